//! moeforge's backends over the verified IR: PTX for Hopper (sm_90a) and Blackwell (sm_100a), and host
//! code through Cranelift.
//!
//! Not built yet (issue [2/5]). What exists is the contract every backend will follow: it accepts only
//! a [`ModuleInfo`], which only the verifier can create, so nothing unverified reaches a GPU.

use moeforge_dsl::ModuleInfo;

/// Errors of the backends.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The backend is not implemented yet.
    #[error("the `{0}` backend is not implemented yet")]
    NotImplemented(&'static str),
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Backend options shared by every target.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Target name (`sm_90a`, `sm_100a`, `host`).
    pub target: String,
}

/// Compile a verified module for a target.
pub fn compile(_module: &ModuleInfo, options: &Options) -> Result<String> {
    let t: &'static str = match options.target.as_str() {
        "sm_90a" => "sm_90a",
        "sm_100a" => "sm_100a",
        _ => "host",
    };
    Err(Error::NotImplemented(t))
}
