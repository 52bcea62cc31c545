//! TMA descriptors at launch: [`TensorMapParams`] (validated by the code generator) encoded by the
//! driver's `cuTensorMapEncodeTiled` into the 128-byte `CUtensorMap` a kernel takes as a
//! `.param .align 64 .b8 [128]` argument, and cached per (buffer, box) so that the steady state
//! never re-encodes.

use std::collections::HashMap;
use std::sync::Mutex;

use cudarc::driver::sys;
use moeforge_codegen::gemm::desc::{
    L2Promotion, OobFill, Swizzle, TensorMapDataType, TensorMapInterleave, TensorMapParams,
};

use crate::{Error, Result};

/// An encoded tensor map: the 128 bytes a kernel parameter carries.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(C, align(64))]
pub struct TensorMap(pub [u8; 128]);

// SAFETY: `TensorMap` is a plain 128-byte `repr(C)` array with no pointers or padding, 64-byte
// aligned as `CUtensorMap` must be; a kernel takes it by value as `.param .align 64 .b8 [128]`, so
// passing its host bytes (cudarc pushes a pointer to the value for the launch to copy) is exactly
// what the driver expects.
unsafe impl cudarc::driver::DeviceRepr for TensorMap {}

impl std::fmt::Debug for TensorMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TensorMap({:02x?}..)", &self.0[..8])
    }
}

fn data_type(t: TensorMapDataType) -> sys::CUtensorMapDataType {
    use sys::CUtensorMapDataType as C;
    use TensorMapDataType as T;
    match t {
        T::Uint8 => C::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        T::Uint16 => C::CU_TENSOR_MAP_DATA_TYPE_UINT16,
        T::Uint32 => C::CU_TENSOR_MAP_DATA_TYPE_UINT32,
        T::Int32 => C::CU_TENSOR_MAP_DATA_TYPE_INT32,
        T::Uint64 => C::CU_TENSOR_MAP_DATA_TYPE_UINT64,
        T::Int64 => C::CU_TENSOR_MAP_DATA_TYPE_INT64,
        T::Float16 => C::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        T::Float32 => C::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        T::Float64 => C::CU_TENSOR_MAP_DATA_TYPE_FLOAT64,
        T::Bfloat16 => C::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        T::Float32Ftz => C::CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ,
        T::Tfloat32 => C::CU_TENSOR_MAP_DATA_TYPE_TFLOAT32,
        T::Tfloat32Ftz => C::CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ,
        T::U4x16Align8B => C::CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN8B,
        T::U4x16Align16B => C::CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B,
        T::U6x16Align16B => C::CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B,
    }
}

fn interleave(i: TensorMapInterleave) -> sys::CUtensorMapInterleave {
    use sys::CUtensorMapInterleave as C;
    match i {
        TensorMapInterleave::None => C::CU_TENSOR_MAP_INTERLEAVE_NONE,
        TensorMapInterleave::B16 => C::CU_TENSOR_MAP_INTERLEAVE_16B,
        TensorMapInterleave::B32 => C::CU_TENSOR_MAP_INTERLEAVE_32B,
    }
}

fn swizzle(s: Swizzle) -> sys::CUtensorMapSwizzle {
    use sys::CUtensorMapSwizzle as C;
    match s {
        Swizzle::None => C::CU_TENSOR_MAP_SWIZZLE_NONE,
        Swizzle::B32 => C::CU_TENSOR_MAP_SWIZZLE_32B,
        Swizzle::B64 => C::CU_TENSOR_MAP_SWIZZLE_64B,
        Swizzle::B128 => C::CU_TENSOR_MAP_SWIZZLE_128B,
    }
}

fn l2(p: L2Promotion) -> sys::CUtensorMapL2promotion {
    use sys::CUtensorMapL2promotion as C;
    match p {
        L2Promotion::None => C::CU_TENSOR_MAP_L2_PROMOTION_NONE,
        L2Promotion::B64 => C::CU_TENSOR_MAP_L2_PROMOTION_L2_64B,
        L2Promotion::B128 => C::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        L2Promotion::B256 => C::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
    }
}

fn oob(o: OobFill) -> sys::CUtensorMapFloatOOBfill {
    use sys::CUtensorMapFloatOOBfill as C;
    match o {
        OobFill::None => C::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        OobFill::NanRequestZeroFma => C::CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA,
    }
}

/// Encode `p` with the driver (which must be loaded: see [`crate::device::driver_present`]).
/// The parameters are validated first, so the driver never sees an argument it would refuse for a
/// documented constraint.
pub fn encode(p: &TensorMapParams) -> Result<TensorMap> {
    p.validate()
        .map_err(|e| Error::Placement(format!("tensor map: {e}")))?;
    if !crate::device::driver_present() {
        return Err(Error::NoDriver(
            "encoding a tensor map needs the CUDA driver".into(),
        ));
    }
    let mut out = sys::CUtensorMap { opaque: [0; 16] };
    let dims: Vec<u64> = p.dims().to_vec();
    let strides: Vec<u64> = p.strides().to_vec();
    let boxes: Vec<u32> = p.box_dims().to_vec();
    let elems: Vec<u32> = p.elem_strides().to_vec();
    // SAFETY: the driver library is loaded (checked above); every pointer is to a live local array
    // of `rank` (strides: `rank - 1`) elements, as `validate` checked the rank; `out` is a valid
    // CUtensorMap to write; the global address is only recorded, not dereferenced, by the encoder.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut out,
            data_type(p.data_type),
            p.rank,
            p.global_address as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elems.as_ptr(),
            interleave(p.interleave),
            swizzle(p.swizzle),
            l2(p.l2_promotion),
            oob(p.oob_fill),
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::Driver {
            call: "cuTensorMapEncodeTiled",
            detail: format!("{r:?}"),
        });
    }
    let mut bytes = [0u8; 128];
    for (c, w) in bytes.chunks_exact_mut(8).zip(out.opaque) {
        c.copy_from_slice(&w.to_le_bytes());
    }
    Ok(TensorMap(bytes))
}

/// Encoded tensor maps by their full parameters (buffer address, shape, strides, box, swizzle...):
/// a launch asks here, and only the first ask for a (buffer, box) encodes.
#[derive(Default)]
pub struct TensorMapCache {
    maps: Mutex<HashMap<TensorMapParams, TensorMap>>,
}

impl TensorMapCache {
    /// An empty cache.
    pub fn new() -> TensorMapCache {
        TensorMapCache::default()
    }

    /// The encoded map for `p`, encoding it on the first ask.
    pub fn get(&self, p: &TensorMapParams) -> Result<TensorMap> {
        if let Some(m) = self.maps.lock().ok().and_then(|m| m.get(p).copied()) {
            return Ok(m);
        }
        let m = encode(p)?;
        if let Ok(mut maps) = self.maps.lock() {
            maps.insert(*p, m);
        }
        Ok(m)
    }

    /// Maps held.
    pub fn len(&self) -> usize {
        self.maps.lock().map(|m| m.len()).unwrap_or(0)
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generator_enums_are_the_drivers_numbers() {
        for t in [
            TensorMapDataType::Uint8,
            TensorMapDataType::Uint16,
            TensorMapDataType::Uint32,
            TensorMapDataType::Int32,
            TensorMapDataType::Uint64,
            TensorMapDataType::Int64,
            TensorMapDataType::Float16,
            TensorMapDataType::Float32,
            TensorMapDataType::Float64,
            TensorMapDataType::Bfloat16,
            TensorMapDataType::Float32Ftz,
            TensorMapDataType::Tfloat32,
            TensorMapDataType::Tfloat32Ftz,
            TensorMapDataType::U4x16Align8B,
            TensorMapDataType::U4x16Align16B,
            TensorMapDataType::U6x16Align16B,
        ] {
            assert_eq!(data_type(t) as u32, t.raw(), "{t:?}");
        }
        for i in [
            TensorMapInterleave::None,
            TensorMapInterleave::B16,
            TensorMapInterleave::B32,
        ] {
            assert_eq!(interleave(i) as u32, i.raw(), "{i:?}");
        }
        for s in Swizzle::ALL {
            assert_eq!(swizzle(s) as u32, s.cu_tensor_map(), "{s:?}");
        }
        for p in [
            L2Promotion::None,
            L2Promotion::B64,
            L2Promotion::B128,
            L2Promotion::B256,
        ] {
            assert_eq!(l2(p) as u32, p.raw(), "{p:?}");
        }
        for o in [OobFill::None, OobFill::NanRequestZeroFma] {
            assert_eq!(oob(o) as u32, o.raw(), "{o:?}");
        }
    }

    #[test]
    fn invalid_parameters_are_refused_before_the_driver() {
        let mut p = TensorMapParams {
            data_type: TensorMapDataType::Bfloat16,
            rank: 2,
            global_address: 0x1000,
            global_dim: [64, 64, 1, 1, 1],
            global_strides: [128, 0, 0, 0],
            box_dim: [64, 64, 1, 1, 1],
            element_strides: [1; 5],
            interleave: TensorMapInterleave::None,
            swizzle: Swizzle::B128,
            l2_promotion: L2Promotion::B256,
            oob_fill: OobFill::None,
        };
        p.global_address = 0x1001;
        assert!(matches!(encode(&p), Err(Error::Placement(_))));
        // A valid map without a driver is NoDriver (CI), or encodes (a GPU machine).
        p.global_address = 0x1000;
        match encode(&p) {
            Ok(m) => assert_ne!(m.0, [0u8; 128]),
            Err(e) => assert!(matches!(e, Error::NoDriver(_)), "{e}"),
        }
    }
}
