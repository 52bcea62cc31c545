//! `moeforge bench --host` and the packing part of `moeforge demo`: every standard recipe packs a
//! synthetic MoE layer on the host; throughput in GB/s of bf16 input against a plain memcpy of the
//! same bytes in the same run, the speed-up over the reference interpreter, recipe -> PTX time, and
//! the dequantization error.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Instant;

use crate::codegen::kir::BufRole;
use crate::kernels::STANDARD;
use crate::Result;

/// A synthetic layer: bf16 bytes and the same values as f32.
pub struct Layer {
    /// `(E, H, I)`.
    pub dims: (usize, usize, usize),
    /// `w13 [E, 2I, H]` as bf16 bytes.
    pub w13: Vec<u8>,
    /// `w2 [E, H, I]` as bf16 bytes.
    pub w2: Vec<u8>,
}

impl Layer {
    /// Random weights of roughly normal distribution (std 0.02, like trained weights), deterministic
    /// in `seed`.
    pub fn synthetic(e: usize, h: usize, i: usize, seed: u64) -> Layer {
        let gen = |n: usize, seed: u64| -> Vec<u8> {
            let mut s = seed | 1;
            let mut out = Vec::with_capacity(2 * n);
            for _ in 0..n {
                let mut acc = 0f32;
                for _ in 0..2 {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    acc += (s & 0xFFFF) as f32 + ((s >> 16) & 0xFFFF) as f32;
                }
                let x = (acc / 65536.0 - 2.0) * 0.0245;
                out.extend_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes());
            }
            out
        };
        Layer {
            dims: (e, h, i),
            w13: gen(e * 2 * i * h, seed),
            w2: gen(e * h * i, seed ^ 0x5555),
        }
    }

    /// Input bytes.
    pub fn bytes(&self) -> usize {
        self.w13.len() + self.w2.len()
    }

    fn f32s(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(2)
            .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
            .collect()
    }

    /// The layer's binding, `E=..,H=..,I=..`.
    pub fn binding(&self) -> String {
        let (e, h, i) = self.dims;
        format!("E={e},H={h},I={i}")
    }
}

/// One recipe's measurements.
#[derive(Debug, Clone)]
pub struct Row {
    /// Recipe.
    pub recipe: String,
    /// Best time of the host backend over the repetitions (s).
    pub seconds: f64,
    /// bf16 input GB/s.
    pub gbps: f64,
    /// Largest |x - x'| relative to the tensor's amax, over w13 and w2.
    pub max_rel_err: Option<f32>,
    /// Largest |x - x'|.
    pub max_abs_err: Option<f32>,
}

/// Pack `layer` with every standard recipe on the host (compiled with `opts`), `reps` times each
/// (best time kept).
pub fn pack_all(
    layer: &Layer,
    threads: usize,
    reps: usize,
    errors: bool,
    only: Option<&str>,
    opts: &crate::codegen::host::Options,
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let bind = layer.binding();
    let inputs: HashMap<&str, &Vec<u8>> = [("w13", &layer.w13), ("w2", &layer.w2)]
        .into_iter()
        .collect();
    for r in STANDARD.iter().filter(|r| only.is_none_or(|o| o == r.name)) {
        let info = crate::check_source(r.source, r.path, Some(&bind))?;
        let prog = crate::codegen::plan::plan_with(
            &info,
            &|n: &str| inputs.contains_key(n),
            &|_| false,
            true,
        )?;
        let compiled = crate::codegen::host::compile_with(&prog, opts)?;
        let mut best = f64::INFINITY;
        // Buffers are allocated and touched once, then reused: what is timed is the backend, not the
        // operating system's first-touch page faults (which this VM makes expensive).
        let mut bufs =
            crate::codegen::alloc_buffers(&prog, &mut |n| inputs.get(n).map(|b| (*b).clone()))?;
        for (d, b) in bufs.iter_mut().zip(&prog.bufs) {
            if !matches!(b.role, BufRole::Input(_)) {
                d.fill(0xFF);
                std::hint::black_box(&d);
            }
        }
        for _ in 0..reps.max(1) {
            let t = Instant::now();
            compiled.run(&mut bufs, &crate::codegen::SingleProcess, threads)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        let (mut rel, mut abs) = (None, None);
        if errors {
            let params: HashMap<String, Vec<u8>> = prog
                .bufs
                .iter()
                .zip(bufs)
                .filter_map(|(b, d)| match &b.role {
                    BufRole::Param(n) => Some((n.clone(), d)),
                    _ => None,
                })
                .collect();
            let (e, h, i) = layer.dims;
            for (name, bytes, shape) in [
                ("w13", &layer.w13, (e, 2 * i, h)),
                ("w2", &layer.w2, (e, h, i)),
            ] {
                let x = Layer::f32s(bytes);
                if let Some(d) = crate::dequant::error(&info, name, &x, shape, &params) {
                    rel = Some(rel.unwrap_or(0f32).max(d.max_rel_to_amax));
                    abs = Some(abs.unwrap_or(0f32).max(d.max_abs));
                }
            }
        }
        rows.push(Row {
            recipe: r.name.to_string(),
            seconds: best,
            gbps: layer.bytes() as f64 / best / 1e9,
            max_rel_err: rel,
            max_abs_err: abs,
        });
    }
    Ok(rows)
}

/// memcpy GB/s of `bytes` bytes (best of `reps`), counting the bytes copied once (as the pack
/// throughput counts bf16 input bytes once).
pub fn memcpy_gbps(bytes: usize, reps: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    bytes as f64 / best / 1e9
}

/// `moeforge bench --host`, the host backend compiling with `opts`.
pub fn host_report(
    threads: usize,
    only: Option<&str>,
    opts: &crate::codegen::host::Options,
) -> Result<String> {
    let mut out = String::new();
    let (e, h, i) = (128, 2048, 768);
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let threads_used = if threads == 0 { cores } else { threads };
    let _ = writeln!(out, "moeforge bench --host: Qwen3-30B-A3B layer (E={e}, H={h}, I={i}), {threads_used} thread(s) on {cores} core(s)");
    let layer = Layer::synthetic(e, h, i, 42);
    let mc = memcpy_gbps(layer.bytes(), 5);
    let _ = writeln!(
        out,
        "input: {:.1} MB of bf16; memcpy of the same bytes: {mc:.2} GB/s (1 thread)\n",
        layer.bytes() as f64 / 1e6
    );
    let rows = pack_all(&layer, threads, 3, false, only, opts)?;
    // Speed-up over the interpreter, measured on a 1-expert slice of the same layer.
    let small = Layer::synthetic(1, h, i, 7);
    let _ = writeln!(
        out,
        "{:<16} {:>9} {:>8} {:>10} {:>14} {:>12}",
        "recipe", "pack ms", "GB/s", "/ memcpy", "vs interpreter", "recipe->PTX"
    );
    for row in &rows {
        let r = crate::kernels::find(&row.recipe)
            .ok_or_else(|| crate::Error::Usage("recipe".into()))?;
        let info = crate::check_source(r.source, r.path, Some(&small.binding()))?;
        let prog = crate::codegen::plan::plan_with(&info, &|_: &str| false, &|_| false, true)?;
        let inputs: HashMap<&str, &Vec<u8>> = [("w13", &small.w13), ("w2", &small.w2)]
            .into_iter()
            .collect();
        let mut bufs =
            crate::codegen::alloc_buffers(&prog, &mut |n| inputs.get(n).map(|b| (*b).clone()))?;
        let t = Instant::now();
        crate::codegen::interp::run(&prog, &mut bufs, &crate::codegen::SingleProcess)?;
        let ti = t.elapsed().as_secs_f64();
        let compiled = crate::codegen::host::compile_with(&prog, opts)?;
        let mut bufs =
            crate::codegen::alloc_buffers(&prog, &mut |n| inputs.get(n).map(|b| (*b).clone()))?;
        let t = Instant::now();
        compiled.run(&mut bufs, &crate::codegen::SingleProcess, threads)?;
        let th = t.elapsed().as_secs_f64();
        // Recipe -> PTX: parse, verify, plan and emit for sm_90a (median of 11).
        let mut times = Vec::new();
        for _ in 0..11 {
            let t = Instant::now();
            let info = crate::check_source(r.source, r.path, Some(&format!("E={e},H={h},I={i}")))?;
            let prog = crate::codegen::plan::plan(&info, &|_: &str| true)?;
            std::hint::black_box(crate::codegen::ptx::compile(
                &prog,
                crate::codegen::ptx::Target::Sm90a,
            )?);
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(|a, b| a.total_cmp(b));
        let _ = writeln!(
            out,
            "{:<16} {:>9.1} {:>8.2} {:>9.0}% {:>13.0}x {:>10.2} ms",
            row.recipe,
            row.seconds * 1e3,
            row.gbps,
            row.gbps / mc * 100.0,
            ti / th,
            times[5] * 1e3
        );
    }
    Ok(out)
}
