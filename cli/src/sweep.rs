//! `recsys sweep`: convert a checkpoint at every precision, evaluate ranking quality, compare with
//! fp32, time each engine, and recommend the fastest variant within a quality budget.

use crate::output::say;
use std::fmt::Write as _;
use std::time::Instant;

use serde::Serialize;

use crate::cli::SweepArgs;
use crate::error::{CliError, Result};
use crate::progress;
use recsys_engine::calibration::{read_timed_histories, CalibrationMethod};
use recsys_engine::engine_dir::{Precision, Screen};
use recsys_engine::metrics::{evaluate, read_test_set, TestCase};
use recsys_engine::Int8Mode;
use recsys_engine::{
    ConvertOptions, ConvertRequest, Engine, ExternalIds, InternalRequest, ModelKind, Spelling,
    W8a8Layers,
};

/// One precision variant to build.
#[derive(Clone, Debug)]
struct Variant {
    name: String,
    precision: Precision,
    method: Option<CalibrationMethod>,
    layers: W8a8Layers,
    screen: Screen,
    /// The `recsys convert` flags that build it.
    flags: String,
}

#[derive(Clone, Debug, Serialize)]
struct Latency {
    batch: usize,
    p50_ms: f64,
    p99_ms: f64,
    histories_per_s: f64,
}

#[derive(Clone, Debug, Serialize)]
struct Row {
    variant: String,
    convert_flags: String,
    metrics: std::collections::BTreeMap<String, f64>,
    ndcg10_delta: f64,
    ndcg10_relative_loss: f64,
    recall10_delta: f64,
    top10_jaccard: f64,
    top100_jaccard: f64,
    identical_top10: f64,
    max_abs_score_error: f64,
    mean_abs_score_error: f64,
    weights_bytes: u64,
    /// Mapped weights file plus the packed copies the kernels read.
    resident_bytes: u64,
    latency: Vec<Latency>,
    /// A screened variant's plan on this CPU: per batch size, its screen or its plain scan.
    #[serde(skip_serializing_if = "Option::is_none")]
    screen_plan: Option<String>,
    /// A variant's kernel plans, as measured: a bf16 variant's `vdpbf16ps` or widened per batch
    /// size (AVX512-BF16), its output layer on AMX tiles or not (or why tiles are not used), and
    /// the AVX-512 row block.
    #[serde(skip_serializing_if = "Option::is_none")]
    kernel_plan: Option<String>,
    /// The threads each batch size gets on this CPU, as measured (engines of more than one thread).
    #[serde(skip_serializing_if = "Option::is_none")]
    thread_plan: Option<String>,
}

/// The variants to compare, from `--precisions` and `--int8-modes` (the values `recsys convert`
/// takes), in the order given; int8 gives one variant per mode, w8a8 one per calibration method.
fn parse_variants(args: &SweepArgs) -> Result<Vec<Variant>> {
    let mut out = Vec::new();
    for precision in &args.precisions {
        match precision {
            Precision::Fp32 | Precision::Fp16 | Precision::Bf16 => out.push(Variant {
                name: precision.as_str().into(),
                precision: *precision,
                method: None,
                layers: W8a8Layers::Output,
                screen: Screen::None,
                flags: format!("--precision {precision}"),
            }),
            Precision::Int8 => {
                for mode in &args.int8_modes {
                    match mode {
                        Int8Mode::WeightOnly => out.push(Variant {
                            name: "int8-wo".into(),
                            precision: Precision::Int8,
                            method: None,
                            layers: W8a8Layers::Output,
                            screen: Screen::None,
                            flags: "--precision int8 --int8-mode weight-only".into(),
                        }),
                        Int8Mode::W8a8 | Int8Mode::W8a8All => {
                            if args.calibration.is_none() {
                                return Err(CliError::Usage(
                                    "--int8-modes w8a8 and w8a8-all need --calibration FILE (or \
                                     leave them out: --int8-modes weight-only)"
                                        .into(),
                                ));
                            }
                            for &calibration_method in &args.calibration_methods {
                                // The variant as `recsys convert` would take it, checked by the
                                // same rules.
                                let plan = ConvertOptions {
                                    precision: Precision::Int8,
                                    int8_mode: *mode,
                                    calibration: true,
                                    calibration_method,
                                    ..Default::default()
                                }
                                .plan(Spelling::Flags)
                                .map_err(CliError::Usage)?;
                                let (mode, name) = (mode.as_str(), calibration_method.as_str());
                                out.push(Variant {
                                    name: format!("int8-{mode}-{name}"),
                                    precision: Precision::Int8,
                                    method: plan.calibration,
                                    layers: plan.w8a8_layers,
                                    screen: Screen::None,
                                    flags: format!(
                                        "--precision int8 --int8-mode {mode} --calibration CAL --calibration-method {name}"
                                    ),
                                });
                            }
                        }
                    }
                }
            }
        }
    }
    if args.screens.contains(&Screen::Int8) {
        // Each fp32 / fp16 variant again, screened; int8 variants already read int8 weights,
        // and bf16 ones round their activations, which the screen's bounds do not cover.
        let screened: Vec<Variant> = out
            .iter()
            .filter(|v| matches!(v.precision, Precision::Fp32 | Precision::Fp16))
            .map(|v| Variant {
                name: format!("{}-screen-int8", v.name),
                screen: Screen::Int8,
                flags: format!("{} --screen int8", v.flags),
                ..v.clone()
            })
            .collect();
        out.extend(screened);
    }
    if !args.screens.contains(&Screen::None) {
        // Unscreened fp32 stays: it is the reference every variant is compared with.
        out.retain(|v| {
            v.screen == Screen::Int8
                || matches!(v.precision, Precision::Int8 | Precision::Bf16)
                || v.name == "fp32"
        });
    }
    if out.first().map(|v| v.precision) != Some(Precision::Fp32) {
        return Err(CliError::Usage(
            "--precisions must start with fp32, the reference of every comparison".into(),
        ));
    }
    Ok(out)
}

/// Each test case as a top-10 request on its known history (with the known events' timestamps
/// and the target's time as the query time, for the models that read time).
fn histories(engine: &Engine, cases: &[TestCase]) -> Vec<InternalRequest> {
    let timed = engine.kind().reads_timestamps();
    cases
        .iter()
        .map(|c| {
            let ids: Vec<&str> = c.history.iter().map(String::as_str).collect();
            let (mapped, kept) = engine.ids.map_with_positions(ExternalIds::Str(&ids));
            let (timestamps, query_timestamp) = match (&c.times, timed) {
                (Some(times), true) => (
                    kept.iter().map(|&i| times.events[i]).collect(),
                    times.target,
                ),
                _ => (Vec::new(), 0),
            };
            InternalRequest {
                history: mapped.indices,
                k: 10,
                exclude_seen: true,
                timestamps,
                query_timestamp,
                ..Default::default()
            }
        })
        .collect()
}

fn top(engine: &Engine, case: &InternalRequest, k: usize) -> Vec<u32> {
    let request = InternalRequest { k, ..case.clone() };
    engine.recommend_internal(&[request])[0]
        .0
        .iter()
        .map(|s| s.index)
        .collect()
}

fn jaccard(a: &[u32], b: &[u32]) -> f64 {
    let inter = a.iter().filter(|x| b.contains(x)).count();
    inter as f64 / (a.len() + b.len() - inter).max(1) as f64
}

fn time_batches(
    engine: &Engine,
    histories: &[InternalRequest],
    batch: usize,
    seconds: f64,
) -> Latency {
    let make = |start: usize| -> Vec<InternalRequest> {
        (0..batch)
            .map(|i| histories[(start + i) % histories.len()].clone())
            .collect()
    };
    engine.recommend_internal(&make(0)); // warm-up
    let mut times = Vec::new();
    let started = Instant::now();
    let mut next = 0;
    while times.len() < 5 || (started.elapsed().as_secs_f64() < seconds && times.len() < 2000) {
        let requests = make(next);
        next += batch;
        let t = Instant::now();
        std::hint::black_box(engine.recommend_internal(&requests));
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
    let p = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize] * 1000.0;
    Latency {
        batch,
        p50_ms: p(0.5),
        p99_ms: p(0.99),
        histories_per_s: batch as f64 * times.len() as f64 / times.iter().sum::<f64>(),
    }
}

pub fn run(args: &SweepArgs) -> Result<i32> {
    let variants = parse_variants(args)?;
    // None: a RecBole checkpoint names its own model (the first conversion reads it).
    let mut kind = args.kind.map(ModelKind::from);
    // A budget below zero would exclude even fp32, leaving nothing to recommend.
    let budget = args
        .budget_ndcg10
        .trim_end_matches('%')
        .parse::<f64>()
        .ok()
        .filter(|b| b.is_finite() && *b >= 0.0)
        .ok_or_else(|| {
            CliError::Usage(format!(
                "--budget-ndcg10 must be a non-negative percentage like 1%, found {:?}",
                args.budget_ndcg10
            ))
        })?
        / 100.0;
    if args.batch_size.is_empty() || args.batch_size.contains(&0) {
        return Err(CliError::Usage(
            "--batch-size needs batch sizes of at least 1".into(),
        ));
    }
    let config = match &args.config {
        None => None,
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(CliError::io(format!("cannot read {}", path.display())))?;
            match serde_json::from_str::<serde_json::Value>(&text) {
                Ok(serde_json::Value::Object(map)) => Some(map),
                _ => {
                    return Err(CliError::Input(format!(
                        "{} is not a JSON object",
                        path.display()
                    )))
                }
            }
        }
    };
    let calibration = args
        .calibration
        .as_ref()
        .map(|p| read_timed_histories(p))
        .transpose()?;
    let cases = read_test_set(&args.test)?;
    let batches: Vec<usize> = args.batch_size.clone();
    std::fs::create_dir_all(args.output.join("engines")).map_err(CliError::io(format!(
        "cannot create {}",
        args.output.display()
    )))?;

    let bar = progress::counter(variants.len() as u64, "variants");
    let mut rows: Vec<Row> = Vec::new();
    let mut reference: Option<(Engine, Vec<InternalRequest>)> = None;
    for variant in &variants {
        bar.set_message(variant.name.clone());
        let dir = args.output.join("engines").join(&variant.name);
        let mut engine = recsys_engine::convert(&ConvertRequest {
            kind,
            checkpoint: &args.checkpoint,
            config: config.as_ref(),
            item_map: args.items.source(),
            out: &dir,
            precision: variant.precision,
            calibration: variant.method.map(|m| {
                (
                    calibration
                        .as_ref()
                        .map(|(histories, _)| histories.as_slice())
                        .expect("checked in parse_variants"),
                    m,
                )
            }),
            calibration_times: calibration.as_ref().and_then(|(_, times)| times.as_deref()),
            screen: variant.screen,
            w8a8_layers: variant.layers,
            catalogue: Default::default(),
        })?;
        kind = Some(engine.kind());
        engine.set_threads(crate::cli::default_threads(args.threads));
        // A screened variant is timed as it would serve: with the plan this CPU measures for it.
        let screen_plan = engine
            .plan_screen(recsys_engine::plan::ScreenPolicy::Auto)
            .map(|p| p.describe());
        let bf16_plan = engine
            .plan_bf16_path(recsys_engine::plan::Bf16Path::Auto)
            .map(|p| p.describe());
        let row_block_plan = engine
            .plan_row_block(recsys_engine::plan::RowBlockPolicy::Auto)
            .map(|p| p.describe());
        let amx_plan = match engine.plan_amx(recsys_engine::plan_amx::AmxPolicy::Auto) {
            Ok(plan) => plan.map(|p| format!("AMX {}", p.describe())),
            Err(why) => Some(format!("AMX tiles not used: {why}")),
        };
        let kernel_plan = [bf16_plan, row_block_plan, amx_plan]
            .into_iter()
            .flatten()
            .reduce(|a, b| format!("{a}; {b}"));
        let thread_plan = engine
            .plan_threads(recsys_engine::plan::ThreadPolicy::Auto)
            .map(|p| p.describe());
        let resident = engine.memory_bytes() as u64;
        let report = evaluate(&engine, &cases, &[10, 20, 100], 256, |_| {})?;
        let hist = histories(&engine, &cases);
        let (mut j10, mut j100, mut same, mut max_err, mut sum_err, mut n_err) =
            (0.0, 0.0, 0usize, 0f64, 0f64, 0usize);
        let compare_users = hist.len().min(args.compare_users);
        if let Some((fp32, _)) = &reference {
            for h in hist.iter().take(compare_users) {
                let (a, b) = (top(fp32, h, 10), top(&engine, h, 10));
                j10 += jaccard(&a, &b);
                same += usize::from(a == b);
                j100 += jaccard(&top(fp32, h, 100), &top(&engine, h, 100));
                let times = [h.event_times()];
                let times = if engine.kind().reads_timestamps() {
                    &times[..]
                } else {
                    &[]
                };
                let history = [h.history.as_slice()];
                let (sa, sb) = (
                    fp32.score_all_timed(&history, times),
                    engine.score_all_timed(&history, times),
                );
                for (x, y) in sa.iter().zip(&sb).skip(1) {
                    let e = (x - y).abs() as f64;
                    max_err = max_err.max(e);
                    sum_err += e;
                    n_err += 1;
                }
            }
        } else {
            (j10, j100, same) = (compare_users as f64, compare_users as f64, compare_users);
        }
        let latency: Vec<Latency> = batches
            .iter()
            .map(|&b| time_batches(&engine, &hist, b, args.seconds))
            .collect();
        let base = rows
            .first()
            .map(|r| r.metrics.clone())
            .unwrap_or_else(|| report.metrics.clone());
        let ndcg = report.metrics["ndcg@10"];
        rows.push(Row {
            variant: variant.name.clone(),
            convert_flags: variant.flags.clone(),
            ndcg10_delta: ndcg - base["ndcg@10"],
            ndcg10_relative_loss: (base["ndcg@10"] - ndcg) / base["ndcg@10"].max(1e-12),
            recall10_delta: report.metrics["recall@10"] - base["recall@10"],
            metrics: report.metrics.clone(),
            top10_jaccard: j10 / compare_users.max(1) as f64,
            top100_jaccard: j100 / compare_users.max(1) as f64,
            identical_top10: same as f64 / compare_users.max(1) as f64,
            max_abs_score_error: max_err,
            mean_abs_score_error: if n_err > 0 {
                sum_err / n_err as f64
            } else {
                0.0
            },
            weights_bytes: engine.manifest.files["weights.safetensors"].bytes,
            resident_bytes: resident,
            latency,
            screen_plan,
            kernel_plan,
            thread_plan,
        });
        if reference.is_none() {
            reference = Some((engine, hist));
        }
        bar.inc(1);
    }
    bar.finish_and_clear();

    // Fastest (p50 at the first batch size) within the budget.
    let within: Vec<&Row> = rows
        .iter()
        .filter(|r| r.ndcg10_relative_loss <= budget)
        .collect();
    let best = within
        .iter()
        .min_by(|a, b| {
            a.latency[0]
                .p50_ms
                .partial_cmp(&b.latency[0].p50_ms)
                .expect("finite")
        })
        .expect("fp32 is always within the budget");
    let kind = kind.expect("at least one variant was converted");
    let command = format!(
        "recsys convert --kind {} --checkpoint {} {} {} --out ENGINE_DIR {}",
        kind,
        args.checkpoint.display(),
        args.config
            .as_ref()
            .map(|c| format!("--config {}", c.display()))
            .unwrap_or_default(),
        args.items.flag(),
        best.convert_flags.replace(
            "CAL",
            &args
                .calibration
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        ),
    );
    let json = serde_json::json!({
        "model": kind.to_string(),
        "checkpoint": args.checkpoint.display().to_string(),
        "test": args.test.display().to_string(),
        "budget_ndcg10_relative_loss": budget,
        "variants": rows,
        "recommendation": {"variant": best.variant, "command": command},
    });
    std::fs::write(
        args.output.join("report.json"),
        serde_json::to_string_pretty(&json).expect("serialises") + "\n",
    )
    .map_err(CliError::io("cannot write report.json"))?;
    let md = markdown(kind, args, &rows, best, &command, budget);
    std::fs::write(args.output.join("report.md"), &md)
        .map_err(CliError::io("cannot write report.md"))?;
    let points: Vec<crate::sweep_chart::Point<'_>> = rows
        .iter()
        .map(|r| crate::sweep_chart::Point {
            variant: &r.variant,
            latency_ms: r.latency[0].p50_ms,
            loss_percent: 100.0 * r.ndcg10_relative_loss,
        })
        .collect();
    let chart = crate::sweep_chart::draw(
        &points,
        rows[0].latency[0].batch,
        100.0 * budget,
        &best.variant,
    )?;
    std::fs::write(args.output.join("pareto.svg"), &chart.svg)
        .map_err(CliError::io("cannot write pareto.svg"))?;
    let png_path = args.output.join("pareto.png");
    let png = crate::sweep_chart::png(&chart.svg, &png_path)?;
    std::fs::write(&png_path, png).map_err(CliError::io("cannot write pareto.png"))?;
    say!("{md}");
    say!(
        "wrote {}/report.md, report.json, pareto.svg and pareto.png",
        args.output.display()
    );
    Ok(0)
}

fn markdown(
    kind: ModelKind,
    args: &SweepArgs,
    rows: &[Row],
    best: &Row,
    command: &str,
    budget: f64,
) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# Precision sweep: {kind} ({})\n",
        args.checkpoint.display()
    );
    let _ = writeln!(
        s,
        "Test set {} ({} users, leave-one-out, full ranking); quality compared with fp32 on the first {} users; latency of `recommend` (top-10) in-process, {} thread(s), median of repeated batches after warm-up. Resident = mapped weights file + the packed copies the kernels read.\n",
        args.test.display(),
        rows[0].metrics["n_users"],
        args.compare_users,
        crate::cli::default_threads(args.threads)
    );
    let _ = writeln!(s, "| variant | NDCG@10 | Δ NDCG@10 | NDCG@20 | NDCG@100 | Recall@10 | Recall@20 | Recall@100 | MRR | top-10 Jaccard | top-100 Jaccard | identical top-10 | max abs Δscore | mean abs Δscore | weights file MiB | resident MiB |");
    let _ = writeln!(
        s,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in rows {
        let m = &r.metrics;
        let _ = writeln!(
            s,
            "| {} | {:.4} | {:+.2} % | {:.4} | {:.4} | {:.4} | {:.4} | {:.4} | {:.4} | {:.3} | {:.3} | {:.1} % | {:.2e} | {:.2e} | {:.2} | {:.1} |",
            r.variant,
            m["ndcg@10"],
            if r.ndcg10_relative_loss.abs() < 5e-5 { 0.0 } else { -100.0 * r.ndcg10_relative_loss },
            m["ndcg@20"],
            m["ndcg@100"],
            m["recall@10"],
            m["recall@20"],
            m["recall@100"],
            m["mrr"],
            r.top10_jaccard,
            r.top100_jaccard,
            100.0 * r.identical_top10,
            r.max_abs_score_error,
            r.mean_abs_score_error,
            r.weights_bytes as f64 / (1 << 20) as f64,
            r.resident_bytes as f64 / (1 << 20) as f64
        );
    }
    let _ = writeln!(s, "\n| variant | batch | p50 ms | p99 ms | histories/s |");
    let _ = writeln!(s, "|---|---|---|---|---|");
    for r in rows {
        for l in &r.latency {
            let _ = writeln!(
                s,
                "| {} | {} | {:.3} | {:.3} | {:.0} |",
                r.variant, l.batch, l.p50_ms, l.p99_ms, l.histories_per_s
            );
        }
    }
    for r in rows {
        if let Some(plan) = &r.screen_plan {
            let _ = writeln!(s, "\nScreen plan of {} on this CPU: {plan}", r.variant);
        }
        if let Some(plan) = &r.kernel_plan {
            let _ = writeln!(s, "\nKernel plan of {} on this CPU: {plan}", r.variant);
        }
        if let Some(plan) = &r.thread_plan {
            let _ = writeln!(s, "\nThread plan of {} on this CPU: {plan}", r.variant);
        }
    }
    let _ = writeln!(
        s,
        "\n**Recommendation**: `{}`: the fastest variant at batch {} whose NDCG@10 loss stays within {:.2} % of fp32.\n\n```sh\n{}\n```",
        best.variant,
        best.latency[0].batch,
        100.0 * budget,
        command
    );
    s
}
