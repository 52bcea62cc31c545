//! Programmatic dependent launch (`runtime::launch`): every kernel of the MoE layer (grouped GEMMs,
//! activation quantization, permute, activation, combine) is launched with the dependency on
//! Hopper, which is only sound if the kernel waits (`griddepcontrol.wait`) before its first access
//! to global memory. Checked on every entry of the golden PTX of those kernels (which the golden
//! tests hold equal to what the generators emit).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

/// Instructions that touch global memory: loads and stores (global, or generic `ld.u*`), atomics
/// and reductions, the async proxy's copies from it, and tensor-map prefetches.
const GLOBAL: [&str; 7] = [
    "ld.global",
    "st.global",
    "atom.",
    "red.",
    "cp.async",
    "prefetch.tensormap",
    "ld.u",
];

#[test]
fn every_layer_kernel_waits_for_its_predecessor_before_touching_memory() {
    let mut entries = 0;
    for dir in ["tests/golden/ptx_gemm", "tests/golden/ptx_moe"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
        for f in std::fs::read_dir(&dir).unwrap() {
            let path = f.unwrap().path();
            if path.extension().is_none_or(|e| e != "ptx") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for body in text.split(".visible .entry ").skip(1) {
                entries += 1;
                let name = body.split('(').next().unwrap();
                let lines: Vec<&str> = body.lines().map(str::trim).collect();
                let at = |needle: &str| lines.iter().position(|l| l.starts_with(needle));
                let wait = at("griddepcontrol.wait;")
                    .unwrap_or_else(|| panic!("{}: {name} never waits", path.display()));
                // It is the body's first instruction (after the parameters and declarations).
                let first = lines.iter().skip(1).position(|l| {
                    !(l.is_empty()
                        || l.starts_with('.')
                        || l.starts_with(')')
                        || l.starts_with('{')
                        || l.starts_with("//"))
                });
                assert_eq!(
                    first.map(|i| i + 1),
                    Some(wait),
                    "{name}: the wait comes first"
                );
                // No early trigger: dependents are scheduled as this kernel's CTAs exit.
                assert_eq!(at("griddepcontrol.launch_dependents"), None, "{name}");
                let first_global = lines.iter().position(|l| {
                    GLOBAL
                        .iter()
                        .any(|g| l.starts_with(g) || l.contains(&format!(" {g}")))
                });
                if let Some(g) = first_global {
                    assert!(
                        wait < g,
                        "{}: {name} touches memory before it waits: {}",
                        path.display(),
                        lines[g]
                    );
                }
            }
        }
    }
    assert!(entries >= 20, "only {entries} entries found");
}
