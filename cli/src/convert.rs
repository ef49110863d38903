//! `recsys convert`.

use crate::cli::ConvertArgs;
use crate::error::{CliError, Result};
use crate::output::say;
use crate::progress;
use recsys_engine::calibration::read_timed_histories;
use recsys_engine::{ConvertOptions, ConvertRequest, ModelKind, Spelling};

impl ConvertArgs {
    /// The flags as the engine's conversion options (the same rules as every front end's).
    fn options(&self) -> ConvertOptions {
        ConvertOptions {
            precision: self.precision,
            int8_mode: self.int8_mode,
            screen: self.screen,
            calibration: self.calibration.is_some(),
            calibration_method: self.calibration_method,
            calibration_percentile: self.calibration_percentile,
        }
    }
}

pub fn run(args: &ConvertArgs) -> Result<i32> {
    // Options that do not go together are refused before anything is read or written.
    let plan = args
        .options()
        .plan(Spelling::Flags)
        .map_err(CliError::Usage)?;
    let target = args.output.to_str().unwrap_or_default().to_string();
    let remote = recsys_registry::transfer::is_remote(&target);
    if remote && !args.force && !recsys_registry::transfer::list_folder(&target)?.is_empty() {
        return Err(CliError::Usage(format!(
            "{target} already holds objects; pass --force to replace them"
        )));
    }
    // An object-store output is converted (and verified) in a scratch folder, then uploaded.
    let scratch = if remote {
        Some(
            tempfile::Builder::new()
                .prefix("recsys-convert-")
                .tempdir()
                .map_err(CliError::io("cannot create a scratch folder (set TMPDIR)"))?,
        )
    } else {
        None
    };
    let out_dir = scratch
        .as_ref()
        .map_or_else(|| args.output.clone(), |s| s.path().join("engine"));
    if !remote && args.output.exists() && !args.force {
        let empty = std::fs::read_dir(&args.output)
            .map(|mut d| d.next().is_none())
            .unwrap_or(false);
        if !empty {
            return Err(CliError::Usage(format!(
                "{} already exists; pass --force to replace it",
                args.output.display()
            )));
        }
    }
    let config = match &args.config {
        None if args.gin.is_some() => {
            let path = args.gin.as_ref().expect("checked");
            let text = std::fs::read_to_string(path).map_err(CliError::io(format!(
                "cannot read gin config {}",
                path.display()
            )))?;
            Some(
                recsys_engine::gin::bindings(&text)
                    .map_err(|e| CliError::Input(format!("{}: {e}", path.display())))?,
            )
        }
        None => None,
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(CliError::io(format!(
                "cannot read config {}",
                path.display()
            )))?;
            match serde_json::from_str::<serde_json::Value>(&text) {
                Ok(serde_json::Value::Object(map)) => Some(map),
                Ok(_) => {
                    return Err(CliError::Input(format!(
                        "{} is not a JSON object",
                        path.display()
                    )))
                }
                Err(e) => {
                    return Err(CliError::Input(format!(
                        "{} is not valid JSON: {e}",
                        path.display()
                    )))
                }
            }
        }
    };
    let kind = args.kind.map(ModelKind::from);
    let calibration = match (&args.calibration, plan.calibration) {
        (Some(path), Some(method)) => Some((read_timed_histories(path)?, method)),
        _ => None,
    };
    let item_attributes = match &args.item_attributes {
        Some(path) => Some(crate::attributes::read(path)?),
        None => None,
    };
    // Counted against the catalogue, so the item map is read here too (convert reads it again).
    let popularity = match &args.interactions {
        None => None,
        Some(path) => {
            let ids = args
                .items
                .source()
                .read(args.max_checkpoint_bytes)
                .map_err(CliError::from)?;
            let bar = progress::spinner(&format!("counting {}", path.display()));
            let counted = recsys_engine::popularity::Popularity::count_file(
                path,
                args.interactions_item_column.as_deref(),
                &ids,
            );
            bar.finish_and_clear();
            Some(counted.map_err(CliError::Input)?)
        }
    };
    let bar = progress::spinner(&format!("converting {}", args.checkpoint.display()));
    let engine = recsys_engine::convert_limited(
        &ConvertRequest {
            kind,
            checkpoint: &args.checkpoint,
            config: config.as_ref(),
            item_map: args.items.source(),
            out: &out_dir,
            precision: plan.precision,
            calibration: calibration.as_ref().map(|((h, _), m)| (h.as_slice(), *m)),
            calibration_times: calibration
                .as_ref()
                .and_then(|((_, times), _)| times.as_deref()),
            screen: plan.screen,
            w8a8_layers: plan.w8a8_layers,
            catalogue: recsys_engine::CatalogueInputs {
                item_attributes: item_attributes.as_ref(),
                popularity: popularity.as_ref(),
            },
        },
        args.max_checkpoint_bytes,
    );
    bar.finish_and_clear();
    let engine = engine?;
    if remote {
        let bar = progress::bytes(0);
        bar.set_message(format!("uploading to {target}"));
        recsys_registry::transfer::upload_folder(&out_dir, &target, &mut |n| bar.set_position(n))?;
        bar.finish_and_clear();
    }
    let m = &engine.manifest;
    let weights = &m.files[recsys_engine::engine_dir::WEIGHTS_FILE];
    // The manifest's own spelling of the enums, so the message matches what users see in the file.
    let name = |v: serde_json::Value| v.as_str().unwrap_or_default().to_owned();
    if args.json {
        let summary = serde_json::json!({
            "engine": args.output,
            "kind": m.model.kind().to_string(),
            "items": engine.n_items(),
            "id_type": m.id_type,
            "precision": m.precision,
            "screen": m.screen,
            "weights_bytes": weights.bytes,
            "source": {"file": m.source.file, "format": m.source.format, "sha256": m.source.sha256},
            "calibration": m.calibration,
            "item_attributes": m.item_attributes,
            "popularity": m.popularity,
        });
        say!("{summary}");
        return Ok(0);
    }
    say!(
        "wrote {} engine to {}: {} items ({} ids), precision {}, weights {:.1} MiB, source {} ({}, sha256 {})",
        m.model.kind(),
        args.output.display(),
        engine.n_items(),
        name(serde_json::json!(m.id_type)),
        name(serde_json::json!(m.precision)),
        weights.bytes as f64 / (1024.0 * 1024.0),
        m.source.file,
        name(serde_json::json!(m.source.format)),
        &m.source.sha256[..12],
    );
    if m.screen == recsys_engine::engine_dir::Screen::Int8 {
        say!(
            "screen: int8 (each top k screened from int8 weights, survivors rescored at {}: the same answers)",
            name(serde_json::json!(m.precision))
        );
    }
    if let Some(a) = &m.item_attributes {
        say!(
            "item attributes: {} set(s) over column(s) {} for {} item(s){}",
            a.sets,
            a.columns.join(", "),
            a.items,
            if a.unknown_items > 0 {
                format!(
                    " ({} row(s) name items the catalogue does not hold: skipped)",
                    a.unknown_items
                )
            } else {
                String::new()
            }
        );
    }
    if let Some(p) = &m.popularity {
        say!(
            "popularity: {} interactions ({}) over {} item(s){}: the answer for a visitor without history",
            p.interactions,
            p.column,
            p.items,
            if p.unknown_items > 0 {
                format!(", {} naming items the catalogue does not hold (skipped)", p.unknown_items)
            } else {
                String::new()
            }
        );
    }
    if let Some(c) = m.calibration.as_ref().map(|c| &c.output_layer) {
        let method = match c.method {
            recsys_engine::calibration::CalibrationMethod::MinMax => "minmax",
            recsys_engine::calibration::CalibrationMethod::Percentile { .. } => "percentile",
            recsys_engine::calibration::CalibrationMethod::Entropy => "entropy",
        };
        say!(
            "calibration: {method} over {} histories ({} values): |activation| max {:.4}, threshold {:.4}, {:.4}% clipped",
            c.histories,
            c.values,
            c.abs_max,
            c.threshold,
            100.0 * c.clipped_fraction
        );
    }
    Ok(0)
}
