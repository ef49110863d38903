//! Live availability: item sets that change without a new engine version (`stock=in`,
//! `available_in=EU`), published as one object per model and swapped into a serving engine's
//! filters while it runs ([`crate::filters::Filters::replace_availability`]).
//!
//! The object is keyed by external item ids, not internal indices, so one published object stays
//! valid across engine versions whose catalogues differ: each engine maps the ids it knows when it
//! takes the object in and counts the rest. Every object carries a version number (a newer one
//! replaces an older one, never the reverse) and the SHA-256 of its payload, so an object cut
//! short by a copy or damaged on the way is refused whole instead of serving half its sets.
//!
//! `recsys-availability.bin`:
//! ```text
//! "RSYSAVAL" u32-le format (1) u32-le header length | header JSON | payload
//! header:  {"version": v, "published_unix": t, "ids": n, "id_bytes": b,
//!           "sets": [{"column": c, "value": x, "count": items, "bytes": s}, ...],
//!           "payload_sha256": hex}
//! payload: the n external ids, each followed by '\n' (b bytes) | each set's Roaring bitmap over
//!          id positions (0..n), in header order
//! ```

use std::collections::{BTreeMap, HashMap};

use roaring::RoaringBitmap;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::idmap::IdMap;
use crate::item_sets::{AttributeTable, ItemSets};
use crate::set_file::{self, Columns, SetEntry};

/// The object's name inside a model's folder of a repository (`<model>/recsys-availability.bin`).
pub const AVAILABILITY_OBJECT: &str = "recsys-availability.bin";
const MAGIC: &[u8; 8] = b"RSYSAVAL";
const FORMAT: u32 = 1;
/// A header is a few dozen bytes per set; anything over this is not one.
const MAX_HEADER_BYTES: usize = 64 << 20;

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Header {
    version: u64,
    published_unix: u64,
    ids: usize,
    id_bytes: usize,
    sets: Vec<SetEntry>,
    payload_sha256: String,
}

/// A published availability object: named sets over external item ids.
#[derive(Clone, Debug, PartialEq)]
pub struct AvailabilityFile {
    /// Newer objects carry larger numbers; a server never goes back to a smaller one.
    pub version: u64,
    /// When it was published (seconds since the Unix epoch): what its age is measured from.
    pub published_unix: u64,
    /// External item ids, each once; sets hold positions in this list.
    ids: Vec<String>,
    columns: Columns,
    /// SHA-256 of the payload (hex): equal objects have equal digests.
    sha256: String,
}

impl AvailabilityFile {
    /// One set per (column, value) of `table` (as `recsys convert --item-attributes` makes them),
    /// over the table's ids; rows repeating an id add to its values.
    pub fn from_table(
        table: &AttributeTable,
        version: u64,
        published_unix: u64,
    ) -> Result<AvailabilityFile, String> {
        table.check()?;
        let mut positions: HashMap<&str, u32> = HashMap::new();
        let mut ids = Vec::new();
        let mut columns: BTreeMap<String, BTreeMap<String, RoaringBitmap>> = table
            .columns
            .iter()
            .map(|c| (c.clone(), BTreeMap::new()))
            .collect();
        for (id, values) in &table.rows {
            if id.is_empty() || id.contains('\n') {
                return Err(format!(
                    "item id {id:?} cannot be published (empty, or holding a line break)"
                ));
            }
            let position = *positions.entry(id.as_str()).or_insert_with(|| {
                ids.push(id.clone());
                (ids.len() - 1) as u32
            });
            for (c, list) in values.iter().enumerate() {
                let column = columns
                    .get_mut(&table.columns[c])
                    .expect("every column was added");
                for value in list {
                    column.entry(value.clone()).or_default().insert(position);
                }
            }
        }
        let mut file = AvailabilityFile {
            version,
            published_unix,
            ids,
            columns,
            sha256: String::new(),
        };
        file.sha256 = hex::encode(Sha256::digest(file.payload().0));
        Ok(file)
    }

    /// Items the object names.
    pub fn n_ids(&self) -> usize {
        self.ids.len()
    }

    /// SHA-256 of the payload (hex).
    pub fn sha256(&self) -> &str {
        &self.sha256
    }

    /// `(column=value, items)` for every set, sorted by name.
    pub fn summary(&self) -> Vec<(String, u64)> {
        self.columns
            .iter()
            .flat_map(|(c, values)| {
                values
                    .iter()
                    .map(move |(v, s)| (format!("{c}={v}"), s.len()))
            })
            .collect()
    }

    /// The payload's bytes, the ids' share of them, and each set's header entry.
    fn payload(&self) -> (Vec<u8>, usize, Vec<SetEntry>) {
        let mut payload = Vec::new();
        for id in &self.ids {
            payload.extend_from_slice(id.as_bytes());
            payload.push(b'\n');
        }
        let id_bytes = payload.len();
        let entries = set_file::write_sets(&self.columns, &mut payload);
        (payload, id_bytes, entries)
    }

    /// The object's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let (payload, id_bytes, sets) = self.payload();
        let header = Header {
            version: self.version,
            published_unix: self.published_unix,
            ids: self.ids.len(),
            id_bytes,
            sets,
            payload_sha256: hex::encode(Sha256::digest(&payload)),
        };
        set_file::write(MAGIC, FORMAT, &header, &payload)
    }

    /// The version, publication time and digest of an object, from its header alone (no set is
    /// parsed): what `recsys availability publish` compares a new object against.
    pub fn peek(bytes: &[u8]) -> Result<(u64, u64, String), String> {
        let (header, _) = header_of(bytes)?;
        Ok((header.version, header.published_unix, header.payload_sha256))
    }

    /// Parses and checks an object: its length against the header, its payload against the
    /// header's digest, then every id, count and position. Anything short, long or altered is
    /// refused with the reason.
    pub fn from_bytes(bytes: &[u8]) -> Result<AvailabilityFile, String> {
        let (header, payload) = header_of(bytes)?;
        let expected = header
            .sets
            .iter()
            .try_fold(header.id_bytes, |sum, s| sum.checked_add(s.bytes))
            .ok_or("the header's lengths overflow")?;
        if payload.len() != expected {
            return Err(format!(
                "the payload holds {} bytes, the header announces {expected} ({})",
                payload.len(),
                if payload.len() < expected {
                    "truncated"
                } else {
                    "bytes follow the last set"
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
        let ids: Vec<String> = match id_text.strip_suffix('\n') {
            Some(body) => body.split('\n').map(str::to_owned).collect(),
            None if id_text.is_empty() => Vec::new(),
            None => return Err("the item id list does not end with a line break".into()),
        };
        if ids.len() != header.ids {
            return Err(format!(
                "the object lists {} item ids, the header says {}",
                ids.len(),
                header.ids
            ));
        }
        let (columns, _) = set_file::read_sets(
            &payload[header.id_bytes..],
            &header.sets,
            ids.len(),
            "position",
        )?;
        Ok(AvailabilityFile {
            version: header.version,
            published_unix: header.published_unix,
            ids,
            columns,
            sha256: digest,
        })
    }

    /// The sets over `ids`' internal indices: what an engine filters by. Ids the catalogue does
    /// not know are left out and counted (catalogues and stock feeds are updated apart).
    pub fn map(&self, ids: &IdMap) -> Availability {
        let index_of: Vec<Option<u32>> = self.ids.iter().map(|id| ids.index_of_str(id)).collect();
        let mut sets = ItemSets::empty(ids.len() + 1);
        for (column, values) in &self.columns {
            sets.add_column(column);
            for (value, positions) in values {
                let indices: RoaringBitmap = positions
                    .iter()
                    .filter_map(|p| index_of[p as usize])
                    .collect();
                sets.add_set(column, value, indices);
            }
        }
        Availability {
            version: self.version,
            published_unix: self.published_unix,
            sha256: self.sha256.clone(),
            known_items: index_of.iter().filter(|i| i.is_some()).count(),
            unknown_items: index_of.iter().filter(|i| i.is_none()).count(),
            sets,
            object: std::sync::Arc::new(self.clone()),
        }
    }
}

/// The header and the payload after it, with the framing checked.
/// The bytes of availability object a server reads at most by default: 16 MiB, plus 512 bytes per
/// item of its catalogue (an id and its memberships take a few dozen; a feed may also list items
/// the model does not know). A larger object is refused from its size alone, before it is read,
/// so a wrong or runaway object at the key cannot exhaust a server's memory.
pub fn default_max_availability_bytes(catalogue_items: usize) -> u64 {
    (16 << 20) + 512 * catalogue_items as u64
}

impl AvailabilityFile {
    /// Checks the first bytes of an object of `size` bytes as they arrive, before the rest is
    /// read: `Ok(Some(n))` while it needs the first `n` bytes, `Ok(None)` once the magic, the
    /// format and the header are good and the sizes the header announces add up to `size`; an
    /// error naming the problem otherwise (not an availability object, another format, a header
    /// that does not parse, an object cut short or with bytes after its last set).
    pub fn check_head(prefix: &[u8], size: u64) -> Result<Option<usize>, String> {
        if size < 16 {
            return Err(format!("not an availability object ({size} bytes)"));
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
        let mut announced = (16 + header_len).checked_add(header.id_bytes);
        for set in &header.sets {
            announced = announced.and_then(|a| a.checked_add(set.bytes));
        }
        let announced = announced.ok_or("the header's lengths overflow")?;
        if announced as u64 != size {
            return Err(format!(
                "the header announces {announced} bytes, the object holds {size} ({})",
                if (announced as u64) > size {
                    "truncated"
                } else {
                    "bytes follow the last set"
                }
            ));
        }
        Ok(None)
    }
}

fn header_of(bytes: &[u8]) -> Result<(Header, &[u8]), String> {
    set_file::read(
        bytes,
        MAGIC,
        FORMAT,
        MAX_HEADER_BYTES,
        "an availability object",
    )
}

/// An availability object mapped onto one engine's catalogue.
#[derive(Clone, Debug, PartialEq)]
pub struct Availability {
    pub version: u64,
    pub published_unix: u64,
    /// The object's payload digest (two objects with one version and different digests are two
    /// different publications).
    pub sha256: String,
    /// The object's ids this catalogue holds.
    pub known_items: usize,
    /// The object's ids this catalogue does not hold (left out).
    pub unknown_items: usize,
    /// The sets, over internal indices.
    pub sets: ItemSets,
    /// The object these sets were mapped from: what a catalogue swap maps again onto the new
    /// catalogue, so the availability in force survives it.
    pub object: std::sync::Arc<AvailabilityFile>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> AttributeTable {
        let row = |id: &str, stock: &[&str], region: &[&str]| {
            (
                id.to_string(),
                vec![
                    stock.iter().map(|s| s.to_string()).collect(),
                    region.iter().map(|s| s.to_string()).collect(),
                ],
            )
        };
        AttributeTable {
            columns: vec!["stock".into(), "available_in".into()],
            rows: vec![
                row("a", &["in"], &["EU", "US"]),
                row("b", &["out"], &[]),
                row("zz", &["in"], &["EU"]),
                row("c", &["in"], &["US"]),
                row("a", &[], &["JP"]),
            ],
        }
    }

    fn catalogue() -> IdMap {
        IdMap::from_string_ids(["a", "b", "c", "d"].iter().map(|s| s.to_string()).collect())
            .unwrap()
    }

    #[test]
    fn an_object_round_trips_and_maps_onto_a_catalogue() {
        let file = AvailabilityFile::from_table(&table(), 7, 1_700_000_000).unwrap();
        let bytes = file.to_bytes();
        let read = AvailabilityFile::from_bytes(&bytes).unwrap();
        assert_eq!(read, file);
        assert_eq!(
            AvailabilityFile::peek(&bytes).unwrap(),
            (7, 1_700_000_000, file.sha256().to_string())
        );
        assert_eq!(read.n_ids(), 4);
        let live = read.map(&catalogue());
        assert_eq!((live.known_items, live.unknown_items), (3, 1));
        let set = |name: &str| live.sets.get(name).unwrap().iter().collect::<Vec<_>>();
        // a=1, b=2, c=3; zz is not in the catalogue; a's repeated row adds JP.
        assert_eq!(set("stock=in"), vec![1, 3]);
        assert_eq!(set("stock=out"), vec![2]);
        assert_eq!(set("available_in=EU"), vec![1]);
        assert_eq!(set("available_in=US"), vec![1, 3]);
        assert_eq!(set("available_in=JP"), vec![1]);
        assert_eq!(live.sets.n_items(), 5);
    }

    #[test]
    fn the_head_of_an_object_is_checked_as_it_arrives() {
        let bytes = AvailabilityFile::from_table(&table(), 1, 0)
            .unwrap()
            .to_bytes();
        let size = bytes.len() as u64;
        let header_end = 16 + u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
        // Prefixes ask for the bytes they lack, then the head is accepted before the payload.
        assert_eq!(
            AvailabilityFile::check_head(&bytes[..5], size),
            Ok(Some(16))
        );
        assert_eq!(
            AvailabilityFile::check_head(&bytes[..16], size),
            Ok(Some(header_end))
        );
        assert_eq!(
            AvailabilityFile::check_head(&bytes[..header_end], size),
            Ok(None)
        );
        // Not an object, another format, and sizes that do not add up are named at once.
        let mut garbage = bytes.clone();
        garbage[..8].copy_from_slice(b"GARBAGE!");
        let err = AvailabilityFile::check_head(&garbage[..16], size).unwrap_err();
        assert!(err.contains("bad magic"), "{err}");
        let err = AvailabilityFile::check_head(&bytes[..header_end], size - 1).unwrap_err();
        assert!(err.contains("truncated"), "{err}");
        let err = AvailabilityFile::check_head(&bytes[..header_end], size + 1).unwrap_err();
        assert!(err.contains("follow the last set"), "{err}");
        let err = AvailabilityFile::check_head(&bytes[..16], 20).unwrap_err();
        assert!(err.contains("truncated"), "{err}");
        assert!(AvailabilityFile::check_head(b"", 3).is_err());
        assert!(default_max_availability_bytes(1_000_000) > 500_000_000);
    }

    #[test]
    fn cut_extended_or_altered_objects_are_refused() {
        let bytes = AvailabilityFile::from_table(&table(), 1, 0)
            .unwrap()
            .to_bytes();
        for cut in [0, 7, 15, 16, 40, bytes.len() / 2, bytes.len() - 1] {
            assert!(
                AvailabilityFile::from_bytes(&bytes[..cut]).is_err(),
                "cut at {cut}"
            );
        }
        let mut longer = bytes.clone();
        longer.push(b'x');
        let err = AvailabilityFile::from_bytes(&longer).unwrap_err();
        assert!(err.contains("follow"), "{err}");
        // Any flipped payload byte fails the digest (or the framing before it).
        let header_end = 16 + u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
        for at in header_end..bytes.len() {
            let mut altered = bytes.clone();
            altered[at] ^= 0x01;
            assert!(AvailabilityFile::from_bytes(&altered).is_err(), "byte {at}");
        }
        let err = AvailabilityFile::from_bytes(&bytes[..bytes.len() - 3]).unwrap_err();
        assert!(err.contains("truncated"), "{err}");
        assert!(AvailabilityFile::from_bytes(b"item,stock\na,in\n")
            .unwrap_err()
            .contains("magic"));
    }

    #[test]
    fn ids_that_cannot_be_listed_are_refused() {
        let mut bad = table();
        bad.rows[0].0 = "a\nb".into();
        assert!(AvailabilityFile::from_table(&bad, 1, 0).is_err());
        bad.rows[0].0 = String::new();
        assert!(AvailabilityFile::from_table(&bad, 1, 0).is_err());
    }
}
