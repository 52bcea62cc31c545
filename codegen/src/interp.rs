//! The reference interpreter: runs a kernel-IR [`Program`] in plain Rust, one work item at a time.
//! Slow and obviously correct; the host and PTX backends are tested against it.

use crate::kir::{BinOp, Elem, Expr, Kernel, Program, Step, Stmt, UnOp};
use crate::{Collective, Error, Result};

#[derive(Debug, Clone, Copy, PartialEq)]
enum Val {
    I64(i64),
    I32(i32),
    F32(f32),
    Bool(bool),
    F32x4([f32; 4]),
    I32x4([i32; 4]),
    Boolx4([bool; 4]),
}

impl Val {
    fn is_vector(self) -> bool {
        matches!(self, Val::F32x4(_) | Val::I32x4(_) | Val::Boolx4(_))
    }

    /// Lane `k` of a vector, or the scalar itself (broadcast).
    fn lane(self, k: usize) -> Val {
        match self {
            Val::F32x4(v) => Val::F32(v[k]),
            Val::I32x4(v) => Val::I32(v[k]),
            Val::Boolx4(v) => Val::Bool(v[k]),
            s => s,
        }
    }

    fn gather(l: [Val; 4]) -> Result<Val> {
        Ok(match l[0] {
            Val::F32(_) => Val::F32x4([l[0].f32()?, l[1].f32()?, l[2].f32()?, l[3].f32()?]),
            Val::I32(_) => Val::I32x4([l[0].i32()?, l[1].i32()?, l[2].i32()?, l[3].i32()?]),
            Val::Bool(_) => Val::Boolx4([l[0].bool()?, l[1].bool()?, l[2].bool()?, l[3].bool()?]),
            _ => return Err(Error::Internal("interpreter: bad vector lanes")),
        })
    }

    fn i64(self) -> Result<i64> {
        match self {
            Val::I64(x) => Ok(x),
            _ => Err(Error::Internal("expected i64")),
        }
    }
    fn i32(self) -> Result<i32> {
        match self {
            Val::I32(x) => Ok(x),
            _ => Err(Error::Internal("expected i32")),
        }
    }
    fn f32(self) -> Result<f32> {
        match self {
            Val::F32(x) => Ok(x),
            _ => Err(Error::Internal("expected f32")),
        }
    }
    fn bool(self) -> Result<bool> {
        match self {
            Val::Bool(x) => Ok(x),
            _ => Err(Error::Internal("expected bool")),
        }
    }
}

struct Ctx<'a> {
    elems: Vec<Elem>,
    bufs: &'a mut [Vec<u8>],
    vars: Vec<Val>,
}

fn oob() -> Error {
    Error::Internal("interpreter: index out of bounds")
}

impl Ctx<'_> {
    fn load(&self, b: usize, i: i64) -> Result<Val> {
        let elem = *self.elems.get(b).ok_or(oob())?;
        let data = self.bufs.get(b).ok_or(oob())?;
        let i = usize::try_from(i).map_err(|_| oob())?;
        let at = |n: usize| data.get(i * n..i * n + n).ok_or(oob());
        Ok(match elem {
            Elem::U8 => Val::I32(at(1)?[0] as i32),
            Elem::Bf16 => {
                let b = at(2)?;
                Val::F32(f32::from_bits(
                    (u16::from_le_bytes([b[0], b[1]]) as u32) << 16,
                ))
            }
            Elem::F32 => {
                let b = at(4)?;
                Val::F32(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            }
        })
    }

    fn store(&mut self, b: usize, i: i64, v: Val) -> Result<()> {
        let elem = *self.elems.get(b).ok_or(oob())?;
        let data = self.bufs.get_mut(b).ok_or(oob())?;
        let i = usize::try_from(i).map_err(|_| oob())?;
        match elem {
            Elem::U8 => *data.get_mut(i).ok_or(oob())? = v.i32()? as u8,
            Elem::Bf16 => {
                let x = ((v.f32()?.to_bits()) >> 16) as u16;
                data.get_mut(i * 2..i * 2 + 2)
                    .ok_or(oob())?
                    .copy_from_slice(&x.to_le_bytes());
            }
            Elem::F32 => data
                .get_mut(i * 4..i * 4 + 4)
                .ok_or(oob())?
                .copy_from_slice(&v.f32()?.to_le_bytes()),
        }
        Ok(())
    }

    fn eval(&self, x: &Expr) -> Result<Val> {
        Ok(match x {
            Expr::Var(v) => *self
                .vars
                .get(v.0 as usize)
                .ok_or(Error::Internal("unset variable"))?,
            Expr::I64(c) => Val::I64(*c),
            Expr::I32(c) => Val::I32(*c),
            Expr::F32(c) => Val::F32(*c),
            Expr::Load { buf, index } => self.load(buf.0 as usize, self.eval(index)?.i64()?)?,
            Expr::Fma(a, b, c) => Val::F32(
                self.eval(a)?
                    .f32()?
                    .mul_add(self.eval(b)?.f32()?, self.eval(c)?.f32()?),
            ),
            Expr::Select(c, a, b) => {
                let (c, a, b) = (self.eval(c)?, self.eval(a)?, self.eval(b)?);
                if c.is_vector() || a.is_vector() || b.is_vector() {
                    let mut l = [Val::I32(0); 4];
                    for (k, slot) in l.iter_mut().enumerate() {
                        *slot = if c.lane(k).bool()? {
                            a.lane(k)
                        } else {
                            b.lane(k)
                        };
                    }
                    Val::gather(l)?
                } else if c.bool()? {
                    a
                } else {
                    b
                }
            }
            Expr::LoadX4 { buf, index } => {
                let i = self.eval(index)?.i64()?;
                let mut l = [Val::I32(0); 4];
                for (k, slot) in l.iter_mut().enumerate() {
                    *slot = self.load(buf.0 as usize, i + k as i64)?;
                }
                Val::gather(l)?
            }
            Expr::PackE2m1 { vals, small } => {
                if vals.is_empty() || vals.len() > 8 {
                    return Err(Error::Internal("pack_e2m1 of 1 to 8 values"));
                }
                let mut w = 0u32;
                for (k, x) in vals.iter().enumerate() {
                    let x = self.eval(x)?.f32()?;
                    if *small && (x.is_nan() || x.abs() >= 7.0) {
                        return Err(Error::Internal("pack_e2m1_small value outside |x| < 7"));
                    }
                    let nib = crate::reference::e2m1_from_f32(x.clamp(-6.0, 6.0)) as u32;
                    w |= (nib & 15) << (4 * k);
                }
                Val::I32(w as i32)
            }
            Expr::AbsMax(vals) => {
                let mut m: Option<f32> = None;
                for x in vals {
                    let a = self.eval(x)?.f32()?.abs();
                    m = Some(m.map_or(a, |b| b.max(a)));
                }
                Val::F32(m.ok_or(Error::Internal("absmax of no values"))?)
            }
            Expr::Splat(a) => {
                let a = self.eval(a)?;
                Val::gather([a; 4])?
            }
            Expr::Lane(a, k) => self.eval(a)?.lane(*k as usize),
            Expr::Un(op, a) => {
                let a = self.eval(a)?;
                if a.is_vector() {
                    let mut l = [Val::I32(0); 4];
                    for (k, slot) in l.iter_mut().enumerate() {
                        *slot = un(*op, a.lane(k))?;
                    }
                    return Val::gather(l);
                }
                un(*op, a)?
            }
            Expr::Bin(op, a, b) => {
                let (a, b) = (self.eval(a)?, self.eval(b)?);
                if a.is_vector() || b.is_vector() {
                    let mut l = [Val::I32(0); 4];
                    for (k, slot) in l.iter_mut().enumerate() {
                        *slot = bin(*op, a.lane(k), b.lane(k))?;
                    }
                    return Val::gather(l);
                }
                bin(*op, a, b)?
            }
        })
    }
}

fn un(op: UnOp, a: Val) -> Result<Val> {
    Ok(match op {
        UnOp::FAbs => Val::F32(a.f32()?.abs()),
        UnOp::FRoundEven => Val::F32(a.f32()?.round_ties_even()),
        UnOp::F2I => Val::I32(a.f32()? as i32),
        UnOp::I2F => Val::F32(a.i32()? as f32),
        UnOp::BitsOf => Val::I32(a.f32()?.to_bits() as i32),
        UnOp::FromBits => Val::F32(f32::from_bits(a.i32()? as u32)),
        UnOp::Widen => Val::I64(a.i32()? as i64),
        UnOp::Narrow => Val::I32(a.i64()? as i32),
        UnOp::BoolToI => Val::I32(a.bool()? as i32),
        // The oracle's table search, not the IR sequence: an independent check of both.
        UnOp::E4m3 => Val::I32(crate::reference::e4m3_from_f32(a.f32()?) as i32),
        UnOp::E4m3Decode => Val::F32(crate::reference::e4m3_to_f32(a.i32()? as u8)),
        UnOp::E2m1 => Val::I32(crate::reference::e2m1_from_f32(a.f32()?.clamp(-6.0, 6.0)) as i32),
        UnOp::Byte(k) => Val::I32(((a.i32()? as u32 >> (8 * (k as u32 & 3))) & 255) as i32),
    })
}

impl Ctx<'_> {
    fn exec(&mut self, body: &[Stmt]) -> Result<()> {
        for s in body {
            match s {
                Stmt::Set(v, x) => {
                    let val = self.eval(x)?;
                    let slot = self
                        .vars
                        .get_mut(v.0 as usize)
                        .ok_or(Error::Internal("variable"))?;
                    *slot = val;
                }
                Stmt::For {
                    var,
                    start,
                    end,
                    body,
                } => {
                    let (a, b) = (self.eval(start)?.i64()?, self.eval(end)?.i64()?);
                    for i in a..b {
                        *self
                            .vars
                            .get_mut(var.0 as usize)
                            .ok_or(Error::Internal("variable"))? = Val::I64(i);
                        self.exec(body)?;
                    }
                }
                Stmt::If { cond, then } => {
                    if self.eval(cond)?.bool()? {
                        self.exec(then)?;
                    }
                }
                Stmt::Store { buf, index, value } => {
                    let (i, v) = (self.eval(index)?.i64()?, self.eval(value)?);
                    self.store(buf.0 as usize, i, v)?;
                }
                Stmt::LoadPacked { buf, index, dst } => {
                    let i = self.eval(index)?.i64()?;
                    for (k, v) in dst.iter().enumerate() {
                        let val = self.load(buf.0 as usize, i + k as i64)?;
                        *self
                            .vars
                            .get_mut(v.0 as usize)
                            .ok_or(Error::Internal("variable"))? = val;
                    }
                }
                Stmt::StorePacked { buf, index, values } => {
                    let i = self.eval(index)?.i64()?;
                    for (k, x) in values.iter().enumerate() {
                        let v = self.eval(x)?;
                        self.store(buf.0 as usize, i + k as i64, v)?;
                    }
                }
                Stmt::AtomicMaxF32 { buf, index, value } => {
                    let i = self.eval(index)?.i64()?;
                    let v = self.eval(value)?.f32()?;
                    let old = self.load(buf.0 as usize, i)?.f32()?;
                    if v.to_bits() > old.to_bits() {
                        self.store(buf.0 as usize, i, Val::F32(v))?;
                    }
                }
                Stmt::GroupMax { .. } | Stmt::GroupRow(_) | Stmt::GroupFor { .. } => {
                    return Err(Error::Internal("group construct in a sequential kernel"))
                }
            }
        }
        Ok(())
    }
}

fn bin(op: BinOp, a: Val, b: Val) -> Result<Val> {
    use BinOp::*;
    Ok(match (op, a, b) {
        (IAdd, Val::I64(x), Val::I64(y)) => Val::I64(x.wrapping_add(y)),
        (ISub, Val::I64(x), Val::I64(y)) => Val::I64(x.wrapping_sub(y)),
        (IMul, Val::I64(x), Val::I64(y)) => Val::I64(x.wrapping_mul(y)),
        (IDiv, Val::I64(x), Val::I64(y)) if y > 0 => Val::I64(x / y),
        (IRem, Val::I64(x), Val::I64(y)) if y > 0 => Val::I64(x % y),
        (ILt, Val::I64(x), Val::I64(y)) => Val::Bool(x < y),
        (IEq, Val::I64(x), Val::I64(y)) => Val::Bool(x == y),
        (IAdd, Val::I32(x), Val::I32(y)) => Val::I32(x.wrapping_add(y)),
        (ISub, Val::I32(x), Val::I32(y)) => Val::I32(x.wrapping_sub(y)),
        (IMul, Val::I32(x), Val::I32(y)) => Val::I32(x.wrapping_mul(y)),
        (And, Val::I64(x), Val::I64(y)) => Val::I64(x & y),
        (Or, Val::I64(x), Val::I64(y)) => Val::I64(x | y),
        (Xor, Val::I64(x), Val::I64(y)) => Val::I64(x ^ y),
        (Shl, Val::I64(x), Val::I64(y)) => Val::I64(x.wrapping_shl(y as u32)),
        (Shr, Val::I64(x), Val::I64(y)) => Val::I64(((x as u64) >> (y as u32 & 63)) as i64),
        (And, Val::I32(x), Val::I32(y)) => Val::I32(x & y),
        (Or, Val::I32(x), Val::I32(y)) => Val::I32(x | y),
        (Xor, Val::I32(x), Val::I32(y)) => Val::I32(x ^ y),
        (Shl, Val::I32(x), Val::I32(y)) => Val::I32(x.wrapping_shl(y as u32)),
        (Shr, Val::I32(x), Val::I32(y)) => Val::I32(((x as u32) >> (y as u32 & 31)) as i32),
        (MulHi, Val::I32(x), Val::I32(y)) => {
            Val::I32((((x as u32 as u64) * (y as u32 as u64)) >> 32) as u32 as i32)
        }
        (Prmt(sel), Val::I32(x), Val::I32(y)) => Val::I32(prmt(x as u32, y as u32, sel) as i32),
        (ILt, Val::I32(x), Val::I32(y)) => Val::Bool(x < y),
        (IEq, Val::I32(x), Val::I32(y)) => Val::Bool(x == y),
        (FAdd, Val::F32(x), Val::F32(y)) => Val::F32(x + y),
        (FMul, Val::F32(x), Val::F32(y)) => Val::F32(x * y),
        (FDiv, Val::F32(x), Val::F32(y)) => Val::F32(x / y),
        (FMax, Val::F32(x), Val::F32(y)) => Val::F32(x.max(y)),
        (FMin, Val::F32(x), Val::F32(y)) => Val::F32(x.min(y)),
        (FLt, Val::F32(x), Val::F32(y)) => Val::Bool(x < y),
        (FLe, Val::F32(x), Val::F32(y)) => Val::Bool(x <= y),
        (FEq, Val::F32(x), Val::F32(y)) => Val::Bool(x == y),
        _ => return Err(Error::Internal("interpreter: ill-typed binary operation")),
    })
}

/// Run one kernel over all its work items.
pub fn run_kernel(k: &Kernel, elems: &[Elem], bufs: &mut [Vec<u8>]) -> Result<()> {
    // Group kernels run as their sequential form (one thread per item).
    let seq;
    let k = if k.group == 1 {
        k
    } else {
        seq = k.sequential();
        &seq
    };
    let mut ctx = Ctx {
        elems: elems.to_vec(),
        bufs,
        vars: vec![Val::I64(0); k.vars as usize],
    };
    for it in 0..k.items {
        *ctx.vars
            .get_mut(k.item.0 as usize)
            .ok_or(Error::Internal("item variable"))? = Val::I64(it);
        ctx.exec(&k.body)?;
    }
    Ok(())
}

/// Run a whole program. `bufs` holds one byte vector per program buffer, sized by
/// [`crate::alloc_buffers`]; buffers the program marks `zeroed` are cleared first, so buffers can be
/// reused between runs.
pub fn run(prog: &Program, bufs: &mut [Vec<u8>], coll: &dyn Collective) -> Result<()> {
    let elems: Vec<Elem> = prog.bufs.iter().map(|b| b.elem).collect();
    for (b, d) in prog.bufs.iter().zip(bufs.iter_mut()) {
        if b.zeroed {
            d.fill(0);
        }
    }
    for s in &prog.steps {
        match s {
            Step::Kernel(k) => run_kernel(k, &elems, bufs)?,
            Step::AllReduceMax { buf, group } => crate::all_reduce_bytes(coll, *group, bufs, *buf)?,
        }
    }
    Ok(())
}

/// [`BinOp::Prmt`]: PTX `prmt.b32` in its default mode.
pub fn prmt(a: u32, b: u32, sel: u16) -> u32 {
    let bytes = (u64::from(b) << 32) | u64::from(a);
    let mut out = 0u32;
    for k in 0..4 {
        let nib = (sel >> (4 * k)) & 15;
        let byte = (bytes >> (8 * (nib & 7))) as u8;
        let byte = if nib & 8 != 0 {
            if byte & 0x80 != 0 {
                0xFF
            } else {
                0
            }
        } else {
            byte
        };
        out |= u32::from(byte) << (8 * k);
    }
    out
}
