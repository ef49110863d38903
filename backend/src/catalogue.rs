//! A model's live catalogue source, and one look at it: a new delta checked, applied to the engine
//! as converted off the serving path, and put in force between batches (the thread that polls is
//! `poller.rs`, which also logs and counts each poll; the engine in force is `live_engine.rs`).
//!
//! An object that fails a check (cut short, damaged, over the bound, made for another engine
//! version, not newer than the one in force, or a row that cannot apply) is refused with a log
//! line and a metric, and the catalogue in force stays. An object is read again only when the
//! store says it changed (its entity tag), so a refused object is reported once.

use recsys_engine::catalogue::CatalogueSummary;
use recsys_registry::catalogue::{check, CatalogueSource};
use recsys_registry::store::Fetched;

use crate::live_engine::LiveEngine;

/// What one look at the source did.
#[derive(Clone, Debug, PartialEq)]
pub enum Polled {
    /// The source holds the object already seen (or, when it was refused, that same object).
    Unchanged,
    /// The source holds no object.
    Missing,
    /// A new delta is in force.
    Swapped {
        summary: CatalogueSummary,
        previous: Option<u64>,
        items: usize,
        /// The object is the delta this (compacted) engine was built from: its rows are already
        /// in the weights, and only its version is taken.
        folded: bool,
    },
    /// A new object was refused; the catalogue in force stays.
    Refused(String),
    /// The store could not be read (network, credentials); tried again at the next poll.
    Unreadable(String),
}

/// One model's catalogue source and what was last read from it.
pub struct Tracker {
    model: String,
    source: CatalogueSource,
    /// The largest object read (`catalogue_max_bytes`); a larger one is refused from its size.
    max_bytes: u64,
    /// The entity tag of the last object read, accepted or refused.
    seen: Option<String>,
}

impl Tracker {
    pub fn new(model: &str, source: CatalogueSource, max_bytes: u64) -> Tracker {
        Tracker {
            model: model.to_string(),
            source,
            max_bytes,
            seen: None,
        }
    }

    /// The model the source belongs to.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// The source as resolved (what log lines name).
    pub fn source(&self) -> &str {
        self.source.describe()
    }

    /// Reads the source if it changed and puts a new delta in force when it passes every check.
    pub fn poll(&mut self, live: &LiveEngine) -> Polled {
        let object = match self.source.fetch(self.seen.as_deref(), self.max_bytes) {
            Ok(Fetched::Unchanged) => return Polled::Unchanged,
            Ok(Fetched::Missing) => {
                self.seen = None;
                return Polled::Missing;
            }
            Ok(Fetched::Changed(object)) => object,
            Ok(Fetched::Refused { why, etag }) => {
                self.seen = etag;
                return Polled::Refused(format!(
                    "{why} (parameter catalogue_max_bytes: {} bytes)",
                    self.max_bytes
                ));
            }
            Err(e) => return Polled::Unreadable(e.to_string()),
        };
        // Remembered whether it passes or not: a refused object is not read (nor reported) again
        // until the source changes.
        self.seen = object.etag().map(str::to_owned);
        live.change(|engine| {
            let delta = match check(engine, &object.bytes) {
                Ok(delta) => delta,
                Err(e) => return (None, Polled::Refused(e)),
            };
            let previous = engine.catalogue().map(|c| c.version);
            if let Some(current) = previous {
                if delta.version <= current {
                    let report = if delta.version == current {
                        Polled::Unchanged
                    } else {
                        Polled::Refused(format!(
                            "catalogue version {} is not newer than version {current} in force \
                             (kept)",
                            delta.version
                        ))
                    };
                    return (None, report);
                }
            }
            let folded = delta.rows.is_empty()
                && engine
                    .manifest
                    .catalogue
                    .as_ref()
                    .is_some_and(|f| delta.version <= f.version);
            match engine.with_catalogue(&delta) {
                Ok(next) => {
                    let summary = next.catalogue().cloned().expect("just applied");
                    let items = next.n_items();
                    (
                        Some(next),
                        Polled::Swapped {
                            summary,
                            previous,
                            items,
                            folded,
                        },
                    )
                }
                Err(e) => (
                    None,
                    Polled::Refused(format!("version {}: {e}", delta.version)),
                ),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use recsys_engine::catalogue::{CatalogueDelta, ItemOp, ItemRow};
    use recsys_engine::catalogue_file::CatalogueFile;
    use recsys_engine::idmap::ExternalId;

    /// A row retiring the item `id`.
    fn retirement(id: ExternalId) -> ItemRow {
        ItemRow {
            id,
            op: ItemOp::Retire,
            vector: None,
            input_vector: None,
        }
    }

    /// A catalogue object of `rows` at `version`, for the engine whose weights digest is `sha`
    /// and whose rows are `(vector, input)` wide.
    fn object_bytes(
        (vector_width, input_width): (usize, usize),
        version: u64,
        rows: Vec<ItemRow>,
        sha: &str,
    ) -> Vec<u8> {
        CatalogueFile::new(
            CatalogueDelta { version, rows },
            0,
            sha,
            vector_width,
            Some(input_width),
        )
        .unwrap()
        .to_bytes()
    }

    #[test]
    fn deltas_are_taken_in_refused_and_kept_as_the_source_changes() {
        let (engine, _engine_dir) =
            crate::test_support::fixture_engine("sasrec", recsys_engine::ModelKind::Sasrec);
        let sha = engine.weights_sha256().to_string();
        let ids: Vec<Option<ExternalId>> = (0..=3).map(|i| engine.external_id(i)).collect();
        let widths = recsys_registry::catalogue::row_widths(&engine);
        let retire = |index: u32| retirement(ids[index as usize].clone().unwrap());
        let object =
            |version: u64, rows: Vec<ItemRow>, sha: &str| object_bytes(widths, version, rows, sha);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("catalogue.bin");
        let live = LiveEngine::new(engine);
        let mut tracker = Tracker::new(
            "sasrec",
            CatalogueSource::open("catalogue.bin", dir.path()).unwrap(),
            1 << 20,
        );
        assert_eq!(tracker.poll(&live), Polled::Missing);

        std::fs::write(&path, object(1, vec![retire(1)], &sha)).unwrap();
        let Polled::Swapped {
            summary,
            previous,
            items,
            folded,
        } = tracker.poll(&live)
        else {
            panic!("version 1 is taken in");
        };
        assert!(!folded);
        assert_eq!(
            (summary.version, summary.retired, previous, items),
            (1, 1, None, 2000)
        );
        assert_eq!(tracker.poll(&live), Polled::Unchanged);
        let first = live.current();

        // Cut short, for another engine, older, or a row that cannot apply: refused, kept.
        let good = object(2, vec![retire(1), retire(2)], &sha);
        std::fs::write(&path, &good[..good.len() - 3]).unwrap();
        assert!(matches!(tracker.poll(&live), Polled::Refused(e) if e.contains("truncated")));
        assert_eq!(tracker.poll(&live), Polled::Unchanged, "refused once");
        std::fs::write(&path, object(2, vec![retire(2)], "0000")).unwrap();
        assert!(
            matches!(tracker.poll(&live), Polled::Refused(e) if e.contains("published for the engine"))
        );
        std::fs::write(&path, object(0, vec![retire(3)], &sha)).unwrap();
        assert!(matches!(tracker.poll(&live), Polled::Refused(e) if e.contains("not newer")));
        let mut unknown = retire(1);
        unknown.id = recsys_engine::idmap::ExternalId::Int(123_456_789);
        std::fs::write(&path, object(5, vec![unknown], &sha)).unwrap();
        assert!(
            matches!(tracker.poll(&live), Polled::Refused(e) if e.contains("not in the engine"))
        );
        assert!(
            std::sync::Arc::ptr_eq(&first, &live.current()),
            "the engine in force stays"
        );

        std::fs::write(&path, &good).unwrap();
        assert!(matches!(
            tracker.poll(&live),
            Polled::Swapped {
                previous: Some(1),
                ..
            }
        ));
        assert_eq!(live.current().catalogue().unwrap().retired, 2);
        // Over the bound: refused from its size.
        let mut bounded = Tracker::new(
            "sasrec",
            CatalogueSource::open("catalogue.bin", dir.path()).unwrap(),
            good.len() as u64 - 1,
        );
        assert!(
            matches!(bounded.poll(&live), Polled::Refused(e) if e.contains("catalogue_max_bytes"))
        );
        // The object gone: the catalogue in force stays.
        std::fs::remove_file(&path).unwrap();
        assert_eq!(tracker.poll(&live), Polled::Missing);
        assert_eq!(live.current().catalogue().unwrap().version, 2);
    }

    /// A compacted engine's server reads the object it folded (the fleet's object while the old
    /// engine still serves): taken at its version with nothing to apply; a later version for the
    /// old engine is refused (its changes are not in this engine); one for this engine applies.
    #[test]
    fn a_compacted_engine_takes_the_object_it_folded_and_refuses_later_ones_for_the_old_engine() {
        let (engine, engine_dir) =
            crate::test_support::fixture_engine("sasrec", recsys_engine::ModelKind::Sasrec);
        let ids: Vec<Option<ExternalId>> = (0..=3).map(|i| engine.external_id(i)).collect();
        let widths = recsys_registry::catalogue::row_widths(&engine);
        let retire = |index: u32| retirement(ids[index as usize].clone().unwrap());
        let object =
            |version: u64, rows: Vec<ItemRow>, sha: &str| object_bytes(widths, version, rows, sha);
        // A new item (item 9's rows under a new id) changes the weights, and so the engine's
        // identity. (Retirements alone keep the weights, so a delta for the old engine is one for
        // the new engine too, and applies as such.)
        let output = engine.model.output();
        let d = output.input_size();
        let mut vector = vec![0f32; d + 1];
        output.weight.add_row_into(9, &mut vector[..d]);
        let added = ItemRow {
            id: recsys_engine::idmap::ExternalId::Int(90_000_000),
            op: ItemOp::Upsert,
            vector: Some(vector),
            input_vector: None,
        };
        let folded = CatalogueDelta {
            version: 4,
            rows: vec![retire(1), retire(2), added],
        };
        let compacted = recsys_engine::compact::write_compacted(
            &engine,
            &folded,
            &engine_dir.path().join("compacted"),
        )
        .unwrap();
        let old_sha = engine.weights_sha256().to_string();
        let new_sha = compacted.weights_sha256().to_string();
        assert_ne!(old_sha, new_sha);

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("catalogue.bin");
        let live = LiveEngine::new(compacted);
        let mut tracker = Tracker::new(
            "sasrec",
            CatalogueSource::open("catalogue.bin", dir.path()).unwrap(),
            1 << 20,
        );
        std::fs::write(&path, object(4, folded.rows.clone(), &old_sha)).unwrap();
        let Polled::Swapped {
            summary, folded, ..
        } = tracker.poll(&live)
        else {
            panic!("the folded object is taken in");
        };
        assert!(folded);
        assert_eq!((summary.version, summary.delta_items), (4, 0));
        assert_eq!(
            live.current().kept_retired().len(),
            2,
            "retired in the engine"
        );

        std::fs::write(&path, object(5, vec![retire(3)], &old_sha)).unwrap();
        assert!(
            matches!(tracker.poll(&live), Polled::Refused(e) if e.contains("after the version 4 it folded"))
        );
        assert_eq!(live.current().catalogue().unwrap().version, 4);

        std::fs::write(&path, object(6, vec![retire(3)], &new_sha)).unwrap();
        let Polled::Swapped {
            summary, folded, ..
        } = tracker.poll(&live)
        else {
            panic!("a delta for the compacted engine applies");
        };
        assert!(!folded);
        assert_eq!((summary.version, summary.retired), (6, 1));
    }
}
