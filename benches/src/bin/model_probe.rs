//! Times whole-model recommendation (encode + fused score + top-k with exclusions) of an engine
//! directory on histories from a JSON file, for `scripts/bench_models.py`, which runs ONNX Runtime on
//! the same model and histories in the same invocation.
//!
//! model_probe ENGINE HISTORIES_JSON batch k threads reps [CANDIDATES_JSON]
//!
//! HISTORIES_JSON: a list of histories (lists of external int ids). Batches cycle through them.
//! CANDIDATES_JSON (optional): one candidate list per history (external int ids): each request
//! then ranks only its candidates (`scripts/bench_candidates.py`).
//! The engine runs as the server runs it: with the plans this CPU measures for it (screen, bf16
//! path, row block, threads per batch size; kept in the plan cache, `RECSYS_PLAN=off` skips them);
//! `RECSYS_PROBE_BF16_PATH=native|widened` pins a bf16 engine's kernel path.
//! `RECSYS_PROBE_CATALOGUE=FILE` puts a published catalogue delta (`recsys catalogue publish`'s
//! object) in force first, as a server's swap does, and reports how long applying it took; its
//! retired items are then left out of every request, as the server leaves them out.
//! A model that reads time (HSTU) gets event `p` of every history at `T0 + 3600 p` seconds and the
//! query time of the event after the last.
//! Prints JSON: median and mean seconds per batch, the top-k ids of the first history, the
//! thread-seconds per batch spent in dense layers, attention and the output layer, and the plans.
#![forbid(unsafe_code)]

use std::time::Instant;

use recsys_engine::{Engine, ExternalIds, InternalRequest};

/// The first event's time of every history of a model that reads time (2020-09-13).
const T0: i64 = 1_600_000_000;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if !(7..=8).contains(&args.len()) {
        eprintln!(
            "usage: model_probe ENGINE HISTORIES_JSON batch k threads reps [CANDIDATES_JSON]"
        );
        std::process::exit(2);
    }
    let mut engine = Engine::load(std::path::Path::new(&args[1])).unwrap_or_else(|e| panic!("{e}"));
    let mut catalogue_apply_s = None;
    if let Ok(path) = std::env::var("RECSYS_PROBE_CATALOGUE") {
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let file =
            recsys_engine::catalogue_file::CatalogueFile::from_bytes(&bytes, engine.ids.id_type())
                .unwrap_or_else(|e| panic!("{path}: {e}"));
        let start = Instant::now();
        engine = engine
            .with_catalogue(&file.delta)
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        catalogue_apply_s = Some(start.elapsed().as_secs_f64());
    }
    // What a request without a filter may be answered with: every item, or every item the
    // catalogue in force has not retired.
    let unfiltered = engine.filters.view().unfiltered();
    let histories: Vec<Vec<i64>> =
        serde_json::from_str(&std::fs::read_to_string(&args[2]).expect("read histories"))
            .expect("histories JSON");
    let batch: usize = args[3].parse().expect("batch");
    let k: usize = args[4].parse().expect("k");
    engine.set_threads(args[5].parse().expect("threads"));
    // A bf16 engine's kernel path as the backend parameter `bf16_path` pins it (auto by default):
    // `scripts/bench_bf16.py` times the pinned paths against the per-batch plan.
    let bf16_path: recsys_engine::plan::Bf16Path = std::env::var("RECSYS_PROBE_BF16_PATH")
        .unwrap_or_else(|_| "auto".into())
        .parse()
        .unwrap_or_else(|e: String| panic!("RECSYS_PROBE_BF16_PATH: {e}"));
    let amx: recsys_engine::plan_amx::AmxPolicy = std::env::var("RECSYS_PROBE_AMX")
        .unwrap_or_else(|_| "auto".into())
        .parse()
        .unwrap_or_else(|e: String| panic!("RECSYS_PROBE_AMX: {e}"));
    let plans: Vec<String> = [
        engine
            .plan_screen(recsys_engine::plan::ScreenPolicy::Auto)
            .map(|p| format!("screen: {}", p.describe())),
        engine
            .plan_bf16_path(bf16_path)
            .map(|p| format!("kernels: {}", p.describe())),
        engine
            .plan_row_block(recsys_engine::plan::RowBlockPolicy::Auto)
            .map(|p| format!("row block: {}", p.describe())),
        // AMX tiles for a bf16 engine, as the backend parameter `amx` pins it (auto by default).
        match engine.plan_amx(amx) {
            Ok(plan) => plan.map(|p| format!("amx: {}", p.describe())),
            Err(why) => Some(format!("amx: tiles not used: {why}")),
        },
        engine
            .plan_threads(recsys_engine::plan::ThreadPolicy::Auto)
            .map(|p| format!("threads: {}", p.describe())),
    ]
    .into_iter()
    .flatten()
    .collect();
    let reps: usize = args[6].parse().expect("reps");
    let mapped: Vec<Vec<u32>> = histories
        .iter()
        .map(|h| engine.ids.map(ExternalIds::Int(h)).indices)
        .collect();
    // Candidates as `Engine::prepare` leaves them: internal indices, ascending and distinct.
    let candidates: Option<Vec<Vec<u32>>> = args.get(7).map(|path| {
        let lists: Vec<Vec<i64>> =
            serde_json::from_str(&std::fs::read_to_string(path).expect("read candidates"))
                .expect("candidates JSON");
        lists
            .iter()
            .map(|c| {
                let mut indices = engine.ids.map(ExternalIds::Int(c)).indices;
                indices.sort_unstable();
                indices.dedup();
                indices
            })
            .collect()
    });
    // A model that reads time (HSTU): event p of every history at T0 + 3600 p, each asked at the
    // next event's time (the cost does not depend on the values).
    let timed = engine.kind().reads_timestamps();
    let longest = mapped.iter().map(Vec::len).max().unwrap_or(0);
    let clock: Vec<i64> = (0..=longest as i64).map(|p| T0 + 3600 * p).collect();
    let batches: Vec<Vec<InternalRequest>> = (0..reps.max(1))
        .map(|r| {
            (0..batch)
                .map(|i| {
                    let user = (r * batch + i) % mapped.len();
                    InternalRequest {
                        history: mapped[user].clone(),
                        exclude: Vec::new(),
                        k,
                        exclude_seen: true,
                        candidates: candidates
                            .as_ref()
                            .map(|lists| lists[user % lists.len()].clone()),
                        embedding: false,
                        eligible: unfiltered.clone(),
                        popular: false,
                        timestamps: if timed {
                            clock[..mapped[user].len()].to_vec()
                        } else {
                            Vec::new()
                        },
                        query_timestamp: if timed { clock[mapped[user].len()] } else { 0 },
                    }
                })
                .collect()
        })
        .collect();
    engine.recommend_internal(&batches[0]); // warm-up
                                            // Thread-seconds by kind of work over the timed batches, for the roofline columns.
    recsys_kernels::profile::take();
    recsys_kernels::profile::enable(true);
    let mut times: Vec<f64> = batches
        .iter()
        .map(|b| {
            let start = Instant::now();
            std::hint::black_box(engine.recommend_internal(b));
            start.elapsed().as_secs_f64()
        })
        .collect();
    recsys_kernels::profile::enable(false);
    let [dense, attention, output] = recsys_kernels::profile::take();
    let per_batch = |seconds: f64| seconds / batches.len() as f64;
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let first = engine.recommend_internal(&batches[0][..1]);
    let top: Vec<i64> = first[0]
        .0
        .iter()
        .filter_map(|s| engine.ids.external_int(s.index))
        .collect();
    println!(
        "{}",
        serde_json::json!({
            "median_s": times[times.len() / 2],
            "mean_s": times.iter().sum::<f64>() / times.len() as f64,
            "isa": engine.scorer.kernels.isa.name(),
            "top_first": top,
            // Per batch, summed over the threads that ran each kind (recsys_engine::profile).
            "thread_seconds": {"dense": per_batch(dense), "attention": per_batch(attention), "output": per_batch(output)},
            "plans": plans,
            "catalogue_apply_s": catalogue_apply_s,
            "items": engine.n_items(),
        })
    );
}
