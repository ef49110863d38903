//! Turning a request's input tensors into engine requests, and engine answers into output tensors.
//! Pure Rust over byte buffers: the FFI layer only gathers the bytes and hands them here.

use crate::error::{BackendError, Result};
use crate::settings::{
    IdTensorType, Limits, INPUTS, INPUT_CANDIDATES, INPUT_EXCLUDE, INPUT_EXCLUDE_SETS,
    INPUT_INCLUDE_SETS, INPUT_ITEM_IDS, INPUT_K, INPUT_QUERY_TIMESTAMP, INPUT_TIMESTAMPS,
    OUTPUT_EMBEDDING, OUTPUT_ITEM_IDS, OUTPUT_SCORES,
};
use recsys_engine::topk::Scored;
use recsys_engine::{Engine, ExternalId, ExternalIds, ItemFilter};

/// Element types the backend distinguishes (the FFI layer maps Triton's enum onto these).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    Int64,
    Int32,
    Bytes,
    /// Any other type, by its Triton name, for error messages.
    Other(&'static str),
}

/// One input tensor of a request, its buffers already gathered into one contiguous copy.
#[derive(Clone, Debug)]
pub struct InputTensor {
    pub name: String,
    pub dtype: DType,
    /// Includes the batch dimension when the model batches.
    pub shape: Vec<i64>,
    pub data: Vec<u8>,
}

/// Item ids of one history as they arrived.
#[derive(Clone, Debug, PartialEq)]
pub enum OwnedIds {
    Int(Vec<i64>),
    Str(Vec<String>),
}

impl OwnedIds {
    /// Runs `f` with a borrowed view of the ids.
    /// `f` of an optional list, as external ids.
    pub fn with_optional<R>(
        ids: Option<&OwnedIds>,
        f: impl FnOnce(Option<ExternalIds<'_>>) -> R,
    ) -> R {
        match ids {
            None => f(None),
            Some(ids) => ids.with_external(|external| f(Some(external))),
        }
    }

    pub fn with_external<R>(&self, f: impl FnOnce(ExternalIds<'_>) -> R) -> R {
        match self {
            OwnedIds::Int(v) => f(ExternalIds::Int(v)),
            OwnedIds::Str(v) => {
                let refs: Vec<&str> = v.iter().map(String::as_str).collect();
                f(ExternalIds::Str(&refs))
            }
        }
    }

    pub fn len(&self) -> usize {
        match self {
            OwnedIds::Int(v) => v.len(),
            OwnedIds::Str(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Which outputs a request asked for (Triton lists all of the model's when the client named none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestedOutputs {
    pub item_ids: bool,
    pub scores: bool,
    pub embedding: bool,
}

impl RequestedOutputs {
    /// The ranked outputs without the embedding: what a client of the plain contract asks for.
    pub const TOP_K: RequestedOutputs = RequestedOutputs {
        item_ids: true,
        scores: true,
        embedding: false,
    };

    pub fn from_names(names: &[String]) -> RequestedOutputs {
        let has = |name: &str| names.iter().any(|n| n == name);
        RequestedOutputs {
            item_ids: has(OUTPUT_ITEM_IDS),
            scores: has(OUTPUT_SCORES),
            embedding: has(OUTPUT_EMBEDDING),
        }
    }

    /// Whether any ranked output is wanted (else nothing is scored).
    pub fn ranked(&self) -> bool {
        self.item_ids || self.scores
    }
}

/// One history of a request (a request may carry several along its batch dimension).
#[derive(Clone, Debug, PartialEq)]
pub struct RowRequest {
    pub history: OwnedIds,
    /// `Some(0)`: no item is scored (the user embedding alone).
    pub k: Option<i64>,
    pub exclude: Option<OwnedIds>,
    /// Rank only these items.
    pub candidates: Option<OwnedIds>,
    /// Answer the user embedding too.
    pub embedding: bool,
    /// Item sets to keep and to drop (INCLUDE_ITEM_SETS, EXCLUDE_ITEM_SETS); `None` when the
    /// request names none.
    pub filter: Option<ItemFilter>,
    /// ITEM_TIMESTAMPS: one unix timestamp per history id (`None` when the request has none).
    pub timestamps: Option<Vec<i64>>,
    /// QUERY_TIMESTAMP: when the event to predict happens (`None`: now).
    pub query_timestamp: Option<i64>,
}

impl RowRequest {
    /// The row's times as the engine takes them.
    pub fn times(&self) -> Option<recsys_engine::RequestTimes<'_>> {
        recsys_engine::RequestTimes::given(self.timestamps.as_deref(), self.query_timestamp)
    }
}

/// The rows of one request, and the outputs it asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodedRequest {
    pub rows: Vec<RowRequest>,
    pub outputs: RequestedOutputs,
}

fn invalid(msg: String) -> BackendError {
    BackendError::InvalidInput(msg)
}

/// `[batch, length]` of a tensor: with batching the shape is `[B, L]`, without it `[L]`.
fn rows_and_width(t: &InputTensor, batched: bool) -> Result<(usize, usize)> {
    let dims: Vec<usize> = t
        .shape
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<_, _>>()
        .map_err(|_| {
            invalid(format!(
                "{} has a negative dimension in shape {:?}",
                t.name, t.shape
            ))
        })?;
    match (batched, dims.as_slice()) {
        (true, [b, l]) => Ok((*b, *l)),
        (false, [l]) => Ok((1, *l)),
        _ => Err(invalid(format!(
            "{} must have shape {}, found {:?}",
            t.name,
            if batched {
                "[batch, length]"
            } else {
                "[length]"
            },
            t.shape
        ))),
    }
}

/// Splits BYTES tensor data into its elements (4-byte little-endian length, then the bytes).
pub fn split_bytes_elements(
    name: &str,
    data: &[u8],
    expected: usize,
    max_len: usize,
) -> Result<Vec<String>> {
    let mut out = Vec::with_capacity(expected.min(data.len() / 4));
    let mut rest = data;
    for i in 0..expected {
        let Some((len, tail)) = rest.split_first_chunk::<4>() else {
            return Err(invalid(format!(
                "{name}: element {i} is truncated (its 4-byte length prefix is missing)"
            )));
        };
        let len = u32::from_le_bytes(*len) as usize;
        if len > max_len {
            return Err(invalid(format!(
                "{name}: element {i} is {len} bytes, more than max_id_bytes {max_len}"
            )));
        }
        if len > tail.len() {
            return Err(invalid(format!(
                "{name}: element {i} claims {len} bytes but only {} remain",
                tail.len()
            )));
        }
        let text = std::str::from_utf8(&tail[..len])
            .map_err(|_| invalid(format!("{name}: element {i} is not valid UTF-8")))?;
        out.push(text.to_owned());
        rest = &tail[len..];
    }
    if !rest.is_empty() {
        return Err(invalid(format!(
            "{name}: {} bytes left over after its {expected} elements",
            rest.len()
        )));
    }
    Ok(out)
}

/// The rows of an id tensor (ITEM_IDS or EXCLUDE_ITEM_IDS).
fn id_rows(
    t: &InputTensor,
    batched: bool,
    max_width: usize,
    limit_name: &str,
    limits: &Limits,
) -> Result<Vec<OwnedIds>> {
    let (rows, width) = rows_and_width(t, batched)?;
    if width > max_width {
        return Err(invalid(format!(
            "{} holds {width} ids per history, more than {limit_name} {max_width}",
            t.name
        )));
    }
    let count = rows
        .checked_mul(width)
        .ok_or_else(|| invalid(format!("{} shape {:?} is too large", t.name, t.shape)))?;
    match t.dtype {
        DType::Int64 => {
            if t.data.len() != count * 8 {
                return Err(invalid(format!(
                    "{} holds {} bytes, but shape {:?} of INT64 needs {}",
                    t.name,
                    t.data.len(),
                    t.shape,
                    count * 8
                )));
            }
            let values: Vec<i64> = t
                .data
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect();
            Ok((0..rows)
                .map(|r| OwnedIds::Int(values[r * width..(r + 1) * width].to_vec()))
                .collect())
        }
        DType::Bytes => {
            let mut values =
                split_bytes_elements(&t.name, &t.data, count, limits.max_id_bytes)?.into_iter();
            Ok((0..rows)
                .map(|_| OwnedIds::Str(values.by_ref().take(width).collect()))
                .collect())
        }
        DType::Int32 => Err(invalid(format!(
            "{} must be INT64 or BYTES, found INT32",
            t.name
        ))),
        DType::Other(name) => Err(invalid(format!(
            "{} must be INT64 or BYTES, found {name}",
            t.name
        ))),
    }
}

/// Decodes one request's inputs, given the outputs it asked for.
pub fn decode(
    inputs: &[InputTensor],
    outputs: RequestedOutputs,
    batched: bool,
    limits: &Limits,
) -> Result<DecodedRequest> {
    let total: usize = inputs.iter().map(|t| t.data.len()).sum();
    if total > limits.max_request_bytes {
        return Err(invalid(format!(
            "the request's inputs hold {total} bytes, more than max_request_bytes {}",
            limits.max_request_bytes
        )));
    }
    for t in inputs {
        if !INPUTS.contains(&t.name.as_str()) {
            return Err(invalid(format!("unexpected input {:?}", t.name)));
        }
    }
    let find = |name: &str| inputs.iter().find(|t| t.name == name);
    let items = find(INPUT_ITEM_IDS)
        .ok_or_else(|| invalid(format!("the request has no {INPUT_ITEM_IDS} input")))?;
    let histories = id_rows(
        items,
        batched,
        limits.max_history,
        "max_history_length",
        limits,
    )?;
    let rows = histories.len();

    let ks: Vec<Option<i64>> = match find(INPUT_K) {
        None => vec![None; rows],
        Some(t) => {
            if t.dtype != DType::Int32 {
                return Err(invalid(format!(
                    "{INPUT_K} must be INT32, found {:?}",
                    t.dtype
                )));
            }
            let values: Vec<i32> = t
                .data
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect();
            if values.len() != rows || t.data.len() % 4 != 0 {
                return Err(invalid(format!(
                    "{INPUT_K} must hold one INT32 per history ({rows}), found shape {:?} with {} bytes",
                    t.shape,
                    t.data.len()
                )));
            }
            // K = 0 (no items) makes sense only for a request that wants the user embedding
            // alone: with the ranked outputs asked for too (as when a client names no outputs,
            // which asks for all), it is a mistake.
            let least = if outputs.ranked() { 1 } else { 0 };
            if let Some(bad) = values.iter().find(|&&k| k < least) {
                return Err(invalid(if *bad == 0 {
                    format!(
                        "{INPUT_K} = 0 asks for no items: it is allowed only when {OUTPUT_EMBEDDING} \
                         is the only output requested"
                    )
                } else {
                    format!("{INPUT_K} must be at least {least}, found {bad}")
                }));
            }
            if let Some(big) = values.iter().find(|&&k| k as usize > limits.max_k) {
                return Err(invalid(format!(
                    "{INPUT_K} = {big} is more than max_k {}",
                    limits.max_k
                )));
            }
            values.into_iter().map(|k| Some(k as i64)).collect()
        }
    };
    // The optional per-history id lists: one row per history, each within its limit.
    let optional_rows =
        |name: &str, max: usize, limit_name: &str| -> Result<Vec<Option<OwnedIds>>> {
            let Some(t) = find(name) else {
                return Ok(vec![None; rows]);
            };
            let lists = id_rows(t, batched, max, limit_name, limits)?;
            if lists.len() != rows {
                return Err(invalid(format!(
                    "{name} has {} rows, {INPUT_ITEM_IDS} has {rows}",
                    lists.len()
                )));
            }
            Ok(lists.into_iter().map(Some).collect())
        };
    let excludes = optional_rows(INPUT_EXCLUDE, limits.max_exclude, "max_exclude_ids")?;
    let candidates = optional_rows(INPUT_CANDIDATES, limits.max_candidates, "max_candidates")?;
    let include_sets = set_name_rows(find(INPUT_INCLUDE_SETS), rows, batched, limits)?;
    let exclude_sets = set_name_rows(find(INPUT_EXCLUDE_SETS), rows, batched, limits)?;
    let timestamps = match find(INPUT_TIMESTAMPS) {
        None => vec![None; rows],
        Some(t) => {
            if t.dtype != DType::Int64 {
                return Err(invalid(format!(
                    "{INPUT_TIMESTAMPS} holds unix timestamps in seconds and must be INT64, \
                     found {:?}",
                    t.dtype
                )));
            }
            let lists = id_rows(t, batched, limits.max_history, "max_history_length", limits)?;
            if lists.len() != rows {
                return Err(invalid(format!(
                    "{INPUT_TIMESTAMPS} has {} rows, {INPUT_ITEM_IDS} has {rows}",
                    lists.len()
                )));
            }
            lists
                .into_iter()
                .map(|list| match list {
                    OwnedIds::Int(times) => Some(times),
                    OwnedIds::Str(_) => unreachable!("an INT64 tensor decodes to integers"),
                })
                .collect()
        }
    };
    let query_timestamps: Vec<Option<i64>> = match find(INPUT_QUERY_TIMESTAMP) {
        None => vec![None; rows],
        Some(t) => {
            if t.dtype != DType::Int64 || t.data.len() != rows * 8 {
                return Err(invalid(format!(
                    "{INPUT_QUERY_TIMESTAMP} must hold one INT64 per history ({rows}), found \
                     {:?} of shape {:?} with {} bytes",
                    t.dtype,
                    t.shape,
                    t.data.len()
                )));
            }
            t.data
                .chunks_exact(8)
                .map(|c| Some(i64::from_le_bytes(c.try_into().expect("8 bytes"))))
                .collect()
        }
    };
    Ok(DecodedRequest {
        rows: histories
            .into_iter()
            .zip(ks)
            .zip(excludes)
            .zip(candidates)
            .zip(include_sets.into_iter().zip(exclude_sets))
            .zip(timestamps.into_iter().zip(query_timestamps))
            .map(
                |(
                    ((((history, k), exclude), candidates), (include, drop)),
                    (timestamps, query_timestamp),
                )| RowRequest {
                    history,
                    // Asked for the embedding alone: nothing to score.
                    k: if outputs.ranked() { k } else { Some(0) },
                    exclude,
                    candidates,
                    embedding: outputs.embedding,
                    filter: (!include.is_empty() || !drop.is_empty()).then_some(ItemFilter {
                        include,
                        exclude: drop,
                    }),
                    timestamps,
                    query_timestamp,
                },
            )
            .collect(),
        outputs,
    })
}

/// Each history's item set names from INCLUDE_ITEM_SETS or EXCLUDE_ITEM_SETS (BYTES, one name
/// per element; empty elements, which pad a ragged batch, are ignored), or none per history when
/// the request does not carry the input.
fn set_name_rows(
    tensor: Option<&InputTensor>,
    rows: usize,
    batched: bool,
    limits: &Limits,
) -> Result<Vec<Vec<String>>> {
    let Some(t) = tensor else {
        return Ok(vec![Vec::new(); rows]);
    };
    if t.dtype != DType::Bytes {
        return Err(invalid(format!(
            "{} holds item set names and must be BYTES (TYPE_STRING), found {:?}",
            t.name, t.dtype
        )));
    }
    let lists = id_rows(t, batched, limits.max_item_sets, "max_item_sets", limits)?;
    if lists.len() != rows {
        return Err(invalid(format!(
            "{} has {} rows, {INPUT_ITEM_IDS} has {rows}",
            t.name,
            lists.len()
        )));
    }
    Ok(lists
        .into_iter()
        .map(|names| match names {
            OwnedIds::Str(names) => names.into_iter().filter(|n| !n.is_empty()).collect(),
            OwnedIds::Int(_) => unreachable!("a BYTES tensor decodes to strings"),
        })
        .collect())
}

/// Output tensors of one response.
#[derive(Clone, Debug, PartialEq)]
pub struct EncodedOutputs {
    pub shape: Vec<i64>,
    pub ids: Vec<u8>,
    pub ids_type: IdTensorType,
    pub scores: Vec<u8>,
}

/// Score written where a row has fewer results than the widest row of its request (only possible
/// when one request carries several histories): the lowest f32, which JSON can carry (NaN and
/// infinities cannot), with id -1 or the empty string.
pub const PADDING_SCORE: f32 = f32::MIN;
pub const PADDING_ID: i64 = -1;

/// The response tensors of one request's answer rows. Every item index is checked against the
/// catalogue before it is mapped to an external id: an index a kernel or a device got wrong fails
/// this response with an internal error naming it, instead of a panic or a wrong id.
pub fn encode(
    rows: &[Vec<Scored>],
    engine: &Engine,
    ids_type: IdTensorType,
    batched: bool,
) -> Result<EncodedOutputs> {
    let width = rows.iter().map(Vec::len).max().unwrap_or(0);
    let shape = if batched {
        vec![rows.len() as i64, width as i64]
    } else {
        vec![width as i64]
    };
    let mut ids = Vec::with_capacity(rows.len() * width * 8);
    let mut scores = Vec::with_capacity(rows.len() * width * 4);
    for row in rows {
        for slot in 0..width {
            let item = row.get(slot);
            scores.extend_from_slice(&item.map_or(PADDING_SCORE, |s| s.score).to_le_bytes());
            let id = match item {
                None => None,
                Some(s) => Some(engine.external_id(s.index).ok_or_else(|| {
                    BackendError::Internal(format!(
                        "the model returned item index {}, outside the catalogue of {} items",
                        s.index,
                        engine.n_items()
                    ))
                })?),
            };
            match ids_type {
                IdTensorType::Int64 => {
                    let value = match id {
                        Some(ExternalId::Int(i)) => i,
                        // The config check refuses INT64 outputs for string catalogues.
                        Some(ExternalId::Str(_)) | None => PADDING_ID,
                    };
                    ids.extend_from_slice(&value.to_le_bytes());
                }
                IdTensorType::String => {
                    let text = match id {
                        Some(ExternalId::Int(i)) => i.to_string(),
                        Some(ExternalId::Str(s)) => s,
                        None => String::new(),
                    };
                    ids.extend_from_slice(&(text.len() as u32).to_le_bytes());
                    ids.extend_from_slice(text.as_bytes());
                }
            }
        }
    }
    Ok(EncodedOutputs {
        shape,
        ids,
        ids_type,
        scores,
    })
}

/// The `USER_EMBEDDING` tensor of one response: `[rows, width]` with batching, `[width]` without.
pub fn encode_embeddings(embeddings: &[Vec<f32>], batched: bool) -> Result<(Vec<i64>, Vec<u8>)> {
    let width = embeddings.first().map_or(0, Vec::len);
    if let Some(bad) = embeddings.iter().find(|e| e.len() != width) {
        return Err(BackendError::Internal(format!(
            "the engine returned user embeddings of {} and {width} values in one response",
            bad.len()
        )));
    }
    let shape = if batched {
        vec![embeddings.len() as i64, width as i64]
    } else {
        vec![width as i64]
    };
    let bytes = embeddings
        .iter()
        .flat_map(|e| e.iter().flat_map(|v| v.to_le_bytes()))
        .collect();
    Ok((shape, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes for a client of the plain top-k contract.
    fn decode_top(
        inputs: &[InputTensor],
        batched: bool,
        limits: &Limits,
    ) -> Result<DecodedRequest> {
        decode(inputs, RequestedOutputs::TOP_K, batched, limits)
    }

    fn int_tensor(name: &str, shape: Vec<i64>, values: &[i64]) -> InputTensor {
        InputTensor {
            name: name.into(),
            dtype: DType::Int64,
            shape,
            data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    fn bytes_of(items: &[&str]) -> Vec<u8> {
        items
            .iter()
            .flat_map(|s| (s.len() as u32).to_le_bytes().into_iter().chain(s.bytes()))
            .collect()
    }

    #[test]
    fn decodes_batched_rows_with_k_and_exclusions() {
        let inputs = vec![
            int_tensor(INPUT_ITEM_IDS, vec![2, 3], &[1, 2, 3, 4, 5, 6]),
            InputTensor {
                name: INPUT_K.into(),
                dtype: DType::Int32,
                shape: vec![2, 1],
                data: [5i32, 7].iter().flat_map(|v| v.to_le_bytes()).collect(),
            },
            int_tensor(INPUT_EXCLUDE, vec![2, 1], &[9, 8]),
        ];
        let d = decode_top(&inputs, true, &Limits::default()).unwrap();
        assert_eq!(d.rows.len(), 2);
        assert_eq!(d.rows[1].history, OwnedIds::Int(vec![4, 5, 6]));
        assert_eq!(d.rows[1].k, Some(7));
        assert_eq!(d.rows[0].exclude, Some(OwnedIds::Int(vec![9])));
    }

    #[test]
    fn timestamps_and_query_times_are_read_per_history_and_checked() {
        let ids = int_tensor(INPUT_ITEM_IDS, vec![2, 2], &[1, 2, 3, 4]);
        let times = int_tensor(INPUT_TIMESTAMPS, vec![2, 2], &[100, 200, 300, 400]);
        let query = int_tensor(INPUT_QUERY_TIMESTAMP, vec![2, 1], &[250, 500]);
        let d = decode_top(
            &[ids.clone(), times.clone(), query.clone()],
            true,
            &Limits::default(),
        )
        .unwrap();
        assert_eq!(d.rows[1].timestamps, Some(vec![300, 400]));
        assert_eq!(d.rows[0].query_timestamp, Some(250));
        let row = d.rows[1].times().unwrap();
        assert_eq!((row.events, row.query), (&[300, 400][..], Some(500)));
        // Without QUERY_TIMESTAMP the query time is left to the engine (now); without either,
        // no times at all.
        let d = decode_top(&[ids.clone(), times.clone()], true, &Limits::default()).unwrap();
        assert_eq!(d.rows[0].query_timestamp, None);
        let d = decode_top(std::slice::from_ref(&ids), true, &Limits::default()).unwrap();
        assert!(d.rows[0].times().is_none());

        let as_int32 = InputTensor {
            dtype: DType::Int32,
            ..times.clone()
        };
        let err = decode_top(&[ids.clone(), as_int32], true, &Limits::default()).unwrap_err();
        assert!(
            err.to_string()
                .contains("ITEM_TIMESTAMPS holds unix timestamps"),
            "{err}"
        );
        let one_row = int_tensor(INPUT_TIMESTAMPS, vec![1, 2], &[100, 200]);
        let err = decode_top(&[ids.clone(), one_row], true, &Limits::default()).unwrap_err();
        assert!(
            err.to_string().contains("ITEM_TIMESTAMPS has 1 rows"),
            "{err}"
        );
        let one_query = int_tensor(INPUT_QUERY_TIMESTAMP, vec![1, 1], &[250]);
        let err = decode_top(&[ids, times, one_query], true, &Limits::default()).unwrap_err();
        assert!(
            err.to_string()
                .contains("QUERY_TIMESTAMP must hold one INT64 per history (2)"),
            "{err}"
        );
    }

    #[test]
    fn the_requested_outputs_decide_what_is_scored() {
        let k = |v: i32| InputTensor {
            name: INPUT_K.into(),
            dtype: DType::Int32,
            shape: vec![1, 1],
            data: v.to_le_bytes().to_vec(),
        };
        let history = || int_tensor(INPUT_ITEM_IDS, vec![1, 2], &[1, 2]);
        let names = |list: &[&str]| -> Vec<String> { list.iter().map(|s| s.to_string()).collect() };
        let all = RequestedOutputs::from_names(&names(&[
            OUTPUT_ITEM_IDS,
            OUTPUT_SCORES,
            OUTPUT_EMBEDDING,
        ]));
        assert!(all.ranked() && all.embedding);
        // Every output (what a client naming none asks for): K = 0 is a mistake.
        let d = decode(&[history(), k(3)], all, true, &Limits::default()).unwrap();
        assert_eq!((d.rows[0].k, d.rows[0].embedding), (Some(3), true));
        let err = decode(&[history(), k(0)], all, true, &Limits::default()).unwrap_err();
        assert!(
            err.to_string()
                .contains("USER_EMBEDDING is the only output requested"),
            "{err}"
        );
        // Only the embedding asked for: nothing is scored, whatever K says, and K = 0 is fine.
        let alone = RequestedOutputs::from_names(&names(&[OUTPUT_EMBEDDING]));
        assert!(!alone.ranked());
        for given in [0, 5] {
            let d = decode(&[history(), k(given)], alone, true, &Limits::default()).unwrap();
            assert_eq!((d.rows[0].k, d.rows[0].embedding), (Some(0), true));
        }
        let err = decode(&[history(), k(-1)], alone, true, &Limits::default()).unwrap_err();
        assert!(
            err.to_string().contains("K must be at least 0, found -1"),
            "{err}"
        );
        // The plain contract: K as given, no embedding.
        let top = RequestedOutputs::from_names(&names(&[OUTPUT_SCORES]));
        let d = decode(&[history(), k(5)], top, true, &Limits::default()).unwrap();
        assert_eq!((d.rows[0].k, d.rows[0].embedding), (Some(5), false));
        let err = decode(&[history(), k(0)], top, true, &Limits::default()).unwrap_err();
        assert!(
            err.to_string()
                .contains("USER_EMBEDDING is the only output requested"),
            "{err}"
        );
    }

    #[test]
    fn embeddings_are_encoded_row_by_row() {
        let rows = vec![vec![1.0f32, -2.5, 1.0], vec![0.5, 0.25, 1.0]];
        let (shape, bytes) = encode_embeddings(&rows, true).unwrap();
        assert_eq!(shape, vec![2, 3]);
        let values: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(values, [1.0, -2.5, 1.0, 0.5, 0.25, 1.0]);
        assert_eq!(encode_embeddings(&rows[..1], false).unwrap().0, vec![3]);
        let ragged = vec![vec![1.0f32, 1.0], vec![1.0]];
        assert!(matches!(
            encode_embeddings(&ragged, true),
            Err(BackendError::Internal(_))
        ));
    }

    #[test]
    fn empty_history_is_a_row_with_no_ids() {
        let d = decode_top(
            &[int_tensor(INPUT_ITEM_IDS, vec![1, 0], &[])],
            true,
            &Limits::default(),
        )
        .unwrap();
        assert!(d.rows[0].history.is_empty());
    }

    #[test]
    fn string_ids() {
        let t = InputTensor {
            name: INPUT_ITEM_IDS.into(),
            dtype: DType::Bytes,
            shape: vec![1, 2],
            data: bytes_of(&["sku-1", "é"]),
        };
        let d = decode_top(&[t], true, &Limits::default()).unwrap();
        assert_eq!(
            d.rows[0].history,
            OwnedIds::Str(vec!["sku-1".into(), "é".into()])
        );
    }

    #[test]
    fn item_set_names_decode_per_history_and_bad_ones_are_named() {
        let names = |name: &str, shape: Vec<i64>, items: &[&str]| InputTensor {
            name: name.into(),
            dtype: DType::Bytes,
            shape,
            data: bytes_of(items),
        };
        let limits = Limits::default();
        let history = int_tensor(INPUT_ITEM_IDS, vec![2, 1], &[1, 2]);
        let d = decode_top(
            &[
                history.clone(),
                names(
                    INPUT_INCLUDE_SETS,
                    vec![2, 2],
                    &["category=shoes", "region=EU", "category=hats", ""],
                ),
                names(INPUT_EXCLUDE_SETS, vec![2, 1], &["", "stock=out"]),
            ],
            true,
            &limits,
        )
        .unwrap();
        let filter = |r: usize| d.rows[r].filter.clone().unwrap();
        assert_eq!(filter(0).include, vec!["category=shoes", "region=EU"]);
        assert!(filter(0).exclude.is_empty());
        assert_eq!(filter(1).include, vec!["category=hats"]);
        assert_eq!(filter(1).exclude, vec!["stock=out"]);
        // Without the inputs, no filter at all.
        let plain = decode_top(std::slice::from_ref(&history), true, &limits).unwrap();
        assert!(plain.rows.iter().all(|r| r.filter.is_none()));
        // INT64 set names, too many names, rows that do not match the histories: refused, named.
        let wrong_type = int_tensor(INPUT_INCLUDE_SETS, vec![2, 1], &[7, 8]);
        let err = decode_top(&[history.clone(), wrong_type], true, &limits).unwrap_err();
        assert!(
            err.to_string()
                .contains("INCLUDE_ITEM_SETS holds item set names"),
            "{err}"
        );
        let many: Vec<String> = (0..65).map(|i| format!("tag={i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let err = decode_top(
            &[
                int_tensor(INPUT_ITEM_IDS, vec![1, 1], &[1]),
                names(INPUT_EXCLUDE_SETS, vec![1, 65], &many),
            ],
            true,
            &limits,
        )
        .unwrap_err();
        assert!(err.to_string().contains("max_item_sets 64"), "{err}");
        let err = decode_top(
            &[history, names(INPUT_INCLUDE_SETS, vec![1, 1], &["a=b"])],
            true,
            &limits,
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("INCLUDE_ITEM_SETS has 1 rows"),
            "{err}"
        );
    }

    #[test]
    fn limits_are_enforced_and_named() {
        let limits = Limits {
            max_history: 3,
            max_k: 5,
            max_exclude: 2,
            max_candidates: 2,
            max_id_bytes: 4,
            max_request_bytes: 1000,
            max_item_sets: 2,
        };
        let too_long = decode_top(
            &[int_tensor(INPUT_ITEM_IDS, vec![1, 4], &[1, 2, 3, 4])],
            true,
            &limits,
        )
        .unwrap_err();
        assert!(
            too_long
                .to_string()
                .contains("more than max_history_length 3"),
            "{too_long}"
        );
        let k = InputTensor {
            name: INPUT_K.into(),
            dtype: DType::Int32,
            shape: vec![1, 1],
            data: 6i32.to_le_bytes().to_vec(),
        };
        let big_k = decode_top(
            &[int_tensor(INPUT_ITEM_IDS, vec![1, 1], &[1]), k],
            true,
            &limits,
        )
        .unwrap_err();
        assert!(big_k.to_string().contains("more than max_k 5"), "{big_k}");
        let cand = decode_top(
            &[
                int_tensor(INPUT_ITEM_IDS, vec![1, 1], &[1]),
                int_tensor(INPUT_CANDIDATES, vec![1, 3], &[1, 2, 3]),
            ],
            true,
            &limits,
        )
        .unwrap_err();
        assert!(cand.to_string().contains("max_candidates 2"), "{cand}");
        let ok = decode_top(
            &[
                int_tensor(INPUT_ITEM_IDS, vec![2, 1], &[1, 2]),
                int_tensor(INPUT_CANDIDATES, vec![2, 2], &[7, 8, 9, 10]),
            ],
            true,
            &limits,
        )
        .unwrap();
        assert_eq!(ok.rows[1].candidates, Some(OwnedIds::Int(vec![9, 10])));
        let rows_mismatch = decode_top(
            &[
                int_tensor(INPUT_ITEM_IDS, vec![2, 1], &[1, 2]),
                int_tensor(INPUT_CANDIDATES, vec![1, 2], &[7, 8]),
            ],
            true,
            &limits,
        )
        .unwrap_err();
        assert!(
            rows_mismatch
                .to_string()
                .contains("CANDIDATE_ITEM_IDS has 1 rows"),
            "{rows_mismatch}"
        );
        let excl = decode_top(
            &[
                int_tensor(INPUT_ITEM_IDS, vec![1, 1], &[1]),
                int_tensor(INPUT_EXCLUDE, vec![1, 3], &[1, 2, 3]),
            ],
            true,
            &limits,
        )
        .unwrap_err();
        assert!(excl.to_string().contains("max_exclude_ids 2"), "{excl}");
        let long_id = InputTensor {
            name: INPUT_ITEM_IDS.into(),
            dtype: DType::Bytes,
            shape: vec![1, 1],
            data: bytes_of(&["sku-12345"]),
        };
        assert!(decode_top(&[long_id], true, &limits)
            .unwrap_err()
            .to_string()
            .contains("max_id_bytes 4"));
        let huge = decode_top(
            &[int_tensor(INPUT_ITEM_IDS, vec![1, 200], &[7; 200])],
            true,
            &limits,
        )
        .unwrap_err();
        assert!(
            huge.to_string().contains("max_request_bytes 1000"),
            "{huge}"
        );
    }

    #[test]
    fn an_index_outside_the_catalogue_fails_the_response_instead_of_panicking() {
        let (engine, _dir) =
            crate::test_support::fixture_engine("multivae", recsys_engine::ModelKind::Vaecf);
        let n = engine.n_items() as u32;
        let good = vec![Scored {
            index: n,
            score: 1.0,
        }];
        let encoded = encode(&[good], &engine, IdTensorType::Int64, true).unwrap();
        assert_eq!(encoded.shape, vec![1, 1]);
        for bad in [0, n + 1, u32::MAX] {
            let rows = vec![vec![
                Scored {
                    index: 1,
                    score: 2.0,
                },
                Scored {
                    index: bad,
                    score: 1.0,
                },
            ]];
            for ids_type in [IdTensorType::Int64, IdTensorType::String] {
                let err = encode(&rows, &engine, ids_type, true).unwrap_err();
                assert!(matches!(err, BackendError::Internal(_)), "{err}");
                assert!(
                    err.to_string().contains(&format!(
                        "item index {bad}, outside the catalogue of {n} items"
                    )),
                    "{err}"
                );
            }
        }
    }

    #[test]
    fn bad_inputs_are_named() {
        let cases: Vec<(Vec<InputTensor>, &str)> = vec![
            (vec![], "no ITEM_IDS"),
            (
                vec![int_tensor(INPUT_ITEM_IDS, vec![1, 3], &[1, 2])],
                "ITEM_IDS holds 16 bytes",
            ),
            (
                vec![int_tensor(INPUT_ITEM_IDS, vec![3], &[1, 2, 3])],
                "ITEM_IDS must have shape [batch, length]",
            ),
            (
                vec![int_tensor(INPUT_ITEM_IDS, vec![1, -1], &[])],
                "negative",
            ),
            (
                vec![InputTensor {
                    name: INPUT_ITEM_IDS.into(),
                    dtype: DType::Other("FP32"),
                    shape: vec![1, 1],
                    data: vec![0; 4],
                }],
                "ITEM_IDS must be INT64 or BYTES, found FP32",
            ),
            (
                vec![InputTensor {
                    name: INPUT_ITEM_IDS.into(),
                    dtype: DType::Bytes,
                    shape: vec![1, 2],
                    data: bytes_of(&["a"]),
                }],
                "ITEM_IDS: element 1 is truncated",
            ),
            (
                vec![InputTensor {
                    name: INPUT_ITEM_IDS.into(),
                    dtype: DType::Bytes,
                    shape: vec![1, 1],
                    data: vec![200, 0, 0, 0, b'x'],
                }],
                "claims 200 bytes",
            ),
            (
                vec![InputTensor {
                    name: INPUT_ITEM_IDS.into(),
                    dtype: DType::Bytes,
                    shape: vec![1, 1],
                    data: vec![2, 0, 0, 0, 0xff, 0xfe],
                }],
                "not valid UTF-8",
            ),
            (
                vec![
                    int_tensor(INPUT_ITEM_IDS, vec![1, 1], &[1]),
                    InputTensor {
                        name: INPUT_K.into(),
                        dtype: DType::Int32,
                        shape: vec![1, 1],
                        data: 0i32.to_le_bytes().to_vec(),
                    },
                ],
                "K = 0 asks for no items: it is allowed only when USER_EMBEDDING is the only output requested",
            ),
            (
                vec![
                    int_tensor(INPUT_ITEM_IDS, vec![1, 1], &[1]),
                    int_tensor(INPUT_K, vec![1, 1], &[3]),
                ],
                "K must be INT32",
            ),
            (
                vec![
                    int_tensor(INPUT_ITEM_IDS, vec![1, 1], &[1]),
                    int_tensor("USER", vec![1, 1], &[3]),
                ],
                "unexpected input \"USER\"",
            ),
        ];
        for (inputs, needle) in cases {
            let err = decode_top(&inputs, true, &Limits::default()).unwrap_err();
            assert!(err.to_string().contains(needle), "{needle}: {err}");
            assert_eq!(err.code(), crate::error::ErrorCode::InvalidArg);
        }
    }
}
