//! The one error type of the command line.

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Engine(#[from] recsys_engine::EngineError),

    #[error(transparent)]
    Onnx(#[from] recsys_onnx::OnnxError),

    #[error(transparent)]
    Registry(#[from] recsys_registry::RegistryError),

    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    /// Flags that parse but do not make sense together (exit status 2, like clap's own errors).
    #[error("{0}")]
    Usage(String),

    /// A file, repository or server that is not what the command needs: malformed JSON, a version
    /// that does not exist, a lock held by another command, a server that refuses (exit status 1).
    #[error("{0}")]
    Input(String),
}

impl CliError {
    /// The process exit status: 2 for bad flags (as clap exits for unparsable ones), 6 for a
    /// model's lease held by another command, 10 for a lease lost while the command ran, 1
    /// otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Usage(_) | CliError::Registry(recsys_registry::RegistryError::Usage(_)) => 2,
            CliError::Registry(recsys_registry::RegistryError::LeaseHeld(_)) => {
                crate::exit::LEASE_HELD_EXIT
            }
            CliError::Registry(recsys_registry::RegistryError::LeaseLost(_)) => {
                crate::exit::LEASE_LOST_EXIT
            }
            _ => 1,
        }
    }

    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> CliError {
        let context = context.into();
        move |source| CliError::Io { context, source }
    }
}

pub type Result<T> = std::result::Result<T, CliError>;
