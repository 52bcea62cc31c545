//! INT8 and FP8 per channel: one group per row reading DRAM once (max, then quantize what was
//! loaded), or a row loop in the host form.

use moeforge_dsl::ir::{Group, QuantScheme};

use super::*;
use crate::kir::{e, BinOp, BufId, BufRole, Elem, Expr, GroupRow, Step, Stmt, Ty};
use crate::quant::{self, clamp, fabs, fdiv, fmax, fmul, is_zero, Emit};
use crate::{Error, Result};

/// Where a row pass takes each row's amax from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RowAmax {
    /// The row's own values (the row is whole on this rank): max, scale and codes in one pass.
    Own,
    /// Only the row's amax, stored to this `[E * rows]` buffer (no scales, no codes).
    Store(BufId),
    /// The amax in this buffer (all-reduced over the ranks that split the row); scales and codes.
    Load(BufId),
}

impl Planner<'_> {
    /// INT8 and FP8 per channel: one scale per row, the row quantized with it. Where the columns
    /// are split over `moe_tp`, a row's amax runs over every rank's slice: a pass of row maxima,
    /// their MAX all-reduce over `moe_tp`, then the quantize pass scaling by the reduced amax.
    pub(super) fn quant_rows(&mut self, ctx: &QuantCtx<'_>) -> Result<()> {
        ctx.check_cut((1, 1))?;
        if !ctx.row_cut() {
            return self.rows_pass(ctx, RowAmax::Own);
        }
        let amax_b = self.buf(
            BufRole::Temp(format!("{}_row_amax", ctx.tag)),
            Elem::F32,
            usize::try_from(ctx.ne * ctx.rows).map_err(|_| Error::Internal("size"))?,
            false,
        );
        self.rows_pass(ctx, RowAmax::Store(amax_b))?;
        self.prog.steps.push(Step::AllReduceMax {
            buf: amax_b,
            group: Group::MoeTp,
        });
        self.rows_pass(ctx, RowAmax::Load(amax_b))
    }

    /// One pass over the rows (see [`RowAmax`]).
    fn rows_pass(&mut self, ctx: &QuantCtx<'_>, from: RowAmax) -> Result<()> {
        let QuantCtx {
            q,
            tag,
            xb,
            ne,
            rows,
            cols,
            vals,
            scl,
            src_row,
            scheme,
            ..
        } = ctx.clone();
        let rc = ctx.rows * ctx.cols;
        let xb_l = ctx.xb;
        let load = move |row_base: Expr, c: Expr| e::load(xb_l, e::add(row_base, c));
        let int8 = matches!(scheme, QuantScheme::Int8Row);
        self.quants.insert(
            q,
            QuantTemps {
                gs: None,
                decode: None,
                fp8_scale: None,
            },
        );
        let (sb, vals) = match from {
            RowAmax::Store(_) => (None, None),
            _ => (scl.as_ref().map(|x| x.0), vals),
        };
        let name = match from {
            RowAmax::Store(_) => format!("{tag}_row_amax"),
            _ => format!("{tag}_quant"),
        };
        let packed = !self.x4 && cols % 8 == 0;
        let x4r = self.x4 && cols % 4 == 0;
        let xelem = self.prog.buf(xb).map(|b| b.elem).unwrap_or(Elem::F32);
        // The row's scale from its amax, as SPEC §8 (int8) or the per-channel FP8 formula.
        let scale_of = move |em: &mut Emit<'_>, mx: Expr| -> Expr {
            if int8 {
                em.set(
                    Ty::F32,
                    e::sel(is_zero(mx.clone()), e::f(1.0), fdiv(mx, e::f(127.0))),
                )
            } else {
                em.set(
                    Ty::F32,
                    e::sel(
                        is_zero(mx.clone()),
                        e::f(1.0),
                        fmax(fdiv(mx, e::f(448.0)), e::f(1.0 / (448.0 * 512.0))),
                    ),
                )
            }
        };
        if packed {
            // GPU form: one CTA per row. Its threads stride through the row in 8-element
            // packed loads and max-reduce together (warp shuffles, shared memory); then they
            // quantize the row, reading it again from L1/L2 while it is still there, so DRAM
            // sees the input once.
            return self.group_kernel(
                name,
                ne * rows,
                row_group(cols / 8, &self.sched),
                |em, row| {
                    let ex = em.set(Ty::I64, e::div(row.clone(), rows));
                    let r = em.set(Ty::I64, e::rem(row.clone(), rows));
                    let sr = src_row(em, r);
                    let base = em.set(
                        Ty::I64,
                        e::add(e::mul(ex, e::i(rc)), e::mul(sr, e::i(cols))),
                    );
                    // Pass 1 loads the row and max-reduces it; between the passes, the
                    // row's scale; pass 2 quantizes what pass 1 loaded.
                    let mx = em.vars.new_var(Ty::F32);
                    let sub = em.vars.new_var(Ty::I64);
                    let load_segment = |b: &mut Emit<'_>| {
                        let at = e::add(base.clone(), e::mul(e::v(sub), e::i(8)));
                        load_block(b, xb, xelem, at, 8)
                    };
                    let mut xs: Vec<Expr> = Vec::new();
                    let load = em.block(|b| xs = load_segment(b));
                    let value = Expr::AbsMax(xs.clone());
                    // bf16 rows whose scale is in range divide by the row's reciprocal and
                    // one correction (see `quant::quot_by_reciprocal`); others, and wider
                    // inputs, by a correctly rounded division per element.
                    let fast = xelem == Elem::Bf16;
                    let mut scale = e::f(1.0);
                    let mut neg_b = e::f(0.0);
                    let mut y = e::f(0.0);
                    let mut safe = e::i32(0);
                    let mid = em.block(|b| {
                        let amax = match from {
                            RowAmax::Own => e::v(mx),
                            RowAmax::Load(ab) => b.set(Ty::F32, e::load(ab, row.clone())),
                            RowAmax::Store(ab) => {
                                b.out.push(Stmt::Store {
                                    buf: ab,
                                    index: row.clone(),
                                    value: e::v(mx),
                                });
                                return;
                            }
                        };
                        scale = scale_of(b, amax);
                        if let Some(sb) = sb {
                            b.out.push(Stmt::Store {
                                buf: sb,
                                index: row.clone(),
                                value: scale.clone(),
                            });
                        }
                        if fast && vals.is_some() {
                            neg_b = b.set(Ty::F32, fmul(scale.clone(), e::f(-1.0)));
                            y = b.set(Ty::F32, fdiv(e::f(1.0), scale.clone()));
                            safe = b.set(Ty::I32, quant::reciprocal_safe(scale.clone()));
                        }
                    });
                    let mut body = Vec::new();
                    let mut slow = Vec::new();
                    if let Some(vb) = vals {
                        let quantize = |b: &mut Emit<'_>, by_reciprocal: bool, xs: &[Expr]| {
                            let codes = xs
                                .iter()
                                .map(|x| {
                                    let q = if by_reciprocal {
                                        quant::quot_by_reciprocal(b, x.clone(), &neg_b, &y)
                                    } else {
                                        fdiv(x.clone(), scale.clone())
                                    };
                                    if int8 {
                                        quant::int8_of_quotient(b, q)
                                    } else {
                                        quant::e4m3_rne(b, q)
                                    }
                                })
                                .collect();
                            let at =
                                e::add(e::mul(row.clone(), e::i(cols)), e::mul(e::v(sub), e::i(8)));
                            store_block(b, vb, Elem::U8, at, codes);
                        };
                        body = em.block(|b| {
                            if fast {
                                let then = b.block(|b2| quantize(b2, true, &xs));
                                b.out.push(Stmt::If {
                                    cond: e::bin(BinOp::IEq, safe.clone(), e::i32(1)),
                                    then,
                                });
                            } else {
                                quantize(b, false, &xs);
                            }
                        });
                        if fast {
                            // Rows with an extreme scale: loaded again and divided per
                            // element, in a loop (a path real checkpoints do not take, kept
                            // out of the unrolled code).
                            slow = em.block(|b| {
                                let inner = b.block(|b2| {
                                    let again = load_segment(b2);
                                    quantize(b2, false, &again);
                                });
                                b.out.push(Stmt::If {
                                    cond: e::bin(BinOp::IEq, safe.clone(), e::i32(0)),
                                    then: vec![Stmt::GroupFor {
                                        var: sub,
                                        count: e::i(cols / 8),
                                        body: inner,
                                    }],
                                });
                            });
                        }
                    }
                    em.out.push(Stmt::GroupRow(GroupRow {
                        var: mx,
                        sub,
                        count: e::i(cols / 8),
                        load,
                        value,
                        mid,
                        body,
                    }));
                    em.out.extend(slow);
                    Ok(())
                },
            );
        }
        self.kernel(name, ne * rows, |em, it| {
            let ex = em.set(Ty::I64, e::div(it.clone(), rows));
            let r = em.set(Ty::I64, e::rem(it.clone(), rows));
            let sr = src_row(em, r);
            let base = em.set(
                Ty::I64,
                e::add(e::mul(ex, e::i(rc)), e::mul(sr, e::i(cols))),
            );
            let out = em.set(Ty::I64, e::mul(it.clone(), e::i(cols)));
            let mx = em.var(Ty::F32, e::f(0.0));
            if x4r {
                // Host form: four lanes at a time, reduced across lanes at the end.
                let mv = em.var(Ty::F32x4, e::splat(e::f(0.0)));
                em.for_(e::i(0), e::i(cols / 4), |b, c4| {
                    let x = fabs(e::load_x4(xb, e::add(base.clone(), e::mul(c4, e::i(4)))));
                    b.out.push(Stmt::Set(mv, fmax(e::v(mv), x)));
                });
                let lanes = (0..4).map(|k| e::lane(e::v(mv), k)).collect();
                em.out.push(Stmt::Set(mx, max_tree(lanes)));
            } else {
                // (The GPU form of rows a multiple of 8 long returned above.)
                em.for_(e::i(0), e::i(cols), |b, c| {
                    b.out
                        .push(Stmt::Set(mx, fmax(e::v(mx), fabs(load(base.clone(), c)))));
                });
            }
            let amax = match from {
                RowAmax::Own => e::v(mx),
                RowAmax::Load(ab) => em.set(Ty::F32, e::load(ab, it.clone())),
                RowAmax::Store(ab) => {
                    em.out.push(Stmt::Store {
                        buf: ab,
                        index: it,
                        value: e::v(mx),
                    });
                    return Ok(());
                }
            };
            // int8: amax / 127; fp8 per channel: max(amax / 448, 1 / (448*512)); 1 for a zero row.
            let scale = scale_of(em, amax);
            if let Some(sb) = sb {
                em.out.push(Stmt::Store {
                    buf: sb,
                    index: it,
                    value: scale.clone(),
                });
            }
            let code_of = |b: &mut Emit<'_>, x: Expr| {
                if int8 {
                    quant::int8_rne(b, x, scale.clone())
                } else {
                    let y = clamp(fdiv(x, scale.clone()), -448.0, 448.0);
                    quant::e4m3_rne(b, y)
                }
            };
            if let Some(vb) = vals {
                if x4r {
                    em.for_(e::i(0), e::i(cols / 4), |b, c4| {
                        let c = b.set(Ty::I64, e::mul(c4, e::i(4)));
                        let x = e::load_x4(xb, e::add(base.clone(), c.clone()));
                        let codes = b.vector(|bv| code_of(bv, x));
                        let lanes = (0..4u8).map(|k| e::lane(codes.clone(), k)).collect();
                        store_block(b, vb, Elem::U8, e::add(out.clone(), c), lanes);
                    });
                } else {
                    em.for_(e::i(0), e::i(cols), |b, c| {
                        let code = code_of(b, load(base.clone(), c.clone()));
                        b.out.push(Stmt::Store {
                            buf: vb,
                            index: e::add(out.clone(), c),
                            value: code,
                        });
                    });
                }
            }
            Ok(())
        })
    }
}
