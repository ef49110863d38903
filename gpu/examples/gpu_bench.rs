//! Times the fused score + top-k kernel on the GPU (N = 1e6 items, d = 64, k = 100; batch 1 and 64;
//! fp32 and fp16 weights), and the device's copy bandwidth, and writes the weights and hidden
//! vectors it used so scripts/gpu_bench_torch.py can time torch.matmul + torch.topk on the same
//! data. Prints one JSON object. Run by scripts/gpu-check.sh on a lent GPU machine.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use recsys_engine::tensor::Tensor;
use recsys_engine::weights::Matrix;
use recsys_gpu::cuda::GpuOutputLayer;

fn main() {
    let out_dir = std::env::args().nth(1).expect("usage: gpu_bench OUT_DIR");
    let (n, d, k) = (1_000_000usize, 64usize, 100usize);
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let weights: Vec<f32> = (0..n * d).map(|_| uniform() * 0.1).collect();
    let bias: Vec<f32> = (0..n).map(|_| uniform() * 0.01).collect();
    let hidden: Vec<f32> = (0..64 * d).map(|_| uniform()).collect();
    let dump = |name: &str, v: &[f32]| {
        let mut f = std::fs::File::create(format!("{out_dir}/{name}.f32")).unwrap();
        for x in v {
            f.write_all(&x.to_le_bytes()).unwrap();
        }
    };
    dump("weights", &weights);
    dump("bias", &bias);
    dump("hidden", &hidden);
    let f16: Vec<u16> = weights
        .iter()
        .map(|v| half::f16::from_f32(*v).to_bits())
        .collect();
    let bias_t = Tensor::from_vec(vec![n], bias);
    let variants = [
        ("fp32", Matrix::F32(Tensor::from_vec(vec![n, d], weights))),
        (
            "fp16",
            Matrix::F16 {
                bits: Arc::new(f16),
                start: 0,
                rows: n,
                cols: d,
            },
        ),
    ];
    let mut results = Vec::new();
    for (name, w) in &variants {
        let layer = GpuOutputLayer::new(0, w, &bias_t).expect("GPU");
        let bytes_per_row = if *name == "fp32" { 4 } else { 2 } * d + 4;
        for rows in [1usize, 64] {
            let excluded: Vec<&[u32]> = vec![&[]; rows];
            let h = &hidden[..rows * d];
            for _ in 0..5 {
                layer.topk(h, k, &excluded).unwrap();
            }
            let mut times = Vec::new();
            for _ in 0..30 {
                let t = Instant::now();
                layer.topk(h, k, &excluded).unwrap();
                times.push(t.elapsed().as_secs_f64());
            }
            times.sort_by(f64::total_cmp);
            let median = times[times.len() / 2];
            // Bytes the kernel reads at least: every weight row and bias once per group of up to
            // MAX_ROWS batch rows (a stage-1 block scores its tile for a whole group).
            let passes = rows.div_ceil(recsys_gpu::MAX_ROWS);
            let gbps = (bytes_per_row * n * passes) as f64 / median / 1e9;
            results.push(format!(
                "{{\"precision\": \"{name}\", \"batch\": {rows}, \"median_ms\": {:.4}, \"achieved_gb_s\": {gbps:.1}}}",
                median * 1e3
            ));
        }
    }
    let copy = layer_copy_bandwidth();
    println!(
        "{{\"n\": {n}, \"d\": {d}, \"k\": {k}, \"copy_gb_s\": {copy:.1}, \"fused\": [{}]}}",
        results.join(", ")
    );
}

/// Device-to-device copy bandwidth of a 1 GiB buffer (read + write bytes per second), median of 10.
fn layer_copy_bandwidth() -> f64 {
    let ctx = cudarc::driver::CudaContext::new(0).expect("GPU");
    let stream = ctx.default_stream();
    let len = 1usize << 28; // 2^28 f32 = 1 GiB
    let src = stream.alloc_zeros::<f32>(len).unwrap();
    let mut dst = stream.alloc_zeros::<f32>(len).unwrap();
    let mut times = Vec::new();
    for _ in 0..10 {
        stream.synchronize().unwrap();
        let t = Instant::now();
        stream.memcpy_dtod(&src, &mut dst).unwrap();
        stream.synchronize().unwrap();
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    (2 * 4 * len) as f64 / times[times.len() / 2] / 1e9
}
