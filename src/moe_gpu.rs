//! The GPU MoE layer's operands (issue \[9\]), read off the verified module: what the generated
//! grouped GEMMs of `codegen::gemm::ws` take for a recipe's `w13` and `w2`, and how each GEMM's
//! input is fed. Host code only (CI tests it); [`crate::moe_gpu_layer`] uploads and runs it.
//!
//! # Where the bytes come from
//! Every weight code and scale is read through the recipe's verified storage maps
//! ([`crate::dequant::logical_experts`], the reader the host forward uses), in the *input's*
//! coordinates: `w13`'s rows come back `[gate; up]` whatever physical row order the recipe
//! stores, so the SiLU kernel pairs column `c` with column `I + c` (the fused first GEMM takes
//! [`GemmWeights::paired`] rows instead). The GEMM operand is then `W [slots, N, K]` row-major in
//! that order (int8 and 4-bit codes in the kernel's order within a row, int8 rows padded to 64
//! bytes), with its scales in the GEMM's layout:
//! * no scheme (bf16 weights): no scale;
//! * FP8 per tensor: `[slots]`, one per expert (every element of an expert must carry the same);
//! * FP8 per channel: `[slots, N]`, one per row; group-wise FP8 (and int8): group scales
//!   `[slots, groups, N]` f32 (every element of a group must carry the same);
//! * FP8 128x128 block: `[slots, ceil(N/128), ceil(K/128)]`, the scale of each 128x128 block of
//!   the input's coordinates (every element of a block must carry the same: a recipe whose rows
//!   are gathered across blocks is refused by name).
//!
//! For the standard `bf16`, `fp8_per_tensor` and `fp8_block128` recipes the stored order is the
//! input's, so the operand is the param's bytes; [`GemmWeights::relayout`] says whether it was not.
//! bf16 and E4M3 weights are also read in place where the param's storage is a TMA map of rows
//! ([`crate::gemm_access`], issue \[8\] item 2), and int8 codes where the param is stored exactly
//! as the GEMM's compact operand (K in the kernel's order, rows in the GEMM's order):
//! [`GemmWeights::in_place`] gives the map, plain or in the fused epilogue's paired order, and
//! [`GemmWeights::stored`] the bytes it reads.
//!
//! # What runs on the GPU
//! bf16 weights with bf16 activations; E4M3 per-tensor, per-channel and group-wise (groups of at
//! least 128) weights with per-token dynamic or static activation scales; E4M3 128x128-block weights with 1x128 per-token activation groups; the
//! weights-only recipes' int8 per-row and 4-bit (NVFP4, MXFP4, symmetric INT4) weights with bf16
//! activations (the dequantizing GEMMs of issue \[8\]). Anything else is refused with
//! [`MoeError::Unsupported`] naming it.

use std::collections::HashMap;

use crate::codegen::gemm::wmap::WLayout;
use crate::codegen::gemm::ws::{Operands, Scaling};
use crate::dsl::ir::{Fp8Granularity, QuantScheme};
use crate::dsl::ModuleInfo;
use crate::gemm_access::{Access, WeightAccess};
use crate::moe_host::{dims, Feed, Layer, MoeError};

type Result<T, E = MoeError> = std::result::Result<T, E>;

/// One GEMM's weight operand.
#[derive(Debug, Clone, PartialEq)]
pub struct GemmWeights {
    /// The GEMM's operand type and accumulator scaling.
    pub operands: Operands,
    /// How the accumulator is scaled (per-token activation scales for every FP8 tensorwise feed:
    /// dynamic ones, or static ones spread to rows).
    pub scaling: Scaling,
    /// Slots (the GEMM's experts).
    pub slots: usize,
    /// Output columns N (weight rows).
    pub n: usize,
    /// Depth K.
    pub k: usize,
    /// `[slots, N, Operands::w_row_bytes(K)]` codes, row-major in the input's order (bf16
    /// little-endian or E4M3 bytes;
    /// int8 bytes in the kernel's order within a row, rows padded to 64 bytes; 4-bit codes two
    /// per byte in the kernel's order within a row; [`GemmWeights::paired`] rows in the paired
    /// order).
    pub codes: Vec<u8>,
    /// The weight scales in the GEMM's layout (empty without scaling and for group-wise int8);
    /// 4-bit weights: one factor per slot.
    pub scales: Vec<f32>,
    /// 4-bit weights' group scales, `[slots, scale tiles, N, groups per k-tile]` (`W4::group_scale_at`) (E4M3 or E8M0 bytes, or bf16);
    /// group-wise int8's, `[slots, groups, N]` f32 (little-endian); empty for other operands.
    pub group_scales: Vec<u8>,
    /// Whether the codes differ from the stored param's bytes (a recipe that stores another row
    /// order or layout): the operand is then a re-laid-out copy.
    pub relayout: bool,
    /// How the GEMM can read the param itself (bf16 and E4M3 weights; int8 codes where the param
    /// is stored in the kernel's order, [`crate::gemm_access::KOrder`]; `None` for 4-bit codes,
    /// which the kernels take in their own order): [`crate::gemm_access`].
    pub access: Option<WeightAccess>,
    /// The param's stored bytes where `access` reads any of them in place; else empty.
    pub stored: Vec<u8>,
}

/// Everything the GPU layer needs of a recipe's params.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerOperands {
    /// The first GEMM: `[slots, 2I, H]`, `[gate; up]` rows.
    pub w13: GemmWeights,
    /// The second GEMM: `[slots, H, I]`.
    pub w2: GemmWeights,
    /// The first GEMM's feed (SPEC §9, the recipe's `activation` declaration).
    pub feed13: Feed,
    /// The second GEMM's feed.
    pub feed2: Feed,
    /// Physical slots.
    pub slots: usize,
    /// Hidden size H.
    pub h: usize,
    /// Intermediate size I.
    pub i: usize,
}

/// Whether a first GEMM of `n` rows (`[gate; up]`) with weight scaling `scaling` can take its rows
/// in the fused SiLU epilogue's paired order ([`GemmWeights::paired`]): `n` a multiple of 16; with
/// 128x128 block scales a multiple of 128 (`I` of 64, so that a tile's gate rows and its up rows
/// each lie in one block: the kernel reads each half's block scale by its `[gate; up]` row,
/// `WsConfig::paired_blocks`, and the scales stay in their `[E, N / 128, K / 128]` order).
pub fn pairable(scaling: Scaling, n: usize) -> bool {
    u32::try_from(n).is_ok_and(|n| crate::codegen::gemm::ws::rows_pair(scaling, n))
}

impl GemmWeights {
    /// The same weights with their rows in the fused SiLU epilogue's paired order
    /// ([`crate::codegen::gemm::ws::glu_row`]: per 16 rows, 8 gate rows then the 8 up rows of the
    /// same outputs), for a first GEMM of `[gate; up]` rows: the codes, per-row scales and group
    /// scales (4-bit, group-wise int8 and FP8) move with their rows (per-expert scales and 128x128
    /// block scales stay). `None` where that cannot be: N not a multiple of 16 (of 128 with block
    /// scales, [`pairable`]).
    pub fn paired(&self) -> Option<GemmWeights> {
        Some(GemmWeights {
            operands: self.operands,
            scaling: self.scaling,
            slots: self.slots,
            n: self.n,
            k: self.k,
            codes: self.paired_rows(&self.codes, self.slots, false)?,
            scales: self.paired_scales(false)?,
            group_scales: self.paired_group_scales(false)?,
            relayout: true,
            access: None,
            stored: Vec::new(),
        })
    }

    /// The weight scales of a GEMM reading the rows in the fused epilogue's paired order
    /// (`up_first`: [`crate::codegen::gemm::ws::paired_row`]'s), as [`GemmWeights::paired`] takes
    /// them: per-row (and per-channel) scales in that order, others as they are. `None` where the
    /// rows do not pair.
    pub fn paired_scales(&self, up_first: bool) -> Option<Vec<f32>> {
        Some(match self.scaling {
            Scaling::PerRow | Scaling::Channelwise { .. } => {
                let b: Vec<u8> = self.scales.iter().flat_map(|v| v.to_le_bytes()).collect();
                self.paired_rows(&b, self.slots, up_first)?
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect()
            }
            _ if pairable(self.scaling, self.n) => self.scales.clone(),
            _ => return None,
        })
    }

    /// The group scales in the same order (4-bit weights' `[slots, scale tiles, N, ..]` and the
    /// per-row-group scalings' `[slots, groups, N]` rows move with their rows); `None` where the
    /// rows do not pair.
    pub fn paired_group_scales(&self, up_first: bool) -> Option<Vec<u8>> {
        match (self.operands, self.scaling.row_group()) {
            (Operands::W4Bf16(w), _) => self.paired_rows(
                &self.group_scales,
                self.slots * w.scale_tiles(self.k),
                up_first,
            ),
            (_, Some(group)) => self.paired_rows(
                &self.group_scales,
                self.slots * self.k.div_ceil(group.max(1) as usize),
                up_first,
            ),
            _ if pairable(self.scaling, self.n) => Some(self.group_scales.clone()),
            _ => None,
        }
    }

    /// `v` as `runs` runs of N equal rows, each run's rows in the paired order (`up_first`: see
    /// [`crate::codegen::gemm::ws::paired_row`]); `None` where the rows do not pair or `v` is no
    /// such runs.
    fn paired_rows(&self, v: &[u8], runs: usize, up_first: bool) -> Option<Vec<u8>> {
        let n = self.n;
        if !pairable(self.scaling, n) || self.slots * n == 0 {
            return None;
        }
        let half = n / 2;
        let row = v.len().checked_div(runs * n)?;
        if row * runs * n != v.len() {
            return None;
        }
        let mut out = Vec::with_capacity(v.len());
        for run in v.chunks_exact(n * row) {
            for r in 0..n {
                let from = crate::codegen::gemm::ws::paired_row(r, half, up_first);
                out.extend_from_slice(&run[from * row..(from + 1) * row]);
            }
        }
        Some(out)
    }

    /// The param's map where the GEMM reads it in place: rows in the input's order, or
    /// (`paired`) in the fused epilogue's paired order; `None` where it takes a re-laid copy.
    pub fn in_place(&self, paired: bool) -> Option<&WLayout> {
        let a = self.access.as_ref()?;
        let which = if paired { a.paired.as_ref()? } else { &a.plain };
        let row = self.operands.w_row_bytes(self.k as u64);
        // (EPLB moves the buffer as `slots` equal chunks: exactly the slots' rows, no padding.)
        let whole = (self.slots * self.n) as u64 * row == self.stored.len() as u64;
        match which {
            Access::InPlace { layout, .. }
                if layout.span_bytes(row) <= self.stored.len() as u64
                    && !self.stored.is_empty()
                    && whole =>
            {
                Some(layout)
            }
            _ => None,
        }
    }
}

fn unsupported(info: &ModuleInfo, why: String) -> MoeError {
    MoeError::Unsupported {
        recipe: info.module().name.clone(),
        why,
    }
}

/// The scale of each of `groups` consecutive runs of `len` elements of `scales` (bits), which all
/// of a run's elements must share; `Err(i)` names the first run `i` that does not.
fn shared_scales(
    scales: &[u32],
    len: usize,
    groups: usize,
) -> std::result::Result<Vec<f32>, usize> {
    (0..groups)
        .map(|i| {
            let all = scales.get(i * len..(i + 1) * len).unwrap_or_default();
            let bits = all.first().copied().unwrap_or(0);
            if all.iter().any(|&b| b != bits) {
                Err(i)
            } else {
                Ok(f32::from_bits(bits))
            }
        })
        .collect()
}

/// The weight operand of input `name` (`w13` or `w2`), fed as `feed`: from the stored bytes where
/// they are the operand already ([`compact_weights`]), else (`read_back`, or any other form) from
/// the element-wise read-back.
fn weights(layer: &Layer<'_>, name: &str, feed: &Feed, read_back: bool) -> Result<GemmWeights> {
    if !read_back {
        if let Some(w) = compact_weights(layer, name, feed)? {
            return Ok(w);
        }
    }
    let info = layer.info;
    let l = crate::dequant::logical(info, name, layer.params).ok_or_else(|| {
        unsupported(
            info,
            format!("its params of `{name}` cannot be read back (a param missing, or a form the reader does not know)"),
        )
    })?;
    let (slots, n, k) = l.shape;
    let scheme = l.scheme;
    let gpu_feeds = "the GPU layer runs bf16 weights with bf16 activations, FP8 weights (per tensor, per channel or per group of at least 128 with per_token or static activation scales, 128x128 blocks with per_token_group = 128), int8 per-row weights and 4-bit weights (NVFP4, MXFP4, symmetric INT4) with bf16 activations";
    // The forms that need no more than one scale per expert, row, block or group first; the
    // others below (4-bit) or refused by name.
    let simple = simple_form(scheme, feed, l.dtype, k);
    let (operands, scaling) = match (simple, scheme, feed) {
        (Some(form), ..) => form,
        (None, None, _) => {
            return Err(unsupported(
                info,
                format!(
                    "`{name}` is a copy of {:?} weights fed as `{}`; the GPU layer's unquantized GEMM takes bf16 weights with bf16 activations",
                    l.dtype,
                    feed.describe()
                ),
            ))
        }
        // Group-wise FP8 with groups the GEMM does not take ([`simple_form`] takes the others).
        (
            None,
            Some(QuantScheme::Fp8 {
                granularity: Fp8Granularity::Group { group },
                ..
            }),
            Feed::PerToken | Feed::Static { .. },
        ) => {
            return Err(unsupported(
                info,
                format!(
                    "`{name}`: group-wise FP8 weights with groups of {group}: the GPU GEMM takes groups of a power of two, at least 128 (whole E4M3 k-tiles)"
                ),
            ))
        }
        // Int8 per row with K off the W8A16 alignment ([`simple_form`] takes the others): refused
        // here by name, not later by every GEMM configuration.
        (None, Some(QuantScheme::Int8Row), Feed::Bf16) => {
            return Err(unsupported(
                info,
                format!(
                    "`{name}`: int8 weights with K = {k}: the W8A16 GEMM takes K a multiple of {}",
                    crate::codegen::gemm::ws::I8_K_ALIGN
                ),
            ));
        }
        // Group-wise int8 with groups or K the W8A16 GEMM does not take ([`simple_form`] takes
        // the others).
        (None, Some(QuantScheme::Int8Group { group }), Feed::Bf16) => {
            return Err(unsupported(
                info,
                format!(
                    "`{name}`: group-wise int8 weights with groups of {group} and K = {k}: the GPU GEMM takes groups of a power of two, at least 64, and K a multiple of {}",
                    crate::codegen::gemm::ws::I8_K_ALIGN
                ),
            ))
        }
        // 4-bit codes with group scales, bf16 activations: W4A16 (`moe_gpu_w4`).
        (
            None,
            Some(QuantScheme::Nvfp4 { .. } | QuantScheme::Mxfp4 | QuantScheme::Int4 { .. }),
            Feed::Bf16,
        ) => {
            let w4 = crate::moe_gpu_w4::operand(&l);
            return w4_weights(layer, name, l.shape, w4);
        }
        (
            None,
            Some(
                QuantScheme::Nvfp4 { .. }
                | QuantScheme::Mxfp4
                | QuantScheme::Int8Row
                | QuantScheme::Int8Group { .. }
                | QuantScheme::Int4 { .. },
            ),
            _,
        ) => {
            return Err(unsupported(
                info,
                format!(
                    "`{name}` is weights-only quantized ({}) and fed as `{}`; the GPU GEMMs that dequantize such weights take bf16 activations",
                    scheme.map(|s| format!("{s:?}")).unwrap_or_default(),
                    feed.describe()
                ),
            ))
        }
        (None, s, f) => {
            return Err(unsupported(
                info,
                format!(
                    "`{name}`: weights {} fed as `{}`: {gpu_feeds}",
                    s.map(|s| format!("{s:?}")).unwrap_or_else(|| "bf16".into()),
                    f.describe()
                ),
            ))
        }
    };
    // (After the refusals of weights the GPU layer has no GEMM for, which name the form.)
    hopper_binding(info, name)?;
    let elem = operands.bytes() as usize;
    let mut codes = Vec::with_capacity(l.codes.len() * elem);
    for &c in &l.codes {
        match operands {
            Operands::Bf16 => codes.extend_from_slice(&(c as u16).to_le_bytes()),
            Operands::E4m3 | Operands::I8Bf16 | Operands::W4Bf16(_) => codes.push(c as u8),
        }
    }
    // Int8 codes in the W8A16 kernel's order (rows padded to 64 bytes).
    if operands == Operands::I8Bf16 {
        codes = crate::codegen::gemm::reference::i8_kernel_order(&codes, slots * n, k);
    }
    let per_expert = n * k;
    let scale_of = |at: usize| f32::from_bits(l.scales.get(at).copied().unwrap_or(0));
    let scales = match scaling {
        Scaling::None => Vec::new(),
        // One scale per slot, or per weight row: every element of it must carry that scale.
        Scaling::Tensorwise { .. } => shared_scales(&l.scales, per_expert, slots).map_err(|e| {
            unsupported(
                info,
                format!("`{name}`: slot {e}'s elements do not share one scale"),
            )
        })?,
        Scaling::PerExpert | Scaling::PerRowGroup { .. } | Scaling::Groupwise { .. } => Vec::new(),
        Scaling::PerRow | Scaling::Channelwise { .. } => shared_scales(&l.scales, k, slots * n)
            .map_err(|r| {
                unsupported(
                    info,
                    format!("`{name}`: row {r}'s elements do not share one scale"),
                )
            })?,
        Scaling::Block128 => {
            let (nb, kb) = (n.div_ceil(128), k.div_ceil(128));
            let mut s = vec![0f32; slots * nb * kb];
            for e in 0..slots {
                for r in 0..n {
                    for c in 0..k {
                        let at = (e * n + r) * k + c;
                        let b = (e * nb + r / 128) * kb + c / 128;
                        let v = scale_of(at);
                        if r % 128 == 0 && c % 128 == 0 {
                            s[b] = v;
                        } else if v.to_bits() != s[b].to_bits() {
                            return Err(unsupported(
                                info,
                                format!(
                                    "`{name}`: the scales of slot {e} are not uniform over the 128x128 blocks of the input's coordinates (row {r}, column {c}); the block-scaled GEMM reads one scale per block"
                                ),
                            ));
                        }
                    }
                }
            }
            s
        }
    };
    // Group-wise int8 and FP8: `[slots, groups, N]` f32 (little-endian bytes), every element of
    // a group carrying its scale.
    let group_scales = match scaling.row_group() {
        Some(group) => {
            let g = group as usize;
            let groups = k.div_ceil(g);
            let mut b = vec![0u8; slots * groups * n * 4];
            for e in 0..slots {
                for r in 0..n {
                    for q in 0..groups {
                        let at = (e * n + r) * k + q * g;
                        let all = &l.scales[at..at + g.min(k - q * g)];
                        if all.iter().any(|&v| v != all[0]) {
                            return Err(unsupported(
                                info,
                                format!(
                                    "`{name}`: slot {e}, row {r}: the elements of scale group {q} do not share one scale"
                                ),
                            ));
                        }
                        let o = ((e * groups + q) * n + r) * 4;
                        b[o..o + 4].copy_from_slice(&all[0].to_le_bytes());
                    }
                }
            }
            b
        }
        _ => Vec::new(),
    };
    Ok(with_access(
        layer,
        name,
        (operands, scaling),
        (slots, n, k),
        codes,
        scales,
        group_scales,
    ))
}

/// The GEMM form of the weights that need no more than their stored bytes and one scale per
/// expert, row, 128x128 block or group along K (what [`compact_weights`] builds): bf16 copies fed bf16; FP8 per
/// tensor (the token's scale in the epilogue) or per channel (a scale per weight row, applied with
/// the token's) fed per token or static; FP8 128x128 blocks fed per 1x128 group; FP8 groups along
/// K (a power of two, at least 128) fed per token or static; int8 codes with a per-row scale, or
/// per row and group (a power of two, at least 64), fed bf16 (W8A16: the weights dequantized into
/// the GEMM's register-sourced A operand), K a multiple of the W8A16 alignment. `None` for every
/// other form (the read-back path refuses those it does not run by name).
fn simple_form(
    scheme: Option<QuantScheme>,
    feed: &Feed,
    dtype: crate::dsl::ir::DType,
    k: usize,
) -> Option<(Operands, Scaling)> {
    let fp8 = |g: &Fp8Granularity| match scheme {
        Some(QuantScheme::Fp8 { granularity, .. }) => granularity == *g,
        _ => false,
    };
    let static_or_token = matches!(feed, Feed::PerToken | Feed::Static { .. });
    let i8_aligned = k.is_multiple_of(crate::codegen::gemm::ws::I8_K_ALIGN as usize);
    Some(match (scheme, feed) {
        (None, Feed::Bf16) if dtype == crate::dsl::ir::DType::Bf16 => {
            (Operands::Bf16, Scaling::None)
        }
        _ if fp8(&Fp8Granularity::Tensor) && static_or_token => {
            (Operands::E4m3, Scaling::Tensorwise { per_token: true })
        }
        _ if fp8(&Fp8Granularity::Channel) && static_or_token => {
            (Operands::E4m3, Scaling::Channelwise { per_token: true })
        }
        (_, Feed::PerTokenGroup128) if fp8(&Fp8Granularity::Block128) => {
            (Operands::E4m3, Scaling::Block128)
        }
        (Some(QuantScheme::Int8Row), Feed::Bf16) if i8_aligned => {
            (Operands::I8Bf16, Scaling::PerRow)
        }
        // Group-wise FP8 (groups of a power of two, at least 128) and int8 (at least 64).
        (
            Some(QuantScheme::Fp8 {
                granularity: Fp8Granularity::Group { group },
                ..
            }),
            _,
        ) if static_or_token => {
            let g = u32::try_from(group)
                .ok()
                .filter(|g| *g >= 128 && g.is_power_of_two())?;
            (
                Operands::E4m3,
                Scaling::Groupwise {
                    group: g,
                    per_token: true,
                },
            )
        }
        (Some(QuantScheme::Int8Group { group }), Feed::Bf16) if i8_aligned => {
            (Operands::I8Bf16, Scaling::per_row_group(group)?)
        }
        _ => return None,
    })
}

/// The operand of input `name` straight from its stored bytes, where [`crate::dequant::compact`]
/// finds them (row-major, rows in the input's order or gathered from it) and the form is one of
/// [`simple_form`]'s or 4-bit codes fed bf16 ([`crate::moe_gpu_w4::from_compact`]): the same
/// operand the read-back builds, without reading every element back (the start-up of a serving
/// process). `None` for every other form.
fn compact_weights(layer: &Layer<'_>, name: &str, feed: &Feed) -> Result<Option<GemmWeights>> {
    let info = layer.info;
    let Some(c) = crate::dequant::compact(info, name, layer.params) else {
        return Ok(None);
    };
    let Some(form) = simple_form(c.scheme, feed, c.dtype, c.shape.2) else {
        // 4-bit codes with group scales, bf16 activations: W4A16 (`moe_gpu_w4`).
        return match (c.scheme, feed) {
            (
                Some(QuantScheme::Nvfp4 { .. } | QuantScheme::Mxfp4 | QuantScheme::Int4 { .. }),
                Feed::Bf16,
            ) => w4_weights(layer, name, c.shape, crate::moe_gpu_w4::from_compact(&c)).map(Some),
            _ => Ok(None),
        };
    };
    hopper_binding(info, name)?;
    let (slots, n, k) = c.shape;
    // Group-wise: `[slots, groups, N]` f32 bytes from the `[slots, N, groups]` scales; else one
    // f32 per expert, row or block.
    let (scales, group_scales) = match form.1.row_group() {
        Some(group) => {
            let groups = k.div_ceil(group.max(1) as usize);
            let mut b = Vec::with_capacity(slots * groups * n * 4);
            for e in 0..slots {
                for q in 0..groups {
                    for r in 0..n {
                        let bits = c.scales.get((e * n + r) * groups + q).copied();
                        b.extend_from_slice(&bits.unwrap_or(0).to_le_bytes());
                    }
                }
            }
            (Vec::new(), b)
        }
        None => (
            c.scales.iter().map(|&b| f32::from_bits(b)).collect(),
            Vec::new(),
        ),
    };
    let codes = match form.0 {
        // Int8 codes in the W8A16 kernel's order (rows padded to 64 bytes), as the read-back's.
        Operands::I8Bf16 => {
            crate::codegen::gemm::reference::i8_kernel_order(&c.values, slots * n, k)
        }
        _ => c.values.into_owned(),
    };
    Ok(Some(with_access(
        layer,
        name,
        form,
        c.shape,
        codes,
        scales,
        group_scales,
    )))
}

/// The W4A16 operand of input `name` (`[slots, N, K]`) as [`crate::moe_gpu_w4`] built it (or why
/// the GEMM cannot take those weights), after the check that a Hopper binding reads its params.
fn w4_weights(
    layer: &Layer<'_>,
    name: &str,
    (slots, n, k): (usize, usize, usize),
    w4: std::result::Result<crate::moe_gpu_w4::W4Operand, String>,
) -> Result<GemmWeights> {
    let info = layer.info;
    let w4 = w4.map_err(|why| unsupported(info, format!("`{name}`: {why}")))?;
    hopper_binding(info, name)?;
    let relayout = stored_bytes(info, name, layer.params) != Some(w4.codes.as_slice());
    Ok(GemmWeights {
        operands: w4.operands,
        scaling: Scaling::PerExpert,
        slots,
        n,
        k,
        codes: w4.codes,
        scales: w4.factors,
        group_scales: w4.group_scales,
        relayout,
        access: None,
        stored: Vec::new(),
    })
}

/// A weight operand from its codes and scales: whether they are the stored bytes, and how the
/// GEMM can read the param in place ([`crate::gemm_access`]).
fn with_access(
    layer: &Layer<'_>,
    name: &str,
    (operands, scaling): (Operands, Scaling),
    (slots, n, k): (usize, usize, usize),
    codes: Vec<u8>,
    scales: Vec<f32>,
    group_scales: Vec<u8>,
) -> GemmWeights {
    let info = layer.info;
    let relayout = stored_bytes(info, name, layer.params).is_none_or(|b| b != codes.as_slice());
    // bf16 and E4M3 codes: the param itself, where its storage is a TMA map of rows; int8 codes
    // where it is the GEMM's compact operand in the kernel's order (4-bit codes: never).
    let order = match operands {
        Operands::I8Bf16 => Some(crate::gemm_access::KOrder::Int8Kernel),
        Operands::W4Bf16(_) => None,
        _ => Some(crate::gemm_access::KOrder::Contiguous),
    };
    let w_elem = operands.w_bits() as usize / 8;
    let access =
        order.map(|o| crate::gemm_access::weight_access(info, name, (slots, n, k), (w_elem, o)));
    let reads_param = access.as_ref().is_some_and(|a| {
        std::iter::once(&a.plain)
            .chain(a.paired.as_ref())
            .any(|x| matches!(x, Access::InPlace { .. }))
    });
    let stored = match stored_bytes(info, name, layer.params) {
        Some(b) if reads_param => b.to_vec(),
        _ => Vec::new(),
    };
    GemmWeights {
        operands,
        scaling,
        slots,
        n,
        k,
        codes,
        scales,
        group_scales,
        relayout,
        access,
        stored,
    }
}

/// The params holding input `name`'s codes and scales (and NVFP4's decode scale) must be read by
/// one of the recipe's `on sm_90a` kernel bindings, as the GEMM plan requires
/// (`gemm_variants::plan`, through the same `codegen::bindings::require`): the GPU layer runs
/// Hopper GEMMs only where the recipe says they may read those params.
fn hopper_binding(info: &ModuleInfo, name: &str) -> Result<()> {
    let m = info.module();
    let ids: Vec<_> = match info.quantization_of(name) {
        Some(q) => q
            .values
            .into_iter()
            .chain(q.scales)
            .chain(q.decode_scale)
            .map(|o| o.param)
            .collect(),
        None => info.copy_of(name).map(|c| c.param).into_iter().collect(),
    };
    let names: Vec<&str> = ids
        .iter()
        .filter_map(|&id| m.tensor(id).map(|t| t.name.as_str()))
        .collect();
    crate::codegen::bindings::require(info, crate::dsl::ir::Target::Sm90a, &names)
        .map(|_| ())
        .map_err(|why| unsupported(info, format!("`{name}`: {why}")))
}

/// The stored bytes of the param holding input `name`'s codes.
fn stored_bytes<'a>(
    info: &ModuleInfo,
    name: &str,
    params: &'a HashMap<String, Vec<u8>>,
) -> Option<&'a [u8]> {
    let id = match info.quantization_of(name) {
        Some(q) => q.values?.param,
        None => info.copy_of(name)?.param,
    };
    let pname = &info.module().tensor(id)?.name;
    params.get(pname).map(Vec::as_slice)
}

/// The GPU operands of a layer (see the module docs). Errors: a recipe or feed the GPU layer does
/// not run (named), a static activation scale that is not positive and finite.
pub fn operands(layer: &Layer<'_>) -> Result<LayerOperands> {
    layer_operands(layer, false)
}

/// [`operands`] with every weight operand built from the element-wise read-back
/// ([`crate::dequant::logical`]), never straight from the stored bytes: the reference the faster
/// path is tested against.
pub fn operands_read_back(layer: &Layer<'_>) -> Result<LayerOperands> {
    layer_operands(layer, true)
}

fn layer_operands(layer: &Layer<'_>, read_back: bool) -> Result<LayerOperands> {
    let (slots, h, i) = dims(layer.info)?;
    let f13 = Feed::of(layer.info, "w13", layer.params)?;
    let f2 = Feed::of(layer.info, "w2", layer.params)?;
    for f in [&f13, &f2] {
        if let Feed::Static { param, values } = f {
            if values.len() < slots {
                return Err(unsupported(
                    layer.info,
                    format!("`{param}` holds {} values for {slots} slots", values.len()),
                ));
            }
            if let Some((slot, &value)) = values
                .iter()
                .enumerate()
                .find(|(_, v)| !(v.is_finite() && **v > 0.0))
            {
                return Err(MoeError::ActivationScale {
                    param: param.clone(),
                    slot,
                    value,
                });
            }
        }
    }
    let w13 = weights(layer, "w13", &f13, read_back)?;
    let w2 = weights(layer, "w2", &f2, read_back)?;
    let shapes = [(&w13, 2 * i, h), (&w2, h, i)];
    for (w, n, k) in shapes {
        if (w.slots, w.n, w.k) != (slots, n, k) {
            return Err(unsupported(
                layer.info,
                format!(
                    "a GEMM operand is [{}, {}, {}], expected [{slots}, {n}, {k}]",
                    w.slots, w.n, w.k
                ),
            ));
        }
    }
    Ok(LayerOperands {
        w13,
        w2,
        feed13: f13,
        feed2: f2,
        slots,
        h,
        i,
    })
}
