//! Event times as Python passes them, for the models that read them (HSTU): `timestamps`, one
//! list of unix seconds per history (lists, tuples or a 2-D integer array), and
//! `query_timestamp`, one time for every history or one per history (`None`: now).

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// Each history's timestamps and query time.
pub(crate) struct Times {
    events: Vec<Vec<i64>>,
    query: Vec<Option<i64>>,
}

impl Times {
    /// `timestamps` and `query_timestamp` for `histories` histories; `None` when neither is given.
    pub(crate) fn extract(
        timestamps: Option<&Bound<'_, PyAny>>,
        query_timestamp: Option<&Bound<'_, PyAny>>,
        histories: usize,
    ) -> PyResult<Option<Times>> {
        let Some(timestamps) = timestamps else {
            if query_timestamp.is_some() {
                return Err(PyValueError::new_err(
                    "query_timestamp= was given without timestamps=: give each history's event \
                     times (unix seconds, one per id) too",
                ));
            }
            return Ok(None);
        };
        let events: Vec<Vec<i64>> = timestamps.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "timestamps= must hold one sequence of integer unix timestamps (seconds) per \
                 history, got {}",
                type_name(timestamps)
            ))
        })?;
        if events.len() != histories {
            return Err(PyValueError::new_err(format!(
                "timestamps= holds {} lists for {histories} histories: give one per history",
                events.len()
            )));
        }
        let query = match query_timestamp {
            None => vec![None; histories],
            Some(q) => match q.extract::<i64>() {
                Ok(one) => vec![Some(one); histories],
                Err(_) => {
                    let each: Vec<i64> = q.extract().map_err(|_| {
                        PyTypeError::new_err(format!(
                            "query_timestamp= must be an integer unix timestamp (seconds) or one \
                             per history, got {}",
                            type_name(q)
                        ))
                    })?;
                    if each.len() != histories {
                        return Err(PyValueError::new_err(format!(
                            "query_timestamp= holds {} values for {histories} histories: give \
                             one per history, or one integer for all",
                            each.len()
                        )));
                    }
                    each.into_iter().map(Some).collect()
                }
            },
        };
        Ok(Some(Times { events, query }))
    }

    /// Refuses a history whose timestamps are not one per id, naming it (a timeline cuts both
    /// at every length, so they must agree before the first step).
    pub(crate) fn check_lengths(&self, histories: &crate::ids::IdLists) -> PyResult<()> {
        for (i, events) in self.events.iter().enumerate() {
            let ids = histories.len_of(i);
            if events.len() != ids {
                return Err(PyValueError::new_err(format!(
                    "timestamps= for history {i} holds {} times for its {ids} ids: give one \
                     unix timestamp per id",
                    events.len()
                )));
            }
        }
        Ok(())
    }

    /// The times of the first `t` events of the histories `which` (each at least `t` long), as a
    /// timeline step asks them: each prefix queried at its next event's time, or, after a
    /// history's last event, at its own query time (`None`: now).
    pub(crate) fn prefixes(&self, which: &[usize], t: usize) -> Times {
        Times {
            events: which
                .iter()
                .map(|&i| self.events[i][..t].to_vec())
                .collect(),
            query: which
                .iter()
                .map(|&i| self.events[i].get(t).copied().or(self.query[i]))
                .collect(),
        }
    }

    /// History `i`'s times as the engine takes them.
    pub(crate) fn row(&self, i: usize) -> recsys_engine::RequestTimes<'_> {
        recsys_engine::RequestTimes {
            events: &self.events[i],
            query: self.query[i],
        }
    }
}

fn type_name(value: &Bound<'_, PyAny>) -> String {
    value
        .get_type()
        .name()
        .map_or_else(|_| "an object".into(), |n| n.to_string())
}
