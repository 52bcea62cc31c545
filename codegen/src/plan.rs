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

use moeforge_dsl::ir::{
    AmaxGranularity, Arith, DType, Fp8Granularity, Group, IndexVec, Op, QuantField, QuantScheme,
    TensorId, TensorKind, ValueId,
};
use moeforge_dsl::roles::{self, Role};
use moeforge_dsl::ModuleInfo;

use crate::addr::StorageMap;

use crate::kir::{
    e, BinOp, Buf, BufId, BufRole, Elem, Expr, GroupRow, Kernel, Program, Step, Stmt, Ty, UnOp,
    VarAlloc,
};
use crate::quant::{self, clamp, fabs, fdiv, fmax, fmul, is_zero, Emit};
use crate::{Error, Result};

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
        DType::E2m1 | DType::E4m3 | DType::E5m2 | DType::E8m0 | DType::I8 | DType::U8 => {
            Some(Elem::U8)
        }
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
            if t.dtype == DType::E2m1 {
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
        let (v, _) = match &p.op(v)? {
            Op::Swizzle128x4 { base } | Op::Pad { base, .. } => (*base, true),
            _ => (v, false),
        };
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
        let half = |n: usize| if t.dtype == DType::E2m1 { n / 2 } else { n };
        let len = half(p.numel(&t.shape)?);
        let name = t.name.clone();
        let fp4 = t.dtype == DType::E2m1;
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

    /// Copy a staged (row-major, unpadded) param into its storage map, zero-filling the padding:
    /// one work item per `run` elements of the param's last dimension, which the map proves
    /// contiguous (16-byte accesses), or one element (byte pair for 4-bit types) at a time.
    fn relayout(&mut self, r: &Relayout) -> Result<()> {
        let t = self.tensor(r.param)?.clone();
        let mut map = self.storage_map(r.param)?;
        let mut shape = map.shape();
        let mut vshape = r.value_shape.clone();
        let elem = self
            .prog
            .buf(r.out)
            .map(|b| b.elem)
            .ok_or(Error::Internal("relayout buffer"))?;
        if t.dtype == DType::E2m1 {
            map = map
                .halved()
                .ok_or_else(|| unsupported(&t.name, "a 4-bit layout that splits byte pairs"))?;
            for s in [&mut shape, &mut vshape] {
                if let Some(l) = s.last_mut() {
                    *l /= 2;
                }
            }
        }
        let rank = shape.len();
        if rank == 0 {
            return Err(unsupported(&t.name, "a scalar param with a storage layout"));
        }
        // The run: `n` elements along the dimension where storage is contiguous, stored as one
        // packed access. Along the last dimension they are loaded packed too; along another (a
        // transposing layout) they are loaded one by one, neighbouring items taking neighbouring
        // last-dimension indices, so that the loads of a warp are coalesced and every store is a
        // whole run.
        let fits = |d: usize, n: i64| shape[d] % n == 0 && vshape[d] % n == 0;
        let max = (16 / elem.size()) as i64;
        let (dim, mut run) = match map.unit_dim() {
            Some(d) if map.run_along(d, max) > 1 => (d, map.run_along(d, max)),
            _ => (rank - 1, 1),
        };
        while run > 1 && !fits(dim, run) {
            run /= 2;
        }
        let last = rank - 1;
        // Item order: the last dimension fastest, except that the run dimension (in steps of `run`)
        // is always present once.
        let ext = |k: usize| if k == dim { shape[k] / run } else { shape[k] };
        let items: i64 = (0..rank).map(ext).product();
        let padded = shape != vshape;
        let name = format!("{}_{}_relayout", self.prog.recipe, t.name);
        let (src, out) = (r.staging, r.out);
        let rows = r.rows.clone();
        let atoms = self.info.binding().ok_or(Error::Unbound)?.atoms().to_vec();
        let vstride: Vec<i64> = (0..rank)
            .map(|k| vshape[k + 1..].iter().product::<i64>())
            .collect();
        self.kernel(name, items, |em, it| {
            let mut coord = vec![e::i(0); rank];
            let mut rest = it;
            for k in (0..rank).rev() {
                let c = em.set(Ty::I64, e::rem(rest.clone(), ext(k)));
                coord[k] = if k == dim && run > 1 {
                    em.set(Ty::I64, e::mul(c, e::i(run)))
                } else {
                    c
                };
                rest = e::div(rest, ext(k));
            }
            // The source row through the gather (dimension 1), where the param reads through one.
            let src_of = |em: &mut Emit<'_>, j: i64| -> Expr {
                let mut at = e::i(0);
                for k in 0..rank {
                    let mut c = coord[k].clone();
                    if k == dim && j > 0 {
                        c = e::add(c, e::i(j));
                    }
                    if let (Some(iv), 1) = (&rows, k) {
                        c = em.set(Ty::I64, index_vec_expr(iv, c, &atoms));
                    }
                    at = e::add(at, e::mul(c, e::i(vstride[k])));
                }
                at
            };
            let src_at = src_of(em, 0);
            let dst = em.set(Ty::I64, map.index(&coord));
            let copy = em.block(|b| {
                let xs = if rows.is_some() && dim == 1 {
                    (0..run)
                        .map(|j| {
                            let at = src_of(b, j);
                            b.set(elem.ty(), e::load(src, at))
                        })
                        .collect()
                } else if dim == last {
                    load_block(b, src, elem, src_at, run as usize)
                } else {
                    let at = b.set(Ty::I64, src_at);
                    (0..run)
                        .map(|j| {
                            let x = e::load(src, e::add(at.clone(), e::i(j * vstride[dim])));
                            b.set(elem.ty(), x)
                        })
                        .collect()
                };
                store_block(b, out, elem, dst.clone(), xs);
            });
            if !padded {
                em.out.extend(copy);
                return Ok(());
            }
            let mut inside = e::i32(1);
            for k in 0..rank {
                if shape[k] != vshape[k] {
                    let lt = e::un(
                        UnOp::BoolToI,
                        e::bin(BinOp::ILt, coord[k].clone(), e::i(vshape[k])),
                    );
                    inside = e::bin(BinOp::And, inside, lt);
                }
            }
            let inside = em.set(Ty::I32, inside);
            em.out.push(Stmt::If {
                cond: e::bin(BinOp::IEq, inside.clone(), e::i32(1)),
                then: copy,
            });
            let zero = if elem == Elem::U8 {
                e::i32(0)
            } else {
                e::f(0.0)
            };
            let zeros = em.block(|b| store_block(b, out, elem, dst, vec![zero; run as usize]));
            em.out.push(Stmt::If {
                cond: e::bin(BinOp::IEq, inside, e::i32(0)),
                then: zeros,
            });
            Ok(())
        })
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

    /// One quantization: amax, collective hook, scales, quantize pass.
    fn quantize(&mut self, q: ValueId, u: &QuantUse) -> Result<()> {
        let m = self.info.module();
        let Op::Quant { scheme, input } = self.op(q)? else {
            return Err(Error::Internal("quantization node expected"));
        };
        let any_param = u
            .values
            .as_ref()
            .map(|x| x.0)
            .or(u.scales.as_ref().map(|x| x.0))
            .or(u.global)
            .or(u.decode)
            .ok_or(Error::Internal("unused quantization"))?;
        let pname = self.tensor(any_param)?.name.clone();
        let (xv, rows_in) = self.strip_gather(&pname, input)?;
        // An input (optionally row-gathered) is read in place; any other tensor expression is
        // first materialized row-major by the generic element kernel.
        let direct = match self.op(xv)? {
            Op::Tensor(xt) => self
                .inputs
                .get(&xt)
                .map(|b| (*b, self.tensor(xt).map(|t| t.name.clone()))),
            _ => None,
        };
        let (xb, xname) = match direct {
            Some((b, n)) => (b, n?),
            None => (self.materialize(&pname, xv)?, format!("q{}", q.0)),
        };
        let shape = self.shape(xv)?;
        let [ne, rows, cols] = shape[..] else {
            return Err(unsupported(
                &pname,
                "quantizing a tensor that is not [E, M, K]",
            ));
        };
        // The row order: a gather before or after the quantization (not both, not different ones).
        let rows_out_v = u.values.as_ref().and_then(|x| x.1.clone());
        let rows_out_s = u.scales.as_ref().and_then(|x| x.1.clone());
        if u.values.is_some() && u.scales.is_some() && rows_out_v != rows_out_s {
            return Err(unsupported(
                &pname,
                "values and scales gathered by different row orders",
            ));
        }
        let rows_out = rows_out_v.or(rows_out_s);
        if rows_in.is_some() && rows_out.is_some() {
            return Err(unsupported(
                &pname,
                "a row gather both before and after the quantization",
            ));
        }
        let rowmap = rows_in.or(rows_out);
        let atoms = self.info.binding().ok_or(Error::Unbound)?.atoms().to_vec();
        let src_row = move |em: &mut Emit<'_>, r: Expr| -> Expr {
            match &rowmap {
                Some(iv) => {
                    let x = index_vec_expr(iv, r, &atoms);
                    em.set(Ty::I64, x)
                }
                None => r,
            }
        };
        let vals = u
            .values
            .as_ref()
            .and_then(|x| self.params.get(&x.0).copied());
        let scl = u.scales.as_ref().and_then(|x| {
            let map = self.scale_maps.get(&x.0).cloned();
            self.params.get(&x.0).copied().map(|b| (b, map))
        });
        let glob = u.global.and_then(|x| self.params.get(&x).copied());
        let dec = u.decode.and_then(|x| self.params.get(&x).copied());
        let rc = rows * cols;
        let tag = format!("{}_{}", m.name, xname);
        let load = move |row_base: Expr, c: Expr| e::load(xb, e::add(row_base, c));

        match scheme {
            QuantScheme::Nvfp4 { .. }
            | QuantScheme::Fp8 {
                granularity: Fp8Granularity::Tensor,
                ..
            } => {
                let (per_tensor, group) = match scheme {
                    QuantScheme::Nvfp4 { amax, group } => {
                        (amax == AmaxGranularity::PerTensor, group)
                    }
                    QuantScheme::Fp8 { group, .. } => (false, group),
                    _ => (false, Group::None),
                };
                let n_amax = if per_tensor { 1 } else { ne as usize };
                let amax_b = self.buf(
                    BufRole::Temp(format!("{tag}_amax")),
                    Elem::F32,
                    n_amax,
                    true,
                );
                // 1. amax: one work item per row, atomically max-reduced per expert.
                let x4 = self.x4 && cols % 16 == 0;
                if !self.x4 {
                    // GPU form: one CTA per slice of 4096 16-byte chunks of an expert; its threads
                    // take neighbouring chunks (coalesced, 16 trips each, unrolled), reduce together,
                    // and thread 0 makes one atomic max per slice.
                    let n_e = rows * cols;
                    let chunk = if n_e % 8 == 0 { 8 } else { 1 };
                    let xelem = self.prog.buf(xb).map(|b| b.elem).unwrap_or(Elem::F32);
                    let per: i64 = 4096;
                    let nchunks = n_e / chunk;
                    let slices = (nchunks + per - 1) / per;
                    let guard = nchunks % per != 0;
                    self.group_kernel(format!("{tag}_amax"), ne * slices, 256, |em, it| {
                        let ex = em.set(Ty::I64, e::div(it.clone(), slices));
                        let sl = em.set(Ty::I64, e::rem(it, slices));
                        let base = em.set(Ty::I64, e::mul(ex.clone(), e::i(n_e)));
                        let mx = em.vars.new_var(Ty::F32);
                        let sub = em.vars.new_var(Ty::I64);
                        let m = em.vars.new_var(Ty::F32);
                        let body = em.block(|b| {
                            let ci =
                                b.set(Ty::I64, e::add(e::mul(sl.clone(), e::i(per)), e::v(sub)));
                            let load = b.block(|b2| {
                                let at = e::add(base.clone(), e::mul(ci.clone(), e::i(chunk)));
                                let xs = load_block(b2, xb, xelem, at, chunk as usize);
                                b2.out.push(Stmt::Set(m, Expr::AbsMax(xs)));
                            });
                            if guard {
                                b.out.push(Stmt::Set(m, e::f(0.0)));
                                b.out.push(Stmt::If {
                                    cond: e::bin(BinOp::ILt, ci, e::i(nchunks)),
                                    then: load,
                                });
                            } else {
                                b.out.extend(load);
                            }
                        });
                        em.out.push(Stmt::GroupMax {
                            var: mx,
                            sub,
                            count: e::i(per),
                            body,
                            value: e::v(m),
                        });
                        let idx = if per_tensor { e::i(0) } else { ex };
                        em.out.push(Stmt::AtomicMaxF32 {
                            buf: amax_b,
                            index: idx,
                            value: e::v(mx),
                        });
                        Ok(())
                    })?;
                } else {
                    self.kernel(format!("{tag}_amax"), ne * rows, |em, it| {
                        let ex = em.set(Ty::I64, e::div(it.clone(), rows));
                        let base = em.set(Ty::I64, e::mul(it, e::i(cols)));
                        let mx = if x4 {
                            // 16 values per step in four f32x4 lanes, reduced across lanes at the end.
                            let mv = em.var(Ty::F32x4, e::splat(e::f(0.0)));
                            em.for_(e::i(0), e::i(cols / 16), |b, c| {
                                let at = b.set(Ty::I64, e::add(base.clone(), e::mul(c, e::i(16))));
                                let vs = (0..4)
                                    .map(|q| fabs(e::load_x4(xb, e::add(at.clone(), e::i(4 * q)))))
                                    .collect();
                                b.out.push(Stmt::Set(mv, fmax(e::v(mv), max_tree(vs))));
                            });
                            let lanes = (0..4).map(|k| e::lane(e::v(mv), k)).collect();
                            em.var(Ty::F32, max_tree(lanes))
                        } else {
                            let mx = em.var(Ty::F32, e::f(0.0));
                            em.for_(e::i(0), e::i(cols), |b, c| {
                                b.out.push(Stmt::Set(
                                    mx,
                                    fmax(e::v(mx), fabs(load(base.clone(), c))),
                                ));
                            });
                            mx
                        };
                        let idx = if per_tensor { e::i(0) } else { ex };
                        em.out.push(Stmt::AtomicMaxF32 {
                            buf: amax_b,
                            index: idx,
                            value: e::v(mx),
                        });
                        Ok(())
                    })?;
                }
                if group != Group::None {
                    self.prog.steps.push(Step::AllReduceMax {
                        buf: amax_b,
                        group: group.name().to_string(),
                    });
                }
                let is_nv = matches!(scheme, QuantScheme::Nvfp4 { .. });
                let s1 = self.buf(
                    BufRole::Temp(format!("{tag}_{}", if is_nv { "gs" } else { "scale" })),
                    Elem::F32,
                    n_amax,
                    false,
                );
                let s2 = self.buf(
                    BufRole::Temp(format!("{tag}_{}", if is_nv { "decode" } else { "inv" })),
                    Elem::F32,
                    n_amax,
                    false,
                );
                // 2. per-expert scales.
                self.kernel(format!("{tag}_scales"), n_amax as i64, |em, it| {
                    let a = em.set(Ty::F32, e::load(amax_b, it.clone()));
                    if is_nv {
                        // gs = 2688 / amax (1 for an all-zero expert); decode = 1 / gs.
                        let gs = em.set(
                            Ty::F32,
                            e::sel(is_zero(a.clone()), e::f(1.0), fdiv(e::f(2688.0), a)),
                        );
                        let d = em.set(Ty::F32, fdiv(e::f(1.0), gs.clone()));
                        em.out.push(Stmt::Store {
                            buf: s1,
                            index: it.clone(),
                            value: gs.clone(),
                        });
                        em.out.push(Stmt::Store {
                            buf: s2,
                            index: it.clone(),
                            value: d.clone(),
                        });
                        if let Some(g) = glob {
                            em.out.push(Stmt::Store {
                                buf: g,
                                index: it.clone(),
                                value: gs,
                            });
                        }
                        if let Some(dd) = dec {
                            em.out.push(Stmt::Store {
                                buf: dd,
                                index: it,
                                value: d,
                            });
                        }
                    } else {
                        // scale = amax / 448 (1 for an all-zero expert); inv = 1 / scale.
                        let s = em.set(
                            Ty::F32,
                            e::sel(is_zero(a.clone()), e::f(1.0), fdiv(a, e::f(448.0))),
                        );
                        let inv = em.set(Ty::F32, fdiv(e::f(1.0), s.clone()));
                        em.out.push(Stmt::Store {
                            buf: s1,
                            index: it.clone(),
                            value: s.clone(),
                        });
                        em.out.push(Stmt::Store {
                            buf: s2,
                            index: it.clone(),
                            value: inv,
                        });
                        if let Some((sb, _)) = &scl {
                            let sb = *sb;
                            em.out.push(Stmt::Store {
                                buf: sb,
                                index: it,
                                value: s,
                            });
                        }
                    }
                    Ok(())
                })?;
                if is_nv {
                    self.quants.insert(
                        q,
                        QuantTemps {
                            gs: Some(s1),
                            decode: Some(s2),
                            fp8_scale: None,
                        },
                    );
                    self.nvfp4_pass(
                        &tag, xb, ne, rows, cols, per_tensor, s1, s2, vals, scl, &src_row,
                    )?;
                } else {
                    self.quants.insert(
                        q,
                        QuantTemps {
                            gs: None,
                            decode: None,
                            fp8_scale: Some(s1),
                        },
                    );
                    // 3. q = e4m3(clamp(x * inv, +-448)).
                    let vb = vals;
                    let x4_q = self.x4 && cols % 4 == 0;
                    let xelem = self.prog.buf(xb).map(|b| b.elem).unwrap_or(Elem::F32);
                    // GPU form: one work item per 16 elements of a row (coalesced).
                    let nch = if !self.x4 && cols % 16 == 0 {
                        cols / 16
                    } else {
                        1
                    };
                    let (c0, c1) = (if nch > 1 { 16 } else { cols }, nch);
                    self.kernel(format!("{tag}_quant"), ne * rows * c1, |em, it0| {
                        let (it, cstart) = if nch > 1 {
                            let row = em.set(Ty::I64, e::div(it0.clone(), nch));
                            let ch = em.set(Ty::I64, e::mul(e::rem(it0, nch), e::i(16)));
                            (row, ch)
                        } else {
                            (it0, e::i(0))
                        };
                        let ex = em.set(Ty::I64, e::div(it.clone(), rows));
                        let r = em.set(Ty::I64, e::rem(it.clone(), rows));
                        let sr = src_row(em, r);
                        let base = em.set(
                            Ty::I64,
                            e::add(e::mul(ex.clone(), e::i(rc)), e::mul(sr, e::i(cols))),
                        );
                        let out = em.set(Ty::I64, e::mul(it, e::i(cols)));
                        let inv = em.set(Ty::F32, e::load(s2, ex));
                        if let Some(vb) = vb {
                            if x4_q {
                                em.for_(e::i(0), e::i(cols / 4), |b, c| {
                                    let c4 = b.set(Ty::I64, e::mul(c, e::i(4)));
                                    let x = fmul(
                                        e::load_x4(xb, e::add(base.clone(), c4.clone())),
                                        inv.clone(),
                                    );
                                    let code =
                                        b.vector(|bv| quant::e4m3_rne(bv, clamp(x, -448.0, 448.0)));
                                    for k in 0..4u8 {
                                        b.out.push(Stmt::Store {
                                            buf: vb,
                                            index: e::add(
                                                e::add(out.clone(), c4.clone()),
                                                e::i(k as i64),
                                            ),
                                            value: e::lane(code.clone(), k),
                                        });
                                    }
                                });
                            } else if nch > 1 {
                                // GPU form: 16 elements in, 16 bytes out, as packed accesses.
                                let xs = load_block(
                                    em,
                                    xb,
                                    xelem,
                                    e::add(base.clone(), cstart.clone()),
                                    16,
                                );
                                let codes: Vec<Expr> = e4m3_codes(em, xs, &inv);
                                store_block(
                                    em,
                                    vb,
                                    Elem::U8,
                                    e::add(out.clone(), cstart.clone()),
                                    codes,
                                );
                            } else {
                                em.for_(
                                    cstart.clone(),
                                    e::add(cstart.clone(), e::i(c0)),
                                    |b, c| {
                                        let x = clamp(
                                            fmul(load(base.clone(), c.clone()), inv.clone()),
                                            -448.0,
                                            448.0,
                                        );
                                        let code = quant::e4m3_rne(b, x);
                                        b.out.push(Stmt::Store {
                                            buf: vb,
                                            index: e::add(out.clone(), c),
                                            value: code,
                                        });
                                    },
                                );
                            }
                        }
                        Ok(())
                    })?;
                }
                Ok(())
            }
            QuantScheme::Fp8 {
                granularity: Fp8Granularity::Channel,
                ..
            }
            | QuantScheme::Int8Row => {
                let int8 = matches!(scheme, QuantScheme::Int8Row);
                self.quants.insert(
                    q,
                    QuantTemps {
                        gs: None,
                        decode: None,
                        fp8_scale: None,
                    },
                );
                let sb = scl.as_ref().map(|x| x.0);
                let packed = !self.x4 && cols % 8 == 0;
                let x4r = self.x4 && cols % 4 == 0;
                let xelem = self.prog.buf(xb).map(|b| b.elem).unwrap_or(Elem::F32);
                // The row's scale from its amax, as SPEC §8 (int8) or the per-channel FP8 formula.
                let scale_of = move |em: &mut Emit<'_>, mx: Expr| -> Expr {
                    if int8 {
                        em.set(
                            Ty::F32,
                            e::sel(is_zero(mx.clone()), e::f(1.0), fdiv(mx, e::f(127.0))),
                        )
                    } else {
                        em.set(
                            Ty::F32,
                            e::sel(
                                is_zero(mx.clone()),
                                e::f(1.0),
                                fmax(fdiv(mx, e::f(448.0)), e::f(1.0 / (448.0 * 512.0))),
                            ),
                        )
                    }
                };
                if packed {
                    // GPU form: one CTA per row. Its threads stride through the row in 8-element
                    // packed loads and max-reduce together (warp shuffles, shared memory); then they
                    // quantize the row, reading it again from L1/L2 while it is still there, so DRAM
                    // sees the input once.
                    return self.group_kernel(
                        format!("{tag}_quant"),
                        ne * rows,
                        row_group(cols / 8),
                        |em, row| {
                            let ex = em.set(Ty::I64, e::div(row.clone(), rows));
                            let r = em.set(Ty::I64, e::rem(row.clone(), rows));
                            let sr = src_row(em, r);
                            let base = em.set(
                                Ty::I64,
                                e::add(e::mul(ex, e::i(rc)), e::mul(sr, e::i(cols))),
                            );
                            // Pass 1 loads the row and max-reduces it; between the passes, the
                            // row's scale; pass 2 quantizes what pass 1 loaded.
                            let mx = em.vars.new_var(Ty::F32);
                            let sub = em.vars.new_var(Ty::I64);
                            let load_segment = |b: &mut Emit<'_>| {
                                let at = e::add(base.clone(), e::mul(e::v(sub), e::i(8)));
                                load_block(b, xb, xelem, at, 8)
                            };
                            let mut xs: Vec<Expr> = Vec::new();
                            let load = em.block(|b| xs = load_segment(b));
                            let value = Expr::AbsMax(xs.clone());
                            // bf16 rows whose scale is in range divide by the row's reciprocal and
                            // one correction (see `quant::quot_by_reciprocal`); others, and wider
                            // inputs, by a correctly rounded division per element.
                            let fast = xelem == Elem::Bf16;
                            let mut scale = e::f(1.0);
                            let mut neg_b = e::f(0.0);
                            let mut y = e::f(0.0);
                            let mut safe = e::i32(0);
                            let mid = em.block(|b| {
                                scale = scale_of(b, e::v(mx));
                                if let Some(sb) = sb {
                                    b.out.push(Stmt::Store {
                                        buf: sb,
                                        index: row.clone(),
                                        value: scale.clone(),
                                    });
                                }
                                if fast && vals.is_some() {
                                    neg_b = b.set(Ty::F32, fmul(scale.clone(), e::f(-1.0)));
                                    y = b.set(Ty::F32, fdiv(e::f(1.0), scale.clone()));
                                    safe = b.set(Ty::I32, quant::reciprocal_safe(scale.clone()));
                                }
                            });
                            let mut body = Vec::new();
                            let mut slow = Vec::new();
                            if let Some(vb) = vals {
                                let quantize =
                                    |b: &mut Emit<'_>, by_reciprocal: bool, xs: &[Expr]| {
                                        let codes = xs
                                            .iter()
                                            .map(|x| {
                                                let q = if by_reciprocal {
                                                    quant::quot_by_reciprocal(
                                                        b,
                                                        x.clone(),
                                                        &neg_b,
                                                        &y,
                                                    )
                                                } else {
                                                    fdiv(x.clone(), scale.clone())
                                                };
                                                if int8 {
                                                    quant::int8_of_quotient(b, q)
                                                } else {
                                                    quant::e4m3_rne(b, q)
                                                }
                                            })
                                            .collect();
                                        let at = e::add(
                                            e::mul(row.clone(), e::i(cols)),
                                            e::mul(e::v(sub), e::i(8)),
                                        );
                                        store_block(b, vb, Elem::U8, at, codes);
                                    };
                                body = em.block(|b| {
                                    if fast {
                                        let then = b.block(|b2| quantize(b2, true, &xs));
                                        b.out.push(Stmt::If {
                                            cond: e::bin(BinOp::IEq, safe.clone(), e::i32(1)),
                                            then,
                                        });
                                    } else {
                                        quantize(b, false, &xs);
                                    }
                                });
                                if fast {
                                    // Rows with an extreme scale: loaded again and divided per
                                    // element, in a loop (a path real checkpoints do not take, kept
                                    // out of the unrolled code).
                                    slow = em.block(|b| {
                                        let inner = b.block(|b2| {
                                            let again = load_segment(b2);
                                            quantize(b2, false, &again);
                                        });
                                        b.out.push(Stmt::If {
                                            cond: e::bin(BinOp::IEq, safe.clone(), e::i32(0)),
                                            then: vec![Stmt::GroupFor {
                                                var: sub,
                                                count: e::i(cols / 8),
                                                body: inner,
                                            }],
                                        });
                                    });
                                }
                            }
                            em.out.push(Stmt::GroupRow(GroupRow {
                                var: mx,
                                sub,
                                count: e::i(cols / 8),
                                load,
                                value,
                                mid,
                                body,
                            }));
                            em.out.extend(slow);
                            Ok(())
                        },
                    );
                }
                self.kernel(format!("{tag}_quant"), ne * rows, |em, it| {
                    let ex = em.set(Ty::I64, e::div(it.clone(), rows));
                    let r = em.set(Ty::I64, e::rem(it.clone(), rows));
                    let sr = src_row(em, r);
                    let base = em.set(
                        Ty::I64,
                        e::add(e::mul(ex, e::i(rc)), e::mul(sr, e::i(cols))),
                    );
                    let out = em.set(Ty::I64, e::mul(it.clone(), e::i(cols)));
                    let mx = em.var(Ty::F32, e::f(0.0));
                    if x4r {
                        // Host form: four lanes at a time, reduced across lanes at the end.
                        let mv = em.var(Ty::F32x4, e::splat(e::f(0.0)));
                        em.for_(e::i(0), e::i(cols / 4), |b, c4| {
                            let x = fabs(e::load_x4(xb, e::add(base.clone(), e::mul(c4, e::i(4)))));
                            b.out.push(Stmt::Set(mv, fmax(e::v(mv), x)));
                        });
                        let lanes = (0..4).map(|k| e::lane(e::v(mv), k)).collect();
                        em.out.push(Stmt::Set(mx, max_tree(lanes)));
                    } else {
                        // (The GPU form of rows a multiple of 8 long returned above.)
                        em.for_(e::i(0), e::i(cols), |b, c| {
                            b.out
                                .push(Stmt::Set(mx, fmax(e::v(mx), fabs(load(base.clone(), c)))));
                        });
                    }
                    // int8: amax / 127; fp8 per channel: max(amax / 448, 1 / (448*512)); 1 for a zero row.
                    let scale = scale_of(em, e::v(mx));
                    if let Some(sb) = sb {
                        em.out.push(Stmt::Store {
                            buf: sb,
                            index: it,
                            value: scale.clone(),
                        });
                    }
                    let code_of = |b: &mut Emit<'_>, x: Expr| {
                        if int8 {
                            quant::int8_rne(b, x, scale.clone())
                        } else {
                            let y = clamp(fdiv(x, scale.clone()), -448.0, 448.0);
                            quant::e4m3_rne(b, y)
                        }
                    };
                    if let Some(vb) = vals {
                        if x4r {
                            em.for_(e::i(0), e::i(cols / 4), |b, c4| {
                                let c = b.set(Ty::I64, e::mul(c4, e::i(4)));
                                let x = e::load_x4(xb, e::add(base.clone(), c.clone()));
                                let codes = b.vector(|bv| code_of(bv, x));
                                let lanes = (0..4u8).map(|k| e::lane(codes.clone(), k)).collect();
                                store_block(b, vb, Elem::U8, e::add(out.clone(), c), lanes);
                            });
                        } else {
                            em.for_(e::i(0), e::i(cols), |b, c| {
                                let code = code_of(b, load(base.clone(), c.clone()));
                                b.out.push(Stmt::Store {
                                    buf: vb,
                                    index: e::add(out.clone(), c),
                                    value: code,
                                });
                            });
                        }
                    }
                    Ok(())
                })
            }
            QuantScheme::Fp8 {
                granularity: Fp8Granularity::Block128,
                ..
            } => {
                self.quants.insert(
                    q,
                    QuantTemps {
                        gs: None,
                        decode: None,
                        fp8_scale: None,
                    },
                );
                let (bm, bk) = ((rows + 127) / 128, (cols + 127) / 128);
                let sb = scl.as_ref().map(|x| x.0);
                let packed = !self.x4 && cols % 8 == 0;
                let x4b = self.x4 && cols % 4 == 0;
                // The fallback below (the host form, and GPU rows not a multiple of 8 long): 4-lane
                // vectors on the host, single elements otherwise.
                let chunk: i64 = if x4b { 4 } else { 1 };
                let xelem = self.prog.buf(xb).map(|b| b.elem).unwrap_or(Elem::F32);
                if packed {
                    // GPU form: one CTA per 128x128 block. Its threads take 8-element row segments
                    // in turns (16 to a block row: neighbouring threads read neighbouring memory),
                    // max-reduce together, and quantize the block from registers.
                    let (need_r, need_c) = (rows % 128 != 0, cols % 128 != 0);
                    return self.group_kernel(format!("{tag}_quant"), ne * bm * bk, 256, |em, it| {
                        let kb = em.set(Ty::I64, e::rem(it.clone(), bk));
                        let t = em.set(Ty::I64, e::div(it, bk));
                        let band = em.set(Ty::I64, e::rem(t.clone(), bm));
                        let ex = em.set(Ty::I64, e::div(t, bm));
                        // Segment `sub` of the block: row band*128 + sub/16, columns kb*128 + 8*(sub%16).
                        let seg = |b: &mut Emit<'_>, sub: Expr, f: &mut dyn FnMut(&mut Emit<'_>, Expr, Expr)| {
                            let r = b.set(
                                Ty::I64,
                                e::add(e::mul(band.clone(), e::i(128)), e::div(sub.clone(), 16)),
                            );
                            let c = b.set(
                                Ty::I64,
                                e::add(e::mul(kb.clone(), e::i(128)), e::mul(e::rem(sub, 16), e::i(8))),
                            );
                            let inner = b.block(|b2| {
                                let sr = src_row(b2, r.clone());
                                let src = b2.set(
                                    Ty::I64,
                                    e::add(
                                        e::add(e::mul(ex.clone(), e::i(rc)), e::mul(sr, e::i(cols))),
                                        c.clone(),
                                    ),
                                );
                                let dst = e::add(
                                    e::add(e::mul(ex.clone(), e::i(rc)), e::mul(r.clone(), e::i(cols))),
                                    c.clone(),
                                );
                                f(b2, src, dst);
                            });
                            let mut guarded = inner;
                            if need_c {
                                guarded = vec![Stmt::If {
                                    cond: e::bin(BinOp::ILt, c.clone(), e::i(cols)),
                                    then: guarded,
                                }];
                            }
                            if need_r {
                                guarded = vec![Stmt::If {
                                    cond: e::bin(BinOp::ILt, r.clone(), e::i(rows)),
                                    then: guarded,
                                }];
                            }
                            b.out.extend(guarded);
                        };
                        // Pass 1 loads the block and max-reduces it; between the passes, its scale;
                        // pass 2 quantizes what pass 1 loaded.
                        let mx = em.vars.new_var(Ty::F32);
                        let sub = em.vars.new_var(Ty::I64);
                        let m = em.vars.new_var(Ty::F32);
                        let mut xs: Vec<Expr> = Vec::new();
                        let load = em.block(|b| {
                            b.out.push(Stmt::Set(m, e::f(0.0)));
                            seg(b, e::v(sub), &mut |b2, src, _| {
                                xs = load_block(b2, xb, xelem, src, 8);
                                b2.out.push(Stmt::Set(m, Expr::AbsMax(xs.clone())));
                            });
                        });
                        // sf = max(amax, 1e-4) / 448; q = e4m3(x * (1/sf)).
                        let mut inv = e::f(1.0);
                        let mid = em.block(|b| {
                            let sf = b.set(Ty::F32, fdiv(fmax(e::v(mx), e::f(1e-4)), e::f(448.0)));
                            inv = b.set(Ty::F32, fdiv(e::f(1.0), sf.clone()));
                            if let Some(sb) = sb {
                                let si = e::add(
                                    e::mul(ex.clone(), e::i(bm * bk)),
                                    e::add(e::mul(band.clone(), e::i(bk)), kb.clone()),
                                );
                                b.out.push(Stmt::Store {
                                    buf: sb,
                                    index: si,
                                    value: sf,
                                });
                            }
                        });
                        let body = match vals {
                            Some(vb) => em.block(|b| {
                                seg(b, e::v(sub), &mut |b2, _, dst| {
                                    let codes = e4m3_codes(b2, xs.clone(), &inv);
                                    store_block(b2, vb, Elem::U8, dst, codes);
                                });
                            }),
                            None => Vec::new(),
                        };
                        em.out.push(Stmt::GroupRow(GroupRow {
                            var: mx,
                            sub,
                            count: e::i(128 * 16),
                            load,
                            value: e::v(m),
                            mid,
                            body,
                        }));
                        Ok(())
                    });
                }
                // One work item per 128x128 block: amax, scale, quantize.
                self.kernel(format!("{tag}_quant"), ne * bm * bk, |em, it0| {
                    let it = em.set(Ty::I64, e::div(it0.clone(), bk));
                    let kb0 = em.set(Ty::I64, e::rem(it0, bk));
                    let ex = em.set(Ty::I64, e::div(it.clone(), bm));
                    let band = em.set(Ty::I64, e::rem(it.clone(), bm));
                    let r0 = em.set(Ty::I64, e::mul(band.clone(), e::i(128)));
                    let r1 = em.set(Ty::I64, e::bin(BinOp::IAdd, r0.clone(), e::i(128)));
                    let r1 = em.set(
                        Ty::I64,
                        e::sel(e::bin(BinOp::ILt, r1.clone(), e::i(rows)), r1, e::i(rows)),
                    );
                    em.for_(kb0.clone(), e::add(kb0.clone(), e::i(1)), |b, kb| {
                        let c0 = b.set(Ty::I64, e::mul(kb.clone(), e::i(128)));
                        let c1 = b.set(Ty::I64, e::bin(BinOp::IAdd, c0.clone(), e::i(128)));
                        let c1 = b.set(
                            Ty::I64,
                            e::sel(e::bin(BinOp::ILt, c1.clone(), e::i(cols)), c1, e::i(cols)),
                        );
                        let mx = b.var(Ty::F32, e::f(0.0));
                        let rows_v = |b: &mut Emit<'_>, f: &dyn Fn(&mut Emit<'_>, Expr, Expr)| {
                            b.for_(r0.clone(), r1.clone(), |b2, r| {
                                let sr = src_row(b2, r.clone());
                                let base = b2.set(
                                    Ty::I64,
                                    e::add(e::mul(ex.clone(), e::i(rc)), e::mul(sr, e::i(cols))),
                                );
                                let out = b2.set(
                                    Ty::I64,
                                    e::add(e::mul(ex.clone(), e::i(rc)), e::mul(r, e::i(cols))),
                                );
                                if chunk > 1 {
                                    // Host form: 4-lane vectors.
                                    let (k0, k1) =
                                        (e::div(c0.clone(), chunk), e::div(c1.clone(), chunk));
                                    b2.for_(k0, k1, |b3, ck| {
                                        let c = b3.set(Ty::I64, e::mul(ck, e::i(chunk)));
                                        f(
                                            b3,
                                            e::add(base.clone(), c.clone()),
                                            e::add(out.clone(), c),
                                        )
                                    });
                                } else {
                                    b2.for_(c0.clone(), c1.clone(), |b3, c| {
                                        f(
                                            b3,
                                            e::add(base.clone(), c.clone()),
                                            e::add(out.clone(), c),
                                        )
                                    });
                                }
                            });
                        };
                        // A vector accumulator only in the host form (the PTX backend takes scalar IR).
                        let mv = x4b.then(|| b.var(Ty::F32x4, e::splat(e::f(0.0))));
                        rows_v(b, &|b3, src, _| {
                            if let Some(mv) = mv {
                                b3.out
                                    .push(Stmt::Set(mv, fmax(e::v(mv), fabs(e::load_x4(xb, src)))));
                                return;
                            }
                            let m = fabs(e::load(xb, src));
                            b3.out.push(Stmt::Set(mx, fmax(e::v(mx), m)));
                        });
                        if let Some(mv) = mv {
                            let lanes = (0..4).map(|k| e::lane(e::v(mv), k)).collect();
                            b.out.push(Stmt::Set(mx, max_tree(lanes)));
                        }
                        // sf = max(amax, 1e-4) / 448; q = e4m3(clamp(x * (1/sf))).
                        let sf = b.set(Ty::F32, fdiv(fmax(e::v(mx), e::f(1e-4)), e::f(448.0)));
                        let inv = b.set(Ty::F32, fdiv(e::f(1.0), sf.clone()));
                        if let Some(sb) = sb {
                            let si = e::add(
                                e::mul(ex.clone(), e::i(bm * bk)),
                                e::add(e::mul(band.clone(), e::i(bk)), kb),
                            );
                            b.out.push(Stmt::Store {
                                buf: sb,
                                index: si,
                                value: sf,
                            });
                        }
                        if let Some(vb) = vals {
                            rows_v(b, &|b3, src, dst| {
                                if x4b {
                                    let x = fmul(e::load_x4(xb, src), inv.clone());
                                    let codes = b3
                                        .vector(|bv| quant::e4m3_rne(bv, clamp(x, -448.0, 448.0)));
                                    let lanes =
                                        (0..4u8).map(|k| e::lane(codes.clone(), k)).collect();
                                    store_block(b3, vb, Elem::U8, dst, lanes);
                                } else {
                                    let code = e4m3_codes(b3, vec![e::load(xb, src)], &inv);
                                    store_block(b3, vb, Elem::U8, dst, code);
                                }
                            });
                        }
                    });
                    Ok(())
                })
            }
            QuantScheme::Mxfp4 => {
                self.quants.insert(
                    q,
                    QuantTemps {
                        gs: None,
                        decode: None,
                        fp8_scale: None,
                    },
                );
                let nb = cols / 32;
                let sb = scl.as_ref().map(|x| x.0);
                let x4 = self.x4;
                let xelem = self.prog.buf(xb).map(|b| b.elem).unwrap_or(Elem::F32);
                let rb = RowBlocks::new(nb, 2, x4);
                self.kernel(
                    format!("{tag}_quant"),
                    ne * rows * rb.items_per_row(),
                    |em, it0| {
                        let ItemRow {
                            it, first, base, ..
                        } = rb.locate(em, it0, (rows, cols), &src_row);
                        let block = |b: &mut Emit<'_>, j: Expr| {
                            let b0 =
                                b.set(Ty::I64, e::add(base.clone(), e::mul(j.clone(), e::i(32))));
                            let xs = load_fp_block(b, xb, xelem, b0.clone(), 32, x4);
                            let m = abs_max(b, &xs, x4);
                            let mx = b.var(Ty::F32, m);
                            // e = clamp(floor(log2 amax) - 2, -127, 127): from the exponent field.
                            let ebits = b.set(
                                Ty::I32,
                                e::bin(
                                    BinOp::And,
                                    e::bin(BinOp::Shr, e::un(UnOp::BitsOf, e::v(mx)), e::i32(23)),
                                    e::i32(0xFF),
                                ),
                            );
                            let zero = b.set(Ty::Bool, is_zero(e::v(mx)));
                            // scale byte = e + 127 = max(ebits - 2, 0); multiplier 2^-e has exponent field min(256 - ebits, 254).
                            let sbyte = e::sel(
                                zero.clone(),
                                e::i32(0),
                                imax(e::bin(BinOp::ISub, ebits.clone(), e::i32(2)), e::i32(0)),
                            );
                            let mexp = imin(e::bin(BinOp::ISub, e::i32(256), ebits), e::i32(254));
                            let mult = b.set(
                                Ty::F32,
                                e::un(UnOp::FromBits, e::bin(BinOp::Shl, mexp, e::i32(23))),
                            );
                            if let Some(sbuf) = sb {
                                let si = e::add(e::mul(it.clone(), e::i(nb)), j.clone());
                                b.out.push(Stmt::Store {
                                    buf: sbuf,
                                    index: si,
                                    value: sbyte,
                                });
                            }
                            if let Some(vb) = vals {
                                let at = (it.clone(), j.clone(), cols);
                                store_fp4_block(b, vb, at, &xs, (&mult, &zero), x4, false);
                            }
                        };
                        rb.blocks(em, first, block);
                        Ok(())
                    },
                )
            }
        }
    }

    /// The NVFP4 quantize pass: per 16-element block, the E4M3 block scale and 8 packed bytes.
    #[allow(clippy::too_many_arguments)]
    fn nvfp4_pass(
        &mut self,
        tag: &str,
        xb: BufId,
        ne: i64,
        rows: i64,
        cols: i64,
        per_tensor: bool,
        gs_b: BufId,
        dec_b: BufId,
        vals: Option<BufId>,
        scl: Option<(BufId, Option<StorageMap>)>,
        src_row: &dyn Fn(&mut Emit<'_>, Expr) -> Expr,
    ) -> Result<()> {
        let nb = cols / 16;
        // The scale param's storage map from the verified module (`None`: compact row-major
        // [E, M, K/16], addressed linearly), e.g. SPEC §1's 128x4 tiles of a padded [E, Mp, Kp].
        let sw = scl.as_ref().and_then(|x| x.1.clone());
        let sw2 = sw.clone();
        let scl = scl.map(|x| x.0);
        let x4 = self.x4;
        let xelem = self.prog.buf(xb).map(|b| b.elem).unwrap_or(Elem::F32);
        let rb = RowBlocks::new(nb, 4, x4);
        self.kernel(
            format!("{tag}_quant"),
            ne * rows * rb.items_per_row(),
            |em, it0| {
                let ItemRow {
                    it,
                    first,
                    ex,
                    r,
                    base,
                } = rb.locate(em, it0, (rows, cols), src_row);
                let si = if per_tensor { e::i(0) } else { ex.clone() };
                let gs = em.set(Ty::F32, e::load(gs_b, si.clone()));
                let dec = em.set(Ty::F32, e::load(dec_b, si));
                // A block's values, E4M3 scale byte, output scale and zero flag.
                let scaled = |b: &mut Emit<'_>, j: &Expr| {
                    let b0 = b.set(Ty::I64, e::add(base.clone(), e::mul(j.clone(), e::i(16))));
                    let xs = load_fp_block(b, xb, xelem, b0, 16, x4);
                    let mx = abs_max(b, &xs, x4);
                    let mx = b.set(Ty::F32, mx);
                    // s = e4m3(clamp(gs * (vmax * f32(1/6)), 0, 448)); oscale = s == 0 ? 0 : 1 / (s * (1/gs)).
                    // (e4m3_rne saturates at ±448 itself.)
                    let s = fmul(gs.clone(), fmul(mx, e::f(1.0f32 / 6.0)));
                    let sbyte = quant::e4m3_rne(b, s);
                    let sval = quant::e4m3_decode(b, sbyte.clone());
                    let zero = b.set(Ty::Bool, e::bin(BinOp::IEq, sbyte.clone(), e::i32(0)));
                    let osc = b.set(
                        Ty::F32,
                        e::sel(
                            zero.clone(),
                            e::f(0.0),
                            fdiv(e::f(1.0), fmul(sval, dec.clone())),
                        ),
                    );
                    (xs, sbyte, osc, zero)
                };
                let store_scale = |b: &mut Emit<'_>, j: &Expr, sbyte: Expr| {
                    if let Some(sbuf) = scl {
                        let idx = match &sw {
                            Some(l) => l.index(&[ex.clone(), r.clone(), j.clone()]),
                            None => e::add(e::mul(it.clone(), e::i(nb)), j.clone()),
                        };
                        let idx = b.set(Ty::I64, idx);
                        b.out.push(Stmt::Store {
                            buf: sbuf,
                            index: idx,
                            value: sbyte,
                        });
                    }
                };
                let Some(vb) = vals else {
                    rb.blocks(em, first, |b, j| {
                        let (_, sbyte, _, _) = scaled(b, &j);
                        store_scale(b, &j, sbyte);
                    });
                    return Ok(());
                };
                if x4 {
                    rb.blocks(em, first, |b, j| {
                        let (xs, sbyte, osc, zero) = scaled(b, &j);
                        store_scale(b, &j, sbyte);
                        let at = (it.clone(), j, cols);
                        store_fp4_block(b, vb, at, &xs, (&osc, &zero), true, false);
                    });
                    return Ok(());
                }
                // A block with a normal E4M3 scale (byte >= 8) and a finite output scale has
                // |x * oscale| <= 6.4: sval >= t (1 - 2^-4) for t = gs * vmax / 6, and the f32
                // roundings add parts in 2^22; its conversion needs no saturation step (`small`,
                // which the interpreter checks). The rare others (zero and subnormal scales, and an
                // infinite or NaN output scale from an expert whose amax is near f32's underflow)
                // are done again after the item's blocks, in a loop over them with the saturating
                // form, where any occurred.
                let normal_of = |sbyte: Expr, osc: Expr| {
                    e::bin(
                        BinOp::And,
                        e::un(UnOp::BoolToI, e::bin(BinOp::ILt, e::i32(7), sbyte)),
                        e::un(UnOp::BoolToI, e::bin(BinOp::FLt, osc, e::f(f32::INFINITY))),
                    )
                };
                // The item's blocks share a row, `ipr` columns apart: where the swizzle moves a
                // block by a constant for that, their scale offsets are the first's plus multiples.
                let shift = sw.as_ref().and_then(|l| l.shift(2, rb.items_per_row()));
                let first_idx = match (&sw, shift, scl) {
                    (Some(l), Some(_), Some(_)) => {
                        Some(em.set(Ty::I64, l.index(&[ex.clone(), r.clone(), first.clone()])))
                    }
                    _ => None,
                };
                let slow = em.var(Ty::I32, e::i32(0));
                rb.blocks_k(em, first.clone(), |b, j, k| {
                    let (xs, sbyte, osc, zero) = scaled(b, &j);
                    match (&first_idx, shift, scl) {
                        (Some(i0), Some(d), Some(sbuf)) => b.out.push(Stmt::Store {
                            buf: sbuf,
                            index: e::add(i0.clone(), e::i(k * d)),
                            value: sbyte.clone(),
                        }),
                        _ => store_scale(b, &j, sbyte.clone()),
                    }
                    let at = (it.clone(), j, cols);
                    let normal = b.set(Ty::I32, normal_of(sbyte, osc.clone()));
                    let fast =
                        b.block(|b2| store_fp4_block(b2, vb, at, &xs, (&osc, &zero), false, true));
                    b.out.push(Stmt::If {
                        cond: e::bin(BinOp::IEq, normal.clone(), e::i32(1)),
                        then: fast,
                    });
                    let not = e::bin(BinOp::Xor, normal, e::i32(1));
                    b.out
                        .push(Stmt::Set(slow, e::bin(BinOp::Or, e::v(slow), not)));
                });
                let again = em.block(|b| {
                    b.for_(e::i(0), e::i(rb.bpi), |b2, k| {
                        let j = b2.set(Ty::I64, rb.block_of(&first, k));
                        let (xs, sbyte, osc, zero) = scaled(b2, &j);
                        let then = b2.block(|b3| {
                            let at = (it.clone(), j, cols);
                            store_fp4_block(b3, vb, at, &xs, (&osc, &zero), false, false)
                        });
                        b2.out.push(Stmt::If {
                            cond: e::bin(BinOp::IEq, normal_of(sbyte, osc), e::i32(0)),
                            then,
                        });
                    });
                });
                em.out.push(Stmt::If {
                    cond: e::bin(BinOp::IEq, e::v(slow), e::i32(1)),
                    then: again,
                });
                Ok(())
            },
        )?;
        // Zero fill of the padding (rows M..Mp, columns K/16..Kp of each expert), through the map.
        if let (Some(sbuf), Some(l)) = (scl, sw2) {
            let [_, mp, kp] = l.shape()[..] else {
                return Err(Error::Internal("NVFP4 scales of rank other than 3"));
            };
            if mp != rows || kp != nb {
                self.kernel(format!("{tag}_pad"), ne * mp, |em, it| {
                    let ex = em.set(Ty::I64, e::div(it.clone(), mp));
                    let r = em.set(Ty::I64, e::rem(it, mp));
                    em.for_(e::i(0), e::i(kp), |b, c| {
                        let pad = e::bin(
                            BinOp::Or,
                            e::un(UnOp::BoolToI, e::bin(BinOp::ILt, e::i(rows - 1), r.clone())),
                            e::un(UnOp::BoolToI, e::bin(BinOp::ILt, e::i(nb - 1), c.clone())),
                        );
                        let idx = l.index(&[ex.clone(), r.clone(), c]);
                        let then = vec![Stmt::Store {
                            buf: sbuf,
                            index: idx,
                            value: e::i32(0),
                        }];
                        b.out.push(Stmt::If {
                            cond: e::bin(BinOp::IEq, pad, e::i32(1)),
                            then,
                        });
                    });
                    Ok(())
                })?;
            }
        }
        Ok(())
    }

    /// A param that is not a quantization output: a copy or per-expert f32 arithmetic.
    fn other(&mut self, id: TensorId) -> Result<()> {
        let t = self.tensor(id)?.clone();
        let out = *self
            .params
            .get(&id)
            .ok_or(Error::Internal("param buffer"))?;
        let v = t.value.ok_or(Error::Internal("param value"))?;
        let (base, rows) = self.strip_gather(&t.name, v)?;
        if let Op::Tensor(src) = self.op(base)? {
            if let Some(&xb) = self.inputs.get(&src) {
                let src_elem = self.prog.buf(xb).map(|b| b.elem);
                if self.tensor(src)?.dtype != t.dtype || src_elem != elem_of(t.dtype) {
                    return Err(unsupported(
                        &t.name,
                        "a copy that changes the dtype (it would round)",
                    ));
                }
                let mut shape = self.shape(base)?;
                if t.dtype == DType::E2m1 {
                    // 4-bit codes are copied as the bytes that hold them (pairs along the last dim).
                    if let Some(l) = shape.last_mut() {
                        *l /= 2;
                    }
                }
                if shape.len() == 3 {
                    let [ne, nr, nc] = shape[..] else {
                        return Err(Error::Internal("rank"));
                    };
                    let atoms = self.info.binding().ok_or(Error::Unbound)?.atoms().to_vec();
                    // GPU form: one work item per 16 bytes of a row, so that each load and store
                    // instruction of a warp covers 512 contiguous bytes.
                    let xelem = self.prog.buf(xb).map(|b| b.elem).unwrap_or(Elem::F32);
                    let chunk = (16 / xelem.size()) as i64;
                    let nch = if !self.x4 && nc % chunk == 0 {
                        nc / chunk
                    } else {
                        1
                    };
                    let clen = if nch > 1 { chunk } else { nc };
                    return self.kernel(
                        format!("{}_{}_copy", self.prog.recipe, t.name),
                        ne * nr * nch,
                        |em, it0| {
                            let (it, cstart) = if nch > 1 {
                                let row = em.set(Ty::I64, e::div(it0.clone(), nch));
                                let ch = em.set(Ty::I64, e::mul(e::rem(it0, nch), e::i(chunk)));
                                (row, ch)
                            } else {
                                (it0, e::i(0))
                            };
                            let ex = em.set(Ty::I64, e::div(it.clone(), nr));
                            let r = em.set(Ty::I64, e::rem(it.clone(), nr));
                            let sr = match &rows {
                                Some(iv) => em.set(Ty::I64, index_vec_expr(iv, r, &atoms)),
                                None => r,
                            };
                            let src_base = em.set(
                                Ty::I64,
                                e::add(e::mul(ex, e::i(nr * nc)), e::mul(sr, e::i(nc))),
                            );
                            let dst_base = em.set(Ty::I64, e::mul(it, e::i(nc)));
                            if nch > 1 {
                                // GPU form: one packed load and store.
                                let xs = load_block(
                                    em,
                                    xb,
                                    xelem,
                                    e::add(src_base.clone(), cstart.clone()),
                                    chunk as usize,
                                );
                                store_block(
                                    em,
                                    out,
                                    xelem,
                                    e::add(dst_base.clone(), cstart.clone()),
                                    xs,
                                );
                                return Ok(());
                            }
                            em.for_(
                                cstart.clone(),
                                e::add(cstart.clone(), e::i(clen)),
                                |b, c| {
                                    b.out.push(Stmt::Store {
                                        buf: out,
                                        index: e::add(dst_base.clone(), c.clone()),
                                        value: e::load(xb, e::add(src_base.clone(), c)),
                                    });
                                },
                            );
                            Ok(())
                        },
                    );
                }
                if rows.is_none() {
                    let n: i64 = shape.iter().product();
                    return self.kernel(
                        format!("{}_{}_copy", self.prog.recipe, t.name),
                        n,
                        |em, it| {
                            em.out.push(Stmt::Store {
                                buf: out,
                                index: it.clone(),
                                value: e::load(xb, it),
                            });
                            Ok(())
                        },
                    );
                }
            }
        }
        // Per-expert f32 arithmetic: [E] params from scalars, [E] vectors and collective maxima.
        if t.dtype != DType::F32 || t.shape.len() != 1 {
            return self.generic(id, out);
        }
        let ne = self.int(&t.shape[0])?;
        self.prepare_reduces(&t.name, v)?;
        let name = format!("{}_{}", self.prog.recipe, t.name);
        let this = &*self;
        let mut err = None;
        let mut va = VarAlloc::default();
        let item = va.new_var(Ty::I64);
        let body = {
            let mut em = Emit::new(&mut va);
            match this.scalar_expr(&t.name, v, e::v(item)) {
                Ok(x) => em.out.push(Stmt::Store {
                    buf: out,
                    index: e::v(item),
                    value: x,
                }),
                Err(er) => err = Some(er),
            }
            em.out
        };
        if let Some(er) = err {
            return Err(er);
        }
        self.prog
            .steps
            .push(Step::Kernel(va.kernel(name, item, ne, body)));
        Ok(())
    }

    /// Any other param: one work item per element of its (unpadded) value, which is evaluated at
    /// that element's coordinate through the value's definition (gathers, slices, indexing,
    /// permutes, reshapes, concatenation, padding, broadcasts, f32 arithmetic, reductions), read
    /// from inputs and earlier params, and stored row-major (a storage layout and the padding are
    /// the relayout kernel's). The scalar path for every expression the language accepts.
    fn generic(&mut self, id: TensorId, out: BufId) -> Result<()> {
        let t = self.tensor(id)?.clone();
        let v = t.value.ok_or(Error::Internal("param value"))?;
        let v = match self.op(v)? {
            Op::Swizzle128x4 { base } | Op::Pad { base, .. } => base,
            _ => v,
        };
        if t.dtype == DType::E2m1 {
            return Err(unsupported(
                &t.name,
                "a computed 4-bit param (only copies and quantizations write FP4)",
            ));
        }
        if matches!(t.dtype, DType::Bf16 | DType::F16) && self.has_arith(v)? {
            return Err(unsupported(
                &t.name,
                "arithmetic stored as bf16/f16 (it would round): declare the param f32",
            ));
        }
        let kname = format!("{}_{}", self.prog.recipe, t.name);
        self.elem_kernel(&t.name, kname, v, out)
    }

    /// One work item per element of `v` (row-major): the element, evaluated by [`Self::elem_expr`],
    /// stored at its row-major index of `out`.
    fn elem_kernel(&mut self, name: &str, kname: String, v: ValueId, out: BufId) -> Result<()> {
        self.prepare_reduces(name, v)?;
        let shape = self.shape(v)?;
        let n: i64 = shape.iter().product();
        let this = &*self;
        let mut err = None;
        let mut va = VarAlloc::default();
        let item = va.new_var(Ty::I64);
        let body = {
            let mut em = Emit::new(&mut va);
            let mut coord = vec![e::i(0); shape.len()];
            let mut rest = e::v(item);
            for k in (0..shape.len()).rev() {
                coord[k] = em.set(Ty::I64, e::rem(rest.clone(), shape[k]));
                rest = e::div(rest, shape[k]);
            }
            match this.elem_expr(&mut em, name, v, &coord) {
                Ok(x) => em.out.push(Stmt::Store {
                    buf: out,
                    index: e::v(item),
                    value: x,
                }),
                Err(er) => err = Some(er),
            }
            em.out
        };
        if let Some(er) = err {
            return Err(er);
        }
        self.prog
            .steps
            .push(Step::Kernel(va.kernel(kname, item, n, body)));
        Ok(())
    }

    /// A tensor expression evaluated into a row-major temporary (bf16 where it is a bf16 value
    /// without arithmetic, else f32): the input of a quantization that is not a checkpoint input.
    fn materialize(&mut self, name: &str, v: ValueId) -> Result<BufId> {
        let shape = self.shape(v)?;
        let n: i64 = shape.iter().product();
        let d = self
            .info
            .module()
            .value(v)
            .ok_or(Error::Internal("value"))?
            .dtype;
        let elem = if d == DType::Bf16 && !self.has_arith(v)? {
            Elem::Bf16
        } else {
            Elem::F32
        };
        let len = usize::try_from(n).map_err(|_| Error::Internal("size"))?;
        let tb = self.buf(
            BufRole::Temp(format!("{name}_input{}", v.0)),
            elem,
            len,
            false,
        );
        let kname = format!("{}_{name}_input{}", self.prog.recipe, v.0);
        self.elem_kernel(name, kname, v, tb)?;
        Ok(tb)
    }

    /// Whether a value's definition does arithmetic (through lets).
    fn has_arith(&self, v: ValueId) -> Result<bool> {
        let v = self.through_lets(v)?;
        let op = self.op(v)?;
        if matches!(op, Op::Arith { .. }) {
            return Ok(true);
        }
        for o in op.operands() {
            if self.has_arith(o)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The element of value `v` at a logical coordinate (one index per dimension of `v`).
    fn elem_expr(&self, em: &mut Emit<'_>, name: &str, v: ValueId, coord: &[Expr]) -> Result<Expr> {
        let v = self.through_lets(v)?;
        let op = self.op(v)?;
        let shape_of = |x: ValueId| self.shape(x);
        let rm = |c: &[Expr], s: &[i64]| {
            let mut at = e::i(0);
            let mut acc = 1;
            for k in (0..s.len()).rev() {
                at = e::add(at, e::mul(c[k].clone(), e::i(acc)));
                acc *= s[k];
            }
            at
        };
        Ok(match op {
            Op::Const(c) => e::f(c as f32),
            Op::Tensor(t) => {
                let b = self
                    .params
                    .get(&t)
                    .or(self.inputs.get(&t))
                    .copied()
                    .ok_or_else(|| {
                        unsupported(
                            name,
                            "reading a tensor that is neither an input nor an earlier param",
                        )
                    })?;
                let s = shape_of(v)?;
                let at = match self.scale_maps.get(&t) {
                    Some(map) => map.index(coord),
                    None => rm(coord, &s),
                };
                e::load(b, at)
            }
            Op::Arith { op, lhs, rhs } => {
                let operand = |em: &mut Emit<'_>, x: ValueId| -> Result<Expr> {
                    let scalar = self.shape(x)?.is_empty();
                    self.elem_expr(em, name, x, if scalar { &[] } else { coord })
                };
                let a = operand(em, lhs)?;
                let b = operand(em, rhs)?;
                match op {
                    Arith::Mul => fmul(a, b),
                    Arith::Div => fdiv(a, b),
                }
            }
            Op::Broadcast { base } => self.elem_expr(em, name, base, &[])?,
            Op::ReduceMax { .. } => {
                let b = self
                    .reduces
                    .get(&v)
                    .copied()
                    .ok_or(Error::Internal("reduction not prepared"))?;
                e::load(b, e::i(0))
            }
            Op::Field { quant, field } => {
                let qt = self.quants.get(&quant).ok_or_else(|| {
                    unsupported(name, "a quantization output used before any param holds it")
                })?;
                let b = match field {
                    QuantField::GlobalScale => qt.gs,
                    QuantField::DecodeScale => qt.decode,
                    QuantField::Scales => qt.fp8_scale,
                    QuantField::Values => None,
                };
                let b = b.ok_or_else(|| {
                    unsupported(
                        name,
                        "this quantization output outside its own param (read the param instead)",
                    )
                })?;
                e::load(b, coord.first().cloned().unwrap_or(e::i(0)))
            }
            Op::Slice {
                base, dim, start, ..
            } => {
                let mut c = coord.to_vec();
                c[dim] = e::add(c[dim].clone(), e::i(self.int(&start)?));
                self.elem_expr(em, name, base, &c)?
            }
            Op::Select { base, dim, index } => {
                let mut c = coord.to_vec();
                c.insert(dim, e::i(self.int(&index)?));
                self.elem_expr(em, name, base, &c)?
            }
            Op::Permute { base, perm } => {
                let mut c = vec![e::i(0); perm.len()];
                for (k, &p) in perm.iter().enumerate() {
                    c[p] = coord[k].clone();
                }
                self.elem_expr(em, name, base, &c)?
            }
            Op::Reshape { base, .. } => {
                let lin = em.set(Ty::I64, rm(coord, &shape_of(v)?));
                let bs = shape_of(base)?;
                let mut c = vec![e::i(0); bs.len()];
                let mut rest = lin;
                for k in (0..bs.len()).rev() {
                    c[k] = em.set(Ty::I64, e::rem(rest.clone(), bs[k]));
                    rest = e::div(rest, bs[k]);
                }
                self.elem_expr(em, name, base, &c)?
            }
            Op::Gather { base, dim, index } => {
                let atoms = self.info.binding().ok_or(Error::Unbound)?.atoms().to_vec();
                let mut c = coord.to_vec();
                c[dim] = em.set(Ty::I64, index_vec_expr(&index, c[dim].clone(), &atoms));
                self.elem_expr(em, name, base, &c)?
            }
            Op::Pad { base, .. } | Op::Swizzle128x4 { base } => {
                // Inside the source: its element; outside: zero. Loads use clamped coordinates.
                let bs = shape_of(base)?;
                let mut inside = e::i32(1);
                let mut c = Vec::with_capacity(bs.len());
                for (k, &n) in bs.iter().enumerate() {
                    let lt = e::bin(BinOp::ILt, coord[k].clone(), e::i(n));
                    inside = e::bin(BinOp::And, inside, e::un(UnOp::BoolToI, lt.clone()));
                    c.push(em.set(Ty::I64, e::sel(lt, coord[k].clone(), e::i(0))));
                }
                let x = self.elem_expr(em, name, base, &c)?;
                let zero = self.zero_of(base)?;
                e::sel(e::bin(BinOp::IEq, inside, e::i32(1)), x, zero)
            }
            Op::Cat { parts, dim } => {
                // Part j covers [o_j, o_j + n_j) along `dim`; each part reads at a clamped index.
                let mut acc: Option<Expr> = None;
                let mut off = 0i64;
                let mut parts_x = Vec::new();
                for part in &parts {
                    let n = shape_of(*part)?[dim];
                    let mut c = coord.to_vec();
                    let local = e::bin(BinOp::ISub, coord[dim].clone(), e::i(off));
                    let ok = e::bin(
                        BinOp::And,
                        e::un(
                            UnOp::BoolToI,
                            e::bin(BinOp::ILt, e::i(off - 1), coord[dim].clone()),
                        ),
                        e::un(
                            UnOp::BoolToI,
                            e::bin(BinOp::ILt, coord[dim].clone(), e::i(off + n)),
                        ),
                    );
                    let ok = em.set(Ty::I32, ok);
                    c[dim] = em.set(
                        Ty::I64,
                        e::sel(e::bin(BinOp::IEq, ok.clone(), e::i32(1)), local, e::i(0)),
                    );
                    let x = self.elem_expr(em, name, *part, &c)?;
                    parts_x.push((ok, x));
                    off += n;
                }
                for (ok, x) in parts_x.into_iter().rev() {
                    acc = Some(match acc {
                        None => x,
                        Some(rest) => e::sel(e::bin(BinOp::IEq, ok, e::i32(1)), x, rest),
                    });
                }
                acc.ok_or_else(|| unsupported(name, "`cat` of nothing"))?
            }
            other => {
                return Err(unsupported(
                    name,
                    format!("{} in a param's definition", other.describe()),
                ))
            }
        })
    }

    /// The zero of a value's element type in the IR (i32 for bytes, f32 otherwise).
    fn zero_of(&self, v: ValueId) -> Result<Expr> {
        let d = self
            .info
            .module()
            .value(v)
            .ok_or(Error::Internal("value"))?
            .dtype;
        Ok(match elem_of(d) {
            Some(Elem::U8) => e::i32(0),
            _ => e::f(0.0),
        })
    }

    /// Emit the reductions (`reduce_max`) a scalar expression needs, each followed by its collective.
    fn prepare_reduces(&mut self, name: &str, v: ValueId) -> Result<()> {
        let v = self.through_lets(v)?;
        let op = self.op(v)?;
        for o in op.operands() {
            self.prepare_reduces(name, o)?;
        }
        if let Op::ReduceMax { base, group } = op {
            if self.reduces.contains_key(&v) {
                return Ok(());
            }
            let Op::Tensor(src) = self.op(base)? else {
                return Err(unsupported(name, "`reduce_max` of anything but a tensor"));
            };
            let xb = self
                .inputs
                .get(&src)
                .or(self.params.get(&src))
                .copied()
                .ok_or_else(|| unsupported(name, "`reduce_max` of a tensor that is not stored"))?;
            let n: i64 = self.shape(base)?.iter().product();
            let tb = self.buf(
                BufRole::Temp(format!("{name}_max{}", v.0)),
                Elem::F32,
                1,
                false,
            );
            self.kernel(
                format!("{}_{name}_max{}", self.prog.recipe, v.0),
                1,
                |em, _it| {
                    let mx = em.var(Ty::F32, e::f(f32::NEG_INFINITY));
                    em.for_(e::i(0), e::i(n), |b, i| {
                        b.out.push(Stmt::Set(mx, fmax(e::v(mx), e::load(xb, i))));
                    });
                    em.out.push(Stmt::Store {
                        buf: tb,
                        index: e::i(0),
                        value: e::v(mx),
                    });
                    Ok(())
                },
            )?;
            if group != Group::None {
                self.prog.steps.push(Step::AllReduceMax {
                    buf: tb,
                    group: group.name().to_string(),
                });
            }
            self.reduces.insert(v, tb);
        }
        Ok(())
    }

    /// A `let` tensor stands for its definition.
    fn through_lets(&self, v: ValueId) -> Result<ValueId> {
        if let Op::Tensor(t) = self.op(v)? {
            let tt = self.tensor(t)?;
            if tt.kind == TensorKind::Let {
                let d = tt.value.ok_or(Error::Internal("let without value"))?;
                return self.through_lets(d);
            }
        }
        Ok(v)
    }

    fn scalar_expr(&self, name: &str, v: ValueId, ex: Expr) -> Result<Expr> {
        let v = self.through_lets(v)?;
        let val = self
            .info
            .module()
            .value(v)
            .ok_or(Error::Internal("value"))?;
        let per_expert = !val.shape.is_empty();
        let idx = if per_expert { ex.clone() } else { e::i(0) };
        Ok(match &val.op {
            Op::Const(c) => e::f(*c as f32),
            Op::Tensor(t) => {
                let b = self
                    .params
                    .get(t)
                    .or(self.inputs.get(t))
                    .copied()
                    .ok_or_else(|| {
                        unsupported(
                            name,
                            "reading a tensor that is neither an input nor an earlier param",
                        )
                    })?;
                if val.shape.len() > 1 || self.tensor(*t)?.dtype != DType::F32 {
                    return Err(unsupported(
                        name,
                        "arithmetic on a tensor that is not f32[E] or a scalar",
                    ));
                }
                e::load(b, idx)
            }
            Op::Arith { op, lhs, rhs } => {
                let a = self.scalar_expr(name, *lhs, ex.clone())?;
                let b = self.scalar_expr(name, *rhs, ex)?;
                match op {
                    Arith::Mul => fmul(a, b),
                    Arith::Div => fdiv(a, b),
                }
            }
            Op::Broadcast { base } => self.scalar_expr(name, *base, ex)?,
            Op::ReduceMax { .. } => {
                let b = self
                    .reduces
                    .get(&v)
                    .copied()
                    .ok_or(Error::Internal("reduction not prepared"))?;
                e::load(b, e::i(0))
            }
            Op::Field { quant, field } => {
                let qt = self.quants.get(quant).ok_or_else(|| {
                    unsupported(name, "a quantization output used before any param holds it")
                })?;
                let b = match field {
                    QuantField::GlobalScale => qt.gs,
                    QuantField::DecodeScale => qt.decode,
                    QuantField::Scales => qt.fp8_scale,
                    QuantField::Values => None,
                };
                e::load(
                    b.ok_or_else(|| unsupported(name, "this quantization output in arithmetic"))?,
                    idx,
                )
            }
            other => {
                return Err(unsupported(
                    name,
                    format!("{} in per-expert arithmetic", other.describe()),
                ))
            }
        })
    }
}

/// A per-block work item's place: its output row (`[E * rows]`), first block (GPU form), expert, row
/// within the expert, and the input offset of its source row.
struct ItemRow {
    it: Expr,
    first: Expr,
    ex: Expr,
    r: Expr,
    base: Expr,
}

/// How the work items of a per-block pass (NVFP4, MXFP4) cover a row of `nb` blocks. Host form
/// (`x4`): one item per row, looping over its blocks. GPU form: `nb / bpi` items per row, each taking
/// `bpi` blocks `nb / bpi` apart, unrolled (`bpi` where it divides `nb`, else 1): neighbouring threads
/// take neighbouring blocks, and an item's blocks share the row's index arithmetic.
struct RowBlocks {
    nb: i64,
    bpi: i64,
    x4: bool,
}

impl RowBlocks {
    fn new(nb: i64, bpi: i64, x4: bool) -> RowBlocks {
        let bpi = if nb % bpi == 0 { bpi } else { 1 };
        RowBlocks { nb, bpi, x4 }
    }

    fn items_per_row(&self) -> i64 {
        if self.x4 {
            1
        } else {
            self.nb / self.bpi
        }
    }

    /// Where work item `it0` is, in `[E, rows, cols]` inputs whose row `r` is read from row
    /// `src_row(r)` of its expert.
    fn locate(
        &self,
        em: &mut Emit<'_>,
        it0: Expr,
        (rows, cols): (i64, i64),
        src_row: &dyn Fn(&mut Emit<'_>, Expr) -> Expr,
    ) -> ItemRow {
        let (it, first) = if self.x4 {
            (it0, e::i(0))
        } else {
            let ipr = self.items_per_row();
            let row = em.set(Ty::I64, e::div(it0.clone(), ipr));
            (row, em.set(Ty::I64, e::rem(it0, ipr)))
        };
        let ex = em.set(Ty::I64, e::div(it.clone(), rows));
        let r = em.set(Ty::I64, e::rem(it.clone(), rows));
        let sr = src_row(em, r.clone());
        let base = em.set(
            Ty::I64,
            e::add(
                e::mul(ex.clone(), e::i(rows * cols)),
                e::mul(sr, e::i(cols)),
            ),
        );
        ItemRow {
            it,
            first,
            ex,
            r,
            base,
        }
    }

    /// Block `k` of an item whose first block is `first` (GPU form).
    fn block_of(&self, first: &Expr, k: Expr) -> Expr {
        e::add(first.clone(), e::mul(k, e::i(self.items_per_row())))
    }

    /// `block(j)` for every block `j` of the item.
    fn blocks(&self, em: &mut Emit<'_>, first: Expr, block: impl Fn(&mut Emit<'_>, Expr)) {
        if self.x4 {
            em.for_(e::i(0), e::i(self.nb), block);
            return;
        }
        self.blocks_k(em, first, |b, j, _| block(b, j));
    }

    /// GPU form: `block(j, k)` for the item's `k`-th block `j`.
    fn blocks_k(&self, em: &mut Emit<'_>, first: Expr, block: impl Fn(&mut Emit<'_>, Expr, i64)) {
        let ipr = self.items_per_row();
        for k in 0..self.bpi {
            block(em, e::add(first.clone(), e::i(k * ipr)), k);
        }
    }
}

/// Threads for a group work item of `n` sub-items: a warp for short rows (its shuffles are the whole
/// reduction), else a CTA whose size divides `n` into at most 16 trips per thread where one does (the
/// PTX backend then unrolls the loop, keeping every load in flight), else 256.
fn row_group(n: i64) -> u32 {
    if n < 512 {
        return 32;
    }
    for g in [256, 128, 64] {
        if n % g == 0 && n / g <= 16 {
            return g as u32;
        }
    }
    256
}

/// Load `n` consecutive elements starting at an aligned `index` as packed accesses of at most 16
/// bytes (vector loads on the GPU); returns the values.
fn load_block(em: &mut Emit<'_>, buf: BufId, elem: Elem, index: Expr, n: usize) -> Vec<Expr> {
    let per = (16 / elem.size()).min(n).max(1);
    let mut out = Vec::with_capacity(n);
    let at = em.set(Ty::I64, index);
    for c in (0..n).step_by(per) {
        let dst: Vec<crate::kir::Var> = (0..per.min(n - c))
            .map(|_| em.vars.new_var(elem.ty()))
            .collect();
        out.extend(dst.iter().map(|v| e::v(*v)));
        em.out.push(Stmt::LoadPacked {
            buf,
            index: e::add(at.clone(), e::i(c as i64)),
            dst,
        });
    }
    out
}

/// Store values to consecutive elements from an aligned `index` as packed accesses of at most 16
/// bytes (vector stores on the GPU).
fn store_block(em: &mut Emit<'_>, buf: BufId, elem: Elem, index: Expr, values: Vec<Expr>) {
    let per = (16 / elem.size()).max(1);
    let at = em.set(Ty::I64, index);
    for (k, chunk) in values.chunks(per).enumerate() {
        em.out.push(Stmt::StorePacked {
            buf,
            index: e::add(at.clone(), e::i((k * per) as i64)),
            values: chunk.to_vec(),
        });
    }
}

/// A block of `n` consecutive float values at an aligned `index`, loaded once: `n/4` f32x4 vectors in
/// the host form, 16-byte packed accesses in the GPU form.
fn load_fp_block(
    em: &mut Emit<'_>,
    buf: BufId,
    elem: Elem,
    index: Expr,
    n: i64,
    x4: bool,
) -> Vec<Expr> {
    if x4 {
        (0..n / 4)
            .map(|q| {
                em.set(
                    Ty::F32x4,
                    e::load_x4(buf, e::add(index.clone(), e::i(4 * q))),
                )
            })
            .collect()
    } else {
        load_block(em, buf, elem, index, n as usize)
    }
}

/// `max |x|` over a block from [`load_fp_block`]: one [`Expr::AbsMax`] in the GPU form (packed bf16
/// pairs there), a balanced tree across the 4-lane vectors and then their lanes in the host form.
fn abs_max(em: &mut Emit<'_>, xs: &[Expr], x4: bool) -> Expr {
    if !x4 {
        return Expr::AbsMax(xs.to_vec());
    }
    let m = max_tree(xs.iter().map(|x| fabs(x.clone())).collect());
    let mv = em.set(Ty::F32x4, m);
    max_tree((0..4).map(|k| e::lane(mv.clone(), k)).collect())
}

/// Store block `j` of row `row` (rows `cols` values long) as packed FP4 bytes (see [`e2m1_bytes`]);
/// the block is `xs.len()` values (`4 * xs.len()` in the host form, whose `xs` are 4-lane vectors).
fn store_fp4_block(
    b: &mut Emit<'_>,
    vb: BufId,
    (row, j, cols): (Expr, Expr, i64),
    xs: &[Expr],
    scale_zero: (&Expr, &Expr),
    x4: bool,
    small: bool,
) {
    let len = if x4 { 4 * xs.len() } else { xs.len() } as i64;
    let at = b.set(
        Ty::I64,
        e::add(e::mul(row, e::i(cols / 2)), e::mul(j, e::i(len / 2))),
    );
    let bytes = e2m1_bytes(b, xs, scale_zero, x4, small);
    store_block(b, vb, Elem::U8, at, bytes);
}

/// The packed FP4 bytes of a block: E2M1 codes of `x * scale` (saturating at ±6), element 2k in the
/// low nibble, and all-zero bytes when `zero` holds (a zero block scale). In the GPU form every 8
/// values are one [`Expr::PackE2m1`] word, its bytes stored as the word; `small` (GPU form only)
/// promises `|x * scale| < 7`.
fn e2m1_bytes(
    em: &mut Emit<'_>,
    xs: &[Expr],
    (scale, zero): (&Expr, &Expr),
    x4: bool,
    small: bool,
) -> Vec<Expr> {
    if !x4 {
        // fma(x, scale, -0) is x * scale to the bit (adding -0 changes nothing, a -0 product
        // included); in a zero block (scale 0) the addend is +0, which makes every product +0, so
        // every code is 0 without a select per byte.
        let zadd = em.set(Ty::F32, e::sel(zero.clone(), e::f(0.0), e::f(-0.0)));
        let mut bytes = Vec::with_capacity(xs.len().div_ceil(2));
        for q in xs.chunks(8) {
            let vals = q
                .iter()
                .map(|x| e::fma(x.clone(), scale.clone(), zadd.clone()))
                .collect();
            let w = em.set(Ty::I32, Expr::PackE2m1 { vals, small });
            bytes.extend((0..q.len().div_ceil(2)).map(|k| e::un(UnOp::Byte(k as u8), w.clone())));
        }
        return bytes;
    }
    let vc: Vec<Expr> = xs
        .iter()
        .map(|v| em.vector(|bv| quant::e2m1_rne(bv, fmul(v.clone(), scale.clone()))))
        .collect();
    let codes: Vec<Expr> = (0..4 * vc.len())
        .map(|c| e::lane(vc[c / 4].clone(), (c % 4) as u8))
        .collect();
    codes
        .chunks(2)
        .map(|p| {
            let byte = e::bin(
                BinOp::Or,
                p[0].clone(),
                e::bin(BinOp::Shl, p[1].clone(), e::i32(4)),
            );
            e::sel(zero.clone(), e::i32(0), byte)
        })
        .collect()
}

/// E4M3 codes of `xs * inv`, saturating at ±448 (SPEC §5's FP8 quantization with a reciprocal scale).
fn e4m3_codes(em: &mut Emit<'_>, xs: Vec<Expr>, inv: &Expr) -> Vec<Expr> {
    xs.into_iter()
        .map(|x| quant::e4m3_rne(em, fmul(x, inv.clone())))
        .collect()
}

/// `max` of several f32 values as a balanced tree (short dependency chains).
fn max_tree(mut v: Vec<Expr>) -> Expr {
    while v.len() > 1 {
        let mut next = Vec::with_capacity(v.len().div_ceil(2));
        let mut it = v.into_iter();
        while let Some(a) = it.next() {
            next.push(match it.next() {
                Some(b) => fmax(a, b),
                None => a,
            });
        }
        v = next;
    }
    v.pop().unwrap_or(e::f(0.0))
}

fn imax(a: Expr, b: Expr) -> Expr {
    e::sel(e::bin(BinOp::ILt, a.clone(), b.clone()), b, a)
}

fn imin(a: Expr, b: Expr) -> Expr {
    e::sel(e::bin(BinOp::ILt, a.clone(), b.clone()), a, b)
}

/// The source index of output position `j` of a row index vector, at a binding.
pub fn index_vec_expr(iv: &IndexVec, j: Expr, atoms: &[i128]) -> Expr {
    match iv {
        IndexVec::Identity(_) => j,
        IndexVec::SwapHalves(n) => {
            let half = (n.eval(atoms).unwrap_or(0) / 2) as i64;
            e::sel(
                e::bin(BinOp::ILt, j.clone(), e::i(half)),
                e::add(j.clone(), e::i(half)),
                e::bin(BinOp::ISub, j, e::i(half)),
            )
        }
        IndexVec::Interleave { base, group } => {
            let n = base.len().eval(atoms).unwrap_or(0) as i64;
            let g = *group;
            let t = e::div(j.clone(), 2 * g);
            let rem = e::rem(j, 2 * g);
            let h = e::div(rem.clone(), g);
            let r = e::rem(rem, g);
            let src = e::add(e::add(e::mul(h, e::i(n / 2)), e::mul(t, e::i(g))), r);
            index_vec_expr(base, src, atoms)
        }
    }
}
