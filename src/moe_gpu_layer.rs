//! The MoE layer forward on a Hopper GPU (issue \[9\] item 2, SPEC §9), from the operands of
//! [`crate::moe_gpu`]: every step is a generated kernel queued on one stream, with no host
//! synchronization between them (the row offsets never leave the device):
//!
//! 1. route + permute (`runtime::permute`): logical ids to EPLB slots (`log2phy[e, t mod
//!    logcnt[e]]`), per-slot counts (the layer's EPLB load counters accumulate too), row offsets,
//!    expert-sorted rows of `x`, and each item's row (`pos_of`, what the combine reads);
//! 2. the first GEMM's feed, made by the permute's scatter as it gathers each row
//!    (`codegen::moe::permute::Gather`): the bf16 rows as they are, or E4M3 codes with per-token
//!    or 1x128 dynamic scales, or with each row's slot's static scale, quantized on the fly (the
//!    bits of `gemm::act_quant` and of the activation kernel's static rows; no kernel of its own).
//!    Rows longer than the scatter holds in registers (`H` past `permute::MAX_HIDDEN_E4M3`) are
//!    gathered in bf16 and quantized by a kernel of their own (`runtime::act_quant`, or
//!    `moe_kernels` for static scales), with the same bits;
//! 3. `w13` grouped GEMM (`runtime::gemm_ws`), f32 out `[n, 2I]`;
//! 4. `a = silu(gate) * up` in f32, fed to the second GEMM as the recipe declares (bf16, or E4M3
//!    per token / per 1x128 group / static). Where the first GEMM's weights pair (every recipe;
//!    `fp8_block128` where 2I is a multiple of 128), SiLU*up is in its epilogue by default
//!    (`codegen::gemm::ws::Epilogue::SiluMul`, weight rows uploaded in its paired order), with
//!    the same bits ([`GpuLayer::with_fusion`]): it writes `a` in bf16 where the second GEMM
//!    takes bf16 (bf16 and the weights-only recipes: steps 3 and 4 are one kernel), else `a` in
//!    f32 (half of `w13_out`'s bytes): with static activation scales the epilogue also stores its
//!    E4M3 codes and the rows' scales (`Epilogue::SiluMulE4m3`, the activation kernel's
//!    instructions: steps 3 and 4 are one kernel, and no kernel spreads static scales to rows);
//!    with dynamic ones the activation kernel quantizes it (`ActIn::F32`);
//! 5. `w2` grouped GEMM, f32 out `[n, H]`;
//! 6. combine: each token's `k` rows weighted by `topk_weights`, summed in `j` order in f32
//!    (`acc = acc + w * y`, two roundings, as the host), rounded to bf16 once.
//!
//! Scratch is sized once per `(max tokens, k)` and reused. The GEMM variant of each GEMM (f32
//! output) is the tuning cache's choice for the forward's row bucket (`T * k` rows over at most
//! `R` experts) when [`GpuLayer::tune`] (or an earlier process with the same cache folder) timed
//! it, else the untuned default of `codegen::gemm::tune`; variants load through the kernel cache.

use std::collections::HashMap;

use cudarc::driver::CudaSlice;

use crate::codegen::gemm::act_quant::Mode;
use crate::codegen::gemm::tune;
use crate::codegen::gemm::wmap::WLayout;
use crate::codegen::gemm::ws::{AQuant, Epilogue, Operands, OutTy, Scaling, WRows, WsConfig};
use crate::codegen::moe::act::{ActIn, ActOut};
use crate::codegen::moe::permute::{Gather, MAX_HIDDEN_E4M3, MAX_TOPK};
use crate::codegen::reference as r;
use crate::moe_gpu::{GemmWeights, LayerOperands};
use crate::moe_host::{Feed, Forward, MoeError, Replicas, Tokens};
use crate::runtime::act_quant::ActQuant;
use crate::runtime::cache::Cache;
use crate::runtime::eplb_state::{EplbLayerState, Policy};
use crate::runtime::gemm_tune::{self, TuneCache, TuneKey, TuneSource};
use crate::runtime::gemm_ws::{ActOutBuffers, GemmOperands, GroupedGemm};
use crate::runtime::jit::Compiler;
use crate::runtime::moe_kernels::{MoeAct, MoeCombine};
use crate::runtime::moves::{MovePlan, SlotMap};
use crate::runtime::permute::{Buffers, Permute};
use crate::runtime::slot_moves::{self, SlotBuffer};
use crate::runtime::{drv, Device};
use crate::{Error, Result};
use cudarc::driver::DevicePtr as _;

/// One GEMM's weights on the device.
struct DevWeights {
    operands: Operands,
    scaling: Scaling,
    /// The output type and epilogue of its variants: f32 `y` for the plain path, or the fused
    /// first GEMM's `a` (bf16, or f32 for an activation kernel that quantizes it).
    out: OutTy,
    epilogue: Epilogue,
    n: u32,
    k: u32,
    w: CudaSlice<u8>,
    /// Where `w`'s rows are when it is the recipe's param itself (read in place through its own
    /// row modes, or the compact map where the param is stored as the operand, int8 codes in the
    /// kernel's order included); `None`: the compact operand copied from the codes.
    layout: Option<WLayout>,
    scale: Option<CudaSlice<f32>>,
    /// 4-bit weights' group scales.
    group_scales: Option<CudaSlice<u8>>,
}

impl DevWeights {
    /// Upload `g`: the param's own bytes where `in_place` gives their map (the GEMM then reads
    /// them through it), else the operand's codes; its weight scales in the GEMM's row order
    /// (`paired`: the fused epilogue's, for the param read in place in that order).
    fn upload(
        dev: &Device,
        g: &GemmWeights,
        (out, epilogue): (OutTy, Epilogue),
        in_place: Option<&WLayout>,
        paired: bool,
    ) -> Result<DevWeights> {
        // Read in place in the paired order: the per-row scales and group scales in that order
        // (up rows first where the map reads them so).
        let unpaired =
            || Error::Usage("the first GEMM's rows do not pair for the fused epilogue".into());
        let up_first = in_place.is_some_and(|l| l.rows.up_first);
        let (paired_scales, paired_groups);
        let (scales, groups) = if paired {
            paired_scales = g.paired_scales(up_first).ok_or_else(unpaired)?;
            paired_groups = g.paired_group_scales(up_first).ok_or_else(unpaired)?;
            (&paired_scales, &paired_groups)
        } else {
            (&g.scales, &g.group_scales)
        };
        let dim = |x: usize, what: &str| {
            u32::try_from(x).map_err(|_| Error::Usage(format!("{what} = {x} past 32 bits")))
        };
        let bytes = match in_place {
            Some(_) => &g.stored,
            None => &g.codes,
        };
        Ok(DevWeights {
            operands: g.operands,
            scaling: g.scaling,
            out,
            epilogue,
            n: dim(g.n, "N")?,
            k: dim(g.k, "K")?,
            w: dev.stream.clone_htod(bytes).map_err(drv("cuMemcpyHtoD"))?,
            layout: in_place.cloned(),
            scale: if scales.is_empty() {
                None
            } else {
                Some(dev.stream.clone_htod(scales).map_err(drv("cuMemcpyHtoD"))?)
            },
            group_scales: if groups.is_empty() {
                None
            } else {
                Some(dev.stream.clone_htod(groups).map_err(drv("cuMemcpyHtoD"))?)
            },
        })
    }

    /// The row modes its variants are compiled for.
    fn w_rows(&self) -> WRows {
        self.layout.as_ref().map_or(WRows::PLAIN, |l| l.rows)
    }

    /// The candidates, with this GEMM's output, epilogue and weight row modes (those the epilogue
    /// and the row modes can run).
    fn candidates(&self) -> Vec<WsConfig> {
        let all = layer_candidates(
            self.operands,
            self.scaling,
            (self.out, self.epilogue),
            self.n,
            self.k,
        );
        // (An in-place map always has some: `in_place_for` takes one only then.)
        crate::gemm_access::for_rows(all, self.w_rows()).unwrap_or_default()
    }

    /// The tuning cache's form of a variant: its choice does not depend on the weight row modes
    /// (they change only a tile's TMA coordinates, computed once a tile), so choices are stored
    /// and looked up with [`WRows::PLAIN`].
    fn plain(c: &WsConfig) -> WsConfig {
        WsConfig {
            w_rows: WRows::PLAIN,
            ..*c
        }
    }

    /// The tuning-cache key of this GEMM at `rows` rows over `slots` experts.
    fn key(&self, dev: &Device, rows: usize, slots: usize) -> TuneKey {
        TuneKey::for_device(
            dev,
            self.operands,
            self.scaling,
            self.out,
            self.epilogue,
            self.n,
            self.k,
            u32::try_from(slots).unwrap_or(u32::MAX),
            rows,
        )
    }

    /// The variant for `rows` rows over at most `slots` experts: the tuning cache's choice for
    /// the row bucket when it has one ([`GpuLayer::tune`]), else the untuned default.
    fn variant(
        &self,
        dev: &Device,
        tuned: &TuneCache,
        rows: usize,
        slots: usize,
    ) -> Result<WsConfig> {
        let all = self.candidates();
        if let Some(e) = tuned.get(&self.key(dev, rows, slots)) {
            let choice = WsConfig {
                w_rows: self.w_rows(),
                ..e.choice
            };
            if all.contains(&choice) {
                return Ok(choice);
            }
        }
        tune::default_choice(&all, rows, slots.min(rows).max(1))
            .copied()
            .ok_or_else(|| {
                Error::Usage(format!(
                    "no grouped-GEMM variant for N = {}, K = {}",
                    self.n, self.k
                ))
            })
    }
}

/// The rows the layer's permute gathers for a first GEMM fed `feed` at hidden size `h`: bf16 for
/// a bf16 feed; E4M3 quantized in the scatter (per token, per 1x128 group, static) where the row
/// fits its registers (`h` at most `permute::MAX_HIDDEN_E4M3`); else bf16, quantized apart.
pub fn gather_for(feed: &Feed, h: u32) -> Gather {
    match feed {
        _ if h > MAX_HIDDEN_E4M3 => Gather::Bf16,
        Feed::Bf16 => Gather::Bf16,
        Feed::PerToken => Gather::PerToken,
        Feed::PerTokenGroup128 => Gather::Group128,
        Feed::Static { .. } => Gather::Static,
    }
}

/// What the GPU layer takes of a batch of `t` tokens of `k` choices: at least one token and 1 to
/// `permute::MAX_TOPK` choices (the scatter claims a token's items in one CTA). Errors:
/// `InputShape` naming `topk_ids`. [`GpuLayer::upload`] checks it; `moe run --device gpu` checks
/// it before a device is opened.
pub fn check_batch(t: usize, k: usize) -> Result<()> {
    if t == 0 || k == 0 || k > MAX_TOPK as usize {
        return Err(MoeError::InputShape {
            name: "topk_ids".into(),
            want: format!(
                "at least one token and 1 to {MAX_TOPK} choices (the GPU permute's claim)"
            ),
            got: vec![t, k],
        }
        .into());
    }
    Ok(())
}

/// The output type and epilogue of one of the layer's GEMMs (`w13` or not): the first GEMM fused
/// with SiLU*up where fusion is asked for and its `n13` weight rows of scaling `scaling` can be
/// paired ([`crate::moe_gpu::pairable`]), writing `a` in bf16 where the second GEMM takes bf16
/// (`a2` `None`); with static E4M3 scales also its codes and scales in the same kernel
/// ([`Epilogue::SiluMulE4m3`], f32 `a` out); with dynamic ones `a` in f32, which the activation
/// kernel quantizes (the in-kernel forms of per-token and per-group scales, which count each
/// token tile's arrivals, were slower on the H200: `codegen::gemm::finish`); else (and for `w2`)
/// f32 out, plain store. What [`GpuLayer::with_fusion`] decides, for warming a cache before any
/// layer exists.
pub fn gemm_form(
    w13: bool,
    fuse: bool,
    a2: Option<AQuant>,
    scaling: Scaling,
    n13: usize,
) -> (OutTy, Epilogue) {
    if w13 && fuse && crate::moe_gpu::pairable(scaling, n13) {
        match a2 {
            None => (OutTy::Bf16, Epilogue::SiluMul),
            Some(AQuant::Static) => (OutTy::F32, Epilogue::SiluMulE4m3(AQuant::Static)),
            Some(_) => (OutTy::F32, Epilogue::SiluMul),
        }
    } else {
        (OutTy::F32, Epilogue::Store)
    }
}

/// How the second GEMM's input `a` is quantized for a feed `feed2`: `None` for bf16.
pub fn a2_quant(feed2: &Feed) -> Option<AQuant> {
    match feed2 {
        Feed::Bf16 => None,
        Feed::PerToken => Some(AQuant::PerToken),
        Feed::PerTokenGroup128 => Some(AQuant::Group128),
        Feed::Static { .. } => Some(AQuant::Static),
    }
}

/// Where the first GEMM writes: with static E4M3 scales (`quantizes_a`) the second GEMM's codes
/// `a` and row scales `s2` from the slots' scales `static2` (its `y`, `h13`, is not written: no f32
/// `a`); fused with a bf16 second GEMM (`writes_a`) `a` itself; else `h13` (`w13_out`, or the fused
/// f32 `a`). The one choice of [`GpuLayer::enqueue`] and [`GpuLayer::tune`].
fn w13_outputs<'a>(
    (h13, a, s2): (
        &'a mut CudaSlice<u8>,
        &'a mut CudaSlice<u8>,
        &'a CudaSlice<f32>,
    ),
    static2: Option<&'a CudaSlice<f32>>,
    (quantizes_a, writes_a): (bool, bool),
) -> (&'a mut CudaSlice<u8>, Option<ActOutBuffers<'a>>) {
    if quantizes_a {
        let codes: &'a CudaSlice<u8> = a;
        (
            h13,
            Some(ActOutBuffers {
                codes,
                scales: s2,
                static_scales: static2,
                a_f32: false,
            }),
        )
    } else if writes_a {
        (a, None)
    } else {
        (h13, None)
    }
}

/// The tuning candidates of family `(operands, scaling)` at `N = n`, `K = k`
/// (`codegen::gemm::tune::candidates`), with the idle-skipping twins where
/// [`crate::settings::idle_skip_enabled`].
pub fn tune_candidates(operands: Operands, scaling: Scaling, n: u32, k: u32) -> Vec<WsConfig> {
    let all = tune::candidates(operands, scaling, n, k);
    if crate::settings::idle_skip_enabled() {
        tune::with_idle_twins(all)
    } else {
        all
    }
}

/// The grouped-GEMM variants a layer's GEMM of family `(operands, scaling)` at `N = n`, `K = k`
/// tunes among and loads, in the form `(out, epilogue)` ([`gemm_form`]): the tuning candidates
/// (`codegen::gemm::tune::candidates`) with that output and epilogue; fused, those whose weight
/// tile holds whole groups of 16 rows (and, block-scaled, at most 128 rows: `WsConfig::supported`).
pub fn layer_candidates(
    operands: Operands,
    scaling: Scaling,
    (out, epilogue): (OutTy, Epilogue),
    n: u32,
    k: u32,
) -> Vec<WsConfig> {
    tune_candidates(operands, scaling, n, k)
        .into_iter()
        .map(|c| WsConfig { out, epilogue, ..c })
        .filter(|c| !c.epilogue.silu() || c.tile_weights().is_multiple_of(16))
        .filter(|c| c.supported().is_ok())
        .collect()
}

/// `g`'s in-place map (rows `paired` or not) where some candidate of `form` can read through it;
/// `None`: the layer reads the re-laid copy (no tile of the candidates is a box of the row modes).
fn in_place_for(g: &GemmWeights, paired: bool, form: (OutTy, Epilogue)) -> Option<&WLayout> {
    let l = g.in_place(paired)?;
    let (n, k) = (u32::try_from(g.n).ok()?, u32::try_from(g.k).ok()?);
    let all = layer_candidates(g.operands, g.scaling, form, n, k);
    crate::gemm_access::for_rows(all, l.rows).map(|_| l)
}

/// How the first GEMM's input is made: the gathered bf16 rows, or E4M3 codes and scales that the
/// permute's scatter quantizes on the fly (`permute::Gather`), with each slot's static scale
/// (uploaded here) or dynamic ones.
enum Feed13 {
    /// The bf16 rows as they are.
    Bf16,
    /// E4M3 rows written by the permute; the static scales per slot, if the recipe's are static.
    E4m3(Option<CudaSlice<f32>>),
    /// Rows too long for the quantizing scatter (`H` past `permute::MAX_HIDDEN_E4M3`): the bf16
    /// rows gathered, then dynamic E4M3 by a kernel of their own (`runtime::act_quant`).
    Dynamic(ActQuant),
    /// As `Dynamic`, with each row's slot's static scale (`moe_kernels`).
    Static(MoeAct, CudaSlice<f32>),
}

/// The per-forward device buffers, sized for `t_max` tokens of `k` choices.
struct Scratch {
    t_max: usize,
    k: usize,
    x: CudaSlice<u16>,
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    slot: CudaSlice<i32>,
    counts: CudaSlice<u32>,
    errors: CudaSlice<u32>,
    offsets: CudaSlice<i32>,
    cursor: CudaSlice<u32>,
    row_of: CudaSlice<i32>,
    xs: CudaSlice<u8>,
    q13: CudaSlice<u8>,
    s13: CudaSlice<f32>,
    h13: CudaSlice<u8>,
    a: CudaSlice<u8>,
    s2: CudaSlice<f32>,
    y: CudaSlice<u8>,
    pos_of: CudaSlice<i32>,
    out: CudaSlice<u16>,
}

/// The uploaded forward's shape and GEMM variants.
#[derive(Debug, Clone, Copy)]
struct Current {
    t: usize,
    k: usize,
    c13: WsConfig,
    c2: WsConfig,
}

/// Why a fused layer refuses `dump`.
const FUSED_DUMP: &str = "MoE layer: the fused layer keeps no w13_out to dump (build it with GpuLayer::with_fusion(.., false))";

/// Named events recorded after each step of [`GpuLayer::enqueue`] (the first is `start`).
pub type Marks = Vec<(&'static str, cudarc::driver::CudaEvent)>;

/// A MoE layer loaded on a GPU: its operands, kernels and scratch.
pub struct GpuLayer {
    slots: usize,
    h: usize,
    i: usize,
    feed2: Feed,
    permute: Permute,
    feed13: Feed13,
    /// The activation kernel between the GEMMs: `silu(gate) * up` of `w13_out` (unfused), or the
    /// E4M3 quantization of the fused first GEMM's f32 `a`; `None` when the fused first GEMM
    /// writes the bf16 `a` the second takes.
    act: Option<MoeAct>,
    static2: Option<CudaSlice<f32>>,
    combine: MoeCombine,
    w13: DevWeights,
    w2: DevWeights,
    log2phy: CudaSlice<i32>,
    logcnt: CudaSlice<i32>,
    experts: usize,
    max_replicas: usize,
    load: CudaSlice<u32>,
    gemms: HashMap<WsConfig, GroupedGemm>,
    cache: Cache,
    tuned: TuneCache,
    compiler: Compiler,
    scratch: Option<Scratch>,
    current: Option<Current>,
    /// The placement the layer's buffers hold (`phy2log`).
    placement: SlotMap,
    /// The layer's EPLB state; `None` means EPLB is off.
    eplb: Option<EplbLayerState>,
    /// The device load counters as the last [`GpuLayer::record_load`] read them.
    load_seen: Vec<u32>,
    /// False after a rebalance failed part-way: the buffers may mix two placements.
    usable: bool,
    /// Bumped whenever the scratch is reallocated (a captured graph holds its addresses).
    generation: u64,
}

/// A forward captured in a CUDA graph ([`GpuLayer::capture`]), replayed by [`GpuLayer::replay`].
pub struct LayerGraph {
    graph: cudarc::driver::CudaGraph,
    generation: u64,
    t: usize,
    k: usize,
}

/// What [`GpuLayer::rebalance`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuRebalance {
    /// Balancedness of the window's loads before and after.
    pub balance: (f32, f32),
    /// Slots whose expert changed.
    pub changed_slots: usize,
    /// Bytes the copies read and wrote.
    pub bytes: u64,
}

impl std::fmt::Debug for GpuLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GpuLayer(R = {}, H = {}, I = {})",
            self.slots, self.h, self.i
        )
    }
}

/// The replica table of `replicas` with rows of `width` (at least the most replicas of an expert;
/// the layer uses its slot count, so that the table keeps its size and address across rebalances):
/// `log2phy [E, width]` (`-1` padded), `logcnt [E]`, and the width used.
fn replica_table(replicas: &Replicas, width: usize) -> (Vec<i32>, Vec<i32>, usize) {
    let e = replicas.experts();
    let rows: Vec<Vec<usize>> = (0..e).map(|x| replicas.replicas_of(x).to_vec()).collect();
    let max = rows
        .iter()
        .map(Vec::len)
        .max()
        .unwrap_or(1)
        .max(width)
        .max(1);
    let mut l2p = vec![-1i32; e * max];
    for (x, row) in rows.iter().enumerate() {
        for (j, &p) in row.iter().enumerate() {
            l2p[x * max + j] = i32::try_from(p).unwrap_or(-1);
        }
    }
    let cnt = rows
        .iter()
        .map(|r| i32::try_from(r.len()).unwrap_or(0))
        .collect();
    (l2p, cnt, max)
}

/// The placement (`phy2log`) of `replicas` over `slots` slots: every slot must hold an expert.
fn placement_of(replicas: &Replicas, slots: usize) -> Result<SlotMap> {
    let mut phy2log = vec![usize::MAX; slots];
    for e in 0..replicas.experts() {
        for &p in replicas.replicas_of(e) {
            if let Some(x) = phy2log.get_mut(p) {
                *x = e;
            }
        }
    }
    if let Some(p) = phy2log.iter().position(|&e| e == usize::MAX) {
        return Err(MoeError::Placement(format!("slot {p} of the layer holds no expert")).into());
    }
    Ok(SlotMap::new(phy2log, replicas.experts())?)
}

fn u32_of(x: usize, what: &str) -> Result<u32> {
    u32::try_from(x).map_err(|_| Error::Usage(format!("{what} = {x} past 32 bits")))
}

impl GpuLayer {
    /// Upload `ops` to `dev` (Hopper), load the layer's kernels (through the kernel cache of
    /// `settings`) and route through `replicas`; the first GEMM fuses `silu(gate) * up` where it
    /// can ([`GpuLayer::with_fusion`]).
    pub fn new(
        dev: &Device,
        ops: &LayerOperands,
        replicas: &Replicas,
        settings: &crate::runtime::Settings,
    ) -> Result<GpuLayer> {
        GpuLayer::with_fusion(dev, ops, replicas, settings, true)
    }

    /// [`GpuLayer::new`], choosing the path between the GEMMs. With `fuse`, where the first
    /// GEMM's weights can be paired ([`crate::moe_gpu::pairable`]), its epilogue computes `a = silu(gate) * up` (its weight rows uploaded in
    /// the paired order; the same bits as the unfused path, which computes the same f32 values
    /// with the same instructions) and writes it in bf16 where the second GEMM takes bf16; for
    /// an E4M3 second GEMM in f32, with static scales also the codes and scales in the same
    /// kernel (`Epilogue::SiluMulE4m3`, the activation kernel's instructions), with dynamic ones
    /// for the activation kernel to quantize (`ActIn::F32`); else (and always without `fuse`) it
    /// writes `w13_out` in f32 and the activation kernel makes `a`, the path
    /// `--dump-intermediates` needs.
    pub fn with_fusion(
        dev: &Device,
        ops: &LayerOperands,
        replicas: &Replicas,
        settings: &crate::runtime::Settings,
        fuse: bool,
    ) -> Result<GpuLayer> {
        let (h, i) = (u32_of(ops.h, "H")?, u32_of(ops.i, "I")?);
        let slots = u32_of(ops.slots, "slots")?;
        let up = |v: &[f32]| dev.stream.clone_htod(v).map_err(drv("cuMemcpyHtoD"));
        // The scatter quantizes rows it can hold in registers; longer rows are gathered in bf16
        // and quantized apart.
        let gather = gather_for(&ops.feed13, h);
        let (feed13, gather) = match (&ops.feed13, gather) {
            (_, Gather::PerToken | Gather::Group128) => (Feed13::E4m3(None), gather),
            (Feed::Static { values: v, .. }, Gather::Static) => {
                (Feed13::E4m3(Some(up(v)?)), gather)
            }
            (Feed::PerToken, _) => (
                Feed13::Dynamic(ActQuant::load(dev, Mode::PerToken, h)?),
                gather,
            ),
            (Feed::PerTokenGroup128, _) => (
                Feed13::Dynamic(ActQuant::load(dev, Mode::PerGroup128, h)?),
                gather,
            ),
            (Feed::Static { values: v, .. }, _) => (
                Feed13::Static(
                    MoeAct::load(dev, ActIn::Bf16, ActOut::StaticRow, h)?,
                    up(v)?,
                ),
                gather,
            ),
            (Feed::Bf16, _) => (Feed13::Bf16, gather),
        };
        let out2 = a2_quant(&ops.feed2).map_or(ActOut::Bf16, AQuant::act_out);
        let static2 = match &ops.feed2 {
            Feed::Static { values: v, .. } => Some(up(v)?),
            _ => None,
        };
        let form = gemm_form(true, fuse, a2_quant(&ops.feed2), ops.w13.scaling, ops.w13.n);
        // Fused: the param read in place in the paired order where its rows allow (its per-row
        // scales, FP8 per channel's, then go up in that order), else a copy of its rows in that
        // order.
        let fused_w13 = match form {
            (_, e) if e.silu() => match in_place_for(&ops.w13, true, form) {
                Some(l) => Some(DevWeights::upload(dev, &ops.w13, form, Some(l), true)?),
                None => match ops.w13.paired() {
                    Some(p) => Some(DevWeights::upload(dev, &p, form, None, false)?),
                    None => None,
                },
            },
            _ => None,
        };
        let (w13, act) = match fused_w13 {
            // Fused: `a` in bf16 for the second GEMM, or quantized to E4M3 with static scales by
            // the GEMM itself (no f32 `a`: `h13` is not written), else in f32 for the activation
            // kernel.
            Some(w) => (
                w,
                match form {
                    (OutTy::F32, Epilogue::SiluMul) => {
                        Some(MoeAct::load(dev, ActIn::F32, out2, i)?)
                    }
                    _ => None,
                },
            ),
            None => (
                DevWeights::upload(
                    dev,
                    &ops.w13,
                    (OutTy::F32, Epilogue::Store),
                    in_place_for(&ops.w13, false, (OutTy::F32, Epilogue::Store)),
                    false,
                )?,
                Some(MoeAct::load(dev, ActIn::SiluMul, out2, i)?),
            ),
        };
        let (l2p, cnt, max_replicas) = replica_table(replicas, ops.slots);
        let placement = placement_of(replicas, ops.slots)?;
        Ok(GpuLayer {
            slots: ops.slots,
            h: ops.h,
            i: ops.i,
            feed2: ops.feed2.clone(),
            permute: Permute::load(dev, h, slots, gather)?,
            feed13,
            act,
            static2,
            combine: MoeCombine::load(dev, h)?,
            w13,
            w2: DevWeights::upload(
                dev,
                &ops.w2,
                (OutTy::F32, Epilogue::Store),
                in_place_for(&ops.w2, false, (OutTy::F32, Epilogue::Store)),
                false,
            )?,
            log2phy: dev.stream.clone_htod(&l2p).map_err(drv("cuMemcpyHtoD"))?,
            logcnt: dev.stream.clone_htod(&cnt).map_err(drv("cuMemcpyHtoD"))?,
            experts: replicas.experts(),
            max_replicas,
            load: dev
                .stream
                .alloc_zeros::<u32>(ops.slots.max(1))
                .map_err(drv("cuMemAlloc"))?,
            gemms: HashMap::new(),
            cache: Cache::new(settings.cache_dir.clone()),
            tuned: TuneCache::new(settings.cache_dir.clone()),
            compiler: Compiler::resolve(&settings.jit)?,
            scratch: None,
            current: None,
            placement,
            eplb: None,
            load_seen: vec![0; ops.slots],
            usable: true,
            generation: 0,
        })
    }

    fn check_usable(&self) -> Result<()> {
        if self.usable {
            Ok(())
        } else {
            Err(MoeError::Placement(
                "a rebalance failed part-way; the layer's buffers may mix two placements (create it again)".into(),
            )
            .into())
        }
    }

    /// Whether the first GEMM's epilogue computes `silu(gate) * up` (no `w13_out`; an
    /// activation kernel only where the second GEMM takes E4M3): see [`GpuLayer::with_fusion`].
    pub fn fused(&self) -> bool {
        self.w13.epilogue.silu()
    }

    /// Whether the first GEMM writes `a` itself, in the second GEMM's bf16 (fused, no activation
    /// kernel); else it writes into `h13` (`w13_out`, or the fused f32 `a`).
    fn writes_a(&self) -> bool {
        self.act.is_none() && !self.quantizes_a()
    }

    /// Whether the first GEMM also quantizes `a` to the second GEMM's E4M3 codes and scales
    /// (`Epilogue::SiluMulE4m3`, static scales: into `a` and `s2`; no f32 `a` is stored).
    fn quantizes_a(&self) -> bool {
        self.w13.epilogue.quant().is_some()
    }

    /// Whether the first GEMM's E4M3 rows are made by a kernel of their own (rows longer than the
    /// quantizing scatter takes), not by the permute.
    pub fn quantized_apart(&self) -> bool {
        matches!(self.feed13, Feed13::Dynamic(_) | Feed13::Static(..))
    }

    /// The placement the layer's buffers hold.
    pub fn placement(&self) -> &SlotMap {
        &self.placement
    }

    /// Turn EPLB on with `state` (over the layer's current placement), or off with `None`. The
    /// window's first step counts the forwards after this call.
    pub fn set_eplb(&mut self, dev: &Device, state: Option<EplbLayerState>) -> Result<()> {
        if let Some(s) = &state {
            if s.map() != &self.placement {
                return Err(MoeError::Placement(
                    "the EPLB state's map is not the layer's placement".into(),
                )
                .into());
            }
        }
        self.load_seen = self.load_counters(dev)?;
        self.eplb = state;
        Ok(())
    }

    /// The layer's EPLB state (`None`: off).
    pub fn eplb(&self) -> Option<&EplbLayerState> {
        self.eplb.as_ref()
    }

    /// Count the forwards since the last call as one step of the EPLB window: the device load
    /// counters' growth per slot (they accumulate on the device, wrapping at 2^32). Errors: EPLB
    /// off.
    pub fn record_load(&mut self, dev: &Device) -> Result<()> {
        let now = self.load_counters(dev)?;
        let state = self
            .eplb
            .as_mut()
            .ok_or_else(|| Error::from(MoeError::Placement("EPLB is off for this layer".into())))?;
        let step: Vec<u64> = now
            .iter()
            .zip(&self.load_seen)
            .map(|(&n, &o)| u64::from(n.wrapping_sub(o)))
            .collect();
        state.record(&step)?;
        self.load_seen = now;
        Ok(())
    }

    /// Plan a new placement from the EPLB window (SPEC §6's policy) and move every per-slot buffer
    /// of the layer to it in place, between forwards: both GEMMs' codes, weight scales and group
    /// scales, and the static activation scales, with one plan (`runtime::slot_moves`), then the
    /// replica table the permute routes by (in place: a captured graph stays valid). The layer then
    /// serves the new placement. Moving
    /// experts without changing replica counts changes no output bit (SPEC §9). Errors: EPLB off, a
    /// policy for another GPU count, a device error (the layer then refuses every later call:
    /// create it again).
    pub fn rebalance(&mut self, dev: &Device, policy: Policy) -> Result<GpuRebalance> {
        self.check_usable()?;
        let state = self
            .eplb
            .as_ref()
            .ok_or_else(|| Error::from(MoeError::Placement("EPLB is off for this layer".into())))?;
        let new = state.plan(policy)?;
        let plan = MovePlan::new(&self.placement, &new, 1)?;
        dev.sync()?;
        let mut bufs = Vec::new();
        {
            let st = &dev.stream;
            let mut add = |ptr: u64, len: usize| bufs.push(SlotBuffer { ptr, len });
            for w in [&self.w13, &self.w2] {
                add(w.w.device_ptr(st).0, w.w.len());
                if let Some(sc) = &w.scale {
                    add(sc.device_ptr(st).0, 4 * sc.len());
                }
                if let Some(g) = &w.group_scales {
                    add(g.device_ptr(st).0, g.len());
                }
            }
            if let Feed13::E4m3(Some(v)) | Feed13::Static(_, v) = &self.feed13 {
                add(v.device_ptr(st).0, 4 * v.len());
            }
            if let Some(v) = &self.static2 {
                add(v.device_ptr(st).0, 4 * v.len());
            }
        }
        // Unusable until every buffer and the replica table have moved.
        self.usable = false;
        // SAFETY: every buffer is one of this layer's live allocations on `dev`'s context; the
        // layer is borrowed mutably, so no forward runs meanwhile, and the copies are queued on
        // `dev.stream` and waited for below, before the buffers are used again.
        let bytes = unsafe { slot_moves::rearrange(&dev.stream, &bufs, &plan) }?;
        let replicas = Replicas::from_phy2log(new.phy2log(), self.experts)?;
        // The same table size (rows of the slot count): the new table goes into the same buffers,
        // so that a graph captured before stays valid.
        let (l2p, cnt, _) = replica_table(&replicas, self.max_replicas);
        dev.stream
            .memcpy_htod(&l2p, &mut self.log2phy)
            .map_err(drv("cuMemcpyHtoD"))?;
        dev.stream
            .memcpy_htod(&cnt, &mut self.logcnt)
            .map_err(drv("cuMemcpyHtoD"))?;
        dev.stream
            .memset_zeros(&mut self.load)
            .map_err(drv("cuMemsetD8"))?;
        dev.sync()?;
        self.load_seen = vec![0; self.slots];
        let changed_slots = plan.changed_slots();
        self.placement = new.clone();
        self.usable = true;
        let balance = match self.eplb.as_mut() {
            Some(s) => s.moved_to(new)?,
            None => (0.0, 0.0),
        };
        Ok(GpuRebalance {
            balance,
            changed_slots,
            bytes,
        })
    }

    /// The EPLB load counters: items routed to each slot over every forward so far.
    pub fn load_counters(&self, dev: &Device) -> Result<Vec<u32>> {
        dev.sync()?;
        Ok(dev
            .stream
            .clone_dtoh(&self.load)
            .map_err(drv("cuMemcpyDtoH"))?)
    }

    fn scratch(&mut self, dev: &Device, t: usize, k: usize) -> Result<()> {
        if self
            .scratch
            .as_ref()
            .is_some_and(|s| s.t_max >= t && s.k == k)
        {
            return Ok(());
        }
        self.scratch = None;
        self.generation += 1;
        let (h, i, r) = (self.h, self.i, self.slots);
        let n = (t * k).max(1);
        let kb = |w: usize| w.div_ceil(128);
        let s13_len = match (&self.feed13, self.w13.scaling) {
            (_, Scaling::Block128) => kb(h) * n,
            (Feed13::Bf16, _) => 1,
            _ => n,
        };
        let s2_len = match self.feed2 {
            Feed::Bf16 => 1,
            Feed::PerTokenGroup128 => kb(i) * n,
            _ => n,
        };
        let e2 = self.w2.operands.bytes() as usize;
        let st = &dev.stream;
        macro_rules! z {
            ($ty:ty, $len:expr) => {
                st.alloc_zeros::<$ty>(($len).max(1))
                    .map_err(drv("cuMemAlloc"))?
            };
        }
        self.scratch = Some(Scratch {
            t_max: t,
            k,
            x: z!(u16, t * h),
            ids: z!(i32, t * k),
            weights: z!(f32, t * k),
            slot: z!(i32, n),
            counts: z!(u32, r),
            // [the permute's running count, this forward's skipped items]
            errors: z!(u32, 2),
            offsets: z!(i32, r + 1),
            cursor: z!(u32, r),
            row_of: z!(i32, n),
            // (bf16 rows, or the E4M3 codes the permute writes)
            xs: z!(u8, self.permute.launch().gathered_row_bytes() * n),
            // (the codes of rows quantized apart)
            q13: z!(u8, if self.quantized_apart() { n * h } else { 1 }),
            s13: z!(f32, s13_len),
            // (the fused path writes `a` directly: no `w13_out`; or its f32 `a` for the E4M3
            // quantization)
            h13: z!(
                u8,
                match (self.fused(), self.writes_a()) {
                    (_, true) => 1,
                    (true, false) => 4 * n * i,
                    (false, false) => 4 * n * 2 * i,
                }
            ),
            a: z!(u8, e2 * n * i),
            s2: z!(f32, s2_len),
            y: z!(u8, 4 * n * h),
            pos_of: z!(i32, n),
            out: z!(u16, t * h),
        });
        Ok(())
    }

    fn gemm(&mut self, dev: &Device, cfg: &WsConfig) -> Result<()> {
        if !self.gemms.contains_key(cfg) {
            let g = GroupedGemm::load_cached(dev, cfg, &self.cache, &self.compiler)?;
            self.gemms.insert(*cfg, g);
        }
        Ok(())
    }

    /// One forward of `tokens` (see the module docs): [`GpuLayer::upload`], [`GpuLayer::enqueue`],
    /// [`GpuLayer::finish`]. The result is in the host forward's form, with `w13_out` and `act`
    /// filled when `dump` (else empty; a fused layer refuses `dump`: it has no `w13_out`).
    pub fn forward(&mut self, dev: &Device, tokens: &Tokens<'_>, dump: bool) -> Result<Forward> {
        if dump && self.fused() {
            // Refused before anything runs (the load counters count a forward).
            return Err(Error::Usage(FUSED_DUMP.into()));
        }
        if (tokens.t == 0 || tokens.k == 0) && tokens.x.len() == tokens.t * self.h {
            // Nothing routed: every output is the empty sum, 0 (as on the host).
            return Ok(Forward {
                output: vec![0; tokens.t * self.h],
                w13_out: Vec::new(),
                act: Vec::new(),
                h: self.h,
                i: self.i,
            });
        }
        self.upload(dev, tokens)?;
        self.enqueue(dev, None)?;
        self.finish(dev, dump)
    }

    /// Check `tokens` against the layer, size the scratch, load the GEMM variants for its rows and
    /// queue the copies of its inputs to the device. What [`GpuLayer::enqueue`] then runs on.
    pub fn upload(&mut self, dev: &Device, tokens: &Tokens<'_>) -> Result<()> {
        self.check_usable()?;
        let (t, k, h, r) = (tokens.t, tokens.k, self.h, self.slots);
        tokens.check_lengths(h)?;
        check_batch(t, k)?;
        let n = t * k;
        self.scratch(dev, t, k)?;
        let c13 = self.w13.variant(dev, &self.tuned, n, r)?;
        let c2 = self.w2.variant(dev, &self.tuned, n, r)?;
        self.gemm(dev, &c13)?;
        self.gemm(dev, &c2)?;
        let Some(s) = self.scratch.as_mut() else {
            return Err(Error::Usage("MoE layer: no scratch".into()));
        };
        let st = &dev.stream;
        st.memcpy_htod(tokens.x, &mut s.x)
            .map_err(drv("cuMemcpyHtoD"))?;
        st.memcpy_htod(tokens.ids, &mut s.ids)
            .map_err(drv("cuMemcpyHtoD"))?;
        st.memcpy_htod(tokens.weights, &mut s.weights)
            .map_err(drv("cuMemcpyHtoD"))?;
        self.current = Some(Current { t, k, c13, c2 });
        Ok(())
    }

    /// Queue the forward of the uploaded tokens on `dev.stream` (no host synchronization). With
    /// `marks`, an event is recorded after each step, named (for the per-kernel times of the
    /// benchmark).
    pub fn enqueue(&mut self, dev: &Device, mut marks: Option<&mut Marks>) -> Result<()> {
        self.check_usable()?;
        let Some(Current { t, k, c13, c2 }) = self.current else {
            return Err(Error::Usage("MoE layer: enqueue before upload".into()));
        };
        let (n, r, writes_a, apart) = (t * k, self.slots, self.writes_a(), self.quantized_apart());
        let (silu_fused, quantizes_a) = (self.fused(), self.quantizes_a());
        let Some(s) = self.scratch.as_mut() else {
            return Err(Error::Usage("MoE layer: no scratch".into()));
        };
        let mut mark = |what: &'static str| -> Result<()> {
            if let Some(m) = marks.as_deref_mut() {
                let ev = dev
                    .stream
                    .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(drv("cuEventRecord"))?;
                m.push((what, ev));
            }
            Ok(())
        };
        mark("start")?;
        let quantized = matches!(self.feed13, Feed13::E4m3(_));
        let b = Buffers {
            topk_ids: &s.ids,
            log2phy: &self.log2phy,
            logcnt: &self.logcnt,
            x: &s.x,
            slot: &mut s.slot,
            counts: &mut s.counts,
            load: &mut self.load,
            errors: &mut s.errors,
            offsets: &mut s.offsets,
            cursor: &mut s.cursor,
            row_of: &mut s.row_of,
            xs: &mut s.xs,
            scales: quantized.then_some(&mut s.s13),
            static_scales: match &self.feed13 {
                Feed13::E4m3(v) => v.as_ref(),
                _ => None,
            },
            pos_of: &mut s.pos_of,
        };
        // SAFETY: every launch of this forward is on `dev.stream`, in order; no other stream
        // touches the layer's buffers. Sizes are checked by each `run`; the row offsets the later
        // kernels read are the permute's (non-decreasing from 0, ending at most at `n`).
        unsafe {
            self.permute
                .run(dev, b, t, k, self.experts, self.max_replicas)?;
            mark(if quantized {
                "permute + quantize x"
            } else {
                "permute"
            })?;
            let x13: &CudaSlice<u8> = match &self.feed13 {
                Feed13::Bf16 | Feed13::E4m3(_) => &s.xs,
                Feed13::Dynamic(q) => {
                    q.run(dev, &s.xs, &mut s.q13, &mut s.s13, n)?;
                    &s.q13
                }
                Feed13::Static(q, values) => {
                    self.combine.row_scales(
                        dev, &s.row_of, &s.slot, values, &s.offsets, &mut s.s13, r, n,
                    )?;
                    q.run(dev, &s.xs, &mut s.q13, Some(&mut s.s13), &s.offsets, r, n)?;
                    &s.q13
                }
            };
            if apart {
                mark("quantize x")?;
            }
            let scaled13 = self.w13.scaling.takes_x_scale();
            let g13 = self
                .gemms
                .get(&c13)
                .ok_or_else(|| Error::Usage("MoE layer: w13 variant not loaded".into()))?;
            let (out13, act_out) = w13_outputs(
                (&mut s.h13, &mut s.a, &s.s2),
                self.static2.as_ref(),
                (quantizes_a, writes_a),
            );
            g13.run(
                dev,
                &GemmOperands {
                    x: x13,
                    w: &self.w13.w,
                    offsets: &s.offsets,
                    x_scale: scaled13.then_some(&s.s13),
                    w_scale: self.w13.scale.as_ref(),
                    group_scales: self.w13.group_scales.as_ref(),
                    w_layout: self.w13.layout.as_ref(),
                    t: n,
                    experts: r,
                    act_out,
                },
                out13,
            )?;
            mark(match (silu_fused, quantizes_a) {
                (true, true) => "w13 GEMM + silu * up + quantize a",
                (true, false) => "w13 GEMM + silu * up",
                _ => "w13 GEMM",
            })?;
            if let (Some(values), false) = (&self.static2, quantizes_a) {
                self.combine
                    .row_scales(dev, &s.row_of, &s.slot, values, &s.offsets, &mut s.s2, r, n)?;
            }
            if let Some(act) = &self.act {
                let s2 = match self.feed2 {
                    Feed::Bf16 => None,
                    _ => Some(&mut s.s2),
                };
                act.run(dev, &s.h13, &mut s.a, s2, &s.offsets, r, n)?;
                mark(if silu_fused {
                    "quantize a"
                } else {
                    "silu * up"
                })?;
            }
            let scaled2 = self.w2.scaling.takes_x_scale();
            let g2 = self
                .gemms
                .get(&c2)
                .ok_or_else(|| Error::Usage("MoE layer: w2 variant not loaded".into()))?;
            g2.run(
                dev,
                &GemmOperands {
                    x: &s.a,
                    w: &self.w2.w,
                    offsets: &s.offsets,
                    x_scale: scaled2.then_some(&s.s2),
                    w_scale: self.w2.scale.as_ref(),
                    group_scales: self.w2.group_scales.as_ref(),
                    w_layout: self.w2.layout.as_ref(),
                    t: n,
                    experts: r,
                    act_out: None,
                },
                &mut s.y,
            )?;
            mark("w2 GEMM")?;
            // (`pos_of`, each item's row, is the permute's.)
            self.combine
                .combine(dev, &s.y, &s.pos_of, &s.weights, &mut s.out, t, k, n)?;
            mark("combine")?;
        }
        Ok(())
    }

    /// Tune both GEMMs for the uploaded forward's row bucket: every candidate timed (three
    /// launches each, the mean) on this forward's own operands, the fastest stored in the tuning
    /// cache (the settings' folder, else memory) and used from now on. Needs one
    /// [`GpuLayer::enqueue`] of the uploaded tokens first (the row offsets are the permute's). A
    /// bucket already in the cache is not timed again. Returns where each choice came from.
    pub fn tune(&mut self, dev: &Device) -> Result<(TuneSource, TuneSource)> {
        let Some(cur) = self.current else {
            return Err(Error::Usage("MoE layer: tune before upload".into()));
        };
        let (n, r, writes_a, apart, quantizes_a) = (
            cur.t * cur.k,
            self.slots,
            self.writes_a(),
            self.quantized_apart(),
            self.quantizes_a(),
        );
        let all13 = self.w13.candidates();
        let all2 = self.w2.candidates();
        for c in all13.iter().chain(&all2) {
            self.gemm(dev, c)?;
        }
        dev.sync()?;
        let Some(s) = self.scratch.as_mut() else {
            return Err(Error::Usage("MoE layer: no scratch".into()));
        };
        let static2 = self.static2.as_ref();
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut sources = Vec::new();
        for which in [13, 2] {
            let (w, all, key) = if which == 13 {
                (&self.w13, &all13, self.w13.key(dev, n, r))
            } else {
                (&self.w2, &all2, self.w2.key(dev, n, r))
            };
            let x13 = if apart { &s.q13 } else { &s.xs };
            let (x, (out, act_out)): (&CudaSlice<u8>, _) = match which {
                13 => (
                    x13,
                    w13_outputs(
                        (&mut s.h13, &mut s.a, &s.s2),
                        static2,
                        (quantizes_a, writes_a),
                    ),
                ),
                _ => (&s.a, (&mut s.y, None)),
            };
            let x_scale = if which == 13 { &s.s13 } else { &s.s2 };
            let gemms = &self.gemms;
            // (Timed in the layer's own row modes, stored in the plain form: `DevWeights::plain`.)
            let w_rows = w.w_rows();
            let plain: Vec<WsConfig> = all.iter().map(DevWeights::plain).collect();
            let (entry, source) = gemm_tune::tune(&self.tuned, &key, &plain, 3, |cfg| {
                let g = gemms
                    .get(&WsConfig { w_rows, ..*cfg })
                    .ok_or_else(|| Error::Usage("MoE layer: a candidate is not loaded".into()))?;
                let op = GemmOperands {
                    x,
                    w: &w.w,
                    offsets: &s.offsets,
                    x_scale: (w.scaling.takes_x_scale()).then_some(x_scale),
                    w_scale: w.scale.as_ref(),
                    group_scales: w.group_scales.as_ref(),
                    w_layout: w.layout.as_ref(),
                    t: n,
                    experts: r,
                    act_out,
                };
                let a = dev
                    .stream
                    .record_event(timing)
                    .map_err(drv("cuEventRecord"))?;
                // SAFETY: the offsets are the permute's of the uploaded forward (enqueued before,
                // on this stream); sizes are checked by `run`; one stream only.
                unsafe { g.run(dev, &op, out) }?;
                let b = dev
                    .stream
                    .record_event(timing)
                    .map_err(drv("cuEventRecord"))?;
                dev.sync()?;
                Ok::<f64, Error>(
                    f64::from(a.elapsed_ms(&b).map_err(drv("cuEventElapsedTime"))?) * 1e3,
                )
            })?;
            let choice = WsConfig {
                w_rows,
                ..entry.choice
            };
            if which == 13 {
                self.current = Some(Current { c13: choice, ..cur });
            } else if let Some(c) = self.current.as_mut() {
                c.c2 = choice;
            }
            sources.push(source);
        }
        Ok((sources[0], sources.get(1).copied().unwrap_or(sources[0])))
    }

    /// The variants the uploaded forward runs (w13, w2).
    pub fn variants(&self) -> Option<(WsConfig, WsConfig)> {
        self.current.map(|c| (c.c13, c.c2))
    }

    /// Capture the forward of the uploaded tokens ([`GpuLayer::enqueue`], no marks) into a CUDA
    /// graph on `dev.stream`: replaying it ([`cudarc::driver::CudaGraph::launch`]) computes the
    /// forward of whatever tokens of the same `(T, k)` were last uploaded into the layer's scratch
    /// (the graph holds device pointers, and nothing in the forward reads the host), then
    /// [`GpuLayer::finish`] reads it back. Run one forward first: the GEMM variants, tensor maps and
    /// split-K buffers are made on the first run, and a capture must not allocate. Errors: nothing
    /// uploaded, or the driver refusing the capture (the stream's capture is ended either way).
    /// The graph stays valid across [`GpuLayer::rebalance`] (the replica table is rewritten in
    /// place) and across uploads of the same shape.
    pub fn capture(&mut self, dev: &Device) -> Result<LayerGraph> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let Some(Current { t, k, .. }) = self.current else {
            return Err(Error::Usage("MoE layer: capture before upload".into()));
        };
        dev.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv("cuStreamBeginCapture"))?;
        let queued = self.enqueue(dev, None);
        // End the capture whatever happened, so that the stream is usable again.
        let graph = dev
            .stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(drv("cuStreamEndCapture"));
        queued?;
        let graph = graph?
            .ok_or_else(|| Error::Usage("MoE layer: the capture recorded no graph".into()))?;
        Ok(LayerGraph {
            graph,
            generation: self.generation,
            t,
            k,
        })
    }

    /// Replay `g` (queued on the stream it was captured on, the device's; read the result with
    /// [`GpuLayer::finish`]): the forward
    /// of the tokens last uploaded, which must have `g`'s `(T, k)`. Errors: a graph of another
    /// shape, or one captured before the scratch was reallocated (an upload of more tokens or
    /// another `k`: its addresses are gone; capture again), a layer left unusable.
    pub fn replay(&mut self, g: &LayerGraph) -> Result<()> {
        self.check_usable()?;
        let now = self.current.map(|c| (c.t, c.k));
        if g.generation != self.generation || now != Some((g.t, g.k)) {
            return Err(Error::Usage(format!(
                "MoE layer: a graph captured for T = {}, k = {} on other scratch buffers; capture again",
                g.t, g.k
            )));
        }
        g.graph.launch().map_err(drv("cuGraphLaunch"))?;
        Ok(())
    }

    /// Zero the output buffer (a check that a replayed graph writes it again).
    pub fn clear_output(&mut self, dev: &Device) -> Result<()> {
        let Some(s) = self.scratch.as_mut() else {
            return Err(Error::Usage("MoE layer: no scratch".into()));
        };
        dev.stream
            .memset_zeros(&mut s.out)
            .map_err(drv("cuMemsetD8"))?;
        Ok(())
    }

    /// Wait for the queued forward and read its result back (see [`GpuLayer::forward`]). Errors:
    /// items the permute skipped (an id out of range or without a replica on the device).
    pub fn finish(&mut self, dev: &Device, dump: bool) -> Result<Forward> {
        let Some(Current { t, k, .. }) = self.current else {
            return Err(Error::Usage("MoE layer: finish before upload".into()));
        };
        let (n, h, i, r) = (t * k, self.h, self.i, self.slots);
        let Some(s) = self.scratch.as_ref() else {
            return Err(Error::Usage("MoE layer: no scratch".into()));
        };
        let st = &dev.stream;
        dev.sync()?;
        let dl = |e| drv("cuMemcpyDtoH")(e);
        let errors = st.clone_dtoh(&s.errors).map_err(dl)?;
        if let Some(&bad) = errors.get(1).filter(|&&e| e > 0) {
            return Err(MoeError::Placement(format!(
                "{bad} (token, choice) pairs had an expert id outside [0, {}) or no replica on the device (or no row: the layer's scratch was left inconsistent; make the layer again)",
                self.experts
            ))
            .into());
        }
        let mut output = st.clone_dtoh(&s.out).map_err(dl)?;
        output.truncate(t * h);
        let (mut w13_out, mut act) = (Vec::new(), Vec::new());
        if dump && self.fused() {
            return Err(Error::Usage(FUSED_DUMP.into()));
        }
        if dump {
            let offsets = st.clone_dtoh(&s.offsets).map_err(dl)?;
            let rows = usize::try_from(offsets.get(r).copied().unwrap_or(0))
                .unwrap_or(0)
                .min(n);
            let row_of = st.clone_dtoh(&s.row_of).map_err(dl)?;
            let h13 = f32s(&st.clone_dtoh(&s.h13).map_err(dl)?);
            let a = st.clone_dtoh(&s.a).map_err(dl)?;
            let s2 = st.clone_dtoh(&s.s2).map_err(dl)?;
            w13_out = vec![0f32; n * 2 * i];
            act = vec![0f32; n * i];
            for (row, &item) in row_of.iter().enumerate().take(rows) {
                let Ok(item) = usize::try_from(item) else {
                    continue;
                };
                if item >= n {
                    continue;
                }
                w13_out[item * 2 * i..(item + 1) * 2 * i]
                    .copy_from_slice(&h13[row * 2 * i..(row + 1) * 2 * i]);
                for c in 0..i {
                    act[item * i + c] = match &self.feed2 {
                        Feed::Bf16 => {
                            let at = 2 * (row * i + c);
                            f32::from_bits(u32::from(u16::from_le_bytes([a[at], a[at + 1]])) << 16)
                        }
                        f => {
                            let scale = match f {
                                Feed::PerTokenGroup128 => s2[(c / 128) * n + row],
                                _ => s2[row],
                            };
                            (f64::from(r::e4m3_to_f32(a[row * i + c])) * f64::from(scale)) as f32
                        }
                    };
                }
            }
        }
        Ok(Forward {
            output,
            w13_out,
            act,
            h,
            i,
        })
    }
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Run one forward of `tokens` on GPU 0 (see [`GpuLayer::forward`]) with the operands `ops`,
/// routed through `replicas`: fused where it can be, unfused when `dump`.
pub fn forward(
    ops: &LayerOperands,
    tokens: &Tokens<'_>,
    replicas: &Replicas,
    settings: &crate::runtime::Settings,
    dump: bool,
) -> Result<Forward> {
    let dev = crate::gpu::open_device()?;
    // The intermediates exist on the unfused path only.
    let mut l = GpuLayer::with_fusion(&dev, ops, replicas, settings, !dump)?;
    l.forward(&dev, tokens, dump)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The verifier and the permute generator agree: at every hidden size the bf16 permute takes
    /// (a multiple of 8 up to `permute::MAX_HIDDEN`), for every feed, the gather the layer picks
    /// generates; quantizing ones up to `MAX_HIDDEN_E4M3`, bf16 past it.
    #[test]
    fn every_hidden_size_gets_a_permute_for_every_feed() {
        use crate::codegen::moe::permute::{launch, MAX_HIDDEN};
        let feeds = [
            Feed::Bf16,
            Feed::PerToken,
            Feed::PerTokenGroup128,
            Feed::Static {
                param: "w13_input_scale".into(),
                values: vec![1.0; 4],
            },
        ];
        for h in (8..=MAX_HIDDEN).step_by(8) {
            for f in &feeds {
                let g = gather_for(f, h);
                assert_eq!(g == Gather::Bf16, *f == Feed::Bf16 || h > MAX_HIDDEN_E4M3);
                assert!(launch(h, 4, g).is_ok(), "H = {h}, {f:?}: {g:?}");
            }
        }
    }

    /// The first GEMM fuses SiLU*up only where asked and its rows pair (its `a` in bf16 where the
    /// second GEMM takes bf16, else quantized to E4M3 in the GEMM as the second GEMM's feed says);
    /// the second never; the fused candidates keep whole groups of 16 weight rows per tile.
    #[test]
    fn the_gemm_forms_follow_the_fusion_rule() {
        let fused = (OutTy::Bf16, Epilogue::SiluMul);
        let plain = (OutTy::F32, Epilogue::Store);
        let tok = Scaling::Tensorwise { per_token: true };
        let q = |a: AQuant| (OutTy::F32, Epilogue::SiluMulE4m3(a));
        assert_eq!(gemm_form(true, true, None, Scaling::None, 4096), fused);
        assert_eq!(gemm_form(true, true, None, Scaling::PerRow, 1536), fused);
        assert_eq!(gemm_form(true, false, None, Scaling::None, 4096), plain);
        // An E4M3 second GEMM: static scales quantized in the GEMM; dynamic ones by the
        // activation kernel from the fused f32 `a`.
        let f32_a = (OutTy::F32, Epilogue::SiluMul);
        for (a, form) in [
            (AQuant::PerToken, f32_a),
            (AQuant::Group128, f32_a),
            (AQuant::Static, q(AQuant::Static)),
        ] {
            assert_eq!(gemm_form(true, true, Some(a), tok, 4096), form);
            assert_eq!(gemm_form(true, false, Some(a), tok, 4096), plain);
        }
        let feeds = [
            (Feed::Bf16, None),
            (Feed::PerToken, Some(AQuant::PerToken)),
            (Feed::PerTokenGroup128, Some(AQuant::Group128)),
            (
                Feed::Static {
                    param: "w2_input_scale".into(),
                    values: vec![1.0; 4],
                },
                Some(AQuant::Static),
            ),
        ];
        for (f, a) in feeds {
            assert_eq!(a2_quant(&f), a, "{f:?}");
        }
        // Block scales pair where N is a multiple of 128 (the tile's gate and up rows each in one
        // block), fused tiles of at most 128 weight rows (the 192-row one is not a candidate).
        let g128 = Some(AQuant::Group128);
        assert_eq!(gemm_form(true, true, g128, Scaling::Block128, 4096), f32_a);
        assert_eq!(gemm_form(true, true, g128, Scaling::Block128, 4160), plain);
        let block = layer_candidates(Operands::E4m3, Scaling::Block128, f32_a, 4096, 7168);
        assert!(block.iter().any(|c| !c.swap_ab) && block.iter().any(|c| c.swap_ab));
        assert!(block
            .iter()
            .all(|c| c.tile_weights() <= 128 && c.paired_blocks()));
        assert_eq!(gemm_form(true, true, None, Scaling::None, 4104), plain);
        assert_eq!(gemm_form(false, true, None, Scaling::None, 4096), plain);
        let all = layer_candidates(Operands::Bf16, Scaling::None, fused, 4096, 7168);
        assert!(!all.is_empty());
        assert!(all.iter().all(|c| c.epilogue == Epilogue::SiluMul
            && c.out == OutTy::Bf16
            && c.tile_weights() % 16 == 0));
        let w2 = layer_candidates(Operands::Bf16, Scaling::None, plain, 7168, 2048);
        assert_eq!(
            w2.len(),
            tune::candidates(Operands::Bf16, Scaling::None, 7168, 2048).len()
        );
    }

    /// The layer's placement comes from its replica table: every slot holds the expert whose
    /// replica it is; a slot without one is refused.
    #[test]
    fn the_placement_follows_the_replicas() {
        let p = placement_of(&Replicas::identity(4), 4).unwrap();
        assert_eq!(p, SlotMap::identity(4));
        let r = Replicas::from_phy2log(&[2, 0, 1, 2, 0], 3).unwrap();
        assert_eq!(placement_of(&r, 5).unwrap().phy2log(), &[2, 0, 1, 2, 0]);
        assert!(placement_of(&Replicas::identity(3), 4).is_err());
        let (l2p, cnt, max) = replica_table(&r, 2);
        assert_eq!((cnt, max), (vec![2, 1, 2], 2));
        assert_eq!(l2p, vec![1, 4, 2, -1, 0, 3]);
        // Rows as wide as the slots (the layer's table keeps its size across rebalances).
        let (l2p, _, max) = replica_table(&r, 5);
        assert_eq!(max, 5);
        assert_eq!(&l2p[..5], &[1, 4, -1, -1, -1]);
    }
}
