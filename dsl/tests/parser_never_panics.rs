//! Arbitrary input never panics the front end: it verifies or gives diagnostics whose spans lie in
//! the source. (The same property under coverage-guided fuzzing: `fuzz/fuzz_targets/parse.rs`.)

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use proptest::prelude::*;

const SEEDS: &[&str] = &[
    include_str!("../../kernels/nvfp4_cutedsl.recipe"),
    include_str!("../../kernels/fp8_per_tensor.recipe"),
    include_str!("../../kernels/fp8_block128.recipe"),
    include_str!("../../kernels/mxfp4.recipe"),
];

fn run(src: &str) {
    let bind = vec![
        ("E".to_string(), 2),
        ("H".to_string(), 128),
        ("I".to_string(), 128),
    ];
    for b in [None, Some(bind.as_slice())] {
        if let Err(diags) = moeforge_dsl::check(src, b) {
            assert!(!diags.is_empty());
            for d in &diags {
                for (span, _) in &d.labels {
                    assert!(span.start <= span.end && span.end <= src.len(), "{d:?}");
                }
                let _ = d.render("fuzz.recipe", src);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn arbitrary_text(s in "\\PC{0,200}") {
        run(&s);
    }

    #[test]
    fn recipe_like_tokens(toks in prop::collection::vec(prop::sample::select(vec![
        "recipe", "r", "(", ")", "E", ":", "experts", ",", "H", "where", "%", "==", "0", "64", "{", "}",
        "input", "param", "view", "let", "kernel", "quant", "nvfp4", "w", "bf16", "e2m1", "[", "]", "=",
        "*", "/", "@", "S<3,4,3> o", "bijective", "swizzle_128x4", "mma_sf_view", "interleave", ".", "\n",
        "-", "+", "99999999999999999999", "reduce", "moe_tp", "#c\n", "<=", "on", "index", "i32",
    ]), 0..60)) {
        run(&toks.join(" "));
    }

    #[test]
    fn mutated_standard_recipes(k in 0usize..4, at in 0usize..4000, len in 0usize..40, ins in "\\PC{0,8}") {
        let src = SEEDS[k];
        let at = at % (src.len() + 1);
        let end = (at + len).min(src.len());
        if !src.is_char_boundary(at) || !src.is_char_boundary(end) {
            return Ok(());
        }
        let mutated = format!("{}{}{}", &src[..at], ins, &src[end..]);
        run(&mutated);
    }
}
