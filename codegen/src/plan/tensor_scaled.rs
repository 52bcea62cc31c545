//! NVFP4 and FP8 per tensor: per-expert amax (one CTA per slice in the GPU form), its collective,
//! the scales, and FP8's quantize pass.

use moeforge_dsl::ir::{AmaxGranularity, Group, QuantScheme};

use super::*;
use crate::kir::{e, BinOp, BufRole, Elem, Expr, Step, Stmt, Ty};
use crate::quant::{self, clamp, fabs, fdiv, fmax, fmul, is_zero};
use crate::Result;

impl Planner<'_> {
    /// NVFP4 and FP8 per-tensor: a per-expert (or per-tensor) amax, its collective, the scales, then
    /// the quantize pass ([`Self::nvfp4_pass`], or FP8's codes here).
    pub(super) fn quant_tensor_scaled(&mut self, ctx: &QuantCtx<'_>) -> Result<()> {
        let QuantCtx {
            q,
            tag,
            xb,
            ne,
            rows,
            cols,
            vals,
            scl,
            glob,
            dec,
            src_row,
            scheme,
            ..
        } = ctx.clone();
        let rc = ctx.rows * ctx.cols;
        let xb_l = ctx.xb;
        let load = move |row_base: Expr, c: Expr| e::load(xb_l, e::add(row_base, c));
        let (per_tensor, group) = match scheme {
            QuantScheme::Nvfp4 { amax, group } => (amax == AmaxGranularity::PerTensor, group),
            QuantScheme::Fp8 { group, .. } => (false, group),
            _ => (false, Group::None),
        };
        // NVFP4's 16-element blocks along the columns must lie within one rank.
        let is_nvfp4 = matches!(scheme, QuantScheme::Nvfp4 { .. });
        ctx.check_cut(if is_nvfp4 { (1, 16) } else { (1, 1) })?;
        let n_amax = if per_tensor { 1 } else { ne as usize };
        let amax_b = self.buf(
            BufRole::Temp(format!("{tag}_amax")),
            Elem::F32,
            n_amax,
            true,
        );
        // 1. amax: one work item per row, atomically max-reduced per expert.
        let x4 = self.x4 && cols % 16 == 0;
        if !self.x4 {
            // GPU form: one CTA per slice of 4096 16-byte chunks of an expert; its threads
            // take neighbouring chunks (coalesced, 16 trips each, unrolled), reduce together,
            // and thread 0 makes one atomic max per slice.
            let n_e = rows * cols;
            let chunk = if n_e % 8 == 0 { 8 } else { 1 };
            let xelem = self.prog.buf(xb).map(|b| b.elem).unwrap_or(Elem::F32);
            let per: i64 = self.sched.amax_slice_chunks;
            let nchunks = n_e / chunk;
            let slices = (nchunks + per - 1) / per;
            let guard = nchunks % per != 0;
            self.group_kernel(
                format!("{tag}_amax"),
                ne * slices,
                self.sched.cta_threads,
                |em, it| {
                    let ex = em.set(Ty::I64, e::div(it.clone(), slices));
                    let sl = em.set(Ty::I64, e::rem(it, slices));
                    let base = em.set(Ty::I64, e::mul(ex.clone(), e::i(n_e)));
                    let mx = em.vars.new_var(Ty::F32);
                    let sub = em.vars.new_var(Ty::I64);
                    let m = em.vars.new_var(Ty::F32);
                    let body = em.block(|b| {
                        let ci = b.set(Ty::I64, e::add(e::mul(sl.clone(), e::i(per)), e::v(sub)));
                        let load = b.block(|b2| {
                            let at = e::add(base.clone(), e::mul(ci.clone(), e::i(chunk)));
                            let xs = load_block(b2, xb, xelem, at, chunk as usize);
                            b2.out.push(Stmt::Set(m, Expr::AbsMax(xs)));
                        });
                        if guard {
                            b.out.push(Stmt::Set(m, e::f(0.0)));
                            b.out.push(Stmt::If {
                                cond: e::bin(BinOp::ILt, ci, e::i(nchunks)),
                                then: load,
                            });
                        } else {
                            b.out.extend(load);
                        }
                    });
                    em.out.push(Stmt::GroupMax {
                        var: mx,
                        sub,
                        count: e::i(per),
                        body,
                        value: e::v(m),
                    });
                    let idx = if per_tensor { e::i(0) } else { ex };
                    em.out.push(Stmt::AtomicMaxF32 {
                        buf: amax_b,
                        index: idx,
                        value: e::v(mx),
                    });
                    Ok(())
                },
            )?;
        } else {
            self.kernel(format!("{tag}_amax"), ne * rows, |em, it| {
                let ex = em.set(Ty::I64, e::div(it.clone(), rows));
                let base = em.set(Ty::I64, e::mul(it, e::i(cols)));
                let mx = if x4 {
                    // 16 values per step in four f32x4 lanes, reduced across lanes at the end.
                    let mv = em.var(Ty::F32x4, e::splat(e::f(0.0)));
                    em.for_(e::i(0), e::i(cols / 16), |b, c| {
                        let at = b.set(Ty::I64, e::add(base.clone(), e::mul(c, e::i(16))));
                        let vs = (0..4)
                            .map(|q| fabs(e::load_x4(xb, e::add(at.clone(), e::i(4 * q)))))
                            .collect();
                        b.out.push(Stmt::Set(mv, fmax(e::v(mv), max_tree(vs))));
                    });
                    let lanes = (0..4).map(|k| e::lane(e::v(mv), k)).collect();
                    em.var(Ty::F32, max_tree(lanes))
                } else {
                    let mx = em.var(Ty::F32, e::f(0.0));
                    em.for_(e::i(0), e::i(cols), |b, c| {
                        b.out
                            .push(Stmt::Set(mx, fmax(e::v(mx), fabs(load(base.clone(), c)))));
                    });
                    mx
                };
                let idx = if per_tensor { e::i(0) } else { ex };
                em.out.push(Stmt::AtomicMaxF32 {
                    buf: amax_b,
                    index: idx,
                    value: e::v(mx),
                });
                Ok(())
            })?;
        }
        if group != Group::None {
            self.prog
                .steps
                .push(Step::AllReduceMax { buf: amax_b, group });
        }
        // Where this rank holds a slice of the amax's region, the MAX over the groups that cut it
        // (the recipe's own group is `moe_tp` for expert weights, the default where it names none;
        // a per-tensor amax also spans the experts `ep` divides).
        let mut cut = Vec::new();
        if ctx.shard.moe_tp.is_some() {
            cut.push(Group::MoeTp);
        }
        if per_tensor && ctx.shard.ep {
            cut.push(Group::Ep);
        }
        for g in cut {
            if g != group {
                self.prog.steps.push(Step::AllReduceMax {
                    buf: amax_b,
                    group: g,
                });
            }
        }
        let is_nv = matches!(scheme, QuantScheme::Nvfp4 { .. });
        let s1 = self.buf(
            BufRole::Temp(format!("{tag}_{}", if is_nv { "gs" } else { "scale" })),
            Elem::F32,
            n_amax,
            false,
        );
        let s2 = self.buf(
            BufRole::Temp(format!("{tag}_{}", if is_nv { "decode" } else { "inv" })),
            Elem::F32,
            n_amax,
            false,
        );
        // 2. per-expert scales.
        self.kernel(format!("{tag}_scales"), n_amax as i64, |em, it| {
            let a = em.set(Ty::F32, e::load(amax_b, it.clone()));
            if is_nv {
                // gs = 2688 / amax (1 for an all-zero expert); decode = 1 / gs.
                let gs = em.set(
                    Ty::F32,
                    e::sel(is_zero(a.clone()), e::f(1.0), fdiv(e::f(2688.0), a)),
                );
                let d = em.set(Ty::F32, fdiv(e::f(1.0), gs.clone()));
                em.out.push(Stmt::Store {
                    buf: s1,
                    index: it.clone(),
                    value: gs.clone(),
                });
                em.out.push(Stmt::Store {
                    buf: s2,
                    index: it.clone(),
                    value: d.clone(),
                });
                if let Some(g) = glob {
                    em.out.push(Stmt::Store {
                        buf: g,
                        index: it.clone(),
                        value: gs,
                    });
                }
                if let Some(dd) = dec {
                    em.out.push(Stmt::Store {
                        buf: dd,
                        index: it,
                        value: d,
                    });
                }
            } else {
                // scale = amax / 448 (1 for an all-zero expert); inv = 1 / scale.
                let s = em.set(
                    Ty::F32,
                    e::sel(is_zero(a.clone()), e::f(1.0), fdiv(a, e::f(448.0))),
                );
                let inv = em.set(Ty::F32, fdiv(e::f(1.0), s.clone()));
                em.out.push(Stmt::Store {
                    buf: s1,
                    index: it.clone(),
                    value: s.clone(),
                });
                em.out.push(Stmt::Store {
                    buf: s2,
                    index: it.clone(),
                    value: inv,
                });
                if let Some((sb, _)) = &scl {
                    let sb = *sb;
                    em.out.push(Stmt::Store {
                        buf: sb,
                        index: it,
                        value: s,
                    });
                }
            }
            Ok(())
        })?;
        if is_nv {
            self.quants.insert(
                q,
                QuantTemps {
                    gs: Some(s1),
                    decode: Some(s2),
                    fp8_scale: None,
                },
            );
            self.nvfp4_pass(
                &tag, xb, ne, rows, cols, per_tensor, s1, s2, vals, scl, &src_row,
            )?;
        } else {
            self.quants.insert(
                q,
                QuantTemps {
                    gs: None,
                    decode: None,
                    fp8_scale: Some(s1),
                },
            );
            // 3. q = e4m3(clamp(x * inv, +-448)).
            let vb = vals;
            let x4_q = self.x4 && cols % 4 == 0;
            let xelem = self.prog.buf(xb).map(|b| b.elem).unwrap_or(Elem::F32);
            // GPU form: one work item per 16 elements of a row (coalesced).
            let nch = if !self.x4 && cols % 16 == 0 {
                cols / 16
            } else {
                1
            };
            let (c0, c1) = (if nch > 1 { 16 } else { cols }, nch);
            self.kernel(format!("{tag}_quant"), ne * rows * c1, |em, it0| {
                let (it, cstart) = if nch > 1 {
                    let row = em.set(Ty::I64, e::div(it0.clone(), nch));
                    let ch = em.set(Ty::I64, e::mul(e::rem(it0, nch), e::i(16)));
                    (row, ch)
                } else {
                    (it0, e::i(0))
                };
                let ex = em.set(Ty::I64, e::div(it.clone(), rows));
                let r = em.set(Ty::I64, e::rem(it.clone(), rows));
                let sr = src_row(em, r);
                let base = em.set(
                    Ty::I64,
                    e::add(e::mul(ex.clone(), e::i(rc)), e::mul(sr, e::i(cols))),
                );
                let out = em.set(Ty::I64, e::mul(it, e::i(cols)));
                let inv = em.set(Ty::F32, e::load(s2, ex));
                if let Some(vb) = vb {
                    if x4_q {
                        em.for_(e::i(0), e::i(cols / 4), |b, c| {
                            let c4 = b.set(Ty::I64, e::mul(c, e::i(4)));
                            let x = fmul(
                                e::load_x4(xb, e::add(base.clone(), c4.clone())),
                                inv.clone(),
                            );
                            let code = b.vector(|bv| quant::e4m3_rne(bv, clamp(x, -448.0, 448.0)));
                            for k in 0..4u8 {
                                b.out.push(Stmt::Store {
                                    buf: vb,
                                    index: e::add(e::add(out.clone(), c4.clone()), e::i(k as i64)),
                                    value: e::lane(code.clone(), k),
                                });
                            }
                        });
                    } else if nch > 1 {
                        // GPU form: 16 elements in, 16 bytes out, as packed accesses.
                        let xs =
                            load_block(em, xb, xelem, e::add(base.clone(), cstart.clone()), 16);
                        let codes: Vec<Expr> = e4m3_codes(em, xs, &inv);
                        store_block(em, vb, Elem::U8, e::add(out.clone(), cstart.clone()), codes);
                    } else {
                        em.for_(cstart.clone(), e::add(cstart.clone(), e::i(c0)), |b, c| {
                            let x = clamp(
                                fmul(load(base.clone(), c.clone()), inv.clone()),
                                -448.0,
                                448.0,
                            );
                            let code = quant::e4m3_rne(b, x);
                            b.out.push(Stmt::Store {
                                buf: vb,
                                index: e::add(out.clone(), c),
                                value: code,
                            });
                        });
                    }
                }
                Ok(())
            })?;
        }
        Ok(())
    }
}
