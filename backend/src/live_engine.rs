//! The engine a model serves, replaceable while it serves: a catalogue delta builds the next engine
//! off the serving path, and putting it in force is one pointer store. A batch takes the engine
//! once and keeps it to its end (its answers are mapped back to ids by the engine that scored
//! them), so no batch mixes two catalogues and none waits for a swap.

use std::sync::{Arc, Mutex, RwLock};

use recsys_engine::Engine;

pub struct LiveEngine {
    current: RwLock<Arc<Engine>>,
    /// Held by whoever changes what is in force (a catalogue swap, an availability update), so
    /// an availability update never lands on an engine a swap is about to replace.
    changing: Mutex<()>,
}

impl LiveEngine {
    pub fn new(engine: Engine) -> LiveEngine {
        LiveEngine {
            current: RwLock::new(Arc::new(engine)),
            changing: Mutex::new(()),
        }
    }

    /// The engine in force; kept by the caller to the end of its batch.
    pub fn current(&self) -> Arc<Engine> {
        Arc::clone(&self.current.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Runs `change` on the engine in force with every other change held off; `change` returns a
    /// new engine to put in force (or `None` to keep it) and what to report.
    pub fn change<R>(&self, change: impl FnOnce(&Arc<Engine>) -> (Option<Engine>, R)) -> R {
        let _one_at_a_time = self.changing.lock().unwrap_or_else(|p| p.into_inner());
        let current = self.current();
        let (next, report) = change(&current);
        if let Some(next) = next {
            *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(next);
        }
        report
    }
}
