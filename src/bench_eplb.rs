//! `moeforge bench --gpu --eplb`: in-place EPLB rearrangement of a DeepSeek-V3 EP8 layer (32 local
//! experts, H=7168, I=2048) on one GPU, for every standard recipe: from a random placement to
//! another, every param of the move set, through the same `ParamStore::rearrange` the executor
//! uses. Counts two times the bytes of every slot whose expert changes (one read, one write),
//! divided by the time, against the device copy ceiling measured in the same run (a linear
//! device-to-device copy, [`linear_copy_tbps`]).

use std::fmt::Write as _;

use crate::kernels::STANDARD;
use crate::runtime::collective::SingleDevice;
use crate::runtime::moves::{MovePlan, SlotMap};
use crate::runtime::store::{DeviceStorage, ParamStore};
use crate::{Error, Result};

/// The copy ceiling of the H200 (bytes read + written per second), ../shared/ANCHORS.md, re-measured
/// by the anchors in the same `scripts/gpu-check` call. The report's percentages are of the
/// ceiling measured on the card at hand ([`linear_copy_tbps`]); this figure is printed beside it.
pub const COPY_CEILING_TBPS: f64 = 4.27;

/// Bytes of the linear copy that measures the ceiling (1 GiB each way).
const CEILING_BYTES: usize = 1 << 30;

/// The device's linear copy rate (TB/s, bytes read + written): `cuMemcpyDtoD` of
/// [`CEILING_BYTES`], the best of five (the rearrangements' figures are means), timed like the
/// rearrangements (host wall time around the
/// copy and its synchronisation).
pub fn linear_copy_tbps(dev: &crate::runtime::Device) -> Result<f64> {
    let d = crate::runtime::drv::<cudarc::driver::DriverError>;
    let src = dev
        .stream
        .alloc_zeros::<u8>(CEILING_BYTES)
        .map_err(d("cuMemAlloc"))?;
    let mut dst = dev
        .stream
        .alloc_zeros::<u8>(CEILING_BYTES)
        .map_err(d("cuMemAlloc"))?;
    dev.stream
        .memcpy_dtod(&src, &mut dst)
        .map_err(d("cuMemcpyDtoD"))?;
    dev.sync().map_err(Error::from)?;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t0 = std::time::Instant::now();
        dev.stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(d("cuMemcpyDtoD"))?;
        dev.sync().map_err(Error::from)?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(2.0 * CEILING_BYTES as f64 / best / 1e12)
}

/// A shuffled permutation of `n` (xorshift, seeded).
fn shuffle(n: usize, seed: &mut u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    for k in (1..n).rev() {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        v.swap(k, (*seed % (k as u64 + 1)) as usize);
    }
    v
}

/// Run the benchmark: `reps` timed rearrangements per recipe. `progress` sees each finished line
/// of the report as it comes (the report itself is returned whole).
pub fn run(
    reps: usize,
    nccl_path: Option<&std::path::Path>,
    progress: &mut dyn FnMut(&str),
) -> Result<String> {
    let mut out = String::new();
    let dev = match crate::gpu::open() {
        Ok(d) => d,
        Err(why) => {
            let _ = writeln!(out, "SKIPPED: the EPLB benchmark needs a CUDA GPU ({why})");
            return Ok(out);
        }
    };
    let (e, h, i) = (32usize, 7168, 2048);
    let ceiling = linear_copy_tbps(&dev)?;
    let _ = writeln!(
        out,
        "EPLB rearrangement on {} (one GPU): DeepSeek-V3 EP8 layer, E={e} local slots, H={h}, I={i}; random placement -> random placement, every param of the move set; bandwidth = 2 x bytes of changed slots / time; % ceil = of this card's linear device copy, measured here: {ceiling:.3} TB/s (cuMemcpyDtoD of 1 GiB, best of 5, against the rearrangements' means; the H200's anchor is {COPY_CEILING_TBPS} TB/s)",
        dev.name
    );
    use crate::runtime::copy_batch::Flavour;
    use crate::runtime::copy_kernel::{CopyKernel, Form, DEFAULT_FORM};
    // memcpy, then the copy-list kernel in the default form (large params first, small ones on
    // side streams of their own; every launch on the main stream; small params first) and in the
    // batched forms.
    let batch = |flavour| {
        Some(Form::Batch {
            flavour,
            resident: 2,
        })
    };
    // (name, form, small params on side streams, large params first)
    let forms: [(&str, Option<Form>, bool, bool); 6] = [
        ("memcpy", None, true, true),
        ("columns", Some(DEFAULT_FORM), true, true),
        ("one stream", Some(DEFAULT_FORM), false, true),
        ("small first", Some(DEFAULT_FORM), true, false),
        ("cp.async", batch(Flavour::CpAsync), true, true),
        ("bulk", batch(Flavour::Bulk), true, true),
    ];
    let mut head = format!(
        "{:<16} {:>8} {:>8} {:>9}",
        "recipe", "MB/slot", "changed", "moved GB"
    );
    for (name, ..) in &forms {
        let _ = write!(
            head,
            " | {:>14} {:>8} {:>7}",
            format!("{name} ms"),
            "TB/s",
            "% ceil"
        );
    }
    // The copy-list kernel on its own first, against its host simulation (a short check of every
    // form before the long runs).
    let _ = writeln!(out, "copy-list kernel on its own:");
    out.push_str(&crate::runtime::copy_kernel::gpu_check(&dev, progress).map_err(Error::from)?);
    let _ = writeln!(out, "\n{head}");
    let mut kernels = Vec::new();
    for (_, f, side, _) in &forms {
        kernels.push(match f {
            Some(f) => Some((
                std::sync::Arc::new(CopyKernel::load(&dev).map_err(Error::from)?.with_form(*f)),
                *side,
            )),
            None => None,
        });
    }
    // Per recipe, the host's share: the time until `rearrange` returns (everything queued).
    let mut enqueued = String::new();
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    for r in STANDARD {
        let info = crate::check_source(r.source, r.path, Some(&format!("E={e},H={h},I={i}")))
            .map_err(|d| Error::Usage(format!("{}: {d:?}", r.name)))?;
        let mut maps = vec![SlotMap::identity(e)];
        for _ in 0..reps.max(1) + 1 {
            maps.push(SlotMap::new(shuffle(e, &mut seed), e).map_err(Error::from)?);
        }
        let mut cols = Vec::new();
        let mut queues = Vec::new();
        let (mut per_slot, mut changed_avg, mut moved_avg) = (0usize, 0f64, 0f64);
        for (kernel, form) in kernels.iter().zip(&forms) {
            let m = info.module();
            let mut params = Vec::new();
            for mv in &info.move_set {
                let Some(t) = m.tensor(mv.param) else {
                    continue;
                };
                let bytes = info.bytes_per_expert(mv).unwrap_or(0) as usize * e;
                // Contents do not matter for the timing (copies are not data-dependent).
                let buf =
                    dev.stream
                        .alloc_zeros::<u8>(bytes.max(1))
                        .map_err(crate::runtime::drv::<cudarc::driver::DriverError>(
                            "cuMemAlloc",
                        ))?;
                let mut st = DeviceStorage::owned(buf, dev.stream.clone());
                if let Some((k, side)) = kernel {
                    st = st.with_copy_kernel(k.clone()).with_side_stream(*side);
                }
                params.push((t.name.clone(), st));
            }
            let mut store = ParamStore::new(&info, params)
                .map_err(Error::from)?
                .with_large_first(form.3);
            per_slot = store.bytes_per_slot();
            // Warm-up: the first move (allocations, first-touch).
            let plan = MovePlan::new(&maps[0], &maps[1], 1).map_err(Error::from)?;
            store.rearrange(&plan, &SingleDevice).map_err(Error::from)?;
            dev.sync().map_err(Error::from)?;
            let (mut secs, mut bytes, mut changed, mut queue) = (0f64, 0f64, 0usize, 0f64);
            for k in 1..maps.len() - 1 {
                let plan = MovePlan::new(&maps[k], &maps[k + 1], 1).map_err(Error::from)?;
                let t0 = std::time::Instant::now();
                store.rearrange(&plan, &SingleDevice).map_err(Error::from)?;
                queue += t0.elapsed().as_secs_f64();
                dev.sync().map_err(Error::from)?;
                secs += t0.elapsed().as_secs_f64();
                bytes += 2.0 * (plan.changed_slots() * per_slot) as f64;
                changed += plan.changed_slots();
            }
            let n = (maps.len() - 2) as f64;
            changed_avg = changed as f64 / n;
            moved_avg = bytes / n / 1e9;
            let tbps = bytes / secs / 1e12;
            queues.push(format!("{:.0}", queue / n * 1e6));
            cols.push(format!(
                "{:>14.3} {:>8.3} {:>6.1}%",
                secs / n * 1e3,
                tbps,
                100.0 * tbps / ceiling
            ));
        }
        let row = format!(
            "{:<16} {:>8.2} {:>8.1} {:>9.3} | {}",
            r.name,
            per_slot as f64 / 1e6,
            changed_avg,
            moved_avg,
            cols.join(" | ")
        );
        progress(&row);
        let _ = writeln!(out, "{row}");
        let _ = writeln!(enqueued, "{:<16} {}", r.name, queues.join(" / "));
    }
    let _ = writeln!(
        out,
        "(host wall time around each rearrangement including its synchronisation; torch's `param.copy_(param[perm])` is the anchor `eplb_rearrange_torch` in the same gpu-check call)"
    );
    let names: Vec<&str> = forms.iter().map(|f| f.0).collect();
    let _ = write!(
        out,
        "host time until `rearrange` returns (us; {}):\n{enqueued}",
        names.join(" / ")
    );
    async_overhead(&dev, &mut out, e, h, i, &mut seed)?;
    if crate::runtime::device::count().unwrap_or(0) >= 2 {
        let nccl = crate::runtime::nccl::Nccl::load(nccl_path).map_err(Error::from)?;
        crate::eplb_nccl::bandwidth(nccl, reps, &mut out)?;
    } else {
        let _ = writeln!(out, "\n(one GPU: the two-GPU EPLB bandwidth needs 2)");
    }
    Ok(out)
}

/// Async mode: a stream of stand-in forwards (each a 512 MiB device copy followed by a host sync,
/// as a decode step ends with the host reading its tokens) with a rearrangement of the bf16 layer staged on a side stream and swapped
/// in between two forwards, against the same forwards alone and against a synchronous
/// rearrangement between them.
fn async_overhead(
    dev: &crate::runtime::Device,
    out: &mut String,
    e: usize,
    h: usize,
    i: usize,
    seed: &mut u64,
) -> Result<()> {
    let d = crate::runtime::drv::<cudarc::driver::DriverError>;
    let r = crate::kernels::find("bf16").ok_or_else(|| Error::Usage("no bf16 recipe".into()))?;
    let info = crate::check_source(r.source, r.path, Some(&format!("E={e},H={h},I={i}")))
        .map_err(|x| Error::Usage(format!("bf16: {x:?}")))?;
    let m = info.module();
    let mut params = Vec::new();
    for mv in &info.move_set {
        let Some(t) = m.tensor(mv.param) else {
            continue;
        };
        let bytes = info.bytes_per_expert(mv).unwrap_or(0) as usize * e;
        let buf = dev
            .stream
            .alloc_zeros::<u8>(bytes)
            .map_err(d("cuMemAlloc"))?;
        params.push((
            t.name.clone(),
            DeviceStorage::owned(buf, dev.stream.clone()),
        ));
    }
    let mut store = ParamStore::new(&info, params).map_err(Error::from)?;
    let src = dev
        .stream
        .alloc_zeros::<u8>(1 << 29)
        .map_err(d("cuMemAlloc"))?;
    let mut dst = dev
        .stream
        .alloc_zeros::<u8>(1 << 29)
        .map_err(d("cuMemAlloc"))?;
    let side = dev.ctx.new_stream().map_err(d("cuStreamCreate"))?;
    let steps = 60usize;
    let forward = |dst: &mut cudarc::driver::CudaSlice<u8>| {
        dev.stream.memcpy_dtod(&src, dst).map_err(d("cuMemcpyDtoD"))
    };
    // Each mode: total time and the longest step (what a token's latency sees).
    let mut step_times = |mode: u8,
                          store: &mut ParamStore<DeviceStorage>,
                          map: &SlotMap,
                          next: &SlotMap|
     -> Result<(f64, f64, Option<usize>, u64)> {
        let plan = MovePlan::new(map, next, 1).map_err(Error::from)?;
        forward(&mut dst)?;
        dev.sync().map_err(Error::from)?;
        let (mut total, mut worst) = (0f64, 0f64);
        let mut staged = None;
        let (mut swapped_at, mut staged_bytes) = (None, 0u64);
        for k in 0..steps {
            let t0 = std::time::Instant::now();
            forward(&mut dst)?;
            // A serving step ends with the host reading its results.
            dev.sync().map_err(Error::from)?;
            match mode {
                1 if k == 10 => {
                    store.rearrange(&plan, &SingleDevice).map_err(Error::from)?;
                    dev.sync().map_err(Error::from)?;
                }
                2 if k == 10 => {
                    let st = store.stage(&plan, &side).map_err(Error::from)?;
                    staged_bytes = st.staged_bytes();
                    staged = Some(st);
                }
                2 if staged.as_ref().is_some_and(|s| s.is_ready()) => {
                    if let Some(s) = staged.take() {
                        store.commit(s).map_err(Error::from)?;
                        swapped_at = Some(k);
                    }
                }
                _ => {}
            }
            let dt = t0.elapsed().as_secs_f64();
            total += dt;
            worst = worst.max(dt);
        }
        if let Some(s) = staged.take() {
            store.commit(s).map_err(Error::from)?;
            dev.sync().map_err(Error::from)?;
            swapped_at = Some(steps);
        }
        Ok((total, worst, swapped_at, staged_bytes))
    };
    let a = SlotMap::identity(e);
    let b = SlotMap::new(shuffle(e, seed), e).map_err(Error::from)?;
    let c = SlotMap::new(shuffle(e, seed), e).map_err(Error::from)?;
    let alone = step_times(0, &mut store, &a, &a)?;
    let sync = step_times(1, &mut store, &a, &b)?;
    let first = step_times(2, &mut store, &b, &c)?;
    let d = SlotMap::new(shuffle(e, seed), e).map_err(Error::from)?;
    let asynch = step_times(2, &mut store, &c, &d)?;
    let changed = MovePlan::new(&c, &d, 1)
        .map_err(Error::from)?
        .changed_slots();
    let ms = |x: f64| x * 1e3;
    let _ = writeln!(
        out,
        "\nasync mode (bf16 layer, {changed} changed slots; the next placement built in a new {:.2} GB buffer on a side stream and swapped in by pointer), {steps} stand-in forwards (512 MiB device copy + host sync, {:.3} ms each alone):\n  alone: {:.2} ms in all, longest step {:.3} ms\n  synchronous rearrangement after step 10: {:.2} ms in all (+{:.2}), longest step {:.3} ms (the stall)\n  async, staged from step 10, swapped in after step {}: {:.2} ms in all (+{:.2}), longest step {:.3} ms (steady state: the staging buffer is the spare the previous swap-in left; the first async move, which allocates it: longest step {:.3} ms)",
        asynch.3 as f64 / 1e9,
        ms(alone.0) / steps as f64,
        ms(alone.0),
        ms(alone.1),
        ms(sync.0),
        ms(sync.0 - alone.0),
        ms(sync.1),
        asynch.2.map_or("never".to_string(), |k| k.to_string()),
        ms(asynch.0),
        ms(asynch.0 - alone.0),
        ms(asynch.1),
        ms(first.1)
    );
    Ok(())
}
