//! `moeforge bench --gpu --eplb`: in-place EPLB rearrangement of a DeepSeek-V3 EP8 layer (32 local
//! experts, H=7168, I=2048) on one GPU, for every standard recipe: from a random placement to
//! another, every param of the move set, through the same `ParamStore::rearrange` the executor
//! uses. Counts two times the bytes of every slot whose expert changes (one read, one write),
//! divided by the time, against the device copy ceiling.

use std::fmt::Write as _;

use crate::kernels::STANDARD;
use crate::runtime::moves::{MovePlan, SlotMap};
use crate::runtime::store::{DeviceStorage, NoDeviceTransport, ParamStore};
use crate::{Error, Result};

/// The copy ceiling of the H200 (bytes read + written per second), ../shared/ANCHORS.md, re-measured
/// by the anchors in the same `scripts/gpu-check` call.
pub const COPY_CEILING_TBPS: f64 = 4.27;

fn rt(e: crate::runtime::Error) -> Error {
    Error::Runtime(e)
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

/// Run the benchmark: `reps` timed rearrangements per recipe.
pub fn run(reps: usize) -> Result<String> {
    let mut out = String::new();
    let dev = match crate::gpu::open() {
        Ok(d) => d,
        Err(why) => {
            let _ = writeln!(out, "SKIPPED: the EPLB benchmark needs a CUDA GPU ({why})");
            return Ok(out);
        }
    };
    let (e, h, i) = (32usize, 7168, 2048);
    let _ = writeln!(
        out,
        "EPLB rearrangement on {} (one GPU): DeepSeek-V3 EP8 layer, E={e} local slots, H={h}, I={i}; random placement -> random placement, every param of the move set; bandwidth = 2 x bytes of changed slots / time; ceiling {COPY_CEILING_TBPS} TB/s",
        dev.name
    );
    let _ = writeln!(
        out,
        "{:<16} {:>10} {:>8} {:>10} {:>9} {:>10} {:>8}",
        "recipe", "MB/slot", "changed", "moved GB", "ms", "TB/s", "% ceil"
    );
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    for r in STANDARD {
        let info = crate::check_source(r.source, r.path, Some(&format!("E={e},H={h},I={i}")))
            .map_err(|d| Error::Usage(format!("{}: {d:?}", r.name)))?;
        let m = info.module();
        let mut params = Vec::new();
        for mv in &info.move_set {
            let Some(t) = m.tensor(mv.param) else {
                continue;
            };
            let bytes = info.bytes_per_expert(mv).unwrap_or(0) as usize * e;
            // Contents do not matter for the timing; a pattern makes the bytes non-trivial.
            let host: Vec<u8> = (0..bytes).map(|k| (k * 31 % 251) as u8).collect();
            let buf = dev.stream.clone_htod(&host).map_err(|x| {
                rt(crate::runtime::Error::Driver {
                    call: "cuMemcpyHtoD",
                    detail: format!("{x:?}"),
                })
            })?;
            params.push((
                t.name.clone(),
                DeviceStorage::owned(buf, dev.stream.clone()),
            ));
        }
        let mut store = ParamStore::new(&info, params).map_err(rt)?;
        let per_slot = store.bytes_per_slot();
        let mut maps = vec![SlotMap::identity(e)];
        for _ in 0..reps.max(1) + 1 {
            maps.push(SlotMap::new(shuffle(e, &mut seed), e).map_err(rt)?);
        }
        // Warm-up: the first move (allocations, first-touch).
        let plan = MovePlan::new(&maps[0], &maps[1], 1).map_err(rt)?;
        store.rearrange(&plan, &NoDeviceTransport).map_err(rt)?;
        dev.sync().map_err(rt)?;
        let (mut secs, mut bytes, mut changed) = (0f64, 0f64, 0usize);
        for k in 1..maps.len() - 1 {
            let plan = MovePlan::new(&maps[k], &maps[k + 1], 1).map_err(rt)?;
            let t0 = std::time::Instant::now();
            store.rearrange(&plan, &NoDeviceTransport).map_err(rt)?;
            dev.sync().map_err(rt)?;
            secs += t0.elapsed().as_secs_f64();
            bytes += 2.0 * (plan.changed_slots() * per_slot) as f64;
            changed += plan.changed_slots();
        }
        let n = (maps.len() - 2) as f64;
        let tbps = bytes / secs / 1e12;
        let _ = writeln!(
            out,
            "{:<16} {:>10.2} {:>8.1} {:>10.3} {:>9.3} {:>10.3} {:>7.1}%",
            r.name,
            per_slot as f64 / 1e6,
            changed as f64 / n,
            bytes / n / 1e9,
            secs / n * 1e3,
            tbps,
            100.0 * tbps / COPY_CEILING_TBPS
        );
    }
    let _ = writeln!(
        out,
        "(host wall time around each rearrangement including its synchronisation; torch's `param.copy_(param[perm])` is the anchor `eplb_rearrange_torch` in the same gpu-check call)"
    );
    Ok(out)
}
