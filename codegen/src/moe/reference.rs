//! The host reference of the route + permute kernels ([`super::permute`]), and the checker that
//! accepts a device's output up to the order of rows within a slot.
//!
//! The reference is deterministic: within a slot, rows are in `(t, j)` order (item `i = t * k + j`
//! ascending). The device orders a slot's rows by its atomics; no output bit depends on that order
//! (see [`super::permute`]), so [`check`] compares everything else exactly and each slot's rows as
//! a multiset.

use crate::{Error, Result};

/// The EPLB map the route reads (SPEC §6): `log2phy [E, max_replicas]` (slot of replica `r` of
/// expert `e`, `-1` padded) and `logcnt [E]` (replicas of each expert).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Map {
    /// `log2phy`, row-major `[E, max_replicas]`.
    pub log2phy: Vec<i32>,
    /// `logcnt`, `[E]`.
    pub logcnt: Vec<i32>,
    /// Replicas a row of `log2phy` holds.
    pub max_replicas: usize,
    /// Physical slots `R`.
    pub slots: usize,
}

impl Map {
    /// No EPLB: `E` slots, expert `e` in slot `e` (identity `log2phy`, one replica each).
    pub fn identity(experts: usize) -> Map {
        Map {
            log2phy: (0..experts as i32).collect(),
            logcnt: vec![1; experts],
            max_replicas: 1,
            slots: experts,
        }
    }

    /// Logical experts `E`.
    pub fn experts(&self) -> usize {
        self.logcnt.len()
    }

    /// The slot of item `i` of token `t` routed to `e`, or `None` where the id or the map is out
    /// of range (an error the route counts).
    pub fn slot(&self, e: i32, t: usize) -> Option<usize> {
        let e = usize::try_from(e).ok().filter(|e| *e < self.experts())?;
        let cnt = usize::try_from(self.logcnt[e])
            .ok()
            .filter(|c| (1..=self.max_replicas).contains(c))?;
        let s = *self.log2phy.get(e * self.max_replicas + t % cnt)?;
        usize::try_from(s).ok().filter(|s| *s < self.slots)
    }

    fn check(&self) -> Result<()> {
        if self.log2phy.len() != self.experts() * self.max_replicas {
            return Err(Error::BufferSize {
                name: "log2phy".into(),
                expected: self.experts() * self.max_replicas * 4,
                got: self.log2phy.len() * 4,
            });
        }
        Ok(())
    }
}

/// What the permute produces (the device's outputs read back, or the reference's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permuted {
    /// Slot of each item (`-1` for an out-of-range one), `[n]`.
    pub slot: Vec<i32>,
    /// Items per slot, `[R]`.
    pub counts: Vec<u32>,
    /// Row offsets, `[R + 1]` (exclusive prefix sums of `counts`).
    pub offsets: Vec<i32>,
    /// Item of each expert-sorted row, `[offsets[R]]`.
    pub row_of: Vec<i32>,
    /// Gathered rows (bf16 bits), `[offsets[R], H]`.
    pub xs: Vec<u16>,
    /// Items skipped as out of range.
    pub errors: u32,
}

/// Kernel A on the host: each item's slot (`-1` where out of range), the per-slot counts and the
/// error count, with `load` (the EPLB load counters, `[R]`) counting each routed item.
pub fn route(topk_ids: &[i32], k: usize, map: &Map, load: &mut [u32]) -> Result<Routed> {
    map.check()?;
    if k == 0 || !topk_ids.len().is_multiple_of(k) {
        return Err(Error::BufferSize {
            name: "topk_ids".into(),
            expected: k * 4,
            got: topk_ids.len() * 4,
        });
    }
    if load.len() != map.slots {
        return Err(Error::BufferSize {
            name: "load".into(),
            expected: map.slots * 4,
            got: load.len() * 4,
        });
    }
    let mut r = Routed {
        slot: Vec::with_capacity(topk_ids.len()),
        counts: vec![0; map.slots],
        errors: 0,
    };
    for (i, &e) in topk_ids.iter().enumerate() {
        match map.slot(e, i / k) {
            Some(s) => {
                r.slot.push(s as i32);
                r.counts[s] += 1;
                load[s] = load[s].wrapping_add(1);
            }
            None => {
                r.slot.push(-1);
                r.errors += 1;
            }
        }
    }
    Ok(r)
}

/// Kernel A's outputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routed {
    /// Slot of each item, `-1` where out of range.
    pub slot: Vec<i32>,
    /// Items per slot.
    pub counts: Vec<u32>,
    /// Items out of range.
    pub errors: u32,
}

/// Kernel B on the host: `offsets[s] = sum(counts[..s])`, `R + 1` of them.
pub fn offsets(counts: &[u32]) -> Vec<i32> {
    let mut out = Vec::with_capacity(counts.len() + 1);
    let mut acc = 0i64;
    out.push(0);
    for &c in counts {
        acc += i64::from(c);
        out.push(acc as i32);
    }
    out
}

/// The permute on the host: `x` bf16 bits `[T, hidden]`, `topk_ids [T, k]`; `load` counts as
/// in [`route`]. Within a slot, rows are in item order.
pub fn permute(
    x: &[u16],
    hidden: usize,
    topk_ids: &[i32],
    k: usize,
    map: &Map,
    load: &mut [u32],
) -> Result<Permuted> {
    let r = route(topk_ids, k, map, load)?;
    let tokens = topk_ids.len() / k;
    if x.len() != tokens * hidden {
        return Err(Error::BufferSize {
            name: "x".into(),
            expected: tokens * hidden * 2,
            got: x.len() * 2,
        });
    }
    let offsets = offsets(&r.counts);
    let total = offsets.last().copied().unwrap_or(0) as usize;
    let mut cursor = vec![0usize; map.slots];
    let mut row_of = vec![0i32; total];
    let mut xs = vec![0u16; total * hidden];
    for (i, &s) in r.slot.iter().enumerate() {
        let Ok(s) = usize::try_from(s) else { continue };
        let pos = offsets[s] as usize + cursor[s];
        cursor[s] += 1;
        row_of[pos] = i as i32;
        let t = i / k;
        xs[pos * hidden..(pos + 1) * hidden].copy_from_slice(&x[t * hidden..(t + 1) * hidden]);
    }
    Ok(Permuted {
        slot: r.slot,
        counts: r.counts,
        offsets,
        row_of,
        xs,
        errors: r.errors,
    })
}

/// Check a device's output `got` against the reference `want` of the same inputs (`x` bf16 bits
/// `[T, hidden]`, `k` choices a token): slots, counts, offsets and the error count exactly; per
/// slot, the same multiset of items in `row_of`; each `xs` row equal to `x[row_of[p] / k]`. Rows
/// of `row_of` and `xs` past `offsets[R]` are not looked at. Returns the first difference found.
pub fn check(
    want: &Permuted,
    got: &Permuted,
    x: &[u16],
    hidden: usize,
    k: usize,
) -> std::result::Result<(), String> {
    if got.slot != want.slot {
        let i = (0..want.slot.len().min(got.slot.len()))
            .find(|&i| got.slot[i] != want.slot[i])
            .unwrap_or(want.slot.len().min(got.slot.len()));
        return Err(format!(
            "slot differs at item {i}: got {:?}, want {:?}",
            got.slot.get(i),
            want.slot.get(i)
        ));
    }
    if got.counts != want.counts {
        return Err(format!(
            "counts differ: got {:?}, want {:?}",
            got.counts, want.counts
        ));
    }
    if got.offsets != want.offsets {
        return Err(format!(
            "offsets differ: got {:?}, want {:?}",
            got.offsets, want.offsets
        ));
    }
    if got.errors != want.errors {
        return Err(format!(
            "error count differs: got {}, want {}",
            got.errors, want.errors
        ));
    }
    let total = want.offsets.last().copied().unwrap_or(0) as usize;
    if got.row_of.len() < total || got.xs.len() < total * hidden {
        return Err(format!(
            "row_of has {} rows and xs {} values; {total} rows of {hidden} needed",
            got.row_of.len(),
            got.xs.len()
        ));
    }
    for s in 0..want.counts.len() {
        let (a, b) = (want.offsets[s] as usize, want.offsets[s + 1] as usize);
        let mut g = got.row_of[a..b].to_vec();
        let mut w = want.row_of[a..b].to_vec();
        g.sort_unstable();
        w.sort_unstable();
        if g != w {
            return Err(format!(
                "slot {s}: rows {a}..{b} hold items {g:?}, want {w:?}"
            ));
        }
    }
    for p in 0..total {
        let t = got.row_of[p] as usize / k.max(1);
        let row = &got.xs[p * hidden..(p + 1) * hidden];
        if x.get(t * hidden..(t + 1) * hidden) != Some(row) {
            let c = (0..hidden)
                .find(|&c| x.get(t * hidden + c) != Some(&row[c]))
                .unwrap_or(0);
            return Err(format!(
                "xs row {p} (item {}, token {t}) differs from x at column {c}",
                got.row_of[p]
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// E = 3 experts on R = 5 slots: expert 0 has replicas in slots 3 and 0, expert 1 in slot 1,
    /// expert 2 in slots 2 and 4.
    fn replicated() -> Map {
        Map {
            log2phy: vec![3, 0, 1, -1, 2, 4],
            logcnt: vec![2, 1, 2],
            max_replicas: 2,
            slots: 5,
        }
    }

    #[test]
    fn counts_are_the_histogram_of_slots_and_replicas_go_by_token() {
        let map = replicated();
        // T = 4, k = 2.
        let ids = [0, 2, 0, 1, 0, 2, 2, 2];
        let mut load = vec![10; 5];
        let r = route(&ids, 2, &map, &mut load).unwrap();
        // Token t takes replica t mod logcnt[e].
        assert_eq!(r.slot, vec![3, 2, 0, 1, 3, 2, 4, 4]);
        let mut hist = vec![0u32; 5];
        for &s in &r.slot {
            hist[s as usize] += 1;
        }
        assert_eq!(r.counts, hist);
        assert_eq!(load, vec![11, 11, 12, 12, 12]);
        assert_eq!(r.errors, 0);
    }

    #[test]
    fn identity_map_routes_to_the_expert_itself() {
        let map = Map::identity(4);
        let mut load = vec![0; 4];
        let r = route(&[3, 1, 1, 0], 1, &map, &mut load).unwrap();
        assert_eq!(r.slot, vec![3, 1, 1, 0]);
        assert_eq!(r.counts, vec![1, 2, 0, 1]);
    }

    #[test]
    fn out_of_range_ids_and_map_entries_are_counted_and_skipped() {
        let mut map = replicated();
        map.logcnt[1] = 2; // replica 1 of expert 1 is the -1 pad
        let mut load = vec![0; 5];
        let ids = [-1, 3, 1, 1, 7, 1, 0, 0];
        let r = route(&ids, 2, &map, &mut load).unwrap();
        // Token 1 takes replica 1 of expert 1: the pad; token 2 replica 0, slot 1.
        assert_eq!(r.slot, vec![-1, -1, -1, -1, -1, 1, 0, 0]);
        assert_eq!(r.errors, 5);
        assert_eq!(r.counts, vec![2, 1, 0, 0, 0]);
        assert_eq!(load, vec![2, 1, 0, 0, 0]);
    }

    #[test]
    fn offsets_are_prefix_sums_and_row_of_is_a_permutation() {
        let map = replicated();
        let (t, k, h) = (6, 2, 8);
        let ids: Vec<i32> = (0..t * k).map(|i| ((i * 7 + 1) % 3) as i32).collect();
        let x: Vec<u16> = (0..t * h).map(|v| v as u16).collect();
        let mut load = vec![0; 5];
        let p = permute(&x, h, &ids, k, &map, &mut load).unwrap();
        assert_eq!(p.offsets[0], 0);
        for s in 0..5 {
            assert_eq!(p.offsets[s + 1] - p.offsets[s], p.counts[s] as i32);
        }
        let mut rows = p.row_of.clone();
        rows.sort_unstable();
        assert_eq!(rows, (0..(t * k) as i32).collect::<Vec<_>>());
        for (pos, &i) in p.row_of.iter().enumerate() {
            let s = p.slot[i as usize] as usize;
            assert!((p.offsets[s] as usize..p.offsets[s + 1] as usize).contains(&pos));
            let tok = i as usize / k;
            assert_eq!(&p.xs[pos * h..(pos + 1) * h], &x[tok * h..(tok + 1) * h]);
        }
        // Within a slot, items ascend.
        for s in 0..5 {
            let r = &p.row_of[p.offsets[s] as usize..p.offsets[s + 1] as usize];
            assert!(r.windows(2).all(|w| w[0] < w[1]));
        }
        assert!(check(&p, &p, &x, h, k).is_ok());
    }

    /// A reference output and its inputs: `t` tokens, `k` choices over the replicated map.
    fn case(t: usize, k: usize, seed: u64) -> (Permuted, Vec<u16>) {
        let map = replicated();
        let h = 4;
        let mut s = seed | 1;
        let ids: Vec<i32> = (0..t * k)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 3) as i32
            })
            .collect();
        let x: Vec<u16> = (0..t * h).map(|v| (v * 31 + 7) as u16).collect();
        let mut load = vec![0; 5];
        (permute(&x, h, &ids, k, &map, &mut load).unwrap(), x)
    }

    /// Apply `perm` (one shuffle key per row) within each slot, to `row_of` and `xs` together.
    fn shuffle_within_slots(p: &Permuted, keys: &[u64], h: usize) -> Permuted {
        let mut q = p.clone();
        for s in 0..p.counts.len() {
            let (a, b) = (p.offsets[s] as usize, p.offsets[s + 1] as usize);
            let mut order: Vec<usize> = (a..b).collect();
            order.sort_by_key(|&r| (keys[r % keys.len()], r));
            for (dst, &src) in (a..b).zip(&order) {
                q.row_of[dst] = p.row_of[src];
                q.xs[dst * h..(dst + 1) * h].copy_from_slice(&p.xs[src * h..(src + 1) * h]);
            }
        }
        q
    }

    proptest! {
        #[test]
        fn checker_accepts_any_within_slot_order(
            t in 1usize..20, k in 1usize..4, seed in any::<u64>(),
            keys in proptest::collection::vec(any::<u64>(), 1..64),
        ) {
            let (p, x) = case(t, k, seed);
            let q = shuffle_within_slots(&p, &keys, 4);
            prop_assert!(check(&p, &q, &x, 4, k).is_ok());
        }

        #[test]
        fn checker_rejects_rows_swapped_across_slots(
            t in 2usize..20, k in 1usize..4, seed in any::<u64>(), pick in any::<usize>(),
        ) {
            let (p, x) = case(t, k, seed);
            // Two rows of different slots, swapped (items and their xs rows together).
            let n = p.row_of.len();
            let a = pick % n;
            let sa = p.slot[p.row_of[a] as usize];
            let b = (0..n).map(|d| (a + d) % n).find(|&b| p.slot[p.row_of[b] as usize] != sa);
            prop_assume!(b.is_some());
            let b = b.unwrap();
            let mut q = p.clone();
            q.row_of.swap(a, b);
            for c in 0..4 {
                q.xs.swap(a * 4 + c, b * 4 + c);
            }
            prop_assert!(check(&p, &q, &x, 4, k).is_err());
        }
    }

    #[test]
    fn checker_rejects_a_wrong_xs_row_and_wrong_counts() {
        let (p, x) = case(5, 2, 9);
        let mut q = p.clone();
        q.xs[0] ^= 1;
        assert!(check(&p, &q, &x, 4, 2).is_err());
        let mut q = p.clone();
        q.errors += 1;
        assert!(check(&p, &q, &x, 4, 2).is_err());
        let mut q = p.clone();
        q.offsets[1] += 1;
        assert!(check(&p, &q, &x, 4, 2).is_err());
    }
}
