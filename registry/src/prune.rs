//! `versions --prune --keep N`: deletes old versions from the repository. Triton copies every
//! version folder of a model from object storage at each load, so a model with many old versions
//! loads slower and takes more local disk with every approve. Never pruned: the N newest
//! versions, the serving version, the previous approved one (the automatic rollback's target),
//! pending versions (awaiting a decision), incomplete ones (an upload may be in progress), the
//! versions config.pbtxt names and the versions any named replica has loaded. A prune takes the
//! model's lease, and refuses while the config and the records disagree (a command stopped
//! between its two writes), naming the command that finishes the switch.
//!
//! A version is taken apart so that no step leaves something that could serve: its record first
//! says `incomplete` (never served, never approved), then its files go, the record last. A prune
//! killed half-way leaves an incomplete version, which the next prune finishes.

use crate::config::{policy_versions, CONFIG_FILE};
use crate::error::{RegistryError, Result};
use crate::lease::{self, LeaseOptions};
use crate::replicas::{self, ReplicaError};
use crate::store::Repository;
use crate::versions::{self, Status, VersionInfo, VERSION_FILE};

/// The history line that marks a version being pruned (so the next prune may finish it).
const PRUNING: &str = "pruning started at ";

/// What a prune removed and kept.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pruned {
    pub removed: Vec<u64>,
    /// Each kept version older than the N newest, with why.
    pub kept: Vec<(u64, &'static str)>,
}

fn being_pruned(info: &VersionInfo) -> bool {
    info.status == Status::Incomplete
        && info
            .history
            .last()
            .is_some_and(|line| line.starts_with(PRUNING))
}

/// Versions kept whatever their status, with why (named by the config, loaded on a replica).
pub type Protected = [(u64, &'static str)];

/// Which versions a prune keeping `keep` would remove, and why the others stay.
pub fn plan(listed: &[VersionInfo], keep: usize, protected: &Protected) -> Pruned {
    let serving = versions::serving(listed);
    let previous = serving.and_then(|s| {
        listed
            .iter()
            .filter(|v| v.status == Status::Approved && v.version < s)
            .map(|v| v.version)
            .max()
    });
    let newest: Vec<u64> = listed.iter().rev().take(keep).map(|v| v.version).collect();
    let mut plan = Pruned::default();
    for info in listed {
        let v = info.version;
        if newest.contains(&v) {
            continue;
        }
        let why = if Some(v) == serving {
            Some("serving")
        } else if Some(v) == previous {
            Some("previous approved (the rollback target)")
        } else if let Some((_, why)) = protected.iter().find(|(p, _)| *p == v) {
            Some(*why)
        } else if info.status == Status::Pending {
            Some("pending")
        } else if info.status == Status::Incomplete && !being_pruned(info) {
            Some("incomplete (an upload may be in progress)")
        } else {
            None
        };
        match why {
            Some(why) => plan.kept.push((v, why)),
            None => plan.removed.push(v),
        }
    }
    plan
}

/// What a prune is asked to do.
pub struct PruneRequest<'a> {
    pub model: &'a str,
    /// How many of the newest versions stay whatever their status.
    pub keep: usize,
    /// Plan only.
    pub dry_run: bool,
    /// Replicas (already resolved) whose loaded versions stay.
    pub replicas: &'a [String],
    pub lease: LeaseOptions,
}

/// The versions the config names: never pruned. Refuses when they are not what the records say
/// serves (a reject, rollback or approve stopped between its record write and its config write).
fn configured(repo: &Repository, model: &str, listed: &[VersionInfo]) -> Result<Vec<u64>> {
    let Some(config) = repo.read(&format!("{model}/{CONFIG_FILE}"))? else {
        return Ok(Vec::new());
    };
    let text = String::from_utf8_lossy(&config.bytes);
    let named = policy_versions(&text).unwrap_or_default();
    let serving = versions::serving(listed);
    if let Some(serving) = serving {
        if !named.is_empty() && named != [serving] {
            return Err(RegistryError::Input(format!(
                "{CONFIG_FILE} names version(s) {named:?} but the records say version {serving} \
                 serves (a command stopped between its two writes): nothing pruned. Finish the \
                 switch first:\n  recsys approve --repository {} --model {model} --version \
                 {serving}",
                repo.uri()
            )));
        }
    }
    Ok(named)
}

/// Prunes `request.model` down to its `keep` newest versions (and those [`plan`] keeps).
/// `on_removed` hears each version once it is gone; `on_unreachable` each named replica that
/// could not be asked what it has loaded (it loads what the config names when it starts).
pub fn prune(
    repo: &Repository,
    request: &PruneRequest<'_>,
    on_unreachable: &mut dyn FnMut(&str, &str),
    on_removed: &mut dyn FnMut(u64),
) -> Result<Pruned> {
    let model = request.model;
    let lease = lease::acquire(repo, model, &request.lease, &mut |_| {})?;
    let mut protected: Vec<(u64, &'static str)> = Vec::new();
    for server in request.replicas {
        match replicas::ready_on(server, model) {
            Ok(loaded) => {
                protected.extend(loaded.into_iter().map(|v| (v, "loaded on a replica")));
            }
            Err(ReplicaError::NotLive(e)) => on_unreachable(server, &e),
            Err(ReplicaError::Failed(e) | ReplicaError::TimedOut(e)) => {
                return Err(RegistryError::Input(format!(
                    "cannot ask {server} which versions it has loaded: {e}"
                )))
            }
        }
    }
    let listed = versions::list(repo, model)?;
    for v in configured(repo, model, &listed)? {
        protected.push((v, "named by config.pbtxt"));
    }
    let planned = plan(&listed, request.keep, &protected);
    if !request.dry_run {
        lease.with_heartbeat(|| remove(repo, request, &protected, &planned, on_removed))?;
    }
    lease.release()?;
    Ok(planned)
}

/// Takes the planned versions apart, each in the order that never leaves something that could
/// serve.
fn remove(
    repo: &Repository,
    request: &PruneRequest<'_>,
    protected: &Protected,
    planned: &Pruned,
    on_removed: &mut dyn FnMut(u64),
) -> Result<()> {
    let model = request.model;
    for &version in &planned.removed {
        versions::update(repo, model, version, &mut |listed, info| {
            // Re-checked on the fresh listing: a concurrent approve may have made it the
            // serving or previous version since the plan.
            if !plan(listed, request.keep, protected)
                .removed
                .contains(&version)
            {
                return Err(RegistryError::Input(format!(
                    "{model} version {version} changed during the prune; run it again"
                )));
            }
            if !being_pruned(info) {
                info.status = Status::Incomplete;
                info.history.push(format!(
                    "{PRUNING}{}",
                    recsys_engine::engine_dir::utc_now_rfc3339()
                ));
            }
            Ok(())
        })?;
        let folder = format!("{model}/{version}");
        for (name, _) in repo.files(&folder)? {
            if name != VERSION_FILE {
                repo.delete(&format!("{folder}/{name}"))?;
            }
        }
        repo.delete(&versions::record_key(model, version))?;
        repo.remove_empty_folder(&folder)?;
        on_removed(version);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(version: u64, status: Status) -> VersionInfo {
        let mut info: VersionInfo = serde_json::from_value(serde_json::json!({
            "version": version, "status": "pending", "created_at": "", "model_kind": "",
            "precision": "", "source_checkpoint": "", "source_sha256": "", "metrics": null,
            "history": [],
        }))
        .unwrap();
        info.status = status;
        info
    }

    #[test]
    fn the_plan_never_takes_the_serving_previous_pending_or_in_progress_versions() {
        use Status::*;
        let listed: Vec<VersionInfo> = [
            (1, Approved),
            (2, Rejected),
            (3, Pending),
            (4, Approved),
            (5, Incomplete),
            (6, RolledBack),
            (7, Approved),
            (8, Rejected),
        ]
        .into_iter()
        .map(|(v, s)| info(v, s))
        .collect();
        let p = plan(&listed, 1, &[]);
        assert_eq!(p.removed, [1, 2, 6]);
        assert_eq!(
            p.kept.iter().map(|(v, _)| *v).collect::<Vec<_>>(),
            [3, 4, 5, 7]
        );
        assert_eq!(plan(&listed, 3, &[]).removed, [1, 2]);
        assert_eq!(plan(&listed, 8, &[]).removed, Vec::<u64>::new());
        // What the config names or a replica has loaded stays, whatever its status.
        let p = plan(
            &listed,
            1,
            &[(6, "named by config.pbtxt"), (2, "loaded on a replica")],
        );
        assert_eq!(p.removed, [1]);
        assert!(
            p.kept.contains(&(6, "named by config.pbtxt")),
            "{:?}",
            p.kept
        );
        assert!(p.kept.contains(&(2, "loaded on a replica")), "{:?}", p.kept);
        // An interrupted prune's leftover is taken by the next one.
        let mut leftover = listed.clone();
        leftover[4].history.push(format!("{PRUNING}then"));
        assert_eq!(plan(&leftover, 1, &[]).removed, [1, 2, 5, 6]);
    }
}
