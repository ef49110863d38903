//! recsys engine: BERT4Rec, SASRec, GRU4Rec, Mult-VAE and HSTU inference in pure Rust, independent of any serving framework.
//!
//! Flow: a checkpoint ([`import`]) plus hyper-parameters ([`config`]) become an engine directory
//! ([`engine_dir`]); an [`Engine`] loads it and answers requests in external item ids
//! ([`idmap`]) with the top-k items ([`topk`]); [`metrics`] scores it offline.

pub mod availability;
pub mod calibration;
pub mod catalogue;
pub mod catalogue_file;
pub mod compact;
pub mod config;
mod config_fields;
pub mod convert;
pub mod convert_options;
pub mod elements;
pub mod engine;
pub mod engine_dir;
pub use engine_dir::kernel_file;
pub mod error;
pub mod filters;
#[cfg(feature = "fixtures")]
pub mod fixtures;
pub mod fold_in;
pub mod gin;
pub mod idmap;
pub mod import;
pub mod interactions;
pub mod item_sets;
pub mod metrics;
pub mod models;
pub mod plan;
pub mod plan_amx;
pub mod plan_load;
pub mod popularity;
pub mod prefix_cache;
pub mod request;
mod set_file;
pub mod tensor;
pub mod weights;

// The kernels crate under the names the engine has always used for it.
pub use recsys_kernels as kernels;
pub use recsys_kernels::{parallel, profile, topk};

pub use availability::{default_max_availability_bytes, Availability, AvailabilityFile};
pub use config::{ModelConfig, ModelKind};
pub use convert::{convert, convert_limited, CatalogueInputs, ConvertRequest, W8a8Layers};
pub use convert_options::{CalibrationChoice, ConvertOptions, ConvertPlan, Int8Mode, Spelling};
pub use engine::{Engine, RankedRows, Scorer};
pub use error::{EngineError, IdInput, NoKnownItemRefusal, Result};
pub use filters::FilterView;
pub use idmap::{ExternalId, ExternalIds, IdMap, ItemMapSource};
pub use item_sets::{AttributeTable, ItemFilter, ItemSets};
pub use request::{
    excluded_items, BatchRecommender, EmptyHistoryPolicy, InternalRequest, Recommendation, Request,
    RequestTimes, RowAnswer, ServeOptions, UnknownIds, UnknownItemPolicy,
};
