//! Fields of a model's hyper-parameters read from its JSON and checked against the weights: the
//! helpers every family's config resolution shares.

use serde_json::{Map, Value};

use crate::error::{EngineError, Result};

/// The first of `keys` present in the JSON, as an unsigned integer.
pub(crate) fn usize_field(json: &Map<String, Value>, keys: &[&str]) -> Result<Option<usize>> {
    for key in keys {
        if let Some(v) = json.get(*key) {
            return v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                EngineError::Config(format!("'{key}' must be a non-negative integer, found {v}"))
            });
        }
    }
    Ok(None)
}

/// Takes the value from the config when given (checking it against the weights) or else from the
/// weights; `what` names the field in error messages.
pub(crate) fn agree(
    what: &str,
    from_config: Option<usize>,
    from_weights: usize,
    evidence: &str,
) -> Result<usize> {
    match from_config {
        Some(v) if v != from_weights => Err(EngineError::Config(format!(
            "config says {what} = {v}, but {evidence} implies {from_weights}"
        ))),
        _ => Ok(from_weights),
    }
}
