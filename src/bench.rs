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

/// A synthetic layer of bf16 weights.
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
    /// in `seed`: element `n` of a tensor is made from steps `2n+1` and `2n+2` of a xorshift64
    /// stream started at `seed | 1` (`seed ^ 0x5555` for `w2`). The stream is cut into pieces, each
    /// started by jumping ahead, and generated on every core, so the bytes do not depend on
    /// how many cores there are.
    pub fn synthetic(e: usize, h: usize, i: usize, seed: u64) -> Layer {
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        Layer {
            dims: (e, h, i),
            w13: synthetic_bf16(e * 2 * i * h, seed, threads),
            w2: synthetic_bf16(e * h * i, seed ^ 0x5555, threads),
        }
    }

    /// Input bytes.
    pub fn bytes(&self) -> usize {
        self.w13.len() + self.w2.len()
    }

    /// The layer's binding, `E=..,H=..,I=..`.
    pub fn binding(&self) -> String {
        let (e, h, i) = self.dims;
        format!("E={e},H={h},I={i}")
    }
}

/// One step of the synthetic weights' generator (xorshift64, shifts 13, 7, 17).
fn xorshift(mut s: u64) -> u64 {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    s
}

/// A step is linear over GF(2): as a 64x64 bit matrix, column `j` is the image of bit `j`.
struct Gf2([u64; 64]);

impl Gf2 {
    /// The matrix of one [`xorshift`] step.
    fn step() -> Gf2 {
        let mut c = [0u64; 64];
        for (j, col) in c.iter_mut().enumerate() {
            *col = xorshift(1 << j);
        }
        Gf2(c)
    }

    /// The matrix applied to a state.
    fn apply(&self, mut v: u64) -> u64 {
        let mut out = 0;
        while v != 0 {
            out ^= self.0[v.trailing_zeros() as usize];
            v &= v - 1;
        }
        out
    }

    /// The matrix applied twice.
    fn squared(&self) -> Gf2 {
        Gf2(self.0.map(|c| self.apply(c)))
    }
}

/// The generator's state `n` steps after `s` (binary powers of the step matrix).
fn jump(mut s: u64, mut n: u64) -> u64 {
    let mut p = Gf2::step();
    while n != 0 {
        if n & 1 == 1 {
            s = p.apply(s);
        }
        n >>= 1;
        if n != 0 {
            p = p.squared();
        }
    }
    s
}

/// One element from the generator's state before it: its bf16 bits and the state after it (two
/// steps later). A sum of four uniform 16-bit draws, centred and scaled to std ~0.02, truncated to
/// bf16.
#[inline(always)]
fn element(s: u64) -> (u16, u64) {
    let s1 = xorshift(s);
    let s2 = xorshift(s1);
    let acc = ((s1 & 0xFFFF) as f32 + ((s1 >> 16) & 0xFFFF) as f32)
        + ((s2 & 0xFFFF) as f32 + ((s2 >> 16) & 0xFFFF) as f32);
    let x = (acc / 65536.0 - 2.0) * 0.0245;
    ((x.to_bits() >> 16) as u16, s2)
}

/// `n` synthetic bf16 values (little-endian bytes) of the stream seeded by `seed`, on `threads`
/// threads; the same bytes for any thread count.
pub fn synthetic_bf16(n: usize, seed: u64, threads: usize) -> Vec<u8> {
    let mut out = vec![0u8; 2 * n];
    let start = seed | 1;
    // At least 64 Ki elements a thread: a jump costs about as much as generating a few thousand.
    let t = threads.clamp(1, (n / (1 << 16)).max(1));
    let per = n.div_ceil(t);
    std::thread::scope(|sc| {
        for (k, piece) in out.chunks_mut(2 * per.max(1)).enumerate() {
            sc.spawn(move || fill_piece(piece, start, k * per));
        }
    });
    out
}

/// Elements `first..first + piece.len() / 2` of the stream started at `start`, as four
/// interleaved lanes (each its own jump) so that a core runs four independent step chains at once;
/// each lane's values go through a small block on the stack, then to its part of `piece`.
fn fill_piece(piece: &mut [u8], start: u64, first: usize) {
    const LANES: usize = 4;
    const BLOCK: usize = 256;
    let n = piece.len() / 2;
    let per = n / LANES;
    let mut states = [0u64; LANES];
    for (l, s) in states.iter_mut().enumerate() {
        *s = jump(start, 2 * (first + l * per) as u64);
    }
    let (lanes, tail) = piece.split_at_mut(2 * per * LANES);
    if per > 0 {
        let mut lanes: Vec<&mut [u8]> = lanes.chunks_exact_mut(2 * per).collect();
        let mut block = [[0u16; BLOCK]; LANES];
        let mut j = 0;
        while j < per {
            let m = BLOCK.min(per - j);
            for t in 0..m {
                for (s, b) in states.iter_mut().zip(block.iter_mut()) {
                    let (v, next) = element(*s);
                    *s = next;
                    b[t] = v;
                }
            }
            for (lane, b) in lanes.iter_mut().zip(&block) {
                let dst = lane.get_mut(2 * j..2 * (j + m)).unwrap_or_default();
                for (d, v) in dst.chunks_exact_mut(2).zip(b) {
                    d.copy_from_slice(&v.to_le_bytes());
                }
            }
            j += m;
        }
    }
    // The last lane ends where the tail starts.
    let mut s = states[LANES - 1];
    for d in tail.chunks_exact_mut(2) {
        let (v, next) = element(s);
        s = next;
        d.copy_from_slice(&v.to_le_bytes());
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
/// (best time kept); with `errors`, also the dequantization error over every element of the layer
/// ([`crate::dequant::error_bf16`]). `bar` advances by one per recipe.
pub fn pack_all(
    layer: &Layer,
    threads: usize,
    reps: usize,
    errors: bool,
    only: Option<&str>,
    opts: &crate::codegen::host::Options,
    bar: &indicatif::ProgressBar,
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let bind = layer.binding();
    let inputs: HashMap<&str, &Vec<u8>> = [("w13", &layer.w13), ("w2", &layer.w2)]
        .into_iter()
        .collect();
    let (e, h, i) = layer.dims;
    let x = if errors {
        let w13 = crate::dequant::Bf16Input::new(&layer.w13, (e, 2 * i, h), threads);
        let w2 = crate::dequant::Bf16Input::new(&layer.w2, (e, h, i), threads);
        [("w13", w13), ("w2", w2)].to_vec()
    } else {
        Vec::new()
    };
    // The previous recipe's buffers, reused: the pages of a fresh allocation are faulted in on first
    // touch, which this VM makes expensive (about as long as the pack itself for a layer).
    let mut pool: Vec<Vec<u8>> = Vec::new();
    for r in STANDARD.iter().filter(|r| only.is_none_or(|o| o == r.name)) {
        bar.set_message(format!("{}: packing", r.name));
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
        // operating system's first-touch page faults.
        let mut bufs = Vec::with_capacity(prog.bufs.len());
        for b in &prog.bufs {
            let bytes = b.len * b.elem.size();
            let mut d = take(&mut pool, bytes);
            match &b.role {
                BufRole::Input(name) => {
                    let src = inputs.get(name.as_str()).map_or(&[][..], |v| v.as_slice());
                    if src.len() != bytes {
                        return Err(crate::codegen::Error::BufferSize {
                            name: name.clone(),
                            expected: bytes,
                            got: src.len(),
                        }
                        .into());
                    }
                    d.extend_from_slice(src);
                }
                _ => d.resize(bytes, 0xFF),
            }
            bufs.push(d);
        }
        // What this recipe did not take is not kept for the next.
        pool.clear();
        for _ in 0..reps.max(1) {
            let t = Instant::now();
            compiled.run(&mut bufs, &crate::codegen::SingleProcess, threads)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        let (mut rel, mut abs) = (None, None);
        if errors {
            bar.set_message(format!("{}: dequantization error", r.name));
            let mut params: HashMap<String, Vec<u8>> = HashMap::new();
            for (b, d) in prog.bufs.iter().zip(bufs.drain(..)) {
                match &b.role {
                    BufRole::Param(n) => {
                        params.insert(n.clone(), d);
                    }
                    _ => pool.push(d),
                }
            }
            for (name, x) in &x {
                let Some(x) = x else { continue };
                if let Some(d) = crate::dequant::error_bf16(&info, name, x, &params, threads) {
                    rel = Some(rel.unwrap_or(0f32).max(d.max_rel_to_amax));
                    abs = Some(abs.unwrap_or(0f32).max(d.max_abs));
                }
            }
            pool.extend(params.into_values());
        }
        pool.append(&mut bufs);
        rows.push(Row {
            recipe: r.name.to_string(),
            seconds: best,
            gbps: layer.bytes() as f64 / best / 1e9,
            max_rel_err: rel,
            max_abs_err: abs,
        });
        bar.inc(1);
    }
    Ok(rows)
}

/// An empty buffer of capacity at least `bytes` from `pool` (the smallest that fits), or a new one.
fn take(pool: &mut Vec<Vec<u8>>, bytes: usize) -> Vec<u8> {
    let fit = pool
        .iter()
        .enumerate()
        .filter(|(_, v)| v.capacity() >= bytes)
        .min_by_key(|(_, v)| v.capacity())
        .map(|(k, _)| k);
    match fit {
        Some(k) => {
            let mut v = pool.swap_remove(k);
            v.clear();
            v
        }
        None => Vec::with_capacity(bytes),
    }
}

/// A progress bar of `len` steps on stderr, drawn only when stderr is a terminal (the reports go to
/// stdout and stay clean).
pub fn progress_bar(len: u64) -> indicatif::ProgressBar {
    use std::io::IsTerminal as _;
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    bar
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
    let bar = progress_bar(
        STANDARD
            .iter()
            .filter(|r| only.is_none_or(|o| o == r.name))
            .count() as u64,
    );
    let rows = pack_all(&layer, threads, 3, false, only, opts, &bar);
    bar.finish_and_clear();
    let rows = rows?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The generator as first written: one xorshift64 stream, element after element.
    fn serial(n: usize, seed: u64) -> Vec<u8> {
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
    }

    #[test]
    fn jump_is_that_many_steps() {
        let mut s = 0x1234_5678_9abc_def1u64;
        let s0 = s;
        for n in 0..300u64 {
            assert_eq!(jump(s0, n), s, "{n} steps");
            s = xorshift(s);
        }
    }

    /// The parallel, lane-interleaved generator writes the serial stream's bytes, for any thread
    /// count, lengths not a multiple of the lanes or of the pieces included.
    #[test]
    fn synthetic_equals_the_serial_stream() {
        for (n, seed) in [
            (0, 1),
            (1, 2),
            (7, 3),
            (1000, 4),
            (200_003, 5),
            (262_147, 42),
        ] {
            let want = serial(n, seed);
            for threads in [1, 2, 3, 8] {
                assert!(
                    synthetic_bf16(n, seed, threads) == want,
                    "n={n} seed={seed} threads={threads}"
                );
            }
        }
        let l = Layer::synthetic(3, 64, 32, 7);
        assert!(l.w13 == serial(3 * 64 * 64, 7));
        assert!(l.w2 == serial(3 * 64 * 32, 7 ^ 0x5555));
    }
}
