//! Hostile input to the command line never crashes, hangs or destroys data (issue \[5\] items 8-12):
//! unbounded files are refused with the limit named, an output that is an input or a device is
//! refused and left as it was, outputs honour the umask, duplicate bindings are errors, oversized
//! index maps are refused before any allocation, and non-finite weights are refused with the tensor,
//! expert and index named.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
use common::run;

use std::path::Path;
use std::process::Command;

use safetensors::tensor::{Dtype, TensorView};

/// A one-layer fused bf16 checkpoint (E=2, H=32, I=16); `poison` puts a NaN at w13[1, 3, 5].
fn checkpoint(path: &Path, poison: bool) {
    let (e, h, i) = (2usize, 32usize, 16usize);
    let mut w13: Vec<u8> = (0..e * 2 * i * h)
        .flat_map(|k| (0x3C00u16 + (k % 200) as u16).to_le_bytes())
        .collect();
    if poison {
        let k = (2 * i + 3) * h + 5;
        w13[2 * k..2 * k + 2].copy_from_slice(&0x7FC0u16.to_le_bytes());
    }
    let w2: Vec<u8> = (0..e * h * i)
        .flat_map(|k| (0x3C00u16 + (k % 100) as u16).to_le_bytes())
        .collect();
    let views = vec![
        (
            "model.layers.0.mlp.experts.w13_weight".to_string(),
            TensorView::new(Dtype::BF16, vec![e, 2 * i, h], &w13).unwrap(),
        ),
        (
            "model.layers.0.mlp.experts.w2_weight".to_string(),
            TensorView::new(Dtype::BF16, vec![e, h, i], &w2).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn unbounded_files_are_refused_with_the_limit_named() {
    if !Path::new("/dev/zero").exists() {
        return;
    }
    let (code, _, err) = run(&["check", "/dev/zero"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("read limit"), "{err}");
    let (code, _, err) = run(&["cache", "warmup", "--replay", "/dev/zero"]);
    assert_ne!(code, 0);
    assert!(err.contains("read limit"), "{err}");
}

#[test]
fn outputs_never_replace_an_input_or_a_device() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck.safetensors");
    checkpoint(&ck, false);
    let before = std::fs::read(&ck).unwrap();
    let c = ck.to_str().unwrap();
    let (code, _, err) = run(&["pack", "bf16", "--input", c, "--output", c]);
    assert_ne!(code, 0);
    assert!(err.contains("is the input"), "{err}");
    // Through a symbolic link too (same inode).
    #[cfg(unix)]
    {
        let link = dir.path().join("link.safetensors");
        std::os::unix::fs::symlink(&ck, &link).unwrap();
        let (code, _, err) = run(&[
            "pack",
            "bf16",
            "--input",
            c,
            "--output",
            link.to_str().unwrap(),
        ]);
        assert_ne!(code, 0);
        assert!(err.contains("is the input"), "{err}");
    }
    assert_eq!(
        std::fs::read(&ck).unwrap(),
        before,
        "the checkpoint was modified"
    );
    if Path::new("/dev/full").exists() {
        let (code, _, err) = run(&["pack", "bf16", "--input", c, "--output", "/dev/full"]);
        assert_ne!(code, 0);
        assert!(err.contains("not a regular file"), "{err}");
        let (code, _, err) = run(&[
            "compile",
            "bf16",
            "--bind",
            "E=1,H=64,I=64",
            "--target",
            "host",
            "-o",
            "/dev/full",
        ]);
        assert_ne!(code, 0);
        assert!(err.contains("not a regular file"), "{err}");
    }
}

#[cfg(unix)]
#[test]
fn outputs_honour_the_umask() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck.safetensors");
    checkpoint(&ck, false);
    let out = dir.path().join("out.safetensors");
    let bin = env!("CARGO_BIN_EXE_moeforge");
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "umask 022 && '{bin}' pack bf16 --input '{}' --output '{}'",
            ck.display(),
            out.display()
        ))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .unwrap();
    assert!(status.success());
    let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o644, "mode {mode:o}");
    // A --passthrough checkpoint directory, and the files in it, too.
    let dir_out = dir.path().join("packed");
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "umask 022 && '{bin}' pack bf16 --passthrough --input '{}' --output '{}'",
            ck.display(),
            dir_out.display()
        ))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .unwrap();
    assert!(status.success());
    let mode = std::fs::metadata(&dir_out).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o755, "directory mode {mode:o}");
    let shard = dir_out.join("ck.safetensors");
    let mode = std::fs::metadata(&shard).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o644, "shard mode {mode:o}");
}

#[test]
fn duplicate_bindings_are_errors() {
    let (code, _, err) = run(&["check", "bf16", "--bind", "E=1,H=64,I=64,E=5"]);
    assert_eq!(code, 1);
    assert!(err.contains("`E` is bound twice"), "{err}");
}

#[test]
fn huge_index_maps_are_refused_before_allocating() {
    let dir = tempfile::tempdir().unwrap();
    let r = dir.path().join("big.recipe");
    std::fs::write(
        &r,
        "recipe big(E: experts, H) {\n  input w : f32[E, H]\n  param p : f32[E, H] = w\n  view v = p @ (E,H,H,H):(H,1,0,0)\n}\n",
    )
    .unwrap();
    let t = std::time::Instant::now();
    let (code, _, err) = run(&[
        "check",
        r.to_str().unwrap(),
        "--bind",
        "E=1,H=100000",
        "--index-map",
        "v",
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("over the limit"), "{err}");
    let (code, _, err) = run(&[
        "check",
        r.to_str().unwrap(),
        "--bind",
        "E=1,H=4294967296",
        "--index-map",
        "v",
    ]);
    assert_ne!(code, 0, "{err}");
    assert!(
        t.elapsed().as_secs() < 30,
        "refusals must not enumerate the map"
    );
    // A small one streams the whole map.
    let (code, out, err) = run(&[
        "check",
        r.to_str().unwrap(),
        "--bind",
        "E=1,H=2",
        "--index-map",
        "v",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), "[0,0,0,0,1,1,1,1]");
}

#[test]
fn non_finite_weights_are_refused_with_the_place_named() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("nan.safetensors");
    checkpoint(&ck, true);
    let out = dir.path().join("out.safetensors");
    let args = [
        "pack",
        "fp8_per_tensor",
        "--input",
        ck.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ];
    let (code, _, err) = run(&args);
    assert_ne!(code, 0);
    assert!(
        err.contains("model.layers.0.mlp.experts.w13_weight")
            && err.contains("expert 1")
            && err.contains("[3, 5]"),
        "{err}"
    );
    assert!(!out.exists(), "nothing is written on failure");
    let mut allow = args.to_vec();
    allow.push("--allow-nonfinite");
    let (code, _, err) = run(&allow);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn a_non_bf16_expert_under_a_copying_recipe_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("mixed.safetensors");
    let (h, i) = (32usize, 16usize);
    let bf: Vec<u8> = (0..i * h)
        .flat_map(|k| (0x3C00u16 + (k % 50) as u16).to_le_bytes())
        .collect();
    let down: Vec<u8> = (0..h * i)
        .flat_map(|k| (0x3C00u16 + (k % 70) as u16).to_le_bytes())
        .collect();
    let mut views = Vec::new();
    for e in 0..2 {
        for (w, shape, data) in [
            ("gate_proj", vec![i, h], &bf),
            ("up_proj", vec![i, h], &bf),
            ("down_proj", vec![h, i], &down),
        ] {
            let dt = if e == 1 && w == "up_proj" {
                Dtype::F16
            } else {
                Dtype::BF16
            };
            views.push((
                format!("model.layers.0.mlp.experts.{e}.{w}.weight"),
                TensorView::new(dt, shape, data).unwrap(),
            ));
        }
    }
    safetensors::serialize_to_file(views, None, &ck).unwrap();
    let out = dir.path().join("out.safetensors");
    let (code, _, err) = run(&[
        "pack",
        "bf16",
        "--input",
        ck.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert_ne!(code, 0);
    assert!(
        err.contains("model.layers.0.mlp.experts.1.up_proj.weight") && err.contains("F16"),
        "{err}"
    );
}

#[test]
fn index_width_at_exactly_2_31_elements_fits() {
    let dir = tempfile::tempdir().unwrap();
    let r = dir.path().join("w.recipe");
    std::fs::write(&r, "recipe w(E: experts, H) {\n  input x : u8[E, H]\n  param p : u8[E, H] = x\n  kernel k(p) on sm_90a index i32\n}\n").unwrap();
    let (code, _, err) = run(&["check", r.to_str().unwrap(), "--bind", "E=1,H=2147483648"]);
    assert_eq!(code, 0, "the largest offset 2^31 - 1 fits i32: {err}");
    let (code, _, err) = run(&["check", r.to_str().unwrap(), "--bind", "E=1,H=2147483649"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("largest offset 2147483648 exceeds 2147483647"),
        "{err}"
    );
}

#[test]
fn broadcast_views_are_not_called_injective() {
    let dir = tempfile::tempdir().unwrap();
    let r = dir.path().join("b.recipe");
    std::fs::write(&r, "recipe b(E: experts, H) {\n  input w : f32[E, H]\n  param p : f32[E, H] = w\n  view v = p @ (E,H,2):(H,1,0)\n}\n").unwrap();
    for bind in [None, Some("E=2,H=4")] {
        let mut args = vec!["check", r.to_str().unwrap(), "--json"];
        if let Some(b) = bind {
            args.extend(["--bind", b]);
        }
        let (code, out, err) = run(&args);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            v["views"][0]["injective"],
            serde_json::json!(false),
            "{out}"
        );
    }
}
