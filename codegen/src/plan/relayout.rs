//! Relayout: a staged (row-major) param, or an input copied straight, into its storage map.

use super::*;
use crate::kir::{e, BinOp, Elem, Expr, Stmt, Ty, UnOp};
use crate::quant::Emit;
use crate::{Error, Result};

impl Planner<'_> {
    /// Copy a staged (row-major, unpadded) param into its storage map, zero-filling the padding:
    /// one work item per `run` elements of the param's last dimension, which the map proves
    /// contiguous (16-byte accesses), or one element (byte pair for 4-bit types) at a time.
    pub(super) fn relayout(&mut self, r: &Relayout) -> Result<()> {
        let t = self.tensor(r.param)?.clone();
        let mut map = self.storage_map(r.param)?;
        let mut shape = map.shape();
        let mut vshape = r.value_shape.clone();
        let elem = self
            .prog
            .buf(r.out)
            .map(|b| b.elem)
            .ok_or(Error::Internal("relayout buffer"))?;
        if t.dtype.is_packed4() {
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
        let max = (self.sched.access_bytes / elem.size()) as i64;
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
}
