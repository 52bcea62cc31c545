//! Plumbing shared by the GPU self-tests (`selftest --gpu --gemm`: the grouped GEMMs, the activation
//! quantizers, the MoE permute): a seeded generator, a fresh seed, and the Hopper device or the
//! report's SKIPPED line.

use std::fmt::Write as _;

use crate::runtime::Device;

/// xorshift64*.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    /// A bf16 in [-1, 1).
    pub(crate) fn bf16(&mut self) -> u16 {
        let u = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        crate::codegen::gemm::reference::bf16_from_f32(2.0 * u - 1.0)
    }

    /// A finite bf16 with a random sign, mantissa and an exponent field in `exp`.
    pub(crate) fn bf16_exp(&mut self, exp: std::ops::Range<usize>) -> u16 {
        let e = (exp.start + self.below(exp.end - exp.start)) as u16;
        let r = self.next();
        ((r & 1) as u16) << 15 | e << 7 | ((r >> 8) & 0x7F) as u16
    }
}

/// A fresh odd seed from the clock (the reports print it, so that a failure can be replayed).
pub(crate) fn fresh_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1)
        | 1
}

/// The device for a Hopper-only self-test of `what`, or `None` after writing its SKIPPED line
/// (no GPU, or not sm_90a) to `out`.
pub(crate) fn hopper(what: &str, out: &mut String) -> Option<Device> {
    let dev = match crate::gpu::open() {
        Ok(d) => d,
        Err(why) => {
            let _ = writeln!(out, "SKIPPED: the {what} needs a CUDA GPU ({why})");
            return None;
        }
    };
    if dev.target() != Some(crate::codegen::ptx::Target::Sm90a) {
        let _ = writeln!(out, "SKIPPED: the {what} is sm_90a (Hopper) only");
        return None;
    }
    Some(dev)
}
