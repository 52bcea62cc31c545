//! moeforge: a compiler and runtime for quantized Mixture-of-Experts kernels.
//!
//! This facade ties the crates together for the `moeforge` command: the recipe language and verifier
//! ([`dsl`]), the backends ([`codegen`]), the GPU runtime ([`runtime`]) and the standard recipes
//! ([`kernels`]). [`Settings`] are what the environment sets, read once by the command and passed
//! down: no library reads the environment.

pub use moeforge_codegen as codegen;
pub use moeforge_dsl as dsl;
pub use moeforge_kernels as kernels;
pub use moeforge_runtime as runtime;

pub mod act_quant_check;
pub mod bench;
pub mod bench_eplb;
pub mod bench_gemm;
pub mod bench_gemm_ws;
pub mod bench_layouts;
pub mod bench_moe;
pub mod checkpoint;
pub mod demo;
pub mod demo_eplb;
pub mod demo_moe;
pub mod dequant;
pub mod eplb_apply;
pub mod eplb_nccl;
pub mod gemm_access;
pub mod gemm_check;
pub mod gemm_variants;
pub mod gemm_warmup;
pub mod gemm_ws_check;
pub mod gpu;
pub mod gpu_shards;
pub mod layout_gen;
mod moe_eplb_check;
pub mod moe_gpu;
pub mod moe_gpu_check;
pub mod moe_gpu_layer;
mod moe_gpu_w4;
mod moe_graph_check;
pub mod moe_host;
pub mod moe_kernels_check;
pub mod moe_run;
pub mod pack;
pub mod permute_check;
pub mod plot;
pub mod prequant;
pub mod report;
mod selftest_util;
pub mod settings;

pub use settings::Settings;

/// Errors of the `moeforge` command.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The recipe has errors; already rendered with source snippets.
    #[error("{rendered}")]
    Recipe {
        /// Rendered diagnostics.
        rendered: String,
        /// How many.
        count: usize,
    },
    /// A command-line usage error.
    #[error("{0}")]
    Usage(String),
    /// An environment variable has a value that means nothing (see [`settings`]).
    #[error("environment: {0}")]
    Setting(String),
    /// A checkpoint is missing a tensor, has a wrong shape or dtype, or is not a safetensors file.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// The GPU runtime failed (or there is no GPU).
    #[error(transparent)]
    Runtime(#[from] runtime::Error),
    /// Code generation failed.
    #[error(transparent)]
    Codegen(#[from] codegen::Error),
    /// An EPLB placement cannot be applied to a packed checkpoint (`moeforge eplb apply`).
    #[error(transparent)]
    Placement(#[from] eplb_apply::ApplyError),
    /// The MoE layer cannot run (`moeforge moe run`): bad inputs, a layer or placement that does
    /// not fit, the GPU path asked for.
    #[error(transparent)]
    Moe(#[from] moe_host::MoeError),
    /// A checkpoint cannot be split over the ranks asked for (`pack --moe-tp`, `--ep`): a size
    /// the rank count does not divide, a rank shape the recipe does not admit.
    #[error("topology: {0}")]
    Topology(String),
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Render diagnostics against a source into an [`Error::Recipe`].
pub fn recipe_error(diags: &[dsl::Diagnostic], file: &str, src: &str) -> Error {
    Error::Recipe {
        rendered: dsl::diag::render_all(diags, file, src),
        count: diags.len(),
    }
}

/// Parse, lower, bind and verify a recipe source (no code is planned).
pub fn verify_source(src: &str, file: &str, bind: Option<&str>) -> Result<dsl::ModuleInfo> {
    let bind = match bind {
        Some(b) => Some(dsl::verify::parse_binding(b).map_err(|d| recipe_error(&[d], file, src))?),
        None => None,
    };
    dsl::check(src, bind.as_deref()).map_err(|d| recipe_error(&d, file, src))
}

/// Check a recipe source: parse, lower, bind and verify, then serve or refuse: the pack program is
/// planned (every optional input present) at the binding, or at the smallest admissible one, so that
/// what `compile` and `pack` would refuse is refused here, with the param's span (E0601).
pub fn check_source(src: &str, file: &str, bind: Option<&str>) -> Result<dsl::ModuleInfo> {
    let info = verify_source(src, file, bind)?;
    let witness;
    let at = if info.binding().is_some() {
        &info
    } else {
        let dims: Vec<(String, i64)> = info
            .module()
            .dims
            .iter()
            .map(|d| (d.name.clone(), d.min))
            .collect();
        match dsl::check(src, Some(&dims)) {
            Ok(w) => {
                witness = w;
                &witness
            }
            // No admissible binding verifies: nothing to plan (verification said why, or will).
            Err(_) => return Ok(info),
        }
    };
    plan_or_refuse(at, &|_: &str| true, file, src)?;
    Ok(info)
}

/// Plan a verified module's pack program; a param the planner cannot generate becomes E0601 on that
/// param's statement, rendered against the source.
pub fn plan_or_refuse(
    info: &dsl::ModuleInfo,
    present: &dyn codegen::plan::Presence,
    file: &str,
    src: &str,
) -> Result<codegen::kir::Program> {
    codegen::plan::plan(info, present).map_err(|e| refusal(info, e, file, src))
}

/// A planner error as the user sees it: E0601 with the param's span where a param's definition has
/// no generated form, the error itself otherwise.
pub fn refusal(info: &dsl::ModuleInfo, e: codegen::Error, file: &str, src: &str) -> Error {
    let codegen::Error::Unsupported { param, what } = e else {
        return e.into();
    };
    let span = info
        .module()
        .tensors
        .iter()
        .rev()
        .find(|t| t.name == param)
        .map(|t| t.span);
    let mut d = dsl::Diagnostic::error(
        "E0601",
        format!("param `{param}` cannot be generated: {what}"),
    );
    if let Some(sp) = span {
        d = d.with_label(sp, "the code generator has no path for this definition");
    }
    let d = d.with_note(
        "help: every param is packed by generated code; restate it with operations the generator serves (see the README's tensor operations)",
    );
    recipe_error(&[d], file, src)
}

/// Verify a bound recipe and lower it to its pack program (params that need an optional input
/// `present` says is missing are left out), planning it once.
pub fn pack_program(
    src: &str,
    file: &str,
    bind: &str,
    present: &dyn Fn(&str) -> bool,
) -> Result<codegen::kir::Program> {
    let info = verify_source(src, file, Some(bind))?;
    plan_or_refuse(&info, &present, file, src)
}

/// The largest cache manifest read (bytes).
pub const MANIFEST_LIMIT: u64 = 16 << 20;
/// The largest `--index-map` printed (elements).
pub const INDEX_MAP_LIMIT: u64 = 1 << 28;

/// Read a text file of at most `limit` bytes (recipes, manifests, JSON indexes): a larger file, or a
/// device that never ends (`/dev/zero`), is refused with the limit named instead of read whole.
pub fn read_capped(path: &std::path::Path, limit: u64) -> Result<String> {
    use std::io::Read as _;
    let io = |e: std::io::Error| Error::Io {
        path: path.display().to_string(),
        source: e,
    };
    let f = std::fs::File::open(path).map_err(io)?;
    let mut buf = Vec::new();
    f.take(limit + 1).read_to_end(&mut buf).map_err(io)?;
    if buf.len() as u64 > limit {
        return Err(Error::Usage(format!(
            "{}: larger than the {} KiB read limit for this kind of file",
            path.display(),
            limit >> 10
        )));
    }
    String::from_utf8(buf).map_err(|_| Error::Usage(format!("{}: not UTF-8 text", path.display())))
}

/// Refuse to write to `out`: when it exists and is not a regular file (a device such as `/dev/full`,
/// a directory), or when it is one of `inputs` (by path or by inode: a link to an input counts).
pub fn check_output(out: &std::path::Path, inputs: &[std::path::PathBuf]) -> Result<()> {
    let Ok(meta) = std::fs::metadata(out) else {
        return Ok(());
    };
    if !meta.is_file() {
        return Err(Error::Usage(format!(
            "{}: exists and is not a regular file; refusing to replace it",
            out.display()
        )));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt as _;
        for i in inputs {
            if let Ok(m) = std::fs::metadata(i) {
                if m.dev() == meta.dev() && m.ino() == meta.ino() {
                    return Err(Error::Usage(format!(
                        "{}: is the input {} itself; write the output elsewhere",
                        out.display(),
                        i.display()
                    )));
                }
            }
        }
    }
    let canon = std::fs::canonicalize(out).ok();
    for i in inputs {
        if canon.is_some() && std::fs::canonicalize(i).ok() == canon {
            return Err(Error::Usage(format!(
                "{}: is the input {} itself; write the output elsewhere",
                out.display(),
                i.display()
            )));
        }
    }
    Ok(())
}

/// Write a file atomically: a temporary file in the same folder (created with the process's umask
/// applied, as any new file), renamed over the target only when everything was written. A target
/// that exists and is not a regular file is refused.
pub fn write_atomic(path: &std::path::Path, bytes: &[u8]) -> Result<()> {
    check_output(path, &[])?;
    let tmp = stage(path, bytes)?;
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::Io {
            path: path.display().to_string(),
            source: e,
        });
    }
    Ok(())
}

/// Write several files all or none: each is staged as [`write_atomic`] stages one, and they are
/// renamed into place only when every one was written; on any error, every staged file and every
/// target already renamed is removed, so no output file remains. Targets are checked as
/// [`write_atomic`] checks one before anything is written.
pub fn write_all_atomic(files: &[(std::path::PathBuf, Vec<u8>)]) -> Result<()> {
    for (p, _) in files {
        check_output(p, &[])?;
    }
    let mut staged: Vec<std::path::PathBuf> = Vec::new();
    for (p, b) in files {
        match stage(p, b) {
            Ok(t) => staged.push(t),
            Err(e) => {
                for t in &staged {
                    let _ = std::fs::remove_file(t);
                }
                return Err(e);
            }
        }
    }
    for (k, (tmp, (p, _))) in staged.iter().zip(files).enumerate() {
        if let Err(e) = std::fs::rename(tmp, p) {
            for (q, _) in &files[..k] {
                let _ = std::fs::remove_file(q);
            }
            for t in &staged[k..] {
                let _ = std::fs::remove_file(t);
            }
            return Err(Error::Io {
                path: p.display().to_string(),
                source: e,
            });
        }
    }
    Ok(())
}

/// Write `bytes` to a fresh temporary file beside `path` and flush it to disk; returns its path
/// (removed again on failure).
fn stage(path: &std::path::Path, bytes: &[u8]) -> Result<std::path::PathBuf> {
    use std::io::Write as _;
    let io = |e: std::io::Error| Error::Io {
        path: path.display().to_string(),
        source: e,
    };
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_else(|| "out".into());
    // A fresh name beside the target; `create_new` never follows or reuses an existing file.
    let mut k = 0u32;
    let (tmp, mut f) = loop {
        let t = dir.join(format!(".{name}.moeforge-{}-{k}.tmp", std::process::id()));
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&t)
        {
            Ok(f) => break (t, f),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && k < 1000 => k += 1,
            Err(e) => return Err(io(e)),
        }
    };
    if let Err(e) = f.write_all(bytes).and_then(|_| f.sync_all()) {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(e));
    }
    Ok(tmp)
}
