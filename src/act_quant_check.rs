//! `moeforge selftest --gpu --gemm`, second half: the generated activation quantization to E4M3
//! (`codegen::gemm::act_quant`, per token and per 1x128 group) on the GPU, bit for bit against the
//! host reference (`codegen::gemm::reference::quantize_per_token` / `quantize_per_group128`, the
//! group scales transposed to the kernel's group-major layout). K in {128, 7168, 2112 (a short last
//! group)} x T in {1, 7, 513}, random finite bf16 from a fresh seed (printed): rows of zeros (with
//! negative zeros), of values in [-1, 1), of huge and of tiny (subnormal) values, of any finite
//! magnitude, and sparse rows with all-zero groups. The outputs are poisoned before each run. Then
//! both modes are timed at T = 8192, K = 7168.

use std::fmt::Write as _;

use crate::codegen::gemm::act_quant::{scales_group_major, Mode};
use crate::codegen::gemm::reference;
use crate::runtime::act_quant::ActQuant;
use crate::runtime::{drv, Device};
use crate::selftest_util::{fresh_seed, hopper, Rng};
use crate::Result;

/// The K of the checks.
const KS: [usize; 3] = [128, 7168, 2048 + 64];
/// The T of the checks.
const TS: [usize; 3] = [1, 7, 513];
/// The poison of the codes (an E4M3 NaN, which no finite input produces).
const CODE_POISON: u8 = 0x7F;
/// The poison of the scales (a NaN).
const SCALE_POISON: u32 = 0x7FC0_DEAD;

/// Row kinds, in the order the first rows of a test cycle through them.
const KINDS: usize = 7;

/// One row of `k` bf16 of kind `kind`: 0 zeros (some negative), 1 values in [-1, 1), 2 huge
/// (2^112 and up), 3 tiny (subnormal up to 2^-112), 4 any finite magnitude, 5 sparse (one value in
/// 50 from [-8, 8), so most 128-groups of a long row are all zero), 6 rounding ties: `448 * 2^e`
/// at the start of every 128-group (so both modes' scales are `2^e` and `x / s`, `x * (1/s)` are
/// exact) and elsewhere values of 5 significant bits from `2^(e-12)` to below `2^(e+8)`, many of
/// them exactly halfway between two E4M3 codes, normal and subnormal.
pub(crate) fn row(rng: &mut Rng, kind: usize, k: usize) -> Vec<u16> {
    let e = rng.below(21) as i32 - 10;
    (0..k)
        .map(|c| match kind {
            0 => {
                if rng.below(4) == 0 {
                    0x8000
                } else {
                    0
                }
            }
            1 => reference::bf16_from_f32(
                2.0 * (rng.next() >> 40) as f32 / (1u64 << 24) as f32 - 1.0,
            ),
            2 => rng.bf16_exp(0xEF..0xFF),
            3 => rng.bf16_exp(0..0x10),
            4 => rng.bf16_exp(0..0xFF),
            6 if c % 128 == 0 => reference::bf16_from_f32(448.0 * 2f32.powi(e)),
            6 => {
                let r = rng.next();
                let exp = (127 + e - 12 + rng.below(20) as i32) as u16;
                ((r & 1) as u16) << 15 | exp << 7 | ((r >> 8) & 0x78) as u16
            }
            _ => {
                if rng.below(50) == 0 {
                    rng.bf16_exp(0x70..0x83)
                } else {
                    0
                }
            }
        })
        .collect()
}

/// The host reference over row chunks on the machine's threads: codes `[t, k]` and scales in the
/// kernel's layout.
fn reference_parallel(mode: Mode, x: &[f32], t: usize, k: usize) -> Result<(Vec<u8>, Vec<f32>)> {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let per = t.div_ceil(threads).max(1);
    let parts: Vec<crate::codegen::Result<(Vec<u8>, Vec<f32>)>> = std::thread::scope(|sc| {
        let handles: Vec<_> = x
            .chunks(per * k)
            .map(|c| {
                sc.spawn(move || match mode {
                    Mode::PerToken => reference::quantize_per_token(c, k),
                    Mode::PerGroup128 => reference::quantize_per_group128(c, k),
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or(Err(crate::codegen::Error::Internal(
                    "a reference task panicked",
                )))
            })
            .collect()
    });
    let (mut q, mut s) = (Vec::with_capacity(t * k), Vec::new());
    for p in parts {
        let (pq, ps) = p?;
        q.extend(pq);
        s.extend(ps);
    }
    if mode == Mode::PerGroup128 {
        s = scales_group_major(&s, t, k)?;
    }
    Ok((q, s))
}

fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::PerToken => "per token",
        Mode::PerGroup128 => "per 1x128 group",
    }
}

/// One `(mode, K, T)` on the device: the report line and whether every code and scale matched.
fn run_case(dev: &Device, mode: Mode, k: usize, t: usize, rng: &mut Rng) -> Result<(bool, String)> {
    let offset = rng.below(KINDS);
    let mut x = Vec::with_capacity(t * k);
    for r in 0..t {
        let kind = if r < KINDS {
            (r + offset) % KINDS
        } else {
            rng.below(KINDS)
        };
        x.extend(row(rng, kind, k));
    }
    let xf: Vec<f32> = x.iter().map(|b| reference::bf16_to_f32(*b)).collect();
    let (want_q, want_s) = reference_parallel(mode, &xf, t, k)?;

    let aq = ActQuant::load(dev, mode, k as u32)?;
    let st = &dev.stream;
    let bytes: Vec<u8> = x.iter().flat_map(|b| b.to_le_bytes()).collect();
    let dx = st.clone_htod(&bytes).map_err(drv("cuMemcpyHtoD"))?;
    let mut dq = st
        .clone_htod(&vec![CODE_POISON; t * k])
        .map_err(drv("cuMemcpyHtoD"))?;
    let ns = aq.launch().scales_len(t);
    let mut ds = st
        .clone_htod(&vec![f32::from_bits(SCALE_POISON); ns])
        .map_err(drv("cuMemcpyHtoD"))?;
    // SAFETY: one stream only; the sizes are checked by `run`.
    unsafe { aq.run(dev, &dx, &mut dq, &mut ds, t) }?;
    dev.sync()?;
    let q = st.clone_dtoh(&dq).map_err(drv("cuMemcpyDtoH"))?;
    let s = st.clone_dtoh(&ds).map_err(drv("cuMemcpyDtoH"))?;

    let bad_q: Vec<usize> = (0..q.len()).filter(|&i| q[i] != want_q[i]).collect();
    let bad_s: Vec<usize> = (0..s.len())
        .filter(|&i| s[i].to_bits() != want_s[i].to_bits())
        .collect();
    let ok =
        bad_q.is_empty() && bad_s.is_empty() && q.len() == want_q.len() && s.len() == want_s.len();
    let mut line = format!(
        "act quant e4m3 {} K={k} T={t}: code mismatches {}/{}, scale mismatches {}/{}: {}",
        mode_name(mode),
        bad_q.len(),
        q.len(),
        bad_s.len(),
        s.len(),
        if ok { "ok" } else { "FAIL" }
    );
    if let Some(&i) = bad_q.first() {
        let _ = write!(
            line,
            " (first code: row {} col {}: x {:e} ({:#06x}), gpu {:#04x}, host {:#04x})",
            i / k,
            i % k,
            xf[i],
            x[i],
            q[i],
            want_q[i]
        );
    }
    if let Some(&i) = bad_s.first() {
        let _ = write!(
            line,
            " (first scale {i}: gpu {:e} ({:#010x}), host {:e} ({:#010x}))",
            s[i],
            s[i].to_bits(),
            want_s[i],
            want_s[i].to_bits()
        );
    }
    Ok((ok, line))
}

/// Both modes timed at `T = 8192, K = 7168` with CUDA events: the report lines.
fn timing(dev: &Device, rng: &mut Rng) -> Result<String> {
    let (t, k) = (8192usize, 7168usize);
    let st = &dev.stream;
    let bytes: Vec<u8> = row(rng, 1, t * k)
        .iter()
        .flat_map(|b| b.to_le_bytes())
        .collect();
    let dx = st.clone_htod(&bytes).map_err(drv("cuMemcpyHtoD"))?;
    let mut dq = st.alloc_zeros::<u8>(t * k).map_err(drv("cuMemAlloc"))?;
    let mut out = String::new();
    for mode in [Mode::PerToken, Mode::PerGroup128] {
        let aq = ActQuant::load(dev, mode, k as u32)?;
        let ns = aq.launch().scales_len(t);
        let mut ds = st.alloc_zeros::<f32>(ns).map_err(drv("cuMemAlloc"))?;
        // SAFETY: one stream only; the sizes are checked by `run`.
        unsafe { aq.run(dev, &dx, &mut dq, &mut ds, t) }?;
        let reps = 20;
        let ev = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let a = st.record_event(ev).map_err(drv("cuEventRecord"))?;
        for _ in 0..reps {
            // SAFETY: as above.
            unsafe { aq.run(dev, &dx, &mut dq, &mut ds, t) }?;
        }
        let b = st.record_event(ev).map_err(drv("cuEventRecord"))?;
        let ms = a.elapsed_ms(&b).map_err(drv("cuEventElapsedTime"))? as f64 / reps as f64;
        let moved = (t * k * 3 + ns * 4) as f64;
        let _ = writeln!(
            out,
            "act quant e4m3 {} timing (T={t} K={k}, {reps} reps, CUDA events): {:.1} us/launch, {:.0} GB/s (2 bytes read + 1 written per element)",
            mode_name(mode),
            ms * 1e3,
            moved / (ms * 1e-3) / 1e9
        );
    }
    Ok(out)
}

/// The activation-quantization self-test: one line per `(mode, K, T)`, the timing lines and a
/// verdict; `None` as the verdict without a GPU or off Hopper (the report then says SKIPPED).
pub fn selftest() -> Result<(String, Option<bool>)> {
    let mut out = String::new();
    let Some(dev) = hopper("activation-quantization self-test", &mut out) else {
        return Ok((out, None));
    };
    let seed = fresh_seed();
    let _ = writeln!(out, "act quant seed {seed:#x}");
    let mut rng = Rng(seed);
    let mut all = true;
    for mode in [Mode::PerToken, Mode::PerGroup128] {
        for k in KS {
            for t in TS {
                let (ok, line) = run_case(&dev, mode, k, t, &mut rng)?;
                all &= ok;
                let _ = writeln!(out, "{line}");
            }
        }
    }
    out.push_str(&timing(&dev, &mut rng)?);
    let _ = writeln!(
        out,
        "{}",
        if all {
            "act quant e4m3: all codes and scales bit-exact"
        } else {
            "act quant e4m3: FAILED"
        }
    );
    Ok((out, Some(all)))
}

/// Two self-tests' verdicts together: false if either failed, true if one passed and none failed,
/// `None` if both skipped.
pub fn both(a: Option<bool>, b: Option<bool>) -> Option<bool> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x && y),
        (x, None) | (None, x) => x,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_finite_and_of_their_kind() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for kind in 0..KINDS {
            let r = row(&mut rng, kind, 4096);
            assert!(r.iter().all(|b| b & 0x7F80 != 0x7F80), "kind {kind}");
            let f: Vec<f32> = r.iter().map(|b| reference::bf16_to_f32(*b)).collect();
            let amax = f.iter().fold(0f32, |m, v| m.max(v.abs()));
            match kind {
                0 => {
                    assert_eq!(amax, 0.0);
                    assert!(r.contains(&0x8000));
                }
                1 => assert!(amax <= 1.0),
                2 => assert!(amax > 1e34),
                3 => assert!(amax < 1e-33 && f.iter().any(|v| v.is_subnormal())),
                5 => assert!(f.iter().filter(|v| **v != 0.0).count() < 300),
                6 => {
                    // Every group's amax is its first value, 448 * 2^e: the scales are powers of 2.
                    for g in f.chunks(128) {
                        let a = g.iter().fold(0f32, |m, v| m.max(v.abs()));
                        assert_eq!(a, g[0]);
                        assert_eq!((a / 448.0).log2().fract(), 0.0);
                    }
                }
                _ => {}
            }
        }
    }

    #[test]
    fn the_parallel_reference_is_the_reference() {
        let mut rng = Rng(0x1234_5678_9abc_def1);
        let (t, k) = (37, 2112);
        let x: Vec<f32> = (0..t)
            .flat_map(|r| row(&mut rng, r % KINDS, k))
            .map(reference::bf16_to_f32)
            .collect();
        for mode in [Mode::PerToken, Mode::PerGroup128] {
            let want = crate::codegen::gemm::act_quant::reference(mode, &x, k).unwrap();
            assert_eq!(reference_parallel(mode, &x, t, k).unwrap(), want);
        }
    }

    #[test]
    fn verdicts_combine() {
        assert_eq!(both(None, None), None);
        assert_eq!(both(Some(true), None), Some(true));
        assert_eq!(both(None, Some(false)), Some(false));
        assert_eq!(both(Some(true), Some(false)), Some(false));
        assert_eq!(both(Some(true), Some(true)), Some(true));
    }
}
