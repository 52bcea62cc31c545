//! Group-wise INT8 and FP8: per group of `g` elements along a row, the row formula per group:
//! SPEC §8's symmetric int8 (`scale = amax / 127`, 1 for an all-zero group; `q = clamp(rne(x /
//! scale), -128, 127)`), or the per-channel FP8 one (`scale = max(amax / 448, 1 / (448 * 512))`, 1
//! for an all-zero group; `q = e4m3(rne(x / scale))`).

use moeforge_dsl::ir::{Fp8Granularity, QuantScheme};

use super::*;
use crate::kir::{e, Stmt, Ty};
use crate::quant::{self, fabs, fdiv, fmax, is_zero};
use crate::{Error, Result};

impl Planner<'_> {
    /// Group-wise INT8 and FP8 (README, "Group-wise INT8", "Group-wise FP8"): one work item per
    /// row and group: the group's amax, its f32 scale (int8: `amax / 127`; FP8: `max(amax / 448,
    /// 1 / (448 * 512))`; correctly rounded; 1 where the amax is 0), then each element's code
    /// (int8: `clamp(rne(x / scale), -128, 127)`; FP8: the E4M3 rounding of `x / scale`, a
    /// correctly rounded quotient) as a byte.
    pub(super) fn quant_groups(&mut self, ctx: &QuantCtx<'_>) -> Result<()> {
        let (group, fp8) = match ctx.scheme {
            QuantScheme::Int8Group { group } => (group, false),
            QuantScheme::Fp8 {
                granularity: Fp8Granularity::Group { group },
                ..
            } => (group, true),
            _ => return Err(Error::Internal("a group-wise scheme expected")),
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
            ..
        } = ctx.clone();
        if group <= 0 || cols % group != 0 {
            return Err(Error::Internal("the groups do not divide the rows"));
        }
        // A rank's cut of the columns must keep whole groups (each group's amax is its own).
        ctx.check_cut((1, group))?;
        self.quants.insert(
            q,
            QuantTemps {
                gs: None,
                decode: None,
                fp8_scale: None,
            },
        );
        let ng = cols / group;
        let sb = scl.as_ref().map(|x| x.0);
        self.kernel(format!("{tag}_quant"), ne * rows * ng, |em, it0| {
            let (row, j, base) = ctx.row_item(em, it0, ng);
            let b0 = em.set(Ty::I64, e::add(base, e::mul(j.clone(), e::i(group))));
            // Pass 1: the group's amax.
            let hi = em.var(Ty::F32, e::f(0.0));
            em.for_(e::i(0), e::i(group), |b, c| {
                let x = b.set(Ty::F32, e::load(xb, e::add(b0.clone(), c)));
                b.out.push(Stmt::Set(hi, fmax(e::v(hi), fabs(x))));
            });
            let scale = if fp8 {
                fmax(fdiv(e::v(hi), e::f(448.0)), e::f(1.0 / (448.0 * 512.0)))
            } else {
                fdiv(e::v(hi), e::f(127.0))
            };
            let s = em.set(Ty::F32, e::sel(is_zero(e::v(hi)), e::f(1.0), scale));
            if let Some(sb) = sb {
                em.out.push(Stmt::Store {
                    buf: sb,
                    index: e::add(e::mul(row.clone(), e::i(ng)), j.clone()),
                    value: s.clone(),
                });
            }
            // Pass 2: the codes.
            if let Some(vb) = vals {
                let out0 = em.set(
                    Ty::I64,
                    e::add(e::mul(row, e::i(cols)), e::mul(j, e::i(group))),
                );
                em.for_(e::i(0), e::i(group), |b, c| {
                    let x = e::load(xb, e::add(b0.clone(), c.clone()));
                    let code = if fp8 {
                        let q = fdiv(x, s.clone());
                        quant::e4m3_rne(b, q)
                    } else {
                        quant::int8_rne(b, x, s.clone())
                    };
                    b.out.push(Stmt::Store {
                        buf: vb,
                        index: e::add(out0.clone(), c),
                        value: code,
                    });
                });
            }
            Ok(())
        })
    }
}
