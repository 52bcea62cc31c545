//! The quantization arithmetic of SPEC §4, §5, §7, §8 written as kernel IR: every conversion is
//! spelled out in integer and correctly rounded f32 operations, so every backend computes the same
//! bits (Hopper included, which has no hardware E2M1 conversion).

use crate::kir::{e, BinOp, Expr, Stmt, Ty, UnOp, Var, VarAlloc};

/// Emits statements into a block, allocating variables.
pub struct Emit<'a> {
    /// Variable allocator of the kernel being built.
    pub vars: &'a mut VarAlloc,
    /// Statements emitted so far.
    pub out: Vec<Stmt>,
    /// Whether the conversions below are built on 4-lane vectors.
    pub x4: bool,
}

impl<'a> Emit<'a> {
    /// A new emitter.
    pub fn new(vars: &'a mut VarAlloc) -> Emit<'a> {
        Emit {
            vars,
            out: Vec::new(),
            x4: false,
        }
    }

    /// The type of a conversion temporary: `ty`, or its 4-lane form in vector mode.
    pub fn vt(&self, ty: Ty) -> Ty {
        if self.x4 {
            ty.x4()
        } else {
            ty
        }
    }

    /// Build with 4-lane conversions.
    pub fn vector<R>(&mut self, f: impl FnOnce(&mut Emit<'_>) -> R) -> R {
        let old = self.x4;
        self.x4 = true;
        let r = f(self);
        self.x4 = old;
        r
    }

    /// Bind an expression to a fresh variable and return it.
    pub fn set(&mut self, ty: Ty, x: Expr) -> Expr {
        let v = self.vars.new_var(ty);
        self.out.push(Stmt::Set(v, x));
        e::v(v)
    }

    /// A fresh variable initialised to `x` (to be updated in loops).
    pub fn var(&mut self, ty: Ty, x: Expr) -> Var {
        let v = self.vars.new_var(ty);
        self.out.push(Stmt::Set(v, x));
        v
    }

    /// A sub-block with the same allocator.
    pub fn block(&mut self, f: impl FnOnce(&mut Emit<'_>)) -> Vec<Stmt> {
        let mut sub = Emit::new(self.vars);
        sub.x4 = self.x4;
        f(&mut sub);
        sub.out
    }

    /// `body(0); body(1); ...; body(n-1)`: a loop of constant trip count, unrolled.
    pub fn unroll(&mut self, n: i64, mut f: impl FnMut(&mut Emit<'_>, Expr)) {
        for k in 0..n {
            f(self, e::i(k));
        }
    }

    /// `for var in start..end { body }`.
    pub fn for_(&mut self, start: Expr, end: Expr, f: impl FnOnce(&mut Emit<'_>, Expr)) {
        let var = self.vars.new_var(Ty::I64);
        let body = self.block(|b| f(b, e::v(var)));
        self.out.push(Stmt::For {
            var,
            start,
            end,
            body,
        });
    }
}

/// `rne(y)` as an i32 for `|y| < 2^22`: adding 1.5 * 2^23 makes the f32 addition itself round to an
/// integer (ties to even), and the low bits of the sum are that integer in two's complement. Exact,
/// branch-free, and the same on every backend (one correctly rounded f32 add).
pub fn rne_small_int(y: Expr) -> Expr {
    e::bin(
        BinOp::ISub,
        e::un(UnOp::BitsOf, e::bin(BinOp::FAdd, y, e::f(12_582_912.0))),
        e::i32(0x4B40_0000),
    )
}

/// `min(max(x, lo), hi)` for f32.
pub fn clamp(x: Expr, lo: f32, hi: f32) -> Expr {
    e::bin(BinOp::FMin, e::bin(BinOp::FMax, x, e::f(lo)), e::f(hi))
}

/// Round-to-nearest-even conversion of a finite f32 with `|x| <= 448` to an E4M3 byte (i32).
pub fn e4m3_rne(em: &mut Emit<'_>, x: Expr) -> Expr {
    let x = em.set(em.vt(Ty::F32), x);
    let bits = em.set(em.vt(Ty::I32), e::un(UnOp::BitsOf, x.clone()));
    let sign = e::bin(
        BinOp::And,
        e::bin(BinOp::Shr, bits.clone(), e::i32(24)),
        e::i32(0x80),
    );
    let a = em.set(em.vt(Ty::F32), e::un(UnOp::FAbs, x));
    // Subnormal range (|x| < 2^-6): code = rne(|x| * 2^9), exact scaling; 8 is the smallest normal.
    let sub = rne_small_int(e::bin(BinOp::FMul, a.clone(), e::f(512.0)));
    // Normal range: round the 23-bit mantissa to 3 bits, ties to even, then re-bias 127 -> 7.
    let abits = em.set(em.vt(Ty::I32), e::un(UnOp::BitsOf, a.clone()));
    let lsb = e::bin(
        BinOp::And,
        e::bin(BinOp::Shr, abits.clone(), e::i32(20)),
        e::i32(1),
    );
    let rounded = e::bin(
        BinOp::IAdd,
        e::bin(BinOp::IAdd, abits, e::i32(0x7FFFF)),
        lsb,
    );
    let normal = e::bin(
        BinOp::ISub,
        e::bin(BinOp::Shr, rounded, e::i32(20)),
        e::i32(120 << 3),
    );
    let code = e::sel(e::bin(BinOp::FLt, a, e::f(1.0 / 64.0)), sub, normal);
    em.set(em.vt(Ty::I32), e::bin(BinOp::Or, sign, code))
}

/// The f32 value of an E4M3 byte in `[0, 0x7E]` (non-negative).
pub fn e4m3_decode(em: &mut Emit<'_>, b: Expr) -> Expr {
    let b = em.set(em.vt(Ty::I32), b);
    let exp = e::bin(BinOp::Shr, b.clone(), e::i32(3));
    let mant = e::bin(BinOp::And, b.clone(), e::i32(7));
    let normal = e::un(
        UnOp::FromBits,
        e::bin(
            BinOp::IAdd,
            e::bin(BinOp::Shl, b, e::i32(20)),
            e::i32(120 << 23),
        ),
    );
    let sub = e::bin(BinOp::FMul, e::un(UnOp::I2F, mant), e::f(1.0 / 512.0));
    let t = em.vt(Ty::F32);
    em.set(t, e::sel(e::bin(BinOp::IEq, exp, e::i32(0)), sub, normal))
}

/// Round-to-nearest-even of a finite f32, saturated to ±6, to an E2M1 nibble (sign in bit 3; a value that
/// rounds to zero keeps its sign, as the hardware conversion does). Below 1 the grid step is 0.5, so the
/// code is `rne(2|x|)`; from 1 on, the f32 mantissa is rounded to one bit (ties to even) and the
/// exponent re-biased from 127 to 1, exactly as for E4M3.
pub fn e2m1_rne(em: &mut Emit<'_>, x: Expr) -> Expr {
    let x = em.set(em.vt(Ty::F32), x);
    // Saturate the magnitude at 6 (the sign is taken from `x` itself).
    let a = em.set(
        em.vt(Ty::F32),
        e::bin(BinOp::FMin, e::un(UnOp::FAbs, x.clone()), e::f(6.0)),
    );
    let sub = rne_small_int(e::bin(BinOp::FMul, a.clone(), e::f(2.0)));
    let abits = em.set(em.vt(Ty::I32), e::un(UnOp::BitsOf, a.clone()));
    let lsb = e::bin(
        BinOp::And,
        e::bin(BinOp::Shr, abits.clone(), e::i32(22)),
        e::i32(1),
    );
    let rounded = e::bin(
        BinOp::IAdd,
        e::bin(BinOp::IAdd, abits, e::i32((1 << 21) - 1)),
        lsb,
    );
    let normal = e::bin(
        BinOp::ISub,
        e::bin(BinOp::Shr, rounded, e::i32(22)),
        e::i32(126 << 1),
    );
    let code = e::sel(e::bin(BinOp::FLt, a, e::f(1.0)), sub, normal);
    let sign = e::bin(
        BinOp::And,
        e::bin(BinOp::Shr, e::un(UnOp::BitsOf, x), e::i32(28)),
        e::i32(8),
    );
    em.set(em.vt(Ty::I32), e::bin(BinOp::Or, sign, code))
}

/// `abs(x)`.
pub fn fabs(x: Expr) -> Expr {
    e::un(UnOp::FAbs, x)
}

/// `a * b` (f32).
pub fn fmul(a: Expr, b: Expr) -> Expr {
    e::bin(BinOp::FMul, a, b)
}

/// `a / b` (f32, correctly rounded).
pub fn fdiv(a: Expr, b: Expr) -> Expr {
    e::bin(BinOp::FDiv, a, b)
}

/// `max(a, b)` (f32).
pub fn fmax(a: Expr, b: Expr) -> Expr {
    e::bin(BinOp::FMax, a, b)
}

/// `x == 0.0`.
pub fn is_zero(x: Expr) -> Expr {
    e::bin(BinOp::FEq, x, e::f(0.0))
}

/// Symmetric INT8: `clamp(rne(x / scale), -128, 127)` as a byte (two's complement).
pub fn int8_rne(em: &mut Emit<'_>, x: Expr, scale: Expr) -> Expr {
    // |x / scale| <= 127 up to rounding, so the magic-number rounding is exact; clamp after.
    let q = em.set(
        em.vt(Ty::I32),
        rne_small_int(clamp(fdiv(x, scale), -128.0, 127.0)),
    );
    em.set(em.vt(Ty::I32), e::bin(BinOp::And, q, e::i32(0xFF)))
}
