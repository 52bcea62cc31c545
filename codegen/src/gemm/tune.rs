//! The candidate set of the warp-specialized grouped GEMM ([`super::ws`]) per kernel family and
//! shape, and the default choice for a shape bucket before (or without) autotuning.
//!
//! Prefill candidates put tokens on the M side (two consumer warpgroups, 128 token rows) with a
//! 128- or 256-wide weight tile (block-scaled: 128 or 192); decode candidates swap A and B (64 weight rows on the M side) with
//! 8 to 64 tokens on the N side and a deep ring of stages, so that the weights stream with enough
//! bytes in flight.

use super::ws::{Epilogue, Operands, OutTy, Scaling, WRows, WsConfig};

/// `(consumers, BN, stages, swap_ab, split_k)` of the prefill candidates, bf16 and tensorwise
/// e4m3.
const PREFILL: [(u32, u32, u32, bool, u32); 2] = [(2, 128, 6, false, 1), (2, 256, 4, false, 1)];
/// The block-scaled prefill candidates: two consumers of one slice accumulator each beside the
/// total, 128 weight rows (one scale block), or 192 (96 + 96 registers, two blocks' scales).
const PREFILL_BLOCK: [(u32, u32, u32, bool, u32); 2] =
    [(2, 128, 6, false, 1), (2, 192, 5, false, 1)];
/// The decode candidates (tokens per expert as the wgmma N), then split-K ones for layers whose
/// tiles would not fill the SMs.
const DECODE: [(u32, u32, u32, bool, u32); 7] = [
    (1, 8, 8, true, 1),
    (1, 16, 8, true, 1),
    (1, 32, 8, true, 1),
    (1, 64, 6, true, 1),
    (1, 8, 8, true, 2),
    (1, 8, 8, true, 4),
    (1, 16, 8, true, 2),
];

/// The 4-bit weights' extra decode candidate: 8 tokens with a 4-stage ring (on the H200, NVFP4's
/// DeepSeek-V3 w13 at one token per expert: 286.7 us against 296.7 with 8 stages; its dequantization,
/// not the bytes in flight, is the limit).
const DECODE_W4: [(u32, u32, u32, bool, u32); 1] = [(1, 8, 4, true, 1)];

/// The register-A families' wide tiles (int8 and 4-bit weights are always wgmma's A): first two
/// consumers (128 weight rows) with 8 or 16 tokens and one producer warp, which halves the
/// producer's TMA issue per weight row (its loop was about an eighth of the decode kernel's
/// instructions); then 128 tokens
/// per weight tile with one consumer, so that at prefill each weight tile is loaded and
/// dequantized once per 128 token rows instead of once per 64; then the prefill form, two
/// consumers (128 weight rows) sharing each 128- or 256-token tile, so that a token tile is read
/// once per 128 weight rows (at 64 the tokens' re-reads from L2 outweigh the weights), and one
/// consumer's dequantization runs while the other's MMAs do. (One consumer with 256 tokens, 3
/// stages, was never the tuner's choice on the H200, run 32.)
const WIDE_REGISTER_A: [(u32, u32, u32, bool, u32); 5] = [
    (2, 8, 8, true, 1),
    (2, 16, 8, true, 1),
    (1, 128, 4, true, 1),
    (2, 128, 4, true, 1),
    (2, 256, 4, true, 1),
];

/// Every candidate of the family `(operands, scaling)` at `N = n`, `K = k`, bf16 output: prefill
/// first, then decode by growing token tile.
pub fn candidates(operands: Operands, scaling: Scaling, n: u32, k: u32) -> Vec<WsConfig> {
    let prefill: &[(u32, u32, u32, bool, u32)] = match (operands, scaling) {
        // Int8 and 4-bit weights (register-sourced A): the swapped (weights-on-A) form only,
        // unsplit; their prefill tiles are among the wide ones below.
        (Operands::I8Bf16 | Operands::W4Bf16(_), _) => &[],
        // Group-wise FP8: its prefill form (the block-scaled tile; the row scales on the B side)
        // was 3-9% slower than the swapped two-consumer 128-token tile below at 2048 and 8192
        // tokens on both models (run 72), so only the latter is a candidate; the GEMM check
        // still covers the form.
        (_, Scaling::Groupwise { .. }) => &[],
        (_, Scaling::Block128) => &PREFILL_BLOCK,
        _ => &PREFILL,
    };
    let int8 = operands.register_a();
    let w4: &[(u32, u32, u32, bool, u32)] = match operands {
        Operands::W4Bf16(_) => &DECODE_W4,
        _ => &[],
    };
    // Group-wise FP8: its prefill tile, the swapped form's two consumers (128 weight rows)
    // sharing a 128-token tile.
    let wide: &[(u32, u32, u32, bool, u32)] = if int8 {
        &WIDE_REGISTER_A
    } else if scaling.row_group().is_some() {
        &[(2, 128, 4, true, 1)]
    } else {
        &[]
    };
    prefill
        .iter()
        .chain(DECODE.iter())
        .chain(w4)
        .chain(wide)
        .filter(|&&(_, _, _, _, split_k)| split_k <= k.div_ceil(operands.bk()))
        // Register-sourced A unsplit: the generator serves its split-K (the GEMM check covers it),
        // but d2x8 split in two was never the tuner's choice on the H200 (run 62: NVFP4 at
        // DeepSeek-V3 1 token 71.0 us against 56.6 unsplit).
        .filter(|&&(_, _, _, _, split_k)| !int8 || split_k == 1)
        // Group-wise int8 and FP8: a second accumulator (the group's partial sum) caps BN at 64
        // (128 with two consumers).
        .filter(|&&(consumers, bn, _, _, _)| {
            scaling.row_group().is_none() || bn <= if consumers >= 2 { 128 } else { 64 }
        })
        .map(|&(consumers, bn, stages, swap_ab, split_k)| WsConfig {
            operands,
            scaling,
            out: OutTy::Bf16,
            epilogue: Epilogue::Store,
            consumers,
            bn,
            stages,
            swap_ab,
            split_k,
            n,
            k,
            w_rows: WRows::PLAIN,
            two_slices: false,
            skip_idle: false,
        })
        // Block-scaled prefill: the two-slice twin of each two-consumer tile after it (so that
        // the untuned default stays the one-slice form, which the driver's JIT does not spill).
        .flat_map(|c| {
            let twin = (c.scaling == Scaling::Block128 && c.consumers == 2 && c.bn <= 128)
                .then_some(WsConfig {
                    two_slices: true,
                    ..c
                });
            std::iter::once(c).chain(twin)
        })
        .collect()
}

/// `all` with, after each configuration that can take it, its twin that skips the MMAs of a
/// consumer whose token rows all lie past its expert's end ([`WsConfig::skip_idle`]): the tuner
/// then times both. Not in [`candidates`] until measured faster (`MOEFORGE_IDLE_SKIP=1` asks for
/// it in the benchmarks and the layer's tuning).
pub fn with_idle_twins(all: Vec<WsConfig>) -> Vec<WsConfig> {
    all.into_iter()
        .flat_map(|c| {
            let twin = WsConfig {
                skip_idle: true,
                ..c
            };
            let twin = (!c.skip_idle && twin.supported().is_ok()).then_some(twin);
            std::iter::once(c).chain(twin)
        })
        .collect()
}

/// The widest one-consumer token tile the untuned default takes (the register-A families' wide
/// decode tile).
const DEFAULT_MAX_TOKEN_TILE: u32 = 128;

/// The default candidate for `rows` token rows over `active` experts that received any (the
/// untuned choice): a one-consumer decode tile, the smallest whose tokens hold the mean rows per
/// active expert (up to 64, or 128 for the register-A families' wide tile); else the first prefill
/// candidate; else, for the register-A families (no prefill form with tokens on A), their
/// two-consumer tile with the most tokens (the tuner's choice at 2048 and 8192 tokens on the H200,
/// run 35, but for one of 20 GEMMs); else the widest one-consumer tile.
pub fn default_choice(all: &[WsConfig], rows: usize, active: usize) -> Option<&WsConfig> {
    let mean = rows.div_ceil(active.max(1));
    let decode = || {
        all.iter().filter(|c| {
            c.swap_ab && c.consumers == 1 && c.split_k == 1 && c.bn <= DEFAULT_MAX_TOKEN_TILE
        })
    };
    decode()
        .find(|c| c.bn as usize >= mean)
        .or_else(|| all.iter().find(|c| !c.swap_ab))
        .or_else(|| {
            all.iter()
                .filter(|c| c.swap_ab && c.consumers == 2)
                .max_by_key(|c| c.bn)
        })
        .or_else(|| decode().max_by_key(|c| c.bn))
}

/// The shape bucket of `rows` token rows (what tuning results are keyed by): the next power of two.
pub fn bucket(rows: usize) -> usize {
    rows.max(1).next_power_of_two()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::gemm::ws::grouped_ws_entry;

    #[test]
    fn every_candidate_generates_for_every_family() {
        for (o, s) in [
            (Operands::Bf16, Scaling::None),
            (Operands::E4m3, Scaling::Tensorwise { per_token: true }),
            (Operands::E4m3, Scaling::Tensorwise { per_token: false }),
            (Operands::E4m3, Scaling::Block128),
        ] {
            let all = candidates(o, s, 4096, 7168);
            assert!(all.len() >= 5);
            assert!(all.iter().any(|c| c.swap_ab) && all.iter().any(|c| !c.swap_ab));
            for c in &all {
                grouped_ws_entry("k", c).unwrap();
            }
            let tags: std::collections::BTreeSet<String> = all.iter().map(|c| c.tag()).collect();
            assert_eq!(tags.len(), all.len(), "tags are unique");
        }
        // Int8 weights: the swapped (weights-on-A) form only (every token count runs it), unsplit.
        let all = candidates(Operands::I8Bf16, Scaling::PerRow, 4096, 7168);
        // Four decode tiles, the two-consumer decode ones, the wide one and the two-consumer
        // prefill forms.
        assert_eq!(all.len(), 9);
        assert!(all
            .iter()
            .any(|c| c.bn == 256 && c.consumers == 2 && c.stages == 4));
        for c in &all {
            assert!(c.swap_ab && c.split_k == 1);
            assert!(c.consumers == 1 || c.bn >= 128 || c.bn <= 16);
            assert_eq!(c.reallocates_registers(), c.consumers == 2 && c.bn >= 128);
            assert_eq!(c.producer_warp(), c.consumers == 1 || c.bn <= 16);
            assert_eq!(
                c.threads(),
                if c.producer_warp() {
                    128 * c.consumers + 32
                } else {
                    384
                }
            );
            grouped_ws_entry("k", c).unwrap();
        }
        // 4-bit weights: the same, plus 8 tokens with 4 stages.
        let w4 = candidates(
            Operands::W4Bf16(crate::gemm::ws::W4::NVFP4),
            Scaling::PerExpert,
            4096,
            7168,
        );
        assert_eq!(w4.len(), 10);
        assert!(w4
            .iter()
            .any(|c| c.consumers == 2 && c.bn == 8 && c.producer_warp()));
        assert!(w4.iter().any(|c| c.bn == 8 && c.stages == 4));
        assert!(w4.iter().any(|c| c.bn == 128 && c.stages == 4));
        for c in &w4 {
            grouped_ws_entry("k", c).unwrap();
        }
        // With no prefill candidate, the default is the one-consumer tile that holds the rows,
        // else the two-consumer prefill form with the most tokens.
        let d = default_choice(&all, 100 * 8, 8).unwrap();
        assert_eq!((d.consumers, d.bn), (1, 128));
        let d = default_choice(&all, 200 * 8, 8).unwrap();
        assert_eq!((d.consumers, d.bn), (2, 256));
        let d = default_choice(&all, 10_000, 1).unwrap();
        assert_eq!((d.consumers, d.bn), (2, 256));
        let d = default_choice(&w4, 3 * 8, 8).unwrap();
        assert_eq!((d.consumers, d.bn), (1, 8));
        // The wide tiles are the register-A families' only.
        for (o, s) in [
            (Operands::Bf16, Scaling::None),
            (Operands::E4m3, Scaling::Block128),
        ] {
            assert!(candidates(o, s, 4096, 7168)
                .iter()
                .all(|c| !c.swap_ab || c.bn <= 64));
        }
    }

    #[test]
    fn the_default_follows_rows_per_expert() {
        let all = candidates(Operands::Bf16, Scaling::None, 4096, 7168);
        assert_eq!(default_choice(&all, 8, 8).unwrap().bn, 8);
        assert_eq!(default_choice(&all, 128, 8).unwrap().bn, 16);
        assert_eq!(default_choice(&all, 512, 32).unwrap().bn, 16);
        assert_eq!(default_choice(&all, 64 * 8, 8).unwrap().bn, 64);
        assert!(!default_choice(&all, 65 * 8, 8).unwrap().swap_ab);
        assert!(!default_choice(&all, 65536, 8).unwrap().swap_ab);
        assert_eq!(bucket(0), 1);
        assert_eq!(bucket(5), 8);
        assert_eq!(bucket(512), 512);
    }
}
