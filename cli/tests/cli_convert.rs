//! `recsys convert` end to end: refusals with their exit statuses and messages, string catalogues,
//! W8A8 with calibration, RecBole checkpoints and saved datasets, and what every command's flags
//! and `--json` failures look like.

mod common;

use std::process::Stdio;

use common::{convert, convert_command, fixtures, recsys, Run};

#[test]
fn convert_refuses_to_overwrite_and_explains_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tmp.path().join("engine");
    convert("bert4rec", "bert4rec", "model.pt", &engine);
    let item_map = fixtures().join("bert4rec/item_id_map.tsv");
    convert_command("bert4rec", "bert4rec", "model.pt", &item_map, &engine)
        .run()
        .fails(2, "--force");

    // The wrong kind for the checkpoint names the tensor it could not find.
    convert_command("bert4rec", "vaecf", "model.pt", &item_map, &engine)
        .arg("--force")
        .run()
        .fails(1, "tensor 'encoder.0.weight' is missing");
    // The failed conversion left the previous engine in place.
    assert!(engine.join("manifest.json").exists());

    let help = recsys(["predict", "--help"]).run();
    assert!(help.stdout.as_str().contains("Exit status"));

    // A RecBole checkpoint needs neither --kind nor --config: its own config names both.
    let dir = fixtures().join("bert4rec");
    let recbole = tmp.path().join("recbole");
    let out = recsys(["convert", "--checkpoint"])
        .arg(dir.join("recbole_checkpoint.pth"))
        .arg("--item-map")
        .arg(&item_map)
        .arg("--out")
        .arg(&recbole)
        .run()
        .ok();
    assert!(out.stdout.as_str().contains("wrote bert4rec engine"));
    // A state dict without --kind: exit 1 with what to pass.
    let out = recsys(["convert", "--checkpoint"])
        .arg(dir.join("model.pt"))
        .args(["--config"])
        .arg(dir.join("config.json"))
        .arg("--item-map")
        .arg(&item_map)
        .arg("--out")
        .arg(tmp.path().join("plain"))
        .run();
    assert_eq!(out.code, Some(1));
    assert!(out
        .stderr
        .as_str()
        .contains("pass --kind bert4rec, vaecf, sasrec, gru4rec or hstu"));
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
    convert_command(
        "bert4rec",
        "bert4rec",
        "model.safetensors",
        &tmp.path().join("map.tsv"),
        &tmp.path().join("strings"),
    )
    .run()
    .ok();
    convert(
        "bert4rec",
        "bert4rec",
        "model.safetensors",
        &tmp.path().join("ints"),
    );

    let run = |engine: &str, input: &str| -> serde_json::Value {
        let path = tmp.path().join(format!("{engine}.jsonl"));
        std::fs::write(&path, input).unwrap();
        let out = recsys(["predict", "--k", "5", "--output", "-", "--input"])
            .arg(&path)
            .arg("--engine")
            .arg(tmp.path().join(engine))
            .run()
            .ok();
        serde_json::from_str(&out.stdout).unwrap()
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
    .run()
    .ok();
    let stdout = out.stdout.as_str();
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
    let out = recsys([
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
    .map(common::Outcome::from)
    .unwrap();
    assert!(out.success());
    let line: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(line["item_ids"].as_array().unwrap().len(), 3);

    // w8a8 without calibration, and calibration without w8a8, are refused with the reason.
    convert_command(
        "multivae",
        "vaecf",
        "model.safetensors",
        &item_map,
        &tmp.path().join("x"),
    )
    .args(["--precision", "int8", "--int8-mode", "w8a8"])
    .run()
    .fails(2, "needs --calibration");
    convert_command(
        "multivae",
        "vaecf",
        "model.safetensors",
        &item_map,
        &tmp.path().join("y"),
    )
    .args(["--precision", "fp16", "--calibration"])
    .arg(&calib)
    .run()
    .fails(2, "--calibration applies to");
    let out = convert_command(
        "multivae",
        "vaecf",
        "model.safetensors",
        &item_map,
        &tmp.path().join("z"),
    )
    .args(["--precision", "int8", "--int8-mode", "w8a8-all"])
    .run();
    assert_eq!(out.code, Some(2));
    assert!(out
        .stderr
        .as_str()
        .contains("--int8-mode w8a8-all needs --calibration"));

    // w8a8-all: every dense layer's scale applied, and the export prints its strongly typed
    // TensorRT build.
    let all = tmp.path().join("all");
    convert_command("multivae", "vaecf", "model.safetensors", &item_map, &all)
        .args([
            "--precision",
            "int8",
            "--int8-mode",
            "w8a8-all",
            "--calibration",
        ])
        .arg(&calib)
        .run()
        .ok();
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(all.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["quantization"]["dense_activations"], "static");
    let out = recsys(["export-onnx", "--engine"])
        .arg(&all)
        .arg("--output")
        .arg(tmp.path().join("all.onnx"))
        .run();
    let text = out.stdout.as_str();
    assert!(out.success(), "{}", out.stderr.as_str());
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
fn a_recbole_checkpoint_and_its_saved_dataset_convert_with_no_hand_made_file() {
    let tmp = tempfile::tempdir().unwrap();
    let checkpoint = fixtures().join("sasrec/recbole_checkpoint.pth");
    let saved = fixtures().join("recbole_dataset/recsys-demo-Dataset.pth");
    let engine = tmp.path().join("engine");
    recsys(["convert", "--checkpoint"])
        .arg(&checkpoint)
        .arg("--recbole-dataset")
        .arg(&saved)
        .arg("--output")
        .arg(&engine)
        .run()
        .ok();
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
    let both = recsys(["convert", "--checkpoint"])
        .arg(&checkpoint)
        .arg("--recbole-dataset")
        .arg(&saved)
        .arg("--item-map")
        .arg(fixtures().join("sasrec/item_id_map.tsv"))
        .arg("--output")
        .arg(tmp.path().join("both"))
        .run();
    assert_eq!(both.code, Some(2));
    let stderr = both.stderr.as_str();
    assert!(
        stderr.contains("--item-map") && stderr.contains("--recbole-dataset"),
        "{stderr}"
    );
    let neither = recsys(["convert", "--checkpoint"])
        .arg(&checkpoint)
        .arg("--output")
        .arg(tmp.path().join("neither"))
        .run();
    assert_eq!(neither.code, Some(2));
    let stderr = neither.stderr.as_str();
    assert!(
        stderr.contains("--item-map") && stderr.contains("--recbole-dataset"),
        "{stderr}"
    );
    // A model checkpoint given as the dataset is named for what it is.
    let wrong = recsys(["convert", "--checkpoint"])
        .arg(&checkpoint)
        .arg("--recbole-dataset")
        .arg(&checkpoint)
        .arg("--output")
        .arg(tmp.path().join("wrong"))
        .run();
    assert!(!wrong.success());
    let stderr = wrong.stderr.as_str();
    assert!(stderr.contains("zip archive"), "{stderr}");
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
        let out = recsys(&args).current_dir(tmp.path()).run();
        assert_eq!(out.code, Some(2), "{args:?}: {}", out.stderr.as_str());
    }
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
        let out = recsys([command, "--help"]).run().ok();
        let help = out.stdout.clone();
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

#[test]
fn json_failures_are_one_json_object_and_recboles_model_name_is_a_kind() {
    let tmp = tempfile::tempdir().unwrap();
    // A failure with --json: stdout is one object naming the error and the exit status.
    let out = recsys(["versions", "--json", "--model", "m", "--repository"])
        .arg(tmp.path().join("repo"))
        .args(["--prune"])
        .run();
    assert_eq!(out.code, Some(2));
    let failure: serde_json::Value = serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("no JSON on stdout ({e}): {}", out.stdout.as_str()));
    assert_eq!(failure["exit_code"], 2);
    assert!(
        failure["error"].as_str().unwrap().contains("--keep"),
        "{failure}"
    );
    let out = recsys([
        "approve",
        "--json",
        "--model",
        "m",
        "--version",
        "3",
        "--repository",
    ])
    .arg(tmp.path().join("repo"))
    .run();
    assert_eq!(out.code, Some(1));
    let failure: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
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
