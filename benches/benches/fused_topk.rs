//! The fused score + top-k kernel over the grid of the kernel issue: N in {1e5, 1e6}, d in {64, 600},
//! B in {1, 8, 64}, k in {10, 100}, each precision, on the best ISA of this CPU with 1 thread.
//! N=1e6 with d=600 (2.4 GB of fp32 weights, seconds per iteration) runs only with
//! RECSYS_BENCH_FULL=1. Peers (ONNX Runtime, numpy) and the floor: scripts/bench-kernels.sh.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use recsys_kernels::fused::{top_k, Exclusions, RowQuery};
use recsys_kernels::packed::{quantize_int8_per_row, to_f16_bits, PackedOutput};
use recsys_kernels::KernelTable;

fn lcg(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed;
    move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 0.2 - 0.1
    }
}

fn bench_fused(c: &mut Criterion) {
    let full = std::env::var("RECSYS_BENCH_FULL").is_ok_and(|v| v == "1");
    let table = KernelTable::detect();
    for n in [100_000usize, 1_000_000] {
        for d in [64usize, 600] {
            if n == 1_000_000 && d == 600 && !full {
                continue;
            }
            let mut next = lcg((n * d) as u64);
            let w: Vec<f32> = (0..n * d).map(|_| next()).collect();
            let b: Vec<f32> = (0..n).map(|_| next()).collect();
            let hidden: Vec<f32> = (0..64 * d).map(|_| next() * 10.0).collect();
            let (q, s) = quantize_int8_per_row(&w, d);
            let variants = [
                ("fp32", PackedOutput::from_f32(&w, &b, d)),
                ("fp16", PackedOutput::from_f16_bits(&to_f16_bits(&w), &b, d)),
                ("int8", PackedOutput::from_i8(&q, &s, &b, d)),
            ];
            drop(w);
            let mut group = c.benchmark_group(format!("fused_topk/{}/N{n}/d{d}", table.isa.name()));
            group.sample_size(10);
            group.warm_up_time(std::time::Duration::from_millis(300));
            group.measurement_time(std::time::Duration::from_secs(1));
            let none = Exclusions::default();
            for (name, packed) in &variants {
                for batch in [1usize, 8, 64] {
                    for k in [10usize, 100] {
                        let queries = vec![RowQuery::new(k, &none); batch];
                        group.throughput(Throughput::Elements((batch * n) as u64));
                        group.bench_with_input(
                            BenchmarkId::new(*name, format!("B{batch}/k{k}")),
                            &queries,
                            |bench, queries| {
                                bench
                                    .iter(|| top_k(table, packed, &hidden[..batch * d], queries, 1))
                            },
                        );
                    }
                }
            }
            group.finish();
        }
    }
}

criterion_group!(benches, bench_fused);
criterion_main!(benches);
