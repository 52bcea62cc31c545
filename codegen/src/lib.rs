//! moeforge's backends over the verified IR.
//!
//! A verified, bound recipe ([`ModuleInfo`], which only the verifier can create) is lowered by
//! [`plan::plan`] to a kernel-IR [`kir::Program`]: loop nests over the layouts' index maps with the
//! quantization arithmetic spelled out. Three backends consume it: [`interp`] (the plain-Rust oracle),
//! [`host`] (Cranelift JIT, multi-threaded) and [`ptx`] (PTX text for sm_90a and sm_100a).

pub mod addr;
pub mod bindings;
pub mod gemm;
pub mod host;
pub mod interp;
pub mod kir;
pub mod moe;
pub mod plan;
pub mod ptx;
pub mod quant;
pub mod range;
pub mod reference;
pub mod visit;

pub use moeforge_dsl::ir::Group;
pub use moeforge_dsl::ModuleInfo;

/// A fingerprint of this crate's sources (see `build.rs`): the kernel cache keys include it, so a
/// backend change that leaves a kernel's IR unchanged still gets that kernel compiled again.
pub const FINGERPRINT: &str = env!("MOEFORGE_CODEGEN_FINGERPRINT");

/// Errors of the backends.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The module has no binding; code is generated for a bound shape.
    #[error("code generation needs a binding of every dimension (`--bind`)")]
    Unbound,
    /// A param's definition has a form no backend supports yet.
    #[error("param `{param}`: {what} is not supported by the code generator")]
    Unsupported {
        /// The param.
        param: String,
        /// What is not supported.
        what: String,
    },
    /// An input buffer is missing or has the wrong size.
    #[error("buffer `{name}`: expected {expected} bytes, got {got}")]
    BufferSize {
        /// Buffer name.
        name: String,
        /// Expected bytes.
        expected: usize,
        /// Actual bytes.
        got: usize,
    },
    /// Cranelift failed to compile generated code.
    #[error("cranelift: {0}")]
    Cranelift(String),
    /// A collective operation failed.
    #[error("collective all-reduce over `{group}` failed: {why}")]
    Collective {
        /// Group.
        group: String,
        /// Why.
        why: String,
    },
    /// A shard's cut would split a quantization block between ranks, so its scale could not be
    /// the unsharded one (see [`plan::Sharding`]).
    #[error("input `{input}` cannot be split so: each rank's run of {run} along dimension {dim} is not a multiple of the {block}-element quantization block, so a block would be cut between ranks (choose a split whose slice is a multiple of {block})")]
    CutBlock {
        /// The input.
        input: String,
        /// The dimension cut.
        dim: usize,
        /// The length of one contiguous run of a rank's slice along it.
        run: i64,
        /// The block's extent along it.
        block: i64,
    },
    /// A sharding the planner cannot make topology-invariant (see [`plan::Sharding`]).
    #[error("input `{input}` cannot be split so: {why}")]
    Sharding {
        /// The input.
        input: String,
        /// Why.
        why: String,
    },
    /// A kernel binding generated for a target its `on` list does not name, or PTX asked for a
    /// target that is not a GPU.
    #[error("{0}")]
    Target(String),
    /// An invariant of the code generator was broken (a bug).
    #[error("internal error: {0}")]
    Internal(&'static str),
    /// A typed PTX instruction was given operands its form does not allow (an `N` of `wgmma` that is
    /// not a multiple of 8, a register of the wrong class, ...): a generator bug, caught before any
    /// PTX text is printed.
    #[error("`{inst}`: {why}")]
    Inst {
        /// The instruction (its PTX opcode).
        inst: &'static str,
        /// What is wrong with it.
        why: String,
    },
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The collective hook a pack program calls: MAX all-reduce of f32 values over a process group.
/// `moeforge_runtime::collective` implements it for one process, for threads in one process and
/// for NCCL ranks.
pub trait Collective: Sync {
    /// Replace each value by its maximum over the group's ranks.
    fn all_reduce_max(&self, group: Group, data: &mut [f32]) -> Result<()>;
}

/// One process that is the whole world: every group has one rank, so every all-reduce is the
/// identity (the right answer, not a skipped step).
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleProcess;

impl Collective for SingleProcess {
    fn all_reduce_max(&self, _group: Group, _data: &mut [f32]) -> Result<()> {
        Ok(())
    }
}

/// All-reduce an f32 buffer stored as little-endian bytes.
pub(crate) fn all_reduce_bytes(
    coll: &dyn Collective,
    group: Group,
    bufs: &mut [Vec<u8>],
    buf: kir::BufId,
) -> Result<()> {
    let data = bufs
        .get_mut(buf.0 as usize)
        .ok_or(Error::Internal("buffer"))?;
    let mut v: Vec<f32> = data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    coll.all_reduce_max(group, &mut v)?;
    for (c, x) in data.chunks_exact_mut(4).zip(v) {
        c.copy_from_slice(&x.to_le_bytes());
    }
    Ok(())
}

/// Allocate the byte buffers of a program: inputs are filled by `fill` (which must return exactly the
/// buffer's size), others zeroed.
pub fn alloc_buffers(
    prog: &kir::Program,
    fill: &mut dyn FnMut(&str) -> Option<Vec<u8>>,
) -> Result<Vec<Vec<u8>>> {
    let mut out = Vec::with_capacity(prog.bufs.len());
    for b in &prog.bufs {
        let bytes = b.len * b.elem.size();
        match &b.role {
            kir::BufRole::Input(name) => {
                let data = fill(name).ok_or_else(|| Error::BufferSize {
                    name: name.clone(),
                    expected: bytes,
                    got: 0,
                })?;
                if data.len() != bytes {
                    return Err(Error::BufferSize {
                        name: name.clone(),
                        expected: bytes,
                        got: data.len(),
                    });
                }
                out.push(data);
            }
            _ => out.push(vec![0u8; bytes]),
        }
    }
    Ok(out)
}
