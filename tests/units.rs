//! The GPU runtime's unit of PTX generation, caching and JIT is one kernel: a program splits into
//! single-kernel programs with the same buffers (so every kernel keeps the program's parameter list)
//! and the same kernels in order, each unit's PTX holds exactly its kernel, and units are cached apart
//! (memory, then disk). Host-side (CI has no GPU; `moeforge selftest --gpu` loads the same units on
//! the device).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use moeforge::codegen::kir::Step;
use moeforge::codegen::ptx::Target;
use moeforge::runtime::cache::Hit;
use moeforge::runtime::gpu_pack::{unit_ptx, units};
use moeforge::runtime::Cache;

#[test]
fn programs_split_into_cached_single_kernel_units() {
    let dir = tempfile::tempdir().unwrap();
    for r in moeforge::kernels::STANDARD {
        let prog = moeforge::pack_program(r.source, r.path, "E=2,H=128,I=128", &|_| true).unwrap();
        let us = units(&prog);
        let kernels: Vec<_> = prog.kernels().collect();
        assert_eq!(us.len(), kernels.len(), "{}", r.name);
        for (u, k) in us.iter().zip(&kernels) {
            assert_eq!(u.bufs, prog.bufs, "{}: a unit keeps every buffer", r.name);
            assert_eq!(u.steps, vec![Step::Kernel((*k).clone())], "{}", r.name);
        }
        let cache = Cache::new(Some(dir.path().to_path_buf()));
        let (texts, hit) = unit_ptx(&cache, &prog, Target::Sm90a).unwrap();
        assert_eq!(hit, Hit::Compiled, "{}", r.name);
        assert_eq!(texts.len(), kernels.len());
        let mut keys: Vec<&String> = texts.iter().map(|(k, _)| k).collect();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), kernels.len(), "{}: one key per kernel", r.name);
        for ((_, text), k) in texts.iter().zip(&kernels) {
            let text = String::from_utf8(text.to_vec()).unwrap();
            assert_eq!(text.matches(".entry").count(), 1, "{}", k.name);
            assert!(text.contains(&format!(".entry {}(", k.name)), "{}", k.name);
        }
        let (_, again) = unit_ptx(&cache, &prog, Target::Sm90a).unwrap();
        assert_eq!(again, Hit::Memory, "{}", r.name);
        let fresh = Cache::new(Some(dir.path().to_path_buf()));
        let (_, disk) = unit_ptx(&fresh, &prog, Target::Sm90a).unwrap();
        assert_eq!(disk, Hit::Disk, "{}", r.name);
    }
}

#[test]
fn launch_options_reach_the_cache_keys_through_the_kernel_ir() {
    use moeforge::runtime::LaunchOptions;
    use std::borrow::Cow;
    let cache = Cache::new(None);
    let keys = |p: &moeforge::codegen::kir::Program| -> Vec<String> {
        let (units, _) = unit_ptx(&cache, p, Target::Sm90a).unwrap();
        units.into_iter().map(|(k, _)| k).collect()
    };
    for r in moeforge::kernels::STANDARD {
        let prog = moeforge::pack_program(r.source, r.path, "E=2,H=128,I=128", &|_| true).unwrap();
        // The defaults, and a grid cap (launch shape only), leave the program as it is.
        for o in [
            LaunchOptions::default(),
            LaunchOptions {
                max_blocks: Some(8),
                ..LaunchOptions::default()
            },
        ] {
            assert!(matches!(o.apply(&prog), Cow::Borrowed(_)), "{}", r.name);
        }
        let base = keys(&prog);
        let wide = LaunchOptions {
            wide_index: true,
            ..LaunchOptions::default()
        }
        .apply(&prog);
        assert!(wide.kernels().all(|k| k.wide_index), "{}", r.name);
        let capped = LaunchOptions {
            maxnreg: Some(40),
            ..LaunchOptions::default()
        }
        .apply(&prog);
        for (k, c) in prog.kernels().zip(capped.kernels()) {
            let want = if k.group == 1 { Some(40) } else { k.maxnreg };
            assert_eq!(c.maxnreg, want, "{}: {}", r.name, k.name);
        }
        // A kernel the options change has a key of its own; one they leave keeps its key.
        for (opts, tuned) in [("wide_index", &wide), ("maxnreg", &capped)] {
            for ((k, t), (kb, kt)) in prog
                .kernels()
                .zip(tuned.kernels())
                .zip(base.iter().zip(keys(tuned)))
            {
                assert_eq!(k == t, *kb == kt, "{} {opts}: {}", r.name, k.name);
            }
        }
    }
}
