//! The parameter store on host storage (the same code as on the GPU, whose self-test repeats this):
//! views alias the packed params with the verifier's index map, and rearranging experts in place equals
//! packing the permuted checkpoint, byte for byte, for every standard recipe.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;

use moeforge::bench::Layer;
use moeforge::runtime::store::ParamStore;

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

fn permute(bytes: &[u8], experts: usize, perm: &[usize]) -> Vec<u8> {
    let n = bytes.len() / experts;
    perm.iter()
        .flat_map(|&p| bytes[p * n..(p + 1) * n].to_vec())
        .collect()
}

#[test]
fn rearranging_in_place_equals_packing_the_permuted_checkpoint() {
    let (e, h, i) = (4, 128, 128);
    let perm = [2usize, 0, 3, 1];
    let layer = Layer::synthetic(e, h, i, 11);
    let scales: Vec<u8> = (0..e)
        .flat_map(|k| (0.5f32 + k as f32).to_le_bytes())
        .collect();
    let mut inp = HashMap::new();
    inp.insert("w13".to_string(), layer.w13.clone());
    inp.insert("w2".to_string(), layer.w2.clone());
    inp.insert("w13_input_scale".to_string(), scales.clone());
    inp.insert("w2_input_scale".to_string(), scales.clone());
    let mut permuted = HashMap::new();
    for (k, v) in &inp {
        permuted.insert(k.clone(), permute(v, e, &perm));
    }
    for r in moeforge::kernels::STANDARD {
        let info =
            moeforge::check_source(r.source, r.path, Some(&format!("E={e},H={h},I={i}"))).unwrap();
        let mut store = ParamStore::new(&info, pack(&info, &inp)).unwrap();
        // Views read the store through the verifier's index maps.
        for v in &info.views {
            let name = &info.module().tensor(v.id).unwrap().name;
            let view = store.view(name).unwrap();
            assert!(
                view.index_map() == info.index_map(v).unwrap(),
                "{} {name}: index maps differ",
                r.name
            );
            assert_eq!(view.param(), info.module().tensor(v.source).unwrap().name);
        }
        store.rearrange(&perm).unwrap();
        for (name, want) in pack(&info, &permuted) {
            assert!(
                store.param(&name).unwrap() == &want,
                "{}.{name} differs after rearrangement",
                r.name
            );
        }
        assert!(store.rearrange(&[0, 0, 1, 2]).is_err(), "not a permutation");
    }
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
