//! Model hyper-parameters: read from the fixtures' `config.json`, or from the `final_config_dict` a
//! RecBole checkpoint carries, completed from the weights' shapes and checked against them.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::config_fields::{agree, usize_field};
use crate::error::{EngineError, Result};
use crate::import::Checkpoint;
pub use crate::models::hstu::HstuConfig;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    Bert4rec,
    Vaecf,
    Sasrec,
    Gru4rec,
    Hstu,
}

impl ModelKind {
    /// The name the command line and manifests use.
    pub fn as_str(self) -> &'static str {
        match self {
            ModelKind::Bert4rec => "bert4rec",
            ModelKind::Vaecf => "vaecf",
            ModelKind::Sasrec => "sasrec",
            ModelKind::Gru4rec => "gru4rec",
            ModelKind::Hstu => "hstu",
        }
    }

    /// Every kind, in the order the command line lists them.
    pub const ALL: [ModelKind; 5] = [
        ModelKind::Bert4rec,
        ModelKind::Vaecf,
        ModelKind::Sasrec,
        ModelKind::Gru4rec,
        ModelKind::Hstu,
    ];

    /// The kinds RecBole trains (and whose fixtures RecBole made): BERT4Rec, Mult-VAE, SASRec and
    /// GRU4Rec. HSTU comes from Meta's generative-recommenders code instead.
    pub const RECBOLE: [ModelKind; 4] = [
        ModelKind::Bert4rec,
        ModelKind::Vaecf,
        ModelKind::Sasrec,
        ModelKind::Gru4rec,
    ];

    /// The kind of a RecBole model class (a checkpoint config's `model`), when recsys runs it.
    pub fn of_recbole_class(name: &str) -> Option<ModelKind> {
        match name {
            "BERT4Rec" => Some(ModelKind::Bert4rec),
            "MultiVAE" => Some(ModelKind::Vaecf),
            "SASRec" => Some(ModelKind::Sasrec),
            "GRU4Rec" => Some(ModelKind::Gru4rec),
            _ => None,
        }
    }

    /// Models that read the history in order and answer from its last item: they keep the most
    /// recent `max_len` items and need at least one.
    pub fn needs_history(self) -> bool {
        matches!(
            self,
            ModelKind::Sasrec | ModelKind::Gru4rec | ModelKind::Hstu
        )
    }

    /// Models that read when each event happened (HSTU's relative time bias): their requests
    /// carry a timestamp per history item and the time of the event to predict.
    pub fn reads_timestamps(self) -> bool {
        self == ModelKind::Hstu
    }
}

impl std::str::FromStr for ModelKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().replace(['-', '_'], "").as_str() {
            "bert4rec" => Ok(ModelKind::Bert4rec),
            "vaecf" | "multivae" => Ok(ModelKind::Vaecf),
            "sasrec" => Ok(ModelKind::Sasrec),
            "gru4rec" => Ok(ModelKind::Gru4rec),
            "hstu" => Ok(ModelKind::Hstu),
            _ => Err(format!(
                "unknown model kind {s:?} (expected bert4rec, vaecf, sasrec, gru4rec or hstu)"
            )),
        }
    }
}

impl std::fmt::Display for ModelKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A transformer recommender as RecBole builds it: BERT4Rec or SASRec (the same post-LN layers;
/// which of the two is the [`ModelConfig`] variant).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TransformerConfig {
    /// Real items N (internal indices 1..=N; 0 is PAD; BERT4Rec's MASK is N+1).
    pub n_items: usize,
    /// Positions L (rows of the position embedding): BERT4Rec keeps the last L-1 items and its
    /// MASK slot, SASRec the last L items.
    pub max_len: usize,
    pub hidden_size: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub inner_size: usize,
    pub layer_norm_eps: f64,
}

/// GRU4Rec as RecBole's `GRU4Rec` builds it: item embedding, a stacked GRU, a dense layer back
/// to the embedding width, and scores against the item embedding.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Gru4RecConfig {
    pub n_items: usize,
    /// Most recent items kept (RecBole's `MAX_ITEM_LIST_LENGTH`).
    pub max_len: usize,
    pub embedding_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    /// The GRU carries `bias_ih`/`bias_hh` (RecBole builds it with `bias=False`; other
    /// implementations keep them).
    pub gru_bias: bool,
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
    Bert4rec(TransformerConfig),
    Vaecf(VaeCfConfig),
    Sasrec(TransformerConfig),
    Gru4rec(Gru4RecConfig),
    Hstu(HstuConfig),
}

impl ModelConfig {
    pub fn kind(&self) -> ModelKind {
        match self {
            ModelConfig::Bert4rec(_) => ModelKind::Bert4rec,
            ModelConfig::Vaecf(_) => ModelKind::Vaecf,
            ModelConfig::Sasrec(_) => ModelKind::Sasrec,
            ModelConfig::Gru4rec(_) => ModelKind::Gru4rec,
            ModelConfig::Hstu(_) => ModelKind::Hstu,
        }
    }

    pub fn n_items(&self) -> usize {
        match self {
            ModelConfig::Bert4rec(c) | ModelConfig::Sasrec(c) => c.n_items,
            ModelConfig::Vaecf(c) => c.n_items,
            ModelConfig::Gru4rec(c) => c.n_items,
            ModelConfig::Hstu(c) => c.n_items,
        }
    }

    /// The same model over a catalogue of `n_items` items (a catalogue delta adds items).
    pub fn with_n_items(&self, n_items: usize) -> ModelConfig {
        let mut config = self.clone();
        match &mut config {
            ModelConfig::Bert4rec(c) | ModelConfig::Sasrec(c) => c.n_items = n_items,
            ModelConfig::Vaecf(c) => c.n_items = n_items,
            ModelConfig::Gru4rec(c) => c.n_items = n_items,
            ModelConfig::Hstu(c) => c.n_items = n_items,
        }
        config
    }

    /// The most recent history items the model reads (`None`: all of them, as a set).
    pub fn history_window(&self) -> Option<usize> {
        match self {
            ModelConfig::Bert4rec(c) => Some(c.max_len - 1),
            ModelConfig::Sasrec(c) => Some(c.max_len),
            ModelConfig::Gru4rec(c) => Some(c.max_len),
            ModelConfig::Hstu(c) => Some(c.max_len),
            ModelConfig::Vaecf(_) => None,
        }
    }

    /// Builds the config of a `kind` model from a JSON object (the fixtures' `config.json` or RecBole's
    /// config dict), filling what the JSON leaves out from the checkpoint's shapes, and refusing any
    /// value that contradicts the weights.
    pub fn resolve(kind: ModelKind, json: &Map<String, Value>, ckpt: &Checkpoint) -> Result<Self> {
        match kind {
            ModelKind::Bert4rec => {
                resolve_transformer(json, ckpt, ModelKind::Bert4rec).map(ModelConfig::Bert4rec)
            }
            ModelKind::Sasrec => {
                resolve_transformer(json, ckpt, ModelKind::Sasrec).map(ModelConfig::Sasrec)
            }
            ModelKind::Vaecf => resolve_vaecf(json, ckpt).map(ModelConfig::Vaecf),
            ModelKind::Gru4rec => resolve_gru4rec(json, ckpt).map(ModelConfig::Gru4rec),
            ModelKind::Hstu => {
                crate::models::hstu::resolve_config(json, ckpt).map(ModelConfig::Hstu)
            }
        }
    }
}

/// The item count from the item embedding, which has a PAD row, the items and, for BERT4Rec, a
/// MASK row: `extra_rows` rows beside the items.
fn items_of_embedding(
    json: &Map<String, Value>,
    ckpt: &Checkpoint,
    extra_rows: usize,
) -> Result<(usize, usize)> {
    let emb = ckpt.require_shape("item_embedding.weight")?;
    let layout = if extra_rows == 2 {
        "N+2 rows: PAD, items, MASK"
    } else {
        "N+1 rows: PAD, then the items"
    };
    if emb.len() != 2 || emb[0] < extra_rows + 1 {
        return Err(EngineError::Config(format!(
            "item_embedding.weight must be [{layout}; width] with N >= 1, found {emb:?}"
        )));
    }
    let n_items = agree(
        "n_items",
        usize_field(json, &["n_real_items", "n_items"])?,
        emb[0] - extra_rows,
        &format!("item_embedding.weight ({layout})"),
    )?;
    Ok((n_items, emb[1]))
}

/// BERT4Rec or SASRec (`kind`): the same layers; BERT4Rec's embedding has a MASK row and it has
/// an output head (`output_ffn`, `output_ln`), SASRec neither.
fn resolve_transformer(
    json: &Map<String, Value>,
    ckpt: &Checkpoint,
    kind: ModelKind,
) -> Result<TransformerConfig> {
    let extra_rows = if kind == ModelKind::Bert4rec { 2 } else { 1 };
    let (n_items, hidden) = items_of_embedding(json, ckpt, extra_rows)?;
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
        None => 1e-12, // RecBole's default for both models
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
                    "{key} = {act:?} is not supported: {kind} here uses the exact (erf) GELU \
                     (RecBole's 'gelu')"
                )));
            }
        }
    }
    if kind == ModelKind::Sasrec && ckpt.shape("output_ffn.weight").is_some() {
        return Err(EngineError::Config(
            "the checkpoint has an output head (output_ffn): it is a BERT4Rec, not a SASRec".into(),
        ));
    }
    Ok(TransformerConfig {
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

fn resolve_gru4rec(json: &Map<String, Value>, ckpt: &Checkpoint) -> Result<Gru4RecConfig> {
    let (n_items, embedding_size) = items_of_embedding(json, ckpt, 1)?;
    let embedding_size = agree(
        "embedding_size",
        usize_field(json, &["embedding_size"])?,
        embedding_size,
        "item_embedding.weight",
    )?;
    let hh = ckpt.require_shape("gru_layers.weight_hh_l0")?;
    if hh.len() != 2 || hh[0] != 3 * hh[1] {
        return Err(EngineError::Config(format!(
            "gru_layers.weight_hh_l0 must be [3 x hidden, hidden] (the reset, update and new \
             gates), found {hh:?}"
        )));
    }
    let hidden_size = agree(
        "hidden_size",
        usize_field(json, &["hidden_size"])?,
        hh[1],
        "gru_layers.weight_hh_l0",
    )?;
    let layers_in_weights = (0..)
        .take_while(|l| ckpt.shape(&format!("gru_layers.weight_ih_l{l}")).is_some())
        .count();
    let num_layers = agree(
        "num_layers",
        usize_field(json, &["num_layers"])?,
        layers_in_weights,
        "the gru_layers.weight_ih_l* tensors",
    )?;
    if num_layers == 0 {
        return Err(EngineError::MissingTensor {
            name: "gru_layers.weight_ih_l0".into(),
        });
    }
    for key in ckpt.tensors.keys() {
        if key.starts_with("gru_layers.") && key.contains("_reverse") {
            return Err(EngineError::Config(format!(
                "{key}: a bidirectional GRU is not supported (GRU4Rec reads the history forwards)"
            )));
        }
    }
    let gru_bias = ckpt.shape("gru_layers.bias_ih_l0").is_some();
    for l in 0..num_layers {
        for part in ["bias_ih", "bias_hh"] {
            let name = format!("gru_layers.{part}_l{l}");
            if ckpt.shape(&name).is_some() != gru_bias {
                return Err(EngineError::Config(format!(
                    "{name} is {}, unlike gru_layers.bias_ih_l0: every GRU layer has both \
                     biases or none",
                    if gru_bias { "missing" } else { "present" }
                )));
            }
        }
    }
    let max_len = usize_field(json, &["max_seq_length", "MAX_ITEM_LIST_LENGTH", "max_len"])?
        .ok_or_else(|| {
            EngineError::Config(
                "'MAX_ITEM_LIST_LENGTH' (or 'max_seq_length') is required: a GRU's weights do not \
                 say how many recent items it was trained on"
                    .into(),
            )
        })?;
    if max_len == 0 {
        return Err(EngineError::Config(
            "max_seq_length must be at least 1".into(),
        ));
    }
    Ok(Gru4RecConfig {
        n_items,
        max_len,
        embedding_size,
        hidden_size,
        num_layers,
        gru_bias,
    })
}
