//! Dequantization of packed params back to the input's row order, read off the verified module: the
//! params holding the codes, the scales and the decode scale (`ModuleInfo::quantization_of`, the
//! query the planner uses too), the row gather between them, and each param's storage map (every
//! element read through its layout). Used to report the dequantization error of a pack, and to
//! compare packs in the input's coordinates ([`logical`]: the shards of a `--moe-tp`/`--ep` pack
//! against the unsplit one).

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

/// The params packed from one input, read back in the input's coordinates: for every element
/// `(e, row, col)` of the input `[E, M, K]` (rows in the input's order, before any row gather), the
/// code stored for it and the bits of the scale applied to it, and per expert the decode scale.
/// Two packs of one input are the same quantization exactly when their `Logical`s are equal,
/// whatever row order, swizzle or storage layout each recipe chose.
#[derive(Debug, Clone, PartialEq)]
pub struct Logical {
    /// The scheme; `None` for a copy.
    pub scheme: Option<QuantScheme>,
    /// The input's shape `(E, M, K)`.
    pub shape: (usize, usize, usize),
    /// Per element, row-major over `shape`: the code (an E2M1 nibble, an E4M3 or INT8 byte) or,
    /// for a copy, the element's bits.
    pub codes: Vec<u32>,
    /// Per element: the bits of its scale (an E4M3 or E8M0 byte, or an f32's bits); 0 where the
    /// scheme has no scale.
    pub scales: Vec<u32>,
    /// Per expert (one value for a per-tensor amax): the bits of the f32 decode scale (NVFP4);
    /// empty where there is none.
    pub decode: Vec<u32>,
}

/// Bytes per element of a param's dtype (0 for E2M1, two per byte).
fn elem_bytes(info: &ModuleInfo, id: TensorId) -> Option<usize> {
    use crate::dsl::ir::DType as D;
    Some(match info.module().tensor(id)?.dtype {
        D::E2m1 => 0,
        D::E4m3 | D::E5m2 | D::E8m0 | D::I8 | D::U8 => 1,
        D::Bf16 | D::F16 => 2,
        D::F32 | D::I32 => 4,
    })
}

/// Element `o` of a param's bytes, `size` bytes per element (0: a nibble), little-endian.
fn elem_bits(b: &[u8], o: usize, size: usize) -> Option<u32> {
    if size == 0 {
        return Some(((*b.get(o / 2)? >> (4 * (o % 2))) & 0xF) as u32);
    }
    let c = b.get(size * o..size * o + size)?;
    Some(c.iter().rev().fold(0u32, |a, &x| (a << 8) | x as u32))
}

/// Read the params packed from input `name` back in the input's coordinates ([`Logical`]); `params`
/// maps param names to their bytes. `None` when the recipe's form is not one this reads or a param
/// is missing.
pub fn logical(
    info: &ModuleInfo,
    name: &str,
    params: &HashMap<String, Vec<u8>>,
) -> Option<Logical> {
    let m = info.module();
    let input = m
        .tensors
        .iter()
        .find(|t| t.name == name && matches!(t.kind, crate::dsl::ir::TensorKind::Input { .. }))?;
    let dims: Vec<usize> = input
        .shape
        .iter()
        .map(|p| info.eval(p).and_then(|x| usize::try_from(x).ok()))
        .collect::<Option<_>>()?;
    let [ne, mr, k] = dims[..] else {
        return None;
    };
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
    let vsize = elem_bytes(info, values)?;
    let atoms = info.binding()?.atoms().to_vec();
    let src_row = |r: usize| -> Option<usize> {
        match &rows {
            Some(iv) => iv
                .map(r as i128, &atoms)
                .and_then(|x| usize::try_from(x).ok()),
            None => Some(r),
        }
    };
    let scales = match scales {
        Some(id) => {
            let (n, map) = param(info, id)?;
            Some((params.get(&n)?, map, elem_bytes(info, id)?))
        }
        None => None,
    };
    let decode: Vec<u32> = match decode {
        Some(id) => f32s(params.get(&param(info, id)?.0)?)
            .into_iter()
            .map(f32::to_bits)
            .collect(),
        None => Vec::new(),
    };
    // A scale at its logical coordinate, read through its storage map.
    let scale_at = |coord: &[i64]| -> Option<u32> {
        let (b, map, size) = scales.as_ref()?;
        elem_bits(b, usize::try_from(map.offset_of(coord)).ok()?, *size)
    };
    let n = ne * mr * k;
    let mut codes = vec![0u32; n];
    let mut scl = vec![0u32; n];
    for e in 0..ne {
        for r in 0..mr {
            let sr = src_row(r).filter(|&x| x < mr)?;
            for c in 0..k {
                let (ei, ri, ci) = (e as i64, r as i64, c as i64);
                let o = usize::try_from(vmap.offset_of(&[ei, ri, ci])).ok()?;
                let at = (e * mr + sr) * k + c;
                codes[at] = elem_bits(vals, o, vsize)?;
                scl[at] = match scheme {
                    None => 0,
                    Some(QuantScheme::Nvfp4 { .. }) => scale_at(&[ei, ri, ci / 16])?,
                    Some(QuantScheme::Mxfp4) => scale_at(&[ei, ri, ci / 32])?,
                    Some(QuantScheme::Fp8 { granularity, .. }) => match granularity {
                        Fp8Granularity::Tensor => scale_at(&[ei])?,
                        Fp8Granularity::Channel => scale_at(&[ei, ri])?,
                        Fp8Granularity::Block128 => scale_at(&[ei, ri / 128, ci / 128])?,
                    },
                    Some(QuantScheme::Int8Row) => scale_at(&[ei, ri])?,
                };
            }
        }
    }
    Some(Logical {
        scheme,
        shape: (ne, mr, k),
        codes,
        scales: scl,
        decode,
    })
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
    let l = logical(info, name, params)?;
    if l.shape != shape || x.len() != l.codes.len() {
        return None;
    }
    let (_, m, k) = shape;
    let amax = x.iter().fold(0f32, |a, b| a.max(b.abs()));
    let mut worst = 0f32;
    for (at, &xv) in x.iter().enumerate() {
        let (code, sb) = (l.codes[at], l.scales[at]);
        let e = at / (m * k);
        let deq = match l.scheme {
            None => f32::from_bits(code << 16),
            Some(QuantScheme::Nvfp4 { .. }) => {
                let dec = f32::from_bits(*l.decode.get(e).or(l.decode.first())?);
                r::e2m1_to_f32(code as u8) * r::e4m3_to_f32(sb as u8) * dec
            }
            Some(QuantScheme::Mxfp4) => r::e2m1_to_f32(code as u8) * 2f32.powi(sb as i32 - 127),
            Some(QuantScheme::Fp8 { .. }) => r::e4m3_to_f32(code as u8) * f32::from_bits(sb),
            Some(QuantScheme::Int8Row) => (code as u8 as i8) as f32 * f32::from_bits(sb),
        };
        worst = worst.max((xv - deq).abs());
    }
    Some(DequantError {
        max_abs: worst,
        max_rel_to_amax: if amax > 0.0 { worst / amax } else { 0.0 },
    })
}
