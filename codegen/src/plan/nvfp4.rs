//! The NVFP4 quantize pass: E4M3 block scales (stored straight through their storage map, padding
//! zero-filled) and packed E2M1 codes, with the no-saturation fast path for normal blocks.

use super::*;
use crate::kir::{e, BinOp, BufId, Elem, Expr, Stmt, Ty, UnOp};
use crate::quant::{self, fdiv, fmul, Emit};
use crate::{Error, Result};

impl Planner<'_> {
    /// The NVFP4 quantize pass: per 16-element block, the E4M3 block scale and 8 packed bytes.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn nvfp4_pass(
        &mut self,
        tag: &str,
        xb: BufId,
        ne: i64,
        rows: i64,
        cols: i64,
        per_tensor: bool,
        gs_b: BufId,
        dec_b: BufId,
        vals: Option<BufId>,
        scl: Option<(BufId, Option<StorageMap>)>,
        src_row: &dyn Fn(&mut Emit<'_>, Expr) -> Expr,
    ) -> Result<()> {
        let nb = cols / 16;
        // The scale param's storage map from the verified module (`None`: compact row-major
        // [E, M, K/16], addressed linearly), e.g. SPEC §1's 128x4 tiles of a padded [E, Mp, Kp].
        let sw = scl.as_ref().and_then(|x| x.1.clone());
        let sw2 = sw.clone();
        let scl = scl.map(|x| x.0);
        let x4 = self.x4;
        let xelem = self.prog.buf(xb).map(|b| b.elem).unwrap_or(Elem::F32);
        let rb = RowBlocks::new(nb, self.sched.nvfp4_blocks_per_item, x4);
        self.kernel(
            format!("{tag}_quant"),
            ne * rows * rb.items_per_row(),
            |em, it0| {
                let ItemRow {
                    it,
                    first,
                    ex,
                    r,
                    base,
                } = rb.locate(em, it0, (rows, cols), src_row);
                let si = if per_tensor { e::i(0) } else { ex.clone() };
                let gs = em.set(Ty::F32, e::load(gs_b, si.clone()));
                let dec = em.set(Ty::F32, e::load(dec_b, si));
                // A block's values, E4M3 scale byte, output scale and zero flag.
                let scaled = |b: &mut Emit<'_>, j: &Expr| {
                    let b0 = b.set(Ty::I64, e::add(base.clone(), e::mul(j.clone(), e::i(16))));
                    let xs = load_fp_block(b, xb, xelem, b0, 16, x4);
                    let mx = abs_max(b, &xs, x4);
                    let mx = b.set(Ty::F32, mx);
                    // s = e4m3(clamp(gs * (vmax * f32(1/6)), 0, 448)); oscale = s == 0 ? 0 : 1 / (s * (1/gs)).
                    // (e4m3_rne saturates at ±448 itself.)
                    let s = fmul(gs.clone(), fmul(mx, e::f(1.0f32 / 6.0)));
                    let sbyte = quant::e4m3_rne(b, s);
                    let sval = quant::e4m3_decode(b, sbyte.clone());
                    let zero = b.set(Ty::Bool, e::bin(BinOp::IEq, sbyte.clone(), e::i32(0)));
                    let osc = b.set(
                        Ty::F32,
                        e::sel(
                            zero.clone(),
                            e::f(0.0),
                            fdiv(e::f(1.0), fmul(sval, dec.clone())),
                        ),
                    );
                    (xs, sbyte, osc, zero)
                };
                let store_scale = |b: &mut Emit<'_>, j: &Expr, sbyte: Expr| {
                    if let Some(sbuf) = scl {
                        let idx = match &sw {
                            Some(l) => l.index(&[ex.clone(), r.clone(), j.clone()]),
                            None => e::add(e::mul(it.clone(), e::i(nb)), j.clone()),
                        };
                        let idx = b.set(Ty::I64, idx);
                        b.out.push(Stmt::Store {
                            buf: sbuf,
                            index: idx,
                            value: sbyte,
                        });
                    }
                };
                let Some(vb) = vals else {
                    rb.blocks(em, first, |b, j| {
                        let (_, sbyte, _, _) = scaled(b, &j);
                        store_scale(b, &j, sbyte);
                    });
                    return Ok(());
                };
                if x4 {
                    rb.blocks(em, first, |b, j| {
                        let (xs, sbyte, osc, zero) = scaled(b, &j);
                        store_scale(b, &j, sbyte);
                        let at = (it.clone(), j, cols);
                        store_fp4_block(b, vb, at, &xs, (&osc, &zero), true, false);
                    });
                    return Ok(());
                }
                // A block with a normal E4M3 scale (byte >= 8) and a finite output scale has
                // |x * oscale| <= 6.4: sval >= t (1 - 2^-4) for t = gs * vmax / 6, and the f32
                // roundings add parts in 2^22; its conversion needs no saturation step (`small`,
                // which the interpreter checks). The rare others (zero and subnormal scales, and an
                // infinite or NaN output scale from an expert whose amax is near f32's underflow)
                // are done again after the item's blocks, in a loop over them with the saturating
                // form, where any occurred.
                let normal_of = |sbyte: Expr, osc: Expr| {
                    e::bin(
                        BinOp::And,
                        e::un(UnOp::BoolToI, e::bin(BinOp::ILt, e::i32(7), sbyte)),
                        e::un(UnOp::BoolToI, e::bin(BinOp::FLt, osc, e::f(f32::INFINITY))),
                    )
                };
                // The item's blocks share a row, `ipr` columns apart: where the swizzle moves a
                // block by a constant for that, their scale offsets are the first's plus multiples.
                let shift = sw.as_ref().and_then(|l| l.shift(2, rb.items_per_row()));
                let first_idx = match (&sw, shift, scl) {
                    (Some(l), Some(_), Some(_)) => {
                        Some(em.set(Ty::I64, l.index(&[ex.clone(), r.clone(), first.clone()])))
                    }
                    _ => None,
                };
                let slow = em.var(Ty::I32, e::i32(0));
                rb.blocks_k(em, first.clone(), |b, j, k| {
                    let (xs, sbyte, osc, zero) = scaled(b, &j);
                    match (&first_idx, shift, scl) {
                        (Some(i0), Some(d), Some(sbuf)) => b.out.push(Stmt::Store {
                            buf: sbuf,
                            index: e::add(i0.clone(), e::i(k * d)),
                            value: sbyte.clone(),
                        }),
                        _ => store_scale(b, &j, sbyte.clone()),
                    }
                    let at = (it.clone(), j, cols);
                    let normal = b.set(Ty::I32, normal_of(sbyte, osc.clone()));
                    let fast =
                        b.block(|b2| store_fp4_block(b2, vb, at, &xs, (&osc, &zero), false, true));
                    b.out.push(Stmt::If {
                        cond: e::bin(BinOp::IEq, normal.clone(), e::i32(1)),
                        then: fast,
                    });
                    let not = e::bin(BinOp::Xor, normal, e::i32(1));
                    b.out
                        .push(Stmt::Set(slow, e::bin(BinOp::Or, e::v(slow), not)));
                });
                let again = em.block(|b| {
                    b.for_(e::i(0), e::i(rb.bpi), |b2, k| {
                        let j = b2.set(Ty::I64, rb.block_of(&first, k));
                        let (xs, sbyte, osc, zero) = scaled(b2, &j);
                        let then = b2.block(|b3| {
                            let at = (it.clone(), j, cols);
                            store_fp4_block(b3, vb, at, &xs, (&osc, &zero), false, false)
                        });
                        b2.out.push(Stmt::If {
                            cond: e::bin(BinOp::IEq, normal_of(sbyte, osc), e::i32(0)),
                            then,
                        });
                    });
                });
                em.out.push(Stmt::If {
                    cond: e::bin(BinOp::IEq, e::v(slow), e::i32(1)),
                    then: again,
                });
                Ok(())
            },
        )?;
        // Zero fill of the padding (rows M..Mp, columns K/16..Kp of each expert), through the map.
        if let (Some(sbuf), Some(l)) = (scl, sw2) {
            let [_, mp, kp] = l.shape()[..] else {
                return Err(Error::Internal("NVFP4 scales of rank other than 3"));
            };
            if mp != rows || kp != nb {
                self.kernel(format!("{tag}_pad"), ne * mp, |em, it| {
                    let ex = em.set(Ty::I64, e::div(it.clone(), mp));
                    let r = em.set(Ty::I64, e::rem(it, mp));
                    em.for_(e::i(0), e::i(kp), |b, c| {
                        let pad = e::bin(
                            BinOp::Or,
                            e::un(UnOp::BoolToI, e::bin(BinOp::ILt, e::i(rows - 1), r.clone())),
                            e::un(UnOp::BoolToI, e::bin(BinOp::ILt, e::i(nb - 1), c.clone())),
                        );
                        let idx = l.index(&[ex.clone(), r.clone(), c]);
                        let then = vec![Stmt::Store {
                            buf: sbuf,
                            index: idx,
                            value: e::i32(0),
                        }];
                        b.out.push(Stmt::If {
                            cond: e::bin(BinOp::IEq, pad, e::i32(1)),
                            then,
                        });
                    });
                    Ok(())
                })?;
            }
        }
        Ok(())
    }
}
