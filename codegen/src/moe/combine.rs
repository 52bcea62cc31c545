//! The generated kernels around the MoE layer's second grouped GEMM (issue \[9\]), PTX for
//! `sm_90a` through the typed builder: two entries in one module, launched on one stream with no
//! host synchronization (the row count `offsets[slots]` is read on the device).
//!
//! With `n = T * k` items `i = t * k + j`, the permute's `row_of` (i32 `[n]`: the item of each
//! expert-sorted row, its first `offsets[slots]` valid) and the grouped GEMM's row offsets
//! (`offsets`, i32 `[slots + 1]`), and `pos_of` (i32 `[n]`, each item's row or `-1`: the permute's
//! scatter writes it, [`invert_reference`] is its host form):
//! * [`ROW_SCALES_ENTRY`], a grid-stride loop of one thread per row `r < min(offsets[slots], n)`: `out[r] =
//!   values[slot[row_of[r]]]` (a per-slot value, e.g. a static activation scale, gathered per
//!   row); `1.0` where `row_of[r]` is outside `[0, n)` or the slot outside `[0, slots)`.
//! * [`COMBINE_ENTRY`], a grid-stride loop of one CTA per token: `out[t, c] = bf16_rne(acc)` with
//!   `acc = 0.0; for j in 0..k { p = pos_of[t k + j]; if 0 <= p < n { acc = add.rn(acc,
//!   mul.rn(w[t k + j], y[p, c])) } }`: the host's `acc += w * y` in f32, two roundings, no fma, in
//!   `j` order, so that the kernel and [`combine_reference`] give the same bits for the same `y`.
//!   `H` is compiled in; thread `u` of the CTA holds the chunks of 8 columns `u, u + threads, ...`
//!   (at most 4): two 16-byte loads of `y` per chunk and choice, one 16-byte store of bf16.
//!
//! # Parameters, in order
//! * row scales ([`ROW_SCALES_PARAMS`]): `.u64 row_of`, `.u64 slot` (i32 `[n]`: each item's
//!   physical slot or `-1`), `.u64 values` (f32 `[slots]`), `.u64 offsets`, `.u64 out` (f32 `[n]`,
//!   its first `min(offsets[slots], n)` written), `.u32 slots`, `.u32 n`.
//! * combine ([`COMBINE_PARAMS`]): `.u64 y` (f32 `[n, H]`, 16-byte aligned), `.u64 pos_of` (i32
//!   `[T k]`), `.u64 weights` (f32 `[T k]`), `.u64 out` (bf16 `[T, H]`, 16-byte aligned), `.u32 t`,
//!   `.u32 k`, `.u32 n`.
//!
//! # Launch shapes
//! Row scales: [`CombineLaunch::index_grid`] CTAs of [`INDEX_THREADS`]. Combine:
//! [`CombineLaunch::combine_grid`] CTAs of [`CombineLaunch::combine_threads`].

use super::emit::{entry_params, push_entry, G};
use crate::gemm::emit::Emit as _;
use crate::gemm::reference::bf16_from_f32;
use crate::ptx::{BinOpcode, CmpOp, Entry, Inst, Operand, PtxTy, Reg, SpecialReg};
use crate::{Error, Result};

/// The row-scales kernel's entry name.
pub const ROW_SCALES_ENTRY: &str = "moeforge_moe_row_scales";
/// The combine kernel's entry name.
pub const COMBINE_ENTRY: &str = "moeforge_moe_combine";
/// The row-scales kernel's parameter names, in order.
pub const ROW_SCALES_PARAMS: [&str; 7] = [
    "rs_row_of",
    "rs_slot",
    "rs_values",
    "rs_offsets",
    "rs_out",
    "rs_slots",
    "rs_n",
];
/// The combine kernel's parameter names, in order.
pub const COMBINE_PARAMS: [&str; 7] = [
    "comb_y",
    "comb_pos_of",
    "comb_weights",
    "comb_out",
    "comb_t",
    "comb_k",
    "comb_n",
];
/// The largest hidden size (4 chunks of 8 columns for each of 512 threads).
pub const MAX_HIDDEN: u32 = 16384;
/// Threads per CTA of the row-scales kernel.
pub const INDEX_THREADS: u32 = 256;
/// The most CTAs of the row-scales kernel.
pub const INDEX_MAX_CTAS: u32 = 1024;
/// The most threads per CTA of the combine kernel.
pub const COMBINE_MAX_THREADS: u32 = 512;
/// The most CTAs of the combine kernel.
pub const COMBINE_MAX_CTAS: u32 = 8192;

/// The shape a combine module is generated for, and its launch shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CombineLaunch {
    /// `H` (compiled into the combine kernel).
    pub hidden: u32,
    /// Threads per CTA of the combine kernel (a multiple of 32).
    pub combine_threads: u32,
    /// Threads per CTA of the row-scales kernel ([`INDEX_THREADS`]).
    pub index_threads: u32,
}

impl CombineLaunch {
    /// CTAs of the row-scales kernel for `n` rows (at least 1).
    pub fn index_grid(&self, n: u32) -> u32 {
        n.div_ceil(self.index_threads).clamp(1, INDEX_MAX_CTAS)
    }

    /// CTAs of the combine kernel for `t` tokens (at least 1).
    pub fn combine_grid(&self, t: u32) -> u32 {
        t.clamp(1, COMBINE_MAX_CTAS)
    }

    /// Chunks of 8 columns each combine thread holds (at most 4).
    pub fn chunks_per_thread(&self) -> u32 {
        (self.hidden / 8).div_ceil(self.combine_threads)
    }
}

fn unsupported(what: String) -> Error {
    Error::Unsupported {
        param: "moe combine".into(),
        what,
    }
}

/// The launch shapes at hidden size `hidden`, after checking it: positive, a multiple of 8 and
/// at most [`MAX_HIDDEN`].
pub fn combine_launch(hidden: u32) -> Result<CombineLaunch> {
    if hidden == 0 || !hidden.is_multiple_of(8) || hidden > MAX_HIDDEN {
        return Err(unsupported(format!(
            "H = {hidden} (positive, a multiple of 8, at most {MAX_HIDDEN})"
        )));
    }
    Ok(CombineLaunch {
        hidden,
        combine_threads: (32 * (hidden / 8).div_ceil(32)).min(COMBINE_MAX_THREADS),
        index_threads: INDEX_THREADS,
    })
}

/// The module: PTX (`.version`, `.target sm_90a`, the entries [`ROW_SCALES_ENTRY`],
/// [`COMBINE_ENTRY`]) and its launch shapes. Errors: as [`combine_launch`].
pub fn combine_module(hidden: u32) -> Result<(String, CombineLaunch)> {
    let l = combine_launch(hidden)?;
    let mut s = format!(
        ".version {}\n.target sm_90a\n.address_size 64\n",
        crate::ptx::PTX_VERSION
    );
    for (e, g) in [row_scales(), combine(&l)] {
        push_entry(&mut s, &e, &g)?;
    }
    Ok((s, l))
}

fn row_scales() -> (Entry, G) {
    let mut e = Entry::new(ROW_SCALES_ENTRY);
    e.params = entry_params(&ROW_SCALES_PARAMS, 5, |_| 4);
    e.maxntid = Some(INDEX_THREADS);
    let mut g = G::default();
    let [row_of, slot, values, offsets, out] =
        [0, 1, 2, 3, 4].map(|k| g.global_param(ROW_SCALES_PARAMS[k]));
    let [slots, n] = [5, 6].map(|k| g.u32_param(ROW_SCALES_PARAMS[k]));
    let rows = g.filled_rows(offsets, slots, n);
    let (r, step) = g.grid_stride();
    let (top, store, done) = (
        g.b.label("rs_row"),
        g.b.label("rs_store"),
        g.b.label("rs_done"),
    );
    g.label(&top);
    let past = g.setp(CmpOp::Ge, PtxTy::U32, r, Operand::Reg(rows));
    g.bra(&done, Some((past, false)));
    let v = g.f32();
    g.mov(v, Operand::F32(1.0));
    let a = g.elem(row_of, r, 4);
    let i = g.ld(PtxTy::S32, a);
    let bad = g.setp(CmpOp::Ge, PtxTy::U32, i, Operand::Reg(n));
    g.bra(&store, Some((bad, false)));
    let a = g.elem(slot, i, 4);
    let s = g.ld(PtxTy::S32, a);
    let bad = g.setp(CmpOp::Ge, PtxTy::U32, s, Operand::Reg(slots));
    g.bra(&store, Some((bad, false)));
    let a = g.elem(values, s, 4);
    g.b.push(Inst::Ld {
        ty: PtxTy::F32,
        d: v,
        addr: a,
    });
    g.label(&store);
    let a = g.elem(out, r, 4);
    g.b.push(Inst::St {
        ty: PtxTy::F32,
        addr: a,
        v,
    });
    g.bin_to(r, BinOpcode::Add, PtxTy::U32, r, Operand::Reg(step));
    g.bra(&top, None);
    g.label(&done);
    g.b.push(Inst::Ret);
    (e, g)
}

fn combine(l: &CombineLaunch) -> (Entry, G) {
    let mut e = Entry::new(COMBINE_ENTRY);
    e.params = entry_params(
        &COMBINE_PARAMS,
        4,
        |k| if k == 0 || k == 3 { 16 } else { 4 },
    );
    e.maxntid = Some(l.combine_threads);
    let mut g = G::default();
    let [y, pos_of, weights, out] = [0, 1, 2, 3].map(|k| g.global_param(COMBINE_PARAMS[k]));
    let [t_count, k, n] = [4, 5, 6].map(|i| g.u32_param(COMBINE_PARAMS[i]));
    let threads = l.combine_threads;
    let chunks = l.hidden / 8;
    let cpt = l.chunks_per_thread();
    let h = i64::from(l.hidden);
    let tid = g.special(SpecialReg::TidX);
    let cta = g.special(SpecialReg::CtaidX);
    let ncta = g.special(SpecialReg::NctaidX);
    let valid = g.chunk_guards(tid, chunks, threads, cpt);
    let y_tid = g.bin(BinOpcode::MulWide, PtxTy::U32, tid, Operand::Int(32));
    let y_t = g.bin(BinOpcode::Add, PtxTy::U64, y, Operand::Reg(y_tid));
    let o_tid = g.bin(BinOpcode::MulWide, PtxTy::U32, tid, Operand::Int(16));
    let o_t = g.bin(BinOpcode::Add, PtxTy::U64, out, Operand::Reg(o_tid));
    let t = g.r32();
    g.mov(t, Operand::Reg(cta));
    let (top, done) = (g.b.label("comb_token"), g.b.label("comb_done"));
    g.label(&top);
    let past = g.setp(CmpOp::Ge, PtxTy::U32, t, Operand::Reg(t_count));
    g.bra(&done, Some((past, false)));
    let acc: Vec<[Reg; 8]> = (0..cpt)
        .map(|_| {
            let a: [Reg; 8] = std::array::from_fn(|_| g.f32());
            for &r in &a {
                g.mov(r, Operand::F32(0.0));
            }
            a
        })
        .collect();
    // Items t k + j, j in 0..k, in order.
    let item = g.bin(BinOpcode::MulLo, PtxTy::U32, t, Operand::Reg(k));
    let end = g.bin(BinOpcode::Add, PtxTy::U32, item, Operand::Reg(k));
    let (jtop, jnext, jdone) = (
        g.b.label("comb_choice"),
        g.b.label("comb_next"),
        g.b.label("comb_sum"),
    );
    g.label(&jtop);
    let over = g.setp(CmpOp::Ge, PtxTy::U32, item, Operand::Reg(end));
    g.bra(&jdone, Some((over, false)));
    let a = g.elem(pos_of, item, 4);
    let p = g.ld(PtxTy::S32, a);
    let a = g.elem(weights, item, 4);
    let w = g.ld(PtxTy::F32, a);
    let absent = g.setp(CmpOp::Ge, PtxTy::U32, p, Operand::Reg(n));
    g.bra(&jnext, Some((absent, false)));
    let row = g.elem(y_t, p, 4 * h);
    for (i, (acc, v)) in acc.iter().zip(&valid).enumerate() {
        let skip = v.map(|pred| {
            let lab = g.b.label("comb_skip_chunk");
            g.bra(&lab, Some((pred, true)));
            lab
        });
        let base = g.offset(row, 32 * i64::from(threads) * i as i64);
        let lo = g.ld4_f32(base);
        let hi_addr = g.offset(base, 16);
        let hi = g.ld4_f32(hi_addr);
        for (c, &yv) in lo.iter().chain(&hi).enumerate() {
            let prod = g.bin(BinOpcode::MulRn, PtxTy::F32, w, Operand::Reg(yv));
            g.bin_to(
                acc[c],
                BinOpcode::AddRn,
                PtxTy::F32,
                acc[c],
                Operand::Reg(prod),
            );
        }
        if let Some(lab) = skip {
            g.label(&lab);
        }
    }
    g.label(&jnext);
    g.bin_to(item, BinOpcode::Add, PtxTy::U32, item, Operand::Int(1));
    g.bra(&jtop, None);
    g.label(&jdone);
    let orow = g.elem(o_t, t, 2 * h);
    for (i, (acc, v)) in acc.iter().zip(&valid).enumerate() {
        let skip = v.map(|pred| {
            let lab = g.b.label("comb_skip_store");
            g.bra(&lab, Some((pred, true)));
            lab
        });
        let words: Vec<Reg> = (0..4)
            .map(|q| g.bf16x2(acc[2 * q], acc[2 * q + 1]))
            .collect();
        let a = g.offset(orow, 16 * i64::from(threads) * i as i64);
        g.b.push(Inst::StV { words, addr: a });
        if let Some(lab) = skip {
            g.label(&lab);
        }
    }
    g.bin_to(t, BinOpcode::Add, PtxTy::U32, t, Operand::Reg(ncta));
    g.bra(&top, None);
    g.label(&done);
    g.b.push(Inst::Ret);
    (e, g)
}

fn too_short(name: &str, got: usize, want: usize, bytes: usize) -> Result<()> {
    if got < want {
        return Err(Error::BufferSize {
            name: name.into(),
            expected: want * bytes,
            got: got * bytes,
        });
    }
    Ok(())
}

/// `min(max(offsets[slots], 0), n)`. Errors: fewer than `slots + 1` offsets.
fn filled(offsets: &[i32], slots: usize, n: usize) -> Result<usize> {
    too_short("offsets", offsets.len(), slots + 1, 4)?;
    Ok((offsets[slots].max(0) as usize).min(n))
}

/// `pos_of` on the host (what the permute's scatter writes beside `row_of`): i32 `[n]`, `-1` where
/// no row holds the item, from the first `min(offsets[slots], n)` rows of `row_of`. Where two rows
/// name one item (never after the permute) the later row wins. Errors: `offsets` or `row_of` too
/// short.
pub fn invert_reference(
    row_of: &[i32],
    offsets: &[i32],
    slots: usize,
    n: usize,
) -> Result<Vec<i32>> {
    let rows = filled(offsets, slots, n)?;
    too_short("row_of", row_of.len(), rows, 4)?;
    let mut pos_of = vec![-1i32; n];
    for (r, &i) in row_of[..rows].iter().enumerate() {
        if let Some(p) = usize::try_from(i).ok().and_then(|i| pos_of.get_mut(i)) {
            *p = r as i32;
        }
    }
    Ok(pos_of)
}

/// The row-scales kernel on the host: `out[r]` for the first `min(offsets[slots], n)` rows (the
/// kernel leaves the rest of `out` untouched): `values[slot[row_of[r]]]`, 1.0 where `row_of[r]`
/// is outside `[0, n)` or the slot outside `[0, slots)`. Errors: a buffer too short.
pub fn row_scales_reference(
    row_of: &[i32],
    slot: &[i32],
    values: &[f32],
    offsets: &[i32],
    slots: usize,
    n: usize,
) -> Result<Vec<f32>> {
    let rows = filled(offsets, slots, n)?;
    too_short("row_of", row_of.len(), rows, 4)?;
    too_short("slot", slot.len(), n, 4)?;
    too_short("values", values.len(), slots, 4)?;
    Ok(row_of[..rows]
        .iter()
        .map(|&i| {
            usize::try_from(i)
                .ok()
                .filter(|&i| i < n)
                .and_then(|i| usize::try_from(slot[i]).ok())
                .filter(|&s| s < slots)
                .map_or(1.0, |s| values[s])
        })
        .collect())
}

/// The combine kernel on the host: bf16 bits `[t, hidden]`, `out[t, c] = bf16_rne(acc)` with
/// `acc += w[t k + j] * y[p, c]` in f32 over `j` in order, for `p = pos_of[t k + j]` in `[0, n)`.
/// Errors: a buffer too short.
pub fn combine_reference(
    y: &[f32],
    pos_of: &[i32],
    weights: &[f32],
    t: usize,
    k: usize,
    n: usize,
    hidden: usize,
) -> Result<Vec<u16>> {
    too_short("y", y.len(), n * hidden, 4)?;
    too_short("pos_of", pos_of.len(), t * k, 4)?;
    too_short("weights", weights.len(), t * k, 4)?;
    let mut out = Vec::with_capacity(t * hidden);
    let mut acc = vec![0f32; hidden];
    for tok in 0..t {
        acc.fill(0.0);
        for j in 0..k {
            let item = tok * k + j;
            let Some(p) = usize::try_from(pos_of[item]).ok().filter(|&p| p < n) else {
                continue;
            };
            let w = weights[item];
            for (a, &v) in acc.iter_mut().zip(&y[p * hidden..(p + 1) * hidden]) {
                *a += w * v;
            }
        }
        out.extend(acc.iter().map(|&a| bf16_from_f32(a)));
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::gemm::reference::bf16_to_f32;

    #[test]
    fn hidden_is_checked_by_name() {
        for bad in [0, 4, 7164, MAX_HIDDEN + 8] {
            let e = combine_module(bad).unwrap_err();
            let s = e.to_string();
            assert!(matches!(e, Error::Unsupported { .. }), "{s}");
            assert!(
                s.contains("moe combine") && s.contains("multiple of 8"),
                "{s}"
            );
        }
        let l = combine_launch(7168).unwrap();
        assert_eq!((l.combine_threads, l.chunks_per_thread()), (512, 2));
        let l = combine_launch(8).unwrap();
        assert_eq!((l.combine_threads, l.chunks_per_thread()), (32, 1));
        let l = combine_launch(MAX_HIDDEN).unwrap();
        assert_eq!((l.combine_threads, l.chunks_per_thread()), (512, 4));
        assert_eq!(l.index_grid(0), 1);
        assert_eq!(l.index_grid(257), 2);
        assert_eq!(l.index_grid(u32::MAX), INDEX_MAX_CTAS);
        assert_eq!(l.combine_grid(0), 1);
        assert_eq!(l.combine_grid(u32::MAX), COMBINE_MAX_CTAS);
    }

    #[test]
    fn module_has_two_entries_and_is_deterministic() {
        let (a, l) = combine_module(7168).unwrap();
        assert_eq!(a, combine_module(7168).unwrap().0);
        assert_eq!(a.matches(".visible .entry ").count(), 2);
        for e in [ROW_SCALES_ENTRY, COMBINE_ENTRY] {
            assert_eq!(a.matches(&format!(".visible .entry {e}(")).count(), 1);
        }
        let n = l.chunks_per_thread() as usize;
        assert_eq!(a.matches("ld.global.nc.v4.b32").count(), 2 * n);
        assert_eq!(a.matches("mul.rn.f32").count(), 8 * n);
        assert_eq!(a.matches("add.rn.f32").count(), 8 * n);
        assert!(!a.contains("fma"));
        assert_eq!(a.matches("cvt.rn.bf16x2.f32").count(), 4 * n);
        assert_eq!(a.matches("st.global.v4.b32").count(), n);
    }

    #[test]
    fn combine_reference_with_two_choices() {
        // T = 2, k = 2, n = 3 rows of H = 8; token 1's second choice has no row.
        let h = 8;
        let y: Vec<f32> = (0..3 * h).map(|i| i as f32 * 0.5).collect();
        let pos_of = [2, 0, 1, -1];
        let w = [0.25f32, 0.75, 2.0, 100.0];
        let out = combine_reference(&y, &pos_of, &w, 2, 2, 3, h).unwrap();
        for c in 0..h {
            let mut acc = 0.0f32;
            acc += 0.25 * y[2 * h + c];
            acc += 0.75 * y[c];
            assert_eq!(out[c], bf16_from_f32(acc));
            assert_eq!(
                bf16_to_f32(out[h + c]),
                bf16_to_f32(bf16_from_f32(2.0 * y[h + c]))
            );
        }
        // Column 1: 0.25 * 8.5 + 0.75 * 0.5 = 2.5.
        assert_eq!(bf16_to_f32(out[1]), 2.5);
        assert!(combine_reference(&y, &pos_of, &w, 3, 2, 3, h).is_err());
    }

    #[test]
    fn invert_and_row_scales_references() {
        // n = 5 items, 3 slots; offsets total 4 rows (the fifth item was dropped).
        let row_of = [3, 0, 4, 1, 2];
        let offsets = [0, 2, 2, 4];
        let pos = invert_reference(&row_of, &offsets, 3, 5).unwrap();
        assert_eq!(pos, vec![1, 3, -1, 0, 2]);
        let slot = [2, 0, -1, 0, 7];
        let values = [10.0f32, 20.0, 30.0];
        let s = row_scales_reference(&row_of, &slot, &values, &offsets, 3, 5).unwrap();
        assert_eq!(s, vec![10.0, 30.0, 1.0, 10.0]);
        // A total past n is capped; a negative one is none; out-of-range items are skipped.
        assert_eq!(
            invert_reference(&[9, -1, 0], &[0, 9], 1, 3).unwrap(),
            vec![2, -1, -1]
        );
        assert_eq!(invert_reference(&[0], &[0, -5], 1, 1).unwrap(), vec![-1]);
        assert!(invert_reference(&[0], &[0], 1, 1).is_err());
    }
}
