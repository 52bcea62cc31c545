//! The generated route + permute kernels (`codegen::moe::permute`): golden PTX of the module at
//! H = 7168, R = 256, bf16 and quantizing per 1x128 group (`BLESS=1` rewrites them), and ptxas
//! 13.0 with `-v` on the module at the shapes the GPU self-test runs, in every form of the
//! gathered rows (no spills, no stack frame, no C75xx diagnostic).
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

use moeforge::codegen::moe::permute::{permute_module, Gather};

mod common;

/// The shapes the ptxas check assembles: (H, R). The golden files are the first.
const SHAPES: [(u32, u32); 5] = [(7168, 256), (7168, 32), (8, 1), (4104, 4096), (2056, 1000)];
/// The largest hidden size of the quantizing forms (also assembled).
const LARGEST_E4M3: (u32, u32) = (16384, 64);

fn ptxas() -> Option<PathBuf> {
    common::ptxas("permute PTX not assembled")
}

#[test]
fn golden_permute_ptx() {
    let (h, r) = SHAPES[0];
    for (gather, tag) in [(Gather::Bf16, ""), (Gather::Group128, "_e4m3_group128")] {
        let (got, _) = permute_module(h, r, gather).unwrap();
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(format!("tests/golden/ptx_moe/permute_h{h}_r{r}{tag}.ptx"));
        let failure = common::golden(&path, &got, std::env::var_os("BLESS").is_some());
        assert!(
            failure.is_none(),
            "golden permute PTX{tag} mismatch (BLESS=1 to update):\n{}",
            failure.unwrap_or_default()
        );
    }
}

#[test]
fn ptxas_assembles_the_permute_kernels_without_spills() {
    let Some(ptxas) = ptxas() else { return };
    let dir = tempfile::tempdir().unwrap();
    for gather in Gather::ALL {
        let largest = (gather != Gather::Bf16).then_some(LARGEST_E4M3);
        for (h, r) in SHAPES.into_iter().chain(largest) {
            let (ptx, _) = permute_module(h, r, gather).unwrap();
            let src = dir.path().join(format!("permute_{h}_{r}_{gather:?}.ptx"));
            let cubin = dir.path().join(format!("permute_{h}_{r}_{gather:?}.cubin"));
            std::fs::write(&src, ptx).unwrap();
            let report = common::assemble(&ptxas, &src, &cubin);
            let p = common::problems(&report, 4);
            assert!(p.is_empty(), "H={h} R={r} {gather:?}: {p:?}\n{report}");
            eprintln!("H={h} R={r} {gather:?}: {report}");
        }
    }
}
