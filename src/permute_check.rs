//! `moeforge selftest --gpu --gemm`, third part: the generated MoE route + permute kernels
//! (`codegen::moe::permute`, run by `runtime::permute`) on the GPU against the host reference
//! (`codegen::moe::reference`), through its checker (exact slots, counts, offsets and error count;
//! each slot's rows as a multiset, since their order follows the device's atomics; each gathered
//! row equal to its token's row of `x`). Random routings from a fresh seed (printed): uniform and
//! skewed, T = 1 and T not a multiple of anything, top-k 1, 2 and 8, with the identity map and
//! with an EPLB map with replicas, out-of-range ids, R = 4096. The EPLB load counters are checked
//! after two runs (they accumulate). The outputs are poisoned before each run. The quantizing
//! scatter (`permute::Gather`: per token, per 1x128 group, static per slot) is checked the same
//! way, and each gathered row's E4M3 codes and scales bit for bit against the host quantizer of
//! its token's row (`act_quant::reference`, `quantize_per_tensor` with the slot's scale), on rows
//! of every kind of `act_quant_check` (zeros, tiny, huge, sparse, rounding ties). Then timing lines
//! at T = 1 and T = 8192 (H = 7168, k = 8, E = 32), bf16 and per 1x128 group.

use std::fmt::Write as _;

use crate::codegen::gemm::act_quant::{self, Mode};
use crate::codegen::gemm::reference as gemm_ref;
use crate::codegen::moe::permute::Gather;
use crate::codegen::moe::reference::{self, Map, Permuted};
use crate::runtime::permute::{Buffers, Permute};
use crate::runtime::{drv, Device};
use crate::selftest_util::{fresh_seed, hopper, Rng};
use crate::Result;

/// How the ids are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ids {
    /// Uniform over the experts.
    Uniform,
    /// Most items on a few experts (`E * u^4`).
    Skewed,
    /// Uniform, with about one item in 10 out of range (`-1`, `E`, `E + 1000`, `i32::MIN`).
    OutOfRange,
}

/// One case of the check.
struct Case {
    t: usize,
    k: usize,
    experts: usize,
    /// Physical slots (`experts` for the identity map).
    slots: usize,
    hidden: usize,
    ids: Ids,
    gather: Gather,
}

/// An EPLB map of `experts` on `slots` slots: every expert once on a shuffled slot, the other
/// slots replicas of random experts.
fn replicated_map(rng: &mut Rng, experts: usize, slots: usize) -> Map {
    let mut phy2log: Vec<usize> = (0..slots)
        .map(|p| if p < experts { p } else { rng.below(experts) })
        .collect();
    for i in (1..slots).rev() {
        phy2log.swap(i, rng.below(i + 1));
    }
    let mut replicas = vec![Vec::new(); experts];
    for (p, &e) in phy2log.iter().enumerate() {
        replicas[e].push(p as i32);
    }
    let max_replicas = replicas.iter().map(Vec::len).max().unwrap_or(1);
    let mut log2phy = vec![-1; experts * max_replicas];
    for (e, r) in replicas.iter().enumerate() {
        log2phy[e * max_replicas..e * max_replicas + r.len()].copy_from_slice(r);
    }
    Map {
        log2phy,
        logcnt: replicas.iter().map(|r| r.len() as i32).collect(),
        max_replicas,
        slots,
    }
}

fn draw_ids(rng: &mut Rng, n: usize, experts: usize, ids: Ids) -> Vec<i32> {
    (0..n)
        .map(|_| match ids {
            Ids::Uniform => rng.below(experts) as i32,
            Ids::Skewed => {
                let u = (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
                ((experts as f64 * u.powi(4)) as usize).min(experts - 1) as i32
            }
            Ids::OutOfRange => {
                if rng.below(10) == 0 {
                    [-1, experts as i32, experts as i32 + 1000, i32::MIN][rng.below(4)]
                } else {
                    rng.below(experts) as i32
                }
            }
        })
        .collect()
}

/// Device buffers of one routing.
struct Dev {
    ids: cudarc::driver::CudaSlice<i32>,
    log2phy: cudarc::driver::CudaSlice<i32>,
    logcnt: cudarc::driver::CudaSlice<i32>,
    x: cudarc::driver::CudaSlice<u16>,
    slot: cudarc::driver::CudaSlice<i32>,
    counts: cudarc::driver::CudaSlice<u32>,
    load: cudarc::driver::CudaSlice<u32>,
    errors: cudarc::driver::CudaSlice<u32>,
    offsets: cudarc::driver::CudaSlice<i32>,
    cursor: cudarc::driver::CudaSlice<u32>,
    row_of: cudarc::driver::CudaSlice<i32>,
    xs: cudarc::driver::CudaSlice<u8>,
    pos_of: cudarc::driver::CudaSlice<i32>,
    /// The quantizing forms' scales and static scales per slot.
    scales: cudarc::driver::CudaSlice<f32>,
    statics: cudarc::driver::CudaSlice<f32>,
    gather: Gather,
}

impl Dev {
    fn new(
        dev: &Device,
        ids: &[i32],
        map: &Map,
        x: &[u16],
        hidden: usize,
        gather: Gather,
        statics: &[f32],
    ) -> Result<Dev> {
        let st = &dev.stream;
        let up_i = |v: &[i32]| st.clone_htod(v).map_err(drv("cuMemcpyHtoD"));
        let up_u = |v: &[u32]| st.clone_htod(v).map_err(drv("cuMemcpyHtoD"));
        let n = ids.len().max(1);
        let r = map.slots;
        Ok(Dev {
            ids: up_i(ids)?,
            log2phy: up_i(&map.log2phy)?,
            logcnt: up_i(&map.logcnt)?,
            x: st.clone_htod(x).map_err(drv("cuMemcpyHtoD"))?,
            slot: up_i(&vec![0x5EED; n])?,
            // Zero on entry (the permute's precondition); `errors[1]` poisoned.
            counts: up_u(&vec![0; r])?,
            load: up_u(&vec![0; r])?,
            errors: up_u(&[0, 77])?,
            offsets: up_i(&vec![-7; r + 1])?,
            cursor: up_u(&vec![0xBAD; r])?,
            row_of: up_i(&vec![-9; n])?,
            pos_of: up_i(&vec![-5; n])?,
            xs: st
                .clone_htod(&vec![0xFFu8; gather.row_bytes(hidden) * n])
                .map_err(drv("cuMemcpyHtoD"))?,
            scales: st
                .clone_htod(&vec![f32::NAN; gather.scales_len(n, hidden).max(1)])
                .map_err(drv("cuMemcpyHtoD"))?,
            statics: st
                .clone_htod(if statics.is_empty() {
                    &[0.0f32][..]
                } else {
                    statics
                })
                .map_err(drv("cuMemcpyHtoD"))?,
            gather,
        })
    }

    /// # Safety
    /// One stream only (as [`Permute::run`]).
    unsafe fn run(
        &mut self,
        dev: &Device,
        p: &Permute,
        t: usize,
        k: usize,
        map: &Map,
    ) -> Result<()> {
        let b = Buffers {
            topk_ids: &self.ids,
            log2phy: &self.log2phy,
            logcnt: &self.logcnt,
            x: &self.x,
            slot: &mut self.slot,
            counts: &mut self.counts,
            load: &mut self.load,
            errors: &mut self.errors,
            offsets: &mut self.offsets,
            cursor: &mut self.cursor,
            row_of: &mut self.row_of,
            xs: &mut self.xs,
            scales: (self.gather != Gather::Bf16).then_some(&mut self.scales),
            static_scales: (self.gather == Gather::Static).then_some(&self.statics),
            pos_of: &mut self.pos_of,
        };
        // SAFETY: the caller's promise: one stream only; sizes are checked by `run`.
        unsafe { p.run(dev, b, t, k, map.experts(), map.max_replicas) }?;
        Ok(())
    }

    /// The run's outputs in the reference's form, the load counters, and the checks the reference
    /// does not make: `counts` and `errors[0]` left zero for the next run, and `pos_of` the inverse
    /// of `row_of` (`-1` for a skipped item).
    fn read(
        &self,
        dev: &Device,
        n: usize,
    ) -> Result<(Permuted, Vec<u32>, std::result::Result<(), String>)> {
        let bf16 = self.gather == Gather::Bf16;
        let st = &dev.stream;
        dev.sync()?;
        let get_i =
            |b: &cudarc::driver::CudaSlice<i32>| st.clone_dtoh(b).map_err(drv("cuMemcpyDtoH"));
        let get_u =
            |b: &cudarc::driver::CudaSlice<u32>| st.clone_dtoh(b).map_err(drv("cuMemcpyDtoH"));
        let mut slot = get_i(&self.slot)?;
        slot.truncate(n);
        let errors = get_u(&self.errors)?;
        let offsets = get_i(&self.offsets)?;
        let row_of = get_i(&self.row_of)?;
        let pos_of = get_i(&self.pos_of)?;
        let left = get_u(&self.counts)?;
        let extra = if let Some(s) = left.iter().position(|&c| c != 0) {
            Err(format!("counts[{s}] left {} (not zero)", left[s]))
        } else if errors.first() != Some(&0) {
            Err(format!("errors[0] left {:?} (not zero)", errors.first()))
        } else {
            (0..n)
                .find(|&i| {
                    let p = pos_of[i];
                    if slot[i] < 0 {
                        p != -1
                    } else {
                        usize::try_from(p)
                            .ok()
                            .and_then(|p| row_of.get(p))
                            .is_none_or(|&r| r != i as i32)
                    }
                })
                .map_or(Ok(()), |i| {
                    Err(format!("pos_of[{i}] = {} is not its row", pos_of[i]))
                })
        };
        // The counts are the offsets' differences (the device's are zero again).
        let counts = offsets
            .windows(2)
            .map(|w| w[1].wrapping_sub(w[0]) as u32)
            .collect();
        Ok((
            Permuted {
                slot,
                counts,
                offsets,
                row_of,
                // (A quantizing run's codes are checked by `check_codes`.)
                xs: if bf16 {
                    st.clone_dtoh(&self.xs)
                        .map_err(drv("cuMemcpyDtoH"))?
                        .chunks_exact(2)
                        .map(|c| u16::from_le_bytes([c[0], c[1]]))
                        .collect()
                } else {
                    Vec::new()
                },
                errors: errors.get(1).copied().unwrap_or(u32::MAX),
            },
            get_u(&self.load)?,
            extra,
        ))
    }
}

/// The quantized rows the device wrote, read back: codes `[n, H]` and scales.
struct Codes {
    q: Vec<u8>,
    scales: Vec<f32>,
}

/// Each of the first `offsets[R]` gathered rows against the host quantizer of its token's row of
/// `x`: codes and scales bit for bit (per group, scale `g` of row `p` at `g * n + p`). Returns the
/// first difference.
#[allow(clippy::too_many_arguments)]
fn check_codes(
    gather: Gather,
    got: &Codes,
    perm: &Permuted,
    x: &[u16],
    h: usize,
    k: usize,
    n: usize,
    statics: &[f32],
) -> std::result::Result<(), String> {
    let total = perm.offsets.last().copied().unwrap_or(0).max(0) as usize;
    for p in 0..total {
        let i = perm.row_of[p] as usize;
        let t = i / k;
        let row: Vec<f32> = x[t * h..(t + 1) * h]
            .iter()
            .map(|&b| gemm_ref::bf16_to_f32(b))
            .collect();
        let (want_q, want_s) = match gather {
            Gather::PerToken => act_quant::reference(Mode::PerToken, &row, h),
            Gather::Group128 => act_quant::reference(Mode::PerGroup128, &row, h),
            Gather::Static => {
                let s = statics[perm.slot[i] as usize];
                Ok((gemm_ref::quantize_per_tensor(&row, s), vec![s]))
            }
            Gather::Bf16 => return Ok(()),
        }
        .map_err(|e| e.to_string())?;
        let q = &got.q[p * h..(p + 1) * h];
        if let Some(c) = (0..h).find(|&c| q[c] != want_q[c]) {
            return Err(format!(
                "row {p} (item {i}, token {t}) column {c}: code {:#04x}, want {:#04x}",
                q[c], want_q[c]
            ));
        }
        for (g, want) in want_s.iter().enumerate() {
            let have = got.scales[g * n + p];
            if have.to_bits() != want.to_bits() {
                return Err(format!(
                    "row {p} (item {i}, token {t}) scale {g}: {have:e}, want {want:e}"
                ));
            }
        }
    }
    Ok(())
}

/// One case: the report line and whether it passed.
fn run_case(dev: &Device, c: &Case, rng: &mut Rng) -> Result<(bool, String)> {
    let map = if c.slots == c.experts {
        Map::identity(c.experts)
    } else {
        replicated_map(rng, c.experts, c.slots)
    };
    let n = c.t * c.k;
    let ids = draw_ids(rng, n, c.experts, c.ids);
    // Any bits for a copy; finite rows of every kind for the quantizers (their contract).
    let x: Vec<u16> = if c.gather == Gather::Bf16 {
        (0..c.t * c.hidden).map(|_| rng.next() as u16).collect()
    } else {
        (0..c.t)
            .flat_map(|_| {
                let kind = rng.below(7);
                crate::act_quant_check::row(rng, kind, c.hidden)
            })
            .collect()
    };
    // Static scales per slot: positive, from 2^-12 to about 2^4, most not powers of two.
    let statics: Vec<f32> = if c.gather == Gather::Static {
        (0..c.slots)
            .map(|_| 2f32.powf(rng.below(1600) as f32 / 100.0 - 12.0))
            .collect()
    } else {
        Vec::new()
    };
    let mut want_load = vec![0u32; c.slots];
    let want = reference::permute(&x, c.hidden, &ids, c.k, &map, &mut want_load)?;
    let p = Permute::load(dev, c.hidden as u32, c.slots as u32, c.gather)?;
    let mut d = Dev::new(dev, &ids, &map, &x, c.hidden, c.gather, &statics)?;
    let check = |d: &Dev| -> Result<(std::result::Result<(), String>, Vec<u32>)> {
        let (mut got, load, extra) = d.read(dev, n)?;
        let codes = if c.gather == Gather::Bf16 {
            Ok(())
        } else {
            let st = &dev.stream;
            let got_codes = Codes {
                q: st.clone_dtoh(&d.xs).map_err(drv("cuMemcpyDtoH"))?,
                scales: st.clone_dtoh(&d.scales).map_err(drv("cuMemcpyDtoH"))?,
            };
            let r = check_codes(c.gather, &got_codes, &got, &x, c.hidden, c.k, n, &statics);
            // The structural check below then sees each row's token's bf16 row (the codes were
            // checked against it).
            got.xs = (0..n)
                .flat_map(|p| {
                    let i = got.row_of.get(p).copied().unwrap_or(-1);
                    let t = usize::try_from(i).map_or(usize::MAX, |i| i / c.k);
                    (0..c.hidden).map(move |col| (t, col))
                })
                .map(|(t, col)| x.get(t * c.hidden + col).copied().unwrap_or(0))
                .collect();
            r
        };
        let r = reference::check(&want, &got, &x, c.hidden, c.k)
            .and(extra)
            .and(codes);
        Ok((r, load))
    };
    // SAFETY: one stream only.
    unsafe { d.run(dev, &p, c.t, c.k, &map) }?;
    let (first, _) = check(&d)?;
    // A second run: same outputs, load counters doubled.
    // SAFETY: one stream only.
    unsafe { d.run(dev, &p, c.t, c.k, &map) }?;
    let (second, load) = check(&d)?;
    let twice: Vec<u32> = want_load.iter().map(|l| 2 * l).collect();
    let load_ok = load == twice;
    let ok = first.is_ok() && second.is_ok() && load_ok;
    let mut line = format!(
        "moe permute T={} k={} E={} R={} H={} {:?}{}{}{}: {} rows, {} errors: {}",
        c.t,
        c.k,
        c.experts,
        c.slots,
        c.hidden,
        c.ids,
        match c.gather {
            Gather::Bf16 => String::new(),
            g => format!(" e4m3 {g:?}"),
        },
        if c.slots == c.experts { "" } else { " eplb" },
        if p.launch().small(n as u32) {
            " (small path)"
        } else {
            ""
        },
        want.row_of.len(),
        want.errors,
        if ok { "ok" } else { "FAIL" }
    );
    for (what, r) in [("run 1", first), ("run 2", second)] {
        if let Err(why) = r {
            let _ = write!(line, " ({what}: {why})");
        }
    }
    if !load_ok {
        let s = (0..c.slots).find(|&s| load[s] != twice[s]).unwrap_or(0);
        let _ = write!(
            line,
            " (load counters after two runs: slot {s} has {}, want {})",
            load.get(s).copied().unwrap_or(0),
            twice[s]
        );
    }
    Ok((ok, line))
}

/// Timed at `T = 1` and `T = 8192` (H = 7168, k = 8, E = 32, identity map) with CUDA events: the
/// report lines (the whole run: at T = 1 the small path's two kernels, at T = 8192 three; no
/// memset).
fn timing(dev: &Device, rng: &mut Rng) -> Result<String> {
    let (h, k, e) = (7168usize, 8usize, 32usize);
    let map = Map::identity(e);
    let mut out = String::new();
    for (gather, t) in [
        (Gather::Bf16, 1usize),
        (Gather::Bf16, 8192),
        (Gather::Group128, 1),
        (Gather::Group128, 8192),
    ] {
        let p = Permute::load(dev, h as u32, e as u32, gather)?;
        let ids = draw_ids(rng, t * k, e, Ids::Uniform);
        let x: Vec<u16> = (0..t * h).map(|_| rng.bf16()).collect();
        let mut d = Dev::new(dev, &ids, &map, &x, h, gather, &[])?;
        // SAFETY: one stream only.
        unsafe { d.run(dev, &p, t, k, &map) }?;
        let reps = 20;
        let st = &dev.stream;
        let ev = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let a = st.record_event(ev).map_err(drv("cuEventRecord"))?;
        for _ in 0..reps {
            // SAFETY: as above.
            unsafe { d.run(dev, &p, t, k, &map) }?;
        }
        let b = st.record_event(ev).map_err(drv("cuEventRecord"))?;
        let ms = a.elapsed_ms(&b).map_err(drv("cuEventElapsedTime"))? as f64 / reps as f64;
        // Rows (or codes and scales) written once per item; x read once per token by the
        // scatter (the earlier measure counted it once per item).
        let written = (t * k * gather.row_bytes(h) + 4 * gather.scales_len(t * k, h)) as f64;
        let moved = written + (2 * t * h) as f64;
        let per_item = written + (2 * t * k * h) as f64;
        let _ = writeln!(
            out,
            "moe permute timing (T={t} H={h} k={k} E={e}{}, {reps} reps, CUDA events): {:.1} us/run, {:.0} GB/s moved (x read once, rows written per item; {:.0} GB/s counting x once per item; targets: <= 10 us at T=1, >= 3000 GB/s at T >= 2048)",
            if gather == Gather::Bf16 { String::new() } else { format!(", e4m3 {gather:?}") },
            ms * 1e3,
            moved / (ms * 1e-3) / 1e9,
            per_item / (ms * 1e-3) / 1e9
        );
    }
    Ok(out)
}

/// The route + permute self-test: one line per case, the timing lines and a verdict; `None` as
/// the verdict without a GPU or off Hopper (the report then says SKIPPED).
pub fn selftest() -> Result<(String, Option<bool>)> {
    let mut out = String::new();
    let Some(dev) = hopper("MoE permute self-test", &mut out) else {
        return Ok((out, None));
    };
    let seed = fresh_seed();
    let _ = writeln!(out, "moe permute seed {seed:#x}");
    let mut rng = Rng(seed);
    let case = |t, k, experts, slots, hidden, ids| Case {
        t,
        k,
        experts,
        slots,
        hidden,
        ids,
        gather: Gather::Bf16,
    };
    let quant = |gather, t, k, experts, slots, hidden, ids| Case {
        gather,
        ..case(t, k, experts, slots, hidden, ids)
    };
    let cases = [
        case(1, 8, 32, 32, 7168, Ids::Uniform),
        case(1, 1, 32, 48, 512, Ids::Uniform),
        case(1000, 2, 32, 32, 7168, Ids::Uniform),
        case(777, 8, 32, 48, 512, Ids::Skewed),
        case(4099, 1, 256, 288, 256, Ids::Skewed),
        case(513, 8, 32, 40, 2056, Ids::OutOfRange),
        case(37, 2, 7, 7, 8, Ids::OutOfRange),
        case(300, 8, 4096, 4096, 64, Ids::Uniform),
        case(301, 8, 1000, 4096, 64, Ids::Skewed),
        // The small path's edges: 1024 items over 48 slots (two a thread of 512), 1032 (the
        // three kernels), 2048 over 4096 slots (two a thread of 1024), with ids out of range.
        case(128, 8, 32, 48, 512, Ids::Skewed),
        case(129, 8, 32, 48, 512, Ids::Skewed),
        case(256, 8, 4000, 4096, 64, Ids::OutOfRange),
        // Quantized on the fly: DeepSeek-V3's H (a short last group nowhere), Qwen3's, a short
        // last 128-group (H = 2056), the largest H, the small path and the three kernels, EPLB
        // replicas (static scales per slot), out-of-range ids.
        quant(Gather::Group128, 1, 8, 32, 32, 7168, Ids::Uniform),
        quant(Gather::Group128, 777, 8, 32, 48, 7168, Ids::Skewed),
        quant(Gather::Group128, 301, 2, 32, 40, 2056, Ids::OutOfRange),
        quant(Gather::Group128, 5, 8, 64, 64, 16384, Ids::Uniform),
        quant(Gather::PerToken, 1, 8, 128, 128, 2048, Ids::Uniform),
        quant(Gather::PerToken, 513, 8, 32, 40, 2056, Ids::OutOfRange),
        quant(Gather::PerToken, 64, 1, 8, 8, 8, Ids::Skewed),
        quant(Gather::PerToken, 3, 8, 64, 64, 16384, Ids::Uniform),
        quant(Gather::Static, 1, 8, 32, 48, 7168, Ids::Uniform),
        quant(Gather::Static, 1000, 2, 32, 48, 4096, Ids::Skewed),
        quant(Gather::Static, 129, 8, 32, 40, 2056, Ids::OutOfRange),
    ];
    let mut all = true;
    for c in &cases {
        let (ok, line) = run_case(&dev, c, &mut rng)?;
        all &= ok;
        let _ = writeln!(out, "{line}");
    }
    out.push_str(&timing(&dev, &mut rng)?);
    let _ = writeln!(
        out,
        "moe permute: {}",
        if all { "all ok" } else { "FAILED" }
    );
    Ok((out, Some(all)))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The quantizing scatter's host checker: the host quantizer's own codes and scales pass, one
    /// wrong code or scale fails, for every quantizing form.
    #[test]
    fn the_code_checker_accepts_the_reference_and_rejects_one_wrong_value() {
        let (t, k, e, h) = (5usize, 2usize, 4usize, 136usize);
        let mut rng = Rng(0x5EED_1234_0001);
        let ids: Vec<i32> = (0..t * k).map(|_| rng.below(e) as i32).collect();
        let x: Vec<u16> = (0..t)
            .flat_map(|r| crate::act_quant_check::row(&mut rng, r % 7, h))
            .collect();
        let map = Map::identity(e);
        let mut load = vec![0u32; e];
        let perm = reference::permute(&x, h, &ids, k, &map, &mut load).unwrap();
        let n = t * k;
        let statics = [0.5f32, 3.0, 0.01, 7.25];
        for gather in [Gather::PerToken, Gather::Group128, Gather::Static] {
            let mut codes = Codes {
                q: vec![0; n * h],
                scales: vec![0.0; gather.scales_len(n, h)],
            };
            for p in 0..n {
                let i = perm.row_of[p] as usize;
                let row: Vec<f32> = x[(i / k) * h..(i / k + 1) * h]
                    .iter()
                    .map(|&b| gemm_ref::bf16_to_f32(b))
                    .collect();
                let (q, s) = match gather {
                    Gather::PerToken => act_quant::reference(Mode::PerToken, &row, h).unwrap(),
                    Gather::Group128 => act_quant::reference(Mode::PerGroup128, &row, h).unwrap(),
                    _ => {
                        let s = statics[perm.slot[i] as usize];
                        (gemm_ref::quantize_per_tensor(&row, s), vec![s])
                    }
                };
                codes.q[p * h..(p + 1) * h].copy_from_slice(&q);
                for (g, v) in s.iter().enumerate() {
                    codes.scales[g * n + p] = *v;
                }
            }
            let check = |c: &Codes| check_codes(gather, c, &perm, &x, h, k, n, &statics);
            assert_eq!(check(&codes), Ok(()), "{gather:?}");
            let mut bad = Codes {
                q: codes.q.clone(),
                scales: codes.scales.clone(),
            };
            bad.q[n * h - 3] ^= 1;
            assert!(check(&bad).is_err(), "{gather:?}: a wrong code passed");
            let mut bad = Codes {
                q: codes.q.clone(),
                scales: codes.scales.clone(),
            };
            bad.scales[n - 1] *= 2.0;
            assert!(check(&bad).is_err(), "{gather:?}: a wrong scale passed");
        }
    }
}
