//! `moeforge cache warmup --model` and the GEMM tuning entries of `cache ls` / `cache clear`, end to
//! end (no GPU: the warm-up generates every variant and says that it skipped the rest).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::Command;

use moeforge::codegen::gemm::tune::candidates;
use moeforge::codegen::gemm::ws::{Epilogue, Operands, OutTy, Scaling, WsConfig};
use moeforge::runtime::gemm_tune::{TuneCache, TuneEntry, TuneKey};

fn run(cache: &Path, args: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> (i32, String, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_moeforge"));
    c.args(args)
        .env("MOEFORGE_CACHE_DIR", cache)
        .env_remove("MOEFORGE_JIT");
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Every candidate of every recipe of a model's w13 and w2 (what the warm-up generates): the GEMM
/// benchmark's bf16-out form, and the MoE layer's: w2 in f32, w13 fused with SiLU*up in bf16 where
/// the recipe feeds the second GEMM bf16 (bf16 here; the FP8 recipes quantize) and its rows pair
/// (whole groups of 16 weight rows per tile; block scales with N a multiple of 128 and tiles of at
/// most 128 rows), else in f32.
fn variants(n13: u32, k13: u32, recipes: &[(Operands, Scaling)]) -> usize {
    let mut total = 0;
    for (w13, n, k) in [(true, n13, k13), (false, k13, n13 / 2)] {
        for &(o, s) in recipes {
            let all = candidates(o, s, n, k);
            total += all.len();
            // Fused where the rows pair (block scales: N a multiple of 128, the tiles of at most
            // 128 rows that the generator serves fused).
            let fused = w13 && n % 16 == 0 && (s != Scaling::Block128 || n % 128 == 0);
            total += if fused {
                all.iter()
                    .filter(|c| c.tile_weights() % 16 == 0)
                    .filter(|c| {
                        WsConfig {
                            epilogue: Epilogue::SiluMul,
                            ..**c
                        }
                        .supported()
                        .is_ok()
                    })
                    .count()
            } else {
                all.len()
            };
        }
    }
    total
}

const ALL: [(Operands, Scaling); 3] = [
    (Operands::Bf16, Scaling::None),
    (Operands::E4m3, Scaling::Tensorwise { per_token: true }),
    (Operands::E4m3, Scaling::Block128),
];

#[test]
fn bad_model_or_recipe_names_fail_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let (code, out, err) = run(dir.path(), &["cache", "warmup", "--model", "nosuch"], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        err.contains("unknown --model `nosuch`") && err.contains("qwen3-30b-a3b"),
        "{err}"
    );
    let (code, _, err) = run(
        dir.path(),
        &[
            "cache",
            "warmup",
            "--model",
            "qwen3-30b-a3b",
            "--recipe",
            "fp8",
        ],
        &[],
    );
    assert_eq!(code, 1);
    assert!(err.contains("unknown --recipe `fp8`"), "{err}");
    let (code, _, err) = run(
        dir.path(),
        &[
            "cache",
            "warmup",
            "--model",
            "qwen3-30b-a3b",
            "--tokens",
            "0",
        ],
        &[],
    );
    assert_eq!(code, 1);
    assert!(err.contains("--tokens"), "{err}");
    // --model is its own kind of warm-up; --recipe and --tokens go with it.
    let (code, _, _) = run(
        dir.path(),
        &["cache", "warmup", "mxfp4", "--model", "qwen3-30b-a3b"],
        &[],
    );
    assert_eq!(code, 2);
    let (code, _, err) = run(dir.path(), &["cache", "warmup", "--recipe", "bf16"], &[]);
    assert_eq!(code, 2, "{err}");
}

#[test]
fn warmup_of_a_model_without_a_gpu_generates_every_variant_and_skips() {
    if moeforge::runtime::device::driver_present() {
        return; // with a GPU the variants are built and tuned: `scripts/gpu-check` runs that path
    }
    let dir = tempfile::tempdir().unwrap();
    // The driver's JIT by name: with no device nothing is built (the default, auto, builds the
    // cubins with a ptxas where there is one: the test below).
    let (code, out, err) = run(
        dir.path(),
        &["cache", "warmup", "--model", "qwen3-30b-a3b"],
        &[("MOEFORGE_JIT", std::ffi::OsStr::new("driver"))],
    );
    assert_eq!(code, 0, "{err}");
    let want = variants(1536, 2048, &ALL);
    assert!(
        out.contains(&format!(
            "summary: {want} variants generated, 0 built (0 from the cache), 0 buckets tuned, 0 tuning cache hits"
        )),
        "{out}"
    );
    assert!(
        out.contains("SKIPPED: kernels not built and tuning skipped"),
        "{out}"
    );
    assert!(
        out.contains("qwen3-30b-a3b w2 (N=2048, K=768) fp8_block128"),
        "{out}"
    );
    // Nothing was stored.
    let (_, ls, _) = run(dir.path(), &["cache", "ls"], &[]);
    assert!(ls.starts_with("0 entries") && !ls.contains("tune"), "{ls}");
}

#[test]
fn warmup_with_ptxas_fills_the_gemm_cubins_once() {
    if moeforge::runtime::device::driver_present() {
        return;
    }
    let Some(ptxas) = std::env::var_os("MOEFORGE_PTXAS") else {
        assert!(
            std::env::var_os("MOEFORGE_REQUIRE_PTXAS").is_none(),
            "MOEFORGE_REQUIRE_PTXAS is set but MOEFORGE_PTXAS is not"
        );
        eprintln!("skipped: no ptxas (set MOEFORGE_PTXAS; scripts/test does)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let env = [
        ("MOEFORGE_JIT", std::ffi::OsStr::new("ptxas")),
        ("MOEFORGE_PTXAS", ptxas.as_os_str()),
    ];
    let args = [
        "cache",
        "warmup",
        "--model",
        "mixtral-8x7b",
        "--recipe",
        "bf16",
        "--tokens",
        "1,16",
    ];
    let want = variants(28672, 4096, &ALL[..1]);
    let (code, out, err) = run(dir.path(), &args, &env);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!(
            "{want} variants generated, {want} built (0 from the cache)"
        )) && out.contains("cubins compiled by ptxas but no kernel loaded and tuning skipped"),
        "{out}"
    );
    let (code, out, _) = run(dir.path(), &args, &env);
    assert_eq!(code, 0);
    assert!(
        out.contains(&format!(
            "{want} variants generated, {want} built ({want} from the cache)"
        )),
        "{out}"
    );
    let (_, ls, _) = run(dir.path(), &["cache", "ls"], &[]);
    assert!(ls.starts_with(&format!("{want} entries")), "{ls}");
}

#[test]
fn cache_ls_and_clear_handle_tuning_entries() {
    let dir = tempfile::tempdir().unwrap();
    let tune = TuneCache::new(Some(dir.path().to_path_buf()));
    let all = candidates(Operands::Bf16, Scaling::None, 1536, 2048);
    let key = |rows: usize| TuneKey {
        gpu: "NVIDIA H200".into(),
        driver: 13000,
        version: "0.1.0".into(),
        codegen: "test".into(),
        operands: Operands::Bf16,
        scaling: Scaling::None,
        out: OutTy::Bf16,
        epilogue: Epilogue::Store,
        n: 1536,
        k: 2048,
        experts: 128,
        bucket: moeforge::codegen::gemm::tune::bucket(rows) as u64,
    };
    let entry = TuneEntry {
        choice: all[2],
        times_ns: all.iter().map(|c| (c.tag(), 1000)).collect(),
        reps: 3,
    };
    tune.put(&key(512), &entry).unwrap();
    tune.put(&key(8), &entry).unwrap();
    // Corrupt the second: listed as such.
    let bad = tune.path(&key(8)).unwrap();
    let mut bytes = std::fs::read(&bad).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x20;
    std::fs::write(&bad, &bytes).unwrap();
    let (code, ls, err) = run(dir.path(), &["cache", "ls"], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(ls.starts_with("0 entries"), "{ls}");
    assert!(ls.contains("2 GEMM tuning entries"), "{ls}");
    let good = ls
        .lines()
        .find(|l| l.contains(&key(512).hash()))
        .unwrap_or_else(|| panic!("{ls}"));
    assert!(
        good.contains("NVIDIA H200")
            && good.contains("N=1536 K=2048 E=128 rows<=512")
            && good.contains(&format!("-> {}  ok", all[2].tag())),
        "{good}"
    );
    let corrupt = ls
        .lines()
        .find(|l| l.contains(&key(8).hash()))
        .unwrap_or_else(|| panic!("{ls}"));
    assert!(corrupt.contains("CORRUPT"), "{corrupt}");
    let (code, out, _) = run(dir.path(), &["cache", "clear"], &[]);
    assert_eq!(code, 0);
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        ["removed 0 entries", "removed 2 GEMM tuning entries"]
    );
    let (_, ls, _) = run(dir.path(), &["cache", "ls"], &[]);
    assert!(!ls.contains("tuning"), "{ls}");
    assert_eq!(
        TuneCache::new(Some(dir.path().to_path_buf())).get(&key(500)),
        None
    );
}
