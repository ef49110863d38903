//! The cost of item set filters in the fused top-k against the unfiltered scan of the same
//! weights, measured in one run with the variants interleaved (each repetition times every
//! variant once, so a noisy machine slows them alike): random masks keeping 50 %, 10 %, 5 %, 1 %
//! and 0.1 % of the catalogue, the same mask for every row (a category page) and, for batches, a
//! distinct mask per row (a batch of different pages).
//!
//! filter_probe N D BATCH K PRECISION THREADS REPS
//!   (PRECISION: fp32, fp16, int8, or screened: the fp32 engine's exact int8 screen)
//!
//! Prints one JSON object: per variant the median seconds and the ratio to the unfiltered scan.
#![forbid(unsafe_code)]

use std::time::Instant;

use recsys_kernels::fused::{top_k, Exclusions, RowQuery};
use recsys_kernels::item_mask::ItemMask;
use recsys_kernels::packed::{quantize_int8_per_row, to_f16_bits, PackedOutput};
use recsys_kernels::screen::{top_k_from_f32, ScreenTable};
use recsys_kernels::KernelTable;

fn arg<T: std::str::FromStr>(args: &[String], i: usize, what: &str) -> T {
    args.get(i)
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("argument {i} ({what}) missing or invalid; see the header"))
}

/// Uniform in [-1, 1), deterministic.
fn lcg(seed: u64) -> impl FnMut() -> f32 {
    let mut state = seed;
    move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = arg(&args, 1, "N");
    let d: usize = arg(&args, 2, "D");
    let batch: usize = arg(&args, 3, "BATCH");
    let k: usize = arg(&args, 4, "K");
    let precision = args.get(5).map_or("fp32", String::as_str).to_owned();
    let threads: usize = arg(&args, 6, "THREADS");
    let reps: usize = arg(&args, 7, "REPS");

    let mut next = lcg(7);
    let weights: Vec<f32> = (0..n * d).map(|_| next() * 0.1).collect();
    let bias: Vec<f32> = (0..n).map(|_| next() * 0.01).collect();
    let hidden: Vec<f32> = (0..batch * d).map(|_| next()).collect();
    let table = KernelTable::detect();
    let packed = match precision.as_str() {
        "fp32" | "screened" => PackedOutput::from_f32(&weights, &bias, d),
        "fp16" => PackedOutput::from_f16_bits(&to_f16_bits(&weights), &bias, d),
        "int8" => {
            let (q, s) = quantize_int8_per_row(&weights, d);
            PackedOutput::from_i8(&q, &s, &bias, d)
        }
        other => panic!("unknown precision {other}"),
    };
    let screen = (precision == "screened").then(|| ScreenTable::new(&weights, &bias, d));

    let shares = [1.0, 0.5, 0.1, 0.05, 0.01, 0.001];
    let mut mask_of = |share: f64| {
        ItemMask::of(
            n,
            (0..n as u32).filter(|_| f64::from(next() + 1.0) / 2.0 < share),
        )
    };
    // Variant 0 is unfiltered; then one shared mask per share; then, for batches, distinct masks.
    let mut variants: Vec<(String, Vec<Option<ItemMask>>)> =
        vec![("none".into(), vec![None; batch])];
    for &share in &shares {
        let mask = mask_of(share);
        variants.push((format!("page {share}"), vec![Some(mask); batch]));
    }
    // The unfiltered scan again, last in each repetition: the difference between the two is the
    // run's noise (order, caches, frequency), the margin every ratio is read within.
    variants.push(("none, again".into(), vec![None; batch]));
    if batch > 1 {
        for &share in &shares {
            let masks = (0..batch).map(|_| Some(mask_of(share))).collect();
            variants.push((format!("per-row {share}"), masks));
        }
    }
    let none = Exclusions::default();
    let mut times = vec![Vec::with_capacity(reps); variants.len()];
    let mut answers = vec![0usize; variants.len()];
    for _ in 0..reps {
        for (v, (_, masks)) in variants.iter().enumerate() {
            let queries: Vec<RowQuery> = masks
                .iter()
                .map(|m| RowQuery {
                    k,
                    excluded: &none,
                    eligible: m.as_ref(),
                })
                .collect();
            let start = Instant::now();
            let result = match &screen {
                None => top_k(table, &packed, &hidden, &queries, threads),
                Some(s) => top_k_from_f32(table, s, &weights, &bias, &hidden, &queries, threads).0,
            };
            times[v].push(start.elapsed().as_secs_f64());
            answers[v] = result.iter().map(Vec::len).sum();
        }
    }
    let base = median(times[0].clone());
    let rows: Vec<serde_json::Value> = variants
        .iter()
        .zip(&times)
        .zip(&answers)
        .map(|(((name, _), t), &answered)| {
            let m = median(t.clone());
            serde_json::json!({
                "variant": name,
                "median_ms": m * 1e3,
                "ratio_to_unfiltered": m / base,
                "items_answered": answered,
            })
        })
        .collect();
    println!(
        "{}",
        serde_json::json!({
            "n": n, "d": d, "batch": batch, "k": k, "precision": precision,
            "threads": threads, "reps": reps, "isa": table.isa.name(),
            "variants": rows,
        })
    );
}
