//! The generated activation-quantization kernels (issue \[7\]): bf16 `X [T, K]` (row-major) to
//! E4M3 codes `Q [T, K]` and f32 scales, emitted through the typed PTX builder for `sm_90a`, bit for
//! bit the host reference's ([`reference::quantize_per_token`],
//! [`reference::quantize_per_group128`]).
//!
//! # The two modes
//! * [`Mode::PerToken`]: per row `s_t = max(amax_t / 448, 1/(448*512))`, 1.0 for an all-zero row,
//!   `q = e4m3(clamp(x / s_t, ±448))` (an exact `div.rn.f32` per element); scales f32 `[T]`.
//! * [`Mode::PerGroup128`]: per row and per 128 columns `s = max(amax, 1e-4) / 448`,
//!   `q = e4m3(x * (1/s))` (`rcp.rn.f32`, then `mul.rn.f32`); the last group is short when
//!   `K % 128 != 0`. Scales f32 `[ceil(K/128), T]`, **group-major** (the GEMM epilogue reads the
//!   scales of consecutive tokens of one K block contiguously): the host reference's `[T,
//!   ceil(K/128)]` transposed ([`scales_group_major`]).
//!
//! Both convert with `cvt.rn.satfinite.e4m3x2.f32` (round to nearest even, finite values past 448
//! saturate to ±448: the host's clamp and table search). The amax is taken on the bf16 bits: for
//! finite values `|x|` orders as `bits & 0x7FFF` does, so an integer `max.u32` (and
//! `shfl.sync.bfly`) gives exactly the f32 `max(|x|)` of the host, without rounding. Inputs must be
//! finite (NaN and infinities are outside the contract: the host maps them differently).
//!
//! # Shape of the kernels
//! Every thread loads 8 bf16 (one 16-byte `ld.global.nc.v4.b32`) and stores their 8 codes (one
//! 8-byte `st.global.v2.b32`), so a warp reads 512 and writes 256 contiguous bytes.
//! * Per token: one CTA per row, `threads = min(256, 32 * ceil(K/256))`, each thread holding
//!   `ceil(K / (8 threads))` chunks of 8 in registers (chunk `tid + i * threads`); the amax is
//!   reduced over the warp with `shfl.sync.bfly`, then over the warps through shared memory.
//!   K is at most [`MAX_K_PER_TOKEN`] (16 chunks a thread).
//! * Per 1x128 group: 16 threads (a half warp) per `(row, group)`, 256 threads (16 groups) per
//!   CTA, the groups numbered row-major (`h = row * G + group`, so a CTA streams contiguous
//!   memory); the amax is reduced over the half warp with `shfl.sync.bfly` 8, 4, 2, 1.
//!
//! # Parameters, in order
//! `.param .u64 x` (bf16 `[T, K]`, 16-byte aligned), `.param .u64 q` (E4M3 `[T, K]`, 8-byte
//! aligned), `.param .u64 scales` (f32 `[T]` or `[ceil(K/128), T]`, 4-byte aligned), `.param .u32
//! rows` (`T`). `K` is compiled in. Grid: [`Launch::grid`] CTAs of [`Launch::threads`].

use super::emit::{Emit as _, K};
use super::kernel::module_header;
use crate::gemm::reference::{self, BLOCK};
use crate::ptx::{
    BinOpcode, Builder, CmpOp, Entry, Inst, Operand, Param, PtxTy, Reg, RegClass, SharedDecl,
    SharedTy, SpecialReg, UnOpcode,
};
use crate::{Error, Result};

/// The per-token kernel's entry name.
pub const PER_TOKEN_ENTRY: &str = "moeforge_act_quant_e4m3_per_token";
/// The per-1x128-group kernel's entry name.
pub const PER_GROUP_ENTRY: &str = "moeforge_act_quant_e4m3_group128";
/// Parameter names, in launch order.
pub const PARAMS: [&str; 4] = ["x", "q", "scales", "rows"];
/// The largest E4M3 magnitude.
pub const E4M3_MAX: f32 = 448.0;
/// The per-token scale's floor, `1/(448*512)` rounded to f32 as the host reference computes it.
pub const PER_TOKEN_FLOOR: f32 = 1.0 / (448.0 * 512.0);
/// The per-group amax floor.
pub const GROUP_AMAX_FLOOR: f32 = 1e-4;
/// The largest K of the per-token kernel (16 chunks of 8 for each of 256 threads).
pub const MAX_K_PER_TOKEN: u32 = 8 * 256 * MAX_CHUNKS;
/// The largest K of the per-group kernel (the kernel's 32-bit column arithmetic).
pub const MAX_K_PER_GROUP: u32 = 1 << 24;
/// Threads per CTA of the per-group kernel (16 groups of 16 threads).
pub const GROUP_THREADS: u32 = 256;
/// Groups per CTA of the per-group kernel.
pub const GROUPS_PER_CTA: u32 = GROUP_THREADS / 16;
/// Chunks of 8 a per-token thread holds at most.
const MAX_CHUNKS: u32 = 16;

/// How the scales are shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// One scale per token (row).
    PerToken,
    /// One scale per token and 128 consecutive columns.
    PerGroup128,
}

impl Mode {
    /// The kernel's entry name.
    pub fn entry(self) -> &'static str {
        match self {
            Mode::PerToken => PER_TOKEN_ENTRY,
            Mode::PerGroup128 => PER_GROUP_ENTRY,
        }
    }
}

/// What a launch of an activation-quantization kernel needs besides its arguments.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Launch {
    /// The entry name.
    pub entry: String,
    /// The mode.
    pub mode: Mode,
    /// K (compiled in).
    pub k: u32,
    /// Threads per CTA.
    pub threads: u32,
    /// Chunks of 8 values each thread handles (per token; 1 per group).
    pub chunks_per_thread: u32,
}

impl Launch {
    /// Groups of 128 columns per row, `ceil(K / 128)`.
    pub fn groups(&self) -> usize {
        groups(self.k as usize)
    }

    /// The number of scales for `t` rows: `t` per token, `ceil(K/128) * t` per group.
    pub fn scales_len(&self, t: usize) -> usize {
        match self.mode {
            Mode::PerToken => t,
            Mode::PerGroup128 => self.groups() * t,
        }
    }

    /// CTAs for `t` rows: one per row (per token), `ceil(t * G / 16)` (per group); `None` past the
    /// kernel's 32-bit indices (`t * G` must stay below `2^32 - 16`) or the grid's `2^31 - 1`.
    pub fn grid(&self, t: usize) -> Option<u32> {
        let ctas = match self.mode {
            Mode::PerToken => t,
            Mode::PerGroup128 => {
                let items = t.checked_mul(self.groups())?;
                if items > (u32::MAX - GROUPS_PER_CTA) as usize {
                    return None;
                }
                items.div_ceil(GROUPS_PER_CTA as usize)
            }
        };
        u32::try_from(ctas).ok().filter(|c| *c <= i32::MAX as u32)
    }
}

/// Groups of 128 columns in a row of `k`: `ceil(k / 128)`.
pub fn groups(k: usize) -> usize {
    k.div_ceil(BLOCK)
}

/// The host reference's per-group scales `[t, ceil(k/128)]` (row-major) transposed to the
/// kernel's group-major `[ceil(k/128), t]`. Errors: `scales` not of `t * ceil(k/128)` values.
pub fn scales_group_major(scales: &[f32], t: usize, k: usize) -> Result<Vec<f32>> {
    let g = groups(k);
    if scales.len() != t * g {
        return Err(Error::BufferSize {
            name: "scales".into(),
            expected: t * g * 4,
            got: scales.len() * 4,
        });
    }
    let mut out = Vec::with_capacity(scales.len());
    for j in 0..g {
        out.extend((0..t).map(|r| scales[r * g + j]));
    }
    Ok(out)
}

/// The host reference in the kernel's layout: codes `[t, k]` and scales (`[t]` per token,
/// `[ceil(k/128), t]` per group) of `x` (f32 values, `t * k` of them).
pub fn reference(mode: Mode, x: &[f32], k: usize) -> Result<(Vec<u8>, Vec<f32>)> {
    match mode {
        Mode::PerToken => reference::quantize_per_token(x, k),
        Mode::PerGroup128 => {
            let (q, s) = reference::quantize_per_group128(x, k)?;
            let t = x.len() / k.max(1);
            Ok((q, scales_group_major(&s, t, k)?))
        }
    }
}

fn unsupported(what: String) -> Error {
    Error::Unsupported {
        param: "activation quantization".into(),
        what,
    }
}

/// The launch shape of `mode` at `K = k`, after checking `k`: positive, a multiple of 8 (one
/// 16-byte load of bf16 never straddles a row) and at most [`MAX_K_PER_TOKEN`] (per token) or
/// [`MAX_K_PER_GROUP`] (per group).
pub fn launch(mode: Mode, k: u32) -> Result<Launch> {
    if k == 0 || !k.is_multiple_of(8) {
        return Err(unsupported(format!("K = {k} (positive, a multiple of 8)")));
    }
    let (threads, chunks_per_thread) = match mode {
        Mode::PerToken => {
            if k > MAX_K_PER_TOKEN {
                return Err(unsupported(format!(
                    "K = {k} per token (at most {MAX_K_PER_TOKEN})"
                )));
            }
            let chunks = k / 8;
            let threads = (32 * chunks.div_ceil(32)).min(256);
            (threads, chunks.div_ceil(threads))
        }
        Mode::PerGroup128 => {
            if k > MAX_K_PER_GROUP {
                return Err(unsupported(format!(
                    "K = {k} per group (at most {MAX_K_PER_GROUP})"
                )));
            }
            (GROUP_THREADS, 1)
        }
    };
    Ok(Launch {
        entry: mode.entry().to_string(),
        mode,
        k,
        threads,
        chunks_per_thread,
    })
}

/// The kernel of `mode` for `K = k`: the PTX module (`.version`, `.target sm_90a`, one entry
/// [`Mode::entry`]) and its launch information. Errors: as [`launch`].
pub fn act_quant(mode: Mode, k: u32) -> Result<(String, Launch)> {
    let l = launch(mode, k)?;
    let mut entry = Entry::new(mode.entry());
    entry.params = vec![
        Param::global_ptr(PARAMS[0], 16),
        Param::global_ptr(PARAMS[1], 8),
        Param::global_ptr(PARAMS[2], 4),
        Param::scalar(PARAMS[3], PtxTy::U32),
    ];
    let mut g = K {
        b: Builder::default(),
    };
    match mode {
        Mode::PerToken => per_token(&mut g, &l)?,
        Mode::PerGroup128 => per_group(&mut g, &l),
    }
    Ok((module_header() + &g.entry_text(&entry)?, l))
}

/// The activation quantizers' own helpers over [`K`].
impl K {
    /// The `rows` parameter (`T`).
    fn rows(&mut self) -> Reg {
        let d = self.reg32();
        self.b.push(Inst::LdParam {
            ty: PtxTy::U32,
            d,
            name: PARAMS[3].into(),
        });
        d
    }

    /// Four words of 8 bf16 from `addr`, skipped (left zero: they add nothing to the amax) where
    /// `valid` is false.
    fn load_chunk(&mut self, addr: Reg, valid: Option<Reg>) -> [Reg; 4] {
        let words = [self.reg32(), self.reg32(), self.reg32(), self.reg32()];
        let skip = valid.map(|p| {
            for w in words {
                self.b.push(Inst::Un {
                    op: UnOpcode::Mov(PtxTy::B32),
                    d: w,
                    a: Operand::Int(0),
                });
            }
            let l = self.b.label("skip_load");
            self.bra(&l, Some((p, true)));
            l
        });
        self.b.push(Inst::LdV {
            nc: true,
            words: words.to_vec(),
            addr,
        });
        if let Some(l) = skip {
            self.b.push(Inst::Label(l));
        }
        words
    }

    /// `m = max(m, |x|)` over the 8 bf16 of `words`, on the magnitude bits (`bits & 0x7FFF`).
    fn amax_bits(&mut self, m: Reg, words: &[Reg; 4]) {
        for &w in words {
            let lo = self.bin(BinOpcode::And, PtxTy::B32, w, Operand::Int(0x7FFF));
            let hi = self.bin(BinOpcode::Shr, PtxTy::U32, w, Operand::Int(16));
            self.bin_to(hi, BinOpcode::And, PtxTy::B32, hi, Operand::Int(0x7FFF));
            self.bin_to(m, BinOpcode::Max, PtxTy::U32, m, Operand::Reg(lo));
            self.bin_to(m, BinOpcode::Max, PtxTy::U32, m, Operand::Reg(hi));
        }
    }

    /// The f32 value of amax magnitude bits (a bf16's high half).
    fn amax_f32(&mut self, m: Reg) -> Reg {
        let bits = self.bin(BinOpcode::Shl, PtxTy::B32, m, Operand::Int(16));
        self.un(UnOpcode::Mov(PtxTy::B32), RegClass::F32, Operand::Reg(bits))
    }

    /// The 8 codes of the chunk `words` as two words: each value `v` becomes `e4m3(v op s)`.
    fn quantize_chunk(&mut self, words: &[Reg; 4], op: BinOpcode, s: Reg) -> [Reg; 2] {
        let mut ys = Vec::with_capacity(8);
        for &w in words {
            let lo = self.bin(BinOpcode::Shl, PtxTy::B32, w, Operand::Int(16));
            let hi = self.bin(
                BinOpcode::And,
                PtxTy::B32,
                w,
                Operand::Int(0xFFFF_0000u32.into()),
            );
            for bits in [lo, hi] {
                let v = self.un(UnOpcode::Mov(PtxTy::B32), RegClass::F32, Operand::Reg(bits));
                ys.push(self.bin(op, PtxTy::F32, v, Operand::Reg(s)));
            }
        }
        let ys: [Reg; 8] = [ys[0], ys[1], ys[2], ys[3], ys[4], ys[5], ys[6], ys[7]];
        self.e4m3_pack(&ys)
    }

    fn store_codes(&mut self, addr: Reg, codes: [Reg; 2]) {
        self.b.push(Inst::StV {
            words: codes.to_vec(),
            addr,
        });
    }
}

/// One CTA per row: load the row into registers, reduce the amax over the CTA, store the scale
/// (thread 0) and the codes.
fn per_token(g: &mut K, l: &Launch) -> Result<()> {
    let (threads, cpt) = (l.threads, l.chunks_per_thread);
    let chunks = l.k / 8;
    let warps = threads / 32;
    if warps > 1 {
        g.b.declare_shared(SharedDecl::array("amax_warp", SharedTy::B32, warps, 4)?)?;
    }
    let tid = g.special(SpecialReg::TidX);
    let row = g.special(SpecialReg::CtaidX);
    let rows = g.rows();
    let done = g.b.label("done");
    let past = g.setp(CmpOp::Ge, row, Operand::Reg(rows));
    g.bra(&done, Some((past, false)));

    // This thread's first chunk: x + row * 2K + 16 tid; q + row * K + 8 tid.
    let x = g.global_param(PARAMS[0]);
    let row_x = g.wide(row, 2 * i64::from(l.k));
    let tid_x = g.wide(tid, 16);
    let x0 = g.bin(BinOpcode::Add, PtxTy::U64, x, Operand::Reg(row_x));
    g.bin_to(x0, BinOpcode::Add, PtxTy::U64, x0, Operand::Reg(tid_x));
    // Chunk i is valid for every thread when (i + 1) * threads <= chunks, else below a bound.
    let mut valid = Vec::with_capacity(cpt as usize);
    for i in 0..cpt {
        valid.push(if (i + 1) * threads <= chunks {
            None
        } else {
            let bound = i64::from(chunks - i * threads);
            Some(g.setp(CmpOp::Lt, tid, Operand::Int(bound)))
        });
    }
    let m = g.reg32();
    g.b.push(Inst::Un {
        op: UnOpcode::Mov(PtxTy::U32),
        d: m,
        a: Operand::Int(0),
    });
    let mut data = Vec::with_capacity(cpt as usize);
    for (i, v) in valid.iter().enumerate() {
        let addr = g.bin(
            BinOpcode::Add,
            PtxTy::U64,
            x0,
            Operand::Int(16 * i64::from(threads) * i as i64),
        );
        let words = g.load_chunk(addr, *v);
        data.push(words);
    }
    for words in &data {
        g.amax_bits(m, words);
    }
    g.reduce_max_u32(m, &[16, 8, 4, 2, 1]);
    if warps > 1 {
        let smem = g.b.shared_addr("amax_warp");
        let lane = g.bin(BinOpcode::And, PtxTy::B32, tid, Operand::Int(31));
        let warp = g.bin(BinOpcode::Shr, PtxTy::U32, tid, Operand::Int(5));
        let slot = g.bin(BinOpcode::Shl, PtxTy::B32, warp, Operand::Int(2));
        g.bin_to(slot, BinOpcode::Add, PtxTy::U32, slot, Operand::Reg(smem));
        let first = g.setp(CmpOp::Ne, lane, Operand::Int(0));
        let stored = g.b.label("stored");
        g.bra(&stored, Some((first, false)));
        g.b.push(Inst::StShared { addr: slot, v: m });
        g.b.push(Inst::Label(stored));
        g.b.push(Inst::BarSync);
        for w in 0..warps {
            let o = g.reg32();
            g.b.push(Inst::LdShared {
                d: o,
                addr: smem,
                off: 4 * i64::from(w),
            });
            g.bin_to(m, BinOpcode::Max, PtxTy::U32, m, Operand::Reg(o));
        }
    }
    // s = amax == 0 ? 1 : max(amax / 448, 1/(448*512)).
    let amax = g.amax_f32(m);
    let s = g.e4m3_token_scale(amax, m);
    // Thread 0 stores the scale.
    let not_first = g.setp(CmpOp::Ne, tid, Operand::Int(0));
    let scaled = g.b.label("scaled");
    g.bra(&scaled, Some((not_first, false)));
    let scales = g.global_param(PARAMS[2]);
    let off = g.wide(row, 4);
    let sa = g.bin(BinOpcode::Add, PtxTy::U64, scales, Operand::Reg(off));
    g.b.push(Inst::St {
        ty: PtxTy::F32,
        addr: sa,
        v: s,
    });
    g.b.push(Inst::Label(scaled));
    // The codes: q + row * K + 8 (tid + i * threads).
    let q = g.global_param(PARAMS[1]);
    let row_q = g.wide(row, i64::from(l.k));
    let tid_q = g.wide(tid, 8);
    let q0 = g.bin(BinOpcode::Add, PtxTy::U64, q, Operand::Reg(row_q));
    g.bin_to(q0, BinOpcode::Add, PtxTy::U64, q0, Operand::Reg(tid_q));
    for (i, (words, v)) in data.iter().zip(&valid).enumerate() {
        let codes = g.quantize_chunk(words, BinOpcode::DivRn, s);
        let skip = v.map(|p| {
            let l = g.b.label("skip_store");
            g.bra(&l, Some((p, true)));
            l
        });
        let addr = g.bin(
            BinOpcode::Add,
            PtxTy::U64,
            q0,
            Operand::Int(8 * i64::from(threads) * i as i64),
        );
        g.store_codes(addr, codes);
        if let Some(l) = skip {
            g.b.push(Inst::Label(l));
        }
    }
    g.b.push(Inst::Label(done));
    g.b.push(Inst::Ret);
    Ok(())
}

/// A half warp per `(row, group)`: `h = 16 ctaid + tid / 16`, `row = h / G`, `group = h % G`.
fn per_group(g: &mut K, l: &Launch) {
    let k = l.k;
    let ngroups = i64::from(k.div_ceil(BLOCK as u32));
    let tid = g.special(SpecialReg::TidX);
    let cta = g.special(SpecialReg::CtaidX);
    let rows = g.rows();
    let total = g.bin(BinOpcode::MulLo, PtxTy::U32, rows, Operand::Int(ngroups));
    let h = g.bin(
        BinOpcode::Shl,
        PtxTy::B32,
        cta,
        Operand::Int(i64::from(GROUPS_PER_CTA.trailing_zeros())),
    );
    let half = g.bin(BinOpcode::Shr, PtxTy::U32, tid, Operand::Int(4));
    g.bin_to(h, BinOpcode::Add, PtxTy::U32, h, Operand::Reg(half));
    let lane = g.bin(BinOpcode::And, PtxTy::B32, tid, Operand::Int(15));
    let row = g.bin(BinOpcode::Div, PtxTy::U32, h, Operand::Int(ngroups));
    let row_g = g.bin(BinOpcode::MulLo, PtxTy::U32, row, Operand::Int(ngroups));
    let grp = g.bin(BinOpcode::Sub, PtxTy::U32, h, Operand::Reg(row_g));
    // col = 128 group + 8 lane.
    let col = g.bin(BinOpcode::Shl, PtxTy::B32, grp, Operand::Int(7));
    let lane8 = g.bin(BinOpcode::Shl, PtxTy::B32, lane, Operand::Int(3));
    g.bin_to(col, BinOpcode::Add, PtxTy::U32, col, Operand::Reg(lane8));
    let valid = g.setp(CmpOp::Lt, h, Operand::Reg(total));
    if !k.is_multiple_of(BLOCK as u32) {
        let in_row = g.setp(CmpOp::Lt, col, Operand::Int(k.into()));
        g.bin_to(
            valid,
            BinOpcode::And,
            PtxTy::Pred,
            valid,
            Operand::Reg(in_row),
        );
    }
    // x + 2 (row K + col).
    let x = g.global_param(PARAMS[0]);
    let row_x = g.wide(row, 2 * i64::from(k));
    let col_x = g.wide(col, 2);
    let xa = g.bin(BinOpcode::Add, PtxTy::U64, x, Operand::Reg(row_x));
    g.bin_to(xa, BinOpcode::Add, PtxTy::U64, xa, Operand::Reg(col_x));
    let words = g.load_chunk(xa, Some(valid));
    let m = g.reg32();
    g.b.push(Inst::Un {
        op: UnOpcode::Mov(PtxTy::U32),
        d: m,
        a: Operand::Int(0),
    });
    g.amax_bits(m, &words);
    g.reduce_max_u32(m, &[8, 4, 2, 1]);
    // s = max(amax, 1e-4) / 448; inv = 1 / s (correctly rounded).
    let amax = g.amax_f32(m);
    let (s, inv) = g.e4m3_group_scale(amax);
    let done = g.b.label("done");
    g.bra(&done, Some((valid, true)));
    let codes = g.quantize_chunk(&words, BinOpcode::MulRn, inv);
    let q = g.global_param(PARAMS[1]);
    let row_q = g.wide(row, i64::from(k));
    let col_q = g.un(
        UnOpcode::cvt(PtxTy::U64, PtxTy::U32),
        RegClass::B64,
        Operand::Reg(col),
    );
    let qa = g.bin(BinOpcode::Add, PtxTy::U64, q, Operand::Reg(row_q));
    g.bin_to(qa, BinOpcode::Add, PtxTy::U64, qa, Operand::Reg(col_q));
    g.store_codes(qa, codes);
    // Lane 0 of the half warp stores scales[group * T + row].
    let not_first = g.setp(CmpOp::Ne, lane, Operand::Int(0));
    g.bra(&done, Some((not_first, false)));
    let scales = g.global_param(PARAMS[2]);
    let idx = g.bin(BinOpcode::MulLo, PtxTy::U32, grp, Operand::Reg(rows));
    g.bin_to(idx, BinOpcode::Add, PtxTy::U32, idx, Operand::Reg(row));
    let off = g.wide(idx, 4);
    let sa = g.bin(BinOpcode::Add, PtxTy::U64, scales, Operand::Reg(off));
    g.b.push(Inst::St {
        ty: PtxTy::F32,
        addr: sa,
        v: s,
    });
    g.b.push(Inst::Label(done));
    g.b.push(Inst::Ret);
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::reference::{e4m3_from_f32, e4m3_to_f32};
    use proptest::prelude::*;

    #[test]
    fn k_is_validated() {
        for mode in [Mode::PerToken, Mode::PerGroup128] {
            for bad in [0, 4, 12, 130] {
                let e = act_quant(mode, bad).unwrap_err();
                assert!(matches!(e, Error::Unsupported { .. }), "{mode:?} K={bad}");
                assert!(e.to_string().contains("multiple of 8"), "{e}");
            }
            for good in [8, 128, 2112, 7168] {
                assert!(act_quant(mode, good).is_ok(), "{mode:?} K={good}");
            }
        }
        assert!(act_quant(Mode::PerToken, MAX_K_PER_TOKEN).is_ok());
        assert!(act_quant(Mode::PerToken, MAX_K_PER_TOKEN + 8).is_err());
        assert!(act_quant(Mode::PerGroup128, MAX_K_PER_TOKEN + 8).is_ok());
        assert!(act_quant(Mode::PerGroup128, MAX_K_PER_GROUP + 8).is_err());
    }

    #[test]
    fn launch_shapes() {
        let l = launch(Mode::PerToken, 7168).unwrap();
        assert_eq!((l.threads, l.chunks_per_thread), (256, 4));
        assert_eq!(l.grid(513), Some(513));
        assert_eq!(l.scales_len(513), 513);
        let l = launch(Mode::PerToken, 128).unwrap();
        assert_eq!((l.threads, l.chunks_per_thread), (32, 1));
        let l = launch(Mode::PerGroup128, 2112).unwrap();
        assert_eq!((l.threads, l.groups()), (256, 17));
        assert_eq!(l.scales_len(7), 7 * 17);
        assert_eq!(l.grid(7), Some(8)); // 119 groups, 16 a CTA
        assert_eq!(l.grid(0), Some(0));
        assert_eq!(l.grid(usize::MAX), None);
        assert_eq!(l.grid(1 << 32), None);
    }

    #[test]
    fn group_major_scales_transpose_the_reference() {
        // t = 3 rows, k = 300 (3 groups, the last short): s[r][j] = 10 r + j.
        let s: Vec<f32> = (0..3)
            .flat_map(|r| (0..3).map(move |j| (10 * r + j) as f32))
            .collect();
        let g = scales_group_major(&s, 3, 300).unwrap();
        assert_eq!(g, vec![0.0, 10.0, 20.0, 1.0, 11.0, 21.0, 2.0, 12.0, 22.0]);
        assert!(scales_group_major(&s, 2, 300).is_err());
        assert_eq!(scales_group_major(&[], 0, 128).unwrap(), Vec::<f32>::new());
        // Through the reference: a short last group has its own scale.
        let k = 136;
        let mut x = vec![0.0f32; 2 * k];
        x[130] = 7.0;
        x[k + 3] = -448.0;
        let (q, sg) = reference(Mode::PerGroup128, &x, k).unwrap();
        let f = 1e-4f32 / 448.0;
        assert_eq!(sg, vec![f, 1.0, 7.0 / 448.0, f]);
        assert_eq!(e4m3_to_f32(q[130]), 448.0);
        assert_eq!(e4m3_to_f32(q[k + 3]), -448.0);
        let (_, st) = reference(Mode::PerToken, &x, k).unwrap();
        assert_eq!(st, vec![7.0 / 448.0, 1.0]);
    }

    #[test]
    fn kernels_are_deterministic_and_vectorized() {
        for (mode, k) in [
            (Mode::PerToken, 7168),
            (Mode::PerToken, 2112),
            (Mode::PerGroup128, 7168),
            (Mode::PerGroup128, 2112),
        ] {
            let (a, l) = act_quant(mode, k).unwrap();
            assert_eq!(a, act_quant(mode, k).unwrap().0);
            assert!(a.contains(&format!(".visible .entry {}(", l.entry)));
            assert!(a.contains(".param .u64 .ptr .global .align 16 x,"));
            assert!(a.contains(".param .u32 rows\n"));
            let n = l.chunks_per_thread as usize;
            assert_eq!(a.matches("ld.global.nc.v4.b32").count(), n, "{mode:?}");
            assert_eq!(a.matches("st.global.v2.b32").count(), n, "{mode:?}");
            assert_eq!(
                a.matches("cvt.rn.satfinite.e4m3x2.f32").count(),
                4 * n,
                "{mode:?}"
            );
            assert!(a.contains("shfl.sync.bfly.b32"));
            match mode {
                Mode::PerToken => assert_eq!(a.matches("div.rn.f32").count(), 1 + 8 * n),
                Mode::PerGroup128 => {
                    assert_eq!(a.matches("rcp.rn.f32").count(), 1);
                    assert_eq!(a.matches("mul.rn.f32").count(), 8);
                }
            }
        }
    }

    /// The bf16 magnitude bits order as the values do: the kernels' integer amax is the host's.
    #[test]
    fn bf16_magnitude_bits_order_as_values() {
        let mags: Vec<u16> = (0..0x7F80u16).step_by(7).chain([0x7F7F]).collect();
        for w in mags.windows(2) {
            let (a, b) = (
                f32::from_bits((w[0] as u32) << 16),
                f32::from_bits((w[1] as u32) << 16),
            );
            assert!(a < b, "{:#x} {:#x}", w[0], w[1]);
        }
    }

    proptest! {
        /// The host reference's codes dequantize within half an E4M3 ulp of `x / s` (clamped to
        /// ±448), per token and per group: the codes are the nearest values.
        #[test]
        fn reference_codes_are_within_half_an_ulp(
            vals in prop::collection::vec(
                prop_oneof![
                    -1.0e3f32..1.0e3,
                    -1.0f32..1.0,
                    -1.0e-3f32..1.0e-3,
                    Just(0.0f32),
                ],
                16..400,
            ),
            k8 in 1usize..40,
        ) {
            let k = 8 * k8;
            let t = vals.len() / k;
            prop_assume!(t > 0);
            let x = &vals[..t * k];
            for mode in [Mode::PerToken, Mode::PerGroup128] {
                let (q, s) = reference(mode, x, k).unwrap();
                for (i, (&v, &c)) in x.iter().zip(&q).enumerate() {
                    let (r, j) = (i / k, (i % k) / BLOCK);
                    let y = match mode {
                        Mode::PerToken => v / s[r],
                        Mode::PerGroup128 => v * (1.0 / s[j * t + r]),
                    }
                    .clamp(-E4M3_MAX, E4M3_MAX);
                    let d = e4m3_to_f32(c);
                    prop_assert!(!d.is_nan());
                    // The ulp of E4M3 at |y|: 2^(e - 3) for normals (e >= -6), 2^-9 below.
                    let e = (y.abs().max(2f32.powi(-6))).log2().floor();
                    let ulp = 2f32.powf(e - 3.0);
                    prop_assert!((d - y).abs() <= ulp / 2.0, "{} -> {} ({}), ulp {}", y, d, c, ulp);
                    prop_assert_eq!(c, e4m3_from_f32(y));
                }
            }
        }
    }
}
