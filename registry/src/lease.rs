//! The lease on a model's fleet: one object, `<model>/recsys-lease.json`, created only if absent,
//! naming who holds it, the command it runs and when it expires. approve, reject, rollback and
//! prune take it before they read what they will change and hold it until they end, so two
//! operators (or CI and on-call) never roll one fleet in opposite directions at once: the second
//! command waits for the first, or fails naming it.
//!
//! While a command runs, a heartbeat renews its lease every quarter of [`LEASE_TTL`], and the
//! command renews it again before each replica, so a lease outlives a slow rollout (a reload may
//! take minutes) but not a killed command: [`LEASE_TTL`] after its last renewal the next command
//! takes it over with a conditional replace (on S3 and GCS, of two commands taking over the same
//! expired lease, one wins). Expiry is read on the clock of the machine that checks it: operators'
//! clocks must agree within the TTL (NTP). `--force` takes over a live lease, for a holder known to be dead; the old
//! holder then finds at its next renewal that it lost the lease and stops before touching another
//! replica. On a local directory (no conditional replace) a takeover is not atomic: local
//! repositories serve one machine, where two operators are rare.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::error::{RegistryError, Result};
use crate::store::{Object, Repository, WriteFence, STORE_REQUEST_BOUND};

/// The lease object's name inside the model folder (tritonserver ignores files there that are
/// not version folders or the config).
pub const LEASE_FILE: &str = "recsys-lease.json";

/// How long a lease lasts after its last renewal: how long a killed command blocks the next one.
pub const LEASE_TTL: Duration = Duration::from_secs(120);

// A write that passed its fence must land while the lease it renewed still holds: the store's
// longest request, retries included, fits in half the lease's lifetime (and a renewal slower
// than that half is refused).
const _: () = assert!(2 * STORE_REQUEST_BOUND.as_secs() <= LEASE_TTL.as_secs());

/// What the lease object says.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    /// Host and process of the command holding it.
    pub holder: String,
    /// The command, as its user would recognise it (`approve --version 6`).
    pub command: String,
    pub acquired_at: String,
    /// Seconds since the Unix epoch after which the lease is free to take over.
    pub expires_at_unix: u64,
    pub expires_at: String,
    /// Distinguishes two holders on one host and process id (a restarted process).
    pub token: String,
}

impl LeaseRecord {
    fn expired(&self, now: u64) -> bool {
        now >= self.expires_at_unix
    }

    /// "host pid 12 (`approve --version 6`, since ..., expires ...)".
    pub fn describe(&self) -> String {
        format!(
            "{} (`{}`, since {}, expires {})",
            self.holder, self.command, self.acquired_at, self.expires_at
        )
    }
}

/// How to take the lease.
#[derive(Clone, Debug)]
pub struct LeaseOptions {
    /// The command, for whoever finds the lease held.
    pub command: String,
    /// How long the lease lasts after each renewal ([`LEASE_TTL`]; the heartbeat renews it every
    /// quarter of that).
    pub ttl: Duration,
    /// How long to wait for a held lease before failing (zero: fail at once).
    pub wait: Duration,
    /// Take over a lease that has not expired (its holder is known to be dead).
    pub force: bool,
}

/// Whoever is waiting for a lease hears who holds it (once, when the wait starts).
pub type OnWait<'a> = &'a mut dyn FnMut(&LeaseRecord);

/// A held lease: released when dropped (a command that fails still lets the next one in).
/// Renewed through a shared reference, so a heartbeat thread and the command both can. While it
/// is held, every write through the repository handle it was taken with renews it first (a
/// compare-and-swap on the lease object): a command that lost it writes nothing more.
pub struct Lease<'a> {
    repo: &'a Repository,
    state: Arc<Held>,
    released: bool,
}

/// What the holder knows of its lease, shared with the repository's write fence.
struct Held {
    key: String,
    ttl: Duration,
    /// The record as this holder last wrote it; locked for the whole of a renewal.
    record: Mutex<LeaseRecord>,
    /// Why the lease was lost, once it was: every later renewal fails with it.
    lost: Mutex<Option<String>>,
}

/// This machine's clock, in seconds since the Unix epoch (shifted by the fault plan's clock skew
/// in the simulation tests' build only).
fn unix_now() -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    now.saturating_add_signed(crate::faults::clock_skew())
}

fn token() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{}-{nanos:x}", std::process::id())
}

pub fn lease_key(model: &str) -> String {
    format!("{model}/{LEASE_FILE}")
}

/// The lease on `model` as stored now, if any.
pub fn current(repo: &Repository, model: &str) -> Result<Option<LeaseRecord>> {
    let key = lease_key(model);
    repo.read(&key)?.map(|o| parse(repo, &key, &o)).transpose()
}

fn parse(repo: &Repository, key: &str, object: &Object) -> Result<LeaseRecord> {
    serde_json::from_slice(&object.bytes).map_err(|e| {
        RegistryError::Input(format!(
            "{}/{key} is not a recsys lease ({e}); if no command is running, delete it",
            repo.uri().trim_end_matches('/')
        ))
    })
}

fn rfc3339(unix: u64) -> String {
    recsys_engine::engine_dir::rfc3339_utc(unix as i64)
}

impl LeaseRecord {
    fn new(command: &str, ttl: Duration) -> LeaseRecord {
        let now = unix_now();
        let expires = now + ttl.as_secs().max(1);
        LeaseRecord {
            holder: crate::publish::publisher(),
            command: command.to_string(),
            acquired_at: rfc3339(now),
            expires_at_unix: expires,
            expires_at: rfc3339(expires),
            token: token(),
        }
    }

    fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec_pretty(self).expect("a lease serialises")
    }
}

/// Takes the lease on `model`: creates it, or takes over an expired one (or any, with `force`),
/// waiting up to `options.wait` for a live holder to finish. Fails with
/// [`RegistryError::LeaseHeld`] naming the holder when the wait ends.
pub fn acquire<'a>(
    repo: &'a Repository,
    model: &str,
    options: &LeaseOptions,
    on_wait: OnWait<'_>,
) -> Result<Lease<'a>> {
    let key = lease_key(model);
    let ttl = crate::faults::lease_ttl().unwrap_or(options.ttl);
    let started = std::time::Instant::now();
    let mut told = None::<String>;
    loop {
        let record = LeaseRecord::new(&options.command, ttl);
        if repo.create(&key, &record.to_bytes())? {
            return Lease::confirm(repo, key, record, ttl);
        }
        let Some(existing) = repo.read(&key)? else {
            // Released between the create and the read: try again at once.
            continue;
        };
        let held = parse(repo, &key, &existing)?;
        if held.expired(unix_now()) || options.force {
            if repo.replace(&key, &record.to_bytes(), &existing)? {
                return Lease::confirm(repo, key, record, ttl);
            }
            continue;
        }
        if started.elapsed() >= options.wait {
            return Err(RegistryError::LeaseHeld(format!(
                "{model} is being changed by {}; {}wait for it to finish, or, if that command is \
                 dead, take the lease over with --force (it expires by itself at {})",
                held.describe(),
                if options.wait.is_zero() {
                    String::new()
                } else {
                    format!("waited {} s; ", options.wait.as_secs())
                },
                held.expires_at
            )));
        }
        if told.as_deref() != Some(held.token.as_str()) {
            on_wait(&held);
            told = Some(held.token.clone());
        }
        std::thread::sleep(Duration::from_millis(500).min(options.wait - started.elapsed()));
    }
}

impl<'a> Lease<'a> {
    /// Reads the lease back after writing it: on a store without conditional replace, of two
    /// takeovers the one whose record stands holds it.
    fn confirm(
        repo: &'a Repository,
        key: String,
        record: LeaseRecord,
        ttl: Duration,
    ) -> Result<Lease<'a>> {
        let stands = match &repo.read(&key)? {
            Some(o) => parse(repo, &key, o)?.token == record.token,
            None => false,
        };
        if !stands {
            return Err(RegistryError::LeaseLost(format!(
                "another command took the lease on {key} at the same moment; run the command again"
            )));
        }
        let state = Arc::new(Held {
            key,
            ttl,
            record: Mutex::new(record),
            lost: Mutex::new(None),
        });
        repo.add_write_fence(state.clone());
        Ok(Lease {
            repo,
            state,
            released: false,
        })
    }

    pub fn record(&self) -> LeaseRecord {
        self.state.record.lock().expect("lease record").clone()
    }

    /// Extends the lease by its ttl from now. Fails with [`RegistryError::LeaseLost`] when another
    /// command took it over (`--force`, or after it expired), or when the store answered so late
    /// that the lease may have expired meanwhile: the caller must stop changing the fleet at once.
    pub fn renew(&self) -> Result<()> {
        self.state.renew(self.repo)
    }

    /// Runs `body` while a heartbeat renews the lease every quarter of its ttl. A heartbeat that
    /// finds the lease lost stops; the command's next write then fails (the write fence renews
    /// first). The heartbeat stops however `body` ends, a panic included, so a failing command
    /// never goes on holding the lease.
    pub fn with_heartbeat<R>(&self, body: impl FnOnce() -> R) -> R {
        /// Tells the heartbeat to stop when dropped: on return and on unwinding alike.
        struct StopOnDrop<'s>(&'s AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let stop = AtomicBool::new(false);
        let period = self.state.ttl / 4;
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let mut last = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(100));
                    if last.elapsed() >= period {
                        if let Err(RegistryError::LeaseLost(_)) = self.renew() {
                            return;
                        }
                        last = Instant::now();
                    }
                }
            });
            let _stop = StopOnDrop(&stop);
            body()
        })
    }

    /// Gives the lease up (deleting it only while it is still this holder's).
    pub fn release(mut self) -> Result<()> {
        self.released = true;
        self.repo.remove_write_fence(&*self.state);
        self.delete_if_mine()
    }

    fn delete_if_mine(&self) -> Result<()> {
        let Some(stored) = self.repo.read(&self.state.key)? else {
            return Ok(());
        };
        let token = self.record().token;
        if parse(self.repo, &self.state.key, &stored)?.token == token {
            self.repo.delete(&self.state.key)?;
        }
        Ok(())
    }
}

impl Held {
    /// Marks the lease lost for good and says why.
    fn lose(&self, why: String) -> RegistryError {
        *self.lost.lock().expect("lease state") = Some(why.clone());
        RegistryError::LeaseLost(why)
    }

    fn lost_to(&self, by: Option<LeaseRecord>) -> RegistryError {
        self.lose(match by {
            Some(other) => format!(
                "the lease on {} was taken over by {}; this command stopped changing the fleet",
                self.key,
                other.describe()
            ),
            None => format!(
                "the lease on {} was removed by another command; this command stopped changing \
                 the fleet",
                self.key
            ),
        })
    }

    fn renew(&self, repo: &Repository) -> Result<()> {
        if let Some(lost) = self.lost.lock().expect("lease state").clone() {
            return Err(RegistryError::LeaseLost(lost));
        }
        let mut record = self.record.lock().expect("lease record");
        let began = Instant::now();
        let Some(stored) = repo.read(&self.key)? else {
            return Err(self.lost_to(None));
        };
        let held = parse(repo, &self.key, &stored)?;
        if held.token != record.token {
            return Err(self.lost_to(Some(held)));
        }
        let expires = unix_now() + self.ttl.as_secs().max(1);
        let mut renewed = record.clone();
        renewed.expires_at_unix = expires;
        renewed.expires_at = rfc3339(expires);
        if !repo.replace(&self.key, &renewed.to_bytes(), &stored)? {
            let now = repo
                .read(&self.key)?
                .map(|o| parse(repo, &self.key, &o))
                .transpose()?;
            return Err(self.lost_to(now));
        }
        *record = renewed;
        // A renewal the store took half the lease's lifetime to answer leaves too little of it
        // for the write it guards: another command may take it over before that write lands.
        let took = began.elapsed();
        if took > self.ttl / 2 {
            return Err(self.lose(format!(
                "renewing the lease on {} took {:.0} s of its {} s lifetime (the store is slow or \
                 retrying); this command stopped changing the fleet rather than write after the \
                 lease may have expired",
                self.key,
                took.as_secs_f64(),
                self.ttl.as_secs()
            )));
        }
        Ok(())
    }
}

/// The lease as the repository's write fence: every write but the lease's own renews it first.
impl WriteFence for Held {
    fn key(&self) -> &str {
        &self.key
    }

    fn before_write(&self, repo: &Repository) -> Result<()> {
        self.renew(repo)
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        if !self.released {
            self.repo.remove_write_fence(&*self.state);
            // Best effort: a lease that cannot be deleted expires by itself.
            let _ = self.delete_if_mine();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(command: &str, wait_ms: u64) -> LeaseOptions {
        LeaseOptions {
            command: command.into(),
            ttl: LEASE_TTL,
            wait: Duration::from_millis(wait_ms),
            force: false,
        }
    }

    fn repositories(tmp: &std::path::Path) -> Vec<Repository> {
        vec![
            Repository::open(tmp.join("repo").to_str().unwrap()).unwrap(),
            Repository::in_memory(),
        ]
    }

    #[test]
    fn a_second_command_is_refused_naming_the_holder_until_the_first_releases() {
        let tmp = tempfile::tempdir().unwrap();
        for repo in repositories(tmp.path()) {
            let first =
                acquire(&repo, "m", &options("approve --version 6", 0), &mut |_| {}).unwrap();
            assert_eq!(current(&repo, "m").unwrap().unwrap(), first.record());
            let mut heard = Vec::new();
            let err = acquire(&repo, "m", &options("rollback", 1200), &mut |held| {
                heard.push(held.command.clone())
            })
            .err()
            .unwrap();
            assert!(matches!(err, RegistryError::LeaseHeld(_)), "{err}");
            let text = err.to_string();
            assert!(
                text.contains("approve --version 6") && text.contains("--force"),
                "{text}"
            );
            assert!(text.contains("waited 1 s"), "{text}");
            assert_eq!(heard, ["approve --version 6"], "told once who holds it");
            first.release().unwrap();
            assert!(current(&repo, "m").unwrap().is_none());
            let second = acquire(&repo, "m", &options("rollback", 0), &mut |_| {}).unwrap();
            drop(second);
            assert!(
                current(&repo, "m").unwrap().is_none(),
                "a dropped lease is released"
            );
        }
    }

    #[test]
    fn a_waiting_command_gets_the_lease_once_the_holder_releases_it() {
        let repo = std::sync::Arc::new(Repository::in_memory());
        let first = acquire(&repo, "m", &options("approve", 0), &mut |_| {}).unwrap();
        let token = first.record().token.clone();
        let waiter = {
            let repo = repo.clone();
            std::thread::spawn(move || {
                let lease = acquire(&repo, "m", &options("rollback", 10_000), &mut |_| {}).unwrap();
                lease.record().command.clone()
            })
        };
        std::thread::sleep(Duration::from_millis(700));
        assert_eq!(current(&repo, "m").unwrap().unwrap().token, token);
        first.release().unwrap();
        assert_eq!(waiter.join().unwrap(), "rollback");
    }

    #[test]
    fn an_expired_lease_is_taken_over_and_force_takes_a_live_one_whose_holder_then_stops() {
        let tmp = tempfile::tempdir().unwrap();
        for repo in repositories(tmp.path()) {
            // A killed holder: its lease is left behind, already expired.
            let mut dead = LeaseRecord::new("approve --version 3", Duration::from_secs(1));
            dead.expires_at_unix = unix_now() - 1;
            repo.overwrite(&lease_key("m"), &dead.to_bytes()).unwrap();
            let taken = acquire(&repo, "m", &options("rollback", 0), &mut |_| {}).unwrap();
            assert_eq!(current(&repo, "m").unwrap().unwrap().command, "rollback");
            taken.renew().unwrap();
            assert!(taken.record().expires_at_unix >= unix_now() + LEASE_TTL.as_secs() - 1);

            let forced = acquire(
                &repo,
                "m",
                &LeaseOptions {
                    force: true,
                    ..options("approve --version 4", 0)
                },
                &mut |_| {},
            )
            .unwrap();
            let err = taken.renew().unwrap_err();
            assert!(matches!(err, RegistryError::LeaseLost(_)), "{err}");
            assert!(err.to_string().contains("approve --version 4"), "{err}");
            // The old holder's drop must not delete the new holder's lease.
            drop(taken);
            assert_eq!(
                current(&repo, "m").unwrap().unwrap().token,
                forced.record().token
            );
            forced.release().unwrap();
        }
    }

    #[test]
    fn the_heartbeat_keeps_a_short_lease_alive_through_a_long_step() {
        let repo = Repository::in_memory();
        let lease = acquire(
            &repo,
            "m",
            &LeaseOptions {
                ttl: Duration::from_secs(2),
                ..options("approve", 0)
            },
            &mut |_| {},
        )
        .unwrap();
        let first_expiry = lease.record().expires_at_unix;
        // A step longer than the ttl (a slow reload), with no renewal of its own.
        lease.with_heartbeat(|| std::thread::sleep(Duration::from_millis(2600)));
        let stored = current(&repo, "m").unwrap().unwrap();
        assert!(stored.expires_at_unix > first_expiry, "{stored:?}");
        assert!(!stored.expired(unix_now()));
        let err = acquire(&repo, "m", &options("rollback", 0), &mut |_| {})
            .err()
            .unwrap();
        assert!(matches!(err, RegistryError::LeaseHeld(_)), "{err}");
        lease.renew().unwrap();
    }

    #[test]
    fn the_heartbeat_and_the_command_share_the_store_client_at_once() {
        // The command's own store calls and the heartbeat's renewals run on one current-thread
        // runtime from two threads: neither may block the other for good or fail.
        let tmp = tempfile::tempdir().unwrap();
        for repo in repositories(tmp.path()) {
            let lease = acquire(
                &repo,
                "m",
                &LeaseOptions {
                    ttl: Duration::from_secs(1),
                    ..options("approve", 0)
                },
                &mut |_| {},
            )
            .unwrap();
            let first_expiry = lease.record().expires_at_unix;
            let started = Instant::now();
            let writes = lease.with_heartbeat(|| {
                let mut n = 0;
                while started.elapsed() < Duration::from_millis(1500) {
                    repo.overwrite("m/1/record", format!("{n}").as_bytes())
                        .unwrap();
                    assert!(repo.read("m/1/record").unwrap().is_some());
                    n += 1;
                }
                n
            });
            assert!(writes > 10, "{writes}");
            // Renewed while the command worked: still held, not expired.
            let stored = current(&repo, "m").unwrap().unwrap();
            assert_eq!(stored.token, lease.record().token);
            assert!(stored.expires_at_unix > first_expiry, "{stored:?}");
            lease.renew().unwrap();
        }
    }

    #[test]
    fn a_command_that_panics_stops_its_heartbeat_and_lets_the_next_command_in() {
        // A panic in the body (stdout closed under `println!`, say) must end the command: its
        // heartbeat stops and the dropped lease is released, rather than renewed for ever.
        let repo = std::sync::Arc::new(Repository::in_memory());
        let (done, ended) = std::sync::mpsc::channel();
        let command = {
            let repo = repo.clone();
            std::thread::spawn(move || {
                let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let lease = acquire(
                        &repo,
                        "m",
                        &LeaseOptions {
                            ttl: Duration::from_secs(2),
                            ..options("approve --version 2", 0)
                        },
                        &mut |_| {},
                    )
                    .unwrap();
                    lease.with_heartbeat(|| {
                        std::thread::sleep(Duration::from_millis(700));
                        panic!("failed printing to stdout: Broken pipe");
                    })
                }));
                done.send(outcome.is_err()).unwrap();
            })
        };
        let panicked = ended
            .recv_timeout(Duration::from_secs(10))
            .expect("the command ended instead of renewing its lease for ever");
        assert!(panicked);
        command.join().unwrap();
        assert!(current(&repo, "m").unwrap().is_none(), "lease released");
        acquire(&repo, "m", &options("rollback", 0), &mut |_| {}).unwrap();
    }

    #[test]
    fn once_another_command_takes_the_lease_over_no_write_of_the_old_holder_lands() {
        let tmp = tempfile::tempdir().unwrap();
        for repo in repositories(tmp.path()) {
            let lease =
                acquire(&repo, "m", &options("approve --version 2", 0), &mut |_| {}).unwrap();
            // While it holds the lease, each write renews it first.
            let before = current(&repo, "m").unwrap().unwrap();
            std::thread::sleep(Duration::from_millis(1100));
            repo.overwrite("m/2/record", b"approved").unwrap();
            let renewed = current(&repo, "m").unwrap().unwrap();
            assert!(renewed.expires_at_unix > before.expires_at_unix);

            // Another process (its own handle on the store) forces the lease over.
            let other = repo.another_handle().unwrap();
            let forced = acquire(
                &other,
                "m",
                &LeaseOptions {
                    force: true,
                    ..options("rollback --force", 0)
                },
                &mut |_| {},
            )
            .unwrap();
            let staged = tmp.path().join("file");
            std::fs::write(&staged, b"engine").unwrap();
            let existing = repo.read("m/2/record").unwrap().unwrap();
            let refused = [
                repo.overwrite("m/config.pbtxt", b"version 2").err(),
                repo.create("m/3/record", b"x").err(),
                repo.replace("m/2/record", b"rolled back", &existing).err(),
                repo.delete("m/2/record").err(),
                repo.upload("m/3/file", &staged, &mut |_| {}).err(),
            ];
            for err in refused {
                let err = err.expect("a write after the takeover was refused");
                assert!(matches!(err, RegistryError::LeaseLost(_)), "{err}");
                assert!(err.to_string().contains("rollback --force"), "{err}");
            }
            assert!(repo.read("m/config.pbtxt").unwrap().is_none());
            assert!(repo.read("m/3/record").unwrap().is_none());
            assert_eq!(repo.read("m/2/record").unwrap().unwrap().bytes, b"approved");
            assert!(matches!(lease.renew(), Err(RegistryError::LeaseLost(_))));
            // The new holder writes; the old one's release leaves its lease alone.
            other.overwrite("m/config.pbtxt", b"version 1").unwrap();
            drop(lease);
            assert_eq!(
                current(&repo, "m").unwrap().unwrap().token,
                forced.record().token
            );
            // The old handle writes again once it holds no lease (a later command).
            repo.overwrite("m/notes", b"x").unwrap();
            forced.release().unwrap();
        }
    }

    #[test]
    fn a_lease_that_is_not_a_lease_is_named() {
        let repo = Repository::in_memory();
        repo.overwrite(&lease_key("m"), b"garbage").unwrap();
        let err = acquire(&repo, "m", &options("approve", 0), &mut |_| {})
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("recsys-lease.json is not a recsys lease"),
            "{err}"
        );
    }
}
