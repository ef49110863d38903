//! The exit statuses of the release commands, one per outcome a script may act on (the user guide,
//! docs/guide/src/release.md, where each is named).

/// A gate refused the version: the repository is unchanged (the reason is recorded on the
/// version).
pub const REFUSED_EXIT: i32 = 3;
/// The repository changed but not every replica serves what it names (`--rollout continue`, a
/// failed or unreachable replica the reconcile pass could not bring over).
pub const PARTIAL_ROLLOUT_EXIT: i32 = 4;
/// A replica failed after the switch and the command rolled itself back.
pub const ROLLED_BACK_EXIT: i32 = 5;
/// Another command holds the model's lease: nothing changed.
pub const LEASE_HELD_EXIT: i32 = 6;
/// An error after the config switched (the object store, a replica list that no longer
/// resolves): the report says what was done.
pub const FAILED_AFTER_SWITCH_EXIT: i32 = 7;
/// The canary could not be put back on the serving version (recorded on the version).
pub const CANARY_STRANDED_EXIT: i32 = 8;
/// The repository came to name another version during this one (another command changed it):
/// this one stopped changing replicas.
pub const SUPERSEDED_EXIT: i32 = 9;
/// This command's lease was lost while it ran (taken over with `--force` or after it expired):
/// it wrote nothing after that.
pub const LEASE_LOST_EXIT: i32 = 10;
