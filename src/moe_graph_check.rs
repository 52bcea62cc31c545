//! The MoE layer forward captured in a CUDA graph (issue \[9\] item 2): capture, replay, the same
//! bits. Part of `moeforge selftest --gpu --moe`; GPU only (CI has none: there the self-test says
//! that it skipped).
//!
//! For each recipe family (bf16, FP8 per tensor, FP8 128x128 blocks, the W4A16 NVFP4 and W8A16 int8
//! GEMMs), on a small synthetic layer with random weights ([`crate::bench_moe`]'s operands): one
//! forward of random tokens; the graph captured from it; the output buffer cleared and the graph replayed
//! (the same bits as the forward); new tokens of the same shape uploaded and the graph replayed
//! (the same bits as a plain forward of them); then more tokens uploaded (the scratch reallocated):
//! the replay is refused.

use std::fmt::Write as _;

use crate::bench_gemm::{Model, Recipe};
use crate::moe_gpu_layer::GpuLayer;
use crate::moe_host::{Replicas, Tokens};
use crate::runtime::Device;
use crate::selftest_util::Rng;
use crate::Result;

/// The synthetic layer of the GPU layer's checks: 8 experts, H = 256, I = 384 (a multiple of every
/// 4-bit group), top-2.
pub(crate) const MODEL: Model = Model {
    name: "layer-check",
    experts: 8,
    top_k: 2,
    hidden: 256,
    intermediate: 384,
};

/// Random tokens of [`MODEL`]: bf16 `x` (bits), distinct expert ids per token, weights in `(0, 1)`.
/// With `hot`, token `i < E` takes expert `i` first (every expert is used) and the other choices go
/// to experts 0 and 1 eight times in ten (a skewed load).
pub(crate) fn random_tokens(rng: &mut Rng, t: usize, hot: bool) -> OwnedTokens {
    let (h, e, k) = (MODEL.hidden, MODEL.experts, MODEL.top_k);
    let x = (0..t * h).map(|_| rng.bf16_exp(120..130)).collect();
    let mut ids = Vec::with_capacity(t * k);
    for i in 0..t {
        let mut chosen: Vec<i32> = Vec::with_capacity(k);
        if hot && i < e {
            chosen.push(i as i32);
        }
        while chosen.len() < k {
            let c = if hot && rng.below(10) < 8 {
                rng.below(2)
            } else {
                rng.below(e)
            } as i32;
            if !chosen.contains(&c) {
                chosen.push(c);
            }
        }
        ids.extend(chosen);
    }
    let w = (0..t * k)
        .map(|_| (rng.below(1 << 20) as f32 + 1.0) / (1 << 20) as f32)
        .collect();
    OwnedTokens { x, ids, w, t }
}

/// Tokens of [`MODEL`] held by the checks.
pub(crate) struct OwnedTokens {
    x: Vec<u16>,
    ids: Vec<i32>,
    w: Vec<f32>,
    t: usize,
}

impl OwnedTokens {
    /// The layer's view of them.
    pub(crate) fn tokens(&self) -> Tokens<'_> {
        Tokens {
            x: &self.x,
            ids: &self.ids,
            weights: &self.w,
            t: self.t,
            k: MODEL.top_k,
        }
    }
}

/// A GPU layer of [`MODEL`] with `recipe`'s random weights, every expert on its own slot.
pub(crate) fn layer(
    dev: &Device,
    recipe: Recipe,
    settings: &crate::runtime::Settings,
) -> Result<GpuLayer> {
    let ops = crate::bench_moe::operands(&MODEL, recipe);
    GpuLayer::new(dev, &ops, &Replicas::identity(MODEL.experts), settings)
}

/// The recipe families the GPU layer's graph and EPLB checks run: bf16, FP8 per tensor (fused
/// SiLU*up with f32 `a`, then the E4M3 quantization per token), FP8 128x128 blocks (fused where 2I
/// is a multiple of 128, `a` per 1x128 group by the activation kernel), and the W4A16 (NVFP4) and
/// W8A16 GEMMs.
pub(crate) const RECIPES: [Recipe; 5] = [
    Recipe::Bf16,
    Recipe::Fp8PerTensor,
    Recipe::Fp8Block128,
    Recipe::Nvfp4,
    Recipe::Int8Row,
];

/// The check's lines and verdict.
pub(crate) fn graph_check(
    dev: &Device,
    rng: &mut Rng,
    settings: &crate::runtime::Settings,
) -> Result<(String, bool)> {
    let mut out = String::new();
    let mut all = true;
    let t = 37;
    for recipe in RECIPES {
        let mut layer = layer(dev, recipe, settings)?;
        let first = random_tokens(rng, t, false);
        let a = first.tokens();
        let plain = layer.forward(dev, &a, false)?.output;
        let graph = layer.capture(dev)?;
        // Clear the output, replay: the graph recomputes it.
        layer.clear_output(dev)?;
        layer.replay(&graph)?;
        let replay = layer.finish(dev, false)?.output;
        // New tokens into the same buffers, replay, against a plain forward of them.
        let second = random_tokens(rng, t, false);
        let b = second.tokens();
        layer.upload(dev, &b)?;
        layer.replay(&graph)?;
        let replay2 = layer.finish(dev, false)?.output;
        let plain2 = layer.forward(dev, &b, false)?.output;
        // More tokens than the graph's: the scratch is reallocated and the graph refused.
        let third = random_tokens(rng, 2 * t, false);
        let c = third.tokens();
        layer.upload(dev, &c)?;
        let refused = layer.replay(&graph).is_err();
        // The layer fuses SiLU*up into its first GEMM where its rows pair (`moe_gpu::pairable`:
        // block-scaled FP8 where 2I is a multiple of 128): the graph holds the fused kernel then.
        let fused_ok =
            layer.fused() == crate::moe_gpu::pairable(recipe.family().1, 2 * MODEL.intermediate);
        let ok = replay == plain
            && replay2 == plain2
            && refused
            && fused_ok
            && plain != plain2
            && plain.iter().any(|&v| v & 0x7FFF != 0);
        all &= ok;
        let _ = writeln!(
            out,
            "moe layer graph {:<14} T={t} k={}{}: capture, replay == forward ({}), new tokens replayed == their forward ({}), refused after a larger upload ({}): {}",
            recipe.name(),
            MODEL.top_k,
            match (layer.fused(), fused_ok) {
                (true, true) => " fused",
                (false, true) => "",
                (true, false) => " fused (NOT EXPECTED)",
                (false, false) => " unfused (NOT EXPECTED)",
            },
            if replay == plain { "same bits" } else { "DIFFERENT" },
            if replay2 == plain2 { "same bits" } else { "DIFFERENT" },
            if refused { "yes" } else { "NO" },
            if ok { "ok" } else { "FAIL" }
        );
    }
    Ok((out, all))
}
