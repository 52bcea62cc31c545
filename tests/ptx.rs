//! Generated PTX: golden files for every standard recipe and both targets (`BLESS=1` rewrites them),
//! deterministic output, and ptxas 13.0 acceptance of every golden file for its target.
//!
//! ptxas comes from `MOEFORGE_PTXAS`, else the cache `scripts/ptxas` fills. Without one this test says
//! that it skipped the assembly check, unless `MOEFORGE_REQUIRE_PTXAS` is set (as `scripts/test` and
//! CI do), in which case a missing ptxas fails it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;

use moeforge::codegen::ptx::Target;

const BIND: &str = "E=2,H=128,I=128";

mod common;

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/ptx")
}

fn generate(recipe: &str, target: Target) -> String {
    let r = moeforge::kernels::find(recipe).unwrap();
    let prog = moeforge::pack_program(r.source, r.path, BIND, &|_| true).unwrap();
    moeforge::codegen::ptx::compile(&prog, target).unwrap()
}

#[test]
fn golden_ptx() {
    let bless = std::env::var_os("BLESS").is_some();
    let mut failures = Vec::new();
    for r in moeforge::kernels::STANDARD {
        for t in [Target::Sm90a, Target::Sm100a] {
            let got = generate(r.name, t);
            assert_eq!(got, generate(r.name, t), "{} is not deterministic", r.name);
            assert!(got.contains(".version 8.7") && got.contains(&format!(".target {}", t.name())));
            let path = golden_dir().join(format!("{}.{}.ptx", r.name, t.name()));
            failures.extend(common::golden(&path, &got, bless));
        }
    }
    assert!(
        failures.is_empty(),
        "golden PTX mismatches (BLESS=1 to update):\n{}",
        failures.join("\n")
    );
}

fn ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MOEFORGE_PTXAS") {
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
    let p = cache.join("cuda-nvcc-13.0.88/ptxas");
    p.exists().then_some(p)
}

#[test]
fn ptxas_accepts_every_golden_ptx() {
    let Some(ptxas) = ptxas() else {
        assert!(
            std::env::var_os("MOEFORGE_REQUIRE_PTXAS").is_none(),
            "MOEFORGE_REQUIRE_PTXAS is set but no ptxas was found (run scripts/ptxas)"
        );
        eprintln!("SKIPPED: ptxas not found; run scripts/test (or scripts/ptxas) to assemble the golden PTX");
        return;
    };
    let out = tempfile::tempdir().unwrap();
    let mut n = 0;
    for r in moeforge::kernels::STANDARD {
        for t in [Target::Sm90a, Target::Sm100a] {
            let path = golden_dir().join(format!("{}.{}.ptx", r.name, t.name()));
            let cubin = out.path().join(format!("{}.{}.cubin", r.name, t.name()));
            let res = Command::new(&ptxas)
                .arg(format!("-arch={}", t.name()))
                .arg(&path)
                .arg("-o")
                .arg(&cubin)
                .output()
                .unwrap();
            assert!(
                res.status.success(),
                "ptxas rejected {}:\n{}",
                path.display(),
                String::from_utf8_lossy(&res.stderr)
            );
            assert!(std::fs::metadata(&cubin).unwrap().len() > 0);
            n += 1;
        }
    }
    eprintln!("ptxas ({}) assembled {n} golden PTX files", ptxas.display());
}

#[test]
fn compile_cli_emits_ptx_ir_and_clif() {
    let run = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_moeforge"))
            .args(args)
            .output()
            .unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (code, out, _) = run(&[
        "compile",
        "nvfp4_cutedsl",
        "--bind",
        BIND,
        "--target",
        "sm_100a",
    ]);
    assert_eq!(code, Some(0));
    assert_eq!(out, generate("nvfp4_cutedsl", Target::Sm100a));
    let (code, out, _) = run(&[
        "compile",
        "fp8_block128",
        "--bind",
        BIND,
        "--target",
        "host",
        "--emit",
        "ir",
    ]);
    assert_eq!(code, Some(0));
    assert!(out.starts_with("program fp8_block128"), "{out}");
    let (code, out, _) = run(&["compile", "mxfp4", "--bind", BIND, "--target", "host"]);
    assert_eq!(code, Some(0));
    assert!(out.contains("function") && out.contains("fmax"), "{out}");
    let (code, _, err) = run(&["compile", "mxfp4", "--bind", BIND, "--target", "sm_80"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("unknown target `sm_80`"), "{err}");
    let (code, _, err) = run(&["compile", "mxfp4", "--bind", "E=2,H=100,I=128"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("H % 64 == 0"), "{err}");
    // -o writes atomically: nothing is left behind on failure.
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("out.ptx");
    let (code, _, _) = run(&[
        "compile",
        "mxfp4",
        "--bind",
        BIND,
        "-o",
        target.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(0));
    assert!(std::fs::read_to_string(&target)
        .unwrap()
        .contains(".target sm_90a"));
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn ptx_compiles_at_shapes_that_take_every_code_path() {
    // Shapes where rows and columns are and are not multiples of the GPU form's block sizes.
    let shapes = [
        (2, 128, 128),
        (3, 40, 24),
        (3, 72, 40),
        (1, 192, 64),
        (2, 1040, 48),
        // The CTA-per-row forms: unrolled (7168: 128 threads) and looped (4160: 256 threads).
        (2, 7168, 256),
        (1, 4160, 2112),
    ];
    let assembler = ptxas();
    let out = tempfile::tempdir().unwrap();
    let mut compiled = 0;
    for r in moeforge::kernels::STANDARD {
        for (e, h, i) in shapes {
            let bind = format!("E={e},H={h},I={i}");
            let Ok(prog) = moeforge::pack_program(r.source, r.path, &bind, &|_| true) else {
                continue; // the recipe's where-clause rejects this shape
            };
            for t in [Target::Sm90a, Target::Sm100a] {
                let ptx = moeforge::codegen::ptx::compile(&prog, t)
                    .unwrap_or_else(|err| panic!("{} at {bind} for {}: {err}", r.name, t.name()));
                assert!(ptx.contains(".entry"));
                if let Some(ptxas) = &assembler {
                    // Assembled as well where ptxas is at hand (scripts/test installs it).
                    let src = out.path().join(format!("{}.{}.ptx", r.name, t.name()));
                    std::fs::write(&src, &ptx).unwrap();
                    let res = Command::new(ptxas)
                        .arg(format!("-arch={}", t.name()))
                        .arg(&src)
                        .arg("-o")
                        .arg(out.path().join("k.cubin"))
                        .output()
                        .unwrap();
                    assert!(
                        res.status.success(),
                        "ptxas rejected {} at {bind} for {}:\n{}",
                        r.name,
                        t.name(),
                        String::from_utf8_lossy(&res.stderr)
                    );
                }
                compiled += 1;
            }
        }
    }
    assert!(compiled >= 24, "only {compiled} programs compiled");
}

#[test]
fn index_arithmetic_of_real_layers_is_proven_32_bit() {
    // At DeepSeek-V3 EP8 and Qwen3-30B-A3B shapes every kernel's i64 arithmetic provably fits in
    // i32, so the PTX backend computes indices in 32 bits there; an 8 GB expert tensor does not.
    for r in moeforge::kernels::STANDARD {
        for bind in ["E=32,H=7168,I=2048", "E=128,H=2048,I=768"] {
            let prog = moeforge::pack_program(r.source, r.path, bind, &|_| true).unwrap();
            for k in prog.kernels() {
                assert!(
                    moeforge::codegen::range::indices_fit_i32(k),
                    "{} at {bind}: kernel {} not proven 32-bit",
                    r.name,
                    k.name
                );
            }
            for t in [Target::Sm90a, Target::Sm100a] {
                let ptx = moeforge::codegen::ptx::compile(&prog, t).unwrap();
                assert!(
                    !ptx.contains("setp.ge.s64"),
                    "{} at {bind}: a 64-bit loop",
                    r.name
                );
            }
        }
    }
    let r = moeforge::kernels::find("bf16").unwrap();
    let prog = moeforge::pack_program(r.source, r.path, "E=512,H=8192,I=4096", &|_| true).unwrap();
    assert!(prog
        .kernels()
        .any(|k| !moeforge::codegen::range::indices_fit_i32(k)));
}

/// Assemble `ptx` for `t` with ptxas where it is at hand; panics with ptxas's messages on rejection.
#[test]
fn ptx_of_declared_layouts_assembles() {
    // kernels/layouts: relayout kernels through column-major, tiled and swizzled maps (the swizzle's
    // 64-bit XOR and shifts) and the padded MXFP4 scale tiles, in the 32- and 64-bit index forms.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/layouts");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let src = std::fs::read_to_string(&path).unwrap();
        let what = path.display().to_string();
        for bind in ["E=2,H=256,I=128", "E=256,H=7168,I=2048"] {
            let mut prog = moeforge::pack_program(&src, &what, bind, &|_| true).unwrap();
            let relaid = prog
                .kernels()
                .filter(|k| k.name.ends_with("_relayout"))
                .count();
            assert!(relaid >= 1, "{what}: no relayout kernel");
            for t in [Target::Sm90a, Target::Sm100a] {
                let ptx = moeforge::codegen::ptx::compile(&prog, t).unwrap();
                assemble(&ptx, t, &what);
                n += 1;
            }
            for s in &mut prog.steps {
                if let moeforge::codegen::kir::Step::Kernel(k) = s {
                    k.wide_index = true;
                }
            }
            let ptx = moeforge::codegen::ptx::compile(&prog, Target::Sm90a).unwrap();
            assemble(&ptx, Target::Sm90a, &what);
        }
    }
    assert!(n >= 16, "only {n} programs");
}

fn assemble(ptx: &str, t: Target, what: &str) {
    let Some(ptxas) = ptxas() else { return };
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("k.ptx");
    std::fs::write(&src, ptx).unwrap();
    let res = Command::new(ptxas)
        .arg(format!("-arch={}", t.name()))
        .arg(&src)
        .arg("-o")
        .arg(dir.path().join("k.cubin"))
        .output()
        .unwrap();
    assert!(
        res.status.success(),
        "ptxas rejected {what} for {}:\n{}",
        t.name(),
        String::from_utf8_lossy(&res.stderr)
    );
}

#[test]
fn the_64_bit_index_path_compiles_for_layers_past_2_31_elements() {
    // All 256 DeepSeek-V3 experts in one process: w13 alone is 7.5e9 elements, so its kernels keep
    // 64-bit indices (`%rd` registers in index arithmetic); and every recipe at a small shape with
    // `wide_index` forced (what `MOEFORGE_INDEX64=1` does for the GPU self-test).
    let mut compiled = 0;
    for r in moeforge::kernels::STANDARD {
        if let Ok(prog) = moeforge::pack_program(r.source, r.path, "E=256,H=7168,I=2048", &|_| true)
        {
            assert!(
                prog.kernels()
                    .any(|k| !moeforge::codegen::range::indices_fit_i32(k)),
                "{}: every kernel proven 32-bit at E=256",
                r.name
            );
            for t in [Target::Sm90a, Target::Sm100a] {
                let ptx = moeforge::codegen::ptx::compile(&prog, t).unwrap();
                assemble(&ptx, t, &format!("{} at E=256,H=7168,I=2048", r.name));
                compiled += 1;
            }
        }
        // int4_g128 needs H and I multiples of its groups of 128.
        let small = if r.name == "int4_g128" {
            "E=3,H=256,I=128"
        } else {
            "E=3,H=192,I=64"
        };
        let mut prog = moeforge::pack_program(r.source, r.path, small, &|_| true).unwrap();
        for st in prog.steps.iter_mut() {
            if let moeforge::codegen::kir::Step::Kernel(k) = st {
                k.wide_index = true;
            }
        }
        for t in [Target::Sm90a, Target::Sm100a] {
            let ptx = moeforge::codegen::ptx::compile(&prog, t).unwrap();
            // The item loop's bound check is 64-bit only on this path (addresses are 64-bit on both).
            assert!(
                ptx.contains("setp.ge.s64"),
                "{}: no 64-bit item loop",
                r.name
            );
            assemble(&ptx, t, &format!("{} with wide_index", r.name));
        }
    }
    assert!(
        compiled >= 8,
        "only {compiled} huge-layer programs compiled"
    );
}
