//! Live availability objects (see `recsys_engine::availability`) in a model repository: publishing
//! a newer one for a whole fleet with one conditional write, and the source a server polls.
//!
//! A model's object lives next to its config (`<model>/recsys-availability.bin`), outside every
//! version folder, so it outlives versions; the servers name it in their config
//! (`availability_source`) and poll it. Publishing never goes back: the new object's version is
//! above the one stored (the next number, or one the caller gives), and it is written only if the
//! stored object is still the one read, so two publishers racing cannot both win with one number.

use std::path::Path;

use recsys_engine::availability::{AvailabilityFile, AVAILABILITY_OBJECT};
use recsys_engine::AttributeTable;

use crate::error::{RegistryError, Result};
use crate::live_source::LiveSource;
use crate::store::{Fetched, Repository};

/// The key of a model's availability object in its repository.
pub fn object_key(model: &str) -> String {
    format!("{model}/{AVAILABILITY_OBJECT}")
}

/// The `availability_source` a server of `model` names: the object's URI in the repository's
/// syntax (an absolute path for a local repository).
pub fn source_uri(repository: &Repository, model: &str) -> String {
    crate::live_source::object_uri(repository, model, AVAILABILITY_OBJECT)
}

/// What [`publish`] wrote.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Published {
    pub model: String,
    pub version: u64,
    /// The version it replaced (`None`: the model had none).
    pub previous: Option<u64>,
    pub published_unix: u64,
    pub items: usize,
    pub sets: Vec<(String, u64)>,
    pub bytes: usize,
    pub sha256: String,
    /// What the model's servers name as `availability_source`.
    pub source: String,
    /// Whether the model's `config.pbtxt` names an availability source at all (if not, no server
    /// reads the object).
    pub configured: bool,
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Publishes `table`'s sets as `model`'s availability: version `version` (which must be above the
/// stored one) or the stored version plus one. The model must exist in the repository.
pub fn publish(
    repository: &Repository,
    model: &str,
    table: &AttributeTable,
    version: Option<u64>,
) -> Result<Published> {
    let configured = crate::live_source::config_names(repository, model, "availability_source")?;
    let written = crate::live_source::publish_forward(
        repository,
        model,
        "availability",
        &object_key(model),
        version,
        |bytes| AvailabilityFile::peek(bytes).map(|(v, _, _)| v),
        |next| {
            let published_unix = now_unix();
            let file = AvailabilityFile::from_table(table, next, published_unix)
                .map_err(RegistryError::Input)?;
            let bytes = file.to_bytes();
            let len = bytes.len();
            Ok((bytes, (file, published_unix, len)))
        },
    )?;
    let (file, published_unix, bytes) = written.made;
    Ok(Published {
        model: model.to_string(),
        version: written.version,
        previous: written.previous,
        published_unix,
        items: file.n_ids(),
        sets: file.summary(),
        bytes,
        sha256: file.sha256().to_string(),
        source: source_uri(repository, model),
        configured,
    })
}

/// An availability source as a server names it (parameter `availability_source`): a local file
/// (relative to the model's folder) or an object in a repository, read only when it changed.
pub struct AvailabilitySource(LiveSource);

impl std::fmt::Debug for AvailabilitySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl AvailabilitySource {
    /// The source `text`; a relative local path is taken from `model_dir`.
    pub fn open(text: &str, model_dir: &Path) -> Result<AvailabilitySource> {
        LiveSource::open("availability_source", text, model_dir).map(AvailabilitySource)
    }

    /// The source as resolved (what log lines name).
    pub fn describe(&self) -> &str {
        self.0.describe()
    }

    /// The object unless it still carries the entity tag `known`. An object larger than
    /// `max_bytes` is refused from its size before it is read, and one that does not start as an
    /// availability object (magic, format, a header whose sizes add up to the object's) as soon as
    /// its first bytes arrive ([`Fetched::Refused`]), so memory stays bounded whatever is at the
    /// key.
    pub fn fetch(&self, known: Option<&str>, max_bytes: u64) -> Result<Fetched> {
        self.0
            .fetch(known, max_bytes, &AvailabilityFile::check_head)
    }
}

/// What [`apply`] put in force.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Applied {
    pub version: u64,
    /// The object's ids the engine's catalogue holds, and those it does not (left out).
    pub known_items: usize,
    pub unknown_items: usize,
}

/// Reads the availability object at `source` (a file, or `s3://...`/`gs://...`) and puts it in
/// force in `engine`'s filters: offline scoring with the sets the servers use.
pub fn apply(engine: &recsys_engine::Engine, source: &str) -> Result<Applied> {
    let opened = AvailabilitySource::open(source, Path::new("."))?;
    let max_bytes = recsys_engine::default_max_availability_bytes(engine.ids.len());
    let object = match opened.fetch(None, max_bytes)? {
        Fetched::Changed(object) => object,
        Fetched::Missing | Fetched::Unchanged => {
            return Err(RegistryError::Input(format!(
                "no availability object at {}",
                opened.describe()
            )))
        }
        Fetched::Refused { why, .. } => {
            return Err(RegistryError::Input(format!(
                "availability object {} refused: {why}",
                opened.describe()
            )))
        }
    };
    let file = AvailabilityFile::from_bytes(&object.bytes).map_err(|e| {
        RegistryError::Input(format!("availability object {}: {e}", opened.describe()))
    })?;
    let mapped = file.map(&engine.ids);
    let applied = Applied {
        version: mapped.version,
        known_items: mapped.known_items,
        unknown_items: mapped.unknown_items,
    };
    engine
        .filters
        .replace_availability(mapped)
        .map_err(RegistryError::Input)?;
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(stock: &[(&str, &str)]) -> AttributeTable {
        AttributeTable {
            columns: vec!["stock".into()],
            rows: stock
                .iter()
                .map(|(id, s)| (id.to_string(), vec![vec![s.to_string()]]))
                .collect(),
        }
    }

    fn repository_with_model() -> (tempfile::TempDir, Repository) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("shop")).unwrap();
        std::fs::write(
            dir.path().join("shop/config.pbtxt"),
            "backend: \"recsys\"\nparameters { key: \"availability_source\" value { string_value: \"recsys-availability.bin\" } }\n",
        )
        .unwrap();
        let repo = Repository::open(&dir.path().display().to_string()).unwrap();
        (dir, repo)
    }

    #[test]
    fn publishing_numbers_forward_and_never_back() {
        let (dir, repo) = repository_with_model();
        let first = publish(&repo, "shop", &table(&[("1", "in"), ("2", "out")]), None).unwrap();
        assert_eq!((first.version, first.previous), (1, None));
        assert!(first.configured);
        assert_eq!(
            first.source,
            std::fs::canonicalize(dir.path())
                .unwrap()
                .join("shop/recsys-availability.bin")
                .display()
                .to_string()
        );
        let second = publish(&repo, "shop", &table(&[("1", "out")]), None).unwrap();
        assert_eq!((second.version, second.previous), (2, Some(1)));
        let err = publish(&repo, "shop", &table(&[("1", "in")]), Some(2)).unwrap_err();
        assert!(err.to_string().contains("not newer"), "{err}");
        let jumped = publish(&repo, "shop", &table(&[("1", "in")]), Some(10)).unwrap();
        assert_eq!(jumped.version, 10);
        let stored = repo.read(&object_key("shop")).unwrap().unwrap();
        let file = AvailabilityFile::from_bytes(&stored.bytes).unwrap();
        assert_eq!(
            (file.version, file.summary()),
            (10, vec![("stock=in".into(), 1)])
        );

        // A damaged stored object is replaced only with an explicit version.
        std::fs::write(dir.path().join("shop/recsys-availability.bin"), b"garbage").unwrap();
        let err = publish(&repo, "shop", &table(&[("1", "in")]), None).unwrap_err();
        assert!(err.to_string().contains("--version"), "{err}");
        assert_eq!(
            publish(&repo, "shop", &table(&[("1", "in")]), Some(11))
                .unwrap()
                .version,
            11
        );

        let err = publish(&repo, "nope", &table(&[("1", "in")]), None).unwrap_err();
        assert!(err.to_string().contains("no model \"nope\""), "{err}");
    }

    #[test]
    fn a_source_is_read_again_only_when_it_changed() {
        let (dir, repo) = repository_with_model();
        let model_dir = dir.path().join("shop");
        let source = AvailabilitySource::open("recsys-availability.bin", &model_dir).unwrap();
        assert!(matches!(
            source.fetch(None, u64::MAX).unwrap(),
            Fetched::Missing
        ));
        publish(&repo, "shop", &table(&[("1", "in")]), None).unwrap();
        let Fetched::Changed(object) = source.fetch(None, u64::MAX).unwrap() else {
            panic!("the object is there");
        };
        let tag = object.etag().map(str::to_owned);
        assert!(tag.is_some());
        assert!(matches!(
            source.fetch(tag.as_deref(), u64::MAX).unwrap(),
            Fetched::Unchanged
        ));
        publish(&repo, "shop", &table(&[("1", "out")]), None).unwrap();
        assert!(matches!(
            source.fetch(tag.as_deref(), u64::MAX).unwrap(),
            Fetched::Changed(_)
        ));

        // Over the bound, or not an availability object: refused without being read whole.
        let size = std::fs::metadata(model_dir.join("recsys-availability.bin"))
            .unwrap()
            .len();
        let Fetched::Refused { why, etag } = source.fetch(None, size - 1).unwrap() else {
            panic!("an object over the bound is refused");
        };
        assert!(
            why.contains(&format!("holds {size} bytes, more than the {}", size - 1)),
            "{why}"
        );
        assert!(
            etag.is_some(),
            "the refused object's tag, so it is not read again"
        );
        std::fs::write(
            model_dir.join("recsys-availability.bin"),
            vec![b'x'; 4 << 20],
        )
        .unwrap();
        let Fetched::Refused { why, .. } = source.fetch(None, u64::MAX).unwrap() else {
            panic!("garbage is refused");
        };
        assert!(why.contains("bad magic"), "{why}");

        assert!(AvailabilitySource::open("missing-dir/x.bin", &model_dir).is_err());
        assert!(AvailabilitySource::open("s3://bucket", &model_dir).is_err());
        assert!(AvailabilitySource::open("ftp://host/x", &model_dir).is_err());
    }
}
