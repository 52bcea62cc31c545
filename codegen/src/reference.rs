//! SPEC's formulas in plain Rust, written independently of the kernel IR (different algorithms: the
//! E4M3 conversion searches the code table, E2M1 uses SPEC's threshold table): the oracle the
//! interpreter and both backends are tested against, byte for byte.

/// Value of an E4M3 (`float8_e4m3fn`) byte; NaN for `0x7F`/`0xFF`.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = (b >> 3) & 0xF;
    let m = (b & 7) as f32;
    if e == 0xF && b & 7 == 7 {
        return f32::NAN;
    }
    if e == 0 {
        s * m * 2f32.powi(-9)
    } else {
        s * (1.0 + m / 8.0) * 2f32.powi(e as i32 - 7)
    }
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
    let mut q = Vec::with_capacity(x.len());
    let mut s = Vec::new();
    for row in x.chunks(k) {
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

    #[test]
    fn fp8_per_tensor_example() {
        // SPEC §5: amax 3.5 -> scale 2^-7; [3.5, -1, .01, .3] -> [448, -128, 1.25, 40].
        let (q, s) = fp8_per_tensor(&[3.5, -1.0, 0.01, 0.3]);
        assert_eq!(s, 2f32.powi(-7));
        let v: Vec<f32> = q.iter().map(|b| e4m3_to_f32(*b)).collect();
        assert_eq!(v, vec![448.0, -128.0, 1.25, 40.0]);
    }
}
