//! The published form of a catalogue delta ([`crate::catalogue`]): one object per model that every
//! replica polls and swaps in while it serves.
//!
//! The object names the engine it was made for (the SHA-256 of the engine's weights file), since
//! a delta is every change since that engine was converted: a replica serving another engine
//! version refuses it rather than apply rows to tables they were not made for. Like the
//! availability object it carries a version (a newer one replaces an older one, never the
//! reverse) and the SHA-256 of its payload, so an object cut short or damaged is refused whole.
//!
//! `recsys-catalogue.bin`:
//! ```text
//! "RSYSCATL" u32-le format (1) u32-le header length | header JSON | payload
//! header:  {"version": v, "published_unix": t, "engine_sha256": hex, "rows": n,
//!           "vector_width": d+1, "input_width": w or null, "id_bytes": b, "vectors": m,
//!           "inputs": j, "payload_sha256": hex}
//! payload: the n external ids, each followed by '\n' (b bytes) | one flags byte per row
//!          (bit 0: retire, bit 1: has a vector, bit 2: has an input row) | the m vectors,
//!          d+1 f32-le each, in row order | the j input rows, w f32-le each, in row order
//! ```

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::catalogue::{CatalogueDelta, ItemOp, ItemRow};
use crate::idmap::{ExternalId, IdType};
use crate::set_file;

/// The object's name inside a model's folder of a repository (`<model>/recsys-catalogue.bin`).
pub const CATALOGUE_OBJECT: &str = "recsys-catalogue.bin";
const MAGIC: &[u8; 8] = b"RSYSCATL";
const FORMAT: u32 = 1;
/// The header is a few hundred bytes; anything over this is not one.
const MAX_HEADER_BYTES: usize = 1 << 20;

const RETIRE: u8 = 1;
const HAS_VECTOR: u8 = 2;
const HAS_INPUT: u8 = 4;

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Header {
    version: u64,
    published_unix: u64,
    engine_sha256: String,
    rows: usize,
    vector_width: usize,
    input_width: Option<usize>,
    id_bytes: usize,
    vectors: usize,
    inputs: usize,
    payload_sha256: String,
}

impl Header {
    /// Bytes of the payload the header announces (`None` when the sizes overflow).
    fn payload_bytes(&self) -> Option<usize> {
        let vectors = self
            .vectors
            .checked_mul(self.vector_width)?
            .checked_mul(4)?;
        let inputs = self
            .inputs
            .checked_mul(self.input_width.unwrap_or(0))?
            .checked_mul(4)?;
        self.id_bytes
            .checked_add(self.rows)?
            .checked_add(vectors)?
            .checked_add(inputs)
    }
}

/// A published catalogue delta, as read from or written to its object.
#[derive(Clone, Debug, PartialEq)]
pub struct CatalogueFile {
    pub delta: CatalogueDelta,
    /// When it was published (seconds since the Unix epoch).
    pub published_unix: u64,
    /// The SHA-256 of the weights file of the engine the delta was made for.
    pub engine_sha256: String,
    /// Values per vector (`[embedding, bias]`) and per input row.
    pub vector_width: usize,
    pub input_width: Option<usize>,
    /// SHA-256 of the payload (hex).
    pub sha256: String,
}

/// Bytes a server reads of a catalogue object at most by default: 16 MiB, plus room for every
/// item of its catalogue changed twice over (a delta holds each item once; new items add to it).
pub fn default_max_catalogue_bytes(catalogue_items: usize, row_bytes: usize) -> u64 {
    (16u64 << 20).saturating_add(
        2u64.saturating_mul(catalogue_items as u64)
            .saturating_mul(row_bytes as u64 + 64),
    )
}

impl CatalogueFile {
    /// The object of `delta` for the engine whose weights file has digest `engine_sha256`, with
    /// rows `vector_width` (and `input_width`) values wide; every row must have those widths.
    pub fn new(
        delta: CatalogueDelta,
        published_unix: u64,
        engine_sha256: &str,
        vector_width: usize,
        input_width: Option<usize>,
    ) -> Result<CatalogueFile, String> {
        for row in &delta.rows {
            let id = &row.id;
            if let Some(v) = &row.vector {
                if v.len() != vector_width {
                    return Err(format!(
                        "item {id}: vector holds {} values, the engine's take {vector_width}",
                        v.len()
                    ));
                }
            }
            match (&row.input_vector, input_width) {
                (Some(v), Some(w)) if v.len() != w => {
                    return Err(format!(
                        "item {id}: input_vector holds {} values, the engine's input rows take {w}",
                        v.len()
                    ))
                }
                (Some(_), None) => {
                    return Err(format!(
                        "item {id}: input_vector given, but the object has no input rows"
                    ))
                }
                _ => {}
            }
            let text = match id {
                ExternalId::Int(i) => i.to_string(),
                ExternalId::Str(s) => s.clone(),
            };
            if text.contains(['\n', '\r']) || text.is_empty() {
                return Err(format!("item id {id} is empty or holds a line break"));
            }
        }
        let mut file = CatalogueFile {
            delta,
            published_unix,
            engine_sha256: engine_sha256.to_string(),
            vector_width,
            input_width,
            sha256: String::new(),
        };
        file.sha256 = hex::encode(Sha256::digest(file.payload().0));
        Ok(file)
    }

    /// The payload's bytes and the ids' share of them.
    fn payload(&self) -> (Vec<u8>, usize) {
        let mut payload = Vec::new();
        for row in &self.delta.rows {
            match &row.id {
                ExternalId::Int(i) => payload.extend_from_slice(i.to_string().as_bytes()),
                ExternalId::Str(s) => payload.extend_from_slice(s.as_bytes()),
            }
            payload.push(b'\n');
        }
        let id_bytes = payload.len();
        for row in &self.delta.rows {
            let mut flags = 0;
            if row.op == ItemOp::Retire {
                flags |= RETIRE;
            }
            if row.vector.is_some() {
                flags |= HAS_VECTOR;
            }
            if row.input_vector.is_some() {
                flags |= HAS_INPUT;
            }
            payload.push(flags);
        }
        for vector in self.delta.rows.iter().filter_map(|r| r.vector.as_ref()) {
            payload.extend(vector.iter().flat_map(|v| v.to_le_bytes()));
        }
        for input in self
            .delta
            .rows
            .iter()
            .filter_map(|r| r.input_vector.as_ref())
        {
            payload.extend(input.iter().flat_map(|v| v.to_le_bytes()));
        }
        (payload, id_bytes)
    }

    /// The object's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let (payload, id_bytes) = self.payload();
        let rows = &self.delta.rows;
        let header = Header {
            version: self.delta.version,
            published_unix: self.published_unix,
            engine_sha256: self.engine_sha256.clone(),
            rows: rows.len(),
            vector_width: self.vector_width,
            input_width: self.input_width,
            id_bytes,
            vectors: rows.iter().filter(|r| r.vector.is_some()).count(),
            inputs: rows.iter().filter(|r| r.input_vector.is_some()).count(),
            payload_sha256: self.sha256.clone(),
        };
        set_file::write(MAGIC, FORMAT, &header, &payload)
    }

    /// The version, engine digest and payload digest of an object, from its header alone: what
    /// `recsys catalogue publish` compares a new object against.
    pub fn peek(bytes: &[u8]) -> Result<(u64, String, String), String> {
        let (header, _) = header_of(bytes)?;
        Ok((header.version, header.engine_sha256, header.payload_sha256))
    }

    /// Parses and checks an object: its length against the header, its payload against the
    /// header's digest, then every id and flag. Ids are read as the catalogue's `id_type`.
    /// Anything short, long or altered is refused with the reason.
    pub fn from_bytes(bytes: &[u8], id_type: IdType) -> Result<CatalogueFile, String> {
        let (header, payload) = header_of(bytes)?;
        let expected = header
            .payload_bytes()
            .ok_or("the header's sizes overflow")?;
        if payload.len() != expected {
            return Err(format!(
                "the payload holds {} bytes, the header announces {expected} ({})",
                payload.len(),
                if payload.len() < expected {
                    "truncated"
                } else {
                    "bytes follow the last row"
                }
            ));
        }
        let digest = hex::encode(Sha256::digest(payload));
        if digest != header.payload_sha256 {
            return Err(format!(
                "the payload's SHA-256 is {digest}, the header says {} (damaged in transit or \
                 written over while being read)",
                header.payload_sha256
            ));
        }
        let id_text = std::str::from_utf8(&payload[..header.id_bytes])
            .map_err(|e| format!("the item ids are not UTF-8: {e}"))?;
        let ids: Vec<&str> = match id_text.strip_suffix('\n') {
            Some(body) => body.split('\n').collect(),
            None if id_text.is_empty() => Vec::new(),
            None => return Err("the item id list does not end with a line break".into()),
        };
        if ids.len() != header.rows {
            return Err(format!(
                "the object lists {} item ids, the header says {} rows",
                ids.len(),
                header.rows
            ));
        }
        let flags = &payload[header.id_bytes..header.id_bytes + header.rows];
        let with_vector = flags.iter().filter(|&&f| f & HAS_VECTOR != 0).count();
        let with_input = flags.iter().filter(|&&f| f & HAS_INPUT != 0).count();
        if with_vector != header.vectors || with_input != header.inputs {
            return Err(format!(
                "the rows' flags mark {with_vector} vectors and {with_input} input rows, the \
                 header says {} and {}",
                header.vectors, header.inputs
            ));
        }
        if let Some(f) = flags
            .iter()
            .find(|&&f| f & !(RETIRE | HAS_VECTOR | HAS_INPUT) != 0)
        {
            return Err(format!("a row's flags byte is {f:#04x}, which no row has"));
        }
        let floats = |from: usize, count: usize| -> Vec<f32> {
            payload[from..from + 4 * count]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        };
        let mut vector_at = header.id_bytes + header.rows;
        let mut input_at = vector_at + 4 * header.vectors * header.vector_width;
        let input_width = header.input_width.unwrap_or(0);
        let mut rows = Vec::with_capacity(header.rows);
        for (text, &flag) in ids.into_iter().zip(flags) {
            let id = match id_type {
                IdType::Int64 => ExternalId::Int(text.parse::<i64>().map_err(|_| {
                    format!("item id {text:?} is not an integer; the engine's ids are int64")
                })?),
                IdType::String => ExternalId::Str(text.to_string()),
            };
            let vector = (flag & HAS_VECTOR != 0).then(|| {
                let v = floats(vector_at, header.vector_width);
                vector_at += 4 * header.vector_width;
                v
            });
            let input_vector = (flag & HAS_INPUT != 0).then(|| {
                let v = floats(input_at, input_width);
                input_at += 4 * input_width;
                v
            });
            rows.push(ItemRow {
                id,
                op: if flag & RETIRE != 0 {
                    ItemOp::Retire
                } else {
                    ItemOp::Upsert
                },
                vector,
                input_vector,
            });
        }
        Ok(CatalogueFile {
            delta: CatalogueDelta {
                version: header.version,
                rows,
            },
            published_unix: header.published_unix,
            engine_sha256: header.engine_sha256,
            vector_width: header.vector_width,
            input_width: header.input_width,
            sha256: digest,
        })
    }

    /// Checks the first bytes of an object of `size` bytes as they arrive, before the rest is
    /// read: `Ok(Some(n))` while it needs the first `n` bytes, `Ok(None)` once the magic, the
    /// format and the header are good and the sizes it announces add up to `size`; an error
    /// naming the problem otherwise.
    pub fn check_head(prefix: &[u8], size: u64) -> Result<Option<usize>, String> {
        if size < 16 {
            return Err(format!("not a catalogue object ({size} bytes)"));
        }
        if prefix.len() < 16 {
            return Ok(Some(16));
        }
        let header_len = u32::from_le_bytes(prefix[12..16].try_into().expect("4 bytes")) as usize;
        if &prefix[..8] == MAGIC && header_len <= MAX_HEADER_BYTES && prefix.len() < 16 + header_len
        {
            if 16 + header_len as u64 > size {
                return Err(format!(
                    "the header claims {header_len} bytes; the object holds {size} (truncated?)"
                ));
            }
            return Ok(Some(16 + header_len));
        }
        let (header, _) = header_of(prefix)?;
        let announced = header
            .payload_bytes()
            .and_then(|p| p.checked_add(16 + header_len))
            .ok_or("the header's sizes overflow")?;
        if announced as u64 != size {
            return Err(format!(
                "the header announces {announced} bytes, the object holds {size} ({})",
                if (announced as u64) > size {
                    "truncated"
                } else {
                    "bytes follow the last row"
                }
            ));
        }
        Ok(None)
    }
}

fn header_of(bytes: &[u8]) -> Result<(Header, &[u8]), String> {
    set_file::read(bytes, MAGIC, FORMAT, MAX_HEADER_BYTES, "a catalogue object")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CatalogueFile {
        let rows = vec![
            ItemRow {
                id: ExternalId::Int(10),
                op: ItemOp::Upsert,
                vector: Some(vec![0.5, -1.0, 2.0]),
                input_vector: Some(vec![1.0, 2.0]),
            },
            ItemRow {
                id: ExternalId::Int(-3),
                op: ItemOp::Retire,
                vector: None,
                input_vector: None,
            },
            ItemRow {
                id: ExternalId::Int(77),
                op: ItemOp::Retire,
                vector: Some(vec![f32::MIN_POSITIVE, 0.0, -0.0]),
                input_vector: Some(vec![3.0, 4.0]),
            },
        ];
        CatalogueFile::new(
            CatalogueDelta { version: 4, rows },
            1_700_000_000,
            "ab12",
            3,
            Some(2),
        )
        .unwrap()
    }

    #[test]
    fn an_object_reads_back_as_written_and_checks_its_head() {
        let file = sample();
        let bytes = file.to_bytes();
        let back = CatalogueFile::from_bytes(&bytes, IdType::Int64).unwrap();
        assert_eq!(back, file);
        assert_eq!(
            CatalogueFile::peek(&bytes).unwrap(),
            (4, "ab12".to_string(), file.sha256.clone())
        );
        // Read as a string catalogue, the same rows with their ids as text.
        let strings = CatalogueFile::from_bytes(&bytes, IdType::String).unwrap();
        assert_eq!(strings.delta.rows[1].id, ExternalId::Str("-3".into()));
        // The head check passes the whole object, asks for the header, and refuses a wrong size.
        assert_eq!(
            CatalogueFile::check_head(&bytes[..4], bytes.len() as u64),
            Ok(Some(16))
        );
        let needed = CatalogueFile::check_head(&bytes[..16], bytes.len() as u64)
            .unwrap()
            .unwrap();
        assert_eq!(
            CatalogueFile::check_head(&bytes[..needed], bytes.len() as u64),
            Ok(None)
        );
        let err = CatalogueFile::check_head(&bytes[..needed], bytes.len() as u64 + 1).unwrap_err();
        assert!(err.contains("bytes follow the last row"), "{err}");
    }

    #[test]
    fn every_cut_extension_and_flipped_payload_byte_is_refused() {
        let bytes = sample().to_bytes();
        for len in 0..bytes.len() {
            assert!(
                CatalogueFile::from_bytes(&bytes[..len], IdType::Int64).is_err(),
                "cut at {len}"
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        let err = CatalogueFile::from_bytes(&longer, IdType::Int64).unwrap_err();
        assert!(err.contains("bytes follow"), "{err}");
        let header_len = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
        for at in 16 + header_len..bytes.len() {
            let mut flipped = bytes.clone();
            flipped[at] ^= 0x20;
            let err = CatalogueFile::from_bytes(&flipped, IdType::Int64).unwrap_err();
            assert!(err.contains("SHA-256"), "byte {at}: {err}");
        }
        let err =
            CatalogueFile::from_bytes(b"RSYSAVAL\x01\0\0\0\0\0\0\0", IdType::Int64).unwrap_err();
        assert!(err.contains("not a catalogue object"), "{err}");
    }

    #[test]
    fn rows_of_the_wrong_width_are_refused_when_the_object_is_made() {
        let mut delta = sample().delta;
        delta.rows[0].vector = Some(vec![1.0]);
        let err = CatalogueFile::new(delta, 0, "ab", 3, Some(2)).unwrap_err();
        assert!(err.contains("item 10: vector holds 1 values"), "{err}");
    }
}
