//! `moeforge selftest --gpu --moe`: the MoE layer forward on the GPU against the host path (issue
//! \[9\] tests), end to end through `moe run`: a random bf16 checkpoint (fresh seed, printed) is
//! packed with each recipe the GPU layer runs, then the same inputs run with `--device host` and
//! `--device gpu --dump-intermediates`, and the files are compared (relative Frobenius):
//! * `w13_out` within 2e-3 of the host's (the first GEMM takes the same quantized input on both:
//!   the activation quantizers are bit-exact);
//! * `output` within SPEC §9's 1e-2 of an f64 evaluation of the second GEMM and the combine *with
//!   the same quantized operands* the GPU used: the weights read back from the packed params and
//!   the GPU's own `act` (SPEC §9's bound is against the same quantized operands: where `a` is
//!   quantized to E4M3, a GPU `a` a few ulp off the host's can round to the neighbouring code, so
//!   the two paths' `act` legitimately differ by whole E4M3 steps in a few elements);
//! * with bf16 activations (no such rounding), `output` and `act` also within 1e-2 of the host's;
//! * for every recipe whose first GEMM pairs its rows (all but fp8_block128 at an I off 64), the fused layer
//!   (`silu(gate) * up` in the first GEMM's epilogue, what runs without `--dump-intermediates`;
//!   for FP8 per tensor its f32 `a` quantized by the activation kernel) gives the unfused output
//!   (the bits are printed as the same or not; within 1e-3 passes).
//!
//! * layout independence: one checkpoint packed with `bf16` and `bf16_up_gate`, and with
//!   `fp8_per_tensor`, `fp8_up_gate` and `fp8_colmajor`, and with `fp8_channel` and
//!   `fp8_channel_by8` (per-channel scales, gate and up interleaved by 8), and with `nvfp4_cutedsl`
//!   and `nvfp4_linear` (linear scales, no interleave), and with `fp8_g128` and `fp8_g128_up_gate`,
//!   and with `int8_per_row` and `int8_kernel_order` (codes in the kernel's order, read in place)
//!   (the same quantization,
//!   other storage: read in place through other row modes, or re-laid), gives the fused GPU layer
//!   the same output bits ([`layout_independence`]);
//! * a layer of one expert ([`one_expert`]).
//!
//! The GPU-vs-host differences of `act` and `output` are printed for every recipe. Routings: uniform
//! and skewed (empty experts), T = 1, T not a multiple of any tile, top-k 1, 2 and 8, and a
//! placement with replicas (`--placement`, the packed params placed as `eplb apply` does). With
//! `quick` (for the sanitizers), the first three routings only.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};

use crate::moe_run::{self, Device, RunOptions};
use crate::pack::{self, PackOptions};
use crate::runtime::collective::Topology;
use crate::selftest_util::{fresh_seed, hopper, Rng};
use crate::{Error, Result};

const E: usize = 8;
const H: usize = 256;
/// Not a multiple of 128: the last 1x128 group of `a` is short.
const I: usize = 208;
const LAYER: u32 = 3;

/// A synthetic layer's sizes: experts, hidden, intermediate.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    /// Experts.
    pub(crate) e: usize,
    /// Hidden size H.
    pub(crate) h: usize,
    /// Intermediate size I.
    pub(crate) i: usize,
}

/// The self-test's layer.
const DIMS: Dims = Dims { e: E, h: H, i: I };
/// The 4-bit recipes' layer (I a multiple of 128).
const DIMS4: Dims = Dims { e: E, h: H, i: 384 };
/// fp8_block128 fused with I = 192 (2I a multiple of 128, I not: a block holds gate and up rows).
const DIMS192: Dims = Dims { e: E, h: H, i: 192 };
/// The asymmetric INT4 recipe's layer (its zero points pack two groups of 128 a byte: I a
/// multiple of 256).
const DIMS4Z: Dims = Dims { e: E, h: H, i: 512 };

type Tensor = (Dtype, Vec<usize>, Vec<u8>);

pub(crate) fn write(path: &Path, t: &BTreeMap<String, Tensor>) -> Result<()> {
    let views = t
        .iter()
        .map(|(n, (d, s, b))| {
            TensorView::new(*d, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| Error::Checkpoint(format!("selftest tensor `{n}`: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, None, path)
        .map_err(|e| Error::Checkpoint(format!("selftest: writing {}: {e}", path.display())))
}

/// Every tensor of a safetensors file as f32 (bf16 widened; anything else read as f32).
pub(crate) fn read(path: &Path) -> Result<BTreeMap<String, Vec<f32>>> {
    let bytes = std::fs::read(path).map_err(|e| Error::Io {
        path: path.display().to_string(),
        source: e,
    })?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| Error::Checkpoint(format!("{}: {e}", path.display())))?;
    Ok(st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            let vals = match v.dtype() {
                Dtype::BF16 => v
                    .data()
                    .chunks_exact(2)
                    .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
                    .collect(),
                _ => v
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            };
            (n, vals)
        })
        .collect())
}

fn bf16_bytes(rng: &mut Rng, n: usize, scale: f32) -> Vec<u8> {
    (0..n)
        .flat_map(|_| {
            let v = crate::codegen::gemm::reference::bf16_to_f32(rng.bf16()) * scale;
            crate::codegen::gemm::reference::bf16_from_f32(v).to_le_bytes()
        })
        .collect()
}

/// A random checkpoint of one MoE layer of sizes `d`, with static activation scales when `scales`.
pub(crate) fn checkpoint(rng: &mut Rng, path: &Path, scales: bool, d: Dims) -> Result<()> {
    let Dims { e, h, i } = d;
    let p = format!("model.layers.{LAYER}.mlp.experts");
    let mut t = BTreeMap::new();
    t.insert(
        format!("{p}.w13_weight"),
        (
            Dtype::BF16,
            vec![e, 2 * i, h],
            bf16_bytes(rng, e * 2 * i * h, 0.1),
        ),
    );
    t.insert(
        format!("{p}.w2_weight"),
        (Dtype::BF16, vec![e, h, i], bf16_bytes(rng, e * h * i, 0.1)),
    );
    if scales {
        // Calibrated to cover |x| < 1 and |a| below about 1.5.
        let s = |v: f32| -> Vec<u8> { (0..e).flat_map(|_| v.to_le_bytes()).collect() };
        t.insert(
            format!("{p}.w13_input_scale"),
            (Dtype::F32, vec![e], s(1.0 / 440.0)),
        );
        t.insert(
            format!("{p}.w2_input_scale"),
            (Dtype::F32, vec![e], s(1.6 / 440.0)),
        );
    }
    write(path, &t)
}

/// How the ids are drawn.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Routing {
    Uniform,
    /// Most items on two experts; some experts get none.
    Skewed,
}

/// Random inputs of `t` tokens with top-`k` routing over a layer of sizes `d`.
pub(crate) fn inputs(
    rng: &mut Rng,
    path: &Path,
    t: usize,
    k: usize,
    routing: Routing,
    d: Dims,
) -> Result<()> {
    let Dims { e: experts, h, .. } = d;
    let mut ids = Vec::with_capacity(t * k);
    for _ in 0..t {
        let mut row: Vec<i32> = Vec::new();
        while row.len() < k {
            let e = match routing {
                Routing::Uniform => rng.below(experts),
                Routing::Skewed if rng.below(4) > 0 && row.len() < 2 => row.len(),
                Routing::Skewed => rng.below(experts),
            } as i32;
            if !row.contains(&e) {
                row.push(e);
            }
        }
        ids.extend(row);
    }
    let w: Vec<f32> = (0..t * k)
        .map(|_| (rng.below(1000) as f32 + 1.0) / 1000.0)
        .collect();
    let mut m = BTreeMap::new();
    m.insert(
        "hidden_states".to_string(),
        (Dtype::BF16, vec![t, h], bf16_bytes(rng, t * h, 1.0)),
    );
    m.insert(
        "topk_ids".to_string(),
        (
            Dtype::I32,
            vec![t, k],
            ids.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
    );
    m.insert(
        "topk_weights".to_string(),
        (
            Dtype::F32,
            vec![t, k],
            w.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
    );
    write(path, &m)
}

/// Pack checkpoint `ck` with standard recipe `r` on the host into `packed`.
pub(crate) fn pack_on_host(
    r: &crate::kernels::StandardRecipe,
    ck: &Path,
    packed: &Path,
    settings: &crate::Settings,
) -> Result<()> {
    pack::pack(&PackOptions {
        recipe_src: r.source.to_string(),
        recipe_path: r.path.to_string(),
        inputs: vec![ck.to_path_buf()],
        output: packed.to_path_buf(),
        layers: None,
        threads: 0,
        progress: false,
        gpu: false,
        passthrough: false,
        allow_nonfinite: false,
        settings: settings.clone(),
        topology: Topology::SINGLE,
    })
    .map(|_| ())
}

/// `||got - want|| / ||want||` (Frobenius), through the GEMM reference's measure; infinite when
/// the lengths differ.
pub(crate) fn rel_frobenius(got: &[f32], want: &[f64]) -> f64 {
    crate::codegen::gemm::reference::rel_frobenius(got, want).unwrap_or(f64::INFINITY)
}

/// The packed `w2` read back in f64, `[E, H, I]` in the input's coordinates (logical expert `e`
/// is slot `e` of the unplaced file).
fn logical_w2(packed: &Path, src: &str, path: &str, d: Dims) -> Result<Vec<f64>> {
    let bytes = std::fs::read(packed).map_err(|e| Error::Io {
        path: packed.display().to_string(),
        source: e,
    })?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| Error::Checkpoint(format!("{}: {e}", packed.display())))?;
    let prefix = format!("model.layers.{LAYER}.mlp.experts.");
    let params: std::collections::HashMap<String, Vec<u8>> = st
        .tensors()
        .into_iter()
        .filter_map(|(n, v)| {
            n.strip_prefix(&prefix)
                .map(|p| (p.to_string(), v.data().to_vec()))
        })
        .collect();
    let info = crate::verify_source(src, path, Some(&format!("E={},H={},I={}", d.e, d.h, d.i)))?;
    let l = crate::dequant::logical(&info, "w2", &params).ok_or_else(|| {
        Error::Checkpoint(format!("{}: w2 cannot be read back", packed.display()))
    })?;
    (0..l.codes.len())
        .map(|at| {
            l.value(at)
                .ok_or_else(|| Error::Checkpoint("w2: an element has no value".into()))
        })
        .collect()
}

/// `topk_ids` and `topk_weights` of an inputs file.
/// The `topk_ids` and `topk_weights` of an inputs file.
pub(crate) fn read_routing(path: &Path) -> Result<(Vec<i32>, Vec<f32>)> {
    let bytes = std::fs::read(path).map_err(|e| Error::Io {
        path: path.display().to_string(),
        source: e,
    })?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| Error::Checkpoint(format!("{}: {e}", path.display())))?;
    let words = |name: &str| -> Result<Vec<[u8; 4]>> {
        let v = st
            .tensor(name)
            .map_err(|e| Error::Checkpoint(format!("{}: {e}", path.display())))?;
        Ok(v.data()
            .chunks_exact(4)
            .map(|c| [c[0], c[1], c[2], c[3]])
            .collect())
    };
    Ok((
        words("topk_ids")?
            .into_iter()
            .map(i32::from_le_bytes)
            .collect(),
        words("topk_weights")?
            .into_iter()
            .map(f32::from_le_bytes)
            .collect(),
    ))
}

/// `out[t] = sum_j w[t, j] * (W2[e] . act[t, j])` in f64, `[T, H]` (`act` is `[T, k, I]`).
fn second_gemm(
    w2: &[f64],
    act: &[f32],
    ids: &[i32],
    weights: &[f32],
    t: usize,
    k: usize,
    d: Dims,
) -> Vec<f64> {
    let (e_all, h, i) = (d.e, d.h, d.i);
    let mut out = vec![0f64; t * h];
    for (p, (&e, &w)) in ids.iter().zip(weights).enumerate() {
        let e = usize::try_from(e).unwrap_or(0).min(e_all - 1);
        let a = &act[p * i..(p + 1) * i];
        for c in 0..h {
            let row = &w2[(e * h + c) * i..(e * h + c + 1) * i];
            let v: f64 = row.iter().zip(a).map(|(w, x)| w * f64::from(*x)).sum();
            out[(p / k) * h + c] += f64::from(w) * v;
        }
    }
    out
}

/// Run the check (see the module docs); the report and whether every case passed (`None` when
/// skipped without a Hopper GPU).
pub fn selftest(quick: bool, settings: &crate::Settings) -> Result<(String, Option<bool>)> {
    let mut out = String::new();
    let Some(dev) = hopper("GPU MoE layer self-test", &mut out) else {
        return Ok((out, None));
    };
    let seed = fresh_seed();
    let mut rng = Rng(seed);
    let _ = writeln!(
        out,
        "moe layer seed {seed:#x} (E = {E}, H = {H}, I = {I}; the 4-bit recipes I = {})",
        DIMS4.i
    );
    let dir = tempfile::tempdir().map_err(|e| Error::Io {
        path: "a temporary folder".into(),
        source: e,
    })?;
    let d = dir.path();
    let mut ok = true;
    // (recipe, static activation scales)
    let recipes = [
        ("bf16", false),
        ("fp8_per_tensor", true),
        ("fp8_per_tensor", false),
        ("fp8_block128", false),
        // (again at I = 384: 2I a multiple of 128, so its first GEMM fuses SiLU*up, each half of
        // the paired rows taking its `[gate; up]` row's scale block; and at I = 192, where one
        // 128-row block holds gate rows and up rows)
        ("fp8_block128", false),
        ("fp8_block128", false),
        // FP8 per channel (a variant): a scale per weight row, per-token activations.
        ("fp8_channel", false),
        // Group-wise FP8 (a variant): a scale per row and 128 along K.
        ("fp8_g128", false),
        // Weights-only: int8 codes with per-row scales, bf16 activations (W8A16).
        ("int8_per_row", false),
        // Weights-only 4-bit codes with group scales, bf16 activations (W4A16).
        ("nvfp4_cutedsl", false),
        ("mxfp4", false),
        ("int4_g128", false),
        // Asymmetric INT4 (a u4 zero point per group; a variant, not a standard recipe).
        ("int4_g128_zp", false),
        // Group-wise int8 (an f32 scale per 128 along K; a variant).
        ("int8_g128", false),
    ];
    let cases: [(usize, usize, Routing); 5] = [
        (1, 8, Routing::Uniform),
        (37, 2, Routing::Skewed),
        (300, 8, Routing::Uniform),
        (129, 1, Routing::Skewed),
        (513, 2, Routing::Uniform),
    ];
    // A placement of 12 slots: every expert once, four replicas.
    let placement = d.join("placement.json");
    let phy2log = [3, 0, 7, 1, 3, 2, 6, 4, 5, 0, 7, 3];
    std::fs::write(
        &placement,
        serde_json::json!({ "phy2log": [phy2log] }).to_string(),
    )
    .map_err(|e| Error::Io {
        path: placement.display().to_string(),
        source: e,
    })?;
    // The sanitizers' run: the two smallest routings, and the placed one.
    let cases: Vec<(usize, usize, Routing)> = if quick {
        cases[..3].to_vec()
    } else {
        cases.to_vec()
    };
    for (ri, (recipe, scales)) in recipes.iter().enumerate() {
        let ck = d.join(format!("ckpt{ri}.safetensors"));
        // The 4-bit recipes bind I as a multiple of 128 (their groups, nvfp4_cutedsl's interleave).
        let dims = match *recipe {
            "nvfp4_cutedsl" | "mxfp4" | "int4_g128" | "int8_g128" | "fp8_g128" => DIMS4,
            "int4_g128_zp" => DIMS4Z,
            // (its second and third entries)
            "fp8_block128" => match recipes[..ri].iter().filter(|(r, _)| r == recipe).count() {
                0 => DIMS,
                1 => DIMS4,
                _ => DIMS192,
            },
            _ => DIMS,
        };
        checkpoint(&mut rng, &ck, *scales, dims)?;
        let packed = d.join(format!("{recipe}{ri}.safetensors"));
        let r = crate::kernels::find(recipe)
            .ok_or_else(|| Error::Usage(format!("no standard recipe `{recipe}`")))?;
        pack_on_host(r, &ck, &packed, settings)?;
        let w2 = logical_w2(&packed, r.source, r.path, dims)?;
        for (ci, &(t, k, routing)) in cases.iter().enumerate() {
            let placed = ci == 2;
            let inp = d.join(format!("in{ri}_{ci}.safetensors"));
            inputs(&mut rng, &inp, t, k, routing, dims)?;
            let run_as = |device: Device, dump: bool| -> Result<BTreeMap<String, Vec<f32>>> {
                let output = d.join(format!("out{ri}_{ci}_{device:?}_{dump}.safetensors"));
                let placement = placed.then(|| placement.clone());
                run_layer(settings, (&packed, &inp, &output), device, dump, placement)
            };
            let run = |device: Device| run_as(device, true);
            let label = format!(
                "moe layer {recipe:<15}{} T={t:<4} k={k} {routing:?}{}{}",
                if *scales { " static" } else { "       " },
                if placed { " placed (12 slots)" } else { "" },
                if dims.i == I {
                    String::new()
                } else {
                    format!(" (I = {})", dims.i)
                }
            );
            let host = run(Device::Host)?;
            let gpu = match run(Device::Gpu) {
                Ok(g) => g,
                Err(e) => {
                    ok = false;
                    let _ = writeln!(out, "{label}: FAIL (the GPU run: {e})");
                    continue;
                }
            };
            let mut line = String::new();
            let mut good = true;
            // bf16 activations all the way: the act and the output compare with the host's too.
            let bf16_feed = matches!(
                *recipe,
                "bf16"
                    | "int8_per_row"
                    | "nvfp4_cutedsl"
                    | "mxfp4"
                    | "int4_g128"
                    | "int4_g128_zp"
                    | "int8_g128"
            );
            for (name, bound) in [
                ("w13_out", Some(2e-3)),
                ("act", bf16_feed.then_some(1e-2)),
                ("output", bf16_feed.then_some(1e-2)),
            ] {
                let (Some(g), Some(h)) = (gpu.get(name), host.get(name)) else {
                    good = false;
                    let _ = write!(line, " {name} missing");
                    continue;
                };
                let e = rel_frobenius(g, &h.iter().map(|&v| f64::from(v)).collect::<Vec<_>>());
                let nan = g.iter().filter(|v| !v.is_finite()).count();
                good &= bound.is_none_or(|b| e <= b) && nan == 0;
                let _ = write!(line, " {name} {e:.2e}");
                if nan > 0 {
                    let _ = write!(line, " ({nan} non-finite)");
                }
            }
            // Without intermediates the GPU layer fuses `silu(gate) * up` into the first GEMM
            // where its rows pair (fp8_block128 only where 2I is a multiple of 128; `a` in bf16, or in f32 that the
            // activation kernel quantizes): the same output as the unfused path (the same f32
            // values through the same instructions; the bits match when both ran the same tile
            // variant, which the tuning cache may make differ).
            // (The layer's rule: the first GEMM's 2I rows pair, `moe_gpu::pairable`.)
            // (A variant the benchmark does not name, FP8 per channel, pairs as its rows do.)
            let fuses = crate::bench_gemm::Recipe::from_name(recipe)
                .map_or((2 * dims.i).is_multiple_of(16), |r| {
                    crate::moe_gpu::pairable(r.family().1, 2 * dims.i)
                });
            if fuses {
                match (run_as(Device::Gpu, false), gpu.get("output")) {
                    (Ok(fused), Some(plain)) => match fused.get("output") {
                        Some(f) => {
                            let same = f.len() == plain.len()
                                && f.iter().zip(plain).all(|(a, b)| a.to_bits() == b.to_bits());
                            let want: Vec<f64> = plain.iter().map(|&v| f64::from(v)).collect();
                            let e = rel_frobenius(f, &want);
                            good &= e <= 1e-3;
                            if same {
                                let _ = write!(line, "; fused: same bits");
                            } else {
                                let _ = write!(line, "; fused vs unfused {e:.2e}");
                            }
                        }
                        None => {
                            good = false;
                            let _ = write!(line, "; fused: no output");
                        }
                    },
                    (Err(e), _) => {
                        good = false;
                        let _ = write!(line, "; fused: {e}");
                    }
                    (_, None) => good = false,
                }
            }
            // The second GEMM and the combine in f64 with the GPU's own `act`.
            match (gpu.get("act"), gpu.get("output")) {
                (Some(act), Some(o)) => {
                    let (ids, weights) = read_routing(&inp)?;
                    let want = second_gemm(&w2, act, &ids, &weights, t, k, dims);
                    let e = rel_frobenius(o, &want);
                    good &= e <= 1e-2;
                    let _ = write!(line, "; output vs f64 of its act {e:.2e}");
                }
                _ => good = false,
            }
            ok &= good;
            let _ = writeln!(out, "{label}:{line}: {}", if good { "ok" } else { "FAIL" });
        }
    }
    let (l, lok) = layout_independence(&mut rng, d, settings, quick)?;
    out.push_str(&l);
    ok &= lok;
    let (l, lok) = one_expert(&mut rng, d, settings)?;
    out.push_str(&l);
    ok &= lok;
    let (g, gok) = crate::moe_graph_check::graph_check(&dev, &mut rng, &settings.runtime)?;
    out.push_str(&g);
    ok &= gok;
    let (g, gok) = crate::moe_eplb_check::eplb_check(&dev, &mut rng, &settings.runtime)?;
    out.push_str(&g);
    ok &= gok;
    let _ = writeln!(
        out,
        "moe layer: {}",
        if ok {
            "GPU == host within SPEC §9's bounds on every case"
        } else {
            "FAILED"
        }
    );
    Ok((out, Some(ok)))
}

/// `moe run` of packed params on `inputs` into `output` on `device` (with the intermediates where
/// `dump`, placed where `placement` is given), read back.
fn run_layer(
    settings: &crate::Settings,
    (packed, inputs, output): (&Path, &Path, &Path),
    device: Device,
    dump: bool,
    placement: Option<std::path::PathBuf>,
) -> Result<BTreeMap<String, Vec<f32>>> {
    moe_run::run(&RunOptions {
        packed: packed.to_path_buf(),
        inputs: inputs.to_path_buf(),
        output: output.to_path_buf(),
        layer: None,
        device,
        placement,
        dump_intermediates: dump,
        recipe: None,
        threads: 0,
        settings: settings.runtime.clone(),
    })?;
    read(output)
}

/// A layer of one expert (its weights' expert stride never steps: the in-place maps give that
/// dimension the rows' span): the first GEMM's output against the host's, the output against the
/// f64 second GEMM of the GPU's own `act`, and the fused layer against the unfused one, for a bf16
/// and an E4M3 recipe.
fn one_expert(rng: &mut Rng, d: &Path, settings: &crate::Settings) -> Result<(String, bool)> {
    let (mut out, mut ok) = (String::new(), true);
    let dims = Dims { e: 1, h: H, i: I };
    let (t, k) = (37, 1);
    for name in ["bf16", "fp8_per_tensor"] {
        let r = crate::kernels::find(name)
            .ok_or_else(|| Error::Usage(format!("no standard recipe `{name}`")))?;
        let (ck, packed, inp) = (
            d.join(format!("one_ckpt_{name}.safetensors")),
            d.join(format!("one_{name}.safetensors")),
            d.join(format!("one_in_{name}.safetensors")),
        );
        checkpoint(rng, &ck, false, dims)?;
        pack_on_host(r, &ck, &packed, settings)?;
        inputs(rng, &inp, t, k, Routing::Uniform, dims)?;
        let run_as = |device: Device, dump: bool| -> Result<BTreeMap<String, Vec<f32>>> {
            let output = d.join(format!("one_out_{name}_{device:?}_{dump}.safetensors"));
            run_layer(settings, (&packed, &inp, &output), device, dump, None)
        };
        let mut line = String::new();
        let good = match (
            run_as(Device::Host, true),
            run_as(Device::Gpu, true),
            run_as(Device::Gpu, false),
        ) {
            (Ok(host), Ok(gpu), Ok(fused)) => {
                let pair =
                    |a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>, n| match (
                        a.get(n),
                        b.get(n),
                    ) {
                        (Some(x), Some(y)) => {
                            rel_frobenius(x, &y.iter().map(|&v| f64::from(v)).collect::<Vec<_>>())
                        }
                        _ => f64::INFINITY,
                    };
                let e13 = pair(&gpu, &host, "w13_out");
                let ef = pair(&fused, &gpu, "output");
                let (ids, weights) = read_routing(&inp)?;
                let w2 = logical_w2(&packed, r.source, r.path, dims)?;
                let eo = match (gpu.get("act"), gpu.get("output")) {
                    (Some(act), Some(o)) => {
                        rel_frobenius(o, &second_gemm(&w2, act, &ids, &weights, t, k, dims))
                    }
                    _ => f64::INFINITY,
                };
                let _ = write!(
                    line,
                    " w13_out {e13:.2e}; output vs f64 of its act {eo:.2e}; fused vs unfused {ef:.2e}"
                );
                e13 <= 2e-3 && eo <= 1e-2 && ef <= 1e-3
            }
            (h, g, f) => {
                for (what, r) in [("host", h.err()), ("GPU", g.err()), ("fused GPU", f.err())] {
                    if let Some(e) = r {
                        let _ = write!(line, " the {what} run: {e}");
                    }
                }
                false
            }
        };
        ok &= good;
        let _ = writeln!(
            out,
            "moe layer {name:<15} one expert T={t} k={k}:{line}: {}",
            if good { "ok" } else { "FAIL" }
        );
    }
    Ok((out, ok))
}

/// Layout independence on the GPU (issue \[8\]): one checkpoint packed with a standard recipe and
/// with recipes that quantize alike but store otherwise (`w13`'s rows `[up; gate]` interleaved by
/// 64, read in place through their own row modes, up first; `fp8_colmajor`'s column-major weights,
/// which no TMA map of rows serves, re-laid) runs the fused GPU layer to the same output bits: each
/// layer reads its params through its own maps, and the kernels' accumulation order is the same.
fn layout_independence(
    rng: &mut Rng,
    d: &Path,
    settings: &crate::Settings,
    quick: bool,
) -> Result<(String, bool)> {
    let mut out = String::new();
    let mut ok = true;
    let bind = format!("E={},H={},I={}", DIMS4.e, DIMS4.h, DIMS4.i);
    let pairs: [(&str, &[&str]); 6] = [
        ("bf16", &["bf16_up_gate"]),
        ("fp8_per_tensor", &["fp8_up_gate", "fp8_colmajor"]),
        // (Gate and up interleaved by 8, scales moving with their rows: the per-channel
        // pair.)
        ("fp8_channel", &["fp8_channel_by8", "fp8_channel_up_gate"]),
        // (Linear E4M3 scales and `[gate; up]` rows without the interleave: the 4-bit codes and
        // scales go into the kernel's order from either storage.)
        ("nvfp4_cutedsl", &["nvfp4_linear"]),
        // (Group scales read in the in-place up-first order.)
        ("fp8_g128", &["fp8_g128_up_gate"]),
        // (Int8 codes stored in the GEMM's own order, w13 in the paired order: both GEMMs read
        // the params' bytes in place, the standard recipe's a copy re-laid on the host.)
        ("int8_per_row", &["int8_kernel_order"]),
    ];
    let cases: &[(usize, usize, Routing)] = if quick {
        &[(1, 8, Routing::Uniform)]
    } else {
        &[(1, 8, Routing::Uniform), (300, 8, Routing::Skewed)]
    };
    for (pi, (base, others)) in pairs.iter().enumerate() {
        let ck = d.join(format!("li_ckpt{pi}.safetensors"));
        checkpoint(rng, &ck, false, DIMS4)?;
        let mut packed = Vec::new();
        for name in std::iter::once(base).chain(others.iter()) {
            let r = crate::kernels::find(name)
                .ok_or_else(|| Error::Usage(format!("no recipe `{name}`")))?;
            let p = d.join(format!("li_{name}.safetensors"));
            pack_on_host(r, &ck, &p, settings)?;
            let info = crate::verify_source(r.source, r.path, Some(&bind))?;
            let reads = crate::gemm_access::of_gemm(&info, "w13")
                .and_then(|(_, a)| a.paired)
                .map_or_else(|| "?".to_string(), |a| a.describe());
            packed.push((*name, p, reads));
        }
        for (ci, &(t, k, routing)) in cases.iter().enumerate() {
            let inp = d.join(format!("li_in{pi}_{ci}.safetensors"));
            inputs(rng, &inp, t, k, routing, DIMS4)?;
            let mut outs = Vec::new();
            for (name, p, _) in &packed {
                let output = d.join(format!("li_out_{name}_{ci}.safetensors"));
                let mut o = run_layer(settings, (p, &inp, &output), Device::Gpu, false, None)?;
                outs.push(o.remove("output").unwrap_or_default());
            }
            for (j, (name, _, reads)) in packed.iter().enumerate().skip(1) {
                let (a, b) = (&outs[0], &outs[j]);
                let same = !a.is_empty()
                    && a.len() == b.len()
                    && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                ok &= same;
                let _ = writeln!(
                    out,
                    "moe layout independence {name:<13} vs {base:<15} T={t:<4} k={k} {routing:?} (fused w13 reads {reads}): {}",
                    if same { "same bits: ok" } else { "FAIL (the outputs differ)" }
                );
            }
        }
    }
    Ok((out, ok))
}
