//! `recsys export-onnx`: the engine as an ONNX graph, or as a Triton onnxruntime model.

use crate::output::say;
use recsys_onnx::{ExportOptions, ExportSummary, GraphOutput, RepositoryModel};

use crate::cli::ExportOnnxArgs;
use crate::error::Result;

pub fn run(args: &ExportOnnxArgs) -> Result<i32> {
    if !args.all_scores && args.k > recsys_onnx::TENSORRT_MAX_TOPK {
        return Err(crate::error::CliError::Usage(format!(
            "--k {} is above {}, the largest k TensorRT's TopK layer takes; use --all-scores and \
             select on the host for larger k",
            args.k,
            recsys_onnx::TENSORRT_MAX_TOPK
        )));
    }
    let options = ExportOptions {
        output: if args.all_scores {
            GraphOutput::Scores
        } else {
            GraphOutput::TopK(args.k)
        },
        external_data: args.external_data,
        candidates: args.candidates,
        embedding: args.embedding,
        dedup: match args.dedup {
            crate::cli::DedupArg::Auto => recsys_onnx::Dedup::Auto,
            crate::cli::DedupArg::Scatter => recsys_onnx::Dedup::Scatter,
            crate::cli::DedupArg::Pairs => recsys_onnx::Dedup::Pairs,
        },
    };
    let summary = match (&args.output, &args.model_repository) {
        (_, Some(repository)) => {
            let manifest = recsys_engine::engine_dir::load(&args.engine)?.manifest;
            let default_name = format!(
                "{}_onnx_{}",
                manifest.model.kind().as_str(),
                format!("{:?}", manifest.precision).to_lowercase()
            );
            let uri = repository
                .to_str()
                .unwrap_or_default()
                .trim_end_matches('/')
                .to_string();
            let remote = recsys_registry::transfer::is_remote(&uri);
            let name = args.model_name.clone().unwrap_or(default_name);
            if remote
                && !args.force
                && !recsys_registry::transfer::list_folder(&format!(
                    "{uri}/{name}/{}",
                    args.version
                ))?
                .is_empty()
            {
                return Err(crate::error::CliError::Usage(format!(
                    "{uri}/{name}/{} already holds objects; pass --force to replace them",
                    args.version
                )));
            }
            // An object-store repository: the model is written to a scratch repository, then
            // uploaded (config, item map and graph).
            let scratch = if remote {
                Some(
                    tempfile::Builder::new()
                        .prefix("recsys-export-")
                        .tempdir()
                        .map_err(crate::error::CliError::io(
                            "cannot create a scratch folder (set TMPDIR)",
                        ))?,
                )
            } else {
                None
            };
            let target = RepositoryModel {
                repository: scratch
                    .as_ref()
                    .map_or_else(|| repository.clone(), |s| s.path().to_path_buf()),
                name,
                version: args.version,
                max_batch_size: args.max_batch_size,
                gpu: args.gpu,
                force: args.force || remote,
            };
            let mut summary = recsys_onnx::write_model_repository(&args.engine, &target, &options)?;
            if remote {
                let local_model = target.repository.join(&target.name);
                let remote_model = format!("{uri}/{}", target.name);
                recsys_registry::transfer::upload_folder(&local_model, &remote_model, &mut |_| {})?;
                let rebase = |p: &std::path::Path| {
                    let relative = p.strip_prefix(&local_model).unwrap_or(p);
                    std::path::PathBuf::from(format!("{remote_model}/{}", relative.display()))
                };
                let graph = rebase(&summary.path);
                let data = summary.external_data.as_deref().map(rebase);
                summary.path = graph;
                summary.external_data = data;
            }
            if !args.json {
                say!(
                    "wrote Triton model {} (onnxruntime backend, {}) in {}",
                    target.name,
                    if target.gpu { "KIND_GPU" } else { "KIND_CPU" },
                    repository.display()
                );
            }
            summary
        }
        (Some(out), None) => {
            if out.exists() && !args.force {
                return Err(crate::error::CliError::Usage(format!(
                    "{} already exists; pass --force to replace it",
                    out.display()
                )));
            }
            recsys_onnx::export(&args.engine, out, &options)?
        }
        (None, None) => unreachable!("clap requires --output or --model-repository"),
    };
    let trtexec = recsys_onnx::trtexec_command(&summary, args.max_batch_size);
    if args.json {
        let mut json = summary_json(&summary);
        json["trtexec"] = serde_json::json!(trtexec);
        say!("{json}");
    } else {
        report(&summary);
        say!("TensorRT 10 build: {trtexec}");
    }
    Ok(0)
}

fn summary_json(s: &ExportSummary) -> serde_json::Value {
    let tensors = |list: &[recsys_onnx::TensorSpec]| {
        list.iter()
            .map(|t| {
                serde_json::json!({
                    "name": t.name,
                    "dtype": t.dtype.to_string(),
                    "dims": std::iter::once(None).chain(t.dims.iter().copied()).collect::<Vec<_>>(),
                })
            })
            .collect::<Vec<_>>()
    };
    serde_json::json!({
        "path": s.path,
        "bytes": s.bytes,
        "external_data": s.external_data,
        "model": s.model.kind().as_str(),
        "precision": format!("{:?}", s.precision).to_lowercase(),
        "int8_mode": s.int8_mode,
        "opset": recsys_onnx::OPSET,
        "nodes": s.nodes,
        "quantize_nodes": s.quantize_nodes,
        "dequantize_nodes": s.dequantize_nodes,
        "inputs": tensors(&s.inputs),
        "outputs": tensors(&s.outputs),
        "tensorrt_rules": "passed",
    })
}

fn report(s: &ExportSummary) {
    let mode = s
        .int8_mode
        .as_deref()
        .map(|m| format!(" ({m})"))
        .unwrap_or_default();
    say!(
        "wrote {} ({:.1} MB): {} at {}{mode}, opset {}, {} nodes, {} QuantizeLinear, {} DequantizeLinear",
        s.path.display(),
        s.bytes as f64 / 1e6,
        s.model.kind().as_str(),
        format!("{:?}", s.precision).to_lowercase(),
        recsys_onnx::OPSET,
        s.nodes,
        s.quantize_nodes,
        s.dequantize_nodes
    );
    if let Some(data) = &s.external_data {
        say!("weights in {}", data.display());
    }
    let fmt = |list: &[recsys_onnx::TensorSpec]| {
        list.iter()
            .map(|t| {
                let dims: Vec<String> = std::iter::once("batch".to_string())
                    .chain(
                        t.dims
                            .iter()
                            .map(|v| v.map_or("?".into(), |v| v.to_string())),
                    )
                    .collect();
                format!("{} {} [{}]", t.name, t.dtype, dims.join(", "))
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    say!("inputs: {}", fmt(&s.inputs));
    say!("outputs: {}", fmt(&s.outputs));
    say!(
        "TensorRT 10 rules: passed (parser, explicit quantization, strong typing: \
         docs/QUANTIZATION.md; checked on the graph, no TensorRT build run)"
    );
    match s.int8_mode.as_deref() {
        Some("weight-only") => say!(
            "note: weight-only int8 multiplies float activations; TensorRT builds these layers in \
             float, not as INT8 GEMMs (an onnxruntime and file-size format). For INT8 kernels convert \
             with --int8-mode w8a8-all"
        ),
        Some("w8a8") if s.quantize_nodes > 0 => {}
        Some(m) if m.contains("output layer only") => say!(
            "note: this engine predates per-layer calibration: only the output layer's input is \
             quantized; re-convert with --calibration for INT8 dense layers"
        ),
        _ => {}
    }
}
