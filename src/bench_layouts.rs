//! `moeforge bench --layouts`: what a declared storage layout costs. Each layout example
//! (`kernels/layouts`: column-major FP8, 16x16-tiled and swizzled bf16, MXFP4 with swizzled E8M0
//! scales) is packed beside its row-major twin (the same recipe with every `@ layout` removed), on
//! the host (Cranelift, the `pack` form) and on the GPU, in the same run; the report gives both
//! times, their ratio and the layout's GB/s of bf16 input.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Instant;

use crate::bench::Layer;
use crate::codegen::kir::BufRole;
use crate::kernels::LAYOUTS;
use crate::layout_gen::without_layouts;
use crate::Result;

/// Best host pack time of a recipe source at a layer, in seconds.
fn host_time(
    src: &str,
    path: &str,
    layer: &Layer,
    threads: usize,
    reps: usize,
    opts: &crate::codegen::host::Options,
) -> Result<f64> {
    let info = crate::check_source(src, path, Some(&layer.binding()))?;
    let inputs: HashMap<&str, &Vec<u8>> = [("w13", &layer.w13), ("w2", &layer.w2)]
        .into_iter()
        .collect();
    let prog = crate::codegen::plan::plan_with(
        &info,
        &|n: &str| inputs.contains_key(n),
        &|_| false,
        true,
    )?;
    let compiled = crate::codegen::host::compile_with(&prog, opts)?;
    let mut bufs =
        crate::codegen::alloc_buffers(&prog, &mut |n| inputs.get(n).map(|b| (*b).clone()))?;
    for (d, b) in bufs.iter_mut().zip(&prog.bufs) {
        if !matches!(b.role, BufRole::Input(_)) {
            d.fill(0xFF);
        }
    }
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        compiled.run(&mut bufs, &crate::codegen::SingleProcess, threads)?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

fn header(out: &mut String, what: &str, layer: &Layer) {
    let (e, h, i) = layer.dims;
    let _ = writeln!(
        out,
        "\nDeclared layouts on the {what} (E={e}, H={h}, I={i}; {:.2} GB of bf16), against the row-major twin:",
        layer.bytes() as f64 / 1e9
    );
    let _ = writeln!(
        out,
        "{:<16} {:>14} {:>14} {:>8} {:>12}",
        "recipe", "row-major ms", "layout ms", "ratio", "layout GB/s"
    );
}

fn row(out: &mut String, name: &str, t_row: f64, t_lay: f64, layer: &Layer) {
    let _ = writeln!(
        out,
        "{:<16} {:>14.2} {:>14.2} {:>7.2}x {:>12.1}",
        name,
        t_row * 1e3,
        t_lay * 1e3,
        t_lay / t_row,
        layer.bytes() as f64 / t_lay / 1e9
    );
}

/// The host part: every layout example and its twin, `reps` runs each (best kept), compiled with
/// `opts`.
pub fn host(threads: usize, reps: usize, opts: &crate::codegen::host::Options) -> Result<String> {
    let layer = Layer::synthetic(16, 2048, 768, 3);
    let mut out = String::new();
    header(&mut out, "host", &layer);
    for r in LAYOUTS {
        let t_lay = host_time(r.source, r.path, &layer, threads, reps, opts)?;
        let t_row = host_time(
            &without_layouts(r.source),
            r.path,
            &layer,
            threads,
            reps,
            opts,
        )?;
        row(&mut out, r.name, t_row, t_lay, &layer);
    }
    Ok(out)
}

/// The GPU part, at a DeepSeek-V3 EP8 layer, with the per-kernel split of the layout's pack;
/// programs are loaded with `settings` (the kernel cache is in memory whatever they say).
pub fn gpu(reps: usize, settings: &crate::runtime::Settings) -> Result<String> {
    use crate::runtime::cache::Cache;
    use crate::runtime::gpu_pack::GpuProgram;
    let rt = |e: crate::runtime::Error| crate::Error::from(e);
    let mut out = String::new();
    let dev = match crate::gpu::open() {
        Ok(d) => d,
        Err(why) => {
            let _ = writeln!(
                out,
                "SKIPPED: GPU layout benchmark needs a CUDA GPU ({why})"
            );
            return Ok(out);
        }
    };
    let layer = Layer::synthetic(32, 7168, 2048, 5);
    let inp = crate::gpu::inputs(&layer);
    let cache = Cache::new(None);
    header(&mut out, "H200 (on-GPU pack)", &layer);
    let mut splits = Vec::new();
    for r in LAYOUTS {
        let mut times = Vec::new();
        for src in [r.source.to_string(), without_layouts(r.source)] {
            let info = crate::check_source(&src, r.path, Some(&layer.binding()))?;
            let prog = crate::codegen::plan::plan(&info, &|n: &str| inp.contains_key(n))?;
            let gp = GpuProgram::load(&dev, &cache, &prog, settings).map_err(rt)?;
            let mut bufs = gp.alloc(&dev, &mut |n| inp.get(n).cloned()).map_err(rt)?;
            gp.run(&dev, &mut bufs).map_err(rt)?;
            dev.sync().map_err(rt)?;
            let mut best = f64::INFINITY;
            for _ in 0..reps.max(1) {
                let t = Instant::now();
                gp.run(&dev, &mut bufs).map_err(rt)?;
                dev.sync().map_err(rt)?;
                best = best.min(t.elapsed().as_secs_f64());
            }
            if times.is_empty() {
                let per = gp.run_timed(&dev, &mut bufs).map_err(rt)?;
                let parts: Vec<String> = per
                    .iter()
                    .filter(|(_, ms)| *ms >= 0.005)
                    .map(|(n, ms)| format!("{} {:.3}", n.strip_prefix(r.name).unwrap_or(n), ms))
                    .collect();
                splits.push(format!("    {} kernels (ms): {}", r.name, parts.join(", ")));
            }
            times.push(best);
        }
        row(&mut out, r.name, times[1], times[0], &layer);
    }
    for s in splits {
        let _ = writeln!(out, "{s}");
    }
    Ok(out)
}
