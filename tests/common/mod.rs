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

/// Smooth, sign-changing, bf16-exact values of varied magnitude: element `k` of a synthetic tensor.
pub fn value(k: usize) -> f32 {
    let x = ((k * 7919) % 1000) as f32 / 250.0 - 2.0;
    f32::from_bits((x * (1.0 + (k % 5) as f32)).to_bits() & 0xFFFF_0000)
}

/// f32 values as bf16 bytes (truncating; exact for values from [`value`]).
pub fn bf16(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
        .collect()
}

/// Golden-file check: with `bless`, write `got` to `path` and return `None`; otherwise `None` when
/// the file holds `got`, else a message naming the first differing line.
pub fn golden(path: &std::path::Path, got: &str, bless: bool) -> Option<String> {
    if bless {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).unwrap();
        }
        std::fs::write(path, got).unwrap();
        return None;
    }
    let want = std::fs::read_to_string(path).unwrap_or_default();
    if want == got {
        return None;
    }
    let line = want
        .lines()
        .zip(got.lines())
        .position(|(a, b)| a != b)
        .unwrap_or(want.lines().count().min(got.lines().count()));
    Some(format!(
        "{}: differs from line {}:\n- {}\n+ {}",
        path.display(),
        line + 1,
        want.lines().nth(line).unwrap_or("<end>"),
        got.lines().nth(line).unwrap_or("<end>")
    ))
}
