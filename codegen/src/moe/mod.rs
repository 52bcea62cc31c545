//! The MoE layer's own kernels (issue \[9\]), outside the GEMMs: [`permute`] generates the
//! route + permute kernels (logical expert ids to EPLB slots, per-slot counts and row offsets,
//! expert-sorted rows of the activations), and [`reference`](mod@reference) computes the same on the host and
//! checks a device's output against it. Between and after the grouped GEMMs, [`act`] generates the
//! activation kernel (SiLU times up and/or quantization of rows to E4M3) and [`combine`] the
//! inversion of the row order, the per-row scales and the weighted sum of each token's rows.

pub mod act;
pub mod combine;
mod emit;
pub mod permute;
pub mod reference;
mod row_out;
pub mod scatter;
