//! `moeforge demo`: the main job on an embedded default MoE layer.
//!
//! Today it checks every standard recipe at a Qwen3-30B-A3B layer (E=128, H=2048, I=768) and prints
//! what each registers, what it aliases and how every promise was proven. Packing and GPU execution
//! join it as those parts of moeforge land.

use std::fmt::Write as _;
use std::time::Instant;

use crate::kernels::{QWEN3_30B_A3B, STANDARD};
use crate::report;

/// Run the demo with `settings` and return its report.
pub fn run(pack_experts: usize, settings: &crate::Settings) -> crate::Result<String> {
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
        "verification and the host pack run on the CPU (Cranelift JIT); with a CUDA GPU the layer is packed there too and checked against the host.\n"
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
    // Pack one synthetic layer of that shape with every recipe.
    let (e, h, i) = (pack_experts.max(1), bind[1].1 as usize, bind[2].1 as usize);
    // Progress on stderr (a terminal only): generating the layer, then each recipe's pack and check.
    let bar = crate::bench::progress_bar(STANDARD.len() as u64 + 1);
    bar.set_message("generating the synthetic layer");
    let layer = crate::bench::Layer::synthetic(e, h, i, 1);
    bar.inc(1);
    let _ = writeln!(
        out,
        "\npacking a synthetic layer (E={e}, H={h}, I={i}: {:.0} MB of bf16 weights) on the host:",
        layer.bytes() as f64 / 1e6
    );
    let rows = crate::bench::pack_all(&layer, 0, 1, true, None, &settings.host, &bar);
    bar.finish_and_clear();
    let rows = rows?;
    let _ = writeln!(
        out,
        "{:<16} {:>9} {:>8} {:>22} {:>14}",
        "recipe", "time ms", "GB/s", "max |x-x'| / amax", "max |x-x'|"
    );
    for r in &rows {
        let f = |x: Option<f32>| x.map(|v| format!("{v:.3e}")).unwrap_or_else(|| "-".into());
        let _ = writeln!(
            out,
            "{:<16} {:>9.1} {:>8.2} {:>22} {:>14}",
            r.recipe,
            r.seconds * 1e3,
            r.gbps,
            f(r.max_rel_err),
            f(r.max_abs_err)
        );
    }
    // With a GPU: pack the same layer on the device and verify it against the host, byte for byte.
    match crate::gpu::open() {
        Ok(dev) => {
            let _ = writeln!(
                out,
                "\nGPU: {} - packing the same layer on the device, verified against the host:",
                dev.name
            );
            let cache = crate::runtime::Cache::new(settings.runtime.cache_dir.clone());
            let inputs: std::collections::HashMap<String, Vec<u8>> = [
                ("w13".to_string(), layer.w13.clone()),
                ("w2".to_string(), layer.w2.clone()),
            ]
            .into_iter()
            .collect();
            let binding = format!("E={e},H={h},I={i}");
            let _ = writeln!(
                out,
                "{:<16} {:>9} {:>8}  result",
                "recipe", "time ms", "GB/s"
            );
            for r in STANDARD {
                let info = crate::check_source(r.source, r.path, Some(&binding))?;
                let host = crate::gpu::host_pack(&info, &inputs, &settings.host)?;
                let prog = crate::codegen::plan::plan(&info, &|n: &str| inputs.contains_key(n))?;
                let gp = crate::runtime::gpu_pack::GpuProgram::load(
                    &dev,
                    &cache,
                    &prog,
                    &settings.runtime,
                )?;
                let mut bufs = gp.alloc(&dev, &mut |n| inputs.get(n).cloned())?;
                gp.run(&dev, &mut bufs)?;
                dev.sync()?;
                let t = Instant::now();
                gp.run(&dev, &mut bufs)?;
                dev.sync()?;
                let secs = t.elapsed().as_secs_f64();
                let gpu = gp.download(&dev, &bufs)?;
                let same = host.len() == gpu.len() && host.iter().zip(&gpu).all(|(a, b)| a == b);
                let _ = writeln!(
                    out,
                    "{:<16} {:>9.2} {:>8.1}  {}",
                    r.name,
                    secs * 1e3,
                    layer.bytes() as f64 / secs / 1e9,
                    if same {
                        "identical to the host"
                    } else {
                        "DIFFERENT from the host"
                    }
                );
                if !same {
                    return Err(crate::Error::Usage(format!(
                        "GPU pack of `{}` differs from the host",
                        r.name
                    )));
                }
            }
        }
        Err(why) => {
            let _ = writeln!(
                out,
                "\nno GPU here ({why}): the packing above ran on the host only"
            );
        }
    }
    crate::demo_moe::run(&mut out, settings)?;
    crate::demo_eplb::run(&mut out, &settings.host, &settings.runtime)?;
    let _ = writeln!(
        out,
        "\nDetails of one recipe: moeforge check kernels/nvfp4_cutedsl.recipe --bind E=128,H=2048,I=768"
    );
    Ok(out)
}
