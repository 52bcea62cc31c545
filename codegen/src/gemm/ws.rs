//! v1 of the generated grouped GEMM (issue \[7\] item 3): warp-specialized, persistent, for bf16 and
//! e4m3 operands, prefill and decode (swap-AB) forms, with f32 or bf16 output and the FP8 scales
//! applied to the f32 accumulator. `Y[rows of e] = X[rows of e] · W[e]^T`, `X [T, K]` with rows sorted
//! by expert (per-expert row offsets in device memory), `W [E, N, K]` (a recipe param in its
//! verified storage layout, K-major), `Y [T, N]` row-major.
//!
//! # Composition (CuTe's vocabulary)
//! * **Copy atom**: TMA `cp.async.bulk.tensor` of K-major boxes, 128-byte swizzle, completing on the
//!   stage's "full" mbarrier (one `arrive.expect_tx` of the stage's bytes).
//! * **MMA atom**: `wgmma.mma_async` m64nNk16 (bf16, HGMMA) or m64nNk32 (e4m3, QGMMA), both operands
//!   from shared memory through descriptors; one k-tile is 128 bytes of K (64 bf16 or 128 e4m3), four
//!   MMAs, the descriptors' low word advancing by 2 (32 bytes) per MMA.
//! * **Pipeline**: `S` stages; per stage a "full" barrier (count 1: the producer's expect_tx) and an
//!   "empty" barrier (count `4 * C`: one arrival per consumer warp once its MMAs that read the stage
//!   have completed). The producer waits on "empty" with the opposite parity (a fresh barrier's
//!   previous phase counts as complete), so the first `S` loads go out at once.
//! * **Warp specialization**: warpgroup 0 is the producer (one thread issues every TMA), warpgroups
//!   `1..=C` are consumers that share each tile; with two consumers the producer gives registers
//!   back (`setmaxnreg.dec` to 40) and the consumers take them (`setmaxnreg.inc` to 232)
//!   (cooperative): consumer `c` owns the A rows `64c .. 64c + 63` of the tile. With register-
//!   sourced A (int8 and 4-bit weights) and one consumer, or two with a decode token tile of at
//!   most 32, the producer is instead one warp after the consumer warpgroups (160 or 288 threads a
//!   CTA, so more CTAs fit an SM), and no registers move.
//!   Their prefill form has two consumers (a producer warpgroup, cooperative as above) that share
//!   each token tile, one dequantizing while the other's MMAs run.
//! * **Tile scheduler**: persistent CTAs; CTA `b` takes tiles `b, b + G, b + 2G, ...` (`G` =
//!   `%nctaid.x`) of the raster order (experts in order; inside an expert, groups of
//!   [`WsConfig::raster_group`] weight tiles with the token tile major inside a group, for L2
//!   reuse), and maps a tile to its expert by scanning the device-resident offsets, a whole warp
//!   at a time over 32 experts (one coalesced load, a warp scan of their tile counts and a ballot),
//!   resuming where its previous tile's scan stopped (tile ids only grow). Producer and consumers
//!   scan alike (the producer keeps one warp for it); [`TileScan`] is the same scan on the host.
//!   With [`WsConfig::skip_idle`] (prefill forms, see [`skips_idle_rows`]; not yet a default
//!   candidate), a consumer whose 64 token rows all lie past the
//!   expert's end (the last token tile of an expert that fills at most its first half: about half
//!   the experts' last tiles at 512 rows an expert) issues no MMAs and no stores: it waits for
//!   each stage and frees it, so the other consumer's MMAs have the tensor cores alone. The
//!   branch goes through `vote.sync.any`, which ptxas sees warp-uniform (a plain branch on the
//!   tile's rows moved the k loop off the uniform datapath: 17-40% slower on the H100, run 95).
//! * **Epilogue**: the accumulator fragment (GEMM.md §1.6) -> scale -> convert -> masked global
//!   stores (rows past the expert's end and columns past N are not stored). With
//!   [`Epilogue::SiluMul`] (the MoE layer's first GEMM, fused) it stores `a [T, N / 2]`, `silu(gate)
//!   times up`, instead: the weight rows are in the paired order of [`glu_row`] (8 gate rows, then the
//!   8 up rows of the same outputs), so each thread's fragment holds both halves of its outputs
//!   and no data crosses threads. `silu` is the activation kernel's sequence, so the fused and the
//!   unfused paths give the same bits. With [`Epilogue::SiluMulE4m3`] `a` is also quantized to
//!   E4M3 for an FP8 second GEMM ([`super::finish`]), with the activation kernel's instructions:
//!   static scales by the epilogue itself, dynamic ones by the CTA that completes a token tile's
//!   count of weight tiles.
//!
//! # Prefill and decode
//! * Prefill (`swap_ab = false`): A = `X` (`64 C` token rows), B = `W[e]` (`BN` weight rows); the
//!   wgmma N is `BN`.
//! * Decode (`swap_ab = true`): A = `W[e]` (`64 C` weight rows), B = `X` (`BN` token rows, 8 to 256);
//!   the accumulator is `Y^T`'s tile and the epilogue stores it transposed. Few tokens per expert then
//!   cost few MMA columns and little of the TMA traffic, and the weights stream on the M side.
//!
//! # Scaling (FP8)
//! * [`Scaling::Tensorwise`]: `acc * s_w[e] * s_x[t]` with `s_x` per token (`[T]`) or one value for
//!   all tokens (`[1]`), applied once in the epilogue (SPEC §9 `fp8_per_tensor`).
//! * [`Scaling::Channelwise`]: `acc * (s_x[t] * s_w[e, row])`, `s_w` `[E, N]` in the GEMM's row
//!   order, once in the epilogue (a row scale per row class of the fragment: the two A-side
//!   halves in decode, the `BN / 4` B-side columns in prefill).
//! * [`Scaling::Groupwise`]: each group of `g` along K (whole k-tiles) accumulates on its own and
//!   is promoted with its rows' scales `s_w[e, g, row]` from the stage (as
//!   [`Scaling::PerRowGroup`]), weights on A only; `s_x[t]` in the epilogue.
//! * [`Scaling::Block128`] (SPEC §9 `fp8_block128`): each 128-deep K slice (one e4m3 k-tile) is
//!   accumulated on its own (`scale-d` 0 on its first MMA) and promoted into the f32 total with
//!   `s_x[kb, t] * s_w[e, n / 128, kb]` (`fma`, slices in ascending order). `s_x` is group-major
//!   `[ceil(K/128), T]` (the activation quantizer's layout), `s_w` `[E, ceil(N/128), ceil(K/128)]`.
//!   The producer loads a k-tile's scales into its stage by TMA too, completing on the same full
//!   barrier as A and B (1-D maps over each scale buffer: [`BLOCK_SCALE_W_BOX`] weight scales and
//!   the tile's token rows of activation scales plus [`BLOCK_SCALE_PAD`]), so every write into a
//!   stage is the async proxy's and ordered by the barrier (compute-sanitizer racecheck tracks it;
//!   the earlier per-lane `cp.async` copies were reported as hazards). A TMA box must start on 16
//!   bytes (on an H200 an unaligned first coordinate of a 1-D map is an illegal instruction), so
//!   each box starts at its first element rounded down to a multiple of 4 and the consumers add the
//!   remainder (`& 3`), which they compute from the same tile and k-tile. The total is cleared at
//!   a tile's start, so every promotion is one `fma` a slot (the first one `p * s + 0`, the same
//!   bits as a multiply). Prefill tiles hold 128 weight rows (one scale block), or 192: such a
//!   tile starts on a multiple of 64 rows and spans two blocks, so the producer loads a second
//!   weight-scale box (the next block's, `KT` elements on) and each 64-column chunk of the
//!   fragment takes its block's scale (the middle chunk's by whether the tile starts on a block).
//!
//! # Parameters, in order
//! `tmap_x`, `tmap_w` (`.param .align 64 .b8 [128]`), `y` (u64), `offsets` (u64: i32 `[E + 1]`),
//! `x_scale` (u64; 0 when unscaled), `w_scale` (u64; 0 when unscaled), `experts` (u32), `tokens`
//! (u32: `T`, the stride of the group-major activation scales), `workspace`, `counters` (u64:
//! split-K), `tmap_xs`, `tmap_ws` (1-D f32 maps of `x_scale` and `w_scale` for the block-scaled
//! variants; for 4-bit weights `tmap_ws` is the 3-D map of the group scales `[E, scale tiles, N]` (each
//! element one row's scales of one k-tile, `W4::group_scale_at`); the
//! others read neither and take any valid map there). With [`Epilogue::SiluMulE4m3`], four more
//! after them ([`super::finish::FINISH_PARAMS`]): the E4M3 codes and scales of `a`, the token
//! tiles' arrival counters and the static scales per expert.

use crate::ptx::{
    AsyncOp, BinOpcode, Builder, CmpOp, DynamicShared, Entry, Guard, Inst, MaxNReg, Operand, Param,
    PtxTy, Reg, RegClass, RegDelta, ScaleD, SharedDecl, SharedTy, SpecialReg, TmaDim, TmaLoad,
    UnOpcode, Wgmma, WgmmaN, WgmmaTy,
};
use crate::{Error, Result};

use super::emit::{Emit as _, K};
pub use super::finish::AQuant;
pub use super::wmap::WRows;

/// The operand types of X and W.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operands {
    /// bf16 x bf16 (HGMMA, k16).
    Bf16,
    /// e4m3 x e4m3 (QGMMA, k32).
    E4m3,
    /// bf16 activations x int8 weights (W8A16, weights-on-A form only): the weights are wgmma's A
    /// operand from registers, each code converted to bf16 (exact: |code| <= 128) as the consumer
    /// loads it from the stage (`gemm::dequant`); HGMMA k16. Their scale ([`Scaling::PerRow`]) is
    /// applied to the f32 accumulator.
    I8Bf16,
    /// bf16 activations x 4-bit weights with a scale per group of K (W4A16, weights-on-A form
    /// only): as [`Operands::I8Bf16`], each code times its group scale converted to bf16 as the
    /// consumer loads it (`gemm::dequant`); the stage also holds the tile's group scales (by TMA).
    /// A per-expert factor ([`Scaling::PerExpert`]) is applied to the f32 accumulator.
    W4Bf16(W4),
}

/// What K the W8A16 GEMM ([`Operands::I8Bf16`]) takes a multiple of: the GPU check covers K a
/// multiple of 16 (the code rows are padded to 64 bytes; X's rows of 2K bytes need K % 8 for TMA).
pub const I8_K_ALIGN: u32 = 16;

/// The codes of 4-bit weights, two per byte, in the kernel's order within each 64-deep k-tile of a
/// row ([`crate::gemm::reference::w4_kernel_bits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum W4Codes {
    /// E2M1 (NVFP4, MXFP4): sign, two exponent bits, one mantissa bit.
    E2m1,
    /// Unsigned `q` standing for `q - 8` (symmetric group-wise INT4).
    U4,
}

/// The element type of a 4-bit weight's group scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupScale {
    /// E4M3 bytes (NVFP4), times `2^118` in the kernel; the accumulator is `2^-8` of the true
    /// sum, which the per-expert factor restores (the host folds `2^8` into it).
    E4m3,
    /// E8M0 exponent bytes `b`: the group scale is `2^(b - 127)`, and the kernel forms
    /// `2^(b - 1)` (bf16 exponent `b + 126`), which needs `b <= 128`: the host lowers an expert's
    /// bytes by `c` (its largest past 128) and folds `2^c` into the per-expert factor.
    E8m0,
    /// bf16 scales (symmetric group-wise INT4): `(q - 8) * s` rounded once to bf16.
    Bf16,
    /// bf16 scales with u4 zero points (asymmetric group-wise INT4): each element 4 bytes, the
    /// scale `s` in bits 15..0 and bf16 `-(128 + z)` in bits 31..16 (exact: 128..143 are bf16
    /// integers), so that the kernel's `(128 + q) + hi` is `q - z` exactly; `(q - z) * s` rounded
    /// once to bf16 ([`GroupScale::zero_point_bits`]).
    Bf16Zero,
}

impl GroupScale {
    /// Bytes per scale.
    pub const fn bytes(self) -> u32 {
        match self {
            GroupScale::E4m3 | GroupScale::E8m0 => 1,
            GroupScale::Bf16 => 2,
            GroupScale::Bf16Zero => 4,
        }
    }

    /// The high half of a [`GroupScale::Bf16Zero`] element for zero point `z` (`0..=15`): the bf16
    /// bits of `-(128 + z)`.
    pub const fn zero_point_bits(z: u8) -> u16 {
        // -(128 + z) = -(1 + z / 128) * 2^7: the sign, exponent 127 + 7, a 7-bit mantissa z.
        0xC300 | (z & 0xF) as u16
    }

    /// The zero point of a [`GroupScale::Bf16Zero`] element's high half (the inverse of
    /// [`GroupScale::zero_point_bits`]), `None` for bits it never writes.
    pub const fn zero_point_of(bits: u16) -> Option<u8> {
        if bits & 0xFFF0 == 0xC300 {
            Some((bits & 0xF) as u8)
        } else {
            None
        }
    }
}

/// A 4-bit weight format: codes, group scales and the group's length along K.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct W4 {
    /// The codes.
    pub codes: W4Codes,
    /// The scales' type.
    pub scale: GroupScale,
    /// Elements of K per scale: a power of two, at least 16.
    pub group: u32,
}

impl W4 {
    /// NVFP4 (`nvfp4_cutedsl`): E2M1 codes, an E4M3 scale per 16.
    pub const NVFP4: W4 = W4 {
        codes: W4Codes::E2m1,
        scale: GroupScale::E4m3,
        group: 16,
    };
    /// MXFP4: E2M1 codes, an E8M0 scale per 32.
    pub const MXFP4: W4 = W4 {
        codes: W4Codes::E2m1,
        scale: GroupScale::E8m0,
        group: 32,
    };
    /// Symmetric group-wise INT4 (`int4_g128`): u4 codes, a bf16 scale per 128.
    pub const INT4_G128: W4 = W4 {
        codes: W4Codes::U4,
        scale: GroupScale::Bf16,
        group: 128,
    };

    /// Asymmetric group-wise INT4 (`int4_g128_zp`): u4 codes, a bf16 scale and a u4 zero point
    /// per 128.
    pub const INT4_G128_ZP: W4 = W4 {
        codes: W4Codes::U4,
        scale: GroupScale::Bf16Zero,
        group: 128,
    };

    /// Whether an `N x K` weight fits the kernel: K a multiple of 64 (the codes' kernel order is
    /// per 64-deep k-tile, and a code row's pitch, K / 2 bytes, is a multiple of 16 for TMA) and a
    /// scale row (N scales) a multiple of 16 bytes.
    pub const fn fits(self, n: u64, k: u64) -> bool {
        k.is_multiple_of(64) && (n * self.scale.bytes() as u64).is_multiple_of(16)
    }

    /// Scale groups along `K = k`: `ceil(k / group)` (a group of 0 counts as 1).
    pub const fn groups(self, k: usize) -> usize {
        let g = if self.group == 0 {
            1
        } else {
            self.group as usize
        };
        k.div_ceil(g)
    }

    /// Scale tiles along `K = k`: the groups taken [`W4::groups_per_ktile`] at a time (one per
    /// 64-deep k-tile, or per group where a group is longer).
    pub const fn scale_tiles(self, k: usize) -> usize {
        self.groups(k).div_ceil(self.groups_per_ktile() as usize)
    }

    /// Bytes of one weight row's scales in one scale tile: [`W4::groups_per_ktile`] scales.
    pub const fn scale_tile_bytes(self) -> u32 {
        self.groups_per_ktile() * self.scale.bytes()
    }

    /// Bytes of the group scales of `experts` weights of `N x K`: `[experts, scale tiles, N,
    /// groups per k-tile]` ([`W4::group_scale_at`]).
    pub const fn group_scale_bytes(self, experts: usize, n: usize, k: usize) -> usize {
        experts * self.scale_tiles(k) * n * self.scale_tile_bytes() as usize
    }

    /// Byte offset of the scale of group `q` of row `j` of expert slot `e` (weights of `N x K`):
    /// the kernel's order, `[E, scale tiles, N, groups per k-tile]`, so that one k-tile's scales of
    /// a row are one aligned load and a tile's rows one TMA box.
    pub const fn group_scale_at(self, n: usize, k: usize, e: usize, j: usize, q: usize) -> usize {
        let per = self.groups_per_ktile() as usize;
        ((e * self.scale_tiles(k) + q / per) * n + j) * self.scale_tile_bytes() as usize
            + (q % per) * self.scale.bytes() as usize
    }

    /// The scale element at byte offset `at` of group scales `bytes` ([`W4::group_scale_at`]):
    /// [`GroupScale::bytes`] bytes, little-endian (what [`crate::gemm::reference::w4_weight`]
    /// takes); `None` past the end.
    pub fn group_scale_element(self, bytes: &[u8], at: usize) -> Option<u32> {
        let b = bytes.get(at..at.checked_add(self.scale.bytes() as usize)?)?;
        Some(b.iter().rev().fold(0u32, |v, &x| v << 8 | u32::from(x)))
    }

    /// Scale groups one 64-deep k-tile spans (1 when a group is longer than the k-tile).
    pub const fn groups_per_ktile(self) -> u32 {
        // (A group of 0 is refused by the configuration check; 1 here, no division by zero.)
        match 64u32.checked_div(self.group) {
            Some(q) if q > 0 => q,
            _ => 1,
        }
    }
}

impl Operands {
    /// Bytes per element of X (the activations).
    pub const fn bytes(self) -> u32 {
        match self {
            Operands::Bf16 | Operands::I8Bf16 | Operands::W4Bf16(_) => 2,
            Operands::E4m3 => 1,
        }
    }

    /// Bits per element of W (the weights).
    pub const fn w_bits(self) -> u32 {
        match self {
            Operands::Bf16 => 16,
            Operands::E4m3 | Operands::I8Bf16 => 8,
            Operands::W4Bf16(_) => 4,
        }
    }

    /// Bytes of one weight row of `k` elements in the W operand ([`WsConfig::w_row_bytes`]): int8
    /// rows padded to a multiple of 64 bytes.
    pub const fn w_row_bytes(self, k: u64) -> u64 {
        match self {
            Operands::I8Bf16 => k.next_multiple_of(super::reference::I8_ROW_ALIGN as u64),
            o => k * o.w_bits() as u64 / 8,
        }
    }

    /// Whether W is wgmma's register-sourced A operand (weights converted by the consumers).
    pub const fn register_a(self) -> bool {
        matches!(self, Operands::I8Bf16 | Operands::W4Bf16(_))
    }

    /// K elements per k-tile (128 bytes of X).
    pub const fn bk(self) -> u32 {
        128 / self.bytes()
    }

    fn wgmma(self) -> WgmmaTy {
        match self {
            Operands::Bf16 | Operands::I8Bf16 | Operands::W4Bf16(_) => WgmmaTy::Bf16,
            Operands::E4m3 => WgmmaTy::E4m3,
        }
    }

    /// The operands named `s` ([`Operands::name`]'s inverse; a 4-bit name with a group that is
    /// not a power of two of at least 16 is none).
    pub fn from_name(s: &str) -> Option<Operands> {
        match s {
            "bf16" => return Some(Operands::Bf16),
            "e4m3" => return Some(Operands::E4m3),
            "i8w" => return Some(Operands::I8Bf16),
            _ => {}
        }
        let (head, group) = s.split_once('g')?;
        let group: u32 = group.parse().ok()?;
        let (codes, scale) = match head {
            "f4e" => (W4Codes::E2m1, GroupScale::E4m3),
            "f4m" => (W4Codes::E2m1, GroupScale::E8m0),
            "u4b" => (W4Codes::U4, GroupScale::Bf16),
            "u4z" => (W4Codes::U4, GroupScale::Bf16Zero),
            _ => return None,
        };
        (group >= 16 && group.is_power_of_two()).then_some(Operands::W4Bf16(W4 {
            codes,
            scale,
            group,
        }))
    }

    /// `bf16`, `e4m3`, `i8w` or a 4-bit format's `f4e` (E2M1 codes, E4M3 scales), `f4m` (E2M1,
    /// E8M0), `u4b` (INT4, bf16) or `u4z` (INT4, bf16 and zero points), then `g` and the group, e.g. `f4eg16` (the tags' and the
    /// tuning cache's name).
    pub fn name(self) -> String {
        match self {
            Operands::Bf16 => "bf16".into(),
            Operands::E4m3 => "e4m3".into(),
            Operands::I8Bf16 => "i8w".into(),
            Operands::W4Bf16(w) => {
                let c = match w.codes {
                    W4Codes::E2m1 => "f4",
                    W4Codes::U4 => "u4",
                };
                let s = match w.scale {
                    GroupScale::E4m3 => "e",
                    GroupScale::E8m0 => "m",
                    GroupScale::Bf16 => "b",
                    GroupScale::Bf16Zero => "z",
                };
                format!("{c}{s}g{}", w.group)
            }
        }
    }
}

/// How the f32 accumulator is scaled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scaling {
    /// Not at all (bf16).
    None,
    /// Once in the epilogue: per-expert weight scale `[E]` times the activation scale, per token
    /// (`[T]`, `per_token`) or one for all tokens (`[1]`).
    Tensorwise {
        /// The activation scale is per token (else one value).
        per_token: bool,
    },
    /// Per 128-deep K slice with 1x128 activation groups and 128x128 weight blocks.
    Block128,
    /// Once in the epilogue: per weight row (channel) `w_scale [E, N]` times the activation
    /// scale, per token (`[T]`) or one (`[1]`): FP8 per-channel weights. A slot is scaled by the
    /// factor `x_scale * w_scale[row]`, the product taken first as the per-tensor form takes
    /// `x_scale * w_scale[e]`, so channels that share one scale give the per-tensor kernel's bits.
    Channelwise {
        /// The activation scale is per token (else one value).
        per_token: bool,
    },
    /// Once in the epilogue, per weight row: `w_scale [E, N]` (weights-only recipes' per-row
    /// scales, e.g. `int8_per_row`); no activation scale.
    PerRow,
    /// Once in the epilogue, per expert: `w_scale [E]` (4-bit weights' factor: NVFP4's global
    /// scale, the powers of two the group scales' conversion left out); no activation scale.
    PerExpert,
    /// Per weight row and group of `group` along K (group-wise int8): each group's k-tiles
    /// accumulate on their own (`scale-d` 0 on the group's first MMA) and are promoted into the f32
    /// total with the row's scale of the group, `acc += part * s[row, g]`; the scales come by TMA
    /// into the stage as `[E, groups, N]` f32 ([`WsConfig::group_scale_bytes`]); no activation scale.
    PerRowGroup {
        /// Elements of K per scale: a power of two, at least 64 (whole k-tiles).
        group: u32,
    },
    /// Group-wise FP8: per weight row and group of `group` along K, promoted as
    /// [`Scaling::PerRowGroup`] promotes (the scales by TMA into the stage, `[E, groups, N]` f32),
    /// and the activation's scale per token (`[T]`) or one (`[1]`) in the epilogue.
    Groupwise {
        /// Elements of K per scale: a power of two, at least the 128 of an E4M3 k-tile.
        group: u32,
        /// The activation scale is per token (else one value).
        per_token: bool,
    },
}

impl Scaling {
    /// The group-wise int8 scaling of groups of `group` along K, where the GEMM serves it: a power
    /// of two, at least 64 (whole k-tiles). The one rule the configuration check, the GEMM plan
    /// and the layer follow.
    pub fn per_row_group(group: i64) -> Option<Scaling> {
        u32::try_from(group)
            .ok()
            .filter(|g| *g >= 64 && g.is_power_of_two())
            .map(|group| Scaling::PerRowGroup { group })
    }

    /// Whether the kernel reads activation scales (`x_scale`): the FP8 families.
    pub const fn takes_x_scale(self) -> bool {
        matches!(
            self,
            Scaling::Tensorwise { .. }
                | Scaling::Block128
                | Scaling::Channelwise { .. }
                | Scaling::Groupwise { .. }
        )
    }

    /// The group along K of a per-row-group scaling (group-wise int8's or FP8's), promoted per
    /// group from the stage's scales.
    pub const fn row_group(self) -> Option<u32> {
        match self {
            Scaling::PerRowGroup { group } | Scaling::Groupwise { group, .. } => Some(group),
            _ => None,
        }
    }
}

/// The output element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutTy {
    /// f32.
    F32,
    /// bf16 (round to nearest even).
    Bf16,
}

impl OutTy {
    /// Bytes per element.
    pub const fn bytes(self) -> u32 {
        match self {
            OutTy::F32 => 4,
            OutTy::Bf16 => 2,
        }
    }

    /// `f32` or `bf16` (the tags' and the tuning cache's name).
    pub const fn name(self) -> &'static str {
        match self {
            OutTy::F32 => "f32",
            OutTy::Bf16 => "bf16",
        }
    }
}

/// What the epilogue stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Epilogue {
    /// `y [T, N]`: the scaled accumulator.
    Store,
    /// `a [T, N / 2]`: `silu(gate) * up` of the scaled accumulator's row pairs (the MoE layer's
    /// first GEMM, fused). The weight rows are in the *paired order*: within each 16 rows, 8 gate
    /// rows then the 8 up rows of the same outputs ([`glu_row`]), so that every fragment thread
    /// holds both halves of its outputs (decode: the A-side halves `h = 0, 1`; prefill: the B-side
    /// column blocks `j` even and odd). N a multiple of 16.
    SiluMul,
    /// [`Epilogue::SiluMul`] with `a` quantized to E4M3 codes and scales for an FP8 second GEMM
    /// ([`super::finish`]; the output type is f32): static scales in the epilogue itself, each
    /// output's code; per token or per 1x128 group by the CTA that completes a token tile's count
    /// of weight tiles, over the tile's rows of the f32 `a`.
    SiluMulE4m3(AQuant),
}

impl Epilogue {
    /// `store`, `silu_mul` or `silu_mul_e4m3_{token,g128,static}` (the tuning cache's name).
    pub const fn name(self) -> &'static str {
        match self {
            Epilogue::Store => "store",
            Epilogue::SiluMul => "silu_mul",
            Epilogue::SiluMulE4m3(AQuant::PerToken) => "silu_mul_e4m3_token",
            Epilogue::SiluMulE4m3(AQuant::Group128) => "silu_mul_e4m3_g128",
            Epilogue::SiluMulE4m3(AQuant::Static) => "silu_mul_e4m3_static",
        }
    }

    /// Whether it computes `silu(gate) * up` of paired weight rows (the fused first GEMM).
    pub const fn silu(self) -> bool {
        matches!(self, Epilogue::SiluMul | Epilogue::SiluMulE4m3(_))
    }

    /// The E4M3 quantization of `a` it finishes with, if any.
    pub const fn quant(self) -> Option<AQuant> {
        match self {
            Epilogue::SiluMulE4m3(q) => Some(q),
            _ => None,
        }
    }

    /// Every epilogue (the tuning cache parses names against these).
    pub const ALL: [Epilogue; 5] = [
        Epilogue::Store,
        Epilogue::SiluMul,
        Epilogue::SiluMulE4m3(AQuant::PerToken),
        Epilogue::SiluMulE4m3(AQuant::Group128),
        Epilogue::SiluMulE4m3(AQuant::Static),
    ];
}

/// Whether a first GEMM of `n` weight rows (`[gate; up]`) with weight scaling `scaling` can take
/// them in the fused epilogue's paired order ([`paired_row`]): `n` a multiple of 16; with 128x128
/// block scales a multiple of 128 (`I` of 64, so that a tile's gate rows and its up rows each lie
/// inside one scale block, [`WsConfig::paired_blocks`]). The rule the layer fuses by and the
/// generator checks.
pub const fn rows_pair(scaling: Scaling, n: u32) -> bool {
    let rows = if matches!(scaling, Scaling::Block128) {
        128
    } else {
        16
    };
    n.is_multiple_of(rows)
}

/// The logical row of the fused epilogue's weight row `r` in `[gate; up]` order with `i` outputs
/// (`N = 2i`): rows `16q .. 16q + 8` are gate rows `8q ..`, rows `16q + 8 .. 16q + 16` the up rows
/// `i + 8q ..` ([`Epilogue::SiluMul`]).
pub const fn glu_row(r: usize, i: usize) -> usize {
    let out = (r / 16) * 8 + r % 8;
    if r % 16 < 8 {
        out
    } else {
        i + out
    }
}

/// The `[gate; up]` row that the fused epilogue's weight row `r` reads (`N = 2i`): [`glu_row`],
/// or with `up_first` (a storage whose paired order puts each 8 up rows before their gate rows,
/// [`WRows::up_first`]) its partner in the other half. Every per-row operand of a paired GEMM
/// (codes, per-row scales, group scales) follows this order.
pub const fn paired_row(r: usize, i: usize, up_first: bool) -> usize {
    let g = glu_row(r, i);
    if up_first {
        (g + i) % (2 * i)
    } else {
        g
    }
}

/// One variant of the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WsConfig {
    /// Operand type.
    pub operands: Operands,
    /// Scaling of the accumulator.
    pub scaling: Scaling,
    /// Output type.
    pub out: OutTy,
    /// What the epilogue stores: the product, or the fused `silu(gate) * up`.
    pub epilogue: Epilogue,
    /// Consumer warpgroups (1 or 2): the A side of a tile is `64 * consumers` rows.
    pub consumers: u32,
    /// The B side of a tile (the wgmma N): weight rows (prefill) or token rows (decode).
    pub bn: u32,
    /// Pipeline stages.
    pub stages: u32,
    /// Decode form: weights on the A (M) side, tokens on the B (N) side.
    pub swap_ab: bool,
    /// Split-K (decode only): each tile's k-tiles are cut into this many contiguous ranges,
    /// computed by different CTAs into an f32 workspace; the last of them to finish sums the
    /// partials in split order (deterministic) and runs the epilogue. 1: no split.
    pub split_k: u32,
    /// N (compiled in).
    pub n: u32,
    /// K (compiled in).
    pub k: u32,
    /// How a tile's weight rows are addressed in the weight's TMA map: [`WRows::PLAIN`] for the
    /// compact `[E, N, K]` operand, else the row modes of the recipe's own storage
    /// ([`super::wmap`]; bf16 and E4M3 weights).
    pub w_rows: WRows,
    /// Block-scaled tiles of two consumers: each consumer keeps two slice accumulators, so that
    /// k-tile i's MMAs run while slice i - 1 is promoted, as one consumer always does (`false`:
    /// one slice, promoted after its MMAs complete, which the other consumer's MMAs overlap).
    /// Three accumulators a thread fit the 232 registers of `setmaxnreg` as ptxas allocates
    /// them; the driver's JIT spills them, so this form is a tuning candidate, never the default.
    /// `false` for every other family.
    pub two_slices: bool,
    /// A consumer whose token rows all lie past its expert's end skips its MMAs and epilogue
    /// ([`skips_idle_rows`]); the prefill forms with two consumers, shared-memory operands, one k
    /// split and no group-wise scales only. Not measured faster yet (the first form of it was
    /// 17-40% slower on the H100, run 95; the vote that should mend that is not measured), so
    /// no candidate list holds it unless asked (`tune::with_idle_twins`).
    pub skip_idle: bool,
}

impl WsConfig {
    /// Bytes of A per stage (`64 C` rows of a k-tile: 128 bytes, 64 for int8 weights, 32 for
    /// 4-bit ones).
    pub const fn a_stage_bytes(&self) -> u32 {
        64 * self.consumers * self.a_row_bytes()
    }

    /// Bytes of one A row of a k-tile: 128, or `bk` times the weight's bits over 8 for
    /// register-sourced A (int8: 64, 4-bit: 32).
    pub const fn a_row_bytes(&self) -> u32 {
        if self.operands.register_a() {
            self.operands.bk() * self.operands.w_bits() / 8
        } else {
            128
        }
    }

    /// Bytes of one weight row of the GEMM's W operand in device memory: `K` elements of
    /// [`Operands::w_bits`], except int8 codes, whose rows are padded with zeros to a multiple of 64
    /// (their kernel order, [`crate::gemm::reference::i8_kernel_place`], is per 64-deep k-tile).
    pub const fn w_row_bytes(&self) -> u64 {
        self.operands.w_row_bytes(self.k as u64)
    }

    /// Bytes of a tile's group scales in a stage (0 for operands without them): the tile's weight
    /// rows, each its [`W4::scale_tile_bytes`] for 4-bit weights, or one f32 for group-wise int8 and
    /// FP8 ([`Scaling::PerRowGroup`], [`Scaling::Groupwise`]) (row-major, as the TMA box lands).
    pub const fn group_scale_bytes(&self) -> u32 {
        match (self.operands, self.scaling) {
            (Operands::W4Bf16(w), _) => self.tile_weights() * w.scale_tile_bytes(),
            (Operands::I8Bf16, Scaling::PerRowGroup { .. })
            | (Operands::E4m3, Scaling::Groupwise { .. }) => self.tile_weights() * 4,
            _ => 0,
        }
    }

    /// The group along K of the stage's group scales (4-bit weights' or group-wise int8's), if
    /// any.
    pub const fn scale_group(&self) -> Option<u32> {
        match (self.operands, self.scaling) {
            (Operands::W4Bf16(w), _) => Some(w.group),
            (_, s) => s.row_group(),
        }
    }

    /// Bytes of B per stage (`BN` rows of 128 bytes).
    pub const fn b_stage_bytes(&self) -> u32 {
        self.bn * 128
    }

    /// Bytes of the scales of one stage, padded to whole KiB so that the next stage stays
    /// 1024-byte aligned: block-scaled, the weight-scale boxes from 0 and the activation scales of the
    /// tile's token rows at [`WsConfig::block_x_at`]; 4-bit weights and group-wise int8 and FP8, the k-tile's
    /// group scales ([`WsConfig::group_scale_bytes`]); 0 otherwise.
    pub const fn scale_stage_bytes(&self) -> u32 {
        match self.scaling {
            Scaling::Block128 => {
                (self.block_x_at() + 4 * (self.tile_tokens() + BLOCK_SCALE_PAD)).div_ceil(1024)
                    * 1024
            }
            _ => self.group_scale_bytes().div_ceil(1024) * 1024,
        }
    }

    /// Block-scaled: the weight-scale boxes a stage holds, one per 128-row scale block a tile's
    /// weight rows can touch: two for a 192-row prefill tile (it starts on 64 rows and spans two
    /// blocks) and for the fused epilogue's paired rows ([`WsConfig::paired_blocks`]: the tile's
    /// gate rows lie in one block, its up rows in another); one otherwise.
    pub const fn w_scale_boxes(&self) -> u32 {
        let block = matches!(self.scaling, Scaling::Block128);
        if self.paired_blocks() || (block && !self.swap_ab && self.bn > 128) {
            2
        } else {
            1
        }
    }

    /// Block-scaled with the fused SiLU epilogue: the GEMM's weight rows are in the paired order
    /// ([`paired_row`]), so a row's 128x128 scale block is that of its `[gate; up]` row, not of
    /// its position in the tile.
    pub const fn paired_blocks(&self) -> bool {
        matches!(self.scaling, Scaling::Block128) && self.epilogue.silu()
    }

    /// Byte offset of the activation scales in a stage's block-scale area: after the weight-scale
    /// boxes, 128 bytes apart (TMA destinations); [`BLOCK_SCALE_X_AT`] with one box.
    pub const fn block_x_at(&self) -> u32 {
        BLOCK_SCALE_X_AT * self.w_scale_boxes()
    }

    /// TMA bytes of a stage's scales: block-scaled, the weight-scale boxes and the activation box; 4-bit weights and group-wise
    /// int8 and FP8, the group-scale box; 0 otherwise.
    pub const fn scale_tx_bytes(&self) -> u32 {
        match self.scaling {
            Scaling::Block128 => {
                4 * (BLOCK_SCALE_W_BOX * self.w_scale_boxes()
                    + self.tile_tokens()
                    + BLOCK_SCALE_PAD)
            }
            _ => self.group_scale_bytes(),
        }
    }

    /// TMA bytes of one stage (the expected transaction bytes of its full barrier).
    pub const fn tx_bytes(&self) -> u32 {
        self.a_stage_bytes() + self.b_stage_bytes()
    }

    /// Bytes of one stage: A, B and the block scales.
    pub const fn stage_bytes(&self) -> u32 {
        self.tx_bytes() + self.scale_stage_bytes()
    }

    /// Arrivals that complete a stage's full barrier: the producer's one `expect_tx` (the block
    /// scales come by TMA on the same barrier).
    pub const fn full_arrivals(&self) -> u32 {
        1
    }

    /// Token rows per tile.
    pub const fn tile_tokens(&self) -> u32 {
        if self.swap_ab {
            self.bn
        } else {
            64 * self.consumers
        }
    }

    /// Weight rows (output columns) per tile.
    pub const fn tile_weights(&self) -> u32 {
        if self.swap_ab {
            64 * self.consumers
        } else {
            self.bn
        }
    }

    /// Weight tiles per raster group: a wave of persistent CTAs walks `G` weight tiles across the
    /// expert's token tiles before the next `G`, so that it shares a few X and W tiles in L2
    /// (prefill: 8, about the square root of half the SMs for a W tile twice an X tile). Decode:
    /// 1, so that the token tiles of one weight tile run back to back and read it once from HBM.
    pub const fn raster_group(&self) -> u32 {
        if self.swap_ab {
            1
        } else {
            8
        }
    }

    /// Columns of the output: N, or N / 2 for the fused SiLU epilogue.
    pub const fn out_cols(&self) -> u32 {
        if self.epilogue.silu() {
            self.n / 2
        } else {
            self.n
        }
    }

    /// Weight tiles per token tile: `ceil(N / tile_weights)`.
    pub const fn weight_tiles(&self) -> u32 {
        self.n.div_ceil(self.tile_weights())
    }

    /// 128-byte k-tiles: `ceil(K / bk)`.
    pub const fn k_tiles(&self) -> u32 {
        self.k.div_ceil(self.operands.bk())
    }

    /// Threads per CTA: a producer warpgroup and the consumers, or the consumers first and a
    /// producer warp after them ([`WsConfig::producer_warp`]: register-sourced A with one consumer,
    /// or two with a small decode tile; no `setmaxnreg`).
    pub const fn threads(&self) -> u32 {
        if self.producer_warp() {
            128 * self.consumers + 32
        } else {
            128 * (1 + self.consumers)
        }
    }

    /// Whether the producer is one warp after the consumer warpgroups (register-sourced A with one
    /// consumer, or two with a decode token tile of at most [`MAX_WARP_PRODUCER_BN`]), not a
    /// warpgroup before them: its other 96 threads would only hold registers, and a CTA of 160
    /// (288) threads leaves room for more CTAs per SM (a wgmma warpgroup must start at a warp
    /// index that is a multiple of 4, hence the consumers first). Two consumers of a wider tile
    /// take a producer warpgroup and `setmaxnreg` as the other families do: with 9 warps, one of
    /// the SM's four sub-partitions holds 3 of them in its quarter of the register file, so a
    /// thread gets at most 168 registers (the driver's occupancy is 0 past it), where the
    /// 256-token tile needs about 190; a small decode tile needs about 70.
    pub const fn producer_warp(&self) -> bool {
        self.operands.register_a()
            && (self.consumers == 1 || (self.swap_ab && self.bn <= MAX_WARP_PRODUCER_BN))
    }

    /// Whether the producer warpgroup gives registers to the consumers (`setmaxnreg`): with two
    /// consumers and a producer warpgroup.
    pub const fn reallocates_registers(&self) -> bool {
        self.consumers >= 2 && !self.producer_warp()
    }

    /// The first thread of the producer.
    pub const fn producer_tid(&self) -> u32 {
        if self.producer_warp() {
            128 * self.consumers
        } else {
            0
        }
    }

    /// Dynamic shared memory per CTA (stages plus 1 KiB of alignment slack).
    pub const fn dynamic_smem_bytes(&self) -> u32 {
        self.stages * self.stage_bytes() + SMEM_ALIGN_SLACK
    }

    /// A short name of the variant (what the tables and the entry names use), e.g.
    /// `bf16_p2x128_s4` (prefill, 2 consumers, BN 128, 4 stages) or `e4m3b_d1x16_s8_bf16`; the
    /// fused SiLU epilogue adds `_silu` before the output type.
    pub fn tag(&self) -> String {
        let scale = match self.scaling {
            Scaling::None => "",
            Scaling::Tensorwise { per_token: true } => "t",
            Scaling::Tensorwise { per_token: false } => "s",
            Scaling::Block128 => "b",
            Scaling::Channelwise { per_token: true } => "ct",
            Scaling::Channelwise { per_token: false } => "cs",
            Scaling::PerRow => "r",
            Scaling::PerExpert => "x",
            Scaling::PerRowGroup { .. } => "g",
            Scaling::Groupwise {
                per_token: true, ..
            } => "gt",
            Scaling::Groupwise {
                per_token: false, ..
            } => "gs",
        };
        let scale = match self.scaling.row_group() {
            Some(group) => format!("{scale}{group}"),
            _ => scale.to_string(),
        };
        let out = self.out.name();
        let silu = match self.epilogue {
            Epilogue::Store => String::new(),
            Epilogue::SiluMul => "_silu".into(),
            Epilogue::SiluMulE4m3(q) => format!("_silu_{}", q.tag()),
        };
        let split = if self.split_k > 1 {
            format!("_k{}", self.split_k)
        } else {
            String::new()
        };
        let slices = if self.two_slices { "_2s" } else { "" };
        let idle = if self.skip_idle { "_i" } else { "" };
        format!(
            "{}{scale}_{}{}x{}_s{}{split}{slices}{idle}{silu}_{out}{}",
            self.operands.name(),
            if self.swap_ab { "d" } else { "p" },
            self.consumers,
            self.bn,
            self.stages,
            self.w_rows.tag()
        )
    }

    /// Upper bound on the tiles of `t` rows over `experts` experts (at most `min(E, T)` of them
    /// hold rows): `(ceil(T / tile_tokens) + min(E, T)) * weight_tiles`.
    pub fn tiles_upper_bound(&self, t: u64, experts: u64) -> u64 {
        self.token_tiles_upper_bound(t, experts) * u64::from(self.weight_tiles())
    }

    /// Upper bound on the token tiles of a launch of `t` rows over `experts` (the E4M3 output's
    /// arrival counters, [`super::finish::FINISH_PARAMS`]).
    pub fn token_tiles_upper_bound(&self, t: u64, experts: u64) -> u64 {
        t.div_ceil(u64::from(self.tile_tokens())) + experts.min(t)
    }

    /// Upper bound on the work items (tiles times splits): what the persistent grid walks.
    pub fn items_upper_bound(&self, t: u64, experts: u64) -> u64 {
        self.tiles_upper_bound(t, experts) * u64::from(self.split_k.max(1))
    }

    /// f32 elements of one tile's partial sum in the split-K workspace.
    pub const fn partial_elems(&self) -> u32 {
        64 * self.consumers * self.bn
    }

    /// The k-tile range `[start, end)` of split `s` (balanced, contiguous).
    pub const fn split_range(&self, s: u32) -> (u32, u32) {
        let kt = self.k_tiles();
        let n = if self.split_k == 0 { 1 } else { self.split_k };
        (s * kt / n, (s + 1) * kt / n)
    }

    /// The group-wise families' tile rules (`what`: `int8` or `FP8`): the group's partial sum is a
    /// second accumulator (BN at most 128 with two consumers, 64 with one), and a row of f32 group
    /// scales is a TMA row (N a multiple of 4).
    fn check_group_tile(&self, what: &str) -> Result<()> {
        let most = if self.consumers >= 2 { 128 } else { 64 };
        if self.bn > most {
            return Err(unsupported(format!(
                "group-wise {what} with BN = {} (at most {most} with {} consumer warpgroup(s): the group's partial sum is a second accumulator)",
                self.bn, self.consumers
            )));
        }
        if !self.n.is_multiple_of(4) {
            return Err(unsupported(format!(
                "group-wise {what} with N = {} (a multiple of 4: a row of f32 group scales is a TMA row of 16-byte multiples)",
                self.n
            )));
        }
        Ok(())
    }

    /// Whether the generator serves this configuration (what [`grouped_ws_entry`] checks first):
    /// `Err` names the first rule it breaks.
    pub fn supported(&self) -> Result<()> {
        let bad = |what: String| Err(unsupported(what));
        if !(1..=2).contains(&self.consumers) {
            return bad(format!("{} consumer warpgroups (1 or 2)", self.consumers));
        }
        if self.two_slices
            && (self.scaling != Scaling::Block128 || self.consumers != 2 || self.swap_ab)
        {
            return bad(format!(
                "two slice accumulators with {:?}, {} consumer warpgroup(s){} (the block-scaled prefill form with two consumers; one consumer always keeps two)",
                self.scaling,
                self.consumers,
                if self.swap_ab { ", swapped" } else { "" }
            ));
        }
        if self.skip_idle && !idle_rows_apply(self) {
            return bad(format!(
                "skipping idle consumers in {} (the prefill forms with two consumers, shared-memory operands, one k split and no group-wise scales)",
                self.tag()
            ));
        }
        WgmmaN::new(self.bn)?;
        if self.reallocates_registers() && self.bn < 128 {
            // ptxas then allocates fewer than 168 registers at entry and drops `setmaxnreg`
            // (C7508).
            return bad(format!(
                "two consumer warpgroups behind a producer warpgroup with BN = {} (at least 128; register-sourced A with BN <= {MAX_WARP_PRODUCER_BN} takes a producer warp)",
                self.bn
            ));
        }
        if self.swap_ab && !self.bn.is_power_of_two() {
            return bad(format!(
                "a decode token tile of {} (a power of two, 8 to 256)",
                self.bn
            ));
        }
        if self.split_k == 0 || self.split_k > MAX_SPLIT_K {
            return bad(format!("split-K of {} (1 to {MAX_SPLIT_K})", self.split_k));
        }
        if self.split_k > 1 && !self.swap_ab {
            return bad(format!(
                "split-K of {} in the prefill form (decode only)",
                self.split_k
            ));
        }
        if self.split_k > 1 && self.split_k > self.k_tiles() {
            return bad(format!(
                "split-K of {} over {} k-tiles",
                self.split_k,
                self.k_tiles()
            ));
        }
        if !(2..=MAX_STAGES).contains(&self.stages) {
            return bad(format!("{} stages (2 to {MAX_STAGES})", self.stages));
        }
        if self.dynamic_smem_bytes() > MAX_DYNAMIC_SMEM {
            return bad(format!(
                "{} bytes of shared memory ({} stages of {}; at most {MAX_DYNAMIC_SMEM})",
                self.dynamic_smem_bytes(),
                self.stages,
                self.stage_bytes()
            ));
        }
        let align = 16 / self.operands.bytes();
        if self.n == 0 || self.k == 0 || !self.k.is_multiple_of(align) || !self.n.is_multiple_of(2)
        {
            return bad(format!(
                "N = {}, K = {} (positive, N even, K a multiple of {align})",
                self.n, self.k
            ));
        }
        if self.epilogue.silu()
            && (!self.n.is_multiple_of(16) || !self.tile_weights().is_multiple_of(16))
        {
            return bad(format!(
                "the fused SiLU epilogue with N = {} and {} weight rows per tile (multiples of 16: gate and up rows pair within 16)",
                self.n,
                self.tile_weights()
            ));
        }
        if self.epilogue.quant().is_some() && self.out != OutTy::F32 {
            return bad(format!(
                "the E4M3 output of `a` with {} out (the epilogue stores `a` in f32 for the token tile's quantization)",
                self.out.name()
            ));
        }
        if self.w_rows != WRows::PLAIN {
            if self.operands.register_a() {
                return bad(format!(
                    "{} weights read through the recipe's row modes (their codes are re-laid in the kernel's order)",
                    self.operands.name()
                ));
            }
            if self.w_rows.up_first && !self.epilogue.silu() {
                return bad("up rows first without the fused SiLU epilogue".into());
            }
            self.w_rows
                .check(self.n, self.tile_weights())
                .map_err(unsupported)?;
        }
        if self.n > (1 << 24) || self.k > (1 << 24) {
            return bad(format!(
                "N = {}, K = {} (at most 2^24 each)",
                self.n, self.k
            ));
        }
        match (self.operands, self.scaling) {
            (Operands::Bf16, Scaling::None)
            | (Operands::E4m3, Scaling::Tensorwise { .. } | Scaling::Channelwise { .. }) => {}
            (Operands::I8Bf16, Scaling::PerRowGroup { group }) => {
                // Whole k-tiles a group, and a second accumulator (the group's partial sum): BN at
                // most 64, as the tuner's decode tiles; the group scales' TMA rows (4 N bytes) a
                // multiple of 16 bytes; and the int8 form's rules (as for per-row scales).
                if Scaling::per_row_group(group.into()).is_none() {
                    return bad(format!(
                        "group-wise int8 with groups of {group} (a power of two, at least 64)"
                    ));
                }
                // (As the block-scaled family: the total and the partial sum within the registers
                // of a two-consumer CTA at BN 128, of a one-consumer one at 64.)
                self.check_group_tile("int8")?;
                if !self.swap_ab {
                    return bad("int8 weights need the swapped (weights-on-A) form".into());
                }
                if !self.k.is_multiple_of(I8_K_ALIGN) {
                    return bad(format!(
                        "int8 weights with K = {} (a multiple of 16)",
                        self.k
                    ));
                }
            }
            (Operands::E4m3, Scaling::Groupwise { group, .. }) => {
                // As group-wise int8 (whole k-tiles of 128 a group, the partial sum a second
                // accumulator, rows of f32 group scales by TMA); the promotion reads each
                // fragment row's scale from the stage (the A side swapped, else the B side).
                if group < self.operands.bk() || !group.is_power_of_two() {
                    return bad(format!(
                        "group-wise FP8 with groups of {group} (a power of two, at least {})",
                        self.operands.bk()
                    ));
                }
                self.check_group_tile("FP8")?;
            }
            (Operands::I8Bf16, Scaling::PerRow) => {
                // The register-A form: weights on A (one or two consumers' 64 rows each), no
                // split-K.
                if !self.swap_ab {
                    return bad("int8 weights need the swapped (weights-on-A) form".into());
                }
                // K a multiple of 16, as the GPU check covers it (the code rows are padded to 64
                // bytes, `w_row_bytes`; X's rows of 2K bytes need K % 8 for TMA).
                if !self.k.is_multiple_of(I8_K_ALIGN) {
                    return bad(format!(
                        "int8 weights with K = {} (a multiple of 16)",
                        self.k
                    ));
                }
            }
            (Operands::W4Bf16(w), Scaling::PerExpert) => {
                if !self.swap_ab {
                    return bad("4-bit weights need the swapped (weights-on-A) form".into());
                }
                // A k16 step lies inside one group; a k-tile holds whole groups or lies inside one.
                let g = w.group;
                let int4_scale = matches!(w.scale, GroupScale::Bf16 | GroupScale::Bf16Zero);
                if (w.codes == W4Codes::U4) != int4_scale {
                    return bad(format!(
                        "4-bit codes {:?} with {:?} scales (E2M1 takes E4M3 or E8M0, INT4 bf16)",
                        w.codes, w.scale
                    ));
                }
                // A row's scales and zero points of a k-tile are one 4- or 8-byte load.
                if w.scale == GroupScale::Bf16Zero && g < 32 {
                    return bad(format!(
                        "asymmetric INT4 with a scale group of {g} (zero points take groups of at least 32)"
                    ));
                }
                if g < 16 || !g.is_power_of_two() {
                    return bad(format!(
                        "a scale group of {g} (a power of two, at least 16)"
                    ));
                }
                // The codes' kernel order is per 64-deep k-tile (and TMA wants a code row's pitch,
                // K / 2 bytes, and a scale row's, N scales, in multiples of 16 bytes).
                if !w.fits(self.n as u64, self.k as u64) {
                    return bad(format!(
                        "4-bit weights with N = {}, K = {} (K a multiple of 64, N of {})",
                        self.n,
                        self.k,
                        16 / w.scale.bytes()
                    ));
                }
            }
            (Operands::E4m3, Scaling::Block128) => {
                // The total and one slice accumulator per thread (two slices with one consumer or
                // `two_slices`): BN at most 128 with two consumers, 64 with one (more spills); or
                // the two-consumer prefill tile of 192 weight rows with one slice (96 + 96
                // registers), whose 64-row column chunks each lie inside one 128-row scale block.
                // Any other prefill tile must not straddle two scale blocks.
                let most = if self.consumers >= 2 { 128 } else { 64 };
                let wide = self.bn == 192 && self.consumers == 2 && !self.swap_ab;
                if (self.bn > most && !wide)
                    || (!self.swap_ab && !wide && !128u32.is_multiple_of(self.bn))
                    || (wide && self.two_slices)
                {
                    return bad(format!(
                        "block-scaled BN = {} (a divisor of 128 for prefill, or 192 with two consumers and one slice; at most {most} with {} consumer warpgroup(s))",
                        self.bn, self.consumers
                    ));
                }
                // Paired rows (the fused epilogue): a tile's gate rows and its up rows each inside
                // one 128-row block, which holds for tiles of at most 128 paired rows (64 gate
                // rows from a multiple of 64) when I = N / 2 is a multiple of 64.
                if self.paired_blocks()
                    && (self.tile_weights() > 128 || !rows_pair(self.scaling, self.n))
                {
                    return bad(format!(
                        "block-scaled weights in the fused SiLU epilogue with {} weight rows a tile and N = {} (at most 128 rows a tile, N a multiple of 128: a tile's gate rows and its up rows each in one 128-row scale block)",
                        self.tile_weights(),
                        self.n
                    ));
                }
            }
            (o, s) => return bad(format!("{} operands with scaling {s:?}", o.name())),
        }
        Ok(())
    }
}

/// Extra dynamic shared memory so that the kernel can round its base up to 1024 bytes.
pub const SMEM_ALIGN_SLACK: u32 = 1024;
/// The most dynamic shared memory a CTA may ask for on sm_90 (227 KiB).
pub const MAX_DYNAMIC_SMEM: u32 = 227 * 1024;
/// The most pipeline stages.
pub const MAX_STAGES: u32 = 12;
/// The most split-K ranges.
pub const MAX_SPLIT_K: u32 = 8;
/// The widest decode token tile whose two register-A consumers share a producer warp
/// ([`WsConfig::producer_warp`]).
pub const MAX_WARP_PRODUCER_BN: u32 = 32;
/// Registers per producer thread after `setmaxnreg.dec`.
pub const PRODUCER_REGS: u32 = 40;
/// The sm_90 descriptor's high word for a K-major 128B-swizzled tile: SBO 1024 bytes, layout 1.
const DESC_HI: i64 = 0x4000_0040;
/// The descriptor's low-word LBO field (16 bytes, ignored for swizzled K-major operands).
const DESC_LBO: i64 = 0x1_0000;

/// Weight scales one TMA box of `tmap_ws` holds (16 bytes: the box's inner extent must be a
/// multiple of 16 bytes); the consumers read the first.
pub const BLOCK_SCALE_W_BOX: u32 = 4;
/// Activation scales a stage's box holds past the tile's token rows: the box starts up to 3
/// elements early (rounded down to 16 bytes).
pub const BLOCK_SCALE_PAD: u32 = 4;
/// Byte offset of the activation scales in a stage's block-scale area (after the weight-scale box,
/// 128-byte aligned as a TMA destination).
pub const BLOCK_SCALE_X_AT: u32 = 128;

/// Parameter names, in launch order.
pub const PARAMS: [&str; 12] = [
    "tmap_x",
    "tmap_w",
    "y",
    "offsets",
    "x_scale",
    "w_scale",
    "experts",
    "tokens",
    "workspace",
    "counters",
    "tmap_xs",
    "tmap_ws",
];

/// Registers per consumer thread after `setmaxnreg.inc` with two consumer warpgroups (what the
/// register file of 64 Ki registers leaves beside the producer's 40). With one consumer (256
/// threads, or 160 with a producer warp) the kernel keeps ptxas's allocation and emits no
/// `setmaxnreg`.
pub const CONSUMER_REGS: u32 = 232;

fn unsupported(what: String) -> Error {
    Error::Unsupported {
        param: "grouped GEMM (warp-specialized)".into(),
        what,
    }
}

/// One tile of the linear order, as the kernel's scan finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WsTile {
    /// The expert.
    pub expert: usize,
    /// First token row (global) and the expert's end row.
    pub tokens: std::ops::Range<usize>,
    /// First weight row (output column).
    pub weight0: usize,
}

/// The kernel's tile walk on the host: tile `id` of the raster order (experts in order; inside an
/// expert, groups of [`WsConfig::raster_group`] weight tiles, token tile major and weight tile minor
/// inside a group), or `None` past the last tile. `offsets` has `E + 1` entries. A fresh
/// [`TileScan`]'s answer.
pub fn tile_of(cfg: &WsConfig, offsets: &[usize], id: usize) -> Option<WsTile> {
    TileScan::new(cfg, offsets).find(id)
}

/// Lanes of the warp that scans the experts (one expert a lane per step).
pub const SCAN_LANES: usize = 32;

/// The kernel's tile scan on the host, step by step as one warp runs it: the cursor `(expert,
/// tiles before it, its first row)` that a CTA keeps across its growing tile ids, and the 32-expert
/// steps (each lane's end offset, start from the lane below, tile count, the inclusive sums, the
/// first lane whose sum passes the id as `popc(!ballot)`), so that the tests check the kernel's
/// arithmetic, resumption included, against an independent enumeration. It counts an expert's
/// tiles (m-tiles times weight tiles); the kernel counts its items, the same times the split-K
/// factor, with the same steps.
#[derive(Debug, Clone)]
pub struct TileScan<'a> {
    cfg: &'a WsConfig,
    offsets: &'a [usize],
    expert: usize,
    before: usize,
    lo: usize,
}

impl<'a> TileScan<'a> {
    /// A cursor at expert 0 (`offsets` has `E + 1` entries; none is read when it is empty).
    pub fn new(cfg: &'a WsConfig, offsets: &'a [usize]) -> Self {
        TileScan {
            cfg,
            offsets,
            expert: 0,
            before: 0,
            lo: offsets.first().copied().unwrap_or(0),
        }
    }

    /// Tile `id` (at least every id asked before, as a CTA's ids only grow), or `None` past the
    /// last tile.
    pub fn find(&mut self, id: usize) -> Option<WsTile> {
        let (tm, nt) = (
            self.cfg.tile_tokens() as usize,
            self.cfg.weight_tiles() as usize,
        );
        let experts = self.offsets.len().saturating_sub(1);
        loop {
            if self.expert >= experts {
                return None;
            }
            let mut hi = [0usize; SCAN_LANES];
            let mut lo = [0usize; SCAN_LANES];
            let mut tiles = [0usize; SCAN_LANES];
            let mut end = [0usize; SCAN_LANES];
            let mut ballot = 0u32;
            for j in 0..SCAN_LANES {
                hi[j] = self.offsets[(self.expert + j + 1).min(experts)];
                lo[j] = if j == 0 { self.lo } else { hi[j - 1] };
                tiles[j] = (hi[j] - lo[j]).div_ceil(tm) * nt;
                end[j] = tiles[j] + if j == 0 { self.before } else { end[j - 1] };
                if id < end[j] {
                    ballot |= 1 << j;
                }
            }
            if ballot == 0 {
                self.before = end[SCAN_LANES - 1];
                self.lo = hi[SCAN_LANES - 1];
                self.expert += SCAN_LANES;
                continue;
            }
            let f = (!ballot).count_ones() as usize;
            self.before = end[f] - tiles[f];
            self.lo = lo[f];
            self.expert += f;
            let mtiles = tiles[f] / nt;
            let local = id - self.before;
            let g = self.cfg.raster_group() as usize;
            let (grp, r) = (local / (g * mtiles), local % (g * mtiles));
            let width = g.min(nt - grp * g);
            let (mt, wt) = (r / width, grp * g + r % width);
            return Some(WsTile {
                expert: self.expert,
                tokens: (lo[f] + mt * tm)..hi[f],
                weight0: wt * self.cfg.tile_weights() as usize,
            });
        }
    }
}

/// The scan state one role keeps across its tiles.
struct Scan {
    expert: Reg,
    before: Reg,
    lo: Reg,
    hi: Reg,
    tile: Reg,
    offsets: Reg,
    experts: Reg,
}

/// The work item the scan found.
struct Found {
    tok0: Reg,
    w0: Reg,
    /// Its split (split-K), else 0.
    split: Reg,
    /// The tile's index in the order without splits (the split-K workspace slot and counter).
    tile_key: Reg,
    /// The k-tile range `[ks, ke)` of its split.
    ks: Reg,
    ke: Reg,
    /// The token tile's index in the launch (the token tiles of the experts before plus its
    /// index in its expert): the counted E4M3 output's arrival counter (`None` without it).
    token_key: Option<Reg>,
}

fn log2(v: u32) -> i64 {
    i64::from(v.trailing_zeros())
}

/// Advance `s` to the expert of `s.tile`; branch to `exit` past the last tile.
///
/// The whole warp takes part (every lane holds the same cursor state, and the control flow is
/// warp-uniform; each lane's offsets, counts and sums are its own until the broadcast): the warp
/// looks at 32 experts at a time, lane `j` at expert
/// `expert + j`. Each lane loads its expert's end offset (one coalesced load for 32 experts), takes
/// its start from the lane below (`shfl.up`), counts the expert's work items, and an inclusive
/// warp scan (five `shfl.up`) gives the items up to and including each expert. The experts whose
/// items end past `tile` form a suffix of the lanes (the sums only grow), so the found expert is
/// the first lane of that suffix, `popc(~ballot)`, and its state is broadcast (`shfl.idx`). The
/// result is [`TileScan`]'s (the same expert, items before it and row range). The earlier walk read
/// `offsets[e + 1]` expert by expert, a chain of dependent loads as long as the expert count (128
/// for Qwen3-30B-A3B) before the CTA's first TMA could go out: Qwen3's w13 at 1 token took 29.0 us
/// with it and 23.1 with this scan on the H200 (bf16; FP8 22.9 -> 15.7).
fn scan(k: &mut K, cfg: &WsConfig, s: &Scan, exit: &str) -> Found {
    let (top, found) = (k.b.label("scan"), k.b.label("found"));
    let tid = k.special(SpecialReg::TidX);
    let last_lane = SCAN_LANES as i64 - 1;
    let lane = k.bin(BinOpcode::And, PtxTy::B32, tid, Operand::Int(last_lane));
    let lane0 = k.setp(CmpOp::Eq, lane, Operand::Int(0));
    k.b.push(Inst::Label(top.clone()));
    let done = k.setp(CmpOp::Ge, s.expert, Operand::Reg(s.experts));
    k.bra(exit, Some((done, false)));
    // hi_j = offsets[min(expert + j + 1, E)]: lanes past the last expert read offsets[E] and
    // count no rows.
    let idx = k.bin(BinOpcode::Add, PtxTy::U32, s.expert, Operand::Reg(lane));
    k.bin_to(idx, BinOpcode::Add, PtxTy::U32, idx, Operand::Int(1));
    k.bin_to(
        idx,
        BinOpcode::Min,
        PtxTy::U32,
        idx,
        Operand::Reg(s.experts),
    );
    let addr = k.addr(s.offsets, idx, 4);
    let hi = k.reg32();
    k.b.push(Inst::Ld {
        ty: PtxTy::U32,
        d: hi,
        addr,
    });
    // lo_j = hi_{j - 1}, and the cursor's lo for lane 0.
    let lo = k.reg32();
    k.b.push(Inst::ShflUp {
        d: lo,
        a: hi,
        delta: 1,
    });
    k.b.push(Inst::Selp {
        ty: PtxTy::U32,
        d: lo,
        a: Operand::Reg(s.lo),
        b: Operand::Reg(lo),
        p: lane0,
    });
    // The expert's m-tiles, and its items (m-tiles times weight tiles times splits).
    let rows = k.bin(BinOpcode::Sub, PtxTy::U32, hi, Operand::Reg(lo));
    let tm = cfg.tile_tokens();
    k.bin_to(
        rows,
        BinOpcode::Add,
        PtxTy::U32,
        rows,
        Operand::Int(i64::from(tm - 1)),
    );
    k.bin_to(
        rows,
        BinOpcode::Shr,
        PtxTy::U32,
        rows,
        Operand::Int(log2(tm)),
    );
    let tiles = k.bin(
        BinOpcode::MulLo,
        PtxTy::U32,
        rows,
        Operand::Int(i64::from(cfg.weight_tiles() * cfg.split_k)),
    );
    // end_j = before + the items of experts expert ..= expert + j (inclusive warp scan).
    let end = k.reg32();
    k.mov(end, Operand::Reg(tiles));
    for d in [1i64, 2, 4, 8, 16] {
        let o = k.reg32();
        k.b.push(Inst::ShflUp {
            d: o,
            a: end,
            delta: d,
        });
        let below = k.setp(CmpOp::Lt, lane, Operand::Int(d));
        k.b.push(Inst::Selp {
            ty: PtxTy::U32,
            d: o,
            a: Operand::Int(0),
            b: Operand::Reg(o),
            p: below,
        });
        k.bin_to(end, BinOpcode::Add, PtxTy::U32, end, Operand::Reg(o));
    }
    k.bin_to(end, BinOpcode::Add, PtxTy::U32, end, Operand::Reg(s.before));
    let hit = k.setp(CmpOp::Lt, s.tile, Operand::Reg(end));
    let ballot = k.reg32();
    k.b.push(Inst::Ballot { d: ballot, p: hit });
    let any = k.setp(CmpOp::Ne, ballot, Operand::Int(0));
    let first = k.bin(BinOpcode::Xor, PtxTy::B32, ballot, Operand::Int(-1));
    let first = k.un(UnOpcode::Popc, RegClass::B32, Operand::Reg(first));
    k.bra(&found, Some((any, false)));
    // None of the 32: past them (lane 31's sums), and on.
    for (d, a) in [(s.before, end), (s.lo, hi)] {
        k.b.push(Inst::ShflIdx {
            d,
            a,
            lane: Operand::Int(last_lane),
        });
    }
    k.bin_to(
        s.expert,
        BinOpcode::Add,
        PtxTy::U32,
        s.expert,
        Operand::Int(SCAN_LANES as i64),
    );
    k.bra(&top, None);
    // The first lane whose items end past the tile holds it: that expert's state, broadcast.
    k.b.push(Inst::Label(found));
    k.bin_to(end, BinOpcode::Sub, PtxTy::U32, end, Operand::Reg(tiles));
    for (d, a) in [(s.before, end), (s.lo, lo), (s.hi, hi), (rows, rows)] {
        k.b.push(Inst::ShflIdx {
            d,
            a,
            lane: Operand::Reg(first),
        });
    }
    k.bin_to(
        s.expert,
        BinOpcode::Add,
        PtxTy::U32,
        s.expert,
        Operand::Reg(first),
    );
    // Raster order inside the expert: groups of G weight tiles; in a group, token tile major and
    // weight tile minor (so that a wave of CTAs shares a few X and W tiles in L2).
    let local = k.bin(BinOpcode::Sub, PtxTy::U32, s.tile, Operand::Reg(s.before));
    let g = i64::from(cfg.raster_group());
    // With split-K the splits are virtual weight tiles (wt' = wt * S + split; decode: G = 1).
    let nt = i64::from(cfg.weight_tiles() * cfg.split_k);
    let gsz = k.bin(BinOpcode::MulLo, PtxTy::U32, rows, Operand::Int(g));
    let grp = k.bin(BinOpcode::Div, PtxTy::U32, local, Operand::Reg(gsz));
    let r = k.bin(BinOpcode::MulLo, PtxTy::U32, grp, Operand::Reg(gsz));
    k.bin_to(r, BinOpcode::Sub, PtxTy::U32, local, Operand::Reg(r));
    let gstart = k.bin(BinOpcode::MulLo, PtxTy::U32, grp, Operand::Int(g));
    let width = k.reg32();
    k.mov(width, Operand::Int(nt));
    k.bin_to(
        width,
        BinOpcode::Sub,
        PtxTy::U32,
        width,
        Operand::Reg(gstart),
    );
    k.bin_to(width, BinOpcode::Min, PtxTy::U32, width, Operand::Int(g));
    let mt = k.bin(BinOpcode::Div, PtxTy::U32, r, Operand::Reg(width));
    let wt = k.bin(BinOpcode::MulLo, PtxTy::U32, mt, Operand::Reg(width));
    k.bin_to(wt, BinOpcode::Sub, PtxTy::U32, r, Operand::Reg(wt));
    k.bin_to(wt, BinOpcode::Add, PtxTy::U32, wt, Operand::Reg(gstart));
    let sk = i64::from(cfg.split_k);
    let (split, ks, ke, tile_key) = if cfg.split_k > 1 {
        let split = k.bin(BinOpcode::Rem, PtxTy::U32, wt, Operand::Int(sk));
        k.bin_to(wt, BinOpcode::Div, PtxTy::U32, wt, Operand::Int(sk));
        let kt = i64::from(cfg.k_tiles());
        let ks = k.bin(BinOpcode::MulLo, PtxTy::U32, split, Operand::Int(kt));
        k.bin_to(ks, BinOpcode::Div, PtxTy::U32, ks, Operand::Int(sk));
        let ke = k.bin(BinOpcode::Add, PtxTy::U32, split, Operand::Int(1));
        k.bin_to(ke, BinOpcode::MulLo, PtxTy::U32, ke, Operand::Int(kt));
        k.bin_to(ke, BinOpcode::Div, PtxTy::U32, ke, Operand::Int(sk));
        // before / S + wt * mtiles + mt (each expert's item count is a multiple of S).
        let key = k.bin(BinOpcode::Div, PtxTy::U32, s.before, Operand::Int(sk));
        let wm = k.bin(BinOpcode::MulLo, PtxTy::U32, wt, Operand::Reg(rows));
        k.bin_to(key, BinOpcode::Add, PtxTy::U32, key, Operand::Reg(wm));
        k.bin_to(key, BinOpcode::Add, PtxTy::U32, key, Operand::Reg(mt));
        (split, ks, ke, key)
    } else {
        let zero = k.imm(0);
        let ke = k.imm(i64::from(cfg.k_tiles()));
        (zero, zero, ke, zero)
    };
    let token_key = cfg.epilogue.quant().filter(|q| q.counted()).map(|_| {
        // Each expert's items are its token tiles times `nt`.
        let key = k.bin(BinOpcode::Div, PtxTy::U32, s.before, Operand::Int(nt));
        k.bin_to(key, BinOpcode::Add, PtxTy::U32, key, Operand::Reg(mt));
        key
    });
    let tok0 = k.bin(BinOpcode::Shl, PtxTy::B32, mt, Operand::Int(log2(tm)));
    k.bin_to(tok0, BinOpcode::Add, PtxTy::U32, tok0, Operand::Reg(s.lo));
    let w0 = k.bin(
        BinOpcode::MulLo,
        PtxTy::U32,
        wt,
        Operand::Int(i64::from(cfg.tile_weights())),
    );
    Found {
        tok0,
        w0,
        split,
        tile_key,
        ks,
        ke,
        token_key,
    }
}

/// The CTA's next tile (`tile += %nctaid.x`), back to the tile loop.
fn next_tile(k: &mut K, s: &Scan, grid: Reg, tile_loop: &str) {
    k.bin_to(
        s.tile,
        BinOpcode::Add,
        PtxTy::U32,
        s.tile,
        Operand::Reg(grid),
    );
    k.bra(tile_loop, None);
}

/// A fresh scan state at the CTA's first tile (`%ctaid.x`), `lo = offsets[0]`.
fn scan_state(k: &mut K) -> Scan {
    let offsets = k.global_param(PARAMS[3]);
    let experts = k.reg32();
    k.b.push(Inst::LdParam {
        ty: PtxTy::U32,
        d: experts,
        name: PARAMS[6].into(),
    });
    let lo = k.reg32();
    k.b.push(Inst::Ld {
        ty: PtxTy::U32,
        d: lo,
        addr: offsets,
    });
    let tile = k.special(SpecialReg::CtaidX);
    Scan {
        expert: k.imm(0),
        before: k.imm(0),
        lo,
        hi: k.reg32(),
        tile,
        offsets,
        experts,
    }
}

/// The entry's text (dynamic shared declaration, `.entry`, body) for `cfg`, named `name`.
///
/// Errors: a configuration [`WsConfig`] does not support (consumers, BN, stages, shared memory,
/// N or K, an operand/scaling pair that does not exist), a name that is not a PTX identifier.
pub fn grouped_ws_entry(name: &str, cfg: &WsConfig) -> Result<String> {
    if !super::emit::is_ptx_ident(name) {
        return Err(unsupported(format!(
            "entry name `{name}` (not a PTX identifier)"
        )));
    }
    cfg.supported()?;
    let stages = cfg.stages;
    let mut entry = Entry::new(name);
    entry.params = vec![
        Param::tensor_map(PARAMS[0]),
        Param::tensor_map(PARAMS[1]),
        Param::global_ptr(PARAMS[2], 16),
        Param::global_ptr(PARAMS[3], 4),
        Param::global_ptr(PARAMS[4], 4),
        Param::global_ptr(PARAMS[5], 4),
        Param::scalar(PARAMS[6], PtxTy::U32),
        Param::scalar(PARAMS[7], PtxTy::U32),
        Param::global_ptr(PARAMS[8], 16),
        Param::global_ptr(PARAMS[9], 4),
        Param::tensor_map(PARAMS[10]),
        Param::tensor_map(PARAMS[11]),
    ];
    if cfg.epilogue.quant().is_some() {
        entry.params.extend([
            Param::global_ptr(super::finish::FINISH_PARAMS[0], 8),
            Param::global_ptr(super::finish::FINISH_PARAMS[1], 4),
            Param::global_ptr(super::finish::FINISH_PARAMS[2], 4),
            Param::global_ptr(super::finish::FINISH_PARAMS[3], 4),
        ]);
    }
    entry.maxntid = Some(cfg.threads());
    entry.dynamic_shared = Some(DynamicShared {
        name: "smem".into(),
        align: 1024,
    });
    let mut kb = K {
        b: Builder::default(),
    };
    kb.b.declare_shared(SharedDecl::array("full_bar", SharedTy::B64, stages, 8)?)?;
    kb.b.declare_shared(SharedDecl::array("empty_bar", SharedTy::B64, stages, 8)?)?;
    if cfg.split_k > 1 {
        kb.b.declare_shared(SharedDecl::scalar("split_last", SharedTy::B32, 4)?)?;
    }
    if cfg.epilogue.quant().is_some_and(AQuant::counted) {
        kb.b.declare_shared(SharedDecl::scalar("token_tile_last", SharedTy::B32, 4)?)?;
    }
    let k = &mut kb;

    let tid = k.special(SpecialReg::TidX);
    let leader = k.setp(CmpOp::Eq, tid, Operand::Int(0));
    let full = k.b.shared_addr("full_bar");
    let empty = k.b.shared_addr("empty_bar");
    for s in 0..stages {
        for (bars, count) in [(full, cfg.full_arrivals()), (empty, 4 * cfg.consumers)] {
            let bar = k.bin(
                BinOpcode::Add,
                PtxTy::U32,
                bars,
                Operand::Int(8 * i64::from(s)),
            );
            k.b.emit_guarded(
                Guard::when(leader),
                AsyncOp::MbarrierInit {
                    bar,
                    count: Operand::Int(count.into()),
                },
            )?;
        }
    }
    k.b.emit_guarded(Guard::when(leader), AsyncOp::FenceMbarrierInit)?;
    k.b.push(Inst::BarSync);
    // The stage buffers: the dynamic base rounded up to 1024 bytes.
    let base = k.aligned_shared_base("smem", SMEM_ALIGN_SLACK);
    let wg = k.bin(BinOpcode::Shr, PtxTy::U32, tid, Operand::Int(7));
    let is_consumer = if cfg.producer_warp() {
        k.setp(CmpOp::Lt, wg, Operand::Int(cfg.consumers.into()))
    } else {
        k.setp(CmpOp::Ne, wg, Operand::Int(0))
    };
    let consumer = k.b.label("consumer");
    let exit = k.b.label("exit");
    k.bra(&consumer, Some((is_consumer, false)));

    producer(k, cfg, tid, base, full, empty, &exit)?;

    k.b.push(Inst::Label(consumer));
    consumers(k, cfg, tid, wg, base, full, empty, &exit)?;

    k.b.push(Inst::Label(exit));
    k.b.push(Inst::Ret);

    kb.entry_text(&entry)
}

/// The producer (a warpgroup, or a warp after the consumers: [`WsConfig::producer_warp`]):
/// registers down with two consumers behind a producer warpgroup, then its first warp scans the tiles and its first thread
/// ([`WsConfig::producer_tid`]) keeps the ring full.
fn producer(
    k: &mut K,
    cfg: &WsConfig,
    tid: Reg,
    base: Reg,
    full: Reg,
    empty: Reg,
    exit: &str,
) -> Result<()> {
    if cfg.reallocates_registers() {
        k.b.emit(AsyncOp::SetMaxNReg {
            delta: RegDelta::Dec,
            count: MaxNReg::new(PRODUCER_REGS)?,
        })?;
    }
    // One thread issues every TMA load, the block scales' included.
    let block = cfg.scaling == Scaling::Block128;
    let first = i64::from(cfg.producer_tid());
    let leader = k.setp(CmpOp::Eq, tid, Operand::Int(first));
    // The producer's first warp stays (the tile scan takes a whole warp); the rest of a producer
    // warpgroup leaves.
    if !cfg.producer_warp() {
        let idle = k.setp(CmpOp::Ge, tid, Operand::Int(32));
        k.bra(exit, Some((idle, false)));
    }
    let tmap_x = k.b.tensor_map_addr(PARAMS[0])?;
    let tmap_w = k.b.tensor_map_addr(PARAMS[1])?;
    k.b.emit_guarded(
        Guard::when(leader),
        AsyncOp::PrefetchTensorMap { tmap: tmap_x },
    )?;
    k.b.emit_guarded(
        Guard::when(leader),
        AsyncOp::PrefetchTensorMap { tmap: tmap_w },
    )?;
    let s = scan_state(k);
    let scales = if block {
        let xs = k.b.tensor_map_addr(PARAMS[10])?;
        let ws = k.b.tensor_map_addr(PARAMS[11])?;
        for tmap in [xs, ws] {
            k.b.emit_guarded(Guard::when(leader), AsyncOp::PrefetchTensorMap { tmap })?;
        }
        let tokens = k.reg32();
        k.b.push(Inst::LdParam {
            ty: PtxTy::U32,
            d: tokens,
            name: PARAMS[7].into(),
        });
        Some((xs, ws, tokens))
    } else {
        None
    };
    // 4-bit weights and group-wise int8: their group scales' map (`tmap_ws`).
    let group_scales = if cfg.scale_group().is_some() {
        let gs = k.b.tensor_map_addr(PARAMS[11])?;
        k.b.emit_guarded(Guard::when(leader), AsyncOp::PrefetchTensorMap { tmap: gs })?;
        Some(gs)
    } else {
        None
    };
    let grid = k.special(SpecialReg::NctaidX);
    let stage = k.imm(0);
    let phase = k.imm(0);
    let tile_loop = k.b.label("p_tile");
    k.b.push(Inst::Label(tile_loop.clone()));
    let f = scan(k, cfg, &s, exit);
    let (w_dim, w_rows) = w_row_coords(k, cfg, f.w0, s.expert)?;
    let kt = k.reg32();
    k.mov(kt, Operand::Reg(f.ks));
    let kloop = k.b.label("p_k");
    k.b.push(Inst::Label(kloop.clone()));
    let (a, fbar) = k.stage_addrs(stage, cfg.stage_bytes(), base, full);
    let ebar = k.bin(BinOpcode::Shl, PtxTy::B32, stage, Operand::Int(3));
    k.bin_to(ebar, BinOpcode::Add, PtxTy::U32, ebar, Operand::Reg(empty));
    let wait_parity = k.bin(BinOpcode::Xor, PtxTy::B32, phase, Operand::Int(1));
    k.b.mbarrier_wait(ebar, Operand::Reg(wait_parity))?;
    k.b.emit_guarded(
        Guard::when(leader),
        AsyncOp::MbarrierArriveExpectTx {
            bar: fbar,
            tx_bytes: Operand::Int((cfg.tx_bytes() + cfg.scale_tx_bytes()).into()),
        },
    )?;
    let b = k.bin(
        BinOpcode::Add,
        PtxTy::U32,
        a,
        Operand::Int(cfg.a_stage_bytes().into()),
    );
    let k0 = k.bin(
        BinOpcode::MulLo,
        PtxTy::U32,
        kt,
        Operand::Int(cfg.operands.bk().into()),
    );
    let (x_dst, w_dst) = if cfg.swap_ab { (b, a) } else { (a, b) };
    k.b.emit_guarded(
        Guard::when(leader),
        AsyncOp::TmaLoad(TmaLoad {
            dim: TmaDim::D2,
            dst: x_dst,
            tmap: tmap_x,
            coords: vec![k0, f.tok0],
            bar: fbar,
            cache_hint: None,
        }),
    )?;
    // The weights' first coordinate is in bytes of codes: half of K for 4-bit codes.
    let w_k0 = match cfg.operands {
        Operands::W4Bf16(_) => k.bin(BinOpcode::Shr, PtxTy::U32, k0, Operand::Int(1)),
        _ => k0,
    };
    k.b.emit_guarded(
        Guard::when(leader),
        AsyncOp::TmaLoad(TmaLoad {
            dim: w_dim,
            dst: w_dst,
            tmap: tmap_w,
            coords: std::iter::once(w_k0)
                .chain(w_rows.iter().copied())
                .collect(),
            bar: fbar,
            cache_hint: None,
        }),
    )?;
    if let Some((xs, ws, tokens)) = scales {
        load_block_scales(k, cfg, leader, a, fbar, &s, &f, kt, xs, ws, tokens)?;
    }
    if let (Some(group), Some(gs)) = (cfg.scale_group(), group_scales) {
        // The k-tile's scales of the tile's weight rows: `[E, scale tiles, N]` of
        // `scale_tile_bytes` each (group-wise int8: one f32), box {64 C rows, 1, 1} at {w0, scale
        // tile, expert}, after A and B.
        let bk = cfg.operands.bk();
        let g0 = if group > bk {
            k.bin(
                BinOpcode::Shr,
                PtxTy::U32,
                kt,
                Operand::Int(log2(group / bk)),
            )
        } else {
            kt
        };
        let dst = k.bin(
            BinOpcode::Add,
            PtxTy::U32,
            a,
            Operand::Int(cfg.tx_bytes().into()),
        );
        k.b.emit_guarded(
            Guard::when(leader),
            AsyncOp::TmaLoad(TmaLoad {
                dim: TmaDim::D3,
                dst,
                tmap: gs,
                coords: vec![f.w0, g0, s.expert],
                bar: fbar,
                cache_hint: None,
            }),
        )?;
    }
    let more = k.next_ktile(stage, phase, cfg.stages, kt, Operand::Reg(f.ke));
    k.bra(&kloop, Some((more, false)));
    next_tile(k, &s, grid, &tile_loop);
    Ok(())
}

/// The weight map's dimension and the TMA coordinates after K of the tile whose first weight row
/// is `w0` in `expert` ([`WRows::coords`], the host twin): `{w0, expert}` for the compact operand;
/// for the recipe's row modes, 0 inside the box, `(w0 / P_i) mod n_i` past it (the last mode
/// unreduced, plus `expert * n_last` when the expert is folded into it), then the expert. Once a
/// tile, before its k-loop.
fn w_row_coords(k: &mut K, cfg: &WsConfig, w0: Reg, expert: Reg) -> Result<(TmaDim, Vec<Reg>)> {
    let wr = cfg.w_rows;
    let dim = match wr.rank() {
        3 => TmaDim::D3,
        4 => TmaDim::D4,
        5 => TmaDim::D5,
        r => return Err(unsupported(format!("a rank-{r} weight map"))),
    };
    if wr == WRows::PLAIN {
        return Ok((dim, vec![w0, expert]));
    }
    let rows = cfg.tile_weights();
    let Some((j, _)) = wr.split(cfg.n, rows) else {
        return Err(unsupported(format!(
            "a tile of {rows} weight rows is not a box of the row modes {:?}",
            wr.extents(cfg.n)
        )));
    };
    let ext = wr.extents(cfg.n);
    let last = ext.len() - 1;
    let mut coords = Vec::with_capacity(ext.len() + 1);
    let mut p = 1u32;
    for (i, &x) in ext.iter().enumerate() {
        let c = if i < j {
            k.imm(0)
        } else {
            let q = if p == 1 {
                let r = k.reg32();
                k.mov(r, Operand::Reg(w0));
                r
            } else if p.is_power_of_two() {
                k.bin(BinOpcode::Shr, PtxTy::U32, w0, Operand::Int(log2(p)))
            } else {
                k.bin(BinOpcode::Div, PtxTy::U32, w0, Operand::Int(p.into()))
            };
            if i < last {
                if x.is_power_of_two() {
                    k.bin_to(
                        q,
                        BinOpcode::And,
                        PtxTy::B32,
                        q,
                        Operand::Int((x - 1).into()),
                    );
                } else {
                    k.bin_to(q, BinOpcode::Rem, PtxTy::U32, q, Operand::Int(x.into()));
                }
            } else if wr.folded {
                let base = k.bin(BinOpcode::MulLo, PtxTy::U32, expert, Operand::Int(x.into()));
                k.bin_to(q, BinOpcode::Add, PtxTy::U32, q, Operand::Reg(base));
            }
            q
        };
        coords.push(c);
        p = p.saturating_mul(x);
    }
    if !wr.folded {
        coords.push(expert);
    }
    Ok((dim, coords))
}

/// The producer's TMA loads of k-tile `kt`'s block scales into the stage at `a` (after A and B),
/// on the stage's full barrier: the weight scale `s_w[e, blk, kt]` of each block the tile's rows
/// take (in one [`BLOCK_SCALE_W_BOX`] box each, from its index rounded down to 4, 128 bytes apart;
/// [`WsConfig::w_scale_boxes`], [`w_scale_index`]: one box for a tile inside one block, two for a
/// 192-row prefill tile and for paired rows, their gate rows' block and their up rows'); then the
/// activation scales of the tile's token rows, `s_x[kt, tok0 ..]` (group-major `[KB, T]`, flat;
/// the box from that index rounded down to 4, [`BLOCK_SCALE_PAD`] longer), at
/// [`WsConfig::block_x_at`]. Token rows past the expert's end read the
/// next expert's scales and rows past the buffer read zeros (TMA's out-of-bounds fill): their
/// results are never stored.
#[allow(clippy::too_many_arguments)]
fn load_block_scales(
    k: &mut K,
    cfg: &WsConfig,
    leader: Reg,
    a: Reg,
    fbar: Reg,
    s: &Scan,
    f: &Found,
    kt: Reg,
    xs: Reg,
    ws: Reg,
    tokens: Reg,
) -> Result<()> {
    let area = k.bin(
        BinOpcode::Add,
        PtxTy::U32,
        a,
        Operand::Int(cfg.tx_bytes().into()),
    );
    for b in 0..cfg.w_scale_boxes() {
        // Box b holds the scale of the tile's b-th block ([`w_scale_index`]); a 192-row tile's
        // second block past N reads the next expert's scale or TMA's zero fill, for columns that
        // are never stored.
        let ib = w_scale_index(k, cfg, s.expert, f.w0, kt, b);
        // Boxes start on 16 bytes: the consumers add the remainder (`stage_scales`).
        k.bin_to(ib, BinOpcode::And, PtxTy::B32, ib, Operand::Int(-4));
        let dst = k.bin(
            BinOpcode::Add,
            PtxTy::U32,
            area,
            Operand::Int(i64::from(b * BLOCK_SCALE_X_AT)),
        );
        load_1d(k, leader, (dst, ws, ib), fbar)?;
    }
    let x = x_scale_index(k, kt, tokens, f.tok0);
    k.bin_to(x, BinOpcode::And, PtxTy::B32, x, Operand::Int(-4));
    let dst = k.bin(
        BinOpcode::Add,
        PtxTy::U32,
        area,
        Operand::Int(cfg.block_x_at().into()),
    );
    load_1d(k, leader, (dst, xs, x), fbar)
}

/// The leader's 1-D TMA load of the box at element `coord` of the map `tmap` into `dst`, completing
/// on the barrier `bar`.
fn load_1d(k: &mut K, leader: Reg, (dst, tmap, coord): (Reg, Reg, Reg), bar: Reg) -> Result<()> {
    k.b.emit_guarded(
        Guard::when(leader),
        AsyncOp::TmaLoad(TmaLoad {
            dim: TmaDim::D1,
            dst,
            tmap,
            coords: vec![coord],
            bar,
            cache_hint: None,
        }),
    )
}

/// The flat index of k-tile `kt`'s weight scale for box `b` of the tile starting at weight row
/// `w0`, in `s_w [E, ceil(N/128), KT]`: `(expert * NB + blk) * KT + kt` (what the producer's box
/// starts at, rounded down to 4, and the consumers' skew within it). `blk` is `w0 / 128 + b`; with
/// paired rows ([`WsConfig::paired_blocks`]) the block of the tile's first (`b = 0`) or second
/// half of each 16 rows: `(w0 / 2 + I) / 128` for the up rows, `(w0 / 2) / 128` for the gate rows
/// (`I = N / 2`; [`paired_row`]: up rows first with `up_first`).
fn w_scale_index(k: &mut K, cfg: &WsConfig, expert: Reg, w0: Reg, kt: Reg, b: u32) -> Reg {
    let nb = cfg.n.div_ceil(128);
    let i = k.bin(
        BinOpcode::MulLo,
        PtxTy::U32,
        expert,
        Operand::Int(i64::from(nb)),
    );
    let blk = if cfg.paired_blocks() {
        let row = k.bin(BinOpcode::Shr, PtxTy::U32, w0, Operand::Int(1));
        if (b == 1) != cfg.w_rows.up_first {
            k.bin_to(
                row,
                BinOpcode::Add,
                PtxTy::U32,
                row,
                Operand::Int(i64::from(cfg.n / 2)),
            );
        }
        k.bin_to(row, BinOpcode::Shr, PtxTy::U32, row, Operand::Int(7));
        row
    } else {
        let blk = k.bin(BinOpcode::Shr, PtxTy::U32, w0, Operand::Int(7));
        if b > 0 {
            k.bin_to(
                blk,
                BinOpcode::Add,
                PtxTy::U32,
                blk,
                Operand::Int(i64::from(b)),
            );
        }
        blk
    };
    k.bin_to(i, BinOpcode::Add, PtxTy::U32, i, Operand::Reg(blk));
    k.bin_to(
        i,
        BinOpcode::MulLo,
        PtxTy::U32,
        i,
        Operand::Int(i64::from(cfg.k_tiles())),
    );
    k.bin_to(i, BinOpcode::Add, PtxTy::U32, i, Operand::Reg(kt));
    i
}

/// The flat index of the tile's first activation scale of k-tile `kt` in the group-major `s_x [KB,
/// T]`: `kt * T + tok0`.
fn x_scale_index(k: &mut K, kt: Reg, tokens: Reg, tok0: Reg) -> Reg {
    let x = k.bin(BinOpcode::MulLo, PtxTy::U32, kt, Operand::Reg(tokens));
    k.bin_to(x, BinOpcode::Add, PtxTy::U32, x, Operand::Reg(tok0));
    x
}

/// Per-thread epilogue coordinates: the fragment's row (A side) and column (B side) bases.
struct Frag {
    /// A-side row of `f[4j + 0/1]` within the tile (add 8 for `f[4j + 2/3]`).
    a_row: Reg,
    /// B-side column of `f[4j]` within the tile, less `8j`.
    b_col: Reg,
}

/// The consumer warpgroups: registers up, then the tiles' MMAs and epilogues.
#[allow(clippy::too_many_arguments)]
fn consumers(
    k: &mut K,
    cfg: &WsConfig,
    tid: Reg,
    wg: Reg,
    base: Reg,
    full: Reg,
    empty: Reg,
    exit: &str,
) -> Result<()> {
    if cfg.reallocates_registers() {
        k.b.emit(AsyncOp::SetMaxNReg {
            delta: RegDelta::Inc,
            count: MaxNReg::new(CONSUMER_REGS)?,
        })?;
    }
    // The consumer's index: warpgroups 0.. when the producer is a warp after them, else 1...
    let first_wg = if cfg.producer_warp() { 0 } else { 1 };
    let cwg = k.bin(BinOpcode::Sub, PtxTy::U32, wg, Operand::Int(first_wg));
    let lane = k.bin(BinOpcode::And, PtxTy::B32, tid, Operand::Int(31));
    let warp = k.bin(BinOpcode::Shr, PtxTy::U32, tid, Operand::Int(5));
    k.bin_to(warp, BinOpcode::And, PtxTy::B32, warp, Operand::Int(3));
    let lane0 = k.setp(CmpOp::Eq, lane, Operand::Int(0));
    // Fragment coordinates (GEMM.md §1.6): row 16 w + l / 4 (+ 64 c), column 2 (l % 4).
    let a_row = k.bin(BinOpcode::Shl, PtxTy::B32, warp, Operand::Int(4));
    let quad = k.bin(BinOpcode::Shr, PtxTy::U32, lane, Operand::Int(2));
    k.bin_to(a_row, BinOpcode::Add, PtxTy::U32, a_row, Operand::Reg(quad));
    let c64 = k.bin(BinOpcode::Shl, PtxTy::B32, cwg, Operand::Int(6));
    k.bin_to(a_row, BinOpcode::Add, PtxTy::U32, a_row, Operand::Reg(c64));
    let b_col = k.bin(BinOpcode::And, PtxTy::B32, lane, Operand::Int(3));
    k.bin_to(b_col, BinOpcode::Shl, PtxTy::B32, b_col, Operand::Int(1));
    let frag = Frag { a_row, b_col };
    // This consumer's A rows start 64 c rows into the stage.
    let a_off = k.bin(
        BinOpcode::Shl,
        PtxTy::B32,
        cwg,
        Operand::Int(i64::from((64 * cfg.a_row_bytes()).trailing_zeros())),
    );
    let rega = match cfg.operands {
        Operands::I8Bf16 => Some(super::dequant::RegA::I8(super::dequant::i8_frag(
            k,
            warp,
            lane,
            cfg.a_row_bytes(),
        ))),
        Operands::W4Bf16(w) => Some(super::dequant::RegA::W4(super::dequant::w4_frag(
            k,
            w,
            warp,
            lane,
            (cwg, cfg.tile_weights()),
        ))),
        _ => None,
    };

    let s = scan_state(k);
    let grid = k.special(SpecialReg::NctaidX);
    let y = k.global_param(PARAMS[2]);
    let (x_scale, w_scale) = match cfg.scaling {
        Scaling::None => (None, None),
        _ => (
            Some(k.global_param(PARAMS[4])),
            Some(k.global_param(PARAMS[5])),
        ),
    };
    let tokens = k.reg32();
    k.b.push(Inst::LdParam {
        ty: PtxTy::U32,
        d: tokens,
        name: PARAMS[7].into(),
    });
    let stage = k.imm(0);
    let phase = k.imm(0);
    let prev = k.imm(0);
    let n_mma = WgmmaN::new(cfg.bn)?;
    let acc = k.b.accumulator(n_mma);
    let block = cfg.scaling == Scaling::Block128;
    let row_group = cfg.scaling.row_group();
    // Block-scaled: the first slice accumulator (the second is made with the k loop); group-wise
    // int8: the group's partial sum.
    let part = if block || row_group.is_some() {
        k.b.accumulator(n_mma)
    } else {
        Vec::new()
    };
    let desc_hi = k.imm(DESC_HI);
    let always = k.setp(CmpOp::Eq, tid, Operand::Reg(tid));

    let tile_loop = k.b.label("c_tile");
    k.b.push(Inst::Label(tile_loop.clone()));
    let f = scan(k, cfg, &s, exit);
    let kt = k.reg32();
    let ring = Ring {
        stage,
        phase,
        prev,
        base,
        full,
        empty,
        a_off,
        desc_hi,
        always,
        lane0,
        rega,
    };
    let k_end = Operand::Reg(f.ke);
    let past_epilogue = k.b.label("c_past_epilogue");
    if skips_idle_rows(cfg) {
        // A consumer whose 64 token rows all lie past the expert's end (the last token tile of an
        // expert that fills at most its first half) issues no MMAs and stores nothing: it waits
        // for each stage and frees it at once (so the ring's counts stay as they are), then
        // skips the epilogue (every row is past the end; a counted E4M3 output's arrival still
        // takes both consumers). The other consumer's MMAs have the tensor cores alone.
        let first = k.bin(BinOpcode::Add, PtxTy::U32, f.tok0, Operand::Reg(c64));
        let past = k.setp(CmpOp::Ge, first, Operand::Reg(s.hi));
        // (The same for the whole warpgroup; through a vote, so that ptxas sees it warp-uniform
        // and keeps the k loop's stage, phase and descriptors on the uniform datapath: a plain
        // branch on it moved them to vector registers, and the GEMM was 17-40% slower on the
        // H100, run 95.)
        let idle = k.b.reg(RegClass::Pred);
        k.b.push(Inst::VoteAny { d: idle, p: past });
        let busy = k.b.label("c_busy");
        k.bra(&busy, Some((idle, true)));
        k.mov(kt, Operand::Reg(f.ks));
        let idle_loop = k.b.label("c_idle");
        k.b.push(Inst::Label(idle_loop.clone()));
        let (_, fbar) = k.stage_addrs(stage, cfg.stage_bytes(), base, full);
        k.b.mbarrier_wait(fbar, Operand::Reg(phase))?;
        k.mov(prev, Operand::Reg(stage));
        release(k, &ring, None)?;
        let more = k.next_ktile(stage, phase, cfg.stages, kt, k_end);
        k.bra(&idle_loop, Some((more, false)));
        k.bra(&past_epilogue, None);
        k.b.push(Inst::Label(busy));
    }
    if block || row_group.is_some() {
        zero_total(k, &acc);
    }
    // The epilogue's scales, loaded before the k loop where they are few (`EARLY_LOADS`).
    let early = (epilogue_load_count(cfg) <= EARLY_LOADS)
        .then(|| epilogue_loads(k, cfg, &frag, &f, &s, x_scale, w_scale));
    k.mov(kt, Operand::Reg(f.ks));
    let kloop = k.b.label("c_k");
    k.b.push(Inst::Label(kloop.clone()));
    match (x_scale, w_scale) {
        (Some(_), Some(_)) if block && cfg.consumers >= 2 && !cfg.two_slices => {
            // Two consumers: one slice accumulator (the total and the slice stay within the 168
            // registers that the driver's JIT gives a thread of a 384-thread CTA); the two
            // warpgroups' promotions and MMAs interleave on the tensor core.
            issue_ktile(k, cfg, &ring, n_mma, &part, None)?;
            k.b.emit(AsyncOp::WgmmaWaitGroup(0))?;
            k.mov(prev, Operand::Reg(stage));
            let skew = Skew {
                s: &s,
                f: &f,
                tokens,
            };
            let sc = stage_scales(k, cfg, &frag, &ring, &skew, kt)?;
            release(k, &ring, None)?;
            promote(k, cfg, &sc, &part, &acc);
            let more = k.next_ktile(stage, phase, cfg.stages, kt, k_end);
            k.bra(&kloop, Some((more, false)));
        }
        (Some(_), Some(_)) if block => {
            // One consumer, or two with `two_slices`: two slice accumulators, so that the MMAs
            // of k-tile i run while slice i - 1 is promoted with its scales, which the producer
            // copied into its stage.
            let part_b = k.b.accumulator(n_mma);
            let skew = Skew {
                s: &s,
                f: &f,
                tokens,
            };
            let promote_at = |k: &mut K, from: &[Reg]| -> Result<()> {
                let done = k.bin(BinOpcode::Sub, PtxTy::U32, kt, Operand::Int(1));
                let sc = stage_scales(k, cfg, &frag, &ring, &skew, done)?;
                release(k, &ring, None)?;
                promote(k, cfg, &sc, from, &acc);
                Ok(())
            };
            // Even k-tile into `part`.
            issue_ktile(k, cfg, &ring, n_mma, &part, None)?;
            k.b.emit(AsyncOp::WgmmaWaitGroup(1))?;
            let skip = k.b.label("c_first");
            let first = k.setp(CmpOp::Eq, kt, Operand::Reg(f.ks));
            k.bra(&skip, Some((first, false)));
            promote_at(k, &part_b)?;
            k.b.push(Inst::Label(skip));
            k.mov(prev, Operand::Reg(stage));
            let tail_a = k.b.label("c_tail_a");
            let more = k.next_ktile(stage, phase, cfg.stages, kt, k_end);
            k.bra(&tail_a, Some((more, true)));
            // Odd k-tile into `part_b`.
            issue_ktile(k, cfg, &ring, n_mma, &part_b, None)?;
            k.b.emit(AsyncOp::WgmmaWaitGroup(1))?;
            promote_at(k, &part)?;
            k.mov(prev, Operand::Reg(stage));
            let more = k.next_ktile(stage, phase, cfg.stages, kt, k_end);
            k.bra(&kloop, Some((more, false)));
            // The last slice was odd (in `part_b`) or even (in `part`).
            let epi = k.b.label("c_epi");
            k.b.emit(AsyncOp::WgmmaWaitGroup(0))?;
            promote_at(k, &part_b)?;
            k.bra(&epi, None);
            k.b.push(Inst::Label(tail_a));
            k.b.emit(AsyncOp::WgmmaWaitGroup(0))?;
            promote_at(k, &part)?;
            k.b.push(Inst::Label(epi));
        }
        _ if row_group.is_some() => {
            let group = row_group.unwrap_or(64);
            promote_row_groups(k, cfg, &ring, (n_mma, group), &f, kt, (&frag, &part, &acc))?;
            let not_first = k.setp(CmpOp::Ne, kt, Operand::Reg(f.ks));
            let rel = k.bin(BinOpcode::And, PtxTy::Pred, not_first, Operand::Reg(lane0));
            release(k, &ring, Some(rel))?;
            k.mov(prev, Operand::Reg(stage));
            let more = k.next_ktile(stage, phase, cfg.stages, kt, k_end);
            k.bra(&kloop, Some((more, false)));
            release(k, &ring, None)?;
        }
        _ => {
            // The first MMA of a tile overwrites; one MMA group stays in flight, and the previous
            // k-tile's stage is free once it completes.
            let accumulate = k.setp(CmpOp::Ne, kt, Operand::Reg(f.ks));
            issue_ktile(k, cfg, &ring, n_mma, &acc, Some(accumulate))?;
            // Register-sourced A: the next k-tile rewrites the A registers, so its MMAs must
            // have read them (wait for all); else one group stays in flight. (A form that
            // converted k-tile i + 1 while k-tile i's MMAs ran, two A register sets, was 1-4%
            // faster at 1 and 128 tokens and 3-6% slower at 16 on the H200, run 57: not kept.)
            let in_flight = if ring.rega.is_some() { 0 } else { 1 };
            k.b.emit(AsyncOp::WgmmaWaitGroup(in_flight))?;
            let not_first = k.setp(CmpOp::Ne, kt, Operand::Reg(f.ks));
            let rel = k.bin(BinOpcode::And, PtxTy::Pred, not_first, Operand::Reg(lane0));
            release(k, &ring, Some(rel))?;
            k.mov(prev, Operand::Reg(stage));
            let more = k.next_ktile(stage, phase, cfg.stages, kt, k_end);
            k.bra(&kloop, Some((more, false)));
            k.b.emit(AsyncOp::WgmmaWaitGroup(0))?;
            release(k, &ring, None)?;
        }
    }
    let done = k.b.label("c_next");
    if cfg.split_k > 1 {
        split_reduce(k, cfg, tid, &f, &acc, always, &done)?;
    }
    let loads = match early {
        Some(l) => l,
        None => epilogue_loads(k, cfg, &frag, &f, &s, x_scale, w_scale),
    };
    epilogue(k, cfg, (&frag, &f, &s), y, loads, &acc)?;
    k.b.push(Inst::Label(past_epilogue));
    if let (Some(q), Some(key)) = (cfg.epilogue.quant(), f.token_key) {
        let ctid = k.consumer_tid(cfg.producer_warp(), tid);
        let tile = super::finish::Tile {
            ctid,
            tok0: f.tok0,
            hi: s.hi,
            key,
            tokens,
            a: y,
        };
        super::finish::finish(k, cfg, q, &tile, &done)?;
    }
    k.b.push(Inst::Label(done));
    next_tile(k, &s, grid, &tile_loop);
    Ok(())
}

/// Split-K: store this split's partial accumulator to its workspace slot (slot-major, so each
/// store is coalesced), count the tile's arrivals (acquire-release at GPU scope); every CTA but
/// the last of the tile's splits goes to `skip`; the last (which resets the counter for the next
/// launch) sums the `S` partials in split order 0, 1, ... (the same bits whichever CTA is last)
/// into `acc` for the epilogue.
fn split_reduce(
    k: &mut K,
    cfg: &WsConfig,
    tid: Reg,
    f: &Found,
    acc: &[Reg],
    always: Reg,
    skip: &str,
) -> Result<()> {
    let nthreads = 128 * cfg.consumers;
    let p = i64::from(cfg.partial_elems());
    let sk = i64::from(cfg.split_k);
    let workspace = k.global_param(PARAMS[8]);
    let counters = k.global_param(PARAMS[9]);
    let ctid = k.consumer_tid(cfg.producer_warp(), tid);
    // The slot of (tile, split): ((tile_key * S + split) * P + ctid) * 4.
    let slot_of = |k: &mut K, split: Operand| -> Reg {
        let i = k.bin(BinOpcode::MulLo, PtxTy::U32, f.tile_key, Operand::Int(sk));
        k.bin_to(i, BinOpcode::Add, PtxTy::U32, i, split);
        let slot = k.addr(workspace, i, 4 * p);
        k.addr(slot, ctid, 4)
    };
    let mine = slot_of(k, Operand::Reg(f.split));
    let stride = 4 * i64::from(nthreads);
    for (i, &v) in acc.iter().enumerate() {
        k.b.push(Inst::StGuarded {
            pred: always,
            negate: false,
            ty: PtxTy::F32,
            addr: mine,
            off: i as i64 * stride,
            v,
        });
    }
    // Thread 0 of the consumers counts the arrival; all but the tile's last split go to `skip`.
    k.last_arrival(
        ctid,
        |k| k.addr(counters, f.tile_key, 4),
        sk,
        (nthreads, "split_last", "c_counted"),
        skip,
    )?;
    for sp in 0..sk {
        let slot = slot_of(k, Operand::Int(sp));
        for (i, &a) in acc.iter().enumerate() {
            let off = i as i64 * stride;
            if sp == 0 {
                k.b.push(Inst::LdGlobalCgF32 {
                    d: a,
                    addr: slot,
                    off,
                });
            } else {
                let v = k.b.reg(RegClass::F32);
                k.b.push(Inst::LdGlobalCgF32 {
                    d: v,
                    addr: slot,
                    off,
                });
                k.b.push(Inst::Bin {
                    op: BinOpcode::AddRn,
                    ty: PtxTy::F32,
                    d: a,
                    a: Operand::Reg(a),
                    b: Operand::Reg(v),
                });
            }
        }
    }
    Ok(())
}

/// The consumer's pipeline registers.
struct Ring {
    stage: Reg,
    phase: Reg,
    prev: Reg,
    base: Reg,
    full: Reg,
    empty: Reg,
    a_off: Reg,
    desc_hi: Reg,
    always: Reg,
    lane0: Reg,
    /// Int8 or 4-bit weights: the per-thread constants of their register-A fragments.
    rega: Option<super::dequant::RegA>,
}

/// Wait for the current stage, then its four MMAs into `d` (`scale-d` from `accumulate` on the
/// first, 0 where `None`), committed as one group.
fn issue_ktile(
    k: &mut K,
    cfg: &WsConfig,
    r: &Ring,
    n_mma: WgmmaN,
    d: &[Reg],
    accumulate: Option<Reg>,
) -> Result<()> {
    let (sa, fbar) = k.stage_addrs(r.stage, cfg.stage_bytes(), r.base, r.full);
    k.b.mbarrier_wait(fbar, Operand::Reg(r.phase))?;
    let a_addr = k.bin(BinOpcode::Add, PtxTy::U32, sa, Operand::Reg(r.a_off));
    let a_lo = k.bin(BinOpcode::Shr, PtxTy::U32, a_addr, Operand::Int(4));
    k.bin_to(
        a_lo,
        BinOpcode::Or,
        PtxTy::B32,
        a_lo,
        Operand::Int(DESC_LBO),
    );
    let b_lo = k.bin(BinOpcode::Shr, PtxTy::U32, sa, Operand::Int(4));
    k.bin_to(
        b_lo,
        BinOpcode::Add,
        PtxTy::U32,
        b_lo,
        Operand::Int(i64::from(cfg.a_stage_bytes() >> 4)),
    );
    k.bin_to(
        b_lo,
        BinOpcode::Or,
        PtxTy::B32,
        b_lo,
        Operand::Int(DESC_LBO),
    );
    // Int8 weights: the four steps' A fragments, from the stage into registers, before the fence
    // (the previous k-tile's MMAs, which read these registers, were waited for).
    let a_regs: Option<Vec<[Reg; 4]>> = match r.rega.as_ref() {
        Some(fr) => {
            let scales = k.bin(
                BinOpcode::Add,
                PtxTy::U32,
                sa,
                Operand::Int(cfg.tx_bytes().into()),
            );
            Some(super::dequant::ktile_a_regs(
                k,
                fr,
                a_addr,
                scales,
                cfg.a_row_bytes(),
            ))
        }
        None => None,
    };
    let mut descs = Vec::with_capacity(4);
    for step in 0..4i64 {
        let mut pair = [a_lo, b_lo];
        for lo in pair.iter_mut() {
            let l = k.bin(BinOpcode::Add, PtxTy::U32, *lo, Operand::Int(2 * step));
            let dd = k.b.reg(RegClass::B64);
            k.b.emit(AsyncOp::PackB64 {
                d: dd,
                lo: l,
                hi: r.desc_hi,
            })?;
            *lo = dd;
        }
        descs.push(pair);
    }
    k.b.emit(AsyncOp::WgmmaFence)?;
    for (step, [da, db]) in descs.into_iter().enumerate() {
        let scale_d = match (step, accumulate) {
            (0, Some(p)) => ScaleD::Pred(p),
            (0, None) => ScaleD::Imm(false),
            _ => ScaleD::Pred(r.always),
        };
        let mma = match &a_regs {
            Some(a) => Wgmma::rs(
                n_mma,
                cfg.operands.wgmma(),
                d.to_vec(),
                a[step],
                db,
                scale_d,
            ),
            None => Wgmma::ss(n_mma, cfg.operands.wgmma(), d.to_vec(), da, db, scale_d),
        };
        k.b.emit(AsyncOp::Wgmma(mma))?;
    }
    k.b.emit(AsyncOp::WgmmaCommitGroup)
}

/// One arrival per consumer warp on the empty barrier of stage `prev` (under `guard`, else lane 0).
/// With block scales every lane has read the stage with `ld.shared`: a warp barrier first orders
/// those reads before lane 0's release (an arrival releases only its own thread's accesses).
fn release(k: &mut K, r: &Ring, guard: Option<Reg>) -> Result<()> {
    if guard.is_none() {
        k.b.push(Inst::BarWarpSync);
    }
    let ebar = k.bin(BinOpcode::Shl, PtxTy::B32, r.prev, Operand::Int(3));
    k.bin_to(
        ebar,
        BinOpcode::Add,
        PtxTy::U32,
        ebar,
        Operand::Reg(r.empty),
    );
    k.b.emit_guarded(
        Guard::when(guard.unwrap_or(r.lane0)),
        AsyncOp::MbarrierArrive { bar: ebar },
    )
}

fn ld_f32(k: &mut K, base: Reg, index: Reg) -> Reg {
    let addr = k.addr(base, index, 4);
    let d = k.b.reg(RegClass::F32);
    k.b.push(Inst::Ld {
        ty: PtxTy::F32,
        d,
        addr,
    });
    d
}

fn fmul(k: &mut K, a: Reg, b: Reg) -> Reg {
    k.fmul_rn(a, Operand::Reg(b))
}

/// `min(v, hi - 1)`: a token index that is safe to read scales at (rows past the expert's end are
/// computed but never stored).
fn clamp_token(k: &mut K, v: Reg, hi: Reg) -> Reg {
    let last = k.bin(BinOpcode::Sub, PtxTy::U32, hi, Operand::Int(1));
    k.bin(BinOpcode::Min, PtxTy::U32, v, Operand::Reg(last))
}

/// The token of each fragment slot class: prefill `[row h]` (h = 0, 1); decode `[column 8j + c]`.
fn frag_tokens(k: &mut K, cfg: &WsConfig, frag: &Frag, f: &Found, s: &Scan) -> Vec<Reg> {
    if cfg.swap_ab {
        let mut v = Vec::new();
        for j in 0..cfg.bn / 8 {
            for c in 0..2u32 {
                let t = k.bin(
                    BinOpcode::Add,
                    PtxTy::U32,
                    frag.b_col,
                    Operand::Int(i64::from(8 * j + c)),
                );
                k.bin_to(t, BinOpcode::Add, PtxTy::U32, t, Operand::Reg(f.tok0));
                v.push(clamp_token(k, t, s.hi));
            }
        }
        v
    } else {
        (0..2u32)
            .map(|h| {
                let t = k.bin(
                    BinOpcode::Add,
                    PtxTy::U32,
                    frag.a_row,
                    Operand::Int(i64::from(8 * h)),
                );
                k.bin_to(t, BinOpcode::Add, PtxTy::U32, t, Operand::Reg(f.tok0));
                clamp_token(k, t, s.hi)
            })
            .collect()
    }
}

/// The fragment slot `i = 4j + 2h + c` to its token class (see [`frag_tokens`]).
fn token_class(cfg: &WsConfig, i: u32) -> usize {
    let (j, h, c) = (i / 4, (i / 2) % 2, i % 2);
    if cfg.swap_ab {
        (2 * j + c) as usize
    } else {
        h as usize
    }
}

/// The weight row class of accumulator slot `i` (see [`token_class`]): its A-side half `h` in the
/// swapped form (weights on A), its B-side column `2 j + c` otherwise.
fn row_class(cfg: &WsConfig, i: u32) -> usize {
    let (j, h, c) = (i / 4, (i / 2) % 2, i % 2);
    if cfg.swap_ab {
        h as usize
    } else {
        (2 * j + c) as usize
    }
}

/// The block scales of one K slice, read from its stage.
struct BlockScales {
    /// `s_x` per token class (see [`token_class`]).
    sx: Vec<Reg>,
    /// `s_w` per weight-row class (see [`w_chunk`]): one entry for a tile inside one block; the
    /// first and second halves of each 16 rows' blocks for paired rows; the three 64-column
    /// chunks' for a 192-row tile.
    sw: Vec<Reg>,
}

/// What a consumer needs to find k-tile `kt`'s scales in the boxes the producer loaded: the tile
/// (its expert, first weight row and first token) and `T`.
struct Skew<'a> {
    s: &'a Scan,
    f: &'a Found,
    tokens: Reg,
}

/// `ld.shared` of the scales of k-tile `kt`, in stage `r.prev` (the producer's TMA boxes: the
/// weight-scale boxes first, the tile's activation scales by local token row at
/// [`WsConfig::block_x_at`]),
/// each box entered at its skew: the element index's remainder mod 4 that the producer rounded
/// down (`load_block_scales`).
fn stage_scales(
    k: &mut K,
    cfg: &WsConfig,
    frag: &Frag,
    r: &Ring,
    sk: &Skew,
    kt: Reg,
) -> Result<BlockScales> {
    let (sa, _) = k.stage_addrs(r.prev, cfg.stage_bytes(), r.base, r.full);
    let area = k.bin(
        BinOpcode::Add,
        PtxTy::U32,
        sa,
        Operand::Int(cfg.tx_bytes().into()),
    );
    // The weight scales' skews: (index & 3) elements in box b ([`w_scale_index`]).
    let boxes: Vec<Reg> = (0..cfg.w_scale_boxes())
        .map(|b| {
            let ib = w_scale_index(k, cfg, sk.s.expert, sk.f.w0, kt, b);
            k.bin_to(ib, BinOpcode::And, PtxTy::B32, ib, Operand::Int(3));
            k.bin_to(ib, BinOpcode::Shl, PtxTy::B32, ib, Operand::Int(2));
            k.bin_to(ib, BinOpcode::Add, PtxTy::U32, ib, Operand::Reg(area));
            let d = k.b.reg(RegClass::F32);
            k.b.push(Inst::LdShared {
                d,
                addr: ib,
                off: i64::from(b * BLOCK_SCALE_X_AT),
            });
            d
        })
        .collect();
    // The activation scales' skew: ((kt * T + tok0) & 3) elements.
    let xi = x_scale_index(k, kt, sk.tokens, sk.f.tok0);
    k.bin_to(xi, BinOpcode::And, PtxTy::B32, xi, Operand::Int(3));
    k.bin_to(xi, BinOpcode::Shl, PtxTy::B32, xi, Operand::Int(2));
    let area_x = k.bin(BinOpcode::Add, PtxTy::U32, area, Operand::Reg(xi));
    let area = area_x;
    // Local token rows: prefill a_row + 8h; decode b_col + 8j + c.
    let offs: Vec<(Reg, i64)> = if cfg.swap_ab {
        let b4 = k.bin(BinOpcode::Shl, PtxTy::B32, frag.b_col, Operand::Int(2));
        k.bin_to(b4, BinOpcode::Add, PtxTy::U32, b4, Operand::Reg(area));
        (0..cfg.bn / 8)
            .flat_map(|j| (0..2).map(move |c| i64::from(4 * (8 * j + c))))
            .map(|o| (b4, o))
            .collect()
    } else {
        let a4 = k.bin(BinOpcode::Shl, PtxTy::B32, frag.a_row, Operand::Int(2));
        k.bin_to(a4, BinOpcode::Add, PtxTy::U32, a4, Operand::Reg(area));
        vec![(a4, 0), (a4, 32)]
    };
    let at = i64::from(cfg.block_x_at());
    let sx = offs
        .into_iter()
        .map(|(addr, off)| {
            let d = k.b.reg(RegClass::F32);
            k.b.push(Inst::LdShared {
                d,
                addr,
                off: off + at,
            });
            d
        })
        .collect();
    // One scale per 64-column chunk of the tile ([`w_chunk`]): a 192-row tile's middle chunk
    // lies in the first block where the tile starts on a block, else in the second.
    let sw = match boxes[..] {
        // Paired rows: box 0 holds the first half of each 16 rows' block, box 1 the second's.
        _ if cfg.paired_blocks() => boxes,
        [b0, b1] => {
            let off = k.bin(BinOpcode::And, PtxTy::B32, sk.f.w0, Operand::Int(127));
            let on_block = k.setp(CmpOp::Eq, off, Operand::Int(0));
            let mid = k.selp(PtxTy::F32, Operand::Reg(b0), Operand::Reg(b1), on_block);
            vec![b0, mid, b1]
        }
        _ => boxes,
    };
    Ok(BlockScales { sx, sw })
}

/// The weight scale ([`BlockScales::sw`]) of accumulator slot `i` (`4j + 2h + c`): with paired
/// rows, the half of its 16-row group (the B-side column block `j % 2` in prefill, the A-side half
/// `h` swapped); for a prefill tile spanning two scale blocks its 64-column chunk `j / 8`; else 0.
fn w_chunk(cfg: &WsConfig, i: u32) -> usize {
    let (j, h) = (i / 4, (i / 2) % 2);
    if cfg.paired_blocks() {
        if cfg.swap_ab {
            h as usize
        } else {
            (j % 2) as usize
        }
    } else if cfg.w_scale_boxes() == 2 {
        (j / 8) as usize
    } else {
        0
    }
}

/// Group-wise int8 and FP8 ([`Scaling::PerRowGroup`], [`Scaling::Groupwise`]), k-tile `kt` of the
/// range `[f.ks, f.ke)`: its MMAs into `part` (`scale-d` 0 on the first k-tile of its group or of
/// the range), all waited for (register-sourced A must be read before it is rewritten; one partial
/// sum); after the last k-tile of a group (or of the range) the fragment's row scales of the group
/// are read from the stage's scale area (the tile's weight rows, f32; one per [`row_class`]: rows
/// `a_row`, `a_row + 8` swapped, `b_col + 8 j + c` otherwise) and promoted: `acc = part * s + acc`
/// (the total cleared at the tile's start). Warp-uniform branches only (`kt` is).
fn promote_row_groups(
    k: &mut K,
    cfg: &WsConfig,
    ring: &Ring,
    (n_mma, group): (WgmmaN, u32),
    f: &Found,
    kt: Reg,
    (frag, part, acc): (&Frag, &[Reg], &[Reg]),
) -> Result<()> {
    let bk = cfg.operands.bk();
    let kpg = i64::from((group / bk).max(1));
    // Whether k-tile `x` starts a group (`x % kpg`, as `cmp`: `Ne` for not).
    let starts_group = |k: &mut K, x: Reg, cmp: CmpOp| {
        let within = k.bin(BinOpcode::And, PtxTy::B32, x, Operand::Int(kpg - 1));
        k.setp(cmp, within, Operand::Int(0))
    };
    let later_in_group = starts_group(k, kt, CmpOp::Ne);
    let not_first = k.setp(CmpOp::Ne, kt, Operand::Reg(f.ks));
    let accumulate = k.bin(
        BinOpcode::And,
        PtxTy::Pred,
        later_in_group,
        Operand::Reg(not_first),
    );
    issue_ktile(k, cfg, ring, n_mma, part, Some(accumulate))?;
    k.b.emit(AsyncOp::WgmmaWaitGroup(0))?;
    // The group ends here: the next k-tile starts another, or the range ends.
    let next = k.bin(BinOpcode::Add, PtxTy::U32, kt, Operand::Int(1));
    let ends_group = starts_group(k, next, CmpOp::Eq);
    let ends_range = k.setp(CmpOp::Eq, next, Operand::Reg(f.ke));
    let last = k.bin(
        BinOpcode::Or,
        PtxTy::Pred,
        ends_group,
        Operand::Reg(ends_range),
    );
    let skip = k.b.label("c_group");
    k.bra(&skip, Some((last, true)));
    let (sa, _) = k.stage_addrs(ring.stage, cfg.stage_bytes(), ring.base, ring.full);
    // The scales of the fragment's weight rows, one per row class (`row_class`): the two A-side
    // rows `a_row`, `a_row + 8` in the swapped form; the B-side rows `b_col + 8 j + c` otherwise.
    let (base, offs): (Reg, Vec<i64>) = if cfg.swap_ab {
        (frag.a_row, vec![0, 8])
    } else {
        (
            frag.b_col,
            (0..i64::from(cfg.bn / 8))
                .flat_map(|j| [8 * j, 8 * j + 1])
                .collect(),
        )
    };
    let row4 = k.bin(BinOpcode::Shl, PtxTy::B32, base, Operand::Int(2));
    let at = k.bin(BinOpcode::Add, PtxTy::U32, sa, Operand::Reg(row4));
    let sc: Vec<Reg> = offs
        .iter()
        .map(|&o| {
            let d = k.b.reg(RegClass::F32);
            k.b.push(Inst::LdShared {
                d,
                addr: at,
                off: i64::from(cfg.tx_bytes()) + 4 * o,
            });
            d
        })
        .collect();
    accumulate_scaled(k, part, acc, |_, i| sc[row_class(cfg, i as u32)]);
    k.b.push(Inst::Label(skip));
    Ok(())
}

/// Block-scaled promotion of a K slice (its scales in `sc`): `acc = part * s_x * s_w + acc` (the
/// total cleared at the tile's start).
fn promote(k: &mut K, cfg: &WsConfig, sc: &BlockScales, part: &[Reg], acc: &[Reg]) {
    let mut factor = std::collections::HashMap::new();
    accumulate_scaled(k, part, acc, |k, i| {
        let tc = token_class(cfg, i as u32);
        let wc = w_chunk(cfg, i as u32);
        *factor
            .entry((tc, wc))
            .or_insert_with(|| fmul(k, sc.sx[tc], sc.sw[wc]))
    });
}

/// `acc[i] = part[i] * factor(i) + acc[i]` for every slot: a promotion of a partial sum into the
/// f32 total (which [`zero_total`] cleared at the tile's start, so the first promotion assigns, as
/// `fma(p, f, +0)` is `p * f` rounded once).
fn accumulate_scaled(
    k: &mut K,
    part: &[Reg],
    acc: &[Reg],
    mut factor: impl FnMut(&mut K, usize) -> Reg,
) {
    for (i, (&p, &a)) in part.iter().zip(acc).enumerate() {
        let fac = factor(k, i);
        k.b.push(Inst::Fma {
            d: a,
            a: p,
            b: fac,
            c: a,
        });
    }
}

/// Whether a consumer whose token rows all lie past its expert's end skips its MMAs (the
/// consumers' tile loop): where [`WsConfig::skip_idle`] asks for it, in prefill tiles (tokens on
/// the M side) shared by two or more consumers, with shared-memory operands and one k split (the
/// plain k loop and the 128x128 block-scaled ones; group-wise scales have the weights on A).
pub fn skips_idle_rows(cfg: &WsConfig) -> bool {
    cfg.skip_idle && idle_rows_apply(cfg)
}

/// Whether a consumer's token rows can all lie past its expert's end while the other's do not
/// (what [`WsConfig::skip_idle`] needs).
fn idle_rows_apply(cfg: &WsConfig) -> bool {
    cfg.scaling.row_group().is_none()
        && cfg.consumers >= 2
        && !cfg.swap_ab
        && cfg.split_k == 1
        && !cfg.operands.register_a()
}

/// `acc = +0` at a tile's start, before the promoted families' k loop (block-scaled and
/// group-wise): their promotions then add to the total without a select on the first slice.
fn zero_total(k: &mut K, acc: &[Reg]) {
    for &a in acc {
        k.b.push(Inst::Un {
            op: crate::ptx::UnOpcode::Mov(PtxTy::F32),
            d: a,
            a: Operand::F32(0.0),
        });
    }
}

/// The epilogue's scale loads of a tile, as loaded (not yet multiplied): [`epilogue_loads`].
struct EpiLoads {
    /// The activation scales, one per token class (per token), or the one for all tokens.
    x: Option<Vec<Reg>>,
    /// The expert's weight scale (per tensor, per expert).
    w: Option<Reg>,
    /// The weight rows' scales, one per row class (per row, per channel).
    rows: Option<Vec<Reg>>,
    /// The expert's static activation scale of the E4M3 output ([`AQuant::Static`]).
    act_static: Option<Reg>,
}

/// How many registers [`epilogue_loads`] loads for `cfg` (0: none).
fn epilogue_load_count(cfg: &WsConfig) -> u32 {
    let x = if per_token(cfg.scaling) {
        if cfg.swap_ab {
            cfg.bn / 4
        } else {
            2
        }
    } else {
        1
    };
    let rows = if cfg.swap_ab { 2 } else { cfg.bn / 4 };
    let scales = match cfg.scaling {
        Scaling::PerExpert => 1,
        Scaling::Tensorwise { .. } => x + 1,
        Scaling::Channelwise { .. } => x + rows,
        Scaling::Groupwise { .. } => x,
        Scaling::PerRow => rows,
        _ => 0,
    };
    let stat = u32::from(matches!(
        cfg.epilogue,
        Epilogue::SiluMulE4m3(AQuant::Static)
    ));
    scales + stat
}

/// At most this many scale registers are loaded at a tile's start, before its k loop, so that
/// their latency hides behind the MMAs ([`consumers`]); more are loaded by the epilogue itself.
/// Loaded after the k loop, a load can wait behind the producer's TMA loads of the next tile
/// (read as the static E4M3 output's cost in run 91; run 92 on an H100 measured no speed change
/// from loading early, so that reading was wrong; BENCHMARKS). 20 takes every per-tensor and
/// per-token form up to 64 decode tokens (16 + 1 + 1); per channel's prefill row scales (`BN / 4`)
/// stay in the epilogue.
pub const EARLY_LOADS: u32 = 20;

/// The epilogue's scale loads of the tile `f` of the expert `s.expert`.
fn epilogue_loads(
    k: &mut K,
    cfg: &WsConfig,
    frag: &Frag,
    f: &Found,
    s: &Scan,
    x_scale: Option<Reg>,
    w_scale: Option<Reg>,
) -> EpiLoads {
    // Tensorwise scales: one factor per token class (per channel: the activation's alone, the
    // weight's per row below).
    let tokens = |k: &mut K, xs: Reg, per_token: bool| -> Vec<Reg> {
        let toks = if per_token {
            frag_tokens(k, cfg, frag, f, s)
        } else {
            vec![k.imm(0)]
        };
        toks.iter().map(|&t| ld_f32(k, xs, t)).collect()
    };
    let (x, w) = match (cfg.scaling, x_scale, w_scale) {
        (Scaling::PerExpert, _, Some(ws)) => (None, Some(ld_f32(k, ws, s.expert))),
        (Scaling::Tensorwise { per_token }, Some(xs), Some(ws)) => {
            let sw = ld_f32(k, ws, s.expert);
            (Some(tokens(k, xs, per_token)), Some(sw))
        }
        (
            Scaling::Channelwise { per_token } | Scaling::Groupwise { per_token, .. },
            Some(xs),
            _,
        ) => (Some(tokens(k, xs, per_token)), None),
        _ => (None, None),
    };
    // Per weight row: `w_scale[e, row]` per row class (`row_class`: the fragment's two A-side
    // halves in the swapped form, its B-side columns otherwise), rows past N clamped to N - 1
    // (never stored).
    let row_factors: Option<Vec<Reg>> = match (cfg.scaling, w_scale) {
        (Scaling::PerRow | Scaling::Channelwise { .. }, Some(ws)) => {
            let (base, offs): (Reg, Vec<u32>) = if cfg.swap_ab {
                (frag.a_row, vec![0, 8])
            } else {
                (
                    frag.b_col,
                    (0..cfg.bn / 8).flat_map(|j| [8 * j, 8 * j + 1]).collect(),
                )
            };
            let mut fs = Vec::with_capacity(offs.len());
            // Prefill: a column pair's two scales (8j, 8j + 1: adjacent, the first even, N even) in
            // one v2 load, its start clamped to N - 2 (columns past N are never stored).
            if !cfg.swap_ab && cfg.n.is_multiple_of(2) && cfg.n >= 2 {
                let i0 = k.bin(
                    BinOpcode::MulLo,
                    PtxTy::U32,
                    s.expert,
                    Operand::Int(cfg.n.into()),
                );
                for o in offs.iter().step_by(2) {
                    let r = k.bin(BinOpcode::Add, PtxTy::U32, base, Operand::Reg(f.w0));
                    k.bin_to(
                        r,
                        BinOpcode::Add,
                        PtxTy::U32,
                        r,
                        Operand::Int(i64::from(*o)),
                    );
                    k.bin_to(
                        r,
                        BinOpcode::Min,
                        PtxTy::U32,
                        r,
                        Operand::Int(i64::from(cfg.n) - 2),
                    );
                    k.bin_to(r, BinOpcode::Add, PtxTy::U32, r, Operand::Reg(i0));
                    let addr = k.addr(ws, r, 4);
                    let (lo, hi) = (k.b.reg(RegClass::F32), k.b.reg(RegClass::F32));
                    k.b.push(Inst::LdV2F32 { lo, hi, addr });
                    fs.push(lo);
                    fs.push(hi);
                }
            } else {
                for o in offs {
                    let r = k.bin(BinOpcode::Add, PtxTy::U32, base, Operand::Reg(f.w0));
                    k.bin_to(r, BinOpcode::Add, PtxTy::U32, r, Operand::Int(i64::from(o)));
                    k.bin_to(
                        r,
                        BinOpcode::Min,
                        PtxTy::U32,
                        r,
                        Operand::Int(i64::from(cfg.n) - 1),
                    );
                    let i = k.bin(
                        BinOpcode::MulLo,
                        PtxTy::U32,
                        s.expert,
                        Operand::Int(cfg.n.into()),
                    );
                    k.bin_to(i, BinOpcode::Add, PtxTy::U32, i, Operand::Reg(r));
                    fs.push(ld_f32(k, ws, i));
                }
            }
            Some(fs)
        }
        _ => None,
    };
    let act_static = matches!(cfg.epilogue, Epilogue::SiluMulE4m3(AQuant::Static))
        .then(|| super::finish::static_scale(k, s.expert));
    EpiLoads {
        x,
        w,
        rows: row_factors,
        act_static,
    }
}

/// Whether the activation scales are per token (one per token class of the fragment).
fn per_token(scaling: Scaling) -> bool {
    matches!(
        scaling,
        Scaling::Tensorwise { per_token: true }
            | Scaling::Channelwise { per_token: true }
            | Scaling::Groupwise {
                per_token: true,
                ..
            }
    )
}

/// Scale, convert and store the tile's accumulator (masked at the expert's end and at N) with the
/// scales of `loads` ([`epilogue_loads`]).
fn epilogue(
    k: &mut K,
    cfg: &WsConfig,
    (frag, f, s): (&Frag, &Found, &Scan),
    y: Reg,
    loads: EpiLoads,
    acc: &[Reg],
) -> Result<()> {
    // Per tensor: the activation's factor per token class times the expert's (the same
    // products, in the same order, as when the loads were the epilogue's own).
    let factors = match (cfg.scaling, loads.x, loads.w) {
        (Scaling::Tensorwise { .. }, Some(sx), Some(sw)) => {
            Some(sx.iter().map(|&x| fmul(k, x, sw)).collect())
        }
        (Scaling::PerExpert, _, Some(sw)) => Some(vec![sw]),
        (_, x, _) => x,
    };
    let sc = SlotScales {
        factors,
        row_factors: loads.rows,
        per_token: per_token(cfg.scaling),
        act_static: loads.act_static,
    };
    match cfg.epilogue {
        Epilogue::Store => store(k, cfg, frag, f, s, y, acc, &sc),
        Epilogue::SiluMul | Epilogue::SiluMulE4m3(_) => store_silu(k, cfg, frag, f, s, y, acc, &sc),
    }
}

/// The factors the epilogue scales the accumulator slots by.
struct SlotScales {
    /// Per token class (or one for all).
    factors: Option<Vec<Reg>>,
    /// Per row class ([`row_class`]: per weight row).
    row_factors: Option<Vec<Reg>>,
    per_token: bool,
    /// The expert's static activation scale, as loaded: `Some` exactly for
    /// [`AQuant::Static`]'s epilogue ([`epilogue_loads`]).
    act_static: Option<Reg>,
}

/// The accumulator slots, scaled. Slot i = 4j + 2h + c sits at A-side offset 8h and B-side offset
/// 8j + c.
fn scale_slots(k: &mut K, cfg: &WsConfig, acc: &[Reg], sc: &SlotScales) -> Vec<Reg> {
    let mut scaled = Vec::with_capacity((cfg.bn / 2) as usize);
    for i in 0..cfg.bn / 2 {
        let v = acc[i as usize];
        let rf = sc.row_factors.as_ref().map(|fs| fs[row_class(cfg, i)]);
        let tf = sc.factors.as_ref().map(|fs| {
            if sc.per_token {
                fs[token_class(cfg, i)]
            } else {
                fs[0]
            }
        });
        scaled.push(match (tf, rf) {
            (Some(t), Some(r)) => {
                let f = fmul(k, t, r);
                fmul(k, v, f)
            }
            (Some(f), None) | (None, Some(f)) => fmul(k, v, f),
            (None, None) => v,
        });
    }
    scaled
}

/// [`Epilogue::Store`]: the scaled slots to `y [T, N]`.
#[allow(clippy::too_many_arguments)]
fn store(
    k: &mut K,
    cfg: &WsConfig,
    frag: &Frag,
    f: &Found,
    s: &Scan,
    y: Reg,
    acc: &[Reg],
    sc: &SlotScales,
) -> Result<()> {
    let n = i64::from(cfg.n);
    let ob = i64::from(cfg.out.bytes());
    // Global (token, weight) of the fragment's base slot.
    let (tok, wrow) = if cfg.swap_ab {
        (
            k.bin(BinOpcode::Add, PtxTy::U32, frag.b_col, Operand::Reg(f.tok0)),
            k.bin(BinOpcode::Add, PtxTy::U32, frag.a_row, Operand::Reg(f.w0)),
        )
    } else {
        (
            k.bin(BinOpcode::Add, PtxTy::U32, frag.a_row, Operand::Reg(f.tok0)),
            k.bin(BinOpcode::Add, PtxTy::U32, frag.b_col, Operand::Reg(f.w0)),
        )
    };
    let row = k.addr(y, tok, ob * n);
    let addr = k.addr(row, wrow, ob);
    let scaled = scale_slots(k, cfg, acc, sc);
    // Masks: token < hi, weight row < N, per A-side half h and B-side column 8j + c.
    let mut a_ok = Vec::new();
    for h in 0..2u32 {
        let a = if cfg.swap_ab { wrow } else { tok };
        let r = k.bin(
            BinOpcode::Add,
            PtxTy::U32,
            a,
            Operand::Int(i64::from(8 * h)),
        );
        a_ok.push(if cfg.swap_ab {
            k.setp(CmpOp::Lt, r, Operand::Int(n))
        } else {
            k.setp(CmpOp::Lt, r, Operand::Reg(s.hi))
        });
    }
    let b_side = if cfg.swap_ab { tok } else { wrow };
    let b_full = !cfg.swap_ab && cfg.n.is_multiple_of(cfg.bn);
    if !cfg.swap_ab
        && cfg.out == OutTy::Bf16
        && cfg.n.is_multiple_of(4)
        && cfg.bn.is_multiple_of(16)
    {
        store_bf16_quads(k, cfg, frag, addr, b_side, b_full, &a_ok, &scaled);
        return Ok(());
    }
    for j in 0..cfg.bn / 8 {
        // Prefill stores the column pair (c = 0, 1) as one b32 (bf16) or one v2.f32: adjacent
        // and 4- or 8-byte aligned (N even, the pair's column even).
        let pair = !cfg.swap_ab;
        let cs: &[u32] = if pair { &[0] } else { &[0, 1] };
        for &c in cs {
            let b_ok = if b_full {
                None
            } else {
                let col = k.bin(
                    BinOpcode::Add,
                    PtxTy::U32,
                    b_side,
                    Operand::Int(i64::from(8 * j + c)),
                );
                Some(if cfg.swap_ab {
                    k.setp(CmpOp::Lt, col, Operand::Reg(s.hi))
                } else {
                    // N is even and the column pair starts even: the pair is in or out together.
                    k.setp(CmpOp::Lt, col, Operand::Int(n))
                })
            };
            for (h, &aok) in a_ok.iter().enumerate() {
                let pred = match b_ok {
                    None => aok,
                    Some(bok) => k.bin(BinOpcode::And, PtxTy::Pred, aok, Operand::Reg(bok)),
                };
                let i = (4 * j + 2 * h as u32 + c) as usize;
                // Byte offset of the slot from `addr`.
                let (da, db) = (8 * h as i64, i64::from(8 * j + c));
                let off = if cfg.swap_ab {
                    db * ob * n + da * ob
                } else {
                    da * ob * n + db * ob
                };
                put(
                    k,
                    cfg.out,
                    pred,
                    addr,
                    off,
                    scaled[i],
                    pair.then(|| scaled[i + 1]),
                );
            }
        }
    }
    Ok(())
}

/// Prefill bf16 out, N a multiple of 4: four adjacent columns a store (8 bytes). A thread holds
/// columns `2q, 2q + 1` (`q = b_col / 2`) of each 8-column group `j`; the lanes `q` and `q ^ 1`
/// trade one bf16 pair of groups `j` and `j + 1` (`shfl.bfly 1`), so the even lane stores
/// columns `8j + 2q .. + 3` and the odd lane `8(j + 1) + 2(q - 1) .. + 3`: a warp's store covers
/// 32 contiguous bytes of each of its 8 rows instead of 16. Every lane shuffles (the epilogue is
/// warp-uniform); only the stores are masked, a quad's four columns in or out of N together.
#[allow(clippy::too_many_arguments)]
fn store_bf16_quads(
    k: &mut K,
    cfg: &WsConfig,
    frag: &Frag,
    addr: Reg,
    b_side: Reg,
    b_full: bool,
    a_ok: &[Reg],
    scaled: &[Reg],
) {
    let n = i64::from(cfg.n);
    let q2 = k.bin(BinOpcode::And, PtxTy::B32, frag.b_col, Operand::Int(2));
    let odd = k.setp(CmpOp::Ne, q2, Operand::Int(0));
    // The odd lane's quad starts 6 columns (12 bytes) past its own column pair.
    let shifted = k.bin(BinOpcode::Add, PtxTy::U64, addr, Operand::Int(12));
    let base = k.selp(PtxTy::U64, Operand::Reg(shifted), Operand::Reg(addr), odd);
    let col0 = if b_full {
        None
    } else {
        let c = k.selp(PtxTy::U32, Operand::Int(6), Operand::Int(0), odd);
        k.bin_to(c, BinOpcode::Add, PtxTy::U32, c, Operand::Reg(b_side));
        Some(c)
    };
    let pack = |k: &mut K, lo: Reg, hi: Reg| -> Reg {
        let w = k.reg32();
        k.b.push(Inst::Bin {
            op: BinOpcode::CvtRnBf16x2,
            ty: PtxTy::F32,
            d: w,
            a: Operand::Reg(hi),
            b: Operand::Reg(lo),
        });
        w
    };
    let sel = |k: &mut K, a: Reg, b: Reg| k.selp(PtxTy::B32, Operand::Reg(a), Operand::Reg(b), odd);
    for j in (0..cfg.bn / 8).step_by(2) {
        let col_ok = col0.map(|c| {
            let col = k.bin(
                BinOpcode::Add,
                PtxTy::U32,
                c,
                Operand::Int(i64::from(8 * j)),
            );
            k.setp(CmpOp::Lt, col, Operand::Int(n))
        });
        for (h, &aok) in a_ok.iter().enumerate() {
            // Slots 4j + 2h + c (group j) and 4(j + 1) + 2h + c (group j + 1).
            let i0 = (4 * j + 2 * h as u32) as usize;
            let i1 = i0 + 4;
            let w0 = pack(k, scaled[i0], scaled[i0 + 1]);
            let w1 = pack(k, scaled[i1], scaled[i1 + 1]);
            // The even lane sends its group j + 1 pair, the odd lane its group j pair.
            let x = sel(k, w0, w1);
            let y = k.reg32();
            k.b.push(Inst::ShflBfly {
                d: y,
                a: x,
                mask: 1,
            });
            let lo = sel(k, y, w0);
            let hi = sel(k, w1, y);
            let pred = match col_ok {
                None => aok,
                Some(ok) => k.bin(BinOpcode::And, PtxTy::Pred, aok, Operand::Reg(ok)),
            };
            k.b.push(Inst::StGuardedV2 {
                pred,
                ty: PtxTy::B32,
                addr: base,
                off: 8 * h as i64 * 2 * n + 16 * i64::from(j),
                lo,
                hi,
            });
        }
    }
}

/// [`Epilogue::SiluMul`]: `a [T, N / 2]` from the scaled slots' gate/up pairs (weight rows in
/// the paired order of [`glu_row`]; tiles start on 16 weight rows).
/// * Decode: the thread's A-side row `r = w0 + a_row` is a gate row (`a_row % 16 < 8`) and
///   `r + 8` its up row: slot `4j + c` pairs with `4j + 2 + c`, for token `8j + c`, output
///   `(r / 16) * 8 + r % 8`.
/// * Prefill: the B-side columns `w0 + b_col + 8j` are gate rows for even `j` and the up rows of
///   the same outputs for `j + 1`: slot `4j + 2h + c` pairs with `4(j + 1) + 2h + c`, for token
///   row `8h`, output `w0 / 2 + b_col + 8 (j / 2) + c`.
#[allow(clippy::too_many_arguments)]
fn store_silu(
    k: &mut K,
    cfg: &WsConfig,
    frag: &Frag,
    f: &Found,
    s: &Scan,
    y: Reg,
    acc: &[Reg],
    sc: &SlotScales,
) -> Result<()> {
    let n = i64::from(cfg.n);
    let half = n / 2;
    let ob = i64::from(cfg.out.bytes());
    // The thread's base token, its first output and the mask of its weight rows (decode).
    let (tok, out0) = if cfg.swap_ab {
        let tok = k.bin(BinOpcode::Add, PtxTy::U32, frag.b_col, Operand::Reg(f.tok0));
        let r = k.bin(BinOpcode::Add, PtxTy::U32, frag.a_row, Operand::Reg(f.w0));
        let q = k.bin(BinOpcode::Shr, PtxTy::U32, r, Operand::Int(4));
        k.bin_to(q, BinOpcode::Shl, PtxTy::B32, q, Operand::Int(3));
        let lo = k.bin(BinOpcode::And, PtxTy::B32, r, Operand::Int(7));
        k.bin_to(q, BinOpcode::Add, PtxTy::U32, q, Operand::Reg(lo));
        (tok, q)
    } else {
        let tok = k.bin(BinOpcode::Add, PtxTy::U32, frag.a_row, Operand::Reg(f.tok0));
        let o = k.bin(BinOpcode::Shr, PtxTy::U32, f.w0, Operand::Int(1));
        k.bin_to(o, BinOpcode::Add, PtxTy::U32, o, Operand::Reg(frag.b_col));
        (tok, o)
    };
    let row = k.addr(y, tok, ob * half);
    let addr = k.addr(row, out0, ob);
    let scaled = scale_slots(k, cfg, acc, sc);
    // (gate slot, token offset, output offset) of every pair; the up slot is the gate's + 2
    // (decode) or + 4 (prefill).
    let mut pairs = Vec::new();
    if cfg.swap_ab {
        for j in 0..cfg.bn / 8 {
            for c in 0..2u32 {
                pairs.push((4 * j + c, i64::from(8 * j + c), 0i64));
            }
        }
    } else {
        for j in (0..cfg.bn / 8).step_by(2) {
            for h in 0..2u32 {
                for c in 0..2u32 {
                    pairs.push((4 * j + 2 * h + c, i64::from(8 * h), i64::from(4 * j + c)));
                }
            }
        }
    }
    // (With the recipe's up rows first, the slots of each pair swap roles.)
    let up_at = if cfg.swap_ab { 2 } else { 4 };
    let vals: Vec<Reg> = pairs
        .iter()
        .map(|&(g, _, _)| {
            let (first, second) = (scaled[g as usize], scaled[(g + up_at) as usize]);
            if cfg.w_rows.up_first {
                k.silu_mul(second, first)
            } else {
                k.silu_mul(first, second)
            }
        })
        .collect();
    // Masks. Decode: the output row (gate row < N, so its up row too) and the token column;
    // prefill: the token row (per h) and the output column (per j / 2).
    let out_ok = if cfg.swap_ab {
        Some(k.setp(CmpOp::Lt, out0, Operand::Int(half)))
    } else {
        None
    };
    let prefill_full = !cfg.swap_ab && cfg.n.is_multiple_of(cfg.bn);
    let pair_store = !cfg.swap_ab;
    // Static E4M3 output (its scale loaded by `epilogue_loads`): each output's code too, and the
    // rows' scales from output column 0.
    let statics = sc
        .act_static
        .map(|st| super::finish::static_codes(k, cfg, st, (tok, out0)));
    let mut row_masks: Vec<(i64, Reg)> = Vec::new();
    for (p, &(_, dt, dout)) in pairs.iter().enumerate() {
        // Prefill: the output pair (c = 0, 1) as one b32 (bf16) or v2.f32 (N / 2 even: tiles of
        // 16 rows), at the even c.
        if pair_store && dout % 2 == 1 {
            continue;
        }
        let tok_ok = {
            let t = k.bin(BinOpcode::Add, PtxTy::U32, tok, Operand::Int(dt));
            k.setp(CmpOp::Lt, t, Operand::Reg(s.hi))
        };
        let pred = match out_ok {
            Some(o) => k.bin(BinOpcode::And, PtxTy::Pred, tok_ok, Operand::Reg(o)),
            None if prefill_full => tok_ok,
            None => {
                let o = k.bin(BinOpcode::Add, PtxTy::U32, out0, Operand::Int(dout));
                let ok = k.setp(CmpOp::Lt, o, Operand::Int(half));
                k.bin(BinOpcode::And, PtxTy::Pred, tok_ok, Operand::Reg(ok))
            }
        };
        let off = dt * ob * half + dout * ob;
        let hi = pair_store.then(|| vals[p + 1]);
        // (Static E4M3 output: the f32 `a` only where `y` is given, not 0.)
        let a_pred = match &statics {
            Some(c) => k.bin(BinOpcode::And, PtxTy::Pred, pred, Operand::Reg(c.has_a)),
            None => pred,
        };
        put(k, cfg.out, a_pred, addr, off, vals[p], hi);
        if let Some(c) = &statics {
            super::finish::store_static(k, cfg, c, pred, (dt, dout), vals[p], hi);
            if !row_masks.iter().any(|r| r.0 == dt) {
                row_masks.push((dt, tok_ok));
            }
        }
    }
    if let Some(c) = &statics {
        super::finish::store_static_scales(k, c, &row_masks);
    }
    Ok(())
}

/// One guarded store of the epilogue at `addr + off`: `lo` as f32 alone, or with `hi` 4 bytes
/// further (`v2.f32`), or in bf16 alone (`u16`) or with `hi` as the pair's upper half (`b32`,
/// `cvt.rn.bf16x2` of `(hi, lo)`).
#[allow(clippy::too_many_arguments)]
fn put(k: &mut K, out: OutTy, pred: Reg, addr: Reg, off: i64, lo: Reg, hi: Option<Reg>) {
    if let (OutTy::F32, Some(hi)) = (out, hi) {
        k.b.push(Inst::StGuardedV2 {
            pred,
            ty: PtxTy::F32,
            addr,
            off,
            lo,
            hi,
        });
        return;
    }
    let (v, ty) = match out {
        OutTy::F32 => (lo, PtxTy::F32),
        OutTy::Bf16 => {
            let w = k.reg32();
            k.b.push(Inst::Bin {
                op: BinOpcode::CvtRnBf16x2,
                ty: PtxTy::F32,
                d: w,
                a: Operand::Reg(hi.unwrap_or(lo)),
                b: Operand::Reg(lo),
            });
            (w, if hi.is_some() { PtxTy::B32 } else { PtxTy::U16 })
        }
    };
    k.b.push(Inst::StGuarded {
        pred,
        negate: false,
        ty,
        addr,
        off,
        v,
    });
}

/// The module (header and one entry named `name`) for `cfg`.
pub fn grouped_ws_module(name: &str, cfg: &WsConfig) -> Result<String> {
    Ok(super::kernel::module_header() + &grouped_ws_entry(name, cfg)?)
}
