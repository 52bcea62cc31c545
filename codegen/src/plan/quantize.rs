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
            .or(u.zeros.as_ref().map(|x| x.0))
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
        let (xb, xname, shard) = match direct {
            Some((b, n)) => {
                let n = n?;
                let shard = self.sharding.of(&n);
                (b, n, shard)
            }
            None => {
                // An expression is materialized whole on this rank: refused where it reads a cut
                // input (its amax would be rank-local, or its blocks cut).
                if let Some((name, _)) = self.cut_inputs_read(xv)?.into_iter().next() {
                    return Err(Error::Sharding {
                        input: name,
                        why: format!(
                            "param `{pname}` quantizes an expression of it, and the planner makes only a quantization of the input itself (optionally row-gathered) independent of how it is sharded"
                        ),
                    });
                }
                let b = self.materialize(&pname, xv)?;
                (b, format!("q{}", q.0), Shard::default())
            }
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
        let rows_out_z = u.zeros.as_ref().and_then(|x| x.1.clone());
        if u.zeros.is_some()
            && (u.values.is_some() && rows_out_v != rows_out_z
                || u.scales.is_some() && rows_out_s != rows_out_z)
        {
            return Err(unsupported(
                &pname,
                "zero points gathered by another row order than the codes or scales",
            ));
        }
        let rows_out = rows_out_v.or(rows_out_s).or(rows_out_z);
        if rows_in.is_some() && rows_out.is_some() {
            return Err(unsupported(
                &pname,
                "a row gather both before and after the quantization",
            ));
        }
        let gathered_in = rows_in.is_some();
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
        let zer = u
            .zeros
            .as_ref()
            .and_then(|x| self.params.get(&x.0).copied());
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
            zer,
            glob,
            dec,
            src_row: &src_row,
            input: xname.clone(),
            shard,
            gathered_in,
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
            QuantScheme::Int4 { .. } => self.quant_int4(&ctx),
            QuantScheme::Int8Group { .. }
            | QuantScheme::Fp8 {
                granularity: Fp8Granularity::Group { .. },
                ..
            } => self.quant_groups(&ctx),
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
    /// Group-wise INT4's zero points (u4, two per byte).
    pub(super) zer: Option<BufId>,
    pub(super) glob: Option<BufId>,
    pub(super) dec: Option<BufId>,
    pub(super) src_row: &'r dyn Fn(&mut Emit<'_>, Expr) -> Expr,
    /// The quantized input's name (a temporary's, when an expression is materialized).
    pub(super) input: String,
    /// How this rank's slice of the input is cut ([`Sharding::of`]).
    pub(super) shard: Shard,
    /// Whether rows are gathered before the quantization (`quant ...(x[:, rows, :])`).
    pub(super) gathered_in: bool,
}

impl QuantCtx<'_> {
    /// A work item `it0` of `per_row` items per row (`E * rows * per_row` in all): its row (over
    /// every expert), its index within the row, and the input offset of its source row's first
    /// element (through the row gather).
    pub(super) fn row_item(
        &self,
        em: &mut Emit<'_>,
        it0: Expr,
        per_row: i64,
    ) -> (Expr, Expr, Expr) {
        use crate::kir::e;
        let (rows, cols) = (self.rows, self.cols);
        let row = em.set(Ty::I64, e::div(it0.clone(), per_row));
        let within = em.set(Ty::I64, e::rem(it0, per_row));
        let ex = em.set(Ty::I64, e::div(row.clone(), rows));
        let r = em.set(Ty::I64, e::rem(row.clone(), rows));
        let sr = (self.src_row)(em, r);
        let base = em.set(
            Ty::I64,
            e::add(e::mul(ex, e::i(rows * cols)), e::mul(sr, e::i(cols))),
        );
        (row, within, base)
    }

    /// Refuse a cut through this quantization's blocks of `block` (rows, columns) elements: every
    /// block must lie within one rank's run, or its scale would differ from the unsharded one.
    pub(super) fn check_cut(&self, block: (i64, i64)) -> Result<()> {
        let Some(s) = self.shard.moe_tp else {
            return Ok(());
        };
        let why = |why: String| Error::Sharding {
            input: self.input.clone(),
            why,
        };
        let (extent, blk) = match s.dim {
            1 => (self.rows, block.0),
            2 => (self.cols, block.1),
            d => {
                return Err(why(format!(
                    "a cut over `moe_tp` along dimension {d}; only the rows (1) and columns (2) of an [E, M, K] expert tensor are split over it (experts are divided over `ep`)"
                )))
            }
        };
        if s.runs < 1 || extent % s.runs != 0 {
            return Err(why(format!(
                "this rank's extent {extent} along dimension {} is not {} equal runs",
                s.dim, s.runs
            )));
        }
        let run = extent / s.runs;
        if run % blk != 0 {
            return Err(Error::CutBlock {
                input: self.input.clone(),
                dim: s.dim,
                run,
                block: blk,
            });
        }
        if blk > 1 && s.dim == 1 && self.gathered_in {
            return Err(why(
                "its rows are gathered before a block quantization, so a block's rows would not be the unsharded block's".into(),
            ));
        }
        Ok(())
    }

    /// Whether a row's amax runs over a cut: the columns are split over `moe_tp`.
    pub(super) fn row_cut(&self) -> bool {
        self.shard.moe_tp.is_some_and(|s| s.dim == 2)
    }
}

impl Planner<'_> {
    /// The cut inputs a value reads (transitively through lets and params), with their cuts.
    pub(super) fn cut_inputs_read(&self, v: ValueId) -> Result<Vec<(String, Shard)>> {
        let m = self.info.module();
        let mut ts = m.tensors_read(v);
        for t in ts.clone() {
            for x in m.tensors_read_all(t) {
                if !ts.contains(&x) {
                    ts.push(x);
                }
            }
        }
        let mut out = Vec::new();
        for t in ts {
            let tt = self.tensor(t)?;
            if matches!(tt.kind, TensorKind::Input { .. }) {
                let s = self.sharding.of(&tt.name);
                if !s.is_whole() {
                    out.push((tt.name.clone(), s));
                }
            }
        }
        Ok(out)
    }
}
