//! Move plans: how one layer's expert slots go from one placement to another, in place, on every
//! rank at once (SPEC §6, vLLM's `rearrange_expert_weights_inplace` semantics, with moeforge's
//! choices).
//!
//! A [`SlotMap`] is one layer's validated `phy2log`: `R` physical slots on `P` ranks (slot `p` on
//! rank `p / (R/P)`), every logical expert held at least once. A [`MovePlan`] from an old map to a
//! new one says, for each rank:
//! - which experts it sends to which peer and receives from which peer (one primary receive per
//!   (rank, expert) into a transfer buffer; senders chosen as SPEC §6 says, spreading the receivers
//!   of a hot expert over its holders), both sides sorted by expert id so messages pair up;
//! - the local copies, in an order that never overwrites a slot whose old expert is still to be
//!   read. Only slots whose expert changes are read or written (except a source slot, read once);
//!   replicas are filled from one source; cycles are broken with one expert of scratch.
//!
//! Plans are pure host data, validated when made: executing one cannot fail for a reason of the
//! plan. The store (`crate::store`) runs them over host or device storage.

use crate::{Error, Result};

/// One layer's validated placement: slot -> logical expert.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SlotMap {
    phy2log: Vec<usize>,
    experts: usize,
}

impl SlotMap {
    /// Validate `phy2log` for `experts` logical experts: every entry below `experts`, every expert
    /// present at least once.
    pub fn new(phy2log: Vec<usize>, experts: usize) -> Result<SlotMap> {
        if phy2log.len() < experts {
            return Err(Error::Placement(format!(
                "{} slots cannot hold {experts} experts",
                phy2log.len()
            )));
        }
        let mut held = vec![false; experts];
        for (p, &e) in phy2log.iter().enumerate() {
            let h = held.get_mut(e).ok_or_else(|| {
                Error::Placement(format!(
                    "slot {p} holds expert {e}, but there are {experts} experts"
                ))
            })?;
            *h = true;
        }
        if let Some(e) = held.iter().position(|h| !h) {
            return Err(Error::Placement(format!(
                "logical expert {e} has no replica (no slot holds it)"
            )));
        }
        Ok(SlotMap { phy2log, experts })
    }

    /// `R = E` slots, slot `p` holding expert `p`.
    pub fn identity(experts: usize) -> SlotMap {
        SlotMap {
            phy2log: (0..experts).collect(),
            experts,
        }
    }

    /// From a signed row (as in plan JSON).
    pub fn from_i64(row: &[i64], experts: usize) -> Result<SlotMap> {
        let v = row
            .iter()
            .enumerate()
            .map(|(p, &e)| {
                usize::try_from(e).map_err(|_| {
                    Error::Placement(format!("slot {p} holds expert {e}, which is negative"))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        SlotMap::new(v, experts)
    }

    /// Slot -> logical expert.
    pub fn phy2log(&self) -> &[usize] {
        &self.phy2log
    }

    /// Physical slots (R).
    pub fn slots(&self) -> usize {
        self.phy2log.len()
    }

    /// Logical experts (E).
    pub fn experts(&self) -> usize {
        self.experts
    }

    /// Replicas per logical expert.
    pub fn logcnt(&self) -> Vec<usize> {
        let mut c = vec![0; self.experts];
        for &e in &self.phy2log {
            c[e] += 1;
        }
        c
    }

    /// The slots of each logical expert, ascending (replica `r` of `e` is `log2phy()[e][r]`).
    pub fn log2phy(&self) -> Vec<Vec<usize>> {
        let mut m = vec![Vec::new(); self.experts];
        for (p, &e) in self.phy2log.iter().enumerate() {
            m[e].push(p);
        }
        m
    }
}

/// `bytes` (`experts` equal expert-major parts) placed as `phy2log`: part `p` of the result is part
/// `phy2log[p]` of the input. What loading a checkpoint for a placement reads, and so what a
/// rearrangement must produce.
pub fn place_bytes(bytes: &[u8], experts: usize, phy2log: &[usize]) -> Vec<u8> {
    let n = bytes.len() / experts.max(1);
    let mut out = Vec::with_capacity(n * phy2log.len());
    for &p in phy2log {
        if let Some(part) = bytes.get(p * n..(p + 1) * n) {
            out.extend_from_slice(part);
        }
    }
    out
}

/// Every tensor of a checkpoint placed as `phy2log` ([`place_bytes`]).
pub fn place_tensors(
    tensors: &std::collections::HashMap<String, Vec<u8>>,
    experts: usize,
    phy2log: &[usize],
) -> std::collections::HashMap<String, Vec<u8>> {
    tensors
        .iter()
        .map(|(k, v)| (k.clone(), place_bytes(v, experts, phy2log)))
        .collect()
}

/// Where a local copy reads or writes: a slot of this rank (local index), the transfer buffer
/// (received experts, by index), or the one-expert scratch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Loc {
    /// Local slot index (`0..R/P`).
    Slot(usize),
    /// Index into the rank's transfer buffer.
    Transfer(usize),
    /// The one-expert scratch.
    Scratch,
}

/// One expert crossing ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Transfer {
    /// The other rank (EP rank).
    pub peer: usize,
    /// The logical expert.
    pub expert: usize,
    /// Sends: the local slot read; receives: the transfer-buffer index written.
    pub at: usize,
}

/// One message of an exchange: `count` consecutive experts from `at` (sends: local slots;
/// receives: transfer-buffer indices), to or from `peer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Message {
    /// The other rank (EP rank).
    pub peer: usize,
    /// First slot (sends) or transfer index (receives).
    pub at: usize,
    /// Experts in the message (at least 1).
    pub count: usize,
}

/// One expert's bytes copied on a rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Copy {
    /// Source.
    pub from: Loc,
    /// Destination.
    pub to: Loc,
}

/// What one rank does.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RankMoves {
    /// Sends, sorted by (peer, expert).
    pub sends: Vec<Transfer>,
    /// Receives, sorted by (peer, expert); `at` is 0, 1, ... in this order.
    pub recvs: Vec<Transfer>,
    /// Local copies, in execution order (after the exchange completes).
    pub copies: Vec<Copy>,
}

impl RankMoves {
    /// Experts the transfer buffer must hold.
    pub fn transfer_experts(&self) -> usize {
        self.recvs.len()
    }

    /// Whether the scratch expert is used.
    pub fn uses_scratch(&self) -> bool {
        self.copies.iter().any(|c| c.to == Loc::Scratch)
    }
}

/// A validated plan from one placement to another over `ranks` ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MovePlan {
    old: SlotMap,
    new: SlotMap,
    ranks: usize,
    per_rank: Vec<RankMoves>,
}

impl MovePlan {
    /// Plan moving `old` to `new` over `ranks` ranks (slot `p` on rank `p / (R/ranks)`).
    pub fn new(old: &SlotMap, new: &SlotMap, ranks: usize) -> Result<MovePlan> {
        let r = old.slots();
        if new.slots() != r || new.experts() != old.experts() {
            return Err(Error::Placement(format!(
                "the new placement has {} slots of {} experts, the layer {r} slots of {}",
                new.slots(),
                new.experts(),
                old.experts()
            )));
        }
        if ranks == 0 || !r.is_multiple_of(ranks) {
            return Err(Error::Placement(format!(
                "{r} slots do not divide over {ranks} ranks"
            )));
        }
        let local = r / ranks;
        let rank_of = |p: usize| p / local;
        let e_n = old.experts();
        // holders[e]: ranks holding e in old, ascending, each with its first local slot.
        let mut holders: Vec<Vec<(usize, usize)>> = vec![Vec::new(); e_n];
        for (p, &e) in old.phy2log().iter().enumerate() {
            let k = rank_of(p);
            if holders[e].last().is_none_or(|h| h.0 != k) {
                holders[e].push((k, p % local));
            }
        }
        // needers[e]: ranks needing e in new that lack it in old, ascending.
        let mut needers: Vec<Vec<usize>> = vec![Vec::new(); e_n];
        for (p, &e) in new.phy2log().iter().enumerate() {
            let k = rank_of(p);
            let has = holders[e].iter().any(|h| h.0 == k);
            if !has && needers[e].last() != Some(&k) {
                needers[e].push(k);
            }
        }
        let mut per_rank = vec![RankMoves::default(); ranks];
        for e in 0..e_n {
            let s = &holders[e];
            let rr = &needers[e];
            let n = rr.len() / s.len().max(1);
            for (j, &dst) in rr.iter().enumerate() {
                // SPEC §6: receiver j takes S[j / n] for j < |S| n, else S[j - |S| n].
                let pick = if n > 0 && j < s.len() * n {
                    j / n
                } else {
                    j - s.len() * n
                };
                let (src, slot) = s[pick];
                per_rank[src].sends.push(Transfer {
                    peer: dst,
                    expert: e,
                    at: slot,
                });
                per_rank[dst].recvs.push(Transfer {
                    peer: src,
                    expert: e,
                    at: 0,
                });
            }
        }
        for (k, rm) in per_rank.iter_mut().enumerate() {
            rm.sends.sort_by_key(|t| (t.peer, t.expert));
            rm.recvs.sort_by_key(|t| (t.peer, t.expert));
            for (i, t) in rm.recvs.iter_mut().enumerate() {
                t.at = i;
            }
            let o = &old.phy2log()[k * local..(k + 1) * local];
            let w = &new.phy2log()[k * local..(k + 1) * local];
            rm.copies = local_copies(o, w, &rm.recvs, e_n)?;
        }
        Ok(MovePlan {
            old: old.clone(),
            new: new.clone(),
            ranks,
            per_rank,
        })
    }

    /// The placement moved from.
    pub fn old(&self) -> &SlotMap {
        &self.old
    }

    /// The placement moved to.
    pub fn new_map(&self) -> &SlotMap {
        &self.new
    }

    /// Ranks.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Slots per rank.
    pub fn local_slots(&self) -> usize {
        self.old.slots() / self.ranks
    }

    /// One rank's moves.
    pub fn rank(&self, k: usize) -> Option<&RankMoves> {
        self.per_rank.get(k)
    }

    /// Slots whose expert changes (the slots written).
    pub fn changed_slots(&self) -> usize {
        self.old
            .phy2log()
            .iter()
            .zip(self.new.phy2log())
            .filter(|(a, b)| a != b)
            .count()
    }

    /// Rank `k`'s sends and receives as messages, in the order of its transfers: the transfers of one
    /// pair of ranks merge into one message while the sender's slots and the receiver's transfer
    /// indices both run on by one. Both ends derive the same boundaries from the plan, so the
    /// messages of a pair match one to one, in order (as NCCL matches them). One large message
    /// instead of one per expert is what lets NCCL reach its bandwidth (`bench --gpu --eplb`: 16
    /// messages of one exchange moved 275 GB/s between two H200s, one message 353).
    pub fn messages(&self, k: usize) -> Result<(Vec<Message>, Vec<Message>)> {
        let me = self
            .rank(k)
            .ok_or_else(|| Error::Placement(format!("the plan has no rank {k}")))?;
        let pair = |from: usize, to: usize| -> Result<(Vec<usize>, Vec<usize>)> {
            let (Some(a), Some(b)) = (self.rank(from), self.rank(to)) else {
                return Err(Error::Placement(format!("no ranks {from} and {to}")));
            };
            let s: Vec<usize> = a
                .sends
                .iter()
                .filter(|t| t.peer == to)
                .map(|t| t.at)
                .collect();
            let r: Vec<usize> = b
                .recvs
                .iter()
                .filter(|t| t.peer == from)
                .map(|t| t.at)
                .collect();
            if s.len() != r.len() {
                return Err(Error::Placement(format!(
                    "rank {from} sends {} experts to rank {to}, which receives {}",
                    s.len(),
                    r.len()
                )));
            }
            Ok((s, r))
        };
        // Runs of a pair: (index of the first transfer, length).
        let runs = |s: &[usize], r: &[usize]| -> Vec<(usize, usize)> {
            let mut out: Vec<(usize, usize)> = Vec::new();
            for i in 0..s.len() {
                match out.last_mut() {
                    Some((first, n))
                        // (The last run always ends at `i`: runs cover `0..i`.)
                        if s[i] == s[i - 1] + 1 && r[i] == r[i - 1] + 1 =>
                    {
                        *n += 1
                    }
                    _ => out.push((i, 1)),
                }
            }
            out
        };
        let mut peers: Vec<usize> = me.sends.iter().chain(&me.recvs).map(|t| t.peer).collect();
        peers.sort_unstable();
        peers.dedup();
        let (mut sends, mut recvs) = (Vec::new(), Vec::new());
        for &q in &peers {
            let (s, r) = pair(k, q)?;
            for (i, n) in runs(&s, &r) {
                sends.push(Message {
                    peer: q,
                    at: s[i],
                    count: n,
                });
            }
            let (s, r) = pair(q, k)?;
            for (i, n) in runs(&s, &r) {
                recvs.push(Message {
                    peer: q,
                    at: r[i],
                    count: n,
                });
            }
        }
        Ok((sends, recvs))
    }

    /// Experts sent from rank `a` to rank `b`, for every pair (`[a][b]`).
    pub fn experts_between(&self) -> Vec<Vec<usize>> {
        let mut m = vec![vec![0; self.ranks]; self.ranks];
        for (a, rm) in self.per_rank.iter().enumerate() {
            for t in &rm.sends {
                m[a][t.peer] += 1;
            }
        }
        m
    }
}

/// The local copies of one rank: `old`/`new` are its slots' experts, `recvs` the experts it
/// receives (transfer index = position).
fn local_copies(
    old: &[usize],
    new: &[usize],
    recvs: &[Transfer],
    experts: usize,
) -> Result<Vec<Copy>> {
    let n = old.len();
    // A copy of expert e that is final and never overwritten: a received one, or an unchanged slot.
    let mut stable: Vec<Option<Loc>> = vec![None; experts];
    for t in recvs {
        stable[t.expert] = Some(Loc::Transfer(t.at));
    }
    for p in 0..n {
        if old[p] == new[p] && stable[old[p]].is_none() {
            stable[old[p]] = Some(Loc::Slot(p));
        }
    }
    let changed: Vec<usize> = (0..n).filter(|&p| old[p] != new[p]).collect();
    // source[e]: where e's old bytes are read from when no stable copy exists (the lowest changed
    // slot holding it; later the scratch).
    let mut source: Vec<Option<Loc>> = vec![None; experts];
    for &p in &changed {
        if stable[old[p]].is_none() && source[old[p]].is_none() {
            source[old[p]] = Some(Loc::Slot(p));
        }
    }
    // A changed slot holding some e's only source is blocked until e has a final copy.
    let needed: Vec<bool> = {
        let mut v = vec![false; experts];
        for &p in &changed {
            v[new[p]] = true;
        }
        v
    };
    let blocked = |p: usize, source: &[Option<Loc>], stable: &[Option<Loc>]| {
        let e = old[p];
        needed[e] && stable[e].is_none() && source[e] == Some(Loc::Slot(p))
    };
    let mut written = vec![false; n];
    let mut left = changed.len();
    let mut out = Vec::new();
    let mut scratch_holds: Option<usize> = None;
    while left > 0 {
        let mut progress = false;
        for &p in &changed {
            if written[p] || blocked(p, &source, &stable) {
                continue;
            }
            let e = new[p];
            let from = match stable[e].or(source[e]) {
                Some(l) => l,
                None => {
                    return Err(Error::Placement(format!(
                        "logical expert {e} is needed but no slot holds it"
                    )))
                }
            };
            out.push(Copy {
                from,
                to: Loc::Slot(p),
            });
            if from == Loc::Scratch {
                scratch_holds = None;
            }
            written[p] = true;
            left -= 1;
            progress = true;
            // p now holds e for good: later replicas read it, and e's old source is free.
            stable[e] = Some(Loc::Slot(p));
        }
        if left > 0 && !progress {
            // Only cycles remain (each blocked slot's expert is needed by exactly one other blocked
            // slot): stage the lowest one's expert in the scratch, which the cycle consumes before
            // it is needed again.
            if scratch_holds.is_some() {
                return Err(Error::Placement(
                    "internal: a second cycle while the scratch is in use".into(),
                ));
            }
            let p = changed
                .iter()
                .copied()
                .find(|&p| !written[p])
                .ok_or_else(|| Error::Placement("internal: no slot left".into()))?;
            out.push(Copy {
                from: Loc::Slot(p),
                to: Loc::Scratch,
            });
            source[old[p]] = Some(Loc::Scratch);
            scratch_holds = Some(old[p]);
        }
    }
    Ok(out)
}

/// Run one rank's plan over plain slots (`Vec` per slot), the reference the storage executors are
/// tested against: `slots` is the rank's local slots, `received` the transfer buffer.
pub fn apply_local<T: Clone>(slots: &mut [T], received: &[T], copies: &[Copy]) -> Result<()> {
    let mut scratch: Option<T> = None;
    for c in copies {
        let v = match c.from {
            Loc::Slot(p) => slots.get(p).cloned(),
            Loc::Transfer(k) => received.get(k).cloned(),
            Loc::Scratch => scratch.clone(),
        }
        .ok_or_else(|| Error::Placement(format!("copy from {:?}: nothing there", c.from)))?;
        match c.to {
            Loc::Slot(p) => {
                *slots
                    .get_mut(p)
                    .ok_or_else(|| Error::Placement(format!("copy to slot {p}: out of range")))? = v
            }
            Loc::Scratch => scratch = Some(v),
            Loc::Transfer(_) => {
                return Err(Error::Placement("a copy into the transfer buffer".into()))
            }
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Simulate every rank: slots carry their logical id as a canary.
    fn simulate(plan: &MovePlan) -> Vec<usize> {
        let local = plan.local_slots();
        let old = plan.old().phy2log();
        let mut out = Vec::new();
        for k in 0..plan.ranks() {
            let rm = plan.rank(k).cloned().unwrap_or_default();
            // Received experts: what the sender's slot held before anything moved.
            let received: Vec<usize> = rm
                .recvs
                .iter()
                .map(|t| {
                    let s = plan.rank(t.peer).cloned().unwrap_or_default();
                    let send = s
                        .sends
                        .iter()
                        .find(|x| x.peer == k && x.expert == t.expert)
                        .copied()
                        .unwrap_or(Transfer {
                            peer: 0,
                            expert: usize::MAX,
                            at: 0,
                        });
                    if send.expert == usize::MAX {
                        usize::MAX
                    } else {
                        old[t.peer * local + send.at]
                    }
                })
                .collect();
            let mut slots = old[k * local..(k + 1) * local].to_vec();
            apply_local(&mut slots, &received, &rm.copies).unwrap_or_default();
            out.extend(slots);
        }
        out
    }

    #[test]
    fn validation_names_the_problem() {
        assert!(
            matches!(SlotMap::new(vec![0, 1, 5], 3), Err(Error::Placement(m)) if m.contains("slot 2 holds expert 5"))
        );
        assert!(
            matches!(SlotMap::new(vec![0, 0, 1], 3), Err(Error::Placement(m)) if m.contains("expert 2 has no replica"))
        );
        assert!(
            matches!(SlotMap::from_i64(&[0, -1, 1], 2), Err(Error::Placement(m)) if m.contains("negative"))
        );
        let a = SlotMap::new(vec![0, 1, 2], 3).unwrap();
        assert!(MovePlan::new(&a, &a, 2).is_err(), "3 slots over 2 ranks");
        let b = SlotMap::new(vec![0, 1, 2, 2], 3).unwrap();
        assert!(MovePlan::new(&a, &b, 1).is_err(), "slot counts differ");
    }

    #[test]
    fn a_cycle_uses_one_expert_of_scratch_and_touches_only_changed_slots() {
        let old = SlotMap::new(vec![0, 1, 2, 3], 4).unwrap();
        let new = SlotMap::new(vec![1, 2, 0, 3], 4).unwrap();
        let plan = MovePlan::new(&old, &new, 1).unwrap();
        let rm = plan.rank(0).cloned().unwrap_or_default();
        assert!(rm.uses_scratch());
        assert_eq!(rm.copies.len(), 4, "3 writes + 1 staging: {:?}", rm.copies);
        assert!(rm
            .copies
            .iter()
            .all(|c| c.to != Loc::Slot(3) && c.from != Loc::Slot(3)));
        assert_eq!(simulate(&plan), vec![1, 2, 0, 3]);
    }

    #[test]
    fn senders_spread_over_holders_as_spec_says() {
        // Expert 0 held on ranks 0 and 1; ranks 2, 3, 4, 5 need it: n = 2, so 2,3 <- 0 and 4,5 <- 1.
        let old = SlotMap::new(vec![0, 0, 1, 2, 3, 4], 5).unwrap();
        let plan = MovePlan::new(&old, &old, 6).unwrap();
        assert_eq!(plan.changed_slots(), 0);
        let old = SlotMap::new(vec![0, 1, 0, 2, 3, 4], 5).unwrap();
        let new = SlotMap::new(vec![1, 2, 3, 4, 0, 0], 5).unwrap();
        // 6 ranks of 1 slot: 0 held by ranks 0 and 2; needed by 4 and 5 (n = 1): 4 <- 0, 5 <- 2.
        let plan = MovePlan::new(&old, &new, 6).unwrap();
        let from = |k: usize| plan.rank(k).map(|r| r.recvs.clone()).unwrap_or_default();
        assert_eq!(from(4)[0].peer, 0);
        assert_eq!(from(5)[0].peer, 2);
        assert_eq!(simulate(&plan), new.phy2log().to_vec());
    }

    fn placement(e: usize, r: usize) -> impl Strategy<Value = Vec<usize>> {
        // Every expert once, then r - e random replicas, shuffled.
        (
            proptest::collection::vec(0..e, r - e),
            proptest::collection::vec(any::<u32>(), r),
        )
            .prop_map(move |(extra, keys)| {
                let v: Vec<usize> = (0..e).chain(extra).collect();
                let mut idx: Vec<usize> = (0..r).collect();
                idx.sort_by_key(|&i| (keys[i], i));
                idx.into_iter().map(|i| v[i]).collect::<Vec<_>>()
            })
    }

    fn case() -> impl Strategy<Value = (usize, usize, Vec<usize>, Vec<usize>)> {
        (1usize..=32, 1usize..=4, 0usize..=3).prop_flat_map(|(ranks, per, extra)| {
            let r = ranks * per.max(1);
            let e = (r - (extra.min(r - 1))).max(1);
            (Just(ranks), Just(e), placement(e, r), placement(e, r))
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]
        /// Thousands of random placements (replicas, same-rank duplicates, 1-32 ranks): after the
        /// plan, every slot holds its new expert (the canary), and only changed slots are written.
        #[test]
        fn random_plans_land_every_slot((ranks, e, a, b) in case()) {
            let old = SlotMap::new(a, e).map_err(|x| TestCaseError::fail(x.to_string()))?;
            let new = SlotMap::new(b, e).map_err(|x| TestCaseError::fail(x.to_string()))?;
            let plan = MovePlan::new(&old, &new, ranks).map_err(|x| TestCaseError::fail(x.to_string()))?;
            prop_assert_eq!(simulate(&plan), new.phy2log().to_vec());
            let local = plan.local_slots();
            for k in 0..ranks {
                let rm = plan.rank(k).cloned().unwrap_or_default();
                let writes: Vec<usize> = rm.copies.iter().filter_map(|c| match c.to { Loc::Slot(p) => Some(p), _ => None }).collect();
                let changed: Vec<usize> = (0..local).filter(|&p| old.phy2log()[k*local+p] != new.phy2log()[k*local+p]).collect();
                let mut w = writes.clone();
                w.sort_unstable();
                prop_assert_eq!(w, changed, "rank {} writes exactly its changed slots, once", k);
                prop_assert!(rm.copies.iter().filter(|c| c.to == Loc::Scratch).count() <= rm.copies.len());
                // One primary receive per (rank, expert), never of an expert it already holds.
                let mut got: Vec<usize> = rm.recvs.iter().map(|t| t.expert).collect();
                got.sort_unstable();
                let n = got.len();
                got.dedup();
                prop_assert_eq!(got.len(), n);
                for t in &rm.recvs {
                    prop_assert!(!old.phy2log()[k*local..(k+1)*local].contains(&t.expert));
                }
            }
            // Messages: they expand to exactly the rank's transfers (per peer, in order), and the
            // two ends of every pair cut them at the same places.
            let msgs: Vec<_> = (0..ranks).map(|k| plan.messages(k).unwrap()).collect();
            for k in 0..ranks {
                let rm = plan.rank(k).cloned().unwrap_or_default();
                for q in 0..ranks {
                    let expand = |m: &[Message]| -> Vec<usize> {
                        m.iter().filter(|m| m.peer == q).flat_map(|m| m.at..m.at + m.count).collect()
                    };
                    let sends: Vec<usize> = rm.sends.iter().filter(|t| t.peer == q).map(|t| t.at).collect();
                    let recvs: Vec<usize> = rm.recvs.iter().filter(|t| t.peer == q).map(|t| t.at).collect();
                    prop_assert_eq!(expand(&msgs[k].0), sends);
                    prop_assert_eq!(expand(&msgs[k].1), recvs);
                    let cuts = |m: &[Message], peer: usize| -> Vec<usize> {
                        m.iter().filter(|m| m.peer == peer).map(|m| m.count).collect()
                    };
                    prop_assert_eq!(cuts(&msgs[k].0, q), cuts(&msgs[q].1, k), "pair {} -> {}", k, q);
                }
            }
        }
    }

    #[test]
    fn halves_that_swap_ranks_move_as_one_message_each_way() {
        // 16 slots over 2 ranks, the halves swapping: 8 experts each way, one message each.
        let a: Vec<usize> = (0..16).collect();
        let b: Vec<usize> = (8..16).chain(0..8).collect();
        let plan = MovePlan::new(
            &SlotMap::new(a, 16).unwrap(),
            &SlotMap::new(b, 16).unwrap(),
            2,
        )
        .unwrap();
        for k in 0..2 {
            let (s, r) = plan.messages(k).unwrap();
            assert_eq!(
                s,
                vec![Message {
                    peer: 1 - k,
                    at: 0,
                    count: 8
                }]
            );
            assert_eq!(
                r,
                vec![Message {
                    peer: 1 - k,
                    at: 0,
                    count: 8
                }]
            );
        }
        // A reversed order breaks the runs: the receiver's transfer indices run on, the sender's
        // slots run backwards.
        let a: Vec<usize> = (0..4).collect();
        let b = vec![3, 2, 1, 0];
        let plan = MovePlan::new(
            &SlotMap::new(a, 4).unwrap(),
            &SlotMap::new(b, 4).unwrap(),
            2,
        )
        .unwrap();
        let (s, _) = plan.messages(0).unwrap();
        assert_eq!(s.iter().map(|m| m.count).sum::<usize>(), 2);
    }
}
