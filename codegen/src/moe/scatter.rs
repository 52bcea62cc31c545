//! Kernel C of the permute module ([`super::permute`]): the scatter, a grid-stride loop of one
//! CTA of [`SCATTER_THREADS`] per token, in two forms that share the claim of the token's rows.
//!
//! # The claim (both forms)
//! Thread `j < k` takes the token's item `i = t k + j`: `pos = offsets[slot] + atom.add(cursor[slot],
//! 1)`, writes `row_of[pos] = i` and `pos_of[i] = pos`, and leaves `pos` in shared memory
//! (`scatter_pos[j]`, so `k` is at most [`MAX_TOPK`](super::permute::MAX_TOPK)). Items with
//! `slot < 0` are skipped with `pos_of[i] = -1`; so is a `pos` past `n`, which only counts not
//! zero on entry could make (nothing is written there, and it counts into `errors[1]`). After a
//! barrier the CTA loads row `t` of `x` once (thread `u` holds its chunks of 8 columns `u, u + 256,
//! ...` in registers, every load issued before any store) and writes it at each of the token's
//! positions, so a token's row is read once, not `k` times.
//!
//! # The forms
//! * [`SCATTER_ENTRY`] ([`Gather::Bf16`]) copies the row to `xs` (bf16).
//! * [`SCATTER_E4M3_ENTRY`] ([`Gather::PerToken`], [`Gather::Group128`], [`Gather::Static`])
//!   quantizes it on the way to E4M3 codes `q [n, H]` and f32 scales, what the first grouped GEMM
//!   of an FP8 recipe reads, so the layer runs no activation-quantization kernel and never writes
//!   the bf16 rows. The row is quantized by the activation kernel's code ([`super::row_out`]), so
//!   the codes and scales are bit for bit those of `gemm::act_quant` (per token, per 1x128 group)
//!   and of the activation kernel's static rows on the gathered bf16 rows:
//!   * per token: `s = max(amax / 448, 1/(448*512))` (1.0 for an all-zero row) at `scales[pos]`,
//!     `q = e4m3(x / s)` (`div.rn`); quantized once per token;
//!   * per 1x128 group: `s = max(amax, 1e-4) / 448` at `scales[group * n + pos]` (group-major,
//!     `n` rows: the grouped GEMM's layout), `q = e4m3(x * rcp.rn(s))`; once per token;
//!   * static: `s = static_scales[slot]` (the item's slot's registered input scale, positive and
//!     finite; the claiming thread stores it at `scales[pos]`, the GEMM's per-row scale),
//!     `q = e4m3(x * rcp.rn(s))`, once per item (the slots' scales differ).
//!
//! # Parameters, in order
//! * [`SCATTER_PARAMS`]: `slot`, `offsets`, `cursor`, `x` (bf16 `[T, H]`, 16-byte aligned),
//!   `row_of`, `xs` (bf16 `[n, H]`, 16-byte aligned), `pos_of`, `errors`, then the u32 `n`, `k`.
//! * [`SCATTER_E4M3_PARAMS`]: `slot`, `offsets`, `cursor`, `x`, `row_of`, `q` (E4M3 `[n, H]`,
//!   8-byte aligned), `scales` (f32: `n`, or `ceil(H/128) * n` per group), `static_scales` (f32
//!   `[R]`, read by the static form only; may be 0 otherwise), `pos_of`, `errors`, then `n`, `k`.

use super::act::{ActIn, ActOut};
use super::emit::{entry_params, G};
use super::permute::{Launch, MAX_TOPK, SCATTER_THREADS};
use super::row_out::{load_values, RowWriter};
use crate::gemm::emit::Emit as _;
use crate::ptx::SpecialReg;
use crate::ptx::{BinOpcode, CmpOp, Entry, Inst, Operand, PtxTy, Reg, SharedDecl, SharedTy};
use crate::Result;

/// The bf16 scatter's entry name.
pub const SCATTER_ENTRY: &str = "moeforge_moe_scatter_gather";
/// The quantizing scatter's entry name.
pub const SCATTER_E4M3_ENTRY: &str = "moeforge_moe_scatter_gather_e4m3";

/// The bf16 scatter's parameter names, in order.
pub const SCATTER_PARAMS: [&str; 11] = [
    "scatter_slot",
    "scatter_offsets",
    "scatter_cursor",
    "scatter_x",
    "scatter_row_of",
    "scatter_xs",
    "scatter_pos_of",
    "scatter_errors",
    "scatter_items",
    "scatter_k",
    "scatter_split",
];

/// The quantizing scatter's parameter names, in order.
pub const SCATTER_E4M3_PARAMS: [&str; 13] = [
    "scatter_slot",
    "scatter_offsets",
    "scatter_cursor",
    "scatter_x",
    "scatter_row_of",
    "scatter_q",
    "scatter_scales",
    "scatter_static_scales",
    "scatter_pos_of",
    "scatter_errors",
    "scatter_items",
    "scatter_k",
    "scatter_split",
];

/// What the scatter writes for the first GEMM: the gathered rows as they are, or quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Gather {
    /// bf16 rows `xs [n, H]`.
    Bf16,
    /// E4M3 codes, one dynamic scale per row.
    PerToken,
    /// E4M3 codes, one dynamic scale per row and 128 columns (group-major).
    Group128,
    /// E4M3 codes with the item's slot's static scale.
    Static,
}

impl Gather {
    /// Every form.
    pub const ALL: [Gather; 4] = [
        Gather::Bf16,
        Gather::PerToken,
        Gather::Group128,
        Gather::Static,
    ];

    /// The activation kernel's output of the same formulas (`None` for bf16).
    pub fn act_out(self) -> Option<ActOut> {
        match self {
            Gather::Bf16 => None,
            Gather::PerToken => Some(ActOut::PerToken),
            Gather::Group128 => Some(ActOut::Group128),
            Gather::Static => Some(ActOut::StaticRow),
        }
    }

    /// The scatter's entry name.
    pub fn entry(self) -> &'static str {
        match self {
            Gather::Bf16 => SCATTER_ENTRY,
            _ => SCATTER_E4M3_ENTRY,
        }
    }

    /// Bytes of one gathered row of `h` columns: bf16 or one code a column.
    pub fn row_bytes(self, h: usize) -> usize {
        match self {
            Gather::Bf16 => 2 * h,
            _ => h,
        }
    }

    /// Scales written for `n` rows of `h` columns: none (bf16), `n`, or `ceil(h/128) * n`.
    pub fn scales_len(self, n: usize, h: usize) -> usize {
        match self {
            Gather::Bf16 => 0,
            Gather::PerToken | Gather::Static => n,
            Gather::Group128 => h.div_ceil(128) * n,
        }
    }
}

/// The registers of the claim loop (see the module docs).
struct Claim {
    slot_in: Reg,
    offsets: Reg,
    cursor: Reg,
    row_of: Reg,
    pos_of: Reg,
    errors: Reg,
    n: Reg,
    k: Reg,
    /// CTAs a token's items are split over (`split` parameter, `1..=k`).
    split: Reg,
    /// The current unit's item count (set by [`for_each_unit`]).
    per: Reg,
    tid: Reg,
    cta: Reg,
    ncta: Reg,
    /// The shared positions `scatter_pos[j]`.
    shared_pos: Reg,
    /// The static form's `static_scales` and `scales`, and the shared `scatter_scale[j]`.
    statics: Option<(Reg, Reg, Reg)>,
}

/// The grid-stride loop over units `w < T * split`, one CTA each: unit `w` is token `t = w /
/// split`, part `s = w % split`, whose items are the token's choices `j = s, s + split, ...`
/// (`per` of them). Thread `u < per` claims item `t k + s + u split` (see the module docs) and
/// leaves its position in `scatter_pos[u]` (all ones where it has none: a skipped item, or a
/// position past `n`) and, in the static form, its slot's scale in `scatter_scale[u]` (also
/// stored at `scales[pos]`); then `body(g, t)` runs on the whole CTA.
fn for_each_unit(g: &mut G, c: &Claim, body: impl FnOnce(&mut G, Reg)) {
    let minus1 = g.r32();
    g.mov(minus1, Operand::Int(-1));
    let tokens = g.bin(BinOpcode::Div, PtxTy::U32, c.n, Operand::Reg(c.k));
    let units = g.bin(BinOpcode::MulLo, PtxTy::U32, tokens, Operand::Reg(c.split));
    let w = g.r32();
    g.mov(w, Operand::Reg(c.cta));
    let my_pos = g.shared_word(c.shared_pos, c.tid);
    let (top, done, claimed) = (
        g.b.label("scatter_unit"),
        g.b.label("scatter_done"),
        g.b.label("scatter_claimed"),
    );
    g.label(&top);
    let past = g.setp(CmpOp::Ge, PtxTy::U32, w, Operand::Reg(units));
    g.bra(&done, Some((past, false)));
    // t = w / split, s = w - t split, per = (k - s + split - 1) / split.
    let t = g.bin(BinOpcode::Div, PtxTy::U32, w, Operand::Reg(c.split));
    let part = g.bin(BinOpcode::MulLo, PtxTy::U32, t, Operand::Reg(c.split));
    g.bin_to(part, BinOpcode::Sub, PtxTy::U32, w, Operand::Reg(part));
    g.bin_to(c.per, BinOpcode::Sub, PtxTy::U32, c.k, Operand::Reg(part));
    g.bin_to(
        c.per,
        BinOpcode::Add,
        PtxTy::U32,
        c.per,
        Operand::Reg(c.split),
    );
    g.bin_to(c.per, BinOpcode::Sub, PtxTy::U32, c.per, Operand::Int(1));
    g.bin_to(
        c.per,
        BinOpcode::Div,
        PtxTy::U32,
        c.per,
        Operand::Reg(c.split),
    );
    let not_claimer = g.setp(CmpOp::Ge, PtxTy::U32, c.tid, Operand::Reg(c.per));
    g.bra(&claimed, Some((not_claimer, false)));
    // Item i = t k + s + tid split.
    let i = g.bin(BinOpcode::MulLo, PtxTy::U32, c.tid, Operand::Reg(c.split));
    g.bin_to(i, BinOpcode::Add, PtxTy::U32, i, Operand::Reg(part));
    let tk = g.bin(BinOpcode::MulLo, PtxTy::U32, t, Operand::Reg(c.k));
    g.bin_to(i, BinOpcode::Add, PtxTy::U32, i, Operand::Reg(tk));
    let a = g.elem(c.slot_in, i, 4);
    let slot = g.ld(PtxTy::S32, a);
    let p = g.r32();
    g.mov(p, Operand::Reg(minus1));
    let skipped = g.setp(CmpOp::Lt, PtxTy::S32, slot, Operand::Int(0));
    let record = g.b.label("scatter_record");
    g.bra(&record, Some((skipped, false)));
    let a = g.elem(c.cursor, slot, 4);
    let cur = g.r32();
    g.b.push(Inst::AtomAddU32 {
        d: cur,
        addr: a,
        v: Operand::Int(1),
    });
    let a = g.elem(c.offsets, slot, 4);
    let pos = g.ld(PtxTy::S32, a);
    g.bin_to(pos, BinOpcode::Add, PtxTy::U32, pos, Operand::Reg(cur));
    // A position past `n` can only come from counts that were not zero on entry (the caller's
    // precondition): never written, so the kernel stays within `row_of` and the rows regardless,
    // and counted in `errors[1]` (the item is then missing from the output: the caller reports
    // it).
    let off_end = g.setp(CmpOp::Ge, PtxTy::U32, pos, Operand::Reg(c.n));
    let in_range = g.b.label("scatter_in_range");
    g.bra(&in_range, Some((off_end, true)));
    let a = g.bin(BinOpcode::Add, PtxTy::U64, c.errors, Operand::Int(4));
    g.b.push(Inst::RedAddU32 {
        addr: a,
        v: Operand::Int(1),
    });
    g.bra(&record, None);
    g.label(&in_range);
    g.mov(p, Operand::Reg(pos));
    let a = g.elem(c.row_of, pos, 4);
    g.b.push(Inst::St {
        ty: PtxTy::U32,
        addr: a,
        v: i,
    });
    if let Some((statics, scales, shared_scale)) = c.statics {
        let a = g.elem(statics, slot, 4);
        let s = g.ld(PtxTy::F32, a);
        let a = g.elem(scales, pos, 4);
        g.b.push(Inst::St {
            ty: PtxTy::F32,
            addr: a,
            v: s,
        });
        let w = g.shared_word(shared_scale, c.tid);
        g.b.push(Inst::StShared { addr: w, v: s });
    }
    g.label(&record);
    // The item's position (the combine's `pos_of`): -1 for a skipped item.
    let a = g.elem(c.pos_of, i, 4);
    g.b.push(Inst::St {
        ty: PtxTy::S32,
        addr: a,
        v: p,
    });
    g.b.push(Inst::StSharedU32 {
        addr: my_pos,
        off: 0,
        v: p,
    });
    g.label(&claimed);
    g.b.push(Inst::BarSync);
    body(g, t);
    // (Every thread has read the positions before the next unit's claims overwrite them.)
    g.b.push(Inst::BarSync);
    g.bin_to(w, BinOpcode::Add, PtxTy::U32, w, Operand::Reg(c.ncta));
    g.bra(&top, None);
    g.label(&done);
    g.b.push(Inst::Ret);
}

/// For each `u < per` (the unit's items) whose position `p = scatter_pos[u]` is below `n`
/// (uniform over the CTA): `body(g, u, p)`.
fn for_each_position(g: &mut G, c: &Claim, body: impl FnOnce(&mut G, Reg, Reg)) {
    let j = g.r32();
    g.mov(j, Operand::Int(0));
    let (top, next, done) = (
        g.b.label("scatter_row"),
        g.b.label("scatter_next_row"),
        g.b.label("scatter_rows_done"),
    );
    g.label(&top);
    let past = g.setp(CmpOp::Ge, PtxTy::U32, j, Operand::Reg(c.per));
    g.bra(&done, Some((past, false)));
    let a = g.shared_word(c.shared_pos, j);
    let pos = g.r32();
    g.b.push(Inst::LdSharedU32 {
        d: pos,
        addr: a,
        off: 0,
    });
    let none = g.setp(CmpOp::Ge, PtxTy::U32, pos, Operand::Reg(c.n));
    g.bra(&next, Some((none, false)));
    body(g, j, pos);
    g.label(&next);
    g.bin_to(j, BinOpcode::Add, PtxTy::U32, j, Operand::Int(1));
    g.bra(&top, None);
    g.label(&done);
}

/// The claim's registers from a form's parameters (`names`: slot, offsets, cursor, x, row_of,
/// ..., pos_of at `pos_of`, errors after it, then `n`, `k` and `split`), with the shared
/// positions declared here: the claim and the pointer parameters in order.
fn claim_registers(g: &mut G, names: &[&str], pos_of: usize) -> Result<(Claim, Vec<Reg>)> {
    g.b.declare_shared(SharedDecl::array(
        "scatter_pos",
        SharedTy::B32,
        MAX_TOPK,
        4,
    )?)?;
    let ptrs: Vec<Reg> = names[..names.len() - 3]
        .iter()
        .map(|p| g.global_param(p))
        .collect();
    let [n, k, split] = [3, 2, 1].map(|back| g.u32_param(names[names.len() - back]));
    let per = g.r32();
    let tid = g.special(SpecialReg::TidX);
    let cta = g.special(SpecialReg::CtaidX);
    let ncta = g.special(SpecialReg::NctaidX);
    let shared_pos = g.b.shared_addr("scatter_pos");
    let c = Claim {
        slot_in: ptrs[0],
        offsets: ptrs[1],
        cursor: ptrs[2],
        row_of: ptrs[4],
        pos_of: ptrs[pos_of],
        errors: ptrs[pos_of + 1],
        n,
        k,
        split,
        per,
        tid,
        cta,
        ncta,
        shared_pos,
        statics: None,
    };
    Ok((c, ptrs))
}

/// The scatter entry of `gather` for the shapes `l`.
pub(super) fn scatter(l: &Launch, gather: Gather) -> Result<(Entry, G)> {
    let threads = SCATTER_THREADS;
    let quantized = gather.act_out();
    let (names, pointers): (&[&str], usize) = match quantized {
        None => (&SCATTER_PARAMS, 8),
        Some(_) => (&SCATTER_E4M3_PARAMS, 10),
    };
    let mut e = Entry::new(gather.entry());
    e.params = entry_params(names, pointers, |k| match (k, quantized) {
        (3, _) | (5, None) => 16,
        (5, Some(_)) => 8,
        _ => 4,
    });
    e.maxntid = Some(threads);
    // Without a cap, ptxas 13.0 held the quantizing form at H = 16384 per 1x128 group to 80
    // registers and spilled; 128 lets it take the 96 it needs (two CTAs an SM still fit).
    e.maxnreg = quantized.map(|_| 128);
    let mut g = G::default();
    let smem = (quantized == Some(ActOut::PerToken)).then_some("scatter_amax");
    if let Some(name) = smem {
        g.b.declare_shared(SharedDecl::array(name, SharedTy::B32, threads / 32, 4)?)?;
    }
    let (mut c, ptrs) = claim_registers(&mut g, names, pointers - 2)?;
    let (x, dst, tid) = (ptrs[3], ptrs[5], c.tid);
    let scales = if quantized.is_some() { ptrs[6] } else { x };
    if gather == Gather::Static {
        g.b.declare_shared(SharedDecl::array(
            "scatter_scale",
            SharedTy::B32,
            MAX_TOPK,
            4,
        )?)?;
        let shared_scale = g.b.shared_addr("scatter_scale");
        c.statics = Some((ptrs[7], scales, shared_scale));
    }
    let hidden = l.hidden;
    let chunks = hidden / 8;
    let cpt = chunks.div_ceil(threads);
    let valid = g.chunk_guards(tid, chunks, threads, cpt);
    let src_tid = g.bin(BinOpcode::MulWide, PtxTy::U32, tid, Operand::Int(16));
    let src_t = g.bin(BinOpcode::Add, PtxTy::U64, x, Operand::Reg(src_tid));
    let out_chunk = if quantized.is_some() { 8 } else { 16 };
    let dst_tid = g.bin(BinOpcode::MulWide, PtxTy::U32, tid, Operand::Int(out_chunk));
    let dst_t = g.bin(BinOpcode::Add, PtxTy::U64, dst, Operand::Reg(dst_tid));
    let dst_row_bytes = i64::from(hidden) * out_chunk / 8;
    let stride = |m: usize| i64::from(threads) * m as i64;
    let writer = quantized.map(|out| RowWriter::new(&mut g, out, threads, cpt, tid, c.n, smem));
    let claim = &c;
    for_each_unit(&mut g, claim, |g, t| {
        let src_row = g.elem(src_t, t, 2 * i64::from(hidden));
        match (&writer, gather) {
            (None, _) => {
                // The row's chunks, all loads issued before any store.
                let held: Vec<[Reg; 4]> = valid
                    .iter()
                    .enumerate()
                    .map(|(m, v)| {
                        let a = g.offset(src_row, 16 * stride(m));
                        load_words(g, a, *v)
                    })
                    .collect();
                for_each_position(g, claim, |g, _, pos| {
                    let row = g.elem(dst_t, pos, dst_row_bytes);
                    for (m, (words, v)) in held.iter().zip(&valid).enumerate() {
                        let a = g.offset(row, 16 * stride(m));
                        store_words(g, a, words, *v);
                    }
                });
            }
            (Some(w), Gather::Static) => {
                let data = load_rows(g, hidden, src_row, &valid, threads);
                for_each_position(g, claim, |g, j, pos| {
                    let Some((_, _, shared_scale)) = claim.statics else {
                        return;
                    };
                    let a = g.shared_word(shared_scale, j);
                    let s = g.f32();
                    g.b.push(Inst::LdShared {
                        d: s,
                        addr: a,
                        off: 0,
                    });
                    let q = w.quantize(g, &data, Some(s));
                    let row = g.elem(dst_t, pos, dst_row_bytes);
                    w.store(g, &q, &valid, row, pos, scales);
                });
            }
            (Some(w), _) => {
                let data = load_rows(g, hidden, src_row, &valid, threads);
                // Quantized once per token, stored at each of its items' rows.
                let q = w.quantize(g, &data, None);
                for_each_position(g, claim, |g, _, pos| {
                    let row = g.elem(dst_t, pos, dst_row_bytes);
                    w.store(g, &q, &valid, row, pos, scales);
                });
            }
        }
    });
    Ok((e, g))
}

/// The f32 values of this thread's chunks of a bf16 row (`src_row` at the thread's first chunk).
fn load_rows(
    g: &mut G,
    hidden: u32,
    src_row: Reg,
    valid: &[Option<Reg>],
    threads: u32,
) -> Vec<[Reg; 8]> {
    valid
        .iter()
        .enumerate()
        .map(|(m, v)| {
            load_values(
                g,
                ActIn::Bf16,
                hidden,
                src_row,
                i64::from(threads) * m as i64,
                *v,
            )
        })
        .collect()
}

/// Four words (16 bytes) from `addr`, skipped where `valid` is false.
fn load_words(g: &mut G, addr: Reg, valid: Option<Reg>) -> [Reg; 4] {
    let words = [g.r32(), g.r32(), g.r32(), g.r32()];
    let skip = g.b.label("scatter_skip_load");
    if let Some(p) = valid {
        g.bra(&skip, Some((p, true)));
    }
    g.b.push(Inst::LdV {
        nc: true,
        words: words.to_vec(),
        addr,
    });
    if valid.is_some() {
        g.label(&skip);
    }
    words
}

/// Store four words at `addr`, skipped where `valid` is false.
fn store_words(g: &mut G, addr: Reg, words: &[Reg; 4], valid: Option<Reg>) {
    let skip = g.b.label("scatter_skip_store");
    if let Some(p) = valid {
        g.bra(&skip, Some((p, true)));
    }
    g.b.push(Inst::StV {
        words: words.to_vec(),
        addr,
    });
    if valid.is_some() {
        g.label(&skip);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::permute::{launch, permute_module, MAX_HIDDEN, MAX_HIDDEN_E4M3};
    use super::*;
    use crate::Error;

    #[test]
    fn forms_have_their_sizes_and_entries() {
        assert_eq!(Gather::Bf16.row_bytes(7168), 14336);
        assert_eq!(Gather::Group128.row_bytes(7168), 7168);
        assert_eq!(Gather::Bf16.scales_len(10, 7168), 0);
        assert_eq!(Gather::PerToken.scales_len(10, 7168), 10);
        assert_eq!(Gather::Static.scales_len(10, 7168), 10);
        assert_eq!(Gather::Group128.scales_len(10, 7168), 560);
        assert_eq!(Gather::Group128.scales_len(10, 2056), 170);
        for g in Gather::ALL {
            assert_eq!(g.act_out().is_none(), g == Gather::Bf16);
            let l = launch(2056, 40, g).unwrap();
            assert_eq!(l.scatter_entry(), g.entry());
            assert_eq!(l.gathered_row_bytes(), g.row_bytes(2056));
        }
    }

    /// The units' item arithmetic the kernel emits (`t = w / split`, `s = w - t split`, `per =
    /// (k - s + split - 1) / split`, item `t k + s + u split` for `u < per`) claims every item
    /// exactly once, for every split the launch may choose, with at most `k` claimers a unit.
    #[test]
    fn units_claim_every_item_once() {
        for t in 0u32..40 {
            for k in 1u32..=17 {
                for split in 1..=k {
                    let n = t * k;
                    let mut hits = vec![0u8; n as usize];
                    for w in 0..t * split {
                        let tt = w / split;
                        let s = w - tt * split;
                        // (The kernel's `(k - s + split - 1) / split`.)
                        let per = (k - s).div_ceil(split);
                        assert!((1..=k).contains(&per));
                        for u in 0..per {
                            hits[(tt * k + s + u * split) as usize] += 1;
                        }
                    }
                    assert!(hits.iter().all(|&h| h == 1), "t={t} k={k} split={split}");
                }
            }
        }
    }

    #[test]
    fn quantizing_forms_refuse_rows_too_long_for_registers() {
        assert!(launch(MAX_HIDDEN, 8, Gather::Bf16).is_ok());
        for g in [Gather::PerToken, Gather::Group128, Gather::Static] {
            assert!(launch(MAX_HIDDEN_E4M3, 8, g).is_ok());
            let e = permute_module(MAX_HIDDEN_E4M3 + 8, 8, g).unwrap_err();
            assert!(matches!(e, Error::Unsupported { .. }), "{e}");
            assert!(e.to_string().contains("quantized on the fly"), "{e}");
        }
    }

    #[test]
    fn each_module_holds_its_scatter_only() {
        for g in Gather::ALL {
            let (ptx, _) = permute_module(2056, 40, g).unwrap();
            assert_eq!(ptx.matches(".entry ").count(), 4);
            let quantized = ptx.contains(&format!(".entry {SCATTER_E4M3_ENTRY}("));
            assert_eq!(quantized, g != Gather::Bf16, "{g:?}");
            assert_eq!(
                ptx.contains(&format!(".entry {SCATTER_ENTRY}(")),
                g == Gather::Bf16
            );
            // The codes come from the saturating converter; the formulas are the act kernel's.
            assert_eq!(ptx.contains("cvt.rn.satfinite.e4m3x2.f32"), quantized);
            match g {
                Gather::PerToken => {
                    assert!(ptx.contains("div.rn.f32") && ptx.contains("scatter_amax"));
                    assert!(!ptx.contains("rcp.rn.f32"));
                }
                Gather::Group128 | Gather::Static => {
                    assert!(ptx.contains("rcp.rn.f32") && !ptx.contains("scatter_amax"));
                }
                Gather::Bf16 => {}
            }
        }
    }
}
