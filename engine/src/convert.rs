//! Conversion: a checkpoint and its hyper-parameters into a verified engine directory, quantized and
//! calibrated at the precision asked for.

use std::collections::BTreeMap;
use std::path::Path;

use crate::calibration::{self, CalibrationMethod, CalibrationSummary};
use crate::config::{ModelConfig, ModelKind};
pub use crate::convert_options::W8a8Layers;
use crate::convert_options::{ConvertOptions, Int8Mode, Spelling};
use crate::engine::Engine;
use crate::engine_dir::{
    self, CalibrationRecord, DenseActivations, EngineParts, KernelParts, OutputLayerMode,
    OutputLayerQuantization, Precision, Quantization, RawTensor, Screen, SourceCheckpoint,
};
use crate::error::{EngineError, Result};
use crate::idmap::{ExternalIds, IdMap, ItemMapSource};
use crate::import::Checkpoint;
use crate::item_sets::{AttributeTable, ItemSets};
use crate::kernels::packed::{quantize_int8_per_row, to_bf16_bits, to_f16_bits};
use crate::models::Model;
use crate::popularity::{Popularity, PopularityReport};
use crate::weights::scale_name;

/// Inputs of a conversion.
pub struct ConvertRequest<'a> {
    /// The architecture; `None` to take it from a RecBole checkpoint's own config (its `model`).
    pub kind: Option<ModelKind>,
    pub checkpoint: &'a Path,
    /// A JSON object of hyper-parameters; `None` to use the checkpoint's own (RecBole) config.
    pub config: Option<&'a serde_json::Map<String, serde_json::Value>>,
    /// The item map: a TSV, or the dataset RecBole saved.
    pub item_map: ItemMapSource<'a>,
    pub out: &'a Path,
    pub precision: Precision,
    /// With `Precision::Int8`: calibration histories (external ids as text) and method, for W8A8
    /// static activation scales. `None` is weight-only int8.
    pub calibration: Option<(&'a [Vec<String>], CalibrationMethod)>,
    /// The calibration histories' event times, one per history, for a model that reads time
    /// (HSTU; required there with a calibration, ignored by the others).
    pub calibration_times: Option<&'a [crate::metrics::CaseTimes]>,
    /// The top-k screen to record (fp32 and fp16 engines).
    pub screen: Screen,
    /// With a calibration: which layers the engine runs at static int8 activation scales. Every
    /// dense layer's scale is calibrated and recorded either way (ONNX exports use them).
    pub w8a8_layers: W8a8Layers,
    /// What the engine keeps about the catalogue besides the model: item attribute sets.
    pub catalogue: CatalogueInputs<'a>,
}

/// Catalogue data stored with an engine, each optional.
#[derive(Clone, Copy, Debug, Default)]
pub struct CatalogueInputs<'a> {
    /// Item attributes: every (column, value) becomes a named item set requests can filter by
    /// ([`crate::item_sets`]).
    pub item_attributes: Option<&'a AttributeTable>,
    /// Interaction counts per item (and what counting found): the answer for an empty history
    /// ([`crate::popularity`]).
    pub popularity: Option<&'a (Popularity, PopularityReport)>,
}

impl ConvertRequest<'_> {
    /// The request as the options a user gives, so that it is checked by the same rules
    /// ([`ConvertOptions::plan`]) as every front end's.
    fn options(&self) -> ConvertOptions {
        let int8_mode = match (self.calibration.is_some(), self.w8a8_layers) {
            (_, W8a8Layers::All) => Int8Mode::W8a8All,
            (true, W8a8Layers::Output) => Int8Mode::W8a8,
            (false, W8a8Layers::Output) => Int8Mode::WeightOnly,
        };
        ConvertOptions {
            precision: self.precision,
            int8_mode,
            screen: self.screen,
            calibration: self.calibration.is_some(),
            ..Default::default()
        }
    }
}

/// The architecture to convert: the one asked for, checked against a RecBole checkpoint's own
/// `model` when it names one (and against an HSTU's tensor names), or, when none is asked for,
/// that `model` (RecBole's names: `BERT4Rec`, `MultiVAE`, `SASRec`, `GRU4Rec`) or HSTU.
fn model_kind(asked: Option<ModelKind>, ckpt: &Checkpoint, path: &Path) -> Result<ModelKind> {
    let recorded = ckpt
        .embedded_config
        .as_ref()
        .and_then(|c| c.get("model"))
        .and_then(|m| m.as_str());
    let of_recbole = ModelKind::of_recbole_class;
    let holds_hstu = ckpt.shape(crate::models::hstu::KEY_OF_HSTU).is_some();
    match (asked, recorded) {
        (Some(kind), Some(name)) => match of_recbole(name) {
            Some(recorded_kind) if recorded_kind != kind => Err(EngineError::Config(format!(
                "{} is a RecBole {name} checkpoint (its config's model), but the conversion asks \
                 for {kind}: pass --kind {recorded_kind} or leave --kind out",
                path.display()
            ))),
            _ => Ok(kind),
        },
        // The official HSTU's state dict names say what it is.
        (Some(kind), None) if kind != ModelKind::Hstu && holds_hstu => {
            Err(EngineError::Config(format!(
                "{} holds an HSTU (its tensors are named {}...), but the conversion asks for \
                 {kind}: pass --kind hstu or leave --kind out",
                path.display(),
                crate::models::hstu::KEY_OF_HSTU
            )))
        }
        (Some(kind), None) => Ok(kind),
        (None, None) if holds_hstu => Ok(ModelKind::Hstu),
        (None, Some(name)) => of_recbole(name).ok_or_else(|| {
            EngineError::Config(format!(
                "{} is a RecBole {name} checkpoint; recsys converts BERT4Rec, \
                 SASRec, GRU4Rec and MultiVAE (Mult-VAE, VAE-CF)",
                path.display()
            ))
        }),
        (None, None) => Err(EngineError::Config(format!(
            "{} does not say which model it holds (only a RecBole checkpoint's \
             config and an HSTU's tensor names do): pass --kind bert4rec, vaecf, sasrec, gru4rec \
             or hstu",
            path.display()
        ))),
    }
}

/// Reads a checkpoint and writes a verified engine directory; returns the loaded engine.
pub fn convert(request: &ConvertRequest<'_>) -> Result<Engine> {
    convert_limited(request, crate::import::DEFAULT_MAX_CHECKPOINT_BYTES)
}

/// [`convert`] refusing checkpoints larger than `max_checkpoint_bytes`.
pub fn convert_limited(request: &ConvertRequest<'_>, max_checkpoint_bytes: u64) -> Result<Engine> {
    let ckpt = Checkpoint::load_limited(request.checkpoint, max_checkpoint_bytes)?;
    let kind = model_kind(request.kind, &ckpt, request.checkpoint)?;
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
    let config = ModelConfig::resolve(kind, &json, &ckpt)?;
    let calibration_times = match (request.calibration, request.calibration_times) {
        (Some(_), None) if kind.reads_timestamps() => {
            return Err(EngineError::Config(format!(
                "W8A8 calibration of {kind}: the model reads time, so each calibration history \
                 needs its \"timestamps\" (unix seconds, one per item id; \"query_timestamp\" \
                 optional, else the last event's)"
            )))
        }
        (Some((histories, _)), Some(times)) if kind.reads_timestamps() => {
            if times.len() != histories.len() {
                return Err(EngineError::Config(format!(
                    "{} calibration histories but {} with times: give each its timestamps",
                    histories.len(),
                    times.len()
                )));
            }
            Some(times)
        }
        _ => None,
    };
    let mut tensors = Model::engine_tensors(&config, &ckpt)?;
    let ids = request.item_map.read(max_checkpoint_bytes)?;
    request
        .options()
        .plan(Spelling::Keywords)
        .map_err(EngineError::Config)?;
    let (raw_tensors, quantization, calibration) = quantize(
        &config,
        &mut tensors,
        request.precision,
        &ids,
        request.calibration,
        calibration_times,
        request.w8a8_layers,
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
    // The output layer (and screen) laid out for the kernels, from the model in memory: it goes
    // into `kernels.bin` in the same atomic write as the rest, and the engine is loaded once.
    let model = Model::from_tensors(
        &config,
        &crate::weights::Weights {
            f32: tensors.iter().cloned().collect(),
            raw: raw_tensors.iter().cloned().collect(),
        },
    )?;
    let out = model.output();
    let packed = out.weight.pack(out.bias.as_slice());
    let screen = (request.screen == Screen::Int8).then(|| crate::engine::screen_of(out));
    let item_sets = match request.catalogue.item_attributes {
        None => None,
        Some(table) => Some(ItemSets::from_table(table, &ids).map_err(EngineError::Config)?),
    };
    engine_dir::write(
        request.out,
        &EngineParts {
            config: &config,
            tensors: &tensors,
            raw_tensors: &raw_tensors,
            precision: request.precision,
            quantization,
            calibration,
            screen: request.screen,
            ids: &ids,
            source,
            kernels: Some(KernelParts {
                packed: &packed,
                screen: screen.as_ref(),
            }),
            item_sets: item_sets.as_ref(),
            popularity: request.catalogue.popularity,
            folded: None,
        },
    )?;
    drop((model, packed, screen));
    Engine::load(request.out)
}

/// Every value entering each dense layer (by name) and the output layer for the calibration
/// histories (with their event times, for a model that reads them: an unknown id is dropped with
/// its time, as a request's is).
fn calibration_activations(
    model: &Model,
    ids: &IdMap,
    histories: &[Vec<String>],
    times: Option<&[crate::metrics::CaseTimes]>,
) -> (BTreeMap<String, Vec<f32>>, Vec<f32>) {
    let mut dense: BTreeMap<String, Vec<f32>> = BTreeMap::new();
    let mut output = Vec::new();
    for (c, chunk) in histories.chunks(256).enumerate() {
        // (indices, their event times, the query time) per history; a timed history with no
        // known item is left out (a request with none is not the model's to answer).
        let mut mapped: Vec<(Vec<u32>, Vec<i64>, i64)> = Vec::with_capacity(chunk.len());
        for (i, h) in chunk.iter().enumerate() {
            let refs: Vec<&str> = h.iter().map(String::as_str).collect();
            let (known, positions) = ids.map_with_positions(ExternalIds::Str(&refs));
            match times {
                Some(_) if known.indices.is_empty() => {}
                Some(times) => {
                    let case = &times[c * 256 + i];
                    let events = positions.iter().map(|&p| case.events[p]).collect();
                    mapped.push((known.indices, events, case.target));
                }
                None => mapped.push((known.indices, Vec::new(), 0)),
            }
        }
        let refs: Vec<&[u32]> = mapped.iter().map(|(h, _, _)| h.as_slice()).collect();
        let when: Vec<crate::models::EventTimes<'_>> = if times.is_some() {
            mapped
                .iter()
                .map(|(_, events, query)| crate::models::EventTimes {
                    events,
                    query: *query,
                })
                .collect()
        } else {
            Vec::new()
        };
        let mut observe = |layer: &str, x: &[f32]| {
            dense
                .entry(layer.to_string())
                .or_default()
                .extend_from_slice(x);
        };
        output.extend(model.encode_observed(&refs, &when, &mut observe).0);
    }
    (dense, output)
}

/// What a bf16 engine's layers compute, as its manifest says.
const BF16_COMPUTE: &str = "bf16 weights x activations rounded to bf16 (nearest-even), products \
                            added in f32 odd feature then even per pair (vdpbf16ps)";

/// Quantized tensors to store, the manifest's description of the scheme, and the calibration.
type Quantized = (
    Vec<(String, RawTensor)>,
    Option<Quantization>,
    Option<CalibrationRecord>,
);

/// Stores every quantizable 2-D weight (embeddings, dense layers, output layer) at `precision`;
/// biases, norms and the position embedding stay fp32. fp32 changes nothing. With a calibration
/// (int8 only), the output layer's activations get a static scale (W8A8), measured on the model as
/// it will be served (quantized weights included); so does every dense layer's input, recorded for
/// exports and applied by the engine with [`W8a8Layers::All`].
fn quantize(
    config: &ModelConfig,
    tensors: &mut Vec<(String, crate::tensor::Tensor)>,
    precision: Precision,
    ids: &IdMap,
    calibration: Option<(&[Vec<String>], CalibrationMethod)>,
    calibration_times: Option<&[crate::metrics::CaseTimes]>,
    w8a8_layers: W8a8Layers,
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
            Precision::Fp16 | Precision::Bf16 => {
                let (bits, dtype) = if precision == Precision::Fp16 {
                    (to_f16_bits(tensor.as_slice()), safetensors::Dtype::F16)
                } else {
                    (to_bf16_bits(tensor.as_slice()), safetensors::Dtype::BF16)
                };
                let bytes = bits
                    .iter()
                    .flat_map(|b| b.to_le_bytes())
                    .collect::<Vec<u8>>()
                    .into();
                raw.push((
                    name,
                    RawTensor {
                        dtype,
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
                        bytes: q.iter().map(|&v| v as u8).collect::<Vec<u8>>().into(),
                    },
                ));
            }
        }
    }
    *tensors = kept;
    let weights_name = match precision {
        Precision::Fp16 => "fp16",
        Precision::Bf16 => "bf16",
        _ => "int8",
    };
    let mut output_layer = match precision {
        Precision::Fp16 => OutputLayerQuantization {
            weights: "fp16".into(),
            mode: None,
            compute: "fp32".into(),
            rounding: Some("nearest-even".into()),
            scheme: None,
            activation_scale: None,
        },
        Precision::Bf16 => OutputLayerQuantization {
            weights: "bf16".into(),
            mode: None,
            compute: BF16_COMPUTE.into(),
            rounding: Some("nearest-even".into()),
            scheme: None,
            activation_scale: None,
        },
        _ => OutputLayerQuantization {
            weights: "int8".into(),
            mode: Some(OutputLayerMode::WeightOnly),
            compute: "int32 accumulation of int8 weights x int16 activations (each request's own \
                      scale)"
                .into(),
            rounding: None,
            scheme: Some(
                "symmetric, one scale per output row: scale = max|w| / 127, q = round(w / scale)"
                    .into(),
            ),
            activation_scale: None,
        },
    };
    let mut summary = None;
    let mut dense_scales = None;
    if let Some((histories, method)) = calibration {
        let weights = crate::weights::Weights {
            f32: tensors.iter().cloned().collect(),
            raw: raw.iter().cloned().collect(),
        };
        let model = Model::from_tensors(config, &weights)?;
        let (dense, values) = calibration_activations(&model, ids, histories, calibration_times);
        let s = calibration::summarize(&values, histories.len(), method);
        output_layer = OutputLayerQuantization {
            weights: "int8".into(),
            mode: Some(OutputLayerMode::W8a8),
            compute: "int32 accumulation of int8 x int8".into(),
            rounding: None,
            scheme: Some(
                "weights: symmetric, one scale per output row; activations: one static scale \
                 from calibration, saturating to [-128, 127] (QuantizeLinear)"
                    .into(),
            ),
            activation_scale: Some(s.scale),
        };
        let layers: BTreeMap<String, CalibrationSummary> = dense
            .iter()
            .map(|(name, v)| {
                (
                    name.clone(),
                    calibration::summarize(v, histories.len(), method),
                )
            })
            .collect();
        dense_scales = Some(
            layers
                .iter()
                .map(|(name, l)| (name.clone(), l.scale))
                .collect::<BTreeMap<_, _>>(),
        );
        summary = Some(CalibrationRecord {
            output_layer: s,
            dense_layers: layers,
        });
    }
    let static_dense = dense_scales.is_some() && w8a8_layers == W8a8Layers::All;
    let quantization = Quantization {
        weights: weights_name.into(),
        tensors: targets,
        int8_scales: if precision == Precision::Int8 {
            "<tensor>.scale, one f32 per row".into()
        } else {
            String::new()
        },
        kept_fp32: "biases, LayerNorm parameters, BERT4Rec's position embedding".into(),
        dense_layers: match (precision, static_dense) {
            (Precision::Int8, true) => {
                "int8 weights x int8 activations (each layer's calibrated \
                                       static scale, saturating to [-128, 127])"
            }
            (Precision::Int8, false) => {
                "int8 weights x int16 activations (each request's own scale)"
            }
            (Precision::Bf16, _) => BF16_COMPUTE,
            _ => "fp16 weights, fp32 compute",
        }
        .into(),
        output_layer,
        dense_activations: dense_scales.as_ref().map(|_| {
            if static_dense {
                DenseActivations::Static
            } else {
                DenseActivations::Dynamic
            }
        }),
        dense_activation_scales: dense_scales,
    };
    Ok((raw, Some(quantization), summary))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recbole_checkpoint_of(model: &str) -> Checkpoint {
        let mut config = serde_json::Map::new();
        config.insert("model".into(), model.into());
        Checkpoint {
            format: crate::import::CheckpointFormat::Recbole,
            tensors: Default::default(),
            embedded_config: Some(config),
            sha256: String::new(),
        }
    }

    #[test]
    fn a_recbole_model_recsys_does_not_run_is_named_with_the_ones_it_does() {
        let path = Path::new("lightgcn.pth");
        let err = model_kind(None, &recbole_checkpoint_of("LightGCN"), path)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("RecBole LightGCN checkpoint")
                && err.contains("BERT4Rec, SASRec, GRU4Rec and MultiVAE"),
            "{err}"
        );
        for (kind, name) in ModelKind::RECBOLE
            .into_iter()
            .zip(["BERT4Rec", "MultiVAE", "SASRec", "GRU4Rec"])
        {
            let ckpt = recbole_checkpoint_of(name);
            assert_eq!(model_kind(None, &ckpt, path).unwrap(), kind);
            assert_eq!(model_kind(Some(kind), &ckpt, path).unwrap(), kind);
        }
    }
}
