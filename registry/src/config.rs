//! `config.pbtxt`'s `version_policy`: the one line that decides which version every replica loads.
//! The registry keeps it naming the newest approved version and changes it with one atomic write
//! of the whole file, so a reader (a replica reloading, a restarting pod) sees the old config or
//! the new one, never a mix.

use crate::error::{RegistryError, Result};
use crate::store::Repository;
use crate::versions;

pub const CONFIG_FILE: &str = "config.pbtxt";

const MANAGED_COMMENT: &str =
    "# Managed by `recsys publish/approve/reject`: the newest approved version.";

/// The config a model gets when it has none: the backend completes inputs, outputs, `top_k` and
/// dynamic batching from the engine (README, "Serve with Triton").
pub fn minimal(max_batch_size: u32) -> String {
    format!(
        "# Written by `recsys publish`; the recsys backend completes the rest from the engine.\n\
         backend: \"recsys\"\nmax_batch_size: {max_batch_size}\n"
    )
}

/// The byte range of a `version_policy` entry (with its braced block), if any.
fn policy_span(config: &str) -> Option<(usize, usize)> {
    let start = config.find("version_policy")?;
    let open = start + config[start..].find('{')?;
    let mut depth = 0;
    for (i, c) in config[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some((start, open + i + 1));
                }
            }
            _ => {}
        }
    }
    None
}

/// The versions a `specific` policy names; `None` for no policy or `latest` / `all`.
pub fn policy_versions(config: &str) -> Option<Vec<u64>> {
    let (start, end) = policy_span(config)?;
    let policy = &config[start..end];
    let specific = policy.find("specific")?;
    let list = &policy[specific..];
    let open = list.find('[')?;
    let close = open + list[open..].find(']')?;
    list[open + 1..close]
        .split(',')
        .map(|v| v.trim().parse::<u64>().ok())
        .collect()
}

/// `config` with its policy replaced by one naming exactly `version`, the rest kept as it was.
pub fn with_version(config: &str, version: u64) -> String {
    let stripped = match policy_span(config) {
        Some((start, end)) => format!("{}{}", config[..start].trim_end(), &config[end..]),
        None => config.to_string(),
    };
    let mut text: String = stripped
        .lines()
        .filter(|l| !l.starts_with(MANAGED_COMMENT))
        .map(|l| format!("{l}\n"))
        .collect();
    text = text.trim_end().to_string();
    text.push_str(&format!(
        "\n{MANAGED_COMMENT}\nversion_policy: {{ specific: {{ versions: [ {version} ] }} }}\n"
    ));
    text
}

/// Points `model`'s config at the newest approved version and returns it. Re-reads after every
/// write until the config and the version records agree, so concurrent switches converge on
/// the same answer (with conditional replace a stale writer is refused; without it, the last
/// writer re-checks and repairs).
pub fn switch(repo: &Repository, model: &str) -> Result<u64> {
    let key = format!("{model}/{CONFIG_FILE}");
    for _ in 0..32 {
        let listed = versions::list(repo, model)?;
        let target = versions::serving(&listed).ok_or_else(|| {
            RegistryError::Input(format!("{model} has no approved version to serve"))
        })?;
        let config = repo
            .read(&key)?
            .ok_or_else(|| RegistryError::Input(format!("{} has no {key}", repo.uri())))?;
        let text = String::from_utf8(config.bytes.clone())
            .map_err(|_| RegistryError::Input(format!("{key} is not UTF-8 text")))?;
        if policy_versions(&text).as_deref() == Some(&[target]) {
            return Ok(target);
        }
        repo.replace(&key, with_version(&text, target).as_bytes(), &config)?;
    }
    Err(RegistryError::Input(format!(
        "{key} kept changing under concurrent commands; run the command again"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_is_replaced_not_duplicated_and_read_back() {
        let text =
            "name: \"m\"\nversion_policy: { specific: { versions: [ 1 ] } }\nmax_batch_size: 8\n";
        assert_eq!(policy_versions(text), Some(vec![1]));
        let once = with_version(text, 3);
        let twice = with_version(&once, 4);
        assert_eq!(twice.matches("version_policy").count(), 1, "{twice}");
        assert_eq!(twice.matches(MANAGED_COMMENT).count(), 1, "{twice}");
        assert!(twice.contains("max_batch_size: 8"));
        assert_eq!(policy_versions(&twice), Some(vec![4]));
        assert_eq!(policy_versions("max_batch_size: 8"), None);
        assert_eq!(
            policy_versions("version_policy: { latest: { num_versions: 1 } }"),
            None
        );
        assert_eq!(
            policy_versions("version_policy: { specific: { versions: [1, 2] } }"),
            Some(vec![1, 2])
        );
    }
}
