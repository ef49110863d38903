//! Whole-model cost at B=1 and B=64 on the fixture models: the forward pass (hidden vectors), and
//! the full request path (forward + scoring every item + top-10 with exclusions).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use recsys_benches::{fixture_engine, test_histories};
use recsys_engine::{InternalRequest, ModelKind};

fn bench_models(c: &mut Criterion) {
    for kind in [ModelKind::Bert4rec, ModelKind::Vaecf] {
        let (engine, _guard) = fixture_engine(kind);
        let histories = test_histories(&engine, 64);
        let mut group = c.benchmark_group(format!("{kind}"));
        for batch in [1usize, 64] {
            let refs: Vec<&[u32]> = histories[..batch].iter().map(Vec::as_slice).collect();
            group.throughput(Throughput::Elements(batch as u64));
            group.bench_with_input(BenchmarkId::new("encode", batch), &refs, |b, refs| {
                b.iter(|| engine.model.encode(refs))
            });
            let requests: Vec<InternalRequest> = histories[..batch]
                .iter()
                .map(|h| InternalRequest {
                    history: h.clone(),
                    exclude: Vec::new(),
                    k: 10,
                    exclude_seen: true,
                    candidates: None,
                    embedding: false,
                    eligible: None,
                    popular: false,
                    timestamps: Vec::new(),
                    query_timestamp: 0,
                })
                .collect();
            group.bench_with_input(
                BenchmarkId::new("recommend_top10", batch),
                &requests,
                |b, reqs| b.iter(|| engine.recommend_internal(reqs)),
            );
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    // Short runs: the machine is small and shared; medians over 20 samples are stable enough.
    config = Criterion::default().sample_size(20).warm_up_time(std::time::Duration::from_secs(1)).measurement_time(std::time::Duration::from_secs(3));
    targets = bench_models
}
criterion_main!(benches);
