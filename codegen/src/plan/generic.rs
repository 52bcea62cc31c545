//! The generic element kernel (any param definition, evaluated at a logical coordinate), the
//! materialization of a quantization's tensor-expression input, and per-expert f32 arithmetic.

use moeforge_dsl::ir::{Arith, DType, Group, Op, QuantField, TensorId, TensorKind, ValueId};

use super::*;
use crate::kir::{e, BinOp, BufId, BufRole, Elem, Expr, Step, Stmt, Ty, UnOp, VarAlloc};
use crate::quant::{fdiv, fmax, fmul, Emit};
use crate::{Error, Result};

impl Planner<'_> {
    /// Any other param: one work item per element of its (unpadded) value, which is evaluated at
    /// that element's coordinate through the value's definition (gathers, slices, indexing,
    /// permutes, reshapes, concatenation, padding, broadcasts, f32 arithmetic, reductions), read
    /// from inputs and earlier params, and stored row-major (a storage layout and the padding are
    /// the relayout kernel's). The scalar path for every expression the language accepts.
    pub(super) fn generic(&mut self, id: TensorId, out: BufId) -> Result<()> {
        let t = self.tensor(id)?.clone();
        let v = t.value.ok_or(Error::Internal("param value"))?;
        let (v, _) = moeforge_dsl::roles::unpadded(self.info.module(), v);
        if t.dtype.is_packed4() {
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
    pub(super) fn elem_kernel(
        &mut self,
        name: &str,
        kname: String,
        v: ValueId,
        out: BufId,
    ) -> Result<()> {
        self.prepare_reduces(name, v)?;
        let shape = self.shape(v)?;
        let n: i64 = shape.iter().product();
        let this = &*self;
        let mut err = None;
        let mut va = VarAlloc::default();
        let item = va.new_var(Ty::I64);
        let body = {
            let mut em = Emit::new(&mut va);
            // Row-major coordinates of the item (a rank-1 value's is the item itself).
            let mut coord = vec![e::i(0); shape.len()];
            let mut rest = e::v(item);
            for k in (0..shape.len()).rev() {
                coord[k] = if k == 0 {
                    rest.clone()
                } else {
                    em.set(Ty::I64, e::rem(rest.clone(), shape[k]))
                };
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
    pub(super) fn materialize(&mut self, name: &str, v: ValueId) -> Result<BufId> {
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
    pub(super) fn has_arith(&self, v: ValueId) -> Result<bool> {
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
    pub(super) fn elem_expr(
        &self,
        em: &mut Emit<'_>,
        name: &str,
        v: ValueId,
        coord: &[Expr],
    ) -> Result<Expr> {
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
                    QuantField::Values | QuantField::Zeros => None,
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
    pub(super) fn zero_of(&self, v: ValueId) -> Result<Expr> {
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
    pub(super) fn prepare_reduces(&mut self, name: &str, v: ValueId) -> Result<()> {
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
                self.prog.steps.push(Step::AllReduceMax { buf: tb, group });
            }
            // A MAX over a tensor this rank holds a slice of (an input cut, or a param computed
            // from one) also runs over the groups that cut it; over values already equal on
            // those ranks it changes nothing.
            let mut cut: Vec<Group> = Vec::new();
            for (_, s) in self.cut_inputs_read(base)? {
                for g in s.whole_max_groups() {
                    if g != group && !cut.contains(&g) {
                        cut.push(g);
                    }
                }
            }
            for g in cut {
                self.prog
                    .steps
                    .push(Step::AllReduceMax { buf: tb, group: g });
            }
            self.reduces.insert(v, tb);
        }
        Ok(())
    }

    /// A `let` tensor stands for its definition.
    pub(super) fn through_lets(&self, v: ValueId) -> Result<ValueId> {
        if let Op::Tensor(t) = self.op(v)? {
            let tt = self.tensor(t)?;
            if tt.kind == TensorKind::Let {
                let d = tt.value.ok_or(Error::Internal("let without value"))?;
                return self.through_lets(d);
            }
        }
        Ok(v)
    }
}
