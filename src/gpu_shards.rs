//! A `--moe-tp`/`--ep` pack on GPUs: each rank packs its shard on its own GPU, with NCCL doing the
//! all-reduces that make every scale the unsplit pack's (issue \[6\] item 5, GPU part).
//!
//! The GPU ranks run the same rank program as the host ranks ([`crate::pack::plan_rank`], in the
//! scalar form the PTX backend takes), on the same slices ([`crate::pack::rank_slice`]), with the
//! reductions through a [`DeviceCollective`] instead of the host's in-process collective. One
//! thread per rank (rank `r` on GPU `r`) opens its [`Device`] and joins its communicators
//! ([`NcclWorld`], which is not `Send`) on that thread; the caller's thread plans every program
//! (so a split is refused before any GPU works) and hands each rank its job. Each step that can
//! fail on one rank alone (opening the device, loading and uploading a program) is confirmed by
//! every rank before any of them enters a collective, so such a failure stops every rank instead
//! of leaving the others waiting in NCCL. A failure inside a collective (a lost peer) may still
//! leave the other ranks waiting: run under a timeout.

use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use crate::codegen::kir::{BufRole, Program, Step};
use crate::runtime::cache::Cache;
use crate::runtime::collective::{DeviceCollective, Group, SingleDevice, Topology};
use crate::runtime::gpu_pack::GpuProgram;
use crate::runtime::nccl::{Nccl, NcclWorld, WorldIds};
use crate::runtime::Device;
use crate::{Error, Result};

/// A layer's whole inputs, as [`crate::pack::rank_slice`] takes them.
#[derive(Debug, Clone)]
pub struct WholeLayer {
    /// The inputs by recipe input name (`w13 [E, 2I, H]`, `w2 [E, H, I]`, activation scales).
    pub bufs: HashMap<String, Vec<u8>>,
    /// `(E, H, I)` of the whole layer.
    pub dims: (usize, usize, usize),
    /// Whether the weights are f32 (else bf16).
    pub as_f32: bool,
}

/// One rank's packed buffers, in the program's order: every param's bytes, every other buffer
/// empty (what [`crate::pack`] writes from).
pub type ShardBufs = Vec<Vec<u8>>;

/// The program a GPU rank of `topo` runs for a layer of whole shape `dims`:
/// [`crate::pack::plan_rank`] in the GPU's scalar form (the host ranks run the same plan in its
/// 4-lane form; same buffers, same all-reduces, same bytes).
pub fn rank_program(
    recipe_src: &str,
    recipe_path: &str,
    topo: Topology,
    dims: (usize, usize, usize),
    as_f32: bool,
    present: &[String],
) -> Result<(crate::dsl::ModuleInfo, Program)> {
    crate::pack::plan_rank(recipe_src, recipe_path, topo, dims, as_f32, present, false)
}

/// The groups a program all-reduces over, in first-use order (what its world needs communicators
/// for).
pub fn program_groups(prog: &Program) -> Vec<Group> {
    let mut out = Vec::new();
    for s in &prog.steps {
        if let Step::AllReduceMax { group, .. } = s {
            if !out.contains(group) {
                out.push(*group);
            }
        }
    }
    out
}

/// What `pack --device gpu` with `topo`'s ranks refuses when this machine has fewer GPUs than
/// ranks (rank `r` packs on GPU `r`); the number of GPUs otherwise.
pub fn check_gpus(topo: Topology) -> Result<usize> {
    let need = topo.world();
    let what = format!(
        "--device gpu with --ep {} --moe-tp {} packs each of the {need} ranks on its own GPU (rank r on GPU r), so it needs {need} CUDA GPUs",
        topo.ep, topo.moe_tp
    );
    match crate::runtime::device::count() {
        Err(why) => Err(Error::Usage(format!(
            "{what}; none is usable here ({why}); pack on the host instead (leave out --device gpu)"
        ))),
        Ok(n) if n < need => Err(Error::Usage(format!(
            "{what}; this machine has {n}; pack on the host instead (leave out --device gpu)"
        ))),
        Ok(n) => Ok(n),
    }
}

/// The params of a rank's buffers: `(name, bytes)` in program order.
pub fn shard_params(prog: &Program, bufs: &[Vec<u8>]) -> crate::gpu::Params {
    prog.bufs
        .iter()
        .zip(bufs)
        .filter_map(|(b, d)| match &b.role {
            BufRole::Param(n) => Some((n.clone(), d.clone())),
            _ => None,
        })
        .collect()
}

/// Run a loaded rank program on `dev` over `inputs` (the rank's slice), its all-reduces through
/// `coll`, and download the params: [`ShardBufs`] in the order of `prog` (the program `gp` was
/// loaded from).
pub fn run_shard(
    dev: &Device,
    gp: &GpuProgram,
    prog: &Program,
    coll: &dyn DeviceCollective,
    inputs: &HashMap<String, Vec<u8>>,
) -> Result<ShardBufs> {
    let mut bufs = gp
        .alloc(dev, &mut |n| inputs.get(n).cloned())
        .map_err(Error::from)?;
    run_allocated(dev, gp, prog, coll, &mut bufs)
}

fn run_allocated(
    dev: &Device,
    gp: &GpuProgram,
    prog: &Program,
    coll: &dyn DeviceCollective,
    bufs: &mut [cudarc::driver::CudaSlice<u8>],
) -> Result<ShardBufs> {
    gp.run_with(dev, bufs, coll).map_err(Error::from)?;
    let params: HashMap<String, Vec<u8>> = gp
        .download(dev, bufs)
        .map_err(Error::from)?
        .into_iter()
        .collect();
    Ok(prog
        .bufs
        .iter()
        .map(|b| match &b.role {
            BufRole::Param(n) => params.get(n).cloned().unwrap_or_default(),
            _ => Vec::new(),
        })
        .collect())
}

/// One rank's shard packed on its GPU.
pub struct Shard {
    /// The recipe verified at the rank shape.
    pub info: crate::dsl::ModuleInfo,
    /// The rank program (every rank of the topology runs this one).
    pub program: Program,
    /// Its buffers after it ran ([`ShardBufs`]).
    pub bufs: ShardBufs,
}

/// Pack rank `rank`'s shard of a layer of whole shape `dims` on `dev`: the recipe verified at the
/// rank's shape and planned with [`crate::pack::rank_sharding`] ([`rank_program`]), loaded through
/// `cache` with `settings`, run over `inputs` (the rank's slice, [`crate::pack::rank_slice`]) with
/// its all-reduces through `coll` (an [`NcclWorld`] of `topo`: every rank of the topology must make
/// this call together), and the params downloaded. `coll` must be `topo`'s world at `rank`.
#[allow(clippy::too_many_arguments)]
pub fn pack_shard(
    dev: &Device,
    cache: &Cache,
    settings: &crate::runtime::Settings,
    coll: &dyn DeviceCollective,
    recipe_src: &str,
    recipe_path: &str,
    dims: (usize, usize, usize),
    topo: Topology,
    rank: usize,
    as_f32: bool,
    inputs: &HashMap<String, Vec<u8>>,
) -> Result<Shard> {
    if coll.topology() != topo || coll.world_rank() != rank {
        return Err(Error::Usage(format!(
            "internal: rank {rank} of ep {} x moe_tp {} given the collective of rank {} of ep {} x moe_tp {}",
            topo.ep,
            topo.moe_tp,
            coll.world_rank(),
            coll.topology().ep,
            coll.topology().moe_tp
        )));
    }
    let mut present: Vec<String> = inputs.keys().cloned().collect();
    present.sort();
    let (info, program) = rank_program(recipe_src, recipe_path, topo, dims, as_f32, &present)?;
    let gp = GpuProgram::load(dev, cache, &program, settings).map_err(Error::from)?;
    let bufs = run_shard(dev, &gp, &program, coll, inputs)?;
    Ok(Shard {
        info,
        program,
        bufs,
    })
}

/// What a rank thread is told.
enum Cmd {
    /// Load (or keep) the program and upload the slice; answer [`Reply::Ready`].
    Job {
        prog: Arc<Program>,
        inputs: HashMap<String, Vec<u8>>,
        alone: bool,
    },
    /// Every rank is ready: go on (join the world, or run the job); answer [`Reply::Ready`] after
    /// joining, [`Reply::Done`] after a job.
    Go,
    /// Some rank could not prepare the job: drop it and wait for the next.
    Skip,
    /// Stop (close the world and return).
    Stop,
}

/// What a rank thread answers.
enum Reply {
    Ready(Result<()>),
    Done(Result<RankShard>),
}

/// One rank's result of [`GpuRanks::pack`].
#[derive(Debug, Clone)]
pub struct RankShard {
    /// Its buffers with the reductions through NCCL ([`ShardBufs`]).
    pub bufs: ShardBufs,
    /// When asked for: the same program over the same slice run with [`SingleDevice`] (every
    /// reduction over this rank alone), what a skipped all-reduce would give.
    pub alone: Option<ShardBufs>,
}

/// The ranks of a world of GPUs, one thread each, while [`with_gpu_ranks`] runs.
pub struct GpuRanks {
    topo: Topology,
    cmds: Vec<Sender<Cmd>>,
    replies: Receiver<(usize, Reply)>,
}

impl GpuRanks {
    /// The world's shape.
    pub fn topology(&self) -> Topology {
        self.topo
    }

    fn send_all(&self, mut make: impl FnMut() -> Cmd) -> Result<()> {
        for (r, c) in self.cmds.iter().enumerate() {
            c.send(make())
                .map_err(|_| Error::Usage(format!("GPU rank {r} stopped")))?;
        }
        Ok(())
    }

    /// One answer from every rank: the first error (by rank), or the answers in rank order.
    fn gather<T>(&self, pick: impl Fn(Reply) -> Option<Result<T>>) -> Result<Vec<T>> {
        let n = self.cmds.len();
        let mut got: Vec<Option<Result<T>>> = (0..n).map(|_| None).collect();
        for _ in 0..n {
            let (r, reply) = self
                .replies
                .recv()
                .map_err(|_| Error::Usage("every GPU rank stopped".into()))?;
            let v = pick(reply).unwrap_or_else(|| {
                Err(Error::Usage(format!(
                    "internal: GPU rank {r} answered out of turn"
                )))
            });
            if let Some(slot) = got.get_mut(r) {
                *slot = Some(v);
            }
        }
        let mut out = Vec::with_capacity(n);
        for (r, g) in got.into_iter().enumerate() {
            match g {
                Some(Ok(v)) => out.push(v),
                Some(Err(e)) => return Err(Error::Usage(format!("GPU rank {r} (GPU {r}): {e}"))),
                None => return Err(Error::Usage(format!("GPU rank {r} did not answer"))),
            }
        }
        Ok(out)
    }

    fn ready(&self) -> Result<()> {
        self.gather(|r| match r {
            Reply::Ready(x) => Some(x),
            Reply::Done(Err(e)) => Some(Err(e)),
            Reply::Done(Ok(_)) => None,
        })
        .map(|_| ())
    }

    /// Run `prog` on every rank over its slice (`slices[r]` on GPU `r`) with the reductions through
    /// NCCL; with `alone`, each rank also runs it with [`SingleDevice`]. Every rank loads and uploads
    /// first; only when all succeeded does any of them run.
    pub fn pack(
        &mut self,
        prog: &Arc<Program>,
        slices: Vec<HashMap<String, Vec<u8>>>,
        alone: bool,
    ) -> Result<Vec<RankShard>> {
        if slices.len() != self.cmds.len() {
            return Err(Error::Usage(format!(
                "internal: {} slices for {} ranks",
                slices.len(),
                self.cmds.len()
            )));
        }
        for ((r, c), inputs) in self.cmds.iter().enumerate().zip(slices) {
            c.send(Cmd::Job {
                prog: prog.clone(),
                inputs,
                alone,
            })
            .map_err(|_| Error::Usage(format!("GPU rank {r} stopped")))?;
        }
        if let Err(e) = self.ready() {
            // Every rank waits for a decision: none runs (so none waits in a collective).
            let _ = self.send_all(|| Cmd::Skip);
            return Err(e);
        }
        self.send_all(|| Cmd::Go)?;
        self.gather(|r| match r {
            Reply::Done(x) => Some(x),
            // A rank that failed (or panicked) before answering this phase.
            Reply::Ready(Err(e)) => Some(Err(e)),
            Reply::Ready(Ok(())) => None,
        })
    }
}

/// Run `f` with a world of `topo.world()` GPU ranks (rank `r` on GPU `r`, one thread each, NCCL
/// communicators for `groups`, loaded from `settings.nccl_path` or NCCL's sonames; none, and no
/// NCCL, when no group needs one), then close the world. Kernels are cached as `settings` says.
pub fn with_gpu_ranks<R>(
    topo: Topology,
    groups: &[Group],
    settings: &crate::runtime::Settings,
    f: impl FnOnce(&mut GpuRanks) -> Result<R>,
) -> Result<R> {
    let needed = WorldIds::member_sets(topo, groups);
    let ids = if needed.is_empty() {
        WorldIds::from_ids(topo, &[], &[]).map_err(Error::from)?
    } else {
        let nccl = Nccl::load(settings.nccl_path.as_deref()).map_err(Error::from)?;
        WorldIds::new(nccl, topo, groups).map_err(Error::from)?
    };
    let cache = Cache::new(settings.cache_dir.clone());
    let (ids, cache) = (&ids, &cache);
    std::thread::scope(|s| {
        let (reply_tx, replies) = channel();
        let mut cmds = Vec::new();
        let mut handles = Vec::new();
        for rank in 0..topo.world() {
            let (tx, rx) = channel();
            cmds.push(tx);
            let reply = reply_tx.clone();
            handles.push(s.spawn(move || -> Result<()> {
                let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    rank_main(rank, ids, cache, settings, &rx, &reply)
                }));
                match ran {
                    Ok(r) => r,
                    Err(_) => {
                        let why = format!("GPU rank {rank}'s thread panicked");
                        let _ = reply.send((rank, Reply::Ready(Err(Error::Usage(why.clone())))));
                        Err(Error::Usage(why))
                    }
                }
            }));
        }
        drop(reply_tx);
        let mut ranks = GpuRanks {
            topo,
            cmds,
            replies,
        };
        // Every device opened, then every rank joins its communicators.
        let res = ranks
            .ready()
            .and_then(|()| ranks.send_all(|| Cmd::Go))
            .and_then(|()| ranks.ready())
            .and_then(|()| f(&mut ranks));
        for c in &ranks.cmds {
            let _ = c.send(Cmd::Stop);
        }
        drop(ranks);
        let mut closed = Ok(());
        for (r, h) in handles.into_iter().enumerate() {
            let j = h
                .join()
                .unwrap_or_else(|_| Err(Error::Usage(format!("GPU rank {r}'s thread panicked"))));
            if closed.is_ok() {
                closed = j;
            }
        }
        let out = res?;
        closed.map(|()| out)
    })
}

/// Wait for [`Cmd::Go`]: `false` on anything else or when the caller is gone.
fn go(rx: &Receiver<Cmd>) -> bool {
    matches!(rx.recv(), Ok(Cmd::Go))
}

/// One rank's thread: open GPU `rank`, join the world, then run jobs until told to stop.
fn rank_main(
    rank: usize,
    ids: &WorldIds,
    cache: &Cache,
    settings: &crate::runtime::Settings,
    rx: &Receiver<Cmd>,
    reply: &Sender<(usize, Reply)>,
) -> Result<()> {
    let answer = |r: Reply| {
        let _ = reply.send((rank, r));
    };
    let dev = match Device::open(rank) {
        Ok(d) => {
            answer(Reply::Ready(Ok(())));
            d
        }
        Err(e) => {
            answer(Reply::Ready(Err(Error::from(e))));
            return Ok(());
        }
    };
    if !go(rx) {
        return Ok(());
    }
    let world = match NcclWorld::init(&dev, ids, rank) {
        Ok(w) => {
            answer(Reply::Ready(Ok(())));
            w
        }
        Err(e) => {
            answer(Reply::Ready(Err(Error::from(e))));
            return Ok(());
        }
    };
    let mut loaded: Option<(Arc<Program>, GpuProgram)> = None;
    while let Ok(Cmd::Job {
        prog,
        inputs,
        alone,
    }) = rx.recv()
    {
        // Load (unless the same program is loaded) and upload, then wait for every rank.
        let prep = (|| -> Result<Vec<cudarc::driver::CudaSlice<u8>>> {
            if loaded.as_ref().is_none_or(|(p, _)| **p != *prog) {
                loaded = None;
                let gp = GpuProgram::load(&dev, cache, &prog, settings).map_err(Error::from)?;
                loaded = Some((prog.clone(), gp));
            }
            let Some((_, gp)) = &loaded else {
                return Err(Error::Usage("internal: no loaded program".into()));
            };
            gp.alloc(&dev, &mut |n| inputs.get(n).cloned())
                .map_err(Error::from)
        })();
        // Every rank answers, then waits for the caller's decision: run only when all are ready.
        let prepared = match prep {
            Ok(b) => {
                answer(Reply::Ready(Ok(())));
                Some(b)
            }
            Err(e) => {
                answer(Reply::Ready(Err(e)));
                None
            }
        };
        match rx.recv() {
            Ok(Cmd::Go) => {}
            Ok(Cmd::Skip) => continue,
            _ => break,
        }
        let done = (|| -> Result<RankShard> {
            let (Some((_, gp)), Some(mut bufs)) = (&loaded, prepared) else {
                return Err(Error::Usage(
                    "internal: told to run a job that was not prepared".into(),
                ));
            };
            let shard = run_allocated(&dev, gp, &prog, &world, &mut bufs)?;
            drop(bufs);
            let alone = if alone {
                Some(run_shard(&dev, gp, &prog, &SingleDevice, &inputs)?)
            } else {
                None
            };
            Ok(RankShard { bufs: shard, alone })
        })();
        answer(Reply::Done(done));
    }
    dev.sync().map_err(Error::from)?;
    world.close().map_err(Error::from)
}

/// Pack `layers` layers for every rank of `topo`, rank `r` on GPU `r` (see the module): `next(k)`
/// gives layer `k`'s whole inputs; each layer's rank program is planned here
/// ([`rank_program`], refused before any GPU works on it), the slices cut
/// ([`crate::pack::rank_slice`]), every rank packs its own, and `done(k, info, program, bufs)`
/// receives the recipe at the rank shape, the rank program and every rank's [`ShardBufs`] in rank
/// order. The world's communicators are those the first layer's program reduces over.
#[allow(clippy::type_complexity)]
pub fn pack_layers(
    recipe_src: &str,
    recipe_path: &str,
    topo: Topology,
    settings: &crate::runtime::Settings,
    layers: usize,
    next: &mut dyn FnMut(usize) -> Result<WholeLayer>,
    done: &mut dyn FnMut(usize, &crate::dsl::ModuleInfo, &Program, Vec<ShardBufs>) -> Result<()>,
) -> Result<()> {
    check_gpus(topo)?;
    if layers == 0 {
        return Ok(());
    }
    type Key = (usize, usize, usize, bool, Vec<String>);
    let plan = |w: &WholeLayer| -> Result<(Key, crate::dsl::ModuleInfo, Arc<Program>)> {
        let mut present: Vec<String> = w.bufs.keys().cloned().collect();
        present.sort();
        let (info, prog) = rank_program(recipe_src, recipe_path, topo, w.dims, w.as_f32, &present)?;
        let (e, h, i) = w.dims;
        Ok(((e, h, i, w.as_f32, present), info, Arc::new(prog)))
    };
    let first = next(0)?;
    let mut planned = plan(&first)?;
    let groups = program_groups(&planned.2);
    with_gpu_ranks(topo, &groups, settings, |ranks| {
        let mut whole = Some(first);
        for k in 0..layers {
            let w = match whole.take() {
                Some(w) => w,
                None => next(k)?,
            };
            let mut present: Vec<String> = w.bufs.keys().cloned().collect();
            present.sort();
            let (e, h, i) = w.dims;
            if planned.0 != (e, h, i, w.as_f32, present) {
                planned = plan(&w)?;
            }
            let elem = if w.as_f32 { 4 } else { 2 };
            let slices = (0..topo.world())
                .map(|r| crate::pack::rank_slice(&w.bufs, w.dims, elem, topo, r))
                .collect::<Result<Vec<_>>>()?;
            drop(w);
            let shards = ranks.pack(&planned.2, slices, false)?;
            done(
                k,
                &planned.1,
                &planned.2,
                shards.into_iter().map(|s| s.bufs).collect(),
            )?;
        }
        Ok(())
    })
}

/// `(E, H, I)` of `selftest --gpu --nccl`'s sharded packs: a split every standard recipe admits
/// under both [`SHARD_TOPOLOGIES`] (`I/2 = 128`: whole FP8 128x128 blocks and NVFP4's 64-row
/// interleave on each rank; two experts per EP rank).
pub const SHARD_SHAPE: (usize, usize, usize) = (4, 256, 256);

/// The two-rank topologies `selftest --gpu --nccl` packs shards under: `moe_tp = 2` (every expert
/// split) and `ep = 2` (the experts divided).
pub const SHARD_TOPOLOGIES: [Topology; 2] =
    [Topology { ep: 1, moe_tp: 2 }, Topology { ep: 2, moe_tp: 1 }];

/// `ep N` / `moe_tp T` / `ep N x moe_tp T`, naming only the split groups.
pub fn topology_name(t: Topology) -> String {
    match (t.ep, t.moe_tp) {
        (1, tp) => format!("moe_tp {tp}"),
        (ep, 1) => format!("ep {ep}"),
        (ep, tp) => format!("ep {ep} x moe_tp {tp}"),
    }
}

/// One standard recipe's sharded pack of the self-test, prepared on the host.
pub struct ShardCase {
    /// The recipe's name.
    pub recipe: &'static str,
    /// The GPU ranks' program ([`rank_program`]).
    pub program: Arc<Program>,
    /// Each rank's slice of the layer ([`crate::pack::rank_slice`]).
    pub slices: Vec<HashMap<String, Vec<u8>>>,
    /// Each rank's params from the host's rank pack ([`crate::pack::RankPacker`], the path of
    /// `pack --moe-tp`/`--ep`: host threads, the in-process collective), which
    /// `tests/topology.rs` proves equal to the unsplit pack once reassembled.
    pub want: Vec<crate::gpu::Params>,
}

/// The self-test's cases under `topo`: every standard recipe at [`SHARD_SHAPE`] (one synthetic
/// layer with per-expert activation scales), packed on the host with `host`.
pub fn shard_cases(topo: Topology, host: &crate::codegen::host::Options) -> Result<Vec<ShardCase>> {
    let dims = SHARD_SHAPE;
    let (e, h, i) = dims;
    let whole = crate::gpu::inputs(&crate::bench::Layer::synthetic(e, h, i, 0x5eed_5a4d));
    let mut present: Vec<String> = whole.keys().cloned().collect();
    present.sort();
    let mut out = Vec::new();
    for r in crate::kernels::STANDARD {
        let (_, prog) = rank_program(r.source, r.path, topo, dims, false, &present)?;
        let mut packer = crate::pack::RankPacker::new(r.source, r.path, topo, 0, host)?;
        let l = packer.pack_layer(&whole, dims, false)?;
        let want = l.bufs.iter().map(|b| shard_params(l.program, b)).collect();
        let slices = (0..topo.world())
            .map(|k| crate::pack::rank_slice(&whole, dims, 2, topo, k))
            .collect::<Result<_>>()?;
        out.push(ShardCase {
            recipe: r.name,
            program: Arc::new(prog),
            slices,
            want,
        });
    }
    Ok(out)
}

/// How many params of `got` differ from `want` (by name; a param missing from either counts).
pub fn params_differing(want: &crate::gpu::Params, got: &crate::gpu::Params) -> usize {
    let g: HashMap<&str, &Vec<u8>> = got.iter().map(|(n, b)| (n.as_str(), b)).collect();
    let w: HashMap<&str, &Vec<u8>> = want.iter().map(|(n, b)| (n.as_str(), b)).collect();
    let missing = g.keys().filter(|n| !w.contains_key(*n)).count();
    missing
        + want
            .iter()
            .filter(|(n, b)| g.get(n.as_str()) != Some(&b))
            .count()
}

/// The first param of `got` that differs from `want`, described (`None`: byte-equal, same params).
fn first_difference(want: &crate::gpu::Params, got: &crate::gpu::Params) -> Option<String> {
    let g: HashMap<&str, &Vec<u8>> = got.iter().map(|(n, b)| (n.as_str(), b)).collect();
    for (n, wb) in want {
        let Some(gb) = g.get(n.as_str()) else {
            return Some(format!("no param `{n}`"));
        };
        if gb.len() != wb.len() {
            return Some(format!("`{n}`: {} bytes, want {}", gb.len(), wb.len()));
        }
        if let Some(k) = wb.iter().zip(gb.iter()).position(|(a, b)| a != b) {
            return Some(format!(
                "`{n}` byte {k}: gpu {:#04x}, host {:#04x}",
                gb[k], wb[k]
            ));
        }
    }
    (got.len() != want.len()).then(|| format!("{} params, want {}", got.len(), want.len()))
}

/// `selftest --gpu --nccl`'s sharded packs: under each of [`SHARD_TOPOLOGIES`], every standard
/// recipe's two ranks pack their shards on GPUs 0 and 1 (one thread each, the all-reduces through
/// NCCL), and each rank's params must equal the host's rank pack byte for byte ([`shard_cases`]).
/// Each rank also runs its program without the reduction ([`SingleDevice`]); under each topology
/// some params must differ from that, or the check could not tell a skipped all-reduce. One line
/// per (recipe, topology); then [`pack_command_check`]. Returns whether all passed.
pub fn selftest(settings: &crate::Settings, out: &mut String) -> Result<bool> {
    use std::fmt::Write as _;
    let (e, h, i) = SHARD_SHAPE;
    let mut all = true;
    for topo in SHARD_TOPOLOGIES {
        let name = topology_name(topo);
        let cases = shard_cases(topo, &settings.host)?;
        let mut groups: Vec<Group> = Vec::new();
        for c in &cases {
            for g in program_groups(&c.program) {
                if !groups.contains(&g) {
                    groups.push(g);
                }
            }
        }
        let mut lines = String::new();
        let res = with_gpu_ranks(topo, &groups, &settings.runtime, |ranks| {
            let mut ok = true;
            let mut changed_all = 0;
            for c in &cases {
                let head = format!("{:<16} {name}, E,H,I={e},{h},{i}:", c.recipe);
                let got = match ranks.pack(&c.program, c.slices.clone(), true) {
                    Ok(g) => g,
                    Err(why) => {
                        ok = false;
                        let _ = writeln!(lines, "{head} FAILED: {why}");
                        continue;
                    }
                };
                let mut verdict = None;
                let mut changed = 0;
                for (r, (g, want)) in got.iter().zip(&c.want).enumerate() {
                    let have = shard_params(&c.program, &g.bufs);
                    if verdict.is_none() {
                        verdict = first_difference(want, &have).map(|d| format!("rank {r}: {d}"));
                    }
                    if let Some(a) = &g.alone {
                        changed += params_differing(&shard_params(&c.program, a), &have);
                    }
                }
                changed_all += changed;
                ok &= verdict.is_none();
                let _ = writeln!(
                    lines,
                    "{head} {} ({changed} params differ from the ranks packed without the reduction)",
                    match verdict {
                        None => "identical to the host's rank pack on both ranks".to_string(),
                        Some(d) => format!("DIFFERENT: {d}"),
                    }
                );
            }
            if changed_all == 0 {
                ok = false;
                let _ = writeln!(
                    lines,
                    "{name}: the NCCL reduction changed no param of any recipe, so these checks prove nothing: FAILED"
                );
            }
            Ok(ok)
        });
        out.push_str(&lines);
        match res {
            Ok(ok) => all &= ok,
            Err(why) => {
                all = false;
                let _ = writeln!(out, "sharded packs over {name}: FAILED: {why}");
            }
        }
    }
    all &= pack_command_check(settings, out)?;
    Ok(all)
}

/// A fused checkpoint of `layers` synthetic layers at `dims` (`mlp.experts.w13_weight`,
/// `w2_weight`, bf16; `w13_input_scale`, `w2_input_scale`, f32), as safetensors bytes.
pub fn synthetic_checkpoint(layers: usize, dims: (usize, usize, usize)) -> Result<Vec<u8>> {
    use safetensors::tensor::{Dtype, TensorView};
    let (e, h, i) = dims;
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for l in 0..layers {
        let inp = crate::gpu::inputs(&crate::bench::Layer::synthetic(
            e,
            h,
            i,
            0x5eed_c4e0 + l as u64,
        ));
        let pre = format!("model.layers.{l}.mlp.experts");
        for (n, dt, shape) in [
            ("w13", Dtype::BF16, vec![e, 2 * i, h]),
            ("w2", Dtype::BF16, vec![e, h, i]),
            ("w13_input_scale", Dtype::F32, vec![e]),
            ("w2_input_scale", Dtype::F32, vec![e]),
        ] {
            let bytes = inp
                .get(n)
                .cloned()
                .ok_or_else(|| Error::Usage(format!("internal: no synthetic `{n}`")))?;
            let name = match n {
                "w13" | "w2" => format!("{pre}.{n}_weight"),
                _ => format!("{pre}.{n}"),
            };
            tensors.push((name, dt, shape, bytes));
        }
    }
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, sh, b)| {
            TensorView::new(*d, sh.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| Error::Usage(format!("internal: tensor `{n}`: {e}")))
        })
        .collect::<Result<_>>()?;
    safetensors::serialize(views, None)
        .map_err(|e| Error::Usage(format!("internal: serializing: {e}")))
}

/// What two packed files hold, compared: `None` when their tensors (names, dtypes, shapes, bytes)
/// and metadata are equal, else the first difference.
pub fn file_difference(a: &[u8], b: &[u8]) -> Result<Option<String>> {
    use safetensors::SafeTensors;
    let bad = |e: safetensors::SafeTensorError| Error::Checkpoint(format!("{e}"));
    let (_, ma) = SafeTensors::read_metadata(a).map_err(bad)?;
    let (_, mb) = SafeTensors::read_metadata(b).map_err(bad)?;
    if ma.metadata() != mb.metadata() {
        return Ok(Some("the metadata differs".into()));
    }
    let (sa, sb) = (
        SafeTensors::deserialize(a).map_err(bad)?,
        SafeTensors::deserialize(b).map_err(bad)?,
    );
    let mut ta = sa.tensors();
    let mut tb = sb.tensors();
    ta.sort_by(|x, y| x.0.cmp(&y.0));
    tb.sort_by(|x, y| x.0.cmp(&y.0));
    if ta.len() != tb.len() {
        return Ok(Some(format!("{} tensors vs {}", ta.len(), tb.len())));
    }
    for ((na, va), (nb, vb)) in ta.iter().zip(&tb) {
        if na != nb || va.dtype() != vb.dtype() || va.shape() != vb.shape() {
            return Ok(Some(format!("tensor `{na}` vs `{nb}`")));
        }
        if va.data() != vb.data() {
            return Ok(Some(format!("tensor `{na}`: different bytes")));
        }
    }
    Ok(None)
}

/// `selftest --gpu --nccl`'s end-to-end check of `pack --device gpu --moe-tp/--ep`: a two-layer
/// synthetic checkpoint packed by [`crate::pack::pack`] on the host and on GPUs 0 and 1, under
/// `moe_tp = 2` (`nvfp4_cutedsl`) and `ep = 2` (`fp8_per_tensor`); every rank file must hold what
/// the host's does (tensors and metadata). One line each; returns whether all passed.
pub fn pack_command_check(settings: &crate::Settings, out: &mut String) -> Result<bool> {
    use std::fmt::Write as _;
    let dir = tempfile::tempdir().map_err(|e| Error::Io {
        path: "temporary folder".into(),
        source: e,
    })?;
    let io = |p: &std::path::Path| {
        let p = p.display().to_string();
        move |e: std::io::Error| Error::Io { path: p, source: e }
    };
    let ck = dir.path().join("ckpt.safetensors");
    std::fs::write(&ck, synthetic_checkpoint(2, SHARD_SHAPE)?).map_err(io(&ck))?;
    let mut all = true;
    for (recipe, topo) in [
        ("nvfp4_cutedsl", SHARD_TOPOLOGIES[0]),
        ("fp8_per_tensor", SHARD_TOPOLOGIES[1]),
    ] {
        let r = crate::kernels::find(recipe)
            .ok_or_else(|| Error::Usage(format!("no standard recipe `{recipe}`")))?;
        let mut files = Vec::new();
        for gpu in [false, true] {
            let output = dir.path().join(format!(
                "{recipe}.{}.safetensors",
                if gpu { "gpu" } else { "host" }
            ));
            let opts = crate::pack::PackOptions {
                recipe_src: r.source.to_string(),
                recipe_path: r.path.to_string(),
                inputs: vec![ck.clone()],
                output: output.clone(),
                layers: None,
                threads: 0,
                progress: false,
                gpu,
                passthrough: false,
                allow_nonfinite: false,
                settings: settings.clone(),
                topology: topo,
            };
            files.push((crate::pack::pack(&opts), output));
        }
        let flag = match (topo.ep, topo.moe_tp) {
            (1, t) => format!("--moe-tp {t}"),
            (n, _) => format!("--ep {n}"),
        };
        let head =
            format!("pack --device gpu {flag} ({recipe}, 2 layers of E,H,I={SHARD_SHAPE:?}):");
        let verdict = match (&files[0].0, &files[1].0) {
            (Err(e), _) => format!("FAILED: the host pack: {e}"),
            (_, Err(e)) => format!("FAILED: {e}"),
            (Ok(_), Ok(_)) => {
                let mut v = "every rank file == the host's (tensors and metadata)".to_string();
                for rank in 0..topo.world() {
                    let (a, b) = (
                        crate::pack::rank_path(&files[0].1, rank),
                        crate::pack::rank_path(&files[1].1, rank),
                    );
                    let fa = std::fs::read(&a).map_err(io(&a))?;
                    let fb = std::fs::read(&b).map_err(io(&b))?;
                    if let Some(d) = file_difference(&fa, &fb)? {
                        v = format!("DIFFERENT: rank {rank}: {d}");
                        break;
                    }
                }
                v
            }
        };
        all &= verdict.starts_with("every");
        let _ = writeln!(out, "{head} {verdict}");
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host side of the self-test's sharded packs: every recipe splits at [`SHARD_SHAPE`]
    /// under both topologies, the GPU ranks' program has the host ranks' buffers and all-reduces,
    /// and under each topology the host's reference differs from packing without the reduction,
    /// so a skipped all-reduce on the GPU cannot pass.
    #[test]
    fn the_shard_check_depends_on_the_reduction() {
        let host = crate::codegen::host::Options::default();
        for topo in SHARD_TOPOLOGIES {
            let cases = shard_cases(topo, &host).unwrap();
            assert_eq!(cases.len(), crate::kernels::STANDARD.len());
            let mut changed = 0;
            for c in &cases {
                assert_eq!(c.want.len(), 2);
                let r = crate::kernels::STANDARD
                    .iter()
                    .find(|r| r.name == c.recipe)
                    .unwrap();
                let mut present: Vec<String> = c.slices[0].keys().cloned().collect();
                present.sort();
                let (_, host_prog) = crate::pack::plan_rank(
                    r.source,
                    r.path,
                    topo,
                    SHARD_SHAPE,
                    false,
                    &present,
                    true,
                )
                .unwrap();
                assert_eq!(host_prog.bufs, c.program.bufs, "{}", c.recipe);
                assert_eq!(
                    program_groups(&host_prog),
                    program_groups(&c.program),
                    "{}",
                    c.recipe
                );
                // Each rank alone: the same rank program, every reduction over itself.
                let compiled = crate::codegen::host::compile(&host_prog).unwrap();
                for (slice, want) in c.slices.iter().zip(&c.want) {
                    let mut b =
                        crate::codegen::alloc_buffers(&host_prog, &mut |n| slice.get(n).cloned())
                            .unwrap();
                    compiled
                        .run(&mut b, &crate::codegen::SingleProcess, 1)
                        .unwrap();
                    changed += params_differing(want, &shard_params(&host_prog, &b));
                }
            }
            assert!(changed > 0, "{topo:?}: the reduction changes nothing");
        }
    }

    /// The host half of [`pack_command_check`]: the synthetic checkpoint packs under both
    /// topologies, and [`file_difference`] sees a changed byte and changed metadata.
    #[test]
    fn the_pack_command_check_compares_what_it_should() {
        let dir = tempfile::tempdir().unwrap();
        let ck = dir.path().join("ckpt.safetensors");
        std::fs::write(&ck, synthetic_checkpoint(2, (4, 128, 256)).unwrap()).unwrap();
        let r = crate::kernels::find("fp8_per_tensor").unwrap();
        let mut files = Vec::new();
        for (k, topo) in SHARD_TOPOLOGIES.iter().enumerate() {
            let output = dir.path().join(format!("o{k}.safetensors"));
            crate::pack::pack(&crate::pack::PackOptions {
                recipe_src: r.source.to_string(),
                recipe_path: r.path.to_string(),
                inputs: vec![ck.clone()],
                output: output.clone(),
                layers: None,
                threads: 1,
                progress: false,
                gpu: false,
                passthrough: false,
                allow_nonfinite: false,
                settings: Default::default(),
                topology: *topo,
            })
            .unwrap();
            files.push(std::fs::read(crate::pack::rank_path(&output, 0)).unwrap());
        }
        assert_eq!(file_difference(&files[0], &files[0]).unwrap(), None);
        // Other metadata (the rank's binding).
        assert!(file_difference(&files[0], &files[1]).unwrap().is_some());
        // One byte of the last tensor's data (the file ends with tensor data).
        let mut flipped = files[0].clone();
        if let Some(b) = flipped.last_mut() {
            *b ^= 1;
        }
        assert_eq!(
            file_difference(&files[0], &flipped)
                .unwrap()
                .map(|d| d.contains("different bytes")),
            Some(true)
        );
    }

    #[test]
    fn program_groups_lists_each_reduced_group_once() {
        let r = crate::kernels::find("fp8_per_tensor").unwrap();
        let present: Vec<String> = ["w13", "w13_input_scale", "w2", "w2_input_scale"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let t = Topology { ep: 2, moe_tp: 2 };
        let (_, p) = rank_program(r.source, r.path, t, (4, 128, 256), false, &present).unwrap();
        let g = program_groups(&p);
        assert!(g.contains(&Group::MoeTp) && g.contains(&Group::Ep), "{g:?}");
        let mut d = g.clone();
        d.dedup();
        assert_eq!(d.len(), g.len());
        assert_eq!(topology_name(t), "ep 2 x moe_tp 2");
        assert_eq!(topology_name(SHARD_TOPOLOGIES[0]), "moe_tp 2");
    }
}
