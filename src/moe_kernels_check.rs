//! `moeforge selftest --gpu --gemm`, the MoE layer's activation and combine kernels
//! (`codegen::moe::act` and `codegen::moe::combine`, run by `runtime::moe_kernels`) on the GPU
//! against their host references, from a fresh seed (printed).
//!
//! * The activation kernel, every (input, output) pair at W in {8, 768, 2048, 7168, 14336} and `max_rows` in
//!   {1, 37, 300}, with row offsets over 4 slots whose total is below `max_rows` (but for one row):
//!   rows past the total, and their scales, must keep the poison written first. Bf16 and F32
//!   input: codes, bf16 and scales bit for bit. SiluMul input (the kernel's `ex2.approx` against
//!   the host's `exp2`): E4M3 values within one E4M3 step of the row's (or group's) scale, bf16 within one
//!   ulp, scales within 1e-6 relative. Rows of zeros, of very negative gates (`exp` overflows) and
//!   of mixed magnitudes are included.
//! * Row scales and combine, exactly: random routings with dropped items (slot `-1`) and a corrupt
//!   row index, so that some items have no row (`pos_of = -1`, the host's inverse of `row_of`, as
//!   the permute's scatter writes it and the permute check checks); the combine's output is
//!   compared bit for bit with the host's sum.
//!
//! Each line ends with `: ok` or `: FAIL ...`. Then one timing line each for the activation
//! (SiluMul to bf16, 65536 rows, W = 2048) and the combine (T = 8192, k = 8, H = 7168), with CUDA
//! events.

use std::fmt::Write as _;

use cudarc::driver::CudaSlice;

use crate::codegen::gemm::reference::{bf16_from_f32, bf16_to_f32};
use crate::codegen::moe::act::{self, ActIn, ActOut};
use crate::codegen::moe::combine;
use crate::runtime::moe_kernels::{MoeAct, MoeCombine};
use crate::runtime::{drv, Device};
use crate::selftest_util::{fresh_seed, hopper, Rng};
use crate::Result;

/// Widths of the activation checks.
/// The widths: one chunk of 8 a thread up to 2048; 7168 and 14336 give a thread 2 and 4 chunks
/// (the last one guarded), the per-group order of several chunks a thread.
const WIDTHS: [usize; 5] = [8, 768, 2048, 7168, 14336];
/// `max_rows` of the activation checks.
const ROWS: [usize; 3] = [1, 37, 300];
/// Slots of the activation checks' offsets.
const ACT_SLOTS: usize = 4;
/// The poison byte of outputs (an E4M3 NaN; bf16 0xFFFF is a NaN too).
const POISON: u8 = 0xFF;
/// The poison of written scales (a NaN).
const SCALE_POISON: u32 = 0x7FC0_DEAD;

/// A uniform f32 in `[lo, hi)`.
fn uniform(rng: &mut Rng, lo: f32, hi: f32) -> f32 {
    let u = (rng.next() >> 40) as f32 / (1u64 << 24) as f32;
    lo + (hi - lo) * u
}

/// The f32 source values of `rows` rows of width `w`: `h [rows, 2W]` (SiluMul), bf16 values as
/// f32 `[rows, W]`, or f32 `a [rows, W]` (F32). Row kinds cycle: zeros, mixed magnitudes, very
/// negative gates (SiluMul) or tiny values (bf16, F32: subnormal f32 included), values in [-1, 1)
/// (F32: rounding ties of E4M3 among them).
fn source(rng: &mut Rng, input: ActIn, rows: usize, w: usize) -> Vec<f32> {
    let per = input.values_per_column() * w;
    let mut out = Vec::with_capacity(rows * per);
    let kind0 = rng.below(4);
    for r in 0..rows {
        let kind = (r + kind0) % 4;
        for c in 0..per {
            let v = match (input, kind) {
                (_, 0) => 0.0,
                (ActIn::SiluMul, 1) => {
                    uniform(rng, -12.0, 12.0) * 2f32.powi(rng.below(9) as i32 - 4)
                }
                (ActIn::SiluMul, 2) if c < w => {
                    if rng.below(3) == 0 {
                        -200.0 - uniform(rng, 0.0, 1000.0)
                    } else {
                        uniform(rng, -20.0, 20.0)
                    }
                }
                (ActIn::SiluMul, _) => uniform(rng, -4.0, 4.0),
                (ActIn::Bf16, 1) => bf16_to_f32(rng.bf16_exp(0x60..0x90)),
                (ActIn::Bf16, 2) => bf16_to_f32(rng.bf16_exp(0x01..0x20)),
                (ActIn::Bf16, _) => bf16_to_f32(rng.bf16()),
                (ActIn::F32, 1) => uniform(rng, -12.0, 12.0) * 2f32.powi(rng.below(17) as i32 - 8),
                (ActIn::F32, 2) => {
                    f32::from_bits(rng.below(1 << 24) as u32) * uniform(rng, -1.0, 1.0).signum()
                }
                // E4M3 ties (the midpoint of two codes, times a power of two) and plain values.
                (ActIn::F32, _) if rng.below(4) == 0 => {
                    (1.0 + (2 * rng.below(8) + 1) as f32 / 16.0)
                        * 2f32.powi(rng.below(8) as i32 - 4)
                }
                (ActIn::F32, _) => uniform(rng, -1.0, 1.0),
            };
            out.push(v);
        }
    }
    out
}

/// Row offsets over `slots` slots whose total is `total` (non-decreasing cut points).
fn offsets(rng: &mut Rng, slots: usize, total: usize) -> Vec<i32> {
    let mut cuts: Vec<usize> = (0..slots - 1).map(|_| rng.below(total + 1)).collect();
    cuts.sort_unstable();
    let mut o = vec![0i32];
    o.extend(cuts.iter().map(|&c| c as i32));
    o.push(total as i32);
    o
}

fn up<T: cudarc::driver::DeviceRepr>(dev: &Device, v: &[T]) -> Result<CudaSlice<T>> {
    Ok(dev.stream.clone_htod(v).map_err(drv("cuMemcpyHtoD"))?)
}

fn down<T: cudarc::driver::DeviceRepr + Default + Clone>(
    dev: &Device,
    d: &CudaSlice<T>,
) -> Result<Vec<T>> {
    Ok(dev.stream.clone_dtoh(d).map_err(drv("cuMemcpyDtoH"))?)
}

/// One activation case: the report line and whether it passed.
fn act_case(
    dev: &Device,
    input: ActIn,
    output: ActOut,
    w: usize,
    max_rows: usize,
    rng: &mut Rng,
) -> Result<(bool, String)> {
    let total = if max_rows == 1 {
        1
    } else {
        max_rows - 1 - rng.below(max_rows / 3)
    };
    let offs = offsets(rng, ACT_SLOTS, total);
    let src = source(rng, input, max_rows, w);
    let per = input.values_per_column() * w;
    let statics: Vec<f32> = (0..max_rows)
        .map(|_| uniform(rng, 1e-3, 0.1) * 2f32.powi(rng.below(5) as i32 - 2))
        .collect();
    let (want_q, want_s) = act::reference(input, output, &src[..total * per], w, total, &statics)?;

    let a = MoeAct::load(dev, input, output, w as u32)?;
    let l = *a.launch();
    let src_bytes: Vec<u8> = match input {
        ActIn::SiluMul | ActIn::F32 => src.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ActIn::Bf16 => src
            .iter()
            .flat_map(|v| bf16_from_f32(*v).to_le_bytes())
            .collect(),
    };
    let d_src = up(dev, &src_bytes)?;
    let dst_len = max_rows * l.dst_row_bytes();
    let mut d_dst = up(dev, &vec![POISON; dst_len])?;
    let ns = l.scales_len(max_rows);
    let scales_in: Vec<f32> = if output == ActOut::StaticRow {
        statics.clone()
    } else {
        // At least one element: a zero-sized allocation is refused.
        vec![f32::from_bits(SCALE_POISON); ns.max(1)]
    };
    let mut d_scales = up(dev, &scales_in)?;
    let d_offs = up(dev, &offs)?;
    let scales_arg = (ns > 0).then_some(&mut d_scales);
    // SAFETY: one stream only; the sizes are checked by `run`.
    unsafe {
        a.run(
            dev, &d_src, &mut d_dst, scales_arg, &d_offs, ACT_SLOTS, max_rows,
        )
    }?;
    dev.sync()?;
    let q = down(dev, &d_dst)?;
    let s = down(dev, &d_scales)?;

    let exact = input != ActIn::SiluMul;
    let rb = l.dst_row_bytes();
    let mut bad_out = 0usize;
    let mut first_out = None;
    let mut untouched = q[total * rb..].iter().all(|&b| b == POISON);
    // The scale of element (r, c), kernel layout and host layout (max_rows = total).
    let scale_at = |r: usize, c: usize| -> (usize, usize) {
        match output {
            ActOut::Group128 => (c / 128 * max_rows + r, c / 128 * total + r),
            _ => (r, r),
        }
    };
    for r in 0..total {
        for c in 0..w {
            let ok = match output {
                ActOut::Bf16 => {
                    let i = 2 * (r * w + c);
                    let g = u16::from_le_bytes([q[i], q[i + 1]]);
                    let h = u16::from_le_bytes([want_q[i], want_q[i + 1]]);
                    if exact {
                        g == h
                    } else {
                        act::bf16_close(g, h)
                    }
                }
                _ => {
                    let i = r * w + c;
                    let (ks, hs) = scale_at(r, c);
                    if exact {
                        q[i] == want_q[i]
                    } else {
                        let sg = s.get(ks).copied().unwrap_or(f32::NAN);
                        let sh = want_s.get(hs).copied().unwrap_or(f32::NAN);
                        act::e4m3_close((q[i], sg), (want_q[i], sh))
                    }
                }
            };
            if !ok {
                bad_out += 1;
                first_out.get_or_insert((r, c));
            }
        }
    }
    let mut bad_scales = 0usize;
    match output {
        ActOut::Bf16 => {}
        ActOut::StaticRow => {
            untouched &= s
                .iter()
                .zip(&statics)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        }
        ActOut::PerToken | ActOut::Group128 => {
            let groups = if output == ActOut::Group128 {
                l.groups()
            } else {
                1
            };
            for g in 0..groups {
                for r in 0..max_rows {
                    let got = s[g * max_rows + r];
                    if r >= total {
                        untouched &= got.to_bits() == SCALE_POISON;
                        continue;
                    }
                    let want = want_s[g * total + r];
                    let ok = if exact {
                        got.to_bits() == want.to_bits()
                    } else {
                        (got - want).abs() <= 1e-6 * want.abs()
                    };
                    bad_scales += usize::from(!ok);
                }
            }
        }
    }
    let ok = bad_out == 0 && bad_scales == 0 && untouched;
    let mut line = format!(
        "moe act {input:?} -> {output:?} W={w} max_rows={max_rows} rows={total}: {} mismatches {bad_out}/{}, scale mismatches {bad_scales}",
        if exact { "exact" } else { "tolerance" },
        total * w
    );
    if ok {
        line.push_str(": ok");
    } else {
        line.push_str(": FAIL");
        if let Some((r, c)) = first_out {
            let _ = write!(line, " (first at row {r} col {c})");
        }
        if !untouched {
            line.push_str(" (rows past the total, or read-only scales, were written)");
        }
    }
    Ok((ok, line))
}

/// A routing: per item its slot (`-1` dropped), the expert-sorted `row_of` (garbage past the
/// total) and the offsets.
fn routing(rng: &mut Rng, n: usize, slots: usize) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
    let slot: Vec<i32> = (0..n)
        .map(|_| {
            if rng.below(10) == 0 {
                -1
            } else {
                rng.below(slots) as i32
            }
        })
        .collect();
    let mut row_of = Vec::with_capacity(n);
    let mut offs = vec![0i32];
    for s in 0..slots as i32 {
        let mut items: Vec<i32> = (0..n as i32).filter(|&i| slot[i as usize] == s).collect();
        for i in (1..items.len()).rev() {
            items.swap(i, rng.below(i + 1));
        }
        row_of.extend(items);
        offs.push(row_of.len() as i32);
    }
    while row_of.len() < n {
        row_of.push(-9);
    }
    (slot, row_of, offs)
}

/// One row scales + combine case (`pos_of` the host's inverse of `row_of`, as the permute writes
/// it): the report line and whether it passed.
fn combine_case(
    dev: &Device,
    t: usize,
    k: usize,
    h: usize,
    rng: &mut Rng,
) -> Result<(bool, String)> {
    let n = t * k;
    let slots = 8;
    let (slot, mut row_of, offs) = routing(rng, n, slots);
    let total = offs[slots] as usize;
    if total > 1 {
        // A corrupt row index: its item keeps no row, its scale is 1.0.
        row_of[rng.below(total)] = (n + 5) as i32;
    }
    let values: Vec<f32> = (0..slots).map(|_| uniform(rng, 0.01, 2.0)).collect();
    let y: Vec<f32> = (0..n * h).map(|_| uniform(rng, -3.0, 3.0)).collect();
    let weights: Vec<f32> = (0..n).map(|_| uniform(rng, 0.0, 1.0)).collect();
    let want_pos = combine::invert_reference(&row_of, &offs, slots, n)?;
    let want_rs = combine::row_scales_reference(&row_of, &slot, &values, &offs, slots, n)?;
    let want_out = combine::combine_reference(&y, &want_pos, &weights, t, k, n, h)?;

    let c = MoeCombine::load(dev, h as u32)?;
    let d_row_of = up(dev, &row_of)?;
    let d_offs = up(dev, &offs)?;
    let d_slot = up(dev, &slot)?;
    let d_values = up(dev, &values)?;
    let y_bytes: Vec<u8> = y.iter().flat_map(|v| v.to_le_bytes()).collect();
    let d_y = up(dev, &y_bytes)?;
    let d_w = up(dev, &weights)?;
    let d_pos = up(dev, &want_pos)?;
    let mut d_rs = up(dev, &vec![f32::from_bits(SCALE_POISON); n])?;
    let mut d_out = up(dev, &vec![0xFFFFu16; t * h])?;
    // SAFETY: one stream only; the sizes are checked by each launch.
    unsafe {
        c.row_scales(
            dev, &d_row_of, &d_slot, &d_values, &d_offs, &mut d_rs, slots, n,
        )?;
        c.combine(dev, &d_y, &d_pos, &d_w, &mut d_out, t, k, n)?;
    }
    dev.sync()?;
    let rs = down(dev, &d_rs)?;
    let out = down(dev, &d_out)?;
    let bad_rs = (0..n)
        .filter(|&r| {
            let want = want_rs.get(r).map_or(SCALE_POISON, |v| v.to_bits());
            rs[r].to_bits() != want
        })
        .count();
    let bad_out = out.iter().zip(&want_out).filter(|(a, b)| a != b).count();
    let absent = want_pos.iter().filter(|&&p| p < 0).count();
    let ok = bad_rs == 0 && bad_out == 0;
    let mut line = format!(
        "moe row scales/combine T={t} k={k} H={h}: {total} rows, {absent} items without a row; row-scale mismatches {bad_rs}/{n}, output mismatches {bad_out}/{}",
        t * h
    );
    line.push_str(if ok { ": ok" } else { ": FAIL" });
    if let Some(i) = (0..out.len()).find(|&i| out[i] != want_out[i]) {
        let _ = write!(
            line,
            " (first output at token {} col {}: gpu {:#06x}, host {:#06x})",
            i / h,
            i % h,
            out[i],
            want_out[i]
        );
    }
    Ok((ok, line))
}

/// Milliseconds per call of `f` over `reps` calls, with CUDA events on `dev.stream`.
fn time(dev: &Device, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let st = &dev.stream;
    let ev = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let a = st.record_event(ev).map_err(drv("cuEventRecord"))?;
    for _ in 0..reps {
        f()?;
    }
    let b = st.record_event(ev).map_err(drv("cuEventRecord"))?;
    Ok(a.elapsed_ms(&b).map_err(drv("cuEventElapsedTime"))? as f64 / reps as f64)
}

/// The timing lines: the activation (SiluMul to bf16, 65536 rows of W = 2048) and the combine
/// (T = 8192, k = 8, H = 7168, every item with a row).
fn timing(dev: &Device, rng: &mut Rng) -> Result<String> {
    let mut out = String::new();
    let reps = 20;
    let (rows, w) = (65536usize, 2048usize);
    let a = MoeAct::load(dev, ActIn::SiluMul, ActOut::Bf16, w as u32)?;
    let h_bytes: Vec<u8> = (0..rows * 2 * w)
        .flat_map(|_| uniform(rng, -6.0, 6.0).to_le_bytes())
        .collect();
    let d_src = up(dev, &h_bytes)?;
    drop(h_bytes);
    let mut d_dst = dev
        .stream
        .alloc_zeros::<u8>(rows * 2 * w)
        .map_err(drv("cuMemAlloc"))?;
    let d_offs = up(dev, &[0i32, rows as i32])?;
    let ms = time(dev, reps, || {
        // SAFETY: one stream only; the sizes are checked by `run`.
        unsafe { a.run(dev, &d_src, &mut d_dst, None, &d_offs, 1, rows) }
            .map_err(crate::Error::from)
    })?;
    let moved = (rows * w * (8 + 2)) as f64;
    let _ = writeln!(
        out,
        "moe act timing (SiluMul -> bf16, rows={rows} W={w}, {reps} reps, CUDA events): {:.1} us/run, {:.0} GB/s (h read + a written)",
        ms * 1e3,
        moved / (ms * 1e-3) / 1e9
    );
    drop((d_src, d_dst));

    let (t, k, h) = (8192usize, 8usize, 7168usize);
    let n = t * k;
    let c = MoeCombine::load(dev, h as u32)?;
    let d_y = dev
        .stream
        .alloc_zeros::<u8>(4 * n * h)
        .map_err(drv("cuMemAlloc"))?;
    let mut pos: Vec<i32> = (0..n as i32).collect();
    for i in (1..n).rev() {
        pos.swap(i, rng.below(i + 1));
    }
    let d_pos = up(dev, &pos)?;
    let weights: Vec<f32> = (0..n).map(|_| uniform(rng, 0.0, 1.0)).collect();
    let d_w = up(dev, &weights)?;
    let mut d_out = dev
        .stream
        .alloc_zeros::<u16>(t * h)
        .map_err(drv("cuMemAlloc"))?;
    let ms = time(dev, reps, || {
        // SAFETY: one stream only; the sizes are checked by `combine`.
        unsafe { c.combine(dev, &d_y, &d_pos, &d_w, &mut d_out, t, k, n) }
            .map_err(crate::Error::from)
    })?;
    let moved = (n * h * 4 + t * h * 2) as f64;
    let _ = writeln!(
        out,
        "moe combine timing (T={t} k={k} H={h}, {reps} reps, CUDA events): {:.1} us/run, {:.0} GB/s (y read + out written)",
        ms * 1e3,
        moved / (ms * 1e-3) / 1e9
    );
    Ok(out)
}

/// The MoE activation and combine self-test: one line per case, the timing lines and a verdict;
/// `None` as the verdict without a GPU or off Hopper (the report then says SKIPPED).
pub fn selftest() -> Result<(String, Option<bool>)> {
    let mut out = String::new();
    let Some(dev) = hopper("MoE activation/combine self-test", &mut out) else {
        return Ok((out, None));
    };
    let seed = fresh_seed();
    let _ = writeln!(out, "moe act/combine seed {seed:#x}");
    let mut rng = Rng(seed);
    let mut all = true;
    for input in ActIn::ALL {
        for output in ActOut::ALL {
            for w in WIDTHS {
                for rows in ROWS {
                    let (ok, line) = act_case(&dev, input, output, w, rows, &mut rng)?;
                    all &= ok;
                    let _ = writeln!(out, "{line}");
                }
            }
        }
    }
    for (t, k, h) in [
        (1, 8, 7168),
        (37, 2, 2048),
        (300, 8, 8),
        (300, 1, 2048),
        (37, 8, 7168),
    ] {
        let (ok, line) = combine_case(&dev, t, k, h, &mut rng)?;
        all &= ok;
        let _ = writeln!(out, "{line}");
    }
    out.push_str(&timing(&dev, &mut rng)?);
    let _ = writeln!(
        out,
        "moe act/combine: {}",
        if all { "all ok" } else { "FAILED" }
    );
    Ok((out, Some(all)))
}
