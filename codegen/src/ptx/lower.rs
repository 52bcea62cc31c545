//! Lowering the kernel IR to PTX: each [`Kernel`] of a [`Program`] becomes one `.entry` built
//! through the typed layer ([`super::isa`]) and declared through its ABI description
//! ([`super::entry`]); [`compile`] makes the whole module. Constant divisions become shifts or a
//! multiply-high ([`magic_u31`]); conversions the target lacks ([`native`]) were softened into
//! integer sequences before lowering.

use std::fmt::Write as _;

use super::entry::{Entry, Param};
use super::isa::{
    BinOpcode, Builder, CmpOp, Inst, Operand, PtxTy, Reg, RegClass, Rnd, SpecialReg, UnOpcode,
    PTX_VERSION,
};
use super::Target;
use crate::kir::{BinOp, Elem, Expr, GroupRow, Kernel, Program, Stmt, Ty, UnOp, Var};
use crate::{Error, Result};

/// Whether the target converts to a narrow float format in one instruction: E4M3 everywhere
/// (`cvt.rn.satfinite.e4m3x2.f32`, sm_89 on), E2M1 only on sm_100a (`...e2m1x2.f32`).
pub fn native(target: Target, op: UnOp) -> bool {
    match op {
        UnOp::E4m3 | UnOp::E4m3Decode => target.is_gpu(),
        UnOp::E2m1 => target == Target::Sm100a,
        _ => true,
    }
}

/// The multiplier and shift that divide any `a < 2^31` by a constant `2 <= c < 2^31`:
/// `a / c == mulhi32(a, m) >> shift` with `m = ceil(2^(31+l) / c) < 2^32`, `2^l >= c`, `shift = l - 1`.
pub fn magic_u31(c: i64) -> (i64, i64) {
    let l = 64 - ((c - 1) as u64).leading_zeros() as i64;
    let m = (1u128 << (31 + l)).div_ceil(c as u128);
    (m as i64, l - 1)
}

/// The register class of a scalar IR type (an `i64` may live in a 32-bit register instead: see
/// `Gen::idx`).
fn reg_class(t: Ty) -> RegClass {
    match t {
        Ty::I64 => RegClass::B64,
        Ty::I32 => RegClass::B32,
        Ty::F32 => RegClass::F32,
        Ty::Bool => RegClass::Pred,
        // Vector IR is host-only; `kernel_ptx` rejects it before registers are made.
        Ty::F32x4 | Ty::I32x4 | Ty::Boolx4 => RegClass::B32,
    }
}

/// The state of lowering one kernel: its builder, the registers of its variables and buffers, and
/// what it knows of its index widths and thread groups.
struct Gen<'a> {
    b: Builder,
    /// f32 registers holding a bf16 loaded as half of a 32-bit word: the word and the half (0 low,
    /// 1 high), for [`Expr::AbsMax`] on packed pairs; a register leaves when written again.
    halves: std::collections::HashMap<Reg, (Reg, u8)>,
    vars: Vec<Reg>,
    bases: Vec<Reg>,
    elems: &'a [Elem],
    /// Buffers no kernel of the program writes (checkpoint inputs).
    readonly: &'a [bool],
    /// The kernel has fewer than 2^32 work items. The planner divides only coordinates (work-item
    /// indices and what is derived from them by division, rows, block numbers), never offsets, so then
    /// every division's operands fit 32 bits, and 64-bit divisions (a long software sequence on the
    /// GPU) are done in 32 bits.
    narrow_div: bool,
    /// Items (so every coordinate) below 2^31: constant division by multiply-high.
    magic_div: bool,
    /// The register class of `i64` values: `B32` where [`crate::range::indices_fit_i32`] proves every
    /// one fits in 32 bits (indices are then computed in 32 bits and widened in address arithmetic
    /// only), else `B64`.
    idx: RegClass,
    /// In a group (CTA-per-item) kernel: the thread's index in the CTA (64-bit) and the predicate
    /// `tid != 0`.
    lane: Option<(Reg, Reg)>,
    /// Threads per item (the CTA size of a group kernel; 1 otherwise).
    group: i64,
    /// In a group kernel: this warp's slot of the reduction array, the array's base, and the
    /// predicate `lane in warp != 0` (shared-memory addresses, 32-bit).
    red: Option<(Reg, Reg, Reg)>,
    /// Inside a group construct (its stores are every lane's own).
    in_group: bool,
}

/// The untyped bits type of an integer register class (for `and`, `or`, `xor`, `shl`).
fn bits_ty(c: RegClass) -> PtxTy {
    if c == RegClass::B64 {
        PtxTy::B64
    } else {
        PtxTy::B32
    }
}

fn int_ty(c: RegClass) -> PtxTy {
    if c == RegClass::B64 {
        PtxTy::S64
    } else {
        PtxTy::S32
    }
}

impl Gen<'_> {
    /// `a / c` or `a % c` of a 32-bit value `a` by a constant `0 < c < 2^31`: a shift or mask for a
    /// power of two; otherwise, where the kernel's items (and so every coordinate) are below 2^31, a
    /// multiply-high by `m = ceil(2^(31+l) / c)` with `2^l >= c` (Granlund-Montgomery: exact for every
    /// `a < 2^31`); else `div.u32`/`rem.u32`. ptxas was seen to expand constant `div.u32` into a
    /// reciprocal sequence, several times the cost of these.
    fn div32(&mut self, div: bool, a32: Reg, c: i64) -> Reg {
        let q = self.b.reg(RegClass::B32);
        if c & (c - 1) == 0 {
            let k = c.trailing_zeros() as i64;
            self.b.push(Inst::Bin {
                op: if div { BinOpcode::Shr } else { BinOpcode::And },
                ty: PtxTy::B32,
                d: q,
                a: Operand::Reg(a32),
                b: Operand::Int(if div { k } else { c - 1 }),
            });
            return q;
        }
        if !self.magic_div {
            self.b.push(Inst::Bin {
                op: if div { BinOpcode::Div } else { BinOpcode::Rem },
                ty: PtxTy::U32,
                d: q,
                a: Operand::Reg(a32),
                b: Operand::Int(c),
            });
            return q;
        }
        let (m, shift) = magic_u31(c);
        let hi = self.b.reg(RegClass::B32);
        self.b.push(Inst::Bin {
            op: BinOpcode::MulHi,
            ty: PtxTy::U32,
            d: hi,
            a: Operand::Reg(a32),
            b: Operand::Int(m),
        });
        let quo = if div { q } else { self.b.reg(RegClass::B32) };
        self.b.push(Inst::Bin {
            op: BinOpcode::Shr,
            ty: PtxTy::B32,
            d: quo,
            a: Operand::Reg(hi),
            b: Operand::Int(shift),
        });
        if !div {
            let t = self.b.reg(RegClass::B32);
            self.b.push(Inst::Bin {
                op: BinOpcode::MulLo,
                ty: PtxTy::U32,
                d: t,
                a: Operand::Reg(quo),
                b: Operand::Int(c),
            });
            self.b.push(Inst::Bin {
                op: BinOpcode::Sub,
                ty: PtxTy::U32,
                d: q,
                a: Operand::Reg(a32),
                b: Operand::Reg(t),
            });
        }
        q
    }

    fn in_reg(&mut self, o: Operand, class: RegClass) -> Reg {
        match o {
            Operand::Reg(r) => r,
            imm => {
                let d = self.b.reg(class);
                let op = match class {
                    RegClass::B64 => UnOpcode::Mov(PtxTy::U64),
                    RegClass::F32 => UnOpcode::Mov(PtxTy::F32),
                    _ => UnOpcode::Mov(PtxTy::U32),
                };
                self.b.push(Inst::Un { op, d, a: imm });
                d
            }
        }
    }

    fn class_of(&self, x: &Expr) -> Result<RegClass> {
        Ok(match x {
            Expr::Var(v) => {
                self.vars
                    .get(v.0 as usize)
                    .ok_or(Error::Internal("variable"))?
                    .class
            }
            Expr::I64(_) => self.idx,
            Expr::I32(_) => RegClass::B32,
            Expr::F32(_) => RegClass::F32,
            Expr::Load { buf, .. } => reg_class(
                self.elems
                    .get(buf.0 as usize)
                    .ok_or(Error::Internal("buffer"))?
                    .ty(),
            ),
            Expr::Select(_, a, _) => self.class_of(a)?,
            Expr::Fma(..) | Expr::AbsMax(_) => RegClass::F32,
            Expr::PackE2m1 { .. } => RegClass::B32,
            Expr::LoadX4 { .. } | Expr::Splat(_) | Expr::Lane(..) => {
                return Err(Error::Internal("vector IR reached the PTX backend"))
            }
            Expr::Un(op, _) => match op.result_ty() {
                Ty::I64 => self.idx,
                t => reg_class(t),
            },
            Expr::Bin(op, a, _) => match op {
                BinOp::ILt | BinOp::IEq | BinOp::FLt | BinOp::FLe | BinOp::FEq => RegClass::Pred,
                _ => self.class_of(a)?,
            },
        })
    }

    fn addr(&mut self, buf: usize, index: &Expr) -> Result<Reg> {
        let elem = *self.elems.get(buf).ok_or(Error::Internal("buffer"))?;
        let base = *self.bases.get(buf).ok_or(Error::Internal("buffer"))?;
        let i = self.expr(index)?;
        let i = self.in_reg(i, self.idx);
        let d = self.b.reg(RegClass::B64);
        // The byte offset: a 32-bit index (non-negative, proven below 2^31) by one widening multiply.
        let off = if self.idx == RegClass::B32 || elem.size() != 1 {
            let t = self.b.reg(RegClass::B64);
            let (op, ty) = if self.idx == RegClass::B32 {
                (BinOpcode::MulWide, PtxTy::U32)
            } else {
                (BinOpcode::MulLo, PtxTy::S64)
            };
            self.b.push(Inst::Bin {
                op,
                ty,
                d: t,
                a: Operand::Reg(i),
                b: Operand::Int(elem.size() as i64),
            });
            t
        } else {
            i
        };
        self.b.push(Inst::Bin {
            op: BinOpcode::Add,
            ty: PtxTy::S64,
            d,
            a: Operand::Reg(base),
            b: Operand::Reg(off),
        });
        Ok(d)
    }

    fn expr(&mut self, x: &Expr) -> Result<Operand> {
        Ok(match x {
            Expr::Var(v) => Operand::Reg(
                *self
                    .vars
                    .get(v.0 as usize)
                    .ok_or(Error::Internal("variable"))?,
            ),
            Expr::I64(c) => Operand::Int(*c),
            Expr::I32(c) => Operand::Int(*c as i64),
            Expr::F32(c) => Operand::F32(*c),
            Expr::Load { buf, index } => {
                let elem = *self
                    .elems
                    .get(buf.0 as usize)
                    .ok_or(Error::Internal("buffer"))?;
                let addr = self.addr(buf.0 as usize, index)?;
                match elem {
                    Elem::U8 | Elem::F32 => {
                        let (class, ty) = if elem == Elem::U8 {
                            (RegClass::B32, PtxTy::U8)
                        } else {
                            (RegClass::F32, PtxTy::F32)
                        };
                        let d = self.b.reg(class);
                        self.b.push(Inst::Ld { ty, d, addr });
                        Operand::Reg(d)
                    }
                    Elem::Bf16 => {
                        let h = self.b.reg(RegClass::B32);
                        self.b.push(Inst::Ld {
                            ty: PtxTy::U16,
                            d: h,
                            addr,
                        });
                        let s = self.b.reg(RegClass::B32);
                        self.b.push(Inst::Bin {
                            op: BinOpcode::Shl,
                            ty: PtxTy::B32,
                            d: s,
                            a: Operand::Reg(h),
                            b: Operand::Int(16),
                        });
                        let d = self.b.reg(RegClass::F32);
                        self.b.push(Inst::Un {
                            op: UnOpcode::Mov(PtxTy::B32),
                            d,
                            a: Operand::Reg(s),
                        });
                        Operand::Reg(d)
                    }
                }
            }
            Expr::LoadX4 { .. } | Expr::Splat(_) | Expr::Lane(..) => {
                return Err(Error::Internal("vector IR reached the PTX backend"))
            }
            Expr::AbsMax(vals) => Operand::Reg(self.abs_max(vals)?),
            Expr::PackE2m1 { vals, .. } => {
                if vals.is_empty() || vals.len() > 8 {
                    return Err(Error::Internal("pack_e2m1 of 1 to 8 values"));
                }
                let mut regs = Vec::with_capacity(vals.len());
                for x in vals {
                    let v = self.expr(x)?;
                    regs.push(self.in_reg(v, RegClass::F32));
                }
                let d = self.b.reg(RegClass::B32);
                self.b.push(Inst::CvtE2m1Pack { d, vals: regs });
                Operand::Reg(d)
            }
            Expr::Un(UnOp::Byte(k), a) => {
                let v = self.expr(a)?;
                let a = self.in_reg(v, RegClass::B32);
                let t = self.b.reg(RegClass::B32);
                self.b.push(Inst::Bin {
                    op: BinOpcode::Shr,
                    ty: PtxTy::U32,
                    d: t,
                    a: Operand::Reg(a),
                    b: Operand::Int(8 * i64::from(*k & 3)),
                });
                let d = self.b.reg(RegClass::B32);
                self.b.push(Inst::Bin {
                    op: BinOpcode::And,
                    ty: PtxTy::B32,
                    d,
                    a: Operand::Reg(t),
                    b: Operand::Int(255),
                });
                Operand::Reg(d)
            }
            Expr::Fma(a, b, c) => {
                let mut r = Vec::with_capacity(3);
                for x in [a, b, c] {
                    let v = self.expr(x)?;
                    r.push(self.in_reg(v, RegClass::F32));
                }
                let d = self.b.reg(RegClass::F32);
                self.b.push(Inst::Fma {
                    d,
                    a: r[0],
                    b: r[1],
                    c: r[2],
                });
                Operand::Reg(d)
            }
            Expr::Select(c, a, b) => {
                let class = self.class_of(a)?;
                if class == RegClass::Pred {
                    return Err(Error::Internal("select of predicates"));
                }
                let p = self.expr(c)?;
                let p = self.in_reg(p, RegClass::Pred);
                let (a, b) = (self.expr(a)?, self.expr(b)?);
                let d = self.b.reg(class);
                let ty = match class {
                    RegClass::F32 => PtxTy::F32,
                    RegClass::B64 => PtxTy::S64,
                    _ => PtxTy::S32,
                };
                self.b.push(Inst::Selp { ty, d, a, b, p });
                Operand::Reg(d)
            }
            Expr::Un(UnOp::Widen | UnOp::Narrow, a) if self.idx == RegClass::B32 => {
                // Indices are 32-bit here: widening and narrowing change nothing.
                let v = self.expr(a)?;
                Operand::Reg(self.in_reg(v, RegClass::B32))
            }
            Expr::Un(op, a) => {
                let ac = self.class_of(a)?;
                let a = self.expr(a)?;
                let a = Operand::Reg(self.in_reg(a, ac));
                let (opc, class): (UnOpcode, RegClass) = match op {
                    UnOp::FAbs => (UnOpcode::Abs(PtxTy::F32), RegClass::F32),
                    UnOp::FRoundEven => (
                        UnOpcode::cvt_rnd(Rnd::Rni, PtxTy::F32, PtxTy::F32),
                        RegClass::F32,
                    ),
                    UnOp::F2I => (
                        UnOpcode::cvt_rnd(Rnd::Rzi, PtxTy::S32, PtxTy::F32),
                        RegClass::B32,
                    ),
                    UnOp::I2F => (
                        UnOpcode::cvt_rnd(Rnd::Rn, PtxTy::F32, PtxTy::S32),
                        RegClass::F32,
                    ),
                    UnOp::BitsOf | UnOp::FromBits => {
                        let class = if *op == UnOp::BitsOf {
                            RegClass::B32
                        } else {
                            RegClass::F32
                        };
                        (UnOpcode::Mov(PtxTy::B32), class)
                    }
                    UnOp::Byte(_) => return Err(Error::Internal("byte extraction")),
                    UnOp::Widen => (UnOpcode::cvt(PtxTy::S64, PtxTy::S32), RegClass::B64),
                    UnOp::Narrow => (UnOpcode::cvt(PtxTy::U32, PtxTy::U64), RegClass::B32),
                    UnOp::E4m3Decode => {
                        let Operand::Reg(a) = a else {
                            return Err(Error::Internal("conversion operand"));
                        };
                        let d = self.b.reg(RegClass::F32);
                        self.b.push(Inst::CvtFromE4m3 { d, a });
                        return Ok(Operand::Reg(d));
                    }
                    UnOp::E4m3 | UnOp::E2m1 => {
                        let Operand::Reg(a) = a else {
                            return Err(Error::Internal("conversion operand"));
                        };
                        let d = self.b.reg(RegClass::B32);
                        self.b.push(Inst::CvtNarrow {
                            e2m1: *op == UnOp::E2m1,
                            d,
                            a,
                        });
                        return Ok(Operand::Reg(d));
                    }
                    UnOp::BoolToI => {
                        let Operand::Reg(p) = a else {
                            return Err(Error::Internal("predicate"));
                        };
                        let d = self.b.reg(RegClass::B32);
                        self.b.push(Inst::Selp {
                            ty: PtxTy::U32,
                            d,
                            a: Operand::Int(1),
                            b: Operand::Int(0),
                            p,
                        });
                        return Ok(Operand::Reg(d));
                    }
                };
                let d = self.b.reg(class);
                self.b.push(Inst::Un { op: opc, d, a });
                Operand::Reg(d)
            }
            Expr::Bin(op @ (BinOp::IDiv | BinOp::IRem), a, b)
                if self.idx == RegClass::B32
                    && self.class_of(a)? == RegClass::B32
                    && matches!(**b, Expr::I64(c) if c > 0 && c < (1 << 31)) =>
            {
                let Expr::I64(c) = **b else {
                    return Err(Error::Internal("divisor"));
                };
                let a = self.expr(a)?;
                let a = self.in_reg(a, RegClass::B32);
                Operand::Reg(self.div32(*op == BinOp::IDiv, a, c))
            }
            Expr::Bin(op @ (BinOp::IDiv | BinOp::IRem), a, b)
                if self.narrow_div
                    && self.class_of(a)? == RegClass::B64
                    && matches!(**b, Expr::I64(c) if c > 0 && c < (1 << 31)) =>
            {
                let Expr::I64(c) = **b else {
                    return Err(Error::Internal("divisor"));
                };
                let a = self.expr(a)?;
                let a = self.in_reg(a, RegClass::B64);
                let a32 = self.b.reg(RegClass::B32);
                self.b.push(Inst::Un {
                    op: UnOpcode::cvt(PtxTy::U32, PtxTy::U64),
                    d: a32,
                    a: Operand::Reg(a),
                });
                let q = self.div32(*op == BinOp::IDiv, a32, c);
                let d = self.b.reg(RegClass::B64);
                self.b.push(Inst::Un {
                    op: UnOpcode::cvt(PtxTy::U64, PtxTy::U32),
                    d,
                    a: Operand::Reg(q),
                });
                Operand::Reg(d)
            }
            Expr::Bin(op, a, b) => {
                let ac = self.class_of(a)?;
                let a = self.expr(a)?;
                let a = Operand::Reg(self.in_reg(a, ac));
                let b = self.expr(b)?;
                let ity = int_ty(ac);
                let (opc, ty, class) = match op {
                    BinOp::IAdd => (BinOpcode::Add, ity, ac),
                    BinOp::ISub => (BinOpcode::Sub, ity, ac),
                    BinOp::IMul => (BinOpcode::MulLo, ity, ac),
                    BinOp::IDiv => (
                        BinOpcode::Div,
                        if ac == RegClass::B64 {
                            PtxTy::U64
                        } else {
                            PtxTy::U32
                        },
                        ac,
                    ),
                    BinOp::IRem => (
                        BinOpcode::Rem,
                        if ac == RegClass::B64 {
                            PtxTy::U64
                        } else {
                            PtxTy::U32
                        },
                        ac,
                    ),
                    BinOp::And => (BinOpcode::And, bits_ty(ac), ac),
                    BinOp::Or => (BinOpcode::Or, bits_ty(ac), ac),
                    BinOp::Xor => (BinOpcode::Xor, bits_ty(ac), ac),
                    BinOp::Shl => (BinOpcode::Shl, bits_ty(ac), ac),
                    BinOp::Shr => (
                        BinOpcode::Shr,
                        if ac == RegClass::B64 {
                            PtxTy::U64
                        } else {
                            PtxTy::U32
                        },
                        ac,
                    ),
                    BinOp::MulHi => (BinOpcode::MulHi, PtxTy::U32, ac),
                    BinOp::Prmt(sel) => {
                        let b = self.in_reg(b, RegClass::B32);
                        let Operand::Reg(a) = a else {
                            return Err(Error::Internal("permute operand"));
                        };
                        let d = self.b.reg(RegClass::B32);
                        self.b.push(Inst::Prmt {
                            d,
                            a,
                            b,
                            sel: i64::from(*sel),
                        });
                        return Ok(Operand::Reg(d));
                    }
                    BinOp::FAdd => (BinOpcode::AddRn, PtxTy::F32, RegClass::F32),
                    BinOp::FMul => (BinOpcode::MulRn, PtxTy::F32, RegClass::F32),
                    BinOp::FDiv => (BinOpcode::DivRn, PtxTy::F32, RegClass::F32),
                    BinOp::FMax => (BinOpcode::Max, PtxTy::F32, RegClass::F32),
                    BinOp::FMin => (BinOpcode::Min, PtxTy::F32, RegClass::F32),
                    BinOp::ILt | BinOp::IEq | BinOp::FLt | BinOp::FLe | BinOp::FEq => {
                        let (cmp, ty) = match op {
                            BinOp::ILt => (CmpOp::Lt, ity),
                            BinOp::IEq => (CmpOp::Eq, ity),
                            BinOp::FLt => (CmpOp::Lt, PtxTy::F32),
                            BinOp::FLe => (CmpOp::Le, PtxTy::F32),
                            _ => (CmpOp::Eq, PtxTy::F32),
                        };
                        let p = self.b.reg(RegClass::Pred);
                        self.b.push(Inst::Setp { cmp, ty, p, a, b });
                        return Ok(Operand::Reg(p));
                    }
                };
                let d = self.b.reg(class);
                self.b.push(Inst::Bin {
                    op: opc,
                    ty,
                    d,
                    a,
                    b,
                });
                Operand::Reg(d)
            }
        })
    }

    /// `max |x|` over `vals`: where they are exactly the two halves of some loaded bf16 words, a
    /// tree of `max.xorsign.abs.bf16x2` over the words (each half the larger magnitude; the sign is
    /// dropped at the end), then the larger half as f32; otherwise a tree of f32 maxima.
    fn abs_max(&mut self, vals: &[Expr]) -> Result<Reg> {
        let mut regs = Vec::with_capacity(vals.len());
        for x in vals {
            let v = self.expr(x)?;
            regs.push(self.in_reg(v, RegClass::F32));
        }
        let mut words: Vec<Reg> = Vec::new();
        let mut seen: std::collections::HashMap<Reg, u8> = std::collections::HashMap::new();
        let mut packed = !regs.is_empty();
        for r in &regs {
            match self.halves.get(r) {
                Some(&(w, half)) => {
                    let m = seen.entry(w).or_insert_with(|| {
                        words.push(w);
                        0
                    });
                    if *m & (1 << half) != 0 {
                        packed = false;
                    }
                    *m |= 1 << half;
                }
                None => packed = false,
            }
        }
        packed &= seen.values().all(|&m| m == 3);
        let mut level: Vec<Reg> = if packed {
            let w = self.tree(
                words,
                RegClass::B32,
                BinOpcode::MaxXorsignAbs,
                PtxTy::Bf16x2,
            )?;
            (0..2)
                .map(|half| {
                    let f = self.b.reg(RegClass::F32);
                    self.bf16_half(f, w, half);
                    f
                })
                .collect()
        } else {
            regs
        };
        for r in level.iter_mut() {
            let d = self.b.reg(RegClass::F32);
            self.b.push(Inst::Un {
                op: UnOpcode::Abs(PtxTy::F32),
                d,
                a: Operand::Reg(*r),
            });
            *r = d;
        }
        self.tree(level, RegClass::F32, BinOpcode::Max, PtxTy::F32)
    }

    /// A balanced tree of the binary `op` over `regs` (short dependency chains).
    fn tree(
        &mut self,
        mut regs: Vec<Reg>,
        class: RegClass,
        op: BinOpcode,
        ty: PtxTy,
    ) -> Result<Reg> {
        while regs.len() > 1 {
            let mut next = Vec::with_capacity(regs.len().div_ceil(2));
            for pair in regs.chunks(2) {
                if let [a, b] = pair {
                    let d = self.b.reg(class);
                    self.b.push(Inst::Bin {
                        op,
                        ty,
                        d,
                        a: Operand::Reg(*a),
                        b: Operand::Reg(*b),
                    });
                    next.push(d);
                } else {
                    next.extend_from_slice(pair);
                }
            }
            regs = next;
        }
        regs.pop().ok_or(Error::Internal("reduction of no values"))
    }

    /// `d` (f32) = the bf16 in half `half` (0 low, 1 high) of the 32-bit word `w`.
    fn bf16_half(&mut self, d: Reg, w: Reg, half: usize) {
        let t = self.b.reg(RegClass::B32);
        let (op, k) = if half == 0 {
            (BinOpcode::Shl, 16)
        } else {
            (BinOpcode::And, 0xFFFF_0000)
        };
        self.b.push(Inst::Bin {
            op,
            ty: PtxTy::B32,
            d: t,
            a: Operand::Reg(w),
            b: Operand::Int(k),
        });
        self.b.push(Inst::Un {
            op: UnOpcode::Mov(PtxTy::B32),
            d,
            a: Operand::Reg(t),
        });
    }

    fn assign(&mut self, dst: Reg, x: &Expr) -> Result<()> {
        let v = self.expr(x)?;
        self.halves.remove(&dst);
        let op = match dst.class {
            RegClass::B64 => UnOpcode::Mov(PtxTy::U64),
            RegClass::F32 => UnOpcode::Mov(PtxTy::F32),
            RegClass::B32 => UnOpcode::Mov(PtxTy::U32),
            RegClass::Pred => UnOpcode::Mov(PtxTy::Pred),
        };
        self.b.push(Inst::Un { op, d: dst, a: v });
        Ok(())
    }

    fn stmts(&mut self, body: &[Stmt]) -> Result<()> {
        for s in body {
            // In a group kernel, stores outside the group constructs are lane 0's alone.
            let guard = match (self.lane, self.in_group, s) {
                (
                    Some((_, not0)),
                    false,
                    Stmt::Store { .. } | Stmt::StorePacked { .. } | Stmt::AtomicMaxF32 { .. },
                ) => {
                    let skip = self.b.label("lane0");
                    self.b.push(Inst::Bra {
                        label: skip.clone(),
                        pred: Some((not0, false)),
                    });
                    Some(skip)
                }
                _ => None,
            };
            self.stmt(s)?;
            if let Some(skip) = guard {
                self.b.push(Inst::Label(skip));
            }
        }
        Ok(())
    }

    /// `var = lane; while var < count { body; var += 32 }` (the group loop of one lane).
    fn lane_loop(
        &mut self,
        var: Reg,
        count: &Expr,
        unroll: bool,
        body: &mut dyn FnMut(&mut Self) -> Result<()>,
    ) -> Result<()> {
        let (lane, _) = self
            .lane
            .ok_or(Error::Internal("group construct outside a group kernel"))?;
        if self.in_group {
            return Err(Error::Internal("nested group construct"));
        }
        // Every thread makes the same number of trips (a constant multiple of the group size, at
        // most 16): straight-line copies of the body, so that all their loads can be in flight at once.
        if let (Expr::I64(c), true) = (count, unroll) {
            let (c, trips) = (*c, *c / self.group);
            if c > 0 && c % self.group == 0 && trips <= 16 {
                self.in_group = true;
                let mut r = Ok(());
                for t in 0..trips {
                    self.b.push(Inst::Bin {
                        op: BinOpcode::Add,
                        ty: int_ty(self.idx),
                        d: var,
                        a: Operand::Reg(lane),
                        b: Operand::Int(t * self.group),
                    });
                    r = body(self);
                    if r.is_err() {
                        break;
                    }
                }
                self.in_group = false;
                return r;
            }
        }
        let end = self.expr(count)?;
        let end = Operand::Reg(self.in_reg(end, self.idx));
        self.b.push(Inst::Un {
            op: if self.idx == RegClass::B32 {
                UnOpcode::Mov(PtxTy::U32)
            } else {
                UnOpcode::Mov(PtxTy::U64)
            },
            d: var,
            a: Operand::Reg(lane),
        });
        let step = Operand::Int(self.group);
        self.counted_loop(var, end, step, ("lanes", "lanes_done"), &mut |g| {
            g.in_group = true;
            let r = body(g);
            g.in_group = false;
            r
        })
    }

    /// `while var < end { body; var += step }` (signed, of `var`'s width), with labels named `names`.
    fn counted_loop(
        &mut self,
        var: Reg,
        end: Operand,
        step: Operand,
        names: (&str, &str),
        body: &mut dyn FnMut(&mut Self) -> Result<()>,
    ) -> Result<()> {
        let head = self.b.label(names.0);
        let done = self.b.label(names.1);
        self.b.push(Inst::Label(head.clone()));
        let p = self.b.reg(RegClass::Pred);
        self.b.push(Inst::Setp {
            cmp: CmpOp::Ge,
            ty: int_ty(var.class),
            p,
            a: Operand::Reg(var),
            b: end,
        });
        self.b.push(Inst::Bra {
            label: done.clone(),
            pred: Some((p, false)),
        });
        body(self)?;
        self.b.push(Inst::Bin {
            op: BinOpcode::Add,
            ty: int_ty(var.class),
            d: var,
            a: Operand::Reg(var),
            b: step,
        });
        self.b.push(Inst::Bra {
            label: head,
            pred: None,
        });
        self.b.push(Inst::Label(done));
        Ok(())
    }

    /// The group's maximum of every thread's `acc`, left in `acc` on every thread. Butterfly: after
    /// five exchanges every lane holds its warp's maximum; in a CTA group, lane 0 of each warp then
    /// puts it in shared memory (after a barrier, so that no thread still reads the previous
    /// reduction's values), and after a second barrier every thread reads them all.
    fn reduce_max(&mut self, acc: Reg) {
        for mask in [16, 8, 4, 2, 1] {
            let t = self.b.reg(RegClass::F32);
            self.b.push(Inst::ShflBfly { d: t, a: acc, mask });
            self.b.push(Inst::Bin {
                op: BinOpcode::Max,
                ty: PtxTy::F32,
                d: acc,
                a: Operand::Reg(acc),
                b: Operand::Reg(t),
            });
        }
        let Some((slot, base, wnot0)) = self.red else {
            return;
        };
        self.b.push(Inst::BarSync);
        let skip = self.b.label("warp0");
        self.b.push(Inst::Bra {
            label: skip.clone(),
            pred: Some((wnot0, false)),
        });
        self.b.push(Inst::StShared { addr: slot, v: acc });
        self.b.push(Inst::Label(skip));
        self.b.push(Inst::BarSync);
        for w in 0..self.group / 32 {
            let t = self.b.reg(RegClass::F32);
            self.b.push(Inst::LdShared {
                d: t,
                addr: base,
                off: 4 * w,
            });
            self.b.push(Inst::Bin {
                op: BinOpcode::Max,
                ty: PtxTy::F32,
                d: acc,
                a: Operand::Reg(acc),
                b: Operand::Reg(t),
            });
        }
    }

    /// [`Stmt::GroupRow`]: where every thread makes the same number of trips (at most 16), each
    /// trip's loads get registers of their own, kept from the first pass to the second; otherwise a
    /// group maximum and a group loop that loads again.
    fn group_row(&mut self, g: &GroupRow) -> Result<()> {
        let GroupRow {
            var,
            sub,
            count,
            load,
            value,
            mid,
            body,
        } = g;
        let (var, sub) = (*var, *sub);
        let reg = |g: &Self, v: Var| {
            g.vars
                .get(v.0 as usize)
                .copied()
                .ok_or(Error::Internal("variable"))
        };
        let acc = reg(self, var)?;
        let (lane, _) = self
            .lane
            .ok_or(Error::Internal("group construct outside a group kernel"))?;
        let trips = match *count {
            Expr::I64(c) if c > 0 && c % self.group == 0 && c / self.group <= 16 => c / self.group,
            _ => 0,
        };
        if trips == 0 {
            return self.stmts(&crate::kir::group_row_passes(g.clone()));
        }
        let mut defs = vec![sub];
        defined(load, &mut defs);
        let saved: Vec<Reg> = defs.iter().map(|v| reg(self, *v)).collect::<Result<_>>()?;
        self.b.push(Inst::Un {
            op: UnOpcode::Mov(PtxTy::F32),
            d: acc,
            a: Operand::F32(0.0),
        });
        self.in_group = true;
        let mut per_trip: Vec<Vec<Reg>> = Vec::with_capacity(trips as usize);
        for t in 0..trips {
            let regs: Vec<Reg> = saved.iter().map(|r| self.b.reg(r.class)).collect();
            for (v, r) in defs.iter().zip(&regs) {
                self.vars[v.0 as usize] = *r;
            }
            self.b.push(Inst::Bin {
                op: BinOpcode::Add,
                ty: int_ty(self.idx),
                d: regs[0],
                a: Operand::Reg(lane),
                b: Operand::Int(t * self.group),
            });
            let r = self.stmts(load).and_then(|_| {
                let v = self.expr(value)?;
                let v = self.in_reg(v, RegClass::F32);
                self.b.push(Inst::Bin {
                    op: BinOpcode::Max,
                    ty: PtxTy::F32,
                    d: acc,
                    a: Operand::Reg(acc),
                    b: Operand::Reg(v),
                });
                Ok(())
            });
            if let Err(e) = r {
                self.in_group = false;
                return Err(e);
            }
            per_trip.push(regs);
        }
        self.in_group = false;
        for (v, r) in defs.iter().zip(&saved) {
            self.vars[v.0 as usize] = *r;
        }
        self.reduce_max(acc);
        self.stmts(mid)?;
        self.in_group = true;
        let mut result = Ok(());
        for regs in &per_trip {
            for (v, r) in defs.iter().zip(regs) {
                self.vars[v.0 as usize] = *r;
            }
            result = self.stmts(body);
            if result.is_err() {
                break;
            }
        }
        self.in_group = false;
        for (v, r) in defs.iter().zip(&saved) {
            self.vars[v.0 as usize] = *r;
        }
        result
    }

    fn stmt(&mut self, s: &Stmt) -> Result<()> {
        // Which registers hold loaded bf16 halves is known within straight-line code only: a branch
        // or loop may skip a load while another path wrote the register.
        let control = !matches!(
            s,
            Stmt::Set(..)
                | Stmt::Store { .. }
                | Stmt::LoadPacked { .. }
                | Stmt::StorePacked { .. }
                | Stmt::AtomicMaxF32 { .. }
        );
        if control {
            self.halves.clear();
        }
        let r = self.stmt_inner(s);
        if control {
            self.halves.clear();
        }
        r
    }

    fn stmt_inner(&mut self, s: &Stmt) -> Result<()> {
        match s {
            Stmt::Set(v, x) => {
                let dst = *self
                    .vars
                    .get(v.0 as usize)
                    .ok_or(Error::Internal("variable"))?;
                self.assign(dst, x)?;
            }
            Stmt::For {
                var,
                start,
                end,
                body,
            } => {
                let r = *self
                    .vars
                    .get(var.0 as usize)
                    .ok_or(Error::Internal("variable"))?;
                self.assign(r, start)?;
                let end = self.expr(end)?;
                let end = Operand::Reg(self.in_reg(end, self.idx));
                self.counted_loop(r, end, Operand::Int(1), ("loop", "done"), &mut |g| {
                    g.stmts(body)
                })?;
            }
            Stmt::If { cond, then } => {
                let p = self.expr(cond)?;
                let p = self.in_reg(p, RegClass::Pred);
                let skip = self.b.label("endif");
                self.b.push(Inst::Bra {
                    label: skip.clone(),
                    pred: Some((p, true)),
                });
                self.stmts(then)?;
                self.b.push(Inst::Label(skip));
            }
            Stmt::Store { buf, index, value } => {
                let elem = *self
                    .elems
                    .get(buf.0 as usize)
                    .ok_or(Error::Internal("buffer"))?;
                let addr = self.addr(buf.0 as usize, index)?;
                let v = self.expr(value)?;
                match elem {
                    Elem::U8 => {
                        let v = self.in_reg(v, RegClass::B32);
                        self.b.push(Inst::St {
                            ty: PtxTy::U8,
                            addr,
                            v,
                        });
                    }
                    Elem::F32 => {
                        let v = self.in_reg(v, RegClass::F32);
                        self.b.push(Inst::St {
                            ty: PtxTy::F32,
                            addr,
                            v,
                        });
                    }
                    Elem::Bf16 => {
                        let v = self.in_reg(v, RegClass::F32);
                        let bits = self.b.reg(RegClass::B32);
                        self.b.push(Inst::Un {
                            op: UnOpcode::Mov(PtxTy::B32),
                            d: bits,
                            a: Operand::Reg(v),
                        });
                        let hi = self.b.reg(RegClass::B32);
                        self.b.push(Inst::Bin {
                            op: BinOpcode::Shr,
                            ty: PtxTy::U32,
                            d: hi,
                            a: Operand::Reg(bits),
                            b: Operand::Int(16),
                        });
                        self.b.push(Inst::St {
                            ty: PtxTy::U16,
                            addr,
                            v: hi,
                        });
                    }
                }
            }
            Stmt::LoadPacked { buf, index, dst } => {
                let elem = *self
                    .elems
                    .get(buf.0 as usize)
                    .ok_or(Error::Internal("buffer"))?;
                let bytes = dst.len() * elem.size();
                let nw = bytes / 4;
                if bytes % 4 != 0 || !matches!(nw, 1 | 2 | 4) {
                    // No vector form: element loads.
                    for (k, v) in dst.iter().enumerate() {
                        let r = *self
                            .vars
                            .get(v.0 as usize)
                            .ok_or(Error::Internal("variable"))?;
                        let at = Expr::Bin(
                            BinOp::IAdd,
                            Box::new(index.clone()),
                            Box::new(Expr::I64(k as i64)),
                        );
                        self.assign(
                            r,
                            &Expr::Load {
                                buf: *buf,
                                index: Box::new(at),
                            },
                        )?;
                    }
                    return Ok(());
                }
                let addr = self.addr(buf.0 as usize, index)?;
                let words: Vec<Reg> = (0..nw).map(|_| self.b.reg(RegClass::B32)).collect();
                let nc = self.readonly.get(buf.0 as usize).copied().unwrap_or(false);
                self.b.push(Inst::LdV {
                    nc,
                    words: words.clone(),
                    addr,
                });
                for (k, v) in dst.iter().enumerate() {
                    let d = *self
                        .vars
                        .get(v.0 as usize)
                        .ok_or(Error::Internal("variable"))?;
                    if elem == Elem::Bf16 {
                        self.halves.insert(d, (words[k / 2], (k % 2) as u8));
                    } else {
                        self.halves.remove(&d);
                    }
                    match elem {
                        Elem::F32 => self.b.push(Inst::Un {
                            op: UnOpcode::Mov(PtxTy::B32),
                            d,
                            a: Operand::Reg(words[k]),
                        }),
                        Elem::Bf16 => self.bf16_half(d, words[k / 2], k % 2),
                        Elem::U8 => {
                            let t = self.b.reg(RegClass::B32);
                            let w = Operand::Reg(words[k / 4]);
                            self.b.push(Inst::Bin {
                                op: BinOpcode::Shr,
                                ty: PtxTy::U32,
                                d: t,
                                a: w,
                                b: Operand::Int(8 * (k % 4) as i64),
                            });
                            self.b.push(Inst::Bin {
                                op: BinOpcode::And,
                                ty: PtxTy::B32,
                                d,
                                a: Operand::Reg(t),
                                b: Operand::Int(0xFF),
                            });
                        }
                    }
                }
            }
            Stmt::StorePacked { buf, index, values } => {
                let elem = *self
                    .elems
                    .get(buf.0 as usize)
                    .ok_or(Error::Internal("buffer"))?;
                let bytes = values.len() * elem.size();
                let nw = bytes / 4;
                if bytes % 4 != 0 || !matches!(nw, 1 | 2 | 4) {
                    for (k, x) in values.iter().enumerate() {
                        let at = Expr::Bin(
                            BinOp::IAdd,
                            Box::new(index.clone()),
                            Box::new(Expr::I64(k as i64)),
                        );
                        self.stmts(&[Stmt::Store {
                            buf: *buf,
                            index: at,
                            value: x.clone(),
                        }])?;
                    }
                    return Ok(());
                }
                if elem == Elem::U8 {
                    // Four low bytes to a word with three byte permutes (no masking or shifts);
                    // bytes 0-3 of one word, in order, are that word.
                    let mut words = Vec::with_capacity(nw);
                    for q in values.chunks(4) {
                        let whole = match &q[0] {
                            Expr::Un(UnOp::Byte(0), w) => (1..4).all(|k| {
                                matches!(&q[k], Expr::Un(UnOp::Byte(j), w2) if *j as usize == k && w2 == w)
                            }).then_some(w),
                            _ => None,
                        };
                        if let Some(w) = whole {
                            let v = self.expr(w)?;
                            words.push(self.in_reg(v, RegClass::B32));
                            continue;
                        }
                        let mut regs = Vec::with_capacity(4);
                        for x in q {
                            let v = self.expr(x)?;
                            regs.push(self.in_reg(v, RegClass::B32));
                        }
                        let [t1, t2, w] = [0; 3].map(|_| self.b.reg(RegClass::B32));
                        self.b.push(Inst::Prmt {
                            d: t1,
                            a: regs[0],
                            b: regs[1],
                            sel: 0x0040,
                        });
                        self.b.push(Inst::Prmt {
                            d: t2,
                            a: regs[2],
                            b: regs[3],
                            sel: 0x0040,
                        });
                        self.b.push(Inst::Prmt {
                            d: w,
                            a: t1,
                            b: t2,
                            sel: 0x5410,
                        });
                        words.push(w);
                    }
                    let addr = self.addr(buf.0 as usize, index)?;
                    self.b.push(Inst::StV { words, addr });
                    return Ok(());
                }
                // Each value as its bits in the low bits of a 32-bit register.
                let per = 4 / elem.size();
                let mut parts: Vec<Reg> = Vec::new();
                for x in values {
                    let v = self.expr(x)?;
                    let r = match elem {
                        Elem::U8 => {
                            let v = self.in_reg(v, RegClass::B32);
                            let t = self.b.reg(RegClass::B32);
                            self.b.push(Inst::Bin {
                                op: BinOpcode::And,
                                ty: PtxTy::B32,
                                d: t,
                                a: Operand::Reg(v),
                                b: Operand::Int(0xFF),
                            });
                            t
                        }
                        Elem::Bf16 | Elem::F32 => {
                            let v = self.in_reg(v, RegClass::F32);
                            let t = self.b.reg(RegClass::B32);
                            self.b.push(Inst::Un {
                                op: UnOpcode::Mov(PtxTy::B32),
                                d: t,
                                a: Operand::Reg(v),
                            });
                            if elem == Elem::Bf16 {
                                let h = self.b.reg(RegClass::B32);
                                self.b.push(Inst::Bin {
                                    op: BinOpcode::Shr,
                                    ty: PtxTy::U32,
                                    d: h,
                                    a: Operand::Reg(t),
                                    b: Operand::Int(16),
                                });
                                h
                            } else {
                                t
                            }
                        }
                    };
                    parts.push(r);
                }
                let mut words = Vec::with_capacity(nw);
                for w in 0..nw {
                    let mut acc = parts[w * per];
                    for j in 1..per {
                        let sh = self.b.reg(RegClass::B32);
                        let bits = (8 * elem.size() * j) as i64;
                        self.b.push(Inst::Bin {
                            op: BinOpcode::Shl,
                            ty: PtxTy::B32,
                            d: sh,
                            a: Operand::Reg(parts[w * per + j]),
                            b: Operand::Int(bits),
                        });
                        let o = self.b.reg(RegClass::B32);
                        self.b.push(Inst::Bin {
                            op: BinOpcode::Or,
                            ty: PtxTy::B32,
                            d: o,
                            a: Operand::Reg(acc),
                            b: Operand::Reg(sh),
                        });
                        acc = o;
                    }
                    words.push(acc);
                }
                let addr = self.addr(buf.0 as usize, index)?;
                self.b.push(Inst::StV { words, addr });
            }
            Stmt::GroupFor { var, count, body } => {
                let r = *self
                    .vars
                    .get(var.0 as usize)
                    .ok_or(Error::Internal("variable"))?;
                self.lane_loop(r, count, false, &mut |g| g.stmts(body))?;
            }
            Stmt::GroupMax {
                var,
                sub,
                count,
                body,
                value,
            } => {
                let [acc, r] = [var, sub].map(|v| self.vars.get(v.0 as usize).copied());
                let (acc, r) = (
                    acc.ok_or(Error::Internal("variable"))?,
                    r.ok_or(Error::Internal("variable"))?,
                );
                self.b.push(Inst::Un {
                    op: UnOpcode::Mov(PtxTy::F32),
                    d: acc,
                    a: Operand::F32(0.0),
                });
                self.lane_loop(r, count, true, &mut |g| {
                    g.stmts(body)?;
                    let v = g.expr(value)?;
                    let v = g.in_reg(v, RegClass::F32);
                    g.b.push(Inst::Bin {
                        op: BinOpcode::Max,
                        ty: PtxTy::F32,
                        d: acc,
                        a: Operand::Reg(acc),
                        b: Operand::Reg(v),
                    });
                    Ok(())
                })?;
                self.reduce_max(acc);
            }
            Stmt::GroupRow(g) => self.group_row(g)?,
            Stmt::AtomicMaxF32 { buf, index, value } => {
                let addr = self.addr(buf.0 as usize, index)?;
                let v = self.expr(value)?;
                let v = self.in_reg(v, RegClass::F32);
                let bits = self.b.reg(RegClass::B32);
                self.b.push(Inst::Un {
                    op: UnOpcode::Mov(PtxTy::B32),
                    d: bits,
                    a: Operand::Reg(v),
                });
                self.b.push(Inst::RedMaxU32 { addr, v: bits });
            }
        }

        Ok(())
    }
}

/// Every variable a block assigns (sets, packed-load destinations, loop variables), in order.
fn defined(body: &[Stmt], out: &mut Vec<Var>) {
    for v in crate::visit::defined_vars(body) {
        if !out.contains(&v) {
            out.push(v);
        }
    }
}

/// The PTX of one kernel (an `.entry`), taking one pointer per program buffer.
pub fn kernel_ptx(k: &Kernel, elems: &[Elem], readonly: &[bool]) -> Result<String> {
    if k.var_types.iter().any(|t| t.is_vector()) {
        return Err(Error::Internal(
            "vector IR reached the PTX backend (plan with `x4: false`)",
        ));
    }
    let mut g = Gen {
        b: Builder::default(),
        halves: std::collections::HashMap::new(),
        vars: Vec::new(),
        bases: Vec::new(),
        elems,
        readonly,
        narrow_div: k.items < (1i64 << 32),
        magic_div: k.items < (1i64 << 31),
        idx: if !k.wide_index && crate::range::indices_fit_i32(k) {
            RegClass::B32
        } else {
            RegClass::B64
        },
        lane: None,
        in_group: false,
        group: k.group as i64,
        red: None,
    };
    if k.group != 1 && (!k.group.is_multiple_of(32) || k.group > 1024) {
        return Err(Error::Internal(
            "group size not a whole number of warps up to 1024",
        ));
    }
    for t in &k.var_types {
        let r = g.b.reg(if *t == Ty::I64 { g.idx } else { reg_class(*t) });
        g.vars.push(r);
    }
    // One 16-byte aligned global pointer per program buffer, in program order.
    let mut entry = Entry::new(k.name.clone());
    entry.params = (0..elems.len())
        .map(|i| Param::global_ptr(format!("{}_param_{i}", k.name), 16))
        .collect();
    entry.maxnreg = k.maxnreg;
    for p in &entry.params {
        let gen = g.b.reg(RegClass::B64);
        g.b.push(Inst::LdParam {
            ty: PtxTy::U64,
            d: gen,
            name: p.name.clone(),
        });
        let glob = g.b.reg(RegClass::B64);
        g.b.push(Inst::Cvta { d: glob, a: gen });
        g.bases.push(glob);
    }
    // item = ctaid.x * ntid.x + tid.x; stride = nctaid.x * ntid.x (64-bit).
    let [ctaid, ntid, tid, nctaid] = [
        g.b.reg(RegClass::B32),
        g.b.reg(RegClass::B32),
        g.b.reg(RegClass::B32),
        g.b.reg(RegClass::B32),
    ];
    for (d, name) in [
        (ctaid, SpecialReg::CtaidX),
        (ntid, SpecialReg::NtidX),
        (tid, SpecialReg::TidX),
        (nctaid, SpecialReg::NctaidX),
    ] {
        g.b.push(Inst::Special { d, name });
    }
    let item_var = *g
        .vars
        .get(k.item.0 as usize)
        .ok_or(Error::Internal("item variable"))?;
    // The item, its stride and the lane are set up in 64 bits, then narrowed where indices are
    // 32-bit (once per thread).
    let item = if g.idx == RegClass::B32 {
        g.b.reg(RegClass::B64)
    } else {
        item_var
    };
    let base = g.b.reg(RegClass::B64);
    g.b.push(Inst::MulWide {
        d: base,
        a: ctaid,
        b: ntid,
    });
    let tid64 = g.b.reg(RegClass::B64);
    g.b.push(Inst::Un {
        op: UnOpcode::cvt(PtxTy::U64, PtxTy::U32),
        d: tid64,
        a: Operand::Reg(tid),
    });
    g.b.push(Inst::Bin {
        op: BinOpcode::Add,
        ty: PtxTy::S64,
        d: item,
        a: Operand::Reg(base),
        b: Operand::Reg(tid64),
    });
    let stride = g.b.reg(RegClass::B64);
    g.b.push(Inst::MulWide {
        d: stride,
        a: nctaid,
        b: ntid,
    });
    let red_sym = format!("{}_red", k.name);
    if k.group == 32 {
        // One warp per item: item = global thread / 32, stride = threads / 32; every lane of a warp
        // sees the same items, so the item loop is uniform across the warp and its shuffles.
        for r in [item, stride] {
            g.b.push(Inst::Bin {
                op: BinOpcode::Shr,
                ty: PtxTy::U64,
                d: r,
                a: Operand::Reg(r),
                b: Operand::Int(5),
            });
        }
        let lane = g.b.reg(RegClass::B64);
        g.b.push(Inst::Bin {
            op: BinOpcode::And,
            ty: PtxTy::B64,
            d: lane,
            a: Operand::Reg(tid64),
            b: Operand::Int(31),
        });
        let not0 = g.b.reg(RegClass::Pred);
        g.b.push(Inst::Setp {
            cmp: CmpOp::Ne,
            ty: PtxTy::S64,
            p: not0,
            a: Operand::Reg(lane),
            b: Operand::Int(0),
        });
        g.lane = Some((lane, not0));
    } else if k.group > 1 {
        // One CTA of `group` threads per item: item = ctaid.x, stride = nctaid.x, and the thread's
        // index in the CTA is its lane in the group loops (the item loop is uniform across the CTA,
        // so its barriers are reached by every thread).
        g.b.push(Inst::Un {
            op: UnOpcode::cvt(PtxTy::U64, PtxTy::U32),
            d: item,
            a: Operand::Reg(ctaid),
        });
        g.b.push(Inst::Un {
            op: UnOpcode::cvt(PtxTy::U64, PtxTy::U32),
            d: stride,
            a: Operand::Reg(nctaid),
        });
        let not0 = g.b.reg(RegClass::Pred);
        g.b.push(Inst::Setp {
            cmp: CmpOp::Ne,
            ty: PtxTy::S64,
            p: not0,
            a: Operand::Reg(tid64),
            b: Operand::Int(0),
        });
        g.lane = Some((tid64, not0));
        let base = g.b.reg(RegClass::B32);
        g.b.push(Inst::MovSym {
            d: base,
            sym: red_sym.clone(),
        });
        let w = g.b.reg(RegClass::B32);
        g.b.push(Inst::Bin {
            op: BinOpcode::Shr,
            ty: PtxTy::B32,
            d: w,
            a: Operand::Reg(tid),
            b: Operand::Int(5),
        });
        let slot = g.b.reg(RegClass::B32);
        g.b.push(Inst::Bin {
            op: BinOpcode::Shl,
            ty: PtxTy::B32,
            d: slot,
            a: Operand::Reg(w),
            b: Operand::Int(2),
        });
        g.b.push(Inst::Bin {
            op: BinOpcode::Add,
            ty: PtxTy::U32,
            d: slot,
            a: Operand::Reg(slot),
            b: Operand::Reg(base),
        });
        let wl = g.b.reg(RegClass::B32);
        g.b.push(Inst::Bin {
            op: BinOpcode::And,
            ty: PtxTy::B32,
            d: wl,
            a: Operand::Reg(tid),
            b: Operand::Int(31),
        });
        let wnot0 = g.b.reg(RegClass::Pred);
        g.b.push(Inst::Setp {
            cmp: CmpOp::Ne,
            ty: PtxTy::S32,
            p: wnot0,
            a: Operand::Reg(wl),
            b: Operand::Int(0),
        });
        g.red = Some((slot, base, wnot0));
    }
    let stride = if g.idx == RegClass::B32 {
        let narrow = |g: &mut Gen<'_>, d: Reg, a: Reg| {
            g.b.push(Inst::Un {
                op: UnOpcode::cvt(PtxTy::U32, PtxTy::U64),
                d,
                a: Operand::Reg(a),
            })
        };
        narrow(&mut g, item_var, item);
        let s32 = g.b.reg(RegClass::B32);
        narrow(&mut g, s32, stride);
        if let Some((lane, not0)) = g.lane {
            let l32 = g.b.reg(RegClass::B32);
            narrow(&mut g, l32, lane);
            g.lane = Some((l32, not0));
        }
        s32
    } else {
        stride
    };
    g.counted_loop(
        item_var,
        Operand::Int(k.items),
        Operand::Reg(stride),
        ("item", "exit"),
        &mut |g| g.stmts(&k.body),
    )?;
    g.b.push(Inst::Ret);

    let mut s = String::new();
    let _ = writeln!(s, "// {} work items", k.items);
    s.push_str(&entry.header()?);
    s.push_str(&g.b.decls());
    if k.group > 32 {
        let _ = writeln!(s, "\t.shared .align 4 .f32 \t{red_sym}[{}];", k.group / 32);
    }
    s.push('\n');
    for i in &g.b.insts {
        let _ = writeln!(s, "{i}");
    }
    let _ = writeln!(s, "}}");
    Ok(s)
}

/// The PTX module of a whole program for a target.
pub fn compile(prog: &Program, target: Target) -> Result<String> {
    if !target.is_gpu() {
        return Err(Error::Target(format!(
            "PTX is generated for sm_90a and sm_100a, not `{}`",
            target.name()
        )));
    }
    let elems: Vec<Elem> = prog.bufs.iter().map(|b| b.elem).collect();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "//\n// Generated by moeforge {} from recipe `{}`",
        env!("CARGO_PKG_VERSION"),
        prog.recipe
    );
    let _ = writeln!(
        s,
        "// Buffers (one .u64 kernel parameter each, in this order):"
    );
    for (i, b) in prog.bufs.iter().enumerate() {
        let _ = writeln!(s, "//   {i}: {} {}[{}]", b.name(), b.elem.name(), b.len);
    }
    let _ = writeln!(
        s,
        "//\n\n.version {PTX_VERSION}\n.target {}\n.address_size 64\n",
        target.name()
    );
    let readonly: Vec<bool> = prog
        .bufs
        .iter()
        .map(|b| matches!(b.role, crate::kir::BufRole::Input(_)))
        .collect();
    // Conversions the target lacks become integer sequences first.
    let prog = crate::quant::soften(prog, &|op| native(target, op));
    for k in prog.kernels() {
        s.push_str(&kernel_ptx(k, &elems, &readonly)?);
        s.push('\n');
    }
    Ok(s)
}

#[cfg(test)]
mod magic_tests {
    use super::magic_u31;

    #[test]
    fn magic_division_is_exact_below_2_pow_31() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for c in (2i64..600).chain([448, 7168, 14336, 4096 * 7, 29_360_128, (1 << 31) - 1]) {
            let (m, sh) = magic_u31(c);
            assert!((0..1i64 << 32).contains(&m), "c={c} m={m}");
            let check = |a: u64| {
                let q = ((a * m as u64) >> 32) >> sh;
                assert_eq!(q, a / c as u64, "a={a} c={c}");
            };
            for a in [0, 1, c as u64 - 1, c as u64, (1 << 31) - 1, (1 << 31) - 2] {
                check(a);
            }
            let top = ((1u64 << 31) - 1) / c as u64;
            for k in [top, top.saturating_sub(1)] {
                check(k * c as u64);
                check((k * c as u64).saturating_sub(1));
            }
            for _ in 0..2000 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                check(x % (1 << 31));
            }
        }
    }
}
