//! The warp-specialized grouped GEMM (`runtime::gemm_ws::GroupedGemm`) behind the GEMM benchmark's
//! [`GemmRunner`]: bf16, fp8_per_tensor (e4m3 with a per-expert weight scale and per-token
//! activation scales) and fp8_block128, bf16 output. For every case it takes the variant the tuning
//! cache ([`crate::runtime::gemm_tune`]) holds for the case's family, shape and row bucket, or tunes
//! over the candidate set of `codegen::gemm::tune` (each candidate timed with an L2 flush before each
//! launch, the fastest kept and stored), and then launches it; the table says which. The kernels'
//! cubins come from the kernel cache ([`GroupedGemm::load_cached`]).

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::CudaSlice;

use crate::bench_gemm::{
    fill_device, random_bf16, random_e4m3, GemmCase, GemmRunner, Prepared, Recipe,
};
use crate::codegen::gemm::ws::{Epilogue, Operands, OutTy, Scaling, WsConfig};
use crate::runtime::cache::{Cache, Hit};
use crate::runtime::gemm_tune::{self, TuneCache, TuneKey, TuneSource};
use crate::runtime::gemm_ws::{GemmOperands, GroupedGemm};
use crate::runtime::jit::Compiler;
use crate::runtime::{drv, Device};
use crate::{Error, Result};

/// Timed launches per candidate when tuning (after one untimed launch).
const TUNE_REPS: usize = 3;
/// The L2 flush before each tuning launch.
const TUNE_FLUSH_BYTES: usize = 256 << 20;

/// Device operands of the current case.
struct Operands_ {
    key: (Recipe, usize, usize, usize, usize),
    x: CudaSlice<u8>,
    w: CudaSlice<u8>,
    x_scale: CudaSlice<f32>,
    w_scale: CudaSlice<f32>,
    /// 4-bit weights' group scales.
    group_scales: Option<CudaSlice<u8>>,
    y: CudaSlice<u8>,
    offsets: CudaSlice<i32>,
    t: usize,
    experts: usize,
}

/// What a runner built and tuned (for the warm-up's summary).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WsStats {
    /// Variants loaded.
    pub built: usize,
    /// Of those, cubins found in the kernel cache (memory or disk).
    pub cubin_hits: usize,
    /// Cases whose variant was tuned now.
    pub tuned: usize,
    /// Cases whose variant came from the tuning cache.
    pub tune_hits: usize,
}

/// The tuned warp-specialized runner.
pub struct WsRunner {
    kernels: HashMap<WsConfig, GroupedGemm>,
    ops: Option<Operands_>,
    chosen: Option<WsConfig>,
    flush: Option<CudaSlice<u8>>,
    cache: Cache,
    tune: Arc<TuneCache>,
    compiler: Compiler,
    /// Every candidate timed now: (case label, candidate tag, microseconds).
    pub tuning: Vec<(String, String, f64)>,
    /// What was built and tuned.
    pub stats: WsStats,
}

impl Default for WsRunner {
    fn default() -> Self {
        WsRunner::new()
    }
}

impl WsRunner {
    /// A runner with nothing loaded, its kernel and tuning caches in memory only, compiling with
    /// the driver's JIT.
    pub fn new() -> WsRunner {
        WsRunner::with_caches(Cache::new(None), TuneCache::new(None), Compiler::Driver)
    }

    /// A runner over the kernel cache and tuning cache of `settings.cache_dir`, compiling with the
    /// compiler `settings.jit` asks for.
    pub fn with_settings(settings: &crate::runtime::Settings) -> Result<WsRunner> {
        Ok(WsRunner::with_caches(
            Cache::new(settings.cache_dir.clone()),
            TuneCache::new(settings.cache_dir.clone()),
            Compiler::resolve(&settings.jit)?,
        ))
    }

    /// A runner over the given caches and compiler.
    pub fn with_caches(cache: Cache, tune: TuneCache, compiler: Compiler) -> WsRunner {
        WsRunner {
            kernels: HashMap::new(),
            ops: None,
            chosen: None,
            flush: None,
            cache,
            tune: Arc::new(tune),
            compiler,
            tuning: Vec::new(),
            stats: WsStats::default(),
        }
    }

    /// Load `cfg` on `dev` (its cubin through the kernel cache) unless it is loaded; whether it was
    /// loaded now.
    pub fn build(&mut self, dev: &Device, cfg: &WsConfig) -> Result<bool> {
        if self.kernels.contains_key(cfg) {
            return Ok(false);
        }
        let g = GroupedGemm::load_cached(dev, cfg, &self.cache, &self.compiler)?;
        self.stats.built += 1;
        if matches!(g.cubin_hit(), Some(Hit::Memory | Hit::Disk)) {
            self.stats.cubin_hits += 1;
        }
        self.kernels.insert(*cfg, g);
        Ok(true)
    }

    fn launch_cfg(&mut self, dev: &Device, cfg: &WsConfig) -> Result<()> {
        let (Some(o), Some(g)) = (self.ops.as_mut(), self.kernels.get(cfg)) else {
            return Err(Error::Usage("GEMM bench: launch before prepare".into()));
        };
        let scaled = cfg.scaling != Scaling::None;
        let op = GemmOperands {
            x: &o.x,
            w: &o.w,
            offsets: &o.offsets,
            x_scale: scaled.then_some(&o.x_scale),
            w_scale: scaled.then_some(&o.w_scale),
            group_scales: o.group_scales.as_ref(),
            w_layout: None,
            t: o.t,
            experts: o.experts,
            act_out: None,
        };
        // SAFETY: `offsets` holds the exclusive prefix sums of the case's row counts
        // (non-decreasing from 0, ending at `t`); the other sizes are checked by `run`.
        unsafe { g.run(dev, &op, &mut o.y) }?;
        Ok(())
    }

    fn prepare_operands(&mut self, dev: &Device, case: &GemmCase) -> Result<()> {
        let t = case.rows_total();
        let key = (case.recipe, case.experts, case.n, case.k, t);
        if self.ops.as_ref().is_some_and(|o| o.key == key) {
            return Ok(());
        }
        self.ops = None;
        let (operands, scaling) = case.recipe.family();
        let eb = operands.bytes() as usize;
        let mut chunk = vec![0u8; 8 << 20];
        match operands {
            Operands::Bf16 => random_bf16(&mut chunk, 0x5EED_0002),
            _ => random_e4m3(&mut chunk, 0x5EED_0003),
        }
        let alloc = |n: usize| {
            dev.stream
                .alloc_zeros::<u8>(n.max(1))
                .map_err(drv("cuMemAlloc"))
        };
        let mut w = alloc(case.experts * case.n * operands.w_row_bytes(case.k as u64) as usize)?;
        fill_device(dev, &mut w, &chunk)?;
        let mut x = alloc(t * case.k * eb)?;
        fill_device(dev, &mut x, &chunk)?;
        let y = alloc(t * case.n * 2)?;
        let (kb, nb) = (case.k.div_ceil(128), case.n.div_ceil(128));
        let xs = vec![1.0f32 / 64.0; (kb * t).max(1)];
        // Enough weight scales for every family (per expert, per block, per row).
        let ws = vec![1.0f32 / 256.0; (case.experts * (nb * kb).max(case.n)).max(1)];
        // 4-bit weights' group scales, enough for groups of 16 of bf16 (0x3c bytes: E4M3 1.5,
        // E8M0 2^-67, bf16 2^-7 pairs); group-wise int8's and FP8's f32 scales (0x3c3c3c3c, about
        // 0.0115), enough for groups of 64.
        let group_bytes = match (operands, scaling) {
            (Operands::W4Bf16(_), _) => Some(case.experts * case.k.div_ceil(16) * case.n * 2),
            (_, Scaling::PerRowGroup { .. } | Scaling::Groupwise { .. }) => {
                Some(case.experts * case.k.div_ceil(64) * case.n * 4)
            }
            _ => None,
        };
        let group_scales = match group_bytes {
            Some(len) => {
                let mut g = alloc(len)?;
                fill_device(dev, &mut g, &[0x3c; 4096])?;
                Some(g)
            }
            None => None,
        };
        let x_scale = dev.stream.clone_htod(&xs).map_err(drv("cuMemcpyHtoD"))?;
        let w_scale = dev.stream.clone_htod(&ws).map_err(drv("cuMemcpyHtoD"))?;
        let offsets: Vec<i32> = case
            .offsets()
            .into_iter()
            .map(|o| i32::try_from(o).unwrap_or(i32::MAX))
            .collect();
        let offsets = dev
            .stream
            .clone_htod(&offsets)
            .map_err(drv("cuMemcpyHtoD"))?;
        self.ops = Some(Operands_ {
            key,
            x,
            w,
            x_scale,
            w_scale,
            group_scales,
            y,
            offsets,
            t,
            experts: case.experts,
        });
        Ok(())
    }

    /// Time one launch of `cfg` on the prepared operands after an L2 flush, in microseconds (with
    /// `warm`, after one untimed launch).
    fn time_once(&mut self, dev: &Device, cfg: &WsConfig, warm: bool) -> Result<f64> {
        self.build(dev, cfg)?;
        if warm {
            self.launch_cfg(dev, cfg)?;
        }
        if self.flush.is_none() {
            self.flush = Some(
                dev.stream
                    .alloc_zeros::<u8>(TUNE_FLUSH_BYTES)
                    .map_err(drv("cuMemAlloc"))?,
            );
        }
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        if let Some(f) = self.flush.as_mut() {
            dev.stream.memset_zeros(f).map_err(drv("cuMemsetD8"))?;
        }
        let a = dev
            .stream
            .record_event(timing)
            .map_err(drv("cuEventRecord"))?;
        self.launch_cfg(dev, cfg)?;
        let b = dev
            .stream
            .record_event(timing)
            .map_err(drv("cuEventRecord"))?;
        dev.sync()?;
        Ok(f64::from(a.elapsed_ms(&b).map_err(drv("cuEventElapsedTime"))?) * 1e3)
    }

    /// The variant for `case` on `dev` (a Hopper GPU) and where the choice came from: the tuning
    /// cache's entry for the case's family, N, K, experts and row bucket, else every candidate
    /// timed now (`TUNE_REPS` launches each, in candidate order) on the case's operands (made
    /// here) and the fastest stored.
    pub fn choose(&mut self, dev: &Device, case: &GemmCase) -> Result<(WsConfig, TuneSource)> {
        let (n, k, e) = match (
            u32::try_from(case.n),
            u32::try_from(case.k),
            u32::try_from(case.experts),
        ) {
            (Ok(n), Ok(k), Ok(e)) => (n, k, e),
            _ => {
                return Err(Error::Usage(format!(
                    "N = {}, K = {}, {} experts do not fit the kernel",
                    case.n, case.k, case.experts
                )))
            }
        };
        let (operands, scaling) = case.recipe.family();
        let all = crate::moe_gpu_layer::tune_candidates(operands, scaling, n, k);
        let out = all.first().map_or(OutTy::Bf16, |c| c.out);
        let key = TuneKey::for_device(
            dev,
            operands,
            scaling,
            out,
            Epilogue::Store,
            n,
            k,
            e,
            case.rows_total(),
        );
        let label = format!("{} {} {}", case.model, case.recipe.name(), case.tokens);
        let cache = Arc::clone(&self.tune);
        let mut prepared = false;
        let mut last: Option<WsConfig> = None;
        let (entry, source) = gemm_tune::tune(&cache, &key, &all, TUNE_REPS as u32, |cfg| {
            if !prepared {
                self.prepare_operands(dev, case)?;
                prepared = true;
            }
            // The first launch of each candidate is untimed (module and tensor maps warm).
            let warm = last != Some(*cfg);
            last = Some(*cfg);
            let us = self.time_once(dev, cfg, warm)?;
            self.tuning.push((label.clone(), cfg.tag(), us));
            // Progress on stderr: every launch timed, for the record of how a choice was made.
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "tune {label}: {} {us:.1} us", cfg.tag());
            Ok::<f64, Error>(us)
        })?;
        match source {
            TuneSource::Cached => self.stats.tune_hits += 1,
            TuneSource::Tuned => self.stats.tuned += 1,
        }
        Ok((entry.choice, source))
    }
}

impl GemmRunner for WsRunner {
    fn prepare(&mut self, dev: &Device, case: &GemmCase) -> Result<Prepared> {
        self.chosen = None;
        if dev.target() != Some(crate::codegen::ptx::Target::Sm90a) {
            return Ok(Prepared::NotBuilt(
                "the grouped GEMM is sm_90a (Hopper) only".into(),
            ));
        }
        let (n, k) = match (u32::try_from(case.n), u32::try_from(case.k)) {
            (Ok(n), Ok(k)) => (n, k),
            _ => {
                return Err(Error::Usage(format!(
                    "N = {}, K = {} do not fit the kernel",
                    case.n, case.k
                )))
            }
        };
        let (cfg, source) = self.choose(dev, case)?;
        self.prepare_operands(dev, case)?;
        self.build(dev, &cfg)?;
        self.chosen = Some(cfg);
        let (operands, scaling) = case.recipe.family();
        let how = match source {
            TuneSource::Cached => "cached tuning".to_string(),
            TuneSource::Tuned => format!(
                "tuned now over {}",
                crate::moe_gpu_layer::tune_candidates(operands, scaling, n, k).len()
            ),
        };
        Ok(Prepared::Ready(format!("ws {} ({how})", cfg.tag())))
    }

    fn launch(&mut self, dev: &Device) -> Result<()> {
        let Some(cfg) = self.chosen else {
            return Err(Error::Usage("GEMM bench: launch before prepare".into()));
        };
        self.launch_cfg(dev, &cfg)
    }
}
