//! The warp-specialized grouped GEMM (`runtime::gemm_ws::GroupedGemm`) behind the GEMM benchmark's
//! [`GemmRunner`]: bf16, fp8_per_tensor (e4m3 with a per-expert weight scale and per-token
//! activation scales) and fp8_block128, bf16 output. For every case it tunes over the candidate set
//! of `codegen::gemm::tune` (each candidate timed with an L2 flush before each launch, the fastest
//! kept; the choice is named in the table) and then launches the chosen variant.

use std::collections::HashMap;

use cudarc::driver::CudaSlice;

use crate::bench_gemm::{
    fill_device, random_bf16, random_e4m3, GemmCase, GemmRunner, Prepared, Recipe,
};
use crate::codegen::gemm::tune;
use crate::codegen::gemm::ws::{Operands, Scaling, WsConfig};
use crate::runtime::gemm_ws::{GemmOperands, GroupedGemm};
use crate::runtime::{drv, Device};
use crate::{Error, Result};

/// Launches per candidate when tuning (after one warm-up).
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
    y: CudaSlice<u8>,
    offsets: CudaSlice<i32>,
    t: usize,
    experts: usize,
}

/// The tuned warp-specialized runner.
pub struct WsRunner {
    kernels: HashMap<WsConfig, GroupedGemm>,
    ops: Option<Operands_>,
    chosen: Option<WsConfig>,
    flush: Option<CudaSlice<u8>>,
    /// Every tuning outcome: (case label, candidate tag, microseconds).
    pub tuning: Vec<(String, String, f64)>,
}

impl Default for WsRunner {
    fn default() -> Self {
        WsRunner::new()
    }
}

/// The kernel family of a recipe.
pub fn family(recipe: Recipe) -> (Operands, Scaling) {
    match recipe {
        Recipe::Bf16 => (Operands::Bf16, Scaling::None),
        Recipe::Fp8PerTensor => (Operands::E4m3, Scaling::Tensorwise { per_token: true }),
        Recipe::Fp8Block128 => (Operands::E4m3, Scaling::Block128),
    }
}

impl WsRunner {
    /// A runner with nothing loaded.
    pub fn new() -> WsRunner {
        WsRunner {
            kernels: HashMap::new(),
            ops: None,
            chosen: None,
            flush: None,
            tuning: Vec::new(),
        }
    }

    fn kernel(&mut self, dev: &Device, cfg: &WsConfig) -> Result<&GroupedGemm> {
        if !self.kernels.contains_key(cfg) {
            let g = GroupedGemm::load(dev, cfg)?;
            self.kernels.insert(*cfg, g);
        }
        self.kernels
            .get(cfg)
            .ok_or_else(|| Error::Usage("GEMM bench: kernel not loaded".into()))
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
            t: o.t,
            experts: o.experts,
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
        let (operands, _) = family(case.recipe);
        let eb = operands.bytes() as usize;
        let mut chunk = vec![0u8; 8 << 20];
        match operands {
            Operands::Bf16 => random_bf16(&mut chunk, 0x5EED_0002),
            Operands::E4m3 => random_e4m3(&mut chunk, 0x5EED_0003),
        }
        let alloc = |n: usize| {
            dev.stream
                .alloc_zeros::<u8>(n.max(1))
                .map_err(drv("cuMemAlloc"))
        };
        let mut w = alloc(case.experts * case.n * case.k * eb)?;
        fill_device(dev, &mut w, &chunk)?;
        let mut x = alloc(t * case.k * eb)?;
        fill_device(dev, &mut x, &chunk)?;
        let y = alloc(t * case.n * 2)?;
        let (kb, nb) = (case.k.div_ceil(128), case.n.div_ceil(128));
        let xs = vec![1.0f32 / 64.0; (kb * t).max(1)];
        let ws = vec![1.0f32 / 256.0; (case.experts * nb * kb).max(1)];
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
            y,
            offsets,
            t,
            experts: case.experts,
        });
        Ok(())
    }

    /// Time `cfg` on the prepared operands: the mean of [`TUNE_REPS`] launches, each after an L2
    /// flush, in microseconds.
    fn time(&mut self, dev: &Device, cfg: &WsConfig) -> Result<f64> {
        self.kernel(dev, cfg)?;
        if self.flush.is_none() {
            self.flush = Some(
                dev.stream
                    .alloc_zeros::<u8>(TUNE_FLUSH_BYTES)
                    .map_err(drv("cuMemAlloc"))?,
            );
        }
        self.launch_cfg(dev, cfg)?;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut total = 0.0;
        for _ in 0..TUNE_REPS {
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
            total += f64::from(a.elapsed_ms(&b).map_err(drv("cuEventElapsedTime"))?) * 1e3;
        }
        Ok(total / TUNE_REPS as f64)
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
        self.prepare_operands(dev, case)?;
        let (operands, scaling) = family(case.recipe);
        let all = tune::candidates(operands, scaling, n, k);
        let mut best: Option<(WsConfig, f64)> = None;
        let label = format!("{} {} {}", case.model, case.recipe.name(), case.tokens);
        for cfg in &all {
            let us = self.time(dev, cfg)?;
            self.tuning.push((label.clone(), cfg.tag(), us));
            // Progress on stderr: every candidate's time, for the record of how a choice was made.
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "tune {label}: {} {us:.1} us", cfg.tag());
            if best.is_none_or(|(_, b)| us < b) {
                best = Some((*cfg, us));
            }
        }
        let Some((cfg, _)) = best else {
            return Ok(Prepared::NotBuilt("no candidate".into()));
        };
        self.chosen = Some(cfg);
        Ok(Prepared::Ready(format!(
            "ws {} (tuned over {})",
            cfg.tag(),
            all.len()
        )))
    }

    fn launch(&mut self, dev: &Device) -> Result<()> {
        let Some(cfg) = self.chosen else {
            return Err(Error::Usage("GEMM bench: launch before prepare".into()));
        };
        self.launch_cfg(dev, &cfg)
    }
}
