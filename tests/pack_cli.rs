//! `moeforge pack` and `inspect` on small generated checkpoints: a round trip whose dequantized values
//! are within SPEC's error bounds, Hugging Face / Mixtral / fused naming, optional activation scales,
//! and bad checkpoints (missing expert, wrong shape, wrong dtype, truncated file) that fail with the
//! tensor named and leave no output file.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
use common::{bf16, f32s, read_tensors as read, run, value};

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use moeforge::codegen::reference as r;
use moeforge::dsl::spec;
use safetensors::tensor::{Dtype, TensorView};

const E: usize = 3;
const H: usize = 128;
const I: usize = 64;

struct Tensors(Vec<(String, Dtype, Vec<usize>, Vec<u8>)>);

impl Tensors {
    fn write(&self, path: &Path) {
        let views: Vec<(String, TensorView<'_>)> = self
            .0
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }
}

/// Expert weights in Hugging Face naming for one layer; returns (w13 [E, 2I, H], w2 [E, H, I]).
fn hf_layer(t: &mut Tensors, layer: usize, scales: bool) -> (Vec<f32>, Vec<f32>) {
    let mut w13 = Vec::new();
    let mut w2 = Vec::new();
    for e in 0..E {
        let g: Vec<f32> = (0..I * H)
            .map(|k| value(k + e * 100_003 + layer * 7))
            .collect();
        let u: Vec<f32> = (0..I * H).map(|k| value(k * 3 + e * 1009 + 17)).collect();
        let d: Vec<f32> = (0..H * I).map(|k| value(k * 5 + e * 31 + 5)).collect();
        let p = format!("model.layers.{layer}.mlp.experts.{e}");
        t.0.push((
            format!("{p}.gate_proj.weight"),
            Dtype::BF16,
            vec![I, H],
            bf16(&g),
        ));
        t.0.push((
            format!("{p}.up_proj.weight"),
            Dtype::BF16,
            vec![I, H],
            bf16(&u),
        ));
        t.0.push((
            format!("{p}.down_proj.weight"),
            Dtype::BF16,
            vec![H, I],
            bf16(&d),
        ));
        if scales {
            for (w, s) in [
                ("gate_proj", 0.5 + e as f32),
                ("up_proj", 0.25),
                ("down_proj", 2.0),
            ] {
                t.0.push((
                    format!("{p}.{w}.input_scale"),
                    Dtype::F32,
                    vec![],
                    s.to_le_bytes().to_vec(),
                ));
            }
        }
        w13.extend(g);
        w13.extend(u);
        w2.extend(d);
    }
    (w13, w2)
}

#[test]
fn nvfp4_round_trip_within_spec_bound() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ckpt.safetensors");
    let mut t = Tensors(Vec::new());
    let (w13, _) = hf_layer(&mut t, 0, true);
    hf_layer(&mut t, 1, false);
    t.write(&ck);
    let out = dir.path().join("packed.safetensors");
    let (code, stdout, err) = run(&[
        "pack",
        "nvfp4_cutedsl",
        "--input",
        ck.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--layers",
        "0-0",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("packed 1 layer(s)"), "{stdout}");
    let (p, meta) = read(&out);
    assert_eq!(meta["moeforge.recipe"], "nvfp4_cutedsl");
    assert_eq!(meta["moeforge.version"], env!("CARGO_PKG_VERSION"));
    let src = moeforge::kernels::find("nvfp4_cutedsl").unwrap().source;
    assert_eq!(
        meta["moeforge.recipe_blake3"],
        blake3::hash(src.as_bytes()).to_hex().to_string()
    );
    let pre = "model.layers.0.mlp.experts.";
    let (vd, vs, vals) = &p[&format!("{pre}w13_weight")];
    assert_eq!((*vd, vs.clone()), (Dtype::U8, vec![E, 2 * I, H / 2]));
    let (sd, ss, scl) = &p[&format!("{pre}w13_weight_scale")];
    assert_eq!((*sd, ss.clone()), (Dtype::F8_E4M3, vec![E, 2 * I, 8]));
    let dec = f32s(&p[&format!("{pre}w13_weight_scale_2")].2);
    assert!(
        p.contains_key(&format!("{pre}g1_alphas")),
        "activation scales present -> alphas written"
    );
    assert!(
        !p.keys().any(|k| k.starts_with("model.layers.1.")),
        "--layers 0-0 is inclusive of 0 only"
    );
    // Dequantize: row r of the packed weight is source row cutedsl_row_src(r).
    let m = 2 * I;
    let kb = H / 16;
    let mut worst = 0f32;
    for e in 0..E {
        for r in 0..m {
            let src = spec::cutedsl_row_src(r as i64, m as i64, 64) as usize;
            for j in 0..kb {
                let so =
                    spec::swizzle_128x4_offset(0, r as i64, j as i64, m as i64, kb as i64) as usize;
                let s = r::e4m3_to_f32(scl[e * m * 8 + so]);
                let xb = &w13[(e * m + src) * H + j * 16..(e * m + src) * H + j * 16 + 16];
                let vmax = xb.iter().fold(0f32, |a, b| a.max(b.abs()));
                for (c, x) in xb.iter().enumerate() {
                    let byte = vals[(e * m + r) * H / 2 + j * 8 + c / 2];
                    let code = (byte >> (4 * (c % 2))) & 0xF;
                    let xq = r::e2m1_to_f32(code) * s * dec[e];
                    let bound = vmax / 6.0 * (1.0 + 0.125) + 1e-6;
                    let err = (x - xq).abs();
                    assert!(
                        err <= bound,
                        "expert {e} row {r} col {}: {x} -> {xq} (bound {bound})",
                        j * 16 + c
                    );
                    worst = worst.max(err / vmax.max(1e-30));
                }
            }
        }
    }
    assert!(worst > 0.0);
    // inspect lists params and metadata.
    let (code, listing, _) = run(&["inspect", out.to_str().unwrap()]);
    assert_eq!(code, 0);
    assert!(listing.contains("moeforge.recipe: nvfp4_cutedsl"));
    let line = listing
        .lines()
        .find(|l| l.starts_with("model.layers.0.mlp.experts.w13_weight_scale "))
        .unwrap();
    assert!(
        line.contains("F8_E4M3") && line.contains("[3, 128, 8]"),
        "{listing}"
    );
}

#[test]
fn fp8_and_bf16_recipes_from_mixtral_and_fused_naming() {
    let dir = tempfile::tempdir().unwrap();
    // Mixtral naming, no activation scales.
    let mut t = Tensors(Vec::new());
    let (w13, w2) = hf_layer(&mut t, 3, false);
    for (n, _, _, _) in t.0.iter_mut() {
        *n = n
            .replace(".mlp.experts.", ".block_sparse_moe.experts.")
            .replace("gate_proj", "w1")
            .replace("up_proj", "w3")
            .replace("down_proj", "w2");
    }
    let ck = dir.path().join("mixtral.safetensors");
    t.write(&ck);
    let out = dir.path().join("fp8.safetensors");
    let (code, _, err) = run(&[
        "pack",
        "fp8_per_tensor",
        "--input",
        ck.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let (p, _) = read(&out);
    let pre = "model.layers.3.mlp.experts.";
    assert!(
        !p.contains_key(&format!("{pre}g1_alphas")),
        "no activation scales -> no alphas"
    );
    assert!(!p.contains_key(&format!("{pre}w13_input_scale")));
    let q = &p[&format!("{pre}w13_weight")];
    assert_eq!((q.0, q.1.clone()), (Dtype::F8_E4M3, vec![E, 2 * I, H]));
    let s = f32s(&p[&format!("{pre}w13_weight_scale")].2);
    for e in 0..E {
        let xs = &w13[e * 2 * I * H..(e + 1) * 2 * I * H];
        let (want_q, want_s) = r::fp8_per_tensor(xs);
        assert_eq!(s[e], want_s);
        assert_eq!(&q.2[e * 2 * I * H..(e + 1) * 2 * I * H], &want_q[..]);
        for (x, b) in xs.iter().zip(&want_q) {
            let deq = r::e4m3_to_f32(*b) * want_s;
            assert!(
                (x - deq).abs() <= x.abs() / 16.0 + want_s * 2f32.powi(-9),
                "{x} vs {deq}"
            );
        }
    }
    // Fused naming, bf16 recipe: a byte-exact copy.
    let fused = dir.path().join("fused.safetensors");
    Tensors(vec![
        (
            "model.layers.0.mlp.experts.w13_weight".into(),
            Dtype::BF16,
            vec![E, 2 * I, H],
            bf16(&w13),
        ),
        (
            "model.layers.0.mlp.experts.w2_weight".into(),
            Dtype::BF16,
            vec![E, H, I],
            bf16(&w2),
        ),
    ])
    .write(&fused);
    let out = dir.path().join("bf16.safetensors");
    let (code, _, err) = run(&[
        "pack",
        "bf16",
        "--input",
        fused.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let (p, _) = read(&out);
    assert_eq!(p["model.layers.0.mlp.experts.w13_weight"].2, bf16(&w13));
    assert_eq!(p["model.layers.0.mlp.experts.w2_weight"].2, bf16(&w2));
}

fn expect_failure(dir: &Path, t: Tensors, recipe: &str, needle: &str) {
    let ck = dir.join("bad.safetensors");
    t.write(&ck);
    let out = dir.join("out.safetensors");
    let (code, _, err) = run(&[
        "pack",
        recipe,
        "--input",
        ck.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains(needle), "expected {needle:?} in: {err}");
    assert!(!out.exists(), "a failed pack left an output file");
    let leftovers: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        leftovers.len(),
        1,
        "temporary files left behind: {leftovers:?}"
    );
}

#[test]
fn bad_checkpoints_name_the_tensor_and_write_nothing() {
    let fresh = || {
        let mut t = Tensors(Vec::new());
        hf_layer(&mut t, 0, false);
        t
    };
    // Missing expert 1's up_proj.
    let dir = tempfile::tempdir().unwrap();
    let mut t = fresh();
    t.0.retain(|x| x.0 != "model.layers.0.mlp.experts.1.up_proj.weight");
    expect_failure(
        dir.path(),
        t,
        "nvfp4_cutedsl",
        "missing tensor `model.layers.0.mlp.experts.1.up_proj.weight`",
    );
    // Wrong shape.
    let dir = tempfile::tempdir().unwrap();
    let mut t = fresh();
    for x in
        t.0.iter_mut()
            .filter(|x| x.0 == "model.layers.0.mlp.experts.2.down_proj.weight")
    {
        x.2 = vec![I, H];
    }
    expect_failure(dir.path(), t, "fp8_block128", &format!("tensor `model.layers.0.mlp.experts.2.down_proj.weight`: expected shape [{H}, {I}], found [{I}, {H}]"));
    // Wrong dtype.
    let dir = tempfile::tempdir().unwrap();
    let mut t = fresh();
    for x in
        t.0.iter_mut()
            .filter(|x| x.0 == "model.layers.0.mlp.experts.0.gate_proj.weight")
    {
        x.1 = Dtype::I16;
    }
    expect_failure(dir.path(), t, "mxfp4", "tensor `model.layers.0.mlp.experts.0.gate_proj.weight`: expected dtype BF16, F16 or F32, found I16");
    // A shape the recipe's where-clause rejects (H=128 is fine; I=64 with int8 fine; use mxfp4 with H=40).
    // Truncated file.
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("bad.safetensors");
    fresh().write(&ck);
    let bytes = std::fs::read(&ck).unwrap();
    std::fs::write(&ck, &bytes[..bytes.len() / 2]).unwrap();
    let out = dir.path().join("out.safetensors");
    let (code, _, err) = run(&[
        "pack",
        "int8_per_row",
        "--input",
        ck.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("not a valid safetensors file"), "{err}");
    assert!(!out.exists());
    // An f32 checkpoint cannot be copied into a bf16 param without rounding.
    let dir = tempfile::tempdir().unwrap();
    let mut t = fresh();
    for x in t.0.iter_mut() {
        let v: Vec<f32> =
            x.3.chunks_exact(2)
                .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
                .collect();
        x.1 = Dtype::F32;
        x.3 = v.iter().flat_map(|f| f.to_le_bytes()).collect();
    }
    expect_failure(dir.path(), t, "bf16", "copies bf16 weights bit for bit");
}

#[test]
fn f32_and_f16_checkpoints_are_widened_exactly() {
    // The same values as bf16, f16 and f32 checkpoints quantize identically.
    let dir = tempfile::tempdir().unwrap();
    let mut outs = Vec::new();
    for dt in [Dtype::BF16, Dtype::F16, Dtype::F32] {
        let mut t = Tensors(Vec::new());
        hf_layer(&mut t, 0, false);
        for x in t.0.iter_mut() {
            let v: Vec<f32> =
                x.3.chunks_exact(2)
                    .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
                    .collect();
            x.1 = dt;
            x.3 = match dt {
                Dtype::BF16 => bf16(&v),
                Dtype::F32 => v.iter().flat_map(|f| f.to_le_bytes()).collect(),
                _ => v
                    .iter()
                    .flat_map(|f| f32_to_f16_exact(*f).to_le_bytes())
                    .collect(),
            };
        }
        let ck = dir.path().join(format!("{dt:?}.safetensors"));
        t.write(&ck);
        let out = dir.path().join(format!("{dt:?}.out.safetensors"));
        let (code, _, err) = run(&[
            "pack",
            "mxfp4",
            "--input",
            ck.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{dt:?}: {err}");
        outs.push(read(&out).0);
    }
    assert_eq!(outs[0], outs[1]);
    assert_eq!(outs[0], outs[2]);
}

/// f32 -> f16 for values that f16 represents exactly (the test's values do).
fn f32_to_f16_exact(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    if x == 0.0 {
        return sign;
    }
    let exp = ((b >> 23) & 0xFF) as i32 - 127 + 15;
    assert!(
        exp > 0 && exp < 31 && b & 0x1FFF == 0,
        "{x} is not an exact f16 normal"
    );
    sign | ((exp as u16) << 10) | ((b >> 13) & 0x3FF) as u16
}

#[test]
fn f16_widening_is_exact() {
    for h in 0u16..=0xFFFF {
        let f = moeforge::pack::f16_to_f32(h);
        let exp = (h >> 10) & 0x1F;
        if exp == 0x1F {
            continue;
        }
        let mant = (h & 0x3FF) as f64;
        let v = if exp == 0 {
            mant * 2f64.powi(-24)
        } else {
            (1.0 + mant / 1024.0) * 2f64.powi(exp as i32 - 15)
        };
        let v = if h & 0x8000 != 0 { -v } else { v };
        assert_eq!(f as f64, v, "{h:#06x}");
    }
}

#[test]
fn declared_layouts_are_written_and_recorded() {
    // The reproducer: a column-major FP8 recipe. `pack` must store each expert's bytes
    // column-major (element (e, r, c) at e*2IH + r + c*2I), record the layout and the recipe source
    // in the metadata, and agree with the row-major standard recipe element for element.
    let dir = tempfile::tempdir().unwrap();
    let mut t = Tensors(Vec::new());
    hf_layer(&mut t, 0, false);
    let ck = dir.path().join("in.safetensors");
    t.write(&ck);
    let pack = |recipe: &str, name: &str| {
        let out = dir.path().join(name);
        let (code, _, err) = run(&[
            "pack",
            recipe,
            "--input",
            ck.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{err}");
        read(&out)
    };
    let (col, col_meta) = pack("kernels/layouts/fp8_colmajor.recipe", "col.safetensors");
    let (row, row_meta) = pack("fp8_per_tensor", "row.safetensors");
    let key = "model.layers.0.mlp.experts.w13_weight";
    let (c, r) = (&col[key], &row[key]);
    assert_eq!(c.1, vec![E, 2 * I, H], "logical shape");
    assert_ne!(c.2, r.2, "column-major bytes must differ from row-major");
    for e in 0..E {
        for m in 0..2 * I {
            for k in 0..H {
                let base = e * 2 * I * H;
                assert_eq!(
                    c.2[base + m + k * 2 * I],
                    r.2[base + m * H + k],
                    "({e},{m},{k})"
                );
            }
        }
    }
    let lay = &col_meta["moeforge.layout.w13_weight"];
    assert_eq!(
        lay,
        &format!("({E},{},{H}):({},1,{})", 2 * I, 2 * I * H, 2 * I)
    );
    assert!(!row_meta.contains_key("moeforge.layout.w13_weight"));
    assert!(col_meta["moeforge.recipe_source"].contains("recipe fp8_colmajor"));
    assert!(row_meta["moeforge.recipe_source"].contains("recipe fp8_per_tensor"));
}

/// A ModelOpt-style checkpoint of one layer quantized from the bf16 values of `hf_layer` by SPEC's
/// formulas: per expert one NVFP4 global scale (or FP8 scale) over the whole w13 (gate and up
/// together, as the standard recipes take it) and one over w2. `split` gives gate and up their own
/// scales instead (a checkpoint the packer must requantize).
fn modelopt_layer(fp4: bool, split: bool) -> (Tensors, Tensors) {
    let mut bf = Tensors(Vec::new());
    let (w13, w2) = hf_layer(&mut bf, 0, false);
    let mut q = Tensors(Vec::new());
    let scalar = |v: f32| v.to_le_bytes().to_vec();
    for e in 0..E {
        let x13 = &w13[e * 2 * I * H..(e + 1) * 2 * I * H];
        let x2 = &w2[e * H * I..(e + 1) * H * I];
        let p = format!("model.layers.0.mlp.experts.{e}");
        let mut put = |proj: &str, x: &[f32], scale_of: &[f32], rows: usize, k: usize| {
            if fp4 {
                let (gs, dec) = r::nvfp4_global(scale_of);
                let (codes, sc) = r::nvfp4_quantize(x, k, gs);
                q.0.push((
                    format!("{p}.{proj}.weight"),
                    Dtype::U8,
                    vec![rows, k / 2],
                    codes,
                ));
                q.0.push((
                    format!("{p}.{proj}.weight_scale"),
                    Dtype::F8_E4M3,
                    vec![rows, k / 16],
                    sc,
                ));
                q.0.push((
                    format!("{p}.{proj}.weight_scale_2"),
                    Dtype::F32,
                    vec![],
                    scalar(dec),
                ));
            } else {
                let (_, s) = r::fp8_per_tensor(scale_of);
                let codes = x
                    .iter()
                    .map(|v| r::e4m3_from_f32((v * (1.0 / s)).clamp(-448.0, 448.0)))
                    .collect();
                q.0.push((
                    format!("{p}.{proj}.weight"),
                    Dtype::F8_E4M3,
                    vec![rows, k],
                    codes,
                ));
                q.0.push((
                    format!("{p}.{proj}.weight_scale"),
                    Dtype::F32,
                    vec![],
                    scalar(s),
                ));
            }
        };
        let (gate, up) = x13.split_at(I * H);
        // Split scales: up at a quarter of its magnitude (bf16-exact), so that its scale is smaller.
        let up_q: Vec<f32> = up.iter().map(|v| v * 0.25).collect();
        let up = if split { &up_q[..] } else { up };
        put("gate_proj", gate, if split { gate } else { x13 }, I, H);
        put("up_proj", up, if split { up } else { x13 }, I, H);
        put("down_proj", x2, x2, H, I);
    }
    (bf, q)
}

#[test]
fn prequantized_checkpoints_pack_to_the_standard_recipes_params() {
    // ModelOpt NVFP4 -> nvfp4_modelopt_cutedsl == bf16 -> nvfp4_cutedsl, and ModelOpt FP8 ->
    // fp8_modelopt == bf16 -> fp8_per_tensor, every param byte for byte.
    let dir = tempfile::tempdir().unwrap();
    for (fp4, pre, standard) in [
        (true, "nvfp4_modelopt_cutedsl", "nvfp4_cutedsl"),
        (false, "fp8_modelopt", "fp8_per_tensor"),
    ] {
        let (bf, q) = modelopt_layer(fp4, false);
        let (bf_path, q_path) = (
            dir.path().join("bf.safetensors"),
            dir.path().join("q.safetensors"),
        );
        bf.write(&bf_path);
        q.write(&q_path);
        let pack = |recipe: &str, input: &Path, name: &str| {
            let out = dir.path().join(name);
            let (code, stdout, err) = run(&[
                "pack",
                recipe,
                "--input",
                input.to_str().unwrap(),
                "--output",
                out.to_str().unwrap(),
            ]);
            assert_eq!(code, 0, "{recipe}: {err}");
            (read(&out).0, stdout)
        };
        let (want, _) = pack(standard, &bf_path, "std.safetensors");
        let (got, stdout) = pack(pre, &q_path, "pre.safetensors");
        assert!(!stdout.contains("requantized"), "{stdout}");
        assert_eq!(
            got.keys().collect::<BTreeSet<_>>(),
            want.keys().collect::<BTreeSet<_>>(),
            "{pre}: params"
        );
        for (k, w) in &want {
            assert_eq!(got[k].0, w.0, "{pre}: `{k}` dtype");
            assert_eq!(got[k].1, w.1, "{pre}: `{k}` shape");
            assert!(got[k].2 == w.2, "{pre}: `{k}` differs from {standard}'s");
        }
    }
}

#[test]
fn differing_gate_and_up_scales_are_requantized_to_their_max() {
    let dir = tempfile::tempdir().unwrap();
    for (fp4, pre, scale) in [
        (true, "nvfp4_modelopt_cutedsl", "w13_weight_scale_2"),
        (false, "fp8_modelopt", "w13_weight_scale"),
    ] {
        let (_, q) = modelopt_layer(fp4, true);
        let q_path = dir.path().join("q.safetensors");
        q.write(&q_path);
        let out = dir.path().join("pre.safetensors");
        let (code, stdout, err) = run(&[
            "pack",
            pre,
            "--input",
            q_path.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{err}");
        assert!(stdout.contains("requantized both to"), "{stdout}");
        let (t, _) = read(&out);
        let s = f32s(&t[&format!("model.layers.0.mlp.experts.{scale}")].2);
        // The stored scale is the max of gate's and up's.
        for (e, got) in s.iter().enumerate() {
            let find = |proj: &str| {
                let n = format!(
                    "model.layers.0.mlp.experts.{e}.{proj}.{}",
                    scale.trim_start_matches("w13_")
                );
                let b = &q.0.iter().find(|x| x.0 == n).unwrap().3;
                f32::from_le_bytes([b[0], b[1], b[2], b[3]])
            };
            assert_eq!(*got, find("gate_proj").max(find("up_proj")), "expert {e}");
            if !fp4 {
                // The up half, requantized to the larger scale, still holds the checkpoint's
                // values (to E4M3's rounding); the gate half is unchanged.
                let w = &t["model.layers.0.mlp.experts.w13_weight"].2;
                let n = format!("model.layers.0.mlp.experts.{e}.up_proj.weight");
                let orig = &q.0.iter().find(|x| x.0 == n).unwrap().3;
                let su = find("up_proj");
                for (k, &c) in orig.iter().enumerate() {
                    let before = r::e4m3_to_f32(c) * su;
                    let after = r::e4m3_to_f32(w[(e * 2 * I + I) * H + k]) * got;
                    assert!(
                        (before - after).abs() <= before.abs() / 16.0 + got / 512.0,
                        "expert {e} up[{k}]: {before} -> {after}"
                    );
                }
            }
        }
    }
}

#[test]
fn sharded_checkpoints_and_passthrough() {
    // Two shards behind an index, with tensors the recipe does not consume and a config file:
    // packing through the index, the directory or the files gives the same params; --passthrough
    // writes a complete checkpoint directory sharded like the input.
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ckpt");
    std::fs::create_dir(&ck).unwrap();
    let mut a = Tensors(Vec::new());
    hf_layer(&mut a, 0, false);
    a.0.push((
        "model.embed_tokens.weight".into(),
        Dtype::BF16,
        vec![4, 8],
        bf16(&[0.5; 32]),
    ));
    let mut b = Tensors(Vec::new());
    hf_layer(&mut b, 1, false);
    b.0.push((
        "model.layers.1.self_attn.o_proj.weight".into(),
        Dtype::F32,
        vec![2, 2],
        vec![7u8; 16],
    ));
    a.write(&ck.join("model-00001-of-00002.safetensors"));
    b.write(&ck.join("model-00002-of-00002.safetensors"));
    let mut map = serde_json::Map::new();
    for (t, f) in [
        (&a, "model-00001-of-00002.safetensors"),
        (&b, "model-00002-of-00002.safetensors"),
    ] {
        for (n, _, _, _) in &t.0 {
            map.insert(n.clone(), serde_json::Value::String(f.into()));
        }
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    std::fs::write(ck.join("model.safetensors.index.json"), index.to_string()).unwrap();
    std::fs::write(ck.join("config.json"), "{\"model_type\": \"test\"}").unwrap();
    let pack = |input: &Path, out: &Path, extra: &[&str]| {
        let mut args = vec![
            "pack",
            "fp8_per_tensor",
            "--input",
            input.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let (code, _, err) = run(&args);
        assert_eq!(code, 0, "{err}");
    };
    let via_index = dir.path().join("a.safetensors");
    pack(&ck.join("model.safetensors.index.json"), &via_index, &[]);
    let via_dir = dir.path().join("b.safetensors");
    pack(&ck, &via_dir, &[]);
    let (p1, _) = read(&via_index);
    let (p2, _) = read(&via_dir);
    assert_eq!(p1, p2);
    assert!(p1.contains_key("model.layers.1.mlp.experts.w13_weight"));
    assert!(
        !p1.contains_key("model.embed_tokens.weight"),
        "default output holds the params only"
    );
    // --passthrough
    let out = dir.path().join("packed");
    pack(&ck, &out, &["--passthrough"]);
    let idx: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let wm = idx["weight_map"].as_object().unwrap();
    assert_eq!(
        wm["model.embed_tokens.weight"],
        "model-00001-of-00002.safetensors"
    );
    assert_eq!(
        wm["model.layers.1.self_attn.o_proj.weight"],
        "model-00002-of-00002.safetensors"
    );
    assert_eq!(
        wm["model.layers.0.mlp.experts.w13_weight"],
        "model-00001-of-00002.safetensors"
    );
    assert_eq!(
        wm["model.layers.1.mlp.experts.w2_weight_scale"],
        "model-00002-of-00002.safetensors"
    );
    assert!(
        !wm.keys().any(|k| k.contains("gate_proj")),
        "consumed expert tensors are not copied"
    );
    let (s1, m1) = read(&out.join("model-00001-of-00002.safetensors"));
    let (s2, _) = read(&out.join("model-00002-of-00002.safetensors"));
    assert_eq!(s1["model.embed_tokens.weight"].2, bf16(&[0.5; 32]));
    assert_eq!(
        s2["model.layers.1.self_attn.o_proj.weight"].2,
        vec![7u8; 16]
    );
    assert_eq!(
        s2["model.layers.1.mlp.experts.w13_weight"],
        p1["model.layers.1.mlp.experts.w13_weight"]
    );
    assert_eq!(m1["moeforge.recipe"], "fp8_per_tensor");
    assert!(out.join("config.json").is_file());
    // An existing output directory is refused, and left as it was.
    let (code, _, err) = run(&[
        "pack",
        "fp8_per_tensor",
        "--input",
        ck.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--passthrough",
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("exists"), "{err}");
}

#[test]
fn host_settings_come_from_the_environment_of_the_command() {
    // MOEFORGE_DISASM=DIR writes each JIT-compiled kernel's machine code there; MOEFORGE_CL_OPT picks
    // Cranelift's optimization level (the packed bytes do not depend on it); a level that does not
    // exist is an error naming the variable.
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ckpt.safetensors");
    let mut t = Tensors(Vec::new());
    hf_layer(&mut t, 0, false);
    t.write(&ck);
    let asm = dir.path().join("asm");
    std::fs::create_dir(&asm).unwrap();
    let pack = |out: &str, env: &[(&str, &Path)]| {
        let out = dir.path().join(out);
        let mut c = Command::new(env!("CARGO_BIN_EXE_moeforge"));
        c.args(["pack", "fp8_per_tensor", "--input"])
            .arg(&ck)
            .arg("--output")
            .arg(&out)
            .env_remove("MOEFORGE_DISASM")
            .env_remove("MOEFORGE_CL_OPT");
        for (k, v) in env {
            c.env(k, v);
        }
        let o = c.output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        (o.status.code(), out, err)
    };
    let (code, plain, err) = pack("plain.safetensors", &[]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(std::fs::read_dir(&asm).unwrap().count(), 0);
    let (code, dumped, err) = pack(
        "dumped.safetensors",
        &[
            ("MOEFORGE_DISASM", &asm),
            ("MOEFORGE_CL_OPT", Path::new("none")),
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    let files: Vec<String> = std::fs::read_dir(&asm)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !files.is_empty() && files.iter().all(|f| f.ends_with(".s")),
        "{files:?}"
    );
    assert_eq!(read(&plain).0, read(&dumped).0);
    let (code, _, err) = pack("bad.safetensors", &[("MOEFORGE_CL_OPT", Path::new("fast"))]);
    assert_eq!(code, Some(1));
    assert!(err.contains("MOEFORGE_CL_OPT=`fast`"), "{err}");
}
