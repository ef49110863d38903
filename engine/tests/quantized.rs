//! fp16, bf16 and int8 (weight-only) engines against the fp32 engine of the same checkpoint: score
//! error within named tolerances, ranking overlap and metric deltas measured and bounded.

mod common;

use common::*;
use recsys_engine::metrics::{evaluate, read_test_set};
use recsys_engine::{Engine, ModelKind};

/// Largest |score - fp32 score| accepted, for whole models quantized (embeddings, every dense layer
/// and the output layer). fp16 keeps 11 significant bits of each weight; int8 about 8 bits of each
/// row's largest weight, and the errors of BERT4Rec's 2 transformer layers add up. Measured
/// 2026-11-30: fp16 max 5.1e-3 (BERT4Rec) / 1.2e-3 (Mult-VAE); int8 max 0.21 / 0.045, with mean
/// errors of 0.017 / 0.0066 on logits of magnitude ~5-10.
const FP16_SCORE_ABS_TOL: f32 = 0.01;
const INT8_SCORE_ABS_TOL: f32 = 0.3;
/// bf16 keeps 8 significant bits of each weight and of each layer's input (a relative error of
/// up to 2^-9 each, where fp16 keeps 11 bits of the weights alone). Measured 2026-12-03: max 0.095
/// (BERT4Rec), 0.039 (SASRec), 0.042 (GRU4Rec), 0.014 (Mult-VAE), mean errors 2e-3..6e-3.
const BF16_SCORE_ABS_TOL: f32 = 0.15;

struct Comparison {
    max_abs: f32,
    mean_abs: f64,
    top10_jaccard: f64,
    top100_jaccard: f64,
    identical_top10: f64,
}

fn jaccard(a: &[u32], b: &[u32]) -> f64 {
    let inter = a.iter().filter(|x| b.contains(x)).count();
    inter as f64 / (a.len() + b.len() - inter).max(1) as f64
}

fn compare(kind: ModelKind, reference: &Engine, quantized: &Engine) -> Comparison {
    let cases = read_test_set(&fixtures().join("test_set.tsv")).unwrap();
    let (mut max_abs, mut sum_abs, mut count) = (0f32, 0f64, 0usize);
    let (mut j10, mut j100, mut same10) = (0f64, 0f64, 0usize);
    let users = 500;
    for case in cases.iter().take(users) {
        let ids: Vec<&str> = case.history.iter().map(String::as_str).collect();
        let history = reference
            .ids
            .map(recsys_engine::ExternalIds::Str(&ids))
            .indices;
        let (a, b) = (
            reference.score_all(&[&history]),
            quantized.score_all(&[&history]),
        );
        for (x, y) in a.iter().zip(&b).skip(1) {
            let e = (x - y).abs();
            max_abs = max_abs.max(e);
            sum_abs += e as f64;
            count += 1;
        }
        let request = |k| recsys_engine::InternalRequest {
            history: history.clone(),
            exclude: vec![],
            k,
            exclude_seen: true,
            candidates: None,
            embedding: false,
            eligible: None,
            popular: false,
            timestamps: Vec::new(),
            query_timestamp: 0,
        };
        let top = |e: &Engine, k| -> Vec<u32> {
            e.recommend_internal(&[request(k)])[0]
                .0
                .iter()
                .map(|s| s.index)
                .collect()
        };
        let (r10, q10) = (top(reference, 10), top(quantized, 10));
        j10 += jaccard(&r10, &q10);
        same10 += usize::from(r10 == q10);
        j100 += jaccard(&top(reference, 100), &top(quantized, 100));
    }
    let c = Comparison {
        max_abs,
        mean_abs: sum_abs / count as f64,
        top10_jaccard: j10 / users as f64,
        top100_jaccard: j100 / users as f64,
        identical_top10: same10 as f64 / users as f64,
    };
    eprintln!(
        "{kind} {:?}: max |score err| {:.2e}, mean {:.2e}, top-10 Jaccard {:.3}, top-100 Jaccard {:.3}, identical top-10 {:.1}%",
        quantized.manifest.precision, c.max_abs, c.mean_abs, c.top10_jaccard, c.top100_jaccard, 100.0 * c.identical_top10
    );
    c
}

fn check(kind: ModelKind) {
    let tmp = tempfile::tempdir().unwrap();
    let fp32 = convert_fixture_at(
        kind,
        "model.safetensors",
        &tmp.path().join("fp32"),
        Precision::Fp32,
    );
    let fp16 = convert_fixture_at(
        kind,
        "model.safetensors",
        &tmp.path().join("fp16"),
        Precision::Fp16,
    );
    let int8 = convert_fixture_at(
        kind,
        "model.safetensors",
        &tmp.path().join("int8"),
        Precision::Int8,
    );
    let bf16 = convert_fixture_at(
        kind,
        "model.safetensors",
        &tmp.path().join("bf16"),
        Precision::Bf16,
    );
    assert_eq!(
        bf16.manifest
            .quantization
            .as_ref()
            .unwrap()
            .output_layer
            .weights,
        "bf16"
    );
    assert_eq!(
        int8.manifest
            .quantization
            .as_ref()
            .unwrap()
            .output_layer
            .weights,
        "int8"
    );

    // Every embedding and dense weight is stored at the precision: the weights file shrinks.
    let size = |e: &Engine| e.manifest.files["weights.safetensors"].bytes as f64;
    eprintln!(
        "{kind}: weights file fp16 {:.2}x, int8 {:.2}x of fp32",
        size(&fp16) / size(&fp32),
        size(&int8) / size(&fp32)
    );
    assert!(size(&fp16) < 0.6 * size(&fp32) && size(&int8) < 0.35 * size(&fp32));
    assert!(size(&bf16) < 0.6 * size(&fp32));
    let listed = int8.manifest.quantization.as_ref().unwrap().tensors.len();
    assert!(listed >= 4, "{kind}: only {listed} tensors quantized");

    let c16 = compare(kind, &fp32, &fp16);
    assert!(
        c16.max_abs <= FP16_SCORE_ABS_TOL,
        "{kind} fp16: {}",
        c16.max_abs
    );
    assert!(
        c16.top10_jaccard >= 0.99,
        "{kind} fp16 top-10 overlap {}",
        c16.top10_jaccard
    );
    let cb = compare(kind, &fp32, &bf16);
    assert!(
        cb.max_abs <= BF16_SCORE_ABS_TOL,
        "{kind} bf16: {}",
        cb.max_abs
    );
    assert!(
        cb.top10_jaccard >= 0.95,
        "{kind} bf16 top-10 overlap {}",
        cb.top10_jaccard
    );
    let c8 = compare(kind, &fp32, &int8);
    assert!(
        c8.max_abs <= INT8_SCORE_ABS_TOL,
        "{kind} int8: {}",
        c8.max_abs
    );
    assert!(
        c8.top10_jaccard >= 0.95,
        "{kind} int8 top-10 overlap {}",
        c8.top10_jaccard
    );

    // Ranking quality on the whole test set: reported, and bounded loosely (a real regression in
    // the quantizer would cost far more than these bounds).
    let cases = read_test_set(&fixtures().join("test_set.tsv")).unwrap();
    let base = evaluate(&fp32, &cases, &[10], 256, |_| {}).unwrap().metrics["ndcg@10"];
    for engine in [&fp16, &bf16, &int8] {
        let ndcg = evaluate(engine, &cases, &[10], 256, |_| {})
            .unwrap()
            .metrics["ndcg@10"];
        let loss = (base - ndcg) / base;
        eprintln!(
            "{kind} {:?}: NDCG@10 {ndcg:.5} vs fp32 {base:.5} ({:+.2}%)",
            engine.manifest.precision,
            -100.0 * loss
        );
        assert!(
            loss < 0.02,
            "{kind} {:?} loses {:.2}% NDCG@10",
            engine.manifest.precision,
            100.0 * loss
        );
    }
}

/// W8A8 with each calibration method: calibrated on the first 1000 test histories, evaluated on all
/// 5000 (the same protocol a team would use with a held-out calibration sample).
fn check_w8a8(kind: ModelKind) {
    use recsys_engine::calibration::CalibrationMethod;
    let tmp = tempfile::tempdir().unwrap();
    let cases = read_test_set(&fixtures().join("test_set.tsv")).unwrap();
    let calibration: Vec<Vec<String>> =
        cases.iter().take(1000).map(|c| c.history.clone()).collect();
    let fp32 = convert_fixture_at(
        kind,
        "model.safetensors",
        &tmp.path().join("fp32"),
        Precision::Fp32,
    );
    let base = evaluate(&fp32, &cases, &[10], 256, |_| {}).unwrap().metrics["ndcg@10"];
    for (name, method) in [
        ("minmax", CalibrationMethod::MinMax),
        (
            "percentile",
            CalibrationMethod::Percentile { percentile: 99.99 },
        ),
        ("entropy", CalibrationMethod::Entropy),
    ] {
        let engine = convert_fixture_w8a8(kind, &tmp.path().join(name), &calibration, method);
        let summary = engine
            .manifest
            .calibration
            .clone()
            .expect("calibration recorded")
            .output_layer;
        assert_eq!(summary.histories, 1000);
        assert_eq!(
            engine
                .manifest
                .quantization
                .as_ref()
                .unwrap()
                .output_layer
                .mode,
            Some(recsys_engine::engine_dir::OutputLayerMode::W8a8)
        );
        let threshold = summary.threshold;
        assert!(threshold > 0.0 && threshold <= summary.abs_max * 1.001);
        let c = compare(kind, &fp32, &engine);
        let ndcg = evaluate(&engine, &cases, &[10], 256, |_| {})
            .unwrap()
            .metrics["ndcg@10"];
        let loss = (base - ndcg) / base;
        eprintln!(
            "{kind} w8a8 {name}: threshold {threshold:.4} (max {:.4}), NDCG@10 {ndcg:.5} vs fp32 {base:.5} ({:+.2}%)",
            summary.abs_max,
            -100.0 * loss
        );
        assert!(
            c.top10_jaccard >= 0.85,
            "{kind} w8a8 {name}: top-10 overlap {}",
            c.top10_jaccard
        );
        assert!(
            loss < 0.05,
            "{kind} w8a8 {name} loses {:.2}% NDCG@10",
            100.0 * loss
        );
    }
}

#[test]
fn bert4rec_w8a8_calibrations_stay_close_to_fp32() {
    check_w8a8(ModelKind::Bert4rec);
}

#[test]
fn vaecf_w8a8_calibrations_stay_close_to_fp32() {
    check_w8a8(ModelKind::Vaecf);
}

#[test]
fn bert4rec_fp16_bf16_and_int8_stay_close_to_fp32() {
    check(ModelKind::Bert4rec);
}

#[test]
fn vaecf_fp16_bf16_and_int8_stay_close_to_fp32() {
    check(ModelKind::Vaecf);
}

#[test]
fn sasrec_and_gru4rec_fp16_bf16_and_int8_stay_close_to_fp32() {
    check(ModelKind::Sasrec);
    check(ModelKind::Gru4rec);
}

#[test]
fn sasrec_and_gru4rec_w8a8_calibrations_stay_close_to_fp32() {
    check_w8a8(ModelKind::Sasrec);
    check_w8a8(ModelKind::Gru4rec);
}
