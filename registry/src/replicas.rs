//! Rolling the fleet onto the version the repository names: every replica (a tritonserver in
//! explicit model-control mode) is asked to reload the model, one after another, and counts as
//! done only when it serves that version and no other. A replica may be named directly or through
//! a DNS name that resolves to several addresses (a Kubernetes headless Service), which stands for
//! one replica per address.

use std::net::{IpAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::error::{RegistryError, Result};
use crate::triton::{
    describe, loaded_config, override_config, post_load, ready_versions, wait_for_versions,
    LIVENESS_TIMEOUT,
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
    /// Left alone: an earlier replica failed and the rollout stops at the first failure.
    NotAttempted,
}

#[derive(Clone, Debug)]
pub struct ReplicaReport {
    pub server: String,
    pub outcome: Outcome,
    pub seconds: f64,
}

/// The outcome of a rollout, replica by replica, in the order they were taken.
#[derive(Clone, Debug)]
pub struct Rollout {
    pub model: String,
    pub version: u64,
    pub replicas: Vec<ReplicaReport>,
}

impl Rollout {
    /// Every replica serves the version.
    pub fn complete(&self) -> bool {
        self.replicas.iter().all(|r| r.outcome == Outcome::Serving)
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "model": self.model,
            "version": self.version,
            "complete": self.complete(),
            "replicas": self.replicas.iter().map(|r| {
                let (outcome, error) = match &r.outcome {
                    Outcome::Serving => ("serving", None),
                    Outcome::Failed(e) => ("failed", Some(e.clone())),
                    Outcome::NotAttempted => ("not attempted", None),
                };
                serde_json::json!({
                    "server": r.server,
                    "outcome": outcome,
                    "error": error,
                    "seconds": r.seconds,
                })
            }).collect::<Vec<_>>(),
        })
    }
}

/// Reloads `model` on each replica in turn until it serves `version`. A failure stops the rollout
/// (the remaining replicas are not touched) unless `continue_after_failure`; `on_replica` hears of
/// each replica as it finishes.
pub fn roll_out(
    replicas: &[String],
    model: &str,
    version: u64,
    repository_config: Option<&str>,
    continue_after_failure: bool,
    timeout: Duration,
    on_replica: &mut dyn FnMut(&ReplicaReport),
) -> Rollout {
    let mut reports = Vec::new();
    let mut failed = false;
    for server in replicas {
        let started = Instant::now();
        let outcome = if failed && !continue_after_failure {
            Outcome::NotAttempted
        } else {
            match reload_and_wait(server, model, version, repository_config, timeout) {
                Ok(()) => Outcome::Serving,
                Err(e) => {
                    failed = true;
                    Outcome::Failed(e.to_string())
                }
            }
        };
        let report = ReplicaReport {
            server: server.clone(),
            outcome,
            seconds: started.elapsed().as_secs_f64(),
        };
        on_replica(&report);
        reports.push(report);
    }
    Rollout {
        model: model.to_string(),
        version,
        replicas: reports,
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
) -> Result<()> {
    let base = server.trim_end_matches('/');
    let agent = ureq::AgentBuilder::new()
        .timeout_connect(Duration::from_secs(5))
        .timeout(timeout)
        .build();
    agent
        .get(&format!("{base}/v2/health/live"))
        .timeout(LIVENESS_TIMEOUT.min(timeout))
        .call()
        .map_err(|e| {
            RegistryError::Input(format!(
                "the server is not live (no answer to /v2/health/live within {:?}): {}",
                LIVENESS_TIMEOUT.min(timeout),
                describe(e)
            ))
        })?;
    post_load(&agent, base, model, None)
        .map_err(|e| RegistryError::Input(format!("the server refused to reload {model}: {e}")))?;
    if wait_for_versions(&agent, base, model, &[version], RELOAD_GRACE.min(timeout)).is_ok() {
        return Ok(());
    }
    let still = ready_versions(&agent, base, model).unwrap_or_default();
    if !still.is_empty() && !still.contains(&version.to_string()) {
        let config = override_config(
            model,
            version,
            repository_config,
            loaded_config(&agent, base, model).as_ref(),
        );
        post_load(&agent, base, model, Some(&config)).map_err(|e| {
            RegistryError::Input(format!(
                "the server kept versions {still:?} after the reload and refused to load \
                 version {version} by override: {e}"
            ))
        })?;
    }
    wait_for_versions(&agent, base, model, &[version], timeout).map_err(|e| {
        RegistryError::Input(format!(
            "{model} version {version} was not the only ready version: {e}"
        ))
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

    #[test]
    fn a_failed_replica_stops_the_rollout_unless_asked_to_go_on() {
        // Nothing listens on these ports: every reload fails fast.
        let dead: Vec<String> = (0..3)
            .map(|_| {
                let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                format!("http://{}", l.local_addr().unwrap())
            })
            .collect();
        let mut heard = 0;
        let stop = roll_out(
            &dead,
            "m",
            2,
            None,
            false,
            Duration::from_secs(2),
            &mut |_| heard += 1,
        );
        assert_eq!(heard, 3);
        assert!(!stop.complete());
        assert!(matches!(stop.replicas[0].outcome, Outcome::Failed(_)));
        assert_eq!(stop.replicas[1].outcome, Outcome::NotAttempted);
        let go_on = roll_out(
            &dead,
            "m",
            2,
            None,
            true,
            Duration::from_secs(2),
            &mut |_| {},
        );
        assert!(go_on
            .replicas
            .iter()
            .all(|r| matches!(r.outcome, Outcome::Failed(_))));
        assert_eq!(go_on.to_json()["replicas"][2]["outcome"], "failed");
    }

    #[test]
    fn a_replica_that_accepts_but_never_answers_fails_within_the_liveness_timeout() {
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
        let report = roll_out(
            std::slice::from_ref(&server),
            "m",
            2,
            None,
            false,
            Duration::from_secs(120),
            &mut |_| {},
        );
        let waited = started.elapsed();
        let Outcome::Failed(error) = &report.replicas[0].outcome else {
            panic!(
                "a silent replica must fail: {:?}",
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
