//! `moeforge moe run`: one MoE layer of a packed checkpoint run on the router's output (issue \[9\]
//! item 3), reading and writing safetensors files.
//!
//! The packed file (`moeforge pack` or `moeforge eplb apply` output) names its recipe in its
//! metadata (`moeforge.recipe_source`; `--recipe` overrides it); the recipe is verified at the
//! binding the layer's params hold, and the params are read through that verified module. With
//! `--placement`, the params are first placed exactly as `moeforge eplb apply` places them
//! ([`crate::eplb_apply::place`], in memory) and the tokens are routed through the placement's
//! `log2phy` (its `log2phy` when the file has one, else each expert's slots in ascending order).
//! The inputs are checked before anything runs (names, dtypes, shapes against the layer's `H`,
//! expert ids against the logical experts); any refusal is a named error and no output file. The
//! forward itself is [`crate::moe_host`]; the output is written atomically.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use crate::dsl::ir::{TensorId, TensorKind};
use crate::eplb_apply::{self, ApplyOptions};
use crate::moe_host::{self, Feed, MoeError, Replicas};
use crate::{Error, Result};

/// Where `moe run` computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The host reference path (what CI tests).
    Host,
    /// The generated kernels on GPU 0 (Hopper; bf16 and FP8 recipes): [`crate::moe_gpu_layer`].
    Gpu,
}

impl std::str::FromStr for Device {
    type Err = Error;
    fn from_str(s: &str) -> Result<Device> {
        match s {
            "host" => Ok(Device::Host),
            "gpu" => Ok(Device::Gpu),
            other => Err(Error::Usage(format!(
                "--device `{other}`: expected `host` or `gpu`"
            ))),
        }
    }
}

/// Options of [`run`].
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The packed checkpoint.
    pub packed: PathBuf,
    /// The inputs: `hidden_states`, `topk_ids`, `topk_weights`.
    pub inputs: PathBuf,
    /// The output file (written atomically).
    pub output: PathBuf,
    /// The MoE layer (needed when the file holds several).
    pub layer: Option<u32>,
    /// Where to compute.
    pub device: Device,
    /// An EPLB placement (`moeforge eplb plan --json` output) to place the params along first.
    pub placement: Option<PathBuf>,
    /// Also write `w13_out` and `act`.
    pub dump_intermediates: bool,
    /// `(file name, source)` of the recipe, overriding the file's `moeforge.recipe_source`.
    pub recipe: Option<(String, String)>,
    /// Host threads (0: one per core).
    pub threads: usize,
    /// The GPU runtime's settings (kernel cache, JIT), for `--device gpu`.
    pub settings: crate::runtime::Settings,
}

/// What [`run`] did.
#[derive(Debug, Clone)]
pub struct RunReport {
    /// The recipe's name.
    pub recipe: String,
    /// The layer run.
    pub layer: u32,
    /// Where it ran.
    pub device: Device,
    /// Tokens T.
    pub tokens: usize,
    /// Choices per token k.
    pub top_k: usize,
    /// Logical experts.
    pub experts: usize,
    /// Physical slots the params hold.
    pub slots: usize,
    /// The first and second GEMM's activation feeds.
    pub activation: (String, String),
    /// Bytes written.
    pub output_bytes: usize,
}

/// Metadata key of the output: a JSON object naming the recipe, layer, device and activation
/// feeds of the run (one key, so that the file's bytes are deterministic).
pub const META_RUN: &str = "moeforge.moe_run";

/// The largest inputs file read whole (bytes).
const INPUTS_LIMIT: u64 = 1 << 34;

fn dtype_name(d: Dtype) -> String {
    format!("{d:?}").to_lowercase()
}

/// An input tensor by name, with its dtype and rank checked.
fn input<'a>(
    st: &'a SafeTensors<'a>,
    file: &str,
    name: &str,
    dtype: Dtype,
    what: &str,
) -> Result<TensorView<'a>> {
    let v = st.tensor(name).map_err(|_| MoeError::MissingInput {
        file: file.into(),
        name: name.into(),
    })?;
    if v.dtype() != dtype {
        return Err(MoeError::InputDtype {
            name: name.into(),
            want: dtype_name(dtype),
            got: dtype_name(v.dtype()),
        }
        .into());
    }
    if v.shape().len() != 2 {
        return Err(MoeError::InputShape {
            name: name.into(),
            want: what.into(),
            got: v.shape().to_vec(),
        }
        .into());
    }
    Ok(v)
}

/// The rows of a placement file's `log2phy` for row `row` (experts -> slots, -1 padding dropped),
/// when it has one.
fn placement_log2phy(text: &str, row: usize) -> Result<Option<Vec<Vec<usize>>>> {
    let bad = |why: String| -> Error { MoeError::Placement(why).into() };
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| bad(format!("not JSON ({e})")))?;
    let Some(l2p) = v.get("log2phy") else {
        return Ok(None);
    };
    let layer = l2p
        .as_array()
        .and_then(|rows| rows.get(row))
        .and_then(|r| r.as_array())
        .ok_or_else(|| {
            bad(format!(
                "`log2phy` has no row {row} (one list per MoE layer)"
            ))
        })?;
    layer
        .iter()
        .enumerate()
        .map(|(e, slots)| {
            let slots = slots
                .as_array()
                .ok_or_else(|| bad(format!("`log2phy[{row}][{e}]` is not a list")))?;
            let mut out = Vec::new();
            for (rk, s) in slots.iter().enumerate() {
                match s.as_i64() {
                    Some(-1) => {}
                    Some(p) if p >= 0 => out.push(p as usize),
                    _ => {
                        return Err(bad(format!(
                            "`log2phy[{row}][{e}][{rk}]` = {s} is not a slot or -1"
                        )))
                    }
                }
            }
            Ok(out)
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// Run one MoE layer (see the module docs) and write `output` (and, with `dump_intermediates`,
/// `w13_out` and `act`) atomically.
pub fn run(opts: &RunOptions) -> Result<RunReport> {
    let mut reads = vec![opts.packed.clone(), opts.inputs.clone()];
    reads.extend(opts.placement.clone());
    crate::check_output(&opts.output, &reads)?;
    let file = opts.packed.display().to_string();
    let io = |path: &std::path::Path| {
        let path = path.display().to_string();
        move |e: std::io::Error| Error::Io { path, source: e }
    };

    // The inputs first: cheap to check, and nothing else needs them read.
    let in_file = opts.inputs.display().to_string();
    let in_bytes = {
        use std::io::Read as _;
        let f = std::fs::File::open(&opts.inputs).map_err(io(&opts.inputs))?;
        let mut b = Vec::new();
        f.take(INPUTS_LIMIT)
            .read_to_end(&mut b)
            .map_err(io(&opts.inputs))?;
        b
    };
    let ins = SafeTensors::deserialize(&in_bytes)
        .map_err(|e| Error::Checkpoint(format!("{in_file}: not a valid safetensors file ({e})")))?;

    // The packed params, placed first when asked.
    let packed_bytes = match &opts.placement {
        Some(p) => {
            let aopts = ApplyOptions {
                input: opts.packed.clone(),
                placement: p.clone(),
                output: opts.output.clone(),
                rank: None,
                recipe: opts.recipe.clone(),
            };
            eplb_apply::place(&aopts)?.0
        }
        None => std::fs::read(&opts.packed).map_err(io(&opts.packed))?,
    };
    let not_st = |e: safetensors::SafeTensorError| {
        Error::Checkpoint(format!("{file}: not a valid safetensors file ({e})"))
    };
    let (_, header) = SafeTensors::read_metadata(&packed_bytes).map_err(not_st)?;
    let st = SafeTensors::deserialize(&packed_bytes).map_err(not_st)?;
    let meta: HashMap<String, String> = header.metadata().clone().unwrap_or_default();
    let (recipe_path, recipe_src) = match (&opts.recipe, meta.get("moeforge.recipe_source")) {
        (Some((p, s)), _) => (p.clone(), s.clone()),
        (None, Some(s)) => (format!("{file}:moeforge.recipe_source"), s.clone()),
        (None, None) => {
            return Err(Error::Checkpoint(format!(
                "{file}: no `moeforge.recipe_source` metadata; pass --recipe with the recipe it was packed with"
            )))
        }
    };
    let module = crate::dsl::compile(&recipe_src)
        .map_err(|d| crate::recipe_error(&d, &recipe_path, &recipe_src))?;
    let recipe = module.name.clone();
    let registered: BTreeMap<String, TensorId> = module
        .tensors_with_ids()
        .filter(|(_, t)| t.kind == TensorKind::Param)
        .map(|(id, t)| (t.name.clone(), id))
        .collect();

    // The layer: every layer with a registered param in its experts.
    let layers = eplb_apply::packed_layers(&st.names(), &registered, false);
    let list = || {
        layers
            .keys()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let layer = match opts.layer {
        Some(l) if layers.contains_key(&l) => l,
        Some(l) => {
            return Err(MoeError::Layer(format!(
                "{file} has no packed MoE layer {l} of recipe `{recipe}` (it has: {})",
                if layers.is_empty() {
                    "none".into()
                } else {
                    list()
                }
            ))
            .into())
        }
        None => match layers.keys().collect::<Vec<_>>()[..] {
            [&l] => l,
            [] => {
                return Err(MoeError::Layer(format!(
                    "{file} has no packed MoE layer of recipe `{recipe}` (no tensor `model.layers.{{L}}.mlp.experts.{{param}}` for a param it registers)"
                ))
                .into())
            }
            _ => {
                return Err(MoeError::Layer(format!(
                    "{file} holds MoE layers {}; pass --layer",
                    list()
                ))
                .into())
            }
        },
    };
    let row = layers.keys().position(|&l| l == layer).unwrap_or(0);
    let ps = layers
        .get(&layer)
        .ok_or_else(|| MoeError::Layer(format!("no layer {layer}")))?;

    // The binding the params hold, verified; every param's stored shape and dtype checked.
    let slots = ps
        .values()
        .next()
        .and_then(|t| st.tensor(t).ok())
        .and_then(|v| v.shape().first().copied())
        .unwrap_or(0);
    let meta_binding = meta
        .get("moeforge.binding")
        .and_then(|b| crate::dsl::verify::parse_binding(b).ok())
        .unwrap_or_default();
    let b = eplb_apply::layer_binding(&module, &st, ps, &registered, slots, &meta_binding)?;
    let info = crate::verify_source(&recipe_src, &recipe_path, Some(&eplb_apply::describe(&b)))?;
    let mut params: HashMap<String, Vec<u8>> = HashMap::new();
    for (pname, tname) in ps {
        let Some(&id) = registered.get(pname) else {
            continue;
        };
        let Some(t) = module.tensor(id) else { continue };
        let v = st.tensor(tname).map_err(not_st)?;
        let want = eplb_apply::stored_shape(&info, id);
        let dtype = eplb_apply::stored_dtype(t.dtype);
        if want.as_deref() != Some(v.shape()) || v.dtype() != dtype {
            return Err(Error::Checkpoint(format!(
                "tensor `{tname}`: recipe `{recipe}` at {} gives {dtype:?} {want:?}, the file holds {:?} {:?}",
                eplb_apply::describe(&b),
                v.dtype(),
                v.shape()
            )));
        }
        params.insert(pname.clone(), v.data().to_vec());
    }
    let (_, h, i) = moe_host::dims(&info)?;

    // The logical experts and the slot each one's tokens run on.
    let replicas = match meta.get(eplb_apply::META_PHY2LOG) {
        None => Replicas::identity(slots),
        Some(rows) => {
            if meta.contains_key(eplb_apply::META_RANK) {
                return Err(MoeError::Placement(format!(
                    "{file} holds one rank's slots of a placement; moe run needs all of them"
                ))
                .into());
            }
            let rows: Vec<Vec<usize>> = serde_json::from_str(rows).map_err(|e| {
                MoeError::Placement(format!(
                    "`{}` is unreadable ({e})",
                    eplb_apply::META_PHY2LOG
                ))
            })?;
            let experts: usize = meta
                .get(eplb_apply::META_EXPERTS)
                .and_then(|x| x.parse().ok())
                .ok_or_else(|| MoeError::Placement(format!("no `{}`", eplb_apply::META_EXPERTS)))?;
            let phy2log = rows.get(row).ok_or_else(|| {
                MoeError::Placement(format!("no placement row for layer {layer}"))
            })?;
            let given = match &opts.placement {
                Some(p) => {
                    placement_log2phy(&crate::read_capped(p, eplb_apply::PLACEMENT_LIMIT)?, row)?
                }
                None => None,
            };
            match given {
                Some(l2p) if l2p.len() == experts => Replicas::new(l2p, phy2log)?,
                Some(l2p) => {
                    return Err(MoeError::Placement(format!(
                        "`log2phy` row {row} has {} experts, the placement {experts}",
                        l2p.len()
                    ))
                    .into())
                }
                None => Replicas::from_phy2log(phy2log, experts)?,
            }
        }
    };

    // The inputs, checked against the layer.
    let x = input(&ins, &in_file, "hidden_states", Dtype::BF16, "[T, H]")?;
    let ids = input(&ins, &in_file, "topk_ids", Dtype::I32, "[T, k]")?;
    let w = input(&ins, &in_file, "topk_weights", Dtype::F32, "[T, k]")?;
    let (t, hx) = (x.shape()[0], x.shape()[1]);
    if hx != h {
        return Err(MoeError::InputShape {
            name: "hidden_states".into(),
            want: format!("[T, {h}] (H = {h}: layer {layer}'s hidden size)"),
            got: x.shape().to_vec(),
        }
        .into());
    }
    let k = ids.shape()[1];
    if ids.shape()[0] != t {
        return Err(MoeError::InputShape {
            name: "topk_ids".into(),
            want: format!("[{t}, k] (T = {t} tokens, as hidden_states)"),
            got: ids.shape().to_vec(),
        }
        .into());
    }
    if w.shape() != [t, k] {
        return Err(MoeError::InputShape {
            name: "topk_weights".into(),
            want: format!("[{t}, {k}] (as topk_ids)"),
            got: w.shape().to_vec(),
        }
        .into());
    }
    let xs: Vec<u16> = x
        .data()
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect();
    let id_v: Vec<i32> = ids
        .data()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let w_v: Vec<f32> = w
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();

    let activation = (
        Feed::of(&info, "w13", &params)?.describe(),
        Feed::of(&info, "w2", &params)?.describe(),
    );
    let layer_ref = moe_host::Layer {
        info: &info,
        params: &params,
    };
    let tokens = moe_host::Tokens {
        x: &xs,
        ids: &id_v,
        weights: &w_v,
        t,
        k,
    };
    let fwd = match opts.device {
        Device::Host => moe_host::forward(&layer_ref, &tokens, &replicas, opts.threads)?,
        Device::Gpu => {
            // The ids are checked here as on the host (the device counts any it skips, too).
            moe_host::check_ids(&tokens, &replicas)?;
            crate::moe_gpu_layer::check_batch(t, k)?;
            // The operands first: a recipe the GPU layer does not run is refused before a device
            // is opened.
            let ops = crate::moe_gpu::operands(&layer_ref)?;
            crate::moe_gpu_layer::forward(
                &ops,
                &tokens,
                &replicas,
                &opts.settings,
                opts.dump_intermediates,
            )?
        }
    };

    let out_b: Vec<u8> = fwd.output.iter().flat_map(|v| v.to_le_bytes()).collect();
    let f32_bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> =
        vec![("output".into(), Dtype::BF16, vec![t, h], out_b)];
    if opts.dump_intermediates {
        tensors.push((
            "w13_out".into(),
            Dtype::F32,
            vec![t, k, 2 * i],
            f32_bytes(&fwd.w13_out),
        ));
        tensors.push(("act".into(), Dtype::F32, vec![t, k, i], f32_bytes(&fwd.act)));
    }
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, data)| {
            TensorView::new(*d, s.clone(), data)
                .map(|v| (n.clone(), v))
                .map_err(|e| Error::Checkpoint(format!("tensor `{n}`: {e}")))
        })
        .collect::<Result<_>>()?;
    // One metadata key, a JSON object (ordered keys): safetensors writes its metadata map in hash
    // order, so several keys would make the same run's bytes differ.
    let about = serde_json::json!({
        "recipe": recipe,
        "layer": layer,
        "device": match opts.device { Device::Host => "host", Device::Gpu => "gpu" },
        "activation": { "w13": activation.0, "w2": activation.1 },
    });
    let meta_out: HashMap<String, String> = [(META_RUN.to_string(), about.to_string())]
        .into_iter()
        .collect();
    let bytes = safetensors::serialize(views, Some(meta_out))
        .map_err(|e| Error::Checkpoint(format!("serializing: {e}")))?;
    crate::write_atomic(&opts.output, &bytes)?;
    Ok(RunReport {
        recipe,
        layer,
        device: opts.device,
        tokens: t,
        top_k: k,
        experts: replicas.experts(),
        slots,
        activation,
        output_bytes: bytes.len(),
    })
}
