//! The version records: `<model>/<version>/recsys-version.json`, one per version, the first object
//! a publish writes (status `incomplete`, claimed with a create-if-absent write, which is what gives
//! two concurrent publishers distinct numbers) and rewritten once the upload is complete and
//! verified (status `pending` or `approved`). A version whose record still says `incomplete` is
//! incomplete, in progress or abandoned by a killed publish: it never serves.

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
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Status::Incomplete => "incomplete",
            Status::Pending => "pending",
            Status::Approved => "approved",
            Status::Rejected => "rejected",
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
}

impl VersionInfo {
    /// The record of a version folder made without the registry (e.g. by `recsys convert
    /// --output <repo>/<model>/<v>`): treated as approved, as Triton would serve it.
    fn unregistered(version: u64) -> VersionInfo {
        VersionInfo {
            version,
            status: Status::Approved,
            created_at: String::new(),
            model_kind: String::new(),
            precision: String::new(),
            source_checkpoint: String::new(),
            source_sha256: String::new(),
            metrics: None,
            history: vec!["found without registry metadata; treated as approved".into()],
            publisher: None,
            files: Vec::new(),
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
                    // Only a folder holding an engine counts; anything else (a copy cut short)
                    // must never be named by the config.
                    let has_engine = repo
                        .files(&format!("{model}/{version}"))?
                        .iter()
                        .any(|(name, _)| name == recsys_engine::engine_dir::MANIFEST_FILE);
                    let mut info = VersionInfo::unregistered(version);
                    if !has_engine {
                        info.status = Status::Incomplete;
                        info.history = vec!["no registry record and no engine manifest".into()];
                    }
                    Ok(info)
                }
            }
        })
        .collect()
}

/// The version every replica should serve: the newest approved one.
pub fn serving(versions: &[VersionInfo]) -> Option<u64> {
    versions
        .iter()
        .filter(|v| v.status == Status::Approved)
        .map(|v| v.version)
        .max()
}
