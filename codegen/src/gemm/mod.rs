//! The grouped-GEMM generator (issue \[7\]): a layer between the recipe and the PTX builder, in CuTe's
//! vocabulary. A kernel is composed of a copy atom (TMA into shared memory, completing on an
//! mbarrier), an MMA atom (`wgmma` on Hopper; a `tcgen05` atom plugs in later), a pipeline (an
//! mbarrier ring), a tile scheduler (persistent CTAs over expert, m-tile and n-tile work) and an
//! epilogue. This module holds the target-independent parts that are checked on the host.

pub mod act_quant;
pub(crate) mod dequant;
pub mod desc;
pub(crate) mod emit;
pub mod finish;
pub mod kernel;
pub mod reference;
pub mod schedule;
pub mod tune;
pub mod wmap;
pub mod ws;
