//! `moeforge selftest --gpu --gemm`, v1 part: every warp-specialized variant family (bf16, e4m3 with
//! per-token or per-tensor activation scales, `fp8_block128`; prefill and decode forms; f32 and bf16
//! output) on the GPU against the f64 host reference (`codegen::gemm::reference`) over the same
//! quantized operands, on the shape classes issue \[7\] names: uniform routing, skewed routing (one
//! expert gets most rows), empty experts, M = 1, M not a multiple of any tile, N and K not multiples
//! of the tiles, and the models' K and N. Operands are random from a fresh seed (printed), outputs
//! are poisoned with NaN before every run, and every output row must be written (no NaN). Large
//! shapes compare a sample of rows (each expert's first and last row and random others) with the
//! reference; small ones compare every row.

use std::fmt::Write as _;

use crate::codegen::gemm::act_quant::scales_group_major;
use crate::codegen::gemm::reference::{self, ActScale, Grouped, SPEC_BOUND};
use crate::codegen::gemm::wmap::{self, WLayout};
use crate::codegen::gemm::ws::{
    paired_row, AQuant, Epilogue, GroupScale, Operands, OutTy, Scaling, WRows, WsConfig, W4,
};
use crate::codegen::moe::act::ActIn;
use crate::runtime::gemm_ws::{ActOutBuffers, GemmOperands, GroupedGemm};
use crate::runtime::{drv, Device};
use crate::selftest_util::Rng;
use crate::{Error, Result};

/// One shape class.
pub(crate) struct Case {
    pub(crate) what: &'static str,
    pub(crate) rows: Vec<usize>,
    pub(crate) n: u32,
    pub(crate) k: u32,
}

/// The shape classes; `quick` keeps the small ones (for the sanitizers).
pub(crate) fn cases(rng: &mut Rng, quick: bool) -> Vec<Case> {
    let mut skew = vec![0usize; 8];
    for (e, r) in skew.iter_mut().enumerate() {
        *r = if e == 5 {
            250
        } else {
            rng.below(4) * rng.below(6)
        };
    }
    let mut v = vec![
        Case {
            what: "ragged, an empty expert, a one-row expert",
            rows: vec![0, 1, 70, 129],
            n: 256,
            k: 512,
        },
        Case {
            what: "skewed routing, N and K off the tiles",
            rows: skew.clone(),
            n: 392,
            k: 1040,
        },
        Case {
            what: "M = 1 (qwen3-30b-a3b w13)",
            rows: vec![0, 0, 0, 1, 0, 0, 0, 0],
            n: 1536,
            k: 2048,
        },
    ];
    // More experts than the tile scan's warp has lanes (it looks at 32 a step): hits at a step's
    // first and last lanes, a step that finds nothing, and the last step part past E.
    let mut many = vec![0usize; 70];
    for (e, r) in [(2, 3), (31, 1), (33, 17), (40, 2), (64, 9), (69, 1)] {
        many[e] = r;
    }
    v.insert(
        2,
        Case {
            what: "70 experts, few of them routed (the scan's 32-expert steps)",
            rows: many,
            n: 256,
            k: 512,
        },
    );
    if quick {
        // The sanitizers' set: masking at the expert's end and at N and K off the tiles, and the
        // scan over many experts.
        v.truncate(3);
        return v;
    }
    let uniform = |rng: &mut Rng, e: usize, tokens: usize, top: usize| {
        let mut rows = vec![0usize; e];
        for _ in 0..tokens {
            // top distinct experts per token
            let mut chosen = Vec::with_capacity(top);
            while chosen.len() < top {
                let x = rng.below(e);
                if !chosen.contains(&x) {
                    chosen.push(x);
                }
            }
            for x in chosen {
                rows[x] += 1;
            }
        }
        rows
    };
    // The 4-bit kernels need K a multiple of 64 (the codes' kernel order) and N of 16 (TMA): their
    // case off the tiles.
    v.push(Case {
        what: "skewed routing, N and K off the tiles as far as 4-bit weights allow",
        rows: skew,
        n: 400,
        k: 1088,
    });
    v.push(Case {
        what: "qwen3-30b-a3b w13, 16 tokens, uniform top-8",
        rows: uniform(rng, 128, 16, 8),
        n: 1536,
        k: 2048,
    });
    v.push(Case {
        what: "deepseek-v3-ep8 w13, 64 tokens, uniform top-8",
        rows: uniform(rng, 32, 64, 8),
        n: 4096,
        k: 7168,
    });
    v.push(Case {
        what: "mixtral-8x7b w2, 300 tokens, uniform top-2",
        rows: uniform(rng, 8, 300, 2),
        n: 4096,
        k: 14336,
    });
    v
}

/// Symmetric INT4 with bf16 scales per `group`.
fn int4_g(group: u32) -> Operands {
    int4_as(GroupScale::Bf16, group)
}

/// INT4 with `scale` elements (bf16, or bf16 and zero points) per `group`.
fn int4_as(scale: GroupScale, group: u32) -> Operands {
    Operands::W4Bf16(W4 {
        codes: crate::codegen::gemm::ws::W4Codes::U4,
        scale,
        group,
    })
}

/// The variants checked on every case: (label, operands, scaling, out, consumers, BN, stages,
/// swap).
pub(crate) fn variants(n: u32, k: u32) -> Vec<WsConfig> {
    let v = |operands, scaling, out, consumers, bn, stages, swap_ab| WsConfig {
        operands,
        scaling,
        out,
        epilogue: Epilogue::Store,
        consumers,
        bn,
        stages,
        swap_ab,
        split_k: 1,
        n,
        k,
        w_rows: WRows::PLAIN,
        two_slices: false,
        skip_idle: false,
    };
    let tok = Scaling::Tensorwise { per_token: true };
    let ten = Scaling::Tensorwise { per_token: false };
    // FP8 per channel: a weight scale per row with the token's (or one static) scale.
    let ch = Scaling::Channelwise { per_token: true };
    let chs = Scaling::Channelwise { per_token: false };
    // Group-wise FP8: a weight scale per row and 128 (or 256) along K, the token's in the epilogue.
    let gw = |group, per_token| Scaling::Groupwise { group, per_token };
    // The register-A families and a variant of one (weights on A: always the swapped form).
    let i8 = (Operands::I8Bf16, Scaling::PerRow);
    let [nvfp4, mxfp4, int4] = W4_FORMATS.map(|o| (o, Scaling::PerExpert));
    let int4z = (int4_as(GroupScale::Bf16Zero, 128), Scaling::PerExpert);
    let i8g128 = (Operands::I8Bf16, Scaling::PerRowGroup { group: 128 });
    let ra = |(o, sc): (Operands, Scaling), out, consumers, bn, stages| {
        v(o, sc, out, consumers, bn, stages, true)
    };
    let (b, e) = (Operands::Bf16, Operands::E4m3);
    let plain = vec![
        v(b, Scaling::None, OutTy::Bf16, 2, 128, 6, false),
        v(b, Scaling::None, OutTy::Bf16, 2, 256, 4, false),
        v(b, Scaling::None, OutTy::F32, 1, 128, 4, false),
        v(b, Scaling::None, OutTy::Bf16, 1, 16, 8, true),
        v(b, Scaling::None, OutTy::F32, 1, 8, 8, true),
        v(e, tok, OutTy::Bf16, 2, 256, 4, false),
        v(e, ten, OutTy::F32, 2, 128, 6, false),
        v(e, tok, OutTy::Bf16, 1, 32, 8, true),
        v(e, Scaling::Block128, OutTy::Bf16, 2, 128, 6, false),
        // (and its two-slice twin, each consumer promoting one slice while the next one's MMAs
        // run)
        WsConfig {
            two_slices: true,
            ..v(e, Scaling::Block128, OutTy::F32, 2, 128, 6, false)
        },
        // (and the 192-row tile spanning two scale blocks, bf16 and f32 out)
        v(e, Scaling::Block128, OutTy::Bf16, 2, 192, 5, false),
        v(e, Scaling::Block128, OutTy::F32, 2, 192, 5, false),
        v(e, Scaling::Block128, OutTy::F32, 1, 16, 8, true),
        // FP8 per channel: the row scales on the B side (prefill) and the A side (decode).
        v(e, ch, OutTy::Bf16, 2, 128, 6, false),
        v(e, chs, OutTy::F32, 2, 256, 4, false),
        v(e, ch, OutTy::F32, 1, 16, 8, true),
        v(e, chs, OutTy::Bf16, 1, 8, 8, true),
        WsConfig {
            split_k: 2,
            ..v(e, ch, OutTy::F32, 1, 32, 8, true)
        },
        // Group-wise FP8 (weights on A): one consumer, two at 128 weight rows a token tile, static, groups of 256, split-K (a
        // range starting inside a group).
        v(e, gw(128, true), OutTy::F32, 1, 16, 8, true),
        v(e, gw(128, true), OutTy::Bf16, 1, 64, 6, true),
        v(e, gw(128, false), OutTy::F32, 1, 8, 8, true),
        v(e, gw(256, true), OutTy::Bf16, 1, 32, 8, true),
        v(e, gw(128, true), OutTy::Bf16, 2, 128, 4, true),
        // (and the prefill form: the row scales on the B side)
        v(e, gw(128, true), OutTy::Bf16, 2, 128, 6, false),
        v(e, gw(256, false), OutTy::F32, 2, 128, 6, false),
        WsConfig {
            split_k: 3,
            ..v(e, gw(256, true), OutTy::F32, 1, 16, 8, true)
        },
        // Int8 weights as register-sourced A (W8A16, decode).
        ra(i8, OutTy::Bf16, 1, 16, 8),
        ra(i8, OutTy::F32, 1, 8, 8),
        ra(i8, OutTy::Bf16, 1, 64, 6),
        // Split-K (decode): bf16, per-token FP8 and block-scaled.
        WsConfig {
            split_k: 4,
            ..v(b, Scaling::None, OutTy::Bf16, 1, 8, 8, true)
        },
        WsConfig {
            split_k: 3,
            ..v(e, tok, OutTy::F32, 1, 16, 8, true)
        },
        WsConfig {
            split_k: 2,
            ..v(e, Scaling::Block128, OutTy::Bf16, 1, 32, 8, true)
        },
        // 4-bit weights as register-sourced A (W4A16, decode): NVFP4's, MXFP4's and INT4 g128's
        // codes and scales.
        ra(nvfp4, OutTy::Bf16, 1, 16, 8),
        ra(mxfp4, OutTy::F32, 1, 8, 8),
        // The 4-stage ring the tuner may choose for 4-bit weights.
        ra(nvfp4, OutTy::Bf16, 1, 8, 4),
        ra(int4, OutTy::F32, 1, 8, 4),
        // The register-A families' wide token tiles (their prefill).
        ra(i8, OutTy::Bf16, 1, 128, 4),
        // The register-A prefill form: two consumers (128 weight rows) share a token tile.
        ra(i8, OutTy::F32, 2, 256, 4),
        ra(i8, OutTy::Bf16, 2, 128, 4),
        ra(nvfp4, OutTy::F32, 2, 256, 4),
        ra(mxfp4, OutTy::F32, 2, 128, 4),
        ra(mxfp4, OutTy::Bf16, 1, 128, 4),
        ra(int4, OutTy::Bf16, 2, 256, 4),
        ra(int4, OutTy::Bf16, 1, 64, 6),
        // Two decode consumers (128 weight rows) sharing one producer warp.
        ra(nvfp4, OutTy::Bf16, 2, 8, 8),
        // Register-sourced A split along K (the two-consumer 8-token tile, and others).
        WsConfig {
            split_k: 2,
            ..ra(nvfp4, OutTy::Bf16, 2, 8, 8)
        },
        WsConfig {
            split_k: 3,
            ..ra(i8, OutTy::F32, 2, 8, 8)
        },
        WsConfig {
            split_k: 2,
            ..ra(int4, OutTy::F32, 1, 16, 8)
        },
        // INT4 with groups of 32 and 16 (bf16 scales: two a word, two words a row's k-tile).
        ra((int4_g(32), Scaling::PerExpert), OutTy::F32, 2, 8, 8),
        ra((int4_g(16), Scaling::PerExpert), OutTy::Bf16, 1, 16, 8),
        ra(mxfp4, OutTy::Bf16, 2, 16, 8),
        ra(int4, OutTy::F32, 2, 8, 8),
        ra(i8, OutTy::F32, 2, 16, 8),
        // Asymmetric INT4 (zero points) with groups of 128, 64 and 32: decode, split-K, prefill.
        ra(int4z, OutTy::Bf16, 2, 8, 8),
        ra(
            (int4_as(GroupScale::Bf16Zero, 64), Scaling::PerExpert),
            OutTy::F32,
            1,
            16,
            8,
        ),
        ra(
            (int4_as(GroupScale::Bf16Zero, 32), Scaling::PerExpert),
            OutTy::Bf16,
            2,
            16,
            8,
        ),
        WsConfig {
            split_k: 2,
            ..ra(int4z, OutTy::F32, 1, 8, 8)
        },
        ra(int4z, OutTy::Bf16, 2, 256, 4),
        // Group-wise int8 (groups of 128 and 64, each group's sum promoted by its row's scale):
        // one and two consumers, split-K (a range starting inside a group).
        ra(i8g128, OutTy::Bf16, 1, 8, 8),
        // (and its prefill tile: two consumers, 128 tokens)
        ra(i8g128, OutTy::F32, 2, 128, 4),
        ra(i8g128, OutTy::F32, 2, 16, 8),
        ra(
            (Operands::I8Bf16, Scaling::PerRowGroup { group: 64 }),
            OutTy::Bf16,
            1,
            64,
            6,
        ),
        WsConfig {
            split_k: 3,
            ..ra(i8g128, OutTy::F32, 2, 8, 8)
        },
    ];
    // The fused SiLU epilogue (the layer's first GEMM): prefill and decode, split-K, every family.
    let silu = [
        (v(b, Scaling::None, OutTy::Bf16, 2, 128, 6, false), 1),
        (v(b, Scaling::None, OutTy::F32, 1, 16, 8, true), 1),
        (v(e, tok, OutTy::Bf16, 2, 256, 4, false), 1),
        // (f32 out in prefill: the FP8 per-tensor layer's fused first GEMM)
        (v(e, tok, OutTy::F32, 2, 256, 4, false), 1),
        (v(e, tok, OutTy::F32, 1, 16, 8, true), 3),
        (v(e, Scaling::Block128, OutTy::F32, 1, 16, 8, true), 1),
        // (block scales: each half of the paired rows takes its `[gate; up]` row's block; the
        // layer's prefill tile, its two-slice twin and a split decode tile)
        (v(e, Scaling::Block128, OutTy::F32, 2, 128, 6, false), 1),
        (
            WsConfig {
                two_slices: true,
                ..v(e, Scaling::Block128, OutTy::F32, 2, 128, 6, false)
            },
            1,
        ),
        (v(e, Scaling::Block128, OutTy::Bf16, 1, 64, 6, true), 2),
        (v(e, ch, OutTy::F32, 2, 256, 4, false), 1),
        (v(e, ch, OutTy::F32, 1, 16, 8, true), 2),
        (v(e, gw(128, true), OutTy::F32, 1, 16, 8, true), 1),
        (v(e, gw(128, true), OutTy::F32, 2, 128, 4, true), 1),
        (v(e, gw(128, true), OutTy::F32, 2, 128, 6, false), 1),
        (ra(i8, OutTy::Bf16, 1, 16, 8), 1),
        (ra(nvfp4, OutTy::Bf16, 1, 8, 8), 1),
        (ra(int4, OutTy::F32, 1, 16, 8), 1),
        (ra(nvfp4, OutTy::Bf16, 2, 128, 4), 1),
        (ra(nvfp4, OutTy::Bf16, 2, 8, 8), 1),
        (ra(i8, OutTy::Bf16, 2, 16, 8), 1),
        (ra(mxfp4, OutTy::Bf16, 2, 8, 8), 2),
        (ra(int4z, OutTy::Bf16, 2, 8, 8), 1),
        (ra(i8g128, OutTy::Bf16, 2, 8, 8), 1),
        (ra(i8g128, OutTy::Bf16, 2, 128, 4), 1),
        (ra(i8, OutTy::Bf16, 1, 128, 4), 1),
        (ra(i8, OutTy::Bf16, 2, 256, 4), 1),
    ]
    .map(|(c, split_k)| WsConfig {
        epilogue: Epilogue::SiluMul,
        split_k,
        ..c
    });
    // Weights read in place through a recipe's row modes (`codegen::gemm::wmap`), stored by the
    // check in a permuted order of those modes ([`in_place_operand`]): `[gate; up]` rows read in
    // the fused epilogue's paired order (8 rows, the halves, blocks of 8), up-before-gate rows
    // interleaved by 64 read up-first (the expert folded into a rank-5 map), and rows interleaved
    // by 8 read in the input's order.
    let paired = WRows {
        modes: 3,
        inner: [8, 2, 0],
        folded: false,
        up_first: false,
    };
    let interleaved = WRows {
        modes: 4,
        inner: [8, 2, 8],
        folded: true,
        up_first: true,
    };
    let by8 = WRows {
        modes: 3,
        inner: [8, (n / 16).max(2), 0],
        folded: false,
        up_first: false,
    };
    let fused = |c: WsConfig, w_rows| WsConfig {
        epilogue: Epilogue::SiluMul,
        w_rows,
        ..c
    };
    let in_place = [
        fused(v(b, Scaling::None, OutTy::Bf16, 2, 128, 6, false), paired),
        fused(v(b, Scaling::None, OutTy::F32, 1, 16, 8, true), paired),
        fused(v(e, tok, OutTy::Bf16, 2, 128, 6, false), interleaved),
        fused(v(e, tok, OutTy::F32, 1, 16, 8, true), interleaved),
        fused(v(e, ch, OutTy::F32, 2, 128, 6, false), paired),
        fused(v(e, ch, OutTy::F32, 1, 16, 8, true), interleaved),
        fused(v(e, gw(128, true), OutTy::F32, 1, 16, 8, true), interleaved),
        fused(
            v(e, Scaling::Block128, OutTy::F32, 2, 128, 6, false),
            interleaved,
        ),
        fused(v(e, Scaling::Block128, OutTy::F32, 1, 32, 8, true), paired),
        WsConfig {
            split_k: 2,
            ..fused(v(b, Scaling::None, OutTy::Bf16, 1, 8, 8, true), interleaved)
        },
        WsConfig {
            w_rows: by8,
            ..v(b, Scaling::None, OutTy::F32, 1, 8, 8, true)
        },
        WsConfig {
            w_rows: by8,
            ..v(e, ten, OutTy::Bf16, 2, 128, 6, false)
        },
    ];
    // The fused epilogue with `a` quantized to E4M3 in the kernel (per token, static, per 1x128
    // group), its codes and scales checked bit for bit against the activation kernel's.
    // (scaling, consumers, BN, stages, swapped, quantization, row order, split-K).
    let e4m3_out = [
        (tok, 2, 128, 6, false, AQuant::PerToken, WRows::PLAIN, 1),
        (tok, 1, 16, 8, true, AQuant::PerToken, interleaved, 1),
        (tok, 1, 16, 8, true, AQuant::PerToken, WRows::PLAIN, 2),
        (tok, 2, 256, 4, false, AQuant::Static, paired, 1),
        (tok, 1, 8, 8, true, AQuant::Static, WRows::PLAIN, 1),
        (ch, 1, 16, 8, true, AQuant::PerToken, WRows::PLAIN, 1),
        (
            Scaling::Block128,
            2,
            128,
            6,
            false,
            AQuant::Group128,
            interleaved,
            1,
        ),
        (
            Scaling::Block128,
            1,
            32,
            8,
            true,
            AQuant::Group128,
            paired,
            1,
        ),
        // Groups of 128 outputs over per-token FP8: N / 2 need not be a multiple of 128 here,
        // so the shapes off the tiles end on a partial group.
        (tok, 2, 128, 6, false, AQuant::Group128, WRows::PLAIN, 1),
        (tok, 1, 16, 8, true, AQuant::Group128, WRows::PLAIN, 1),
    ]
    .map(|(sc, c, bn, st, swap, q, w_rows, split_k)| WsConfig {
        epilogue: Epilogue::SiluMulE4m3(q),
        w_rows,
        split_k,
        ..v(e, sc, OutTy::F32, c, bn, st, swap)
    });
    // Each prefill form that can skip an idle consumer's MMAs, also with the skip.
    let all: Vec<WsConfig> = plain
        .into_iter()
        .chain(silu)
        .chain(in_place)
        .chain(e4m3_out)
        .collect();
    crate::codegen::gemm::tune::with_idle_twins(all)
        .into_iter()
        // In-place row modes where the shape has them (and a tile is a box of them).
        .filter(|c| c.w_rows == WRows::PLAIN || c.w_rows.check(n, c.tile_weights()).is_ok())
        // 4-bit weights only where their TMA boxes fit the shape; the fused epilogue where gate
        // and up rows pair (N a multiple of 16).
        .filter(|c| match c.operands {
            Operands::W4Bf16(w) => w.fits(u64::from(n), u64::from(k)),
            _ => true,
        })
        .filter(|c| !c.epilogue.silu() || n.is_multiple_of(16))
        // Block scales with paired rows: N a multiple of 128 (a tile's gate and up rows each in
        // one block).
        .filter(|c| !c.paired_blocks() || n.is_multiple_of(128))
        .collect()
}

/// The 4-bit weight formats of the standard recipes: NVFP4 (E2M1, E4M3 per 16), MXFP4 (E2M1, E8M0
/// per 32), INT4 g128 (U4, bf16 per 128).
pub(crate) const W4_FORMATS: [Operands; 3] = [
    Operands::W4Bf16(W4::NVFP4),
    Operands::W4Bf16(W4::MXFP4),
    Operands::W4Bf16(W4::INT4_G128),
];

/// Random group scales of a 4-bit format, `len` bytes (`W4::group_scale_at`'s order): E4M3 of either sign with
/// subnormals and zero (NaN excluded), E8M0 in `[100, 128]` (with zeros), positive bf16 in
/// `[2^-9, 2^-1)` (with a zero point in `0..=15` each for asymmetric INT4).
fn group_scales(rng: &mut Rng, w: W4, len: usize) -> Vec<u8> {
    match w.scale {
        GroupScale::E4m3 => (0..len).map(|_| e4m3_code(rng)).collect(),
        GroupScale::E8m0 => (0..len)
            .map(|_| {
                if rng.below(50) == 0 {
                    0
                } else {
                    100 + rng.below(29) as u8
                }
            })
            .collect(),
        GroupScale::Bf16 => (0..len / 2).flat_map(|_| bf16_scale(rng)).collect(),
        // A scale and a zero point in 0..=15 per element.
        GroupScale::Bf16Zero => (0..len / 4)
            .flat_map(|_| {
                let z = GroupScale::zero_point_bits(rng.below(16) as u8);
                let [a, b] = bf16_scale(rng);
                let [c, d] = z.to_le_bytes();
                [a, b, c, d]
            })
            .collect(),
    }
}

/// A random positive bf16 scale in `[2^-9, 2^-1)`, little-endian.
fn bf16_scale(rng: &mut Rng) -> [u8; 2] {
    let v = (2f32).powf(-9.0 + 8.0 * (rng.below(1 << 20) as f32 / (1 << 20) as f32));
    reference::bf16_from_f32(v).to_le_bytes()
}

/// A random e4m3 code that is not NaN (`0x7f`, `0xff`).
fn e4m3_code(rng: &mut Rng) -> u8 {
    loop {
        let b = (rng.next() >> 56) as u8;
        if b & 0x7f != 0x7f {
            return b;
        }
    }
}

/// A positive scale in `[2^-12, 2^-4)`.
fn scale(rng: &mut Rng) -> f32 {
    let u = (rng.next() >> 40) as f32 / (1u64 << 24) as f32;
    (2f32).powf(-12.0 + 8.0 * u)
}

/// The raw operands of one case, shared by its variants: bf16 `X` and `W`, e4m3 codes of `X` and `W`
/// (random codes, NaN excluded; the quantizers are tested on their own), drawn once per case.
struct Raw {
    x16: Vec<u8>,
    w16: Vec<u8>,
    x8: Vec<u8>,
    w8: Vec<u8>,
}

fn raw(rng: &mut Rng, t: usize, e: usize, n: usize, k: usize) -> Raw {
    let mut bf = |len: usize| {
        (0..len)
            .flat_map(|_| rng.bf16().to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let (x16, w16) = (bf(t * k), bf(e * n * k));
    let x8 = (0..t * k).map(|_| e4m3_code(rng)).collect();
    let w8 = (0..e * n * k).map(|_| e4m3_code(rng)).collect();
    Raw { x16, w16, x8, w8 }
}

/// The scales of `cfg`'s family: activation (`[T]`, `[1]` or `[T, KB]` in the reference's layout)
/// and weight (`[E]` or `[E, NB, KB]`).
fn scales(rng: &mut Rng, cfg: &WsConfig, t: usize, e: usize) -> (Vec<f32>, Vec<f32>) {
    let (kb, nb) = (
        (cfg.k as usize).div_ceil(128),
        (cfg.n as usize).div_ceil(128),
    );
    let mut v = |len: usize| (0..len).map(|_| scale(rng)).collect::<Vec<f32>>();
    match cfg.scaling {
        Scaling::None => (vec![], vec![]),
        Scaling::Tensorwise { per_token: true } => (v(t), v(e)),
        Scaling::Tensorwise { per_token: false } => (v(1), v(e)),
        Scaling::Block128 => (v(t * kb), v(e * nb * kb)),
        Scaling::PerRow => (vec![], v(e * cfg.n as usize)),
        Scaling::Channelwise { per_token } => {
            (v(if per_token { t } else { 1 }), v(e * cfg.n as usize))
        }
        Scaling::PerExpert => (vec![], v(e)),
        // (Group-wise int8: its scales are the operand's group scales.)
        Scaling::PerRowGroup { .. } => (vec![], vec![]),
        // Group-wise FP8: the activation's; the weights' are the operand's group scales.
        Scaling::Groupwise { per_token, .. } => (v(if per_token { t } else { 1 }), vec![]),
    }
}

/// Row `j` of expert `e` (`n` rows of `k`) against activations `xs`, per group of `group` along K:
/// each group's dot of `value(code)` and `xs` (f64) times the row's f32 scale of the group, from
/// `op.group_scales` (`[E, groups, N]`), summed over the groups.
fn group_dot(
    op: &Operand<'_>,
    (e, j, n, k): (usize, usize, usize, usize),
    group: u32,
    row: &[u8],
    xs: &[f64],
    value: impl Fn(u8) -> f64,
) -> f64 {
    let g = group.max(1) as usize;
    let groups = k.div_ceil(g);
    (0..groups)
        .map(|q| {
            let o = ((e * groups + q) * n + j) * 4;
            let s = op
                .group_scales
                .get(o..o + 4)
                .map_or(f32::NAN, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            let (lo, hi) = (q * g, ((q + 1) * g).min(k));
            let dot: f64 = row[lo..hi]
                .iter()
                .zip(&xs[lo..hi])
                .map(|(&c, &x)| value(c) * x)
                .sum();
            dot * f64::from(s)
        })
        .sum()
}

/// Host operands of one variant.
struct Operand<'a> {
    x: &'a [u8],
    w: &'a [u8],
    /// Per-token scales `[T]`, the per-tensor scale `[1]`, or block scales `[T, KB]` (reference
    /// layout; the kernel gets the transpose).
    x_scale: Vec<f32>,
    /// `[E]` or `[E, NB, KB]`.
    w_scale: Vec<f32>,
    /// 4-bit weights' group scales in the kernel's order (`W4::group_scale_at`), bytes.
    group_scales: Vec<u8>,
}

/// The reference rows `rows` (global row indices, with their experts) of the case.
fn reference_rows(cfg: &WsConfig, op: &Operand<'_>, rows: &[(usize, usize)]) -> Result<Vec<f64>> {
    let (n, k) = (cfg.n as usize, cfg.k as usize);
    let (kb, nb) = (k.div_ceil(128), n.div_ceil(128));
    let threads = std::thread::available_parallelism()
        .map(|t| t.get())
        .unwrap_or(1);
    let per = rows.len().div_ceil(threads).max(1);
    let mut parts: Vec<Option<crate::codegen::Result<Vec<f64>>>> =
        (0..rows.len().div_ceil(per)).map(|_| None).collect();
    std::thread::scope(|sc| {
        for (c, slot) in parts.iter_mut().enumerate() {
            let chunk = &rows[c * per..((c + 1) * per).min(rows.len())];
            sc.spawn(move || {
                let mut out = Vec::with_capacity(chunk.len() * n);
                for &(r, e) in chunk {
                    let g = Grouped::new(&[1], n, k);
                    let wr = e * n * k..(e + 1) * n * k;
                    let got = match (cfg.operands, cfg.scaling) {
                        (Operands::Bf16, _) => {
                            let u16s = |b: &[u8]| {
                                b.chunks(2)
                                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
                                    .collect::<Vec<u16>>()
                            };
                            reference::gemm_bf16(
                                &g,
                                &u16s(&op.x[2 * r * k..2 * (r + 1) * k]),
                                &u16s(&op.w[2 * wr.start..2 * wr.end]),
                            )
                        }
                        (Operands::E4m3, Scaling::Tensorwise { per_token }) => {
                            let s = if per_token {
                                ActScale::PerToken(&op.x_scale[r..r + 1])
                            } else {
                                ActScale::PerTensor(op.x_scale[0])
                            };
                            reference::gemm_fp8(
                                &g,
                                &op.x[r * k..(r + 1) * k],
                                s,
                                &op.w[wr],
                                &op.w_scale[e..e + 1],
                            )
                        }
                        // Per channel: the unit-scaled product times each row's scale.
                        (Operands::E4m3, Scaling::Channelwise { per_token }) => {
                            let s = if per_token {
                                ActScale::PerToken(&op.x_scale[r..r + 1])
                            } else {
                                ActScale::PerTensor(op.x_scale[0])
                            };
                            reference::gemm_fp8(&g, &op.x[r * k..(r + 1) * k], s, &op.w[wr], &[1.0])
                                .map(|v| {
                                    v.iter()
                                        .enumerate()
                                        .map(|(j, &y)| y * f64::from(op.w_scale[e * n + j]))
                                        .collect()
                                })
                        }
                        (Operands::I8Bf16, Scaling::PerRowGroup { group }) => {
                            // Per group: the codes' dot with bf16 activations (f64) times the
                            // row's scale of the group (`[E, groups, N]` f32).
                            let xs = bf16_row(&op.x[2 * r * k..2 * (r + 1) * k]);
                            let row = |j: usize| &op.w[wr.start + j * k..wr.start + (j + 1) * k];
                            Ok((0..n)
                                .map(|j| {
                                    group_dot(op, (e, j, n, k), group, row(j), &xs, |c| {
                                        f64::from(c as i8)
                                    })
                                })
                                .collect())
                        }
                        (Operands::I8Bf16, _) => {
                            // Int8 codes times the row scale, against bf16 activations (f64).
                            let xs = bf16_row(&op.x[2 * r * k..2 * (r + 1) * k]);
                            Ok((0..n)
                                .map(|j| {
                                    let row = &op.w[wr.start + j * k..wr.start + (j + 1) * k];
                                    let dot: f64 = row
                                        .iter()
                                        .zip(&xs)
                                        .map(|(&c, &x)| f64::from(c as i8) * x)
                                        .sum();
                                    dot * f64::from(op.w_scale[e * n + j])
                                })
                                .collect())
                        }
                        (Operands::W4Bf16(w4), _) => {
                            let xs = bf16_row(&op.x[2 * r * k..2 * (r + 1) * k]);
                            Ok((0..n)
                                .map(|j| {
                                    let dot: f64 = xs
                                        .iter()
                                        .enumerate()
                                        .map(|(kk, &x)| {
                                            let code = reference::w4_kernel_code(
                                                w4.codes,
                                                op.w,
                                                e * n + j,
                                                kk,
                                                k,
                                            );
                                            let at = w4.group_scale_at(
                                                n,
                                                k,
                                                e,
                                                j,
                                                kk / w4.group as usize,
                                            );
                                            let sc = w4
                                                .group_scale_element(&op.group_scales, at)
                                                .unwrap_or(u32::MAX);
                                            reference::w4_weight(w4, code, sc) * x
                                        })
                                        .sum();
                                    dot * f64::from(op.w_scale[e])
                                })
                                .collect())
                        }
                        (Operands::E4m3, Scaling::Groupwise { group, per_token }) => {
                            // Per group: the E4M3 codes' dot (f64) times the row's scale of the
                            // group (`[E, groups, N]` f32), then the activation's scale.
                            let e4m3 = |c: u8| f64::from(crate::codegen::reference::e4m3_to_f32(c));
                            let sx = f64::from(op.x_scale[if per_token { r } else { 0 }]);
                            let xs: Vec<f64> =
                                op.x[r * k..(r + 1) * k].iter().map(|&c| e4m3(c)).collect();
                            let row = |j: usize| &op.w[wr.start + j * k..wr.start + (j + 1) * k];
                            Ok((0..n)
                                .map(|j| group_dot(op, (e, j, n, k), group, row(j), &xs, e4m3) * sx)
                                .collect())
                        }
                        // (Paired rows, the fused epilogue: each row takes its `[gate; up]`
                        // row's block.)
                        (Operands::E4m3, _) => reference::gemm_fp8_block128_rows(
                            &g,
                            &op.x[r * k..(r + 1) * k],
                            &op.x_scale[r * kb..(r + 1) * kb],
                            &op.w[wr],
                            &op.w_scale[e * nb * kb..(e + 1) * nb * kb],
                            |c| {
                                if cfg.paired_blocks() {
                                    paired_row(c, n / 2, cfg.w_rows.up_first)
                                } else {
                                    c
                                }
                            },
                        ),
                    };
                    match got {
                        Ok(v) => out.extend(v),
                        Err(err) => {
                            *slot = Some(Err(err));
                            return;
                        }
                    }
                }
                *slot = Some(Ok(out));
            });
        }
    });
    let mut out = Vec::with_capacity(rows.len() * n);
    for p in parts {
        match p {
            Some(r) => out.extend(r?),
            None => return Err(Error::Usage("gemm reference: a task did not run".into())),
        }
    }
    Ok(out)
}

/// A row of bf16 bytes as f64.
fn bf16_row(b: &[u8]) -> Vec<f64> {
    b.chunks(2)
        .map(|c| f64::from(reference::bf16_to_f32(u16::from_le_bytes([c[0], c[1]]))))
        .collect()
}

/// Which rows to compare: all of them when the case is small, else each expert's first and last
/// row where 12 fit, and random others (24 rows in all: the f64 reference of an e4m3 model shape
/// costs seconds per row on the host).
fn sample_rows(rng: &mut Rng, starts: &[usize], n: usize, k: usize) -> Vec<(usize, usize)> {
    let t = starts[starts.len() - 1];
    let expert_of = |r: usize| starts.partition_point(|&s| s <= r) - 1;
    if (t as u64) * (n as u64) * (k as u64) <= 400_000_000 {
        return (0..t).map(|r| (r, expert_of(r))).collect();
    }
    // Each expert's first and last row where they fit in the cap, then random rows.
    let cap = 24usize;
    let mut edges: Vec<usize> = Vec::new();
    for w in starts.windows(2) {
        if w[1] > w[0] {
            edges.push(w[0]);
            edges.push(w[1] - 1);
        }
    }
    let mut rows: Vec<usize> = Vec::new();
    while rows.len() < cap / 2 && !edges.is_empty() {
        rows.push(edges.swap_remove(rng.below(edges.len())));
    }
    while rows.len() < cap {
        rows.push(rng.below(t));
    }
    rows.sort_unstable();
    rows.dedup();
    rows.into_iter().map(|r| (r, expert_of(r))).collect()
}

/// `w` (`[e, N, K]` in the GEMM's row order) stored as a recipe could store it for `cfg`'s row
/// modes: the modes laid out compactly in one of the orders whose row offsets [`wmap::fit`] reads
/// back as exactly `cfg.w_rows` (picked at random), after a random prefix of 16 to 128 bytes of
/// NaN (0xff) that the map's base skips. Returns the buffer and its map.
fn in_place_operand(
    rng: &mut Rng,
    cfg: &WsConfig,
    w: &[u8],
    e: usize,
) -> Result<(Vec<u8>, WLayout)> {
    let (n, rb) = (
        cfg.n as usize,
        cfg.k as usize * cfg.operands.bytes() as usize,
    );
    let ext: Vec<usize> = cfg
        .w_rows
        .extents(cfg.n)
        .iter()
        .map(|&x| x as usize)
        .collect();
    let m = ext.len();
    let place = |stride: &[usize], q: usize| {
        let (mut p, mut r) = (1, 0);
        for i in 0..m {
            r += ((q / p) % ext[i]) * stride[i];
            p *= ext[i];
        }
        r
    };
    // Every order of the modes (innermost first) whose compact strides fit back to `w_rows`.
    let mut orders: Vec<Vec<usize>> = vec![vec![]];
    for _ in 0..m {
        orders = orders
            .into_iter()
            .flat_map(|o| {
                (0..m)
                    .filter(|i| !o.contains(i))
                    .map(|i| {
                        let mut v = o.clone();
                        v.push(i);
                        v
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
    }
    let mut fits = Vec::new();
    for order in orders {
        let mut stride = vec![0usize; m];
        let mut acc = 1;
        for &i in &order {
            stride[i] = acc;
            acc *= ext[i];
        }
        let off: Vec<i64> = (0..n).map(|q| (place(&stride, q) * rb) as i64).collect();
        if let Ok(l) = wmap::fit(&off, (n * rb) as i64, e as u64, cfg.w_rows.up_first) {
            if l.rows == cfg.w_rows {
                fits.push((stride, l));
            }
        }
    }
    if fits.is_empty() {
        return Err(Error::Usage(format!(
            "GEMM check: no storage order of {}'s row modes {ext:?} fits them back",
            cfg.tag()
        )));
    }
    let (stride, mut layout) = fits.swap_remove(rng.below(fits.len()));
    let base = 16 * (1 + rng.below(8));
    layout.base = base as u64;
    let mut bytes = vec![0xffu8; base + e * n * rb];
    for x in 0..e {
        for q in 0..n {
            let from = (x * n + q) * rb;
            let to = base + (x * n + place(&stride, q)) * rb;
            bytes[to..to + rb].copy_from_slice(&w[from..from + rb]);
        }
    }
    Ok((bytes, layout))
}

fn upload<T: cudarc::driver::DeviceRepr>(
    dev: &Device,
    v: &[T],
) -> Result<cudarc::driver::CudaSlice<T>> {
    Ok(dev.stream.clone_htod(v).map_err(drv("cuMemcpyHtoD"))?)
}

/// One variant on one case: the verdict and its line.
fn run_one(
    dev: &Device,
    rng: &mut Rng,
    case: &Case,
    data: &Raw,
    cfg: &WsConfig,
    compiler: &crate::runtime::jit::Compiler,
) -> Result<(bool, String)> {
    let e = case.rows.len();
    let t: usize = case.rows.iter().sum();
    let (n, k) = (case.n as usize, case.k as usize);
    let (x_scale, w_scale) = scales(rng, cfg, t, e);
    let op = match cfg.operands {
        Operands::Bf16 => Operand {
            x: &data.x16,
            w: &data.w16,
            x_scale,
            w_scale,
            group_scales: Vec::new(),
        },
        // (Group-wise FP8: random f32 scales `[E, groups, N]`.)
        Operands::E4m3 => Operand {
            x: &data.x8,
            w: &data.w8,
            x_scale,
            w_scale,
            group_scales: match cfg.scaling.row_group() {
                Some(group) => (0..e * k.div_ceil(group as usize) * n)
                    .flat_map(|_| scale(rng).to_le_bytes())
                    .collect(),
                None => Vec::new(),
            },
        },
        // bf16 activations, the e4m3 codes' bytes as int8 codes (every byte is one); group-wise:
        // random f32 scales `[E, groups, N]`.
        Operands::I8Bf16 => Operand {
            x: &data.x16,
            w: &data.w8,
            x_scale,
            w_scale,
            group_scales: match cfg.scaling {
                Scaling::PerRowGroup { group } => (0..e * k.div_ceil(group as usize) * n)
                    .flat_map(|_| scale(rng).to_le_bytes())
                    .collect(),
                _ => Vec::new(),
            },
        },
        // bf16 activations, the first half of the e4m3 bytes as two 4-bit codes each (every
        // nibble is an E2M1 or U4 code), random group scales.
        Operands::W4Bf16(w4) => Operand {
            x: &data.x16,
            w: &data.w8[..e * n * k / 2],
            x_scale,
            w_scale,
            group_scales: group_scales(rng, w4, w4.group_scale_bytes(e, n, k)),
        },
    };
    let mut starts = vec![0usize];
    for r in &case.rows {
        starts.push(starts[starts.len() - 1] + r);
    }
    let offsets: Vec<i32> = starts.iter().map(|&s| s as i32).collect();
    // Compiled as the layer's GEMMs are (the settings' compiler), with no cache.
    let gemm = GroupedGemm::load_cached(dev, cfg, &crate::runtime::Cache::new(None), compiler)?;
    let dx = upload(dev, op.x)?;
    // Int8 codes go to the GPU in the kernel's order (the host reference reads them row-major);
    // weights read through row modes, stored in a permuted order of them.
    let in_place = if cfg.w_rows == WRows::PLAIN {
        None
    } else {
        Some(in_place_operand(rng, cfg, op.w, e)?)
    };
    let dw = match (&in_place, cfg.operands) {
        (Some((bytes, _)), _) => upload(dev, bytes)?,
        (None, Operands::I8Bf16) => upload(dev, &reference::i8_kernel_order(op.w, e * n, k))?,
        (None, _) => upload(dev, op.w)?,
    };
    let doff = upload(dev, &offsets)?;
    let xs_dev = if cfg.scaling == Scaling::Block128 {
        scales_group_major(&op.x_scale, t, k)?
    } else {
        op.x_scale.clone()
    };
    let dxs = if xs_dev.is_empty() {
        None
    } else {
        Some(upload(dev, &xs_dev)?)
    };
    let dws = if op.w_scale.is_empty() {
        None
    } else {
        Some(upload(dev, &op.w_scale)?)
    };
    let dgs = if op.group_scales.is_empty() {
        None
    } else {
        Some(upload(dev, &op.group_scales)?)
    };
    let (ob, cols) = (cfg.out.bytes() as usize, cfg.out_cols() as usize);
    // NaN poison: 0xff bytes are NaN in f32 and bf16.
    let mut dy = upload(dev, &vec![0xffu8; t * cols * ob])?;
    // The E4M3 output of `a`: codes poisoned with 0xff (an E4M3 NaN), scales with NaN, and a
    // random static scale per expert.
    let mut a_out = match cfg.epilogue.quant() {
        Some(q) => {
            let statics: Vec<f32> = (0..e).map(|_| scale(rng)).collect();
            Some((
                q,
                upload(dev, &vec![0xffu8; t * cols])?,
                upload(dev, &vec![f32::NAN; q.scales_len(t, cols)])?,
                upload(dev, &statics)?,
                statics,
            ))
        }
        None => None,
    };
    // The operands with an E4M3 output (a macro, not a closure: the two launches borrow the
    // output buffers for different spans).
    macro_rules! operands {
        ($act_out:expr) => {
            GemmOperands {
                x: &dx,
                w: &dw,
                offsets: &doff,
                x_scale: dxs.as_ref(),
                w_scale: dws.as_ref(),
                group_scales: dgs.as_ref(),
                w_layout: in_place.as_ref().map(|(_, l)| l),
                t,
                experts: e,
                act_out: $act_out,
            }
        };
    }
    let ops = operands!(a_out.as_ref().map(|(_, c, s, st, _)| ActOutBuffers {
        codes: c,
        scales: s,
        static_scales: Some(st),
        a_f32: true,
    }));
    // SAFETY: `offsets` is the exclusive prefix sum of the row counts: non-decreasing from 0,
    // ending at t.
    unsafe { gemm.run(dev, &ops, &mut dy) }?;
    dev.sync()?;
    let yb = dev.stream.clone_dtoh(&dy).map_err(drv("cuMemcpyDtoH"))?;
    let y: Vec<f32> = match cfg.out {
        OutTy::F32 => yb
            .chunks(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        OutTy::Bf16 => yb
            .chunks(2)
            .map(|c| reference::bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
    };
    let nan = y.iter().filter(|v| v.is_nan()).count();
    let sample = sample_rows(rng, &starts, n, k);
    let want = reference_rows(cfg, &op, &sample)?;
    // The fused epilogue: silu(gate) * up of the rows' paired weight rows, in f64.
    let want = match cfg.epilogue {
        Epilogue::Store => want,
        Epilogue::SiluMul | Epilogue::SiluMulE4m3(_) => want
            .chunks(n)
            .flat_map(|row| {
                (0..cols).map(move |o| {
                    let (first, second) =
                        (row[(o / 8) * 16 + o % 8], row[(o / 8) * 16 + 8 + o % 8]);
                    let (g, u) = if cfg.w_rows.up_first {
                        (second, first)
                    } else {
                        (first, second)
                    };
                    g / (1.0 + (-g).exp()) * u
                })
            })
            .collect(),
    };
    let got: Vec<f32> = sample
        .iter()
        .flat_map(|&(r, _)| y[r * cols..(r + 1) * cols].iter().copied())
        .collect();
    let rel = if want.is_empty() {
        0.0
    } else {
        reference::rel_frobenius(&got, &want)?
    };
    // The driver JIT's own report of registers and spills (a performance matter that the offline
    // ptxas check cannot see: the driver's JIT allocates per shape), printed, not judged.
    let (regs, spills) = gemm.jit_registers_and_spills();
    // The E4M3 output: the activation kernel's quantization (host reference, bit for bit) of
    // the kernel's own f32 `a`, over every row.
    // Then a second launch, its outputs poisoned again: the counted forms must give the same bits
    // (the finishing CTAs reset their token tiles' counters for it), and the static form, asked
    // for no f32 `a` (as the layer asks), the same codes and scales with `y` left unwritten.
    let (codes_ok, codes_note) = match a_out.as_mut() {
        None => (true, String::new()),
        Some((q, dc, ds, dst, statics)) => {
            let first_codes = dev.stream.clone_dtoh(&*dc).map_err(drv("cuMemcpyDtoH"))?;
            let first_scales = dev.stream.clone_dtoh(&*ds).map_err(drv("cuMemcpyDtoH"))?;
            let (mis_codes, mis_scales) = e4m3_mismatches(
                *q,
                &y,
                &starts,
                cols,
                statics,
                (&first_codes, &first_scales),
            )?;
            dev.stream
                .memcpy_htod(&vec![0xffu8; first_codes.len()], dc)
                .map_err(drv("cuMemcpyHtoD"))?;
            dev.stream
                .memcpy_htod(&vec![f32::NAN; first_scales.len()], ds)
                .map_err(drv("cuMemcpyHtoD"))?;
            let a_f32 = q.counted();
            if !a_f32 {
                dev.stream
                    .memcpy_htod(&vec![0xffu8; t * cols * ob], &mut dy)
                    .map_err(drv("cuMemcpyHtoD"))?;
            }
            let ops = operands!(Some(ActOutBuffers {
                codes: &*dc,
                scales: &*ds,
                static_scales: Some(&*dst),
                a_f32,
            }));
            // SAFETY: as for the first launch (the same offsets).
            unsafe { gemm.run(dev, &ops, &mut dy) }?;
            dev.sync()?;
            let codes = dev.stream.clone_dtoh(&*dc).map_err(drv("cuMemcpyDtoH"))?;
            let scales = dev.stream.clone_dtoh(&*ds).map_err(drv("cuMemcpyDtoH"))?;
            let same = codes == first_codes
                && scales
                    .iter()
                    .zip(&first_scales)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
            let y_kept = a_f32
                || dev
                    .stream
                    .clone_dtoh(&dy)
                    .map_err(drv("cuMemcpyDtoH"))?
                    .iter()
                    .all(|&b| b == 0xff);
            (
                mis_codes == 0 && mis_scales == 0 && same && y_kept,
                format!(
                    ", E4M3 a ({}): {mis_codes} codes and {mis_scales} scales differ from the activation kernel's; launched again{}: {}",
                    q.name(),
                    if a_f32 { "" } else { " without f32 a" },
                    match (same, y_kept) {
                        (true, true) => "the same bits",
                        (false, _) => "codes or scales differ",
                        (true, false) => "y was written",
                    }
                ),
            )
        }
    };
    let ok = nan == 0 && rel <= SPEC_BOUND && codes_ok;
    Ok((
        ok,
        format!(
            "gemm {:<22} E={e:<3} N={n:<5} K={k:<5} T={t:<5} grid {:>4} regs {} spill {}: rel_frobenius {rel:.2e} over {} rows, NaN {nan}{codes_note}: {}",
            cfg.tag(),
            gemm.grid(t, e),
            regs.map_or("?".into(), |r| r.to_string()),
            spills.map_or("?".into(), |b| format!("{b}B")),
            sample.len(),
            if ok { "ok" } else { "FAIL" }
        ),
    ))
}

/// Codes and scales of the fused GEMM's E4M3 output that differ (by bits) from the activation
/// kernel's host reference (`moe::act::reference`, `ActIn::F32`) of the kernel's own f32 `a`
/// (`y`, `[t, cols]`): every row of every expert (`starts`, the row offsets), each with its
/// expert's static scale for `AQuant::Static`.
pub fn e4m3_mismatches(
    q: AQuant,
    y: &[f32],
    starts: &[usize],
    cols: usize,
    statics: &[f32],
    (codes, scales): (&[u8], &[f32]),
) -> Result<(usize, usize)> {
    let t = *starts.last().unwrap_or(&0);
    let out = q.act_out();
    let mut row_scale = vec![0f32; t];
    for (ex, w) in starts.windows(2).enumerate() {
        let scale = statics.get(ex).copied().unwrap_or(1.0);
        row_scale
            .get_mut(w[0]..w[1])
            .ok_or_else(|| {
                crate::Error::Usage(format!("row offsets {w:?} out of order or past {t}"))
            })?
            .fill(scale);
    }
    let a = y.get(..t * cols).ok_or_else(|| {
        crate::Error::Usage(format!("`a` holds {} values, needs {}", y.len(), t * cols))
    })?;
    let (want_q, want_s) =
        crate::codegen::moe::act::reference(ActIn::F32, out, a, cols, t, &row_scale)?;
    let mis_codes = want_q.iter().zip(codes).filter(|(a, b)| a != b).count()
        + want_q.len().saturating_sub(codes.len());
    let mis_scales = want_s
        .iter()
        .zip(scales)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count()
        + want_s.len().saturating_sub(scales.len());
    Ok((mis_codes, mis_scales))
}

/// A line to stderr as it happens (a hung kernel then shows which variant it was).
fn progress(line: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// The v1 self-test over every case and variant (`only`: the variants whose tag contains one of
/// its comma-separated pieces): report lines and the verdict. Each line also goes to stderr as it
/// is made.
pub fn selftest(
    dev: &Device,
    seed: u64,
    quick: bool,
    compiler: &crate::runtime::jit::Compiler,
    only: Option<&str>,
) -> Result<(String, bool)> {
    let chosen = |cfg: &WsConfig| {
        only.is_none_or(|o| {
            let tag = cfg.tag();
            o.split(',')
                .any(|piece| !piece.is_empty() && tag.contains(piece))
        })
    };
    let mut out = String::new();
    let mut rng = Rng(seed ^ 0x9e37_79b9_7f4a_7c15);
    let mut all = true;
    let mut ran = 0usize;
    for case in cases(&mut rng, quick) {
        let rows_desc = if case.rows.len() <= 8 {
            format!("{:?}", case.rows)
        } else {
            format!(
                "{} experts, {}..={} rows each",
                case.rows.len(),
                case.rows.iter().min().copied().unwrap_or(0),
                case.rows.iter().max().copied().unwrap_or(0)
            )
        };
        let head = format!("case: {} (rows {rows_desc})", case.what);
        progress(&head);
        let _ = writeln!(out, "{head}");
        let t: usize = case.rows.iter().sum();
        let data = raw(
            &mut rng,
            t,
            case.rows.len(),
            case.n as usize,
            case.k as usize,
        );
        for cfg in variants(case.n, case.k).into_iter().filter(|c| chosen(c)) {
            ran += 1;
            let (ok, line) = run_one(dev, &mut rng, &case, &data, &cfg, compiler)?;
            progress(&line);
            all &= ok;
            let _ = writeln!(out, "  {line}");
        }
    }
    if ran == 0 {
        // An `--only` that matches nothing checked nothing: not a pass.
        all = false;
        let _ = writeln!(
            out,
            "gemm v1: no variant matches --only {}",
            only.unwrap_or_default()
        );
    }
    let _ = writeln!(
        out,
        "{}",
        if all {
            "gemm v1 (warp-specialized): every variant within bound on every case"
        } else {
            "gemm v1 (warp-specialized): FAILED"
        }
    );
    if !quick && only.is_none() {
        out.push_str(&decode_timing(dev, compiler)?);
    }
    Ok((out, all))
}

/// A figure, not a test: W8A16 and W4A16 (NVFP4, MXFP4, INT4 g128) against bf16 weights in the decode form on a DeepSeek-V3 EP8 w13
/// shape (32 experts of N = 4096, K = 7168, one token each), the kernels' times by CUDA events
/// (20 launches after a warm-up) and the weight bytes (codes and group scales) streamed per second.
fn decode_timing(dev: &Device, compiler: &crate::runtime::jit::Compiler) -> Result<String> {
    let (e, n, k) = (32usize, 4096usize, 7168usize);
    let t = e;
    let offsets: Vec<i32> = (0..=e as i32).collect();
    let doff = upload(dev, &offsets)?;
    let dx = upload(dev, &vec![0x3fu8; t * k * 2])?;
    let dws = upload(dev, &vec![1.0f32 / 64.0; e * n])?;
    let mut out = String::new();
    let dwe = upload(dev, &vec![1.0f32 / 64.0; e])?;
    for (operands, scaling, bn, stages) in [
        (Operands::Bf16, Scaling::None, 8u32, 8u32),
        (Operands::I8Bf16, Scaling::PerRow, 8, 8),
        (Operands::I8Bf16, Scaling::PerRow, 8, 4),
        (Operands::I8Bf16, Scaling::PerRow, 16, 8),
        (W4_FORMATS[0], Scaling::PerExpert, 8, 8),
        (W4_FORMATS[0], Scaling::PerExpert, 8, 4),
        (W4_FORMATS[1], Scaling::PerExpert, 8, 8),
        (W4_FORMATS[2], Scaling::PerExpert, 8, 8),
    ] {
        let cfg = WsConfig {
            operands,
            scaling,
            out: OutTy::Bf16,
            epilogue: Epilogue::Store,
            consumers: 1,
            bn,
            stages,
            swap_ab: true,
            split_k: 1,
            n: n as u32,
            k: k as u32,
            w_rows: WRows::PLAIN,
            two_slices: false,
            skip_idle: false,
        };
        let wbytes = e * n * operands.w_row_bytes(k as u64) as usize;
        let dw = upload(dev, &vec![0x11u8; wbytes])?;
        // 4-bit weights: their group scales (0x3c: an E4M3 1.5, E8M0 2^-67, bf16 pairs of 2^-7),
        // counted in the bytes streamed.
        let dgs = match operands {
            Operands::W4Bf16(w4) => {
                Some(upload(dev, &vec![0x3cu8; w4.group_scale_bytes(e, n, k)])?)
            }
            _ => None,
        };
        let wbytes = wbytes + dgs.as_ref().map_or(0, |g| g.len());
        let gemm =
            GroupedGemm::load_cached(dev, &cfg, &crate::runtime::Cache::new(None), compiler)?;
        let mut dy = upload(dev, &vec![0u8; t * n * 2])?;
        let ops = GemmOperands {
            act_out: None,
            x: &dx,
            w: &dw,
            offsets: &doff,
            x_scale: None,
            w_scale: match scaling {
                Scaling::PerRow => Some(&dws),
                Scaling::PerExpert => Some(&dwe),
                _ => None,
            },
            group_scales: dgs.as_ref(),
            w_layout: None,
            t,
            experts: e,
        };
        let st = &dev.stream;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        // SAFETY: `offsets` is 0..=e: one row per expert, non-decreasing, ending at t.
        unsafe { gemm.run(dev, &ops, &mut dy) }?;
        let reps = 20;
        let a = st.record_event(timing).map_err(drv("cuEventRecord"))?;
        for _ in 0..reps {
            // SAFETY: as above.
            unsafe { gemm.run(dev, &ops, &mut dy) }?;
        }
        let b = st.record_event(timing).map_err(drv("cuEventRecord"))?;
        dev.sync()?;
        let ms = f64::from(a.elapsed_ms(&b).map_err(drv("cuEventElapsedTime"))?) / reps as f64;
        let _ = writeln!(
            out,
            "gemm decode timing {} (E={e} N={n} K={k}, 1 token per expert, {reps} launches, CUDA events): {:.1} us, weights {:.2} TB/s",
            cfg.tag(),
            ms * 1e3,
            wbytes as f64 / (ms * 1e-3) / 1e12
        );
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn group_major_transposes() {
        let s: Vec<f32> = (0..6).map(|v| v as f32).collect();
        // [T = 2, KB = 3] -> [3, 2]
        assert_eq!(
            scales_group_major(&s, 2, 3 * 128).unwrap(),
            vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
        );
    }

    /// Every variant of every case is one the generator accepts, and the cases hold the named
    /// shape classes.
    #[test]
    fn the_cases_and_variants_are_valid() {
        let mut rng = Rng(0x1234_5678_9abc_def1);
        let all = cases(&mut rng, false);
        assert!(all.iter().any(|c| c.rows.contains(&0)));
        assert!(all.iter().any(|c| c.rows.iter().sum::<usize>() == 1));
        assert!(all.iter().any(|c| c.n % 128 != 0 && c.k % 128 != 0));
        let skew = &all[1];
        assert!(skew.rows[5] * 2 > skew.rows.iter().sum::<usize>());
        for c in &all {
            for v in variants(c.n, c.k) {
                crate::codegen::gemm::ws::grouped_ws_entry("k", &v).unwrap();
            }
        }
        let quick = cases(&mut rng, true);
        assert_eq!(quick.len(), 3);
        // The sanitizers' set holds a case past the scan warp's 32 experts.
        assert!(quick.iter().any(|c| c.rows.len() > 64 && c.rows[64] > 0));
    }

    /// The sample holds every expert's first and last row.
    #[test]
    fn the_sample_covers_every_expert_edge() {
        let mut rng = Rng(7);
        let starts = vec![0, 3, 3, 100, 4096];
        let s = sample_rows(&mut rng, &starts, 4096, 7168);
        for r in [0, 2, 3, 99, 100, 4095] {
            assert!(s.iter().any(|&(x, _)| x == r), "{r}");
        }
        assert!(s.iter().all(|&(r, e)| starts[e] <= r && r < starts[e + 1]));
        let all = sample_rows(&mut rng, &[0, 2, 5], 8, 8);
        assert_eq!(all.len(), 5);
    }
}
