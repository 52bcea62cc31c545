//! The PTX backend: every kernel of a [`Program`](crate::kir::Program) as PTX for Hopper (`sm_90a`)
//! or Blackwell (`sm_100a`), `.version 8.7`, built through a typed instruction builder (virtual
//! registers by type, typed operands and opcodes; ptxas allocates registers). Output is
//! deterministic.
//!
//! The layers, one file each:
//! * [`isa`]: the typed PTX layer: registers, operands, type suffixes, opcodes, the instruction
//!   enum [`Inst`] (its `Display` is the PTX text) and the [`Builder`];
//! * [`asyncops`]: Hopper's asynchronous and tensor-core instructions ([`AsyncOp`]: `.shared`
//!   declarations, mbarriers, TMA, `wgmma`, `setmaxnreg`, `elect.sync`, named barriers), carried
//!   by [`Inst::Async`];
//! * [`entry`]: kernel entries' ABI: parameters (global pointers, scalars, TMA descriptors), dynamic
//!   shared memory, register cap and cluster shape, and the `.entry` header they print;
//! * `lower`: the kernel IR lowered through both ([`compile`], [`kernel_ptx`]).
//!
//! Each kernel takes one `.u64` global pointer per program buffer, in program order, and runs its
//! work items in a grid-stride loop (`item = ctaid.x * ntid.x + tid.x`, step `nctaid.x * ntid.x`).
//! All float arithmetic is IEEE round-to-nearest without flush-to-zero (`add.rn`, `mul.rn`,
//! `div.rn`), matching the host backend and the interpreter bit for bit. E2M1 rounding is the IR's
//! own arithmetic, so Hopper (which lacks `cvt.rn.satfinite.e2m1x2.f32`) computes the same codes.

pub mod asyncops;
pub mod entry;
pub mod isa;
mod lower;

/// The one target enum (`sm_90a`, `sm_100a`, `host`), shared with the recipe language's `on` lists.
pub use moeforge_dsl::ir::Target;

pub use asyncops::{
    AsyncOp, BarrierId, Guard, ImmScale, MaxNReg, RegDelta, ScaleD, SharedDecl, SharedTy, TmaDim,
    TmaLoad, Wgmma, WgmmaA, WgmmaN, WgmmaTy,
};
pub use entry::{Cluster, DynamicShared, Entry, Param, ParamKind};
pub use isa::{
    BinOpcode, Builder, CmpOp, Inst, Operand, PtxTy, Reg, RegClass, Rnd, SpecialReg, UnOpcode,
    PTX_VERSION,
};
pub use lower::{compile, kernel_ptx, magic_u31, native};
