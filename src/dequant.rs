//! Dequantization of packed params back to the input's row order, read off the recipe itself: which
//! param holds the codes, which the scales (linear or 128x4-swizzled), which the global scale, and the
//! row gather between them. Used to report the dequantization error of a pack.

use std::collections::HashMap;

use crate::codegen::reference as r;
use crate::dsl::ir::{Fp8Granularity, IndexVec, Op, QuantField, QuantScheme, TensorKind, ValueId};
use crate::dsl::ModuleInfo;

/// Dequantization error of one input tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DequantError {
    /// Largest |x - x'|.
    pub max_abs: f32,
    /// Largest |x - x'| relative to the tensor's amax.
    pub max_rel_to_amax: f32,
}

struct Parts {
    scheme: Option<QuantScheme>,
    values: Option<String>,
    scales: Option<(String, bool)>,
    decode: Option<String>,
    rows: Option<IndexVec>,
}

fn strip(info: &ModuleInfo, mut v: ValueId) -> (ValueId, bool, Option<IndexVec>) {
    let m = info.module();
    let mut sw = false;
    let mut rows = None;
    loop {
        match m.value(v).map(|x| &x.op) {
            Some(Op::Swizzle128x4 { base }) => {
                sw = true;
                v = *base;
            }
            Some(Op::Gather { base, index, .. }) => {
                rows = Some(index.clone());
                v = *base;
            }
            _ => return (v, sw, rows),
        }
    }
}

fn parts(info: &ModuleInfo, input: &str) -> Parts {
    let m = info.module();
    let mut p = Parts {
        scheme: None,
        values: None,
        scales: None,
        decode: None,
        rows: None,
    };
    for t in &m.tensors {
        if t.kind != TensorKind::Param {
            continue;
        }
        let Some(v) = t.value else { continue };
        let (v, sw, rows) = strip(info, v);
        match m.value(v).map(|x| x.op.clone()) {
            Some(Op::Field { quant, field }) => {
                let Some(Op::Quant { scheme, input: qi }) = m.value(quant).map(|x| x.op.clone())
                else {
                    continue;
                };
                let (qi, _, rows_in) = strip(info, qi);
                let Some(Op::Tensor(x)) = m.value(qi).map(|x| x.op.clone()) else {
                    continue;
                };
                if m.tensor(x).map(|x| x.name.as_str()) != Some(input) {
                    continue;
                }
                p.scheme = Some(scheme);
                if rows.is_some() || rows_in.is_some() {
                    p.rows = rows.or(rows_in);
                }
                match field {
                    QuantField::Values => p.values = Some(t.name.clone()),
                    QuantField::Scales => p.scales = Some((t.name.clone(), sw)),
                    QuantField::DecodeScale => p.decode = Some(t.name.clone()),
                    QuantField::GlobalScale => {}
                }
            }
            Some(Op::Tensor(x)) if m.tensor(x).map(|x| x.name.as_str()) == Some(input) => {
                p.values = Some(t.name.clone());
                p.rows = rows;
            }
            _ => {}
        }
    }
    p
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
    let p = parts(info, name);
    let (ne, m, k) = shape;
    let vals = params.get(p.values.as_ref()?)?;
    let atoms = info.binding()?.atoms().to_vec();
    let src_row = |r: usize| -> usize {
        match &p.rows {
            Some(iv) => iv.map(r as i128, &atoms).map(|x| x as usize).unwrap_or(r),
            None => r,
        }
    };
    let scales = p
        .scales
        .as_ref()
        .and_then(|(n, sw)| params.get(n).map(|b| (b, *sw)));
    let dec_v: Vec<f32> = p
        .decode
        .as_ref()
        .and_then(|n| params.get(n))
        .map(|b| f32s(b))
        .unwrap_or_default();
    let sf_v: Vec<f32> = scales.map(|(b, _)| f32s(b)).unwrap_or_default();
    let amax = x.iter().fold(0f32, |a, b| a.max(b.abs()));
    let mut worst = 0f32;
    for e in 0..ne {
        for r in 0..m {
            let sr = src_row(r);
            for c in 0..k {
                let xv = x[(e * m + sr) * k + c];
                let o = (e * m + r) * k + c;
                let deq = match p.scheme {
                    None => f32::from_bits(
                        (u16::from_le_bytes([vals[2 * o], vals[2 * o + 1]]) as u32) << 16,
                    ),
                    Some(QuantScheme::Nvfp4 { .. }) => {
                        let (sb, sw) = scales?;
                        let kb = k / 16;
                        let so = if sw {
                            let (mp, kp) = (
                                crate::dsl::spec::ru(m as i64, 128) as usize,
                                crate::dsl::spec::ru(kb as i64, 4) as usize,
                            );
                            e * mp * kp
                                + crate::dsl::spec::swizzle_128x4_offset(
                                    0,
                                    r as i64,
                                    (c / 16) as i64,
                                    m as i64,
                                    kb as i64,
                                ) as usize
                        } else {
                            (e * m + r) * kb + c / 16
                        };
                        let dec = *dec_v.get(e)?;
                        let code = (vals[o / 2] >> (4 * (o % 2))) & 0xF;
                        r::e2m1_to_f32(code) * r::e4m3_to_f32(sb[so]) * dec
                    }
                    Some(QuantScheme::Mxfp4) => {
                        let (sb, _) = scales?;
                        let code = (vals[o / 2] >> (4 * (o % 2))) & 0xF;
                        r::e2m1_to_f32(code) * 2f32.powi(sb[o / 32] as i32 - 127)
                    }
                    Some(QuantScheme::Fp8 { granularity, .. }) => {
                        let s = &sf_v;
                        let sc = match granularity {
                            Fp8Granularity::Tensor => s[e],
                            Fp8Granularity::Channel => s[e * m + r],
                            Fp8Granularity::Block128 => {
                                let (bm, bk) = (m.div_ceil(128), k.div_ceil(128));
                                s[e * bm * bk + (r / 128) * bk + c / 128]
                            }
                        };
                        r::e4m3_to_f32(vals[o]) * sc
                    }
                    Some(QuantScheme::Int8Row) => (vals[o] as i8) as f32 * sf_v[e * m + r],
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
