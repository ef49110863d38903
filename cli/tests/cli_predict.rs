//! `recsys predict` and `recsys eval` end to end on the fixture models: PyTorch's answers and
//! metrics, bad lines, threads, shards and resume, embeddings, candidates and screened engines.

mod common;

use std::path::Path;
use std::process::Stdio;

use common::{convert, convert_command, fixtures, read_npy, recsys, Run};

/// `recsys predict` answers each golden request with PyTorch's top-100, in input order.
fn predict_matches_golden(model_dir: &str, kind: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tmp.path().join("engine");
    convert(model_dir, kind, "model.safetensors", &engine);
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join(model_dir).join("golden.json")).unwrap(),
    )
    .unwrap();
    let cases = golden["cases"].as_array().unwrap();
    let input: String = cases
        .iter()
        .map(|c| {
            serde_json::json!({"case": c["case"], "item_ids": c["history_ext"]}).to_string() + "\n"
        })
        .collect();
    std::fs::write(tmp.path().join("in.jsonl"), input).unwrap();
    // A batch size that does not divide 64 checks order across batch boundaries.
    recsys(["predict", "--k", "100", "--batch-size", "7", "--engine"])
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
    assert_eq!(lines.len(), cases.len());
    let mut differing = 0;
    for (line, case) in lines.iter().zip(cases) {
        assert_eq!(line["case"], case["case"], "output order");
        let want: Vec<&serde_json::Value> = case["topk"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| &t["external"])
            .collect();
        let got: Vec<&serde_json::Value> = line["item_ids"].as_array().unwrap().iter().collect();
        assert_eq!(got.len(), want.len());
        let scores = case["topk"].as_array().unwrap();
        for (pos, (g, w)) in got.iter().zip(&want).enumerate() {
            if g != w {
                // Allowed only at an exact tie in PyTorch's own scores.
                let next = scores.get(pos + 1).map(|s| s["score"].as_f64().unwrap());
                let prev = pos
                    .checked_sub(1)
                    .map(|p| scores[p]["score"].as_f64().unwrap());
                let here = scores[pos]["score"].as_f64().unwrap();
                assert!(
                    next == Some(here) || prev == Some(here),
                    "case {}: position {pos}",
                    case["case"]
                );
                differing += 1;
            }
        }
    }
    assert_eq!(
        differing, 0,
        "top-100 positions differing (all at exact ties)"
    );
}

#[test]
fn bert4rec_predict_reproduces_pytorch_top100() {
    predict_matches_golden("bert4rec", "bert4rec");
}

#[test]
fn vaecf_predict_reproduces_pytorch_top100() {
    predict_matches_golden("multivae", "vaecf");
}

#[test]
fn eval_prints_pytorch_metrics() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tmp.path().join("engine");
    convert("bert4rec", "bert4rec", "recbole_checkpoint.pth", &engine);
    let out = recsys(["eval", "--k", "10,20,100", "--engine"])
        .arg(&engine)
        .arg("--test")
        .arg(fixtures().join("test_set.tsv"))
        .run()
        .ok();
    let report: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("bert4rec/metrics.json")).unwrap(),
    )
    .unwrap();
    for key in [
        "ndcg@10",
        "recall@10",
        "ndcg@20",
        "recall@20",
        "ndcg@100",
        "recall@100",
        "mrr",
    ] {
        let (got, want) = (
            report["metrics"][key].as_f64().unwrap(),
            expected["test_float64"][key].as_f64().unwrap(),
        );
        assert!((got - want).abs() <= 1e-6, "{key}: {got} vs {want}");
    }
    assert_eq!(report["metrics"]["n_users"], 5000);
}

#[test]
fn predict_reports_bad_lines_in_place_and_exits_3() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tmp.path().join("engine");
    convert("bert4rec", "bert4rec", "model.pt", &engine);
    let input = concat!(
        "{\"user_id\": 1, \"item_ids\": [10011403, 10011207]}\n",
        "{\"user_id\": 2, \"item_ids\": \"oops\"}\n",
        "this is not json\n",
        "\n",
        "{\"user_id\": 3, \"item_ids\": [\"10011403\"], \"k\": 2, \"exclude_item_ids\": [10011445]}\n",
        "{\"user_id\": 4, \"item_ids\": [10011403], \"k\": -1}\n",
        "{\"user_id\": 5, \"item_ids\": [1, 2, 3]}\n",
    );
    let mut child = recsys([
        "predict", "--input", "-", "--output", "-", "--k", "3", "--engine",
    ])
    .arg(&engine)
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), input.as_bytes()).unwrap();
    drop(child.stdin.take());
    let out = common::Outcome::from(child.wait_with_output().unwrap());
    assert_eq!(out.code, Some(3));
    let stderr = out.stderr.as_str();
    assert!(stderr.contains("6 lines, 3 ok, 3 failed"), "{stderr}");
    let lines: Vec<serde_json::Value> = out
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 6);
    assert_eq!(lines[0]["user_id"], 1);
    assert_eq!(lines[0]["item_ids"].as_array().unwrap().len(), 3);
    assert_eq!(lines[1]["user_id"], 2);
    assert!(lines[1]["error"].as_str().unwrap().contains("item_ids"));
    assert_eq!(lines[2]["line"], 3);
    assert!(lines[2]["error"].as_str().unwrap().contains("invalid JSON"));
    assert_eq!(lines[3]["user_id"], 3);
    let recs = lines[3]["item_ids"].as_array().unwrap();
    assert_eq!(recs.len(), 2);
    assert!(
        !recs.contains(&serde_json::json!(10011445)),
        "excluded item came back"
    );
    assert!(
        !recs.contains(&serde_json::json!(10011403)),
        "seen item came back"
    );
    assert!(lines[4]["error"].as_str().unwrap().contains("\"k\""));
    // Only unknown ids: the model's answer for an empty history, not an error.
    assert_eq!(lines[5]["user_id"], 5);
    assert_eq!(lines[5]["item_ids"].as_array().unwrap().len(), 3);

    // --strict-ids turns unknown ids into per-line errors.
    recsys(["predict", "--strict-ids", "--input"])
        .arg(tmp.path().join("missing.jsonl"))
        .args(["--output", "-", "--engine"])
        .arg(&engine)
        .run()
        .fails(1, "cannot open input");
}

#[test]
fn predict_threads_shards_and_resume_reproduce_the_plain_run() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tmp.path().join("engine");
    convert("bert4rec", "bert4rec", "model.pt", &engine);
    let input: String = std::fs::read_to_string(fixtures().join("test_set.tsv"))
        .unwrap()
        .lines()
        .skip(1)
        .take(200)
        .enumerate()
        .map(|(i, l)| {
            let ids: Vec<&str> = l.split('\t').nth(2).unwrap().split(' ').collect();
            let blank = if i == 50 { "\n" } else { "" }; // a blank line must not shift anything
            format!(
                "{blank}{{\"user_id\": {i}, \"item_ids\": [{}]}}\n",
                ids.join(", ")
            )
        })
        .collect();
    let input_path = tmp.path().join("in.jsonl");
    std::fs::write(&input_path, input).unwrap();
    let predict = |out: &Path, extra: &[&str]| {
        recsys(["predict", "--k", "5", "--batch-size", "7", "--engine"])
            .arg(&engine)
            .arg("--input")
            .arg(&input_path)
            .arg("--output")
            .arg(out)
            .args(extra)
            .stderr(Stdio::null())
            .run()
            .ok();
        std::fs::read_to_string(out).unwrap()
    };
    let plain = predict(&tmp.path().join("plain.jsonl"), &[]);
    let lines: Vec<&str> = plain.lines().collect();
    assert_eq!(lines.len(), 200);

    // Worker threads keep the input order.
    assert_eq!(
        predict(&tmp.path().join("threads.jsonl"), &["--threads", "3"]),
        plain
    );

    // Three shards cover every record exactly once.
    let mut from_shards = vec![String::new(); 200];
    for shard in 0..3 {
        let out = predict(
            &tmp.path().join(format!("s{shard}.jsonl")),
            &["--shard", &format!("{shard}/3")],
        );
        for (j, line) in out.lines().enumerate() {
            from_shards[shard + 3 * j] = line.to_string();
        }
    }
    assert_eq!(from_shards, lines);

    // Resume after an interruption that left 60 lines and half of the 61st.
    let resumed = tmp.path().join("resumed.jsonl");
    let partial: String = lines[..60]
        .iter()
        .map(|l| format!("{l}\n"))
        .collect::<String>()
        + &lines[60][..20];
    std::fs::write(&resumed, partial).unwrap();
    assert_eq!(predict(&resumed, &["--resume", "--threads", "2"]), plain);

    recsys(["predict", "--shard", "3/3", "--output", "-", "--input"])
        .arg(&input_path)
        .arg("--engine")
        .arg(&engine)
        .run()
        .fails(2, "--shard must be I/N");
}

#[test]
fn predict_returns_the_user_embedding_that_scores_the_exported_items() {
    let tmp = tempfile::tempdir().unwrap();
    let engine_dir = tmp.path().join("engine");
    convert("bert4rec", "bert4rec", "model.safetensors", &engine_dir);
    let items = tmp.path().join("items");
    recsys(["export-items", "--engine"])
        .arg(&engine_dir)
        .arg("--output")
        .arg(&items)
        .run()
        .ok();
    let ((_, cols), table) = read_npy(&items.with_extension("npy"));
    let ids: Vec<String> = std::fs::read_to_string(items.with_extension("ids.txt"))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    let input = tmp.path().join("in.jsonl");
    std::fs::write(
        &input,
        "{\"item_ids\": [10011403, 10011207], \"return_embedding\": true}\n\
         {\"item_ids\": [10011739]}\n\
         {\"item_ids\": [10011788], \"return_embedding\": \"yes\"}\n",
    )
    .unwrap();
    let out = recsys(["predict", "--k", "20", "--output", "-", "--engine"])
        .arg(&engine_dir)
        .arg("--input")
        .arg(&input)
        .run();
    assert_eq!(out.code, Some(3), "the third line is refused");
    let lines: Vec<serde_json::Value> = out
        .stdout
        .as_str()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        lines[1].get("embedding").is_none(),
        "only asked for on line 1"
    );
    assert!(lines[2]["error"]
        .as_str()
        .unwrap()
        .contains("return_embedding"));
    let embedding: Vec<f32> = lines[0]["embedding"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    assert_eq!(embedding.len(), cols);
    assert_eq!(*embedding.last().unwrap(), 1.0);
    for (id, score) in lines[0]["item_ids"]
        .as_array()
        .unwrap()
        .iter()
        .zip(lines[0]["scores"].as_array().unwrap())
    {
        let id = id.to_string();
        let row = ids.iter().position(|i| *i == id).unwrap();
        let dot: f32 = embedding
            .iter()
            .zip(&table[row * cols..(row + 1) * cols])
            .map(|(a, b)| a * b)
            .sum();
        // The JSON carries the engine's f32 score; the dot product sums in another order.
        assert!(
            (dot - score.as_f64().unwrap() as f32).abs() <= 1e-4,
            "{id}: {dot} vs {score}"
        );
    }
    // --return-embedding asks for every line.
    let out = recsys(["predict", "--return-embedding", "--output", "-", "--engine"])
        .arg(&engine_dir)
        .arg("--input")
        .arg(&input)
        .run();
    let lines: Vec<serde_json::Value> = out
        .stdout
        .as_str()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(lines[0].get("embedding").is_some() && lines[1].get("embedding").is_some());
}

#[test]
fn predict_ranks_a_lines_candidates_only() {
    let tmp = tempfile::tempdir().unwrap();
    let engine_dir = tmp.path().join("engine");
    convert("multivae", "vaecf", "model.safetensors", &engine_dir);
    let input = tmp.path().join("in.jsonl");
    // The whole catalogue's answer first, then the same user re-ranking five of its items plus one
    // unknown id (dropped) and one item of the history (left out, as always).
    std::fs::write(&input, "{\"item_ids\": [10006762, 10006545], \"k\": 30}\n").unwrap();
    let run = |input: &Path| {
        let out = recsys(["predict", "--output", "-", "--engine"])
            .arg(&engine_dir)
            .arg("--input")
            .arg(input)
            .run()
            .ok();
        out.stdout
            .as_str()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .collect::<Vec<_>>()
    };
    let whole = run(&input);
    let ids = whole[0]["item_ids"].as_array().unwrap();
    let scores = whole[0]["scores"].as_array().unwrap();
    let picked: Vec<&serde_json::Value> = [29, 3, 17, 8, 22].iter().map(|&i| &ids[i]).collect();
    let mut candidates: Vec<serde_json::Value> = picked.iter().map(|v| (*v).clone()).collect();
    candidates.push(serde_json::json!(-5));
    candidates.push(serde_json::json!(10006545));
    std::fs::write(
        &input,
        serde_json::json!({"item_ids": [10006762, 10006545], "candidate_item_ids": candidates})
            .to_string()
            + "\n",
    )
    .unwrap();
    let ranked = run(&input);
    // The five, in the whole scan's order, with its scores.
    let want: Vec<(serde_json::Value, serde_json::Value)> = [3, 8, 17, 22, 29]
        .iter()
        .map(|&i| (ids[i].clone(), scores[i].clone()))
        .collect();
    let got: Vec<(serde_json::Value, serde_json::Value)> = ranked[0]["item_ids"]
        .as_array()
        .unwrap()
        .iter()
        .cloned()
        .zip(ranked[0]["scores"].as_array().unwrap().iter().cloned())
        .collect();
    assert_eq!(got, want);
}

#[test]
fn a_screened_engine_predicts_byte_for_byte_what_the_plain_one_does() {
    let tmp = tempfile::tempdir().unwrap();
    let input: String = std::fs::read_to_string(fixtures().join("test_set.tsv"))
        .unwrap()
        .lines()
        .skip(1)
        .take(300)
        .enumerate()
        .map(|(i, l)| {
            let ids: Vec<&str> = l.split('\t').nth(2).unwrap().split(' ').collect();
            let k = [1, 10, 100, 1000][i % 4];
            format!(
                "{{\"user_id\": {i}, \"k\": {k}, \"item_ids\": [{}]}}\n",
                ids.join(", ")
            )
        })
        .collect();
    let input_path = tmp.path().join("in.jsonl");
    std::fs::write(&input_path, input).unwrap();
    for (model_dir, kind) in [("bert4rec", "bert4rec"), ("multivae", "vaecf")] {
        for precision in ["fp32", "fp16"] {
            let item_map = fixtures().join(model_dir).join("item_id_map.tsv");
            let mut outputs = Vec::new();
            for screen in ["none", "int8"] {
                let engine = tmp.path().join(format!("{kind}-{precision}-{screen}"));
                let done =
                    convert_command(model_dir, kind, "model.safetensors", &item_map, &engine)
                        .args(["--precision", precision, "--screen", screen, "--json"])
                        .run();
                assert!(done.success(), "{}", done.stderr.as_str());
                let summary: serde_json::Value = serde_json::from_str(&done.stdout).unwrap();
                assert_eq!(summary["screen"], screen);
                let out = tmp
                    .path()
                    .join(format!("{kind}-{precision}-{screen}.jsonl"));
                recsys(["predict", "--engine"])
                    .arg(&engine)
                    .arg("--input")
                    .arg(&input_path)
                    .arg("--output")
                    .arg(&out)
                    .stderr(Stdio::null())
                    .run()
                    .ok();
                outputs.push(std::fs::read(&out).unwrap());
            }
            assert!(
                outputs[0] == outputs[1],
                "{kind} {precision}: screened output differs"
            );
        }
    }
    // int8 engines already read int8 weights: refused, naming why, with the usage status.
    let item_map = fixtures().join("multivae").join("item_id_map.tsv");
    let done = convert_command(
        "multivae",
        "vaecf",
        "model.safetensors",
        &item_map,
        &tmp.path().join("x"),
    )
    .args(["--precision", "int8", "--screen", "int8"])
    .run();
    assert!(!done.success());
    assert!(done.stderr.as_str().contains("fp32 and fp16"));
}

/// `predict --timeline` answers each history after every event exactly as `predict` answers that
/// prefix on its own line: GRU4Rec and SASRec through their incremental passes, BERT4Rec by
/// recomputing (and saying so on stderr); a step with no known item is that step's error, not the
/// line's.
#[test]
fn timelines_answer_every_prefix_as_its_own_line_would() {
    let tmp = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(fixtures().join("test_set.tsv")).unwrap();
    let mut histories: Vec<Vec<i64>> = text
        .lines()
        .skip(1)
        .take(5)
        .map(|l| {
            l.split('\t')
                .nth(2)
                .unwrap()
                .split_whitespace()
                .map(|x| x.parse().unwrap())
                .take(70)
                .collect()
        })
        .collect();
    // An unknown id first: the first step has no known item.
    histories[1].insert(0, -5);
    for (model_dir, kind, note) in [
        ("gru4rec", "gru4rec", false),
        ("sasrec", "sasrec", false),
        ("bert4rec", "bert4rec", true),
    ] {
        let engine = tmp.path().join(model_dir);
        convert(model_dir, kind, "model.safetensors", &engine);
        let input: String = histories
            .iter()
            .map(|h| serde_json::json!({"item_ids": h}).to_string() + "\n")
            .collect();
        let prefixes: String = histories
            .iter()
            .flat_map(|h| {
                (1..=h.len())
                    .map(move |t| serde_json::json!({"item_ids": &h[..t]}).to_string() + "\n")
            })
            .collect();
        std::fs::write(tmp.path().join("in.jsonl"), input).unwrap();
        std::fs::write(tmp.path().join("prefixes.jsonl"), prefixes).unwrap();
        let timeline = recsys([
            "predict",
            "--k",
            "20",
            "--timeline",
            "--batch-size",
            "3",
            "--engine",
        ])
        .arg(&engine)
        .args(["--input"])
        .arg(tmp.path().join("in.jsonl"))
        .args(["--output", "-"])
        .run();
        // The step with no known item fails alone: the line itself answers.
        let stdout = timeline.stdout.clone();
        assert_eq!(
            stderr_has(&timeline.stderr, "recomputes each prefix"),
            note,
            "{}",
            timeline.stderr
        );
        let separate = recsys(["predict", "--k", "20", "--engine"])
            .arg(&engine)
            .args(["--input"])
            .arg(tmp.path().join("prefixes.jsonl"))
            .args(["--output", "-"])
            .run();
        let mut reference = separate
            .stdout
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap());
        for (line, history) in stdout.lines().zip(&histories) {
            let line: serde_json::Value = serde_json::from_str(line).unwrap();
            let events = line["timeline"].as_array().unwrap();
            assert_eq!(events.len(), history.len(), "{model_dir}");
            for (t, event) in events.iter().enumerate() {
                let want = reference.next().unwrap();
                assert_eq!(event["event"], t + 1);
                match want.get("error") {
                    Some(error) => {
                        assert_eq!(&event["error"], error, "{model_dir} event {}", t + 1)
                    }
                    None => {
                        assert_eq!(
                            event["item_ids"],
                            want["item_ids"],
                            "{model_dir} event {}",
                            t + 1
                        );
                        assert_eq!(
                            event["scores"],
                            want["scores"],
                            "{model_dir} event {}",
                            t + 1
                        );
                    }
                }
            }
            assert_eq!(line["item_ids"], events.last().unwrap()["item_ids"]);
        }
        assert!(reference.next().is_none());
    }
}

fn stderr_has(stderr: &str, needle: &str) -> bool {
    stderr.contains(needle)
}
