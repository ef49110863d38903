//! The input lines of `recsys predict`: one JSON object per line with `item_ids` (the history),
//! optional `exclude_item_ids` and `k`; every other field passes through to the output line.
//! Pure parsing, kept apart from the command so it can be fuzzed.

use serde_json::{Map, Value};

/// A line longer than this is refused without being parsed (a history of a million ids fits).
pub const MAX_LINE_BYTES: usize = 16 << 20;

pub enum Ids {
    Int(Vec<i64>),
    Str(Vec<String>),
}

impl Ids {
    /// Numbers stay numbers; any string in the list makes the whole list strings (an int64
    /// catalogue still resolves digit strings).
    pub fn parse(value: &Value, field: &str) -> std::result::Result<Ids, String> {
        let items = value
            .as_array()
            .ok_or_else(|| format!("\"{field}\" must be an array of item ids"))?;
        if items.iter().all(|v| v.is_i64()) {
            return Ok(Ids::Int(
                items.iter().map(|v| v.as_i64().expect("checked")).collect(),
            ));
        }
        items
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                Value::Number(n) if n.is_i64() => Ok(n.to_string()),
                other => Err(format!(
                    "\"{field}\" holds {other}, which is not an item id (integer or string)"
                )),
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map(Ids::Str)
    }
}

/// A line that could not be turned into a request: the message, and the fields to pass through.
pub type LineError = (String, Map<String, Value>);

/// One input line: its 1-based number and what it parsed into.
pub type Line = (u64, std::result::Result<ParsedLine, LineError>);

pub struct ParsedLine {
    pub history: Ids,
    pub exclude: Option<Ids>,
    /// `"candidate_item_ids"`: rank only these items.
    pub candidates: Option<Ids>,
    pub k: Option<i64>,
    /// `"return_embedding": true`: also answer the user embedding.
    pub return_embedding: bool,
    pub passthrough: Map<String, Value>,
}

pub fn parse_line(text: &str) -> std::result::Result<ParsedLine, LineError> {
    let mut object = match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(map)) => map,
        Ok(_) => return Err(("the line is not a JSON object".into(), Map::new())),
        Err(e) => return Err((format!("invalid JSON: {e}"), Map::new())),
    };
    let fail = |msg: String, object: Map<String, Value>| Err((msg, object));
    let Some(history) = object.remove("item_ids") else {
        return fail("missing \"item_ids\"".into(), object);
    };
    let history = match Ids::parse(&history, "item_ids") {
        Ok(ids) => ids,
        Err(msg) => return fail(msg, object),
    };
    let exclude = match object.remove("exclude_item_ids") {
        None | Some(Value::Null) => None,
        Some(v) => match Ids::parse(&v, "exclude_item_ids") {
            Ok(ids) => Some(ids),
            Err(msg) => return fail(msg, object),
        },
    };
    let candidates = match object.remove("candidate_item_ids") {
        None | Some(Value::Null) => None,
        Some(v) => match Ids::parse(&v, "candidate_item_ids") {
            Ok(ids) => Some(ids),
            Err(msg) => return fail(msg, object),
        },
    };
    let k = match object.remove("k") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_i64() {
            Some(k) if k >= 1 => Some(k),
            _ => {
                return fail(
                    format!("\"k\" must be a positive integer, found {v}"),
                    object,
                )
            }
        },
    };
    let return_embedding = match object.remove("return_embedding") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => b,
        Some(v) => {
            return fail(
                format!("\"return_embedding\" must be true or false, found {v}"),
                object,
            )
        }
    };
    Ok(ParsedLine {
        history,
        exclude,
        candidates,
        k,
        return_embedding,
        passthrough: object,
    })
}
