//! HSTU against the official research code's PyTorch answers (`tests/fixtures/hstu`, made by
//! generative-recommenders at db1bf8f2e8f6): the 64 golden cases (test users, some longer than
//! the window; unknown ids; a repeated item; a query time equal to the last event and one 10^9 s
//! later; a one-item history) from the raw request (external ids, timestamps, query time), from
//! the plain state dict and from the official trainer's checkpoint (`module.`-prefixed names,
//! optimizer state beside them); a request without timestamps or with a wrong count is refused by
//! name; a config that disagrees with the weights is refused naming both.

mod common;

use std::path::Path;

use common::*;
use recsys_engine::{
    convert, ConvertRequest, Engine, EngineError, ExternalIds, ItemMapSource, ModelKind, Request,
    RequestTimes, ServeOptions,
};

/// Scores: the engine's f32 against PyTorch's f32 top-100 (which is within 2e-7 of float64).
const SCORE_ABS_TOL: f32 = 1e-5;
/// The user embedding against PyTorch's float64 one.
const EMBEDDING_ABS_TOL: f64 = 1e-5;

fn fixture() -> std::path::PathBuf {
    recsys_engine::fixtures::model_dir(ModelKind::Hstu)
}

fn convert_hstu(
    checkpoint: &str,
    kind: Option<ModelKind>,
    config: &serde_json::Map<String, serde_json::Value>,
    out: &Path,
) -> recsys_engine::Result<Engine> {
    convert(&ConvertRequest {
        kind,
        checkpoint: &fixture().join(checkpoint),
        config: Some(config),
        item_map: ItemMapSource::Tsv(&fixture().join("item_id_map.tsv")),
        out,
        precision: recsys_engine::engine_dir::Precision::Fp32,
        calibration: None,
        calibration_times: None,
        screen: Default::default(),
        w8a8_layers: Default::default(),
        catalogue: Default::default(),
    })
}

fn golden_cases() -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(fixture().join("golden.json")).unwrap();
    let golden: serde_json::Value = serde_json::from_str(&text).unwrap();
    golden["cases"].as_array().unwrap().clone()
}

fn request<'a>(history: &'a [i64], times: &'a [i64], query: Option<i64>) -> Request<'a> {
    Request {
        history: ExternalIds::Int(history),
        k: None,
        exclude: None,
        candidates: None,
        embedding: true,
        filter: None,
        times: Some(RequestTimes {
            events: times,
            query,
        }),
    }
}

/// Every golden case through `engine.recommend`: top-100 equal (but for PyTorch's own near-ties),
/// scores and the user embedding within tolerance. Returns the largest score and embedding
/// differences.
fn check_golden(engine: &Engine) -> (f32, f64) {
    // The golden top-100 ranks every item, the history's included.
    let options = ServeOptions {
        default_k: 100,
        exclude_seen: false,
        ..ServeOptions::default()
    };
    let cases = golden_cases();
    assert_eq!(cases.len(), 64);
    let (mut score_diff, mut embedding_diff) = (0f32, 0f64);
    for (n, case) in cases.iter().enumerate() {
        let history = i64s(&case["history_external"]);
        let times = i64s(&case["history_timestamps"]);
        let query = case["query_timestamp"].as_i64().unwrap();
        let answer = engine
            .recommend(&[request(&history, &times, Some(query))], &options)
            .remove(0)
            .unwrap_or_else(|e| panic!("case {n}: {e}"));
        assert_eq!(
            answer.unknown_ids,
            case["unknown_external_ids"].as_array().unwrap().len(),
            "case {n}"
        );
        let length = case["model_input_length"].as_u64().unwrap() as usize;
        assert_eq!(
            answer.truncated,
            history.len() - answer.unknown_ids > length,
            "case {n}"
        );

        let want_embedding: Vec<f64> = case["user_embedding_f64"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        // The embedding output is [h, 1]: the user vector, then the bias's coefficient.
        assert_eq!(answer.embedding.len(), want_embedding.len() + 1, "case {n}");
        for (got, want) in answer.embedding.iter().zip(&want_embedding) {
            embedding_diff = embedding_diff.max((*got as f64 - want).abs());
        }

        let want_top = case["topk"].as_array().unwrap();
        assert_eq!(answer.items.len(), want_top.len(), "case {n}");
        let torch_score = |index: u32| {
            want_top
                .iter()
                .find(|w| w["internal"].as_u64().unwrap() as u32 == index)
                .map(|w| w["score"].as_f64().unwrap() as f32)
        };
        for (pos, (got, want)) in answer.items.iter().zip(want_top).enumerate() {
            let want_index = want["internal"].as_u64().unwrap() as u32;
            let want_score = want["score"].as_f64().unwrap() as f32;
            score_diff = score_diff.max((got.score - want_score).abs());
            if got.index != want_index {
                // Only where PyTorch's own scores tie within the tolerance (the last places may
                // swap with an item just outside its top 100, whose score is then checked at
                // the place it took).
                let theirs = torch_score(got.index).unwrap_or(got.score);
                assert!(
                    (theirs - want_score).abs() <= SCORE_ABS_TOL,
                    "case {n} position {pos}: item {} (torch {theirs}) where torch has \
                     {want_index} ({want_score})",
                    got.index
                );
            }
        }
    }
    assert!(
        score_diff <= SCORE_ABS_TOL,
        "largest score difference {score_diff}"
    );
    assert!(
        embedding_diff <= EMBEDDING_ABS_TOL,
        "largest embedding difference {embedding_diff}"
    );
    (score_diff, embedding_diff)
}

#[test]
fn the_official_state_dict_reproduces_every_golden_case() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = convert_hstu(
        "model.safetensors",
        Some(ModelKind::Hstu),
        &config_json(ModelKind::Hstu),
        &tmp.path().join("engine"),
    )
    .unwrap();
    let (scores, embedding) = check_golden(&engine);
    eprintln!("HSTU fp32: scores within {scores:e}, user embedding within {embedding:e}");
}

#[test]
fn the_official_trainer_checkpoint_is_read_without_kind_and_answers_alike() {
    let tmp = tempfile::tempdir().unwrap();
    // `module.`-prefixed names and the optimizer's state beside them; the kind from the names.
    let engine = convert_hstu(
        "official_trainer_checkpoint.pt",
        None,
        &config_json(ModelKind::Hstu),
        &tmp.path().join("engine"),
    )
    .unwrap();
    assert_eq!(engine.kind(), ModelKind::Hstu);
    check_golden(&engine);
}

#[test]
fn requests_without_timestamps_or_with_a_wrong_count_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = convert_hstu(
        "model.safetensors",
        None,
        &config_json(ModelKind::Hstu),
        &tmp.path().join("engine"),
    )
    .unwrap();
    let case = &golden_cases()[0];
    let history = i64s(&case["history_external"]);
    let times = i64s(&case["history_timestamps"]);
    let options = ServeOptions::default();
    let untimed = Request {
        times: None,
        ..request(&history, &times, None)
    };
    let err = engine
        .recommend(&[untimed], &options)
        .remove(0)
        .unwrap_err();
    assert!(
        matches!(&err, EngineError::InvalidRequest(m) if m.contains("no timestamps")
            && m.contains("ITEM_TIMESTAMPS")),
        "{err}"
    );
    let err = engine
        .recommend(&[request(&history, &times[1..], None)], &options)
        .remove(0)
        .unwrap_err();
    assert!(
        err.to_string().contains(&format!(
            "{} timestamp(s) for {} history ids",
            times.len() - 1,
            times.len()
        )),
        "{err}"
    );
    // Without a query time, the request's time is now: a valid answer.
    let now = engine
        .recommend(&[request(&history, &times, None)], &options)
        .remove(0)
        .unwrap();
    assert_eq!(now.items.len(), options.default_k);
}

#[test]
fn a_config_that_disagrees_with_the_weights_is_refused_naming_both() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: [(&str, serde_json::Value, &[&str]); 4] = [
        ("num_blocks", 3.into(), &["num_blocks = 3", "implies 2"]),
        (
            "max_sequence_length",
            100.into(),
            &["max_sequence_length = 100", "has 211"],
        ),
        ("num_heads", 3.into(), &["num_heads = 3 does not divide"]),
        (
            "linear_activation",
            "gelu".into(),
            &["linear_activation = \"gelu\""],
        ),
    ];
    for (n, (key, value, needles)) in cases.into_iter().enumerate() {
        let mut config = config_json(ModelKind::Hstu);
        let hyper = config["hyperparameters"].as_object_mut().unwrap();
        hyper.insert(key.into(), value);
        let err = convert_hstu(
            "model.safetensors",
            None,
            &config,
            &tmp.path().join(n.to_string()),
        )
        .err()
        .expect("refused")
        .to_string();
        assert!(needles.iter().all(|s| err.contains(s)), "{key}: {err}");
    }

    // An HSTU checkpoint converted as another kind is named for what it holds.
    let err = convert_hstu(
        "model.safetensors",
        Some(ModelKind::Sasrec),
        &config_json(ModelKind::Hstu),
        &tmp.path().join("d"),
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(err.contains("holds an HSTU"), "{err}");
}

/// The official protocol's test metrics (metrics.json: every user's last interaction, the up to
/// 200 before it as the history with their timestamps, the target's time as the query time, the
/// window's items left out of the ranking) from the timestamped test file, gzip-compressed.
#[test]
fn the_official_test_metrics_are_reproduced_from_the_timestamped_test_file() {
    /// The metrics are means over 5,000 users of values that only a near-tie could move.
    const METRIC_ABS_TOL: f64 = 1e-6;
    let tmp = tempfile::tempdir().unwrap();
    let engine = convert_hstu(
        "model.safetensors",
        None,
        &config_json(ModelKind::Hstu),
        &tmp.path().join("engine"),
    )
    .unwrap();
    let cases = recsys_engine::metrics::read_test_set(&fixture().join("test_set.tsv.gz")).unwrap();
    assert_eq!(cases.len(), 5000);
    assert!(cases.iter().all(|c| c.times.is_some()));
    let report =
        recsys_engine::metrics::evaluate(&engine, &cases, &[1, 10, 50, 200], 256, |_| {}).unwrap();
    let text = std::fs::read_to_string(fixture().join("metrics.json")).unwrap();
    let want: serde_json::Value = serde_json::from_str(&text).unwrap();
    let want = &want["test_float64"];
    for (ours, theirs) in [
        ("ndcg@1", "ndcg@1"),
        ("ndcg@10", "ndcg@10"),
        ("ndcg@50", "ndcg@50"),
        ("ndcg@200", "ndcg@200"),
        ("recall@10", "hr@10"),
        ("recall@50", "hr@50"),
        ("recall@200", "hr@200"),
        ("mrr", "mrr"),
    ] {
        let (got, expected) = (report.metrics[ours], want[theirs].as_f64().unwrap());
        assert!(
            (got - expected).abs() <= METRIC_ABS_TOL,
            "{ours}: {got} against the official {expected}"
        );
    }
    assert_eq!(report.unknown_targets, 0);

    // A test file without timestamps cannot be evaluated on a model that reads time.
    let untimed: Vec<_> = cases
        .iter()
        .take(3)
        .cloned()
        .map(|mut c| {
            c.times = None;
            c
        })
        .collect();
    let err = recsys_engine::metrics::evaluate(&engine, &untimed, &[10], 256, |_| {})
        .expect_err("refused")
        .to_string();
    assert!(err.contains("the test set has no timestamps"), "{err}");
}

/// The official protocol's NDCG@10 at fp16, bf16 and int8 (weight-only), against fp32's; the
/// exact int8 screen of the fp32 and fp16 engines gives their own answers bit for bit (the screen
/// bounds the normalised table's scores as it bounds any output layer's, so the cosine ranking
/// stays exact); and two threads give one thread's bits.
#[test]
fn every_precision_the_screen_and_threads_keep_hstus_answers() {
    use recsys_engine::engine_dir::{Precision, Screen};
    /// NDCG@10 may move by at most this fraction of fp32's at a reduced precision.
    const NDCG_RELATIVE_DROP: f64 = 0.01;
    let tmp = tempfile::tempdir().unwrap();
    let cases = recsys_engine::metrics::read_test_set(&fixture().join("test_set.tsv.gz")).unwrap();
    let cases = &cases[..1000];
    let ndcg = |engine: &Engine| {
        recsys_engine::metrics::evaluate(engine, cases, &[10], 256, |_| {})
            .unwrap()
            .metrics["ndcg@10"]
    };
    let options = ServeOptions {
        default_k: 20,
        ..ServeOptions::default()
    };
    let answers = |engine: &Engine| -> Vec<Vec<(u32, u32)>> {
        let golden = golden_cases();
        let histories: Vec<Vec<i64>> = golden
            .iter()
            .map(|c| i64s(&c["history_external"]))
            .collect();
        let times: Vec<Vec<i64>> = golden
            .iter()
            .map(|c| i64s(&c["history_timestamps"]))
            .collect();
        let requests: Vec<Request<'_>> = histories
            .iter()
            .zip(&times)
            .zip(&golden)
            .map(|((h, t), c)| request(h, t, c["query_timestamp"].as_i64()))
            .collect();
        engine
            .recommend(&requests, &options)
            .into_iter()
            .map(|r| {
                r.unwrap()
                    .items
                    .iter()
                    .map(|s| (s.index, s.score.to_bits()))
                    .collect()
            })
            .collect()
    };
    let mut fp32 = None;
    for (name, precision) in [
        ("fp32", Precision::Fp32),
        ("fp16", Precision::Fp16),
        ("bf16", Precision::Bf16),
        ("int8", Precision::Int8),
    ] {
        let engine = common::convert_fixture_at(
            ModelKind::Hstu,
            "model.safetensors",
            &tmp.path().join(name),
            precision,
        );
        let score = ndcg(&engine);
        let base = *fp32.get_or_insert(score);
        assert!(
            score >= base * (1.0 - NDCG_RELATIVE_DROP),
            "{name}: NDCG@10 {score} against fp32's {base}"
        );
        eprintln!("HSTU {name}: NDCG@10 {score:.4} (fp32 {base:.4})");
        if matches!(precision, Precision::Fp32 | Precision::Fp16) {
            let screened = common::convert_fixture_screened(
                ModelKind::Hstu,
                &tmp.path().join(format!("{name}-screened")),
                precision,
                Screen::Int8,
            )
            .unwrap();
            assert_eq!(answers(&screened), answers(&engine), "{name}: screened");
        }
        let mut threaded = common::convert_fixture_at(
            ModelKind::Hstu,
            "model.safetensors",
            &tmp.path().join(format!("{name}-threads")),
            precision,
        );
        threaded.set_threads(2);
        assert_eq!(answers(&threaded), answers(&engine), "{name}: two threads");
    }
}

/// W8A8 (every dense layer's input and the output layer's at static int8 scales) calibrated on
/// the test file's first 256 histories with their timestamps, each asked at its target's time:
/// the official protocol's NDCG@10 within the precision test's 1 % of fp32's; calibration without
/// timestamps is refused by name, and so is a count of times that differs from the histories'.
#[test]
fn w8a8_calibrates_on_timestamped_histories() {
    use recsys_engine::calibration::CalibrationMethod;
    use recsys_engine::engine_dir::Precision;
    /// As in the precision test: NDCG@10 may move by at most this fraction of fp32's.
    const NDCG_RELATIVE_DROP: f64 = 0.01;
    let tmp = tempfile::tempdir().unwrap();
    let cases = recsys_engine::metrics::read_test_set(&fixture().join("test_set.tsv.gz")).unwrap();
    let calibration: Vec<Vec<String>> = cases[..256].iter().map(|c| c.history.clone()).collect();
    let times: Vec<_> = cases[..256]
        .iter()
        .map(|c| c.times.clone().unwrap())
        .collect();
    let config = config_json(ModelKind::Hstu);
    let (checkpoint, item_map) = (
        fixture().join("model.safetensors"),
        fixture().join("item_id_map.tsv"),
    );
    let outs = ["untimed", "short", "w8a8"].map(|name| tmp.path().join(name));
    let request = |out: usize, times| ConvertRequest {
        kind: Some(ModelKind::Hstu),
        checkpoint: &checkpoint,
        config: Some(&config),
        item_map: ItemMapSource::Tsv(&item_map),
        out: &outs[out],
        precision: Precision::Int8,
        calibration: Some((
            &calibration,
            CalibrationMethod::Percentile { percentile: 99.99 },
        )),
        calibration_times: times,
        screen: Default::default(),
        w8a8_layers: recsys_engine::W8a8Layers::All,
        catalogue: Default::default(),
    };
    let err = convert(&request(0, None))
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("needs its \"timestamps\""), "{err}");
    let err = convert(&request(1, Some(&times[1..])))
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("256 calibration histories but 255 with times"),
        "{err}"
    );

    let w8a8 = convert(&request(2, Some(&times))).unwrap();
    assert!(w8a8.manifest.static_dense_activations());
    let fp32 = common::convert_fixture_at(
        ModelKind::Hstu,
        "model.safetensors",
        &tmp.path().join("fp32"),
        Precision::Fp32,
    );
    let ndcg = |engine: &Engine| {
        recsys_engine::metrics::evaluate(engine, &cases[..1000], &[10], 256, |_| {})
            .unwrap()
            .metrics["ndcg@10"]
    };
    let (base, got) = (ndcg(&fp32), ndcg(&w8a8));
    eprintln!("HSTU w8a8-all: NDCG@10 {got:.4} (fp32 {base:.4})");
    assert!(
        got >= base * (1.0 - NDCG_RELATIVE_DROP),
        "{got} against {base}"
    );
}
