//! Pack programs against SPEC: every standard recipe and variant, packed by the reference interpreter and by the
//! Cranelift host backend on random inputs (a fresh seed each run, printed on failure), must equal
//! SPEC's formulas (`codegen::reference`) byte for byte; plus SPEC §4's worked example end to end.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
use common::seed;

use std::collections::HashMap;

use moeforge::codegen::{self, kir::BufRole, reference as r, SingleProcess};
use moeforge::dsl::ir::DType;
use moeforge::dsl::spec;

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// A bf16-representable value with a wide spread of magnitudes, some exact zeros and ties.
    fn bf16(&mut self) -> f32 {
        let k = self.next();
        match k % 16 {
            0 => 0.0,
            1 => -0.0,
            2 => ((k >> 8) % 13) as f32 * 0.25 - 1.5, // E2M1-ish grid points and midpoints
            _ => {
                let mant = ((k >> 8) & 0x7F) as u32;
                let exp = 120 + ((k >> 16) % 14) as u32;
                let sign = ((k >> 24) & 1) as u32;
                f32::from_bits((sign << 31) | (exp << 23) | (mant << 16))
            }
        }
    }
}

fn bf16_bytes(x: &[f32]) -> Vec<u8> {
    x.iter()
        .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
        .collect()
}

fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

type Params = HashMap<String, Vec<u8>>;

/// `src` checked at `E = e, M = m, K = k`.
fn check_emk(src: &str, e: usize, m: usize, k: usize) -> moeforge::dsl::ModuleInfo {
    let b = vec![
        ("E".into(), e as i64),
        ("M".into(), m as i64),
        ("K".into(), k as i64),
    ];
    moeforge::dsl::check(src, Some(&b)).unwrap()
}

/// Pack with a backend; returns param name -> bytes.
fn pack(
    recipe: &str,
    bind: (i64, i64, i64),
    inputs: &HashMap<String, Vec<u8>>,
    backend: &str,
) -> Params {
    let src = moeforge::kernels::find(recipe).unwrap().source;
    let b = vec![
        ("E".into(), bind.0),
        ("H".into(), bind.1),
        ("I".into(), bind.2),
    ];
    let info = moeforge::dsl::check(src, Some(&b)).unwrap();
    run_backend(&info, &|n| inputs.get(n).cloned(), backend)
}

/// The pack program of `info` run on `backend` (`interp`, `host`, or either with `_x4`: the
/// four-lane form), its inputs from `input`: param name -> bytes.
fn run_backend(
    info: &moeforge::dsl::ModuleInfo,
    input: &dyn Fn(&str) -> Option<Vec<u8>>,
    backend: &str,
) -> Params {
    let x4 = backend.ends_with("_x4");
    let prog =
        codegen::plan::plan_with(info, &|n: &str| input(n).is_some(), &|_| false, x4).unwrap();
    let mut bufs = codegen::alloc_buffers(&prog, &mut |n| input(n)).unwrap();
    match backend.trim_end_matches("_x4") {
        "interp" => codegen::interp::run(&prog, &mut bufs, &SingleProcess).unwrap(),
        "host" => {
            let compiled = codegen::host::compile(&prog).unwrap();
            compiled.run(&mut bufs, &SingleProcess, 2).unwrap();
        }
        _ => unreachable!(),
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

struct Case {
    e: usize,
    h: usize,
    i: usize,
    w13: Vec<f32>,
    w2: Vec<f32>,
    s13: Vec<f32>,
    s2: Vec<f32>,
}

impl Case {
    fn new(rng: &mut Rng, e: usize, h: usize, i: usize) -> Case {
        let mut gen = |n: usize| (0..n).map(|_| rng.bf16()).collect::<Vec<f32>>();
        let w13 = gen(e * 2 * i * h);
        let w2 = gen(e * h * i);
        let s13 = (0..e).map(|k| 0.5 + k as f32 * 0.25).collect();
        let s2 = (0..e).map(|k| 2.0 - k as f32 * 0.125).collect();
        Case {
            e,
            h,
            i,
            w13,
            w2,
            s13,
            s2,
        }
    }

    fn inputs(&self, with_scales: bool) -> HashMap<String, Vec<u8>> {
        let mut m = HashMap::new();
        m.insert("w13".to_string(), bf16_bytes(&self.w13));
        m.insert("w2".to_string(), bf16_bytes(&self.w2));
        if with_scales {
            m.insert("w13_input_scale".to_string(), f32_bytes(&self.s13));
            m.insert("w2_input_scale".to_string(), f32_bytes(&self.s2));
        }
        m
    }

    fn experts<'a>(&self, x: &'a [f32]) -> Vec<&'a [f32]> {
        x.chunks(x.len() / self.e).collect()
    }
}

/// SPEC's packing of each standard recipe, from the reference formulas.
fn expected(recipe: &str, c: &Case, with_scales: bool) -> Params {
    let mut out = Params::new();
    let (h, i) = (c.h, c.i);
    let cat = |v: Vec<Vec<u8>>| v.concat();
    let amax_max = |s: &[f32]| s.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b));
    match recipe {
        "bf16" => {
            out.insert("w13_weight".into(), bf16_bytes(&c.w13));
            out.insert("w2_weight".into(), bf16_bytes(&c.w2));
        }
        "fp8_per_tensor" => {
            for (name, x, s_in, alpha) in [
                ("w13", &c.w13, &c.s13, "g1_alphas"),
                ("w2", &c.w2, &c.s2, "g2_alphas"),
            ] {
                let (q, s): (Vec<Vec<u8>>, Vec<f32>) =
                    c.experts(x).into_iter().map(r::fp8_per_tensor).unzip();
                out.insert(format!("{name}_weight"), cat(q));
                out.insert(format!("{name}_weight_scale"), f32_bytes(&s));
                if with_scales {
                    let a = amax_max(s_in);
                    out.insert(format!("{name}_input_scale"), f32_bytes(&vec![a; c.e]));
                    out.insert(
                        alpha.into(),
                        f32_bytes(&s.iter().map(|v| v * a).collect::<Vec<_>>()),
                    );
                }
            }
        }
        "fp8_block128" => {
            for (name, x, m, n) in [("w13", &c.w13, 2 * i, h), ("w2", &c.w2, h, i)] {
                let (q, s): (Vec<Vec<u8>>, Vec<Vec<f32>>) = c
                    .experts(x)
                    .into_iter()
                    .map(|xe| r::fp8_block128(xe, m, n))
                    .unzip();
                out.insert(format!("{name}_weight"), cat(q));
                out.insert(format!("{name}_weight_scale_inv"), f32_bytes(&s.concat()));
            }
        }
        "mxfp4" | "int8_per_row" => {
            for (name, x, k) in [("w13", &c.w13, h), ("w2", &c.w2, i)] {
                let (q, s): (Vec<Vec<u8>>, Vec<Vec<u8>>) = c
                    .experts(x)
                    .into_iter()
                    .map(|xe| {
                        if recipe == "mxfp4" {
                            r::mxfp4(xe)
                        } else {
                            let (q, s) = r::int8_per_row(xe, k);
                            (q, f32_bytes(&s))
                        }
                    })
                    .unzip();
                out.insert(format!("{name}_weight"), cat(q));
                out.insert(format!("{name}_weight_scale"), cat(s));
            }
        }
        "int4_g128" | "int4_g128_zp" => {
            let zp = recipe == "int4_g128_zp";
            for (name, x, k) in [("w13", &c.w13, h), ("w2", &c.w2, i)] {
                let q: Vec<r::Int4> = c
                    .experts(x)
                    .into_iter()
                    .map(|xe| r::int4_group(xe, k, 128, zp, DType::Bf16))
                    .collect();
                out.insert(
                    format!("{name}_weight"),
                    cat(q.iter().map(|q| q.codes.clone()).collect()),
                );
                let s: Vec<f32> = q.iter().flat_map(|q| q.scales.clone()).collect();
                out.insert(format!("{name}_weight_scale"), bf16_bytes(&s));
                if zp {
                    out.insert(
                        format!("{name}_weight_zero"),
                        cat(q.iter().map(|q| q.packed_zeros()).collect()),
                    );
                }
            }
        }
        "int8_g128" | "fp8_g128" => {
            for (name, x) in [("w13", &c.w13), ("w2", &c.w2)] {
                let (q, s): (Vec<Vec<u8>>, Vec<Vec<f32>>) = c
                    .experts(x)
                    .into_iter()
                    .map(|xe| {
                        if recipe == "fp8_g128" {
                            r::fp8_per_group(xe, 128)
                        } else {
                            r::int8_per_group(xe, 128)
                        }
                    })
                    .unzip();
                out.insert(format!("{name}_weight"), cat(q));
                out.insert(format!("{name}_weight_scale"), f32_bytes(&s.concat()));
            }
        }
        "nvfp4_cutedsl" => {
            for (name, x, m, k, reorder, s_in, alpha) in [
                ("w13", &c.w13, 2 * i, h, true, &c.s13, "g1_alphas"),
                ("w2", &c.w2, h, i, false, &c.s2, "g2_alphas"),
            ] {
                let mut vals = Vec::new();
                let mut scales = Vec::new();
                let mut decode = Vec::new();
                for xe in c.experts(x) {
                    let (gs, d) = r::nvfp4_global(xe);
                    decode.push(d);
                    // [gate; up] -> [up; gate] interleaved by 64 (SPEC §3), then quantize.
                    let rows: Vec<f32> = (0..m)
                        .flat_map(|row| {
                            let src = if reorder {
                                spec::cutedsl_row_src(row as i64, m as i64, 64) as usize
                            } else {
                                row
                            };
                            xe[src * k..(src + 1) * k].to_vec()
                        })
                        .collect();
                    let (p, s) = r::nvfp4_quantize(&rows, k, gs);
                    vals.push(p);
                    // Swizzle this expert's [m, k/16] scales into [ru(m,128), ru(k/16,4)] tiles.
                    let kb = k / 16;
                    let (mp, kp) = (
                        spec::ru(m as i64, 128) as usize,
                        spec::ru(kb as i64, 4) as usize,
                    );
                    let mut sw = vec![0u8; mp * kp];
                    for rr in 0..m {
                        for cc in 0..kb {
                            let o = spec::swizzle_128x4_offset(
                                0, rr as i64, cc as i64, m as i64, kb as i64,
                            );
                            sw[o as usize] = s[rr * kb + cc];
                        }
                    }
                    scales.push(sw);
                }
                out.insert(format!("{name}_weight"), cat(vals));
                out.insert(format!("{name}_weight_scale"), cat(scales));
                out.insert(format!("{name}_weight_scale_2"), f32_bytes(&decode));
                if with_scales {
                    let a = amax_max(s_in);
                    out.insert(
                        alpha.into(),
                        f32_bytes(&decode.iter().map(|d| d * a).collect::<Vec<_>>()),
                    );
                }
            }
        }
        _ => unreachable!(),
    }
    out
}

fn compare(
    recipe: &str,
    seed: u64,
    shape: (usize, usize, usize),
    want: &Params,
    got: &Params,
    backend: &str,
) {
    let mut names: Vec<&String> = want.keys().collect();
    names.sort();
    let mut got_names: Vec<&String> = got.keys().collect();
    got_names.sort();
    assert_eq!(names, got_names, "{recipe} {backend}: param sets differ");
    for n in names {
        let (a, b) = (&want[n], &got[n]);
        assert_eq!(a.len(), b.len(), "{recipe}.{n} ({backend}): length");
        if let Some(pos) = a.iter().zip(b.iter()).position(|(x, y)| x != y) {
            panic!(
                "{recipe}.{n} ({backend}) differs from SPEC at byte {pos}: want {:#04x}, got {:#04x} (MOEFORGE_SEED={seed}, E,H,I = {shape:?})",
                a[pos], b[pos]
            );
        }
    }
}

/// Pack `c` with the interpreter and the host backend, each in both forms, and compare with `want`.
fn check_backends(
    recipe: &str,
    seed: u64,
    c: &Case,
    inputs: &HashMap<String, Vec<u8>>,
    want: &Params,
) {
    let shape = (c.e, c.h, c.i);
    for backend in ["interp", "host", "interp_x4", "host_x4"] {
        let bind = (c.e as i64, c.h as i64, c.i as i64);
        let got = pack(recipe, bind, inputs, backend);
        compare(recipe, seed, shape, want, &got, backend);
    }
}

#[test]
fn every_recipe_matches_spec_on_random_inputs() {
    let seed = seed();
    let mut rng = Rng::new(seed);
    // Shapes include ones not divisible by the tiles: H=192 pads w2's scales to 256 rows; I=96 and
    // H=160 leave partial 128x128 FP8 blocks.
    let shapes: &[(&str, (usize, usize, usize))] = &[
        ("bf16", (2, 64, 64)),
        // Copies of 1, 2 and 4 chunks per GPU work item (rows of 5, 6, 3 and 10 16-byte chunks).
        ("bf16", (2, 40, 24)),
        ("bf16", (2, 48, 80)),
        ("fp8_per_tensor", (3, 64, 48)),
        ("fp8_block128", (2, 160, 96)),
        ("nvfp4_cutedsl", (2, 192, 64)),
        ("nvfp4_cutedsl", (3, 64, 128)),
        // Rows of 16 and 32 blocks: a work item's four blocks are 4 or 8 columns apart, which the
        // 128x4 swizzle moves by a constant (their scale offsets are the first's plus multiples).
        ("nvfp4_cutedsl", (2, 256, 512)),
        ("mxfp4", (2, 64, 192)),
        ("int8_per_row", (2, 48, 32)),
        ("int8_per_row", (2, 1040, 48)),
        ("int4_g128", (2, 256, 128)),
        ("int4_g128", (3, 128, 384)),
        // The variants: asymmetric INT4 (zero points two groups a byte), group-wise INT8.
        ("int4_g128_zp", (2, 256, 512)),
        ("int8_g128", (2, 256, 128)),
        ("int8_g128", (3, 128, 384)),
        // Group-wise FP8 (the per-channel formula per 128 along a row).
        ("fp8_g128", (2, 256, 128)),
        ("fp8_g128", (3, 128, 384)),
    ];
    for &(recipe, (e, h, i)) in shapes {
        let c = Case::new(&mut rng, e, h, i);
        for with_scales in [false, true] {
            let want = expected(recipe, &c, with_scales);
            check_backends(recipe, seed, &c, &c.inputs(with_scales), &want);
        }
    }
}

#[test]
fn nvfp4_worked_example_end_to_end() {
    // SPEC §4's block as an f32 checkpoint row: [3, -1.3, 0.4, 0.125, -0.01, 0...] and 12 in the next
    // block, so the expert's amax is 12 and gs = 224.
    let src = "recipe ex(E: experts, M, K) where K % 16 == 0 {\n  input w : f32[E, M, K]\n  let q = quant nvfp4(w, amax = per_expert reduce moe_tp)\n  param v : e2m1[E, M, K] = q.values\n  param s : e4m3[E, M, K/16] = q.scales\n  param s2 : f32[E] = q.decode_scale\n}\n";
    let b = vec![("E".into(), 1), ("M".into(), 1), ("K".into(), 32)];
    let info = moeforge::dsl::check(src, Some(&b)).unwrap();
    let prog = codegen::plan::plan(&info, &|_: &str| true).unwrap();
    let mut x = vec![0f32; 32];
    x[..5].copy_from_slice(&[3.0, -1.3, 0.4, 0.125, -0.01]);
    x[16] = 12.0;
    for backend in ["interp", "host"] {
        let mut bufs = codegen::alloc_buffers(&prog, &mut |_| Some(f32_bytes(&x))).unwrap();
        if backend == "interp" {
            codegen::interp::run(&prog, &mut bufs, &SingleProcess).unwrap();
        } else {
            codegen::host::compile(&prog)
                .unwrap()
                .run(&mut bufs, &SingleProcess, 1)
                .unwrap();
        }
        let get = |n: &str| {
            let k = prog.bufs.iter().position(|b| b.name() == n).unwrap();
            bufs[k].clone()
        };
        assert_eq!(&get("v")[..4], &[0xD7, 0x02, 0x08, 0x00], "{backend}");
        assert_eq!(get("s")[0], 0x6E, "{backend}");
        assert_eq!(
            get("s2"),
            (1.0f32 / 224.0).to_le_bytes().to_vec(),
            "{backend}"
        );
    }
}

#[test]
fn signed_zeros_and_zero_scale_blocks_match_spec() {
    // Blocks whose scale rounds to zero (tiny values next to a large expert maximum), all -0.0 blocks,
    // and -0.0 inside ordinary blocks: the cases where the sign of a zero decides a code.
    let seed = seed();
    let mut rng = Rng::new(seed);
    for &(recipe, (e, h, i)) in &[
        ("nvfp4_cutedsl", (2, 64, 64)),
        ("mxfp4", (2, 64, 64)),
        ("fp8_per_tensor", (2, 64, 48)),
        ("fp8_block128", (2, 160, 96)),
        ("int8_per_row", (2, 48, 32)),
        ("int4_g128", (2, 256, 128)),
    ] {
        let mut c = Case::new(&mut rng, e, h, i);
        for w in [&mut c.w13, &mut c.w2] {
            w[0] = 1000.0;
            for (k, v) in w.iter_mut().enumerate() {
                match (k / 16) % 5 {
                    1 => *v = -0.0,
                    // ±2^-96 (bf16-exact, as every value here).
                    2 => {
                        let t = f32::from_bits(0x0F80_0000);
                        *v = if k % 3 == 0 { -t } else { t }
                    }
                    3 if k % 4 == 1 => *v = -0.0,
                    _ => {}
                }
            }
        }
        let want = expected(recipe, &c, false);
        check_backends(recipe, seed, &c, &c.inputs(false), &want);
    }
}

#[test]
fn subnormal_scale_blocks_saturate_like_spec() {
    // NVFP4 blocks whose E4M3 scale is subnormal (bytes 1-7) next to a large expert maximum: the
    // scale rounds far down, so |x * oscale| reaches past 7 and the saturation at ±6 decides codes
    // (the GPU form converts normal-scale blocks without that step and these in a separate path).
    let seed = seed();
    let mut rng = Rng::new(seed);
    let (e, h, i) = (2, 64, 64);
    let mut c = Case::new(&mut rng, e, h, i);
    let bf = |v: f32| f32::from_bits((v.to_bits() + 0x8000) & 0xFFFF_0000);
    for (w, per) in [(&mut c.w13, 2 * i * h), (&mut c.w2, h * i)] {
        for (k, v) in w.iter_mut().enumerate() {
            if k % per == 0 {
                *v = 1000.0;
            } else if (k / 16) % 3 == 1 {
                // gs = 2.688, so a block maximum near 0.0061 has gs * max / 6 about 1.4 * 2^-9.
                let top = 0.0040 + 0.0005 * ((k / 16) % 7) as f32;
                let mag = bf(top * ((k % 16) + 1) as f32 / 16.0);
                *v = if (k * 7) % 3 == 0 { -mag } else { mag };
            }
        }
    }
    let inputs = c.inputs(false);
    let want = expected("nvfp4_cutedsl", &c, false);
    let subnormal = want["w13_weight_scale"]
        .iter()
        .filter(|b| (1..=7).contains(*b))
        .count();
    assert!(subnormal > 10, "only {subnormal} subnormal scale bytes");
    check_backends("nvfp4_cutedsl", seed, &c, &inputs, &want);
}

#[test]
fn nvfp4_blocks_whose_output_scale_overflows_saturate_like_spec() {
    // An expert whose amax is near f32's underflow (1e-34): gs = 2688 / amax is finite, but for a
    // block of denormal values the scale's decode product sval / gs is denormal too and its
    // reciprocal, the output scale, is +inf; x * oscale is then ±inf, which SPEC saturates to ±6. The
    // GPU form must not take its no-saturation path there (normal scale byte, finite output scale).
    let seed = seed();
    let mut rng = Rng::new(seed);
    let (e, h, i) = (2, 64, 64);
    let mut c = Case::new(&mut rng, e, h, i);
    let bf = |v: f32| f32::from_bits((v.to_bits() + 0x8000) & 0xFFFF_0000);
    let per13 = 2 * i * h;
    for (k, v) in c.w13[..per13].iter_mut().enumerate() {
        let blk = k / 16;
        *v = if k == 0 {
            bf(1e-34)
        } else {
            // Block maxima from 2e-39 to about 2.4e-38 (scale bytes 8 and up), no zeros.
            let top = 2e-39 * (1.0 + (blk % 12) as f32);
            let mag = bf(top * ((k % 16) + 1) as f32 / 16.0).max(f32::from_bits(0x0001_0000));
            if (k * 5) % 3 == 0 {
                -mag
            } else {
                mag
            }
        };
    }
    // Blocks of that expert with a normal scale byte and an infinite output scale (as SPEC computes).
    let (gs, _) = r::nvfp4_global(&c.w13[..per13]);
    let overflowing = c.w13[..per13]
        .chunks(16)
        .filter(|b| {
            let vmax = b.iter().fold(0f32, |m, x| m.max(x.abs()));
            let s = r::e4m3_from_f32((gs * (vmax * (1.0f32 / 6.0))).clamp(-448.0, 448.0));
            s >= 8 && (1.0 / (r::e4m3_to_f32(s) * (1.0 / gs))).is_infinite()
        })
        .count();
    assert!(
        overflowing > 10,
        "only {overflowing} blocks with an infinite output scale"
    );
    let inputs = c.inputs(false);
    let want = expected("nvfp4_cutedsl", &c, false);
    check_backends("nvfp4_cutedsl", seed, &c, &inputs, &want);
}

/// Group-wise INT4 beyond the standard recipe: asymmetric (u4 zero points, two groups a byte) and
/// f16 / f32 scales, groups of 32 and 64, packed by the interpreter and the host backend (both
/// forms) on random inputs (with all-zero and single-sign groups), equal to the reference byte for
/// byte.
#[test]
fn int4_variants_match_the_reference() {
    let seed = seed();
    let mut rng = Rng::new(seed);
    let (e, m, k) = (2usize, 6usize, 256usize);
    for (group, zp, scale) in [
        (128, true, DType::Bf16),
        (32, true, DType::F16),
        (64, false, DType::F16),
        (32, false, DType::F32),
        (64, true, DType::F32),
    ] {
        let zeros = if zp {
            format!("  param z : u4[E, M, K/{group}] = q.zeros\n")
        } else {
            String::new()
        };
        let src = format!(
            "recipe ex(E: experts, M, K) where K % {} == 0 {{\n  input w : bf16[E, M, K]\n  let q = quant int4(w, group = {group}, zero_point = {zp}, scale = {})\n  param v : u4[E, M, K] = q.values\n  param s : {}[E, M, K/{group}] = q.scales\n{zeros}}}\n",
            2 * group,
            scale.name(),
            scale.name()
        );
        let info = check_emk(&src, e, m, k);
        let mut x: Vec<f32> = (0..e * m * k).map(|_| rng.bf16()).collect();
        // An all-zero group, an all-positive and an all-negative one.
        x[..group].fill(0.0);
        for v in &mut x[group..2 * group] {
            *v = v.abs() + 0.5;
        }
        for v in &mut x[2 * group..3 * group] {
            *v = -v.abs() - 0.25;
        }
        let x: Vec<f32> = x
            .iter()
            .map(|v| f32::from_bits(v.to_bits() & 0xFFFF_0000))
            .collect();
        let want = r::int4_group(&x, k, group, zp, scale);
        let want_s: Vec<u8> = match scale {
            DType::Bf16 => bf16_bytes(&want.scales),
            // f16 scales are held as f32 in the program (the pack writes them as f16).
            _ => f32_bytes(&want.scales),
        };
        let xb = bf16_bytes(&x);
        for backend in ["interp", "host", "interp_x4", "host_x4"] {
            let got = run_backend(&info, &|_| Some(xb.clone()), backend);
            let what = format!("group {group} zp {zp} {scale} {backend} (MOEFORGE_SEED={seed})");
            assert_eq!(got["v"], want.codes, "codes: {what}");
            assert_eq!(got["s"], want_s, "scales: {what}");
            if zp {
                assert_eq!(got["z"], want.packed_zeros(), "zeros: {what}");
            }
        }
    }
}

/// Group-wise FP8's edge groups against the reference on the interpreter and the host, both forms:
/// an all-zero group (scale 1), a tiny group (the floor scale `1 / (448 * 512)`), a group at the
/// E4M3 maximum, and random ones.
#[test]
fn fp8_group_edges_match_the_reference() {
    let seed = seed();
    let mut rng = Rng::new(seed);
    let (e, m, k, group) = (2usize, 8usize, 256usize, 128usize);
    let src = format!(
        "recipe ex(E: experts, M, K) where K % {group} == 0 {{\n  input w : bf16[E, M, K]\n  let q = quant fp8(w, group = {group})\n  param v : e4m3[E, M, K] = q.values\n  param s : f32[E, M, K/{group}] = q.scales\n}}\n"
    );
    let info = check_emk(&src, e, m, k);
    let mut x: Vec<f32> = (0..e * m * k).map(|_| rng.bf16()).collect();
    x[..group].fill(0.0);
    for v in &mut x[group..2 * group] {
        *v *= 1e-9;
    }
    x[2 * group] = 448.0;
    x[3 * group] = -448.0;
    let x: Vec<f32> = x
        .iter()
        .map(|v| f32::from_bits(v.to_bits() & 0xFFFF_0000))
        .collect();
    let (want_q, want_s) = r::fp8_per_group(&x, group);
    assert_eq!(want_s[0], 1.0);
    assert_eq!(
        want_s[1],
        1.0 / (448.0 * 512.0),
        "the floor scale is exercised"
    );
    let xb = bf16_bytes(&x);
    for backend in ["interp", "host", "interp_x4", "host_x4"] {
        let got = run_backend(&info, &|_| Some(xb.clone()), backend);
        let what = format!("{backend} (MOEFORGE_SEED={seed})");
        assert_eq!(got["v"], want_q, "codes: {what}");
        assert_eq!(got["s"], f32_bytes(&want_s), "scales: {what}");
    }
}
