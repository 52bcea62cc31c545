//! The grouped-GEMM variants a bound recipe can use (`moeforge compile --kernels gemm|all`): which
//! generated GEMM kernels serve the recipe's registered weights, at which `N`, `K` and pipeline
//! stages, and the PTX module that holds them all.
//!
//! The weights are the params `w13_weight` (`[E, N, K]` = `[E, 2I, H]`) and `w2_weight`
//! (`[E, H, I]`) of the verified module; what serves them is decided from their dtypes and
//! shapes at the binding, never from the recipe's name:
//! * bf16 weights: the v0 kernel (`codegen::gemm::kernel::grouped_bf16_v0`) at three stage counts,
//!   then every warp-specialized candidate (`codegen::gemm::tune::candidates`);
//! * e4m3 weights with a registered f32 weight scale of shape `[E]`: the tensorwise FP8
//!   candidates, with per-token (dynamic) and/or per-tensor (static) activation scales, as the
//!   recipe's `activation` declaration says (both where its static scale is optional);
//! * e4m3 weights with a registered f32 weight scale of shape `[E, ceil(N/128), ceil(K/128)]`: the
//!   `fp8_block128` candidates;
//! * i8 weights with a registered f32 scale of shape `[E, N]`: the W8A16 candidates (decode form,
//!   K a multiple of 16);
//! * e2m1 or u4 weights of a recognised 4-bit quantization (NVFP4, MXFP4, symmetric INT4 with
//!   bf16-exact scales): the W4A16 candidates (`W4::fits`: K a multiple of 64).
//!
//! Those are the benchmark's bf16-out forms ([`Plan::variants`]); [`Plan::layer`] adds the MoE
//! layer's own forms of the same GEMMs (f32 out, the fused SiLU*up epilogue where w13's rows pair,
//! per-token activation scales, the in-place row modes), which `compile --kernels gemm` writes
//! after them.
//!
//! The scale is the registered f32 param whose name starts with the weight's (`w13_weight_scale`,
//! `w13_weight_scale_inv`) and whose bound shape is one of those; for 4-bit weights, the
//! quantization's scales. A weight gets variants only where an `on sm_90a` kernel binding reads it
//! and its scales (NVFP4's decode scale too: `codegen::bindings::require`). Anything else is named
//! in [`Plan::missing`].

use crate::{codegen, dsl, Error, Result};

use codegen::gemm::kernel;
use codegen::gemm::tune;
use codegen::gemm::ws::{self, Operands, Scaling, WsConfig};

/// The pipeline stages emitted for every bf16 GEMM: the default first, then the autotune
/// candidates.
pub const BF16_V0_STAGES: [u32; 3] = [3, 2, 4];

/// The weight params the MoE layer's two GEMMs read, with the short name used in entry names.
pub const WEIGHTS: [(&str, &str); 2] = [("w13", "w13_weight"), ("w2", "w2_weight")];

/// One generated GEMM kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Variant {
    /// The GEMM: `w13` or `w2`.
    pub gemm: &'static str,
    /// The weight param it reads.
    pub param: String,
    /// The kernel family (`bf16_v0` or `ws`).
    pub family: &'static str,
    /// Its entry name.
    pub entry: String,
    /// Its entry's text (no module header).
    pub ptx: String,
    /// N, K and the pipeline stages.
    pub n: u32,
    /// K.
    pub k: u32,
    /// Pipeline stages.
    pub stages: u32,
    /// The warp-specialized configuration (`ws` family).
    pub ws: Option<WsConfig>,
    /// The weight-scale param it reads (FP8).
    pub scale_param: Option<String>,
}

/// The GEMM variants of a bound recipe, and the GEMMs that have none yet.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// The variants, w13's then w2's; per GEMM the bf16 v0 stages in [`BF16_V0_STAGES`] order
    /// (bf16 weights), then the warp-specialized candidates.
    pub variants: Vec<Variant>,
    /// The MoE layer's own forms of the same GEMMs, those not among `variants` (what `GpuLayer`
    /// tunes among and loads, and `cache warmup` builds: f32 out, and the first GEMM fused with
    /// SiLU*up where its rows pair, compiled for the row modes through which the layer reads the
    /// param in place; `crate::gemm_access::layer_variants`), w13's then w2's.
    pub layer: Vec<Variant>,
    /// One message per GEMM without a variant, e.g. "no GEMM variant for e4m3 weights yet
    /// (issue \[7\]): `w13_weight` is e4m3[E, 2*I, H]".
    pub missing: Vec<String>,
    /// The slow access patterns (`crate::gemm_access`): `(gemm, rows, what)` for each bf16 or
    /// E4M3 weight the GEMM cannot read in place (rows in the input's order), saying why it reads
    /// a copy re-laid on the host (`check --bind` reports every GEMM's access).
    pub access: Vec<(&'static str, &'static str, String)>,
}

impl Plan {
    /// Every variant as one PTX module (what `compile --kernels gemm` writes): the header once,
    /// then [`Plan::variants`]' entries in order ([`Plan::bench_module`]), then the layer's.
    pub fn module(&self) -> String {
        let mut s = self.bench_module();
        for v in &self.layer {
            s.push('\n');
            s.push_str(&v.ptx);
        }
        s
    }

    /// [`Plan::variants`] alone as one PTX module (the benchmark's bf16-out forms: the golden
    /// files'), a prefix of [`Plan::module`].
    pub fn bench_module(&self) -> String {
        module_of(&self.variants)
    }

    /// The layer's forms alone as one PTX module (the header, then [`Plan::layer`]'s entries).
    pub fn layer_module(&self) -> String {
        module_of(&self.layer)
    }

    /// The entries of the module, after a pack PTX module (`--kernels all`): every entry, in
    /// order, without a second header.
    pub fn entries(&self) -> String {
        let mut s = String::new();
        for v in self.variants.iter().chain(&self.layer) {
            s.push('\n');
            s.push_str(&v.ptx);
        }
        s
    }
}

/// The module header, then the entries of `vs` one line apart.
fn module_of(vs: &[Variant]) -> String {
    let mut s = kernel::module_header();
    for (i, v) in vs.iter().enumerate() {
        if i > 0 {
            s.push('\n');
        }
        s.push_str(&v.ptx);
    }
    s
}

/// The scaling the MoE layer's GEMMs take for a declared FP8 `s`: per-token activation scales
/// always (a recipe's static scale is spread per row by the layer), the rest as declared.
fn layer_scaling(s: Scaling) -> Scaling {
    match s {
        Scaling::Tensorwise { .. } => Scaling::Tensorwise { per_token: true },
        Scaling::Channelwise { .. } => Scaling::Channelwise { per_token: true },
        Scaling::Groupwise { group, .. } => Scaling::Groupwise {
            group,
            per_token: true,
        },
        s => s,
    }
}

/// The entry name of the bf16 v0 kernel of `gemm` at `stages`, e.g. `moeforge_gemm_bf16_v0_w13_s3`.
pub fn bf16_v0_entry(gemm: &str, stages: u32) -> String {
    format!("{}_{gemm}_s{stages}", kernel::V0_ENTRY)
}

/// The entry name of a warp-specialized variant of `gemm`, e.g.
/// `moeforge_gemm_bf16_p2x128_s6_bf16_w13`.
pub fn ws_entry(gemm: &str, cfg: &WsConfig) -> String {
    format!("moeforge_gemm_{}_{gemm}", cfg.tag())
}

/// The warp-specialized variant `cfg` of `gemm` over weight param `name` (scale `scale_param`).
fn ws_variant(
    gemm: &'static str,
    name: &str,
    cfg: WsConfig,
    scale_param: Option<&str>,
) -> Result<Variant> {
    let entry = ws_entry(gemm, &cfg);
    let ptx = ws::grouped_ws_entry(&entry, &cfg)?;
    Ok(Variant {
        gemm,
        param: name.to_string(),
        family: "ws",
        entry,
        ptx,
        n: cfg.n,
        k: cfg.k,
        stages: cfg.stages,
        ws: Some(cfg),
        scale_param: scale_param.map(str::to_string),
    })
}

/// The registered f32 scale of weight `name` (`[E, N, K]`): its name and scaling, if any param
/// named `name...` has the shape `[E]` (tensorwise), `[E, ceil(N/128), ceil(K/128)]` (block) or
/// `[E, N]` (per row: int8 weights).
fn weight_scale(
    info: &dsl::ModuleInfo,
    name: &str,
    e: i128,
    n: i128,
    k: i128,
) -> Option<(String, Scaling)> {
    let module = info.module();
    info.params.iter().find_map(|p| {
        let t = module.tensor(p.id)?;
        if t.name == name || !t.name.starts_with(name) || t.dtype != dsl::ir::DType::F32 {
            return None;
        }
        let shape = t
            .shape
            .iter()
            .map(|d| info.eval(d))
            .collect::<Option<Vec<i128>>>()?;
        let scaling = if shape == [e] {
            Scaling::Tensorwise { per_token: true }
        } else if shape == [e, (n + 127) / 128, (k + 127) / 128] {
            Scaling::Block128
        } else if shape == [e, n] {
            Scaling::PerRow
        } else {
            return None;
        };
        Some((t.name.clone(), scaling))
    })
}

/// The scalings of `gemm`'s variants, from the recipe's declared activation scheme (SPEC §9;
/// `dsl::ModuleInfo::activation_scales`): tensorwise FP8 weights take per-token activation scales
/// (`per_token`), a static one (`static(..)`), or both where the static scale is optional (the
/// per-token variant serves checkpoints without it); 128x128 block weights take
/// `per_token_group = 128`. Anything else is the reason there is no variant.
fn declared_scalings(
    info: &dsl::ModuleInfo,
    gemm: &str,
    operands: Operands,
    weight: Scaling,
) -> std::result::Result<Vec<Scaling>, String> {
    use dsl::ir::{ActDynamic, ActScale};
    if operands == Operands::Bf16 {
        return Ok(vec![weight]);
    }
    // Int8 and 4-bit weights take bf16 activations (W8A16, W4A16): no activation scale.
    if operands.register_a() {
        let act = info.activation();
        return if info.activation_scales(gemm).is_empty() {
            Ok(vec![weight])
        } else {
            Err(format!(
                "{} weights with {} activations (`activation {}`; the weights-only GEMMs take bf16)",
                operands.name(),
                act.dtype(),
                act.text(info.module())
            ))
        };
    }
    let act = info.activation();
    let scales = info.activation_scales(gemm);
    if scales.is_empty() {
        return Err(format!(
            "e4m3 weights with {} activations (`activation {}`)",
            act.dtype(),
            act.text(info.module())
        ));
    }
    let mut out = Vec::new();
    for s in scales {
        let scaling = match (weight, s) {
            (Scaling::Tensorwise { .. }, ActScale::Dynamic(ActDynamic::PerToken)) => {
                Scaling::Tensorwise { per_token: true }
            }
            (Scaling::Tensorwise { .. }, ActScale::Static(_)) => {
                Scaling::Tensorwise { per_token: false }
            }
            (Scaling::Channelwise { .. }, ActScale::Dynamic(ActDynamic::PerToken)) => {
                Scaling::Channelwise { per_token: true }
            }
            (Scaling::Channelwise { .. }, ActScale::Static(_)) => {
                Scaling::Channelwise { per_token: false }
            }
            (Scaling::Groupwise { group, .. }, ActScale::Dynamic(ActDynamic::PerToken)) => {
                Scaling::Groupwise {
                    group,
                    per_token: true,
                }
            }
            (Scaling::Groupwise { group, .. }, ActScale::Static(_)) => Scaling::Groupwise {
                group,
                per_token: false,
            },
            (Scaling::Block128, ActScale::Dynamic(ActDynamic::PerTokenGroup { group: 128 })) => {
                Scaling::Block128
            }
            (w, s) => {
                let weights = match w {
                    Scaling::Block128 => "128x128 block weight scales",
                    Scaling::Channelwise { .. } => "per-channel weight scales",
                    Scaling::Groupwise { .. } => "group-wise weight scales",
                    _ => "per-tensor weight scales",
                };
                let acts = match s {
                    ActScale::Static(_) => "static activation scales".to_string(),
                    ActScale::Dynamic(d) => format!("`{d}` activation scales"),
                };
                return Err(format!("{acts} with {weights}"));
            }
        };
        out.push(scaling);
    }
    Ok(out)
}

/// The GEMM variants that serve a verified, bound module's weights. Errors: no binding, a weight
/// param that is missing or not `[E, N, K]`, or a shape the kernel refuses.
pub fn plan(info: &dsl::ModuleInfo) -> Result<Plan> {
    if info.binding().is_none() {
        return Err(Error::Usage(
            "the GEMM variants need a binding (--bind)".into(),
        ));
    }
    let module = info.module();
    let mut plan = Plan::default();
    for (gemm, name) in WEIGHTS {
        let found = info
            .params
            .iter()
            .find_map(|p| module.tensor(p.id).filter(|t| t.name == name));
        let Some(t) = found else {
            plan.missing.push(format!(
                "no GEMM variant for `{gemm}`: the recipe registers no param `{name}`"
            ));
            continue;
        };
        let shape = t
            .shape
            .iter()
            .map(|d| info.eval(d))
            .collect::<Option<Vec<i128>>>()
            .ok_or_else(|| Error::Usage(format!("`{name}`: its shape is not bound")))?;
        let described = format!("`{name}` is {}{}", t.dtype, module.show_shape(&t.shape));
        let [e, n, k] = shape[..] else {
            return Err(Error::Usage(format!(
                "{described}: the GEMM reads its weight as [E, N, K]"
            )));
        };
        let family = match t.dtype {
            dsl::ir::DType::Bf16 => Some((Operands::Bf16, Scaling::None, None)),
            // FP8: per tensor, per 128x128 block, per channel (an `[E, N]` scale), or per group
            // along K (the quantization's scales, which the layer writes `[E, groups, N]`).
            dsl::ir::DType::E4m3 => {
                match info.quantization_of(gemm).map(|q| (q.scheme, q.scales)) {
                    Some((
                        dsl::ir::QuantScheme::Fp8 {
                            granularity: dsl::ir::Fp8Granularity::Group { group },
                            ..
                        },
                        Some(sc),
                    )) => u32::try_from(group)
                        .ok()
                        .filter(|g| *g >= 128 && g.is_power_of_two())
                        .and_then(|group| {
                            let p = module.tensor(sc.param)?.name.clone();
                            Some((
                                Operands::E4m3,
                                Scaling::Groupwise {
                                    group,
                                    per_token: true,
                                },
                                Some(p),
                            ))
                        }),
                    _ => weight_scale(info, name, e, n, k).map(|(p, s)| {
                        let s = match s {
                            Scaling::PerRow => Scaling::Channelwise { per_token: true },
                            s => s,
                        };
                        (Operands::E4m3, s, Some(p))
                    }),
                }
            }
            // W8A16: int8 codes with one f32 scale per row, bf16 activations; group-wise int8
            // (groups of a power of two, at least 64) with each group's sum promoted by its row's
            // scale, which the layer writes `[E, groups, N]` from the recipe's scale param.
            dsl::ir::DType::I8 => match info.quantization_of(gemm).map(|q| (q.scheme, q.scales)) {
                Some((dsl::ir::QuantScheme::Int8Group { group }, Some(sc))) => {
                    Scaling::per_row_group(group).and_then(|scaling| {
                        let p = module.tensor(sc.param)?.name.clone();
                        Some((Operands::I8Bf16, scaling, Some(p)))
                    })
                }
                _ => weight_scale(info, name, e, n, k)
                    .filter(|(_, s)| *s == Scaling::PerRow)
                    .map(|(p, s)| (Operands::I8Bf16, s, Some(p))),
            },
            // W4A16: E2M1 or u4 codes with group scales (NVFP4, MXFP4, symmetric INT4), the
            // format from the input's quantization; the kernel takes the group scales laid out
            // in its order, `W4::group_scale_at` (the layer writes them from the recipe's scale
            // param).
            dsl::ir::DType::E2m1 | dsl::ir::DType::U4 => info.quantization_of(gemm).and_then(|q| {
                let w4 = crate::moe_gpu_w4::format(q.scheme).ok()?;
                let fits =
                    matches!((u64::try_from(n), u64::try_from(k)), (Ok(n), Ok(k)) if w4.fits(n, k));
                let scales = module.tensor(q.scales?.param)?.name.clone();
                fits.then_some((Operands::W4Bf16(w4), Scaling::PerExpert, Some(scales)))
            }),
            _ => None,
        };
        let Some((operands, scaling, scale_param)) = family else {
            let why = match t.dtype {
                dsl::ir::DType::E4m3 => match info.quantization_of(gemm).map(|q| q.scheme) {
                    Some(dsl::ir::QuantScheme::Fp8 {
                        granularity: dsl::ir::Fp8Granularity::Group { .. },
                        ..
                    }) => {
                        " with group-wise scales in groups other than a power of two of at least 128 (whole E4M3 k-tiles)"
                    }
                    _ => {
                        " without a registered f32 weight scale of shape [E], [E, N] or [E, ceil(N/128), ceil(K/128)]"
                    }
                },
                dsl::ir::DType::I8 => match info.quantization_of(gemm).map(|q| q.scheme) {
                    Some(dsl::ir::QuantScheme::Int8Group { .. }) => {
                        " with group-wise scales in groups other than a power of two of at least 64"
                    }
                    _ => " without a registered f32 weight scale of shape [E, N]",
                },
                dsl::ir::DType::U4 | dsl::ir::DType::E2m1 => {
                    " (W4A16 takes E2M1 codes with E4M3 scales per 16 or E8M0 per 32, and INT4 with groups of a power of two (at least 32 with zero points), K a multiple of 64 and N of 16, or 8 with bf16 scales, or 4 with zero points)"
                }
                _ => "",
            };
            plan.missing.push(format!(
                "no GEMM variant for {} weights{why} yet (issue [7]): {described}",
                t.dtype
            ));
            continue;
        };
        // The recipe's `on sm_90a` kernel bindings say what its Hopper GEMMs may read: a weight
        // (its weight scale, and NVFP4's decode scale, which the layer folds into its factor) no
        // such binding reads gets no variant.
        let decode = info
            .quantization_of(gemm)
            .and_then(|q| q.decode_scale)
            .and_then(|o| module.tensor(o.param))
            .map(|t| t.name.as_str());
        let reads: Vec<&str> = std::iter::once(name)
            .chain(scale_param.as_deref())
            .chain(decode)
            .collect();
        if let Err(why) = crate::codegen::bindings::require(info, dsl::ir::Target::Sm90a, &reads) {
            plan.missing
                .push(format!("no GEMM variant for `{gemm}`: {why}"));
            continue;
        }
        // How the layer's GEMMs read the param: in place through its row modes, or a copy.
        let access = crate::gemm_access::of_gemm(info, gemm).map(|(_, a)| a);
        let rows_of = |a: Option<&crate::gemm_access::Access>| match a {
            Some(crate::gemm_access::Access::InPlace { layout, .. }) => layout.rows,
            _ => ws::WRows::PLAIN,
        };
        let plain_rows = rows_of(access.as_ref().map(|a| &a.plain));
        let (n, k) = match (u32::try_from(n), u32::try_from(k)) {
            (Ok(n), Ok(k)) => (n, k),
            _ => {
                return Err(Error::Usage(format!(
                    "{described}: N = {n}, K = {k} past the GEMM's 32-bit sizes"
                )))
            }
        };
        if operands == Operands::Bf16 {
            for stages in BF16_V0_STAGES {
                let entry = bf16_v0_entry(gemm, stages);
                let (ptx, launch) = kernel::grouped_bf16_v0_entry(&entry, n, k, stages)?;
                plan.variants.push(Variant {
                    gemm,
                    param: name.to_string(),
                    family: "bf16_v0",
                    entry,
                    ptx,
                    n,
                    k,
                    stages: launch.stages,
                    ws: None,
                    scale_param: None,
                });
            }
        }
        let scalings = match declared_scalings(info, gemm, operands, scaling) {
            Ok(s) => s,
            Err(why) => {
                plan.missing
                    .push(format!("no GEMM variant for {why} yet: {described}"));
                continue;
            }
        };
        // The slow pattern, said: bf16 or E4M3 weights whose storage the GEMM's TMA map cannot
        // read in place get a copy re-laid on the host (the variants serve the copy).
        if let Some(crate::gemm_access::Access::Relaid { why }) = access.as_ref().map(|a| &a.plain)
        {
            if !operands.register_a() {
                plan.access
                    .push((gemm, "plain", format!("a copy re-laid on the host: {why}")));
            }
        }
        for scaling in scalings {
            let all = tune::candidates(operands, scaling, n, k);
            // The row modes where some tile is a box of them, else the re-laid copy (said).
            let plain = match crate::gemm_access::for_rows(all.clone(), plain_rows) {
                Some(v) => v,
                None => {
                    let note = (
                        gemm,
                        "plain",
                        format!(
                            "a copy re-laid on the host: no tile of the candidates is a box of `{name}`'s row modes {:?}",
                            plain_rows.extents(n)
                        ),
                    );
                    // (Once a weight, not once per scaling.)
                    if !plan.access.iter().any(|a| a.0 == note.0 && a.1 == note.1) {
                        plan.access.push(note);
                    }
                    all
                }
            };
            for cfg in plain {
                plan.variants
                    .push(ws_variant(gemm, name, cfg, scale_param.as_deref())?);
            }
        }
        // The layer's own forms (`GpuLayer`): the first GEMM fused with SiLU*up where its rows
        // pair, in the form of each scheme the recipe declares for the second GEMM (bf16 out for
        // bf16 activations; with E4M3 ones f32 out, and the codes quantized in the GEMM for a
        // static scale: a static scale and its dynamic fallback are two forms), and f32 out
        // plain (the unfused path, and the second GEMM).
        let layer = layer_scaling(scaling);
        let a2: Vec<Option<ws::AQuant>> = {
            let declared = info.activation_scales("w2");
            if declared.is_empty() {
                vec![None]
            } else {
                declared.iter().filter_map(a2_of).map(Some).collect()
            }
        };
        let w13 = gemm == "w13";
        let mut forms: Vec<_> = a2
            .iter()
            .map(|&q| crate::moe_gpu_layer::gemm_form(w13, true, q, layer, n as usize))
            .collect();
        forms.dedup();
        let unfused = (ws::OutTy::F32, ws::Epilogue::Store);
        if !forms.contains(&unfused) {
            forms.push(unfused);
        }
        for form in forms {
            let cfgs = crate::gemm_access::layer_variants(
                crate::moe_gpu_layer::layer_candidates(operands, layer, form, n, k),
                access.as_ref(),
                form.1.silu(),
            );
            for cfg in cfgs {
                let entry = ws_entry(gemm, &cfg);
                if plan
                    .variants
                    .iter()
                    .chain(&plan.layer)
                    .any(|v| v.entry == entry)
                {
                    continue;
                }
                plan.layer
                    .push(ws_variant(gemm, name, cfg, scale_param.as_deref())?);
            }
        }
    }
    Ok(plan)
}

/// The E4M3 quantization of the second GEMM's `a` for a declared activation scheme (`None`: one
/// the GPU layer does not serve, a dynamic group other than 128).
fn a2_of(s: &dsl::ir::ActScale) -> Option<ws::AQuant> {
    use dsl::ir::{ActDynamic, ActScale};
    match s {
        ActScale::Static(_) => Some(ws::AQuant::Static),
        ActScale::Dynamic(ActDynamic::PerToken) => Some(ws::AQuant::PerToken),
        ActScale::Dynamic(ActDynamic::PerTokenGroup { group: 128 }) => Some(ws::AQuant::Group128),
        ActScale::Dynamic(ActDynamic::PerTokenGroup { .. }) => None,
    }
}
