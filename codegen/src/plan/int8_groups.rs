//! Group-wise INT8: per group of `g` elements along a row, SPEC §8's symmetric formula (`scale =
//! amax / 127`, 1 for an all-zero group; `q = clamp(rne(x / scale), -128, 127)`).

use moeforge_dsl::ir::QuantScheme;

use super::*;
use crate::kir::{e, Stmt, Ty};
use crate::quant::{self, fabs, fdiv, fmax, is_zero};
use crate::{Error, Result};

impl Planner<'_> {
    /// Group-wise INT8 (README, "Group-wise INT8"): one work item per row and group: the group's
    /// amax, its f32 scale `amax / 127` (correctly rounded; 1 where the amax is 0), then each
    /// element's code `clamp(rne(x / scale), -128, 127)` (a correctly rounded quotient) as a byte.
    pub(super) fn quant_int8_groups(&mut self, ctx: &QuantCtx<'_>) -> Result<()> {
        let QuantScheme::Int8Group { group } = ctx.scheme else {
            return Err(Error::Internal("group-wise int8 scheme expected"));
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
            return Err(Error::Internal("int8 groups do not divide the rows"));
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
            let s = em.set(
                Ty::F32,
                e::sel(is_zero(e::v(hi)), e::f(1.0), fdiv(e::v(hi), e::f(127.0))),
            );
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
                    let code = quant::int8_rne(b, x, s.clone());
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
