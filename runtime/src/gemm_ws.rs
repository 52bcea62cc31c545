//! The warp-specialized grouped GEMM (`codegen::gemm::ws`, v1) on the device: bf16 or e4m3 `X [T, K]`
//! (rows sorted by expert) times `W [E, N, K]` into f32 or bf16 `Y [T, N]`, per-expert row offsets
//! read by the kernel from device memory (no host sync, so a CUDA graph can capture it), FP8 scales
//! applied to the f32 accumulator. [`GroupedGemm::load`] JITs one variant and opts it in to its
//! shared memory; [`GroupedGemm::run`] builds (or finds in its cache) the two tensor maps and launches
//! a persistent grid of at most `SMs x occupancy` CTAs.

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, DevicePtr, LaunchConfig};
use std::sync::Arc;

use moeforge_codegen::gemm::desc::{Swizzle, TensorMapParams, WgmmaDtype};
use moeforge_codegen::gemm::wmap::WLayout;
use moeforge_codegen::gemm::ws::{
    self, AQuant, Operands, Scaling, WRows, WsConfig, BLOCK_SCALE_W_BOX,
};

use crate::cache::{Cache, Hit};
use crate::jit::Compiler;
use crate::tma::TensorMapCache;
use crate::{drv, Device, Error, Result};

/// The variant's entry name (`moeforge_gemm_{tag}`) and its PTX module (sm_90a).
pub fn variant_ptx(cfg: &WsConfig) -> Result<(String, String)> {
    let entry = format!("moeforge_gemm_{}", cfg.tag());
    let ptx = ws::grouped_ws_module(&entry, cfg)?;
    Ok((entry, ptx))
}

/// The cache key of a GEMM variant's PTX text: BLAKE3 of the text, the target and the moeforge
/// version (the text holds everything the variant is; its cubin's key adds the compiler through
/// [`Cache::cubin_key`], as the pack kernels' do).
pub fn ptx_text_key(ptx: &str) -> String {
    let mut h = blake3::Hasher::new();
    for part in ["moeforge-gemm-ptx", env!("CARGO_PKG_VERSION"), "sm_90a"] {
        h.update(part.as_bytes());
        h.update(&[0]);
    }
    h.update(ptx.as_bytes());
    h.finalize().to_hex().to_string()
}

/// The cubin of the PTX module `ptx` (entry `entry`) from `cache`, or compiled by `compiler` and
/// stored there: the driver's JIT needs `dev`, ptxas does not (a warm-up without a GPU). Returns
/// the cubin, where it came from, and the compiler's log (empty on a hit).
pub fn variant_cubin(
    cache: &Cache,
    compiler: &Compiler,
    dev: Option<&Device>,
    entry: &str,
    ptx: &str,
) -> Result<(Arc<Vec<u8>>, Hit, String)> {
    let key = Cache::cubin_key(
        &ptx_text_key(ptx),
        &compiler.key_part(dev.map_or(0, |d| d.driver_version)),
    );
    let mut log = String::new();
    let (cubin, hit) = cache.get_or_insert("cubin", &key, || {
        let (c, l) = match (compiler, dev) {
            (Compiler::Driver, Some(dev)) => crate::jit::link_ptx(dev, entry, ptx)?,
            (Compiler::Driver, None) => {
                return Err(Error::NoDriver(
                    "the driver's JIT needs a device (ptxas does not)".into(),
                ))
            }
            (Compiler::Ptxas { path, .. }, _) => {
                crate::jit::ptxas_compile(path, "sm_90a", entry, ptx)?
            }
        };
        log = l;
        Ok(c)
    })?;
    Ok((cubin, hit, log))
}

/// One loaded variant.
pub struct GroupedGemm {
    _module: Arc<CudaModule>,
    func: CudaFunction,
    cfg: WsConfig,
    entry: String,
    maps: TensorMapCache,
    /// CTAs of the persistent grid when there is enough work: SMs x resident CTAs per SM.
    max_ctas: u32,
    /// The driver JIT's verbose log (registers, spills).
    jit_log: String,
    /// Where the cubin came from, when a cache was used.
    cubin_hit: Option<Hit>,
    /// Split-K's f32 workspace and per-tile arrival counters (zeroed once; the last split of a
    /// tile resets its counter), grown to the largest launch seen.
    split: std::sync::Mutex<Option<SplitBuffers>>,
    /// The E4M3 output's token-tile arrival counters (zeroed once; the finishing CTA resets
    /// each), grown to the largest launch seen.
    token_counters: std::sync::Mutex<Option<CudaSlice<u32>>>,
}

/// Split-K's device buffers.
struct SplitBuffers {
    workspace: CudaSlice<f32>,
    counters: CudaSlice<u32>,
}

impl std::fmt::Debug for GroupedGemm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GroupedGemm({}, max {} CTAs)", self.entry, self.max_ctas)
    }
}

/// The operands of one launch (device buffers; sizes are checked by [`GroupedGemm::run`]).
#[derive(Debug, Clone, Copy)]
pub struct GemmOperands<'a> {
    /// `X [t, K]` (bf16 or e4m3 bytes), rows sorted by expert.
    pub x: &'a CudaSlice<u8>,
    /// `W [experts, N, K]`: bf16 or e4m3 bytes; int8 codes in the kernel's order, rows padded to
    /// a multiple of 64 bytes (`[experts, N, ceil(K / 64) 64]`,
    /// `codegen::gemm::reference::i8_kernel_place`); or for 4-bit weights `[experts, N, K/2]` bytes of
    /// two codes each, in the kernel's order (`codegen::gemm::reference::w4_kernel_bits`).
    pub w: &'a CudaSlice<u8>,
    /// i32 `[experts + 1]`, exclusive row offsets.
    pub offsets: &'a CudaSlice<i32>,
    /// Activation scales: `[t]` per token or `[1]` (tensorwise), `[ceil(K/128), t]` (block128).
    pub x_scale: Option<&'a CudaSlice<f32>>,
    /// Weight scales: `[experts]` (tensorwise), `[experts, ceil(N/128), ceil(K/128)]` (block128).
    pub w_scale: Option<&'a CudaSlice<f32>>,
    /// 4-bit weights' group scales, `[experts, scale tiles, N, groups per k-tile]`
    /// (`W4::group_scale_at`; E4M3 or E8M0 bytes, bf16, or bf16 with zero points); group-wise
    /// int8's (`Scaling::PerRowGroup`), `[experts, ceil(K / group), N]` f32.
    pub group_scales: Option<&'a CudaSlice<u8>>,
    /// Where `w`'s rows are, for a variant compiled for the recipe's own row modes
    /// (`WsConfig::w_rows` not `WRows::PLAIN`; bf16 and E4M3 weights read in place): the
    /// dimensions after K, their byte strides and the kernel's `WRows` (which must be the
    /// variant's). The compact map itself may be given too, for any operands (a param stored as
    /// the operand, int8 codes in the kernel's order included). `None`: the compact
    /// `[experts, N, K]` above.
    pub w_layout: Option<&'a WLayout>,
    /// Rows of X.
    pub t: usize,
    /// Experts.
    pub experts: usize,
    /// Where a variant with the E4M3 output of `a` (`Epilogue::SiluMulE4m3`) writes it; `None`
    /// for every other variant.
    pub act_out: Option<ActOutBuffers<'a>>,
}

/// The E4M3 output of the fused first GEMM ([`GemmOperands::act_out`]).
#[derive(Debug, Clone, Copy)]
pub struct ActOutBuffers<'a> {
    /// E4M3 codes `[t, N / 2]`.
    pub codes: &'a CudaSlice<u8>,
    /// Their f32 scales (`AQuant::scales_len` of `t` rows; group-major per 1x128 group, with
    /// row stride `t`).
    pub scales: &'a CudaSlice<f32>,
    /// The static activation scale per expert (`[experts]`, positive and finite), for
    /// `AQuant::Static` only.
    pub static_scales: Option<&'a CudaSlice<f32>>,
    /// With static scales: whether the f32 `a` is stored into `y` too (the other forms always
    /// store it; without it `y` is not written).
    pub a_f32: bool,
}

fn map_err(e: moeforge_codegen::gemm::desc::DescError) -> Error {
    Error::Placement(format!("tensor map: {e}"))
}

fn short(what: &str, got: usize, want: usize) -> Error {
    Error::Placement(format!(
        "grouped GEMM: `{what}` has {got} elements, needs at least {want}"
    ))
}

impl GroupedGemm {
    /// Generate the variant `cfg`, JIT it for `dev` (Hopper, sm_90a, only) with the driver's JIT
    /// linker, load it and allow it its dynamic shared memory. No cache: every call compiles
    /// ([`GroupedGemm::load_cached`] goes through the kernel cache).
    pub fn load(dev: &Device, cfg: &WsConfig) -> Result<GroupedGemm> {
        crate::device::hopper_only(dev, "the grouped GEMM")?;
        let (entry, ptx) = variant_ptx(cfg)?;
        let (cubin, jit_log) = crate::jit::link_ptx(dev, &entry, &ptx)?;
        GroupedGemm::from_cubin(dev, cfg, entry, cubin, jit_log, None)
    }

    /// [`GroupedGemm::load`] with the cubin from the kernel cache `cache` (keyed by the PTX text and
    /// the compiler, as the pack kernels' cubins are: [`variant_cubin`]), compiled by `compiler` and
    /// stored there on a miss, so that a process pays the JIT of a variant once. The JIT log is
    /// empty when the cubin came from the cache.
    pub fn load_cached(
        dev: &Device,
        cfg: &WsConfig,
        cache: &Cache,
        compiler: &Compiler,
    ) -> Result<GroupedGemm> {
        crate::device::hopper_only(dev, "the grouped GEMM")?;
        let (entry, ptx) = variant_ptx(cfg)?;
        let (cubin, hit, jit_log) = variant_cubin(cache, compiler, Some(dev), &entry, &ptx)?;
        GroupedGemm::from_cubin(dev, cfg, entry, cubin.as_ref().clone(), jit_log, Some(hit))
    }

    fn from_cubin(
        dev: &Device,
        cfg: &WsConfig,
        entry: String,
        cubin: Vec<u8>,
        jit_log: String,
        cubin_hit: Option<Hit>,
    ) -> Result<GroupedGemm> {
        let module = dev
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(drv("cuModuleLoadData"))?;
        let func = module
            .load_function(&entry)
            .map_err(drv("cuModuleGetFunction"))?;
        func.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            i32::try_from(cfg.dynamic_smem_bytes()).unwrap_or(i32::MAX),
        )
        .map_err(drv("cuFuncSetAttribute"))?;
        let per_sm = func
            .occupancy_max_active_blocks_per_multiprocessor(
                cfg.threads(),
                cfg.dynamic_smem_bytes() as usize,
                None,
            )
            .map_err(drv("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
        if per_sm == 0 {
            return Err(Error::Placement(format!(
                "grouped GEMM {entry}: no CTA fits on an SM ({} bytes of shared memory)",
                cfg.dynamic_smem_bytes()
            )));
        }
        Ok(GroupedGemm {
            _module: module,
            func,
            cfg: *cfg,
            entry,
            maps: TensorMapCache::new(),
            max_ctas: dev.sms.max(1) * per_sm,
            jit_log,
            cubin_hit,
            split: std::sync::Mutex::new(None),
            token_counters: std::sync::Mutex::new(None),
        })
    }

    /// Where the cubin came from ([`GroupedGemm::load_cached`]); `None` when it was compiled
    /// without a cache ([`GroupedGemm::load`]).
    pub fn cubin_hit(&self) -> Option<Hit> {
        self.cubin_hit
    }

    /// The variant.
    pub fn config(&self) -> &WsConfig {
        &self.cfg
    }

    /// The entry name.
    pub fn entry(&self) -> &str {
        &self.entry
    }

    /// The JIT's verbose log.
    pub fn jit_log(&self) -> &str {
        &self.jit_log
    }

    /// Registers per thread and spilled bytes (stores plus loads) as the JIT reported them, where
    /// its log says.
    pub fn jit_registers_and_spills(&self) -> (Option<u32>, Option<u64>) {
        jit_registers_and_spills(&self.jit_log)
    }

    /// CTAs launched for `t` rows over `experts` experts: the work-item bound (tiles times
    /// splits), at most SMs x occupancy.
    pub fn grid(&self, t: usize, experts: usize) -> u32 {
        let items = self.cfg.items_upper_bound(t as u64, experts as u64);
        u32::try_from(items.min(u64::from(self.max_ctas))).unwrap_or(self.max_ctas)
    }

    /// `Y[rows of e] = X[rows of e] · W[e]^T` (scaled as the variant says) into `y` (`[t, N]` f32 or
    /// bf16 bytes). Only rows inside some expert's range are written. Queued on `dev.stream`;
    /// returns without waiting.
    ///
    /// # Safety
    /// The *contents* of `offsets` (device memory, not read here) must be non-decreasing from 0 with
    /// `offsets[experts] <= t`: the kernel stores the rows they name and reads the activation
    /// scales of those rows. The buffers' sizes are checked here.
    pub unsafe fn run(
        &self,
        dev: &Device,
        op: &GemmOperands<'_>,
        y: &mut CudaSlice<u8>,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let (n, k, t, e) = (cfg.n as usize, cfg.k as usize, op.t, op.experts);
        let eb = cfg.operands.bytes() as usize;
        if op.x.len() < t * k * eb {
            return Err(short("x", op.x.len(), t * k * eb));
        }
        let compact = WLayout::compact(e as u64, n as u64, cfg.w_row_bytes());
        let layout = weight_layout(cfg, op.w_layout, &compact, e as u64).ok_or_else(|| {
            Error::Placement(format!(
                "grouped GEMM {}: the weight layout given is not the one the variant is compiled for ({:?}, {} rows over {e} experts)",
                self.entry, cfg.w_rows, cfg.n
            ))
        })?;
        // (An in-place layout's expert dimension is the slots it holds, folded or not.)
        let w_len = usize::try_from(layout.span_bytes(cfg.w_row_bytes())).unwrap_or(usize::MAX);
        if op.w.len() < w_len {
            return Err(short("w", op.w.len(), w_len));
        }
        // 4-bit weights' group scales: `[experts, scale tiles, N]` (`W4::group_scale_at`);
        // group-wise int8's and FP8's: `[experts, ceil(K / group), N]` f32. (groups, element
        // bytes, address)
        let group_scales = match (cfg.operands, cfg.scaling.row_group(), op.group_scales) {
            (Operands::W4Bf16(w4), _, Some(gs)) => {
                let groups = w4.scale_tiles(k);
                let want = w4.group_scale_bytes(e, n, k);
                if gs.len() < want {
                    return Err(short("group_scales", gs.len(), want));
                }
                Some((groups, w4.scale_tile_bytes(), gs.device_ptr(&dev.stream).0))
            }
            (_, Some(group), Some(gs)) => {
                let groups = k.div_ceil(group.max(1) as usize);
                let want = e * groups * n * 4;
                if gs.len() < want {
                    return Err(short("group_scales", gs.len(), want));
                }
                Some((groups, 4, gs.device_ptr(&dev.stream).0))
            }
            (Operands::W4Bf16(_), _, None) | (_, Some(_), None) => {
                return Err(Error::Placement(format!(
                    "grouped GEMM {}: `group_scales` is required",
                    self.entry
                )))
            }
            _ => None,
        };
        if op.offsets.len() < e + 1 {
            return Err(short("offsets", op.offsets.len(), e + 1));
        }
        let (ob, cols) = (cfg.out.bytes() as usize, cfg.out_cols() as usize);
        if y.len() < t * cols * ob {
            return Err(short("y", y.len(), t * cols * ob));
        }
        let (kb, nb) = (k.div_ceil(128), n.div_ceil(128));
        let (want_x, want_w) = match cfg.scaling {
            Scaling::None => (0, 0),
            Scaling::Tensorwise { per_token } => (if per_token { t } else { 1 }, e),
            Scaling::Block128 => (kb * t, e * nb * kb),
            Scaling::Channelwise { per_token } => (if per_token { t } else { 1 }, e * n),
            Scaling::PerRow => (0, e * n),
            Scaling::PerExpert => (0, e),
            Scaling::PerRowGroup { .. } => (0, 0),
            Scaling::Groupwise { per_token, .. } => (if per_token { t } else { 1 }, 0),
        };
        // The kernel's block-scale box coordinates are u32 sums that TMA reads as s32: refuse
        // scale vectors they could not address (`(e * NB + blk) * KT + kt` plus a box).
        if cfg.scaling == Scaling::Block128 && want_w.max(want_x) + nb * kb >= 1 << 31 {
            return Err(Error::Placement(format!(
                "grouped GEMM {}: {} weight and {} activation block scales (TMA coordinates reach 2^31)",
                self.entry, want_w, want_x
            )));
        }
        let scale = |s: Option<&CudaSlice<f32>>, what: &str, want: usize| -> Result<u64> {
            match s {
                None if want == 0 => Ok(0),
                None => Err(Error::Placement(format!(
                    "grouped GEMM {}: `{what}` is required ({want} f32)",
                    self.entry
                ))),
                Some(s) if s.len() < want => Err(short(what, s.len(), want)),
                Some(s) => Ok(s.device_ptr(&dev.stream).0),
            }
        };
        let xs = scale(op.x_scale, "x_scale", want_x)?;
        let ws = scale(op.w_scale, "w_scale", want_w)?;
        if t == 0 || e == 0 {
            return Ok(());
        }
        let (t32, e32) = match (u32::try_from(t), u32::try_from(e)) {
            (Ok(a), Ok(b)) if a < i32::MAX as u32 && b < 65536 => (a, b),
            _ => {
                return Err(Error::Placement(format!(
                    "grouped GEMM: {t} rows over {e} experts is past the kernel's 32-bit indices"
                )))
            }
        };
        if cfg.items_upper_bound(t as u64, e as u64) >= u64::from(u32::MAX) {
            return Err(Error::Placement(format!(
                "grouped GEMM: {t} rows over {e} experts is past the kernel's 32-bit tile ids"
            )));
        }
        let dtype = match cfg.operands {
            Operands::Bf16 | Operands::I8Bf16 | Operands::W4Bf16(_) => WgmmaDtype::Bf16,
            Operands::E4m3 => WgmmaDtype::E4m3,
        };
        // The TMA boxes: a tile's token rows of X and its weight rows of W.
        let (x_rows, w_rows) = (cfg.tile_tokens(), cfg.tile_weights());
        let (xp, _xs) = op.x.device_ptr(&dev.stream);
        let (wp, _ws) = op.w.device_ptr(&dev.stream);
        let px = TensorMapParams::k_major(dtype, Swizzle::B128, xp, t as u64, k as u64, x_rows)
            .map_err(map_err)?;
        let pw = if cfg.operands.register_a() {
            // Int8 or 4-bit codes: boxes of a k-tile's bytes per row, unswizzled (the consumers
            // read them with `ld.shared` into register fragments, not through a descriptor).
            TensorMapParams::expert_rows_u8(
                wp,
                e as u64,
                n as u64,
                cfg.w_row_bytes(),
                cfg.a_row_bytes(),
                w_rows,
            )
            .map_err(map_err)?
        } else if op.w_layout.is_none() {
            TensorMapParams::expert_k_major(
                dtype,
                Swizzle::B128,
                wp,
                e as u64,
                n as u64,
                k as u64,
                w_rows,
            )
            .map_err(map_err)?
        } else {
            let boxes = cfg.w_rows.boxes(cfg.n, w_rows).ok_or_else(|| {
                Error::Placement(format!(
                    "grouped GEMM {}: a tile of {w_rows} weight rows is no box of its row modes",
                    self.entry
                ))
            })?;
            TensorMapParams::strided_k_major(
                dtype,
                Swizzle::B128,
                wp.saturating_add(layout.base),
                k as u64,
                &layout.extents,
                &layout.strides,
                &boxes,
            )
            .map_err(map_err)?
        };
        let tmap_x = self.maps.get(&px)?;
        let tmap_w = self.maps.get(&pw)?;
        // The block scales' 1-D maps (a k-tile's weight-scale box and its token rows of activation
        // scales); variants without block scales never read these parameters and get the X map.
        let (tmap_xs, tmap_ws) = if cfg.scaling == Scaling::Block128 {
            let pxs = TensorMapParams::f32_vector(xs, want_x as u64, x_rows + ws::BLOCK_SCALE_PAD)
                .map_err(map_err)?;
            let pws = TensorMapParams::f32_vector(ws, want_w as u64, BLOCK_SCALE_W_BOX)
                .map_err(map_err)?;
            (self.maps.get(&pxs)?, self.maps.get(&pws)?)
        } else if let Some((groups, elem, gp)) = group_scales {
            let pgs = TensorMapParams::expert_group_scales(
                gp,
                e as u64,
                groups as u64,
                n as u64,
                elem,
                w_rows,
            )
            .map_err(map_err)?;
            (tmap_x, self.maps.get(&pgs)?)
        } else {
            (tmap_x, tmap_x)
        };
        let cfg_l = LaunchConfig {
            grid_dim: (self.grid(t, e), 1, 1),
            block_dim: (cfg.threads(), 1, 1),
            shared_mem_bytes: cfg.dynamic_smem_bytes(),
        };
        // Split-K's buffers, sized for this launch's tile bound (zeroed counters on growth).
        let mut split_guard = self
            .split
            .lock()
            .map_err(|_| Error::Placement("grouped GEMM: split-K buffers poisoned".into()))?;
        let (wsp, cntp) = if cfg.split_k > 1 {
            let tiles = cfg.tiles_upper_bound(t as u64, e as u64) as usize;
            let elems = tiles * cfg.split_k as usize * cfg.partial_elems() as usize;
            let fits = split_guard
                .as_ref()
                .is_some_and(|b| b.workspace.len() >= elems && b.counters.len() >= tiles);
            if !fits {
                *split_guard = None;
                let workspace = dev
                    .stream
                    .alloc_zeros::<f32>(elems)
                    .map_err(drv("cuMemAlloc"))?;
                let counters = dev
                    .stream
                    .alloc_zeros::<u32>(tiles)
                    .map_err(drv("cuMemAlloc"))?;
                *split_guard = Some(SplitBuffers {
                    workspace,
                    counters,
                });
            }
            match split_guard.as_ref() {
                Some(b) => (
                    b.workspace.device_ptr(&dev.stream).0,
                    b.counters.device_ptr(&dev.stream).0,
                ),
                None => (0, 0),
            }
        } else {
            (0, 0)
        };
        // The E4M3 output of `a`: codes, scales, the token tiles' counters (locked for the counted
        // forms only, until the launch is queued) and static scales.
        let mut counters_guard = None;
        let finish = match (cfg.epilogue.quant(), op.act_out.as_ref()) {
            (None, None) => None,
            (None, Some(_)) => {
                return Err(Error::Placement(format!(
                    "grouped GEMM {}: `act_out` given to a variant without the E4M3 output",
                    self.entry
                )))
            }
            (Some(_), None) => {
                return Err(Error::Placement(format!(
                    "grouped GEMM {}: the E4M3 output of `a` needs `act_out`",
                    self.entry
                )))
            }
            (Some(q), Some(ao)) => {
                if ao.codes.len() < t * cols {
                    return Err(short("act_out.codes", ao.codes.len(), t * cols));
                }
                let want = q.scales_len(t, cols);
                if ao.scales.len() < want {
                    return Err(short("act_out.scales", ao.scales.len(), want));
                }
                let st = match (q, ao.static_scales) {
                    (AQuant::Static, Some(v)) if v.len() >= e => v.device_ptr(&dev.stream).0,
                    (AQuant::Static, Some(v)) => {
                        return Err(short("act_out.static_scales", v.len(), e))
                    }
                    (AQuant::Static, None) => {
                        return Err(Error::Placement(format!(
                            "grouped GEMM {}: static activation scales are required",
                            self.entry
                        )))
                    }
                    _ => 0,
                };
                // (Static scales: the epilogue quantizes, nothing is counted.)
                let tiles = if q.counted() {
                    cfg.token_tiles_upper_bound(t as u64, e as u64) as usize
                } else {
                    0
                };
                let cnt = if tiles > 0 {
                    let guard =
                        counters_guard.insert(self.token_counters.lock().map_err(|_| {
                            Error::Placement("grouped GEMM: token-tile counters poisoned".into())
                        })?);
                    if guard.as_ref().is_none_or(|c| c.len() < tiles) {
                        **guard = None;
                        **guard = Some(
                            dev.stream
                                .alloc_zeros::<u32>(tiles)
                                .map_err(drv("cuMemAlloc"))?,
                        );
                    }
                    guard.as_ref().map_or(0, |c| c.device_ptr(&dev.stream).0)
                } else {
                    0
                };
                // Static E4M3 output without the f32 `a`: `y` is passed as 0 (the kernel stores
                // codes only).
                let no_a = q == AQuant::Static && !ao.a_f32;
                Some((
                    [
                        ao.codes.device_ptr(&dev.stream).0,
                        ao.scales.device_ptr(&dev.stream).0,
                        cnt,
                        st,
                    ],
                    no_a,
                ))
            }
        };
        let (yp, _ys) = y.device_ptr(&dev.stream);
        let yp = if finish.is_some_and(|(_, no_a)| no_a) {
            0
        } else {
            yp
        };
        let (op_off, _os) = op.offsets.device_ptr(&dev.stream);
        let mut l = crate::launch::KernelLaunch::new(dev, &self.func);
        l.val(&tmap_x)
            .val(&tmap_w)
            .val(&yp)
            .val(&op_off)
            .val(&xs)
            .val(&ws)
            .val(&e32)
            .val(&t32)
            .val(&wsp)
            .val(&cntp)
            .val(&tmap_xs)
            .val(&tmap_ws);
        if let Some((ptrs, _)) = &finish {
            for p in ptrs {
                l.val(p);
            }
        }
        // SAFETY: the arguments match the entry's parameters in order (two 128-byte tensor maps by
        // value, the u64 addresses of `y` (0 for a static E4M3 output without f32 `a`: the kernel
        // then stores no `a`), `offsets` and the two scale buffers (0 where the variant reads
        // none), the u32 expert and row counts, the split-K workspace and counters (0 without
        // split-K; with it sized for every tile of this launch's bound, the counters zero between
        // launches, and launches of one `GroupedGemm` ordered on its stream: the buffers are
        // guarded by the lock until queued), and two more 128-byte maps). The maps describe `x`
        // ([t, K]) and `w` ([experts, N, K]), and with block scales `x_scale` ([KB * t]) and
        // `w_scale` ([E * NB * KB]), with 4-bit weights `group_scales` ([E, scale tiles, N], `W4::group_scale_at`), whose
        // sizes were checked; TMA reads only inside them
        // (out-of-bounds boxes are zero-filled). The kernel reads `offsets[0..=experts]` (checked), scales at rows
        // below `offsets[experts]` and experts below `experts` (sizes checked), and stores `y` rows
        // below `offsets[experts]`, columns below N, inside `y` by the caller's guarantee on the
        // offsets' contents. With the E4M3 output of `a` (`finish`), four more u64: the codes
        // ([t, N / 2] bytes) and scales (`scales_len`) checked above, the token-tile counters
        // (sized for this launch's token-tile bound, zero between launches: the finishing CTA
        // resets each, and launches of one `GroupedGemm` are ordered on its stream, guarded by
        // the lock until queued) and the static scales ([experts], checked) or 0; the kernel
        // writes codes and scales of rows below `offsets[experts]` only. The buffers' guards live
        // until the launch has been queued.
        unsafe { l.launch(cfg_l) }?;
        Ok(())
    }
}

/// `Used N registers` and the sum of `N bytes spill stores` and `N bytes spill loads` in a
/// ptxas-style log.
pub fn jit_registers_and_spills(log: &str) -> (Option<u32>, Option<u64>) {
    let number_before = |line: &str, tail: &str| -> Option<u64> {
        let i = line.find(tail)?;
        line[..i].split_whitespace().last()?.parse().ok()
    };
    let number_after = |line: &str, head: &str| -> Option<u32> {
        let i = line.find(head)?;
        line[i + head.len()..]
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    let mut regs = None;
    let mut spills: Option<u64> = None;
    for line in log.lines() {
        if let Some(r) = number_after(line, "Used ") {
            regs = Some(r);
        }
        for tail in [" bytes spill stores", " bytes spill loads"] {
            if let Some(b) = number_before(line, tail) {
                spills = Some(spills.unwrap_or(0) + b);
            }
        }
    }
    (regs, spills)
}

/// The weight map a launch of `cfg` reads through, given the caller's `given` (`None`: the
/// compact `[experts, N, K]` operand, `compact`): the compact map itself for any operands (a param
/// stored as the operand, int8 codes in the kernel's order included), or a map of the variant's
/// row modes that serves its `n` rows over `experts` (bf16 and E4M3 only: the register-A kernels
/// read no row modes). `None`: the map is not the one the variant is compiled for.
pub fn weight_layout<'a>(
    cfg: &WsConfig,
    given: Option<&'a WLayout>,
    compact: &'a WLayout,
    experts: u64,
) -> Option<&'a WLayout> {
    match given {
        None if cfg.w_rows == WRows::PLAIN => Some(compact),
        Some(l) if l == compact && cfg.w_rows == WRows::PLAIN => Some(compact),
        Some(l)
            if l.rows == cfg.w_rows && !cfg.operands.register_a() && l.serves(cfg.n, experts) =>
        {
            Some(l)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeforge_codegen::gemm::ws::{Epilogue, OutTy};

    /// A bf16 decode variant: one consumer, 16 tokens, 4 stages, N 256, K 512, bf16 out.
    fn decode_16() -> WsConfig {
        WsConfig {
            operands: Operands::Bf16,
            scaling: Scaling::None,
            out: OutTy::Bf16,
            epilogue: Epilogue::Store,
            consumers: 1,
            bn: 16,
            stages: 4,
            swap_ab: true,
            split_k: 1,
            n: 256,
            k: 512,
            w_rows: WRows::PLAIN,
            two_slices: false,
            skip_idle: false,
        }
    }

    /// The map a launch reads its weights through: the compact map, given or not, for any
    /// operands; row modes only for bf16 and E4M3, only the variant's own, only where they serve.
    #[test]
    fn a_launch_takes_the_compact_map_for_any_operands_and_row_modes_for_its_own() {
        let cfg = |operands: Operands, w_rows: WRows| WsConfig {
            operands,
            out: OutTy::F32,
            w_rows,
            ..decode_16()
        };
        let int8 = cfg(Operands::I8Bf16, WRows::PLAIN);
        let compact = WLayout::compact(4, 256, int8.w_row_bytes());
        // Register-A int8: the compact map, given (the param read in place) or not.
        assert_eq!(weight_layout(&int8, None, &compact, 4), Some(&compact));
        let given = compact.clone();
        assert_eq!(
            weight_layout(&int8, Some(&given), &compact, 4),
            Some(&compact)
        );
        // ... but no other map: another expert count, another base, row modes.
        let other = WLayout::compact(5, 256, int8.w_row_bytes());
        assert_eq!(weight_layout(&int8, Some(&other), &compact, 4), None);
        let shifted = WLayout {
            base: 16,
            ..compact.clone()
        };
        assert_eq!(weight_layout(&int8, Some(&shifted), &compact, 4), None);
        let by8 = WRows {
            modes: 3,
            inner: [8, 2, 0],
            folded: false,
            up_first: false,
        };
        let modes = WLayout {
            rows: by8,
            base: 0,
            extents: vec![8, 2, 16, 4],
            strides: vec![512, 8192, 1024, 131072],
        };
        assert_eq!(weight_layout(&int8, Some(&modes), &compact, 4), None);
        assert_eq!(
            weight_layout(&cfg(Operands::I8Bf16, by8), Some(&modes), &compact, 4),
            None
        );
        // E4M3: the compact map as before, and a map of the variant's row modes that serves it.
        let e4m3 = cfg(Operands::E4m3, by8);
        let compact8 = WLayout::compact(4, 256, e4m3.w_row_bytes());
        assert_eq!(
            weight_layout(
                &cfg(Operands::E4m3, WRows::PLAIN),
                Some(&compact8),
                &compact8,
                4
            ),
            Some(&compact8)
        );
        assert!(modes.serves(256, 4));
        assert_eq!(
            weight_layout(&e4m3, Some(&modes), &compact8, 4),
            Some(&modes)
        );
        assert_eq!(weight_layout(&e4m3, None, &compact8, 4), None);
    }

    #[test]
    fn the_jit_log_gives_registers_and_spills() {
        let log = "ptxas info    : Function properties for k\n    0 bytes stack frame, 276 bytes spill stores, 280 bytes spill loads\nptxas info    : Used 168 registers, used 1 barriers";
        assert_eq!(jit_registers_and_spills(log), (Some(168), Some(556)));
        assert_eq!(jit_registers_and_spills(""), (None, None));
    }

    /// The cubin key follows the PTX text; the driver's JIT without a device is refused and stores
    /// nothing; where a ptxas is given (`MOEFORGE_PTXAS`, as `scripts/test` sets it) it compiles
    /// once, and the second request is a hit.
    #[test]
    fn variant_cubins_go_through_the_cache() {
        let cfg = decode_16();
        let (entry, ptx) = variant_ptx(&cfg).unwrap();
        assert_eq!(entry, format!("moeforge_gemm_{}", cfg.tag()));
        assert_eq!(
            ptx_text_key(&ptx),
            ptx_text_key(&variant_ptx(&cfg).unwrap().1)
        );
        let other = variant_ptx(&WsConfig { k: 1024, ..cfg }).unwrap().1;
        assert_ne!(ptx_text_key(&ptx), ptx_text_key(&other));
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::new(Some(dir.path().to_path_buf()));
        let err = variant_cubin(&cache, &Compiler::Driver, None, &entry, &ptx).unwrap_err();
        assert!(matches!(err, Error::NoDriver(_)), "{err}");
        assert!(cache.entries().unwrap().is_empty());
        let Some(ptxas) = std::env::var_os("MOEFORGE_PTXAS") else {
            return;
        };
        let compiler = Compiler::ptxas(std::path::Path::new(&ptxas)).unwrap();
        let (c1, hit, _) = variant_cubin(&cache, &compiler, None, &entry, &ptx).unwrap();
        assert_eq!(hit, Hit::Compiled);
        let fresh = Cache::new(Some(dir.path().to_path_buf()));
        let (c2, hit, log) = variant_cubin(&fresh, &compiler, None, &entry, &ptx).unwrap();
        assert_eq!((hit, log.as_str()), (Hit::Disk, ""));
        assert_eq!(c1, c2);
    }

    /// Without a driver there is no device to load on (`NoDriver`); with one, sm_90a loads.
    #[test]
    fn load_without_a_driver_is_no_driver() {
        let cfg = WsConfig {
            operands: Operands::Bf16,
            scaling: Scaling::None,
            out: OutTy::Bf16,
            epilogue: Epilogue::Store,
            consumers: 2,
            bn: 128,
            stages: 4,
            swap_ab: false,
            split_k: 1,
            n: 256,
            k: 512,
            w_rows: WRows::PLAIN,
            two_slices: false,
            skip_idle: false,
        };
        match Device::open(0) {
            Err(e) => assert!(matches!(e, Error::NoDriver(_)), "{e}"),
            Ok(dev) => match GroupedGemm::load(&dev, &cfg) {
                Ok(g) => assert!(g.grid(1, 1) >= 1),
                Err(e) => assert!(
                    matches!(e, Error::NoDriver(_))
                        && dev.target() != Some(moeforge_codegen::ptx::Target::Sm90a),
                    "{e}"
                ),
            },
        }
    }
}
