//! `publish`: an engine becomes the model's next version without any lock. The version number is
//! claimed by creating its record (create-if-absent: of two concurrent publishers one gets `n`,
//! the other `n + 1`); the files are uploaded under it; the upload is checked against the local
//! engine (every file, every size); only then does the record say `pending`. A publish killed at
//! any point leaves at most an incomplete version that no config names. Serving it is approve's
//! job ([`crate::release`]), which verifies the version first; `publish --approve` is a publish
//! followed by that approve.

use std::path::{Path, PathBuf};

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

use crate::error::{RegistryError, Result};
use crate::self_check::SelfCheck;
use crate::store::Repository;
use crate::versions::{self, Status, VersionInfo, VERSION_FILE};
use recsys_engine::Engine;

/// How many version numbers a publish tries before giving up (each refusal means another
/// publisher took that number at the same moment).
const CLAIM_ATTEMPTS: u64 = 1000;

pub struct PublishRequest<'a> {
    pub model: &'a str,
    pub engine_dir: &'a Path,
    /// The caller approves the version right after (`publish --approve`); without it the model
    /// must already have an approved version to serve.
    pub approve: bool,
    pub metrics: Option<serde_json::Value>,
    /// Held-out histories with their next items (a `recsys eval` test set) for the quality gate,
    /// stored with the version as [`crate::quality::EVAL_SET_FILE`].
    pub eval_set: Option<&'a Path>,
}

/// Checks an evaluation set before it is published: it parses, and its histories and targets are
/// items of the engine's catalogue (a set for another model would make the gate meaningless).
fn check_eval_set(engine: &Engine, path: &Path) -> Result<u64> {
    let cases = recsys_engine::metrics::read_test_set(path)?;
    let known_targets = cases
        .iter()
        .filter(|c| engine.ids.index_of_str(&c.target).is_some())
        .count();
    let usable = cases.iter().filter(|c| !c.history.is_empty()).count();
    if usable == 0 || known_targets * 2 < cases.len() {
        return Err(RegistryError::Input(format!(
            "{} is not an evaluation set for this engine: {} cases, {usable} with a history, {} of \
             their targets in the engine's catalogue (at least half must be)",
            path.display(),
            cases.len(),
            known_targets
        )));
    }
    Ok(std::fs::metadata(path)
        .map_err(RegistryError::io(format!("cannot read {}", path.display())))?
        .len())
}

/// Every file of the engine folder but a stray version record, as (relative path, local path,
/// size), sorted.
fn engine_files(dir: &Path) -> Result<Vec<(String, PathBuf, u64)>> {
    let mut files = crate::transfer::local_files(dir)?;
    files.retain(|(relative, _, _)| relative != VERSION_FILE);
    Ok(files)
}

pub(crate) fn publisher() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown host".into());
    format!("{host} pid {}", std::process::id())
}

/// The SHA-256 (hex) of every file before the upload. Files the engine manifest lists were just
/// verified against it by `Engine::load`, so their checksums are the manifest's; only the others
/// (the manifest itself) are read and hashed here.
fn checksums(
    files: &[(String, PathBuf, u64)],
    manifest: &BTreeMap<String, recsys_engine::engine_dir::FileEntry>,
) -> Result<BTreeMap<String, String>> {
    files
        .iter()
        .map(|(name, path, size)| {
            if let Some(entry) = manifest.get(name).filter(|e| e.bytes == *size) {
                return Ok((name.clone(), entry.sha256.to_lowercase()));
            }
            let mut file = std::fs::File::open(path)
                .map_err(RegistryError::io(format!("cannot read {}", path.display())))?;
            let mut hasher = Sha256::new();
            std::io::copy(&mut file, &mut hasher)
                .map_err(RegistryError::io(format!("cannot read {}", path.display())))?;
            Ok((name.clone(), hex::encode(hasher.finalize())))
        })
        .collect()
}

/// Why a plain publish (without `--approve`) is refused when no version is approved, saying what
/// state the repository is in: a model with no version yet, or one whose versions were all
/// rejected or rolled back, or a release command stopped between its writes (the config naming a
/// version whose record is no longer approved), with the command that repairs it.
fn no_approved_version(
    repo: &Repository,
    model: &str,
    existing: &[VersionInfo],
) -> Result<RegistryError> {
    let published: Vec<&VersionInfo> = existing
        .iter()
        .filter(|v| v.status != Status::Incomplete)
        .collect();
    if published.is_empty() {
        return Ok(RegistryError::Usage(
            "the first version of a model must be published with --approve: with no approved \
             version there is nothing to serve or roll back to"
                .into(),
        ));
    }
    let states = published
        .iter()
        .map(|v| format!("{} {}", v.version, v.status))
        .collect::<Vec<_>>()
        .join(", ");
    let config_key = format!("{model}/{}", crate::config::CONFIG_FILE);
    let named = repo
        .read(&config_key)?
        .and_then(|o| crate::config::policy_versions(&String::from_utf8_lossy(&o.bytes)));
    let repair = |version: u64| {
        format!(
            "recsys approve --repository {} --model {model} --version {version}",
            repo.uri()
        )
    };
    Ok(RegistryError::Usage(match named.as_deref() {
        Some(&[version]) => format!(
            "{model} has no approved version (versions: {states}), yet {config_key} still names \
             version {version}: a release command (a rollback or reject) was stopped between its \
             record write and its config write. Replicas serve version {version}. Approve the \
             version that should serve to repair it (`{}`), then publish; or publish this engine \
             with --approve",
            repair(version)
        ),
        _ => format!(
            "{model} has no approved version (versions: {states}) and {config_key} names none: \
             nothing serves. Approve a version that should serve (`{}`), or publish this engine \
             with --approve",
            repair(published.last().expect("a published version").version)
        ),
    }))
}

/// Publishes `request.engine_dir` as the next version of `request.model`, pending; `progress`
/// gets (bytes uploaded, bytes in all).
pub fn publish(
    repo: &Repository,
    request: &PublishRequest<'_>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<VersionInfo> {
    let model = request.model;
    if model.is_empty() || model.contains('/') || model.starts_with('.') {
        return Err(RegistryError::Usage(format!(
            "{model:?} is not a model name (one folder name of the repository)"
        )));
    }
    // The engine is loaded (checksums verified) before anything is written.
    let engine = Engine::load(request.engine_dir)?;
    let mut files = engine_files(request.engine_dir)?;
    if let Some(eval_set) = request.eval_set {
        let size = check_eval_set(&engine, eval_set)?;
        files.retain(|(name, _, _)| name != crate::quality::EVAL_SET_FILE);
        files.push((
            crate::quality::EVAL_SET_FILE.to_string(),
            eval_set.to_path_buf(),
            size,
        ));
        files.sort();
    }
    let total: u64 = files.iter().map(|(_, _, size)| size).sum();

    let existing = versions::list(repo, model)?;
    if !request.approve && versions::serving(&existing).is_none() {
        return Err(no_approved_version(repo, model, &existing)?);
    }
    let checksums = checksums(&files, &engine.manifest.files)?;
    let self_check = SelfCheck::from_engine(&engine)?;
    let now = recsys_engine::engine_dir::utc_now_rfc3339();
    let m = &engine.manifest;
    let mut info = VersionInfo {
        version: 0,
        status: Status::Incomplete,
        created_at: now.clone(),
        model_kind: m.model.kind().to_string(),
        precision: serde_json::json!(m.precision)
            .as_str()
            .unwrap_or("")
            .to_string(),
        source_checkpoint: m.source.file.clone(),
        source_sha256: m.source.sha256.clone(),
        metrics: request.metrics.clone(),
        history: vec![format!("upload started at {now}")],
        publisher: Some(publisher()),
        files: Vec::new(),
        checksums,
        self_check: Some(self_check),
        last_failure: None,
        quality: None,
    };

    // Claim the next free number.
    let first = versions::numbers(repo, model)?.last().map_or(1, |v| v + 1);
    let mut claimed = None;
    for version in first..first + CLAIM_ATTEMPTS {
        info.version = version;
        if repo.create(&versions::record_key(model, version), &info.to_json())? {
            claimed = Some(version);
            break;
        }
    }
    let version = claimed.ok_or_else(|| {
        RegistryError::Input(format!(
            "could not claim a version number for {model} after {CLAIM_ATTEMPTS} attempts"
        ))
    })?;
    let record_key = versions::record_key(model, version);
    let claim = repo.read(&record_key)?.ok_or_else(|| {
        RegistryError::Input(format!(
            "the record of {model} version {version} vanished after it was written"
        ))
    })?;

    let mut upload = || -> Result<()> {
        let mut done = 0u64;
        for (relative, path, _) in &files {
            let base = done;
            let sent = repo.upload(&format!("{model}/{version}/{relative}"), path, &mut |n| {
                progress(base + n, total)
            })?;
            done += sent;
        }
        // The upload is complete when the store holds exactly the engine's files and sizes.
        let mut uploaded = repo.files(&format!("{model}/{version}"))?;
        uploaded.retain(|(name, _)| name != VERSION_FILE);
        let expected: Vec<(String, u64)> = files.iter().map(|(n, _, s)| (n.clone(), *s)).collect();
        if uploaded != expected {
            return Err(RegistryError::Input(format!(
                "the upload of {model} version {version} does not match the engine: the store \
                 holds {uploaded:?}, the engine has {expected:?}"
            )));
        }
        Ok(())
    };
    if let Err(e) = upload() {
        // Best effort: leave no half version behind (a killed process leaves an incomplete one,
        // which never serves).
        for (relative, _, _) in &files {
            let _ = repo.delete(&format!("{model}/{version}/{relative}"));
        }
        let _ = repo.delete(&record_key);
        return Err(e);
    }

    let now = recsys_engine::engine_dir::utc_now_rfc3339();
    info.status = Status::Pending;
    info.files = files.iter().map(|(n, _, s)| (n.clone(), *s)).collect();
    info.history.push(format!("published pending at {now}"));
    if !repo.replace(&record_key, &info.to_json(), &claim)? {
        return Err(RegistryError::Input(format!(
            "the record of {model} version {version} was changed by another command during the \
             upload; see `recsys versions`"
        )));
    }
    Ok(info)
}
