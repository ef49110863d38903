//! The catalogue's popularity: how often each item occurs in the training interactions, the
//! answer for a visitor with no history (`empty_history_policy: popular`).
//!
//! `recsys convert --interactions FILE` counts the item column of an interaction log (CSV, TSV,
//! or RecBole's atomic `.inter` file, whose header names `item_id:token`) and stores the counts
//! with the engine as `item_popularity.bin` ([`POPULARITY_FILE`]: magic, then one little-endian
//! u64 count per internal index, PAD's always 0), checksummed in the manifest like every file.

use std::path::Path;

use crate::idmap::IdMap;
use crate::interactions::{LogReader, ITEM_COLUMNS};
use crate::kernels::item_mask::ItemMask;
use crate::topk::Scored;

/// The file an engine's popularity counts live in.
pub const POPULARITY_FILE: &str = "item_popularity.bin";
const MAGIC: &[u8; 8] = b"RSYSPOP1";

/// Interaction counts per internal index, with the items in popularity order.
#[derive(Clone, Debug, PartialEq)]
pub struct Popularity {
    counts: Vec<u64>,
    /// Items (internal indices) with at least one interaction, most frequent first, ties to the
    /// lower index.
    order: Vec<u32>,
    total: u64,
}

/// What counting an interaction log found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PopularityReport {
    /// The column counted.
    pub column: String,
    /// Interactions with an item of the catalogue.
    pub interactions: u64,
    /// Interactions naming an item the catalogue does not hold (skipped).
    pub unknown_items: u64,
    /// Distinct items with at least one interaction.
    pub items: usize,
}

impl Popularity {
    /// From counts per internal index (`counts[0]`, PAD, is ignored).
    pub fn from_counts(mut counts: Vec<u64>) -> Self {
        if let Some(pad) = counts.first_mut() {
            *pad = 0;
        }
        let mut order: Vec<u32> = (1..counts.len() as u32)
            .filter(|&i| counts[i as usize] > 0)
            .collect();
        order.sort_by(|&a, &b| counts[b as usize].cmp(&counts[a as usize]).then(a.cmp(&b)));
        let total = counts.iter().sum();
        Popularity {
            counts,
            order,
            total,
        }
    }

    /// Counts the item column of the interaction log at `path` (CSV by a `.csv` extension, else
    /// tab-separated, with a header): `column` by name, else the first header among
    /// `item_id:token`, `item_id`, `item`, `itemid`.
    pub fn count_file(
        path: &Path,
        column: Option<&str>,
        ids: &IdMap,
    ) -> Result<(Popularity, PopularityReport), String> {
        let mut log = LogReader::open(path)?;
        let position = match column {
            Some(c) => log.names().iter().position(|n| n == c),
            None => log.find(&ITEM_COLUMNS),
        }
        .ok_or_else(|| {
            format!(
                "{}: no item column {} in the header ({}); name it with --interactions-item-column",
                path.display(),
                column.map_or_else(|| ITEM_COLUMNS.join(" / "), |c| format!("{c:?}")),
                log.names().join(", ")
            )
        })?;
        let mut counts = vec![0u64; ids.len() + 1];
        let mut report = PopularityReport {
            column: log.names()[position].clone(),
            ..Default::default()
        };
        while let Some(record) = log.next_record()? {
            match ids.index_of_str(record.field(position, "item")?) {
                Some(i) => {
                    counts[i as usize] += 1;
                    report.interactions += 1;
                }
                None => report.unknown_items += 1,
            }
        }
        if report.interactions == 0 {
            return Err(format!(
                "{}: none of its {} interactions names an item of the catalogue (column {:?})",
                path.display(),
                report.unknown_items,
                report.column
            ));
        }
        let popularity = Popularity::from_counts(counts);
        report.items = popularity.order.len();
        Ok((popularity, report))
    }

    /// Interactions counted, over all items.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// These counts over a catalogue of `len` internal indices (PAD included): items past the
    /// counted ones (a catalogue delta's new items) have none.
    pub fn grown(&self, len: usize) -> Popularity {
        let mut counts = self.counts.clone();
        counts.resize(len.max(counts.len()), 0);
        Popularity::from_counts(counts)
    }

    /// Interactions of item `index`.
    pub fn count(&self, index: u32) -> u64 {
        self.counts.get(index as usize).copied().unwrap_or(0)
    }

    /// The `k` most popular items `allowed` keeps (most frequent first, ties to the lower index;
    /// never an item without interactions), each scored with its share of all interactions.
    pub fn top_k(&self, k: usize, allowed: impl Fn(u32) -> bool) -> Vec<Scored> {
        let total = self.total.max(1) as f64;
        self.order
            .iter()
            .copied()
            .filter(|&i| allowed(i))
            .take(k)
            .map(|index| Scored {
                index,
                score: (self.counts[index as usize] as f64 / total) as f32,
            })
            .collect()
    }

    /// [`Self::top_k`] for a prepared request: not in `excluded`, in `eligible` and in
    /// `candidates` (ascending) when given.
    pub fn top_k_for(
        &self,
        k: usize,
        excluded: &[u32],
        eligible: Option<&ItemMask>,
        candidates: Option<&[u32]>,
    ) -> Vec<Scored> {
        let mut excluded = excluded.to_vec();
        excluded.sort_unstable();
        self.top_k(k, |i| {
            excluded.binary_search(&i).is_err()
                && eligible.is_none_or(|m| m.allows(i))
                && candidates.is_none_or(|c| c.binary_search(&i).is_ok())
        })
    }

    /// `item_popularity.bin`'s bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + 8 * self.counts.len());
        out.extend_from_slice(MAGIC);
        for c in &self.counts {
            out.extend_from_slice(&c.to_le_bytes());
        }
        out
    }

    /// Parses `item_popularity.bin` for a catalogue of `items` internal indices (PAD included).
    pub fn from_bytes(bytes: &[u8], items: usize) -> Result<Popularity, String> {
        if bytes.len() < 8 || &bytes[..8] != MAGIC {
            return Err("not a popularity file (bad magic)".into());
        }
        let body = &bytes[8..];
        if body.len() != 8 * items {
            return Err(format!(
                "{} bytes of counts; a {items}-index catalogue needs {}",
                body.len(),
                8 * items
            ));
        }
        Ok(Popularity::from_counts(
            body.chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_rank_and_filter() {
        let ids = IdMap::from_int_ids(vec![10, 20, 30, 40]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log.inter");
        std::fs::write(
            &log,
            "user_id:token\titem_id:token\ttimestamp:float\n\
             1\t20\t5\n1\t30\t6\n2\t20\t7\n3\t40\t1\n3\t30\t2\n4\t99\t3\n5\t20\t4\n",
        )
        .unwrap();
        let (pop, report) = Popularity::count_file(&log, None, &ids).unwrap();
        assert_eq!(report.column, "item_id:token");
        assert_eq!(
            (report.interactions, report.unknown_items, report.items),
            (6, 1, 3)
        );
        // 20 (index 2) x3, 30 (index 3) x2, 40 (index 4) x1; 10 never: never answered.
        let top = pop.top_k(10, |_| true);
        assert_eq!(
            top.iter().map(|s| s.index).collect::<Vec<_>>(),
            vec![2, 3, 4]
        );
        assert_eq!(top[0].score, 0.5);
        let filtered = pop.top_k_for(2, &[2], Some(&ItemMask::of(5, [2, 3, 4])), None);
        assert_eq!(
            filtered.iter().map(|s| s.index).collect::<Vec<_>>(),
            vec![3, 4]
        );
        let among = pop.top_k_for(5, &[], None, Some(&[1, 4]));
        assert_eq!(among.iter().map(|s| s.index).collect::<Vec<_>>(), vec![4]);
        assert_eq!(Popularity::from_bytes(&pop.to_bytes(), 5).unwrap(), pop);
        assert!(Popularity::from_bytes(&pop.to_bytes()[..20], 5).is_err());
        let csv = dir.path().join("log.csv");
        std::fs::write(&csv, "user,product\n1,20\n").unwrap();
        let err = Popularity::count_file(&csv, None, &ids).unwrap_err();
        assert!(err.contains("user, product"), "{err}");
        let (pop, _) = Popularity::count_file(&csv, Some("product"), &ids).unwrap();
        assert_eq!(pop.count(2), 1);
    }
}
