//! The generated activation-quantization kernels (`codegen::gemm::act_quant`): golden PTX of both
//! modes at K = 7168 (`BLESS=1` rewrites them), and ptxas 13.0 with `-v` on both modes at every K
//! the GPU self-test runs (no spills, no stack frame, no C75xx diagnostic).
//!
//! ptxas comes from `MOEFORGE_PTXAS` (else the cache `scripts/ptxas` fills). Without it the ptxas
//! test says that it skipped, unless `MOEFORGE_REQUIRE_PTXAS` is set (as `scripts/test` does): then
//! it fails.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stderr
)]

use std::path::{Path, PathBuf};

use moeforge::codegen::gemm::act_quant::{act_quant, Mode};

mod common;

/// The K of the golden files.
const GOLDEN_K: u32 = 7168;
/// The K the ptxas check assembles (the GPU self-test's: one group, DeepSeek-V3's hidden size, a
/// short last group).
const KS: [u32; 3] = [128, 7168, 2048 + 64];

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/ptx_gemm")
}

fn label(mode: Mode) -> &'static str {
    match mode {
        Mode::PerToken => "per_token",
        Mode::PerGroup128 => "group128",
    }
}

fn ptxas() -> Option<PathBuf> {
    common::ptxas("activation-quantization PTX not assembled")
}

#[test]
fn golden_act_quant_ptx() {
    let bless = std::env::var_os("BLESS").is_some();
    let mut failures = Vec::new();
    for mode in [Mode::PerToken, Mode::PerGroup128] {
        let (got, _) = act_quant(mode, GOLDEN_K).unwrap();
        let path = golden_dir().join(format!("act_quant_{}_k{GOLDEN_K}.ptx", label(mode)));
        failures.extend(common::golden(&path, &got, bless));
    }
    assert!(
        failures.is_empty(),
        "golden activation-quantization PTX mismatches (BLESS=1 to update):\n{}",
        failures.join("\n")
    );
}

#[test]
fn ptxas_assembles_both_modes_without_spills() {
    let Some(ptxas) = ptxas() else { return };
    let dir = tempfile::tempdir().unwrap();
    for mode in [Mode::PerToken, Mode::PerGroup128] {
        for k in KS {
            let (ptx, _) = act_quant(mode, k).unwrap();
            let src = dir.path().join(format!("{}_{k}.ptx", label(mode)));
            let cubin = dir.path().join(format!("{}_{k}.cubin", label(mode)));
            std::fs::write(&src, ptx).unwrap();
            let report = common::assemble(&ptxas, &src, &cubin);
            let p = common::problems(&report, 1);
            assert!(p.is_empty(), "{mode:?} K={k}: {p:?}\n{report}");
            eprintln!("{mode:?} K={k}: {report}");
        }
    }
}
