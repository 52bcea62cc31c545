//! MXFP4: E8M0 scales from each 32-value block's exponent, packed E2M1 codes.

use super::*;
use crate::kir::{e, BinOp, Elem, Expr, Stmt, Ty, UnOp};
use crate::quant::{is_zero, Emit};
use crate::Result;

impl Planner<'_> {
    /// MXFP4: an E8M0 scale per 32 values from the block's exponent, packed E2M1 codes.
    pub(super) fn quant_mxfp4(&mut self, ctx: &QuantCtx<'_>) -> Result<()> {
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
        ctx.check_cut((1, 32))?;
        self.quants.insert(
            q,
            QuantTemps {
                gs: None,
                decode: None,
                fp8_scale: None,
            },
        );
        let nb = cols / 32;
        let sb = scl.as_ref().map(|x| x.0);
        let x4 = self.x4;
        let xelem = self.prog.buf(xb).map(|b| b.elem).unwrap_or(Elem::F32);
        let rb = RowBlocks::new(nb, self.sched.mxfp4_blocks_per_item, x4);
        self.kernel(
            format!("{tag}_quant"),
            ne * rows * rb.items_per_row(),
            |em, it0| {
                let ItemRow {
                    it, first, base, ..
                } = rb.locate(em, it0, (rows, cols), &src_row);
                let block = |b: &mut Emit<'_>, j: Expr| {
                    let b0 = b.set(Ty::I64, e::add(base.clone(), e::mul(j.clone(), e::i(32))));
                    let xs = load_fp_block(b, xb, xelem, b0.clone(), 32, x4);
                    let m = abs_max(b, &xs, x4);
                    let mx = b.var(Ty::F32, m);
                    // e = clamp(floor(log2 amax) - 2, -127, 127): from the exponent field.
                    let ebits = b.set(
                        Ty::I32,
                        e::bin(
                            BinOp::And,
                            e::bin(BinOp::Shr, e::un(UnOp::BitsOf, e::v(mx)), e::i32(23)),
                            e::i32(0xFF),
                        ),
                    );
                    let zero = b.set(Ty::Bool, is_zero(e::v(mx)));
                    // scale byte = e + 127 = max(ebits - 2, 0); multiplier 2^-e has exponent field min(256 - ebits, 254).
                    let sbyte = e::sel(
                        zero.clone(),
                        e::i32(0),
                        imax(e::bin(BinOp::ISub, ebits.clone(), e::i32(2)), e::i32(0)),
                    );
                    let mexp = imin(e::bin(BinOp::ISub, e::i32(256), ebits), e::i32(254));
                    let mult = b.set(
                        Ty::F32,
                        e::un(UnOp::FromBits, e::bin(BinOp::Shl, mexp, e::i32(23))),
                    );
                    if let Some(sbuf) = sb {
                        let si = e::add(e::mul(it.clone(), e::i(nb)), j.clone());
                        b.out.push(Stmt::Store {
                            buf: sbuf,
                            index: si,
                            value: sbyte,
                        });
                    }
                    if let Some(vb) = vals {
                        let at = (it.clone(), j.clone(), cols);
                        store_fp4_block(b, vb, at, &xs, (&mult, &zero), x4, false);
                    }
                };
                rb.blocks(em, first, block);
                Ok(())
            },
        )
    }
}
