//! The quantization arithmetic of SPEC §4, §5, §7, §8 written as kernel IR: every conversion is
//! spelled out in integer and correctly rounded f32 operations, so every backend computes the same
//! bits (Hopper included, which has no hardware E2M1 conversion).

use moeforge_dsl::ir::DType;

use crate::kir::{e, BinOp, Expr, Program, Step, Stmt, Ty, UnOp, Var, VarAlloc};

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

/// Round-to-nearest-even conversion of a finite f32 to an E4M3 byte (i32), saturating at ±448: the
/// IR's [`UnOp::E4m3`] in scalar form (one hardware conversion on the GPU), the integer sequence of
/// [`e4m3_soft`] in 4-lane form.
pub fn e4m3_rne(em: &mut Emit<'_>, x: Expr) -> Expr {
    if em.x4 {
        e4m3_soft(em, clamp(x, -448.0, 448.0))
    } else {
        em.set(Ty::I32, e::un(UnOp::E4m3, x))
    }
}

/// Round-to-nearest-even conversion of a finite f32 with `|x| <= 448` to an E4M3 byte (i32), in
/// integer and correctly rounded f32 operations.
pub fn e4m3_soft(em: &mut Emit<'_>, x: Expr) -> Expr {
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

/// The f32 value of an E4M3 byte in `[0, 0x7E]` (non-negative): the IR's [`UnOp::E4m3Decode`] in
/// scalar form, the integer sequence of [`e4m3_decode_soft`] in 4-lane form.
pub fn e4m3_decode(em: &mut Emit<'_>, b: Expr) -> Expr {
    if em.x4 {
        e4m3_decode_soft(em, b)
    } else {
        em.set(Ty::F32, e::un(UnOp::E4m3Decode, b))
    }
}

/// [`e4m3_decode`] in integer and f32 operations.
pub fn e4m3_decode_soft(em: &mut Emit<'_>, b: Expr) -> Expr {
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

/// Round-to-nearest-even of a finite f32, saturated to ±6, to an E2M1 nibble (sign in bit 3; a value
/// that rounds to zero keeps its sign, as the hardware conversion does): the IR's [`UnOp::E2m1`] in
/// scalar form (native on sm_100a), the integer sequence of [`e2m1_soft`] in 4-lane form.
pub fn e2m1_rne(em: &mut Emit<'_>, x: Expr) -> Expr {
    if em.x4 {
        e2m1_soft(em, x)
    } else {
        em.set(Ty::I32, e::un(UnOp::E2m1, x))
    }
}

/// [`e2m1_rne`] in integer and correctly rounded f32 operations. With `y = min(|x|, 6)`, the E2M1 grid
/// has step 1/2 below 2, 1 in [2, 4) and 2 in [4, 6], so the code is `rne(y * s) + off` with
/// `(s, off) = (2, 0)`, `(1, 2)` or `(1/2, 4)`: the products are exact (powers of two), one correctly
/// rounded add does the rounding (ties to even, and code parity is mantissa parity), and the offsets
/// make the codes continue across the range boundaries (rne(2y) = 4 at y -> 2 is code 4, etc.).
pub fn e2m1_soft(em: &mut Emit<'_>, x: Expr) -> Expr {
    if !em.x4 {
        return e2m1_soft_scalar(em, x);
    }
    let x = em.set(em.vt(Ty::F32), x);
    let y = em.set(
        em.vt(Ty::F32),
        e::bin(BinOp::FMin, e::un(UnOp::FAbs, x.clone()), e::f(6.0)),
    );
    let lt2 = em.set(em.vt(Ty::Bool), e::bin(BinOp::FLt, y.clone(), e::f(2.0)));
    let lt4 = em.set(em.vt(Ty::Bool), e::bin(BinOp::FLt, y.clone(), e::f(4.0)));
    // Select arms are vectors in 4-lane form.
    let x4 = em.x4;
    let kf = |v: f32| if x4 { e::splat(e::f(v)) } else { e::f(v) };
    let ki = |v: i32| if x4 { e::splat(e::i32(v)) } else { e::i32(v) };
    let s = e::sel(lt2.clone(), kf(2.0), e::sel(lt4.clone(), kf(1.0), kf(0.5)));
    let off = e::sel(lt2, ki(0), e::sel(lt4, ki(2), ki(4)));
    let code = e::bin(BinOp::IAdd, rne_small_int(e::bin(BinOp::FMul, y, s)), off);
    let sign = e::bin(
        BinOp::And,
        e::bin(BinOp::Shr, e::un(UnOp::BitsOf, x), e::i32(28)),
        e::i32(8),
    );
    em.set(em.vt(Ty::I32), e::bin(BinOp::Or, sign, code))
}

/// [`e2m1_soft`] for one value, with the range's `s` and offset taken from the exponent field instead
/// of two selects each: `E = exponent of max(y, 1)` (127..=129 as `y <= 6`), `s = 2^(128 - E)`,
/// `off = 2 (E - 127)`; `fma(y, s, 1.5 * 2^23 + off)` rounds `y * s` (exact) to an integer and adds
/// `off` in one rounding, and as `1.5 * 2^23` has zero low bits, the code is the sum's low three bits.
fn e2m1_soft_scalar(em: &mut Emit<'_>, x: Expr) -> Expr {
    // Mostly multiply-add work, which the GPU's FMA pipe takes, leaving its ALU pipe (min/max and
    // logic) three operations: right shifts are multiply-highs, and the exponent's uses are
    // multiply-adds of it.
    let x = em.set(Ty::F32, x);
    let sum = e2m1_magnitude(em, x.clone(), false);
    // The top nibble of x (a multiply-high), its sign in bit 3: the code's bits 0-2 merged with
    // the top's bit 3 as top ^ ((top ^ sum) & 7), one three-input logic operation.
    let top = em.set(
        Ty::I32,
        e::bin(BinOp::MulHi, e::un(UnOp::BitsOf, x), e::i32(16)),
    );
    em.set(
        Ty::I32,
        e::bin(
            BinOp::Xor,
            top.clone(),
            e::bin(BinOp::And, e::bin(BinOp::Xor, top, sum), e::i32(7)),
        ),
    )
}

/// The E2M1 code of `|x|` as the low three bits of an i32 whose bits 3-21 are zero (the bits of
/// `fma(y, s, 1.5 * 2^23 + off)`, see [`e2m1_soft_scalar`]; bits 22 and up are the constant's).
/// `small` promises `|x| < 7` and leaves out the `min(|x|, 6)`: the codes are the same there (values
/// in (6, 7) have `E = 129`, and `rne(y / 2) = 3` gives code 7).
fn e2m1_magnitude(em: &mut Emit<'_>, x: Expr, small: bool) -> Expr {
    let abs = e::un(UnOp::FAbs, x);
    let y = em.set(
        Ty::F32,
        if small {
            abs
        } else {
            e::bin(BinOp::FMin, abs, e::f(6.0))
        },
    );
    // E = bits(max(y, 1)) >> 23 (127..=129; the sign is 0 and the mantissa shifts out).
    let ex = em.set(
        Ty::I32,
        e::bin(
            BinOp::MulHi,
            e::un(UnOp::BitsOf, e::bin(BinOp::FMax, y.clone(), e::f(1.0))),
            e::i32(1 << 9),
        ),
    );
    // s = 2^(128 - E): bits (255 - E) << 23; magic = 1.5 * 2^23 + 2 (E - 127).
    let s = e::un(
        UnOp::FromBits,
        e::bin(
            BinOp::IAdd,
            e::bin(BinOp::IMul, ex.clone(), e::i32(-(1 << 23))),
            e::i32(255 << 23),
        ),
    );
    let magic = e::un(
        UnOp::FromBits,
        e::bin(
            BinOp::IAdd,
            e::bin(BinOp::IMul, ex, e::i32(2)),
            e::i32(0x4B40_0000 - 254),
        ),
    );
    em.set(Ty::I32, e::un(UnOp::BitsOf, e::fma(y, s, magic)))
}

/// [`Expr::PackE2m1`] without a native conversion. The magnitudes' codes (`e2m1_magnitude`) are
/// placed by multiply-adds, four per half word (each sum's constant bits start at bit 22, so they
/// shift out of the half's low 16 bits), and the halves joined by one byte permute. The signs come
/// from the values' top bytes: byte permutes copying a byte's top bit give `[s0, s2, s4, s6]` and
/// `[s1, s3, s5, s7]` as 0x00/0xFF bytes (two values per permute, then one to join), and two masked
/// ors put them at bits 3 and 7 of each byte. Per eight values: 8 code sequences, 6 multiply-adds and
/// 7 permutes, 2 logic operations (the per-value merge and packing took 27).
pub fn pack_e2m1_soft(em: &mut Emit<'_>, vals: Vec<Expr>, small: bool) -> Expr {
    let mut vs: Vec<Expr> = vals.into_iter().map(|v| em.set(Ty::F32, v)).collect();
    vs.resize(8, e::f(0.0));
    let sums: Vec<Expr> = vs
        .iter()
        .map(|v| e2m1_magnitude(em, v.clone(), small))
        .collect();
    let half = |q: &[Expr]| {
        q.iter().rev().skip(1).fold(q[3].clone(), |acc, c| {
            e::bin(BinOp::IAdd, e::bin(BinOp::IMul, acc, e::i32(16)), c.clone())
        })
    };
    let lo = em.set(Ty::I32, half(&sums[..4]));
    let hi = em.set(Ty::I32, half(&sums[4..]));
    let codes = e::bin(BinOp::Prmt(0x5410), lo, hi);
    let bits: Vec<Expr> = vs.iter().map(|v| e::un(UnOp::BitsOf, v.clone())).collect();
    // Top bytes (3 of a, 7 of b) with their top bit copied: [sign(a), sign(b), ...].
    let signs = |a: &Expr, b: &Expr| e::bin(BinOp::Prmt(0x00FB), a.clone(), b.clone());
    let even = e::bin(
        BinOp::Prmt(0x5410),
        signs(&bits[0], &bits[2]),
        signs(&bits[4], &bits[6]),
    );
    let odd = e::bin(
        BinOp::Prmt(0x5410),
        signs(&bits[1], &bits[3]),
        signs(&bits[5], &bits[7]),
    );
    em.set(
        Ty::I32,
        e::bin(
            BinOp::Or,
            e::bin(
                BinOp::Or,
                codes,
                e::bin(BinOp::And, even, e::i32(0x0808_0808)),
            ),
            e::bin(BinOp::And, odd, e::i32(0x8080_8080_u32 as i32)),
        ),
    )
}

/// Rewrite the native conversions a backend lacks ([`UnOp::E4m3`], [`UnOp::E2m1`] where `native` says
/// no) into their integer sequences: each such operand is bound to a fresh variable just before the
/// statement that uses it, followed by the sequence, whose result replaces the operation. Every
/// expression here is pure (loads included), so evaluating it a statement earlier is the same.
pub fn soften(prog: &Program, native: &dyn Fn(UnOp) -> bool) -> Program {
    let mut out = prog.clone();
    for st in out.steps.iter_mut() {
        if let Step::Kernel(k) = st {
            let mut va = VarAlloc::continuing(k.var_types.clone());
            let body = std::mem::take(&mut k.body);
            k.body = soften_block(body, &mut va, native);
            let (vars, types) = va.into_parts();
            k.vars = vars;
            k.var_types = types;
        }
    }
    out
}

fn soften_block(body: Vec<Stmt>, va: &mut VarAlloc, native: &dyn Fn(UnOp) -> bool) -> Vec<Stmt> {
    let take = |x: &mut Expr| std::mem::replace(x, Expr::I64(0));
    let mut out = Vec::with_capacity(body.len());
    for mut st in body {
        let mut em = Emit::new(va);
        // The statement's own expressions: their conversions go right before it; a block's value
        // (a group's per-sub-item value): at the end of that block (see `soften_with_value`).
        let parts = st.parts_mut();
        for x in parts.exprs {
            let y = soften_expr(take(x), &mut em, native);
            *x = y;
        }
        for (block, value) in parts.blocks {
            let b = std::mem::take(block);
            match value {
                Some(v) => {
                    let (nb, nv) = soften_with_value(b, take(v), em.vars, native);
                    *block = nb;
                    *v = nv;
                }
                None => *block = soften_block(b, em.vars, native),
            }
        }
        out.append(&mut em.out);
        out.push(st);
    }
    out
}

/// A per-sub-item block and the value computed after it: the value's conversions go at the end of
/// the block (evaluated per sub-item; pure, so also right where the block runs twice).
fn soften_with_value(
    block: Vec<Stmt>,
    value: Expr,
    va: &mut VarAlloc,
    native: &dyn Fn(UnOp) -> bool,
) -> (Vec<Stmt>, Expr) {
    let mut block = soften_block(block, va, native);
    let mut tail = Emit::new(va);
    let value = soften_expr(value, &mut tail, native);
    block.append(&mut tail.out);
    (block, value)
}

fn soften_expr(x: Expr, em: &mut Emit<'_>, native: &dyn Fn(UnOp) -> bool) -> Expr {
    let bx = |x: Box<Expr>, em: &mut Emit<'_>| Box::new(soften_expr(*x, em, native));
    match x {
        Expr::Un(op @ (UnOp::E4m3 | UnOp::E2m1 | UnOp::E4m3Decode), a) if !native(op) => {
            let a = soften_expr(*a, em, native);
            match op {
                UnOp::E4m3 => e4m3_soft(em, clamp(a, -448.0, 448.0)),
                UnOp::E2m1 => e2m1_soft(em, a),
                _ => e4m3_decode_soft(em, a),
            }
        }
        Expr::PackE2m1 { vals, small } => {
            let vals: Vec<Expr> = vals
                .into_iter()
                .map(|v| soften_expr(v, em, native))
                .collect();
            if native(UnOp::E2m1) {
                Expr::PackE2m1 { vals, small }
            } else {
                pack_e2m1_soft(em, vals, small)
            }
        }
        Expr::AbsMax(vals) => Expr::AbsMax(
            vals.into_iter()
                .map(|v| soften_expr(v, em, native))
                .collect(),
        ),
        Expr::Un(op, a) => Expr::Un(op, bx(a, em)),
        Expr::Bin(op, a, b) => {
            let a = bx(a, em);
            Expr::Bin(op, a, bx(b, em))
        }
        Expr::Select(c, a, b) => {
            let c = bx(c, em);
            let a = bx(a, em);
            Expr::Select(c, a, bx(b, em))
        }
        Expr::Fma(a, b, c) => {
            let a = bx(a, em);
            let b = bx(b, em);
            Expr::Fma(a, b, bx(c, em))
        }
        Expr::Load { buf, index } => Expr::Load {
            buf,
            index: bx(index, em),
        },
        Expr::LoadX4 { buf, index } => Expr::LoadX4 {
            buf,
            index: bx(index, em),
        },
        Expr::Splat(a) => Expr::Splat(bx(a, em)),
        Expr::Lane(a, k) => Expr::Lane(bx(a, em), k),
        leaf @ (Expr::Var(_) | Expr::I64(_) | Expr::I32(_) | Expr::F32(_)) => leaf,
    }
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

/// A non-negative finite f32 rounded to the nearest value of a scale dtype (ties to even), as an f32
/// holding that value exactly: `bf16` by rounding away the low 16 bits of the encoding; `f16` by
/// rounding to a multiple of its quantum `max(2^(e-10), 2^-24)` (`e` the value's binary exponent;
/// division and multiplication by a power of two are exact) and saturating at 65504; `f32` unchanged.
/// Group-wise INT4's scale rounding (README, "Group-wise INT4").
pub fn round_scale(em: &mut Emit<'_>, s: Expr, dtype: DType) -> Expr {
    match dtype {
        DType::Bf16 => {
            let b = em.set(Ty::I32, e::un(UnOp::BitsOf, s));
            let odd = e::bin(
                BinOp::And,
                e::bin(BinOp::Shr, b.clone(), e::i32(16)),
                e::i32(1),
            );
            let r = e::bin(BinOp::IAdd, e::bin(BinOp::IAdd, b, e::i32(0x7FFF)), odd);
            em.set(
                Ty::F32,
                e::un(
                    UnOp::FromBits,
                    e::bin(BinOp::And, r, e::i32(0xFFFF_0000_u32 as i32)),
                ),
            )
        }
        DType::F16 => {
            let s = em.set(Ty::F32, s);
            let ex = e::bin(
                BinOp::And,
                e::bin(BinOp::Shr, e::un(UnOp::BitsOf, s.clone()), e::i32(23)),
                e::i32(0xFF),
            );
            // The quantum's exponent field: e - 10, at least that of 2^-24 (127 - 24 = 103).
            let qe = e::bin(BinOp::ISub, ex, e::i32(10));
            let qe = e::sel(e::bin(BinOp::ILt, qe.clone(), e::i32(103)), e::i32(103), qe);
            let quantum = em.set(
                Ty::F32,
                e::un(UnOp::FromBits, e::bin(BinOp::Shl, qe, e::i32(23))),
            );
            let n = e::un(UnOp::FRoundEven, fdiv(s, quantum.clone()));
            em.set(
                Ty::F32,
                e::bin(BinOp::FMin, fmul(n, quantum), e::f(65504.0)),
            )
        }
        _ => em.set(Ty::F32, s),
    }
}

/// A group-wise INT4 code `clamp(rne(x / s) + z, 0, 15)` (i32): `z` is 8 for symmetric groups, the
/// group's zero point for asymmetric ones (an f32 holding a small integer). `rne` rounds the
/// correctly rounded quotient half to even before `z` is added, as GPTQ and AWQ do.
pub fn int4_code(em: &mut Emit<'_>, x: Expr, s: &Expr, z: &Expr) -> Expr {
    let r = e::un(UnOp::FRoundEven, fdiv(x, s.clone()));
    let c = clamp(e::bin(BinOp::FAdd, r, z.clone()), 0.0, 15.0);
    em.set(Ty::I32, rne_small_int(c))
}

/// Symmetric INT8: `clamp(rne(x / scale), -128, 127)` as a byte (two's complement).
pub fn int8_rne(em: &mut Emit<'_>, x: Expr, scale: Expr) -> Expr {
    int8_of_quotient(em, fdiv(x, scale))
}

/// The INT8 byte of a quotient `q = x / scale`: `clamp(rne(q), -128, 127)`.
pub fn int8_of_quotient(em: &mut Emit<'_>, q: Expr) -> Expr {
    // The clamped quotient is small, so the magic-number rounding is exact.
    let q = em.set(em.vt(Ty::I32), rne_small_int(clamp(q, -128.0, 127.0)));
    em.set(em.vt(Ty::I32), e::bin(BinOp::And, q, e::i32(0xFF)))
}

/// `x / b` from the row's `y = RN(1/b)` and `-b` by one multiply and two fused multiply-adds
/// (Markstein's correction step: `q0 = x*y`, `r = x - b*q0` exactly, `q = q0 + r*y`), for rows whose
/// `b` lies in `[2^-100, 2^100]`. Where the residual does not underflow this is the correctly rounded
/// quotient; for every bf16 `x` and every scale derived from a bf16 row maximum, the INT8 and E4M3
/// codes of this quotient equal those of `x / b` (checked exhaustively: `exhaustive_row_division`).
pub fn quot_by_reciprocal(em: &mut Emit<'_>, x: Expr, neg_b: &Expr, y: &Expr) -> Expr {
    let x = em.set(Ty::F32, x);
    let q0 = em.set(Ty::F32, fmul(x.clone(), y.clone()));
    let r = em.set(Ty::F32, e::fma(neg_b.clone(), q0.clone(), x));
    em.set(Ty::F32, e::fma(r, y.clone(), q0))
}

/// The range of row scales [`quot_by_reciprocal`] is used for: `2^-100 <= b <= 2^100`, as an i32
/// flag (1 or 0).
pub fn reciprocal_safe(b: Expr) -> Expr {
    let lo = e::un(
        UnOp::BoolToI,
        e::bin(BinOp::FLe, e::f(f32::from_bits(0x0D80_0000)), b.clone()),
    );
    let hi = e::un(
        UnOp::BoolToI,
        e::bin(BinOp::FLe, b, e::f(f32::from_bits(0x7180_0000))),
    );
    e::bin(BinOp::And, lo, hi)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kir::{Buf, BufId, BufRole, Elem, Kernel};

    /// A one-kernel program `out[i] = op(in[i])` over f32 inputs.
    fn convert(op: UnOp, xs: &[f32], x4: bool) -> Program {
        let mut va = VarAlloc::default();
        let item = va.new_var(Ty::I64);
        let body = {
            let mut em = Emit::new(&mut va);
            if x4 {
                let v = e::load_x4(BufId(0), e::mul(e::v(item), e::i(4)));
                let c = em.vector(|bv| {
                    if op == UnOp::E4m3 {
                        e4m3_rne(bv, v)
                    } else {
                        e2m1_rne(bv, v)
                    }
                });
                for k in 0..4u8 {
                    em.out.push(Stmt::Store {
                        buf: BufId(1),
                        index: e::add(e::mul(e::v(item), e::i(4)), e::i(k as i64)),
                        value: e::lane(c.clone(), k),
                    });
                }
            } else {
                let x = e::load(BufId(0), e::v(item));
                em.out.push(Stmt::Store {
                    buf: BufId(1),
                    index: e::v(item),
                    value: e::un(op, x),
                });
            }
            em.out
        };
        let n = xs.len() as i64;
        let k: Kernel = va.kernel("cvt".into(), item, if x4 { n / 4 } else { n }, body);
        one_kernel(k, (Elem::F32, xs.len()), (Elem::U8, xs.len()))
    }

    /// A program of kernel `k` over an input buffer (0) and a param buffer (1), `(element, length)`.
    fn one_kernel(k: Kernel, input: (Elem, usize), param: (Elem, usize)) -> Program {
        let buf = |role, (elem, len)| Buf {
            role,
            elem,
            len,
            zeroed: false,
        };
        Program {
            recipe: k.name.clone(),
            bufs: vec![
                buf(BufRole::Input("x".into()), input),
                buf(BufRole::Param("q".into()), param),
            ],
            steps: vec![Step::Kernel(k)],
        }
    }

    /// Every f32 in `[0, hi]` whose low `skip` mantissa bits are zero, each grid point and tie of the
    /// target format with its neighbours one ulp away, all of it with both signs.
    fn values(hi: f32, skip: u32, grid: &[f32]) -> Vec<f32> {
        let mut v = Vec::new();
        let mut b = 0u32;
        while f32::from_bits(b) <= hi {
            v.push(f32::from_bits(b));
            b += 1 << skip;
        }
        for w in grid.windows(2) {
            for p in [w[0], (w[0] + w[1]) / 2.0] {
                let pb = p.to_bits();
                v.extend([
                    p,
                    f32::from_bits(pb + 1),
                    f32::from_bits(pb.saturating_sub(1)),
                ]);
            }
        }
        v.extend([hi * 2.0, 1e30, f32::MIN_POSITIVE, 1e-40]);
        let neg: Vec<f32> = v.iter().map(|x| -x).collect();
        v.extend(neg);
        while v.len() % 4 != 0 {
            v.push(0.0);
        }
        v
    }

    fn check(op: UnOp, xs: &[f32]) {
        let bytes: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
        for x4 in [false, true] {
            let prog = convert(op, xs, x4);
            let mut host = vec![bytes.clone(), vec![0u8; xs.len()]];
            crate::host::compile(&prog)
                .and_then(|c| c.run(&mut host, &crate::SingleProcess, 1))
                .expect("host run");
            for (i, x) in xs.iter().enumerate() {
                let want = if op == UnOp::E4m3 {
                    crate::reference::e4m3_from_f32(*x)
                } else {
                    crate::reference::e2m1_from_f32(x.clamp(-6.0, 6.0))
                };
                assert_eq!(host[1][i], want, "{op:?} of {x:e} (x4 = {x4})");
            }
        }
    }

    #[test]
    fn e4m3_decode_sequence_matches_the_table() {
        let mut va = VarAlloc::default();
        let item = va.new_var(Ty::I64);
        let body = vec![Stmt::Store {
            buf: BufId(1),
            index: e::v(item),
            value: e::un(UnOp::E4m3Decode, e::load(BufId(0), e::v(item))),
        }];
        let k: Kernel = va.kernel("dec".into(), item, 0x7F, body);
        let prog = one_kernel(k, (Elem::U8, 0x7F), (Elem::F32, 0x7F));
        let codes: Vec<u8> = (0..0x7F).collect();
        let mut host = vec![codes.clone(), vec![0u8; 4 * 0x7F]];
        crate::host::compile(&prog)
            .and_then(|c| c.run(&mut host, &crate::SingleProcess, 1))
            .expect("host run");
        for c in codes {
            let got = f32::from_le_bytes(host[1][4 * c as usize..][..4].try_into().unwrap());
            let want = crate::reference::e4m3_to_f32(c);
            assert_eq!(got.to_bits(), want.to_bits(), "byte {c:#04x}");
        }
    }

    #[test]
    fn e2m1_sequence_matches_the_threshold_table() {
        let grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        check(UnOp::E2m1, &values(6.5, 8, &grid));
    }

    /// `out[i] = pack_e2m1(x[8i..8i+8])` (as little-endian words), through the host backend (the
    /// soft sequence, Cranelift) and the interpreter (the reference per value), against the reference.
    fn check_pack(xs: &[f32], small: bool) {
        let mut va = VarAlloc::default();
        let item = va.new_var(Ty::I64);
        let mut em = Emit::new(&mut va);
        let vals = (0..8)
            .map(|k| e::load(BufId(0), e::add(e::mul(e::v(item), e::i(8)), e::i(k))))
            .collect();
        let w = em.set(Ty::I32, Expr::PackE2m1 { vals, small });
        let bytes = (0..4).map(|k| e::un(UnOp::Byte(k), w.clone())).collect();
        em.out.push(Stmt::StorePacked {
            buf: BufId(1),
            index: e::mul(e::v(item), e::i(4)),
            values: bytes,
        });
        let body = em.out;
        let n = xs.len() / 8;
        let k: Kernel = va.kernel("pack".into(), item, n as i64, body);
        let prog = one_kernel(k, (Elem::F32, 8 * n), (Elem::U8, 4 * n));
        let input: Vec<u8> = xs[..8 * n].iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut host = vec![input.clone(), vec![0u8; 4 * n]];
        crate::host::compile(&prog)
            .and_then(|c| c.run(&mut host, &crate::SingleProcess, 1))
            .expect("host run");
        let mut interp = vec![input, vec![0u8; 4 * n]];
        crate::interp::run(&prog, &mut interp, &crate::SingleProcess).expect("interpreter run");
        for (i, x) in xs[..8 * n].iter().enumerate() {
            let want = crate::reference::e2m1_from_f32(x.clamp(-6.0, 6.0));
            for (who, out) in [("host", &host[1]), ("interpreter", &interp[1])] {
                let got = (out[i / 2] >> (4 * (i % 2))) & 15;
                assert_eq!(
                    got, want,
                    "{who}: pack_e2m1 (small {small}) of {x:e} at {i}"
                );
            }
        }
    }

    #[test]
    fn packed_e2m1_matches_the_threshold_table() {
        let grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        let mut xs = values(6.5, 8, &grid);
        // Neighbours in a word differ in sign and size (a rotation of the list per pass).
        let rot: Vec<f32> = xs
            .iter()
            .cycle()
            .skip(3)
            .step_by(5)
            .take(xs.len())
            .copied()
            .collect();
        xs.extend(rot);
        check_pack(&xs, false);
        let small: Vec<f32> = xs.into_iter().filter(|x| x.abs() < 7.0).collect();
        check_pack(&small, true);
    }

    #[test]
    fn packed_e2m1_small_refuses_a_value_outside_its_range() {
        let mut va = VarAlloc::default();
        let item = va.new_var(Ty::I64);
        let mut em = Emit::new(&mut va);
        let w = em.set(
            Ty::I32,
            Expr::PackE2m1 {
                vals: vec![e::load(BufId(0), e::v(item))],
                small: true,
            },
        );
        em.out.push(Stmt::Store {
            buf: BufId(1),
            index: e::v(item),
            value: e::un(UnOp::Byte(0), w),
        });
        let body = em.out;
        let k: Kernel = va.kernel("pack".into(), item, 1, body);
        let prog = one_kernel(k, (Elem::F32, 1), (Elem::U8, 1));
        for (x, ok) in [(6.99f32, true), (-6.99, true), (7.0, false), (-9.0, false)] {
            let mut bufs = vec![x.to_le_bytes().to_vec(), vec![0u8]];
            let r = crate::interp::run(&prog, &mut bufs, &crate::SingleProcess);
            assert_eq!(r.is_ok(), ok, "{x}");
        }
    }

    #[test]
    fn byte_permute_follows_ptx_prmt() {
        let (a, b) = (0x8877_6655u32, 0x44F3_2211u32);
        // Plain bytes, reversed, and copied top bits (0x88 and 0x44: one set, one clear).
        assert_eq!(crate::interp::prmt(a, b, 0x3210), a);
        assert_eq!(crate::interp::prmt(a, b, 0x7654), b);
        assert_eq!(crate::interp::prmt(a, b, 0x0123), 0x5566_7788);
        assert_eq!(crate::interp::prmt(a, b, 0x5410), 0x2211_6655);
        assert_eq!(crate::interp::prmt(a, b, 0x00FB), 0x5555_00FF);
        assert_eq!(crate::interp::prmt(a, b, 0xEFAB), 0xFF00_00FF);
    }

    #[test]
    fn e4m3_sequence_matches_the_code_table() {
        let grid: Vec<f32> = (0u8..=0x7E).map(crate::reference::e4m3_to_f32).collect();
        check(UnOp::E4m3, &values(500.0, 12, &grid));
    }
}

#[cfg(test)]
mod division_tests {
    /// Every bf16 `x` with `|x| <= amax` (non-negative: the sequence is odd-symmetric) against every
    /// `step`-th positive bf16 row maximum whose scale is in `reciprocal_safe`'s range: the INT8 code and
    /// the E4M3 code of `quot_by_reciprocal`'s quotient (the same f32 operations, in Rust) equal those
    /// of the correctly rounded `x / scale`. Returns the number of pairs checked.
    fn row_division(step: u32) -> u64 {
        let bf = |b: u32| f32::from_bits(b << 16);
        let (lo, hi) = (f32::from_bits(0x0D80_0000), f32::from_bits(0x7180_0000));
        let mut pairs = 0u64;
        for int8 in [true, false] {
            let mut a_b = 1u32;
            while a_b < 0x7F80 {
                let amax = bf(a_b);
                let scale = if int8 {
                    amax / 127.0
                } else {
                    (amax / 448.0).max(1.0 / (448.0 * 512.0))
                };
                if (lo..=hi).contains(&scale) {
                    let y = 1.0f32 / scale;
                    for x_b in 0..=a_b {
                        let x = bf(x_b);
                        let want = x / scale;
                        let q0 = x * y;
                        let q = ((-scale).mul_add(q0, x)).mul_add(y, q0);
                        pairs += 1;
                        if q.to_bits() == want.to_bits() {
                            continue;
                        }
                        if int8 {
                            let c = |v: f32| v.clamp(-128.0, 127.0).round_ties_even();
                            assert_eq!(c(q), c(want), "int8: x={x:e} scale={scale:e}");
                        } else {
                            let c = crate::reference::e4m3_from_f32;
                            assert_eq!(c(q), c(want), "e4m3: x={x:e} scale={scale:e}");
                        }
                    }
                }
                a_b += step;
            }
        }
        pairs
    }

    #[test]
    fn row_division_by_reciprocal_sampled() {
        assert!(row_division(97) > 1_000_000);
    }

    /// The whole domain (about 9e8 pairs; `cargo test --release -p moeforge-codegen -- --ignored`).
    #[test]
    #[ignore]
    fn exhaustive_row_division() {
        assert!(row_division(1) > 800_000_000);
    }
}
