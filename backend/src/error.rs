//! The one error type of the backend, and its mapping to Triton error codes.

use recsys_engine::EngineError;

/// Triton's error codes, as the backend uses them (mapped to the C values in the FFI layer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorCode {
    Internal,
    NotFound,
    InvalidArg,
    Unsupported,
    Unavailable,
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Engine(#[from] EngineError),

    /// A model version whose engine cannot be loaded; the code follows the engine's error.
    /// `what` names the model, version and directory, plus a hint when there is an obvious fix.
    #[error("cannot load {what}")]
    Load {
        what: String,
        #[source]
        source: Box<EngineError>,
    },

    /// A request input that cannot be served; the message names the input.
    #[error("{0}")]
    InvalidInput(String),

    /// A model configuration (config.pbtxt) the backend cannot serve.
    #[error("{0}")]
    InvalidConfig(String),

    /// Something this build does not do (e.g. KIND_GPU instances without the GPU path).
    #[error("{0}")]
    Unsupported(String),

    /// A call into the Triton API failed.
    #[error("{call} failed: {message}")]
    Triton {
        call: &'static str,
        code: ErrorCode,
        message: String,
    },

    /// A bug: a panic caught at the boundary, or a broken invariant.
    #[error("{0}")]
    Internal(String),
}

impl BackendError {
    /// The code Triton reports to the client.
    pub fn code(&self) -> ErrorCode {
        match self {
            BackendError::Engine(e) => engine_code(e),
            BackendError::Load { source, .. } => engine_code(source),
            BackendError::InvalidInput(_) | BackendError::InvalidConfig(_) => ErrorCode::InvalidArg,
            BackendError::Unsupported(_) => ErrorCode::Unsupported,
            BackendError::Triton { code, .. } => *code,
            BackendError::Internal(_) => ErrorCode::Internal,
        }
    }

    /// The message with its whole cause chain, for the client and the log.
    pub fn full_message(&self) -> String {
        let mut message = self.to_string();
        let mut source = std::error::Error::source(self);
        while let Some(cause) = source {
            let text = cause.to_string();
            if !message.contains(&text) {
                message.push_str(": ");
                message.push_str(&text);
            }
            source = cause.source();
        }
        message
    }
}

/// Exhaustive over engine errors, so a new kind cannot silently land in the wrong class: bad files
/// and requests are the user's to fix (INVALID_ARG), a missing file is NOT_FOUND, I/O is INTERNAL.
fn engine_code(e: &EngineError) -> ErrorCode {
    match e {
        EngineError::Io { .. } | EngineError::Device(_) => ErrorCode::Internal,
        EngineError::NotFound { .. } => ErrorCode::NotFound,
        EngineError::Checkpoint { .. }
        | EngineError::MissingTensor { .. }
        | EngineError::ShapeMismatch { .. }
        | EngineError::UnsupportedDtype { .. }
        | EngineError::NonFiniteWeight { .. }
        | EngineError::Config(_)
        | EngineError::IdMap { .. }
        | EngineError::EngineDir { .. }
        | EngineError::Checksum { .. }
        | EngineError::InvalidRequest(_)
        | EngineError::UnknownIds { .. }
        | EngineError::NoKnownItem { .. }
        | EngineError::Catalogue(_)
        | EngineError::TestSet { .. } => ErrorCode::InvalidArg,
    }
}

pub type Result<T, E = BackendError> = std::result::Result<T, E>;
