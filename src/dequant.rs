//! Dequantization of packed params back to the input's row order, read off the verified module: the
//! params holding the codes, the scales and the decode scale (`ModuleInfo::quantization_of`, the
//! query the planner uses too), the row gather between them, and each param's storage map (every
//! element read through its layout). Used to report the dequantization error of a pack.

use std::collections::HashMap;

use crate::codegen::addr::StorageMap;
use crate::codegen::reference as r;
use crate::dsl::ir::{Fp8Granularity, IndexVec, QuantScheme, TensorId};
use crate::dsl::ModuleInfo;

/// A param's name and storage map.
fn param(info: &ModuleInfo, id: TensorId) -> Option<(String, StorageMap)> {
    let p = info.params.iter().find(|p| p.id == id)?;
    let map = StorageMap::of(&p.layout, info.binding()?).ok()?;
    Some((info.module().tensor(id)?.name.clone(), map))
}

/// Dequantization error of one input tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DequantError {
    /// Largest |x - x'|.
    pub max_abs: f32,
    /// Largest |x - x'| relative to the tensor's amax.
    pub max_rel_to_amax: f32,
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Dequantize the params packed from input `name` (`[E, M, K]`, given as f32 values) and compare.
/// `params` maps param names to their bytes. `None` when the recipe's form is not one this reads.
pub fn error(
    info: &ModuleInfo,
    name: &str,
    x: &[f32],
    shape: (usize, usize, usize),
    params: &HashMap<String, Vec<u8>>,
) -> Option<DequantError> {
    let (ne, m, k) = shape;
    let (scheme, values, scales, decode, rows): (
        Option<QuantScheme>,
        TensorId,
        Option<TensorId>,
        Option<TensorId>,
        Option<IndexVec>,
    ) = match info.quantization_of(name) {
        Some(q) => {
            let v = q.values?;
            (
                Some(q.scheme),
                v.param,
                q.scales.map(|o| o.param),
                q.decode_scale.map(|o| o.param),
                v.rows.or(q.rows_in),
            )
        }
        None => {
            let c = info.copy_of(name)?;
            (None, c.param, None, None, c.rows)
        }
    };
    let (vname, vmap) = param(info, values)?;
    let vals = params.get(&vname)?;
    let atoms = info.binding()?.atoms().to_vec();
    let src_row = |r: usize| -> usize {
        match &rows {
            Some(iv) => iv.map(r as i128, &atoms).map(|x| x as usize).unwrap_or(r),
            None => r,
        }
    };
    let scales = match scales {
        Some(id) => {
            let (n, map) = param(info, id)?;
            Some((params.get(&n)?, map))
        }
        None => None,
    };
    let dec_v: Vec<f32> = match decode {
        Some(id) => f32s(params.get(&param(info, id)?.0)?),
        None => Vec::new(),
    };
    // A scale at its logical coordinate, read through its storage map.
    let scale_at = |coord: &[i64]| -> Option<(u8, f32)> {
        let (b, map) = scales.as_ref()?;
        let o = usize::try_from(map.offset_of(coord)).ok()?;
        let f = b
            .get(4 * o..4 * o + 4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .unwrap_or(0.0);
        Some((*b.get(o)?, f))
    };
    let amax = x.iter().fold(0f32, |a, b| a.max(b.abs()));
    let mut worst = 0f32;
    for e in 0..ne {
        for r in 0..m {
            let sr = src_row(r);
            for c in 0..k {
                let xv = x[(e * m + sr) * k + c];
                let (ei, ri, ci) = (e as i64, r as i64, c as i64);
                let o = usize::try_from(vmap.offset_of(&[ei, ri, ci])).ok()?;
                let nib = |o: usize| (vals[o / 2] >> (4 * (o % 2))) & 0xF;
                let deq = match scheme {
                    None => f32::from_bits(
                        (u16::from_le_bytes([vals[2 * o], vals[2 * o + 1]]) as u32) << 16,
                    ),
                    Some(QuantScheme::Nvfp4 { .. }) => {
                        let (sb, _) = scale_at(&[ei, ri, ci / 16])?;
                        let dec = *dec_v.get(e)?;
                        r::e2m1_to_f32(nib(o)) * r::e4m3_to_f32(sb) * dec
                    }
                    Some(QuantScheme::Mxfp4) => {
                        let (sb, _) = scale_at(&[ei, ri, ci / 32])?;
                        r::e2m1_to_f32(nib(o)) * 2f32.powi(sb as i32 - 127)
                    }
                    Some(QuantScheme::Fp8 { granularity, .. }) => {
                        let (_, sc) = match granularity {
                            Fp8Granularity::Tensor => scale_at(&[ei])?,
                            Fp8Granularity::Channel => scale_at(&[ei, ri])?,
                            Fp8Granularity::Block128 => scale_at(&[ei, ri / 128, ci / 128])?,
                        };
                        r::e4m3_to_f32(vals[o]) * sc
                    }
                    Some(QuantScheme::Int8Row) => (vals[o] as i8) as f32 * scale_at(&[ei, ri])?.1,
                };
                worst = worst.max((xv - deq).abs());
            }
        }
    }
    Some(DequantError {
        max_abs: worst,
        max_rel_to_amax: if amax > 0.0 { worst / amax } else { 0.0 },
    })
}
