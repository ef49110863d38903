//! The canary gate: before the repository names a new version, one replica loads it without the
//! repository changing (Triton's load API with a config override naming that version), answers
//! the version's self-check request through Triton, and is put back on the version it served.
//! Only a version that loads and answers its self-check may be switched to. With a
//! [`QualityCheck`], the replica then answers held-out histories with the candidate and, once put
//! back, with the serving version ([`crate::quality`]): a candidate whose ranking is degenerate
//! or clearly worse is refused too.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::quality::{self, QualityCheck, QualityReport};
use crate::self_check::{Ranked, SelfCheck};
use crate::triton::{
    admin, describe, is_live, loaded_config, override_config, post_load, wait_for_versions,
};

/// How one canary went.
#[derive(Clone, Debug)]
pub struct CanaryReport {
    pub server: String,
    /// `Err`: why the version may not serve.
    pub result: std::result::Result<(), String>,
    /// Whether the replica is back on what it served before (`Err`: what it serves instead).
    pub restored: std::result::Result<(), String>,
    /// The quality gate's numbers, when it ran.
    pub quality: Option<QualityReport>,
    pub seconds: f64,
}

impl CanaryReport {
    pub fn to_json(&self) -> Value {
        json!({
            "server": self.server,
            "passed": self.result.is_ok(),
            "error": self.result.as_ref().err(),
            "restored": self.restored.is_ok(),
            "restore_error": self.restored.as_ref().err(),
            "quality": self.quality,
            "seconds": self.seconds,
        })
    }
}

/// What the canary needs to know.
pub struct Canary<'a> {
    pub model: &'a str,
    /// The candidate.
    pub version: u64,
    /// What the fleet serves now (`None`: nothing yet, the canary unloads the model afterwards).
    pub serving: Option<u64>,
    pub check: &'a SelfCheck,
    /// The repository's config.pbtxt, when it has one: which fields it declares itself.
    pub repository_config: Option<&'a str>,
    /// The longest a load may take.
    pub timeout: Duration,
    /// The quality gate's held-out histories (`None`: the gate is skipped).
    pub quality: Option<&'a QualityCheck>,
}

/// Runs the canary on the first live replica of `replicas`. Fails (the version may not serve)
/// when none is live.
pub fn run(replicas: &[String], canary: &Canary<'_>) -> CanaryReport {
    let started = Instant::now();
    let Some(server) = replicas.iter().find(|r| is_live(r)) else {
        return CanaryReport {
            server: replicas.join(", "),
            result: Err(format!(
                "no replica is live to run the canary on (tried {})",
                replicas.join(", ")
            )),
            restored: Ok(()),
            quality: None,
            seconds: started.elapsed().as_secs_f64(),
        };
    };
    let base = server.trim_end_matches('/');
    let agent = ureq::AgentBuilder::new()
        .timeout_connect(Duration::from_secs(5))
        .timeout(canary.timeout)
        .build();
    // The replica's own config as loaded, when it has the model: the override then differs
    // from what the switch will give only in the version it names.
    let loaded_config = loaded_config(&agent, base, canary.model);
    let override_config = override_config(
        canary.model,
        canary.version,
        canary.repository_config,
        loaded_config.as_ref(),
    );
    let batched = override_config["max_batch_size"].as_u64().unwrap_or(0) > 0;
    let mut result = load_and_check(&agent, base, canary, &override_config);
    let mut ask = |version: u64| {
        let agent = &agent;
        move |question: &SelfCheck| infer(agent, base, canary.model, version, question, batched)
    };
    let candidate = match (&result, canary.quality) {
        (Ok(()), Some(check)) => Some(quality::score(
            canary.version,
            &check.cases,
            &mut ask(canary.version),
        )),
        _ => None,
    };
    let restored = restore(&agent, base, canary, loaded_config.as_ref());
    let mut report = None;
    if let (Some(check), Some(candidate)) = (canary.quality, candidate) {
        match judge_on_replica(check, candidate, canary.serving, &restored, &mut ask) {
            Ok(judged) => {
                if let Some(reason) = &judged.refused {
                    result = Err(format!("quality gate: {reason}"));
                }
                report = Some(judged);
            }
            Err(e) => result = Err(format!("quality gate: {e}")),
        }
    }
    CanaryReport {
        server: server.clone(),
        result,
        restored,
        quality: report,
        seconds: started.elapsed().as_secs_f64(),
    }
}

/// The candidate's score against the serving version's, asked of the replica once it is back on
/// the serving version.
fn judge_on_replica<A>(
    check: &QualityCheck,
    candidate: std::result::Result<quality::VersionScore, String>,
    serving: Option<u64>,
    restored: &std::result::Result<(), String>,
    ask: &mut dyn FnMut(u64) -> A,
) -> std::result::Result<QualityReport, String>
where
    A: FnMut(&SelfCheck) -> std::result::Result<Vec<Ranked>, String>,
{
    let candidate = candidate.map_err(|e| format!("the candidate's answers failed: {e}"))?;
    // A serving version that no longer loads cannot be compared with: the candidate is judged on
    // its own scores (a repair of a broken version must get through), and the report says why.
    let (serving, serving_unscored) = match (serving, restored) {
        (None, _) => (None, None),
        (Some(version), Ok(())) => (
            Some(
                quality::score(version, &check.cases, &mut ask(version))
                    .map_err(|e| format!("the serving version {version}'s answers failed: {e}"))?,
            ),
            None,
        ),
        (Some(version), Err(e)) => (
            None,
            Some(format!(
                "the serving version {version} could not be scored: the canary could not load it \
                 again ({e})"
            )),
        ),
    };
    let refused = quality::judge(&candidate, serving.as_ref(), check.max_drop);
    Ok(QualityReport {
        source: check.source.clone(),
        candidate,
        serving,
        serving_unscored,
        max_drop: check.max_drop,
        refused,
    })
}

fn load_and_check(
    agent: &ureq::Agent,
    base: &str,
    canary: &Canary<'_>,
    config: &Value,
) -> std::result::Result<(), String> {
    let (model, version) = (canary.model, canary.version);
    post_load(agent, base, model, Some(config))
        .map_err(|e| format!("the replica could not load version {version}: {e}"))?;
    wait_for_versions(agent, base, model, &[version], canary.timeout)
        .map_err(|e| format!("version {version} did not become ready: {e}"))?;
    let batched = config["max_batch_size"].as_u64().unwrap_or(0) > 0;
    let answer = infer(agent, base, model, version, canary.check, batched)
        .map_err(|e| format!("the self-check request failed: {e}"))?;
    canary
        .check
        .check(&answer)
        .map_err(|e| format!("self-check failed: {e}"))
}

/// Puts the replica back on what the repository names (a plain load re-reads config.pbtxt), or
/// unloads the model when nothing serves yet.
fn restore(
    agent: &ureq::Agent,
    base: &str,
    canary: &Canary<'_>,
    loaded: Option<&Value>,
) -> std::result::Result<(), String> {
    let model = canary.model;
    let Some(serving) = canary.serving else {
        admin(agent.post(&format!("{base}/v2/repository/models/{model}/unload")))
            .send_string("")
            .map_err(|e| format!("could not unload the candidate: {}", describe(e)))?;
        return wait_for_versions(agent, base, model, &[], canary.timeout);
    };
    post_load(agent, base, model, None).map_err(|e| format!("could not reload {model}: {e}"))?;
    if wait_for_versions(agent, base, model, &[serving], Duration::from_secs(5)).is_ok() {
        return Ok(());
    }
    // Triton keeps a model loaded by override when the repository did not change since; the
    // config it served before, given back, puts it on the serving version.
    let Some(loaded) = loaded else {
        return wait_for_versions(agent, base, model, &[serving], canary.timeout);
    };
    post_load(agent, base, model, Some(loaded))
        .map_err(|e| format!("could not reload {model} with its previous config: {e}"))?;
    wait_for_versions(agent, base, model, &[serving], canary.timeout)
}

/// Sends the self-check request (outputs as binary data: a non-finite score has no JSON form)
/// and returns the answer, checking it came from `version`.
fn infer(
    agent: &ureq::Agent,
    base: &str,
    model: &str,
    version: u64,
    check: &SelfCheck,
    batched: bool,
) -> std::result::Result<Vec<Ranked>, String> {
    let strings = check.history.iter().any(Value::is_string);
    let n = check.history.len();
    let (ids_shape, k_shape) = if batched {
        (json!([1, n]), json!([1, 1]))
    } else {
        (json!([n]), json!([1]))
    };
    let body = json!({
        "inputs": [
            {"name": "ITEM_IDS", "shape": ids_shape,
             "datatype": if strings { "BYTES" } else { "INT64" }, "data": check.history},
            {"name": "K", "shape": k_shape, "datatype": "INT32", "data": [check.k]},
        ],
        "outputs": [
            {"name": "TOP_ITEM_IDS", "parameters": {"binary_data": true}},
            {"name": "TOP_SCORES", "parameters": {"binary_data": true}},
        ],
    });
    let response = agent
        .post(&format!(
            "{base}/v2/models/{model}/versions/{version}/infer"
        ))
        .set("Content-Type", "application/json")
        .send_string(&body.to_string())
        .map_err(describe)?;
    let header_len: Option<usize> = response
        .header("Inference-Header-Content-Length")
        .and_then(|v| v.trim().parse().ok());
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut response.into_reader(), &mut bytes)
        .map_err(|e| format!("unreadable answer: {e}"))?;
    let header_len = header_len.unwrap_or(bytes.len()).min(bytes.len());
    let header: Value = serde_json::from_slice(&bytes[..header_len])
        .map_err(|e| format!("unreadable answer: {e}"))?;
    if header["model_version"].as_str() != Some(&version.to_string()) {
        return Err(format!(
            "the answer came from version {} of {model}, not {version}",
            header["model_version"]
        ));
    }
    let mut offset = header_len;
    let mut ids: Option<Vec<Value>> = None;
    let mut scores: Option<Vec<Option<f32>>> = None;
    for output in header["outputs"].as_array().into_iter().flatten() {
        let size = output["parameters"]["binary_data_size"]
            .as_u64()
            .ok_or("an output came without binary data")? as usize;
        let data = bytes
            .get(offset..offset + size)
            .ok_or("the answer is shorter than its header says")?;
        offset += size;
        match (output["name"].as_str(), output["datatype"].as_str()) {
            (Some("TOP_SCORES"), Some("FP32")) => {
                scores = Some(
                    data.chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .map(|s| s.is_finite().then_some(s))
                        .collect(),
                )
            }
            (Some("TOP_ITEM_IDS"), Some("INT64")) => {
                ids = Some(
                    data.chunks_exact(8)
                        .map(|b| Value::from(i64::from_le_bytes(b.try_into().expect("8 bytes"))))
                        .collect(),
                )
            }
            (Some("TOP_ITEM_IDS"), Some("BYTES")) => ids = Some(parse_bytes(data)?),
            _ => {}
        }
    }
    let (ids, scores) = (
        ids.ok_or("the answer has no TOP_ITEM_IDS")?,
        scores.ok_or("the answer has no TOP_SCORES")?,
    );
    if ids.len() != scores.len() {
        return Err(format!(
            "the answer has {} ids and {} scores",
            ids.len(),
            scores.len()
        ));
    }
    Ok(ids
        .into_iter()
        .zip(scores)
        .map(|(id, score)| Ranked { id, score })
        .collect())
}

/// Triton's binary BYTES tensor: each element a little-endian u32 length and that many bytes.
fn parse_bytes(mut data: &[u8]) -> std::result::Result<Vec<Value>, String> {
    let mut out = Vec::new();
    while !data.is_empty() {
        let len = data
            .get(..4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
            .ok_or("a truncated BYTES element")?;
        let text = data.get(4..4 + len).ok_or("a truncated BYTES element")?;
        out.push(Value::from(String::from_utf8_lossy(text).into_owned()));
        data = &data[4 + len..];
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canary<'a>(check: &'a SelfCheck, repository_config: Option<&'a str>) -> Canary<'a> {
        Canary {
            model: "m",
            version: 3,
            serving: Some(2),
            check,
            repository_config,
            timeout: Duration::from_secs(1),
            quality: None,
        }
    }

    #[test]
    fn binary_bytes_elements_are_split_by_their_lengths() {
        let mut data = Vec::new();
        for s in ["ab", "", "xyz"] {
            data.extend_from_slice(&(s.len() as u32).to_le_bytes());
            data.extend_from_slice(s.as_bytes());
        }
        assert_eq!(
            parse_bytes(&data).unwrap(),
            vec![json!("ab"), json!(""), json!("xyz")]
        );
        assert!(parse_bytes(&data[..data.len() - 1]).is_err());
    }

    #[test]
    fn with_no_live_replica_the_canary_fails_and_touches_nothing() {
        let check = SelfCheck {
            history: vec![json!(1)],
            k: 1,
            expected: vec![],
        };
        let dead = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}", l.local_addr().unwrap())
        };
        let report = run(&[dead], &canary(&check, None));
        let err = report.result.unwrap_err();
        assert!(err.contains("no replica is live"), "{err}");
        assert!(report.restored.is_ok());
    }
}
