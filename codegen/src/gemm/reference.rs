//! The host reference of the grouped (MoE) GEMM: `Y[rows of e] = X[rows of e] · W[e]^T` evaluated in
//! f64 over the same quantized operands the GPU reads (SPEC §9), the activation quantization the FP8
//! variants feed it, and SPEC §9's comparison metric for the GPU-vs-host bound.
//!
//! Layouts (row-major, as the kernels read them): `X [T, K]` with its rows sorted by expert, expert
//! `e` owning rows `offsets[e] .. offsets[e + 1]` ([`Grouped`]); `W [E, N, K]` (`W[e]` is `[N, K]`,
//! K-major); `Y [T, N]`. Every product of two quantized operands is exact in f64, and the sums are
//! f64, so the reference is the formula up to f64 rounding; the per-element accumulation order is
//! ascending K (for `fp8_block128`: ascending within each 128-deep slice, then the slices ascending).
//!
//! The E4M3 conversions are [`crate::reference`]'s (the table search and the SPEC §5 quantizers);
//! only bf16, which that module does not have, is converted here.

use crate::reference::{e4m3_from_f32, e4m3_to_f32, fp8_block128, fp8_per_channel};
use crate::{Error, Result};

/// The K depth of one `fp8_block128` scale slice, and the side of a weight scale block.
pub const BLOCK: usize = 128;

/// SPEC §9's accuracy bound: `||out - ref||_F / ||ref||_F <= 1e-2`.
pub const SPEC_BOUND: f64 = 1e-2;

/// The grouped problem: per-expert row offsets (exclusive prefix sums of the row counts), N and K.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grouped {
    offsets: Vec<usize>,
    n: usize,
    k: usize,
}

impl Grouped {
    /// Experts with `rows[e]` rows each (in the order `X` is sorted), `n` outputs, depth `k`.
    pub fn new(rows: &[usize], n: usize, k: usize) -> Grouped {
        let mut offsets = Vec::with_capacity(rows.len() + 1);
        let mut off = 0usize;
        offsets.push(0);
        for r in rows {
            off += r;
            offsets.push(off);
        }
        Grouped { offsets, n, k }
    }

    /// Number of experts E.
    pub fn experts(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Total rows T of `X` and `Y`.
    pub fn rows(&self) -> usize {
        self.offsets[self.experts()]
    }

    /// The row offsets (`E + 1` entries).
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// N, the output columns (rows of each `W[e]`).
    pub fn n(&self) -> usize {
        self.n
    }

    /// K, the reduced depth.
    pub fn k(&self) -> usize {
        self.k
    }

    /// `ceil(K / 128)`: the scale slices along K.
    pub fn k_blocks(&self) -> usize {
        self.k.div_ceil(BLOCK)
    }

    /// `ceil(N / 128)`: the weight scale blocks along N.
    pub fn n_blocks(&self) -> usize {
        self.n.div_ceil(BLOCK)
    }

    /// `Y[t, c] = f(e, t, c)` for every expert `e`, its rows `t` and every column `c`.
    fn map(&self, mut f: impl FnMut(usize, usize, usize) -> f64) -> Vec<f64> {
        let mut y = Vec::with_capacity(self.rows() * self.n);
        for e in 0..self.experts() {
            for t in self.offsets[e]..self.offsets[e + 1] {
                for c in 0..self.n {
                    y.push(f(e, t, c));
                }
            }
        }
        y
    }
}

fn check_len(name: &str, got: usize, elems: usize, bytes_per: usize) -> Result<()> {
    if got != elems {
        return Err(Error::BufferSize {
            name: name.into(),
            expected: elems * bytes_per,
            got: got * bytes_per,
        });
    }
    Ok(())
}

fn check_operands(g: &Grouped, x: usize, w: usize, bytes_per: usize) -> Result<()> {
    check_len("x", x, g.rows() * g.k, bytes_per)?;
    check_len("w", w, g.experts() * g.n * g.k, bytes_per)
}

/// Group-wise INT4 weights (W4A16, README "Group-wise INT4") as the kernels read them: `codes`
/// `[E, N, K]` u4 (two per byte, element 2j in the low nibble), `scales` `[E, N, K/group]` (the
/// scales' values, each exactly a value of its dtype), and `zeros` `[E, N, K/group]` u4 packed the
/// same way (`None`: symmetric, every zero point 8).
#[derive(Debug, Clone, Copy)]
pub struct Int4Weights<'a> {
    /// The packed u4 codes.
    pub codes: &'a [u8],
    /// The scales' values.
    pub scales: &'a [f32],
    /// The packed u4 zero points of an asymmetric quantization.
    pub zeros: Option<&'a [u8]>,
    /// Elements per group along K.
    pub group: usize,
}

/// Nibble `i` of a u4 array packed two per byte.
fn nibble(b: &[u8], i: usize) -> u8 {
    (b[i / 2] >> (4 * (i % 2))) & 0xF
}

impl Int4Weights<'_> {
    fn check(&self, g: &Grouped) -> Result<()> {
        let groups = if self.group > 0 && g.k.is_multiple_of(self.group) {
            g.k / self.group
        } else {
            return Err(Error::BufferSize {
                name: "int4 group".into(),
                expected: self.group,
                got: g.k,
            });
        };
        let n = g.experts() * g.n;
        check_len("codes", self.codes.len() * 2, n * g.k, 1)?;
        check_len("scales", self.scales.len(), n * groups, 4)?;
        if let Some(z) = self.zeros {
            check_len("zeros", z.len(), (n * groups).div_ceil(2), 1)?;
        }
        Ok(())
    }

    /// `(q - z)` of element `(e, c, k)` (an integer in [-15, 15], exact in bf16) and its group's
    /// scale.
    fn at(&self, g: &Grouped, e: usize, c: usize, k: usize) -> (f64, f64) {
        let row = e * g.n + c;
        let gi = row * (g.k / self.group) + k / self.group;
        let z = self.zeros.map_or(8, |z| nibble(z, gi));
        let q = nibble(self.codes, row * g.k + k);
        (f64::from(q) - f64::from(z), f64::from(self.scales[gi]))
    }
}

/// The dequantized weight `W[e, c, k] = (q - z) * s` of group-wise INT4, `[E, N, K]`, in f64 (exact:
/// a small integer times an f32).
pub fn int4_dequant(g: &Grouped, w: &Int4Weights<'_>) -> Result<Vec<f64>> {
    w.check(g)?;
    let mut out = Vec::with_capacity(g.experts() * g.n * g.k);
    for e in 0..g.experts() {
        for c in 0..g.n {
            for k in 0..g.k {
                let (d, s) = w.at(g, e, c, k);
                out.push(d * s);
            }
        }
    }
    Ok(out)
}

/// (d) W4A16, group-wise INT4 weights and bf16 activations, the way the GEMM is to compute it:
/// `q - z` is exact in bf16 and feeds the bf16 tensor cores; each group's partial sum is scaled by
/// its `s` and added to the accumulator, groups in ascending order:
/// `Y[t, c] = sum_j s[e, c, j] * (sum_{k in group j} X[t, k] (q[e, c, k] - z[e, c, j]))`,
/// all in f64 (so equal, up to f64 rounding, to `X · deq(W)^T` with [`int4_dequant`]). `x` is
/// `[T, K]` as bf16 bits.
pub fn gemm_int4(g: &Grouped, x: &[u16], w: &Int4Weights<'_>) -> Result<Vec<f64>> {
    check_len("x", x.len(), g.rows() * g.k, 2)?;
    w.check(g)?;
    let (k, gs) = (g.k, w.group);
    Ok(g.map(|e, t, c| {
        let xr = &x[t * k..(t + 1) * k];
        (0..k / gs).fold(0.0, |acc, j| {
            let mut part = 0.0;
            let mut s = 0.0;
            for (kk, xv) in xr.iter().enumerate().skip(j * gs).take(gs) {
                let (d, sc) = w.at(g, e, c, kk);
                part += bf16_to_f32(*xv) as f64 * d;
                s = sc;
            }
            acc + part * s
        })
    }))
}

/// bf16 bits of an f32, round to nearest even (NaN stays a quiet NaN of the same sign).
pub fn bf16_from_f32(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x0040;
    }
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1));
    (rounded >> 16) as u16
}

/// The f32 value of bf16 bits (exact).
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// One weight of the W4A16 GEMM's operand ([`super::ws::Operands::W4Bf16`]) as its kernel
/// multiplies it, before the per-expert factor: `code` (a nibble) with its group's `scale` element
/// (an E4M3 or E8M0 byte, bf16 bits, or bf16 bits and a zero point):
/// * E2M1 with E4M3: `e2m1(code) * e4m3(scale) * 2^-8` (exact; the factor carries the `2^8`);
/// * E2M1 with E8M0: `e2m1(code) * 2^(scale - 127)` (exact for bytes up to 128);
/// * U4 with bf16: `(code - 8) * s` rounded to bf16 (once);
/// * U4 with bf16 and zero points (`scale` a [`super::ws::GroupScale::Bf16Zero`] element: `s` in
///   bits 15..0, bf16 `-(128 + z)` in bits 31..16): `(code - z) * s` rounded to bf16 (once); NaN
///   for high bits that are no zero point.
pub fn w4_weight(w: super::ws::W4, code: u8, scale: u32) -> f64 {
    use super::ws::{GroupScale, W4Codes};
    match (w.codes, w.scale) {
        (W4Codes::E2m1, GroupScale::E4m3) => {
            f64::from(crate::reference::e2m1_to_f32(code))
                * f64::from(crate::reference::e4m3_to_f32(scale as u8))
                / 256.0
        }
        (W4Codes::E2m1, _) => {
            f64::from(crate::reference::e2m1_to_f32(code))
                * 2f64.powi(i32::from((scale & 0xFF) as u8) - 127)
        }
        (W4Codes::U4, s) => {
            let z = match s {
                GroupScale::Bf16Zero => match GroupScale::zero_point_of((scale >> 16) as u16) {
                    Some(z) => z,
                    None => return f64::NAN,
                },
                _ => 8,
            };
            // (q - z) has at most 4 significant bits and s 8: the f32 product is exact.
            let v = (f32::from(code & 0xF) - f32::from(z)) * bf16_to_f32(scale as u16);
            f64::from(bf16_to_f32(bf16_from_f32(v)))
        }
    }
}

/// Where the W4A16 GEMM's operand keeps the code of element `x` of a row (K a multiple of 64): its
/// byte offset in the row and its nibble (0 = bits 3..0), for U4 codes. The kernel's order: each
/// 64-deep k-tile of a row is 32 bytes; fragment thread `c` (`l & 3`) reads bytes `8c..8c+8` as
/// two words, word `w` holding k16 steps `2w` and `2w + 1`; pair `p = 2 (s % 2) + h` of a word
/// (`h` = 0 for K `16s + 2c`, 1 for `16s + 8 + 2c`) has its low element's code in nibble `3 - p`
/// and its high element's in nibble `7 - p`, so that the kernel extracts pair `p` from the word
/// shifted right by `4 (3 - p)` with one `lop3`. E2M1 codes use the same words but place their
/// bits apart ([`w4_kernel_bits`]).
pub fn w4_kernel_place(x: usize) -> (usize, u32) {
    let (word, p, hi) = w4_kernel_word(x);
    let nib = if hi == 0 { 3 - p } else { 7 - p };
    (word + (nib / 2) as usize, nib % 2)
}

/// Where element `x` of a row lands in the register-A fragments (GEMM.md §1.6): its 64-deep
/// k-tile, k16 step `s`, half `h` (0 for K `16s + 2c`, 1 for `16s + 8 + 2c`), fragment thread
/// `c = l & 3` and whether it is the high element of its pair.
fn frag_coords(x: usize) -> (usize, usize, usize, usize, usize) {
    let (tile, e) = (x / 64, x % 64);
    let (s, r) = (e / 16, e % 16);
    let (h, r) = (r / 8, r % 8);
    let (c, hi) = (r / 2, r % 2);
    (tile, s, h, c, hi)
}

/// The byte offset (in its row) of the word that holds element `x`, its pair `p` in the word and
/// whether it is the pair's high element (see [`w4_kernel_place`]).
fn w4_kernel_word(x: usize) -> (usize, u32, u32) {
    let (tile, s, h, c, hi) = frag_coords(x);
    let (w, p) = (s / 2, 2 * (s % 2) + h);
    (32 * tile + 8 * c + 4 * w, p as u32, hi as u32)
}

/// The bit (of its word) of E2M1 bit `j` (0 = mantissa, 1 and 2 = exponent, 3 = sign) of the low
/// element of pair `p` (the high element's is 16 higher). The kernel turns pair `p` into the two
/// bf16 `code * 2^-126` (sign at bit 15, exponent and mantissa at bits 8..6) with one mask for
/// pair 0, a shift and a mask for pair 1, and two shifts, a mask and a masked merge for pairs 2
/// and 3 (`crate::gemm::dequant`): the four pairs' bits tile the word.
pub const E2M1_PAIR_BITS: [[u32; 4]; 4] =
    [[6, 7, 8, 15], [3, 4, 5, 12], [9, 10, 11, 14], [0, 1, 2, 13]];

/// Where the W4A16 GEMM's operand keeps each bit of the code of element `x` of a row: for code bit
/// `j` (bit 3 = the sign of E2M1), its byte offset in the row and its bit in that byte. U4 codes
/// keep a nibble ([`w4_kernel_place`]); E2M1 codes put their bits at [`E2M1_PAIR_BITS`] of the
/// same word.
pub fn w4_kernel_bits(codes: super::ws::W4Codes, x: usize) -> [(usize, u32); 4] {
    match codes {
        super::ws::W4Codes::U4 => {
            let (at, nib) = w4_kernel_place(x);
            [0, 1, 2, 3].map(|j| (at, 4 * nib + j))
        }
        super::ws::W4Codes::E2m1 => {
            let (word, p, hi) = w4_kernel_word(x);
            E2M1_PAIR_BITS[p as usize].map(|b| {
                let bit = b + 16 * hi;
                (word + (bit / 8) as usize, bit % 8)
            })
        }
    }
}

/// Where the W8A16 GEMM's operand keeps element `x` of a row: its byte offset in the row, whose
/// length is `K` rounded up to a multiple of 64 (zeros after `K`). The kernel's order: each 64-deep
/// k-tile of a row is 64 bytes; fragment thread `c` (`l & 3`) reads bytes `16c..16c+16` with one
/// 16-byte load, word `s` holding k16 step `s`: its bytes 0 and 2 the pair of K `16s + 2c` (and + 1),
/// bytes 1 and 3 the pair of K `16s + 8 + 2c`, so that each pair is two bytes, `p` and `p + 2`, of
/// one word (one byte permute each, `crate::gemm::dequant`).
pub fn i8_kernel_place(x: usize) -> usize {
    let (tile, s, h, c, hi) = frag_coords(x);
    64 * tile + 16 * c + 4 * s + h + 2 * hi
}

/// Bytes an int8 kernel-order row is padded to a multiple of (its order is per 64-deep k-tile).
pub const I8_ROW_ALIGN: usize = 64;

/// `rows` rows of `k` int8 codes stored row-major rewritten in the kernel's order
/// ([`i8_kernel_place`]): rows of `k` rounded up to [`I8_ROW_ALIGN`] bytes.
pub fn i8_kernel_order(row_major: &[u8], rows: usize, k: usize) -> Vec<u8> {
    let kp = k.next_multiple_of(I8_ROW_ALIGN);
    let places: Vec<usize> = (0..k).map(i8_kernel_place).collect();
    let mut out = vec![0u8; rows * kp];
    for r in 0..rows {
        for (x, &at) in places.iter().enumerate() {
            if let (Some(&b), Some(o)) = (row_major.get(r * k + x), out.get_mut(r * kp + at)) {
                *o = b;
            }
        }
    }
    out
}

/// The code of element `x` of row `r` of a kernel-order int8 operand of rows of `k` codes.
pub fn i8_kernel_code(buf: &[u8], r: usize, x: usize, k: usize) -> u8 {
    buf.get(r * k.next_multiple_of(I8_ROW_ALIGN) + i8_kernel_place(x))
        .copied()
        .unwrap_or(0)
}

/// `rows` rows of `k` 4-bit codes stored row-major (element `2j` in the low nibble of byte `j`)
/// rewritten in the kernel's order for `codes` ([`w4_kernel_bits`]); `k` a multiple of 64.
/// Whole 64-deep k-tiles go through [`w4_tile_table`] (a byte's two codes at once); the rest, and
/// rows `row_major` holds only part of, element by element (bytes it lacks are zero codes).
pub fn w4_kernel_order(
    codes: super::ws::W4Codes,
    row_major: &[u8],
    rows: usize,
    k: usize,
) -> Vec<u8> {
    let rb = k / 2;
    let places: Vec<[(usize, u32); 4]> = (0..k).map(|x| w4_kernel_bits(codes, x)).collect();
    let table = w4_tile_table(codes);
    let mut out = vec![0u8; rows * rb];
    for (r, row) in out.chunks_exact_mut(rb.max(1)).enumerate().take(rows) {
        let src = row_major.get(r * rb..(r + 1) * rb);
        let start = match (src, &table) {
            (Some(src), Some(t)) => {
                for (o, s) in row.chunks_exact_mut(32).zip(src.chunks_exact(32)) {
                    let mut acc = [0u64; 4];
                    for (i, &v) in s.iter().enumerate() {
                        let c = &t[i * 256 + v as usize];
                        for (a, b) in acc.iter_mut().zip(c) {
                            *a |= b;
                        }
                    }
                    for (d, a) in o.chunks_exact_mut(8).zip(acc) {
                        d.copy_from_slice(&a.to_le_bytes());
                    }
                }
                64 * (k / 64)
            }
            _ => 0,
        };
        for (x, bits) in places.iter().enumerate().skip(start) {
            let Some(&b) = row_major.get(r * rb + x / 2) else {
                continue;
            };
            let code = (b >> (4 * (x % 2))) & 0xF;
            for (j, &(at, bit)) in bits.iter().enumerate() {
                if let Some(o) = row.get_mut(at) {
                    *o |= ((code >> j) & 1) << bit;
                }
            }
        }
    }
    out
}

/// For each of the 32 bytes of a 64-deep k-tile of row-major codes (two codes each) and each of
/// its 256 values, that byte's bits placed as [`w4_kernel_bits`] places them in the tile's 32
/// kernel-order bytes, as four little-endian words (index `byte * 256 + value`). `None` if a
/// tile's bits left its 32 bytes (they do not: the kernel's order permutes within a k-tile).
pub fn w4_tile_table(codes: super::ws::W4Codes) -> Option<Vec<[u64; 4]>> {
    let mut t = vec![[0u64; 4]; 32 * 256];
    for i in 0..32 {
        for v in 0..256usize {
            let w = &mut t[i * 256 + v];
            for half in 0..2 {
                let code = (v >> (4 * half)) & 0xF;
                for (j, &(at, bit)) in w4_kernel_bits(codes, 2 * i + half).iter().enumerate() {
                    if at >= 32 {
                        return None;
                    }
                    let b = (((code >> j) & 1) as u64) << (8 * (at % 8) + bit as usize);
                    w[at / 8] |= b;
                }
            }
        }
    }
    Some(t)
}

/// The code of element `x` of row `r` of a kernel-order operand of rows of `k` codes of kind
/// `codes`.
pub fn w4_kernel_code(codes: super::ws::W4Codes, buf: &[u8], r: usize, x: usize, k: usize) -> u8 {
    w4_kernel_bits(codes, x)
        .iter()
        .enumerate()
        .fold(0, |code, (j, &(at, bit))| {
            let b = buf.get(r * (k / 2) + at).map_or(0, |b| (b >> bit) & 1);
            code | b << j
        })
}

/// (a) bf16 x bf16: `Y[t, c] = sum_k X[t, k] W[e, c, k]` in f64. `x` is `[T, K]` and `w` `[E, N, K]`,
/// as bf16 bits. The GPU's f32 output is compared against this; its bf16 output against
/// [`to_bf16`] of it.
pub fn gemm_bf16(g: &Grouped, x: &[u16], w: &[u16]) -> Result<Vec<f64>> {
    check_operands(g, x.len(), w.len(), 2)?;
    let k = g.k;
    Ok(g.map(|e, t, c| {
        let xr = &x[t * k..(t + 1) * k];
        let wr = &w[(e * g.n + c) * k..(e * g.n + c + 1) * k];
        xr.iter().zip(wr).fold(0.0, |acc, (a, b)| {
            acc + bf16_to_f32(*a) as f64 * bf16_to_f32(*b) as f64
        })
    }))
}

/// The activation scale of the per-tensor / per-token FP8 GEMM.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ActScale<'a> {
    /// One static scale for every row (the checkpoint's `*_input_scale`).
    PerTensor(f32),
    /// One scale per row of `X` (`[T]`, dynamic per-token quantization).
    PerToken(&'a [f32]),
}

fn e4m3_dot(x: &[u8], w: &[u8]) -> f64 {
    x.iter().zip(w).fold(0.0, |acc, (a, b)| {
        acc + e4m3_to_f32(*a) as f64 * e4m3_to_f32(*b) as f64
    })
}

/// (b) e4m3 x e4m3 with the scales applied to the accumulator (SPEC §9 `fp8_per_tensor`):
/// `Y[t, c] = (sum_k q_x[t, k] q_w[e, c, k]) * s_x * s_w[e]`, all in f64. `xq` is `[T, K]` and `wq`
/// `[E, N, K]` (E4M3 codes), `w_scale` `[E]` (the per-expert weight scale).
pub fn gemm_fp8(
    g: &Grouped,
    xq: &[u8],
    x_scale: ActScale<'_>,
    wq: &[u8],
    w_scale: &[f32],
) -> Result<Vec<f64>> {
    check_operands(g, xq.len(), wq.len(), 1)?;
    check_len("w_scale", w_scale.len(), g.experts(), 4)?;
    if let ActScale::PerToken(s) = x_scale {
        check_len("x_scale", s.len(), g.rows(), 4)?;
    }
    let k = g.k;
    Ok(g.map(|e, t, c| {
        let acc = e4m3_dot(
            &xq[t * k..(t + 1) * k],
            &wq[(e * g.n + c) * k..(e * g.n + c + 1) * k],
        );
        let sx = match x_scale {
            ActScale::PerTensor(s) => s,
            ActScale::PerToken(s) => s[t],
        };
        acc * sx as f64 * w_scale[e] as f64
    }))
}

/// (c) `fp8_block128` (SPEC §9, DeepGEMM's promotion): each 128-deep K slice `j` is accumulated on
/// its own, rescaled by `s_x[t, j] * s_w[e, c / 128, j]` and added to the accumulator, slices in
/// ascending order:
/// `Y[t, c] = sum_j (sum_{k in slice j} q_x[t, k] q_w[e, c, k]) * s_x[t, j] * s_w[e, c/128, j]`.
/// `xq` is `[T, K]`, `x_scale` `[T, ceil(K/128)]` (1x128 groups), `wq` `[E, N, K]`, `w_scale`
/// `[E, ceil(N/128), ceil(K/128)]` (128x128 blocks; vLLM's `*_weight_scale_inv`). A K (or N) that is
/// not a multiple of 128 has a short last slice (block).
pub fn gemm_fp8_block128(
    g: &Grouped,
    xq: &[u8],
    x_scale: &[f32],
    wq: &[u8],
    w_scale: &[f32],
) -> Result<Vec<f64>> {
    gemm_fp8_block128_rows(g, xq, x_scale, wq, w_scale, |c| c)
}

/// [`gemm_fp8_block128`] where weight row `c` of the GEMM takes the scale block of row
/// `scale_row(c)` (`< N`): the fused SiLU epilogue's paired rows take their `[gate; up]` row's
/// block (`ws::paired_row`), the scales staying in `[E, ceil(N/128), ceil(K/128)]` order.
pub fn gemm_fp8_block128_rows(
    g: &Grouped,
    xq: &[u8],
    x_scale: &[f32],
    wq: &[u8],
    w_scale: &[f32],
    scale_row: impl Fn(usize) -> usize,
) -> Result<Vec<f64>> {
    check_operands(g, xq.len(), wq.len(), 1)?;
    let (kb, nb) = (g.k_blocks(), g.n_blocks());
    check_len("x_scale", x_scale.len(), g.rows() * kb, 4)?;
    check_len("w_scale", w_scale.len(), g.experts() * nb * kb, 4)?;
    if let Some(c) = (0..g.n).find(|&c| scale_row(c) >= g.n) {
        return Err(Error::Unsupported {
            param: "w_scale".into(),
            what: format!(
                "GEMM row {c} taking the scale block of row {} of N = {}",
                scale_row(c),
                g.n
            ),
        });
    }
    let k = g.k;
    Ok(g.map(|e, t, c| {
        let mut acc = 0.0f64;
        for j in 0..kb {
            let ks = j * BLOCK..((j + 1) * BLOCK).min(k);
            let slice = e4m3_dot(
                &xq[t * k + ks.start..t * k + ks.end],
                &wq[(e * g.n + c) * k + ks.start..(e * g.n + c) * k + ks.end],
            );
            let sx = x_scale[t * kb + j] as f64;
            let sw = w_scale[(e * nb + scale_row(c) / BLOCK) * kb + j] as f64;
            acc += slice * sx * sw;
        }
        acc
    }))
}

/// Dynamic per-token activation quantization (SPEC §9 `fp8_per_tensor` without a checkpoint scale,
/// §5 per-channel online): per row of `k` values `s_t = max(amax_t / 448, 1/(448*512))`, 1.0 for an
/// all-zero row, `q = e4m3(clamp(x / s_t, ±448))`. Returns codes `[T, K]` and scales `[T]`.
pub fn quantize_per_token(x: &[f32], k: usize) -> Result<(Vec<u8>, Vec<f32>)> {
    check_rows(x.len(), k)?;
    Ok(fp8_per_channel(x, k))
}

/// Static per-tensor activation quantization with the checkpoint's scale (SPEC §9 `fp8_per_tensor`,
/// with moeforge's choice for per-tensor FP8: multiply by the correctly rounded `1/scale`):
/// `q = e4m3(clamp(x * (1/scale), ±448))`.
pub fn quantize_per_tensor(x: &[f32], scale: f32) -> Vec<u8> {
    let inv = 1.0 / scale;
    x.iter()
        .map(|v| e4m3_from_f32((v * inv).clamp(-448.0, 448.0)))
        .collect()
}

/// Per-token 1x128-group activation quantization (SPEC §9 `fp8_block128`): per row and per 128
/// consecutive columns `s = max(amax_group, 1e-4) / 448`, `q = e4m3(x * (1/s))` (the same formula as
/// the 128x128 weight blocks, a group being a 1x128 block; an all-zero group gets `1e-4/448` and zero
/// codes). Returns codes `[T, K]` and scales `[T, ceil(K/128)]`.
pub fn quantize_per_group128(x: &[f32], k: usize) -> Result<(Vec<u8>, Vec<f32>)> {
    check_rows(x.len(), k)?;
    let mut q = Vec::with_capacity(x.len());
    let mut s = Vec::with_capacity(x.len() / k.max(1) * k.div_ceil(BLOCK));
    for row in x.chunks(k) {
        let (rq, rs) = fp8_block128(row, 1, k);
        q.extend(rq);
        s.extend(rs);
    }
    Ok((q, s))
}

fn check_rows(len: usize, k: usize) -> Result<()> {
    if k == 0 || !len.is_multiple_of(k) {
        return Err(Error::BufferSize {
            name: "x".into(),
            expected: len.div_ceil(k.max(1)) * k * 4,
            got: len * 4,
        });
    }
    Ok(())
}

/// The reference rounded to f32 (what the GPU's f32 output holds at best).
pub fn to_f32(y: &[f64]) -> Vec<f32> {
    y.iter().map(|v| *v as f32).collect()
}

/// The reference rounded to bf16 bits, through f32 as the GPU's epilogue rounds its f32 accumulator.
pub fn to_bf16(y: &[f64]) -> Vec<u16> {
    y.iter().map(|v| bf16_from_f32(*v as f32)).collect()
}

/// SPEC §9's metric: `||out - ref||_F / ||ref||_F` in f64. A zero reference gives 0 when `out` is
/// zero too, infinity otherwise; any NaN in `out` gives NaN (which no bound accepts).
pub fn rel_frobenius(out: &[f32], reference: &[f64]) -> Result<f64> {
    check_len("out", out.len(), reference.len(), 4)?;
    let (mut d2, mut r2) = (0.0f64, 0.0f64);
    for (o, r) in out.iter().zip(reference) {
        let d = *o as f64 - r;
        d2 += d * d;
        r2 += r * r;
    }
    Ok(if r2 == 0.0 {
        if d2 == 0.0 {
            0.0
        } else if d2.is_nan() {
            f64::NAN
        } else {
            f64::INFINITY
        }
    } else {
        (d2 / r2).sqrt()
    })
}

/// Whether `out` meets SPEC §9's bound against `reference` (false on NaN).
pub fn within_bound(out: &[f32], reference: &[f64]) -> Result<bool> {
    Ok(rel_frobenius(out, reference)? <= SPEC_BOUND)
}

#[cfg(test)]
mod tests {
    /// The kernel order is a permutation of every k-tile's bits for both kinds of code, and
    /// reading it back gives every code; a thread's 8 bytes hold exactly its fragment elements,
    /// and an E2M1 code stays in the word of the U4 order.
    #[test]
    fn the_kernel_order_permutes_and_reads_back() {
        use super::super::ws::W4Codes;
        let k = 192;
        for kind in [W4Codes::U4, W4Codes::E2m1] {
            let mut places: Vec<(usize, u32)> =
                (0..k).flat_map(|x| w4_kernel_bits(kind, x)).collect();
            places.sort_unstable();
            places.dedup();
            assert_eq!(places.len(), 4 * k, "{kind:?}");
            assert!(places.iter().all(|&(b, n)| b < k / 2 && n < 8));
            let rows = 3;
            let codes: Vec<u8> = (0..rows * k / 2).map(|i| (i * 37 + 11) as u8).collect();
            let ko = w4_kernel_order(kind, &codes, rows, k);
            for r in 0..rows {
                for x in 0..k {
                    let want = (codes[r * k / 2 + x / 2] >> (4 * (x % 2))) & 0xF;
                    assert_eq!(w4_kernel_code(kind, &ko, r, x, k), want, "{kind:?} {r} {x}");
                }
            }
            // A last row held only in part goes element by element: its missing codes are zero.
            let short = &codes[..rows * k / 2 - 5];
            let ks = w4_kernel_order(kind, short, rows, k);
            for x in 0..k {
                let r = rows - 1;
                let want = short
                    .get(r * k / 2 + x / 2)
                    .map_or(0, |b| (b >> (4 * (x % 2))) & 0xF);
                assert_eq!(
                    w4_kernel_code(kind, &ks, r, x, k),
                    want,
                    "{kind:?} short {x}"
                );
            }
            // Thread c's bytes 8c..8c+8 of a tile: K = 16s + 8h + 2c (+1) for every s, h.
            for x in 0..64 {
                let c = (x % 8) / 2;
                for (at, _) in w4_kernel_bits(kind, x) {
                    assert_eq!(at / 8, c, "{x}");
                    assert_eq!(at / 4, w4_kernel_place(x).0 / 4, "{x}");
                }
            }
        }
    }

    /// The int8 kernel order permutes each 64-byte k-tile (a partial last one's elements stay in
    /// it, the padding zero), reads back, and a thread's 16 bytes hold its fragment elements.
    #[test]
    fn the_int8_kernel_order_permutes_and_reads_back() {
        for k in [64usize, 1040, 192] {
            let kp = k.next_multiple_of(64);
            let mut places: Vec<usize> = (0..k).map(i8_kernel_place).collect();
            places.sort_unstable();
            places.dedup();
            assert_eq!(places.len(), k);
            assert!(places.iter().all(|&p| p < kp));
            let rows = 3;
            let codes: Vec<u8> = (0..rows * k).map(|i| (i * 37 + 11) as u8).collect();
            let ko = i8_kernel_order(&codes, rows, k);
            assert_eq!(ko.len(), rows * kp);
            for r in 0..rows {
                for x in 0..k {
                    assert_eq!(
                        i8_kernel_code(&ko, r, x, k),
                        codes[r * k + x],
                        "{k} {r} {x}"
                    );
                }
            }
            // Each element stays in its k-tile, and every byte no element is placed at (a partial
            // last tile's tail, the padding) is zero.
            assert!((0..k).all(|x| i8_kernel_place(x) / 64 == x / 64));
            for r in 0..rows {
                for (at, &b) in ko[r * kp..(r + 1) * kp].iter().enumerate() {
                    if places.binary_search(&at).is_err() {
                        assert_eq!(b, 0, "{k} {r} {at}");
                    }
                }
            }
        }
        // Thread c's bytes 16c..16c+16 of a tile: K = 16s + 8h + 2c (+1); word s has step s.
        for x in 0..64 {
            let (c, s) = ((x % 8) / 2, x / 16);
            assert_eq!(i8_kernel_place(x) / 16, c, "{x}");
            assert_eq!(i8_kernel_place(x) % 16 / 4, s, "{x}");
        }
    }

    /// The E2M1 pair bits tile a word (with the high elements' 16 higher).
    #[test]
    fn the_e2m1_pair_bits_tile_a_word() {
        let mut all: Vec<u32> = E2M1_PAIR_BITS
            .iter()
            .flatten()
            .flat_map(|&b| [b, b + 16])
            .collect();
        all.sort_unstable();
        assert_eq!(all, (0..32).collect::<Vec<_>>());
    }

    use super::*;
    use proptest::prelude::*;

    fn bf(v: &[f32]) -> Vec<u16> {
        v.iter().map(|x| bf16_from_f32(*x)).collect()
    }

    #[test]
    fn bf16_rounding() {
        assert_eq!(bf16_from_f32(1.0), 0x3F80);
        assert_eq!(bf16_from_f32(-2.0), 0xC000);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(bf16_from_f32(1.0 + 2f32.powi(-8)), 0x3F80);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
        assert_eq!(bf16_from_f32(1.0 + 3.0 * 2f32.powi(-8)), 0x3F82);
        assert_eq!(bf16_from_f32(1.0 + 2f32.powi(-8) + 2f32.powi(-20)), 0x3F81);
        assert!(bf16_to_f32(bf16_from_f32(f32::NAN)).is_nan());
        assert_eq!(bf16_from_f32(f32::INFINITY), 0x7F80);
        assert_eq!(bf16_to_f32(0x3FC0), 1.5);
    }

    /// INT4 by hand: one expert, one row, N = 1, K = 4 in groups of 2. Codes [9, 6 | 15, 0]
    /// (bytes 0x69, 0x0F), symmetric (z = 8) with scales [0.5, 0.25], then asymmetric with zero
    /// points [6, 3] (byte 0x36).
    #[test]
    fn int4_by_hand() {
        let g = Grouped::new(&[1], 1, 4);
        let x = bf(&[1.0, 2.0, -1.0, 0.5]);
        let w = Int4Weights {
            codes: &[0x69, 0x0F],
            scales: &[0.5, 0.25],
            zeros: None,
            group: 2,
        };
        // deq = [(9-8)/2, (6-8)/2, (15-8)/4, (0-8)/4] = [0.5, -1, 1.75, -2].
        assert_eq!(int4_dequant(&g, &w).unwrap(), vec![0.5, -1.0, 1.75, -2.0]);
        // 0.5 * (1 - 2*2) + 0.25 * (-7 - 4) = -1.5 - 2.75.
        assert_eq!(gemm_int4(&g, &x, &w).unwrap(), vec![-4.25]);
        let a = Int4Weights {
            zeros: Some(&[0x36]),
            ..w
        };
        // deq = [(9-6)/2, (6-6)/2, (15-3)/4, (0-3)/4] = [1.5, 0, 3, -0.75].
        assert_eq!(int4_dequant(&g, &a).unwrap(), vec![1.5, 0.0, 3.0, -0.75]);
        assert_eq!(gemm_int4(&g, &x, &a).unwrap(), vec![1.5 - 3.0 - 0.375]);
        // A K that the group does not divide is an error.
        let bad = Int4Weights { group: 3, ..w };
        assert!(gemm_int4(&g, &x, &bad).is_err());
    }

    proptest! {
        /// The grouped form (scale on each group's partial sum) equals `X · deq(W)^T`, and the
        /// dequantized weight of the reference quantizer is within half a scale of the weight
        /// (symmetric; asymmetric adds the clamp overshoot `max(0, (hi - lo) - 15 s)`), up to the
        /// f32 rounding of `x / s`.
        #[test]
        fn int4_gemm_equals_dequantized_product(
            seed in any::<u64>(), zp in any::<bool>(), f16 in any::<bool>()
        ) {
            use moeforge_dsl::ir::DType;
            let (n, k, group) = (3usize, 64usize, 16usize);
            let mut st = seed | 1;
            let mut next = || {
                st ^= st << 13;
                st ^= st >> 7;
                st ^= st << 17;
                ((st >> 11) as f64 / (1u64 << 53) as f64 * 8.0 - 4.0) as f32
            };
            let w: Vec<f32> = (0..2 * n * k).map(|_| bf16_to_f32(bf16_from_f32(next()))).collect();
            let x: Vec<u16> = (0..3 * k).map(|_| bf16_from_f32(next())).collect();
            let scale = if f16 { DType::F16 } else { DType::Bf16 };
            let q = crate::reference::int4_group(&w, k, group, zp, scale);
            let zeros = q.packed_zeros();
            let wt = Int4Weights {
                codes: &q.codes,
                scales: &q.scales,
                zeros: zp.then_some(&zeros[..]),
                group,
            };
            let g = Grouped::new(&[1, 2], n, k);
            let deq = int4_dequant(&g, &wt).unwrap();
            for (i, (&v, &d)) in w.iter().zip(&deq).enumerate() {
                let grp = &w[i / group * group..(i / group + 1) * group];
                let s = f64::from(q.scales[i / group]);
                let over = if zp {
                    let lo = grp.iter().fold(0f32, |a, &b| a.min(b)) as f64;
                    let hi = grp.iter().fold(0f32, |a, &b| a.max(b)) as f64;
                    ((hi - lo) - 15.0 * s).max(0.0)
                } else {
                    0.0
                };
                let bound = s / 2.0 + over + f64::from(v.abs()) * 2f64.powi(-24);
                prop_assert!((f64::from(v) - d).abs() <= bound, "element {i}: {v} vs {d}, s {s}");
            }
            let y = gemm_int4(&g, &x, &wt).unwrap();
            let plain = g.map(|e, t, c| {
                (0..k).fold(0.0, |a, kk| {
                    a + bf16_to_f32(x[t * k + kk]) as f64 * deq[(e * n + c) * k + kk]
                })
            });
            for (a, b) in y.iter().zip(&plain) {
                prop_assert!((a - b).abs() <= 1e-9 * (1.0 + b.abs()));
            }
        }

        /// Packing round trip: nibble `i` of the packed codes is element `i` (element 2j in the low
        /// nibble), both for packing by hand and for the reference quantizer (values `c - 8` with a
        /// 7 among them: scale 1, so its codes are `c`).
        #[test]
        fn u4_packing_round_trips(codes in proptest::collection::vec(1u8..16, 1..64)) {
            let mut c = codes.clone();
            c.push(15);
            if c.len() % 2 == 1 {
                c.push(15);
            }
            let packed: Vec<u8> = c.chunks(2).map(|p| p[0] | (p[1] << 4)).collect();
            for (i, &v) in c.iter().enumerate() {
                prop_assert_eq!(nibble(&packed, i), v);
            }
            let xs: Vec<f32> = c.iter().map(|&q| f32::from(q) - 8.0).collect();
            let r = crate::reference::int4_group(
                &xs, xs.len(), xs.len(), false, moeforge_dsl::ir::DType::F32,
            );
            prop_assert_eq!(r.scales, vec![1.0]);
            prop_assert_eq!(r.codes, packed);
        }
    }

    /// Two experts (1 row, 2 rows), N = 2, K = 3, computed by hand.
    #[test]
    fn bf16_by_hand() {
        let g = Grouped::new(&[1, 2], 2, 3);
        let x = bf(&[1.0, 2.0, 3.0, 0.5, -1.0, 0.0, 4.0, 0.25, -2.0]);
        let w = bf(&[
            1.0, 0.0, 0.0, // W[0] row 0
            1.0, 1.0, 1.0, // W[0] row 1
            2.0, -1.0, 0.5, // W[1] row 0
            0.0, 4.0, -3.0, // W[1] row 1
        ]);
        let y = gemm_bf16(&g, &x, &w).unwrap();
        // Row 0 (expert 0): [1, 6]. Row 1 (expert 1): [0.5*2 + -1*-1 + 0, 0 - 4 + 0] = [2, -4].
        // Row 2 (expert 1): [8 - 0.25 - 1, 0 + 1 + 6] = [6.75, 7].
        assert_eq!(y, vec![1.0, 6.0, 2.0, -4.0, 6.75, 7.0]);
        assert_eq!(to_bf16(&[6.75, 1.0 + 2f64.powi(-9)]), vec![0x40D8, 0x3F80]);
    }

    /// e4m3 with a per-token and a per-expert scale, by hand.
    #[test]
    fn fp8_by_hand() {
        let g = Grouped::new(&[1, 1], 1, 2);
        let c = |v: f32| e4m3_from_f32(v);
        let xq = vec![c(2.0), c(-1.5), c(448.0), c(0.0)];
        let wq = vec![c(3.0), c(4.0), c(0.5), c(1.0)];
        // Expert 0: 2*3 - 1.5*4 = 0; expert 1: 448*0.5 + 0 = 224, times the scales.
        let y = gemm_fp8(&g, &xq, ActScale::PerToken(&[2.0, 0.25]), &wq, &[1.0, 0.5]).unwrap();
        assert_eq!(y, vec![0.0, 224.0 * 0.25 * 0.5]);
        let y = gemm_fp8(&g, &xq, ActScale::PerTensor(4.0), &wq, &[3.0, 0.5]).unwrap();
        assert_eq!(y, vec![0.0, 224.0 * 4.0 * 0.5]);
    }

    /// fp8_block128 with K = 256 (two slices) and N = 130 (two weight blocks), by hand.
    #[test]
    fn block128_by_hand() {
        let (n, k) = (130, 256);
        let g = Grouped::new(&[1], n, k);
        let one = e4m3_from_f32(1.0);
        let two = e4m3_from_f32(2.0);
        let xq = vec![one; k];
        let mut wq = vec![one; n * k];
        // Column 129 (second weight block) has code 2 in the second slice.
        for v in &mut wq[129 * k + 128..130 * k] {
            *v = two;
        }
        let x_scale = [2.0, 3.0];
        let w_scale = [5.0, 7.0, 11.0, 13.0]; // [n-block][k-slice]
        let y = gemm_fp8_block128(&g, &xq, &x_scale, &wq, &w_scale).unwrap();
        assert_eq!(y[0], 128.0 * 2.0 * 5.0 + 128.0 * 3.0 * 7.0);
        assert_eq!(y[127], y[0]);
        assert_eq!(y[128], 128.0 * 2.0 * 11.0 + 128.0 * 3.0 * 13.0);
        assert_eq!(y[129], 128.0 * 2.0 * 11.0 + 256.0 * 3.0 * 13.0);
    }

    /// A short last slice (K = 130): slice 1 holds two columns.
    #[test]
    fn block128_ragged_k() {
        let g = Grouped::new(&[2], 1, 130);
        let one = e4m3_from_f32(1.0);
        let y = gemm_fp8_block128(
            &g,
            &[one; 260],
            &[1.0, 10.0, 1.0, 100.0],
            &[one; 130],
            &[1.0, 1.0],
        )
        .unwrap();
        assert_eq!(y, vec![128.0 + 20.0, 128.0 + 200.0]);
    }

    #[test]
    fn activation_quantization() {
        // Per token (SPEC §5): amax 3.5 -> 3.5/448 = 2^-7; an all-zero row gets scale 1 and zero codes;
        // a tiny row gets the floor 1/(448*512).
        let x = [3.5, -1.0, 0.0, 0.0, 0.0, 0.0, 1e-9, 0.0];
        let (q, s) = quantize_per_token(&x, 2).unwrap();
        assert_eq!(s, vec![2f32.powi(-7), 1.0, 1.0, 1.0 / (448.0 * 512.0)]);
        assert_eq!(q[..4], [e4m3_from_f32(448.0), e4m3_from_f32(-128.0), 0, 0]);
        // Per 1x128 group: a row of K = 256 with amax 3.5 then 0; and the second row 1e-5 (clamped).
        let mut x = vec![0f32; 512];
        x[0] = 3.5;
        x[1] = -1.0;
        x[256] = 1e-5;
        let (q, s) = quantize_per_group128(&x, 256).unwrap();
        assert_eq!(
            s,
            vec![3.5 / 448.0, 1e-4 / 448.0, 1e-4 / 448.0, 1e-4 / 448.0]
        );
        assert_eq!(e4m3_to_f32(q[0]), 448.0);
        assert_eq!(e4m3_to_f32(q[1]), -128.0);
        assert!(q[2..256].iter().all(|&b| b == 0));
        assert_eq!(
            e4m3_to_f32(q[256]),
            e4m3_to_f32(e4m3_from_f32(1e-5 / (1e-4 / 448.0)))
        );
        // Static per tensor.
        let q = quantize_per_tensor(&[1.0, -1000.0], 0.5);
        assert_eq!(q, vec![e4m3_from_f32(2.0), e4m3_from_f32(-448.0)]);
        assert!(quantize_per_token(&[1.0; 3], 2).is_err());
        assert!(quantize_per_group128(&[1.0; 3], 0).is_err());
    }

    #[test]
    fn zero_row_experts() {
        let (n, k) = (3, 4);
        let rows = [0, 2, 0, 0, 1, 0];
        let g = Grouped::new(&rows, n, k);
        let x: Vec<u16> = bf(&(0..3 * k).map(|i| i as f32 - 5.0).collect::<Vec<_>>());
        let w: Vec<u16> = bf(&(0..6 * n * k)
            .map(|i| (i % 7) as f32 - 3.0)
            .collect::<Vec<_>>());
        let y = gemm_bf16(&g, &x, &w).unwrap();
        assert_eq!(y.len(), 3 * n);
        // Row 0 and 1 use expert 1, row 2 expert 4: compare with a dense evaluation per row.
        for (t, e) in [(0, 1), (1, 1), (2, 4)] {
            for c in 0..n {
                let want: f64 = (0..k)
                    .map(|kk| {
                        bf16_to_f32(x[t * k + kk]) as f64
                            * bf16_to_f32(w[(e * n + c) * k + kk]) as f64
                    })
                    .sum();
                assert_eq!(y[t * n + c], want);
            }
        }
        // All experts empty: an empty output, not an error.
        let g = Grouped::new(&[0, 0], n, k);
        assert_eq!(
            gemm_bf16(&g, &[], &vec![0; 2 * n * k]).unwrap(),
            Vec::<f64>::new()
        );
        assert!(gemm_bf16(&g, &[0; 4], &vec![0; 2 * n * k]).is_err());
    }

    #[test]
    fn metric() {
        let r = [3.0, 4.0];
        assert_eq!(rel_frobenius(&[3.0, 4.0], &r).unwrap(), 0.0);
        assert_eq!(rel_frobenius(&[3.0, 4.5], &r).unwrap(), 0.1);
        assert!(rel_frobenius(&[f32::NAN, 4.0], &r).unwrap().is_nan());
        assert!(!within_bound(&[f32::NAN, 4.0], &r).unwrap());
        assert!(within_bound(&[3.0, 4.04], &r).unwrap());
        assert!(!within_bound(&[3.0, 4.06], &r).unwrap());
        assert_eq!(rel_frobenius(&[0.0], &[0.0]).unwrap(), 0.0);
        assert_eq!(rel_frobenius(&[1.0], &[0.0]).unwrap(), f64::INFINITY);
        assert!(rel_frobenius(&[1.0], &r).is_err());
    }

    /// Finite E4M3 codes (no NaN).
    fn code() -> impl Strategy<Value = u8> {
        (0u8..0x7F, any::<bool>()).prop_map(|(c, neg)| if neg { c | 0x80 } else { c })
    }

    fn grouped() -> impl Strategy<Value = (Vec<usize>, usize, usize)> {
        (
            prop::collection::vec(prop_oneof![Just(0usize), 1usize..4], 1..5),
            1usize..260,
            1usize..300,
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        /// (b) with unit scales and (c) with unit scales equal (a) on operands exact in e4m3 (every
        /// e4m3 value is exact in bf16; the products and sums are exact in f64).
        #[test]
        fn fp8_unit_scales_equal_bf16(
            (rows, n, k) in grouped(),
            seed in prop::collection::vec(code(), 64),
        ) {
            let g = Grouped::new(&rows, n, k);
            let xq: Vec<u8> = (0..g.rows() * k).map(|i| seed[(i * 7 + 3) % 64]).collect();
            let wq: Vec<u8> = (0..g.experts() * n * k).map(|i| seed[(i * 13 + 5) % 64]).collect();
            let to_bf = |q: &[u8]| -> Vec<u16> {
                q.iter()
                    .map(|b| {
                        let v = e4m3_to_f32(*b);
                        let h = bf16_from_f32(v);
                        assert_eq!(bf16_to_f32(h), v);
                        h
                    })
                    .collect()
            };
            let a = gemm_bf16(&g, &to_bf(&xq), &to_bf(&wq)).unwrap();
            let ones_e = vec![1.0; g.experts()];
            let ones_t = vec![1.0; g.rows()];
            prop_assert_eq!(&gemm_fp8(&g, &xq, ActScale::PerToken(&ones_t), &wq, &ones_e).unwrap(), &a);
            prop_assert_eq!(&gemm_fp8(&g, &xq, ActScale::PerTensor(1.0), &wq, &ones_e).unwrap(), &a);
            let sx = vec![1.0; g.rows() * g.k_blocks()];
            let sw = vec![1.0; g.experts() * g.n_blocks() * g.k_blocks()];
            prop_assert_eq!(&gemm_fp8_block128(&g, &xq, &sx, &wq, &sw).unwrap(), &a);
        }

        /// Changing the scale of one 128x128 weight block (or one 1x128 activation group) changes
        /// exactly the outputs that depend on it: the expert's rows (the token) and the block's
        /// 128 columns (every column); everything else keeps its bits.
        #[test]
        fn block_scale_placement(
            rows in prop::collection::vec(prop_oneof![Just(0usize), 1usize..3], 2..4),
            n in 129usize..300,
            k in 129usize..400,
            seed in prop::collection::vec(1u8..0x70, 32),
            pick in any::<(prop::sample::Index, prop::sample::Index, prop::sample::Index)>(),
        ) {
            let g = Grouped::new(&rows, n, k);
            prop_assume!(g.rows() > 0);
            // Positive nonzero codes, so every slice sum is positive and any scale change shows.
            let xq: Vec<u8> = (0..g.rows() * k).map(|i| seed[(i * 7 + 1) % 32]).collect();
            let wq: Vec<u8> = (0..g.experts() * n * k).map(|i| seed[(i * 11 + 2) % 32]).collect();
            let (kb, nb) = (g.k_blocks(), g.n_blocks());
            let sx: Vec<f32> = (0..g.rows() * kb).map(|i| 1.0 + (i % 5) as f32 * 0.25).collect();
            let sw: Vec<f32> =
                (0..g.experts() * nb * kb).map(|i| 0.5 + (i % 3) as f32 * 0.125).collect();
            let base = gemm_fp8_block128(&g, &xq, &sx, &wq, &sw).unwrap();

            // One weight block (e, nb_i, kb_j) of a non-empty expert.
            let nonempty: Vec<usize> = (0..g.experts()).filter(|&e| rows[e] > 0).collect();
            let e = nonempty[pick.0.index(nonempty.len())];
            let (bi, bj) = (pick.1.index(nb), pick.2.index(kb));
            let mut sw2 = sw.clone();
            sw2[(e * nb + bi) * kb + bj] *= 3.0;
            let y = gemm_fp8_block128(&g, &xq, &sx, &wq, &sw2).unwrap();
            let off = g.offsets();
            for t in 0..g.rows() {
                for c in 0..n {
                    let depends = off[e] <= t && t < off[e + 1] && c / BLOCK == bi;
                    prop_assert_eq!(y[t * n + c] != base[t * n + c], depends, "t {} c {}", t, c);
                }
            }

            // One activation group (t, kb_j).
            let t0 = pick.0.index(g.rows());
            let mut sx2 = sx.clone();
            sx2[t0 * kb + bj] *= 3.0;
            let y = gemm_fp8_block128(&g, &xq, &sx2, &wq, &sw).unwrap();
            for t in 0..g.rows() {
                for c in 0..n {
                    prop_assert_eq!(y[t * n + c] != base[t * n + c], t == t0, "t {} c {}", t, c);
                }
            }
        }
    }
}
