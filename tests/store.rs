//! The parameter store on host storage (the same code as on the GPU, whose self-test repeats this):
//! views alias the packed params with the verifier's index map, and rearranging experts in place equals
//! packing the permuted checkpoint, byte for byte, for every standard recipe.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;

use moeforge::bench::Layer;
use moeforge::runtime::collective::{InProcess, SingleRank, Topology};
use moeforge::runtime::moves::{place_tensors as place, MovePlan, SlotMap};
use moeforge::runtime::store::ParamStore;

mod common;

fn pack(
    info: &moeforge::dsl::ModuleInfo,
    inp: &HashMap<String, Vec<u8>>,
) -> Vec<(String, Vec<u8>)> {
    let prog =
        moeforge::codegen::plan::plan_with(info, &|n: &str| inp.contains_key(n), &|_| false, true)
            .unwrap();
    let c = moeforge::codegen::host::compile(&prog).unwrap();
    let mut bufs = moeforge::codegen::alloc_buffers(&prog, &mut |n| inp.get(n).cloned()).unwrap();
    c.run(&mut bufs, &moeforge::codegen::SingleProcess, 2)
        .unwrap();
    prog.bufs
        .iter()
        .zip(bufs)
        .filter_map(|(b, d)| match &b.role {
            moeforge::codegen::kir::BufRole::Param(n) => Some((n.clone(), d)),
            _ => None,
        })
        .collect()
}

fn checkpoint(e: usize, h: usize, i: usize, seed: u64) -> HashMap<String, Vec<u8>> {
    let layer = Layer::synthetic(e, h, i, seed);
    let scales: Vec<u8> = (0..e)
        .flat_map(|k| (0.5f32 + k as f32).to_le_bytes())
        .collect();
    let mut inp = HashMap::new();
    inp.insert("w13".to_string(), layer.w13.clone());
    inp.insert("w2".to_string(), layer.w2.clone());
    inp.insert("w13_input_scale".to_string(), scales.clone());
    inp.insert("w2_input_scale".to_string(), scales);
    inp
}

/// A random placement of `e` experts on `r` slots: each once, the rest random replicas, shuffled.
fn random_placement(rng: &mut u64, e: usize, r: usize) -> Vec<usize> {
    let mut next = || {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        *rng
    };
    let mut v: Vec<usize> = (0..e).collect();
    for _ in e..r {
        v.push((next() % e as u64) as usize);
    }
    for k in (1..v.len()).rev() {
        let j = (next() % (k as u64 + 1)) as usize;
        v.swap(k, j);
    }
    v
}

#[test]
fn rearranging_in_place_equals_packing_the_permuted_checkpoint() {
    // The contract, on one rank: pack a checkpoint placed as a random `old` (replicas included),
    // rearrange in place to a random `new`: every param equals packing the checkpoint placed as
    // `new`, views alias the same storage, and the store reports the slots it wrote. Both orders
    // of queueing the params (smallest first, the default, and largest first).
    let seed = common::seed();
    let mut rng = seed | 1;
    let (e, r, h, i) = (4, 6, 128, 128);
    let inp = checkpoint(e, h, i, 11);
    let orders = [false, true];
    for (rec, large_first) in moeforge::kernels::STANDARD
        .iter()
        .flat_map(|r| orders.iter().map(move |&o| (r, o)))
    {
        let old = random_placement(&mut rng, e, r);
        let new = random_placement(&mut rng, e, r);
        let info =
            moeforge::check_source(rec.source, rec.path, Some(&format!("E={r},H={h},I={i}")))
                .unwrap();
        let old_map = SlotMap::new(old.clone(), e).unwrap();
        let mut store = ParamStore::placed(
            &info,
            pack(&info, &place(&inp, e, &old)),
            old_map.clone(),
            0,
            1,
        )
        .unwrap()
        .with_large_first(large_first);
        let before: Vec<u64> = info
            .views
            .iter()
            .map(|v| {
                store
                    .view(&info.module().tensor(v.id).unwrap().name)
                    .unwrap()
                    .address()
            })
            .collect();
        for v in &info.views {
            let name = &info.module().tensor(v.id).unwrap().name;
            let view = store.view(name).unwrap();
            assert!(
                view.index_map() == info.index_map(v).unwrap(),
                "{} {name}: index maps differ",
                rec.name
            );
            assert_eq!(view.param(), info.module().tensor(v.source).unwrap().name);
        }
        let plan = MovePlan::new(&old_map, &SlotMap::new(new.clone(), e).unwrap(), 1).unwrap();
        let report = store.rearrange(&plan, &SingleRank).unwrap();
        assert_eq!(report.slots_written, plan.changed_slots(), "seed {seed}");
        for (name, want) in pack(&info, &place(&inp, e, &new)) {
            assert!(
                store.param(&name).unwrap() == &want,
                "{}.{name} differs after rearrangement {old:?} -> {new:?} (seed {seed}, large first {large_first})",
                rec.name
            );
        }
        let after: Vec<u64> = info
            .views
            .iter()
            .map(|v| {
                store
                    .view(&info.module().tensor(v.id).unwrap().name)
                    .unwrap()
                    .address()
            })
            .collect();
        assert_eq!(before, after, "views still alias the params' storage");
        assert_eq!(store.placement().phy2log(), &new[..]);
    }
}

#[test]
fn ranks_exchange_experts_through_the_in_process_transport() {
    // 2 to 4 ranks (threads), each holding its slots: after the rearrangement every rank's params
    // equal its slice of packing the checkpoint placed as `new`.
    let seed = common::seed();
    let mut rng = seed | 1;
    let (e, h, i) = (4, 128, 128);
    let inp = checkpoint(e, h, i, 5);
    for rec in moeforge::kernels::STANDARD {
        for ranks in [2usize, 4] {
            let local = 2;
            let r = ranks * local;
            let old = random_placement(&mut rng, e, r);
            let new = random_placement(&mut rng, e, r);
            let full =
                moeforge::check_source(rec.source, rec.path, Some(&format!("E={r},H={h},I={i}")))
                    .unwrap();
            let info = moeforge::check_source(
                rec.source,
                rec.path,
                Some(&format!("E={local},H={h},I={i}")),
            )
            .unwrap();
            let old_packed = pack(&full, &place(&inp, e, &old));
            let want = pack(&full, &place(&inp, e, &new));
            let old_map = SlotMap::new(old.clone(), e).unwrap();
            let plan =
                MovePlan::new(&old_map, &SlotMap::new(new.clone(), e).unwrap(), ranks).unwrap();
            let world = InProcess::world(Topology {
                ep: ranks,
                moe_tp: 1,
            });
            let results: Vec<Vec<(String, Vec<u8>)>> = std::thread::scope(|s| {
                let hs: Vec<_> = world
                    .iter()
                    .enumerate()
                    .map(|(k, c)| {
                        let (info, plan, old_map) = (&info, &plan, &old_map);
                        let params: Vec<(String, Vec<u8>)> = old_packed
                            .iter()
                            .map(|(n, b)| {
                                let per = b.len() / r;
                                (
                                    n.clone(),
                                    b[k * local * per..(k + 1) * local * per].to_vec(),
                                )
                            })
                            .collect();
                        s.spawn(move || {
                            let mut st =
                                ParamStore::placed(info, params, old_map.clone(), k, ranks)
                                    .unwrap();
                            st.rearrange(plan, c).unwrap();
                            st.param_names()
                                .iter()
                                .map(|n| (n.to_string(), st.param(n).unwrap().clone()))
                                .collect::<Vec<_>>()
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (name, w) in &want {
                let per = w.len() / r;
                for (k, got) in results.iter().enumerate() {
                    let g = &got.iter().find(|x| &x.0 == name).unwrap().1;
                    assert!(
                        g[..] == w[k * local * per..(k + 1) * local * per],
                        "{}.{name} rank {k}/{ranks}: {old:?} -> {new:?} (seed {seed})",
                        rec.name
                    );
                }
            }
        }
    }
}

#[test]
fn a_failed_move_marks_the_layer_unusable_and_bad_plans_change_nothing() {
    let rec = moeforge::kernels::find("nvfp4_cutedsl").unwrap();
    let (e, h, i) = (4, 128, 128);
    let inp = checkpoint(e, h, i, 9);
    let info =
        moeforge::check_source(rec.source, rec.path, Some(&format!("E={e},H={h},I={i}"))).unwrap();
    let packed = pack(&info, &inp);
    let id = SlotMap::identity(e);
    // Bad placements are refused by name, before anything moves.
    assert!(
        matches!(SlotMap::new(vec![0, 1, 2], e), Err(moeforge::runtime::Error::Placement(m)) if m.contains("3 slots"))
    );
    assert!(
        matches!(SlotMap::new(vec![0, 1, 2, 7], e), Err(moeforge::runtime::Error::Placement(m)) if m.contains("slot 3 holds expert 7"))
    );
    assert!(
        matches!(SlotMap::new(vec![0, 1, 2, 2], e), Err(moeforge::runtime::Error::Placement(m)) if m.contains("expert 3 has no replica"))
    );
    assert!(
        matches!(MovePlan::new(&id, &id, 3), Err(moeforge::runtime::Error::Placement(m)) if m.contains("do not divide"))
    );
    let mut store = ParamStore::new(&info, packed.clone()).unwrap();
    let other = SlotMap::new(vec![1, 0, 2, 3], e).unwrap();
    let wrong_start = MovePlan::new(&other, &id, 1).unwrap();
    assert!(matches!(
        store.rearrange(&wrong_start, &SingleRank),
        Err(moeforge::runtime::Error::Placement(_))
    ));
    let two_ranks = MovePlan::new(&id, &other, 2).unwrap();
    assert!(store.rearrange(&two_ranks, &SingleRank).is_err());
    for (n, b) in &packed {
        assert!(store.param(n).unwrap() == b, "a refused plan changed {n}");
    }
    assert!(store.is_usable());
    // A transfer failing part-way: an error, the layer unusable, views refused, no silent mix.
    let plan = MovePlan::new(&id, &SlotMap::new(vec![3, 2, 1, 0], e).unwrap(), 1).unwrap();
    // 8 params' exchanges, then two copies of the first param: the failure lands mid-copy.
    store.inject_fault(Some(10));
    match store.rearrange(&plan, &SingleRank) {
        Err(moeforge::runtime::Error::Unusable(m)) => assert!(m.contains("injected"), "{m}"),
        other => panic!("expected Unusable, got {:?}", other.map(|_| ())),
    }
    assert!(!store.is_usable());
    assert!(matches!(
        store.view("w13_scale_mma"),
        Err(moeforge::runtime::Error::Unusable(_))
    ));
    assert!(store.rearrange(&plan, &SingleRank).is_err());
    assert_eq!(store.placement(), &id, "the map did not switch");
}

#[test]
fn a_partial_move_set_is_refused() {
    // The review's reproducer: nvfp4_cutedsl's store built from one of its params. Rearranging it
    // would leave the other params (`g1_alphas` among them) on the old placement: refused.
    let r = moeforge::kernels::find("nvfp4_cutedsl").unwrap();
    let info = moeforge::check_source(r.source, r.path, Some("E=2,H=128,I=128")).unwrap();
    let layer = Layer::synthetic(2, 128, 128, 3);
    let inp: HashMap<String, Vec<u8>> = [
        ("w13".to_string(), layer.w13.clone()),
        ("w2".to_string(), layer.w2.clone()),
    ]
    .into_iter()
    .collect();
    let params = pack(&info, &inp);
    assert!(ParamStore::new(&info, params.clone()).is_ok());
    let one: Vec<(String, Vec<u8>)> = params.into_iter().take(1).collect();
    match ParamStore::new(&info, one) {
        Err(moeforge::runtime::Error::IncompleteMoveSet { missing }) => {
            assert!(
                missing.iter().any(|m| m.contains("w2_weight_scale")),
                "{missing:?}"
            );
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("a partial move set was accepted"),
    }
}
