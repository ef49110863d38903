//! `recsys sweep`: quality and latency per precision, and its recommendation.

mod common;

use common::{fixtures, recsys, Run};

#[test]
fn sweep_reports_quality_latency_and_a_recommendation() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixtures().join("multivae");
    let out = tmp.path().join("sweep");
    recsys([
        "sweep",
        "--kind",
        "vaecf",
        "--precisions",
        "fp32,fp16,bf16,int8",
        "--int8-modes",
        "weight-only",
        "--batch-size",
        "1,8",
    ])
    .args([
        "--seconds",
        "0.05",
        "--compare-users",
        "50",
        "--budget-ndcg10",
        "1%",
        "--checkpoint",
    ])
    .arg(dir.join("model.safetensors"))
    .arg("--config")
    .arg(dir.join("config.json"))
    .arg("--item-map")
    .arg(dir.join("item_id_map.tsv"))
    .arg("--test")
    .arg(fixtures().join("test_set.tsv"))
    .arg("--out")
    .arg(&out)
    .run()
    .ok();
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    let variants = report["variants"].as_array().unwrap();
    let names: Vec<&str> = variants
        .iter()
        .map(|v| v["variant"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "fp32",
            "fp16",
            "bf16",
            "int8-wo",
            "fp32-screen-int8",
            "fp16-screen-int8"
        ]
    );
    // bf16 has its quality columns against fp32 (rounded weights and activations: close, not
    // equal), half fp32's weight bytes, and no screened variant (the screen refuses bf16).
    let bf16 = &variants[2];
    assert_eq!(bf16["convert_flags"], "--precision bf16");
    let top10 = bf16["top10_jaccard"].as_f64().unwrap();
    assert!((0.95..=1.0).contains(&top10), "bf16 top-10 Jaccard {top10}");
    let err = bf16["max_abs_score_error"].as_f64().unwrap();
    assert!(err > 0.0 && err < 0.15, "bf16 max score error {err}");
    assert!(bf16["ndcg10_relative_loss"].as_f64().unwrap().abs() < 0.02);
    assert!(
        bf16["weights_bytes"].as_u64().unwrap() * 10
            < variants[0]["weights_bytes"].as_u64().unwrap() * 6
    );
    let variants: Vec<serde_json::Value> = variants
        .iter()
        .filter(|v| v["variant"] != "bf16")
        .cloned()
        .collect();
    // Screened variants give their reference's answers exactly: the same metrics, and against
    // fp32 no score error at all.
    assert_eq!(variants[3]["metrics"], variants[0]["metrics"]);
    assert_eq!(variants[3]["max_abs_score_error"], 0.0);
    assert_eq!(variants[3]["identical_top10"], 1.0);
    assert_eq!(variants[4]["metrics"], variants[1]["metrics"]);
    assert!(variants[3]["convert_flags"]
        .as_str()
        .unwrap()
        .ends_with("--screen int8"));
    // Screened variants name the plan they were timed with; the others have none.
    for v in &variants {
        let screened = v["variant"].as_str().unwrap().contains("screen");
        let plan = v.get("screen_plan").and_then(|p| p.as_str());
        assert_eq!(plan.is_some(), screened, "{}", v["variant"]);
        if let Some(plan) = plan {
            assert!(
                plan.contains("batch 1+:") && plan.contains("batch 64+:"),
                "{plan}"
            );
        }
    }
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(
        md.contains("Screen plan of fp32-screen-int8 on this CPU:"),
        "{md}"
    );
    // The fp32 row is the engine's evaluation: PyTorch's float64 metrics.
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("metrics.json")).unwrap()).unwrap();
    for key in ["ndcg@10", "recall@10", "ndcg@100", "mrr"] {
        let (got, want) = (
            variants[0]["metrics"][key].as_f64().unwrap(),
            expected["test_float64"][key].as_f64().unwrap(),
        );
        assert!((got - want).abs() <= 1e-6, "{key}: {got} vs {want}");
    }
    assert_eq!(variants[0]["top10_jaccard"], 1.0);
    for v in &variants {
        assert_eq!(v["latency"].as_array().unwrap().len(), 2);
        assert!(v["latency"][0]["p50_ms"].as_f64().unwrap() > 0.0);
        assert!(v["weights_bytes"].as_u64().unwrap() > 0);
    }
    assert!(
        variants[2]["weights_bytes"].as_u64().unwrap() * 3
            < variants[0]["weights_bytes"].as_u64().unwrap()
    );
    // Among every variant, bf16 included (on a CPU with AMX its tiles can make it the fastest).
    let recommended = report["recommendation"]["variant"].as_str().unwrap();
    let row = report["variants"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["variant"] == recommended)
        .unwrap_or_else(|| {
            panic!("recommended {recommended:?} is not among {names:?}: {report:#}")
        });
    assert!(row["ndcg10_relative_loss"].as_f64().unwrap() <= 0.01);
    assert!(report["recommendation"]["command"]
        .as_str()
        .unwrap()
        .starts_with("recsys convert --kind vaecf"));
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("**Recommendation**") && md.contains("| int8-wo |"));
    let svg = std::fs::read_to_string(out.join("pareto.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("int8-wo") && svg.contains("recommended"));
    let png = std::fs::read(out.join("pareto.png")).unwrap();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000);

    // A variant list that does not start at fp32 is refused.
    recsys([
        "sweep",
        "--kind",
        "vaecf",
        "--precisions",
        "fp16",
        "--checkpoint",
    ])
    .arg(dir.join("model.safetensors"))
    .arg("--item-map")
    .arg(dir.join("item_id_map.tsv"))
    .arg("--test")
    .arg(fixtures().join("test_set.tsv"))
    .arg("--out")
    .arg(tmp.path().join("x"))
    .run()
    .fails(2, "must start with fp32");

    // A negative budget is refused rather than leaving nothing to recommend.
    recsys([
        "sweep",
        "--kind",
        "vaecf",
        "--precisions",
        "fp32",
        "--budget-ndcg10=-1%",
        "--checkpoint",
    ])
    .arg(dir.join("model.safetensors"))
    .arg("--item-map")
    .arg(dir.join("item_id_map.tsv"))
    .arg("--test")
    .arg(fixtures().join("test_set.tsv"))
    .arg("--out")
    .arg(tmp.path().join("y"))
    .run()
    .fails(2, "non-negative percentage");
}

/// A RecBole checkpoint names its model, so a sweep of one needs no --kind (SASRec here); its
/// fp32 row is RecBole's metrics and the recommended command names the kind it read.
#[test]
fn sweep_of_a_recbole_checkpoint_reads_its_kind() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixtures().join("sasrec");
    let out = tmp.path().join("sweep");
    recsys(["sweep", "--precisions", "fp32,fp16", "--batch-size", "1"])
        .args(["--seconds", "0.05", "--compare-users", "50", "--checkpoint"])
        .arg(dir.join("recbole_checkpoint.pth"))
        .arg("--recbole-dataset")
        .arg(fixtures().join("recbole_dataset/recsys-demo-Dataset.pth"))
        .arg("--test")
        .arg(fixtures().join("test_set.tsv"))
        .arg("--output")
        .arg(&out)
        .run()
        .ok();
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["model"], "sasrec");
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("metrics.json")).unwrap()).unwrap();
    let got = report["variants"][0]["metrics"]["ndcg@10"]
        .as_f64()
        .unwrap();
    let want = expected["test_float64"]["ndcg@10"].as_f64().unwrap();
    assert!((got - want).abs() <= 1e-6, "{got} vs {want}");
    assert!(report["recommendation"]["command"]
        .as_str()
        .unwrap()
        .starts_with("recsys convert --kind sasrec"));
    assert!(report["recommendation"]["command"]
        .as_str()
        .unwrap()
        .contains("--recbole-dataset "));
}
