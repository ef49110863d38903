//! The integrity gate: before a version may serve, every one of its stored files is read back from
//! the repository and its size and SHA-256 compared with what was published (the version record's
//! checksums, and the engine manifest's own, which every loader also checks). A flipped bit, a
//! truncated or missing object, or an extra file caught here changes nothing; caught by a replica
//! it would be a replica that cannot load.

use std::collections::BTreeMap;

use recsys_engine::engine_dir::{Manifest, MANIFEST_FILE};

use crate::error::{RegistryError, Result};
use crate::store::Repository;
use crate::versions::{VersionInfo, VERSION_FILE};

/// What the gate read.
#[derive(Clone, Debug, PartialEq)]
pub struct Verified {
    pub files: usize,
    pub bytes: u64,
}

/// Checks every file of `info`'s version in `repo`; `progress` hears (bytes read, bytes in all).
/// The error names the first file that differs and how.
pub fn verify(
    repo: &Repository,
    model: &str,
    info: &VersionInfo,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Verified> {
    let version = info.version;
    let folder = format!("{model}/{version}");
    let fail = |what: String| {
        RegistryError::Input(format!(
            "integrity check of {model} version {version} failed: {what}"
        ))
    };
    let manifest_key = format!("{folder}/{MANIFEST_FILE}");
    let manifest_bytes = repo
        .read(&manifest_key)?
        .ok_or_else(|| fail(format!("{MANIFEST_FILE} is missing")))?
        .bytes;
    let manifest: Manifest = serde_json::from_slice(&manifest_bytes)
        .map_err(|e| fail(format!("{MANIFEST_FILE} is malformed: {e}")))?;

    // What each file must be: the manifest's entries, and everything the publisher recorded.
    let mut expected: BTreeMap<String, (Option<u64>, Option<String>)> = manifest
        .files
        .iter()
        .map(|(name, entry)| {
            (
                name.clone(),
                (Some(entry.bytes), Some(entry.sha256.to_lowercase())),
            )
        })
        .collect();
    for (name, size) in &info.files {
        let entry = expected.entry(name.clone()).or_insert((None, None));
        if entry.0.is_some_and(|s| s != *size) {
            return Err(fail(format!(
                "{name}: the record says {size} bytes, the manifest {}",
                entry.0.unwrap_or_default()
            )));
        }
        entry.0 = Some(*size);
    }
    for (name, sha) in &info.checksums {
        let entry = expected.entry(name.clone()).or_insert((None, None));
        if entry.1.as_ref().is_some_and(|s| *s != sha.to_lowercase()) {
            return Err(fail(format!(
                "{name}: the record's SHA-256 differs from the manifest's"
            )));
        }
        entry.1 = Some(sha.to_lowercase());
    }

    let mut stored = repo.files(&folder)?;
    stored.retain(|(name, _)| name != VERSION_FILE);
    let stored: BTreeMap<String, u64> = stored.into_iter().collect();
    if let Some(missing) = expected.keys().find(|name| !stored.contains_key(*name)) {
        return Err(fail(format!("{missing} is missing from the repository")));
    }
    if !info.files.is_empty() {
        if let Some(extra) = stored.keys().find(|name| !expected.contains_key(*name)) {
            return Err(fail(format!(
                "{extra} is in the repository but was not published"
            )));
        }
    }
    let total: u64 = expected.keys().map(|name| stored[name]).sum();
    let mut done = 0u64;
    for (name, (size, sha)) in &expected {
        if let Some(size) = size {
            if stored[name] != *size {
                return Err(fail(format!(
                    "{name} holds {} bytes, {size} were published",
                    stored[name]
                )));
            }
        }
        let (read, actual) = repo
            .sha256(&format!("{folder}/{name}"))?
            .ok_or_else(|| fail(format!("{name} vanished while it was being read")))?;
        done += read;
        progress(done, total);
        if let Some(sha) = sha {
            if actual != *sha {
                return Err(fail(format!(
                    "{name}: SHA-256 {actual} where {sha} was published (the stored object is \
                     corrupt or was replaced)"
                )));
            }
        }
    }
    Ok(Verified {
        files: expected.len(),
        bytes: done,
    })
}
