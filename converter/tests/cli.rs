//! The `recsys` binary end to end on the fixture models: convert, predict and eval against PyTorch.

use std::path::Path;
use std::process::{Command, Stdio};

fn recsys() -> Command {
    Command::new(env!("CARGO_BIN_EXE_recsys"))
}

use recsys_engine::fixtures::dir as fixtures;

/// `recsys convert` of a fixture checkpoint with the fixture's config and the given item map.
fn convert_command(
    model_dir: &str,
    kind: &str,
    checkpoint: &str,
    item_map: &Path,
    out: &Path,
) -> Command {
    let dir = fixtures().join(model_dir);
    let mut cmd = recsys();
    cmd.args(["convert", "--kind", kind, "--checkpoint"])
        .arg(dir.join(checkpoint))
        .arg("--config")
        .arg(dir.join("config.json"))
        .arg("--item-map")
        .arg(item_map)
        .arg("--output")
        .arg(out);
    cmd
}

fn convert(model_dir: &str, kind: &str, checkpoint: &str, out: &Path) {
    let item_map = fixtures().join(model_dir).join("item_id_map.tsv");
    let status = convert_command(model_dir, kind, checkpoint, &item_map, out)
        .status()
        .unwrap();
    assert!(status.success());
}

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
    let status = recsys()
        .args(["predict", "--k", "100", "--batch-size", "7", "--engine"])
        .arg(&engine)
        .arg("--input")
        .arg(tmp.path().join("in.jsonl"))
        .arg("--output")
        .arg(tmp.path().join("out.jsonl"))
        .status()
        .unwrap();
    assert!(status.success());
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
    let out = recsys()
        .args(["eval", "--k", "10,20,100", "--engine"])
        .arg(&engine)
        .arg("--test")
        .arg(fixtures().join("test_set.tsv"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
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
    let mut child = recsys()
        .args([
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
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(3));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("6 lines, 3 ok, 3 failed"), "{stderr}");
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
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
    let out = recsys()
        .args(["predict", "--strict-ids", "--input"])
        .arg(tmp.path().join("missing.jsonl"))
        .args(["--output", "-", "--engine"])
        .arg(&engine)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot open input"));
}

#[test]
fn convert_refuses_to_overwrite_and_explains_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tmp.path().join("engine");
    convert("bert4rec", "bert4rec", "model.pt", &engine);
    let item_map = fixtures().join("bert4rec/item_id_map.tsv");
    let out = convert_command("bert4rec", "bert4rec", "model.pt", &item_map, &engine)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--force"));

    // The wrong kind for the checkpoint names the tensor it could not find.
    let out = convert_command("bert4rec", "vaecf", "model.pt", &item_map, &engine)
        .arg("--force")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("tensor 'encoder.0.weight' is missing"));
    // The failed conversion left the previous engine in place.
    assert!(engine.join("manifest.json").exists());

    let help = recsys().args(["predict", "--help"]).output().unwrap();
    assert!(String::from_utf8_lossy(&help.stdout).contains("Exit status"));

    // A RecBole checkpoint needs neither --kind nor --config: its own config names both.
    let dir = fixtures().join("bert4rec");
    let recbole = tmp.path().join("recbole");
    let out = recsys()
        .args(["convert", "--checkpoint"])
        .arg(dir.join("recbole_checkpoint.pth"))
        .arg("--item-map")
        .arg(&item_map)
        .arg("--out")
        .arg(&recbole)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("wrote bert4rec engine"));
    // A state dict without --kind: exit 1 with what to pass.
    let out = recsys()
        .args(["convert", "--checkpoint"])
        .arg(dir.join("model.pt"))
        .args(["--config"])
        .arg(dir.join("config.json"))
        .arg("--item-map")
        .arg(&item_map)
        .arg("--out")
        .arg(tmp.path().join("plain"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("pass --kind bert4rec, vaecf, sasrec or gru4rec"));
}

#[test]
fn string_catalogue_gives_the_same_answers_as_int_ids() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixtures().join("bert4rec");
    // The same catalogue keyed by strings: "sku-<id>".
    let map = std::fs::read_to_string(dir.join("item_id_map.tsv")).unwrap();
    let string_map: String = map
        .lines()
        .skip(1)
        .map(|l| {
            let (i, ext) = l.split_once('\t').unwrap();
            format!("{i}\tsku-{ext}\n")
        })
        .collect();
    std::fs::write(tmp.path().join("map.tsv"), string_map).unwrap();
    let status = convert_command(
        "bert4rec",
        "bert4rec",
        "model.safetensors",
        &tmp.path().join("map.tsv"),
        &tmp.path().join("strings"),
    )
    .status()
    .unwrap();
    assert!(status.success());
    convert(
        "bert4rec",
        "bert4rec",
        "model.safetensors",
        &tmp.path().join("ints"),
    );

    let run = |engine: &str, input: &str| -> serde_json::Value {
        let path = tmp.path().join(format!("{engine}.jsonl"));
        std::fs::write(&path, input).unwrap();
        let out = recsys()
            .args(["predict", "--k", "5", "--output", "-", "--input"])
            .arg(&path)
            .arg("--engine")
            .arg(tmp.path().join(engine))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let ints = run("ints", "{\"item_ids\": [10011403, 10011207, 42]}\n");
    let strings = run(
        "strings",
        "{\"item_ids\": [\"sku-10011403\", \"sku-10011207\", \"sku-nope\"]}\n",
    );
    let expected: Vec<serde_json::Value> = ints["item_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|id| serde_json::json!(format!("sku-{id}")))
        .collect();
    assert_eq!(strings["item_ids"].as_array().unwrap(), &expected);
    assert_eq!(strings["scores"], ints["scores"]);
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("strings/manifest.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(manifest["id_type"], "string");
}

#[test]
fn convert_w8a8_with_calibration_and_clear_flag_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let item_map = fixtures().join("multivae/item_id_map.tsv");
    // Calibration histories in the predict input format, from the test set.
    let lines: String = std::fs::read_to_string(fixtures().join("test_set.tsv"))
        .unwrap()
        .lines()
        .skip(1)
        .take(300)
        .map(|l| {
            let ids: Vec<&str> = l.split('\t').nth(2).unwrap().split(' ').collect();
            format!("{{\"item_ids\": [{}]}}\n", ids.join(", "))
        })
        .collect();
    let calib = tmp.path().join("calibration.jsonl");
    std::fs::write(&calib, lines).unwrap();

    let out = convert_command(
        "multivae",
        "vaecf",
        "model.safetensors",
        &item_map,
        &tmp.path().join("w8a8"),
    )
    .args([
        "--precision",
        "int8",
        "--int8-mode",
        "w8a8",
        "--calibration-method",
        "percentile",
        "--calibration",
    ])
    .arg(&calib)
    .output()
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("calibration: percentile over 300 histories"),
        "{stdout}"
    );
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("w8a8/manifest.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(manifest["precision"], "int8");
    assert_eq!(manifest["quantization"]["output_layer"]["mode"], "w8a8");
    assert_eq!(manifest["calibration"]["method"], "percentile");

    // The engine serves.
    let out = recsys()
        .args([
            "predict", "--k", "3", "--input", "-", "--output", "-", "--engine",
        ])
        .arg(tmp.path().join("w8a8"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            std::io::Write::write_all(
                child.stdin.as_mut().unwrap(),
                b"{\"item_ids\": [10011403]}\n",
            )?;
            drop(child.stdin.take());
            child.wait_with_output()
        })
        .unwrap();
    assert!(out.status.success());
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(line["item_ids"].as_array().unwrap().len(), 3);

    // w8a8 without calibration, and calibration without w8a8, are refused with the reason.
    let out = convert_command(
        "multivae",
        "vaecf",
        "model.safetensors",
        &item_map,
        &tmp.path().join("x"),
    )
    .args(["--precision", "int8", "--int8-mode", "w8a8"])
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs --calibration"));
    let out = convert_command(
        "multivae",
        "vaecf",
        "model.safetensors",
        &item_map,
        &tmp.path().join("y"),
    )
    .args(["--precision", "fp16", "--calibration"])
    .arg(&calib)
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--calibration applies to"));
    let out = convert_command(
        "multivae",
        "vaecf",
        "model.safetensors",
        &item_map,
        &tmp.path().join("z"),
    )
    .args(["--precision", "int8", "--int8-mode", "w8a8-all"])
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--int8-mode w8a8-all needs --calibration")
    );

    // w8a8-all: every dense layer's scale applied, and the export prints its strongly typed
    // TensorRT build.
    let all = tmp.path().join("all");
    let out = convert_command("multivae", "vaecf", "model.safetensors", &item_map, &all)
        .args([
            "--precision",
            "int8",
            "--int8-mode",
            "w8a8-all",
            "--calibration",
        ])
        .arg(&calib)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(all.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["quantization"]["dense_activations"], "static");
    let out = recsys()
        .args(["export-onnx", "--engine"])
        .arg(&all)
        .arg("--output")
        .arg(tmp.path().join("all.onnx"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("(w8a8)") && text.contains("3 QuantizeLinear"),
        "{text}"
    );
    assert!(text.contains("TensorRT 10 rules: passed"), "{text}");
    assert!(
        text.contains("trtexec --onnx=") && text.contains("--stronglyTyped"),
        "{text}"
    );
}

#[test]
fn publish_approve_reject_keep_the_newest_approved_version_serving() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = tmp.path().join("repo");
    std::fs::create_dir_all(repo.join("bert4rec")).unwrap();
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../model_repository/bert4rec/config.pbtxt"),
        repo.join("bert4rec/config.pbtxt"),
    )
    .unwrap();
    let engine = tmp.path().join("engine");
    convert("bert4rec", "bert4rec", "model.pt", &engine);
    let run = |args: &[&str]| {
        let out = recsys()
            .args(args)
            .arg("--repository")
            .arg(&repo)
            .args(["--model", "bert4rec"])
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let policy = || {
        let text = std::fs::read_to_string(repo.join("bert4rec/config.pbtxt")).unwrap();
        assert_eq!(text.matches("version_policy").count(), 1, "{text}");
        text.split("versions: [ ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .to_string()
    };
    let engine_arg = engine.to_str().unwrap();

    // The first version must be approved.
    let (code, _, err) = run(&["publish", "--engine", engine_arg]);
    assert_eq!(code, Some(2));
    assert!(err.contains("--approve"), "{err}");
    assert_eq!(
        run(&["publish", "--approve", "--engine", engine_arg]).0,
        Some(0)
    );
    assert_eq!(policy(), "1");
    // A pending version does not serve.
    let (code, out, _) = run(&["publish", "--engine", engine_arg]);
    assert_eq!(code, Some(0));
    assert!(out.contains("version 2 is pending"), "{out}");
    assert_eq!(policy(), "1");
    assert_eq!(run(&["approve", "--version", "2"]).0, Some(0));
    assert_eq!(policy(), "2");
    // Rejecting the serving version rolls back.
    assert_eq!(run(&["reject", "--version", "2"]).0, Some(0));
    assert_eq!(policy(), "1");
    // The only approved version cannot be rejected; unknown versions are named.
    let (code, _, err) = run(&["reject", "--version", "1"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("only approved version"), "{err}");
    let (code, _, err) = run(&["approve", "--version", "9"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("no version 9"), "{err}");
    let (code, out, _) = run(&["versions"]);
    assert_eq!(code, Some(0));
    assert!(
        out.lines().nth(1).unwrap().contains("approved")
            && out.lines().nth(1).unwrap().contains("yes"),
        "{out}"
    );
    assert!(out.lines().nth(2).unwrap().contains("rejected"), "{out}");
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo.join("bert4rec/2/recsys-version.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(meta["status"], "rejected");
    // upload started, published pending, approved, rejected.
    assert_eq!(meta["history"].as_array().unwrap().len(), 4);
    // No lock or staging leftovers.
    let leftovers: Vec<_> = std::fs::read_dir(repo.join("bert4rec"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // A corrupted version is refused with exit 3, nothing changes, and `versions` says why.
    assert_eq!(run(&["publish", "--engine", engine_arg]).0, Some(0));
    let weights = repo.join("bert4rec/3/weights.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x80;
    std::fs::write(&weights, bytes).unwrap();
    let (code, out, err) = run(&["approve", "--version", "3"]);
    assert_eq!(code, Some(3), "{out}{err}");
    assert!(
        err.contains("SHA-256") && err.contains("nothing changed"),
        "{err}"
    );
    assert_eq!(policy(), "1");
    let (_, out, _) = run(&["versions"]);
    assert!(
        out.lines().nth(3).unwrap().contains("approve refused"),
        "{out}"
    );
    // rollback: 4 approved over 1, then back to 1; prune keeps what may serve.
    assert_eq!(
        run(&["publish", "--approve", "--engine", engine_arg]).0,
        Some(0)
    );
    assert_eq!(policy(), "4");
    let (code, out, err) = run(&["rollback"]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains("rolled back from version 4 to version 1"),
        "{out}"
    );
    assert_eq!(policy(), "1");
    let (code, _, err) = run(&["rollback"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("no approved version older"), "{err}");
    let (code, out, _) = run(&["versions", "--prune", "--keep", "1", "--dry-run"]);
    assert_eq!(code, Some(0));
    assert!(out.contains("would remove bert4rec version 2"), "{out}");
    assert!(out.contains("kept bert4rec version 1: serving"), "{out}");
    assert!(out.contains("kept bert4rec version 3: pending"), "{out}");
    assert!(
        repo.join("bert4rec/2").exists(),
        "a dry run removes nothing"
    );
    assert_eq!(run(&["versions", "--prune", "--keep", "1"]).0, Some(0));
    assert!(!repo.join("bert4rec/2").exists());
    let (code, _, err) = run(&["versions", "--prune"]);
    assert_eq!(code, Some(2), "--prune needs --keep: {err}");
}

/// Runs `recsys ARGS` and parses its standard output as one JSON object.
fn json_of(args: &[&std::ffi::OsStr]) -> serde_json::Value {
    let out = recsys().args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{args:?} printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

#[test]
fn publish_writes_a_minimal_config_and_every_writing_command_speaks_json() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixtures().join("multivae");
    let engine = tmp.path().join("engine");
    let os = |s: &str| std::ffi::OsString::from(s);
    let converted = json_of(&[
        &os("convert"),
        &os("--kind"),
        &os("vaecf"),
        &os("--checkpoint"),
        dir.join("model.safetensors").as_os_str(),
        &os("--config"),
        dir.join("config.json").as_os_str(),
        &os("--item-map"),
        dir.join("item_id_map.tsv").as_os_str(),
        &os("--output"),
        engine.as_os_str(),
        &os("--json"),
    ]);
    assert_eq!(converted["kind"], "vaecf");
    assert_eq!(converted["precision"], "fp32");
    let items = std::fs::read_to_string(dir.join("item_id_map.tsv"))
        .unwrap()
        .lines()
        .count()
        - 1;
    assert_eq!(converted["items"], items);
    assert_eq!(converted["engine"], engine.to_str().unwrap());

    // A model directory that does not exist yet: publish writes a minimal config.
    let repo = tmp.path().join("repo");
    let published = json_of(&[
        &os("publish"),
        &os("--repository"),
        repo.as_os_str(),
        &os("--model"),
        &os("vaecf"),
        &os("--engine"),
        engine.as_os_str(),
        &os("--approve"),
        &os("--max-batch-size"),
        &os("16"),
        &os("--json"),
    ]);
    assert_eq!(published["version"], 1);
    assert_eq!(published["status"], "approved");
    assert!(published["approve_command"].is_null());
    let config = std::fs::read_to_string(repo.join("vaecf/config.pbtxt")).unwrap();
    assert_eq!(published["created_config"], true);
    assert!(
        config.contains("backend: \"recsys\"") && config.contains("max_batch_size: 16"),
        "{config}"
    );
    assert!(config.contains("versions: [ 1 ]"), "{config}");

    // A pending version: the printed command, pasted into a shell, makes it serve.
    let out = recsys()
        .args(["publish", "--model", "vaecf", "--repository"])
        .arg(&repo)
        .arg("--engine")
        .arg(&engine)
        .output()
        .unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let command = stdout
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("recsys approve "))
        .unwrap_or_else(|| panic!("no approve command in {stdout}"));
    let pasted = Command::new("bash")
        .arg("-c")
        .arg(command.replacen("recsys", env!("CARGO_BIN_EXE_recsys"), 1) + " --json")
        .output()
        .unwrap();
    assert!(
        pasted.status.success(),
        "{command}: {}",
        String::from_utf8_lossy(&pasted.stderr)
    );
    let approved: serde_json::Value = serde_json::from_slice(&pasted.stdout).unwrap();
    assert_eq!(
        (
            approved["version"].as_u64(),
            approved["serving_version"].as_u64()
        ),
        (Some(2), Some(2))
    );

    let rejected = json_of(&[
        &os("reject"),
        &os("--repository"),
        repo.as_os_str(),
        &os("--model"),
        &os("vaecf"),
        &os("--version"),
        &os("2"),
        &os("--json"),
    ]);
    assert_eq!(rejected["status"], "rejected");
    assert_eq!(rejected["serving_version"], 1);

    let onnx = tmp.path().join("model.onnx");
    let exported = json_of(&[
        &os("export-onnx"),
        &os("--engine"),
        engine.as_os_str(),
        &os("--output"),
        onnx.as_os_str(),
        &os("--json"),
    ]);
    assert_eq!(exported["path"], onnx.to_str().unwrap());
    assert!(exported["nodes"].as_u64().unwrap() > 0);
    assert_eq!(
        exported["bytes"].as_u64(),
        Some(std::fs::metadata(&onnx).unwrap().len())
    );
}

#[test]
fn bad_flag_combinations_exit_with_status_2() {
    let tmp = tempfile::tempdir().unwrap();
    // clap's own refusals and the commands' checks of flags that parse but do not go together.
    for args in [
        vec!["convert", "--kind", "vaecf"],
        vec![
            "export-onnx",
            "--engine",
            "x",
            "--output",
            "y",
            "--model-repository",
            "z",
        ],
        vec![
            "predict", "--engine", "e", "--input", "i", "--output", "-", "--resume",
        ],
        vec![
            "export-onnx",
            "--engine",
            "e",
            "--output",
            "x.onnx",
            "--k",
            "4000",
        ],
    ] {
        let out = recsys()
            .args(&args)
            .current_dir(tmp.path())
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn concurrent_publishes_get_distinct_versions() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = tmp.path().join("repo");
    std::fs::create_dir_all(repo.join("m")).unwrap();
    std::fs::write(
        repo.join("m/config.pbtxt"),
        "backend: \"recsys\"\nmax_batch_size: 8\n",
    )
    .unwrap();
    let engine = tmp.path().join("engine");
    convert("bert4rec", "bert4rec", "model.pt", &engine);
    let children: Vec<_> = (0..4)
        .map(|_| {
            recsys()
                .args(["publish", "--approve", "--model", "m", "--repository"])
                .arg(&repo)
                .arg("--engine")
                .arg(&engine)
                .stdout(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
    let mut versions: Vec<u64> = std::fs::read_dir(repo.join("m"))
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
        .collect();
    versions.sort();
    assert_eq!(versions, vec![1, 2, 3, 4]);
    let text = std::fs::read_to_string(repo.join("m/config.pbtxt")).unwrap();
    assert!(text.contains("versions: [ 4 ]"), "{text}");
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
        let status = recsys()
            .args(["predict", "--k", "5", "--batch-size", "7", "--engine"])
            .arg(&engine)
            .arg("--input")
            .arg(&input_path)
            .arg("--output")
            .arg(out)
            .args(extra)
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success());
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

    let out = recsys()
        .args(["predict", "--shard", "3/3", "--output", "-", "--input"])
        .arg(&input_path)
        .arg("--engine")
        .arg(&engine)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--shard must be I/N"));
}

#[test]
fn sweep_reports_quality_latency_and_a_recommendation() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixtures().join("multivae");
    let out = tmp.path().join("sweep");
    let run = recsys()
        .args([
            "sweep",
            "--kind",
            "vaecf",
            "--precisions",
            "fp32,fp16,int8",
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
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
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
            "int8-wo",
            "fp32-screen-int8",
            "fp16-screen-int8"
        ]
    );
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
    for v in variants {
        assert_eq!(v["latency"].as_array().unwrap().len(), 2);
        assert!(v["latency"][0]["p50_ms"].as_f64().unwrap() > 0.0);
        assert!(v["weights_bytes"].as_u64().unwrap() > 0);
    }
    assert!(
        variants[2]["weights_bytes"].as_u64().unwrap() * 3
            < variants[0]["weights_bytes"].as_u64().unwrap()
    );
    let recommended = report["recommendation"]["variant"].as_str().unwrap();
    let row = variants
        .iter()
        .find(|v| v["variant"] == recommended)
        .unwrap();
    assert!(row["ndcg10_relative_loss"].as_f64().unwrap() <= 0.01);
    assert!(report["recommendation"]["command"]
        .as_str()
        .unwrap()
        .starts_with("recsys convert --kind vaecf"));
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("**Recommendation**") && md.contains("| int8-wo |"));
    let svg = std::fs::read_to_string(out.join("pareto.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("polyline") && svg.contains("int8-wo"));
    let png = std::fs::read(out.join("pareto.png")).unwrap();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000);

    // A variant list that does not start at fp32 is refused.
    let bad = recsys()
        .args([
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
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("must start with fp32"));

    // A negative budget is refused rather than leaving nothing to recommend.
    let bad = recsys()
        .args([
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
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("non-negative percentage"));
}

/// A RecBole checkpoint names its model, so a sweep of one needs no --kind (SASRec here); its
/// fp32 row is RecBole's metrics and the recommended command names the kind it read.
#[test]
fn sweep_of_a_recbole_checkpoint_reads_its_kind() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixtures().join("sasrec");
    let out = tmp.path().join("sweep");
    let run = recsys()
        .args(["sweep", "--precisions", "fp32,fp16", "--batch-size", "1"])
        .args(["--seconds", "0.05", "--compare-users", "50", "--checkpoint"])
        .arg(dir.join("recbole_checkpoint.pth"))
        .arg("--recbole-dataset")
        .arg(fixtures().join("recbole_dataset/recsys-demo-Dataset.pth"))
        .arg("--test")
        .arg(fixtures().join("test_set.tsv"))
        .arg("--output")
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
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

#[test]
fn a_recbole_checkpoint_and_its_saved_dataset_convert_with_no_hand_made_file() {
    let tmp = tempfile::tempdir().unwrap();
    let checkpoint = fixtures().join("sasrec/recbole_checkpoint.pth");
    let saved = fixtures().join("recbole_dataset/recsys-demo-Dataset.pth");
    let engine = tmp.path().join("engine");
    let run = recsys()
        .args(["convert", "--checkpoint"])
        .arg(&checkpoint)
        .arg("--recbole-dataset")
        .arg(&saved)
        .arg("--output")
        .arg(&engine)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    // The engine's item ids are RecBole's numbering: the hand-made map's, line for line.
    let ids = std::fs::read_to_string(engine.join("item_ids.tsv")).unwrap();
    let hand_made = std::fs::read_to_string(fixtures().join("sasrec/item_id_map.tsv")).unwrap();
    let rows = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| l.starts_with(|c: char| c.is_ascii_digit()))
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(rows(&ids), rows(&hand_made));

    // Exactly one of the two item-map flags.
    let both = recsys()
        .args(["convert", "--checkpoint"])
        .arg(&checkpoint)
        .arg("--recbole-dataset")
        .arg(&saved)
        .arg("--item-map")
        .arg(fixtures().join("sasrec/item_id_map.tsv"))
        .arg("--output")
        .arg(tmp.path().join("both"))
        .output()
        .unwrap();
    assert_eq!(both.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&both.stderr);
    assert!(
        stderr.contains("--item-map") && stderr.contains("--recbole-dataset"),
        "{stderr}"
    );
    let neither = recsys()
        .args(["convert", "--checkpoint"])
        .arg(&checkpoint)
        .arg("--output")
        .arg(tmp.path().join("neither"))
        .output()
        .unwrap();
    assert_eq!(neither.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&neither.stderr);
    assert!(
        stderr.contains("--item-map") && stderr.contains("--recbole-dataset"),
        "{stderr}"
    );
    // A model checkpoint given as the dataset is named for what it is.
    let wrong = recsys()
        .args(["convert", "--checkpoint"])
        .arg(&checkpoint)
        .arg("--recbole-dataset")
        .arg(&checkpoint)
        .arg("--output")
        .arg(tmp.path().join("wrong"))
        .output()
        .unwrap();
    assert!(!wrong.status.success());
    let stderr = String::from_utf8_lossy(&wrong.stderr);
    assert!(stderr.contains("zip archive"), "{stderr}");
}

#[test]
fn every_flag_of_every_command_has_help() {
    for command in [
        "convert",
        "predict",
        "eval",
        "publish",
        "approve",
        "reject",
        "versions",
        "sweep",
        "export-onnx",
        "export-items",
    ] {
        let out = recsys().args([command, "--help"]).output().unwrap();
        assert!(out.status.success());
        let help = String::from_utf8_lossy(&out.stdout).into_owned();
        // The Options section only: the text after it may quote flags in prose.
        let lines: Vec<&str> = help
            .lines()
            .skip_while(|l| *l != "Options:")
            .skip(1)
            .take_while(|l| l.is_empty() || l.starts_with(' '))
            .collect();
        let mut flags = 0;
        for (i, line) in lines.iter().enumerate() {
            // Flag lines are indented less than help lines (which may start with a flag name).
            let trimmed = line.trim_start();
            let indent = line.len() - trimmed.len();
            if indent >= 10 || !trimmed.starts_with('-') {
                continue;
            }
            flags += 1;
            // clap puts the help after two spaces on the flag's line, or on the next line indented.
            let after_spec = trimmed
                .split_once("  ")
                .map(|(_, rest)| rest.trim())
                .unwrap_or("");
            let next_is_help = lines
                .get(i + 1)
                .is_some_and(|n| n.starts_with("          ") && !n.trim().is_empty());
            assert!(
                !after_spec.is_empty() || next_is_help,
                "recsys {command}: {trimmed} has no help text"
            );
        }
        assert!(flags > 1, "recsys {command} --help lists no flags:\n{help}");
    }
}

/// Reads a `.npy` file that `recsys export-items` wrote: (shape, values).
fn read_npy(path: &Path) -> ((usize, usize), Vec<f32>) {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(&bytes[..8], b"\x93NUMPY\x01\x00");
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + header_len]).unwrap();
    assert!(header.contains("'descr': '<f4'") && header.contains("'fortran_order': False"));
    let dims: Vec<usize> = header
        .split("'shape': (")
        .nth(1)
        .unwrap()
        .split(')')
        .next()
        .unwrap()
        .split(',')
        .map(|v| v.trim().parse().unwrap())
        .collect();
    let values: Vec<f32> = bytes[10 + header_len..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(values.len(), dims[0] * dims[1]);
    ((dims[0], dims[1]), values)
}

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

#[test]
fn predict_returns_the_user_embedding_that_scores_the_exported_items() {
    let tmp = tempfile::tempdir().unwrap();
    let engine_dir = tmp.path().join("engine");
    convert("bert4rec", "bert4rec", "model.safetensors", &engine_dir);
    let items = tmp.path().join("items");
    let status = recsys()
        .args(["export-items", "--engine"])
        .arg(&engine_dir)
        .arg("--output")
        .arg(&items)
        .status()
        .unwrap();
    assert!(status.success());
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
    let out = recsys()
        .args(["predict", "--k", "20", "--output", "-", "--engine"])
        .arg(&engine_dir)
        .arg("--input")
        .arg(&input)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "the third line is refused");
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
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
    let out = recsys()
        .args(["predict", "--return-embedding", "--output", "-", "--engine"])
        .arg(&engine_dir)
        .arg("--input")
        .arg(&input)
        .output()
        .unwrap();
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
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
        let out = recsys()
            .args(["predict", "--output", "-", "--engine"])
            .arg(&engine_dir)
            .arg("--input")
            .arg(input)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
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
                        .output()
                        .unwrap();
                assert!(
                    done.status.success(),
                    "{}",
                    String::from_utf8_lossy(&done.stderr)
                );
                let summary: serde_json::Value = serde_json::from_slice(&done.stdout).unwrap();
                assert_eq!(summary["screen"], screen);
                let out = tmp
                    .path()
                    .join(format!("{kind}-{precision}-{screen}.jsonl"));
                let status = recsys()
                    .args(["predict", "--engine"])
                    .arg(&engine)
                    .arg("--input")
                    .arg(&input_path)
                    .arg("--output")
                    .arg(&out)
                    .stderr(Stdio::null())
                    .status()
                    .unwrap();
                assert!(status.success());
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
    .output()
    .unwrap();
    assert!(!done.status.success());
    assert!(String::from_utf8_lossy(&done.stderr).contains("fp32 and fp16"));
}

#[test]
fn versions_names_a_config_that_lags_the_records_and_the_command_that_finishes_the_switch() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = tmp.path().join("repo");
    let engine = tmp.path().join("engine");
    convert("multivae", "vaecf", "model.safetensors", &engine);
    let run = |args: &[&str]| {
        recsys()
            .args(args)
            .arg("--repository")
            .arg(&repo)
            .args(["--model", "vaecf"])
            .output()
            .unwrap()
    };
    let engine_arg = engine.to_str().unwrap();
    assert!(run(&["publish", "--approve", "--engine", engine_arg])
        .status
        .success());
    assert!(run(&["publish", "--approve", "--engine", engine_arg])
        .status
        .success());
    // What approve leaves when killed between its record write and its config write.
    let config = repo.join("vaecf/config.pbtxt");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("versions: [ 2 ]", "versions: [ 1 ]")).unwrap();
    let out = run(&["versions"]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(stdout.lines().nth(1).unwrap().contains("yes"), "{stdout}");
    assert!(
        stderr.contains("names version(s) [1] but the newest approved version is 2"),
        "{stderr}"
    );
    let fix = stderr
        .lines()
        .find_map(|l| l.split('`').nth(1))
        .expect("a command in backquotes");
    assert!(
        fix.starts_with("recsys approve ") && fix.contains("--version 2"),
        "{fix}"
    );
    let fixed = Command::new("bash")
        .arg("-c")
        .arg(fix.replacen("recsys", env!("CARGO_BIN_EXE_recsys"), 1))
        .output()
        .unwrap();
    assert!(fixed.status.success());
    assert!(std::fs::read_to_string(&config)
        .unwrap()
        .contains("versions: [ 2 ]"));
    assert!(run(&["versions"]).stderr.is_empty());
}

#[test]
fn json_failures_are_one_json_object_and_recboles_model_name_is_a_kind() {
    let tmp = tempfile::tempdir().unwrap();
    // A failure with --json: stdout is one object naming the error and the exit status.
    let out = recsys()
        .args(["versions", "--json", "--model", "m", "--repository"])
        .arg(tmp.path().join("repo"))
        .args(["--prune"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let failure: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "no JSON on stdout ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    assert_eq!(failure["exit_code"], 2);
    assert!(
        failure["error"].as_str().unwrap().contains("--keep"),
        "{failure}"
    );
    let out = recsys()
        .args([
            "approve",
            "--json",
            "--model",
            "m",
            "--version",
            "3",
            "--repository",
        ])
        .arg(tmp.path().join("repo"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let failure: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(failure["exit_code"], 1);
    assert!(
        failure["error"].as_str().unwrap().contains("no version 3"),
        "{failure}"
    );
    // RecBole calls the model MultiVAE: `--kind multivae` and `mult-vae` are VAE-CF.
    for kind in ["multivae", "mult-vae"] {
        let engine = tmp.path().join(kind);
        convert("multivae", kind, "model.safetensors", &engine);
        assert!(engine.join("manifest.json").is_file(), "{kind}");
    }
}
