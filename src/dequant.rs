//! Dequantization of packed params back to the input's row order, read off the verified module: the
//! params holding the codes, the scales and the decode scale (`ModuleInfo::quantization_of`, the
//! query the planner uses too), the row gather between them, and each param's storage map (every
//! element read through its layout). Used to report the dequantization error of a pack, and to
//! compare packs in the input's coordinates ([`logical`]: the shards of a `--moe-tp`/`--ep` pack
//! against the unsplit one).
//!
//! [`error`] is the plain form (every element through [`StorageMap::offset_of`], one thread), kept as
//! the oracle; [`error_bf16`] reads the bf16 input as it is, tabulates each storage map per
//! dimension, decodes through lookup tables and splits the rows over threads. The tests hold the two
//! equal, bit for bit.

use std::collections::HashMap;
use std::ops::Range;

use crate::codegen::addr::StorageMap;
use crate::codegen::reference as r;
use crate::dsl::ir::{DType, Fp8Granularity, IndexVec, QuantScheme, TensorId};
use crate::dsl::layout::Swizzle;
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

/// The longest dimension of a storage map that [`logical_experts`] tabulates (`StorageMap::tables`):
/// experts, rows and columns of real layers are far below it.
const TABLE_LEN: i64 = 1 << 22;

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
    /// The dtype of the param holding the codes (for a copy, the dtype of its elements' bits).
    pub dtype: DType,
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
    /// Per element: its group's u4 zero point (asymmetric group-wise INT4); empty where there is
    /// none.
    pub zeros: Vec<u32>,
}

impl Logical {
    /// The dequantized value of element `at` (row-major over [`Logical::shape`]) in f64:
    /// `code * block scale * decode scale` (`(code - zero) * scale` for group-wise INT4), the
    /// product taken in f64, where it is exact (every code and scale has few enough significant
    /// bits); a copy's element read as its dtype (bf16, f16 or f32). `None` when `at` is out of
    /// range, or for a copy of another dtype (its scale, if any, is not part of the copy).
    pub fn value(&self, at: usize) -> Option<f64> {
        let (code, sb) = (*self.codes.get(at)?, *self.scales.get(at)?);
        let (_, m, k) = self.shape;
        let e = at / (m * k).max(1);
        Some(match self.scheme {
            None => match self.dtype {
                DType::Bf16 => f32::from_bits(code << 16) as f64,
                DType::F16 => crate::pack::f16_to_f32(code as u16) as f64,
                DType::F32 => f32::from_bits(code) as f64,
                _ => return None,
            },
            Some(QuantScheme::Nvfp4 { .. }) => {
                let dec = f32::from_bits(*self.decode.get(e).or(self.decode.first())?);
                r::e2m1_to_f32(code as u8) as f64 * r::e4m3_to_f32(sb as u8) as f64 * dec as f64
            }
            Some(QuantScheme::Mxfp4) => {
                r::e2m1_to_f32(code as u8) as f64 * 2f64.powi(sb as i32 - 127)
            }
            Some(QuantScheme::Fp8 { .. }) => {
                r::e4m3_to_f32(code as u8) as f64 * f32::from_bits(sb) as f64
            }
            Some(QuantScheme::Int8Row | QuantScheme::Int8Group { .. }) => {
                (code as u8 as i8) as f64 * f32::from_bits(sb) as f64
            }
            Some(QuantScheme::Int4 {
                zero_point, scale, ..
            }) => {
                let z = if zero_point { *self.zeros.get(at)? } else { 8 };
                (code as f64 - z as f64) * scale_value(scale, sb) as f64
            }
        })
    }
}

/// Bytes per element of a param's dtype (0 for E2M1, two per byte).
fn elem_bytes(info: &ModuleInfo, id: TensorId) -> Option<usize> {
    use crate::dsl::ir::DType as D;
    Some(match info.module().tensor(id)?.dtype {
        D::E2m1 | D::U4 => 0,
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
    logical_experts(info, name, params, None)
}

/// The params of input `name` where they need no element-wise read-back: the values param stored
/// compactly (a row-major `[E, M, K]` map, rows in the input's order or gathered from it) and a
/// copy, or a quantization with one scale per expert (FP8 per tensor), per row (FP8 per channel,
/// int8 per row), per 128x128 block (FP8, rows not gathered) or per row and group along K (FP8 and
/// int8 groups, NVFP4's 16, MXFP4's 32, INT4's groups with their zero points), with NVFP4's decode
/// scale.
#[derive(Debug, Clone, PartialEq)]
pub struct Compact<'a> {
    /// The scheme; `None` for a copy.
    pub scheme: Option<QuantScheme>,
    /// The values param's dtype.
    pub dtype: DType,
    /// The input's shape `(E, M, K)`.
    pub shape: (usize, usize, usize),
    /// The values in the input's order: element `(e, row, col)` at `((e * M + row) * K + col)`
    /// elements (4-bit codes two per byte, the even element in the low nibble). The param's own
    /// bytes where its rows are in the input's order; a copy with the rows put back where they
    /// are gathered.
    pub values: std::borrow::Cow<'a, [u8]>,
    /// The scale bits per expert (FP8 per tensor), per `(expert, row)` (FP8 per channel, int8 per
    /// row), per `(expert, row block, column block)` (128x128 blocks) or per `(expert, row,
    /// group)` (groups along K), rows in the input's order, as [`Logical::scales`] holds them for
    /// each of their elements; empty for a copy.
    pub scales: Vec<u32>,
    /// Per `(expert, row, group)` the u4 zero point (asymmetric INT4); empty where there is none.
    pub zeros: Vec<u32>,
    /// The decode scale bits, as [`Logical::decode`] holds them; empty where there is none.
    pub decode: Vec<u32>,
}

/// Input `name`'s `[E, M, K]` at the binding (`None`: no such input, or another rank).
fn input_dims(info: &ModuleInfo, name: &str) -> Option<[usize; 3]> {
    crate::moe_host::input_shape(info, name).map(|(e, m, k)| [e, m, k])
}

/// The elements along K that one scale covers, for the schemes with a scale per row and group.
fn group_len(scheme: QuantScheme) -> Option<usize> {
    let g = match scheme {
        QuantScheme::Nvfp4 { .. } => 16,
        QuantScheme::Mxfp4 => 32,
        QuantScheme::Fp8 {
            granularity: Fp8Granularity::Group { group },
            ..
        }
        | QuantScheme::Int8Group { group }
        | QuantScheme::Int4 { group, .. } => group,
        _ => return None,
    };
    usize::try_from(g).ok().filter(|&g| g > 0)
}

/// The input row each of the param's `rows` rows holds (the row gather), checked to be a
/// permutation; the identity without a gather.
fn gathered_rows(info: &ModuleInfo, rows: Option<&IndexVec>, count: usize) -> Option<Vec<usize>> {
    let Some(iv) = rows else {
        return Some((0..count).collect());
    };
    let atoms = info.binding()?.atoms().to_vec();
    let src: Vec<usize> = (0..count)
        .map(|r| {
            iv.map(r as i128, &atoms)
                .and_then(|x| usize::try_from(x).ok())
                .filter(|&x| x < count)
        })
        .collect::<Option<_>>()?;
    let mut seen = vec![false; count];
    for &s in &src {
        if std::mem::replace(&mut seen[s], true) {
            return None;
        }
    }
    Some(src)
}

/// [`Compact`] of input `name`, or `None` where its params need [`logical`]'s element-wise read
/// (another layout, a row gather that is no permutation or that meets 128x128 blocks, another
/// scheme, an empty extent, a param missing or short). Where it is `Some`, its values, scales,
/// zero points and decode scales are exactly what [`logical`] reads.
pub fn compact<'a>(
    info: &ModuleInfo,
    name: &str,
    params: &'a HashMap<String, Vec<u8>>,
) -> Option<Compact<'a>> {
    let m = info.module();
    let [ne, mr, k] = input_dims(info, name)?;
    if ne == 0 || mr == 0 || k == 0 {
        return None;
    }
    let parts = Parts::of(info, name)?;
    // Per expert, the `(row, column)` of the first element each scale covers (rows the param's):
    // one per expert, row, 128x128 block or row and group along K.
    let firsts = |rows: usize, cols: usize, (dr, dc): (usize, usize)| -> Vec<(i64, i64)> {
        (0..rows)
            .flat_map(|r| (0..cols).map(move |c| ((r * dr) as i64, (c * dc) as i64)))
            .collect()
    };
    let per_expert = match parts.scheme {
        None => None,
        Some(QuantScheme::Fp8 {
            granularity: Fp8Granularity::Tensor,
            ..
        }) => Some(firsts(1, 1, (0, 0))),
        Some(
            QuantScheme::Fp8 {
                granularity: Fp8Granularity::Channel,
                ..
            }
            | QuantScheme::Int8Row,
        ) => Some(firsts(mr, 1, (1, 0))),
        Some(QuantScheme::Fp8 {
            granularity: Fp8Granularity::Block128,
            ..
        }) if parts.rows.is_none() => Some(firsts(mr.div_ceil(128), k.div_ceil(128), (128, 128))),
        Some(s) => {
            let g = group_len(s)?;
            Some(firsts(mr, k.div_ceil(g), (1, g)))
        }
    };
    let src = gathered_rows(info, parts.rows.as_ref(), mr)?;
    let (vname, vmap) = param(info, parts.values)?;
    let vsize = elem_bytes(info, parts.values)?;
    let stored = params.get(&vname)?;
    let want = [ne, mr, k].map(|x| x as i64);
    // Bytes per row (4-bit codes: whole bytes only).
    let row_bytes = match vsize {
        0 if k.is_multiple_of(2) => k / 2,
        0 => return None,
        s => k.checked_mul(s)?,
    };
    if !vmap.is_row_major()
        || vmap.shape() != want
        || stored.len() != ne.checked_mul(mr)?.checked_mul(row_bytes)?
    {
        return None;
    }
    let values = if parts.rows.is_none() {
        std::borrow::Cow::Borrowed(stored.as_slice())
    } else {
        // Param row p of each expert holds input row src[p].
        let mut v = vec![0u8; stored.len()];
        for e in 0..ne {
            for (p, &s) in src.iter().enumerate() {
                let from = (e * mr + p) * row_bytes;
                let to = (e * mr + s) * row_bytes;
                v[to..to + row_bytes].copy_from_slice(&stored[from..from + row_bytes]);
            }
        }
        std::borrow::Cow::Owned(v)
    };
    // The bits at each first element, per expert, in the input's row order: the scales through
    // `scale_map`, the zero points through their param's map at the same coordinates.
    let read = |b: &[u8],
                size: usize,
                offset: &dyn Fn((i64, i64, i64)) -> i64,
                firsts: &[(i64, i64)]|
     -> Option<Vec<u32>> {
        let mut v = vec![0u32; ne * firsts.len()];
        // The firsts are row-major over (row, column) slots: with a gather, the row slot of
        // param row p moves to input row src[p] (per-row and per-group scales only).
        let per_row = if firsts.len().is_multiple_of(mr) && parts.rows.is_some() {
            firsts.len() / mr
        } else {
            0
        };
        for e in 0..ne {
            for (i, &(r, c)) in firsts.iter().enumerate() {
                let o = usize::try_from(offset((e as i64, r, c))).ok()?;
                let slot = match per_row {
                    0 => i,
                    w => src[i / w] * w + i % w,
                };
                v[e * firsts.len() + slot] = elem_bits(b, o, size)?;
            }
        }
        Some(v)
    };
    let scheme = parts.scheme;
    let (scales, zeros) = match (per_expert, scheme) {
        (None, _) if parts.scales.is_none() && parts.zeros.is_none() => (Vec::new(), Vec::new()),
        (Some(firsts), Some(sc)) => {
            let sm = scale_map(info, name)?;
            let size = elem_bytes(info, parts.scales?)?;
            let scales = read(params.get(&sm.param)?, size, &|at| sm.offset(at), &firsts)?;
            let zeros = match parts.zeros {
                Some(id) => {
                    let (zname, zmap) = param(info, id)?;
                    let at = |x| zmap.offset_of(&scale_coord(sc, x));
                    read(params.get(&zname)?, elem_bytes(info, id)?, &at, &firsts)?
                }
                None => Vec::new(),
            };
            (scales, zeros)
        }
        _ => return None,
    };
    let decode = match parts.decode {
        Some(id) => f32s(params.get(&param(info, id)?.0)?)
            .into_iter()
            .map(f32::to_bits)
            .collect(),
        None => Vec::new(),
    };
    Some(Compact {
        scheme,
        dtype: m.tensor(parts.values)?.dtype,
        shape: (ne, mr, k),
        values,
        scales,
        zeros,
        decode,
    })
}

/// [`logical`] for the experts `experts` only (all of them for `None`): the shape's first extent
/// is then the range's length, and the decode scales are those of the range's experts (a single
/// per-tensor value is kept as it is). What the host MoE forward reads, one expert at a time.
pub fn logical_experts(
    info: &ModuleInfo,
    name: &str,
    params: &HashMap<String, Vec<u8>>,
    experts: Option<Range<usize>>,
) -> Option<Logical> {
    let [ne_all, mr, k] = input_dims(info, name)?;
    let range = experts.unwrap_or(0..ne_all);
    if range.start > range.end || range.end > ne_all {
        return None;
    }
    let ne = range.len();
    let Parts {
        scheme,
        values,
        scales,
        decode,
        zeros,
        rows,
    } = Parts::of(info, name)?;
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
        Some(id) => {
            let all: Vec<u32> = f32s(params.get(&param(info, id)?.0)?)
                .into_iter()
                .map(f32::to_bits)
                .collect();
            if all.len() == ne_all && ne_all > 1 {
                all.get(range.clone())?.to_vec()
            } else {
                all
            }
        }
        None => Vec::new(),
    };
    let zeros = match zeros {
        Some(id) => {
            let (n, map) = param(info, id)?;
            Some((params.get(&n)?, map, 0))
        }
        None => None,
    };
    // The maps' offsets tabulated per dimension (a lookup per dimension instead of a div/mod per
    // sub-mode, for every element of the param).
    let vmap = vmap.tables(TABLE_LEN);
    let scales = scales.map(|(b, m, size)| (b, m.tables(TABLE_LEN), size));
    let zeros = zeros.map(|(b, m, size)| (b, m.tables(TABLE_LEN), size));
    // A scale (or zero point) at its logical coordinate, read through its storage map.
    let scale_at = |coord: &[i64]| -> Option<u32> {
        let (b, map, size) = scales.as_ref()?;
        elem_bits(b, usize::try_from(map.offset_of(coord)).ok()?, *size)
    };
    let zero_at = |coord: &[i64]| -> Option<u32> {
        let (b, map, size) = zeros.as_ref()?;
        elem_bits(b, usize::try_from(map.offset_of(coord)).ok()?, *size)
    };
    let n = ne * mr * k;
    let mut codes = vec![0u32; n];
    let mut scl = vec![0u32; n];
    let mut zer = if zeros.is_some() {
        vec![0u32; n]
    } else {
        Vec::new()
    };
    // The input row each param row holds, checked once (also where there are no columns to read).
    let srcs: Vec<usize> = (0..mr)
        .map(|r| src_row(r).filter(|&x| x < mr))
        .collect::<Option<_>>()?;
    // One expert's rows: its chunks of `codes`, `scl` and `zer` (`zer` empty without zero points).
    let expert = |eg: usize, codes: &mut [u32], scl: &mut [u32], zer: &mut [u32]| -> Option<()> {
        for (r, &sr) in srcs.iter().enumerate() {
            let (ei, ri) = (eg as i64, r as i64);
            // The row's share of the values' offsets; the scale (and zero point) read again only
            // where the element's scale coordinate changes along the row.
            let row = vmap.partial(&[ei, ri]);
            let mut last: Option<([i64; 3], u32, u32)> = None;
            for c in 0..k {
                let ci = c as i64;
                let o = usize::try_from(vmap.last(row, ci)).ok()?;
                let at = sr * k + c;
                *codes.get_mut(at)? = elem_bits(vals, o, vsize)?;
                let Some(sc) = scheme else {
                    continue;
                };
                let coord = scale_coord(sc, (ei, ri, ci));
                let (s, z) = match last {
                    Some((key, s, z)) if key == coord.0 => (s, z),
                    _ => {
                        let z = match (zeros.is_some(), sc) {
                            (true, QuantScheme::Int4 { .. }) => zero_at(&coord)?,
                            _ => 0,
                        };
                        let s = scale_at(&coord)?;
                        last = Some((coord.0, s, z));
                        (s, z)
                    }
                };
                *scl.get_mut(at)? = s;
                if let Some(zz) = zer.get_mut(at) {
                    *zz = z;
                }
            }
        }
        Some(())
    };
    // A block of consecutive experts from `first`: each expert's chunks in turn.
    let per = (mr * k).max(1);
    let block = |first: usize, cs: &mut [u32], ss: &mut [u32], zs: &mut [u32]| -> Option<()> {
        let mut zs = zs.chunks_mut(per);
        for (x, (c, s)) in cs.chunks_mut(per).zip(ss.chunks_mut(per)).enumerate() {
            expert(first + x, c, s, zs.next().unwrap_or_default())?;
        }
        Some(())
    };
    // The experts split into contiguous blocks, one per host thread (up to one thread per core,
    // none spawned for a single expert).
    let threads = if ne <= 1 { 1 } else { workers(0).min(ne) };
    if threads <= 1 {
        block(range.start, &mut codes, &mut scl, &mut zer)?;
    } else {
        let span = per * ne.div_ceil(threads);
        let ok = std::thread::scope(|sc| {
            let mut zc = zer.chunks_mut(span);
            let jobs: Vec<_> = codes
                .chunks_mut(span)
                .zip(scl.chunks_mut(span))
                .enumerate()
                .map(|(j, (cs, ss))| {
                    let zs = zc.next().unwrap_or_default();
                    let block = &block;
                    sc.spawn(move || block(range.start + j * (span / per), cs, ss, zs))
                })
                .collect();
            // Every thread joined (a panic in one is its `None`, never the scope's), then all
            // must have read their experts.
            let done: Vec<bool> = jobs
                .into_iter()
                .map(|h| h.join().ok().flatten().is_some())
                .collect();
            done.iter().all(|&d| d)
        });
        if !ok {
            return None;
        }
    }
    Some(Logical {
        scheme,
        dtype: info.module().tensor(values)?.dtype,
        shape: (ne, mr, k),
        codes,
        scales: scl,
        decode,
        zeros: zer,
    })
}

/// Dequantize the params packed from input `name` (`[E, M, K]`, given as f32 values) and compare.
/// `params` maps param names to their bytes. `None` when the recipe's form is not one this reads.
/// The plain form, built on [`logical`]: the oracle [`error_bf16`] is tested against (that one is
/// what `demo` uses).
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
            Some(QuantScheme::Int8Row | QuantScheme::Int8Group { .. }) => {
                (code as u8 as i8) as f32 * f32::from_bits(sb)
            }
            Some(QuantScheme::Int4 {
                zero_point, scale, ..
            }) => {
                let z = if zero_point { *l.zeros.get(at)? } else { 8 };
                (code as f32 - z as f32) * scale_value(scale, sb)
            }
        };
        worst = worst.max((xv - deq).abs());
    }
    Some(DequantError {
        max_abs: worst,
        max_rel_to_amax: if amax > 0.0 { worst / amax } else { 0.0 },
    })
}

/// The coordinate, in the quantization's scales (and zero points), of the scale of element
/// `(expert, row, column)` of its values param (`row` the param's row).
fn scale_coord(scheme: QuantScheme, (e, r, c): (i64, i64, i64)) -> ScaleCoord {
    let three = |x| ScaleCoord([e, r, x], 3);
    match scheme {
        QuantScheme::Nvfp4 { .. } => three(c / 16),
        QuantScheme::Mxfp4 => three(c / 32),
        QuantScheme::Fp8 { granularity, .. } => match granularity {
            Fp8Granularity::Tensor => ScaleCoord([e, 0, 0], 1),
            Fp8Granularity::Channel => ScaleCoord([e, r, 0], 2),
            Fp8Granularity::Block128 => ScaleCoord([e, r / 128, c / 128], 3),
            Fp8Granularity::Group { group } => three(c / group),
        },
        QuantScheme::Int8Row => ScaleCoord([e, r, 0], 2),
        QuantScheme::Int8Group { group } | QuantScheme::Int4 { group, .. } => three(c / group),
    }
}

/// A scale coordinate of one to three dimensions ([`scale_coord`]), kept off the heap: it is
/// computed for every element of a param.
struct ScaleCoord([i64; 3], usize);

impl std::ops::Deref for ScaleCoord {
    type Target = [i64];

    fn deref(&self) -> &[i64] {
        &self.0[..self.1]
    }
}

/// The weight scales of input `name`'s quantization as its param stores them: [`scale_map`].
pub struct ScaleMap {
    /// The scale param.
    pub param: String,
    /// The quantization.
    pub scheme: QuantScheme,
    map: StorageMap,
}

impl ScaleMap {
    /// The element offset, in the param's storage, of the scale of element `(expert, row,
    /// column)` of the values param (`row` the param's row).
    pub fn offset(&self, at: (i64, i64, i64)) -> i64 {
        self.map.offset_of(&scale_coord(self.scheme, at))
    }
}

/// Input `name`'s weight-scale param and its storage map at the module's binding (`None`
/// without a quantization with scales, or without a binding).
pub fn scale_map(info: &ModuleInfo, name: &str) -> Option<ScaleMap> {
    let parts = Parts::of(info, name)?;
    let (param, map) = param(info, parts.scales?)?;
    Some(ScaleMap {
        param,
        scheme: parts.scheme?,
        map,
    })
}

/// What dequantizing input `name` reads: the scheme (`None`: a plain copy), the params holding the
/// codes, the scales and the decode scale, and the row gather between input and params.
struct Parts {
    scheme: Option<QuantScheme>,
    values: TensorId,
    scales: Option<TensorId>,
    decode: Option<TensorId>,
    zeros: Option<TensorId>,
    rows: Option<IndexVec>,
}

/// The f32 value of a group-wise INT4 scale stored as `dtype` (its bits, as read).
fn scale_value(dtype: crate::dsl::ir::DType, bits: u32) -> f32 {
    use crate::dsl::ir::DType as D;
    match dtype {
        D::Bf16 => f32::from_bits(bits << 16),
        D::F16 => crate::pack::f16_to_f32(bits as u16),
        _ => f32::from_bits(bits),
    }
}

impl Parts {
    fn of(info: &ModuleInfo, name: &str) -> Option<Parts> {
        let (scheme, values, scales, decode, zeros, rows) = match info.quantization_of(name) {
            Some(q) => {
                let v = q.values?;
                (
                    Some(q.scheme),
                    v.param,
                    q.scales.map(|o| o.param),
                    q.decode_scale.map(|o| o.param),
                    q.zeros.map(|o| o.param),
                    v.rows.or(q.rows_in),
                )
            }
            None => {
                let c = info.copy_of(name)?;
                (None, c.param, None, None, None, c.rows)
            }
        };
        Some(Parts {
            scheme,
            values,
            scales,
            decode,
            zeros,
            rows,
        })
    }
}

/// How many threads `threads` means (0: one per core).
fn workers(threads: usize) -> usize {
    if threads == 0 {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    } else {
        threads
    }
}

/// `f` over `0..n` cut into contiguous ranges, one per thread (`threads`, 0: one per core), the
/// results in order; `None` if a thread failed.
fn per_range<T: Send>(
    n: usize,
    threads: usize,
    f: impl Fn(Range<usize>) -> T + Sync,
) -> Option<Vec<T>> {
    let t = workers(threads).clamp(1, n.max(1));
    if t == 1 {
        return Some(vec![f(0..n)]);
    }
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..t)
            .map(|j| s.spawn(move || f(j * n / t..(j + 1) * n / t)))
            .collect();
        // Every thread joined before the results are looked at (a panic in one is its `None`).
        let joined: Vec<Option<T>> = handles.into_iter().map(|h| h.join().ok()).collect();
        joined.into_iter().collect()
    })
}

/// The f32 value of a bf16 (little-endian bytes).
#[inline(always)]
fn bf16(b: &[u8]) -> f32 {
    f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)
}

/// The running amax `m` (bits of |x|) after one more bf16 `p`: with the sign cleared, non-NaN values
/// order as their bit patterns do, and a NaN (above 0x7F80) is skipped as `f32::max` skips it.
#[inline(always)]
fn amax_step(m: u16, p: &[u8]) -> u16 {
    let a = u16::from_le_bytes([p[0], p[1]]) & 0x7FFF;
    if a <= 0x7F80 {
        m.max(a)
    } else {
        m
    }
}

/// An input tensor `[E, M, K]` as the checkpoint holds it (bf16, little-endian bytes) with its
/// amax: what [`error_bf16`] compares a pack against.
#[derive(Debug, Clone, Copy)]
pub struct Bf16Input<'a> {
    bytes: &'a [u8],
    shape: (usize, usize, usize),
    amax: f32,
}

impl<'a> Bf16Input<'a> {
    /// `bytes` read as `shape`; its amax (the largest |x|, NaN skipped, as [`error`] finds it) is
    /// found on `threads` threads (0: one per core). `None` when `bytes` is not `2*E*M*K` long.
    pub fn new(bytes: &'a [u8], shape: (usize, usize, usize), threads: usize) -> Option<Self> {
        let n = shape.0.checked_mul(shape.1)?.checked_mul(shape.2)?;
        if bytes.len() != n.checked_mul(2)? {
            return None;
        }
        let parts = per_range(n, threads, |r| {
            let b = bytes.get(2 * r.start..2 * r.end).unwrap_or(&[]);
            // Sixteen running maxima, so that the loop vectorizes.
            let mut acc = [0u16; 16];
            let (head, rest) = b.split_at(b.len() / 32 * 32);
            for c in head.chunks_exact(32) {
                for (a, p) in acc.iter_mut().zip(c.chunks_exact(2)) {
                    *a = amax_step(*a, p);
                }
            }
            let tail = rest.chunks_exact(2).fold(0, amax_step);
            acc.into_iter().fold(tail, u16::max)
        })?;
        let top = parts.into_iter().max().unwrap_or(0);
        Some(Bf16Input {
            bytes,
            shape,
            amax: f32::from_bits(u32::from(top) << 16),
        })
    }

    /// The largest |x|.
    pub fn amax(&self) -> f32 {
        self.amax
    }

    /// `(E, M, K)`.
    pub fn shape(&self) -> (usize, usize, usize) {
        self.shape
    }
}

/// A storage map tabulated per dimension over the coordinates read: `offset_of(c)` is
/// `swizzle(base + sum over d of dims[d][c[d]])`, since each dimension's sub-modes add their part
/// independently of the others.
struct Tabulated {
    base: i64,
    dims: Vec<Vec<i64>>,
    swizzle: Option<Swizzle>,
}

impl Tabulated {
    /// `map` at coordinates below `extents` (one extent per coordinate given; a coordinate past the
    /// map's dimensions adds nothing, as in `offset_of`).
    fn new(map: &StorageMap, extents: &[usize]) -> Tabulated {
        let dims = extents
            .iter()
            .enumerate()
            .map(|(d, &n)| match map.modes.get(d) {
                Some(subs) => {
                    let one = StorageMap {
                        modes: vec![subs.clone()],
                        offset: 0,
                        swizzle: None,
                    };
                    (0..n).map(|c| one.offset_of(&[c as i64])).collect()
                }
                None => vec![0; n],
            })
            .collect();
        Tabulated {
            base: map.offset,
            dims,
            swizzle: map.swizzle,
        }
    }

    /// The offset of a sum of dimension parts (the swizzle applied).
    #[inline(always)]
    fn at(&self, sum: i64) -> i64 {
        match self.swizzle {
            None => sum,
            Some(sw) => sw.apply(sum),
        }
    }

    /// The base offset plus the parts of the leading coordinates (the swizzle not yet applied).
    fn partial(&self, coord: &[usize]) -> Option<i64> {
        let mut t = self.base;
        for (d, &c) in coord.iter().enumerate() {
            t = t.wrapping_add(*self.dims.get(d)?.get(c)?);
        }
        Some(t)
    }

    /// The offset of a full coordinate, as a buffer index.
    fn offset(&self, coord: &[usize]) -> Option<usize> {
        usize::try_from(self.at(self.partial(coord)?)).ok()
    }
}

/// How the codes decode: bf16 as they are, or through a table (4-bit codes two to a byte, low
/// nibble first, or one code a byte).
enum Codes<'t> {
    Bf16,
    Nibble(&'t [f32; 16]),
    Byte(&'t [f32; 256]),
}

/// Which scale an element uses: per expert, per row, per block of a row, or per 128x128 tile.
#[derive(Clone, Copy)]
enum Granule {
    Tensor,
    Row,
    Block,
    Tile128,
}

/// How a scale's storage decodes.
#[derive(Clone, Copy)]
enum ScaleCode {
    E4m3,
    E8m0,
    F32,
    Bf16,
    F16,
    /// A u4 zero point (two per byte, low nibble first).
    U4,
}

/// The scales of one quantization, tabulated.
struct Scales<'p> {
    bytes: &'p [u8],
    map: Tabulated,
    granule: Granule,
    code: ScaleCode,
}

impl Scales<'_> {
    /// Row `r` of expert `e`'s `n` scales (one per block along K) into `out`, decoded.
    fn row(&self, e: usize, r: usize, n: usize, luts: &Luts, out: &mut Vec<f32>) -> Option<()> {
        out.clear();
        for j in 0..n {
            let o = match self.granule {
                Granule::Tensor => self.map.offset(&[e]),
                Granule::Row => self.map.offset(&[e, r]),
                Granule::Block => self.map.offset(&[e, r, j]),
                Granule::Tile128 => self.map.offset(&[e, r / 128, j]),
            }?;
            let two = |o: usize| self.bytes.get(2 * o..2 * o + 2).map(|c| [c[0], c[1]]);
            out.push(match self.code {
                ScaleCode::Bf16 => bf16(&two(o)?),
                ScaleCode::F16 => crate::pack::f16_to_f32(u16::from_le_bytes(two(o)?)),
                ScaleCode::U4 => f32::from((*self.bytes.get(o / 2)? >> (4 * (o % 2))) & 0xF),
                ScaleCode::E4m3 => luts.e4m3[usize::from(*self.bytes.get(o)?)],
                ScaleCode::E8m0 => luts.e8m0[usize::from(*self.bytes.get(o)?)],
                ScaleCode::F32 => self
                    .bytes
                    .get(4 * o..4 * o + 4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .unwrap_or(0.0),
            });
        }
        Some(())
    }
}

/// Decoding tables, each entry the reference conversion of its code.
struct Luts {
    e2m1: [f32; 16],
    e4m3: [f32; 256],
    e8m0: [f32; 256],
    i8: [f32; 256],
    u4: [f32; 16],
}

impl Luts {
    fn new() -> Luts {
        Luts {
            e2m1: std::array::from_fn(|n| r::e2m1_to_f32(n as u8)),
            e4m3: std::array::from_fn(|b| r::e4m3_to_f32(b as u8)),
            e8m0: std::array::from_fn(|b| 2f32.powi(b as i32 - 127)),
            i8: std::array::from_fn(|b| f32::from(b as u8 as i8)),
            u4: std::array::from_fn(|n| n as f32),
        }
    }
}

/// One row's codes decoded into `q` (its length is K): `sum` is the row's part of the values'
/// offsets, `t` the last dimension's table, `contiguous` whether that table is the identity and
/// there is no swizzle.
fn decode_row(
    codes: &Codes,
    vals: &[u8],
    map: &Tabulated,
    t: &[i64],
    sum: i64,
    contiguous: bool,
    q: &mut [f32],
) -> Option<()> {
    let k = q.len();
    let start = usize::try_from(sum).ok();
    match (codes, start) {
        (Codes::Bf16, Some(s)) if contiguous => {
            let v = vals.get(2 * s..2 * (s + k))?;
            for (d, c) in q.iter_mut().zip(v.chunks_exact(2)) {
                *d = bf16(c);
            }
        }
        (Codes::Byte(lut), Some(s)) if contiguous => {
            let v = vals.get(s..s + k)?;
            for (d, &b) in q.iter_mut().zip(v) {
                *d = lut[usize::from(b)];
            }
        }
        (Codes::Nibble(lut), Some(s)) if contiguous && s % 2 == 0 => {
            let v = vals.get(s / 2..(s + k).div_ceil(2))?;
            for (d, &b) in q.chunks_mut(2).zip(v) {
                d[0] = lut[usize::from(b & 0xF)];
                if let Some(hi) = d.get_mut(1) {
                    *hi = lut[usize::from(b >> 4)];
                }
            }
        }
        _ => {
            for (d, &tc) in q.iter_mut().zip(t) {
                let o = usize::try_from(map.at(sum.wrapping_add(tc))).ok()?;
                *d = match codes {
                    Codes::Bf16 => bf16(vals.get(2 * o..2 * o + 2)?),
                    Codes::Byte(lut) => lut[usize::from(*vals.get(o)?)],
                    Codes::Nibble(lut) => {
                        lut[usize::from((*vals.get(o / 2)? >> (4 * (o % 2))) & 0xF)]
                    }
                };
            }
        }
    }
    Some(())
}

/// The largest of `worst` and `|x - q|` over a row (`x` as bf16 bytes, `q` dequantized).
#[inline(always)]
fn row_worst(x: &[u8], q: &[f32], worst: f32) -> f32 {
    // Eight running maxima, so that the loop vectorizes; the order does not change a maximum (every
    // term is >= +0 or a NaN, which `f32::max` skips wherever it falls).
    let mut acc = [worst; 8];
    let (xh, xt) = x.split_at(x.len() / 16 * 16);
    let (qh, qt) = q.split_at((xh.len() / 2).min(q.len()));
    for (xc, qc) in xh.chunks_exact(16).zip(qh.chunks_exact(8)) {
        for ((a, xb), &qv) in acc.iter_mut().zip(xc.chunks_exact(2)).zip(qc) {
            *a = a.max((bf16(xb) - qv).abs());
        }
    }
    for (xc, &qv) in xt.chunks_exact(2).zip(qt) {
        acc[0] = acc[0].max((bf16(xc) - qv).abs());
    }
    acc.iter().fold(worst, |a, &b| a.max(b))
}

/// [`error`] on the bf16 input as it is, fast: the params' storage maps tabulated per dimension,
/// codes and scales decoded through tables, each row's scales read once, and the rows split over
/// `threads` threads (0: one per core). The same result as [`error`] on the input's f32 values, bit
/// for bit.
pub fn error_bf16(
    info: &ModuleInfo,
    name: &str,
    x: &Bf16Input<'_>,
    params: &HashMap<String, Vec<u8>>,
    threads: usize,
) -> Option<DequantError> {
    let (ne, m, k) = x.shape;
    let Parts {
        scheme,
        values,
        scales,
        decode,
        zeros,
        rows,
    } = Parts::of(info, name)?;
    let (vname, vmap) = param(info, values)?;
    let vals = params.get(&vname)?.as_slice();
    let atoms = info.binding()?.atoms().to_vec();
    let src: Vec<usize> = (0..m)
        .map(|r| match &rows {
            Some(iv) => iv.map(r as i128, &atoms).map(|x| x as usize).unwrap_or(r),
            None => r,
        })
        .collect();
    let scales = match scales {
        Some(id) => {
            let (n, map) = param(info, id)?;
            Some((params.get(&n)?.as_slice(), map))
        }
        None => None,
    };
    let dec_v: Vec<f32> = match decode {
        Some(id) => f32s(params.get(&param(info, id)?.0)?),
        None => Vec::new(),
    };
    if ne == 0 || m == 0 || k == 0 {
        return Some(DequantError {
            max_abs: 0.0,
            max_rel_to_amax: 0.0,
        });
    }
    let luts = Luts::new();
    // Elements along K one scale covers, the scales' coordinates and their decoding.
    let (codes, block, granule, code) = match scheme {
        None => (Codes::Bf16, k, None, None),
        Some(QuantScheme::Nvfp4 { .. }) => (
            Codes::Nibble(&luts.e2m1),
            16,
            Some(Granule::Block),
            Some(ScaleCode::E4m3),
        ),
        Some(QuantScheme::Mxfp4) => (
            Codes::Nibble(&luts.e2m1),
            32,
            Some(Granule::Block),
            Some(ScaleCode::E8m0),
        ),
        Some(QuantScheme::Fp8 { granularity, .. }) => {
            let (block, g) = match granularity {
                Fp8Granularity::Tensor => (k, Granule::Tensor),
                Fp8Granularity::Channel => (k, Granule::Row),
                Fp8Granularity::Block128 => (128, Granule::Tile128),
                Fp8Granularity::Group { group } => (usize::try_from(group).ok()?, Granule::Block),
            };
            (
                Codes::Byte(&luts.e4m3),
                block,
                Some(g),
                Some(ScaleCode::F32),
            )
        }
        Some(QuantScheme::Int8Row) => (
            Codes::Byte(&luts.i8),
            k,
            Some(Granule::Row),
            Some(ScaleCode::F32),
        ),
        Some(QuantScheme::Int8Group { group }) => (
            Codes::Byte(&luts.i8),
            usize::try_from(group).ok()?,
            Some(Granule::Block),
            Some(ScaleCode::F32),
        ),
        Some(QuantScheme::Int4 { group, scale, .. }) => (
            Codes::Nibble(&luts.u4),
            usize::try_from(group).ok()?,
            Some(Granule::Block),
            Some(match scale {
                crate::dsl::ir::DType::Bf16 => ScaleCode::Bf16,
                crate::dsl::ir::DType::F16 => ScaleCode::F16,
                _ => ScaleCode::F32,
            }),
        ),
    };
    let nblk = k.div_ceil(block);
    let scales = match (granule, code) {
        (Some(granule), Some(code)) => {
            let (bytes, map) = scales?;
            let extents: Vec<usize> = match granule {
                Granule::Tensor => vec![ne],
                Granule::Row => vec![ne, m],
                Granule::Block => vec![ne, m, nblk],
                Granule::Tile128 => vec![ne, m.div_ceil(128), nblk],
            };
            Some(Scales {
                bytes,
                map: Tabulated::new(&map, &extents),
                granule,
                code,
            })
        }
        _ => None,
    };
    // Group-wise INT4's zero points (8 for symmetric groups; none for the other schemes).
    let int4 = matches!(scheme, Some(QuantScheme::Int4 { .. }));
    let zeros = match zeros {
        Some(id) => {
            let (n, map) = param(info, id)?;
            Some(Scales {
                bytes: params.get(&n)?.as_slice(),
                map: Tabulated::new(&map, &[ne, m, nblk]),
                granule: Granule::Block,
                code: ScaleCode::U4,
            })
        }
        None => None,
    };
    let vt = Tabulated::new(&vmap, &[ne, m, k]);
    let t = vt.dims.get(2)?.as_slice();
    let contiguous = vt.swizzle.is_none() && t.iter().enumerate().all(|(c, &o)| o == c as i64);
    let nvfp4 = matches!(scheme, Some(QuantScheme::Nvfp4 { .. }));
    let parts = per_range(ne * m, threads, |range| -> Option<f32> {
        let mut q = vec![0f32; k];
        let mut blk = Vec::with_capacity(nblk);
        let mut zb = vec![if int4 { 8.0 } else { 0.0 }; nblk];
        let mut worst = 0f32;
        for row in range {
            let (e, r) = (row / m, row % m);
            match &scales {
                Some(s) => s.row(e, r, nblk, &luts, &mut blk)?,
                None => {
                    blk.clear();
                    blk.resize(nblk, 1.0);
                }
            }
            if let Some(z) = &zeros {
                z.row(e, r, nblk, &luts, &mut zb)?;
            }
            let d = if nvfp4 { *dec_v.get(e)? } else { 1.0 };
            let sum = vt.partial(&[e, r])?;
            decode_row(&codes, vals, &vt, t, sum, contiguous, &mut q)?;
            let first = (e * m + *src.get(r)?).checked_mul(k)?;
            let xrow = x.bytes.get(2 * first..2 * (first + k))?;
            // x' = ((code - zero) * scale) * decode scale, the reference's order of rounding (the
            // zero is 0 but for INT4, where `code - zero` is exact).
            for ((qb, &s), &z) in q.chunks_mut(block).zip(&blk).zip(&zb) {
                for v in qb {
                    *v = ((*v - z) * s) * d;
                }
            }
            worst = row_worst(xrow, &q, worst);
        }
        Some(worst)
    })?;
    let worst = parts
        .into_iter()
        .try_fold(0f32, |a, w| w.map(|w| a.max(w)))?;
    let amax = x.amax;
    Some(DequantError {
        max_abs: worst,
        max_rel_to_amax: if amax > 0.0 { worst / amax } else { 0.0 },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::Layer;

    fn f32s_of_bf16(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(2).map(bf16).collect()
    }

    /// Every standard and layout recipe packs a small layer (rows not a multiple of 128, swizzled
    /// and column-major storage among them); the fast error equals the plain one bit for bit, on
    /// one thread and on several, before and after corrupting the params.
    #[test]
    fn fast_error_equals_the_plain_one() {
        // I = 384: a multiple of int4_g128's groups of 128.
        let (e, h, i) = (3, 256, 384);
        let mut layer = Layer::synthetic(e, h, i, 9);
        // A NaN in the input, which both forms skip. (No outliers: the largest error would be that
        // of the small values zeroed beside one, the same whatever the scales, and hide a
        // difference in how the scales are read.)
        layer.w13[2..4].copy_from_slice(&0x7FC1u16.to_le_bytes());
        let inputs: HashMap<String, Vec<u8>> = [
            ("w13".to_string(), layer.w13.clone()),
            ("w2".to_string(), layer.w2.clone()),
        ]
        .into_iter()
        .collect();
        let opts = crate::codegen::host::Options::default();
        let mut compared = 0;
        for r in crate::kernels::STANDARD
            .iter()
            .chain(crate::kernels::LAYOUTS)
        {
            let info = crate::check_source(r.source, r.path, Some(&layer.binding()))
                .unwrap_or_else(|err| panic!("{}: {err}", r.name));
            let mut params: HashMap<String, Vec<u8>> = crate::gpu::host_pack(&info, &inputs, &opts)
                .unwrap_or_else(|err| panic!("{}: {err}", r.name))
                .into_iter()
                .collect();
            for corrupt in [false, true] {
                if corrupt {
                    // Every 97th byte of every param flipped: codes, scales and decode scales.
                    for p in params.values_mut() {
                        for b in p.iter_mut().step_by(97) {
                            *b ^= 0x5A;
                        }
                    }
                }
                for (name, bytes, shape) in [
                    ("w13", &layer.w13, (e, 2 * i, h)),
                    ("w2", &layer.w2, (e, h, i)),
                ] {
                    let plain = error(&info, name, &f32s_of_bf16(bytes), shape, &params);
                    let declared = r.source.contains(&format!("input {name} "));
                    assert_eq!(plain.is_some(), declared, "{} {name}", r.name);
                    for threads in [1, 2, 5] {
                        let x = Bf16Input::new(bytes, shape, threads).unwrap();
                        let fast = error_bf16(&info, name, &x, &params, threads);
                        let bits = |d: Option<DequantError>| {
                            d.map(|d| (d.max_abs.to_bits(), d.max_rel_to_amax.to_bits()))
                        };
                        assert_eq!(
                            bits(fast),
                            bits(plain),
                            "{} {name} corrupt={corrupt} threads={threads}",
                            r.name
                        );
                    }
                    compared += usize::from(declared);
                }
            }
        }
        // Two inputs, clean and corrupt, in every recipe but `mxfp4_swizzled` (w13 only).
        assert_eq!(
            compared,
            4 * (crate::kernels::STANDARD.len() + crate::kernels::LAYOUTS.len()) - 2
        );
    }

    /// The amax on the bits is the amax of the values (a NaN skipped, an infinity kept).
    #[test]
    fn amax_on_bits_equals_amax_of_values() {
        let layer = Layer::synthetic(1, 64, 64, 4);
        let mut b = layer.w13.clone();
        let shape = (1, 128, 64);
        let plain = |b: &[u8]| f32s_of_bf16(b).iter().fold(0f32, |a, v| a.max(v.abs()));
        for threads in [1, 3] {
            let x = Bf16Input::new(&b, shape, threads).unwrap();
            assert_eq!(x.amax().to_bits(), plain(&b).to_bits());
        }
        b[100..102].copy_from_slice(&0xFFC0u16.to_le_bytes()); // NaN
        b[200..202].copy_from_slice(&0xBF80u16.to_le_bytes()); // -1.0
        let x = Bf16Input::new(&b, shape, 2).unwrap();
        assert_eq!(x.amax(), 1.0);
        assert_eq!(x.amax().to_bits(), plain(&b).to_bits());
        b[300..302].copy_from_slice(&0xFF80u16.to_le_bytes()); // -inf
        let x = Bf16Input::new(&b, shape, 2).unwrap();
        assert_eq!(x.amax(), f32::INFINITY);
        assert!(Bf16Input::new(&b[2..], shape, 1).is_none());
    }
}
