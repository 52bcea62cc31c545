//! Thousands of random rearrangements through the in-process transport (SGLang's canary test, done
//! with moeforge's own stores): 2 to 32 ranks as threads, each holding its slots of nvfp4_cutedsl's
//! eight params (4-byte alphas to 4 KiB of codes per expert); every slot carries a canary that encodes
//! its logical expert and the param, and after the move every slot on every rank must hold the canary
//! of its new expert. Placements include replicas and same-rank duplicates.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;

use moeforge::runtime::collective::{InProcess, Topology};
use moeforge::runtime::moves::{MovePlan, SlotMap};
use moeforge::runtime::store::ParamStore;

mod common;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn placement(&mut self, e: usize, r: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (0..e).collect();
        for _ in e..r {
            v.push(self.below(e));
        }
        for k in (1..v.len()).rev() {
            let j = self.below(k + 1);
            v.swap(k, j);
        }
        v
    }
}

/// The canary of logical expert `e` in param `k`: every byte, with the byte's position mixed in so
/// that a shifted or partial copy shows.
fn canary(e: usize, k: usize, bytes: usize) -> Vec<u8> {
    (0..bytes)
        .map(|j| (e as u8).wrapping_mul(31) ^ (k as u8).wrapping_mul(7) ^ (j as u8))
        .collect()
}

#[test]
fn thousands_of_random_placements_land_every_canary() {
    let seed = common::seed();
    let mut rng = Rng(seed | 1);
    let rec = moeforge::kernels::find("nvfp4_cutedsl").unwrap();
    let mut infos: HashMap<usize, moeforge::dsl::ModuleInfo> = HashMap::new();
    let cases = 2000;
    let mut moved = 0usize;
    for case in 0..cases {
        let ranks = [2usize, 3, 4, 8, 16, 32][rng.below(6)];
        let local = 1 + rng.below(3);
        let r = ranks * local;
        let e = (r - rng.below(r.min(4))).max(1);
        let old = rng.placement(e, r);
        let new = rng.placement(e, r);
        let info = infos.entry(local).or_insert_with(|| {
            moeforge::check_source(rec.source, rec.path, Some(&format!("E={local},H=64,I=64")))
                .unwrap()
        });
        let sizes: Vec<(String, usize)> = info
            .move_set
            .iter()
            .map(|m| {
                (
                    info.module().tensor(m.param).unwrap().name.clone(),
                    info.bytes_per_expert(m).unwrap() as usize,
                )
            })
            .collect();
        let old_map = SlotMap::new(old.clone(), e).unwrap();
        let new_map = SlotMap::new(new.clone(), e).unwrap();
        let plan = MovePlan::new(&old_map, &new_map, ranks).unwrap();
        moved += plan.changed_slots();
        let world = InProcess::world(Topology {
            ep: ranks,
            moe_tp: 1,
        });
        let info = &*info;
        let results: Vec<Vec<(String, Vec<u8>)>> = std::thread::scope(|s| {
            let hs: Vec<_> = world
                .iter()
                .enumerate()
                .map(|(rank, c)| {
                    let (plan, old_map, old, sizes) = (&plan, &old_map, &old, &sizes);
                    s.spawn(move || {
                        let params: Vec<(String, Vec<u8>)> = sizes
                            .iter()
                            .enumerate()
                            .map(|(k, (n, b))| {
                                let bytes = (0..local)
                                    .flat_map(|p| canary(old[rank * local + p], k, *b))
                                    .collect();
                                (n.clone(), bytes)
                            })
                            .collect();
                        let mut st =
                            ParamStore::placed(info, params, old_map.clone(), rank, ranks).unwrap();
                        st.rearrange(plan, c).unwrap();
                        assert_eq!(st.placement(), plan.new_map());
                        sizes
                            .iter()
                            .map(|(n, _)| (n.clone(), st.param(n).unwrap().clone()))
                            .collect()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, got) in results.iter().enumerate() {
            for (k, ((_, b), (n, bytes))) in sizes.iter().zip(got).enumerate() {
                for p in 0..local {
                    let want = canary(new[rank * local + p], k, *b);
                    assert!(
                        bytes[p * b..(p + 1) * b] == want[..],
                        "case {case}: {ranks} ranks x {local} slots, {e} experts, {old:?} -> {new:?}: rank {rank} slot {p} of `{n}` (seed {seed})"
                    );
                }
            }
        }
    }
    assert!(moved > cases, "the cases moved experts");
}
