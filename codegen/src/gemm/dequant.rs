//! Weights dequantized into wgmma's register-sourced A operand (issue \[8\]): the consumer loads a
//! k-tile's weight codes from its stage and converts them to the bf16 fragment `wgmma ...
//! {a0, a1, a2, a3}, descB` reads (GEMM.md §1.6, register A, k16: `a_j` holds rows
//! `16 w + l / 4 + 8 (j & 1)`, K `2 (l & 3) + 8 (j >> 1)` and the next, the low half first).
//!
//! Int8 codes ([`super::ws::Operands::I8Bf16`]): the stage holds the tile's 64 weight rows of
//! `bk` bytes each, row-major, unswizzled (the TMA box of a `Uint8` map with no swizzle). Each
//! `a_j` is one 4-byte `ld.shared` (the aligned word that holds its two codes), a shift to bring
//! them to the low half, and a conversion with no integer-to-float instruction (those issue at a
//! quarter of the rate, and with them the kernel was ALU-bound: 2.95 TB/s of weights on the H200):
//! the sign bits flipped (`x + 128`), each byte permuted into the mantissa of the f32 `2^23`, one
//! `sub.f32` of `2^23 + 128` each (exact), and one byte permute that packs the two f32's high
//! halves as bf16x2 (exact: every int8 is a bf16). The weights' scale is not applied here (per
//! row: in the epilogue, on the f32 accumulator).

use crate::ptx::{BinOpcode, Inst, Operand, PtxTy, Reg, RegClass, UnOpcode};

use super::emit::{Emit as _, K};

/// Per-thread constants of the int8 fragment loads.
pub(crate) struct I8Frag {
    /// Byte offset of the thread's first word in a stage's A: row `16 w + l / 4`, column
    /// `4 ((l & 3) >> 1)`.
    base: Reg,
    /// `16 (l & 3 & 1)`: the shift that brings the thread's two codes to the word's low half.
    shift: Reg,
    /// The f32 2^23 (`0x4B000000`), whose mantissa takes a code.
    magic: Reg,
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
    let magic = k.imm(0x4B00_0000);
    I8Frag { base, shift, magic }
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
        // Codes as unsigned `x + 128` (flip the sign bits), each byte into the mantissa of the
        // f32 2^23 (0x4B000000): `2^23 + x + 128`, exact; minus `2^23 + 128` is `x`, exact.
        k.bin_to(w, BinOpcode::Xor, PtxTy::B32, w, Operand::Int(0x8080));
        let mut halves = [fr.magic; 2];
        for (byte, h) in halves.iter_mut().enumerate() {
            let m = k.b.reg(RegClass::B32);
            // d.byte0 = w.byte[byte], d.byte1..2 = magic's zero bytes, d.byte3 = 0x4B.
            k.b.push(Inst::Prmt {
                d: m,
                a: w,
                b: fr.magic,
                sel: 0x7540 | byte as i64,
            });
            let v = k.un(UnOpcode::Mov(PtxTy::F32), RegClass::F32, Operand::Reg(m));
            let x = k.bin(BinOpcode::Sub, PtxTy::F32, v, Operand::F32(8_388_736.0));
            *h = k.un(UnOpcode::Mov(PtxTy::B32), RegClass::B32, Operand::Reg(x));
        }
        // bf16x2 = the high halves of the two f32 (exact: |x| <= 128 has at most 8 significant
        // bits): K in the low half, K + 1 in the high.
        let d = k.b.reg(RegClass::B32);
        k.b.push(Inst::Prmt {
            d,
            a: halves[0],
            b: halves[1],
            sel: 0x7632,
        });
        *slot = d;
    }
    out
}

#[cfg(test)]
mod tests {
    /// `prmt.b32` (default mode): byte `i` of the result is byte `sel[4i..4i+4]` of `{b, a}`.
    fn prmt(a: u32, b: u32, sel: u32) -> u32 {
        let bytes = (u64::from(b) << 32 | u64::from(a)).to_le_bytes();
        (0..4).fold(0u32, |d, i| {
            let s = (sel >> (4 * i)) & 7;
            d | u32::from(bytes[s as usize]) << (8 * i)
        })
    }

    /// The conversion `i8_a_regs` emits, on the host: the low two bytes of `w` (codes K, K + 1)
    /// to bf16x2.
    fn convert(w: u32) -> u32 {
        let w = w ^ 0x8080;
        let half = |byte: u32| {
            let m = prmt(w, 0x4B00_0000, 0x7540 | byte);
            (f32::from_bits(m) - 8_388_736.0).to_bits()
        };
        prmt(half(0), half(1), 0x7632)
    }

    /// Every pair of int8 codes converts to the exact bf16 pair, K in the low half.
    #[test]
    fn every_int8_pair_is_exact() {
        let bf16 = |h: u32| f32::from_bits(h << 16);
        for lo in 0..=255u32 {
            for hi in 0..=255u32 {
                let got = convert(hi << 8 | lo | 0xABCD_0000);
                assert_eq!(bf16(got & 0xFFFF), f32::from(lo as u8 as i8), "{lo} {hi}");
                assert_eq!(bf16(got >> 16), f32::from(hi as u8 as i8), "{lo} {hi}");
            }
        }
    }
}
