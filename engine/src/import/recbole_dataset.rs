//! The item list of a dataset as RecBole saved it (`save_dataset: True` writes
//! `<dataset>-<DatasetClass>.pth`, `save_dataloaders: True` writes
//! `<dataset>-for-<model>-dataloader.pth`): both are plain pickles of RecBole objects, read here as
//! data by [`pickle`], so nothing in them runs and neither RecBole nor PyTorch is needed.
//!
//! What is read: the RecBole `Dataset` object (the first object whose state holds both
//! `field2id_token` and `iid_field`), its `iid_field` (the item column, `item_id` by default) and
//! `field2id_token[iid_field]`, the numpy array of the item tokens by internal index, `[PAD]` at 0.
//! That array is the mapping a RecBole model's item embedding rows follow, so it is the item map.
//! numpy keeps it as fixed-width unicode (`<U8`: UTF-32 code units, NUL padded) or, for mixed
//! tokens, as an object array whose pickled data is a list of strings; both are read. The
//! dictionary's keys are numpy string scalars (`numpy.core.multiarray.scalar(dtype, bytes)`) or
//! plain strings.

use std::io::Read;
use std::path::Path;

use super::pickle::{self, Value};
use crate::error::{EngineError, Result};

/// RecBole's padding token, internal index 0.
const PAD_TOKEN: &str = "[PAD]";

/// The item tokens of internal indices 1..=N from a RecBole saved dataset or dataloaders file, at
/// most `max_bytes` long (the whole file is decoded in memory).
pub fn read_item_tokens(path: &Path, max_bytes: u64) -> Result<Vec<String>> {
    let bad = |reason: String| EngineError::IdMap {
        path: path.to_path_buf(),
        reason,
    };
    let mut file = EngineError::open(path)?;
    let size = file
        .metadata()
        .map_err(|e| EngineError::io(format!("cannot stat {}", path.display()), e))?
        .len();
    if size > max_bytes {
        return Err(bad(format!(
            "the file is {size} bytes, more than the limit of {max_bytes} \
             (raise it with --max-checkpoint-bytes if the file is trusted)"
        )));
    }
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .map_err(|e| EngineError::io(format!("cannot read {}", path.display()), e))?;
    item_tokens_from_bytes(&bytes).map_err(bad)
}

/// [`read_item_tokens`] on the file's bytes; the error is the reason, for the caller to place.
pub fn item_tokens_from_bytes(bytes: &[u8]) -> std::result::Result<Vec<String>, String> {
    if bytes.starts_with(b"PK\x03\x04") {
        return Err(
            "this is a zip archive (a torch.save file, such as a model checkpoint); \
                    RecBole saves its dataset and dataloaders as plain pickles \
                    (`<dataset>-<DatasetClass>.pth`, `<dataset>-for-<model>-dataloader.pth`)"
                .into(),
        );
    }
    if bytes.first() != Some(&0x80) {
        return Err(
            "not a pickle file; expected the dataset or dataloaders file RecBole saves \
                    with save_dataset / save_dataloaders"
                .into(),
        );
    }
    let root = pickle::parse(bytes).map_err(|e| e.to_string())?;
    let state = find_dataset_state(&root).ok_or_else(|| {
        "no RecBole Dataset in the file (no object with field2id_token and iid_field)".to_string()
    })?;
    let field = state
        .get("iid_field")
        .and_then(Value::as_str)
        .ok_or("the Dataset's iid_field is not a string")?;
    let tables = state
        .get("field2id_token")
        .and_then(Value::as_dict)
        .ok_or("the Dataset's field2id_token is not a dictionary")?;
    let array = tables
        .iter()
        .find(|(key, _)| key_text(key).as_deref() == Some(field))
        .map(|(_, array)| array)
        .ok_or_else(|| {
            let names: Vec<String> = tables.iter().filter_map(|(k, _)| key_text(k)).collect();
            format!(
                "field2id_token has no entry for the item field {field:?} (it has {})",
                names.join(", ")
            )
        })?;
    let mut tokens =
        numpy_strings(array).map_err(|reason| format!("field2id_token[{field:?}]: {reason}"))?;
    match tokens.first().map(String::as_str) {
        Some(PAD_TOKEN) => {}
        Some(other) => {
            return Err(format!(
                "field2id_token[{field:?}] starts with {other:?}, not RecBole's {PAD_TOKEN:?} \
                 at index 0"
            ))
        }
        None => return Err(format!("field2id_token[{field:?}] is empty")),
    }
    tokens.remove(0);
    if tokens.is_empty() {
        return Err(format!("field2id_token[{field:?}] holds no item"));
    }
    Ok(tokens)
}

/// The state (a dict) of the first object, in document order, that carries a dataset's maps.
/// Walks with an explicit stack: the value tree of a large dataset can be deep.
fn find_dataset_state(root: &Value) -> Option<&Value> {
    let mut pending = vec![root];
    while let Some(value) = pending.pop() {
        let children: Vec<&Value> = match value {
            Value::Object {
                callable: _,
                args,
                state,
                dict_items,
                list_items,
            } => {
                if let Some(state) = state.as_deref() {
                    if state.get("field2id_token").is_some() && state.get("iid_field").is_some() {
                        return Some(state);
                    }
                }
                let mut c: Vec<&Value> = vec![args];
                c.extend(state.as_deref());
                c.extend(dict_items.iter().map(|(_, v)| v));
                c.extend(list_items);
                c
            }
            Value::List(v) | Value::Tuple(v) | Value::Set(v) => v.iter().collect(),
            Value::Dict(items) => items.iter().map(|(_, v)| v).collect(),
            _ => continue,
        };
        // Reversed, so that the first child is looked at first.
        pending.extend(children.into_iter().rev());
    }
    None
}

/// A dictionary key as text: a Python `str`, or a numpy string scalar.
fn key_text(key: &Value) -> Option<String> {
    match key {
        Value::Str(s) => Some(s.clone()),
        Value::Object { callable, args, .. }
            if is_numpy(callable, "scalar") || is_numpy(callable, "_reconstruct") =>
        {
            let args = args.as_sequence()?;
            let (kind, width, little_endian) = dtype_of(args.first()?).ok()?;
            match (kind, args.get(1)?) {
                ('U', Value::Bytes(raw)) => {
                    let width = if width == 0 { raw.len() / 4 } else { width };
                    utf32_strings(raw, width.max(1), little_endian)
                        .ok()?
                        .into_iter()
                        .next()
                }
                _ => None,
            }
        }
        _ => None,
    }
}

/// Whether `callable` is numpy's `name` (numpy 1's `numpy.core.multiarray` or numpy 2's
/// `numpy._core.multiarray`).
fn is_numpy(callable: &Value, name: &str) -> bool {
    callable.is_global("numpy.core.multiarray", name)
        || callable.is_global("numpy._core.multiarray", name)
}

/// A pickled `numpy.dtype`: its kind letter ('U' unicode, 'O' object, ...), its width in
/// characters for 'U' (0 when not stated), and whether its data is little-endian.
fn dtype_of(value: &Value) -> std::result::Result<(char, usize, bool), String> {
    let Value::Object {
        callable,
        args,
        state,
        ..
    } = value
    else {
        return Err("its dtype is not a numpy dtype".into());
    };
    if !callable.is_global("numpy", "dtype") {
        return Err("its dtype is not a numpy dtype".into());
    }
    let code = args
        .as_sequence()
        .and_then(|a| a.first())
        .and_then(Value::as_str)
        .ok_or("its dtype has no type code")?;
    let mut chars = code.chars();
    let kind = chars.next().ok_or("its dtype has an empty type code")?;
    let width = chars.as_str().parse::<usize>().unwrap_or(0);
    // The dtype's state: (version, byte order, ...); '<' little, '>' big, '|' or '=' not applicable
    // or native (every platform RecBole runs on is little-endian).
    let order = state
        .as_deref()
        .and_then(Value::as_sequence)
        .and_then(|s| s.get(1))
        .and_then(Value::as_str)
        .unwrap_or("<");
    Ok((kind, width, order != ">"))
}

/// The strings of a pickled one-dimensional numpy array of strings.
fn numpy_strings(array: &Value) -> std::result::Result<Vec<String>, String> {
    let Value::Object {
        callable, state, ..
    } = array
    else {
        return Err("not a numpy array".into());
    };
    if !is_numpy(callable, "_reconstruct") {
        return Err("not a numpy array".into());
    }
    // ndarray state: (version, shape, dtype, is_fortran, data).
    let state = state
        .as_deref()
        .and_then(Value::as_sequence)
        .ok_or("the numpy array has no state")?;
    let [_, shape, dtype, _, data] = state else {
        return Err(format!(
            "the numpy array's state has {} parts, expected 5",
            state.len()
        ));
    };
    let shape: Vec<i64> = shape
        .as_sequence()
        .ok_or("the numpy array has no shape")?
        .iter()
        .map(|d| d.as_int().ok_or("the numpy array's shape is not integers"))
        .collect::<std::result::Result<_, _>>()?;
    let [count] = shape[..] else {
        return Err(format!(
            "the array has shape {shape:?}, expected one dimension"
        ));
    };
    let count = usize::try_from(count).map_err(|_| "negative array length".to_string())?;
    let (kind, width, little_endian) = dtype_of(dtype)?;
    let strings = match (kind, data) {
        ('U', Value::Bytes(raw)) => {
            if width == 0 || raw.len() != count * width * 4 {
                return Err(format!(
                    "{} bytes of data for {count} strings of {width} characters",
                    raw.len()
                ));
            }
            utf32_strings(raw, width, little_endian)?
        }
        ('O', Value::List(items)) => items
            .iter()
            .map(|item| match item {
                Value::Str(s) => Ok(s.clone()),
                Value::Int(i) => Ok(i.to_string()),
                other => Err(format!("an element is not a string: {other:?}")),
            })
            .collect::<std::result::Result<_, _>>()?,
        (kind, _) => {
            return Err(format!(
                "the array's dtype kind is {kind:?}; item tokens are unicode ('U') or object ('O')"
            ))
        }
    };
    if strings.len() != count {
        return Err(format!(
            "the array holds {} strings, its shape says {count}",
            strings.len()
        ));
    }
    Ok(strings)
}

/// Fixed-width UTF-32 strings of `width` code units each, trailing NULs removed.
fn utf32_strings(
    raw: &[u8],
    width: usize,
    little_endian: bool,
) -> std::result::Result<Vec<String>, String> {
    raw.chunks_exact(width * 4)
        .map(|cell| {
            let mut text = String::with_capacity(width);
            for unit in cell.chunks_exact(4) {
                let unit: [u8; 4] = unit.try_into().expect("chunks of 4");
                let code = if little_endian {
                    u32::from_le_bytes(unit)
                } else {
                    u32::from_be_bytes(unit)
                };
                if code == 0 {
                    break;
                }
                text.push(
                    char::from_u32(code).ok_or_else(|| {
                        format!("a token holds {code:#x}, not a Unicode character")
                    })?,
                );
            }
            Ok(text)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_width_utf32_cells_lose_their_padding() {
        let mut raw = Vec::new();
        for cell in ["[PAD]", "a", "é€"] {
            let mut units: Vec<u32> = cell.chars().map(|c| c as u32).collect();
            units.resize(5, 0);
            raw.extend(units.iter().flat_map(|u| u.to_le_bytes()));
        }
        assert_eq!(
            utf32_strings(&raw, 5, true).unwrap(),
            vec!["[PAD]", "a", "é€"]
        );
        let big: Vec<u8> = raw
            .chunks_exact(4)
            .flat_map(|u| [u[3], u[2], u[1], u[0]])
            .collect();
        assert_eq!(utf32_strings(&big, 5, false).unwrap()[2], "é€");
        let bad = 0xD800u32.to_le_bytes();
        assert!(utf32_strings(&bad, 1, true).unwrap_err().contains("0xd800"));
    }

    #[test]
    fn files_that_are_not_recbole_datasets_are_named() {
        let zip = item_tokens_from_bytes(b"PK\x03\x04rest").unwrap_err();
        assert!(zip.contains("zip archive"), "{zip}");
        let text = item_tokens_from_bytes(b"1\t10001\n").unwrap_err();
        assert!(text.contains("not a pickle"), "{text}");
        // A pickled dict with no Dataset in it: {"a": 1}
        let plain = item_tokens_from_bytes(b"\x80\x04}\x94\x8c\x01a\x94K\x01s.").unwrap_err();
        assert!(plain.contains("no RecBole Dataset"), "{plain}");
    }
}
