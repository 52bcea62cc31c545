//! GPU self-tests and benchmarks (`moeforge selftest --gpu`, `moeforge bench --gpu`): on-GPU packing
//! byte-identical to the host backend for every standard recipe at several shapes, JIT latency through
//! the cache, and on-GPU pack time against each recipe's traffic bound; and the two-GPU NCCL smoke
//! test (`moeforge selftest --gpu --nccl`, with the sharded packs of [`crate::gpu_shards`]). Without a GPU (or a second one) they say so and skip.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Instant;

use crate::bench::Layer;
use crate::kernels::{StandardRecipe, STANDARD};
use crate::runtime::cache::{Cache, Hit};
use crate::runtime::collective::{DeviceCollective, Group, SingleDevice, Topology};
use crate::runtime::gpu_pack::{unit_ptx, GpuProgram};
use crate::runtime::nccl::{Nccl, NcclWorld, WorldIds};
use crate::runtime::Device;
use crate::{Error, Result, Settings};

/// Open GPU 0, or the reason there is none; programmatic dependent launch as
/// [`crate::settings::pdl_enabled`] says (and the device allows).
pub fn open() -> std::result::Result<Device, String> {
    open_device().map_err(|e| e.to_string())
}

/// [`open`] with the runtime's error.
pub fn open_device() -> crate::runtime::Result<Device> {
    let mut dev = Device::open(0)?;
    dev.pdl &= crate::settings::pdl_enabled();
    Ok(dev)
}

pub(crate) fn inputs(layer: &Layer) -> HashMap<String, Vec<u8>> {
    let (e, _, _) = layer.dims;
    let mut m = HashMap::new();
    m.insert("w13".to_string(), layer.w13.clone());
    m.insert("w2".to_string(), layer.w2.clone());
    let s13: Vec<u8> = (0..e)
        .flat_map(|k| (0.5f32 + k as f32 * 0.125).to_le_bytes())
        .collect();
    let s2: Vec<u8> = (0..e)
        .flat_map(|k| (2.0f32 - k as f32 * 0.0625).to_le_bytes())
        .collect();
    m.insert("w13_input_scale".to_string(), s13);
    m.insert("w2_input_scale".to_string(), s2);
    m
}

/// Packed params: `(name, bytes)` in program order.
pub type Params = Vec<(String, Vec<u8>)>;

/// Pack on the host (4-lane Cranelift form, compiled with `opts`): `(param, bytes)` in program
/// order.
pub fn host_pack(
    info: &crate::dsl::ModuleInfo,
    inp: &HashMap<String, Vec<u8>>,
    opts: &crate::codegen::host::Options,
) -> Result<Params> {
    host_pack_with(info, inp, opts, &crate::codegen::SingleProcess)
}

/// [`host_pack`] as one rank of the world `coll` describes (its all-reduces through `coll`).
pub fn host_pack_with(
    info: &crate::dsl::ModuleInfo,
    inp: &HashMap<String, Vec<u8>>,
    opts: &crate::codegen::host::Options,
    coll: &dyn crate::codegen::Collective,
) -> Result<Params> {
    let prog =
        crate::codegen::plan::plan_with(info, &|n: &str| inp.contains_key(n), &|_| false, true)?;
    let compiled = crate::codegen::host::compile_with(&prog, opts)?;
    let mut bufs = crate::codegen::alloc_buffers(&prog, &mut |n| inp.get(n).cloned())?;
    compiled.run(&mut bufs, coll, 0)?;
    Ok(prog
        .bufs
        .iter()
        .zip(bufs)
        .filter_map(|(b, d)| match &b.role {
            crate::codegen::kir::BufRole::Param(n) => Some((n.clone(), d)),
            _ => None,
        })
        .collect())
}

/// Pack on the GPU, loading the program with `settings`: returns the params and the GPU program.
pub fn gpu_pack(
    dev: &Device,
    cache: &Cache,
    info: &crate::dsl::ModuleInfo,
    inp: &HashMap<String, Vec<u8>>,
    settings: &crate::runtime::Settings,
) -> Result<(Params, GpuProgram)> {
    gpu_pack_with(dev, cache, info, inp, settings, &SingleDevice)
}

/// [`gpu_pack`] as one rank of the world `coll` describes (its all-reduces through `coll`, on the
/// device's stream).
pub fn gpu_pack_with(
    dev: &Device,
    cache: &Cache,
    info: &crate::dsl::ModuleInfo,
    inp: &HashMap<String, Vec<u8>>,
    settings: &crate::runtime::Settings,
    coll: &dyn DeviceCollective,
) -> Result<(Params, GpuProgram)> {
    let prog = crate::codegen::plan::plan(info, &|n: &str| inp.contains_key(n))?;
    let gp = GpuProgram::load(dev, cache, &prog, settings).map_err(Error::from)?;
    let mut bufs = gp
        .alloc(dev, &mut |n| inp.get(n).cloned())
        .map_err(Error::from)?;
    gp.run_with(dev, &mut bufs, coll).map_err(Error::from)?;
    let out = gp.download(dev, &bufs).map_err(Error::from)?;
    Ok((out, gp))
}

/// Shapes of the self-test: small, not multiples of the tiles where the recipe allows, and a real layer.
/// (The last two reach the CTA-per-row forms: rows of 7168 (128 threads, unrolled) and of 4160
/// (256 threads, looped), partial 128x128 blocks, and a 2112-wide row for the warp form's loop.)
pub const SHAPES: &[(usize, usize, usize)] = &[
    (2, 128, 128),
    (3, 192, 64),
    (4, 320, 192),
    (8, 2048, 768),
    (2, 7168, 256),
    (1, 4160, 2112),
];

/// `moeforge selftest --gpu`: GPU == host byte for byte, each backend with its `settings` (the
/// kernel cache is in memory whatever they say). Returns the report and whether all passed (`None`
/// when there is no GPU).
pub fn selftest(quick: bool, settings: &Settings) -> Result<(String, Option<bool>)> {
    let mut out = String::new();
    let dev = match open() {
        Ok(d) => d,
        Err(why) => {
            let _ = writeln!(out, "SKIPPED: GPU self-test needs a CUDA GPU ({why})");
            return Ok((out, None));
        }
    };
    let _ = writeln!(
        out,
        "device: {} (sm_{}{}), driver CUDA {}",
        dev.name, dev.capability.0, dev.capability.1, dev.driver_version
    );
    let cache = Cache::new(None);
    let shapes: &[(usize, usize, usize)] = if quick { &SHAPES[..2] } else { SHAPES };
    let mut all = true;
    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    let _ = writeln!(out, "seed {seed}");
    let _ = writeln!(
        out,
        "{:<16} {:>14} {:>8} {:>12}  result",
        "recipe", "E,H,I", "params", "bytes"
    );
    // (name, source, path, shape)
    type Case = (String, String, String, (usize, usize, usize));
    let mut cases: Vec<Case> = Vec::new();
    // The standard recipes at every shape; the variants (group-wise INT8 and FP8, per-channel FP8,
    // other row orders) at Qwen3-30B-A3B's sizes on 8 experts, which every variant's `where`
    // admits.
    for r in STANDARD {
        for &sh in shapes {
            cases.push((r.name.into(), r.source.into(), r.path.into(), sh));
        }
    }
    for r in crate::kernels::VARIANTS {
        cases.push((r.name.into(), r.source.into(), r.path.into(), SHAPES[3]));
    }
    // Declared layouts: the layout examples, and random legal layouts on every standard recipe
    // (relayout kernels through permuted, tiled and swizzled maps).
    for r in crate::kernels::LAYOUTS {
        for &sh in &shapes[..2] {
            cases.push((r.name.into(), r.source.into(), r.path.into(), sh));
        }
    }
    let mut rng = crate::layout_gen::Rng::new(seed);
    for k in 0..if quick { 1 } else { 3 } {
        for r in STANDARD {
            let (e, h, i) = shapes[0];
            let bind = format!("E={e},H={h},I={i}");
            let Some(src) =
                crate::layout_gen::random_accepted(&mut rng, r.source, r.path, &bind, 32)
            else {
                continue;
            };
            let name = format!("{}~{k}", r.name);
            cases.push((name, src, r.path.into(), shapes[0]));
        }
    }
    for (name, src, path, (e, h, i)) in cases {
        let bind = format!("E={e},H={h},I={i}");
        let Ok(info) = crate::check_source(&src, &path, Some(&bind)) else {
            let _ = writeln!(
                out,
                "{:<16} {:>14} {:>8} {:>12}  skipped (the recipe rejects this shape or layout)",
                name,
                format!("{e},{h},{i}"),
                "-",
                "-"
            );
            continue;
        };
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let layer = Layer::synthetic(e, h, i, seed);
        let inp = inputs(&layer);
        let want = host_pack(&info, &inp, &settings.host)?;
        let (got, _) = gpu_pack(&dev, &cache, &info, &inp, &settings.runtime)?;
        let mut verdict = "identical".to_string();
        let mut bytes = 0usize;
        for ((wn, wb), (gn, gb)) in want.iter().zip(&got) {
            bytes += wb.len();
            if wn != gn || wb.len() != gb.len() {
                verdict = format!("DIFFERENT params: {wn} vs {gn}");
                break;
            }
            if let Some(k) = wb.iter().zip(gb).position(|(a, b)| a != b) {
                verdict = format!(
                    "DIFFERENT: {wn} byte {k}: host {:#04x}, gpu {:#04x}",
                    wb[k], gb[k]
                );
                break;
            }
        }
        if want.len() != got.len() {
            verdict = format!(
                "DIFFERENT: {} params on host, {} on GPU",
                want.len(),
                got.len()
            );
        }
        all &= verdict == "identical";
        let _ = writeln!(
            out,
            "{:<16} {:>14} {:>8} {:>12}  {verdict}",
            name,
            format!("{e},{h},{i}"),
            want.len(),
            bytes
        );
        if e == 3 {
            all &= rearrange_check(&dev, &info, &inp, e, false, &settings.host, &mut out)?;
        }
        if e == 4 {
            // The copy kernel's two queueings: small params first on side streams (the
            // default), and every launch on the main stream with the large params first.
            for other in [false, true] {
                all &= rearrange_check(&dev, &info, &inp, e, other, &settings.host, &mut out)?;
            }
        }
    }
    all &= tma_check(&dev, &mut out)?;
    let _ = writeln!(
        out,
        "{}",
        if all {
            "GPU == host: all identical"
        } else {
            "GPU != host: FAILED"
        }
    );
    Ok((out, Some(all)))
}

/// The driver encodes the tensor map the GEMM generator asks for over a real expert tensor
/// (`w13_weight`-shaped bf16 `[8, 256, 512]`, 64-row boxes, 128B swizzle), and the cache answers the
/// second ask without encoding again.
fn tma_check(dev: &Device, out: &mut String) -> Result<bool> {
    use crate::codegen::gemm::desc::{Swizzle, TensorMapParams, WgmmaDtype};
    let (e, rows, k) = (8u64, 256u64, 512u64);
    let buf = dev
        .stream
        .alloc_zeros::<u8>((e * rows * k * 2) as usize)
        .map_err(crate::runtime::drv::<cudarc::driver::DriverError>(
            "cuMemAlloc",
        ))?;
    let (ptr, _sync) = cudarc::driver::DevicePtr::device_ptr(&buf, &dev.stream);
    let p = TensorMapParams::expert_k_major(WgmmaDtype::Bf16, Swizzle::B128, ptr, e, rows, k, 64)
        .map_err(|x| Error::Usage(format!("tensor map: {x}")))?;
    let cache = crate::runtime::tma::TensorMapCache::new();
    let a = cache.get(&p).map_err(Error::from)?;
    let b = cache.get(&p).map_err(Error::from)?;
    let ok = a == b && cache.len() == 1 && a.0 != [0u8; 128];
    let _ = writeln!(
        out,
        "TMA: cuTensorMapEncodeTiled of a bf16 [8, 256, 512] expert tensor, 64-row boxes, 128B swizzle: {}",
        if ok { "encoded, cached" } else { "FAILED" }
    );
    Ok(ok)
}

/// Rearranging experts in place on the device equals packing the checkpoint placed as the new
/// placement: `e - 1` logical experts on `e` slots (one replica), from a seeded random placement to
/// another, every param of the move set; views still alias the same storage. `other_order`: the
/// copy kernel's launches all on the main stream, the small params queued first
/// (`DeviceStorage::with_side_stream(false)`, `ParamStore::with_large_first(false)`).
#[allow(clippy::too_many_arguments)]
fn rearrange_check(
    dev: &Device,
    info: &crate::dsl::ModuleInfo,
    inp: &HashMap<String, Vec<u8>>,
    e: usize,
    other_order: bool,
    host: &crate::codegen::host::Options,
    out: &mut String,
) -> Result<bool> {
    use crate::runtime::moves::{MovePlan, SlotMap};
    let logical = e - 1;
    let mut seed = 0x2545_F491_4F6C_DD1Du64 ^ e as u64;
    let mut random = |n: usize| -> Vec<usize> {
        let mut v: Vec<usize> = (0..logical).chain([0]).collect();
        for k in (1..n).rev() {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            v.swap(k, (seed % (k as u64 + 1)) as usize);
        }
        v
    };
    let (old, new) = (random(e), random(e));
    let place = |phy2log: &[usize]| crate::runtime::moves::place_tensors(inp, e, phy2log);
    let drv = crate::runtime::drv::<cudarc::driver::DriverError>;
    // At 4 experts the local copies run as the chunked copy-list kernel, at 3 as one memcpy each.
    let kernel = if e == 4 {
        Some(std::sync::Arc::new(
            crate::runtime::copy_kernel::CopyKernel::load(dev).map_err(Error::from)?,
        ))
    } else {
        None
    };
    let mut params = Vec::new();
    for (n, b) in host_pack(info, &place(&old), host)? {
        let buf = dev.stream.clone_htod(&b).map_err(drv("cuMemcpyHtoD"))?;
        let mut st = crate::runtime::store::DeviceStorage::owned(buf, dev.stream.clone());
        if let Some(k) = &kernel {
            st = st
                .with_copy_kernel(k.clone())
                .with_side_stream(!other_order);
        }
        params.push((n.clone(), st));
    }
    let old_map = SlotMap::new(old.clone(), logical).map_err(Error::from)?;
    let mut store = crate::runtime::store::ParamStore::placed(info, params, old_map.clone(), 0, 1)
        .map_err(Error::from)?
        .with_large_first(!other_order);
    let views: Vec<String> = info
        .views
        .iter()
        .filter_map(|v| Some(info.module().tensor(v.id)?.name.clone()))
        .collect();
    let addr = |s: &crate::runtime::store::ParamStore<_>| -> Vec<u64> {
        views
            .iter()
            .map(|v| s.view(v).map(|x| x.address()).unwrap_or(0))
            .collect()
    };
    let before = addr(&store);
    let plan = MovePlan::new(
        &old_map,
        &SlotMap::new(new.clone(), logical).map_err(Error::from)?,
        1,
    )
    .map_err(Error::from)?;
    store
        .rearrange(&plan, &crate::runtime::collective::SingleDevice)
        .map_err(Error::from)?;
    let mut ok = addr(&store) == before;
    for (n, want) in host_pack(info, &place(&new), host)? {
        let Some(s) = store.param(&n) else {
            ok = false;
            continue;
        };
        let have = s.download().map_err(Error::from)?;
        ok &= have.get(..want.len()) == Some(&want[..]);
    }
    // Then asynchronously (staged on a side stream, swapped in) to a third placement, and again to
    // a fourth (the second staging reuses the buffer the first swap-in replaced).
    let third = random(e);
    let fourth = random(e);
    let side = dev.ctx.new_stream().map_err(drv("cuStreamCreate"))?;
    for (from, to) in [(&new, &third), (&third, &fourth)] {
        let plan = MovePlan::new(
            &SlotMap::new(from.clone(), logical).map_err(Error::from)?,
            &SlotMap::new(to.clone(), logical).map_err(Error::from)?,
            1,
        )
        .map_err(Error::from)?;
        let staged = store.stage(&plan, &side).map_err(Error::from)?;
        store.commit(staged).map_err(Error::from)?;
        // A swap-in exchanges the params' buffers: every view must alias its param's new one.
        ok &= views.iter().all(|v| {
            store.view(v).is_ok_and(|x| {
                store.param(x.param()).is_some_and(|p| {
                    crate::runtime::store::ExpertStorage::address(p) == x.address()
                })
            })
        });
        for (n, want) in host_pack(info, &place(to), host)? {
            let Some(s) = store.param(&n) else {
                ok = false;
                continue;
            };
            let have = s.download().map_err(Error::from)?;
            ok &= have.get(..want.len()) == Some(&want[..]);
        }
    }
    let perm = format!(
        "{old:?}->{new:?}->{third:?}->{fourth:?} ({}, then async twice)",
        if kernel.is_some() && other_order {
            "copy kernel on the main stream, small params first"
        } else if kernel.is_some() {
            "copy kernel"
        } else {
            "memcpy"
        }
    );
    let verdict = if ok {
        "in place == packing the placed checkpoint; views alias"
    } else {
        "DIFFERENT after rearrangement"
    };
    let _ = writeln!(
        out,
        "{:<16} {:>14} {:>8} {:>12}  {verdict}",
        info.module().name,
        perm,
        "",
        ""
    );
    Ok(ok)
}

/// The NCCL smoke test's MAX all-reduce input on rank `rank`: values that differ between the ranks
/// everywhere (no ties, no signed zeros), with an infinity of each sign.
pub fn nccl_reduce_input(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| match (i, rank) {
            (7, 0) => f32::INFINITY,
            (9, 1) => f32::NEG_INFINITY,
            _ => {
                let x = i as f32 + 1.0 + rank as f32 * 0.25;
                match (i + rank) % 4 {
                    0 => x * 0.5,
                    1 => -x,
                    2 => 1e30 / x,
                    _ => -1e-20 * x,
                }
            }
        })
        .collect()
}

/// The NCCL smoke test's messages from rank `from` to rank `to`, in order (three to the other rank,
/// from 1 byte to just over 1 MiB, one to itself).
pub fn nccl_messages(from: usize, to: usize) -> Vec<Vec<u8>> {
    let lens: &[usize] = if from == to {
        &[333]
    } else {
        &[1, 4099, (1 << 20) + 3]
    };
    lens.iter()
        .enumerate()
        .map(|(k, &n)| {
            (0..n)
                .map(|j| (from * 101 + to * 53 + k * 37 + j * 13 + (j >> 8)) as u8)
                .collect()
        })
        .collect()
}

/// `(peer, message index)` per message, in the order given to NCCL.
pub type Order = Vec<(usize, usize)>;

/// The order rank `me` (of two) sends in and receives in: `(peer, message index)`, peers interleaved
/// differently on the two sides so that only the per-pair order can match them.
pub fn nccl_exchange_order(me: usize) -> (Order, Order) {
    let other = 1 - me;
    (
        vec![(other, 0), (me, 0), (other, 1), (other, 2)],
        vec![(other, 0), (other, 1), (me, 0), (other, 2)],
    )
}

/// The NCCL smoke test's pack: `fp8_per_tensor` at `E,H,I` = [`NCCL_PACK_SHAPE`], a different
/// synthetic layer per rank, and the host's packs of them.
pub struct NcclPackCase {
    /// The bound recipe.
    pub info: crate::dsl::ModuleInfo,
    /// Each rank's inputs.
    pub inps: Vec<HashMap<String, Vec<u8>>>,
    /// Each rank's params from the host's pack as a world of `moe_tp = 2` (threads).
    pub want: Vec<Params>,
    /// Each rank's params packed alone (no reduction): what a skipped all-reduce would give.
    pub alone: Vec<Params>,
}

/// `(E, H, I)` of the NCCL smoke test's pack.
pub const NCCL_PACK_SHAPE: (usize, usize, usize) = (2, 128, 128);

/// The NCCL smoke test's pack case for a world of shape `topo` (two ranks), packed on the host with
/// `host`.
pub fn nccl_pack_case(
    topo: Topology,
    host: &crate::codegen::host::Options,
) -> Result<NcclPackCase> {
    let recipe = STANDARD
        .iter()
        .find(|r| r.name == "fp8_per_tensor")
        .ok_or_else(|| Error::Usage("no standard recipe `fp8_per_tensor`".into()))?;
    let (e, h, i) = NCCL_PACK_SHAPE;
    let info = crate::check_source(
        recipe.source,
        recipe.path,
        Some(&format!("E={e},H={h},I={i}")),
    )?;
    let inps: Vec<HashMap<String, Vec<u8>>> = (0..topo.world() as u64)
        .map(|r| inputs(&Layer::synthetic(e, h, i, 17 + 977 * r)))
        .collect();
    let host_world = crate::runtime::collective::InProcess::world(topo);
    let (info_ref, inps_ref) = (&info, &inps);
    let want: Vec<Result<Params>> = std::thread::scope(|s| {
        let hs: Vec<_> = host_world
            .iter()
            .zip(inps_ref)
            .map(|(c, inp)| {
                s.spawn(move || {
                    host_pack_with(info_ref, inp, host, &crate::runtime::collective::Hook(c))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Usage("a host rank panicked".into())))
            })
            .collect()
    });
    let want: Vec<Params> = want.into_iter().collect::<Result<_>>()?;
    let alone: Vec<Params> = inps
        .iter()
        .map(|inp| host_pack(&info, inp, host))
        .collect::<Result<_>>()?;
    Ok(NcclPackCase {
        info,
        inps,
        want,
        alone,
    })
}

/// What one rank of the NCCL smoke test saw.
struct NcclRank {
    reduced: Vec<u8>,
    /// Each receive with one guard byte either side, in receive order.
    received: Vec<Vec<u8>>,
    packed: Params,
}

/// Guard bytes around each receive buffer (they must survive the exchange).
const GUARD: u8 = 0xa5;

/// One rank of the NCCL smoke test, on its own thread: its device, its communicators, then the
/// reduction, the exchange and the pack, each collective on both ranks in the same order.
fn nccl_rank(
    rank: usize,
    ids: &WorldIds,
    info: &crate::dsl::ModuleInfo,
    inp: &HashMap<String, Vec<u8>>,
    settings: &crate::runtime::Settings,
    n_reduce: usize,
) -> Result<NcclRank> {
    let drv = crate::runtime::drv::<cudarc::driver::DriverError>;
    let dev = Device::open(rank).map_err(Error::from)?;
    let world = NcclWorld::init(&dev, ids, rank).map_err(Error::from)?;
    // MAX all-reduce in place.
    let bytes: Vec<u8> = nccl_reduce_input(rank, n_reduce)
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let mut buf = dev.stream.clone_htod(&bytes).map_err(drv("cuMemcpyHtoD"))?;
    world
        .all_reduce_max(Group::MoeTp, &mut buf, &dev)
        .map_err(Error::from)?;
    let reduced = dev.stream.clone_dtoh(&buf).map_err(drv("cuMemcpyDtoH"))?;
    // Grouped exchange: sends are views at odd offsets of one buffer, receives views inside guards.
    let (send_order, recv_order) = nccl_exchange_order(rank);
    let mut packed_sends = vec![GUARD];
    let mut offsets = Vec::new();
    for &(peer, k) in &send_order {
        let m = nccl_messages(rank, peer).swap_remove(k);
        offsets.push((packed_sends.len(), m.len()));
        packed_sends.extend_from_slice(&m);
        packed_sends.extend_from_slice(&[GUARD; 5]);
    }
    let sbuf = dev
        .stream
        .clone_htod(&packed_sends)
        .map_err(drv("cuMemcpyHtoD"))?;
    let mut rbufs = Vec::new();
    for &(peer, k) in &recv_order {
        let n = nccl_messages(peer, rank)[k].len();
        rbufs.push(
            dev.stream
                .clone_htod(&vec![GUARD; n + 2])
                .map_err(drv("cuMemcpyHtoD"))?,
        );
    }
    {
        let sends: Vec<_> = send_order
            .iter()
            .zip(&offsets)
            .map(|(&(peer, _), &(o, n))| (peer, sbuf.slice(o..o + n)))
            .collect();
        let mut recvs: Vec<_> = recv_order
            .iter()
            .zip(rbufs.iter_mut())
            .map(|(&(peer, _), b)| {
                let n = b.len() - 2;
                (peer, b.slice_mut(1..1 + n))
            })
            .collect();
        world
            .exchange(Group::MoeTp, &sends, &mut recvs, &dev)
            .map_err(Error::from)?;
    }
    let mut received = Vec::new();
    for b in &rbufs {
        received.push(dev.stream.clone_dtoh(b).map_err(drv("cuMemcpyDtoH"))?);
    }
    // A pack whose amax steps reduce over moe_tp through NCCL.
    let cache = Cache::new(None);
    let (packed, _) = gpu_pack_with(&dev, &cache, info, inp, settings, &world)?;
    dev.sync().map_err(Error::from)?;
    world.close().map_err(Error::from)?;
    Ok(NcclRank {
        reduced,
        received,
        packed,
    })
}

/// `moeforge selftest --gpu --nccl`: on GPUs 0 and 1, one thread each (each opens its device and
/// joins the communicator itself; the unique id is made once and copied), as a world of
/// `moe_tp = 2`: a MAX all-reduce of known f32 values, a grouped exchange of byte buffers both ways
/// (and one message to itself), and a pack of `fp8_per_tensor` whose per-expert amax is reduced
/// through NCCL, against the host's two-rank pack (threads, [`crate::runtime::collective::InProcess`]);
/// then every standard recipe's sharded pack under `moe_tp = 2` and `ep = 2`, each rank's shard on
/// its GPU against the host's rank pack ([`crate::gpu_shards::selftest`]); then EPLB across the GPUs.
/// One line per check. `None`: skipped (fewer than 2 GPUs). NCCL is loaded from
/// `settings.runtime.nccl_path`, else `libnccl.so.2`, else `libnccl.so`. A rank that fails may leave
/// the other waiting in NCCL: run it under a timeout.
pub fn nccl_selftest(settings: &Settings) -> Result<(String, Option<bool>)> {
    let mut out = String::new();
    let gpus = match crate::runtime::device::count() {
        Ok(n) => n,
        Err(why) => {
            let _ = writeln!(out, "SKIPPED: the NCCL self-test needs 2 CUDA GPUs ({why})");
            return Ok((out, None));
        }
    };
    if gpus < 2 {
        let _ = writeln!(
            out,
            "SKIPPED: the NCCL self-test needs 2 CUDA GPUs; this machine has {gpus}"
        );
        return Ok((out, None));
    }
    let nccl = Nccl::load(settings.runtime.nccl_path.as_deref()).map_err(Error::from)?;
    let _ = writeln!(
        out,
        "NCCL: {} ({gpus} GPUs; ranks on GPUs 0 and 1, moe_tp = 2)",
        nccl.path().display()
    );
    let topo = Topology { ep: 1, moe_tp: 2 };
    let ids = WorldIds::new(nccl, topo, &[Group::MoeTp]).map_err(Error::from)?;
    // The pack check: different inputs per rank, and the host's two-rank pack as the reference.
    let case = nccl_pack_case(topo, &settings.host)?;
    let (info, inps) = (&case.info, &case.inps);
    let (want, alone) = (&case.want, &case.alone);
    let n_reduce = 1027;
    let ids = &ids;
    let rs = &settings.runtime;
    let got: Vec<Result<NcclRank>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .zip(inps)
            .map(|(rank, inp)| s.spawn(move || nccl_rank(rank, ids, info, inp, rs, n_reduce)))
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Usage("a GPU rank panicked".into())))
            })
            .collect()
    });
    let mut all = true;
    let mut ranks = Vec::new();
    for (r, g) in got.into_iter().enumerate() {
        match g {
            Ok(g) => ranks.push(g),
            Err(why) => {
                all = false;
                let _ = writeln!(out, "rank {r}: FAILED: {why}");
            }
        }
    }
    if ranks.len() != 2 {
        let _ = writeln!(out, "NCCL self-test: FAILED");
        return Ok((out, Some(false)));
    }
    // 1. The all-reduce.
    let a = nccl_reduce_input(0, n_reduce);
    let b = nccl_reduce_input(1, n_reduce);
    let max: Vec<u8> = a
        .iter()
        .zip(&b)
        .flat_map(|(x, y)| if x >= y { *x } else { *y }.to_le_bytes())
        .collect();
    let mut verdict = "identical on both ranks".to_string();
    for (r, g) in ranks.iter().enumerate() {
        if let Some(k) =
            (0..n_reduce).find(|&k| g.reduced.get(4 * k..4 * k + 4) != max.get(4 * k..4 * k + 4))
        {
            let v = |bs: &[u8]| {
                bs.get(4 * k..4 * k + 4)
                    .and_then(|c| c.try_into().ok())
                    .map(f32::from_le_bytes)
            };
            verdict = format!(
                "DIFFERENT: rank {r} value {k}: got {:?}, want {:?}",
                v(&g.reduced),
                v(&max)
            );
            break;
        }
    }
    all &= verdict.starts_with("identical");
    let _ = writeln!(
        out,
        "all_reduce_max over moe_tp, {n_reduce} f32 in place: {verdict}"
    );
    // 2. The exchange.
    let mut verdict = "identical on both ranks, guards intact".to_string();
    'ranks: for (r, g) in ranks.iter().enumerate() {
        let (_, recv_order) = nccl_exchange_order(r);
        for ((peer, k), have) in recv_order.iter().zip(&g.received) {
            let mut want = vec![GUARD];
            want.extend_from_slice(&nccl_messages(*peer, r)[*k]);
            want.push(GUARD);
            if *have != want {
                let at = have.iter().zip(&want).position(|(x, y)| x != y);
                verdict = format!(
                    "DIFFERENT: rank {r}, message {k} from rank {peer}: {} bytes (want {}), first difference at {at:?}",
                    have.len(),
                    want.len()
                );
                break 'ranks;
            }
        }
    }
    all &= verdict.starts_with("identical");
    let _ = writeln!(
        out,
        "grouped exchange over moe_tp, 4 messages each way (1 B to 1 MiB + 3 B, one to itself, odd offsets): {verdict}"
    );
    // 3. The pack.
    let mut verdict = "identical to the host's two-rank pack on both ranks".to_string();
    let mut changed = 0;
    for (r, g) in ranks.iter().enumerate() {
        changed += want[r]
            .iter()
            .zip(&alone[r])
            .filter(|(x, y)| x.1 != y.1)
            .count();
        if g.packed != want[r] {
            let which = g
                .packed
                .iter()
                .zip(&want[r])
                .find(|(x, y)| x != y)
                .map_or("the param list".to_string(), |(x, _)| x.0.clone());
            verdict = format!("DIFFERENT: rank {r}: {which}");
            break;
        }
    }
    if changed == 0 {
        verdict =
            format!("{verdict}; but the reduction changed nothing, so this proves nothing: FAILED");
    }
    all &= verdict.starts_with("identical") && changed > 0;
    let _ = writeln!(
        out,
        "fp8_per_tensor E,H,I={NCCL_PACK_SHAPE:?}, amax reduced over moe_tp by NCCL: {verdict} ({changed} params differ from a one-rank pack)"
    );
    // 4. Sharded packs: every standard recipe under moe_tp = 2 and ep = 2, each rank's shard
    // packed on its GPU == the host's rank pack.
    all &= crate::gpu_shards::selftest(settings, &mut out)?;
    // 5. EPLB: experts moved between the two GPUs, for every recipe.
    all &= crate::eplb_nccl::contract(nccl, &settings.host, &mut out)?;
    let _ = writeln!(
        out,
        "{}",
        if all {
            "NCCL self-test: all passed"
        } else {
            "NCCL self-test: FAILED"
        }
    );
    Ok((out, Some(all)))
}

/// Fewest bytes a recipe's pack must move: each param written once, each input read once, or twice
/// where an amax over a whole expert (or tensor) must be known before quantizing (NVFP4's global scale,
/// FP8 per-tensor: the programs with a separate `_amax` pass). Row and 128x128-block amaxes stay on
/// chip (one group kernel per row or block), so they count one read.
fn traffic_bytes(prog: &crate::codegen::kir::Program) -> f64 {
    let two_pass = prog.kernels().any(|k| k.name.ends_with("_amax"));
    let mut b = 0f64;
    for buf in &prog.bufs {
        let n = (buf.len * buf.elem.size()) as f64;
        match &buf.role {
            crate::codegen::kir::BufRole::Input(_) => {
                b += if two_pass && n > 1e6 { 2.0 * n } else { n }
            }
            crate::codegen::kir::BufRole::Param(_) => b += n,
            _ => {}
        }
    }
    b
}

/// Run `moeforge cache warmup NAME` at the JIT benchmark's binding in a new process over a filled
/// cache folder: its own request-to-loaded milliseconds (`None` unless both PTX and cubins came from
/// disk) and the process's wall-clock seconds. The new process reads its other settings from this
/// process's environment, as the command does.
fn new_process_hit(name: &str, dir: &std::path::Path) -> Result<(Option<f64>, f64)> {
    let exe = std::env::current_exe().map_err(|e| Error::Io {
        path: "current executable".into(),
        source: e,
    })?;
    let t = Instant::now();
    let o = std::process::Command::new(&exe)
        .args(["cache", "warmup", name, "--bind", "E=128,H=2048,I=768"])
        .env("MOEFORGE_CACHE_DIR", dir)
        .output()
        .map_err(|e| Error::Io {
            path: exe.display().to_string(),
            source: e,
        })?;
    let wall = t.elapsed().as_secs_f64();
    let text = String::from_utf8_lossy(&o.stdout);
    let ms = text
        .lines()
        .find(|l| l.contains("ptx Disk, cubin Disk"))
        .and_then(|l| l.split("loaded in ").nth(1))
        .and_then(|x| x.trim_end_matches(" ms").trim().parse::<f64>().ok());
    Ok((ms, wall))
}

/// `moeforge bench --gpu [--recipe NAME]`: JIT latency and on-GPU pack time of a DeepSeek-V3 EP8
/// layer, for every standard recipe or only the one named; `pack_only` leaves out the JIT part,
/// `jit_only` the pack part, and the pack time is the best of `reps` runs. Programs are loaded with
/// `settings` (the kernel caches are temporary whatever they say).
pub fn bench(
    only: Option<&str>,
    pack_only: bool,
    jit_only: bool,
    reps: usize,
    settings: &Settings,
) -> Result<String> {
    if let Some(name) = only {
        if !STANDARD.iter().any(|r| r.name == name) {
            return Err(Error::Usage(format!("no standard recipe `{name}`")));
        }
    }
    let chosen: Vec<&StandardRecipe> = STANDARD
        .iter()
        .filter(|r| only.is_none_or(|n| n == r.name))
        .collect();
    let mut out = String::new();
    let dev = match open() {
        Ok(d) => d,
        Err(why) => {
            let _ = writeln!(out, "SKIPPED: GPU benchmarks need a CUDA GPU ({why})");
            return Ok(out);
        }
    };
    let _ = writeln!(
        out,
        "device: {} (sm_{}{}), driver CUDA {}; CUDA_CACHE_DISABLE={}",
        dev.name,
        dev.capability.0,
        dev.capability.1,
        dev.driver_version,
        settings.cuda_cache_disable
    );
    let rs = &settings.runtime;
    if !pack_only {
        jit_latency(&dev, &mut out, &chosen, rs)?;
    }
    if !jit_only {
        pack_bench(&dev, &mut out, &chosen, reps.max(1), rs)?;
    }
    Ok(out)
}

/// JIT latency per recipe at the Qwen3-30B-A3B binding.
fn jit_latency(
    dev: &Device,
    out: &mut String,
    chosen: &[&StandardRecipe],
    settings: &crate::runtime::Settings,
) -> Result<()> {
    let compiler = crate::runtime::jit::Compiler::resolve(&settings.jit).map_err(Error::from)?;
    let _ = writeln!(
        out,
        "\nJIT latency (Qwen3-30B-A3B binding, sm_90a; PTX -> cubin by {}):",
        compiler.describe()
    );
    let _ = writeln!(
        out,
        "{:<16} {:>12} {:>16} {:>16} {:>18} {:>16} {:>13}",
        "recipe",
        "recipe->PTX",
        "cold PTX->module",
        "warm memory hit",
        "warm disk hit",
        "new process hit",
        "process wall"
    );
    for r in chosen {
        let dir = tempfile::tempdir().map_err(|e| Error::Io {
            path: "tempdir".into(),
            source: e,
        })?;
        let t = Instant::now();
        let prog = crate::pack_program(r.source, r.path, "E=128,H=2048,I=768", &|_| true)?;
        let target = dev
            .target()
            .ok_or_else(|| Error::Usage("unsupported GPU".into()))?;
        // As the runtime makes it: one PTX unit per kernel, generated in parallel (memory cache).
        let ptx_units = unit_ptx(&Cache::new(None), &prog, target).map_err(Error::from)?;
        let t_ptx = t.elapsed().as_secs_f64();
        std::hint::black_box(&ptx_units);
        let cache = Cache::new(Some(dir.path().to_path_buf()));
        let t = Instant::now();
        let gp = GpuProgram::load(dev, &cache, &prog, settings).map_err(Error::from)?;
        let t_cold = t.elapsed().as_secs_f64() - gp.ptx_seconds;
        // Warm in-memory hit: the same request again, answered by the process's loaded programs.
        let loaded = crate::runtime::gpu_pack::Loaded::new(settings.clone());
        let key = |src: &str| {
            crate::runtime::gpu_pack::Loaded::key(
                src,
                "E=128,H=2048,I=768",
                &["w13", "w2", "w13_input_scale", "w2_input_scale"],
                target.name(),
            )
        };
        let k0 = key(r.source);
        let (_, hit0) = loaded
            .get_or_load(dev, &cache, &k0, || Ok(prog.clone()))
            .map_err(Error::from)?;
        let t = Instant::now();
        let k1 = key(r.source);
        let (_, hit1) = loaded
            .get_or_load(dev, &cache, &k1, || {
                Err(crate::runtime::Error::NoDriver("miss".into()))
            })
            .map_err(Error::from)?;
        let t_mem = t.elapsed().as_secs_f64();
        let (h1, h2) = (
            if !hit0 && hit1 {
                Hit::Memory
            } else {
                Hit::Compiled
            },
            Hit::Memory,
        );
        // Warm disk hit: a fresh cache object over the same folder, then module load.
        let cache2 = Cache::new(Some(dir.path().to_path_buf()));
        let t = Instant::now();
        let gp2 = GpuProgram::load(dev, &cache2, &prog, settings).map_err(Error::from)?;
        let t_disk = t.elapsed().as_secs_f64();
        // Warm disk hit in a new process: `moeforge cache warmup` over the same folder reports its
        // request-to-loaded time (after opening the device); the process's whole wall time, CUDA
        // start-up included, is shown beside it.
        let (t_proc, t_wall) = new_process_hit(r.name, dir.path())?;
        let ok = h1 == Hit::Memory
            && h2 == Hit::Memory
            && gp2.ptx_hit == Hit::Disk
            && gp2.cubin_hit == Hit::Disk
            && t_proc.is_some();
        let _ = writeln!(
            out,
            "{:<16} {:>9.2} ms {:>13.1} ms {:>13.1} us {:>15.2} ms {:>13.2} ms {:>10.0} ms{}",
            r.name,
            t_ptx * 1e3,
            t_cold * 1e3,
            t_mem * 1e6,
            t_disk * 1e3,
            t_proc.unwrap_or(f64::NAN),
            t_wall * 1e3,
            if ok { "" } else { "  (unexpected cache path)" }
        );
    }
    Ok(())
}

/// On-GPU pack of a DeepSeek-V3 EP8 layer, best of `reps` runs, and the per-kernel split.
fn pack_bench(
    dev: &Device,
    out: &mut String,
    chosen: &[&StandardRecipe],
    reps: usize,
    settings: &crate::runtime::Settings,
) -> Result<()> {
    let (e, h, i) = (32, 7168, 2048);
    let layer = Layer::synthetic(e, h, i, 5);
    let inp = inputs(&layer);
    let _ = writeln!(out, "\nOn-GPU pack, DeepSeek-V3 EP8 layer (E={e}, H={h}, I={i}; {:.2} GB of bf16), bound = traffic at the H200's copy ceiling of 4.27 TB/s (ANCHORS.md; not re-measured on this card):", layer.bytes() as f64 / 1e9);
    let _ = writeln!(
        out,
        "{:<16} {:>10} {:>12} {:>12} {:>10}",
        "recipe", "time ms", "traffic GB", "bound ms", "of bound"
    );
    let cache = Cache::new(None);
    for r in chosen {
        let info = crate::check_source(r.source, r.path, Some(&format!("E={e},H={h},I={i}")))?;
        let prog = crate::codegen::plan::plan(&info, &|n: &str| inp.contains_key(n))?;
        let gp = GpuProgram::load(dev, &cache, &prog, settings).map_err(Error::from)?;
        let mut bufs = gp
            .alloc(dev, &mut |n| inp.get(n).cloned())
            .map_err(Error::from)?;
        gp.run(dev, &mut bufs).map_err(Error::from)?;
        dev.sync().map_err(Error::from)?;
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            let t = Instant::now();
            gp.run(dev, &mut bufs).map_err(Error::from)?;
            dev.sync().map_err(Error::from)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        let traffic = traffic_bytes(&prog);
        let bound = traffic / 4.27e12;
        let _ = writeln!(
            out,
            "{:<16} {:>10.2} {:>12.2} {:>12.3} {:>9.1}%",
            r.name,
            best * 1e3,
            traffic / 1e9,
            bound * 1e3,
            bound / best * 100.0
        );
        // Where the time goes: one more run with an event pair around each kernel.
        let per = gp.run_timed(dev, &mut bufs).map_err(Error::from)?;
        let parts: Vec<String> = per
            .iter()
            .filter(|(_, ms)| *ms >= 0.005)
            .map(|(n, ms)| format!("{} {:.3}", n.strip_prefix(r.name).unwrap_or(n), ms))
            .collect();
        let _ = writeln!(out, "    kernels (ms): {}", parts.join(", "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nccl_reduction_input_has_one_answer_per_value() {
        let (a, b) = (nccl_reduce_input(0, 1027), nccl_reduce_input(1, 1027));
        assert_eq!((a.len(), b.len()), (1027, 1027));
        // No ties and no zeros: the maximum is one of the two values, whatever NCCL's max does with
        // equal or signed-zero operands.
        assert!(a
            .iter()
            .zip(&b)
            .all(|(x, y)| x != y && *x != 0.0 && *y != 0.0));
        assert!(a.iter().chain(&b).all(|x| !x.is_nan()));
        assert!(a.contains(&f32::INFINITY) && b.contains(&f32::NEG_INFINITY));
        // Each rank holds the maximum somewhere.
        assert!(a.iter().zip(&b).any(|(x, y)| x > y) && a.iter().zip(&b).any(|(x, y)| y > x));
    }

    #[test]
    fn the_nccl_exchange_matches_per_pair_in_order() {
        // For every pair (from, to), the messages `from` sends to `to` are, in order, the messages
        // `to` receives from `from`: what NCCL's point-to-point matching needs.
        for from in 0..2 {
            for to in 0..2 {
                let sent: Vec<usize> = nccl_exchange_order(from)
                    .0
                    .iter()
                    .filter(|(p, _)| *p == to)
                    .map(|(_, k)| *k)
                    .collect();
                let received: Vec<usize> = nccl_exchange_order(to)
                    .1
                    .iter()
                    .filter(|(p, _)| *p == from)
                    .map(|(_, k)| *k)
                    .collect();
                assert_eq!(sent, received, "{from} -> {to}");
                assert_eq!(sent.len(), nccl_messages(from, to).len());
            }
        }
        // Messages differ between directions and between positions.
        assert_ne!(nccl_messages(0, 1)[2], nccl_messages(1, 0)[2]);
        assert_ne!(nccl_messages(0, 1)[1][..], nccl_messages(0, 1)[2][..4099]);
        assert_eq!(nccl_messages(1, 1)[0].len(), 333);
    }

    #[test]
    fn the_nccl_pack_reference_depends_on_the_reduction() {
        // The host side of `selftest --gpu --nccl`'s pack check: with the amax reduced over
        // moe_tp = 2, both ranks get the same per-expert scales, which packing alone does not give;
        // so a skipped all-reduce on the GPU cannot pass the check.
        let topo = Topology { ep: 1, moe_tp: 2 };
        let case = nccl_pack_case(topo, &Default::default()).unwrap();
        let param = |p: &Params, n: &str| p.iter().find(|(k, _)| k == n).unwrap().1.clone();
        for n in ["w13_weight_scale", "w2_weight_scale", "g1_alphas"] {
            assert_eq!(param(&case.want[0], n), param(&case.want[1], n), "{n}");
            assert_ne!(param(&case.alone[0], n), param(&case.alone[1], n), "{n}");
        }
        assert!(case.want[0] != case.alone[0] && case.want[1] != case.alone[1]);
    }
}
