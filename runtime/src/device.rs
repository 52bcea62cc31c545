//! The CUDA device: a context and a stream on one GPU, opened only after checking that the driver
//! library can be loaded at all.
//!
//! The stream is not the legacy null stream (unless a caller hands that in): [`Device::open`] creates
//! one of its own (non-blocking), and [`Device::with_borrowed_stream`] queues on a stream a serving
//! process hands in (PyTorch's current stream, say), so moeforge's work is ordered with the host
//! framework's by the stream itself. A device's buffers are used on its stream only, so cudarc's cross-stream event tracking
//! is off: work a caller queues on another stream must be ordered with the device's by the caller.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use crate::{drv, Error, Result};

/// Whether a CUDA driver library (libcuda) can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only tries to dlopen the library's usual names and closes them again;
    // it touches no other state.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

fn no_driver() -> Error {
    Error::NoDriver("libcuda (the CUDA driver library) is not installed or not loadable".into())
}

/// The number of CUDA GPUs, or why there are none to count (no driver library, no device).
pub fn count() -> Result<usize> {
    if !driver_present() {
        return Err(no_driver());
    }
    let n = CudaContext::device_count().map_err(|e| Error::NoDriver(format!("{e:?}")))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// One GPU with its primary context and a stream.
pub struct Device {
    /// The context.
    pub ctx: Arc<CudaContext>,
    /// The stream all work is queued on: this device's own ([`Device::open`]) or a borrowed one
    /// ([`Device::with_borrowed_stream`]), never the legacy null stream unless a caller hands it in.
    pub stream: Arc<CudaStream>,
    /// The driver's CUDA version (e.g. 13000).
    pub driver_version: i32,
    /// The device's name.
    pub name: String,
    /// Compute capability (major, minor).
    pub capability: (i32, i32),
    /// Streaming multiprocessors.
    pub sms: u32,
    /// Launch the MoE layer's kernels with programmatic dependent launch
    /// ([`crate::launch::KernelLaunch`]): on by default from compute capability 9.0 (Hopper), which
    /// has it; a caller may turn it off (the CLI's `MOEFORGE_PDL=0`).
    pub pdl: bool,
}

impl Device {
    /// A handle that queues on `stream` (its context's device), for code that holds only a stream
    /// (a parameter store's storage); the descriptive fields (name, capability, SMs, driver
    /// version) are left empty.
    pub fn on_stream(stream: &Arc<CudaStream>) -> Device {
        Device {
            ctx: stream.context().clone(),
            stream: stream.clone(),
            driver_version: 0,
            name: String::new(),
            capability: (0, 0),
            sms: 0,
            pdl: false,
        }
    }

    /// Open GPU `ordinal` (its primary context, current on the calling thread) with a new stream of
    /// its own, or say why not (no driver library, no device).
    pub fn open(ordinal: usize) -> Result<Device> {
        Device::open_with(ordinal, |ctx| {
            ctx.new_stream().map_err(drv("cuStreamCreate"))
        })
    }

    /// Open GPU `ordinal` (its primary context, current on the calling thread) queuing all work on
    /// `stream`, a stream owned by the caller (a serving process's current stream). A null `stream` is
    /// the legacy default stream.
    ///
    /// # Safety
    ///
    /// - `stream` must be a valid stream of GPU `ordinal`'s *primary* context (the one the CUDA
    ///   runtime, and so PyTorch, uses), or null.
    /// - It must stay alive (not be destroyed by its owner) as long as the returned device, and every
    ///   buffer, program or store made with it, may be used or dropped: buffers are freed on it.
    /// - The caller orders work it queues on other streams with the work moeforge queues here (work on
    ///   this same stream is ordered by the stream itself).
    pub unsafe fn with_borrowed_stream(
        ordinal: usize,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<Device> {
        Device::open_with(ordinal, |ctx| {
            // SAFETY: the caller guarantees that `stream` is a stream of this primary context (or
            // null) that outlives the device and whatever retains the wrapper, and orders other
            // streams' work with it (this function's contract).
            Ok(unsafe { ctx.wrap_borrowed_stream(stream) })
        })
    }

    fn open_with(
        ordinal: usize,
        stream: impl FnOnce(&Arc<CudaContext>) -> Result<Arc<CudaStream>>,
    ) -> Result<Device> {
        if !driver_present() {
            return Err(no_driver());
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| Error::NoDriver(format!("{e:?}")))?;
        // SAFETY: this context object was just made, so no buffer of it exists yet; every buffer of a
        // `Device` is used on its one stream, in stream order (and freed on it), so cudarc's
        // cross-stream event tracking is not needed (the legacy null stream never had it) and would
        // add an event wait and record per buffer per launch.
        unsafe { ctx.disable_event_tracking() };
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
        let stream = stream(&ctx)?;
        Ok(Device {
            ctx,
            stream,
            driver_version: v,
            name,
            capability: (major, minor),
            sms,
            pdl: major >= 9,
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

/// `NoDriver` unless a driver is present and `dev` is Hopper (sm_90a): the check of every loader of
/// the sm_90a-only kernels (grouped GEMMs, activation quantization, the MoE layer's kernels); `what`
/// names the kernels in the message.
pub(crate) fn hopper_only(dev: &Device, what: &str) -> Result<()> {
    if !driver_present() {
        return Err(Error::NoDriver(format!("{what} needs the CUDA driver")));
    }
    if dev.target() != Some(moeforge_codegen::ptx::Target::Sm90a) {
        return Err(Error::NoDriver(format!(
            "{what} is sm_90a (Hopper) only; this device is compute capability {:?}",
            dev.capability
        )));
    }
    Ok(())
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
        // SAFETY: never reaches the driver: there is none (checked above).
        match unsafe { Device::with_borrowed_stream(0, std::ptr::null_mut()) } {
            Err(Error::NoDriver(why)) => assert!(why.contains("libcuda"), "{why}"),
            Err(other) => panic!("expected NoDriver, got {other}"),
            Ok(_) => panic!("opened a device without a driver"),
        }
        assert!(matches!(count(), Err(Error::NoDriver(_))));
    }
}
