//! What each Triton entry point does: backend, model and instance lifecycle, and Execute.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::ptr;
use std::sync::Arc;

use recsys_engine::Engine;
use recsys_ffi as sys;

use crate::decode::{self, DecodedRequest};
use crate::error::{BackendError, Result};
use crate::metrics::{self, ModelMetrics};
use crate::serve::{self, Answer};
use crate::settings::{self, IdTensorType, ModelSettings, OUTPUT_ITEM_IDS, OUTPUT_SCORES};
use crate::triton::{borrowed_str, ffi_call, log, LogLevel, OutputType, Request, Response};

pub(crate) fn initialize(backend: *mut sys::TRITONBACKEND_Backend) -> Result<()> {
    let (mut major, mut minor) = (0u32, 0u32);
    // SAFETY: valid out-pointers.
    unsafe { ffi_call!(TRITONBACKEND_ApiVersion(&mut major, &mut minor))? };
    if major != sys::TRITONBACKEND_API_VERSION_MAJOR || minor < sys::TRITONBACKEND_API_VERSION_MINOR
    {
        return Err(BackendError::Unsupported(format!(
            "the recsys backend needs Triton backend API {}.{} or a later 1.x; this server has {major}.{minor}",
            sys::TRITONBACKEND_API_VERSION_MAJOR,
            sys::TRITONBACKEND_API_VERSION_MINOR
        )));
    }
    let mut name = ptr::null();
    // SAFETY: `backend` is live during Initialize; the name is owned by Triton.
    unsafe { ffi_call!(TRITONBACKEND_BackendName(backend, &mut name))? };
    // SAFETY: Triton owns the name for the backend's lifetime.
    let name = unsafe { borrowed_str(name) };
    metrics::init_families();
    log(
        LogLevel::Info,
        &format!(
            "recsys backend {} ({name}) initialised on Triton backend API {major}.{minor}",
            env!("CARGO_PKG_VERSION")
        ),
    );
    Ok(())
}

pub(crate) fn finalize() -> Result<()> {
    metrics::finalize_families();
    Ok(())
}

/// State of one model version, shared by its instances.
pub(crate) struct ModelState {
    name: String,
    version: u64,
    engine: Arc<Engine>,
    settings: ModelSettings,
    metrics: Option<Arc<ModelMetrics>>,
}

pub(crate) fn model_initialize(model: *mut sys::TRITONBACKEND_Model) -> Result<()> {
    let (mut name, mut version) = (ptr::null(), 0u64);
    let (mut artifact, mut location) = (0, ptr::null());
    // SAFETY: `model` is live during ModelInitialize; out-pointers are valid locals.
    unsafe {
        ffi_call!(TRITONBACKEND_ModelName(model, &mut name))?;
        ffi_call!(TRITONBACKEND_ModelVersion(model, &mut version))?;
        ffi_call!(TRITONBACKEND_ModelRepository(
            model,
            &mut artifact,
            &mut location
        ))?;
    }
    // SAFETY: Triton owns both strings for the model's lifetime.
    let (name, location) = unsafe { (borrowed_str(name), borrowed_str(location)) };
    if artifact != sys::TRITONBACKEND_ARTIFACT_FILESYSTEM {
        return Err(BackendError::Unsupported(format!(
            "model {name}: only file-system model repositories are supported"
        )));
    }
    let engine_dir = PathBuf::from(&location).join(version.to_string());
    let mut config = crate::triton::model_config(model)?;
    let max_engine_bytes = settings::max_engine_bytes(&config).map_err(|e| {
        BackendError::InvalidConfig(format!(
            "model '{name}' version {version}: {}",
            e.full_message()
        ))
    })?;
    let engine = Engine::load_limited(&engine_dir, max_engine_bytes).map_err(|source| {
        let hint = match source {
            recsys_engine::EngineError::NotFound { .. } => format!(
                " (write the engine there with `recsys convert --out {}`)",
                engine_dir.display()
            ),
            _ => String::new(),
        };
        BackendError::Load {
            what: format!(
                "model '{name}' version {version} from {}{hint}",
                engine_dir.display()
            ),
            source: Box::new(source),
        }
    })?;

    let mut auto_complete = false;
    // SAFETY: valid out-pointer; `model` is live.
    unsafe {
        ffi_call!(TRITONBACKEND_ModelAutoCompleteConfig(
            model,
            &mut auto_complete
        ))?
    };
    if auto_complete && settings::auto_complete(&mut config, engine.manifest.id_type) {
        crate::triton::set_model_config(model, &config)?;
        log(
            LogLevel::Info,
            &format!("recsys: model {name}: filled in the config from the engine"),
        );
    }
    let settings = settings::parse(&config, &engine).map_err(|e| {
        BackendError::InvalidConfig(format!(
            "model '{name}' version {version}: {}",
            e.full_message()
        ))
    })?;
    let metrics = ModelMetrics::new(&name, version).map(Arc::new);
    let mut engine = engine;
    engine.set_threads(settings.threads);
    log(
        LogLevel::Info,
        &format!(
            "recsys: loaded model {name} version {version}: {} engine, {} items, precision {:?}, {} kernels, {} scoring thread(s), top_k {}",
            engine.kind(),
            engine.n_items(),
            engine.manifest.precision,
            engine.scorer.kernels.isa.name(),
            engine.scorer.threads,
            settings.default_k
        ),
    );
    let state = Box::new(ModelState {
        name,
        version,
        engine: Arc::new(engine),
        settings,
        metrics,
    });
    let raw = Box::into_raw(state);
    // SAFETY: ownership of the box passes to Triton until ModelFinalize takes it back.
    if let Err(e) = unsafe { ffi_call!(TRITONBACKEND_ModelSetState(model, raw as *mut c_void)) } {
        // SAFETY: Triton did not take the pointer; reclaim it so it is freed.
        drop(unsafe { Box::from_raw(raw) });
        return Err(e);
    }
    Ok(())
}

pub(crate) fn model_finalize(model: *mut sys::TRITONBACKEND_Model) -> Result<()> {
    let mut raw = ptr::null_mut();
    // SAFETY: `model` is live; the state was set in ModelInitialize.
    unsafe { ffi_call!(TRITONBACKEND_ModelState(model, &mut raw))? };
    if !raw.is_null() {
        // SAFETY: the pointer came from Box::into_raw in model_initialize and is reclaimed once here.
        let state = unsafe { Box::from_raw(raw as *mut ModelState) };
        log(
            LogLevel::Info,
            &format!(
                "recsys: unloaded model {} version {}",
                state.name, state.version
            ),
        );
    }
    Ok(())
}

/// State of one model instance: its own handle on the shared (memory-mapped) engine.
pub(crate) struct InstanceState {
    name: String,
    engine: Arc<Engine>,
    settings: ModelSettings,
    metrics: Option<Arc<ModelMetrics>>,
    batched: bool,
    /// The whole model on this instance's GPU (KIND_GPU); `None` runs it on the CPU.
    device: Option<Arc<dyn recsys_engine::BatchRecommender>>,
}

pub(crate) fn instance_initialize(instance: *mut sys::TRITONBACKEND_ModelInstance) -> Result<()> {
    let (mut name, mut kind, mut device, mut model) = (ptr::null(), 0, 0i32, ptr::null_mut());
    // SAFETY: `instance` is live during ModelInstanceInitialize; out-pointers are valid locals.
    unsafe {
        ffi_call!(TRITONBACKEND_ModelInstanceName(instance, &mut name))?;
        ffi_call!(TRITONBACKEND_ModelInstanceKind(instance, &mut kind))?;
        ffi_call!(TRITONBACKEND_ModelInstanceDeviceId(instance, &mut device))?;
        ffi_call!(TRITONBACKEND_ModelInstanceModel(instance, &mut model))?;
    }
    // SAFETY: owned by Triton for the instance's lifetime.
    let name = unsafe { borrowed_str(name) };
    let mut raw = ptr::null_mut();
    // SAFETY: the model outlives its instances; its state is the ModelState set at initialisation.
    unsafe { ffi_call!(TRITONBACKEND_ModelState(model, &mut raw))? };
    if raw.is_null() {
        return Err(BackendError::Internal(format!(
            "instance {name}: the model has no state"
        )));
    }
    // SAFETY: see above; only shared access is taken, and ModelFinalize runs after every instance's.
    let model_state = unsafe { &*(raw as *const ModelState) };
    let device = if kind == sys::TRITONSERVER_INSTANCEGROUPKIND_GPU {
        let (on_device, device_name) = crate::device_choice::gpu_recommender(
            &name,
            device,
            &model_state.engine,
            model_state.settings.limits.max_k,
        )?;
        log(
            LogLevel::Info,
            &format!(
                "recsys: instance {name}: whole model on {device_name} (CUDA encoder and fused score + top-k)"
            ),
        );
        Some(on_device)
    } else {
        None
    };
    let state = Box::new(InstanceState {
        device,
        name,
        engine: Arc::clone(&model_state.engine),
        settings: model_state.settings.clone(),
        metrics: model_state.metrics.clone(),
        batched: model_state.settings.max_batch_size > 0,
    });
    let raw = Box::into_raw(state);
    // SAFETY: ownership passes to Triton until ModelInstanceFinalize.
    if let Err(e) = unsafe {
        ffi_call!(TRITONBACKEND_ModelInstanceSetState(
            instance,
            raw as *mut c_void
        ))
    } {
        // SAFETY: not taken by Triton; reclaim.
        drop(unsafe { Box::from_raw(raw) });
        return Err(e);
    }
    Ok(())
}

pub(crate) fn instance_finalize(instance: *mut sys::TRITONBACKEND_ModelInstance) -> Result<()> {
    let mut raw = ptr::null_mut();
    // SAFETY: `instance` is live.
    unsafe { ffi_call!(TRITONBACKEND_ModelInstanceState(instance, &mut raw))? };
    if !raw.is_null() {
        // SAFETY: from Box::into_raw in instance_initialize; reclaimed once.
        drop(unsafe { Box::from_raw(raw as *mut InstanceState) });
    }
    Ok(())
}

/// Nanoseconds on CLOCK_MONOTONIC, the clock Triton stamps requests with (C++ steady_clock), so
/// the queue and compute times it derives from our timestamps are meaningful.
fn now_ns() -> u64 {
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

/// Decodes and scores every request of the batch.
fn score_batch(state: &InstanceState, requests: &[Request]) -> ScoredBatch {
    let decoded: Vec<Result<DecodedRequest>> = requests
        .iter()
        .map(|r| {
            r.inputs()
                .and_then(|inputs| decode::decode(&inputs, state.batched, &state.settings.limits))
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
        &state.engine,
        &state.settings.options(),
        decoded,
        match state.device.as_deref() {
            Some(device) => device,
            None => &*state.engine,
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

    let scored = catch_unwind(AssertUnwindSafe(|| score_batch(state, requests)));
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
                // Writing outputs maps indices to ids and copies into Triton's buffers: a panic
                // there fails this response alone, which is still sent (below) exactly once.
                catch_unwind(AssertUnwindSafe(|| {
                    write_outputs(&mut response, state, &answer, panic_in_output)
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
    let exec_end = now_ns();
    for (request, success) in requests.iter().zip(successes) {
        report_request(
            instance,
            request,
            success,
            exec_start,
            scored.compute_start,
            scored.compute_end,
            exec_end,
        );
    }
    // SAFETY: `instance` is live during Execute.
    if let Err(e) = unsafe {
        ffi_call!(TRITONBACKEND_ModelInstanceReportBatchStatistics(
            instance,
            scored.batch_size,
            exec_start,
            scored.compute_start,
            scored.compute_end,
            exec_end
        ))
    } {
        log(
            LogLevel::Error,
            &format!("recsys: cannot report batch statistics: {e}"),
        );
    }
    if let Some(metrics) = &state.metrics {
        metrics.record_batch(scored.engine_rows, unknown, truncated, invalid);
    }
}

fn report_request(
    instance: *mut sys::TRITONBACKEND_ModelInstance,
    request: &Request,
    success: bool,
    exec_start: u64,
    compute_start: u64,
    compute_end: u64,
    exec_end: u64,
) {
    // SAFETY: the instance and the request are live (the request is released later, on drop).
    if let Err(e) = unsafe {
        ffi_call!(TRITONBACKEND_ModelInstanceReportStatistics(
            instance,
            request.raw(),
            success,
            exec_start,
            compute_start,
            compute_end,
            exec_end
        ))
    } {
        log(
            LogLevel::Error,
            &format!("recsys: cannot report request statistics: {e}"),
        );
    }
}

fn write_outputs(
    response: &mut Response,
    state: &InstanceState,
    answer: &Answer,
    panic_in_output: bool,
) -> Result<()> {
    let encoded = decode::encode(
        &answer.rows,
        &state.engine,
        state.settings.output_ids_type,
        state.batched,
    )?;
    let ids_type = match encoded.ids_type {
        IdTensorType::Int64 => OutputType::Int64,
        IdTensorType::String => OutputType::Bytes,
    };
    response.add_output(OUTPUT_ITEM_IDS, ids_type, &encoded.shape, &encoded.ids)?;
    #[cfg(feature = "panic-trigger")]
    if panic_in_output {
        panic!("test-only panic trigger in output writing");
    }
    #[cfg(not(feature = "panic-trigger"))]
    let _ = panic_in_output;
    response.add_output(
        OUTPUT_SCORES,
        OutputType::Fp32,
        &encoded.shape,
        &encoded.scores,
    )?;
    // Counted for the client too, so it can tell a cold-start answer from a personalised one.
    response.set_int_parameter("unknown_item_count", answer.unknown_ids as i64)?;
    response.set_int_parameter("truncated_histories", answer.truncated as i64)?;
    Ok(())
}
