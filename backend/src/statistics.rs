//! Execute's statistics for Triton: per-request and per-batch timestamps on the clock Triton uses.

use recsys_ffi as sys;

use crate::triton::{ffi_call, log, LogLevel, Request};

/// Nanoseconds on CLOCK_MONOTONIC, the clock Triton stamps requests with (C++ steady_clock), so
/// the queue and compute times it derives from our timestamps are meaningful.
pub(crate) fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    if rc != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The four timestamps Triton takes for a request or a batch (nanoseconds, [`now_ns`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Timestamps {
    pub exec_start: u64,
    pub compute_start: u64,
    pub compute_end: u64,
    pub exec_end: u64,
}

/// Reports one request's outcome and times; a failure to report is logged, never raised.
pub(crate) fn report_request(
    instance: *mut sys::TRITONBACKEND_ModelInstance,
    request: &Request,
    success: bool,
    t: &Timestamps,
) {
    // SAFETY: the instance and the request are live (the request is released later, on drop).
    if let Err(e) = unsafe {
        ffi_call!(TRITONBACKEND_ModelInstanceReportStatistics(
            instance,
            request.raw(),
            success,
            t.exec_start,
            t.compute_start,
            t.compute_end,
            t.exec_end
        ))
    } {
        log(
            LogLevel::Error,
            &format!("recsys: cannot report request statistics: {e}"),
        );
    }
}

/// Reports one batch (its size in engine rows) and its times; a failure is logged.
pub(crate) fn report_batch(
    instance: *mut sys::TRITONBACKEND_ModelInstance,
    batch_size: u64,
    t: &Timestamps,
) {
    // SAFETY: `instance` is live during Execute.
    if let Err(e) = unsafe {
        ffi_call!(TRITONBACKEND_ModelInstanceReportBatchStatistics(
            instance,
            batch_size,
            t.exec_start,
            t.compute_start,
            t.compute_end,
            t.exec_end
        ))
    } {
        log(
            LogLevel::Error,
            &format!("recsys: cannot report batch statistics: {e}"),
        );
    }
}
