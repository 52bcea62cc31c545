//! The MoE layer's own kernels (issue \[9\]), outside the GEMMs: [`permute`] generates the
//! route + permute kernels (logical expert ids to EPLB slots, per-slot counts and row offsets,
//! expert-sorted rows of the activations), and [`reference`](mod@reference) computes the same on the host and
//! checks a device's output against it.

pub mod permute;
pub mod reference;
