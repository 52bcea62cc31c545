//! Parse + lower + verify time of every standard recipe, unbound (symbolic proofs only) and bound at
//! a Qwen3-30B-A3B layer. Run: `cargo bench --bench check`.

use criterion::{criterion_group, criterion_main, Criterion};
use moeforge::kernels::{QWEN3_30B_A3B, STANDARD};
use std::hint::black_box;

fn bench(c: &mut Criterion) {
    let bind: Vec<(String, i64)> = QWEN3_30B_A3B
        .iter()
        .map(|(k, v)| (k.to_string(), *v))
        .collect();
    let mut g = c.benchmark_group("check");
    for r in STANDARD {
        g.bench_function(format!("{}/symbolic", r.name), |b| {
            b.iter(|| black_box(moeforge::dsl::check(black_box(r.source), None).is_ok()))
        });
        g.bench_function(format!("{}/bound", r.name), |b| {
            b.iter(|| black_box(moeforge::dsl::check(black_box(r.source), Some(&bind)).is_ok()))
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
