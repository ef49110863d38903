//! HSTU's hyper-parameters and tensors from a checkpoint of the official research code: its state
//! dict names (`_hstu._attention_layers.{b}._uvqk`, ...), checked against the gin bindings or
//! config JSON it was trained with, and re-laid-out under the engine's names.

use serde_json::{Map, Value};

use super::config::HstuConfig;
use crate::config_fields::{agree, usize_field};
use crate::error::{EngineError, Result};
use crate::import::Checkpoint;
use crate::tensor::Tensor;

/// The official state dict's names.
pub(crate) const ITEM_EMBEDDING: &str = "_embedding_module._item_emb.weight";
pub(crate) const POSITION_EMBEDDING: &str = "_input_features_preproc._pos_emb.weight";

fn layer(b: usize, what: &str) -> String {
    format!("_hstu._attention_layers.{b}.{what}")
}

/// The engine's names for HSTU's tensors.
pub mod names {
    /// The items' rows as the official embedding holds them: what a history reads.
    pub const INPUT_ROWS: &str = "item_embedding.weight";
    /// The same rows divided by their L2 norms (the output layer: cosine scoring).
    pub const OUTPUT_ROWS: &str = "item_embedding.normalized";
    pub const POSITIONS: &str = "position_embedding.weight";

    /// A block's uvqk projection as a dense layer (`[out, in]`, a zero bias).
    pub fn uvqk(b: usize) -> String {
        format!("blocks.{b}.uvqk")
    }
    /// A block's output projection (`_o`).
    pub fn output(b: usize) -> String {
        format!("blocks.{b}.output")
    }
    pub fn position_bias(b: usize) -> String {
        format!("blocks.{b}.position_bias")
    }
    pub fn time_bias(b: usize) -> String {
        format!("blocks.{b}.time_bias")
    }
}

/// A string value of the config, when present.
fn text<'a>(json: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>> {
    match json.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.as_str())),
        Some(v) => Err(EngineError::Config(format!(
            "'{key}' must be a string, found {v}"
        ))),
    }
}

fn flag(json: &Map<String, Value>, key: &str) -> Result<Option<bool>> {
    match json.get(key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(EngineError::Config(format!(
            "'{key}' must be true or false, found {v}"
        ))),
    }
}

/// Refuses a setting recsys does not run, naming it, what it is, and what is run.
fn require(key: &str, found: Option<&str>, runs: &str, default: &str) -> Result<()> {
    let value = found.unwrap_or(default);
    if value != runs {
        return Err(EngineError::Config(format!(
            "{key} = {value:?}{}: recsys runs HSTU with {key} = {runs:?}",
            if found.is_none() {
                " (the official default)"
            } else {
                ""
            }
        )));
    }
    Ok(())
}

/// The config's own keys: a flat object of the official names, or the fixtures' layout, which
/// nests them under `hyperparameters`.
fn flattened(json: &Map<String, Value>) -> Map<String, Value> {
    let mut flat = json.clone();
    if let Some(Value::Object(inner)) = json.get("hyperparameters") {
        for (k, v) in inner {
            flat.entry(k.clone()).or_insert_with(|| v.clone());
        }
    }
    flat
}

/// HSTU's config from the gin bindings or JSON (`max_sequence_length`, `num_blocks`,
/// `num_heads`, `dqk`, `dv`, `item_embedding_dim`, `gr_output_length`, ...), completed from and
/// checked against the checkpoint's shapes.
pub(crate) fn resolve_config(json: &Map<String, Value>, ckpt: &Checkpoint) -> Result<HstuConfig> {
    let json = &flattened(json);
    if let Some(module) = text(json, "main_module")? {
        if module != "HSTU" {
            return Err(EngineError::Config(format!(
                "main_module = {module:?}: the config is not an HSTU's (pass the config the \
                 checkpoint was trained with)"
            )));
        }
    }
    require(
        "normalization",
        text(json, "normalization")?,
        "rel_bias",
        "rel_bias",
    )?;
    require(
        "linear_config",
        text(json, "linear_config")?,
        "uvqk",
        "uvqk",
    )?;
    require(
        "linear_activation",
        text(json, "linear_activation")?,
        "silu",
        "silu",
    )?;
    require(
        "user_embedding_norm",
        text(json, "user_embedding_norm")?,
        "l2_norm",
        "l2_norm",
    )?;
    if let Some(interaction) = text(json, "interaction_module_type")? {
        if interaction != "DotProduct" {
            return Err(EngineError::Config(format!(
                "interaction_module_type = {interaction:?}: recsys scores HSTU by the dot product \
                 (DotProduct)"
            )));
        }
    }
    if flag(json, "concat_ua")? == Some(true) {
        return Err(EngineError::Config(
            "concat_ua = true: recsys runs HSTU with concat_ua = false".into(),
        ));
    }
    if flag(json, "enable_relative_attention_bias")? == Some(false) {
        return Err(EngineError::Config(
            "enable_relative_attention_bias = false: recsys runs HSTU with its relative position \
             and time bias"
                .into(),
        ));
    }
    if flag(json, "item_l2_norm")? != Some(true) {
        return Err(EngineError::Config(format!(
            "item_l2_norm is {}: recsys scores HSTU by the cosine of the user and item embeddings \
             (item_l2_norm = true, as the official HSTU configs train it); set it in the config \
             if the model was trained so",
            json.get("item_l2_norm")
                .map_or("not set (the official default is false)".to_string(), |v| v
                    .to_string())
        )));
    }

    let emb = ckpt.require_shape(ITEM_EMBEDDING)?;
    if emb.len() != 2 || emb[0] < 2 {
        return Err(EngineError::Config(format!(
            "{ITEM_EMBEDDING} must be [N+1 rows: PAD, then the items; width] with N >= 1, found \
             {emb:?}"
        )));
    }
    let n_items = agree(
        "n_items",
        usize_field(json, &["num_items", "n_items"])?,
        emb[0] - 1,
        &format!("{ITEM_EMBEDDING} (N+1 rows: PAD, then the items)"),
    )?;
    let embedding_dim = agree(
        "item_embedding_dim",
        usize_field(json, &["item_embedding_dim", "embedding_dim"])?,
        emb[1],
        ITEM_EMBEDDING,
    )?;
    let blocks_in_weights = (0..)
        .take_while(|b| ckpt.shape(&layer(*b, "_uvqk")).is_some())
        .count();
    if blocks_in_weights == 0 {
        return Err(EngineError::MissingTensor {
            name: layer(0, "_uvqk"),
        });
    }
    let num_blocks = agree(
        "num_blocks",
        usize_field(json, &["num_blocks"])?,
        blocks_in_weights,
        "the _hstu._attention_layers.* tensors",
    )?;
    let num_heads = usize_field(json, &["num_heads"])?.ok_or_else(|| {
        EngineError::Config(
            "'num_heads' is required: the weights give the heads' total width, not their number"
                .into(),
        )
    })?;
    if num_heads == 0 {
        return Err(EngineError::Config("num_heads must be at least 1".into()));
    }
    let uvqk = ckpt.require_shape(&layer(0, "_uvqk"))?;
    let o = ckpt.require_shape(&layer(0, "_o.weight"))?;
    if uvqk.len() != 2 || uvqk[0] != embedding_dim || o.len() != 2 || o[0] != embedding_dim {
        return Err(EngineError::Config(format!(
            "{} must be [item_embedding_dim = {embedding_dim}, 2 x heads x (dv + dqk)] and {} \
             [{embedding_dim}, heads x dv], found {uvqk:?} and {o:?}",
            layer(0, "_uvqk"),
            layer(0, "_o.weight")
        )));
    }
    let values_width = o[1];
    let per_head = |what: &str, total: usize| -> Result<usize> {
        if !total.is_multiple_of(num_heads) {
            return Err(EngineError::Config(format!(
                "num_heads = {num_heads} does not divide the {what} width {total} the weights give"
            )));
        }
        Ok(total / num_heads)
    };
    let dv = agree(
        "dv",
        usize_field(json, &["dv", "linear_dim"])?,
        per_head("value", values_width)?,
        &format!("{} (heads x dv columns)", layer(0, "_o.weight")),
    )?;
    let keys_width = (uvqk[1] / 2)
        .checked_sub(values_width)
        .filter(|_| uvqk[1] % 2 == 0);
    let keys_width = keys_width.ok_or_else(|| {
        EngineError::Config(format!(
            "{} has {} columns, which is not 2 x (heads x dv + heads x dqk) with heads x dv = \
             {values_width}",
            layer(0, "_uvqk"),
            uvqk[1]
        ))
    })?;
    let dqk = agree(
        "dqk",
        usize_field(json, &["dqk", "attention_dim"])?,
        per_head("query and key", keys_width)?,
        &format!("{} (u, v, q, k)", layer(0, "_uvqk")),
    )?;
    if dqk == 0 || dv == 0 {
        return Err(EngineError::Config(format!(
            "dqk = {dqk} and dv = {dv} must both be at least 1"
        )));
    }
    let positions = ckpt.require_shape(POSITION_EMBEDDING)?;
    if positions.len() != 2 || positions[1] != embedding_dim {
        return Err(EngineError::Config(format!(
            "{POSITION_EMBEDDING} must be [positions, {embedding_dim}], found {positions:?}"
        )));
    }
    let attention_width = positions[0];
    let output_length = usize_field(json, &["gr_output_length"])?.unwrap_or(10);
    let max_len = match usize_field(json, &["max_sequence_length", "max_len"])? {
        Some(len) => {
            if len + output_length + 1 != attention_width {
                return Err(EngineError::Config(format!(
                    "config says max_sequence_length = {len} and gr_output_length = \
                     {output_length}, so the model's width is {} rows, but {POSITION_EMBEDDING} \
                     has {attention_width}",
                    len + output_length + 1
                )));
            }
            len
        }
        None => attention_width
            .checked_sub(output_length + 1)
            .filter(|len| *len >= 1)
            .ok_or_else(|| {
                EngineError::Config(format!(
                    "{POSITION_EMBEDDING} has {attention_width} rows, too few for \
                     gr_output_length = {output_length}"
                ))
            })?,
    };
    let time_rows = ckpt.require_shape(&layer(0, "_rel_attn_bias._ts_w"))?;
    if time_rows.len() != 1 || time_rows[0] < 2 {
        return Err(EngineError::Config(format!(
            "{} must be [time buckets + 1], found {time_rows:?}",
            layer(0, "_rel_attn_bias._ts_w")
        )));
    }
    let config = HstuConfig {
        n_items,
        max_len,
        embedding_dim,
        num_blocks,
        num_heads,
        dqk,
        dv,
        attention_width,
        time_buckets: time_rows[0] - 1,
    };
    // Every block's shapes, so that a disagreement is named before any tensor is read.
    for (name, shape) in checkpoint_shapes(&config) {
        let found = ckpt.require_shape(&name)?;
        if found != shape.as_slice() {
            return Err(EngineError::ShapeMismatch {
                name,
                expected: shape,
                found: found.to_vec(),
            });
        }
    }
    Ok(config)
}

/// The official state dict's tensors that the model reads, with their shapes.
fn checkpoint_shapes(c: &HstuConfig) -> Vec<(String, Vec<usize>)> {
    let d = c.embedding_dim;
    let mut shapes = vec![
        (ITEM_EMBEDDING.to_string(), vec![c.n_items + 1, d]),
        (POSITION_EMBEDDING.to_string(), vec![c.attention_width, d]),
    ];
    for b in 0..c.num_blocks {
        shapes.extend([
            (layer(b, "_uvqk"), vec![d, c.uvqk_width()]),
            (layer(b, "_o.weight"), vec![d, c.num_heads * c.dv]),
            (layer(b, "_o.bias"), vec![d]),
            (layer(b, "_rel_attn_bias._ts_w"), vec![c.time_buckets + 1]),
            (
                layer(b, "_rel_attn_bias._pos_w"),
                vec![2 * c.attention_width - 1],
            ),
        ]);
    }
    shapes
}

/// The engine's tensors, with their shapes (what [`engine_tensors`] writes).
pub(crate) fn engine_shapes(c: &HstuConfig) -> Vec<(String, Vec<usize>)> {
    let d = c.embedding_dim;
    let mut shapes = vec![
        (names::INPUT_ROWS.to_string(), vec![c.n_items + 1, d]),
        (names::OUTPUT_ROWS.to_string(), vec![c.n_items + 1, d]),
        (names::POSITIONS.to_string(), vec![c.attention_width, d]),
    ];
    for b in 0..c.num_blocks {
        shapes.extend([
            (
                format!("{}.weight", names::uvqk(b)),
                vec![c.uvqk_width(), d],
            ),
            (format!("{}.bias", names::uvqk(b)), vec![c.uvqk_width()]),
            (
                format!("{}.weight", names::output(b)),
                vec![d, c.num_heads * c.dv],
            ),
            (format!("{}.bias", names::output(b)), vec![d]),
            (names::position_bias(b), vec![2 * c.attention_width - 1]),
            (names::time_bias(b), vec![c.time_buckets + 1]),
        ]);
    }
    shapes
}

/// The 2-D weights a reduced precision applies to: both item tables and the blocks' projections.
/// The position embedding and the biases stay fp32.
pub(crate) fn quantizable(c: &HstuConfig) -> Vec<String> {
    engine_shapes(c)
        .into_iter()
        .filter(|(name, shape)| shape.len() == 2 && name != names::POSITIONS)
        .map(|(name, _)| name)
        .collect()
}

/// Each row divided by `max(||row||, eps)` (the official `item_l2_norm`), in f32 as PyTorch's
/// `F.normalize` computes it.
pub(crate) fn normalised_rows(table: &[f32], width: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(table.len());
    for row in table.chunks_exact(width) {
        let norm = row.iter().map(|v| v * v).sum::<f32>().sqrt();
        let scale = norm.max(HstuConfig::EPS as f32);
        out.extend(row.iter().map(|v| v / scale));
    }
    out
}

/// The engine tensors from the official checkpoint: the item table as stored and normalised, the
/// uvqk projection transposed to a dense layer's `[out, in]` (with a zero bias), the rest as
/// stored.
pub(crate) fn engine_tensors(c: &HstuConfig, ckpt: &Checkpoint) -> Result<Vec<(String, Tensor)>> {
    let shapes: std::collections::BTreeMap<String, Vec<usize>> =
        checkpoint_shapes(c).into_iter().collect();
    let read = |name: &str| ckpt.tensor_f32(name, &shapes[name]);
    let d = c.embedding_dim;
    let items = read(ITEM_EMBEDDING)?;
    let normalised = normalised_rows(items.as_slice(), d);
    let mut out = vec![
        (
            names::OUTPUT_ROWS.to_string(),
            Tensor::from_vec(vec![c.n_items + 1, d], normalised),
        ),
        (names::INPUT_ROWS.to_string(), items),
        (names::POSITIONS.to_string(), read(POSITION_EMBEDDING)?),
    ];
    for b in 0..c.num_blocks {
        out.extend([
            (
                format!("{}.weight", names::uvqk(b)),
                read(&layer(b, "_uvqk"))?.transposed(),
            ),
            (
                format!("{}.bias", names::uvqk(b)),
                Tensor::from_vec(vec![c.uvqk_width()], vec![0.0; c.uvqk_width()]),
            ),
            (
                format!("{}.weight", names::output(b)),
                read(&layer(b, "_o.weight"))?,
            ),
            (
                format!("{}.bias", names::output(b)),
                read(&layer(b, "_o.bias"))?,
            ),
            (
                names::position_bias(b),
                read(&layer(b, "_rel_attn_bias._pos_w"))?,
            ),
            (
                names::time_bias(b),
                read(&layer(b, "_rel_attn_bias._ts_w"))?,
            ),
        ]);
    }
    Ok(out)
}
