//! Human and JSON reports of a verified recipe (`moeforge check`), and the demo table.

use std::fmt::Write as _;

use moeforge_dsl::ir::{ActDynamic, ActScale, Module, Tensor, TensorKind, GEMM_WEIGHTS};
use moeforge_dsl::poly::Poly;
use moeforge_dsl::verify::{ModuleInfo, Proof, ViewInfo};
use serde_json::{json, Value};

fn dims_text(info: &ModuleInfo, shape: &[Poly]) -> String {
    match info.binding() {
        Some(b) => {
            let v: Vec<String> = shape
                .iter()
                .map(|p| {
                    b.eval(p)
                        .map(|x| x.to_string())
                        .unwrap_or_else(|| "?".into())
                })
                .collect();
            format!("[{}]", v.join(", "))
        }
        None => info.module().show_shape(shape),
    }
}

fn layout_text(info: &ModuleInfo, l: &moeforge_dsl::ir::SymLayout) -> String {
    match info.numeric(l) {
        Some((lay, off)) => {
            let sw = l.swizzle.map(|s| format!("{s} o ")).unwrap_or_default();
            if off == 0 {
                format!("{sw}{lay}")
            } else {
                format!("{sw}{off} + {lay}")
            }
        }
        None => l.display(&info.module().atoms).to_string(),
    }
}

fn bytes_text(info: &ModuleInfo, e: &moeforge_dsl::verify::MoveEntry) -> String {
    match info.bytes_per_expert(e) {
        Some(v) if info.binding().is_some() => v.to_string(),
        _ => match e.bytes_symbolic() {
            Some(p) => info.module().show(&p),
            None => format!("({})/8", info.module().show(&e.bits_per_expert)),
        },
    }
}

/// The logical tensor a view stands for, written from its definition.
pub fn stands_for(info: &ModuleInfo, view: crate::dsl::ir::TensorId) -> String {
    let m = info.module();
    let Some(v) = m.tensor(view).and_then(|t| t.value) else {
        return "?".into();
    };
    definition(info, v, 0)
}

fn definition(info: &ModuleInfo, v: crate::dsl::ir::ValueId, depth: usize) -> String {
    use crate::dsl::ir::Op;
    let m = info.module();
    let Some(val) = m.value(v) else {
        return "?".into();
    };
    if depth > 64 {
        return "...".into();
    }
    let sub = |x| definition(info, x, depth + 1);
    let rank = |x: crate::dsl::ir::ValueId| m.value(x).map(|y| y.shape.len()).unwrap_or(0);
    let index = |base: crate::dsl::ir::ValueId, dim: usize, what: String| {
        let parts: Vec<String> = (0..rank(base))
            .map(|k| if k == dim { what.clone() } else { ":".into() })
            .collect();
        format!("{}[{}]", sub(base), parts.join(", "))
    };
    match &val.op {
        Op::Tensor(t) => m.tensor(*t).map(|x| x.name.clone()).unwrap_or_default(),
        Op::Slice {
            base,
            dim,
            start,
            end,
        } => index(*base, *dim, format!("{}:{}", m.show(start), m.show(end))),
        Op::Select {
            base,
            dim,
            index: i,
        } => index(*base, *dim, m.show(i)),
        Op::Permute { base, perm } => format!(
            "permute({}, {})",
            sub(*base),
            perm.iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Op::Reshape { base, shape } => format!(
            "reshape({}, {})",
            sub(*base),
            shape
                .iter()
                .map(|p| m.show(p))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Op::MmaSfView { base } => format!(
            "S_g[r, c] = {}[g, r, c] at (r%32, (r%128)/32, r/128, c%4, c/4, g)",
            sub(*base)
        ),
        Op::Apply { base, layout } => format!(
            "the raw storage of {} through {}",
            sub(*base),
            layout.display(&m.atoms)
        ),
        other => other.describe().into(),
    }
}

fn map_kind(v: &ViewInfo) -> &'static str {
    match (v.bijective, v.injective) {
        (Some(true), _) => "bijective",
        (_, Some(true)) => "injective",
        (_, Some(false)) => "aliasing",
        (_, None) => "unknown",
    }
}

fn table(rows: &[Vec<String>]) -> String {
    let cols = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    let mut w = vec![0usize; cols];
    for r in rows {
        for (k, c) in r.iter().enumerate() {
            w[k] = w[k].max(c.chars().count());
        }
    }
    let mut out = String::new();
    for r in rows {
        let mut line = String::from("  ");
        for (k, c) in r.iter().enumerate() {
            if k + 1 == r.len() {
                line.push_str(c);
            } else {
                let _ = write!(line, "{c:<width$}  ", width = w[k]);
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// The human-readable report of `moeforge check`.
pub fn human(info: &ModuleInfo) -> String {
    let m = info.module();
    let mut out = String::new();
    let dims: Vec<String> = m
        .dims
        .iter()
        .map(|d| {
            if d.experts {
                format!("{}: experts", d.name)
            } else {
                d.name.clone()
            }
        })
        .collect();
    let _ = writeln!(out, "recipe {}({})", m.name, dims.join(", "));
    match info.binding() {
        Some(b) => {
            let _ = writeln!(out, "bound at {}", b.describe());
        }
        None => {
            let _ =
                writeln!(
                out,
                "not bound: sizes are symbolic; pass --bind {} for numbers and exhaustive checks",
                m.dims.iter().map(|d| format!("{}=..", d.name)).collect::<Vec<_>>().join(",")
            );
        }
    }
    out.push_str("\nparams (registered, expert-major, contiguous: EPLB moves these)\n");
    let mut rows = vec![vec![
        "name".into(),
        "dtype".into(),
        "shape".into(),
        "layout".into(),
        "bytes/expert".into(),
        "proof".into(),
    ]];
    for (p, e) in info.params.iter().zip(&info.move_set) {
        let Some(t) = m.tensor(p.id) else { continue };
        let name = if t.optional {
            format!("{} (optional)", t.name)
        } else {
            t.name.clone()
        };
        rows.push(vec![
            name,
            t.dtype.to_string(),
            dims_text(info, &t.shape),
            layout_text(info, &p.layout),
            bytes_text(info, e),
            p.proof.to_string(),
        ]);
    }
    out.push_str(&table(&rows));
    if !info.views.is_empty() {
        out.push_str("\nviews (aliases of one param's storage: no copy)\n");
        let mut rows = vec![vec![
            "name".into(),
            "source".into(),
            "shape".into(),
            "layout".into(),
            "map".into(),
            "in bounds".into(),
            "bijection".into(),
        ]];
        for v in &info.views {
            let (Some(t), Some(s)) = (m.tensor(v.id), m.tensor(v.source)) else {
                continue;
            };
            let claim = if v.claimed { " (claimed)" } else { "" };
            rows.push(vec![
                t.name.clone(),
                s.name.clone(),
                dims_text(info, &t.shape),
                layout_text(info, &v.layout),
                map_kind(v).into(),
                v.in_bounds.to_string(),
                format!("{}{claim}", v.bijective_proof),
            ]);
        }
        out.push_str(&table(&rows));
        // What each view stands for: its definition over the param's logical elements (the layout
        // above is that definition composed with the param's storage layout).
        for v in &info.views {
            if let Some(t) = m.tensor(v.id) {
                let _ = writeln!(out, "  {} stands for {}", t.name, stands_for(info, v.id));
            }
        }
    }
    if !m.kernels.is_empty() {
        out.push_str("\nkernels\n");
        let mut rows = vec![vec![
            "name".into(),
            "reads".into(),
            "targets".into(),
            "index".into(),
        ]];
        for k in &info.kernels {
            let Some(kb) = m.kernels.get(k.index) else {
                continue;
            };
            let reads: Vec<String> = kb
                .operands
                .iter()
                .filter_map(|(t, _)| m.tensor(*t).map(|x| x.name.clone()))
                .collect();
            let targets: Vec<&str> = kb.targets.iter().map(|t| t.name()).collect();
            let w = match kb.index.0 {
                moeforge_dsl::ir::IndexWidth::I32 => "i32",
                moeforge_dsl::ir::IndexWidth::I64 => "i64",
            };
            rows.push(vec![
                kb.name.clone(),
                reads.join(", "),
                targets.join(", "),
                format!("{w} ({})", k.proof),
            ]);
        }
        out.push_str(&table(&rows));
    }
    out.push_str(&activation_human(info));
    out.push_str("\nmove set (expert e owns bytes [e*B, (e+1)*B) of each param)\n");
    let mut rows = vec![vec!["param".into(), "B = bytes/expert".into()]];
    let mut total: i128 = 0;
    for e in &info.move_set {
        let Some(t) = m.tensor(e.param) else {
            continue;
        };
        total += info.bytes_per_expert(e).unwrap_or(0);
        rows.push(vec![t.name.clone(), bytes_text(info, e)]);
    }
    if let Some(b) = info.binding() {
        let experts = m
            .experts_dim()
            .and_then(|d| b.dims.iter().find(|x| x.0 == d.name))
            .map(|x| x.1 as i128)
            .unwrap_or(0);
        rows.push(vec![
            "total".into(),
            format!("{total} per expert, {} per layer", total * experts),
        ]);
    }
    out.push_str(&table(&rows));
    let _ = writeln!(out, "\nverified: {}", promise_summary(info));
    out
}

/// One line saying which promises were proven how.
pub fn promise_summary(info: &ModuleInfo) -> String {
    let count = |f: &dyn Fn(Proof) -> bool| -> usize {
        info.params.iter().filter(|p| f(p.proof)).count()
            + info.views.iter().filter(|v| f(v.in_bounds)).count()
            + info.views.iter().filter(|v| f(v.bijective_proof)).count()
            + info.kernels.iter().filter(|k| f(k.proof)).count()
    };
    let s = count(&|p| p == Proof::Symbolic);
    let e = count(&|p| p == Proof::Exhaustive);
    let n = count(&|p| p == Proof::NeedsBinding);
    let mut parts = vec![format!("{s} symbolic")];
    if e > 0 {
        parts.push(format!("{e} exhaustive at the bound shape"));
    }
    if n > 0 {
        parts.push(format!("{n} need a binding"));
    }
    format!(
        "{} params, {} views, {} kernels; proofs: {}",
        info.params.len(),
        info.views.len(),
        info.kernels.len(),
        parts.join(", ")
    )
}

fn int_list(info: &ModuleInfo, ps: &[Poly]) -> Value {
    match ps
        .iter()
        .map(|p| info.eval(p))
        .collect::<Option<Vec<i128>>>()
    {
        Some(v) if info.binding().is_some() => {
            json!(v.iter().map(|x| *x as i64).collect::<Vec<_>>())
        }
        _ => Value::Null,
    }
}

fn sym_list(info: &ModuleInfo, ps: &[Poly]) -> Value {
    json!(ps.iter().map(|p| info.module().show(p)).collect::<Vec<_>>())
}

/// The `--json` report of `moeforge check`.
pub fn json(info: &ModuleInfo) -> Value {
    let m = info.module();
    let bound = info.binding().is_some();
    let params: Vec<Value> = info
        .params
        .iter()
        .zip(&info.move_set)
        .filter_map(|(p, e)| {
            let t = m.tensor(p.id)?;
            Some(json!({
                "name": t.name,
                "dtype": t.dtype.name(),
                "shape": int_list(info, &t.shape),
                "shape_symbolic": sym_list(info, &t.shape),
                "layout": layout_text(info, &p.layout),
                "bytes_per_expert": if bound { json!(info.bytes_per_expert(e).map(|x| x as i64)) } else { Value::Null },
                "bytes_per_expert_symbolic": bytes_text_symbolic(info, e),
                "optional": t.optional,
                "proof": p.proof.name(),
            }))
        })
        .collect();
    let views: Vec<Value> = info
        .views
        .iter()
        .filter_map(|v| {
            let t = m.tensor(v.id)?;
            let s = m.tensor(v.source)?;
            let leaves = v.layout.leaves();
            let shape: Vec<Poly> = leaves.iter().map(|x| x.0.clone()).collect();
            let stride: Vec<Poly> = leaves.iter().map(|x| x.1.clone()).collect();
            Some(json!({
                "name": t.name,
                "source": s.name,
                "shape": int_list(info, &shape),
                "stride": int_list(info, &stride),
                "offset": if bound { json!(info.eval(&v.layout.offset).map(|x| x as i64)) } else { Value::Null },
                "swizzle": v.layout.swizzle.map(|s| s.to_string()),
                "layout": layout_text(info, &v.layout),
                "layout_symbolic": v.layout.display(&m.atoms).to_string(),
                "bijective": v.bijective,
                "injective": v.injective,
                "stands_for": stands_for(info, v.id),
                "claimed_bijective": v.claimed,
                "in_bounds_proof": v.in_bounds.name(),
                "bijective_proof": v.bijective_proof.name(),
            }))
        })
        .collect();
    let move_set: Vec<Value> = info
        .move_set
        .iter()
        .filter_map(|e| {
            let t = m.tensor(e.param)?;
            Some(json!({
                "param": t.name,
                "bytes_per_expert": if bound { json!(info.bytes_per_expert(e).map(|x| x as i64)) } else { Value::Null },
                "bytes_per_expert_symbolic": bytes_text_symbolic(info, e),
            }))
        })
        .collect();
    let kernels: Vec<Value> = info
        .kernels
        .iter()
        .filter_map(|k| {
            let kb = m.kernels.get(k.index)?;
            Some(json!({
                "name": kb.name,
                "reads": kb.operands.iter().filter_map(|(t, _)| m.tensor(*t).map(|x| x.name.clone())).collect::<Vec<_>>(),
                "targets": kb.targets.iter().map(|t| t.name()).collect::<Vec<_>>(),
                "index": match kb.index.0 { moeforge_dsl::ir::IndexWidth::I32 => "i32", moeforge_dsl::ir::IndexWidth::I64 => "i64" },
                "index_proof": k.proof.name(),
            }))
        })
        .collect();
    let binding = info
        .binding()
        .map(|b| Value::Object(b.dims.iter().map(|(k, v)| (k.clone(), json!(v))).collect()));
    json!({
        "recipe": m.name,
        "binding": binding,
        "params": params,
        "views": views,
        "move_set": move_set,
        "kernels": kernels,
        "activation": activation_json(info),
    })
}

/// One way a GEMM scales its E4M3 input, for the reports.
fn act_scale_text(m: &Module, s: &ActScale) -> String {
    match s {
        ActScale::Static(t) => {
            let name = m.tensor(*t).map(|t| t.name.clone()).unwrap_or_default();
            let optional = m.tensor(*t).is_some_and(|t| t.optional);
            if optional {
                format!("static {name} (where present)")
            } else {
                format!("static {name}")
            }
        }
        ActScale::Dynamic(ActDynamic::PerToken) => "per_token".into(),
        ActScale::Dynamic(ActDynamic::PerTokenGroup { group }) => {
            format!("per_token_group {group}")
        }
    }
}

/// The GEMM weights a report lists activations for: `(gemm, weight)` where the weight is registered.
fn gemm_weights(m: &Module) -> Vec<(&'static str, &Tensor)> {
    GEMM_WEIGHTS
        .iter()
        .filter_map(|(g, w)| {
            let t = m.tensor(m.find(w)?)?;
            (t.kind == TensorKind::Param).then_some((*g, t))
        })
        .collect()
}

/// The human report's activation section: the declared scheme and, per GEMM, its operands and
/// how its input is scaled.
fn activation_human(info: &ModuleInfo) -> String {
    let m = info.module();
    let act = info.activation();
    let declared = if m.activation_span().is_some() {
        "declared"
    } else {
        "not declared: bf16 by default"
    };
    let mut out = format!("\nactivation {} ({declared}; SPEC §9)\n", act.text(m));
    let gemms = gemm_weights(m);
    if gemms.is_empty() {
        return out;
    }
    let mut rows = vec![vec![
        "gemm".into(),
        "weight".into(),
        "weight dtype".into(),
        "activations".into(),
        "input scales".into(),
    ]];
    for (g, w) in gemms {
        // Static first: "static w13_input_scale (where present), else per_token".
        let mut scales = info.activation_scales(g);
        scales.sort_by_key(|s| !matches!(s, ActScale::Static(_)));
        let scales: Vec<String> = scales.iter().map(|s| act_scale_text(m, s)).collect();
        rows.push(vec![
            g.into(),
            w.name.clone(),
            w.dtype.to_string(),
            act.dtype().to_string(),
            if scales.is_empty() {
                "none".into()
            } else {
                scales.join(", else ")
            },
        ]);
    }
    out.push_str(&table(&rows));
    out.push_str(&reads_human(info));
    out
}

/// How the GPU layer's GEMMs read each weight at the binding (`crate::gemm_access`): in place
/// through which TMA map, or from a copy re-laid on the host and why, and their weight scales as
/// stored or as a vector made on the host and why; without a binding, a line saying so.
fn reads_human(info: &ModuleInfo) -> String {
    if info.binding().is_none() {
        return "  (how the GEMMs read the weights is decided at a binding: --bind)\n".into();
    }
    let mut rows = vec![vec![
        "gemm".into(),
        "rows".into(),
        "the GPU GEMM reads".into(),
        "its weight scales".into(),
    ]];
    let scales = |g: &str, paired: bool| {
        crate::gemm_access::scales_read(info, g, paired)
            .map_or_else(|| "-".to_string(), |s| s.describe())
    };
    for (g, _) in GEMM_WEIGHTS {
        if let Some((_, a)) = crate::gemm_access::of_gemm(info, g) {
            rows.push(vec![
                g.to_string(),
                "input order".into(),
                a.plain.describe(),
                scales(g, false),
            ]);
            if let (true, Some(p)) = (g == "w13", &a.paired) {
                rows.push(vec![
                    g.to_string(),
                    "fused (paired)".into(),
                    p.describe(),
                    scales(g, true),
                ]);
            }
        }
    }
    if rows.len() == 1 {
        return String::new();
    }
    format!(
        "\nweights read by the GEMMs (at the binding)\n{}",
        table(&rows)
    )
}

/// The `--json` report's `reads` of a GEMM: `{"plain": access, "fused": access, "scales": scales,
/// "fused_scales": scales}` (`null` without a binding or a param; scales `null` without weight
/// scales).
fn reads_json(info: &ModuleInfo, gemm: &str) -> Value {
    use crate::gemm_access::Access;
    let one = |a: &Access| match a {
        Access::InPlace { param, layout } => json!({
            "in_place": true,
            "param": param,
            "rank": layout.rows.rank(),
            "row_modes": layout.rows.inner[..usize::from(layout.rows.modes.clamp(1, 4)) - 1],
            "expert_folded": layout.rows.folded,
            "up_first": layout.rows.up_first,
            "base": layout.base,
            "extents": layout.extents,
            "strides": layout.strides,
        }),
        Access::Relaid { why } => json!({"in_place": false, "why": why}),
    };
    use crate::gemm_access::ScaleRead;
    let scales = |paired: bool| match crate::gemm_access::scales_read(info, gemm, paired) {
        Some(ScaleRead::AsStored { param }) => json!({"as_stored": true, "param": param}),
        Some(ScaleRead::Copied { why }) => json!({"as_stored": false, "why": why}),
        None => Value::Null,
    };
    match crate::gemm_access::of_gemm(info, gemm) {
        Some((_, a)) => json!({
            "plain": one(&a.plain),
            "fused": if gemm == "w13" { a.paired.as_ref().map(one) } else { None },
            "scales": scales(false),
            "fused_scales": if gemm == "w13" && a.paired.is_some() { scales(true) } else { Value::Null },
        }),
        None => Value::Null,
    }
}

/// The `--json` report's `activation` object.
fn activation_json(info: &ModuleInfo) -> Value {
    let m = info.module();
    let act = info.activation();
    let gemms: Vec<Value> = gemm_weights(m)
        .into_iter()
        .map(|(g, w)| {
            let scales: Vec<Value> = info
                .activation_scales(g)
                .iter()
                .map(|s| match s {
                    ActScale::Static(t) => {
                        let t = m.tensor(*t);
                        json!({
                            "kind": "static",
                            "param": t.map(|t| t.name.clone()),
                            "optional": t.is_some_and(|t| t.optional),
                        })
                    }
                    ActScale::Dynamic(ActDynamic::PerToken) => json!({"kind": "per_token"}),
                    ActScale::Dynamic(ActDynamic::PerTokenGroup { group }) => {
                        json!({"kind": "per_token_group", "group": group})
                    }
                })
                .collect();
            json!({
                "gemm": g,
                "weight": w.name,
                "weight_dtype": w.dtype.name(),
                "scales": scales,
                "reads": reads_json(info, g),
            })
        })
        .collect();
    json!({
        "scheme": act.scheme(),
        "dtype": act.dtype().name(),
        "declared": m.activation_span().is_some(),
        "text": act.text(m),
        "gemms": gemms,
    })
}

fn bytes_text_symbolic(info: &ModuleInfo, e: &moeforge_dsl::verify::MoveEntry) -> String {
    match e.bytes_symbolic() {
        Some(p) => info.module().show(&p),
        None => format!("({})/8", info.module().show(&e.bits_per_expert)),
    }
}

/// Names of all tensors of a kind, for messages.
pub fn names_of(m: &Module, pred: &dyn Fn(&TensorKind) -> bool) -> Vec<String> {
    m.tensors
        .iter()
        .filter(|t| pred(&t.kind))
        .map(|t| t.name.clone())
        .collect()
}
