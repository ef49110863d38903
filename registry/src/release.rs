//! Changing what the fleet serves, failing closed: `approve`, `reject` and `rollback`.
//!
//! Before anything changes, the version that would serve is verified: every stored file against
//! its published size and SHA-256 ([`crate::integrity`]), and, for an approve with replicas, a
//! canary replica loads it without the repository changing and answers its self-check
//! ([`crate::canary`]). A gate that fails leaves the repository and every replica as they were and
//! records the reason on the version. Only then does the record change and the config switch (two
//! single-object writes, as before: a command killed between them leaves the config on a complete,
//! approved version, and running it again finishes). If a replica then fails to load the approved
//! version, the approve undoes itself: the version is marked rolled back, the config goes back to
//! the previous approved version and the replicas already reached reload it (unless the caller
//! asked the rollout to continue past failures).

use std::time::Duration;

use serde_json::{json, Value};

use crate::canary::{self, Canary, CanaryReport};
use crate::config::{self, policy_versions, CONFIG_FILE};
use crate::error::{RegistryError, Result};
use crate::integrity::{self, Verified};
use crate::publish::{self, PublishRequest};
use crate::replicas::{self, Outcome, ReplicaReport, Rollout};
use crate::self_check::{SelfCheck, SELF_CHECK_K};
use crate::store::Repository;
use crate::versions::{self, Status, VersionInfo};

/// The replicas a command reaches, and how.
pub struct Fleet<'a> {
    /// One URL per replica (already expanded: [`replicas::expand`]).
    pub replicas: &'a [String],
    /// Go on past a failed replica, and never roll back automatically.
    pub continue_after_failure: bool,
    /// The longest one replica may take to load a version.
    pub reload_timeout: Duration,
}

impl Fleet<'_> {
    pub fn none() -> Fleet<'static> {
        Fleet {
            replicas: &[],
            continue_after_failure: false,
            reload_timeout: Duration::from_secs(120),
        }
    }
}

/// What a command is doing, as it happens (for progress output).
pub enum Step<'a> {
    Verifying {
        version: u64,
    },
    Verified {
        version: u64,
        verified: &'a Verified,
    },
    Canary(&'a CanaryReport),
    /// A replica of the rollout onto `version`, as it finishes.
    Replica {
        version: u64,
        report: &'a ReplicaReport,
    },
    RollingBack {
        to: u64,
        reason: &'a str,
    },
    /// A replica the failed rollout had reached, reloaded onto `version` again.
    RolledBack {
        version: u64,
        report: &'a ReplicaReport,
    },
}

/// What a command did.
#[derive(Clone, Debug, Default)]
pub struct Release {
    pub model: String,
    /// The version the command was about.
    pub version: u64,
    /// What the config named before (the fleet's version).
    pub serving_before: Option<u64>,
    /// What the config names afterwards.
    pub serving: Option<u64>,
    /// The model had no config: the first approval wrote a minimal one.
    pub created_config: bool,
    /// Why a gate refused: nothing changed.
    pub refused: Option<String>,
    pub verified: Option<Verified>,
    pub canary: Option<CanaryReport>,
    pub rollout: Option<Rollout>,
    /// The automatic rollback's reload of the replicas the rollout had reached.
    pub rolled_back: Option<Rollout>,
    /// Why the automatic rollback happened.
    pub rollback_reason: Option<String>,
}

impl Release {
    pub fn to_json(&self) -> Value {
        json!({
            "model": self.model,
            "version": self.version,
            "serving_version_before": self.serving_before,
            "serving_version": self.serving,
            "created_config": self.created_config,
            "refused": self.refused,
            "verified": self.verified.as_ref().map(|v| json!({"files": v.files, "bytes": v.bytes})),
            "canary": self.canary.as_ref().map(CanaryReport::to_json),
            "rollout": self.rollout.as_ref().map(Rollout::to_json),
            "rolled_back": self.rolled_back.as_ref().map(Rollout::to_json),
            "rollback_reason": self.rollback_reason,
        })
    }
}

fn find(
    listed: &[VersionInfo],
    repo: &Repository,
    model: &str,
    version: u64,
) -> Result<VersionInfo> {
    listed
        .iter()
        .find(|v| v.version == version)
        .cloned()
        .ok_or_else(|| versions::no_such_version(repo, model, version, listed))
}

/// The versions the config names now (`None`: no config, or no specific policy).
fn read_config(repo: &Repository, model: &str) -> Result<(Option<String>, Option<Vec<u64>>)> {
    let text = repo
        .read(&format!("{model}/{CONFIG_FILE}"))?
        .and_then(|o| String::from_utf8(o.bytes).ok());
    let versions = text.as_deref().and_then(policy_versions);
    Ok((text, versions))
}

fn now() -> String {
    recsys_engine::engine_dir::utc_now_rfc3339()
}

/// Writes a gate's refusal on the version's record (best effort: the refusal itself is what the
/// caller reports; a record that cannot be written must not hide it).
fn record_failure(repo: &Repository, model: &str, version: u64, message: &str) {
    let _ = versions::update(repo, model, version, &mut |_, info| {
        info.last_failure = Some(message.to_string());
        info.history.push(message.to_string());
        Ok(())
    });
}

/// The integrity gate on `version`, reported through `on_step`.
fn verify(
    repo: &Repository,
    model: &str,
    info: &VersionInfo,
    on_step: &mut dyn FnMut(Step<'_>),
) -> std::result::Result<Verified, String> {
    on_step(Step::Verifying {
        version: info.version,
    });
    let verified =
        integrity::verify(repo, model, info, &mut |_, _| {}).map_err(|e| e.to_string())?;
    on_step(Step::Verified {
        version: info.version,
        verified: &verified,
    });
    Ok(verified)
}

/// A self-check for a version published before self-checks were recorded: a few catalogue ids
/// from its stored item table, checked for a well-formed, finite answer only.
fn blind_check(repo: &Repository, model: &str, version: u64) -> Result<SelfCheck> {
    use recsys_engine::engine_dir::{Manifest, ITEM_IDS_FILE, MANIFEST_FILE};
    let read = |name: &str| -> Result<Vec<u8>> {
        Ok(repo
            .read(&format!("{model}/{version}/{name}"))?
            .ok_or_else(|| {
                RegistryError::Input(format!("{model} version {version} has no {name}"))
            })?
            .bytes)
    };
    let manifest: Manifest = serde_json::from_slice(&read(MANIFEST_FILE)?)
        .map_err(|e| RegistryError::Input(format!("{model} version {version}'s manifest: {e}")))?;
    let strings = manifest.id_type == recsys_engine::idmap::IdType::String;
    let ids = read(ITEM_IDS_FILE)?;
    let history: Vec<Value> = String::from_utf8_lossy(&ids)
        .lines()
        .skip(1)
        .filter_map(|line| line.split('\t').nth(1))
        .take(3)
        .map(|id| match (strings, id.parse::<i64>()) {
            (false, Ok(i)) => Value::from(i),
            _ => Value::from(id),
        })
        .collect();
    Ok(SelfCheck {
        history,
        k: SELF_CHECK_K,
        expected: Vec::new(),
    })
}

/// Approves `version` through the gates (see the module documentation). `max_batch_size` is the
/// minimal config's when the model has none yet.
pub fn approve(
    repo: &Repository,
    model: &str,
    version: u64,
    fleet: &Fleet<'_>,
    max_batch_size: u32,
    on_step: &mut dyn FnMut(Step<'_>),
) -> Result<Release> {
    let listed = versions::list(repo, model)?;
    let info = find(&listed, repo, model, version)?;
    if info.status == Status::Incomplete {
        return Err(RegistryError::Input(format!(
            "{model} version {version} is incomplete: its publish ({}) has not finished or was \
             stopped, so it cannot serve; publish the engine again (it gets a new version)",
            info.publisher.as_deref().unwrap_or("publisher unknown")
        )));
    }
    let (config_text, configured) = read_config(repo, model)?;
    let serving_before = versions::serving(&listed);
    let target = serving_before.map_or(version, |s| s.max(version));
    let fleet_changes = configured.as_deref() != Some(&[target]);
    let mut release = Release {
        model: model.to_string(),
        version,
        serving_before: configured.as_ref().and_then(|c| c.last().copied()),
        ..Release::default()
    };
    let refuse = |mut release: Release, reason: String| -> Result<Release> {
        record_failure(
            repo,
            model,
            version,
            &format!("approve refused at {}: {reason}", now()),
        );
        release.refused = Some(reason);
        Ok(release)
    };

    if fleet_changes || info.status != Status::Approved {
        match verify(repo, model, &info, on_step) {
            Ok(verified) => release.verified = Some(verified),
            Err(reason) => return refuse(release, reason),
        }
    }
    if fleet_changes && target == version && !fleet.replicas.is_empty() {
        let check = match &info.self_check {
            Some(check) => check.clone(),
            None => blind_check(repo, model, version)?,
        };
        let report = canary::run(
            fleet.replicas,
            &Canary {
                model,
                version,
                serving: release.serving_before,
                check: &check,
                // No config yet (the first approval): the one the switch will write.
                repository_config: Some(
                    config_text
                        .clone()
                        .unwrap_or_else(|| config::minimal(max_batch_size))
                        .as_str(),
                ),
                timeout: fleet.reload_timeout,
            },
        );
        on_step(Step::Canary(&report));
        let failed = report
            .result
            .as_ref()
            .err()
            .map(|e| format!("canary on {}: {e}", report.server));
        let restore_failed = report.restored.as_ref().err().cloned();
        release.canary = Some(report);
        if let Some(reason) = failed {
            let reason = match restore_failed {
                Some(r) => format!("{reason} (and the canary was not put back: {r})"),
                None => reason,
            };
            return refuse(release, reason);
        }
    }

    versions::update(repo, model, version, &mut |_, v| {
        if v.status == Status::Incomplete {
            return Err(RegistryError::Input(format!(
                "{model} version {version} became incomplete during the approve"
            )));
        }
        if v.status != Status::Approved {
            v.status = Status::Approved;
            v.history.push(format!("approved at {}", now()));
        }
        v.last_failure = None;
        Ok(())
    })?;
    let switched = config::switch_creating(repo, model, max_batch_size)?;
    release.serving = Some(switched.serving);
    release.created_config = switched.created;
    if fleet.replicas.is_empty() {
        return Ok(release);
    }
    let repository_config = read_config(repo, model)?.0;
    let rollout = replicas::roll_out(
        fleet.replicas,
        model,
        switched.serving,
        repository_config.as_deref(),
        fleet.continue_after_failure,
        fleet.reload_timeout,
        &mut |report| {
            on_step(Step::Replica {
                version: switched.serving,
                report,
            })
        },
    );
    let complete = rollout.complete();
    release.rollout = Some(rollout);
    let undo = !complete
        && !fleet.continue_after_failure
        && fleet_changes
        && switched.serving == version
        && serving_before.is_some();
    if undo {
        roll_back_automatically(repo, model, version, fleet, &mut release, on_step)?;
    }
    Ok(release)
}

/// After a failed rollout of `version`: the version is marked rolled back, the config names the
/// previous approved version again and the replicas the rollout reached reload it.
fn roll_back_automatically(
    repo: &Repository,
    model: &str,
    version: u64,
    fleet: &Fleet<'_>,
    release: &mut Release,
    on_step: &mut dyn FnMut(Step<'_>),
) -> Result<()> {
    let rollout = release.rollout.as_ref().expect("a rollout to undo");
    let reason = rollout
        .replicas
        .iter()
        .filter_map(|r| match &r.outcome {
            Outcome::Failed(e) => Some(format!("{} failed: {e}", r.server)),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("; ");
    let reached: Vec<String> = rollout
        .replicas
        .iter()
        .filter(|r| r.outcome == Outcome::Serving)
        .map(|r| r.server.clone())
        .collect();
    let note = format!("rolled back automatically at {}: {reason}", now());
    versions::update(repo, model, version, &mut |_, v| {
        if v.status == Status::Approved {
            v.status = Status::RolledBack;
        }
        v.last_failure = Some(note.clone());
        v.history.push(note.clone());
        Ok(())
    })?;
    let back = config::switch(repo, model)?;
    release.serving = Some(back);
    on_step(Step::RollingBack {
        to: back,
        reason: &reason,
    });
    release.rollback_reason = Some(reason);
    let repository_config = read_config(repo, model)?.0;
    release.rolled_back = Some(replicas::roll_out(
        &reached,
        model,
        back,
        repository_config.as_deref(),
        true,
        fleet.reload_timeout,
        &mut |report| {
            on_step(Step::RolledBack {
                version: back,
                report,
            })
        },
    ));
    Ok(())
}

/// Switches the config to what the records say after a status change, verifying first the
/// version that would then serve; `change` makes the record changes. Shared by reject and
/// rollback, whose direction (back to a version that served before) needs no canary.
fn switch_back(
    repo: &Repository,
    model: &str,
    version: u64,
    after: u64,
    fleet: &Fleet<'_>,
    on_step: &mut dyn FnMut(Step<'_>),
    change: &mut dyn FnMut() -> Result<()>,
) -> Result<Release> {
    let listed = versions::list(repo, model)?;
    let (_, configured) = read_config(repo, model)?;
    let mut release = Release {
        model: model.to_string(),
        version,
        serving_before: configured.as_ref().and_then(|c| c.last().copied()),
        ..Release::default()
    };
    if configured.as_deref() != Some(&[after]) {
        let target = find(&listed, repo, model, after)?;
        match verify(repo, model, &target, on_step) {
            Ok(verified) => release.verified = Some(verified),
            Err(reason) => {
                record_failure(
                    repo,
                    model,
                    after,
                    &format!("could not go back to it at {}: {reason}", now()),
                );
                release.refused = Some(format!(
                    "version {after}, which would serve instead, fails its gate: {reason}"
                ));
                return Ok(release);
            }
        }
    }
    change()?;
    let serving = config::switch(repo, model)?;
    release.serving = Some(serving);
    if !fleet.replicas.is_empty() {
        let repository_config = read_config(repo, model)?.0;
        release.rollout = Some(replicas::roll_out(
            fleet.replicas,
            model,
            serving,
            repository_config.as_deref(),
            fleet.continue_after_failure,
            fleet.reload_timeout,
            &mut |report| {
                on_step(Step::Replica {
                    version: serving,
                    report,
                })
            },
        ));
    }
    Ok(release)
}

/// Rejects `version`. Rejecting the serving version puts the fleet back on the previous approved
/// one (verified first); the only approved version cannot be rejected.
pub fn reject(
    repo: &Repository,
    model: &str,
    version: u64,
    fleet: &Fleet<'_>,
    on_step: &mut dyn FnMut(Step<'_>),
) -> Result<Release> {
    let listed = versions::list(repo, model)?;
    let info = find(&listed, repo, model, version)?;
    // What serves once the version is rejected: the newest approved version but it.
    let after = listed
        .iter()
        .filter(|v| v.status == Status::Approved && v.version != version)
        .map(|v| v.version)
        .max();
    let after = match after {
        Some(after) => after,
        None if info.status == Status::Approved => {
            return Err(RegistryError::Input(format!(
                "version {version} is the only approved version of {model}: rejecting it would \
                 leave nothing to serve; publish and approve another version first"
            )))
        }
        None => {
            return Err(RegistryError::Input(format!(
                "{model} has no approved version: publish one with --approve first"
            )))
        }
    };
    switch_back(repo, model, version, after, fleet, on_step, &mut || {
        versions::update(repo, model, version, &mut |_, v| {
            if v.status != Status::Rejected {
                v.status = Status::Rejected;
                v.history.push(format!("rejected at {}", now()));
            }
            Ok(())
        })
        .map(|_| ())
    })
}

/// Serves an earlier approved version: `to`, or the newest approved version older than the one
/// serving. Every approved version newer than it is marked rolled back (approving one again runs
/// its gates again).
pub fn rollback(
    repo: &Repository,
    model: &str,
    to: Option<u64>,
    fleet: &Fleet<'_>,
    on_step: &mut dyn FnMut(Step<'_>),
) -> Result<Release> {
    let listed = versions::list(repo, model)?;
    let serving = versions::serving(&listed)
        .ok_or_else(|| RegistryError::Input(format!("{model} has no approved version")))?;
    let target = match to {
        Some(to) => {
            let info = find(&listed, repo, model, to)?;
            if info.status != Status::Approved {
                return Err(RegistryError::Input(format!(
                    "{model} version {to} is {}, not approved: rollback serves an approved \
                     version (`recsys approve --version {to}` runs its gates and serves it)",
                    info.status
                )));
            }
            if to >= serving {
                return Err(RegistryError::Input(format!(
                    "{model} version {to} is not older than the serving version {serving}: \
                     nothing to roll back"
                )));
            }
            to
        }
        None => listed
            .iter()
            .filter(|v| v.status == Status::Approved && v.version < serving)
            .map(|v| v.version)
            .max()
            .ok_or_else(|| {
                RegistryError::Input(format!(
                    "{model} has no approved version older than the serving version {serving} \
                     to roll back to"
                ))
            })?,
    };
    let newer: Vec<u64> = listed
        .iter()
        .filter(|v| v.status == Status::Approved && v.version > target)
        .map(|v| v.version)
        .collect();
    switch_back(repo, model, serving, target, fleet, on_step, &mut || {
        // Newest first: a command killed half-way leaves the config's next switch on an
        // approved, complete version in between, and running it again finishes.
        for &v in newer.iter().rev() {
            let note = format!("rolled back at {} to version {target}", now());
            versions::update(repo, model, v, &mut |_, info| {
                if info.status == Status::Approved {
                    info.status = Status::RolledBack;
                    info.history.push(note.clone());
                }
                Ok(())
            })?;
        }
        Ok(())
    })
}

/// `publish --approve`: publishes the engine (pending), then approves it through the gates.
pub fn publish_and_approve(
    repo: &Repository,
    request: &PublishRequest<'_>,
    max_batch_size: u32,
    fleet: &Fleet<'_>,
    progress: &mut dyn FnMut(u64, u64),
    on_step: &mut dyn FnMut(Step<'_>),
) -> Result<(VersionInfo, Release)> {
    let info = publish::publish(repo, request, progress)?;
    let release = approve(
        repo,
        request.model,
        info.version,
        fleet,
        max_batch_size,
        on_step,
    )?;
    let info = versions::list(repo, request.model)?
        .into_iter()
        .find(|v| v.version == info.version)
        .unwrap_or(info);
    Ok((info, release))
}
