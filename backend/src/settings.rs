//! The model configuration (Triton's config.pbtxt, as JSON): reading the recsys parameters,
//! checking the config against the engine, and filling in what an auto-completed config leaves out.

use serde_json::{json, Map, Value};

use crate::error::{BackendError, Result};
use recsys_engine::idmap::IdType;
use recsys_engine::{EmptyHistoryPolicy, Engine, UnknownItemPolicy};

pub const INPUT_ITEM_IDS: &str = "ITEM_IDS";
pub const INPUT_K: &str = "K";
pub const INPUT_EXCLUDE: &str = "EXCLUDE_ITEM_IDS";
/// Optional: rank only these items (a retrieval stage's candidates), same type as `ITEM_IDS`.
pub const INPUT_CANDIDATES: &str = "CANDIDATE_ITEM_IDS";
/// Optional: item set names (`category=shoes`, TYPE_STRING) a history's answer must come from: in
/// every column named, in at least one of its sets.
pub const INPUT_INCLUDE_SETS: &str = "INCLUDE_ITEM_SETS";
/// Optional: item set names (TYPE_STRING) whose items a history's answer leaves out.
pub const INPUT_EXCLUDE_SETS: &str = "EXCLUDE_ITEM_SETS";
/// For the models that read time (HSTU): one unix timestamp (seconds, INT64) per `ITEM_IDS`
/// entry, ragged like it. Required by those models, ignored by the others.
pub const INPUT_TIMESTAMPS: &str = "ITEM_TIMESTAMPS";
/// Optional, for the models that read time: when the event to predict happens (INT64 unix
/// seconds, one per history); without it, the server's clock when the request is prepared.
pub const INPUT_QUERY_TIMESTAMP: &str = "QUERY_TIMESTAMP";
/// Every input the backend reads.
pub const INPUTS: [&str; 8] = [
    INPUT_ITEM_IDS,
    INPUT_K,
    INPUT_EXCLUDE,
    INPUT_CANDIDATES,
    INPUT_INCLUDE_SETS,
    INPUT_EXCLUDE_SETS,
    INPUT_TIMESTAMPS,
    INPUT_QUERY_TIMESTAMP,
];
pub const OUTPUT_ITEM_IDS: &str = "TOP_ITEM_IDS";
pub const OUTPUT_SCORES: &str = "TOP_SCORES";
/// Optional: the user embedding `[hidden, 1]` (FP32), whose inner product with an item's row of
/// `recsys export-items` is the model's score for that item. Computed only for requests that ask
/// for it.
pub const OUTPUT_EMBEDDING: &str = "USER_EMBEDDING";

/// Values in one user embedding: the output layer's input plus the trailing 1 that carries the
/// item bias.
pub fn embedding_width(engine: &Engine) -> usize {
    engine.model.output().input_size() + 1
}

/// Request limits, from the model's parameters (`max_history_length`, `max_k`, `max_exclude_ids`,
/// `max_id_bytes`, `max_request_bytes`). The defaults protect the server from one request taking
/// all its memory or time; a request beyond them gets INVALID_ARG naming the limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub max_history: usize,
    pub max_k: usize,
    pub max_exclude: usize,
    pub max_candidates: usize,
    /// Set names per history in each of INCLUDE_ITEM_SETS and EXCLUDE_ITEM_SETS.
    pub max_item_sets: usize,
    pub max_id_bytes: usize,
    pub max_request_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_history: 10_000,
            max_k: 1_000,
            max_exclude: 10_000,
            max_candidates: 10_000,
            max_item_sets: 64,
            max_id_bytes: 256,
            max_request_bytes: 16 << 20,
        }
    }
}

/// Element type of the item-id tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdTensorType {
    Int64,
    /// `TYPE_STRING` (Triton BYTES): 4-byte little-endian length, then the UTF-8 bytes.
    String,
}

/// What the backend needs from the model configuration.
#[derive(Clone, Debug)]
pub struct ModelSettings {
    pub default_k: usize,
    pub limits: Limits,
    /// Scoring threads per instance (instances x threads should not exceed the cores).
    pub threads: usize,
    pub exclude_seen: bool,
    pub unknown_items: UnknownItemPolicy,
    /// Who answers a history without a known item (parameter `empty_history_policy`).
    pub empty_history: EmptyHistoryPolicy,
    /// 0 when the model does not batch (shapes then have no batch dimension).
    pub max_batch_size: u64,
    pub item_ids_type: IdTensorType,
    pub exclude_type: IdTensorType,
    pub output_ids_type: IdTensorType,
    /// Where the model's live availability object is read from, and how often.
    pub availability: Option<AvailabilitySettings>,
    /// Where the model's live catalogue delta is read from, and how often.
    pub catalogue: Option<LiveObjectSettings>,
    /// The prefix cache's byte budget and idle expiry (parameters `prefix_cache_bytes`,
    /// `prefix_cache_idle_seconds`); `None`: no cache.
    pub prefix_cache: Option<(usize, Option<std::time::Duration>)>,
    /// Whether a screened engine runs its int8 screen: by measurement (`auto`), or pinned
    /// (parameter `screen_policy`).
    pub screen_policy: recsys_engine::plan::ScreenPolicy,
    /// Which kernels a bf16 engine runs on a CPU with AVX512-BF16: by measurement (`auto`), or
    /// pinned (parameter `bf16_path`: `native` or `widened`).
    pub bf16_path: recsys_engine::plan::Bf16Path,
    /// Whether a bf16 engine's layers, an int8 engine's output layer or a screened engine's int8
    /// screen run on AMX tiles where the CPU has them: by measurement (`auto`), always (`on`) or never (`off`) (parameter `amx`).
    pub amx: recsys_engine::plan_amx::AmxPolicy,
    /// The largest row group an instance whose kernels come in two (AVX-512) cuts batches into:
    /// by measurement (`auto`), or pinned (parameter `row_block`: `4` or `8`).
    pub row_block: recsys_engine::plan::RowBlockPolicy,
    /// How many of the instance's threads each batch size gets: by measurement (`auto`), all of
    /// them (`all`), or a fixed count (parameter `thread_plan`).
    pub thread_plan: recsys_engine::plan::ThreadPolicy,
}

/// Default of `prefix_cache_bytes` for GRU4Rec: a GRU4Rec state is a few hundred bytes to a few
/// KiB per user, so this holds tens of thousands of users.
pub const DEFAULT_PREFIX_CACHE_BYTES: usize = 64 << 20;
/// Default of `prefix_cache_bytes` for SASRec and HSTU, whose states grow with the history: every
/// layer's key and value rows per event (SASRec: 1 KiB per event at MovieLens-1M's shape, 2
/// layers of 64, so this holds about 1,300 users at 200 events, or 5,000 at 50; HSTU: 3.2 KiB
/// per event at the official MovieLens-1M config, 8 blocks of 2 heads x (25 + 25), so about 400
/// users at 200 events).
pub const DEFAULT_PREFIX_CACHE_BYTES_SASREC: usize = 256 << 20;
/// Default of `prefix_cache_idle_seconds`: a session idle this long is over.
pub const DEFAULT_PREFIX_CACHE_IDLE_SECONDS: u64 = 1800;

/// Parameters `<object>_source`, `<object>_poll_seconds` and `<object>_max_bytes` of a live
/// object (`availability`, `catalogue`).
#[derive(Clone, Debug, PartialEq)]
pub struct LiveObjectSettings {
    /// A file (relative to the model's folder, or absolute) or an object (`s3://...`, `gs://...`).
    pub source: String,
    /// How often the source is checked; `None`: only when the model loads.
    pub poll: Option<std::time::Duration>,
    /// The largest object read (`None`: derived from the catalogue's size,
    /// `recsys_engine::default_max_availability_bytes`, `default_max_catalogue_bytes`).
    pub max_bytes: Option<u64>,
}

/// The availability parameters.
pub type AvailabilitySettings = LiveObjectSettings;

/// Default of `availability_poll_seconds`: a stock change shows within seconds, and a check of
/// an unchanged object is one conditional GET.
pub const DEFAULT_AVAILABILITY_POLL_SECONDS: f64 = 10.0;
/// Default of `catalogue_poll_seconds`: a new product shows within a minute; a swap builds the
/// catalogue's tables again, so it is not checked as often as stock.
pub const DEFAULT_CATALOGUE_POLL_SECONDS: f64 = 30.0;
/// The shortest poll interval accepted (a tighter loop only loads the store).
const MIN_POLL_SECONDS: f64 = 0.1;

impl ModelSettings {
    pub fn options(&self) -> recsys_engine::ServeOptions {
        recsys_engine::ServeOptions {
            default_k: self.default_k,
            exclude_seen: self.exclude_seen,
            unknown_items: self.unknown_items,
            empty_history: self.empty_history,
        }
    }
}

/// A `parameters { key: ... value { string_value: ... } }` entry.
/// A plan's policy parameter (`screen_policy`, `bf16_path`, `amx`, `row_block`, `thread_plan`): its
/// default (`auto`) when absent; a value the policy does not take is refused with its message.
fn plan_policy<T: std::str::FromStr<Err = String> + Default>(
    config: &Value,
    key: &str,
) -> Result<T, BackendError> {
    match parameter(config, key) {
        None => Ok(T::default()),
        Some(text) => text
            .trim()
            .parse()
            .map_err(|e: String| BackendError::InvalidConfig(format!("parameter {e}"))),
    }
}

fn parameter<'a>(config: &'a Value, key: &str) -> Option<&'a str> {
    config
        .get("parameters")?
        .get(key)?
        .get("string_value")?
        .as_str()
}

/// Triton prints int64 fields either as numbers or as strings depending on the path; accept both.
fn as_i64(v: &Value) -> Option<i64> {
    v.as_i64().or_else(|| v.as_str()?.parse().ok())
}

fn tensors<'a>(config: &'a Value, field: &str) -> &'a [Value] {
    config
        .get(field)
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

fn find<'a>(list: &'a [Value], name: &str) -> Option<&'a Value> {
    list.iter()
        .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
}

fn data_type(tensor: &Value) -> &str {
    tensor
        .get("data_type")
        .and_then(Value::as_str)
        .unwrap_or("")
}

fn id_tensor_type(tensor: &Value, what: &str) -> Result<IdTensorType> {
    match data_type(tensor) {
        "TYPE_INT64" => Ok(IdTensorType::Int64),
        "TYPE_STRING" | "TYPE_BYTES" => Ok(IdTensorType::String),
        other => Err(BackendError::InvalidConfig(format!(
            "{what} must be TYPE_INT64 or TYPE_STRING, the config says {other:?}"
        ))),
    }
}

const KNOWN_PARAMETERS: &[&str] = &[
    "top_k",
    "exclude_seen",
    "unknown_item_policy",
    "threads",
    "max_history_length",
    "max_k",
    "max_exclude_ids",
    "max_candidates",
    "max_item_sets",
    "max_id_bytes",
    "max_request_bytes",
    "max_engine_bytes",
    "empty_history_policy",
    "availability_source",
    "availability_poll_seconds",
    "availability_max_bytes",
    "catalogue_source",
    "catalogue_poll_seconds",
    "catalogue_max_bytes",
    "prefix_cache_bytes",
    "prefix_cache_idle_seconds",
    "screen_policy",
    "bf16_path",
    "amx",
    "row_block",
    "thread_plan",
];

/// The prefix cache parameters: on by default for the models that carry a state (GRU4Rec,
/// SASRec, HSTU), off with `prefix_cache_bytes` 0; asked of another model, refused naming why.
fn prefix_cache(
    config: &Value,
    engine: &Engine,
) -> Result<Option<(usize, Option<std::time::Duration>)>> {
    let why_not = engine.why_no_prefix_cache();
    let default = match engine.kind() {
        recsys_engine::ModelKind::Sasrec | recsys_engine::ModelKind::Hstu => {
            DEFAULT_PREFIX_CACHE_BYTES_SASREC
        }
        _ => DEFAULT_PREFIX_CACHE_BYTES,
    };
    let bytes = match parameter(config, "prefix_cache_bytes").map(str::trim) {
        None => why_not.is_none().then_some(default),
        Some(text) => match text.parse::<usize>() {
            Ok(0) => None,
            Ok(bytes) => match why_not {
                None => Some(bytes),
                Some(why) => {
                    return Err(BackendError::InvalidConfig(format!(
                        "parameter prefix_cache_bytes: a {} model recomputes every history \
                         ({why}; the prefix cache serves GRU4Rec, SASRec and HSTU); remove the \
                         parameter or set it to 0",
                        engine.kind()
                    )))
                }
            },
            Err(_) => {
                return Err(BackendError::InvalidConfig(format!(
                "parameter prefix_cache_bytes must be a byte count (0: no cache), found {text:?}"
            )))
            }
        },
    };
    let idle = match parameter(config, "prefix_cache_idle_seconds").map(str::trim) {
        None => Some(std::time::Duration::from_secs(
            DEFAULT_PREFIX_CACHE_IDLE_SECONDS,
        )),
        Some(text) => match text.parse::<u64>() {
            Ok(0) => None,
            Ok(seconds) => Some(std::time::Duration::from_secs(seconds)),
            Err(_) => {
                return Err(BackendError::InvalidConfig(format!(
                    "parameter prefix_cache_idle_seconds must be whole seconds (0: no expiry), \
                     found {text:?}"
                )))
            }
        },
    };
    Ok(bytes.map(|b| (b, idle)))
}

/// A live object's parameters (`<object>_source`, `_poll_seconds`, `_max_bytes`): none without a
/// source; a poll interval or bound needs one.
fn live_object(
    config: &Value,
    object: &str,
    default_poll_seconds: f64,
) -> Result<Option<LiveObjectSettings>> {
    let (source_key, poll_key, bound_key) = (
        format!("{object}_source"),
        format!("{object}_poll_seconds"),
        format!("{object}_max_bytes"),
    );
    let poll = match parameter(config, &poll_key).map(str::trim) {
        None => None,
        Some(text) => match text.parse::<f64>() {
            Ok(0.0) => Some(None),
            Ok(s) if s.is_finite() && s >= MIN_POLL_SECONDS => {
                Some(Some(std::time::Duration::from_secs_f64(s)))
            }
            _ => {
                return Err(BackendError::InvalidConfig(format!(
                    "parameter {poll_key} must be 0 (read at load only) or a number of seconds \
                     from {MIN_POLL_SECONDS}, found {text:?}"
                )))
            }
        },
    };
    let max_bytes = match parameter(config, &bound_key) {
        None => None,
        Some(_) => Some(limit(config, &bound_key, 1)? as u64),
    };
    match parameter(config, &source_key).map(str::trim) {
        None if poll.is_some() || max_bytes.is_some() => Err(BackendError::InvalidConfig(format!(
            "parameters {poll_key} and {bound_key} need {source_key}, which is not set"
        ))),
        None => Ok(None),
        Some("") => Err(BackendError::InvalidConfig(format!(
            "parameter {source_key} is empty"
        ))),
        Some(source) => Ok(Some(LiveObjectSettings {
            source: source.to_string(),
            poll: poll.unwrap_or(Some(std::time::Duration::from_secs_f64(
                default_poll_seconds,
            ))),
            max_bytes,
        })),
    }
}

/// The `max_engine_bytes` parameter: the largest engine (all its files) the model may load; read
/// before the engine, so an oversized one is refused without being read.
pub fn max_engine_bytes(config: &Value) -> Result<u64> {
    let default = recsys_engine::engine_dir::DEFAULT_MAX_ENGINE_BYTES as usize;
    Ok(limit(config, "max_engine_bytes", default)? as u64)
}

/// A positive integer parameter, or its default.
fn limit(config: &Value, key: &str, default: usize) -> Result<usize> {
    match parameter(config, key) {
        None => Ok(default),
        Some(text) => match text.trim().parse::<usize>() {
            Ok(v) if v >= 1 => Ok(v),
            _ => Err(BackendError::InvalidConfig(format!(
                "parameter {key} must be a positive integer, found {text:?}"
            ))),
        },
    }
}

/// Reads and checks the configuration against the loaded engine.
pub fn parse(config: &Value, engine: &Engine) -> Result<ModelSettings> {
    if let Some(params) = config.get("parameters").and_then(Value::as_object) {
        for key in params.keys() {
            if !KNOWN_PARAMETERS.contains(&key.as_str()) {
                return Err(BackendError::InvalidConfig(format!(
                    "unknown parameter {key:?} (the recsys backend reads {})",
                    KNOWN_PARAMETERS.join(", ")
                )));
            }
        }
    }
    let default_k = match parameter(config, "top_k") {
        None => 10,
        Some(text) => match text.trim().parse::<usize>() {
            Ok(k) if k >= 1 => k,
            _ => {
                return Err(BackendError::InvalidConfig(format!(
                    "parameter top_k must be a positive integer, found {text:?}"
                )))
            }
        },
    };
    let threads = match parameter(config, "threads") {
        None => 1,
        Some(text) => match text.trim().parse::<usize>() {
            Ok(t) if (1..=256).contains(&t) => t,
            _ => {
                return Err(BackendError::InvalidConfig(format!(
                    "parameter threads must be an integer from 1 to 256, found {text:?}"
                )))
            }
        },
    };
    let defaults = Limits::default();
    let limits = Limits {
        max_history: limit(config, "max_history_length", defaults.max_history)?,
        max_k: limit(config, "max_k", defaults.max_k)?,
        max_exclude: limit(config, "max_exclude_ids", defaults.max_exclude)?,
        max_candidates: limit(config, "max_candidates", defaults.max_candidates)?,
        max_item_sets: limit(config, "max_item_sets", defaults.max_item_sets)?,
        max_id_bytes: limit(config, "max_id_bytes", defaults.max_id_bytes)?,
        max_request_bytes: limit(config, "max_request_bytes", defaults.max_request_bytes)?,
    };
    if default_k > limits.max_k {
        return Err(BackendError::InvalidConfig(format!(
            "parameter top_k = {default_k} is more than max_k = {}",
            limits.max_k
        )));
    }
    let exclude_seen = match parameter(config, "exclude_seen").map(str::trim) {
        None | Some("true") => true,
        Some("false") => false,
        Some(other) => {
            return Err(BackendError::InvalidConfig(format!(
                "parameter exclude_seen must be \"true\" or \"false\", found {other:?}"
            )))
        }
    };
    let unknown_items = match parameter(config, "unknown_item_policy") {
        None => UnknownItemPolicy::Drop,
        Some(text) => text
            .trim()
            .parse()
            .map_err(|e: String| BackendError::InvalidConfig(format!("parameter {e}")))?,
    };
    let empty_history = match parameter(config, "empty_history_policy") {
        None => EmptyHistoryPolicy::Auto,
        Some(text) => text
            .trim()
            .parse()
            .map_err(|e: String| BackendError::InvalidConfig(format!("parameter {e}")))?,
    };
    if empty_history == EmptyHistoryPolicy::Popular && engine.popularity.is_none() {
        return Err(BackendError::InvalidConfig(
            "parameter empty_history_policy is \"popular\", but the engine has no popularity \
             list: convert it with --interactions"
                .into(),
        ));
    }
    let max_batch_size = config
        .get("max_batch_size")
        .and_then(as_i64)
        .unwrap_or(0)
        .max(0) as u64;

    let inputs = tensors(config, "input");
    let outputs = tensors(config, "output");
    for tensor in inputs {
        let name = tensor.get("name").and_then(Value::as_str).unwrap_or("");
        if !INPUTS.contains(&name) {
            return Err(BackendError::InvalidConfig(format!(
                "input {name:?} is not one the recsys backend reads ({})",
                INPUTS.join(", ")
            )));
        }
    }
    for tensor in outputs {
        let name = tensor.get("name").and_then(Value::as_str).unwrap_or("");
        if ![OUTPUT_ITEM_IDS, OUTPUT_SCORES, OUTPUT_EMBEDDING].contains(&name) {
            return Err(BackendError::InvalidConfig(format!(
                "output {name:?} is not one the recsys backend produces ({OUTPUT_ITEM_IDS}, \
                 {OUTPUT_SCORES}, {OUTPUT_EMBEDDING})"
            )));
        }
    }
    let item_ids = find(inputs, INPUT_ITEM_IDS).ok_or_else(|| {
        BackendError::InvalidConfig(format!("the config has no {INPUT_ITEM_IDS} input"))
    })?;
    let item_ids_type = id_tensor_type(item_ids, INPUT_ITEM_IDS)?;
    let exclude_type = match find(inputs, INPUT_EXCLUDE) {
        Some(t) => id_tensor_type(t, INPUT_EXCLUDE)?,
        None => item_ids_type,
    };
    if let Some(t) = find(inputs, INPUT_CANDIDATES) {
        // INT64 or STRING, like the other id inputs (either maps onto any catalogue).
        id_tensor_type(t, INPUT_CANDIDATES)?;
    }
    for name in [INPUT_INCLUDE_SETS, INPUT_EXCLUDE_SETS] {
        if let Some(t) = find(inputs, name) {
            if !matches!(data_type(t), "TYPE_STRING" | "TYPE_BYTES") {
                return Err(BackendError::InvalidConfig(format!(
                    "{name} holds item set names and must be TYPE_STRING, the config says {:?}",
                    data_type(t)
                )));
            }
        }
    }
    for name in [INPUT_TIMESTAMPS, INPUT_QUERY_TIMESTAMP] {
        if let Some(t) = find(inputs, name) {
            if data_type(t) != "TYPE_INT64" {
                return Err(BackendError::InvalidConfig(format!(
                    "{name} holds unix timestamps in seconds and must be TYPE_INT64, the config \
                     says {:?}",
                    data_type(t)
                )));
            }
        }
    }
    if engine.kind().reads_timestamps() && find(inputs, INPUT_TIMESTAMPS).is_none() {
        return Err(BackendError::InvalidConfig(format!(
            "a {} model reads when each event happened: the config needs the input \
             {{ name: \"{INPUT_TIMESTAMPS}\" data_type: TYPE_INT64 dims: [ -1 ] }} (ragged like \
             {INPUT_ITEM_IDS}; leave inputs out and the backend completes them)",
            engine.kind()
        )));
    }
    if let Some(k) = find(inputs, INPUT_K) {
        if data_type(k) != "TYPE_INT32" {
            return Err(BackendError::InvalidConfig(format!(
                "{INPUT_K} must be TYPE_INT32, the config says {:?}",
                data_type(k)
            )));
        }
    }
    let top_ids = find(outputs, OUTPUT_ITEM_IDS).ok_or_else(|| {
        BackendError::InvalidConfig(format!("the config has no {OUTPUT_ITEM_IDS} output"))
    })?;
    let output_ids_type = id_tensor_type(top_ids, OUTPUT_ITEM_IDS)?;
    let catalogue = engine.manifest.id_type;
    if catalogue == IdType::String && output_ids_type == IdTensorType::Int64 {
        return Err(BackendError::InvalidConfig(format!(
            "the engine's catalogue has string item ids, so {OUTPUT_ITEM_IDS} must be TYPE_STRING, not TYPE_INT64"
        )));
    }
    let scores = find(outputs, OUTPUT_SCORES).ok_or_else(|| {
        BackendError::InvalidConfig(format!("the config has no {OUTPUT_SCORES} output"))
    })?;
    if data_type(scores) != "TYPE_FP32" {
        return Err(BackendError::InvalidConfig(format!(
            "{OUTPUT_SCORES} must be TYPE_FP32, the config says {:?}",
            data_type(scores)
        )));
    }
    for output in [top_ids, scores] {
        let dims: Vec<i64> = tensors(output, "dims").iter().filter_map(as_i64).collect();
        if dims.len() != 1 || (dims[0] != -1 && dims[0] < default_k as i64) {
            return Err(BackendError::InvalidConfig(format!(
                "output {} must have dims [ -1 ] (one variable dimension up to k), the config says {dims:?}",
                output.get("name").and_then(Value::as_str).unwrap_or("")
            )));
        }
    }
    if let Some(embedding) = find(outputs, OUTPUT_EMBEDDING) {
        let width = embedding_width(engine) as i64;
        let dims: Vec<i64> = tensors(embedding, "dims")
            .iter()
            .filter_map(as_i64)
            .collect();
        if data_type(embedding) != "TYPE_FP32" || (dims != [width] && dims != [-1]) {
            return Err(BackendError::InvalidConfig(format!(
                "output {OUTPUT_EMBEDDING} must be TYPE_FP32 with dims [ {width} ] (the model's \
                 hidden size plus 1), the config says {:?} {dims:?}",
                data_type(embedding)
            )));
        }
    }
    Ok(ModelSettings {
        default_k,
        limits,
        threads,
        exclude_seen,
        unknown_items,
        empty_history,
        max_batch_size,
        item_ids_type,
        exclude_type,
        output_ids_type,
        availability: live_object(config, "availability", DEFAULT_AVAILABILITY_POLL_SECONDS)?,
        catalogue: live_object(config, "catalogue", DEFAULT_CATALOGUE_POLL_SECONDS)?,
        prefix_cache: prefix_cache(config, engine)?,
        screen_policy: plan_policy(config, "screen_policy")?,
        bf16_path: plan_policy(config, "bf16_path")?,
        amx: plan_policy(config, "amx")?,
        row_block: plan_policy(config, "row_block")?,
        thread_plan: plan_policy(config, "thread_plan")?,
    })
}

/// Fills the inputs, outputs and parameters a minimal config leaves out, from the engine's id type,
/// embedding width ([`embedding_width`]) and whether its model reads timestamps. Returns true when
/// the config changed. Existing entries are never overwritten.
pub fn auto_complete(config: &mut Value, engine: &Engine) -> bool {
    let Some(object) = config.as_object_mut() else {
        return false;
    };
    let embedding_width = embedding_width(engine);
    let reads_timestamps = engine.kind().reads_timestamps();
    let id_type = match engine.manifest.id_type {
        IdType::Int64 => "TYPE_INT64",
        IdType::String => "TYPE_STRING",
    };
    let batching = object.get("max_batch_size").and_then(as_i64).unwrap_or(0) > 0;
    let mut changed = false;
    let mut fill = |object: &mut Map<String, Value>, field: &str, entries: Vec<Value>| {
        let list = object.entry(field).or_insert_with(|| json!([]));
        if !list.is_array() {
            *list = json!([]);
        }
        let list = list.as_array_mut().expect("made an array");
        if list.is_empty() {
            *list = entries;
            changed = true;
        }
    };
    let ragged = |mut t: Value| {
        if batching {
            t["allow_ragged_batch"] = json!(true);
        }
        t
    };
    let mut inputs = vec![
        ragged(json!({"name": INPUT_ITEM_IDS, "data_type": id_type, "dims": [-1]})),
        json!({"name": INPUT_K, "data_type": "TYPE_INT32", "dims": [1], "optional": true}),
        ragged(
            json!({"name": INPUT_EXCLUDE, "data_type": id_type, "dims": [-1], "optional": true}),
        ),
        ragged(
            json!({"name": INPUT_CANDIDATES, "data_type": id_type, "dims": [-1], "optional": true}),
        ),
        ragged(
            json!({"name": INPUT_INCLUDE_SETS, "data_type": "TYPE_STRING", "dims": [-1], "optional": true}),
        ),
        ragged(
            json!({"name": INPUT_EXCLUDE_SETS, "data_type": "TYPE_STRING", "dims": [-1], "optional": true}),
        ),
    ];
    if reads_timestamps {
        inputs.extend([
            ragged(json!({"name": INPUT_TIMESTAMPS, "data_type": "TYPE_INT64", "dims": [-1]})),
            json!({"name": INPUT_QUERY_TIMESTAMP, "data_type": "TYPE_INT64", "dims": [1], "optional": true}),
        ]);
    }
    fill(object, "input", inputs);
    fill(
        object,
        "output",
        vec![
            json!({"name": OUTPUT_ITEM_IDS, "data_type": id_type, "dims": [-1]}),
            json!({"name": OUTPUT_SCORES, "data_type": "TYPE_FP32", "dims": [-1]}),
            json!({"name": OUTPUT_EMBEDDING, "data_type": "TYPE_FP32", "dims": [embedding_width]}),
        ],
    );
    let params = object.entry("parameters").or_insert_with(|| json!({}));
    if let Some(params) = params.as_object_mut() {
        if !params.contains_key("top_k") {
            params.insert("top_k".into(), json!({"string_value": "10"}));
            changed = true;
        }
    }
    // Batch whatever is already queued, without waiting: a queue delay is pure latency at low load.
    if batching
        && !object.contains_key("dynamic_batching")
        && !object.contains_key("sequence_batching")
    {
        object.insert("dynamic_batching".into(), json!({}));
        changed = true;
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine() -> (Engine, tempfile::TempDir) {
        crate::test_support::fixture_engine("bert4rec", recsys_engine::ModelKind::Bert4rec)
    }

    fn minimal() -> Value {
        json!({"name": "m", "backend": "recsys", "max_batch_size": 64})
    }

    #[test]
    fn auto_complete_fills_a_minimal_config_that_then_parses() {
        let (engine, _tmp) = engine();
        let mut config = minimal();
        assert!(auto_complete(&mut config, &engine));
        assert_eq!(config["input"][0]["allow_ragged_batch"], true);
        assert_eq!(config["dynamic_batching"], json!({}));
        let settings = parse(&config, &engine).unwrap();
        assert_eq!(settings.default_k, 10);
        assert_eq!(settings.item_ids_type, IdTensorType::Int64);
        assert!(settings.exclude_seen);
        // A second pass changes nothing.
        assert!(!auto_complete(&mut config, &engine));
    }

    #[test]
    fn an_hstu_config_is_completed_with_its_timestamps_and_refused_without_them() {
        let (hstu, _tmp) =
            crate::test_support::fixture_engine("hstu", recsys_engine::ModelKind::Hstu);
        let mut config = minimal();
        assert!(auto_complete(&mut config, &hstu));
        let names: Vec<&str> = config["input"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap())
            .collect();
        assert!(names.contains(&INPUT_TIMESTAMPS) && names.contains(&INPUT_QUERY_TIMESTAMP));
        parse(&config, &hstu).unwrap();
        // Other models are not given them.
        let (engine, _tmp2) = engine();
        let mut plain = minimal();
        auto_complete(&mut plain, &engine);
        assert!(!plain.to_string().contains(INPUT_TIMESTAMPS));

        let mut without = config.clone();
        without["input"]
            .as_array_mut()
            .unwrap()
            .retain(|t| t["name"] != INPUT_TIMESTAMPS);
        let err = parse(&without, &hstu).unwrap_err().to_string();
        assert!(
            err.contains("needs the input") && err.contains(INPUT_TIMESTAMPS),
            "{err}"
        );
        let mut int32 = config.clone();
        for t in int32["input"].as_array_mut().unwrap() {
            if t["name"] == INPUT_TIMESTAMPS {
                t["data_type"] = json!("TYPE_INT32");
            }
        }
        let err = parse(&int32, &hstu).unwrap_err().to_string();
        assert!(err.contains("must be TYPE_INT64"), "{err}");
    }

    #[test]
    fn bad_parameters_are_named() {
        let (engine, _tmp) = engine();
        let mut config = minimal();
        auto_complete(&mut config, &engine);
        for (key, value, needle) in [
            ("top_k", "zero", "top_k must be a positive integer"),
            ("top_k", "0", "top_k must be a positive integer"),
            ("exclude_seen", "maybe", "exclude_seen must be"),
            (
                "unknown_item_policy",
                "panic",
                "unknown_item_policy must be",
            ),
            ("topk", "10", "unknown parameter \"topk\""),
            ("threads", "0", "threads must be an integer from 1 to 256"),
            ("max_k", "x", "max_k must be a positive integer"),
            ("top_k", "5000", "more than max_k"),
            ("screen_policy", "sometimes", "screen_policy must be"),
            ("bf16_path", "fastest", "bf16_path must be"),
            ("amx", "yes", "amx must be"),
            ("row_block", "16", "row_block must be"),
            ("thread_plan", "0", "thread_plan must be"),
            ("thread_plan", "most", "thread_plan must be"),
        ] {
            let mut c = config.clone();
            c["parameters"][key] = json!({"string_value": value});
            let err = parse(&c, &engine).unwrap_err().to_string();
            assert!(err.contains(needle), "{key}={value}: {err}");
        }
    }

    #[test]
    fn catalogue_parameters_are_read_and_checked() {
        let (engine, _tmp) = engine();
        let mut config = minimal();
        auto_complete(&mut config, &engine);
        assert_eq!(parse(&config, &engine).unwrap().catalogue, None);
        let with = |pairs: &[(&str, &str)]| {
            let mut c = config.clone();
            for (key, value) in pairs {
                c["parameters"][*key] = json!({ "string_value": value });
            }
            parse(&c, &engine).map(|s| s.catalogue)
        };
        assert_eq!(
            with(&[("catalogue_source", "recsys-catalogue.bin")]).unwrap(),
            Some(LiveObjectSettings {
                source: "recsys-catalogue.bin".into(),
                poll: Some(std::time::Duration::from_secs_f64(
                    DEFAULT_CATALOGUE_POLL_SECONDS
                )),
                max_bytes: None,
            })
        );
        let set = with(&[
            ("catalogue_source", "c.bin"),
            ("catalogue_poll_seconds", "2"),
            ("catalogue_max_bytes", "4096"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (set.poll, set.max_bytes),
            (Some(std::time::Duration::from_secs(2)), Some(4096))
        );
        let err = with(&[("catalogue_poll_seconds", "5")]).unwrap_err();
        assert!(err.to_string().contains("need catalogue_source"), "{err}");
        let err = with(&[
            ("catalogue_source", "c.bin"),
            ("catalogue_poll_seconds", "x"),
        ])
        .unwrap_err();
        assert!(
            err.to_string().contains("catalogue_poll_seconds must be"),
            "{err}"
        );
    }

    #[test]
    fn availability_parameters_are_read_and_checked() {
        let (engine, _tmp) = engine();
        let mut config = minimal();
        auto_complete(&mut config, &engine);
        assert_eq!(parse(&config, &engine).unwrap().availability, None);
        let with = |pairs: &[(&str, &str)]| {
            let mut c = config.clone();
            for (key, value) in pairs {
                c["parameters"][*key] = json!({ "string_value": value });
            }
            parse(&c, &engine).map(|s| s.availability)
        };
        let seconds = std::time::Duration::from_secs_f64;
        assert_eq!(
            with(&[(
                "availability_source",
                "s3://models/shop/recsys-availability.bin"
            )])
            .unwrap(),
            Some(AvailabilitySettings {
                source: "s3://models/shop/recsys-availability.bin".into(),
                poll: Some(seconds(DEFAULT_AVAILABILITY_POLL_SECONDS)),
                max_bytes: None,
            })
        );
        let bounded = with(&[
            ("availability_source", "stock.bin"),
            ("availability_max_bytes", "1048576"),
        ]);
        assert_eq!(bounded.unwrap().unwrap().max_bytes, Some(1 << 20));
        let polled = with(&[
            ("availability_source", "stock.bin"),
            ("availability_poll_seconds", "0.5"),
        ]);
        assert_eq!(polled.unwrap().unwrap().poll, Some(seconds(0.5)));
        let at_load = with(&[
            ("availability_source", "stock.bin"),
            ("availability_poll_seconds", "0"),
        ]);
        assert_eq!(at_load.unwrap().unwrap().poll, None);
        for (pairs, needle) in [
            (
                &[("availability_poll_seconds", "5")][..],
                "need availability_source",
            ),
            (
                &[("availability_max_bytes", "100")][..],
                "need availability_source",
            ),
            (
                &[
                    ("availability_source", "x"),
                    ("availability_max_bytes", "0"),
                ][..],
                "availability_max_bytes",
            ),
            (&[("availability_source", " ")][..], "is empty"),
            (
                &[
                    ("availability_source", "x"),
                    ("availability_poll_seconds", "0.01"),
                ][..],
                "availability_poll_seconds must be",
            ),
            (
                &[
                    ("availability_source", "x"),
                    ("availability_poll_seconds", "soon"),
                ][..],
                "availability_poll_seconds must be",
            ),
        ] {
            let err = with(pairs).unwrap_err().to_string();
            assert!(err.contains(needle), "{pairs:?}: {err}");
        }
    }

    #[test]
    fn the_prefix_cache_is_on_for_gru4rec_and_sasrec_by_default_and_refused_elsewhere() {
        let (gru, _tmp) =
            crate::test_support::fixture_engine("gru4rec", recsys_engine::ModelKind::Gru4rec);
        let mut config = minimal();
        auto_complete(&mut config, &gru);
        let with = |engine: &Engine, pairs: &[(&str, &str)]| {
            let mut c = config.clone();
            for (key, value) in pairs {
                c["parameters"][*key] = json!({ "string_value": value });
            }
            parse(&c, engine).map(|s| s.prefix_cache)
        };
        let idle = Some(std::time::Duration::from_secs(
            DEFAULT_PREFIX_CACHE_IDLE_SECONDS,
        ));
        assert_eq!(
            with(&gru, &[]).unwrap(),
            Some((DEFAULT_PREFIX_CACHE_BYTES, idle))
        );
        assert_eq!(with(&gru, &[("prefix_cache_bytes", "0")]).unwrap(), None);
        assert_eq!(
            with(
                &gru,
                &[
                    ("prefix_cache_bytes", "1000"),
                    ("prefix_cache_idle_seconds", "0")
                ]
            )
            .unwrap(),
            Some((1000, None))
        );
        assert!(with(&gru, &[("prefix_cache_bytes", "lots")])
            .unwrap_err()
            .to_string()
            .contains("byte count"));
        let (sasrec, _tmp3) =
            crate::test_support::fixture_engine("sasrec", recsys_engine::ModelKind::Sasrec);
        assert_eq!(
            with(&sasrec, &[]).unwrap(),
            Some((DEFAULT_PREFIX_CACHE_BYTES_SASREC, idle))
        );
        assert_eq!(
            with(&sasrec, &[("prefix_cache_bytes", "5000")]).unwrap(),
            Some((5000, idle))
        );
        let (bert, _tmp2) = engine();
        assert_eq!(with(&bert, &[]).unwrap(), None);
        assert_eq!(with(&bert, &[("prefix_cache_bytes", "0")]).unwrap(), None);
        let refused = with(&bert, &[("prefix_cache_bytes", "1000")])
            .unwrap_err()
            .to_string();
        assert!(
            refused.contains("serves GRU4Rec, SASRec and HSTU")
                && refused.contains("bidirectional"),
            "{refused}"
        );
    }

    #[test]
    fn the_embedding_output_must_have_the_models_width() {
        let (engine, _tmp) = engine();
        let width = embedding_width(&engine);
        assert_eq!(width, engine.model.output().input_size() + 1);
        let mut config = minimal();
        auto_complete(&mut config, &engine);
        assert_eq!(config["output"][2]["name"], OUTPUT_EMBEDDING);
        parse(&config, &engine).unwrap();
        config["output"][2]["dims"] = json!([-1]);
        parse(&config, &engine).unwrap();
        for (dims, data_type) in [
            (json!([width - 1]), "TYPE_FP32"),
            (json!([-1]), "TYPE_FP16"),
        ] {
            let mut c = config.clone();
            c["output"][2]["dims"] = dims;
            c["output"][2]["data_type"] = json!(data_type);
            let err = parse(&c, &engine).unwrap_err().to_string();
            assert!(
                err.contains(&format!(
                    "USER_EMBEDDING must be TYPE_FP32 with dims [ {width} ]"
                )),
                "{err}"
            );
        }
    }

    #[test]
    fn max_engine_bytes_is_read_before_the_engine() {
        let mut config = minimal();
        assert_eq!(
            max_engine_bytes(&config).unwrap(),
            recsys_engine::engine_dir::DEFAULT_MAX_ENGINE_BYTES
        );
        config["parameters"] = json!({"max_engine_bytes": {"string_value": "1048576"}});
        assert_eq!(max_engine_bytes(&config).unwrap(), 1 << 20);
        config["parameters"]["max_engine_bytes"] = json!({"string_value": "-1"});
        let err = max_engine_bytes(&config).unwrap_err().to_string();
        assert!(
            err.contains("max_engine_bytes must be a positive integer"),
            "{err}"
        );
    }

    #[test]
    fn config_contradicting_the_engine_is_refused() {
        let (engine, _tmp) = engine();
        let mut config = minimal();
        auto_complete(&mut config, &engine);
        let mut c = config.clone();
        c["output"][1]["data_type"] = json!("TYPE_FP16");
        assert!(parse(&c, &engine)
            .unwrap_err()
            .to_string()
            .contains("TOP_SCORES must be TYPE_FP32"));
        let mut c = config.clone();
        c["input"][0]["data_type"] = json!("TYPE_FP32");
        assert!(parse(&c, &engine)
            .unwrap_err()
            .to_string()
            .contains("ITEM_IDS must be"));
        let mut c = config.clone();
        c["output"][0]["dims"] = json!([5]);
        assert!(parse(&c, &engine).unwrap_err().to_string().contains("dims"));
        let mut c = config.clone();
        c["input"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name": "USER_ID", "data_type": "TYPE_INT64", "dims": [1]}));
        assert!(parse(&c, &engine)
            .unwrap_err()
            .to_string()
            .contains("USER_ID"));
        let mut c = config.clone();
        c["input"].as_array_mut().unwrap().remove(0);
        assert!(parse(&c, &engine)
            .unwrap_err()
            .to_string()
            .contains("no ITEM_IDS input"));
        // Strings in, strings out: fine for an int64 catalogue (ids are parsed).
        let mut c = config.clone();
        c["input"][0]["data_type"] = json!("TYPE_STRING");
        c["output"][0]["data_type"] = json!("TYPE_STRING");
        assert_eq!(
            parse(&c, &engine).unwrap().output_ids_type,
            IdTensorType::String
        );
        // Dims given as strings (one of Triton's JSON spellings of int64) are understood.
        let mut c = config.clone();
        c["output"][0]["dims"] = json!(["-1"]);
        assert!(parse(&c, &engine).is_ok());
    }
}
