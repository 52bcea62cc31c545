//! FP8 with 128x128 block scales: one group per block.

use super::*;
use crate::kir::{e, BinOp, Elem, Expr, GroupRow, Stmt, Ty};
use crate::quant::{self, clamp, fabs, fdiv, fmax, fmul, Emit};
use crate::Result;

impl Planner<'_> {
    /// FP8 with one scale per 128x128 block.
    pub(super) fn quant_fp8_block(&mut self, ctx: &QuantCtx<'_>) -> Result<()> {
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
            ..
        } = ctx.clone();
        ctx.check_cut((128, 128))?;
        let rc = ctx.rows * ctx.cols;
        let xb_l = ctx.xb;
        let _load = move |row_base: Expr, c: Expr| e::load(xb_l, e::add(row_base, c));
        self.quants.insert(
            q,
            QuantTemps {
                gs: None,
                decode: None,
                fp8_scale: None,
            },
        );
        let (bm, bk) = ((rows + 127) / 128, (cols + 127) / 128);
        let sb = scl.as_ref().map(|x| x.0);
        let packed = !self.x4 && cols % 8 == 0;
        let x4b = self.x4 && cols % 4 == 0;
        // The fallback below (the host form, and GPU rows not a multiple of 8 long): 4-lane
        // vectors on the host, single elements otherwise.
        let chunk: i64 = if x4b { 4 } else { 1 };
        let xelem = self.prog.buf(xb).map(|b| b.elem).unwrap_or(Elem::F32);
        if packed {
            // GPU form: one CTA per 128x128 block. Its threads take 8-element row segments
            // in turns (16 to a block row: neighbouring threads read neighbouring memory),
            // max-reduce together, and quantize the block from registers.
            let (need_r, need_c) = (rows % 128 != 0, cols % 128 != 0);
            return self.group_kernel(
                format!("{tag}_quant"),
                ne * bm * bk,
                self.sched.cta_threads,
                |em, it| {
                    let kb = em.set(Ty::I64, e::rem(it.clone(), bk));
                    let t = em.set(Ty::I64, e::div(it, bk));
                    let band = em.set(Ty::I64, e::rem(t.clone(), bm));
                    let ex = em.set(Ty::I64, e::div(t, bm));
                    // Segment `sub` of the block: row band*128 + sub/16, columns kb*128 + 8*(sub%16).
                    let seg =
                        |b: &mut Emit<'_>,
                         sub: Expr,
                         f: &mut dyn FnMut(&mut Emit<'_>, Expr, Expr)| {
                            let r = b.set(
                                Ty::I64,
                                e::add(e::mul(band.clone(), e::i(128)), e::div(sub.clone(), 16)),
                            );
                            let c = b.set(
                                Ty::I64,
                                e::add(
                                    e::mul(kb.clone(), e::i(128)),
                                    e::mul(e::rem(sub, 16), e::i(8)),
                                ),
                            );
                            let inner = b.block(|b2| {
                                let sr = src_row(b2, r.clone());
                                let src = b2.set(
                                    Ty::I64,
                                    e::add(
                                        e::add(
                                            e::mul(ex.clone(), e::i(rc)),
                                            e::mul(sr, e::i(cols)),
                                        ),
                                        c.clone(),
                                    ),
                                );
                                let dst = e::add(
                                    e::add(
                                        e::mul(ex.clone(), e::i(rc)),
                                        e::mul(r.clone(), e::i(cols)),
                                    ),
                                    c.clone(),
                                );
                                f(b2, src, dst);
                            });
                            let mut guarded = inner;
                            if need_c {
                                guarded = vec![Stmt::If {
                                    cond: e::bin(BinOp::ILt, c.clone(), e::i(cols)),
                                    then: guarded,
                                }];
                            }
                            if need_r {
                                guarded = vec![Stmt::If {
                                    cond: e::bin(BinOp::ILt, r.clone(), e::i(rows)),
                                    then: guarded,
                                }];
                            }
                            b.out.extend(guarded);
                        };
                    // Pass 1 loads the block and max-reduces it; between the passes, its scale;
                    // pass 2 quantizes what pass 1 loaded.
                    let mx = em.vars.new_var(Ty::F32);
                    let sub = em.vars.new_var(Ty::I64);
                    let m = em.vars.new_var(Ty::F32);
                    let mut xs: Vec<Expr> = Vec::new();
                    let load = em.block(|b| {
                        b.out.push(Stmt::Set(m, e::f(0.0)));
                        seg(b, e::v(sub), &mut |b2, src, _| {
                            xs = load_block(b2, xb, xelem, src, 8);
                            b2.out.push(Stmt::Set(m, Expr::AbsMax(xs.clone())));
                        });
                    });
                    // sf = max(amax, 1e-4) / 448; q = e4m3(x * (1/sf)).
                    let mut inv = e::f(1.0);
                    let mid = em.block(|b| {
                        let sf = b.set(Ty::F32, fdiv(fmax(e::v(mx), e::f(1e-4)), e::f(448.0)));
                        inv = b.set(Ty::F32, fdiv(e::f(1.0), sf.clone()));
                        if let Some(sb) = sb {
                            let si = e::add(
                                e::mul(ex.clone(), e::i(bm * bk)),
                                e::add(e::mul(band.clone(), e::i(bk)), kb.clone()),
                            );
                            b.out.push(Stmt::Store {
                                buf: sb,
                                index: si,
                                value: sf,
                            });
                        }
                    });
                    let body = match vals {
                        Some(vb) => em.block(|b| {
                            seg(b, e::v(sub), &mut |b2, _, dst| {
                                let codes = e4m3_codes(b2, xs.clone(), &inv);
                                store_block(b2, vb, Elem::U8, dst, codes);
                            });
                        }),
                        None => Vec::new(),
                    };
                    em.out.push(Stmt::GroupRow(GroupRow {
                        var: mx,
                        sub,
                        count: e::i(128 * 16),
                        load,
                        value: e::v(m),
                        mid,
                        body,
                    }));
                    Ok(())
                },
            );
        }
        // One work item per 128x128 block: amax, scale, quantize.
        self.kernel(format!("{tag}_quant"), ne * bm * bk, |em, it0| {
            let it = em.set(Ty::I64, e::div(it0.clone(), bk));
            let kb0 = em.set(Ty::I64, e::rem(it0, bk));
            let ex = em.set(Ty::I64, e::div(it.clone(), bm));
            let band = em.set(Ty::I64, e::rem(it.clone(), bm));
            let r0 = em.set(Ty::I64, e::mul(band.clone(), e::i(128)));
            let r1 = em.set(Ty::I64, e::bin(BinOp::IAdd, r0.clone(), e::i(128)));
            let r1 = em.set(
                Ty::I64,
                e::sel(e::bin(BinOp::ILt, r1.clone(), e::i(rows)), r1, e::i(rows)),
            );
            em.for_(kb0.clone(), e::add(kb0.clone(), e::i(1)), |b, kb| {
                let c0 = b.set(Ty::I64, e::mul(kb.clone(), e::i(128)));
                let c1 = b.set(Ty::I64, e::bin(BinOp::IAdd, c0.clone(), e::i(128)));
                let c1 = b.set(
                    Ty::I64,
                    e::sel(e::bin(BinOp::ILt, c1.clone(), e::i(cols)), c1, e::i(cols)),
                );
                let mx = b.var(Ty::F32, e::f(0.0));
                let rows_v = |b: &mut Emit<'_>, f: &dyn Fn(&mut Emit<'_>, Expr, Expr)| {
                    b.for_(r0.clone(), r1.clone(), |b2, r| {
                        let sr = src_row(b2, r.clone());
                        let base = b2.set(
                            Ty::I64,
                            e::add(e::mul(ex.clone(), e::i(rc)), e::mul(sr, e::i(cols))),
                        );
                        let out = b2.set(
                            Ty::I64,
                            e::add(e::mul(ex.clone(), e::i(rc)), e::mul(r, e::i(cols))),
                        );
                        if chunk > 1 {
                            // Host form: 4-lane vectors.
                            let (k0, k1) = (e::div(c0.clone(), chunk), e::div(c1.clone(), chunk));
                            b2.for_(k0, k1, |b3, ck| {
                                let c = b3.set(Ty::I64, e::mul(ck, e::i(chunk)));
                                f(b3, e::add(base.clone(), c.clone()), e::add(out.clone(), c))
                            });
                        } else {
                            b2.for_(c0.clone(), c1.clone(), |b3, c| {
                                f(b3, e::add(base.clone(), c.clone()), e::add(out.clone(), c))
                            });
                        }
                    });
                };
                // A vector accumulator only in the host form (the PTX backend takes scalar IR).
                let mv = x4b.then(|| b.var(Ty::F32x4, e::splat(e::f(0.0))));
                rows_v(b, &|b3, src, _| {
                    if let Some(mv) = mv {
                        b3.out
                            .push(Stmt::Set(mv, fmax(e::v(mv), fabs(e::load_x4(xb, src)))));
                        return;
                    }
                    let m = fabs(e::load(xb, src));
                    b3.out.push(Stmt::Set(mx, fmax(e::v(mx), m)));
                });
                if let Some(mv) = mv {
                    let lanes = (0..4).map(|k| e::lane(e::v(mv), k)).collect();
                    b.out.push(Stmt::Set(mx, max_tree(lanes)));
                }
                // sf = max(amax, 1e-4) / 448; q = e4m3(clamp(x * (1/sf))).
                let sf = b.set(Ty::F32, fdiv(fmax(e::v(mx), e::f(1e-4)), e::f(448.0)));
                let inv = b.set(Ty::F32, fdiv(e::f(1.0), sf.clone()));
                if let Some(sb) = sb {
                    let si = e::add(
                        e::mul(ex.clone(), e::i(bm * bk)),
                        e::add(e::mul(band.clone(), e::i(bk)), kb),
                    );
                    b.out.push(Stmt::Store {
                        buf: sb,
                        index: si,
                        value: sf,
                    });
                }
                if let Some(vb) = vals {
                    rows_v(b, &|b3, src, dst| {
                        if x4b {
                            let x = fmul(e::load_x4(xb, src), inv.clone());
                            let codes =
                                b3.vector(|bv| quant::e4m3_rne(bv, clamp(x, -448.0, 448.0)));
                            let lanes = (0..4u8).map(|k| e::lane(codes.clone(), k)).collect();
                            store_block(b3, vb, Elem::U8, dst, lanes);
                        } else {
                            let code = e4m3_codes(b3, vec![e::load(xb, src)], &inv);
                            store_block(b3, vb, Elem::U8, dst, code);
                        }
                    });
                }
            });
            Ok(())
        })
    }
}
