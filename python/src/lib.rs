//! The recsys engine as the Python extension `recsys._recsys`: an engine directory loaded once
//! (memory-mapped), answering recommendations, candidate re-ranking, user embeddings and full
//! score matrices for batches of histories with the GIL released while it computes; `convert` and
//! `evaluate` as the command line runs them. Inputs are Python sequences (lists or numpy arrays)
//! of item ids; outputs are numpy arrays (lists for string ids). Engine errors become Python
//! exceptions carrying the engine's message.
#![forbid(unsafe_code)]

mod commands;
mod device;
mod engine;
mod filters;
mod ids;
mod recbole;
mod times;

use pyo3::exceptions::{PyException, PyFileNotFoundError, PyValueError};
use pyo3::prelude::*;
use recsys_engine::EngineError;

use engine::PyEngine;

pyo3::create_exception!(
    _recsys,
    RecsysError,
    PyException,
    "An engine, checkpoint or file that recsys cannot use; the message says why."
);

/// The Python exception for an engine error: a bad request is a ValueError, a missing file a
/// FileNotFoundError, anything else a RecsysError.
pub(crate) fn engine_error(e: EngineError) -> PyErr {
    match &e {
        EngineError::NotFound { .. } => PyFileNotFoundError::new_err(e.to_string()),
        EngineError::InvalidRequest(_)
        | EngineError::UnknownIds { .. }
        | EngineError::NoKnownItem { .. } => PyValueError::new_err(e.to_string()),
        _ => RecsysError::new_err(e.to_string()),
    }
}

#[pymodule]
fn _recsys(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngine>()?;
    m.add_function(wrap_pyfunction!(commands::convert, m)?)?;
    m.add_function(wrap_pyfunction!(commands::evaluate, m)?)?;
    m.add_function(wrap_pyfunction!(recbole::recbole_item_tokens, m)?)?;
    m.add("RecsysError", m.py().get_type::<RecsysError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
