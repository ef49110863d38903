//! The serving API: external ids in, top-k external ids and scores out.

use std::path::{Path, PathBuf};

use crate::calibration::{self, CalibrationMethod, CalibrationSummary};
use crate::config::{ModelConfig, ModelKind};
use crate::engine_dir::{self, EngineParts, Manifest, Precision, RawTensor, SourceCheckpoint};
use crate::error::{EngineError, Result};
use crate::idmap::{ExternalId, ExternalIds, IdMap};
use crate::import::Checkpoint;
use crate::kernels::fused::{self, Exclusions, RowQuery};
use crate::kernels::packed::{quantize_int8_per_row, to_f16_bits, PackedOutput};
use crate::kernels::KernelTable;
use crate::models::{HistoryNote, Model};
use crate::topk::Scored;
use crate::weights::scale_name;

/// What to do with history ids the catalogue does not know.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UnknownItemPolicy {
    /// Drop them and count them (the default: catalogues churn faster than models retrain).
    #[default]
    Drop,
    /// Refuse the request.
    Error,
}

impl std::str::FromStr for UnknownItemPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "drop" | "skip" | "ignore" => Ok(UnknownItemPolicy::Drop),
            "error" => Ok(UnknownItemPolicy::Error),
            _ => Err(format!(
                "unknown_item_policy must be \"drop\" or \"error\", found {s:?}"
            )),
        }
    }
}

/// Serving options that hold for every request of a model.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub default_k: usize,
    /// Leave the history's own items out of the answer.
    pub exclude_seen: bool,
    pub unknown_items: UnknownItemPolicy,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            default_k: 10,
            exclude_seen: true,
            unknown_items: UnknownItemPolicy::Drop,
        }
    }
}

/// One user's request.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    /// The user's history, oldest first.
    pub history: ExternalIds<'a>,
    /// Overrides [`ServeOptions::default_k`].
    pub k: Option<i64>,
    /// Extra items never to recommend (out of stock, already bought elsewhere).
    pub exclude: Option<ExternalIds<'a>>,
}

/// One user's answer.
#[derive(Clone, Debug, PartialEq)]
pub struct Recommendation {
    /// Best first, internal indices with scores.
    pub items: Vec<Scored>,
    /// History ids that were not in the catalogue.
    pub unknown_ids: usize,
    /// The history was longer than the model's window (BERT4Rec keeps the most recent items).
    pub truncated: bool,
}

/// A request already mapped to internal indices.
#[derive(Clone, Debug, Default)]
pub struct InternalRequest {
    pub history: Vec<u32>,
    pub exclude: Vec<u32>,
    pub k: usize,
    pub exclude_seen: bool,
}

/// The output layer as the fused kernels read it, and how to run them.
pub struct Scorer {
    pub packed: PackedOutput,
    pub kernels: &'static KernelTable,
    /// Threads one batch's scoring may use (instances x threads should fit the cores).
    pub threads: usize,
}

/// Each row's best items, best first.
pub type RankedRows = Vec<Vec<Scored>>;

/// What answers a batch of prepared requests: the engine itself (the whole model on the CPU) or a
/// device that runs the whole model (the CUDA path). The serving layer picks one per model
/// instance.
pub trait BatchRecommender: Send + Sync {
    /// Each request's best items, best first, with what the model noted about its history.
    fn recommend_batch(&self, batch: &[InternalRequest])
        -> Result<Vec<(Vec<Scored>, HistoryNote)>>;
}

impl BatchRecommender for Engine {
    fn recommend_batch(
        &self,
        batch: &[InternalRequest],
    ) -> Result<Vec<(Vec<Scored>, HistoryNote)>> {
        Ok(self.recommend_internal(batch))
    }
}

/// The items each request leaves out: its history when `exclude_seen`, then its own list
/// (unsorted, may repeat; PAD is left out by every scorer).
pub fn excluded_items(request: &InternalRequest) -> Vec<u32> {
    let seen = if request.exclude_seen {
        request.history.as_slice()
    } else {
        &[]
    };
    let mut list = Vec::with_capacity(1 + seen.len() + request.exclude.len());
    list.extend_from_slice(seen);
    list.extend_from_slice(&request.exclude);
    list
}

impl Scorer {
    /// For each row of `hidden` (`[rows, d]`): its best `ks[row]` items, best first, never index 0
    /// (PAD) nor any of `excluded[row]` (unsorted, may repeat).
    pub fn top_k(&self, hidden: &[f32], ks: &[usize], excluded: Vec<Vec<u32>>) -> RankedRows {
        let exclusions: Vec<Exclusions> = excluded
            .into_iter()
            .map(|mut list| {
                list.push(0); // PAD is never an item
                Exclusions::new(list)
            })
            .collect();
        let queries: Vec<RowQuery<'_>> = ks
            .iter()
            .zip(&exclusions)
            .map(|(&k, excluded)| RowQuery { k, excluded })
            .collect();
        fused::top_k(self.kernels, &self.packed, hidden, &queries, self.threads)
    }
}

/// A loaded model with its id map.
pub struct Engine {
    pub manifest: Manifest,
    pub model: Model,
    pub ids: IdMap,
    pub path: Option<PathBuf>,
    pub scorer: Scorer,
}

/// Packs the output layer (at whatever precision it is stored) for the fused kernels; W8A8 engines
/// also carry their calibrated activation scale.
fn packed_output(loaded: &engine_dir::LoadedDir) -> Result<PackedOutput> {
    let out = loaded.model.output();
    let packed = out.weight.pack(out.bias.as_slice());
    let bad = |reason: String| EngineError::EngineDir {
        path: loaded.path.clone(),
        reason,
    };
    match loaded.manifest.output_activation_scale().map_err(bad)? {
        None => Ok(packed),
        Some(_) if !matches!(out.weight, crate::weights::Matrix::I8 { .. }) => {
            Err(bad("w8a8 engine whose output layer is not int8".into()))
        }
        Some(scale) => Ok(packed.with_static_activation_scale(scale)),
    }
}

impl Engine {
    /// Loads and verifies an engine directory; the kernels are the best this CPU runs (or
    /// `RECSYS_FORCE_ISA`), with one scoring thread.
    pub fn load(dir: &Path) -> Result<Engine> {
        Engine::load_limited(dir, engine_dir::DEFAULT_MAX_ENGINE_BYTES)
    }

    /// [`Engine::load`] refusing engines whose files hold more than `max_engine_bytes`.
    pub fn load_limited(dir: &Path, max_engine_bytes: u64) -> Result<Engine> {
        let loaded = engine_dir::load_limited(dir, max_engine_bytes)?;
        let packed = packed_output(&loaded)?;
        Ok(Engine {
            manifest: loaded.manifest,
            model: loaded.model,
            ids: loaded.ids,
            path: Some(loaded.path),
            scorer: Scorer {
                packed,
                kernels: KernelTable::detect(),
                threads: 1,
            },
        })
    }

    /// Bytes the engine holds: the weights file (memory-mapped and read at load, so resident) plus
    /// the packed copies the kernels read (dense layers and output layer).
    pub fn memory_bytes(&self) -> usize {
        let mapped = self
            .manifest
            .files
            .values()
            .map(|f| f.bytes as usize)
            .sum::<usize>();
        mapped
            + self.model.packed_bytes()
            + self.scorer.packed.weight_bytes()
            + 4 * self.scorer.packed.bias.len()
    }

    /// Threads for scoring one batch (at least 1).
    pub fn set_threads(&mut self, threads: usize) {
        self.scorer.threads = threads.max(1);
    }

    /// Replaces the kernel set (tests and benches run every ISA path).
    pub fn set_kernels(&mut self, kernels: &'static KernelTable) {
        self.scorer.kernels = kernels;
        self.model.set_kernels(kernels);
    }

    /// Every item's score for each history, `[B, N+1]`, with the serving kernels and precision
    /// (for evaluation; serving never materialises this).
    pub fn score_all(&self, histories: &[&[u32]]) -> Vec<f32> {
        let (hidden, _) = self.model.encode(histories);
        fused::score_all(self.scorer.kernels, &self.scorer.packed, &hidden)
    }

    pub fn kind(&self) -> ModelKind {
        self.manifest.model.kind()
    }

    pub fn n_items(&self) -> usize {
        self.ids.len()
    }

    /// Maps and validates one request. Errors name the offending input.
    pub fn prepare(
        &self,
        request: &Request<'_>,
        options: &ServeOptions,
    ) -> Result<(InternalRequest, usize)> {
        let k = match request.k {
            None => options.default_k,
            Some(k) if k >= 1 => usize::try_from(k).unwrap_or(usize::MAX),
            Some(k) => {
                return Err(EngineError::InvalidRequest(format!(
                    "K must be at least 1, found {k}"
                )))
            }
        };
        let history = self.ids.map(request.history);
        if history.unknown > 0 && options.unknown_items == UnknownItemPolicy::Error {
            return Err(EngineError::InvalidRequest(format!(
                "ITEM_IDS holds {} id(s) unknown to the model (unknown_item_policy is \"error\")",
                history.unknown
            )));
        }
        let exclude = request
            .exclude
            .map(|e| self.ids.map(e).indices)
            .unwrap_or_default();
        Ok((
            InternalRequest {
                history: history.indices,
                exclude,
                k: k.min(self.n_items()),
                exclude_seen: options.exclude_seen,
            },
            history.unknown,
        ))
    }

    /// Answers a batch. Each request gets its own result; a bad request does not affect the others,
    /// and the good ones run as one batch.
    pub fn recommend(
        &self,
        requests: &[Request<'_>],
        options: &ServeOptions,
    ) -> Vec<Result<Recommendation>> {
        let mut results: Vec<Option<Result<Recommendation>>> = Vec::with_capacity(requests.len());
        let mut batch = Vec::new();
        let mut unknown = Vec::new();
        let mut slots = Vec::new();
        for (i, request) in requests.iter().enumerate() {
            match self.prepare(request, options) {
                Ok((prepared, n_unknown)) => {
                    batch.push(prepared);
                    unknown.push(n_unknown);
                    slots.push(i);
                    results.push(None);
                }
                Err(e) => results.push(Some(Err(e))),
            }
        }
        let answers = self.recommend_internal(&batch);
        for (((slot, (items, note)), n_unknown), _) in
            slots.into_iter().zip(answers).zip(unknown).zip(&batch)
        {
            results[slot] = Some(Ok(Recommendation {
                items,
                unknown_ids: n_unknown,
                truncated: note.truncated,
            }));
        }
        results
            .into_iter()
            .map(|r| r.expect("every slot is filled"))
            .collect()
    }

    /// Top-k over internal indices for a batch of prepared requests, on the CPU kernels.
    pub fn recommend_internal(&self, batch: &[InternalRequest]) -> Vec<(Vec<Scored>, HistoryNote)> {
        if batch.is_empty() {
            return Vec::new();
        }
        let histories: Vec<&[u32]> = batch.iter().map(|r| r.history.as_slice()).collect();
        let (hidden, notes) = self.model.encode(&histories);
        let excluded: Vec<Vec<u32>> = batch.iter().map(excluded_items).collect();
        let ks: Vec<usize> = batch.iter().map(|r| r.k).collect();
        let top = self.scorer.top_k(&hidden, &ks, excluded);
        top.into_iter().zip(notes).collect()
    }

    /// External id of an internal index; `None` outside the catalogue (see [`IdMap::external`]).
    pub fn external_id(&self, index: u32) -> Option<ExternalId> {
        self.ids.external(index)
    }
}

/// Inputs of a conversion.
pub struct ConvertRequest<'a> {
    pub kind: ModelKind,
    pub checkpoint: &'a Path,
    /// A JSON object of hyper-parameters; `None` to use the checkpoint's own (RecBole) config.
    pub config: Option<&'a serde_json::Map<String, serde_json::Value>>,
    pub item_map: &'a Path,
    pub out: &'a Path,
    pub precision: Precision,
    /// With `Precision::Int8`: calibration histories (external ids as text) and method, for W8A8
    /// static activation scales. `None` is weight-only int8.
    pub calibration: Option<(&'a [Vec<String>], CalibrationMethod)>,
}

/// Reads a checkpoint and writes a verified engine directory; returns the loaded engine.
pub fn convert(request: &ConvertRequest<'_>) -> Result<Engine> {
    convert_limited(request, crate::import::DEFAULT_MAX_CHECKPOINT_BYTES)
}

/// [`convert`] refusing checkpoints larger than `max_checkpoint_bytes`.
pub fn convert_limited(request: &ConvertRequest<'_>, max_checkpoint_bytes: u64) -> Result<Engine> {
    let ckpt = Checkpoint::load_limited(request.checkpoint, max_checkpoint_bytes)?;
    let json = match (request.config, &ckpt.embedded_config) {
        (Some(json), _) => json.clone(),
        (None, Some(embedded)) => embedded.clone(),
        (None, None) => {
            return Err(EngineError::Config(format!(
                "{} carries no model config; pass one with --config",
                request.checkpoint.display()
            )))
        }
    };
    let config = ModelConfig::resolve(request.kind, &json, &ckpt)?;
    let mut tensors = Model::engine_tensors(&config, &ckpt)?;
    let ids = IdMap::read_tsv(request.item_map)?;
    if request.calibration.is_some() && request.precision != Precision::Int8 {
        return Err(EngineError::Config(
            "calibration applies to int8 (W8A8) only".into(),
        ));
    }
    let (raw_tensors, quantization, calibration) = quantize(
        &config,
        &mut tensors,
        request.precision,
        &ids,
        request.calibration,
    )?;
    let source = SourceCheckpoint {
        file: request
            .checkpoint
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        format: ckpt.format,
        sha256: ckpt.sha256.clone(),
    };
    engine_dir::write(
        request.out,
        &EngineParts {
            config: &config,
            tensors: &tensors,
            raw_tensors: &raw_tensors,
            precision: request.precision,
            quantization,
            calibration: calibration.map(|c| serde_json::to_value(c).expect("summary serialises")),
            ids: &ids,
            source,
        },
    )?;
    Engine::load(request.out)
}

/// The values entering the output layer for the calibration histories.
fn output_activations(model: &Model, ids: &IdMap, histories: &[Vec<String>]) -> Vec<f32> {
    let mut values = Vec::new();
    for chunk in histories.chunks(256) {
        let mapped: Vec<Vec<u32>> = chunk
            .iter()
            .map(|h| {
                let refs: Vec<&str> = h.iter().map(String::as_str).collect();
                ids.map(ExternalIds::Str(&refs)).indices
            })
            .collect();
        let refs: Vec<&[u32]> = mapped.iter().map(Vec::as_slice).collect();
        values.extend(model.encode(&refs).0);
    }
    values
}

/// Quantized tensors to store, the manifest's description of the scheme, and the calibration.
type Quantized = (
    Vec<(String, RawTensor)>,
    Option<serde_json::Value>,
    Option<CalibrationSummary>,
);

/// Stores every quantizable 2-D weight (embeddings, dense layers, output layer) at `precision`;
/// biases, norms and the position embedding stay fp32. fp32 changes nothing. With a calibration
/// (int8 only), the output layer's activations get a static scale (W8A8), measured on the model as
/// it will be served (quantized weights included).
fn quantize(
    config: &ModelConfig,
    tensors: &mut Vec<(String, crate::tensor::Tensor)>,
    precision: Precision,
    ids: &IdMap,
    calibration: Option<(&[Vec<String>], CalibrationMethod)>,
) -> Result<Quantized> {
    if precision == Precision::Fp32 {
        return Ok((Vec::new(), None, None));
    }
    let targets = Model::quantizable(config);
    let mut raw = Vec::new();
    let mut kept = Vec::new();
    for (name, tensor) in tensors.drain(..) {
        if !targets.contains(&name) {
            kept.push((name, tensor));
            continue;
        }
        let shape = tensor.shape().to_vec();
        let cols = shape[1];
        match precision {
            Precision::Fp32 => unreachable!("returned above"),
            Precision::Fp16 => {
                let bytes = to_f16_bits(tensor.as_slice())
                    .iter()
                    .flat_map(|b| b.to_le_bytes())
                    .collect();
                raw.push((
                    name,
                    RawTensor {
                        dtype: safetensors::Dtype::F16,
                        shape,
                        bytes,
                    },
                ));
            }
            Precision::Int8 => {
                let (q, scales) = quantize_int8_per_row(tensor.as_slice(), cols);
                kept.push((
                    scale_name(&name),
                    crate::tensor::Tensor::from_vec(vec![shape[0]], scales),
                ));
                raw.push((
                    name,
                    RawTensor {
                        dtype: safetensors::Dtype::I8,
                        shape,
                        bytes: q.iter().map(|&v| v as u8).collect(),
                    },
                ));
            }
        }
    }
    *tensors = kept;
    let weights_name = match precision {
        Precision::Fp16 => "fp16",
        _ => "int8",
    };
    let mut output_layer = match precision {
        Precision::Fp16 => {
            serde_json::json!({"weights": "fp16", "compute": "fp32", "rounding": "nearest-even"})
        }
        _ => serde_json::json!({
            "weights": "int8", "mode": "weight-only",
            "compute": "int32 accumulation of int8 weights x int16 activations (each request's own scale)",
            "scheme": "symmetric, one scale per output row: scale = max|w| / 127, q = round(w / scale)",
        }),
    };
    let mut summary = None;
    if let Some((histories, method)) = calibration {
        let weights = crate::weights::Weights {
            f32: tensors.iter().cloned().collect(),
            raw: raw.iter().cloned().collect(),
        };
        let model = Model::from_tensors(config, &weights)?;
        let values = output_activations(&model, ids, histories);
        let s = calibration::summarize(&values, histories.len(), method);
        output_layer = serde_json::json!({
            "weights": "int8", "mode": "w8a8", "compute": "int32 accumulation of int8 x int8",
            "scheme": "weights: symmetric, one scale per output row; activations: one static scale from calibration, clipped to +-127",
            "activation_scale": s.scale,
        });
        summary = Some(s);
    }
    let quantization = serde_json::json!({
        "weights": weights_name,
        "tensors": targets,
        "int8_scales": if precision == Precision::Int8 { "<tensor>.scale, one f32 per row" } else { "" },
        "kept_fp32": "biases, LayerNorm parameters, BERT4Rec's position embedding",
        "dense_layers": if precision == Precision::Int8 { "int8 weights x int16 activations (each request's own scale)" } else { "fp16 weights, fp32 compute" },
        "output_layer": output_layer,
    });
    Ok((raw, Some(quantization), summary))
}
