//! Execute: decode, score and answer one batch of requests, never handing back requests it owns.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use recsys_engine::Engine;
use recsys_ffi as sys;

use crate::decode::{self, DecodedRequest, RequestedOutputs};
use crate::error::{BackendError, Result};
use crate::lifecycle::InstanceState;
use crate::serve::{self, Answer};
use crate::settings::{IdTensorType, OUTPUT_EMBEDDING, OUTPUT_ITEM_IDS, OUTPUT_SCORES};
use crate::statistics::{now_ns, report_batch, report_request, Timestamps};
use crate::triton::{ffi_call, log, LogLevel, OutputType, Request, Response};

/// Only in test builds of the backend: a history holding this id makes Execute panic while it
/// scores the batch.
#[cfg(feature = "panic-trigger")]
pub const PANIC_TRIGGER_ID: i64 = -7_777_777_777;
/// Only in test builds of the backend: a history holding this id makes Execute panic while it
/// writes that request's outputs (after the first output tensor).
#[cfg(feature = "panic-trigger")]
pub const PANIC_IN_OUTPUT_TRIGGER_ID: i64 = -7_777_777_778;

/// Whether a request's history holds `id` (the test-only panic triggers).
#[cfg(feature = "panic-trigger")]
fn holds_id(decoded: &Result<DecodedRequest>, id: i64) -> bool {
    decoded.as_ref().is_ok_and(|d| {
        d.rows
            .iter()
            .any(|row| matches!(&row.history, decode::OwnedIds::Int(v) if v.contains(&id)))
    })
}

/// The text of a caught panic.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// What scoring one Execute batch produced.
struct ScoredBatch {
    answers: Vec<Result<Answer>>,
    engine_rows: usize,
    batch_size: u64,
    compute_start: u64,
    compute_end: u64,
    /// Per request: the test-only trigger for a panic in output writing.
    panic_in_output: Vec<bool>,
}

/// Decodes and scores every request of the batch on `engine` (the one in force when it started).
fn score_batch(state: &InstanceState, engine: &Engine, requests: &[Request]) -> ScoredBatch {
    let decoded: Vec<Result<DecodedRequest>> = requests
        .iter()
        .map(|r| {
            let outputs = r.requested_outputs()?;
            let inputs = r.inputs()?;
            decode::decode(
                &inputs,
                RequestedOutputs::from_names(&outputs),
                state.batched,
                &state.settings.limits,
            )
        })
        .collect();
    #[cfg(feature = "panic-trigger")]
    if decoded.iter().any(|d| holds_id(d, PANIC_TRIGGER_ID)) {
        panic!("test-only panic trigger");
    }
    #[cfg(feature = "panic-trigger")]
    let panic_in_output = decoded
        .iter()
        .map(|d| holds_id(d, PANIC_IN_OUTPUT_TRIGGER_ID))
        .collect();
    #[cfg(not(feature = "panic-trigger"))]
    let panic_in_output = vec![false; decoded.len()];
    let batch_size: u64 = decoded
        .iter()
        .map(|d| d.as_ref().map_or(1, |d| d.rows.len() as u64))
        .sum();
    let compute_start = now_ns();
    let (answers, summary) = serve::serve(
        engine,
        &state.settings.options(),
        decoded,
        match state.device.as_deref() {
            Some(device) => device,
            None => engine,
        },
    );
    ScoredBatch {
        answers,
        engine_rows: summary.engine_rows,
        batch_size,
        compute_start,
        compute_end: now_ns(),
        panic_in_output,
    }
}

/// Execute: create every response first; then decode, score and answer each request, reporting
/// errors per request; report statistics; release every request. Returns an error only if nothing
/// was taken over from Triton (the instance state is missing): once it owns the requests it never
/// fails and never unwinds, because Triton releases the requests of a failed Execute itself, and
/// ours are released by their wrappers. Every panic is caught where it happens (scoring the batch,
/// or writing one response), so every response is sent exactly once and statistics are reported.
pub(crate) fn execute(
    instance: *mut sys::TRITONBACKEND_ModelInstance,
    raw_requests: *mut *mut sys::TRITONBACKEND_Request,
    count: u32,
) -> Result<()> {
    let exec_start = now_ns();
    let mut raw_state = ptr::null_mut();
    // SAFETY: `instance` is live during Execute.
    unsafe { ffi_call!(TRITONBACKEND_ModelInstanceState(instance, &mut raw_state))? };
    if raw_state.is_null() {
        return Err(BackendError::Internal("the instance has no state".into()));
    }
    // SAFETY: set in instance_initialize and alive until instance_finalize, which Triton never runs
    // concurrently with Execute on the same instance.
    let state = unsafe { &*(raw_state as *const InstanceState) };
    let raw_requests = if count == 0 || raw_requests.is_null() {
        &[][..]
    } else {
        // SAFETY: Triton passes `count` request pointers, ours from here on.
        unsafe { std::slice::from_raw_parts(raw_requests, count as usize) }
    };
    // From here on every request is ours: the wrappers release each exactly once when dropped.
    // SAFETY: each pointer is a distinct live request, wrapped once.
    let requests: Vec<Request> = raw_requests
        .iter()
        .map(|&r| unsafe { Request::from_raw(r) })
        .collect();
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        answer_batch(instance, state, &requests, exec_start)
    }));
    if let Err(panic) = outcome {
        // answer_batch catches the panics of its parts; this is the last line of defence (a
        // response not yet sent is sent with an error by its wrapper's drop).
        log(
            LogLevel::Error,
            &format!(
                "recsys: instance {}: Execute failed: {}",
                state.name,
                panic_message(&*panic)
            ),
        );
    }
    drop(requests);
    Ok(())
}

/// Everything Execute does once it owns the requests.
fn answer_batch(
    instance: *mut sys::TRITONBACKEND_ModelInstance,
    state: &InstanceState,
    requests: &[Request],
    exec_start: u64,
) {
    let mut responses: Vec<Option<Response>> = requests
        .iter()
        .map(|r| match Response::new(r) {
            Ok(response) => Some(response),
            Err(e) => {
                log(
                    LogLevel::Error,
                    &format!(
                        "recsys: instance {}: cannot create a response: {e}",
                        state.name
                    ),
                );
                None
            }
        })
        .collect();

    // The engine in force now answers the whole batch, its ids mapped back by it too: a
    // catalogue swap lands between batches.
    let engine = state.engine.current();
    let scored = catch_unwind(AssertUnwindSafe(|| score_batch(state, &engine, requests)));
    let scored = match scored {
        Ok(scored) => scored,
        Err(panic) => {
            let error = BackendError::Internal(format!(
                "the recsys backend failed while executing this batch: {}",
                panic_message(&*panic)
            ));
            log(
                LogLevel::Error,
                &format!("recsys: instance {}: {error}", state.name),
            );
            let now = now_ns();
            ScoredBatch {
                answers: requests
                    .iter()
                    .map(|_| Err(BackendError::Internal(error.to_string())))
                    .collect(),
                engine_rows: 0,
                batch_size: requests.len() as u64,
                compute_start: now,
                compute_end: now,
                panic_in_output: vec![false; requests.len()],
            }
        }
    };

    let (mut unknown, mut truncated, mut invalid) = (0, 0, 0);
    let mut survivors = Vec::new();
    let mut successes = Vec::with_capacity(requests.len());
    for ((slot, answer), panic_in_output) in responses
        .iter_mut()
        .zip(scored.answers)
        .zip(scored.panic_in_output)
    {
        let Some(mut response) = slot.take() else {
            successes.push(false);
            invalid += 1;
            continue;
        };
        let result = match answer {
            Ok(answer) => {
                unknown += answer.unknown_ids;
                truncated += answer.truncated;
                survivors.extend_from_slice(&answer.screen_survivors);
                // Writing outputs maps indices to ids and copies into Triton's buffers: a panic
                // there fails this response alone, which is still sent (below) exactly once.
                catch_unwind(AssertUnwindSafe(|| {
                    write_outputs(&mut response, state, &engine, &answer, panic_in_output)
                }))
                .unwrap_or_else(|panic| {
                    Err(BackendError::Internal(format!(
                        "the recsys backend failed while writing this response: {}",
                        panic_message(&*panic)
                    )))
                })
            }
            Err(e) => Err(e),
        };
        let success = match result {
            Ok(()) => {
                response.send(None);
                true
            }
            Err(e) => {
                if matches!(e, BackendError::Internal(_)) {
                    log(
                        LogLevel::Error,
                        &format!("recsys: instance {}: {e}", state.name),
                    );
                }
                response.send(Some(&e));
                false
            }
        };
        invalid += usize::from(!success);
        successes.push(success);
    }
    let times = Timestamps {
        exec_start,
        compute_start: scored.compute_start,
        compute_end: scored.compute_end,
        exec_end: now_ns(),
    };
    for (request, success) in requests.iter().zip(successes) {
        report_request(instance, request, success, &times);
    }
    report_batch(instance, scored.batch_size, &times);
    if let Some(metrics) = &state.metrics {
        metrics.record_batch(scored.engine_rows, unknown, truncated, invalid, &survivors);
        if let Some(cache) = engine.prefix_cache() {
            metrics.record_prefix_cache(cache.stats());
        }
    }
}

fn write_outputs(
    response: &mut Response,
    state: &InstanceState,
    engine: &Engine,
    answer: &Answer,
    panic_in_output: bool,
) -> Result<()> {
    let encoded = decode::encode(
        &answer.rows,
        engine,
        state.settings.output_ids_type,
        state.batched,
    )?;
    let ids_type = match encoded.ids_type {
        IdTensorType::Int64 => OutputType::Int64,
        IdTensorType::String => OutputType::Bytes,
    };
    // Only the outputs the client asked for (Triton lists all of them when it named none).
    let wanted = answer.outputs;
    if wanted.item_ids {
        response.add_output(OUTPUT_ITEM_IDS, ids_type, &encoded.shape, &encoded.ids)?;
    }
    #[cfg(feature = "panic-trigger")]
    if panic_in_output {
        panic!("test-only panic trigger in output writing");
    }
    #[cfg(not(feature = "panic-trigger"))]
    let _ = panic_in_output;
    if wanted.scores {
        response.add_output(
            OUTPUT_SCORES,
            OutputType::Fp32,
            &encoded.shape,
            &encoded.scores,
        )?;
    }
    if wanted.embedding {
        let (shape, bytes) = decode::encode_embeddings(&answer.embeddings, state.batched)?;
        response.add_output(OUTPUT_EMBEDDING, OutputType::Fp32, &shape, &bytes)?;
    }
    // Counted for the client too, so it can tell a cold-start answer from a personalised one.
    response.set_int_parameter("unknown_item_count", answer.unknown_ids as i64)?;
    response.set_int_parameter("truncated_histories", answer.truncated as i64)?;
    if answer.unknown_candidates > 0 {
        response.set_int_parameter("unknown_candidate_count", answer.unknown_candidates as i64)?;
    }
    // Histories the popularity list answered (empty_history_policy), not the model.
    response.set_int_parameter("popular_answers", answer.popular as i64)?;
    // The live availability the answer was filtered by (0: the model names a source, and no
    // object from it is in force yet).
    if let Some(version) =
        answer
            .availability_version
            .or(state.settings.availability.as_ref().map(|_| 0))
    {
        response.set_int_parameter("availability_version", version as i64)?;
    }
    // The catalogue delta the answer was scored with (0: the model names a source, and no
    // object from it is in force yet).
    if state.settings.catalogue.is_some() {
        let version = engine.catalogue().map_or(0, |c| c.version);
        response.set_int_parameter("catalogue_version", version as i64)?;
    }
    Ok(())
}
