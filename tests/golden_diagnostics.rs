//! Golden diagnostics: every `tests/golden/diagnostics/*.recipe` must fail `check` with exactly the
//! rendered errors in the `.stderr` file beside it. A first line `# bind: E=..,H=..` binds the recipe.
//! `BLESS=1 cargo test --test golden_diagnostics` rewrites the expected files.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

fn bind_line(src: &str) -> Option<String> {
    src.lines()
        .next()
        .and_then(|l| l.strip_prefix("# bind:"))
        .map(|b| b.trim().to_string())
}

#[test]
fn golden_diagnostics() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/diagnostics");
    let bless = std::env::var_os("BLESS").is_some();
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "recipe"))
        .collect();
    entries.sort();
    assert!(
        entries.len() >= 12,
        "expected at least 12 golden diagnostics, found {}",
        entries.len()
    );
    let mut failures = Vec::new();
    let mut codes = std::collections::BTreeSet::new();
    for path in &entries {
        let src = std::fs::read_to_string(path).unwrap();
        let name = format!(
            "tests/golden/diagnostics/{}",
            path.file_name().unwrap().to_string_lossy()
        );
        let got = match moeforge::check_source(&src, &name, bind_line(&src).as_deref()) {
            Ok(_) => format!("unexpectedly verified: {name}\n"),
            Err(moeforge::Error::Recipe { rendered, .. }) => rendered,
            Err(other) => format!("unexpected error kind: {other}\n"),
        };
        if let Some(code) = got.lines().next().and_then(|l| l.split(['[', ']']).nth(1)) {
            codes.insert(code.to_string());
        }
        let expected_path = path.with_extension("stderr");
        if bless {
            std::fs::write(&expected_path, &got).unwrap();
            continue;
        }
        let expected = std::fs::read_to_string(&expected_path).unwrap_or_default();
        if expected != got {
            failures.push(format!(
                "--- {}\n+++ actual\n{}",
                expected_path.display(),
                diff(&expected, &got)
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "golden mismatches (BLESS=1 to update):\n{}",
        failures.join("\n")
    );
    assert!(
        codes.len() >= 12,
        "expected at least 12 distinct error codes, got {codes:?}"
    );
}

fn diff(a: &str, b: &str) -> String {
    let (la, lb): (Vec<&str>, Vec<&str>) = (a.lines().collect(), b.lines().collect());
    let mut out = String::new();
    for k in 0..la.len().max(lb.len()) {
        match (la.get(k), lb.get(k)) {
            (Some(x), Some(y)) if x == y => out.push_str(&format!("  {x}\n")),
            (x, y) => {
                if let Some(x) = x {
                    out.push_str(&format!("- {x}\n"));
                }
                if let Some(y) = y {
                    out.push_str(&format!("+ {y}\n"));
                }
            }
        }
    }
    out
}
