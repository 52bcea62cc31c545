//! SPEC's formulas in plain Rust, written independently of the kernel IR (different algorithms: the
//! E4M3 conversion searches the code table, E2M1 uses SPEC's threshold table): the oracle the
//! interpreter and both backends are tested against, byte for byte.

/// Value of an E4M3 (`float8_e4m3fn`) byte; NaN for `0x7F`/`0xFF`. A lookup in [`E4M3_VALUES`]
/// (the host reads every FP8 weight through it: the `powi` of the formula was an eighth of the
/// host forward's time).
pub fn e4m3_to_f32(b: u8) -> f32 {
    E4M3_VALUES[b as usize]
}

/// The 256 E4M3 values, built at compile time from each byte's sign, exponent and mantissa as
/// f32 bits (every E4M3 value is exact in f32): normal `2^(e - 7) * (1 + m / 8)`, subnormal `m *
/// 2^-9` (renormalized), `+-0`, and NaN for `0x7F`/`0xFF`.
pub const E4M3_VALUES: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = f32::from_bits(e4m3_bits(b as u8));
        b += 1;
    }
    t
};

const fn e4m3_bits(b: u8) -> u32 {
    let sign = ((b >> 7) as u32) << 31;
    let e = ((b >> 3) & 0xF) as u32;
    let m = (b & 7) as u32;
    if e == 0xF && m == 7 {
        return f32::NAN.to_bits();
    }
    if e != 0 {
        return sign | ((e + 127 - 7) << 23) | (m << 20);
    }
    if m == 0 {
        return sign;
    }
    // m * 2^-9 with m in 1..=7: the leading bit p of m sets the exponent, the rest the mantissa.
    let p = 31 - m.leading_zeros();
    sign | ((p + 127 - 9) << 23) | ((m - (1 << p)) << (23 - p))
}

/// RNE conversion of f32 to E4M3 after clamping to ±448 (SPEC §0): the nearest code of the table,
/// ties to the even code.
pub fn e4m3_from_f32(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs().min(448.0) as f64;
    let mut best = 0u8;
    let mut best_d = f64::INFINITY;
    for c in 0u8..=0x7E {
        let d = (e4m3_to_f32(c) as f64 - a).abs();
        if d < best_d || (d == best_d && c % 2 == 0) {
            best = c;
            best_d = d;
        }
    }
    sign | best
}

/// SPEC §0's threshold form of RNE to E2M1 (input already clamped to ±6); the sign is kept for values
/// that round to zero.
pub fn e2m1_from_f32(x: f32) -> u8 {
    let a = x.abs();
    let code = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    let sign = if x.is_sign_negative() { 8 } else { 0 };
    sign | code
}

/// Value of an E2M1 nibble.
pub fn e2m1_to_f32(n: u8) -> f32 {
    const GRID: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let v = GRID[(n & 7) as usize];
    if n & 8 != 0 {
        -v
    } else {
        v
    }
}

fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// NVFP4 global (encode) scale `gs = 2688 / amax` (1 when `amax == 0`) and decode scale `1/gs`.
pub fn nvfp4_global(x: &[f32]) -> (f32, f32) {
    let a = amax(x);
    let gs = if a == 0.0 { 1.0 } else { 2688.0 / a };
    (gs, 1.0 / gs)
}

/// SPEC §4 for rows of `k` values: packed codes `[rows, k/2]` and linear E4M3 scales `[rows, k/16]`.
pub fn nvfp4_quantize(x: &[f32], k: usize, gs: f32) -> (Vec<u8>, Vec<u8>) {
    let mut packed = Vec::with_capacity(x.len() / 2);
    let mut scales = Vec::with_capacity(x.len() / 16);
    let inv_gs = 1.0 / gs;
    for row in x.chunks(k) {
        for blk in row.chunks(16) {
            let vmax = amax(blk);
            let s = e4m3_from_f32((gs * (vmax * (1.0f32 / 6.0))).clamp(-448.0, 448.0));
            let sv = e4m3_to_f32(s);
            let oscale = if sv == 0.0 { 0.0 } else { 1.0 / (sv * inv_gs) };
            scales.push(s);
            for pair in blk.chunks(2) {
                let c = |v: f32| e2m1_from_f32((v * oscale).clamp(-6.0, 6.0));
                let byte = if sv == 0.0 {
                    0
                } else {
                    c(pair[0]) | (c(pair[1]) << 4)
                };
                packed.push(byte);
            }
        }
    }
    (packed, scales)
}

/// FP8 per-tensor (SPEC §5): codes and `scale = amax/448` (1 for all zeros), `q = e4m3(x * (1/scale))`.
pub fn fp8_per_tensor(x: &[f32]) -> (Vec<u8>, f32) {
    let a = amax(x);
    let scale = if a == 0.0 { 1.0 } else { a / 448.0 };
    let inv = 1.0 / scale;
    (
        x.iter()
            .map(|v| e4m3_from_f32((v * inv).clamp(-448.0, 448.0)))
            .collect(),
        scale,
    )
}

/// FP8 per-channel: per row `scale = max(amax/448, 1/(448*512))` (1 for a zero row), `q = e4m3(x/scale)`.
pub fn fp8_per_channel(x: &[f32], k: usize) -> (Vec<u8>, Vec<f32>) {
    let mut q = Vec::with_capacity(x.len());
    let mut s = Vec::new();
    for row in x.chunks(k) {
        let a = amax(row);
        let scale = if a == 0.0 {
            1.0
        } else {
            (a / 448.0).max(1.0 / (448.0 * 512.0))
        };
        s.push(scale);
        q.extend(
            row.iter()
                .map(|v| e4m3_from_f32((v / scale).clamp(-448.0, 448.0))),
        );
    }
    (q, s)
}

/// Group-wise FP8: per `group` consecutive elements of a row, the per-channel formula
/// ([`fp8_per_channel`] with rows of `group`); scales in row-major `[rows, K / group]` order.
pub fn fp8_per_group(x: &[f32], group: usize) -> (Vec<u8>, Vec<f32>) {
    fp8_per_channel(x, group)
}

/// FP8 128x128 blocks (DeepGEMM's `per_block_cast_to_fp8`): `sf = max(amax, 1e-4)/448`,
/// `q = e4m3(x * (1/sf))`; scales `[ceil(m/128), ceil(n/128)]`.
pub fn fp8_block128(x: &[f32], m: usize, n: usize) -> (Vec<u8>, Vec<f32>) {
    let (bm, bn) = (m.div_ceil(128), n.div_ceil(128));
    let mut q = vec![0u8; m * n];
    let mut sf = vec![0f32; bm * bn];
    for i in 0..bm {
        for j in 0..bn {
            let mut a = 0f32;
            for r in i * 128..((i + 1) * 128).min(m) {
                for c in j * 128..((j + 1) * 128).min(n) {
                    a = a.max(x[r * n + c].abs());
                }
            }
            let s = a.max(1e-4) / 448.0;
            sf[i * bn + j] = s;
            let inv = 1.0 / s;
            for r in i * 128..((i + 1) * 128).min(m) {
                for c in j * 128..((j + 1) * 128).min(n) {
                    q[r * n + c] = e4m3_from_f32((x[r * n + c] * inv).clamp(-448.0, 448.0));
                }
            }
        }
    }
    (q, sf)
}

/// MXFP4 (SPEC §7): per 32 elements, E8M0 scale `floor(log2 amax) - 2` (OCP floor, clamped), codes of
/// `x / 2^e`, packed low nibble first.
pub fn mxfp4(x: &[f32]) -> (Vec<u8>, Vec<u8>) {
    let mut packed = Vec::new();
    let mut scales = Vec::new();
    for blk in x.chunks(32) {
        let a = amax(blk);
        if a == 0.0 {
            scales.push(0);
            packed.extend(std::iter::repeat_n(0u8, 16));
            continue;
        }
        let e = ((a as f64).log2().floor() as i32 - 2).clamp(-127, 127);
        scales.push((e + 127) as u8);
        let div = 2f64.powi(e);
        for pair in blk.chunks(2) {
            let c = |v: f32| e2m1_from_f32(((v as f64 / div) as f32).clamp(-6.0, 6.0));
            packed.push(c(pair[0]) | (c(pair[1]) << 4));
        }
    }
    (packed, scales)
}

/// INT8 per row (SPEC §8): `scale = amax/127` (1 for a zero row), `q = clamp(rne(x/scale), -128, 127)`.
pub fn int8_per_row(x: &[f32], k: usize) -> (Vec<u8>, Vec<f32>) {
    int8_per_group(x, k)
}

/// Group-wise INT8 (README, "Group-wise INT8"): SPEC §8's formula per run of `group` consecutive
/// elements (a row when `group` is its length): `scale = amax/127` (1 for a zero group),
/// `q = clamp(rne(x/scale), -128, 127)`; one scale per group, in order.
pub fn int8_per_group(x: &[f32], group: usize) -> (Vec<u8>, Vec<f32>) {
    let mut q = Vec::with_capacity(x.len());
    let mut s = Vec::new();
    for row in x.chunks(group.max(1)) {
        let a = amax(row);
        let scale = if a == 0.0 { 1.0 } else { a / 127.0 };
        s.push(scale);
        q.extend(
            row.iter()
                .map(|v| ((v / scale).round_ties_even().clamp(-128.0, 127.0) as i8) as u8),
        );
    }
    (q, s)
}

/// A non-negative finite f32 rounded to the nearest value of a group-wise INT4 scale dtype, ties to
/// the even encoding (README, "Group-wise INT4"): `bf16` by comparing the two bf16 neighbours in
/// f64; `f16` by rounding `x / quantum` in f64 (quantum `2^(floor(log2 x) - 10)`, at least `2^-24`,
/// the subnormal step) and saturating at 65504; any other dtype leaves `x` as it is.
pub fn round_scale(x: f32, dtype: moeforge_dsl::ir::DType) -> f32 {
    use moeforge_dsl::ir::DType;
    match dtype {
        DType::Bf16 => {
            let lo = f32::from_bits(x.to_bits() & 0xFFFF_0000);
            if lo == x {
                return x;
            }
            let hi = f32::from_bits((x.to_bits() & 0xFFFF_0000) + 0x1_0000);
            let (dl, dh) = (x as f64 - lo as f64, hi as f64 - x as f64);
            if dl < dh || (dl == dh && lo.to_bits() & 0x1_0000 == 0) {
                lo
            } else {
                hi
            }
        }
        DType::F16 => {
            let v = x as f64;
            if v == 0.0 {
                return 0.0;
            }
            let q = if v < 2f64.powi(-14) {
                2f64.powi(-24)
            } else {
                2f64.powi(v.log2().floor() as i32 - 10)
            };
            let n = v / q;
            let (f, frac) = (n.floor(), n - n.floor());
            let m = if frac > 0.5 || (frac == 0.5 && f % 2.0 != 0.0) {
                f + 1.0
            } else {
                f
            };
            (m * q).min(65504.0) as f32
        }
        _ => x,
    }
}

/// Group-wise INT4 of a row-major `[rows, k]` tensor: what [`int4_group`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct Int4 {
    /// u4 codes, two per byte (element 2j in the low nibble), row-major `[rows, k]`.
    pub codes: Vec<u8>,
    /// The scales' values (each exactly a value of the scale dtype), `[rows, k/group]`.
    pub scales: Vec<f32>,
    /// The zero points (8 for symmetric groups), one per group, unpacked, `[rows, k/group]`.
    pub zeros: Vec<u8>,
}

impl Int4 {
    /// The zero points packed as the `zeros` param stores them (two per byte, low nibble first).
    pub fn packed_zeros(&self) -> Vec<u8> {
        self.zeros
            .chunks(2)
            .map(|p| p[0] | (p.get(1).copied().unwrap_or(0) << 4))
            .collect()
    }
}

/// Group-wise INT4 (W4A16, GPTQ/AWQ style; README, "Group-wise INT4"), per `group` consecutive
/// elements of each `k`-long row:
/// * symmetric: `amax = max |x|`, `s = R(amax / 7)`, `z = 8`;
/// * asymmetric: `lo = min(min x, 0)`, `hi = max(max x, 0)`, `s = R((hi - lo) / 15)`,
///   `z = clamp(rne(-lo / s), 0, 15)`;
///
/// where `R` rounds to the scale dtype ([`round_scale`]) and a scale that is 0 becomes 1; then
/// `q = clamp(rne(x / s) + z, 0, 15)` (f32 division, correctly rounded; `rne` half to even).
/// Dequantization is `(q - z) * s`.
pub fn int4_group(
    x: &[f32],
    k: usize,
    group: usize,
    zero_point: bool,
    scale: moeforge_dsl::ir::DType,
) -> Int4 {
    let mut nib: Vec<u8> = Vec::with_capacity(x.len());
    let mut scales = Vec::new();
    let mut zeros = Vec::new();
    for row in x.chunks(k) {
        for g in row.chunks(group) {
            let (s32, lo) = if zero_point {
                let lo = g.iter().fold(0f32, |a, &v| a.min(v));
                let hi = g.iter().fold(0f32, |a, &v| a.max(v));
                ((hi - lo) / 15.0, lo)
            } else {
                (amax(g) / 7.0, 0.0)
            };
            let mut s = round_scale(s32, scale);
            if s == 0.0 {
                s = 1.0;
            }
            let z = if zero_point {
                (-lo / s).round_ties_even().clamp(0.0, 15.0)
            } else {
                8.0
            };
            scales.push(s);
            zeros.push(z as u8);
            nib.extend(
                g.iter()
                    .map(|&v| ((v / s).round_ties_even() + z).clamp(0.0, 15.0) as u8),
            );
        }
    }
    let codes = nib
        .chunks(2)
        .map(|p| p[0] | (p.get(1).copied().unwrap_or(0) << 4))
        .collect();
    Int4 {
        codes,
        scales,
        zeros,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_examples() {
        assert_eq!(e4m3_from_f32(1.0), 0x38);
        assert_eq!(e4m3_from_f32(448.0), 0x7E);
        assert_eq!(e4m3_from_f32(112.0), 0x6E);
        assert_eq!(e4m3_from_f32(2f32.powi(-9)), 0x01);
        assert_eq!(e4m3_from_f32(464.0), 0x7E); // clamped first
        assert_eq!(e4m3_from_f32(-1.0), 0xB8);
    }

    #[test]
    fn e2m1_ties_go_to_even() {
        let cases = [
            (0.25, 0),
            (0.75, 2),
            (1.25, 2),
            (1.75, 4),
            (2.5, 4),
            (3.5, 6),
            (5.0, 6),
            (6.0, 7),
        ];
        for (x, c) in cases {
            assert_eq!(e2m1_from_f32(x), c, "{x}");
        }
        assert_eq!(e2m1_from_f32(-0.01), 8);
    }

    #[test]
    fn nvfp4_worked_example() {
        // SPEC §4: block [3, -1.3, 0.4, 0.125, -0.01, 0...], tensor amax 12 -> gs 224.
        let mut x = vec![0f32; 32];
        x[..5].copy_from_slice(&[3.0, -1.3, 0.4, 0.125, -0.01]);
        x[16] = 12.0;
        let (gs, _) = nvfp4_global(&x);
        assert_eq!(gs, 224.0);
        let (packed, scales) = nvfp4_quantize(&x, 32, gs);
        assert_eq!(&packed[..4], &[0xD7, 0x02, 0x08, 0x00]);
        assert_eq!(scales[0], 0x6E);
        let deq: Vec<f32> = (0..5)
            .map(|i| {
                e2m1_to_f32((packed[i / 2] >> (4 * (i % 2))) & 0xF) * e4m3_to_f32(scales[0]) / gs
            })
            .collect();
        assert_eq!(deq, vec![3.0, -1.5, 0.5, 0.0, -0.0]);
    }

    /// Group-wise INT8's worked example (README, "Group-wise INT8"), groups of 4: a group whose
    /// amax is `127 * 2^-4` (scale `2^-4`, a tie `0.5` rounding to even), an all-zero group
    /// (scale 1), and one of amax 2 (scale `RN(2/127)`).
    #[test]
    fn int8_group_worked_example() {
        let x = [
            7.9375, -1.0, 0.03125, 0.09375, //
            0.0, 0.0, 0.0, 0.0, //
            -2.0, 1.5, 0.5, -0.25,
        ];
        let (q, s) = int8_per_group(&x, 4);
        assert_eq!(s, vec![0.0625, 1.0, 2.0f32 / 127.0]);
        assert_eq!(s[2].to_bits(), 0x3C81_0204);
        assert_eq!(
            q,
            vec![0x7F, 0xF0, 0x00, 0x02, 0, 0, 0, 0, 0x81, 0x5F, 0x20, 0xF0]
        );
        // Per row (SPEC §8) is the one-group case.
        assert_eq!(int8_per_row(&x, 12), int8_per_group(&x, 12));
    }

    /// Group-wise FP8's worked example (README, "Group-wise FP8"), groups of 4: a group of amax
    /// 448 (scale 1), an all-zero group (scale 1), and a tiny group whose scale is the floor
    /// `1 / (448 * 512)`.
    #[test]
    fn fp8_group_worked_example() {
        let x = [
            448.0, -1.0, 0.5, 3.25, //
            0.0, 0.0, 0.0, 0.0, //
            1e-6, 0.0, 0.0, 0.0,
        ];
        let (q, s) = fp8_per_group(&x, 4);
        assert_eq!(s[..2], [1.0, 1.0]);
        assert_eq!(s[2].to_bits(), 0x3692_4925);
        assert_eq!(q, vec![0x7E, 0xB8, 0x30, 0x45, 0, 0, 0, 0, 0x27, 0, 0, 0]);
        // Per channel is the one-group case.
        assert_eq!(fp8_per_channel(&x, 12), fp8_per_group(&x, 12));
    }

    /// README "Group-wise INT4", worked example: two symmetric groups of 8 with bf16 scales (the
    /// first with an exact scale and ties, the second with a scale rounded to bf16), and one
    /// asymmetric group.
    #[test]
    #[allow(clippy::excessive_precision)] // exact binary fractions, written out in full
    fn int4_worked_example() {
        use moeforge_dsl::ir::DType;
        let x = [
            3.5, -1.25, 0.25, 0.75, -3.5, 1.0, 0.0, -0.125, //
            1.0, -0.3, 0.6, 0.1, 0.0, 0.2, -0.2, 0.45,
        ];
        let q = int4_group(&x, 16, 8, false, DType::Bf16);
        assert_eq!(q.scales, vec![0.5, 0.142578125]);
        assert_eq!(q.zeros, vec![8, 8]);
        assert_eq!(
            q.codes,
            vec![0x6F, 0xA8, 0xA1, 0x88, 0x6F, 0x9C, 0x98, 0xB7]
        );
        let deq: Vec<f32> = (0..16)
            .map(|i| {
                let c = (q.codes[i / 2] >> (4 * (i % 2))) & 0xF;
                (f32::from(c) - 8.0) * q.scales[i / 8]
            })
            .collect();
        assert_eq!(
            deq,
            vec![
                3.5,
                -1.0,
                0.0,
                1.0,
                -3.5,
                1.0,
                0.0,
                0.0, //
                0.998046875,
                -0.28515625,
                0.5703125,
                0.142578125,
                0.0,
                0.142578125,
                -0.142578125,
                0.427734375,
            ]
        );
        let a = [-1.0, 0.2, 2.0, 3.3, -0.6, 1.4, 0.0, 2.5];
        let q = int4_group(&a, 8, 8, true, DType::Bf16);
        assert_eq!(q.scales, vec![0.287109375]);
        assert_eq!(q.zeros, vec![3]);
        assert_eq!(q.packed_zeros(), vec![0x03]);
        assert_eq!(q.codes, vec![0x40, 0xEA, 0x81, 0xC3]);
        let deq: Vec<f32> = (0..8)
            .map(|i| {
                let c = (q.codes[i / 2] >> (4 * (i % 2))) & 0xF;
                (f32::from(c) - 3.0) * q.scales[0]
            })
            .collect();
        assert_eq!(
            deq,
            vec![
                -0.861328125,
                0.287109375,
                2.009765625,
                3.158203125,
                -0.57421875,
                1.435546875,
                0.0,
                2.583984375
            ]
        );
        // f16 and f32 scales of the second symmetric group: 1/7 rounded to f16, and as it is.
        let g = &x[8..];
        assert_eq!(
            int4_group(g, 8, 8, false, DType::F16).scales,
            vec![0.142822265625]
        );
        assert_eq!(
            int4_group(g, 8, 8, false, DType::F32).scales,
            vec![1.0 / 7.0]
        );
        // An all-zero group: scale 1, every code the zero point.
        let z = int4_group(&[0.0; 8], 8, 8, false, DType::Bf16);
        assert_eq!((z.scales, z.codes), (vec![1.0], vec![0x88; 4]));
    }

    #[test]
    #[allow(clippy::excessive_precision)]
    fn scale_rounding_matches_the_formats() {
        use moeforge_dsl::ir::DType;
        // bf16: ties to even at the 16-bit boundary.
        assert_eq!(round_scale(f32::from_bits(0x3F80_8000), DType::Bf16), 1.0);
        assert_eq!(
            round_scale(f32::from_bits(0x3F81_8000), DType::Bf16),
            f32::from_bits(0x3F82_0000)
        );
        // f16: 1 + 2^-11 ties to 1, 1 + 3 * 2^-11 to 1 + 2^-9; the subnormal step 2^-24; saturation.
        assert_eq!(round_scale(1.0 + 2f32.powi(-11), DType::F16), 1.0);
        assert_eq!(
            round_scale(1.0 + 3.0 * 2f32.powi(-11), DType::F16),
            1.0 + 2f32.powi(-9)
        );
        assert_eq!(
            round_scale(1.5 * 2f32.powi(-24), DType::F16),
            2f32.powi(-23)
        );
        assert_eq!(round_scale(0.5 * 2f32.powi(-24), DType::F16), 0.0);
        assert_eq!(round_scale(1e6, DType::F16), 65504.0);
    }

    #[test]
    fn fp8_per_tensor_example() {
        // SPEC §5: amax 3.5 -> scale 2^-7; [3.5, -1, .01, .3] -> [448, -128, 1.25, 40].
        let (q, s) = fp8_per_tensor(&[3.5, -1.0, 0.01, 0.3]);
        assert_eq!(s, 2f32.powi(-7));
        let v: Vec<f32> = q.iter().map(|b| e4m3_to_f32(*b)).collect();
        assert_eq!(v, vec![448.0, -128.0, 1.25, 40.0]);
    }
}

#[cfg(test)]
mod e4m3_table_tests {
    /// The table holds the formula's value for every byte, bit for bit (NaN where it is NaN).
    #[test]
    fn the_e4m3_table_is_the_formula() {
        for b in 0..=255u8 {
            let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
            let e = (b >> 3) & 0xF;
            let m = (b & 7) as f32;
            let want = if e == 0xF && b & 7 == 7 {
                f32::NAN
            } else if e == 0 {
                s * m * 2f32.powi(-9)
            } else {
                s * (1.0 + m / 8.0) * 2f32.powi(e as i32 - 7)
            };
            let have = super::e4m3_to_f32(b);
            if want.is_nan() {
                assert!(have.is_nan(), "{b:#04x}");
            } else {
                assert_eq!(have.to_bits(), want.to_bits(), "{b:#04x}");
            }
        }
        assert_eq!(super::e4m3_to_f32(0x7E), 448.0);
        assert_eq!(super::e4m3_to_f32(0x01), 2f32.powi(-9));
    }
}
