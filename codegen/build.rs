//! A fingerprint of the code generator's sources (FNV-1a over `src/**/*.rs`, in path order), part of
//! the kernel cache's keys: a change to a backend that leaves the kernel IR as it was must not be
//! served PTX or cubins that an older backend made.

use std::path::{Path, PathBuf};

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in rd.flatten() {
        let p = entry.path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn main() {
    let src = Path::new("src");
    println!("cargo:rerun-if-changed=src");
    let mut all = Vec::new();
    files(src, &mut all);
    all.sort();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in &all {
        let name = p.to_string_lossy();
        let body = std::fs::read(p).unwrap_or_default();
        for b in name
            .as_bytes()
            .iter()
            .chain([0u8].iter())
            .chain(body.iter())
        {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    println!("cargo:rustc-env=MOEFORGE_CODEGEN_FINGERPRINT={h:016x}");
}
