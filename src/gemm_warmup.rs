//! `moeforge cache warmup --model`: pre-build and pre-tune every grouped-GEMM variant of a model's
//! MoE shapes, so that a serving process finds its kernels' cubins in the kernel cache and its
//! choices in the tuning cache ([`crate::runtime::gemm_tune`]).
//!
//! For each model of the selection ([`crate::bench_gemm::MODELS`]), each of its two GEMMs (w13:
//! `N = 2I, K = H`; w2: `N = H, K = I`) and each recipe, every candidate of
//! `codegen::gemm::tune::candidates` is generated (the GEMM benchmark's bf16-out form), and every
//! candidate in the form the MoE layer loads ([`crate::moe_gpu_layer::layer_candidates`]: f32 out,
//! or the fused SiLU*up epilogue where the first GEMM's rows pair, bf16 or f32 out; compiled for
//! the row modes through which the layer reads the recipe's param in place,
//! [`crate::gemm_access::layer_variants`]); on a Hopper
//! GPU each is JIT-compiled through the kernel cache and loaded, and each token count is tuned for the
//! benchmark's form (uniform routing as the GEMM benchmark routes, random operands) unless the
//! tuning cache holds its bucket. The layer's forms are built, not tuned: `GpuLayer::tune` tunes
//! them on the layer's own operands. Without one, the PTX is still
//! generated (it proves every variant generates), the cubins are compiled when the compiler is
//! ptxas (it needs no device), and tuning is skipped.

use std::fmt::Write as _;

use crate::bench_gemm::{case_seed, routing, GemmCase, Selection};
use crate::bench_gemm_ws::WsRunner;
use crate::codegen::gemm::tune;
use crate::codegen::gemm::ws::{Epilogue, OutTy};
use crate::moe_gpu_layer::{gemm_form, layer_candidates};
use crate::runtime::cache::{Cache, Hit};
use crate::runtime::gemm_tune::TuneSource;
use crate::runtime::gemm_ws::{variant_cubin, variant_ptx};
use crate::runtime::jit::Compiler;
use crate::{Error, Result};

/// The two GEMMs of a model's MoE layer: name, N, K.
pub fn gemms(m: &crate::bench_gemm::Model) -> [(&'static str, usize, usize); 2] {
    [
        ("w13", 2 * m.intermediate, m.hidden),
        ("w2", m.hidden, m.intermediate),
    ]
}

/// How the GPU layer reads `recipe`'s weights of `gemm` at model `m`'s binding (`None` where the
/// recipe does not verify there: the plain variants are then warmed).
fn access_at(
    recipe: crate::bench_gemm::Recipe,
    m: &crate::bench_gemm::Model,
    gemm: &str,
) -> Option<crate::gemm_access::WeightAccess> {
    let r = crate::kernels::find(recipe.name())?;
    let bind = format!("E={},H={},I={}", m.experts, m.hidden, m.intermediate);
    let info = crate::verify_source(r.source, r.path, Some(&bind)).ok()?;
    crate::gemm_access::of_gemm(&info, gemm).map(|(_, a)| a)
}

/// The MoE layer's own form of `gemm` (w13 or w2, `N = n`, `K = k`) for `recipe` at model `m`
/// and its variants (what `GpuLayer` loads): f32 out, or the first GEMM fused with SiLU*up where
/// its rows pair (bf16 out where the recipe feeds the second GEMM bf16, else f32), compiled for
/// the row modes through which the layer reads the recipe's param in place at the model's
/// binding (`gemm_access`).
pub fn layer_forms(
    recipe: crate::bench_gemm::Recipe,
    m: &crate::bench_gemm::Model,
    gemm: &str,
    n: u32,
    k: u32,
) -> ((OutTy, Epilogue), Vec<crate::codegen::gemm::ws::WsConfig>) {
    let (operands, scaling) = recipe.family();
    let form = gemm_form(
        gemm == "w13",
        true,
        crate::moe_gpu_layer::a2_quant(&crate::bench_moe::feed(recipe)),
        scaling,
        2 * m.intermediate,
    );
    let layer = crate::gemm_access::layer_variants(
        layer_candidates(operands, scaling, form, n, k),
        access_at(recipe, m, gemm).as_ref(),
        form.1.silu(),
    );
    (form, layer)
}

/// What a warm-up did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WarmupSummary {
    /// Variants whose PTX was generated.
    pub generated: usize,
    /// Variants built (cubin compiled or found in the kernel cache, and loaded where there is a GPU).
    pub built: usize,
    /// Of those, cubins found in the kernel cache.
    pub cubin_hits: usize,
    /// Token buckets tuned now.
    pub tuned: usize,
    /// Token buckets whose choice the tuning cache held.
    pub tune_hits: usize,
}

/// Warm the kernel and tuning caches of `settings` for `sel`'s models, recipes and token counts;
/// the report's text. Without a Hopper GPU this is not an error: the report says that the kernels
/// were not loaded and tuning was skipped.
pub fn warmup(sel: &Selection, settings: &crate::runtime::Settings) -> Result<String> {
    let mut text = String::new();
    let compiler = Compiler::resolve(&settings.jit)?;
    let cache = Cache::new(settings.cache_dir.clone());
    let dev = crate::gpu::open();
    let hopper = match &dev {
        Ok(d) if d.target() == Some(crate::codegen::ptx::Target::Sm90a) => Some(d),
        _ => None,
    };
    let why_not = match &dev {
        Ok(d) => format!(
            "the GPU here ({}, compute capability {:?}) is not Hopper (sm_90a)",
            d.name, d.capability
        ),
        Err(why) => why.clone(),
    };
    let ptxas = matches!(compiler, Compiler::Ptxas { .. });
    let mut runner = WsRunner::with_settings(settings)?;
    let mut s = WarmupSummary::default();
    let _ = writeln!(
        text,
        "GEMM warm-up: cache {}, compiler {}",
        cache
            .dir()
            .map(|d| d.display().to_string())
            .unwrap_or_else(|| "in memory only".into()),
        compiler.describe()
    );
    for m in &sel.models {
        for (gemm, n, k) in gemms(m) {
            let (n32, k32) = match (u32::try_from(n), u32::try_from(k)) {
                (Ok(a), Ok(b)) => (a, b),
                _ => {
                    return Err(Error::Usage(format!(
                        "{} {gemm}: N = {n}, K = {k} do not fit the kernel",
                        m.name
                    )))
                }
            };
            for &recipe in &sel.recipes {
                let (operands, scaling) = recipe.family();
                let all = tune::candidates(operands, scaling, n32, k32);
                let (form, layer) = layer_forms(recipe, m, gemm, n32, k32);
                let (mut built, mut hits) = (0, 0);
                for cfg in all.iter().chain(&layer) {
                    let (entry, ptx) = variant_ptx(cfg)?;
                    s.generated += 1;
                    if let Some(d) = hopper {
                        let before = runner.stats;
                        runner.build(d, cfg)?;
                        built += runner.stats.built - before.built;
                        hits += runner.stats.cubin_hits - before.cubin_hits;
                    } else if ptxas {
                        let (_, hit, _) = variant_cubin(&cache, &compiler, None, &entry, &ptx)?;
                        built += 1;
                        if matches!(hit, Hit::Memory | Hit::Disk) {
                            hits += 1;
                        }
                    }
                }
                s.built += built;
                s.cubin_hits += hits;
                let _ = writeln!(
                    text,
                    "{} {gemm} (N={n}, K={k}) {}: {} variants generated ({} the GEMM benchmark's, {} the layer's {}), {built} built ({hits} from the cache)",
                    m.name,
                    recipe.name(),
                    all.len() + layer.len(),
                    all.len(),
                    layer.len(),
                    match form {
                        (OutTy::Bf16, Epilogue::SiluMul) => "fused SiLU*up, bf16 out",
                        (_, Epilogue::SiluMul) => "fused SiLU*up, f32 out",
                        (_, Epilogue::SiluMulE4m3(_)) => "fused SiLU*up, E4M3 a out",
                        (_, Epilogue::Store) => "f32 out",
                    }
                );
                let Some(d) = hopper else { continue };
                for &tokens in &sel.tokens {
                    let case = GemmCase {
                        model: format!("{} {gemm}", m.name),
                        recipe,
                        tokens,
                        experts: m.experts,
                        top_k: m.top_k,
                        n,
                        k,
                        rows: routing(tokens, m.experts, m.top_k, case_seed(m.name, tokens))?,
                    };
                    let (cfg, source) = runner.choose(d, &case)?;
                    let how = match source {
                        TuneSource::Cached => {
                            s.tune_hits += 1;
                            "from the tuning cache"
                        }
                        TuneSource::Tuned => {
                            s.tuned += 1;
                            "tuned now"
                        }
                    };
                    let rows = case.rows_total();
                    let _ = writeln!(
                        text,
                        "  tokens {tokens} (rows {rows}, bucket {}): {} {how}",
                        tune::bucket(rows),
                        cfg.tag()
                    );
                }
            }
        }
    }
    let _ = writeln!(
        text,
        "summary: {} variants generated, {} built ({} from the cache), {} buckets tuned, {} tuning cache hits",
        s.generated, s.built, s.cubin_hits, s.tuned, s.tune_hits
    );
    if hopper.is_none() {
        let built = if ptxas {
            "cubins compiled by ptxas but no kernel loaded"
        } else {
            "kernels not built"
        };
        let _ = writeln!(
            text,
            "SKIPPED: {built} and tuning skipped: the GEMM needs a Hopper GPU ({why_not})"
        );
    }
    Ok(text)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// `compile --kernels gemm`'s layer forms (`gemm_variants::Plan::layer`) hold every variant
    /// the warm-up builds for the layer, for every recipe the benchmarks know at every model: the
    /// two lists, derived apart, agree.
    #[test]
    fn the_compiled_layer_forms_hold_what_the_warm_up_builds() {
        use crate::bench_gemm::{Recipe, MODELS};
        let mut checked = Vec::new();
        for m in MODELS {
            let bind = format!("E={},H={},I={}", m.experts, m.hidden, m.intermediate);
            for recipe in Recipe::ALL
                .into_iter()
                .chain(Recipe::WEIGHTS_ONLY)
                .chain(Recipe::VARIANTS)
            {
                let r = crate::kernels::find(recipe.name()).unwrap();
                let Ok(info) = crate::verify_source(r.source, r.path, Some(&bind)) else {
                    continue;
                };
                let plan = crate::gemm_variants::plan(&info).unwrap();
                if !plan.missing.is_empty() {
                    continue;
                }
                for (gemm, n, k) in gemms(&m) {
                    let (_, layer) = layer_forms(recipe, &m, gemm, n as u32, k as u32);
                    assert!(!layer.is_empty(), "{} {} {gemm}", m.name, recipe.name());
                    for cfg in layer {
                        assert!(
                            plan.layer
                                .iter()
                                .any(|v| v.gemm == gemm && v.ws == Some(cfg)),
                            "{} {} {gemm}: {} not compiled",
                            m.name,
                            recipe.name(),
                            cfg.tag()
                        );
                    }
                }
                checked.push((m.name, recipe.name()));
            }
        }
        // (Every recipe at every model verifies and has both GEMMs.)
        assert_eq!(checked.len(), 3 * 11, "{checked:?}");
    }

    #[test]
    fn a_model_has_its_two_gemms() {
        let q = crate::bench_gemm::MODELS[0];
        assert_eq!(q.name, "qwen3-30b-a3b");
        assert_eq!(gemms(&q), [("w13", 1536, 2048), ("w2", 2048, 768)]);
    }

    /// The layer's fused bf16 first GEMM reads the standard recipe's param in place in the paired
    /// order (8 rows, the halves, then the rest): the warm-up builds those variants, not the
    /// compact ones the layer never loads.
    #[test]
    fn the_layer_forms_are_warmed_with_the_in_place_row_modes() {
        use crate::bench_gemm::{Recipe, MODELS};
        use crate::codegen::gemm::ws::{Operands, Scaling, WRows};
        let q = MODELS[0];
        let a = access_at(Recipe::Bf16, &q, "w13").expect("bf16 verifies at Qwen3");
        let form = gemm_form(true, true, None, Scaling::None, 2 * q.intermediate);
        let v = crate::gemm_access::layer_variants(
            layer_candidates(Operands::Bf16, Scaling::None, form, 1536, 2048),
            Some(&a),
            true,
        );
        assert!(!v.is_empty());
        assert!(v
            .iter()
            .all(|c| c.w_rows.modes == 3 && c.w_rows.inner[..2] == [8, 2]));
        // The second GEMM reads the compact map: the plain variants.
        let a2 = access_at(Recipe::Bf16, &q, "w2").expect("w2");
        let v2 = crate::gemm_access::layer_variants(
            layer_candidates(
                Operands::Bf16,
                Scaling::None,
                (OutTy::F32, Epilogue::Store),
                2048,
                768,
            ),
            Some(&a2),
            false,
        );
        assert!(v2.iter().all(|c| c.w_rows == WRows::PLAIN));
    }
}
