//! The serving API: external ids in, top-k external ids and scores out.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::catalogue::{CatalogueDelta, CatalogueSummary};
use crate::config::ModelKind;
use crate::engine_dir::{self, Manifest, Screen};
use crate::error::{EngineError, Result};
use crate::filters::{FilterView, Filters};
use crate::idmap::{ExternalId, IdMap};
use crate::kernels::fused::{self, Exclusions, RowQuery};
use crate::kernels::item_mask::ItemMask;
use crate::kernels::packed::PackedOutput;
use crate::kernels::screen::{self, ScreenTable};
use crate::kernels::KernelTable;
use crate::models::{EncodeScratch, EventTimes, HistoryNote, Model};
use crate::popularity::Popularity;
use crate::prefix_cache::{KeyLayout, PrefixCache, State};
use crate::request::{
    excluded_items, BatchRecommender, EmptyHistoryPolicy, InternalRequest, Recommendation, Request,
    RowAnswer, ServeOptions, UnknownIds, UnknownItemPolicy,
};
use crate::topk::Scored;

/// The output layer as the fused kernels read it, and how to run them.
pub struct Scorer {
    pub packed: PackedOutput,
    /// The int8 screen of a `screen: int8` engine ([`crate::engine_dir::Screen`]): whole-catalogue
    /// top-k reads it instead of `packed`, and rescores the survivors from the reference weights.
    pub screen: Option<ScreenTable>,
    pub kernels: &'static KernelTable,
    /// Threads one batch's scoring may use (instances x threads should fit the cores).
    pub threads: usize,
    /// A bf16 output layer's AMX tiles (built from `packed`, the same values), run by calls
    /// whose kernel table is tiled ([`Engine::plan_amx`], [`Engine::kernels_for`]).
    pub amx: Option<Arc<crate::kernels::fused_amx::AmxLayer>>,
    /// An int8 output layer's AMX-INT8 tiles (int8 and W8A8 engines; the same values as
    /// `packed`, the same scores to the bit), run like `amx`.
    pub amx_int8: Option<Arc<crate::kernels::fused_amx_i8::AmxI8Layer>>,
}

/// Each row's best items, best first.
pub type RankedRows = Vec<Vec<Scored>>;

/// How a ranking among some of the output layer's rows reads them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RowAccess {
    /// Through the mapping: candidate lists, which the caller picked and may repeat.
    Mapped,
    /// By positioned reads of the file when the table is large: a screen's survivors.
    Scattered,
}

impl BatchRecommender for Engine {
    fn recommend_batch(&self, batch: &[InternalRequest]) -> Result<Vec<RowAnswer>> {
        Ok(self.recommend_internal(batch))
    }
}

/// Each row's exclusions over the whole catalogue: its own list and PAD, never an item.
fn whole_catalogue_exclusions(excluded: Vec<Vec<u32>>) -> Vec<Exclusions> {
    excluded
        .into_iter()
        .map(|mut list| {
            list.push(0);
            Exclusions::new(list)
        })
        .collect()
}

/// One query per row: its k, its exclusions, the items its filter keeps (`None`: all).
fn queries_of<'a>(
    ks: &[usize],
    exclusions: &'a [Exclusions],
    eligible: &'a [Option<std::sync::Arc<ItemMask>>],
) -> Vec<RowQuery<'a>> {
    ks.iter()
        .zip(exclusions)
        .zip(eligible)
        .map(|((&k, excluded), eligible)| RowQuery {
            k,
            excluded,
            eligible: eligible.as_deref(),
        })
        .collect()
}

/// What each whole-catalogue row leaves out: its exclusions and the items its filter keeps.
pub(crate) struct RowLimits {
    pub excluded: Vec<Vec<u32>>,
    pub eligible: Vec<Option<std::sync::Arc<ItemMask>>>,
}

impl Scorer {
    /// For each row of `hidden` (`[rows, d]`): its best `ks[row]` items, best first, never index 0
    /// (PAD) nor any of `limits.excluded[row]` (unsorted, may repeat), only items its mask keeps.
    /// On up to `threads` pool threads, with `kernels` (the call's: see [`Engine::kernels_for`]).
    fn top_k(
        &self,
        kernels: &KernelTable,
        hidden: &[f32],
        ks: &[usize],
        limits: RowLimits,
        threads: usize,
    ) -> RankedRows {
        let exclusions = whole_catalogue_exclusions(limits.excluded);
        let queries = queries_of(ks, &exclusions, &limits.eligible);
        if let Some(tiles) = self.amx.as_ref().filter(|_| kernels.tiles) {
            // Tiles were checked runnable when planned; should they fail all the same, the SIMD
            // scan answers (the same bf16 layer).
            if let Ok(ranked) =
                crate::kernels::fused_amx::top_k_bf16(tiles, hidden, &queries, threads)
            {
                return ranked;
            }
        }
        if let Some(tiles) = self.amx_int8.as_ref().filter(|_| kernels.tiles) {
            // As above; here the SIMD scan's answer is the tiles' to the bit.
            if let Ok(ranked) =
                crate::kernels::fused_amx_i8::top_k(tiles, &self.packed, hidden, &queries, threads)
            {
                return ranked;
            }
        }
        fused::top_k(kernels, &self.packed, hidden, &queries, threads)
    }
}

/// A loaded model with its id map.
pub struct Engine {
    pub manifest: Manifest,
    pub model: Model,
    pub ids: IdMap,
    pub path: Option<PathBuf>,
    pub scorer: Scorer,
    /// The item attribute sets requests filter by, and their resolved masks.
    pub filters: Filters,
    /// Interaction counts, the answer to an empty history (an engine converted with
    /// `--interactions`).
    pub popularity: Option<Popularity>,
    /// States after recent histories, so a history one event longer computes one event (causal
    /// models only; see [`Engine::set_prefix_cache`]).
    prefix_cache: Option<PrefixCache>,
    /// Per batch size, whether a screened engine runs its screen or the plain scan (see
    /// [`Engine::plan_screen`]); `None`: the screen always runs.
    screen_plan: Option<crate::plan::ScreenPlan>,
    /// A bf16 engine's kernel path on a CPU with AVX512-BF16 (see [`Engine::plan_bf16_path`]);
    /// `None`: the native path (or nothing to choose).
    bf16_path_plan: Option<crate::plan::Bf16PathPlan>,
    /// The row block of an engine whose kernels come in two (see [`Engine::plan_row_block`]).
    row_block_plan: Option<crate::plan::RowBlockPlan>,
    /// A bf16 engine's AMX choice (see [`Engine::plan_amx`]); the tiles themselves live in the
    /// scorer while some batch size uses them.
    amx_plan: Option<crate::plan_amx::AmxPlan>,
    /// Per batch size, how many of the scorer's threads a call uses (see
    /// [`Engine::plan_threads`]); `None`: all of them.
    thread_plan: Option<crate::plan::ThreadPlan>,
    /// The engine as converted: what a catalogue delta applies to ([`Engine::with_catalogue`]).
    converted: Arc<Converted>,
    /// The catalogue delta in force (`None`: the catalogue as converted).
    catalogue: Option<CatalogueSummary>,
    /// Converted items whose input rows the delta in force replaced, ascending.
    changed_inputs: Arc<[u32]>,
    /// Items the engine directory itself keeps retired (a compacted engine's
    /// `retired_items.tsv`), ascending: out of every answer unless a delta upserts them.
    kept_retired: Arc<[u32]>,
}

/// What a catalogue delta is applied to: the engine's stored tensors (mapped, not copied), ids
/// as converted. Every delta applies to these, never to another delta. (The converted ids are the
/// first `config.n_items()` of the engine's, and its item sets the engine's own: a delta only
/// appends items, in no set.)
struct Converted {
    config: crate::config::ModelConfig,
    weights: crate::weights::Weights,
}

/// Packs the output layer (at whatever precision it is stored) for the fused kernels; W8A8 engines
/// also carry their calibrated activation scale.
fn packed_output(loaded: &engine_dir::LoadedDir) -> Result<PackedOutput> {
    let out = loaded.model.output();
    let bad = |reason: String| EngineError::EngineDir {
        path: loaded.path.clone(),
        reason,
    };
    let packed = match (&loaded.kernels, &loaded.manifest.kernel_layout) {
        // Stored laid out: mapped, not copied.
        (Some(backing), Some(layout)) => crate::engine_dir::kernel_file::map_output(
            backing,
            layout,
            out.n_outputs(),
            out.input_size(),
            loaded.manifest.precision,
        )
        .map_err(bad)?,
        _ => out.weight.pack(out.bias.as_slice()),
    };
    match loaded.manifest.output_activation_scale().map_err(bad)? {
        None => Ok(packed),
        Some(_) if !matches!(out.weight, crate::weights::Matrix::I8 { .. }) => {
            Err(bad("w8a8 engine whose output layer is not int8".into()))
        }
        Some(scale) => Ok(packed.with_static_activation_scale(scale)),
    }
}

/// The int8 screening table of a `screen: int8` engine, built from the output layer's stored
/// reference weights (fp32, or fp16 widened: the values the dense kernel reads).
fn screen_table(loaded: &engine_dir::LoadedDir) -> Result<Option<ScreenTable>> {
    if loaded.manifest.screen == Screen::None {
        return Ok(None);
    }
    let out = loaded.model.output();
    if matches!(out.weight, crate::weights::Matrix::I8 { .. }) {
        return Err(EngineError::EngineDir {
            path: loaded.path.clone(),
            reason: "screen int8 on an int8 engine: the screen is for fp32 and fp16 engines".into(),
        });
    }
    let (n, d) = (out.n_outputs(), out.input_size());
    if let (Some(backing), Some(layout)) = (&loaded.kernels, &loaded.manifest.kernel_layout) {
        return crate::engine_dir::kernel_file::map_screen(backing, layout, n, d)
            .map(Some)
            .map_err(|reason| EngineError::EngineDir {
                path: loaded.path.clone(),
                reason,
            });
    }
    Ok(Some(screen_of(out)))
}

/// The int8 screening table of an fp32 or fp16 output layer, from its reference weights (fp32,
/// or fp16 widened: the values the dense kernel reads): what loading builds for an engine without
/// `kernels.bin`, and what conversion stores in it.
pub(crate) fn screen_of(out: &crate::models::OutputLayer) -> ScreenTable {
    let (n, d) = (out.n_outputs(), out.input_size());
    let mut reference = vec![0f32; n * d];
    for (i, row) in reference.chunks_exact_mut(d).enumerate() {
        out.weight.add_row_into(i, row);
    }
    ScreenTable::new(&reference, out.bias.as_slice(), d)
}

impl Engine {
    /// Loads and verifies an engine directory; the kernels are the best this CPU runs (or
    /// `RECSYS_FORCE_ISA`), with one scoring thread.
    pub fn load(dir: &Path) -> Result<Engine> {
        Engine::load_limited(dir, engine_dir::DEFAULT_MAX_ENGINE_BYTES)
    }

    /// [`Engine::load`] refusing engines whose files hold more than `max_engine_bytes`.
    pub fn load_limited(dir: &Path, max_engine_bytes: u64) -> Result<Engine> {
        Engine::load_with(
            dir,
            &engine_dir::LoadOptions {
                max_engine_bytes,
                ..Default::default()
            },
        )
    }

    /// [`Engine::load`] with explicit [`engine_dir::LoadOptions`].
    pub fn load_with(dir: &Path, options: &engine_dir::LoadOptions) -> Result<Engine> {
        let loaded = engine_dir::load_with(dir, options)?;
        let packed = packed_output(&loaded)?;
        let screen = screen_table(&loaded)?;
        let converted = Arc::new(Converted {
            config: loaded.manifest.model.clone(),
            weights: loaded.weights.clone(),
        });
        let filters = Filters::retiring(
            loaded.item_sets,
            loaded.model.output().n_outputs(),
            &loaded.retired,
        );
        let popularity = loaded.popularity;
        Ok(Engine {
            manifest: loaded.manifest,
            model: loaded.model,
            ids: loaded.ids,
            path: Some(loaded.path),
            scorer: Scorer {
                packed,
                screen,
                kernels: KernelTable::detect(),
                threads: 1,
                amx: None,
                amx_int8: None,
            },
            filters,
            popularity,
            prefix_cache: None,
            screen_plan: None,
            bf16_path_plan: None,
            row_block_plan: None,
            amx_plan: None,
            thread_plan: None,
            converted,
            catalogue: None,
            changed_inputs: Arc::from([]),
            kept_retired: Arc::from(loaded.retired),
        })
    }

    /// This engine with `delta` as its catalogue: the engine conversion would have built with
    /// those rows (see [`crate::catalogue`]), on the same kernels, threads and plans. The delta
    /// replaces whatever delta this engine had (it holds every change since conversion). A delta
    /// that cannot apply is refused, naming the item, and this engine is untouched. The new
    /// engine keeps this one's prefix cache (its budget, counters and every state whose history
    /// holds no item whose input row changed between the two engines) and availability in force.
    pub fn with_catalogue(&self, delta: &CatalogueDelta) -> Result<Engine> {
        let converted = &self.converted;
        let applied = self.applied(delta)?;
        let mut model = Model::from_tensors(&applied.config, &applied.weights)?;
        if self.manifest.static_dense_activations() {
            let scales = self
                .manifest
                .dense_activation_scales()
                .map_err(EngineError::Config)?;
            model.set_static_activation_scales(&scales)?;
        }
        model.set_kernels(self.model.kernels());
        if let Some(tiled) = self
            .scorer
            .kernels
            .tiled()
            .filter(|_| self.amx_plan.as_ref().is_some_and(|p| p.uses_tiles()))
        {
            model.prepare_tiles(tiled);
        }
        let out = model.output();
        let mut packed = out.weight.pack(out.bias.as_slice());
        if let Some(scale) = self.scorer.packed.activation_scale {
            packed = packed.with_static_activation_scale(scale);
        }
        // New rows, new tiles; the plan stands (the layer's shape is the same but for items).
        let screen = self.scorer.screen.as_ref().map(|old| {
            let mut screen = screen_of(out);
            if old.has_tiles() {
                // The same process ran tiles for the old screen, so they run for this one; were
                // they refused all the same, its scans run on the SIMD tables (same answers).
                let _ = screen.prepare_tiles();
            }
            screen
        });
        let amx =
            self.scorer.amx.as_ref().and_then(|_| {
                crate::kernels::fused_amx::AmxLayer::from_packed(&packed).map(Arc::new)
            });
        let amx_int8 = self.scorer.amx_int8.as_ref().and_then(|_| {
            crate::kernels::fused_amx_i8::AmxI8Layer::from_packed(&packed).map(Arc::new)
        });
        let n_outputs = out.n_outputs();
        let retired = self.retired_with(&applied.retired, &applied.upserted);
        let filters = Filters::retiring(self.filters.sets().grown(n_outputs), n_outputs, &retired);
        // The availability in force stays in force, mapped onto the new catalogue (new items are
        // in its sets when the object lists them).
        if let Some(live) = self.filters.view().availability() {
            filters
                .replace_availability(live.object.map(&applied.ids))
                .map_err(EngineError::Config)?;
        }
        let mut manifest = self.manifest.clone();
        manifest.model = applied.config;
        Ok(Engine {
            manifest,
            model,
            ids: applied.ids,
            path: self.path.clone(),
            scorer: Scorer {
                packed,
                screen,
                kernels: self.scorer.kernels,
                threads: self.scorer.threads,
                amx,
                amx_int8,
            },
            filters,
            popularity: self.popularity.clone(),
            prefix_cache: self.prefix_cache.as_ref().map(|cache| {
                let (before, after) = (&self.changed_inputs, &applied.changed_inputs);
                cache.carried(self.cache_key_layout(), |i| {
                    before.binary_search(&i).is_ok() || after.binary_search(&i).is_ok()
                })
            }),
            screen_plan: self.screen_plan.clone(),
            bf16_path_plan: self.bf16_path_plan.clone(),
            row_block_plan: self.row_block_plan.clone(),
            amx_plan: self.amx_plan.clone(),
            thread_plan: self.thread_plan.clone(),
            converted: Arc::clone(converted),
            catalogue: Some(applied.summary),
            changed_inputs: Arc::from(applied.changed_inputs),
            kept_retired: Arc::clone(&self.kept_retired),
        })
    }

    /// The engine as converted with `delta` applied (see [`crate::catalogue::apply`]).
    pub(crate) fn applied(&self, delta: &CatalogueDelta) -> Result<crate::catalogue::Applied> {
        let converted = &self.converted;
        let base_items = converted.config.n_items();
        let prefix;
        let ids = if self.ids.len() == base_items {
            &self.ids
        } else {
            prefix = self.ids.prefix(base_items).map_err(EngineError::Config)?;
            &prefix
        };
        crate::catalogue::apply(&converted.config, &converted.weights, ids, delta)
    }

    /// The items out of every answer under a delta that retires `retired` and upserts `upserted`
    /// (ascending): those, and those the engine keeps retired that the delta does not upsert.
    pub(crate) fn retired_with(&self, retired: &[u32], upserted: &[u32]) -> Vec<u32> {
        let mut all: Vec<u32> = self
            .kept_retired
            .iter()
            .copied()
            .filter(|i| upserted.binary_search(i).is_err())
            .chain(retired.iter().copied())
            .collect();
        all.sort_unstable();
        all.dedup();
        all
    }

    /// Items the engine directory itself keeps retired (a compacted engine's), ascending.
    pub fn kept_retired(&self) -> &[u32] {
        &self.kept_retired
    }

    /// The SHA-256 of the engine's weights file (as its manifest lists it): what a published
    /// catalogue delta names as the engine it was made for.
    pub fn weights_sha256(&self) -> &str {
        self.manifest
            .files
            .get(crate::engine_dir::WEIGHTS_FILE)
            .map_or("", |f| f.sha256.as_str())
    }

    /// The catalogue delta in force (`None`: the catalogue as converted).
    pub fn catalogue(&self) -> Option<&CatalogueSummary> {
        self.catalogue.as_ref()
    }

    /// Chooses, per batch size, between a screened engine's int8 screen and its plain scan (the
    /// same answers either way): by `policy`, and for `Auto` by the plan measured on this CPU for
    /// this engine and thread count (read from the plan cache when it was measured before; see
    /// [`crate::plan`]). Call after [`Engine::set_threads`]. `None` for an engine without a
    /// screen.
    pub fn plan_screen(
        &mut self,
        policy: crate::plan::ScreenPolicy,
    ) -> Option<&crate::plan::ScreenPlan> {
        use crate::plan::{PlanSource, ScreenPlan, ScreenPolicy};
        self.scorer.screen.as_ref()?;
        let chosen = match policy {
            ScreenPolicy::Always | ScreenPolicy::Never => ScreenPlan::fixed(
                policy == ScreenPolicy::Always,
                PlanSource::Pinned(format!("{policy:?}").to_lowercase()),
            ),
            ScreenPolicy::Auto if plans_off() => ScreenPlan::fixed(true, PlanSource::Skipped),
            ScreenPolicy::Auto => {
                let (timings, source) = self.planned("screen", Engine::measure_screen);
                ScreenPlan::from_timings(timings, source)
            }
        };
        self.screen_plan = Some(chosen);
        self.screen_plan.as_ref()
    }

    /// The identity of this engine's plan `plan` ("screen", "bf16-path", "row-block" or
    /// "threads") on this CPU, with its kernels and thread count: what its plan file is kept
    /// under (see [`crate::plan::read_cached`]).
    pub fn plan_key(&self, plan: &str) -> crate::plan::PlanKey {
        crate::plan::PlanKey {
            plan: plan.to_string(),
            cpu: crate::plan::cpu_model(),
            isa: self.scorer.kernels.isa.name().to_string(),
            threads: self.scorer.threads,
            engine: self.weights_digest(),
        }
    }

    /// The timings of the plan `plan` for this CPU, engine and thread count: read from the plan
    /// cache when they were measured before, else measured now by `measure` (and kept there).
    fn planned<T: serde::Serialize + serde::de::DeserializeOwned + Clone>(
        &mut self,
        plan: &str,
        measure: impl FnOnce(&mut Engine) -> Vec<T>,
    ) -> (Vec<T>, crate::plan::PlanSource) {
        use crate::plan::{self, PlanSource};
        let key = self.plan_key(plan);
        let dir = plan::plan_dir();
        match dir.as_deref().map(|d| plan::read_cached(d, &key)) {
            Some(Ok(Some((timings, path)))) => (timings, PlanSource::Cached(path)),
            other => {
                let ignored = match other {
                    Some(Err(why)) => Some(why),
                    _ => None,
                };
                // Measured without the prefix cache: the plan's made-up histories are nobody's
                // session, and a cached repeat would time the cache instead of the kernels.
                let cache = self.prefix_cache.take();
                let (timings, others) = crate::plan_load::others_cores_during(|| measure(self));
                self.prefix_cache = cache;
                // A plan timed beside other work is used now but not kept for later loads.
                let busy =
                    crate::plan_load::busy_verdict(others, crate::plan_load::busy_cores_limit());
                let (path, not_kept) = match (busy, dir) {
                    (Some(why), _) => (None, Some(why)),
                    (None, None) => (None, Some("no cache directory can be named".into())),
                    (None, Some(d)) => match plan::write_cached(&d, &key, &timings) {
                        Ok(path) => (Some(path), None),
                        Err(why) => (None, Some(format!("it could not be written: {why}"))),
                    },
                };
                (
                    timings,
                    PlanSource::Measured {
                        path,
                        ignored,
                        not_kept,
                    },
                )
            }
        }
    }

    /// Chooses a bf16 engine's kernels on a CPU with AVX512-BF16, per batch size: `vdpbf16ps` or
    /// bf16 widened to f32 (the same answers either way; see [`crate::plan::Bf16Path`]): by
    /// `policy`, and for `Auto` by timing whole calls with each on this CPU (or its cached plan).
    /// The engine's kernels stay the native table (what plans are keyed by); each call runs the
    /// table its batch size was given ([`Engine::kernels_for`]). Call after
    /// [`Engine::set_threads`]. `None` for other engines and CPUs (nothing to choose).
    pub fn plan_bf16_path(
        &mut self,
        policy: crate::plan::Bf16Path,
    ) -> Option<&crate::plan::Bf16PathPlan> {
        use crate::kernels::Isa;
        use crate::plan::{Bf16Path, Bf16PathPlan, PlanSource};
        let bf16 = matches!(
            self.model.output().weight,
            crate::weights::Matrix::Bf16 { .. }
        );
        if !bf16 || self.scorer.kernels.isa != Isa::Avx512Bf16 {
            return None;
        }
        let chosen = match policy {
            Bf16Path::Native | Bf16Path::Widened => Bf16PathPlan::fixed(
                policy == Bf16Path::Native,
                PlanSource::Pinned(format!("{policy:?}").to_lowercase()),
            ),
            Bf16Path::Auto if plans_off() => Bf16PathPlan::fixed(true, PlanSource::Skipped),
            Bf16Path::Auto => {
                self.bf16_path_plan = None;
                let (timings, source) = self.planned("bf16-path", Engine::measure_bf16_paths);
                Bf16PathPlan::from_timings(timings, source)
            }
        };
        self.bf16_path_plan = Some(chosen);
        self.bf16_path_plan.as_ref()
    }

    /// The bf16 kernel plan the engine runs by ([`Engine::plan_bf16_path`]).
    pub fn bf16_path_plan(&self) -> Option<&crate::plan::Bf16PathPlan> {
        self.bf16_path_plan.as_ref()
    }

    /// The kernels a call of `batch` histories runs: the engine's, or for a bf16 engine whose
    /// plan widens at this batch size, the AVX-512 table that widens bf16 to f32 (same row
    /// block); either with bf16 layers on AMX tiles where the AMX plan runs them at this batch
    /// size. Every table gives the same bits but the tiled ones (the tile unit's order of
    /// additions); otherwise only time differs.
    pub fn kernels_for(&self, batch: usize) -> &'static KernelTable {
        let table = match &self.bf16_path_plan {
            Some(plan) if !plan.native_for(batch) => KernelTable::for_isa_rows(
                crate::kernels::Isa::Avx512,
                self.scorer.kernels.row_block(),
            ),
            _ => self.scorer.kernels,
        };
        match &self.amx_plan {
            Some(plan) if plan.tiles_for(batch) => table.tiled().unwrap_or(table),
            _ => table,
        }
    }

    /// Whole calls (encoder, output layer, top-10) on seeded random histories at each plan batch
    /// size, with `vdpbf16ps` (the candidate) and widened (the fallback) kernels in turn.
    fn measure_bf16_paths(&mut self) -> Vec<crate::plan::Timing> {
        use crate::plan::{Bf16PathPlan, PlanSource};
        let requests = self.plan_requests();
        let largest = requests.len();
        let kept = self.bf16_path_plan.take();
        let timings = crate::plan::measure(|native, b| {
            self.bf16_path_plan = Some(Bf16PathPlan::fixed(native, PlanSource::Skipped));
            let answers = self.recommend_internal(&requests[..b.min(largest)]);
            std::hint::black_box(answers);
        });
        self.bf16_path_plan = kept;
        timings
    }

    /// Chooses whether an engine's AMX-capable layers run on AMX tiles, per batch size: a bf16
    /// engine's output layer scan ([`crate::kernels::fused_amx`], its tiles in the scorer) and
    /// dense layers ([`crate::kernels::dense_amx`], their tiles made on first use), an int8 or
    /// W8A8 engine's output layer scan and a screened engine's int8 screen
    /// ([`crate::kernels::fused_amx_i8`], their tiles in the scorer and the screen table).
    /// By `policy`, and for `Auto` by timing whole calls with tiles and with the SIMD tables on
    /// this CPU (or its cached plan), tiles kept only where strictly faster. A call at a batch
    /// size that uses tiles gets the tiled counterpart of its table from [`Engine::kernels_for`],
    /// and a screened engine screens there whatever its screen plan chose (the screen is what
    /// the tiles run). bf16 tiles hold the packed layers' bf16 values, their sums differ from
    /// the SIMD tables' in the last bits (the tile unit's order of additions); the screen's
    /// scores on tiles (and an int8 output layer's) are the SIMD scan's to the bit, so answers
    /// keep their bits. Call after
    /// [`Engine::plan_screen`], [`Engine::plan_bf16_path`] and [`Engine::plan_row_block`] (tiles
    /// are timed against the tables and the screen plan those chose). `Ok(None)` for engines
    /// with neither bf16 nor int8 layers nor a screen, and under `Off`; `Err` with the reason where this
    /// CPU, process or kernel table cannot run tiles (the engine runs the SIMD tables: log it).
    pub fn plan_amx(
        &mut self,
        policy: crate::plan_amx::AmxPolicy,
    ) -> std::result::Result<Option<&crate::plan_amx::AmxPlan>, String> {
        use crate::kernels::fused_amx::AmxLayer;
        use crate::kernels::fused_amx_i8::AmxI8Layer;
        use crate::plan::PlanSource;
        use crate::plan_amx::{AmxPlan, AmxPolicy, AmxSubject};
        self.amx_plan = None;
        self.drop_tiles();
        let subject = match (&self.model.output().weight, self.scorer.screen.is_some()) {
            (crate::weights::Matrix::Bf16 { .. }, _) => AmxSubject::Bf16Layers,
            (crate::weights::Matrix::I8 { .. }, _) => AmxSubject::Int8Output,
            (_, true) => AmxSubject::Int8Screen,
            (_, false) => return Ok(None),
        };
        if policy == AmxPolicy::Off {
            return Ok(None);
        }
        crate::kernels::amx::availability().clone()?;
        if self.scorer.kernels.tiled().is_none() {
            return Err(format!(
                "the {} kernels in use have no tiled table (AMX runs beside AVX-512)",
                self.scorer.kernels.isa.name()
            ));
        }
        match subject {
            AmxSubject::Bf16Layers => {
                let Some(tiles) = AmxLayer::from_packed(&self.scorer.packed) else {
                    return Ok(None);
                };
                self.scorer.amx = Some(Arc::new(tiles));
            }
            AmxSubject::Int8Output => {
                let Some(tiles) = AmxI8Layer::from_packed(&self.scorer.packed) else {
                    return Ok(None);
                };
                self.scorer.amx_int8 = Some(Arc::new(tiles));
            }
            AmxSubject::Int8Screen => {
                if let Some(screen) = &mut self.scorer.screen {
                    screen.prepare_tiles()?;
                }
            }
        }
        let plan = match policy {
            AmxPolicy::On => AmxPlan::fixed(subject, true, PlanSource::Pinned("on".into())),
            AmxPolicy::Auto if plans_off() => AmxPlan::fixed(subject, false, PlanSource::Skipped),
            AmxPolicy::Auto | AmxPolicy::Off => {
                let (timings, source) = self.planned("amx", |engine| engine.measure_amx(subject));
                AmxPlan::from_timings(subject, timings, source)
            }
        };
        // The tiles double the memory of the layer they copy: dropped when no batch size uses
        // them; those a call makes on first use only for some batches are made now.
        if !plan.uses_tiles() {
            self.drop_tiles();
        } else if let Some(tiled) = self.scorer.kernels.tiled() {
            self.model.prepare_tiles(tiled);
        }
        self.amx_plan = Some(plan);
        Ok(self.amx_plan.as_ref())
    }

    /// Drops every AMX copy of a layer (the output layer's, the screen's).
    fn drop_tiles(&mut self) {
        self.scorer.amx = None;
        self.scorer.amx_int8 = None;
        if let Some(screen) = &mut self.scorer.screen {
            screen.drop_tiles();
        }
    }

    /// The AMX plan the engine runs by ([`Engine::plan_amx`]).
    pub fn amx_plan(&self) -> Option<&crate::plan_amx::AmxPlan> {
        self.amx_plan.as_ref()
    }

    /// Whole calls (encoder, output layer, top-10) on seeded random histories at each plan batch
    /// size, with the output layer on tiles (the candidate) and on the SIMD tables in turn.
    fn measure_amx(&mut self, subject: crate::plan_amx::AmxSubject) -> Vec<crate::plan::Timing> {
        use crate::plan::PlanSource;
        use crate::plan_amx::AmxPlan;
        let requests = self.plan_requests();
        let largest = requests.len();
        let timings = crate::plan::measure(|tiles, b| {
            self.amx_plan = Some(AmxPlan::fixed(subject, tiles, PlanSource::Skipped));
            std::hint::black_box(self.recommend_internal(&requests[..b.min(largest)]));
        });
        self.amx_plan = None;
        timings
    }

    /// Chooses the row block of an engine whose kernels come in two (AVX-512): batches cut into
    /// row groups of up to 8 rows or of up to 4 (the same answers either way; see
    /// [`crate::plan::RowBlockPolicy`]): by `policy`, and for `Auto` by timing whole calls with
    /// each on this CPU (or its cached plan). Call after [`Engine::set_threads`] and
    /// [`Engine::plan_bf16_path`] (it times the kernels that plan chose). `None` for kernels with
    /// one row block (scalar, AVX2).
    pub fn plan_row_block(
        &mut self,
        policy: crate::plan::RowBlockPolicy,
    ) -> Option<&crate::plan::RowBlockPlan> {
        use crate::kernels::RowBlock;
        use crate::plan::{PlanSource, RowBlockPlan, RowBlockPolicy};
        let isa = self.scorer.kernels.isa;
        if !KernelTable::offers_row_blocks(isa) {
            return None;
        }
        let chosen = match policy {
            RowBlockPolicy::Fixed(block) => {
                RowBlockPlan::fixed(block, PlanSource::Pinned(block.rows().to_string()))
            }
            RowBlockPolicy::Auto if plans_off() => {
                RowBlockPlan::fixed(RowBlock::Eight, PlanSource::Skipped)
            }
            RowBlockPolicy::Auto => {
                let (timings, source) = self.planned("row-block", Engine::measure_row_blocks);
                RowBlockPlan::from_timings(timings, source)
            }
        };
        self.put_kernels(KernelTable::for_isa_rows(isa, chosen.block));
        self.row_block_plan = Some(chosen);
        self.row_block_plan.as_ref()
    }

    /// The row block the engine runs by ([`Engine::plan_row_block`]).
    pub fn row_block_plan(&self) -> Option<&crate::plan::RowBlockPlan> {
        self.row_block_plan.as_ref()
    }

    /// Whole calls (encoder, output layer, top-10) on seeded random histories at each plan batch
    /// size, with row groups of up to 8 rows (the candidate) and of up to 4 in turn.
    fn measure_row_blocks(&mut self) -> Vec<crate::plan::Timing> {
        use crate::kernels::RowBlock;
        let requests = self.plan_requests();
        let largest = requests.len();
        let isa = self.scorer.kernels.isa;
        let timings = crate::plan::measure(|eight, b| {
            let block = if eight {
                RowBlock::Eight
            } else {
                RowBlock::Four
            };
            self.put_kernels(KernelTable::for_isa_rows(isa, block));
            std::hint::black_box(self.recommend_internal(&requests[..b.min(largest)]));
        });
        self.put_kernels(KernelTable::for_isa_rows(isa, RowBlock::Eight));
        timings
    }

    /// Top-10 requests (the history excluded) on histories of the lengths real sessions have
    /// ([`crate::plan::session_length`]): what the whole-call plans time. One length for all
    /// would misjudge them: at batch 8, a second thread lost on 16-event histories and won by 1.4x
    /// on the fixture's test users (lengths 9 to 299, median 24).
    fn plan_requests(&self) -> Vec<InternalRequest> {
        self.plan_histories(crate::plan::session_length)
            .into_iter()
            .map(|history| self.plan_request(history))
            .collect()
    }

    /// A top-10 request (the history excluded) on `history`, for the plans; for a model that
    /// reads time, its events ten minutes apart and the query ten minutes after the last.
    fn plan_request(&self, history: Vec<u32>) -> InternalRequest {
        let (timestamps, query_timestamp) = if self.kind().reads_timestamps() {
            plan_times(history.len())
        } else {
            (Vec::new(), 0)
        };
        InternalRequest {
            history,
            k: 10.min(self.n_items()),
            exclude_seen: true,
            timestamps,
            query_timestamp,
            ..Default::default()
        }
    }

    /// Seeded random histories, row `r` of `length(r)` items, as many as the largest plan batch:
    /// what the plans time the engine on (the model makes real hidden vectors of them).
    fn plan_histories(&self, length: impl Fn(usize) -> usize) -> Vec<Vec<u32>> {
        let n = self.n_items() as u64;
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n) as u32 + 1
        };
        let largest = *crate::plan::PLAN_BATCHES.iter().max().expect("batch sizes");
        (0..largest)
            .map(|row| (0..length(row)).map(|_| next()).collect())
            .collect()
    }

    /// The plan the engine runs by ([`Engine::plan_screen`]).
    pub fn screen_plan(&self) -> Option<&crate::plan::ScreenPlan> {
        self.screen_plan.as_ref()
    }

    /// A digest of the engine's stored files (their SHA-256 in the manifest): what a plan is
    /// made for.
    fn weights_digest(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut hash = Sha256::new();
        for (name, file) in &self.manifest.files {
            hash.update(name.as_bytes());
            hash.update(file.sha256.as_bytes());
        }
        hex::encode(hash.finalize())
    }

    /// Times the screened and the plain top-10 of this engine at the plan's batch sizes, on
    /// hidden vectors the model makes from seeded random histories of 8 items.
    fn measure_screen(&mut self) -> Vec<crate::plan::Timing> {
        let histories = self.plan_histories(|_| 8);
        let largest = histories.len();
        let views: Vec<&[u32]> = histories.iter().map(Vec::as_slice).collect();
        let (hidden, _) = if self.kind().reads_timestamps() {
            let (events, query) = plan_times(8);
            let times = vec![
                EventTimes {
                    events: &events,
                    query
                };
                largest
            ];
            self.encode_timed(&views, &times)
        } else {
            self.encode(&views)
        };
        let width = self.model.output().input_size();
        let limits = |b: usize| RowLimits {
            excluded: histories[..b].to_vec(),
            eligible: vec![None; b],
        };
        let ks = vec![10usize.min(self.n_items()); largest];
        let screen = self.scorer.screen.as_ref().expect("a screened engine");
        let threads = self.scorer.threads;
        crate::plan::measure(|screened, b| {
            if screened {
                let kernels = self.kernels_for(b);
                self.screen_top_k(
                    kernels,
                    screen,
                    &hidden[..b * width],
                    &ks[..b],
                    limits(b),
                    threads,
                );
            } else {
                let kernels = self.kernels_for(b);
                self.scorer
                    .top_k(kernels, &hidden[..b * width], &ks[..b], limits(b), threads);
            }
        })
    }

    /// Keeps the states of recent histories in `cache`, so a history that extends a cached one
    /// computes only its new events; answers never change (see [`crate::prefix_cache`]). GRU4Rec
    /// carries its GRU states, SASRec and HSTU every layer's keys and values; BERT4Rec and
    /// Mult-VAE are refused, naming why. `None` turns the cache off.
    pub fn set_prefix_cache(&mut self, cache: Option<PrefixCache>) -> Result<()> {
        if let (Some(why), Some(_)) = (self.why_no_prefix_cache(), &cache) {
            return Err(EngineError::InvalidRequest(format!(
                "the prefix cache serves GRU4Rec, SASRec and HSTU engines; a {} engine recomputes \
                 every history ({why})",
                self.kind(),
            )));
        }
        self.prefix_cache = cache;
        Ok(())
    }

    /// Why this engine's model cannot resume from a cached prefix (BERT4Rec, Mult-VAE); `None`
    /// for the causal models that can (GRU4Rec, SASRec, HSTU).
    pub fn why_no_prefix_cache(&self) -> Option<&'static str> {
        match self.kind() {
            ModelKind::Gru4rec | ModelKind::Sasrec | ModelKind::Hstu => None,
            ModelKind::Bert4rec => {
                Some("its attention is bidirectional: a new event changes every position")
            }
            ModelKind::Vaecf => Some("it reads the history as a set, in one layer"),
        }
    }

    /// The prefix cache, when one is set.
    pub fn prefix_cache(&self) -> Option<&PrefixCache> {
        self.prefix_cache.as_ref()
    }

    /// Bytes the engine holds: the weights file (memory-mapped and read at load, so resident) plus
    /// the packed copies the kernels read (dense layers, output layer, screen, AMX tiles).
    pub fn memory_bytes(&self) -> usize {
        let mapped = self
            .manifest
            .files
            .values()
            .map(|f| f.bytes as usize)
            .sum::<usize>();
        mapped
            + self.model.packed_bytes()
            + self.scorer.packed.weight_bytes()
            + 4 * self.scorer.packed.bias.len()
            + self
                .scorer
                .screen
                .as_ref()
                .map_or(0, ScreenTable::memory_bytes)
            + self.scorer.amx.as_ref().map_or(0, |t| t.bytes())
            + self.scorer.amx_int8.as_ref().map_or(0, |t| t.bytes())
    }

    /// Threads for scoring one batch (at least 1). A thread plan made for another count is
    /// dropped ([`Engine::plan_threads`] makes one for this count).
    pub fn set_threads(&mut self, threads: usize) {
        self.scorer.threads = threads.max(1);
        self.thread_plan = None;
    }

    /// The threads a call of `batch` histories of the plan's session lengths uses: its thread
    /// plan's count for that batch size, never more than the engine's threads; all of them
    /// without a plan.
    pub fn call_threads(&self, batch: usize) -> usize {
        let all = self.scorer.threads.max(1);
        self.thread_plan
            .as_ref()
            .map_or(all, |plan| plan.threads_for(batch).clamp(1, all))
    }

    /// The threads a call on `histories` uses: as [`Engine::call_threads`], and for a
    /// sequential model by the events its histories average too (the items the model reads of
    /// each; [`crate::plan::LongHistoryThreads`]). With a prefix cache a history's call computes
    /// only its events past the cached prefix, a few for a session's next click, so such an
    /// engine's calls keep the count by batch size.
    pub fn call_threads_for(&self, histories: &[&[u32]]) -> usize {
        let all = self.scorer.threads.max(1);
        let Some(plan) = self.thread_plan.as_ref() else {
            return all;
        };
        if self.prefix_cache.is_some() {
            return self.call_threads(histories.len());
        }
        let events = match (self.manifest.model.history_window(), histories.len()) {
            (Some(window), n) if n > 0 => {
                histories.iter().map(|h| h.len().min(window)).sum::<usize>() / n
            }
            _ => 0,
        };
        plan.threads_for_call(histories.len(), events).clamp(1, all)
    }

    /// Chooses how many of the engine's threads each batch size gets (the same answers whatever
    /// the count; see [`crate::plan::ThreadPlan`]): by `policy`, and for `Auto` by timing whole
    /// calls at 1, 2, 4 ... threads on this CPU (or its cached plan). Call after
    /// [`Engine::set_threads`] and the other plans (it times the kernels they chose). `None` for
    /// an engine of one thread (nothing to choose).
    pub fn plan_threads(
        &mut self,
        policy: crate::plan::ThreadPolicy,
    ) -> Option<&crate::plan::ThreadPlan> {
        use crate::plan::{PlanSource, ThreadPlan, ThreadPolicy};
        let all = self.scorer.threads;
        if all <= 1 {
            self.thread_plan = None;
            return None;
        }
        let chosen = match policy {
            ThreadPolicy::All => ThreadPlan::fixed(all, PlanSource::Pinned("all".into())),
            ThreadPolicy::Fixed(t) => {
                ThreadPlan::fixed(t.min(all), PlanSource::Pinned(t.to_string()))
            }
            ThreadPolicy::Auto if plans_off() => ThreadPlan::fixed(all, PlanSource::Skipped),
            ThreadPolicy::Auto => {
                // Timed with the layers on AMX tiles, the threads a batch needs are another
                // plan than on the SIMD tables (tiles left one thread enough for a Mult-VAE at
                // batch 64): kept under its own name, so an engine loaded with the other AMX
                // policy does not read it.
                let tiles = self.amx_plan.as_ref().is_some_and(|p| p.uses_tiles());
                let name = if tiles { "threads-amx" } else { "threads" };
                let (timings, source) = self.planned(name, Engine::measure_threads);
                ThreadPlan::from_timings(timings, source)
            }
        };
        self.thread_plan = Some(chosen);
        self.thread_plan.as_ref()
    }

    /// The thread plan the engine runs by ([`Engine::plan_threads`]).
    pub fn thread_plan(&self) -> Option<&crate::plan::ThreadPlan> {
        self.thread_plan.as_ref()
    }

    /// Whole calls (encoder, output layer, top-10) on seeded random histories at each plan batch
    /// size and each candidate thread count in turn; for a sequential model that reads more than
    /// twice the plan's median history, batch 1 once more on a history as long as it reads
    /// ([`crate::plan::LongHistoryThreads`]).
    fn measure_threads(&mut self) -> Vec<crate::plan::ThreadTiming> {
        use crate::plan::{session_length, thread_candidates, PlanSource, ThreadPlan};
        let candidates = thread_candidates(self.scorer.threads);
        let requests = self.plan_requests();
        let largest = requests.len();
        let kept = self.thread_plan.take();
        let mut timings = crate::plan::measure_threads(&candidates, |threads, b| {
            self.thread_plan = Some(ThreadPlan::fixed(threads, PlanSource::Skipped));
            std::hint::black_box(self.recommend_internal(&requests[..b.min(largest)]));
        });
        if let Some(window) = self
            .manifest
            .model
            .history_window()
            .filter(|&w| w >= 2 * session_length(0))
        {
            let long = self.plan_histories(|_| window).swap_remove(0);
            let request = [self.plan_request(long)];
            timings.extend(crate::plan::measure_threads_at(
                &candidates,
                &[1],
                false,
                window,
                |threads, _| {
                    self.thread_plan = Some(ThreadPlan::fixed(threads, PlanSource::Skipped));
                    std::hint::black_box(self.recommend_internal(&request));
                },
            ));
        }
        self.thread_plan = kept;
        timings
    }

    /// Replaces the kernel set (tests and benches run every ISA path): every call runs it, so a
    /// bf16 path plan, made for the native table, and AMX tiles are dropped.
    pub fn set_kernels(&mut self, kernels: &'static KernelTable) {
        self.bf16_path_plan = None;
        self.amx_plan = None;
        self.drop_tiles();
        self.put_kernels(kernels);
    }

    /// Replaces the kernel set, keeping the plans (the row-block plan swaps tables of one ISA).
    fn put_kernels(&mut self, kernels: &'static KernelTable) {
        self.scorer.kernels = kernels;
        self.model.set_kernels(kernels);
    }

    /// Every item's score for each history, `[B, N+1]`, with the serving kernels and precision
    /// (for evaluation; serving never materialises this).
    pub fn score_all(&self, histories: &[&[u32]]) -> Vec<f32> {
        self.score_all_timed(histories, &[])
    }

    /// [`Engine::score_all`] with each history's event times, for the models that read them.
    pub fn score_all_timed(&self, histories: &[&[u32]], times: &[EventTimes<'_>]) -> Vec<f32> {
        let (hidden, _) = self.encode_timed(histories, times);
        self.score_all_hidden(&hidden, histories.len())
    }

    /// Every item's score for `rows` hidden vectors already encoded (`[rows, d]`), `[rows, N+1]`.
    pub(crate) fn score_all_hidden(&self, hidden: &[f32], rows: usize) -> Vec<f32> {
        fused::score_all(self.kernels_for(rows), &self.scorer.packed, hidden)
    }

    pub fn kind(&self) -> ModelKind {
        self.manifest.model.kind()
    }

    pub fn n_items(&self) -> usize {
        self.ids.len()
    }

    /// Whether the popularity list answers a history that holds no known item (`history`), under
    /// `options.empty_history`; `Ok(false)`: the model answers it; an error when neither may.
    fn answers_empty_popular(
        &self,
        options: &ServeOptions,
        history: &crate::idmap::Mapped,
    ) -> Result<bool> {
        let refuse = |why| EngineError::NoKnownItem {
            ids: history.indices.len() + history.unknown,
            unknown: history.unknown,
            why,
        };
        match (options.empty_history, &self.popularity) {
            (EmptyHistoryPolicy::Popular | EmptyHistoryPolicy::Auto, Some(_)) => Ok(true),
            (EmptyHistoryPolicy::Popular, None) => {
                Err(refuse(crate::error::NoKnownItemRefusal::NoPopularityList))
            }
            (EmptyHistoryPolicy::Error, _) => {
                Err(refuse(crate::error::NoKnownItemRefusal::PolicyRefuses))
            }
            (EmptyHistoryPolicy::Model | EmptyHistoryPolicy::Auto, _)
                if self.kind().needs_history() =>
            {
                Err(refuse(crate::error::NoKnownItemRefusal::ModelNeedsHistory(
                    self.kind().as_str(),
                )))
            }
            (EmptyHistoryPolicy::Model | EmptyHistoryPolicy::Auto, _) => Ok(false),
        }
    }

    /// The request's event times for a model that reads them: the timestamps of the history ids
    /// at `kept` (the known ones) and the query time (now, when the request gives none). Empty
    /// for the other models, which ignore times sent to them.
    fn request_times(&self, request: &Request<'_>, kept: &[usize]) -> Result<(Vec<i64>, i64)> {
        if !self.kind().reads_timestamps() {
            return Ok((Vec::new(), 0));
        }
        let Some(times) = request.times else {
            return Err(EngineError::InvalidRequest(format!(
                "the request has no timestamps: {} reads when each event happened, so a \
                 request carries one unix timestamp (seconds) per history id (Triton input \
                 ITEM_TIMESTAMPS, \"timestamps\" in predict's JSONL, timestamps= in Python)",
                self.kind()
            )));
        };
        if times.events.len() != request.history.len() {
            return Err(EngineError::InvalidRequest(format!(
                "the request holds {} timestamp(s) for {} history ids: one per id",
                times.events.len(),
                request.history.len()
            )));
        }
        let query = match times.query {
            Some(query) => query,
            None => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64),
        };
        Ok((kept.iter().map(|&i| times.events[i]).collect(), query))
    }

    /// Maps and validates one request. Errors name the offending input.
    pub fn prepare(
        &self,
        request: &Request<'_>,
        options: &ServeOptions,
    ) -> Result<(InternalRequest, UnknownIds)> {
        self.prepare_in(&self.filters.view(), request, options)
    }

    /// [`Self::prepare`] with the request's filter resolved in `view`: a batch resolves all its
    /// requests in the one view it took, so a live availability update never splits a batch.
    pub fn prepare_in(
        &self,
        view: &FilterView,
        request: &Request<'_>,
        options: &ServeOptions,
    ) -> Result<(InternalRequest, UnknownIds)> {
        let k =
            match request.k {
                None => options.default_k,
                Some(k) if k >= 1 => usize::try_from(k).unwrap_or(usize::MAX),
                // The user embedding alone: nothing to score.
                Some(0) if request.embedding => 0,
                Some(0) => return Err(EngineError::InvalidRequest(
                    "K = 0 asks for no items: it is allowed only together with the user embedding"
                        .into(),
                )),
                Some(k) => {
                    return Err(EngineError::InvalidRequest(format!(
                        "K must be at least 1, found {k}"
                    )))
                }
            };
        let (history, kept) = self.ids.map_with_positions(request.history);
        let (timestamps, query_timestamp) = self.request_times(request, &kept)?;
        if history.unknown > 0 && options.unknown_items == UnknownItemPolicy::Error {
            return Err(EngineError::UnknownIds {
                input: crate::error::IdInput::History,
                count: history.unknown,
                examples: self.ids.unknown_examples(request.history, 3),
            });
        }
        let popular =
            history.indices.is_empty() && self.answers_empty_popular(options, &history)?;
        if popular && request.embedding {
            return Err(EngineError::InvalidRequest(
                "a history without a known item has no user embedding (the popularity list \
                 answers it, empty_history_policy \"popular\")"
                    .into(),
            ));
        }
        let exclude = request
            .exclude
            .map(|e| self.ids.map(e).indices)
            .unwrap_or_default();
        let eligible = match request.filter {
            Some(filter) if !filter.is_empty() => {
                Some(view.resolve(filter).map_err(EngineError::InvalidRequest)?)
            }
            // Every item, or every item a catalogue delta has not retired.
            _ => view.unfiltered(),
        };
        let mut unknown_candidates = 0;
        let candidates = match request.candidates {
            None => None,
            Some(ids) => {
                let mapped = self.ids.map(ids);
                if mapped.unknown > 0 && options.unknown_items == UnknownItemPolicy::Error {
                    return Err(EngineError::UnknownIds {
                        input: crate::error::IdInput::Candidates,
                        count: mapped.unknown,
                        examples: self.ids.unknown_examples(ids, 3),
                    });
                }
                unknown_candidates = mapped.unknown;
                // Ascending and distinct: the selection's ties then go to the lower index, as
                // over the whole catalogue.
                let mut indices = mapped.indices;
                indices.sort_unstable();
                indices.dedup();
                // A filter narrows the candidates themselves: the candidate path then needs no
                // mask of its own.
                if let Some(mask) = &eligible {
                    indices.retain(|&i| mask.allows(i));
                }
                Some(indices)
            }
        };
        let eligible = if candidates.is_some() { None } else { eligible };
        Ok((
            InternalRequest {
                history: history.indices,
                exclude,
                k: k.min(self.n_items()),
                exclude_seen: options.exclude_seen,
                candidates,
                embedding: request.embedding,
                eligible,
                popular,
                timestamps,
                query_timestamp,
            },
            UnknownIds {
                history: history.unknown,
                candidates: unknown_candidates,
            },
        ))
    }

    /// Answers a batch. Each request gets its own result; a bad request does not affect the others,
    /// and the good ones run as one batch (one encoder pass, which also gives the embeddings that
    /// requests ask for).
    pub fn recommend(
        &self,
        requests: &[Request<'_>],
        options: &ServeOptions,
    ) -> Vec<Result<Recommendation>> {
        self.recommend_on(self, requests, options)
    }

    /// [`Self::recommend`] with the prepared batch answered by `recommender` (this engine's model
    /// on a device, say): requests are checked and mapped here, on the CPU, as for every path. A
    /// failure of the recommender is every good request's error.
    pub fn recommend_on(
        &self,
        recommender: &dyn BatchRecommender,
        requests: &[Request<'_>],
        options: &ServeOptions,
    ) -> Vec<Result<Recommendation>> {
        let mut results: Vec<Option<Result<Recommendation>>> = Vec::with_capacity(requests.len());
        let mut batch = Vec::new();
        let mut unknown = Vec::new();
        let mut slots = Vec::new();
        let view = self.filters.view();
        for (i, request) in requests.iter().enumerate() {
            match self.prepare_in(&view, request, options) {
                Ok((prepared, n_unknown)) => {
                    batch.push(prepared);
                    unknown.push(n_unknown);
                    slots.push(i);
                    results.push(None);
                }
                Err(e) => results.push(Some(Err(e))),
            }
        }
        let answers = if batch.is_empty() {
            Vec::new()
        } else {
            match self.answer_split(recommender, &batch) {
                Ok(answers) => answers,
                Err(e) => {
                    let message = e.to_string();
                    for slot in slots {
                        results[slot] = Some(Err(EngineError::Device(message.clone())));
                    }
                    return results
                        .into_iter()
                        .map(|r| r.expect("every slot is filled"))
                        .collect();
                }
            }
        };
        for (((slot, (items, note, embedding)), n_unknown), prepared) in
            slots.into_iter().zip(answers).zip(unknown).zip(&batch)
        {
            results[slot] = Some(Ok(Recommendation {
                items,
                unknown_ids: n_unknown.history,
                truncated: note.truncated,
                unknown_candidates: n_unknown.candidates,
                embedding,
                popular: prepared.popular,
            }));
        }
        results
            .into_iter()
            .map(|r| r.expect("every slot is filled"))
            .collect()
    }

    /// The encoder over a batch (`[B, hidden]` and a note per history), the histories split into
    /// contiguous runs of about equal work, one per scoring thread. A row's hidden vector does not
    /// depend on the rows encoded beside it, so the split changes no bit of the answer; it only
    /// lets a batch use the threads it was given for the encoder as well as for the output layer.
    pub fn encode(&self, histories: &[&[u32]]) -> (Vec<f32>, Vec<HistoryNote>) {
        self.encode_timed(histories, &[])
    }

    /// [`Engine::encode`] with each history's event times, for the models that read them (HSTU;
    /// one [`EventTimes`] per history), empty for the others.
    pub fn encode_timed(
        &self,
        histories: &[&[u32]],
        times: &[EventTimes<'_>],
    ) -> (Vec<f32>, Vec<HistoryNote>) {
        let batch = histories.len();
        self.encode_on(
            self.kernels_for(batch),
            histories,
            times,
            self.call_threads_for(histories),
        )
    }

    /// [`Engine::encode_timed`] on `kernels` and up to `threads` pool threads.
    fn encode_on(
        &self,
        kernels: &'static KernelTable,
        histories: &[&[u32]],
        times: &[EventTimes<'_>],
        threads: usize,
    ) -> (Vec<f32>, Vec<HistoryNote>) {
        match &self.prefix_cache {
            // With the prefix cache, each run resumes its own histories (see `encode_cached_run`:
            // a history longer than the window is recomputed and not kept, since its window
            // slides, which moves every SASRec item to another position and restarts RecBole's
            // GRU4Rec at the window's first item).
            Some(cache) => self.encode_in_runs(histories, times, threads, |run, run_times, t| {
                self.encode_cached_run(kernels, cache, run, run_times, t)
            }),
            None => self.encode_in_runs(histories, times, threads, |run, run_times, t| {
                self.encode_run(kernels, run, run_times, t)
            }),
        }
    }

    /// `encode_run` over `histories` (and their `times`, where the model reads them) split into
    /// at most `threads` runs of about equal work, the runs on the worker pool (fewer histories
    /// than threads: each run splits its own layers over the threads left), their hidden vectors
    /// and notes joined in order.
    fn encode_in_runs(
        &self,
        histories: &[&[u32]],
        times: &[EventTimes<'_>],
        threads: usize,
        encode_run: impl Fn(&[&[u32]], &[EventTimes<'_>], usize) -> (Vec<f32>, Vec<HistoryNote>) + Sync,
    ) -> (Vec<f32>, Vec<HistoryNote>) {
        let window = self.manifest.model.history_window().unwrap_or(usize::MAX);
        let runs = split_into_runs(histories, threads, window);
        if runs.len() <= 1 {
            return encode_run(histories, times, threads);
        }
        let threads_per_run = threads / runs.len();
        let parts: Vec<(Vec<f32>, Vec<HistoryNote>)> =
            crate::parallel::map_pieces(runs.len(), |i| {
                let run_times = if times.is_empty() {
                    &[][..]
                } else {
                    &times[runs[i].clone()]
                };
                encode_run(&histories[runs[i].clone()], run_times, threads_per_run)
            });
        let width = self.model.output().input_size();
        let mut hidden = Vec::with_capacity(histories.len() * width);
        let mut notes = Vec::with_capacity(histories.len());
        for (part_hidden, part_notes) in parts {
            hidden.extend_from_slice(&part_hidden);
            notes.extend(part_notes);
        }
        (hidden, notes)
    }

    /// How this engine's histories key the prefix cache: HSTU's with their timestamps.
    fn cache_key_layout(&self) -> KeyLayout {
        match self.kind() {
            ModelKind::Hstu => KeyLayout::TimedItems,
            _ => KeyLayout::Items,
        }
    }

    /// The encoder over one run of histories with the prefix cache, on this thread's buffers, its
    /// larger layers split over up to `threads` pool threads: each history whose model input is
    /// cached up to some row resumes there, and every history's state after its last row that a
    /// later call can resume from is kept (a history longer than the window is recomputed and
    /// not kept). `times` are the histories' event times where the model reads them.
    fn encode_cached_run(
        &self,
        kernels: &'static KernelTable,
        cache: &PrefixCache,
        histories: &[&[u32]],
        times: &[EventTimes<'_>],
        threads: usize,
    ) -> (Vec<f32>, Vec<HistoryNote>) {
        let window = self.manifest.model.history_window().unwrap_or(usize::MAX);
        let layout = self.cache_key_layout();
        let cacheable = |h: &[u32]| !h.is_empty() && h.len() <= window;
        let keys: Vec<std::borrow::Cow<'_, [u32]>> = histories
            .iter()
            .enumerate()
            .map(|(b, h)| {
                if !cacheable(h) {
                    return std::borrow::Cow::Borrowed(&[][..]);
                }
                layout.key(h, times.get(b).map_or(&[][..], |t| t.events))
            })
            .collect();
        let found: Vec<Option<(usize, State)>> = histories
            .iter()
            .zip(&keys)
            .map(|(h, key)| {
                cacheable(h)
                    .then(|| cache.longest_prefix_in(layout, key))
                    .flatten()
            })
            .collect();
        let starts: Vec<Option<(usize, &State)>> = found
            .iter()
            .map(|f| f.as_ref().map(|(done, state)| (*done, state)))
            .collect();
        let (mut ends, mut ends_at) = (Vec::new(), Vec::new());
        let mut hidden = Vec::with_capacity(histories.len() * self.model.output().input_size());
        let mut notes = Vec::with_capacity(histories.len());
        let carry = crate::models::Carry {
            starts: &starts,
            ends: &mut ends,
            ends_at: &mut ends_at,
        };
        thread_local! {
            static SCRATCH: std::cell::RefCell<EncodeScratch> = Default::default();
        }
        SCRATCH.with(|cell| {
            let mut own = EncodeScratch::default();
            let mut borrowed = cell.try_borrow_mut();
            let scratch = match borrowed.as_deref_mut() {
                Ok(s) => s,
                Err(_) => &mut own,
            };
            self.model
                .encode_carried(
                    kernels,
                    histories,
                    times,
                    scratch,
                    &mut hidden,
                    &mut notes,
                    threads,
                    carry,
                )
                .expect("the prefix cache is set on causal engines only");
        });
        // A state that grows by appending (SASRec's, HSTU's) is stored as the carried one's runs
        // plus the new part. SASRec does not carry the answer slot's output, so a repeated
        // history computes its last event again (and stores nothing new); HSTU never carries its
        // last row (its keys and values read the query time), so the state after a history of
        // `n` rows covers `n - 1`.
        let appends = crate::models::Carry::appends(self.kind());
        let timed = layout == KeyLayout::TimedItems;
        for (b, history) in histories.iter().enumerate() {
            let kept = history.len().min(window);
            let cached = starts[b].map_or(0, |(done, _)| done.min(kept));
            let resumed = if appends && cached == kept {
                kept.saturating_sub(1)
            } else {
                cached
            };
            cache.computed(kept - resumed);
            let covered_after = if timed { kept.saturating_sub(1) } else { kept };
            if cacheable(history) && cached < covered_after {
                let part = &ends[ends_at[b]..ends_at[b + 1]];
                let state = match starts[b] {
                    Some((_, carried)) if appends => carried.appended(part),
                    _ => State::from_slice(part),
                };
                cache.extend(
                    &keys[b][..layout.len_of(covered_after)],
                    state,
                    layout.len_of(cached),
                );
            }
        }
        (hidden, notes)
    }

    /// The encoder over `histories` on this thread, in this thread's buffers (so a stream of
    /// batches reuses its activations' memory rather than allocating it per batch), its larger
    /// layers split over up to `threads` pool threads.
    fn encode_run(
        &self,
        kernels: &'static KernelTable,
        histories: &[&[u32]],
        times: &[EventTimes<'_>],
        threads: usize,
    ) -> (Vec<f32>, Vec<HistoryNote>) {
        thread_local! {
            static SCRATCH: std::cell::RefCell<EncodeScratch> = Default::default();
        }
        let mut hidden = Vec::with_capacity(histories.len() * self.model.output().input_size());
        let mut notes = Vec::with_capacity(histories.len());
        SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut scratch) => self.model.encode_with(
                kernels,
                histories,
                times,
                &mut scratch,
                &mut hidden,
                &mut notes,
                threads,
            ),
            // Only if this thread is already encoding further up its stack (a pool thread that
            // picked up another batch's piece while waiting): that pass keeps the buffers.
            Err(_) => self.model.encode_with(
                kernels,
                histories,
                times,
                &mut EncodeScratch::default(),
                &mut hidden,
                &mut notes,
                threads,
            ),
        });
        (hidden, notes)
    }

    /// `batch`'s answers: the rows the popularity list answers from it; when `recommender` is not
    /// this engine (a device), the rows only the CPU engine ranks (candidates, item set filters)
    /// from this engine; the others from `recommender`, which never sees the rest.
    fn answer_split(
        &self,
        recommender: &dyn BatchRecommender,
        batch: &[InternalRequest],
    ) -> Result<Vec<RowAnswer>> {
        let elsewhere = !std::ptr::addr_eq(recommender as *const dyn BatchRecommender, self);
        let on_cpu =
            |r: &InternalRequest| elsewhere && (r.candidates.is_some() || r.eligible.is_some());
        if !batch.iter().any(|r| r.popular || on_cpu(r)) {
            return recommender.recommend_batch(batch);
        }
        let pick = |keep: &dyn Fn(&InternalRequest) -> bool| -> Vec<InternalRequest> {
            batch.iter().filter(|r| keep(r)).cloned().collect()
        };
        let run =
            |r: &dyn BatchRecommender, rows: Vec<InternalRequest>| -> Result<Vec<RowAnswer>> {
                if rows.is_empty() {
                    Ok(Vec::new())
                } else {
                    r.recommend_batch(&rows)
                }
            };
        let mut from_cpu = run(self, pick(&|r| !r.popular && on_cpu(r)))?.into_iter();
        let mut from_model = run(recommender, pick(&|r| !r.popular && !on_cpu(r)))?.into_iter();
        Ok(batch
            .iter()
            .map(|r| {
                if r.popular {
                    self.popular_answer(r)
                } else if on_cpu(r) {
                    from_cpu.next().expect("one answer per CPU row")
                } else {
                    from_model.next().expect("one answer per model row")
                }
            })
            .collect())
    }

    /// The popularity list's answer to a prepared row (see [`Popularity::top_k_for`]).
    fn popular_answer(&self, request: &InternalRequest) -> RowAnswer {
        let items = match &self.popularity {
            Some(p) => p.top_k_for(
                request.k,
                &excluded_items(request),
                request.eligible.as_deref(),
                request.candidates.as_deref(),
            ),
            None => Vec::new(),
        };
        (items, HistoryNote::default(), Vec::new())
    }

    /// Each prepared request's answer on the CPU kernels: its best items (internal indices, best
    /// first), its history note, and its user embedding where it asks for one (`[hidden, 1]`, see
    /// [`Recommendation::embedding`]; empty otherwise). Rows with `k = 0` are encoded and not
    /// scored. The engine's [`BatchRecommender`], as a device model is.
    pub fn recommend_internal(&self, batch: &[InternalRequest]) -> Vec<RowAnswer> {
        if batch.is_empty() {
            return Vec::new();
        }
        if batch.iter().any(|r| r.popular) {
            return self
                .answer_split(self, batch)
                .expect("the CPU engine answers every batch");
        }
        // A pool worker wakes while the batch starts, and stays awake between its split steps.
        let histories: Vec<&[u32]> = batch.iter().map(|r| r.history.as_slice()).collect();
        let times: Vec<EventTimes<'_>> = if self.kind().reads_timestamps() {
            batch.iter().map(InternalRequest::event_times).collect()
        } else {
            Vec::new()
        };
        let threads = self.call_threads_for(&histories);
        let kernels = self.kernels_for(batch.len());
        let _awake = (threads > 1).then(crate::parallel::Batch::begin);
        let (hidden, mut notes) = self.encode_on(kernels, &histories, &times, threads);
        let width = self.model.output().input_size();
        let user = |r: usize| &hidden[r * width..(r + 1) * width];
        // Whole-catalogue rows go through the scorer together; candidate rows each score their
        // own candidates; embedding-only rows (k = 0) score nothing.
        let whole: Vec<usize> = (0..batch.len())
            .filter(|&r| batch[r].candidates.is_none() && batch[r].k > 0)
            .collect();
        let mut top: Vec<Vec<Scored>> = vec![Vec::new(); batch.len()];
        if !whole.is_empty() {
            let rows_hidden: Vec<f32> = whole
                .iter()
                .flat_map(|&r| user(r).iter().copied())
                .collect();
            let limits = RowLimits {
                excluded: whole.iter().map(|&r| excluded_items(&batch[r])).collect(),
                eligible: whole.iter().map(|&r| batch[r].eligible.clone()).collect(),
            };
            let ks: Vec<usize> = whole.iter().map(|&r| batch[r].k).collect();
            let (ranked, survivors) =
                self.screened_top_k(kernels, &rows_hidden, &ks, limits, threads);
            for (i, (r, ranked)) in whole.iter().zip(ranked).enumerate() {
                top[*r] = ranked;
                if let Some(survivors) = &survivors {
                    notes[*r].screen_survivors = Some(survivors[i] as u32);
                }
            }
        }
        self.rank_candidate_rows(kernels, batch, &hidden, &mut top, threads);
        top.into_iter()
            .zip(notes)
            .enumerate()
            .map(|(r, (items, note))| {
                let embedding = if batch[r].embedding {
                    let mut e = Vec::with_capacity(width + 1);
                    e.extend_from_slice(user(r));
                    e.push(1.0);
                    e
                } else {
                    Vec::new()
                };
                (items, note, embedding)
            })
            .collect()
    }

    /// Each row's best `ks[row]` of the whole catalogue (never PAD nor an item `limits` leaves
    /// out): through
    /// the screen when the engine has one, each row's survivors rescored exactly as the candidate
    /// path scores candidates (so the answer is the dense scan's), else the dense scan itself;
    /// with each row's count of screen survivors (the items rescored) when the engine screens.
    fn screened_top_k(
        &self,
        kernels: &KernelTable,
        hidden: &[f32],
        ks: &[usize],
        limits: RowLimits,
        threads: usize,
    ) -> (RankedRows, Option<Vec<usize>>) {
        let Some(screen) = &self.scorer.screen else {
            return (
                self.scorer.top_k(kernels, hidden, ks, limits, threads),
                None,
            );
        };
        // A tiled table screens on tiles: the AMX plan chose it for this batch size against
        // the SIMD tables under the screen plan, so that plan's choice does not apply.
        if !kernels.tiles
            && self
                .screen_plan
                .as_ref()
                .is_some_and(|plan| !plan.screen_for(ks.len()))
        {
            // Planned: the plain scan measured faster at this batch size (the same answer).
            return (
                self.scorer.top_k(kernels, hidden, ks, limits, threads),
                None,
            );
        }
        let (ranked, survivors) = self.screen_top_k(kernels, screen, hidden, ks, limits, threads);
        (ranked, Some(survivors))
    }

    /// The screened top-k itself: each row's survivors of the screen, rescored exactly.
    fn screen_top_k(
        &self,
        kernels: &KernelTable,
        screen: &ScreenTable,
        hidden: &[f32],
        ks: &[usize],
        limits: RowLimits,
        threads: usize,
    ) -> (RankedRows, Vec<usize>) {
        let exclusions = whole_catalogue_exclusions(limits.excluded);
        let queries = queries_of(ks, &exclusions, &limits.eligible);
        let d = screen.packed.d;
        let (ranked, survivors) =
            screen::top_k(kernels, screen, hidden, &queries, threads, |row, items| {
                // Survivors are eligible already: nothing left to exclude. They are a few
                // scattered rows of a table the screen exists not to read, so a large table
                // gives them by reads of its file rather than by mapping its pages.
                self.rank_rows(
                    kernels,
                    &hidden[row * d..(row + 1) * d],
                    items,
                    &[ks[row]],
                    &[vec![]],
                    1,
                    RowAccess::Scattered,
                )
                .remove(0)
            });
        (ranked, survivors)
    }

    /// Ranks every row of `batch` that carries candidates (into `top`), as one batch: rows with the
    /// same candidate list (a shared pool re-ranked per user) share one packed table and one
    /// multi-row scan, so its rows are read once for all of them; distinct lists are spread over
    /// the scorer's threads.
    fn rank_candidate_rows(
        &self,
        kernels: &KernelTable,
        batch: &[InternalRequest],
        hidden: &[f32],
        top: &mut [Vec<Scored>],
        threads: usize,
    ) {
        let mut groups: Vec<(&[u32], Vec<usize>)> = Vec::new();
        let mut group_of: std::collections::HashMap<&[u32], usize> = Default::default();
        for (r, request) in batch.iter().enumerate() {
            let Some(candidates) = request.candidates.as_deref() else {
                continue;
            };
            if request.k == 0 || candidates.is_empty() {
                continue;
            }
            let g = *group_of.entry(candidates).or_insert_with(|| {
                groups.push((candidates, Vec::new()));
                groups.len() - 1
            });
            groups[g].1.push(r);
        }
        if groups.is_empty() {
            return;
        }
        let width = self.model.output().input_size();
        let rank = |(candidates, rows): &(&[u32], Vec<usize>), threads: usize| {
            let users: Vec<f32> = rows
                .iter()
                .flat_map(|&r| hidden[r * width..(r + 1) * width].iter().copied())
                .collect();
            let ks: Vec<usize> = rows.iter().map(|&r| batch[r].k).collect();
            let excluded: Vec<Vec<u32>> = rows.iter().map(|&r| excluded_items(&batch[r])).collect();
            self.top_k_among_rows(kernels, &users, candidates, &ks, &excluded, threads)
        };
        let ranked: Vec<RankedRows> = if groups.len() == 1 || threads == 1 {
            groups.iter().map(|g| rank(g, threads)).collect()
        } else {
            // Groups dealt round-robin to the threads; each scans its own lists on one thread.
            let lanes = threads.min(groups.len());
            let mut per_lane: Vec<Vec<(usize, RankedRows)>> =
                crate::parallel::map_pieces(lanes, |lane| {
                    (lane..groups.len())
                        .step_by(lanes)
                        .map(|g| (g, rank(&groups[g], 1)))
                        .collect::<Vec<_>>()
                });
            let mut ordered: Vec<Option<RankedRows>> = vec![None; groups.len()];
            for (g, rows) in per_lane.drain(..).flatten() {
                ordered[g] = Some(rows);
            }
            ordered
                .into_iter()
                .map(|r| r.expect("every group is ranked"))
                .collect()
        };
        for ((_, rows), answers) in groups.iter().zip(ranked) {
            for (&r, answer) in rows.iter().zip(answers) {
                top[r] = answer;
            }
        }
    }

    /// For each row of `hidden` (`[rows, d]`), its best `ks[row]` of `candidates` (ascending,
    /// distinct internal indices) leaving out `excluded[row]`: the candidates' rows packed exactly
    /// as the whole table is (same micro-kernels, same per-row arithmetic, W8A8's static scale)
    /// and scanned once for all the rows, so every score is the one the whole-catalogue scan gives
    /// the same item, and ties go to the lower index as there. Costs the candidates' rows, not the
    /// catalogue.
    fn top_k_among_rows(
        &self,
        kernels: &KernelTable,
        hidden: &[f32],
        candidates: &[u32],
        ks: &[usize],
        excluded: &[Vec<u32>],
        threads: usize,
    ) -> RankedRows {
        self.rank_rows(
            kernels,
            hidden,
            candidates,
            ks,
            excluded,
            threads,
            RowAccess::Mapped,
        )
    }

    /// [`Self::top_k_among_rows`], reading the candidates' rows as `access` says.
    #[allow(clippy::too_many_arguments)]
    fn rank_rows(
        &self,
        kernels: &KernelTable,
        hidden: &[f32],
        candidates: &[u32],
        ks: &[usize],
        excluded: &[Vec<u32>],
        threads: usize,
        access: RowAccess,
    ) -> RankedRows {
        if candidates.is_empty() {
            return vec![Vec::new(); ks.len()];
        }
        let out = self.model.output();
        let bias: Vec<f32> = candidates
            .iter()
            .map(|&c| out.bias.as_slice()[c as usize])
            .collect();
        let mut packed = match access {
            RowAccess::Mapped => out.weight.pack_rows(candidates, &bias),
            RowAccess::Scattered => out.weight.pack_scattered_rows(candidates, &bias),
        };
        if let Some(scale) = self.scorer.packed.activation_scale {
            packed = packed.with_static_activation_scale(scale);
        }
        // Positions, in the candidate list, of each row's items left out (PAD is never a
        // candidate).
        let exclusions: Vec<Exclusions> = excluded
            .iter()
            .map(|list| {
                let mut list = list.clone();
                list.sort_unstable();
                Exclusions::new(
                    candidates
                        .iter()
                        .enumerate()
                        .filter(|(_, c)| list.binary_search(c).is_ok())
                        .map(|(p, _)| p as u32)
                        .collect(),
                )
            })
            .collect();
        let queries: Vec<RowQuery<'_>> = ks
            .iter()
            .zip(&exclusions)
            .map(|(&k, excluded)| RowQuery::new(k.min(candidates.len()), excluded))
            .collect();
        fused::top_k(kernels, &packed, hidden, &queries, threads)
            .into_iter()
            .map(|row| {
                row.into_iter()
                    .map(|s| Scored {
                        index: candidates[s.index as usize],
                        score: s.score,
                    })
                    .collect()
            })
            .collect()
    }

    /// External id of an internal index; `None` outside the catalogue (see [`IdMap::external`]).
    pub fn external_id(&self, index: u32) -> Option<ExternalId> {
        self.ids.external(index)
    }
}

/// `RECSYS_PLAN=off`: no plan is measured or read; engines run their defaults.
fn plans_off() -> bool {
    std::env::var("RECSYS_PLAN").as_deref() == Ok("off")
}

/// Event times for a plan's history of `len` items (for the models that read time): ten minutes
/// apart from a fixed day, the query ten minutes after the last.
fn plan_times(len: usize) -> (Vec<i64>, i64) {
    const START: i64 = 1_700_000_000;
    const GAP: i64 = 600;
    let events: Vec<i64> = (0..len as i64).map(|i| START + i * GAP).collect();
    (events, START + len as i64 * GAP)
}

/// Splits `histories` into at most `threads` contiguous runs of about equal encoder work (a
/// history costs about its length, up to the model's `window` of most recent items, plus a fixed
/// part: the [MASK] row, the first layer's bias, the output of the last layer).
fn split_into_runs(
    histories: &[&[u32]],
    threads: usize,
    window: usize,
) -> Vec<std::ops::Range<usize>> {
    const FIXED_COST: usize = 8;
    let runs = threads.min(histories.len());
    if runs <= 1 {
        return std::iter::once(0..histories.len()).collect();
    }
    // A sequential model reads at most its window of each history.
    let cost = |h: &&[u32]| h.len().min(window) + FIXED_COST;
    let total: usize = histories.iter().map(cost).sum();
    let mut ranges = Vec::with_capacity(runs);
    let (mut start, mut done) = (0, 0);
    for (i, history) in histories.iter().enumerate() {
        done += cost(history);
        // Close run j once it holds its share of the work, or when only one row per later run
        // is left.
        let j = ranges.len();
        let rows_left = histories.len() - (i + 1);
        let later_runs = runs.saturating_sub(j + 1);
        let balanced = done * runs >= total * (j + 1);
        if later_runs > 0 && rows_left >= later_runs && (balanced || rows_left == later_runs) {
            ranges.push(start..i + 1);
            start = i + 1;
        }
    }
    ranges.push(start..histories.len());
    ranges
}

#[cfg(test)]
mod split_tests {
    use super::split_into_runs;

    #[test]
    fn runs_cover_the_batch_in_order_with_balanced_work() {
        let long = vec![1u32; 200];
        let short = vec![1u32; 2];
        let batch: Vec<&[u32]> = (0..40)
            .map(|i| if i % 4 == 0 { &long[..] } else { &short[..] })
            .collect();
        for threads in 1..=8 {
            let runs = split_into_runs(&batch, threads, usize::MAX);
            assert_eq!(runs.len(), threads.min(batch.len()));
            assert_eq!(runs.first().unwrap().start, 0);
            assert_eq!(runs.last().unwrap().end, batch.len());
            for pair in runs.windows(2) {
                assert_eq!(pair[0].end, pair[1].start, "contiguous, in order");
            }
            assert!(runs.iter().all(|r| !r.is_empty()));
            let work = |r: &std::ops::Range<usize>| -> usize {
                batch[r.clone()].iter().map(|h| h.len() + 8).sum()
            };
            let total: usize = batch.iter().map(|h| h.len() + 8).sum();
            // No run holds more than its share plus one history's work.
            for r in &runs {
                assert!(
                    work(r) <= total / runs.len() + 208,
                    "{threads} threads: {runs:?}"
                );
            }
        }
        // The work at the end of the batch: still one run per thread.
        let tail: Vec<&[u32]> = vec![&short, &short, &long];
        assert_eq!(split_into_runs(&tail, 2, usize::MAX), [0..2, 2..3]);
        // Fewer histories than threads: one run each.
        assert_eq!(split_into_runs(&batch[..3], 8, usize::MAX).len(), 3);
        let empty = split_into_runs(&[], 4, usize::MAX);
        assert_eq!((empty.len(), empty[0].is_empty()), (1, true));
    }
}
