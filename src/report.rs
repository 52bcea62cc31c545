//! Human and JSON reports of a verified recipe (`moeforge check`), and the demo table.

use std::fmt::Write as _;

use moeforge_dsl::ir::{Module, TensorKind};
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

/// What the view's map is: a bijection, else injective only where that is proven (a view that is
/// not a bijection may map two coordinates to one offset, e.g. a stride-0 broadcast).
fn map_kind(info: &ModuleInfo, v: &ViewInfo) -> &'static str {
    let injective =
        || moeforge_dsl::verify::sym_injective_with(&v.layout, &info.module().atoms.lower_bounds());
    match v.bijective {
        Some(true) => "bijective",
        Some(false) if injective() => "injective",
        Some(false) => "not bijective",
        None => "unknown",
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
                map_kind(info, v).into(),
                v.in_bounds.to_string(),
                format!("{}{claim}", v.bijective_proof),
            ]);
        }
        out.push_str(&table(&rows));
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
