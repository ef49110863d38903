//! Model versions in a Triton model repository, on a local disk or in object storage (S3 and
//! S3-compatible stores, GCS), for one server or a fleet of replicas:
//! - [`location`]: the repository string, in tritonserver's own `--model-repository` syntax;
//! - [`store`]: the few object operations the registry needs, over object_store;
//! - [`versions`]: the per-version records (`<model>/<v>/recsys-version.json`);
//! - [`publish`]: an engine becomes the next version (pending), without a lock;
//! - [`release`]: approve, reject and rollback, each verifying what would serve before anything
//!   changes and undoing a failed rollout by itself;
//! - [`lease`]: one command at a time changes a model's fleet (a create-if-absent object that
//!   expires);
//! - [`integrity`]: the gate that reads every stored file back against its published SHA-256;
//! - [`self_check`] and [`canary`]: the request a version must answer on one replica, loaded
//!   without the repository changing, before it may serve;
//! - [`quality`]: the champion/challenger gate on held-out histories (NDCG@10, degenerate scores);
//! - [`status`]: a version's status changed alone (no gate, no rollout);
//! - [`prune`]: old versions removed, never one that serves or may serve next;
//! - [`config`]: `config.pbtxt`'s version policy, switched by one atomic write (found among
//!   the file's protobuf-text tokens by `pbtxt`, never inside a comment or a string);
//! - [`replicas`]: reloading every replica and reporting each one;
//! - [`triton`]: the calls of Triton's HTTP API that loading a version needs;
//! - [`pushgateway`]: a release command's outcome pushed to a Prometheus Pushgateway;
//! - [`transfer`]: single files and folders to and from object storage;
//! - [`availability`]: live availability objects published for a fleet and polled by servers;
//! - `faults`: the simulation tests' fault hooks (a panic or an abort at the N-th store write, a
//!   short lease, a skewed clock), compiled in only with the `fault-injection` feature.
#![forbid(unsafe_code)]

pub mod availability;
mod aws_files;
pub mod canary;
pub mod catalogue;
pub mod compact;
pub mod config;
pub mod error;
mod faults;
pub mod integrity;
pub mod lease;
pub mod live_source;
pub mod location;
mod pbtxt;
pub mod prune;
pub mod publish;
pub mod pushgateway;
pub mod quality;
pub mod release;
pub mod replicas;
pub mod self_check;
pub mod status;
pub mod store;
pub mod transfer;
pub mod triton;
pub mod versions;

pub use error::{RegistryError, Result};
pub use store::Repository;
pub use versions::{Status, VersionInfo};
