//! `moeforge eplb plan`: docs/FORMATS.md §6's worked example end to end, and refusals.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
use common::run;

#[test]
fn plan_reproduces_the_worked_example() {
    let dir = tempfile::tempdir().unwrap();
    let loads = dir.path().join("loads.json");
    std::fs::write(
        &loads,
        "[[90,132,40,61,104,165,39,4,73,56,183,86],[20,107,104,64,19,197,187,157,172,86,16,27]]",
    )
    .unwrap();
    let l = loads.to_str().unwrap();
    let args = [
        "eplb",
        "plan",
        "--loads",
        l,
        "--replicas",
        "16",
        "--groups",
        "4",
        "--nodes",
        "2",
        "--gpus",
        "8",
    ];
    let mut json = args.to_vec();
    json.push("--json");
    let (code, out, err) = run(&json);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v["phy2log"],
        serde_json::json!([
            [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
            [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]
        ])
    );
    assert_eq!(
        v["logcnt"][0],
        serde_json::json!([1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1])
    );
    assert_eq!(v["log2phy"][0][1], serde_json::json!([15, 13]));
    let (code, out, _) = run(&args);
    assert_eq!(code, 0);
    assert!(out.contains("layer 1: balancedness"), "{out}");
    // R not a multiple of P, and a file that is not a list of lists.
    let (code, _, err) = run(&[
        "eplb",
        "plan",
        "--loads",
        l,
        "--replicas",
        "15",
        "--gpus",
        "8",
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("must divide by GPUs"), "{err}");
    std::fs::write(&loads, "{\"a\": 1}").unwrap();
    let (code, _, err) = run(&[
        "eplb",
        "plan",
        "--loads",
        l,
        "--replicas",
        "16",
        "--gpus",
        "8",
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("list of per-layer lists"), "{err}");
}
