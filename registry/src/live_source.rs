//! Where a server reads a live object of a model (an availability object, a catalogue delta):
//! a local file, relative to the model's folder, or an object in a repository (`s3://...`,
//! `gs://...`), read only when its entity tag changed and never past a size bound.

use std::path::Path;

use crate::config::CONFIG_FILE;
use crate::error::{RegistryError, Result};
use crate::location::Location;
use crate::store::{Fetched, HeadCheck, ReadBound, Repository};

/// Publishers racing on one object are retried this often before giving up.
const PUBLISH_ATTEMPTS: usize = 8;

/// What [`publish_forward`] wrote: the version, the one it replaced, and what `make` returned.
pub struct Written<T> {
    pub version: u64,
    pub previous: Option<u64>,
    pub made: T,
}

/// `model`'s `config.pbtxt` as text; the model must exist in the repository.
pub fn model_config(repository: &Repository, model: &str) -> Result<String> {
    let config = repository
        .read(&format!("{model}/{CONFIG_FILE}"))?
        .ok_or_else(|| {
            RegistryError::Input(format!(
                "{} holds no model {model:?} (no {model}/{CONFIG_FILE}); publish its engine first",
                repository.uri()
            ))
        })?;
    Ok(String::from_utf8_lossy(&config.bytes).into_owned())
}

/// Whether `model`'s config names parameter `parameter`; the model must exist in the repository.
pub fn config_names(repository: &Repository, model: &str, parameter: &str) -> Result<bool> {
    Ok(model_config(repository, model)?.contains(parameter))
}

/// Writes `model`'s live object `what` (`availability`, `catalogue`) at `key`, forward only:
/// version `version` (above the stored one) or the stored version plus one, as `make(version)`
/// makes its bytes, with create-if-absent or replace-if-unchanged; when another publisher wrote
/// between the read and the write, it reads theirs and goes above it. `peek` reads a stored
/// object's version; a stored object it cannot read is replaced only with an explicit `version`.
pub fn publish_forward<T>(
    repository: &Repository,
    model: &str,
    what: &str,
    key: &str,
    version: Option<u64>,
    peek: impl Fn(&[u8]) -> std::result::Result<u64, String>,
    mut make: impl FnMut(u64) -> Result<(Vec<u8>, T)>,
) -> Result<Written<T>> {
    for _ in 0..PUBLISH_ATTEMPTS {
        let stored = repository.read(key)?;
        let previous = match &stored {
            None => None,
            Some(object) => match peek(&object.bytes) {
                Ok(v) => Some(v),
                // The servers hold the last good object; the caller's number must be above it.
                Err(_) if version.is_some() => None,
                Err(e) => {
                    return Err(RegistryError::Input(format!(
                        "the stored {what} object of {model} is not readable ({e}): give \
                         --version N above the version its servers report (response parameter \
                         {what}_version) to replace it"
                    )))
                }
            },
        };
        let next = match (version, previous) {
            (Some(v), Some(p)) if v <= p => {
                return Err(RegistryError::Input(format!(
                    "{what} version {v} is not newer than version {p} stored for {model}: \
                     servers never go back to an older one"
                )))
            }
            (Some(0), None) => {
                return Err(RegistryError::Usage(format!("{what} versions start at 1")))
            }
            (Some(v), _) => v,
            (None, p) => p.map_or(1, |p| p + 1),
        };
        let (bytes, made) = make(next)?;
        let written = match &stored {
            None => repository.create(key, &bytes)?,
            Some(object) => repository.replace(key, &bytes, object)?,
        };
        if written {
            return Ok(Written {
                version: next,
                previous,
                made,
            });
        }
    }
    Err(RegistryError::Input(format!(
        "the {what} object of {model} kept changing while publishing ({PUBLISH_ATTEMPTS} \
         attempts): another publisher is writing it"
    )))
}

/// The URI of `model`'s live object `name` in `repository`, as a server's parameter names it
/// (an absolute path for a local repository).
pub fn object_uri(repository: &Repository, model: &str, name: &str) -> String {
    match repository.location() {
        Location::Local(dir) => {
            let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.clone());
            dir.join(model).join(name).display().to_string()
        }
        _ => format!("{}/{model}/{name}", repository.uri().trim_end_matches('/')),
    }
}

/// One live object's source, as a model parameter names it.
pub struct LiveSource {
    repository: Repository,
    key: String,
    text: String,
}

impl std::fmt::Debug for LiveSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

impl LiveSource {
    /// The source `text` given as model parameter `parameter` (named in errors); a relative
    /// local path is taken from `model_dir`.
    pub fn open(parameter: &str, text: &str, model_dir: &Path) -> Result<LiveSource> {
        let text = text.trim();
        let bad = |why: &str| RegistryError::Input(format!("{parameter} {text:?}: {why}"));
        if text.contains("://") {
            // Checked whole first, so the error names the source as given.
            Location::parse(text)?;
            let (scheme, rest) = text.split_once("://").expect("checked above");
            let (parent, name) = rest
                .rsplit_once('/')
                .filter(|(parent, name)| !parent.is_empty() && !name.is_empty())
                .ok_or_else(|| bad("it names a bucket or folder, not an object in it"))?;
            return Ok(LiveSource {
                repository: Repository::open(&format!("{scheme}://{parent}"))?,
                key: name.to_string(),
                text: text.to_string(),
            });
        }
        let path = model_dir.join(text);
        let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
            return Err(bad("it names no file"));
        };
        if !dir.is_dir() {
            return Err(bad(&format!("no directory {}", dir.display())));
        }
        Ok(LiveSource {
            repository: Repository::open(&dir.display().to_string())?,
            key: name.to_string_lossy().into_owned(),
            text: path.display().to_string(),
        })
    }

    /// The source as resolved (what log lines name).
    pub fn describe(&self) -> &str {
        &self.text
    }

    /// The object unless it still carries the entity tag `known`. An object larger than
    /// `max_bytes` is refused from its size before it is read, and one whose first bytes
    /// `check_head` refuses as soon as they arrive ([`Fetched::Refused`]), so memory stays
    /// bounded whatever is at the key.
    pub fn fetch(
        &self,
        known: Option<&str>,
        max_bytes: u64,
        check_head: HeadCheck<'_>,
    ) -> Result<Fetched> {
        self.repository.read_if_changed_within(
            &self.key,
            known,
            &ReadBound {
                max_bytes,
                check_head,
            },
        )
    }
}
