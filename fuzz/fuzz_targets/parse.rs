//! Any input gives a verified module or diagnostics with in-range spans, never a panic.
//! Run with `cargo +nightly fuzz run parse` from the repository root.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(src) = std::str::from_utf8(data) else { return };
    let bind = vec![("E".to_string(), 2), ("H".to_string(), 128), ("I".to_string(), 128)];
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
});
