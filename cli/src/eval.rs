//! `recsys eval`.

use crate::cli::EvalArgs;
use crate::error::{CliError, Result};
use crate::output::say;
use crate::progress;
use recsys_engine::metrics::{evaluate_filtered, read_test_set};
use recsys_engine::{Engine, ItemFilter};

pub fn run(args: &EvalArgs) -> Result<i32> {
    if args.k.is_empty() || args.k.contains(&0) {
        return Err(CliError::Usage("--k needs cut-offs of at least 1".into()));
    }
    let mut engine = Engine::load(&args.engine)?;
    engine.set_threads(crate::cli::default_threads(args.threads));
    let filter = ItemFilter {
        include: args.include_item_sets.clone(),
        exclude: args.exclude_item_sets.clone(),
    };
    let eligible = if filter.is_empty() {
        None
    } else {
        Some(engine.filters.resolve(&filter).map_err(CliError::Usage)?)
    };
    let cases = read_test_set(&args.test)?;
    let bar = progress::counter(cases.len() as u64, "users");
    let started = std::time::Instant::now();
    let report = evaluate_filtered(
        &engine,
        &cases,
        &args.k,
        args.batch_size as usize,
        eligible.as_deref(),
        |n| bar.inc(n as u64),
    )?;
    bar.finish_and_clear();
    let mut json = serde_json::json!({
        "engine": args.engine.display().to_string(),
        "model": engine.kind().to_string(),
        "precision": serde_json::json!(engine.manifest.precision),
        "kernels": engine.scorer.kernels.isa.name(),
        "threads": engine.scorer.threads,
        "test": args.test.display().to_string(),
        "metrics": report.metrics,
        "unknown_history_ids": report.unknown_history_ids,
        "unknown_targets": report.unknown_targets,
        "targets_outside_filter": report.targets_outside_filter,
        "filter": {"include_item_sets": filter.include, "exclude_item_sets": filter.exclude},
        "seconds": started.elapsed().as_secs_f64(),
    });
    if let Some(n) = json["metrics"]["n_users"].as_f64() {
        json["metrics"]["n_users"] = serde_json::json!(n as u64);
    }
    let text = serde_json::to_string_pretty(&json).expect("report serialises");
    say!("{text}");
    if let Some(path) = &args.output {
        std::fs::write(path, text + "\n")
            .map_err(CliError::io(format!("cannot write {}", path.display())))?;
    }
    Ok(0)
}
