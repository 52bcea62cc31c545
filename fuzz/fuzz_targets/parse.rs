//! Any input gives a verified module or diagnostics with in-range spans, never a panic, a stack
//! overflow or a hang: parse, lower and verify (`moeforge_dsl::check`), unbound and bound.
//!
//! Deep and long inputs: byte-level mutation seldom builds 10,000 nested parentheses, so an input
//! holding the byte `\x01` is also run *expanded*: `a\x01b\x01c` is `a`, then `b` repeated `n`
//! times, then `c`; `a\x01b\x01c\x01d\x01e` repeats `b` and `d` `n` times each (opening and closing
//! brackets). `n` is one past a limit or far beyond it, picked by the length of `b`.
//! Run with `scripts/fuzz` (or `cargo +nightly fuzz run parse`) from the repository root.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moeforge_dsl::limits::{MAX_CHAIN, MAX_DEPTH, MAX_SOURCE_BYTES};

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
                    assert!(span.start <= span.end && span.end <= src.len());
                }
                let _ = d.render("fuzz.recipe", src);
            }
        }
    }
}

/// The expanded form of an input with `\x01` markers, at most a little over the source limit.
fn expand(src: &str) -> Option<String> {
    let parts: Vec<&str> = src.split('\u{1}').collect();
    let (fixed, repeated): (Vec<&str>, Vec<&str>) = match parts.as_slice() {
        [a, b, c] => (vec![a, c], vec![b]),
        [a, b, c, d, e] => (vec![a, c, e], vec![b, d]),
        _ => return None,
    };
    let unit: usize = repeated.iter().map(|r| r.len()).sum();
    if unit == 0 {
        return None;
    }
    let n = [MAX_DEPTH + 1, MAX_CHAIN + 1, 20_000][repeated[0].len() % 3];
    let n = n.min((MAX_SOURCE_BYTES + 64) / unit).max(1);
    let mut out = String::with_capacity(fixed.iter().map(|f| f.len()).sum::<usize>() + n * unit);
    for (k, f) in fixed.iter().enumerate() {
        out.push_str(f);
        if let Some(r) = repeated.get(k) {
            for _ in 0..n {
                out.push_str(r);
            }
        }
    }
    Some(out)
}

fuzz_target!(|data: &[u8]| {
    let Ok(src) = std::str::from_utf8(data) else {
        return;
    };
    run(src);
    if let Some(big) = expand(src) {
        run(&big);
    }
});
