//! `approve` and `reject`: change one version's record, then point the config at the newest
//! approved version. Both steps are single object writes; a command killed between them leaves
//! the config on the previous version, which is still approved and complete, and the next
//! command (or the same one run again) finishes the switch.

use crate::config;
use crate::error::{RegistryError, Result};
use crate::store::Repository;
use crate::versions::{self, Status};

/// Sets `version`'s status and returns the version the config names afterwards.
pub fn set_status(repo: &Repository, model: &str, version: u64, status: Status) -> Result<u64> {
    if status == Status::Incomplete || status == Status::Pending {
        return Err(RegistryError::Usage(format!(
            "a version can be approved or rejected, not set to {status}"
        )));
    }
    for _ in 0..16 {
        let listed = versions::list(repo, model)?;
        let Some(index) = listed.iter().position(|v| v.version == version) else {
            return Err(RegistryError::Input(format!(
                "{}/{model} has no version {version} (versions: {})",
                repo.uri().trim_end_matches('/'),
                listed
                    .iter()
                    .map(|v| v.version.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        };
        let current = &listed[index];
        if status == Status::Approved && current.status == Status::Incomplete {
            return Err(RegistryError::Input(format!(
                "{model} version {version} is incomplete: its publish ({}) has not finished or \
                 was stopped, so it cannot serve; publish the engine again (it gets a new version)",
                current.publisher.as_deref().unwrap_or("publisher unknown")
            )));
        }
        if status == Status::Rejected
            && current.status == Status::Approved
            && !listed
                .iter()
                .any(|v| v.status == Status::Approved && v.version != version)
        {
            return Err(RegistryError::Input(format!(
                "version {version} is the only approved version of {model}: rejecting it would \
                 leave nothing to serve; publish and approve another version first"
            )));
        }
        let mut changed = current.clone();
        changed.status = status;
        changed.history.push(format!(
            "{status} at {}",
            recsys_engine::engine_dir::utc_now_rfc3339()
        ));
        let key = versions::record_key(model, version);
        let written = match repo.read(&key)? {
            Some(object) => repo.replace(&key, &changed.to_json(), &object)?,
            None => repo.create(&key, &changed.to_json())?,
        };
        if written {
            return config::switch(repo, model);
        }
        // Another command changed this record between our read and our write: look again.
    }
    Err(RegistryError::Input(format!(
        "the record of {model} version {version} kept changing under concurrent commands; run \
         the command again"
    )))
}
