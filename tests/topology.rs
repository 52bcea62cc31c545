//! Topology-invariant scales (issue \[6\] item 5): one checkpoint quantizes to the same bytes under any
//! TP/EP layout. Every standard recipe is packed whole, then split for real (w13 by rows: each rank
//! its gate rows and the same up rows; w2 by columns; or the experts divided over `ep`), each rank
//! packed with the in-process collective doing the reductions, and the ranks' params reassembled in
//! the input's coordinates (`dequant::logical`: codes and the scale of every element, decode scales,
//! per-expert params) must equal the whole pack's byte for byte. Without the reductions (each rank
//! packed alone) the scales differ, so the comparison does see rank-local amaxes. Bad splits are
//! refused by name and write nothing.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
use common::run;

use std::collections::HashMap;
use std::path::Path;

use moeforge::codegen;
use moeforge::dequant::{logical, Logical};
use moeforge::dsl::ModuleInfo;
use moeforge::pack::{rank_slice, RankPacker};
use moeforge::runtime::collective::Topology;
use safetensors::tensor::{Dtype, TensorView};

/// Params by name.
type Params = HashMap<String, Vec<u8>>;

/// A small deterministic generator (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn bf16_bits(x: f32) -> u16 {
    (x.to_bits() >> 16) as u16
}

/// `[E, M, K]` bf16 values whose magnitude grows along the rows and the columns, so that every
/// rank's slice has a different amax than the whole (a rank-local amax shows in the scales).
fn weights(rng: &mut Rng, e: usize, m: usize, k: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(e * m * k * 2);
    for x in 0..e {
        for r in 0..m {
            for c in 0..k {
                let g = (1.0 + 3.0 * c as f32 / k as f32) * (1.0 + r as f32 / m as f32);
                let v = rng.unit() * g * (1.0 + x as f32 * 0.25);
                out.extend_from_slice(&bf16_bits(v).to_le_bytes());
            }
        }
    }
    out
}

/// A layer's whole inputs: `w13 [E, 2I, H]`, `w2 [E, H, I]` (bf16), and per-expert activation scales
/// whose largest value sits in the last expert (outside the first EP rank's experts).
fn layer(seed: u64, (e, h, i): (usize, usize, usize)) -> Params {
    let mut rng = Rng(seed);
    let mut p = Params::new();
    p.insert("w13".into(), weights(&mut rng, e, 2 * i, h));
    p.insert("w2".into(), weights(&mut rng, e, h, i));
    let s = |base: f32| -> Vec<u8> {
        (0..e)
            .flat_map(|x| (base * (1.0 + x as f32)).to_le_bytes())
            .collect()
    };
    p.insert("w13_input_scale".into(), s(0.125));
    p.insert("w2_input_scale".into(), s(0.0625));
    p
}

/// The inputs a recipe reads, of `all`.
fn inputs_of(src: &str, all: &Params) -> Params {
    let m = moeforge::dsl::compile(src).unwrap();
    all.iter()
        .filter(|(n, _)| {
            m.tensors.iter().any(|t| {
                &t.name == *n && matches!(t.kind, moeforge::dsl::ir::TensorKind::Input { .. })
            })
        })
        .map(|(n, b)| (n.clone(), b.clone()))
        .collect()
}

/// Run a planned program on the host with one process's collective; the params by name.
fn run_single(prog: &codegen::kir::Program, inputs: &Params) -> Params {
    let c = codegen::host::compile(prog).unwrap();
    let mut bufs = codegen::alloc_buffers(prog, &mut |n| inputs.get(n).cloned()).unwrap();
    c.run(&mut bufs, &codegen::SingleProcess, 1).unwrap();
    params_of(prog, bufs)
}

fn params_of(prog: &codegen::kir::Program, bufs: Vec<Vec<u8>>) -> Params {
    prog.bufs
        .iter()
        .zip(bufs)
        .filter_map(|(b, d)| match &b.role {
            codegen::kir::BufRole::Param(n) => Some((n.clone(), d)),
            _ => None,
        })
        .collect()
}

/// The whole layer packed by one process.
fn pack_whole(
    name: &str,
    src: &str,
    dims: (usize, usize, usize),
    inputs: &Params,
) -> (ModuleInfo, Params) {
    let (e, h, i) = dims;
    let info = moeforge::verify_source(src, name, Some(&format!("E={e},H={h},I={i}"))).unwrap();
    let prog = codegen::plan::plan_with(&info, &|n: &str| inputs.contains_key(n), &|_| false, true)
        .unwrap();
    let params = run_single(&prog, inputs);
    (info, params)
}

/// Every rank of `topo` packed by the library's rank packer: one thread per rank, the in-process
/// collective doing the reductions the sharded plan places.
fn pack_ranks(
    name: &str,
    src: &str,
    dims: (usize, usize, usize),
    inputs: &Params,
    topo: Topology,
) -> (ModuleInfo, Vec<Params>) {
    let mut packer =
        RankPacker::new(src, name, topo, 2, &codegen::host::Options::default()).unwrap();
    let l = packer.pack_layer(inputs, dims, false).unwrap();
    let out = l
        .bufs
        .into_iter()
        .map(|b| params_of(l.program, b))
        .collect();
    (l.info.clone(), out)
}

/// Every rank of `topo` packed alone, as a process that knows nothing of the others would: planned
/// unsharded at the rank shape, run with one process's collective.
fn pack_alone(
    name: &str,
    src: &str,
    dims: (usize, usize, usize),
    inputs: &Params,
    topo: Topology,
) -> (ModuleInfo, Vec<Params>) {
    let (e, h, i) = dims;
    let bind = format!("E={},H={h},I={}", e / topo.ep, i / topo.moe_tp);
    let info = moeforge::verify_source(src, name, Some(&bind)).unwrap();
    let prog = codegen::plan::plan_with(&info, &|n: &str| inputs.contains_key(n), &|_| false, true)
        .unwrap();
    let out = (0..topo.world())
        .map(|r| run_single(&prog, &rank_slice(inputs, dims, 2, topo, r).unwrap()))
        .collect();
    (info, out)
}

/// The params of a pack that hold an output of input `name`'s quantization (or its copy).
fn params_of_input(info: &ModuleInfo, name: &str) -> Vec<String> {
    let m = info.module();
    let ids: Vec<_> = match info.quantization_of(name) {
        Some(q) => q.params().collect(),
        None => info
            .copy_of(name)
            .map(|c| vec![c.param])
            .unwrap_or_default(),
    };
    ids.into_iter()
        .filter_map(|id| m.tensor(id).map(|t| t.name.clone()))
        .collect()
}

/// Compare a topology's ranks, reassembled in the input's coordinates, with the whole pack.
/// Returns the first difference, described.
fn compare(
    whole: (&ModuleInfo, &Params),
    ranks: (&ModuleInfo, &[Params]),
    dims: (usize, usize, usize),
    topo: Topology,
) -> Result<(), String> {
    let (e, _h, i) = dims;
    let (el, j) = (e / topo.ep, i / topo.moe_tp);
    let (winfo, wparams) = whole;
    let (rinfo, rparams) = ranks;
    let mut covered: Vec<String> = Vec::new();
    for input in ["w13", "w2"] {
        covered.extend(params_of_input(winfo, input));
        let w: Logical = logical(winfo, input, wparams)
            .ok_or_else(|| format!("`{input}`: the whole pack cannot be read back"))?;
        let (_, wm, wk) = w.shape;
        for (r, rp) in rparams.iter().enumerate() {
            let (p, t) = (r / topo.moe_tp, r % topo.moe_tp);
            let l = logical(rinfo, input, rp)
                .ok_or_else(|| format!("`{input}`: rank {r}'s pack cannot be read back"))?;
            let (ne, m, k) = l.shape;
            for x in 0..ne {
                let ge = p * el + x;
                if !w.decode.is_empty() {
                    let (a, b) = (l.decode[x], w.decode[ge]);
                    if a != b {
                        return Err(format!(
                            "`{input}`: rank {r} expert {x} (expert {ge}) decode scale {} != {} of the whole pack",
                            f32::from_bits(a),
                            f32::from_bits(b)
                        ));
                    }
                }
                for row in 0..m {
                    let grow = if input == "w13" {
                        if row < j {
                            t * j + row
                        } else {
                            i + t * j + (row - j)
                        }
                    } else {
                        row
                    };
                    for c in 0..k {
                        let gc = if input == "w2" { t * j + c } else { c };
                        let a = (x * m + row) * k + c;
                        let b = (ge * wm + grow) * wk + gc;
                        if l.scales[a] != w.scales[b] {
                            return Err(format!(
                                "`{input}`: rank {r} element ({x}, {row}, {c}) = whole ({ge}, {grow}, {gc}): scale bits {:#x} != {:#x}",
                                l.scales[a], w.scales[b]
                            ));
                        }
                        if l.codes[a] != w.codes[b] {
                            return Err(format!(
                                "`{input}`: rank {r} element ({x}, {row}, {c}) = whole ({ge}, {grow}, {gc}): code {:#x} != {:#x}",
                                l.codes[a], w.codes[b]
                            ));
                        }
                    }
                }
            }
        }
    }
    // Every other param (per-expert scalars: activation scales, alphas) expert by expert.
    for (name, wb) in wparams {
        if covered.contains(name) {
            continue;
        }
        let per = wb.len() / e;
        for (r, rp) in rparams.iter().enumerate() {
            let p = r / topo.moe_tp;
            let rb = rp
                .get(name)
                .ok_or_else(|| format!("rank {r} has no param `{name}`"))?;
            if rb.len() != per * el {
                return Err(format!(
                    "param `{name}`: rank {r} holds {} bytes, expected {}",
                    rb.len(),
                    per * el
                ));
            }
            if rb[..] != wb[p * el * per..(p + 1) * el * per] {
                return Err(format!(
                    "param `{name}`: rank {r}'s experts differ from the whole pack's"
                ));
            }
        }
    }
    for (r, rp) in rparams.iter().enumerate() {
        if rp.len() != wparams.len() {
            return Err(format!(
                "rank {r} has params {:?}, the whole pack {:?}",
                rp.keys().collect::<Vec<_>>(),
                wparams.keys().collect::<Vec<_>>()
            ));
        }
    }
    Ok(())
}

/// One binding admissible for every standard recipe under every topology tested: `I / 4` is a
/// multiple of 128 (FP8 128x128 blocks, NVFP4's 64-row interleave, MXFP4's 32-element blocks).
const DIMS: (usize, usize, usize) = (4, 128, 512);

const TOPOLOGIES: &[Topology] = &[
    Topology { ep: 1, moe_tp: 2 },
    Topology { ep: 1, moe_tp: 4 },
    Topology { ep: 2, moe_tp: 1 },
    Topology { ep: 2, moe_tp: 2 },
];

#[test]
fn every_standard_recipe_packs_the_same_bytes_under_moe_tp_and_ep() {
    let all = layer(0x5eed_0001, DIMS);
    for r in moeforge::kernels::STANDARD {
        let inputs = inputs_of(r.source, &all);
        let (winfo, whole) = pack_whole(r.path, r.source, DIMS, &inputs);
        for &topo in TOPOLOGIES {
            let (rinfo, ranks) = pack_ranks(r.path, r.source, DIMS, &inputs, topo);
            assert_eq!(ranks.len(), topo.world());
            if let Err(why) = compare((&winfo, &whole), (&rinfo, &ranks), DIMS, topo) {
                panic!("recipe `{}`, {topo:?}: {why}", r.name);
            }
        }
    }
}

#[test]
fn without_the_reductions_rank_local_scales_differ() {
    let all = layer(0x5eed_0002, DIMS);
    let tp2 = Topology { ep: 1, moe_tp: 2 };
    let ep2 = Topology { ep: 2, moe_tp: 1 };
    // (recipe, topology, what must differ): per-expert amaxes and w2's row amaxes over `moe_tp`,
    // activation scales over `ep`.
    let cases = [
        ("nvfp4_cutedsl", tp2, "decode scale"),
        ("fp8_per_tensor", tp2, "scale bits"),
        ("int8_per_row", tp2, "`w2`: rank 0 element"),
        ("fp8_per_tensor", ep2, "param `"),
        ("nvfp4_cutedsl", ep2, "param `"),
    ];
    for (name, topo, needle) in cases {
        let r = moeforge::kernels::find(name).unwrap();
        let inputs = inputs_of(r.source, &all);
        let (winfo, whole) = pack_whole(r.path, r.source, DIMS, &inputs);
        let (ainfo, alone) = pack_alone(r.path, r.source, DIMS, &inputs, topo);
        match compare((&winfo, &whole), (&ainfo, &alone), DIMS, topo) {
            Ok(()) => panic!("`{name}` {topo:?}: ranks packed alone matched the whole pack, so the test cannot see rank-local amaxes"),
            Err(why) => assert!(why.contains(needle), "`{name}` {topo:?}: {why}"),
        }
        // The same ranks with the collective: equal.
        let (rinfo, ranks) = pack_ranks(r.path, r.source, DIMS, &inputs, topo);
        compare((&winfo, &whole), (&rinfo, &ranks), DIMS, topo)
            .unwrap_or_else(|why| panic!("`{name}` {topo:?}: {why}"));
    }
    // int8's w13 rows are whole on every rank: its row scales need (and get) no reduction, so a
    // rank packed alone already has the whole pack's w13.
    let r = moeforge::kernels::find("int8_per_row").unwrap();
    let inputs = inputs_of(r.source, &all);
    let (winfo, whole) = pack_whole(r.path, r.source, DIMS, &inputs);
    let (ainfo, alone) = pack_alone(r.path, r.source, DIMS, &inputs, tp2);
    let w = logical(&winfo, "w13", &whole).unwrap();
    let a = logical(&ainfo, "w13", &alone[1]).unwrap();
    let (j, h) = (DIMS.2 / 2, DIMS.1);
    for x in 0..DIMS.0 {
        for row in 0..2 * j {
            let grow = if row < j {
                j + row
            } else {
                DIMS.2 + j + row - j
            };
            for c in 0..h {
                let (ai, wi) = ((x * 2 * j + row) * h + c, (x * 2 * DIMS.2 + grow) * h + c);
                assert_eq!(a.scales[ai], w.scales[wi]);
                assert_eq!(a.codes[ai], w.codes[wi]);
            }
        }
    }
}

#[test]
fn the_sharded_plan_reduces_only_where_a_cut_splits_the_amax() {
    let all = layer(0x5eed_0003, DIMS);
    let steps = |name: &str, topo: Topology| -> Vec<String> {
        let r = moeforge::kernels::find(name).unwrap();
        let inputs = inputs_of(r.source, &all);
        let mut p = RankPacker::new(r.source, r.path, topo, 1, &Default::default()).unwrap();
        let mut present: Vec<String> = inputs.keys().cloned().collect();
        present.sort();
        let (_, prog) = p.plan(DIMS, false, &present).unwrap();
        prog.steps
            .iter()
            .filter_map(|s| match s {
                codegen::kir::Step::AllReduceMax { buf, group } => Some(format!(
                    "{} over {}",
                    prog.bufs[buf.0 as usize].name(),
                    group.name()
                )),
                _ => None,
            })
            .collect()
    };
    let tp2 = Topology { ep: 1, moe_tp: 2 };
    // int8: w2's row amaxes over moe_tp, w13's rows (whole on each rank) not at all.
    assert_eq!(
        steps("int8_per_row", tp2),
        vec!["int8_per_row_w2_row_amax over moe_tp"]
    );
    // Block scales within one rank's slice: nothing to reduce.
    assert!(steps("fp8_block128", tp2).is_empty());
    assert!(steps("mxfp4", tp2).is_empty());
    assert!(steps("bf16", tp2).is_empty());
    // Per-expert amaxes: over moe_tp, as the recipe declares (the identity where one rank holds
    // the whole expert); activation scales over ep. EP cuts no expert, so nothing is added.
    for topo in [tp2, Topology { ep: 2, moe_tp: 1 }] {
        assert_eq!(
            steps("fp8_per_tensor", topo)
                .iter()
                .map(|s| s.split_once(" over ").unwrap())
                .map(|(b, g)| (b.split("_max").next().unwrap().to_string(), g.to_string()))
                .collect::<Vec<_>>(),
            [
                ("fp8_per_tensor_w13_amax", "moe_tp"),
                ("fp8_per_tensor_w2_amax", "moe_tp"),
                ("w13_input_scale", "ep"),
                ("w2_input_scale", "ep"),
            ]
            .map(|(a, b)| (a.to_string(), b.to_string())),
            "{topo:?}"
        );
    }
    // The unsplit plan is the plan of before: a sharding that cuts nothing changes no step.
    let r = moeforge::kernels::find("int8_per_row").unwrap();
    let info = moeforge::verify_source(r.source, r.path, Some("E=4,H=128,I=512")).unwrap();
    let a = codegen::plan::plan(&info, &|_: &str| true).unwrap();
    let b = codegen::plan::plan_sharded(
        &info,
        &|_: &str| true,
        &|_| false,
        false,
        Default::default(),
        &codegen::plan::Sharding::unsplit(),
    )
    .unwrap();
    assert_eq!(a, b);
}

#[test]
fn a_split_that_cuts_a_block_is_refused_by_name() {
    let dims = (2, 64, 256);
    let all = layer(7, dims);
    let r = moeforge::kernels::find("fp8_block128").unwrap();
    let inputs = inputs_of(r.source, &all);
    let mut p = RankPacker::new(
        r.source,
        r.path,
        Topology { ep: 1, moe_tp: 4 },
        1,
        &Default::default(),
    )
    .unwrap();
    // I/4 = 64 rows of gate (and of up) per rank: a 128-row block would straddle two ranks.
    match p.pack_layer(&inputs, dims, false) {
        Err(moeforge::Error::Codegen(codegen::Error::CutBlock {
            input, block, run, ..
        })) => {
            assert_eq!((input.as_str(), block, run), ("w13", 128, 64));
        }
        Err(e) => panic!("expected a cut block, got: {e}"),
        Ok(_) => panic!("a split through 128x128 blocks was packed"),
    }
}

// ---- through the command -------------------------------------------------------------------

/// A fused checkpoint of `layers` layers (`mlp.experts.w13_weight`, `w2_weight`,
/// `w13_input_scale`, `w2_input_scale`); returns each layer's inputs.
fn write_checkpoint(path: &Path, layers: usize, dims: (usize, usize, usize)) -> Vec<Params> {
    let (e, h, i) = dims;
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut out = Vec::new();
    for l in 0..layers {
        let p = layer(100 + l as u64, dims);
        let pre = format!("model.layers.{l}.mlp.experts");
        tensors.push((
            format!("{pre}.w13_weight"),
            Dtype::BF16,
            vec![e, 2 * i, h],
            p["w13"].clone(),
        ));
        tensors.push((
            format!("{pre}.w2_weight"),
            Dtype::BF16,
            vec![e, h, i],
            p["w2"].clone(),
        ));
        for s in ["w13_input_scale", "w2_input_scale"] {
            tensors.push((format!("{pre}.{s}"), Dtype::F32, vec![e], p[s].clone()));
        }
        out.push(p);
    }
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
    out
}

/// A packed file: params of layer `layer` by name, and the metadata.
fn read_packed(path: &Path, layer: usize) -> (Params, HashMap<String, String>) {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let pre = format!("model.layers.{layer}.mlp.experts.");
    let params = st
        .tensors()
        .into_iter()
        .filter_map(|(n, v)| {
            n.strip_prefix(&pre)
                .map(|p| (p.to_string(), v.data().to_vec()))
        })
        .collect();
    (params, meta.metadata().clone().unwrap_or_default())
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn pack_writes_one_file_per_rank_equal_to_the_unsplit_pack() {
    let dims = (4, 64, 256);
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ckpt.safetensors");
    write_checkpoint(&ck, 2, dims);
    for (recipe, ep, tp) in [
        ("nvfp4_cutedsl", 1, 2),
        ("int8_per_row", 2, 2),
        ("fp8_per_tensor", 2, 1),
    ] {
        let whole = dir.path().join(format!("{recipe}.safetensors"));
        let (code, _, err) = run(&[
            "pack",
            recipe,
            "--input",
            ck.to_str().unwrap(),
            "--output",
            whole.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{err}");
        let out = dir.path().join(format!("{recipe}.sharded.safetensors"));
        let (code, stdout, err) = run(&[
            "pack",
            recipe,
            "--input",
            ck.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--ep",
            &ep.to_string(),
            "--moe-tp",
            &tp.to_string(),
        ]);
        assert_eq!(code, 0, "{err}");
        let topo = Topology { ep, moe_tp: tp };
        assert!(!out.exists(), "no file at --output itself: one per rank");
        assert!(
            stdout.contains(&format!("{} ranks", topo.world())),
            "{stdout}"
        );
        let r = moeforge::kernels::find(recipe).unwrap();
        let (e, h, i) = dims;
        let winfo =
            moeforge::verify_source(r.source, r.path, Some(&format!("E={e},H={h},I={i}"))).unwrap();
        let rbind = format!("E={},H={h},I={}", e / ep, i / tp);
        let rinfo = moeforge::verify_source(r.source, r.path, Some(&rbind)).unwrap();
        for layer in 0..2 {
            let (w, _) = read_packed(&whole, layer);
            let mut ranks = Vec::new();
            for rank in 0..topo.world() {
                let path = moeforge::pack::rank_path(&out, rank);
                assert_eq!(
                    path.file_name().unwrap().to_string_lossy(),
                    format!("{recipe}.sharded.rank{rank}.safetensors")
                );
                let (p, meta) = read_packed(&path, layer);
                for (k, v) in [
                    ("rank", rank.to_string()),
                    ("ranks", topo.world().to_string()),
                    ("moe_tp", tp.to_string()),
                    ("ep", ep.to_string()),
                    ("moe_tp_rank", (rank % tp).to_string()),
                    ("ep_rank", (rank / tp).to_string()),
                    ("binding", rbind.clone()),
                    ("unsharded_binding", format!("E={e},H={h},I={i}")),
                    ("recipe", recipe.to_string()),
                ] {
                    assert_eq!(meta.get(&format!("moeforge.{k}")), Some(&v), "{k}");
                }
                let el = e / ep;
                assert_eq!(
                    meta["moeforge.experts"],
                    format!("{}..{}", rank / tp * el, (rank / tp + 1) * el)
                );
                ranks.push(p);
            }
            compare((&winfo, &w), (&rinfo, &ranks), dims, topo)
                .unwrap_or_else(|why| panic!("`{recipe}` {topo:?} layer {layer}: {why}"));
        }
    }
}

#[test]
fn bad_splits_are_refused_by_name_and_write_nothing() {
    let dims = (4, 64, 256);
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ckpt.safetensors");
    write_checkpoint(&ck, 1, dims);
    let out = dir.path().join("out.safetensors");
    let cases: &[(&str, &[&str], &str)] = &[
        // I = 256 is not split into 3.
        (
            "int8_per_row",
            &["--moe-tp", "3"],
            "--moe-tp 3 does not divide the intermediate size I = 256",
        ),
        // 4 experts are not divided over 3 ranks.
        (
            "bf16",
            &["--ep", "3"],
            "--ep 3 does not divide the 4 experts",
        ),
        // I/4 = 64: a 128x128 block would straddle two ranks.
        ("fp8_block128", &["--moe-tp", "4"], "quantization block"),
        // I/8 = 32: NVFP4's 64-row interleave needs I % 64 at the rank shape.
        (
            "nvfp4_cutedsl",
            &["--moe-tp", "8"],
            "is not one the recipe admits",
        ),
        ("bf16", &["--moe-tp", "0"], "at least 1"),
        ("bf16", &["--moe-tp", "2", "--passthrough"], "--passthrough"),
        // One GPU per rank: no machine here has 16.
        (
            "bf16",
            &["--ep", "2", "--moe-tp", "8", "--device", "gpu"],
            "needs 16 CUDA GPUs",
        ),
    ];
    for (recipe, extra, needle) in cases {
        let mut args = vec![
            "pack",
            recipe,
            "--input",
            ck.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let (code, _, err) = run(&args);
        assert_eq!(code, 1, "{recipe} {extra:?}: {err}");
        assert!(
            err.contains(needle),
            "{recipe} {extra:?}: expected {needle:?} in: {err}"
        );
        assert_eq!(
            files_in(dir.path()),
            vec!["ckpt.safetensors"],
            "{recipe} {extra:?}"
        );
    }
    // The cut block names the input.
    let (code, _, err) = run(&[
        "pack",
        "fp8_block128",
        "--input",
        ck.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--moe-tp",
        "4",
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("input `w13` cannot be split so"), "{err}");
}

#[test]
fn rank_files_are_written_all_or_none() {
    let dir = tempfile::tempdir().unwrap();
    let ok = dir.path().join("a.bin");
    // A target that is a directory is refused before anything is written.
    let bad = dir.path().join("b.bin");
    std::fs::create_dir(&bad).unwrap();
    let e = moeforge::write_all_atomic(&[(ok.clone(), vec![1, 2]), (bad.clone(), vec![3])]);
    assert!(e.is_err());
    assert_eq!(files_in(dir.path()), vec!["b.bin"]);
    // The ordinary path: every file in place.
    moeforge::write_all_atomic(&[
        (ok.clone(), vec![1, 2]),
        (dir.path().join("c.bin"), vec![3]),
    ])
    .unwrap();
    assert_eq!(files_in(dir.path()), vec!["a.bin", "b.bin", "c.bin"]);
    assert_eq!(std::fs::read(&ok).unwrap(), vec![1, 2]);
    assert_eq!(
        moeforge::pack::rank_path(Path::new("/x/out.safetensors"), 3),
        Path::new("/x/out.rank3.safetensors")
    );
    assert_eq!(
        moeforge::pack::rank_path(Path::new("out"), 1),
        Path::new("out.rank1")
    );
}

/// ptxas from `MOEFORGE_PTXAS` or scripts/ptxas's cache folder; `None` when neither has one.
fn ptxas() -> Option<std::path::PathBuf> {
    if let Some(p) = std::env::var_os("MOEFORGE_PTXAS") {
        return Some(p.into());
    }
    let cache = std::env::var_os("MOEFORGE_TOOLS_DIR")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME")
                .map(|x| std::path::PathBuf::from(x).join("moeforge/tools"))
        })
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| std::path::PathBuf::from(h).join(".cache/moeforge/tools"))
        })?;
    let p = cache.join("cuda-nvcc-13.0.88/ptxas");
    p.exists().then_some(p)
}

#[test]
fn rank_programs_in_the_gpu_form_match_and_assemble() {
    use codegen::ptx::Target;
    use moeforge::runtime::collective::{Hook, InProcess};
    let small = (2, 64, 256);
    // int4_g128 groups K by 128: H a multiple of it.
    let wide = (2, 128, 256);
    let (all_small, all_wide) = (layer(0x5eed_0004, small), layer(0x5eed_0004, wide));
    let ptxas = ptxas();
    for r in moeforge::kernels::STANDARD {
        let (dims, all) = if r.name == "int4_g128" {
            (wide, &all_wide)
        } else {
            (small, &all_small)
        };
        let inputs = inputs_of(r.source, all);
        let (winfo, whole) = pack_whole(r.path, r.source, dims, &inputs);
        for topo in [Topology { ep: 1, moe_tp: 2 }, Topology { ep: 2, moe_tp: 2 }] {
            let (e, h, i) = dims;
            let bind = format!("E={},H={h},I={}", e / topo.ep, i / topo.moe_tp);
            let info = moeforge::verify_source(r.source, r.path, Some(&bind)).unwrap();
            // The scalar form the GPU runs, through the interpreter, one thread per rank: the
            // program `pack --device gpu --moe-tp/--ep` and `selftest --gpu --nccl` plan for each
            // GPU rank.
            let mut present: Vec<String> = inputs.keys().cloned().collect();
            present.sort();
            let (_, prog) =
                moeforge::gpu_shards::rank_program(r.source, r.path, topo, dims, false, &present)
                    .unwrap();
            assert_eq!(
                prog,
                codegen::plan::plan_sharded(
                    &info,
                    &|n: &str| inputs.contains_key(n),
                    &|_| false,
                    false,
                    Default::default(),
                    &moeforge::pack::rank_sharding(topo),
                )
                .unwrap()
            );
            // The host ranks' program (`pack --moe-tp/--ep` on the host) differs only in the
            // 4-lane form of its kernels: the same buffers, the same all-reduces in the same
            // places between the same kernels.
            let (_, host) =
                moeforge::pack::plan_rank(r.source, r.path, topo, dims, false, &present, true)
                    .unwrap();
            assert_eq!(prog.bufs, host.bufs, "`{}` {topo:?}", r.name);
            let shape = |p: &codegen::kir::Program| -> Vec<String> {
                p.steps
                    .iter()
                    .map(|s| match s {
                        codegen::kir::Step::Kernel(k) => k.name.clone(),
                        codegen::kir::Step::AllReduceMax { buf, group } => {
                            format!("all_reduce_max b{} over {}", buf.0, group.name())
                        }
                    })
                    .collect()
            };
            assert_eq!(shape(&prog), shape(&host), "`{}` {topo:?}", r.name);
            let world = InProcess::world(topo);
            let ranks: Vec<Params> = std::thread::scope(|s| {
                let hs: Vec<_> = world
                    .iter()
                    .enumerate()
                    .map(|(rank, coll)| {
                        let slice = rank_slice(&inputs, dims, 2, topo, rank).unwrap();
                        let prog = &prog;
                        s.spawn(move || {
                            let mut b =
                                codegen::alloc_buffers(prog, &mut |n| slice.get(n).cloned())
                                    .unwrap();
                            codegen::interp::run(prog, &mut b, &Hook(coll)).unwrap();
                            params_of(prog, b)
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            compare((&winfo, &whole), (&info, &ranks), dims, topo)
                .unwrap_or_else(|why| panic!("`{}` {topo:?}, GPU form: {why}", r.name));
            for t in [Target::Sm90a, Target::Sm100a] {
                let ptx = codegen::ptx::compile(&prog, t).unwrap();
                let Some(ptxas) = &ptxas else { continue };
                let dir = tempfile::tempdir().unwrap();
                let src = dir.path().join("k.ptx");
                std::fs::write(&src, &ptx).unwrap();
                let res = std::process::Command::new(ptxas)
                    .arg(format!("-arch={}", t.name()))
                    .arg(&src)
                    .arg("-o")
                    .arg(dir.path().join("k.cubin"))
                    .output()
                    .unwrap();
                assert!(
                    res.status.success(),
                    "ptxas rejected `{}` {topo:?} for {}:\n{}",
                    r.name,
                    t.name(),
                    String::from_utf8_lossy(&res.stderr)
                );
            }
        }
    }
}

/// `pack --device gpu --moe-tp T --ep N` packs rank `r` on GPU `r`. Without enough GPUs (CI has
/// none) it is refused, naming how many it needs, and writes nothing; on a machine with 2 GPUs the
/// rank files equal the host's rank files (tensors and metadata) for every standard recipe under
/// `moe_tp = 2` and `ep = 2`.
#[test]
fn gpu_rank_packs_need_a_gpu_per_rank_and_equal_the_host_ranks() {
    // H = 128: int4_g128 groups K by 128.
    let dims = (4, 128, 256);
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ckpt.safetensors");
    write_checkpoint(&ck, 2, dims);
    let gpus = moeforge::runtime::device::count().unwrap_or(0);
    if gpus < 2 {
        let out = dir.path().join("out.safetensors");
        let (code, _, err) = run(&[
            "pack",
            "fp8_per_tensor",
            "--input",
            ck.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--moe-tp",
            "2",
            "--device",
            "gpu",
        ]);
        assert_eq!(code, 1, "{err}");
        assert!(
            err.contains("packs each of the 2 ranks on its own GPU")
                && err.contains("needs 2 CUDA GPUs"),
            "{err}"
        );
        assert!(err.contains("leave out --device gpu"), "{err}");
        assert_eq!(files_in(dir.path()), vec!["ckpt.safetensors"]);
        return;
    }
    for r in moeforge::kernels::STANDARD {
        for (ep, tp) in [(1, 2), (2, 1)] {
            let mut outs = Vec::new();
            for device in ["host", "gpu"] {
                let out = dir
                    .path()
                    .join(format!("{}.{ep}.{tp}.{device}.safetensors", r.name));
                let (code, stdout, err) = run(&[
                    "pack",
                    r.name,
                    "--input",
                    ck.to_str().unwrap(),
                    "--output",
                    out.to_str().unwrap(),
                    "--ep",
                    &ep.to_string(),
                    "--moe-tp",
                    &tp.to_string(),
                    "--device",
                    device,
                ]);
                assert_eq!(code, 0, "`{}` ep {ep} moe_tp {tp} {device}: {err}", r.name);
                if device == "gpu" {
                    assert!(stdout.contains("on 2 GPUs"), "{stdout}");
                }
                outs.push(out);
            }
            for rank in 0..2 {
                for layer in 0..2 {
                    let host = read_packed(&moeforge::pack::rank_path(&outs[0], rank), layer);
                    let gpu = read_packed(&moeforge::pack::rank_path(&outs[1], rank), layer);
                    assert!(
                        host == gpu,
                        "`{}` ep {ep} moe_tp {tp} rank {rank} layer {layer}: the GPU rank file differs from the host's",
                        r.name
                    );
                }
            }
        }
    }
}
