//! Times the fused score + top-k kernel on weights written by `scripts/bench_kernels.py`, so that the
//! script can run ONNX Runtime and numpy on the very same weights in the same invocation. Also
//! measures the machine's floor: streaming read bandwidth and FMA throughput.
//!
//! kernel_probe topk WEIGHTS BIAS HIDDEN n d batch k precision threads reps [rows]
//!   (precision: fp32, fp16, bf16, int8, or screened-int8: the int8 screen with exact fp32 rescoring;
//!   screened-int8-amx: the same screen with its int8 scores on AMX tiles, where the CPU has them;
//!   bf16-amx: the bf16 layer's scan on AMX tiles, where the CPU has them;
//!   rows: the largest row group, 4 or 8, where the CPU's kernels offer both; default theirs)
//! kernel_probe bandwidth MIB threads reps
//! kernel_probe fma threads
//! kernel_probe amx-peak threads   (the tile unit's bf16 multiply-adds a second, each thread)
//! kernel_probe dense n d rows precision threads reps
//!   (a dense layer `[rows, d] -> [rows, n]` on the SIMD kernels, deterministic weights; precision
//!   fp32, fp16, bf16 or int8; prints the median and the fastest call and the multiply-adds a
//!   nanosecond of the fastest)
//!
//! Prints one JSON object.
#![forbid(unsafe_code)]

use std::time::Instant;

use recsys_kernels::fused::{top_k, Exclusions, RowQuery};
use recsys_kernels::fused_amx::{top_k_bf16, AmxLayer};
use recsys_kernels::packed::{quantize_int8_per_row, to_bf16_bits, to_f16_bits, PackedOutput};
use recsys_kernels::screen::{top_k_from_f32, ScreenTable};
use recsys_kernels::{fma_peak_flops, KernelTable, RowBlock};

fn read_f32(path: &str) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn arg<T: std::str::FromStr>(args: &[String], i: usize, what: &str) -> T {
    args.get(i)
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("argument {i} ({what}) missing or invalid"))
}

/// The kernels, with the row block `rows` (argument 12) when it is given.
fn kernels(args: &[String]) -> &'static KernelTable {
    let table = KernelTable::detect();
    match args.get(12).map(String::as_str) {
        None => table,
        Some("4") => KernelTable::for_isa_rows(table.isa, RowBlock::Four),
        Some("8") => KernelTable::for_isa_rows(table.isa, RowBlock::Eight),
        Some(other) => panic!("rows must be 4 or 8, not {other}"),
    }
}

fn topk(args: &[String]) {
    let (weights, bias, hidden) = (read_f32(&args[2]), read_f32(&args[3]), read_f32(&args[4]));
    let n: usize = arg(args, 5, "n");
    let d: usize = arg(args, 6, "d");
    let batch: usize = arg(args, 7, "batch");
    let k: usize = arg(args, 8, "k");
    let precision = args[9].as_str();
    let threads: usize = arg(args, 10, "threads");
    let reps: usize = arg(args, 11, "reps");
    assert_eq!(weights.len(), n * d);
    assert_eq!(bias.len(), n);
    assert!(hidden.len() >= batch * d);
    if precision == "screened-int8" || precision == "screened-int8-amx" {
        let table = kernels(args);
        let table = if precision == "screened-int8-amx" {
            if let Err(why) = recsys_kernels::amx::availability() {
                panic!("screened-int8-amx: {why}");
            }
            table
                .tiled()
                .unwrap_or_else(|| panic!("the {} kernels have no tiled table", table.isa.name()))
        } else {
            table
        };
        return screened(&weights, &bias, &hidden, d, batch, k, threads, reps, table);
    }
    if precision == "bf16-amx" {
        return bf16_on_tiles(&weights, &bias, &hidden, d, batch, k, threads, reps);
    }
    let packed = packed_at(precision, &weights, &bias, d);
    drop(weights);
    let table = kernels(args);
    let none = Exclusions::default();
    let queries = vec![RowQuery::new(k, &none); batch];
    let h = &hidden[..batch * d];
    let (times, result) = timed(reps, || top_k(table, &packed, h, &queries, threads));
    println!(
        "{}",
        serde_json::json!({
            "median_s": median(times.clone()),
            "min_s": times.iter().cloned().fold(f64::INFINITY, f64::min),
            "isa": table.isa.name(),
            "rows": table.row_block().rows(),
            "weight_bytes": packed.weight_bytes(),
            "top_row0": first_row(&result),
        })
    );
}

/// `[n, d]` weights packed at `precision` (fp32, fp16, bf16 or int8 per row).
fn packed_at(precision: &str, weights: &[f32], bias: &[f32], d: usize) -> PackedOutput {
    match precision {
        "fp32" => PackedOutput::from_f32(weights, bias, d),
        "fp16" => PackedOutput::from_f16_bits(&to_f16_bits(weights), bias, d),
        "bf16" => PackedOutput::from_bf16_bits(&to_bf16_bits(weights), bias, d),
        "int8" => {
            let (q, s) = quantize_int8_per_row(weights, d);
            PackedOutput::from_i8(&q, &s, bias, d)
        }
        other => panic!("unknown precision {other}"),
    }
}

/// `run` called `reps` times (at least once): each call's seconds and the last call's answer.
fn timed<T>(reps: usize, mut run: impl FnMut() -> T) -> (Vec<f64>, T) {
    let mut times = Vec::with_capacity(reps.max(1));
    loop {
        let start = Instant::now();
        let result = run();
        times.push(start.elapsed().as_secs_f64());
        if times.len() >= reps.max(1) {
            return (times, result);
        }
    }
}

/// Row 0's items, best first.
fn first_row(result: &[Vec<recsys_kernels::topk::Scored>]) -> Vec<u32> {
    result[0].iter().map(|s| s.index).collect()
}

/// A bf16 layer's scan on AMX tiles (`fused_amx::top_k_bf16`), as a bf16 engine's output layer
/// runs where its plan chose tiles.
#[allow(clippy::too_many_arguments)] // the probe's own arguments, parsed above
fn bf16_on_tiles(
    weights: &[f32],
    bias: &[f32],
    hidden: &[f32],
    d: usize,
    batch: usize,
    k: usize,
    threads: usize,
    reps: usize,
) {
    if let Err(why) = recsys_kernels::amx::availability() {
        panic!("bf16-amx: {why}");
    }
    let packed = PackedOutput::from_bf16_bits(&to_bf16_bits(weights), bias, d);
    let tiles = AmxLayer::from_packed(&packed).expect("a bf16 layer has tiles");
    let none = Exclusions::default();
    let queries = vec![RowQuery::new(k, &none); batch];
    let h = &hidden[..batch * d];
    let (times, result) = timed(reps, || {
        top_k_bf16(&tiles, h, &queries, threads).expect("tiles run here")
    });
    println!(
        "{}",
        serde_json::json!({
            "median_s": median(times.clone()),
            "min_s": times.iter().cloned().fold(f64::INFINITY, f64::min),
            "isa": "amx-bf16",
            "weight_bytes": tiles.bytes(),
            "top_row0": first_row(&result),
        })
    );
}

/// The int8 screen with exact fp32 rescoring (`kernels::screen`): its time, the survivors per
/// row, and the answer (equal to the fp32 kernel's by construction; the script checks).
#[allow(clippy::too_many_arguments)] // the probe's own arguments, parsed above
fn screened(
    weights: &[f32],
    bias: &[f32],
    hidden: &[f32],
    d: usize,
    batch: usize,
    k: usize,
    threads: usize,
    reps: usize,
    table: &'static KernelTable,
) {
    let mut screen = ScreenTable::new(weights, bias, d);
    if table.tiles {
        screen.prepare_tiles().expect("AMX was checked available");
    }
    let none = Exclusions::default();
    let queries = vec![RowQuery::new(k, &none); batch];
    let h = &hidden[..batch * d];
    let mut times = Vec::with_capacity(reps);
    let mut result = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let start = Instant::now();
        result = top_k_from_f32(table, &screen, weights, bias, h, &queries, threads);
        times.push(start.elapsed().as_secs_f64());
    }
    let first: Vec<u32> = result.0[0].iter().map(|s| s.index).collect();
    let mut survivors = result.1.clone();
    survivors.sort_unstable();
    println!(
        "{}",
        serde_json::json!({
            "median_s": median(times.clone()),
            "min_s": times.iter().cloned().fold(f64::INFINITY, f64::min),
            "isa": table.isa.name(),
            "tiles": table.tiles,
            "rows": table.row_block().rows(),
            "weight_bytes": screen.weight_bytes(),
            "top_row0": first,
            "survivors_median": survivors[survivors.len() / 2],
            "survivors_max": survivors[survivors.len() - 1],
        })
    );
}

/// Streaming read bandwidth over a buffer much larger than the caches, `threads` readers.
fn bandwidth(args: &[String]) {
    let mib: usize = arg(args, 2, "MiB");
    let threads: usize = arg(args, 3, "threads");
    let reps: usize = arg(args, 4, "reps");
    let data: Vec<f32> = (0..mib * 1024 * 1024 / 4).map(|i| (i % 7) as f32).collect();
    let mut times = Vec::new();
    for _ in 0..reps {
        let start = Instant::now();
        let chunk = data.len().div_ceil(threads);
        let total: f32 = std::thread::scope(|s| {
            let handles: Vec<_> = data
                .chunks(chunk)
                .map(|part| {
                    s.spawn(move || {
                        let mut acc = [0f32; 16];
                        for block in part.chunks_exact(16) {
                            for (a, v) in acc.iter_mut().zip(block) {
                                *a += v;
                            }
                        }
                        acc.iter().sum::<f32>()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        std::hint::black_box(total);
        times.push(start.elapsed().as_secs_f64());
    }
    let bytes = (data.len() * 4) as f64;
    println!(
        "{}",
        serde_json::json!({"bytes_per_s": bytes / median(times)})
    );
}

fn fma(args: &[String]) {
    let threads: usize = arg(args, 2, "threads");
    let per_thread: Vec<f64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| s.spawn(|| fma_peak_flops(50_000_000).unwrap_or(0.0)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    println!(
        "{}",
        serde_json::json!({"flops": per_thread.iter().sum::<f64>()})
    );
}

/// The tile unit's bf16 rate on `threads` threads at once (`amx::bf16_peak_macs_per_second`).
fn amx_peak(args: &[String]) {
    let threads: usize = arg(args, 2, "threads");
    let per_thread: Vec<f64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    recsys_kernels::amx::bf16_peak_macs_per_second(2_000_000)
                        .unwrap_or_else(|why| panic!("amx-peak: {why}"))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    println!(
        "{}",
        serde_json::json!({"bf16_macs_per_second": per_thread})
    );
}

/// A dense layer's time on the SIMD kernels (`dense::linear_into_threads`), as the encoders call it.
fn dense(args: &[String]) {
    let n: usize = arg(args, 2, "n");
    let d: usize = arg(args, 3, "d");
    let rows: usize = arg(args, 4, "rows");
    let precision = args.get(5).map(String::as_str).unwrap_or("fp32");
    let threads: usize = arg(args, 6, "threads");
    let reps: usize = arg(args, 7, "reps");
    let mut next = recsys_kernels::lcg(7);
    let weights: Vec<f32> = (0..n * d).map(|_| next() * 0.1).collect();
    let bias: Vec<f32> = (0..n).map(|_| next() * 0.1).collect();
    let x: Vec<f32> = (0..rows * d).map(|_| next()).collect();
    let layer = packed_at(precision, &weights, &bias, d);
    let table = KernelTable::detect();
    let mut y = vec![0f32; rows * n];
    let mut quantized = Default::default();
    let (times, ()) = timed(reps, || {
        recsys_kernels::dense::linear_into_threads(
            table,
            layer.view(),
            &x,
            &mut y,
            &mut quantized,
            threads,
            recsys_kernels::profile::Work::Dense,
        )
    });
    let fastest = times.iter().cloned().fold(f64::INFINITY, f64::min);
    println!(
        "{}",
        serde_json::json!({
            "median_s": median(times.clone()),
            "min_s": fastest,
            "macs_per_ns": (rows * n * d) as f64 / fastest / 1e9,
            "isa": table.isa.name(),
            "y0": y[0],
        })
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("topk") => topk(&args),
        Some("bandwidth") => bandwidth(&args),
        Some("fma") => fma(&args),
        Some("amx-peak") => amx_peak(&args),
        Some("dense") => dense(&args),
        _ => {
            eprintln!(
                "usage: kernel_probe topk|bandwidth|fma|amx-peak|dense ... (see the source header)"
            );
            std::process::exit(2);
        }
    }
}
