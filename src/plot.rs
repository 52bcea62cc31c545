//! The MoE layer benchmark's plot (issue \[9\] item 4): time against tokens, log-log, one panel per
//! model, for each recipe's whole-layer forward, its roofline (`max(weight bytes / HBM, flops /
//! dense peak)`, the report's `roofline` share times the time), torch's bf16 layer measured in the
//! same call, and vLLM's tuned Triton w13 GEMM as recorded in ../shared/ANCHORS.md (one GEMM, not a
//! layer: drawn for scale, and labelled so). Written as SVG with `plotters`.
//!
//! The input is `bench --gpu --moe --json`'s report; `moeforge plot` re-draws a saved one, and
//! `bench --gpu --moe --plot OUT.svg` draws the run's own.

use plotters::prelude::*;
use serde_json::Value;

use crate::{Error, Result};

/// One benchmark row: a model's layer forward with one recipe at one token count.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerPoint {
    /// Model name (`qwen3-30b-a3b`, ...).
    pub model: String,
    /// Recipe name.
    pub recipe: String,
    /// Tokens of the forward.
    pub tokens: usize,
    /// The forward's time (microseconds).
    pub us: f64,
    /// The roofline's time (microseconds): the time at 100% of the report's roofline.
    pub roofline_us: f64,
    /// torch's bf16 layer on the same routing (microseconds), when it was measured.
    pub torch_us: Option<f64>,
}

/// The rows of a `bench --gpu --moe --json` report (`{"rows": [{model, recipe, tokens, us,
/// roofline, torch_us}, ...]}`). A report without rows, or a row without those fields (or with a
/// non-positive time), is an error naming it.
pub fn points_from_report(text: &str) -> Result<Vec<LayerPoint>> {
    let v: Value = serde_json::from_str(text)
        .map_err(|e| Error::Usage(format!("the MoE benchmark report is not JSON: {e}")))?;
    let rows = v
        .get("rows")
        .and_then(Value::as_array)
        .ok_or_else(|| Error::Usage("the MoE benchmark report has no `rows` array".into()))?;
    let mut out = Vec::with_capacity(rows.len());
    for (i, r) in rows.iter().enumerate() {
        let bad = |what: &str| Error::Usage(format!("row {i} of the MoE benchmark report: {what}"));
        let text = |k: &str| {
            r.get(k)
                .and_then(Value::as_str)
                .map(String::from)
                .ok_or_else(|| bad(&format!("no `{k}`")))
        };
        let num = |k: &str| {
            r.get(k)
                .and_then(Value::as_f64)
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| bad(&format!("no positive `{k}`")))
        };
        let tokens = r
            .get("tokens")
            .and_then(Value::as_u64)
            .filter(|&t| t > 0)
            .ok_or_else(|| bad("no positive `tokens`"))?;
        let us = num("us")?;
        let share = num("roofline")?;
        out.push(LayerPoint {
            model: text("model")?,
            recipe: text("recipe")?,
            tokens: usize::try_from(tokens).map_err(|_| bad("`tokens` too large"))?,
            us,
            roofline_us: share * us,
            torch_us: r
                .get("torch_us")
                .and_then(Value::as_f64)
                .filter(|x| x.is_finite() && *x > 0.0),
        });
    }
    if out.is_empty() {
        return Err(Error::Usage("the MoE benchmark report has no rows".into()));
    }
    Ok(out)
}

/// Panel height and width (pixels).
const PANEL: (u32, u32) = (420, 960);

/// A recipe's colour (the same in every panel; eight before they repeat, more than the seven
/// standard recipes; black and grey are torch's and vLLM's).
fn colour(i: usize) -> RGBColor {
    const C: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(214, 39, 40),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
        RGBColor(255, 127, 14),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(23, 190, 207),
    ];
    C[i % C.len()]
}

fn draw_err<E: std::fmt::Debug>(e: E) -> Error {
    Error::Usage(format!("drawing the plot: {e:?}"))
}

/// The SVG of `points`: a panel per model (in the order they first appear), and in each a line per
/// recipe (its forward, solid; its roofline, thin), torch's bf16 layer (black) and `vllm(model,
/// tokens)` where it has a value (grey: vLLM's w13 GEMM alone, recorded). `title` heads the plot.
pub fn layer_svg(
    points: &[LayerPoint],
    vllm: &dyn Fn(&str, usize) -> Option<f64>,
    title: &str,
) -> Result<String> {
    let mut models: Vec<&str> = Vec::new();
    let mut recipes: Vec<&str> = Vec::new();
    for p in points {
        if !models.contains(&p.model.as_str()) {
            models.push(&p.model);
        }
        if !recipes.contains(&p.recipe.as_str()) {
            recipes.push(&p.recipe);
        }
    }
    if models.is_empty() {
        return Err(Error::Usage("nothing to plot".into()));
    }
    let mut svg = String::new();
    {
        let height = 40 + PANEL.0 * models.len() as u32;
        let root = SVGBackend::with_string(&mut svg, (PANEL.1, height)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err)?;
        let root = root.titled(title, ("sans-serif", 18)).map_err(draw_err)?;
        let panels = root.split_evenly((models.len(), 1));
        for (model, area) in models.iter().zip(panels.iter()) {
            let mine: Vec<&LayerPoint> = points.iter().filter(|p| p.model == *model).collect();
            let tmax = mine.iter().map(|p| p.tokens).max().unwrap_or(1).max(2) as f64;
            let mut ys: Vec<f64> = mine
                .iter()
                .flat_map(|p| [Some(p.us), Some(p.roofline_us), p.torch_us])
                .flatten()
                .collect();
            ys.extend(mine.iter().filter_map(|p| vllm(model, p.tokens)));
            let ymin = ys.iter().copied().fold(f64::INFINITY, f64::min).max(1e-3) / 1.5;
            let ymax = ys.iter().copied().fold(0.0, f64::max).max(ymin * 2.0) * 1.5;
            let mut chart = ChartBuilder::on(area)
                .caption(*model, ("sans-serif", 16))
                .margin(12)
                .x_label_area_size(36)
                .y_label_area_size(64)
                .build_cartesian_2d((1f64..tmax * 1.2).log_scale(), (ymin..ymax).log_scale())
                .map_err(draw_err)?;
            chart
                .configure_mesh()
                .x_desc("tokens")
                .y_desc("time (us)")
                .draw()
                .map_err(draw_err)?;
            for (ri, recipe) in recipes.iter().enumerate() {
                let mut line: Vec<(f64, f64, f64)> = mine
                    .iter()
                    .filter(|p| p.recipe == *recipe)
                    .map(|p| (p.tokens as f64, p.us, p.roofline_us))
                    .collect();
                if line.is_empty() {
                    continue;
                }
                line.sort_by(|a, b| a.0.total_cmp(&b.0));
                let c = colour(ri);
                chart
                    .draw_series(LineSeries::new(
                        line.iter().map(|&(t, us, _)| (t, us)),
                        c.stroke_width(2),
                    ))
                    .map_err(draw_err)?
                    .label(format!("moeforge {recipe}"))
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                    });
                chart
                    .draw_series(LineSeries::new(
                        line.iter().map(|&(t, _, r)| (t, r)),
                        c.mix(0.45).stroke_width(1),
                    ))
                    .map_err(draw_err)?
                    .label(format!("{recipe} roofline"))
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.mix(0.45)));
            }
            let mut series = |pts: Vec<(f64, f64)>, style: ShapeStyle, label: &str| -> Result<()> {
                if pts.is_empty() {
                    return Ok(());
                }
                chart
                    .draw_series(LineSeries::new(pts, style))
                    .map_err(draw_err)?
                    .label(label)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
                Ok(())
            };
            let mut tokens: Vec<usize> = mine.iter().map(|p| p.tokens).collect();
            tokens.sort_unstable();
            tokens.dedup();
            let torch: Vec<(f64, f64)> = tokens
                .iter()
                .filter_map(|&t| {
                    mine.iter()
                        .find(|p| p.tokens == t && p.torch_us.is_some())
                        .and_then(|p| p.torch_us)
                        .map(|us| (t as f64, us))
                })
                .collect();
            series(torch, BLACK.stroke_width(2), "torch bf16 layer (same call)")?;
            let vl: Vec<(f64, f64)> = tokens
                .iter()
                .filter_map(|&t| vllm(model, t).map(|us| (t as f64, us)))
                .collect();
            series(
                vl,
                RGBColor(128, 128, 128).stroke_width(2),
                "vLLM w13 GEMM only (recorded)",
            )?;
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(draw_err)?;
        }
        root.present().map_err(draw_err)?;
    }
    Ok(svg)
}

/// vLLM's recorded w13 GEMM time for bf16 weights (ANCHORS.md), for [`layer_svg`].
pub fn vllm_bf16_w13(model: &str, tokens: usize) -> Option<f64> {
    crate::bench_gemm::vllm_us(model, tokens, crate::bench_gemm::Recipe::Bf16)
}

/// `moeforge plot REPORT.json -o OUT.svg`: read a `bench --gpu --moe --json` report and write its
/// plot atomically; a bad report is an error naming it, and nothing is written.
pub fn plot_report(report: &std::path::Path, out: &std::path::Path) -> Result<String> {
    let text = std::fs::read_to_string(report).map_err(|e| Error::Io {
        path: report.display().to_string(),
        source: e,
    })?;
    let points = points_from_report(&text)?;
    let title = format!(
        "MoE layer forward on the GPU: {} ({} rows)",
        report
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default(),
        points.len()
    );
    let svg = layer_svg(&points, &vllm_bf16_w13, &title)?;
    crate::write_atomic(out, svg.as_bytes())?;
    Ok(format!(
        "wrote {} ({} rows, {} bytes)\n",
        out.display(),
        points.len(),
        svg.len()
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_standard_recipes_get_distinct_colours() {
        let c: Vec<(u8, u8, u8)> = (0..7)
            .map(|i| {
                let RGBColor(r, g, b) = colour(i);
                (r, g, b)
            })
            .collect();
        for (i, a) in c.iter().enumerate() {
            assert!(c[i + 1..].iter().all(|b| b != a), "colour {i} repeats");
            // Neither torch's black nor vLLM's grey.
            assert!(*a != (0, 0, 0) && *a != (128, 128, 128));
        }
    }

    fn report() -> String {
        let mut rows = Vec::new();
        for model in ["qwen3-30b-a3b", "mixtral-8x7b"] {
            for recipe in ["bf16", "fp8_per_tensor"] {
                for (t, us) in [(1usize, 70.0), (16, 200.0), (8192, 2000.0)] {
                    rows.push(serde_json::json!({
                        "model": model, "recipe": recipe, "tokens": t, "us": us,
                        "roofline": 0.5, "torch_us": us * 2.0, "tflops": 1.0,
                    }));
                }
            }
        }
        serde_json::json!({ "device": "x", "rows": rows }).to_string()
    }

    #[test]
    fn a_report_becomes_points_and_an_svg_with_every_series() {
        let points = points_from_report(&report()).unwrap();
        assert_eq!(points.len(), 12);
        assert_eq!(points[0].roofline_us, 35.0);
        let svg = layer_svg(&points, &|_, t| (t == 16).then_some(150.0), "t").unwrap();
        assert!(svg.starts_with("<svg"));
        for label in [
            "qwen3-30b-a3b",
            "mixtral-8x7b",
            "moeforge bf16",
            "moeforge fp8_per_tensor",
            "bf16 roofline",
            "torch bf16 layer (same call)",
            "vLLM w13 GEMM only (recorded)",
            "tokens",
            "time (us)",
        ] {
            assert!(svg.contains(label), "{label}");
        }
        // Two panels, each with two recipes' forward lines, torch's and vLLM's (stroke 2), and the
        // two rooflines (faint), every one drawn once in the panel and once in its legend.
        let lines = |attrs: &str| {
            svg.lines()
                .filter(|l| l.starts_with("<polyline") && l.contains(attrs))
                .count()
        };
        assert_eq!(lines("stroke-width=\"2\""), 2 * 4 * 2);
        assert_eq!(lines("opacity=\"0.45\""), 2 * 2 * 2);
    }

    #[test]
    fn bad_reports_are_named() {
        for (text, want) in [
            ("not json", "not JSON"),
            ("{}", "no `rows` array"),
            (r#"{"rows": []}"#, "no rows"),
            (
                r#"{"rows": [{"model": "m", "recipe": "r", "tokens": 1, "us": 0, "roofline": 1}]}"#,
                "positive `us`",
            ),
            (
                r#"{"rows": [{"recipe": "r", "tokens": 1, "us": 1, "roofline": 1}]}"#,
                "no `model`",
            ),
        ] {
            let err = points_from_report(text).unwrap_err().to_string();
            assert!(err.contains(want), "{text}: {err}");
        }
    }
}
