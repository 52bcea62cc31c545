//! `moeforge pack` and `moeforge inspect`: checkpoints in, packed params out, through the host backend.
//!
//! Expert weights are found under Hugging Face names (`model.layers.{L}.mlp.experts.{e}.gate_proj.weight`,
//! `up_proj`, `down_proj`; Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2`; or already fused
//! `model.layers.{L}.mlp.experts.w13_weight` / `w2_weight`), stacked as `w13 = [gate; up]` per expert,
//! the recipe is bound from their shapes and the packed params are written as
//! `model.layers.{L}.mlp.experts.{param}`. The output is written to a temporary file and renamed
//! only when everything succeeded. With `--moe-tp`/`--ep` every layer is split over ranks
//! ([`rank_slice`]), each rank packed on its own thread with the in-process collective
//! ([`RankPacker`]: the sharded plan's all-reduces make every scale the unsplit one), or with
//! `--device gpu` each rank on its own GPU with NCCL doing the all-reduces
//! ([`crate::gpu_shards`]: the same rank program in the GPU's form), and one file per rank is
//! written, all or none.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use crate::codegen::kir::{BufRole, Elem, Program};
use crate::codegen::plan::Sharding;
use crate::dsl::ir::{DType, TensorKind};
use crate::runtime::collective::{Hook, InProcess, Topology};
use crate::{Error, Result};

/// Options of [`pack`].
#[derive(Debug, Clone)]
pub struct PackOptions {
    /// Recipe source.
    pub recipe_src: String,
    /// Recipe file name (for diagnostics).
    pub recipe_path: String,
    /// Input checkpoint files.
    pub inputs: Vec<PathBuf>,
    /// Output file (with a [`Self::topology`] of several ranks, the name the rank files are derived
    /// from: [`rank_path`]).
    pub output: PathBuf,
    /// Inclusive layer range; every MoE layer found when `None`.
    pub layers: Option<(u32, u32)>,
    /// Host threads (0: all cores).
    pub threads: usize,
    /// Show a progress bar.
    pub progress: bool,
    /// Pack on GPU 0 instead of the host (with a [`Self::topology`] of several ranks: rank `r` on
    /// GPU `r`).
    pub gpu: bool,
    /// Write a complete checkpoint directory at `output`: the tensors the recipe does not consume
    /// copied through, sharded like the input, with an index (see [`crate::checkpoint`]).
    pub passthrough: bool,
    /// Pack weights holding NaN or infinities (refused by default, naming the tensor, expert and
    /// index): they are then quantized as the formulas make them (NaN left out of the amax).
    pub allow_nonfinite: bool,
    /// The backends' settings (host compile options; GPU tuning, JIT and kernel cache folder).
    pub settings: crate::Settings,
    /// The ranks to pack for. [`Topology::SINGLE`]: one file at `output`, the whole checkpoint.
    /// Otherwise one file per rank, [`rank_path`]`(output, r)`: `moe_tp` ranks split every expert
    /// (w13's gate and up rows, w2's columns), `ep` ranks divide the experts; the ranks run as host
    /// threads whose in-process collective makes every scale the unsplit pack's, or with
    /// [`Self::gpu`] one per GPU (rank `r` on GPU `r`) with NCCL doing the same reductions.
    pub topology: Topology,
}

/// What [`pack`] did for one layer.
#[derive(Debug, Clone)]
pub struct LayerReport {
    /// Layer index.
    pub layer: u32,
    /// Experts, hidden and intermediate sizes.
    pub dims: (usize, usize, usize),
    /// Bytes of expert weights read (as stored in the checkpoint).
    pub input_bytes: usize,
    /// Seconds spent in the host backend (quantize, swizzle, write to buffers).
    pub seconds: f64,
}

/// What [`pack`] did.
#[derive(Debug, Clone)]
pub struct PackReport {
    /// Per layer.
    pub layers: Vec<LayerReport>,
    /// Bytes written.
    pub output_bytes: usize,
    /// Wall-clock seconds of the whole pack.
    pub seconds: f64,
    /// What was done to the checkpoint besides packing (requantized gate/up pairs).
    pub notes: Vec<String>,
}

pub(crate) fn ckpt(msg: impl Into<String>) -> Error {
    Error::Checkpoint(msg.into())
}

/// Parse `0-3` or `5` (inclusive).
pub fn parse_layers(s: &str) -> Result<(u32, u32)> {
    let bad = || {
        Error::Usage(format!(
            "bad --layers `{s}`: expected `N` or `A-B` (inclusive)"
        ))
    };
    let (a, b) = match s.split_once('-') {
        Some((a, b)) => (a.trim(), b.trim()),
        None => (s.trim(), s.trim()),
    };
    let (a, b): (u32, u32) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
    if a > b {
        return Err(bad());
    }
    Ok((a, b))
}

/// How a layer's expert weights are named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Form {
    /// gate_proj / up_proj / down_proj per expert.
    Hf,
    /// Mixtral's w1 (gate) / w3 (up) / w2 (down) per expert.
    Mixtral,
    /// Already fused `w13_weight [E, 2I, H]` / `w2_weight [E, H, I]`.
    Fused,
}

#[derive(Debug, Default)]
struct LayerIndex {
    forms: BTreeMap<u32, (Form, BTreeSet<u32>)>,
}

fn index_layers(names: &[String]) -> Result<LayerIndex> {
    let mut idx = LayerIndex::default();
    for n in names {
        let Some(rest) = n.strip_prefix("model.layers.") else {
            continue;
        };
        let Some((l, rest)) = rest.split_once('.') else {
            continue;
        };
        let Ok(layer) = l.parse::<u32>() else {
            continue;
        };
        let (form, expert) = if let Some(r) = rest.strip_prefix("mlp.experts.") {
            if r == "w13_weight" || r == "w2_weight" {
                (Form::Fused, None)
            } else if let Some((e, w)) = r.split_once('.') {
                if !matches!(
                    w,
                    "gate_proj.weight" | "up_proj.weight" | "down_proj.weight"
                ) {
                    continue;
                }
                (Form::Hf, e.parse::<u32>().ok())
            } else {
                continue;
            }
        } else if let Some(r) = rest.strip_prefix("block_sparse_moe.experts.") {
            let Some((e, w)) = r.split_once('.') else {
                continue;
            };
            if !matches!(w, "w1.weight" | "w2.weight" | "w3.weight") {
                continue;
            }
            (Form::Mixtral, e.parse::<u32>().ok())
        } else {
            continue;
        };
        let entry = idx.forms.entry(layer).or_insert((form, BTreeSet::new()));
        if entry.0 != form {
            return Err(ckpt(format!(
                "layer {layer} mixes expert naming schemes (`{n}` is {form:?}, earlier tensors {:?})",
                entry.0
            )));
        }
        if let Some(e) = expert {
            entry.1.insert(e);
        }
    }
    Ok(idx)
}

struct Files {
    data: Vec<(PathBuf, Vec<u8>)>,
}

pub(crate) struct Source<'a> {
    pub(crate) tensors: HashMap<String, (usize, TensorView<'a>)>,
    files: Vec<&'a Path>,
}

impl<'a> Source<'a> {
    fn open(files: &'a Files) -> Result<Source<'a>> {
        let mut tensors = HashMap::new();
        let mut paths = Vec::new();
        for (k, (path, bytes)) in files.data.iter().enumerate() {
            paths.push(path.as_path());
            let st = SafeTensors::deserialize(bytes).map_err(|e| {
                ckpt(format!(
                    "{}: not a valid safetensors file ({e})",
                    path.display()
                ))
            })?;
            for (name, view) in st.tensors() {
                if tensors.contains_key(&name) {
                    return Err(ckpt(format!(
                        "tensor `{name}` appears in more than one input file"
                    )));
                }
                tensors.insert(name, (k, view));
            }
        }
        Ok(Source {
            tensors,
            files: paths,
        })
    }

    pub(crate) fn get(&self, name: &str) -> Result<&TensorView<'a>> {
        self.tensors.get(name).map(|x| &x.1).ok_or_else(|| {
            ckpt(format!(
                "missing tensor `{name}` (looked in {})",
                self.files
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
    }

    /// A float tensor of an expected shape, widened exactly to f32 or kept as bf16 bytes.
    fn float(&self, name: &str, shape: &[usize]) -> Result<&TensorView<'a>> {
        let t = self.get(name)?;
        if t.shape() != shape {
            return Err(ckpt(format!(
                "tensor `{name}`: expected shape {shape:?}, found {:?}",
                t.shape()
            )));
        }
        if !matches!(t.dtype(), Dtype::BF16 | Dtype::F16 | Dtype::F32) {
            return Err(ckpt(format!(
                "tensor `{name}`: expected dtype BF16, F16 or F32, found {:?}",
                t.dtype()
            )));
        }
        Ok(t)
    }
}

/// The first element of a float tensor that is NaN or infinite.
fn first_nonfinite(t: &TensorView<'_>) -> Option<usize> {
    let d = t.data();
    match t.dtype() {
        Dtype::BF16 => d
            .chunks_exact(2)
            .position(|c| (u16::from_le_bytes([c[0], c[1]]) & 0x7F80) == 0x7F80),
        Dtype::F16 => d
            .chunks_exact(2)
            .position(|c| (u16::from_le_bytes([c[0], c[1]]) & 0x7C00) == 0x7C00),
        Dtype::F32 => d
            .chunks_exact(4)
            .position(|c| !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite()),
        _ => None,
    }
}

/// Refuse a tensor with a NaN or an infinity: its amax would skip or swallow it and the codes would
/// silently mean something else. `expert` names the expert when the tensor holds one (else the
/// expert is the index's leading part of `[E, ..]`, `per` elements each).
fn check_finite(name: &str, t: &TensorView<'_>, expert: Option<usize>, per: usize) -> Result<()> {
    let Some(k) = first_nonfinite(t) else {
        return Ok(());
    };
    let (e, at) = match expert {
        Some(e) => (e, k),
        None => (k / per.max(1), k % per.max(1)),
    };
    let shape: Vec<usize> = match expert {
        Some(_) => t.shape().to_vec(),
        None => t
            .shape()
            .get(1..)
            .map(<[usize]>::to_vec)
            .unwrap_or_default(),
    };
    let mut idx = vec![0usize; shape.len()];
    let mut r = at;
    for (j, &n) in shape.iter().enumerate().rev() {
        idx[j] = r % n.max(1);
        r /= n.max(1);
    }
    Err(ckpt(format!(
        "tensor `{name}`: expert {e} holds a non-finite value (NaN or infinity) at index {idx:?}; pass --allow-nonfinite to pack it anyway"
    )))
}

/// Append a tensor's data as bf16 (when `bf16` and the tensor is bf16) or as exact f32.
fn append(out: &mut Vec<u8>, t: &TensorView<'_>, bf16: bool) {
    let d = t.data();
    match (t.dtype(), bf16) {
        (Dtype::BF16, true) | (Dtype::F32, false) => out.extend_from_slice(d),
        (Dtype::BF16, false) => {
            for c in d.chunks_exact(2) {
                let x = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
        (Dtype::F16, _) => {
            for c in d.chunks_exact(2) {
                out.extend_from_slice(&f16_to_f32(u16::from_le_bytes([c[0], c[1]])).to_le_bytes());
            }
        }
        _ => {}
    }
}

/// Exact IEEE half -> single conversion.
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1F) as u32;
    let mant = (h & 0x3FF) as u32;
    let bits = match (exp, mant) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: normalize.
            let shift = m.leading_zeros() - 21;
            let m = (m << shift) & 0x3FF;
            sign | ((127 - 15 - shift + 1) << 23) | (m << 13)
        }
        (0x1F, m) => sign | (0xFF << 23) | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// The f16 bits of an f32 that an f16 represents exactly (a normal or subnormal f16 value, a zero,
/// an infinity); other values are truncated toward zero.
pub fn f32_to_f16_exact(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xFF) as i32;
    let mant = b & 0x7F_FFFF;
    if exp == 0xFF {
        return sign | 0x7C00 | if mant != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1F {
        return sign | 0x7C00;
    }
    if e > 0 {
        return sign | ((e as u16) << 10) | (mant >> 13) as u16;
    }
    // A subnormal f16: the value is m * 2^-24 with the implicit bit made explicit.
    if exp == 0 || e < -10 {
        return sign;
    }
    let full = mant | 0x80_0000;
    sign | (full >> (14 - e)) as u16
}

pub(crate) fn out_dtype(d: DType) -> Dtype {
    match d {
        DType::E2m1 | DType::U4 | DType::U8 => Dtype::U8,
        DType::E4m3 => Dtype::F8_E4M3,
        DType::E5m2 => Dtype::F8_E5M2,
        DType::E8m0 => Dtype::F8_E8M0,
        DType::I8 => Dtype::I8,
        DType::Bf16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        DType::F32 => Dtype::F32,
        DType::I32 => Dtype::I32,
    }
}

/// The gate, up and down projection names of a per-expert naming scheme, and the experts' prefix.
pub(crate) fn per_expert_names(
    form: Form,
    layer_prefix: &str,
) -> (&'static str, &'static str, &'static str, String) {
    match form {
        Form::Mixtral => (
            "w1",
            "w3",
            "w2",
            format!("{layer_prefix}.block_sparse_moe.experts"),
        ),
        _ => (
            "gate_proj",
            "up_proj",
            "down_proj",
            format!("{layer_prefix}.mlp.experts"),
        ),
    }
}

/// A layer's inputs, as byte buffers in the recipe's input names.
pub(crate) struct LayerInputs {
    pub(crate) dims: (usize, usize, usize),
    pub(crate) bufs: HashMap<String, Vec<u8>>,
    pub(crate) as_f32: bool,
    /// The first weight tensor that is not bf16 (what made `as_f32`), with its dtype.
    pub(crate) wide_from: Option<String>,
    pub(crate) input_bytes: usize,
}

fn gather_layer(
    src: &Source<'_>,
    layer: u32,
    form: Form,
    experts: &BTreeSet<u32>,
    allow_nonfinite: bool,
) -> Result<LayerInputs> {
    let p = format!("model.layers.{layer}");
    let (e, h, i, mut input_bytes);
    let wide_from: Option<String>;
    let mut w13 = Vec::new();
    let mut w2 = Vec::new();
    let as_f32;
    match form {
        Form::Fused => {
            let a = src.get(&format!("{p}.mlp.experts.w13_weight"))?;
            let [ne, two_i, hh] = a.shape()[..] else {
                return Err(ckpt(format!("tensor `{p}.mlp.experts.w13_weight`: expected 3 dimensions [E, 2*I, H], found {:?}", a.shape())));
            };
            (e, h, i) = (ne, hh, two_i / 2);
            let a = src.float(&format!("{p}.mlp.experts.w13_weight"), &[e, 2 * i, h])?;
            let b = src.float(&format!("{p}.mlp.experts.w2_weight"), &[e, h, i])?;
            if !allow_nonfinite {
                check_finite(&format!("{p}.mlp.experts.w13_weight"), a, None, 2 * i * h)?;
                check_finite(&format!("{p}.mlp.experts.w2_weight"), b, None, h * i)?;
            }
            as_f32 = a.dtype() != Dtype::BF16 || b.dtype() != Dtype::BF16;
            wide_from = [("w13_weight", a), ("w2_weight", b)]
                .iter()
                .find(|(_, t)| t.dtype() != Dtype::BF16)
                .map(|(n, t)| format!("`{p}.mlp.experts.{n}` ({:?})", t.dtype()));
            append(&mut w13, a, !as_f32);
            append(&mut w2, b, !as_f32);
            input_bytes = a.data().len() + b.data().len();
        }
        Form::Hf | Form::Mixtral => {
            let (g, u, d, base) = per_expert_names(form, &p);
            e = experts
                .iter()
                .next_back()
                .map(|x| *x as usize + 1)
                .unwrap_or(0);
            for k in 0..e as u32 {
                for w in [g, u, d] {
                    let name = format!("{base}.{k}.{w}.weight");
                    if !src.tensors.contains_key(&name) {
                        return Err(ckpt(format!("missing tensor `{name}`: layer {layer} has experts up to {} but not expert {k}'s `{w}`", e - 1)));
                    }
                }
            }
            let first = src.get(&format!("{base}.0.{g}.weight"))?;
            let [ii, hh] = first.shape()[..] else {
                return Err(ckpt(format!(
                    "tensor `{base}.0.{g}.weight`: expected 2 dimensions [I, H], found {:?}",
                    first.shape()
                )));
            };
            (h, i) = (hh, ii);
            let mut views = Vec::new();
            for k in 0..e {
                let gv = src.float(&format!("{base}.{k}.{g}.weight"), &[i, h])?;
                let uv = src.float(&format!("{base}.{k}.{u}.weight"), &[i, h])?;
                let dv = src.float(&format!("{base}.{k}.{d}.weight"), &[h, i])?;
                if !allow_nonfinite {
                    for (w, t) in [(g, gv), (u, uv), (d, dv)] {
                        check_finite(&format!("{base}.{k}.{w}.weight"), t, Some(k), 0)?;
                    }
                }
                views.push((gv, uv, dv));
            }
            as_f32 = views
                .iter()
                .any(|(a, b, c)| [a, b, c].iter().any(|t| t.dtype() != Dtype::BF16));
            wide_from = views.iter().enumerate().find_map(|(k, (a, b, c))| {
                [(g, a), (u, b), (d, c)]
                    .into_iter()
                    .find(|(_, t)| t.dtype() != Dtype::BF16)
                    .map(|(w, t)| format!("`{base}.{k}.{w}.weight` ({:?})", t.dtype()))
            });
            input_bytes = 0;
            for (gv, uv, dv) in &views {
                append(&mut w13, gv, !as_f32);
                append(&mut w13, uv, !as_f32);
                append(&mut w2, dv, !as_f32);
                input_bytes += gv.data().len() + uv.data().len() + dv.data().len();
            }
        }
    }
    let mut bufs = HashMap::new();
    bufs.insert("w13".to_string(), w13);
    bufs.insert("w2".to_string(), w2);
    // Calibrated activation scales, when the checkpoint has them.
    let scale = |name: &str| -> Result<Option<f32>> {
        match src.tensors.get(name) {
            None => Ok(None),
            Some((_, t)) => {
                if t.dtype() != Dtype::F32 || t.data().len() != 4 {
                    return Err(ckpt(format!(
                        "tensor `{name}`: expected an F32 scalar, found {:?} {:?}",
                        t.dtype(),
                        t.shape()
                    )));
                }
                let d = t.data();
                Ok(Some(f32::from_le_bytes([d[0], d[1], d[2], d[3]])))
            }
        }
    };
    let (s13, s2): (Vec<Option<f32>>, Vec<Option<f32>>) = match form {
        Form::Fused => {
            let v = |n: &str| -> Result<Option<Vec<f32>>> {
                match src.tensors.get(&format!("{p}.mlp.experts.{n}")) {
                    None => Ok(None),
                    Some((_, t)) => {
                        if t.dtype() != Dtype::F32 || t.shape() != [e] {
                            return Err(ckpt(format!(
                                "tensor `{p}.mlp.experts.{n}`: expected F32 [{e}], found {:?} {:?}",
                                t.dtype(),
                                t.shape()
                            )));
                        }
                        Ok(Some(
                            t.data()
                                .chunks_exact(4)
                                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                                .collect(),
                        ))
                    }
                }
            };
            let a = v("w13_input_scale")?
                .map(|x| x.into_iter().map(Some).collect())
                .unwrap_or_default();
            let b = v("w2_input_scale")?
                .map(|x| x.into_iter().map(Some).collect())
                .unwrap_or_default();
            (a, b)
        }
        _ => {
            let (g, u, d, base) = per_expert_names(form, &p);
            let mut a = Vec::new();
            let mut b = Vec::new();
            for k in 0..e {
                let gs = scale(&format!("{base}.{k}.{g}.input_scale"))?;
                let us = scale(&format!("{base}.{k}.{u}.input_scale"))?;
                a.push(match (gs, us) {
                    (Some(x), Some(y)) => Some(x.max(y)),
                    (x, y) => x.or(y),
                });
                b.push(scale(&format!("{base}.{k}.{d}.input_scale"))?);
            }
            (a, b)
        }
    };
    for (name, v) in [("w13_input_scale", s13), ("w2_input_scale", s2)] {
        if !v.is_empty() && v.iter().all(|x| x.is_some()) {
            let bytes: Vec<u8> = v
                .iter()
                .flat_map(|x| x.unwrap_or(0.0).to_le_bytes())
                .collect();
            bufs.insert(name.to_string(), bytes);
        } else if v.iter().any(|x| x.is_some()) {
            return Err(ckpt(format!(
                "layer {layer}: `{name}` is given for some experts but not all"
            )));
        }
    }
    Ok(LayerInputs {
        dims: (e, h, i),
        bufs,
        as_f32,
        wide_from,
        input_bytes,
    })
}

/// Pack checkpoints with a recipe.
pub fn pack(opts: &PackOptions) -> Result<PackReport> {
    let t0 = Instant::now();
    let mut files = Files { data: Vec::new() };
    let mut shard_paths: Vec<PathBuf> = Vec::new();
    for p in &opts.inputs {
        for f in crate::checkpoint::expand_input(p)? {
            if !shard_paths.contains(&f) {
                shard_paths.push(f);
            }
        }
    }
    let ranked = opts.topology != Topology::SINGLE;
    if ranked {
        check_topology(opts)?;
    }
    // The output is never an input (by path or inode) and never a device or directory.
    if ranked {
        for r in 0..opts.topology.world() {
            crate::check_output(&rank_path(&opts.output, r), &shard_paths)?;
        }
    } else if !opts.passthrough {
        crate::check_output(&opts.output, &shard_paths)?;
    }
    for p in &shard_paths {
        let bytes = std::fs::read(p).map_err(|e| Error::Io {
            path: p.display().to_string(),
            source: e,
        })?;
        files.data.push((p.clone(), bytes));
    }
    let src = Source::open(&files)?;
    let mut names: Vec<String> = src.tensors.keys().cloned().collect();
    names.sort();
    let idx = index_layers(&names)?;
    let layers: Vec<(u32, Form, BTreeSet<u32>)> = idx
        .forms
        .into_iter()
        .filter(|(l, _)| opts.layers.is_none_or(|(a, b)| *l >= a && *l <= b))
        .map(|(l, (f, e))| (l, f, e))
        .collect();
    if layers.is_empty() {
        return Err(ckpt(match opts.layers {
            Some((a, b)) => format!("no MoE expert weights for layers {a}-{b} in the input files"),
            None => "no MoE expert weights found (expected `model.layers.{L}.mlp.experts.{e}.gate_proj.weight`, `...block_sparse_moe.experts.{e}.w1.weight` or `...mlp.experts.w13_weight`)".into(),
        }));
    }
    // Check the recipe once, unbound, so recipe errors come first.
    let module = crate::dsl::compile(&opts.recipe_src)
        .map_err(|d| crate::recipe_error(&d, &opts.recipe_path, &opts.recipe_src))?;
    for need in ["E", "H", "I"] {
        if !module.dims.iter().any(|d| d.name == need) {
            return Err(Error::Usage(format!(
                "recipe `{}` must have dimensions E, H and I to pack a checkpoint",
                module.name
            )));
        }
    }
    let recipe_inputs: Vec<crate::prequant::RecipeInput> = module
        .tensors
        .iter()
        .filter_map(|t| match t.kind {
            TensorKind::Input { optional } => Some(crate::prequant::RecipeInput {
                name: t.name.clone(),
                dtype: t.dtype,
                rank: t.shape.len(),
                optional,
            }),
            _ => None,
        })
        .collect();
    // A recipe over bf16/f16/f32 weights reads `w13`/`w2` (and activation scales); a recipe over a
    // pre-quantized checkpoint reads `w13_*`/`w2_*` under ModelOpt's names.
    let prequantized = !recipe_inputs.iter().any(|x| x.name == "w13");
    for x in &recipe_inputs {
        let known = if prequantized {
            x.name.starts_with("w13_") || x.name.starts_with("w2_")
        } else {
            ["w13", "w2", "w13_input_scale", "w2_input_scale"].contains(&x.name.as_str())
        };
        if !known && !x.optional {
            return Err(Error::Usage(format!("recipe input `{}` has no checkpoint source (pack provides `w13`, `w2`, `w13_input_scale`, `w2_input_scale` from bf16/f16/f32 weights, or `w13_*` / `w2_*` from a pre-quantized checkpoint)", x.name)));
        }
    }
    let mut notes: Vec<String> = Vec::new();
    let hash = blake3::hash(opts.recipe_src.as_bytes())
        .to_hex()
        .to_string();
    if ranked {
        if prequantized {
            return Err(Error::Usage(format!(
                "--moe-tp/--ep split bf16/f16/f32 expert weights; recipe `{}` reads a pre-quantized checkpoint (pack it whole)",
                module.name
            )));
        }
        return pack_ranks(opts, &src, &layers, &module.name, hash, t0);
    }
    let bar = if opts.progress {
        indicatif::ProgressBar::new(layers.len() as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} packing layer {msg} [{bar:30}] {pos}/{len} {elapsed}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut out: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut layouts: HashMap<String, String> = HashMap::new();
    // Per packed tensor: the input shard that held its layer's experts (for --passthrough).
    let mut out_shard: Vec<usize> = Vec::new();
    let mut reports = Vec::new();
    type Key = (usize, usize, usize, bool, Vec<String>);
    enum Backend {
        Host(Box<crate::codegen::host::Compiled>),
        Gpu(crate::runtime::gpu_pack::GpuProgram),
    }
    let dev = if opts.gpu {
        Some(crate::runtime::Device::open(0)?)
    } else {
        None
    };
    let kcache = crate::runtime::Cache::new(opts.settings.runtime.cache_dir.clone());
    let mut cache: Option<(Key, crate::dsl::ModuleInfo, Backend)> = None;
    let mut binding = String::new();
    for (layer, form, experts) in &layers {
        bar.set_message(layer.to_string());
        let li = if prequantized {
            crate::prequant::gather(&src, *layer, *form, experts, &recipe_inputs, &mut notes)?
        } else {
            gather_layer(&src, *layer, *form, experts, opts.allow_nonfinite)?
        };
        let (e, h, i) = li.dims;
        binding = format!("E={e},H={h},I={i}");
        let mut present: Vec<String> = li.bufs.keys().cloned().collect();
        present.sort();
        let key = (e, h, i, li.as_f32, present.clone());
        if cache.as_ref().is_none_or(|c| c.0 != key) {
            let info = crate::verify_source(&opts.recipe_src, &opts.recipe_path, Some(&binding))?;
            let has = |n: &str| li.bufs.contains_key(n);
            let as_f32 = li.as_f32;
            // The host takes the 4-lane form of the program, the GPU the scalar one.
            let prog = crate::codegen::plan::plan_with(
                &info,
                &has,
                &|n: &str| as_f32 && (n == "w13" || n == "w2"),
                dev.is_none(),
            )
            .map_err(|err| match (&err, &li.wide_from) {
                (crate::codegen::Error::Unsupported { param, what }, Some(t))
                    if what.contains("changes the dtype") =>
                {
                    ckpt(format!(
                        "tensor {t} is not bf16, so layer {layer}'s weights are read as f32, but param `{param}` of recipe `{}` copies bf16 weights bit for bit; convert the checkpoint to one dtype or use a quantizing recipe",
                        module.name
                    ))
                }
                _ => crate::refusal(&info, err, &opts.recipe_path, &opts.recipe_src),
            })?;
            let backend = match &dev {
                Some(d) => Backend::Gpu(crate::runtime::gpu_pack::GpuProgram::load(
                    d,
                    &kcache,
                    &prog,
                    &opts.settings.runtime,
                )?),
                None => Backend::Host(Box::new(crate::codegen::host::compile_with(
                    &prog,
                    &opts.settings.host,
                )?)),
            };
            cache = Some((key, info, backend));
        }
        let Some((_, info, backend)) = &cache else {
            return Err(Error::Usage("internal: no compiled program".into()));
        };
        let t1 = Instant::now();
        let (prog, bufs): (&Program, Vec<Vec<u8>>) = match (backend, &dev) {
            (Backend::Host(compiled), _) => {
                let prog = compiled.program();
                let mut bufs =
                    crate::codegen::alloc_buffers(prog, &mut |n| li.bufs.get(n).cloned())?;
                compiled.run(&mut bufs, &crate::codegen::SingleProcess, opts.threads)?;
                (prog, bufs)
            }
            (Backend::Gpu(gp), Some(d)) => {
                let prog = gp.program();
                let mut dbufs = gp.alloc(d, &mut |n| li.bufs.get(n).cloned())?;
                gp.run(d, &mut dbufs)?;
                let params: HashMap<String, Vec<u8>> =
                    gp.download(d, &dbufs)?.into_iter().collect();
                let bufs = prog
                    .bufs
                    .iter()
                    .map(|b| match &b.role {
                        BufRole::Param(n) => params.get(n).cloned().unwrap_or_default(),
                        _ => Vec::new(),
                    })
                    .collect();
                (prog, bufs)
            }
            (Backend::Gpu(_), None) => {
                return Err(Error::Usage(
                    "internal: GPU program without a device".into(),
                ))
            }
        };
        let seconds = t1.elapsed().as_secs_f64();
        for t in layer_tensors(info, prog, bufs, *layer, &mut layouts)? {
            out_shard.push(layer_shard(&src, *layer));
            out.push(t);
        }
        reports.push(LayerReport {
            layer: *layer,
            dims: li.dims,
            input_bytes: li.input_bytes,
            seconds,
        });
        bar.inc(1);
    }
    bar.finish_and_clear();
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    meta.insert("moeforge.recipe".to_string(), module.name.clone());
    meta.insert("moeforge.recipe_blake3".to_string(), hash);
    meta.insert(
        "moeforge.version".to_string(),
        env!("CARGO_PKG_VERSION").to_string(),
    );
    meta.insert("moeforge.binding".to_string(), binding);
    // The recipe itself, so that later commands find the recipe of a packed file (custom ones too).
    meta.insert(
        "moeforge.recipe_source".to_string(),
        opts.recipe_src.clone(),
    );
    meta.extend(layouts);
    if opts.passthrough {
        let packed_layers: BTreeSet<u32> = layers.iter().map(|l| l.0).collect();
        let consumed =
            |name: &str| -> bool { expert_layer(name).is_some_and(|l| packed_layers.contains(&l)) };
        let shards: Vec<(PathBuf, &[u8])> = files
            .data
            .iter()
            .map(|(p, b)| (p.clone(), b.as_slice()))
            .collect();
        let packed: Vec<(usize, crate::checkpoint::Tensor)> =
            out_shard.into_iter().zip(out).collect();
        let written = crate::checkpoint::write_passthrough(
            &opts.output,
            &shards,
            &consumed,
            packed,
            &meta,
            &crate::checkpoint::extra_files(&opts.inputs),
        )?;
        return Ok(PackReport {
            layers: reports,
            output_bytes: written,
            seconds: t0.elapsed().as_secs_f64(),
            notes,
        });
    }
    let views: Vec<(String, TensorView<'_>)> = out
        .iter()
        .map(|(n, d, s, data)| {
            TensorView::new(*d, s.clone(), data)
                .map(|v| (n.clone(), v))
                .map_err(|e| ckpt(format!("tensor `{n}`: {e}")))
        })
        .collect::<Result<_>>()?;
    let bytes =
        safetensors::serialize(views, Some(meta)).map_err(|e| ckpt(format!("serializing: {e}")))?;
    crate::write_atomic(&opts.output, &bytes)?;
    Ok(PackReport {
        layers: reports,
        output_bytes: bytes.len(),
        seconds: t0.elapsed().as_secs_f64(),
        notes,
    })
}

/// Where rank `rank`'s file of a `--moe-tp`/`--ep` pack goes: `.rank{r}` inserted before the
/// output's extension (`out.safetensors` -> `out.rank0.safetensors`; `out` -> `out.rank0`).
pub fn rank_path(output: &Path, rank: usize) -> PathBuf {
    let name = match (output.file_stem(), output.extension()) {
        (Some(stem), Some(ext)) => format!(
            "{}.rank{rank}.{}",
            stem.to_string_lossy(),
            ext.to_string_lossy()
        ),
        _ => format!(
            "{}.rank{rank}",
            output
                .file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_else(|| "out".into())
        ),
    };
    output.with_file_name(name)
}

/// What a `--moe-tp`/`--ep` pack refuses before reading anything.
fn check_topology(opts: &PackOptions) -> Result<()> {
    let t = opts.topology;
    if t.ep == 0 || t.moe_tp == 0 {
        return Err(Error::Usage(format!(
            "--ep {} --moe-tp {}: each is a number of ranks, at least 1",
            t.ep, t.moe_tp
        )));
    }
    if opts.passthrough {
        return Err(Error::Usage(
            "--passthrough writes one checkpoint directory; it does not combine with --moe-tp/--ep (one file per rank)".into(),
        ));
    }
    if opts.gpu {
        crate::gpu_shards::check_gpus(t)?;
    }
    Ok(())
}

/// How rank slices of a layer are cut under `topo`, for the planner: w13 by rows over `moe_tp`
/// (two runs: the rank's gate rows, then the same up rows), w2 by columns; every expert-major
/// input by experts over `ep`. A group of one rank cuts nothing.
pub fn rank_sharding(topo: Topology) -> Sharding {
    let mut s = Sharding::unsplit();
    if topo.moe_tp > 1 {
        s = s.with_moe_tp("w13", 1, 2).with_moe_tp("w2", 2, 1);
    }
    if topo.ep > 1 {
        for n in ["w13", "w2", "w13_input_scale", "w2_input_scale"] {
            s = s.with_ep(n);
        }
    }
    s
}

/// Rank `rank`'s slice of a layer's whole inputs (`w13 [E, 2I, H]`, `w2 [E, H, I]` with `elem`
/// bytes per element, the activation scales `f32 [E]`) under `topo`: the experts
/// `[p*E/ep, (p+1)*E/ep)` of its EP rank `p = rank / moe_tp`, and for each, with `t = rank % moe_tp`
/// and `J = I/moe_tp`, the gate rows `[t*J, (t+1)*J)` followed by the same up rows, and w2's
/// columns `[t*J, (t+1)*J)`. `E` and `I` must divide by the group sizes ([`Error::Topology`]).
pub fn rank_slice(
    bufs: &HashMap<String, Vec<u8>>,
    (e, h, i): (usize, usize, usize),
    elem: usize,
    topo: Topology,
    rank: usize,
) -> Result<HashMap<String, Vec<u8>>> {
    let (ep, tp) = (topo.ep, topo.moe_tp);
    if ep == 0 || tp == 0 || rank >= topo.world() {
        return Err(Error::Topology(format!(
            "rank {rank} is not a rank of ep {ep} x moe_tp {tp}"
        )));
    }
    if e % ep != 0 {
        return Err(Error::Topology(format!(
            "--ep {ep} does not divide the {e} experts"
        )));
    }
    if i % tp != 0 {
        return Err(Error::Topology(format!(
            "--moe-tp {tp} does not divide the intermediate size I = {i}"
        )));
    }
    let (el, j) = (e / ep, i / tp);
    let (p, t) = (rank / tp, rank % tp);
    let experts = p * el..(p + 1) * el;
    let mut out = HashMap::new();
    for (name, b) in bufs {
        let want = match name.as_str() {
            "w13" => e * 2 * i * h * elem,
            "w2" => e * h * i * elem,
            "w13_input_scale" | "w2_input_scale" => e * 4,
            other => {
                return Err(Error::Topology(format!(
                    "input `{other}` has no rule for splitting it over ranks"
                )))
            }
        };
        if b.len() != want {
            return Err(Error::Usage(format!(
                "internal: input `{name}` holds {} bytes, expected {want}",
                b.len()
            )));
        }
        let mut v = Vec::new();
        match name.as_str() {
            "w13" => {
                let row = h * elem;
                for x in experts.clone() {
                    let base = x * 2 * i * row;
                    for half in [0, i] {
                        let lo = base + (half + t * j) * row;
                        v.extend_from_slice(&b[lo..lo + j * row]);
                    }
                }
            }
            "w2" => {
                for x in experts.clone() {
                    for r in 0..h {
                        let lo = ((x * h + r) * i + t * j) * elem;
                        v.extend_from_slice(&b[lo..lo + j * elem]);
                    }
                }
            }
            _ => v.extend_from_slice(&b[experts.start * 4..experts.end * 4]),
        }
        out.insert(name.clone(), v);
    }
    Ok(out)
}

/// The rank shape of a layer of whole shape `(E, H, I)` under `topo`, as a binding
/// (`E=E/ep,H=H,I=I/moe_tp`).
pub fn rank_binding(topo: Topology, (e, h, i): (usize, usize, usize)) -> Result<String> {
    let (ep, tp) = (topo.ep, topo.moe_tp);
    if ep == 0 || tp == 0 {
        return Err(Error::Usage(format!(
            "ep {ep} x moe_tp {tp}: each is a number of ranks, at least 1"
        )));
    }
    if e % ep != 0 {
        return Err(Error::Topology(format!(
            "--ep {ep} does not divide the {e} experts"
        )));
    }
    if i % tp != 0 {
        return Err(Error::Topology(format!(
            "--moe-tp {tp} does not divide the intermediate size I = {i}"
        )));
    }
    Ok(format!("E={},H={h},I={}", e / ep, i / tp))
}

/// The program every rank of `topo` runs for a layer of whole shape `dims`: the recipe verified at
/// the rank shape ([`rank_binding`]) and planned with [`rank_sharding`]`(topo)`, so that its
/// all-reduces make every scale the unsplit pack's. `present` names the inputs the layer has,
/// `as_f32` says its weights are read as f32; `x4` is the host backend's 4-lane form (the GPU runs
/// the scalar form, `x4 = false`; both pack the same bytes). The host ([`RankPacker`]) and the GPU
/// ranks ([`crate::gpu_shards`]) plan through this one function. Refused here, before any rank
/// runs: a size the rank count does not divide, a rank shape the recipe's `where` clauses do not
/// admit, a cut through a quantization block ([`crate::codegen::Error::CutBlock`]).
pub fn plan_rank(
    recipe_src: &str,
    recipe_path: &str,
    topo: Topology,
    dims: (usize, usize, usize),
    as_f32: bool,
    present: &[String],
    x4: bool,
) -> Result<(crate::dsl::ModuleInfo, Program)> {
    let bind = rank_binding(topo, dims)?;
    let (e, h, i) = dims;
    let info = crate::verify_source(recipe_src, recipe_path, Some(&bind)).map_err(|err| {
        Error::Topology(format!(
            "the rank shape {bind} (E={e},H={h},I={i} over ep {} x moe_tp {}) is not one the recipe admits:\n{err}",
            topo.ep, topo.moe_tp
        ))
    })?;
    let has = |n: &str| present.iter().any(|p| p == n);
    let prog = crate::codegen::plan::plan_sharded(
        &info,
        &has,
        &|n: &str| as_f32 && (n == "w13" || n == "w2"),
        x4,
        crate::codegen::plan::PackSchedule::default(),
        &rank_sharding(topo),
    )
    .map_err(|err| crate::refusal(&info, err, recipe_path, recipe_src))?;
    Ok((info, prog))
}

/// Packs layers for every rank of a topology: each rank a thread with its handle of one
/// [`InProcess`] world (so the all-reduce steps of the rank program run across the threads), its
/// compiled program kept for the next layer of the same shape.
pub struct RankPacker {
    recipe_src: String,
    recipe_path: String,
    topo: Topology,
    world: Vec<InProcess>,
    /// Threads per rank's kernels.
    threads: usize,
    host: crate::codegen::host::Options,
    /// The last rank shape planned: `(E, H, I, as_f32, inputs present)`, its module and program.
    planned: Option<(RankKey, crate::dsl::ModuleInfo, Program)>,
    /// Per rank: the program compiled last, with the program it was compiled from.
    compiled: Vec<Option<(Program, crate::codegen::host::Compiled)>>,
}

type RankKey = (usize, usize, usize, bool, Vec<String>);

/// One layer packed for every rank.
pub struct RankLayer<'a> {
    /// The recipe verified at the rank shape.
    pub info: &'a crate::dsl::ModuleInfo,
    /// The rank program (every rank runs this one).
    pub program: &'a Program,
    /// Per rank (world order), the program's buffers after it ran.
    pub bufs: Vec<Vec<Vec<u8>>>,
}

impl RankPacker {
    /// A packer for `topo`'s ranks with a recipe (`threads` host threads in all, 0: all cores).
    pub fn new(
        recipe_src: &str,
        recipe_path: &str,
        topo: Topology,
        threads: usize,
        host: &crate::codegen::host::Options,
    ) -> Result<RankPacker> {
        if topo.ep == 0 || topo.moe_tp == 0 {
            return Err(Error::Usage(format!(
                "ep {} x moe_tp {}: each is a number of ranks, at least 1",
                topo.ep, topo.moe_tp
            )));
        }
        let all = if threads == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        } else {
            threads
        };
        Ok(RankPacker {
            recipe_src: recipe_src.to_string(),
            recipe_path: recipe_path.to_string(),
            topo,
            world: InProcess::world(topo),
            threads: (all / topo.world()).max(1),
            host: host.clone(),
            planned: None,
            compiled: (0..topo.world()).map(|_| None).collect(),
        })
    }

    /// Plan (or reuse) the rank program for a layer ([`plan_rank`] in the host's 4-lane form).
    /// Everything a split can be refused for is refused here, before any rank runs.
    pub fn plan(
        &mut self,
        dims: (usize, usize, usize),
        as_f32: bool,
        present: &[String],
    ) -> Result<(&crate::dsl::ModuleInfo, &Program)> {
        let key: RankKey = (dims.0, dims.1, dims.2, as_f32, present.to_vec());
        if self.planned.as_ref().is_none_or(|p| p.0 != key) {
            let (info, prog) = plan_rank(
                &self.recipe_src,
                &self.recipe_path,
                self.topo,
                dims,
                as_f32,
                present,
                true,
            )?;
            self.planned = Some((key, info, prog));
        }
        let Some((_, info, prog)) = &self.planned else {
            return Err(Error::Usage("internal: no rank program".into()));
        };
        Ok((info, prog))
    }

    /// Pack one layer: split its whole inputs ([`rank_slice`]), plan ([`Self::plan`]), then run
    /// every rank's program on its own thread, together.
    pub fn pack_layer(
        &mut self,
        bufs: &HashMap<String, Vec<u8>>,
        dims: (usize, usize, usize),
        as_f32: bool,
    ) -> Result<RankLayer<'_>> {
        let mut present: Vec<String> = bufs.keys().cloned().collect();
        present.sort();
        self.plan(dims, as_f32, &present)?;
        let elem = if as_f32 { 4 } else { 2 };
        let slices: Vec<HashMap<String, Vec<u8>>> = (0..self.topo.world())
            .map(|r| rank_slice(bufs, dims, elem, self.topo, r))
            .collect::<Result<_>>()?;
        let Some((_, info, prog)) = &self.planned else {
            return Err(Error::Usage("internal: no rank program".into()));
        };
        let (threads, host) = (self.threads, &self.host);
        let results: Vec<Result<Vec<Vec<u8>>>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .world
                .iter()
                .zip(self.compiled.iter_mut())
                .zip(slices)
                .map(|((coll, slot), inputs)| {
                    s.spawn(move || -> Result<Vec<Vec<u8>>> {
                        if slot.as_ref().is_none_or(|c| &c.0 != prog) {
                            let c = crate::codegen::host::compile_with(prog, host)?;
                            *slot = Some((prog.clone(), c));
                        }
                        let Some((_, c)) = slot.as_ref() else {
                            return Err(Error::Usage("internal: no compiled program".into()));
                        };
                        let mut b =
                            crate::codegen::alloc_buffers(prog, &mut |n| inputs.get(n).cloned())?;
                        c.run(&mut b, &Hook(coll), threads)?;
                        Ok(b)
                    })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(r, h)| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::Usage(format!(
                            "internal: rank {r}'s thread panicked"
                        )))
                    })
                })
                .collect()
        });
        let bufs = results.into_iter().collect::<Result<Vec<_>>>()?;
        Ok(RankLayer {
            info,
            program: prog,
            bufs,
        })
    }
}

/// `pack --moe-tp T --ep N`: every layer packed for each of the `N*T` ranks (host threads, or one
/// GPU per rank with `opts.gpu`), one file per rank, all written or none.
fn pack_ranks(
    opts: &PackOptions,
    src: &Source<'_>,
    layers: &[(u32, Form, BTreeSet<u32>)],
    recipe: &str,
    hash: String,
    t0: Instant,
) -> Result<PackReport> {
    let topo = opts.topology;
    let world = topo.world();
    let bar = if opts.progress {
        indicatif::ProgressBar::new(layers.len() as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} packing layer {msg} for every rank [{bar:30}] {pos}/{len} {elapsed}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut out: Vec<Vec<OutTensor>> = (0..world).map(|_| Vec::new()).collect();
    let mut layouts: HashMap<String, String> = HashMap::new();
    let mut reports = Vec::new();
    let mut dims = (0, 0, 0);
    if opts.gpu {
        // What the layer in flight read, and when its packing began (`next` sets, `done` reads).
        let pending = std::cell::Cell::new(((0, 0, 0), 0usize));
        let t1 = std::cell::Cell::new(Instant::now());
        crate::gpu_shards::pack_layers(
            &opts.recipe_src,
            &opts.recipe_path,
            topo,
            &opts.settings.runtime,
            layers.len(),
            &mut |k| {
                let (layer, form, experts) = layers
                    .get(k)
                    .ok_or_else(|| Error::Usage("internal: no such layer".into()))?;
                bar.set_message(layer.to_string());
                let li = gather_layer(src, *layer, *form, experts, opts.allow_nonfinite)?;
                pending.set((li.dims, li.input_bytes));
                t1.set(Instant::now());
                Ok(crate::gpu_shards::WholeLayer {
                    bufs: li.bufs,
                    dims: li.dims,
                    as_f32: li.as_f32,
                })
            },
            &mut |k, info, program, bufs| {
                let seconds = t1.get().elapsed().as_secs_f64();
                let layer = layers
                    .get(k)
                    .map(|l| l.0)
                    .ok_or_else(|| Error::Usage("internal: no such layer".into()))?;
                for (r, b) in bufs.into_iter().enumerate() {
                    out[r].extend(layer_tensors(info, program, b, layer, &mut layouts)?);
                }
                let (d, input_bytes) = pending.get();
                dims = d;
                reports.push(LayerReport {
                    layer,
                    dims: d,
                    input_bytes,
                    seconds,
                });
                bar.inc(1);
                Ok(())
            },
        )?;
    } else {
        let mut packer = RankPacker::new(
            &opts.recipe_src,
            &opts.recipe_path,
            topo,
            opts.threads,
            &opts.settings.host,
        )?;
        for (layer, form, experts) in layers {
            bar.set_message(layer.to_string());
            let li = gather_layer(src, *layer, *form, experts, opts.allow_nonfinite)?;
            dims = li.dims;
            let t1 = Instant::now();
            let packed = packer.pack_layer(&li.bufs, li.dims, li.as_f32)?;
            let seconds = t1.elapsed().as_secs_f64();
            let RankLayer {
                info,
                program,
                bufs,
            } = packed;
            for (r, b) in bufs.into_iter().enumerate() {
                out[r].extend(layer_tensors(info, program, b, *layer, &mut layouts)?);
            }
            reports.push(LayerReport {
                layer: *layer,
                dims: li.dims,
                input_bytes: li.input_bytes,
                seconds,
            });
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    let (e, h, i) = dims;
    let (el, j) = (e / topo.ep, i / topo.moe_tp);
    let mut files: Vec<(PathBuf, Vec<u8>)> = Vec::new();
    for (r, tensors) in out.iter().enumerate() {
        let (p, t) = (r / topo.moe_tp, r % topo.moe_tp);
        let mut meta = HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        meta.insert("moeforge.recipe".to_string(), recipe.to_string());
        meta.insert("moeforge.recipe_blake3".to_string(), hash.clone());
        meta.insert(
            "moeforge.version".to_string(),
            env!("CARGO_PKG_VERSION").to_string(),
        );
        meta.insert(
            "moeforge.binding".to_string(),
            format!("E={el},H={h},I={j}"),
        );
        meta.insert(
            "moeforge.unsharded_binding".to_string(),
            format!("E={e},H={h},I={i}"),
        );
        meta.insert(
            "moeforge.recipe_source".to_string(),
            opts.recipe_src.clone(),
        );
        for (k, v) in [
            ("rank", r),
            ("ranks", world),
            ("moe_tp", topo.moe_tp),
            ("ep", topo.ep),
            ("moe_tp_rank", t),
            ("ep_rank", p),
        ] {
            meta.insert(format!("moeforge.{k}"), v.to_string());
        }
        meta.insert(
            "moeforge.experts".to_string(),
            format!("{}..{}", p * el, (p + 1) * el),
        );
        meta.insert(
            "moeforge.intermediate".to_string(),
            format!("{}..{}", t * j, (t + 1) * j),
        );
        meta.extend(layouts.clone());
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, d, s, data)| {
                TensorView::new(*d, s.clone(), data)
                    .map(|v| (n.clone(), v))
                    .map_err(|e| ckpt(format!("tensor `{n}`: {e}")))
            })
            .collect::<Result<_>>()?;
        let bytes = safetensors::serialize(views, Some(meta))
            .map_err(|e| ckpt(format!("serializing: {e}")))?;
        files.push((rank_path(&opts.output, r), bytes));
    }
    crate::write_all_atomic(&files)?;
    Ok(PackReport {
        layers: reports,
        output_bytes: files.iter().map(|f| f.1.len()).sum(),
        seconds: t0.elapsed().as_secs_f64(),
        notes: Vec::new(),
    })
}

/// One output tensor: name, dtype, shape, bytes.
type OutTensor = (String, Dtype, Vec<usize>, Vec<u8>);

/// The params a program packed for one layer (`bufs` as the program's buffers), as output tensors
/// named `model.layers.{L}.mlp.experts.{param}`, in program order. A param stored through a layout
/// other than row-major keeps its storage bytes under its logical shape, and its layout goes into
/// `layouts` (the metadata).
fn layer_tensors(
    info: &crate::dsl::ModuleInfo,
    prog: &Program,
    bufs: Vec<Vec<u8>>,
    layer: u32,
    layouts: &mut HashMap<String, String>,
) -> Result<Vec<OutTensor>> {
    let module = info.module();
    let mut out = Vec::new();
    for (b, data) in prog.bufs.iter().zip(bufs) {
        let BufRole::Param(pname) = &b.role else {
            continue;
        };
        let Some((t_id, t)) = module
            .tensors_with_ids()
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .find(|(_, t)| &t.name == pname && t.kind == TensorKind::Param)
        else {
            continue;
        };
        let mut shape: Vec<usize> = t
            .shape
            .iter()
            .map(|p| info.eval(p).unwrap_or(0) as usize)
            .collect();
        if t.dtype.is_packed4() {
            if let Some(last) = shape.last_mut() {
                *last /= 2;
            }
        }
        if let Some(pi) = info.params.iter().find(|p| p.id == t_id) {
            let b = info
                .binding()
                .ok_or_else(|| Error::Usage("internal: unbound module".into()))?;
            let map = crate::codegen::addr::StorageMap::of(&pi.layout, b)?;
            if !map.is_row_major() {
                layouts.insert(format!("moeforge.layout.{pname}"), map.to_string());
            }
        }
        // f16 params are computed as f32 buffers holding f16 values exactly (group-wise INT4's
        // f16 scales); they are written as f16.
        let data = if t.dtype == DType::F16 && b.elem == Elem::F32 {
            data.chunks_exact(4)
                .flat_map(|c| {
                    f32_to_f16_exact(f32::from_le_bytes([c[0], c[1], c[2], c[3]])).to_le_bytes()
                })
                .collect()
        } else {
            data
        };
        out.push((
            format!("model.layers.{layer}.mlp.experts.{pname}"),
            out_dtype(t.dtype),
            shape,
            data,
        ));
    }
    Ok(out)
}

/// The layer of an expert tensor (`model.layers.{L}.mlp.experts.*` or
/// `model.layers.{L}.block_sparse_moe.experts.*`): what a pack consumes.
fn expert_layer(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("model.layers.")?;
    let (l, rest) = rest.split_once('.')?;
    (rest.starts_with("mlp.experts.") || rest.starts_with("block_sparse_moe.experts."))
        .then(|| l.parse().ok())
        .flatten()
}

/// The input shard holding a layer's expert tensors (the first one found, by name).
fn layer_shard(src: &Source<'_>, layer: u32) -> usize {
    let mut names: Vec<(&String, usize)> = src
        .tensors
        .iter()
        .filter(|(n, _)| expert_layer(n) == Some(layer))
        .map(|(n, (k, _))| (n, *k))
        .collect();
    names.sort();
    names.first().map(|x| x.1).unwrap_or(0)
}

/// `moeforge inspect`: every tensor of a safetensors file with its dtype, shape and size, and the
/// metadata (recipe, its hash, moeforge version).
pub fn inspect(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|e| Error::Io {
        path: path.display().to_string(),
        source: e,
    })?;
    let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| {
        ckpt(format!(
            "{}: not a valid safetensors file ({e})",
            path.display()
        ))
    })?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| {
        ckpt(format!(
            "{}: not a valid safetensors file ({e})",
            path.display()
        ))
    })?;
    let mut out = String::new();
    if let Some(m) = meta.metadata() {
        let mut keys: Vec<(&String, &String)> = m.iter().collect();
        keys.sort();
        for (k, v) in keys {
            out.push_str(&format!("{k}: {v}\n"));
        }
        out.push('\n');
    }
    let mut tensors = st.tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let w = tensors.iter().map(|t| t.0.len()).max().unwrap_or(0);
    let mut total = 0usize;
    for (name, t) in &tensors {
        total += t.data().len();
        out.push_str(&format!(
            "{name:<w$}  {:<8}  {:?}  {} bytes\n",
            format!("{:?}", t.dtype()),
            t.shape(),
            t.data().len()
        ));
    }
    out.push_str(&format!("\n{} tensors, {total} bytes\n", tensors.len()));
    Ok(out)
}
