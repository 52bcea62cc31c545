//! `moeforge eplb apply`: a packed checkpoint laid out along an EPLB placement (issue \[6\] item 3).
//!
//! A placement (`moeforge eplb plan --json`'s `phy2log`, docs/FORMATS.md §6) gives, per MoE layer,
//! the logical expert each of `R` physical slots holds; `R >= E` (an expert may have replicas) and
//! every logical expert has at least one slot. [`apply`] writes every registered param of every MoE
//! layer (the recipe's move set, as the verifier derived it: weights, block scales, global scales,
//! alphas and activation scales alike) with `R` experts in slot order, slot `p` holding the bytes of
//! logical expert `phy2log[p]`; with a rank, only that rank's contiguous `R/P` slots. Nothing about a
//! param is taken from its name: which tensors move, and how many bytes make one expert, come from
//! the verified module. Views are not written (they alias params); the recipe is verified again with
//! the experts dimension bound to the output's slot count, so their index maps are re-checked over
//! the new storage. Tensors outside the MoE layers' experts pass through unchanged, and the output
//! is written atomically: any refusal leaves no file behind.
//!
//! A file that [`apply`] wrote can be placed again: its slots' logical experts are in its metadata
//! (`moeforge.eplb.*`), and each slot of the new placement copies a slot of the input that holds
//! its logical expert (an expert the input holds no replica of is an error, never skipped).

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use crate::codegen::addr::StorageMap;
use crate::dsl::ir::{DType, Module, TensorId, TensorKind};
use crate::dsl::ModuleInfo;
use crate::{Error, Result};

/// The largest placement file read (bytes).
pub const PLACEMENT_LIMIT: u64 = 64 << 20;

/// Metadata key of the placement (all `R` slots of every placed layer, as JSON `[[..], ..]`).
pub const META_PHY2LOG: &str = "moeforge.eplb.phy2log";
/// Metadata key of the MoE layers the placement's rows belong to (JSON list, in row order).
pub const META_LAYERS: &str = "moeforge.eplb.layers";
/// Metadata key of the logical expert count `E`.
pub const META_EXPERTS: &str = "moeforge.eplb.experts";
/// Metadata key of the slot count of each layer in this file (`R`, or `R/P` for one rank).
pub const META_SLOTS: &str = "moeforge.eplb.slots";
/// Metadata key of the rank this file holds (only for a rank's slice).
pub const META_RANK: &str = "moeforge.eplb.rank";
/// Metadata key of the number of ranks the slots are split among (only for a rank's slice).
pub const META_RANKS: &str = "moeforge.eplb.ranks";

/// Why a placement cannot be applied to a packed checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The placement file is not plan's JSON with a `phy2log` list of lists of integers.
    #[error("eplb apply: malformed placement {path}: {why} (expected `moeforge eplb plan --json` output: an object whose `phy2log` is one list of logical expert ids per MoE layer)")]
    MalformedPlacement {
        /// The file.
        path: String,
        /// What is wrong.
        why: String,
    },
    /// `phy2log` has a row count other than the file's MoE layer count.
    #[error("eplb apply: wrong row count: the placement has {rows} row(s) in `phy2log` but {file} has {layers} MoE layer(s) (layers {list}); give one row per MoE layer, in layer order")]
    RowCount {
        /// Rows in the placement.
        rows: usize,
        /// MoE layers in the file.
        layers: usize,
        /// The packed file.
        file: String,
        /// The layers, listed.
        list: String,
    },
    /// Rows of different lengths, or an empty row.
    #[error("eplb apply: ragged placement: row {row} of `phy2log` has {len} slot(s), row 0 has {first}; every layer needs the same slot count R >= 1")]
    RaggedRows {
        /// The row.
        row: usize,
        /// Its length.
        len: usize,
        /// The first row's length.
        first: usize,
    },
    /// A slot names a logical expert outside `[0, E)`.
    #[error("eplb apply: slot out of range: layer {layer}, slot {slot} holds logical expert {value}, outside [0, {experts})")]
    SlotOutOfRange {
        /// The layer.
        layer: u32,
        /// The slot.
        slot: usize,
        /// The value found.
        value: i64,
        /// The logical expert count.
        experts: usize,
    },
    /// A logical expert no slot holds.
    #[error("eplb apply: logical expert without replica: layer {layer}, expert {expert} is in no slot of the placement (every logical expert needs at least one)")]
    NoReplica {
        /// The layer.
        layer: u32,
        /// The expert.
        expert: usize,
    },
    /// A placed input (one rank's slots) holds no replica of an expert the new placement needs.
    #[error("eplb apply: expert not held: layer {layer}, slot {slot} needs logical expert {expert}, which no slot of the input holds (it holds {held})")]
    NotHeld {
        /// The layer.
        layer: u32,
        /// The slot.
        slot: usize,
        /// The expert.
        expert: usize,
        /// What the input holds.
        held: String,
    },
    /// The slot count does not divide among the ranks.
    #[error("eplb apply: slots not divisible by ranks: the placement has R = {slots} slots per layer, which do not divide among --ranks {ranks}")]
    RanksDoNotDivide {
        /// Slots per layer.
        slots: usize,
        /// Ranks.
        ranks: usize,
    },
    /// `--rank` is not below `--ranks`.
    #[error(
        "eplb apply: rank out of range: --rank {rank} with --ranks {ranks} (ranks are 0..{ranks})"
    )]
    RankOutOfRange {
        /// The rank.
        rank: usize,
        /// The ranks.
        ranks: usize,
    },
    /// The file does not say which recipe packed it, and none was given.
    #[error("eplb apply: no recipe: {file} has no `moeforge.recipe_source` metadata; pass --recipe with the recipe it was packed with")]
    NoRecipe {
        /// The packed file.
        file: String,
    },
    /// The verifier refuses the recipe with the experts dimension bound to the output's slot count.
    #[error("eplb apply: the verifier refuses recipe `{recipe}` at {binding} (the experts dimension bound to the output's slot count):\n{rendered}")]
    Refused {
        /// The recipe's name.
        recipe: String,
        /// The binding.
        binding: String,
        /// The rendered diagnostics.
        rendered: String,
    },
    /// A layer holds some of the move set but not all of it.
    #[error("eplb apply: incomplete move set: layer {layer} lacks registered param(s) {}; a placement moves every registered param or none", .missing.join(", "))]
    IncompleteMoveSet {
        /// The layer.
        layer: u32,
        /// The params not found.
        missing: Vec<String>,
    },
    /// A per-expert tensor of a placed layer that the recipe does not register.
    #[error("eplb apply: unregistered expert tensor `{name}`: recipe `{recipe}` does not register it, so placing layer {layer} would leave it on the old placement")]
    Unregistered {
        /// The tensor.
        name: String,
        /// The layer.
        layer: u32,
        /// The recipe.
        recipe: String,
    },
    /// A param whose per-expert bytes are not the same at the input's and the output's expert count.
    #[error("eplb apply: param `{param}` cannot be placed by copying experts: {why}")]
    ExpertLayout {
        /// The param.
        param: String,
        /// Why.
        why: String,
    },
    /// The input's `moeforge.eplb.*` metadata does not describe its tensors.
    #[error("eplb apply: {file}: inconsistent placement metadata: {why}")]
    PlacedMetadata {
        /// The packed file.
        file: String,
        /// What is wrong.
        why: String,
    },
}

/// Options of [`apply`].
#[derive(Debug, Clone)]
pub struct ApplyOptions {
    /// The packed checkpoint (one safetensors file, as `moeforge pack` writes it).
    pub input: PathBuf,
    /// The placement: `moeforge eplb plan --json` output (only `phy2log` is read).
    pub placement: PathBuf,
    /// The output file (written atomically).
    pub output: PathBuf,
    /// `(rank, ranks)`: keep only rank `rank`'s contiguous `R/ranks` slots.
    pub rank: Option<(usize, usize)>,
    /// `(file name, source)` of the recipe, overriding the file's `moeforge.recipe_source`.
    pub recipe: Option<(String, String)>,
}

/// What [`apply`] did.
#[derive(Debug, Clone)]
pub struct ApplyReport {
    /// The recipe's name.
    pub recipe: String,
    /// The MoE layers placed, in row order.
    pub layers: Vec<u32>,
    /// Logical experts per layer.
    pub experts: usize,
    /// Slots per layer in the placement (`R`).
    pub slots: usize,
    /// Slots per layer written (`R`, or `R/P` for one rank).
    pub written_slots: usize,
    /// Params written (over all layers).
    pub params: usize,
    /// Tensors passed through unchanged.
    pub passed: usize,
    /// Bytes written.
    pub output_bytes: usize,
}

fn malformed(path: &Path, why: impl Into<String>) -> Error {
    ApplyError::MalformedPlacement {
        path: path.display().to_string(),
        why: why.into(),
    }
    .into()
}

/// Parse a placement: plan's JSON object, of which only `phy2log` (a list of per-layer lists of
/// logical expert ids) is read. Ids are returned as read (a negative one is refused later, as out of
/// range); rows must all have the same, non-zero length.
pub fn parse_placement(text: &str, path: &Path) -> Result<Vec<Vec<i64>>> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| malformed(path, format!("not JSON ({e})")))?;
    let rows = v
        .as_object()
        .ok_or_else(|| malformed(path, "not a JSON object"))?
        .get("phy2log")
        .ok_or_else(|| malformed(path, "no `phy2log` key"))?
        .as_array()
        .ok_or_else(|| malformed(path, "`phy2log` is not a list"))?;
    let mut out = Vec::with_capacity(rows.len());
    for (l, row) in rows.iter().enumerate() {
        let row = row
            .as_array()
            .ok_or_else(|| malformed(path, format!("`phy2log[{l}]` is not a list")))?;
        let ids = row
            .iter()
            .enumerate()
            .map(|(p, x)| {
                x.as_i64().ok_or_else(|| {
                    malformed(path, format!("`phy2log[{l}][{p}]` = {x} is not an integer"))
                })
            })
            .collect::<Result<Vec<i64>>>()?;
        out.push(ids);
    }
    if let Some(first) = out.first() {
        for (row, r) in out.iter().enumerate() {
            if r.len() != first.len() || r.is_empty() {
                return Err(ApplyError::RaggedRows {
                    row,
                    len: r.len(),
                    first: first.len(),
                }
                .into());
            }
        }
    }
    Ok(out)
}

/// The slots `[lo, hi)` of a placement of `slots` slots that rank `rank` of `ranks` holds.
pub fn rank_slots(slots: usize, rank: Option<(usize, usize)>) -> Result<(usize, usize)> {
    let Some((rank, ranks)) = rank else {
        return Ok((0, slots));
    };
    if rank >= ranks {
        return Err(ApplyError::RankOutOfRange { rank, ranks }.into());
    }
    if !slots.is_multiple_of(ranks) {
        return Err(ApplyError::RanksDoNotDivide { slots, ranks }.into());
    }
    let per = slots / ranks;
    Ok((rank * per, (rank + 1) * per))
}

/// The dtype a param of `d` is stored as (what `moeforge pack` writes).
pub(crate) fn stored_dtype(d: DType) -> Dtype {
    crate::pack::out_dtype(d)
}

/// A param's stored shape at a verified binding (FP4's last dimension halved, two per byte).
pub(crate) fn stored_shape(info: &ModuleInfo, id: TensorId) -> Option<Vec<usize>> {
    let t = info.module().tensor(id)?;
    let mut shape = t
        .shape
        .iter()
        .map(|p| info.eval(p).and_then(|x| usize::try_from(x).ok()))
        .collect::<Option<Vec<usize>>>()?;
    if t.dtype.is_packed4() {
        if let Some(last) = shape.last_mut() {
            *last /= 2;
        }
    }
    Some(shape)
}

/// A tensor to write: name, dtype, shape, bytes (new, or borrowed from the input).
type OutTensor<'a> = (String, Dtype, Vec<usize>, Cow<'a, [u8]>);

/// A binding: `(dimension, value)` in declaration order.
pub(crate) type Dims = Vec<(String, i64)>;

/// The placed layers of a file: layer index -> (param name -> tensor name).
pub(crate) type Layers = BTreeMap<u32, BTreeMap<String, String>>;

/// The packed MoE layers among tensor names `names`: per layer, each param of `registered` that
/// the layer's experts hold, with its tensor name (`expert_tensor`); with `canonical`, only the
/// names pack writes, `model.layers.{L}.mlp.experts.{param}`.
pub(crate) fn packed_layers(
    names: &[&str],
    registered: &BTreeMap<String, TensorId>,
    canonical: bool,
) -> Layers {
    let mut names: Vec<&str> = names.to_vec();
    names.sort_unstable();
    let mut layers: Layers = BTreeMap::new();
    for n in names {
        if let Some((l, rest)) = expert_tensor(n) {
            if registered.contains_key(rest)
                && (!canonical || n.starts_with(&format!("model.layers.{l}.mlp.experts.")))
            {
                layers
                    .entry(l)
                    .or_default()
                    .insert(rest.to_string(), n.to_string());
            }
        }
    }
    layers
}

/// `model.layers.{L}.<ns>.experts.{rest}` -> `(L, rest)`.
pub(crate) fn expert_tensor(name: &str) -> Option<(u32, &str)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (l, rest) = rest.split_once('.')?;
    let rest = rest
        .strip_prefix("mlp.experts.")
        .or_else(|| rest.strip_prefix("block_sparse_moe.experts."))?;
    Some((l.parse().ok()?, rest))
}

/// The binding of one layer: every dimension that some param's shape holds as itself (the experts
/// dimension from the leading one), the others from the file's `moeforge.binding`.
pub(crate) fn layer_binding(
    m: &Module,
    st: &SafeTensors<'_>,
    params: &BTreeMap<String, String>,
    registered: &BTreeMap<String, TensorId>,
    experts: usize,
    meta_binding: &[(String, i64)],
) -> Result<Dims> {
    let mut found: HashMap<String, i64> = HashMap::new();
    for (pname, tname) in params {
        let (Some(&id), Ok(view)) = (registered.get(pname), st.tensor(tname)) else {
            continue;
        };
        let Some(t) = m.tensor(id) else { continue };
        let mut shape: Vec<i64> = view.shape().iter().map(|&x| x as i64).collect();
        if t.dtype.is_packed4() {
            if let Some(last) = shape.last_mut() {
                *last *= 2;
            }
        }
        for (p, &v) in t.shape.iter().zip(&shape) {
            for d in &m.dims {
                if !d.experts && *p == d.poly {
                    found.entry(d.name.clone()).or_insert(v);
                }
            }
        }
    }
    m.dims
        .iter()
        .map(|d| {
            let v = if d.experts {
                Some(experts as i64)
            } else {
                found.get(&d.name).copied().or_else(|| {
                    meta_binding
                        .iter()
                        .find(|(n, _)| n == &d.name)
                        .map(|x| x.1)
                })
            };
            v.map(|v| (d.name.clone(), v)).ok_or_else(|| {
                Error::Checkpoint(format!(
                    "no param shape holds dimension `{}` of recipe `{}` and the file has no `moeforge.binding` naming it",
                    d.name, m.name
                ))
            })
        })
        .collect()
}

pub(crate) fn describe(b: &[(String, i64)]) -> String {
    b.iter()
        .map(|(n, v)| format!("{n}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Check that expert `e`'s bytes of a param are the same function of its coordinates at both
/// bindings and for every `e`: the same bytes per expert, the same layout inside an expert, and a
/// swizzle (if any) that never mixes the expert's index into the offsets inside it.
fn check_expert_layout(
    name: &str,
    info_in: &ModuleInfo,
    info_out: &ModuleInfo,
    id: TensorId,
) -> Result<(usize, Option<String>)> {
    let err = |why: String| -> Error {
        ApplyError::ExpertLayout {
            param: name.to_string(),
            why,
        }
        .into()
    };
    let bytes = |info: &ModuleInfo| -> Option<i128> {
        let mv = info.move_set.iter().find(|e| e.param == id)?;
        info.bytes_per_expert(mv)
    };
    let (b_in, b_out) = (bytes(info_in), bytes(info_out));
    let b = match (b_in, b_out) {
        (Some(a), Some(b)) if a == b => usize::try_from(a).map_err(|_| err("bytes per expert out of range".into()))?,
        _ => {
            return Err(err(format!(
                "one expert is {b_in:?} bytes at the input's expert count and {b_out:?} at the output's"
            )))
        }
    };
    let map = |info: &ModuleInfo| -> Result<StorageMap> {
        let pi = info
            .params
            .iter()
            .find(|p| p.id == id)
            .ok_or_else(|| err("not a verified param".into()))?;
        let b = info
            .binding()
            .ok_or_else(|| err("the module is not bound".into()))?;
        Ok(StorageMap::of(&pi.layout, b)?)
    };
    let (a, o) = (map(info_in)?, map(info_out)?);
    let strides = |m: &StorageMap| -> Vec<i64> {
        m.modes
            .first()
            .map(|d| d.iter().map(|x| x.1).collect())
            .unwrap_or_default()
    };
    if a.modes.get(1..) != o.modes.get(1..)
        || a.offset != o.offset
        || a.swizzle != o.swizzle
        || strides(&a) != strides(&o)
    {
        return Err(err(format!(
            "its storage layout inside one expert changes with the expert count ({a} vs {o})"
        )));
    }
    if let Some(sw) = o.swizzle {
        // The swizzle permutes offsets inside aligned blocks of `period` elements: an expert that
        // is a whole number of blocks is permuted the same way in every slot.
        let per = info_out
            .params
            .iter()
            .find(|p| p.id == id)
            .and_then(|p| info_out.eval(&p.per_expert_elems))
            .unwrap_or(0);
        if per <= 0 || per % sw.period() as i128 != 0 {
            return Err(err(format!(
                "its swizzle {sw} permutes blocks of {} elements, which one expert ({per} elements) does not fill exactly, so its bytes depend on the slot",
                sw.period()
            )));
        }
    }
    let layout = (!o.is_row_major()).then(|| o.to_string());
    Ok((b, layout))
}

/// The logical expert each slot of the input holds, per placed layer: the identity for a file never
/// placed, else read back from its `moeforge.eplb.*` metadata. Also returns the logical expert count.
fn input_logical(
    meta: &HashMap<String, String>,
    file: &str,
    layers: &[u32],
    experts_in: &[usize],
) -> Result<(Vec<Vec<usize>>, usize)> {
    let Some(rows) = meta.get(META_PHY2LOG) else {
        let e = experts_in.first().copied().unwrap_or(0);
        if let Some(k) = experts_in.iter().position(|&x| x != e) {
            return Err(Error::Checkpoint(format!(
                "{file}: layer {} has {} experts, layer {} has {e}; a placement's rows need one expert count",
                layers[k], experts_in[k], layers[0]
            )));
        }
        return Ok((experts_in.iter().map(|&n| (0..n).collect()).collect(), e));
    };
    let bad = |why: String| -> Error {
        ApplyError::PlacedMetadata {
            file: file.to_string(),
            why,
        }
        .into()
    };
    let num = |k: &str| -> Result<Option<usize>> {
        meta.get(k)
            .map(|v| {
                v.parse::<usize>()
                    .map_err(|_| bad(format!("`{k}` = `{v}` is not a count")))
            })
            .transpose()
    };
    let rows: Vec<Vec<usize>> = serde_json::from_str(rows).map_err(|e| {
        bad(format!(
            "`{META_PHY2LOG}` is not a list of lists of ids ({e})"
        ))
    })?;
    let experts = num(META_EXPERTS)?.ok_or_else(|| bad(format!("no `{META_EXPERTS}`")))?;
    if let Some(l) = meta.get(META_LAYERS) {
        let ls: Vec<u32> = serde_json::from_str(l)
            .map_err(|e| bad(format!("`{META_LAYERS}` is not a list of layers ({e})")))?;
        if ls != layers {
            return Err(bad(format!(
                "`{META_LAYERS}` says {ls:?}, the file's MoE layers are {layers:?}"
            )));
        }
    }
    if rows.len() != layers.len() {
        return Err(bad(format!(
            "`{META_PHY2LOG}` has {} rows for {} MoE layers",
            rows.len(),
            layers.len()
        )));
    }
    let rank = match (num(META_RANK)?, num(META_RANKS)?) {
        (Some(r), Some(p)) => Some((r, p)),
        (None, None) => None,
        _ => {
            return Err(bad(format!(
                "`{META_RANK}` without `{META_RANKS}` or the other way"
            )))
        }
    };
    let mut held = Vec::new();
    for ((row, &n), &layer) in rows.iter().zip(experts_in).zip(layers) {
        let (lo, hi) = rank_slots(row.len(), rank).map_err(|e| bad(e.to_string()))?;
        if hi - lo != n {
            return Err(bad(format!(
                "layer {layer} holds {n} slots, its placement row gives {}",
                hi - lo
            )));
        }
        if let Some(x) = row.iter().find(|&&x| x >= experts) {
            return Err(bad(format!(
                "layer {layer}'s row names expert {x} of {experts}"
            )));
        }
        held.push(row[lo..hi].to_vec());
    }
    Ok((held, experts))
}

/// Lay a packed checkpoint out along an EPLB placement (see the module docs): read, check, copy each
/// registered param's experts into slot order, re-verify at the new expert count, write atomically.
pub fn apply(opts: &ApplyOptions) -> Result<ApplyReport> {
    crate::check_output(&opts.output, &[opts.input.clone(), opts.placement.clone()])?;
    let (bytes, report) = place(opts)?;
    crate::write_atomic(&opts.output, &bytes)?;
    Ok(report)
}

/// What [`apply`] writes, in memory: the placed file's safetensors bytes and the report
/// (`opts.output` is not read). `moeforge moe run --placement` runs the layer on these bytes.
pub fn place(opts: &ApplyOptions) -> Result<(Vec<u8>, ApplyReport)> {
    let file = opts.input.display().to_string();
    let text = crate::read_capped(&opts.placement, PLACEMENT_LIMIT)?;
    let phy2log = parse_placement(&text, &opts.placement)?;
    let bytes = std::fs::read(&opts.input).map_err(|e| Error::Io {
        path: file.clone(),
        source: e,
    })?;
    let not_st = |e: safetensors::SafeTensorError| {
        Error::Checkpoint(format!("{file}: not a valid safetensors file ({e})"))
    };
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(not_st)?;
    let st = SafeTensors::deserialize(&bytes).map_err(not_st)?;
    let meta: HashMap<String, String> = header.metadata().clone().unwrap_or_default();
    let (recipe_path, recipe_src) = match (&opts.recipe, meta.get("moeforge.recipe_source")) {
        (Some((p, s)), _) => (p.clone(), s.clone()),
        (None, Some(s)) => (format!("{file}:moeforge.recipe_source"), s.clone()),
        (None, None) => return Err(ApplyError::NoRecipe { file }.into()),
    };
    let module = crate::dsl::compile(&recipe_src)
        .map_err(|d| crate::recipe_error(&d, &recipe_path, &recipe_src))?;
    let recipe = module.name.clone();
    let Some(edim) = module.experts_dim() else {
        return Err(Error::Usage(format!(
            "recipe `{recipe}` has no experts dimension (`E: experts`): it has nothing to place"
        )));
    };
    let edim = edim.name.clone();
    // The registered params (a later definition of a name shadows an input of that name); what
    // one expert of each is comes from the move set the verifier derives at each binding below.
    let registered: BTreeMap<String, TensorId> = module
        .tensors_with_ids()
        .filter(|(_, t)| t.kind == TensorKind::Param)
        .map(|(id, t)| (t.name.clone(), id))
        .collect();

    // The placed layers: every layer with a registered param in its experts.
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    let layers = packed_layers(&st.names(), &registered, true);
    if layers.is_empty() {
        return Err(Error::Checkpoint(format!(
            "{file}: no packed MoE layer (no tensor `model.layers.{{L}}.mlp.experts.{{param}}` for a param that recipe `{recipe}` registers)"
        )));
    }
    let layer_ids: Vec<u32> = layers.keys().copied().collect();
    if phy2log.len() != layers.len() {
        return Err(ApplyError::RowCount {
            rows: phy2log.len(),
            layers: layers.len(),
            file,
            list: layer_ids
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", "),
        }
        .into());
    }
    let slots = phy2log.first().map(Vec::len).unwrap_or(0);
    let (lo, hi) = rank_slots(slots, opts.rank)?;
    let out_slots = hi - lo;
    // Nothing else in a placed layer's experts: it would stay on the old placement.
    for n in &names {
        if let Some((l, rest)) = expert_tensor(n) {
            let placed = layers
                .get(&l)
                .is_some_and(|ps| ps.get(rest).is_some_and(|t| t == n));
            if layers.contains_key(&l) && !placed {
                return Err(ApplyError::Unregistered {
                    name: n.clone(),
                    layer: l,
                    recipe,
                }
                .into());
            }
        }
    }
    // The whole move set or nothing, per layer (optional params exist only where the checkpoint had
    // their inputs; one of them present makes them all required), as the parameter store demands.
    for (&l, ps) in &layers {
        let given = |n: &str| ps.contains_key(n);
        let tensor = |id: &TensorId| module.tensor(*id);
        let any_optional = registered
            .iter()
            .any(|(n, id)| given(n) && tensor(id).is_some_and(|t| t.optional));
        let missing: Vec<String> = registered
            .iter()
            .filter(|(n, id)| !given(n) && tensor(id).is_some_and(|t| !t.optional || any_optional))
            .map(|(n, _)| format!("`{n}`"))
            .collect();
        if !missing.is_empty() {
            return Err(ApplyError::IncompleteMoveSet { layer: l, missing }.into());
        }
    }
    // Experts per layer in the input: the leading dimension every param shares.
    let mut experts_in = Vec::new();
    for (&l, ps) in &layers {
        let mut e: Option<(usize, &str)> = None;
        for t in ps.values() {
            let view = st.tensor(t).map_err(not_st)?;
            let lead = view.shape().first().copied().unwrap_or(0);
            match e {
                None => e = Some((lead, t)),
                Some((x, first)) if x != lead => {
                    return Err(Error::Checkpoint(format!(
                        "layer {l}: tensor `{t}` has {lead} experts, `{first}` has {x}"
                    )))
                }
                _ => {}
            }
        }
        experts_in.push(e.map(|x| x.0).unwrap_or(0));
    }
    let (held, experts) = input_logical(&meta, &file, &layer_ids, &experts_in)?;
    // The placement, checked against the logical experts, and each output slot's input slot.
    let mut sources: Vec<Vec<usize>> = Vec::new();
    for ((row, &layer), held) in phy2log.iter().zip(&layer_ids).zip(&held) {
        let mut seen = vec![false; experts];
        for (slot, &v) in row.iter().enumerate() {
            let e = usize::try_from(v).ok().filter(|&e| e < experts).ok_or(
                ApplyError::SlotOutOfRange {
                    layer,
                    slot,
                    value: v,
                    experts,
                },
            )?;
            seen[e] = true;
        }
        if let Some(expert) = seen.iter().position(|s| !s) {
            return Err(ApplyError::NoReplica { layer, expert }.into());
        }
        let mut src = Vec::with_capacity(out_slots);
        for (slot, &v) in row.iter().enumerate().take(hi).skip(lo) {
            let expert = v as usize;
            let q = held.iter().position(|&x| x == expert).ok_or_else(|| {
                let set: BTreeSet<&usize> = held.iter().collect();
                ApplyError::NotHeld {
                    layer,
                    slot,
                    expert,
                    held: format!("logical experts {set:?}"),
                }
            })?;
            src.push(q);
        }
        sources.push(src);
    }

    // Per layer: verify at the input's binding (the file's tensors must be what it says) and at the
    // output's (views re-checked over the new storage), then copy experts into slot order.
    let meta_binding = meta
        .get("moeforge.binding")
        .and_then(|b| crate::dsl::verify::parse_binding(b).ok())
        .unwrap_or_default();
    // Placed params are new bytes; everything else is borrowed from the input as it is.
    let mut out: Vec<OutTensor<'_>> = Vec::new();
    let mut layouts: BTreeMap<String, String> = BTreeMap::new();
    let mut binding_out = String::new();
    // The last binding verified, at the input's expert count and at the output's.
    let mut cache: Option<(Dims, ModuleInfo, ModuleInfo)> = None;
    for ((ps, src), &e_in) in layers.values().zip(&sources).zip(&experts_in) {
        let b_in = layer_binding(&module, &st, ps, &registered, e_in, &meta_binding)?;
        if cache.as_ref().is_none_or(|c| c.0 != b_in) {
            let info_in = crate::verify_source(&recipe_src, &recipe_path, Some(&describe(&b_in)))?;
            let b_out: Dims = b_in
                .iter()
                .map(|(n, v)| (n.clone(), if *n == edim { out_slots as i64 } else { *v }))
                .collect();
            let info_out = crate::dsl::check(&recipe_src, Some(&b_out)).map_err(|d| {
                let rendered = match crate::recipe_error(&d, &recipe_path, &recipe_src) {
                    Error::Recipe { rendered, .. } => rendered,
                    other => other.to_string(),
                };
                ApplyError::Refused {
                    recipe: recipe.clone(),
                    binding: describe(&b_out),
                    rendered,
                }
            })?;
            binding_out = describe(&b_out);
            cache = Some((b_in, info_in, info_out));
        }
        let Some((_, info_in, info_out)) = &cache else {
            return Err(Error::Usage("internal: no verified module".into()));
        };
        for (pname, tname) in ps {
            let Some(&id) = registered.get(pname) else {
                continue;
            };
            let t = module
                .tensor(id)
                .ok_or_else(|| Error::Usage(format!("internal: no tensor `{pname}`")))?;
            let view = st.tensor(tname).map_err(not_st)?;
            let want = stored_shape(info_in, id);
            let dtype = stored_dtype(t.dtype);
            if want.as_deref() != Some(view.shape()) || view.dtype() != dtype {
                return Err(Error::Checkpoint(format!(
                    "tensor `{tname}`: recipe `{recipe}` at {} gives {dtype:?} {want:?}, the file holds {:?} {:?}",
                    describe(&info_in.binding().map(|b| b.dims.clone()).unwrap_or_default()),
                    view.dtype(),
                    view.shape()
                )));
            }
            let (b, layout) = check_expert_layout(pname, info_in, info_out, id)?;
            let data = view.data();
            if data.len() != b * e_in {
                return Err(Error::Checkpoint(format!(
                    "tensor `{tname}`: {} bytes, not {e_in} experts of {b}",
                    data.len()
                )));
            }
            let mut bytes_out = Vec::with_capacity(b * out_slots);
            for &q in src {
                let expert = data
                    .get(q * b..(q + 1) * b)
                    .ok_or_else(|| Error::Checkpoint(format!("tensor `{tname}`: no expert {q}")))?;
                bytes_out.extend_from_slice(expert);
            }
            let shape = stored_shape(info_out, id).ok_or_else(|| {
                Error::Usage(format!("internal: `{pname}` has no shape at {binding_out}"))
            })?;
            if let Some(l) = layout {
                layouts.insert(format!("moeforge.layout.{pname}"), l);
            }
            out.push((tname.clone(), dtype, shape, Cow::Owned(bytes_out)));
        }
    }
    let params = out.len();
    // Everything else passes through unchanged.
    let placed: BTreeSet<&String> = layers.values().flat_map(|ps| ps.values()).collect();
    let mut passed = 0;
    for n in &names {
        if placed.contains(n) {
            continue;
        }
        let v = st.tensor(n).map_err(not_st)?;
        out.push((
            n.clone(),
            v.dtype(),
            v.shape().to_vec(),
            Cow::Borrowed(v.data()),
        ));
        passed += 1;
    }

    let mut meta_out: HashMap<String, String> = meta
        .into_iter()
        .filter(|(k, _)| !k.starts_with("moeforge.layout.") && !k.starts_with("moeforge.eplb."))
        .collect();
    meta_out.extend(layouts);
    meta_out.insert("format".into(), "pt".into());
    meta_out.insert("moeforge.recipe".into(), recipe.clone());
    meta_out.insert(
        "moeforge.recipe_blake3".into(),
        blake3::hash(recipe_src.as_bytes()).to_hex().to_string(),
    );
    meta_out.insert("moeforge.recipe_source".into(), recipe_src);
    meta_out.insert(
        "moeforge.version".into(),
        env!("CARGO_PKG_VERSION").to_string(),
    );
    meta_out.insert("moeforge.binding".into(), binding_out);
    meta_out.insert(META_PHY2LOG.into(), serde_json::json!(phy2log).to_string());
    meta_out.insert(META_LAYERS.into(), serde_json::json!(layer_ids).to_string());
    meta_out.insert(META_EXPERTS.into(), experts.to_string());
    meta_out.insert(META_SLOTS.into(), out_slots.to_string());
    if let Some((r, p)) = opts.rank {
        meta_out.insert(META_RANK.into(), r.to_string());
        meta_out.insert(META_RANKS.into(), p.to_string());
    }
    let views: Vec<(String, TensorView<'_>)> = out
        .iter()
        .map(|(n, d, s, data)| {
            TensorView::new(*d, s.clone(), data)
                .map(|v| (n.clone(), v))
                .map_err(|e| Error::Checkpoint(format!("tensor `{n}`: {e}")))
        })
        .collect::<Result<_>>()?;
    let bytes = safetensors::serialize(views, Some(meta_out))
        .map_err(|e| Error::Checkpoint(format!("serializing: {e}")))?;
    let report = ApplyReport {
        recipe,
        layers: layer_ids,
        experts,
        slots,
        written_slots: out_slots,
        params,
        passed,
        output_bytes: bytes.len(),
    };
    Ok((bytes, report))
}
