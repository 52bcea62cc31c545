//! Rows of the MoE layer's activations held in registers, written out as the next GEMM takes them
//! (bf16, or E4M3 with per-token, per-1x128-group or static scales): the part shared by the
//! activation kernel ([`super::act`]) and the quantizing gather ([`super::scatter`]). The formulas
//! are [`super::act`]'s (its module docs); both kernels emit the same instructions for them, so
//! they give the same bits.
//!
//! A row is `chunks = W / 8` chunks of 8 columns; thread `tid` of a CTA of `threads` holds chunks
//! `tid + i * threads` (`i < cpt`), each as 8 f32 registers, guarded where not every thread has
//! chunk `i` ([`G::chunk_guards`]).

use super::act::{ActIn, ActOut};
use super::emit::G;
use crate::gemm::emit::Emit as _;
use crate::ptx::{BinOpcode, CmpOp, Inst, Operand, PtxTy, Reg, RegClass, UnOpcode};

/// One chunk of 8 columns of the current row: its values `a` (f32), computed from the source
/// `input` of a row of `width` columns (`src_row` is the thread's first chunk; `chunk_off` counts
/// chunks).
pub(super) fn load_values(
    g: &mut G,
    input: ActIn,
    width: u32,
    src_row: Reg,
    chunk_off: i64,
    valid: Option<Reg>,
) -> [Reg; 8] {
    let w = i64::from(width);
    // Invalid chunks keep zeros: they add nothing to an amax, and are never stored.
    let skip = valid.map(|p| (p, g.b.label("act_skip_load")));
    match input {
        ActIn::SiluMul => {
            let base = g.offset(src_row, 32 * chunk_off);
            let vals: [Reg; 16] = std::array::from_fn(|_| g.f32());
            skip_from(g, &skip, &vals, Operand::F32(0.0));
            for (q, words) in vals.chunks(4).enumerate() {
                // Gate words 0..8 at +0 and +16, up words at +4W and +4W+16.
                let off = if q < 2 {
                    16 * q as i64
                } else {
                    4 * w + 16 * (q as i64 - 2)
                };
                let a = g.offset(base, off);
                g.b.push(Inst::LdV {
                    nc: true,
                    words: words.to_vec(),
                    addr: a,
                });
            }
            skip_to(g, &skip);
            let mut out = [vals[0]; 8];
            for (c, o) in out.iter_mut().enumerate() {
                *o = g.silu_mul(vals[c], vals[8 + c]);
            }
            out
        }
        ActIn::F32 => {
            let base = g.offset(src_row, 32 * chunk_off);
            let vals: [Reg; 8] = std::array::from_fn(|_| g.f32());
            skip_from(g, &skip, &vals, Operand::F32(0.0));
            for (q, words) in vals.chunks(4).enumerate() {
                let a = g.offset(base, 16 * q as i64);
                g.b.push(Inst::LdV {
                    nc: true,
                    words: words.to_vec(),
                    addr: a,
                });
            }
            skip_to(g, &skip);
            vals
        }
        ActIn::Bf16 => {
            let a = g.offset(src_row, 16 * chunk_off);
            let words = [g.r32(), g.r32(), g.r32(), g.r32()];
            skip_from(g, &skip, &words, Operand::Int(0));
            g.b.push(Inst::LdV {
                nc: true,
                words: words.to_vec(),
                addr: a,
            });
            skip_to(g, &skip);
            let mut out = [words[0]; 8];
            for (k, &wd) in words.iter().enumerate() {
                let lo = g.bin(BinOpcode::Shl, PtxTy::B32, wd, Operand::Int(16));
                let hi = g.bin(BinOpcode::And, PtxTy::B32, wd, Operand::Int(0xFFFF_0000));
                out[2 * k] = g.un(UnOpcode::Mov(PtxTy::B32), RegClass::F32, Operand::Reg(lo));
                out[2 * k + 1] = g.un(UnOpcode::Mov(PtxTy::B32), RegClass::F32, Operand::Reg(hi));
            }
            out
        }
    }
}

/// The start of a chunk's guarded loads: with a guard `(valid, label)`, `regs` get `zero` and the
/// thread branches to `label` where `valid` is false ([`skip_to`] places the label).
fn skip_from(g: &mut G, skip: &Option<(Reg, String)>, regs: &[Reg], zero: Operand) {
    if let Some((p, lab)) = skip {
        for &v in regs {
            g.mov(v, zero);
        }
        g.bra(lab, Some((*p, true)));
    }
}

/// The end of a chunk's guarded loads: the guard's label.
fn skip_to(g: &mut G, skip: &Option<(Reg, String)>) {
    if let Some((_, lab)) = skip {
        g.label(lab);
    }
}

/// Store `words` at `addr`, skipped where `valid` is false.
fn store(g: &mut G, addr: Reg, words: Vec<Reg>, valid: Option<Reg>) {
    let skip = valid.map(|p| {
        let lab = g.b.label("act_skip_store");
        g.bra(&lab, Some((p, true)));
        lab
    });
    g.b.push(Inst::StV { words, addr });
    if let Some(lab) = skip {
        g.label(&lab);
    }
}

/// A thread's constants for writing rows of one output kind: its lane, its warp's amax slot
/// (per token, more than one warp) and its chunks' group offsets (per group).
pub(super) struct RowWriter {
    output: ActOut,
    threads: u32,
    tid: Reg,
    lane: Reg,
    /// The shared amax array's base and this warp's slot in it.
    smem: Option<(Reg, Reg)>,
    /// Per chunk `i`: its group `tid / 16 + i threads / 16` times the scales' row stride.
    group_rows: Vec<Reg>,
    /// Whether the thread is not lane 0 of its half warp.
    not_half_first: Option<Reg>,
}

impl RowWriter {
    /// The constants of thread `tid` of `threads` holding `cpt` chunks a row, for `output`;
    /// `smem` names the shared array of one amax word per warp (declared by the caller: per token
    /// with more than one warp), `rows` is the group-major scales' row stride (per group).
    pub(super) fn new(
        g: &mut G,
        output: ActOut,
        threads: u32,
        cpt: u32,
        tid: Reg,
        rows: Reg,
        smem: Option<&str>,
    ) -> RowWriter {
        // Per-token: this warp's amax slot; per-group: each chunk's group times the row stride.
        let lane = g.bin(BinOpcode::And, PtxTy::B32, tid, Operand::Int(31));
        let smem = smem.map(|name| {
            let base = g.b.shared_addr(name);
            let warp = g.bin(BinOpcode::Shr, PtxTy::U32, tid, Operand::Int(5));
            let slot = g.bin(BinOpcode::Shl, PtxTy::B32, warp, Operand::Int(2));
            g.bin_to(slot, BinOpcode::Add, PtxTy::U32, slot, Operand::Reg(base));
            (base, slot)
        });
        // Per group: lane 0 of each half warp stores the scale of its group `tid / 16 + i threads /
        // 16` (chunk i), at `group * rows + row`.
        let (group_rows, not_half_first) = if output == ActOut::Group128 {
            let half = g.bin(BinOpcode::Shr, PtxTy::U32, tid, Operand::Int(4));
            let rows_of: Vec<Reg> = (0..cpt)
                .map(|i| {
                    let grp = if i == 0 {
                        half
                    } else {
                        g.bin(
                            BinOpcode::Add,
                            PtxTy::U32,
                            half,
                            Operand::Int(i64::from(i * threads / 16)),
                        )
                    };
                    g.bin(BinOpcode::MulLo, PtxTy::U32, grp, Operand::Reg(rows))
                })
                .collect();
            let in_half = g.bin(BinOpcode::And, PtxTy::B32, tid, Operand::Int(15));
            let p = g.setp(CmpOp::Ne, PtxTy::U32, in_half, Operand::Int(0));
            (rows_of, Some(p))
        } else {
            (Vec::new(), None)
        };
        RowWriter {
            output,
            threads,
            tid,
            lane,
            smem,
            group_rows,
            not_half_first,
        }
    }

    /// Bytes of one output chunk of 8 columns: 16 (bf16) or 8 (codes).
    pub(super) fn out_chunk(output: ActOut) -> i64 {
        if output == ActOut::Bf16 {
            16
        } else {
            8
        }
    }

    /// Write the row `data` (this thread's chunks, guarded by `valid`) at `dst_row` (the thread's
    /// first chunk of row `row`), with its scales in `scales` (row `row`): [`RowWriter::quantize`]
    /// then [`RowWriter::store`]. A static row's scale is `given` when the caller has it, else
    /// read from `scales[row]`. Every thread of the CTA must call it (per token it synchronizes
    /// the CTA).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn write(
        &self,
        g: &mut G,
        data: &[[Reg; 8]],
        valid: &[Option<Reg>],
        dst_row: Reg,
        row: Reg,
        scales: Reg,
        given: Option<Reg>,
    ) {
        let given = match (self.output, given) {
            (ActOut::StaticRow, None) => {
                let sa = g.elem(scales, row, 4);
                Some(g.ld(PtxTy::F32, sa))
            }
            (_, given) => given,
        };
        let out = self.quantize(g, data, given);
        self.store(g, &out, valid, dst_row, row, scales);
    }

    /// The output words of the row `data` (this thread's chunks: invalid ones hold zeros) and
    /// their scales: bf16 pairs, or E4M3 codes with the row's dynamic scale(s) or the static
    /// scale `given` (required for [`ActOut::StaticRow`]). Every thread of the CTA must call it
    /// (per token it synchronizes the CTA).
    pub(super) fn quantize(&self, g: &mut G, data: &[[Reg; 8]], given: Option<Reg>) -> Quantized {
        let (threads, lane) = (self.threads, self.lane);
        let warps = threads / 32;
        match self.output {
            ActOut::Bf16 => Quantized {
                words: data
                    .iter()
                    .map(|vals| {
                        (0..4)
                            .map(|k| g.bf16x2(vals[2 * k], vals[2 * k + 1]))
                            .collect()
                    })
                    .collect(),
                scales: Vec::new(),
            },
            ActOut::PerToken => {
                let m = g.r32();
                g.mov(m, Operand::Int(0));
                for vals in data {
                    g.amax_bits(m, vals);
                }
                g.reduce_max_u32(m, &[16, 8, 4, 2, 1]);
                if let Some((base, slot)) = self.smem {
                    let not_first = g.setp(CmpOp::Ne, PtxTy::U32, lane, Operand::Int(0));
                    let stored = g.b.label("act_amax_stored");
                    g.bra(&stored, Some((not_first, false)));
                    g.b.push(Inst::StSharedU32 {
                        addr: slot,
                        off: 0,
                        v: m,
                    });
                    g.label(&stored);
                    g.b.push(Inst::BarSync);
                    for w in 0..warps {
                        let o = g.r32();
                        g.b.push(Inst::LdSharedU32 {
                            d: o,
                            addr: base,
                            off: 4 * i64::from(w),
                        });
                        g.bin_to(m, BinOpcode::Max, PtxTy::U32, m, Operand::Reg(o));
                    }
                    // Every warp has read the slots before any writes the next row's.
                    g.b.push(Inst::BarSync);
                }
                // s = amax == 0 ? 1 : max(amax / 448, 1/(448*512)).
                let amax = g.un(UnOpcode::Mov(PtxTy::B32), RegClass::F32, Operand::Reg(m));
                let s = g.e4m3_token_scale(amax, m);
                Quantized {
                    words: data
                        .iter()
                        .map(|vals| g.e4m3_codes(vals, BinOpcode::DivRn, s).to_vec())
                        .collect(),
                    scales: vec![s],
                }
            }
            ActOut::Group128 => {
                let mut out = Quantized {
                    words: Vec::with_capacity(data.len()),
                    scales: Vec::with_capacity(data.len()),
                };
                for vals in data {
                    let m = g.r32();
                    g.mov(m, Operand::Int(0));
                    g.amax_bits(m, vals);
                    g.reduce_max_u32(m, &[8, 4, 2, 1]);
                    // s = max(amax, 1e-4) / 448; inv = 1 / s (correctly rounded).
                    let amax = g.un(UnOpcode::Mov(PtxTy::B32), RegClass::F32, Operand::Reg(m));
                    let (s, inv) = g.e4m3_group_scale(amax);
                    out.words
                        .push(g.e4m3_codes(vals, BinOpcode::MulRn, inv).to_vec());
                    out.scales.push(s);
                }
                out
            }
            ActOut::StaticRow => {
                let s = given.unwrap_or_else(|| {
                    // (Unreachable through `write`; a caller without the scale gets 1.)
                    let r = g.f32();
                    g.mov(r, Operand::F32(1.0));
                    r
                });
                let inv = g.un(UnOpcode::RcpRn(PtxTy::F32), RegClass::F32, Operand::Reg(s));
                Quantized {
                    words: data
                        .iter()
                        .map(|vals| g.e4m3_codes(vals, BinOpcode::MulRn, inv).to_vec())
                        .collect(),
                    scales: Vec::new(),
                }
            }
        }
    }

    /// Store `q` (this thread's chunks, guarded by `valid`) at `dst_row` (the thread's first chunk
    /// of row `row`), and its dynamic scales in `scales`: per token at `scales[row]` (thread 0),
    /// per group at `scales[group * rows + row]` (lane 0 of each half warp). A static row's scale
    /// is the caller's to store.
    pub(super) fn store(
        &self,
        g: &mut G,
        q: &Quantized,
        valid: &[Option<Reg>],
        dst_row: Reg,
        row: Reg,
        scales: Reg,
    ) {
        let dst_step = Self::out_chunk(self.output) * i64::from(self.threads);
        if self.output == ActOut::PerToken {
            if let Some(&s) = q.scales.first() {
                let not_first = g.setp(CmpOp::Ne, PtxTy::U32, self.tid, Operand::Int(0));
                let scaled = g.b.label("act_scaled");
                g.bra(&scaled, Some((not_first, false)));
                let sa = g.elem(scales, row, 4);
                g.b.push(Inst::St {
                    ty: PtxTy::F32,
                    addr: sa,
                    v: s,
                });
                g.label(&scaled);
            }
        }
        for (i, (words, v)) in q.words.iter().zip(valid).enumerate() {
            let a = g.offset(dst_row, dst_step * i as i64);
            store(g, a, words.clone(), *v);
            let (Some(&s), Some(&grp)) = (q.scales.get(i), self.group_rows.get(i)) else {
                continue;
            };
            if self.output != ActOut::Group128 {
                continue;
            }
            let skip = g.b.label("act_skip_scale");
            if let Some(p) = self.not_half_first {
                g.bra(&skip, Some((p, false)));
            }
            if let Some(p) = v {
                g.bra(&skip, Some((*p, true)));
            }
            let idx = g.bin(BinOpcode::Add, PtxTy::U32, grp, Operand::Reg(row));
            let sa = g.elem(scales, idx, 4);
            g.b.push(Inst::St {
                ty: PtxTy::F32,
                addr: sa,
                v: s,
            });
            g.label(&skip);
        }
    }
}

/// A row's output words in a thread's registers ([`RowWriter::quantize`]): per chunk 4 bf16 pairs
/// or 2 words of E4M3 codes; the dynamic scales (one per token, one per chunk per group, none for
/// bf16 and static rows).
pub(super) struct Quantized {
    words: Vec<Vec<Reg>>,
    scales: Vec<Reg>,
}
