//! The version records: `<model>/<version>/recsys-version.json`, one per version, the first object
//! a publish writes (status `incomplete`, claimed with a create-if-absent write, which is what gives
//! two concurrent publishers distinct numbers) and rewritten once the upload is complete and
//! verified (status `pending` or `approved`). A version whose record still says `incomplete` is
//! incomplete, in progress or abandoned by a killed publish: it never serves.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{RegistryError, Result};
use crate::store::Repository;

/// The record's file name inside each version folder.
pub const VERSION_FILE: &str = "recsys-version.json";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Claimed by a publish whose upload has not finished (or was killed).
    Incomplete,
    Pending,
    Approved,
    Rejected,
    /// Was approved and serving, and was taken off: by `recsys rollback`, or automatically when a
    /// replica failed to load it during the rollout. Approving it again runs its gates again.
    #[serde(rename = "rolled-back")]
    RolledBack,
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Status::Incomplete => "incomplete",
            Status::Pending => "pending",
            Status::Approved => "approved",
            Status::Rejected => "rejected",
            Status::RolledBack => "rolled-back",
        })
    }
}

/// What the registry knows about one version.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VersionInfo {
    pub version: u64,
    pub status: Status,
    pub created_at: String,
    pub model_kind: String,
    pub precision: String,
    pub source_checkpoint: String,
    pub source_sha256: String,
    /// Evaluation or sweep metrics handed to `publish --metrics`.
    pub metrics: Option<serde_json::Value>,
    /// Status changes, oldest first: "published pending at ...", "approved at ...".
    pub history: Vec<String>,
    /// Who claimed the version (host and process), so an incomplete one can be traced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publisher: Option<String>,
    /// The engine's files and sizes, recorded when the upload was verified.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<(String, u64)>,
    /// Every file's SHA-256 (hex) as the publisher hashed it before the upload: the integrity gate
    /// checks the stored objects against it (records written before it existed: against the
    /// engine manifest's own checksums).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub checksums: BTreeMap<String, String>,
    /// The request the canary replica must answer, with the answer the publisher's engine gave.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub self_check: Option<crate::self_check::SelfCheck>,
    /// Why the last approve refused this version or why it was rolled back, with the time;
    /// cleared when it is approved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<String>,
    /// The quality gate's numbers from the last approve that ran it (this version's NDCG@10 and
    /// the serving version's on the same held-out histories).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quality: Option<crate::quality::QualityReport>,
}

impl VersionInfo {
    /// The record of a version folder made without the registry (e.g. by `recsys convert
    /// --output <repo>/<model>/<v>`, or a publish still uploading before its record is written):
    /// incomplete, so it never serves and is never approved; `recsys publish` makes a version
    /// of that engine with its checksums and self-check.
    fn unregistered(version: u64, has_engine: bool) -> VersionInfo {
        VersionInfo {
            version,
            status: Status::Incomplete,
            created_at: String::new(),
            model_kind: String::new(),
            precision: String::new(),
            source_checkpoint: String::new(),
            source_sha256: String::new(),
            metrics: None,
            history: vec![if has_engine {
                "a folder without a registry record (written without `recsys publish`)".into()
            } else {
                "no registry record and no engine manifest".into()
            }],
            publisher: None,
            files: Vec::new(),
            checksums: BTreeMap::new(),
            self_check: None,
            last_failure: None,
            quality: None,
        }
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec_pretty(self).expect("version info serialises")
    }
}

pub fn record_key(model: &str, version: u64) -> String {
    format!("{model}/{version}/{VERSION_FILE}")
}

/// The numbers of every version folder of `model` (registered or not), ascending.
pub fn numbers(repo: &Repository, model: &str) -> Result<Vec<u64>> {
    let mut out: Vec<u64> = repo
        .folders(model)?
        .iter()
        .filter_map(|name| name.parse::<u64>().ok())
        .collect();
    out.sort_unstable();
    Ok(out)
}

/// Parses one record, naming the object when it is malformed.
pub fn parse(repo: &Repository, key: &str, bytes: &[u8]) -> Result<VersionInfo> {
    serde_json::from_slice(bytes).map_err(|e| {
        RegistryError::Input(format!(
            "{}/{key} is malformed: {e}",
            repo.uri().trim_end_matches('/')
        ))
    })
}

/// Every version of `model`, ascending.
pub fn list(repo: &Repository, model: &str) -> Result<Vec<VersionInfo>> {
    numbers(repo, model)?
        .into_iter()
        .map(|version| {
            let key = record_key(model, version);
            match repo.read(&key)? {
                Some(object) => parse(repo, &key, &object.bytes),
                None => {
                    // No record: never approvable (an engine copied in by hand, or one whose
                    // upload is still running: `recsys convert` writes the manifest first).
                    let has_engine = repo
                        .files(&format!("{model}/{version}"))?
                        .iter()
                        .any(|(name, _)| name == recsys_engine::engine_dir::MANIFEST_FILE);
                    Ok(VersionInfo::unregistered(version, has_engine))
                }
            }
        })
        .collect()
}

/// The error for a version `listed` does not hold, naming the ones it does.
pub fn no_such_version(
    repo: &Repository,
    model: &str,
    version: u64,
    listed: &[VersionInfo],
) -> RegistryError {
    RegistryError::Input(format!(
        "{}/{model} has no version {version} (versions: {})",
        repo.uri().trim_end_matches('/'),
        listed
            .iter()
            .map(|v| v.version.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

/// Rewrites `version`'s record with `change` (which may refuse by returning an error), retrying
/// when another command changed the record between the read and the conditional write. Returns
/// the record as written.
pub fn update(
    repo: &Repository,
    model: &str,
    version: u64,
    change: &mut dyn FnMut(&[VersionInfo], &mut VersionInfo) -> Result<()>,
) -> Result<VersionInfo> {
    for _ in 0..16 {
        // The object is read first: the conditional write below then refuses if anything changed
        // it after this read.
        let key = record_key(model, version);
        let object = repo.read(&key)?;
        let listed = list(repo, model)?;
        let Some(listed_current) = listed.iter().find(|v| v.version == version) else {
            return Err(no_such_version(repo, model, version, &listed));
        };
        let mut changed = match &object {
            Some(object) => parse(repo, &key, &object.bytes)?,
            None => listed_current.clone(),
        };
        change(&listed, &mut changed)?;
        let written = match &object {
            Some(object) => repo.replace(&key, &changed.to_json(), object)?,
            None => repo.create(&key, &changed.to_json())?,
        };
        if written {
            return Ok(changed);
        }
    }
    Err(RegistryError::Input(format!(
        "the record of {model} version {version} kept changing under concurrent commands; run \
         the command again"
    )))
}

/// The version every replica should serve: the newest approved one.
pub fn serving(versions: &[VersionInfo]) -> Option<u64> {
    versions
        .iter()
        .filter(|v| v.status == Status::Approved)
        .map(|v| v.version)
        .max()
}
