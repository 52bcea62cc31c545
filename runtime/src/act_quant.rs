//! The generated activation quantization on the device (`codegen::gemm::act_quant`): bf16 `X [T,
//! K]` to E4M3 codes `[T, K]` and f32 scales, per token (`[T]`) or per 1x128 group (`[ceil(K/128),
//! T]`, group-major). [`ActQuant::load`] JITs the PTX through the driver's linker;
//! [`ActQuant::run`] checks the buffers' sizes and launches.

use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, LaunchConfig};
use std::sync::Arc;

use moeforge_codegen::gemm::act_quant::{self, Launch, Mode};

use crate::{Device, Error, Result};

/// The loaded activation-quantization kernel for one `(mode, K)`.
pub struct ActQuant {
    _module: Arc<CudaModule>,
    func: CudaFunction,
    launch: Launch,
}

impl std::fmt::Debug for ActQuant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ActQuant({:?})", self.launch)
    }
}

impl ActQuant {
    /// Generate the kernel of `mode` for `K = k`, JIT it for `dev` (Hopper, sm_90a, only) through
    /// the driver's linker and load it. Errors: no driver or another architecture (`NoDriver`), a K
    /// the generator refuses (0, not a multiple of 8, too large: `Codegen`), the JIT's.
    pub fn load(dev: &Device, mode: Mode, k: u32) -> Result<ActQuant> {
        crate::device::hopper_only(dev, "activation quantization")?;
        let (ptx, launch) = act_quant::act_quant(mode, k)?;
        let (module, [func]) = crate::jit::load_entries(dev, &ptx, [launch.entry.as_str()])?;
        Ok(ActQuant {
            _module: module,
            func,
            launch,
        })
    }

    /// The launch information (mode, K, threads).
    pub fn launch(&self) -> &Launch {
        &self.launch
    }

    /// Quantize `t` rows: `x` bf16 `[t, K]` (bytes, finite values), `q` E4M3 `[t, K]` (bytes),
    /// `scales` f32 `[t]` (per token) or `[ceil(K/128), t]` (per group; [`Launch::scales_len`]).
    /// Queued on `dev.stream`; returns without waiting. `t = 0` launches nothing. Errors: a buffer
    /// too small, `t` past the kernel's 32-bit indices (`Placement`), the launch's.
    ///
    /// # Safety
    /// The launch is asynchronous: `x` must not be written, nor `q` and `scales` read or written,
    /// by work on another stream until this stream reaches the kernel's end. The buffers' sizes are
    /// checked here, so the kernel touches nothing outside them.
    pub unsafe fn run(
        &self,
        dev: &Device,
        x: &CudaSlice<u8>,
        q: &mut CudaSlice<u8>,
        scales: &mut CudaSlice<f32>,
        t: usize,
    ) -> Result<()> {
        let k = self.launch.k as usize;
        let short = |what: &str, got: usize, want: usize| {
            Error::Placement(format!(
                "activation quantization: `{what}` has {got} elements, needs at least {want}"
            ))
        };
        let elems = t.checked_mul(k).ok_or_else(|| {
            Error::Placement(format!("activation quantization: {t} rows of {k} overflow"))
        })?;
        if x.len() < elems * 2 {
            return Err(short("x", x.len(), elems * 2));
        }
        if q.len() < elems {
            return Err(short("q", q.len(), elems));
        }
        let ns = self.launch.scales_len(t);
        if scales.len() < ns {
            return Err(short("scales", scales.len(), ns));
        }
        if t == 0 {
            return Ok(());
        }
        let (Some(grid), Ok(t32)) = (self.launch.grid(t), u32::try_from(t)) else {
            return Err(Error::Placement(format!(
                "activation quantization: {t} rows of {k} is past the kernel's 32-bit indices"
            )));
        };
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (self.launch.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = crate::launch::KernelLaunch::new(dev, &self.func);
        l.buf(x).buf_mut(q).buf_mut(scales).val(&t32);
        // SAFETY: the arguments match the entry's parameters in order (three u64 pointers, x, q and
        // scales, then the u32 row count). `x` holds at least t * K bf16, `q` t * K bytes and
        // `scales` scales_len(t) f32 (checked above); the kernel reads rows below `t32` only and
        // writes their codes and scales only, inside those sizes. cudarc's allocations are 256-byte
        // aligned, more than the 16, 8 and 4 bytes the kernel's vector accesses need. The caller
        // keeps other streams off the buffers until the kernel ends.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a driver there is no device to load on (`NoDriver`); with one, sm_90a loads and
    /// refuses short buffers.
    #[test]
    fn load_without_a_driver_is_no_driver() {
        match Device::open(0) {
            Err(e) => assert!(matches!(e, Error::NoDriver(_)), "{e}"),
            Ok(dev) => match ActQuant::load(&dev, Mode::PerGroup128, 256) {
                Ok(a) => assert_eq!(a.launch().scales_len(3), 6),
                Err(e) => assert!(
                    matches!(e, Error::NoDriver(_))
                        && dev.target() != Some(moeforge_codegen::ptx::Target::Sm90a),
                    "{e}"
                ),
            },
        }
    }
}
