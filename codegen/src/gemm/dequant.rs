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
//! bytes), and each code converts by byte permutes with no integer-to-float instruction
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
/// the FMA pipe and was 6-9% slower in decode and 13-26% at prefill on the H200, run 52.)
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
    /// Byte offset of the thread's row `64 c + 16 w + l / 4` (consumer `c`) in a stage's scale
    /// area (rows of [`W4::scale_tile_bytes`], row-major).
    scale_row: Reg,
    /// Four one-byte groups a k-tile (NVFP4): the quad's scales are converted once, lane `4 q + g`
    /// converting group `g` of the quad's two rows, then shared ([`w4_quad_scales`]); this lane's
    /// `prmt` selector for its group, and the quad's four source lanes `4 q + g`.
    quad: Option<(Reg, [Reg; 4])>,
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
    // The row in the tile (the consumer's 64 rows after the others'), for its scales.
    let tr = if tile_rows > 64 {
        let tr = k.bin(BinOpcode::Shl, PtxTy::B32, cwg, Operand::Int(6));
        k.bin_to(tr, BinOpcode::Add, PtxTy::U32, tr, Operand::Reg(r));
        tr
    } else {
        r
    };
    let scale_row = k.bin(
        BinOpcode::MulLo,
        PtxTy::U32,
        tr,
        Operand::Int(w.scale_tile_bytes().into()),
    );
    let quad = (w.groups_per_ktile() == 4 && w.scale.bytes() == 1).then(|| {
        let sel = k.bin(BinOpcode::MulLo, PtxTy::U32, c, Operand::Int(0x1111));
        k.bin_to(
            sel,
            BinOpcode::Add,
            PtxTy::U32,
            sel,
            Operand::Int(SCALE_SEL_BYTES),
        );
        let base = k.bin(BinOpcode::And, PtxTy::B32, lane, Operand::Int(!3));
        let lanes =
            [0i64, 1, 2, 3].map(|g| k.bin(BinOpcode::Or, PtxTy::B32, base, Operand::Int(g)));
        (sel, lanes)
    });
    W4Frag {
        w,
        row,
        scale_row,
        quad,
    }
}

/// The thread's two rows' scales of a k-tile (rows `r` and `r + 8`), one load each (of
/// [`W4::scale_tile_bytes`]: 1 or 2 bytes zero-extended, a word, or two words for bf16 groups of
/// 16): `[row][word]`, each row's groups in k order (the second word the first's copy where there
/// is one word).
fn w4_scale_words(k: &mut K, fr: &W4Frag, scales: Reg) -> [[Reg; 2]; 2] {
    let es = fr.w.scale_tile_bytes();
    let at = k.bin(
        BinOpcode::Add,
        PtxTy::U32,
        scales,
        Operand::Reg(fr.scale_row),
    );
    [0u32, 8 * es].map(|off| {
        let first = k.b.reg(RegClass::B32);
        let d = if es == 8 {
            [first, k.b.reg(RegClass::B32)]
        } else {
            [first; 2]
        };
        let off = off.into();
        match es {
            8 => k.b.push(Inst::LdSharedV2 { d, addr: at, off }),
            4 => k.b.push(Inst::LdSharedU32 {
                d: d[0],
                addr: at,
                off,
            }),
            _ => k.b.push(Inst::LdSharedNarrow {
                d: d[0],
                addr: at,
                off,
                bytes: es as u8,
            }),
        }
        d
    })
}

/// The bf16x2 scales of group `gi` of a k-tile for the thread's two rows: `[s(r), s(r + 8)]`, each
/// the factor that multiplies a converted code (see [`w4_a_regs`]), from the rows' scale words
/// ([`w4_scale_words`]).
fn w4_scales(k: &mut K, fr: &W4Frag, words: [[Reg; 2]; 2], gi: u32) -> Reg {
    // (a word holds 4 one-byte or 2 bf16 scales)
    let word = (gi * fr.w.scale.bytes() / 4) as usize;
    let z = k.b.reg(RegClass::B32);
    k.b.push(Inst::Prmt {
        d: z,
        a: words[0][word],
        b: words[1][word],
        sel: scale_selector(fr.w.scale, gi),
    });
    scale_factor(k, fr.w.scale, z)
}

/// The four groups' bf16x2 scales of a k-tile (as [`w4_scales`] gives each), converted once per
/// quad: lane `4 q + g` gathers and converts group `g` of the quad's rows (a `prmt` with its own
/// selector), then each group's pair comes from its lane (`shfl.sync.idx`). Per k-tile a thread
/// then issues one conversion and four shuffles instead of four conversions.
fn w4_quad_scales(
    k: &mut K,
    fr: &W4Frag,
    words: [[Reg; 2]; 2],
    (sel, lanes): (Reg, [Reg; 4]),
) -> [Reg; 4] {
    let z = k.b.reg(RegClass::B32);
    k.b.push(Inst::PrmtR {
        d: z,
        a: words[0][0],
        b: words[1][0],
        sel,
    });
    let mine = scale_factor(k, fr.w.scale, z);
    lanes.map(|lane| {
        let d = k.b.reg(RegClass::B32);
        k.b.push(Inst::ShflIdx {
            d,
            a: mine,
            lane: Operand::Reg(lane),
        });
        d
    })
}

/// The bf16x2 factor of gathered scale halves `z` (each half the row's scale bits: a one-byte
/// scale sign-extended, or bf16).
fn scale_factor(k: &mut K, scale: GroupScale, z: Reg) -> Reg {
    match scale {
        GroupScale::Bf16 | GroupScale::Bf16Zero => z,
        GroupScale::E4m3 => {
            // z: each half the byte `x` sign-extended. Shifted left by 4 (a multiplication,
            // IMAD) and masked (one LOP3), the E4M3 bits sit as bf16's (sign at 15 from the
            // extension, exponent and mantissa at 10..4): its value times 2^-120, subnormals
            // included; then times 2^120 and 2^118 (both exact).
            let mag = k.bin(BinOpcode::MulLo, PtxTy::U32, z, Operand::Int(16));
            k.bin_to(
                mag,
                BinOpcode::And,
                PtxTy::B32,
                mag,
                Operand::Int(0x87F0_87F0),
            );
            let p120 = k.imm(0x7B80_7B80);
            let p118 = k.imm(0x7A80_7A80);
            let s = k.bin(BinOpcode::MulRn, PtxTy::Bf16x2, mag, Operand::Reg(p120));
            k.bin_to(s, BinOpcode::MulRn, PtxTy::Bf16x2, s, Operand::Reg(p118));
            s
        }
        GroupScale::E8m0 => {
            // z: each half's low byte `b` (the high byte its sign); bf16 exponent `b + 126` is 2^(b - 1),
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
/// [`crate::gemm::reference::w4_kernel_bits`]), group scales at `scales` (`64 C` rows of
/// [`W4::scale_tile_bytes`]: a row's groups of the k-tile in k order).
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
///   bf16 128 (`0x4300 | q`); plus -136 (exact: `q - 8`), or with zero points the group's bf16
///   `-(128 + z)` (exact: `q - z`, [`GroupScale::Bf16Zero`]), times the bf16 scale (rounded once).
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
    let scale_words = w4_scale_words(k, fr, scales);
    let quad = fr.quad.map(|q| w4_quad_scales(k, fr, scale_words, q));
    // Per group of the k-tile: each row's scale and, for U4, the codes' offset (bf16 -(128 + z)).
    let mut cache: Vec<(u32, [Reg; 2], Option<[Reg; 2]>)> = Vec::new();
    // bf16x2 -136, the symmetric U4 codes' offset (128 + 8).
    let neg136 = match (fr.w.codes, fr.w.scale) {
        (W4Codes::U4, GroupScale::Bf16) => Some(k.imm(0xC308_C308)),
        _ => None,
    };
    let broadcast = |k: &mut K, a: Reg, high: bool| {
        let d = k.b.reg(RegClass::B32);
        k.b.push(Inst::HalfBroadcast { d, a, high });
        d
    };
    let mut out = Vec::with_capacity(4);
    for step in 0..4u32 {
        let gi = 16 * step / fr.w.group.min(64);
        let (sc, offset) = match cache.iter().find(|(g, _, _)| *g == gi) {
            Some((_, s, o)) => (*s, *o),
            None => {
                let (s, o) = if fr.w.scale == GroupScale::Bf16Zero {
                    // A row's element is one word (scale low, offset high): each half
                    // broadcast, no gathering `prmt`.
                    let rows = [scale_words[0][gi as usize], scale_words[1][gi as usize]];
                    (
                        rows.map(|w| broadcast(k, w, false)),
                        Some(rows.map(|w| broadcast(k, w, true))),
                    )
                } else {
                    let both = match quad {
                        Some(q) => q[gi as usize],
                        None => w4_scales(k, fr, scale_words, gi),
                    };
                    // Each row's scale in both halves (the pair (K, K + 1) shares it): a half
                    // broadcast, which ptxas folds into the multiply's `.H0_H0` / `.H1_H1`
                    // operand (with `prmt` it issued 8 PRMTs a k-tile of NVFP4's d1x8 variant).
                    let s = [false, true].map(|high| broadcast(k, both, high));
                    (s, neg136.map(|c| [c; 2]))
                };
                cache.push((gi, s, o));
                (s, o)
            }
        };
        let mut regs = [at; 4];
        for (j, slot) in regs.iter_mut().enumerate() {
            let q = words[j & 1][(step / 2) as usize];
            let p = 2 * (step % 2) + (j as u32 >> 1);
            let v = match (fr.w.codes, offset) {
                (W4Codes::U4, Some(off)) => {
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
                    k.bin(BinOpcode::AddRn, PtxTy::Bf16x2, y, Operand::Reg(off[j & 1]))
                }
                _ => e2m1_pair(k, q, p),
            };
            *slot = k.bin(BinOpcode::MulRn, PtxTy::Bf16x2, v, Operand::Reg(sc[j & 1]));
        }
        out.push(regs);
    }
    out
}

/// The `prmt` selector of one-byte group scales for group 0 of a row's word (plus `0x1111 q` for
/// group `q`): bytes `[q, sign of q, 4 + q, sign of 4 + q]` (a selector nibble's bit 3 replicates
/// the byte's sign bit), so that each half is the scale byte sign-extended to 16 bits.
const SCALE_SEL_BYTES: i64 = 0xC480;

/// The `prmt` selector that gathers group `gi`'s scale of row `r` (its word, the first operand)
/// and of row `r + 8` (the second) into the two halves: one-byte scales (byte `gi % 4`)
/// sign-extended ([`SCALE_SEL_BYTES`]); bf16 scales (half `gi % 2`) `0x5410 + 0x2222 (gi % 2)`.
const fn scale_selector(scale: GroupScale, gi: u32) -> i64 {
    match scale {
        GroupScale::Bf16 => 0x5410 + 0x2222 * (gi % 2) as i64,
        // (One element a word: the scales are the low halves.)
        GroupScale::Bf16Zero => 0x5410,
        GroupScale::E4m3 | GroupScale::E8m0 => SCALE_SEL_BYTES + 0x1111 * (gi % 4) as i64,
    }
}

/// `lop3`'s truth table of `(a & b) | c`.
const LUT_A_AND_B_OR_C: u8 = (0xF0 & 0xCC) | 0xAA;

/// Pair `p` of an E2M1 word `q` ([`crate::gemm::reference::E2M1_PAIR_BITS`]) as two bf16
/// `code * 2^-126` (sign at bit 15, exponent and mantissa at bits 8..6 of each half): pair 0 is
/// already in place (one mask), pair 1 three bits lower (a shift, a mask), pairs 2 and 3 have
/// their exponent-and-mantissa bits and their signs at two distances (two shifts, a mask and a
/// masked merge). All the shifts are multiplications (`mul.lo` left, `mul.hi` right), so that ptxas may issue them
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
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use std::collections::HashMap;

    use super::super::emit::K;
    use super::super::ws::{GroupScale, W4Codes, W4};
    use super::e2m1_pair;
    use crate::ptx::{BinOpcode, Inst, Operand, PtxTy, Reg, RegClass, UnOpcode};

    /// `prmt.b32` (default mode): byte `i` of the result is byte `sel[4i..4i+3]` of `{b, a}`,
    /// or with `sel[4i+3]` set that byte's sign bit replicated.
    fn prmt(a: u32, b: u32, sel: u32) -> u32 {
        let bytes = (u64::from(b) << 32 | u64::from(a)).to_le_bytes();
        (0..4).fold(0u32, |d, i| {
            let s = (sel >> (4 * i)) & 0xF;
            let byte = bytes[(s & 7) as usize];
            let v = if s & 8 == 0 {
                byte
            } else if byte & 0x80 != 0 {
                0xFF
            } else {
                0
            };
            d | u32::from(v) << (8 * i)
        })
    }

    /// The one-byte scales' selector gathers row `r`'s scale byte (of the first word) and row
    /// `r + 8`'s (of the second), each sign-extended to a half.
    #[test]
    fn the_scale_selector_sign_extends_each_row_s_byte() {
        for q in 0..4u32 {
            for x in [0x00u32, 0x7F, 0x80, 0xC3, 0x38] {
                let y = x ^ 0x81;
                let w0 = 0x5A5A_5A5A & !(0xFF << (8 * q)) | x << (8 * q);
                let w1 = 0xA5A5_A5A5 & !(0xFF << (8 * q)) | y << (8 * q);
                let z = prmt(w0, w1, super::SCALE_SEL_BYTES as u32 + 0x1111 * q);
                let sext = |b: u32| u32::from(b as u8 as i8 as i16 as u16);
                assert_eq!(z, sext(x) | sext(y) << 16, "{q} {x:#x}");
            }
        }
    }

    /// The conversion `i8_ktile_regs` emits (the word's sign flip, then [`super::i8_pair`]), run
    /// by [`interpret`], for the pair in bytes 0 and 2 (`pair` 0) or 1 and 3 (`pair` 1) of word
    /// `w`: bf16x2 bits, K in the low half.
    fn convert(w: u32, pair: u32) -> u32 {
        let (mut k, r, mut regs) = builder_with(w);
        let magic = k.imm(0x4B00_0000);
        let base = k.imm(0);
        let fr = super::I8Frag { base, magic };
        let wx = k.bin(BinOpcode::Xor, PtxTy::B32, r, Operand::Int(0x8080_8080));
        let d = super::i8_pair(&mut k, &fr, wx, pair);
        interpret(&k.b.insts, &mut regs);
        regs[&d]
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

    /// Runs the straight-line integer, bitwise, byte-permute and f32 instructions the conversions
    /// emit (the PTX semantics of each, on 32-bit values), from `regs`; the registers' values.
    fn interpret(insts: &[Inst], regs: &mut HashMap<Reg, u32>) {
        interpret_with(insts, regs, &HashMap::new());
    }

    /// [`interpret`] with shared memory: 32-bit words by byte address.
    fn interpret_with(insts: &[Inst], regs: &mut HashMap<Reg, u32>, shared: &HashMap<u32, u32>) {
        use crate::ptx::{BinOpcode as B, PtxTy as T};
        for i in insts {
            if let Inst::LdSharedV2 { d, addr, off } = i {
                let a = regs[addr].wrapping_add(*off as u32);
                let v = [shared[&a], shared[&(a + 4)]];
                regs.insert(d[0], v[0]);
                regs.insert(d[1], v[1]);
                continue;
            }
            let val = |regs: &HashMap<Reg, u32>, o: &Operand| match *o {
                Operand::Reg(r) => regs[&r],
                Operand::Int(v) => v as u32,
                Operand::F32(x) => x.to_bits(),
            };
            let (d, v) = match i {
                Inst::Un {
                    op: UnOpcode::Mov(_),
                    d,
                    a,
                } => (*d, val(regs, a)),
                Inst::Bin { op, ty, d, a, b } => {
                    let (x, y) = (val(regs, a), val(regs, b));
                    let v = match (op, ty) {
                        (B::And, _) => x & y,
                        (B::Or, _) => x | y,
                        (B::Xor, _) => x ^ y,
                        (B::Shl, _) => x << y,
                        (B::Shr, T::U32) => x >> y,
                        (B::Add, T::U32) => x.wrapping_add(y),
                        (B::MulLo, T::U32) => x.wrapping_mul(y),
                        (B::MulHi, T::U32) => ((u64::from(x) * u64::from(y)) >> 32) as u32,
                        (B::Sub, T::F32) => (f32::from_bits(x) - f32::from_bits(y)).to_bits(),
                        (B::MulRn, T::Bf16x2) => {
                            let h = |v: u32, i: u32| (v >> (16 * i)) as u16;
                            let m = |i: u32| u32::from(mul_bf16(h(x, i), h(y, i)));
                            m(0) | m(1) << 16
                        }
                        (B::AddRn, T::Bf16x2) => {
                            use crate::gemm::reference::{bf16_from_f32, bf16_to_f32};
                            let h = |v: u32, i: u32| bf16_to_f32((v >> (16 * i)) as u16);
                            // (Two bf16 of the codes' range: their f32 sum is exact.)
                            let a = |i: u32| u32::from(bf16_from_f32(h(x, i) + h(y, i)));
                            a(0) | a(1) << 16
                        }
                        other => panic!("not interpreted: {other:?}"),
                    };
                    (*d, v)
                }
                Inst::Prmt { d, a, b, sel } => (*d, prmt(regs[a], regs[b], *sel as u32)),
                Inst::LdSharedU32 { d, addr, off } => {
                    (*d, shared[&regs[addr].wrapping_add(*off as u32)])
                }
                Inst::LdSharedNarrow {
                    d,
                    addr,
                    off,
                    bytes,
                } => {
                    let a = regs[addr].wrapping_add(*off as u32);
                    let mask = if *bytes == 1 { 0xFF } else { 0xFFFF };
                    (*d, shared[&(a & !3)] >> (8 * (a & 3)) & mask)
                }
                Inst::PrmtR { d, a, b, sel } => (*d, prmt(regs[a], regs[b], regs[sel])),
                Inst::HalfBroadcast { d, a, high } => {
                    let h = if *high {
                        regs[a] >> 16
                    } else {
                        regs[a] & 0xFFFF
                    };
                    (*d, h | h << 16)
                }
                Inst::Lop3 { d, a, b, c, lut } => {
                    let (x, y, z) = (regs[a], val(regs, b), val(regs, c));
                    let v = (0..32).fold(0u32, |v, bit| {
                        let idx = (x >> bit & 1) << 2 | (y >> bit & 1) << 1 | (z >> bit & 1);
                        v | u32::from(lut >> idx & 1) << bit
                    });
                    (*d, v)
                }
                other => panic!("not interpreted: {other:?}"),
            };
            regs.insert(d, v);
        }
    }

    /// A fresh kernel builder with `q` in a register.
    fn builder_with(q: u32) -> (K, Reg, HashMap<Reg, u32>) {
        let mut k = K {
            b: crate::ptx::Builder::default(),
        };
        let r = k.b.reg(RegClass::B32);
        (k, r, HashMap::from([(r, q)]))
    }

    /// Every pair of E2M1 codes placed at its pair's bits of a word (the other pairs' bits
    /// random) converts, by the instructions `e2m1_pair` emits, to the two halves `e2m1_bits`
    /// gives, whatever the rest of the word holds.
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
                    let (mut k, r, mut regs) = builder_with(q);
                    let y = e2m1_pair(&mut k, r, p);
                    interpret(&k.b.insts, &mut regs);
                    let y = regs[&y];
                    assert_eq!(y & 0xFFFF, u32::from(e2m1_bits(lo)), "{p} {lo} {hi}");
                    assert_eq!(y >> 16, u32::from(e2m1_bits(hi)), "{p} {lo} {hi}");
                }
            }
        }
    }

    /// The group scale factor `w4_scales` forms from scale byte `x` of group `q` of fragment row
    /// `r` (its low half; row `r + 8`'s byte, `x ^ 0x81`, must come out in the high half as the
    /// same function of it), for every group of a k-tile (`group` 16: four a row's word; 32: two,
    /// loaded as 16 bits), run by [`interpret_with`] on a stage whose other bytes are noise.
    fn scale_bits(scale: GroupScale, x: u8) -> u16 {
        let mut lows = Vec::new();
        for group in [16u32, 32] {
            let w = W4 {
                codes: W4Codes::E2m1,
                scale,
                group,
            };
            let es = w.scale_tile_bytes();
            let one = |k: &mut K, q: u32, x: u8| {
                let y = x ^ 0x81;
                let (w0, w1) = (
                    0x5A5A_5A5A & !(0xFF << (8 * q)) | u32::from(x) << (8 * q),
                    0xA5A5_A5A5 & !(0xFF << (8 * q)) | u32::from(y) << (8 * q),
                );
                // The thread's row at byte 4 (row 2 with 16-bit words, row 1 with 32-bit), so
                // that row r + 8 sits at 4 + 8 es; noise around both.
                let (at0, at1) = (4u32, 4 + 8 * es);
                let [scales, scale_row, row] = [0, at0, 0].map(|v| k.imm(i64::from(v)));
                let fr = super::W4Frag {
                    w,
                    row,
                    scale_row,
                    quad: None,
                };
                let words = super::w4_scale_words(k, &fr, scales);
                let d = super::w4_scales(k, &fr, words, q);
                // A 16-bit word sits in the low half of its 4-aligned 32-bit word: noise in the
                // high half, which the load must not see.
                let noise = if es == 4 { 0 } else { 0xC3C3_0000 };
                let keep = if es == 4 { u32::MAX } else { 0xFFFF };
                let (p0, p1) = ((at0, w0 & keep | noise), (at1, w1 & keep | noise));
                let mut shared = HashMap::from([p0, p1]);
                shared.insert(0, 0x1234_5678);
                (d, shared)
            };
            for q in 0..w.groups_per_ktile() {
                let (mut k, _, mut regs) = builder_with(0);
                let (d, shared) = one(&mut k, q, x);
                interpret_with(&k.b.insts, &mut regs, &shared);
                let (lo, hi) = (regs[&d] as u16, (regs[&d] >> 16) as u16);
                // Row r + 8's byte through the same conversion (its own run, as the low half).
                let (mut k2, _, mut regs2) = builder_with(0);
                let (d2, shared2) = one(&mut k2, q, x ^ 0x81);
                interpret_with(&k2.b.insts, &mut regs2, &shared2);
                assert_eq!(
                    hi, regs2[&d2] as u16,
                    "{scale:?} {x:#x} group {q} of {group}"
                );
                lows.push(lo);
            }
        }
        assert!(lows.iter().all(|&l| l == lows[0]), "{scale:?} {x:#x}");
        lows[0]
    }

    /// Runs `insts` on the 32 lanes of a warp in lockstep ([`interpret_with`] per lane), with
    /// `shfl.sync.idx` reading the source lane's register.
    fn interpret_warp(insts: &[Inst], lanes: &mut [HashMap<Reg, u32>], shared: &HashMap<u32, u32>) {
        for i in insts {
            match i {
                Inst::ShflIdx { d, a, lane } => {
                    let got: Vec<u32> = (0..lanes.len())
                        .map(|l| {
                            let src = match *lane {
                                Operand::Reg(r) => lanes[l][&r],
                                Operand::Int(v) => v as u32,
                                Operand::F32(_) => panic!("a float lane"),
                            };
                            lanes[(src & 31) as usize][a]
                        })
                        .collect();
                    for (regs, v) in lanes.iter_mut().zip(got) {
                        regs.insert(*d, v);
                    }
                }
                other => {
                    for regs in lanes.iter_mut() {
                        interpret_with(std::slice::from_ref(other), regs, shared);
                    }
                }
            }
        }
    }

    /// NVFP4's quad-shared scales (each lane of a quad converts one group, then four shuffles)
    /// equal, on every lane and for every group, the per-group conversion of [`super::w4_scales`],
    /// for E4M3 and E8M0 bytes (a quad's two rows' words random, different per quad).
    #[test]
    fn quad_shared_scales_equal_the_per_group_conversion() {
        for scale in [GroupScale::E4m3, GroupScale::E8m0] {
            let w = W4 {
                codes: W4Codes::E2m1,
                scale,
                group: 16,
            };
            let mut k = K {
                b: crate::ptx::Builder::default(),
            };
            let [lane, warp, cwg, w0, w1] = [0; 5].map(|_| k.b.reg(RegClass::B32));
            let fr = super::w4_frag(&mut k, w, warp, lane, (cwg, 64));
            let quad = fr.quad.expect("four one-byte groups a k-tile");
            let shared = super::w4_quad_scales(&mut k, &fr, [[w0; 2], [w1; 2]], quad);
            let direct = [0, 1, 2, 3].map(|g| super::w4_scales(&mut k, &fr, [[w0; 2], [w1; 2]], g));
            let mut seed = 0x9E37_79B9u32 ^ scale.bytes();
            let mut next = || {
                seed ^= seed << 13;
                seed ^= seed >> 17;
                seed ^= seed << 5;
                // E4M3 NaN (0x7F/0xFF) and E8M0 bytes past 128 are outside the kernel's range.
                seed & 0x7E7E_7E7E
            };
            let mut lanes: Vec<HashMap<Reg, u32>> = Vec::new();
            let mut words = [0u32; 2];
            for l in 0..32u32 {
                if l % 4 == 0 {
                    words = [next(), next()];
                }
                lanes.push(HashMap::from([
                    (lane, l),
                    (warp, 0),
                    (cwg, 0),
                    (w0, words[0]),
                    (w1, words[1]),
                ]));
            }
            interpret_warp(&k.b.insts, &mut lanes, &HashMap::new());
            for (l, regs) in lanes.iter().enumerate() {
                for g in 0..4 {
                    assert_eq!(
                        regs[&shared[g]], regs[&direct[g]],
                        "{scale:?} lane {l} group {g}"
                    );
                }
            }
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
                        w4_weight(w, code, u32::from(x)),
                        "{scale:?} {x:#x} {code}"
                    );
                }
            }
        }
    }

    /// bf16 group scales of every group length (16: two words a row's k-tile; 32: two halves of a
    /// word; 64, 128: one half): each group's scales of rows `r` and `r + 8` land in the two halves,
    /// read from the row-major scale tiles with noise around them.
    #[test]
    fn bf16_scales_of_every_group_length_are_gathered() {
        for group in [16u32, 32, 64, 128] {
            let w = W4 {
                codes: W4Codes::U4,
                scale: GroupScale::Bf16,
                group,
            };
            let es = w.scale_tile_bytes();
            let per = w.groups_per_ktile();
            // The thread's row 3 (and row 11), in a stage whose other bytes are noise.
            let at0 = 3 * es;
            let mut shared: HashMap<u32, u32> =
                (0..64u32).map(|i| (4 * i, 0xDEAD_0000 | i)).collect();
            let mut put = |at: u32, v: u16| {
                let word = shared.entry(at & !3).or_insert(0);
                let sh = 8 * (at & 3);
                *word = *word & !(0xFFFF << sh) | u32::from(v) << sh;
            };
            for g in 0..per {
                put(at0 + 2 * g, 0x1000 + g as u16);
                put(at0 + 8 * es + 2 * g, 0x2000 + g as u16);
            }
            let (mut k, _, mut regs) = builder_with(0);
            let [scales, scale_row, row] = [0, at0, 0].map(|v| k.imm(i64::from(v)));
            let fr = super::W4Frag {
                w,
                row,
                scale_row,
                quad: None,
            };
            let words = super::w4_scale_words(&mut k, &fr, scales);
            let d: Vec<Reg> = (0..per)
                .map(|g| super::w4_scales(&mut k, &fr, words, g))
                .collect();
            interpret_with(&k.b.insts, &mut regs, &shared);
            for (g, r) in d.iter().enumerate() {
                let want = (0x1000 + g as u32) | (0x2000 + g as u32) << 16;
                assert_eq!(regs[r], want, "group {g} of {group}");
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
                assert_eq!(f64::from(got), w4_weight(w, q, u32::from(s)), "{s:#x} {q}");
            }
        }
    }

    /// The whole U4 k-tile conversion `w4_a_regs` emits, run for every lane of a consumer
    /// warpgroup on a 64-row k-tile in the kernel's order (random codes; random bf16 scales, and
    /// for [`GroupScale::Bf16Zero`] random zero points, per group of 32, 64 or 128): every A
    /// register half is its fragment element's `reference::w4_weight`, so `(q - z) * s` (or
    /// `(q - 8) * s`) rounded once.
    #[test]
    fn every_u4_fragment_element_is_its_reference_weight() {
        use crate::gemm::reference::{bf16_from_f32, w4_kernel_code, w4_kernel_order, w4_weight};
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for (scale, group) in [
            (GroupScale::Bf16, 128),
            (GroupScale::Bf16Zero, 128),
            (GroupScale::Bf16Zero, 64),
            (GroupScale::Bf16Zero, 32),
        ] {
            let w = W4 {
                codes: W4Codes::U4,
                scale,
                group,
            };
            let (rows, kk) = (64usize, 64usize);
            let row_major: Vec<u8> = (0..rows * kk / 2).map(|_| next() as u8).collect();
            let codes = w4_kernel_order(w.codes, &row_major, rows, kk);
            let elems: Vec<u32> = (0..rows * w.groups(kk))
                .map(|_| {
                    let v = 2f32.powf(-9.0 + 8.0 * (next() % 1024) as f32 / 1024.0);
                    let s = u32::from(bf16_from_f32(v));
                    match scale {
                        GroupScale::Bf16Zero => {
                            s | u32::from(GroupScale::zero_point_bits((next() % 16) as u8)) << 16
                        }
                        _ => s,
                    }
                })
                .collect();
            let mut bytes = vec![0u8; w.group_scale_bytes(1, rows, kk)];
            for j in 0..rows {
                for q in 0..w.groups(kk) {
                    let at = w.group_scale_at(rows, kk, 0, j, q);
                    let b = elems[j * w.groups(kk) + q].to_le_bytes();
                    let n = scale.bytes() as usize;
                    bytes[at..at + n].copy_from_slice(&b[..n]);
                }
            }
            // Shared memory: the codes at 0x1000, the scales at 0x4000, as 32-bit words.
            let mut shared = HashMap::new();
            for (base, buf) in [(0x1000u32, &codes), (0x4000, &bytes)] {
                for (i, c) in buf.chunks(4).enumerate() {
                    let mut word = [0u8; 4];
                    word[..c.len()].copy_from_slice(c);
                    shared.insert(base + 4 * i as u32, u32::from_le_bytes(word));
                }
            }
            for warp in 0..4u32 {
                for lane in 0..32u32 {
                    let mut k = K {
                        b: crate::ptx::Builder::default(),
                    };
                    let [wr, lr, cr, ar, sr] = [0; 5].map(|_| k.b.reg(RegClass::B32));
                    let fr = super::w4_frag(&mut k, w, wr, lr, (cr, 64));
                    let a = super::w4_a_regs(&mut k, &fr, ar, sr);
                    let mut regs = HashMap::from([
                        (wr, warp),
                        (lr, lane),
                        (cr, 0),
                        (ar, 0x1000),
                        (sr, 0x4000),
                    ]);
                    interpret_with(&k.b.insts, &mut regs, &shared);
                    let (g, c) = ((16 * warp + lane / 4) as usize, (lane % 4) as usize);
                    for (step, four) in a.iter().enumerate() {
                        for (j, reg) in four.iter().enumerate() {
                            let row = g + 8 * (j & 1);
                            for half in 0..2 {
                                let x = 16 * step + 2 * c + 8 * (j >> 1) + half;
                                let code = w4_kernel_code(w.codes, &codes, row, x, kk);
                                let e = elems[row * w.groups(kk) + x / group as usize];
                                let got = regs[reg] >> (16 * half) & 0xFFFF;
                                let got =
                                    f64::from(crate::gemm::reference::bf16_to_f32(got as u16));
                                assert_eq!(
                                    got,
                                    w4_weight(w, code, e),
                                    "{scale:?} g{group} warp {warp} lane {lane} row {row} k {x}"
                                );
                            }
                        }
                    }
                }
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
