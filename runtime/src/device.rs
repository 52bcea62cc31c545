//! The CUDA device: a context and a stream on one GPU, opened only after checking that the driver
//! library can be loaded at all.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use crate::{drv, Error, Result};

/// Whether a CUDA driver library (libcuda) can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only tries to dlopen the library's usual names and closes them again;
    // it touches no other state.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// One GPU with its primary context and a stream.
pub struct Device {
    /// The context.
    pub ctx: Arc<CudaContext>,
    /// The stream all work is queued on.
    pub stream: Arc<CudaStream>,
    /// The driver's CUDA version (e.g. 13000).
    pub driver_version: i32,
    /// The device's name.
    pub name: String,
    /// Compute capability (major, minor).
    pub capability: (i32, i32),
    /// Streaming multiprocessors.
    pub sms: u32,
}

impl Device {
    /// Open GPU `ordinal`, or say why not (no driver library, no device).
    pub fn open(ordinal: usize) -> Result<Device> {
        if !driver_present() {
            return Err(Error::NoDriver(
                "libcuda (the CUDA driver library) is not installed or not loadable".into(),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| Error::NoDriver(format!("{e:?}")))?;
        let mut v: std::ffi::c_int = 0;
        // SAFETY: the driver library is loaded (checked above) and initialised by `CudaContext::new`;
        // the out-pointer is a valid local.
        let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(Error::Driver {
                call: "cuDriverGetVersion",
                detail: format!("{r:?}"),
            });
        }
        let name = ctx.name().map_err(drv("cuDeviceGetName"))?;
        use cudarc::driver::sys::CUdevice_attribute as A;
        let major = ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .map_err(drv("cuDeviceGetAttribute"))?;
        let minor = ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            .map_err(drv("cuDeviceGetAttribute"))?;
        let sms = ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv("cuDeviceGetAttribute"))?
            .max(1) as u32;
        let stream = ctx.default_stream();
        Ok(Device {
            ctx,
            stream,
            driver_version: v,
            name,
            capability: (major, minor),
            sms,
        })
    }

    /// Wait for all work queued on the stream.
    pub fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(drv("cuStreamSynchronize"))
    }

    /// The PTX target for this device (`sm_90a` on Hopper, `sm_100a` on Blackwell).
    pub fn target(&self) -> Option<moeforge_codegen::ptx::Target> {
        match self.capability {
            (9, 0) => Some(moeforge_codegen::ptx::Target::Sm90a),
            (10, 0) => Some(moeforge_codegen::ptx::Target::Sm100a),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_driver_is_a_clean_error() {
        if driver_present() {
            // A machine with a driver: `moeforge selftest --gpu` covers the device path there.
            return;
        }
        match Device::open(0) {
            Err(Error::NoDriver(why)) => assert!(why.contains("libcuda"), "{why}"),
            Err(other) => panic!("expected NoDriver, got {other}"),
            Ok(_) => panic!("opened a device without a driver"),
        }
    }
}
