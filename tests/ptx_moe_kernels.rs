//! The generated MoE activation and combine kernels (`codegen::moe::act`, `codegen::moe::combine`):
//! golden PTX of the activation module (SiluMul in, Group128 out, W = 2048) and of the combine
//! module at H = 7168 (`BLESS=1` rewrites them), and ptxas 13.0 with `-v` on every (input, output)
//! pair of the activation kernel at W in {8, 768, 2048, 14336, 16384} and on the combine module
//! at H in {8, 2048, 7168}: no spills, no stack frame, no C75xx diagnostic.
//!
//! ptxas comes from `MOEFORGE_PTXAS` (else the cache `scripts/ptxas` fills). Without it the ptxas
//! tests say that they skipped, unless `MOEFORGE_REQUIRE_PTXAS` is set (as `scripts/test` does):
//! then they fail.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stderr
)]

use std::path::{Path, PathBuf};

use moeforge::codegen::moe::act::{act_module, ActIn, ActOut};
use moeforge::codegen::moe::combine::combine_module;

mod common;

/// The widths of the activation kernel's ptxas check.
const WIDTHS: [u32; 5] = [8, 768, 2048, 14336, 16384];
/// The hidden sizes of the combine module's ptxas check.
const HIDDEN: [u32; 3] = [8, 2048, 7168];

fn ptxas() -> Option<PathBuf> {
    common::ptxas("MoE activation/combine PTX not assembled")
}

fn check_golden(name: &str, got: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/golden/ptx_moe/{name}"));
    let failure = common::golden(&path, got, std::env::var_os("BLESS").is_some());
    assert!(
        failure.is_none(),
        "golden {name} mismatch (BLESS=1 to update):\n{}",
        failure.unwrap_or_default()
    );
}

#[test]
fn golden_act_ptx() {
    let (got, _) = act_module(ActIn::SiluMul, ActOut::Group128, 2048).unwrap();
    check_golden("act_silu_mul_group128_w2048.ptx", &got);
}

#[test]
fn golden_combine_ptx() {
    let (got, _) = combine_module(7168).unwrap();
    check_golden("combine_h7168.ptx", &got);
}

fn assemble(ptxas: &Path, dir: &Path, name: &str, ptx: &str, entries: usize) -> String {
    let src = dir.join(format!("{name}.ptx"));
    let cubin = dir.join(format!("{name}.cubin"));
    std::fs::write(&src, ptx).unwrap();
    let report = common::assemble(ptxas, &src, &cubin);
    let p = common::problems(&report, entries);
    assert!(p.is_empty(), "{name}: {p:?}\n{report}");
    report
}

/// `entry: registers` for each entry ptxas reports.
fn registers(report: &str) -> Vec<String> {
    let mut entry = "?";
    let mut out = Vec::new();
    for l in report.lines() {
        if let Some(at) = l.find("Compiling entry function '") {
            entry = l[at + 26..].split('\'').next().unwrap_or("?");
        }
        if let Some(at) = l.find("Used ") {
            let n = l[at + 5..].split(' ').next().unwrap_or("?");
            out.push(format!("{entry}: {n}"));
        }
    }
    out
}

#[test]
fn ptxas_assembles_the_act_kernels_without_spills() {
    let Some(ptxas) = ptxas() else { return };
    let dir = tempfile::tempdir().unwrap();
    for input in ActIn::ALL {
        for output in ActOut::ALL {
            for w in WIDTHS {
                let (ptx, l) = act_module(input, output, w).unwrap();
                let name = format!("act_{input:?}_{output:?}_{w}");
                let report = assemble(&ptxas, dir.path(), &name, &ptx, 1);
                eprintln!(
                    "{name}: {} threads, registers {:?}",
                    l.threads,
                    registers(&report)
                );
            }
        }
    }
}

#[test]
fn ptxas_assembles_the_combine_kernels_without_spills() {
    let Some(ptxas) = ptxas() else { return };
    let dir = tempfile::tempdir().unwrap();
    for h in HIDDEN {
        let (ptx, l) = combine_module(h).unwrap();
        let name = format!("combine_{h}");
        let report = assemble(&ptxas, dir.path(), &name, &ptx, 2);
        eprintln!(
            "{name}: {} combine threads, registers {:?}",
            l.combine_threads,
            registers(&report)
        );
    }
}
