//! Group-wise INT4 (W4A16, GPTQ/AWQ style): per group of `g` elements along a row, a scale rounded
//! to its dtype (and, asymmetric, a u4 zero point), then u4 codes packed two per byte.

use moeforge_dsl::ir::QuantScheme;

use super::*;
use crate::kir::{e, BinOp, Expr, Stmt, Ty};
use crate::quant::{self, clamp, fabs, fdiv, fmax, is_zero};
use crate::{Error, Result};

impl Planner<'_> {
    /// Group-wise INT4 (README, "Group-wise INT4"): one work item per row and group (per pair of
    /// groups when zero points are stored: two share a byte). Per group: the amax (symmetric) or
    /// the minimum and maximum widened to include 0 (asymmetric); the f32 scale `amax / 7` or
    /// `(max - min) / 15` rounded to the scale dtype (1 where that is 0); the zero point (8, or
    /// `clamp(rne(-min / s), 0, 15)`); then the codes `clamp(rne(x / s) + z, 0, 15)`, element 2j in
    /// the low nibble.
    pub(super) fn quant_int4(&mut self, ctx: &QuantCtx<'_>) -> Result<()> {
        let QuantScheme::Int4 {
            group,
            zero_point,
            scale,
        } = ctx.scheme
        else {
            return Err(Error::Internal("int4 scheme expected"));
        };
        let QuantCtx {
            q,
            tag,
            xb,
            ne,
            rows,
            cols,
            vals,
            scl,
            zer,
            ..
        } = ctx.clone();
        // Two groups' zero points share a byte: an item takes both.
        let gpi = if zero_point { 2 } else { 1 };
        ctx.check_cut((1, group * gpi))?;
        self.quants.insert(
            q,
            QuantTemps {
                gs: None,
                decode: None,
                fp8_scale: None,
            },
        );
        if cols % (group * gpi) != 0 {
            return Err(Error::Internal("int4 groups do not divide the rows"));
        }
        let ng = cols / group;
        let ipr = ng / gpi;
        let sb = scl.as_ref().map(|x| x.0);
        self.kernel(format!("{tag}_quant"), ne * rows * ipr, |em, it0| {
            let (row, pair, base) = ctx.row_item(em, it0, ipr);
            let mut zs: Vec<Expr> = Vec::new();
            for k in 0..gpi {
                let j = em.set(Ty::I64, e::add(e::mul(pair.clone(), e::i(gpi)), e::i(k)));
                let b0 = em.set(
                    Ty::I64,
                    e::add(base.clone(), e::mul(j.clone(), e::i(group))),
                );
                // Pass 1: the group's range (max |x|; or max and min, both widened to include 0).
                let hi = em.var(Ty::F32, e::f(0.0));
                let lo = em.var(Ty::F32, e::f(0.0));
                em.for_(e::i(0), e::i(group), |b, c| {
                    let x = b.set(Ty::F32, e::load(xb, e::add(b0.clone(), c)));
                    if zero_point {
                        b.out.push(Stmt::Set(hi, fmax(e::v(hi), x.clone())));
                        b.out.push(Stmt::Set(lo, e::bin(BinOp::FMin, e::v(lo), x)));
                    } else {
                        b.out.push(Stmt::Set(hi, fmax(e::v(hi), fabs(x))));
                    }
                });
                let s32 = if zero_point {
                    fdiv(
                        e::bin(BinOp::FAdd, e::v(hi), quant::fmul(e::v(lo), e::f(-1.0))),
                        e::f(15.0),
                    )
                } else {
                    fdiv(e::v(hi), e::f(7.0))
                };
                let s = quant::round_scale(em, s32, scale);
                let s = em.set(Ty::F32, e::sel(is_zero(s.clone()), e::f(1.0), s));
                if let Some(sb) = sb {
                    em.out.push(Stmt::Store {
                        buf: sb,
                        index: e::add(e::mul(row.clone(), e::i(ng)), j.clone()),
                        value: s.clone(),
                    });
                }
                let z = if zero_point {
                    let nl = quant::fmul(e::v(lo), e::f(-1.0));
                    em.set(
                        Ty::F32,
                        clamp(
                            e::un(crate::kir::UnOp::FRoundEven, fdiv(nl, s.clone())),
                            0.0,
                            15.0,
                        ),
                    )
                } else {
                    e::f(8.0)
                };
                zs.push(z.clone());
                // Pass 2: the codes, two per byte (element 2c in the low nibble).
                if let Some(vb) = vals {
                    let out0 = em.set(
                        Ty::I64,
                        e::add(
                            e::mul(row.clone(), e::i(cols / 2)),
                            e::mul(j, e::i(group / 2)),
                        ),
                    );
                    em.for_(e::i(0), e::i(group / 2), |b, c2| {
                        let at = b.set(Ty::I64, e::add(b0.clone(), e::mul(c2.clone(), e::i(2))));
                        let x0 = e::load(xb, at.clone());
                        let x1 = e::load(xb, e::add(at, e::i(1)));
                        let q0 = quant::int4_code(b, x0, &s, &z);
                        let q1 = quant::int4_code(b, x1, &s, &z);
                        b.out.push(Stmt::Store {
                            buf: vb,
                            index: e::add(out0.clone(), c2),
                            value: e::bin(BinOp::Or, q0, e::bin(BinOp::Shl, q1, e::i32(4))),
                        });
                    });
                }
            }
            if let (Some(zb), [z0, z1]) = (zer, &zs[..]) {
                let c0 = quant::rne_small_int(z0.clone());
                let c1 = quant::rne_small_int(z1.clone());
                em.out.push(Stmt::Store {
                    buf: zb,
                    index: e::add(e::mul(row, e::i(ng / 2)), pair),
                    value: e::bin(BinOp::Or, c0, e::bin(BinOp::Shl, c1, e::i32(4))),
                });
            }
            Ok(())
        })
    }
}
