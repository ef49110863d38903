//! Folding a live catalogue into a new engine directory (`recsys catalogue compact`).
//!
//! A delta costs every replica a table rebuild each time it changes and travels whole with each
//! publish ([`crate::catalogue`]), so a long-lived delta is folded into the engine: the directory
//! written here holds the tensors [`crate::catalogue::apply`] builds (rows stored by conversion's
//! rules, new items appended in the delta's order, so indices and exact-tie order are those of the
//! engine with the delta), the output layer packed for the kernels, the item sets and popularity
//! counts grown over the new items (which are in no set and have no interactions), and the items
//! it keeps retired (`retired_items.tsv`: the delta's retirements and those the engine already
//! kept). Its manifest records the delta it folded ([`FoldedCatalogue`]), so a server of the new
//! engine that still reads that object knows its rows are already in.

use std::path::Path;

use crate::catalogue::CatalogueDelta;
use crate::engine_dir::{self, EngineParts, FoldedCatalogue, KernelParts, Screen, WEIGHTS_FILE};
use crate::error::{EngineError, Result};
use crate::item_sets::AttributeReport;
use crate::models::Model;
use crate::popularity::PopularityReport;
use crate::Engine;

/// Writes `engine` with `delta` folded in as a new engine directory at `out` (atomically, as
/// conversion writes one) and loads it. The delta replaces any delta `engine` has in force: it is
/// applied to the engine as converted, as [`Engine::with_catalogue`] applies it.
pub fn write_compacted(engine: &Engine, delta: &CatalogueDelta, out: &Path) -> Result<Engine> {
    let applied = engine.applied(delta)?;
    let retired = engine.retired_with(&applied.retired, &applied.upserted);
    let model = Model::from_tensors(&applied.config, &applied.weights)?;
    let output = model.output();
    let packed = output.weight.pack(output.bias.as_slice());
    let screen = (engine.manifest.screen == Screen::Int8).then(|| crate::engine::screen_of(output));
    let indices = applied.ids.len() + 1;
    let manifest = &engine.manifest;
    let item_sets = manifest.item_attributes.as_ref().map(|record| {
        (
            engine.filters.sets().grown(indices),
            AttributeReport {
                items: record.items,
                unknown_items: record.unknown_items,
                sets: record.sets,
            },
        )
    });
    let popularity = match (&engine.popularity, &manifest.popularity) {
        (Some(counts), Some(record)) => Some((
            counts.grown(indices),
            PopularityReport {
                column: record.column.clone(),
                interactions: record.interactions,
                unknown_items: record.unknown_items,
                items: record.items,
            },
        )),
        _ => None,
    };
    let weights_sha256 = manifest
        .files
        .get(WEIGHTS_FILE)
        .map(|f| f.sha256.clone())
        .ok_or_else(|| EngineError::Config("the engine's manifest lists no weights".into()))?;
    let folded = FoldedCatalogue {
        from_engine_sha256: weights_sha256,
        version: delta.version,
        base_items: applied.summary.base_items,
        added: applied.summary.added,
        replaced: applied.summary.replaced,
        retired: retired.len(),
    };
    // Sorted by name: the same delta folded twice writes the same weights file.
    let mut tensors: Vec<_> = applied.weights.f32.into_iter().collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let mut raw_tensors: Vec<_> = applied.weights.raw.into_iter().collect();
    raw_tensors.sort_by(|a, b| a.0.cmp(&b.0));
    engine_dir::write(
        out,
        &EngineParts {
            config: &applied.config,
            tensors: &tensors,
            raw_tensors: &raw_tensors,
            precision: manifest.precision,
            quantization: manifest.quantization.clone(),
            calibration: manifest.calibration.clone(),
            screen: manifest.screen,
            ids: &applied.ids,
            source: manifest.source.clone(),
            kernels: Some(KernelParts {
                packed: &packed,
                screen: screen.as_ref(),
            }),
            item_sets: item_sets.as_ref(),
            popularity: popularity.as_ref(),
            folded: Some((folded, &retired)),
        },
    )?;
    drop((model, packed, screen));
    Engine::load(out)
}
