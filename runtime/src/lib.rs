//! moeforge's GPU runtime: the CUDA device (cudarc, loaded dynamically), the JIT from PTX to cubin
//! through the driver's linker, a content-addressed kernel cache, GPU execution of pack programs, and
//! collectives (NCCL, loaded by [`nccl`] itself).
//!
//! Every entry point returns [`Error::NoDriver`] on a machine without a loadable CUDA driver: cudarc
//! panics when libcuda is missing, so its presence is checked before any driver call. Likewise
//! [`Error::NoNccl`] where no NCCL library loads.
//!
//! The runtime reads no environment: its [`Settings`] are built by the caller (the `moeforge`
//! command from its environment) and passed in.

pub mod act_quant;
pub mod cache;
pub mod collective;
pub mod copy_batch;
pub mod copy_kernel;
pub mod device;
pub mod device_storage;
pub mod eplb;
pub mod eplb_state;
pub mod gemm;
pub mod gemm_tune;
pub mod gemm_ws;
pub mod gpu_pack;
pub mod jit;
pub mod launch;
pub mod moe_kernels;
pub mod moves;
pub mod nccl;
pub mod permute;
pub mod slot_moves;
pub mod staged;
pub mod store;
pub mod tma;

pub use cache::Cache;
pub use device::Device;
pub use gpu_pack::LaunchOptions;
pub use jit::JitOptions;

/// The runtime's settings: how kernels are tuned and launched, how PTX becomes cubins, and where
/// the kernel cache keeps its files. The default: no tuning, the driver's JIT, a cache in memory only.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Settings {
    /// Kernel tuning and launch shape.
    pub launch: LaunchOptions,
    /// The PTX -> cubin compiler.
    pub jit: JitOptions,
    /// The kernel cache's folder (`None`: in memory only); see [`Cache::new`].
    pub cache_dir: Option<std::path::PathBuf>,
    /// The NCCL library to try first (`None`: only NCCL's sonames); see [`nccl::Nccl::candidates`].
    pub nccl_path: Option<std::path::PathBuf>,
}

/// Errors of the runtime.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No CUDA driver library could be loaded, or no device is present.
    #[error("no CUDA device: {0}")]
    NoDriver(String),
    /// A parameter store was given part of a recipe's move set: rearranging it would leave the
    /// missing params (and any value derived from them) on the old placement.
    #[error("a parameter store needs the recipe's whole move set; missing: {}", .missing.join(", "))]
    IncompleteMoveSet {
        /// The registered params not given.
        missing: Vec<String>,
    },
    /// A collective over a process group failed (a rank missing, mismatched messages, NCCL).
    #[error("collective over `{group}` failed: {why}")]
    Collective {
        /// The group.
        group: &'static str,
        /// Why.
        why: String,
    },
    /// A program needs a collective over a group this process has no implementation for (a
    /// multi-rank pack on a target without it): an error, never a skipped step.
    #[error("this program reduces over `{group}`, which has {size} ranks, but no collective for it was given")]
    MissingCollective {
        /// The group.
        group: &'static str,
        /// Its ranks.
        size: usize,
    },
    /// A placement (EPLB `phy2log`) or a move plan is not valid for the layer; nothing was changed.
    #[error("bad placement: {0}")]
    Placement(String),
    /// A rearrangement failed part-way: the layer's params hold a mix of placements and it must not
    /// serve until it is restored (re-placed from the checkpoint).
    #[error("layer unusable: {0}")]
    Unusable(String),
    /// No NCCL library could be loaded: each candidate tried, in order, with why it failed (not
    /// found, or a needed entry point missing).
    #[error("no usable NCCL library: {}", .tried.join("; "))]
    NoNccl {
        /// `path (why)` per candidate.
        tried: Vec<String>,
    },
    /// An NCCL call failed (its result's name and NCCL's message), or was refused before the call.
    #[error("NCCL {call} failed: {detail}")]
    Nccl {
        /// The call.
        call: &'static str,
        /// The result code's name and NCCL's message.
        detail: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver error in {call}: {detail}")]
    Driver {
        /// The call.
        call: &'static str,
        /// The driver's message.
        detail: String,
    },
    /// The PTX compiler (the driver's JIT linker or ptxas) rejected the PTX; the log says why.
    #[error("JIT of `{name}` failed ({code}):\n{log}")]
    Jit {
        /// Module name.
        name: String,
        /// CUresult.
        code: String,
        /// The linker's error and info log.
        log: String,
    },
    /// The PTX compiler asked for ([`JitOptions`]) is not usable.
    #[error("kernel compiler: {0}")]
    Compiler(String),
    /// Reading or writing the cache failed.
    #[error("kernel cache at {path}: {source}")]
    Cache {
        /// Path.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// Code generation failed.
    #[error(transparent)]
    Codegen(#[from] moeforge_codegen::Error),
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Turns a failed driver call's error into [`Error::Driver`] naming `call`: `.map_err(drv("cuMemAlloc"))`.
pub fn drv<E: std::fmt::Debug>(call: &'static str) -> impl Fn(E) -> Error {
    move |e| Error::Driver {
        call,
        detail: format!("{e:?}"),
    }
}
