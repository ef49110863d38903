//! `config.pbtxt`'s `version_policy`: the one line that decides which version every replica loads.
//! The registry keeps it naming the newest approved version and changes it with one atomic write
//! of the whole file, so a reader (a replica reloading, a restarting pod) sees the old config or
//! the new one, never a mix.

use crate::error::{RegistryError, Result};
use crate::pbtxt;
use crate::store::Repository;
use crate::versions;

pub const CONFIG_FILE: &str = "config.pbtxt";

const MANAGED_COMMENT: &str =
    "# Managed by `recsys publish/approve/reject`: the newest approved version.";

/// The config a model gets when it has none: the backend completes inputs, outputs, `top_k` and
/// dynamic batching from the engine (the user guide, docs/guide/src/serving.md).
pub fn minimal(max_batch_size: u32) -> String {
    format!(
        "# Written by `recsys approve`; the recsys backend completes the rest from the engine.\n\
         backend: \"recsys\"\nmax_batch_size: {max_batch_size}\n"
    )
}

/// The byte range of the top-level `version_policy` field (its name through its closing brace),
/// if the config declares one. Found among the file's tokens, so a comment or a string that
/// mentions `version_policy` is never taken for it.
fn policy_span(config: &str) -> Option<(usize, usize)> {
    let tokens = pbtxt::tokens(config);
    let field = pbtxt::top_level_fields(&tokens)
        .into_iter()
        .find(|f| f.name == "version_policy")?;
    let last = tokens.get(field.value.end.checked_sub(1)?)?;
    if !matches!(last.kind, pbtxt::Kind::Close(_)) {
        return None;
    }
    Some((tokens[field.name_token].start, last.end))
}

/// The versions a `specific` policy names; `None` for no policy or `latest` / `all`.
pub fn policy_versions(config: &str) -> Option<Vec<u64>> {
    let (start, end) = policy_span(config)?;
    let tokens = pbtxt::tokens(&config[start..end]);
    let specific = tokens.iter().position(|t| t.is_word("specific"))?;
    let at = specific
        + tokens[specific..]
            .iter()
            .position(|t| t.is_word("versions"))?;
    let mut i = at + 1;
    if tokens.get(i)?.kind == pbtxt::Kind::Colon {
        i += 1;
    }
    let number = |t: &pbtxt::Token| match &t.kind {
        pbtxt::Kind::Word(w) => w.parse::<u64>().ok(),
        _ => None,
    };
    match &tokens.get(i)?.kind {
        // `versions: [ 1, 2 ]`
        pbtxt::Kind::Open('[') => {
            let close = pbtxt::matching_close(&tokens, i)?;
            tokens[i + 1..close]
                .iter()
                .filter(|t| t.kind != pbtxt::Kind::Other(','))
                .map(number)
                .collect()
        }
        // `versions: 3` (a repeated field may be given one value at a time)
        pbtxt::Kind::Word(_) => Some(vec![number(&tokens[i])?]),
        _ => None,
    }
}

/// The fields a config sets at its top level, in order, each with its value when that is a
/// scalar (`max_batch_size: 8` -> ("max_batch_size", Some("8")); `backend: "recsys"` ->
/// ("backend", Some("recsys")); `input [ ... ]` -> ("input", None)). Comments and strings are
/// skipped, nested messages are not entered: enough to know what the file itself declares
/// (as opposed to what a backend completed) without a protobuf text parser.
pub fn top_level_fields(config: &str) -> Vec<(String, Option<String>)> {
    let tokens = pbtxt::tokens(config);
    pbtxt::top_level_fields(&tokens)
        .into_iter()
        .map(|field| {
            let scalar = match field.value.len() {
                1 => match &tokens[field.value.start].kind {
                    pbtxt::Kind::Word(v) | pbtxt::Kind::Text(v) => Some(v.clone()),
                    _ => None,
                },
                _ => None,
            };
            (field.name, scalar)
        })
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

/// max_batch_size of the minimal config written when a model's first version is approved and the
/// model has no config yet (`publish --max-batch-size` sets its own).
pub const DEFAULT_MAX_BATCH_SIZE: u32 = 64;

/// What a switch did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Switched {
    /// The version the config names now.
    pub serving: u64,
    /// The model had no config.pbtxt: a minimal one was written.
    pub created: bool,
}

/// Points `model`'s config at the newest approved version and returns it. Re-reads after every
/// write until the config and the version records agree, so concurrent switches converge on
/// the same answer (with conditional replace a stale writer is refused; without it, the last
/// writer re-checks and repairs).
pub fn switch(repo: &Repository, model: &str) -> Result<u64> {
    Ok(switch_creating(repo, model, DEFAULT_MAX_BATCH_SIZE)?.serving)
}

/// [`switch`], writing a minimal config (with `max_batch_size`) when the model has none. The
/// config is written only here, naming an approved version: a model folder never holds a config
/// that would let a replica load an unapproved version (Triton's default policy serves the
/// newest folder).
pub fn switch_creating(repo: &Repository, model: &str, max_batch_size: u32) -> Result<Switched> {
    let key = format!("{model}/{CONFIG_FILE}");
    let mut created = false;
    // The version last written: an error reading back after a write says the write happened.
    let mut written: Option<u64> = None;
    let after_write = |written: Option<u64>| {
        let key = &key;
        move |e: RegistryError| match written {
            Some(v) => RegistryError::Input(format!(
                "{key} was switched to version {v}, but reading it back failed: {e}"
            )),
            None => e,
        }
    };
    for _ in 0..32 {
        let listed = versions::list(repo, model).map_err(after_write(written))?;
        let target = versions::serving(&listed).ok_or_else(|| {
            RegistryError::Input(format!("{model} has no approved version to serve"))
        })?;
        let Some(config) = repo.read(&key).map_err(after_write(written))? else {
            // Of two first approvers one creates it; the other finds it on its next pass.
            let text = with_version(&minimal(max_batch_size), target);
            let made = repo.create(&key, text.as_bytes())?;
            created |= made;
            if made {
                written = Some(target);
            }
            continue;
        };
        let text = String::from_utf8(config.bytes.clone())
            .map_err(|_| RegistryError::Input(format!("{key} is not UTF-8 text")))?;
        if policy_versions(&text).as_deref() == Some(&[target]) {
            return Ok(Switched {
                serving: target,
                created,
            });
        }
        if repo.replace(&key, with_version(&text, target).as_bytes(), &config)? {
            written = Some(target);
        }
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

    #[test]
    fn top_level_fields_are_what_the_file_declares_not_what_is_nested() {
        let text = "# a comment: input\nname: \"m\" backend: \"recsys\"\nmax_batch_size: 8\n\
                    input [ { name: \"ITEM_IDS\" dims: [ -1 ] } ]\n\
                    parameters { key: \"top_k\" value { string_value: \"5\" } }\n\
                    version_policy: { specific: { versions: [ 2 ] } }\n";
        let fields = top_level_fields(text);
        let names: Vec<&str> = fields.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "name",
                "backend",
                "max_batch_size",
                "input",
                "parameters",
                "version_policy"
            ]
        );
        assert_eq!(fields[1].1.as_deref(), Some("recsys"));
        assert_eq!(fields[2].1.as_deref(), Some("8"));
        assert_eq!(fields[3].1, None);
        assert!(top_level_fields(&minimal(4))
            .iter()
            .any(|(n, v)| n == "max_batch_size" && v.as_deref() == Some("4")));
    }
}
