//! `recsys export-items`: the item table whose inner products are the model's scores.

mod common;

use common::{json_of, read_npy};

#[test]
fn exported_item_tables_give_the_models_scores_by_inner_product() {
    /// |[h, 1] . row - engine score| for fp32 engines: both are f32 dot products of the same
    /// values in different summation orders (64- and 600-wide rows, scores of magnitude ~10).
    const SCORE_ABS_TOL: f32 = 1e-4;
    let tmp = tempfile::tempdir().unwrap();
    for (kind, name) in [
        (recsys_engine::ModelKind::Bert4rec, "bert4rec"),
        (recsys_engine::ModelKind::Vaecf, "multivae"),
    ] {
        let engine_dir = tmp.path().join(name);
        let engine = recsys_engine::fixtures::convert(
            kind,
            "model.safetensors",
            &engine_dir,
            recsys_engine::engine_dir::Precision::Fp32,
        )
        .unwrap();
        let out = tmp.path().join(format!("{name}-items"));
        let summary = json_of(&[
            std::ffi::OsStr::new("export-items"),
            std::ffi::OsStr::new("--engine"),
            engine_dir.as_os_str(),
            std::ffi::OsStr::new("--output"),
            out.as_os_str(),
            std::ffi::OsStr::new("--json"),
        ]);
        let n = engine.n_items();
        let ((rows, cols), table) = read_npy(&out.with_extension("npy"));
        let d = engine.model.output().input_size();
        assert_eq!((rows, cols), (n, d + 1));
        assert_eq!(summary["items"], n);
        let ids = std::fs::read_to_string(out.with_extension("ids.txt")).unwrap();
        let ids: Vec<&str> = ids.lines().collect();
        assert_eq!(ids.len(), n);
        for (row, id) in ids.iter().enumerate().step_by(97) {
            assert_eq!(engine.external_id(row as u32 + 1).unwrap().to_string(), *id);
        }
        // A few real histories: the inner product with [hidden, 1] is the engine's score.
        let cases = recsys_engine::metrics::read_test_set(
            &recsys_engine::fixtures::dir().join("test_set.tsv"),
        )
        .unwrap();
        let histories: Vec<Vec<u32>> = cases
            .iter()
            .take(8)
            .map(|c| {
                let ids: Vec<&str> = c.history.iter().map(String::as_str).collect();
                engine
                    .ids
                    .map(recsys_engine::ExternalIds::Str(&ids))
                    .indices
            })
            .collect();
        let refs: Vec<&[u32]> = histories.iter().map(Vec::as_slice).collect();
        let (hidden, _) = engine.model.encode(&refs);
        let scores = engine.score_all(&refs);
        let mut worst = 0f32;
        for (u, h) in hidden.chunks_exact(d).enumerate() {
            for item in 1..=n {
                let row = &table[(item - 1) * cols..item * cols];
                let dot: f32 = h.iter().zip(row).map(|(a, b)| a * b).sum::<f32>() + row[d];
                let want = scores[u * (n + 1) + item];
                worst = worst.max((dot - want).abs());
            }
        }
        assert!(
            worst <= SCORE_ABS_TOL,
            "{name}: max |inner product - score| {worst}"
        );
    }
}
