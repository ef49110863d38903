//! `recsys.convert` and `recsys.evaluate` as the command line runs them: the same conversion
//! options and refusals (`ConvertOptions`, spelled as keywords) and the same evaluation.

use std::path::PathBuf;

use pyo3::exceptions::{PyFileNotFoundError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use recsys_engine::calibration::read_timed_histories;
use recsys_engine::metrics::{evaluate as evaluate_engine, read_test_set};
use recsys_engine::{ConvertOptions, ConvertRequest, ModelKind, Spelling};

use crate::engine::PyEngine;
use crate::engine_error;

/// Converts a checkpoint into an engine directory, as `recsys convert` does; returns the engine.
#[pyfunction]
#[pyo3(signature = (kind, checkpoint, item_map, output, config = None, precision = "fp32",
                    int8_mode = "weight-only", calibration = None, calibration_method = "entropy",
                    calibration_percentile = 99.99, screen = "none", force = false,
                    item_attributes = None, interactions = None, interactions_item_column = None))]
#[allow(clippy::too_many_arguments)] // mirrors the command line's flags, keyword arguments
pub(crate) fn convert(
    py: Python<'_>,
    kind: &str,
    checkpoint: PathBuf,
    item_map: PathBuf,
    output: PathBuf,
    config: Option<PathBuf>,
    precision: &str,
    int8_mode: &str,
    calibration: Option<PathBuf>,
    calibration_method: &str,
    calibration_percentile: f64,
    screen: &str,
    force: bool,
    item_attributes: Option<PathBuf>,
    interactions: Option<PathBuf>,
    interactions_item_column: Option<String>,
) -> PyResult<PyEngine> {
    let kind: ModelKind = kind.parse().map_err(PyValueError::new_err)?;
    // The command line's options, defaults and refusals (`ConvertOptions`), spelled as keywords.
    let plan = ConvertOptions {
        precision: precision.parse().map_err(PyValueError::new_err)?,
        int8_mode: int8_mode.parse().map_err(PyValueError::new_err)?,
        screen: screen.parse().map_err(PyValueError::new_err)?,
        calibration: calibration.is_some(),
        calibration_method: calibration_method.parse().map_err(PyValueError::new_err)?,
        calibration_percentile,
    }
    .plan(Spelling::Keywords)
    .map_err(PyValueError::new_err)?;
    if output.exists() && !force && std::fs::read_dir(&output).is_ok_and(|mut d| d.next().is_some())
    {
        return Err(PyValueError::new_err(format!(
            "{} already exists; pass force=True to replace it",
            output.display()
        )));
    }
    let config = match config {
        None => None,
        Some(path) => {
            let text = std::fs::read_to_string(&path).map_err(|e| {
                PyFileNotFoundError::new_err(format!("cannot read config {}: {e}", path.display()))
            })?;
            match serde_json::from_str::<serde_json::Value>(&text) {
                Ok(serde_json::Value::Object(map)) => Some(map),
                _ => {
                    return Err(PyValueError::new_err(format!(
                        "{} is not a JSON object",
                        path.display()
                    )))
                }
            }
        }
    };
    // CSV or TSV (the engine's reader); the command line also reads Parquet.
    let item_attributes = match item_attributes {
        None => None,
        Some(path) if !path.exists() => {
            return Err(PyFileNotFoundError::new_err(format!(
                "item attributes {}: no such file",
                path.display()
            )))
        }
        Some(path) => Some(
            recsys_engine::AttributeTable::read_delimited(&path).map_err(PyValueError::new_err)?,
        ),
    };
    let popularity = match interactions {
        None => None,
        Some(path) => {
            let ids = recsys_engine::ItemMapSource::Tsv(&item_map)
                .read(recsys_engine::import::DEFAULT_MAX_CHECKPOINT_BYTES)
                .map_err(engine_error)?;
            Some(
                recsys_engine::popularity::Popularity::count_file(
                    &path,
                    interactions_item_column.as_deref(),
                    &ids,
                )
                .map_err(PyValueError::new_err)?,
            )
        }
    };
    let calibration = match (calibration, plan.calibration) {
        (Some(path), Some(method)) => {
            Some((read_timed_histories(&path).map_err(engine_error)?, method))
        }
        _ => None,
    };
    let engine = py
        .detach(|| {
            recsys_engine::convert(&ConvertRequest {
                kind: Some(kind),
                checkpoint: &checkpoint,
                config: config.as_ref(),
                item_map: recsys_engine::ItemMapSource::Tsv(&item_map),
                out: &output,
                precision: plan.precision,
                calibration: calibration
                    .as_ref()
                    .map(|((histories, _), method)| (histories.as_slice(), *method)),
                calibration_times: calibration
                    .as_ref()
                    .and_then(|((_, times), _)| times.as_deref()),
                screen: plan.screen,
                w8a8_layers: plan.w8a8_layers,
                catalogue: recsys_engine::CatalogueInputs {
                    item_attributes: item_attributes.as_ref(),
                    popularity: popularity.as_ref(),
                },
            })
        })
        .map_err(engine_error)?;
    let mut engine = engine;
    engine.set_threads(std::thread::available_parallelism().map_or(1, |n| n.get()));
    Ok(PyEngine {
        engine: std::sync::RwLock::new(std::sync::Arc::new(engine)),
        on_device: None,
        device: crate::device::DeviceChoice::Cpu,
        path: output,
        _copy: None,
        amx_refused: None,
    })
}

/// Ranking quality on a test set (TSV: user, target, history), as `recsys eval` reports it: a dict
/// with "metrics" (ndcg@k, recall@k, mrr, n_users), "unknown_history_ids" and "unknown_targets".
#[pyfunction]
#[pyo3(signature = (engine, test_set, k = vec![10, 20, 100], batch_size = 256))]
pub(crate) fn evaluate<'py>(
    py: Python<'py>,
    engine: &PyEngine,
    test_set: PathBuf,
    k: Vec<usize>,
    batch_size: usize,
) -> PyResult<Bound<'py, PyDict>> {
    if k.is_empty() || k.contains(&0) {
        return Err(PyValueError::new_err("k needs cut-offs of at least 1"));
    }
    let cases = read_test_set(&test_set).map_err(engine_error)?;
    let inner = engine.engine();
    let report = py
        .detach(|| evaluate_engine(&inner, &cases, &k, batch_size.max(1), |_| {}))
        .map_err(engine_error)?;
    let metrics = PyDict::new(py);
    for (name, value) in &report.metrics {
        if name == "n_users" {
            metrics.set_item(name, *value as u64)?;
        } else {
            metrics.set_item(name, *value)?;
        }
    }
    let out = PyDict::new(py);
    out.set_item("metrics", metrics)?;
    out.set_item("unknown_history_ids", report.unknown_history_ids)?;
    out.set_item("unknown_targets", report.unknown_targets)?;
    Ok(out)
}
