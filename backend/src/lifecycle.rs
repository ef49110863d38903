//! What the lifecycle entry points do: backend, model and instance initialisation and finalisation,
//! and the model and instance state they leave for Execute (`execute.rs`).

use std::ffi::c_void;
use std::path::PathBuf;
use std::ptr;
use std::sync::Arc;

use recsys_engine::Engine;

use crate::live_engine::LiveEngine;
use recsys_ffi as sys;

use crate::error::{BackendError, Result};
use crate::metrics::{self, ModelMetrics};
use crate::settings::{self, ModelSettings};
use crate::triton::{borrowed_str, ffi_call, log, LogLevel};

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
    engine: Arc<LiveEngine>,
    settings: ModelSettings,
    metrics: Option<Arc<ModelMetrics>>,
    /// Polls the model's catalogue source (parameter `catalogue_source`); stopped when the state
    /// is dropped, before the availability poller.
    _catalogue: Option<crate::poller::Poller>,
    /// Polls the model's availability source (parameter `availability_source`); stopped when the
    /// state is dropped.
    _availability: Option<crate::poller::Poller>,
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
    if auto_complete && settings::auto_complete(&mut config, &engine) {
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
    if let Some(plan) = engine.plan_screen(settings.screen_policy) {
        log(
            LogLevel::Info,
            &format!(
                "recsys: model {name} version {version}: screen plan: {}",
                plan.describe()
            ),
        );
    }
    if let Some(plan) = engine.plan_bf16_path(settings.bf16_path) {
        log(
            LogLevel::Info,
            &format!(
                "recsys: model {name} version {version}: kernel plan: {}",
                plan.describe()
            ),
        );
    }
    if let Some(plan) = engine.plan_row_block(settings.row_block) {
        log(
            LogLevel::Info,
            &format!(
                "recsys: model {name} version {version}: row-block plan: {}",
                plan.describe()
            ),
        );
    }
    match engine.plan_amx(settings.amx) {
        Ok(Some(plan)) => log(
            LogLevel::Info,
            &format!(
                "recsys: model {name} version {version}: AMX plan: {}",
                plan.describe()
            ),
        ),
        Ok(None) => {}
        Err(why) => log(
            LogLevel::Info,
            &format!(
                "recsys: model {name} version {version}: AMX tiles not used (the SIMD tables \
                 run): {why}"
            ),
        ),
    }
    // Last: it times whole calls with the kernels the plans above chose.
    if let Some(plan) = engine.plan_threads(settings.thread_plan) {
        log(
            LogLevel::Info,
            &format!(
                "recsys: model {name} version {version}: thread plan: {}",
                plan.describe()
            ),
        );
    }
    if let Some((bytes, idle)) = settings.prefix_cache {
        engine
            .set_prefix_cache(Some(recsys_engine::prefix_cache::PrefixCache::new(
                bytes, idle,
            )))
            .map_err(|e| {
                BackendError::InvalidConfig(format!("model '{name}' version {version}: {e}"))
            })?;
        log(
            LogLevel::Info,
            &format!(
                "recsys: model {name} version {version}: prefix cache of {} MiB (idle expiry {}): \
                 a history one event longer than a cached one computes one event",
                bytes >> 20,
                idle.map_or("none".to_string(), |d| format!("{} s", d.as_secs()))
            ),
        );
    }
    if engine.manifest.precision == recsys_engine::engine_dir::Precision::Bf16
        && !engine.scorer.kernels.isa.has_native_bf16()
    {
        // The same answers, computed by widening to f32: say so, since the engine is then no
        // faster than fp16.
        log(
            LogLevel::Info,
            &format!(
                "recsys: model {name} version {version} is bf16 and this CPU has no AVX512-BF16 \
                 ({} kernels): its bf16 layers are computed widened to f32, with the same answers \
                 and without bf16's doubled multiply-add rate",
                engine.scorer.kernels.isa.name()
            ),
        );
    }
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
    let engine = Arc::new(LiveEngine::new(engine));
    let model_dir = std::path::Path::new(&location);
    // The catalogue first: the availability object is then mapped onto the catalogue in force.
    let catalogue = match &settings.catalogue {
        None => None,
        Some(wanted) => {
            let source =
                recsys_registry::catalogue::CatalogueSource::open(&wanted.source, model_dir)
                    .map_err(|e| {
                        BackendError::InvalidConfig(format!(
                            "model '{name}' version {version}: {e}"
                        ))
                    })?;
            let max_bytes = wanted.max_bytes.unwrap_or_else(|| {
                recsys_registry::catalogue::default_max_bytes(&engine.current())
            });
            log(
                LogLevel::Info,
                &format!(
                    "recsys: model {name} version {version}: catalogue from {} ({}, objects up to \
                     {max_bytes} bytes)",
                    source.describe(),
                    poll_text(wanted.poll)
                ),
            );
            let mut tracker = crate::catalogue::Tracker::new(&name, source, max_bytes);
            let (live, metrics) = (Arc::clone(&engine), metrics.clone());
            let mut last_problem = None;
            Some(crate::poller::Poller::start(
                name.clone(),
                "catalogue",
                wanted.poll,
                move || {
                    crate::poller::poll_catalogue_and_report(
                        &mut tracker,
                        &live,
                        metrics.as_deref(),
                        &mut last_problem,
                    )
                },
            ))
        }
    };
    let availability = match &settings.availability {
        None => None,
        Some(wanted) => {
            let source =
                recsys_registry::availability::AvailabilitySource::open(&wanted.source, model_dir)
                    .map_err(|e| {
                        BackendError::InvalidConfig(format!(
                            "model '{name}' version {version}: {e}"
                        ))
                    })?;
            let max_bytes = wanted.max_bytes.unwrap_or_else(|| {
                recsys_engine::default_max_availability_bytes(engine.current().ids.len())
            });
            log(
                LogLevel::Info,
                &format!(
                    "recsys: model {name} version {version}: availability from {} ({}, objects \
                     up to {max_bytes} bytes)",
                    source.describe(),
                    poll_text(wanted.poll)
                ),
            );
            let mut tracker = crate::availability::Tracker::new(&name, source, max_bytes);
            let (live, metrics) = (Arc::clone(&engine), metrics.clone());
            let mut last_problem = None;
            Some(crate::poller::Poller::start(
                name.clone(),
                "availability",
                wanted.poll,
                move || {
                    crate::poller::poll_and_report(
                        &mut tracker,
                        &live,
                        metrics.as_deref(),
                        &mut last_problem,
                    )
                },
            ))
        }
    };
    let state = Box::new(ModelState {
        name,
        version,
        engine,
        settings,
        metrics,
        _catalogue: catalogue,
        _availability: availability,
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

/// How often a live object is read, as log lines say it.
fn poll_text(poll: Option<std::time::Duration>) -> String {
    poll.map_or("read at load only".to_string(), |p| {
        format!("checked every {:.1} s", p.as_secs_f64())
    })
}

/// State of one model instance: its own handle on the shared (memory-mapped) engine in force.
pub(crate) struct InstanceState {
    pub(crate) name: String,
    pub(crate) engine: Arc<LiveEngine>,
    pub(crate) settings: ModelSettings,
    pub(crate) metrics: Option<Arc<ModelMetrics>>,
    pub(crate) batched: bool,
    /// The whole model on this instance's GPU (KIND_GPU); `None` runs it on the CPU.
    pub(crate) device: Option<Arc<dyn recsys_engine::BatchRecommender>>,
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
        if model_state.settings.catalogue.is_some() {
            // The device holds the engine's tables as loaded; a catalogue swap replaces the CPU
            // engine only.
            return Err(BackendError::InvalidConfig(format!(
                "instance {name}: parameter catalogue_source is served by KIND_CPU instances; a \
                 KIND_GPU instance copies the engine's item tables to the device once, at load"
            )));
        }
        let (on_device, device_name) = crate::device_choice::gpu_recommender(
            &name,
            device,
            &model_state.engine.current(),
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
