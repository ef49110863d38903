//! The one error type of the registry.

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error(transparent)]
    Engine(#[from] recsys_engine::EngineError),

    /// The object store refused or failed an operation (network, credentials, missing bucket).
    #[error("{context}: {source}")]
    Store {
        context: String,
        #[source]
        source: object_store::Error,
    },

    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    /// A request that cannot be carried out as asked: flags that do not fit together, the first
    /// version published without --approve (exit status 2, like the CLI's own flag errors).
    #[error("{0}")]
    Usage(String),

    /// A repository, version or server that is not what the command needs: an unknown version, an
    /// incomplete upload, a malformed record, a replica that refuses (exit status 1).
    #[error("{0}")]
    Input(String),

    /// Another command holds the model's lease (nothing changed).
    #[error("{0}")]
    LeaseHeld(String),

    /// Another command took the lease over while this one held it: it stopped changing the fleet.
    #[error("{0}")]
    LeaseLost(String),

    /// The repository came to name another version during a rollout: another command changed
    /// it, and this one stopped changing the fleet.
    #[error("{0}")]
    Superseded(String),
}

impl RegistryError {
    pub fn store(context: impl Into<String>) -> impl FnOnce(object_store::Error) -> RegistryError {
        let context = context.into();
        move |source| RegistryError::Store { context, source }
    }

    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> RegistryError {
        let context = context.into();
        move |source| RegistryError::Io { context, source }
    }
}

pub type Result<T> = std::result::Result<T, RegistryError>;
