//! Host-side tests of the warp-specialized grouped GEMM generator (`gemm::ws`) through its public
//! API: the tile walk (`tile_of`, and the kernel's warp scan resumed across a CTA's tiles,
//! `TileScan`) against an independent enumeration, the configurations
//! `WsConfig` refuses, determinism, and the structure of the generated text (what defines the
//! design: thread count, register reallocation, the MMA shape, the pipeline's barriers, the TMA
//! loads, the epilogue's conversions and stores), not its register numbering. A proptest checks
//! that every tuning candidate generates at random shapes and that `tiles_upper_bound` bounds the
//! walk.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;

use moeforge_codegen::gemm::finish;
use moeforge_codegen::gemm::tune;
use moeforge_codegen::gemm::ws::{
    self, grouped_ws_entry, grouped_ws_module, tile_of, Epilogue, Operands, OutTy, Scaling, WRows,
    WsConfig, WsTile,
};
use moeforge_codegen::ptx::PTX_VERSION;
use proptest::prelude::*;

/// The kernel families: (operands, scaling) as the plan uses them.
const FAMILIES: [(Operands, Scaling); 6] = [
    (Operands::Bf16, Scaling::None),
    (Operands::E4m3, Scaling::Tensorwise { per_token: true }),
    (Operands::E4m3, Scaling::Tensorwise { per_token: false }),
    (Operands::E4m3, Scaling::Block128),
    (Operands::E4m3, Scaling::Channelwise { per_token: true }),
    (Operands::E4m3, Scaling::Channelwise { per_token: false }),
];

#[allow(clippy::too_many_arguments)]
fn cfg(
    operands: Operands,
    scaling: Scaling,
    out: OutTy,
    consumers: u32,
    bn: u32,
    stages: u32,
    swap_ab: bool,
    n: u32,
    k: u32,
) -> WsConfig {
    WsConfig {
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
    }
}

/// bf16 prefill, two consumers, BN 128, 4 stages, N 4096, K 7168, bf16 output.
fn base() -> WsConfig {
    cfg(
        Operands::Bf16,
        Scaling::None,
        OutTy::Bf16,
        2,
        128,
        4,
        false,
        4096,
        7168,
    )
}

/// bf16 decode, one consumer, 16 tokens, 8 stages.
fn decode() -> WsConfig {
    WsConfig {
        consumers: 1,
        bn: 16,
        stages: 8,
        swap_ab: true,
        ..base()
    }
}

fn offsets_of(rows: &[usize]) -> Vec<usize> {
    let mut o = vec![0];
    for r in rows {
        o.push(o.last().unwrap() + r);
    }
    o
}

/// The tiles of the raster order, enumerated directly: experts in order; inside an expert, groups
/// of `raster_group` weight tiles (the last group may be narrower), and inside a group token tile
/// major, weight tile minor.
fn enumerate(c: &WsConfig, offsets: &[usize]) -> Vec<WsTile> {
    let (tt, tw) = (c.tile_tokens() as usize, c.tile_weights() as usize);
    let g = c.raster_group() as usize;
    let nt = (c.n as usize).div_ceil(tw);
    let mut v = Vec::new();
    for e in 0..offsets.len() - 1 {
        let (lo, hi) = (offsets[e], offsets[e + 1]);
        let mut g0 = 0;
        while g0 < nt {
            let mut t0 = lo;
            while t0 < hi {
                for wt in g0..(g0 + g).min(nt) {
                    v.push(WsTile {
                        expert: e,
                        tokens: t0..hi,
                        weight0: wt * tw,
                    });
                }
                t0 += tt;
            }
            g0 += g;
        }
    }
    v
}

/// Every tile `tile_of` yields, from id 0 until the first `None`.
fn walk(c: &WsConfig, offsets: &[usize]) -> Vec<WsTile> {
    (0..)
        .map_while(|id| tile_of(c, offsets, id))
        .collect::<Vec<_>>()
}

fn check_walk(c: &WsConfig, rows: &[usize]) {
    let offsets = offsets_of(rows);
    let got = walk(c, &offsets);
    let want = enumerate(c, &offsets);
    assert_eq!(got, want, "{} rows {rows:?}", c.tag());
    // Past the last tile there is none, however far.
    assert_eq!(tile_of(c, &offsets, got.len() + 1), None);
    assert_eq!(tile_of(c, &offsets, usize::MAX / 2), None);
    // What defines a tile, checked on its own: in expert order, every (token tile, weight tile)
    // pair once, token ranges ending at the expert's end, weight0 < N.
    let mut seen = BTreeSet::new();
    let mut last_expert = 0;
    for t in &got {
        assert!(t.expert >= last_expert, "experts in order");
        last_expert = t.expert;
        assert_eq!(t.tokens.end, offsets[t.expert + 1]);
        assert!(t.tokens.start >= offsets[t.expert] && t.tokens.start < t.tokens.end);
        assert_eq!(
            (t.tokens.start - offsets[t.expert]) % c.tile_tokens() as usize,
            0
        );
        assert!(t.weight0 < c.n as usize);
        assert_eq!(t.weight0 % c.tile_weights() as usize, 0);
        assert!(seen.insert((t.tokens.start, t.weight0)), "a tile twice");
    }
    let per_expert: usize = rows
        .iter()
        .map(|r| r.div_ceil(c.tile_tokens() as usize) * c.weight_tiles() as usize)
        .sum();
    assert_eq!(got.len(), per_expert);
}

/// A CTA's tiles `c, c + grid, ...` found by one resumed [`ws::TileScan`] (as the kernel keeps its
/// cursor) are the enumeration's, for every CTA.
fn check_resumed(c: &WsConfig, rows: &[usize], grid: usize) {
    let offsets = offsets_of(rows);
    let want = enumerate(c, &offsets);
    for cta in 0..grid {
        let mut scan = ws::TileScan::new(c, &offsets);
        let mut id = cta;
        loop {
            let got = scan.find(id);
            assert_eq!(
                got.as_ref(),
                want.get(id),
                "{} rows {rows:?} id {id}",
                c.tag()
            );
            if got.is_none() {
                break;
            }
            id += grid;
        }
    }
}

#[test]
fn the_warp_scan_resumes_over_many_experts() {
    // More experts than a warp has lanes: steps of 32 that find nothing, hits at lane 0 and 31,
    // empty experts at a step's edge, and the last step part past the last expert.
    let mut rows = vec![0usize; 130];
    for (e, r) in [
        (0, 1),
        (31, 3),
        (32, 1),
        (33, 70),
        (63, 2),
        (64, 9),
        (95, 1),
        (129, 5),
    ] {
        rows[e] = r;
    }
    let dec = WsConfig { n: 300, ..decode() };
    for c in [base(), decode(), dec] {
        check_walk(&c, &rows);
        for grid in [1, 3, 7, 132] {
            check_resumed(&c, &rows, grid);
        }
    }
    // Only the last expert holds rows (the scan crosses four empty steps), and none does.
    let mut last = vec![0usize; 128];
    last[127] = 1;
    check_walk(&decode(), &last);
    check_resumed(&decode(), &last, 5);
    check_walk(&decode(), &[0; 128]);
    assert_eq!(tile_of(&decode(), &offsets_of(&[0; 128]), 0), None);
}

#[test]
fn tile_of_walks_the_tiles_of_fixed_row_counts() {
    let prefill = WsConfig { n: 300, ..base() };
    let dec = WsConfig { n: 300, ..decode() };
    for c in [base(), prefill, decode(), dec] {
        for rows in [
            vec![],
            vec![0],
            vec![0, 0, 0],
            vec![1],
            vec![128, 0, 129, 0],
            vec![0, 0, 5, 0, 16, 17, 255, 256, 257],
            vec![1000],
        ] {
            check_walk(&c, &rows);
        }
    }
    // A small case by hand: BN 128 prefill over N 300 has 3 weight tiles; 130 rows are 2 token
    // tiles of 128.
    let c = WsConfig { n: 300, ..base() };
    let offsets = [0, 0, 130, 131];
    assert_eq!(
        tile_of(&c, &offsets, 0),
        Some(WsTile {
            expert: 1,
            tokens: 0..130,
            weight0: 0
        })
    );
    assert_eq!(
        tile_of(&c, &offsets, 5),
        Some(WsTile {
            expert: 1,
            tokens: 128..130,
            weight0: 256
        })
    );
    assert_eq!(
        tile_of(&c, &offsets, 6),
        Some(WsTile {
            expert: 2,
            tokens: 130..131,
            weight0: 0
        })
    );
    assert_eq!(tile_of(&c, &offsets, 9), None);
}

fn rows_strategy() -> impl Strategy<Value = Vec<usize>> {
    // Experts with no rows are common in MoE: a third of them here.
    prop::collection::vec(prop_oneof![Just(0usize), 1usize..300, 0usize..2000], 0..70)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn tile_of_walks_the_tiles_of_random_row_counts(
        rows in rows_strategy(),
        family in 0..FAMILIES.len(),
        which in 0usize..16,
        n in 1u32..=1536,
    ) {
        let (o, s) = FAMILIES[family];
        let all = tune::candidates(o, s, 2 * n, 1024);
        let c = all[which % all.len()];
        check_walk(&c, &rows);
        check_resumed(&c, &rows, 132);
        // Also with a base row offset (the first expert need not start at row 0).
        let mut shifted = offsets_of(&rows);
        for v in shifted.iter_mut() {
            *v += 7;
        }
        let got = walk(&c, &shifted);
        prop_assert_eq!(got, enumerate(&c, &shifted));
    }

    #[test]
    fn every_candidate_generates_and_the_tile_bound_holds(
        family in 0..FAMILIES.len(),
        which in 0usize..16,
        n2 in 4u32..=4096,
        k16 in 1u32..=1024,
        rows in rows_strategy(),
    ) {
        let (n, k) = (2 * n2, 16 * k16);
        let (o, s) = FAMILIES[family];
        let all = tune::candidates(o, s, n, k);
        prop_assert!(!all.is_empty());
        let c = all[which % all.len()];
        prop_assert_eq!((c.n, c.k, c.operands, c.scaling), (n, k, o, s));
        let text = grouped_ws_entry("moeforge_gemm_prop", &c);
        prop_assert!(text.is_ok(), "{}: {:?}", c.tag(), text.err());
        let t: usize = rows.iter().sum();
        let tiles = walk(&c, &offsets_of(&rows)).len() as u64;
        let bound = c.tiles_upper_bound(t as u64, rows.len() as u64);
        prop_assert!(bound >= tiles, "{}: {bound} < {tiles} for {rows:?}", c.tag());
    }
}

#[test]
fn the_tile_bound_is_reached_by_ragged_experts() {
    // Every expert one row past a whole token tile: two token tiles each, within the bound.
    let c = base();
    let tt = c.tile_tokens() as usize;
    let rows = vec![tt + 1; 5];
    let tiles = walk(&c, &offsets_of(&rows)).len() as u64;
    assert_eq!(tiles, 10 * u64::from(c.weight_tiles()));
    assert!(c.tiles_upper_bound(5 * (tt as u64 + 1), 5) >= tiles);
    assert_eq!(c.tiles_upper_bound(0, 0), 0);
    assert_eq!(c.tiles_upper_bound(0, 3), 0, "no rows, no tiles");
    assert_eq!(
        c.tiles_upper_bound(1, 128),
        2 * u64::from(c.weight_tiles()),
        "one row: one token tile of one expert, plus one for the ragged start"
    );
}

fn refused(c: &WsConfig) -> String {
    match grouped_ws_entry("k", c) {
        Ok(_) => panic!("{c:?} was accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn the_configurations_ws_refuses() {
    let e4m3 = WsConfig {
        operands: Operands::E4m3,
        scaling: Scaling::Tensorwise { per_token: true },
        ..base()
    };
    let block = WsConfig {
        scaling: Scaling::Block128,
        ..e4m3
    };
    for (c, why) in [
        // Consumers: 1 or 2.
        (
            WsConfig {
                consumers: 0,
                ..base()
            },
            "consumer",
        ),
        (
            WsConfig {
                consumers: 3,
                ..base()
            },
            "consumer",
        ),
        // BN: a multiple of 8 in 8..=256.
        (WsConfig { bn: 0, ..base() }, "N = 0"),
        (WsConfig { bn: 12, ..base() }, "N = 12"),
        (WsConfig { bn: 100, ..base() }, "N = 100"),
        (WsConfig { bn: 264, ..base() }, "N = 264"),
        (
            WsConfig {
                bn: 264,
                ..decode()
            },
            "N = 264",
        ),
        // Decode: a power-of-two token tile.
        (WsConfig { bn: 24, ..decode() }, "power of two"),
        (WsConfig { bn: 48, ..decode() }, "power of two"),
        (
            WsConfig {
                bn: 192,
                ..decode()
            },
            "power of two",
        ),
        // Stages: 2 to MAX_STAGES, within the shared memory.
        (
            WsConfig {
                stages: 0,
                ..base()
            },
            "stages",
        ),
        (
            WsConfig {
                stages: 1,
                ..base()
            },
            "stages",
        ),
        (
            WsConfig {
                stages: ws::MAX_STAGES + 1,
                ..decode()
            },
            "stages",
        ),
        (
            WsConfig {
                bn: 256,
                stages: 5,
                ..base()
            },
            "shared memory",
        ),
        (
            WsConfig {
                stages: 8,
                ..base()
            },
            "shared memory",
        ),
        // N and K: N even and positive, K aligned to 16 bytes.
        (WsConfig { k: 12, ..base() }, "K = 12"),
        (WsConfig { k: 4, ..base() }, "K = 4"),
        (WsConfig { k: 0, ..base() }, "K = 0"),
        (WsConfig { k: 24, ..e4m3 }, "K = 24"),
        (WsConfig { k: 8, ..e4m3 }, "K = 8"),
        (WsConfig { n: 4095, ..base() }, "N = 4095"),
        (WsConfig { n: 1, ..decode() }, "N = 1"),
        (WsConfig { n: 0, ..base() }, "N = 0"),
        (
            WsConfig {
                k: (1 << 24) + 16,
                ..e4m3
            },
            "2^24",
        ),
        (
            WsConfig {
                n: (1 << 24) + 2,
                ..base()
            },
            "2^24",
        ),
        // Operands and scaling that do not go together.
        (
            WsConfig {
                scaling: Scaling::Tensorwise { per_token: true },
                ..base()
            },
            "bf16 operands",
        ),
        (
            WsConfig {
                scaling: Scaling::Tensorwise { per_token: false },
                ..decode()
            },
            "bf16 operands",
        ),
        (
            WsConfig {
                scaling: Scaling::Block128,
                ..base()
            },
            "bf16 operands",
        ),
        (
            WsConfig {
                scaling: Scaling::None,
                ..e4m3
            },
            "e4m3 operands",
        ),
        // Block-scaled prefill: BN a divisor of 128, or 192 with two consumers and one slice.
        (
            WsConfig {
                bn: 192,
                two_slices: true,
                ..block
            },
            "BN = 192",
        ),
        (
            WsConfig {
                bn: 192,
                consumers: 1,
                ..block
            },
            "BN = 192",
        ),
        (WsConfig { bn: 160, ..block }, "BN = 160"),
        // Two slices: the block-scaled prefill form only (never generated swapped).
        (
            WsConfig {
                bn: 64,
                consumers: 2,
                swap_ab: true,
                two_slices: true,
                ..block
            },
            "two slice accumulators",
        ),
        (WsConfig { bn: 136, ..block }, "BN = 136"),
        (WsConfig { bn: 256, ..block }, "block-scaled BN = 256"),
        (
            WsConfig {
                bn: 128,
                consumers: 1,
                swap_ab: true,
                ..block
            },
            "block-scaled BN = 128",
        ),
        // Two consumers under BN 128: ptxas drops setmaxnreg (C7508).
        (
            WsConfig { bn: 64, ..base() },
            "two consumer warpgroups behind a producer warpgroup with BN = 64",
        ),
    ] {
        let msg = refused(&c);
        assert!(msg.contains(why), "{c:?}: `{msg}` does not say `{why}`");
        assert!(
            msg.contains("not supported") || msg.contains("wgmma"),
            "{msg}"
        );
        assert!(grouped_ws_module("k", &c).is_err());
    }
    // Names that are not PTX identifiers.
    for name in ["", "1k", "a-b", "a b", "k.x"] {
        assert!(grouped_ws_entry(name, &base()).is_err(), "`{name}`");
    }
    // The edges that are accepted.
    for c in [
        WsConfig {
            stages: 2,
            ..base()
        },
        WsConfig {
            stages: ws::MAX_STAGES,
            bn: 8,
            ..decode()
        },
        WsConfig {
            stages: 6,
            ..base()
        },
        WsConfig {
            bn: 8,
            consumers: 1,
            ..base()
        },
        WsConfig {
            bn: 256,
            stages: 4,
            ..decode()
        },
        WsConfig {
            n: 2,
            k: 8,
            ..base()
        },
        WsConfig {
            n: 2,
            k: 16,
            ..e4m3
        },
        WsConfig {
            n: 1 << 24,
            k: 1 << 24,
            ..base()
        },
        WsConfig {
            consumers: 1,
            ..base()
        },
        WsConfig {
            consumers: 2,
            bn: 128,
            stages: 6,
            ..decode()
        },
        WsConfig { bn: 128, ..block },
        WsConfig {
            bn: 64,
            consumers: 1,
            ..block
        },
        WsConfig {
            bn: 32,
            swap_ab: true,
            consumers: 1,
            stages: 8,
            ..block
        },
        WsConfig {
            out: OutTy::F32,
            epilogue: Epilogue::Store,
            ..e4m3
        },
    ] {
        assert!(
            c.dynamic_smem_bytes() <= ws::MAX_DYNAMIC_SMEM,
            "{}",
            c.tag()
        );
        grouped_ws_entry("k", &c).unwrap_or_else(|e| panic!("{c:?}: {e}"));
    }
}

#[test]
fn the_same_configuration_gives_the_same_text() {
    for (o, s) in FAMILIES {
        for c in tune::candidates(o, s, 1536, 2048) {
            let a = grouped_ws_entry("kernel_one", &c).unwrap();
            assert_eq!(
                a,
                grouped_ws_entry("kernel_one", &c).unwrap(),
                "{}",
                c.tag()
            );
            // The name appears only as the name.
            let b = grouped_ws_entry("kernel_two", &c).unwrap();
            assert_eq!(a.replace("kernel_one", "kernel_two"), b, "{}", c.tag());
            // The module is the header and the entry.
            let m = grouped_ws_module("kernel_one", &c).unwrap();
            assert!(m.ends_with(&a));
            let header = &m[..m.len() - a.len()];
            assert!(header.starts_with(&format!(".version {PTX_VERSION}\n")));
            assert!(header.contains(".target sm_90a"));
            assert!(!header.contains(".entry"));
        }
    }
    // Different configurations give different text.
    let texts: BTreeSet<String> = FAMILIES
        .iter()
        .flat_map(|&(o, s)| tune::candidates(o, s, 1536, 2048))
        .map(|c| grouped_ws_entry("k", &c).unwrap())
        .collect();
    let count: usize = FAMILIES
        .iter()
        .map(|&(o, s)| tune::candidates(o, s, 1536, 2048).len())
        .sum();
    assert_eq!(texts.len(), count);
}

/// With `MOEFORGE_PTXAS` set, `text` assembles for sm_90a with no "serialized" wgmma report and no
/// spill (`tag` names the temporary files).
fn assembles_clean(text: &str, tag: &str) {
    let Some(ptxas) = std::env::var_os("MOEFORGE_PTXAS") else {
        return;
    };
    let stem = std::env::temp_dir().join(format!("moeforge_{tag}_{}", std::process::id()));
    let (src, cubin) = (stem.with_extension("ptx"), stem.with_extension("cubin"));
    std::fs::write(&src, text).unwrap();
    let out = std::process::Command::new(ptxas)
        .args(["-arch=sm_90a", "-O3", "-v"])
        .arg(&src)
        .arg("-o")
        .arg(&cubin)
        .output()
        .unwrap();
    let _ = (std::fs::remove_file(&src), std::fs::remove_file(&cubin));
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(!log.contains("serialized"), "{log}");
    assert!(log.contains(" 0 bytes spill stores"), "{log}");
}

/// Lines of `text` that contain `pat`.
fn count(text: &str, pat: &str) -> usize {
    text.lines().filter(|l| l.contains(pat)).count()
}

/// The structure every variant shares, from its configuration.
fn check_structure(c: &WsConfig, text: &str) {
    let tag = c.tag();
    // Threads: the producer warpgroup and the consumers.
    // (Register-sourced A with one consumer, or two with a decode tile of at most 32 tokens: the
    // consumers, then a producer warp.)
    let warp = c.operands.register_a()
        && (c.consumers == 1 || (c.swap_ab && c.bn <= ws::MAX_WARP_PRODUCER_BN));
    let threads = if warp {
        128 * c.consumers + 32
    } else {
        128 * (1 + c.consumers)
    };
    assert_eq!(
        count(text, &format!(".maxntid {threads}, 1, 1")),
        1,
        "{tag}"
    );
    assert_eq!(c.threads(), threads);
    // Register reallocation only with two consumers.
    let (dec, inc) = (
        count(
            text,
            &format!("setmaxnreg.dec.sync.aligned.u32 \t{}", ws::PRODUCER_REGS),
        ),
        count(
            text,
            &format!("setmaxnreg.inc.sync.aligned.u32 \t{}", ws::CONSUMER_REGS),
        ),
    );
    let two = usize::from(c.consumers == 2 && !warp);
    assert_eq!(two == 1, c.reallocates_registers(), "{tag}");
    assert_eq!((dec, inc), (two, two), "{tag}");
    assert_eq!(count(text, "setmaxnreg"), 2 * two, "{tag}");
    // Parameters, in order.
    let mut at = 0;
    for p in ws::PARAMS {
        let pos = text[at..]
            .find(&format!(" {p}"))
            .unwrap_or_else(|| panic!("{tag}: param {p}"));
        at += pos + 1;
    }
    assert_eq!(count(text, ".param .align 64 .b8 tmap_"), 4, "{tag}");
    assert_eq!(
        count(text, ".extern .shared .align 1024 .b8 smem[]"),
        1,
        "{tag}"
    );
    // The pipeline: a full and an empty barrier per stage (counts 1 and one arrival per consumer
    // warp), initialized once.
    let s = c.stages;
    assert_eq!(
        count(text, &format!(".b64 \tfull_bar[{s}];")),
        1,
        "{tag}: {text}"
    );
    assert_eq!(count(text, &format!(".b64 \tempty_bar[{s}];")), 1, "{tag}");
    assert_eq!(count(text, "mbarrier.init"), 2 * s as usize, "{tag}");
    assert_eq!(
        count(text, "mbarrier.init.shared::cta.b64 \t["),
        2 * s as usize
    );
    assert_eq!(
        text.lines()
            .filter(|l| l.contains("mbarrier.init")
                && l.ends_with(&format!("], {};", c.full_arrivals())))
            .count(),
        s as usize,
        "{tag}"
    );
    assert_eq!(
        text.lines()
            .filter(
                |l| l.contains("mbarrier.init") && l.ends_with(&format!("], {};", 4 * c.consumers))
            )
            .count(),
        s as usize,
        "{tag}"
    );
    assert_eq!(count(text, "fence.mbarrier_init"), 1, "{tag}");
    // One expect_tx of the stage's bytes, one TMA load of X (2D) and of W (3D) per stage.
    assert_eq!(
        count(text, "mbarrier.arrive.expect_tx.shared::cta.b64 \t_, [",),
        1,
        "{tag}"
    );
    // Block-scaled: the k-tile's scales come by TMA on the same barrier (1-D boxes: 16 bytes of
    // weight scales per block the tile spans and the tile's token rows of activation scales), and
    // no `cp.async`.
    let block_tx = if c.scaling == Scaling::Block128 {
        4 * (ws::BLOCK_SCALE_W_BOX * c.w_scale_boxes() + c.tile_tokens() + ws::BLOCK_SCALE_PAD)
    } else {
        0
    };
    // 4-bit weights: the k-tile's group scales of the tile's 64 C rows, one 3-D box (a 64-deep
    // k-tile spans 64 / group groups, at least one).
    let group_tx = match c.operands {
        Operands::W4Bf16(w) => (64 / w.group).max(1) * 64 * c.consumers * w.scale.bytes(),
        _ => 0,
    };
    assert_eq!(c.scale_tx_bytes(), block_tx + group_tx, "{tag}");
    assert!(
        text.lines().any(|l| l.contains("expect_tx")
            && l.ends_with(&format!("], {};", c.tx_bytes() + block_tx + group_tx))),
        "{tag}"
    );
    // Block-scaled: the activation scales' box and one weight-scale box per block the tile spans.
    let scale_loads = if block_tx > 0 {
        1 + c.w_scale_boxes() as usize
    } else {
        0
    };
    let group_loads = usize::from(group_tx > 0);
    assert_eq!(
        count(text, "cp.async.bulk.tensor.1d."),
        scale_loads,
        "{tag}"
    );
    assert_eq!(count(text, "cp.async.bulk.tensor.2d."), 1, "{tag}");
    // The weights' load has its map's rank (3 for the compact operand, more for row modes).
    let w_dim = c.w_rows.rank();
    assert_eq!(
        count(text, "cp.async.bulk.tensor.3d."),
        usize::from(w_dim == 3) + group_loads,
        "{tag}"
    );
    assert_eq!(
        count(text, &format!("cp.async.bulk.tensor.{w_dim}d.")),
        if w_dim == 3 { 1 + group_loads } else { 1 },
        "{tag}"
    );
    assert_eq!(
        count(text, "cp.async.bulk.tensor"),
        2 + scale_loads + group_loads,
        "{tag}"
    );
    assert_eq!(
        count(text, "prefetch.tensormap"),
        2 + if block_tx > 0 { 2 } else { 0 } + group_loads,
        "{tag}"
    );
    assert_eq!(
        count(text, "cp.async.ca") + count(text, "cp.async.mbarrier"),
        0,
        "{tag}"
    );
    assert!(c.full_arrivals() == 1, "{tag}");
    // The MMA atom: four wgmmas of BN columns per 128-byte k-tile.
    let shape = match c.operands {
        Operands::Bf16 | Operands::I8Bf16 | Operands::W4Bf16(_) => {
            format!("m64n{}k16.f32.bf16.bf16", c.bn)
        }
        Operands::E4m3 => format!("m64n{}k32.f32.e4m3.e4m3", c.bn),
    };
    // Block-scaled with one consumer or two slices: two slice accumulators, so the k loop is
    // unrolled by two.
    let block = c.scaling == Scaling::Block128;
    let unroll = if block && (c.consumers == 1 || c.two_slices) {
        2
    } else {
        1
    };
    assert_eq!(
        count(text, &format!("wgmma.mma_async.sync.aligned.{shape} ")),
        4 * unroll,
        "{tag}"
    );
    assert_eq!(count(text, "wgmma.mma_async"), 4 * unroll, "{tag}");
    assert_eq!(count(text, "wgmma.fence"), unroll, "{tag}");
    assert_eq!(count(text, "wgmma.commit_group"), unroll, "{tag}");
    // Each wgmma's accumulator: BN / 2 f32 registers.
    for l in text.lines().filter(|l| l.contains("wgmma.mma_async")) {
        let regs = l[l.find('{').unwrap()..l.find('}').unwrap()]
            .matches('%')
            .count();
        assert_eq!(regs as u32, c.bn / 2, "{tag}: {l}");
    }
    // The epilogue: conversions and stores. Prefill stores a column pair as one b32 (bf16) or
    // one v2.f32; decode stores each slot (BN / 2 per thread).
    let slots = (c.bn / 2) as usize;
    let f32_pairs = if c.out == OutTy::F32 && !c.swap_ab {
        slots / 2
    } else {
        0
    };
    assert_eq!(count(text, "st.global.v2.f32"), f32_pairs, "{tag}");
    // Prefill bf16 with N a multiple of 4: four columns a v2.b32 store, a pair traded with the
    // neighbour lane (one shfl.bfly a store).
    let quads =
        c.out == OutTy::Bf16 && !c.swap_ab && c.n.is_multiple_of(4) && c.bn.is_multiple_of(16);
    let v2_b32 = if quads { slots / 4 } else { 0 };
    assert_eq!(count(text, "st.global.v2.b32"), v2_b32, "{tag}");
    if quads {
        assert!(count(text, "shfl.sync.bfly.b32") >= slots / 4, "{tag}");
    }
    let (f32s, b32s, u16s, cvts) = match (c.out, c.swap_ab) {
        (OutTy::F32, false) => (0, 0, 0, 0),
        (OutTy::F32, true) => (slots, 0, 0, 0),
        (OutTy::Bf16, false) if quads => (0, 0, 0, slots / 2),
        (OutTy::Bf16, false) => (0, slots / 2, 0, slots / 2),
        (OutTy::Bf16, true) => (0, 0, slots, slots),
    };
    // Split-K: each thread's partial to the workspace (one f32 store per slot), the counter's
    // reset (one u32 store), one arrival counter add, and the last split's S loads per slot.
    let split = c.split_k > 1;
    let (ws_stores, resets) = if split { (slots, 1) } else { (0, 0) };
    assert_eq!(count(text, "st.global.f32"), f32s + ws_stores, "{tag}");
    assert_eq!(count(text, "st.global.b32"), b32s, "{tag}");
    assert_eq!(count(text, "st.global.u16"), u16s, "{tag}");
    assert_eq!(count(text, "st.global.u32"), resets, "{tag}");
    assert_eq!(
        count(text, "st.global"),
        f32s + b32s + u16s + ws_stores + resets + f32_pairs + v2_b32,
        "{tag}"
    );
    assert_eq!(
        count(text, "atom.acq_rel.gpu.global.add.u32"),
        usize::from(split),
        "{tag}"
    );
    assert_eq!(
        count(text, "ld.global.cg.f32"),
        if split { slots * c.split_k as usize } else { 0 },
        "{tag}"
    );
    assert_eq!(count(text, "cvt.rn.bf16x2.f32"), cvts, "{tag}");
    // Every store is predicated (masked at the expert's end and at N).
    for l in text.lines().filter(|l| l.contains("st.global")) {
        assert!(l.trim_start().starts_with('@'), "{tag}: {l}");
    }
    // The FP8 scales: none unscaled; tensorwise, the expert's weight scale and one activation
    // scale (static) or one per token class of the fragment (per token: the two A-side rows in
    // prefill, the BN / 4 B-side columns in decode), from global memory in the epilogue.
    let token_classes = if c.swap_ab { c.bn / 4 } else { 2 } as usize;
    let scales = match c.scaling {
        Scaling::None | Scaling::Block128 => 0,
        Scaling::Tensorwise { per_token: false } => 2,
        Scaling::Tensorwise { per_token: true } => 1 + token_classes,
        // One row scale per A-side half.
        Scaling::PerRow => 2,
        // Per channel: a row scale per row class (the two A-side halves in decode; in prefill
        // the BN / 4 B-side columns, a pair a v2 load, counted below) and the activation's, as
        // tensorwise.
        Scaling::Channelwise { per_token } => {
            let rows = if c.swap_ab { 2 } else { 0 };
            rows + if per_token { token_classes } else { 1 }
        }
        // The expert's factor.
        Scaling::PerExpert => 1,
        // Group-wise int8: the group scales come from the stage.
        Scaling::PerRowGroup { .. } => 0,
        // Group-wise FP8: those from the stage, the activation's as tensorwise.
        Scaling::Groupwise { per_token, .. } => {
            if per_token {
                token_classes
            } else {
                1
            }
        }
    };
    assert_eq!(count(text, "ld.global.f32"), scales, "{tag}");
    let pair_loads = match c.scaling {
        Scaling::Channelwise { .. } if !c.swap_ab => c.bn as usize / 8,
        _ => 0,
    };
    assert_eq!(count(text, "ld.global.v2.f32"), pair_loads, "{tag}");
    if pair_loads > 0 {
        // A pair's start clamped to N - 2 (even, so the v2 load stays 8-byte aligned).
        assert!(
            text.contains(&format!(", {};", c.n - 2)) && text.contains("min.u32"),
            "{tag}: no clamp to N - 2"
        );
    }
    // Block-scaled: the producer loads each k-tile's scales into its stage by TMA (above), and
    // every promotion reads one activation scale per token class and the weight scale from the
    // stage (one promotion site with two consumers of one slice, four with two slices: even, odd
    // and the two tails), one weight scale per block the tile spans.
    let (shared, fmas) = if block {
        let sites = if c.consumers == 1 || c.two_slices {
            4
        } else {
            1
        };
        (
            sites * (token_classes + c.w_scale_boxes() as usize),
            sites * slots,
        )
    } else {
        (0, 0)
    };
    // (Split-K adds the last-split flag's one shared store and one shared load; int8 weights
    // load a k-tile's fragments with two 16-byte loads, the thread's bytes of its two rows.)
    assert_eq!(
        count(text, "ld.shared.f32"),
        shared + usize::from(c.split_k > 1),
        "{tag}"
    );
    let i8_loads = if c.operands == Operands::I8Bf16 { 2 } else { 0 };
    assert_eq!(count(text, "ld.shared.v4.b32"), i8_loads, "{tag}");
    assert_eq!(
        count(text, "st.shared.f32"),
        usize::from(c.split_k > 1),
        "{tag}"
    );
    // Block scaling promotes each k-tile's partial sum: one fma per accumulator per promotion
    // site; nothing else uses fma.
    assert_eq!(count(text, "fma.rn.f32"), fmas, "{tag}");
    assert!(text.contains("ret;"));
}

#[test]
fn the_text_has_the_structure_of_its_configuration() {
    // The named shapes of the design.
    let p = WsConfig { bn: 256, ..base() };
    let t = grouped_ws_entry("k", &p).unwrap();
    assert_eq!(count(&t, ".maxntid 384, 1, 1"), 1);
    assert_eq!(
        count(&t, "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"),
        4
    );
    assert_eq!(count(&t, "setmaxnreg.dec"), 1);
    assert_eq!(count(&t, "setmaxnreg.inc"), 1);
    // 128 slots a thread: 32 stores of four bf16 columns.
    assert_eq!(count(&t, "st.global.v2.b32"), 32);
    check_structure(&p, &t);
    let d = WsConfig {
        operands: Operands::E4m3,
        scaling: Scaling::Tensorwise { per_token: true },
        ..decode()
    };
    let t = grouped_ws_entry("k", &d).unwrap();
    assert_eq!(count(&t, ".maxntid 256, 1, 1"), 1);
    assert_eq!(
        count(&t, "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3"),
        4
    );
    assert_eq!(count(&t, "setmaxnreg"), 0);
    // Per-token scales: the expert's weight scale and one activation scale per token class.
    assert_eq!(count(&t, "ld.global.f32"), 1 + 2 * 16 / 8);
    check_structure(&d, &t);
    let s = WsConfig {
        scaling: Scaling::Tensorwise { per_token: false },
        ..d
    };
    let t = grouped_ws_entry("k", &s).unwrap();
    assert_eq!(
        count(&t, "ld.global.f32"),
        2,
        "one weight and one activation scale"
    );
    check_structure(&s, &t);
    // Every candidate of every family, in both output types.
    for (o, sc) in FAMILIES {
        for n in [1536, 2048, 300] {
            for c in tune::candidates(o, sc, n, 768) {
                for out in [OutTy::Bf16, OutTy::F32] {
                    let c = WsConfig { out, ..c };
                    check_structure(&c, &grouped_ws_entry("k", &c).unwrap());
                }
            }
        }
    }
    // One consumer in prefill, two in decode.
    for c in [
        WsConfig {
            consumers: 1,
            ..base()
        },
        WsConfig {
            consumers: 2,
            bn: 128,
            stages: 6,
            ..decode()
        },
        WsConfig {
            out: OutTy::F32,
            epilogue: Epilogue::Store,
            bn: 64,
            consumers: 1,
            ..base()
        },
    ] {
        check_structure(&c, &grouped_ws_entry("k", &c).unwrap());
    }
}

#[test]
fn the_configuration_arithmetic() {
    let p = base();
    assert_eq!((p.tile_tokens(), p.tile_weights()), (128, 128));
    assert_eq!(p.weight_tiles(), 32);
    assert_eq!(p.k_tiles(), 7168 / 64);
    assert_eq!(p.stage_bytes(), 128 * 128 + 128 * 128);
    assert_eq!(
        p.dynamic_smem_bytes(),
        4 * p.stage_bytes() + ws::SMEM_ALIGN_SLACK
    );
    let d = decode();
    assert_eq!((d.tile_tokens(), d.tile_weights()), (16, 64));
    assert_eq!(d.weight_tiles(), 4096 / 64);
    assert_eq!(d.stage_bytes(), 64 * 128 + 16 * 128);
    let e = WsConfig {
        operands: Operands::E4m3,
        scaling: Scaling::Block128,
        k: 7184,
        ..d
    };
    assert_eq!(e.k_tiles(), 7184u32.div_ceil(128));
    assert_eq!(p.tag(), "bf16_p2x128_s4_bf16");
    assert_eq!(
        WsConfig {
            out: OutTy::F32,
            ..e
        }
        .tag(),
        "e4m3b_d1x16_s8_f32"
    );
    // Every candidate fits in shared memory and has a unique tag per family.
    for (o, s) in FAMILIES {
        let all = tune::candidates(o, s, 4096, 7168);
        let tags: BTreeSet<String> = all.iter().map(WsConfig::tag).collect();
        assert_eq!(tags.len(), all.len());
        for c in &all {
            assert!(
                c.dynamic_smem_bytes() <= ws::MAX_DYNAMIC_SMEM,
                "{}",
                c.tag()
            );
            assert!(c.stages >= 2 && c.stages <= ws::MAX_STAGES);
        }
    }
}

#[test]
fn split_k_ranges_cover_the_k_tiles_once_and_are_refused_where_they_cannot_run() {
    for k in [16u32, 64, 512, 1040, 2048, 7168] {
        for split_k in 1..=ws::MAX_SPLIT_K {
            let c = WsConfig {
                split_k,
                k,
                ..decode()
            };
            if split_k > c.k_tiles() {
                assert!(grouped_ws_entry("k", &c).is_err(), "{}", c.tag());
                continue;
            }
            grouped_ws_entry("k", &c).unwrap();
            let mut next = 0;
            for s in 0..split_k {
                let (a, b) = c.split_range(s);
                assert_eq!(a, next, "{} split {s}", c.tag());
                assert!(b > a, "{} split {s} is empty", c.tag());
                next = b;
            }
            assert_eq!(next, c.k_tiles(), "{}", c.tag());
            assert_eq!(
                c.items_upper_bound(100, 8),
                c.tiles_upper_bound(100, 8) * u64::from(split_k)
            );
        }
    }
    // Prefill and out-of-range splits are refused.
    for (c, why) in [
        (
            WsConfig {
                split_k: 2,
                ..base()
            },
            "prefill",
        ),
        (
            WsConfig {
                split_k: 0,
                ..decode()
            },
            "split-K of 0",
        ),
        (
            WsConfig {
                split_k: ws::MAX_SPLIT_K + 1,
                ..decode()
            },
            "split-K of 9",
        ),
    ] {
        let msg = refused(&c);
        assert!(msg.contains(why), "{msg}");
    }
}

/// 4-bit weights (W4A16, decode) in the standard recipes' three formats: the weights are wgmma's
/// A from registers, each k-tile's two rows of 32 code bytes per thread loaded as four 16-byte
/// words, the group scales from the stage; the structure of its configuration; ptxas assembles it
/// with no spill and no serialization. Other pairings are refused by name.
#[test]
fn four_bit_weights_feed_register_a_and_assemble() {
    use ws::{GroupScale, W4Codes, W4};
    for (w, bn, stages) in [
        (
            W4 {
                codes: W4Codes::E2m1,
                scale: GroupScale::E4m3,
                group: 16,
            },
            8u32,
            8u32,
        ),
        (
            W4 {
                codes: W4Codes::E2m1,
                scale: GroupScale::E8m0,
                group: 32,
            },
            16,
            8,
        ),
        (
            W4 {
                codes: W4Codes::U4,
                scale: GroupScale::Bf16,
                group: 128,
            },
            64,
            6,
        ),
    ] {
        let c = WsConfig {
            operands: Operands::W4Bf16(w),
            scaling: Scaling::PerExpert,
            bn,
            stages,
            ..decode()
        };
        assert_eq!(c.a_stage_bytes(), 64 * 32, "64 rows of 64 4-bit codes");
        assert_eq!(
            c.group_scale_bytes(),
            64 * w.scale.bytes() * 64u32.div_ceil(w.group)
        );
        let text = ws::grouped_ws_module("moeforge_gemm_w4", &c).unwrap();
        check_structure(&c, &text);
        let rs = text
            .lines()
            .filter(|l| l.contains("wgmma.mma_async") && l.contains("}, {%r"))
            .count();
        assert_eq!(rs, 4, "{text}");
        // One 8-byte load of the thread's codes per row (two rows), no byte permute of codes.
        assert_eq!(text.matches("ld.shared.v2.b32").count(), 2);
        // Two loads of scales per k-tile (rows r and r + 8, each its groups of the k-tile: 32,
        // 16 or 8 bits), whatever the group.
        let groups = 64u32.div_ceil(w.group) as usize;
        let ty = match w.scale_tile_bytes() {
            4 => "ld.shared.u32",
            2 => "ld.shared.u16",
            _ => "ld.shared.u8",
        };
        assert_eq!(text.matches(ty).count(), 2, "{}", c.tag());
        assert_eq!(
            text.matches("ld.shared.u").count(),
            2,
            "{}: no other scalar shared load",
            c.tag()
        );
        // Each row's scale broadcast to both halves by a half unpack and pack (ptxas folds it
        // into the multiply's half selector), not a byte permute.
        assert_eq!(text.matches("mov.b32 {%hb0, %hb1}").count(), 2 * groups);
        assert!(!text.contains(", 0x1010;") && !text.contains(", 0x3232;"));
        // Four one-byte groups a k-tile (NVFP4): each lane of a quad converts one group, shared
        // by four shuffles; otherwise each group is converted by every lane.
        let quad = groups == 4 && w.scale.bytes() == 1;
        let converted = if quad { 1 } else { groups };
        // (the tile scan's shuffles: those of the same variant with INT4 weights)
        let scan_shfl = ws::grouped_ws_module(
            "k",
            &WsConfig {
                operands: Operands::W4Bf16(W4::INT4_G128),
                ..c
            },
        )
        .unwrap()
        .matches("shfl.sync.idx")
        .count();
        assert_eq!(
            text.matches("shfl.sync.idx").count(),
            scan_shfl + if quad { 4 } else { 0 },
            "{}",
            c.tag()
        );
        // One bf16x2 multiply by the scale per A register (16), and the E4M3 scales' two per
        // converted group.
        let muls = 16
            + if w.scale == GroupScale::E4m3 {
                2 * converted
            } else {
                0
            };
        assert_eq!(text.matches("mul.rn.bf16x2").count(), muls, "{}", c.tag());
        assert!(!text.contains("wgmma.wait_group.sync.aligned \t1;"));
        assembles_clean(&text, &format!("w4_{bn}"));
    }
    let ok = WsConfig {
        operands: Operands::W4Bf16(W4 {
            codes: W4Codes::E2m1,
            scale: GroupScale::E4m3,
            group: 16,
        }),
        scaling: Scaling::PerExpert,
        bn: 8,
        ..decode()
    };
    for (c, why) in [
        (
            WsConfig {
                swap_ab: false,
                bn: 128,
                ..ok
            },
            "weights-on-A",
        ),
        (WsConfig { k: 7200, ..ok }, "K a multiple of 64"),
        (WsConfig { n: 4104, ..ok }, "N of 16"),
        (
            WsConfig {
                operands: Operands::W4Bf16(W4 {
                    group: 24,
                    ..W4 {
                        codes: W4Codes::E2m1,
                        scale: GroupScale::E4m3,
                        group: 16,
                    }
                }),
                ..ok
            },
            "a power of two",
        ),
        (
            WsConfig {
                operands: Operands::W4Bf16(W4 {
                    codes: W4Codes::U4,
                    scale: GroupScale::E4m3,
                    group: 16,
                }),
                ..ok
            },
            "INT4 bf16",
        ),
        (
            WsConfig {
                operands: Operands::W4Bf16(W4 {
                    codes: W4Codes::E2m1,
                    scale: GroupScale::Bf16Zero,
                    group: 32,
                }),
                ..ok
            },
            "INT4 bf16",
        ),
        // Zero points ride with their scales: at least 32 a group (one 4- or 8-byte load).
        (
            WsConfig {
                operands: Operands::W4Bf16(W4 {
                    codes: W4Codes::U4,
                    scale: GroupScale::Bf16Zero,
                    group: 16,
                }),
                ..ok
            },
            "at least 32",
        ),
        (
            WsConfig {
                scaling: Scaling::PerRow,
                ..ok
            },
            "scaling PerRow",
        ),
    ] {
        let msg = ws::grouped_ws_module("x", &c).unwrap_err().to_string();
        assert!(msg.contains(why), "{why}: {msg}");
    }
}

/// Group-wise int8 (`Scaling::PerRowGroup`): the int8 register-A k-loop with a second
/// accumulator, each group's partial sum promoted after its last k-tile with the fragment rows'
/// scales from the stage (two `ld.shared.f32`, one `fma` per accumulator slot, no per-row scale in
/// the epilogue); the group scales come by a third TMA map; one and two consumers, split-K, and the
/// fused SiLU epilogue assemble clean; groups under 64, BN past 64 and the unswapped form are
/// refused.
#[test]
fn group_wise_int8_promotes_each_group_and_assembles() {
    for (consumers, bn, split_k, epilogue, group) in [
        (1u32, 8u32, 1u32, Epilogue::Store, 128u32),
        (2, 16, 1, Epilogue::Store, 128),
        (1, 64, 1, Epilogue::Store, 64),
        (2, 8, 3, Epilogue::Store, 256),
        (2, 8, 1, Epilogue::SiluMul, 128),
        (2, 128, 1, Epilogue::SiluMul, 128),
    ] {
        let c = WsConfig {
            operands: Operands::I8Bf16,
            scaling: Scaling::PerRowGroup { group },
            consumers,
            bn,
            split_k,
            epilogue,
            stages: 8,
            ..decode()
        };
        let c = match bn {
            64 => WsConfig { stages: 6, ..c },
            128 => WsConfig { stages: 4, ..c },
            _ => c,
        };
        let tag = c.tag();
        assert!(
            tag.starts_with(&format!("i8wg{group}_d{consumers}x{bn}")),
            "{tag}"
        );
        assert_eq!(c.group_scale_bytes(), 64 * consumers * 4, "{tag}");
        assert_eq!(c.scale_group(), Some(group));
        let text = ws::grouped_ws_module("k", &c).unwrap();
        // (Split-K adds the last-split flag's shared load.)
        let flag = usize::from(split_k > 1);
        assert_eq!(text.matches("ld.shared.f32").count(), 2 + flag, "{tag}");
        // (One promotion site: BN / 2 accumulator slots per thread.)
        assert_eq!(text.matches("fma.rn.f32").count() as u32, bn / 2, "{tag}");
        assert!(text.contains("prefetch.tensormap"), "{tag}");
        // Three TMA loads a k-tile: X, the codes and the group scales.
        assert_eq!(text.matches("cp.async.bulk.tensor").count(), 3, "{tag}");
        assembles_clean(&text, &format!("i8g_{tag}"));
    }
    let ok = WsConfig {
        operands: Operands::I8Bf16,
        scaling: Scaling::PerRowGroup { group: 128 },
        bn: 8,
        ..decode()
    };
    for (c, why) in [
        (
            WsConfig {
                scaling: Scaling::PerRowGroup { group: 32 },
                ..ok
            },
            "at least 64",
        ),
        (
            WsConfig {
                scaling: Scaling::PerRowGroup { group: 96 },
                ..ok
            },
            "at least 64",
        ),
        (WsConfig { bn: 128, ..ok }, "at most 64"),
        (
            WsConfig {
                bn: 256,
                consumers: 2,
                stages: 4,
                ..ok
            },
            "at most 128",
        ),
        (WsConfig { n: 4094, ..ok }, "a multiple of 4"),
        (
            WsConfig {
                swap_ab: false,
                ..ok
            },
            "weights-on-A",
        ),
        (WsConfig { k: 7176, ..ok }, "a multiple of 16"),
    ] {
        let msg = ws::grouped_ws_module("x", &c).unwrap_err().to_string();
        assert!(msg.contains(why), "{why}: {msg}");
    }
}

/// Int8 weights (W8A16, decode): the weights are wgmma's A from registers, each thread's 16
/// bytes of a row loaded with one 16-byte load from the unswizzled stage (the kernel order) and
/// converted to bf16x2; the stage holds 64-byte A rows; the epilogue applies a per-row scale; ptxas
/// assembles it with no spill and no serialization.
#[test]
fn int8_weights_feed_register_a_and_assemble() {
    for (bn, stages) in [(8u32, 8u32), (16, 8), (64, 6)] {
        let c = WsConfig {
            operands: Operands::I8Bf16,
            scaling: Scaling::PerRow,
            bn,
            stages,
            ..decode()
        };
        assert_eq!(c.a_stage_bytes(), 64 * 64, "64 rows of 64 int8 codes");
        assert_eq!(c.tag(), format!("i8wr_d1x{bn}_s{stages}_bf16"));
        let text = ws::grouped_ws_module("moeforge_gemm_i8", &c).unwrap();
        // Four register-A MMAs per k-tile, 16 fragment registers (four per MMA) from two 16-byte
        // loads, each converted with three byte permutes and no integer-to-float conversion.
        let rs = text
            .lines()
            .filter(|l| l.contains("wgmma.mma_async") && l.contains("}, {%r"))
            .count();
        assert_eq!(rs, 4, "{text}");
        assert_eq!(text.matches("prmt.b32").count(), 3 * 16);
        assert_eq!(text.matches("cvt.rn.f32.s32").count(), 0);
        // (the epilogue's one per bf16 output slot: BN / 2 in decode)
        assert_eq!(text.matches("cvt.rn.bf16x2.f32").count(), (bn / 2) as usize);
        assert_eq!(text.matches("ld.shared.v4.b32").count(), 2);
        assert_eq!(text.matches("ld.shared.f32").count(), 0);
        // The register-A k-loop waits for every MMA before the next k-tile rewrites A.
        assert!(
            !text.contains("wgmma.wait_group.sync.aligned \t1;"),
            "{text}"
        );
        assembles_clean(&text, &format!("i8_{bn}"));
    }
    // Int8 weights only in the swapped (weights-on-A) form, and only with per-row scales.
    let bad = WsConfig {
        operands: Operands::I8Bf16,
        scaling: Scaling::PerRow,
        out: OutTy::Bf16,
        epilogue: Epilogue::Store,
        consumers: 2,
        bn: 128,
        stages: 6,
        swap_ab: false,
        split_k: 1,
        n: 4096,
        k: 7168,
        w_rows: WRows::PLAIN,
        two_slices: false,
        skip_idle: false,
    };
    assert!(ws::grouped_ws_module("x", &bad).is_err());
    let bad = WsConfig {
        scaling: Scaling::None,
        ..bad
    };
    assert!(ws::grouped_ws_module("x", &bad).is_err());
}

/// The register-A prefill form: two consumer warpgroups (128 weight rows) share each token tile
/// of int8 or 4-bit weights. The CTA is a producer warpgroup and the two consumers (384 threads,
/// registers moved by `setmaxnreg` as for the other families); each consumer reads its own 64 rows
/// of codes and, for 4-bit weights, its rows' group scales in group rows of 128 scales; ptxas
/// assembles every form with no spill and no serialization, fused SiLU included.
/// Two register-A decode consumers behind one producer warp (`d2x8`, `d2x16`): 288 threads, no
/// `setmaxnreg`, the second consumer's rows 64 further (its scales at `64 * scale_tile_bytes`
/// more), and clean ptxas output, for int8 and every 4-bit format (INT4 also with groups of 16 and
/// 32, whose bf16 scales take two words or two halves of one a row, and asymmetric INT4 with
/// groups of 128 and 32, a zero point in each scale's word).
#[test]
fn register_a_decode_has_a_two_consumer_producer_warp_form() {
    use ws::{GroupScale, W4Codes, W4};
    let int4 = |group| {
        Operands::W4Bf16(W4 {
            codes: W4Codes::U4,
            scale: GroupScale::Bf16,
            group,
        })
    };
    for (operands, scaling) in [
        (Operands::I8Bf16, Scaling::PerRow),
        (Operands::W4Bf16(W4::NVFP4), Scaling::PerExpert),
        (Operands::W4Bf16(W4::MXFP4), Scaling::PerExpert),
        (Operands::W4Bf16(W4::INT4_G128), Scaling::PerExpert),
        (int4(32), Scaling::PerExpert),
        (int4(16), Scaling::PerExpert),
        (Operands::W4Bf16(W4::INT4_G128_ZP), Scaling::PerExpert),
        (
            Operands::W4Bf16(W4 {
                group: 32,
                ..W4::INT4_G128_ZP
            }),
            Scaling::PerExpert,
        ),
    ] {
        for bn in [8, 16] {
            let c = WsConfig {
                operands,
                scaling,
                consumers: 2,
                bn,
                stages: 8,
                ..decode()
            };
            let tag = c.tag();
            assert!(c.producer_warp() && !c.reallocates_registers(), "{tag}");
            assert_eq!(c.threads(), 288, "{tag}");
            let text = ws::grouped_ws_module("k", &c).unwrap();
            check_structure(&c, &text);
            assert_eq!(count(&text, "setmaxnreg"), 0, "{tag}");
            if let Operands::W4Bf16(w) = operands {
                // Groups of 16 with bf16 scales: 8 bytes a row's k-tile, one 8-byte load a row.
                let es = w.scale_tile_bytes();
                assert_eq!(c.group_scale_bytes(), 128 * es, "{tag}");
                let v2 = text.matches("ld.shared.v2.b32").count();
                assert_eq!(v2, 2 + if es == 8 { 2 } else { 0 }, "{tag}");
                // The bf16 selectors: one per group of the k-tile, the second half for odd groups.
                if w.scale == GroupScale::Bf16 && w.groups_per_ktile() >= 2 {
                    assert!(text.contains(", 0x7632;"), "{tag}");
                }
                // Zero points: each group's offset from its row's word (no gathering prmt, no
                // constant -136), one bf16x2 add a pair.
                if w.scale == GroupScale::Bf16Zero {
                    assert!(
                        !text.contains("prmt.b32") && !text.contains("3272131336"),
                        "{tag}"
                    );
                    assert_eq!(
                        text.matches("add.rn.bf16x2").count(),
                        text.matches("mul.rn.bf16x2").count(),
                        "{tag}"
                    );
                }
            }
            assembles_clean(&text, &format!("d2_{tag}"));
            // Split along K (served and GPU-checked, not a tuning candidate): the same form with
            // the split reduction.
            let split = WsConfig { split_k: 2, ..c };
            let text = ws::grouped_ws_module("k", &split).unwrap();
            check_structure(&split, &text);
            assert!(text.contains("fence.acq_rel.gpu"), "{}", split.tag());
            assembles_clean(&text, &format!("d2k2_{tag}"));
        }
    }
}

#[test]
fn register_a_weights_have_a_two_consumer_prefill_form() {
    use ws::W4;
    let fams = [
        (Operands::I8Bf16, Scaling::PerRow),
        (Operands::W4Bf16(W4::NVFP4), Scaling::PerExpert),
        (Operands::W4Bf16(W4::MXFP4), Scaling::PerExpert),
        (Operands::W4Bf16(W4::INT4_G128), Scaling::PerExpert),
        (Operands::W4Bf16(W4::INT4_G128_ZP), Scaling::PerExpert),
    ];
    for (operands, scaling) in fams {
        for (bn, epilogue, out) in [
            (128u32, Epilogue::Store, OutTy::F32),
            (256, Epilogue::Store, OutTy::Bf16),
            (256, Epilogue::SiluMul, OutTy::Bf16),
        ] {
            let c = WsConfig {
                operands,
                scaling,
                epilogue,
                out,
                consumers: 2,
                bn,
                stages: 4,
                ..decode()
            };
            let tag = c.tag();
            assert!(tag.contains(&format!("_d2x{bn}_s4")), "{tag}");
            assert_eq!((c.tile_weights(), c.tile_tokens()), (128, bn), "{tag}");
            assert_eq!(c.threads(), 384, "{tag}");
            assert!(c.reallocates_registers() && !c.producer_warp(), "{tag}");
            assert_eq!(c.a_stage_bytes(), 128 * c.a_row_bytes(), "{tag}");
            let text = grouped_ws_module("k", &c).unwrap();
            if epilogue == Epilogue::Store {
                check_structure(&c, &text);
            }
            assert_eq!(count(&text, "setmaxnreg"), 2, "{tag}");
            if let Operands::W4Bf16(w) = operands {
                // The k-tile's scales of the consumer's rows r and r + 8 at 0 and
                // `8 * scale_tile_bytes` from the thread's row (the other consumer's rows added
                // to it).
                let es = w.scale_tile_bytes();
                assert_eq!(c.group_scale_bytes(), 128 * es, "{tag}");
                for off in [0, 8 * es] {
                    let at = format!("+{off}];");
                    assert!(
                        text.lines()
                            .any(|l| l.contains("ld.shared.u") && l.ends_with(&at)),
                        "{tag}: scales at {off}"
                    );
                }
            }
            assembles_clean(&text, &tag);
        }
    }
}

/// The fused SiLU epilogue (`Epilogue::SiluMul`): every fragment thread pairs its own gate and up
/// slots, one `silu` (an `ex2.approx`) per output slot pair, `BN / 4` outputs per thread in both
/// forms, stored as `a [T, N / 2]` (prefill bf16: two adjacent outputs per b32); ptxas assembles
/// every form with no spill and no serialization; N or a tile's weight rows off 16 are refused.
#[test]
fn the_fused_silu_epilogue_pairs_within_threads_and_assembles() {
    let forms = [
        (
            "prefill bf16",
            WsConfig {
                epilogue: Epilogue::SiluMul,
                ..base()
            },
        ),
        (
            "prefill f32",
            WsConfig {
                epilogue: Epilogue::SiluMul,
                out: OutTy::F32,
                consumers: 1,
                ..base()
            },
        ),
        (
            "decode bf16",
            WsConfig {
                epilogue: Epilogue::SiluMul,
                ..decode()
            },
        ),
        (
            "decode e4m3 split-K f32",
            WsConfig {
                epilogue: Epilogue::SiluMul,
                operands: Operands::E4m3,
                scaling: Scaling::Tensorwise { per_token: true },
                out: OutTy::F32,
                split_k: 3,
                ..decode()
            },
        ),
        (
            "decode int8",
            WsConfig {
                epilogue: Epilogue::SiluMul,
                operands: Operands::I8Bf16,
                scaling: Scaling::PerRow,
                ..decode()
            },
        ),
        (
            "decode nvfp4",
            WsConfig {
                epilogue: Epilogue::SiluMul,
                operands: Operands::W4Bf16(ws::W4::NVFP4),
                scaling: Scaling::PerExpert,
                bn: 8,
                ..decode()
            },
        ),
    ];
    for (what, c) in forms {
        assert!(
            c.tag().ends_with(&format!("_silu_{}", c.out.name())),
            "{what}"
        );
        assert_eq!(c.out_cols(), c.n / 2);
        let text = ws::grouped_ws_module("moeforge_gemm_silu", &c).unwrap();
        let pairs = (c.bn / 4) as usize;
        assert_eq!(count(&text, "ex2.approx.ftz.f32"), pairs, "{what}");
        assert_eq!(count(&text, "rcp.approx.f32"), pairs, "{what}");
        let stores = if !c.swap_ab && c.out == OutTy::Bf16 {
            assert_eq!(count(&text, "st.global.b32"), pairs / 2, "{what}");
            pairs / 2
        } else if !c.swap_ab {
            assert_eq!(count(&text, "st.global.v2.f32"), pairs / 2, "{what}");
            pairs / 2
        } else {
            pairs
        };
        let st = count(&text, "st.global.f32")
            + count(&text, "st.global.v2.f32")
            + count(&text, "st.global.u16")
            + count(&text, "st.global.b32");
        // (split-K's partial stores to the workspace are f32 too: v4 or scalar, counted apart)
        if c.split_k == 1 {
            assert_eq!(st, stores, "{what}: {text}");
        }
        assembles_clean(&text, &format!("silu_{}", what.replace(' ', "_")));
    }
    // The same configuration with the plain epilogue stores N columns and no silu.
    let plain = ws::grouped_ws_module("moeforge_gemm_plain", &decode()).unwrap();
    assert_eq!(count(&plain, "ex2.approx"), 0);
    for bad in [
        WsConfig {
            epilogue: Epilogue::SiluMul,
            n: 4088,
            ..decode()
        },
        WsConfig {
            epilogue: Epilogue::SiluMul,
            bn: 8,
            consumers: 1,
            ..base()
        },
    ] {
        let why = refused(&bad);
        assert!(why.contains("fused SiLU"), "{why}");
    }
}

/// The fused SiLU epilogue with the E4M3 output (`Epilogue::SiluMulE4m3`): the f32 `a` stores of
/// the plain fused form; per token and per group, one acquire-release count per tile on the
/// token tile's counter (reset by the last arrival), and in the finishing CTA `ld.global.cg`
/// loads of `a` (two passes per token: the amax, then the codes), `cvt.rn.satfinite.e4m3x2`
/// codes and the scale rule of the activation kernel (`div.rn` per token, `rcp.rn` per group);
/// static, the epilogue's own codes (`rcp.rn` once) and no count; ptxas assembles every form
/// (decode, prefill, split-K, block-scaled pairs) with no spill and no serialization; a bf16
/// output is refused.
#[test]
fn the_e4m3_output_of_the_fused_epilogue_counts_token_tiles_and_assembles() {
    use ws::AQuant;
    let e4m3 = |q: AQuant, c: WsConfig| WsConfig {
        epilogue: Epilogue::SiluMulE4m3(q),
        operands: Operands::E4m3,
        scaling: Scaling::Tensorwise { per_token: true },
        out: OutTy::F32,
        ..c
    };
    let forms = [
        ("decode token", e4m3(AQuant::PerToken, decode())),
        (
            "decode token split-K",
            WsConfig {
                split_k: 3,
                ..e4m3(AQuant::PerToken, decode())
            },
        ),
        ("decode static", e4m3(AQuant::Static, decode())),
        (
            "prefill token",
            WsConfig {
                bn: 256,
                ..e4m3(AQuant::PerToken, base())
            },
        ),
        ("prefill static", e4m3(AQuant::Static, base())),
        (
            "prefill group block",
            WsConfig {
                scaling: Scaling::Block128,
                n: 4096,
                ..e4m3(AQuant::Group128, base())
            },
        ),
        (
            "decode group block I 320",
            WsConfig {
                scaling: Scaling::Block128,
                n: 640,
                ..e4m3(AQuant::Group128, decode())
            },
        ),
        (
            "prefill token Mixtral",
            WsConfig {
                n: 28672,
                k: 4096,
                ..e4m3(AQuant::PerToken, base())
            },
        ),
    ];
    for (what, c) in forms {
        let q = c.epilogue.quant().unwrap();
        assert!(
            c.tag().ends_with(&format!("_silu_{}_f32", q.tag())),
            "{what}: {}",
            c.tag()
        );
        let text = ws::grouped_ws_module("moeforge_gemm_silu_e4m3", &c).unwrap();
        for p in ws::PARAMS.iter().chain(&finish::FINISH_PARAMS) {
            assert!(text.contains(p), "{what}: {p}");
        }
        let chunks = (c.n / 2 / 8) as usize;
        let iters = chunks.div_ceil(32);
        let split = usize::from(c.split_k > 1);
        if q.counted() {
            // Counted: the finishing CTA's loads, codes and scales.
            let passes = if q == AQuant::PerToken { 2 } else { 1 };
            assert_eq!(
                count(&text, "ld.global.cg.v4.f32"),
                2 * passes * iters,
                "{what}"
            );
            assert_eq!(
                count(&text, "cvt.rn.satfinite.e4m3x2.f32"),
                2 * iters,
                "{what}"
            );
            assert_eq!(
                count(&text, "atom.acq_rel.gpu.global.add.u32"),
                1 + split,
                "{what}"
            );
            let (div, rcp) = match q {
                AQuant::PerToken => (1 + 8 * iters, 0),
                _ => (iters, iters),
            };
            assert_eq!(count(&text, "div.rn.f32"), div, "{what}");
            assert_eq!(count(&text, "rcp.rn.f32"), rcp, "{what}");
        } else {
            // Static: the epilogue's own codes (a byte per output in decode, a pair per u16 in
            // prefill), one reciprocal, no count and no finishing loads.
            let pairs = (c.bn / 4) as usize;
            let (stores, ty) = if c.swap_ab {
                (pairs, "st.global.u8")
            } else {
                (pairs / 2, "st.global.u16")
            };
            assert_eq!(count(&text, ty), stores, "{what}");
            assert_eq!(
                count(&text, "cvt.rn.satfinite.e4m3x2.f32"),
                stores,
                "{what}"
            );
            assert_eq!(count(&text, "ld.global.cg.v4.f32"), 0, "{what}");
            assert_eq!(
                count(&text, "atom.acq_rel.gpu.global.add.u32"),
                split,
                "{what}"
            );
            assert_eq!(count(&text, "rcp.rn.f32"), 1, "{what}");
            assert!(!text.contains("token_tile_last"), "{what}");
        }
        // The plain fused form has none of it.
        let plain = WsConfig {
            epilogue: Epilogue::SiluMul,
            ..c
        };
        let p = ws::grouped_ws_module("moeforge_gemm_silu", &plain).unwrap();
        assert_eq!(count(&p, "ld.global.cg.v4.f32"), 0);
        assert!(!p.contains("act_codes"));
        assembles_clean(&text, &format!("silu_e4m3_{}", what.replace(' ', "_")));
    }
    let bf16 = WsConfig {
        out: OutTy::Bf16,
        ..e4m3(AQuant::PerToken, decode())
    };
    assert!(refused(&bf16).contains("E4M3 output"), "{}", refused(&bf16));
    assert_eq!(AQuant::Group128.scales_len(10, 320), 30);
    assert_eq!(AQuant::PerToken.scales_len(10, 320), 10);
}

/// The paired row order is a bijection onto `[gate; up]` that keeps each 16-row block's 8 gate
/// rows and their 8 up rows together.
#[test]
fn the_paired_row_order_is_a_bijection() {
    for i in [8usize, 16, 24, 768, 2048] {
        let mut seen = vec![false; 2 * i];
        for r in 0..2 * i {
            let l = ws::glu_row(r, i);
            assert!(!seen[l], "row {r} of I = {i}");
            seen[l] = true;
            if r % 16 < 8 {
                assert_eq!(ws::glu_row(r + 8, i), l + i, "the up row of gate row {r}");
            }
        }
    }
}

/// The 4-bit formats' group counts and group-scale sizes (`[E, ceil(K / group), N]`).
#[test]
fn four_bit_group_scales_have_their_sizes() {
    use moeforge_codegen::gemm::ws::W4;
    assert_eq!(W4::NVFP4.groups(7168), 448);
    assert_eq!(W4::MXFP4.groups(7168), 224);
    assert_eq!(W4::INT4_G128.groups(7168), 56);
    assert_eq!(W4::INT4_G128.groups(7169), 57);
    assert_eq!(W4::NVFP4.group_scale_bytes(32, 4096, 7168), 32 * 448 * 4096);
    assert_eq!(W4::INT4_G128.group_scale_bytes(2, 16, 256), 2 * 2 * 16 * 2);
    assert_eq!(W4::MXFP4.group_scale_bytes(0, 16, 256), 0);
    // The kernel's order, pinned by hand: `[E, scale tiles, N, groups per k-tile]`. NVFP4, N = 16,
    // K = 128 (8 groups, 2 tiles of 4): expert 1, row 3, group 5 is tile 1, byte 1 of the row's
    // word: ((1 * 2 + 1) * 16 + 3) * 4 + 1.
    assert_eq!(W4::NVFP4.group_scale_at(16, 128, 1, 3, 5), 205);
    // MXFP4 (2 groups a tile, one byte each): expert 0, row 15, group 3: (1 * 16 + 15) * 2 + 1.
    assert_eq!(W4::MXFP4.group_scale_at(16, 128, 0, 15, 3), 63);
    // INT4 g128 (a tile a group, 2 bytes): expert 2 of K = 256 (2 tiles), row 1, group 1:
    // ((2 * 2 + 1) * 16 + 1) * 2.
    assert_eq!(W4::INT4_G128.group_scale_at(16, 256, 2, 1, 1), 162);
    // Every offset of an expert tensor is distinct and inside it.
    for w in [W4::NVFP4, W4::MXFP4, W4::INT4_G128] {
        let (e, n, k) = (3, 16, 512);
        let sb = w.scale.bytes() as usize;
        let mut seen = BTreeSet::new();
        for x in 0..e {
            for j in 0..n {
                for q in 0..w.groups(k) {
                    let at = w.group_scale_at(n, k, x, j, q);
                    assert!(at + sb <= w.group_scale_bytes(e, n, k), "{w:?}");
                    assert!(at % sb == 0 && seen.insert(at), "{w:?} {x} {j} {q}");
                }
            }
        }
        assert_eq!(seen.len() * sb, w.group_scale_bytes(e, n, k), "{w:?}");
    }
}

/// Weights read through a recipe's row modes (`wmap::WRows`): the weight load takes the map's rank
/// (`[gate; up]` paired: three row modes and the expert; up-first interleaved by 64: four, the
/// expert folded; both rank 5) with the
/// tile's coordinates computed once a tile, the up-first epilogue swaps the pair's roles, the tag
/// names the modes, and each assembles clean; forms the kernel cannot serve are refused by name.
#[test]
fn weights_read_through_row_modes_take_their_rank_and_assemble() {
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
    let fused = |c: WsConfig, w_rows| WsConfig {
        epilogue: Epilogue::SiluMul,
        w_rows,
        ..c
    };
    let e4m3 = |c: WsConfig| WsConfig {
        operands: Operands::E4m3,
        scaling: Scaling::Tensorwise { per_token: true },
        ..c
    };
    let forms = [
        (fused(base(), paired), "5d", "_w8x2"),
        (fused(decode(), paired), "5d", "_w8x2"),
        (fused(e4m3(base()), interleaved), "5d", "_w8x2x8fu"),
        (fused(e4m3(decode()), interleaved), "5d", "_w8x2x8fu"),
    ];
    for (c, dim, suffix) in forms {
        let tag = c.tag();
        assert!(tag.ends_with(suffix), "{tag}");
        let text = grouped_ws_module("k", &c).unwrap();
        // X's 2-D load and the weights' map of the modes' rank.
        assert_eq!(
            count(
                &text,
                &format!("cp.async.bulk.tensor.{dim}.shared::cluster")
            ),
            1,
            "{tag}"
        );
        assert_eq!(count(&text, "cp.async.bulk.tensor.3d"), 0, "{tag}");
        assembles_clean(&text, &tag);
        // The epilogue's pairs: the same multiplies, gate and up swapped where up comes first.
        let plain = grouped_ws_module(
            "k",
            &WsConfig {
                w_rows: WRows::PLAIN,
                ..c
            },
        )
        .unwrap();
        for pat in [
            "ex2.approx",
            "wgmma.mma_async",
            "st.global",
            "mbarrier",
            "bar.sync",
        ] {
            assert_eq!(count(&text, pat), count(&plain, pat), "{tag}: {pat}");
        }
        assert_ne!(text, plain, "{tag}");
    }
    // Refused: register-sourced A through row modes; up rows first without the fused epilogue;
    // modes whose product does not divide N (4104 rows are no whole blocks of 16); a tile that
    // is no box of the modes (128 rows over modes of 48); a rank-6 map.
    let i8 = WsConfig {
        operands: Operands::I8Bf16,
        scaling: Scaling::PerRow,
        w_rows: paired,
        ..decode()
    };
    assert!(refused(&i8).contains("row modes"), "{}", refused(&i8));
    let store_up = WsConfig {
        w_rows: WRows {
            up_first: true,
            ..paired
        },
        ..base()
    };
    assert!(refused(&store_up).contains("up rows first"));
    let odd = WsConfig {
        n: 4104,
        w_rows: paired,
        ..base()
    };
    assert!(refused(&odd).contains("divide N"), "{}", refused(&odd));
    let box_ = WsConfig {
        w_rows: WRows {
            modes: 2,
            inner: [48, 0, 0],
            folded: false,
            up_first: false,
        },
        n: 4608,
        ..base()
    };
    assert!(refused(&box_).contains("box"), "{}", refused(&box_));
    let rank6 = WsConfig {
        w_rows: WRows {
            folded: false,
            ..interleaved
        },
        ..fused(base(), interleaved)
    };
    assert!(refused(&rank6).contains("rank-6"), "{}", refused(&rank6));
}

/// Block scales with the fused epilogue's paired rows: two weight-scale boxes a k-tile (the tile's
/// gate rows' block and its up rows'), the up rows' box `I` rows on (`(w0 / 2 + I) / 128`: an add
/// of `I` that the same tile unpaired has not), assembled with no spill; tiles of more than 128
/// rows and N off 128 refused.
#[test]
fn paired_block_scales_take_each_half_its_block() {
    let block = WsConfig {
        operands: Operands::E4m3,
        scaling: Scaling::Block128,
        out: OutTy::F32,
        epilogue: Epilogue::SiluMul,
        stages: 6,
        ..base()
    };
    let i = block.n / 2;
    // Lines adding `I` to a register (the up rows' block; `setp` and other uses of the value left
    // out).
    let adds_i = |text: &str| {
        text.lines()
            .filter(|l| l.trim_start().starts_with("add.u32") && l.ends_with(&format!(", {i};")))
            .count()
    };
    for c in [
        block,
        WsConfig {
            two_slices: true,
            ..block
        },
        WsConfig {
            bn: 16,
            stages: 8,
            consumers: 1,
            swap_ab: true,
            ..block
        },
    ] {
        assert!(c.paired_blocks() && c.w_scale_boxes() == 2, "{}", c.tag());
        let text = grouped_ws_entry("k", &c).unwrap();
        // The activation scales' box and the two weight-scale boxes, the second 128 bytes on.
        assert_eq!(count(&text, "cp.async.bulk.tensor.1d."), 3, "{}", c.tag());
        assert_eq!(c.block_x_at(), 2 * ws::BLOCK_SCALE_X_AT);
        // The up rows' block: once in the producer, once a promotion site in the consumers.
        let plain = WsConfig {
            epilogue: Epilogue::Store,
            ..c
        };
        assert!(!plain.paired_blocks() && plain.w_scale_boxes() == 1);
        let plain_text = grouped_ws_entry("k", &plain).unwrap();
        assert_eq!(
            count(&plain_text, "cp.async.bulk.tensor.1d."),
            2,
            "{}",
            c.tag()
        );
        assert!(
            adds_i(&text) >= 2 && adds_i(&plain_text) == 0,
            "{}: {} adds of I paired, {} unpaired",
            c.tag(),
            adds_i(&text),
            adds_i(&plain_text)
        );
        assembles_clean(
            &grouped_ws_module("k", &c).unwrap(),
            &format!("pb_{}", c.tag()),
        );
    }
    for (c, why) in [
        (
            WsConfig {
                bn: 192,
                stages: 5,
                ..block
            },
            "at most 128 rows a tile",
        ),
        (WsConfig { n: 4160, ..block }, "N a multiple of 128"),
    ] {
        let e = refused(&c);
        assert!(e.contains(why), "{e}");
    }
}

/// Every tuning candidate of every scaled family, with every epilogue it takes: the epilogue's
/// scale loads sit all before the k loop or all after it, those before take at most 20
/// registers (a `v2` load two; `ws::EARLY_LOADS`), and they are late only past that.
#[test]
fn the_early_scale_loads_of_every_candidate_fit_their_budget() {
    use moeforge_codegen::gemm::ws::{AQuant, W4};
    let families = [
        (Operands::E4m3, Scaling::Tensorwise { per_token: true }),
        (Operands::E4m3, Scaling::Tensorwise { per_token: false }),
        (Operands::E4m3, Scaling::Channelwise { per_token: true }),
        (Operands::E4m3, Scaling::Channelwise { per_token: false }),
        (
            Operands::E4m3,
            Scaling::Groupwise {
                group: 128,
                per_token: true,
            },
        ),
        (Operands::I8Bf16, Scaling::PerRow),
        (Operands::W4Bf16(W4::NVFP4), Scaling::PerExpert),
    ];
    let budget = ws::EARLY_LOADS as usize;
    let mut early = 0;
    for (operands, scaling) in families {
        for c in tune::candidates(operands, scaling, 1536, 2048) {
            let mut forms = vec![
                (OutTy::Bf16, Epilogue::Store),
                (OutTy::F32, Epilogue::SiluMul),
            ];
            if operands == Operands::E4m3 {
                forms.push((OutTy::F32, Epilogue::SiluMulE4m3(AQuant::Static)));
            }
            for (out, epilogue) in forms {
                let c = WsConfig { out, epilogue, ..c };
                if c.supported().is_err() {
                    continue;
                }
                let text = grouped_ws_module("k", &c).unwrap();
                // (Registers: a v2 load fills two.)
                let (before, after) = scale_loads_around_the_k_loop(&text, 2);
                assert!(
                    before <= budget,
                    "{}: {before} registers loaded early",
                    c.tag()
                );
                assert!(before == 0 || after == 0, "{}: {before} / {after}", c.tag());
                assert!(before + after > 0, "{}: no scale loads", c.tag());
                // (Late only past the budget.)
                assert!(before > 0 || after > budget, "{}: {after} late", c.tag());
                early += usize::from(before > 0);
            }
        }
    }
    assert!(early > 0);
}

/// The scale loads of the consumers' epilogue (`ld.global.f32` / `.v2.f32`, a v2 load counted
/// `v2` times) before and after the first k loop (`$L_c_k`) of `text`.
fn scale_loads_around_the_k_loop(text: &str, v2: usize) -> (usize, usize) {
    let at = text.find("$L_c_k").expect("a consumer k loop");
    let loads = |s: &str| count(s, "ld.global.f32") + v2 * count(s, "ld.global.v2.f32");
    let tile = text.find("$L_c_tile").expect("a consumer tile loop");
    (loads(&text[tile..at]), loads(&text[at..]))
}

/// `c` with E4M3 operands scaled as `scaling`, f32 out.
fn e4m3_f32(scaling: Scaling, c: WsConfig) -> WsConfig {
    WsConfig {
        operands: Operands::E4m3,
        scaling,
        out: OutTy::F32,
        ..c
    }
}

#[test]
fn the_epilogue_scales_are_loaded_before_the_k_loop_where_they_are_few() {
    use ws::AQuant;
    let e4m3 = e4m3_f32;
    let token = Scaling::Tensorwise { per_token: true };
    let channel = Scaling::Channelwise { per_token: true };
    // (form, config, loads expected before the k loop, after it)
    let forms = [
        // Prefill per token: two token rows and the expert's weight scale.
        ("prefill per token", e4m3(token, base()), 3, 0),
        (
            "prefill static E4M3 output",
            WsConfig {
                epilogue: Epilogue::SiluMulE4m3(AQuant::Static),
                bn: 256,
                ..e4m3(token, base())
            },
            4,
            0,
        ),
        // Decode: BN / 4 token classes and the weight scale, up to 64 tokens.
        ("decode 16 per token", e4m3(token, decode()), 5, 0),
        (
            "decode 64 per token",
            WsConfig {
                bn: 64,
                stages: 6,
                ..e4m3(token, decode())
            },
            17,
            0,
        ),
        // Decode per channel: BN / 4 token classes and the two weight rows' scales.
        ("decode per channel", e4m3(channel, decode()), 6, 0),
        // Prefill per channel: the BN / 4 row scales (pairs, v2) are too many to hold through
        // the k loop; the epilogue loads them and the token rows' scales after it.
        ("prefill per channel", e4m3(channel, base()), 0, 2 + 128 / 8),
    ];
    for (what, c, before, after) in forms {
        let text = grouped_ws_module("k", &c).unwrap();
        assert_eq!(
            scale_loads_around_the_k_loop(&text, 1),
            (before, after),
            "{what}: {}",
            c.tag()
        );
        assembles_clean(&text, &c.tag());
    }
}

/// A consumer whose token rows all lie past its expert's end skips its MMAs and its epilogue
/// (`ws::skips_idle_rows`): in the prefill forms with two consumers and one accumulator the tile
/// starts with a branch on `tok0 + 64 c >= hi` to a loop that waits for each stage and frees it
/// (one `mbarrier` wait and one arrival a k-tile, no MMA, no store), then jumps past the epilogue
/// to the tile's end (a counted E4M3 output's arrival still follows); every other form has none.
#[test]
fn a_consumer_past_its_experts_end_frees_the_stages_without_mmas() {
    use ws::AQuant;
    let e4m3 = e4m3_f32;
    let token = Scaling::Tensorwise { per_token: true };
    let channel = Scaling::Channelwise { per_token: true };
    let skipping = [
        ("bf16", base()),
        ("bf16 256", WsConfig { bn: 256, ..base() }),
        ("per token", e4m3(token, base())),
        ("per channel", e4m3(channel, base())),
        (
            "static E4M3 output",
            WsConfig {
                epilogue: Epilogue::SiluMulE4m3(AQuant::Static),
                bn: 256,
                ..e4m3(token, base())
            },
        ),
        (
            "counted E4M3 output",
            WsConfig {
                epilogue: Epilogue::SiluMulE4m3(AQuant::PerToken),
                ..e4m3(token, base())
            },
        ),
        ("block-scaled", e4m3(Scaling::Block128, base())),
        (
            "block-scaled, 192 rows",
            WsConfig {
                bn: 192,
                stages: 5,
                ..e4m3(Scaling::Block128, base())
            },
        ),
        (
            "block-scaled, two slices",
            WsConfig {
                two_slices: true,
                ..e4m3(Scaling::Block128, base())
            },
        ),
    ];
    for (what, plain) in skipping {
        // Off unless asked for; asked for, the tag says so.
        assert!(!ws::skips_idle_rows(&plain), "{what}");
        assert!(!grouped_ws_module("k", &plain)
            .unwrap()
            .contains("$L_c_idle"));
        let c = WsConfig {
            skip_idle: true,
            ..plain
        };
        assert!(
            c.tag().contains("_i_") && !plain.tag().contains("_i_"),
            "{what}"
        );
        assert!(ws::skips_idle_rows(&c), "{what}");
        let text = grouped_ws_module("k", &c).unwrap();
        let at = |label: &str| {
            text.find(&format!("\n{label}"))
                .unwrap_or_else(|| panic!("{what}: no {label}"))
        };
        let (tile, idle, busy, kloop, past) = (
            at("$L_c_tile"),
            at("$L_c_idle"),
            at("$L_c_busy"),
            at("$L_c_k"),
            at("$L_c_past_epilogue"),
        );
        assert!(
            tile < idle && idle < busy && busy < kloop && kloop < past,
            "{what}"
        );
        let body = &text[idle..busy];
        assert_eq!(count(body, "wgmma"), 0, "{what}");
        assert_eq!(count(body, "st.global"), 0, "{what}");
        assert_eq!(count(body, "mbarrier.try_wait"), 1, "{what}");
        assert_eq!(count(body, "mbarrier.arrive"), 1, "{what}");
        assert!(body.contains("bra.uni \t$L_c_past_epilogue"), "{what}");
        // The epilogue's stores lie between the k loop and the label the idle loop jumps to.
        assert!(count(&text[kloop..past], "st.global") > 0, "{what}");
        // A counted output's arrival (its fence) comes after the label, on both paths.
        if c.epilogue.quant().is_some_and(AQuant::counted) {
            assert!(count(&text[past..], "fence.acq_rel.gpu") > 0, "{what}");
        }
        assembles_clean(&text, &format!("idle_{}", c.tag()));
    }
    let not = [
        ("decode", decode()),
        (
            "one consumer",
            WsConfig {
                consumers: 1,
                ..base()
            },
        ),
        (
            "split-K",
            WsConfig {
                split_k: 2,
                ..base()
            },
        ),
    ];
    for (what, c) in not {
        let c = WsConfig {
            skip_idle: true,
            ..c
        };
        assert!(!ws::skips_idle_rows(&c), "{what}");
        // Asked for where it cannot apply: refused by name, not generated.
        let err = c.supported().unwrap_err().to_string();
        assert!(err.contains("skipping idle consumers"), "{what}: {err}");
    }
    // The tuning candidates hold none; the twins follow each form that takes them.
    for (operands, scaling) in [
        (Operands::Bf16, Scaling::None),
        (Operands::E4m3, Scaling::Tensorwise { per_token: true }),
        (Operands::E4m3, Scaling::Block128),
        (
            Operands::E4m3,
            Scaling::Groupwise {
                group: 128,
                per_token: true,
            },
        ),
    ] {
        let all = tune::candidates(operands, scaling, 1536, 2048);
        assert!(all.iter().all(|c| !c.skip_idle));
        let twins = tune::with_idle_twins(all.clone());
        let asked: Vec<_> = twins.iter().filter(|c| c.skip_idle).collect();
        assert_eq!(twins.len(), all.len() + asked.len());
        for t in &asked {
            assert!(
                ws::skips_idle_rows(t) && t.supported().is_ok(),
                "{}",
                t.tag()
            );
            let plain = WsConfig {
                skip_idle: false,
                ..**t
            };
            assert!(all.contains(&plain), "{}", t.tag());
        }
        // Prefill forms with two consumers take it (group-wise FP8 has none: weights on A).
        let prefill2 = all
            .iter()
            .filter(|c| !c.swap_ab && c.consumers == 2 && c.split_k == 1)
            .count();
        assert_eq!(asked.len(), prefill2, "{operands:?} {scaling:?}");
    }
}
