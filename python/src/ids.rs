//! Item ids as Python passes them: per history, a sequence (list or numpy array) of all ints or all
//! strings, read into the engine's external-id views.

use numpy::PyReadonlyArray1;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PySequence;
use recsys_engine::ExternalIds;

/// Per-user lists of item ids as Python passed them: within one argument, all ints or all strings.
pub(crate) enum IdLists {
    Int(Vec<Vec<i64>>),
    Str(Vec<Vec<String>>),
}

impl IdLists {
    pub(crate) fn extract(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<IdLists> {
        if let Some(lists) = IdLists::int64_arrays(obj)? {
            return Ok(IdLists::Int(lists));
        }
        if let Ok(lists) = obj.extract::<Vec<Vec<i64>>>() {
            return Ok(IdLists::Int(lists));
        }
        if let Ok(lists) = obj.extract::<Vec<Vec<String>>>() {
            return Ok(IdLists::Str(lists));
        }
        Err(PyTypeError::new_err(format!(
            "{what} must be a sequence of id sequences, one per user, all int or all str \
             (e.g. [[10011403, 10011207], [10011739]])"
        )))
    }

    /// The fast path for a sequence of int64 numpy arrays (rows of a 2-D array, or views into an
    /// Arrow list column's values): each row copied as one slice instead of id by id. `None`
    /// when any row is something else, which the general path then reads.
    fn int64_arrays(obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<Vec<i64>>>> {
        let Ok(rows) = obj.cast::<PySequence>() else {
            return Ok(None);
        };
        let Ok(n) = rows.len() else {
            return Ok(None);
        };
        let mut lists = Vec::with_capacity(n);
        for i in 0..n {
            let row = rows.get_item(i)?;
            let Ok(array) = row.extract::<PyReadonlyArray1<'_, i64>>() else {
                return Ok(None);
            };
            lists.push(array.as_array().to_vec());
        }
        Ok(Some(lists))
    }

    pub(crate) fn optional(
        obj: Option<&Bound<'_, PyAny>>,
        what: &str,
        users: usize,
    ) -> PyResult<Option<IdLists>> {
        let Some(obj) = obj.filter(|o| !o.is_none()) else {
            return Ok(None);
        };
        let lists = IdLists::extract(obj, what)?;
        if lists.len() != users {
            return Err(PyValueError::new_err(format!(
                "{what} has {} lists for {users} histories: give one per history",
                lists.len()
            )));
        }
        Ok(Some(lists))
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            IdLists::Int(v) => v.len(),
            IdLists::Str(v) => v.len(),
        }
    }

    /// Ids that cannot be integers (strings that do not parse as one), as `(row, position,
    /// id)`, in order: what an engine of integer ids can never know.
    pub(crate) fn non_integers(&self) -> Vec<(usize, usize, &str)> {
        match self {
            IdLists::Int(_) => Vec::new(),
            IdLists::Str(v) => v
                .iter()
                .enumerate()
                .flat_map(|(row, ids)| {
                    ids.iter()
                        .enumerate()
                        .filter(|(_, id)| id.trim().parse::<i64>().is_err())
                        .map(move |(at, id)| (row, at, id.as_str()))
                })
                .collect(),
        }
    }

    /// List `i`'s length.
    pub(crate) fn len_of(&self, i: usize) -> usize {
        match self {
            IdLists::Int(v) => v[i].len(),
            IdLists::Str(v) => v[i].len(),
        }
    }

    /// The longest list's length.
    pub(crate) fn longest(&self) -> usize {
        match self {
            IdLists::Int(v) => v.iter().map(Vec::len).max().unwrap_or(0),
            IdLists::Str(v) => v.iter().map(Vec::len).max().unwrap_or(0),
        }
    }

    /// The first `t` ids of every list at least that long, and which lists they are.
    pub(crate) fn prefixes(&self, t: usize) -> (Vec<usize>, IdLists) {
        fn take<T: Clone>(lists: &[Vec<T>], t: usize) -> (Vec<usize>, Vec<Vec<T>>) {
            lists
                .iter()
                .enumerate()
                .filter(|(_, l)| l.len() >= t)
                .map(|(i, l)| (i, l[..t].to_vec()))
                .unzip()
        }
        match self {
            IdLists::Int(v) => {
                let (which, lists) = take(v, t);
                (which, IdLists::Int(lists))
            }
            IdLists::Str(v) => {
                let (which, lists) = take(v, t);
                (which, IdLists::Str(lists))
            }
        }
    }

    /// Borrowed `&str` rows for string lists (empty for int lists); [`Self::row`] reads them.
    pub(crate) fn str_views(&self) -> Vec<Vec<&str>> {
        match self {
            IdLists::Int(_) => Vec::new(),
            IdLists::Str(v) => v
                .iter()
                .map(|row| row.iter().map(String::as_str).collect())
                .collect(),
        }
    }

    pub(crate) fn row<'a>(&'a self, views: &'a [Vec<&'a str>], i: usize) -> ExternalIds<'a> {
        match self {
            IdLists::Int(v) => ExternalIds::Int(&v[i]),
            IdLists::Str(_) => ExternalIds::Str(&views[i]),
        }
    }
}
