//! Times the fused score + top-k kernels on the GPU: N = 1e6 items, d = 64 and 600, k = 100, batch
//! 1 and 64, fp32 / fp16 / int8 weights, by the tile scan and by the threshold scan; and the
//! device's copy bandwidth. Kernel time comes from
//! CUDA events around the kernels (hidden vectors already on the device), as torch's own events
//! time matmul + topk; end-to-end time (host hidden vectors in, host top-k out) is reported
//! separately. Writes the fp32 weights, biases and hidden vectors it used to DATA_DIR so
//! scripts/gpu_bench_torch.py can time torch on the same data, and prints one JSON object.
//!
//!   gpu_bench DATA_DIR          (the GPU bundle's run.sh runs it)
//!   gpu_bench --dry-run         starts, reports whether a CUDA driver is present, exits 0
//!   gpu_bench --versions        the NVRTC this process opens and the driver's CUDA version
//!   gpu_bench --profile CELL    one cell, PRECISION:DIM:BATCH:SCAN (fp16:64:1:coalesced-threshold),
//!                               called twice (the second call with every buffer already kept),
//!                               for a profiler to record its kernels (run.sh runs Nsight
//!                               Compute over a few cells this way)

use std::io::{BufWriter, Write};
use std::path::Path;

#[path = "common/timing.rs"]
mod timing;

use recsys_engine::tensor::Tensor;
use recsys_engine::weights::Matrix;
use recsys_gpu::cuda::{driver_present, GpuOutputLayer};
use recsys_gpu::output_layer::ScanStrategy;

const N_ITEMS: usize = 1_000_000;
const DIMS: [usize; 2] = [64, 600];
const K: usize = 100;
const BATCHES: [usize; 2] = [1, 64];
const WARMUP: usize = 5;
const REPS: usize = 30;

fn main() {
    let arg = std::env::args().nth(1).unwrap_or_else(|| {
        eprintln!("usage: gpu_bench DATA_DIR | --dry-run");
        std::process::exit(2)
    });
    if arg == "--versions" {
        // For run.sh's choice of NVRTC: the library this process opens and what the driver takes.
        match recsys_gpu::cuda::nvrtc_version() {
            Ok((major, minor)) => println!("nvrtc {major}.{minor}"),
            Err(e) => println!("nvrtc unusable: {e}"),
        }
        match recsys_gpu::cuda::driver_cuda_version() {
            Ok((major, minor)) => println!("driver {major}.{minor}"),
            Err(e) => println!("driver unusable: {e}"),
        }
        return;
    }
    if arg == "--dry-run" {
        println!(
            "gpu_bench: starts; CUDA driver {}",
            if driver_present() {
                "present"
            } else {
                "absent"
            }
        );
        return;
    }
    if arg == "--profile" {
        let cell = std::env::args().nth(2).unwrap_or_default();
        if let Err(e) = profile(&cell) {
            eprintln!("gpu_bench --profile {cell}: {e}");
            std::process::exit(2)
        }
        return;
    }
    let data_dir = Path::new(&arg);
    let mut results = Vec::new();
    for dim in DIMS {
        let mut uniform = xorshift(0x2545_F491_4F6C_DD1D ^ dim as u64);
        let weights: Vec<f32> = (0..N_ITEMS * dim).map(|_| uniform() * 0.1).collect();
        let bias: Vec<f32> = (0..N_ITEMS).map(|_| uniform() * 0.01).collect();
        let hidden: Vec<f32> = (0..64 * dim).map(|_| uniform()).collect();
        write_f32(&data_dir.join(format!("weights_d{dim}.f32")), &weights);
        write_f32(&data_dir.join(format!("bias_d{dim}.f32")), &bias);
        write_f32(&data_dir.join(format!("hidden_d{dim}.f32")), &hidden);
        let bias_t = Tensor::from_vec(vec![N_ITEMS], bias);
        for precision in ["fp32", "fp16", "int8"] {
            let (matrix, bytes_per_row) = stored(&weights, dim, precision);
            let mut layer = GpuOutputLayer::new(0, &matrix, &bias_t).unwrap_or_else(|e| {
                eprintln!("gpu_bench: {e}");
                std::process::exit(1)
            });
            drop(matrix);
            for scan in ["tiles", "threshold", "coalesced-threshold"] {
                layer.set_strategy(strategy_named(scan).expect("a known scan"));
                for rows in BATCHES {
                    let excluded: Vec<&[u32]> = vec![&[]; rows];
                    let h = &hidden[..rows * dim];
                    let mut kernel = layer
                        .kernel_times_ms(h, K, &excluded, WARMUP, REPS)
                        .expect("timing the kernels");
                    kernel.sort_by(f32::total_cmp);
                    let kernel_ms = f64::from(kernel[kernel.len() / 2]);
                    let end_to_end_ms = timing::median_ms(WARMUP, REPS, || {
                        layer.topk(h, K, &excluded).expect("fused top-k");
                    });
                    // The bytes the kernels must read at least: every weight row (with its bias, and
                    // its scale for int8) once per batch; the grid lets a tile's groups share it in L2.
                    let gb_s = (bytes_per_row * N_ITEMS) as f64 / (kernel_ms / 1e3) / 1e9;
                    results.push(format!(
                        "{{\"precision\": \"{precision}\", \"dim\": {dim}, \"batch\": {rows}, \
                     \"scan\": \"{scan}\", \"kernel_ms\": {kernel_ms:.4}, \
                     \"end_to_end_ms\": {end_to_end_ms:.4}, \"achieved_gb_s\": {gb_s:.1}}}"
                    ));
                    eprintln!("gpu_bench: {}", results.last().expect("pushed"));
                }
            }
        }
    }
    let copy = copy_bandwidth_gb_s();
    println!(
        "{{\"n\": {N_ITEMS}, \"dims\": {DIMS:?}, \"k\": {K}, \"copy_gb_s\": {copy:.1}, \"fused\": [{}]}}",
        results.join(", ")
    );
}

/// The strategy a scan name of the results stands for.
fn strategy_named(scan: &str) -> Option<ScanStrategy> {
    match scan {
        "tiles" => Some(ScanStrategy::Tiles),
        "threshold" => Some(ScanStrategy::Threshold),
        "coalesced-threshold" => Some(ScanStrategy::CoalescedThreshold),
        _ => None,
    }
}

/// `--profile PRECISION:DIM:BATCH:SCAN`: the cell's weights as the benchmark makes them, and two
/// calls of its kernels (the first allocates the kept buffers; a profiler reads the second).
fn profile(cell: &str) -> Result<(), String> {
    let usage = || {
        format!(
            "expected PRECISION:DIM:BATCH:SCAN, e.g. fp16:64:1:coalesced-threshold; got {cell:?}"
        )
    };
    let parts: Vec<&str> = cell.split(':').collect();
    let [precision, dim, rows, scan] = parts[..] else {
        return Err(usage());
    };
    if !["fp32", "fp16", "int8"].contains(&precision) {
        return Err(usage());
    }
    let dim: usize = dim.parse().map_err(|_| usage())?;
    let rows: usize = rows.parse().map_err(|_| usage())?;
    let strategy = strategy_named(scan).ok_or_else(usage)?;
    if dim == 0 || rows == 0 {
        return Err(usage());
    }
    let mut uniform = xorshift(0x2545_F491_4F6C_DD1D ^ dim as u64);
    let weights: Vec<f32> = (0..N_ITEMS * dim).map(|_| uniform() * 0.1).collect();
    let bias: Vec<f32> = (0..N_ITEMS).map(|_| uniform() * 0.01).collect();
    let hidden: Vec<f32> = (0..rows * dim).map(|_| uniform()).collect();
    let (matrix, _) = stored(&weights, dim, precision);
    drop(weights);
    let mut layer = GpuOutputLayer::new(0, &matrix, &Tensor::from_vec(vec![N_ITEMS], bias))
        .map_err(|e| e.to_string())?;
    drop(matrix);
    layer.set_strategy(strategy);
    let excluded: Vec<&[u32]> = vec![&[]; rows];
    let times = layer
        .kernel_times_ms(&hidden, K, &excluded, 1, 1)
        .map_err(|e| e.to_string())?;
    println!(
        "gpu_bench --profile {cell}: {:.4} ms (under the profiler: not a timing)",
        times[0]
    );
    Ok(())
}

/// Uniform values in [-1, 1) from a xorshift generator (reproducible, no dependency).
fn xorshift(seed: u64) -> impl FnMut() -> f32 {
    let mut state = seed;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// `weights` at `precision` (int8: symmetric, one scale per row, as the engine quantizes), and the
/// bytes one item costs the kernel (row, bias, scale).
fn stored(weights: &[f32], dim: usize, precision: &str) -> (Matrix, usize) {
    match precision {
        "fp32" => (
            Matrix::F32(Tensor::from_vec(vec![N_ITEMS, dim], weights.to_vec())),
            4 * dim + 4,
        ),
        "fp16" => (
            Matrix::F16 {
                bits: recsys_engine::elements::Elements::from_vec(
                    weights
                        .iter()
                        .map(|v| half::f16::from_f32(*v).to_bits())
                        .collect(),
                ),
                start: 0,
                rows: N_ITEMS,
                cols: dim,
            },
            2 * dim + 4,
        ),
        _ => {
            let mut q = Vec::with_capacity(weights.len());
            let mut scales = Vec::with_capacity(N_ITEMS);
            for row in weights.chunks(dim) {
                let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                let scale = if max > 0.0 { max / 127.0 } else { 1.0 };
                scales.push(scale);
                q.extend(
                    row.iter()
                        .map(|v| (v / scale).round().clamp(-127.0, 127.0) as i8),
                );
            }
            (
                Matrix::I8 {
                    q: recsys_engine::elements::Elements::from_vec(q),
                    scales: recsys_engine::elements::Elements::from_vec(scales),
                    start: 0,
                    rows: N_ITEMS,
                    cols: dim,
                },
                dim + 8,
            )
        }
    }
}

fn write_f32(path: &Path, values: &[f32]) {
    let file = std::fs::File::create(path)
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
    let mut out = BufWriter::with_capacity(1 << 22, file);
    for chunk in values.chunks(1 << 16) {
        let bytes: Vec<u8> = chunk.iter().flat_map(|v| v.to_le_bytes()).collect();
        out.write_all(&bytes).expect("writing benchmark data");
    }
    out.flush().expect("writing benchmark data");
}

/// Device-to-device copy bandwidth of a 1 GiB buffer (bytes read + written per second), timed with
/// CUDA events, median of 10 after 2 warm-ups.
fn copy_bandwidth_gb_s() -> f64 {
    let ctx = cudarc::driver::CudaContext::new(0).expect("GPU");
    let stream = ctx.default_stream();
    let len = 1usize << 28; // 2^28 f32 = 1 GiB
    let src = stream.alloc_zeros::<f32>(len).expect("device memory");
    let mut dst = stream.alloc_zeros::<f32>(len).expect("device memory");
    let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut times = Vec::new();
    for rep in 0..12 {
        let start = stream.record_event(timing).expect("event");
        stream.memcpy_dtod(&src, &mut dst).expect("copy");
        let end = stream.record_event(timing).expect("event");
        end.synchronize().expect("copy");
        if rep >= 2 {
            times.push(f64::from(start.elapsed_ms(&end).expect("event timer")));
        }
    }
    times.sort_by(f64::total_cmp);
    (2 * 4 * len) as f64 / (times[times.len() / 2] / 1e3) / 1e9
}
