//! `moeforge bench --gpu --gemm`: the MoE layer's first grouped GEMM (w13, gate and up: `N = 2I`,
//! `K = H`, weights `[E, N, K]`) at the anchor shapes of ../shared/ANCHORS.md (Qwen3-30B-A3B,
//! DeepSeek-V3 EP8, Mixtral-8x7B; 1 to 8192 tokens), for the bf16, fp8_per_tensor and fp8_block128
//! recipes, against torch's grouped GEMMs measured in the same run (`scripts/gemm_anchor.py`, a
//! subprocess fed the very row counts timed here) and vLLM's tuned Triton kernel as recorded in
//! ANCHORS.md.
//!
//! Routing is what `torch_anchors.py` does (uniform random top-k: every token picks `top_k`
//! distinct experts uniformly), drawn here from a seed fixed per (model, tokens), so that a case has
//! the same row counts in every run and for every recipe. The kernels are behind [`GemmRunner`]:
//! the harness owns the timing (warm-up, an L2 flush before each rep as triton's `do_bench` does,
//! CUDA events around the launch only, the median), a runner only prepares operands and launches.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use cudarc::driver::CudaSlice;
use serde_json::{json, Value};

use crate::codegen::gemm::ws::{Operands, Scaling};
use crate::runtime::{drv, Device};
use crate::{Error, Result};

/// HBM read-only streaming ceiling of the H200 (TB/s), ../shared/ANCHORS.md "Ceilings": the bound
/// for streaming weights.
pub const READ_CEILING_TBPS: f64 = 4.22;
/// Dense bf16 GEMM ceiling (cuBLAS 8192^3, TFLOP/s), ../shared/ANCHORS.md.
pub const BF16_CEILING_TFLOPS: f64 = 723.0;
/// Dense fp8 e4m3 GEMM ceiling (`torch._scaled_mm` 8192^3, TFLOP/s), ../shared/ANCHORS.md.
pub const FP8_CEILING_TFLOPS: f64 = 1272.0;
/// The token counts of the default sweep (the rows of ANCHORS.md's tables).
pub const DEFAULT_TOKENS: [usize; 6] = [1, 16, 128, 512, 2048, 8192];
/// The default anchor script, relative to the working directory (the repository root).
pub const DEFAULT_ANCHOR: &str = "scripts/gemm_anchor.py";
/// Kernel time aimed at per case when choosing the number of reps.
const BUDGET_US: f64 = 20_000.0;
/// Reps per case: at least, at most.
const MIN_REPS: usize = 3;
const MAX_REPS: usize = 200;
/// The buffer cleared before each rep so that no weight is served from L2 (60 MB on the H200), as
/// triton's `do_bench` does with its 256 MB buffer.
const FLUSH_BYTES: usize = 256 << 20;
/// Seconds the anchor subprocess may run before it is killed.
const ANCHOR_TIMEOUT_S: u64 = 240;

/// A model's MoE layer as one GPU holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Model {
    /// The name used on the command line and in ANCHORS.md.
    pub name: &'static str,
    /// Local experts E.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Hidden size H (w13's K).
    pub hidden: usize,
    /// Intermediate size I (w13's N is 2I).
    pub intermediate: usize,
}

/// The models of ANCHORS.md (and `torch_anchors.py`'s `MODELS`).
pub const MODELS: [Model; 3] = [
    Model {
        name: "qwen3-30b-a3b",
        experts: 128,
        top_k: 8,
        hidden: 2048,
        intermediate: 768,
    },
    // 256 experts over 8 GPUs: 32 local, every token routed among them (as the anchors do it).
    Model {
        name: "deepseek-v3-ep8",
        experts: 32,
        top_k: 8,
        hidden: 7168,
        intermediate: 2048,
    },
    Model {
        name: "mixtral-8x7b",
        experts: 8,
        top_k: 2,
        hidden: 4096,
        intermediate: 14336,
    },
];

/// The weight recipe of a case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Recipe {
    /// bf16 weights and activations.
    Bf16,
    /// e4m3 weights with one f32 scale per expert.
    Fp8PerTensor,
    /// e4m3 weights with an f32 scale per 128x128 block.
    Fp8Block128,
    /// Weights-only NVFP4 (`nvfp4_cutedsl`): E2M1 codes, an E4M3 scale per 16, bf16 activations
    /// (the W4A16 GEMM).
    Nvfp4,
    /// Weights-only MXFP4: E2M1 codes, an E8M0 scale per 32, bf16 activations.
    Mxfp4,
    /// Weights-only INT8 with an f32 scale per row (`int8_per_row`, the W8A16 GEMM).
    Int8Row,
    /// Weights-only group-wise INT4 (`int4_g128`): u4 codes, a bf16 scale per 128.
    Int4G128,
    /// Weights-only asymmetric group-wise INT4 (the variant `int4_g128_zp`): u4 codes, a bf16
    /// scale and a u4 zero point per 128.
    Int4G128Zp,
    /// Weights-only group-wise INT8 (the variant `int8_g128`): int8 codes, an f32 scale per 128.
    Int8G128,
    /// FP8 per channel (the variant `fp8_channel`): e4m3 weights with an f32 scale per row,
    /// per-token e4m3 activations.
    Fp8Channel,
    /// Group-wise FP8 (the variant `fp8_g128`): e4m3 weights with an f32 scale per row and 128
    /// along K, per-token e4m3 activations.
    Fp8G128,
}

impl Recipe {
    /// Every recipe with bf16 or FP8 activations, in table order (what `all` selects).
    pub const ALL: [Recipe; 3] = [Recipe::Bf16, Recipe::Fp8PerTensor, Recipe::Fp8Block128];

    /// The weights-only recipes (bf16 activations, the weights dequantized in the GEMM; decode
    /// form only): what `weights_only` selects.
    pub const WEIGHTS_ONLY: [Recipe; 4] = [
        Recipe::Nvfp4,
        Recipe::Mxfp4,
        Recipe::Int8Row,
        Recipe::Int4G128,
    ];

    /// Recipes of the variants (`kernels::VARIANTS`): selected by name only.
    pub const VARIANTS: [Recipe; 4] = [
        Recipe::Int4G128Zp,
        Recipe::Int8G128,
        Recipe::Fp8Channel,
        Recipe::Fp8G128,
    ];

    /// The recipe's name (a standard recipe's, or a variant's).
    pub fn name(self) -> &'static str {
        match self {
            Recipe::Bf16 => "bf16",
            Recipe::Fp8PerTensor => "fp8_per_tensor",
            Recipe::Fp8Block128 => "fp8_block128",
            Recipe::Nvfp4 => "nvfp4_cutedsl",
            Recipe::Mxfp4 => "mxfp4",
            Recipe::Int8Row => "int8_per_row",
            Recipe::Int4G128 => "int4_g128",
            Recipe::Int4G128Zp => "int4_g128_zp",
            Recipe::Int8G128 => "int8_g128",
            Recipe::Fp8Channel => "fp8_channel",
            Recipe::Fp8G128 => "fp8_g128",
        }
    }

    /// The recipe named `s`, if it is one of the seven standard ones or a variant.
    pub fn from_name(s: &str) -> Option<Recipe> {
        Recipe::ALL
            .into_iter()
            .chain(Recipe::WEIGHTS_ONLY)
            .chain(Recipe::VARIANTS)
            .find(|r| r.name() == s)
    }

    /// Whether the weights and activations are fp8.
    pub fn is_fp8(self) -> bool {
        matches!(
            self,
            Recipe::Fp8PerTensor | Recipe::Fp8Block128 | Recipe::Fp8Channel | Recipe::Fp8G128
        )
    }

    /// The GEMM family of the recipe's weights: operands and accumulator scaling.
    pub fn family(self) -> (Operands, Scaling) {
        use crate::codegen::gemm::ws::W4;
        match self {
            Recipe::Bf16 => (Operands::Bf16, Scaling::None),
            Recipe::Fp8PerTensor => (Operands::E4m3, Scaling::Tensorwise { per_token: true }),
            Recipe::Fp8Block128 => (Operands::E4m3, Scaling::Block128),
            Recipe::Nvfp4 => (Operands::W4Bf16(W4::NVFP4), Scaling::PerExpert),
            Recipe::Mxfp4 => (Operands::W4Bf16(W4::MXFP4), Scaling::PerExpert),
            Recipe::Int8Row => (Operands::I8Bf16, Scaling::PerRow),
            Recipe::Int4G128 => (Operands::W4Bf16(W4::INT4_G128), Scaling::PerExpert),
            Recipe::Int4G128Zp => (Operands::W4Bf16(W4::INT4_G128_ZP), Scaling::PerExpert),
            Recipe::Int8G128 => (Operands::I8Bf16, Scaling::PerRowGroup { group: 128 }),
            Recipe::Fp8Channel => (Operands::E4m3, Scaling::Channelwise { per_token: true }),
            Recipe::Fp8G128 => (
                Operands::E4m3,
                Scaling::Groupwise {
                    group: 128,
                    per_token: true,
                },
            ),
        }
    }

    /// The bytes one expert's w13 occupies (`N x K` values and their scales).
    pub fn expert_bytes(self, n: usize, k: usize) -> u64 {
        let (n, k) = (n as u64, k as u64);
        match self {
            Recipe::Bf16 => n * k * 2,
            Recipe::Fp8PerTensor => n * k + 4,
            Recipe::Fp8Block128 => n * k + n.div_ceil(128) * k.div_ceil(128) * 4,
            Recipe::Nvfp4 => n * k / 2 + n * k.div_ceil(16) + 4,
            Recipe::Mxfp4 => n * k / 2 + n * k.div_ceil(32),
            // (Int8 rows are padded to 64 bytes, which the kernel streams too.)
            Recipe::Int8Row => n * self.family().0.w_row_bytes(k) + 4 * n,
            Recipe::Int4G128 => n * k / 2 + 2 * n * k.div_ceil(128),
            // (The kernel's scale element carries the zero point: 4 bytes a group.)
            Recipe::Int4G128Zp => n * k / 2 + 4 * n * k.div_ceil(128),
            Recipe::Int8G128 => n * self.family().0.w_row_bytes(k) + 4 * n * k.div_ceil(128),
            Recipe::Fp8Channel => n * k + 4 * n,
            Recipe::Fp8G128 => n * k + 4 * n * k.div_ceil(128),
        }
    }

    /// The dense GEMM ceiling of the recipe's arithmetic (TFLOP/s).
    pub fn flops_ceiling(self) -> f64 {
        if self.is_fp8() {
            FP8_CEILING_TFLOPS
        } else {
            BF16_CEILING_TFLOPS
        }
    }
}

/// One benchmark case: a model's w13 GEMM at a token count under a recipe, with its row counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GemmCase {
    /// The model's name.
    pub model: String,
    /// The recipe.
    pub recipe: Recipe,
    /// Tokens in the batch.
    pub tokens: usize,
    /// Local experts E.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// N = 2I.
    pub n: usize,
    /// K = H.
    pub k: usize,
    /// Rows routed to each expert (`experts` entries, summing to `tokens * top_k`).
    pub rows: Vec<usize>,
}

impl GemmCase {
    /// All rows (tokens x top-k).
    pub fn rows_total(&self) -> usize {
        self.rows.iter().sum()
    }

    /// Experts that received at least one row (their weights are read).
    pub fn touched(&self) -> usize {
        self.rows.iter().filter(|r| **r > 0).count()
    }

    /// Exclusive prefix sums of the rows: `experts + 1` offsets, the last the total.
    pub fn offsets(&self) -> Vec<usize> {
        let mut o = Vec::with_capacity(self.rows.len() + 1);
        o.push(0);
        for r in &self.rows {
            o.push(o[o.len() - 1] + r);
        }
        o
    }
}

/// splitmix64: the routing's generator.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`; the modulo bias is below 2^-40 for the sizes used here).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// The routing seed of a (model, tokens) pair: the same for every recipe and every run.
pub fn case_seed(model: &str, tokens: usize) -> u64 {
    // FNV-1a over the name, then the token count mixed in.
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in model.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^ (tokens as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Uniform random top-k routing, as `torch_anchors.py`'s `routing(M, E, k, 0)` (the top k of
/// i.i.d. normal logits: k distinct experts, every k-subset equally likely): each of `tokens`
/// tokens picks `top_k` distinct experts of `experts` by a partial Fisher-Yates shuffle. Returns
/// the chosen experts, `[tokens, top_k]` row-major. Errors when `top_k` is 0 or above `experts`.
pub fn routing_ids(tokens: usize, experts: usize, top_k: usize, seed: u64) -> Result<Vec<usize>> {
    if top_k == 0 || top_k > experts {
        return Err(Error::Usage(format!(
            "routing: top-{top_k} of {experts} experts (needs 1 <= top_k <= experts)"
        )));
    }
    let mut rng = SplitMix(seed);
    let mut ids: Vec<usize> = (0..experts).collect();
    let mut out = Vec::with_capacity(tokens * top_k);
    for _ in 0..tokens {
        for j in 0..top_k {
            let r = j + rng.below(experts - j);
            ids.swap(j, r);
            out.push(ids[j]);
        }
    }
    Ok(out)
}

/// [`routing_ids`] as rows per expert (summing to `tokens * top_k`).
pub fn routing(tokens: usize, experts: usize, top_k: usize, seed: u64) -> Result<Vec<usize>> {
    let mut rows = vec![0usize; experts];
    for e in routing_ids(tokens, experts, top_k, seed)? {
        rows[e] += 1;
    }
    Ok(rows)
}

/// What a sweep covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// The models.
    pub models: Vec<Model>,
    /// The token counts.
    pub tokens: Vec<usize>,
    /// The recipes.
    pub recipes: Vec<Recipe>,
}

impl Selection {
    /// The selection from the command line's `--model`, `--tokens` and `--recipe` (each absent:
    /// everything; `all` also means everything). Errors name the value that is not known.
    pub fn parse(model: Option<&str>, tokens: Option<&str>, recipe: Option<&str>) -> Result<Self> {
        let models = match model.map(str::trim) {
            None | Some("all") => MODELS.to_vec(),
            Some(list) => {
                let mut v = Vec::new();
                for name in list.split(',').map(str::trim) {
                    let m = MODELS.iter().find(|m| m.name == name).ok_or_else(|| {
                        Error::Usage(format!(
                            "unknown --model `{name}` (expected {} or all)",
                            MODELS.map(|m| m.name).join(", ")
                        ))
                    })?;
                    if !v.contains(m) {
                        v.push(*m);
                    }
                }
                v
            }
        };
        let tokens = match tokens {
            None => DEFAULT_TOKENS.to_vec(),
            Some(list) => {
                let mut v = Vec::new();
                for t in list.split(',').map(str::trim) {
                    let n: usize = t.parse().map_err(|_| {
                        Error::Usage(format!(
                            "--tokens: `{t}` is not a token count (expected a comma-separated list of positive integers, e.g. 1,16,128)"
                        ))
                    })?;
                    if n == 0 || n > 1 << 20 {
                        return Err(Error::Usage(format!(
                            "--tokens: {n} is out of range (1 to {})",
                            1 << 20
                        )));
                    }
                    if !v.contains(&n) {
                        v.push(n);
                    }
                }
                v
            }
        };
        let recipes = match recipe.map(str::trim) {
            None | Some("all") => Recipe::ALL.to_vec(),
            Some("weights_only") => Recipe::WEIGHTS_ONLY.to_vec(),
            Some(list) => {
                let mut v = Vec::new();
                for name in list.split(',').map(str::trim) {
                    let r = Recipe::from_name(name).ok_or_else(|| {
                        Error::Usage(format!(
                            "unknown --recipe `{name}` for the grouped GEMM (expected a list of bf16, fp8_per_tensor, fp8_block128, nvfp4_cutedsl, mxfp4, int8_per_row, int4_g128, int4_g128_zp, int8_g128, fp8_channel, fp8_g128, or all, or weights_only)"
                        ))
                    })?;
                    if !v.contains(&r) {
                        v.push(r);
                    }
                }
                v
            }
        };
        Ok(Selection {
            models,
            tokens,
            recipes,
        })
    }

    /// The cases, model by model, tokens ascending within a model, recipes within a token count.
    pub fn cases(&self) -> Result<Vec<GemmCase>> {
        let mut out = Vec::new();
        for m in &self.models {
            for &t in &self.tokens {
                let rows = routing(t, m.experts, m.top_k, case_seed(m.name, t))?;
                for &r in &self.recipes {
                    out.push(GemmCase {
                        model: m.name.to_string(),
                        recipe: r,
                        tokens: t,
                        experts: m.experts,
                        top_k: m.top_k,
                        n: 2 * m.intermediate,
                        k: m.hidden,
                        rows: rows.clone(),
                    });
                }
            }
        }
        Ok(out)
    }
}

/// The cases as the JSON the anchor script reads: `{"cases": [{model, recipe, tokens, experts,
/// top_k, n, k, rows}, ...]}`.
pub fn cases_json(cases: &[GemmCase]) -> Value {
    let list: Vec<Value> = cases
        .iter()
        .map(|c| {
            json!({
                "model": c.model,
                "recipe": c.recipe.name(),
                "tokens": c.tokens,
                "experts": c.experts,
                "top_k": c.top_k,
                "n": c.n,
                "k": c.k,
                "rows": c.rows,
            })
        })
        .collect();
    json!({ "cases": list })
}

/// Read [`cases_json`]'s form back; every field checked (rows: one per expert).
pub fn cases_from_json(v: &Value) -> Result<Vec<GemmCase>> {
    let bad = |what: String| Error::Usage(format!("GEMM cases JSON: {what}"));
    let list = v
        .get("cases")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("no `cases` list".into()))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, c) in list.iter().enumerate() {
        let num = |f: &str| -> Result<usize> {
            c.get(f)
                .and_then(Value::as_u64)
                .and_then(|x| usize::try_from(x).ok())
                .ok_or_else(|| bad(format!("case {i}: `{f}` is not a count")))
        };
        let text = |f: &str| -> Result<&str> {
            c.get(f)
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("case {i}: `{f}` is not a string")))
        };
        let recipe = Recipe::from_name(text("recipe")?)
            .ok_or_else(|| bad(format!("case {i}: unknown recipe")))?;
        let rows = c
            .get("rows")
            .and_then(Value::as_array)
            .ok_or_else(|| bad(format!("case {i}: `rows` is not a list")))?
            .iter()
            .map(|r| {
                r.as_u64()
                    .and_then(|x| usize::try_from(x).ok())
                    .ok_or_else(|| bad(format!("case {i}: a row count is not a count")))
            })
            .collect::<Result<Vec<usize>>>()?;
        let case = GemmCase {
            model: text("model")?.to_string(),
            recipe,
            tokens: num("tokens")?,
            experts: num("experts")?,
            top_k: num("top_k")?,
            n: num("n")?,
            k: num("k")?,
            rows,
        };
        if case.rows.len() != case.experts {
            return Err(bad(format!(
                "case {i}: {} row counts for {} experts",
                case.rows.len(),
                case.experts
            )));
        }
        out.push(case);
    }
    Ok(out)
}

/// The figures of one timed case.
#[derive(Debug, Clone, PartialEq)]
pub struct Metrics {
    /// Floating-point operations: `2 x rows x N x K`.
    pub flops: f64,
    /// Bytes of the touched experts' weights (and scales), each read once.
    pub weight_bytes: u64,
    /// TFLOP/s.
    pub tflops: f64,
    /// Weight bytes per second, TB/s.
    pub weight_tbps: f64,
    /// `weight_tbps` as a percentage of [`READ_CEILING_TBPS`].
    pub pct_read_ceiling: f64,
    /// `tflops` as a percentage of the recipe's dense GEMM ceiling.
    pub pct_flops_ceiling: f64,
}

/// The metrics of `case` done in `us` microseconds.
pub fn metrics(case: &GemmCase, us: f64) -> Metrics {
    let flops = 2.0 * case.rows_total() as f64 * case.n as f64 * case.k as f64;
    let weight_bytes = case.touched() as u64 * case.recipe.expert_bytes(case.n, case.k);
    let secs = us * 1e-6;
    let tflops = flops / secs / 1e12;
    let weight_tbps = weight_bytes as f64 / secs / 1e12;
    Metrics {
        flops,
        weight_bytes,
        tflops,
        weight_tbps,
        pct_read_ceiling: 100.0 * weight_tbps / READ_CEILING_TBPS,
        pct_flops_ceiling: 100.0 * tflops / case.recipe.flops_ceiling(),
    }
}

/// vLLM's tuned Triton `fused_moe_kernel`, w13 only, as recorded in ../shared/ANCHORS.md ("vLLM's
/// Triton fused_moe kernel, same shapes"; measured 2026-11-30 on one H200 beside torch; vLLM is not
/// on the device image, so it cannot be re-run there): (model, tokens, bf16 us, fp8 us).
pub const VLLM_TRITON_US: [(&str, usize, f64, f64); 18] = [
    ("qwen3-30b-a3b", 1, 23.0, 20.9),
    ("qwen3-30b-a3b", 16, 129.6, 74.4),
    ("qwen3-30b-a3b", 128, 203.4, 113.5),
    ("qwen3-30b-a3b", 512, 206.4, 115.1),
    ("qwen3-30b-a3b", 2048, 274.8, 156.4),
    ("qwen3-30b-a3b", 8192, 760.8, 444.0),
    ("deepseek-v3-ep8", 1, 122.3, 72.0),
    ("deepseek-v3-ep8", 16, 427.0, 231.3),
    ("deepseek-v3-ep8", 128, 446.2, 240.0),
    ("deepseek-v3-ep8", 512, 603.6, 312.1),
    ("deepseek-v3-ep8", 2048, 1651.7, 897.6),
    ("deepseek-v3-ep8", 8192, 6101.1, 3300.2),
    ("mixtral-8x7b", 1, 125.9, 77.9),
    ("mixtral-8x7b", 16, 438.8, 232.4),
    ("mixtral-8x7b", 128, 453.7, 238.8),
    ("mixtral-8x7b", 512, 626.9, 348.8),
    ("mixtral-8x7b", 2048, 1533.5, 897.5),
    ("mixtral-8x7b", 8192, 6244.6, 3380.0),
];

/// torch's grouped GEMMs as recorded in ../shared/ANCHORS.md ("MoE first GEMM (w13, gate+up) with
/// torch's grouped kernels": `torch._grouped_mm` bf16 us, `torch._scaled_grouped_mm` fp8 rowwise
/// us): the run's own torch numbers are compared with these to show the machine's drift.
pub const TORCH_RECORDED_US: [(&str, usize, f64, f64); 18] = [
    ("qwen3-30b-a3b", 1, 35.4, 26.3),
    ("qwen3-30b-a3b", 16, 190.8, 119.5),
    ("qwen3-30b-a3b", 128, 265.9, 171.4),
    ("qwen3-30b-a3b", 512, 265.5, 172.5),
    ("qwen3-30b-a3b", 2048, 363.3, 241.0),
    ("qwen3-30b-a3b", 8192, 747.1, 1426.4),
    ("deepseek-v3-ep8", 1, 184.5, 109.8),
    ("deepseek-v3-ep8", 16, 637.9, 344.9),
    ("deepseek-v3-ep8", 128, 623.2, 343.8),
    ("deepseek-v3-ep8", 512, 897.1, 521.7),
    ("deepseek-v3-ep8", 2048, 1724.8, 1120.2),
    ("deepseek-v3-ep8", 8192, 5857.5, 3731.4),
    ("mixtral-8x7b", 1, 226.0, 113.0),
    ("mixtral-8x7b", 16, 747.2, 351.7),
    ("mixtral-8x7b", 128, 652.9, 342.4),
    ("mixtral-8x7b", 512, 869.0, 507.7),
    ("mixtral-8x7b", 2048, 1605.1, 1129.1),
    ("mixtral-8x7b", 8192, 5882.7, 3855.3),
];

fn lookup(
    table: &[(&str, usize, f64, f64)],
    model: &str,
    tokens: usize,
    recipe: Recipe,
) -> Option<f64> {
    table
        .iter()
        .find(|(m, t, _, _)| *m == model && *t == tokens)
        .map(|&(_, _, bf16, fp8)| if recipe.is_fp8() { fp8 } else { bf16 })
}

/// vLLM's recorded time for a case (its fp8 figure for both fp8 recipes); `None` off the table.
pub fn vllm_us(model: &str, tokens: usize, recipe: Recipe) -> Option<f64> {
    lookup(&VLLM_TRITON_US, model, tokens, recipe)
}

/// torch's recorded time for a case (fp8 rowwise for both fp8 recipes); `None` off the table.
pub fn torch_recorded_us(model: &str, tokens: usize, recipe: Recipe) -> Option<f64> {
    lookup(&TORCH_RECORDED_US, model, tokens, recipe)
}

/// The best peer of a case: the faster of torch (this run) and vLLM (recorded), with its name.
pub fn best_peer(torch: Option<f64>, vllm: Option<f64>) -> Option<(&'static str, f64)> {
    match (torch, vllm) {
        (Some(t), Some(v)) if v < t => Some(("vllm", v)),
        (Some(t), _) => Some(("torch", t)),
        (None, Some(v)) => Some(("vllm", v)),
        (None, None) => None,
    }
}

/// What a runner says about a case before it is timed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prepared {
    /// Operands are on the device; [`GemmRunner::launch`] runs the case. The string names the
    /// kernel (for the report).
    Ready(String),
    /// No kernel for this case yet (the table says "not built"); the string says why.
    NotBuilt(String),
}

/// A grouped-GEMM implementation under benchmark. The harness ([`time_case`]) calls
/// [`prepare`](GemmRunner::prepare) once per case, then [`launch`](GemmRunner::launch) once to
/// warm up and once per timed rep (an L2 flush and CUDA events around each launch are the
/// harness's), so that every runner is timed the same way.
pub trait GemmRunner {
    /// Make `case` ready to launch on `dev` (operands allocated once per case, or reused from an
    /// earlier case of the same shape), or say that there is no kernel for it.
    fn prepare(&mut self, dev: &Device, case: &GemmCase) -> Result<Prepared>;

    /// Queue one GEMM of the case last prepared on `dev.stream`, without waiting for it.
    fn launch(&mut self, dev: &Device) -> Result<()>;
}

/// Random finite bf16 values (magnitudes 2^-7 to 2, random signs) as little-endian bytes.
pub fn random_bf16(bytes: &mut [u8], seed: u64) {
    let mut rng = SplitMix(seed | 1);
    for pair in bytes.chunks_mut(2) {
        let r = rng.next();
        let bits = (((r >> 8) & 1) << 15) as u16
            | ((120 + (r & 7) as u16) << 7)
            | ((r >> 16) & 0x7f) as u16;
        for (d, s) in pair.iter_mut().zip(bits.to_le_bytes()) {
            *d = s;
        }
    }
}

/// Random e4m3 bytes, never one of the NaN codes 0x7f and 0xff (for fp8 runners).
pub fn random_e4m3(bytes: &mut [u8], seed: u64) {
    let mut rng = SplitMix(seed | 1);
    for b in bytes.iter_mut() {
        let mut v = (rng.next() >> 24) as u8;
        if v & 0x7f == 0x7f {
            v ^= 1;
        }
        *b = v;
    }
}

/// Fill a device buffer with a repeated host chunk of random data (`chunk` non-empty).
pub(crate) fn fill_device(dev: &Device, buf: &mut CudaSlice<u8>, chunk: &[u8]) -> Result<()> {
    let len = buf.len();
    let mut off = 0;
    while off < len && !chunk.is_empty() {
        let n = chunk.len().min(len - off);
        dev.stream
            .memcpy_htod(&chunk[..n], &mut buf.slice_mut(off..off + n))
            .map_err(drv("cuMemcpyHtoD"))?;
        off += n;
    }
    Ok(())
}

/// The timing of one case.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Timed: the median over `reps` launches, in microseconds, and the kernel's name.
    Timed {
        /// Median time per launch.
        us: f64,
        /// Timed launches.
        reps: usize,
        /// The kernel.
        kernel: String,
    },
    /// No kernel for the case yet.
    NotBuilt(String),
    /// The runner failed on this case.
    Failed(String),
}

/// Reps for a kernel of about `est_us` each: enough for 20 ms of kernel time, between 3 and 200.
pub fn reps_for(est_us: f64) -> usize {
    if !(est_us.is_finite() && est_us > 0.0) {
        return MIN_REPS;
    }
    ((BUDGET_US / est_us).ceil() as usize).clamp(MIN_REPS, MAX_REPS)
}

/// The median of `v` (the mean of the middle two for an even count); 0 for none.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// Time one case: prepare, one warm-up launch, one launch to estimate, then [`reps_for`] launches,
/// each after clearing `flush` (so that weights come from HBM, not L2) and timed alone with CUDA
/// events; the median.
pub fn time_case(
    dev: &Device,
    runner: &mut dyn GemmRunner,
    case: &GemmCase,
    flush: &mut CudaSlice<u8>,
) -> Result<Outcome> {
    let kernel = match runner.prepare(dev, case)? {
        Prepared::Ready(k) => k,
        Prepared::NotBuilt(why) => return Ok(Outcome::NotBuilt(why)),
    };
    let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut one = |runner: &mut dyn GemmRunner| -> Result<(_, _)> {
        dev.stream.memset_zeros(flush).map_err(drv("cuMemsetD8"))?;
        let a = dev
            .stream
            .record_event(timing)
            .map_err(drv("cuEventRecord"))?;
        runner.launch(dev)?;
        let b = dev
            .stream
            .record_event(timing)
            .map_err(drv("cuEventRecord"))?;
        Ok((a, b))
    };
    runner.launch(dev)?;
    dev.sync()?;
    let (a, b) = one(runner)?;
    let est_ms = f64::from(a.elapsed_ms(&b).map_err(drv("cuEventElapsedTime"))?);
    let reps = reps_for(est_ms * 1e3);
    let mut events = Vec::with_capacity(reps);
    for _ in 0..reps {
        events.push(one(runner)?);
    }
    dev.sync()?;
    let mut us = Vec::with_capacity(reps);
    for (a, b) in &events {
        us.push(f64::from(a.elapsed_ms(b).map_err(drv("cuEventElapsedTime"))?) * 1e3);
    }
    Ok(Outcome::Timed {
        us: median(&mut us),
        reps,
        kernel,
    })
}

/// Where torch's numbers come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Anchor {
    /// Run this script (`python3 SCRIPT CASES.json`).
    Script(PathBuf),
    /// Do not measure torch (`--no-anchor`).
    Off,
}

/// torch's result for one case.
#[derive(Debug, Clone, PartialEq)]
pub struct TorchResult {
    /// Median microseconds, if measured.
    pub us: Option<f64>,
    /// What was measured (e.g. `torch._scaled_grouped_mm fp8 rowwise`).
    pub anchor: String,
    /// A note (fp8_block128: torch has no blockwise grouped GEMM) or the error.
    pub note: Option<String>,
}

/// The anchor script's output: per case (model, recipe, tokens), and a reason when nothing was
/// measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TorchResults {
    /// Results by case.
    pub by_case: BTreeMap<(String, String, usize), TorchResult>,
    /// Why torch was not measured at all (missing python3, torch, script, GPU...).
    pub not_measured: Option<String>,
    /// The torch version and device the script reported.
    pub version: Option<String>,
}

/// Parse the anchor script's standard output: one JSON object per line (other lines ignored).
/// A record with `model`, `recipe` and `tokens` is a case's (`us` or `error`); one without them
/// and with `error` says why nothing was measured; `{"what": "device", ...}` names torch's version.
pub fn parse_anchor_output(text: &str) -> TorchResults {
    let mut r = TorchResults::default();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line.trim()) else {
            continue;
        };
        let s = |f: &str| v.get(f).and_then(Value::as_str).map(str::to_string);
        let key = (
            s("model"),
            s("recipe"),
            v.get("tokens").and_then(Value::as_u64),
        );
        match key {
            (Some(m), Some(rc), Some(t)) => {
                let us = v.get("us").and_then(Value::as_f64).filter(|x| *x > 0.0);
                let note = s("error")
                    .map(|e| format!("error: {e}"))
                    .or_else(|| s("note"));
                r.by_case.insert(
                    (m, rc, t as usize),
                    TorchResult {
                        us,
                        anchor: s("anchor").unwrap_or_default(),
                        note,
                    },
                );
            }
            _ => {
                if let Some(e) = s("error") {
                    r.not_measured = Some(e);
                } else if s("what").as_deref() == Some("device") {
                    r.version = Some(format!(
                        "torch {} on {}",
                        s("torch").unwrap_or_default(),
                        s("name").unwrap_or_default()
                    ));
                }
            }
        }
    }
    if r.by_case.is_empty() && r.not_measured.is_none() {
        r.not_measured = Some("the anchor script printed no result".into());
    }
    r
}

/// Run the anchor script on `cases` (written to a temporary JSON file) and parse what it prints;
/// never an error: whatever goes wrong is the reason torch was not measured.
pub fn run_anchor(script: &Path, cases: &[GemmCase]) -> TorchResults {
    let not = |why: String| TorchResults {
        not_measured: Some(why),
        ..TorchResults::default()
    };
    if !script.is_file() {
        return not(format!(
            "{} not found (run from the repository root, or pass --anchor PATH)",
            script.display()
        ));
    }
    let dir = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => return not(format!("temporary folder: {e}")),
    };
    let file = dir.path().join("gemm_cases.json");
    let text = cases_json(cases).to_string();
    if let Err(e) = std::fs::write(&file, text) {
        return not(format!("{}: {e}", file.display()));
    }
    let child = std::process::Command::new("python3")
        .arg(script)
        .arg(&file)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return not("python3 not found".into())
        }
        Err(e) => return not(format!("python3: {e}")),
    };
    let reader = |p: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut p) = p {
                let _ = p.read_to_string(&mut s);
            }
            s
        })
    };
    let out = reader(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
    );
    let err = reader(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
    );
    let t0 = std::time::Instant::now();
    let mut timed_out = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if t0.elapsed().as_secs() >= ANCHOR_TIMEOUT_S => {
                timed_out = true;
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Ok(None) => std::thread::sleep(std::time::Duration::from_millis(50)),
            Err(e) => return not(format!("waiting for python3: {e}")),
        }
    };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    let mut r = parse_anchor_output(&stdout);
    if timed_out {
        r.not_measured
            .get_or_insert_with(|| format!("the anchor script ran past {ANCHOR_TIMEOUT_S} s"));
    }
    if r.by_case.is_empty() {
        let tail: Vec<&str> = stderr.lines().rev().take(3).collect();
        if !tail.is_empty() && status.is_some_and(|s| !s.success()) {
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            r.not_measured = Some(format!(
                "{}; stderr: {}",
                r.not_measured.unwrap_or_default(),
                tail.join(" | ")
            ));
        }
    }
    r
}

/// One row of the report.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The case.
    pub case: GemmCase,
    /// Our timing.
    pub ours: Outcome,
    /// torch's, if measured.
    pub torch: Option<TorchResult>,
}

impl Row {
    /// Our median time, if timed.
    pub fn ours_us(&self) -> Option<f64> {
        match self.ours {
            Outcome::Timed { us, .. } => Some(us),
            _ => None,
        }
    }

    /// The row as JSON: the case, our metrics, torch, vLLM, the best peer and the ratios
    /// (peer time / our time: above 1, moeforge is faster).
    pub fn json(&self) -> Value {
        let c = &self.case;
        let torch_us = self.torch.as_ref().and_then(|t| t.us);
        let vllm = vllm_us(&c.model, c.tokens, c.recipe);
        let peer = best_peer(torch_us, vllm);
        let ours = self.ours_us();
        let ratio = |peer: Option<f64>| match (peer, ours) {
            (Some(p), Some(o)) if o > 0.0 => json!(p / o),
            _ => Value::Null,
        };
        let mut v = json!({
            "model": c.model,
            "recipe": c.recipe.name(),
            "tokens": c.tokens,
            "experts": c.experts,
            "top_k": c.top_k,
            "n": c.n,
            "k": c.k,
            "rows": c.rows,
            "rows_total": c.rows_total(),
            "touched": c.touched(),
            "weight_bytes": c.touched() as u64 * c.recipe.expert_bytes(c.n, c.k),
            "ours_us": ours,
            "torch_us": torch_us,
            "torch_anchor": self.torch.as_ref().map(|t| t.anchor.clone()),
            "torch_note": self.torch.as_ref().and_then(|t| t.note.clone()),
            "torch_recorded_us": torch_recorded_us(&c.model, c.tokens, c.recipe),
            "torch_ratio": ratio(torch_us),
            "vllm_us": vllm,
            "best_peer": peer.map(|p| p.0),
            "best_peer_us": peer.map(|p| p.1),
            "best_peer_ratio": ratio(peer.map(|p| p.1)),
        });
        match &self.ours {
            Outcome::Timed { us, reps, kernel } => {
                let m = metrics(c, *us);
                v["status"] = json!("timed");
                v["kernel"] = json!(kernel);
                v["reps"] = json!(reps);
                v["tflops"] = json!(m.tflops);
                v["weight_tbps"] = json!(m.weight_tbps);
                v["pct_read_ceiling"] = json!(m.pct_read_ceiling);
                v["pct_flops_ceiling"] = json!(m.pct_flops_ceiling);
            }
            Outcome::NotBuilt(why) => {
                v["status"] = json!("not built");
                v["reason"] = json!(why);
            }
            Outcome::Failed(why) => {
                v["status"] = json!("failed");
                v["reason"] = json!(why);
            }
        }
        v
    }
}

/// The table header.
fn header() -> String {
    format!(
        "{:<16} {:<14} {:>6} {:>7} | {:>9} {:>7} {:>6} {:>6} {:>6} | {:>9} {:>6} | {:>8} {:>6}",
        "model",
        "recipe",
        "tokens",
        "touched",
        "ours us",
        "TFLOP/s",
        "W TB/s",
        "%HBM",
        "%peak",
        "torch us",
        "t/ours",
        "vLLM us",
        "peer/o"
    )
}

/// One table line.
fn line(r: &Row) -> String {
    let c = &r.case;
    let f = |x: Option<f64>, prec: usize, w: usize| match x {
        Some(x) => format!("{x:>w$.prec$}"),
        None => format!("{:>w$}", "-"),
    };
    let ours = match &r.ours {
        Outcome::Timed { us, .. } => {
            let m = metrics(c, *us);
            format!(
                "{:>9.1} {:>7.1} {:>6.2} {:>5.1}% {:>5.1}%",
                us, m.tflops, m.weight_tbps, m.pct_read_ceiling, m.pct_flops_ceiling
            )
        }
        Outcome::NotBuilt(_) => {
            format!("{:>9} {:>7} {:>6} {:>6} {:>6}", "not built", "", "", "", "")
        }
        Outcome::Failed(_) => format!("{:>9} {:>7} {:>6} {:>6} {:>6}", "FAILED", "", "", "", ""),
    };
    let torch = r.torch.as_ref().and_then(|t| t.us);
    let vllm = vllm_us(&c.model, c.tokens, c.recipe);
    let ours_us = r.ours_us();
    let ratio = |p: Option<f64>| p.zip(ours_us).map(|(p, o)| p / o);
    format!(
        "{:<16} {:<14} {:>6} {:>7} | {} | {} {} | {} {}",
        c.model,
        c.recipe.name(),
        c.tokens,
        c.touched(),
        ours,
        f(torch, 1, 9),
        f(ratio(torch), 2, 6),
        f(vllm, 1, 8),
        f(ratio(best_peer(torch, vllm).map(|p| p.1)), 2, 6)
    )
}

/// The report's text: a table with one row per case, then the notes.
pub fn render(device: &str, rows: &[Row], torch: &TorchResults) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "grouped GEMM w13 (N = 2I, K = H) on {device}: median of CUDA-event-timed launches, L2 flushed before each; uniform random top-k routing (seeded per model and token count); ceilings: weights {READ_CEILING_TBPS} TB/s (HBM read), dense {BF16_CEILING_TFLOPS} (bf16) / {FP8_CEILING_TFLOPS} (fp8) TFLOP/s"
    );
    match (&torch.not_measured, &torch.version) {
        (Some(why), _) if torch.by_case.is_empty() => {
            let _ = writeln!(out, "torch: not measured ({why})");
        }
        (_, Some(v)) => {
            let _ = writeln!(out, "torch: measured now ({v}), same row counts; bf16 and the weights-only recipes: torch._grouped_mm bf16; fp8 recipes: torch._scaled_grouped_mm fp8 rowwise (torch has no blockwise grouped GEMM, so fp8_block128 is compared with rowwise)");
        }
        _ => {
            let _ = writeln!(out, "torch: measured now, same row counts");
        }
    }
    let _ = writeln!(out, "vLLM: tuned Triton fused_moe as recorded in ANCHORS.md (not re-run); t/ours and peer/o: the peer's time over ours (above 1: moeforge is faster); peer = the faster of torch (now) and vLLM (recorded)");
    let _ = writeln!(out, "{}", header());
    for r in rows {
        let _ = writeln!(out, "{}", line(r));
    }
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    for r in rows {
        match &r.ours {
            Outcome::NotBuilt(why) => *reasons.entry(format!("not built: {why}")).or_default() += 1,
            Outcome::Failed(why) => {
                let _ = writeln!(
                    out,
                    "FAILED {} {} {} tokens: {why}",
                    r.case.model,
                    r.case.recipe.name(),
                    r.case.tokens
                );
            }
            Outcome::Timed { .. } => {}
        }
        if let Some(TorchResult {
            note: Some(n),
            us: None,
            ..
        }) = &r.torch
        {
            *reasons
                .entry(format!("torch {}: {n}", r.case.recipe.name()))
                .or_default() += 1;
        }
    }
    for (why, n) in reasons {
        let _ = writeln!(out, "({n} case(s)) {why}");
    }
    // torch now against torch recorded: the machine's drift.
    let drift: Vec<f64> = rows
        .iter()
        .filter_map(|r| {
            let now = r.torch.as_ref()?.us?;
            let rec = torch_recorded_us(&r.case.model, r.case.tokens, r.case.recipe)?;
            Some(now / rec)
        })
        .collect();
    if !drift.is_empty() {
        let lo = drift.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = drift.iter().copied().fold(0.0, f64::max);
        let _ = writeln!(
            out,
            "torch now / torch recorded (ANCHORS.md): {lo:.2} to {hi:.2} over {} case(s)",
            drift.len()
        );
    }
    out
}

/// What `moeforge bench --gpu --gemm` runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// The cases.
    pub selection: Selection,
    /// torch's anchor.
    pub anchor: Anchor,
    /// Where to write the JSON report (atomically), if anywhere.
    pub json: Option<PathBuf>,
    /// The runtime's settings: the kernel and tuning caches' folder, the PTX compiler.
    pub runtime: crate::runtime::Settings,
}

/// Run the benchmark with `runner`; the report's text, and whether every case that has a kernel
/// ran. Without a GPU: a SKIPPED line, nothing written.
pub fn run_with(opts: &Options, runner: &mut dyn GemmRunner) -> Result<(String, bool)> {
    let cases = opts.selection.cases()?;
    if let Some(p) = &opts.json {
        // Refused before any device time is spent.
        crate::check_output(p, &[])?;
        if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
            if !dir.is_dir() {
                return Err(Error::Usage(format!(
                    "--json {}: the folder {} does not exist",
                    p.display(),
                    dir.display()
                )));
            }
        }
    }
    let dev = match crate::gpu::open() {
        Ok(d) => d,
        Err(why) => {
            return Ok((
                format!("SKIPPED: the GEMM benchmark needs a CUDA GPU ({why})\n"),
                true,
            ))
        }
    };
    let mut flush = dev
        .stream
        .alloc_zeros::<u8>(FLUSH_BYTES)
        .map_err(drv("cuMemAlloc"))?;
    let mut rows = Vec::with_capacity(cases.len());
    let mut ok = true;
    for c in &cases {
        let ours = match time_case(&dev, runner, c, &mut flush) {
            Ok(o) => o,
            Err(e) => {
                ok = false;
                // The stream may hold the failure: later cases report their own.
                let _ = dev.sync();
                Outcome::Failed(e.to_string())
            }
        };
        rows.push(Row {
            case: c.clone(),
            ours,
            torch: None,
        });
    }
    drop(flush);
    dev.sync()?;
    let torch = match &opts.anchor {
        Anchor::Off => TorchResults {
            not_measured: Some("--no-anchor".into()),
            ..TorchResults::default()
        },
        Anchor::Script(p) => run_anchor(p, &cases),
    };
    for r in rows.iter_mut() {
        r.torch = torch
            .by_case
            .get(&(
                r.case.model.clone(),
                r.case.recipe.name().to_string(),
                r.case.tokens,
            ))
            .cloned();
    }
    let mut text = render(&dev.name, &rows, &torch);
    if let Some(p) = &opts.json {
        let v = json!({
            "what": "bench_gemm",
            "device": dev.name,
            "ceilings": {
                "read_TBps": READ_CEILING_TBPS,
                "bf16_TFLOPs": BF16_CEILING_TFLOPS,
                "fp8_TFLOPs": FP8_CEILING_TFLOPS,
            },
            "torch": {
                "measured": !torch.by_case.is_empty(),
                "not_measured": torch.not_measured,
                "version": torch.version,
            },
            "vllm": "recorded, ../shared/ANCHORS.md",
            "cases": rows.iter().map(Row::json).collect::<Vec<_>>(),
        });
        let bytes = serde_json::to_vec_pretty(&v).map_err(|e| Error::Usage(e.to_string()))?;
        crate::write_atomic(p, &bytes)?;
        let _ = writeln!(text, "wrote {}", p.display());
    }
    Ok((text, ok))
}

/// [`run_with`] the tuned warp-specialized runner ([`crate::bench_gemm_ws::WsRunner`]) over the
/// kernel and tuning caches of `opts.runtime`.
pub fn run(opts: &Options) -> Result<(String, bool)> {
    let mut runner = crate::bench_gemm_ws::WsRunner::with_settings(&opts.runtime)?;
    run_with(opts, &mut runner)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn routing_is_deterministic_and_sums_to_tokens_times_top_k() {
        for m in MODELS {
            for t in DEFAULT_TOKENS {
                let s = case_seed(m.name, t);
                let a = routing(t, m.experts, m.top_k, s).unwrap();
                assert_eq!(a, routing(t, m.experts, m.top_k, s).unwrap());
                assert_eq!(a.len(), m.experts);
                assert_eq!(a.iter().sum::<usize>(), t * m.top_k);
                // No expert gets a token twice: at most `t` rows each.
                assert!(a.iter().all(|r| *r <= t));
            }
        }
        // One token: exactly top_k experts with one row.
        let one = routing(1, 128, 8, 3).unwrap();
        assert_eq!(one.iter().filter(|r| **r == 1).count(), 8);
        // Uniform: 8192 tokens of top-8 over 128 experts, 512 rows each on average.
        let many = routing(8192, 128, 8, 5).unwrap();
        assert!(many.iter().all(|r| (400..=630).contains(r)), "{many:?}");
        assert_ne!(
            routing(16, 32, 8, case_seed("a", 16)).unwrap(),
            routing(16, 32, 8, case_seed("b", 16)).unwrap()
        );
        assert!(routing(1, 4, 5, 0).is_err());
        assert!(routing(1, 4, 0, 0).is_err());
    }

    #[test]
    fn every_recipe_of_a_token_count_has_the_same_rows() {
        let s = Selection::parse(Some("mixtral-8x7b"), Some("16,512"), None).unwrap();
        let cases = s.cases().unwrap();
        assert_eq!(cases.len(), 6);
        assert_eq!(cases[0].rows, cases[1].rows);
        assert_eq!(cases[0].rows, cases[2].rows);
        assert_eq!((cases[0].n, cases[0].k), (28672, 4096));
        assert_eq!(cases[3].rows_total(), 1024);
    }

    #[test]
    fn cases_round_trip_through_json() {
        let cases = Selection::parse(None, None, None).unwrap().cases().unwrap();
        assert_eq!(cases.len(), 54);
        let text = cases_json(&cases).to_string();
        let back = cases_from_json(&serde_json::from_str(&text).unwrap()).unwrap();
        assert_eq!(back, cases);
        // Rows that do not match the experts are refused.
        let mut v = cases_json(&cases[..1]);
        v["cases"][0]["rows"] = json!([1, 2]);
        assert!(cases_from_json(&v).is_err());
        assert!(cases_from_json(&json!({"x": 1})).is_err());
        v["cases"][0]["rows"] = json!(cases[0].rows);
        v["cases"][0]["recipe"] = json!("int4");
        assert!(cases_from_json(&v).is_err());
    }

    #[test]
    fn metrics_of_a_known_case() {
        let c = GemmCase {
            model: "m".into(),
            recipe: Recipe::Bf16,
            tokens: 4,
            experts: 4,
            top_k: 2,
            n: 256,
            k: 512,
            rows: vec![3, 0, 5, 0],
        };
        let m = metrics(&c, 2.0);
        assert_eq!(m.flops, 2.0 * 8.0 * 256.0 * 512.0);
        assert_eq!(m.weight_bytes, 2 * 256 * 512 * 2);
        assert!((m.tflops - m.flops / 2e-6 / 1e12).abs() < 1e-12);
        assert!((m.weight_tbps - 524_288.0 / 2e-6 / 1e12).abs() < 1e-12);
        assert!((m.pct_read_ceiling - 100.0 * m.weight_tbps / 4.22).abs() < 1e-9);
        assert!((m.pct_flops_ceiling - 100.0 * m.tflops / 723.0).abs() < 1e-9);
        let f = GemmCase {
            recipe: Recipe::Fp8Block128,
            ..c.clone()
        };
        assert_eq!(metrics(&f, 1.0).weight_bytes, 2 * (256 * 512 + 2 * 4 * 4));
        let p = GemmCase {
            recipe: Recipe::Fp8PerTensor,
            ..c
        };
        assert_eq!(metrics(&p, 1.0).weight_bytes, 2 * (256 * 512 + 4));
        assert!(
            (metrics(&p, 1.0).pct_flops_ceiling - 100.0 * metrics(&p, 1.0).tflops / 1272.0).abs()
                < 1e-9
        );
        // DeepSeek-V3 EP8 at 512 tokens against vLLM's recorded 603.6 us: 3.11 TB/s in ANCHORS.md
        // with every expert touched.
        let ds = GemmCase {
            model: "deepseek-v3-ep8".into(),
            recipe: Recipe::Bf16,
            tokens: 512,
            experts: 32,
            top_k: 8,
            n: 4096,
            k: 7168,
            rows: vec![128; 32],
        };
        let m = metrics(&ds, 603.6);
        assert!((m.weight_tbps - 3.11).abs() < 0.01, "{}", m.weight_tbps);
        assert!((m.tflops - 398.0).abs() < 1.0, "{}", m.tflops);
    }

    #[test]
    fn vllm_table_lookup_and_best_peer() {
        assert_eq!(vllm_us("qwen3-30b-a3b", 1, Recipe::Bf16), Some(23.0));
        assert_eq!(
            vllm_us("deepseek-v3-ep8", 2048, Recipe::Fp8Block128),
            Some(897.6)
        );
        assert_eq!(
            vllm_us("mixtral-8x7b", 8192, Recipe::Fp8PerTensor),
            Some(3380.0)
        );
        assert_eq!(vllm_us("mixtral-8x7b", 3, Recipe::Bf16), None);
        assert_eq!(vllm_us("llama", 1, Recipe::Bf16), None);
        assert_eq!(
            torch_recorded_us("qwen3-30b-a3b", 8192, Recipe::Fp8PerTensor),
            Some(1426.4)
        );
        // Every model and default token count is in both tables.
        for m in MODELS {
            for t in DEFAULT_TOKENS {
                assert!(vllm_us(m.name, t, Recipe::Bf16).is_some());
                assert!(torch_recorded_us(m.name, t, Recipe::Bf16).is_some());
            }
        }
        assert_eq!(best_peer(Some(30.0), Some(23.0)), Some(("vllm", 23.0)));
        assert_eq!(best_peer(Some(20.0), Some(23.0)), Some(("torch", 20.0)));
        assert_eq!(best_peer(None, Some(23.0)), Some(("vllm", 23.0)));
        assert_eq!(best_peer(None, None), None);
    }

    #[test]
    fn selection_parsing() {
        let s = Selection::parse(Some("all"), Some("1, 16,16"), Some("bf16,fp8_block128")).unwrap();
        assert_eq!(s.models.len(), 3);
        assert_eq!(s.tokens, vec![1, 16]);
        assert_eq!(s.recipes, vec![Recipe::Bf16, Recipe::Fp8Block128]);
        let e = Selection::parse(Some("llama"), None, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("llama"), "{e}");
        assert!(Selection::parse(None, Some("0"), None).is_err());
        assert!(Selection::parse(None, Some("1,x"), None).is_err());
        assert!(Selection::parse(None, Some(""), None).is_err());
        let e = Selection::parse(None, None, Some("nvfp4"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("nvfp4"), "{e}");
    }

    #[test]
    fn anchor_output_parsing() {
        let text = "noise\n{\"what\": \"device\", \"name\": \"H200\", \"torch\": \"2.11\"}\n\
            {\"model\": \"m\", \"recipe\": \"bf16\", \"tokens\": 1, \"us\": 30.5, \"anchor\": \"torch._grouped_mm bf16\"}\n\
            {\"model\": \"m\", \"recipe\": \"fp8_block128\", \"tokens\": 1, \"error\": \"boom\"}\n";
        let r = parse_anchor_output(text);
        assert_eq!(r.by_case.len(), 2);
        assert_eq!(r.by_case[&("m".into(), "bf16".into(), 1)].us, Some(30.5));
        assert_eq!(
            r.by_case[&("m".into(), "fp8_block128".into(), 1)]
                .note
                .as_deref(),
            Some("error: boom")
        );
        assert!(r.not_measured.is_none());
        assert_eq!(r.version.as_deref(), Some("torch 2.11 on H200"));
        let r = parse_anchor_output("{\"error\": \"torch not importable: no module\"}\n");
        assert!(r.by_case.is_empty());
        assert!(r.not_measured.unwrap().contains("torch not importable"));
        assert!(parse_anchor_output("").not_measured.is_some());
    }

    #[test]
    fn a_missing_script_is_a_reason_not_an_error() {
        let r = run_anchor(Path::new("/nonexistent/gemm_anchor.py"), &[]);
        assert!(r.not_measured.unwrap().contains("not found"));
    }

    #[test]
    fn random_operands_are_finite() {
        let mut b = vec![0u8; 1 << 16];
        random_e4m3(&mut b, 9);
        assert!(b.iter().all(|x| x & 0x7f != 0x7f));
        random_bf16(&mut b, 9);
        for p in b.chunks(2) {
            let v = f32::from_bits(u32::from(u16::from_le_bytes([p[0], p[1]])) << 16);
            assert!(
                v.is_finite() && v.abs() < 2.0 && v.abs() >= 1.0 / 128.0,
                "{v}"
            );
        }
    }

    #[test]
    fn the_report_names_what_is_missing() {
        let cases = Selection::parse(Some("qwen3-30b-a3b"), Some("1"), None)
            .unwrap()
            .cases()
            .unwrap();
        let rows: Vec<Row> = cases
            .iter()
            .map(|c| Row {
                case: c.clone(),
                ours: if c.recipe == Recipe::Bf16 {
                    Outcome::Timed {
                        us: 20.0,
                        reps: 200,
                        kernel: "k".into(),
                    }
                } else {
                    Outcome::NotBuilt("no fp8 kernel yet".into())
                },
                torch: (c.recipe == Recipe::Bf16).then(|| TorchResult {
                    us: Some(30.0),
                    anchor: "torch._grouped_mm bf16".into(),
                    note: None,
                }),
            })
            .collect();
        let text = render("H200", &rows, &TorchResults::default());
        assert!(text.contains("not built"), "{text}");
        assert!(
            text.contains("(2 case(s)) not built: no fp8 kernel yet"),
            "{text}"
        );
        // bf16: torch 30 us / ours 20 us = 1.50; the best peer is vLLM's 23.0 us: 1.15.
        assert!(text.contains("1.50") && text.contains("1.15"), "{text}");
        let v = rows[0].json();
        assert_eq!(v["status"], "timed");
        assert_eq!(v["best_peer"], "vllm");
        assert!((v["best_peer_ratio"].as_f64().unwrap() - 1.15).abs() < 1e-9);
        assert_eq!(rows[1].json()["status"], "not built");
        assert!(rows[1].json()["torch_ratio"].is_null());
    }

    #[test]
    fn reps_and_median() {
        assert_eq!(reps_for(10.0), 200);
        assert_eq!(reps_for(1000.0), 20);
        assert_eq!(reps_for(50_000.0), 3);
        assert_eq!(reps_for(f64::NAN), 3);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }
}
