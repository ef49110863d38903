//! The mapping between a catalogue's own item ids (external: int64 or strings) and the model's
//! internal indices 1..=N (0 is PAD).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;

use crate::error::{EngineError, Result};

/// External ids of one request, as they arrive.
#[derive(Clone, Copy, Debug)]
pub enum ExternalIds<'a> {
    Int(&'a [i64]),
    Str(&'a [&'a str]),
}

impl ExternalIds<'_> {
    pub fn len(&self) -> usize {
        match self {
            ExternalIds::Int(v) => v.len(),
            ExternalIds::Str(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One external id.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ExternalId {
    Int(i64),
    Str(String),
}

impl std::fmt::Display for ExternalId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExternalId::Int(i) => write!(f, "{i}"),
            ExternalId::Str(s) => write!(f, "{s:?}"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IdType {
    Int64,
    String,
}

#[derive(Clone, Debug)]
enum Ids {
    Int {
        by_index: Vec<i64>,
        lookup: IntLookup,
    },
    Str {
        by_index: Vec<String>,
        lookup: HashMap<String, u32>,
    },
}

/// External int64 id -> internal index. Requests carry up to thousands of ids (histories,
/// exclusions, a retrieval stage's candidates), so this sits on the serving path: a hash lookup
/// into a million-item map is a cache miss plus hashing (~200 ns measured), while most catalogues
/// number their items in a compact range, where one table read answers.
#[derive(Clone, Debug)]
enum IntLookup {
    /// Ids within `min..min + slots.len()`: `slots[id - min]` is the index, 0 = not an item.
    Dense {
        min: i64,
        slots: Vec<u32>,
    },
    Hashed(HashMap<i64, u32>),
}

impl IntLookup {
    /// A dense table when the ids span at most this many slots per item (4 bytes each), so it never
    /// takes more than a few times the hash map's memory.
    const MAX_SLOTS_PER_ITEM: usize = 4;

    /// Refuses an id that appears twice (the error holds it).
    fn new(by_index: &[i64]) -> Result<IntLookup, i64> {
        let (Some(&min), Some(&max)) = (by_index.iter().min(), by_index.iter().max()) else {
            return Ok(IntLookup::Hashed(HashMap::new()));
        };
        let span = (max as i128 - min as i128 + 1) as u128;
        let limit = (Self::MAX_SLOTS_PER_ITEM * by_index.len() + 1024) as u128;
        if span <= limit {
            let mut slots = vec![0u32; span as usize];
            for (i, &id) in by_index.iter().enumerate() {
                let slot = &mut slots[(id - min) as usize];
                if *slot != 0 {
                    return Err(id);
                }
                *slot = i as u32 + 1;
            }
            return Ok(IntLookup::Dense { min, slots });
        }
        let mut lookup = HashMap::with_capacity(by_index.len());
        for (i, &id) in by_index.iter().enumerate() {
            if lookup.insert(id, i as u32 + 1).is_some() {
                return Err(id);
            }
        }
        Ok(IntLookup::Hashed(lookup))
    }

    fn get(&self, id: i64) -> Option<u32> {
        match self {
            IntLookup::Dense { min, slots } => {
                let offset = usize::try_from(id.checked_sub(*min)?).ok()?;
                slots.get(offset).copied().filter(|&i| i != 0)
            }
            IntLookup::Hashed(lookup) => lookup.get(&id).copied(),
        }
    }
}

/// Where a conversion takes its item map from.
#[derive(Clone, Copy, Debug)]
pub enum ItemMapSource<'a> {
    /// A TSV of `internal_index<TAB>external_id` lines ([`IdMap::read_tsv`]).
    Tsv(&'a Path),
    /// The dataset or dataloaders file RecBole saved (`save_dataset` / `save_dataloaders`), whose
    /// `field2id_token` is the map; read as data ([`crate::import::recbole_dataset`]).
    RecboleDataset(&'a Path),
}

impl ItemMapSource<'_> {
    /// Reads the map; a RecBole file larger than `max_bytes` is refused unread.
    pub fn read(&self, max_bytes: u64) -> Result<IdMap> {
        match *self {
            ItemMapSource::Tsv(path) => IdMap::read_tsv(path),
            ItemMapSource::RecboleDataset(path) => {
                let tokens = crate::import::recbole_dataset::read_item_tokens(path, max_bytes)?;
                IdMap::from_tokens(&tokens).map_err(|reason| EngineError::IdMap {
                    path: path.to_path_buf(),
                    reason: format!("RecBole's item tokens: {reason}"),
                })
            }
        }
    }

    pub fn path(&self) -> &Path {
        match *self {
            ItemMapSource::Tsv(path) | ItemMapSource::RecboleDataset(path) => path,
        }
    }
}

/// Item id map for N items. Index `i` (1-based) maps to `by_index[i - 1]`.
#[derive(Clone, Debug)]
pub struct IdMap {
    ids: Ids,
}

/// What happened to a request's ids.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Mapped {
    pub indices: Vec<u32>,
    /// How many ids were not in the catalogue (and were dropped).
    pub unknown: usize,
}

impl IdMap {
    /// Reads `internal_index <TAB> external_id` lines (an optional header line is skipped). Indices
    /// must be exactly 1..=N, each once, and external ids unique. External ids are int64 if every one
    /// parses as an integer, strings otherwise.
    pub fn read_tsv(path: &Path) -> Result<IdMap> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                EngineError::NotFound {
                    path: path.to_path_buf(),
                }
            } else {
                EngineError::io(format!("cannot read {}", path.display()), e)
            }
        })?;
        Self::parse_tsv(&text).map_err(|reason| EngineError::IdMap {
            path: path.to_path_buf(),
            reason,
        })
    }

    pub fn parse_tsv(text: &str) -> Result<IdMap, String> {
        let mut rows: Vec<(usize, &str)> = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim_end_matches('\r');
            if line.is_empty() {
                continue;
            }
            let Some((index, external)) = line.split_once('\t') else {
                return Err(format!("line {}: expected 'index<TAB>external_id'", n + 1));
            };
            match index.trim().parse::<usize>() {
                Ok(i) => rows.push((i, external)),
                Err(_) if n == 0 => continue, // header
                Err(_) => return Err(format!("line {}: index {index:?} is not an integer", n + 1)),
            }
        }
        if rows.is_empty() {
            return Err("no items".into());
        }
        let n = rows.len();
        let mut slots: Vec<Option<&str>> = vec![None; n];
        for &(i, ext) in &rows {
            if i == 0 || i > n {
                return Err(format!(
                    "index {i} is outside 1..={n} (0 is reserved for padding; indices must be contiguous)"
                ));
            }
            if slots[i - 1].replace(ext).is_some() {
                return Err(format!("index {i} appears twice"));
            }
        }
        let externals: Vec<&str> = slots.into_iter().map(|s| s.expect("all filled")).collect();
        IdMap::from_tokens(&externals)
    }

    /// Builds a map from the external ids of items 1..=N as text, in order: int64 ids if every one
    /// parses as an integer, strings otherwise (the rule of [`IdMap::parse_tsv`], and of a RecBole
    /// dataset's item tokens).
    pub fn from_tokens<S: AsRef<str>>(tokens: &[S]) -> Result<IdMap, String> {
        let ints: Option<Vec<i64>> = tokens
            .iter()
            .map(|s| s.as_ref().parse::<i64>().ok())
            .collect();
        match ints {
            Some(ints) => IdMap::from_int_ids(ints),
            None => IdMap::from_string_ids(tokens.iter().map(|s| s.as_ref().to_owned()).collect()),
        }
    }

    /// Builds a map from the external ids of items 1..=N, in order.
    pub fn from_int_ids(by_index: Vec<i64>) -> Result<IdMap, String> {
        let lookup =
            IntLookup::new(&by_index).map_err(|id| format!("external id {id} appears twice"))?;
        Ok(IdMap {
            ids: Ids::Int { by_index, lookup },
        })
    }

    pub fn from_string_ids(by_index: Vec<String>) -> Result<IdMap, String> {
        let mut lookup = HashMap::with_capacity(by_index.len());
        for (i, id) in by_index.iter().enumerate() {
            if id.contains(['\t', '\n', '\r']) {
                return Err(format!("external id {id:?} contains a tab or newline"));
            }
            if lookup.insert(id.clone(), i as u32 + 1).is_some() {
                return Err(format!("external id {id:?} appears twice"));
            }
        }
        Ok(IdMap {
            ids: Ids::Str { by_index, lookup },
        })
    }

    /// This map followed by `new` ids (items N+1, N+2, ...), which must be of the map's id type
    /// and not in it (a catalogue delta's new items).
    pub fn appended(&self, new: &[ExternalId]) -> Result<IdMap, String> {
        match &self.ids {
            Ids::Int { by_index, .. } => {
                let mut all = by_index.clone();
                for id in new {
                    match id {
                        ExternalId::Int(i) => all.push(*i),
                        ExternalId::Str(s) => {
                            return Err(format!(
                                "item id {s:?} is a string; this catalogue's ids are int64"
                            ))
                        }
                    }
                }
                IdMap::from_int_ids(all)
            }
            Ids::Str { by_index, .. } => {
                let mut all = by_index.clone();
                all.extend(new.iter().map(|id| match id {
                    ExternalId::Int(i) => i.to_string(),
                    ExternalId::Str(s) => s.clone(),
                }));
                IdMap::from_string_ids(all)
            }
        }
    }

    /// The map of items 1..=`n` alone (the catalogue before items appended after them).
    pub fn prefix(&self, n: usize) -> Result<IdMap, String> {
        match &self.ids {
            Ids::Int { by_index, .. } => {
                IdMap::from_int_ids(by_index[..n.min(by_index.len())].to_vec())
            }
            Ids::Str { by_index, .. } => {
                IdMap::from_string_ids(by_index[..n.min(by_index.len())].to_vec())
            }
        }
    }

    /// The internal index of one external id (`None`: not an item).
    pub fn index_of(&self, id: &ExternalId) -> Option<u32> {
        match id {
            ExternalId::Int(i) => self.index_of_int(*i),
            ExternalId::Str(s) => match &self.ids {
                // An int64 catalogue answers only ids that are integers, written exactly so.
                Ids::Int { lookup, .. } => s.parse::<i64>().ok().and_then(|i| lookup.get(i)),
                Ids::Str { lookup, .. } => lookup.get(s.as_str()).copied(),
            },
        }
    }

    pub fn len(&self) -> usize {
        match &self.ids {
            Ids::Int { by_index, .. } => by_index.len(),
            Ids::Str { by_index, .. } => by_index.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn id_type(&self) -> IdType {
        match &self.ids {
            Ids::Int { .. } => IdType::Int64,
            Ids::Str { .. } => IdType::String,
        }
    }

    /// The TSV form read by [`IdMap::parse_tsv`], with a header.
    pub fn to_tsv(&self) -> String {
        let mut out = String::from("internal_index\texternal_item_id\n");
        for i in 1..=self.len() {
            let _ = writeln!(out, "{i}\t{}", self.external_string(i as u32));
        }
        out
    }

    fn external_string(&self, index: u32) -> String {
        match &self.ids {
            Ids::Int { by_index, .. } => by_index[index as usize - 1].to_string(),
            Ids::Str { by_index, .. } => by_index[index as usize - 1].clone(),
        }
    }

    pub fn index_of_int(&self, id: i64) -> Option<u32> {
        match &self.ids {
            Ids::Int { lookup, .. } => lookup.get(id),
            // A string catalogue may still be addressed by digits.
            Ids::Str { lookup, .. } => lookup.get(&id.to_string()).copied(),
        }
    }

    pub fn index_of_str(&self, id: &str) -> Option<u32> {
        match &self.ids {
            Ids::Int { lookup, .. } => id.trim().parse::<i64>().ok().and_then(|i| lookup.get(i)),
            Ids::Str { lookup, .. } => lookup.get(id).copied(),
        }
    }

    /// Maps ids to internal indices, dropping (and counting) unknown ones; order and duplicates are kept.
    pub fn map(&self, ids: ExternalIds<'_>) -> Mapped {
        self.map_with_positions(ids).0
    }

    /// The first `limit` ids of `ids` the map does not know, as text (for an error to show).
    pub fn unknown_examples(&self, ids: ExternalIds<'_>, limit: usize) -> Vec<String> {
        match ids {
            ExternalIds::Int(v) => v
                .iter()
                .filter(|&&id| self.index_of_int(id).is_none())
                .take(limit)
                .map(i64::to_string)
                .collect(),
            ExternalIds::Str(v) => v
                .iter()
                .filter(|id| self.index_of_str(id).is_none())
                .take(limit)
                .map(|id| id.to_string())
                .collect(),
        }
    }

    /// [`IdMap::map`], and the positions in `ids` of the ids it kept (what a request's per-id
    /// values, such as timestamps, are filtered by).
    pub fn map_with_positions(&self, ids: ExternalIds<'_>) -> (Mapped, Vec<usize>) {
        let mut out = Mapped {
            indices: Vec::with_capacity(ids.len()),
            unknown: 0,
        };
        let mut kept = Vec::with_capacity(ids.len());
        let mut push = |position: usize, found: Option<u32>| match found {
            Some(i) => {
                out.indices.push(i);
                kept.push(position);
            }
            None => out.unknown += 1,
        };
        match ids {
            ExternalIds::Int(v) => v
                .iter()
                .enumerate()
                .for_each(|(p, &id)| push(p, self.index_of_int(id))),
            ExternalIds::Str(v) => v
                .iter()
                .enumerate()
                .for_each(|(p, id)| push(p, self.index_of_str(id))),
        }
        (out, kept)
    }

    /// The external id of internal index `index`; `None` outside 1..=N (PAD, or an index that a
    /// kernel or a device got wrong: it is checked here, never trusted).
    pub fn external(&self, index: u32) -> Option<ExternalId> {
        let slot = (index as usize).checked_sub(1)?;
        match &self.ids {
            Ids::Int { by_index, .. } => by_index.get(slot).map(|&i| ExternalId::Int(i)),
            Ids::Str { by_index, .. } => by_index.get(slot).map(|s| ExternalId::Str(s.clone())),
        }
    }

    /// The external id as an i64, for int64 catalogues; `None` for string catalogues and outside
    /// 1..=N.
    pub fn external_int(&self, index: u32) -> Option<i64> {
        let slot = (index as usize).checked_sub(1)?;
        match &self.ids {
            Ids::Int { by_index, .. } => by_index.get(slot).copied(),
            Ids::Str { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_and_hashed_lookups_agree_on_every_id() {
        // A compact range (dense table), and the same ids with one far outlier (hash map).
        let compact: Vec<i64> = (0..500).map(|i| 1_000 + 3 * i).rev().collect();
        let mut sparse = compact.clone();
        sparse.push(i64::MAX - 1);
        for (ids, dense) in [(compact, true), (sparse, false)] {
            let map = IdMap::from_int_ids(ids.clone()).unwrap();
            let Ids::Int { lookup, .. } = &map.ids else {
                unreachable!("int ids")
            };
            assert_eq!(matches!(lookup, IntLookup::Dense { .. }), dense);
            for (i, &id) in ids.iter().enumerate() {
                assert_eq!(map.index_of_int(id), Some(i as u32 + 1), "{id}");
                assert_eq!(map.index_of_str(&id.to_string()), Some(i as u32 + 1));
            }
            for unknown in [999, 1_001, 2_498, 2_500, 0, -1, i64::MIN, i64::MAX] {
                assert_eq!(
                    map.index_of_int(unknown),
                    None,
                    "{unknown} (dense: {dense})"
                );
            }
        }
        for twice in [vec![5, 6, 5], vec![5, i64::MAX, 5]] {
            let err = IdMap::from_int_ids(twice).unwrap_err();
            assert!(err.contains("external id 5 appears twice"), "{err}");
        }
    }

    #[test]
    fn parses_header_and_maps_ids() {
        let map = IdMap::parse_tsv("internal_index\texternal_item_id\n2\t20\n1\t10\n").unwrap();
        assert_eq!(map.id_type(), IdType::Int64);
        let m = map.map(ExternalIds::Int(&[20, 99, 10, 20, -1]));
        assert_eq!(m.indices, vec![2, 1, 2]);
        assert_eq!(m.unknown, 2);
        assert_eq!(map.external(1), Some(ExternalId::Int(10)));
        assert_eq!(map.external(0), None, "PAD has no external id");
        assert_eq!(map.external(3), None, "past the catalogue");
        assert_eq!(map.external(u32::MAX), None);
        assert_eq!(map.external_int(3), None);
        assert_eq!(
            IdMap::parse_tsv(&map.to_tsv())
                .unwrap()
                .map(ExternalIds::Int(&[10]))
                .indices,
            vec![1]
        );
    }

    #[test]
    fn string_catalogue() {
        let map = IdMap::parse_tsv("1\tsku-a\n2\tsku-b\n").unwrap();
        assert_eq!(map.id_type(), IdType::String);
        let m = map.map(ExternalIds::Str(&["sku-b", "nope"]));
        assert_eq!((m.indices, m.unknown), (vec![2], 1));
    }

    #[test]
    fn rejects_gaps_duplicates_and_zero() {
        assert!(IdMap::parse_tsv("1\t10\n3\t30\n")
            .unwrap_err()
            .contains("outside"));
        assert!(IdMap::parse_tsv("1\t10\n1\t11\n")
            .unwrap_err()
            .contains("twice"));
        assert!(IdMap::parse_tsv("0\t10\n")
            .unwrap_err()
            .contains("reserved"));
        assert!(IdMap::parse_tsv("1\t10\n2\t10\n")
            .unwrap_err()
            .contains("appears twice"));
        assert!(IdMap::parse_tsv("").unwrap_err().contains("no items"));
    }
}
