//! The one error type of the engine crate.

use std::path::PathBuf;

/// Everything that can go wrong while importing a checkpoint, loading an engine or serving a request.
///
/// The variants are grouped by who has to act: the caller's request (`InvalidRequest`), the files a
/// user handed us (`Checkpoint`, `MissingTensor`, `ShapeMismatch`, ...), or the engine directory.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    #[error("file not found: {}", path.display())]
    NotFound { path: PathBuf },

    /// The checkpoint could not be parsed (truncated, corrupted, not a checkpoint at all).
    #[error("cannot read checkpoint {}: {reason}", path.display())]
    Checkpoint { path: PathBuf, reason: String },

    #[error("tensor '{name}' is missing from the checkpoint")]
    MissingTensor { name: String },

    #[error("tensor '{name}' has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },

    #[error("tensor '{name}' has unsupported dtype {dtype} (supported: F32, F16, BF16, F64)")]
    UnsupportedDtype { name: String, dtype: String },

    #[error("tensor '{name}' holds a non-finite value (NaN or infinity) at flat index {index}")]
    NonFiniteWeight { name: String, index: usize },

    /// The model configuration is missing a field, has an impossible value, or disagrees with the weights.
    #[error("invalid model config: {0}")]
    Config(String),

    #[error("invalid item id map {}: {reason}", path.display())]
    IdMap { path: PathBuf, reason: String },

    /// The engine directory is damaged or was written by an incompatible version.
    #[error("invalid engine directory {}: {reason}", path.display())]
    EngineDir { path: PathBuf, reason: String },

    #[error("checksum mismatch for {}: manifest says {expected}, file has {found}", path.display())]
    Checksum {
        path: PathBuf,
        expected: String,
        found: String,
    },

    /// A request that cannot be served as sent; the message names the offending input.
    #[error("invalid request: {0}")]
    InvalidRequest(String),

    /// A request whose ids include ones the model does not know, under the policy that refuses
    /// them (worded in Triton's terms; the Python package words it in its own from the fields).
    #[error(
        "invalid request: {} holds {count} id(s) unknown to the model (unknown_item_policy is \"error\")",
        input.tensor()
    )]
    UnknownIds {
        input: IdInput,
        count: usize,
        /// The first few unknown ids, as text.
        examples: Vec<String>,
    },

    /// A history with no item the model knows, which neither the popularity list nor the model
    /// can answer (worded in Triton's terms; the Python package words it in its own).
    #[error(
        "invalid request: ITEM_IDS holds no item known to the model ({ids} id(s), {unknown} \
         unknown){}",
        why.triton_text()
    )]
    NoKnownItem {
        ids: usize,
        unknown: usize,
        why: NoKnownItemRefusal,
    },

    /// A catalogue delta that cannot apply to the engine; the message names the item and why.
    #[error("catalogue delta: {0}")]
    Catalogue(String),

    /// The device running the output layer (the GPU path) failed.
    #[error("output-layer device: {0}")]
    Device(String),

    #[error("invalid test file {}: line {line}: {reason}", path.display())]
    TestSet {
        path: PathBuf,
        line: usize,
        reason: String,
    },
}

impl EngineError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        EngineError::Io {
            context: context.into(),
            source,
        }
    }

    pub(crate) fn checkpoint(path: &std::path::Path, reason: impl Into<String>) -> Self {
        EngineError::Checkpoint {
            path: path.to_path_buf(),
            reason: reason.into(),
        }
    }

    /// Opens a file, mapping "does not exist" to [`EngineError::NotFound`] so callers can tell a
    /// missing file from an unreadable one.
    pub(crate) fn open(path: &std::path::Path) -> Result<std::fs::File> {
        std::fs::File::open(path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                EngineError::NotFound {
                    path: path.to_path_buf(),
                }
            } else {
                EngineError::io(format!("cannot open {}", path.display()), e)
            }
        })
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// Why a history without a known item was refused ([`EngineError::NoKnownItem`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoKnownItemRefusal {
    /// `empty_history_policy` is "popular" and the engine has no popularity list.
    NoPopularityList,
    /// `empty_history_policy` is "error".
    PolicyRefuses,
    /// The model (by name: "sasrec", "gru4rec", ...) answers from the history's last item, and
    /// no popularity list answers instead.
    ModelNeedsHistory(&'static str),
}

impl NoKnownItemRefusal {
    fn triton_text(self) -> String {
        match self {
            NoKnownItemRefusal::NoPopularityList => {
                " and empty_history_policy is \"popular\", but \
                this engine has no popularity list (convert it with --interactions)"
                    .to_string()
            }
            NoKnownItemRefusal::PolicyRefuses => " (empty_history_policy is \"error\")".to_string(),
            NoKnownItemRefusal::ModelNeedsHistory(kind) => format!(
                ": {kind} answers from the history's last item, so it needs at least one \
                 (empty_history_policy \"popular\", with an engine converted with \
                 --interactions, answers such visitors with the most popular items)"
            ),
        }
    }
}

/// Which ids of a request an [`EngineError::UnknownIds`] is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdInput {
    History,
    Candidates,
}

impl IdInput {
    /// The Triton input that carries them.
    pub fn tensor(self) -> &'static str {
        match self {
            IdInput::History => "ITEM_IDS",
            IdInput::Candidates => "CANDIDATE_ITEM_IDS",
        }
    }
}
