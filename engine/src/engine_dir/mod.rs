//! The engine directory: what `recsys convert` writes and the server loads, in one place: the
//! manifest's types ([`manifest`], the leaf the rest builds on), `kernels.bin` ([`kernel_file`]),
//! and writing and loading the whole directory (here).
//!
//! ```text
//! manifest.json          format version, model config, precision, source checkpoint, per-file sha256
//! weights.safetensors    the model's tensors (f32), memory-mapped at load
//! item_ids.tsv           internal index -> external id
//! kernels.bin            the output layer (and screen) laid out for the kernels, mapped at load
//! item_sets.bin          item attribute sets (optional; `crate::item_sets`)
//! item_popularity.bin    interaction counts per item (optional; `crate::popularity`)
//! retired_items.tsv      items a compacted engine keeps but never returns (optional;
//!                        `crate::compact`)
//! ```
//! Loading checks the format version, every file's size and sha256, and the tensors' shapes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::idmap::IdMap;
use crate::item_sets::{AttributeReport, ItemSets, ITEM_SETS_FILE};
use crate::models::Model;
use crate::popularity::{Popularity, PopularityReport, POPULARITY_FILE};
use crate::tensor::TensorMap;
use crate::tensor::{Storage, Tensor};
pub use crate::weights::RawTensor;

pub mod kernel_file;
mod manifest;

pub use manifest::*;

/// Everything needed to write an engine directory.
pub struct EngineParts<'a> {
    pub config: &'a ModelConfig,
    pub tensors: &'a [(String, Tensor)],
    /// Quantized tensors, stored in their own dtype.
    pub raw_tensors: &'a [(String, RawTensor)],
    pub precision: Precision,
    pub quantization: Option<Quantization>,
    pub calibration: Option<CalibrationRecord>,
    pub screen: Screen,
    pub ids: &'a IdMap,
    pub source: SourceCheckpoint,
    /// The output layer (and screen) as the kernels read them, for `kernels.bin`; `None` writes
    /// an engine without it (loading then packs, as for engines written before it existed).
    pub kernels: Option<KernelParts<'a>>,
    /// Item attribute sets and what made them, for `item_sets.bin`.
    pub item_sets: Option<&'a (ItemSets, AttributeReport)>,
    /// Interaction counts per item, for `item_popularity.bin`.
    pub popularity: Option<&'a (Popularity, PopularityReport)>,
    /// The catalogue delta a compacted engine folds in, and the items it keeps retired (internal
    /// indices, ascending), for `retired_items.tsv`.
    pub folded: Option<(FoldedCatalogue, &'a [u32])>,
}

/// What `kernels.bin` holds.
#[derive(Clone, Copy)]
pub struct KernelParts<'a> {
    pub packed: &'a crate::kernels::packed::PackedOutput,
    pub screen: Option<&'a crate::kernels::screen::ScreenTable>,
}

/// Writes an engine directory atomically: every file (`kernels.bin` included) goes to a temporary
/// sibling directory that is renamed into place, so a crash never leaves a half-written engine
/// under the final name.
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
    let kernel_layout = match parts.kernels {
        Some(k) => {
            let (layout, entry) = kernel_file::write(dir, k.packed, k.screen)?;
            files.insert(kernel_file::KERNELS_FILE.to_string(), entry);
            Some(layout)
        }
        None => None,
    };
    let mut written = vec![WEIGHTS_FILE, ITEM_IDS_FILE];
    let item_attributes = parts.item_sets.map(|(sets, report)| {
        written.push(ITEM_SETS_FILE);
        ItemAttributesRecord {
            columns: sets.columns().map(str::to_owned).collect(),
            sets: sets.len(),
            items: report.items,
            unknown_items: report.unknown_items,
        }
    });
    let popularity = parts.popularity.map(|(_, report)| {
        written.push(POPULARITY_FILE);
        PopularityRecord {
            column: report.column.clone(),
            interactions: report.interactions,
            unknown_items: report.unknown_items,
            items: report.items,
        }
    });
    if let Some((counts, _)) = parts.popularity {
        let path = dir.join(POPULARITY_FILE);
        std::fs::write(&path, counts.to_bytes())
            .map_err(|e| EngineError::io(format!("cannot write {}", path.display()), e))?;
    }
    if let Some((_, retired)) = &parts.folded {
        written.push(RETIRED_ITEMS_FILE);
        let mut text = String::new();
        for &index in retired.iter() {
            let id = parts.ids.external(index).ok_or_else(|| {
                EngineError::Config(format!(
                    "retired item index {index} is not in the catalogue"
                ))
            })?;
            match id {
                crate::idmap::ExternalId::Int(i) => text.push_str(&i.to_string()),
                crate::idmap::ExternalId::Str(s) => text.push_str(&s),
            }
            text.push('\n');
        }
        let path = dir.join(RETIRED_ITEMS_FILE);
        std::fs::write(&path, text)
            .map_err(|e| EngineError::io(format!("cannot write {}", path.display()), e))?;
    }
    if let Some((sets, _)) = parts.item_sets {
        let path = dir.join(ITEM_SETS_FILE);
        std::fs::write(&path, sets.to_bytes())
            .map_err(|e| EngineError::io(format!("cannot write {}", path.display()), e))?;
    }
    for file in written {
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
        kernel_layout,
        item_attributes,
        popularity,
        catalogue: parts.folded.as_ref().map(|(record, _)| record.clone()),
        created_by: format!("recsys {}", env!("CARGO_PKG_VERSION")),
        created_at: utc_now_rfc3339(),
    };
    let json = serde_json::to_string_pretty(&manifest).expect("manifest serialises");
    std::fs::write(dir.join(MANIFEST_FILE), json + "\n")
        .map_err(|e| EngineError::io("cannot write the manifest", e))?;
    Ok(manifest)
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
    /// The item attribute sets of an engine converted with them (else none).
    pub item_sets: ItemSets,
    /// The interaction counts of an engine converted with them.
    pub popularity: Option<Popularity>,
    /// Items a compacted engine keeps retired (internal indices, ascending; `retired_items.tsv`).
    pub retired: Vec<u32>,
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
                .get(kernel_file::KERNELS_FILE)
                .ok_or_else(|| {
                    bad(format!(
                        "the manifest has a kernel layout but does not list {}",
                        kernel_file::KERNELS_FILE
                    ))
                })?;
            let path = dir.join(kernel_file::KERNELS_FILE);
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
    let sets_bytes = read_optional(dir, &manifest, ITEM_SETS_FILE)?;
    let popularity_bytes = read_optional(dir, &manifest, POPULARITY_FILE)?;
    let retired_bytes = read_optional(dir, &manifest, RETIRED_ITEMS_FILE)?;
    let mut loaded = from_parts(dir, manifest, storage, ids_bytes)?;
    if let Some(bytes) = popularity_bytes {
        loaded.popularity = Some(
            Popularity::from_bytes(&bytes, loaded.ids.len() + 1)
                .map_err(|reason| bad(format!("{POPULARITY_FILE}: {reason}")))?,
        );
    }
    loaded.kernels = kernels;
    match (retired_bytes, &loaded.manifest.catalogue) {
        (Some(bytes), record) => {
            loaded.retired = parse_retired(&bytes, &loaded.ids, record.as_ref())
                .map_err(|reason| bad(format!("{RETIRED_ITEMS_FILE}: {reason}")))?;
        }
        (None, Some(record)) if record.retired > 0 => {
            return Err(bad(format!(
                "the manifest's catalogue record keeps {} item(s) retired but does not list \
                 {RETIRED_ITEMS_FILE}",
                record.retired
            )))
        }
        (None, _) => {}
    }
    if let Some(bytes) = sets_bytes {
        loaded.item_sets = ItemSets::from_bytes(&bytes, loaded.ids.len() + 1)
            .map_err(|reason| bad(format!("{ITEM_SETS_FILE}: {reason}")))?;
    }
    Ok(loaded)
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
    let item_sets = ItemSets::empty(weights_items(&ids));
    Ok(LoadedDir {
        path: dir.to_path_buf(),
        manifest,
        model,
        ids,
        weights,
        kernels: None,
        item_sets,
        popularity: None,
        retired: Vec::new(),
    })
}

/// The internal indices (ascending, distinct) of the ids `retired_items.tsv` lists: every one an
/// item of the engine, as many as the manifest's catalogue record counts.
fn parse_retired(
    bytes: &[u8],
    ids: &IdMap,
    record: Option<&FoldedCatalogue>,
) -> std::result::Result<Vec<u32>, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| "not UTF-8 text".to_string())?;
    let mut retired = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let index = ids
            .index_of_str(line)
            .ok_or_else(|| format!("line {}: {line:?} is not an item of the engine", n + 1))?;
        retired.push(index);
    }
    retired.sort_unstable();
    retired.dedup();
    let expected = record.map(|r| r.retired).ok_or_else(|| {
        "the manifest has no catalogue record, so no item can be retired".to_string()
    })?;
    if retired.len() != expected {
        return Err(format!(
            "{} distinct items, the manifest's catalogue record says {expected}",
            retired.len()
        ));
    }
    Ok(retired)
}

/// The verified bytes of `file` when the manifest lists it (an optional part of the engine).
fn read_optional(dir: &Path, manifest: &Manifest, file: &str) -> Result<Option<Vec<u8>>> {
    let Some(entry) = manifest.files.get(file) else {
        return Ok(None);
    };
    let path = dir.join(file);
    let bytes = std::fs::read(&path)
        .map_err(|e| EngineError::io(format!("cannot read {}", path.display()), e))?;
    verify(&path, &bytes, &entry.sha256)?;
    Ok(Some(bytes))
}

/// Internal indices of a catalogue (PAD included).
fn weights_items(ids: &IdMap) -> usize {
    ids.len() + 1
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
            safetensors::Dtype::F16 | safetensors::Dtype::BF16 | safetensors::Dtype::I8 => {
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
                    "tensor {name} is {other:?}, expected F32, F16, BF16 or I8"
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
