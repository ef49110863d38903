//! What a request is, before and after id mapping, and what answers a batch of them.

use crate::error::Result;
use std::sync::Arc;

use crate::idmap::ExternalIds;
use crate::item_sets::ItemFilter;
use crate::kernels::item_mask::ItemMask;
use crate::models::HistoryNote;
use crate::topk::Scored;

/// What to do with history ids the catalogue does not know.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UnknownItemPolicy {
    /// Drop them and count them (the default: catalogues churn faster than models retrain).
    #[default]
    Drop,
    /// Refuse the request.
    Error,
}

impl std::str::FromStr for UnknownItemPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "drop" | "skip" | "ignore" => Ok(UnknownItemPolicy::Drop),
            "error" => Ok(UnknownItemPolicy::Error),
            _ => Err(format!(
                "unknown_item_policy must be \"drop\" or \"error\", found {s:?}"
            )),
        }
    }
}

/// Who answers a history that is empty or holds no item the catalogue knows (a new visitor).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EmptyHistoryPolicy {
    /// `popular` when the engine holds a popularity list, else `model`.
    #[default]
    Auto,
    /// The most popular items (the engine's popularity list), filtered like any answer.
    Popular,
    /// The model's own answer for an empty input (BERT4Rec, Mult-VAE); refused for models that
    /// answer from the last item (SASRec, GRU4Rec).
    Model,
    /// Refuse the request.
    Error,
}

impl std::str::FromStr for EmptyHistoryPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(EmptyHistoryPolicy::Auto),
            "popular" => Ok(EmptyHistoryPolicy::Popular),
            "model" => Ok(EmptyHistoryPolicy::Model),
            "error" => Ok(EmptyHistoryPolicy::Error),
            _ => Err(format!(
                "empty_history_policy must be \"popular\", \"model\", \"error\" or \"auto\", found {s:?}"
            )),
        }
    }
}

/// Serving options that hold for every request of a model.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub default_k: usize,
    /// Leave the history's own items out of the answer.
    pub exclude_seen: bool,
    pub unknown_items: UnknownItemPolicy,
    /// Who answers an empty history (or one without a known item).
    pub empty_history: EmptyHistoryPolicy,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            default_k: 10,
            exclude_seen: true,
            unknown_items: UnknownItemPolicy::Drop,
            empty_history: EmptyHistoryPolicy::Auto,
        }
    }
}

/// One user's request.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    /// The user's history, oldest first.
    pub history: ExternalIds<'a>,
    /// Overrides [`ServeOptions::default_k`].
    pub k: Option<i64>,
    /// Extra items never to recommend (out of stock, already bought elsewhere).
    pub exclude: Option<ExternalIds<'a>>,
    /// Rank only these items (a retrieval stage's candidates) instead of the whole catalogue.
    pub candidates: Option<ExternalIds<'a>>,
    /// Also return the user embedding ([`Recommendation::embedding`]). With it, `k = Some(0)`
    /// asks for the embedding alone (no item is scored).
    pub embedding: bool,
    /// Item sets to keep and to drop (`category=shoes`; see [`crate::item_sets`]); `None` or an
    /// empty filter keeps every item.
    pub filter: Option<&'a ItemFilter>,
    /// When the history's events happened: required by the models that read time (HSTU),
    /// ignored by the others.
    pub times: Option<RequestTimes<'a>>,
}

/// A request's timestamps (unix seconds): one per history id, in the history's order (an unknown
/// id's timestamp leaves with it), and the time of the event to predict (`None`: now, by the
/// clock of the machine answering).
#[derive(Clone, Copy, Debug, Default)]
pub struct RequestTimes<'a> {
    pub events: &'a [i64],
    pub query: Option<i64>,
}

impl<'a> RequestTimes<'a> {
    /// A request's times as a front end decoded them: none without `events`.
    pub fn given(events: Option<&'a [i64]>, query: Option<i64>) -> Option<RequestTimes<'a>> {
        events.map(|events| RequestTimes { events, query })
    }
}

/// One user's answer.
#[derive(Clone, Debug, PartialEq)]
pub struct Recommendation {
    /// Best first, internal indices with scores.
    pub items: Vec<Scored>,
    /// History ids that were not in the catalogue.
    pub unknown_ids: usize,
    /// The history was longer than the model's window (BERT4Rec keeps the most recent items).
    pub truncated: bool,
    /// Candidate ids that were not in the catalogue (dropped, or the request refused, as for the
    /// history under [`UnknownItemPolicy`]).
    pub unknown_candidates: usize,
    /// The user embedding when the request asked for it (else empty): the model's final hidden
    /// vector followed by a 1, whose inner product with an item's `[embedding, bias]` row
    /// (`recsys export-items`) is the model's score for that item.
    pub embedding: Vec<f32>,
    /// The popularity list answered (an empty history under `empty_history_policy: popular`);
    /// the scores are then each item's share of the interactions counted.
    pub popular: bool,
}

/// The ids of a request that the catalogue does not know ([`crate::Engine::prepare`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnknownIds {
    pub history: usize,
    pub candidates: usize,
}

/// A request already mapped to internal indices.
#[derive(Clone, Debug, Default)]
pub struct InternalRequest {
    pub history: Vec<u32>,
    pub exclude: Vec<u32>,
    pub k: usize,
    pub exclude_seen: bool,
    /// Rank only these items: internal indices, ascending and distinct (so ties still go to the
    /// lower index). `None` ranks the whole catalogue.
    pub candidates: Option<Vec<u32>>,
    /// The answer carries the user embedding; `k` may then be 0 (the embedding alone).
    pub embedding: bool,
    /// Whole-catalogue rows: only these items may be recommended (the request's filter; a
    /// candidate list is narrowed by it instead). `None`: every item.
    pub eligible: Option<Arc<ItemMask>>,
    /// Answered from the popularity list, not the model (an empty history under
    /// `empty_history_policy: popular`); only the CPU engine answers such rows.
    pub popular: bool,
    /// For the models that read time (HSTU): a unix timestamp per `history` item, and the time of
    /// the event to predict. Empty and 0 for the others.
    pub timestamps: Vec<i64>,
    pub query_timestamp: i64,
}

impl InternalRequest {
    /// The request's event times as a model reads them.
    pub fn event_times(&self) -> crate::models::EventTimes<'_> {
        crate::models::EventTimes {
            events: &self.timestamps,
            query: self.query_timestamp,
        }
    }
}

/// One prepared row's answer: its best items (best first), what the model noted about its
/// history, and its user embedding when the row asked for it (else empty; see
/// [`Recommendation::embedding`]).
pub type RowAnswer = (Vec<Scored>, HistoryNote, Vec<f32>);

/// What answers a batch of prepared requests: the engine itself (the whole model on the CPU) or a
/// device that runs the whole model (the CUDA path). The serving layer picks one per model
/// instance.
pub trait BatchRecommender: Send + Sync {
    /// Each request's answer, in order.
    fn recommend_batch(&self, batch: &[InternalRequest]) -> Result<Vec<RowAnswer>>;
}

/// The items each request leaves out: its history when `exclude_seen`, then its own list
/// (unsorted, may repeat; PAD is left out by every scorer).
pub fn excluded_items(request: &InternalRequest) -> Vec<u32> {
    let seen = if request.exclude_seen {
        request.history.as_slice()
    } else {
        &[]
    };
    let mut list = Vec::with_capacity(1 + seen.len() + request.exclude.len());
    list.extend_from_slice(seen);
    list.extend_from_slice(&request.exclude);
    list
}
