//! `libtriton_recsys.so`: a Triton Inference Server backend (`backend: "recsys"`) that serves recsys
//! engines. It decodes requests, hands them to the engine as one batch, and encodes the answers;
//! it does no arithmetic of its own.
//!
//! Layers: `settings` (model config), `decode` (tensors <-> engine requests) and `serve` (batching)
//! are pure Rust and unit-tested; `triton` (RAII wrappers), `metrics`, `lifecycle` and the exports
//! below touch the C API and are tested through the real server (the Triton symbols only resolve
//! inside it, so they are left out of unit-test and fuzzing builds).

pub mod availability;
pub mod catalogue;
pub mod decode;
pub mod device_choice;
pub mod error;
pub mod serve;
pub mod settings;
#[cfg(test)]
mod test_support;

#[cfg(not(any(test, fuzzing)))]
mod execute;
#[cfg(not(any(test, fuzzing)))]
mod lifecycle;
pub mod live_engine;
#[cfg(not(any(test, fuzzing)))]
mod metrics;
#[cfg(not(any(test, fuzzing)))]
mod poller;
#[cfg(not(any(test, fuzzing)))]
mod statistics;
#[cfg(not(any(test, fuzzing)))]
mod triton;

#[cfg(not(any(test, fuzzing)))]
mod exports {
    //! The entry points Triton looks up. Each is one call into `guard`, which catches panics and
    //! turns errors into `TRITONSERVER_Error`s, so nothing unwinds into the server.
    use std::panic::{catch_unwind, AssertUnwindSafe};

    use recsys_ffi as sys;

    use crate::error::{BackendError, Result};
    use crate::triton::{log, new_error, LogLevel};
    use crate::{execute, lifecycle};

    fn guard(entry: &str, f: impl FnOnce() -> Result<()>) -> *mut sys::TRITONSERVER_Error {
        let error = match catch_unwind(AssertUnwindSafe(f)) {
            Ok(Ok(())) => return std::ptr::null_mut(),
            Ok(Err(e)) => e,
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                BackendError::Internal(format!("the recsys backend panicked in {entry}: {what}"))
            }
        };
        log(
            LogLevel::Error,
            &format!("recsys: {entry}: {}", error.full_message()),
        );
        new_error(&error)
    }

    #[no_mangle]
    pub extern "C" fn TRITONBACKEND_Initialize(
        backend: *mut sys::TRITONBACKEND_Backend,
    ) -> *mut sys::TRITONSERVER_Error {
        guard("TRITONBACKEND_Initialize", || {
            lifecycle::initialize(backend)
        })
    }

    #[no_mangle]
    pub extern "C" fn TRITONBACKEND_Finalize(
        _backend: *mut sys::TRITONBACKEND_Backend,
    ) -> *mut sys::TRITONSERVER_Error {
        guard("TRITONBACKEND_Finalize", lifecycle::finalize)
    }

    #[no_mangle]
    pub extern "C" fn TRITONBACKEND_ModelInitialize(
        model: *mut sys::TRITONBACKEND_Model,
    ) -> *mut sys::TRITONSERVER_Error {
        guard("TRITONBACKEND_ModelInitialize", || {
            lifecycle::model_initialize(model)
        })
    }

    #[no_mangle]
    pub extern "C" fn TRITONBACKEND_ModelFinalize(
        model: *mut sys::TRITONBACKEND_Model,
    ) -> *mut sys::TRITONSERVER_Error {
        guard("TRITONBACKEND_ModelFinalize", || {
            lifecycle::model_finalize(model)
        })
    }

    #[no_mangle]
    pub extern "C" fn TRITONBACKEND_ModelInstanceInitialize(
        instance: *mut sys::TRITONBACKEND_ModelInstance,
    ) -> *mut sys::TRITONSERVER_Error {
        guard("TRITONBACKEND_ModelInstanceInitialize", || {
            lifecycle::instance_initialize(instance)
        })
    }

    #[no_mangle]
    pub extern "C" fn TRITONBACKEND_ModelInstanceFinalize(
        instance: *mut sys::TRITONBACKEND_ModelInstance,
    ) -> *mut sys::TRITONSERVER_Error {
        guard("TRITONBACKEND_ModelInstanceFinalize", || {
            lifecycle::instance_finalize(instance)
        })
    }

    #[no_mangle]
    pub extern "C" fn TRITONBACKEND_ModelInstanceExecute(
        instance: *mut sys::TRITONBACKEND_ModelInstance,
        requests: *mut *mut sys::TRITONBACKEND_Request,
        request_count: u32,
    ) -> *mut sys::TRITONSERVER_Error {
        guard("TRITONBACKEND_ModelInstanceExecute", || {
            execute::execute(instance, requests, request_count)
        })
    }
}

#[cfg(test)]
mod conventions {
    /// Every call into Triton's C API goes through `ffi_call!`, so the FFI surface is one grep and
    /// every returned error is checked: no `sys::TRITON...(` call outside it.
    #[test]
    fn every_c_call_goes_through_ffi_call() {
        let files = [
            ("lib.rs", include_str!("lib.rs")),
            ("execute.rs", include_str!("execute.rs")),
            ("lifecycle.rs", include_str!("lifecycle.rs")),
            ("statistics.rs", include_str!("statistics.rs")),
            ("metrics.rs", include_str!("metrics.rs")),
            ("triton.rs", include_str!("triton.rs")),
        ];
        let needle = ["sys", "::TRITON"].concat();
        for (file, text) in files {
            for (n, line) in text.lines().enumerate() {
                let mut rest = line;
                while let Some(at) = rest.find(&needle) {
                    let after = &rest[at + 5..];
                    let end = after
                        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                        .unwrap_or(after.len());
                    assert!(
                        !after[end..].starts_with('('),
                        "{file}:{}: a direct C call; use ffi_call!: {line}",
                        n + 1
                    );
                    rest = &after[end..];
                }
            }
        }
    }
}
