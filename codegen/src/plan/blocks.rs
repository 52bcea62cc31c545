//! Block helpers shared by the passes: work-item placement over a row's blocks, packed loads and
//! stores, block maxima, FP4/E4M3 code emission, row-gather index expressions.

use super::PackSchedule;
use moeforge_dsl::ir::IndexVec;

use crate::kir::{e, BinOp, BufId, Elem, Expr, Stmt, Ty, UnOp};
use crate::quant::{self, fabs, fmax, fmul, Emit};

/// A per-block work item's place: its output row (`[E * rows]`), first block (GPU form), expert, row
/// within the expert, and the input offset of its source row.
pub(super) struct ItemRow {
    pub(super) it: Expr,
    pub(super) first: Expr,
    pub(super) ex: Expr,
    pub(super) r: Expr,
    pub(super) base: Expr,
}

/// How the work items of a per-block pass (NVFP4, MXFP4) cover a row of `nb` blocks. Host form
/// (`x4`): one item per row, looping over its blocks. GPU form: `nb / bpi` items per row, each taking
/// `bpi` blocks `nb / bpi` apart, unrolled (`bpi` where it divides `nb`, else 1): neighbouring threads
/// take neighbouring blocks, and an item's blocks share the row's index arithmetic.
pub(super) struct RowBlocks {
    nb: i64,
    pub(super) bpi: i64,
    x4: bool,
}

impl RowBlocks {
    pub(super) fn new(nb: i64, bpi: i64, x4: bool) -> RowBlocks {
        let bpi = if nb % bpi == 0 { bpi } else { 1 };
        RowBlocks { nb, bpi, x4 }
    }

    pub(super) fn items_per_row(&self) -> i64 {
        if self.x4 {
            1
        } else {
            self.nb / self.bpi
        }
    }

    /// Where work item `it0` is, in `[E, rows, cols]` inputs whose row `r` is read from row
    /// `src_row(r)` of its expert.
    pub(super) fn locate(
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
    pub(super) fn block_of(&self, first: &Expr, k: Expr) -> Expr {
        e::add(first.clone(), e::mul(k, e::i(self.items_per_row())))
    }

    /// `block(j)` for every block `j` of the item.
    pub(super) fn blocks(
        &self,
        em: &mut Emit<'_>,
        first: Expr,
        block: impl Fn(&mut Emit<'_>, Expr),
    ) {
        if self.x4 {
            em.for_(e::i(0), e::i(self.nb), block);
            return;
        }
        self.blocks_k(em, first, |b, j, _| block(b, j));
    }

    /// GPU form: `block(j, k)` for the item's `k`-th block `j`.
    pub(super) fn blocks_k(
        &self,
        em: &mut Emit<'_>,
        first: Expr,
        block: impl Fn(&mut Emit<'_>, Expr, i64),
    ) {
        let ipr = self.items_per_row();
        for k in 0..self.bpi {
            block(em, e::add(first.clone(), e::i(k * ipr)), k);
        }
    }
}

/// Threads for a group work item of `n` sub-items: a warp for short rows (its shuffles are the whole
/// reduction), else a CTA whose size divides `n` into at most 16 trips per thread where one does (the
/// PTX backend then unrolls the loop, keeping every load in flight), else 256.
pub(super) fn row_group(n: i64, s: &PackSchedule) -> u32 {
    if n < s.row_warp_below {
        return 32;
    }
    for g in [256, 128, 64] {
        if n % g == 0 && n / g <= s.row_max_trips {
            return g as u32;
        }
    }
    256
}

/// Load `n` consecutive elements starting at an aligned `index` as packed accesses of at most 16
/// bytes (vector loads on the GPU); returns the values.
pub(super) fn load_block(
    em: &mut Emit<'_>,
    buf: BufId,
    elem: Elem,
    index: Expr,
    n: usize,
) -> Vec<Expr> {
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
pub(super) fn store_block(
    em: &mut Emit<'_>,
    buf: BufId,
    elem: Elem,
    index: Expr,
    values: Vec<Expr>,
) {
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
pub(super) fn load_fp_block(
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
pub(super) fn abs_max(em: &mut Emit<'_>, xs: &[Expr], x4: bool) -> Expr {
    if !x4 {
        return Expr::AbsMax(xs.to_vec());
    }
    let m = max_tree(xs.iter().map(|x| fabs(x.clone())).collect());
    let mv = em.set(Ty::F32x4, m);
    max_tree((0..4).map(|k| e::lane(mv.clone(), k)).collect())
}

/// Store block `j` of row `row` (rows `cols` values long) as packed FP4 bytes (see [`e2m1_bytes`]);
/// the block is `xs.len()` values (`4 * xs.len()` in the host form, whose `xs` are 4-lane vectors).
pub(super) fn store_fp4_block(
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
pub(super) fn e2m1_bytes(
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
pub(super) fn e4m3_codes(em: &mut Emit<'_>, xs: Vec<Expr>, inv: &Expr) -> Vec<Expr> {
    xs.into_iter()
        .map(|x| quant::e4m3_rne(em, fmul(x, inv.clone())))
        .collect()
}

/// `max` of several f32 values as a balanced tree (short dependency chains).
pub(super) fn max_tree(mut v: Vec<Expr>) -> Expr {
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

pub(super) fn imax(a: Expr, b: Expr) -> Expr {
    e::sel(e::bin(BinOp::ILt, a.clone(), b.clone()), b, a)
}

pub(super) fn imin(a: Expr, b: Expr) -> Expr {
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
