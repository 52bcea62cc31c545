//! `moeforge demo`: the main job on an embedded default MoE layer.
//!
//! Today it checks every standard recipe at a Qwen3-30B-A3B layer (E=128, H=2048, I=768) and prints
//! what each registers, what it aliases and how every promise was proven. Packing and GPU execution
//! join it as those parts of moeforge land.

use std::fmt::Write as _;
use std::time::Instant;

use crate::kernels::{QWEN3_30B_A3B, STANDARD};
use crate::report;

/// Run the demo and return its report.
pub fn run() -> crate::Result<String> {
    let bind: Vec<(String, i64)> = QWEN3_30B_A3B
        .iter()
        .map(|(k, v)| (k.to_string(), *v))
        .collect();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "moeforge demo: every standard recipe checked at a Qwen3-30B-A3B MoE layer ({})",
        bind.iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = writeln!(
        out,
        "device: host (CPU). Packing and GPU kernels are not built yet: this run parses, binds and verifies.\n"
    );
    let mut rows = vec![vec![
        "recipe".to_string(),
        "params".into(),
        "views".into(),
        "MiB/expert".into(),
        "MiB/layer".into(),
        "check time".into(),
        "proofs".into(),
    ]];
    for r in STANDARD {
        let t0 = Instant::now();
        let info = crate::dsl::check(r.source, Some(&bind))
            .map_err(|d| crate::recipe_error(&d, r.path, r.source))?;
        let dt = t0.elapsed();
        let per: i128 = info
            .move_set
            .iter()
            .map(|e| info.bytes_per_expert(e).unwrap_or(0))
            .sum();
        let experts = bind.first().map(|x| x.1 as i128).unwrap_or(1);
        let mib = |b: i128| format!("{:.2}", b as f64 / (1u64 << 20) as f64);
        rows.push(vec![
            r.name.to_string(),
            info.params.len().to_string(),
            info.views.len().to_string(),
            mib(per),
            mib(per * experts),
            format!("{:.0} us", dt.as_secs_f64() * 1e6),
            report::promise_summary(&info)
                .split("proofs: ")
                .nth(1)
                .unwrap_or("")
                .to_string(),
        ]);
    }
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|k| rows.iter().map(|r| r[k].len()).max().unwrap_or(0))
        .collect();
    for r in &rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
    let _ = writeln!(
        out,
        "\nDetails of one recipe: moeforge check kernels/nvfp4_cutedsl.recipe --bind E=128,H=2048,I=768"
    );
    Ok(out)
}
