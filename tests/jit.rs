//! The ptxas JIT path (`runtime::jit`): ptxas compiles PTX to a cubin and reports errors with its
//! log, and `auto` takes a working ptxas. ptxas comes from `MOEFORGE_PTXAS` (scripts/test installs
//! one); without it these tests say that they skipped, unless `MOEFORGE_REQUIRE_PTXAS` is set.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stderr
)]

use std::path::PathBuf;

use moeforge::runtime::jit::{find_ptxas, ptxas_compile, Compiler, CompilerChoice, JitOptions};
use moeforge::runtime::Error;

const PTX: &str = ".version 8.6\n.target sm_90a\n.address_size 64\n\
    .visible .entry k(.param .u64 p)\n{\n.reg .b64 %rd<2>;\n.reg .b32 %r<2>;\n\
    ld.param.u64 %rd1, [p];\nmov.u32 %r1, 7;\nst.global.u32 [%rd1], %r1;\nret;\n}\n";

/// ptxas from `MOEFORGE_PTXAS`; `None` skips, saying so, unless `MOEFORGE_REQUIRE_PTXAS` is set.
fn ptxas() -> Option<Compiler> {
    let found = std::env::var_os("MOEFORGE_PTXAS").map(PathBuf::from);
    match found.map(|p| Compiler::ptxas(&p)) {
        Some(Ok(c)) => Some(c),
        other => {
            assert!(
                std::env::var_os("MOEFORGE_REQUIRE_PTXAS").is_none(),
                "MOEFORGE_REQUIRE_PTXAS is set but ptxas is unusable: {other:?}"
            );
            eprintln!("skipped: no ptxas (set MOEFORGE_PTXAS; scripts/test does)");
            None
        }
    }
}

#[test]
fn ptxas_compiles_ptx_to_a_cubin_and_reports_errors_with_its_log() {
    let Some(c) = ptxas() else { return };
    let Compiler::Ptxas { path, version } = &c else {
        unreachable!()
    };
    assert!(version.contains("release"), "{version}");
    assert!(c.key_part(13000).starts_with("ptxas "));
    let (cubin, _) = ptxas_compile(path, "sm_90a", "k", PTX).unwrap();
    assert_eq!(&cubin[..4], b"\x7fELF");
    let bad = PTX.replace("mov.u32", "mov.u32.bogus");
    match ptxas_compile(path, "sm_90a", "k", &bad) {
        Err(Error::Jit { code, log, .. }) => {
            assert!(code.starts_with("ptxas exit"), "{code}");
            assert!(log.contains("bogus") || log.contains("error"), "{log}");
        }
        other => panic!("expected a ptxas error, got {other:?}"),
    }
}

#[test]
fn auto_and_ptxas_take_a_working_ptxas() {
    let Some(Compiler::Ptxas { path, .. }) = ptxas() else {
        return;
    };
    let c = Compiler::choose_from(CompilerChoice::Auto, Some(path.clone())).unwrap();
    assert!(matches!(c, Compiler::Ptxas { .. }), "{c:?}");
    assert_eq!(
        Compiler::choose_from(CompilerChoice::Ptxas, Some(path.clone())).unwrap(),
        c
    );
    // Through the options: the ptxas given, or the one in a search folder.
    let given = JitOptions {
        compiler: CompilerChoice::Auto,
        ptxas: Some(path.clone()),
        search_dirs: Vec::new(),
    };
    assert_eq!(Compiler::resolve(&given).unwrap(), c);
    if path.file_name() != Some(std::ffi::OsStr::new("ptxas")) {
        return; // a search finds only files named `ptxas`
    }
    let searched = JitOptions {
        compiler: CompilerChoice::Ptxas,
        ptxas: None,
        search_dirs: vec![path.parent().unwrap().to_path_buf()],
    };
    assert_eq!(find_ptxas(&searched), Some(path));
    assert_eq!(Compiler::resolve(&searched).unwrap(), c);
}
