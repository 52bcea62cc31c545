//! `moeforge selftest --gpu --gemm`: the generated grouped bf16 GEMM v0 on the GPU against the f64
//! host reference (`codegen::gemm::reference::gemm_bf16`), on three shapes (a ragged one with an
//! empty expert and a one-row expert, random row counts, and the DeepSeek-V3 w13 shape), with
//! random bf16 operands from a fresh seed (printed) and `Y` poisoned with NaN before the run; then
//! the largest shape timed.

use std::fmt::Write as _;

use crate::codegen::gemm::reference::{self, Grouped, SPEC_BOUND};
use crate::runtime::gemm::GemmBf16V0;
use crate::runtime::{drv, Device};
use crate::selftest_util::{fresh_seed, hopper, Rng};
use crate::{Error, Result};

/// One test shape: experts' row counts, N, K, pipeline stages.
struct Shape {
    rows: Vec<usize>,
    n: u32,
    k: u32,
    stages: u32,
    what: String,
}

fn shapes(rng: &mut Rng) -> Vec<Shape> {
    let mut random = vec![0usize; 8];
    for r in random.iter_mut() {
        *r = rng.below(300);
    }
    let mut spread = vec![0usize; 32];
    for _ in 0..512 {
        spread[rng.below(32)] += 1;
    }
    vec![
        Shape {
            rows: vec![0, 1, 70, 129],
            n: 256,
            k: 512,
            stages: 2,
            what: "ragged".into(),
        },
        Shape {
            rows: random,
            n: 512,
            k: 1024,
            stages: 3,
            what: "random rows 0..300".into(),
        },
        Shape {
            rows: spread,
            n: 2048,
            k: 7168,
            stages: 4,
            what: "DeepSeek-V3 w13, 512 tokens".into(),
        },
    ]
}

/// The f64 reference, one expert per task over the machine's threads.
fn reference_parallel(s: &Shape, x: &[u16], w: &[u16]) -> Result<Vec<f64>> {
    let (n, k) = (s.n as usize, s.k as usize);
    let mut starts = vec![0usize];
    for r in &s.rows {
        starts.push(starts[starts.len() - 1] + r);
    }
    let threads = std::thread::available_parallelism()
        .map(|t| t.get())
        .unwrap_or(1);
    let experts = s.rows.len();
    let mut parts: Vec<Option<crate::codegen::Result<Vec<f64>>>> =
        (0..experts).map(|_| None).collect();
    std::thread::scope(|sc| {
        for (c, chunk) in parts.chunks_mut(experts.div_ceil(threads)).enumerate() {
            let first = c * experts.div_ceil(threads);
            let starts = &starts;
            sc.spawn(move || {
                for (i, slot) in chunk.iter_mut().enumerate() {
                    let e = first + i;
                    let g = Grouped::new(&[s.rows[e]], n, k);
                    *slot = Some(reference::gemm_bf16(
                        &g,
                        &x[starts[e] * k..starts[e + 1] * k],
                        &w[e * n * k..(e + 1) * n * k],
                    ));
                }
            });
        }
    });
    let mut out = Vec::with_capacity(starts[experts] * n);
    for p in parts {
        match p {
            Some(r) => out.extend(r?),
            None => return Err(Error::Usage("gemm reference: a task did not run".into())),
        }
    }
    Ok(out)
}

/// The result of one shape on the device.
struct Outcome {
    ok: bool,
    line: String,
}

fn run_shape(dev: &Device, s: &Shape, rng: &mut Rng, time: bool) -> Result<Outcome> {
    let (n, k) = (s.n as usize, s.k as usize);
    let experts = s.rows.len();
    let t: usize = s.rows.iter().sum();
    let x: Vec<u16> = (0..t * k).map(|_| rng.bf16()).collect();
    let w: Vec<u16> = (0..experts * n * k).map(|_| rng.bf16()).collect();
    let mut offsets = vec![0i32];
    for r in &s.rows {
        offsets.push(offsets[offsets.len() - 1] + *r as i32);
    }
    let bytes = |v: &[u16]| v.iter().flat_map(|b| b.to_le_bytes()).collect::<Vec<u8>>();
    let gemm = GemmBf16V0::load(dev, s.n, s.k, s.stages)?;
    let st = &dev.stream;
    let dx = st.clone_htod(&bytes(&x)).map_err(drv("cuMemcpyHtoD"))?;
    let dw = st.clone_htod(&bytes(&w)).map_err(drv("cuMemcpyHtoD"))?;
    let doff = st.clone_htod(&offsets).map_err(drv("cuMemcpyHtoD"))?;
    let mut dy = st
        .clone_htod(&vec![f32::NAN; t * n])
        .map_err(drv("cuMemcpyHtoD"))?;
    // SAFETY: `offsets` is the exclusive prefix sum of the row counts: non-decreasing, ending at t.
    unsafe { gemm.run(dev, &dx, &dw, &doff, &mut dy, t, experts) }?;
    dev.sync()?;
    let y = st.clone_dtoh(&dy).map_err(drv("cuMemcpyDtoH"))?;
    let want = reference_parallel(s, &x, &w)?;
    let nan = y.iter().filter(|v| v.is_nan()).count();
    let rel = reference::rel_frobenius(&y, &want)?;
    let ok = nan == 0 && rel <= SPEC_BOUND;
    let rows_desc = if experts <= 8 {
        format!("rows {:?}", s.rows)
    } else {
        format!(
            "rows {}..={} per expert",
            s.rows.iter().min().copied().unwrap_or(0),
            s.rows.iter().max().copied().unwrap_or(0)
        )
    };
    let mut line = format!(
        "gemm bf16 v0 E={experts} N={n} K={k} S={} T={t} ({}; {rows_desc}): rel_frobenius {rel:.3e} (bound {SPEC_BOUND:e}), NaN {nan}: {}",
        s.stages,
        s.what,
        if ok { "ok" } else { "FAIL" }
    );
    if time {
        let reps = 10;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let a = st.record_event(timing).map_err(drv("cuEventRecord"))?;
        for _ in 0..reps {
            // SAFETY: as above.
            unsafe { gemm.run(dev, &dx, &dw, &doff, &mut dy, t, experts) }?;
        }
        let b = st.record_event(timing).map_err(drv("cuEventRecord"))?;
        let ms = a.elapsed_ms(&b).map_err(drv("cuEventElapsedTime"))? as f64 / reps as f64;
        let tflops = 2.0 * (t * n * k) as f64 / (ms * 1e-3) / 1e12;
        let _ = write!(
            line,
            "\ngemm bf16 v0 timing (E={experts} N={n} K={k} T={t}, {reps} reps, CUDA events): {:.1} us/launch, {tflops:.1} TFLOP/s (v0, untuned)",
            ms * 1e3
        );
    }
    Ok(Outcome { ok, line })
}

/// The GEMM self-test: v0 (one line per shape and a timing line), then every v1 variant on every
/// shape class ([`crate::gemm_ws_check`]; `quick` keeps the small classes, for the sanitizers);
/// `None` as the verdict without a GPU (the report then says SKIPPED).
pub fn selftest(
    quick: bool,
    jit: &crate::runtime::jit::JitOptions,
    only: Option<&str>,
) -> Result<(String, Option<bool>)> {
    let mut out = String::new();
    let Some(dev) = hopper("grouped-GEMM self-test", &mut out) else {
        return Ok((out, None));
    };
    let seed = fresh_seed();
    let _ = writeln!(
        out,
        "device: {} (sm_{}{}), driver CUDA {}; gemm seed {seed:#x}",
        dev.name, dev.capability.0, dev.capability.1, dev.driver_version
    );
    let mut rng = Rng(seed);
    let mut list = shapes(&mut rng);
    if quick {
        list.truncate(2);
    }
    if only.is_some() {
        // Only the chosen warp-specialized variants.
        list.clear();
    }
    let last = list.len().saturating_sub(1);
    let mut all = true;
    for (i, s) in list.iter().enumerate() {
        let o = run_shape(&dev, s, &mut rng, i == last && !quick)?;
        all &= o.ok;
        let _ = writeln!(out, "{}", o.line);
    }
    let compiler = crate::runtime::jit::Compiler::resolve(jit).map_err(Error::from)?;
    let _ = writeln!(
        out,
        "gemm v1 compiled by {} (MOEFORGE_JIT={})",
        compiler.describe(),
        jit.compiler.name()
    );
    let (v1, ok1) = crate::gemm_ws_check::selftest(&dev, seed, quick, &compiler, only)?;
    out.push_str(&v1);
    all &= ok1;
    let _ = writeln!(
        out,
        "{}",
        if all {
            "gemm: all shapes within bound"
        } else {
            "gemm: FAILED"
        }
    );
    Ok((out, Some(all)))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The per-expert parallel reference is the whole-problem reference, in the same row order.
    #[test]
    fn the_parallel_reference_is_the_reference() {
        let mut rng = Rng(0x1234_5678_9abc_def1);
        let s = Shape {
            rows: vec![0, 1, 70, 0, 129, 3],
            n: 24,
            k: 40,
            stages: 2,
            what: String::new(),
        };
        let t: usize = s.rows.iter().sum();
        let (n, k) = (s.n as usize, s.k as usize);
        let x: Vec<u16> = (0..t * k).map(|_| rng.bf16()).collect();
        let w: Vec<u16> = (0..s.rows.len() * n * k).map(|_| rng.bf16()).collect();
        let whole = reference::gemm_bf16(&Grouped::new(&s.rows, n, k), &x, &w).unwrap();
        assert_eq!(reference_parallel(&s, &x, &w).unwrap(), whole);
        let sh = shapes(&mut rng);
        assert_eq!(sh[0].rows, vec![0, 1, 70, 129]);
        assert_eq!(sh[2].rows.iter().sum::<usize>(), 512);
        assert!(sh[1].rows.iter().all(|r| *r < 300));
    }
}
