//! The one error type of the command line.

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Engine(#[from] recsys_engine::EngineError),

    #[error(transparent)]
    Onnx(#[from] recsys_onnx::OnnxError),

    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    /// Flags that parse but do not make sense together, or files that are not what a flag expects.
    #[error("{0}")]
    Usage(String),
}

impl CliError {
    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> CliError {
        let context = context.into();
        move |source| CliError::Io { context, source }
    }
}

pub type Result<T> = std::result::Result<T, CliError>;
