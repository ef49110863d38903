//! The input lines of `recsys predict`: one JSON object per line with `item_ids` (the history),
//! optional `timestamps` and `query_timestamp` (unix seconds, for the models that read time),
//! `exclude_item_ids`, `candidate_item_ids`, `include_item_sets`, `exclude_item_sets`, `k` and
//! `return_embedding`; every other field passes through to the output line.
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
    /// `"include_item_sets"` / `"exclude_item_sets"`: item set names to keep and to drop.
    pub filter: Option<recsys_engine::ItemFilter>,
    /// `"timestamps"`: one unix timestamp (seconds) per history id.
    pub timestamps: Option<Vec<i64>>,
    /// `"query_timestamp"`: when the event to predict happens (default: now).
    pub query_timestamp: Option<i64>,
    pub passthrough: Map<String, Value>,
}

impl ParsedLine {
    /// The line's times as the engine takes them (`None` when the line has no `timestamps`).
    pub fn times(&self) -> Option<recsys_engine::RequestTimes<'_>> {
        recsys_engine::RequestTimes::given(self.timestamps.as_deref(), self.query_timestamp)
    }
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
    let mut sets = [Vec::new(), Vec::new()];
    for (field, names) in ["include_item_sets", "exclude_item_sets"]
        .into_iter()
        .zip(&mut sets)
    {
        match object.remove(field) {
            None | Some(Value::Null) => {}
            Some(v) => match set_names(&v, field) {
                Ok(list) => *names = list,
                Err(msg) => return fail(msg, object),
            },
        }
    }
    let [include, exclude_sets] = sets;
    let filter =
        (!include.is_empty() || !exclude_sets.is_empty()).then_some(recsys_engine::ItemFilter {
            include,
            exclude: exclude_sets,
        });
    let timestamps = match object.remove("timestamps") {
        None | Some(Value::Null) => None,
        Some(Value::Array(items)) => match items.iter().map(Value::as_i64).collect() {
            Some(times) => Some(times),
            None => {
                return fail(
                    "\"timestamps\" must be an array of integers (unix seconds)".into(),
                    object,
                )
            }
        },
        Some(v) => {
            return fail(
                format!("\"timestamps\" must be an array of integers (unix seconds), found {v}"),
                object,
            )
        }
    };
    let query_timestamp = match object.remove("query_timestamp") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_i64() {
            Some(t) => Some(t),
            None => {
                return fail(
                    format!("\"query_timestamp\" must be an integer (unix seconds), found {v}"),
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
        filter,
        timestamps,
        query_timestamp,
        passthrough: object,
    })
}

/// An array of item set names (`"category=shoes"`).
fn set_names(value: &Value, field: &str) -> std::result::Result<Vec<String>, String> {
    value
        .as_array()
        .and_then(|items| {
            items
                .iter()
                .map(|v| v.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
        })
        .ok_or_else(|| {
            format!(
                "\"{field}\" must be an array of item set names (\"column=value\"), found {value}"
            )
        })
}
