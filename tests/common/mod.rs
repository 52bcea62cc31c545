//! Helpers shared by the integration tests: running the CLI, and the seed of randomized tests.

#![allow(dead_code, clippy::unwrap_used, clippy::print_stderr)]

use std::path::{Path, PathBuf};

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

pub fn cache_tool(var: &str, rel: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(var) {
        return Some(PathBuf::from(p));
    }
    let cache = std::env::var_os("MOEFORGE_TOOLS_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME").map(|x| PathBuf::from(x).join("moeforge/tools"))
        })
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/moeforge/tools"))
        })?;
    let p = cache.join(rel);
    p.exists().then_some(p)
}

/// A tool, or `None` after saying that the test skipped (a failure under `MOEFORGE_REQUIRE_PTXAS`).
pub fn tool(var: &str, rel: &str, script: &str, what: &str) -> Option<PathBuf> {
    let t = cache_tool(var, rel);
    if t.is_none() {
        assert!(
            std::env::var_os("MOEFORGE_REQUIRE_PTXAS").is_none(),
            "MOEFORGE_REQUIRE_PTXAS is set but {var} is not and the cache holds none (run {script})"
        );
        eprintln!("SKIPPED: {what}: no {rel} found; run scripts/test (or {script})");
    }
    t
}

/// ptxas 13.0 (`MOEFORGE_PTXAS`, else the cache `scripts/ptxas` fills), or `None` after saying
/// that `what` skipped.
pub fn ptxas(what: &str) -> Option<PathBuf> {
    tool(
        "MOEFORGE_PTXAS",
        "cuda-nvcc-13.0.88/ptxas",
        "scripts/ptxas",
        what,
    )
}

/// cuobjdump 13.5 (`MOEFORGE_CUOBJDUMP`, else the cache `scripts/sass` fills), or `None` after
/// saying that `what` skipped.
pub fn cuobjdump(what: &str) -> Option<PathBuf> {
    tool(
        "MOEFORGE_CUOBJDUMP",
        "cuda-sass-13.5.37/cuobjdump",
        "scripts/sass",
        what,
    )
}

/// What in a `ptxas -v` report of a module with `entries` entries is an error: the serialized
/// wgmma warning, any C75xx performance diagnostic, spills or a stack frame in any entry.
pub fn problems(report: &str, entries: usize) -> Vec<&'static str> {
    let mut p = Vec::new();
    if report.contains("wgmma.mma_async instructions are serialized") {
        p.push("wgmma.mma_async instructions are serialized");
    }
    if report.contains("(C75") || report.contains("Potential Performance Loss") {
        p.push("a C75xx diagnostic");
    }
    if report
        .matches("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")
        .count()
        != entries
    {
        p.push("spills or a stack frame (or an entry without a report)");
    }
    if report.matches("Used ").count() != entries {
        p.push("an entry without a register report");
    }
    p
}

/// `ptxas -arch=sm_90a -v` of `ptx` into `cubin`; panics on rejection. Returns the report.
pub fn assemble(ptxas: &Path, ptx: &Path, cubin: &Path) -> String {
    let out = Command::new(ptxas)
        .args(["-arch=sm_90a", "-v"])
        .arg(ptx)
        .arg("-o")
        .arg(cubin)
        .output()
        .unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "ptxas rejected {}:\n{report}",
        ptx.display()
    );
    assert!(std::fs::metadata(cubin).unwrap().len() > 0);
    report
}

/// A safetensors tensor as the tests build and read it: dtype, shape, bytes.
pub type Tensor = (safetensors::tensor::Dtype, Vec<usize>, Vec<u8>);

/// Write `tensors` (name -> tensor) as a safetensors file, with `meta` as its metadata.
pub fn write_tensors(
    path: &Path,
    tensors: &std::collections::BTreeMap<String, Tensor>,
    meta: Option<std::collections::HashMap<String, String>>,
) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (d, s, b))| {
            let view = safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap();
            (n.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, meta, path).unwrap();
}

/// Read a safetensors file: its tensors (name -> tensor) and its metadata.
pub fn read_tensors(
    path: &Path,
) -> (
    std::collections::BTreeMap<String, Tensor>,
    std::collections::HashMap<String, String>,
) {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect();
    (t, meta.metadata().clone().unwrap_or_default())
}

/// Little-endian f32 bytes as values.
pub fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// `moeforge pack RECIPE --input INPUT --output OUTPUT`, which must succeed.
pub fn pack(recipe: &str, input: &Path, output: &Path) {
    let (code, _, err) = run(&[
        "pack",
        recipe,
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "pack {recipe}: {err}");
}

/// `nvfp4_cutedsl`'s source without its `on sm_90a` kernel bindings (`moe_gemm1_sm90`,
/// `moe_gemm2_sm90`): only the Blackwell ones, which read the MMA scale view and the alphas.
pub fn nvfp4_without_sm90_bindings() -> String {
    let r = moeforge::kernels::find("nvfp4_cutedsl").unwrap();
    let src: String = r
        .source
        .lines()
        .filter(|l| !l.contains("_sm90("))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_ne!(src, r.source);
    src
}

/// `int4_g128`'s source as a recipe `int4_g8` that groups INT4 by 8 along K: packs, but no GPU GEMM
/// takes groups shorter than 16 (the W4A16 kernel's k16 step).
pub fn int4_g8_source() -> String {
    moeforge::kernels::find("int4_g128")
        .unwrap()
        .source
        .replace("recipe int4_g128", "recipe int4_g8")
        .replace("group = 128", "group = 8")
        .replace("/128]", "/8]")
}
