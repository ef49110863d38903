//! Where a `recsys.Engine` runs its batches: the CPU engine itself, or, in a package built with
//! CUDA support (`scripts/build-wheel.sh --cuda 12|13`), the whole model on a GPU through the
//! same `recsys_gpu::cuda::GpuModel` a Triton KIND_GPU instance uses (uploaded once, checked
//! against the CPU engine at load). Requests are checked and mapped on the CPU either way.

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use recsys_engine::{BatchRecommender, Engine};

use crate::RecsysError;

/// A `device` argument: "cpu", "cuda" (GPU 0) or "cuda:N".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DeviceChoice {
    Cpu,
    Cuda(usize),
}

impl DeviceChoice {
    pub(crate) fn parse(text: &str) -> PyResult<DeviceChoice> {
        let bad = || {
            PyValueError::new_err(format!(
                "device must be \"cpu\", \"cuda\" or \"cuda:N\" (N a GPU ordinal), got {text:?}"
            ))
        };
        match text.trim() {
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            other => {
                let ordinal = other.strip_prefix("cuda:").ok_or_else(bad)?;
                ordinal.parse().map(DeviceChoice::Cuda).map_err(|_| bad())
            }
        }
    }

    pub(crate) fn name(self) -> String {
        match self {
            DeviceChoice::Cpu => "cpu".into(),
            DeviceChoice::Cuda(n) => format!("cuda:{n}"),
        }
    }
}

/// The recommender for `choice`: `None` for the CPU (the engine answers itself).
#[cfg(feature = "cuda")]
pub(crate) fn recommender(
    choice: DeviceChoice,
    engine: &Arc<Engine>,
) -> PyResult<Option<Arc<dyn BatchRecommender>>> {
    match choice {
        DeviceChoice::Cpu => Ok(None),
        DeviceChoice::Cuda(ordinal) => {
            let model = recsys_gpu::cuda::GpuModel::new(ordinal, engine)
                .map_err(|e| RecsysError::new_err(format!("device cuda:{ordinal}: {e}")))?;
            Ok(Some(Arc::new(model)))
        }
    }
}

/// Without CUDA support a GPU is refused with how to get a package that has it.
#[cfg(not(feature = "cuda"))]
pub(crate) fn recommender(
    choice: DeviceChoice,
    _engine: &Arc<Engine>,
) -> PyResult<Option<Arc<dyn BatchRecommender>>> {
    match choice {
        DeviceChoice::Cpu => Ok(None),
        DeviceChoice::Cuda(_) => Err(RecsysError::new_err(format!(
            "device {:?}: this recsys package runs on the CPU only; build one with CUDA support \
             (scripts/build-wheel.sh --cuda 12, or --cuda 13, on a machine with the Rust \
             toolchain) to run the model on a GPU",
            choice.name()
        ))),
    }
}
