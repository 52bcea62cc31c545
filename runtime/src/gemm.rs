//! The generated grouped GEMM on the device, v0 (`codegen::gemm::kernel::grouped_bf16_v0`): bf16 `X
//! [T, K]` (rows sorted by expert) times bf16 `W [E, N, K]` into f32 `Y [T, N]`, the per-expert row
//! offsets read by the kernel from device memory (no host sync). [`GemmBf16V0::load`] JITs the PTX
//! through the driver's linker and opts the function in to its dynamic shared memory;
//! [`GemmBf16V0::run`] builds the two tensor maps (cached per buffer and shape) and launches.

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

use moeforge_codegen::gemm::desc::{Swizzle, TensorMapParams, WgmmaDtype};
use moeforge_codegen::gemm::kernel::{self, Launch};

use crate::tma::TensorMapCache;
use crate::{drv, Device, Error, Result};

/// The loaded v0 kernel for one `(N, K, stages)`.
pub struct GemmBf16V0 {
    _module: Arc<CudaModule>,
    func: CudaFunction,
    launch: Launch,
    maps: TensorMapCache,
}

impl std::fmt::Debug for GemmBf16V0 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GemmBf16V0({:?})", self.launch)
    }
}

fn map_err(e: moeforge_codegen::gemm::desc::DescError) -> Error {
    Error::Placement(format!("tensor map: {e}"))
}

impl GemmBf16V0 {
    /// Generate the kernel for `N = n`, `K = k` and `stages` pipeline stages, JIT it for `dev`
    /// (Hopper, sm_90a, only) through the driver's linker, load it and allow it its dynamic shared
    /// memory.
    pub fn load(dev: &Device, n: u32, k: u32, stages: u32) -> Result<GemmBf16V0> {
        crate::device::hopper_only(dev, "the grouped GEMM v0")?;
        let (ptx, launch) = kernel::grouped_bf16_v0(n, k, stages)?;
        let (module, [func]) = crate::jit::load_entries(dev, &ptx, [kernel::V0_ENTRY])?;
        func.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            i32::try_from(launch.dynamic_smem_bytes).unwrap_or(i32::MAX),
        )
        .map_err(drv("cuFuncSetAttribute"))?;
        Ok(GemmBf16V0 {
            _module: module,
            func,
            launch,
            maps: TensorMapCache::new(),
        })
    }

    /// The launch information (N, K, stages, shared memory).
    pub fn launch(&self) -> &Launch {
        &self.launch
    }

    /// `Y[rows of e] = X[rows of e] · W[e]^T` for `t` rows and `experts` experts: `x` bf16 `[t, K]`
    /// (bytes), `w` bf16 `[experts, N, K]` (bytes), `offsets` i32 `[experts + 1]`, `y` f32 `[t, N]`.
    /// Only rows inside some expert's range are written. Queued on `dev.stream`; returns without
    /// waiting.
    ///
    /// # Safety
    /// The *contents* of `offsets` (device memory, not read here) must be non-decreasing with
    /// `offsets[experts] <= t`: the kernel stores the rows they name, and rows past `t` would be
    /// written past the end of `y`. The buffers' sizes are checked here.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run(
        &self,
        dev: &Device,
        x: &CudaSlice<u8>,
        w: &CudaSlice<u8>,
        offsets: &CudaSlice<i32>,
        y: &mut CudaSlice<f32>,
        t: usize,
        experts: usize,
    ) -> Result<()> {
        let (n, k) = (self.launch.n as usize, self.launch.k as usize);
        let short = |what: &str, got: usize, want: usize| {
            Error::Placement(format!(
                "grouped GEMM: `{what}` has {got} elements, needs at least {want}"
            ))
        };
        if x.len() < t * k * 2 {
            return Err(short("x", x.len(), t * k * 2));
        }
        if w.len() < experts * n * k * 2 {
            return Err(short("w", w.len(), experts * n * k * 2));
        }
        if offsets.len() < experts + 1 {
            return Err(short("offsets", offsets.len(), experts + 1));
        }
        if y.len() < t * n {
            return Err(short("y", y.len(), t * n));
        }
        if t == 0 || experts == 0 {
            return Ok(());
        }
        let (t32, e32) = match (u32::try_from(t), u32::try_from(experts)) {
            (Ok(a), Ok(b)) if a < i32::MAX as u32 && b < 65536 => (a, b),
            _ => {
                return Err(Error::Placement(format!(
                "grouped GEMM: {t} rows over {experts} experts is past the kernel's 32-bit indices"
            )))
            }
        };
        let grid = self.launch.grid(t32, e32);
        if grid.1 > 65535 {
            return Err(Error::Placement(format!(
                "grouped GEMM: {} m-tiles exceed the grid's y limit of 65535",
                grid.1
            )));
        }
        let (xp, _xs) = x.device_ptr(&dev.stream);
        let (wp, _ws) = w.device_ptr(&dev.stream);
        let px = TensorMapParams::k_major(
            WgmmaDtype::Bf16,
            Swizzle::B128,
            xp,
            t as u64,
            k as u64,
            kernel::BM,
        )
        .map_err(map_err)?;
        let pw = TensorMapParams::expert_k_major(
            WgmmaDtype::Bf16,
            Swizzle::B128,
            wp,
            experts as u64,
            n as u64,
            k as u64,
            kernel::BN,
        )
        .map_err(map_err)?;
        let tmap_x = self.maps.get(&px)?;
        let tmap_w = self.maps.get(&pw)?;
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (self.launch.threads, 1, 1),
            shared_mem_bytes: self.launch.dynamic_smem_bytes,
        };
        let mut l = dev.stream.launch_builder(&self.func);
        l.arg(&tmap_x).arg(&tmap_w).arg(y).arg(offsets).arg(&e32);
        // SAFETY: the arguments match the entry's parameters in order (two 128-byte tensor maps
        // passed by value, the u64 pointers to `y` and `offsets`, the u32 expert count). The maps
        // describe `x` ([t, K] bf16) and `w` ([experts, N, K] bf16), whose sizes were checked, and
        // TMA reads only inside them (out-of-bounds boxes are zero-filled). The kernel reads
        // `offsets[0..=experts]` (checked) and stores `y` rows below `offsets[experts]`, columns
        // below N, inside `y` by the caller's guarantee on the offsets' contents. The maps live on
        // this stack frame until `launch` has copied the arguments.
        unsafe { l.launch(cfg) }.map_err(drv("cuLaunchKernel"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a driver there is no device to load on (`NoDriver`); with one, sm_90a loads.
    #[test]
    fn load_without_a_driver_is_no_driver() {
        match Device::open(0) {
            Err(e) => assert!(matches!(e, Error::NoDriver(_)), "{e}"),
            Ok(dev) => match GemmBf16V0::load(&dev, 256, 512, 2) {
                Ok(g) => assert_eq!(g.launch().k_tiles, 8),
                Err(e) => assert!(
                    matches!(e, Error::NoDriver(_))
                        && dev.target() != Some(moeforge_codegen::ptx::Target::Sm90a),
                    "{e}"
                ),
            },
        }
    }
}
