//! Custom Prometheus metrics, published on Triton's own metrics endpoint through its metrics API.
//!
//! The families are process-wide (created in TRITONBACKEND_Initialize, deleted in Finalize); each
//! model version gets its own labelled metrics. Metrics are best effort: if the server runs with
//! metrics disabled, creation fails, a warning is logged, and serving is unaffected.

use std::ptr;
use std::sync::Mutex;

use recsys_ffi as sys;

use crate::error::Result;
use crate::triton::{c_string, ffi_call, log, LogLevel};

struct Family(*mut sys::TRITONSERVER_MetricFamily);

// SAFETY: a metric family is an immutable server object that Triton allows to be used from any
// thread; the pointer is only deleted in `finalize_families`, after every model is finalized.
unsafe impl Send for Family {}

struct Families {
    unknown_ids: Family,
    truncated: Family,
    invalid_requests: Family,
    batch_size: Family,
    screen_survivors: Family,
    availability_version: Family,
    availability_age: Family,
    availability_refused: Family,
    catalogue_version: Family,
    catalogue_delta_items: Family,
    catalogue_refused: Family,
    prefix_hits: Family,
    prefix_misses: Family,
    prefix_computed: Family,
    prefix_reused: Family,
    prefix_evictions: Family,
    prefix_bytes: Family,
}

static FAMILIES: Mutex<Option<Families>> = Mutex::new(None);

fn family(kind: sys::TRITONSERVER_MetricKind, name: &str, help: &str) -> Result<Family> {
    let (name, help) = (c_string(name), c_string(help));
    let mut raw = ptr::null_mut();
    // SAFETY: valid strings, copied by Triton; `raw` is a valid out-pointer.
    unsafe {
        ffi_call!(TRITONSERVER_MetricFamilyNew(
            &mut raw,
            kind,
            name.as_ptr(),
            help.as_ptr()
        ))?
    };
    Ok(Family(raw))
}

fn make_families() -> Result<Families> {
    Ok(Families {
            unknown_ids: family(
                sys::TRITONSERVER_METRIC_KIND_COUNTER,
                "recsys_unknown_item_ids_total",
                "History item ids not in the model's catalogue (dropped, or refused under unknown_item_policy=error)",
            )?,
            truncated: family(
                sys::TRITONSERVER_METRIC_KIND_COUNTER,
                "recsys_histories_truncated_total",
                "Histories longer than the model's window whose oldest items were left out",
            )?,
            invalid_requests: family(
                sys::TRITONSERVER_METRIC_KIND_COUNTER,
                "recsys_invalid_requests_total",
                "Requests answered with an error by the recsys backend",
            )?,
            batch_size: family(
                sys::TRITONSERVER_METRIC_KIND_HISTOGRAM,
                "recsys_engine_batch_size",
                "Histories scored together in one engine batch",
            )?,
            screen_survivors: family(
                sys::TRITONSERVER_METRIC_KIND_HISTOGRAM,
                "recsys_screen_survivors",
                "Items the int8 screen kept (and rescored exactly) per whole-catalogue history, for engines converted with --screen int8",
            )?,
            availability_version: family(
                sys::TRITONSERVER_METRIC_KIND_GAUGE,
                "recsys_availability_version",
                "Version of the live availability object in force (0: none yet), for models with an availability_source",
            )?,
            availability_age: family(
                sys::TRITONSERVER_METRIC_KIND_GAUGE,
                "recsys_availability_age_seconds",
                "Seconds since the availability object in force was published, as of the last poll of its source",
            )?,
            availability_refused: family(
                sys::TRITONSERVER_METRIC_KIND_COUNTER,
                "recsys_availability_refused_total",
                "Availability objects read from the source and refused (truncated, malformed, older than the one in force, or of another catalogue); the one in force stays",
            )?,
            catalogue_version: family(
                sys::TRITONSERVER_METRIC_KIND_GAUGE,
                "recsys_catalogue_version",
                "Version of the live catalogue delta in force (0: the catalogue as converted), for models with a catalogue_source",
            )?,
            catalogue_delta_items: family(
                sys::TRITONSERVER_METRIC_KIND_GAUGE,
                "recsys_catalogue_delta_items",
                "Items the catalogue delta in force adds, replaces or retires (0: none in force)",
            )?,
            catalogue_refused: family(
                sys::TRITONSERVER_METRIC_KIND_COUNTER,
                "recsys_catalogue_refused_total",
                "Catalogue objects read from the source and refused (truncated, damaged, over catalogue_max_bytes, made for another engine version, not newer than the one in force, or a row that cannot apply); the one in force stays",
            )?,
            prefix_hits: family(
                sys::TRITONSERVER_METRIC_KIND_COUNTER,
                "recsys_prefix_cache_hits_total",
                "Histories that resumed from a cached prefix (prefix_cache_bytes)",
            )?,
            prefix_misses: family(
                sys::TRITONSERVER_METRIC_KIND_COUNTER,
                "recsys_prefix_cache_misses_total",
                "Histories within the model's window with no cached prefix (computed whole)",
            )?,
            prefix_computed: family(
                sys::TRITONSERVER_METRIC_KIND_COUNTER,
                "recsys_prefix_cache_events_computed_total",
                "History events the model computed, for models with a prefix cache",
            )?,
            prefix_reused: family(
                sys::TRITONSERVER_METRIC_KIND_COUNTER,
                "recsys_prefix_cache_events_reused_total",
                "History events whose work a cached prefix saved",
            )?,
            prefix_evictions: family(
                sys::TRITONSERVER_METRIC_KIND_COUNTER,
                "recsys_prefix_cache_evictions_total",
                "Prefix cache entries dropped to stay within prefix_cache_bytes, or idle past prefix_cache_idle_seconds",
            )?,
            prefix_bytes: family(
                sys::TRITONSERVER_METRIC_KIND_GAUGE,
                "recsys_prefix_cache_bytes",
                "Bytes the prefix cache holds (at most prefix_cache_bytes)",
            )?,
        })
}

pub(crate) fn init_families() {
    match make_families() {
        Ok(families) => *FAMILIES.lock().unwrap_or_else(|p| p.into_inner()) = Some(families),
        Err(e) => log(
            LogLevel::Warn,
            &format!("recsys: custom metrics are off: {e}"),
        ),
    }
}

pub(crate) fn finalize_families() {
    if let Some(families) = FAMILIES.lock().unwrap_or_else(|p| p.into_inner()).take() {
        for f in [
            families.unknown_ids,
            families.truncated,
            families.invalid_requests,
            families.batch_size,
            families.screen_survivors,
            families.availability_version,
            families.availability_age,
            families.availability_refused,
            families.catalogue_version,
            families.catalogue_delta_items,
            families.catalogue_refused,
            families.prefix_hits,
            families.prefix_misses,
            families.prefix_computed,
            families.prefix_reused,
            families.prefix_evictions,
            families.prefix_bytes,
        ] {
            // SAFETY: every metric of the family was deleted with its model; the family is deleted once.
            let _ = unsafe { ffi_call!(TRITONSERVER_MetricFamilyDelete(f.0)) };
        }
    }
}

struct Metric(*mut sys::TRITONSERVER_Metric);

// SAFETY: Triton's metric objects are internally synchronised (prometheus-cpp); increments and
// observations may come from several model instances at once.
unsafe impl Send for Metric {}
// SAFETY: as for Send: shared references only ever increment or observe, which Triton synchronises.
unsafe impl Sync for Metric {}

impl Drop for Metric {
    fn drop(&mut self) {
        // SAFETY: created by MetricNew(WithArgs) and deleted exactly once, before its family.
        let _ = unsafe { ffi_call!(TRITONSERVER_MetricDelete(self.0)) };
    }
}

/// Upper bounds of the engine batch size histogram.
const BATCH_BUCKETS: [f64; 9] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];
/// Upper bounds of the screen survivors histogram: from k-sized survivor sets (the screen at its
/// best) to whole catalogues (all scores equal: every item survives).
const SURVIVOR_BUCKETS: [f64; 13] = [
    10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1e3, 2e3, 5e3, 1e4, 1e5, 1e6, 1e7,
];

/// The metrics of one model version.
pub(crate) struct ModelMetrics {
    unknown_ids: Metric,
    truncated: Metric,
    invalid_requests: Metric,
    batch_size: Metric,
    screen_survivors: Metric,
    availability_version: Metric,
    availability_age: Metric,
    availability_refused: Metric,
    catalogue_version: Metric,
    catalogue_delta_items: Metric,
    catalogue_refused: Metric,
    prefix_hits: Metric,
    prefix_misses: Metric,
    prefix_computed: Metric,
    prefix_reused: Metric,
    prefix_evictions: Metric,
    prefix_bytes: Metric,
    /// The prefix cache's counters as last reported: each batch increments Triton's counters by
    /// what changed since (the instances of a model share the cache and these metrics).
    prefix_reported: std::sync::Mutex<recsys_engine::prefix_cache::PrefixCacheStats>,
}

impl ModelMetrics {
    /// `None` when metrics are off (families missing or the server refused).
    pub(crate) fn new(model: &str, version: u64) -> Option<ModelMetrics> {
        let guard = FAMILIES.lock().unwrap_or_else(|p| p.into_inner());
        let families = guard.as_ref()?;
        match Self::create(families, model, version) {
            Ok(m) => Some(m),
            Err(e) => {
                log(
                    LogLevel::Warn,
                    &format!("recsys: metrics for model {model} are off: {e}"),
                );
                None
            }
        }
    }

    fn create(families: &Families, model: &str, version: u64) -> Result<ModelMetrics> {
        {
            let (k_model, v_model) = (c_string("model"), c_string(model));
            let (k_version, v_version) = (c_string("version"), c_string(&version.to_string()));
            // SAFETY: each parameter copies its name and value; they are deleted below after the
            // metrics, which copy the labels, are created.
            let labels = unsafe {
                [
                    ffi_call!(value TRITONSERVER_ParameterNew(
                        k_model.as_ptr(),
                        sys::TRITONSERVER_PARAMETER_STRING,
                        v_model.as_ptr().cast(),
                    )),
                    ffi_call!(value TRITONSERVER_ParameterNew(
                        k_version.as_ptr(),
                        sys::TRITONSERVER_PARAMETER_STRING,
                        v_version.as_ptr().cast(),
                    )),
                ]
            };
            let label_ptrs: [*const sys::TRITONSERVER_Parameter; 2] = [labels[0], labels[1]];
            // The header declares the array `const TRITONSERVER_Parameter**` (a mutable pointer
            // to const parameters); Triton only reads it.
            let label_array = label_ptrs.as_ptr().cast_mut();
            let new_metric = |family: &Family| -> Result<Metric> {
                let mut raw = ptr::null_mut();
                // SAFETY: the family is live; the label array holds 2 valid parameters.
                unsafe { ffi_call!(TRITONSERVER_MetricNew(&mut raw, family.0, label_array, 2))? };
                Ok(Metric(raw))
            };
            let histogram = |family: &Family, buckets: &[f64]| -> Result<Metric> {
                let mut args = ptr::null_mut();
                let mut raw = ptr::null_mut();
                // SAFETY: args are created, used for one metric and deleted; buckets are copied.
                unsafe {
                    ffi_call!(TRITONSERVER_MetricArgsNew(&mut args))?;
                    let made = ffi_call!(TRITONSERVER_MetricArgsSetHistogram(
                        args,
                        buckets.as_ptr(),
                        buckets.len() as u64
                    ))
                    .and_then(|_| {
                        ffi_call!(TRITONSERVER_MetricNewWithArgs(
                            &mut raw,
                            family.0,
                            label_array,
                            2,
                            args
                        ))
                    });
                    let _ = ffi_call!(TRITONSERVER_MetricArgsDelete(args));
                    made?;
                }
                Ok(Metric(raw))
            };
            let metrics = new_metric(&families.unknown_ids).and_then(|unknown_ids| {
                Ok(ModelMetrics {
                    unknown_ids,
                    truncated: new_metric(&families.truncated)?,
                    invalid_requests: new_metric(&families.invalid_requests)?,
                    batch_size: histogram(&families.batch_size, &BATCH_BUCKETS)?,
                    screen_survivors: histogram(&families.screen_survivors, &SURVIVOR_BUCKETS)?,
                    availability_version: new_metric(&families.availability_version)?,
                    availability_age: new_metric(&families.availability_age)?,
                    availability_refused: new_metric(&families.availability_refused)?,
                    catalogue_version: new_metric(&families.catalogue_version)?,
                    catalogue_delta_items: new_metric(&families.catalogue_delta_items)?,
                    catalogue_refused: new_metric(&families.catalogue_refused)?,
                    prefix_hits: new_metric(&families.prefix_hits)?,
                    prefix_misses: new_metric(&families.prefix_misses)?,
                    prefix_computed: new_metric(&families.prefix_computed)?,
                    prefix_reused: new_metric(&families.prefix_reused)?,
                    prefix_evictions: new_metric(&families.prefix_evictions)?,
                    prefix_bytes: new_metric(&families.prefix_bytes)?,
                    prefix_reported: Default::default(),
                })
            });
            for label in labels {
                // SAFETY: created above, no longer referenced.
                unsafe { ffi_call!(value TRITONSERVER_ParameterDelete(label)) };
            }
            metrics
        }
    }

    pub(crate) fn record_batch(
        &self,
        engine_rows: usize,
        unknown_ids: usize,
        truncated: usize,
        invalid: usize,
        screen_survivors: &[u32],
    ) {
        // SAFETY: the metrics are live for as long as `self`.
        unsafe {
            for &survivors in screen_survivors {
                let _ = ffi_call!(TRITONSERVER_MetricObserve(
                    self.screen_survivors.0,
                    f64::from(survivors)
                ));
            }
            if engine_rows > 0 {
                let _ = ffi_call!(TRITONSERVER_MetricObserve(
                    self.batch_size.0,
                    engine_rows as f64
                ));
            }
            if unknown_ids > 0 {
                let _ = ffi_call!(TRITONSERVER_MetricIncrement(
                    self.unknown_ids.0,
                    unknown_ids as f64
                ));
            }
            if truncated > 0 {
                let _ = ffi_call!(TRITONSERVER_MetricIncrement(
                    self.truncated.0,
                    truncated as f64
                ));
            }
            if invalid > 0 {
                let _ = ffi_call!(TRITONSERVER_MetricIncrement(
                    self.invalid_requests.0,
                    invalid as f64
                ));
            }
        }
    }

    /// The availability object in force: its version (0 for none) and its age in seconds.
    pub(crate) fn set_availability(&self, version: u64, age_seconds: f64) {
        // SAFETY: the metrics are live for as long as `self`.
        unsafe {
            let _ = ffi_call!(TRITONSERVER_MetricSet(
                self.availability_version.0,
                version as f64
            ));
            let _ = ffi_call!(TRITONSERVER_MetricSet(self.availability_age.0, age_seconds));
        }
    }

    /// One availability object refused.
    pub(crate) fn availability_refused(&self) {
        // SAFETY: the metric is live for as long as `self`.
        let _ = unsafe {
            ffi_call!(TRITONSERVER_MetricIncrement(
                self.availability_refused.0,
                1.0
            ))
        };
    }

    /// The catalogue delta in force: its version and rows (0 for none).
    pub(crate) fn set_catalogue(&self, version: u64, delta_items: usize) {
        // SAFETY: the metrics are live for as long as `self`.
        unsafe {
            let _ = ffi_call!(TRITONSERVER_MetricSet(
                self.catalogue_version.0,
                version as f64
            ));
            let _ = ffi_call!(TRITONSERVER_MetricSet(
                self.catalogue_delta_items.0,
                delta_items as f64
            ));
        }
    }

    /// One catalogue object refused.
    pub(crate) fn catalogue_refused(&self) {
        // SAFETY: the metric is live for as long as `self`.
        let _ = unsafe { ffi_call!(TRITONSERVER_MetricIncrement(self.catalogue_refused.0, 1.0)) };
    }

    /// Brings the prefix cache's metrics up to `now` (its counters since the engine loaded).
    pub(crate) fn record_prefix_cache(&self, now: recsys_engine::prefix_cache::PrefixCacheStats) {
        let mut reported = self
            .prefix_reported
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let step = |metric: &Metric, was: u64, is: u64| {
            if is > was {
                // SAFETY: the metric is live for as long as `self`.
                let _ =
                    unsafe { ffi_call!(TRITONSERVER_MetricIncrement(metric.0, (is - was) as f64)) };
            }
        };
        step(&self.prefix_hits, reported.hits, now.hits);
        step(&self.prefix_misses, reported.misses, now.misses);
        step(
            &self.prefix_computed,
            reported.events_computed,
            now.events_computed,
        );
        step(
            &self.prefix_reused,
            reported.events_reused,
            now.events_reused,
        );
        step(
            &self.prefix_evictions,
            reported.evictions + reported.expirations,
            now.evictions + now.expirations,
        );
        // SAFETY: the metric is live for as long as `self`.
        let _ = unsafe {
            ffi_call!(TRITONSERVER_MetricSet(
                self.prefix_bytes.0,
                now.bytes as f64
            ))
        };
        *reported = now;
    }
}
