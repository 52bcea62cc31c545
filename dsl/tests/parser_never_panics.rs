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

/// [`run`] on a 1 MiB stack: deep input must not need more (`dsl/tests/hostile_input.rs`).
fn run_small_stack(src: String) {
    std::thread::Builder::new()
        .stack_size(1 << 20)
        .spawn(move || run(&src))
        .unwrap()
        .join()
        .unwrap();
}

/// Openers and closers of every nesting construct, and chain links, for deep and long input.
const NESTS: &[(&str, &str)] = &[
    ("(", ")"),
    ("-", ""),
    ("permute(", ", 1, 0)"),
    ("ceil_div(", ", 2)"),
    ("cat(", ", w)"),
    ("w[", ", :]"),
    ("quant nvfp4(", ")"),
    ("(", ""),
    ("", " + H"),
    ("", " * w"),
    ("", "[:, :]"),
    ("", ".values"),
    ("", " @ (E, H):(H, 1)"),
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn deep_and_long_input(k in 0usize..NESTS.len(), n in 0usize..600, core in prop::sample::select(vec!["H", "w", "p", "E * 2"]), at in 0usize..3) {
        let (open, close) = NESTS[k];
        let e = format!("{}{core}{}", open.repeat(n), close.repeat(n));
        let body = match at {
            0 => format!("  input w : bf16[E, {e}]"),
            1 => format!("  input w : f32[E, H]\n  param p : f32[E, H] = {e}"),
            _ => format!("  input w : f32[E, H]\n  param p : f32[E, H] = w\n  view v = {e}"),
        };
        run_small_stack(format!("recipe r(E: experts, H, I) where H % 64 == 0 {{\n{body}\n}}\n"));
    }

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
