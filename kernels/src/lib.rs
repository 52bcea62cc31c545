//! moeforge's standard recipes, embedded in the binary: each describes how one quantized MoE
//! backend lays out its weights over the dimensions `E` (local experts), `H` (hidden size) and `I`
//! (intermediate size per expert), with vLLM's parameter names.

/// A standard recipe: its file name (without `.recipe`) and source text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StandardRecipe {
    /// Name, equal to the recipe's own name.
    pub name: &'static str,
    /// Path relative to the repository root.
    pub path: &'static str,
    /// Source.
    pub source: &'static str,
}

macro_rules! recipe {
    ($name:literal) => {
        StandardRecipe {
            name: $name,
            path: concat!("kernels/", $name, ".recipe"),
            source: include_str!(concat!("../", $name, ".recipe")),
        }
    };
}

/// Every standard recipe, in a stable order.
pub const STANDARD: &[StandardRecipe] = &[
    recipe!("bf16"),
    recipe!("fp8_per_tensor"),
    recipe!("fp8_block128"),
    recipe!("nvfp4_cutedsl"),
    recipe!("mxfp4"),
    recipe!("int8_per_row"),
    recipe!("int4_g128"),
];

macro_rules! layout_example {
    ($name:literal) => {
        StandardRecipe {
            name: $name,
            path: concat!("kernels/layouts/", $name, ".recipe"),
            source: include_str!(concat!("../layouts/", $name, ".recipe")),
        }
    };
}

/// Recipes whose params declare storage layouts other than row-major (column-major, tiled,
/// swizzled, padded scale tiles): what the layout tests, `selftest --gpu` and `bench --layouts` run.
pub const LAYOUTS: &[StandardRecipe] = &[
    layout_example!("fp8_colmajor"),
    layout_example!("bf16_tiled"),
    layout_example!("bf16_swizzled"),
    layout_example!("mxfp4_swizzled"),
];

macro_rules! prequant {
    ($name:literal) => {
        StandardRecipe {
            name: $name,
            path: concat!("kernels/prequant/", $name, ".recipe"),
            source: include_str!(concat!("../prequant/", $name, ".recipe")),
        }
    };
}

/// Recipes over pre-quantized checkpoints (ModelOpt NVFP4 and FP8): they re-lay out codes and scales
/// without rounding, producing the params of the matching standard recipe.
pub const PREQUANT: &[StandardRecipe] = &[
    prequant!("nvfp4_modelopt_cutedsl"),
    prequant!("fp8_modelopt"),
];

macro_rules! variant {
    ($name:literal) => {
        StandardRecipe {
            name: $name,
            path: concat!("kernels/variants/", $name, ".recipe"),
            source: include_str!(concat!("../variants/", $name, ".recipe")),
        }
    };
}

/// Recipes of quantization options the standard recipes do not take (asymmetric INT4 with zero
/// points, group-wise INT8): what the layer's tests (and, where the GPU layer serves them,
/// `selftest --gpu --moe`) run besides the standard ones.
pub const VARIANTS: &[StandardRecipe] = &[
    variant!("int4_g128_zp"),
    variant!("int8_g128"),
    variant!("bf16_up_gate"),
    variant!("fp8_up_gate"),
    variant!("fp8_channel"),
    variant!("fp8_channel_by8"),
    variant!("fp8_channel_up_gate"),
    variant!("nvfp4_linear"),
    variant!("fp8_g128"),
    variant!("fp8_g128_up_gate"),
    variant!("int8_kernel_order"),
];

/// A standard recipe, a layout example, a pre-quantized recipe or a variant by name.
pub fn find(name: &str) -> Option<&'static StandardRecipe> {
    STANDARD
        .iter()
        .chain(LAYOUTS)
        .chain(PREQUANT)
        .chain(VARIANTS)
        .find(|r| r.name == name)
}

/// The default binding of `moeforge demo`: one Qwen3-30B-A3B MoE layer (128 experts, hidden 2048,
/// intermediate 768).
pub const QWEN3_30B_A3B: &[(&str, i64)] = &[("E", 128), ("H", 2048), ("I", 768)];
