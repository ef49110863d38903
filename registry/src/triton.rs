//! The few calls of Triton's HTTP API that changing a replica's version needs: liveness, which
//! versions of a model are ready, its loaded config, and loading it (from the repository, or with
//! a config override naming one version).

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::config::top_level_fields;

/// The header Triton's restricted model-repository and model-config APIs expect
/// (`--http-restricted-api=model-repository,model-config:recsys-admin-key=<key>`).
pub const ADMIN_HEADER: &str = "recsys-admin-key";

/// The key sent in [`ADMIN_HEADER`]: `RECSYS_TRITON_ADMIN_KEY`, or the first line of the file
/// `RECSYS_TRITON_ADMIN_KEY_FILE` names (a mounted Secret).
fn admin_key() -> Option<String> {
    if let Ok(key) = std::env::var("RECSYS_TRITON_ADMIN_KEY") {
        return Some(key.trim().to_string()).filter(|k| !k.is_empty());
    }
    let path = std::env::var_os("RECSYS_TRITON_ADMIN_KEY_FILE")?;
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| text.lines().next().map(|l| l.trim().to_string()))
        .filter(|k| !k.is_empty())
}

/// `request` with the admin key, when one is configured: the calls that change or read a
/// replica's models go through it, so a fleet whose model control is restricted to the approver's
/// key can be rolled out.
pub fn admin(request: ureq::Request) -> ureq::Request {
    match admin_key() {
        Some(key) => request.set(ADMIN_HEADER, &key),
        None => request,
    }
}
use crate::error::{RegistryError, Result};

pub fn describe(e: ureq::Error) -> String {
    match e {
        ureq::Error::Status(code, response) => {
            format!(
                "HTTP {code}: {}",
                response.into_string().unwrap_or_default()
            )
        }
        other => other.to_string(),
    }
}

/// The versions of `model` that `server` reports ready (its model metadata).
pub fn ready_versions(agent: &ureq::Agent, base: &str, model: &str) -> Result<Vec<String>> {
    let response = agent
        .get(&format!("{base}/v2/models/{model}"))
        .call()
        .map_err(|e| RegistryError::Input(describe(e)))?;
    let text = response
        .into_string()
        .map_err(|e| RegistryError::Input(format!("unreadable model metadata: {e}")))?;
    let body: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| RegistryError::Input(format!("unreadable model metadata: {e}")))?;
    Ok(body["versions"]
        .as_array()
        .map(|v| {
            v.iter()
                .filter_map(|x| x.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default())
}

/// How long a replica may take to answer its liveness probe before the rollout counts it failed
/// and moves on. The reload itself may take minutes (a large engine loading), so its own timeout
/// cannot tell a dead replica from a busy one; a server that accepts connections but answers
/// nothing (hung, or stopping) would otherwise hold the whole rollout for that long.
pub const LIVENESS_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether `server` answers `/v2/health/live` within [`LIVENESS_TIMEOUT`].
pub fn is_live(server: &str) -> bool {
    let agent = ureq::AgentBuilder::new()
        .timeout_connect(LIVENESS_TIMEOUT)
        .timeout(LIVENESS_TIMEOUT)
        .build();
    agent
        .get(&format!("{}/v2/health/live", server.trim_end_matches('/')))
        .call()
        .is_ok()
}

pub fn post_load(
    agent: &ureq::Agent,
    base: &str,
    model: &str,
    config: Option<&Value>,
) -> Result<()> {
    let body = match config {
        Some(config) => json!({ "parameters": { "config": config.to_string() } }),
        None => json!({}),
    };
    admin(agent.post(&format!("{base}/v2/repository/models/{model}/load")))
        .set("Content-Type", "application/json")
        .send_string(&body.to_string())
        .map(|_| ())
        .map_err(|e| RegistryError::Input(describe(e)))
}

/// Polls until `model`'s ready versions are exactly `want` (empty: none), or `timeout`.
pub fn wait_for_versions(
    agent: &ureq::Agent,
    base: &str,
    model: &str,
    want: &[u64],
    timeout: Duration,
) -> std::result::Result<(), String> {
    let want: Vec<String> = want.iter().map(u64::to_string).collect();
    let started = Instant::now();
    loop {
        let seen = ready_versions(agent, base, model);
        match &seen {
            Ok(v) if *v == want => return Ok(()),
            // An unloaded model has no metadata: that is "no versions".
            Err(_) if want.is_empty() => return Ok(()),
            _ => {}
        }
        // Triton's load call returns once the load is over: a version that failed says why in
        // the repository index, and waiting longer would not change it.
        for version in &want {
            if let Some(reason) = load_failure(agent, base, model, version) {
                return Err(format!("version {version} failed to load: {reason}"));
            }
        }
        if started.elapsed() > timeout {
            return Err(match seen {
                Ok(v) => format!("it serves versions {v:?} after {timeout:?}, not {want:?}"),
                Err(e) => format!("no ready version after {timeout:?} ({e})"),
            });
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The repository index's entries for `model`: (version, state, reason).
fn index_entries(agent: &ureq::Agent, base: &str, model: &str) -> Vec<(String, String, String)> {
    let Some(index) = admin(agent.post(&format!("{base}/v2/repository/index")))
        .set("Content-Type", "application/json")
        .send_string("{}")
        .ok()
        .and_then(|r| r.into_string().ok())
        .and_then(|text| serde_json::from_str::<Value>(&text).ok())
    else {
        return Vec::new();
    };
    let text = |entry: &Value, key: &str| entry[key].as_str().unwrap_or_default().to_string();
    index
        .as_array()
        .into_iter()
        .flatten()
        .filter(|entry| entry["name"].as_str() == Some(model))
        .map(|entry| {
            (
                text(entry, "version"),
                text(entry, "state"),
                text(entry, "reason"),
            )
        })
        .collect()
}

/// A failed load is UNAVAILABLE with its error as the reason; an unloaded version says "unloaded".
fn is_failure(state: &str, reason: &str) -> bool {
    state == "UNAVAILABLE" && !reason.is_empty() && reason != "unloaded"
}

/// Why `version` of `model` failed to load on `base` (`None`: it did not fail).
pub fn load_failure(agent: &ureq::Agent, base: &str, model: &str, version: &str) -> Option<String> {
    index_entries(agent, base, model)
        .into_iter()
        .find(|(v, state, reason)| v == version && is_failure(state, reason))
        .map(|(_, _, reason)| reason)
}

/// Whether a load or unload of `model` is under way on `base` (a version LOADING or UNLOADING in
/// the repository index). A replica whose load of another version outlasted a rollout still
/// serves the old version while it loads, and switches when the load ends: it is not settled
/// on what it serves.
pub fn in_transition(agent: &ureq::Agent, base: &str, model: &str) -> bool {
    index_entries(agent, base, model)
        .iter()
        .any(|(_, state, _)| state == "LOADING" || state == "UNLOADING")
}

/// `model`'s config as `base` has it loaded (after the backend completed it), if it has one.
pub fn loaded_config(agent: &ureq::Agent, base: &str, model: &str) -> Option<Value> {
    admin(agent.get(&format!("{base}/v2/models/{model}/config")))
        .call()
        .ok()
        .and_then(|r| r.into_string().ok())
        .and_then(|text| serde_json::from_str::<Value>(&text).ok())
}

/// The config that loads exactly `version` of `model` without the repository changing: the
/// replica's loaded config naming that version, without the inputs and outputs the backend
/// completed from the engine it served (another version's may differ, e.g. the embedding's width)
/// unless the repository's config declares them itself; or, when the replica has no loaded
/// config, the repository's declared backend and max_batch_size for the backend to complete.
pub fn override_config(
    model: &str,
    version: u64,
    repository_config: Option<&str>,
    loaded: Option<&Value>,
) -> Value {
    let declared: Vec<(String, Option<String>)> =
        repository_config.map(top_level_fields).unwrap_or_default();
    let declares = |name: &str| declared.iter().any(|(n, _)| n == name);
    let policy = json!({ "specific": { "versions": [version] } });
    match loaded {
        Some(Value::Object(fields)) => {
            let mut fields = fields.clone();
            for completed in ["input", "output"] {
                if !declares(completed) {
                    fields.remove(completed);
                }
            }
            fields.insert("version_policy".into(), policy);
            Value::Object(fields)
        }
        _ => {
            let value = |name: &str| {
                declared
                    .iter()
                    .find(|(n, _)| n == name)
                    .and_then(|(_, v)| v.clone())
            };
            let max_batch_size: u64 = value("max_batch_size")
                .and_then(|v| v.parse().ok())
                .unwrap_or(crate::config::DEFAULT_MAX_BATCH_SIZE.into());
            json!({
                "name": model,
                "backend": value("backend").unwrap_or_else(|| "recsys".into()),
                "max_batch_size": max_batch_size,
                "version_policy": policy,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_override_names_the_candidate_and_drops_what_the_backend_completed() {
        let loaded = json!({"name": "m", "backend": "recsys", "max_batch_size": 8,
                            "input": [{"name": "ITEM_IDS"}], "output": [{"name": "USER_EMBEDDING"}],
                            "version_policy": {"specific": {"versions": [2]}}});
        let minimal = "backend: \"recsys\"\nmax_batch_size: 8\n";
        let o = override_config("m", 3, Some(minimal), Some(&loaded));
        assert_eq!(o["version_policy"]["specific"]["versions"], json!([3]));
        assert!(o.get("input").is_none() && o.get("output").is_none(), "{o}");
        assert_eq!(o["max_batch_size"], 8);
        let declared = "backend: \"recsys\"\nmax_batch_size: 8\ninput [ { name: \"ITEM_IDS\" } ]\n";
        let o = override_config("m", 3, Some(declared), Some(&loaded));
        assert!(o.get("input").is_some() && o.get("output").is_none(), "{o}");
        // No loaded model on the replica: the repository's own backend and batch size.
        let o = override_config("m", 3, Some("max_batch_size: 16\n"), None);
        assert_eq!(o["max_batch_size"], 16);
        assert_eq!(o["backend"], "recsys");
        assert_eq!(o["version_policy"]["specific"]["versions"], json!([3]));
    }
}
