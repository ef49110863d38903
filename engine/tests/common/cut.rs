//! Fixture checkpoints with items cut out: what an engine converted before those items existed
//! looks like (the live-catalogue tests give them back as a delta), and the conversion of one.

use std::path::{Path, PathBuf};

use super::{config_json, fixtures, model_dir, Precision};
use recsys_engine::catalogue::{CatalogueDelta, ItemOp, ItemRow};
use recsys_engine::engine_dir::Screen;
use recsys_engine::idmap::{ExternalId, ExternalIds};
use recsys_engine::models::ModelView;
use recsys_engine::request::{Request, ServeOptions};
use recsys_engine::{Engine, ModelKind};

/// The fixture checkpoint of `kind` with the items at `cut` (internal indices) removed: every
/// tensor dimension over the items (N+1 rows, or N+2 with BERT4Rec's mask token) loses those
/// entries, the item map loses their lines and the config its count of them. Returns the
/// checkpoint, config and item map written under `dir`.
pub fn cut_checkpoint(
    kind: ModelKind,
    cut: &[usize],
    dir: &Path,
) -> (PathBuf, serde_json::Map<String, serde_json::Value>, PathBuf) {
    std::fs::create_dir_all(dir).unwrap();
    let n = 2000usize;
    let bytes = std::fs::read(model_dir(kind).join("model.safetensors")).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in tensors.tensors() {
        let shape = view.shape().to_vec();
        if view.dtype() != safetensors::Dtype::F32 {
            // Not over the items (HSTU's boolean causal mask): kept as it is.
            assert!(!shape.contains(&(n + 1)), "{name}");
            out.push((name.to_string(), view.dtype(), shape, view.data().to_vec()));
            continue;
        }
        let values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let (mut shape, mut values) = (shape, values);
        for axis in 0..shape.len() {
            if shape[axis] != n + 1 && shape[axis] != n + 2 {
                continue;
            }
            let outer: usize = shape[..axis].iter().product();
            let inner: usize = shape[axis + 1..].iter().product();
            let mut kept = Vec::with_capacity(values.len());
            for o in 0..outer {
                for i in 0..shape[axis] {
                    if cut.binary_search(&i).is_ok() {
                        continue;
                    }
                    let at = (o * shape[axis] + i) * inner;
                    kept.extend_from_slice(&values[at..at + inner]);
                }
            }
            shape[axis] -= cut.len();
            values = kept;
        }
        out.push((
            name.to_string(),
            safetensors::Dtype::F32,
            shape,
            bytemuck::cast_slice(&values).to_vec(),
        ));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = out
        .iter()
        .map(|(name, dtype, shape, data)| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    let checkpoint = dir.join("model.safetensors");
    std::fs::write(&checkpoint, safetensors::serialize(views, &None).unwrap()).unwrap();

    let map = std::fs::read_to_string(model_dir(kind).join("item_id_map.tsv")).unwrap();
    let mut lines = vec!["internal_index\texternal_item_id".to_string()];
    for line in map.lines() {
        let Some((index, id)) = line.split_once('\t') else {
            continue;
        };
        let Ok(index) = index.parse::<usize>() else {
            continue;
        };
        if cut.binary_search(&index).is_err() {
            lines.push(format!("{}\t{id}", lines.len()));
        }
    }
    let item_map = dir.join("item_id_map.tsv");
    std::fs::write(&item_map, lines.join("\n") + "\n").unwrap();

    let mut config = config_json(kind);
    let kept = (n - cut.len()) as u64;
    for (key, value) in [
        ("n_real_items", kept),
        ("recbole_n_items", kept + 1),
        ("input_dim", kept + 1),
        ("mask_index", kept + 1),
        ("item_embedding_rows", kept + 2),
        ("num_items", kept),
    ] {
        if config.contains_key(key) {
            config.insert(key.to_string(), value.into());
        }
    }
    (checkpoint, config, item_map)
}

/// An engine converted from `checkpoint` (a cut one, or the fixture's own) at `precision`.
pub fn convert_from(
    kind: ModelKind,
    checkpoint: &Path,
    config: &serde_json::Map<String, serde_json::Value>,
    item_map: &Path,
    out: &Path,
    precision: Precision,
    screen: Screen,
) -> Engine {
    recsys_engine::convert(&recsys_engine::ConvertRequest {
        screen,
        ..super::request(kind, checkpoint, config, item_map, out, precision)
    })
    .unwrap_or_else(|e| panic!("converting {}: {e}", checkpoint.display()))
}

/// The item's rows in `engine` as `recsys export-items --with-input-rows` writes them:
/// `[embedding, bias]`, and the input row where the model has one of its own.
pub fn rows_of(engine: &Engine, index: u32) -> (Vec<f32>, Option<Vec<f32>>) {
    let output = engine.model.output();
    let d = output.input_size();
    let mut vector = vec![0f32; d + 1];
    output.weight.add_row_into(index as usize, &mut vector[..d]);
    vector[d] = output.bias.as_slice()[index as usize];
    let input = match engine.model.view() {
        ModelView::Vaecf(view) => {
            let mut row = vec![0f32; view.first_by_item.cols()];
            view.first_by_item.add_row_into(index as usize, &mut row);
            Some(row)
        }
        _ => None,
    };
    (vector, input)
}

/// A delta of `op` rows for `ids`, with their rows in `source` (none for a bare retirement).
pub fn delta_from(
    source: &Engine,
    ids: &[ExternalId],
    op: ItemOp,
    with_rows: bool,
) -> CatalogueDelta {
    CatalogueDelta {
        version: 1,
        rows: ids
            .iter()
            .map(|id| {
                let index = match id {
                    ExternalId::Int(i) => source.ids.index_of_int(*i),
                    ExternalId::Str(s) => source.ids.index_of_str(s),
                }
                .unwrap();
                let (vector, input) = rows_of(source, index);
                ItemRow {
                    id: id.clone(),
                    op,
                    vector: with_rows.then_some(vector),
                    input_vector: if with_rows { input } else { None },
                }
            })
            .collect(),
    }
}

/// Every test-set history's top `k` from `engine`: external ids with scores, best first.
pub fn answers(engine: &Engine, k: i64) -> Vec<Vec<(ExternalId, f32)>> {
    let cases = recsys_engine::metrics::read_test_set(&fixtures().join("test_set.tsv")).unwrap();
    let histories: Vec<Vec<&str>> = cases
        .iter()
        .take(200)
        .map(|c| c.history.iter().map(String::as_str).collect())
        .collect();
    let requests: Vec<Request<'_>> = histories
        .iter()
        .map(|h| Request {
            history: ExternalIds::Str(h),
            k: Some(k),
            exclude: None,
            candidates: None,
            embedding: false,
            filter: None,
            times: None,
        })
        .collect();
    engine
        .recommend(&requests, &ServeOptions::default())
        .into_iter()
        .map(|answer| {
            answer
                .unwrap()
                .items
                .iter()
                .map(|s| (engine.external_id(s.index).unwrap(), s.score))
                .collect()
        })
        .collect()
}

/// The fixture's whole checkpoint of `kind` converted at fp32 into `out`: the engine whose rows a
/// delta gives back.
pub fn whole_engine(kind: ModelKind, out: &Path) -> Engine {
    convert_from(
        kind,
        &model_dir(kind).join("model.safetensors"),
        &config_json(kind),
        &model_dir(kind).join("item_id_map.tsv"),
        out,
        Precision::Fp32,
        Screen::None,
    )
}

/// The external ids of `engine`'s items at `indices`.
pub fn ids_at(engine: &Engine, indices: &[usize]) -> Vec<ExternalId> {
    indices
        .iter()
        .map(|&i| engine.external_id(i as u32).unwrap())
        .collect()
}

/// The `count` items `engine` recommends most often in the first five places of the test-set
/// answers: retiring them changes many answers.
pub fn popular_items(engine: &Engine, count: usize) -> Vec<ExternalId> {
    let mut counts: std::collections::BTreeMap<String, usize> = Default::default();
    for answer in answers(engine, 40) {
        for (id, _) in answer.iter().take(5) {
            *counts.entry(id.to_string()).or_default() += 1;
        }
    }
    let mut ranked: Vec<(usize, String)> = counts.into_iter().map(|(id, c)| (c, id)).collect();
    ranked.sort_unstable_by(|a, b| b.cmp(a));
    ranked
        .iter()
        .take(count)
        .map(|(_, id)| ExternalId::Int(id.parse().unwrap()))
        .collect()
}
