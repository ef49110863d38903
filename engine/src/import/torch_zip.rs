//! PyTorch's zip checkpoint format (`torch.save`, PyTorch >= 1.6): `<prefix>/data.pkl` holds the
//! pickled object graph, and each tensor storage is the raw bytes of `<prefix>/data/<key>`, named by a
//! persistent id `('storage', <dtype>Storage, key, location, numel)`.

use std::collections::BTreeMap;
use std::io::{Cursor, Read};
use std::path::Path;

use super::pickle::{self, Value};
use super::{CheckpointFormat, CheckpointTensor, ElementType};
use crate::error::{EngineError, Result};

type Parsed = (
    CheckpointFormat,
    BTreeMap<String, CheckpointTensor>,
    Option<serde_json::Map<String, serde_json::Value>>,
);

pub(super) fn read(path: &Path, bytes: &[u8]) -> Result<Parsed> {
    let bad = |reason: String| EngineError::checkpoint(path, reason);
    let mut archive = zip::ZipArchive::new(Cursor::new(bytes))
        .map_err(|e| bad(format!("corrupted zip archive: {e}")))?;

    let pickle_name = archive
        .file_names()
        .find(|n| *n == "data.pkl" || n.ends_with("/data.pkl"))
        .map(str::to_owned)
        .ok_or_else(|| bad("zip archive has no data.pkl: not a torch.save checkpoint".into()))?;
    let prefix = pickle_name
        .strip_suffix("data.pkl")
        .unwrap_or("")
        .to_owned();

    if let Some(order) = read_entry(&mut archive, &format!("{prefix}byteorder"), path)? {
        if order != b"little" {
            return Err(bad(format!(
                "big-endian checkpoints are not supported (byteorder = {:?})",
                String::from_utf8_lossy(&order)
            )));
        }
    }

    let pickled = read_entry(&mut archive, &pickle_name, path)?.expect("name was listed");
    let root = pickle::parse(&pickled).map_err(|e| bad(format!("in {pickle_name}: {e}")))?;

    let (format, state_dict) = find_state_dict(&root).ok_or_else(|| {
        bad(
            "no state dict found: expected a dict of tensors, or a dict with a 'state_dict' entry"
                .into(),
        )
    })?;

    let mut tensors = BTreeMap::new();
    for (key, value) in state_dict {
        let Some(name) = key.as_str() else { continue };
        let Some(spec) = tensor_spec(value) else {
            // Non-tensor entries (e.g. `_metadata`, scalars) carry no weights.
            continue;
        };
        let spec = spec.map_err(|reason| bad(format!("tensor '{name}': {reason}")))?;
        let storage_name = format!("{prefix}data/{}", spec.storage_key);
        let storage = read_entry(&mut archive, &storage_name, path)?.ok_or_else(|| {
            bad(format!(
                "tensor '{name}': storage {storage_name} is missing from the archive"
            ))
        })?;
        let bytes =
            gather(&spec, &storage).map_err(|reason| bad(format!("tensor '{name}': {reason}")))?;
        tensors.insert(
            name.to_owned(),
            CheckpointTensor {
                dtype: spec.dtype,
                shape: spec.shape,
                bytes,
            },
        );
    }

    let config = match format {
        CheckpointFormat::Recbole => {
            root.get("config")
                .and_then(recbole_final_config)
                .map(|c| match to_json(c) {
                    serde_json::Value::Object(map) => map,
                    _ => serde_json::Map::new(),
                })
        }
        _ => None,
    };
    Ok((format, tensors, config))
}

fn read_entry(
    archive: &mut zip::ZipArchive<Cursor<&[u8]>>,
    name: &str,
    path: &Path,
) -> Result<Option<Vec<u8>>> {
    let mut entry = match archive.by_name(name) {
        Ok(entry) => entry,
        Err(zip::result::ZipError::FileNotFound) => return Ok(None),
        Err(e) => {
            return Err(EngineError::checkpoint(
                path,
                format!("cannot open {name} in the archive: {e}"),
            ))
        }
    };
    // The declared size comes from the file; cap the up-front reservation so a lie costs nothing.
    let mut out = Vec::with_capacity((entry.size() as usize).min(1 << 30));
    entry.read_to_end(&mut out).map_err(|e| {
        EngineError::checkpoint(path, format!("cannot read {name} in the archive: {e}"))
    })?;
    Ok(Some(out))
}

/// Finds the dict of tensors: the root itself (`torch.save(state_dict)`), or its `state_dict` entry
/// (RecBole, and the common `{'state_dict': ..., 'optimizer': ...}` training checkpoints), or its
/// `model_state_dict` entry (the generative-recommenders trainer's `{epoch, model_state_dict,
/// optimizer_state_dict}`).
fn find_state_dict(root: &Value) -> Option<(CheckpointFormat, &[(Value, Value)])> {
    let items = root.as_dict()?;
    if let Some(inner) = root.get("model_state_dict").and_then(Value::as_dict) {
        return Some((CheckpointFormat::TorchStateDict, inner));
    }
    if let Some(inner) = root.get("state_dict").and_then(Value::as_dict) {
        let format = if root.get("config").is_some() {
            CheckpointFormat::Recbole
        } else {
            CheckpointFormat::TorchStateDict
        };
        return Some((format, inner));
    }
    let has_tensor = items.iter().any(|(_, v)| tensor_spec(v).is_some());
    has_tensor.then_some((CheckpointFormat::TorchStateDict, items))
}

struct TensorSpec {
    dtype: ElementType,
    storage_key: String,
    storage_numel: usize,
    offset: usize,
    shape: Vec<usize>,
    strides: Vec<usize>,
}

/// Recognises `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` (and
/// `_rebuild_parameter` around it). `None`: not a tensor; `Some(Err)`: a tensor we cannot read.
fn tensor_spec(value: &Value) -> Option<Result<TensorSpec, String>> {
    let Value::Object { callable, args, .. } = value else {
        return None;
    };
    if callable.is_global("torch._utils", "_rebuild_parameter") {
        return tensor_spec(args.as_sequence()?.first()?);
    }
    if !(callable.is_global("torch._utils", "_rebuild_tensor_v2")
        || callable.is_global("torch._utils", "_rebuild_tensor"))
    {
        return None;
    }
    Some(parse_rebuild_args(args))
}

fn parse_rebuild_args(args: &Value) -> Result<TensorSpec, String> {
    let args = args
        .as_sequence()
        .ok_or("rebuild arguments are not a tuple")?;
    if args.len() < 4 {
        return Err(format!("rebuild takes 4+ arguments, found {}", args.len()));
    }
    let Value::PersistentId(pid) = &args[0] else {
        return Err("storage is not a persistent reference".into());
    };
    let pid = pid
        .as_sequence()
        .ok_or("storage reference is not a tuple")?;
    if pid.len() < 5 || pid[0].as_str() != Some("storage") {
        return Err("storage reference is not ('storage', type, key, location, numel)".into());
    }
    let dtype = match &pid[1] {
        Value::Global { module, name } if module == "torch" => storage_dtype(name)?,
        _ => return Err("storage type is not a torch storage class".into()),
    };
    let storage_key = match &pid[2] {
        Value::Str(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        _ => return Err("storage key is not a string".into()),
    };
    if storage_key.is_empty() || !storage_key.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(format!("storage key {storage_key:?} is not a plain name"));
    }
    let storage_numel = non_negative(&pid[4], "storage size")?;
    let offset = non_negative(&args[1], "storage offset")?;
    let dims = |v: &Value, what: &str| -> Result<Vec<usize>, String> {
        v.as_sequence()
            .ok_or(format!("{what} is not a tuple"))?
            .iter()
            .map(|d| non_negative(d, what))
            .collect()
    };
    let shape = dims(&args[2], "size")?;
    let strides = dims(&args[3], "stride")?;
    if shape.len() != strides.len() {
        return Err(format!(
            "size {shape:?} and stride {strides:?} differ in rank"
        ));
    }
    Ok(TensorSpec {
        dtype,
        storage_key,
        storage_numel,
        offset,
        shape,
        strides,
    })
}

fn non_negative(v: &Value, what: &str) -> Result<usize, String> {
    v.as_int()
        .and_then(|i| usize::try_from(i).ok())
        .ok_or(format!("{what} is not a non-negative integer"))
}

fn storage_dtype(class: &str) -> Result<ElementType, String> {
    Ok(match class {
        "FloatStorage" => ElementType::F32,
        "DoubleStorage" => ElementType::F64,
        "HalfStorage" => ElementType::F16,
        "BFloat16Storage" => ElementType::BF16,
        "LongStorage" => ElementType::Other("I64", 8),
        "IntStorage" => ElementType::Other("I32", 4),
        "ShortStorage" => ElementType::Other("I16", 2),
        "CharStorage" => ElementType::Other("I8", 1),
        "ByteStorage" => ElementType::Other("U8", 1),
        "BoolStorage" => ElementType::Other("BOOL", 1),
        other => return Err(format!("unknown storage type torch.{other}")),
    })
}

/// Copies the (possibly strided) tensor out of its storage into contiguous bytes.
fn gather(spec: &TensorSpec, storage: &[u8]) -> Result<Vec<u8>, String> {
    let elem = spec.dtype.size();
    if storage.len() < spec.storage_numel.saturating_mul(elem) {
        return Err(format!(
            "storage holds {} bytes but declares {} elements of {} bytes (truncated file?)",
            storage.len(),
            spec.storage_numel,
            elem
        ));
    }
    let numel = spec
        .shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or("shape overflows")?;
    if numel == 0 {
        return Ok(Vec::new());
    }
    // The last element any index can reach must lie inside the storage.
    let max_offset = spec
        .shape
        .iter()
        .zip(&spec.strides)
        .try_fold(spec.offset, |acc, (&d, &s)| {
            (d - 1).checked_mul(s).and_then(|x| x.checked_add(acc))
        })
        .ok_or("strides overflow")?;
    if max_offset >= spec.storage_numel {
        return Err(format!(
            "view reaches element {max_offset} of a storage of {} elements",
            spec.storage_numel
        ));
    }
    let contiguous = {
        let mut expected = 1usize;
        let mut ok = true;
        for (&d, &s) in spec.shape.iter().zip(&spec.strides).rev() {
            if d != 1 && s != expected {
                ok = false;
            }
            expected *= d;
        }
        ok
    };
    if contiguous {
        let start = spec.offset * elem;
        return Ok(storage[start..start + numel * elem].to_vec());
    }
    let mut out = Vec::with_capacity(numel * elem);
    let mut index = vec![0usize; spec.shape.len()];
    for _ in 0..numel {
        let at = spec.offset
            + index
                .iter()
                .zip(&spec.strides)
                .map(|(i, s)| i * s)
                .sum::<usize>();
        out.extend_from_slice(&storage[at * elem..(at + 1) * elem]);
        for axis in (0..index.len()).rev() {
            index[axis] += 1;
            if index[axis] < spec.shape[axis] {
                break;
            }
            index[axis] = 0;
        }
    }
    Ok(out)
}

/// RecBole pickles its `Config` object; its state (set by `BUILD`) holds `final_config_dict`.
fn recbole_final_config(config: &Value) -> Option<&Value> {
    match config {
        Value::Object {
            state: Some(state), ..
        } => state.get("final_config_dict"),
        _ => None,
    }
}

/// Plain pickle data as JSON; objects (enums, devices, classes) become null because a model config
/// never needs them.
fn to_json(value: &Value) -> serde_json::Value {
    use serde_json::Value as J;
    match value {
        Value::None => J::Null,
        Value::Bool(b) => J::Bool(*b),
        Value::Int(i) => J::from(*i),
        Value::Float(f) => serde_json::Number::from_f64(*f).map_or(J::Null, J::Number),
        Value::Str(s) => J::String(s.clone()),
        Value::List(items) | Value::Tuple(items) | Value::Set(items) => {
            J::Array(items.iter().map(to_json).collect())
        }
        Value::Dict(items) => J::Object(
            items
                .iter()
                .filter_map(|(k, v)| Some((k.as_str()?.to_owned(), to_json(v))))
                .collect(),
        ),
        _ => J::Null,
    }
}
