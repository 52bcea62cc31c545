//! The host backend: every kernel of a [`Program`] is emitted as CLIF and JIT-compiled by Cranelift
//! for the machine it runs on. A kernel becomes `fn(bufs: *const *mut u8, lo: i64, hi: i64)` running
//! work items `lo..hi`: index maps, reductions and the quantization arithmetic are all inline code,
//! with no calls out of the loop. [`Compiled::run`] splits each kernel's items across threads.
//! [`Options`] are the backend's settings (Cranelift's optimization level, a machine-code dump);
//! [`compile`] takes the defaults, [`compile_with`] the ones given.

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{
    types, AbiParam, AtomicRmwOp, InstBuilder, MemFlagsData as MemFlags, Type, Value,
};
use cranelift_codegen::settings::{self, Configurable};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext, Variable};
use cranelift_jit::{JITBuilder, JITModule};
use cranelift_module::{default_libcall_names, Linkage, Module};

use crate::kir::{BinOp, Elem, Expr, Kernel, Program, Step, Stmt, Ty, UnOp};
use crate::{Collective, Error, Result};

type KernelFn = unsafe extern "C" fn(*const *mut u8, i64, i64);

/// Cranelift's optimization level (its `opt_level` setting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum OptLevel {
    /// No optimization (`none`).
    None,
    /// Optimize for speed (`speed`, the default).
    #[default]
    Speed,
    /// Optimize for speed and code size (`speed_and_size`).
    SpeedAndSize,
}

impl OptLevel {
    /// Every level, in order of increasing optimization.
    pub const ALL: [OptLevel; 3] = [OptLevel::None, OptLevel::Speed, OptLevel::SpeedAndSize];

    /// Cranelift's name of the level.
    pub fn name(self) -> &'static str {
        match self {
            OptLevel::None => "none",
            OptLevel::Speed => "speed",
            OptLevel::SpeedAndSize => "speed_and_size",
        }
    }

    /// The level Cranelift names `name`.
    pub fn from_name(name: &str) -> Option<OptLevel> {
        OptLevel::ALL.into_iter().find(|l| l.name() == name)
    }
}

/// Options of the host backend.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Options {
    /// Cranelift's optimization level.
    pub opt_level: OptLevel,
    /// Write each kernel's machine code to `{dir}/{kernel}.s` (for performance work); `None`: not
    /// written.
    pub disasm_dir: Option<std::path::PathBuf>,
}

/// A JIT-compiled program.
pub struct Compiled {
    // Keeps the code alive; never touched after compilation.
    _module: JITModule,
    prog: Program,
    fns: Vec<KernelFn>,
}

fn cl<E: std::fmt::Display>(e: E) -> Error {
    Error::Cranelift(e.to_string())
}

fn clty(t: Ty) -> Type {
    match t {
        Ty::I64 => types::I64,
        Ty::I32 => types::I32,
        Ty::F32 => types::F32,
        Ty::Bool => types::I8,
        Ty::F32x4 => types::F32X4,
        Ty::I32x4 | Ty::Boolx4 => types::I32X4,
    }
}

/// Flags of vector bitcasts (lane order must be explicit).
fn little() -> MemFlags {
    MemFlags::new().with_endianness(cranelift_codegen::ir::Endianness::Little)
}

/// The CLIF of every kernel of a program, as Cranelift prints it (before optimization).
pub fn clif_text(prog: &Program) -> Result<String> {
    let soft = crate::quant::soften(&prog.sequential(), &|_| false);
    let prog = &soft;
    let mut out = String::new();
    let isa = native_isa(&Options::default())?;
    let ptr = isa.pointer_type();
    let cfg = isa.frontend_config();
    let elems: Vec<Elem> = prog.bufs.iter().map(|b| b.elem).collect();
    let mut fctx = FunctionBuilderContext::new();
    for k in prog.kernels() {
        let mut func = cranelift_codegen::ir::Function::new();
        func.signature.params.push(AbiParam::new(ptr));
        func.signature.params.push(AbiParam::new(types::I64));
        func.signature.params.push(AbiParam::new(types::I64));
        {
            let mut b = FunctionBuilder::new(&mut func, &mut fctx);
            let mut g = Gen::new(&mut b, k, &elems, ptr);
            g.kernel()?;
            b.seal_all_blocks();
            b.finalize(cfg);
        }
        out.push_str(&format!("; kernel {}\n{}\n", k.name, func.display()));
    }
    Ok(out)
}

fn native_isa(opts: &Options) -> Result<cranelift_codegen::isa::OwnedTargetIsa> {
    let mut flags = settings::builder();
    flags.set("opt_level", opts.opt_level.name()).map_err(cl)?;
    flags.set("use_colocated_libcalls", "false").map_err(cl)?;
    flags.set("is_pic", "false").map_err(cl)?;
    cranelift_native::builder()
        .map_err(|e| Error::Cranelift(e.to_string()))?
        .finish(settings::Flags::new(flags))
        .map_err(cl)
}

/// Compile every kernel of a program for this machine, with the default [`Options`].
pub fn compile(prog: &Program) -> Result<Compiled> {
    compile_with(prog, &Options::default())
}

/// Compile every kernel of a program for this machine, with `opts`.
pub fn compile_with(prog: &Program, opts: &Options) -> Result<Compiled> {
    // The host has no narrow-float conversion instructions: their integer sequences instead.
    let soft = crate::quant::soften(&prog.sequential(), &|_| false);
    let prog = &soft;
    let isa = native_isa(opts)?;
    let mut module = JITModule::new(JITBuilder::with_isa(isa, default_libcall_names()));
    let ptr = module.target_config().pointer_type();
    let mut ctx = module.make_context();
    let mut fctx = FunctionBuilderContext::new();
    let elems: Vec<Elem> = prog.bufs.iter().map(|b| b.elem).collect();
    let mut ids = Vec::new();
    let fcfg = module.target_config();
    for k in prog.kernels() {
        ctx.func.signature.params.push(AbiParam::new(ptr));
        ctx.func.signature.params.push(AbiParam::new(types::I64));
        ctx.func.signature.params.push(AbiParam::new(types::I64));
        let id = module
            .declare_function(&k.name, Linkage::Local, &ctx.func.signature)
            .map_err(cl)?;
        {
            let mut b = FunctionBuilder::new(&mut ctx.func, &mut fctx);
            let mut g = Gen::new(&mut b, k, &elems, ptr);
            g.kernel()?;
            b.seal_all_blocks();
            b.finalize(fcfg);
        }
        let dump = opts.disasm_dir.as_deref();
        ctx.set_disasm(dump.is_some());
        module
            .define_function(id, &mut ctx)
            .map_err(|e| Error::Cranelift(format!("{e:?}")))?;
        if let (Some(dir), Some(code)) = (dump, ctx.compiled_code().and_then(|c| c.vcode.clone())) {
            // Best effort: a dump that cannot be written does not fail the compilation.
            let _ = std::fs::write(dir.join(format!("{}.s", k.name)), code);
        }
        module.clear_context(&mut ctx);
        ids.push(id);
    }
    module.finalize_definitions().map_err(cl)?;
    let fns = ids
        .into_iter()
        .map(|id| {
            let p = module.get_finalized_function(id);
            // SAFETY: `p` is the entry of a function just compiled with exactly the signature
            // `(ptr, i64, i64)` in the platform's default C calling convention, which `KernelFn` is.
            unsafe { std::mem::transmute::<*const u8, KernelFn>(p) }
        })
        .collect();
    Ok(Compiled {
        _module: module,
        prog: prog.clone(),
        fns,
    })
}

struct Gen<'a, 'b> {
    b: &'a mut FunctionBuilder<'b>,
    k: &'a Kernel,
    elems: &'a [Elem],
    vars: Vec<Variable>,
    bases: Vec<Value>,
    ptr: Type,
}

impl<'a, 'b> Gen<'a, 'b> {
    fn new(
        b: &'a mut FunctionBuilder<'b>,
        k: &'a Kernel,
        elems: &'a [Elem],
        ptr: Type,
    ) -> Gen<'a, 'b> {
        Gen {
            b,
            k,
            elems,
            vars: Vec::new(),
            bases: Vec::new(),
            ptr,
        }
    }

    fn kernel(&mut self) -> Result<()> {
        let entry = self.b.create_block();
        self.b.append_block_params_for_function_params(entry);
        self.b.switch_to_block(entry);
        let params = self.b.block_params(entry).to_vec();
        let [bufs, lo, hi] = params[..] else {
            return Err(Error::Internal("kernel signature"));
        };
        for t in &self.k.var_types {
            let v = self.b.declare_var(clty(*t));
            self.vars.push(v);
        }
        // Buffer base pointers, loaded once.
        let flags = MemFlags::trusted();
        for i in 0..self.elems.len() {
            let off = (i * self.ptr.bytes() as usize) as i32;
            let base = self.b.ins().load(self.ptr, flags, bufs, off);
            self.bases.push(base);
        }
        let item = self.var(self.k.item)?;
        self.loop_(item, lo, hi, &self.k.body)?;
        self.b.ins().return_(&[]);
        Ok(())
    }

    fn var(&self, v: crate::kir::Var) -> Result<Variable> {
        self.vars
            .get(v.0 as usize)
            .copied()
            .ok_or(Error::Internal("variable"))
    }

    fn loop_(&mut self, var: Variable, start: Value, end: Value, body: &[Stmt]) -> Result<()> {
        let header = self.b.create_block();
        let block = self.b.create_block();
        let exit = self.b.create_block();
        self.b.def_var(var, start);
        self.b.ins().jump(header, &[]);
        self.b.switch_to_block(header);
        let i = self.b.use_var(var);
        let c = self.b.ins().icmp(IntCC::SignedLessThan, i, end);
        self.b.ins().brif(c, block, &[], exit, &[]);
        self.b.switch_to_block(block);
        self.stmts(body)?;
        let i = self.b.use_var(var);
        let next = self.b.ins().iadd_imm_s(i, 1);
        self.b.def_var(var, next);
        self.b.ins().jump(header, &[]);
        self.b.switch_to_block(exit);
        Ok(())
    }

    fn stmts(&mut self, body: &[Stmt]) -> Result<()> {
        for s in body {
            match s {
                Stmt::Set(v, x) => {
                    let val = self.expr(x)?;
                    let var = self.var(*v)?;
                    self.b.def_var(var, val);
                }
                Stmt::For {
                    var,
                    start,
                    end,
                    body,
                } => {
                    let (s0, e0) = (self.expr(start)?, self.expr(end)?);
                    let var = self.var(*var)?;
                    self.loop_(var, s0, e0, body)?;
                }
                Stmt::If { cond, then } => {
                    let c = self.expr(cond)?;
                    let t = self.b.create_block();
                    let merge = self.b.create_block();
                    self.b.ins().brif(c, t, &[], merge, &[]);
                    self.b.switch_to_block(t);
                    self.stmts(then)?;
                    self.b.ins().jump(merge, &[]);
                    self.b.switch_to_block(merge);
                }
                Stmt::Store { buf, index, value } => {
                    let i = self.expr(index)?;
                    let v = self.expr(value)?;
                    self.store_at(buf.0 as usize, i, v)?;
                }
                // Packed accesses are element accesses on the host.
                Stmt::LoadPacked { buf, index, dst } => {
                    let base = self.expr(index)?;
                    let tmp = self.b.declare_var(types::I64);
                    self.b.def_var(tmp, base);
                    for (k, v) in dst.iter().enumerate() {
                        let var = self.var(*v)?;
                        let i = self.b.use_var(tmp);
                        let i = self.b.ins().iadd_imm_s(i, k as i64);
                        let val = self.load_at(buf.0 as usize, i)?;
                        self.b.def_var(var, val);
                    }
                }
                Stmt::StorePacked { buf, index, values } => {
                    let base = self.expr(index)?;
                    let tmp = self.b.declare_var(types::I64);
                    self.b.def_var(tmp, base);
                    for (k, x) in values.iter().enumerate() {
                        let v = self.expr(x)?;
                        let i = self.b.use_var(tmp);
                        let i = self.b.ins().iadd_imm_s(i, k as i64);
                        self.store_at(buf.0 as usize, i, v)?;
                    }
                }
                Stmt::AtomicMaxF32 { buf, index, value } => {
                    let addr = self.addr(buf.0 as usize, index, Elem::F32)?;
                    let v = self.expr(value)?;
                    let bits = self.b.ins().bitcast(types::I32, MemFlags::new(), v);
                    self.b.ins().atomic_rmw(
                        types::I32,
                        MemFlags::trusted(),
                        AtomicRmwOp::Umax,
                        addr,
                        bits,
                    );
                }
                Stmt::GroupMax { .. } | Stmt::GroupRow(_) | Stmt::GroupFor { .. } => {
                    return Err(Error::Internal("group construct in a sequential kernel"))
                }
            }
        }
        Ok(())
    }

    fn addr(&mut self, buf: usize, index: &Expr, elem: Elem) -> Result<Value> {
        let i = self.expr(index)?;
        self.addr_val(buf, i, elem)
    }

    fn addr_val(&mut self, buf: usize, i: Value, elem: Elem) -> Result<Value> {
        let base = *self.bases.get(buf).ok_or(Error::Internal("buffer"))?;
        let off = match elem.size() {
            1 => i,
            n => self.b.ins().imul_imm_s(i, n as i64),
        };
        Ok(self.b.ins().iadd(base, off))
    }

    /// Load element `i` (an i64 value) of a buffer as its scalar type.
    fn load_at(&mut self, buf: usize, i: Value) -> Result<Value> {
        let elem = *self.elems.get(buf).ok_or(Error::Internal("buffer"))?;
        let addr = self.addr_val(buf, i, elem)?;
        let f = MemFlags::trusted();
        Ok(match elem {
            Elem::U8 => self.b.ins().uload8(types::I32, f, addr, 0),
            Elem::F32 => self.b.ins().load(types::F32, f, addr, 0),
            Elem::Bf16 => {
                let h = self.b.ins().uload16(types::I32, f, addr, 0);
                let bits = self.b.ins().ishl_imm_u(h, 16);
                self.b.ins().bitcast(types::F32, MemFlags::new(), bits)
            }
        })
    }

    /// Store a scalar to element `i` (an i64 value) of a buffer.
    fn store_at(&mut self, buf: usize, i: Value, v: Value) -> Result<()> {
        let elem = *self.elems.get(buf).ok_or(Error::Internal("buffer"))?;
        let addr = self.addr_val(buf, i, elem)?;
        let f = MemFlags::trusted();
        match elem {
            Elem::U8 => {
                self.b.ins().istore8(f, v, addr, 0);
            }
            Elem::F32 => {
                self.b.ins().store(f, v, addr, 0);
            }
            Elem::Bf16 => {
                let bits = self.b.ins().bitcast(types::I32, MemFlags::new(), v);
                let hi = self.b.ins().ushr_imm_u(bits, 16);
                self.b.ins().istore16(f, hi, addr, 0);
            }
        }
        Ok(())
    }

    /// The IR type of an expression.
    fn ty(&self, x: &Expr) -> Result<Ty> {
        Ok(match x {
            Expr::Var(v) => *self
                .k
                .var_types
                .get(v.0 as usize)
                .ok_or(Error::Internal("variable"))?,
            Expr::I64(_) => Ty::I64,
            Expr::I32(_) => Ty::I32,
            Expr::F32(_) => Ty::F32,
            Expr::Load { buf, .. } => self
                .elems
                .get(buf.0 as usize)
                .ok_or(Error::Internal("buffer"))?
                .ty(),
            Expr::LoadX4 { buf, .. } => self
                .elems
                .get(buf.0 as usize)
                .ok_or(Error::Internal("buffer"))?
                .ty()
                .x4(),
            Expr::Splat(a) => self.ty(a)?.x4(),
            Expr::Lane(a, _) => match self.ty(a)? {
                Ty::F32x4 => Ty::F32,
                Ty::Boolx4 => Ty::Bool,
                _ => Ty::I32,
            },
            Expr::Fma(..) | Expr::AbsMax(_) => Ty::F32,
            Expr::PackE2m1 { .. } => Ty::I32,
            Expr::Select(_, a, b) => {
                let (ta, tb) = (self.ty(a)?, self.ty(b)?);
                if tb.is_vector() {
                    tb
                } else {
                    ta
                }
            }
            Expr::Un(op, a) => {
                let t = self.ty(a)?;
                let v = t.is_vector();
                let s = op.result_ty();
                if v {
                    s.x4()
                } else {
                    s
                }
            }
            Expr::Bin(op, a, b) => {
                let (ta, tb) = (self.ty(a)?, self.ty(b)?);
                let v = ta.is_vector() || tb.is_vector();
                let t = if ta.is_vector() {
                    ta
                } else if tb.is_vector() {
                    tb.x4()
                } else {
                    ta
                };
                match op {
                    BinOp::ILt | BinOp::IEq | BinOp::FLt | BinOp::FLe | BinOp::FEq => {
                        if v {
                            Ty::Boolx4
                        } else {
                            Ty::Bool
                        }
                    }
                    _ => t,
                }
            }
        })
    }

    /// `v` as a value of type `want`, broadcasting a scalar to a vector.
    fn coerce(&mut self, v: Value, have: Ty, want: Ty) -> Value {
        if want.is_vector() && !have.is_vector() {
            self.b.ins().splat(clty(want), v)
        } else {
            v
        }
    }

    /// [`BinOp::Prmt`] with a constant selector: per byte a shift and a mask (or, for a copied top
    /// bit, a shift up and an arithmetic shift down), then an or into place.
    fn prmt(&mut self, a: Value, b: Value, sel: u16) -> Value {
        let mut out = self.b.ins().iconst(types::I32, 0);
        for k in 0..4u16 {
            let nib = (sel >> (4 * k)) & 15;
            let src = if nib & 7 < 4 { a } else { b };
            let at = i64::from(8 * (nib & 3));
            let ins = self.b.ins();
            let byte = if nib & 8 != 0 {
                let up = ins.ishl_imm_u(src, 24 - at);
                let fill = self.b.ins().sshr_imm_u(up, 31);
                self.b.ins().band_imm_u(fill, 255)
            } else {
                let down = ins.ushr_imm_u(src, at);
                self.b.ins().band_imm_u(down, 255)
            };
            let placed = self.b.ins().ishl_imm_u(byte, i64::from(8 * k));
            out = self.b.ins().bor(out, placed);
        }
        out
    }

    /// One binary operation on scalars, or lane-wise on vectors (operands already of one type).
    fn binop(&mut self, op: BinOp, a: Value, b: Value, vector: bool) -> Result<Value> {
        let ins = self.b.ins();
        Ok(match op {
            BinOp::IAdd => ins.iadd(a, b),
            BinOp::ISub => ins.isub(a, b),
            BinOp::IMul => ins.imul(a, b),
            BinOp::IDiv | BinOp::IRem if vector => return Err(Error::Internal("vector division")),
            BinOp::IDiv => ins.udiv(a, b),
            BinOp::IRem => ins.urem(a, b),
            BinOp::And => ins.band(a, b),
            BinOp::Or => ins.bor(a, b),
            BinOp::Xor => ins.bxor(a, b),
            BinOp::Shl => ins.ishl(a, b),
            BinOp::Shr => ins.ushr(a, b),
            BinOp::MulHi if vector => return Err(Error::Internal("vector multiply-high")),
            BinOp::MulHi => ins.umulhi(a, b),
            BinOp::Prmt(_) if vector => return Err(Error::Internal("vector byte permute")),
            BinOp::Prmt(sel) => self.prmt(a, b, sel),
            BinOp::FAdd => ins.fadd(a, b),
            BinOp::FMul => ins.fmul(a, b),
            BinOp::FDiv => ins.fdiv(a, b),
            // Operands of the IR's max/min are never NaN and never a (+0, -0) pair, so on vectors a
            // lane mask and a bit select are exact, and much shorter than the NaN-aware sequence x86
            // needs for `fmax`.
            BinOp::FMax | BinOp::FMin if vector => {
                let (x, y) = if op == BinOp::FMax { (a, b) } else { (b, a) };
                let lt = ins.fcmp(FloatCC::LessThan, x, y);
                let m = self.b.ins().bitcast(types::F32X4, little(), lt);
                self.b.ins().bitselect(m, b, a)
            }
            BinOp::FMax => ins.fmax(a, b),
            BinOp::FMin => ins.fmin(a, b),
            BinOp::ILt => ins.icmp(IntCC::SignedLessThan, a, b),
            BinOp::IEq => ins.icmp(IntCC::Equal, a, b),
            // On vectors, comparisons give i32x4 lane masks.
            BinOp::FLt => ins.fcmp(FloatCC::LessThan, a, b),
            BinOp::FLe => ins.fcmp(FloatCC::LessThanOrEqual, a, b),
            BinOp::FEq => ins.fcmp(FloatCC::Equal, a, b),
        })
    }

    fn expr(&mut self, x: &Expr) -> Result<Value> {
        Ok(match x {
            Expr::Var(v) => {
                let var = self.var(*v)?;
                self.b.use_var(var)
            }
            Expr::I64(c) => self.b.ins().iconst(types::I64, *c),
            Expr::I32(c) => self.b.ins().iconst(types::I32, *c as i64),
            Expr::F32(c) => self.b.ins().f32const(*c),
            Expr::Load { buf, index } => {
                let i = self.expr(index)?;
                self.load_at(buf.0 as usize, i)?
            }
            Expr::LoadX4 { buf, index } => {
                let elem = *self
                    .elems
                    .get(buf.0 as usize)
                    .ok_or(Error::Internal("buffer"))?;
                let addr = self.addr(buf.0 as usize, index, elem)?;
                // Vector loads may be unaligned: no `aligned` flag.
                let f = MemFlags::new().with_notrap();
                match elem {
                    Elem::Bf16 => {
                        let h = self.b.ins().uload16x4(f, addr, 0);
                        let bits = self.b.ins().ishl_imm_u(h, 16);
                        self.b.ins().bitcast(types::F32X4, little(), bits)
                    }
                    Elem::F32 => self.b.ins().load(types::F32X4, f, addr, 0),
                    Elem::U8 => return Err(Error::Internal("byte vector loads")),
                }
            }
            Expr::Splat(a) => {
                let t = self.ty(a)?;
                let v = self.expr(a)?;
                self.b.ins().splat(clty(t.x4()), v)
            }
            Expr::Lane(a, k) => {
                let v = self.expr(a)?;
                self.b.ins().extractlane(v, *k)
            }
            Expr::Fma(a, b, c) => {
                let (a, b, c) = (self.expr(a)?, self.expr(b)?, self.expr(c)?);
                self.b.ins().fma(a, b, c)
            }
            Expr::Select(c, a, b) => {
                let want = self.ty(x)?;
                let (tc, ta, tb) = (self.ty(c)?, self.ty(a)?, self.ty(b)?);
                let (c, a, b) = (self.expr(c)?, self.expr(a)?, self.expr(b)?);
                let a = self.coerce(a, ta, want);
                let b = self.coerce(b, tb, want);
                if tc.is_vector() {
                    let c = if want == Ty::F32x4 {
                        self.b.ins().bitcast(types::F32X4, little(), c)
                    } else {
                        c
                    };
                    self.b.ins().bitselect(c, a, b)
                } else {
                    self.b.ins().select(c, a, b)
                }
            }
            Expr::Un(op, a) if self.ty(a)?.is_vector() => {
                let a = self.expr(a)?;
                let ins = self.b.ins();
                match op {
                    UnOp::FAbs => ins.fabs(a),
                    UnOp::FRoundEven => ins.nearest(a),
                    UnOp::F2I => ins.fcvt_to_sint_sat(types::I32X4, a),
                    UnOp::I2F => ins.fcvt_from_sint(types::F32X4, a),
                    UnOp::BitsOf => ins.bitcast(types::I32X4, little(), a),
                    UnOp::FromBits => ins.bitcast(types::F32X4, little(), a),
                    UnOp::BoolToI => {
                        let one = self.b.ins().iconst(types::I32, 1);
                        let one = self.b.ins().splat(types::I32X4, one);
                        self.b.ins().band(a, one)
                    }
                    UnOp::Widen | UnOp::Narrow | UnOp::Byte(_) => {
                        return Err(Error::Internal("vector widen/narrow/byte"))
                    }
                    UnOp::E4m3 | UnOp::E2m1 | UnOp::E4m3Decode => {
                        return Err(Error::Internal("native conversion not softened"))
                    }
                }
            }
            Expr::Bin(op, a, b) if self.ty(a)?.is_vector() || self.ty(b)?.is_vector() => {
                let (ta, tb) = (self.ty(a)?, self.ty(b)?);
                let want = if ta.is_vector() { ta } else { tb.x4() };
                let (a, b) = (self.expr(a)?, self.expr(b)?);
                let a = self.coerce(a, ta, want);
                let b = if matches!(op, BinOp::Shl | BinOp::Shr) {
                    b
                } else {
                    self.coerce(b, tb, want)
                };
                self.binop(*op, a, b, true)?
            }
            Expr::Un(op, a) => {
                let a = self.expr(a)?;
                let ins = self.b.ins();
                match op {
                    UnOp::FAbs => ins.fabs(a),
                    UnOp::FRoundEven => ins.nearest(a),
                    UnOp::F2I => ins.fcvt_to_sint_sat(types::I32, a),
                    UnOp::I2F => ins.fcvt_from_sint(types::F32, a),
                    UnOp::BitsOf => ins.bitcast(types::I32, MemFlags::new(), a),
                    UnOp::FromBits => ins.bitcast(types::F32, MemFlags::new(), a),
                    UnOp::Widen => ins.sextend(types::I64, a),
                    UnOp::Narrow => ins.ireduce(types::I32, a),
                    UnOp::BoolToI => ins.uextend(types::I32, a),
                    UnOp::Byte(k) => {
                        let down = ins.ushr_imm_u(a, 8 * i64::from(*k & 3));
                        self.b.ins().band_imm_u(down, 255)
                    }
                    UnOp::E4m3 | UnOp::E2m1 | UnOp::E4m3Decode => {
                        return Err(Error::Internal("native conversion not softened"))
                    }
                }
            }
            Expr::PackE2m1 { .. } => return Err(Error::Internal("native conversion not softened")),
            Expr::AbsMax(vals) => {
                // The same as a chain of f32 maxima of absolute values (exact and order-free).
                let tree = vals
                    .iter()
                    .map(|x| Expr::Un(UnOp::FAbs, Box::new(x.clone())))
                    .reduce(|a, b| Expr::Bin(BinOp::FMax, Box::new(a), Box::new(b)))
                    .ok_or(Error::Internal("absmax of no values"))?;
                return self.expr(&tree);
            }
            Expr::Bin(op, a, b) => {
                // Constant right operands become immediates where Cranelift has the form.
                if let (Expr::I64(c), BinOp::IDiv | BinOp::IRem | BinOp::IMul | BinOp::IAdd) =
                    (&**b, op)
                {
                    let a = self.expr(a)?;
                    let ins = self.b.ins();
                    return Ok(match op {
                        BinOp::IDiv => ins.udiv_imm_u(a, *c),
                        BinOp::IRem => ins.urem_imm_u(a, *c),
                        BinOp::IMul => ins.imul_imm_s(a, *c),
                        _ => ins.iadd_imm_s(a, *c),
                    });
                }
                let (a, b) = (self.expr(a)?, self.expr(b)?);
                self.binop(*op, a, b, false)?
            }
        })
    }
}

impl Compiled {
    /// The program this was compiled from.
    pub fn program(&self) -> &Program {
        &self.prog
    }

    /// Run the program over buffers from [`crate::alloc_buffers`], splitting each kernel's work items
    /// over `threads` threads (0: all cores).
    pub fn run(&self, bufs: &mut [Vec<u8>], coll: &dyn Collective, threads: usize) -> Result<()> {
        if bufs.len() != self.prog.bufs.len() {
            return Err(Error::Internal("buffer count"));
        }
        for (b, d) in self.prog.bufs.iter().zip(bufs.iter()) {
            let want = b.len * b.elem.size();
            if d.len() != want {
                return Err(Error::BufferSize {
                    name: b.name().to_string(),
                    expected: want,
                    got: d.len(),
                });
            }
        }
        for (b, d) in self.prog.bufs.iter().zip(bufs.iter_mut()) {
            if b.zeroed {
                d.fill(0);
            }
        }
        let threads = if threads == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        } else {
            threads
        };
        let mut kernels = self.fns.iter();
        for step in &self.prog.steps {
            match step {
                Step::Kernel(k) => {
                    let f = *kernels.next().ok_or(Error::Internal("kernel count"))?;
                    let ptrs: Vec<SendPtr> =
                        bufs.iter_mut().map(|b| SendPtr(b.as_mut_ptr())).collect();
                    let n = k.items;
                    let t = (threads as i64).min(n).max(1);
                    // Small chunks balance uneven rows; at least one item per chunk.
                    let chunk = (n + t * 8 - 1) / (t * 8);
                    let next = std::sync::atomic::AtomicI64::new(0);

                    std::thread::scope(|s| {
                        for _ in 0..t {
                            s.spawn(|| loop {
                                let lo = next
                                    .fetch_add(chunk.max(1), std::sync::atomic::Ordering::Relaxed);
                                if lo >= n {
                                    break;
                                }
                                let hi = (lo + chunk.max(1)).min(n);
                                // SAFETY: `ptrs` holds one base pointer per program buffer, each
                                // sized exactly as the program declares (checked above), in the
                                // order the kernel loads them. The planner only generates
                                // in-bounds indices (the interpreter checks the same programs with
                                // bounds checks in the tests), and distinct work items write
                                // disjoint elements except through atomic max.
                                unsafe { f(ptrs.as_ptr() as *const *mut u8, lo, hi) };
                            });
                        }
                    });
                }
                Step::AllReduceMax { buf, group } => {
                    crate::all_reduce_bytes(coll, *group, bufs, *buf)?
                }
            }
        }
        Ok(())
    }
}

#[derive(Clone, Copy)]
#[repr(transparent)]
struct SendPtr(*mut u8);

// SAFETY: the pointers are only dereferenced by generated kernels under the disjointness argument
// documented at the call site; the buffers outlive the scoped threads.
unsafe impl Send for SendPtr {}
// SAFETY: as above; sharing the pointer array between threads only reads it.
unsafe impl Sync for SendPtr {}
