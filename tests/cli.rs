//! The `moeforge` command end to end: `check` (human, `--json`, `--index-map`), errors and `demo`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

fn moeforge(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_moeforge"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn check_json_schema_and_values() {
    let (code, out, err) = moeforge(&[
        "check",
        "kernels/nvfp4_cutedsl.recipe",
        "--bind",
        "E=8,H=2048,I=768",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["recipe"], "nvfp4_cutedsl");
    let params = v["params"].as_array().unwrap();
    let p = |n: &str| params.iter().find(|p| p["name"] == n).unwrap().clone();
    for p in params {
        for k in ["name", "dtype", "shape", "layout", "bytes_per_expert"] {
            assert!(p.get(k).is_some(), "param lacks {k}: {p}");
        }
    }
    // FP4 counts elements, not bytes; the swizzled scale param has its padded storage shape.
    assert_eq!(p("w13_weight")["dtype"], "e2m1");
    assert_eq!(p("w13_weight")["shape"], serde_json::json!([8, 1536, 2048]));
    assert_eq!(p("w13_weight")["bytes_per_expert"], 1536 * 2048 / 2);
    assert_eq!(p("w13_weight_scale")["dtype"], "e4m3");
    assert_eq!(
        p("w13_weight_scale")["shape"],
        serde_json::json!([8, 1536, 128])
    );
    assert_eq!(
        p("w2_weight_scale")["shape"],
        serde_json::json!([8, 2048, 48])
    );
    assert_eq!(p("w13_weight_scale_2")["dtype"], "f32");
    assert_eq!(p("w13_weight_scale_2")["bytes_per_expert"], 4);
    assert_eq!(p("w13_weight")["layout"], "(8,1536,2048):(3145728,2048,1)");
    let views = v["views"].as_array().unwrap();
    let mma = views.iter().find(|x| x["name"] == "w13_scale_mma").unwrap();
    assert_eq!(mma["source"], "w13_weight_scale");
    assert_eq!(mma["shape"], serde_json::json!([32, 4, 12, 4, 32, 8]));
    assert_eq!(
        mma["stride"],
        serde_json::json!([16, 4, 16384, 1, 512, 196608])
    );
    assert_eq!(mma["bijective"], true);
    assert_eq!(mma["layout"], "(32,4,12,4,32,8):(16,4,16384,1,512,196608)");
    let moves = v["move_set"].as_array().unwrap();
    assert_eq!(moves.len(), params.len());
    assert!(moves
        .iter()
        .all(|m| m["param"].is_string() && m["bytes_per_expert"].is_number()));
}

#[test]
fn check_reports_the_activation_scheme() {
    let (code, out, err) = moeforge(&["check", "kernels/fp8_per_tensor.recipe", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let a = &v["activation"];
    assert_eq!(a["scheme"], "fp8");
    assert_eq!(a["dtype"], "e4m3");
    assert_eq!(a["declared"], true);
    assert_eq!(
        a["text"],
        "fp8(static(w13 = w13_input_scale, w2 = w2_input_scale) else per_token)"
    );
    let g = &a["gemms"][1];
    assert_eq!(g["gemm"], "w2");
    assert_eq!(g["weight"], "w2_weight");
    assert_eq!(g["weight_dtype"], "e4m3");
    assert_eq!(
        g["scales"],
        serde_json::json!([{"kind": "per_token"}, {"kind": "static", "param": "w2_input_scale", "optional": true}])
    );
    let (code, out, err) = moeforge(&["check", "kernels/fp8_block128.recipe"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("activation fp8(per_token_group = 128) (declared; SPEC §9)"),
        "{out}"
    );
    assert!(out.contains("per_token_group 128"), "{out}");
    let (code, out, err) = moeforge(&["check", "kernels/layouts/bf16_tiled.recipe"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("activation bf16 (not declared: bf16 by default; SPEC §9)"),
        "{out}"
    );
}

#[test]
fn check_json_without_binding_reports_what_needs_one() {
    let (code, out, _) = moeforge(&["check", "kernels/fp8_block128.recipe", "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["binding"].is_null());
    let p = &v["params"][1];
    assert_eq!(p["name"], "w13_weight_scale_inv");
    assert!(p["shape"].is_null());
    assert_eq!(
        p["shape_symbolic"],
        serde_json::json!(["E", "ceil_div(2*I, 128)", "ceil_div(H, 128)"])
    );
    assert!(p["bytes_per_expert"].is_null());
}

#[test]
fn index_map_is_row_major_over_the_view() {
    let (code, out, err) = moeforge(&[
        "check",
        "kernels/nvfp4_cutedsl.recipe",
        "--bind",
        "E=3,H=128,I=128",
        "--index-map",
        "w13_scale_mma",
    ]);
    assert_eq!(code, 0, "{err}");
    let map: Vec<i64> = serde_json::from_str(&out).unwrap();
    assert_eq!(map.len(), 32 * 4 * 2 * 4 * 2 * 3);
    let shape = [32usize, 4, 2, 4, 2, 3];
    let flat = |idx: [usize; 6]| idx.iter().zip(shape).fold(0, |a, (i, s)| a * s + i);
    assert_eq!(map[flat([8, 2, 1, 1, 1, 2])], 5769);
    assert_eq!(map[0], 0);
    assert_eq!(map[1], 2048); // last index (the expert) is fastest
    let mut sorted = map.clone();
    sorted.sort();
    assert_eq!(sorted, (0..map.len() as i64).collect::<Vec<_>>());
}

#[test]
fn index_map_of_a_slice_view() {
    let (code, out, _) = moeforge(&[
        "check",
        "bf16",
        "--bind",
        "E=2,H=8,I=8",
        "--index-map",
        "w13_up",
    ]);
    assert_eq!(code, 0);
    let map: Vec<i64> = serde_json::from_str(&out).unwrap();
    // w13_up = w13_weight[:, I:2*I, :] of [2, 16, 8]: element (e, r, c) -> e*128 + (8 + r)*8 + c.
    let mut want = Vec::new();
    for e in 0..2 {
        for r in 0..8 {
            for c in 0..8 {
                want.push(e * 128 + (8 + r) * 8 + c);
            }
        }
    }
    assert_eq!(map, want);
}

#[test]
fn human_report_lists_params_views_and_move_set() {
    let (code, out, _) = moeforge(&[
        "check",
        "kernels/nvfp4_cutedsl.recipe",
        "--bind",
        "E=8,H=2048,I=768",
    ]);
    assert_eq!(code, 0);
    for needle in [
        "w13_weight ",
        "(8,1536,2048):(3145728,2048,1)",
        "w13_scale_mma",
        "(32,4,12,4,32,8):(16,4,16384,1,512,196608)",
        "symbolic (claimed)",
        "move set",
        "total",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in\n{out}");
    }
}

#[test]
fn errors_render_on_stderr_with_exit_code_1() {
    let (code, out, err) = moeforge(&["check", "tests/golden/diagnostics/06_view_computes.recipe"]);
    assert_eq!(code, 1);
    assert!(out.is_empty());
    let golden =
        std::fs::read_to_string("tests/golden/diagnostics/06_view_computes.stderr").unwrap();
    assert_eq!(err, golden);
    assert!(err.contains("06_view_computes.recipe:7:20"));
}

#[test]
fn bad_bindings_and_missing_files_fail_cleanly() {
    let (code, _, err) = moeforge(&["check", "kernels/bf16.recipe", "--bind", "E=8,H=2048"]);
    assert_eq!(code, 1);
    assert!(err.contains("missing binding for dimension `I`"), "{err}");
    let (code, _, err) = moeforge(&["check", "kernels/bf16.recipe", "--bind", "E=8,X=1,H=8,I=8"]);
    assert_eq!(code, 1);
    assert!(err.contains("`X` is not a dimension"), "{err}");
    let (code, _, err) = moeforge(&["check", "no/such/file.recipe"]);
    assert_eq!(code, 1);
    assert!(err.contains("no/such/file.recipe"), "{err}");
    let (code, _, err) = moeforge(&[
        "check",
        "bf16",
        "--bind",
        "E=2,H=8,I=8",
        "--index-map",
        "nope",
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("no view `nope`"), "{err}");
    let (code, _, err) = moeforge(&["check", "bf16", "--index-map", "w13_up"]);
    assert_eq!(code, 1);
    assert!(err.contains("needs --bind"), "{err}");
}

#[test]
fn demo_checks_every_standard_recipe() {
    // A 2-expert pack keeps this debug-build test fast; the verification still uses E=128.
    let (code, out, err) = moeforge(&["demo", "--experts", "2"]);
    assert_eq!(code, 0, "{err}");
    for r in moeforge::kernels::STANDARD {
        assert!(out.contains(r.name), "demo lacks {}", r.name);
    }
    assert!(out.contains("E=128, H=2048, I=768"));
    assert!(out.contains("packing a synthetic layer (E=2, H=2048, I=768"));
    assert!(out.contains("nvfp4_cutedsl") && out.contains("max |x-x'| / amax"));
    // The MoE layer round: every standard recipe's forward through `moe run`, against f64 with the
    // bf16 weights (bf16 itself within the rounding of its output), and where it ran.
    let round: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("MoE layer forward (SPEC §9"))
        .take(2 + moeforge::kernels::STANDARD.len())
        .collect();
    assert_eq!(round.len(), 2 + moeforge::kernels::STANDARD.len(), "{out}");
    for (line, r) in round[2..].iter().zip(moeforge::kernels::STANDARD) {
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(cols[0], r.name, "{line}");
        let err: f64 = cols[1].parse().unwrap();
        // Per scheme, tighter than the demo's own sanity bound of 0.25 (measured: bf16 2.4e-3,
        // FP8 6.1e-2, int8 7.0e-3, INT4 1.3e-1, NVFP4 and MXFP4 1.8e-1; the layer is deterministic).
        let bound = match r.name {
            "bf16" => 1e-2,
            "int8_per_row" => 2e-2,
            "fp8_per_tensor" | "fp8_block128" => 1e-1,
            "int4_g128" => 1.5e-1,
            _ => 0.2,
        };
        assert!(err < bound, "{line}");
        if !moeforge::runtime::device::driver_present() {
            assert!(line.ends_with("no Hopper GPU: host only"), "{line}");
        }
    }
}

#[test]
fn the_nccl_selftest_without_two_gpus_skips_and_keeps_nvls_off() {
    if moeforge::runtime::device::driver_present() {
        return; // run by the lead on a two-GPU machine: `moeforge selftest --gpu --nccl`
    }
    let run = |nvls: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_moeforge"));
        c.args(["selftest", "--gpu", "--nccl"]);
        match nvls {
            Some(v) => c.env("NCCL_NVLS_ENABLE", v),
            None => c.env_remove("NCCL_NVLS_ENABLE"),
        };
        let o = c.output().unwrap();
        (o.status.code(), String::from_utf8(o.stdout).unwrap())
    };
    let (code, out) = run(None);
    assert_eq!(code, Some(0), "{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[0], "NCCL_NVLS_ENABLE=0 (set by moeforge: it was unset)",
        "{out}"
    );
    assert!(
        lines[1].starts_with("SKIPPED: the NCCL self-test needs 2 CUDA GPUs"),
        "{out}"
    );
    // A value the caller set is left alone.
    let (code, out) = run(Some("0"));
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.starts_with("NCCL_NVLS_ENABLE=0 (from the environment)"),
        "{out}"
    );
    // --nccl is a kind of GPU self-test.
    let (code, _, err) = moeforge(&["selftest", "--nccl"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--gpu"), "{err}");
}

#[test]
fn gpu_commands_without_a_gpu_say_so() {
    if moeforge::runtime::device::driver_present() {
        return; // covered by `moeforge selftest --gpu` on the GPU machine
    }
    let (code, out, _) = moeforge(&["selftest", "--gpu"]);
    assert_eq!(code, 0);
    assert!(
        out.starts_with("SKIPPED: GPU self-test needs a CUDA GPU"),
        "{out}"
    );
    let (code, out, _) = moeforge(&["bench", "--gpu"]);
    assert_eq!(code, 0);
    assert!(out.contains("SKIPPED"), "{out}");
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let run = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_moeforge"))
            .args(args)
            .env("MOEFORGE_CACHE_DIR", &cache)
            // The driver's JIT, asked for by name: with no device its cubin step is skipped (the
            // default, auto, compiles cubins with a ptxas where there is one: below).
            .env("MOEFORGE_JIT", "driver")
            .output()
            .unwrap();
        (
            o.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let manifest = dir.path().join("warm.tsv");
    let (code, out, err) = run(&[
        "cache",
        "warmup",
        "nvfp4_cutedsl",
        "--bind",
        "E=8,H=2048,I=768",
        "--manifest",
        manifest.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("ptx Compiled; cubin step skipped (no CUDA device"),
        "{out}"
    );
    // One PTX entry per kernel of the program (kernels are the unit of caching and JIT).
    let kernels = moeforge::pack_program(
        moeforge::kernels::STANDARD
            .iter()
            .find(|r| r.name == "nvfp4_cutedsl")
            .unwrap()
            .source,
        "nvfp4_cutedsl",
        "E=8,H=2048,I=768",
        &|_| true,
    )
    .unwrap()
    .kernels()
    .count();
    assert!(kernels > 1);
    let (code, out, _) = run(&["cache", "ls"]);
    assert_eq!(code, 0);
    assert!(
        out.starts_with(&format!("{kernels} entries"))
            && out.contains(" ok")
            && !out.contains("CORRUPT"),
        "{out}"
    );
    let (code, out, _) = run(&["cache", "warmup", "--replay", manifest.to_str().unwrap()]);
    assert_eq!(code, 0);
    assert!(out.contains("ptx Disk"), "{out}");
    let (code, out, _) = run(&["cache", "clear"]);
    assert_eq!(
        (code, out.trim()),
        (0, format!("removed {kernels} entries").as_str())
    );
    let (code, _, err) = moeforge(&[
        "pack",
        "bf16",
        "--input",
        "nothing.safetensors",
        "--output",
        "x.safetensors",
        "--device",
        "gpu",
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("nothing.safetensors"), "{err}");
}

#[test]
fn warmup_with_ptxas_fills_cubins_without_a_gpu() {
    // MOEFORGE_JIT=ptxas compiles cubins with a ptxas on the machine, keyed by its release, so a
    // machine without a GPU can fill them; scripts/test provides ptxas through MOEFORGE_PTXAS.
    if moeforge::runtime::device::driver_present() {
        return; // with a GPU the modules are loaded too: `scripts/gpu-check` runs that path
    }
    let Some(ptxas) = std::env::var_os("MOEFORGE_PTXAS") else {
        assert!(
            std::env::var_os("MOEFORGE_REQUIRE_PTXAS").is_none(),
            "MOEFORGE_REQUIRE_PTXAS is set but MOEFORGE_PTXAS is not"
        );
        eprintln!("skipped: no ptxas (set MOEFORGE_PTXAS; scripts/test does)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str], jit: &str| {
        let o = Command::new(env!("CARGO_BIN_EXE_moeforge"))
            .args(args)
            .env("MOEFORGE_CACHE_DIR", dir.path())
            .env("MOEFORGE_JIT", jit)
            .env("MOEFORGE_PTXAS", &ptxas)
            .output()
            .unwrap();
        (
            o.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let warm = ["cache", "warmup", "mxfp4", "--bind", "E=4,H=256,I=128"];
    let (code, out, err) = run(&warm, "ptxas");
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("ptx Compiled, cubin Compiled by"), "{out}");
    let (code, out, _) = run(&warm, "ptxas");
    assert_eq!(code, 0);
    assert!(out.contains("ptx Disk, cubin Disk by"), "{out}");
    let (_, ls, _) = run(&["cache", "ls"], "driver");
    let cubins = ls.lines().filter(|l| l.starts_with("cubin")).count();
    let ptx = ls.lines().filter(|l| l.starts_with("ptx")).count();
    assert!(cubins > 0 && cubins == ptx, "{ls}");
    // The driver's JIT cannot run here: it skips the cubin step, and a bad setting is an error.
    let (code, out, _) = run(&warm, "driver");
    assert_eq!(code, 0);
    assert!(out.contains("cubin step skipped"), "{out}");
    let (code, _, err) = run(&warm, "nvcc");
    assert_eq!(code, 1);
    assert!(err.contains("MOEFORGE_JIT=`nvcc`"), "{err}");
}

/// `moeforge plot`: the recorded H200 report (docs/) draws every model and recipe; a bad report is
/// a named error with nothing written; `--plot` belongs to the MoE benchmark.
#[test]
fn plot_draws_a_report_and_refuses_bad_ones() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("layer.svg");
    let (code, out, err) = moeforge(&[
        "plot",
        "docs/bench_moe_h200_413c1d4.json",
        "-o",
        svg.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("54 rows"), "{out}");
    let text = std::fs::read_to_string(&svg).unwrap();
    for label in [
        "qwen3-30b-a3b",
        "deepseek-v3-ep8",
        "mixtral-8x7b",
        "moeforge fp8_block128",
        "torch bf16 layer (same call)",
    ] {
        assert!(text.contains(label), "{label}");
    }
    // The committed plot is this report's.
    assert_eq!(
        text,
        std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/moe_layer_h200.svg")
        )
        .unwrap()
    );
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, r#"{"rows": [{"model": "m"}]}"#).unwrap();
    let none = dir.path().join("none.svg");
    let (code, _, err) = moeforge(&["plot", bad.to_str().unwrap(), "-o", none.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("row 0 of the MoE benchmark report"), "{err}");
    assert!(!none.exists());
    let (code, _, err) = moeforge(&["bench", "--gpu", "--gemm", "--plot", "x.svg"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("--plot draws the MoE layer benchmark"),
        "{err}"
    );
}

/// `check --bind` says how the GPU layer's GEMMs read each weight (issue [8] item 2): the standard
/// bf16 recipe in place (the compact rank-3 map; the fused paired order through row modes 8 x 2),
/// a column-major FP8 weight from a re-laid copy because K is not contiguous, 4-bit codes from a
/// copy in the kernel's order; the human report says the same, and without a binding it says that
/// a binding decides.
#[test]
fn check_says_how_the_gemms_read_each_weight() {
    let reads = |recipe: &str| -> serde_json::Value {
        let (code, out, err) = moeforge(&["check", recipe, "--bind", "E=8,H=2048,I=768", "--json"]);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v["activation"]["gemms"].clone()
    };
    let bf16 = reads("bf16");
    let w13 = &bf16[0]["reads"];
    assert_eq!(w13["plain"]["in_place"], true);
    assert_eq!(w13["plain"]["rank"], 3);
    assert_eq!(
        w13["plain"]["strides"],
        serde_json::json!([4096, 4096 * 1536])
    );
    assert_eq!(w13["fused"]["rank"], 5);
    assert_eq!(w13["fused"]["row_modes"], serde_json::json!([8, 2]));
    assert_eq!(w13["fused"]["up_first"], false);
    assert_eq!(bf16[1]["reads"]["fused"], serde_json::Value::Null);
    let col = reads("fp8_colmajor");
    let why = col[0]["reads"]["plain"]["why"].as_str().unwrap();
    assert!(why.contains("not contiguous along K"), "{why}");
    let fp4 = reads("nvfp4_cutedsl");
    assert_eq!(fp4[0]["reads"]["plain"]["in_place"], false);
    assert!(fp4[0]["reads"]["plain"]["why"]
        .as_str()
        .unwrap()
        .contains("kernel's own order"));
    let (code, human, _) = moeforge(&["check", "bf16", "--bind", "E=8,H=2048,I=768"]);
    assert_eq!(code, 0);
    assert!(
        human.contains("weights read by the GEMMs (at the binding)"),
        "{human}"
    );
    assert!(
        human.contains("`w13_weight` in place, a rank-5 TMA map (row modes 8 x 2 then the rest)"),
        "{human}"
    );
    let (_, unbound, _) = moeforge(&["check", "bf16"]);
    assert!(unbound.contains("decided at a binding"), "{unbound}");
}
