//! The recsys engine as the Python extension `recsys._recsys`: an engine directory loaded once
//! (memory-mapped), answering recommendations, candidate re-ranking, user embeddings and full
//! score matrices for batches of histories with the GIL released while it computes; `convert` and
//! `evaluate` as the command line runs them. Inputs are Python sequences (lists or numpy arrays)
//! of item ids; outputs are numpy arrays (lists for string ids). Engine errors become Python
//! exceptions carrying the engine's message.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyReadonlyArray1};
use pyo3::exceptions::{PyException, PyFileNotFoundError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PySequence};
use recsys_engine::calibration::read_histories;
use recsys_engine::metrics::{evaluate as evaluate_engine, read_test_set};
use recsys_engine::{
    ConvertOptions, ConvertRequest, Engine, EngineError, ExternalId, ExternalIds, ModelKind,
    Recommendation, Request, ServeOptions, Spelling, UnknownItemPolicy,
};

pyo3::create_exception!(
    _recsys,
    RecsysError,
    PyException,
    "An engine, checkpoint or file that recsys cannot use; the message says why."
);

/// The Python exception for an engine error: a bad request is a ValueError, a missing file a
/// FileNotFoundError, anything else a RecsysError.
fn engine_error(e: EngineError) -> PyErr {
    match &e {
        EngineError::NotFound { .. } => PyFileNotFoundError::new_err(e.to_string()),
        EngineError::InvalidRequest(_) => PyValueError::new_err(e.to_string()),
        _ => RecsysError::new_err(e.to_string()),
    }
}

/// Downloads the engine directory at `uri` (s3://..., gs://..., as `recsys predict --engine`
/// takes them, with the same credential chains) into a new folder under the temporary directory
/// (TMPDIR), the GIL released; the engine is then loaded, and so verified, from there.
fn download_engine(py: Python<'_>, uri: &str) -> PyResult<tempfile::TempDir> {
    let copy = tempfile::Builder::new()
        .prefix("recsys-engine-")
        .tempdir()
        .map_err(|e| {
            RecsysError::new_err(format!(
                "cannot create a folder for {uri}'s engine (set TMPDIR): {e}"
            ))
        })?;
    let target = copy.path().to_path_buf();
    py.detach(|| recsys_registry::transfer::download_folder(uri, &target))
        .map_err(|e| RecsysError::new_err(format!("cannot fetch the engine at {uri}: {e}")))?;
    Ok(copy)
}

/// Per-user lists of item ids as Python passed them: within one argument, all ints or all strings.
enum IdLists {
    Int(Vec<Vec<i64>>),
    Str(Vec<Vec<String>>),
}

impl IdLists {
    fn extract(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<IdLists> {
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

    fn optional(
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

    fn len(&self) -> usize {
        match self {
            IdLists::Int(v) => v.len(),
            IdLists::Str(v) => v.len(),
        }
    }

    /// Borrowed `&str` rows for string lists (empty for int lists); [`Self::row`] reads them.
    fn str_views(&self) -> Vec<Vec<&str>> {
        match self {
            IdLists::Int(_) => Vec::new(),
            IdLists::Str(v) => v
                .iter()
                .map(|row| row.iter().map(String::as_str).collect())
                .collect(),
        }
    }

    fn row<'a>(&'a self, views: &'a [Vec<&'a str>], i: usize) -> ExternalIds<'a> {
        match self {
            IdLists::Int(v) => ExternalIds::Int(&v[i]),
            IdLists::Str(_) => ExternalIds::Str(&views[i]),
        }
    }
}

/// What one call asks of every history.
struct Ask {
    k: Option<i64>,
    /// The k of a history whose own k is `None`.
    default_k: usize,
    exclude_seen: bool,
    strict: bool,
    embedding: bool,
}

/// [`PyEngine::predict`]'s answer: four lists with one entry per history.
#[derive(Default)]
struct PredictRows {
    ids: Vec<Py<PyAny>>,
    scores: Vec<Py<PyAny>>,
    embeddings: Vec<Option<Py<PyAny>>>,
    errors: Vec<Option<String>>,
}

/// [`PredictRows`] as Python receives it: the tuple `(ids, scores, embeddings, errors)`.
type PredictTuple = (
    Vec<Py<PyAny>>,
    Vec<Py<PyAny>>,
    Vec<Option<Py<PyAny>>>,
    Vec<Option<String>>,
);

/// A loaded engine directory (written by `recsys convert`).
#[pyclass(name = "Engine", module = "recsys", frozen)]
struct PyEngine {
    engine: Engine,
    path: PathBuf,
    /// The local copy of an engine loaded from object storage, removed with the engine (the
    /// engine maps its files).
    _copy: Option<tempfile::TempDir>,
}

impl PyEngine {
    /// Runs every history through the engine as one batch, the GIL released; each history's own
    /// answer or refusal. `ks`, when given, holds each history's k (`None`: `ask.default_k`).
    #[allow(clippy::too_many_arguments)] // one batch's inputs, each optional
    fn answer_each(
        &self,
        py: Python<'_>,
        histories: &IdLists,
        ks: Option<&[Option<i64>]>,
        exclude: Option<&IdLists>,
        candidates: Option<&IdLists>,
        ask: &Ask,
    ) -> Vec<recsys_engine::Result<Recommendation>> {
        let views = histories.str_views();
        let exclude_views = exclude.map(IdLists::str_views).unwrap_or_default();
        let candidate_views = candidates.map(IdLists::str_views).unwrap_or_default();
        let requests: Vec<Request<'_>> = (0..histories.len())
            .map(|i| Request {
                history: histories.row(&views, i),
                k: ks.map_or(ask.k, |ks| ks[i]),
                exclude: exclude.map(|e| e.row(&exclude_views, i)),
                candidates: candidates.map(|c| c.row(&candidate_views, i)),
                embedding: ask.embedding,
            })
            .collect();
        let options = ServeOptions {
            default_k: ask.default_k,
            exclude_seen: ask.exclude_seen,
            unknown_items: if ask.strict {
                UnknownItemPolicy::Error
            } else {
                UnknownItemPolicy::Drop
            },
        };
        let engine = &self.engine;
        py.detach(|| engine.recommend(&requests, &options))
    }

    /// [`Self::answer_each`] for calls that fail as a whole: the first refused history raises.
    fn answer(
        &self,
        py: Python<'_>,
        histories: &IdLists,
        exclude: Option<&IdLists>,
        candidates: Option<&IdLists>,
        ask: &Ask,
    ) -> PyResult<Vec<Recommendation>> {
        self.answer_each(py, histories, None, exclude, candidates, ask)
            .into_iter()
            .enumerate()
            .map(|(i, answer)| {
                answer.map_err(|e| match e {
                    EngineError::InvalidRequest(message) => {
                        PyValueError::new_err(format!("history {i}: {message}"))
                    }
                    other => engine_error(other),
                })
            })
            .collect()
    }

    /// `(ids, scores)` of ranked answers: scores `[B, width]` float32 padded with -inf; ids int64
    /// `[B, width]` padded with -1 for int catalogues, lists of strings (each its own length) for
    /// string catalogues.
    fn ranked<'py>(
        &self,
        py: Python<'py>,
        answers: &[Recommendation],
        width: usize,
    ) -> PyResult<(Py<PyAny>, Bound<'py, PyArray2<f32>>)> {
        let rows = answers.len();
        let mut scores = vec![f32::NEG_INFINITY; rows * width];
        for (r, answer) in answers.iter().enumerate() {
            for (slot, item) in answer.items.iter().take(width).enumerate() {
                scores[r * width + slot] = item.score;
            }
        }
        let scores = Array2::from_shape_vec((rows, width), scores)
            .expect("rows x width values")
            .into_pyarray(py);
        let external = |index: u32| {
            self.engine.external_id(index).ok_or_else(|| {
                RecsysError::new_err(format!(
                    "the engine returned item index {index}, outside its catalogue"
                ))
            })
        };
        let ids = if self.engine.manifest.id_type == recsys_engine::idmap::IdType::String {
            let mut lists = Vec::with_capacity(rows);
            for answer in answers {
                let row: Vec<String> = answer
                    .items
                    .iter()
                    .map(|s| {
                        external(s.index).map(|id| match id {
                            ExternalId::Str(s) => s,
                            ExternalId::Int(i) => i.to_string(),
                        })
                    })
                    .collect::<PyResult<_>>()?;
                lists.push(row);
            }
            lists.into_pyobject(py)?.into_any().unbind()
        } else {
            let mut ids = vec![-1i64; rows * width];
            for (r, answer) in answers.iter().enumerate() {
                for (slot, item) in answer.items.iter().take(width).enumerate() {
                    ids[r * width + slot] = match external(item.index)? {
                        ExternalId::Int(i) => i,
                        ExternalId::Str(_) => unreachable!("int catalogue"),
                    };
                }
            }
            Array2::from_shape_vec((rows, width), ids)
                .expect("rows x width ids")
                .into_pyarray(py)
                .into_any()
                .unbind()
        };
        Ok((ids, scores))
    }

    /// `recommend` and `rerank`: each history's ranked answer, among its own candidates when
    /// given.
    fn rank<'py>(
        &self,
        py: Python<'py>,
        histories: &Bound<'py, PyAny>,
        candidates: Option<&Bound<'py, PyAny>>,
        exclude: Option<&Bound<'py, PyAny>>,
        ask: &Ask,
    ) -> PyResult<(Py<PyAny>, Bound<'py, PyArray2<f32>>)> {
        let width = self.width(ask.k.unwrap_or(10))?;
        let histories = IdLists::extract(histories, "histories")?;
        let candidates = IdLists::optional(candidates, "candidates", histories.len())?;
        let exclude = IdLists::optional(exclude, "exclude", histories.len())?;
        let answers = self.answer(py, &histories, exclude.as_ref(), candidates.as_ref(), ask)?;
        self.ranked(py, &answers, width)
    }

    fn width(&self, k: i64) -> PyResult<usize> {
        if k < 1 {
            return Err(PyValueError::new_err(format!(
                "k must be at least 1, got {k}"
            )));
        }
        Ok((k as usize).min(self.engine.n_items()))
    }
}

#[pymethods]
impl PyEngine {
    /// Loads an engine directory; `threads` scoring threads per call (default: the available cores).
    #[new]
    #[pyo3(signature = (path, threads = None))]
    fn new(py: Python<'_>, path: PathBuf, threads: Option<usize>) -> PyResult<Self> {
        let (dir, copy) = match path
            .to_str()
            .filter(|p| recsys_registry::transfer::is_remote(p))
        {
            Some(uri) => {
                let copy = download_engine(py, uri)?;
                (copy.path().to_path_buf(), Some(copy))
            }
            None => (path.clone(), None),
        };
        let mut engine = py.detach(|| Engine::load(&dir)).map_err(engine_error)?;
        let threads = match threads {
            Some(0) => return Err(PyValueError::new_err("threads must be at least 1")),
            Some(t) => t,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        engine.set_threads(threads);
        Ok(PyEngine {
            engine,
            path,
            _copy: copy,
        })
    }

    /// "bert4rec", "vaecf", "sasrec" or "gru4rec".
    #[getter]
    fn kind(&self) -> &'static str {
        self.engine.kind().as_str()
    }

    /// "fp32", "fp16" or "int8".
    #[getter]
    fn precision(&self) -> &'static str {
        self.engine.manifest.precision.as_str()
    }

    /// Items in the catalogue (N).
    #[getter]
    fn num_items(&self) -> usize {
        self.engine.n_items()
    }

    /// Scoring threads per call.
    #[getter]
    fn threads(&self) -> usize {
        self.engine.scorer.threads
    }

    /// Values in a user embedding: the model's hidden size plus the trailing 1.
    #[getter]
    fn embedding_dim(&self) -> usize {
        self.engine.model.output().input_size() + 1
    }

    /// The external ids of items 1..=N (the columns of `score`): int64 array or list of str.
    #[getter]
    fn item_ids(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let ids = (1..=self.engine.n_items() as u32).map(|i| self.engine.external_id(i));
        if self.engine.manifest.id_type == recsys_engine::idmap::IdType::String {
            let names: Vec<String> = ids
                .map(|id| match id {
                    Some(ExternalId::Str(s)) => s,
                    Some(ExternalId::Int(i)) => i.to_string(),
                    None => unreachable!("1..=N are items"),
                })
                .collect();
            Ok(names.into_pyobject(py)?.into_any().unbind())
        } else {
            let ints: Vec<i64> = ids
                .map(|id| match id {
                    Some(ExternalId::Int(i)) => i,
                    _ => unreachable!("int catalogue"),
                })
                .collect();
            Ok(PyArray1::from_vec(py, ints).into_any().unbind())
        }
    }

    /// The best `k` items of each history (oldest first, external ids), best first.
    #[pyo3(signature = (histories, k = 10, exclude = None, exclude_seen = true, strict = false))]
    fn recommend<'py>(
        &self,
        py: Python<'py>,
        histories: &Bound<'py, PyAny>,
        k: i64,
        exclude: Option<&Bound<'py, PyAny>>,
        exclude_seen: bool,
        strict: bool,
    ) -> PyResult<(Py<PyAny>, Bound<'py, PyArray2<f32>>)> {
        let ask = Ask {
            k: Some(k),
            default_k: 10,
            exclude_seen,
            strict,
            embedding: false,
        };
        self.rank(py, histories, None, exclude, &ask)
    }

    /// The best `k` of each history's own candidates, with exactly the scores the whole-catalogue
    /// scan gives them.
    #[pyo3(signature = (histories, candidates, k = 10, exclude = None, exclude_seen = true, strict = false))]
    #[allow(clippy::too_many_arguments)] // mirrors the Python signature, keyword arguments
    fn rerank<'py>(
        &self,
        py: Python<'py>,
        histories: &Bound<'py, PyAny>,
        candidates: &Bound<'py, PyAny>,
        k: i64,
        exclude: Option<&Bound<'py, PyAny>>,
        exclude_seen: bool,
        strict: bool,
    ) -> PyResult<(Py<PyAny>, Bound<'py, PyArray2<f32>>)> {
        let ask = Ask {
            k: Some(k),
            default_k: 10,
            exclude_seen,
            strict,
            embedding: false,
        };
        self.rank(py, histories, Some(candidates), exclude, &ask)
    }

    /// Each history's user embedding `[h, 1]`, float32 `[B, embedding_dim]`.
    #[pyo3(signature = (histories, strict = false))]
    fn embed<'py>(
        &self,
        py: Python<'py>,
        histories: &Bound<'py, PyAny>,
        strict: bool,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let histories = IdLists::extract(histories, "histories")?;
        let ask = Ask {
            k: Some(0),
            default_k: 10,
            exclude_seen: true,
            strict,
            embedding: true,
        };
        let answers = self.answer(py, &histories, None, None, &ask)?;
        let width = self.embedding_dim();
        let values: Vec<f32> = answers.into_iter().flat_map(|a| a.embedding).collect();
        Ok(Array2::from_shape_vec((histories.len(), width), values)
            .expect("one embedding per history")
            .into_pyarray(py))
    }

    /// Every item's score for each history, float32 `[B, N]` (column j is `item_ids[j]`), with
    /// nothing left out: for evaluation. Unknown ids are dropped.
    fn score<'py>(
        &self,
        py: Python<'py>,
        histories: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let histories = IdLists::extract(histories, "histories")?;
        let views = histories.str_views();
        let engine = &self.engine;
        let mapped: Vec<Vec<u32>> = (0..histories.len())
            .map(|i| engine.ids.map(histories.row(&views, i)).indices)
            .collect();
        let n = engine.n_items();
        let all = py.detach(|| {
            let refs: Vec<&[u32]> = mapped.iter().map(Vec::as_slice).collect();
            engine.score_all(&refs)
        });
        // Drop the PAD column (index 0, never an item).
        let values: Vec<f32> = all
            .chunks_exact(n + 1)
            .flat_map(|row| row[1..].iter().copied())
            .collect();
        Ok(Array2::from_shape_vec((mapped.len(), n), values)
            .expect("B x N scores")
            .into_pyarray(py))
    }

    /// Per-history answers as `recsys predict` gives them, for batch jobs (`recsys.ray` uses it):
    /// each history may carry its own k (`None`: `default_k`), and a history the engine refuses
    /// gets its error message instead of failing the batch. Returns four lists, one entry per
    /// history: ids (int64 array or list of str), float32 scores, float32 embeddings (`None`
    /// unless `embedding`), and the error message (`None` when answered; the other three are then
    /// empty, or `None` for the embedding).
    #[pyo3(signature = (histories, k = None, exclude = None, candidates = None, default_k = 10,
                        exclude_seen = true, strict = false, embedding = false))]
    #[allow(clippy::too_many_arguments)] // mirrors the Python signature, keyword arguments
    fn predict<'py>(
        &self,
        py: Python<'py>,
        histories: &Bound<'py, PyAny>,
        k: Option<Vec<Option<i64>>>,
        exclude: Option<&Bound<'py, PyAny>>,
        candidates: Option<&Bound<'py, PyAny>>,
        default_k: i64,
        exclude_seen: bool,
        strict: bool,
        embedding: bool,
    ) -> PyResult<PredictTuple> {
        let default_k = self.width(default_k)?;
        let histories = IdLists::extract(histories, "histories")?;
        let users = histories.len();
        if let Some(ks) = &k {
            if ks.len() != users {
                return Err(PyValueError::new_err(format!(
                    "k has {} values for {users} histories: give one per history (None: default_k)",
                    ks.len()
                )));
            }
        }
        let candidates = IdLists::optional(candidates, "candidates", users)?;
        let exclude = IdLists::optional(exclude, "exclude", users)?;
        let ask = Ask {
            k: None,
            default_k,
            exclude_seen,
            strict,
            embedding,
        };
        let answers = self.answer_each(
            py,
            &histories,
            k.as_deref(),
            exclude.as_ref(),
            candidates.as_ref(),
            &ask,
        );
        let string_ids = self.engine.manifest.id_type == recsys_engine::idmap::IdType::String;
        let mut rows = PredictRows::default();
        for answer in answers {
            let answer = match answer {
                Ok(answer) => answer,
                Err(e) => {
                    rows.ids.push(if string_ids {
                        Vec::<String>::new().into_pyobject(py)?.into_any().unbind()
                    } else {
                        PyArray1::<i64>::zeros(py, 0, false).into_any().unbind()
                    });
                    rows.scores
                        .push(PyArray1::<f32>::zeros(py, 0, false).into_any().unbind());
                    rows.embeddings.push(None);
                    rows.errors.push(Some(e.to_string()));
                    continue;
                }
            };
            let mut ints = Vec::with_capacity(answer.items.len());
            let mut names = Vec::new();
            for item in &answer.items {
                match self.engine.external_id(item.index) {
                    Some(ExternalId::Int(i)) => ints.push(i),
                    Some(ExternalId::Str(s)) => names.push(s),
                    None => {
                        return Err(RecsysError::new_err(format!(
                            "the engine returned item index {}, outside its catalogue",
                            item.index
                        )))
                    }
                }
            }
            rows.ids.push(if string_ids {
                names.into_pyobject(py)?.into_any().unbind()
            } else {
                PyArray1::from_vec(py, ints).into_any().unbind()
            });
            let scores: Vec<f32> = answer.items.iter().map(|s| s.score).collect();
            rows.scores
                .push(PyArray1::from_vec(py, scores).into_any().unbind());
            rows.embeddings.push(
                embedding.then(|| PyArray1::from_vec(py, answer.embedding).into_any().unbind()),
            );
            rows.errors.push(None);
        }
        Ok((rows.ids, rows.scores, rows.embeddings, rows.errors))
    }

    fn __repr__(&self) -> String {
        format!(
            "recsys.Engine({:?}, kind={}, precision={}, items={}, threads={})",
            self.path.display().to_string(),
            self.kind(),
            self.precision(),
            self.num_items(),
            self.threads()
        )
    }
}

/// Converts a checkpoint into an engine directory, as `recsys convert` does; returns the engine.
#[pyfunction]
#[pyo3(signature = (kind, checkpoint, item_map, output, config = None, precision = "fp32",
                    int8_mode = "weight-only", calibration = None, calibration_method = "entropy",
                    calibration_percentile = 99.99, screen = "none", force = false))]
#[allow(clippy::too_many_arguments)] // mirrors the command line's flags, keyword arguments
fn convert(
    py: Python<'_>,
    kind: &str,
    checkpoint: PathBuf,
    item_map: PathBuf,
    output: PathBuf,
    config: Option<PathBuf>,
    precision: &str,
    int8_mode: &str,
    calibration: Option<PathBuf>,
    calibration_method: &str,
    calibration_percentile: f64,
    screen: &str,
    force: bool,
) -> PyResult<PyEngine> {
    let kind: ModelKind = kind.parse().map_err(PyValueError::new_err)?;
    // The command line's options, defaults and refusals (`ConvertOptions`), spelled as keywords.
    let plan = ConvertOptions {
        precision: precision.parse().map_err(PyValueError::new_err)?,
        int8_mode: int8_mode.parse().map_err(PyValueError::new_err)?,
        screen: screen.parse().map_err(PyValueError::new_err)?,
        calibration: calibration.is_some(),
        calibration_method: calibration_method.parse().map_err(PyValueError::new_err)?,
        calibration_percentile,
    }
    .plan(Spelling::Keywords)
    .map_err(PyValueError::new_err)?;
    if output.exists() && !force && std::fs::read_dir(&output).is_ok_and(|mut d| d.next().is_some())
    {
        return Err(PyValueError::new_err(format!(
            "{} already exists; pass force=True to replace it",
            output.display()
        )));
    }
    let config = match config {
        None => None,
        Some(path) => {
            let text = std::fs::read_to_string(&path).map_err(|e| {
                PyFileNotFoundError::new_err(format!("cannot read config {}: {e}", path.display()))
            })?;
            match serde_json::from_str::<serde_json::Value>(&text) {
                Ok(serde_json::Value::Object(map)) => Some(map),
                _ => {
                    return Err(PyValueError::new_err(format!(
                        "{} is not a JSON object",
                        path.display()
                    )))
                }
            }
        }
    };
    let calibration = match (calibration, plan.calibration) {
        (Some(path), Some(method)) => Some((read_histories(&path).map_err(engine_error)?, method)),
        _ => None,
    };
    let engine = py
        .detach(|| {
            recsys_engine::convert(&ConvertRequest {
                kind: Some(kind),
                checkpoint: &checkpoint,
                config: config.as_ref(),
                item_map: &item_map,
                out: &output,
                precision: plan.precision,
                calibration: calibration
                    .as_ref()
                    .map(|(histories, method)| (histories.as_slice(), *method)),
                screen: plan.screen,
                w8a8_layers: plan.w8a8_layers,
            })
        })
        .map_err(engine_error)?;
    let mut engine = engine;
    engine.set_threads(std::thread::available_parallelism().map_or(1, |n| n.get()));
    Ok(PyEngine {
        engine,
        path: output,
        _copy: None,
    })
}

/// Ranking quality on a test set (TSV: user, target, history), as `recsys eval` reports it: a dict
/// with "metrics" (ndcg@k, recall@k, mrr, n_users), "unknown_history_ids" and "unknown_targets".
#[pyfunction]
#[pyo3(signature = (engine, test_set, k = vec![10, 20, 100], batch_size = 256))]
fn evaluate<'py>(
    py: Python<'py>,
    engine: &PyEngine,
    test_set: PathBuf,
    k: Vec<usize>,
    batch_size: usize,
) -> PyResult<Bound<'py, PyDict>> {
    if k.is_empty() || k.contains(&0) {
        return Err(PyValueError::new_err("k needs cut-offs of at least 1"));
    }
    let cases = read_test_set(&test_set).map_err(engine_error)?;
    let inner = &engine.engine;
    let report = py.detach(|| evaluate_engine(inner, &cases, &k, batch_size.max(1), |_| {}));
    let metrics = PyDict::new(py);
    for (name, value) in &report.metrics {
        if name == "n_users" {
            metrics.set_item(name, *value as u64)?;
        } else {
            metrics.set_item(name, *value)?;
        }
    }
    let out = PyDict::new(py);
    out.set_item("metrics", metrics)?;
    out.set_item("unknown_history_ids", report.unknown_history_ids)?;
    out.set_item("unknown_targets", report.unknown_targets)?;
    Ok(out)
}

#[pymodule]
fn _recsys(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngine>()?;
    m.add_function(wrap_pyfunction!(convert, m)?)?;
    m.add_function(wrap_pyfunction!(evaluate, m)?)?;
    m.add("RecsysError", m.py().get_type::<RecsysError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
