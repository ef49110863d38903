//! Rolling the fleet onto the version the repository names: every replica (a tritonserver in
//! explicit model-control mode) is asked to reload the model, one after another, and counts as
//! done only when it serves that version and no other. A replica may be named directly or through
//! a DNS name that resolves to several addresses (a Kubernetes headless Service), which stands for
//! one replica per address.

use std::net::{IpAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::error::{RegistryError, Result};
use crate::triton::{
    describe, in_transition, loaded_config, override_config, post_load, ready_versions,
    wait_for_versions, LIVENESS_TIMEOUT,
};

/// `http://host:port` split into its parts (the scheme defaults to http).
fn split_url(server: &str) -> Result<(String, String, u16)> {
    let (scheme, rest) = match server.split_once("://") {
        Some((scheme @ ("http" | "https"), rest)) => (scheme.to_string(), rest),
        Some((scheme, _)) => {
            return Err(RegistryError::Usage(format!(
                "--server {server:?}: {scheme}:// is not a tritonserver HTTP endpoint (http://host:port)"
            )))
        }
        None => ("http".to_string(), server),
    };
    let authority = rest.split('/').next().unwrap_or_default();
    let bad = || {
        RegistryError::Usage(format!(
            "--server {server:?} is not host:port (e.g. http://127.0.0.1:8000)"
        ))
    };
    let (host, port) = if let Some(inner) = authority.strip_prefix('[') {
        let (host, after) = inner.split_once(']').ok_or_else(bad)?;
        (host.to_string(), after.strip_prefix(':').ok_or_else(bad)?)
    } else {
        let (host, port) = authority.rsplit_once(':').ok_or_else(bad)?;
        (host.to_string(), port)
    };
    let port: u16 = port.parse().map_err(|_| bad())?;
    if host.is_empty() {
        return Err(bad());
    }
    Ok((scheme, host, port))
}

fn url(scheme: &str, ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(v4) => format!("{scheme}://{v4}:{port}"),
        IpAddr::V6(v6) => format!("{scheme}://[{v6}]:{port}"),
    }
}

/// The replicas behind `servers`, resolving names with `resolve`: a name with several addresses
/// stands for one replica per address (IPv4 ones if it has any, so `localhost` stays one replica).
pub fn expand_with(
    servers: &[String],
    resolve: &dyn Fn(&str, u16) -> std::io::Result<Vec<IpAddr>>,
) -> Result<Vec<String>> {
    let mut out: Vec<String> = Vec::new();
    for server in servers {
        let (scheme, host, port) = split_url(server)?;
        let base = format!(
            "{scheme}://{}",
            server.split_once("://").map_or(server.as_str(), |(_, r)| r)
        )
        .trim_end_matches('/')
        .to_string();
        let expanded = if host.parse::<IpAddr>().is_ok() {
            vec![base]
        } else {
            let addresses = resolve(&host, port).map_err(|e| {
                RegistryError::Input(format!("--server {server}: cannot resolve {host}: {e}"))
            })?;
            let mut v4: Vec<IpAddr> = addresses.iter().copied().filter(IpAddr::is_ipv4).collect();
            if v4.is_empty() {
                v4 = addresses;
            }
            v4.sort();
            v4.dedup();
            match v4.len() {
                0 => {
                    return Err(RegistryError::Input(format!(
                        "--server {server}: {host} resolves to no address"
                    )))
                }
                1 => vec![base],
                _ => v4.into_iter().map(|ip| url(&scheme, ip, port)).collect(),
            }
        };
        for replica in expanded {
            if !out.contains(&replica) {
                out.push(replica);
            }
        }
    }
    Ok(out)
}

/// [`expand_with`] through the system resolver.
pub fn expand(servers: &[String]) -> Result<Vec<String>> {
    expand_with(servers, &|host, port| {
        Ok((host, port).to_socket_addrs()?.map(|a| a.ip()).collect())
    })
}

/// How one replica fared.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Serves the version, and only it.
    Serving,
    Failed(String),
    /// Not live (starting, terminating, or gone): not a load failure. A replica that starts
    /// loads what the repository names; the reconcile pass looks at it again.
    Unreachable(String),
    /// Left alone: an earlier replica failed and the rollout stops at the first failure.
    NotAttempted,
    /// Left alone: the command stopped before it (the repository names another version now, the
    /// lease was taken over, or the store failed).
    Stopped(String),
}

impl Outcome {
    pub fn name(&self) -> &'static str {
        match self {
            Outcome::Serving => "serving",
            Outcome::Failed(_) => "failed",
            Outcome::Unreachable(_) => "unreachable",
            Outcome::NotAttempted => "not attempted",
            Outcome::Stopped(_) => "stopped",
        }
    }

    pub fn error(&self) -> Option<&str> {
        match self {
            Outcome::Failed(e) | Outcome::Unreachable(e) | Outcome::Stopped(e) => Some(e),
            Outcome::Serving | Outcome::NotAttempted => None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct ReplicaReport {
    pub server: String,
    pub outcome: Outcome,
    /// The replica was asked to reload (`false`: it already served the version alone).
    pub reloaded: bool,
    /// It failed by running out of time: its load may still be under way (see
    /// [`RolloutPlan::force_reload`]).
    pub timed_out: bool,
    pub seconds: f64,
}

/// The outcome of a rollout, replica by replica, in the order they were taken.
#[derive(Clone, Debug)]
pub struct Rollout {
    pub model: String,
    pub version: u64,
    pub replicas: Vec<ReplicaReport>,
    /// Why the rollout stopped before its last replica, if it did.
    pub halted: Option<String>,
}

impl Rollout {
    /// Every replica serves the version.
    pub fn complete(&self) -> bool {
        self.replicas.iter().all(|r| r.outcome == Outcome::Serving)
    }

    /// Some replica failed to load the version (unreachable ones do not count).
    pub fn failed(&self) -> bool {
        self.replicas
            .iter()
            .any(|r| matches!(r.outcome, Outcome::Failed(_)))
    }

    /// How many replicas serve the version.
    pub fn serving(&self) -> usize {
        self.replicas
            .iter()
            .filter(|r| r.outcome == Outcome::Serving)
            .count()
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "model": self.model,
            "version": self.version,
            "complete": self.complete(),
            "halted": self.halted,
            "replicas": self.replicas.iter().map(|r| {
                serde_json::json!({
                    "server": r.server,
                    "outcome": r.outcome.name(),
                    "error": r.outcome.error(),
                    "reloaded": r.reloaded,
                    "timed_out": r.timed_out,
                    "seconds": r.seconds,
                })
            }).collect::<Vec<_>>(),
        })
    }
}

/// How a rollout treats its replicas.
pub struct RolloutPlan<'a> {
    pub model: &'a str,
    pub version: u64,
    /// The repository's config.pbtxt (for a load by override, see [`reload_and_wait`]).
    pub repository_config: Option<&'a str>,
    /// Go on past a failed replica (otherwise the rest are not attempted).
    pub continue_after_failure: bool,
    /// The longest one replica may take to load the version.
    pub timeout: Duration,
    /// Replicas reloaded even if they already serve the version alone: those that ran out of time
    /// in an earlier pass of the command. A load that outlasted its timeout goes on in the replica,
    /// which keeps serving the old version while it downloads and loads and switches when it
    /// ends; a reload queues behind it and then loads what the config names.
    pub force_reload: &'a [String],
}

/// Brings each replica in turn onto `plan.version`: a replica that already serves it alone is
/// left as it is, the others reload and count when they serve it and no other. `guard` runs
/// before each replica (the caller renews its lease and checks the repository still names the
/// version); its error stops the rollout there and is returned with the report. A failure stops
/// the rollout unless `continue_after_failure`; an unreachable replica never does.
pub fn roll_out(
    replicas: &[String],
    plan: &RolloutPlan<'_>,
    guard: &mut dyn FnMut() -> Result<()>,
    on_replica: &mut dyn FnMut(&ReplicaReport),
) -> (Rollout, Option<RegistryError>) {
    let mut reports = Vec::new();
    let mut failed = false;
    let mut halted: Option<RegistryError> = None;
    for server in replicas {
        let started = Instant::now();
        let mut reloaded = false;
        let mut timed_out = false;
        let outcome = if let Some(reason) = &halted {
            Outcome::Stopped(reason.to_string())
        } else if failed && !plan.continue_after_failure {
            Outcome::NotAttempted
        } else if let Err(e) = guard() {
            let outcome = Outcome::Stopped(e.to_string());
            halted = Some(e);
            outcome
        } else {
            match converge_one(server, plan) {
                Ok(did_reload) => {
                    reloaded = did_reload;
                    Outcome::Serving
                }
                Err(ReplicaError::NotLive(e)) => Outcome::Unreachable(e),
                Err(ReplicaError::Failed(e)) => {
                    reloaded = true;
                    failed = true;
                    Outcome::Failed(e)
                }
                Err(ReplicaError::TimedOut(e)) => {
                    reloaded = true;
                    failed = true;
                    timed_out = true;
                    Outcome::Failed(e)
                }
            }
        };
        let report = ReplicaReport {
            server: server.clone(),
            outcome,
            reloaded,
            timed_out,
            seconds: started.elapsed().as_secs_f64(),
        };
        on_replica(&report);
        reports.push(report);
    }
    let rollout = Rollout {
        model: plan.model.to_string(),
        version: plan.version,
        replicas: reports,
        halted: halted.as_ref().map(|e| e.to_string()),
    };
    (rollout, halted)
}

/// Why a replica is not on the version.
#[derive(Debug)]
pub enum ReplicaError {
    /// It did not answer its liveness probe.
    NotLive(String),
    /// It answered and did not come to serve the version.
    Failed(String),
    /// Its reload did not end within the timeout: the load may still be under way.
    TimedOut(String),
}

impl std::fmt::Display for ReplicaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplicaError::NotLive(e) | ReplicaError::Failed(e) | ReplicaError::TimedOut(e) => {
                f.write_str(e)
            }
        }
    }
}

fn agent(timeout: Duration) -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout_connect(Duration::from_secs(5))
        .timeout(timeout)
        .build()
}

fn check_live(
    agent: &ureq::Agent,
    base: &str,
    timeout: Duration,
) -> std::result::Result<(), ReplicaError> {
    agent
        .get(&format!("{base}/v2/health/live"))
        .timeout(LIVENESS_TIMEOUT.min(timeout))
        .call()
        .map(|_| ())
        .map_err(|e| {
            ReplicaError::NotLive(format!(
                "the server is not live (no answer to /v2/health/live within {:?}): {}",
                LIVENESS_TIMEOUT.min(timeout),
                describe(e)
            ))
        })
}

/// One replica onto `plan.version`: `Ok(false)` when it already served it alone, `Ok(true)` once
/// a reload brought it there.
fn converge_one(server: &str, plan: &RolloutPlan<'_>) -> std::result::Result<bool, ReplicaError> {
    let base = server.trim_end_matches('/');
    let agent = agent(plan.timeout);
    check_live(&agent, base, plan.timeout)?;
    let serves_it_alone =
        ready_versions(&agent, base, plan.model).is_ok_and(|v| v == [plan.version.to_string()]);
    // A load still under way (one that outlasted an earlier pass's timeout) would switch the
    // replica when it ends: the reload below waits for it and then loads what the config names.
    let forced = plan.force_reload.iter().any(|f| f == server);
    if serves_it_alone && !forced && !in_transition(&agent, base, plan.model) {
        return Ok(false);
    }
    // Liveness was checked above: one GET per replica, not two.
    reload_live(
        &agent,
        base,
        plan.model,
        plan.version,
        plan.repository_config,
        plan.timeout,
    )
    .map(|()| true)
}

/// The versions of `model` that `server` has ready now (for a prune, which must keep them).
pub fn ready_on(server: &str, model: &str) -> std::result::Result<Vec<u64>, ReplicaError> {
    let base = server.trim_end_matches('/');
    let agent = agent(LIVENESS_TIMEOUT * 2);
    check_live(&agent, base, LIVENESS_TIMEOUT)?;
    match ready_versions(&agent, base, model) {
        Ok(versions) => Ok(versions.iter().filter_map(|v| v.parse().ok()).collect()),
        // A replica without the model (never loaded, or unloaded) has no metadata for it.
        Err(_) => Ok(Vec::new()),
    }
}

/// How long a replica may keep serving another version after its reload returned before the
/// rollout loads the version by a config override. Triton's load call returns once the load is
/// done; a replica still on the old version then did not see the repository change (Triton
/// decides by modification times, which an object store keeps to the second: a config written in
/// the same second as the replica's previous load, e.g. right after a canary, looks unchanged).
const RELOAD_GRACE: Duration = Duration::from_secs(3);

/// Asks one tritonserver (explicit model control) to reload `model`, then waits until it serves
/// `version` and no other. `server` is like `http://127.0.0.1:8000`. A replica that does not
/// answer `/v2/health/live` within [`LIVENESS_TIMEOUT`] fails at once. A replica that reloads but
/// keeps the old version is loaded with a config override naming `version`
/// ([`override_config`], from `repository_config`: the repository's config.pbtxt).
pub fn reload_and_wait(
    server: &str,
    model: &str,
    version: u64,
    repository_config: Option<&str>,
    timeout: Duration,
) -> std::result::Result<(), ReplicaError> {
    let base = server.trim_end_matches('/');
    let agent = agent(timeout);
    check_live(&agent, base, timeout)?;
    reload_live(&agent, base, model, version, repository_config, timeout)
}

/// [`reload_and_wait`] on a replica already known to be live, through `agent`.
fn reload_live(
    agent: &ureq::Agent,
    base: &str,
    model: &str,
    version: u64,
    repository_config: Option<&str>,
    timeout: Duration,
) -> std::result::Result<(), ReplicaError> {
    let failed = |text: String| ReplicaError::Failed(text);
    post_load(agent, base, model, None).map_err(|e| {
        let e = e.to_string();
        if e.contains("timed out") {
            ReplicaError::TimedOut(format!(
                "the reload of {model} did not finish within {timeout:?} (--reload-timeout; the \
                 replica may still be loading, and the next pass reloads it again): {e}"
            ))
        } else {
            failed(format!("the server refused to reload {model}: {e}"))
        }
    })?;
    if wait_for_versions(agent, base, model, &[version], RELOAD_GRACE.min(timeout)).is_ok() {
        return Ok(());
    }
    let still = ready_versions(agent, base, model).unwrap_or_default();
    if !still.is_empty() && !still.contains(&version.to_string()) {
        let config = override_config(
            model,
            version,
            repository_config,
            loaded_config(agent, base, model).as_ref(),
        );
        post_load(agent, base, model, Some(&config)).map_err(|e| {
            failed(format!(
                "the server kept versions {still:?} after the reload and refused to load \
                 version {version} by override: {e}"
            ))
        })?;
    }
    wait_for_versions(agent, base, model, &[version], timeout).map_err(|e| {
        let text = format!("{model} version {version} was not the only ready version: {e}");
        // A load that failed says so in the index; anything else ran out of time.
        if e.contains(" failed to load: ") {
            failed(text)
        } else {
            ReplicaError::TimedOut(text)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake(host: &str, _port: u16) -> std::io::Result<Vec<IpAddr>> {
        match host {
            "replicas.svc" => Ok(vec![
                "10.0.0.2".parse().unwrap(),
                "10.0.0.1".parse().unwrap(),
                "10.0.0.2".parse().unwrap(),
                "fd00::1".parse().unwrap(),
            ]),
            "localhost" => Ok(vec!["127.0.0.1".parse().unwrap(), "::1".parse().unwrap()]),
            "v6only" => Ok(vec!["fd00::1".parse().unwrap(), "fd00::2".parse().unwrap()]),
            _ => Err(std::io::Error::other("no such host")),
        }
    }

    #[test]
    fn names_with_several_addresses_become_one_replica_each() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            expand_with(&s(&["http://replicas.svc:8000"]), &fake).unwrap(),
            s(&["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
        );
        assert_eq!(
            expand_with(&s(&["localhost:8000", "http://localhost:8000/"]), &fake).unwrap(),
            s(&["http://localhost:8000"])
        );
        assert_eq!(
            expand_with(&s(&["http://v6only:8000"]), &fake).unwrap(),
            s(&["http://[fd00::1]:8000", "http://[fd00::2]:8000"])
        );
        assert_eq!(
            expand_with(
                &s(&["http://127.0.0.1:8000", "http://127.0.0.1:8001"]),
                &fake
            )
            .unwrap(),
            s(&["http://127.0.0.1:8000", "http://127.0.0.1:8001"])
        );
        let err = expand_with(&s(&["http://nowhere:8000"]), &fake)
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot resolve nowhere"), "{err}");
        let err = expand_with(&s(&["grpc://a:8001"]), &fake)
            .unwrap_err()
            .to_string();
        assert!(err.contains("grpc://"), "{err}");
        let err = expand_with(&s(&["http://a"]), &fake)
            .unwrap_err()
            .to_string();
        assert!(err.contains("host:port"), "{err}");
    }

    fn plan(timeout: Duration) -> RolloutPlan<'static> {
        RolloutPlan {
            model: "m",
            version: 2,
            repository_config: None,
            continue_after_failure: false,
            timeout,
            force_reload: &[],
        }
    }

    fn dead_ports(n: usize) -> Vec<String> {
        (0..n)
            .map(|_| {
                let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                format!("http://{}", l.local_addr().unwrap())
            })
            .collect()
    }

    #[test]
    fn replicas_that_are_not_live_are_unreachable_not_failed_and_do_not_stop_the_rollout() {
        // Nothing listens on these ports (a pod terminating, or not started yet).
        let dead = dead_ports(3);
        let mut heard = 0;
        let (rollout, halted) = roll_out(
            &dead,
            &plan(Duration::from_secs(2)),
            &mut || Ok(()),
            &mut |_| heard += 1,
        );
        assert!(halted.is_none());
        assert_eq!(heard, 3);
        assert!(!rollout.complete() && !rollout.failed());
        assert!(rollout
            .replicas
            .iter()
            .all(|r| matches!(r.outcome, Outcome::Unreachable(_)) && !r.reloaded));
        assert_eq!(rollout.to_json()["replicas"][2]["outcome"], "unreachable");
    }

    #[test]
    fn a_guard_that_fails_stops_the_rollout_before_the_next_replica() {
        let dead = dead_ports(3);
        let mut calls = 0;
        let (rollout, halted) = roll_out(
            &dead,
            &plan(Duration::from_secs(2)),
            &mut || {
                calls += 1;
                if calls == 2 {
                    Err(RegistryError::Input(
                        "the repository names version 5 now".into(),
                    ))
                } else {
                    Ok(())
                }
            },
            &mut |_| {},
        );
        assert_eq!(calls, 2, "no replica is taken after the guard refused");
        assert!(halted.unwrap().to_string().contains("version 5"));
        let outcomes: Vec<&str> = rollout.replicas.iter().map(|r| r.outcome.name()).collect();
        assert_eq!(outcomes, ["unreachable", "stopped", "stopped"]);
        assert!(rollout.halted.as_deref().unwrap().contains("version 5"));
    }

    #[test]
    fn a_replica_that_accepts_but_never_answers_is_unreachable_within_the_liveness_timeout() {
        // A listener that takes connections and reads them but never writes a byte: a hung or
        // stopping server. The reload's own timeout (here 120 s) must not be what ends the wait.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let server = format!("http://{}", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            // Every connection is kept open, unanswered, until the test process exits.
            let mut open = Vec::new();
            for stream in listener.incoming().flatten() {
                open.push(stream);
            }
        });
        let started = Instant::now();
        let (report, _) = roll_out(
            std::slice::from_ref(&server),
            &plan(Duration::from_secs(120)),
            &mut || Ok(()),
            &mut |_| {},
        );
        let waited = started.elapsed();
        let Outcome::Unreachable(error) = &report.replicas[0].outcome else {
            panic!(
                "a silent replica must be unreachable: {:?}",
                report.replicas[0].outcome
            );
        };
        assert!(error.contains("not live"), "{error}");
        assert!(
            waited < LIVENESS_TIMEOUT + Duration::from_secs(5),
            "the rollout waited {waited:?} on a silent replica"
        );
    }
}
