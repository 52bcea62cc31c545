//! The `activation` statement: each form parses and lowers onto the module, the standard recipes
//! declare SPEC §9's schemes, and every misuse is refused with its code.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use moeforge_dsl::ir::{ActDynamic, ActScale, Activation, DType};

fn codes(src: &str) -> Vec<String> {
    match moeforge_dsl::check(src, None) {
        Ok(_) => Vec::new(),
        Err(ds) => ds.into_iter().map(|d| d.code).collect(),
    }
}

fn activation(src: &str) -> (Activation, String) {
    let info = moeforge_dsl::check(src, None).unwrap_or_else(|ds| panic!("{ds:?}\n{src}"));
    let a = info.activation();
    (a, a.text(info.module()))
}

/// A tensorwise FP8 recipe (both GEMMs) with `extra` statements and `decl` appended.
fn fp8_tensor(inputs_optional: bool, decl: &str) -> String {
    let opt = if inputs_optional { " optional" } else { "" };
    format!(
        "recipe r(E: experts, H, I) where H % 16 == 0, I % 16 == 0 {{
  input w13 : bf16[E, 2*I, H]
  input w2  : bf16[E, H, I]
  input w13_input_scale : f32[E]{opt}
  input w2_input_scale  : f32[E]{opt}
  let q13 = quant fp8(w13, granularity = tensor, amax = per_expert reduce moe_tp)
  let q2  = quant fp8(w2,  granularity = tensor, amax = per_expert reduce moe_tp)
  param w13_weight       : e4m3[E, 2*I, H] = q13.values
  param w13_weight_scale : f32[E]          = q13.scales
  param w2_weight        : e4m3[E, H, I]   = q2.values
  param w2_weight_scale  : f32[E]          = q2.scales
  param w13_input_scale  : f32[E] = broadcast(reduce_max(w13_input_scale, group = ep), E)
  param w2_input_scale   : f32[E] = broadcast(reduce_max(w2_input_scale, group = ep), E)
  {decl}
}}
"
    )
}

const BF16: &str = "recipe r(E: experts, H, I) {
  input w13 : bf16[E, 2*I, H]
  param w13_weight : bf16[E, 2*I, H] = w13
  DECL
}
";

#[test]
fn standard_recipes_declare_spec_9() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../kernels/");
    for (name, want) in [
        ("bf16", "bf16"),
        ("nvfp4_cutedsl", "bf16"),
        ("mxfp4", "bf16"),
        ("int8_per_row", "bf16"),
        ("fp8_block128", "fp8(per_token_group = 128)"),
        (
            "fp8_per_tensor",
            "fp8(static(w13 = w13_input_scale, w2 = w2_input_scale) else per_token)",
        ),
        (
            "prequant/fp8_modelopt",
            "fp8(static(w13 = w13_input_scale, w2 = w2_input_scale) else per_token)",
        ),
        ("layouts/fp8_colmajor", "fp8(per_token)"),
    ] {
        let src = std::fs::read_to_string(format!("{root}{name}.recipe")).unwrap();
        let info = moeforge_dsl::check(&src, None).unwrap();
        assert!(info.module().activation_span().is_some(), "{name}");
        assert_eq!(info.activation().text(info.module()), want, "{name}");
    }
}

#[test]
fn fp8_per_tensor_scales_per_gemm() {
    let src = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../kernels/fp8_per_tensor.recipe"
    ))
    .unwrap();
    let info = moeforge_dsl::check(&src, None).unwrap();
    let m = info.module();
    let Activation::Fp8Static { w13, w2, fallback } = info.activation() else {
        panic!("{:?}", info.activation());
    };
    assert_eq!(fallback, Some(ActDynamic::PerToken));
    let name = |t| m.tensor(t).unwrap().name.clone();
    assert_eq!(name(w13), "w13_input_scale");
    assert_eq!(name(w2), "w2_input_scale");
    // The params, not the inputs they shadow.
    assert!(m.tensor(w13).unwrap().kind == moeforge_dsl::ir::TensorKind::Param);
    assert_eq!(
        info.activation_scales("w13"),
        vec![
            ActScale::Dynamic(ActDynamic::PerToken),
            ActScale::Static(w13)
        ]
    );
    assert_eq!(
        info.activation_scales("w2"),
        vec![
            ActScale::Dynamic(ActDynamic::PerToken),
            ActScale::Static(w2)
        ]
    );
    assert_eq!(info.activation().dtype(), DType::E4m3);
}

#[test]
fn forms_lower_and_print_back() {
    let (a, t) = activation(&fp8_tensor(false, "activation fp8(per_token)"));
    assert_eq!(a, Activation::Fp8Dynamic(ActDynamic::PerToken));
    assert_eq!(t, "fp8(per_token)");
    // Always-present static scales: static only, no fallback.
    let src = fp8_tensor(
        false,
        "activation fp8(static(w2 = w2_input_scale, w13 = w13_input_scale))",
    );
    let info = moeforge_dsl::check(&src, None).unwrap();
    let a = info.activation();
    assert!(matches!(a, Activation::Fp8Static { fallback: None, .. }));
    assert_eq!(
        a.text(info.module()),
        "fp8(static(w13 = w13_input_scale, w2 = w2_input_scale))"
    );
    assert!(matches!(
        info.activation_scales("w13")[..],
        [ActScale::Static(_)]
    ));
    // Text printed back parses to the same scheme.
    let again = fp8_tensor(false, &format!("activation {}", a.text(info.module())));
    assert_eq!(activation(&again).0, a);
    // Optional scales with a group fallback.
    let (a, _) = activation(&fp8_tensor(
        true,
        "activation fp8(static(w13 = w13_input_scale, w2 = w2_input_scale) else per_token_group = 128)",
    ));
    assert!(matches!(
        a,
        Activation::Fp8Static {
            fallback: Some(ActDynamic::PerTokenGroup { group: 128 }),
            ..
        }
    ));
    // bf16: declared, and the default.
    let (a, t) = activation(&BF16.replace("DECL", "activation bf16"));
    assert_eq!((a, t.as_str()), (Activation::Bf16, "bf16"));
    let info = moeforge_dsl::check(&BF16.replace("DECL", ""), None).unwrap();
    assert_eq!(info.activation(), Activation::Bf16);
    assert!(info.module().activation_span().is_none());
    assert!(info.activation_scales("w13").is_empty());
    // `activation` is not reserved: it can still name a tensor.
    let src = BF16.replace(
        "DECL",
        "let activation = w13_weight\n  param p : bf16[E, 2*I, H] = activation",
    );
    assert!(moeforge_dsl::check(&src, None).is_ok(), "{:?}", codes(&src));
}

#[test]
fn weights_only_dtypes_take_bf16() {
    let src = "recipe r(E: experts, H, I) {
  input w2 : bf16[E, H, I]
  let q = quant int8(w2, granularity = row)
  param w2_weight : i8[E, H, I] = q.values
  param w2_weight_scale : f32[E, H] = q.scales
  DECL
}
";
    assert!(codes(&src.replace("DECL", "")).is_empty());
    assert!(codes(&src.replace("DECL", "activation bf16")).is_empty());
    assert_eq!(
        codes(&src.replace("DECL", "activation fp8(per_token)")),
        ["E0701"]
    );
}

#[test]
fn misuse_is_refused_with_codes() {
    let cases: &[(&str, bool, &str)] = &[
        // operands
        ("activation bf16", false, "E0701"),
        ("", false, "E0701"),
        // twice
        ("activation fp8(per_token)\n  activation fp8(per_token)", false, "E0102"),
        // arguments
        ("activation bf16(per_token)", false, "E0105"),
        ("activation fp8", false, "E0105"),
        ("activation fp8(per_token = 4)", false, "E0105"),
        ("activation fp8(per_token_group)", false, "E0105"),
        ("activation fp8(static)", false, "E0105"),
        ("activation fp8(static(w13 = w13_input_scale))", false, "E0105"),
        ("activation fp8(static(w1 = w13_input_scale, w2 = w2_input_scale))", false, "E0105"),
        ("activation fp8(per_channel)", false, "E0104"),
        ("activation e4m3", false, "E0104"),
        (
            "activation fp8(static(w13 = w13_input_scale, w13 = w13_input_scale, w2 = w2_input_scale))",
            false,
            "E0102",
        ),
        // static scales
        ("activation fp8(static(w13 = w13_weight_scale, w2 = w2_input_scale))", false, "E0702"),
        ("activation fp8(static(w13 = w13_weight, w2 = w2_input_scale))", false, "E0702"),
        ("activation fp8(static(w13 = nope, w2 = w2_input_scale))", false, "E0101"),
        // group sizes
        ("activation fp8(per_token_group = 0)", false, "E0703"),
        ("activation fp8(per_token_group = 256)", false, "E0703"),
        // fallbacks
        ("activation fp8(per_token else per_token)", false, "E0704"),
        (
            "activation fp8(static(w13 = w13_input_scale, w2 = w2_input_scale) else per_token)",
            false,
            "E0704",
        ),
        ("activation fp8(static(w13 = w13_input_scale, w2 = w2_input_scale))", true, "E0704"),
        (
            "activation fp8(static(w13 = w13_input_scale, w2 = w2_input_scale) else static(w13 = w13_input_scale, w2 = w2_input_scale))",
            true,
            "E0704",
        ),
        ("activation fp8(static(w13 = w13_input_scale, w2 = w2_input_scale) else per_tensor)", true, "E0104"),
        // syntax
        ("activation fp8(per_token_group = -128)", false, "E0001"),
        ("activation fp8(per_token", false, "E0001"),
        ("activation", false, "E0001"),
    ];
    for (decl, optional, want) in cases {
        let src = fp8_tensor(*optional, decl);
        let got = codes(&src);
        assert_eq!(
            got.first().map(String::as_str),
            Some(*want),
            "{decl}: {got:?}"
        );
    }
}

#[test]
fn static_scale_must_be_one_value_for_all_experts() {
    let src = fp8_tensor(
        false,
        "param s : f32[E] = w13_weight_scale * w2_weight_scale\n  activation fp8(static(w13 = s, w2 = w2_input_scale))",
    );
    let ds = moeforge_dsl::check(&src, None).err().unwrap();
    assert_eq!(ds[0].code, "E0702");
    assert!(
        ds[0].message.contains("not one value for all experts"),
        "{}",
        ds[0].message
    );
}
