//! Hostile input: very deep, very long and very large recipes get diagnostics, never a stack
//! overflow or a hang. Every case runs in a thread with a 1 MiB stack (an eighth of a main
//! thread's), so that passing proves the front end's recursion is bounded, not merely that the
//! default stack happened to be large enough. The limits are in `moeforge_dsl::limits`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use moeforge_dsl::limits::{MAX_CHAIN, MAX_DEPTH, MAX_SOURCE_BYTES};

const STACK: usize = 1 << 20;

/// `check` (unbound and bound) in a small-stack thread: the error codes, or `None` if it verified.
fn check_small_stack(src: String) -> Option<Vec<String>> {
    let h = std::thread::Builder::new()
        .stack_size(STACK)
        .spawn(move || {
            let t = Instant::now();
            let bind = vec![
                ("E".to_string(), 2),
                ("H".to_string(), 128),
                ("I".to_string(), 128),
            ];
            let mut codes = None;
            for b in [None, Some(bind.as_slice())] {
                match moeforge_dsl::check(&src, b) {
                    Ok(_) => {}
                    Err(diags) => {
                        assert!(!diags.is_empty());
                        for d in &diags {
                            for (span, _) in &d.labels {
                                assert!(span.start <= span.end && span.end <= src.len(), "{d:?}");
                            }
                        }
                        let rendered =
                            moeforge_dsl::diag::render_all(&diags, "hostile.recipe", &src);
                        assert!(rendered.contains("error["));
                        if codes.is_none() {
                            codes = Some(diags.iter().map(|d| d.code.clone()).collect());
                        }
                    }
                }
            }
            (codes, t.elapsed())
        })
        .unwrap();
    let (codes, took) = h.join().unwrap();
    assert!(took < Duration::from_secs(60), "took {took:?}");
    codes
}

fn expect_code(src: String, code: &str) {
    let codes = check_small_stack(src);
    assert_eq!(
        codes.as_deref().and_then(|c| c.first()).map(String::as_str),
        Some(code),
        "{codes:?}"
    );
}

fn recipe(body: &str) -> String {
    format!("recipe r(E: experts, H, I) where H % 64 == 0, I % 64 == 0 {{\n{body}\n}}\n")
}

#[test]
fn ten_thousand_nested_parentheses_in_a_size() {
    let size = format!("{}H{}", "(".repeat(10_000), ")".repeat(10_000));
    expect_code(recipe(&format!("  input w : bf16[E, {size}]")), "E0002");
}

#[test]
fn a_flat_sum_of_thirty_thousand_terms() {
    let sum = vec!["H"; 30_000].join(" + ");
    expect_code(recipe(&format!("  input w : bf16[E, {sum}]")), "E0003");
}

#[test]
fn ten_thousand_nested_permutes() {
    let v = format!("{}w{}", "permute(".repeat(10_000), ", 0, 1)".repeat(10_000));
    expect_code(
        recipe(&format!(
            "  input w : bf16[E, H]\n  param p : bf16[E, H] = {v}"
        )),
        "E0002",
    );
}

#[test]
fn ten_thousand_index_suffixes() {
    let v = format!("p{}", "[:, :]".repeat(10_000));
    expect_code(
        recipe(&format!(
            "  input w : bf16[E, H]\n  param p : bf16[E, H] = w\n  view v = {v}"
        )),
        "E0003",
    );
}

#[test]
fn a_hundred_thousand_unary_minus_signs() {
    let size = format!("{}H", "-".repeat(100_000));
    expect_code(recipe(&format!("  input w : bf16[E, {size}]")), "E0002");
}

#[test]
fn a_hundred_thousand_unclosed_parentheses() {
    let size = "(".repeat(100_000);
    expect_code(recipe(&format!("  input w : bf16[E, {size}")), "E0002");
}

#[test]
fn ten_thousand_lets_each_reading_the_last() {
    let mut body = String::from("  input w : f32[E, H]\n  let a0 = w\n");
    for k in 1..10_000 {
        body.push_str(&format!("  let a{k} = a{}\n", k - 1));
    }
    body.push_str("  param p : f32[E, H] = a9999\n");
    expect_code(recipe(&body), "E0002");
}

#[test]
fn ten_thousand_tensor_lets_with_arithmetic() {
    let mut body = String::from("  input w : f32[E, H]\n  let a0 = w * 2\n");
    for k in 1..10_000 {
        body.push_str(&format!("  let a{k} = a{} * 2\n", k - 1));
    }
    body.push_str("  param p : f32[E, H] = a9999\n");
    expect_code(recipe(&body), "E0002");
}

#[test]
fn lets_that_double_what_they_stand_for() {
    // Each `let` reads the previous one twice: 2^40 operations once substituted.
    let mut body = String::from("  input w : f32[E, H]\n  let a0 = w * w\n");
    for k in 1..40 {
        body.push_str(&format!("  let a{k} = a{0} * a{0}\n", k - 1));
    }
    body.push_str("  param p : f32[E, H] = a39\n");
    expect_code(recipe(&body), "E0003");
}

#[test]
fn ten_thousand_size_lets_are_fine() {
    // Sizes are numbers (polynomials), not trees: a long chain of them is legal.
    let mut body = String::from("  let s0 = H\n");
    for k in 1..10_000 {
        body.push_str(&format!("  let s{k} = s{} + 0\n", k - 1));
    }
    body.push_str("  input w : bf16[E, s9999]\n  param p : bf16[E, H] = w\n");
    assert_eq!(check_small_stack(recipe(&body)), None);
}

#[test]
fn squaring_sizes_through_lets() {
    // The degree doubles with each `let`: refused as overflow, never wrapped or looped over.
    let mut body = String::from("  let s0 = H * I + E\n");
    for k in 1..64 {
        body.push_str(&format!("  let s{k} = s{0} * s{0}\n", k - 1));
    }
    body.push_str("  input w : bf16[E, s63]\n");
    expect_code(recipe(&body), "E0207");
}

#[test]
fn ten_thousand_nested_interleaves_through_lets() {
    let mut body = String::from("  let r0 = interleave(arange(2*I), group = 1)\n");
    for k in 1..10_000 {
        body.push_str(&format!("  let r{k} = interleave(r{}, group = 1)\n", k - 1));
    }
    body.push_str("  input w : bf16[E, 2*I, H]\n  param p : bf16[E, 2*I, H] = w[:, r9999, :]\n");
    expect_code(recipe(&body), "E0002");
}

#[test]
fn ten_thousand_nested_ceil_divs_through_lets() {
    let mut body = String::from("  let c0 = ceil_div(H, 3)\n");
    for k in 1..10_000 {
        body.push_str(&format!("  let c{k} = ceil_div(c{}, 3)\n", k - 1));
    }
    body.push_str("  input w : bf16[E, c9999]\n");
    expect_code(recipe(&body), "E0002");
}

#[test]
fn ceil_divs_whose_written_form_doubles() {
    // `c{k}` is written with `c{k-1}` twice: the printed size would double with each `let`.
    let mut body = String::from("  let c0 = ceil_div(H, 3)\n");
    for k in 1..64 {
        body.push_str(&format!(
            "  let c{k} = ceil_div(c{0} * H + c{0}, 3)\n",
            k - 1
        ));
    }
    body.push_str("  input w : bf16[E, c63]\n");
    expect_code(recipe(&body), "E0003");
}

#[test]
fn a_source_over_the_size_limit() {
    let mut src = recipe("  input w : bf16[E, H]");
    src.push_str(&"# padding\n".repeat(MAX_SOURCE_BYTES / 10 + 1));
    expect_code(src, "E0004");
}

#[test]
fn limits_are_exact() {
    // MAX_DEPTH levels are fine, one more is not.
    let nested = |n: usize| format!("{}H{}", "(".repeat(n), ")".repeat(n));
    let ok = recipe(&format!("  input w : bf16[E, {}]", nested(MAX_DEPTH)));
    assert_eq!(check_small_stack(ok), None);
    let deep = recipe(&format!("  input w : bf16[E, {}]", nested(MAX_DEPTH + 1)));
    expect_code(deep, "E0002");
    // MAX_CHAIN terms are fine, one more is not.
    let sum = |n: usize| vec!["H"; n].join(" + ");
    let ok = recipe(&format!("  input w : bf16[E, {}]", sum(MAX_CHAIN)));
    assert_eq!(check_small_stack(ok), None);
    let long = recipe(&format!("  input w : bf16[E, {}]", sum(MAX_CHAIN + 1)));
    expect_code(long, "E0003");
}

#[test]
fn long_legal_chains_verify() {
    // MAX_CHAIN suffixes in a row: a long but legal view, answered without deep recursion.
    let v = format!("p{}", "[:, :]".repeat(MAX_CHAIN));
    let src = recipe(&format!(
        "  input w : bf16[E, H]\n  param p : bf16[E, H] = w\n  view v = {v}"
    ));
    assert_eq!(check_small_stack(src), None);
    // MAX_DEPTH nested calls.
    let v = format!(
        "{}w{}",
        "permute(".repeat(MAX_DEPTH),
        ", 0, 1)".repeat(MAX_DEPTH)
    );
    let src = recipe(&format!(
        "  input w : bf16[E, H]\n  param p : bf16[E, H] = {v}"
    ));
    assert_eq!(check_small_stack(src), None);
    // A long product of tensors: one level per factor in the IR, so up to MAX_DEPTH factors.
    let v = vec!["w"; MAX_DEPTH].join(" * ");
    let src = recipe(&format!(
        "  input w : f32[E, H]\n  param p : f32[E, H] = {v}"
    ));
    assert_eq!(check_small_stack(src), None);
}

#[test]
fn every_nesting_construct_at_the_limit() {
    // Each construct nested MAX_DEPTH levels deep is answered (verified or refused, no crash), and
    // one level more is refused with E0002.
    let parens = |n: usize| format!("{}H{}", "(".repeat(n), ")".repeat(n));
    let minus = |n: usize| format!("{}H", "-".repeat(n));
    let ceil = |n: usize| format!("{}H{}", "ceil_div(".repeat(n), ", 1)".repeat(n));
    let sizes: [(&str, &dyn Fn(usize) -> String); 3] =
        [("parens", &parens), ("minus", &minus), ("ceil_div", &ceil)];
    for (what, f) in sizes {
        for n in [MAX_DEPTH, MAX_DEPTH + 1] {
            let src = recipe(&format!("  input w : bf16[E, {}]", f(n)));
            let codes = check_small_stack(src);
            if n > MAX_DEPTH {
                assert_eq!(
                    codes.as_deref().and_then(|c| c.first()).map(String::as_str),
                    Some("E0002"),
                    "{what}"
                );
            }
        }
    }
    let tensors: [(&str, &dyn Fn(usize) -> String); 4] = [
        ("permute", &|n| {
            format!("{}w{}", "permute(".repeat(n), ", 0, 1)".repeat(n))
        }),
        ("cat", &|n| {
            format!("{}w{}", "cat(".repeat(n), ")".repeat(n))
        }),
        ("index", &|n| {
            format!("w[{}0{}, :]", "0 + w[".repeat(n - 1), ", 0]".repeat(n - 1))
        }),
        ("layout", &|n| {
            format!("w @ {}E{} : (H, 1)", "(".repeat(n - 1), ")".repeat(n - 1))
        }),
    ];
    for (what, f) in tensors {
        for n in [MAX_DEPTH, MAX_DEPTH + 1] {
            let src = recipe(&format!(
                "  input w : f32[E, H]\n  param p : f32[E, H] = {}",
                f(n)
            ));
            let codes = check_small_stack(src);
            if n > MAX_DEPTH {
                assert_eq!(
                    codes.as_deref().and_then(|c| c.first()).map(String::as_str),
                    Some("E0002"),
                    "{what}"
                );
            }
        }
    }
}
