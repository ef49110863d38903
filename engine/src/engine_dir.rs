//! The engine directory: what `recsys convert` writes and the server loads.
//!
//! ```text
//! manifest.json          format version, model config, precision, source checkpoint, per-file sha256
//! weights.safetensors    the model's tensors (f32), memory-mapped at load
//! item_ids.tsv           internal index -> external id
//! ```
//! Loading checks the format version, every file's size and sha256, and the tensors' shapes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::idmap::{IdMap, IdType};
use crate::import::CheckpointFormat;
use crate::models::Model;
use crate::tensor::TensorMap;
use crate::tensor::{Storage, Tensor};
pub use crate::weights::RawTensor;

pub const FORMAT_NAME: &str = "recsys-engine";
pub const FORMAT_VERSION: u32 = 1;
pub const MANIFEST_FILE: &str = "manifest.json";
pub const WEIGHTS_FILE: &str = "weights.safetensors";
pub const ITEM_IDS_FILE: &str = "item_ids.tsv";

/// Numeric precision of the engine's output layer (the item-scoring step that dominates serving
/// cost); the manifest's `quantization` field says exactly what is stored how.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    Fp32,
    /// Weights stored as IEEE half, computed in f32.
    Fp16,
    /// Weights stored as symmetric int8 with one f32 scale per item, computed in f32 (weight-only).
    Int8,
}

/// How the output layer's top k is found. `Int8`: screened from an int8 copy of the output layer
/// and the survivors rescored from the reference weights, so the answers are the unscreened
/// engine's bit for bit at the cost of reading int8 weights (`kernels::screen`); fp32 and fp16
/// engines only. The screening table is derived from the stored weights at load.
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
            "int8" => Ok(Precision::Int8),
            _ => Err(format!(
                "unknown precision {s:?} (expected fp32, fp16 or int8)"
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
    pub quantization: Option<serde_json::Value>,
    /// Calibration summary; `null` when no calibration was run.
    pub calibration: Option<serde_json::Value>,
    /// The top-k screen (absent in engines written before it existed: none).
    #[serde(default)]
    pub screen: Screen,
    pub id_type: IdType,
    pub source: SourceCheckpoint,
    pub files: BTreeMap<String, FileEntry>,
    /// Where `kernels.bin` keeps the output layer (and screen) laid out for the kernels; absent in
    /// engines written before it existed, which pack at load.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_layout: Option<crate::kernel_file::KernelLayout>,
    pub created_by: String,
    pub created_at: String,
}

impl Manifest {
    /// The output layer's calibrated static activation scale of a W8A8 engine; `None` for every
    /// other scheme. A W8A8 manifest without a finite, non-negative scale is malformed.
    pub fn output_activation_scale(&self) -> std::result::Result<Option<f32>, String> {
        let layer = self.quantization.as_ref().map(|q| &q["output_layer"]);
        if layer.and_then(|l| l["mode"].as_str()) != Some("w8a8") {
            return Ok(None);
        }
        layer
            .and_then(|l| l["activation_scale"].as_f64())
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(|s| Some(s as f32))
            .ok_or_else(|| {
                "w8a8 engine without a valid output_layer.activation_scale in the manifest".into()
            })
    }
}

impl Manifest {
    /// Whether the dense layers run at their calibrated static activation scales (all-layer
    /// W8A8, `quantization.dense_activations: "static"`) rather than each request's own.
    pub fn static_dense_activations(&self) -> bool {
        self.quantization
            .as_ref()
            .and_then(|q| q.get("dense_activations"))
            .and_then(|v| v.as_str())
            == Some("static")
    }

    /// The calibrated static activation scale of every dense layer's input of a W8A8 engine,
    /// keyed by the layer's weight prefix (`quantization.dense_activation_scales`); empty for
    /// other schemes and for W8A8 engines converted before dense layers were calibrated.
    pub fn dense_activation_scales(&self) -> std::result::Result<BTreeMap<String, f32>, String> {
        let Some(scales) = self
            .quantization
            .as_ref()
            .and_then(|q| q.get("dense_activation_scales"))
        else {
            return Ok(BTreeMap::new());
        };
        let object = scales
            .as_object()
            .ok_or("quantization.dense_activation_scales must be an object")?;
        object
            .iter()
            .map(|(layer, value)| {
                value
                    .as_f64()
                    .filter(|s| s.is_finite() && *s >= 0.0)
                    .map(|s| (layer.clone(), s as f32))
                    .ok_or_else(|| {
                        format!(
                            "quantization.dense_activation_scales.{layer} must be a finite, \
                             non-negative number"
                        )
                    })
            })
            .collect()
    }
}

/// Everything needed to write an engine directory.
pub struct EngineParts<'a> {
    pub config: &'a ModelConfig,
    pub tensors: &'a [(String, Tensor)],
    /// Quantized tensors, stored in their own dtype.
    pub raw_tensors: &'a [(String, RawTensor)],
    pub precision: Precision,
    pub quantization: Option<serde_json::Value>,
    pub calibration: Option<serde_json::Value>,
    pub screen: Screen,
    pub ids: &'a IdMap,
    pub source: SourceCheckpoint,
}

/// Writes an engine directory atomically: files go to a temporary sibling directory that is renamed
/// into place, so a crash never leaves a half-written engine under the final name.
pub fn write(out: &Path, parts: &EngineParts<'_>) -> Result<Manifest> {
    if parts.ids.len() != parts.config.n_items() {
        return Err(EngineError::Config(format!(
            "the item id map has {} items but the model has {}",
            parts.ids.len(),
            parts.config.n_items()
        )));
    }
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent)
        .map_err(|e| EngineError::io(format!("cannot create {}", parent.display()), e))?;
    let name = out
        .file_name()
        .ok_or_else(|| EngineError::Config(format!("{} is not a directory name", out.display())))?;
    let tmp = parent.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)
            .map_err(|e| EngineError::io(format!("cannot clear {}", tmp.display()), e))?;
    }
    std::fs::create_dir(&tmp)
        .map_err(|e| EngineError::io(format!("cannot create {}", tmp.display()), e))?;

    let result = write_files(&tmp, parts).and_then(|manifest| {
        if out.exists() {
            std::fs::remove_dir_all(out)
                .map_err(|e| EngineError::io(format!("cannot replace {}", out.display()), e))?;
        }
        std::fs::rename(&tmp, out).map_err(|e| {
            EngineError::io(format!("cannot move the engine into {}", out.display()), e)
        })?;
        Ok(manifest)
    });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

fn write_files(dir: &Path, parts: &EngineParts<'_>) -> Result<Manifest> {
    let weights_path = dir.join(WEIGHTS_FILE);
    let views: Vec<(&str, safetensors::tensor::TensorView<'_>)> = parts
        .tensors
        .iter()
        .map(|(name, t)| {
            let view = safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                t.shape().to_vec(),
                bytemuck::cast_slice(t.as_slice()),
            )
            .expect("a tensor's bytes always match its shape");
            (name.as_str(), view)
        })
        .chain(parts.raw_tensors.iter().map(|(name, t)| {
            let view = safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.bytes)
                .expect("quantized tensor bytes match their shape");
            (name.as_str(), view)
        }))
        .collect();
    safetensors::serialize_to_file(views, &None, &weights_path).map_err(|e| {
        EngineError::Config(format!("cannot write {}: {e}", weights_path.display()))
    })?;
    let ids_path = dir.join(ITEM_IDS_FILE);
    std::fs::write(&ids_path, parts.ids.to_tsv())
        .map_err(|e| EngineError::io(format!("cannot write {}", ids_path.display()), e))?;

    let mut files = BTreeMap::new();
    for file in [WEIGHTS_FILE, ITEM_IDS_FILE] {
        let bytes = std::fs::read(dir.join(file))
            .map_err(|e| EngineError::io(format!("cannot read back {file}"), e))?;
        files.insert(
            file.to_string(),
            FileEntry {
                bytes: bytes.len() as u64,
                sha256: hex::encode(Sha256::digest(&bytes)),
            },
        );
    }
    let manifest = Manifest {
        format: FORMAT_NAME.into(),
        format_version: FORMAT_VERSION,
        model: parts.config.clone(),
        precision: parts.precision,
        quantization: parts.quantization.clone(),
        calibration: parts.calibration.clone(),
        screen: parts.screen,
        id_type: parts.ids.id_type(),
        source: parts.source.clone(),
        files,
        kernel_layout: None,
        created_by: format!("recsys {}", env!("CARGO_PKG_VERSION")),
        created_at: utc_now_rfc3339(),
    };
    let json = serde_json::to_string_pretty(&manifest).expect("manifest serialises");
    std::fs::write(dir.join(MANIFEST_FILE), json + "\n")
        .map_err(|e| EngineError::io("cannot write the manifest", e))?;
    Ok(manifest)
}

/// Adds `kernels.bin` (the output layer and screen as the kernels read them) to the engine in
/// `dir` and records it in the manifest, replaced in one rename: a crash before the rename leaves
/// the engine as it was (a stray `kernels.bin` is not in the manifest and is ignored).
pub fn add_kernels_file(
    dir: &Path,
    packed: &crate::kernels::packed::PackedOutput,
    screen: Option<&crate::kernels::screen::ScreenTable>,
) -> Result<()> {
    let (layout, entry) = crate::kernel_file::write(dir, packed, screen)?;
    let manifest_path = dir.join(MANIFEST_FILE);
    let text = std::fs::read_to_string(&manifest_path)
        .map_err(|e| EngineError::io(format!("cannot read {}", manifest_path.display()), e))?;
    let mut manifest = parse_manifest(dir, &text)?;
    manifest
        .files
        .insert(crate::kernel_file::KERNELS_FILE.to_string(), entry);
    manifest.kernel_layout = Some(layout);
    let tmp = dir.join(format!("{MANIFEST_FILE}.tmp-{}", std::process::id()));
    let json = serde_json::to_string_pretty(&manifest).expect("manifest serialises");
    std::fs::write(&tmp, json + "\n")
        .map_err(|e| EngineError::io(format!("cannot write {}", tmp.display()), e))?;
    std::fs::rename(&tmp, &manifest_path)
        .map_err(|e| EngineError::io(format!("cannot replace {}", manifest_path.display()), e))
}

/// A loaded, verified engine directory.
pub struct LoadedDir {
    pub path: PathBuf,
    pub manifest: Manifest,
    pub model: Model,
    pub ids: IdMap,
    /// The stored tensors by name (exporters read them; the engine itself keeps only `model`).
    pub weights: crate::weights::Weights,
    /// The mapped `kernels.bin` of an engine that has one (see [`crate::kernel_file`]).
    pub kernels: Option<crate::kernels::shared::Backing>,
}

/// Largest engine (all files of the manifest together) loaded by default: 64 GiB.
pub const DEFAULT_MAX_ENGINE_BYTES: u64 = 64 << 30;
/// A manifest is a few KiB; anything over this is not one.
const MAX_MANIFEST_BYTES: u64 = 16 << 20;

/// Loads and verifies an engine directory (at most [`DEFAULT_MAX_ENGINE_BYTES`]).
pub fn load(dir: &Path) -> Result<LoadedDir> {
    load_limited(dir, DEFAULT_MAX_ENGINE_BYTES)
}

/// Weight tables of at least this many bytes (64 MiB) read the few scattered rows a request needs
/// by positioned reads of the weights file instead of through its mapping (see
/// [`crate::tensor::Tensor::copy_row_into`]): below it, mapping a whole table costs at most this
/// much memory and is cheaper than a read per row. MovieLens-1M's tables are under 9 MiB;
/// MovieLens-20M's Mult-VAE first layer (20,108 x 600, 48 MiB) read by system calls spent 9 ms of
/// a 25 ms batch of 64 histories in them, 3 ms through the mapping.
pub const DEFAULT_ROW_READS_MIN_BYTES: usize = 64 << 20;

/// How an engine directory is loaded.
#[derive(Clone, Copy, Debug)]
pub struct LoadOptions {
    /// Largest engine (all files of the manifest together) accepted.
    pub max_engine_bytes: u64,
    /// Tables of at least this many bytes read scattered rows from the file, not the mapping.
    pub row_reads_min_bytes: usize,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            max_engine_bytes: DEFAULT_MAX_ENGINE_BYTES,
            row_reads_min_bytes: DEFAULT_ROW_READS_MIN_BYTES,
        }
    }
}

/// [`load`] with an explicit limit on the engine's total file size, checked before reading. Files
/// must live inside the directory: a symlink that resolves outside it is refused.
pub fn load_limited(dir: &Path, max_engine_bytes: u64) -> Result<LoadedDir> {
    load_with(
        dir,
        &LoadOptions {
            max_engine_bytes,
            ..LoadOptions::default()
        },
    )
}

/// [`load`] with explicit [`LoadOptions`].
pub fn load_with(dir: &Path, options: &LoadOptions) -> Result<LoadedDir> {
    let max_engine_bytes = options.max_engine_bytes;
    let bad = |reason: String| EngineError::EngineDir {
        path: dir.to_path_buf(),
        reason,
    };
    if !dir.is_dir() {
        return Err(EngineError::NotFound {
            path: dir.to_path_buf(),
        });
    }
    let manifest_path = dir.join(MANIFEST_FILE);
    let canonical_dir = dir
        .canonicalize()
        .map_err(|e| EngineError::io(format!("cannot resolve {}", dir.display()), e))?;
    confined(&canonical_dir, &manifest_path).map_err(bad)?;
    if let Ok(meta) = std::fs::metadata(&manifest_path) {
        if meta.len() > MAX_MANIFEST_BYTES {
            return Err(bad(format!(
                "{MANIFEST_FILE} is {} bytes; a manifest is never over {MAX_MANIFEST_BYTES}",
                meta.len()
            )));
        }
    }
    let text = std::fs::read_to_string(&manifest_path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            EngineError::NotFound {
                path: manifest_path.clone(),
            }
        } else {
            EngineError::io(format!("cannot read {}", manifest_path.display()), e)
        }
    })?;
    let manifest = parse_manifest(dir, &text)?;

    for required in [WEIGHTS_FILE, ITEM_IDS_FILE] {
        if !manifest.files.contains_key(required) {
            return Err(bad(format!("the manifest does not list {required}")));
        }
    }
    let total: u64 = manifest.files.values().map(|f| f.bytes).sum();
    if total > max_engine_bytes {
        return Err(bad(format!(
            "the engine's files hold {total} bytes, more than the limit of {max_engine_bytes} \
             (the model parameter max_engine_bytes raises it)"
        )));
    }
    for (file, entry) in &manifest.files {
        if file.contains(['/', '\\']) || file.starts_with('.') {
            return Err(bad(format!(
                "the manifest names a file outside the engine: {file:?}"
            )));
        }
        let path = dir.join(file);
        confined(&canonical_dir, &path).map_err(bad)?;
        let meta =
            std::fs::metadata(&path).map_err(|_| EngineError::NotFound { path: path.clone() })?;
        if meta.len() != entry.bytes {
            return Err(bad(format!(
                "{file} is {} bytes, the manifest says {} (truncated or replaced?)",
                meta.len(),
                entry.bytes
            )));
        }
    }

    let weights_path = dir.join(WEIGHTS_FILE);
    let file = EngineError::open(&weights_path)?;
    // SAFETY: the mapping is read-only and the file belongs to an engine directory, which recsys never
    // modifies after writing; its contents are verified against the manifest's sha256 right below.
    // Truncating the file while it is mapped would be an operator error outside this process' control.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .map_err(|e| EngineError::io(format!("cannot map {}", weights_path.display()), e))?;
    // Hashed by reading the file, not the mapping: the pages stay out of this process' resident
    // set until the model touches them.
    verify_file(&weights_path, &manifest.files[WEIGHTS_FILE].sha256)?;
    let storage = Storage::mapped(map, file, options.row_reads_min_bytes);
    let kernels = match &manifest.kernel_layout {
        None => None,
        Some(_) => {
            let entry = manifest
                .files
                .get(crate::kernel_file::KERNELS_FILE)
                .ok_or_else(|| {
                    bad(format!(
                        "the manifest has a kernel layout but does not list {}",
                        crate::kernel_file::KERNELS_FILE
                    ))
                })?;
            let path = dir.join(crate::kernel_file::KERNELS_FILE);
            let file = EngineError::open(&path)?;
            // SAFETY: as for the weights above: read-only, never modified after writing, verified
            // against the manifest's sha256 right below.
            let map = unsafe { memmap2::Mmap::map(&file) }
                .map_err(|e| EngineError::io(format!("cannot map {}", path.display()), e))?;
            verify_file(&path, &entry.sha256)?;
            let backing: crate::kernels::shared::Backing = std::sync::Arc::new(map);
            Some(backing)
        }
    };

    let ids_path = dir.join(ITEM_IDS_FILE);
    let ids_bytes = std::fs::read(&ids_path)
        .map_err(|e| EngineError::io(format!("cannot read {}", ids_path.display()), e))?;
    verify(&ids_path, &ids_bytes, &manifest.files[ITEM_IDS_FILE].sha256)?;
    let mut loaded = from_parts(dir, manifest, storage, ids_bytes)?;
    loaded.kernels = kernels;
    Ok(loaded)
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

/// The part of [`load`] after the files are read and their checksums verified: parses the weights
/// and the id map and checks them against the manifest. Exposed so the parsers can be fuzzed
/// without forging checksums.
pub fn from_parts(
    dir: &Path,
    manifest: Manifest,
    storage: Storage,
    ids_bytes: Vec<u8>,
) -> Result<LoadedDir> {
    let bad = |reason: String| EngineError::EngineDir {
        path: dir.to_path_buf(),
        reason,
    };
    let (tensors, raw_tensors) =
        tensor_map(&storage).map_err(|reason| bad(format!("{WEIGHTS_FILE}: {reason}")))?;
    let ids_path = dir.join(ITEM_IDS_FILE);
    let ids_text =
        String::from_utf8(ids_bytes).map_err(|_| bad(format!("{ITEM_IDS_FILE} is not UTF-8")))?;
    let ids = IdMap::parse_tsv(&ids_text).map_err(|reason| EngineError::IdMap {
        path: ids_path.clone(),
        reason,
    })?;
    if ids.len() != manifest.model.n_items() {
        return Err(bad(format!(
            "{ITEM_IDS_FILE} has {} items, the model has {}",
            ids.len(),
            manifest.model.n_items()
        )));
    }
    if ids.id_type() != manifest.id_type {
        return Err(bad(format!(
            "{ITEM_IDS_FILE} holds {:?} ids, the manifest says {:?}",
            ids.id_type(),
            manifest.id_type
        )));
    }
    let weights = crate::weights::Weights {
        f32: tensors,
        raw: raw_tensors,
    };
    let mut model =
        Model::from_tensors(&manifest.model, &weights).map_err(|e| bad(e.to_string()))?;
    if manifest.static_dense_activations() {
        let scales = manifest.dense_activation_scales().map_err(&bad)?;
        model
            .set_static_activation_scales(&scales)
            .map_err(|e| bad(e.to_string()))?;
    }
    Ok(LoadedDir {
        path: dir.to_path_buf(),
        manifest,
        model,
        ids,
        weights,
        kernels: None,
    })
}

/// Refuses a file that is a symlink resolving outside the engine directory (`dir` is canonical).
/// A missing file passes here; reading it reports that.
fn confined(dir: &Path, path: &Path) -> std::result::Result<(), String> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_symlink() => {
            let target = path
                .canonicalize()
                .map_err(|e| format!("{} is a dangling symlink ({e})", path.display()))?;
            if target.starts_with(dir) {
                Ok(())
            } else {
                Err(format!(
                    "{} is a symlink to {}, outside the engine directory",
                    path.display(),
                    target.display()
                ))
            }
        }
        _ => Ok(()),
    }
}

/// [`verify`] over a file read in 1 MiB pieces.
fn verify_file(path: &Path, expected: &str) -> Result<()> {
    use std::io::Read;
    let mut file = EngineError::open(path)?;
    let mut hash = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buffer)
            .map_err(|e| EngineError::io(format!("cannot read {}", path.display()), e))?;
        if n == 0 {
            break;
        }
        hash.update(&buffer[..n]);
    }
    check_digest(path, hex::encode(hash.finalize()), expected)
}

fn check_digest(path: &Path, found: String, expected: &str) -> Result<()> {
    if found != expected {
        return Err(EngineError::Checksum {
            path: path.to_path_buf(),
            expected: expected.into(),
            found,
        });
    }
    Ok(())
}

fn verify(path: &Path, bytes: &[u8], expected: &str) -> Result<()> {
    check_digest(path, hex::encode(Sha256::digest(bytes)), expected)
}

type Tensors = (TensorMap, std::collections::HashMap<String, RawTensor>);

fn tensor_map(storage: &Storage) -> Result<Tensors, String> {
    let bytes = storage.bytes();
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
    let mut map = TensorMap::new();
    let mut raw = std::collections::HashMap::new();
    for (name, view) in st.tensors() {
        match view.dtype() {
            safetensors::Dtype::F32 => {}
            safetensors::Dtype::F16 | safetensors::Dtype::I8 => {
                let offset = view.data().as_ptr() as usize - bytes.as_ptr() as usize;
                raw.insert(
                    name,
                    RawTensor {
                        dtype: view.dtype(),
                        shape: view.shape().to_vec(),
                        bytes: crate::elements::Elements::view(storage, offset, view.data().len())?,
                    },
                );
                continue;
            }
            other => {
                return Err(format!(
                    "tensor {name} is {other:?}, expected F32, F16 or I8"
                ))
            }
        }
        let offset = view.data().as_ptr() as usize - bytes.as_ptr() as usize;
        let tensor =
            Tensor::view(storage, offset, view.shape().to_vec()).map_err(|e| e.to_string())?;
        map.insert(name, tensor);
    }
    Ok((map, raw))
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
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
