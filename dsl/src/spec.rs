//! The reference formulas of SPEC §1-§3, written out plainly: the oracle the layout algebra and the
//! recipes' views are tested against.

use crate::layout::{IntTuple, Layout, Result};

/// `ceil(x / a)`.
pub fn cd(x: i64, a: i64) -> i64 {
    (x + a - 1) / a
}

/// `ceil(x / a) * a`.
pub fn ru(x: i64, a: i64) -> i64 {
    cd(x, a) * a
}

/// SPEC §1: byte offset of logical scale `(b, r, c)` in the 128x4-swizzled buffer of an `[B, M, K]`
/// scale tensor (`r < ru(M,128)`, `c < ru(K,4)`).
pub fn swizzle_128x4_offset(b: i64, r: i64, c: i64, m: i64, k: i64) -> i64 {
    let (mp, kp) = (ru(m, 128), ru(k, 4));
    let kt = kp / 4;
    b * mp * kp
        + (r / 128) * kt * 512
        + (c / 4) * 512
        + (r % 32) * 16
        + ((r % 128) / 32) * 4
        + (c % 4)
}

/// SPEC §1 as a CuTe layout over logical `(b, r, c)`: `(B, (32,4,MT), (4,KT)) : (Mp*Kp, (16,4,KT*512), (1,512))`.
pub fn swizzle_128x4_layout(batches: i64, m: i64, k: i64) -> Result<Layout> {
    let (mp, kp) = (ru(m, 128), ru(k, 4));
    let (mt, kt) = (mp / 128, kp / 4);
    Layout::new(
        IntTuple::Tuple(vec![
            IntTuple::Int(batches),
            IntTuple::flat(&[32, 4, mt]),
            IntTuple::flat(&[4, kt]),
        ]),
        IntTuple::Tuple(vec![
            IntTuple::Int(mp * kp),
            IntTuple::flat(&[16, 4, kt * 512]),
            IntTuple::flat(&[1, 512]),
        ]),
    )
}

/// SPEC §2: source offset of MMA-view element `(a, b, mt, c, kt, g)` for `(m, k, G)`.
pub fn mma_view_offset(idx: [i64; 6], m: i64, k: i64) -> i64 {
    let sf_k = cd(k, 16);
    let (mt_n, kt_n) = (cd(m, 128), cd(sf_k, 4));
    let [a, b, mt, c, kt, g] = idx;
    g * mt_n * kt_n * 512 + mt * kt_n * 512 + kt * 512 + a * 16 + b * 4 + c
}

/// SPEC §3: `interleave_linear_and_gate`: the input index that output index `j` takes (`n` divisible by
/// `2g`).
pub fn interleave_src(j: i64, n: i64, g: i64) -> i64 {
    let (t, rem) = (j / (2 * g), j % (2 * g));
    let (h, r) = (rem / g, rem % g);
    h * (n / 2) + t * g + r
}

/// SPEC §3: `[gate; up] -> [up; gate]` then interleave by `g`: the source row of output row `j`.
pub fn cutedsl_row_src(j: i64, n: i64, g: i64) -> i64 {
    let s = interleave_src(j, n, g);
    if s < n / 2 {
        s + n / 2
    } else {
        s - n / 2
    }
}
