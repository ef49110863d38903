//! The serving API: external ids in, top-k external ids and scores out.

use std::path::{Path, PathBuf};

use crate::config::{ModelConfig, ModelKind};
use crate::engine_dir::{self, EngineParts, Manifest, SourceCheckpoint};
use crate::error::{EngineError, Result};
use crate::idmap::{ExternalId, ExternalIds, IdMap};
use crate::import::Checkpoint;
use crate::models::{HistoryNote, Model};
use crate::topk::{self, ExclusionSet, Scored};

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

/// Serving options that hold for every request of a model.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub default_k: usize,
    /// Leave the history's own items out of the answer.
    pub exclude_seen: bool,
    pub unknown_items: UnknownItemPolicy,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            default_k: 10,
            exclude_seen: true,
            unknown_items: UnknownItemPolicy::Drop,
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
}

/// A request already mapped to internal indices.
#[derive(Clone, Debug, Default)]
pub struct InternalRequest {
    pub history: Vec<u32>,
    pub exclude: Vec<u32>,
    pub k: usize,
    pub exclude_seen: bool,
}

/// A loaded model with its id map.
pub struct Engine {
    pub manifest: Manifest,
    pub model: Model,
    pub ids: IdMap,
    pub path: Option<PathBuf>,
}

impl Engine {
    /// Loads and verifies an engine directory.
    pub fn load(dir: &Path) -> Result<Engine> {
        let loaded = engine_dir::load(dir)?;
        Ok(Engine {
            manifest: loaded.manifest,
            model: loaded.model,
            ids: loaded.ids,
            path: Some(loaded.path),
        })
    }

    pub fn kind(&self) -> ModelKind {
        self.manifest.model.kind()
    }

    pub fn n_items(&self) -> usize {
        self.ids.len()
    }

    /// Maps and validates one request. Errors name the offending input.
    pub fn prepare(
        &self,
        request: &Request<'_>,
        options: &ServeOptions,
    ) -> Result<(InternalRequest, usize)> {
        let k = match request.k {
            None => options.default_k,
            Some(k) if k >= 1 => usize::try_from(k).unwrap_or(usize::MAX),
            Some(k) => {
                return Err(EngineError::InvalidRequest(format!(
                    "K must be at least 1, found {k}"
                )))
            }
        };
        let history = self.ids.map(request.history);
        if history.unknown > 0 && options.unknown_items == UnknownItemPolicy::Error {
            return Err(EngineError::InvalidRequest(format!(
                "ITEM_IDS holds {} id(s) unknown to the model (unknown_item_policy is \"error\")",
                history.unknown
            )));
        }
        let exclude = request
            .exclude
            .map(|e| self.ids.map(e).indices)
            .unwrap_or_default();
        Ok((
            InternalRequest {
                history: history.indices,
                exclude,
                k: k.min(self.n_items()),
                exclude_seen: options.exclude_seen,
            },
            history.unknown,
        ))
    }

    /// Answers a batch. Each request gets its own result; a bad request does not affect the others,
    /// and the good ones run as one batch.
    pub fn recommend(
        &self,
        requests: &[Request<'_>],
        options: &ServeOptions,
    ) -> Vec<Result<Recommendation>> {
        let mut results: Vec<Option<Result<Recommendation>>> = Vec::with_capacity(requests.len());
        let mut batch = Vec::new();
        let mut unknown = Vec::new();
        let mut slots = Vec::new();
        for (i, request) in requests.iter().enumerate() {
            match self.prepare(request, options) {
                Ok((prepared, n_unknown)) => {
                    batch.push(prepared);
                    unknown.push(n_unknown);
                    slots.push(i);
                    results.push(None);
                }
                Err(e) => results.push(Some(Err(e))),
            }
        }
        let answers = self.recommend_internal(&batch);
        for (((slot, (items, note)), n_unknown), _) in
            slots.into_iter().zip(answers).zip(unknown).zip(&batch)
        {
            results[slot] = Some(Ok(Recommendation {
                items,
                unknown_ids: n_unknown,
                truncated: note.truncated,
            }));
        }
        results
            .into_iter()
            .map(|r| r.expect("every slot is filled"))
            .collect()
    }

    /// Top-k over internal indices for a batch of prepared requests.
    pub fn recommend_internal(&self, batch: &[InternalRequest]) -> Vec<(Vec<Scored>, HistoryNote)> {
        if batch.is_empty() {
            return Vec::new();
        }
        let histories: Vec<&[u32]> = batch.iter().map(|r| r.history.as_slice()).collect();
        let (hidden, notes) = self.model.encode(&histories);
        let scores = self.model.output().score_all(&hidden);
        let n_out = self.model.output().n_outputs();
        let mut excluded = ExclusionSet::new(n_out);
        batch
            .iter()
            .zip(notes)
            .enumerate()
            .map(|(row, (request, note))| {
                excluded.clear();
                excluded.insert(0); // PAD is never an item
                if request.exclude_seen {
                    request.history.iter().for_each(|&i| excluded.insert(i));
                }
                request.exclude.iter().for_each(|&i| excluded.insert(i));
                let row_scores = &scores[row * n_out..(row + 1) * n_out];
                (topk::top_k(row_scores, request.k, &excluded), note)
            })
            .collect()
    }

    /// External id of an internal index.
    pub fn external_id(&self, index: u32) -> ExternalId {
        self.ids.external(index)
    }
}

/// Inputs of a conversion.
pub struct ConvertRequest<'a> {
    pub kind: ModelKind,
    pub checkpoint: &'a Path,
    /// A JSON object of hyper-parameters; `None` to use the checkpoint's own (RecBole) config.
    pub config: Option<&'a serde_json::Map<String, serde_json::Value>>,
    pub item_map: &'a Path,
    pub out: &'a Path,
}

/// Reads a checkpoint and writes a verified engine directory; returns the loaded engine.
pub fn convert(request: &ConvertRequest<'_>) -> Result<Engine> {
    let ckpt = Checkpoint::load(request.checkpoint)?;
    let json = match (request.config, &ckpt.embedded_config) {
        (Some(json), _) => json.clone(),
        (None, Some(embedded)) => embedded.clone(),
        (None, None) => {
            return Err(EngineError::Config(format!(
                "{} carries no model config; pass one with --config",
                request.checkpoint.display()
            )))
        }
    };
    let config = ModelConfig::resolve(request.kind, &json, &ckpt)?;
    let tensors = Model::engine_tensors(&config, &ckpt)?;
    let ids = IdMap::read_tsv(request.item_map)?;
    let source = SourceCheckpoint {
        file: request
            .checkpoint
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        format: ckpt.format,
        sha256: ckpt.sha256.clone(),
    };
    engine_dir::write(
        request.out,
        &EngineParts {
            config: &config,
            tensors: &tensors,
            ids: &ids,
            source,
        },
    )?;
    Engine::load(request.out)
}
