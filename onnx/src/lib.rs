//! Exports a recsys engine directory as a self-contained ONNX model (opset 17) that computes what
//! the engine computes, at the engine's precision:
//!
//! - fp32: float initializers;
//! - fp16: typed FP16 end to end (weights, biases, activations, GEMMs), with LayerNormalization,
//!   Softmax and the L2 normalisation in fp32 through explicit Casts: what a strongly typed
//!   TensorRT build runs as FP16 kernels. Outputs are cast to float.
//! - int8: the engine's int8 bytes and per-row scales through `DequantizeLinear`, each feeding its
//!   MatMul, Gemm or Gather directly; a W8A8 engine's calibrated static activation scales become
//!   a `QuantizeLinear`/`DequantizeLinear` pair on the input of every dense layer and the output
//!   layer. That explicit Q/DQ form is what TensorRT 10 builds int8 GEMMs from. Weight-only int8
//!   graphs multiply float activations: an onnxruntime and file-size format, not TensorRT INT8.
//!
//! Every graph passes [`tensorrt_rules::check`], the TensorRT 10 rules visible in the graph.
//!
//! Inputs are internal item indices (the engine's `item_ids.tsv` maps them), plus `exclude_ids`,
//! indices whose scores are set to -inf (pad with 0, which is always excluded), and with
//! [`ExportOptions::candidates`] `candidate_ids`, the only items to score (a retrieval stage's
//! candidates: Gather of their rows, MatMul, TopK). Outputs are the top-k (`topk_scores`,
//! `topk_items`) or the scores (`scores`), and with [`ExportOptions::embedding`] the user embedding
//! `user_embedding` (`[h, 1]`, whose inner product with an item's `[embedding, bias]` row is its
//! score).
#![forbid(unsafe_code)]

mod graph;
mod hstu;
mod models;
mod repository;
pub mod tensorrt_rules;

use std::path::{Path, PathBuf};

use onnx_protobuf as pb;
use pb::tensor_proto::DataType;
use protobuf::{Message, MessageField};
use recsys_engine::config::ModelConfig;
use recsys_engine::engine_dir::{self, Precision};

use graph::{value_info, Attr, GraphBuilder};
pub use repository::{write_model_repository, RepositoryModel};

pub const OPSET: i64 = 17;
/// IR version 8 is the one that goes with opset 17.
pub const IR_VERSION: i64 = 8;
/// Above this many initializer bytes the weights go to a `<file>.data` side file (protobuf messages
/// cannot exceed 2 GiB).
pub const EXTERNAL_DATA_THRESHOLD: usize = 1 << 30;

#[derive(Debug, thiserror::Error)]
pub enum OnnxError {
    #[error(transparent)]
    Engine(#[from] recsys_engine::EngineError),
    #[error("{0}")]
    Invalid(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = OnnxError> = std::result::Result<T, E>;

/// The largest k TensorRT 10's TopK layer takes (its documented limit); exports refuse more, so a
/// graph never fails only when a user builds it with TensorRT.
pub const TENSORRT_MAX_TOPK: usize = 3840;

impl OnnxError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> OnnxError {
        OnnxError::Io {
            context: context.into(),
            source,
        }
    }
}

/// What the graph returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphOutput {
    /// `topk_scores` `[batch, k]` (float) and `topk_items` `[batch, k]` (int64 internal indices).
    TopK(usize),
    /// `scores` `[batch, N+1]`: every item's score, excluded ones -inf.
    Scores,
}

/// How a Mult-VAE graph drops duplicate items from the padded history it is given (each
/// distinct item counts once, as in the engine).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Dedup {
    /// [`Dedup::Scatter`] below 65,536 items, [`Dedup::Pairs`] from there.
    #[default]
    Auto,
    /// A scatter over one row of the catalogue per history (`[batch, N+1]` int64 each run):
    /// linear in the history's length.
    Scatter,
    /// Pairwise comparison of the history's slots (`[batch, T, T]`): no memory per catalogue
    /// item, but quadratic in the padded history's length T.
    Pairs,
}

#[derive(Clone, Debug)]
pub struct ExportOptions {
    pub output: GraphOutput,
    /// Force weights into a side file even below [`EXTERNAL_DATA_THRESHOLD`].
    pub external_data: bool,
    /// Score only the `candidate_ids` input's items (`[batch, C]`, right-padded with 0, C >= k):
    /// `topk_items` are then item indices taken from the candidates, `scores` is `[batch, C]` in
    /// candidate order.
    pub candidates: bool,
    /// Add the `user_embedding` output, `[batch, d + 1]`.
    pub embedding: bool,
    /// Mult-VAE only: how the graph drops duplicate history items.
    pub dedup: Dedup,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            output: GraphOutput::TopK(100),
            external_data: false,
            candidates: false,
            embedding: false,
            dedup: Dedup::Auto,
        }
    }
}

/// What was written, for the command's report and the Triton config.
#[derive(Clone, Debug)]
pub struct ExportSummary {
    pub path: PathBuf,
    /// The weights side file, when one was written.
    pub external_data: Option<PathBuf>,
    pub bytes: u64,
    pub model: ModelConfig,
    pub precision: Precision,
    /// "weight-only" or "w8a8" for int8 engines.
    pub int8_mode: Option<String>,
    pub output: GraphOutput,
    pub nodes: usize,
    pub quantize_nodes: usize,
    pub dequantize_nodes: usize,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
}

/// A graph input or output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    /// "int64" or "float".
    pub dtype: &'static str,
    /// Dims after the batch dim; `None` = dynamic.
    pub dims: Vec<Option<usize>>,
}

fn type_name(dtype: DataType) -> &'static str {
    if dtype == DataType::INT64 {
        "int64"
    } else {
        "float"
    }
}

/// The int8 mode ("weight-only", "w8a8" with every dense layer's input quantized, or "w8a8
/// (output layer only)" for engines converted before the dense layers were calibrated) and the
/// static activation scales the graph quantizes with.
fn activation_scales(
    manifest: &engine_dir::Manifest,
) -> Result<(Option<String>, models::ActivationScales)> {
    if manifest.precision != Precision::Int8 {
        return Ok((None, Default::default()));
    }
    match manifest
        .output_activation_scale()
        .map_err(OnnxError::Invalid)?
    {
        // QuantizeLinear divides by the scale.
        Some(scale) if scale > 0.0 => {
            let dense = manifest
                .dense_activation_scales()
                .map_err(OnnxError::Invalid)?;
            let mode = if dense.is_empty() {
                "w8a8 (output layer only)"
            } else {
                "w8a8"
            };
            if let Some((layer, s)) = dense.iter().find(|(_, s)| **s <= 0.0) {
                return Err(OnnxError::Invalid(format!(
                    "w8a8 engine with activation scale {s} for {layer}: QuantizeLinear needs \
                     positive scales (re-convert with calibration histories that reach the layer)"
                )));
            }
            Ok((
                Some(mode.into()),
                models::ActivationScales {
                    dense,
                    output: Some(scale),
                },
            ))
        }
        Some(_) => Err(OnnxError::Invalid(
            "w8a8 engine with a zero activation scale cannot be expressed as QuantizeLinear".into(),
        )),
        None => Ok((Some("weight-only".into()), Default::default())),
    }
}

/// Builds the ONNX model of the engine in `engine`; returns it with its summary (path unset).
/// Every graph passes the TensorRT rules check ([`tensorrt_rules::check`]) before it is returned.
pub fn build(engine: &Path, options: &ExportOptions) -> Result<(pb::ModelProto, ExportSummary)> {
    let loaded = engine_dir::load(engine)?;
    let manifest = &loaded.manifest;
    let (int8_mode, scales) = activation_scales(manifest)?;
    let act_scale = scales.output;
    // fp16 engines export FP16 end to end; fp32 and int8 (whose Q/DQ dequantize to float) FP32.
    let float = if manifest.precision == Precision::Fp16 {
        DataType::FLOAT16
    } else {
        DataType::FLOAT
    };
    let mut g = GraphBuilder::new(float);
    let mut model = match &manifest.model {
        ModelConfig::Bert4rec(c) => {
            let kind = models::Transformer::Bert4Rec;
            models::transformer(&mut g, kind, c, &loaded.weights, &scales)?
        }
        ModelConfig::Sasrec(c) => {
            let kind = models::Transformer::SasRec;
            models::transformer(&mut g, kind, c, &loaded.weights, &scales)?
        }
        ModelConfig::Gru4rec(c) => models::gru4rec(&mut g, c, &loaded.weights, &scales)?,
        ModelConfig::Vaecf(c) => models::vaecf(&mut g, c, &loaded.weights, &scales, options.dedup)?,
        ModelConfig::Hstu(c) => hstu::hstu(&mut g, c, &loaded.weights, &scales)?,
    };
    let n_outputs = model.n_outputs;
    if let GraphOutput::TopK(k) = options.output {
        if k > TENSORRT_MAX_TOPK {
            return Err(OnnxError::Invalid(format!(
                "k = {k} is above {TENSORRT_MAX_TOPK}, the largest k TensorRT's TopK layer takes; \
                 export --all-scores and select on the host for larger k"
            )));
        }
        if k == 0 || k >= n_outputs {
            return Err(OnnxError::Invalid(format!(
                "k = {k} is out of range: the model scores {} items, so k must be 1..={}",
                n_outputs - 1,
                n_outputs - 1
            )));
        }
    }

    let exclude = "exclude_ids";
    let candidates = "candidate_ids";
    let mut inputs = std::mem::take(&mut model.inputs);
    let scores = if options.candidates {
        let scores = model.candidate_scores(&mut g, candidates, act_scale);
        // A candidate listed in exclude_ids scores -inf: [B, C, 1] == [B, 1, E], any over E.
        let axes2 = g.init_i64("axes", &[2]);
        let axes1 = g.init_i64("axes", &[1]);
        let column = g.op("Unsqueeze", &[candidates, &axes2], vec![]);
        let row = g.op("Unsqueeze", &[exclude, &axes1], vec![]);
        let hit = g.op("Equal", &[&column, &row], vec![]);
        let hit = g.cast_to_compute(&hit);
        let any = g.op(
            "ReduceMax",
            &[&hit],
            vec![("axes", Attr::Ints(vec![2])), ("keepdims", Attr::Int(0))],
        );
        let any = g.op(
            "Cast",
            &[&any],
            vec![("to", Attr::Int(DataType::BOOL as i64))],
        );
        let minus_inf = g.scalar_float("minus_inf", f32::NEG_INFINITY);
        inputs.push(value_info(
            candidates,
            DataType::INT64,
            &[None, None],
            &["batch", "candidate_slots"],
            "internal item indices to rank (a retrieval stage's candidates), right-padded with 0 \
             (which scores -inf) to at least k slots",
        ));
        g.op("Where", &[&any, &minus_inf, &scores], vec![])
    } else {
        // Caller exclusions: scatter -inf into the listed columns.
        let logits = model.logits(&mut g, act_scale);
        let minus_inf = g.filled_like(exclude, f32::NEG_INFINITY);
        g.op(
            "ScatterElements",
            &[&logits, exclude, &minus_inf],
            vec![("axis", Attr::Int(1))],
        )
    };
    inputs.push(value_info(
        exclude,
        DataType::INT64,
        &[None, None],
        &["batch", "exclude_slots"],
        "internal item indices to leave out of the answer (typically the history), right-padded with 0",
    ));
    let mut outputs = match options.output {
        GraphOutput::TopK(k) => {
            let kk = g.init_i64("k", &[k as i64]);
            let items = if options.candidates {
                "topk_positions"
            } else {
                "topk_items"
            };
            // Scores leave the graph as float whatever the compute type.
            let top_scores = if float == DataType::FLOAT {
                "topk_scores"
            } else {
                "topk_scores_compute"
            };
            g.node_with_outputs(
                "TopK",
                &[&scores, &kk],
                &[top_scores, items],
                vec![
                    ("axis", Attr::Int(1)),
                    ("largest", Attr::Int(1)),
                    ("sorted", Attr::Int(1)),
                ],
            );
            if float != DataType::FLOAT {
                cast_to_output(&mut g, top_scores, "topk_scores");
            }
            if options.candidates {
                // Positions in the candidate list back to item indices.
                g.node_with_outputs(
                    "GatherElements",
                    &[candidates, items],
                    &["topk_items"],
                    vec![("axis", Attr::Int(1))],
                );
            }
            vec![
                ("topk_scores", DataType::FLOAT, vec![Some(k)]),
                ("topk_items", DataType::INT64, vec![Some(k)]),
            ]
        }
        GraphOutput::Scores => {
            if float == DataType::FLOAT {
                g.node_with_outputs("Identity", &[&scores], &["scores"], vec![]);
            } else {
                cast_to_output(&mut g, &scores, "scores");
            }
            let width = if options.candidates {
                None
            } else {
                Some(n_outputs)
            };
            vec![("scores", DataType::FLOAT, vec![width])]
        }
    };
    if options.embedding {
        // [h, 1]: a column of ones shaped like h's first column.
        let (s0, s1, a1) = (
            g.init_i64("starts", &[0]),
            g.init_i64("ends", &[1]),
            g.init_i64("axes", &[1]),
        );
        let first = g.op("Slice", &[&model.hidden, &s0, &s1, &a1], vec![]);
        let ones = g.filled_like(&first, 1.0);
        let embedding = g.op(
            "Concat",
            &[&model.hidden, &ones],
            vec![("axis", Attr::Int(1))],
        );
        if float == DataType::FLOAT {
            g.node_with_outputs("Identity", &[&embedding], &["user_embedding"], vec![]);
        } else {
            cast_to_output(&mut g, &embedding, "user_embedding");
        }
        outputs.push((
            "user_embedding",
            DataType::FLOAT,
            vec![Some(model.hidden_size + 1)],
        ));
    }
    let describe = |dims: &[Option<usize>]| {
        let mut all = vec![None];
        all.extend_from_slice(dims);
        all
    };
    let graph_outputs = outputs
        .iter()
        .map(|(name, dtype, dims)| value_info(name, *dtype, &describe(dims), &["batch"], ""))
        .collect();
    let input_summary = inputs
        .iter()
        .map(|vi| {
            let t = vi.type_.tensor_type();
            let dims = t.shape.dim[1..]
                .iter()
                .map(|d| match d.value {
                    Some(pb::tensor_shape_proto::dimension::Value::DimValue(v)) => Some(v as usize),
                    _ => None,
                })
                .collect();
            TensorSpec {
                name: vi.name.clone(),
                dtype: if t.elem_type == DataType::INT64 as i32 {
                    "int64"
                } else {
                    "float"
                },
                dims,
            }
        })
        .collect();
    let outputs = outputs
        .into_iter()
        .map(|(name, dtype, dims)| TensorSpec {
            name: name.to_string(),
            dtype: type_name(dtype),
            dims,
        })
        .collect();

    let kind = manifest.model.kind().as_str();
    let precision = manifest.precision.as_str();
    let mut metadata = vec![
        ("recsys.kind", kind.to_string()),
        ("recsys.precision", precision.to_string()),
        ("recsys.n_items", (n_outputs - 1).to_string()),
        ("recsys.source_sha256", manifest.source.sha256.clone()),
        (
            "recsys.item_ids",
            "internal index -> external id: the engine's item_ids.tsv".to_string(),
        ),
    ];
    if let Some(mode) = &int8_mode {
        metadata.push(("recsys.int8_mode", mode.clone()));
    }
    if let ModelConfig::Bert4rec(c) = &manifest.model {
        metadata.push(("recsys.mask_index", (c.n_items + 1).to_string()));
    }
    match &manifest.model {
        ModelConfig::Bert4rec(c) | ModelConfig::Sasrec(c) => {
            metadata.push(("recsys.max_len", c.max_len.to_string()))
        }
        ModelConfig::Gru4rec(c) => metadata.push(("recsys.max_len", c.max_len.to_string())),
        ModelConfig::Hstu(c) => metadata.push(("recsys.max_len", c.max_len.to_string())),
        ModelConfig::Vaecf(_) => {}
    }
    let summary = ExportSummary {
        path: PathBuf::new(),
        external_data: None,
        bytes: 0,
        model: manifest.model.clone(),
        precision: manifest.precision,
        int8_mode,
        output: options.output,
        nodes: g.nodes.len(),
        quantize_nodes: g.quantize_nodes,
        dequantize_nodes: g.dequantize_nodes,
        inputs: input_summary,
        outputs,
    };
    let proto = pb::ModelProto {
        ir_version: IR_VERSION,
        opset_import: vec![pb::OperatorSetIdProto {
            domain: String::new(),
            version: OPSET,
            ..Default::default()
        }],
        producer_name: "recsys".into(),
        producer_version: env!("CARGO_PKG_VERSION").into(),
        doc_string: format!(
            "{kind} exported by recsys from an engine at {precision}; inputs are internal item \
             indices (see the engine's item_ids.tsv)"
        ),
        graph: MessageField::some(pb::GraphProto {
            name: format!("recsys_{kind}_{precision}"),
            node: std::mem::take(&mut g.nodes),
            initializer: std::mem::take(&mut g.initializers),
            input: inputs,
            output: graph_outputs,
            ..Default::default()
        }),
        metadata_props: metadata
            .into_iter()
            .map(|(key, value)| pb::StringStringEntryProto {
                key: key.into(),
                value,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let violations = tensorrt_rules::check(&proto);
    if !violations.is_empty() {
        return Err(OnnxError::Invalid(format!(
            "the exported graph breaks {} TensorRT rule(s) (a bug in the exporter; please report \
             it): {}",
            violations.len(),
            violations.join("; ")
        )));
    }
    Ok((proto, summary))
}

/// A graph output named `name`: `x` cast to float.
fn cast_to_output(g: &mut GraphBuilder, x: &str, name: &str) {
    g.node_with_outputs(
        "Cast",
        &[x],
        &[name],
        vec![("to", Attr::Int(DataType::FLOAT as i64))],
    );
}

/// Exports the engine in `engine` to `out` (written atomically); large weights go to `out.data`.
pub fn export(engine: &Path, out: &Path, options: &ExportOptions) -> Result<ExportSummary> {
    let (mut proto, mut summary) = build(engine, options)?;
    let graph = proto.graph.as_mut().expect("built with a graph");
    let weight_bytes: usize = graph.initializer.iter().map(|t| t.raw_data.len()).sum();
    let data_path = if options.external_data || weight_bytes > EXTERNAL_DATA_THRESHOLD {
        let file_name = format!(
            "{}.data",
            out.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model.onnx".into())
        );
        let path = out.with_file_name(&file_name);
        let mut blob = Vec::with_capacity(weight_bytes);
        for t in graph
            .initializer
            .iter_mut()
            .filter(|t| t.raw_data.len() >= 1024)
        {
            // Offsets aligned to 64 bytes, so a reader can map the file and view tensors in place.
            blob.resize(blob.len().next_multiple_of(64), 0);
            let offset = blob.len();
            blob.extend_from_slice(&t.raw_data);
            t.external_data = [
                ("location", file_name.clone()),
                ("offset", offset.to_string()),
                ("length", t.raw_data.len().to_string()),
            ]
            .into_iter()
            .map(|(key, value)| pb::StringStringEntryProto {
                key: key.into(),
                value,
                ..Default::default()
            })
            .collect();
            t.data_location =
                protobuf::EnumOrUnknown::new(pb::tensor_proto::DataLocation::EXTERNAL);
            t.raw_data = Vec::new();
        }
        write_atomically(&path, &blob)?;
        Some(path)
    } else {
        None
    };
    let bytes = proto
        .write_to_bytes()
        .map_err(|e| OnnxError::Invalid(format!("cannot serialise the ONNX model: {e}")))?;
    write_atomically(out, &bytes)?;
    summary.path = out.to_path_buf();
    summary.bytes = bytes.len() as u64
        + data_path
            .as_ref()
            .and_then(|p| std::fs::metadata(p).ok())
            .map_or(0, |m| m.len());
    summary.external_data = data_path;
    Ok(summary)
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .map_err(|e| OnnxError::io(format!("cannot create {}", parent.display()), e))?;
    }
    let tmp = PathBuf::from(format!("{}.partial", path.display()));
    std::fs::write(&tmp, bytes)
        .map_err(|e| OnnxError::io(format!("cannot write {}", tmp.display()), e))?;
    std::fs::rename(&tmp, path)
        .map_err(|e| OnnxError::io(format!("cannot rename {} into place", tmp.display()), e))
}

/// Slots of a dynamic input's second dimension in the TensorRT optimisation profile the user
/// guide's build (docs/guide/src/onnx.md) uses: (min, opt, max).
fn profile_slots(input: &str, output: GraphOutput) -> (usize, usize, usize) {
    match input {
        // TopK's K must fit the candidate axis at every shape of the profile.
        "candidate_ids" => {
            let k = match output {
                GraphOutput::TopK(k) => k,
                GraphOutput::Scores => 1,
            };
            (k, k.max(200), k.max(1000))
        }
        _ => (1, 64, 512),
    }
}

/// The `trtexec` command that builds a TensorRT 10 engine (`model.plan`) from the exported graph
/// as NVIDIA recommends for Q/DQ and FP16 graphs: `--stronglyTyped` (each layer runs in the types
/// the graph gives it, so no `--fp16`/`--int8` flags), with an optimisation profile from batch 1
/// to `max_batch` (the Triton config's `max_batch_size`) over every input.
pub fn trtexec_command(summary: &ExportSummary, max_batch: usize) -> String {
    let shapes = |batch: usize, pick: fn((usize, usize, usize)) -> usize| {
        summary
            .inputs
            .iter()
            .map(|t| {
                let dims: Vec<String> =
                    std::iter::once(batch)
                        .chain(t.dims.iter().map(|d| {
                            d.unwrap_or_else(|| pick(profile_slots(&t.name, summary.output)))
                        }))
                        .map(|d| d.to_string())
                        .collect();
                format!("{}:{}", t.name, dims.join("x"))
            })
            .collect::<Vec<_>>()
            .join(",")
    };
    let max_batch = max_batch.max(1);
    format!(
        "trtexec --onnx={} --stronglyTyped --minShapes={} --optShapes={} --maxShapes={} \
         --saveEngine=model.plan",
        summary.path.display(),
        shapes(1, |s| s.0),
        shapes(max_batch, |s| s.1),
        shapes(max_batch, |s| s.2),
    )
}
