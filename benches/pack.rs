//! Host pack throughput (criterion): NVFP4 and FP8 per-tensor packing of an 8-expert slice of a
//! Qwen3-30B-A3B layer through the Cranelift backend, beside a memcpy of the same bytes. Throughput is
//! reported per byte of bf16 input. Run: `cargo bench --bench pack`.

use std::collections::HashMap;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use moeforge::bench::Layer;

fn bench(c: &mut Criterion) {
    let layer = Layer::synthetic(8, 2048, 768, 3);
    let mut g = c.benchmark_group("pack");
    g.throughput(Throughput::Bytes(layer.bytes() as u64));
    g.sample_size(10);
    let src: Vec<u8> = [layer.w13.clone(), layer.w2.clone()].concat();
    let mut dst = vec![0u8; src.len()];
    g.bench_function("memcpy", |b| {
        b.iter(|| dst.copy_from_slice(std::hint::black_box(&src)))
    });
    let inputs: HashMap<&str, &Vec<u8>> = [("w13", &layer.w13), ("w2", &layer.w2)]
        .into_iter()
        .collect();
    for name in ["nvfp4_cutedsl", "fp8_per_tensor"] {
        let Some(r) = moeforge::kernels::find(name) else {
            continue;
        };
        let Ok(info) = moeforge::check_source(r.source, r.path, Some("E=8,H=2048,I=768")) else {
            continue;
        };
        let Ok(prog) = moeforge::codegen::plan::plan_with(
            &info,
            &|n: &str| inputs.contains_key(n),
            &|_| false,
            true,
        ) else {
            continue;
        };
        let Ok(compiled) = moeforge::codegen::host::compile(&prog) else {
            continue;
        };
        let Ok(mut bufs) =
            moeforge::codegen::alloc_buffers(&prog, &mut |n| inputs.get(n).map(|b| (*b).clone()))
        else {
            continue;
        };
        g.bench_function(name, |b| {
            b.iter(|| {
                compiled
                    .run(&mut bufs, &moeforge::codegen::SingleProcess, 0)
                    .is_ok()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
