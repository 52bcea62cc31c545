//! EPLB across two GPUs: experts move between EP ranks through NCCL (`ncclSend`/`ncclRecv` in one
//! group per param, staged through the transfer buffer), each rank on its own thread with its own
//! device and communicator. The contract check (`selftest --gpu --nccl`) and the bandwidth
//! measurement (`bench --gpu --eplb`) share the rank runner.

use std::collections::HashMap;
use std::fmt::Write as _;

use crate::gpu::Params;
use crate::kernels::STANDARD;
use crate::runtime::collective::{Group, Topology};
use crate::runtime::device::Device;
use crate::runtime::moves::{place_tensors, MovePlan, SlotMap};
use crate::runtime::nccl::{Nccl, NcclWorld, WorldIds};
use crate::runtime::store::{DeviceStorage, ParamStore};
use crate::{Error, Result};

/// What one rank did: its params after the move, and the seconds the timed moves took.
struct RankResult {
    params: Params,
    secs: f64,
}

/// Rank `rank` of an EP world of 2: upload its slots of `old_packed`, rearrange along `plans` in
/// order (the first untimed when `warm`; the last staged on a side stream and swapped in when
/// `async_last`), download.
#[allow(clippy::too_many_arguments)]
fn rank_run(
    rank: usize,
    ids: &WorldIds,
    info: &crate::dsl::ModuleInfo,
    old_packed: &[(String, Vec<u8>)],
    old: &SlotMap,
    plans: &[MovePlan],
    warm: bool,
    async_last: bool,
) -> Result<RankResult> {
    let ranks = 2;
    let dev = Device::open(rank).map_err(Error::from)?;
    let world = NcclWorld::init(&dev, ids, rank).map_err(Error::from)?;
    let r = old.slots();
    let local = r / ranks;
    let kernel = std::sync::Arc::new(
        crate::runtime::copy_kernel::CopyKernel::load(&dev).map_err(Error::from)?,
    );
    let mut params = Vec::new();
    for (n, b) in old_packed {
        let per = b.len() / r;
        let mine = &b[rank * local * per..(rank + 1) * local * per];
        let buf = dev.stream.clone_htod(mine).map_err(crate::runtime::drv::<
            cudarc::driver::DriverError,
        >("cuMemcpyHtoD"))?;
        params.push((
            n.clone(),
            DeviceStorage::owned(buf, dev.stream.clone()).with_copy_kernel(kernel.clone()),
        ));
    }
    let mut store =
        ParamStore::placed(info, params, old.clone(), rank, ranks).map_err(Error::from)?;
    let mut secs = 0.0;
    for (k, plan) in plans.iter().enumerate() {
        dev.sync().map_err(Error::from)?;
        let t0 = std::time::Instant::now();
        if async_last && k + 1 == plans.len() {
            let side = dev.ctx.new_stream().map_err(crate::runtime::drv::<
                cudarc::driver::DriverError,
            >("cuStreamCreate"))?;
            let staged = store.stage_with(plan, &side, &world).map_err(Error::from)?;
            store.commit(staged).map_err(Error::from)?;
        } else {
            store.rearrange(plan, &world).map_err(Error::from)?;
        }
        dev.sync().map_err(Error::from)?;
        if !(warm && k == 0) {
            secs += t0.elapsed().as_secs_f64();
        }
    }
    let mut out = Vec::new();
    for n in store.param_names() {
        let s = store
            .param(n)
            .ok_or_else(|| Error::Usage(format!("no param {n}")))?;
        out.push((n.to_string(), s.download().map_err(Error::from)?));
    }
    world.close().map_err(Error::from)?;
    Ok(RankResult { params: out, secs })
}

fn both_ranks(
    nccl: &'static Nccl,
    info: &crate::dsl::ModuleInfo,
    old_packed: &[(String, Vec<u8>)],
    old: &SlotMap,
    plans: &[MovePlan],
    warm: bool,
    async_last: bool,
) -> Result<Vec<RankResult>> {
    let ids =
        WorldIds::new(nccl, Topology { ep: 2, moe_tp: 1 }, &[Group::Ep]).map_err(Error::from)?;
    let ids = &ids;
    let got: Vec<Result<RankResult>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|k| {
                s.spawn(move || rank_run(k, ids, info, old_packed, old, plans, warm, async_last))
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Usage("a GPU rank panicked".into())))
            })
            .collect()
    });
    got.into_iter().collect()
}

/// The contract across two GPUs, for every standard recipe: 3 logical experts on 4 slots (2 per
/// rank), from a placement to another that moves experts both ways and adds a replica on the other
/// rank; each rank's params must equal its slots of packing the checkpoint placed as the new
/// placement. One line per recipe; `Ok(false)` when any differs.
pub fn contract(
    nccl: &'static Nccl,
    host: &crate::codegen::host::Options,
    out: &mut String,
) -> Result<bool> {
    let (e, r, h, i) = (3usize, 4usize, 128usize, 128usize);
    let old = vec![0, 1, 2, 0];
    let new = vec![2, 0, 1, 1];
    let third = vec![1, 2, 0, 2];
    let layer = crate::bench::Layer::synthetic(e, h, i, 23);
    let scales: Vec<u8> = (0..e)
        .flat_map(|k| (0.75f32 + k as f32).to_le_bytes())
        .collect();
    let inp: HashMap<String, Vec<u8>> = [
        ("w13".to_string(), layer.w13),
        ("w2".to_string(), layer.w2),
        ("w13_input_scale".to_string(), scales.clone()),
        ("w2_input_scale".to_string(), scales),
    ]
    .into_iter()
    .collect();
    let old_map = SlotMap::new(old.clone(), e).map_err(Error::from)?;
    let new_map = SlotMap::new(new.clone(), e).map_err(Error::from)?;
    let plan = MovePlan::new(&old_map, &new_map, 2).map_err(Error::from)?;
    let plan2 = MovePlan::new(
        &new_map,
        &SlotMap::new(third.clone(), e).map_err(Error::from)?,
        2,
    )
    .map_err(Error::from)?;
    let mut all = true;
    for rec in STANDARD {
        let full = crate::check_source(rec.source, rec.path, Some(&format!("E={r},H={h},I={i}")))
            .map_err(|d| Error::Usage(format!("{d:?}")))?;
        let part = crate::check_source(
            rec.source,
            rec.path,
            Some(&format!("E={},H={h},I={i}", r / 2)),
        )
        .map_err(|d| Error::Usage(format!("{d:?}")))?;
        let old_packed = crate::gpu::host_pack(&full, &place_tensors(&inp, e, &old), host)?;
        // Synchronously to `new`; then, in a second world, synchronously to `new` and
        // asynchronously (staged on a side stream with NCCL there, swapped in) on to `third`.
        for (plans, target, how) in [
            (vec![plan.clone()], &new, "sync"),
            (
                vec![plan.clone(), plan2.clone()],
                &third,
                "sync, then async",
            ),
        ] {
            let want = crate::gpu::host_pack(&full, &place_tensors(&inp, e, target), host)?;
            let got = both_ranks(
                nccl,
                &part,
                &old_packed,
                &old_map,
                &plans,
                false,
                plans.len() > 1,
            )?;
            let mut ok = true;
            for (k, g) in got.iter().enumerate() {
                for (n, w) in &want {
                    let per = w.len() / r;
                    let have = g.params.iter().find(|x| &x.0 == n).map(|x| &x.1[..]);
                    ok &= have == Some(&w[k * 2 * per..(k + 1) * 2 * per]);
                }
            }
            all &= ok;
            let _ = writeln!(
                out,
                "EPLB over NCCL {:<16} {old:?} -> {} ({how}) on 2 GPUs: {}",
                rec.name,
                if plans.len() > 1 {
                    format!("{new:?} -> {third:?}")
                } else {
                    format!("{new:?}")
                },
                if ok {
                    "both ranks == packing the placed checkpoint"
                } else {
                    "DIFFERENT: FAILED"
                }
            );
        }
    }
    Ok(all)
}

/// Bandwidth between two GPUs: a bf16 DeepSeek-V3 EP8-shaped layer (H=7168, I=2048) of 8 slots per
/// rank whose halves swap ranks (every slot's expert crosses), timed over `reps` moves after a warm-up.
pub fn bandwidth(nccl: &'static Nccl, reps: usize, out: &mut String) -> Result<()> {
    let (local, h, i) = (8usize, 7168usize, 2048usize);
    let r = 2 * local;
    let rec = crate::kernels::find("bf16").ok_or_else(|| Error::Usage("no bf16 recipe".into()))?;
    let part = crate::check_source(
        rec.source,
        rec.path,
        Some(&format!("E={local},H={h},I={i}")),
    )
    .map_err(|d| Error::Usage(format!("{d:?}")))?;
    let m = part.module();
    let mut old_packed = Vec::new();
    let mut per_slot = 0usize;
    for mv in &part.move_set {
        let Some(t) = m.tensor(mv.param) else {
            continue;
        };
        let b = part.bytes_per_expert(mv).unwrap_or(0) as usize;
        per_slot += b;
        old_packed.push((
            t.name.clone(),
            (0..b * r).map(|k| (k % 253) as u8).collect::<Vec<u8>>(),
        ));
    }
    let a: Vec<usize> = (0..r).collect();
    let b: Vec<usize> = (local..r).chain(0..local).collect();
    let ma = SlotMap::new(a.clone(), r).map_err(Error::from)?;
    let mb = SlotMap::new(b, r).map_err(Error::from)?;
    let mut plans = Vec::new();
    let mut cur = ma.clone();
    for k in 0..=reps.max(1) {
        let next = if k % 2 == 0 { mb.clone() } else { ma.clone() };
        plans.push(MovePlan::new(&cur, &next, 2).map_err(Error::from)?);
        cur = next;
    }
    let got = both_ranks(nccl, &part, &old_packed, &ma, &plans, true, false)?;
    let secs = got.iter().map(|g| g.secs).fold(0.0, f64::max) / reps.max(1) as f64;
    let one_way = (local * per_slot) as f64;
    let _ = writeln!(
        out,
        "\nEPLB between 2 GPUs over NCCL (bf16 layer, H={h}, I={i}, {local} slots per rank swap ranks): {:.2} GB each way in {:.3} ms: {:.1} GB/s one way, {:.1} GB/s both ways (NVLink anchors: 395 one way, 767 both; ../shared/ANCHORS.md, re-measured by scripts/eplb_anchor.py in the same call)",
        one_way / 1e9,
        secs * 1e3,
        one_way / secs / 1e9,
        2.0 * one_way / secs / 1e9
    );
    // What NCCL alone moves between the same two GPUs: the same bytes, with no rearrangement
    // around them, as 1 message, as the rearrangement's 16 (one per expert of each param), and
    // as 64; the gap between these and the line above is the store's own cost.
    let w13 = 2 * (2 * i * h);
    let w2 = 2 * (h * i);
    for (name, pieces) in [
        ("1 message", vec![local * per_slot]),
        (
            "16 messages (one per expert and param)",
            std::iter::repeat_n(w13, local)
                .chain(std::iter::repeat_n(w2, local))
                .collect(),
        ),
        (
            "64 messages",
            std::iter::repeat_n(local * per_slot / 64, 64).collect(),
        ),
    ] {
        let secs = nccl_alone(nccl, &pieces, reps.max(1))?;
        let bytes: usize = pieces.iter().sum();
        let _ = writeln!(
            out,
            "NCCL alone, {:.2} GB each way as {name}: {:.3} ms, {:.1} GB/s one way",
            bytes as f64 / 1e9,
            secs * 1e3,
            bytes as f64 / secs / 1e9
        );
    }
    Ok(())
}

/// Seconds per exchange (the slowest rank's mean over `reps`, after one warm-up) of `pieces`
/// messages each way between the 2 GPUs of an EP world, in one NCCL group, from one buffer into
/// another.
fn nccl_alone(nccl: &'static Nccl, pieces: &[usize], reps: usize) -> Result<f64> {
    let ids =
        WorldIds::new(nccl, Topology { ep: 2, moe_tp: 1 }, &[Group::Ep]).map_err(Error::from)?;
    let ids = &ids;
    let total: usize = pieces.iter().sum();
    let run = |rank: usize| -> Result<f64> {
        let dev = Device::open(rank).map_err(Error::from)?;
        let world = NcclWorld::init(&dev, ids, rank).map_err(Error::from)?;
        let comm = world
            .comm(Group::Ep)
            .ok_or_else(|| Error::Usage("no EP communicator".into()))?;
        let drv = crate::runtime::drv::<cudarc::driver::DriverError>;
        let src = dev
            .stream
            .alloc_zeros::<u8>(total)
            .map_err(drv("cuMemAlloc"))?;
        let mut dst = Vec::with_capacity(pieces.len());
        for &p in pieces {
            dst.push(dev.stream.alloc_zeros::<u8>(p).map_err(drv("cuMemAlloc"))?);
        }
        let peer = 1 - rank;
        let mut secs = 0.0;
        for k in 0..=reps {
            dev.sync().map_err(Error::from)?;
            let t0 = std::time::Instant::now();
            let mut at = 0;
            let mut sends = Vec::new();
            for &p in pieces {
                sends.push((peer, src.slice(at..at + p)));
                at += p;
            }
            let mut recvs: Vec<_> = dst.iter_mut().map(|b| (peer, b.as_view_mut())).collect();
            comm.send_recv(&dev, &sends, &mut recvs)
                .map_err(Error::from)?;
            dev.sync().map_err(Error::from)?;
            if k > 0 {
                secs += t0.elapsed().as_secs_f64();
            }
        }
        drop(world);
        Ok(secs / reps as f64)
    };
    let got: Vec<Result<f64>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2).map(|k| s.spawn(move || run(k))).collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Usage("a GPU rank panicked".into())))
            })
            .collect()
    });
    let mut worst: f64 = 0.0;
    for g in got {
        worst = worst.max(g?);
    }
    Ok(worst)
}
