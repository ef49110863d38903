//! HSTU through the command line: `recsys convert` from the official trainer's checkpoint with
//! the gin config it was trained with (the kind read from the tensor names), then `recsys
//! predict` with `timestamps` and `query_timestamp` in its JSONL against the official code's
//! golden top-100; a line without timestamps fails alone, naming what it lacks; a bad gin file is
//! refused naming its line.

mod common;

use common::{fixtures, recsys, Run};

fn golden_cases() -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(fixtures().join("hstu/golden.json")).unwrap();
    let golden: serde_json::Value = serde_json::from_str(&text).unwrap();
    golden["cases"].as_array().unwrap().clone()
}

#[test]
fn an_official_checkpoint_and_its_gin_config_answer_as_pytorch_through_predict() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixtures().join("hstu");
    let engine = tmp.path().join("engine");
    let out = recsys(["convert", "--checkpoint"])
        .arg(dir.join("official_trainer_checkpoint.pt"))
        .arg("--gin")
        .arg(dir.join("train.gin"))
        .arg("--item-map")
        .arg(dir.join("item_id_map.tsv"))
        .arg("--output")
        .arg(&engine)
        .run()
        .ok();
    assert!(out.stdout.contains("wrote hstu engine"), "{}", out.stdout);

    let cases = golden_cases();
    let mut input: String = cases
        .iter()
        .map(|c| {
            serde_json::json!({
                "case": c["case"],
                "item_ids": c["history_external"],
                "timestamps": c["history_timestamps"],
                "query_timestamp": c["query_timestamp"],
            })
            .to_string()
                + "\n"
        })
        .collect();
    input.push_str(r#"{"case": "untimed", "item_ids": [10004529, 10004375]}"#);
    input.push('\n');
    std::fs::write(tmp.path().join("in.jsonl"), input).unwrap();
    recsys([
        "predict",
        "--k",
        "100",
        "--include-seen",
        "--batch-size",
        "9",
    ])
    .arg("--engine")
    .arg(&engine)
    .arg("--input")
    .arg(tmp.path().join("in.jsonl"))
    .arg("--output")
    .arg(tmp.path().join("out.jsonl"))
    .run()
    .fails(3, "1 failed");
    let out = std::fs::read_to_string(tmp.path().join("out.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), cases.len() + 1);
    for (line, case) in lines.iter().zip(&cases) {
        let want: Vec<i64> = case["topk"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["external"].as_i64().unwrap())
            .collect();
        let got: Vec<i64> = line["item_ids"]
            .as_array()
            .unwrap_or_else(|| panic!("case {}: {line}", case["case"]))
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect();
        assert_eq!(got.len(), want.len(), "case {}", case["case"]);
        // Places may swap only where PyTorch's own scores tie within the engine's tolerance
        // (1e-5: engine/tests/hstu.rs).
        let torch_score = |id: i64| {
            case["topk"]
                .as_array()
                .unwrap()
                .iter()
                .find(|t| t["external"].as_i64() == Some(id))
                .map(|t| t["score"].as_f64().unwrap())
        };
        for (pos, (g, w)) in got.iter().zip(&want).enumerate() {
            if g != w {
                let (ours, theirs) = (torch_score(*g), torch_score(*w).unwrap());
                assert!(
                    ours.is_some_and(|s| (s - theirs).abs() <= 1e-5),
                    "case {} position {pos}: {g} where PyTorch has {w}",
                    case["case"]
                );
            }
        }
    }
    // The official protocol's metrics from the gzip-compressed timestamped test file.
    let report = recsys(["eval", "--k", "10,50", "--engine"])
        .arg(&engine)
        .arg("--test")
        .arg(dir.join("test_set.tsv.gz"))
        .run()
        .ok()
        .json();
    let official: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("metrics.json")).unwrap()).unwrap();
    for (ours, theirs) in [
        ("ndcg@10", "ndcg@10"),
        ("recall@50", "hr@50"),
        ("mrr", "mrr"),
    ] {
        let got = report["metrics"][ours].as_f64().unwrap();
        let want = official["test_float64"][theirs].as_f64().unwrap();
        assert!((got - want).abs() <= 1e-6, "{ours}: {got} vs {want}");
    }

    let untimed = &lines[cases.len()];
    assert_eq!(untimed["case"], "untimed");
    assert!(
        untimed["error"].as_str().unwrap().contains("no timestamps"),
        "{untimed}"
    );
}

#[test]
fn a_timeline_queries_each_prefix_at_the_next_events_time() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixtures().join("hstu");
    let engine = tmp.path().join("engine");
    recsys(["convert", "--kind", "hstu", "--checkpoint"])
        .arg(dir.join("model.safetensors"))
        .arg("--config")
        .arg(dir.join("config.json"))
        .arg("--item-map")
        .arg(dir.join("item_id_map.tsv"))
        .arg("--output")
        .arg(&engine)
        .run()
        .ok();
    let case = &golden_cases()[0];
    let history = case["history_external"].as_array().unwrap();
    let times = case["history_timestamps"].as_array().unwrap();
    let n = history.len();
    // The whole history's timeline, and each prefix asked on its own with the next event's time
    // as its query time (the last: the line's query time).
    let mut input = serde_json::json!({
        "item_ids": history, "timestamps": times, "query_timestamp": case["query_timestamp"],
    })
    .to_string()
        + "\n";
    for t in 1..=n {
        let query = if t < n {
            times[t].clone()
        } else {
            case["query_timestamp"].clone()
        };
        input += &(serde_json::json!({
            "item_ids": history[..t], "timestamps": times[..t], "query_timestamp": query,
        })
        .to_string()
            + "\n");
    }
    std::fs::write(tmp.path().join("in.jsonl"), input).unwrap();
    recsys(["predict", "--k", "5", "--timeline", "--engine"])
        .arg(&engine)
        .arg("--input")
        .arg(tmp.path().join("in.jsonl"))
        .arg("--output")
        .arg(tmp.path().join("out.jsonl"))
        .run()
        .ok();
    let out = std::fs::read_to_string(tmp.path().join("out.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let timeline = lines[0]["timeline"].as_array().unwrap();
    assert_eq!(timeline.len(), n);
    for (t, event) in timeline.iter().enumerate() {
        assert_eq!(
            event["item_ids"],
            lines[t + 1]["item_ids"],
            "event {}",
            t + 1
        );
        assert_eq!(event["scores"], lines[t + 1]["scores"], "event {}", t + 1);
    }
}

#[test]
fn a_gin_file_that_is_not_bindings_is_refused_naming_its_line() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixtures().join("hstu");
    let gin = tmp.path().join("bad.gin");
    std::fs::write(
        &gin,
        "train_fn.max_sequence_length = 200\nhstu_encoder.num_heads 2\n",
    )
    .unwrap();
    recsys(["convert", "--checkpoint"])
        .arg(dir.join("model.safetensors"))
        .arg("--gin")
        .arg(&gin)
        .arg("--item-map")
        .arg(dir.join("item_id_map.tsv"))
        .arg("--output")
        .arg(tmp.path().join("engine"))
        .run()
        .fails(1, "bad.gin: line 2");
}
