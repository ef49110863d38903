//! `recsys.Engine`: an engine directory loaded once (memory-mapped, or downloaded from object
//! storage first) answering recommendations, re-ranking, embeddings and score matrices for
//! batches of histories, the GIL released while it computes.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use recsys_engine::{
    BatchRecommender, Engine, EngineError, ExternalId, Recommendation, Request, ServeOptions,
    UnknownItemPolicy,
};

use crate::device::{self, DeviceChoice};
use crate::ids::IdLists;
use crate::{engine_error, RecsysError};

/// Downloads the engine directory at `uri` (s3://..., gs://..., as `recsys predict --engine`
/// takes them, with the same credential chains) into a new folder under the temporary directory
/// (TMPDIR), the GIL released; the engine is then loaded, and so verified, from there.
pub(crate) fn download_engine(py: Python<'_>, uri: &str) -> PyResult<tempfile::TempDir> {
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

/// What one call asks of every history.
struct Ask {
    k: Option<i64>,
    /// Each history's item set filter (`None`: no filter).
    filters: Option<Vec<recsys_engine::ItemFilter>>,
    /// The k of a history whose own k is `None`.
    default_k: usize,
    exclude_seen: bool,
    strict: bool,
    embedding: bool,
    /// Each history's event times, for the models that read them (`None`: not given).
    times: Option<crate::times::Times>,
}

/// A call's `timestamps=` and `query_timestamp=` as Python passed them.
type TimeArgs<'a, 'py> = (Option<&'a Bound<'py, PyAny>>, Option<&'a Bound<'py, PyAny>>);

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

/// [`PyEngine::timelines`]'s answer for one history: ids, scores and errors, one entry per event.
type TimelineTuple = (Vec<Py<PyAny>>, Vec<Py<PyAny>>, Vec<Option<String>>);

/// A loaded engine directory (written by `recsys convert`).
#[pyclass(name = "Engine", module = "recsys", frozen)]
pub(crate) struct PyEngine {
    /// The engine in force; a call takes it once and answers (ids mapped back included) with it,
    /// so a catalogue loaded meanwhile never mixes into one call's answer.
    pub(crate) engine: RwLock<Arc<Engine>>,
    /// Where batches run: `None` on the CPU engine itself, or the model on a GPU.
    pub(crate) on_device: Option<Arc<dyn BatchRecommender>>,
    pub(crate) device: DeviceChoice,
    pub(crate) path: PathBuf,
    /// The local copy of an engine loaded from object storage, removed with the engine (the
    /// engine maps its files).
    pub(crate) _copy: Option<tempfile::TempDir>,
    /// Why an engine's layers (bf16 or int8) or its screen do not run on AMX tiles here (no AMX,
    /// or Linux refused the tile state); `None` where tiles were planned or nothing was asked
    /// of them.
    pub(crate) amx_refused: Option<String>,
}

impl PyEngine {
    /// The engine in force (see [`PyEngine::engine`]).
    pub(crate) fn engine(&self) -> Arc<Engine> {
        Arc::clone(&self.engine.read().unwrap_or_else(|p| p.into_inner()))
    }

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
    ) -> (Arc<Engine>, Vec<recsys_engine::Result<Recommendation>>) {
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
                filter: ask.filters.as_ref().map(|f| &f[i]),
                times: ask.times.as_ref().map(|t| t.row(i)),
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
            empty_history: Default::default(),
        };
        let engine = self.engine();
        let recommender: &dyn BatchRecommender = match &self.on_device {
            Some(device) => device.as_ref(),
            None => engine.as_ref(),
        };
        let answers = py.detach(|| engine.recommend_on(recommender, &requests, &options));
        (engine, answers)
    }

    /// One history's answer as [`PyEngine::predict`] returns it, appended to `rows`: ids (int64
    /// array or list of str) and float32 scores, the embedding when asked, or the refusal's
    /// message with empty ids and scores.
    fn push_row(
        engine: &Engine,
        py: Python<'_>,
        rows: &mut PredictRows,
        answer: recsys_engine::Result<Recommendation>,
        embedding: bool,
    ) -> PyResult<()> {
        let string_ids = engine.manifest.id_type == recsys_engine::idmap::IdType::String;
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
                // The engine's own words, as `recsys predict` writes them (recsys.ray's rows
                // equal the command's).
                rows.errors.push(Some(e.to_string()));
                return Ok(());
            }
        };
        let mut ints = Vec::with_capacity(answer.items.len());
        let mut names = Vec::new();
        for item in &answer.items {
            match engine.external_id(item.index) {
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
        rows.embeddings
            .push(embedding.then(|| PyArray1::from_vec(py, answer.embedding).into_any().unbind()));
        rows.errors.push(None);
        Ok(())
    }

    /// Ids of the wrong type for this engine in `lists` (the argument `argument`): strings that
    /// are not integers given to an engine of integer ids. With `strict` a `TypeError` naming the
    /// first; otherwise a warning (they are dropped as unknown, never silently).
    fn check_id_types(
        &self,
        py: Python<'_>,
        lists: &IdLists,
        argument: &str,
        strict: bool,
    ) -> PyResult<()> {
        let engine = self
            .engine
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if engine.ids.id_type() != recsys_engine::idmap::IdType::Int64 {
            return Ok(());
        }
        let wrong = lists.non_integers();
        let Some(&(row, at, id)) = wrong.first() else {
            return Ok(());
        };
        let what = format!(
            "{argument}[{row}][{at}] is '{id}', a str, but this engine's item ids are integers"
        );
        if strict {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "{what} (strict=True refuses ids of the wrong type)"
            )));
        }
        let message = format!(
            "{what}: {} id(s) of the wrong type dropped as unknown (strict=True refuses them)",
            wrong.len()
        );
        let category = py.get_type::<pyo3::exceptions::PyUserWarning>();
        let message = std::ffi::CString::new(message).expect("no NUL in a message");
        PyErr::warn(py, &category, &message, 1)
    }

    /// [`Self::answer_each`] for calls that fail as a whole: the first refused history raises.
    fn answer(
        &self,
        py: Python<'_>,
        histories: &IdLists,
        exclude: Option<&IdLists>,
        candidates: Option<&IdLists>,
        ask: &Ask,
    ) -> PyResult<(Arc<Engine>, Vec<Recommendation>)> {
        self.check_id_types(py, histories, "histories", ask.strict)?;
        if let Some(candidates) = candidates {
            self.check_id_types(py, candidates, "candidates", ask.strict)?;
        }
        let (engine, answers) = self.answer_each(py, histories, None, exclude, candidates, ask);
        let answers = answers
            .into_iter()
            .enumerate()
            .map(|(i, answer)| {
                answer.map_err(|e| match e {
                    // The sets a request names come from include_sets= and exclude_sets=.
                    EngineError::InvalidRequest(message)
                        if message.starts_with("unknown item set") =>
                    {
                        PyValueError::new_err(format!(
                            "include_sets / exclude_sets for histories[{i}]: {message}"
                        ))
                    }
                    EngineError::InvalidRequest(message) => {
                        PyValueError::new_err(format!("histories[{i}]: {message}"))
                    }
                    EngineError::UnknownIds {
                        input,
                        count,
                        examples,
                    } => PyValueError::new_err(unknown_ids_message(i, input, count, &examples)),
                    EngineError::NoKnownItem { ids, unknown, why } => {
                        PyValueError::new_err(no_known_item_message(i, ids, unknown, why))
                    }
                    other => engine_error(other),
                })
            })
            .collect::<PyResult<_>>()?;
        Ok((engine, answers))
    }

    /// `(ids, scores)` of ranked answers: scores `[B, width]` float32 padded with -inf; ids int64
    /// `[B, width]` padded with -1 for int catalogues, lists of strings (each its own length) for
    /// string catalogues.
    fn ranked<'py>(
        engine: &Engine,
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
            engine.external_id(index).ok_or_else(|| {
                RecsysError::new_err(format!(
                    "the engine returned item index {index}, outside its catalogue"
                ))
            })
        };
        let ids = if engine.manifest.id_type == recsys_engine::idmap::IdType::String {
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
    #[allow(clippy::too_many_arguments)] // one call's inputs, each optional
    fn rank<'py>(
        &self,
        py: Python<'py>,
        histories: &Bound<'py, PyAny>,
        candidates: Option<&Bound<'py, PyAny>>,
        exclude: Option<&Bound<'py, PyAny>>,
        sets: (Option<&Bound<'py, PyAny>>, Option<&Bound<'py, PyAny>>),
        times: TimeArgs<'_, 'py>,
        mut ask: Ask,
    ) -> PyResult<(Py<PyAny>, Bound<'py, PyArray2<f32>>)> {
        let width = self.width(ask.k.unwrap_or(10))?;
        let histories = IdLists::extract(histories, "histories")?;
        let candidates = IdLists::optional(candidates, "candidates", histories.len())?;
        let exclude = IdLists::optional(exclude, "exclude", histories.len())?;
        ask.filters = crate::filters::item_filters(sets.0, sets.1, histories.len())?;
        ask.times = crate::times::Times::extract(times.0, times.1, histories.len())?;
        let (engine, answers) =
            self.answer(py, &histories, exclude.as_ref(), candidates.as_ref(), &ask)?;
        Self::ranked(&engine, py, &answers, width)
    }

    fn width(&self, k: i64) -> PyResult<usize> {
        if k < 1 {
            return Err(PyValueError::new_err(format!(
                "k must be at least 1, got {k}"
            )));
        }
        Ok((k as usize).min(self.engine().n_items()))
    }
}

#[pymethods]
impl PyEngine {
    /// Loads an engine directory; `threads` scoring threads per call (default: the available
    /// cores); `device` "cpu", or "cuda"/"cuda:N" in a package built with CUDA support (the whole
    /// model on that GPU, checked against the CPU engine at load; `score` stays on the CPU).
    #[new]
    #[pyo3(signature = (path, threads = None, device = "cpu", prefix_cache_bytes = 0, screen_policy = "auto",
                        bf16_path = "auto", amx = "auto", row_block = "auto", thread_plan = "auto"))]
    #[allow(clippy::too_many_arguments)] // mirrors the Python signature, keyword arguments
    fn new(
        py: Python<'_>,
        path: PathBuf,
        threads: Option<i64>,
        device: &str,
        prefix_cache_bytes: usize,
        screen_policy: &str,
        bf16_path: &str,
        amx: &str,
        row_block: &str,
        thread_plan: &str,
    ) -> PyResult<Self> {
        let screen_policy: recsys_engine::plan::ScreenPolicy =
            screen_policy.parse().map_err(PyValueError::new_err)?;
        let bf16_path: recsys_engine::plan::Bf16Path =
            bf16_path.parse().map_err(PyValueError::new_err)?;
        let amx: recsys_engine::plan_amx::AmxPolicy = amx.parse().map_err(PyValueError::new_err)?;
        let row_block: recsys_engine::plan::RowBlockPolicy =
            row_block.parse().map_err(PyValueError::new_err)?;
        let thread_plan: recsys_engine::plan::ThreadPolicy =
            thread_plan.parse().map_err(PyValueError::new_err)?;
        // Checked before the engine loads (a large one takes a while to refuse over a typo).
        let threads = match threads {
            Some(t) if !(1..=MAX_THREADS as i64).contains(&t) => {
                return Err(PyValueError::new_err(format!(
                    "threads must be between 1 and {MAX_THREADS} (or None for one per CPU), got {t}"
                )))
            }
            Some(t) => t as usize,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        let device = DeviceChoice::parse(device)?;
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
        engine.set_threads(threads);
        if prefix_cache_bytes > 0 {
            engine
                .set_prefix_cache(Some(recsys_engine::prefix_cache::PrefixCache::new(
                    prefix_cache_bytes,
                    None,
                )))
                .map_err(|e| PyValueError::new_err(e.to_string()))?;
        }
        py.detach(|| engine.plan_screen(screen_policy).is_some());
        py.detach(|| engine.plan_bf16_path(bf16_path).is_some());
        py.detach(|| engine.plan_row_block(row_block).is_some());
        // A CPU or process without AMX runs the SIMD tables; `kernel_plan` says why.
        let amx_refused = py.detach(|| engine.plan_amx(amx).err());
        py.detach(|| engine.plan_threads(thread_plan).is_some());
        let engine = Arc::new(engine);
        let on_device = py.detach(|| device::recommender(device, &engine))?;
        Ok(PyEngine {
            engine: RwLock::new(engine),
            on_device,
            device,
            path,
            _copy: copy,
            amx_refused,
        })
    }

    /// "bert4rec", "vaecf", "sasrec" or "gru4rec".
    #[getter]
    fn kind(&self) -> &'static str {
        self.engine().kind().as_str()
    }

    /// "fp32", "fp16", "bf16" or "int8".
    #[getter]
    fn precision(&self) -> &'static str {
        self.engine().manifest.precision.as_str()
    }

    /// Items in the catalogue (N).
    #[getter]
    fn num_items(&self) -> usize {
        self.engine().n_items()
    }

    /// Scoring threads per call.
    #[getter]
    fn threads(&self) -> usize {
        self.engine().scorer.threads
    }

    /// Values in a user embedding: the model's hidden size plus the trailing 1.
    #[getter]
    fn embedding_dim(&self) -> usize {
        self.engine().model.output().input_size() + 1
    }

    /// The item set names requests may filter by (`column=value`, from `recsys convert
    /// --item-attributes`), each with its item count.
    #[getter]
    fn item_sets(&self) -> std::collections::BTreeMap<String, u64> {
        self.engine().filters.view().summary().into_iter().collect()
    }

    /// Puts a live availability object in force (a file, or s3://... / gs://...; written by
    /// `recsys availability publish`): its sets join `item_sets` (a column of the same name hides
    /// the engine's) and filters may name them. Refused when it is damaged or not newer than the
    /// one in force. Returns its version.
    fn load_availability(&self, py: Python<'_>, source: &str) -> PyResult<u64> {
        let engine = self.engine();
        py.detach(|| recsys_registry::availability::apply(&engine, source))
            .map(|applied| applied.version)
            .map_err(|e| RecsysError::new_err(e.to_string()))
    }

    /// Puts a live catalogue delta in force (a published object: a file, or s3://... / gs://...;
    /// written by `recsys catalogue publish` for this engine): items it adds can be recommended,
    /// items it retires never are, replaced rows score as given. Refused when it is damaged, made
    /// for another engine, or a row cannot apply; the catalogue in force then stays. Returns its
    /// version.
    fn load_catalogue(&self, py: Python<'_>, source: &str) -> PyResult<u64> {
        if self.on_device.is_some() {
            return Err(RecsysError::new_err(
                "an engine on a GPU (device=\"cuda\") holds the item tables copied at load; \
                 load the catalogue on a CPU engine",
            ));
        }
        let engine = self.engine();
        let next = py
            .detach(|| {
                let delta = recsys_registry::catalogue::read(&engine, source)?;
                engine
                    .with_catalogue(&delta)
                    .map_err(|e| recsys_registry::RegistryError::Input(e.to_string()))
            })
            .map_err(|e| RecsysError::new_err(e.to_string()))?;
        let version = next.catalogue().map_or(0, |c| c.version);
        *self.engine.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(next);
        Ok(version)
    }

    /// The version of the catalogue delta in force (`None`: the catalogue as converted).
    #[getter]
    fn catalogue_version(&self) -> Option<u64> {
        self.engine().catalogue().map(|c| c.version)
    }

    /// The prefix cache's counters (`None` without one): hits, misses, events computed and
    /// reused, evictions, expirations, bytes and entries held.
    #[getter]
    fn prefix_cache_stats(&self) -> Option<std::collections::BTreeMap<&'static str, u64>> {
        self.engine().prefix_cache().map(|cache| {
            let s = cache.stats();
            [
                ("hits", s.hits),
                ("misses", s.misses),
                ("events_computed", s.events_computed),
                ("events_reused", s.events_reused),
                ("evictions", s.evictions),
                ("expirations", s.expirations),
                ("bytes", s.bytes),
                ("entries", s.entries),
            ]
            .into_iter()
            .collect()
        })
    }

    /// A screened engine's plan: per batch size, its int8 screen or its plain scan, and where
    /// the plan came from (`None` for an engine without a screen).
    #[getter]
    fn screen_plan(&self) -> Option<String> {
        self.engine().screen_plan().map(|p| p.describe())
    }

    /// A bf16 engine's kernels per batch size: on a CPU with AVX512-BF16, `vdpbf16ps` or widened
    /// to f32; on a CPU with AMX, whether the output layer runs on AMX tiles (or why tiles are
    /// not used); with the times behind each choice and where it came from. `None` for other
    /// engines, and for bf16 engines on CPUs with neither.
    #[getter]
    fn kernel_plan(&self) -> Option<String> {
        let engine = self.engine();
        let amx = match (engine.amx_plan(), &self.amx_refused) {
            (Some(plan), _) => Some(format!("AMX {}", plan.describe())),
            (None, Some(why)) => Some(format!("AMX tiles not used: {why}")),
            (None, None) => None,
        };
        [engine.bf16_path_plan().map(|p| p.describe()), amx]
            .into_iter()
            .flatten()
            .reduce(|a, b| format!("{a}; {b}"))
    }

    /// The largest row group AVX-512 kernels cut a batch into (8 or 4 rows), the times behind the
    /// choice and where it came from; `None` for kernels with one row block (scalar, AVX2).
    #[getter]
    fn row_block_plan(&self) -> Option<String> {
        self.engine().row_block_plan().map(|p| p.describe())
    }

    /// How many of the engine's threads each batch size gets, the times behind it and where the
    /// plan came from; `None` for an engine of one thread.
    #[getter]
    fn thread_plan(&self) -> Option<String> {
        self.engine().thread_plan().map(|p| p.describe())
    }

    /// The version of the availability object in force (`None`: none).
    #[getter]
    fn availability_version(&self) -> Option<u64> {
        self.engine().filters.availability_version()
    }

    /// The external ids of items 1..=N (the columns of `score`): int64 array or list of str.
    #[getter]
    fn item_ids(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let engine = self.engine();
        let ids = (1..=engine.n_items() as u32).map(|i| engine.external_id(i));
        if engine.manifest.id_type == recsys_engine::idmap::IdType::String {
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

    /// The best `k` items of each history (oldest first, external ids), best first; only items
    /// of the `include_sets` and none of the `exclude_sets` (item set names, one list for all
    /// histories or one per history).
    #[pyo3(signature = (histories, k = 10, exclude = None, exclude_seen = true, strict = false,
                        include_sets = None, exclude_sets = None, timestamps = None,
                        query_timestamp = None))]
    #[allow(clippy::too_many_arguments)] // mirrors the Python signature, keyword arguments
    fn recommend<'py>(
        &self,
        py: Python<'py>,
        histories: &Bound<'py, PyAny>,
        k: i64,
        exclude: Option<&Bound<'py, PyAny>>,
        exclude_seen: bool,
        strict: bool,
        include_sets: Option<&Bound<'py, PyAny>>,
        exclude_sets: Option<&Bound<'py, PyAny>>,
        timestamps: Option<&Bound<'py, PyAny>>,
        query_timestamp: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(Py<PyAny>, Bound<'py, PyArray2<f32>>)> {
        let ask = Ask {
            k: Some(k),
            filters: None,
            default_k: 10,
            exclude_seen,
            strict,
            embedding: false,
            times: None,
        };
        self.rank(
            py,
            histories,
            None,
            exclude,
            (include_sets, exclude_sets),
            (timestamps, query_timestamp),
            ask,
        )
    }

    /// The best `k` of each history's own candidates, with exactly the scores the whole-catalogue
    /// scan gives them.
    #[pyo3(signature = (histories, candidates, k = 10, exclude = None, exclude_seen = true, strict = false,
                        include_sets = None, exclude_sets = None, timestamps = None,
                        query_timestamp = None))]
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
        include_sets: Option<&Bound<'py, PyAny>>,
        exclude_sets: Option<&Bound<'py, PyAny>>,
        timestamps: Option<&Bound<'py, PyAny>>,
        query_timestamp: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(Py<PyAny>, Bound<'py, PyArray2<f32>>)> {
        let ask = Ask {
            k: Some(k),
            filters: None,
            default_k: 10,
            exclude_seen,
            strict,
            embedding: false,
            times: None,
        };
        self.rank(
            py,
            histories,
            Some(candidates),
            exclude,
            (include_sets, exclude_sets),
            (timestamps, query_timestamp),
            ask,
        )
    }

    /// Each history's user embedding `[h, 1]`, float32 `[B, embedding_dim]`.
    #[pyo3(signature = (histories, strict = false, timestamps = None, query_timestamp = None))]
    fn embed<'py>(
        &self,
        py: Python<'py>,
        histories: &Bound<'py, PyAny>,
        strict: bool,
        timestamps: Option<&Bound<'py, PyAny>>,
        query_timestamp: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let histories = IdLists::extract(histories, "histories")?;
        let times = crate::times::Times::extract(timestamps, query_timestamp, histories.len())?;
        let ask = Ask {
            times,
            k: Some(0),
            filters: None,
            default_k: 10,
            exclude_seen: true,
            strict,
            embedding: true,
        };
        let (_, answers) = self.answer(py, &histories, None, None, &ask)?;
        let width = self.embedding_dim();
        let values: Vec<f32> = answers.into_iter().flat_map(|a| a.embedding).collect();
        Ok(Array2::from_shape_vec((histories.len(), width), values)
            .expect("one embedding per history")
            .into_pyarray(py))
    }

    /// Every item's score for each history, float32 `[B, N]` (column j is `item_ids[j]`), with
    /// nothing left out: for evaluation. Unknown ids are dropped (with their timestamps, for the
    /// models that read time).
    #[pyo3(signature = (histories, timestamps = None, query_timestamp = None))]
    fn score<'py>(
        &self,
        py: Python<'py>,
        histories: &Bound<'py, PyAny>,
        timestamps: Option<&Bound<'py, PyAny>>,
        query_timestamp: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let histories = IdLists::extract(histories, "histories")?;
        let times = crate::times::Times::extract(timestamps, query_timestamp, histories.len())?;
        let views = histories.str_views();
        let engine = self.engine();
        // Mapped as a request is (the known ids, their timestamps, the query time), so a model
        // that reads time is refused by name without them.
        let mapped: Vec<recsys_engine::InternalRequest> = (0..histories.len())
            .map(|i| {
                let request = Request {
                    history: histories.row(&views, i),
                    k: None,
                    exclude: None,
                    candidates: None,
                    embedding: false,
                    filter: None,
                    times: times.as_ref().map(|t| t.row(i)),
                };
                if engine.kind().reads_timestamps() {
                    let options = ServeOptions {
                        empty_history: recsys_engine::EmptyHistoryPolicy::Model,
                        ..ServeOptions::default()
                    };
                    return engine
                        .prepare(&request, &options)
                        .map(|(internal, _)| internal)
                        .map_err(crate::engine_error);
                }
                Ok(recsys_engine::InternalRequest {
                    history: engine.ids.map(request.history).indices,
                    ..Default::default()
                })
            })
            .collect::<PyResult<_>>()?;
        let n = engine.n_items();
        let all = py.detach(|| {
            let refs: Vec<&[u32]> = mapped.iter().map(|r| r.history.as_slice()).collect();
            let times: Vec<recsys_engine::models::EventTimes<'_>> =
                if engine.kind().reads_timestamps() {
                    mapped.iter().map(|r| r.event_times()).collect()
                } else {
                    Vec::new()
                };
            engine.score_all_timed(&refs, &times)
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
                        exclude_seen = true, strict = false, embedding = false,
                        include_sets = None, exclude_sets = None, timestamps = None,
                        query_timestamp = None))]
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
        include_sets: Option<&Bound<'py, PyAny>>,
        exclude_sets: Option<&Bound<'py, PyAny>>,
        timestamps: Option<&Bound<'py, PyAny>>,
        query_timestamp: Option<&Bound<'py, PyAny>>,
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
            times: crate::times::Times::extract(timestamps, query_timestamp, users)?,
            k: None,
            filters: crate::filters::item_filters(include_sets, exclude_sets, users)?,
            default_k,
            exclude_seen,
            strict,
            embedding,
        };
        if !strict {
            // Under strict=True each such row carries its error instead.
            self.check_id_types(py, &histories, "histories", false)?;
        }
        let (engine, answers) = self.answer_each(
            py,
            &histories,
            k.as_deref(),
            exclude.as_ref(),
            candidates.as_ref(),
            &ask,
        );
        let mut rows = PredictRows::default();
        for answer in answers {
            Self::push_row(&engine, py, &mut rows, answer, embedding)?;
        }
        Ok((rows.ids, rows.scores, rows.embeddings, rows.errors))
    }

    /// Each history's answers after each of its events, for replaying a log or precomputing:
    /// event t answers the history's first t ids as `predict` would. Every history's prefixes of
    /// one length run as one batch, shortest first, so an engine with a prefix cache
    /// (`prefix_cache_bytes`: GRU4Rec, SASRec and HSTU) computes one event per history per step
    /// (HSTU two), n steps for n events; without one each prefix is recomputed (n(n+1)/2
    /// events). For a model that reads time (HSTU) `timestamps=` gives each history's event
    /// times and each prefix is queried at its next event's time (the last one at
    /// `query_timestamp=`, or now). Returns one `(ids, scores, errors)` triple per history, each
    /// a list with one entry per event (a step with no known item has its error and empty ids
    /// and scores).
    #[pyo3(signature = (histories, k = 10, exclude_seen = true, strict = false, timestamps = None,
                        query_timestamp = None))]
    #[allow(clippy::too_many_arguments)]
    fn timelines(
        &self,
        py: Python<'_>,
        histories: &Bound<'_, PyAny>,
        k: i64,
        exclude_seen: bool,
        strict: bool,
        timestamps: Option<&Bound<'_, PyAny>>,
        query_timestamp: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<TimelineTuple>> {
        let default_k = self.width(k)?;
        let histories = IdLists::extract(histories, "histories")?;
        let times = crate::times::Times::extract(timestamps, query_timestamp, histories.len())?;
        if let Some(times) = &times {
            times.check_lengths(&histories)?;
        }
        if !strict {
            self.check_id_types(py, &histories, "histories", false)?;
        }
        let mut timelines: Vec<PredictRows> = (0..histories.len())
            .map(|_| PredictRows::default())
            .collect();
        for t in 1..=histories.longest() {
            let (which, step) = histories.prefixes(t);
            let ask = Ask {
                k: None,
                filters: None,
                default_k,
                exclude_seen,
                strict,
                embedding: false,
                times: times.as_ref().map(|times| times.prefixes(&which, t)),
            };
            let (engine, answers) = self.answer_each(py, &step, None, None, None, &ask);
            for (i, answer) in which.into_iter().zip(answers) {
                Self::push_row(&engine, py, &mut timelines[i], answer, false)?;
            }
        }
        Ok(timelines
            .into_iter()
            .map(|rows| (rows.ids, rows.scores, rows.errors))
            .collect())
    }

    /// Where batches run: "cpu" or "cuda:N".
    #[getter]
    fn device(&self) -> String {
        self.device.name()
    }

    /// The engine's metadata as a plain dict: kind, precision, items, id type, embedding width,
    /// threads, device, path, the weights' SHA-256 (what catalogue deltas name), the live
    /// catalogue and availability versions in force, and the whole manifest (`manifest`: the
    /// source checkpoint, quantization, calibration, screen, item attributes, popularity counts,
    /// a folded catalogue, when and by what it was written).
    ///
    /// >>> engine.info["kind"], engine.info["num_items"]
    /// ('sasrec', 2000)
    #[getter]
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let engine = self.engine();
        let manifest = serde_json::to_value(&engine.manifest)
            .map_err(|e| RecsysError::new_err(format!("the manifest does not serialise: {e}")))?;
        let info = serde_json::json!({
            "kind": self.kind(),
            "precision": self.precision(),
            "num_items": self.num_items(),
            "id_type": engine.manifest.id_type,
            "embedding_dim": self.embedding_dim(),
            "threads": self.threads(),
            "device": self.device(),
            "path": self.path.display().to_string(),
            "weights_sha256": engine.weights_sha256(),
            "catalogue_version": engine.catalogue().map(|c| c.version),
            "availability_version": engine.filters.availability_version(),
            "manifest": manifest,
        });
        py.import("json")?
            .call_method1("loads", (info.to_string(),))
    }

    fn __repr__(&self) -> String {
        format!(
            "recsys.Engine({:?}, kind={}, precision={}, items={}, threads={}, device={})",
            self.path.display().to_string(),
            self.kind(),
            self.precision(),
            self.num_items(),
            self.threads(),
            self.device()
        )
    }
}

/// The most scoring threads an engine takes: far above any machine's cores, far below what would
/// exhaust a process's threads.
const MAX_THREADS: usize = 1024;

/// A refused call's unknown ids in the package's own terms: the argument and row, the ids, and
/// the `strict=` that refused them.
fn unknown_ids_message(
    row: usize,
    input: recsys_engine::IdInput,
    count: usize,
    examples: &[String],
) -> String {
    let argument = match input {
        recsys_engine::IdInput::History => "histories",
        recsys_engine::IdInput::Candidates => "candidates",
    };
    let shown = examples.join(", ");
    let more = if count > examples.len() { ", ..." } else { "" };
    format!(
        "{argument}[{row}] holds {count} id(s) the model does not know ({shown}{more}); \
         strict=True refuses them (strict=False drops them)"
    )
}

/// A refused history without a known item, in the package's terms: the argument and row, and
/// how an engine answers such histories.
fn no_known_item_message(
    row: usize,
    ids: usize,
    unknown: usize,
    why: recsys_engine::NoKnownItemRefusal,
) -> String {
    let reason = match why {
        recsys_engine::NoKnownItemRefusal::ModelNeedsHistory(kind) => format!(
            "{kind} answers from the history's last item, so it needs at least one; an engine \
             converted with interactions= (recsys.convert, or recsys convert --interactions) \
             answers such histories with the most popular items"
        ),
        recsys_engine::NoKnownItemRefusal::NoPopularityList => "the engine has no popularity \
            list to answer it (convert it with interactions=)"
            .to_string(),
        recsys_engine::NoKnownItemRefusal::PolicyRefuses => {
            "the engine's empty-history policy refuses such histories".to_string()
        }
    };
    format!(
        "histories[{row}] holds no item the model knows ({ids} id(s), {unknown} unknown): {reason}"
    )
}
