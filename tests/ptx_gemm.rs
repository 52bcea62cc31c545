//! The grouped-GEMM variants of `moeforge compile --kernels gemm|all`: golden PTX at real model
//! bindings for bf16, `fp8_per_tensor` and `fp8_block128` weights (`BLESS=1` rewrites them), ptxas
//! 13.0 with `-v` on every golden module (no spills, no stack frame, no serialized wgmma, no C75xx
//! diagnostic), the SASS of a bf16 and of the e4m3 modules (HGMMA or QGMMA and the TMA loads,
//! through cuobjdump and nvdisasm), which recipes get which variants (from the weights' dtypes and
//! the registered weight scale's shape, not the recipe's name), and the CLI's behaviour for recipes
//! without one.
//!
//! ptxas comes from `MOEFORGE_PTXAS` (else the cache `scripts/ptxas` fills), cuobjdump from
//! `MOEFORGE_CUOBJDUMP` (else the cache `scripts/sass` fills). Without them these tests say that
//! they skipped, unless `MOEFORGE_REQUIRE_PTXAS` is set (as `scripts/test` does): then they fail.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stderr
)]

use std::path::{Path, PathBuf};
use std::process::Command;

use moeforge::codegen::gemm::tune;
use moeforge::codegen::gemm::ws::{Operands, OutTy, Scaling, WsConfig};
use moeforge::gemm_variants;

/// The bindings of the golden files: (label, binding).
const MODELS: [(&str, &str); 2] = [
    ("qwen3-30b-a3b", "E=128,H=2048,I=768"),
    ("deepseek-v3-ep8", "E=32,H=7168,I=2048"),
];

/// The golden modules: (recipe, model label, binding). bf16 at both models, the two FP8 families
/// (tensorwise and 128x128 block scales) at the first.
const GOLDENS: [(&str, &str, &str); 12] = [
    ("bf16", MODELS[0].0, MODELS[0].1),
    ("bf16", MODELS[1].0, MODELS[1].1),
    ("fp8_per_tensor", MODELS[0].0, MODELS[0].1),
    ("fp8_block128", MODELS[0].0, MODELS[0].1),
    // W8A16: the decode form only (register-sourced A).
    ("int8_per_row", MODELS[0].0, MODELS[0].1),
    // W4A16: NVFP4, MXFP4 and INT4 g128 codes with their group scales, decode only.
    ("nvfp4_cutedsl", MODELS[0].0, MODELS[0].1),
    ("mxfp4", MODELS[0].0, MODELS[0].1),
    ("int4_g128", MODELS[0].0, MODELS[0].1),
    // Asymmetric INT4 (the variant recipe): a zero point in each group's scale element.
    ("int4_g128_zp", MODELS[0].0, MODELS[0].1),
    // Group-wise INT8 (the variant recipe): each group's partial sum promoted by its row's scale.
    ("int8_g128", MODELS[0].0, MODELS[0].1),
    // FP8 per channel (the variant recipe): a weight scale per row with the token's.
    ("fp8_channel", MODELS[0].0, MODELS[0].1),
    // Group-wise FP8 (the variant recipe): each group's partial sum promoted by its row's scale.
    ("fp8_g128", MODELS[0].0, MODELS[0].1),
];

mod common;

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/ptx_gemm")
}

fn plan_of(src: &str, file: &str, bind: &str) -> moeforge::gemm_variants::Plan {
    let info = moeforge::verify_source(src, file, Some(bind)).unwrap();
    moeforge::gemm_variants::plan(&info).unwrap()
}

/// The plan of the standard recipe `recipe` at `bind`.
fn recipe_plan(recipe: &str, bind: &str) -> moeforge::gemm_variants::Plan {
    let r = moeforge::kernels::find(recipe).unwrap();
    plan_of(r.source, r.path, bind)
}

fn bf16_plan(bind: &str) -> moeforge::gemm_variants::Plan {
    recipe_plan("bf16", bind)
}

fn golden_path(recipe: &str, label: &str) -> PathBuf {
    golden_dir().join(format!("{recipe}_{label}.ptx"))
}

/// `(H, I)` of a binding `E=..,H=..,I=..`.
fn h_i(bind: &str) -> (u32, u32) {
    let dims: Vec<u32> = bind
        .split(',')
        .map(|kv| kv.split_once('=').unwrap().1.parse().unwrap())
        .collect();
    (dims[1], dims[2])
}

fn ptxas() -> Option<PathBuf> {
    common::ptxas("GEMM PTX not assembled")
}

fn cuobjdump() -> Option<PathBuf> {
    common::cuobjdump("GEMM SASS not checked")
}

use common::{assemble, problems};

#[test]
fn golden_gemm_ptx() {
    let bless = std::env::var_os("BLESS").is_some();
    let mut failures = Vec::new();
    for (recipe, label, bind) in GOLDENS {
        let plan = recipe_plan(recipe, bind);
        assert!(plan.missing.is_empty(), "{recipe}: {:?}", plan.missing);
        // The golden files hold the benchmark's forms; the layer's forms follow them in
        // `compile`'s output and are assembled below (`ptxas_assembles_the_layer_forms`).
        let got = plan.bench_module();
        assert_eq!(
            got,
            recipe_plan(recipe, bind).bench_module(),
            "not deterministic"
        );
        assert!(plan.module().starts_with(&got));
        failures.extend(common::golden(&golden_path(recipe, label), &got, bless));
    }
    assert!(
        failures.is_empty(),
        "golden GEMM PTX mismatches (BLESS=1 to update):\n{}",
        failures.join("\n")
    );
}

/// `(gemm, family, entry, n, k, stages, ws config)` of every variant of a plan.
type Row = (
    &'static str,
    &'static str,
    String,
    u32,
    u32,
    u32,
    Option<WsConfig>,
);

fn rows(plan: &moeforge::gemm_variants::Plan) -> Vec<Row> {
    plan.variants
        .iter()
        .map(|v| (v.gemm, v.family, v.entry.clone(), v.n, v.k, v.stages, v.ws))
        .collect()
}

/// The module holds the header once and exactly the plan's entries, in order.
fn check_module(plan: &moeforge::gemm_variants::Plan) {
    let module = plan.module();
    assert_eq!(module.matches(".version 8.7").count(), 1);
    assert_eq!(
        module.matches(".visible .entry").count(),
        plan.variants.len() + plan.layer.len()
    );
    let mut at = 0;
    for v in plan.variants.iter().chain(&plan.layer) {
        let pos = module[at..]
            .find(&format!(".visible .entry {}(", v.entry))
            .unwrap_or_else(|| panic!("{} missing or out of order", v.entry));
        at += pos + 1;
        assert!(v.ptx.contains(&format!(".visible .entry {}(", v.entry)));
    }
}

#[test]
fn the_bf16_variants_are_v0_at_three_stage_counts_then_the_ws_candidates() {
    for (_, bind) in MODELS {
        let plan = bf16_plan(bind);
        let (h, i) = h_i(bind);
        let mut want: Vec<Row> = Vec::new();
        for (gemm, n, k) in [("w13", 2 * i, h), ("w2", h, i)] {
            for s in [3, 2, 4] {
                let entry = format!("moeforge_gemm_bf16_v0_{gemm}_s{s}");
                assert_eq!(entry, gemm_variants::bf16_v0_entry(gemm, s));
                want.push((gemm, "bf16_v0", entry, n, k, s, None));
            }
            let cands = tune::candidates(Operands::Bf16, Scaling::None, n, k);
            assert!(cands.iter().any(|c| c.swap_ab) && cands.iter().any(|c| !c.swap_ab));
            for c in cands {
                let entry = format!("moeforge_gemm_{}_{gemm}", c.tag());
                assert_eq!(entry, gemm_variants::ws_entry(gemm, &c));
                assert_eq!(c.out, OutTy::Bf16);
                want.push((gemm, "ws", entry, n, k, c.stages, Some(c)));
            }
        }
        assert_eq!(rows(&plan), want, "{bind}");
        assert_eq!(plan.variants.len(), want.len(), "{bind}");
        assert!(plan.variants.iter().all(|v| v.scale_param.is_none()));
        for v in &plan.variants {
            let param = if v.gemm == "w13" {
                "w13_weight"
            } else {
                "w2_weight"
            };
            assert_eq!(v.param, param);
        }
        check_module(&plan);
    }
}

#[test]
fn the_fp8_variants_follow_the_weight_scale_shape() {
    for (_, bind) in MODELS {
        let (h, i) = h_i(bind);
        // [E] scales: the tensorwise candidates, per-token activation scales first, then static.
        let plan = recipe_plan("fp8_per_tensor", bind);
        assert!(plan.missing.is_empty(), "{:?}", plan.missing);
        let mut want: Vec<Row> = Vec::new();
        for (gemm, n, k) in [("w13", 2 * i, h), ("w2", h, i)] {
            for per_token in [true, false] {
                let s = Scaling::Tensorwise { per_token };
                for c in tune::candidates(Operands::E4m3, s, n, k) {
                    want.push((
                        gemm,
                        "ws",
                        gemm_variants::ws_entry(gemm, &c),
                        n,
                        k,
                        c.stages,
                        Some(c),
                    ));
                }
            }
        }
        assert_eq!(rows(&plan), want, "{bind}");
        assert_eq!(plan.variants.len(), want.len(), "{bind}");
        for v in &plan.variants {
            assert_eq!(
                v.scale_param.as_deref(),
                Some(format!("{}_weight_scale", v.gemm).as_str())
            );
            let tag = v.ws.unwrap().tag();
            assert!(
                tag.starts_with("e4m3t_") || tag.starts_with("e4m3s_"),
                "{tag}"
            );
        }
        check_module(&plan);
        // [E, ceil(N/128), ceil(K/128)] scales: the block-scaled candidates.
        let plan = recipe_plan("fp8_block128", bind);
        assert!(plan.missing.is_empty(), "{:?}", plan.missing);
        let mut want: Vec<Row> = Vec::new();
        for (gemm, n, k) in [("w13", 2 * i, h), ("w2", h, i)] {
            for c in tune::candidates(Operands::E4m3, Scaling::Block128, n, k) {
                want.push((
                    gemm,
                    "ws",
                    gemm_variants::ws_entry(gemm, &c),
                    n,
                    k,
                    c.stages,
                    Some(c),
                ));
            }
        }
        assert_eq!(rows(&plan), want, "{bind}");
        assert_eq!(plan.variants.len(), want.len(), "{bind}");
        for v in &plan.variants {
            assert_eq!(
                v.scale_param.as_deref(),
                Some(format!("{}_weight_scale_inv", v.gemm).as_str())
            );
            assert!(v.ws.unwrap().tag().starts_with("e4m3b_"));
        }
        check_module(&plan);
    }
}

/// The FP8 variants' activation scalings are the recipe's declared ones (SPEC §9), not both
/// regardless: per-token only, static only, or both where the static scale is optional.
#[test]
fn the_fp8_variants_follow_the_declared_activation_scheme() {
    let bind = "E=4,H=256,I=128";
    let per_tensor = moeforge::kernels::find("fp8_per_tensor").unwrap().source;
    let declared =
        "activation fp8(static(w13 = w13_input_scale, w2 = w2_input_scale) else per_token)";
    assert!(per_tensor.contains(declared));
    let scalings = |src: &str| -> Vec<(&'static str, Scaling)> {
        let plan = plan_of(src, "x.recipe", bind);
        assert!(plan.missing.is_empty(), "{:?}", plan.missing);
        let mut out: Vec<(&'static str, Scaling)> = Vec::new();
        for v in &plan.variants {
            let s = (v.gemm, v.ws.unwrap().scaling);
            if !out.contains(&s) {
                out.push(s);
            }
        }
        out
    };
    let tok = Scaling::Tensorwise { per_token: true };
    let stat = Scaling::Tensorwise { per_token: false };
    // Optional static scales with a per-token fallback: both, per-token first.
    assert_eq!(
        scalings(per_tensor),
        [("w13", tok), ("w13", stat), ("w2", tok), ("w2", stat)]
    );
    // Dynamic per-token only.
    let dynamic = per_tensor.replace(declared, "activation fp8(per_token)");
    assert_eq!(scalings(&dynamic), [("w13", tok), ("w2", tok)]);
    // Static scales that are always present: static only.
    let always = per_tensor.replace(" optional", "").replace(
        declared,
        "activation fp8(static(w13 = w13_input_scale, w2 = w2_input_scale))",
    );
    assert_eq!(scalings(&always), [("w13", stat), ("w2", stat)]);
    // Pairings no kernel implements are missing, never guessed.
    let grouped = per_tensor.replace(declared, "activation fp8(per_token_group = 128)");
    let plan = plan_of(&grouped, "x.recipe", bind);
    assert!(plan.variants.is_empty());
    assert_eq!(plan.missing.len(), 2);
    assert!(
        plan.missing[0]
            .contains("`per_token_group = 128` activation scales with per-tensor weight scales"),
        "{:?}",
        plan.missing
    );
    let block = moeforge::kernels::find("fp8_block128").unwrap().source;
    let per_token_block = block.replace(
        "activation fp8(per_token_group = 128)",
        "activation fp8(per_token)",
    );
    assert_ne!(per_token_block, block);
    let plan = plan_of(&per_token_block, "x.recipe", bind);
    assert!(plan.variants.is_empty());
    assert!(
        plan.missing[1].contains("`per_token` activation scales with 128x128 block weight scales")
            && plan.missing[1].contains("`w2_weight`"),
        "{:?}",
        plan.missing
    );
}

/// Every golden module's plan covers each family in both forms (prefill and decode).
#[test]
fn the_golden_modules_cover_every_family_in_both_forms() {
    let mut covered = std::collections::BTreeSet::new();
    for (recipe, _, bind) in GOLDENS {
        for v in &recipe_plan(recipe, bind).variants {
            if let Some(c) = v.ws {
                let family = match c.scaling {
                    Scaling::None => "bf16",
                    Scaling::Tensorwise { .. } => "tensorwise",
                    Scaling::Block128 => "block128",
                    Scaling::Channelwise { .. } => "channelwise",
                    Scaling::PerRow => "per_row",
                    Scaling::PerExpert => "per_expert",
                    Scaling::PerRowGroup { .. } => "per_row_group",
                    Scaling::Groupwise { .. } => "groupwise",
                };
                // Int8 and 4-bit weights: the decode form only.
                assert!(!c.operands.register_a() || c.swap_ab);
                covered.insert((family, c.swap_ab));
            }
        }
    }
    for family in ["bf16", "tensorwise", "block128", "channelwise"] {
        for swap_ab in [false, true] {
            assert!(covered.contains(&(family, swap_ab)), "{family} {swap_ab}");
        }
    }
}

#[test]
fn ptxas_assembles_every_golden_gemm_variant_without_spills_or_serialization() {
    let Some(ptxas) = ptxas() else { return };
    let dir = tempfile::tempdir().unwrap();
    for (recipe, label, bind) in GOLDENS {
        let path = golden_path(recipe, label);
        let entries = std::fs::read_to_string(&path)
            .unwrap()
            .matches(".visible .entry")
            .count();
        assert_eq!(
            entries,
            recipe_plan(recipe, bind).variants.len(),
            "{}",
            path.display()
        );
        let t = std::time::Instant::now();
        let report = assemble(
            &ptxas,
            &path,
            &dir.path().join(format!("{recipe}_{label}.cubin")),
        );
        let p = problems(&report, entries);
        assert!(
            p.is_empty(),
            "ptxas -v on {}: {p:?}\n{report}",
            path.display()
        );
        eprintln!(
            "{}: {entries} entries in {:.2?}\n{report}",
            path.display(),
            t.elapsed()
        );
    }
}

/// The MoE layer's own forms of every golden recipe's GEMMs (`Plan::layer`: f32 out, the fused
/// SiLU*up epilogue, the in-place row modes), which `compile --kernels gemm` writes after the
/// golden entries: ptxas -v assembles them with no spill, stack frame or serialized wgmma, and
/// their SASS holds the family's MMA (HGMMA for bf16, int8 and 4-bit weights; QGMMA for E4M3).
#[test]
fn ptxas_assembles_the_layer_forms_and_their_sass_holds_the_mma() {
    let Some(ptxas) = ptxas() else { return };
    let sass_tool = cuobjdump();
    let dir = tempfile::tempdir().unwrap();
    for (recipe, label, bind) in GOLDENS {
        let plan = recipe_plan(recipe, bind);
        assert!(!plan.layer.is_empty(), "{recipe}: no layer forms");
        // The layer reads w13 fused wherever its rows pair: every recipe at the golden bindings
        // (fp8_block128's 2I a multiple of 128 there).
        let fused = plan.layer.iter().any(|v| v.entry.contains("_silu_"));
        assert!(fused, "{recipe}");
        assert!(plan.layer.iter().any(|v| v.gemm == "w2"), "{recipe}");
        let path = dir.path().join(format!("{recipe}_{label}_layer.ptx"));
        std::fs::write(&path, plan.layer_module()).unwrap();
        let cubin = dir.path().join(format!("{recipe}_{label}_layer.cubin"));
        let t = std::time::Instant::now();
        let report = assemble(&ptxas, &path, &cubin);
        let p = problems(&report, plan.layer.len());
        assert!(
            p.is_empty(),
            "ptxas -v on {recipe}'s layer forms: {p:?}\n{report}"
        );
        eprintln!(
            "{recipe} {label}: {} layer forms in {:.2?}",
            plan.layer.len(),
            t.elapsed()
        );
        let Some(cuobjdump) = &sass_tool else {
            continue;
        };
        let out = Command::new(cuobjdump)
            .arg("-sass")
            .arg(&cubin)
            .output()
            .unwrap();
        assert!(out.status.success());
        let sass = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            sass.matches("Function : moeforge_gemm_").count(),
            plan.layer.len(),
            "{recipe}"
        );
        let e4m3 = plan
            .layer
            .iter()
            .all(|v| v.ws.is_some_and(|c| c.operands == Operands::E4m3));
        let (want, not) = if e4m3 {
            ("QGMMA", "HGMMA")
        } else {
            ("HGMMA", "QGMMA")
        };
        assert!(
            sass.matches(want).count() >= plan.layer.len(),
            "{recipe}: too few {want}"
        );
        assert!(!sass.contains(not), "{recipe}: {not} in the SASS");
    }
}

#[test]
fn the_ptxas_report_check_counts_every_entry() {
    let ok = "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\nUsed 90 registers";
    assert!(problems(&format!("{ok}\n{ok}"), 2).is_empty());
    assert!(!problems(ok, 2).is_empty());
    let spilled =
        "8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\nUsed 255 registers";
    assert!(!problems(&format!("{ok}\n{spilled}"), 2).is_empty());
    assert!(problems(
        &format!("{ok}\nwarning : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized"),
        1
    )
    .contains(&"wgmma.mma_async instructions are serialized"));
}

/// The SASS of a golden module (through ptxas and cuobjdump), or `None` after saying it skipped.
fn sass_of(recipe: &str, label: &str) -> Option<String> {
    let (Some(ptxas), Some(cuobjdump)) = (ptxas(), cuobjdump()) else {
        return None;
    };
    let dir = tempfile::tempdir().unwrap();
    let cubin = dir.path().join("x.cubin");
    assemble(&ptxas, &golden_path(recipe, label), &cubin);
    let out = Command::new(&cuobjdump)
        .arg("-sass")
        .arg(&cubin)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cuobjdump -sass failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn the_sass_of_the_bf16_variants_holds_hgmma_and_tma_loads() {
    let Some(sass) = sass_of("bf16", "deepseek-v3-ep8") else {
        return;
    };
    let entries = bf16_plan(MODELS[1].1).variants.len();
    assert_eq!(sass.matches("Function : moeforge_gemm_").count(), entries);
    // Six v0 entries, each with four m64n128k16 bf16 wgmmas per k-tile.
    assert_eq!(sass.matches("Function : moeforge_gemm_bf16_v0_").count(), 6);
    let hgmma = sass.matches("HGMMA.64x128x16.F32.BF16").count();
    assert!(hgmma >= 24, "{hgmma} HGMMA.64x128 in the SASS:\n{sass}");
    // The warp-specialized candidates: four MMAs per k-tile at each tile width.
    for n in [256, 128, 64, 32, 16, 8] {
        let m = format!("HGMMA.64x{n}x16.F32.BF16");
        assert!(sass.matches(&m).count() >= 4, "no {m} in the SASS:\n{sass}");
    }
    assert!(!sass.contains("QGMMA"));
    assert!(sass.contains("UTMALDG.2D"), "no TMA load of X:\n{sass}");
    assert!(sass.contains("UTMALDG.3D"), "no TMA load of W:\n{sass}");
    eprintln!(
        "{} HGMMA in {entries} entries",
        sass.matches("HGMMA.").count()
    );
}

/// W8A16 and W4A16: every int8 and 4-bit entry holds bf16 HGMMAs whose A comes from registers
/// (the SASS names the register; a descriptor A is `gdesc`), at each decode tile width, and the
/// TMA loads.
#[test]
fn the_sass_of_the_weights_only_variants_holds_register_a_hgmma() {
    for (recipe, prefix) in [
        ("int8_per_row", "i8wr_"),
        ("nvfp4_cutedsl", "f4eg16x_"),
        ("mxfp4", "f4mg32x_"),
        ("int4_g128", "u4bg128x_"),
        ("int4_g128_zp", "u4zg128x_"),
        ("int8_g128", "i8wg128_"),
    ] {
        register_a_sass(recipe, prefix);
    }
}

fn register_a_sass(recipe: &str, prefix: &str) {
    let Some(sass) = sass_of(recipe, MODELS[0].0) else {
        return;
    };
    let entries = recipe_plan(recipe, MODELS[0].1).variants.len();
    assert_eq!(
        sass.matches(&format!("Function : moeforge_gemm_{prefix}"))
            .count(),
        entries,
        "{recipe}"
    );
    for n in [64, 32, 16, 8] {
        let m = format!("HGMMA.64x{n}x16.F32.BF16");
        let lines: Vec<&str> = sass.lines().filter(|l| l.contains(&m)).collect();
        assert!(lines.len() >= 4, "no {m} in the SASS:\n{sass}");
        for l in lines {
            let ops = &l[l.find(&m).unwrap() + m.len()..];
            let a = ops.split(',').nth(1).unwrap_or("").trim();
            assert!(a.starts_with('R'), "A from a register: {l}");
        }
    }
    assert!(!sass.contains("QGMMA"));
    assert!(
        sass.contains("UTMALDG.2D") && sass.contains("UTMALDG.3D"),
        "{sass}"
    );
    if !recipe.starts_with("int8") {
        // The 4-bit group scales' half broadcasts are folded into the multiplies' half selectors:
        // every variant's `HMUL2.BF16_V2` by a row's scale takes `.H0_H0` or `.H1_H1` (with
        // `prmt` broadcasts, none did: a PRMT each).
        let functions = sass.split("Function : ").skip(1);
        for f in functions {
            assert!(
                f.contains(".H0_H0") && f.contains(".H1_H1"),
                "{recipe}: no HMUL2 half selector in\n{f}"
            );
        }
    }
}

#[test]
fn the_sass_of_the_e4m3_variants_holds_qgmma_and_tma_loads() {
    let label = MODELS[0].0;
    for (recipe, widths) in [
        ("fp8_per_tensor", &[256, 128, 64, 32, 16, 8][..]),
        ("fp8_block128", &[128, 64, 32, 16, 8][..]),
    ] {
        let entries = recipe_plan(recipe, MODELS[0].1).variants.len();
        let Some(sass) = sass_of(recipe, label) else {
            return;
        };
        assert_eq!(
            sass.matches("Function : moeforge_gemm_e4m3").count(),
            entries,
            "{recipe}"
        );
        for n in widths {
            let m = format!("QGMMA.64x{n}x32.F32.E4M3.E4M3");
            assert!(
                sass.matches(&m).count() >= 4,
                "{recipe}: no {m} in the SASS:\n{sass}"
            );
        }
        let qgmma = sass.matches("QGMMA.").count();
        assert!(qgmma >= 4 * entries, "{recipe}: {qgmma} QGMMA");
        assert!(!sass.contains("HGMMA"), "{recipe}");
        assert!(sass.contains("UTMALDG.2D"), "{recipe}: no TMA load of X");
        assert!(sass.contains("UTMALDG.3D"), "{recipe}: no TMA load of W");
        eprintln!("{recipe}: {qgmma} QGMMA in {entries} entries");
    }
}

fn run(args: &[&str]) -> (Option<i32>, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_moeforge"))
        .args(args)
        .output()
        .unwrap();
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn compile_cli_kernels_pack_gemm_all() {
    let (label, bind) = MODELS[0];
    // `pack` is the default and its output is what it was.
    let (code, pack, _) = run(&["compile", "bf16", "--bind", bind]);
    assert_eq!(code, Some(0));
    let (code, pack2, _) = run(&["compile", "bf16", "--bind", bind, "--kernels", "pack"]);
    assert_eq!(code, Some(0));
    assert_eq!(pack, pack2);
    assert!(!pack.contains("moeforge_gemm_"));
    // `gemm`: the golden module.
    let (code, gemm, err) = run(&[
        "compile",
        "bf16",
        "--bind",
        bind,
        "--target",
        "sm_90a",
        "--kernels",
        "gemm",
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(gemm, bf16_plan(bind).module());
    if std::env::var_os("BLESS").is_none() {
        let golden = std::fs::read_to_string(golden_path("bf16", label)).unwrap();
        assert!(gemm.starts_with(&golden));
    }
    // `all`: the pack module, then the GEMM entries, in one module.
    let (code, all, err) = run(&["compile", "bf16", "--bind", bind, "--kernels", "all"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(all, pack.clone() + &bf16_plan(bind).entries());
    assert_eq!(all.matches(".version").count(), 1);
    assert!(err.is_empty(), "{err}");
    // -o for gemm.
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("gemm.ptx");
    let (code, _, _) = run(&[
        "compile",
        "bf16",
        "--bind",
        bind,
        "--kernels",
        "gemm",
        "-o",
        target.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(0));
    assert_eq!(std::fs::read_to_string(&target).unwrap(), gemm);
    // Usage errors.
    let (code, _, err) = run(&["compile", "bf16", "--bind", bind, "--kernels", "moe"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("unknown --kernels `moe`"), "{err}");
    for t in ["sm_100a", "host"] {
        let (code, out, err) = run(&[
            "compile",
            "bf16",
            "--bind",
            bind,
            "--target",
            t,
            "--kernels",
            "gemm",
        ]);
        assert_eq!(code, Some(1));
        assert!(out.is_empty());
        assert!(err.contains("sm_90a PTX only"), "{err}");
    }
}

#[test]
fn compile_cli_gemm_and_all_for_the_fp8_recipes() {
    let (label, bind) = MODELS[0];
    for recipe in ["fp8_per_tensor", "fp8_block128"] {
        let plan = recipe_plan(recipe, bind);
        let (code, gemm, err) = run(&["compile", recipe, "--bind", bind, "--kernels", "gemm"]);
        assert_eq!(code, Some(0), "{recipe}: {err}");
        assert!(err.is_empty(), "{recipe}: {err}");
        assert_eq!(gemm, plan.module(), "{recipe}");
        if std::env::var_os("BLESS").is_none() {
            let golden = std::fs::read_to_string(golden_path(recipe, label)).unwrap();
            assert!(gemm.starts_with(&golden), "{recipe}");
        }
        let (code, pack, _) = run(&["compile", recipe, "--bind", bind]);
        assert_eq!(code, Some(0), "{recipe}");
        let (code, all, err) = run(&["compile", recipe, "--bind", bind, "--kernels", "all"]);
        assert_eq!(code, Some(0), "{recipe}: {err}");
        assert!(err.is_empty(), "{recipe}: {err}");
        assert_eq!(all, pack + &plan.entries(), "{recipe}");
        assert_eq!(all.matches(".version").count(), 1);
    }
}

#[test]
fn recipes_without_a_gemm_variant_fail_gemm_and_note_it_in_all() {
    let bind = MODELS[0].1;
    // What `check` accepts and `pack` packs but no GEMM serves: `compile --kernels gemm` says so
    // by name, `all` still writes the pack kernels. (Every standard recipe has its variants: here,
    // group-wise INT4 in groups of 8, shorter than the W4A16 kernel's k16 step.)
    let dir = tempfile::tempdir().unwrap();
    let g8 = dir.path().join("int4_g8.recipe");
    let src = common::int4_g8_source();
    std::fs::write(&g8, src).unwrap();
    // And group-wise INT8 in groups of 32, shorter than the group-wise W8A16 GEMM's k-tile.
    let i8g = dir.path().join("int8_g32.recipe");
    let src32 = moeforge::kernels::find("int8_g128")
        .unwrap()
        .source
        .replace("group = 128", "group = 32")
        .replace("/128]", "/32]");
    std::fs::write(&i8g, &src32).unwrap();
    let i8g = i8g.to_str().unwrap();
    // And asymmetric INT4 in groups of 16 (zero points take groups of at least 32 on the GPU).
    let z16 = dir.path().join("int4_zp_g16.recipe");
    let src16 = moeforge::kernels::find("int4_g128_zp")
        .unwrap()
        .source
        .replace("group = 128", "group = 16")
        .replace("/128]", "/16]");
    std::fs::write(&z16, &src16).unwrap();
    let z16 = z16.to_str().unwrap();
    for (recipe, want) in [
        (
            g8.to_str().unwrap(),
            "no GEMM variant for u4 weights (W4A16 takes E2M1 codes with E4M3 scales per 16 or E8M0 per 32, and INT4 with groups of a power of two",
        ),
        (
            z16,
            "no GEMM variant for u4 weights (W4A16 takes E2M1 codes with E4M3 scales per 16 or E8M0 per 32, and INT4 with groups of a power of two (at least 32 with zero points)",
        ),
        (
            i8g,
            "no GEMM variant for i8 weights with group-wise scales in groups other than a power of two of at least 64",
        ),
    ] {
        assert_eq!(
            run(&["check", recipe, "--bind", bind]).0,
            Some(0),
            "{recipe}: check accepts it"
        );
        // `gemm`: exit 1, the message on stderr, nothing written.
        let err = gemm_compile_refused(recipe, bind);
        assert!(err.contains(&format!("error: {want}")), "{recipe}: {err}");
        assert!(
            err.contains("`w13_weight`") && err.contains("`w2_weight`"),
            "{err}"
        );
        // `all`: the pack kernels, exit 0, the same message as a note.
        let (code, all, err) = run(&["compile", recipe, "--bind", bind, "--kernels", "all"]);
        assert_eq!(code, Some(0), "{recipe}: {err}");
        let (_, pack, _) = run(&["compile", recipe, "--bind", bind]);
        assert_eq!(all, pack, "{recipe}");
        assert!(err.contains(&format!("note: {want}")), "{recipe}: {err}");
    }
}

#[test]
fn variants_follow_the_weights_dtypes_not_the_recipe_name() {
    let bind = "E=4,H=256,I=128";
    // A recipe of another name whose weights are bf16 gets the bf16 variants.
    let r = moeforge::kernels::find("bf16").unwrap();
    let renamed = r.source.replace("recipe bf16(", "recipe my_experts(");
    assert_ne!(renamed, r.source);
    let plan = plan_of(&renamed, "my_experts.recipe", bind);
    assert!(plan.missing.is_empty(), "{:?}", plan.missing);
    assert_eq!(plan.variants, bf16_plan(bind).variants);
    assert_eq!((plan.variants[0].n, plan.variants[0].k), (256, 256));
    assert_eq!(plan.variants[0].family, "bf16_v0");
    let w2_first = 3 + tune::candidates(Operands::Bf16, Scaling::None, 256, 256).len();
    assert_eq!(
        (plan.variants[w2_first].n, plan.variants[w2_first].k),
        (256, 128)
    );
    assert_eq!(plan.variants[w2_first].gemm, "w2");
    // A recipe named bf16 whose weights are e4m3 gets the FP8 variants its weight scales call for:
    // the same as the FP8 recipe's own.
    for (fp8, scaling) in [
        ("fp8_per_tensor", Scaling::Tensorwise { per_token: true }),
        ("fp8_block128", Scaling::Block128),
    ] {
        let r = moeforge::kernels::find(fp8).unwrap();
        let named = r.source.replace(&format!("recipe {fp8}("), "recipe bf16(");
        assert_ne!(named, r.source);
        let plan = plan_of(&named, "bf16.recipe", bind);
        assert!(plan.missing.is_empty(), "{:?}", plan.missing);
        assert_eq!(plan.variants, recipe_plan(fp8, bind).variants, "{fp8}");
        assert!(!plan.variants.is_empty());
        for v in &plan.variants {
            let c = v.ws.unwrap();
            assert_eq!((v.family, c.operands), ("ws", Operands::E4m3));
            assert_eq!(
                std::mem::discriminant(&c.scaling),
                std::mem::discriminant(&scaling)
            );
        }
    }
    // e4m3 weights whose scales are not registered under the weight's name get none.
    let r = moeforge::kernels::find("fp8_per_tensor").unwrap();
    let unnamed = r
        .source
        .replace("w13_weight_scale", "scale13")
        .replace("w2_weight_scale", "scale2");
    let plan = plan_of(&unnamed, "x.recipe", bind);
    assert!(plan.variants.is_empty());
    assert_eq!(plan.missing.len(), 2);
    for (m, w) in plan.missing.iter().zip(["`w13_weight`", "`w2_weight`"]) {
        assert!(
            m.contains("no GEMM variant for e4m3 weights without a registered f32 weight scale")
                && m.contains("yet (issue [7])")
                && m.contains(w),
            "{m}"
        );
    }
    // Through the CLI, from a file.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("my_experts.recipe");
    std::fs::write(&file, &renamed).unwrap();
    let (code, out, err) = run(&[
        "compile",
        file.to_str().unwrap(),
        "--bind",
        bind,
        "--kernels",
        "gemm",
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out, plan_of(&renamed, "x", bind).module());
}

#[test]
fn what_check_accepts_gets_gemm_variants_that_assemble_at_the_binding_extremes() {
    // The verifier and the GEMM generator agree: each recipe's smallest and largest admissible
    // bindings (H, I multiples of 8 (bf16) or 16 (FP8) up to 16384) get their variants, and they
    // assemble cleanly.
    let ptxas = ptxas();
    let dir = tempfile::tempdir().unwrap();
    for (recipe, bind) in [
        ("bf16", "E=1,H=8,I=8"),
        ("bf16", "E=3,H=16384,I=16384"),
        ("bf16", "E=5,H=136,I=200"),
        ("fp8_per_tensor", "E=1,H=16,I=16"),
        ("fp8_per_tensor", "E=3,H=16384,I=16384"),
        ("fp8_block128", "E=1,H=16,I=16"),
        ("fp8_block128", "E=5,H=144,I=208"),
    ] {
        let plan = recipe_plan(recipe, bind);
        assert!(
            plan.missing.is_empty(),
            "{recipe} {bind}: {:?}",
            plan.missing
        );
        assert!(!plan.variants.is_empty());
        let Some(ptxas) = &ptxas else { continue };
        let ptx = dir.path().join("v.ptx");
        std::fs::write(&ptx, plan.module()).unwrap();
        let report = assemble(ptxas, &ptx, &dir.path().join("v.cubin"));
        let p = problems(&report, plan.variants.len() + plan.layer.len());
        assert!(p.is_empty(), "{recipe} {bind}: {p:?}\n{report}");
    }
}

/// `check` and the GEMM plan agree: for every standard recipe that declares `on sm_90a` kernel
/// bindings, every param a planned GEMM variant reads (its weight and, where scaled, its weight
/// scale) is read by one of those bindings, so what `check` lists for the Hopper GEMMs is what the
/// generated GEMMs take; and every standard recipe has variants for both GEMMs.
#[test]
fn the_sm90a_bindings_cover_what_the_planned_gemms_read() {
    use moeforge::dsl::ir::Target;
    let bind = MODELS[0].1;
    for r in moeforge::kernels::STANDARD {
        let info = moeforge::verify_source(r.source, r.path, Some(bind)).unwrap();
        let m = info.module();
        let hopper: Vec<Vec<String>> = m
            .kernels
            .iter()
            .filter(|k| k.targets.contains(&Target::Sm90a))
            .map(|k| {
                k.operands
                    .iter()
                    .map(|(id, _)| m.tensor(*id).unwrap().name.clone())
                    .collect()
            })
            .collect();
        let plan = recipe_plan(r.name, bind);
        assert!(plan.missing.is_empty(), "{}: {:?}", r.name, plan.missing);
        for gemm in ["w13", "w2"] {
            assert!(
                plan.variants.iter().any(|v| v.gemm == gemm),
                "{}: no {gemm} variant",
                r.name
            );
        }
        // Every standard recipe declares its Hopper GEMMs.
        assert!(!hopper.is_empty(), "{}: no `on sm_90a` binding", r.name);
        for v in &plan.variants {
            let reads: Vec<&String> = std::iter::once(&v.param).chain(&v.scale_param).collect();
            assert!(
                hopper.iter().any(|b| reads.iter().all(|p| b.contains(*p))),
                "{}: {} reads {reads:?}, no sm_90a binding reads them all: {hopper:?}",
                r.name,
                v.entry
            );
        }
    }
}

/// The GEMM plan follows the recipe's kernel bindings: `nvfp4_cutedsl` without its `on sm_90a`
/// bindings (only the Blackwell ones, which read the MMA scale view and the alphas) gets no Hopper
/// GEMM, and `compile --kernels gemm` says which param no binding reads, writing nothing.
#[test]
fn a_recipe_without_hopper_bindings_gets_no_hopper_gemm() {
    let src = common::nvfp4_without_sm90_bindings();
    let bind = MODELS[0].1;
    let plan = plan_of(&src, "no_sm90.recipe", bind);
    assert!(plan.variants.is_empty(), "{:?}", plan.variants.len());
    assert_eq!(plan.missing.len(), 2, "{:?}", plan.missing);
    assert!(
        plan.missing[0]
            .contains("no `on sm_90a` kernel binding reads `w13_weight` and `w13_weight_scale`"),
        "{:?}",
        plan.missing
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("no_sm90.recipe");
    std::fs::write(&path, &src).unwrap();
    let err = gemm_compile_refused(path.to_str().unwrap(), bind);
    assert!(err.contains("no `on sm_90a` kernel binding"), "{err}");
}

/// `compile RECIPE --bind BIND --kernels gemm -o FILE` refused: exit 1, nothing on stdout, no file
/// written. Its stderr.
fn gemm_compile_refused(recipe: &str, bind: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("gemm.ptx");
    let (code, out, err) = run(&[
        "compile",
        recipe,
        "--bind",
        bind,
        "--kernels",
        "gemm",
        "-o",
        target.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(1), "{recipe}: {err}");
    assert!(out.is_empty(), "{recipe}: {out}");
    assert!(!target.exists(), "{recipe}");
    err
}

/// NVFP4's Hopper GEMMs read the decode scale too (the layer folds `*_weight_scale_2` into each
/// expert's factor): `nvfp4_cutedsl` with `on sm_90a` bindings that leave it out gets no Hopper
/// GEMM, and the refusal names it.
#[test]
fn a_hopper_binding_without_the_decode_scale_gets_no_hopper_gemm() {
    let r = moeforge::kernels::find("nvfp4_cutedsl").unwrap();
    let src = r
        .source
        .replace(", w13_weight_scale_2) on sm_90a", ") on sm_90a")
        .replace(", w2_weight_scale_2) on sm_90a", ") on sm_90a");
    assert_ne!(src, r.source);
    let plan = plan_of(&src, "no_decode.recipe", MODELS[0].1);
    assert!(plan.variants.is_empty(), "{:?}", plan.variants.len());
    assert_eq!(plan.missing.len(), 2, "{:?}", plan.missing);
    for (m, gemm) in plan.missing.iter().zip(["w13", "w2"]) {
        assert!(
            m.contains(&format!(
                "no `on sm_90a` kernel binding reads `{gemm}_weight` and `{gemm}_weight_scale` and `{gemm}_weight_scale_2`"
            )),
            "{m}"
        );
    }
}

/// The verifier and the GEMM generator agree: at every binding `moeforge check` accepts (a grid of
/// sizes around each standard recipe's constraints: multiples of 8 to 256, and a few model-sized
/// ones), every standard recipe, all of which declare `on sm_90a` kernels, gets a Hopper GEMM
/// variant for both weights (`compile --kernels gemm` would write its module, not refuse it).
#[test]
fn every_binding_check_accepts_gets_both_hopper_gemms() {
    let sizes: Vec<u32> = (1..=32)
        .map(|m| 8 * m)
        .chain([2080, 2112, 2880, 7168])
        .collect();
    let mut accepted = 0;
    for r in moeforge::kernels::STANDARD {
        for &h in &sizes {
            for &i in &sizes {
                let bind = format!("E=4,H={h},I={i}");
                let Ok(info) = moeforge::verify_source(r.source, r.path, Some(&bind)) else {
                    continue;
                };
                accepted += 1;
                let plan = gemm_variants::plan(&info).unwrap();
                assert!(
                    plan.missing.is_empty(),
                    "{} at {bind}: check accepts it, the GEMM plan misses {:?}",
                    r.name,
                    plan.missing
                );
            }
        }
    }
    assert!(accepted > 1000, "{accepted}");
}

/// A declared storage layout that no TMA map of rows serves (`fp8_colmajor`: K is not the
/// contiguous dimension) is read from a copy re-laid on the host: `gemm` writes its variants, exit
/// 0, and says on stderr which GEMM reads a copy and why (issue [8] item 2: the slow pattern,
/// named); the standard recipes, read in place, say nothing.
#[test]
fn a_declared_layout_no_map_serves_is_re_laid_and_said() {
    let bind = "E=8,H=2048,I=768";
    let (code, gemm, err) = run(&[
        "compile",
        "fp8_colmajor",
        "--bind",
        bind,
        "--kernels",
        "gemm",
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        gemm.contains("moeforge_gemm_e4m3t_"),
        "tensorwise FP8 variants"
    );
    for g in ["w13", "w2"] {
        assert!(
            err.contains(&format!("note: {g} reads a copy re-laid on the host: `{g}_weight` is not contiguous along K")),
            "{err}"
        );
    }
    let (code, _, err) = run(&[
        "compile",
        "fp8_per_tensor",
        "--bind",
        bind,
        "--kernels",
        "gemm",
    ]);
    assert_eq!((code, err.as_str()), (Some(0), ""));
}

/// What `check` accepts, `compile --kernels gemm` serves: fp8_block128 with 2I off 128 (I = 208,
/// the recipe's `I % 16` allows it) gets the layer's unfused first GEMM (a paired tile would mix
/// gate and up rows of one scale block with another's), with 2I a multiple of 128 the fused one;
/// nothing missing either way.
#[test]
fn fp8_block128_fuses_where_its_rows_pair_and_is_served_unfused_elsewhere() {
    for (bind, fused) in [("E=8,H=256,I=208", false), ("E=8,H=256,I=192", true)] {
        let plan = recipe_plan("fp8_block128", bind);
        assert!(plan.missing.is_empty(), "{bind}: {:?}", plan.missing);
        let silu = plan.layer.iter().any(|v| v.entry.contains("_silu_"));
        assert_eq!(silu, fused, "{bind}");
        assert!(plan.layer.iter().any(|v| v.gemm == "w13"), "{bind}");
    }
}

/// `fp8_per_tensor` declares static activation scales with a per-token fallback, and the layer
/// picks the fused first GEMM's form by what the packed file holds: with the scales, the codes
/// out of the epilogue (`_silu_qs_f32`); without them, f32 `a` for the activation kernel
/// (`_silu_f32`). What `check` accepts, `compile --kernels gemm` serves in both forms, with the
/// counted dynamic forms (which the layer does not use) in neither.
#[test]
fn fp8_per_tensor_serves_the_static_and_the_fallback_first_gemm() {
    let plan = recipe_plan("fp8_per_tensor", "E=8,H=256,I=192");
    assert!(plan.missing.is_empty(), "{:?}", plan.missing);
    let w13 = |form: &str| {
        plan.layer
            .iter()
            .any(|v| v.gemm == "w13" && v.entry.contains(form))
    };
    assert!(w13("_silu_qs_f32"), "static: the codes out of the epilogue");
    assert!(w13("_silu_f32"), "per-token fallback: f32 `a`");
    assert!(!w13("_silu_qt_f32") && !w13("_silu_qg_f32"));
    assert!(plan
        .layer
        .iter()
        .all(|v| v.gemm != "w2" || !v.entry.contains("_silu")));
}

/// What `check` accepts, `compile --kernels gemm` serves: every variant recipe (other row orders,
/// per-channel and group-wise FP8, int8 in the kernel's order, ...) verifies at Qwen3-30B-A3B's
/// sizes and gets GEMM variants for both GEMMs, none missing (`tests/moe_run.rs` packs each).
#[test]
fn every_variant_recipe_check_accepts_gets_its_gemm_variants() {
    let bind = "E=8,H=2048,I=768";
    for r in moeforge::kernels::VARIANTS {
        let plan = plan_of(r.source, r.path, bind);
        assert!(plan.missing.is_empty(), "{}: {:?}", r.name, plan.missing);
        for gemm in ["w13", "w2"] {
            assert!(
                plan.variants
                    .iter()
                    .chain(&plan.layer)
                    .any(|v| v.gemm == gemm),
                "{}: no {gemm} variant",
                r.name
            );
        }
    }
}
