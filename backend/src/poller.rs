//! The thread that polls a model's live objects (its availability source,
//! [`crate::availability::Tracker`], and its catalogue source, [`crate::catalogue::Tracker`]),
//! and the log lines and metrics each availability poll leaves.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use recsys_engine::Engine;

use crate::availability::{Polled, Tracker};
use crate::catalogue::{Polled as CataloguePolled, Tracker as CatalogueTracker};
use crate::live_engine::LiveEngine;
use crate::metrics::ModelMetrics;
use crate::triton::{log, LogLevel};

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Polls the availability source, then logs and counts what happened, with every other change
/// to the engine in force held off. `last_problem` keeps the last store error logged, so a store
/// that stays unreachable is logged once, not at every poll.
pub(crate) fn poll_and_report(
    tracker: &mut Tracker,
    live: &LiveEngine,
    metrics: Option<&ModelMetrics>,
    last_problem: &mut Option<String>,
) {
    live.change(|engine| {
        report_availability(tracker, engine, metrics, last_problem);
        (None, ())
    })
}

fn report_availability(
    tracker: &mut Tracker,
    engine: &Engine,
    metrics: Option<&ModelMetrics>,
    last_problem: &mut Option<String>,
) {
    let polled = tracker.poll(engine);
    let source = tracker.source().to_string();
    let model = tracker.model().to_string();
    match &polled {
        Polled::Swapped {
            version,
            previous,
            known_items,
            unknown_items,
        } => {
            *last_problem = None;
            let previous = previous.map_or("none".to_string(), |p| p.to_string());
            log(
                LogLevel::Info,
                &format!(
                    "recsys: model {model}: availability version {version} in force (was \
                     {previous}) from {source}: {known_items} items, {unknown_items} ids not \
                     in the catalogue left out"
                ),
            );
        }
        Polled::Refused(why) => {
            *last_problem = None;
            if let Some(m) = metrics {
                m.availability_refused();
            }
            let kept = engine
                .filters
                .availability_version()
                .map_or("no availability object is in force yet".to_string(), |v| {
                    format!("version {v} stays in force")
                });
            log(
                LogLevel::Error,
                &format!(
                    "recsys: model {model}: availability update from {source} refused, \
                     {kept}: {why}"
                ),
            );
            if engine.filters.availability_version().is_none() {
                engine.filters.note_availability_waiting(format!(
                    "the availability object is refused: {why}"
                ));
            }
        }
        Polled::Missing | Polled::Unreadable(_) => {
            let problem = match &polled {
                Polled::Missing => format!("no availability object at {source}"),
                Polled::Unreadable(e) => format!("availability source unreadable: {e}"),
                _ => unreachable!("matched above"),
            };
            if last_problem.as_deref() != Some(problem.as_str()) {
                log(
                    LogLevel::Warn,
                    &format!(
                        "recsys: model {model}: {problem} ({})",
                        engine
                            .filters
                            .availability_version()
                            .map_or("nothing in force yet".to_string(), |v| {
                                format!("version {v} stays in force")
                            })
                    ),
                );
                if engine.filters.availability_version().is_none() {
                    engine.filters.note_availability_waiting(problem.clone());
                }
                *last_problem = Some(problem);
            }
        }
        Polled::Unchanged => {}
    }
    if let Some(m) = metrics {
        let view = engine.filters.view();
        let (version, age) = view.availability().map_or((0, 0.0), |a| {
            (
                a.version,
                now_unix().saturating_sub(a.published_unix) as f64,
            )
        });
        m.set_availability(version, age);
    }
}

/// Polls the catalogue source, then logs and counts what happened. `last_problem` keeps the last store error logged,
/// so a store that stays unreachable is logged once, not at every poll.
pub(crate) fn poll_catalogue_and_report(
    tracker: &mut CatalogueTracker,
    live: &LiveEngine,
    metrics: Option<&ModelMetrics>,
    last_problem: &mut Option<String>,
) {
    let polled = tracker.poll(live);
    let (source, model) = (tracker.source(), tracker.model());
    let in_force = || {
        live.current().catalogue().map_or(
            "the catalogue as converted stays in force".to_string(),
            |c| format!("catalogue version {} stays in force", c.version),
        )
    };
    match &polled {
        CataloguePolled::Swapped {
            summary,
            previous,
            items,
            folded,
        } => {
            *last_problem = None;
            let previous = previous.map_or("none".to_string(), |p| p.to_string());
            let what = if *folded {
                "already folded into this engine by compaction".to_string()
            } else {
                format!(
                    "{} added, {} replaced, {} retired",
                    summary.added, summary.replaced, summary.retired
                )
            };
            log(
                LogLevel::Info,
                &format!(
                    "recsys: model {model}: catalogue version {} in force (was {previous}) from \
                     {source}: {what}; {items} items",
                    summary.version
                ),
            );
        }
        CataloguePolled::Refused(why) => {
            *last_problem = None;
            if let Some(m) = metrics {
                m.catalogue_refused();
            }
            log(
                LogLevel::Error,
                &format!(
                    "recsys: model {model}: catalogue update from {source} refused, {}: {why}",
                    in_force()
                ),
            );
        }
        CataloguePolled::Missing | CataloguePolled::Unreadable(_) => {
            let problem = match &polled {
                CataloguePolled::Missing => format!("no catalogue object at {source}"),
                CataloguePolled::Unreadable(e) => format!("catalogue source unreadable: {e}"),
                _ => unreachable!("matched above"),
            };
            if last_problem.as_deref() != Some(problem.as_str()) {
                log(
                    LogLevel::Warn,
                    &format!("recsys: model {model}: {problem} ({})", in_force()),
                );
                *last_problem = Some(problem);
            }
        }
        CataloguePolled::Unchanged => {}
    }
    if let Some(m) = metrics {
        let engine = live.current();
        let (version, rows) = engine
            .catalogue()
            .map_or((0, 0), |c| (c.version, c.delta_items));
        m.set_catalogue(version, rows);
    }
}

/// The thread polling one of a model's live objects; stopped and joined when dropped (model
/// unload).
pub(crate) struct Poller {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Poller {
    /// Runs `poll` once now (so the model serves with the object from its first request), then
    /// every `interval` on a thread named `name` when one is given. A panic in `poll` is logged
    /// (`what` names the object) and the next poll tries again.
    pub(crate) fn start(
        name: String,
        what: &'static str,
        interval: Option<Duration>,
        mut poll: impl FnMut() + Send + 'static,
    ) -> Poller {
        poll();
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let thread = interval.map(|interval| {
            let stop = Arc::clone(&stop);
            let model = name.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("recsys-{what}-{name}"))
                .spawn(move || {
                    let (lock, wake) = &*stop;
                    loop {
                        let guard = lock.lock().unwrap_or_else(|p| p.into_inner());
                        let (guard, _) = wake
                            .wait_timeout_while(guard, interval, |stopped| !*stopped)
                            .unwrap_or_else(|p| p.into_inner());
                        if *guard {
                            return;
                        }
                        drop(guard);
                        // A panic here would end the polling silently; log it and go on polling.
                        if catch_unwind(AssertUnwindSafe(&mut poll)).is_err() {
                            log(
                                LogLevel::Error,
                                &format!(
                                    "recsys: model {model}: the {what} poll panicked; what is in \
                                     force stays, and the next poll tries again"
                                ),
                            );
                        }
                    }
                });
            match spawned {
                Ok(handle) => Some(handle),
                Err(e) => {
                    log(
                        LogLevel::Error,
                        &format!("recsys: cannot start the {what} poller: {e}"),
                    );
                    None
                }
            }
        });
        Poller {
            stop,
            thread: thread.flatten(),
        }
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        let (lock, wake) = &*self.stop;
        *lock.lock().unwrap_or_else(|p| p.into_inner()) = true;
        wake.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
