//! The manifest (`manifest.json`): what an engine directory holds and how, as types. The leaf of
//! the engine format: the writer, the loader and `kernels.bin` build on it, it on none of them.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::calibration::CalibrationSummary;
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::idmap::IdType;
use crate::import::CheckpointFormat;

pub const FORMAT_NAME: &str = "recsys-engine";
pub const FORMAT_VERSION: u32 = 1;
pub const MANIFEST_FILE: &str = "manifest.json";
pub const WEIGHTS_FILE: &str = "weights.safetensors";
pub const ITEM_IDS_FILE: &str = "item_ids.tsv";
/// The external ids of the items a compacted engine keeps retired, one per line.
pub const RETIRED_ITEMS_FILE: &str = "retired_items.tsv";

/// Numeric precision of the engine's output layer (the item-scoring step that dominates serving
/// cost); the manifest's `quantization` field says exactly what is stored how.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    Fp32,
    /// Weights stored as IEEE half, computed in f32.
    Fp16,
    /// Weights stored as bfloat16; each layer multiplies them by its input rounded to bfloat16
    /// and adds the products in f32 (`vdpbf16ps` where the CPU has AVX512-BF16, the same bits
    /// widened to f32 elsewhere).
    Bf16,
    /// Weights stored as symmetric int8 with one f32 scale per item, computed in f32 (weight-only).
    Int8,
}

/// How the output layer's top k is found. `Int8`: screened from an int8 copy of the output layer
/// and the survivors rescored from the reference weights, so the answers are the unscreened
/// engine's bit for bit at the cost of reading int8 weights (`kernels::screen`); fp32 and fp16
/// engines only (the screen's bounds assume f32 activations, which bf16 layers round). The
/// screening table is derived from the stored weights at load.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Screen {
    #[default]
    None,
    Int8,
}

impl Screen {
    /// The name options and manifests use.
    pub fn as_str(self) -> &'static str {
        match self {
            Screen::None => "none",
            Screen::Int8 => "int8",
        }
    }
}

impl std::fmt::Display for Screen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Precision {
    /// The name options and manifests use.
    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
            Precision::Int8 => "int8",
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Screen {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Screen::None),
            "int8" => Ok(Screen::Int8),
            _ => Err(format!("unknown screen {s:?} (expected none or int8)")),
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fp32" => Ok(Precision::Fp32),
            "fp16" => Ok(Precision::Fp16),
            "bf16" => Ok(Precision::Bf16),
            "int8" => Ok(Precision::Int8),
            _ => Err(format!(
                "unknown precision {s:?} (expected fp32, fp16, bf16 or int8)"
            )),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SourceCheckpoint {
    /// File name of the checkpoint the engine was converted from.
    pub file: String,
    pub format: CheckpointFormat,
    pub sha256: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    pub bytes: u64,
    pub sha256: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub format_version: u32,
    pub model: ModelConfig,
    pub precision: Precision,
    /// Quantization scheme and scales; `null` at fp32.
    pub quantization: Option<Quantization>,
    /// Calibration summary; `null` when no calibration was run.
    pub calibration: Option<CalibrationRecord>,
    /// The top-k screen (absent in engines written before it existed: none).
    #[serde(default)]
    pub screen: Screen,
    pub id_type: IdType,
    pub source: SourceCheckpoint,
    pub files: BTreeMap<String, FileEntry>,
    /// Where `kernels.bin` keeps the output layer (and screen) laid out for the kernels; absent in
    /// engines written before it existed, which pack at load.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_layout: Option<KernelLayout>,
    /// The item attributes the engine was converted with (`item_sets.bin`); absent without.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub item_attributes: Option<ItemAttributesRecord>,
    /// The interactions the popularity list was counted from (`item_popularity.bin`); absent
    /// without.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub popularity: Option<PopularityRecord>,
    /// The live catalogue folded into this engine (`recsys catalogue compact`); absent in an
    /// engine converted from a checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub catalogue: Option<FoldedCatalogue>,
    pub created_by: String,
    pub created_at: String,
}

/// The catalogue delta a compacted engine was built from: the engine it was published for and its
/// version. A server of this engine that still reads that object (the fleet's object until the
/// first delta for this engine is published) knows its rows are already in the weights.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FoldedCatalogue {
    /// The SHA-256 of the weights of the engine the folded delta was published for.
    pub from_engine_sha256: String,
    /// The folded delta's version.
    pub version: u64,
    /// Items of that engine.
    pub base_items: usize,
    pub added: usize,
    pub replaced: usize,
    /// Items kept and never returned (listed in [`RETIRED_ITEMS_FILE`]): those the delta retired,
    /// with those the engine itself kept retired.
    pub retired: usize,
}

/// What `recsys convert --item-attributes` stored (`manifest.item_attributes`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ItemAttributesRecord {
    /// Attribute columns; each value of each is a set named `column=value`.
    pub columns: Vec<String>,
    /// Sets stored.
    pub sets: usize,
    /// Table rows whose item is in the catalogue.
    pub items: usize,
    /// Table rows whose id the catalogue does not know (skipped).
    pub unknown_items: usize,
}

/// What `recsys convert --interactions` counted (`manifest.popularity`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PopularityRecord {
    /// The interaction log's item column.
    pub column: String,
    /// Interactions counted.
    pub interactions: u64,
    /// Interactions naming items the catalogue does not hold (skipped).
    pub unknown_items: u64,
    /// Items with at least one interaction (the most an empty history's answer can hold).
    pub items: usize,
}

/// What a reduced precision stores how (`manifest.quantization`; absent at fp32). The prose
/// fields say it for people reading the manifest; the engine reads the typed ones.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Quantization {
    /// `fp16` or `int8`.
    pub weights: String,
    /// The 2-D weights stored at that precision.
    pub tensors: Vec<String>,
    /// Where int8 weights' row scales are (empty for fp16).
    #[serde(default)]
    pub int8_scales: String,
    #[serde(default)]
    pub kept_fp32: String,
    /// How the dense layers compute.
    #[serde(default)]
    pub dense_layers: String,
    pub output_layer: OutputLayerQuantization,
    /// W8A8: every dense layer's calibrated static input scale, by the layer's weight prefix
    /// (absent in W8A8 engines converted before dense layers were calibrated).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dense_activation_scales: Option<BTreeMap<String, f32>>,
    /// W8A8: whether the dense layers run at those scales or at each request's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dense_activations: Option<DenseActivations>,
}

/// How the output layer (the item scores) is quantized.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OutputLayerQuantization {
    /// `fp16` or `int8`.
    pub weights: String,
    /// int8 only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<OutputLayerMode>,
    pub compute: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rounding: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheme: Option<String>,
    /// W8A8: the calibrated static scale of the output layer's input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation_scale: Option<f32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OutputLayerMode {
    /// int8 weights against each request's own int16 activation scale.
    WeightOnly,
    /// int8 weights against the calibrated static int8 activation scale.
    W8a8,
}

/// Where the dense layers' input scales come from in a W8A8 engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DenseActivations {
    /// Each layer's calibrated static scale (all-layer W8A8).
    Static,
    /// Each request's own int16 scale.
    Dynamic,
}

/// What calibration saw and chose (`manifest.calibration`): the output layer's input, and each
/// dense layer's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CalibrationRecord {
    #[serde(flatten)]
    pub output_layer: CalibrationSummary,
    #[serde(default)]
    pub dense_layers: BTreeMap<String, CalibrationSummary>,
}

impl Manifest {
    /// The output layer's calibrated static activation scale of a W8A8 engine; `None` for every
    /// other scheme. A W8A8 manifest without a finite, non-negative scale is malformed.
    pub fn output_activation_scale(&self) -> std::result::Result<Option<f32>, String> {
        let Some(layer) = self.quantization.as_ref().map(|q| &q.output_layer) else {
            return Ok(None);
        };
        if layer.mode != Some(OutputLayerMode::W8a8) {
            return Ok(None);
        }
        layer
            .activation_scale
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(Some)
            .ok_or_else(|| {
                "w8a8 engine without a valid output_layer.activation_scale in the manifest".into()
            })
    }

    /// Whether the dense layers run at their calibrated static activation scales (all-layer
    /// W8A8, `quantization.dense_activations: "static"`) rather than each request's own.
    pub fn static_dense_activations(&self) -> bool {
        self.quantization.as_ref().and_then(|q| q.dense_activations)
            == Some(DenseActivations::Static)
    }

    /// The calibrated static activation scale of every dense layer's input of a W8A8 engine,
    /// keyed by the layer's weight prefix (`quantization.dense_activation_scales`); empty for
    /// other schemes and for W8A8 engines converted before dense layers were calibrated.
    pub fn dense_activation_scales(&self) -> std::result::Result<BTreeMap<String, f32>, String> {
        let Some(scales) = self
            .quantization
            .as_ref()
            .and_then(|q| q.dense_activation_scales.as_ref())
        else {
            return Ok(BTreeMap::new());
        };
        match scales.iter().find(|(_, s)| !(s.is_finite() && **s >= 0.0)) {
            Some((layer, _)) => Err(format!(
                "quantization.dense_activation_scales.{layer} must be a finite, non-negative \
                 number"
            )),
            None => Ok(scales.clone()),
        }
    }
}

/// Where each section of `kernels.bin` starts and how long it is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Section {
    pub offset: u64,
    pub bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelLayout {
    pub layout_version: u32,
    pub sections: BTreeMap<String, Section>,
}

/// Parses and checks a manifest's text (format name and version first, so an engine from a newer
/// recsys gets a message saying so rather than a schema error).
pub fn parse_manifest(dir: &Path, text: &str) -> Result<Manifest> {
    let bad = |reason: String| EngineError::EngineDir {
        path: dir.to_path_buf(),
        reason,
    };
    let header: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| bad(format!("{MANIFEST_FILE} is not valid JSON: {e}")))?;
    if header.get("format").and_then(|v| v.as_str()) != Some(FORMAT_NAME) {
        return Err(bad(format!(
            "{MANIFEST_FILE} is not a {FORMAT_NAME} manifest"
        )));
    }
    match header.get("format_version").and_then(|v| v.as_u64()) {
        Some(v) if v == FORMAT_VERSION as u64 => {}
        Some(v) => {
            return Err(bad(format!(
                "format version {v} is not supported by this recsys (it reads version {FORMAT_VERSION}); \
                 re-convert the model with this version"
            )))
        }
        None => return Err(bad(format!("{MANIFEST_FILE} has no format_version"))),
    }
    let manifest: Manifest = serde_json::from_value(header)
        .map_err(|e| bad(format!("{MANIFEST_FILE} is malformed: {e}")))?;

    Ok(manifest)
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    rfc3339_utc(secs)
}

/// `secs` since the Unix epoch as an RFC 3339 UTC time, to the second.
pub fn rfc3339_utc(secs: i64) -> String {
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}
