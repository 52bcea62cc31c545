//! Every operation the language accepts in a param's definition is generated: permutes, slices,
//! concatenation, reshapes, padding, indexing and f32 arithmetic on tensors, each packed by the
//! interpreter, the Cranelift GPU form and the host form, against element-by-element index math
//! written here.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;

use moeforge::codegen::{self, kir::BufRole, SingleProcess};

fn pack(
    src: &str,
    bind: &str,
    inputs: &HashMap<String, Vec<u8>>,
    backend: &str,
) -> HashMap<String, Vec<u8>> {
    let b = moeforge::dsl::verify::parse_binding(bind).unwrap();
    let info = moeforge::dsl::check(src, Some(&b)).unwrap();
    let prog = codegen::plan::plan_with(
        &info,
        &|n: &str| inputs.contains_key(n),
        &|_| false,
        backend == "host_x4",
    )
    .unwrap();
    let mut bufs = codegen::alloc_buffers(&prog, &mut |n| inputs.get(n).cloned()).unwrap();
    if backend == "interp" {
        codegen::interp::run(&prog, &mut bufs, &SingleProcess).unwrap();
    } else {
        codegen::host::compile(&prog)
            .unwrap()
            .run(&mut bufs, &SingleProcess, 2)
            .unwrap();
    }
    prog.bufs
        .iter()
        .zip(bufs)
        .filter_map(|(b, d)| match &b.role {
            BufRole::Param(n) => Some((n.clone(), d)),
            _ => None,
        })
        .collect()
}

#[test]
fn tensor_operations_in_params_are_generated() {
    let src = include_str!("recipes/tensor_ops.recipe");
    let (e, h, i) = (2usize, 32usize, 48usize);
    let bf = |k: usize| -> u16 {
        (0x3C00 + ((k * 37) % 700) as u16) ^ if k.is_multiple_of(3) { 0x8000 } else { 0 }
    };
    let w13: Vec<u16> = (0..e * 2 * i * h).map(bf).collect();
    let w2: Vec<u16> = (0..e * h * i).map(|k| bf(k + 11)).collect();
    let s: Vec<f32> = (0..e * 2 * i).map(|k| k as f32 * 0.37 - 5.0).collect();
    let le16 = |v: &[u16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut inputs = HashMap::new();
    inputs.insert("w13".to_string(), le16(&w13));
    inputs.insert("w2".to_string(), le16(&w2));
    inputs.insert(
        "s".to_string(),
        s.iter().flat_map(|x| x.to_le_bytes()).collect(),
    );
    let x13 = |ex: usize, r: usize, c: usize| w13[(ex * 2 * i + r) * h + c];
    // The expected params, by index math.
    let mut want: HashMap<&str, Vec<u8>> = HashMap::new();
    let mut pt = Vec::new();
    let mut up = Vec::new();
    let mut ct = Vec::new();
    let mut pd = Vec::new();
    let mut row0 = Vec::new();
    let mp = (2 * i).div_ceil(128) * 128;
    for ex in 0..e {
        for c in 0..h {
            for r in 0..2 * i {
                pt.push(x13(ex, r, c));
            }
        }
        for r in i..2 * i {
            for c in 0..h {
                up.push(x13(ex, r, c));
            }
        }
        for r in 0..3 * i {
            for c in 0..h {
                ct.push(x13(ex, if r < 2 * i { r } else { r - 2 * i }, c));
            }
        }
        for r in 0..mp {
            for c in 0..h {
                pd.push(if r < 2 * i { x13(ex, r, c) } else { 0 });
            }
        }
        for c in 0..h {
            row0.push(x13(ex, 0, c));
        }
    }
    want.insert("pt", le16(&pt));
    want.insert("up", le16(&up));
    want.insert("ct", le16(&ct));
    want.insert("rs", le16(&w2));
    want.insert("pd", le16(&pd));
    want.insert("row0", le16(&row0));
    want.insert("sq", s.iter().flat_map(|x| (x * x).to_le_bytes()).collect());
    for backend in ["interp", "host", "host_x4"] {
        let got = pack(src, &format!("E={e},H={h},I={i}"), &inputs, backend);
        for (name, w) in &want {
            assert!(got[*name] == *w, "`{name}` on {backend}");
        }
    }
}

#[test]
fn quantizing_a_tensor_expression_equals_quantizing_the_materialized_input() {
    // Quantize permute(wt) where wt is w13 stored transposed: the same bytes as the standard
    // recipes quantizing w13 itself (NVFP4 through its row gather and swizzle, INT8 rows, FP8 blocks).
    let (e, h, i) = (2usize, 128usize, 64usize);
    let bf = |k: usize| -> u16 {
        (0x3A00 + ((k * 53) % 1500) as u16) ^ if k.is_multiple_of(5) { 0x8000 } else { 0 }
    };
    let w13: Vec<u16> = (0..e * 2 * i * h).map(bf).collect();
    let mut wt = vec![0u16; w13.len()];
    for ex in 0..e {
        for r in 0..2 * i {
            for c in 0..h {
                wt[(ex * h + c) * 2 * i + r] = w13[(ex * 2 * i + r) * h + c];
            }
        }
    }
    let le16 = |v: &[u16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let bind = format!("E={e},H={h},I={i}");
    for (recipe, quant, params) in [
        (
            "nvfp4_cutedsl",
            "quant nvfp4(permute(wt, 0, 2, 1), block = 16, amax = per_expert reduce moe_tp)",
            vec![
                "param w13_weight : e2m1[E, 2*I, H] = q.values[:, rows, :]",
                "param w13_weight_scale : e4m3[E, round_up(2*I, 128), round_up(H/16, 4)] = swizzle_128x4(q.scales[:, rows, :])",
                "param w13_weight_scale_2 : f32[E] = q.decode_scale",
            ],
        ),
        (
            "int8_per_row",
            "quant int8(permute(wt, 0, 2, 1), granularity = row)",
            vec![
                "param w13_weight : i8[E, 2*I, H] = q.values",
                "param w13_weight_scale : f32[E, 2*I] = q.scales",
            ],
        ),
        (
            "fp8_block128",
            "quant fp8(permute(wt, 0, 2, 1), granularity = block128)",
            vec![
                "param w13_weight : e4m3[E, 2*I, H] = q.values",
                // e4m3 weights declare their activations (SPEC §9); one entry per param.
                "param w13_weight_scale_inv : f32[E, ceil_div(2*I, 128), ceil_div(H, 128)] = q.scales\n  activation fp8(per_token_group = 128)",
            ],
        ),
    ] {
        let src = format!(
            "recipe t(E: experts, H, I) where I % 64 == 0, H % 64 == 0 {{\n  input wt : bf16[E, H, 2*I]\n  let q = {quant}\n  let rows = interleave(swap_halves(2*I), group = 64)\n  {}\n}}\n",
            params.join("\n  ")
        );
        let mut inputs = HashMap::new();
        inputs.insert("wt".to_string(), le16(&wt));
        let mut std_inputs = HashMap::new();
        std_inputs.insert("w13".to_string(), le16(&w13));
        std_inputs.insert("w2".to_string(), le16(&vec![0u16; e * h * i]));
        let want = pack(moeforge::kernels::find(recipe).unwrap().source, &bind, &std_inputs, "host");
        for backend in ["interp", "host", "host_x4"] {
            let got = pack(&src, &bind, &inputs, backend);
            assert_eq!(got.len(), params.len());
            for (name, g) in &got {
                assert!(want[name] == *g, "{recipe}: `{name}` on {backend}");
            }
        }
    }
}
