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

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::canary::{self, Canary, CanaryReport};
use crate::config::{self, policy_versions, CONFIG_FILE};
use crate::error::{RegistryError, Result};
use crate::integrity::{self, Verified};
use crate::lease::{self, Lease, LeaseOptions, LeaseRecord, LEASE_TTL};
use crate::publish::{self, PublishRequest};
use crate::quality::{self, EvalCase, QualityCheck, QualityOptions, EVAL_SET_FILE};
use crate::replicas::{self, Outcome, ReplicaReport, Rollout, RolloutPlan};
use crate::self_check::{SelfCheck, SELF_CHECK_K};
use crate::store::Repository;
use crate::versions::{self, Status, VersionInfo};

/// The replicas a command reaches, and how.
pub struct Fleet<'a> {
    /// The replicas as named on the command line: URLs, or names that resolve to one replica per
    /// address (a headless Service). Resolved again at every pass, so a pod the autoscaler adds
    /// during a command is reached by its reconcile pass.
    pub servers: &'a [String],
    /// A file listing one replica URL per line (written by a service-discovery agent), read again
    /// at every pass like `servers`.
    pub servers_file: Option<&'a Path>,
    /// The canary replica: outside the traffic path (no client reaches it), it loads a candidate
    /// before the repository names it. Reconciled with the fleet at the end of every command.
    pub canary: Option<&'a str>,
    /// Without a canary replica, run the canary on the first live traffic replica (clients of that
    /// replica may get answers from the unapproved candidate while it is tested).
    pub canary_on_traffic: bool,
    /// Go on past a failed replica, and never roll back automatically.
    pub continue_after_failure: bool,
    /// The longest one replica may take to load a version.
    pub reload_timeout: Duration,
    /// How the command takes the model's lease.
    pub lease: LeaseOptions,
    /// How an approve's canary runs the quality gate.
    pub quality: QualityOptions,
}

/// The reload timeout when none is given: the manifests' load allowance (their startup probe
/// gives a pod 10 minutes to load its models).
pub const DEFAULT_RELOAD_TIMEOUT: Duration = Duration::from_secs(600);

impl Fleet<'_> {
    /// No replicas (the repository alone), failing at once on a held lease.
    pub fn none() -> Fleet<'static> {
        Fleet {
            servers: &[],
            servers_file: None,
            canary: None,
            canary_on_traffic: false,
            continue_after_failure: false,
            reload_timeout: DEFAULT_RELOAD_TIMEOUT,
            lease: LeaseOptions {
                command: "recsys".into(),
                ttl: LEASE_TTL,
                wait: Duration::ZERO,
                force: false,
            },
            quality: QualityOptions::default(),
        }
    }

    /// Whether the command names any replica (the canary included).
    pub fn has_replicas(&self) -> bool {
        self.has_traffic() || self.canary.is_some()
    }

    /// Whether the command names traffic replicas.
    pub fn has_traffic(&self) -> bool {
        !self.servers.is_empty() || self.servers_file.is_some()
    }

    /// The traffic replicas as they resolve now.
    pub fn resolve(&self) -> Result<Vec<String>> {
        let mut named: Vec<String> = self.servers.to_vec();
        if let Some(file) = self.servers_file {
            let text = std::fs::read_to_string(file).map_err(RegistryError::io(format!(
                "cannot read the replica list {}",
                file.display()
            )))?;
            let listed: Vec<String> = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(str::to_string)
                .collect();
            // An empty list is far more likely an agent caught mid-rewrite than a fleet of no
            // replicas: going on would switch the repository and reach nobody.
            if listed.is_empty() {
                return Err(RegistryError::Input(format!(
                    "the replica list {} names no replica (empty, or comments only; a \
                     service-discovery agent may be rewriting it): refusing to change a fleet \
                     this command cannot see; run it again once the list is written, or name \
                     the replicas with --server",
                    file.display()
                )));
            }
            named.extend(listed);
        }
        replicas::expand(&named)
    }

    /// Checks, before anything changes, that the fleet the command names resolves and that the
    /// quality gate's settings are usable: a command that cannot reach its fleet fails closed.
    fn check_before_changing(&self) -> Result<()> {
        if self.has_traffic() {
            self.resolve()?;
        }
        if !self.quality.skip {
            quality::check_max_drop(self.quality.max_drop).map_err(RegistryError::Usage)?;
        }
        Ok(())
    }

    /// Every replica a reconcile pass reaches: the traffic replicas and the canary.
    fn resolve_with_canary(&self) -> Result<Vec<String>> {
        let mut all = self.resolve()?;
        if let Some(canary) = self.canary {
            for c in replicas::expand(&[canary.to_string()])? {
                if !all.contains(&c) {
                    all.push(c);
                }
            }
        }
        Ok(all)
    }
}

/// What a command is doing, as it happens (for progress output).
pub enum Step<'a> {
    /// Another command holds the model's lease: this one waits (up to the lease's wait).
    WaitingForLease(&'a LeaseRecord),
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
    /// A replica of the automatic rollback onto `version` (the whole fleet, resolved again).
    RolledBack {
        version: u64,
        report: &'a ReplicaReport,
    },
    /// The closing pass over the fleet, resolved again: every replica against what the
    /// repository names.
    Reconciling {
        version: u64,
    },
    Reconciled {
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
    /// Why a gate refused: the repository did not change.
    pub refused: Option<String>,
    pub verified: Option<Verified>,
    pub canary: Option<CanaryReport>,
    /// The canary replica serves the candidate still after the command (it could not be put back,
    /// not even by the reconcile pass): recorded on the version.
    pub canary_stranded: Option<String>,
    pub rollout: Option<Rollout>,
    /// The automatic rollback's pass over the fleet.
    pub rolled_back: Option<Rollout>,
    /// Why the automatic rollback happened.
    pub rollback_reason: Option<String>,
    /// The closing reconcile pass: every replica (resolved again) against the config.
    pub reconciled: Option<Rollout>,
    /// The repository came to name another version during this one (another command changed
    /// it): this one stopped changing replicas.
    pub superseded: Option<String>,
    /// This command's lease was lost (taken over with `--force` or after it expired, or a renewal
    /// the store answered too late): it stopped before its next write.
    pub lease_lost: Option<String>,
    /// An error once the repository began to change (a record written; the config switched or
    /// not): a store or resolution failure. The report holds what was done up to it.
    pub failed_after_switch: Option<String>,
    /// Whose lease the command waited for before it began.
    pub waited_for: Option<String>,
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
            "canary_stranded": self.canary_stranded,
            "rollout": self.rollout.as_ref().map(Rollout::to_json),
            "rolled_back": self.rolled_back.as_ref().map(Rollout::to_json),
            "rollback_reason": self.rollback_reason,
            "reconciled": self.reconciled.as_ref().map(Rollout::to_json),
            "superseded": self.superseded,
            "lease_lost": self.lease_lost,
            "failed_after_switch": self.failed_after_switch,
            "waited_for_lease": self.waited_for,
        })
    }

    /// Every replica the closing pass reached serves what the repository names.
    pub fn fleet_converged(&self) -> bool {
        self.reconciled.as_ref().is_none_or(Rollout::complete)
    }

    /// Records an error met after the switch (an error stopping the fleet's convergence): a
    /// takeover by another command, or a failure.
    fn halt(&mut self, error: RegistryError) {
        match error {
            RegistryError::LeaseLost(e) => {
                self.lease_lost.get_or_insert(e);
            }
            RegistryError::Superseded(e) => {
                self.superseded.get_or_insert(e);
            }
            other => {
                self.failed_after_switch.get_or_insert(other.to_string());
            }
        }
    }

    /// Replicas that ran out of time in a pass of this command so far: a load that timed out may
    /// still be under way, so what they show is not what they will serve.
    fn failed_replicas(&self) -> Vec<String> {
        [&self.rollout, &self.rolled_back, &self.reconciled]
            .into_iter()
            .flatten()
            .flat_map(|r| &r.replicas)
            .filter(|r| r.timed_out)
            .map(|r| r.server.clone())
            .collect()
    }

    fn halted(&self) -> bool {
        self.superseded.is_some() || self.lease_lost.is_some() || self.failed_after_switch.is_some()
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

/// Takes the model's lease for the command, telling `on_step` whose lease it waits for.
fn take_lease<'r>(
    repo: &'r Repository,
    model: &str,
    fleet: &Fleet<'_>,
    release: &mut Release,
    on_step: &mut dyn FnMut(Step<'_>),
) -> Result<Lease<'r>> {
    lease::acquire(repo, model, &fleet.lease, &mut |held| {
        release.waited_for = Some(held.describe());
        on_step(Step::WaitingForLease(held));
    })
}

/// Releases the lease at the end of a command that got as far as it could. A failure to delete it
/// (the store failing) must not hide what the command did: the lease then expires by itself.
fn give_back(lease: Lease<'_>, release: &mut Release) {
    if let Err(e) = lease.release() {
        if release.failed_after_switch.is_none() && release.serving.is_some() {
            release.failed_after_switch = Some(format!(
                "the lease could not be released ({e}); it expires by itself"
            ));
        }
    }
}

/// The guard a pass runs before each replica: the lease still this command's (renewed), and the
/// repository still naming `version`.
fn still_ours(lease: &Lease<'_>, repo: &Repository, model: &str, version: u64) -> Result<()> {
    lease.renew()?;
    match read_config(repo, model)?.1 {
        Some(named) if named == [version] => Ok(()),
        named => Err(RegistryError::Superseded(format!(
            "{CONFIG_FILE} names {} now, not version {version}: another command changed the \
             repository; this command stopped changing the fleet",
            match named {
                Some(v) => format!("version(s) {v:?}"),
                None => "no version".into(),
            }
        ))),
    }
}

/// Which pass over the fleet, deciding who is reached, whether a failure stops it and how its
/// replicas are reported.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// The rollout after a switch: the traffic replicas; stops at a failure unless asked not to.
    Rollout,
    /// The automatic rollback: the traffic replicas, every one of them.
    RollBack,
    /// The closing pass: the traffic replicas and the canary, every one of them.
    Reconcile,
}

/// One pass over the fleet as it resolves now, bringing every replica onto `version` (the
/// version the config names). The pass's error (resolution, store, takeover) is returned with
/// its report.
#[allow(clippy::too_many_arguments)]
fn converge(
    lease: &Lease<'_>,
    repo: &Repository,
    model: &str,
    version: u64,
    fleet: &Fleet<'_>,
    pass: Pass,
    failed_before: &[String],
    on_step: &mut dyn FnMut(Step<'_>),
) -> (Rollout, Option<RegistryError>) {
    let empty = |halted: Option<String>| Rollout {
        model: model.to_string(),
        version,
        replicas: Vec::new(),
        halted,
    };
    let resolved = if pass == Pass::Reconcile {
        fleet.resolve_with_canary()
    } else {
        fleet.resolve()
    };
    let replicas = match resolved {
        Ok(replicas) => replicas,
        Err(e) => return (empty(Some(e.to_string())), Some(e)),
    };
    let repository_config = match read_config(repo, model) {
        Ok((text, _)) => text,
        Err(e) => return (empty(Some(e.to_string())), Some(e)),
    };
    replicas::roll_out(
        &replicas,
        &RolloutPlan {
            model,
            version,
            repository_config: repository_config.as_deref(),
            continue_after_failure: pass != Pass::Rollout || fleet.continue_after_failure,
            timeout: fleet.reload_timeout,
            force_reload: failed_before,
        },
        &mut || still_ours(lease, repo, model, version),
        &mut |report| {
            on_step(match pass {
                Pass::Rollout => Step::Replica { version, report },
                Pass::RollBack => Step::RolledBack { version, report },
                Pass::Reconcile => Step::Reconciled { version, report },
            })
        },
    )
}

/// The closing pass of every command that names replicas: the fleet (and the canary) resolved
/// again, each replica compared with what the config names and reloaded where it differs.
fn reconcile(
    lease: &Lease<'_>,
    repo: &Repository,
    model: &str,
    fleet: &Fleet<'_>,
    release: &mut Release,
    on_step: &mut dyn FnMut(Step<'_>),
) {
    if !fleet.has_replicas() || release.halted() {
        return;
    }
    let named = match read_config(repo, model) {
        Ok((_, Some(named))) if named.len() == 1 => named[0],
        // No config yet, or one that names no single version: nothing to reconcile onto.
        Ok(_) => return,
        Err(e) => return release.halt(e),
    };
    on_step(Step::Reconciling { version: named });
    let (report, halted) = converge(
        lease,
        repo,
        model,
        named,
        fleet,
        Pass::Reconcile,
        &release.failed_replicas(),
        on_step,
    );
    release.reconciled = Some(report);
    if let Some(e) = halted {
        release.halt(e);
    }
}

/// After the canary and the reconcile pass: a canary replica still not back on what the
/// repository names is stranded on the candidate, which is recorded on the version.
fn note_stranded_canary(repo: &Repository, model: &str, version: u64, release: &mut Release) {
    let Some(canary) = &release.canary else {
        return;
    };
    let Err(restore_error) = &canary.restored else {
        return;
    };
    let back_by_reconcile = release.reconciled.as_ref().is_some_and(|r| {
        r.replicas
            .iter()
            .any(|x| x.server == canary.server && x.outcome == Outcome::Serving)
    });
    if back_by_reconcile {
        return;
    }
    let note = format!(
        "canary {} could not be put back at {}: {restore_error}; it may still serve version \
         {version} (outside the traffic path when it is a --canary replica)",
        canary.server,
        now()
    );
    record_failure(repo, model, version, &note);
    release.canary_stranded = Some(note);
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
    fleet.check_before_changing()?;
    let mut release = Release {
        model: model.to_string(),
        version,
        ..Release::default()
    };
    let lease = take_lease(repo, model, fleet, &mut release, on_step)?;
    lease.with_heartbeat(|| -> Result<()> {
        approve_leased(
            repo,
            model,
            version,
            fleet,
            max_batch_size,
            &lease,
            &mut release,
            on_step,
        )?;
        reconcile(&lease, repo, model, fleet, &mut release, on_step);
        note_stranded_canary(repo, model, version, &mut release);
        Ok(())
    })?;
    give_back(lease, &mut release);
    Ok(release)
}

#[allow(clippy::too_many_arguments)]
fn approve_leased(
    repo: &Repository,
    model: &str,
    version: u64,
    fleet: &Fleet<'_>,
    max_batch_size: u32,
    lease: &Lease<'_>,
    release: &mut Release,
    on_step: &mut dyn FnMut(Step<'_>),
) -> Result<()> {
    let listed = versions::list(repo, model)?;
    let info = find(&listed, repo, model, version)?;
    if info.status == Status::Incomplete {
        return Err(incomplete(model, &info));
    }
    let (config_text, configured) = read_config(repo, model)?;
    let serving_before = versions::serving(&listed);
    // What the config will name: the newest approved version once this one is approved.
    let target = serving_before.map_or(version, |s| s.max(version));
    let target_info = find(&listed, repo, model, target)?;
    let fleet_changes = configured.as_deref() != Some(&[target]);
    release.serving_before = configured.as_ref().and_then(|c| c.last().copied());
    let needs_canary = fleet_changes && fleet.has_replicas();
    if needs_canary && fleet.canary.is_none() && !fleet.canary_on_traffic {
        return Err(RegistryError::Usage(
            "no canary replica: name one outside the traffic path with --canary URL, or pass \
             --canary-on-traffic to test the candidate on the first live traffic replica \
             (its clients may then get answers from the unapproved version)"
                .into(),
        ));
    }
    let refuse = |release: &mut Release, checked: u64, reason: String| {
        record_failure(
            repo,
            model,
            checked,
            &format!("approve refused at {}: {reason}", now()),
        );
        release.refused = Some(reason);
    };

    // The gates run on what the config will name (the target), and on the version itself when
    // it is not approved yet.
    let mut to_verify = Vec::new();
    if info.status != Status::Approved {
        to_verify.push(&info);
    }
    if fleet_changes && !to_verify.iter().any(|v| v.version == target) {
        to_verify.push(&target_info);
    }
    for checked in to_verify {
        match verify(repo, model, checked, on_step) {
            Ok(verified) => release.verified = Some(verified),
            Err(reason) => {
                refuse(release, checked.version, reason);
                return Ok(());
            }
        }
    }
    if needs_canary {
        let check = match &target_info.self_check {
            Some(check) => check.clone(),
            None => blind_check(repo, model, target)?,
        };
        let quality_check = if fleet.quality.skip {
            let note = format!(
                "quality gate skipped (--skip-quality-gate) at {} by {}",
                now(),
                publish::publisher()
            );
            versions::update(repo, model, target, &mut |_, v| {
                v.history.push(note.clone());
                Ok(())
            })?;
            None
        } else {
            Some(quality_check(
                repo,
                model,
                &target_info,
                release
                    .serving_before
                    .and_then(|s| find(&listed, repo, model, s).ok()),
                &listed,
                &check,
                &fleet.quality,
            )?)
        };
        lease.renew()?;
        let traffic;
        let canary_replicas: &[String] = match fleet.canary {
            Some(canary) => {
                traffic = replicas::expand(&[canary.to_string()])?;
                &traffic
            }
            None => {
                traffic = fleet.resolve()?;
                &traffic
            }
        };
        let report = canary::run(
            canary_replicas,
            &Canary {
                model,
                version: target,
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
                quality: quality_check.as_ref(),
            },
        );
        on_step(Step::Canary(&report));
        if let Some(judged) = &report.quality {
            versions::update(repo, model, target, &mut |_, v| {
                v.quality = Some(judged.clone());
                Ok(())
            })?;
        }
        let failed = report
            .result
            .as_ref()
            .err()
            .map(|e| format!("canary on {}: {e}", report.server));
        release.canary = Some(report);
        if let Some(reason) = failed {
            refuse(release, target, reason);
            return Ok(());
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
    // The record says approved: from here on the repository has changed, and an error is part of
    // the report (exit 7), not a refusal.
    let switched = match config::switch_creating(repo, model, max_batch_size) {
        Ok(switched) => switched,
        Err(e) => {
            release.halt(e);
            return Ok(());
        }
    };
    release.serving = Some(switched.serving);
    release.created_config = switched.created;
    if !fleet.has_traffic() {
        return Ok(());
    }
    // From here on the repository has changed: errors become part of the report.
    let (rollout, halted) = converge(
        lease,
        repo,
        model,
        switched.serving,
        fleet,
        Pass::Rollout,
        &[],
        on_step,
    );
    let failed = rollout.failed();
    release.rollout = Some(rollout);
    if let Some(e) = halted {
        release.halt(e);
        return Ok(());
    }
    let undo = failed
        && !fleet.continue_after_failure
        && fleet_changes
        && switched.serving == version
        && serving_before.is_some();
    if undo {
        if let Err(e) =
            roll_back_automatically(repo, model, version, fleet, lease, release, on_step)
        {
            release.halt(e);
        }
    }
    Ok(())
}

/// The held-out histories the canary asks the candidate and the serving version: the candidate's
/// own evaluation set, else the serving version's, else the newest other version's that has one
/// (the model's held-out data outlives the version it was published with), else (degenerate
/// scores only) the self-check's history.
fn quality_check(
    repo: &Repository,
    model: &str,
    candidate: &VersionInfo,
    serving: Option<VersionInfo>,
    listed: &[VersionInfo],
    check: &SelfCheck,
    options: &QualityOptions,
) -> Result<QualityCheck> {
    let strings = check.history.iter().any(Value::is_string);
    let has_set = |info: &VersionInfo| info.files.iter().any(|(name, _)| name == EVAL_SET_FILE);
    let owner = [Some(candidate.clone()), serving]
        .into_iter()
        .flatten()
        .chain(listed.iter().rev().cloned())
        .find(has_set);
    let Some(owner) = owner else {
        return Ok(QualityCheck {
            cases: vec![EvalCase {
                history: check.history.clone(),
                target: None,
            }],
            source: "no evaluation set (publish --eval-set): degenerate scores checked on the \
                     self-check's history only"
                .into(),
            max_drop: options.max_drop,
        });
    };
    let key = format!("{model}/{}/{EVAL_SET_FILE}", owner.version);
    let text = repo
        .read(&key)?
        .ok_or_else(|| RegistryError::Input(format!("{key} is listed but missing")))?
        .bytes;
    let cases = recsys_engine::metrics::parse_test_set(
        &String::from_utf8_lossy(&text),
        std::path::Path::new(&key),
    )?;
    let cases = quality::sample(&cases, strings, options.histories);
    Ok(QualityCheck {
        source: format!(
            "{} held-out histories of version {}'s evaluation set",
            cases.len(),
            owner.version
        ),
        cases,
        max_drop: options.max_drop,
    })
}

fn incomplete(model: &str, info: &VersionInfo) -> RegistryError {
    RegistryError::Input(format!(
        "{model} version {} is incomplete ({}): it was not published by `recsys publish`, or its \
         publish has not finished or was stopped, so it cannot serve; publish the engine (it gets \
         a new version)",
        info.version,
        match &info.publisher {
            Some(p) => format!("publisher {p}"),
            None => info.history.last().cloned().unwrap_or_default(),
        }
    ))
}

/// After a failed rollout of `version`: the version is marked rolled back, the config names the
/// previous approved version again and every replica of the fleet, resolved again, is brought
/// back onto it (not only those the rollout reached: a replica whose load outlasted the timeout,
/// or a pod added since the switch, may serve `version` too).
fn roll_back_automatically(
    repo: &Repository,
    model: &str,
    version: u64,
    fleet: &Fleet<'_>,
    lease: &Lease<'_>,
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
    let note = format!("rolled back automatically at {}: {reason}", now());
    lease.renew()?;
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
    let (report, halted) = converge(
        lease,
        repo,
        model,
        back,
        fleet,
        Pass::RollBack,
        &release.failed_replicas(),
        on_step,
    );
    release.rolled_back = Some(report);
    match halted {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Reads the records and says which version a reject or rollback is about and which will serve.
type PlanBack<'a> = &'a mut dyn FnMut(&[VersionInfo]) -> Result<(u64, u64)>;
/// Makes a reject's or rollback's record changes (given the records, the version, the target).
type ChangeRecords<'a> = &'a mut dyn FnMut(&[VersionInfo], u64, u64) -> Result<()>;

/// Switches the config to what the records say after a status change, verifying first the
/// version that would then serve; `change` makes the record changes. Shared by reject and
/// rollback, whose direction (back to a version that served before) needs no canary. `plan`
/// reads the records (under the lease) and says which version the command is about and which
/// will serve.
fn switch_back(
    repo: &Repository,
    model: &str,
    fleet: &Fleet<'_>,
    on_step: &mut dyn FnMut(Step<'_>),
    plan: PlanBack<'_>,
    change: ChangeRecords<'_>,
) -> Result<Release> {
    fleet.check_before_changing()?;
    let mut release = Release {
        model: model.to_string(),
        ..Release::default()
    };
    let lease = take_lease(repo, model, fleet, &mut release, on_step)?;
    lease.with_heartbeat(|| {
        switch_back_leased(
            repo,
            model,
            fleet,
            &lease,
            &mut release,
            on_step,
            plan,
            change,
        )
    })?;
    give_back(lease, &mut release);
    Ok(release)
}

#[allow(clippy::too_many_arguments)]
fn switch_back_leased(
    repo: &Repository,
    model: &str,
    fleet: &Fleet<'_>,
    lease: &Lease<'_>,
    release: &mut Release,
    on_step: &mut dyn FnMut(Step<'_>),
    plan: PlanBack<'_>,
    change: ChangeRecords<'_>,
) -> Result<()> {
    let listed = versions::list(repo, model)?;
    let (version, after) = plan(&listed)?;
    release.version = version;
    let (_, configured) = read_config(repo, model)?;
    release.serving_before = configured.as_ref().and_then(|c| c.last().copied());
    if configured.as_deref() != Some(&[after]) {
        let target = find(&listed, repo, model, after)?;
        let verified = verify(repo, model, &target, on_step);
        if let Err(reason) = verified {
            record_failure(
                repo,
                model,
                after,
                &format!("could not go back to it at {}: {reason}", now()),
            );
            release.refused = Some(format!(
                "version {after}, which would serve instead, fails its gate: {reason}"
            ));
            reconcile(lease, repo, model, fleet, release, on_step);
            return Ok(());
        }
        release.verified = verified.ok();
    }
    // A change of several records (a rollback) may stop half-way, and a switch may fail after its
    // write: from the first record change on, an error is part of the report (exit 7).
    let switched = change(&listed, version, after).and_then(|()| config::switch(repo, model));
    let serving = match switched {
        Ok(serving) => serving,
        Err(e) => {
            release.halt(e);
            return Ok(());
        }
    };
    release.serving = Some(serving);
    if fleet.has_traffic() {
        let (report, halted) = converge(
            lease,
            repo,
            model,
            serving,
            fleet,
            Pass::Rollout,
            &[],
            on_step,
        );
        release.rollout = Some(report);
        if let Some(e) = halted {
            release.halt(e);
        }
    }
    reconcile(lease, repo, model, fleet, release, on_step);
    Ok(())
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
    switch_back(
        repo,
        model,
        fleet,
        on_step,
        &mut |listed| {
            let info = find(listed, repo, model, version)?;
            // What serves once the version is rejected: the newest approved version but it.
            let after = listed
                .iter()
                .filter(|v| v.status == Status::Approved && v.version != version)
                .map(|v| v.version)
                .max();
            match after {
                Some(after) => Ok((version, after)),
                None if info.status == Status::Approved => Err(RegistryError::Input(format!(
                    "version {version} is the only approved version of {model}: rejecting it \
                     would leave nothing to serve; publish and approve another version first"
                ))),
                None => Err(RegistryError::Input(format!(
                    "{model} has no approved version: publish one with --approve first"
                ))),
            }
        },
        &mut |_, _, _| {
            versions::update(repo, model, version, &mut |_, v| {
                if v.status != Status::Rejected {
                    v.status = Status::Rejected;
                    v.history.push(format!("rejected at {}", now()));
                }
                Ok(())
            })
            .map(|_| ())
        },
    )
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
    switch_back(
        repo,
        model,
        fleet,
        on_step,
        &mut |listed| {
            let serving = versions::serving(listed)
                .ok_or_else(|| RegistryError::Input(format!("{model} has no approved version")))?;
            let target = match to {
                Some(to) => {
                    let info = find(listed, repo, model, to)?;
                    if info.status != Status::Approved {
                        return Err(RegistryError::Input(format!(
                            "{model} version {to} is {}, not approved: rollback serves an \
                             approved version (`recsys approve --version {to}` runs its gates \
                             and serves it)",
                            info.status
                        )));
                    }
                    if to >= serving {
                        return Err(RegistryError::Input(format!(
                            "{model} version {to} is not older than the serving version \
                             {serving}: nothing to roll back"
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
                            "{model} has no approved version older than the serving version \
                             {serving} to roll back to"
                        ))
                    })?,
            };
            Ok((serving, target))
        },
        &mut |listed, _, target| {
            let newer: Vec<u64> = listed
                .iter()
                .filter(|v| v.status == Status::Approved && v.version > target)
                .map(|v| v.version)
                .collect();
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
        },
    )
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
