//! Model hyper-parameters: read from the fixtures' `config.json`, or from the `final_config_dict` a
//! RecBole checkpoint carries, completed from the weights' shapes and checked against them.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{EngineError, Result};
use crate::import::Checkpoint;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    Bert4rec,
    Vaecf,
}

impl ModelKind {
    /// The name the command line and manifests use.
    pub fn as_str(self) -> &'static str {
        match self {
            ModelKind::Bert4rec => "bert4rec",
            ModelKind::Vaecf => "vaecf",
        }
    }
}

impl std::str::FromStr for ModelKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().replace(['-', '_'], "").as_str() {
            "bert4rec" => Ok(ModelKind::Bert4rec),
            "vaecf" | "multivae" => Ok(ModelKind::Vaecf),
            _ => Err(format!(
                "unknown model kind {s:?} (expected bert4rec or vaecf)"
            )),
        }
    }
}

impl std::fmt::Display for ModelKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ModelKind::Bert4rec => "bert4rec",
            ModelKind::Vaecf => "vaecf",
        })
    }
}

/// BERT4Rec as RecBole builds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Bert4RecConfig {
    /// Real items N (internal indices 1..=N; 0 is PAD, N+1 is MASK).
    pub n_items: usize,
    /// Sequence length L including the MASK slot, so histories keep their last L-1 items.
    pub max_len: usize,
    pub hidden_size: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub inner_size: usize,
    pub layer_norm_eps: f64,
}

/// Mult-VAE as RecBole's `MultiVAE` builds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VaeCfConfig {
    pub n_items: usize,
    /// Widths of the hidden layers of the encoder (the decoder mirrors them).
    pub hidden_sizes: Vec<usize>,
    /// Width of mu (half of RecBole's `latent_dimension`).
    pub latent_size: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum ModelConfig {
    Bert4rec(Bert4RecConfig),
    Vaecf(VaeCfConfig),
}

impl ModelConfig {
    pub fn kind(&self) -> ModelKind {
        match self {
            ModelConfig::Bert4rec(_) => ModelKind::Bert4rec,
            ModelConfig::Vaecf(_) => ModelKind::Vaecf,
        }
    }

    pub fn n_items(&self) -> usize {
        match self {
            ModelConfig::Bert4rec(c) => c.n_items,
            ModelConfig::Vaecf(c) => c.n_items,
        }
    }

    /// Builds the config of a `kind` model from a JSON object (the fixtures' `config.json` or RecBole's
    /// config dict), filling what the JSON leaves out from the checkpoint's shapes, and refusing any
    /// value that contradicts the weights.
    pub fn resolve(kind: ModelKind, json: &Map<String, Value>, ckpt: &Checkpoint) -> Result<Self> {
        match kind {
            ModelKind::Bert4rec => resolve_bert4rec(json, ckpt).map(ModelConfig::Bert4rec),
            ModelKind::Vaecf => resolve_vaecf(json, ckpt).map(ModelConfig::Vaecf),
        }
    }
}

/// The first of `keys` present in the JSON, as an unsigned integer.
fn usize_field(json: &Map<String, Value>, keys: &[&str]) -> Result<Option<usize>> {
    for key in keys {
        if let Some(v) = json.get(*key) {
            return v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                EngineError::Config(format!("'{key}' must be a non-negative integer, found {v}"))
            });
        }
    }
    Ok(None)
}

/// Takes the value from the config when given (checking it against the weights) or else from the
/// weights; `what` names the field in error messages.
fn agree(
    what: &str,
    from_config: Option<usize>,
    from_weights: usize,
    evidence: &str,
) -> Result<usize> {
    match from_config {
        Some(v) if v != from_weights => Err(EngineError::Config(format!(
            "config says {what} = {v}, but {evidence} implies {from_weights}"
        ))),
        _ => Ok(from_weights),
    }
}

fn resolve_bert4rec(json: &Map<String, Value>, ckpt: &Checkpoint) -> Result<Bert4RecConfig> {
    let emb = ckpt.require_shape("item_embedding.weight")?;
    if emb.len() != 2 || emb[0] < 3 {
        return Err(EngineError::Config(format!(
            "item_embedding.weight must be [N+2, hidden] with N >= 1, found {emb:?}"
        )));
    }
    let (emb_rows, hidden) = (emb[0], emb[1]);
    let n_items = agree(
        "n_items",
        usize_field(json, &["n_real_items", "n_items"])?,
        emb_rows - 2,
        "item_embedding.weight (N+2 rows: PAD, items, MASK)",
    )?;
    let hidden_size = agree(
        "hidden_size",
        usize_field(json, &["hidden_size"])?,
        hidden,
        "item_embedding.weight",
    )?;
    let pos = ckpt.require_shape("position_embedding.weight")?;
    let max_len = agree(
        "max_len",
        usize_field(json, &["max_seq_length", "MAX_ITEM_LIST_LENGTH", "max_len"])?,
        pos[0],
        "position_embedding.weight",
    )?;
    let layers_in_weights = (0..)
        .take_while(|l| {
            ckpt.shape(&format!(
                "trm_encoder.layer.{l}.multi_head_attention.query.weight"
            ))
            .is_some()
        })
        .count();
    let n_layers = usize_field(json, &["n_layers"])?.unwrap_or(layers_in_weights);
    if n_layers == 0 {
        return Err(EngineError::MissingTensor {
            name: "trm_encoder.layer.0.multi_head_attention.query.weight".into(),
        });
    }
    if n_layers > layers_in_weights {
        return Err(EngineError::MissingTensor {
            name: format!(
                "trm_encoder.layer.{layers_in_weights}.multi_head_attention.query.weight"
            ),
        });
    }
    agree(
        "n_layers",
        Some(n_layers),
        layers_in_weights,
        "the trm_encoder.layer.* tensors",
    )?;
    let inner = ckpt.require_shape("trm_encoder.layer.0.feed_forward.dense_1.weight")?;
    let inner_size = agree(
        "inner_size",
        usize_field(json, &["inner_size"])?,
        inner[0],
        "trm_encoder.layer.0.feed_forward.dense_1.weight",
    )?;
    let n_heads = usize_field(json, &["n_heads"])?.ok_or_else(|| {
        EngineError::Config("'n_heads' is required: it cannot be read from the weights".into())
    })?;
    if n_heads == 0 || hidden_size % n_heads != 0 {
        return Err(EngineError::Config(format!(
            "n_heads = {n_heads} does not divide hidden_size = {hidden_size}"
        )));
    }
    let layer_norm_eps = match json.get("layer_norm_eps") {
        None => 1e-12, // RecBole's BERT4Rec default
        Some(v) => v
            .as_f64()
            .filter(|e| *e >= 0.0 && e.is_finite())
            .ok_or_else(|| {
                EngineError::Config(format!(
                    "'layer_norm_eps' must be a non-negative number, found {v}"
                ))
            })?,
    };
    for key in ["hidden_act", "output_act"] {
        if let Some(act) = json.get(key).and_then(Value::as_str) {
            if !act.starts_with("gelu") || act.contains("tanh") {
                return Err(EngineError::Config(format!(
                    "{key} = {act:?} is not supported: BERT4Rec here uses the exact (erf) GELU"
                )));
            }
        }
    }
    Ok(Bert4RecConfig {
        n_items,
        max_len,
        hidden_size,
        n_layers,
        n_heads,
        inner_size,
        layer_norm_eps,
    })
}

fn resolve_vaecf(json: &Map<String, Value>, ckpt: &Checkpoint) -> Result<VaeCfConfig> {
    let first = ckpt.require_shape("encoder.0.weight")?;
    if first.len() != 2 || first[1] < 2 {
        return Err(EngineError::Config(format!(
            "encoder.0.weight must be [hidden, N+1] with N >= 1, found {first:?}"
        )));
    }
    let n_items = agree(
        "n_items",
        usize_field(json, &["n_real_items", "n_items"])?,
        first[1] - 1,
        "encoder.0.weight (N+1 input columns)",
    )?;
    // RecBole builds Linear layers at even indices with Tanh in between.
    let encoder_layers = (0..)
        .take_while(|i| ckpt.shape(&format!("encoder.{}.weight", 2 * i)).is_some())
        .count();
    let hidden_from_weights: Vec<usize> = (0..encoder_layers.saturating_sub(1))
        .map(|i| {
            ckpt.require_shape(&format!("encoder.{}.weight", 2 * i))
                .map(|s| s[0])
        })
        .collect::<Result<_>>()?;
    let hidden_sizes = match json.get("mlp_hidden_size") {
        None => hidden_from_weights.clone(),
        Some(v) => {
            let list: Option<Vec<usize>> = v
                .as_array()
                .and_then(|a| a.iter().map(|x| x.as_u64().map(|n| n as usize)).collect());
            let list = list.ok_or_else(|| {
                EngineError::Config(format!(
                    "'mlp_hidden_size' must be a list of integers, found {v}"
                ))
            })?;
            if list != hidden_from_weights {
                return Err(EngineError::Config(format!(
                    "config says mlp_hidden_size = {list:?}, but the encoder weights have hidden layers {hidden_from_weights:?}"
                )));
            }
            list
        }
    };
    if hidden_sizes.is_empty() {
        return Err(EngineError::MissingTensor {
            name: "encoder.2.weight".into(),
        });
    }
    let last = ckpt.require_shape(&format!("encoder.{}.weight", 2 * hidden_sizes.len()))?;
    if last[0] % 2 != 0 {
        return Err(EngineError::Config(format!(
            "the last encoder layer must output [mu | logvar] (an even width), found {}",
            last[0]
        )));
    }
    let latent_size = agree(
        "latent_dimension",
        usize_field(json, &["latent_dimension_recbole", "latent_dimension"])?.map(|d| d / 2),
        last[0] / 2,
        "the last encoder layer (mu and logvar)",
    )?;
    if let Some(mu) = usize_field(json, &["mu_dim"])? {
        agree("mu_dim", Some(mu), latent_size, "the last encoder layer")?;
    }
    Ok(VaeCfConfig {
        n_items,
        hidden_sizes,
        latent_size,
    })
}
