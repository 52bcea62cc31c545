//! Pre-quantized checkpoints: a recipe over quantized inputs (`input w13_weight : e2m1[E, 2*I, H]`,
//! `input w13_weight_scale : e4m3[...]`, `input w13_weight_scale_2 : f32[E]`, ...) reads them under
//! ModelOpt's names: per expert `{gate,up,down}_proj.{weight, weight_scale, weight_scale_2,
//! input_scale}` (Mixtral's `w1/w3/w2`), or already fused `mlp.experts.{input}`. `w13_*` stacks gate
//! and up along rows per expert, `w2_*` is down. Per-expert scalars become `[E]`; where gate and up
//! carry different per-tensor scales (NVFP4's `weight_scale_2`, FP8's `weight_scale`), the pair is
//! requantized to the larger one, as vLLM does, and a note says so.

use std::collections::{BTreeSet, HashMap};

use safetensors::tensor::Dtype;

use crate::codegen::reference as r;
use crate::dsl::ir::DType;
use crate::pack::{ckpt, per_expert_names, Form, LayerInputs, Source};
use crate::Result;

/// A recipe input: name, dtype, rank, whether optional.
#[derive(Debug, Clone)]
pub struct RecipeInput {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Number of dimensions.
    pub rank: usize,
    /// Declared `optional`.
    pub optional: bool,
}

/// The checkpoint dtypes a recipe dtype may be stored as.
fn stored_as(d: DType) -> &'static [Dtype] {
    match d {
        DType::E2m1 | DType::U4 | DType::U8 => &[Dtype::U8],
        DType::E4m3 => &[Dtype::F8_E4M3],
        DType::E5m2 => &[Dtype::F8_E5M2],
        DType::E8m0 => &[Dtype::F8_E8M0, Dtype::U8],
        DType::I8 => &[Dtype::I8],
        DType::F32 => &[Dtype::F32],
        DType::Bf16 => &[Dtype::BF16],
        DType::F16 => &[Dtype::F16],
        DType::I32 => &[Dtype::I32],
    }
}

fn f32_of(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// One stored tensor's bytes, checked against the recipe's dtype.
fn bytes_of(src: &Source<'_>, name: &str, want: DType) -> Result<(Vec<u8>, Vec<usize>)> {
    let t = src.get(name)?;
    if !stored_as(want).contains(&t.dtype()) {
        return Err(ckpt(format!(
            "tensor `{name}`: the recipe reads it as {want}, stored as {:?}; found {:?}",
            stored_as(want),
            t.dtype()
        )));
    }
    Ok((t.data().to_vec(), t.shape().to_vec()))
}

/// Gather a layer's pre-quantized inputs. `notes` receives what was requantized.
pub(crate) fn gather(
    src: &Source<'_>,
    layer: u32,
    form: Form,
    experts: &BTreeSet<u32>,
    inputs: &[RecipeInput],
    notes: &mut Vec<String>,
) -> Result<LayerInputs> {
    let p = format!("model.layers.{layer}");
    let find = |n: &str| inputs.iter().find(|x| x.name == n);
    let w13 = find("w13_weight").ok_or_else(|| {
        ckpt("a recipe over quantized inputs needs `input w13_weight` (and `w2_weight`)")
    })?;
    let fp4 = w13.dtype.is_packed4();
    let mut bufs: HashMap<String, Vec<u8>> = HashMap::new();
    let mut input_bytes = 0usize;
    let (e, h, i);
    match form {
        Form::Fused => {
            for x in inputs {
                let name = format!("{p}.mlp.experts.{}", x.name);
                if x.optional && !src.tensors.contains_key(&name) {
                    continue;
                }
                let (b, _) = bytes_of(src, &name, x.dtype)?;
                input_bytes += b.len();
                bufs.insert(x.name.clone(), b);
            }
            let shape = src
                .get(&format!("{p}.mlp.experts.w13_weight"))?
                .shape()
                .to_vec();
            let [ne, two_i, hc] = shape[..] else {
                return Err(ckpt(format!(
                    "tensor `{p}.mlp.experts.w13_weight`: expected [E, 2*I, H], found {shape:?}"
                )));
            };
            (e, h, i) = (ne, if fp4 { 2 * hc } else { hc }, two_i / 2);
        }
        Form::Hf | Form::Mixtral => {
            let (g, u, d, base) = per_expert_names(form, &p);
            e = experts
                .iter()
                .next_back()
                .map(|x| *x as usize + 1)
                .unwrap_or(0);
            let first = src.get(&format!("{base}.0.{g}.weight"))?;
            let [ii, hc] = first.shape()[..] else {
                return Err(ckpt(format!(
                    "tensor `{base}.0.{g}.weight`: expected [I, H], found {:?}",
                    first.shape()
                )));
            };
            (h, i) = (if fp4 { 2 * hc } else { hc }, ii);
            for x in inputs {
                let (proj, suffix): (Vec<&str>, &str) = if let Some(s) = x.name.strip_prefix("w13_")
                {
                    (vec![g, u], s)
                } else if let Some(s) = x.name.strip_prefix("w2_") {
                    (vec![d], s)
                } else {
                    return Err(ckpt(format!(
                        "recipe input `{}` has no checkpoint source (expected `w13_*` or `w2_*`)",
                        x.name
                    )));
                };
                let names = |k: usize| -> Vec<String> {
                    proj.iter()
                        .map(|pj| format!("{base}.{k}.{pj}.{suffix}"))
                        .collect()
                };
                let missing = (0..e)
                    .flat_map(names)
                    .find(|n| !src.tensors.contains_key(n));
                if let Some(n) = missing {
                    if x.optional {
                        continue;
                    }
                    return Err(ckpt(format!(
                        "missing tensor `{n}` (recipe input `{}`)",
                        x.name
                    )));
                }
                if x.rank == 1 {
                    // One scalar per expert (and per projection): reconciled below for w13.
                    let mut per: Vec<Vec<f32>> = Vec::new();
                    for k in 0..e {
                        let mut v = Vec::new();
                        for n in names(k) {
                            let (b, _) = bytes_of(src, &n, x.dtype)?;
                            if b.len() != 4 {
                                return Err(ckpt(format!("tensor `{n}`: expected an F32 scalar")));
                            }
                            input_bytes += 4;
                            v.push(f32_of(&b));
                        }
                        per.push(v);
                    }
                    let flat: Vec<u8> =
                        per.iter().flatten().flat_map(|f| f.to_le_bytes()).collect();
                    bufs.insert(format!("{}__per_proj", x.name), flat);
                    continue;
                }
                let mut out = Vec::new();
                for k in 0..e {
                    for n in names(k) {
                        let (b, _) = bytes_of(src, &n, x.dtype)?;
                        input_bytes += b.len();
                        out.extend_from_slice(&b);
                    }
                }
                bufs.insert(x.name.clone(), out);
            }
            reconcile(&mut bufs, (e, h, i), fp4, notes, layer)?;
        }
    }
    Ok(LayerInputs {
        dims: (e, h, i),
        bufs,
        as_f32: false,
        wide_from: None,
        input_bytes,
    })
}

/// Per-expert scalars read per projection (`NAME__per_proj`, gate and up for `w13_*`) become `[E]`
/// buffers. Activation scales take the max of gate and up; a per-tensor weight scale that differs
/// between gate and up has the pair requantized to the larger one.
fn reconcile(
    bufs: &mut HashMap<String, Vec<u8>>,
    (e, h, i): (usize, usize, usize),
    fp4: bool,
    notes: &mut Vec<String>,
    layer: u32,
) -> Result<()> {
    let keys: Vec<String> = bufs
        .keys()
        .filter_map(|k| k.strip_suffix("__per_proj").map(str::to_string))
        .collect();
    for name in keys {
        let raw = bufs
            .remove(&format!("{name}__per_proj"))
            .unwrap_or_default();
        let v: Vec<f32> = raw.chunks_exact(4).map(f32_of).collect();
        let per = v.len() / e.max(1);
        let mut out = Vec::with_capacity(e);
        for k in 0..e {
            let s = &v[k * per..(k + 1) * per];
            let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if per == 2 && s[0] != s[1] && !name.ends_with("input_scale") {
                requantize(bufs, &name, k, (e, h, i), fp4, (s[0], s[1]), m)?;
                notes.push(format!(
                    "layer {layer} expert {k}: gate and up `{}` differ ({} vs {}); requantized both to {m}",
                    name.trim_start_matches("w13_"),
                    s[0],
                    s[1]
                ));
            }
            out.push(m);
        }
        bufs.insert(name, out.iter().flat_map(|f| f.to_le_bytes()).collect());
    }
    Ok(())
}

/// Requantize expert `k`'s gate and up halves of `w13_weight` (and NVFP4's block scales) from
/// their own per-tensor scales `(sg, su)` to the common `m` (the larger).
fn requantize(
    bufs: &mut HashMap<String, Vec<u8>>,
    scale_name: &str,
    k: usize,
    (_e, h, i): (usize, usize, usize),
    fp4: bool,
    (sg, su): (f32, f32),
    m: f32,
) -> Result<()> {
    let bad = || {
        ckpt(format!("`{scale_name}` differs between gate and up, and the recipe's inputs are not a ModelOpt NVFP4 or FP8 per-tensor pair that can be requantized"))
    };
    if fp4 && scale_name == "w13_weight_scale_2" {
        // NVFP4: value = e2m1(code) * e4m3(block scale) * scale_2. Dequantize the half whose
        // scale_2 is smaller and quantize it again with gs = 1 / m (SPEC §4).
        let row_bytes = h / 2;
        let nb = h / 16;
        for (half, s) in [(0usize, sg), (1, su)] {
            if s == m {
                continue;
            }
            for r in 0..i {
                let row = k * 2 * i + half * i + r;
                let codes = bufs.get("w13_weight").ok_or_else(bad)?;
                let scales = bufs.get("w13_weight_scale").ok_or_else(bad)?;
                let cb = &codes[row * row_bytes..(row + 1) * row_bytes];
                let sb = &scales[row * nb..(row + 1) * nb];
                let x: Vec<f32> = (0..h)
                    .map(|c| {
                        let code = (cb[c / 2] >> (4 * (c % 2))) & 0xF;
                        r::e2m1_to_f32(code) * r::e4m3_to_f32(sb[c / 16]) * s
                    })
                    .collect();
                let (nc, ns) = r::nvfp4_quantize(&x, h, 1.0 / m);
                if let Some(b) = bufs.get_mut("w13_weight") {
                    b[row * row_bytes..(row + 1) * row_bytes].copy_from_slice(&nc);
                }
                if let Some(b) = bufs.get_mut("w13_weight_scale") {
                    b[row * nb..(row + 1) * nb].copy_from_slice(&ns);
                }
            }
        }
        return Ok(());
    }
    if !fp4 && scale_name == "w13_weight_scale" {
        // FP8 per tensor: value = e4m3(code) * scale; requantize with the common scale.
        for (half, s) in [(0usize, sg), (1, su)] {
            if s == m {
                continue;
            }
            let codes = bufs.get_mut("w13_weight").ok_or_else(bad)?;
            let base = (k * 2 * i + half * i) * h;
            for c in &mut codes[base..base + i * h] {
                *c = r::e4m3_from_f32((r::e4m3_to_f32(*c) * s / m).clamp(-448.0, 448.0));
            }
        }
        return Ok(());
    }
    Err(bad())
}
