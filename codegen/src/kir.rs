//! The kernel IR: structured loop nests over scalar expressions, the one form every backend consumes
//! (the reference interpreter, Cranelift for the host, PTX for the GPU).
//!
//! A [`Program`] is a sequence of [`Step`]s over numbered buffers: kernels and collective all-reduces.
//! A [`Kernel`] has exactly one outer *parallel* loop (its work items: threads on the GPU, chunks of
//! work for host threads), whose body is sequential statements over typed scalar expressions.
//! Index maps, reductions and the quantization arithmetic (correctly rounded f32, RNE to E4M3/E2M1,
//! nibble packing) are all spelled out in this IR, so the backends contain no quantization logic.

use std::fmt;

/// Scalar types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Ty {
    /// 64-bit integer (indices).
    I64,
    /// 32-bit integer (bits, codes).
    I32,
    /// IEEE single.
    F32,
    /// Truth value.
    Bool,
    /// Four f32 lanes (host backend only).
    F32x4,
    /// Four i32 lanes (host backend only).
    I32x4,
    /// Four lane masks (host backend only).
    Boolx4,
}

impl Ty {
    /// The 4-lane form of a scalar type (vector types map to themselves).
    pub fn x4(self) -> Ty {
        match self {
            Ty::F32 | Ty::F32x4 => Ty::F32x4,
            Ty::I32 | Ty::I32x4 => Ty::I32x4,
            Ty::Bool | Ty::Boolx4 => Ty::Boolx4,
            Ty::I64 => Ty::I64,
        }
    }

    /// Whether this is a vector type.
    pub fn is_vector(self) -> bool {
        matches!(self, Ty::F32x4 | Ty::I32x4 | Ty::Boolx4)
    }
}

/// Element types of buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Elem {
    /// bfloat16 (loads widen exactly to f32; stores truncate, used only for bf16-exact values).
    Bf16,
    /// IEEE single.
    F32,
    /// Byte (loads zero-extend to i32; stores keep the low 8 bits).
    U8,
}

impl Elem {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Elem::Bf16 => 2,
            Elem::F32 => 4,
            Elem::U8 => 1,
        }
    }

    /// The scalar type a load produces.
    pub fn ty(self) -> Ty {
        match self {
            Elem::Bf16 | Elem::F32 => Ty::F32,
            Elem::U8 => Ty::I32,
        }
    }

    /// Name.
    pub fn name(self) -> &'static str {
        match self {
            Elem::Bf16 => "bf16",
            Elem::F32 => "f32",
            Elem::U8 => "u8",
        }
    }
}

/// A buffer index in a [`Program`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufId(pub u32);

/// A local variable of a kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Var(pub u32);

/// Binary operators (operands of one type; comparisons give `Bool`). On vectors they act lane-wise,
/// and a scalar operand of a vector operation is broadcast.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BinOp {
    /// Integer add.
    IAdd,
    /// Integer subtract.
    ISub,
    /// Integer multiply.
    IMul,
    /// Unsigned division (operands non-negative).
    IDiv,
    /// Unsigned remainder (operands non-negative).
    IRem,
    /// Bitwise and.
    And,
    /// Bitwise or.
    Or,
    /// Bitwise exclusive or.
    Xor,
    /// Shift left.
    Shl,
    /// Logical shift right.
    Shr,
    /// Unsigned 32-bit multiply, high word: `(a * b) >> 32` (i32 operands as unsigned). A right shift
    /// by `32 - k` is `MulHi(a, 2^k)`, which the GPU runs on its FMA pipe instead of the ALU's.
    MulHi,
    /// Byte permute (i32): byte `k` of the result is byte `(sel >> 4k) & 7` of the eight bytes of
    /// `b:a` (`a`'s are 0-3), or, where bit 3 of that nibble is set, that byte's top bit copied to all
    /// eight bits: PTX `prmt.b32` in its default mode, one instruction on the GPU.
    Prmt(u16),
    /// f32 add (round to nearest even).
    FAdd,
    /// f32 multiply (RNE).
    FMul,
    /// f32 divide (correctly rounded, never approximate).
    FDiv,
    /// f32 maximum (operands are never NaN here).
    FMax,
    /// f32 minimum.
    FMin,
    /// Signed integer less-than.
    ILt,
    /// Integer equality.
    IEq,
    /// f32 less-than.
    FLt,
    /// f32 less-or-equal.
    FLe,
    /// f32 equality.
    FEq,
}

/// Unary operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UnOp {
    /// |x| (f32).
    FAbs,
    /// Round f32 to the nearest integer value, ties to even (result is f32).
    FRoundEven,
    /// f32 holding an integral value -> i32 (exact).
    F2I,
    /// i32 -> f32 (exact for the small values used).
    I2F,
    /// Reinterpret f32 bits as i32.
    BitsOf,
    /// Reinterpret i32 bits as f32.
    FromBits,
    /// i32 -> i64 (sign-extend).
    Widen,
    /// i64 -> i32 (truncate).
    Narrow,
    /// Boolean -> i32 (0 or 1).
    BoolToI,
    /// f32 -> E4M3 byte (i32 in `0..=255`): round to nearest even, saturating at ±448, the sign kept
    /// for values that round to zero (SPEC §0). One `cvt.rn.satfinite.e4m3x2.f32` on the GPU; backends
    /// without it get the integer sequence of [`crate::quant::soften`].
    E4m3,
    /// E4M3 byte (i32 in `0..=0x7E`) -> its f32 value (exact). Two instructions on the GPU
    /// (`cvt.rn.f16x2.e4m3x2`, then f16 -> f32); the integer sequence of [`crate::quant::soften`]
    /// elsewhere.
    E4m3Decode,
    /// f32 -> E2M1 nibble (i32 in `0..=15`): round to nearest even, saturating at ±6, the sign kept for
    /// values that round to zero. Native on sm_100a (`cvt.rn.satfinite.e2m1x2.f32`); elsewhere the
    /// integer sequence of [`crate::quant::soften`].
    E2m1,
    /// Byte `k` of an i32 (`(a >> 8k) & 255`). The GPU backend stores the four bytes of one word,
    /// stored together in order, as that word.
    Byte(u8),
}

impl UnOp {
    /// The scalar type of the result (lane-wise on vectors).
    pub fn result_ty(self) -> Ty {
        match self {
            UnOp::FAbs | UnOp::FRoundEven | UnOp::I2F | UnOp::FromBits | UnOp::E4m3Decode => {
                Ty::F32
            }
            UnOp::F2I
            | UnOp::BitsOf
            | UnOp::Narrow
            | UnOp::BoolToI
            | UnOp::E4m3
            | UnOp::E2m1
            | UnOp::Byte(_) => Ty::I32,
            UnOp::Widen => Ty::I64,
        }
    }
}

/// The parts of a [`Stmt::GroupRow`].
#[derive(Debug, Clone, PartialEq)]
pub struct GroupRow {
    /// The maximum (f32).
    pub var: Var,
    /// The sub-item (i64).
    pub sub: Var,
    /// Number of sub-items (i64).
    pub count: Expr,
    /// Loads of a sub-item (pure).
    pub load: Vec<Stmt>,
    /// The sub-item's value for the maximum (f32, >= 0).
    pub value: Expr,
    /// Run once between the passes (every thread; stores by thread 0).
    pub mid: Vec<Stmt>,
    /// The second pass's work on a sub-item (after `load`).
    pub body: Vec<Stmt>,
}

/// A scalar expression (a tree).
#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    /// A local variable.
    Var(Var),
    /// An i64 constant.
    I64(i64),
    /// An i32 constant.
    I32(i32),
    /// An f32 constant (by value; printed with its bits).
    F32(f32),
    /// `buf[index]`.
    Load {
        /// Buffer.
        buf: BufId,
        /// Element index (i64).
        index: Box<Expr>,
    },
    /// Binary operation.
    Bin(BinOp, Box<Expr>, Box<Expr>),
    /// Unary operation.
    Un(UnOp, Box<Expr>),
    /// `cond ? a : b` (lane-wise for vectors).
    Select(Box<Expr>, Box<Expr>, Box<Expr>),
    /// `a * b + c` in f32 with one rounding (a fused multiply-add; scalar only).
    Fma(Box<Expr>, Box<Expr>, Box<Expr>),
    /// Four consecutive elements `buf[index..index+4]` as an f32x4 (float buffers) or i32x4 (bytes).
    LoadX4 {
        /// Buffer.
        buf: BufId,
        /// Index of the first element (i64).
        index: Box<Expr>,
    },
    /// The E2M1 nibbles of up to eight f32 values packed into an i32, value `k` in bits `4k..4k+4`
    /// (each as [`UnOp::E2m1`]: round to nearest even, saturating at ±6, the sign kept). `small`
    /// promises `|value| < 7`, where no saturation step is needed; the interpreter refuses a value
    /// outside it, so a plan that claims it wrongly fails its tests. Pairs of native conversions on
    /// sm_100a; elsewhere the sequence of [`crate::quant::soften`].
    PackE2m1 {
        /// The values (1 to 8; scalar f32).
        vals: Vec<Expr>,
        /// Every `|value| < 7`.
        small: bool,
    },
    /// `max |x|` over scalar f32 values (never NaN), one f32. The GPU backend takes values loaded from
    /// bf16 pairs two at a time (`max.xorsign.abs.bf16x2` on the loaded words; exact, as the maximum
    /// of bf16 values is one of them).
    AbsMax(Vec<Expr>),
    /// A scalar broadcast to four lanes.
    Splat(Box<Expr>),
    /// One lane of a vector.
    Lane(Box<Expr>, u8),
}

/// A statement.
#[derive(Debug, Clone, PartialEq)]
pub enum Stmt {
    /// Define or update a local variable.
    Set(Var, Expr),
    /// `for var in start..end { body }` (sequential).
    For {
        /// Loop variable (i64).
        var: Var,
        /// Start (i64).
        start: Expr,
        /// End, exclusive (i64).
        end: Expr,
        /// Body.
        body: Vec<Stmt>,
    },
    /// `if cond { then }`.
    If {
        /// Condition.
        cond: Expr,
        /// Body.
        then: Vec<Stmt>,
    },
    /// `buf[index] = value`.
    Store {
        /// Buffer.
        buf: BufId,
        /// Element index (i64).
        index: Expr,
        /// Value (f32 for float buffers, i32 for bytes).
        value: Expr,
    },
    /// `dst[k] = buf[index + k]` for every k: consecutive elements read at once (a 16-byte vector load
    /// on the GPU). `index` must be aligned to the whole access.
    LoadPacked {
        /// Buffer.
        buf: BufId,
        /// First element.
        index: Expr,
        /// Destinations.
        dst: Vec<Var>,
    },
    /// `buf[index + k] = values[k]` for every k: consecutive elements written at once (a vector store
    /// on the GPU). `index` must be aligned to the whole access.
    StorePacked {
        /// Buffer.
        buf: BufId,
        /// First element.
        index: Expr,
        /// Values.
        values: Vec<Expr>,
    },
    /// `var = max(0, max over sub in 0..count of value)`, `body` run before each `value`: a reduction
    /// shared by the work item's group of threads (a warp or a CTA on the GPU: the threads take `sub`
    /// in turns, then combine by warp shuffles and shared memory, and every thread gets the result). Values are non-negative f32; max is
    /// exact and order-free, so every backend gets the same bits. Only at the top level of a group
    /// kernel's body (never inside a loop, branch or group loop).
    GroupMax {
        /// The result (f32).
        var: Var,
        /// The sub-item (i64).
        sub: Var,
        /// Number of sub-items (i64).
        count: Expr,
        /// Statements run for each sub-item.
        body: Vec<Stmt>,
        /// The sub-item's value (f32, >= 0).
        value: Expr,
    },
    /// A group's two passes over the same sub-items: `var = max(0, max over sub of value)` with `load`
    /// run before each `value` (as [`Stmt::GroupMax`]); then `mid` once; then, for every `sub` again,
    /// `load` and `body` (as [`Stmt::GroupFor`]). Sequentially `load` simply runs twice (its loads are
    /// pure); on the GPU, where every thread makes the same few trips, what `load` defines stays in
    /// registers between the passes, so the data is read from memory once. Top level only.
    GroupRow(GroupRow),
    /// `for var in 0..count { body }` with independent iterations, shared by the work item's group of
    /// threads (lanes take `var` in turns on the GPU, in a loop: for rarely taken paths, whose code
    /// should stay small).
    GroupFor {
        /// Loop variable (i64).
        var: Var,
        /// Trip count (i64).
        count: Expr,
        /// Body.
        body: Vec<Stmt>,
    },
    /// `buf[index] = max(buf[index], value)` atomically, for non-negative f32 (ordered as their bits).
    AtomicMaxF32 {
        /// Buffer (f32).
        buf: BufId,
        /// Element index.
        index: Expr,
        /// Value (f32, >= 0).
        value: Expr,
    },
}

/// One kernel: `for item in 0..items (parallel) { body }`.
#[derive(Debug, Clone, PartialEq)]
pub struct Kernel {
    /// Name (a valid identifier).
    pub name: String,
    /// The parallel loop's variable.
    pub item: Var,
    /// Number of work items.
    pub items: i64,
    /// Body, run once per work item.
    pub body: Vec<Stmt>,
    /// Number of local variables used (`Var(0..vars)`).
    pub vars: u32,
    /// Types of the local variables.
    pub var_types: Vec<Ty>,
    /// Threads per work item: 1, or a whole number of warps for a kernel using
    /// [`Stmt::GroupMax`]/[`Stmt::GroupFor`]: one warp (32: shuffles only) or one CTA (64 to 1024:
    /// shuffles, then shared memory) per item on the GPU, so that an item's data is read from DRAM
    /// once and again from L1/L2 while it is still there; a sequential loop elsewhere. In a group kernel, statements outside the group constructs run on every thread,
    /// and their stores are made by thread 0 only.
    pub group: u32,
    /// A cap on registers per thread for the GPU (`.maxnreg`), trading a few spills for more resident
    /// threads; `None` leaves the choice to the assembler.
    pub maxnreg: Option<u32>,
    /// Keep 64-bit index arithmetic on the GPU even where 32 bits are proven enough (the path of
    /// layers over 2^31 elements, run at small shapes to test it).
    pub wide_index: bool,
}

impl Kernel {
    /// The same kernel run by one thread per item: group constructs become plain loops (what the
    /// interpreter and the host backend run).
    pub fn sequential(&self) -> Kernel {
        let mut k = self.clone();
        k.body = sequential_block(std::mem::take(&mut k.body));
        k.group = 1;
        k
    }
}

/// What [`Stmt::GroupRow`] means, as the constructs it combines: a group maximum over `load`, then
/// `mid`, then a group loop running `load` again and `body`. The sequential form, and the GPU form
/// where the trips are not uniform, are exactly this.
pub fn group_row_passes(g: GroupRow) -> Vec<Stmt> {
    let GroupRow {
        var,
        sub,
        count,
        load,
        value,
        mid,
        body,
    } = g;
    let mut again = load.clone();
    again.extend(body);
    let mut out = vec![Stmt::GroupMax {
        var,
        sub,
        count: count.clone(),
        body: load,
        value,
    }];
    out.extend(mid);
    out.push(Stmt::GroupFor {
        var: sub,
        count,
        body: again,
    });
    out
}

fn sequential_block(body: Vec<Stmt>) -> Vec<Stmt> {
    let mut out = Vec::with_capacity(body.len());
    for st in body {
        match st {
            Stmt::GroupMax {
                var,
                sub,
                count,
                body,
                value,
            } => {
                let mut inner = sequential_block(body);
                inner.push(Stmt::Set(
                    var,
                    Expr::Bin(BinOp::FMax, Box::new(Expr::Var(var)), Box::new(value)),
                ));
                out.push(Stmt::Set(var, Expr::F32(0.0)));
                out.push(Stmt::For {
                    var: sub,
                    start: Expr::I64(0),
                    end: count,
                    body: inner,
                });
            }
            Stmt::GroupRow(g) => out.extend(sequential_block(group_row_passes(g))),
            Stmt::GroupFor { var, count, body } => out.push(Stmt::For {
                var,
                start: Expr::I64(0),
                end: count,
                body: sequential_block(body),
            }),
            Stmt::For {
                var,
                start,
                end,
                body,
            } => out.push(Stmt::For {
                var,
                start,
                end,
                body: sequential_block(body),
            }),
            Stmt::If { cond, then } => out.push(Stmt::If {
                cond,
                then: sequential_block(then),
            }),
            other => out.push(other),
        }
    }
    out
}

impl Program {
    /// Every kernel made [`Kernel::sequential`].
    pub fn sequential(&self) -> Program {
        let mut p = self.clone();
        for s in p.steps.iter_mut() {
            if let Step::Kernel(k) = s {
                if k.group != 1 {
                    *k = k.sequential();
                }
            }
        }
        p
    }
}

/// What a buffer holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BufRole {
    /// A checkpoint tensor, by recipe input name.
    Input(String),
    /// A registered param, by name.
    Param(String),
    /// A temporary.
    Temp(String),
}

/// A buffer of a program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Buf {
    /// Role and name.
    pub role: BufRole,
    /// Element type.
    pub elem: Elem,
    /// Number of elements.
    pub len: usize,
    /// Whether it must be zero-filled before the program runs.
    pub zeroed: bool,
}

impl Buf {
    /// The buffer's name.
    pub fn name(&self) -> &str {
        match &self.role {
            BufRole::Input(n) | BufRole::Param(n) | BufRole::Temp(n) => n,
        }
    }
}

/// A step of a program.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Run a kernel.
    Kernel(Kernel),
    /// MAX all-reduce a buffer of f32 over a process group (identity on one process).
    AllReduceMax {
        /// Buffer.
        buf: BufId,
        /// The group (`tp`, `moe_tp`, `ep`; never `none`, which needs no step).
        group: moeforge_dsl::ir::Group,
    },
}

/// A pack program for one bound recipe.
#[derive(Debug, Clone, PartialEq)]
pub struct Program {
    /// Recipe name.
    pub recipe: String,
    /// Buffers.
    pub bufs: Vec<Buf>,
    /// Steps, in order.
    pub steps: Vec<Step>,
}

impl Program {
    /// Kernels, in order.
    pub fn kernels(&self) -> impl Iterator<Item = &Kernel> {
        self.steps.iter().filter_map(|s| match s {
            Step::Kernel(k) => Some(k),
            _ => None,
        })
    }

    /// A buffer by id.
    pub fn buf(&self, b: BufId) -> Option<&Buf> {
        self.bufs.get(b.0 as usize)
    }
}

// ---- builders ---------------------------------------------------------------------------------

/// Shorthands for building expressions.
pub mod e {
    use super::*;

    /// Variable.
    pub fn v(x: Var) -> Expr {
        Expr::Var(x)
    }
    /// i64 constant.
    pub fn i(x: i64) -> Expr {
        Expr::I64(x)
    }
    /// i32 constant.
    pub fn i32(x: i32) -> Expr {
        Expr::I32(x)
    }
    /// f32 constant.
    pub fn f(x: f32) -> Expr {
        Expr::F32(x)
    }
    /// Binary.
    pub fn bin(op: BinOp, a: Expr, b: Expr) -> Expr {
        Expr::Bin(op, Box::new(a), Box::new(b))
    }
    /// Unary.
    pub fn un(op: UnOp, a: Expr) -> Expr {
        Expr::Un(op, Box::new(a))
    }
    /// Load.
    pub fn load(buf: BufId, index: Expr) -> Expr {
        Expr::Load {
            buf,
            index: Box::new(index),
        }
    }
    /// Four consecutive elements as a vector.
    pub fn load_x4(buf: BufId, index: Expr) -> Expr {
        Expr::LoadX4 {
            buf,
            index: Box::new(index),
        }
    }
    /// Broadcast.
    pub fn splat(a: Expr) -> Expr {
        Expr::Splat(Box::new(a))
    }
    /// Lane `k`.
    pub fn lane(a: Expr, k: u8) -> Expr {
        Expr::Lane(Box::new(a), k)
    }
    /// Select.
    pub fn sel(c: Expr, a: Expr, b: Expr) -> Expr {
        Expr::Select(Box::new(c), Box::new(a), Box::new(b))
    }
    /// `a * b + c` rounded once (f32).
    pub fn fma(a: Expr, b: Expr, c: Expr) -> Expr {
        Expr::Fma(Box::new(a), Box::new(b), Box::new(c))
    }
    /// a + b (i64), folding constants.
    pub fn add(a: Expr, b: Expr) -> Expr {
        match (&a, &b) {
            (Expr::I64(0), _) => b,
            (_, Expr::I64(0)) => a,
            (Expr::I64(x), Expr::I64(y)) => Expr::I64(x + y),
            _ => bin(BinOp::IAdd, a, b),
        }
    }
    /// a * b (i64), folding constants.
    pub fn mul(a: Expr, b: Expr) -> Expr {
        match (&a, &b) {
            (Expr::I64(0), _) | (_, Expr::I64(0)) => Expr::I64(0),
            (Expr::I64(1), _) => b,
            (_, Expr::I64(1)) => a,
            (Expr::I64(x), Expr::I64(y)) => Expr::I64(x * y),
            _ => bin(BinOp::IMul, a, b),
        }
    }
    /// a / k (i64, non-negative).
    pub fn div(a: Expr, k: i64) -> Expr {
        if k == 1 {
            a
        } else {
            bin(BinOp::IDiv, a, Expr::I64(k))
        }
    }
    /// a % k (i64, non-negative).
    pub fn rem(a: Expr, k: i64) -> Expr {
        bin(BinOp::IRem, a, Expr::I64(k))
    }
}

/// Allocates local variables while a kernel is built.
#[derive(Debug, Default)]
pub struct VarAlloc {
    types: Vec<Ty>,
}

impl VarAlloc {
    /// A new variable of a type.
    pub fn new_var(&mut self, ty: Ty) -> Var {
        self.types.push(ty);
        Var(self.types.len() as u32 - 1)
    }

    /// An allocator continuing a kernel's variables (for passes that add variables).
    pub fn continuing(types: Vec<Ty>) -> VarAlloc {
        VarAlloc { types }
    }

    /// The number of variables and their types.
    pub fn into_parts(self) -> (u32, Vec<Ty>) {
        (self.types.len() as u32, self.types)
    }

    /// Finish a kernel.
    pub fn kernel(self, name: String, item: Var, items: i64, body: Vec<Stmt>) -> Kernel {
        Kernel {
            name,
            item,
            items,
            body,
            vars: self.types.len() as u32,
            var_types: self.types,
            group: 1,
            maxnreg: None,
            wide_index: false,
        }
    }
}

// ---- printing (deterministic; the IR dump and part of cache keys) -----------------------------

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expr::Var(v) => write!(f, "%{}", v.0),
            Expr::I64(x) => write!(f, "{x}"),
            Expr::I32(x) => write!(f, "{x}i32"),
            Expr::F32(x) => write!(f, "{x:?}f32"),
            Expr::Load { buf, index } => write!(f, "b{}[{index}]", buf.0),
            Expr::Bin(op, a, b) => write!(f, "{op:?}({a}, {b})"),
            Expr::Un(op, a) => write!(f, "{op:?}({a})"),
            Expr::Select(c, a, b) => write!(f, "select({c}, {a}, {b})"),
            Expr::Fma(a, b, c) => write!(f, "fma({a}, {b}, {c})"),
            Expr::LoadX4 { buf, index } => write!(f, "b{}[{index}..+4]", buf.0),
            Expr::PackE2m1 { vals, small } => {
                let v: Vec<String> = vals.iter().map(|x| x.to_string()).collect();
                let tag = if *small { "_small" } else { "" };
                write!(f, "pack_e2m1{tag}({})", v.join(", "))
            }
            Expr::AbsMax(vals) => {
                let v: Vec<String> = vals.iter().map(|x| x.to_string()).collect();
                write!(f, "absmax({})", v.join(", "))
            }
            Expr::Splat(a) => write!(f, "splat({a})"),
            Expr::Lane(a, k) => write!(f, "lane({a}, {k})"),
        }
    }
}

fn write_block(f: &mut fmt::Formatter<'_>, body: &[Stmt], depth: usize) -> fmt::Result {
    let pad = "  ".repeat(depth);
    for s in body {
        match s {
            Stmt::Set(v, x) => writeln!(f, "{pad}%{} = {x}", v.0)?,
            Stmt::For {
                var,
                start,
                end,
                body,
            } => {
                writeln!(f, "{pad}for %{} in {start}..{end} {{", var.0)?;
                write_block(f, body, depth + 1)?;
                writeln!(f, "{pad}}}")?;
            }
            Stmt::If { cond, then } => {
                writeln!(f, "{pad}if {cond} {{")?;
                write_block(f, then, depth + 1)?;
                writeln!(f, "{pad}}}")?;
            }
            Stmt::Store { buf, index, value } => writeln!(f, "{pad}b{}[{index}] = {value}", buf.0)?,
            Stmt::AtomicMaxF32 { buf, index, value } => {
                writeln!(f, "{pad}atomic_max b{}[{index}], {value}", buf.0)?
            }
            Stmt::GroupMax {
                var,
                sub,
                count,
                body,
                value,
            } => {
                writeln!(f, "{pad}%{} = group_max %{} in 0..{count} {{", var.0, sub.0)?;
                write_block(f, body, depth + 1)?;
                writeln!(f, "{pad}  yield {value}")?;
                writeln!(f, "{pad}}}")?;
            }
            Stmt::GroupRow(GroupRow {
                var,
                sub,
                count,
                load,
                value,
                mid,
                body,
            }) => {
                writeln!(f, "{pad}%{} = group_row %{} in 0..{count} {{", var.0, sub.0)?;
                write_block(f, load, depth + 1)?;
                writeln!(f, "{pad}  yield {value}")?;
                writeln!(f, "{pad}}} then {{")?;
                write_block(f, mid, depth + 1)?;
                writeln!(f, "{pad}}} again {{")?;
                write_block(f, body, depth + 1)?;
                writeln!(f, "{pad}}}")?;
            }
            Stmt::GroupFor { var, count, body } => {
                writeln!(f, "{pad}group_for %{} in 0..{count} {{", var.0)?;
                write_block(f, body, depth + 1)?;
                writeln!(f, "{pad}}}")?;
            }
            Stmt::LoadPacked { buf, index, dst } => {
                let d: Vec<String> = dst.iter().map(|v| format!("%{}", v.0)).collect();
                writeln!(
                    f,
                    "{pad}{} = b{}[{index}..+{}]",
                    d.join(", "),
                    buf.0,
                    dst.len()
                )?
            }
            Stmt::StorePacked { buf, index, values } => {
                let v: Vec<String> = values.iter().map(|x| x.to_string()).collect();
                writeln!(
                    f,
                    "{pad}b{}[{index}..+{}] = [{}]",
                    buf.0,
                    values.len(),
                    v.join(", ")
                )?
            }
        }
    }
    Ok(())
}

impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut group = if self.group == 1 {
            String::new()
        } else {
            format!(" group {}", self.group)
        };
        if let Some(n) = self.maxnreg {
            group.push_str(&format!(" maxnreg {n}"));
        }
        if self.wide_index {
            group.push_str(" wide_index");
        }
        writeln!(
            f,
            "kernel {} parallel %{} in 0..{}{group} {{",
            self.name, self.item.0, self.items
        )?;
        write_block(f, &self.body, 1)?;
        writeln!(f, "}}")
    }
}

impl fmt::Display for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "program {}", self.recipe)?;
        for (k, b) in self.bufs.iter().enumerate() {
            let role = match &b.role {
                BufRole::Input(_) => "input",
                BufRole::Param(_) => "param",
                BufRole::Temp(_) => "temp",
            };
            writeln!(
                f,
                "  b{k}: {role} {} {}[{}]{}",
                b.name(),
                b.elem.name(),
                b.len,
                if b.zeroed { " zeroed" } else { "" }
            )?;
        }
        for s in &self.steps {
            match s {
                Step::Kernel(k) => write!(f, "{k}")?,
                Step::AllReduceMax { buf, group } => {
                    writeln!(f, "all_reduce_max b{} over {}", buf.0, group.name())?
                }
            }
        }
        Ok(())
    }
}
