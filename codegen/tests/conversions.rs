//! The IR's E4M3 and E2M1 conversions (bit manipulation and threshold sums) against the reference
//! (table search, SPEC's thresholds) on every midpoint, its neighbours and random values, run by the
//! interpreter and by the Cranelift backend.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use moeforge_codegen::kir::{e, Buf, BufId, BufRole, Elem, Program, Step, Stmt, Ty, VarAlloc};
use moeforge_codegen::quant::{self, clamp, Emit};
use moeforge_codegen::{host, interp, reference as r, SingleProcess};

fn program(n: usize, which: &str) -> Program {
    let mut va = VarAlloc::default();
    let item = va.new_var(Ty::I64);
    let body = {
        let mut em = Emit::new(&mut va);
        let x = e::load(BufId(0), e::v(item));
        let code = if which == "e4m3" {
            quant::e4m3_rne(&mut em, clamp(x, -448.0, 448.0))
        } else {
            quant::e2m1_rne(&mut em, clamp(x, -6.0, 6.0))
        };
        em.out.push(Stmt::Store {
            buf: BufId(1),
            index: e::v(item),
            value: code,
        });
        em.out
    };
    Program {
        recipe: "conv".into(),
        bufs: vec![
            Buf {
                role: BufRole::Input("x".into()),
                elem: Elem::F32,
                len: n,
                zeroed: false,
            },
            Buf {
                role: BufRole::Param("q".into()),
                elem: Elem::U8,
                len: n,
                zeroed: false,
            },
        ],
        steps: vec![Step::Kernel(va.kernel(
            format!("conv_{which}"),
            item,
            n as i64,
            body,
        ))],
    }
}

fn inputs(grid: &[f32]) -> Vec<f32> {
    let mut xs = Vec::new();
    for w in grid.windows(2) {
        let mid = (w[0] + w[1]) / 2.0;
        for v in [w[0], mid, w[1]] {
            for d in [-2i32, -1, 0, 1, 2] {
                let b = (v.to_bits() as i32 + d).max(0) as u32;
                let x = f32::from_bits(b);
                xs.push(x);
                xs.push(-x);
            }
        }
    }
    let mut s = 0x9E3779B97F4A7C15u64;
    for _ in 0..20000 {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let x = f32::from_bits((s as u32 & 0x3FFF_FFFF) | ((s >> 32) as u32 & 0x8000_0000));
        if x.is_finite() && x.abs() < 1000.0 {
            xs.push(x);
        }
    }
    xs.extend([0.0, -0.0, 448.0, 464.0, 500.0, 6.0, 7.0, 1e-30, -1e-30]);
    xs
}

fn check(which: &str, grid: Vec<f32>, reference: fn(f32) -> u8) {
    let xs = inputs(&grid);
    let prog = program(xs.len(), which);
    let bytes: Vec<u8> = xs.iter().flat_map(|v| v.to_le_bytes()).collect();
    let want: Vec<u8> = xs.iter().map(|&x| reference(x)).collect();
    let mut bufs = moeforge_codegen::alloc_buffers(&prog, &mut |_| Some(bytes.clone())).unwrap();
    interp::run(&prog, &mut bufs, &SingleProcess).unwrap();
    for (k, x) in xs.iter().enumerate() {
        assert_eq!(
            bufs[1][k],
            want[k],
            "interp {which}({x:e}) bits {:#x}",
            x.to_bits()
        );
    }
    let mut bufs = moeforge_codegen::alloc_buffers(&prog, &mut |_| Some(bytes.clone())).unwrap();
    host::compile(&prog)
        .unwrap()
        .run(&mut bufs, &SingleProcess, 2)
        .unwrap();
    assert_eq!(bufs[1], want, "host {which}");
}

#[test]
fn e4m3_matches_reference() {
    let grid: Vec<f32> = (0u8..=0x7E).map(r::e4m3_to_f32).collect();
    check("e4m3", grid, |x| r::e4m3_from_f32(x.clamp(-448.0, 448.0)));
}

#[test]
fn e2m1_matches_reference() {
    let grid: Vec<f32> = (0u8..8).map(r::e2m1_to_f32).collect();
    check("e2m1", grid, |x| r::e2m1_from_f32(x.clamp(-6.0, 6.0)));
}
