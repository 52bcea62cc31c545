//! The tile scheduler's work decomposition for the grouped (MoE) GEMM `Y[rows of e] = X[rows of e] ·
//! W[e]^T`, as pure host code: exactly the sequence of work items that the persistent GPU kernel
//! walks, so that the decomposition is tested without a GPU.
//!
//! # The problem
//! The rows of `X [T, K]` are sorted by expert (GEMM.md §4, contiguous layout, without padding):
//! expert `e` owns rows `offsets[e] .. offsets[e + 1]`, where `offsets` is the exclusive prefix sum of
//! the per-expert row counts and lives in device memory (written by the permute kernel), so no host
//! sync is needed and a CUDA graph can capture a forward. `W` is `[E, N, K]`; `Y` is `[T, N]`.
//!
//! # Work items and their order
//! A [`WorkItem`] is `(expert, m_tile, n_tile, split)`: rows `m_tile` of the expert's token rows (never
//! crossing into the next expert: the last tile of an expert is clipped at `offsets[e + 1]`), columns
//! `n_tile` of `N` (rows of `W[e]`), and the K range of split `split`. Items are numbered in one fixed
//! order, the same for every launch:
//!
//! ```text
//! for e in 0..E { for n in 0..n_tiles { for m in 0..m_tiles(e) { for s in 0..S { item } } } }
//! ```
//!
//! * **Expert-major**: an expert's items are contiguous, so the item -> expert search is a search
//!   over one monotone prefix array, and co-running CTAs work on one or two experts at a time.
//! * **n-tile before m-tile** (n-major within an expert): consecutive items, which run at the same
//!   time on consecutive CTAs, share the same weight tile `W[e][n-tile, :]` and differ in the token
//!   rows. The weight tile is then fetched from HBM once and served to the other CTAs from L2, while
//!   the expert's token rows (`rows_e x K`, small next to `W[e]`, which is `N x K`) stay L2-resident
//!   across n-tiles. In decode the weights are the whole traffic, so each weight byte is read from HBM
//!   once; in prefill it is DeepGEMM's reuse of B across m-blocks.
//! * **split innermost**: the S partial sums of one output tile are produced by adjacent CTAs at about
//!   the same time, so the reduction that follows waits least, and a K split never shares a weight
//!   tile with another split (they read disjoint K ranges).
//!
//! The two orientations ([`Orientation`]) number items identically; they differ only in the tile
//! extents and in which operand feeds the MMA's M side: tokens (prefill: `BM` token rows x `BN`
//! output columns) or weights (decode, swap A/B: the MMA's M is 64 rows of `W[e]`, i.e. 64 output
//! columns, and its N is 8, 16 or 32 tokens).
//!
//! # Split-K and its fixed reduction order
//! K is cut into `k_tiles = ceil(K / BK)` tiles; split `s` of `S` takes k-tiles
//! `floor(s * k_tiles / S) .. floor((s + 1) * k_tiles / S)` (balanced, never empty as `S <= k_tiles`;
//! every boundary is a multiple of `BK`, so with `BK = 128` no `fp8_block128` scale slice is cut).
//! Each split writes its raw f32 partial tile to workspace slot `s`; the output tile is then
//! `((p_0 + p_1) + p_2) + ... + p_{S-1}` in f32, always in ascending `s` ([`split_k_sum`]), whichever
//! CTA finished first, and only then does the epilogue apply the per-token / per-expert scales and
//! convert. `S = 1` writes the accumulator directly. So the bits depend only on the inputs and the
//! chosen variant.
//!
//! # The persistent walk and the device-side item search
//! The grid is `grid` CTAs (132 on the H200); CTA `c` takes items `c, c + grid, c + 2 grid, ...`
//! below [`Schedule::items`] (GEMM.md §1.7). A CTA finds the item of linear index `i` from the
//! device-resident offsets in one of two ways, both modelled here and tested against the explicit
//! enumeration ([`Schedule::enumerate`]):
//!
//! * [`Schedule::item`]: **O(log E) binary search** over `m_tile_prefix` (`E + 1` entries, the
//!   exclusive prefix sum of `ceil(rows_e / BM)`); the CTA builds it in shared memory in its prologue
//!   from `offsets` (one block-wide scan, at most 1 KiB for E = 256), then every item costs one
//!   `upper_bound` of `i / (n_tiles * S)` in it, and a few divisions.
//! * [`Schedule::walk`]: an **O(E) cursor**, amortized over the CTA's whole walk (DeepGEMM's
//!   scheduler): the CTA keeps `(expert, items before it)` and, since its indices only grow, advances
//!   the expert while the index lies past it, reading `offsets` directly; nothing is precomputed.
//!
//! The last m-tile of an expert is ragged (`rows_e % BM != 0`): a TMA load past its end reads rows of
//! the next expert (or out-of-bounds zeros), which only feed output rows that are not stored; the
//! epilogue must store rows `< row_end` only (masked stores for that tile, never a full-box TMA
//! store that would overwrite the next expert's rows).

use std::ops::Range;

use crate::{Error, Result};

/// Which operand feeds the MMA's M side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Orientation {
    /// Prefill: tokens (rows of `X`) on the MMA's M side, weights (rows of `W[e]`) on its N side.
    TokensAsM,
    /// Decode, swap A/B: weights on the MMA's M side (64-row tiles), tokens on its N side.
    WeightsAsM,
}

/// The tile shape, in problem coordinates: `m` token rows by `n` output columns by `k` deep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tile {
    /// Which operand is the MMA's M side.
    pub orientation: Orientation,
    /// Token rows per tile (`BM` in prefill; the MMA's N, 8, 16 or 32, in decode).
    pub m: usize,
    /// Output columns (rows of `W[e]`) per tile (`BN` in prefill; the MMA's M, 64, in decode).
    pub n: usize,
    /// K depth of one pipeline stage (`BK`); split-K ranges are multiples of it.
    pub k: usize,
}

/// Rows of `W[e]` per tile on the MMA's M side in the swap-A/B decode variant (one wgmma m64).
pub const DECODE_WEIGHT_ROWS: usize = 64;

fn unsupported(what: String) -> Error {
    Error::Unsupported {
        param: "grouped GEMM schedule".into(),
        what,
    }
}

impl Tile {
    /// A prefill tile: `bm` token rows (a multiple of 64, one wgmma m64 per consumer warpgroup, at
    /// most 256), `bn` output columns (a multiple of 8 in 8..=256, the wgmma N) and `bk` deep (a
    /// positive multiple of 16, the bf16 wgmma K).
    pub fn prefill(bm: usize, bn: usize, bk: usize) -> Result<Tile> {
        if bm == 0 || !bm.is_multiple_of(64) || bm > 256 {
            return Err(unsupported(format!(
                "a BM of {bm} (a multiple of 64, at most 256)"
            )));
        }
        if bn == 0 || !bn.is_multiple_of(8) || bn > 256 {
            return Err(unsupported(format!(
                "a BN of {bn} (a multiple of 8, at most 256)"
            )));
        }
        Tile::check_bk(bk)?;
        Ok(Tile {
            orientation: Orientation::TokensAsM,
            m: bm,
            n: bn,
            k: bk,
        })
    }

    /// A decode tile (swap A/B): [`DECODE_WEIGHT_ROWS`] rows of `W[e]` on the MMA's M side, `tokens`
    /// (8, 16 or 32) on its N side, `bk` deep (a positive multiple of 16).
    pub fn decode(tokens: usize, bk: usize) -> Result<Tile> {
        if !matches!(tokens, 8 | 16 | 32) {
            return Err(unsupported(format!(
                "a decode token tile of {tokens} (8, 16 or 32)"
            )));
        }
        Tile::check_bk(bk)?;
        Ok(Tile {
            orientation: Orientation::WeightsAsM,
            m: tokens,
            n: DECODE_WEIGHT_ROWS,
            k: bk,
        })
    }

    fn check_bk(bk: usize) -> Result<()> {
        if bk == 0 || !bk.is_multiple_of(16) {
            return Err(unsupported(format!(
                "a BK of {bk} (a positive multiple of 16)"
            )));
        }
        Ok(())
    }

    /// The MMA's `(M, N)` per tile: `(m, n)` for tokens as M, `(n, m)` for weights as M.
    pub fn mma_mn(&self) -> (usize, usize) {
        match self.orientation {
            Orientation::TokensAsM => (self.m, self.n),
            Orientation::WeightsAsM => (self.n, self.m),
        }
    }
}

/// One unit of work: one output tile of one expert, over one K split.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WorkItem {
    /// The expert (selects `W[e]`).
    pub expert: usize,
    /// Token-row tile index within the expert.
    pub m_tile: usize,
    /// Output-column tile index.
    pub n_tile: usize,
    /// K split index (`0..S`); its partial goes to workspace slot `split`.
    pub split: usize,
    /// Global rows of `X` and `Y` (inside the expert's rows).
    pub rows: Range<usize>,
    /// Columns of `Y` (rows of `W[e]`).
    pub cols: Range<usize>,
    /// The K range of this split.
    pub k: Range<usize>,
}

/// The work decomposition of one grouped GEMM launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    offsets: Vec<usize>,
    m_tile_prefix: Vec<usize>,
    n: usize,
    k: usize,
    tile: Tile,
    split_k: usize,
    grid: usize,
    n_tiles: usize,
    k_tiles: usize,
}

/// The largest index the device computes with (i32 offsets and item numbers).
const DEVICE_INDEX_MAX: usize = i32::MAX as usize;

impl Schedule {
    /// The schedule for experts with `rows[e]` token rows each (in expert order, as `X` is sorted),
    /// `N` output columns, depth `K`, the tile, `split_k` (S, 1 for none, at most `ceil(K / tile.k)`)
    /// and `grid` persistent CTAs.
    pub fn new(
        rows: &[usize],
        n: usize,
        k: usize,
        tile: Tile,
        split_k: usize,
        grid: usize,
    ) -> Result<Schedule> {
        if n == 0 || k == 0 {
            return Err(unsupported(format!("an empty GEMM (N = {n}, K = {k})")));
        }
        if grid == 0 {
            return Err(unsupported("a grid of 0 CTAs".into()));
        }
        let n_tiles = n.div_ceil(tile.n);
        let k_tiles = k.div_ceil(tile.k);
        if split_k == 0 || split_k > k_tiles {
            return Err(unsupported(format!(
                "a split-K of {split_k} over {k_tiles} k-tiles (1 to {k_tiles})"
            )));
        }
        let mut offsets = Vec::with_capacity(rows.len() + 1);
        let mut m_tile_prefix = Vec::with_capacity(rows.len() + 1);
        let (mut off, mut tiles) = (0usize, 0usize);
        offsets.push(0);
        m_tile_prefix.push(0);
        for &r in rows {
            off = off
                .checked_add(r)
                .ok_or_else(|| unsupported("a row count overflow".into()))?;
            tiles += r.div_ceil(tile.m);
            offsets.push(off);
            m_tile_prefix.push(tiles);
        }
        let items = tiles
            .checked_mul(n_tiles)
            .and_then(|x| x.checked_mul(split_k))
            .ok_or_else(|| unsupported("an item count overflow".into()))?;
        if off > DEVICE_INDEX_MAX || items > DEVICE_INDEX_MAX || n > DEVICE_INDEX_MAX {
            return Err(unsupported(format!(
                "{off} rows and {items} work items (the device indexes with i32)"
            )));
        }
        Ok(Schedule {
            offsets,
            m_tile_prefix,
            n,
            k,
            tile,
            split_k,
            grid,
            n_tiles,
            k_tiles,
        })
    }

    /// The tile.
    pub fn tile(&self) -> Tile {
        self.tile
    }

    /// Number of experts.
    pub fn experts(&self) -> usize {
        self.offsets.len() - 1
    }

    /// The per-expert row offsets (`E + 1` entries, exclusive prefix sums; the device-resident array).
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// Exclusive prefix sums of the per-expert m-tile counts (`E + 1` entries): the array the O(log E)
    /// search runs over.
    pub fn m_tile_prefix(&self) -> &[usize] {
        &self.m_tile_prefix
    }

    /// Output-column tiles per expert.
    pub fn n_tiles(&self) -> usize {
        self.n_tiles
    }

    /// K tiles (of `tile.k`) in all.
    pub fn k_tiles(&self) -> usize {
        self.k_tiles
    }

    /// The split-K factor S.
    pub fn split_k(&self) -> usize {
        self.split_k
    }

    /// The number of persistent CTAs.
    pub fn grid(&self) -> usize {
        self.grid
    }

    /// Total number of work items.
    pub fn items(&self) -> usize {
        self.m_tile_prefix[self.experts()] * self.n_tiles * self.split_k
    }

    /// Number of items of expert `e` (0 for an empty expert or one out of range).
    fn items_of(&self, e: usize) -> usize {
        match (self.offsets.get(e), self.offsets.get(e + 1)) {
            (Some(a), Some(b)) => (b - a).div_ceil(self.tile.m) * self.n_tiles * self.split_k,
            _ => 0,
        }
    }

    /// The K range of split `s`: k-tiles `floor(s * k_tiles / S) .. floor((s + 1) * k_tiles / S)`,
    /// clipped to K.
    pub fn split_range(&self, s: usize) -> Range<usize> {
        let lo = s * self.k_tiles / self.split_k;
        let hi = (s + 1) * self.k_tiles / self.split_k;
        (lo * self.tile.k).min(self.k)..(hi * self.tile.k).min(self.k)
    }

    /// The item of expert `e` with index `local` among the expert's items (n-tile, then m-tile, then
    /// split).
    fn local_item(&self, e: usize, local: usize) -> WorkItem {
        let split = local % self.split_k;
        let tile = local / self.split_k;
        let m_tiles = (self.offsets[e + 1] - self.offsets[e]).div_ceil(self.tile.m);
        self.make(e, tile % m_tiles, tile / m_tiles, split)
    }

    /// The item `(e, m_tile, n_tile, split)` with its row, column and K ranges.
    fn make(&self, e: usize, m_tile: usize, n_tile: usize, split: usize) -> WorkItem {
        let r0 = self.offsets[e] + m_tile * self.tile.m;
        let c0 = n_tile * self.tile.n;
        WorkItem {
            expert: e,
            m_tile,
            n_tile,
            split,
            rows: r0..(r0 + self.tile.m).min(self.offsets[e + 1]),
            cols: c0..(c0 + self.tile.n).min(self.n),
            k: self.split_range(split),
        }
    }

    /// The item of linear index `i` (`None` past the end), found as a CTA finds it: an O(log E)
    /// binary search for the last expert `e` with `m_tile_prefix[e] * n_tiles * S <= i` (an empty
    /// expert has the same prefix as its successor, so the last such expert is the non-empty one).
    pub fn item(&self, i: usize) -> Option<WorkItem> {
        if i >= self.items() {
            return None;
        }
        let per_m_tile = self.n_tiles * self.split_k;
        let t = i / per_m_tile;
        // upper_bound(t) - 1 over the E + 1 prefixes: the first prefix > t, minus one.
        let e = self.m_tile_prefix.partition_point(|&p| p <= t) - 1;
        Some(self.local_item(e, i - self.m_tile_prefix[e] * per_m_tile))
    }

    /// Every item in linear order, by the explicit nested loops (expert, n-tile, m-tile, split): the
    /// specification [`Schedule::item`] and [`Schedule::walk`] are tested against.
    pub fn enumerate(&self) -> Vec<WorkItem> {
        let mut out = Vec::with_capacity(self.items());
        for e in 0..self.experts() {
            let m_tiles = (self.offsets[e + 1] - self.offsets[e]).div_ceil(self.tile.m);
            for n_tile in 0..self.n_tiles {
                for m_tile in 0..m_tiles {
                    for split in 0..self.split_k {
                        out.push(self.make(e, m_tile, n_tile, split));
                    }
                }
            }
        }
        out
    }

    /// The persistent walk of CTA `cta`: items `cta, cta + grid, ...`, found with the O(E) cursor
    /// over the offsets (no precomputed array; amortized over the walk). Empty for `cta >= grid`.
    pub fn walk(&self, cta: usize) -> Walk<'_> {
        Walk {
            sched: self,
            next: if cta < self.grid { cta } else { usize::MAX },
            expert: 0,
            before: 0,
        }
    }
}

/// The persistent walk of one CTA ([`Schedule::walk`]).
#[derive(Debug, Clone)]
pub struct Walk<'a> {
    sched: &'a Schedule,
    next: usize,
    /// The cursor: the expert the last item lay in, and the number of items before it.
    expert: usize,
    before: usize,
}

impl Iterator for Walk<'_> {
    type Item = WorkItem;

    fn next(&mut self) -> Option<WorkItem> {
        let s = self.sched;
        let i = self.next;
        if i >= s.items() {
            return None;
        }
        // Indices only grow, so the cursor only moves forward: O(E) over the whole walk.
        while self.expert < s.experts() && i >= self.before + s.items_of(self.expert) {
            self.before += s.items_of(self.expert);
            self.expert += 1;
        }
        self.next = i.saturating_add(s.grid);
        if self.expert < s.experts() {
            Some(s.local_item(self.expert, i - self.before))
        } else {
            None
        }
    }
}

/// The fixed split-K reduction: the partials of one output element in ascending split order,
/// `((p_0 + p_1) + p_2) + ...` in f32 (0 for none). The GPU's reduction must produce these bits.
pub fn split_k_sum(partials: &[f32]) -> f32 {
    match partials.split_first() {
        Some((first, rest)) => rest.iter().fold(*first, |acc, p| acc + p),
        None => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn tiles() -> impl Strategy<Value = Tile> {
        prop_oneof![
            (1usize..=4, 1usize..=32, 1usize..=8).prop_map(|(m, n, k)| Tile::prefill(
                64 * m,
                8 * n,
                16 * k
            )
            .unwrap()),
            (0usize..3, 1usize..=8)
                .prop_map(|(t, k)| Tile::decode([8, 16, 32][t], 16 * k).unwrap()),
        ]
    }

    /// Row counts: empty experts, one expert with most rows, M = 1, ragged tiles.
    fn row_counts() -> impl Strategy<Value = Vec<usize>> {
        prop_oneof![
            prop::collection::vec(0usize..200, 1..12),
            prop::collection::vec(prop_oneof![Just(0usize), Just(1), 0usize..5], 1..20),
            (
                prop::collection::vec(0usize..4, 1..16),
                300usize..900,
                any::<prop::sample::Index>()
            )
                .prop_map(|(mut v, big, at)| {
                    let i = at.index(v.len());
                    v[i] = big;
                    v
                }),
            Just(vec![1]),
            Just(vec![0, 0, 0]),
        ]
    }

    fn problem() -> impl Strategy<Value = (Schedule, Vec<usize>)> {
        (
            row_counts(),
            tiles(),
            1usize..300,
            1usize..600,
            1usize..8,
            1usize..200,
        )
            .prop_map(|(rows, tile, n, k, s, grid)| {
                let s = s.min(k.div_ceil(tile.k));
                (Schedule::new(&rows, n, k, tile, s, grid).unwrap(), rows)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        #[test]
        fn every_output_element_once_per_split((sched, rows) in problem()) {
            let total: usize = rows.iter().sum();
            let n = sched.n;
            let items = sched.enumerate();
            // cover[split][row * n + col]
            let mut cover = vec![vec![0u8; total * n]; sched.split_k()];
            for it in &items {
                for r in it.rows.clone() {
                    for c in it.cols.clone() {
                        cover[it.split][r * n + c] += 1;
                    }
                }
            }
            for (s, cov) in cover.iter().enumerate() {
                prop_assert!(cov.iter().all(|&x| x == 1), "split {} coverage", s);
            }
        }

        #[test]
        fn every_k_index_in_exactly_one_split((sched, _rows) in problem()) {
            let mut cov = vec![0u8; sched.k];
            for s in 0..sched.split_k() {
                let r = sched.split_range(s);
                prop_assert!(!r.is_empty());
                prop_assert_eq!(r.start % sched.tile().k, 0);
                for k in r {
                    cov[k] += 1;
                }
            }
            prop_assert!(cov.iter().all(|&x| x == 1));
            // And every item's K range is its split's.
            for it in sched.enumerate() {
                prop_assert_eq!(it.k.clone(), sched.split_range(it.split));
            }
        }

        #[test]
        fn items_stay_inside_their_expert((sched, rows) in problem()) {
            let off = sched.offsets();
            for it in sched.enumerate() {
                prop_assert!(rows[it.expert] > 0);
                prop_assert!(!it.rows.is_empty() && !it.cols.is_empty());
                prop_assert!(off[it.expert] <= it.rows.start && it.rows.end <= off[it.expert + 1]);
                prop_assert!(it.rows.len() <= sched.tile().m && it.cols.len() <= sched.tile().n);
                prop_assert!(it.cols.end <= sched.n);
            }
        }

        #[test]
        fn item_function_equals_enumeration((sched, _rows) in problem()) {
            let all = sched.enumerate();
            prop_assert_eq!(all.len(), sched.items());
            for (i, it) in all.iter().enumerate() {
                prop_assert_eq!(sched.item(i), Some(it.clone()), "item {}", i);
            }
            prop_assert_eq!(sched.item(all.len()), None);
            // The order is expert-major, then n-tile, then m-tile, then split.
            let key = |it: &WorkItem| (it.expert, it.n_tile, it.m_tile, it.split);
            prop_assert!(all.windows(2).all(|w| key(&w[0]) < key(&w[1])));
        }

        #[test]
        fn walk_visits_each_item_once((sched, _rows) in problem()) {
            let all = sched.enumerate();
            let mut seen = HashSet::new();
            for c in 0..sched.grid() {
                for (j, it) in sched.walk(c).enumerate() {
                    let i = c + j * sched.grid();
                    prop_assert_eq!(Some(&it), all.get(i), "cta {} step {}", c, j);
                    prop_assert!(seen.insert(i));
                }
            }
            prop_assert_eq!(seen.len(), all.len());
            prop_assert_eq!(sched.walk(sched.grid()).count(), 0);
        }
    }

    #[test]
    fn decode_swaps_a_and_b() {
        let t = Tile::decode(16, 128).unwrap();
        assert_eq!(t.mma_mn(), (64, 16));
        assert_eq!(t.orientation, Orientation::WeightsAsM);
        let p = Tile::prefill(128, 256, 64).unwrap();
        assert_eq!(p.mma_mn(), (128, 256));
        assert!(Tile::decode(24, 128).is_err());
        assert!(Tile::prefill(96, 128, 64).is_err());
        assert!(Tile::prefill(128, 12, 64).is_err());
        assert!(Tile::prefill(128, 128, 24).is_err());
    }

    #[test]
    fn a_worked_schedule() {
        // Experts with 3, 0 and 5 rows; N = 130 in 64-column tiles (3 n-tiles, the last 2 wide);
        // decode tiles of 8 tokens; K = 256 in 2 splits of 128.
        let t = Tile::decode(8, 64).unwrap();
        let s = Schedule::new(&[3, 0, 5], 130, 256, t, 2, 4).unwrap();
        assert_eq!(s.offsets(), &[0, 3, 3, 8]);
        assert_eq!(s.m_tile_prefix(), &[0, 1, 1, 2]);
        assert_eq!(s.items(), 2 * 3 * 2);
        let i7 = s.item(7).unwrap();
        assert_eq!(
            i7,
            WorkItem {
                expert: 2,
                m_tile: 0,
                n_tile: 0,
                split: 1,
                rows: 3..8,
                cols: 0..64,
                k: 128..256,
            }
        );
        let last = s.item(11).unwrap();
        assert_eq!((last.expert, last.n_tile, last.cols), (2, 2, 128..130));
        let walk: Vec<usize> = s.walk(3).map(|it| it.n_tile).collect();
        // items 3, 7, 11: expert 0 n-tile 1, expert 2 n-tile 0, expert 2 n-tile 2.
        assert_eq!(walk, vec![1, 0, 2]);
    }

    #[test]
    fn rejects_bad_shapes() {
        let t = Tile::prefill(128, 128, 64).unwrap();
        assert!(Schedule::new(&[4], 128, 128, t, 3, 132).is_err()); // 2 k-tiles
        assert!(Schedule::new(&[4], 128, 128, t, 0, 132).is_err());
        assert!(Schedule::new(&[4], 0, 128, t, 1, 132).is_err());
        assert!(Schedule::new(&[4], 128, 128, t, 1, 0).is_err());
        let empty = Schedule::new(&[], 128, 128, t, 1, 132).unwrap();
        assert_eq!(empty.items(), 0);
        assert_eq!(empty.walk(0).count(), 0);
    }

    #[test]
    fn split_k_sum_is_ascending() {
        assert_eq!(split_k_sum(&[]), 0.0);
        // 1e8 + 1 - 1e8: ascending gives 0 (1 is lost), another order gives 1.
        assert_eq!(split_k_sum(&[1e8, 1.0, -1e8]), 0.0);
        assert_eq!(split_k_sum(&[1e8, -1e8, 1.0]), 1.0);
    }

    /// The items, computed tile by tile with split partials reduced in order, reproduce the host
    /// reference (small integers, so every sum is exact).
    #[test]
    fn tiled_gemm_matches_reference() {
        use crate::gemm::reference::{bf16_from_f32, gemm_bf16, Grouped};
        let rows = [5usize, 0, 1, 70, 3];
        let (n, k) = (40usize, 96usize);
        let total: usize = rows.iter().sum();
        let x: Vec<u16> = (0..total * k)
            .map(|i| bf16_from_f32(((i * 7 % 11) as f32) - 5.0))
            .collect();
        let w: Vec<u16> = (0..rows.len() * n * k)
            .map(|i| bf16_from_f32(((i * 5 % 13) as f32) - 6.0))
            .collect();
        let g = Grouped::new(&rows, n, k);
        let want = gemm_bf16(&g, &x, &w).unwrap();
        for tile in [
            Tile::prefill(64, 16, 16).unwrap(),
            Tile::decode(8, 32).unwrap(),
        ] {
            let s = Schedule::new(&rows, n, k, tile, 3, 7).unwrap();
            let mut partial = vec![vec![0f32; total * n]; 3];
            for c in 0..s.grid() {
                for it in s.walk(c) {
                    for r in it.rows.clone() {
                        for col in it.cols.clone() {
                            let mut acc = 0f32;
                            for kk in it.k.clone() {
                                let a = crate::gemm::reference::bf16_to_f32(x[r * k + kk]);
                                let b = crate::gemm::reference::bf16_to_f32(
                                    w[(it.expert * n + col) * k + kk],
                                );
                                acc += a * b;
                            }
                            partial[it.split][r * n + col] = acc;
                        }
                    }
                }
            }
            for i in 0..total * n {
                let p: Vec<f32> = partial.iter().map(|v| v[i]).collect();
                assert_eq!(split_k_sum(&p) as f64, want[i], "element {i}");
            }
        }
    }
}
