//! A version's status changed alone, without gates or a rollout (the registry's tests set up
//! states with it; the commands go through [`crate::release`]): change one version's record,
//! then point the config at the newest approved version. Both steps are single object writes; a
//! command killed between them leaves the config on the previous version, which is still
//! approved and complete, and the next command (or the same one run again) finishes the switch.

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
    versions::update(repo, model, version, &mut |listed, current| {
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
        current.status = status;
        current.history.push(format!(
            "{status} at {}",
            recsys_engine::engine_dir::utc_now_rfc3339()
        ));
        Ok(())
    })?;
    config::switch(repo, model)
}
