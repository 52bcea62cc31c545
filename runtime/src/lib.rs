//! moeforge's GPU runtime: device, JIT cache, parameter store, collectives and the EPLB executor.
//!
//! Not built yet (issue [3/5]); the crate exists so that the workspace has its final shape.

/// Errors of the runtime.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No GPU driver could be loaded on this machine.
    #[error("no CUDA driver is available: {0}")]
    NoDriver(String),
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Whether a CUDA driver library can be found on this machine (by the usual names).
pub fn driver_present() -> bool {
    [
        "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        "/usr/lib64/libcuda.so.1",
        "/usr/lib/wsl/lib/libcuda.so.1",
    ]
    .iter()
    .any(|p| std::path::Path::new(p).exists())
}
