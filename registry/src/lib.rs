//! Model versions in a Triton model repository, on a local disk or in object storage (S3 and
//! S3-compatible stores, GCS), for one server or a fleet of replicas:
//! - [`location`]: the repository string, in tritonserver's own `--model-repository` syntax;
//! - [`store`]: the few object operations the registry needs, over object_store;
//! - [`versions`]: the per-version records (`<model>/<v>/recsys-version.json`);
//! - [`publish`]: an engine becomes the next version, without a lock;
//! - [`status`]: approve and reject;
//! - [`config`]: `config.pbtxt`'s version policy, switched by one atomic write;
//! - [`replicas`]: reloading every replica and reporting each one;
//! - [`transfer`]: single files and folders to and from object storage.
#![forbid(unsafe_code)]

mod aws_files;
pub mod config;
pub mod error;
pub mod location;
pub mod publish;
pub mod replicas;
pub mod status;
pub mod store;
pub mod transfer;
pub mod versions;

pub use error::{RegistryError, Result};
pub use store::Repository;
pub use versions::{Status, VersionInfo};
