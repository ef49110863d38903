//! Named item sets: every value of an item attribute (`category=shoes`, `region=EU`) as the set of
//! the catalogue's items that carry it, and the filters requests build from them.
//!
//! `recsys convert --item-attributes FILE` reads a table keyed by the external item id
//! ([`AttributeTable`]), makes one set per (column, value) and stores them in the engine directory
//! as `item_sets.bin` ([`ITEM_SETS_FILE`], checksummed in the manifest like every file). A
//! request's filter ([`ItemFilter`]) names sets to keep (AND across columns, OR within one) and
//! sets to drop; [`ItemSets::resolve`] turns it into the dense [`ItemMask`] the kernels read.
//!
//! Sets are kept as Roaring bitmaps (`roaring`): a catalogue of a million items with thousands of
//! attribute values would need gigabytes as plain bitsets, and Roaring's union and intersection
//! run over compressed containers. Its serialized form is the portable one every Roaring library
//! reads.
//!
//! `item_sets.bin`:
//! ```text
//! "RSYSSETS" u32-le version (1) u32-le header length | header JSON | each set's Roaring bytes, in header order
//! header: {"items": n, "sets": [{"column": c, "value": v, "count": items, "bytes": b}, ...]}
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use roaring::RoaringBitmap;
use serde::{Deserialize, Serialize};

use crate::idmap::IdMap;
use crate::kernels::item_mask::ItemMask;
use crate::set_file::{self, SetEntry};

/// The file an engine's item sets live in.
pub const ITEM_SETS_FILE: &str = "item_sets.bin";
const MAGIC: &[u8; 8] = b"RSYSSETS";
const VERSION: u32 = 1;
/// A header is a few bytes per set; anything over this is not one.
const MAX_HEADER_BYTES: usize = 256 << 20;

/// The separator of list values in one CSV/TSV cell (`tags`: `sale|new`).
pub const LIST_SEPARATOR: char = '|';

/// A CSV (`.csv`) or tab-separated (any other extension) file with a header row, its rows
/// allowed to be ragged so the caller can refuse one naming its line.
pub(crate) fn delimited_reader(path: &Path) -> Result<csv::Reader<std::fs::File>, String> {
    let delimiter = match path.extension().and_then(|e| e.to_str()) {
        Some(e) if e.eq_ignore_ascii_case("csv") => b',',
        _ => b'\t',
    };
    csv::ReaderBuilder::new()
        .delimiter(delimiter)
        .has_headers(true)
        .flexible(true)
        .from_path(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// An attribute table as read from a file: one row per item, the values of each column (none,
/// one, or a list).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AttributeTable {
    /// Attribute column names (the id column is not one).
    pub columns: Vec<String>,
    /// `(external item id, values per column)`, `values[c]` for `columns[c]`.
    pub rows: Vec<(String, Vec<Vec<String>>)>,
}

impl AttributeTable {
    /// Reads a CSV (`.csv`) or tab-separated (any other extension) table with a header row: the
    /// first column is the external item id, every other one an attribute; empty cells carry no
    /// value; a cell with `|` holds a list.
    pub fn read_delimited(path: &Path) -> Result<AttributeTable, String> {
        let mut reader = delimited_reader(path)?;
        let header = reader
            .headers()
            .map_err(|e| format!("{}: {e}", path.display()))?
            .clone();
        if header.len() < 2 {
            return Err(format!(
                "{}: the header names {} column(s); it needs the item id column and at least one \
                 attribute",
                path.display(),
                header.len()
            ));
        }
        let columns: Vec<String> = header.iter().skip(1).map(str::to_owned).collect();
        let mut table = AttributeTable {
            columns,
            rows: Vec::new(),
        };
        for (line, record) in reader.records().enumerate() {
            let record = record.map_err(|e| format!("{}: {e}", path.display()))?;
            if record.len() != header.len() {
                return Err(format!(
                    "{} row {}: {} fields, the header has {}",
                    path.display(),
                    line + 2,
                    record.len(),
                    header.len()
                ));
            }
            let id = record[0].trim().to_owned();
            let values = record
                .iter()
                .skip(1)
                .map(|cell| {
                    cell.split(LIST_SEPARATOR)
                        .map(str::trim)
                        .filter(|v| !v.is_empty())
                        .map(str::to_owned)
                        .collect()
                })
                .collect();
            table.rows.push((id, values));
        }
        table.check()?;
        Ok(table)
    }

    /// Refuses what no set can be named from: a column name holding `=` or `,`, a value holding
    /// `,` (request fields list names separated by commas), a duplicate column.
    pub fn check(&self) -> Result<(), String> {
        let mut seen = std::collections::BTreeSet::new();
        for c in &self.columns {
            if c.is_empty() || c.contains(['=', ',']) {
                return Err(format!(
                    "attribute column {c:?}: a column name must be non-empty, without '=' or ','"
                ));
            }
            if !seen.insert(c) {
                return Err(format!("attribute column {c:?} appears twice"));
            }
        }
        for (id, values) in &self.rows {
            for (c, list) in values.iter().enumerate() {
                if let Some(v) = list.iter().find(|v| v.contains(',')) {
                    return Err(format!(
                        "item {id}: {}={v:?}: a value cannot hold ',' (filters list set names \
                         separated by commas)",
                        self.columns[c]
                    ));
                }
            }
        }
        Ok(())
    }
}

/// What [`ItemSets::from_table`] did with the table's rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttributeReport {
    /// Rows whose item the catalogue holds.
    pub items: usize,
    /// Rows whose id the catalogue does not know (skipped).
    pub unknown_items: usize,
    /// Sets made.
    pub sets: usize,
}

/// A request's filter: set names (`column=value`) to keep and to drop.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ItemFilter {
    /// Keep only items in these sets: in every column named, in at least one of its sets.
    pub include: Vec<String>,
    /// Drop the items of any of these sets.
    pub exclude: Vec<String>,
}

impl ItemFilter {
    pub fn is_empty(&self) -> bool {
        self.include.is_empty() && self.exclude.is_empty()
    }

    /// The same filter, names sorted and deduplicated (equal filters get equal keys).
    pub fn normalized(&self) -> ItemFilter {
        let norm = |v: &[String]| {
            let mut v = v.to_vec();
            v.sort_unstable();
            v.dedup();
            v
        };
        ItemFilter {
            include: norm(&self.include),
            exclude: norm(&self.exclude),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Header {
    items: usize,
    sets: Vec<SetEntry>,
}

/// The set of a value no item has.
static NO_ITEMS: std::sync::LazyLock<RoaringBitmap> = std::sync::LazyLock::new(RoaringBitmap::new);

/// Named sets of a catalogue's items (internal indices below `items`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ItemSets {
    items: usize,
    columns: BTreeMap<String, BTreeMap<String, RoaringBitmap>>,
}

impl ItemSets {
    /// No set, for an `items`-item catalogue.
    pub fn empty(items: usize) -> Self {
        ItemSets {
            items,
            columns: BTreeMap::new(),
        }
    }

    /// One set per (column, value) of `table`, its ids mapped through `ids`.
    pub fn from_table(
        table: &AttributeTable,
        ids: &IdMap,
    ) -> Result<(ItemSets, AttributeReport), String> {
        table.check()?;
        // Internal indices run 1..=N; 0 is padding.
        let mut sets = ItemSets::empty(ids.len() + 1);
        let mut report = AttributeReport::default();
        for column in &table.columns {
            sets.columns.insert(column.clone(), BTreeMap::new());
        }
        for (id, values) in &table.rows {
            let Some(index) = ids.index_of_str(id) else {
                report.unknown_items += 1;
                continue;
            };
            report.items += 1;
            for (c, list) in values.iter().enumerate() {
                let column = sets
                    .columns
                    .get_mut(&table.columns[c])
                    .expect("every column was added");
                for value in list {
                    column.entry(value.clone()).or_default().insert(index);
                }
            }
        }
        if report.items == 0 && !table.rows.is_empty() {
            return Err(format!(
                "none of the table's {} item ids is in the catalogue (first: {:?}); is the first \
                 column the external item id?",
                table.rows.len(),
                table.rows[0].0
            ));
        }
        report.sets = sets.len();
        Ok((sets, report))
    }

    /// Adds an (empty) attribute column, so a column whose every set is empty is still known.
    pub(crate) fn add_column(&mut self, column: &str) {
        self.columns.entry(column.to_owned()).or_default();
    }

    /// Adds (or replaces) the set `column=value`.
    pub(crate) fn add_set(&mut self, column: &str, value: &str, set: RoaringBitmap) {
        self.columns
            .entry(column.to_owned())
            .or_default()
            .insert(value.to_owned(), set);
    }

    /// Whether `column` is one of the attribute columns.
    pub fn has_column(&self, column: &str) -> bool {
        self.columns.contains_key(column)
    }

    /// The same sets over a catalogue of `items` internal indices (PAD included) that keeps every
    /// index they hold: items a catalogue delta appended belong to no set.
    pub fn grown(&self, items: usize) -> ItemSets {
        ItemSets {
            items,
            columns: self.columns.clone(),
        }
    }

    /// Internal indices the sets index (`0 ..`, PAD included).
    pub fn n_items(&self) -> usize {
        self.items
    }

    /// Number of sets.
    pub fn len(&self) -> usize {
        self.columns.values().map(BTreeMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Column names, sorted.
    pub fn columns(&self) -> impl Iterator<Item = &str> {
        self.columns.keys().map(String::as_str)
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

    /// The set `column=value` (empty when the column exists but no item has the value), or why
    /// there is none: a name that is not `column=value`, or a column that does not exist.
    pub fn get(&self, name: &str) -> Result<&RoaringBitmap, String> {
        let Some((column, value)) = name.split_once('=') else {
            return Err(format!(
                "item set {name:?} is not a set name: sets are named column=value"
            ));
        };
        let Some(values) = self.columns.get(column) else {
            let known: Vec<&str> = self.columns().collect();
            return Err(if known.is_empty() {
                format!("unknown item set {name:?}: this model has no item attributes")
            } else {
                format!(
                    "unknown item set {name:?}: no attribute column {column:?} (columns: {})",
                    known.join(", ")
                )
            });
        };
        // A value no item has today (every item in stock: no `stock=out`) is a set like any
        // other, with no items: a request naming it is answered, not refused.
        Ok(values.get(value).unwrap_or(&NO_ITEMS))
    }

    /// The items `filter` keeps, as a mask over `mask_len` indices (the output layer's rows): in
    /// each column it includes, the union of its sets; the intersection of those; minus every
    /// excluded set; never PAD (0) nor an index past the catalogue. A name whose column does not
    /// exist is refused, naming it; a value no item has is an empty set.
    pub fn resolve(&self, filter: &ItemFilter, mask_len: usize) -> Result<ItemMask, String> {
        resolve_with(self.items, |name| self.get(name), filter, mask_len)
    }

    /// `item_sets.bin`'s bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut payload = Vec::new();
        let sets = set_file::write_sets(&self.columns, &mut payload);
        let header = Header {
            items: self.items,
            sets,
        };
        set_file::write(MAGIC, VERSION, &header, &payload)
    }

    /// Parses `item_sets.bin` for an `items`-item catalogue, checking every length, count and
    /// index against it.
    pub fn from_bytes(bytes: &[u8], items: usize) -> Result<ItemSets, String> {
        let (header, payload): (Header, &[u8]) =
            set_file::read(bytes, MAGIC, VERSION, MAX_HEADER_BYTES, "an item sets file")?;
        if header.items != items {
            return Err(format!(
                "the sets index {} items, the catalogue has {items}",
                header.items
            ));
        }
        let (columns, read) = set_file::read_sets(payload, &header.sets, items, "item")?;
        if read != payload.len() {
            return Err(format!(
                "{} bytes follow the last set (not an item sets file, or a damaged one)",
                payload.len() - read
            ));
        }
        Ok(ItemSets { items, columns })
    }
}

/// [`ItemSets::resolve`] over sets found by `get` (one engine's sets, or its sets overlaid with a
/// live availability object), for an `items`-index catalogue.
pub(crate) fn resolve_with<'a>(
    items: usize,
    get: impl Fn(&str) -> Result<&'a RoaringBitmap, String>,
    filter: &ItemFilter,
    mask_len: usize,
) -> Result<ItemMask, String> {
    let mut by_column: BTreeMap<&str, RoaringBitmap> = BTreeMap::new();
    for name in &filter.include {
        let set = get(name)?;
        let column = name.split_once('=').map_or("", |(c, _)| c);
        *by_column.entry(column).or_default() |= set;
    }
    let mut excluded = RoaringBitmap::new();
    for name in &filter.exclude {
        excluded |= get(name)?;
    }
    let mut columns = by_column.into_values();
    let mask = match columns.next() {
        None => {
            let mut all = ItemMask::all(items);
            all.remove(0);
            for i in &excluded {
                all.remove(i);
            }
            all
        }
        Some(first) => {
            let kept = columns.fold(first, |acc, c| acc & c) - excluded;
            ItemMask::of(items, kept.iter())
        }
    };
    Ok(mask.resized(mask_len))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalogue() -> IdMap {
        IdMap::from_string_ids(
            ["a", "b", "c", "d", "e"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
        )
        .unwrap()
    }

    fn table() -> AttributeTable {
        let row = |id: &str, cat: &[&str], region: &[&str]| {
            (
                id.to_string(),
                vec![
                    cat.iter().map(|s| s.to_string()).collect(),
                    region.iter().map(|s| s.to_string()).collect(),
                ],
            )
        };
        AttributeTable {
            columns: vec!["category".into(), "region".into()],
            rows: vec![
                row("a", &["shoes"], &["EU", "US"]),
                row("b", &["shoes"], &["US"]),
                row("c", &["hats"], &["EU"]),
                row("d", &[], &["EU"]),
                row("zz", &["shoes"], &["EU"]),
            ],
        }
    }

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn filters_and_across_columns_or_within_and_drop_excluded() {
        let (sets, report) = ItemSets::from_table(&table(), &catalogue()).unwrap();
        assert_eq!(
            report,
            AttributeReport {
                items: 4,
                unknown_items: 1,
                sets: 4
            }
        );
        let kept = |include: &[&str], exclude: &[&str]| {
            let filter = ItemFilter {
                include: names(include),
                exclude: names(exclude),
            };
            sets.resolve(&filter, 8)
                .unwrap()
                .indices()
                .collect::<Vec<_>>()
        };
        assert_eq!(kept(&["category=shoes"], &[]), vec![1, 2]);
        assert_eq!(
            kept(&["category=shoes", "category=hats"], &[]),
            vec![1, 2, 3]
        );
        assert_eq!(kept(&["category=shoes", "region=EU"], &[]), vec![1]);
        assert_eq!(kept(&["region=EU"], &["category=hats"]), vec![1, 4]);
        // Exclusions alone keep every other item, never PAD nor the rows past the catalogue.
        assert_eq!(kept(&[], &["region=EU"]), vec![2, 5]);
        // A value of a known column that no item has is an empty set: nothing included, nothing
        // excluded.
        assert_eq!(kept(&["category=boots"], &[]), Vec::<u32>::new());
        assert_eq!(kept(&["category=boots", "category=hats"], &[]), vec![3]);
        assert_eq!(kept(&[], &["category=boots"]), vec![1, 2, 3, 4, 5]);
        assert_eq!(kept(&["region=EU"], &["category=boots"]), vec![1, 3, 4]);
        // A column that exists nowhere, or a name that is not column=value, is refused.
        for bad in ["colour=red", "shoes"] {
            let err = sets
                .resolve(
                    &ItemFilter {
                        include: names(&[bad]),
                        exclude: vec![],
                    },
                    8,
                )
                .unwrap_err();
            assert!(err.contains(bad), "{err}");
        }
    }

    #[test]
    fn the_file_round_trips_and_damage_is_refused() {
        let (sets, _) = ItemSets::from_table(&table(), &catalogue()).unwrap();
        let bytes = sets.to_bytes();
        assert_eq!(ItemSets::from_bytes(&bytes, 6).unwrap(), sets);
        assert!(ItemSets::from_bytes(&bytes, 7)
            .unwrap_err()
            .contains("6 items"));
        for cut in [0, 10, 20, bytes.len() - 1] {
            assert!(
                ItemSets::from_bytes(&bytes[..cut], 6).is_err(),
                "cut at {cut}"
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(ItemSets::from_bytes(&longer, 6)
            .unwrap_err()
            .contains("follow"));
        let mut flipped = bytes.clone();
        let last = flipped.len() - 3;
        flipped[last] ^= 0x40;
        assert!(ItemSets::from_bytes(&flipped, 6).is_err());
    }

    #[test]
    fn delimited_tables_read_lists_and_refuse_ragged_rows() {
        let dir = tempfile::tempdir().unwrap();
        let csv = dir.path().join("attrs.csv");
        std::fs::write(
            &csv,
            "item,category,tags\na,shoes,\"sale|new\"\nb,shoes,\nc,\"hats\",sale\n",
        )
        .unwrap();
        let table = AttributeTable::read_delimited(&csv).unwrap();
        assert_eq!(table.columns, names(&["category", "tags"]));
        assert_eq!(table.rows[0].1[1], names(&["sale", "new"]));
        assert!(table.rows[1].1[1].is_empty());
        let tsv = dir.path().join("attrs.tsv");
        std::fs::write(&tsv, "item\tcategory\na\tshoes\nb\n").unwrap();
        let err = AttributeTable::read_delimited(&tsv).unwrap_err();
        assert!(err.contains("row 3"), "{err}");
        std::fs::write(&tsv, "item\tcat=x\na\tshoes\n").unwrap();
        assert!(AttributeTable::read_delimited(&tsv)
            .unwrap_err()
            .contains("cat=x"));
    }
}
