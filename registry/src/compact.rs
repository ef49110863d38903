//! `catalogue compact`: the live catalogue folded into the model's next engine version.
//!
//! The served engine and the repository's catalogue object for it are read; the delta is folded
//! into a new engine directory ([`recsys_engine::compact`]); that engine is verified to answer
//! probe histories exactly as the served engine with the delta (the same items, the same score
//! bits) before anything is written; then it is published as the next version, pending, for the
//! release path to canary and approve as any other. The catalogue object is left as it is: the
//! servers of the old version go on applying it, and those of the new version take it as folded
//! ([`crate::catalogue::check`]), so both answer the same catalogue while the fleet moves. The
//! first delta published once the new version serves starts its own catalogue.

use std::path::Path;

use recsys_engine::catalogue_file::CatalogueFile;
use recsys_engine::request::InternalRequest;
use recsys_engine::Engine;

use crate::catalogue::{load_engine, object_key, served_version};
use crate::error::{RegistryError, Result};
use crate::publish::{publish, PublishRequest};
use crate::store::Repository;

/// Probe histories the compacted engine must answer as the engine with the delta.
const PROBE_HISTORIES: usize = 64;
/// Items asked of each probe history.
const PROBE_K: usize = 50;

/// What [`compact`] did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Compacted {
    pub model: String,
    /// The engine version the delta was published for.
    pub from_version: u64,
    /// The catalogue version folded.
    pub catalogue_version: u64,
    /// The new engine version (pending).
    pub version: u64,
    pub added: usize,
    pub replaced: usize,
    /// Items the new engine keeps and never returns.
    pub retired: usize,
    /// Items of the new engine.
    pub items: usize,
    /// Probe histories answered alike by the new engine and the old one with the delta.
    pub verified_histories: usize,
    /// Whether the new engine's weights differ from the old one's (a delta of retirements alone
    /// keeps them: the object for the old engine then applies to the new one as it stands).
    pub weights_changed: bool,
}

/// Folds `model`'s catalogue object into a new engine version, published pending. The delta
/// must be for `engine_version` (default: the version the model's servers load). `scratch`
/// holds the downloaded and the new engine; `progress` gets (bytes uploaded, bytes in all).
pub fn compact(
    repository: &Repository,
    model: &str,
    engine_version: Option<u64>,
    scratch: &Path,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Compacted> {
    let from_version = match engine_version {
        Some(v) => v,
        None => served_version(repository, model)?,
    };
    let engine = load_engine(repository, model, from_version, scratch)?;
    let object = repository.read(&object_key(model))?.ok_or_else(|| {
        RegistryError::Input(format!(
            "{model} has no catalogue object to compact (publish one with `recsys catalogue \
             publish`)"
        ))
    })?;
    let file = CatalogueFile::from_bytes(&object.bytes, engine.ids.id_type())
        .map_err(|e| RegistryError::Input(format!("{model}'s catalogue object: {e}")))?;
    if file.engine_sha256 != engine.weights_sha256() {
        let folded_here = engine
            .manifest
            .catalogue
            .as_ref()
            .is_some_and(|f| f.from_engine_sha256 == file.engine_sha256);
        return Err(RegistryError::Input(if folded_here {
            format!(
                "{model} version {from_version} was compacted from the engine catalogue version \
                 {} was published for: nothing to fold (publish this version's changes first)",
                file.delta.version
            )
        } else {
            format!(
                "{model}'s catalogue version {} was published for another engine than version \
                 {from_version} (weights SHA-256 {} against {}): give the version it is for with \
                 --engine-version",
                file.delta.version,
                file.engine_sha256,
                engine.weights_sha256()
            )
        }));
    }
    let delta = file.delta;
    let with_delta = engine
        .with_catalogue(&delta)
        .map_err(|e| RegistryError::Input(format!("{model} version {from_version}: {e}")))?;
    let out = scratch.join(format!("{model}-compacted"));
    let compacted = recsys_engine::compact::write_compacted(&engine, &delta, &out)?;
    let verified_histories = verify(&compacted, &with_delta).map_err(|why| {
        RegistryError::Input(format!(
            "the compacted engine does not answer as version {from_version} with catalogue \
             version {}: {why}; nothing was published",
            delta.version
        ))
    })?;
    let record = compacted
        .manifest
        .catalogue
        .clone()
        .expect("a compacted engine records its delta");
    let weights_changed = compacted.weights_sha256() != engine.weights_sha256();
    let items = compacted.n_items();
    drop((compacted, with_delta, engine));
    let info = publish(
        repository,
        &PublishRequest {
            model,
            engine_dir: &out,
            approve: false,
            metrics: Some(serde_json::json!({
                "compacted_from": {
                    "version": from_version,
                    "catalogue_version": delta.version,
                }
            })),
            eval_set: None,
        },
        progress,
    )?;
    Ok(Compacted {
        model: model.to_string(),
        from_version,
        catalogue_version: delta.version,
        version: info.version,
        added: record.added,
        replaced: record.replaced,
        retired: record.retired,
        items,
        verified_histories,
        weights_changed,
    })
}

/// Probe histories spread over the whole catalogue (new items included), each answered by both
/// engines over every item they offer: the same items with the same score bits, or why not.
fn verify(compacted: &Engine, reference: &Engine) -> std::result::Result<usize, String> {
    let n = compacted.n_items() as u64;
    if reference.n_items() as u64 != n {
        return Err(format!(
            "{} items against {}",
            compacted.n_items(),
            reference.n_items()
        ));
    }
    let reads_time = compacted.manifest.model.kind().reads_timestamps();
    let requests = |engine: &Engine| -> Vec<InternalRequest> {
        let eligible = engine.filters.view().unfiltered();
        (0..PROBE_HISTORIES as u64)
            .map(|h| {
                let len = 1 + (h % 20) as usize;
                // Strides coprime with most catalogue sizes walk it evenly; the last history
                // holds the newest items.
                let history: Vec<u32> = (0..len as u64)
                    .map(|t| {
                        let at = if h + 1 == PROBE_HISTORIES as u64 {
                            n - t.min(n - 1)
                        } else {
                            1 + (h * 7919 + t * 104_729) % n
                        };
                        at as u32
                    })
                    .collect();
                let timestamps: Vec<i64> = if reads_time {
                    (0..len as i64).map(|t| 1_600_000_000 + 3600 * t).collect()
                } else {
                    Vec::new()
                };
                InternalRequest {
                    query_timestamp: timestamps.last().map_or(0, |t| t + 3600),
                    timestamps,
                    history,
                    exclude: Vec::new(),
                    k: PROBE_K,
                    exclude_seen: false,
                    candidates: None,
                    embedding: false,
                    eligible: eligible.clone(),
                    popular: false,
                }
            })
            .collect()
    };
    let got = compacted.recommend_internal(&requests(compacted));
    let want = reference.recommend_internal(&requests(reference));
    for (h, ((got, _, _), (want, _, _))) in got.iter().zip(&want).enumerate() {
        let same = got.len() == want.len()
            && got
                .iter()
                .zip(want)
                .all(|(a, b)| a.index == b.index && a.score.to_bits() == b.score.to_bits());
        if !same {
            let show = |s: &[recsys_engine::topk::Scored]| {
                s.iter()
                    .take(3)
                    .map(|s| format!("{}:{}", s.index, s.score))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            return Err(format!(
                "probe history {h}: [{}, ...] against [{}, ...]",
                show(got),
                show(want)
            ));
        }
    }
    Ok(got.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use recsys_engine::catalogue::{CatalogueDelta, ItemOp, ItemRow};
    use recsys_engine::engine_dir::Precision;
    use recsys_engine::{fixtures, ModelKind};

    /// The probe catches an engine that differs from the reference in one item's rows, naming
    /// the history; the engine against itself passes every probe.
    #[test]
    fn the_probe_finds_one_changed_item() {
        let tmp = tempfile::tempdir().unwrap();
        let engine = fixtures::convert(
            ModelKind::Gru4rec,
            "model.safetensors",
            &tmp.path().join("gru4rec"),
            Precision::Fp32,
        )
        .unwrap();
        assert_eq!(verify(&engine, &engine), Ok(PROBE_HISTORIES));
        // The item the first probe history ranks first, given its own row scaled by 1.001.
        let first = {
            let requests = vec![InternalRequest {
                history: vec![1],
                exclude: Vec::new(),
                k: 1,
                exclude_seen: false,
                candidates: None,
                embedding: false,
                eligible: None,
                popular: false,
                timestamps: Vec::new(),
                query_timestamp: 0,
            }];
            engine.recommend_internal(&requests)[0].0[0].index
        };
        let output = engine.model.output();
        let d = output.input_size();
        let mut vector = vec![0f32; d + 1];
        output.weight.add_row_into(first as usize, &mut vector[..d]);
        vector.iter_mut().for_each(|v| *v *= 1.001);
        let changed = engine
            .with_catalogue(&CatalogueDelta {
                version: 1,
                rows: vec![ItemRow {
                    id: engine.external_id(first).unwrap(),
                    op: ItemOp::Upsert,
                    vector: Some(vector),
                    input_vector: None,
                }],
            })
            .unwrap();
        let why = verify(&changed, &engine).unwrap_err();
        assert!(why.starts_with("probe history 0:"), "{why}");
    }
}
