//! `moeforge eplb apply`: a packed checkpoint laid out along a placement equals, byte for byte, the
//! checkpoint permuted (replicas included) and packed at `E = R`, for every standard recipe and every
//! layout example; one rank's slice is that rank's slots of the whole; a placed file placed again is
//! the original placed directly; bad input fails by name, with a non-zero exit and no output file.
//! Placements are random, from a fresh seed each run, printed for replay (`MOEFORGE_SEED=...`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
use common::{bf16, pack, read_tensors as read, run, seed, value, write_tensors as write, Tensor};

use std::collections::BTreeMap;
use std::path::Path;

use moeforge::layout_gen::Rng;
use safetensors::tensor::Dtype;

const E: usize = 4;
const H: usize = 128;
const I: usize = 128; // a multiple of int4_g128's groups
const LAYERS: [usize; 2] = [0, 2];

/// One layer's experts: w13 `[gate; up]` and w2 per expert, and activation scales per expert.
struct Layer {
    w13: Vec<Vec<f32>>,
    w2: Vec<Vec<f32>>,
    s13: Vec<f32>,
    s2: Vec<f32>,
}

/// Expert `e` of layer `l` at its own magnitude, so that every per-expert scale differs.
fn scaled(x: f32, e: usize, l: usize) -> f32 {
    let f = 1.0 + 0.375 * e as f32 + 0.125 * l as f32;
    f32::from_bits((x * f).to_bits() & 0xFFFF_0000)
}

fn layer(l: usize) -> Layer {
    let w13 = (0..E)
        .map(|e| {
            (0..2 * I * H)
                .map(|k| scaled(value(k + e * 100_003 + l * 7919), e, l))
                .collect()
        })
        .collect();
    let w2 = (0..E)
        .map(|e| {
            (0..H * I)
                .map(|k| scaled(value(k * 3 + e * 1009 + l * 31), e, l))
                .collect()
        })
        .collect();
    // Different per expert, so that the activation scale (a max over the experts) is one of them.
    let s13 = (0..E).map(|e| 0.25 + e as f32 * 0.5 + l as f32).collect();
    let s2 = (0..E).map(|e| 2.0 - e as f32 * 0.25).collect();
    Layer { w13, w2, s13, s2 }
}

/// A fused bf16 checkpoint whose layer `l` holds the experts `order[l]` of `layers[l]`, in that order
/// (the identity gives the checkpoint itself; a placement's `phy2log` gives it permuted).
fn checkpoint(path: &Path, layers: &[Layer], order: &[Vec<usize>]) {
    let mut t = BTreeMap::new();
    for ((&l, x), order) in LAYERS.iter().zip(layers).zip(order) {
        let n = order.len();
        let p = format!("model.layers.{l}.mlp.experts");
        let gather =
            |v: &[Vec<f32>]| -> Vec<f32> { order.iter().flat_map(|&e| v[e].clone()).collect() };
        let pick =
            |v: &[f32]| -> Vec<u8> { order.iter().flat_map(|&e| v[e].to_le_bytes()).collect() };
        t.insert(
            format!("{p}.w13_weight"),
            (Dtype::BF16, vec![n, 2 * I, H], bf16(&gather(&x.w13))),
        );
        t.insert(
            format!("{p}.w2_weight"),
            (Dtype::BF16, vec![n, H, I], bf16(&gather(&x.w2))),
        );
        t.insert(
            format!("{p}.w13_input_scale"),
            (Dtype::F32, vec![n], pick(&x.s13)),
        );
        t.insert(
            format!("{p}.w2_input_scale"),
            (Dtype::F32, vec![n], pick(&x.s2)),
        );
    }
    write(path, &t, None);
}

/// `eplb apply`; `extra` appended.
fn apply(packed: &Path, placement: &Path, output: &Path, extra: &[&str]) -> (i32, String, String) {
    let mut args = vec![
        "eplb",
        "apply",
        packed.to_str().unwrap(),
        "--placement",
        placement.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    run(&args)
}

/// A random placement of `E` experts on `r` slots per layer: each expert once, the rest replicas of
/// random experts, shuffled.
fn placement(rng: &mut Rng, r: usize) -> Vec<Vec<usize>> {
    LAYERS
        .iter()
        .map(|_| {
            let mut row: Vec<usize> = (0..E).collect();
            row.extend((E..r).map(|_| rng.below(E as u64) as usize));
            for k in (1..row.len()).rev() {
                row.swap(k, rng.below(k as u64 + 1) as usize);
            }
            row
        })
        .collect()
}

fn write_placement(path: &Path, phy2log: &[Vec<usize>]) {
    // As `eplb plan --json` prints it (only `phy2log` is read).
    let logcnt: Vec<Vec<usize>> = phy2log
        .iter()
        .map(|row| {
            (0..E)
                .map(|e| row.iter().filter(|&&x| x == e).count())
                .collect()
        })
        .collect();
    let v = serde_json::json!({ "phy2log": phy2log, "logcnt": logcnt });
    std::fs::write(path, v.to_string()).unwrap();
}

fn identity() -> Vec<Vec<usize>> {
    LAYERS.iter().map(|_| (0..E).collect()).collect()
}

#[test]
fn every_recipe_placed_equals_the_permuted_checkpoint_packed() {
    let s0 = seed();
    let mut rng = Rng::new(s0);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let layers: Vec<Layer> = LAYERS.iter().map(|&l| layer(l)).collect();
    let ck = d.join("ckpt.safetensors");
    checkpoint(&ck, &layers, &identity());
    let recipes = moeforge::kernels::STANDARD
        .iter()
        .chain(moeforge::kernels::LAYOUTS);
    for recipe in recipes {
        let name = recipe.name;
        let r = E + 1 + rng.below(4) as usize;
        let phy2log = placement(&mut rng, r);
        let ctx = format!("recipe {name}, R = {r}, phy2log {phy2log:?} (MOEFORGE_SEED={s0})");
        let packed = d.join(format!("{name}.safetensors"));
        pack(recipe.path, &ck, &packed);
        let pl = d.join(format!("{name}.placement.json"));
        write_placement(&pl, &phy2log);
        let placed = d.join(format!("{name}.placed.safetensors"));
        let (code, out, err) = apply(&packed, &pl, &placed, &[]);
        assert_eq!(code, 0, "{ctx}: {err}");
        assert!(out.contains(&format!("on {r} slots")), "{ctx}: {out}");
        // The checkpoint permuted as the placement lays it out, packed at E = R.
        let perm = d.join(format!("{name}.permuted.safetensors"));
        checkpoint(&perm, &layers, &phy2log);
        let want = d.join(format!("{name}.want.safetensors"));
        pack(recipe.path, &perm, &want);
        let (got, gmeta) = read(&placed);
        let (exp, wmeta) = read(&want);
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            exp.keys().collect::<Vec<_>>(),
            "{ctx}: the params written"
        );
        let (orig, _) = read(&packed);
        for (n, (dt, shape, bytes)) in &exp {
            let g = &got[n];
            assert_eq!((g.0, &g.1), (*dt, shape), "{ctx}: `{n}` dtype and shape");
            assert_eq!(shape[0], r, "{ctx}: `{n}` has R experts");
            if let Some(k) = g.2.iter().zip(bytes).position(|(a, b)| a != b) {
                panic!("{ctx}: `{n}` differs at byte {k} of {}", bytes.len());
            }
            assert_eq!(g.2.len(), bytes.len(), "{ctx}: `{n}` length");
            // And directly: slot p of the layer holds the bytes of expert phy2log[p] of the input.
            let o = &orig[n];
            let l = LAYERS
                .iter()
                .position(|l| n.starts_with(&format!("model.layers.{l}.")))
                .unwrap();
            let b = o.2.len() / E;
            for (p, &e) in phy2log[l].iter().enumerate() {
                assert!(
                    g.2[p * b..(p + 1) * b] == o.2[e * b..(e + 1) * b],
                    "{ctx}: `{n}` slot {p}"
                );
            }
        }
        assert!(exp.len() >= 4, "{ctx}: {:?}", exp.keys());
        if recipe.source.contains("input w13_input_scale") {
            // The activation scales and the alphas are written (the checkpoint has input scales).
            for p in ["g1_alphas", "g2_alphas"] {
                assert!(
                    exp.contains_key(&format!("model.layers.2.mlp.experts.{p}")),
                    "{ctx}: {p}"
                );
            }
        }
        // Metadata: the binding and the layouts at E = R, the recipe kept, the placement recorded.
        for k in wmeta.keys().filter(|k| k.starts_with("moeforge.layout.")) {
            assert_eq!(gmeta.get(k), Some(&wmeta[k]), "{ctx}: `{k}`");
        }
        for k in [
            "moeforge.binding",
            "moeforge.recipe",
            "moeforge.recipe_source",
            "moeforge.recipe_blake3",
        ] {
            assert_eq!(gmeta.get(k), wmeta.get(k), "{ctx}: `{k}`");
        }
        assert_eq!(
            gmeta
                .keys()
                .filter(|k| k.starts_with("moeforge.layout."))
                .count(),
            wmeta
                .keys()
                .filter(|k| k.starts_with("moeforge.layout."))
                .count(),
            "{ctx}: layout keys"
        );
        let rows: Vec<Vec<usize>> = serde_json::from_str(&gmeta["moeforge.eplb.phy2log"]).unwrap();
        assert_eq!(rows, phy2log, "{ctx}");
        assert_eq!(gmeta["moeforge.eplb.layers"], "[0,2]", "{ctx}");
        assert_eq!(gmeta["moeforge.eplb.slots"], r.to_string(), "{ctx}");
        assert_eq!(gmeta["moeforge.eplb.experts"], E.to_string(), "{ctx}");
        assert!(!gmeta.contains_key("moeforge.eplb.rank"), "{ctx}");
    }
}

/// Every param of `full` (R slots) restricted to slots `[lo, hi)`.
fn slots(
    full: &BTreeMap<String, Tensor>,
    r: usize,
    lo: usize,
    hi: usize,
) -> BTreeMap<String, Vec<u8>> {
    full.iter()
        .map(|(n, (_, _, b))| {
            let per = b.len() / r;
            (n.clone(), b[lo * per..hi * per].to_vec())
        })
        .collect()
}

#[test]
fn rank_slices_are_the_slots_of_the_whole_and_placing_again_composes() {
    let s0 = seed();
    let mut rng = Rng::new(s0 ^ 0x5eed);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let layers: Vec<Layer> = LAYERS.iter().map(|&l| layer(l)).collect();
    let ck = d.join("ckpt.safetensors");
    checkpoint(&ck, &layers, &identity());
    for name in ["nvfp4_cutedsl", "fp8_per_tensor", "fp8_colmajor"] {
        let recipe = moeforge::kernels::find(name).unwrap();
        let packed = d.join(format!("{name}.safetensors"));
        pack(recipe.path, &ck, &packed);
        // A tensor outside the experts passes through unchanged.
        let (mut t, meta) = read(&packed);
        let embed = (
            Dtype::BF16,
            vec![3, 8],
            bf16(&(0..24).map(value).collect::<Vec<_>>()),
        );
        t.insert("model.embed_tokens.weight".into(), embed.clone());
        write(&packed, &t, Some(meta));
        let r = 8;
        let phy2log = placement(&mut rng, r);
        let ctx = format!("recipe {name}, phy2log {phy2log:?} (MOEFORGE_SEED={s0})");
        let pl = d.join("placement.json");
        write_placement(&pl, &phy2log);
        let whole = d.join(format!("{name}.whole.safetensors"));
        let (code, _, err) = apply(&packed, &pl, &whole, &[]);
        assert_eq!(code, 0, "{ctx}: {err}");
        let (full, _) = read(&whole);
        assert_eq!(full["model.embed_tokens.weight"], embed, "{ctx}");
        let params: BTreeMap<String, Tensor> = full
            .iter()
            .filter(|(n, _)| n.contains(".mlp.experts."))
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect();
        assert!(params.len() >= 4, "{ctx}: {:?}", params.keys());
        for ranks in [1, 2, 4, 8] {
            for rank in 0..ranks {
                let part = d.join(format!("{name}.{rank}of{ranks}.safetensors"));
                let (rs, ps) = (rank.to_string(), ranks.to_string());
                let (code, out, err) = apply(&packed, &pl, &part, &["--rank", &rs, "--ranks", &ps]);
                assert_eq!(code, 0, "{ctx}, rank {rank} of {ranks}: {err}");
                assert!(out.contains(&format!("rank {rank} of {ranks}")), "{out}");
                let (got, meta) = read(&part);
                let per = r / ranks;
                let want = slots(&params, r, rank * per, (rank + 1) * per);
                for (n, b) in &want {
                    let g = &got[n];
                    assert_eq!(g.1[0], per, "{ctx}: `{n}` of rank {rank} of {ranks}");
                    assert_eq!(&g.2, b, "{ctx}: `{n}` of rank {rank} of {ranks}");
                }
                assert_eq!(got["model.embed_tokens.weight"], embed, "{ctx}");
                assert_eq!(got.len(), want.len() + 1, "{ctx}");
                assert_eq!(meta["moeforge.eplb.rank"], rs);
                assert_eq!(meta["moeforge.eplb.ranks"], ps);
                assert_eq!(meta["moeforge.eplb.slots"], per.to_string());
                assert!(
                    meta["moeforge.binding"].starts_with(&format!("E={per},")),
                    "{}",
                    meta["moeforge.binding"]
                );
            }
        }
        // Placing the placed file again is placing the original directly.
        let r2 = 6;
        let again = placement(&mut rng, r2);
        let pl2 = d.join("placement2.json");
        write_placement(&pl2, &again);
        let direct = d.join(format!("{name}.direct.safetensors"));
        let twice = d.join(format!("{name}.twice.safetensors"));
        let (code, _, err) = apply(&packed, &pl2, &direct, &[]);
        assert_eq!(code, 0, "{err}");
        let (code, _, err) = apply(&whole, &pl2, &twice, &[]);
        assert_eq!(code, 0, "{ctx}, then {again:?}: {err}");
        let (a, ma) = read(&direct);
        let (b, mb) = read(&twice);
        assert_eq!(a, b, "{ctx}, then {again:?}");
        assert_eq!(ma, mb, "{ctx}, then {again:?}");
        // From one rank's slice, only the experts it holds can be placed.
        let part = d.join(format!("{name}.0of8.safetensors"));
        let held = phy2log[0][0];
        let one: Vec<Vec<usize>> = LAYERS.iter().map(|_| vec![held; E]).collect();
        let pl3 = d.join("placement3.json");
        write_placement(&pl3, &one);
        let out3 = d.join(format!("{name}.from_slice.safetensors"));
        let (code, _, err) = apply(&part, &pl3, &out3, &[]);
        assert_eq!(code, 1, "{ctx}");
        assert!(err.contains("logical expert without replica"), "{err}");
        let mut all: Vec<Vec<usize>> = identity();
        all[0].rotate_left(1);
        write_placement(&pl3, &all);
        let (code, _, err) = apply(&part, &pl3, &out3, &[]);
        assert_eq!(code, 1, "{ctx}");
        assert!(err.contains("expert not held"), "{err}");
        assert!(!out3.exists());
    }
}

/// Run `eplb apply` expecting a refusal naming `needle`, and no output (nor temporary) file.
fn refused(packed: &Path, placement: &str, extra: &[&str], needle: &str) {
    let dir = tempfile::tempdir().unwrap();
    let pl = dir.path().join("placement.json");
    std::fs::write(&pl, placement).unwrap();
    let out = dir.path().join("out.safetensors");
    let (code, _, err) = apply(packed, &pl, &out, extra);
    assert_ne!(code, 0, "{placement} {extra:?} was accepted");
    assert_eq!(code, 1, "{placement} {extra:?}: {err}");
    assert!(
        err.contains(needle),
        "{placement} {extra:?}: expected {needle:?} in: {err}"
    );
    assert!(
        !out.exists(),
        "{placement} {extra:?}: an output file was left"
    );
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 1, "temporary files left behind: {left:?}");
}

#[test]
fn bad_input_fails_by_name_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let layers: Vec<Layer> = LAYERS.iter().map(|&l| layer(l)).collect();
    let ck = d.join("ckpt.safetensors");
    checkpoint(&ck, &layers, &identity());
    let packed = d.join("bf16.safetensors");
    pack("bf16", &ck, &packed);
    let ok = r#"{"phy2log": [[0,1,2,3,1,0],[3,2,1,0,0,2]]}"#;
    // What works, to show that each refusal is the one change it makes.
    let pl = d.join("ok.json");
    std::fs::write(&pl, ok).unwrap();
    let (code, _, err) = apply(
        &packed,
        &pl,
        &d.join("ok.safetensors"),
        &["--rank", "1", "--ranks", "2"],
    );
    assert_eq!(code, 0, "{err}");

    // Wrong row count vs the file's MoE layers.
    refused(
        &packed,
        r#"{"phy2log": [[0,1,2,3]]}"#,
        &[],
        "wrong row count",
    );
    refused(
        &packed,
        r#"{"phy2log": [[0,1,2,3],[0,1,2,3],[0,1,2,3]]}"#,
        &[],
        "wrong row count",
    );
    // A slot value out of range [0, E).
    refused(
        &packed,
        r#"{"phy2log": [[0,1,2,3],[0,1,2,4]]}"#,
        &[],
        "slot out of range: layer 2, slot 3 holds logical expert 4",
    );
    refused(
        &packed,
        r#"{"phy2log": [[0,1,2,3,-1],[0,1,2,3,0]]}"#,
        &[],
        "slot out of range: layer 0, slot 4",
    );
    // A logical expert with no replica.
    refused(
        &packed,
        r#"{"phy2log": [[0,1,2,2],[0,1,2,3]]}"#,
        &[],
        "logical expert without replica: layer 0, expert 3",
    );
    // R not divisible by P; rank >= ranks.
    refused(
        &packed,
        r#"{"phy2log": [[0,1,2,3,0],[0,1,2,3,0]]}"#,
        &["--rank", "0", "--ranks", "2"],
        "slots not divisible by ranks",
    );
    refused(
        &packed,
        ok,
        &["--rank", "2", "--ranks", "2"],
        "rank out of range",
    );
    refused(
        &packed,
        ok,
        &["--rank", "0", "--ranks", "0"],
        "rank out of range",
    );
    // Malformed JSON, a list that is not plan's object, no `phy2log`, ragged rows, non-integers.
    refused(
        &packed,
        r#"{"phy2log": [[0,1,2,3],"#,
        &[],
        "malformed placement",
    );
    refused(&packed, "[[0,1,2,3],[0,1,2,3]]", &[], "malformed placement");
    refused(
        &packed,
        r#"{"logcnt": [[1,1,1,1]]}"#,
        &[],
        "no `phy2log` key",
    );
    refused(
        &packed,
        r#"{"phy2log": [[0,1,2,3],[0,1,2,3,0]]}"#,
        &[],
        "ragged placement",
    );
    refused(
        &packed,
        r#"{"phy2log": [[0,1,2,3],[0,1,2,3.5]]}"#,
        &[],
        "malformed placement",
    );

    // A file without recipe metadata and no --recipe (with --recipe it is placed, dims from shapes).
    let (t, _) = read(&packed);
    let bare = d.join("bare.safetensors");
    write(&bare, &t, None);
    refused(&bare, ok, &[], "no recipe");
    let out = d.join("bare.placed.safetensors");
    let (code, _, err) = apply(&bare, &pl, &out, &["--recipe", "bf16"]);
    assert_eq!(code, 0, "{err}");
    let (want, _) = read(&d.join("ok.safetensors"));
    let (code, _, err) = apply(
        &bare,
        &pl,
        &out,
        &["--recipe", "bf16", "--rank", "1", "--ranks", "2"],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(read(&out).0, want);

    // The verifier refuses the recipe at the output's expert count.
    let by4 = d.join("by4.recipe");
    let src = moeforge::kernels::find("bf16").unwrap().source.replace(
        "recipe bf16(E: experts, H, I) where",
        "recipe by4(E: experts, H, I) where E % 4 == 0,",
    );
    assert!(src.contains("E % 4 == 0"));
    std::fs::write(&by4, src).unwrap();
    let packed4 = d.join("by4.safetensors");
    pack(by4.to_str().unwrap(), &ck, &packed4);
    refused(
        &packed4,
        ok,
        &[],
        "the verifier refuses recipe `by4` at E=6,H=128,I=128",
    );
    refused(&packed4, ok, &[], "E0501");
    let eight = r#"{"phy2log": [[0,1,2,3,0,1,2,3],[0,1,2,3,0,1,2,3]]}"#;
    refused(&packed4, eight, &["--rank", "0", "--ranks", "4"], "at E=2,");
    let p8 = d.join("eight.json");
    std::fs::write(&p8, eight).unwrap();
    let (code, _, err) = apply(&packed4, &p8, &d.join("by4.placed.safetensors"), &[]);
    assert_eq!(code, 0, "{err}");

    // A per-expert tensor the recipe does not register; a layer missing part of its move set.
    let mut stale = t.clone();
    stale.insert(
        "model.layers.2.mlp.experts.g1_alphas".into(),
        (Dtype::F32, vec![E], vec![0; 4 * E]),
    );
    let f = d.join("stale.safetensors");
    write(&f, &stale, Some(read(&packed).1));
    refused(
        &f,
        ok,
        &[],
        "unregistered expert tensor `model.layers.2.mlp.experts.g1_alphas`",
    );
    let mut partial = t.clone();
    partial.remove("model.layers.2.mlp.experts.w2_weight");
    let f = d.join("partial.safetensors");
    write(&f, &partial, Some(read(&packed).1));
    refused(
        &f,
        ok,
        &[],
        "incomplete move set: layer 2 lacks registered param(s) `w2_weight`",
    );
    // --rank without --ranks is a usage error (clap's exit code 2).
    let (code, _, _) = apply(&packed, &pl, &d.join("x.safetensors"), &["--rank", "0"]);
    assert_eq!(code, 2);
    assert!(!d.join("x.safetensors").exists());
}
