//! The demo's EPLB round on the host: plan from a skewed load, rearrange a packed NVFP4 layer over
//! four in-process EP ranks, and check the contract (the round errs when a param differs).

#![allow(clippy::unwrap_used)]

#[test]
fn the_eplb_round_improves_balance_and_keeps_the_contract() {
    let mut out = String::new();
    moeforge::demo_eplb::run(&mut out, &Default::default(), &Default::default()).unwrap();
    assert!(
        out.contains("== packing the checkpoint placed as the new placement"),
        "{out}"
    );
    let line = out.lines().find(|l| l.contains("balancedness")).unwrap();
    let nums: Vec<f32> = line
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|w| w.parse().ok())
        .collect();
    assert!(nums[1] > nums[0], "balancedness must improve: {line}");
}
