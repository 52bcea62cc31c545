//! The demo's EPLB round: a skewed synthetic load goes through the policy, then an in-place
//! rearrangement of a packed NVFP4 layer (over 4 simulated EP ranks exchanging experts on the host,
//! and on the GPU when there is one), then the contract check: every param equals packing the
//! checkpoint placed as the new placement.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Instant;

use crate::gpu::Params;
use crate::runtime::collective::{InProcess, Topology};
use crate::runtime::eplb_state::{EplbLayerState, Policy};
use crate::runtime::moves::{place_tensors, MovePlan, SlotMap};
use crate::runtime::store::ParamStore;
use crate::{Error, Result};

fn pack(
    info: &crate::dsl::ModuleInfo,
    inp: &HashMap<String, Vec<u8>>,
    host: &crate::codegen::host::Options,
) -> Result<Params> {
    crate::gpu::host_pack(info, inp, host)
}

/// Run the round and append its report.
pub fn run(
    out: &mut String,
    host: &crate::codegen::host::Options,
    runtime: &crate::runtime::Settings,
) -> Result<()> {
    let (e, r, ranks, h, i) = (16usize, 20usize, 4usize, 2048usize, 768usize);
    let local = r / ranks;
    let rec = crate::kernels::find("nvfp4_cutedsl")
        .ok_or_else(|| Error::Usage("no nvfp4_cutedsl recipe".into()))?;
    let full = crate::check_source(rec.source, rec.path, Some(&format!("E={r},H={h},I={i}")))
        .map_err(|d| Error::Usage(format!("{d:?}")))?;
    let part = crate::check_source(
        rec.source,
        rec.path,
        Some(&format!("E={local},H={h},I={i}")),
    )
    .map_err(|d| Error::Usage(format!("{d:?}")))?;
    // Start: experts 0..E-1 then replicas of 0..R-E-1 (vLLM's initial layout).
    let start: Vec<usize> = (0..r).map(|p| p % e).collect();
    let start_map = SlotMap::new(start.clone(), e).map_err(Error::from)?;
    let mut state = EplbLayerState::new(start_map.clone(), ranks, EplbLayerState::DEFAULT_WINDOW)
        .map_err(Error::from)?;
    // A skewed load: expert k draws about 1/(k+1) of the tokens (Zipf), over 100 steps, spread over
    // its replicas.
    let cnt = start_map.logcnt();
    for step in 0..100u64 {
        let per_slot: Vec<u64> = start
            .iter()
            .map(|&x| (4096 / (x as u64 + 1) + step % 7) / cnt[x] as u64)
            .collect();
        state.record(&per_slot).map_err(Error::from)?;
    }
    let before = state.balancedness();
    let new_map = state
        .plan(Policy {
            groups: 1,
            nodes: 1,
            gpus: ranks,
        })
        .map_err(Error::from)?;
    let layer = crate::bench::Layer::synthetic(e, h, i, 17);
    let inp: HashMap<String, Vec<u8>> =
        [("w13".to_string(), layer.w13), ("w2".to_string(), layer.w2)]
            .into_iter()
            .collect();
    let old_packed = pack(&full, &place_tensors(&inp, e, &start), host)?;
    let want = pack(&full, &place_tensors(&inp, e, new_map.phy2log()), host)?;
    let plan = MovePlan::new(&start_map, &new_map, ranks).map_err(Error::from)?;
    let world = InProcess::world(Topology {
        ep: ranks,
        moe_tp: 1,
    });
    let t0 = Instant::now();
    let results: Vec<Result<(Params, u64)>> = std::thread::scope(|s| {
        let hs: Vec<_> = world
            .iter()
            .enumerate()
            .map(|(k, c)| {
                let (part, plan, start_map) = (&part, &plan, &start_map);
                let params: Params = old_packed
                    .iter()
                    .map(|(n, b)| {
                        let per = b.len() / r;
                        (
                            n.clone(),
                            b[k * local * per..(k + 1) * local * per].to_vec(),
                        )
                    })
                    .collect();
                s.spawn(move || -> Result<(Params, u64)> {
                    let mut st = ParamStore::placed(part, params, start_map.clone(), k, ranks)
                        .map_err(Error::from)?;
                    let rep = st.rearrange(plan, c).map_err(Error::from)?;
                    let got = st
                        .param_names()
                        .iter()
                        .filter_map(|n| Some((n.to_string(), st.param(n)?.clone())))
                        .collect();
                    Ok((got, rep.total_bytes()))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Usage("a rank panicked".into())))
            })
            .collect()
    });
    let secs = t0.elapsed().as_secs_f64();
    let mut ok = true;
    let mut bytes = 0u64;
    for (k, res) in results.into_iter().enumerate() {
        let (got, b) = res?;
        bytes += b;
        for (name, w) in &want {
            let per = w.len() / r;
            let g = got.iter().find(|x| &x.0 == name).map(|x| &x.1[..]);
            ok &= g == Some(&w[k * local * per..(k + 1) * local * per]);
        }
    }
    let _ = writeln!(
        out,
        "\nEPLB round (nvfp4_cutedsl, E={e} experts on R={r} slots over {ranks} EP ranks, H={h}, I={i}; a Zipf-skewed load over 100 steps):"
    );
    let after = state_after(&state, &new_map, ranks);
    let _ = writeln!(
        out,
        "  plan: balancedness {before:.3} -> {after:.3} ({:.2}x); {} of {r} slots change",
        after / before.max(1e-9),
        plan.changed_slots()
    );
    let _ = writeln!(
        out,
        "  in place on the host, 4 ranks exchanging experts in-process: {:.1} MB moved (reads + writes + transfers) in {:.1} ms ({:.2} GB/s on this CPU); every param on every rank {}",
        bytes as f64 / 1e6,
        secs * 1e3,
        bytes as f64 / secs / 1e9,
        if ok {
            "== packing the checkpoint placed as the new placement"
        } else {
            "DIFFERS from packing the placed checkpoint: FAILED"
        }
    );
    if !ok {
        return Err(Error::Usage("the EPLB round broke the contract".into()));
    }
    gpu_round(
        out,
        &full,
        &old_packed,
        &want,
        &start_map,
        &new_map,
        runtime,
    )?;
    Ok(())
}

fn state_after(state: &EplbLayerState, map: &SlotMap, gpus: usize) -> f32 {
    crate::runtime::eplb::balancedness(&state.logical_loads(), map.phy2log(), &map.logcnt(), gpus)
}

/// The same rearrangement on one GPU (all slots on it), when there is one.
fn gpu_round(
    out: &mut String,
    info: &crate::dsl::ModuleInfo,
    old_packed: &Params,
    want: &Params,
    start: &SlotMap,
    new: &SlotMap,
    runtime: &crate::runtime::Settings,
) -> Result<()> {
    let Ok(dev) = crate::gpu::open() else {
        let _ = writeln!(
            out,
            "  (no GPU here: the in-place rearrangement ran on the host only)"
        );
        return Ok(());
    };
    let d = crate::runtime::drv::<cudarc::driver::DriverError>;
    let kernel = std::sync::Arc::new(
        crate::runtime::copy_kernel::CopyKernel::load(&dev).map_err(Error::from)?,
    );
    let mut params = Vec::new();
    for (n, b) in old_packed {
        let buf = dev.stream.clone_htod(b).map_err(d("cuMemcpyHtoD"))?;
        params.push((
            n.clone(),
            crate::runtime::store::DeviceStorage::owned(buf, dev.stream.clone())
                .with_copy_kernel(kernel.clone()),
        ));
    }
    let mut store = ParamStore::placed(info, params, start.clone(), 0, 1).map_err(Error::from)?;
    let plan = MovePlan::new(start, new, 1).map_err(Error::from)?;
    dev.sync().map_err(Error::from)?;
    let t0 = Instant::now();
    store
        .rearrange(&plan, &crate::runtime::collective::SingleDevice)
        .map_err(Error::from)?;
    dev.sync().map_err(Error::from)?;
    let secs = t0.elapsed().as_secs_f64();
    let mut ok = true;
    for (n, w) in want {
        let have = store
            .param(n)
            .map(|s| s.download())
            .transpose()
            .map_err(Error::from)?;
        ok &= have.as_deref().and_then(|h| h.get(..w.len())) == Some(&w[..]);
    }
    let moved = 2.0 * (plan.changed_slots() * store.bytes_per_slot()) as f64;
    let _ = writeln!(
        out,
        "  on the GPU ({}), one rank: {:.1} MB of changed slots read + written in {:.3} ms ({:.1} GB/s); {}",
        dev.name,
        moved / 1e6,
        secs * 1e3,
        moved / secs / 1e9,
        if ok { "== packing the placed checkpoint" } else { "DIFFERS: FAILED" }
    );
    if !ok {
        return Err(Error::Usage("the GPU EPLB round broke the contract".into()));
    }
    // The generated MoE layer itself (Hopper only): a skewed routing counted by its device load
    // counters, `GpuLayer::rebalance` in place, the same tokens' forward.
    if dev.target() == Some(crate::codegen::ptx::Target::Sm90a) {
        let _ = writeln!(
            out,
            "  the GPU MoE layer (E=8, H=256, I=384, random weights, 96 tokens top-2 mostly on experts 0 and 1, 2 EP ranks for the policy): rebalance() from its load counters, then the same tokens' forward:"
        );
        let mut rng = crate::selftest_util::Rng(0x5EED_E91B);
        let (lines, ok) = crate::moe_eplb_check::eplb_check(&dev, &mut rng, runtime)?;
        for l in lines.lines() {
            let _ = writeln!(out, "    {}", l.trim_start_matches("moe layer eplb "));
        }
        if !ok {
            return Err(Error::Usage(
                "the GPU MoE layer's EPLB round changed an output bit".into(),
            ));
        }
    }
    Ok(())
}
