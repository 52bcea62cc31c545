//! How the GPU runtime runs a pack program's MAX all-reduce steps (host-side: CI has no GPU; the
//! two-GPU run is `moeforge selftest --gpu --nccl`): on one GPU every reduction is over one rank and
//! the identity; in a larger world each reduction over a group of several ranks goes through the
//! device collective, and one the collective cannot do refuses the whole program
//! (`Error::MissingCollective`), never a skipped step.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use moeforge::codegen::kir::Step;
use moeforge::runtime::collective::{DeviceCollective, Group, SingleDevice, Topology};
use moeforge::runtime::gpu_pack::{step_actions, StepAction};
use moeforge::runtime::Error;

/// The standard recipes whose programs reduce over moe_tp, planned as the GPU plans them.
fn reducing_programs() -> Vec<(&'static str, moeforge::codegen::kir::Program)> {
    let out: Vec<_> = moeforge::kernels::STANDARD
        .iter()
        .map(|r| {
            let prog =
                moeforge::pack_program(r.source, r.path, "E=2,H=128,I=128", &|_| true).unwrap();
            (r.name, prog)
        })
        .filter(|(_, p)| {
            p.steps.iter().any(|s| {
                matches!(
                    s,
                    Step::AllReduceMax {
                        group: Group::MoeTp,
                        ..
                    }
                )
            })
        })
        .collect();
    assert!(
        out.len() >= 2,
        "nvfp4_cutedsl and fp8_per_tensor reduce over moe_tp"
    );
    out
}

fn reductions(prog: &moeforge::codegen::kir::Program) -> Vec<(usize, Group)> {
    prog.steps
        .iter()
        .filter_map(|s| match s {
            Step::AllReduceMax { buf, group } => Some((buf.0 as usize, *group)),
            _ => None,
        })
        .collect()
}

#[test]
fn one_gpu_reduces_over_one_rank() {
    for (name, prog) in reducing_programs() {
        let got = step_actions(&prog, &|g| SingleDevice.size(g), &|g| {
            SingleDevice.supports(g)
        })
        .unwrap();
        assert_eq!(got.len(), prog.steps.len(), "{name}");
        let ids: Vec<(usize, Group)> = got
            .iter()
            .filter_map(|a| match *a {
                StepAction::Identity { buf, group } => Some((buf, group)),
                StepAction::Reduce { .. } => panic!("{name}: a reduction on one GPU"),
                StepAction::Launch(_) => None,
            })
            .collect();
        assert_eq!(ids, reductions(&prog), "{name}");
        let launches: Vec<usize> = got
            .iter()
            .filter_map(|a| match a {
                StepAction::Launch(n) => Some(*n),
                _ => None,
            })
            .collect();
        assert_eq!(launches, (0..prog.kernels().count()).collect::<Vec<_>>());
    }
}

#[test]
fn moe_tp_of_two_reduces_through_the_collective_or_is_refused() {
    let t = Topology { ep: 1, moe_tp: 2 };
    let size = |g: Group| t.members(g, 1).len();
    for (name, prog) in reducing_programs() {
        // A world whose collective has moe_tp's communicator (NcclWorld for [MoeTp]): every moe_tp
        // step is reduced, the others (ep, a group of one here) are the identity.
        let got = step_actions(&prog, &size, &|g| g == Group::MoeTp).unwrap();
        for (a, (buf, group)) in got
            .iter()
            .filter(|a| !matches!(a, StepAction::Launch(_)))
            .zip(reductions(&prog))
        {
            let want = if group == Group::MoeTp {
                StepAction::Reduce { buf, group }
            } else {
                StepAction::Identity { buf, group }
            };
            assert_eq!(*a, want, "{name}");
        }
        // Without it: refused, naming the group and its size.
        match step_actions(&prog, &size, &|_| false) {
            Err(Error::MissingCollective { group, size }) => {
                assert_eq!((group, size), ("moe_tp", 2), "{name}")
            }
            other => panic!("{name}: expected MissingCollective, got {other:?}"),
        }
        let msg = step_actions(&prog, &size, &|_| false)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("`moe_tp`, which has 2 ranks"), "{msg}");
    }
}
