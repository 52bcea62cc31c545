//! Copies of checkpoint inputs (through a row gather), 16 bytes per work item in the GPU form.

use moeforge_dsl::ir::{DType, Op, TensorId};

use super::*;
use crate::kir::{e, Elem, Stmt, Ty};
use crate::{Error, Result};

impl Planner<'_> {
    /// A param that is not a quantization output: a copy or per-expert f32 arithmetic.
    pub(super) fn other(&mut self, id: TensorId) -> Result<()> {
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
                if t.dtype.is_packed4() {
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
                    let chunk = (self.sched.access_bytes / xelem.size()) as i64;
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
        let name = format!("{}_{}", self.prog.recipe, t.name);
        self.elem_kernel(&t.name, name, v, out)
    }
}
