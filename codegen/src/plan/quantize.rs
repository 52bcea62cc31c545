//! One quantization: its input (read in place, or materialized), row order and outputs gathered
//! into a [`QuantCtx`], then the scheme's passes.

use moeforge_dsl::ir::{Fp8Granularity, Op, QuantScheme, ValueId};

use super::*;
use crate::kir::{BufId, Expr, Ty};
use crate::quant::Emit;
use crate::{Error, Result};

impl Planner<'_> {
    /// One quantization: amax, collective hook, scales, quantize pass.
    pub(super) fn quantize(&mut self, q: ValueId, u: &QuantUse) -> Result<()> {
        let m = self.info.module();
        let Op::Quant { scheme, input } = self.op(q)? else {
            return Err(Error::Internal("quantization node expected"));
        };
        let any_param = u
            .values
            .as_ref()
            .map(|x| x.0)
            .or(u.scales.as_ref().map(|x| x.0))
            .or(u.global)
            .or(u.decode)
            .ok_or(Error::Internal("unused quantization"))?;
        let pname = self.tensor(any_param)?.name.clone();
        let (xv, rows_in) = self.strip_gather(&pname, input)?;
        // An input (optionally row-gathered) is read in place; any other tensor expression is
        // first materialized row-major by the generic element kernel.
        let direct = match self.op(xv)? {
            Op::Tensor(xt) => self
                .inputs
                .get(&xt)
                .map(|b| (*b, self.tensor(xt).map(|t| t.name.clone()))),
            _ => None,
        };
        let (xb, xname) = match direct {
            Some((b, n)) => (b, n?),
            None => (self.materialize(&pname, xv)?, format!("q{}", q.0)),
        };
        let shape = self.shape(xv)?;
        let [ne, rows, cols] = shape[..] else {
            return Err(unsupported(
                &pname,
                "quantizing a tensor that is not [E, M, K]",
            ));
        };
        // The row order: a gather before or after the quantization (not both, not different ones).
        let rows_out_v = u.values.as_ref().and_then(|x| x.1.clone());
        let rows_out_s = u.scales.as_ref().and_then(|x| x.1.clone());
        if u.values.is_some() && u.scales.is_some() && rows_out_v != rows_out_s {
            return Err(unsupported(
                &pname,
                "values and scales gathered by different row orders",
            ));
        }
        let rows_out = rows_out_v.or(rows_out_s);
        if rows_in.is_some() && rows_out.is_some() {
            return Err(unsupported(
                &pname,
                "a row gather both before and after the quantization",
            ));
        }
        let rowmap = rows_in.or(rows_out);
        let atoms = self.info.binding().ok_or(Error::Unbound)?.atoms().to_vec();
        let src_row = move |em: &mut Emit<'_>, r: Expr| -> Expr {
            match &rowmap {
                Some(iv) => {
                    let x = index_vec_expr(iv, r, &atoms);
                    em.set(Ty::I64, x)
                }
                None => r,
            }
        };
        let vals = u
            .values
            .as_ref()
            .and_then(|x| self.params.get(&x.0).copied());
        let scl = u.scales.as_ref().and_then(|x| {
            let map = self.scale_maps.get(&x.0).cloned();
            self.params.get(&x.0).copied().map(|b| (b, map))
        });
        let glob = u.global.and_then(|x| self.params.get(&x).copied());
        let dec = u.decode.and_then(|x| self.params.get(&x).copied());
        let tag = format!("{}_{}", m.name, xname);

        let ctx = QuantCtx {
            q,
            scheme,
            tag,
            xb,
            ne,
            rows,
            cols,
            vals,
            scl,
            glob,
            dec,
            src_row: &src_row,
        };
        match scheme {
            QuantScheme::Nvfp4 { .. }
            | QuantScheme::Fp8 {
                granularity: Fp8Granularity::Tensor,
                ..
            } => self.quant_tensor_scaled(&ctx),
            QuantScheme::Fp8 {
                granularity: Fp8Granularity::Channel,
                ..
            }
            | QuantScheme::Int8Row => self.quant_rows(&ctx),
            QuantScheme::Fp8 {
                granularity: Fp8Granularity::Block128,
                ..
            } => self.quant_fp8_block(&ctx),
            QuantScheme::Mxfp4 => self.quant_mxfp4(&ctx),
        }
    }
}

/// What every pass of one quantization needs: its node and scheme, the input buffer and shape, the
/// params it writes, and the source row of an output row (the row gather).
#[derive(Clone)]
pub(super) struct QuantCtx<'r> {
    pub(super) q: ValueId,
    pub(super) scheme: QuantScheme,
    pub(super) tag: String,
    pub(super) xb: BufId,
    pub(super) ne: i64,
    pub(super) rows: i64,
    pub(super) cols: i64,
    pub(super) vals: Option<BufId>,
    pub(super) scl: Option<(BufId, Option<StorageMap>)>,
    pub(super) glob: Option<BufId>,
    pub(super) dec: Option<BufId>,
    pub(super) src_row: &'r dyn Fn(&mut Emit<'_>, Expr) -> Expr,
}
