//! A model's live availability source, and one look at it: a new object checked and swapped into
//! the engine's filters between batches (the thread that polls is `poller.rs`).
//!
//! Nothing here is on a request's path: Execute takes the filters' current view once per batch,
//! and a swap replaces that view with one pointer store, so requests neither wait for a poll nor
//! see half an update. An object that fails a check (cut short, damaged, older than the one in
//! force, of another catalogue) is refused with a log line and a metric, and the one in force
//! stays. An object is read again only when the store says it changed (its entity tag), so a
//! refused object is reported once, and an unchanged one costs a conditional GET per poll.

use recsys_engine::filters::Replaced;
use recsys_engine::{AvailabilityFile, Engine};
use recsys_registry::availability::AvailabilitySource;
use recsys_registry::store::Fetched;

/// What one look at the source did.
#[derive(Clone, Debug, PartialEq)]
pub enum Polled {
    /// The source holds the object already seen (or, when it was refused, that same object).
    Unchanged,
    /// The source holds no object.
    Missing,
    /// A new object is in force.
    Swapped {
        version: u64,
        previous: Option<u64>,
        known_items: usize,
        unknown_items: usize,
    },
    /// A new object was refused; the one in force stays.
    Refused(String),
    /// The store could not be read (network, credentials); tried again at the next poll.
    Unreadable(String),
}

/// One model's source and what was last read from it.
pub struct Tracker {
    model: String,
    source: AvailabilitySource,
    /// The largest object read (`availability_max_bytes`); a larger one is refused from its size.
    max_bytes: u64,
    /// The entity tag of the last object read, accepted or refused.
    seen: Option<String>,
}

impl Tracker {
    pub fn new(model: &str, source: AvailabilitySource, max_bytes: u64) -> Tracker {
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

    /// Reads the source if it changed and puts a new object in force when it passes every check.
    pub fn poll(&mut self, engine: &Engine) -> Polled {
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
                    "{why} (parameter availability_max_bytes: {} bytes; by default 16 MiB plus \
                     512 bytes per catalogue item)",
                    self.max_bytes
                ));
            }
            Err(e) => return Polled::Unreadable(e.to_string()),
        };
        // Remembered whether it passes or not: a refused object is not read (nor reported) again
        // until the source changes.
        self.seen = object.etag().map(str::to_owned);
        let file = match AvailabilityFile::from_bytes(&object.bytes) {
            Ok(file) => file,
            Err(e) => return Polled::Refused(e),
        };
        let mapped = file.map(&engine.ids);
        let (version, known_items, unknown_items) =
            (mapped.version, mapped.known_items, mapped.unknown_items);
        if known_items == 0 && file.n_ids() > 0 {
            return Polled::Refused(format!(
                "version {version}: none of its {} item ids is in the model's catalogue",
                file.n_ids()
            ));
        }
        match engine.filters.replace_availability(mapped) {
            Ok(Replaced::Unchanged) => Polled::Unchanged,
            Ok(Replaced::Swapped { previous }) => Polled::Swapped {
                version,
                previous,
                known_items,
                unknown_items,
            },
            Err(e) => Polled::Refused(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use recsys_engine::AttributeTable;

    fn table(rows: &[(String, &str)]) -> AttributeTable {
        AttributeTable {
            columns: vec!["stock".into()],
            rows: rows
                .iter()
                .map(|(id, s)| (id.clone(), vec![vec![s.to_string()]]))
                .collect(),
        }
    }

    #[test]
    fn objects_are_taken_in_refused_and_kept_as_the_source_changes() {
        let (engine, _engine_dir) =
            crate::test_support::fixture_engine("sasrec", recsys_engine::ModelKind::Sasrec);
        let ids: Vec<String> = (1..=3)
            .map(|i| engine.external_id(i).unwrap().to_string())
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stock.bin");
        let write = |version: u64, rows: &[(String, &str)]| {
            let bytes = AvailabilityFile::from_table(&table(rows), version, 0)
                .unwrap()
                .to_bytes();
            std::fs::write(&path, &bytes).unwrap();
            bytes
        };
        let mut tracker = Tracker::new(
            "sasrec",
            AvailabilitySource::open("stock.bin", dir.path()).unwrap(),
            recsys_engine::default_max_availability_bytes(engine.ids.len()),
        );
        assert_eq!(tracker.poll(&engine), Polled::Missing);

        write(1, &[(ids[0].clone(), "in"), ("no-such-item".into(), "in")]);
        assert_eq!(
            tracker.poll(&engine),
            Polled::Swapped {
                version: 1,
                previous: None,
                known_items: 1,
                unknown_items: 1
            }
        );
        assert_eq!(tracker.poll(&engine), Polled::Unchanged);

        // Cut short: refused once, then unchanged until the source changes again.
        let good = write(2, &[(ids[1].clone(), "in")]);
        std::fs::write(&path, &good[..good.len() - 5]).unwrap();
        assert!(matches!(tracker.poll(&engine), Polled::Refused(e) if e.contains("truncated")));
        assert_eq!(tracker.poll(&engine), Polled::Unchanged);
        assert_eq!(engine.filters.availability_version(), Some(1));
        std::fs::write(&path, b"not an availability object").unwrap();
        assert!(matches!(tracker.poll(&engine), Polled::Refused(e) if e.contains("magic")));
        write(1, &[(ids[2].clone(), "in")]);
        assert!(matches!(tracker.poll(&engine), Polled::Refused(e) if e.contains("not newer")));
        write(
            2,
            &[("unknown-1".into(), "in"), ("unknown-2".into(), "out")],
        );
        assert!(matches!(tracker.poll(&engine), Polled::Refused(e) if e.contains("catalogue")));
        assert_eq!(engine.filters.availability_version(), Some(1));

        std::fs::write(&path, &good).unwrap();
        assert!(matches!(
            tracker.poll(&engine),
            Polled::Swapped { version: 2, .. }
        ));
        let mask = engine
            .filters
            .resolve(&recsys_engine::ItemFilter {
                include: vec!["stock=in".into()],
                exclude: vec![],
            })
            .unwrap();
        assert_eq!(mask.indices().collect::<Vec<_>>(), vec![2]);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(tracker.poll(&engine), Polled::Missing);
        assert_eq!(engine.filters.availability_version(), Some(2));

        // An object over availability_max_bytes is refused from its size, naming the parameter;
        // a huge one at the key never reaches memory.
        let big = write(3, &[(ids[0].clone(), "in"), (ids[1].clone(), "out")]);
        let mut bounded = Tracker::new(
            "sasrec",
            AvailabilitySource::open("stock.bin", dir.path()).unwrap(),
            big.len() as u64 - 1,
        );
        let Polled::Refused(why) = bounded.poll(&engine) else {
            panic!("an object over the bound is refused");
        };
        assert!(
            why.contains(&format!("holds {} bytes", big.len()))
                && why.contains("availability_max_bytes"),
            "{why}"
        );
        assert_eq!(bounded.poll(&engine), Polled::Unchanged, "refused once");
        assert_eq!(engine.filters.availability_version(), Some(2));
        let huge = std::fs::File::create(&path).unwrap();
        huge.set_len(3 << 30).unwrap(); // sparse: 3 GiB that take no disk
        let Polled::Refused(why) = tracker.poll(&engine) else {
            panic!("a 3 GiB object is refused");
        };
        assert!(why.contains("3221225472 bytes"), "{why}");
        assert_eq!(engine.filters.availability_version(), Some(2));
    }
}
