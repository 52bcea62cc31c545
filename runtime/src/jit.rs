//! PTX -> cubin through the driver's JIT linker (`cuLinkCreate` / `cuLinkAddData` / `cuLinkComplete`),
//! keeping the info and error logs so that a failure says why.

use std::ffi::{c_void, CString};

use cudarc::driver::sys::{self, CUjitInputType, CUjit_option, CUresult};

use crate::{Device, Error, Result};

const LOG: usize = 1 << 16;

/// Compile PTX text to a cubin for the device's architecture. The device's context must be current
/// (it is made current here).
pub fn link_ptx(dev: &Device, name: &str, ptx: &str) -> Result<(Vec<u8>, String)> {
    dev.ctx
        .bind_to_thread()
        .map_err(crate::drv("cuCtxSetCurrent"))?;
    let mut info = vec![0u8; LOG];
    let mut error = vec![0u8; LOG];
    let mut opts = [
        CUjit_option::CU_JIT_INFO_LOG_BUFFER,
        CUjit_option::CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
        CUjit_option::CU_JIT_LOG_VERBOSE,
    ];
    // Integer-valued options travel in the pointer-sized slot, as the driver API defines.
    let mut vals: [*mut c_void; 5] = [
        info.as_mut_ptr() as *mut c_void,
        std::ptr::without_provenance_mut(LOG),
        error.as_mut_ptr() as *mut c_void,
        std::ptr::without_provenance_mut(LOG),
        std::ptr::without_provenance_mut(1),
    ];
    let src = CString::new(ptx).map_err(|_| Error::Jit {
        name: name.into(),
        code: "invalid".into(),
        log: "the PTX contains a NUL byte".into(),
    })?;
    let cname = CString::new(name).unwrap_or_default();
    let mut state: sys::CUlinkState = std::ptr::null_mut();
    let log_text = |b: &[u8]| {
        String::from_utf8_lossy(&b[..b.iter().position(|&c| c == 0).unwrap_or(b.len())])
            .into_owned()
    };
    // SAFETY: `opts` and `vals` have the same length (5) and live until `cuLinkDestroy`; the log
    // buffers are LOG bytes long as their size options say; `state` is a valid out-pointer.
    let r = unsafe {
        sys::cuLinkCreate_v2(
            opts.len() as u32,
            opts.as_mut_ptr(),
            vals.as_mut_ptr(),
            &mut state,
        )
    };
    if r != CUresult::CUDA_SUCCESS {
        return Err(Error::Driver {
            call: "cuLinkCreate",
            detail: format!("{r:?}"),
        });
    }
    let result = (|| {
        // SAFETY: `state` was created above; `src` is a NUL-terminated PTX string whose size includes
        // the terminator, as the driver expects for PTX input; no per-input options are passed.
        let r = unsafe {
            sys::cuLinkAddData_v2(
                state,
                CUjitInputType::CU_JIT_INPUT_PTX,
                src.as_ptr() as *mut c_void,
                src.as_bytes_with_nul().len(),
                cname.as_ptr(),
                0,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
        if r != CUresult::CUDA_SUCCESS {
            return Err(Error::Jit {
                name: name.into(),
                code: format!("{r:?}"),
                log: format!("{}{}", log_text(&error), log_text(&info)),
            });
        }
        let mut cubin: *mut c_void = std::ptr::null_mut();
        let mut size: usize = 0;
        // SAFETY: `state` holds the added PTX; the out-pointers are valid locals. The returned image is
        // owned by `state` and copied below before `cuLinkDestroy`.
        let r = unsafe { sys::cuLinkComplete(state, &mut cubin, &mut size) };
        if r != CUresult::CUDA_SUCCESS || cubin.is_null() {
            return Err(Error::Jit {
                name: name.into(),
                code: format!("{r:?}"),
                log: format!("{}{}", log_text(&error), log_text(&info)),
            });
        }
        // SAFETY: the driver returned `size` readable bytes at `cubin`, valid until `cuLinkDestroy`.
        let bytes = unsafe { std::slice::from_raw_parts(cubin as *const u8, size) }.to_vec();
        Ok((bytes, log_text(&info)))
    })();
    // SAFETY: `state` was created by `cuLinkCreate` and is destroyed exactly once, after its image was
    // copied out.
    unsafe { sys::cuLinkDestroy(state) };
    result
}
