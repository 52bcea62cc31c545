//! Host-side encodings of the Hopper (sm_90a) GEMM descriptors: the `wgmma` shared-memory matrix
//! descriptor, the parameters of a TMA tiled tensor map (what the runtime hands to
//! `cuTensorMapEncodeTiled`), and the `wgmma` instruction shapes with their accumulator sizes.
//!
//! Nothing here touches CUDA. The descriptor is a 64-bit value with the PTX ISA's layout
//! ("Matrix Descriptor Format", section 9.7.15.5.1.2.2 of the PTX ISA):
//!
//! | bits  | field                                                      |
//! |-------|------------------------------------------------------------|
//! | 0-13  | start address, `(addr & 0x3FFFF) >> 4`                      |
//! | 16-29 | leading dimension byte offset (LBO), `>> 4`                 |
//! | 32-45 | stride dimension byte offset (SBO), `>> 4`                  |
//! | 49-51 | matrix base offset (swizzled modes only)                    |
//! | 62-63 | swizzle: 0 none, 1 = 128B, 2 = 64B, 3 = 32B                 |
//!
//! The other bits are zero on sm_90 (sm_100's descriptor sets bit 46 and widens the swizzle field
//! to bits 61-63; [`SmemDesc::decode`] rejects such a value).
//!
//! The tensor-map enums carry the integer values of the CUDA driver header's `CUtensorMap*` enums,
//! so the runtime maps them 1:1 onto cudarc's sys enums.

use std::fmt;

/// Errors of the descriptor encodings.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DescError {
    /// A shared-memory byte address or offset is not a multiple of 16.
    #[error("`{field}` = {value:#x} is not 16-byte aligned (the descriptor keeps bytes >> 4)")]
    Misaligned {
        /// The field (`start_address`, `leading_byte_offset`, `stride_byte_offset`).
        field: &'static str,
        /// Its value in bytes.
        value: u64,
    },
    /// A shared-memory byte address or offset does not fit its 14-bit field (bytes < 2^18).
    #[error("`{field}` = {value:#x} does not fit the descriptor's 14-bit field (must be < 0x40000 bytes)")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// Its value in bytes.
        value: u64,
    },
    /// The matrix base offset is 3 bits.
    #[error("`base_offset` = {0} does not fit 3 bits")]
    BaseOffsetRange(u8),
    /// The base offset is only meaningful for swizzled layouts.
    #[error("`base_offset` = {0} is set on a non-swizzled descriptor")]
    BaseOffsetWithoutSwizzle(u8),
    /// A 64-bit value has bits set that the sm_90 descriptor keeps zero.
    #[error("descriptor {value:#018x} sets reserved bits {bits:#018x} (an sm_100 descriptor?)")]
    ReservedBits {
        /// The value decoded.
        value: u64,
        /// The reserved bits it sets.
        bits: u64,
    },
    /// A swizzled tile's base is not aligned to its swizzle pattern (so the base offset is not 0).
    #[error("tile base {address:#x} is not aligned to the {align}-byte swizzle pattern")]
    TileAlignment {
        /// The tile's shared-memory address.
        address: u64,
        /// The pattern's repeat in bytes.
        align: u32,
    },
    /// A tile shape the helper cannot describe.
    #[error("tile: {0}")]
    TileShape(String),
    /// A `wgmma` N outside 8..=256 or not a multiple of 8.
    #[error("`wgmma` N = {0} is not a multiple of 8 in 8..=256")]
    WgmmaN(u32),
    /// The tensor map's rank is outside 1..=5.
    #[error("tensor map rank {0} is outside 1..=5")]
    TmaRank(u32),
    /// The global address is not 16-byte aligned.
    #[error("tensor map global address {0:#x} is not 16-byte aligned")]
    TmaAddressAlignment(u64),
    /// A global dimension is zero or above 2^32.
    #[error("tensor map `globalDim[{dim}]` = {value} must be in 1..=2^32")]
    TmaGlobalDim {
        /// The dimension (0 innermost).
        dim: usize,
        /// Its extent.
        value: u64,
    },
    /// A global stride is not a multiple of 16 or not below 2^40.
    #[error(
        "tensor map `globalStrides[{index}]` = {value} bytes must be a multiple of 16 below 2^40"
    )]
    TmaGlobalStride {
        /// The index into `globalStrides` (the stride of dimension `index + 1`).
        index: usize,
        /// The stride in bytes.
        value: u64,
    },
    /// A global stride is smaller than the extent of the dimensions inside it (rows would overlap).
    #[error("tensor map `globalStrides[{index}]` = {value} bytes is below the {min} bytes of the dimensions inside it")]
    TmaStrideOverlap {
        /// The index into `globalStrides`.
        index: usize,
        /// The stride in bytes.
        value: u64,
        /// The smallest stride that does not overlap.
        min: u64,
    },
    /// A box dimension is zero or above 256.
    #[error("tensor map `boxDim[{dim}]` = {value} must be in 1..=256")]
    TmaBoxDim {
        /// The dimension.
        dim: usize,
        /// Its extent in elements.
        value: u32,
    },
    /// The box's inner dimension in bytes is not a multiple of 16.
    #[error("tensor map box inner dimension is {0} bytes, not a multiple of 16")]
    TmaBoxInnerBytes(u64),
    /// The box's inner dimension in bytes exceeds the swizzle span.
    #[error("tensor map box inner dimension is {bytes} bytes, above the {span}-byte swizzle span")]
    TmaSwizzleSpan {
        /// The inner dimension in bytes.
        bytes: u64,
        /// The swizzle span in bytes.
        span: u32,
    },
    /// An element stride is zero or above 8.
    #[error("tensor map `elementStrides[{dim}]` = {value} must be in 1..=8")]
    TmaElementStride {
        /// The dimension.
        dim: usize,
        /// The stride.
        value: u32,
    },
    /// `NAN_REQUEST_ZERO_FMA` fill on a data type that is not floating point.
    #[error("tensor map out-of-bounds NaN fill needs a floating-point data type, not `{0:?}`")]
    TmaOobFillType(TensorMapDataType),
    /// A packed sub-byte data type (sm_100 rules, not modelled here).
    #[error("tensor map data type `{0:?}` (packed sub-byte) is not supported by this encoder")]
    TmaPackedType(TensorMapDataType),
    /// An interleaved layout (moeforge builds non-interleaved maps only).
    #[error("tensor map interleave `{0:?}` is not supported by this encoder (use `None`)")]
    TmaInterleave(TensorMapInterleave),
}

/// The result type of this module.
pub type Result<T, E = DescError> = std::result::Result<T, E>;

// ---------------------------------------------------------------------------------------------
// Swizzle
// ---------------------------------------------------------------------------------------------

/// A shared-memory swizzle mode, shared by the TMA map that writes a tile and the `wgmma`
/// descriptor that reads it (the two must agree).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Swizzle {
    /// No swizzle (the descriptor's "interleave" canonical layout).
    None,
    /// 16-byte chunks swizzled within a 32-byte span.
    B32,
    /// 16-byte chunks swizzled within a 64-byte span.
    B64,
    /// 16-byte chunks swizzled within a 128-byte span.
    B128,
}

impl Swizzle {
    /// All modes, in the driver enum's order.
    pub const ALL: [Swizzle; 4] = [Swizzle::None, Swizzle::B32, Swizzle::B64, Swizzle::B128];

    /// The span in bytes (one swizzled row); `None` for no swizzle.
    pub fn span_bytes(self) -> Option<u32> {
        match self {
            Swizzle::None => None,
            Swizzle::B32 => Some(32),
            Swizzle::B64 => Some(64),
            Swizzle::B128 => Some(128),
        }
    }

    /// The byte boundary at which the swizzle pattern repeats (8 rows of the span): 256, 512 or
    /// 1024 bytes (PTX ISA, table of pattern start addresses); 16 for no swizzle.
    pub fn pattern_bytes(self) -> u32 {
        self.span_bytes().map_or(16, |s| 8 * s)
    }

    /// The value of the sm_90 descriptor's 2-bit layout field (bits 62-63).
    pub fn sm90_layout_type(self) -> u64 {
        match self {
            Swizzle::None => 0,
            Swizzle::B128 => 1,
            Swizzle::B64 => 2,
            Swizzle::B32 => 3,
        }
    }

    /// The mode from the sm_90 descriptor's 2-bit layout field.
    pub fn from_sm90_layout_type(bits: u64) -> Swizzle {
        match bits & 3 {
            1 => Swizzle::B128,
            2 => Swizzle::B64,
            3 => Swizzle::B32,
            _ => Swizzle::None,
        }
    }

    /// The `CUtensorMapSwizzle` value (`CU_TENSOR_MAP_SWIZZLE_NONE` = 0, `_32B` = 1, `_64B` = 2,
    /// `_128B` = 3).
    pub fn cu_tensor_map(self) -> u32 {
        match self {
            Swizzle::None => 0,
            Swizzle::B32 => 1,
            Swizzle::B64 => 2,
            Swizzle::B128 => 3,
        }
    }

    /// The base offset the PTX ISA asks for a pattern that starts at `pattern_start`: 0 when it
    /// starts on the pattern boundary, else `(pattern_start >> 7) & 7`. Always 0 without swizzle.
    pub fn base_offset_for(self, pattern_start: u32) -> u8 {
        if self == Swizzle::None || pattern_start.is_multiple_of(self.pattern_bytes()) {
            0
        } else {
            ((pattern_start >> 7) & 7) as u8
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Shared-memory matrix descriptor
// ---------------------------------------------------------------------------------------------

const FIELD14: u64 = 0x3FFF;
const START_SHIFT: u32 = 0;
const LBO_SHIFT: u32 = 16;
const SBO_SHIFT: u32 = 32;
const BASE_SHIFT: u32 = 49;
const LAYOUT_SHIFT: u32 = 62;
/// The bits an sm_90 descriptor defines; the rest must be zero.
const DEFINED_BITS: u64 = (FIELD14 << START_SHIFT)
    | (FIELD14 << LBO_SHIFT)
    | (FIELD14 << SBO_SHIFT)
    | (7 << BASE_SHIFT)
    | (3 << LAYOUT_SHIFT);
/// Byte addresses and offsets are kept as `bytes >> 4` in 14 bits: below 2^18 bytes.
const BYTE_FIELD_LIMIT: u64 = 1 << 18;

/// The `wgmma` shared-memory matrix descriptor (sm_90): a validated set of fields; [`encode`]
/// gives the 64-bit operand.
///
/// [`encode`]: SmemDesc::encode
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SmemDesc {
    start_address: u32,
    leading_byte_offset: u32,
    stride_byte_offset: u32,
    base_offset: u8,
    swizzle: Swizzle,
}

fn check_byte_field(field: &'static str, value: u64) -> Result<u32> {
    if !value.is_multiple_of(16) {
        return Err(DescError::Misaligned { field, value });
    }
    if value >= BYTE_FIELD_LIMIT {
        return Err(DescError::OutOfRange { field, value });
    }
    u32::try_from(value).map_err(|_| DescError::OutOfRange { field, value })
}

impl SmemDesc {
    /// A descriptor from byte values: the shared-memory (`.shared::cta` window) start address, the
    /// leading and stride dimension byte offsets (each 16-byte aligned and below 2^18), the base
    /// offset (0..=7, and 0 without swizzle) and the swizzle mode.
    pub fn new(
        start_address: u64,
        leading_byte_offset: u64,
        stride_byte_offset: u64,
        base_offset: u8,
        swizzle: Swizzle,
    ) -> Result<Self> {
        let start_address = check_byte_field("start_address", start_address)?;
        let leading_byte_offset = check_byte_field("leading_byte_offset", leading_byte_offset)?;
        let stride_byte_offset = check_byte_field("stride_byte_offset", stride_byte_offset)?;
        if base_offset > 7 {
            return Err(DescError::BaseOffsetRange(base_offset));
        }
        if swizzle == Swizzle::None && base_offset != 0 {
            return Err(DescError::BaseOffsetWithoutSwizzle(base_offset));
        }
        Ok(SmemDesc {
            start_address,
            leading_byte_offset,
            stride_byte_offset,
            base_offset,
            swizzle,
        })
    }

    /// The start address in bytes.
    pub fn start_address(&self) -> u32 {
        self.start_address
    }

    /// The leading dimension byte offset.
    pub fn leading_byte_offset(&self) -> u32 {
        self.leading_byte_offset
    }

    /// The stride dimension byte offset.
    pub fn stride_byte_offset(&self) -> u32 {
        self.stride_byte_offset
    }

    /// The matrix base offset (3 bits).
    pub fn base_offset(&self) -> u8 {
        self.base_offset
    }

    /// The swizzle mode.
    pub fn swizzle(&self) -> Swizzle {
        self.swizzle
    }

    /// The 64-bit descriptor, bit-exact to the PTX ISA layout (see the module docs).
    pub fn encode(&self) -> u64 {
        let enc = |bytes: u32| (u64::from(bytes) >> 4) & FIELD14;
        (enc(self.start_address) << START_SHIFT)
            | (enc(self.leading_byte_offset) << LBO_SHIFT)
            | (enc(self.stride_byte_offset) << SBO_SHIFT)
            | ((u64::from(self.base_offset) & 7) << BASE_SHIFT)
            | (self.swizzle.sm90_layout_type() << LAYOUT_SHIFT)
    }

    /// The low 32 bits (start address and LBO): the word a kernel advances along K.
    pub fn lo32(&self) -> u32 {
        (self.encode() & 0xFFFF_FFFF) as u32
    }

    /// The high 32 bits (SBO, base offset, swizzle): constant over a tile.
    pub fn hi32(&self) -> u32 {
        (self.encode() >> 32) as u32
    }

    /// The fields of a 64-bit sm_90 descriptor; reserved bits must be zero.
    pub fn decode(value: u64) -> Result<Self> {
        let reserved = value & !DEFINED_BITS;
        if reserved != 0 {
            return Err(DescError::ReservedBits {
                value,
                bits: reserved,
            });
        }
        let field = |shift: u32| ((value >> shift) & FIELD14) << 4;
        SmemDesc::new(
            field(START_SHIFT),
            field(LBO_SHIFT),
            field(SBO_SHIFT),
            ((value >> BASE_SHIFT) & 7) as u8,
            Swizzle::from_sm90_layout_type(value >> LAYOUT_SHIFT),
        )
    }

    /// The same descriptor with the start address moved by `bytes` (a K step inside a swizzle
    /// atom, or another row block), validated again.
    pub fn offset(&self, bytes: u64) -> Result<Self> {
        SmemDesc::new(
            u64::from(self.start_address) + bytes,
            u64::from(self.leading_byte_offset),
            u64::from(self.stride_byte_offset),
            self.base_offset,
            self.swizzle,
        )
    }
}

impl fmt::Display for SmemDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "smem_desc({:#018x}: addr={:#x} lbo={} sbo={} base={} {:?})",
            self.encode(),
            self.start_address,
            self.leading_byte_offset,
            self.stride_byte_offset,
            self.base_offset,
            self.swizzle
        )
    }
}

// ---------------------------------------------------------------------------------------------
// wgmma operand types and shapes
// ---------------------------------------------------------------------------------------------

/// The operand type of a `wgmma` (both operands have it; the accumulator is f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WgmmaDtype {
    /// bf16: `m64nNk16`.
    Bf16,
    /// FP8 e4m3: `m64nNk32`, K-major operands only.
    E4m3,
}

impl WgmmaDtype {
    /// Bytes per element.
    pub fn elem_bytes(self) -> u32 {
        match self {
            WgmmaDtype::Bf16 => 2,
            WgmmaDtype::E4m3 => 1,
        }
    }

    /// The K of one `wgmma` (always 32 bytes of K).
    pub fn k(self) -> u32 {
        match self {
            WgmmaDtype::Bf16 => 16,
            WgmmaDtype::E4m3 => 32,
        }
    }

    /// The PTX type suffix (`bf16`, `e4m3`).
    pub fn ptx(self) -> &'static str {
        match self {
            WgmmaDtype::Bf16 => "bf16",
            WgmmaDtype::E4m3 => "e4m3",
        }
    }

    /// The TMA data type its tiles are loaded as (e4m3 as `UINT8`, as the H200 examples do).
    pub fn tensor_map_data_type(self) -> TensorMapDataType {
        match self {
            WgmmaDtype::Bf16 => TensorMapDataType::Bfloat16,
            WgmmaDtype::E4m3 => TensorMapDataType::Uint8,
        }
    }
}

/// A `wgmma.mma_async` shape `m64nNkK` with an f32 accumulator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WgmmaShape {
    /// The operand type.
    pub dtype: WgmmaDtype,
    /// M: always 64 (one warpgroup).
    pub m: u32,
    /// N: a multiple of 8 in 8..=256.
    pub n: u32,
    /// K: 16 for bf16, 32 for e4m3.
    pub k: u32,
}

impl WgmmaShape {
    /// The shape `m64nNk*` for `dtype`, if N is valid.
    pub fn new(dtype: WgmmaDtype, n: u32) -> Result<Self> {
        if n == 0 || n > 256 || !n.is_multiple_of(8) {
            return Err(DescError::WgmmaN(n));
        }
        Ok(WgmmaShape {
            dtype,
            m: 64,
            n,
            k: dtype.k(),
        })
    }

    /// f32 accumulator registers per thread: 64*N values over 128 threads, N/2.
    pub fn accumulator_registers(&self) -> u32 {
        self.m * self.n / 128
    }

    /// The shape as PTX spells it, e.g. `m64n128k16`.
    pub fn ptx(&self) -> String {
        format!("m{}n{}k{}", self.m, self.n, self.k)
    }
}

/// Every valid `wgmma` shape for `dtype` with an f32 accumulator: M = 64, N = 8, 16, ..., 256.
pub fn wgmma_shapes(dtype: WgmmaDtype) -> Vec<WgmmaShape> {
    (1..=32)
        .map(|i| WgmmaShape {
            dtype,
            m: 64,
            n: 8 * i,
            k: dtype.k(),
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// K-major swizzled operand tiles
// ---------------------------------------------------------------------------------------------

/// A K-major operand tile in shared memory, as TMA writes it with a swizzled box of
/// `rows x span` bytes (span = 32, 64 or 128 bytes of K): row `r` of a box lies at
/// `r * span`, and a tile wider than one span along K is `k_bytes / span` such boxes one after the
/// other (`rows * span` bytes each).
///
/// In this layout the descriptor's SBO is the distance between 8-row groups (`8 * span`, 1024
/// bytes for 128B swizzle); LBO is not used by the hardware for swizzled K-major operands and is
/// encoded as 16 bytes (field value 1), as in the H200 examples. A `wgmma` step along K
/// (k16 bf16, k32 e4m3: 32 bytes) moves the start address by 32 bytes inside the span.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KMajorTile {
    dtype: WgmmaDtype,
    swizzle: Swizzle,
    base: u32,
    rows: u32,
    k: u32,
}

/// The LBO encoded for swizzled K-major operands (ignored by the hardware).
pub const K_MAJOR_SWIZZLED_LBO: u32 = 16;

impl KMajorTile {
    /// A tile of `rows x k` elements at shared-memory address `base`. `base` must sit on the
    /// swizzle pattern boundary (1024 bytes for 128B), so the base offset is 0; `rows` a multiple
    /// of 8; `k` a multiple of the span in elements (128 bytes: 64 bf16 or 128 e4m3).
    pub fn new(dtype: WgmmaDtype, swizzle: Swizzle, base: u32, rows: u32, k: u32) -> Result<Self> {
        let Some(span) = swizzle.span_bytes() else {
            return Err(DescError::TileShape(
                "a K-major tile helper needs a swizzled layout (32B, 64B or 128B)".into(),
            ));
        };
        let align = swizzle.pattern_bytes();
        if !base.is_multiple_of(align) {
            return Err(DescError::TileAlignment {
                address: u64::from(base),
                align,
            });
        }
        if rows == 0 || !rows.is_multiple_of(8) {
            return Err(DescError::TileShape(format!(
                "{rows} rows is not a positive multiple of 8"
            )));
        }
        let k_bytes = u64::from(k) * u64::from(dtype.elem_bytes());
        if k == 0 || !k_bytes.is_multiple_of(u64::from(span)) {
            return Err(DescError::TileShape(format!(
                "K = {k} {} elements ({k_bytes} bytes) is not a positive multiple of the {span}-byte swizzle span",
                dtype.ptx()
            )));
        }
        let tile = KMajorTile {
            dtype,
            swizzle,
            base,
            rows,
            k,
        };
        // The whole tile must be addressable by the descriptor.
        let end = u64::from(base) + tile.bytes();
        if end > BYTE_FIELD_LIMIT {
            return Err(DescError::OutOfRange {
                field: "start_address",
                value: end,
            });
        }
        Ok(tile)
    }

    /// The operand type.
    pub fn dtype(&self) -> WgmmaDtype {
        self.dtype
    }

    /// Rows (M or N extent).
    pub fn rows(&self) -> u32 {
        self.rows
    }

    /// K extent in elements.
    pub fn k(&self) -> u32 {
        self.k
    }

    /// The swizzle span in bytes.
    pub fn span_bytes(&self) -> u32 {
        self.swizzle.span_bytes().unwrap_or(16)
    }

    /// Size in bytes (`rows * k * elem_bytes`).
    pub fn bytes(&self) -> u64 {
        u64::from(self.rows) * u64::from(self.k) * u64::from(self.dtype.elem_bytes())
    }

    /// K elements per swizzle span (one TMA box's inner dimension).
    pub fn box_k(&self) -> u32 {
        self.span_bytes() / self.dtype.elem_bytes()
    }

    /// `wgmma` steps along K over the tile.
    pub fn k_steps(&self) -> u32 {
        self.k / self.dtype.k()
    }

    /// The stride dimension byte offset: 8 rows of the span.
    pub fn sbo(&self) -> u32 {
        8 * self.span_bytes()
    }

    /// The descriptor of the operand starting at row `row0` (a multiple of 8; 64-row blocks for
    /// an A operand) for `wgmma` K step `k_step`.
    pub fn desc(&self, row0: u32, k_step: u32) -> Result<SmemDesc> {
        if !row0.is_multiple_of(8) || row0 >= self.rows {
            return Err(DescError::TileShape(format!(
                "row {row0} is not an 8-row group of a {}-row tile",
                self.rows
            )));
        }
        if k_step >= self.k_steps() {
            return Err(DescError::TileShape(format!(
                "K step {k_step} is outside the tile's {} steps",
                self.k_steps()
            )));
        }
        let span = u64::from(self.span_bytes());
        let k_byte = u64::from(k_step) * u64::from(self.dtype.k() * self.dtype.elem_bytes());
        let atom = k_byte / span;
        let inside = k_byte % span;
        let address = u64::from(self.base)
            + atom * u64::from(self.rows) * span
            + u64::from(row0) * span
            + inside;
        SmemDesc::new(
            address,
            u64::from(K_MAJOR_SWIZZLED_LBO),
            u64::from(self.sbo()),
            0,
            self.swizzle,
        )
    }
}

// ---------------------------------------------------------------------------------------------
// TMA tiled tensor map parameters
// ---------------------------------------------------------------------------------------------

/// `CUtensorMapDataType`, with the driver header's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum TensorMapDataType {
    /// `CU_TENSOR_MAP_DATA_TYPE_UINT8`.
    Uint8 = 0,
    /// `CU_TENSOR_MAP_DATA_TYPE_UINT16`.
    Uint16 = 1,
    /// `CU_TENSOR_MAP_DATA_TYPE_UINT32`.
    Uint32 = 2,
    /// `CU_TENSOR_MAP_DATA_TYPE_INT32`.
    Int32 = 3,
    /// `CU_TENSOR_MAP_DATA_TYPE_UINT64`.
    Uint64 = 4,
    /// `CU_TENSOR_MAP_DATA_TYPE_INT64`.
    Int64 = 5,
    /// `CU_TENSOR_MAP_DATA_TYPE_FLOAT16`.
    Float16 = 6,
    /// `CU_TENSOR_MAP_DATA_TYPE_FLOAT32`.
    Float32 = 7,
    /// `CU_TENSOR_MAP_DATA_TYPE_FLOAT64`.
    Float64 = 8,
    /// `CU_TENSOR_MAP_DATA_TYPE_BFLOAT16`.
    Bfloat16 = 9,
    /// `CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ`.
    Float32Ftz = 10,
    /// `CU_TENSOR_MAP_DATA_TYPE_TFLOAT32`.
    Tfloat32 = 11,
    /// `CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ`.
    Tfloat32Ftz = 12,
    /// `CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN8B` (packed 4-bit, CUDA 12.8+).
    U4x16Align8B = 13,
    /// `CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B` (packed 4-bit, CUDA 12.8+).
    U4x16Align16B = 14,
    /// `CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B` (packed 6-bit, CUDA 12.8+).
    U6x16Align16B = 15,
}

impl TensorMapDataType {
    /// The driver enum's integer.
    pub fn raw(self) -> u32 {
        self as u32
    }

    /// Bytes per element; `None` for the packed sub-byte types.
    pub fn elem_bytes(self) -> Option<u64> {
        use TensorMapDataType::*;
        match self {
            Uint8 => Some(1),
            Uint16 | Float16 | Bfloat16 => Some(2),
            Uint32 | Int32 | Float32 | Float32Ftz | Tfloat32 | Tfloat32Ftz => Some(4),
            Uint64 | Int64 | Float64 => Some(8),
            U4x16Align8B | U4x16Align16B | U6x16Align16B => None,
        }
    }

    /// Whether it is a floating-point type (the NaN out-of-bounds fill needs one).
    pub fn is_float(self) -> bool {
        use TensorMapDataType::*;
        matches!(
            self,
            Float16 | Float32 | Float64 | Bfloat16 | Float32Ftz | Tfloat32 | Tfloat32Ftz
        )
    }
}

/// `CUtensorMapInterleave`, with the driver header's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum TensorMapInterleave {
    /// `CU_TENSOR_MAP_INTERLEAVE_NONE`.
    None = 0,
    /// `CU_TENSOR_MAP_INTERLEAVE_16B`.
    B16 = 1,
    /// `CU_TENSOR_MAP_INTERLEAVE_32B`.
    B32 = 2,
}

impl TensorMapInterleave {
    /// The driver enum's integer.
    pub fn raw(self) -> u32 {
        self as u32
    }
}

/// `CUtensorMapL2promotion`, with the driver header's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum L2Promotion {
    /// `CU_TENSOR_MAP_L2_PROMOTION_NONE`.
    None = 0,
    /// `CU_TENSOR_MAP_L2_PROMOTION_L2_64B`.
    B64 = 1,
    /// `CU_TENSOR_MAP_L2_PROMOTION_L2_128B`.
    B128 = 2,
    /// `CU_TENSOR_MAP_L2_PROMOTION_L2_256B`.
    B256 = 3,
}

impl L2Promotion {
    /// The driver enum's integer.
    pub fn raw(self) -> u32 {
        self as u32
    }
}

/// `CUtensorMapFloatOOBfill`, with the driver header's values. Out-of-bounds elements of a box
/// are zero with `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum OobFill {
    /// `CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE`: zero fill.
    None = 0,
    /// `CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA`.
    NanRequestZeroFma = 1,
}

impl OobFill {
    /// The driver enum's integer.
    pub fn raw(self) -> u32 {
        self as u32
    }
}

/// The most dimensions a tensor map has.
pub const TMA_MAX_RANK: usize = 5;

/// The arguments of `cuTensorMapEncodeTiled` (everything but the output map), host side.
/// Dimension 0 is the innermost; `global_strides[i]` is the byte stride of dimension `i + 1`
/// (the innermost stride is the element size, implicit). Entries past `rank` are ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorMapParams {
    /// Element type.
    pub data_type: TensorMapDataType,
    /// Number of dimensions, 1..=5.
    pub rank: u32,
    /// Device address of the tensor's first element (16-byte aligned).
    pub global_address: u64,
    /// Extents, innermost first.
    pub global_dim: [u64; TMA_MAX_RANK],
    /// Byte strides of dimensions 1..rank.
    pub global_strides: [u64; TMA_MAX_RANK - 1],
    /// Box extents in elements, innermost first.
    pub box_dim: [u32; TMA_MAX_RANK],
    /// Element strides (traversal step) per dimension.
    pub element_strides: [u32; TMA_MAX_RANK],
    /// Interleave (only `None` is accepted by [`validate`](Self::validate)).
    pub interleave: TensorMapInterleave,
    /// Shared-memory swizzle of the box.
    pub swizzle: Swizzle,
    /// L2 sector promotion.
    pub l2_promotion: L2Promotion,
    /// Out-of-bounds fill.
    pub oob_fill: OobFill,
}

/// The aliasing rule of a tensor map whose innermost dimension spans `inner` bytes and whose
/// other dimensions have `extents` and byte `strides`: taken in order of their strides (any
/// order of dimensions: a recipe's row modes need not nest), each dimension's stride clears the
/// span of those with smaller ones. A dimension of extent 1 never steps and is left out (an
/// expert dimension of one expert, a GEMM of one row). Errors name the first stride that does not
/// clear (`TmaStrideOverlap`, its index into `strides`).
pub fn strides_nest(inner: u64, extents: &[u64], strides: &[u64]) -> Result<()> {
    let mut order: Vec<usize> = (0..strides.len().min(extents.len()))
        .filter(|&i| extents[i] > 1)
        .collect();
    order.sort_by_key(|&i| strides[i]);
    let mut span = inner;
    for index in order {
        let value = strides[index];
        if value < span {
            return Err(DescError::TmaStrideOverlap {
                index,
                value,
                min: span,
            });
        }
        span = value.saturating_mul(extents[index]);
    }
    Ok(())
}

impl TensorMapParams {
    /// `global_dim[..rank]`.
    pub fn dims(&self) -> &[u64] {
        &self.global_dim[..self.rank_usize()]
    }

    /// `global_strides[..rank - 1]`.
    pub fn strides(&self) -> &[u64] {
        &self.global_strides[..self.rank_usize().saturating_sub(1)]
    }

    /// `box_dim[..rank]`.
    pub fn box_dims(&self) -> &[u32] {
        &self.box_dim[..self.rank_usize()]
    }

    /// `element_strides[..rank]`.
    pub fn elem_strides(&self) -> &[u32] {
        &self.element_strides[..self.rank_usize()]
    }

    fn rank_usize(&self) -> usize {
        (self.rank as usize).min(TMA_MAX_RANK)
    }

    /// Bytes one box writes to shared memory (what `mbarrier.expect_tx` counts, the same at the
    /// tensor's edges); 0 for packed types.
    pub fn box_bytes(&self) -> u64 {
        let eb = self.data_type.elem_bytes().unwrap_or(0);
        self.box_dims()
            .iter()
            .map(|&b| u64::from(b))
            .product::<u64>()
            * eb
    }

    /// Checks the driver's documented constraints of `cuTensorMapEncodeTiled` for a
    /// non-interleaved map of a non-packed type.
    pub fn validate(&self) -> Result<()> {
        if self.rank == 0 || self.rank as usize > TMA_MAX_RANK {
            return Err(DescError::TmaRank(self.rank));
        }
        let Some(eb) = self.data_type.elem_bytes() else {
            return Err(DescError::TmaPackedType(self.data_type));
        };
        if self.interleave != TensorMapInterleave::None {
            return Err(DescError::TmaInterleave(self.interleave));
        }
        if !self.global_address.is_multiple_of(16) {
            return Err(DescError::TmaAddressAlignment(self.global_address));
        }
        for (dim, &value) in self.dims().iter().enumerate() {
            if value == 0 || value > 1 << 32 {
                return Err(DescError::TmaGlobalDim { dim, value });
            }
        }
        for (index, &value) in self.strides().iter().enumerate() {
            if !value.is_multiple_of(16) || value >= 1 << 40 {
                return Err(DescError::TmaGlobalStride { index, value });
            }
        }
        strides_nest(self.global_dim[0] * eb, &self.dims()[1..], self.strides())?;
        for (dim, &value) in self.box_dims().iter().enumerate() {
            if value == 0 || value > 256 {
                return Err(DescError::TmaBoxDim { dim, value });
            }
        }
        let inner_bytes = u64::from(self.box_dim[0]) * eb;
        if !inner_bytes.is_multiple_of(16) {
            return Err(DescError::TmaBoxInnerBytes(inner_bytes));
        }
        if let Some(span) = self.swizzle.span_bytes() {
            if inner_bytes > u64::from(span) {
                return Err(DescError::TmaSwizzleSpan {
                    bytes: inner_bytes,
                    span,
                });
            }
        }
        for (dim, &value) in self.elem_strides().iter().enumerate() {
            if value == 0 || value > 8 {
                return Err(DescError::TmaElementStride { dim, value });
            }
        }
        if self.oob_fill == OobFill::NanRequestZeroFma && !self.data_type.is_float() {
            return Err(DescError::TmaOobFillType(self.data_type));
        }
        Ok(())
    }

    /// A rank-2 K-major map of a row-major `[rows, k]` operand at `global_address`: dimensions
    /// `{k, rows}`, box `{span / elem_bytes, box_rows}` with the given swizzle, element strides 1,
    /// no interleave, L2 256B promotion, zero out-of-bounds fill. TMA coordinates are
    /// `{k0, row0}`. Validated.
    pub fn k_major(
        dtype: WgmmaDtype,
        swizzle: Swizzle,
        global_address: u64,
        rows: u64,
        k: u64,
        box_rows: u32,
    ) -> Result<Self> {
        let params = Self::k_major_inner(dtype, swizzle, global_address, &[k, rows], box_rows)?;
        params.validate()?;
        Ok(params)
    }

    /// A rank-3 K-major map of an expert tensor `[experts, rows, k]` (e.g. `w13_weight [E, 2I, H]`):
    /// dimensions `{k, rows, experts}`, box `{span / elem_bytes, box_rows, 1}`, so one box is a
    /// `box_rows x span` tile of one expert and rows past an expert's end are zero-filled instead
    /// of read from the next expert. TMA coordinates are `{k0, row0, expert}`. Validated.
    pub fn expert_k_major(
        dtype: WgmmaDtype,
        swizzle: Swizzle,
        global_address: u64,
        experts: u64,
        rows: u64,
        k: u64,
        box_rows: u32,
    ) -> Result<Self> {
        let params = Self::k_major_inner(
            dtype,
            swizzle,
            global_address,
            &[k, rows, experts],
            box_rows,
        )?;
        params.validate()?;
        Ok(params)
    }

    /// A K-major weight map with the recipe's own row modes (`super::wmap::WLayout`): dimensions
    /// `{k, extents..}` with byte strides `strides` (one per extent, in any order that does not
    /// alias), box `{span / elem_bytes, boxes..}`, zero out-of-bounds fill. Validated.
    pub fn strided_k_major(
        dtype: WgmmaDtype,
        swizzle: Swizzle,
        global_address: u64,
        k: u64,
        extents: &[u64],
        strides: &[u64],
        boxes: &[u32],
    ) -> Result<Self> {
        if extents.len() != strides.len()
            || extents.len() != boxes.len()
            || extents.len() + 1 > TMA_MAX_RANK
        {
            return Err(DescError::TmaRank(extents.len() as u32 + 1));
        }
        let mut dims = vec![k];
        dims.extend_from_slice(extents);
        let mut params = Self::k_major_inner(dtype, swizzle, global_address, &dims, 8)?;
        params.global_strides[..strides.len()].copy_from_slice(strides);
        params.box_dim[1..1 + boxes.len()].copy_from_slice(boxes);
        params.validate()?;
        Ok(params)
    }

    /// A rank-3 map of an expert tensor of bytes `[experts, rows, k]` (int8 or 4-bit weight codes,
    /// `k` the bytes of a row: K padded to 64 for int8, K / 2 for 4-bit):
    /// dimensions `{k, rows, experts}`, box `{span, box_rows, 1}` with no swizzle (a box lands
    /// row-major, `span` bytes a row), zero out-of-bounds fill. TMA coordinates are
    /// `{k0, row0, expert}`. Validated.
    pub fn expert_rows_u8(
        global_address: u64,
        experts: u64,
        rows: u64,
        k: u64,
        span: u32,
        box_rows: u32,
    ) -> Result<Self> {
        Self::unswizzled(
            TensorMapDataType::Uint8,
            global_address,
            &[k, rows, experts],
            &[span, box_rows, 1],
            L2Promotion::B256,
        )
    }

    /// A rank-3 map of an expert tensor of group scales `[experts, tiles, rows]` (4-bit weights'
    /// scales: each element one row's scales of one k-tile, `elem_bytes` 1, 2, 4 or 8; weight rows
    /// innermost): dimensions `{rows, tiles, experts}`, box `{box_rows, 1, 1}` with no swizzle (a
    /// box lands row-major), zero out-of-bounds fill. TMA coordinates are `{row0, tile,
    /// expert}`. Validated.
    pub fn expert_group_scales(
        global_address: u64,
        experts: u64,
        tiles: u64,
        rows: u64,
        elem_bytes: u32,
        box_rows: u32,
    ) -> Result<Self> {
        let data_type = match elem_bytes {
            8 => TensorMapDataType::Uint64,
            4 => TensorMapDataType::Uint32,
            2 => TensorMapDataType::Uint16,
            _ => TensorMapDataType::Uint8,
        };
        Self::unswizzled(
            data_type,
            global_address,
            &[rows, tiles, experts],
            &[box_rows, 1, 1],
            L2Promotion::B256,
        )
    }

    /// A rank-1 map of `len` f32 at `global_address` (a scale buffer), boxes of `box_elems`
    /// elements (a multiple of 4: 16 bytes), no swizzle, zero out-of-bounds fill. The TMA
    /// coordinate is the first element's index; it must be a multiple of 4 too (a box that starts
    /// off 16 bytes is an illegal instruction on the H200); a box reaching past `len` reads zeros
    /// there. Validated.
    pub fn f32_vector(global_address: u64, len: u64, box_elems: u32) -> Result<Self> {
        Self::unswizzled(
            TensorMapDataType::Float32,
            global_address,
            &[len],
            &[box_elems],
            L2Promotion::None,
        )
    }

    /// A dense, unswizzled map of `dims` (innermost first; strides from the element size) with
    /// boxes `boxes`, element strides 1, zero out-of-bounds fill. Validated.
    fn unswizzled(
        data_type: TensorMapDataType,
        global_address: u64,
        dims: &[u64],
        boxes: &[u32],
        l2_promotion: L2Promotion,
    ) -> Result<Self> {
        let params = Self::dense(
            data_type,
            global_address,
            dims,
            boxes,
            Swizzle::None,
            l2_promotion,
        );
        params.validate()?;
        Ok(params)
    }

    /// A dense map of `dims` (innermost first; each stride the product of the inner dimensions
    /// and the element size) with boxes `boxes`, element strides 1, no interleave, zero
    /// out-of-bounds fill. Not validated.
    fn dense(
        data_type: TensorMapDataType,
        global_address: u64,
        dims: &[u64],
        boxes: &[u32],
        swizzle: Swizzle,
        l2_promotion: L2Promotion,
    ) -> Self {
        let eb = data_type.elem_bytes().unwrap_or(1);
        let mut global_dim = [1u64; TMA_MAX_RANK];
        global_dim[..dims.len()].copy_from_slice(dims);
        let mut global_strides = [0u64; TMA_MAX_RANK - 1];
        let mut stride = eb;
        for i in 0..dims.len().saturating_sub(1) {
            stride = stride.saturating_mul(dims[i]);
            global_strides[i] = stride;
        }
        let mut box_dim = [1u32; TMA_MAX_RANK];
        box_dim[..boxes.len()].copy_from_slice(boxes);
        TensorMapParams {
            data_type,
            rank: dims.len() as u32,
            global_address,
            global_dim,
            global_strides,
            box_dim,
            element_strides: [1; TMA_MAX_RANK],
            interleave: TensorMapInterleave::None,
            swizzle,
            l2_promotion,
            oob_fill: OobFill::None,
        }
    }

    fn k_major_inner(
        dtype: WgmmaDtype,
        swizzle: Swizzle,
        global_address: u64,
        dims: &[u64],
        box_rows: u32,
    ) -> Result<Self> {
        let Some(span) = swizzle.span_bytes() else {
            return Err(DescError::TileShape(
                "a K-major operand map needs a swizzled layout (32B, 64B or 128B)".into(),
            ));
        };
        if box_rows == 0 || !box_rows.is_multiple_of(8) {
            return Err(DescError::TileShape(format!(
                "a box of {box_rows} rows is not a positive multiple of 8"
            )));
        }
        Ok(Self::dense(
            dtype.tensor_map_data_type(),
            global_address,
            dims,
            &[span / dtype.elem_bytes(), box_rows],
            swizzle,
            L2Promotion::B256,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The int8 weight map: `{k, rows, experts}` bytes, unswizzled boxes of `span` bytes by
    /// `box_rows`; a span off 16 bytes is refused; the 1-D f32 map of a scale buffer.
    #[test]
    fn byte_and_vector_maps() -> Result<()> {
        let m = TensorMapParams::expert_rows_u8(1 << 20, 8, 4096, 7168, 64, 64)?;
        assert_eq!(
            (m.rank, m.dims(), m.strides()),
            (3, &[7168, 4096, 8][..], &[7168, 7168 * 4096][..])
        );
        assert_eq!((m.box_dims(), m.swizzle), (&[64, 64, 1][..], Swizzle::None));
        assert!(TensorMapParams::expert_rows_u8(1 << 20, 8, 4096, 7168, 24, 64).is_err());
        let v = TensorMapParams::f32_vector(1 << 20, 1000, 132)?;
        assert_eq!(
            (v.rank, v.dims(), v.box_dims()),
            (1, &[1000][..], &[132][..])
        );
        assert!(TensorMapParams::f32_vector(1 << 20, 1000, 6).is_err());
        Ok(())
    }

    /// A weight map with the recipe's row modes: strides in any order that does not alias are
    /// taken (`[gate; up]` rows in the paired order: 8 rows, the halves `I` rows apart, blocks
    /// of 8), one whose rows would overlap is refused, and a box per dimension.
    #[test]
    fn strided_weight_maps() -> Result<()> {
        let row = 7168 * 2;
        let (i, e) = (2048u64, 32u64);
        let m = TensorMapParams::strided_k_major(
            WgmmaDtype::Bf16,
            Swizzle::B128,
            1 << 20,
            7168,
            &[8, 2, i / 8, e],
            &[row, i * row, 8 * row, 2 * i * row],
            &[8, 2, 4, 1],
        )?;
        assert_eq!((m.rank, m.box_dims()), (5, &[64, 8, 2, 4, 1][..]));
        assert_eq!(m.strides(), &[row, i * row, 8 * row, 2 * i * row][..]);
        // Blocks of 8 rows 4 rows apart overlap.
        let bad = TensorMapParams::strided_k_major(
            WgmmaDtype::Bf16,
            Swizzle::B128,
            1 << 20,
            7168,
            &[8, 2, i / 8, e],
            &[row, i * row, 4 * row, 2 * i * row],
            &[8, 2, 4, 1],
        );
        assert!(
            matches!(bad, Err(DescError::TmaStrideOverlap { .. })),
            "{bad:?}"
        );
        // Extents, strides and boxes must agree in number.
        assert!(TensorMapParams::strided_k_major(
            WgmmaDtype::Bf16,
            Swizzle::B128,
            1 << 20,
            7168,
            &[8, 2],
            &[row],
            &[8, 2],
        )
        .is_err());
        Ok(())
    }

    // ---- shared-memory descriptor: exact bit patterns -------------------------------------

    /// The H200 examples (gemm-examples/sm90_{bf16,e4m3,rs}_generated.ptx, line 8, and
    /// sm90_warpspec_syntax.ptx line 34) build every descriptor as
    /// `lo = (smem_addr >> 4) | 0x10000`, `hi = 0x40000040` (`mov.b64 %rd, {lo, hi}`): LBO 16 B,
    /// SBO 1024 B, 128B swizzle. At shared address 0 that is this constant.
    #[test]
    fn example_descriptor_at_address_zero() -> Result<()> {
        let d = SmemDesc::new(0, 16, 1024, 0, Swizzle::B128)?;
        assert_eq!(d.encode(), 0x4000_0040_0001_0000);
        assert_eq!(d.hi32(), 0x4000_0040);
        assert_eq!(d.lo32(), 0x0001_0000);
        Ok(())
    }

    /// The examples' formula for any 1024-aligned tile, and their K loop: the low word + 2 per
    /// k16 (bf16) or k32 (e4m3) step (`add.u32 %r7,%r4,{0,2,4,6}`), hi unchanged.
    #[test]
    fn example_descriptor_formula_and_k_steps() -> Result<()> {
        for dtype in [WgmmaDtype::Bf16, WgmmaDtype::E4m3] {
            for base in [0u32, 0x400, 0x2000, 0x6000, 0x3_0000] {
                // A: 64 rows x 128 B; B: 128 rows x 128 B, as the harness's boxes.
                for rows in [64, 128] {
                    let k = 128 / dtype.elem_bytes();
                    let tile = KMajorTile::new(dtype, Swizzle::B128, base, rows, k)?;
                    assert_eq!(tile.k_steps(), 4);
                    let lo0 = (base >> 4) | 0x10000;
                    for s in 0..4 {
                        let d = tile.desc(0, s)?;
                        assert_eq!(d.lo32(), lo0 + 2 * s, "{dtype:?} base {base:#x} step {s}");
                        assert_eq!(d.hi32(), 0x4000_0040);
                        assert_eq!(d.encode(), (0x4000_0040u64 << 32) | u64::from(lo0 + 2 * s));
                    }
                }
            }
        }
        Ok(())
    }

    /// GEMM.md 1.5: the next 64-row A sub-tile of a 128-row SW128 tile is lo + 512.
    #[test]
    fn next_64_row_block_is_lo_plus_512() -> Result<()> {
        let tile = KMajorTile::new(WgmmaDtype::Bf16, Swizzle::B128, 0x1000, 128, 64)?;
        assert_eq!(tile.desc(64, 0)?.lo32(), tile.desc(0, 0)?.lo32() + 512);
        assert_eq!(tile.desc(64, 3)?.encode(), 0x4000_0040_0001_0306);
        Ok(())
    }

    /// A tile two spans wide along K (bf16 BLOCK_K = 128): steps 4..8 read the second box,
    /// `rows * 128` bytes further.
    #[test]
    fn second_k_atom_follows_the_first_box() -> Result<()> {
        let tile = KMajorTile::new(WgmmaDtype::Bf16, Swizzle::B128, 0, 128, 128)?;
        assert_eq!(tile.k_steps(), 8);
        assert_eq!(tile.box_k(), 64);
        assert_eq!(tile.desc(0, 4)?.start_address(), 128 * 128);
        assert_eq!(tile.desc(8, 5)?.start_address(), 128 * 128 + 8 * 128 + 32);
        Ok(())
    }

    /// SBO per swizzle mode for K-major tiles: 8 rows of the span; 32B/64B layouts encode 3/2.
    #[test]
    fn k_major_sbo_and_layout_per_swizzle() -> Result<()> {
        let t32 = KMajorTile::new(WgmmaDtype::Bf16, Swizzle::B32, 0, 64, 16)?;
        assert_eq!(t32.desc(0, 0)?.encode(), 0xC000_0010_0001_0000);
        let t64 = KMajorTile::new(WgmmaDtype::E4m3, Swizzle::B64, 0x200, 64, 64)?;
        assert_eq!(t64.desc(0, 1)?.encode(), 0x8000_0020_0001_0022);
        Ok(())
    }

    /// Each field alone at its maximum lands on exactly the ISA's bits.
    #[test]
    fn fields_land_on_the_isa_bits() -> Result<()> {
        let max = (1u64 << 18) - 16;
        assert_eq!(SmemDesc::new(max, 0, 0, 0, Swizzle::None)?.encode(), 0x3FFF);
        assert_eq!(
            SmemDesc::new(0, max, 0, 0, Swizzle::None)?.encode(),
            0x3FFF_0000
        );
        assert_eq!(
            SmemDesc::new(0, 0, max, 0, Swizzle::None)?.encode(),
            0x3FFF_0000_0000
        );
        assert_eq!(
            SmemDesc::new(0, 0, 0, 7, Swizzle::B128)?.encode(),
            0x400E_0000_0000_0000
        );
        let layout = |s| SmemDesc::new(0, 0, 0, 0, s).map(|d| d.encode());
        assert_eq!(layout(Swizzle::None)?, 0);
        assert_eq!(layout(Swizzle::B128)?, 0x4000_0000_0000_0000);
        assert_eq!(layout(Swizzle::B64)?, 0x8000_0000_0000_0000);
        assert_eq!(layout(Swizzle::B32)?, 0xC000_0000_0000_0000);
        Ok(())
    }

    /// PTX ISA: base offset = (pattern start >> 7) & 7 off the 1024/512/256-byte boundary.
    #[test]
    fn base_offset_rule() {
        assert_eq!(Swizzle::B128.base_offset_for(0x400), 0);
        assert_eq!(Swizzle::B128.base_offset_for(0x480), 1);
        assert_eq!(Swizzle::B128.base_offset_for(0x780), 7);
        assert_eq!(Swizzle::B64.base_offset_for(0x200), 0);
        assert_eq!(Swizzle::B64.base_offset_for(0x280), 5);
        assert_eq!(Swizzle::B32.base_offset_for(0x100), 0);
        assert_eq!(Swizzle::None.base_offset_for(0x80), 0);
        assert_eq!(
            [256, 512, 1024],
            [
                Swizzle::B32.pattern_bytes(),
                Swizzle::B64.pattern_bytes(),
                Swizzle::B128.pattern_bytes()
            ]
        );
    }

    #[test]
    fn validation_errors() {
        assert_eq!(
            SmemDesc::new(8, 16, 1024, 0, Swizzle::B128),
            Err(DescError::Misaligned {
                field: "start_address",
                value: 8
            })
        );
        assert_eq!(
            SmemDesc::new(0, 24, 1024, 0, Swizzle::B128),
            Err(DescError::Misaligned {
                field: "leading_byte_offset",
                value: 24
            })
        );
        assert_eq!(
            SmemDesc::new(0, 16, 1 << 18, 0, Swizzle::B128),
            Err(DescError::OutOfRange {
                field: "stride_byte_offset",
                value: 1 << 18
            })
        );
        assert_eq!(
            SmemDesc::new(1 << 18, 16, 1024, 0, Swizzle::B128),
            Err(DescError::OutOfRange {
                field: "start_address",
                value: 1 << 18
            })
        );
        assert_eq!(
            SmemDesc::new(0, 16, 1024, 8, Swizzle::B128),
            Err(DescError::BaseOffsetRange(8))
        );
        assert_eq!(
            SmemDesc::new(0, 16, 1024, 1, Swizzle::None),
            Err(DescError::BaseOffsetWithoutSwizzle(1))
        );
        assert!(matches!(
            KMajorTile::new(WgmmaDtype::Bf16, Swizzle::B128, 0x200, 64, 64),
            Err(DescError::TileAlignment {
                address: 0x200,
                align: 1024
            })
        ));
        assert!(KMajorTile::new(WgmmaDtype::Bf16, Swizzle::B128, 0, 60, 64).is_err());
        assert!(KMajorTile::new(WgmmaDtype::Bf16, Swizzle::B128, 0, 64, 48).is_err());
        assert!(KMajorTile::new(WgmmaDtype::Bf16, Swizzle::None, 0, 64, 64).is_err());
        assert!(KMajorTile::new(WgmmaDtype::Bf16, Swizzle::B128, 0x3_F000, 64, 64).is_err());
        let tile = KMajorTile::new(WgmmaDtype::E4m3, Swizzle::B128, 0, 64, 128);
        assert!(tile
            .as_ref()
            .map(|t| t.desc(4, 0).is_err())
            .unwrap_or(false));
        assert!(tile
            .as_ref()
            .map(|t| t.desc(64, 0).is_err())
            .unwrap_or(false));
        assert!(tile
            .as_ref()
            .map(|t| t.desc(0, 4).is_err())
            .unwrap_or(false));
    }

    /// The sm_100 descriptor of gemm-examples/sm100a_syntax.ptx (`0x4000404000010000`: version bit
    /// 46 set, GEMM.md 5) is not an sm_90 descriptor: decode names the reserved bit.
    #[test]
    fn decode_rejects_reserved_bits() {
        assert_eq!(
            SmemDesc::decode(0x4000_4040_0001_0000),
            Err(DescError::ReservedBits {
                value: 0x4000_4040_0001_0000,
                bits: 1 << 46
            })
        );
        for bit in [14, 15, 30, 31, 46, 47, 48, 52, 55, 61] {
            assert!(SmemDesc::decode(1u64 << bit).is_err(), "bit {bit}");
        }
        assert!(SmemDesc::decode(0x0002_0000_0000_0000).is_err()); // base offset, no swizzle
    }

    #[test]
    fn decode_example_constant() -> Result<()> {
        let d = SmemDesc::decode(0x4000_0040_0001_0206)?;
        assert_eq!(d.start_address(), 0x2060);
        assert_eq!(d.leading_byte_offset(), 16);
        assert_eq!(d.stride_byte_offset(), 1024);
        assert_eq!(d.base_offset(), 0);
        assert_eq!(d.swizzle(), Swizzle::B128);
        Ok(())
    }

    fn swizzle_strategy() -> impl Strategy<Value = Swizzle> {
        prop_oneof![
            Just(Swizzle::None),
            Just(Swizzle::B32),
            Just(Swizzle::B64),
            Just(Swizzle::B128)
        ]
    }

    proptest! {
        #[test]
        fn encode_decode_round_trip(
            a in 0u64..(1 << 14),
            l in 0u64..(1 << 14),
            s in 0u64..(1 << 14),
            b in 0u8..8,
            sw in swizzle_strategy(),
        ) {
            let b = if sw == Swizzle::None { 0 } else { b };
            let d = SmemDesc::new(a << 4, l << 4, s << 4, b, sw);
            prop_assert!(d.is_ok());
            let d = d.map_err(|e| TestCaseError::fail(e.to_string()))?;
            let v = d.encode();
            // Independent reading of the ISA table.
            prop_assert_eq!(v & 0x3FFF, a);
            prop_assert_eq!((v >> 16) & 0x3FFF, l);
            prop_assert_eq!((v >> 32) & 0x3FFF, s);
            prop_assert_eq!((v >> 49) & 7, u64::from(b));
            prop_assert_eq!(v >> 62, sw.sm90_layout_type());
            prop_assert_eq!(v & !DEFINED_BITS, 0);
            prop_assert_eq!(SmemDesc::decode(v), Ok(d));
        }

        #[test]
        fn decode_encode_round_trip(raw in any::<u64>()) {
            let v = raw & DEFINED_BITS;
            match SmemDesc::decode(v) {
                Ok(d) => prop_assert_eq!(d.encode(), v),
                // Only a base offset without swizzle is refused among defined bits.
                Err(e) => prop_assert_eq!(e, DescError::BaseOffsetWithoutSwizzle(((v >> 49) & 7) as u8)),
            }
            if raw != v {
                let refused = matches!(SmemDesc::decode(raw), Err(DescError::ReservedBits { .. }));
                prop_assert!(refused);
            }
        }

        #[test]
        fn k_major_descs_stay_in_the_tile(
            bf16 in any::<bool>(),
            groups in 1u32..=32,
            atoms in 1u32..=4,
            base_blocks in 0u32..64,
        ) {
            let dtype = if bf16 { WgmmaDtype::Bf16 } else { WgmmaDtype::E4m3 };
            let rows = 8 * groups;
            let k = atoms * 128 / dtype.elem_bytes();
            let base = base_blocks * 1024;
            if let Ok(tile) = KMajorTile::new(dtype, Swizzle::B128, base, rows, k) {
                for row0 in (0..rows).step_by(8) {
                    for step in 0..tile.k_steps() {
                        let d = tile.desc(row0, step).map_err(|e| TestCaseError::fail(e.to_string()))?;
                        let off = u64::from(d.start_address() - base);
                        prop_assert!(off + 32 <= tile.bytes());
                        prop_assert_eq!(d.stride_byte_offset(), 1024);
                        prop_assert_eq!(d.hi32(), 0x4000_0040);
                    }
                }
            } else {
                prop_assert!(u64::from(base) + u64::from(rows) * u64::from(atoms) * 128 > 1 << 18);
            }
        }
    }

    // ---- wgmma shapes -----------------------------------------------------------------------

    #[test]
    fn wgmma_shape_list() {
        for dtype in [WgmmaDtype::Bf16, WgmmaDtype::E4m3] {
            let shapes = wgmma_shapes(dtype);
            assert_eq!(shapes.len(), 32);
            assert_eq!(shapes.first().map(|s| s.n), Some(8));
            assert_eq!(shapes.last().map(|s| s.n), Some(256));
            for (i, s) in shapes.iter().enumerate() {
                assert_eq!((s.m, s.n, s.k), (64, 8 * (i as u32 + 1), dtype.k()));
                assert_eq!(s.accumulator_registers(), s.n / 2);
                assert_eq!(WgmmaShape::new(dtype, s.n).as_ref(), Ok(s));
            }
        }
        // The examples' m64n128k16 / m64n128k32 use {%f0..%f63}: 64 registers.
        let bf16 = WgmmaShape::new(WgmmaDtype::Bf16, 128);
        assert_eq!(bf16.as_ref().map(|s| s.ptx()), Ok("m64n128k16".to_string()));
        assert_eq!(bf16.map(|s| s.accumulator_registers()), Ok(64));
        let e4m3 = WgmmaShape::new(WgmmaDtype::E4m3, 128);
        assert_eq!(e4m3.map(|s| s.ptx()), Ok("m64n128k32".to_string()));
        assert_eq!(
            WgmmaShape::new(WgmmaDtype::E4m3, 8).map(|s| s.accumulator_registers()),
            Ok(4)
        );
        assert_eq!(
            WgmmaShape::new(WgmmaDtype::Bf16, 256).map(|s| s.accumulator_registers()),
            Ok(128)
        );
        for n in [0, 4, 12, 100, 264, 512] {
            assert_eq!(
                WgmmaShape::new(WgmmaDtype::Bf16, n),
                Err(DescError::WgmmaN(n))
            );
        }
    }

    // ---- TMA tensor maps --------------------------------------------------------------------

    /// The integers of the CUDA driver header (`cuda.h`, CUDA 12.8+/13.0 `CUtensorMap*` enums;
    /// identical in cudarc 0.19's `driver::sys`). The runtime's own test compares these against
    /// cudarc's sys enums.
    #[test]
    fn driver_enum_values() {
        use TensorMapDataType::*;
        let types = [
            (Uint8, 0),
            (Uint16, 1),
            (Uint32, 2),
            (Int32, 3),
            (Uint64, 4),
            (Int64, 5),
            (Float16, 6),
            (Float32, 7),
            (Float64, 8),
            (Bfloat16, 9),
            (Float32Ftz, 10),
            (Tfloat32, 11),
            (Tfloat32Ftz, 12),
            (U4x16Align8B, 13),
            (U4x16Align16B, 14),
            (U6x16Align16B, 15),
        ];
        for (t, v) in types {
            assert_eq!(t.raw(), v, "{t:?}");
        }
        assert_eq!(
            Swizzle::ALL.map(Swizzle::cu_tensor_map),
            [0, 1, 2, 3] // NONE, 32B, 64B, 128B
        );
        assert_eq!(
            [
                TensorMapInterleave::None.raw(),
                TensorMapInterleave::B16.raw(),
                TensorMapInterleave::B32.raw()
            ],
            [0, 1, 2]
        );
        assert_eq!(
            [
                L2Promotion::None.raw(),
                L2Promotion::B64.raw(),
                L2Promotion::B128.raw(),
                L2Promotion::B256.raw()
            ],
            [0, 1, 2, 3]
        );
        assert_eq!(
            [OobFill::None.raw(), OobFill::NanRequestZeroFma.raw()],
            [0, 1]
        );
    }

    /// The harness gemm-examples/sm90_tma_wgmma_test.py (`tmap`): rank 2, dims (K, rows),
    /// strides (K*es), box (bi, rows), element strides (1, 1), interleave 0, swizzle 3; bf16 is
    /// dtype 9 with bi = 64 at K = 128, e4m3 is dtype 0 with bi = 128 at K = 256. Its
    /// `expect_tx` is 24576 = the A box (64 rows) + the B box (128 rows).
    #[test]
    fn harness_tensor_maps() -> Result<()> {
        let addr = 0x7f00_0000_0000;
        for (dtype, k, raw_type, bi) in [
            (WgmmaDtype::Bf16, 128u64, 9u32, 64u32),
            (WgmmaDtype::E4m3, 256, 0, 128),
        ] {
            let a = TensorMapParams::k_major(dtype, Swizzle::B128, addr, 64, k, 64)?;
            let b = TensorMapParams::k_major(dtype, Swizzle::B128, addr, 128, k, 128)?;
            assert_eq!(a.data_type.raw(), raw_type);
            assert_eq!(a.rank, 2);
            assert_eq!(a.dims(), &[k, 64]);
            assert_eq!(a.strides(), &[k * u64::from(dtype.elem_bytes())]);
            assert_eq!(a.box_dims(), &[bi, 64]);
            assert_eq!(b.box_dims(), &[bi, 128]);
            assert_eq!(a.elem_strides(), &[1, 1]);
            assert_eq!(a.interleave.raw(), 0);
            assert_eq!(a.swizzle.cu_tensor_map(), 3);
            assert_eq!(a.oob_fill.raw(), 0);
            assert_eq!(a.box_bytes() + b.box_bytes(), 24576);
            // The TMA box and the wgmma tile agree: 128 bytes of K per row, 8-row atoms.
            let tile = KMajorTile::new(dtype, Swizzle::B128, 0, 64, bi)?;
            assert_eq!(tile.box_k(), bi);
            assert_eq!(tile.bytes(), a.box_bytes());
        }
        Ok(())
    }

    /// `w13_weight [E, 2I, H]` of a Qwen3-30B-A3B-like layer (E 128, I 768, H 2048), bf16 and e4m3.
    #[test]
    fn expert_tensor_map() -> Result<()> {
        let (e, rows, h) = (128u64, 2 * 768u64, 2048u64);
        let m = TensorMapParams::expert_k_major(
            WgmmaDtype::Bf16,
            Swizzle::B128,
            0x7f00_0000_0000,
            e,
            rows,
            h,
            128,
        )?;
        assert_eq!(m.rank, 3);
        assert_eq!(m.dims(), &[h, rows, e]);
        assert_eq!(m.strides(), &[h * 2, rows * h * 2]);
        assert_eq!(m.box_dims(), &[64, 128, 1]);
        assert_eq!(m.box_bytes(), 128 * 128);
        assert_eq!(m.l2_promotion.raw(), 3);
        let m8 = TensorMapParams::expert_k_major(
            WgmmaDtype::E4m3,
            Swizzle::B128,
            0x7f00_0000_0000,
            e,
            rows,
            h,
            64,
        )?;
        assert_eq!(m8.data_type, TensorMapDataType::Uint8);
        assert_eq!(m8.strides(), &[h, rows * h]);
        assert_eq!(m8.box_dims(), &[128, 64, 1]);
        assert_eq!(m8.box_bytes(), 64 * 128);
        Ok(())
    }

    fn good_map() -> Result<TensorMapParams> {
        TensorMapParams::k_major(WgmmaDtype::Bf16, Swizzle::B128, 0x1000, 256, 512, 128)
    }

    #[test]
    fn tensor_map_validation_errors() -> Result<()> {
        let g = good_map()?;
        assert_eq!(g.validate(), Ok(()));
        let check = |f: &dyn Fn(&mut TensorMapParams), want: DescError| {
            let mut m = g;
            f(&mut m);
            assert_eq!(m.validate(), Err(want));
        };
        check(&|m| m.rank = 0, DescError::TmaRank(0));
        check(&|m| m.rank = 6, DescError::TmaRank(6));
        check(
            &|m| m.global_address = 0x1008,
            DescError::TmaAddressAlignment(0x1008),
        );
        check(
            &|m| m.global_dim[1] = 0,
            DescError::TmaGlobalDim { dim: 1, value: 0 },
        );
        check(
            &|m| m.global_dim[1] = (1 << 32) + 1,
            DescError::TmaGlobalDim {
                dim: 1,
                value: (1 << 32) + 1,
            },
        );
        check(
            &|m| m.global_strides[0] = 1032,
            DescError::TmaGlobalStride {
                index: 0,
                value: 1032,
            },
        );
        check(
            &|m| {
                m.global_dim[0] = 1 << 32;
                m.global_strides[0] = 1 << 40;
            },
            DescError::TmaGlobalStride {
                index: 0,
                value: 1 << 40,
            },
        );
        check(
            &|m| m.global_strides[0] = 1008,
            DescError::TmaStrideOverlap {
                index: 0,
                value: 1008,
                min: 1024,
            },
        );
        check(
            &|m| m.box_dim[1] = 257,
            DescError::TmaBoxDim { dim: 1, value: 257 },
        );
        check(
            &|m| m.box_dim[0] = 0,
            DescError::TmaBoxDim { dim: 0, value: 0 },
        );
        check(&|m| m.box_dim[0] = 4, DescError::TmaBoxInnerBytes(8));
        check(
            &|m| m.box_dim[0] = 128,
            DescError::TmaSwizzleSpan {
                bytes: 256,
                span: 128,
            },
        );
        check(
            &|m| {
                m.box_dim[0] = 64;
                m.swizzle = Swizzle::B64;
            },
            DescError::TmaSwizzleSpan {
                bytes: 128,
                span: 64,
            },
        );
        check(
            &|m| {
                m.box_dim[0] = 32;
                m.swizzle = Swizzle::B32;
            },
            DescError::TmaSwizzleSpan {
                bytes: 64,
                span: 32,
            },
        );
        check(
            &|m| m.element_strides[1] = 9,
            DescError::TmaElementStride { dim: 1, value: 9 },
        );
        check(
            &|m| m.element_strides[0] = 0,
            DescError::TmaElementStride { dim: 0, value: 0 },
        );
        check(
            &|m| {
                m.data_type = TensorMapDataType::Uint16;
                m.oob_fill = OobFill::NanRequestZeroFma;
            },
            DescError::TmaOobFillType(TensorMapDataType::Uint16),
        );
        check(
            &|m| m.data_type = TensorMapDataType::U4x16Align8B,
            DescError::TmaPackedType(TensorMapDataType::U4x16Align8B),
        );
        check(
            &|m| m.interleave = TensorMapInterleave::B32,
            DescError::TmaInterleave(TensorMapInterleave::B32),
        );
        // Accepted: no swizzle lifts the span limit; NaN fill on bf16; element strides up to 8.
        let mut m = g;
        m.swizzle = Swizzle::None;
        m.box_dim[0] = 256;
        m.oob_fill = OobFill::NanRequestZeroFma;
        m.element_strides = [8; TMA_MAX_RANK];
        assert_eq!(m.validate(), Ok(()));
        // Constructors refuse what the driver would.
        assert!(TensorMapParams::k_major(WgmmaDtype::Bf16, Swizzle::B128, 0, 64, 100, 64).is_err());
        assert!(TensorMapParams::k_major(WgmmaDtype::Bf16, Swizzle::B128, 0, 64, 64, 264).is_err());
        assert!(TensorMapParams::k_major(WgmmaDtype::Bf16, Swizzle::None, 0, 64, 64, 64).is_err());
        Ok(())
    }

    proptest! {
        /// Over K-major maps: the constructor accepts exactly the shapes whose row pitch is a
        /// multiple of 16 bytes (the driver's stride rule), and the box fills one swizzle span.
        #[test]
        fn k_major_maps(
            bf16 in any::<bool>(),
            rows in 1u64..5000,
            k in 1u64..20000,
            box_groups in 1u32..=32,
            sw in prop_oneof![Just(Swizzle::B32), Just(Swizzle::B64), Just(Swizzle::B128)],
        ) {
            let dtype = if bf16 { WgmmaDtype::Bf16 } else { WgmmaDtype::E4m3 };
            let eb = u64::from(dtype.elem_bytes());
            let r = TensorMapParams::k_major(dtype, sw, 0x10_0000, rows, k, 8 * box_groups);
            prop_assert_eq!(r.is_ok(), (k * eb) % 16 == 0);
            if let Ok(m) = r {
                prop_assert_eq!(u64::from(m.box_dim[0]) * eb, u64::from(sw.span_bytes().unwrap_or(0)));
                prop_assert_eq!(m.box_bytes(), u64::from(8 * box_groups) * u64::from(sw.span_bytes().unwrap_or(0)));
            }
        }
    }
}
