//! Pack programs on the GPU: the same kernel IR as the host backend, compiled to PTX, JIT-linked to a
//! cubin (both cached), loaded, and launched in program order on device buffers, with the programs'
//! MAX all-reduce steps queued between the kernels through a [`DeviceCollective`].

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaEvent, CudaFunction, CudaModule, CudaSlice, LaunchConfig, PushKernelArg};
use moeforge_codegen::kir::{BufRole, Elem, Program, Step};
use moeforge_codegen::ptx;

use crate::cache::{Cache, Hit};
use crate::collective::{DeviceCollective, Group, SingleDevice};
use crate::jit::Compiler;
use crate::{drv, Device, Error, Result, Settings};

/// How kernels are compiled for launch and launched: tuning and testing knobs. `maxnreg` and
/// `wide_index` are written into the kernel IR ([`LaunchOptions::apply`]), so they are part of the
/// cache keys.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct LaunchOptions {
    /// A cap on registers per thread in every one-thread-per-item kernel (the CLI's
    /// `MOEFORGE_MAXNREG`).
    pub maxnreg: Option<u32>,
    /// Keep every kernel's index arithmetic 64-bit: the path of layers over 2^31 elements, for
    /// testing it at small shapes (the CLI's `MOEFORGE_INDEX64=1`).
    pub wide_index: bool,
    /// A cap on the blocks of one launch, the grid-stride loop taking over past it; `None`: 32 per
    /// SM (the CLI's `MOEFORGE_GPU_MAX_BLOCKS`).
    pub max_blocks: Option<u64>,
}

impl LaunchOptions {
    /// `prog` with these options written into its kernels (`maxnreg` on one-thread-per-item
    /// kernels, `wide_index` on all); `prog` itself when they change nothing.
    pub fn apply<'a>(&self, prog: &'a Program) -> Cow<'a, Program> {
        if self.maxnreg.is_none() && !self.wide_index {
            return Cow::Borrowed(prog);
        }
        let mut p = prog.clone();
        for st in p.steps.iter_mut() {
            if let Step::Kernel(k) = st {
                if k.group == 1 && self.maxnreg.is_some() {
                    k.maxnreg = self.maxnreg;
                }
                k.wide_index |= self.wide_index;
            }
        }
        Cow::Owned(p)
    }
}

/// A pack program loaded on a device: one module per kernel.
pub struct GpuProgram {
    prog: Program,
    _modules: Vec<Arc<CudaModule>>,
    /// Each kernel's function and launch shape (decided once, at load).
    funcs: Vec<(CudaFunction, LaunchConfig)>,
    /// Where the PTX came from (the least cached of the kernels': compiled over recompiled over disk
    /// over memory).
    pub ptx_hit: Hit,
    /// Where the cubins came from (likewise).
    pub cubin_hit: Hit,
    /// Seconds spent generating PTX (0 on a hit).
    pub ptx_seconds: f64,
    /// Seconds spent in PTX -> cubin and module load.
    pub load_seconds: f64,
}

/// A kernel's launch shape: 256-thread blocks of one thread per item, or one warp (group 32) or one
/// CTA of exactly `group` threads per item; at most `max_blocks` blocks, the grid-stride loop taking
/// over past that.
fn launch_config(k: &moeforge_codegen::kir::Kernel, max_blocks: u64) -> LaunchConfig {
    let (threads, per_block) = match k.group {
        0 | 1 => (256u32, 256u64),
        32 => (256, 8),
        g => (g, 1),
    };
    let blocks = ((k.items as u64).div_ceil(per_block)).clamp(1, max_blocks.max(1)) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The less cached of two outcomes (compiled over recompiled over disk over memory).
pub fn worst(a: Hit, b: Hit) -> Hit {
    let rank = |h: Hit| match h {
        Hit::Memory => 0,
        Hit::Disk => 1,
        Hit::Recompiled => 2,
        Hit::Compiled => 3,
    };
    if rank(b) > rank(a) {
        b
    } else {
        a
    }
}

/// One single-kernel program per kernel of `prog` (every buffer kept, so the kernels' parameter
/// lists are unchanged): the unit of PTX generation, caching and JIT, so that a program's kernels are
/// compiled in parallel and a kernel shared by two programs is compiled once.
pub fn units(prog: &Program) -> Vec<Program> {
    prog.kernels()
        .map(|k| Program {
            recipe: prog.recipe.clone(),
            bufs: prog.bufs.clone(),
            steps: vec![Step::Kernel(k.clone())],
        })
        .collect()
}

/// What [`GpuProgram::run_with`] does at one step of a program, decided for the whole program
/// before anything is launched ([`step_actions`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepAction {
    /// Launch the program's `n`-th kernel.
    Launch(usize),
    /// MAX all-reduce buffer `buf` (f32) over `group`, of more than one rank, through the collective.
    Reduce {
        /// The buffer's index.
        buf: usize,
        /// The group.
        group: Group,
    },
    /// A MAX all-reduce over a group of one rank: the identity, so nothing is queued.
    Identity {
        /// The buffer's index.
        buf: usize,
        /// The group.
        group: Group,
    },
}

/// The actions of `prog`'s steps under a collective where group `g` has `size(g)` ranks and
/// `supports(g)` says whether the collective can reduce over it. A reduction over more than one rank
/// that the collective cannot do is [`Error::MissingCollective`] (the whole program is refused, not
/// run part-way); a reduced buffer must be an f32 buffer of the program.
pub fn step_actions(
    prog: &Program,
    size: &dyn Fn(Group) -> usize,
    supports: &dyn Fn(Group) -> bool,
) -> Result<Vec<StepAction>> {
    let mut kernels = 0;
    let mut out = Vec::with_capacity(prog.steps.len());
    for step in &prog.steps {
        out.push(match step {
            Step::Kernel(_) => {
                kernels += 1;
                StepAction::Launch(kernels - 1)
            }
            Step::AllReduceMax { buf, group } => {
                let b = buf.0 as usize;
                if prog.bufs.get(b).map(|d| d.elem) != Some(Elem::F32) {
                    return Err(Error::Codegen(moeforge_codegen::Error::Internal(
                        "an all-reduce of a buffer that is not an f32 buffer of the program",
                    )));
                }
                let n = size(*group);
                if n <= 1 {
                    StepAction::Identity {
                        buf: b,
                        group: *group,
                    }
                } else if supports(*group) {
                    StepAction::Reduce {
                        buf: b,
                        group: *group,
                    }
                } else {
                    return Err(Error::MissingCollective {
                        group: group.name(),
                        size: n,
                    });
                }
            }
        });
    }
    Ok(out)
}

/// A unit's cache key and PTX text.
pub type UnitPtx = (String, Arc<Vec<u8>>);

/// The PTX of every unit of a program through the cache, one thread per unit (key, lookup and, on
/// a miss, generation): `(key, text)` per kernel, and where the least cached one came from.
pub fn unit_ptx(cache: &Cache, prog: &Program, target: ptx::Target) -> Result<(Vec<UnitPtx>, Hit)> {
    let units = units(prog);
    let results: Vec<Result<(UnitPtx, Hit)>> = std::thread::scope(|s| {
        let jobs: Vec<_> = units
            .iter()
            .map(|u| {
                s.spawn(move || {
                    let key = Cache::ptx_key(u, target.name(), "");
                    let (text, h) = cache
                        .get_or_insert("ptx", &key, || Ok(ptx::compile(u, target)?.into_bytes()))?;
                    Ok(((key, text), h))
                })
            })
            .collect();
        jobs.into_iter()
            .map(|j| {
                j.join().unwrap_or_else(|_| {
                    Err(Error::Jit {
                        name: "ptx".into(),
                        code: "panic".into(),
                        log: "a PTX generation thread panicked".into(),
                    })
                })
            })
            .collect()
    });
    let mut out = Vec::with_capacity(results.len());
    let mut hit = Hit::Memory;
    for r in results {
        let (unit, h) = r?;
        hit = worst(hit, h);
        out.push(unit);
    }
    Ok((out, hit))
}

/// The cubin of every unit (`names` are the kernels), from the cache or compiled by `compiler`, one
/// thread per unit. The driver's JIT needs the device; ptxas does not (cache warm-up on a machine
/// without a GPU).
pub fn unit_cubins(
    cache: &Cache,
    units: &[UnitPtx],
    names: &[&str],
    target: ptx::Target,
    compiler: &Compiler,
    dev: Option<&Device>,
) -> Vec<Result<(Arc<Vec<u8>>, Hit)>> {
    let key_part = compiler.key_part(dev.map_or(0, |d| d.driver_version));
    let key_part = &key_part;
    std::thread::scope(|s| {
        let jobs: Vec<_> = units
            .iter()
            .zip(names)
            .map(|((key, text), name)| {
                s.spawn(move || {
                    let ckey = Cache::cubin_key(key, key_part);
                    cache.get_or_insert("cubin", &ckey, || {
                        let text = String::from_utf8_lossy(text).into_owned();
                        match (compiler, dev) {
                            (Compiler::Driver, Some(dev)) => crate::jit::link_ptx(dev, name, &text),
                            (Compiler::Driver, None) => Err(Error::NoDriver(
                                "the driver's JIT needs a device (ptxas does not)".into(),
                            )),
                            (Compiler::Ptxas { path, .. }, _) => {
                                crate::jit::ptxas_compile(path, target.name(), name, &text)
                            }
                        }
                        .map(|(c, _log)| c)
                    })
                })
            })
            .collect();
        jobs.into_iter()
            .zip(names)
            .map(|(j, name)| {
                j.join().unwrap_or_else(|_| {
                    Err(Error::Jit {
                        name: name.to_string(),
                        code: "panic".into(),
                        log: "the JIT thread panicked".into(),
                    })
                })
            })
            .collect()
    })
}

impl GpuProgram {
    /// Generate (or fetch) the PTX of every kernel of `prog` as `settings.launch` tunes it, JIT them
    /// with the compiler `settings.jit` asks for, in parallel, one thread per kernel (or fetch the
    /// cubins), and load the modules.
    pub fn load(
        dev: &Device,
        cache: &Cache,
        prog: &Program,
        settings: &Settings,
    ) -> Result<GpuProgram> {
        let target = dev.target().ok_or_else(|| {
            Error::NoDriver(format!(
                "no PTX target for compute capability {:?}",
                dev.capability
            ))
        })?;
        let launch = &settings.launch;
        let tuned = launch.apply(prog);
        let prog = tuned.as_ref();
        let compiler = &Compiler::resolve(&settings.jit)?;
        let t0 = Instant::now();
        let (ptx_units, ptx_hit) = unit_ptx(cache, prog, target)?;
        let ptx_seconds = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let names: Vec<&str> = prog.kernels().map(|k| k.name.as_str()).collect();
        let cubins = unit_cubins(cache, &ptx_units, &names, target, compiler, Some(dev));
        // At most 32 blocks per SM unless the options say otherwise.
        let max_blocks = launch.max_blocks.unwrap_or(dev.sms as u64 * 32);
        let mut cubin_hit = Hit::Memory;
        let mut modules = Vec::with_capacity(names.len());
        let mut funcs = Vec::with_capacity(names.len());
        for ((c, name), k) in cubins.into_iter().zip(&names).zip(prog.kernels()) {
            let (cubin, h) = c?;
            cubin_hit = worst(cubin_hit, h);
            let module = dev
                .ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(cubin.as_ref().clone()))
                .map_err(drv("cuModuleLoadData"))?;
            funcs.push((
                module
                    .load_function(name)
                    .map_err(drv("cuModuleGetFunction"))?,
                launch_config(k, max_blocks),
            ));
            modules.push(module);
        }
        Ok(GpuProgram {
            prog: prog.clone(),
            _modules: modules,
            funcs,
            ptx_hit,
            cubin_hit,
            ptx_seconds,
            load_seconds: t1.elapsed().as_secs_f64(),
        })
    }

    /// The program.
    pub fn program(&self) -> &Program {
        &self.prog
    }

    /// Device buffers for the program: inputs uploaded from `fill`, the rest zeroed.
    pub fn alloc(
        &self,
        dev: &Device,
        fill: &mut dyn FnMut(&str) -> Option<Vec<u8>>,
    ) -> Result<Vec<CudaSlice<u8>>> {
        let mut out = Vec::with_capacity(self.prog.bufs.len());
        for b in &self.prog.bufs {
            let bytes = b.len * b.elem.size();
            match &b.role {
                BufRole::Input(n) => {
                    let data = fill(n).ok_or_else(|| {
                        Error::Codegen(moeforge_codegen::Error::BufferSize {
                            name: n.clone(),
                            expected: bytes,
                            got: 0,
                        })
                    })?;
                    if data.len() != bytes {
                        return Err(Error::Codegen(moeforge_codegen::Error::BufferSize {
                            name: n.clone(),
                            expected: bytes,
                            got: data.len(),
                        }));
                    }
                    out.push(dev.stream.clone_htod(&data).map_err(drv("cuMemcpyHtoD"))?);
                }
                _ => out.push(
                    dev.stream
                        .alloc_zeros::<u8>(bytes.max(1))
                        .map_err(drv("cuMemAlloc"))?,
                ),
            }
        }
        Ok(out)
    }

    /// Run the program as the whole world (one GPU, one rank: [`SingleDevice`]), where every
    /// all-reduce is over one rank and so the identity: [`GpuProgram::run_with`] with
    /// [`SingleDevice`]. Asynchronous.
    pub fn run(&self, dev: &Device, bufs: &mut [CudaSlice<u8>]) -> Result<()> {
        self.run_with(dev, bufs, &SingleDevice)
    }

    /// Queue every step in order on the device's stream (asynchronous): each kernel, and each MAX
    /// all-reduce through `coll` over its group, stream-ordered between the kernels (for NCCL: its
    /// kernel on the same stream). Over a group of one rank a reduction is the identity; over a larger
    /// group that `coll` does not support the program is refused with [`Error::MissingCollective`]
    /// before anything is queued ([`step_actions`]).
    pub fn run_with(
        &self,
        dev: &Device,
        bufs: &mut [CudaSlice<u8>],
        coll: &dyn DeviceCollective,
    ) -> Result<()> {
        self.launch_all(dev, bufs, coll, None)
    }

    /// [`GpuProgram::run`] with a timing event around every kernel: `(kernel name, milliseconds)` in
    /// program order (waits for the stream). For benchmarks: the events add a little launch overhead.
    pub fn run_timed(
        &self,
        dev: &Device,
        bufs: &mut [CudaSlice<u8>],
    ) -> Result<Vec<(String, f64)>> {
        let mut ev = Vec::new();
        self.launch_all(dev, bufs, &SingleDevice, Some(&mut ev))?;
        let mut out = Vec::new();
        for (name, a, b) in ev {
            let ms = a.elapsed_ms(&b).map_err(drv("cuEventElapsedTime"))?;
            out.push((name, ms as f64));
        }
        Ok(out)
    }

    fn launch_all(
        &self,
        dev: &Device,
        bufs: &mut [CudaSlice<u8>],
        coll: &dyn DeviceCollective,
        mut events: Option<&mut Vec<(String, CudaEvent, CudaEvent)>>,
    ) -> Result<()> {
        if bufs.len() != self.prog.bufs.len() {
            return Err(Error::Codegen(moeforge_codegen::Error::Internal(
                "buffer count",
            )));
        }
        let actions = step_actions(&self.prog, &|g| coll.size(g), &|g| coll.supports(g))?;
        for a in &actions {
            if let StepAction::Reduce { buf, .. } = *a {
                let want = self.prog.bufs.get(buf).map(|b| b.len * b.elem.size());
                if want != bufs.get(buf).map(|d| d.len()) {
                    return Err(Error::Codegen(moeforge_codegen::Error::Internal(
                        "a reduced buffer's size differs from the program's",
                    )));
                }
            }
        }
        for (b, d) in self.prog.bufs.iter().zip(bufs.iter_mut()) {
            if b.zeroed {
                dev.stream.memset_zeros(d).map_err(drv("cuMemsetD8"))?;
            }
        }
        let kernels: Vec<&moeforge_codegen::kir::Kernel> = self.prog.kernels().collect();
        for action in actions {
            match action {
                StepAction::Launch(n) => {
                    let (Some((f, cfg)), Some(k)) = (self.funcs.get(n), kernels.get(n)) else {
                        return Err(Error::Codegen(moeforge_codegen::Error::Internal(
                            "kernel count",
                        )));
                    };
                    let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
                    let start = match events {
                        Some(_) => Some(
                            dev.stream
                                .record_event(timing)
                                .map_err(drv("cuEventRecord"))?,
                        ),
                        None => None,
                    };
                    let mut l = dev.stream.launch_builder(f);
                    for d in bufs.iter() {
                        l.arg(d);
                    }
                    // SAFETY: every generated kernel takes exactly one `.u64` global pointer per program
                    // buffer, in program order (`ptx::kernel_ptx`), and that is what was pushed; each
                    // buffer has the size the program declares (`alloc`), and the kernels index only
                    // inside those sizes (the same programs run bounds-checked in the interpreter).
                    unsafe { l.launch(*cfg) }.map_err(drv("cuLaunchKernel"))?;
                    if let (Some(ev), Some(start)) = (events.as_deref_mut(), start) {
                        let end = dev
                            .stream
                            .record_event(timing)
                            .map_err(drv("cuEventRecord"))?;
                        ev.push((k.name.clone(), start, end));
                    }
                }
                StepAction::Reduce { buf, group } => {
                    let d = bufs
                        .get_mut(buf)
                        .ok_or(Error::Codegen(moeforge_codegen::Error::Internal("buffer")))?;
                    coll.all_reduce_max(group, d, dev)?;
                }
                StepAction::Identity { .. } => {}
            }
        }
        Ok(())
    }

    /// Copy every param back: `(name, bytes)` in program order.
    pub fn download(&self, dev: &Device, bufs: &[CudaSlice<u8>]) -> Result<Vec<(String, Vec<u8>)>> {
        let mut out = Vec::new();
        for (b, d) in self.prog.bufs.iter().zip(bufs) {
            if let BufRole::Param(n) = &b.role {
                let mut v = dev.stream.clone_dtoh(d).map_err(drv("cuMemcpyDtoH"))?;
                v.truncate(b.len * b.elem.size());
                out.push((n.clone(), v));
            }
        }
        Ok(out)
    }
}

/// Loaded programs of one process under one set of [`Settings`], indexed by what a caller asks for
/// (recipe source, binding, present inputs, target), in front of the content-addressed [`Cache`]: a
/// repeated request costs one hash of the recipe text and a map lookup, with no planning, IR
/// printing or module load.
pub struct Loaded {
    settings: Settings,
    map: std::sync::Mutex<std::collections::HashMap<String, Arc<GpuProgram>>>,
}

impl Default for Loaded {
    /// Programs loaded with the default settings.
    fn default() -> Self {
        Loaded::new(Settings::default())
    }
}

impl Loaded {
    /// Programs loaded with `settings`.
    pub fn new(settings: Settings) -> Loaded {
        Loaded {
            settings,
            map: std::sync::Mutex::new(std::collections::HashMap::new()),
        }
    }

    /// The request key: BLAKE3 of the recipe text, the binding, the inputs present, the target and
    /// the moeforge version.
    pub fn key(recipe_src: &str, binding: &str, present: &[&str], target: &str) -> String {
        let mut h = blake3::Hasher::new();
        for p in [env!("CARGO_PKG_VERSION"), recipe_src, binding, target] {
            h.update(p.as_bytes());
            h.update(&[0]);
        }
        for p in present {
            h.update(p.as_bytes());
            h.update(&[1]);
        }
        h.finalize().to_hex().to_string()
    }

    /// The loaded program for a request, made (planned, compiled through the cache, loaded) on a miss.
    /// The flag says whether it was already loaded.
    pub fn get_or_load(
        &self,
        dev: &Device,
        cache: &Cache,
        key: &str,
        make: impl FnOnce() -> Result<Program>,
    ) -> Result<(Arc<GpuProgram>, bool)> {
        if let Some(p) = self.map.lock().ok().and_then(|m| m.get(key).cloned()) {
            return Ok((p, true));
        }
        let prog = make()?;
        let gp = Arc::new(GpuProgram::load(dev, cache, &prog, &self.settings)?);
        if let Ok(mut m) = self.map.lock() {
            m.insert(key.to_string(), gp.clone());
        }
        Ok((gp, false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::Topology;
    use moeforge_codegen::kir::{Buf, BufId, Kernel, Var};

    fn kernel(name: &str) -> Step {
        Step::Kernel(Kernel {
            name: name.into(),
            item: Var(0),
            items: 1,
            body: vec![],
            vars: 1,
            var_types: vec![moeforge_codegen::kir::Ty::I64],
            group: 1,
            maxnreg: None,
            wide_index: false,
        })
    }

    /// amax (f32, 2 values) reduced over moe_tp, then over ep, between three kernels.
    fn program() -> Program {
        let buf = |role, elem| Buf {
            role,
            elem,
            len: 2,
            zeroed: true,
        };
        Program {
            recipe: "r".into(),
            bufs: vec![
                buf(BufRole::Input("w".into()), Elem::Bf16),
                buf(BufRole::Temp("amax".into()), Elem::F32),
            ],
            steps: vec![
                kernel("amax"),
                Step::AllReduceMax {
                    buf: BufId(1),
                    group: Group::MoeTp,
                },
                kernel("scale"),
                Step::AllReduceMax {
                    buf: BufId(1),
                    group: Group::Ep,
                },
                kernel("quant"),
            ],
        }
    }

    fn actions(topo: Topology, rank: usize, supported: &[Group]) -> Result<Vec<StepAction>> {
        step_actions(&program(), &|g| topo.members(g, rank).len(), &|g| {
            supported.contains(&g)
        })
    }

    #[test]
    fn one_gpu_runs_every_reduction_as_the_identity() {
        use StepAction::*;
        let want = vec![
            Launch(0),
            Identity {
                buf: 1,
                group: Group::MoeTp,
            },
            Launch(1),
            Identity {
                buf: 1,
                group: Group::Ep,
            },
            Launch(2),
        ];
        // What `run` does: SingleDevice, a world of one, supports every group.
        let one = SingleDevice;
        let got = step_actions(&program(), &|g| one.size(g), &|g| one.supports(g));
        assert_eq!(got.ok(), Some(want.clone()));
        // Even a collective that supports nothing: groups of one need none.
        assert_eq!(actions(Topology::SINGLE, 0, &[]).ok(), Some(want));
    }

    #[test]
    fn a_group_of_several_is_reduced_through_the_collective_or_refused() {
        use StepAction::*;
        // moe_tp = 2, ep = 1: the moe_tp step goes to the collective, the ep step is the identity.
        let t = Topology { ep: 1, moe_tp: 2 };
        assert_eq!(
            actions(t, 1, &[Group::MoeTp]).ok(),
            Some(vec![
                Launch(0),
                Reduce {
                    buf: 1,
                    group: Group::MoeTp
                },
                Launch(1),
                Identity {
                    buf: 1,
                    group: Group::Ep
                },
                Launch(2),
            ])
        );
        // The review's hole: a multi-rank reduction without a collective for it is an error for the
        // whole program (nothing launched), never a skipped step.
        match actions(t, 0, &[Group::Ep]) {
            Err(Error::MissingCollective { group, size }) => {
                assert_eq!((group, size), ("moe_tp", 2))
            }
            other => panic!("expected MissingCollective, got {other:?}"),
        }
        // 2 x 2 with only moe_tp's communicator: the ep step is refused.
        let t = Topology { ep: 2, moe_tp: 2 };
        match actions(t, 3, &[Group::MoeTp]) {
            Err(Error::MissingCollective { group, size }) => assert_eq!((group, size), ("ep", 2)),
            other => panic!("expected MissingCollective, got {other:?}"),
        }
        assert!(actions(t, 3, &[Group::MoeTp, Group::Ep]).is_ok());
    }

    #[test]
    fn only_f32_buffers_of_the_program_are_reduced() {
        let mut p = program();
        p.steps[1] = Step::AllReduceMax {
            buf: BufId(0),
            group: Group::MoeTp,
        };
        assert!(step_actions(&p, &|_| 1, &|_| true).is_err());
        p.steps[1] = Step::AllReduceMax {
            buf: BufId(7),
            group: Group::MoeTp,
        };
        assert!(step_actions(&p, &|_| 1, &|_| true).is_err());
    }
}
