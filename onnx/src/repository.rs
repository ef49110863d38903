//! A Triton model for the exported graph: `<repository>/<name>/<version>/model.onnx` with a
//! `config.pbtxt` for Triton's `onnxruntime` backend, the item-id map beside it (the graph speaks
//! internal indices) and a note of what was exported from where.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::{export, ExportOptions, ExportSummary, OnnxError, Result, TensorSpec};

/// Where and how to write the Triton model.
#[derive(Clone, Debug)]
pub struct RepositoryModel {
    pub repository: PathBuf,
    pub name: String,
    pub version: u64,
    pub max_batch_size: usize,
    /// `KIND_CPU` or `KIND_GPU` (the onnxruntime backend runs the CUDA execution provider there).
    pub gpu: bool,
    /// Replace an existing version directory.
    pub force: bool,
}

fn triton_type(dtype: &str) -> &'static str {
    if dtype == "int64" {
        "TYPE_INT64"
    } else {
        "TYPE_FP32"
    }
}

fn dims(d: &[Option<usize>]) -> String {
    d.iter()
        .map(|v| v.map_or("-1".to_string(), |v| v.to_string()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The `config.pbtxt` for an exported graph.
pub fn config_pbtxt(target: &RepositoryModel, summary: &ExportSummary) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# Written by `recsys export-onnx`: the exported graph ({}, {}) on Triton's onnxruntime\n\
         # backend. Inputs and outputs are internal item indices; item_ids.tsv maps them.\n\
         # Triton batches only requests whose variable-length inputs have equal shapes: pad them\n\
         # to a fixed width on the client for dynamic batching to pay.",
        summary.model.kind().as_str(),
        format!("{:?}", summary.precision).to_lowercase(),
    );
    let _ = writeln!(s, "name: \"{}\"", target.name);
    let _ = writeln!(s, "backend: \"onnxruntime\"");
    let _ = writeln!(s, "max_batch_size: {}", target.max_batch_size);
    let io = |list: &[TensorSpec]| {
        list.iter()
            .map(|t| {
                format!(
                    "  {{ name: \"{}\" data_type: {} dims: [ {} ] }}",
                    t.name,
                    triton_type(t.dtype),
                    dims(&t.dims)
                )
            })
            .collect::<Vec<_>>()
            .join(",\n")
    };
    let _ = writeln!(s, "input [\n{}\n]", io(&summary.inputs));
    let _ = writeln!(s, "output [\n{}\n]", io(&summary.outputs));
    let kind = if target.gpu { "KIND_GPU" } else { "KIND_CPU" };
    let _ = writeln!(s, "instance_group [ {{ kind: {kind} count: 1 }} ]");
    let _ = writeln!(
        s,
        "dynamic_batching {{ max_queue_delay_microseconds: 100 }}"
    );
    s
}

/// Exports `engine` into the Triton model repository; returns the export summary.
pub fn write_model_repository(
    engine: &Path,
    target: &RepositoryModel,
    options: &ExportOptions,
) -> Result<ExportSummary> {
    if target.name.is_empty()
        || !target
            .name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
        || target.name.starts_with('.')
    {
        return Err(OnnxError::Invalid(format!(
            "model name {:?} must be letters, digits, '_', '-' or '.' (it becomes a directory)",
            target.name
        )));
    }
    if target.version == 0 {
        return Err(OnnxError::Invalid(
            "Triton model versions start at 1".into(),
        ));
    }
    if target.max_batch_size == 0 {
        return Err(OnnxError::Invalid(
            "max batch size must be at least 1".into(),
        ));
    }
    let model_dir = target.repository.join(&target.name);
    let version_dir = model_dir.join(target.version.to_string());
    if version_dir.exists() {
        if !target.force {
            return Err(OnnxError::Invalid(format!(
                "{} already exists; pass --force to replace it",
                version_dir.display()
            )));
        }
        std::fs::remove_dir_all(&version_dir)
            .map_err(|e| OnnxError::io(format!("cannot remove {}", version_dir.display()), e))?;
    }
    let summary = export(engine, &version_dir.join("model.onnx"), options)?;
    let ids = engine.join(recsys_engine::engine_dir::ITEM_IDS_FILE);
    std::fs::copy(&ids, model_dir.join("item_ids.tsv"))
        .map_err(|e| OnnxError::io(format!("cannot copy {}", ids.display()), e))?;
    let config = config_pbtxt(target, &summary);
    std::fs::write(model_dir.join("config.pbtxt"), config)
        .map_err(|e| OnnxError::io("cannot write config.pbtxt", e))?;
    Ok(summary)
}
