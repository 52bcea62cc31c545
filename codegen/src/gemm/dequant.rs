//! Weights dequantized into wgmma's register-sourced A operand (issue \[8\]): the consumer loads a
//! k-tile's weight codes from its stage and converts them to the bf16 fragment `wgmma ...
//! {a0, a1, a2, a3}, descB` reads (GEMM.md §1.6, register A, k16: `a_j` holds rows
//! `16 w + l / 4 + 8 (j & 1)`, K `2 (l & 3) + 8 (j >> 1)` and the next, the low half first).
//!
//! Int8 codes ([`super::ws::Operands::I8Bf16`]): the stage holds the tile's 64 weight rows of
//! `bk` bytes each, row-major, unswizzled (the TMA box of a `Uint8` map with no swizzle). Each
//! `a_j` is one 4-byte `ld.shared` (the aligned word that holds its two codes), a shift to bring
//! them to the low half, two sign extensions, two `cvt.rn.f32.s32` and one
//! `cvt.rn.bf16x2.f32`: exact, as every int8 is a bf16. The weights' scale is not applied here
//! (per row: in the epilogue, on the f32 accumulator).

use crate::ptx::{BinOpcode, Inst, Operand, PtxTy, Reg, RegClass, Rnd, UnOpcode};

use super::emit::K;

/// Per-thread constants of the int8 fragment loads.
pub(crate) struct I8Frag {
    /// Byte offset of the thread's first word in a stage's A: row `16 w + l / 4`, column
    /// `4 ((l & 3) >> 1)`.
    base: Reg,
    /// `16 (l & 3 & 1)`: the shift that brings the thread's two codes to the word's low half.
    shift: Reg,
}

/// The per-thread constants for lane `lane` of warp `warp` (in its warpgroup), rows of
/// `row_bytes` bytes.
pub(crate) fn i8_frag(k: &mut K, warp: Reg, lane: Reg, row_bytes: u32) -> I8Frag {
    let row = k.bin(BinOpcode::Shl, PtxTy::B32, warp, Operand::Int(4));
    let quad = k.bin(BinOpcode::Shr, PtxTy::U32, lane, Operand::Int(2));
    k.bin_to(row, BinOpcode::Add, PtxTy::U32, row, Operand::Reg(quad));
    let base = k.bin(
        BinOpcode::MulLo,
        PtxTy::U32,
        row,
        Operand::Int(row_bytes.into()),
    );
    let c = k.bin(BinOpcode::And, PtxTy::B32, lane, Operand::Int(3));
    let word = k.bin(BinOpcode::Shr, PtxTy::U32, c, Operand::Int(1));
    k.bin_to(word, BinOpcode::Shl, PtxTy::B32, word, Operand::Int(2));
    k.bin_to(base, BinOpcode::Add, PtxTy::U32, base, Operand::Reg(word));
    let shift = k.bin(BinOpcode::And, PtxTy::B32, c, Operand::Int(1));
    k.bin_to(shift, BinOpcode::Shl, PtxTy::B32, shift, Operand::Int(4));
    I8Frag { base, shift }
}

/// The four A registers of k16 step `step` of the k-tile whose A starts at shared address `a`
/// (rows of `row_bytes`).
pub(crate) fn i8_a_regs(k: &mut K, fr: &I8Frag, a: Reg, step: u32, row_bytes: u32) -> [Reg; 4] {
    let at = k.bin(BinOpcode::Add, PtxTy::U32, a, Operand::Reg(fr.base));
    let mut out = [at; 4];
    for (j, slot) in out.iter_mut().enumerate() {
        let j = j as u32;
        let off = 8 * row_bytes * (j & 1) + 8 * (j >> 1) + 16 * step;
        let f = k.b.reg(RegClass::F32);
        k.b.push(Inst::LdShared {
            d: f,
            addr: at,
            off: off.into(),
        });
        let w = k.un(UnOpcode::Mov(PtxTy::B32), RegClass::B32, Operand::Reg(f));
        k.bin_to(w, BinOpcode::Shr, PtxTy::U32, w, Operand::Reg(fr.shift));
        // Sign-extend byte 0 (K) and byte 1 (K + 1).
        let lo = k.bin(BinOpcode::Shl, PtxTy::B32, w, Operand::Int(24));
        k.bin_to(lo, BinOpcode::Shr, PtxTy::S32, lo, Operand::Int(24));
        let hi = k.bin(BinOpcode::Shl, PtxTy::B32, w, Operand::Int(16));
        k.bin_to(hi, BinOpcode::Shr, PtxTy::S32, hi, Operand::Int(24));
        let cvt = UnOpcode::cvt_rnd(Rnd::Rn, PtxTy::F32, PtxTy::S32);
        let flo = k.un(cvt, RegClass::F32, Operand::Reg(lo));
        let fhi = k.un(cvt, RegClass::F32, Operand::Reg(hi));
        // cvt.rn.bf16x2.f32 d, a, b: a to the high half, b to the low.
        let d = k.b.reg(RegClass::B32);
        k.bin_to(
            d,
            BinOpcode::CvtRnBf16x2,
            PtxTy::F32,
            fhi,
            Operand::Reg(flo),
        );
        *slot = d;
    }
    out
}
