//! A release command's outcome pushed to a Prometheus Pushgateway (`--pushgateway URL`), the
//! standard place for what a batch job last did: which version the repository names after the
//! command, its exit status, when it ended, and how many replicas serve that version. The alert
//! rules (deploy/kubernetes/overlays/monitoring/prometheus-rules.yaml) compare the first with the
//! versions the pods report, so a pod left on another version fires an alert, and a rollback or
//! a refusal leaves more than an exit code.
//!
//! One group per model (`job="recsys_release"`, `model`), replaced by each push (HTTP PUT), so
//! the Pushgateway holds the last command's outcome for each model. A push that fails is a
//! warning: the command's own outcome stands.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::release::Release;

/// What the push reports.
pub struct Outcome<'a> {
    pub model: &'a str,
    /// The command's verb (approve, reject, rollback, publish, prune).
    pub command: &'a str,
    pub exit_code: i32,
    /// The version config.pbtxt names after the command, if it could be read.
    pub repository_version: Option<u64>,
    /// Replicas of the closing reconcile pass that serve that version, and those that do not.
    pub replicas: Option<(usize, usize)>,
}

impl<'a> Outcome<'a> {
    /// The outcome of a release command.
    pub fn of(release: &'a Release, command: &'a str, exit_code: i32) -> Outcome<'a> {
        Outcome {
            model: &release.model,
            command,
            exit_code,
            repository_version: release.serving.or(release.serving_before),
            replicas: release.reconciled.as_ref().map(|r| {
                let serving = r.serving();
                (serving, r.replicas.len() - serving)
            }),
        }
    }
}

/// `text` as a label value in Prometheus's text format (backslash, quote and newline escaped).
fn label(text: &str) -> String {
    text.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The push body in Prometheus's text exposition format.
pub fn exposition(outcome: &Outcome<'_>, now_unix: f64) -> String {
    let model = label(outcome.model);
    let command = label(outcome.command);
    let mut text = String::new();
    if let Some(version) = outcome.repository_version {
        text.push_str(
            "# HELP recsys_repository_version_info The version config.pbtxt names after the last release command (value 1).\n\
             # TYPE recsys_repository_version_info gauge\n",
        );
        text.push_str(&format!(
            "recsys_repository_version_info{{model=\"{model}\",version=\"{version}\"}} 1\n"
        ));
    }
    text.push_str(
        "# HELP recsys_release_exit_code The exit status of the last release command (0: every replica serves what the repository names).\n\
         # TYPE recsys_release_exit_code gauge\n",
    );
    text.push_str(&format!(
        "recsys_release_exit_code{{model=\"{model}\",command=\"{command}\"}} {}\n",
        outcome.exit_code
    ));
    text.push_str(
        "# HELP recsys_release_completed_timestamp_seconds When the last release command ended.\n\
         # TYPE recsys_release_completed_timestamp_seconds gauge\n",
    );
    text.push_str(&format!(
        "recsys_release_completed_timestamp_seconds{{model=\"{model}\",command=\"{command}\"}} {now_unix:.3}\n"
    ));
    if let Some((serving, behind)) = outcome.replicas {
        text.push_str(
            "# HELP recsys_release_replicas Replicas the last command's reconcile pass found serving what the repository names, and not.\n\
             # TYPE recsys_release_replicas gauge\n",
        );
        text.push_str(&format!(
            "recsys_release_replicas{{model=\"{model}\",state=\"serving\"}} {serving}\n\
             recsys_release_replicas{{model=\"{model}\",state=\"behind\"}} {behind}\n"
        ));
    }
    text
}

/// The group's URL: `<gateway>/metrics/job/recsys_release/model/<model>`, the model name
/// percent-encoded (a folder name: no `/`, but any other character).
fn group_url(gateway: &str, model: &str) -> String {
    let encoded: String = model
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect();
    format!(
        "{}/metrics/job/recsys_release/model/{encoded}",
        gateway.trim_end_matches('/')
    )
}

/// Pushes `outcome` to `gateway`, replacing the model's group; a failure is printed as a warning.
pub fn push(gateway: &str, outcome: &Outcome<'_>) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(10))
        .build();
    let sent = agent
        .put(&group_url(gateway, outcome.model))
        .set("Content-Type", "text/plain; version=0.0.4")
        .send_string(&exposition(outcome, now));
    if let Err(e) = sent {
        eprintln!(
            "warning: could not push the outcome to the Pushgateway {gateway}: {e} (the command's \
             own outcome stands)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_names_the_repository_version_and_escapes_labels() {
        let text = exposition(
            &Outcome {
                model: "shop \"eu\"",
                command: "approve",
                exit_code: 5,
                repository_version: Some(4),
                replicas: Some((3, 1)),
            },
            1.5,
        );
        assert!(
            text.contains(
                "recsys_repository_version_info{model=\"shop \\\"eu\\\"\",version=\"4\"} 1\n"
            ),
            "{text}"
        );
        assert!(text.contains(
            "recsys_release_exit_code{model=\"shop \\\"eu\\\"\",command=\"approve\"} 5\n"
        ));
        assert!(text.contains("state=\"behind\"} 1\n"));
        assert!(text.contains("recsys_release_completed_timestamp_seconds{model=\"shop \\\"eu\\\"\",command=\"approve\"} 1.500\n"));
        let bare = exposition(
            &Outcome {
                model: "m",
                command: "prune",
                exit_code: 0,
                repository_version: None,
                replicas: None,
            },
            0.0,
        );
        assert!(
            !bare.contains("version_info") && !bare.contains("recsys_release_replicas"),
            "{bare}"
        );
        assert_eq!(
            group_url("http://gw:9091/", "bert4rec"),
            "http://gw:9091/metrics/job/recsys_release/model/bert4rec"
        );
        assert_eq!(
            group_url("http://gw:9091", "shop eu%"),
            "http://gw:9091/metrics/job/recsys_release/model/shop%20eu%25"
        );
    }
}
