//! `recsys.recbole`'s native half: the item tokens of a dataset file RecBole saved, read as data by
//! the engine's reader (the one `recsys convert --recbole-dataset` uses), so that a saved file
//! gives its map without RecBole, PyTorch or unpickling.

use std::path::PathBuf;

use pyo3::prelude::*;

use crate::engine_error;

/// The default size limit: the command line's `--max-checkpoint-bytes` default.
const DEFAULT_MAX_BYTES: u64 = recsys_engine::import::DEFAULT_MAX_CHECKPOINT_BYTES;

/// The item tokens of internal indices 1..=N in a RecBole `save_dataset` / `save_dataloaders` file.
#[pyfunction]
#[pyo3(signature = (path, max_bytes = DEFAULT_MAX_BYTES))]
pub(crate) fn recbole_item_tokens(
    py: Python<'_>,
    path: PathBuf,
    max_bytes: u64,
) -> PyResult<Vec<String>> {
    py.detach(|| recsys_engine::import::recbole_dataset::read_item_tokens(&path, max_bytes))
        .map_err(engine_error)
}
