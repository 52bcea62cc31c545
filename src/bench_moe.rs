//! `moeforge bench --gpu --moe`: the whole MoE layer forward on the GPU ([`crate::moe_gpu_layer`])
//! at the anchor models' shapes (issue \[9\] item 4), with torch's whole layer measured in the same
//! call by `scripts/moe_anchor.py` on the same routing.
//!
//! Per (model, recipe, tokens): the GEMMs are first tuned on the case's own operands
//! ([`GpuLayer::tune`]); random weights (the bench's seeded bytes: bf16 magnitudes 2^-7 to
//! 2, E4M3 codes with f32 scales of 1/256), uniform top-k routing from the (model, tokens) seed,
//! identity placement. Each forward is queued after a 256 MB L2 flush and timed alone with CUDA
//! events (inputs already on the device, as in a serving step); the median of [`reps_for`] runs.
//! Per-step times are the medians of the events between steps. The same forward is also captured
//! in a CUDA graph ([`GpuLayer::capture`]) and replayed as many times, each replay after the flush
//! and right after a queued forward (so both see the same clocks): the "graph us" column, the time
//! a serving engine that replays graphs sees (the launches' gaps shrink; the kernels are the same).
//! Against ANCHORS.md: vLLM's recorded w13 GEMM (tuned Triton, one GEMM, not a layer) over our w13
//! step, the fused one where the layer fuses SiLU*up (so the ratio is conservative for us).
//! Reported: microseconds,
//! TFLOP/s (`6 * T * k * H * I` flops), weight TB/s (the bytes of the experts that received rows:
//! w13, w2 and their scales, once each), and the roofline share `max(bytes / 4.22 TB/s, flops /
//! dense ceiling) / time`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::bench_gemm::{
    case_seed, median, random_bf16, random_e4m3, reps_for, Model, Recipe, Selection,
    READ_CEILING_TBPS,
};
use crate::codegen::gemm::ws::{Operands, Scaling};
use crate::moe_gpu::{GemmWeights, LayerOperands};
use crate::moe_gpu_layer::{GpuLayer, Marks};
use crate::moe_host::{Feed, Replicas, Tokens};
use crate::runtime::{drv, Device};
use crate::{Error, Result};

/// The torch anchor script run by default.
pub const DEFAULT_ANCHOR: &str = "scripts/moe_anchor.py";
/// Bytes cleared before each timed forward (more than the H200's 50 MB L2).
const FLUSH_BYTES: usize = 256 << 20;
/// Seconds the anchor script may take.
const ANCHOR_TIMEOUT_S: u64 = 300;

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Models, token counts, recipes.
    pub selection: Selection,
    /// Write the JSON report here.
    pub json: Option<PathBuf>,
    /// Draw the report as SVG here ([`crate::plot::layer_svg`]).
    pub plot: Option<PathBuf>,
    /// The torch anchor script; `None`: torch is not measured.
    pub anchor: Option<PathBuf>,
    /// The runtime's settings (kernel cache, JIT).
    pub settings: crate::runtime::Settings,
    /// Feed the FP8 recipes' GEMMs with static activation scales (a checkpoint's calibrated
    /// `w13_input_scale` / `w2_input_scale`, [`STATIC_SCALE`] for every expert) instead of
    /// per-token ones; the rows' recipe reads `<recipe>+static`. Recipes without such a scheme
    /// (bf16, the weights-only ones, `fp8_block128`) run as they are.
    pub static_scales: bool,
}

/// The static activation scale of `--static-scales` (a calibrated scale of the benchmark's
/// activations' order; the time does not depend on it).
pub const STATIC_SCALE: f32 = 1.0 / 64.0;

/// `feed`, or static scales in its place where the recipe's dynamic scheme is per token.
fn static_feed(feed: Feed, param: &str, experts: usize) -> Feed {
    match feed {
        Feed::PerToken => Feed::Static {
            param: param.into(),
            values: vec![STATIC_SCALE; experts],
        },
        f => f,
    }
}

/// A row's recipe name: `<recipe>+static` with static activation scales.
fn label(recipe: Recipe, static_scales: bool) -> String {
    if static_scales {
        format!("{}+static", recipe.name())
    } else {
        recipe.name().to_string()
    }
}

/// A weight operand of random bytes for `recipe`: `[experts, n, k]`.
fn random_weights(recipe: Recipe, experts: usize, n: usize, k: usize, seed: u64) -> GemmWeights {
    let (operands, scaling) = recipe.family();
    let len = experts * n * operands.w_row_bytes(k as u64) as usize;
    let mut chunk = vec![0u8; (8 << 20).min(len.max(1))];
    match operands {
        Operands::Bf16 => random_bf16(&mut chunk, seed),
        _ => random_e4m3(&mut chunk, seed),
    }
    let codes: Vec<u8> = chunk.iter().copied().cycle().take(len).collect();
    let scales = match scaling {
        Scaling::None => Vec::new(),
        Scaling::Tensorwise { .. } => vec![1.0 / 256.0; experts],
        Scaling::Block128 => vec![1.0 / 256.0; experts * n.div_ceil(128) * k.div_ceil(128)],
        Scaling::PerRow | Scaling::Channelwise { .. } => vec![1.0 / 256.0; experts * n],
        Scaling::PerExpert => vec![1.0 / 256.0; experts],
        Scaling::PerRowGroup { .. } | Scaling::Groupwise { .. } => Vec::new(),
    };
    GemmWeights {
        operands,
        scaling,
        slots: experts,
        n,
        k,
        codes,
        scales,
        // 4-bit weights: group scales of 0x3c bytes (an E4M3 1.5, an E8M0 2^-67, bf16 2^-7).
        group_scales: match (operands, scaling.row_group()) {
            (Operands::W4Bf16(w), _) => {
                vec![0x3c; w.group_scale_bytes(experts, n, k)]
            }
            // Group-wise int8: f32 2^-8 per (slot, group, row).
            (_, Some(group)) => (1.0f32 / 256.0)
                .to_le_bytes()
                .repeat(experts * k.div_ceil(group as usize) * n),
            _ => Vec::new(),
        },
        relayout: false,
        access: None,
        stored: Vec::new(),
    }
}

/// The activation feed of both GEMMs of a standard recipe's layer, as the benchmark (and the
/// warm-up) run it: FP8 per token or per 1x128 group, else bf16.
pub(crate) fn feed(recipe: Recipe) -> Feed {
    match recipe {
        Recipe::Fp8PerTensor | Recipe::Fp8Channel | Recipe::Fp8G128 => Feed::PerToken,
        Recipe::Fp8Block128 => Feed::PerTokenGroup128,
        // bf16 activations: bf16 weights, and the weights-only recipes.
        _ => Feed::Bf16,
    }
}

pub(crate) fn operands(model: &Model, recipe: Recipe) -> LayerOperands {
    let (e, h, i) = (model.experts, model.hidden, model.intermediate);
    let feed = feed(recipe);
    LayerOperands {
        w13: random_weights(recipe, e, 2 * i, h, 0x5EED_0013),
        w2: random_weights(recipe, e, h, i, 0x5EED_0002),
        feed13: feed.clone(),
        feed2: feed,
        slots: e,
        h,
        i,
    }
}

/// The case's routing ([`crate::bench_gemm::routing_ids`], the GEMM benchmark's) as `topk_ids`,
/// and the number of experts that received any.
fn routing(tokens: usize, experts: usize, top_k: usize, seed: u64) -> Result<(Vec<i32>, usize)> {
    let ids = crate::bench_gemm::routing_ids(tokens, experts, top_k, seed)?;
    let mut used = vec![false; experts];
    for &e in &ids {
        used[e] = true;
    }
    let ids = ids
        .into_iter()
        .map(|e| i32::try_from(e).unwrap_or(i32::MAX))
        .collect();
    Ok((ids, used.iter().filter(|&&u| u).count()))
}

/// One timed case.
#[derive(Debug, Clone)]
struct Row {
    model: &'static str,
    recipe: Recipe,
    /// Static activation scales ([`Options::static_scales`]).
    static_scales: bool,
    tokens: usize,
    us: f64,
    /// The forward replayed from a CUDA graph (`None`: the capture failed).
    graph_us: Option<f64>,
    steps: Vec<(&'static str, f64)>,
    tflops: f64,
    weight_tbps: f64,
    roofline: f64,
    torch_us: Option<f64>,
    /// vLLM's tuned Triton w13 GEMM as ANCHORS.md records it (its fp8 figure for the FP8
    /// recipes, its bf16 figure for the others), where it has the case.
    vllm_w13_us: Option<f64>,
    /// The tuned GEMM variants (w13 / w2).
    variants: String,
}

impl Row {
    /// Our w13 step (the fused `w13 GEMM + silu * up` where the layer fuses it).
    fn w13_us(&self) -> Option<f64> {
        self.steps
            .iter()
            .find(|(name, _)| name.starts_with("w13"))
            .map(|&(_, us)| us)
    }

    /// The recipe's name, `+static` with static activation scales.
    fn label(&self) -> String {
        label(self.recipe, self.static_scales)
    }

    /// vLLM's recorded w13 GEMM over our w13 step (above 1: ours is faster).
    fn vllm_ratio(&self) -> Option<f64> {
        Some(self.vllm_w13_us? / self.w13_us()?)
    }
}

fn bytes_per_expert(recipe: Recipe, h: usize, i: usize) -> u64 {
    recipe.expert_bytes(2 * i, h) + recipe.expert_bytes(h, i)
}

/// Per-step median times, named.
type Steps = Vec<(&'static str, f64)>;

/// What [`time_layer`] measured.
struct Timed {
    /// The median forward, queued kernel by kernel on the stream.
    us: f64,
    /// The median replay of the same forward captured in a CUDA graph (`None` where the capture
    /// failed: the report says why).
    graph_us: Option<f64>,
    steps: Steps,
    /// The tuned variants (w13 / w2).
    variants: String,
    /// Why the graph was not timed.
    note: Option<String>,
}

/// The median forward time (queued, and replayed from a CUDA graph), the per-step medians and
/// the tuned variants (w13 / w2).
fn time_layer(
    dev: &Device,
    layer: &mut GpuLayer,
    tokens: &Tokens<'_>,
    flush: &mut cudarc::driver::CudaSlice<u8>,
) -> Result<Timed> {
    layer.upload(dev, tokens)?;
    // One untimed forward (module load, tensor maps, the row offsets the tuning needs), the
    // GEMMs tuned on its operands, one forward to estimate.
    layer.enqueue(dev, None)?;
    layer.tune(dev)?;
    let one = |layer: &mut GpuLayer, flush: &mut cudarc::driver::CudaSlice<u8>| -> Result<Marks> {
        dev.stream.memset_zeros(flush).map_err(drv("cuMemsetD8"))?;
        let mut m = Marks::new();
        layer.enqueue(dev, Some(&mut m))?;
        Ok(m)
    };
    let est = one(layer, flush)?;
    dev.sync()?;
    let span = |m: &Marks| -> Result<Vec<(&'static str, f64)>> {
        let mut out = Vec::new();
        for w in m.windows(2) {
            let ms = w[0]
                .1
                .elapsed_ms(&w[1].1)
                .map_err(drv("cuEventElapsedTime"))?;
            out.push((w[1].0, f64::from(ms) * 1e3));
        }
        Ok(out)
    };
    let total = |s: &[(&'static str, f64)]| s.iter().map(|x| x.1).sum::<f64>();
    let reps = reps_for(total(&span(&est)?));
    // The same forward captured once (what a serving engine does at decode) and replayed, each
    // replay right after a queued forward and the same flush, so that both see the same clocks
    // (replays timed after all the queued forwards ran slower by up to 11% on large layers: the
    // GPU's clocks sink under a long run of heavy GEMMs); the GPU's time from the event before a
    // replay to the event after it.
    let graph = layer.capture(dev);
    let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut all = Vec::with_capacity(reps);
    let mut marks = Vec::with_capacity(reps);
    for _ in 0..reps {
        all.push(one(layer, flush)?);
        if let Ok(g) = &graph {
            dev.stream.memset_zeros(flush).map_err(drv("cuMemsetD8"))?;
            let a = dev
                .stream
                .record_event(timing)
                .map_err(drv("cuEventRecord"))?;
            layer.replay(g)?;
            let b = dev
                .stream
                .record_event(timing)
                .map_err(drv("cuEventRecord"))?;
            marks.push((a, b));
        }
    }
    dev.sync()?;
    let spans: Vec<Vec<(&'static str, f64)>> = all.iter().map(span).collect::<Result<_>>()?;
    let mut totals: Vec<f64> = spans.iter().map(|s| total(s)).collect();
    let names: Vec<&'static str> = spans
        .first()
        .map(|s| s.iter().map(|x| x.0).collect())
        .unwrap_or_default();
    let steps = names
        .iter()
        .enumerate()
        .map(|(j, name)| {
            let mut v: Vec<f64> = spans.iter().filter_map(|s| s.get(j).map(|x| x.1)).collect();
            (*name, median(&mut v))
        })
        .collect();
    let variants = layer
        .variants()
        .map(|(a, b)| format!("{} / {}", a.tag(), b.tag()))
        .unwrap_or_default();
    if let Err(why) = graph {
        return Ok(Timed {
            us: median(&mut totals),
            graph_us: None,
            steps,
            variants,
            note: Some(format!("the graph capture failed: {why}")),
        });
    }
    let mut replays = marks
        .iter()
        .map(|(a, b)| {
            a.elapsed_ms(b)
                .map(|ms| f64::from(ms) * 1e3)
                .map_err(|e| Error::from(drv("cuEventElapsedTime")(e)))
        })
        .collect::<Result<Vec<f64>>>()?;
    Ok(Timed {
        us: median(&mut totals),
        graph_us: Some(median(&mut replays)),
        steps,
        variants,
        note: None,
    })
}

/// Run torch's layer on the cases (`python3 SCRIPT CASES.json`); microseconds by (model, tokens),
/// and the script's device line or error.
fn run_anchor(script: &Path, cases: &Value) -> (BTreeMap<(String, usize), f64>, String) {
    let mut out = BTreeMap::new();
    let dir = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => return (out, format!("torch layer not measured: {e}")),
    };
    let path = dir.path().join("moe_cases.json");
    if let Err(e) = std::fs::write(&path, cases.to_string()) {
        return (out, format!("torch layer not measured: {e}"));
    }
    let child = std::process::Command::new("timeout")
        .arg(ANCHOR_TIMEOUT_S.to_string())
        .arg("python3")
        .arg(script)
        .arg(&path)
        .output();
    let text = match child {
        Ok(o) => String::from_utf8_lossy(&o.stdout).into_owned(),
        Err(e) => return (out, format!("torch layer not measured: {e}")),
    };
    let mut about = String::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if let Some(e) = v.get("error").and_then(Value::as_str) {
            let _ = write!(about, "torch: {e}; ");
        } else if v.get("what").and_then(Value::as_str) == Some("device") {
            let _ = write!(about, "torch: {}; ", v);
        } else if let (Some(m), Some(t), Some(us)) = (
            v.get("model").and_then(Value::as_str),
            v.get("tokens").and_then(Value::as_u64),
            v.get("us").and_then(Value::as_f64),
        ) {
            out.insert((m.to_string(), t as usize), us);
        }
    }
    (out, about)
}

fn describe(dev: &Device) -> String {
    format!(
        "{} (sm_{}{}, {} SMs)",
        dev.name, dev.capability.0, dev.capability.1, dev.sms
    )
}

/// Run the benchmark; the report. Errors: a case that failed (the report so far is in the error).
pub fn run(opts: &Options) -> Result<String> {
    let mut report = String::new();
    let dev = match crate::gpu::open() {
        Ok(d) => d,
        Err(why) => {
            return Ok(format!(
                "SKIPPED: the MoE layer benchmark needs a CUDA GPU ({why})\n"
            ))
        }
    };
    if dev.target() != Some(crate::codegen::ptx::Target::Sm90a) {
        return Ok("SKIPPED: the MoE layer is sm_90a (Hopper) only\n".into());
    }
    let mut flush = dev
        .stream
        .alloc_zeros::<u8>(FLUSH_BYTES)
        .map_err(drv("cuMemAlloc"))?;
    let mut rows: Vec<Row> = Vec::new();
    let mut cases = Vec::new();
    let mut ok = true;
    for model in &opts.selection.models {
        let (e, h, i, k) = (model.experts, model.hidden, model.intermediate, model.top_k);
        for &tokens in &opts.selection.tokens {
            let (ids, _) = routing(tokens, e, k, case_seed(model.name, tokens))?;
            cases.push(json!({
                "model": model.name, "tokens": tokens, "experts": e, "top_k": k,
                "hidden": h, "intermediate": i, "ids": ids,
            }));
        }
        for &recipe in &opts.selection.recipes {
            let mut ops = operands(model, recipe);
            let static_scales = opts.static_scales && ops.feed13 == Feed::PerToken;
            if static_scales {
                ops.feed13 = static_feed(ops.feed13, "w13_input_scale", e);
                ops.feed2 = static_feed(ops.feed2, "w2_input_scale", e);
            }
            let label = |r: Recipe| label(r, static_scales);
            let mut layer = GpuLayer::new(&dev, &ops, &Replicas::identity(e), &opts.settings)?;
            drop(ops);
            for &tokens in &opts.selection.tokens {
                let (ids, active) = routing(tokens, e, k, case_seed(model.name, tokens))?;
                let mut xb = vec![0u8; 2 * tokens * h];
                random_bf16(&mut xb, 0x5EED_00A0 ^ tokens as u64);
                let x: Vec<u16> = xb
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
                    .collect();
                let w = vec![1.0 / k as f32; tokens * k];
                let toks = Tokens {
                    x: &x,
                    ids: &ids,
                    weights: &w,
                    t: tokens,
                    k,
                };
                match time_layer(&dev, &mut layer, &toks, &mut flush) {
                    Ok(Timed {
                        us,
                        graph_us,
                        steps,
                        variants,
                        note,
                    }) => {
                        if let Some(note) = note {
                            let _ = writeln!(
                                report,
                                "{} {} {tokens} tokens: {note}",
                                model.name,
                                label(recipe)
                            );
                        }
                        let flops = 6.0 * (tokens * k) as f64 * h as f64 * i as f64;
                        let bytes = active as f64 * bytes_per_expert(recipe, h, i) as f64;
                        let t_bw = bytes / (READ_CEILING_TBPS * 1e12) * 1e6;
                        let t_fl = flops / (recipe.flops_ceiling() * 1e12) * 1e6;
                        rows.push(Row {
                            model: model.name,
                            recipe,
                            static_scales,
                            tokens,
                            us,
                            graph_us,
                            steps,
                            tflops: flops / us / 1e6,
                            weight_tbps: bytes / us / 1e6,
                            roofline: t_bw.max(t_fl) / us,
                            torch_us: None,
                            vllm_w13_us: crate::bench_gemm::vllm_us(model.name, tokens, recipe),
                            variants,
                        });
                    }
                    Err(err) => {
                        ok = false;
                        let _ = writeln!(
                            report,
                            "{} {} {tokens} tokens: FAILED: {err}",
                            model.name,
                            label(recipe)
                        );
                    }
                }
            }
        }
    }
    let about = match &opts.anchor {
        Some(script) => {
            let (torch, about) = run_anchor(script, &json!({ "cases": cases }));
            for r in &mut rows {
                r.torch_us = torch.get(&(r.model.to_string(), r.tokens)).copied();
            }
            about
        }
        None => "torch layer not measured (--no-anchor)".into(),
    };
    let _ = writeln!(
        report,
        "MoE layer forward (permute, w13 GEMM, SiLU*up, w2 GEMM, combine; GEMM variants tuned per row bucket on the layer's own operands), {}",
        describe(&dev)
    );
    let _ = writeln!(report, "{about}");
    let _ = writeln!(
        report,
        "| model | recipe | tokens | us | graph us | TFLOP/s | weight TB/s | % roofline | torch bf16 layer us | torch/ours | vLLM w13 us (ANCHORS.md) | vLLM w13 / our w13 | steps (us) | GEMMs (tuned) |"
    );
    let _ = writeln!(
        report,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in &rows {
        let steps: Vec<String> = r
            .steps
            .iter()
            .map(|(n, us)| format!("{n} {us:.1}"))
            .collect();
        let _ = writeln!(
            report,
            "| {} | {} | {} | {:.1} | {} | {:.1} | {:.2} | {:.0}% | {} | {} | {} | {} | {} | {} |",
            r.model,
            r.label(),
            r.tokens,
            r.us,
            r.graph_us.map_or("-".into(), |g| format!("{g:.1}")),
            r.tflops,
            r.weight_tbps,
            100.0 * r.roofline,
            r.torch_us.map_or("-".into(), |t| format!("{t:.1}")),
            r.torch_us
                .map_or("-".into(), |t| format!("{:.2}", t / r.us)),
            r.vllm_w13_us.map_or("-".into(), |v| format!("{v:.1}")),
            r.vllm_ratio().map_or("-".into(), |x| format!("{x:.2}")),
            steps.join(", "),
            r.variants
        );
    }
    if let Some(path) = &opts.plot {
        let points: Vec<crate::plot::LayerPoint> = rows
            .iter()
            .map(|r| crate::plot::LayerPoint {
                model: r.model.to_string(),
                recipe: r.label(),
                tokens: r.tokens,
                us: r.us,
                roofline_us: r.roofline * r.us,
                torch_us: r.torch_us,
            })
            .collect();
        let title = format!("MoE layer forward on {}", describe(&dev));
        let svg = crate::plot::layer_svg(&points, &crate::plot::vllm_bf16_w13, &title)?;
        crate::write_atomic(path, svg.as_bytes())?;
        let _ = writeln!(report, "plot: {}", path.display());
    }
    if let Some(path) = &opts.json {
        let v = json!({
            "device": describe(&dev),
            "torch": about,
            "rows": rows.iter().map(|r| json!({
                "model": r.model, "recipe": r.label(), "tokens": r.tokens, "us": r.us,
                "graph_us": r.graph_us,
                "tflops": r.tflops, "weight_tbps": r.weight_tbps, "roofline": r.roofline,
                "torch_us": r.torch_us, "variants": r.variants,
                "vllm_w13_us": r.vllm_w13_us, "w13_us": r.w13_us(),
                "steps": r.steps.iter().map(|(n, us)| json!({"step": n, "us": us})).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        });
        crate::write_atomic(path, v.to_string().as_bytes())?;
    }
    if !ok {
        return Err(Error::Usage(format!(
            "{report}MoE layer benchmark: a case failed"
        )));
    }
    Ok(report)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn row(steps: Steps, vllm: Option<f64>) -> Row {
        Row {
            model: "deepseek-v3-ep8",
            recipe: Recipe::Bf16,
            static_scales: false,
            tokens: 1,
            us: 200.0,
            graph_us: None,
            steps,
            tflops: 0.0,
            weight_tbps: 0.0,
            roofline: 0.0,
            torch_us: None,
            vllm_w13_us: vllm,
            variants: String::new(),
        }
    }

    /// The vLLM ratio divides ANCHORS.md's w13 GEMM by our w13 step, fused or not, and is absent
    /// without either.
    #[test]
    fn the_vllm_ratio_reads_our_w13_step() {
        let fused = row(
            vec![
                ("permute", 9.0),
                ("w13 GEMM + silu * up", 122.3 / 2.0),
                ("w2 GEMM", 60.0),
            ],
            Some(122.3),
        );
        assert_eq!(fused.w13_us(), Some(61.15));
        assert!((fused.vllm_ratio().unwrap() - 2.0).abs() < 1e-12);
        let plain = row(vec![("w13 GEMM", 70.0), ("silu * up", 5.0)], Some(72.0));
        assert!((plain.vllm_ratio().unwrap() - 72.0 / 70.0).abs() < 1e-12);
        assert_eq!(row(vec![("w13 GEMM", 70.0)], None).vllm_ratio(), None);
        assert_eq!(row(vec![("w2 GEMM", 70.0)], Some(1.0)).vllm_ratio(), None);
        // ANCHORS.md's rows: bf16 and fp8 figures by recipe, none off the table.
        assert_eq!(
            crate::bench_gemm::vllm_us("deepseek-v3-ep8", 1, Recipe::Bf16),
            Some(122.3)
        );
        assert_eq!(
            crate::bench_gemm::vllm_us("deepseek-v3-ep8", 1, Recipe::Fp8Block128),
            Some(72.0)
        );
        assert_eq!(
            crate::bench_gemm::vllm_us("deepseek-v3-ep8", 3, Recipe::Bf16),
            None
        );
    }
}
