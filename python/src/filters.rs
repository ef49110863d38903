//! Item set filters as Python passes them: `include_sets` / `exclude_sets` either one list of set
//! names for every history (a category page) or one list per history (a batch job's rows).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use recsys_engine::ItemFilter;

/// Set names given for every history alike, or one list per history.
enum Names {
    Shared(Vec<String>),
    PerHistory(Vec<Vec<String>>),
}

fn names(obj: Option<&Bound<'_, PyAny>>, what: &str, users: usize) -> PyResult<Option<Names>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    if obj.is_instance_of::<pyo3::types::PyString>() {
        return Err(PyValueError::new_err(format!(
            "{what} must be a list of set names (\"column=value\"), not one string"
        )));
    }
    if let Ok(shared) = obj.extract::<Vec<String>>() {
        return Ok(Some(Names::Shared(shared)));
    }
    let lists: Vec<Vec<String>> = obj.extract().map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a list of set names (\"column=value\") for every history, or one such \
             list per history"
        ))
    })?;
    if lists.len() != users {
        return Err(PyValueError::new_err(format!(
            "{what} has {} lists for {users} histories: give one per history, or one list of \
             names for all",
            lists.len()
        )));
    }
    Ok(Some(Names::PerHistory(lists)))
}

/// Each history's filter, or `None` when neither argument names a set.
pub(crate) fn item_filters(
    include: Option<&Bound<'_, PyAny>>,
    exclude: Option<&Bound<'_, PyAny>>,
    users: usize,
) -> PyResult<Option<Vec<ItemFilter>>> {
    let include = names(include, "include_sets", users)?;
    let exclude = names(exclude, "exclude_sets", users)?;
    if include.is_none() && exclude.is_none() {
        return Ok(None);
    }
    let row = |names: &Option<Names>, i: usize| match names {
        None => Vec::new(),
        Some(Names::Shared(v)) => v.clone(),
        Some(Names::PerHistory(v)) => v[i].clone(),
    };
    Ok(Some(
        (0..users)
            .map(|i| ItemFilter {
                include: row(&include, i),
                exclude: row(&exclude, i),
            })
            .collect(),
    ))
}
