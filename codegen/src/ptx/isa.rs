//! The typed PTX layer: virtual registers by class ([`RegClass`], [`Reg`]), operands, type suffixes
//! ([`PtxTy`]), typed opcodes and modifiers ([`BinOpcode`], [`UnOpcode`], [`CmpOp`], [`Rnd`],
//! [`SpecialReg`]), the instruction enum [`Inst`] whose `Display` is one line of PTX, and the
//! [`Builder`] that numbers registers and labels. Nothing here knows the kernel IR: lowering it is
//! `lower`'s business, and kernel entries' parameters are `entry`'s.

use std::fmt::{self, Write as _};

use super::asyncops::{AsyncOp, Guard, SharedDecl};

/// The PTX ISA version emitted (accepted by ptxas 13.0 for both targets).
pub const PTX_VERSION: &str = "8.7";

/// Register classes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RegClass {
    /// Predicate.
    Pred,
    /// 32-bit integer / bits.
    B32,
    /// 64-bit integer.
    B64,
    /// f32.
    F32,
}

impl RegClass {
    fn prefix(self) -> &'static str {
        match self {
            RegClass::Pred => "p",
            RegClass::B32 => "r",
            RegClass::B64 => "rd",
            RegClass::F32 => "f",
        }
    }

    fn decl(self) -> &'static str {
        match self {
            RegClass::Pred => ".pred",
            RegClass::B32 => ".b32",
            RegClass::B64 => ".b64",
            RegClass::F32 => ".f32",
        }
    }
}

/// A virtual register.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Reg {
    /// Class.
    pub class: RegClass,
    /// Number within the class.
    pub n: u32,
}

impl fmt::Display for Reg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}{}", self.class.prefix(), self.n)
    }
}

/// An operand: a register or an immediate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Operand {
    /// Register.
    Reg(Reg),
    /// Integer immediate.
    Int(i64),
    /// f32 immediate (printed as `0fXXXXXXXX`, exact).
    F32(f32),
}

impl fmt::Display for Operand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Operand::Reg(r) => write!(f, "{r}"),
            Operand::Int(i) => write!(f, "{i}"),
            Operand::F32(x) => write!(f, "0f{:08X}", x.to_bits()),
        }
    }
}

/// A PTX instruction type suffix (printed with its leading dot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PtxTy {
    /// `.pred`
    Pred,
    /// `.s64`
    S64,
    /// `.u64`
    U64,
    /// `.b64`
    B64,
    /// `.s32`
    S32,
    /// `.u32`
    U32,
    /// `.b32`
    B32,
    /// `.f32`
    F32,
    /// `.u16`
    U16,
    /// `.u8`
    U8,
    /// `.bf16x2`
    Bf16x2,
}

impl fmt::Display for PtxTy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PtxTy::Pred => ".pred",
            PtxTy::S64 => ".s64",
            PtxTy::U64 => ".u64",
            PtxTy::B64 => ".b64",
            PtxTy::S32 => ".s32",
            PtxTy::U32 => ".u32",
            PtxTy::B32 => ".b32",
            PtxTy::F32 => ".f32",
            PtxTy::U16 => ".u16",
            PtxTy::U8 => ".u8",
            PtxTy::Bf16x2 => ".bf16x2",
        })
    }
}

/// A rounding modifier (printed with its leading dot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rnd {
    /// `.rn`: to nearest, ties to even (a float result).
    Rn,
    /// `.rni`: to the nearest integer, ties to even (an integral float or integer result).
    Rni,
    /// `.rzi`: to the integer towards zero.
    Rzi,
}

impl fmt::Display for Rnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Rnd::Rn => ".rn",
            Rnd::Rni => ".rni",
            Rnd::Rzi => ".rzi",
        })
    }
}

/// The opcode of a two-operand instruction ([`Inst::Bin`]), with its modifiers and without its type
/// suffix, which [`Inst::Bin`] carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinOpcode {
    /// `add` (integer, wrapping).
    Add,
    /// `sub` (integer, wrapping).
    Sub,
    /// `mul.lo`: the low half of the product.
    MulLo,
    /// `mul.hi`: the high half of the product.
    MulHi,
    /// `mul.wide`: the whole product, twice the operands' width.
    MulWide,
    /// `div` (integer).
    Div,
    /// `rem` (integer).
    Rem,
    /// `and`.
    And,
    /// `or`.
    Or,
    /// `xor`.
    Xor,
    /// `shl`.
    Shl,
    /// `shr` (logical for unsigned and bits types, arithmetic for signed ones).
    Shr,
    /// `min`.
    Min,
    /// `max`.
    Max,
    /// `max.xorsign.abs`: the larger magnitude, with the XOR of the operands' signs.
    MaxXorsignAbs,
    /// `add.rn` (float, correctly rounded).
    AddRn,
    /// `mul.rn` (float, correctly rounded).
    MulRn,
    /// `div.rn` (float, correctly rounded).
    DivRn,
    /// `cvt.rn.bf16x2` (with type `.f32`: `cvt.rn.bf16x2.f32 d, a, b` packs `a` rounded into the
    /// high half of `d` and `b` into the low half).
    CvtRnBf16x2,
}

impl fmt::Display for BinOpcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BinOpcode::Add => "add",
            BinOpcode::Sub => "sub",
            BinOpcode::MulLo => "mul.lo",
            BinOpcode::MulHi => "mul.hi",
            BinOpcode::MulWide => "mul.wide",
            BinOpcode::Div => "div",
            BinOpcode::Rem => "rem",
            BinOpcode::And => "and",
            BinOpcode::Or => "or",
            BinOpcode::Xor => "xor",
            BinOpcode::Shl => "shl",
            BinOpcode::Shr => "shr",
            BinOpcode::Min => "min",
            BinOpcode::Max => "max",
            BinOpcode::MaxXorsignAbs => "max.xorsign.abs",
            BinOpcode::AddRn => "add.rn",
            BinOpcode::MulRn => "mul.rn",
            BinOpcode::DivRn => "div.rn",
            BinOpcode::CvtRnBf16x2 => "cvt.rn.bf16x2",
        })
    }
}

/// The opcode of a one-operand instruction ([`Inst::Un`]), with its modifiers and types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnOpcode {
    /// `mov.ty`.
    Mov(PtxTy),
    /// `abs.ty`.
    Abs(PtxTy),
    /// `rcp.rn.ty`: the correctly rounded reciprocal (IEEE `1 / a`, subnormals kept).
    RcpRn(PtxTy),
    /// `rcp.approx.ty`: `1 / a`, approximate (at most 1 ulp over the whole range, subnormals
    /// kept); `1 / inf = +0`.
    RcpApprox(PtxTy),
    /// `popc.b32`: the number of set bits (the result is `.u32`).
    Popc,
    /// `ex2.approx.ftz.ty`: `2^a`, approximate (at most 2 ulp of relative error over the whole
    /// range), subnormal inputs and results flushed to zero; `+inf` past the f32 range, `+0` below
    /// it.
    Ex2ApproxFtz(PtxTy),
    /// `cvt[.rnd].to.from`.
    Cvt {
        /// Rounding (none for conversions between integers that round nothing).
        rnd: Option<Rnd>,
        /// Destination type.
        to: PtxTy,
        /// Source type.
        from: PtxTy,
    },
}

impl UnOpcode {
    /// `cvt.to.from`: a conversion that rounds nothing (between integers, or a float widened).
    pub const fn cvt(to: PtxTy, from: PtxTy) -> UnOpcode {
        UnOpcode::Cvt {
            rnd: None,
            to,
            from,
        }
    }

    /// `cvt.rnd.to.from`: a rounding conversion.
    pub const fn cvt_rnd(rnd: Rnd, to: PtxTy, from: PtxTy) -> UnOpcode {
        UnOpcode::Cvt {
            rnd: Some(rnd),
            to,
            from,
        }
    }
}

impl fmt::Display for UnOpcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UnOpcode::Mov(ty) => write!(f, "mov{ty}"),
            UnOpcode::Abs(ty) => write!(f, "abs{ty}"),
            UnOpcode::RcpRn(ty) => write!(f, "rcp.rn{ty}"),
            UnOpcode::RcpApprox(ty) => write!(f, "rcp.approx{ty}"),
            UnOpcode::Ex2ApproxFtz(ty) => write!(f, "ex2.approx.ftz{ty}"),
            UnOpcode::Popc => f.write_str("popc.b32"),
            UnOpcode::Cvt {
                rnd: None,
                to,
                from,
            } => write!(f, "cvt{to}{from}"),
            UnOpcode::Cvt {
                rnd: Some(rnd),
                to,
                from,
            } => write!(f, "cvt{rnd}{to}{from}"),
        }
    }
}

/// A comparison of `setp` (printed with its leading dot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmpOp {
    /// `.lt`
    Lt,
    /// `.le`
    Le,
    /// `.eq`
    Eq,
    /// `.ne`
    Ne,
    /// `.ge`
    Ge,
}

impl fmt::Display for CmpOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CmpOp::Lt => ".lt",
            CmpOp::Le => ".le",
            CmpOp::Eq => ".eq",
            CmpOp::Ne => ".ne",
            CmpOp::Ge => ".ge",
        })
    }
}

/// A special register read by [`Inst::Special`] (printed with its `%`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecialReg {
    /// `%tid.x`: the thread's index in its CTA.
    TidX,
    /// `%ntid.x`: threads per CTA.
    NtidX,
    /// `%ctaid.x`: the CTA's index in the grid.
    CtaidX,
    /// `%nctaid.x`: CTAs in the grid.
    NctaidX,
    /// `%ctaid.y`: the CTA's index along the grid's y dimension.
    CtaidY,
}

impl fmt::Display for SpecialReg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SpecialReg::TidX => "%tid.x",
            SpecialReg::NtidX => "%ntid.x",
            SpecialReg::CtaidX => "%ctaid.x",
            SpecialReg::NctaidX => "%nctaid.x",
            SpecialReg::CtaidY => "%ctaid.y",
        })
    }
}

/// Typed PTX instructions (the subset the kernel IR needs).
#[derive(Debug, Clone, PartialEq)]
pub enum Inst {
    /// `op.ty d, a, b` for integer and float arithmetic and logic.
    Bin {
        /// Opcode with modifiers.
        op: BinOpcode,
        /// Type.
        ty: PtxTy,
        /// Destination.
        d: Reg,
        /// First operand.
        a: Operand,
        /// Second operand.
        b: Operand,
    },
    /// `op d, a` for `mov`, `abs` and conversions (the opcode carries its types).
    Un {
        /// Opcode with modifiers and types.
        op: UnOpcode,
        /// Destination.
        d: Reg,
        /// Operand.
        a: Operand,
    },
    /// `setp.cmp.ty p, a, b`.
    Setp {
        /// Comparison.
        cmp: CmpOp,
        /// Type.
        ty: PtxTy,
        /// Destination predicate.
        p: Reg,
        /// First operand.
        a: Operand,
        /// Second operand.
        b: Operand,
    },
    /// `selp.ty d, a, b, p`.
    Selp {
        /// Type.
        ty: PtxTy,
        /// Destination.
        d: Reg,
        /// Value when `p`.
        a: Operand,
        /// Value otherwise.
        b: Operand,
        /// Predicate.
        p: Reg,
    },
    /// `ld.global.ty d, [addr]`.
    Ld {
        /// Type.
        ty: PtxTy,
        /// Destination.
        d: Reg,
        /// Address register (64-bit).
        addr: Reg,
    },
    /// `st.global.ty [addr], v`.
    St {
        /// Type.
        ty: PtxTy,
        /// Address register.
        addr: Reg,
        /// Value register.
        v: Reg,
    },
    /// `@p st.global.v2.ty [addr+off], {lo, hi}`: two adjacent 32-bit values (8 aligned bytes,
    /// `ty` `.f32` or `.b32`) in one masked store.
    StGuardedV2 {
        /// The predicate.
        pred: Reg,
        /// Element type (32-bit).
        ty: PtxTy,
        /// Address register (64-bit, `addr + off` a multiple of 8).
        addr: Reg,
        /// Byte offset.
        off: i64,
        /// The value at `addr + off`.
        lo: Reg,
        /// The value 4 bytes further.
        hi: Reg,
    },
    /// `ld.global.v2.f32 {lo, hi}, [addr]`: two adjacent f32 (8 aligned bytes).
    LdV2F32 {
        /// The value at `addr`.
        lo: Reg,
        /// The value 4 bytes further.
        hi: Reg,
        /// Address register (64-bit, a multiple of 8).
        addr: Reg,
    },
    /// `@p st.global.ty [addr+off], v` (`@!p` when `negate`): a store masked by a predicate, at a
    /// constant byte offset from the address register.
    StGuarded {
        /// The predicate.
        pred: Reg,
        /// Store where the predicate is false instead.
        negate: bool,
        /// Type.
        ty: PtxTy,
        /// Address register (64-bit).
        addr: Reg,
        /// Byte offset.
        off: i64,
        /// Value register.
        v: Reg,
    },
    /// `ld.global[.nc][.vN].b32 {words}, [addr]`: 4, 8 or 16 bytes at once.
    LdV {
        /// Through the read-only (non-coherent) path: the buffer is a checkpoint input, never
        /// written while the program runs (which also lets ptxas move these loads past stores).
        nc: bool,
        /// Destination words (1, 2 or 4).
        words: Vec<Reg>,
        /// Address (aligned to the access).
        addr: Reg,
    },
    /// `st.global[.vN].b32 [addr], {words}`.
    StV {
        /// Source words (1, 2 or 4).
        words: Vec<Reg>,
        /// Address (aligned to the access).
        addr: Reg,
    },
    /// `d` = the E2M1 nibbles of `vals` (1 to 8; value k in bits 4k..4k+4): pairs of
    /// `cvt.rn.satfinite.e2m1x2.f32` (0 for a missing value) and byte permutes, in a scoped block.
    CvtE2m1Pack {
        /// Destination (32-bit).
        d: Reg,
        /// Operands (f32).
        vals: Vec<Reg>,
    },
    /// `d = e4m3(a)` or `d = e2m1(a)` (RNE, saturating, in the low bits of a 32-bit register): one
    /// `cvt.rn.satfinite.{e4m3x2,e2m1x2}.f32` with 0 as the other element, in a scoped block.
    CvtNarrow {
        /// E2M1 (else E4M3).
        e2m1: bool,
        /// Destination (32-bit).
        d: Reg,
        /// Operand (f32).
        a: Reg,
    },
    /// `d` = the E4M3 bytes of `vals` (value k in byte k; RNE, saturating to ±448): two
    /// `cvt.rn.satfinite.e4m3x2.f32` and one `mov.b32` packing their halves, in a scoped block.
    CvtE4m3Pack {
        /// Destination (32-bit).
        d: Reg,
        /// Operands (f32), byte 0 first.
        vals: [Reg; 4],
    },
    /// `d` = one 16-bit half of `a` in both halves (`high`: bits 31..16, else 15..0): `mov.b32`
    /// unpacking `a` into two `.b16` and packing one of them twice, in a scoped block. The same
    /// bits as `prmt.b32 d, a, a, 0x3232 / 0x1010`, but ptxas folds it into the consumer's
    /// operand (an `HMUL2 ... R.H0_H0` / `.H1_H1` half selector) instead of issuing a `PRMT`.
    HalfBroadcast {
        /// Destination (32-bit).
        d: Reg,
        /// Operand (32-bit).
        a: Reg,
        /// Which half: the high one (bits 31..16), else the low.
        high: bool,
    },
    /// `prmt.b32 d, a, b, sel` (byte permute: bytes 0-3 of `a`, 4-7 of `b`).
    Prmt {
        /// Destination.
        d: Reg,
        /// Bytes 0-3.
        a: Reg,
        /// Bytes 4-7.
        b: Reg,
        /// Selector (one nibble per destination byte).
        sel: i64,
    },
    /// `lop3.b32 d, a, b, c, lut`: any bitwise function of three inputs, `lut` its truth table
    /// (the function applied to `0xF0`, `0xCC`, `0xAA`); two of the inputs may be constants, so
    /// that a mask-and-merge with two constants is one instruction.
    Lop3 {
        /// Destination.
        d: Reg,
        /// First input (register).
        a: Reg,
        /// Second input.
        b: Operand,
        /// Third input.
        c: Operand,
        /// Truth table.
        lut: u8,
    },
    /// `prmt.b32 d, a, b, sel` with the selector in a register (a per-thread byte choice).
    PrmtR {
        /// Destination.
        d: Reg,
        /// Bytes 0-3.
        a: Reg,
        /// Bytes 4-7.
        b: Reg,
        /// Selector register (one nibble per destination byte).
        sel: Reg,
    },
    /// `ld.shared.v2.b32 {d0, d1}, [addr+off]` (8 aligned bytes).
    LdSharedV2 {
        /// Destinations (32-bit), the lowest address first.
        d: [Reg; 2],
        /// Shared-memory address (32-bit).
        addr: Reg,
        /// Byte offset.
        off: i64,
    },
    /// `ld.shared.v4.b32 {d0, d1, d2, d3}, [addr+off]` (16 aligned bytes).
    LdSharedV4 {
        /// Destinations (32-bit), the lowest address first.
        d: [Reg; 4],
        /// Shared-memory address (32-bit).
        addr: Reg,
        /// Byte offset.
        off: i64,
    },
    /// `fma.rn.f32 d, a, b, c`.
    Fma {
        /// Destination.
        d: Reg,
        /// Multiplicand.
        a: Reg,
        /// Multiplier.
        b: Reg,
        /// Addend.
        c: Reg,
    },
    /// `bar.sync 0` (the whole CTA).
    BarSync,
    /// `st.shared.f32 [addr], v`.
    StShared {
        /// Shared-memory address (32-bit).
        addr: Reg,
        /// Value (f32).
        v: Reg,
    },
    /// `ld.shared.f32 d, [addr+off]`.
    LdShared {
        /// Destination (f32).
        d: Reg,
        /// Shared-memory address (32-bit).
        addr: Reg,
        /// Byte offset.
        off: i64,
    },
    /// `mov.u32 d, symbol` (the address of a shared variable).
    MovSym {
        /// Destination.
        d: Reg,
        /// Symbol.
        sym: String,
    },
    /// `shfl.sync.bfly.b32 d, a, lanemask, 0x1f, 0xffffffff` (the whole warp, converged).
    ShflBfly {
        /// Destination.
        d: Reg,
        /// Value.
        a: Reg,
        /// Lane mask (XOR distance).
        mask: i64,
    },
    /// `d = f32(e4m3 byte in a)`: `cvt.rn.f16x2.e4m3x2`, then the low half to f32, in a scoped
    /// block.
    CvtFromE4m3 {
        /// Destination (f32).
        d: Reg,
        /// The byte (low 8 bits of a 32-bit register, the rest zero).
        a: Reg,
    },
    /// `atom.acq_rel.gpu.global.add.u32 d, [addr], v`: a GPU-scope acquire-release add that
    /// returns the old value (split-K's arrival counter).
    AtomAddAcqRelU32 {
        /// The old value.
        d: Reg,
        /// Address (64-bit generic address of global memory).
        addr: Reg,
        /// Addend.
        v: Operand,
    },
    /// `fence.acq_rel.gpu`.
    FenceAcqRelGpu,
    /// `bar.warp.sync -1`: the whole warp converges, and its lanes' memory accesses before it
    /// are ordered before those after it (so one lane's release covers the warp's reads).
    BarWarpSync,
    /// `ld.global.cg.f32 d, [addr+off]`: a load cached in L2 only (data other CTAs wrote during
    /// this kernel, never a stale L1 line).
    LdGlobalCgF32 {
        /// Destination.
        d: Reg,
        /// Address.
        addr: Reg,
        /// Byte offset.
        off: i64,
    },
    /// `ld.global.cg.v4.f32 {d}, [addr+off]`: four adjacent f32 (16 aligned bytes) cached in L2
    /// only (data other CTAs wrote during this kernel, never a stale L1 line).
    LdGlobalCgV4F32 {
        /// Destinations, in address order.
        d: [Reg; 4],
        /// Address.
        addr: Reg,
        /// Byte offset (`addr + off` a multiple of 16).
        off: i64,
    },
    /// `red.global.max.u32 [addr], v`.
    RedMaxU32 {
        /// Address.
        addr: Reg,
        /// Value.
        v: Reg,
    },
    /// `ld.param.ty d, [name]` (a kernel parameter's value).
    LdParam {
        /// Type (`.u64` for a pointer).
        ty: PtxTy,
        /// Destination.
        d: Reg,
        /// Parameter name.
        name: String,
    },
    /// `cvta.to.global.u64 d, a`.
    Cvta {
        /// Destination.
        d: Reg,
        /// Generic address.
        a: Reg,
    },
    /// `mov.u32 d, %special`.
    Special {
        /// Destination.
        d: Reg,
        /// The special register.
        name: SpecialReg,
    },
    /// `mul.wide.u32 d, a, b`.
    MulWide {
        /// Destination (64-bit).
        d: Reg,
        /// First.
        a: Reg,
        /// Second.
        b: Reg,
    },
    /// `[@p] bra label` (`@!p` when `negate`).
    Bra {
        /// Label.
        label: String,
        /// Guard.
        pred: Option<(Reg, bool)>,
    },
    /// `label:`.
    Label(String),
    /// `ret`.
    Ret,
    /// `atom.global.add.u32 d, [addr], v`: a relaxed GPU-scope add that returns the old value
    /// (a slot's cursor in the MoE permute).
    AtomAddU32 {
        /// The old value.
        d: Reg,
        /// Address (64-bit, global).
        addr: Reg,
        /// Addend.
        v: Operand,
    },
    /// `red.global.add.u32 [addr], v`: a relaxed add whose old value is not needed (counters).
    RedAddU32 {
        /// Address (64-bit, global).
        addr: Reg,
        /// Addend.
        v: Operand,
    },
    /// `red.shared.add.u32 [addr], v`: a shared-memory counter (the small permute's per-slot
    /// counts).
    RedSharedAddU32 {
        /// Shared-memory address (32-bit).
        addr: Reg,
        /// Addend.
        v: Operand,
    },
    /// `shfl.sync.up.b32 d, a, delta, 0, -1`: lane `i` gets lane `i - delta`'s `a`, lanes below
    /// `delta` their own (the whole warp, converged; the step of an inclusive scan).
    ShflUp {
        /// Destination.
        d: Reg,
        /// Value.
        a: Reg,
        /// Distance (1 to 31).
        delta: i64,
    },
    /// `shfl.sync.idx.b32 d, a, lane, 31, -1`: every lane gets lane `lane`'s `a` (a broadcast;
    /// the whole warp, converged).
    ShflIdx {
        /// Destination.
        d: Reg,
        /// Value.
        a: Reg,
        /// Source lane (0 to 31): an immediate, or a register (the same lane for every thread
        /// where it is warp-uniform).
        lane: Operand,
    },
    /// `griddepcontrol.wait`: wait until the grids this one depends on programmatically have
    /// completed and their memory is visible (a no-op for a grid launched without that
    /// dependency). Nothing before it may touch global memory another kernel writes or reads.
    GridDepWait,
    /// `vote.sync.ballot.b32 d, p, -1`: bit `i` of `d` is lane `i`'s predicate (the whole warp,
    /// converged).
    Ballot {
        /// Destination (32-bit).
        d: Reg,
        /// The predicate.
        p: Reg,
    },
    /// `vote.sync.any.pred d, p, -1`: whether any lane's predicate is set (the whole warp,
    /// converged). The result is warp-uniform by construction, which ptxas sees (a branch on it
    /// keeps the code after it on the uniform datapath).
    VoteAny {
        /// Destination predicate.
        d: Reg,
        /// The predicate.
        p: Reg,
    },
    /// `st.shared.u32 [addr+off], v`.
    StSharedU32 {
        /// Shared-memory address (32-bit).
        addr: Reg,
        /// Byte offset.
        off: i64,
        /// Value (32-bit).
        v: Reg,
    },
    /// `ld.shared.u8` or `ld.shared.u16 d, [addr+off]` (`bytes` 1 or 2), zero-extended into a
    /// 32-bit register.
    LdSharedNarrow {
        /// Destination (32-bit).
        d: Reg,
        /// Shared-memory address (32-bit).
        addr: Reg,
        /// Byte offset.
        off: i64,
        /// Bytes loaded: 1 or 2 (any other value loads 2).
        bytes: u8,
    },
    /// `ld.shared.u32 d, [addr+off]`.
    LdSharedU32 {
        /// Destination (32-bit).
        d: Reg,
        /// Shared-memory address (32-bit).
        addr: Reg,
        /// Byte offset.
        off: i64,
    },
    /// `[@p] op`: one of Hopper's asynchronous, barrier and tensor-core instructions
    /// ([`AsyncOp`]), optionally guarded by a predicate.
    Async {
        /// Guard.
        guard: Option<Guard>,
        /// The instruction.
        op: AsyncOp,
    },
}

impl fmt::Display for Inst {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Inst::Bin { op, ty, d, a, b } => write!(f, "\t{op}{ty} \t{d}, {a}, {b};"),
            Inst::Un { op, d, a } => write!(f, "\t{op} \t{d}, {a};"),
            Inst::Setp { cmp, ty, p, a, b } => write!(f, "\tsetp{cmp}{ty} \t{p}, {a}, {b};"),
            Inst::Selp { ty, d, a, b, p } => write!(f, "\tselp{ty} \t{d}, {a}, {b}, {p};"),
            Inst::Ld { ty, d, addr } => write!(f, "\tld.global{ty} \t{d}, [{addr}];"),
            Inst::St { ty, addr, v } => write!(f, "\tst.global{ty} \t[{addr}], {v};"),
            Inst::StGuardedV2 {
                pred,
                ty,
                addr,
                off,
                lo,
                hi,
            } => write!(
                f,
                "\t@{pred} st.global.v2{ty} \t[{addr}+{off}], {{{lo}, {hi}}};"
            ),
            Inst::LdV2F32 { lo, hi, addr } => {
                write!(f, "\tld.global.v2.f32 \t{{{lo}, {hi}}}, [{addr}];")
            }
            Inst::StGuarded {
                pred,
                negate,
                ty,
                addr,
                off,
                v,
            } => {
                let bang = if *negate { "!" } else { "" };
                write!(f, "\t@{bang}{pred} st.global{ty} \t[{addr}+{off}], {v};")
            }
            Inst::CvtNarrow { e2m1: false, d, a } => write!(
                f,
                "\t{{ .reg .b16 %cvt; cvt.rn.satfinite.e4m3x2.f32 %cvt, 0f00000000, {a}; cvt.u32.u16 {d}, %cvt; }}"
            ),
            Inst::CvtNarrow { e2m1: true, d, a } => write!(
                f,
                "\t{{ .reg .b8 %cvt; cvt.rn.satfinite.e2m1x2.f32 %cvt, 0f00000000, {a}; cvt.u32.u8 {d}, %cvt; }}"
            ),
            Inst::CvtE2m1Pack { d, vals } => {
                write!(f, "\t{{ .reg .b8 %c<4>; .reg .b32 %w<4>;")?;
                let v = |k: usize| vals.get(k).map_or("0f00000000".to_string(), |r| r.to_string());
                for k in 0..4 {
                    write!(
                        f,
                        " cvt.rn.satfinite.e2m1x2.f32 %c{k}, {}, {}; cvt.u32.u8 %w{k}, %c{k};",
                        v(2 * k + 1),
                        v(2 * k)
                    )?;
                }
                write!(
                    f,
                    " prmt.b32 %w0, %w0, %w1, 0x0040; prmt.b32 %w2, %w2, %w3, 0x0040; prmt.b32 {d}, %w0, %w2, 0x5410; }}"
                )
            }
            Inst::CvtE4m3Pack { d, vals: [v0, v1, v2, v3] } => write!(
                f,
                "\t{{ .reg .b16 %e<2>; cvt.rn.satfinite.e4m3x2.f32 %e0, {v1}, {v0}; cvt.rn.satfinite.e4m3x2.f32 %e1, {v3}, {v2}; mov.b32 {d}, {{%e0, %e1}}; }}"
            ),
            Inst::BarSync => write!(f, "\tbar.sync \t0;"),
            Inst::Fma { d, a, b, c } => write!(f, "\tfma.rn.f32 \t{d}, {a}, {b}, {c};"),
            Inst::HalfBroadcast { d, a, high } => {
                let h = if *high { "%hb1" } else { "%hb0" };
                write!(
                    f,
                    "\t{{ .reg .b16 %hb<2>; mov.b32 {{%hb0, %hb1}}, {a}; mov.b32 {d}, {{{h}, {h}}}; }}"
                )
            }
            Inst::Prmt { d, a, b, sel } => write!(f, "\tprmt.b32 \t{d}, {a}, {b}, {sel:#06x};"),
            Inst::PrmtR { d, a, b, sel } => write!(f, "\tprmt.b32 \t{d}, {a}, {b}, {sel};"),
            Inst::Lop3 { d, a, b, c, lut } => {
                write!(f, "\tlop3.b32 \t{d}, {a}, {b}, {c}, {lut:#04x};")
            }
            Inst::LdSharedV4 { d, addr, off } => write!(
                f,
                "\tld.shared.v4.b32 \t{{{}, {}, {}, {}}}, [{addr}+{off}];",
                d[0], d[1], d[2], d[3]
            ),
            Inst::LdSharedV2 { d, addr, off } => write!(
                f,
                "\tld.shared.v2.b32 \t{{{}, {}}}, [{addr}+{off}];",
                d[0], d[1]
            ),
            Inst::StShared { addr, v } => write!(f, "\tst.shared.f32 \t[{addr}], {v};"),
            Inst::LdShared { d, addr, off } => write!(f, "\tld.shared.f32 \t{d}, [{addr}+{off}];"),
            Inst::MovSym { d, sym } => write!(f, "\tmov.u32 \t{d}, {sym};"),
            Inst::ShflBfly { d, a, mask } => {
                write!(f, "\tshfl.sync.bfly.b32 \t{d}, {a}, {mask}, 31, -1;")
            }
            Inst::CvtFromE4m3 { d, a } => write!(
                f,
                "\t{{ .reg .b16 %dlo, %dhi; .reg .b32 %dpair; cvt.u16.u32 %dhi, {a}; cvt.rn.f16x2.e4m3x2 %dpair, %dhi; mov.b32 {{%dlo, %dhi}}, %dpair; cvt.f32.f16 {d}, %dlo; }}"
            ),
            Inst::RedMaxU32 { addr, v } => write!(f, "\tred.global.max.u32 \t[{addr}], {v};"),
            Inst::AtomAddAcqRelU32 { d, addr, v } => {
                write!(f, "\tatom.acq_rel.gpu.global.add.u32 \t{d}, [{addr}], {v};")
            }
            Inst::AtomAddU32 { d, addr, v } => {
                write!(f, "\tatom.global.add.u32 \t{d}, [{addr}], {v};")
            }
            Inst::RedAddU32 { addr, v } => write!(f, "\tred.global.add.u32 \t[{addr}], {v};"),
            Inst::RedSharedAddU32 { addr, v } => {
                write!(f, "\tred.shared.add.u32 \t[{addr}], {v};")
            }
            Inst::ShflUp { d, a, delta } => {
                write!(f, "\tshfl.sync.up.b32 \t{d}, {a}, {delta}, 0, -1;")
            }
            Inst::ShflIdx { d, a, lane } => {
                write!(f, "\tshfl.sync.idx.b32 \t{d}, {a}, {lane}, 31, -1;")
            }
            Inst::GridDepWait => f.write_str("\tgriddepcontrol.wait;"),
            Inst::Ballot { d, p } => write!(f, "\tvote.sync.ballot.b32 \t{d}, {p}, -1;"),
            Inst::VoteAny { d, p } => write!(f, "\tvote.sync.any.pred \t{d}, {p}, -1;"),
            Inst::StSharedU32 { addr, off, v } => {
                write!(f, "\tst.shared.u32 \t[{addr}+{off}], {v};")
            }
            Inst::LdSharedU32 { d, addr, off } => {
                write!(f, "\tld.shared.u32 \t{d}, [{addr}+{off}];")
            }
            Inst::LdSharedNarrow {
                d,
                addr,
                off,
                bytes,
            } => {
                let ty = if *bytes == 1 { "u8" } else { "u16" };
                write!(f, "\tld.shared.{ty} \t{d}, [{addr}+{off}];")
            }
            Inst::FenceAcqRelGpu => write!(f, "\tfence.acq_rel.gpu;"),
            Inst::BarWarpSync => write!(f, "\tbar.warp.sync \t-1;"),
            Inst::LdGlobalCgF32 { d, addr, off } => {
                write!(f, "\tld.global.cg.f32 \t{d}, [{addr}+{off}];")
            }
            Inst::LdGlobalCgV4F32 { d, addr, off } => write!(
                f,
                "\tld.global.cg.v4.f32 \t{{{}, {}, {}, {}}}, [{addr}+{off}];",
                d[0], d[1], d[2], d[3]
            ),
            Inst::LdV { nc, words, addr } => {
                let w: Vec<String> = words.iter().map(|r| r.to_string()).collect();
                let nc = if *nc { ".nc" } else { "" };
                match words.len() {
                    1 => write!(f, "\tld.global{nc}.b32 \t{}, [{addr}];", w[0]),
                    n => write!(f, "\tld.global{nc}.v{n}.b32 \t{{{}}}, [{addr}];", w.join(", ")),
                }
            }
            Inst::StV { words, addr } => {
                let w: Vec<String> = words.iter().map(|r| r.to_string()).collect();
                match words.len() {
                    1 => write!(f, "\tst.global.b32 \t[{addr}], {};", w[0]),
                    n => write!(f, "\tst.global.v{n}.b32 \t[{addr}], {{{}}};", w.join(", ")),
                }
            }
            Inst::LdParam { ty, d, name } => write!(f, "\tld.param{ty} \t{d}, [{name}];"),
            Inst::Cvta { d, a } => write!(f, "\tcvta.to.global.u64 \t{d}, {a};"),
            Inst::Special { d, name } => write!(f, "\tmov.u32 \t{d}, {name};"),
            Inst::MulWide { d, a, b } => write!(f, "\tmul.wide.u32 \t{d}, {a}, {b};"),
            Inst::Bra { label, pred } => match pred {
                None => write!(f, "\tbra.uni \t{label};"),
                Some((p, false)) => write!(f, "\t@{p} bra \t{label};"),
                Some((p, true)) => write!(f, "\t@!{p} bra \t{label};"),
            },
            Inst::Label(l) => write!(f, "{l}:"),
            Inst::Ret => write!(f, "\tret;"),
            Inst::Async { guard: None, op } => write!(f, "\t{op}"),
            Inst::Async {
                guard: Some(g),
                op,
            } => write!(f, "\t{g} {op}"),
        }
    }
}

/// Builds one kernel's instruction list with virtual registers.
#[derive(Debug, Default)]
pub struct Builder {
    counts: [u32; 4],
    /// Instructions so far.
    pub insts: Vec<Inst>,
    labels: u32,
    /// `.shared` variables declared with [`Builder::declare_shared`], in declaration order.
    pub(super) shared: Vec<SharedDecl>,
}

impl Builder {
    /// A fresh register of a class.
    pub fn reg(&mut self, class: RegClass) -> Reg {
        let k = class as usize;
        self.counts[k] += 1;
        Reg {
            class,
            n: self.counts[k],
        }
    }

    /// Append an instruction.
    pub fn push(&mut self, i: Inst) {
        self.insts.push(i);
    }

    /// A fresh label.
    pub fn label(&mut self, stem: &str) -> String {
        self.labels += 1;
        format!("$L_{stem}_{}", self.labels)
    }

    /// Register declarations, then the `.shared` variables declared with
    /// [`Builder::declare_shared`] (none for kernels that declare none).
    pub fn decls(&self) -> String {
        let mut s = String::new();
        for c in [RegClass::Pred, RegClass::B32, RegClass::B64, RegClass::F32] {
            let n = self.counts[c as usize];
            if n > 0 {
                let _ = writeln!(s, "\t.reg {} \t%{}<{}>;", c.decl(), c.prefix(), n + 1);
            }
        }
        for d in &self.shared {
            let _ = writeln!(s, "{d}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each typed opcode prints the text the free-form opcode strings printed before.
    #[test]
    fn opcodes_print_their_ptx_text() {
        use BinOpcode as B;
        let bin = [
            (B::Add, "add"),
            (B::Sub, "sub"),
            (B::MulLo, "mul.lo"),
            (B::MulHi, "mul.hi"),
            (B::MulWide, "mul.wide"),
            (B::Div, "div"),
            (B::Rem, "rem"),
            (B::And, "and"),
            (B::Or, "or"),
            (B::Xor, "xor"),
            (B::Shl, "shl"),
            (B::Shr, "shr"),
            (B::Min, "min"),
            (B::Max, "max"),
            (B::MaxXorsignAbs, "max.xorsign.abs"),
            (B::AddRn, "add.rn"),
            (B::MulRn, "mul.rn"),
            (B::DivRn, "div.rn"),
        ];
        for (op, text) in bin {
            assert_eq!(op.to_string(), text);
        }
        let un = [
            (UnOpcode::Mov(PtxTy::U64), "mov.u64"),
            (UnOpcode::Mov(PtxTy::U32), "mov.u32"),
            (UnOpcode::Mov(PtxTy::F32), "mov.f32"),
            (UnOpcode::Mov(PtxTy::B32), "mov.b32"),
            (UnOpcode::Mov(PtxTy::Pred), "mov.pred"),
            (UnOpcode::Abs(PtxTy::F32), "abs.f32"),
            (UnOpcode::RcpRn(PtxTy::F32), "rcp.rn.f32"),
            (UnOpcode::RcpApprox(PtxTy::F32), "rcp.approx.f32"),
            (UnOpcode::Ex2ApproxFtz(PtxTy::F32), "ex2.approx.ftz.f32"),
            (
                UnOpcode::cvt_rnd(Rnd::Rni, PtxTy::F32, PtxTy::F32),
                "cvt.rni.f32.f32",
            ),
            (
                UnOpcode::cvt_rnd(Rnd::Rzi, PtxTy::S32, PtxTy::F32),
                "cvt.rzi.s32.f32",
            ),
            (
                UnOpcode::cvt_rnd(Rnd::Rn, PtxTy::F32, PtxTy::S32),
                "cvt.rn.f32.s32",
            ),
            (UnOpcode::cvt(PtxTy::S64, PtxTy::S32), "cvt.s64.s32"),
            (UnOpcode::cvt(PtxTy::U32, PtxTy::U64), "cvt.u32.u64"),
            (UnOpcode::cvt(PtxTy::U64, PtxTy::U32), "cvt.u64.u32"),
        ];
        for (op, text) in un {
            assert_eq!(op.to_string(), text);
        }
    }

    #[test]
    fn instructions_print_one_line_of_ptx() {
        let mut b = Builder::default();
        let (p, r, rd, f) = (
            b.reg(RegClass::Pred),
            b.reg(RegClass::B32),
            b.reg(RegClass::B64),
            b.reg(RegClass::F32),
        );
        let cases = [
            (
                Inst::Bin {
                    op: BinOpcode::MulWide,
                    ty: PtxTy::U32,
                    d: rd,
                    a: Operand::Reg(r),
                    b: Operand::Int(4),
                },
                "\tmul.wide.u32 \t%rd1, %r1, 4;",
            ),
            (
                Inst::Bin {
                    op: BinOpcode::MaxXorsignAbs,
                    ty: PtxTy::Bf16x2,
                    d: r,
                    a: Operand::Reg(r),
                    b: Operand::Reg(r),
                },
                "\tmax.xorsign.abs.bf16x2 \t%r1, %r1, %r1;",
            ),
            (
                Inst::Un {
                    op: UnOpcode::cvt_rnd(Rnd::Rzi, PtxTy::S32, PtxTy::F32),
                    d: r,
                    a: Operand::Reg(f),
                },
                "\tcvt.rzi.s32.f32 \t%r1, %f1;",
            ),
            (
                Inst::Un {
                    op: UnOpcode::Mov(PtxTy::F32),
                    d: f,
                    a: Operand::F32(1.0),
                },
                "\tmov.f32 \t%f1, 0f3F800000;",
            ),
            (
                Inst::Setp {
                    cmp: CmpOp::Ge,
                    ty: PtxTy::S64,
                    p,
                    a: Operand::Reg(rd),
                    b: Operand::Int(7),
                },
                "\tsetp.ge.s64 \t%p1, %rd1, 7;",
            ),
            (
                Inst::Special {
                    d: r,
                    name: SpecialReg::NctaidX,
                },
                "\tmov.u32 \t%r1, %nctaid.x;",
            ),
            (
                Inst::LdParam {
                    ty: PtxTy::U64,
                    d: rd,
                    name: "k_param_0".into(),
                },
                "\tld.param.u64 \t%rd1, [k_param_0];",
            ),
            (
                Inst::CvtE4m3Pack {
                    d: r,
                    vals: [f, f, f, f],
                },
                "\t{ .reg .b16 %e<2>; cvt.rn.satfinite.e4m3x2.f32 %e0, %f1, %f1; \
                 cvt.rn.satfinite.e4m3x2.f32 %e1, %f1, %f1; mov.b32 %r1, {%e0, %e1}; }",
            ),
            (
                Inst::HalfBroadcast {
                    d: r,
                    a: r,
                    high: true,
                },
                "\t{ .reg .b16 %hb<2>; mov.b32 {%hb0, %hb1}, %r1; mov.b32 %r1, {%hb1, %hb1}; }",
            ),
            (
                Inst::Un {
                    op: UnOpcode::RcpRn(PtxTy::F32),
                    d: f,
                    a: Operand::Reg(f),
                },
                "\trcp.rn.f32 \t%f1, %f1;",
            ),
            (
                Inst::Un {
                    op: UnOpcode::Ex2ApproxFtz(PtxTy::F32),
                    d: f,
                    a: Operand::Reg(f),
                },
                "\tex2.approx.ftz.f32 \t%f1, %f1;",
            ),
        ];
        for (inst, text) in cases {
            assert_eq!(inst.to_string(), text);
        }
        let permute_cases = [
            (
                Inst::AtomAddU32 {
                    d: r,
                    addr: rd,
                    v: Operand::Int(1),
                },
                "\tatom.global.add.u32 \t%r1, [%rd1], 1;",
            ),
            (
                Inst::RedAddU32 {
                    addr: rd,
                    v: Operand::Reg(r),
                },
                "\tred.global.add.u32 \t[%rd1], %r1;",
            ),
            (
                Inst::RedSharedAddU32 {
                    addr: r,
                    v: Operand::Int(1),
                },
                "\tred.shared.add.u32 \t[%r1], 1;",
            ),
            (
                Inst::ShflUp {
                    d: r,
                    a: r,
                    delta: 4,
                },
                "\tshfl.sync.up.b32 \t%r1, %r1, 4, 0, -1;",
            ),
            (
                Inst::ShflIdx {
                    d: r,
                    a: r,
                    lane: Operand::Int(0),
                },
                "\tshfl.sync.idx.b32 \t%r1, %r1, 0, 31, -1;",
            ),
            (
                Inst::ShflIdx {
                    d: r,
                    a: r,
                    lane: Operand::Reg(r),
                },
                "\tshfl.sync.idx.b32 \t%r1, %r1, %r1, 31, -1;",
            ),
            (Inst::GridDepWait, "\tgriddepcontrol.wait;"),
            (
                Inst::Ballot { d: r, p },
                "\tvote.sync.ballot.b32 \t%r1, %p1, -1;",
            ),
            (
                Inst::VoteAny { d: p, p },
                "\tvote.sync.any.pred \t%p1, %p1, -1;",
            ),
            (
                Inst::Un {
                    op: UnOpcode::Popc,
                    d: r,
                    a: Operand::Reg(r),
                },
                "\tpopc.b32 \t%r1, %r1;",
            ),
            (
                Inst::StSharedU32 {
                    addr: r,
                    off: 8,
                    v: r,
                },
                "\tst.shared.u32 \t[%r1+8], %r1;",
            ),
            (
                Inst::LdSharedU32 {
                    d: r,
                    addr: r,
                    off: 0,
                },
                "\tld.shared.u32 \t%r1, [%r1+0];",
            ),
            (
                Inst::LdSharedNarrow {
                    d: r,
                    addr: r,
                    off: 4,
                    bytes: 2,
                },
                "\tld.shared.u16 \t%r1, [%r1+4];",
            ),
            (
                Inst::LdSharedNarrow {
                    d: r,
                    addr: r,
                    off: 0,
                    bytes: 1,
                },
                "\tld.shared.u8 \t%r1, [%r1+0];",
            ),
            (
                Inst::Ld {
                    ty: PtxTy::S32,
                    d: r,
                    addr: rd,
                },
                "\tld.global.s32 \t%r1, [%rd1];",
            ),
            (
                Inst::LdV2F32 {
                    lo: r,
                    hi: r,
                    addr: rd,
                },
                "\tld.global.v2.f32 \t{%r1, %r1}, [%rd1];",
            ),
            (
                Inst::StGuardedV2 {
                    pred: r,
                    ty: PtxTy::F32,
                    addr: rd,
                    off: 8,
                    lo: r,
                    hi: r,
                },
                "\t@%r1 st.global.v2.f32 \t[%rd1+8], {%r1, %r1};",
            ),
            (Inst::BarSync, "\tbar.sync \t0;"),
        ];
        for (inst, text) in permute_cases {
            assert_eq!(inst.to_string(), text);
        }
        assert_eq!(
            b.decls(),
            "\t.reg .pred \t%p<2>;\n\t.reg .b32 \t%r<2>;\n\t.reg .b64 \t%rd<2>;\n\t.reg .f32 \t%f<2>;\n"
        );
    }
}
