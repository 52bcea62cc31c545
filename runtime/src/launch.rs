//! Kernel launches with programmatic dependent launch (PDL, Hopper and later).
//!
//! The MoE layer is a chain of kernels on one stream (permute, the two grouped GEMMs, the
//! activation and combine kernels). Launched plainly, each waits for its predecessor's grid to
//! complete before its own CTAs are scheduled, so every boundary costs the launch of a grid (CTA
//! scheduling, shared memory and registers set up) on top of the predecessor's tail. Launched with
//! `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`, a kernel's CTAs may be scheduled once
//! every CTA of its predecessor has exited (or run `griddepcontrol.launch_dependents`, which the
//! generated kernels do not: at their start it let the next persistent GEMM's CTAs take SMs while
//! the previous kernel ran, and graph replays ran up to 21% slower, run 44), without waiting for the
//! grid's completion; its `griddepcontrol.wait` then holds it until the predecessor has completed
//! and its memory is visible. Every generated GEMM and MoE kernel begins with that wait and touches
//! no global memory before it (`codegen::gemm::emit`), so a PDL launch gives the same bits as a
//! plain one; the wait is a no-op for a kernel launched without the attribute, and a predecessor of
//! another library counts as triggering when its CTAs exit.
//!
//! [`KernelLaunch`] collects the arguments the way cudarc's launch builder does (pointers to the
//! values, in parameter order) and launches with `cuLaunchKernelEx` when [`Device::pdl`] is on,
//! else with `cuLaunchKernel`.

use std::ffi::c_void;

use cudarc::driver::sys;
use cudarc::driver::{CudaFunction, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use crate::{drv, Device, Result};

/// One argument: a pointer to the caller's value, or the index of a buffer's device address in
/// [`KernelLaunch`]'s own list (whose element pointers are taken only at launch, when the list no
/// longer grows).
enum Arg {
    Val(*mut c_void),
    Addr(usize),
}

/// One kernel launch being put together: its arguments in parameter order.
pub struct KernelLaunch<'a> {
    dev: &'a Device,
    func: &'a CudaFunction,
    /// The arguments in parameter order.
    args: Vec<Arg>,
    /// The device addresses of buffer arguments.
    addrs: Vec<u64>,
}

impl<'a> KernelLaunch<'a> {
    /// A launch of `func` on `dev`'s stream, with no arguments yet.
    pub fn new(dev: &'a Device, func: &'a CudaFunction) -> Self {
        KernelLaunch {
            dev,
            func,
            args: Vec::new(),
            addrs: Vec::new(),
        }
    }

    /// A value argument (a scalar, a 128-byte tensor map, a raw device address).
    pub fn val<T: DeviceRepr>(&mut self, v: &'a T) -> &mut Self {
        self.args.push(Arg::Val(v as *const T as *mut c_void));
        self
    }

    fn addr(&mut self, a: u64) {
        self.args.push(Arg::Addr(self.addrs.len()));
        self.addrs.push(a);
    }

    /// A buffer the kernel reads: its device address. (cudarc's access guard is dropped at once:
    /// moeforge's contexts run with its cross-stream event tracking off, `Device::open`, so the
    /// guard records nothing; the stream orders the launch with the buffer's other uses.)
    pub fn buf<T, B: DevicePtr<T>>(&mut self, b: &B) -> &mut Self {
        let (a, _guard) = b.device_ptr(&self.dev.stream);
        self.addr(a);
        self
    }

    /// A buffer the kernel writes: its device address (the guard as for [`KernelLaunch::buf`]).
    pub fn buf_mut<T, B: DevicePtrMut<T>>(&mut self, b: &mut B) -> &mut Self {
        let (a, _guard) = b.device_ptr_mut(&self.dev.stream);
        self.addr(a);
        self
    }

    /// Queue the kernel on the device's stream: with programmatic dependent launch where the
    /// device allows it ([`Device::pdl`]), else plainly.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order and type, and the
    /// kernel's accesses through them must stay inside the buffers (each caller states why).
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<()> {
        self.dev
            .ctx
            .bind_to_thread()
            .map_err(drv("cuCtxSetCurrent"))?;
        let f = self.func.cu_function();
        let stream = self.dev.stream.cu_stream();
        // One pointer per parameter, to the caller's value or to this launch's copy of a
        // buffer's address (`addrs` is not touched again until the call returns).
        // (One base pointer for all of them: `i` indexes `addrs`, as the argument was pushed.)
        let base = self.addrs.as_mut_ptr();
        let mut ptrs: Vec<*mut c_void> = self
            .args
            .iter()
            .map(|a| match *a {
                Arg::Val(p) => p,
                Arg::Addr(i) => base.wrapping_add(i).cast(),
            })
            .collect();
        let params = ptrs.as_mut_ptr();
        let (call, r) = if self.dev.pdl {
            // SAFETY: an all-zero launch attribute is valid plain data (a union of integers).
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            let config = sys::CUlaunchConfig {
                gridDimX: cfg.grid_dim.0,
                gridDimY: cfg.grid_dim.1,
                gridDimZ: cfg.grid_dim.2,
                blockDimX: cfg.block_dim.0,
                blockDimY: cfg.block_dim.1,
                blockDimZ: cfg.block_dim.2,
                sharedMemBytes: cfg.shared_mem_bytes,
                hStream: stream,
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: `config` and `attr` are valid for the call; `params` points at one pointer
            // per kernel parameter, each to a value that outlives the call (the caller's values
            // borrowed for 'a, the addresses in `self.addrs`, unmoved since `ptrs` was made); the
            // caller vouches for their match with the kernel (this function's contract).
            let r = unsafe { sys::cuLaunchKernelEx(&config, f, params, std::ptr::null_mut()) };
            ("cuLaunchKernelEx", r)
        } else {
            // SAFETY: as above, without launch attributes.
            let r = unsafe {
                sys::cuLaunchKernel(
                    f,
                    cfg.grid_dim.0,
                    cfg.grid_dim.1,
                    cfg.grid_dim.2,
                    cfg.block_dim.0,
                    cfg.block_dim.1,
                    cfg.block_dim.2,
                    cfg.shared_mem_bytes,
                    stream,
                    params,
                    std::ptr::null_mut(),
                )
            };
            ("cuLaunchKernel", r)
        };
        r.result().map_err(drv(call))
    }
}
