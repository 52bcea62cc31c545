//! A weight operand's rows where the recipe stores them (issue \[8\] item 2): the grouped GEMM's
//! TMA map of `W` taken from the bound recipe's storage layout instead of a compact `[E, N, K]`
//! copy.
//!
//! The GEMM walks an expert's weight rows in its own order `q` (the input's `[gate; up]` rows, or
//! for the fused SiLU epilogue the paired order of [`super::ws::glu_row`]). Where the recipe
//! stores row `q` of expert `e` at byte `base + Σ_i ((q / P_i) mod n_i) s_i + e s_E` (a CuTe
//! layout of at most four row modes `n_i : s_i`, innermost first, `P_i` the product of the inner
//! extents, and K contiguous), a rank-5-or-less tensor map with dimensions `{K, n_0, .., e}` and
//! those byte strides lands a tile's rows in shared memory in exactly the order a compact copy
//! would: [`fit`] finds the modes from the row offsets the verified storage map gives, [`WRows`]
//! is what the kernel is compiled for (the coordinates it computes), and [`WLayout`] what the
//! runtime encodes. A layout that does not fit gets a [`Slow`] reason, and the layer falls back to
//! a re-laid copy (`moeforge check` says which and why).

use std::fmt;

/// Row modes a weight map can have: with K, four make a rank-5 map with the expert folded into the
/// last one; with three the expert keeps a dimension of its own.
pub const MAX_ROW_MODES: usize = 4;

/// The TMA tensor's rank limit.
const MAX_RANK: usize = 5;

/// How the kernel addresses a weight tile's rows: the row modes of an expert's `N` rows (the
/// extents of all but the last; the last takes the rest), whether the expert is folded into the
/// last mode, and for the fused epilogue which half of each 16 rows is gate. Compiled into the
/// kernel (part of [`super::ws::WsConfig`]); the strides are the runtime's ([`WLayout`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WRows {
    /// Row modes, 1 to [`MAX_ROW_MODES`].
    pub modes: u8,
    /// The extents of the first `modes - 1` modes (each at least 2); the rest are 0.
    pub inner: [u32; 3],
    /// The expert is folded into the last row mode (its coordinate `e * n_last + ..`).
    pub folded: bool,
    /// Fused SiLU epilogue: rows `16j .. 16j + 8` of the paired order are up rows (the recipe
    /// stores up before gate); the usual order has gate first.
    pub up_first: bool,
}

impl WRows {
    /// One row mode, the expert its own dimension: the compact `[E, N, K]` operand's map.
    pub const PLAIN: WRows = WRows {
        modes: 1,
        inner: [0; 3],
        folded: false,
        up_first: false,
    };

    /// The extents of every row mode within an expert, innermost first (the last one
    /// `ceil(n / P)`).
    pub fn extents(&self, n: u32) -> Vec<u32> {
        let m = usize::from(self.modes.clamp(1, MAX_ROW_MODES as u8));
        let mut v: Vec<u32> = self.inner[..m - 1].to_vec();
        let p: u32 = v.iter().product::<u32>().max(1);
        v.push(n.div_ceil(p));
        v
    }

    /// The TMA map's rank: K, the row modes and the expert unless folded.
    pub fn rank(&self) -> u32 {
        1 + u32::from(self.modes) + u32::from(!self.folded)
    }

    /// Which row mode a tile of `rows` consecutive rows (starting on a multiple of `rows`) splits:
    /// `(j, c)` with the modes before `j` wholly inside the box and `c` entries of mode `j`, where
    /// `rows = P_j c` and `c` divides `n_j` (the last mode of an unfolded map may end ragged: TMA
    /// fills rows past `N` with zeros). `None` where the tile is no box of the modes.
    pub fn split(&self, n: u32, rows: u32) -> Option<(usize, u32)> {
        let ext = self.extents(n);
        let last = ext.len() - 1;
        let mut p = 1u32;
        for (i, &e) in ext.iter().enumerate() {
            if i == last || p.checked_mul(e)? >= rows {
                if p == 0 || !rows.is_multiple_of(p) {
                    return None;
                }
                let c = rows / p;
                let whole = c > 0 && e.is_multiple_of(c);
                return (whole || (i == last && !self.folded)).then_some((i, c));
            }
            p = p.checked_mul(e)?;
        }
        None
    }

    /// The box of a tile of `rows` rows after K: the row modes' entries, then 1 for the expert.
    pub fn boxes(&self, n: u32, rows: u32) -> Option<Vec<u32>> {
        let (j, c) = self.split(n, rows)?;
        let ext = self.extents(n);
        let mut b: Vec<u32> = (0..ext.len())
            .map(|i| match i.cmp(&j) {
                std::cmp::Ordering::Less => ext[i],
                std::cmp::Ordering::Equal => c,
                std::cmp::Ordering::Greater => 1,
            })
            .collect();
        if !self.folded {
            b.push(1);
        }
        Some(b)
    }

    /// The TMA coordinates after K of the tile whose first row is `w0` (a multiple of `rows`) in
    /// expert `e`: 0 for the modes inside the box, `(w0 / P_i) mod n_i` for the others (the last
    /// one unreduced, plus `e n_last` when folded), then `e`. The host twin of the kernel's
    /// arithmetic (`ws`'s producer), which the tests hold to the layout.
    pub fn coords(&self, n: u32, rows: u32, w0: u32, e: u32) -> Option<Vec<u32>> {
        let (j, _) = self.split(n, rows)?;
        let ext = self.extents(n);
        let last = ext.len() - 1;
        let mut p = 1u32;
        let mut c = Vec::with_capacity(ext.len() + 1);
        for (i, &x) in ext.iter().enumerate() {
            c.push(if i < j {
                0
            } else if i == last {
                w0 / p + if self.folded { e * x } else { 0 }
            } else {
                (w0 / p) % x
            });
            p = p.saturating_mul(x);
        }
        if !self.folded {
            c.push(e);
        }
        Some(c)
    }

    /// Whether the description is one a kernel can be compiled for at `n` rows with tiles of
    /// `rows` rows: 1 to 4 modes, inner extents of at least 2, a rank of at most 5, a folded map's
    /// last mode exact, and the tile a box of the modes. The error names the rule.
    pub fn check(&self, n: u32, rows: u32) -> Result<(), String> {
        let m = usize::from(self.modes);
        if !(1..=MAX_ROW_MODES).contains(&m) {
            return Err(format!("{m} weight row modes (1 to {MAX_ROW_MODES})"));
        }
        if self.rank() as usize > MAX_RANK {
            return Err(format!(
                "{m} weight row modes with the expert apart: a rank-{} map (at most {MAX_RANK})",
                self.rank()
            ));
        }
        let inner = &self.inner[..m - 1];
        if inner.iter().any(|&x| x < 2) || self.inner[m - 1..].iter().any(|&x| x != 0) {
            return Err(format!(
                "weight row modes {:?} (inner extents at least 2)",
                inner
            ));
        }
        let p: u64 = inner.iter().map(|&x| u64::from(x)).product();
        if p > u64::from(n) || (p > 1 && !u64::from(n).is_multiple_of(p)) {
            return Err(format!(
                "weight row modes {inner:?} over N = {n} (their product must divide N)"
            ));
        }
        if self.split(n, rows).is_none() {
            return Err(format!(
                "a tile of {rows} weight rows is not a box of the row modes {:?}",
                self.extents(n)
            ));
        }
        Ok(())
    }

    /// The kernel tag's suffix: empty for [`WRows::PLAIN`], else `_w` with the inner extents
    /// (`8x2`), `f` when folded, `u` when up rows come first.
    pub fn tag(&self) -> String {
        if *self == WRows::PLAIN {
            return String::new();
        }
        let m = usize::from(self.modes.clamp(1, MAX_ROW_MODES as u8));
        let inner: Vec<String> = self.inner[..m - 1].iter().map(u32::to_string).collect();
        format!(
            "_w{}{}{}",
            inner.join("x"),
            if self.folded { "f" } else { "" },
            if self.up_first { "u" } else { "" }
        )
    }
}

/// A weight operand as the runtime maps it: the kernel's [`WRows`], then the TMA dimensions after
/// K (the row modes, then the expert unless folded) with their extents and byte strides.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WLayout {
    /// What the kernel is compiled for.
    pub rows: WRows,
    /// The byte offset of expert 0's row 0 (K index 0) in the buffer: the map's start (a multiple
    /// of 16).
    pub base: u64,
    /// Extents of the dimensions after K.
    pub extents: Vec<u64>,
    /// Their byte strides.
    pub strides: Vec<u64>,
}

impl WLayout {
    /// The compact `[experts, n, K]` operand of `row_bytes` bytes a row.
    pub fn compact(experts: u64, n: u64, row_bytes: u64) -> WLayout {
        WLayout {
            rows: WRows::PLAIN,
            base: 0,
            extents: vec![n, experts],
            strides: vec![row_bytes, row_bytes.saturating_mul(n)],
        }
    }

    /// Whether the map covers what a kernel compiled for its row modes reads at `n` rows over
    /// `experts` experts: the row extents its modes compile to (`WRows::extents`), and at least
    /// `experts` experts (in the expert dimension, or folded into the last mode).
    pub fn serves(&self, n: u32, experts: u64) -> bool {
        let want = self.rows.extents(n);
        let m = want.len();
        let rows_ok = |i: usize| self.extents.get(i) == Some(&u64::from(want[i]));
        if self.extents.len() != m + usize::from(!self.rows.folded) || !(0..m - 1).all(rows_ok) {
            return false;
        }
        let last = u64::from(want[m - 1]);
        if self.rows.folded {
            self.extents[m - 1] >= last.saturating_mul(experts)
                && self.extents[m - 1].is_multiple_of(last)
        } else {
            self.extents[m - 1] == last && self.extents[m] >= experts
        }
    }

    /// The bytes a buffer must hold: the map's start, the last element's row offset from it and
    /// `row_bytes` (0 for an empty tensor).
    pub fn span_bytes(&self, row_bytes: u64) -> u64 {
        if self.extents.contains(&0) {
            return 0;
        }
        self.extents
            .iter()
            .zip(&self.strides)
            .map(|(&x, &s)| (x - 1).saturating_mul(s))
            .fold(row_bytes.saturating_add(self.base), u64::saturating_add)
    }
}

/// Why a stored weight layout is not read in place (the layer then takes a re-laid copy).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Slow {
    /// No rows.
    Empty,
    /// The rows are no layout of at most [`MAX_ROW_MODES`] modes: the first row where the modes
    /// found so far disagree with the storage.
    NotAffine {
        /// The GEMM row.
        row: usize,
    },
    /// A stride TMA cannot take (not positive, or not a multiple of 16 bytes).
    Stride {
        /// Which dimension after K (the expert is the last).
        dim: usize,
        /// Its byte stride.
        stride: i64,
    },
    /// More modes than a rank-5 map holds.
    Rank {
        /// Row modes found.
        modes: usize,
    },
    /// Four row modes leave no room for the expert, and the experts do not continue the last
    /// mode (its stride times its extent is not the expert stride), so it cannot fold into it.
    NoFold {
        /// The last mode's end in bytes (its stride times its extent).
        end: i64,
        /// The expert stride in bytes.
        expert_stride: i64,
    },
    /// A row mode's extent past 32 bits.
    Extent {
        /// Its extent.
        extent: usize,
    },
}

impl fmt::Display for Slow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Slow::Empty => write!(f, "the operand has no rows"),
            Slow::NotAffine { row } => write!(
                f,
                "its rows are no layout of at most {MAX_ROW_MODES} strided modes (row {row} breaks the pattern)"
            ),
            Slow::Stride { dim, stride } => write!(
                f,
                "a row stride of {stride} bytes (dimension {dim} after K): TMA takes positive multiples of 16"
            ),
            Slow::Rank { modes } => write!(
                f,
                "{modes} row modes and the expert do not fit a rank-{MAX_RANK} tensor map"
            ),
            Slow::NoFold { end, expert_stride } => write!(
                f,
                "{MAX_ROW_MODES} row modes leave no dimension for the expert, and it cannot fold into the last mode (which ends at byte {end}; the experts are {expert_stride} bytes apart)"
            ),
            Slow::Extent { extent } => write!(f, "a row mode of {extent} rows is past 32 bits"),
        }
    }
}

/// Fit the row offsets of an expert's GEMM rows to modes: `off[q]` the byte offset of row `q`
/// relative to row 0's, `expert_stride` the bytes between experts (`experts` of them), `up_first`
/// recorded for the fused epilogue (the caller sets [`WLayout::base`]). Greedy, innermost first: a mode's stride is the step from row
/// 0 to the first row the inner modes do not reach, its extent as far as that step holds (cut to
/// divide the rows), then every row is checked against the modes.
pub fn fit(off: &[i64], expert_stride: i64, experts: u64, up_first: bool) -> Result<WLayout, Slow> {
    let n = off.len();
    if n == 0 {
        return Err(Slow::Empty);
    }
    let mut modes: Vec<(usize, i64)> = Vec::new();
    let mut p = 1usize;
    while p < n || modes.is_empty() {
        let s = if p < n { off[p] - off[0] } else { 16 };
        let mut e = 1usize;
        while e * p < n && off[e * p] - off[0] == e as i64 * s {
            e += 1;
        }
        if e * p < n {
            while e > 1 && !n.is_multiple_of(e * p) {
                e -= 1;
            }
        }
        if e <= 1 && p < n {
            return Err(Slow::NotAffine { row: p });
        }
        modes.push((e.max(1), s));
        p *= e.max(1);
        if modes.len() > MAX_ROW_MODES {
            return Err(Slow::Rank { modes: modes.len() });
        }
    }
    // The last mode covers the rest exactly (a ragged last block would read past the rows).
    if p != n && modes.len() > 1 {
        return Err(Slow::NotAffine { row: n - 1 });
    }
    for (q, &o) in off.iter().enumerate() {
        let mut want = 0i64;
        let mut pp = 1usize;
        for (i, &(e, s)) in modes.iter().enumerate() {
            let x = if i + 1 == modes.len() {
                q / pp
            } else {
                (q / pp) % e
            };
            want += x as i64 * s;
            pp *= e;
        }
        if o - off[0] != want {
            return Err(Slow::NotAffine { row: q });
        }
    }
    for (dim, &(e, s)) in modes.iter().enumerate() {
        if e > 1 && (s <= 0 || s % 16 != 0) {
            return Err(Slow::Stride { dim, stride: s });
        }
    }
    let (last_e, last_s) = modes[modes.len() - 1];
    let fold = modes.len() == MAX_ROW_MODES;
    if experts > 1 && (expert_stride <= 0 || expert_stride % 16 != 0) {
        return Err(Slow::Stride {
            dim: modes.len(),
            stride: expert_stride,
        });
    }
    if fold && experts > 1 && last_s * last_e as i64 != expert_stride {
        return Err(Slow::NoFold {
            end: last_s * last_e as i64,
            expert_stride,
        });
    }
    let mut inner = [0u32; 3];
    for (i, &(e, _)) in modes[..modes.len() - 1].iter().enumerate() {
        inner[i] = u32::try_from(e).map_err(|_| Slow::Extent { extent: e })?;
    }
    let rows = WRows {
        modes: modes.len() as u8,
        inner,
        folded: fold,
        up_first,
    };
    let stride = |s: i64| if s > 0 { s as u64 } else { 16 };
    let mut extents: Vec<u64> = modes.iter().map(|&(e, _)| e as u64).collect();
    let mut strides: Vec<u64> = modes.iter().map(|&(_, s)| stride(s)).collect();
    if fold {
        if let Some(x) = extents.last_mut() {
            *x = x.saturating_mul(experts.max(1));
        }
    } else {
        extents.push(experts.max(1));
        // One expert never steps: its stride (0 in the storage) becomes the rows' span, which
        // nests as the driver describes strides.
        let span = modes.iter().map(|&(e, s)| e as i64 * s).max().unwrap_or(0);
        strides.push(if experts > 1 {
            stride(expert_stride)
        } else {
            stride(span.max(expert_stride))
        });
    }
    Ok(WLayout {
        rows,
        base: 0,
        extents,
        strides,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Byte offset of row `q` (expert 0) of a layout of modes `(extent, stride)`.
    fn offsets(modes: &[(usize, i64)]) -> Vec<i64> {
        let n: usize = modes.iter().map(|m| m.0).product();
        (0..n)
            .map(|q| {
                let (mut pp, mut o) = (1, 0);
                for &(e, s) in modes {
                    o += ((q / pp) % e) as i64 * s;
                    pp *= e;
                }
                o
            })
            .collect()
    }

    /// The rows a tile's box lands, in shared-memory order (the box's dimensions innermost
    /// first), as byte offsets from the map's start: what TMA does with the map and the
    /// coordinates, on the host.
    fn box_rows(l: &WLayout, n: u32, rows: u32, w0: u32, e: u32) -> Vec<i64> {
        let c = l.rows.coords(n, rows, w0, e).expect("coords");
        let b = l.rows.boxes(n, rows).expect("boxes");
        let total: u32 = b.iter().product();
        (0..total)
            .filter_map(|mut i| {
                let mut o = 0i64;
                for d in 0..b.len() {
                    let at = u64::from(c[d] + i % b[d]);
                    if at >= l.extents[d] {
                        return None;
                    }
                    o += (at * l.strides[d]) as i64;
                    i /= b[d];
                }
                Some(o)
            })
            .collect()
    }

    #[test]
    fn compact_rows_fit_the_plain_map() {
        let off: Vec<i64> = (0..4096).map(|q| q * 14336).collect();
        let l = fit(&off, 4096 * 14336, 32, false).expect("fits");
        assert_eq!(l, WLayout::compact(32, 4096, 14336));
        assert_eq!(l.rows.tag(), "");
        assert_eq!(l.rows.boxes(4096, 64), Some(vec![64, 1]));
        assert_eq!(l.rows.coords(4096, 64, 128, 5), Some(vec![128, 5]));
        // A ragged last tile of an unfolded map: TMA fills the rows past N.
        assert_eq!(WRows::PLAIN.split(100, 64), Some((0, 64)));
    }

    /// `[gate; up]` rows read in the fused epilogue's paired order: 8 rows, the halves, then
    /// blocks of 8 outputs.
    #[test]
    fn gate_up_rows_in_paired_order_are_three_modes() {
        let (i, row) = (2048usize, 14336i64);
        let off: Vec<i64> = (0..2 * i)
            .map(|q| super::super::ws::glu_row(q, i) as i64 * row)
            .collect();
        let l = fit(&off, 2 * i as i64 * row, 32, false).expect("fits");
        assert_eq!(l.rows.extents(4096), vec![8, 2, 256]);
        assert_eq!(
            l.strides,
            vec![
                row as u64,
                i as u64 * row as u64,
                8 * row as u64,
                2 * i as u64 * row as u64
            ]
        );
        assert_eq!(l.rows.tag(), "_w8x2");
        assert_eq!(l.rows.boxes(4096, 64), Some(vec![8, 2, 4, 1]));
        for (w0, e) in [(0, 0), (64, 3), (4032, 31)] {
            let want: Vec<i64> = (w0..w0 + 64)
                .map(|q| off[q as usize] + i64::from(e) * 2 * i as i64 * row)
                .collect();
            assert_eq!(box_rows(&l, 4096, 64, w0, e), want);
        }
    }

    /// Up before gate, interleaved by 64 (an `interleave(swap_halves(..), group = 64)` row
    /// order) read up-first: four row modes, the expert folded into the last.
    #[test]
    fn interleaved_up_first_rows_fold_the_expert() {
        let (i, row) = (768usize, 4096i64);
        // GEMM row q = 16 blk + 8 h + r (h = 0: up), output m = 8 blk + r; stored at
        // (m / 64) 128 + (1 - h') 64 + m % 64 with h' = 1 for gate.
        let off: Vec<i64> = (0..2 * i)
            .map(|q| {
                let (blk, h, r) = (q / 16, (q / 8) % 2, q % 8);
                let m = 8 * blk + r;
                ((m / 64) * 128 + h * 64 + m % 64) as i64 * row
            })
            .collect();
        let l = fit(&off, 2 * i as i64 * row, 8, true).expect("fits");
        assert!(l.rows.folded && l.rows.up_first);
        assert_eq!(l.rows.extents(1536), vec![8, 2, 8, 12]);
        assert_eq!(l.extents, vec![8, 2, 8, 96]);
        assert_eq!(l.rows.rank(), 5);
        assert_eq!(l.rows.tag(), "_w8x2x8fu");
        for rows in [64, 128] {
            for (w0, e) in [(0, 0), (rows, 1), (1536 - rows, 7)] {
                let want: Vec<i64> = (w0..w0 + rows)
                    .map(|q| off[q as usize] + i64::from(e) * 2 * i as i64 * row)
                    .collect();
                assert_eq!(box_rows(&l, 1536, rows, w0, e), want, "rows {rows} w0 {w0}");
            }
        }
        // 256 rows are two whole 128-row blocks; 192 rows are no box.
        assert_eq!(l.rows.split(1536, 256), Some((3, 2)));
        assert!(l.rows.split(1536, 192).is_none());
    }

    #[test]
    fn layouts_that_do_not_fit_are_named() {
        // Rows in a scattered order.
        let off: Vec<i64> = [0, 3, 1, 2].iter().map(|&r| r * 64).collect();
        assert!(matches!(
            fit(&off, 256, 2, false),
            Err(Slow::NotAffine { .. })
        ));
        // Up before gate read gate-first: a negative stride.
        let off: Vec<i64> = (0..32)
            .map(|q| super::super::ws::glu_row(q, 16) as i64 * 64)
            .map(|o| (o + 16 * 64) % (32 * 64))
            .collect();
        assert!(matches!(
            fit(&off, 2048, 2, false),
            Err(Slow::Stride { .. })
        ));
        // Rows 8 bytes apart.
        let off: Vec<i64> = (0..16).map(|q| q * 8).collect();
        assert_eq!(
            fit(&off, 128, 2, false),
            Err(Slow::Stride { dim: 0, stride: 8 })
        );
        // Five modes.
        let off = offsets(&[(2, 64), (2, 256), (2, 128), (2, 1024), (2, 512)]);
        assert_eq!(fit(&off, 4096, 2, false), Err(Slow::Rank { modes: 5 }));
        // Four modes whose last does not meet the next expert: the expert cannot fold.
        let off = offsets(&[(2, 64), (2, 256), (2, 128), (2, 1024)]);
        assert_eq!(
            fit(&off, 4096, 2, false),
            Err(Slow::NoFold {
                end: 2048,
                expert_stride: 4096
            })
        );
        assert!(Slow::NoFold {
            end: 2048,
            expert_stride: 4096
        }
        .to_string()
        .contains("cannot fold"));
    }

    #[test]
    fn a_map_serves_the_rows_and_experts_it_covers() {
        let off = offsets(&[(8, 256), (2, 64 * 256), (4, 8 * 256)]);
        let l = fit(&off, 64 * 256, 3, false).expect("fits");
        assert!(l.serves(64, 3) && l.serves(64, 2));
        assert!(!l.serves(64, 4), "more experts than the map holds");
        assert!(!l.serves(128, 3), "other rows than the modes compile to");
        assert!(WLayout::compact(4, 96, 256).serves(96, 4));
        assert!(!WLayout::compact(4, 96, 256).serves(96, 5));
    }

    #[test]
    fn one_expert_and_one_row_give_maps_the_tma_rule_accepts() {
        use crate::gemm::desc::strides_nest;
        // One expert: its stride (0 in the storage) never steps.
        let off: Vec<i64> = (0..64).map(|q| q * 256).collect();
        let l = fit(&off, 0, 1, false).expect("fits");
        assert_eq!(l.extents.last(), Some(&1));
        strides_nest(256, &l.extents, &l.strides).expect("nests");
        // One row.
        let l = fit(&[0], 512, 4, false).expect("fits");
        strides_nest(512, &l.extents, &l.strides).expect("nests");
        // Modes that alias as TMA sees them (rows 0, 2r, 3r, 5r: a stride of 3r inside the 4r
        // span of the first mode) are named.
        let l = fit(&[0, 512, 768, 1280], 2048, 2, false).expect("fits");
        assert!(strides_nest(256, &l.extents, &l.strides).is_err());
    }

    #[test]
    fn descriptions_kernels_are_not_compiled_for_are_refused() {
        let r = |modes, inner, folded| WRows {
            modes,
            inner,
            folded,
            up_first: false,
        };
        assert!(r(1, [0; 3], false).check(4096, 64).is_ok());
        assert!(r(4, [8, 2, 8], false).check(4096, 64).is_err(), "rank 6");
        assert!(
            r(2, [1, 0, 0], false).check(4096, 64).is_err(),
            "inner extent 1"
        );
        assert!(
            r(2, [3, 0, 0], false).check(4096, 64).is_err(),
            "3 does not divide N"
        );
        assert!(
            r(3, [8, 2, 0], false).check(4096, 24).is_err(),
            "24 rows: no box"
        );
        assert!(r(3, [8, 2, 0], false).check(4096, 64).is_ok());
    }

    proptest! {
        /// Any layout of up to four power-of-two modes with distinct 16-byte-multiple strides
        /// (a permutation of a compact one) fits, and every tile's box lands exactly its rows.
        #[test]
        fn permuted_compact_layouts_fit_and_land_their_rows(
            logs in proptest::collection::vec(1u32..4, 1..5),
            order in Just((0..4).collect::<Vec<usize>>()).prop_shuffle(),
            experts in 1u64..4,
        ) {
            // Strides: the modes stored compactly in the permuted order, 64 bytes a row.
            let m = logs.len();
            let ord: Vec<usize> = order.into_iter().filter(|&i| i < m).collect();
            let mut strides = vec![0i64; m];
            let mut acc = 64i64;
            for &i in &ord {
                strides[i] = acc;
                acc *= 1 << logs[i];
            }
            let modes: Vec<(usize, i64)> = (0..m).map(|i| (1usize << logs[i], strides[i])).collect();
            let off = offsets(&modes);
            let n = off.len() as u32;
            let l = fit(&off, acc, experts, false);
            // Three modes or fewer always fit; four fold only where the last is outermost.
            if m <= 3 {
                prop_assert!(l.is_ok(), "{:?}: {:?}", modes, l);
            }
            prop_assume!(l.is_ok());
            let l = l.map_err(|e| TestCaseError::fail(e.to_string()))?;
            for rows in [8u32, 16, 32, 64] {
                if rows > n || l.rows.check(n, rows).is_err() {
                    continue;
                }
                for e in 0..experts as u32 {
                    for w0 in (0..n).step_by(rows as usize) {
                        let want: Vec<i64> = (w0..w0 + rows)
                            .map(|q| off[q as usize] + i64::from(e) * acc)
                            .collect();
                        prop_assert_eq!(box_rows(&l, n, rows, w0, e), want);
                    }
                }
            }
        }
    }
}
