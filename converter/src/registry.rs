//! Model versions in a Triton model repository: publish an engine as the next version directory,
//! approve or reject it, and keep `config.pbtxt`'s `version_policy` naming the newest approved
//! version (so Triton serves exactly that one). Every change happens under a lock file and lands by
//! atomic rename, so concurrent commands never leave a half-written version or config.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::{CliError, Result};
use recsys_engine::Engine;

/// The file next to the engine in each version directory.
pub const VERSION_FILE: &str = "recsys-version.json";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Pending,
    Approved,
    Rejected,
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
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
    /// Status changes, oldest first: "approved at ...", "rejected at ...".
    pub history: Vec<String>,
}

/// Holds `<model>/.recsys.lock` for the lifetime of the value.
pub struct Lock {
    path: PathBuf,
}

impl Lock {
    /// Waits up to `timeout` for the lock, then names its holder.
    pub fn acquire(model_dir: &Path, timeout: Duration) -> Result<Lock> {
        let path = model_dir.join(".recsys.lock");
        let started = Instant::now();
        loop {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut file) => {
                    let _ = writeln!(file, "pid {}", std::process::id());
                    return Ok(Lock { path });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    if started.elapsed() > timeout {
                        let holder = std::fs::read_to_string(&path).unwrap_or_default();
                        return Err(CliError::Input(format!(
                            "{} is locked by another recsys command ({}); if no such process runs, remove the lock file",
                            model_dir.display(),
                            holder.trim()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => return Err(CliError::io(format!("cannot create {}", path.display()))(e)),
            }
        }
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn write_atomically(path: &Path, contents: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    std::fs::write(&tmp, contents)
        .map_err(CliError::io(format!("cannot write {}", tmp.display())))?;
    std::fs::rename(&tmp, path).map_err(CliError::io(format!("cannot replace {}", path.display())))
}

/// Versions present in the model directory (numeric subdirectories), ascending.
pub fn list(model_dir: &Path) -> Result<Vec<VersionInfo>> {
    let entries = std::fs::read_dir(model_dir)
        .map_err(CliError::io(format!("cannot read {}", model_dir.display())))?;
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let Some(version) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        let meta = entry.path().join(VERSION_FILE);
        let info = match std::fs::read_to_string(&meta) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| CliError::Input(format!("{} is malformed: {e}", meta.display())))?,
            // A version made before the registry (e.g. by `recsys convert --out`) counts as approved.
            Err(_) => VersionInfo {
                version,
                status: Status::Approved,
                created_at: String::new(),
                model_kind: String::new(),
                precision: String::new(),
                source_checkpoint: String::new(),
                source_sha256: String::new(),
                metrics: None,
                history: vec!["found without registry metadata; treated as approved".into()],
            },
        };
        out.push(info);
    }
    out.sort_by_key(|v| v.version);
    Ok(out)
}

/// The version Triton should serve: the newest approved one.
pub fn serving(versions: &[VersionInfo]) -> Option<u64> {
    versions
        .iter()
        .filter(|v| v.status == Status::Approved)
        .map(|v| v.version)
        .max()
}

/// Removes a `version_policy` entry (with its braced block) from config text, keeping the rest.
fn strip_version_policy(config: &str) -> String {
    let Some(start) = config.find("version_policy") else {
        return config.to_string();
    };
    let Some(open) = config[start..].find('{').map(|i| start + i) else {
        return config.to_string();
    };
    let mut depth = 0;
    for (i, c) in config[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    let end = open + i + 1;
                    return format!("{}{}", config[..start].trim_end(), &config[end..]);
                }
            }
            _ => {}
        }
    }
    config.to_string()
}

const MANAGED_COMMENT: &str =
    "# Managed by `recsys publish/approve/reject`: the newest approved version.";

/// Rewrites `config.pbtxt` so Triton serves exactly `version`.
pub fn set_version_policy(model_dir: &Path, version: u64) -> Result<()> {
    let path = model_dir.join("config.pbtxt");
    let text = std::fs::read_to_string(&path)
        .map_err(CliError::io(format!("cannot read {}", path.display())))?;
    let stripped = strip_version_policy(&text);
    let mut new: String = stripped
        .lines()
        .filter(|l| !l.starts_with(MANAGED_COMMENT))
        .map(|l| format!("{l}\n"))
        .collect();
    new = new.trim_end().to_string();
    new.push_str(&format!(
        "\n{MANAGED_COMMENT}\nversion_policy: {{ specific: {{ versions: [ {version} ] }} }}\n"
    ));
    write_atomically(&path, new.as_bytes())
}

fn write_info(model_dir: &Path, info: &VersionInfo) -> Result<()> {
    let json = serde_json::to_string_pretty(info).expect("version info serialises");
    write_atomically(
        &model_dir.join(info.version.to_string()).join(VERSION_FILE),
        json.as_bytes(),
    )
}

fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to).map_err(CliError::io(format!("cannot create {}", to.display())))?;
    for entry in
        std::fs::read_dir(from).map_err(CliError::io(format!("cannot read {}", from.display())))?
    {
        let entry = entry.map_err(CliError::io("cannot list the engine"))?;
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target).map_err(CliError::io(format!(
                "cannot copy {}",
                entry.path().display()
            )))?;
        }
    }
    Ok(())
}

/// What `publish` did.
pub struct Published {
    pub info: VersionInfo,
    /// The minimal config.pbtxt written because the model had none.
    pub created_config: Option<PathBuf>,
}

/// The config of a model that has none: the backend completes inputs, outputs, `top_k` and
/// dynamic batching from the engine (README, "Serve with Triton").
fn minimal_config(max_batch_size: u32) -> String {
    format!(
        "# Written by `recsys publish`; the recsys backend completes the rest from the engine.\n\
         backend: \"recsys\"\nmax_batch_size: {max_batch_size}\n"
    )
}

/// Copies a verified engine into the next version directory, writing a minimal config.pbtxt
/// (`max_batch_size`) first when the model has none.
pub fn publish(
    model_dir: &Path,
    engine_dir: &Path,
    approve: bool,
    metrics: Option<serde_json::Value>,
    max_batch_size: u32,
) -> Result<Published> {
    let engine = Engine::load(engine_dir)?;
    std::fs::create_dir_all(model_dir).map_err(CliError::io(format!(
        "cannot create {}",
        model_dir.display()
    )))?;
    let _lock = Lock::acquire(model_dir, Duration::from_secs(30))?;
    let config = model_dir.join("config.pbtxt");
    let created_config = if config.exists() {
        None
    } else {
        write_atomically(&config, minimal_config(max_batch_size).as_bytes())?;
        Some(config)
    };
    let existing = list(model_dir)?;
    if !approve && serving(&existing).is_none() {
        return Err(CliError::Usage(
            "the first version of a model must be published with --approve: with no approved version there is nothing to serve or roll back to".into(),
        ));
    }
    let version = existing.last().map_or(1, |v| v.version + 1);
    let now = recsys_engine::engine_dir::utc_now_rfc3339();
    let m = &engine.manifest;
    let info = VersionInfo {
        version,
        status: if approve {
            Status::Approved
        } else {
            Status::Pending
        },
        created_at: now.clone(),
        model_kind: m.model.kind().to_string(),
        precision: serde_json::json!(m.precision)
            .as_str()
            .unwrap_or("")
            .to_string(),
        source_checkpoint: m.source.file.clone(),
        source_sha256: m.source.sha256.clone(),
        metrics,
        history: vec![format!(
            "published {} at {now}",
            if approve { "approved" } else { "pending" }
        )],
    };
    let staging = model_dir.join(format!(".staging-{version}-{}", std::process::id()));
    let result = copy_dir(engine_dir, &staging)
        .and_then(|_| Engine::load(&staging).map(|_| ()).map_err(CliError::from))
        .and_then(|_| {
            let json = serde_json::to_string_pretty(&info).expect("version info serialises");
            std::fs::write(staging.join(VERSION_FILE), json)
                .map_err(CliError::io("cannot write version metadata"))
        })
        .and_then(|_| {
            std::fs::rename(&staging, model_dir.join(version.to_string())).map_err(CliError::io(
                format!("cannot move version {version} into place"),
            ))
        });
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(e);
    }
    if approve {
        set_version_policy(model_dir, version)?;
    }
    Ok(Published {
        info,
        created_config,
    })
}

/// Approves or rejects `version`; returns the version that should serve afterwards.
pub fn set_status(model_dir: &Path, version: u64, status: Status) -> Result<u64> {
    let _lock = Lock::acquire(model_dir, Duration::from_secs(30))?;
    let mut versions = list(model_dir)?;
    let Some(index) = versions.iter().position(|v| v.version == version) else {
        return Err(CliError::Input(format!(
            "{} has no version {version} (versions: {})",
            model_dir.display(),
            versions
                .iter()
                .map(|v| v.version.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    };
    if status == Status::Rejected && versions[index].status == Status::Approved {
        let others = versions
            .iter()
            .filter(|v| v.status == Status::Approved && v.version != version)
            .count();
        if others == 0 {
            return Err(CliError::Input(format!(
                "version {version} is the only approved version of {}: rejecting it would leave nothing to serve; publish and approve another version first",
                model_dir.display()
            )));
        }
    }
    let now = recsys_engine::engine_dir::utc_now_rfc3339();
    versions[index].status = status;
    versions[index].history.push(format!("{status} at {now}"));
    write_info(model_dir, &versions[index])?;
    let serve = serving(&versions).expect("at least one approved version remains");
    set_version_policy(model_dir, serve)?;
    Ok(serve)
}

/// Asks a tritonserver in explicit model-control mode to reload `model`, then waits until
/// `version` is ready. `server` is like `http://127.0.0.1:8000`.
pub fn reload_and_wait(server: &str, model: &str, version: u64, timeout: Duration) -> Result<()> {
    let base = server.trim_end_matches('/');
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(120))
        .build();
    agent
        .post(&format!("{base}/v2/repository/models/{model}/load"))
        .send_string("")
        .map_err(|e| {
            CliError::Input(format!(
                "the server refused to reload {model}: {}",
                describe(e)
            ))
        })?;
    let started = Instant::now();
    loop {
        let ready = agent
            .get(&format!(
                "{base}/v2/models/{model}/versions/{version}/ready"
            ))
            .call();
        if ready.is_ok() {
            return Ok(());
        }
        if started.elapsed() > timeout {
            return Err(CliError::Input(format!(
                "{model} version {version} was not ready after {timeout:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn describe(e: ureq::Error) -> String {
    match e {
        ureq::Error::Status(code, response) => format!(
            "HTTP {code}: {}",
            response.into_string().unwrap_or_default()
        ),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_policy_is_replaced_not_duplicated() {
        let text =
            "name: \"m\"\nversion_policy: { specific: { versions: [ 1 ] } }\nmax_batch_size: 8\n";
        let stripped = strip_version_policy(text);
        assert!(!stripped.contains("version_policy"));
        assert!(stripped.contains("max_batch_size: 8"));
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.pbtxt"), text).unwrap();
        set_version_policy(dir.path(), 3).unwrap();
        set_version_policy(dir.path(), 4).unwrap();
        let after = std::fs::read_to_string(dir.path().join("config.pbtxt")).unwrap();
        assert_eq!(after.matches("version_policy").count(), 1, "{after}");
        assert!(after.contains("versions: [ 4 ]") && after.contains("max_batch_size: 8"));
    }

    #[test]
    fn lock_is_exclusive_and_released() {
        let dir = tempfile::tempdir().unwrap();
        let lock = Lock::acquire(dir.path(), Duration::from_secs(1)).unwrap();
        let err = Lock::acquire(dir.path(), Duration::from_millis(100))
            .err()
            .unwrap();
        assert!(err.to_string().contains("locked"));
        drop(lock);
        Lock::acquire(dir.path(), Duration::from_millis(100)).unwrap();
    }
}
