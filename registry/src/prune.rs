//! `versions --prune --keep N`: deletes old versions from the repository. Triton copies every
//! version folder of a model from object storage at each load, so a model with many old versions
//! loads slower and takes more local disk with every approve. Never pruned: the N newest
//! versions, the serving version, the previous approved one (the automatic rollback's target),
//! pending versions (awaiting a decision) and incomplete ones (an upload may be in progress).
//!
//! A version is taken apart so that no step leaves something that could serve: its record first
//! says `incomplete` (never served, never approved), then its files go, the record last. A prune
//! killed half-way leaves an incomplete version, which the next prune finishes.

use crate::error::Result;
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

/// Which versions a prune keeping `keep` would remove, and why the others stay.
pub fn plan(listed: &[VersionInfo], keep: usize) -> Pruned {
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

/// Prunes `model` down to its `keep` newest versions (and those [`plan`] keeps); `dry_run` only
/// plans. `on_removed` hears each version once it is gone.
pub fn prune(
    repo: &Repository,
    model: &str,
    keep: usize,
    dry_run: bool,
    on_removed: &mut dyn FnMut(u64),
) -> Result<Pruned> {
    let listed = versions::list(repo, model)?;
    let planned = plan(&listed, keep);
    if dry_run {
        return Ok(planned);
    }
    for &version in &planned.removed {
        versions::update(repo, model, version, &mut |listed, info| {
            // Re-checked on the fresh listing: a concurrent approve may have made it the
            // serving or previous version since the plan.
            if !plan(listed, keep).removed.contains(&version) {
                return Err(crate::RegistryError::Input(format!(
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
    Ok(planned)
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
        let p = plan(&listed, 1);
        assert_eq!(p.removed, [1, 2, 6]);
        assert_eq!(
            p.kept.iter().map(|(v, _)| *v).collect::<Vec<_>>(),
            [3, 4, 5, 7]
        );
        assert_eq!(plan(&listed, 3).removed, [1, 2]);
        assert_eq!(plan(&listed, 8).removed, Vec::<u64>::new());
        // An interrupted prune's leftover is taken by the next one.
        let mut leftover = listed.clone();
        leftover[4].history.push(format!("{PRUNING}then"));
        assert_eq!(plan(&leftover, 1).removed, [1, 2, 5, 6]);
    }
}
