//! The layout both files of named item sets share (an engine's `item_sets.bin` and a live
//! availability object): an 8-byte magic, a u32-le format number, a u32-le header length, the JSON
//! header, then each set's portable Roaring bytes in the header's order. Every length, count and
//! index is checked when read; each file adds its own header fields and meaning.

use std::collections::BTreeMap;

use roaring::RoaringBitmap;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Sets by column, then by value.
pub(crate) type Columns = BTreeMap<String, BTreeMap<String, RoaringBitmap>>;

/// One set as a header lists it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct SetEntry {
    pub column: String,
    pub value: String,
    pub count: u64,
    pub bytes: usize,
}

/// `magic`, `format`, the header's length and the header, then `payload`.
pub(crate) fn write(
    magic: &[u8; 8],
    format: u32,
    header: &impl Serialize,
    payload: &[u8],
) -> Vec<u8> {
    let header = serde_json::to_vec(header).expect("the header serialises");
    let mut out = Vec::with_capacity(16 + header.len() + payload.len());
    out.extend_from_slice(magic);
    out.extend_from_slice(&format.to_le_bytes());
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(payload);
    out
}

/// The header of a file written by [`write`] and the bytes after it; `what` names the file kind
/// in errors ("an item sets file").
pub(crate) fn read<'a, H: DeserializeOwned>(
    bytes: &'a [u8],
    magic: &[u8; 8],
    format: u32,
    max_header: usize,
    what: &str,
) -> Result<(H, &'a [u8]), String> {
    if bytes.len() < 16 || &bytes[..8] != magic {
        return Err(format!("not {what} (bad magic; {} bytes)", bytes.len()));
    }
    let found = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if found != format {
        return Err(format!(
            "format {found} of {what} is not supported (this recsys reads {format})"
        ));
    }
    let header_len = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes")) as usize;
    if header_len > max_header || 16 + header_len > bytes.len() {
        return Err(format!(
            "the header claims {header_len} bytes; there are {} (truncated?)",
            bytes.len()
        ));
    }
    let header = serde_json::from_slice(&bytes[16..16 + header_len])
        .map_err(|e| format!("the header is not valid: {e}"))?;
    Ok((header, &bytes[16 + header_len..]))
}

/// Appends every set's bytes to `payload`, in column then value order, and lists them.
pub(crate) fn write_sets(columns: &Columns, payload: &mut Vec<u8>) -> Vec<SetEntry> {
    let mut entries = Vec::new();
    for (column, values) in columns {
        for (value, set) in values {
            let before = payload.len();
            set.serialize_into(&mut *payload)
                .expect("writing to memory does not fail");
            entries.push(SetEntry {
                column: column.clone(),
                value: value.clone(),
                count: set.len(),
                bytes: payload.len() - before,
            });
        }
    }
    entries
}

/// The sets `entries` list, read from the start of `payload`, every one checked: within the
/// payload, a valid bitmap, its count the header's, every member below `limit` (`unit` names a
/// member in errors: "item", "position"). Returns the sets and the bytes read.
pub(crate) fn read_sets(
    payload: &[u8],
    entries: &[SetEntry],
    limit: usize,
    unit: &str,
) -> Result<(Columns, usize), String> {
    let mut columns = Columns::new();
    let mut at = 0usize;
    for entry in entries {
        let name = format!("{}={}", entry.column, entry.value);
        let end = at
            .checked_add(entry.bytes)
            .filter(|&e| e <= payload.len())
            .ok_or_else(|| {
                format!(
                    "set {name} claims {} bytes past the end (truncated?)",
                    entry.bytes
                )
            })?;
        let set = RoaringBitmap::deserialize_from(&payload[at..end])
            .map_err(|e| format!("set {name} is not a valid bitmap: {e}"))?;
        if set.len() != entry.count {
            return Err(format!(
                "set {name} holds {} items, the header says {}",
                set.len(),
                entry.count
            ));
        }
        if let Some(max) = set.max().filter(|&m| m as usize >= limit) {
            return Err(format!("set {name} names {unit} {max} of {limit}"));
        }
        columns
            .entry(entry.column.clone())
            .or_default()
            .insert(entry.value.clone(), set);
        at = end;
    }
    Ok((columns, at))
}
