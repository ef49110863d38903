//! Conversion: a checkpoint and its hyper-parameters into a verified engine directory, quantized and
//! calibrated at the precision asked for.

use std::path::Path;

use crate::calibration::{self, CalibrationMethod, CalibrationSummary};
use crate::config::{ModelConfig, ModelKind};
use crate::engine::Engine;
use crate::engine_dir::{self, EngineParts, Precision, RawTensor, Screen, SourceCheckpoint};
use crate::error::{EngineError, Result};
use crate::idmap::{ExternalIds, IdMap};
use crate::import::Checkpoint;
use crate::kernels::packed::{quantize_int8_per_row, to_f16_bits};
use crate::models::Model;
use crate::weights::scale_name;

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
    /// The top-k screen to record (fp32 and fp16 engines).
    pub screen: Screen,
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
    if request.screen == Screen::Int8 && request.precision == Precision::Int8 {
        return Err(EngineError::Config(
            "--screen int8 screens fp32 and fp16 engines (their answers, at int8 cost); an int8 \
             engine already scores from int8 weights"
                .into(),
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
            screen: request.screen,
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
