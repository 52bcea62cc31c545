//! moeforge: a compiler and runtime for quantized Mixture-of-Experts kernels.
//!
//! This facade ties the crates together for the `moeforge` command: the recipe language and verifier
//! ([`dsl`]), the backends ([`codegen`]), the GPU runtime ([`runtime`]) and the standard recipes
//! ([`kernels`]).

pub use moeforge_codegen as codegen;
pub use moeforge_dsl as dsl;
pub use moeforge_kernels as kernels;
pub use moeforge_runtime as runtime;

pub mod demo;
pub mod report;

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

/// Check a recipe source: parse, lower, bind and verify.
pub fn check_source(src: &str, file: &str, bind: Option<&str>) -> Result<dsl::ModuleInfo> {
    let bind = match bind {
        Some(b) => Some(dsl::verify::parse_binding(b).map_err(|d| recipe_error(&[d], file, src))?),
        None => None,
    };
    dsl::check(src, bind.as_deref()).map_err(|d| recipe_error(&d, file, src))
}
