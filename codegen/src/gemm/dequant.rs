//! Weights dequantized into wgmma's register-sourced A operand (issue \[8\]): the consumer loads a
//! k-tile's weight codes from its stage and converts them to the bf16 fragment `wgmma ...
//! {a0, a1, a2, a3}, descB` reads (GEMM.md §1.6, register A, k16: `a_j` holds rows
//! `16 w + l / 4 + 8 (j & 1)`, K `2 (l & 3) + 8 (j >> 1)` and the next, the low half first).
//!
//! Int8 codes ([`super::ws::Operands::I8Bf16`]): the stage holds the tile's `64 C` weight rows of
//! `bk` bytes each (each consumer reads its own 64 from its offset), unswizzled (the TMA box of a
//! `Uint8` map with no swizzle), in the kernel's order
//! ([`crate::gemm::reference::i8_kernel_place`]): each thread's 16 bytes of a row's k-tile are
//! contiguous, one 16-byte `ld.shared` a row (conflict-free: a quarter-warp reads 128 contiguous
//! bytes), and each code converts with no integer-to-float instruction and no byte permute
//! ([`i8_ktile_regs`]). The weights' scale is not applied here (per row: in the epilogue, on the
//! f32 accumulator).

use crate::ptx::{BinOpcode, Inst, Operand, PtxTy, Reg, RegClass, UnOpcode};

use super::emit::{Emit as _, K};
use super::ws::{GroupScale, W4Codes, W4};

/// The per-thread constants of a register-A operand's fragments.
pub(crate) enum RegA {
    /// Int8 codes.
    I8(I8Frag),
    /// 4-bit codes with group scales.
    W4(W4Frag),
}

/// The A registers of the four k16 steps of the k-tile whose A starts at shared address `a` (rows
/// of `row_bytes`) and whose group scales (4-bit codes) start at `scales`.
pub(crate) fn ktile_a_regs(
    k: &mut K,
    fr: &RegA,
    a: Reg,
    scales: Reg,
    row_bytes: u32,
) -> Vec<[Reg; 4]> {
    match fr {
        RegA::I8(f) => i8_ktile_regs(k, f, a, row_bytes),
        RegA::W4(f) => w4_a_regs(k, f, a, scales),
    }
}

/// Per-thread constants of the int8 fragment loads.
pub(crate) struct I8Frag {
    /// Byte offset of the thread's 16 bytes of its row `16 w + l / 4` in a stage's A: `16 (l & 3)`
    /// into the row ([`crate::gemm::reference::i8_kernel_place`]).
    base: Reg,
    /// The f32 2^23 (`0x4B000000`), whose mantissa takes a code.
    magic: Reg,
}

/// The fragment row `16 w + l / 4` of lane `lane` of warp `warp` (GEMM.md §1.6).
fn frag_row(k: &mut K, warp: Reg, lane: Reg) -> Reg {
    let row = k.bin(BinOpcode::Shl, PtxTy::B32, warp, Operand::Int(4));
    let quad = k.bin(BinOpcode::Shr, PtxTy::U32, lane, Operand::Int(2));
    k.bin_to(row, BinOpcode::Add, PtxTy::U32, row, Operand::Reg(quad));
    row
}

/// The per-thread constants for lane `lane` of warp `warp` (in its warpgroup), rows of
/// `row_bytes` bytes.
pub(crate) fn i8_frag(k: &mut K, warp: Reg, lane: Reg, row_bytes: u32) -> I8Frag {
    let row = frag_row(k, warp, lane);
    let base = k.bin(
        BinOpcode::MulLo,
        PtxTy::U32,
        row,
        Operand::Int(row_bytes.into()),
    );
    let c = k.bin(BinOpcode::And, PtxTy::B32, lane, Operand::Int(3));
    k.bin_to(c, BinOpcode::Shl, PtxTy::B32, c, Operand::Int(4));
    k.bin_to(base, BinOpcode::Add, PtxTy::U32, base, Operand::Reg(c));
    let magic = k.imm(0x4B00_0000);
    I8Frag { base, magic }
}

/// The A registers of the four k16 steps of the k-tile whose A starts at shared address `a` (rows
/// of `row_bytes`), in the kernel's order: the thread's 16 bytes of rows `r` and `r + 8` with one
/// 16-byte load each, word `s` of a row holding step `s` (`a_j`: row `r + 8 (j & 1)`, its pair in
/// bytes 0 and 2 for `j < 2`, 1 and 3 for `j >= 2`).
///
/// Each pair converts with byte permutes and no integer-to-float instruction (those issue at a
/// quarter of the rate) ([`i8_pair`]): 3.5 ALU and 2 FMA-pipe instructions a pair. (A nibble
/// split, two `lop3` a pair, a bf16x2 `fma` and `add` and the shifts as `mul.hi`, moved the work to
/// the FMA pipe and was 6-20% slower on the H200, run 52.)
pub(crate) fn i8_ktile_regs(k: &mut K, fr: &I8Frag, a: Reg, row_bytes: u32) -> Vec<[Reg; 4]> {
    let at = k.bin(BinOpcode::Add, PtxTy::U32, a, Operand::Reg(fr.base));
    let words = [0u32, 1].map(|h| {
        let d = [0; 4].map(|_| k.b.reg(RegClass::B32));
        k.b.push(Inst::LdSharedV4 {
            d,
            addr: at,
            off: (8 * row_bytes * h).into(),
        });
        d
    });
    // The codes with flipped sign bits (`x + 128`, unsigned).
    let words = words
        .map(|row| row.map(|w| k.bin(BinOpcode::Xor, PtxTy::B32, w, Operand::Int(0x8080_8080))));
    (0..4usize)
        .map(|step| {
            let mut regs = [at; 4];
            for (j, slot) in regs.iter_mut().enumerate() {
                let w = words[j & 1][step];
                *slot = i8_pair(k, fr, w, j as u32 >> 1);
            }
            regs
        })
        .collect()
}

/// Pair `pair` of word `wx` (the codes plus 128, bytes `pair` and `pair + 2`) as bf16x2 by byte
/// permutes: each byte into the mantissa of the f32 `2^23` (`2^23 + x + 128`, exact), minus
/// `2^23 + 128` (exact), and one permute that packs the two f32's high halves (exact: every int8
/// is a bf16).
fn i8_pair(k: &mut K, fr: &I8Frag, wx: Reg, pair: u32) -> Reg {
    let halves = [pair, pair + 2].map(|byte| {
        let m = k.b.reg(RegClass::B32);
        // d.byte0 = wx.byte[byte], d.byte1..2 = magic's zero bytes, d.byte3 = 0x4B.
        k.b.push(Inst::Prmt {
            d: m,
            a: wx,
            b: fr.magic,
            sel: 0x7540 | i64::from(byte),
        });
        let v = k.un(UnOpcode::Mov(PtxTy::F32), RegClass::F32, Operand::Reg(m));
        let x = k.bin(BinOpcode::Sub, PtxTy::F32, v, Operand::F32(8_388_736.0));
        k.un(UnOpcode::Mov(PtxTy::B32), RegClass::B32, Operand::Reg(x))
    });
    let d = k.b.reg(RegClass::B32);
    k.b.push(Inst::Prmt {
        d,
        a: halves[0],
        b: halves[1],
        sel: 0x7632,
    });
    d
}

/// Per-thread constants of the 4-bit fragment loads (see [`w4_a_regs`]).
pub(crate) struct W4Frag {
    /// The format.
    w: W4,
    /// Byte offset of the thread's 8 bytes of its row `16 w + l / 4` in a stage's A (rows of 32
    /// bytes, the thread's at `8 (l & 3)`).
    row: Reg,
    /// Byte offset of the aligned word holding the scale of row `64 c + 16 w + l / 4` (consumer
    /// `c`) in a group's row of the scale area.
    scale_word: Reg,
    /// Bytes of one group's row of the scale area (the tile's weight rows' scales).
    group_row: u32,
    /// `prmt` selector that gathers that row's scale (from the first word) and row + 8's (from the
    /// second) into the two halves (see [`w4_scales`]).
    scale_sel: Reg,
}

/// The per-thread constants for lane `lane` of warp `warp` of consumer `cwg`, 4-bit format `w`,
/// in a tile of `tile_rows` weight rows (`64` per consumer).
pub(crate) fn w4_frag(
    k: &mut K,
    w: W4,
    warp: Reg,
    lane: Reg,
    (cwg, tile_rows): (Reg, u32),
) -> W4Frag {
    let r = frag_row(k, warp, lane);
    let row = k.bin(BinOpcode::Shl, PtxTy::B32, r, Operand::Int(5));
    let c = k.bin(BinOpcode::And, PtxTy::B32, lane, Operand::Int(3));
    let c8 = k.bin(BinOpcode::Shl, PtxTy::B32, c, Operand::Int(3));
    k.bin_to(row, BinOpcode::Add, PtxTy::U32, row, Operand::Reg(c8));
    let sb = i64::from(w.scale.bytes());
    // The row in the tile (the consumer's 64 rows after the others'), for its scale.
    let tr = if tile_rows > 64 {
        let tr = k.bin(BinOpcode::Shl, PtxTy::B32, cwg, Operand::Int(6));
        k.bin_to(tr, BinOpcode::Add, PtxTy::U32, tr, Operand::Reg(r));
        tr
    } else {
        r
    };
    let scale_word = k.bin(BinOpcode::MulLo, PtxTy::U32, tr, Operand::Int(sb));
    k.bin_to(
        scale_word,
        BinOpcode::And,
        PtxTy::B32,
        scale_word,
        Operand::Int(-4),
    );
    let scale_sel = if sb == 1 {
        // Bytes [q, q, 4 + q, 4 + q], q = r & 3: `0x4400 + 0x1111 q`.
        let q = k.bin(BinOpcode::And, PtxTy::B32, r, Operand::Int(3));
        let sel = k.bin(BinOpcode::MulLo, PtxTy::U32, q, Operand::Int(0x1111));
        k.bin_to(sel, BinOpcode::Add, PtxTy::U32, sel, Operand::Int(0x4400));
        sel
    } else {
        // Halves: bytes [2h, 2h + 1, 4 + 2h, 5 + 2h], h = r & 1: `0x5410 + 0x2222 h`.
        let h = k.bin(BinOpcode::And, PtxTy::B32, r, Operand::Int(1));
        let sel = k.bin(BinOpcode::MulLo, PtxTy::U32, h, Operand::Int(0x2222));
        k.bin_to(sel, BinOpcode::Add, PtxTy::U32, sel, Operand::Int(0x5410));
        sel
    };
    W4Frag {
        w,
        row,
        scale_word,
        group_row: tile_rows * w.scale.bytes(),
        scale_sel,
    }
}

/// The bf16x2 scales of group `gi` of a k-tile for the thread's two rows: `[s(r), s(r + 8)]`, each
/// the factor that multiplies a converted code (see [`w4_a_regs`]).
fn w4_scales(k: &mut K, fr: &W4Frag, scales: Reg, gi: u32) -> Reg {
    let sb = fr.w.scale.bytes();
    let at = k.bin(
        BinOpcode::Add,
        PtxTy::U32,
        scales,
        Operand::Reg(fr.scale_word),
    );
    let words = [0u32, 8 * sb].map(|off| {
        let d = k.b.reg(RegClass::B32);
        k.b.push(Inst::LdSharedU32 {
            d,
            addr: at,
            off: (gi * fr.group_row + off).into(),
        });
        d
    });
    let z = k.b.reg(RegClass::B32);
    k.b.push(Inst::PrmtR {
        d: z,
        a: words[0],
        b: words[1],
        sel: fr.scale_sel,
    });
    match fr.w.scale {
        GroupScale::Bf16 => z,
        GroupScale::E4m3 => {
            // z = [x, x, x8, x8]: each half `x << 8 | x`. The E4M3 bits placed as bf16's (sign at
            // 15, exponent and mantissa at 10..4) are its value times 2^-120, subnormals
            // included; then times 2^120 and 2^118 (both exact).
            let sign = k.bin(BinOpcode::And, PtxTy::B32, z, Operand::Int(0x8000_8000));
            // `z >> 4` as the high word of `z * 2^28` (an IMAD.HI, off the ALU).
            let mag = k.bin(BinOpcode::MulHi, PtxTy::U32, z, Operand::Int(1 << 28));
            k.bin_to(
                mag,
                BinOpcode::And,
                PtxTy::B32,
                mag,
                Operand::Int(0x07F0_07F0),
            );
            k.bin_to(mag, BinOpcode::Or, PtxTy::B32, mag, Operand::Reg(sign));
            let p120 = k.imm(0x7B80_7B80);
            let p118 = k.imm(0x7A80_7A80);
            let s = k.bin(BinOpcode::MulRn, PtxTy::Bf16x2, mag, Operand::Reg(p120));
            k.bin_to(s, BinOpcode::MulRn, PtxTy::Bf16x2, s, Operand::Reg(p118));
            s
        }
        GroupScale::E8m0 => {
            // z = [b, b, b8, b8]: each half's low byte `b`; bf16 exponent `b + 126` is 2^(b - 1),
            // the scale 2^(b - 127) times 2^126 (the host keeps b <= 128).
            let e = k.bin(BinOpcode::And, PtxTy::B32, z, Operand::Int(0x00FF_00FF));
            k.bin_to(e, BinOpcode::Add, PtxTy::U32, e, Operand::Int(0x007E_007E));
            k.bin_to(e, BinOpcode::Shl, PtxTy::B32, e, Operand::Int(7));
            e
        }
    }
}

/// The A registers of the four k16 steps of a 4-bit k-tile: A at shared address `a` (the
/// consumer's 64 rows of 32 bytes in the kernel's order,
/// [`crate::gemm::reference::w4_kernel_place`]), group scales at `scales` (`groups x 64 C` rows,
/// group-major).
///
/// Thread `c = l & 3` reads its 8 bytes of rows `r` and `r + 8` (one 8-byte load each): word `w`
/// holds steps `2w` and `2w + 1`, and pair `p = 2 (s % 2) + h` of it (`a_j`: row `r + 8 (j & 1)`,
/// `h = j >> 1`) has its two codes (U4) in nibbles `3 - p` and `7 - p`. Then:
/// * E2M1 (bits spread, [`crate::gemm::reference::E2M1_PAIR_BITS`]): pair `p` masked (and for
///   `p > 0` shifted) into bf16's sign and exponent-low/mantissa-high bits ([`e2m1_pair`]) is the
///   values times 2^-126 (the 0.5 subnormal included); times the scale times 2^126 gives
///   `code * scale` (exact: at most 2 + 4 significant bits), or `2^-8` of it for E4M3 scales
///   ([`GroupScale::E4m3`]);
/// * U4: the word shifted right by `4 (3 - p)` puts them at bits 3..0 and 19..16, the mantissa of
///   bf16 128 (`0x4300 | q`); plus -136 (exact: `q - 8`), times the bf16 scale (rounded once).
fn w4_a_regs(k: &mut K, fr: &W4Frag, a: Reg, scales: Reg) -> Vec<[Reg; 4]> {
    let at = k.bin(BinOpcode::Add, PtxTy::U32, a, Operand::Reg(fr.row));
    // words[h][w]: word w of the thread's bytes of row r + 8 h.
    let words = [0u32, 1].map(|h| {
        let d = [0; 2].map(|_| k.b.reg(RegClass::B32));
        k.b.push(Inst::LdSharedV2 {
            d,
            addr: at,
            off: (256 * h).into(),
        });
        d
    });
    let mut cache: Vec<(u32, [Reg; 2])> = Vec::new();
    // bf16x2 -136, the U4 codes' offset (128 + 8).
    let neg136 = match fr.w.codes {
        W4Codes::E2m1 => None,
        W4Codes::U4 => Some(k.imm(0xC308_C308)),
    };
    let mut out = Vec::with_capacity(4);
    for step in 0..4u32 {
        let gi = 16 * step / fr.w.group.min(64);
        let sc = match cache.iter().find(|(g, _)| *g == gi) {
            Some((_, s)) => *s,
            None => {
                let both = w4_scales(k, fr, scales, gi);
                // Each row's scale in both halves (the pair (K, K + 1) shares it): a half
                // broadcast, which ptxas folds into the multiply's `.H0_H0` / `.H1_H1` operand
                // (with `prmt` it issued 8 PRMTs a k-tile of NVFP4's d1x8 variant).
                let s = [false, true].map(|high| {
                    let d = k.b.reg(RegClass::B32);
                    k.b.push(Inst::HalfBroadcast { d, a: both, high });
                    d
                });
                cache.push((gi, s));
                s
            }
        };
        let mut regs = [at; 4];
        for (j, slot) in regs.iter_mut().enumerate() {
            let q = words[j & 1][(step / 2) as usize];
            let p = 2 * (step % 2) + (j as u32 >> 1);
            let v = match (fr.w.codes, neg136) {
                (W4Codes::U4, Some(c136)) => {
                    // `q >> 4 (3 - p)` (a shift on the ALU: INT4's k-loop, two bf16x2
                    // operations a pair, is FMA-pipe heavy; as `mul.hi` it was 5-8% slower,
                    // run 53), then `(t & 0x000F000F) | 0x43004300` as one LOP3.
                    let t = if p == 3 {
                        q
                    } else {
                        k.bin(
                            BinOpcode::Shr,
                            PtxTy::U32,
                            q,
                            Operand::Int((4 * (3 - p)).into()),
                        )
                    };
                    let y = k.b.reg(RegClass::B32);
                    k.b.push(Inst::Lop3 {
                        d: y,
                        a: t,
                        b: Operand::Int(0x000F_000F),
                        c: Operand::Int(0x4300_4300),
                        lut: LUT_A_AND_B_OR_C,
                    });
                    k.bin(BinOpcode::AddRn, PtxTy::Bf16x2, y, Operand::Reg(c136))
                }
                _ => e2m1_pair(k, q, p),
            };
            *slot = k.bin(BinOpcode::MulRn, PtxTy::Bf16x2, v, Operand::Reg(sc[j & 1]));
        }
        out.push(regs);
    }
    out
}

/// `lop3`'s truth table of `(a & b) | c`.
const LUT_A_AND_B_OR_C: u8 = (0xF0 & 0xCC) | 0xAA;

/// Pair `p` of an E2M1 word `q` ([`crate::gemm::reference::E2M1_PAIR_BITS`]) as two bf16
/// `code * 2^-126` (sign at bit 15, exponent and mantissa at bits 8..6 of each half): pair 0 is
/// already in place (one mask), pair 1 three bits lower (a shift, a mask), pairs 2 and 3 have
/// their exponent-and-mantissa bits and their signs at two distances (two shifts, a mask and a
/// masked merge). The shifts are multiplications where they go left, so that ptxas may issue them
/// on the FMA pipe instead of the integer ALU, which the masks keep busy.
fn e2m1_pair(k: &mut K, q: Reg, p: u32) -> Reg {
    const BOTH: i64 = 0x81C0_81C0;
    const MAG: i64 = 0x01C0_01C0;
    const SIGN: i64 = 0x8000_8000;
    let left =
        |k: &mut K, by: u32| k.bin(BinOpcode::MulLo, PtxTy::U32, q, Operand::Int(1i64 << by));
    match p {
        0 => k.bin(BinOpcode::And, PtxTy::B32, q, Operand::Int(BOTH)),
        1 => {
            let t = left(k, 3);
            k.bin_to(t, BinOpcode::And, PtxTy::B32, t, Operand::Int(BOTH));
            t
        }
        _ => {
            // Pair 2: magnitudes 3 bits higher, signs 1 lower; pair 3: 6 lower, 2 lower.
            let mag = if p == 2 {
                // `q >> 3` as the high word of `q * 2^29` (an IMAD.HI, off the ALU).
                k.bin(BinOpcode::MulHi, PtxTy::U32, q, Operand::Int(1 << 29))
            } else {
                left(k, 6)
            };
            k.bin_to(mag, BinOpcode::And, PtxTy::B32, mag, Operand::Int(MAG));
            let sign = left(k, if p == 2 { 1 } else { 2 });
            k.bin_to(sign, BinOpcode::And, PtxTy::B32, sign, Operand::Int(SIGN));
            k.bin_to(sign, BinOpcode::Or, PtxTy::B32, sign, Operand::Reg(mag));
            sign
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::ws::{GroupScale, W4Codes, W4};

    /// `prmt.b32` (default mode): byte `i` of the result is byte `sel[4i..4i+4]` of `{b, a}`.
    fn prmt(a: u32, b: u32, sel: u32) -> u32 {
        let bytes = (u64::from(b) << 32 | u64::from(a)).to_le_bytes();
        (0..4).fold(0u32, |d, i| {
            let s = (sel >> (4 * i)) & 7;
            d | u32::from(bytes[s as usize]) << (8 * i)
        })
    }

    /// The conversion `i8_ktile_regs` emits, on the host, for the pair in bytes 0 and 2 (`pair`
    /// 0) or 1 and 3 (`pair` 1) of word `w`: bf16x2 bits, K in the low half.
    fn convert(w: u32, pair: u32) -> u32 {
        let wx = w ^ 0x8080_8080;
        let half = |byte: u32| {
            let m = prmt(wx, 0x4B00_0000, 0x7540 | byte);
            (f32::from_bits(m) - 8_388_736.0).to_bits()
        };
        prmt(half(pair), half(pair + 2), 0x7632)
    }

    /// `mul.rn.bf16x2` on one half: the exact product (two bf16 fit an f32's 24 bits) rounded
    /// to bf16 (bits).
    fn mul_bf16(a: u16, b: u16) -> u16 {
        use crate::gemm::reference::{bf16_from_f32, bf16_to_f32};
        bf16_from_f32(bf16_to_f32(a) * bf16_to_f32(b))
    }

    /// The E2M1 conversion `w4_a_regs` emits, on one half: the code's sign to bit 15, exponent
    /// and mantissa to bits 8..6 (the value times 2^-126).
    fn e2m1_bits(code: u8) -> u16 {
        let y = u16::from(code) << 12;
        (y & 0x8000) | ((y & 0x7000) >> 6)
    }

    /// What `e2m1_pair` emits, on the host.
    fn e2m1_pair_host(q: u32, p: u32) -> u32 {
        match p {
            0 => q & 0x81C0_81C0,
            1 => q.wrapping_mul(8) & 0x81C0_81C0,
            2 => (q >> 3) & 0x01C0_01C0 | q.wrapping_mul(2) & 0x8000_8000,
            _ => q.wrapping_mul(64) & 0x01C0_01C0 | q.wrapping_mul(4) & 0x8000_8000,
        }
    }

    /// Every pair of E2M1 codes placed at its pair's bits of a word (the other pairs' bits
    /// random) converts to the two halves `e2m1_bits` gives, whatever the rest of the word holds.
    #[test]
    fn every_e2m1_pair_extracts_from_its_bits() {
        use crate::gemm::reference::E2M1_PAIR_BITS;
        let mut noise = 0x9E37_79B9u32;
        for p in 0..4u32 {
            let bits = E2M1_PAIR_BITS[p as usize];
            let mine: u32 = bits.iter().map(|b| (1u32 << b) | (1u32 << (b + 16))).sum();
            for lo in 0..16u8 {
                for hi in 0..16u8 {
                    noise = noise.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    let mut q = noise & !mine;
                    for (j, &b) in bits.iter().enumerate() {
                        q |= u32::from((lo >> j) & 1) << b;
                        q |= u32::from((hi >> j) & 1) << (b + 16);
                    }
                    let y = e2m1_pair_host(q, p);
                    assert_eq!(y & 0xFFFF, u32::from(e2m1_bits(lo)), "{p} {lo} {hi}");
                    assert_eq!(y >> 16, u32::from(e2m1_bits(hi)), "{p} {lo} {hi}");
                }
            }
        }
    }

    /// The group scale factors `w4_scales` forms from a scale byte (one half).
    fn scale_bits(scale: GroupScale, x: u8) -> u16 {
        match scale {
            GroupScale::E4m3 => {
                let half = u16::from(x) << 8 | u16::from(x);
                let raw = (half & 0x8000) | ((half >> 4) & 0x07F0);
                mul_bf16(mul_bf16(raw, 0x7B80), 0x7A80)
            }
            GroupScale::E8m0 => ((u16::from(x) + 0x7E) & 0xFF) << 7,
            GroupScale::Bf16 => u16::from(x),
        }
    }

    /// Every E2M1 code with every E4M3 scale (NaN excluded) and every E8M0 scale up to 128
    /// converts to exactly the weight `reference::w4_weight` defines.
    #[test]
    fn every_e2m1_code_and_scale_is_exact() {
        use crate::gemm::reference::{bf16_to_f32, w4_weight};
        for (scale, group, bytes) in [
            (
                GroupScale::E4m3,
                16,
                (0..=255u8).filter(|b| b & 0x7F != 0x7F).collect::<Vec<_>>(),
            ),
            (GroupScale::E8m0, 32, (0..=128u8).collect()),
        ] {
            let w = W4 {
                codes: W4Codes::E2m1,
                scale,
                group,
            };
            for &x in &bytes {
                let s = scale_bits(scale, x);
                for code in 0..16u8 {
                    let got = bf16_to_f32(mul_bf16(e2m1_bits(code), s));
                    assert_eq!(
                        f64::from(got),
                        w4_weight(w, code, u16::from(x)),
                        "{scale:?} {x:#x} {code}"
                    );
                }
            }
        }
    }

    /// Every U4 code (`0x4300 | q`, plus -136) times bf16 scales is `(q - 8) * s` rounded once.
    #[test]
    fn every_u4_code_is_its_offset_value_times_the_scale() {
        use crate::gemm::reference::{bf16_from_f32, bf16_to_f32, w4_weight};
        let w = W4 {
            codes: W4Codes::U4,
            scale: GroupScale::Bf16,
            group: 128,
        };
        for s in [0x3C01u16, 0x3E4D, 0x3B80, 0x0001, 0x7F00, 0xBF3F] {
            for q in 0..16u8 {
                let t = 0x4300 | u16::from(q);
                let v = bf16_from_f32(bf16_to_f32(t) + bf16_to_f32(0xC308));
                assert_eq!(bf16_to_f32(v), f32::from(q) - 8.0);
                let got = bf16_to_f32(mul_bf16(v, s));
                assert_eq!(f64::from(got), w4_weight(w, q, s), "{s:#x} {q}");
            }
        }
    }

    /// Every pair of int8 codes, in either pair of bytes of a word whose other bytes are
    /// arbitrary, converts to the exact bf16 pair, K in the low half.
    #[test]
    fn every_int8_pair_is_exact() {
        let bf16 = |h: u32| f32::from_bits(h << 16);
        for pair in 0..2u32 {
            for lo in 0..=255u32 {
                for hi in 0..=255u32 {
                    let other = (lo * 7 + hi * 13) & 0xFF;
                    let w = if pair == 0 {
                        hi << 16 | lo | (other << 8) | (other ^ 0x5A) << 24
                    } else {
                        hi << 24 | lo << 8 | other | (other ^ 0xA5) << 16
                    };
                    let got = convert(w, pair);
                    assert_eq!(
                        bf16(got & 0xFFFF),
                        f32::from(lo as u8 as i8),
                        "{pair} {lo} {hi}"
                    );
                    assert_eq!(
                        bf16(got >> 16),
                        f32::from(hi as u8 as i8),
                        "{pair} {lo} {hi}"
                    );
                }
            }
        }
    }
}
