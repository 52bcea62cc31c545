//! Helpers shared by the integration tests: running the CLI, and the seed of randomized tests.

#![allow(dead_code, clippy::unwrap_used)]

use std::process::Command;

/// Run `moeforge` from the repository root: exit code, stdout, stderr.
pub fn run(args: &[&str]) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_moeforge"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// `MOEFORGE_SEED` (replay), else a fresh one from the clock; tests print it on failure.
pub fn seed() -> u64 {
    std::env::var("MOEFORGE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(7)
        })
}
