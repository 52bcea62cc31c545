//! The W4A16 GEMM's operand (`codegen::gemm::ws::Operands::W4Bf16`) from a weights-only 4-bit
//! recipe's params (issue \[8\]): NVFP4 (E2M1 codes, E4M3 scales per 16, a per-expert decode
//! scale), MXFP4 (E2M1, E8M0 per 32) and symmetric group-wise INT4 (u4 codes, bf16 scales per
//! group). Read in the input's coordinates through the verified storage maps
//! ([`crate::dequant::Logical`]); written as the kernel takes them:
//! * codes `[slots, N, K / 2]`, two per byte, in the kernel's order within each 64-deep k-tile of a
//!   row (`codegen::gemm::reference::w4_kernel_bits`: each fragment thread's codes in one 8-byte
//!   word pair; INT4's pairs of elements at nibbles `3 - p` and `7 - p`, E2M1's bits spread over
//!   the word so that a pair converts with one or two masks), K a multiple of 64;
//! * group scales `[slots, scale tiles, N, groups per k-tile]` (`W4::group_scale_at`) (one k-tile's
//!   scales of a row are one aligned load, a tile's rows one TMA box), as the recipe stores each (E4M3, E8M0 or bf16 bits;
//!   asymmetric INT4: bf16 bits and bf16 `-(128 + z)` in the high half, `GroupScale::Bf16Zero`), every element of a
//!   group carrying the same (checked);
//! * one f32 factor per slot for the accumulator: NVFP4's decode scale times `2^8` (the kernel
//!   forms E4M3 scales times `2^118`, so its products are `2^-8` of the weights'), MXFP4's `2^c`
//!   where an expert's scale bytes were lowered by `c` to keep them at most 128 (the kernel's
//!   `2^(b - 1)` must be a finite bf16), 1 for INT4.
//!
//! Exactness: `code * scale` is exact in bf16 for E2M1 with E4M3 or E8M0 (at most 2 + 4
//! significant bits, normal range), so NVFP4 and MXFP4 layers accumulate the same products as the
//! f64 reference; INT4's `(q - 8) * s` (up to 4 + 8 significant bits) is rounded once to bf16, a
//! relative error of at most 2^-8 (bf16's unit roundoff) per weight (README, "Group-wise INT4");
//! asymmetric INT4's `(q - z) * s` likewise (`q - z` exact in bf16).

use crate::codegen::gemm::ws::{GroupScale, Operands, W4Codes, W4};
use crate::dequant::Logical;
use crate::dsl::ir::{DType, QuantScheme};

/// The operand: its format, codes, group scales and per-slot factors.
pub(crate) struct W4Operand {
    /// The format.
    pub(crate) operands: Operands,
    /// `[slots, N, K / 2]` bytes.
    pub(crate) codes: Vec<u8>,
    /// `[slots, scale tiles, N, groups per k-tile]` (`W4::group_scale_at`) scales (1 or 2 bytes each, little-endian).
    pub(crate) group_scales: Vec<u8>,
    /// One factor per slot.
    pub(crate) factors: Vec<f32>,
}

/// The 4-bit format of a scheme, or why it has none.
pub(crate) fn format(scheme: QuantScheme) -> Result<W4, String> {
    match scheme {
        QuantScheme::Nvfp4 { .. } => Ok(W4::NVFP4),
        QuantScheme::Mxfp4 => Ok(W4::MXFP4),
        QuantScheme::Int4 {
            group,
            zero_point,
            scale,
        } => {
            // Zero points ride with their scales, a row's k-tile one 4- or 8-byte load.
            let least = if zero_point { 32 } else { 16 };
            let g = u32::try_from(group)
                .ok()
                .filter(|g| *g >= least && g.is_power_of_two());
            match (g, scale) {
                (Some(group), DType::Bf16 | DType::F16 | DType::F32) => Ok(W4 {
                    codes: W4Codes::U4,
                    scale: if zero_point {
                        GroupScale::Bf16Zero
                    } else {
                        GroupScale::Bf16
                    },
                    group,
                }),
                _ => Err(format!(
                    "{} group-wise INT4 with groups of {group}: the GPU GEMM takes groups of a power of two, at least {least}",
                    if zero_point { "asymmetric" } else { "symmetric" }
                )),
            }
        }
        other => Err(format!("{} is not a 4-bit scheme", other.name())),
    }
}

/// The bf16 bits of an INT4 scale stored as `dtype` (`bits` as [`Logical::scales`] holds them),
/// where bf16 holds it exactly.
fn int4_scale_bf16(dtype: DType, bits: u32) -> Option<u16> {
    let v = match dtype {
        DType::Bf16 => return u16::try_from(bits).ok(),
        DType::F16 => crate::pack::f16_to_f32(bits as u16),
        _ => f32::from_bits(bits),
    };
    let b = crate::codegen::gemm::reference::bf16_from_f32(v);
    (crate::codegen::gemm::reference::bf16_to_f32(b).to_bits() == v.to_bits()).then_some(b)
}

/// A 4-bit operand's parts in the input's coordinates, one scale per group: what both
/// [`operand`] (from the element-wise read-back) and [`from_compact`] (from the stored bytes)
/// build the kernel's operand from.
struct Groups<'a> {
    scheme: QuantScheme,
    /// `(slots, N, K)`.
    shape: (usize, usize, usize),
    /// `[slots, N, K]` codes, two per byte, the even element in the low nibble.
    codes: &'a [u8],
    /// Per `(slot, row, group)`: the scale's bits.
    scales: &'a [u32],
    /// Per `(slot, row, group)`: the u4 zero point (asymmetric INT4); empty otherwise.
    zeros: &'a [u32],
    /// Per slot (or one for all): the decode scale's bits (NVFP4).
    decode: &'a [u32],
}

/// The GEMM's format of `scheme` at `(slots, N, K)`, where its kernels take that shape.
fn fitting(scheme: QuantScheme, (slots, n, k): (usize, usize, usize)) -> Result<W4, String> {
    let w = format(scheme)?;
    if !w.fits(n as u64, k as u64) {
        return Err(format!(
            "[{slots}, {n}, {k}] 4-bit weights: the GEMM needs K a multiple of 64 and N of {}",
            16 / w.scale.bytes()
        ));
    }
    Ok(w)
}

/// The operand of the weights `l` (`[slots, N, K]` in the input's coordinates). Errors name what
/// the GEMM cannot take: a scheme without a 4-bit form, a group whose elements do not share one
/// scale (or zero point), an INT4 scale that bf16 does not hold, an MXFP4 expert whose scales
/// span more than the kernel's exponent range.
pub(crate) fn operand(l: &Logical) -> Result<W4Operand, String> {
    let scheme = l.scheme.ok_or("the weights are not quantized")?;
    let w = fitting(scheme, l.shape)?;
    let (slots, n, k) = l.shape;
    let g = w.group as usize;
    let groups = k.div_ceil(g);
    let elems = slots * n * k;
    if l.codes.len() != elems || l.scales.len() != elems {
        return Err(format!(
            "[{slots}, {n}, {k}] weights read back as {} codes and {} scales",
            l.codes.len(),
            l.scales.len()
        ));
    }
    let mut codes = vec![0u8; elems / 2];
    for (i, &c) in l.codes.iter().enumerate() {
        codes[i / 2] |= ((c & 0xF) as u8) << (4 * (i % 2));
    }
    // Each (slot, row, group)'s scale (and zero point), checked shared by the group's elements.
    let zero_points = w.scale == GroupScale::Bf16Zero;
    let mut scales = vec![0u32; slots * n * groups];
    let mut zeros = vec![0u32; if zero_points { scales.len() } else { 0 }];
    for e in 0..slots {
        for j in 0..n {
            for q in 0..groups {
                let at = (e * n + j) * k + q * g;
                let len = g.min(k - q * g);
                let all = &l.scales[at..at + len];
                if all.iter().any(|&b| b != all[0]) {
                    return Err(format!(
                        "slot {e}, row {j}: the elements of scale group {q} do not share one scale"
                    ));
                }
                let i = (e * n + j) * groups + q;
                scales[i] = all[0];
                if zero_points {
                    let zs = l.zeros.get(at..at + len).ok_or_else(|| {
                        format!("slot {e}, row {j}: no zero points for scale group {q}")
                    })?;
                    if zs.iter().any(|&z| z != zs[0]) {
                        return Err(format!(
                            "slot {e}, row {j}: the elements of scale group {q} do not share one u4 zero point"
                        ));
                    }
                    zeros[i] = zs[0];
                }
            }
        }
    }
    build(
        w,
        &Groups {
            scheme,
            shape: l.shape,
            codes: &codes,
            scales: &scales,
            zeros: &zeros,
            decode: &l.decode,
        },
    )
}

/// The operand straight from the stored bytes ([`crate::dequant::compact`]): the same operand
/// [`operand`] builds from the read-back of those params, with the same errors.
pub(crate) fn from_compact(c: &crate::dequant::Compact<'_>) -> Result<W4Operand, String> {
    let scheme = c.scheme.ok_or("the weights are not quantized")?;
    let w = fitting(scheme, c.shape)?;
    let (slots, n, k) = c.shape;
    let per_group = slots * n * k.div_ceil(w.group as usize);
    if c.scales.len() != per_group || c.values.len() != slots * n * k / 2 {
        return Err(format!(
            "[{slots}, {n}, {k}] weights stored as {} code bytes and {} scales",
            c.values.len(),
            c.scales.len()
        ));
    }
    if w.scale == GroupScale::Bf16Zero && c.zeros.len() != per_group {
        return Err(format!(
            "[{slots}, {n}, {k}] weights stored with {} zero points for {per_group} scale groups",
            c.zeros.len()
        ));
    }
    build(
        w,
        &Groups {
            scheme,
            shape: c.shape,
            codes: &c.values,
            scales: &c.scales,
            zeros: &c.zeros,
            decode: &c.decode,
        },
    )
}

/// The kernel's operand of format `w` from one scale (and zero point) per group.
fn build(w: W4, p: &Groups<'_>) -> Result<W4Operand, String> {
    let (slots, n, k) = p.shape;
    let g = w.group as usize;
    let groups = k.div_ceil(g);
    let codes = crate::codegen::gemm::reference::w4_kernel_order(w.codes, p.codes, slots * n, k);
    let sb = w.scale.bytes() as usize;
    let mut group_scales = vec![0u8; w.group_scale_bytes(slots, n, k)];
    let mut factors = vec![1f32; slots];
    // Whether group q of row j of slot e holds a code other than +-0.
    let nonzero = |e: usize, j: usize, q: usize| {
        let at = (e * n + j) * k + q * g;
        (at..at + g.min(k - q * g)).any(|i| {
            p.codes
                .get(i / 2)
                .is_some_and(|b| (b >> (4 * (i % 2))) & 7 != 0)
        })
    };
    for (e, factor) in factors.iter_mut().enumerate() {
        let mut bits = p
            .scales
            .get(e * n * groups..(e + 1) * n * groups)
            .ok_or_else(|| format!("slot {e}: no scales"))?
            .to_vec();
        match w.scale {
            GroupScale::E4m3 => {
                let dec = f32::from_bits(
                    *p.decode
                        .get(e)
                        .or(p.decode.first())
                        .ok_or("no decode scale")?,
                );
                *factor = dec * 256.0;
                if !factor.is_finite() {
                    return Err(format!(
                        "slot {e}: decode scale {dec} times 2^8 is not finite"
                    ));
                }
            }
            GroupScale::E8m0 => {
                // Lower every byte of the expert by c (its largest past 128) and fold 2^c into the
                // factor; a group with a nonzero code must stay at a byte >= 0.
                let top = (0..n * groups)
                    .filter(|&i| nonzero(e, i / groups, i % groups))
                    .map(|i| bits[i])
                    .max()
                    .unwrap_or(0);
                let c = top.saturating_sub(128);
                for (i, b) in bits.iter_mut().enumerate() {
                    if *b < c {
                        if nonzero(e, i / groups, i % groups) {
                            return Err(format!(
                                "slot {e}: its E8M0 scales span 2^{} to 2^{}, more than the GEMM's 2^128 within one expert",
                                i64::from(*b) - 127,
                                i64::from(top) - 127
                            ));
                        }
                        *b = 0;
                    } else {
                        // (A group of zero codes may sit above the top: any scale <= 128 serves it.)
                        *b = (*b - c).min(128);
                    }
                }
                *factor = 2f32.powi(c as i32);
            }
            GroupScale::Bf16 | GroupScale::Bf16Zero => {
                let QuantScheme::Int4 { scale, .. } = p.scheme else {
                    return Err("bf16 group scales come from INT4 only".into());
                };
                for (i, b) in bits.iter_mut().enumerate() {
                    *b = u32::from(int4_scale_bf16(scale, *b).ok_or_else(|| {
                        format!(
                            "slot {e}: an INT4 scale stored as {scale:?} that bf16 does not hold"
                        )
                    })?);
                    if w.scale == GroupScale::Bf16Zero {
                        let (j, q) = (i / groups, i % groups);
                        let z = *p.zeros.get(e * n * groups + i).ok_or_else(|| {
                            format!("slot {e}, row {j}: no zero points for scale group {q}")
                        })?;
                        if z > 15 {
                            return Err(format!(
                                "slot {e}, row {j}: zero point {z} of scale group {q} is not a u4"
                            ));
                        }
                        *b |= u32::from(GroupScale::zero_point_bits(z as u8)) << 16;
                    }
                }
            }
        }
        for j in 0..n {
            for q in 0..groups {
                let at = w.group_scale_at(n, k, e, j, q);
                let b = bits[j * groups + q].to_le_bytes();
                group_scales[at..at + sb].copy_from_slice(&b[..sb]);
            }
        }
    }
    Ok(W4Operand {
        operands: Operands::W4Bf16(w),
        codes,
        group_scales,
        factors,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::codegen::gemm::reference::w4_weight;

    /// A `[1, n, k]` MXFP4 operand: codes `c(j, x)`, one E8M0 byte per (row, group of 32).
    fn mxfp4(
        n: usize,
        k: usize,
        code: impl Fn(usize, usize) -> u32,
        byte: impl Fn(usize, usize) -> u32,
    ) -> Logical {
        let mut codes = Vec::new();
        let mut scales = Vec::new();
        for j in 0..n {
            for x in 0..k {
                codes.push(code(j, x));
                scales.push(byte(j, x / 32));
            }
        }
        Logical {
            scheme: Some(QuantScheme::Mxfp4),
            dtype: DType::E2m1,
            shape: (1, n, k),
            codes,
            scales,
            decode: Vec::new(),
            zeros: Vec::new(),
        }
    }

    /// The operand's weight `(j, x)` times the slot's factor.
    fn weight(o: &W4Operand, n: usize, k: usize, j: usize, x: usize) -> f64 {
        let Operands::W4Bf16(w) = o.operands else {
            panic!("a 4-bit operand")
        };
        let code = crate::codegen::gemm::reference::w4_kernel_code(w.codes, &o.codes, j, x, k);
        let at = w.group_scale_at(n, k, 0, j, x / w.group as usize);
        let s = w.group_scale_element(&o.group_scales, at).unwrap();
        w4_weight(w, code, s) * f64::from(o.factors[0])
    }

    /// E8M0 bytes past 128 (weights of magnitude 8 and more) are lowered by the expert's largest
    /// excess and the factor carries it: every weight is still `e2m1(code) * 2^(b - 127)` exactly;
    /// a group of zero codes may keep any byte (clamped to 128).
    #[test]
    fn e8m0_bytes_past_128_are_lowered_into_the_factor() {
        let (n, k) = (16, 64);
        let l = mxfp4(
            n,
            k,
            |j, x| if j == 3 { 0 } else { ((j + x) % 16) as u32 },
            |j, g| {
                if j == 3 {
                    250
                } else {
                    120 + (j + g) as u32 % 14
                }
            },
        );
        let o = operand(&l).unwrap();
        assert_eq!(
            o.factors[0],
            2f32.powi(5),
            "the largest byte with codes is 133"
        );
        for j in 0..n {
            for x in 0..k {
                let want = f64::from(crate::codegen::reference::e2m1_to_f32(
                    l.codes[j * k + x] as u8,
                )) * 2f64.powi(l.scales[j * k + x] as i32 - 127);
                assert_eq!(weight(&o, n, k, j, x), want, "{j} {x}");
            }
        }
        assert!(o.group_scales.iter().all(|&b| b <= 128));
        // Bytes whose codes are not zero and sit more than 128 below the top: refused.
        let far = mxfp4(n, k, |_, _| 1, |j, _| if j == 0 { 200 } else { 10 });
        let err = operand(&far).err().unwrap();
        assert!(err.contains("2^128"), "{err}");
        // A group whose elements carry different scales: refused by name.
        let mut mixed = mxfp4(n, k, |_, _| 1, |j, g| 120 + (j + g) as u32 % 2);
        mixed.scales[5] = 7;
        assert!(operand(&mixed)
            .err()
            .unwrap()
            .contains("do not share one scale"));
        // Lengths that do not match the shape: refused, never indexed past.
        let mut short = mxfp4(n, k, |_, _| 1, |_, _| 127);
        short.codes.pop();
        assert!(operand(&short).is_err());
    }

    /// Asymmetric INT4 (zero points, groups of 32): every weight of the operand is `(q - z) * s`
    /// rounded once to bf16, the group's zero point riding in its scale element's high half; a
    /// group whose elements disagree on the zero point, groups of 16, and zero points missing
    /// are refused by name.
    #[test]
    fn asymmetric_int4_weights_are_code_minus_zero_times_scale() {
        use crate::codegen::gemm::reference::{bf16_from_f32, bf16_to_f32};
        let (n, k, g) = (8usize, 128usize, 32usize);
        let scheme = |group| QuantScheme::Int4 {
            group,
            zero_point: true,
            scale: DType::Bf16,
        };
        let scale = |j: usize, q: usize| u32::from(bf16_from_f32(0.01 * (1 + j + 3 * q) as f32));
        let zero = |j: usize, q: usize| ((5 * j + q) % 16) as u32;
        let mut l = Logical {
            scheme: Some(scheme(g as i64)),
            dtype: DType::U4,
            shape: (1, n, k),
            codes: (0..n * k).map(|i| ((i * 7) % 16) as u32).collect(),
            scales: (0..n * k).map(|i| scale(i / k, i % k / g)).collect(),
            decode: Vec::new(),
            zeros: (0..n * k).map(|i| zero(i / k, i % k / g)).collect(),
        };
        let o = operand(&l).unwrap();
        assert_eq!(
            o.operands,
            Operands::W4Bf16(W4 {
                codes: W4Codes::U4,
                scale: GroupScale::Bf16Zero,
                group: 32
            })
        );
        for j in 0..n {
            for x in 0..k {
                let (q, z) = (l.codes[j * k + x] as f32, zero(j, x / g) as f32);
                let s = bf16_to_f32(scale(j, x / g) as u16);
                let want = f64::from(bf16_to_f32(bf16_from_f32((q - z) * s)));
                assert_eq!(weight(&o, n, k, j, x), want, "{j} {x}");
            }
        }
        l.zeros[40] ^= 1;
        let err = operand(&l).err().unwrap();
        assert!(err.contains("one u4 zero point"), "{err}");
        l.zeros.clear();
        assert!(operand(&l).err().unwrap().contains("no zero points"));
        let err = format(scheme(16)).err().unwrap();
        assert!(
            err.contains("asymmetric") && err.contains("at least 32"),
            "{err}"
        );
    }

    /// INT4 scales stored as f16 or f32 take bf16 where it holds them exactly, and are refused
    /// where it does not.
    #[test]
    fn int4_scales_must_be_bf16_values() {
        assert_eq!(int4_scale_bf16(DType::Bf16, 0x3C00), Some(0x3C00));
        assert_eq!(int4_scale_bf16(DType::F32, 0.5f32.to_bits()), Some(0x3F00));
        assert_eq!(int4_scale_bf16(DType::F32, 0.1f32.to_bits()), None);
        assert_eq!(int4_scale_bf16(DType::F16, 0x3800), Some(0x3F00));
        assert_eq!(int4_scale_bf16(DType::F16, 0x3801), None);
    }
}
