//! Every worked example of SPEC §1-§3, checked against the reference formulas, the layout algebra and
//! the standard recipes' own views and row orders.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use moeforge::dsl::ir::{Op, TensorKind};
use moeforge::dsl::layout::IntTuple;
use moeforge::dsl::spec;
use moeforge::kernels;

fn bind(e: i64, h: i64, i: i64) -> Vec<(String, i64)> {
    vec![("E".into(), e), ("H".into(), h), ("I".into(), i)]
}

/// SPEC §1 worked example, M=256, K=8.
#[test]
fn swizzle_128x4_worked_example() {
    let cases = [
        ((0, 0), 0),
        ((0, 3), 3),
        ((0, 4), 512),
        ((1, 0), 16),
        ((31, 0), 496),
        ((32, 0), 4),
        ((33, 2), 22),
        ((127, 7), 1023),
        ((128, 0), 1024),
        ((200, 5), 1673),
    ];
    let lay = spec::swizzle_128x4_layout(1, 256, 8).unwrap();
    for ((r, c), want) in cases {
        assert_eq!(
            spec::swizzle_128x4_offset(0, r, c, 256, 8),
            want,
            "formula at ({r},{c})"
        );
        // The same map as a hierarchical CuTe layout over logical (b, r, c), with r and c given as
        // integer coordinates of their hierarchical modes.
        let crd = IntTuple::Tuple(vec![IntTuple::Int(0), IntTuple::Int(r), IntTuple::Int(c)]);
        assert_eq!(lay.crd2idx(&crd).unwrap(), want, "layout at ({r},{c})");
    }
    // 1673 is element [209, 1] of the nominal [256, 8] output.
    assert_eq!(1673 / 8, 209);
    assert_eq!(1673 % 8, 1);
    assert_eq!(
        lay.to_string(),
        "(1,(32,4,2),(4,2)):(2048,(16,4,1024),(1,512))"
    );
    // Each batch is padded separately: batch b starts at b*Mp*Kp.
    assert_eq!(spec::swizzle_128x4_offset(2, 0, 0, 200, 5), 2 * 256 * 8);
}

/// The swizzle is a bijection of the padded tile storage, and its inverse (SPEC §1's reshape and
/// permute) recovers the logical coordinate.
#[test]
fn swizzle_128x4_is_a_bijection_with_the_spec_inverse() {
    for (m, k) in [(256, 8), (200, 5), (128, 4), (1, 1), (300, 13)] {
        let (mp, kp) = (spec::ru(m, 128), spec::ru(k, 4));
        let lay = spec::swizzle_128x4_layout(2, m, k).unwrap();
        assert!(lay.is_bijective(), "{lay}");
        let mut seen = vec![false; (2 * mp * kp) as usize];
        for b in 0..2 {
            for r in 0..mp {
                for c in 0..kp {
                    let o = spec::swizzle_128x4_offset(b, r, c, m, k);
                    assert!(!seen[o as usize]);
                    seen[o as usize] = true;
                    // Inverse: reshape [B, MT, KT, 32, 4, 4] -> permute (0,1,4,3,2,5) -> [B, Mp, Kp].
                    let (mt_n, kt_n) = (mp / 128, kp / 4);
                    let rest = o - b * mp * kp;
                    let (mt, rest) = (rest / (kt_n * 512), rest % (kt_n * 512));
                    let (kt, rest) = (rest / 512, rest % 512);
                    let (r32, rest) = (rest / 16, rest % 16);
                    let (r4, c4) = (rest / 4, rest % 4);
                    assert!(mt < mt_n);
                    assert_eq!((mt * 128 + r4 * 32 + r32, kt * 4 + c4), (r, c));
                }
            }
        }
    }
}

/// SPEC §2: m=256, k=128, G=3: shape (32,4,2,4,2,3), strides (16,4,1024,1,512,2048), element
/// (8,2,1,1,1,2) -> 5769 = S_2[200,5]; through the nvfp4_cutedsl recipe's `w13_scale_mma` view.
#[test]
fn mma_view_worked_example_through_the_recipe() {
    let r = kernels::find("nvfp4_cutedsl").unwrap();
    // 2I = m = 256 rows, H = k = 128, E = G = 3.
    let info = moeforge::dsl::check(r.source, Some(&bind(3, 128, 128))).unwrap();
    let v = info.view("w13_scale_mma").unwrap();
    let (lay, off) = info.numeric(&v.layout).unwrap();
    assert_eq!(off, 0);
    assert_eq!(lay.to_string(), "(32,4,2,4,2,3):(16,4,1024,1,512,2048)");
    assert_eq!(lay.crd2idx_flat(&[8, 2, 1, 1, 1, 2]).unwrap(), 5769);
    assert_eq!(spec::mma_view_offset([8, 2, 1, 1, 1, 2], 256, 128), 5769);
    // Composed with §1: view[r%32, (r%128)/32, r/128, c%4, c/4, g] == S_g[r, c].
    let (r_, c_, g) = (200, 5, 2);
    let per_group = 256 * 8;
    assert_eq!(
        lay.crd2idx_flat(&[r_ % 32, (r_ % 128) / 32, r_ / 128, c_ % 4, c_ / 4, g])
            .unwrap(),
        g * per_group + spec::swizzle_128x4_offset(0, r_, c_, 256, 8)
    );
    assert!(lay.is_bijective());
    // Its storage is the swizzled param (an alias, storage offset 0).
    let src = info.module().tensor(v.source).unwrap();
    assert_eq!(src.name, "w13_weight_scale");
    assert_eq!(src.kind, TensorKind::Param);
}

/// SPEC §2's formula equals the recipe view's index map, element by element, for several shapes.
#[test]
fn mma_view_index_map_matches_formula_for_several_shapes() {
    let r = kernels::find("nvfp4_cutedsl").unwrap();
    for (e, h, i) in [
        (3, 128, 128),
        (2, 64, 64),
        (4, 256, 192),
        (1, 1024, 320),
        (5, 192, 64),
    ] {
        let info = moeforge::dsl::check(r.source, Some(&bind(e, h, i))).unwrap();
        for (view, m, k) in [("w13_scale_mma", 2 * i, h), ("w2_scale_mma", h, i)] {
            let v = info.view(view).unwrap();
            let map = info.index_map(v).unwrap();
            let mt = spec::cd(m, 128);
            let kt = spec::cd(spec::cd(k, 16), 4);
            let shape = [32, 4, mt, 4, kt, e];
            let mut n = 0usize;
            // Row-major over the view's shape: last index fastest.
            for a in 0..32 {
                for b in 0..4 {
                    for x in 0..mt {
                        for c in 0..4 {
                            for y in 0..kt {
                                for g in 0..e {
                                    assert_eq!(
                                        map[n],
                                        spec::mma_view_offset([a, b, x, c, y, g], m, k),
                                        "{view} at E={e},H={h},I={i}: {:?}",
                                        [a, b, x, c, y, g]
                                    );
                                    n += 1;
                                }
                            }
                        }
                    }
                }
            }
            assert_eq!(n, map.len());
            assert_eq!(n as i64, shape.iter().product::<i64>());
        }
    }
}

/// SPEC §3: `interleave_linear_and_gate` with n=256, g=64.
#[test]
fn interleave_worked_example() {
    let out: Vec<i64> = (0..256).map(|j| spec::interleave_src(j, 256, 64)).collect();
    let want: Vec<i64> = (0..64)
        .chain(128..192)
        .chain(64..128)
        .chain(192..256)
        .collect();
    assert_eq!(out, want);
    // A smaller one: n=8, g=2 -> [0,1,4,5,2,3,6,7].
    let out: Vec<i64> = (0..8).map(|j| spec::interleave_src(j, 8, 2)).collect();
    assert_eq!(out, vec![0, 1, 4, 5, 2, 3, 6, 7]);
}

/// SPEC §3 composite for 2I=256 from [gate; up]: source rows [128..191, 0..63, 192..255, 64..127],
/// taken from the row gather the nvfp4_cutedsl recipe itself declares.
#[test]
fn cutedsl_row_order_from_the_recipe() {
    let r = kernels::find("nvfp4_cutedsl").unwrap();
    let info = moeforge::dsl::check(r.source, Some(&bind(2, 64, 128))).unwrap();
    let m = info.module();
    let w = m.tensor(m.find("w13_weight").unwrap()).unwrap();
    // Walk the param's definition down to its row gather.
    let mut v = w.value.unwrap();
    let index = loop {
        match &m.value(v).unwrap().op {
            Op::Gather { index, dim, .. } => {
                assert_eq!(*dim, 1);
                break index.clone();
            }
            other => v = other.operands()[0],
        }
    };
    let atoms = info.binding().unwrap().atoms();
    let rows: Vec<i128> = (0..256).map(|j| index.map(j, atoms).unwrap()).collect();
    let want: Vec<i128> = (128..192)
        .chain(0..64)
        .chain(192..256)
        .chain(64..128)
        .collect();
    assert_eq!(rows, want);
    for j in 0..256 {
        assert_eq!(rows[j as usize] as i64, spec::cutedsl_row_src(j, 256, 64));
    }
    // The same gather feeds the scales, so weights and scales stay row-aligned.
    let s = m.tensor(m.find("w13_weight_scale").unwrap()).unwrap();
    let reads_gather = {
        let mut stack = vec![s.value.unwrap()];
        let mut found = false;
        while let Some(x) = stack.pop() {
            let val = m.value(x).unwrap();
            if let Op::Gather { index: ix, .. } = &val.op {
                found |= *ix == index;
            }
            stack.extend(val.op.operands());
        }
        found
    };
    assert!(reads_gather);
}
