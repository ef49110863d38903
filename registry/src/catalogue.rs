//! Live catalogue objects (see `recsys_engine::catalogue_file`) in a model repository: publishing
//! a delta for the engine a model's servers serve, with one conditional write, and the source a
//! server polls.
//!
//! A model's object lives next to its config (`<model>/recsys-catalogue.bin`), outside every
//! version folder; the servers name it in their config (`catalogue_source`) and poll it. A delta
//! is every change since one engine was converted, so the object names that engine (the SHA-256 of
//! its weights); before anything is written, the delta is applied to that very engine, so a row
//! that cannot apply is refused on the publisher's machine and never reaches a server. Publishing
//! never goes back: the new object's version is above the stored one (the next number, or one the
//! caller gives), and it is written only if the stored object is still the one read, so two
//! publishers racing cannot both win with one number.

use std::path::{Path, PathBuf};

use recsys_engine::catalogue::CatalogueDelta;
use recsys_engine::catalogue_file::{default_max_catalogue_bytes, CatalogueFile, CATALOGUE_OBJECT};
use recsys_engine::Engine;

use crate::config::policy_versions;
use crate::error::{RegistryError, Result};
use crate::live_source::LiveSource;
use crate::location::Location;
use crate::store::{Fetched, Repository};

/// The key of a model's catalogue object in its repository.
pub fn object_key(model: &str) -> String {
    format!("{model}/{CATALOGUE_OBJECT}")
}

/// The `catalogue_source` a server of `model` names: the object's URI in the repository's syntax
/// (an absolute path for a local repository).
pub fn source_uri(repository: &Repository, model: &str) -> String {
    crate::live_source::object_uri(repository, model, CATALOGUE_OBJECT)
}

/// Values per vector (`[embedding, bias]`) and per input row of an engine's items.
pub fn row_widths(engine: &Engine) -> (usize, usize) {
    (
        engine.model.output().input_size() + 1,
        engine.model.input_rows().cols(),
    )
}

/// The engine version `model`'s servers load: the newest version its config's `specific` policy
/// names, else the newest version folder (Triton's `latest`).
pub fn served_version(repository: &Repository, model: &str) -> Result<u64> {
    let text = crate::live_source::model_config(repository, model)?;
    if let Some(newest) = policy_versions(&text).and_then(|v| v.into_iter().max()) {
        return Ok(newest);
    }
    crate::versions::numbers(repository, model)?
        .into_iter()
        .max()
        .ok_or_else(|| RegistryError::Input(format!("{model} has no version folder yet")))
}

/// Loads `model`'s engine version `version` from the repository (downloaded into `scratch` when
/// the repository is remote).
pub fn load_engine(
    repository: &Repository,
    model: &str,
    version: u64,
    scratch: &Path,
) -> Result<Engine> {
    let dir: PathBuf = match repository.location() {
        Location::Local(dir) => dir.join(model).join(version.to_string()),
        _ => {
            let to = scratch.join(format!("{model}-{version}"));
            let uri = format!(
                "{}/{model}/{version}",
                repository.uri().trim_end_matches('/')
            );
            crate::transfer::download_folder(&uri, &to)?;
            to
        }
    };
    Engine::load(&dir).map_err(|e| {
        RegistryError::Input(format!(
            "{model} version {version} ({}): {e}",
            dir.display()
        ))
    })
}

/// What [`publish`] wrote.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Published {
    pub model: String,
    pub version: u64,
    /// The version it replaced (`None`: the model had none).
    pub previous: Option<u64>,
    pub published_unix: u64,
    /// The engine version the delta is for, and its weights' digest.
    pub engine_version: u64,
    pub engine_sha256: String,
    pub rows: usize,
    pub added: usize,
    pub replaced: usize,
    pub retired: usize,
    /// Items of that engine with the delta.
    pub items: usize,
    pub bytes: usize,
    pub sha256: String,
    /// What the model's servers name as `catalogue_source`.
    pub source: String,
    /// Whether the model's `config.pbtxt` names a catalogue source at all.
    pub configured: bool,
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Publishes `delta` as `model`'s catalogue for `engine` (version `engine_version` of the model,
/// as [`load_engine`] loaded it): version `version` (above the stored one) or the stored version
/// plus one. The delta is applied to the engine first; nothing is written if it cannot apply.
pub fn publish(
    repository: &Repository,
    model: &str,
    engine: &Engine,
    engine_version: u64,
    delta: CatalogueDelta,
    version: Option<u64>,
) -> Result<Published> {
    let configured = crate::live_source::config_names(repository, model, "catalogue_source")?;
    // Verified before anything changes: the fleet's engine with this delta.
    let applied = engine
        .with_catalogue(&delta)
        .map_err(|e| RegistryError::Input(format!("{model} version {engine_version}: {e}")))?;
    let summary = applied.catalogue().cloned().expect("just applied");
    let (vector_width, input_width) = row_widths(engine);
    let engine_sha256 = engine.weights_sha256().to_string();
    let written = crate::live_source::publish_forward(
        repository,
        model,
        "catalogue",
        &object_key(model),
        version,
        |bytes| CatalogueFile::peek(bytes).map(|(v, _, _)| v),
        |next| {
            let published_unix = now_unix();
            let mut versioned = delta.clone();
            versioned.version = next;
            let file = CatalogueFile::new(
                versioned,
                published_unix,
                &engine_sha256,
                vector_width,
                Some(input_width),
            )
            .map_err(RegistryError::Input)?;
            let bytes = file.to_bytes();
            let made = (published_unix, bytes.len(), file.sha256);
            Ok((bytes, made))
        },
    )?;
    let (published_unix, bytes, sha256) = written.made;
    Ok(Published {
        model: model.to_string(),
        version: written.version,
        previous: written.previous,
        published_unix,
        engine_version,
        engine_sha256,
        rows: summary.delta_items,
        added: summary.added,
        replaced: summary.replaced,
        retired: summary.retired,
        items: applied.n_items(),
        bytes,
        sha256,
        source: source_uri(repository, model),
        configured,
    })
}

/// A catalogue source as a server names it (parameter `catalogue_source`).
pub struct CatalogueSource(LiveSource);

impl std::fmt::Debug for CatalogueSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl CatalogueSource {
    /// The source `text`; a relative local path is taken from `model_dir`.
    pub fn open(text: &str, model_dir: &Path) -> Result<CatalogueSource> {
        LiveSource::open("catalogue_source", text, model_dir).map(CatalogueSource)
    }

    /// The source as resolved (what log lines name).
    pub fn describe(&self) -> &str {
        self.0.describe()
    }

    /// The object unless it still carries the entity tag `known`; larger than `max_bytes`, or
    /// not starting as a catalogue object, it is refused before it is read whole.
    pub fn fetch(&self, known: Option<&str>, max_bytes: u64) -> Result<Fetched> {
        self.0.fetch(known, max_bytes, &CatalogueFile::check_head)
    }
}

/// The default bound on a catalogue object for `engine`'s servers.
pub fn default_max_bytes(engine: &Engine) -> u64 {
    let (vector, input) = row_widths(engine);
    default_max_catalogue_bytes(engine.ids.len(), 4 * (vector + input))
}

/// Reads and checks the catalogue object at `source` against `engine` (made for it, readable,
/// whole): the delta to apply, with the object's version.
pub fn read(engine: &Engine, source: &str) -> Result<CatalogueDelta> {
    let opened = CatalogueSource::open(source, Path::new("."))?;
    let object = match opened.fetch(None, default_max_bytes(engine))? {
        Fetched::Changed(object) => object,
        Fetched::Missing | Fetched::Unchanged => {
            return Err(RegistryError::Input(format!(
                "no catalogue object at {}",
                opened.describe()
            )))
        }
        Fetched::Refused { why, .. } => {
            return Err(RegistryError::Input(format!(
                "catalogue object {} refused: {why}",
                opened.describe()
            )))
        }
    };
    check(engine, &object.bytes)
        .map_err(|e| RegistryError::Input(format!("catalogue object {}: {e}", opened.describe())))
}

/// Parses a catalogue object and checks it was made for `engine`: the delta to put in force.
///
/// An object made for the engine a compacted `engine` was built from, at a version it folded
/// (the repository's object until the first delta for the new engine is published), is taken as
/// an empty delta at that version: its rows are already in the engine's weights, and the fleet
/// reports one catalogue version while it runs both engines. A later version of that object holds
/// changes this engine lacks, and is refused.
pub fn check(engine: &Engine, bytes: &[u8]) -> std::result::Result<CatalogueDelta, String> {
    let file = CatalogueFile::from_bytes(bytes, engine.ids.id_type())?;
    if file.engine_sha256 == engine.weights_sha256() {
        return Ok(file.delta);
    }
    if let Some(folded) = &engine.manifest.catalogue {
        if file.engine_sha256 == folded.from_engine_sha256 {
            if file.delta.version <= folded.version {
                return Ok(CatalogueDelta {
                    version: file.delta.version,
                    rows: Vec::new(),
                });
            }
            return Err(format!(
                "version {} was published for the engine this one was compacted from, after \
                 the version {} it folded: its later changes are not in this engine (publish \
                 the table again once this engine version serves, or compact again)",
                file.delta.version, folded.version
            ));
        }
    }
    Err(format!(
        "version {} was published for the engine whose weights have SHA-256 {}; this engine's \
         is {} (publish the delta again for this engine version, or compact it into one)",
        file.delta.version,
        file.engine_sha256,
        engine.weights_sha256()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use recsys_engine::catalogue::{ItemOp, ItemRow};
    use recsys_engine::engine_dir::Precision;
    use recsys_engine::idmap::ExternalId;
    use recsys_engine::{fixtures, ModelKind};

    /// A local repository with model `shop` (SASRec) at version 1, configured with a catalogue
    /// source.
    fn repository() -> (tempfile::TempDir, Repository, Engine) {
        let dir = tempfile::tempdir().unwrap();
        let version = dir.path().join("shop/1");
        let engine = fixtures::convert(
            ModelKind::Sasrec,
            "model.safetensors",
            &version,
            Precision::Fp32,
        )
        .unwrap();
        std::fs::write(
            dir.path().join("shop/config.pbtxt"),
            "backend: \"recsys\"\nparameters { key: \"catalogue_source\" value { string_value: \"recsys-catalogue.bin\" } }\n",
        )
        .unwrap();
        let repo = Repository::open(&dir.path().display().to_string()).unwrap();
        (dir, repo, engine)
    }

    fn retire(engine: &Engine, index: u32) -> CatalogueDelta {
        CatalogueDelta {
            version: 0,
            rows: vec![ItemRow {
                id: engine.external_id(index).unwrap(),
                op: ItemOp::Retire,
                vector: None,
                input_vector: None,
            }],
        }
    }

    #[test]
    fn a_delta_is_verified_against_the_served_engine_numbered_forward_and_read_back() {
        let (dir, repo, engine) = repository();
        assert_eq!(served_version(&repo, "shop").unwrap(), 1);
        let scratch = tempfile::tempdir().unwrap();
        let served = load_engine(&repo, "shop", 1, scratch.path()).unwrap();
        let first = publish(&repo, "shop", &served, 1, retire(&engine, 3), None).unwrap();
        assert_eq!((first.version, first.previous, first.retired), (1, None, 1));
        assert!(first.configured);
        assert_eq!(first.engine_sha256, engine.weights_sha256());
        let second = publish(&repo, "shop", &served, 1, retire(&engine, 4), None).unwrap();
        assert_eq!((second.version, second.previous), (2, Some(1)));
        let err = publish(&repo, "shop", &served, 1, retire(&engine, 4), Some(2)).unwrap_err();
        assert!(
            err.to_string().contains("not newer than version 2"),
            "{err}"
        );

        // A delta that cannot apply is refused and nothing is written.
        let bad = CatalogueDelta {
            version: 0,
            rows: vec![ItemRow {
                id: ExternalId::Int(123_456_789),
                op: ItemOp::Retire,
                vector: None,
                input_vector: None,
            }],
        };
        let err = publish(&repo, "shop", &served, 1, bad, None).unwrap_err();
        assert!(
            err.to_string().contains("123456789 is not in the engine"),
            "{err}"
        );

        // What a server reads back: the stored version 2, for this engine only.
        let source = dir.path().join("shop").join(CATALOGUE_OBJECT);
        let delta = read(&engine, &source.display().to_string()).unwrap();
        assert_eq!(delta.version, 2);
        assert_eq!(delta.rows, retire(&engine, 4).rows);
        let other = fixtures::convert(
            ModelKind::Sasrec,
            "model.safetensors",
            &dir.path().join("other"),
            Precision::Fp16,
        )
        .unwrap();
        let err = read(&other, &source.display().to_string()).unwrap_err();
        assert!(
            err.to_string().contains("was published for the engine"),
            "{err}"
        );
    }
}
