//! Lowering a verified, bound recipe to a kernel-IR pack [`Program`].
//!
//! Each param's definition is matched against the forms a checkpoint packer needs: a quantization
//! output (values, scales, global / decode scale) read through an optional row gather and an optional
//! 128x4 swizzle; a copy of an input through an optional row gather; or per-expert f32 arithmetic over
//! earlier params, inputs and collective maxima (the alphas). Every quantization becomes an amax
//! reduction, a collective hook where the recipe names a group, and one quantize pass that writes every
//! output of that quantization. Index maps are generated from the CuTe layouts of the storage.
//!
//! Invariant the backends rely on: integer division and remainder are applied only to coordinates
//! (work-item indices and what division derives from them, rows, blocks), never to memory offsets.

use std::collections::HashMap;

use moeforge_dsl::ir::{DType, IndexVec, Op, QuantScheme, TensorId, TensorKind, ValueId};
use moeforge_dsl::roles::{self, Role};
use moeforge_dsl::ModuleInfo;

use crate::addr::StorageMap;

use crate::kir::{e, Buf, BufId, BufRole, Elem, Expr, Kernel, Program, Step, Ty, VarAlloc};
use crate::quant::Emit;
use crate::{Error, Result};

mod blocks;
mod copy;
mod fp8_block;
mod generic;
mod int4;
mod int8_groups;
mod mxfp4;
mod nvfp4;
mod quantize;
mod relayout;
mod rows;
mod sharding;
mod tensor_scaled;

pub use blocks::index_vec_expr;
use blocks::*;
use quantize::QuantCtx;
pub use sharding::{Shard, Sharding, Split};

/// The GPU form's tuning constants, in one place (the measured choices are in BENCHMARKS.md). The
/// host form ignores them where it loops instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackSchedule {
    /// Bytes per work item of a copy, and the longest relayout run (quantize passes' packed accesses
    /// are 16 bytes, the widest the GPU has).
    pub access_bytes: usize,
    /// 16-byte chunks of one expert per CTA of the per-expert amax pass.
    pub amax_slice_chunks: i64,
    /// Threads per CTA of the per-expert amax and the FP8 block passes.
    pub cta_threads: u32,
    /// NVFP4 16-value blocks per work item (a row apart, sharing the scale swizzle's arithmetic).
    pub nvfp4_blocks_per_item: i64,
    /// MXFP4 32-value blocks per work item.
    pub mxfp4_blocks_per_item: i64,
    /// Rows of fewer 8-element segments than this run one warp per row; longer rows one CTA.
    pub row_warp_below: i64,
    /// The most trips per thread for which a row's CTA size is picked to unroll its loop.
    pub row_max_trips: i64,
}

impl Default for PackSchedule {
    fn default() -> PackSchedule {
        PackSchedule {
            access_bytes: 16,
            amax_slice_chunks: 4096,
            cta_threads: 256,
            nvfp4_blocks_per_item: 4,
            mxfp4_blocks_per_item: 2,
            row_warp_below: 512,
            row_max_trips: 16,
        }
    }
}

/// Which optional inputs a checkpoint provides.
pub trait Presence {
    /// Whether the input `name` is available.
    fn has(&self, name: &str) -> bool;
}

impl<F: Fn(&str) -> bool> Presence for F {
    fn has(&self, name: &str) -> bool {
        self(name)
    }
}

#[derive(Debug, Clone, Default)]
struct QuantUse {
    values: Option<(TensorId, Option<IndexVec>)>,
    scales: Option<(TensorId, Option<IndexVec>)>,
    global: Option<TensorId>,
    decode: Option<TensorId>,
    zeros: Option<(TensorId, Option<IndexVec>)>,
}

struct QuantTemps {
    /// Per-expert (or per-tensor) f32 quantities: NVFP4's gs and 1/gs, FP8's scale.
    gs: Option<BufId>,
    decode: Option<BufId>,
    fp8_scale: Option<BufId>,
}

struct Planner<'a> {
    info: &'a ModuleInfo,
    prog: Program,
    inputs: HashMap<TensorId, BufId>,
    params: HashMap<TensorId, BufId>,
    quants: HashMap<ValueId, QuantTemps>,
    reduces: HashMap<ValueId, BufId>,
    /// NVFP4 scale params stored directly through a non-trivial storage map (byte by byte).
    scale_maps: HashMap<TensorId, StorageMap>,
    x4: bool,
    sched: PackSchedule,
    /// How this rank's inputs are cut (where amaxes are all-reduced, which cuts are refused).
    sharding: &'a Sharding,
}

/// A param the passes write row-major into a staging buffer, then copied into its storage layout
/// (with zero padding) by one relayout kernel.
struct Relayout {
    param: TensorId,
    staging: BufId,
    out: BufId,
    /// The unpadded value's shape (the staging buffer, row-major).
    value_shape: Vec<i64>,
    /// A row gather applied while reading (a copy relaid straight from its input).
    rows: Option<IndexVec>,
}

fn unsupported(param: &str, what: impl Into<String>) -> Error {
    Error::Unsupported {
        param: param.to_string(),
        what: what.into(),
    }
}

fn elem_of(d: DType) -> Option<Elem> {
    match d {
        DType::Bf16 => Some(Elem::Bf16),
        DType::F32 | DType::F16 => Some(Elem::F32),
        DType::E2m1
        | DType::U4
        | DType::E4m3
        | DType::E5m2
        | DType::E8m0
        | DType::I8
        | DType::U8 => Some(Elem::U8),
        DType::I32 => None,
    }
}

/// Lower a verified module, bound to a shape, to a pack program. Params that depend on an optional
/// input the checkpoint lacks are left out.
pub fn plan(info: &ModuleInfo, present: &dyn Presence) -> Result<Program> {
    plan_with(info, present, &|_: &str| false, false)
}

/// [`plan`], reading the inputs `as_f32` names as f32 buffers whatever their declared float type (a
/// checkpoint stored in f16 or f32 is widened exactly, never rounded to the declared bf16).
///
/// `x4` uses 4-lane vector IR in the hot loops (for the host backend; the PTX backend takes scalar
/// IR, where the GPU's threads are the parallelism).
pub fn plan_with(
    info: &ModuleInfo,
    present: &dyn Presence,
    as_f32: &dyn Fn(&str) -> bool,
    x4: bool,
) -> Result<Program> {
    plan_scheduled(info, present, as_f32, x4, PackSchedule::default())
}

/// [`plan_with`] under a given [`PackSchedule`] (for tuning experiments; the default is what the
/// benchmarks measured best).
pub fn plan_scheduled(
    info: &ModuleInfo,
    present: &dyn Presence,
    as_f32: &dyn Fn(&str) -> bool,
    x4: bool,
    sched: PackSchedule,
) -> Result<Program> {
    plan_sharded(info, present, as_f32, x4, sched, &Sharding::unsplit())
}

/// [`plan_scheduled`] for one rank of a sharded checkpoint: `info` is bound at the rank's shape
/// and `sharding` says how its inputs were cut from the whole ones. Each amax whose region a cut
/// splits is MAX-reduced over the cutting group before its scales are derived (per-expert amaxes
/// over `moe_tp` where the expert is split, a row's amax over `moe_tp` where its columns are, an
/// amax spanning experts over `ep` where they are divided), so that every rank's params equal the
/// unsharded pack's; a cut through a quantization block is refused ([`Error::CutBlock`]). With
/// [`Sharding::unsplit`] the program is the one [`plan_scheduled`] gives.
pub fn plan_sharded(
    info: &ModuleInfo,
    present: &dyn Presence,
    as_f32: &dyn Fn(&str) -> bool,
    x4: bool,
    sched: PackSchedule,
    sharding: &Sharding,
) -> Result<Program> {
    if info.binding().is_none() {
        return Err(Error::Unbound);
    }
    let m = info.module();
    let mut p = Planner {
        info,
        prog: Program {
            recipe: m.name.clone(),
            bufs: Vec::new(),
            steps: Vec::new(),
        },
        inputs: HashMap::new(),
        params: HashMap::new(),
        quants: HashMap::new(),
        reduces: HashMap::new(),
        scale_maps: HashMap::new(),
        x4,
        sched,
        sharding,
    };
    // Inputs first, in declaration order.
    for (id, t) in m.tensors_with_ids() {
        if let TensorKind::Input { optional } = t.kind {
            if optional && !present.has(&t.name) {
                continue;
            }
            let mut elem = elem_of(t.dtype)
                .ok_or_else(|| unsupported(&t.name, format!("{} inputs", t.dtype)))?;
            if t.dtype.is_wide_float() && as_f32(&t.name) {
                elem = Elem::F32;
            }
            let mut len = p.numel(&t.shape)?;
            if t.dtype.is_packed4() {
                len /= 2; // two codes per byte, as the checkpoint stores them
            }
            let b = p.buf(BufRole::Input(t.name.clone()), elem, len, false);
            p.inputs.insert(id, b);
        }
    }
    // What each param holds: one query on the verified module (`ModuleInfo::quantizations`).
    let quants = info.quantizations();
    let mut order: Vec<(TensorId, Option<ValueId>)> = Vec::new();
    // Each param's value before padding (`swizzle_128x4` and `pad` only pad: the layout is the
    // param's storage map).
    let mut unpadded: HashMap<TensorId, ValueId> = HashMap::new();
    for (id, t) in m.tensors_with_ids() {
        if t.kind != TensorKind::Param {
            continue;
        }
        if t.optional
            && !m
                .tensors_read_all(id)
                .iter()
                .all(|x| p.available(*x, present))
        {
            continue;
        }
        let v = t
            .value
            .ok_or_else(|| unsupported(&t.name, "a param without a definition"))?;
        let (v, _) = roles::unpadded(m, v);
        unpadded.insert(id, v);
        match info.role(id) {
            Role::Quantized { node, field, .. } => {
                let q = quants
                    .iter()
                    .find(|q| q.node == node)
                    .ok_or(Error::Internal("quantization of a param"))?;
                if !q.params().any(|x| x == id) {
                    return Err(unsupported(
                        &t.name,
                        format!(
                            "a second param holding `.{}` of one quantization",
                            field.name()
                        ),
                    ));
                }
                order.push((id, Some(node)));
            }
            _ => order.push((id, None)),
        }
    }
    let mut uses: HashMap<ValueId, QuantUse> = HashMap::new();
    for q in &quants {
        let kept = |o: &Option<roles::Output>| {
            o.as_ref()
                .filter(|o| order.iter().any(|x| x.0 == o.param))
                .cloned()
        };
        let scalar = |o: Option<roles::Output>| -> Result<Option<TensorId>> {
            match o {
                Some(o) if o.rows.is_some() || o.padded => {
                    let name = p.tensor(o.param)?.name.clone();
                    Err(unsupported(
                        &name,
                        "a row gather or padding of a per-expert global scale",
                    ))
                }
                o => Ok(o.map(|o| o.param)),
            }
        };
        uses.insert(
            q.node,
            QuantUse {
                values: kept(&q.values).map(|o| (o.param, o.rows)),
                scales: kept(&q.scales).map(|o| (o.param, o.rows)),
                global: scalar(kept(&q.global_scale))?,
                decode: scalar(kept(&q.decode_scale))?,
                zeros: kept(&q.zeros).map(|o| (o.param, o.rows)),
            },
        );
    }
    // NVFP4 block scales are stored one byte at a time: through any storage map, directly.
    let mut byte_direct: Vec<TensorId> = Vec::new();
    for (q, u) in &uses {
        if let (Op::Quant { scheme, .. }, Some((sid, _))) = (p.op(*q)?, &u.scales) {
            if matches!(scheme, QuantScheme::Nvfp4 { .. }) {
                byte_direct.push(*sid);
            }
        }
    }
    // Param buffers, in definition order. A param whose storage map is not the compact row-major
    // one of its value (a declared layout, a swizzle, padding) is written row-major to a staging
    // buffer and then relaid through its map, unless its pass stores through the map itself.
    let mut relayouts: Vec<Relayout> = Vec::new();
    let mut direct_copies: Vec<TensorId> = Vec::new();
    for (id, _) in &order {
        let t = p.tensor(*id)?.clone();
        let elem =
            elem_of(t.dtype).ok_or_else(|| unsupported(&t.name, format!("{} params", t.dtype)))?;
        let half = |n: usize| if t.dtype.is_packed4() { n / 2 } else { n };
        let len = half(p.numel(&t.shape)?);
        let name = t.name.clone();
        let fp4 = t.dtype.is_packed4();
        let b = p.buf(BufRole::Param(name.clone()), elem, len, false);
        let map = p.storage_map(*id)?;
        let v0 = unpadded
            .get(id)
            .copied()
            .ok_or(Error::Internal("param value"))?;
        let value_shape = p.shape(v0)?;
        let padded = value_shape != map.shape();
        if map.is_row_major() && !padded {
            p.params.insert(*id, b);
        } else if byte_direct.contains(id) {
            p.params.insert(*id, b);
            p.scale_maps.insert(*id, map);
        } else {
            if fp4 && map.halved().is_none() {
                return Err(unsupported(
                    &name,
                    "a 4-bit layout that splits a byte's pair of elements (the last dimension's innermost stride must be 1 over an even extent)",
                ));
            }
            // A copy of an input that no other param reads is relaid straight from the input
            // (through its row gather): no copy kernel, no staging buffer.
            if let Role::Copy { input, output } = info.role(*id) {
                let same = p.inputs.get(&input).copied().filter(|xb| {
                    p.prog.buf(*xb).map(|b| b.elem) == Some(elem)
                        && p.tensor(input).is_ok_and(|x| x.dtype == t.dtype)
                });
                let read_by_other = order
                    .iter()
                    .any(|(o, _)| o != id && m.tensors_read_all(*o).contains(id));
                if let (Some(xb), false) = (same, read_by_other) {
                    p.params.insert(*id, b);
                    direct_copies.push(*id);
                    relayouts.push(Relayout {
                        param: *id,
                        staging: xb,
                        out: b,
                        value_shape,
                        rows: output.rows,
                    });
                    continue;
                }
            }
            let n: i64 = value_shape.iter().product();
            let staging = p.buf(
                BufRole::Temp(format!("{name}_staged")),
                elem,
                half(usize::try_from(n).map_err(|_| Error::Internal("size"))?),
                false,
            );
            p.params.insert(*id, staging);
            relayouts.push(Relayout {
                param: *id,
                staging,
                out: b,
                value_shape,
                rows: None,
            });
        }
    }
    // Steps, in definition order; a quantization runs when its first output is reached.
    for (id, q) in order {
        match q {
            Some(q) => {
                if !p.quants.contains_key(&q) {
                    let u = uses.get(&q).cloned().unwrap_or_default();
                    p.quantize(q, &u)?;
                }
            }
            None if direct_copies.contains(&id) => {}
            None => p.other(id)?,
        }
    }
    for r in relayouts {
        p.relayout(&r)?;
    }
    Ok(p.prog)
}

trait ReadAll {
    fn tensors_read_all(&self, t: TensorId) -> Vec<TensorId>;
}

impl ReadAll for moeforge_dsl::Module {
    /// Every tensor a tensor's definition reads, transitively through lets and params.
    fn tensors_read_all(&self, t: TensorId) -> Vec<TensorId> {
        let mut out = Vec::new();
        let mut stack = vec![t];
        while let Some(x) = stack.pop() {
            let Some(tt) = self.tensor(x) else { continue };
            if let Some(v) = tt.value {
                for r in self.tensors_read(v) {
                    if !out.contains(&r) {
                        out.push(r);
                        stack.push(r);
                    }
                }
            }
        }
        out
    }
}

impl Planner<'_> {
    fn available(&self, t: TensorId, present: &dyn Presence) -> bool {
        match self.info.module().tensor(t) {
            Some(tt) => match tt.kind {
                TensorKind::Input { optional: true } => present.has(&tt.name),
                _ => true,
            },
            None => false,
        }
    }

    /// A param's verified storage map at the binding.
    fn storage_map(&self, id: TensorId) -> Result<StorageMap> {
        let pi = self
            .info
            .params
            .iter()
            .find(|x| x.id == id)
            .ok_or(Error::Internal("param without verified layout"))?;
        StorageMap::of(&pi.layout, self.info.binding().ok_or(Error::Unbound)?)
    }

    fn tensor(&self, id: TensorId) -> Result<&moeforge_dsl::ir::Tensor> {
        self.info
            .module()
            .tensor(id)
            .ok_or(Error::Internal("dangling tensor id"))
    }

    fn op(&self, v: ValueId) -> Result<Op> {
        Ok(self
            .info
            .module()
            .value(v)
            .ok_or(Error::Internal("dangling value id"))?
            .op
            .clone())
    }

    fn shape(&self, v: ValueId) -> Result<Vec<i64>> {
        let s = self
            .info
            .module()
            .value(v)
            .ok_or(Error::Internal("dangling value id"))?
            .shape
            .clone();
        s.iter().map(|p| self.int(p)).collect()
    }

    fn int(&self, p: &moeforge_dsl::poly::Poly) -> Result<i64> {
        self.info
            .eval(p)
            .and_then(|x| i64::try_from(x).ok())
            .ok_or(Error::Internal("size does not evaluate at the binding"))
    }

    fn numel(&self, s: &[moeforge_dsl::poly::Poly]) -> Result<usize> {
        let mut n: usize = 1;
        for p in s {
            n = n
                .checked_mul(
                    usize::try_from(self.int(p)?).map_err(|_| Error::Internal("negative size"))?,
                )
                .ok_or(Error::Internal("size overflow"))?;
        }
        Ok(n)
    }

    fn buf(&mut self, role: BufRole, elem: Elem, len: usize, zeroed: bool) -> BufId {
        self.prog.bufs.push(Buf {
            role,
            elem,
            len,
            zeroed,
        });
        BufId(self.prog.bufs.len() as u32 - 1)
    }

    fn strip_gather(&self, name: &str, v: ValueId) -> Result<(ValueId, Option<IndexVec>)> {
        match self.op(v)? {
            Op::Gather { base, dim, index } => {
                if dim != 1 {
                    return Err(unsupported(
                        name,
                        "a gather along a dimension other than the rows (1)",
                    ));
                }
                Ok((base, Some(index)))
            }
            _ => Ok((v, None)),
        }
    }

    fn kernel(
        &mut self,
        name: String,
        items: i64,
        f: impl FnOnce(&mut Emit<'_>, Expr) -> Result<()>,
    ) -> Result<()> {
        let mut va = VarAlloc::default();
        let item = va.new_var(Ty::I64);
        let body = {
            let mut em = Emit::new(&mut va);
            f(&mut em, e::v(item))?;
            em.out
        };
        let k: Kernel = va.kernel(name, item, items, body);
        self.prog.steps.push(Step::Kernel(k));
        Ok(())
    }

    /// A kernel run by `group` threads per work item (see [`Kernel::group`]).
    fn group_kernel(
        &mut self,
        name: String,
        items: i64,
        group: u32,
        f: impl FnOnce(&mut Emit<'_>, Expr) -> Result<()>,
    ) -> Result<()> {
        self.kernel(name, items, f)?;
        if let Some(Step::Kernel(k)) = self.prog.steps.last_mut() {
            k.group = group;
        }
        Ok(())
    }
}
