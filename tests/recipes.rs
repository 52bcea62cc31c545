//! Every standard recipe verifies, unbound and at real model shapes, with every promise proven
//! symbolically, and its move set matches the bytes of its params.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use moeforge::dsl::Proof;
use moeforge::kernels::STANDARD;

const SHAPES: &[(&str, i64, i64, i64)] = &[
    ("qwen3-30b-a3b", 128, 2048, 768),
    ("deepseek-v3 EP8", 32, 7168, 2048),
    ("mixtral-8x7b", 8, 4096, 14336),
    ("small", 1, 64, 64),
];

#[test]
fn standard_recipes_verify_symbolically() {
    for r in STANDARD {
        let info = moeforge::dsl::check(r.source, None).unwrap_or_else(|d| {
            panic!(
                "{}:\n{}",
                r.path,
                moeforge::dsl::diag::render_all(&d, r.path, r.source)
            )
        });
        assert_eq!(info.module().name, r.name);
        assert!(
            info.params.iter().all(|p| p.proof == Proof::Symbolic),
            "{}",
            r.name
        );
        assert!(
            info.views.iter().all(|v| v.in_bounds == Proof::Symbolic),
            "{}",
            r.name
        );
        assert!(
            info.views
                .iter()
                .all(|v| v.bijective_proof == Proof::Symbolic),
            "{}",
            r.name
        );
        assert!(
            info.kernels.iter().all(|k| k.proof == Proof::Symbolic),
            "{}",
            r.name
        );
        assert_eq!(info.move_set.len(), info.params.len());
    }
}

#[test]
fn standard_recipes_at_model_shapes() {
    for r in STANDARD {
        for (model, e, h, i) in SHAPES {
            // int4_g128 groups K by 128: the small shape is below one group.
            if r.name == "int4_g128" && (h % 128 != 0 || i % 128 != 0) {
                continue;
            }
            let bind = vec![("E".into(), *e), ("H".into(), *h), ("I".into(), *i)];
            let info = moeforge::dsl::check(r.source, Some(&bind)).unwrap_or_else(|d| {
                panic!(
                    "{} at {model}:\n{}",
                    r.path,
                    moeforge::dsl::diag::render_all(&d, r.path, r.source)
                )
            });
            let m = info.module();
            for (p, mv) in info.params.iter().zip(&info.move_set) {
                let t = m.tensor(p.id).unwrap();
                let numel: i128 = t.shape.iter().map(|d| info.eval(d).unwrap()).product();
                let bytes = numel * t.dtype.bits() as i128 / 8;
                assert_eq!(
                    info.bytes_per_expert(mv).unwrap() * *e as i128,
                    bytes,
                    "{} {}",
                    r.name,
                    t.name
                );
                // A view's every element lands in its param's storage.
                for v in info.views.iter().filter(|v| v.source == p.id) {
                    let (lay, off) = info.numeric(&v.layout).unwrap();
                    assert!(off as i128 + lay.cosize() as i128 <= numel);
                }
            }
        }
    }
}

#[test]
fn nvfp4_cutedsl_registers_what_eplb_must_move() {
    let r = moeforge::kernels::find("nvfp4_cutedsl").unwrap();
    let info = moeforge::dsl::check(r.source, None).unwrap();
    let names: Vec<&str> = info
        .move_set
        .iter()
        .map(|e| info.module().tensor(e.param).unwrap().name.as_str())
        .collect();
    assert_eq!(
        names,
        [
            "w13_weight",
            "w13_weight_scale",
            "w13_weight_scale_2",
            "w2_weight",
            "w2_weight_scale",
            "w2_weight_scale_2",
            "g1_alphas",
            "g2_alphas"
        ]
    );
    // The alphas exist only when the checkpoint has activation scales.
    let opt: Vec<bool> = info
        .move_set
        .iter()
        .map(|e| info.module().tensor(e.param).unwrap().optional)
        .collect();
    assert_eq!(opt, [false, false, false, false, false, false, true, true]);
}
