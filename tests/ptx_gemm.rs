//! The grouped-GEMM variants of `moeforge compile --kernels gemm|all`: golden PTX at real model
//! bindings (`BLESS=1` rewrites them), ptxas 13.0 with `-v` on every variant (no spills, no stack
//! frame, no serialized wgmma, no C75xx diagnostic), the SASS of a bf16 variant (HGMMA and the TMA
//! loads, through cuobjdump and nvdisasm), which recipes get variants (from the weights' dtypes,
//! not the recipe's name), and the CLI's behaviour for recipes without one.
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

/// The bindings of the golden files: (label, binding).
const MODELS: [(&str, &str); 2] = [
    ("qwen3-30b-a3b", "E=128,H=2048,I=768"),
    ("deepseek-v3-ep8", "E=32,H=7168,I=2048"),
];

mod common;

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/ptx_gemm")
}

fn plan_of(src: &str, file: &str, bind: &str) -> moeforge::gemm_variants::Plan {
    let info = moeforge::verify_source(src, file, Some(bind)).unwrap();
    moeforge::gemm_variants::plan(&info).unwrap()
}

fn bf16_plan(bind: &str) -> moeforge::gemm_variants::Plan {
    let r = moeforge::kernels::find("bf16").unwrap();
    plan_of(r.source, r.path, bind)
}

fn cache_tool(var: &str, rel: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(var) {
        return Some(PathBuf::from(p));
    }
    let cache = std::env::var_os("MOEFORGE_TOOLS_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME").map(|x| PathBuf::from(x).join("moeforge/tools"))
        })
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/moeforge/tools"))
        })?;
    let p = cache.join(rel);
    p.exists().then_some(p)
}

/// A tool, or `None` after saying that the test skipped (a failure under `MOEFORGE_REQUIRE_PTXAS`).
fn tool(var: &str, rel: &str, script: &str, what: &str) -> Option<PathBuf> {
    let t = cache_tool(var, rel);
    if t.is_none() {
        assert!(
            std::env::var_os("MOEFORGE_REQUIRE_PTXAS").is_none(),
            "MOEFORGE_REQUIRE_PTXAS is set but {var} is not and the cache holds none (run {script})"
        );
        eprintln!("SKIPPED: {what}: no {rel} found; run scripts/test (or {script})");
    }
    t
}

fn ptxas() -> Option<PathBuf> {
    tool(
        "MOEFORGE_PTXAS",
        "cuda-nvcc-13.0.88/ptxas",
        "scripts/ptxas",
        "GEMM PTX not assembled",
    )
}

fn cuobjdump() -> Option<PathBuf> {
    tool(
        "MOEFORGE_CUOBJDUMP",
        "cuda-sass-13.5.37/cuobjdump",
        "scripts/sass",
        "GEMM SASS not checked",
    )
}

/// What in a `ptxas -v` report of a module with `entries` entries is an error: the serialized
/// wgmma warning, any C75xx performance diagnostic, spills or a stack frame in any entry.
fn problems(report: &str, entries: usize) -> Vec<&'static str> {
    let mut p = Vec::new();
    if report.contains("wgmma.mma_async instructions are serialized") {
        p.push("wgmma.mma_async instructions are serialized");
    }
    if report.contains("(C75") || report.contains("Potential Performance Loss") {
        p.push("a C75xx diagnostic");
    }
    if report
        .matches("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")
        .count()
        != entries
    {
        p.push("spills or a stack frame (or an entry without a report)");
    }
    if report.matches("Used ").count() != entries {
        p.push("an entry without a register report");
    }
    p
}

/// `ptxas -arch=sm_90a -v` of `ptx` into `cubin`; panics on rejection. Returns the report.
fn assemble(ptxas: &Path, ptx: &Path, cubin: &Path) -> String {
    let out = Command::new(ptxas)
        .args(["-arch=sm_90a", "-v"])
        .arg(ptx)
        .arg("-o")
        .arg(cubin)
        .output()
        .unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "ptxas rejected {}:\n{report}",
        ptx.display()
    );
    assert!(std::fs::metadata(cubin).unwrap().len() > 0);
    report
}

#[test]
fn golden_gemm_ptx() {
    let bless = std::env::var_os("BLESS").is_some();
    let mut failures = Vec::new();
    for (label, bind) in MODELS {
        let plan = bf16_plan(bind);
        assert!(plan.missing.is_empty(), "{:?}", plan.missing);
        let got = plan.module();
        assert_eq!(got, bf16_plan(bind).module(), "not deterministic");
        let path = golden_dir().join(format!("bf16_{label}.ptx"));
        failures.extend(common::golden(&path, &got, bless));
    }
    assert!(
        failures.is_empty(),
        "golden GEMM PTX mismatches (BLESS=1 to update):\n{}",
        failures.join("\n")
    );
}

#[test]
fn the_bf16_variants_are_w13_and_w2_at_three_stage_counts() {
    for (_, bind) in MODELS {
        let plan = bf16_plan(bind);
        let dims: Vec<i64> = bind
            .split(',')
            .map(|kv| kv.split_once('=').unwrap().1.parse().unwrap())
            .collect();
        let (h, i) = (dims[1] as u32, dims[2] as u32);
        let got: Vec<(&str, String, u32, u32, u32)> = plan
            .variants
            .iter()
            .map(|v| {
                (
                    v.gemm,
                    v.launch.entry.clone(),
                    v.launch.n,
                    v.launch.k,
                    v.launch.stages,
                )
            })
            .collect();
        let mut want = Vec::new();
        for (gemm, n, k) in [("w13", 2 * i, h), ("w2", h, i)] {
            for s in [3, 2, 4] {
                want.push((gemm, format!("moeforge_gemm_bf16_v0_{gemm}_s{s}"), n, k, s));
            }
        }
        assert_eq!(got, want, "{bind}");
        let module = plan.module();
        assert_eq!(module.matches(".version 8.7").count(), 1);
        assert_eq!(module.matches(".visible .entry").count(), 6);
        for v in &plan.variants {
            assert!(module.contains(&format!(".visible .entry {}(", v.launch.entry)));
        }
    }
}

#[test]
fn ptxas_assembles_every_golden_gemm_variant_without_spills_or_serialization() {
    let Some(ptxas) = ptxas() else { return };
    let dir = tempfile::tempdir().unwrap();
    for (label, _) in MODELS {
        let path = golden_dir().join(format!("bf16_{label}.ptx"));
        let entries = std::fs::read_to_string(&path)
            .unwrap()
            .matches(".visible .entry")
            .count();
        assert_eq!(entries, 6, "{}", path.display());
        let report = assemble(&ptxas, &path, &dir.path().join(format!("{label}.cubin")));
        let p = problems(&report, entries);
        assert!(
            p.is_empty(),
            "ptxas -v on {}: {p:?}\n{report}",
            path.display()
        );
        eprintln!("{report}");
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

#[test]
fn the_sass_of_a_bf16_variant_holds_hgmma_and_tma_loads() {
    let (Some(ptxas), Some(cuobjdump)) = (ptxas(), cuobjdump()) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = golden_dir().join("bf16_deepseek-v3-ep8.ptx");
    let cubin = dir.path().join("x.cubin");
    assemble(&ptxas, &path, &cubin);
    let out = Command::new(&cuobjdump)
        .arg("-sass")
        .arg(&cubin)
        .output()
        .unwrap();
    let sass = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "cuobjdump -sass failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Six entries, each with four m64n128k16 bf16 wgmmas per k-tile.
    assert_eq!(sass.matches("Function : moeforge_gemm_bf16_v0_").count(), 6);
    let hgmma = sass.matches("HGMMA.64x128x16.F32.BF16").count();
    assert!(hgmma >= 24, "{hgmma} HGMMA in the SASS:\n{sass}");
    assert!(sass.contains("UTMALDG.2D"), "no TMA load of X:\n{sass}");
    assert!(sass.contains("UTMALDG.3D"), "no TMA load of W:\n{sass}");
    eprintln!(
        "cuobjdump ({}): {hgmma} HGMMA in 6 entries",
        cuobjdump.display()
    );
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
        let golden =
            std::fs::read_to_string(golden_dir().join(format!("bf16_{label}.ptx"))).unwrap();
        assert_eq!(gemm, golden);
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
fn recipes_without_a_gemm_variant_fail_gemm_and_note_it_in_all() {
    let bind = MODELS[0].1;
    for (recipe, dtype) in [
        ("fp8_per_tensor", "e4m3"),
        ("fp8_block128", "e4m3"),
        ("int8_per_row", "i8"),
        ("mxfp4", "e2m1"),
    ] {
        let want = format!("no GEMM variant for {dtype} weights yet (issue [7])");
        // `gemm`: exit 1, the message on stderr, nothing written.
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
        assert_eq!(code, Some(1), "{recipe}");
        assert!(out.is_empty());
        assert!(err.contains(&format!("error: {want}")), "{recipe}: {err}");
        assert!(
            err.contains("`w13_weight`") && err.contains("`w2_weight`"),
            "{err}"
        );
        assert!(!target.exists());
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
    assert_eq!(plan.variants.len(), 6);
    assert_eq!(
        (plan.variants[0].launch.n, plan.variants[0].launch.k),
        (256, 256)
    );
    assert_eq!(
        (plan.variants[3].launch.n, plan.variants[3].launch.k),
        (256, 128)
    );
    // A recipe named bf16 whose weights are e4m3 gets none.
    let fp8 = moeforge::kernels::find("fp8_per_tensor").unwrap();
    let named = fp8.source.replace("recipe fp8_per_tensor(", "recipe bf16(");
    assert_ne!(named, fp8.source);
    let plan = plan_of(&named, "bf16.recipe", bind);
    assert!(plan.variants.is_empty());
    assert_eq!(plan.missing.len(), 2);
    assert!(plan.missing[0].contains("no GEMM variant for e4m3 weights yet (issue [7])"));
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
    // The verifier and the GEMM generator agree: the bf16 recipe's smallest and largest admissible
    // bindings (H, I multiples of 8 up to 16384) both get their variants, and they assemble cleanly.
    let ptxas = ptxas();
    let dir = tempfile::tempdir().unwrap();
    for bind in ["E=1,H=8,I=8", "E=3,H=16384,I=16384", "E=5,H=136,I=200"] {
        let plan = bf16_plan(bind);
        assert!(plan.missing.is_empty(), "{bind}: {:?}", plan.missing);
        let Some(ptxas) = &ptxas else { continue };
        let ptx = dir.path().join("v.ptx");
        std::fs::write(&ptx, plan.module()).unwrap();
        let report = assemble(ptxas, &ptx, &dir.path().join("v.cubin"));
        let p = problems(&report, 6);
        assert!(p.is_empty(), "{bind}: {p:?}\n{report}");
    }
}
