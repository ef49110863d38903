//! Model versions through the command line: publish, approve, reject, `--json` output, concurrent
//! publishes and a switch left half-done.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};

use common::{convert, fixtures, json_of, recsys, Run};

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
        let out = recsys(args)
            .arg("--repository")
            .arg(&repo)
            .args(["--model", "bert4rec"])
            .run();
        (out.code, out.stdout.clone(), out.stderr.clone())
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
    let out = recsys(["publish", "--model", "vaecf", "--repository"])
        .arg(&repo)
        .arg("--engine")
        .arg(&engine)
        .run()
        .ok();
    let stdout = out.stdout.as_str();
    let command = stdout
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("recsys approve "))
        .unwrap_or_else(|| panic!("no approve command in {stdout}"));
    let pasted = Command::new("bash")
        .arg("-c")
        .arg(command.replacen("recsys", env!("CARGO_BIN_EXE_recsys"), 1) + " --json")
        .run();
    assert!(pasted.success(), "{command}: {}", pasted.stderr.as_str());
    let approved: serde_json::Value = serde_json::from_str(&pasted.stdout).unwrap();
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
            recsys(["publish", "--approve", "--model", "m", "--repository"])
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
fn versions_names_a_config_that_lags_the_records_and_the_command_that_finishes_the_switch() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = tmp.path().join("repo");
    let engine = tmp.path().join("engine");
    convert("multivae", "vaecf", "model.safetensors", &engine);
    let run = |args: &[&str]| {
        recsys(args)
            .arg("--repository")
            .arg(&repo)
            .args(["--model", "vaecf"])
            .run()
    };
    let engine_arg = engine.to_str().unwrap();
    assert!(run(&["publish", "--approve", "--engine", engine_arg]).success());
    assert!(run(&["publish", "--approve", "--engine", engine_arg]).success());
    // What approve leaves when killed between its record write and its config write.
    let config = repo.join("vaecf/config.pbtxt");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("versions: [ 2 ]", "versions: [ 1 ]")).unwrap();
    let out = run(&["versions"]);
    let (stdout, stderr) = (out.stdout.as_str(), out.stderr.as_str());
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
    Command::new("bash")
        .arg("-c")
        .arg(fix.replacen("recsys", env!("CARGO_BIN_EXE_recsys"), 1))
        .run()
        .ok();
    assert!(std::fs::read_to_string(&config)
        .unwrap()
        .contains("versions: [ 2 ]"));
    assert!(run(&["versions"]).stderr.is_empty());
}

#[test]
fn a_release_command_whose_stdout_is_closed_finishes_and_gives_its_lease_back() {
    // `recsys approve ... | head -n0`: the reader is gone before the first line. The command must
    // not die half-way (a panic in the printer) nor hang holding the lease: it carries on, does
    // what it was asked, exits as it would have and releases the lease.
    let tmp = tempfile::tempdir().unwrap();
    let repo = tmp.path().join("repo");
    let engine = tmp.path().join("engine");
    convert("bert4rec", "bert4rec", "model.pt", &engine);
    let base = |command: &mut Command| {
        command
            .arg("--repository")
            .arg(&repo)
            .args(["--model", "bert4rec"]);
    };
    let mut publish = recsys(["publish", "--approve", "--engine"]);
    publish.arg(&engine);
    base(&mut publish);
    publish.run().ok();
    let mut publish = recsys(["publish", "--engine"]);
    publish.arg(&engine);
    base(&mut publish);
    publish.run().ok();

    for command in [&["approve", "--version", "2"][..], &["rollback"][..]] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let mut child = recsys(command);
        base(&mut child);
        let mut child = child
            .stdout(Stdio::from(writer))
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let started = std::time::Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if started.elapsed() > std::time::Duration::from_secs(120) {
                child.kill().unwrap();
                panic!("`recsys {}` with its stdout closed hung", command.join(" "));
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        };
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
        assert_eq!(status.code(), Some(0), "{command:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(
            !repo.join("bert4rec/recsys-lease.json").exists(),
            "{command:?} left its lease behind"
        );
    }
    let config = std::fs::read_to_string(repo.join("bert4rec/config.pbtxt")).unwrap();
    assert!(config.contains("versions: [ 1 ]"), "{config}");
}

#[test]
fn a_max_ndcg_drop_outside_zero_to_one_is_a_usage_error_naming_why() {
    for (value, says) in [
        ("5", "did you mean 0.05?"),
        ("nan", "not a number"),
        ("-0.1", "refuse every candidate"),
        ("1", "let every candidate through"),
        ("five", "is not a number"),
    ] {
        recsys([
            "approve",
            "--repository",
            "/nonexistent",
            "--model",
            "m",
            "--version",
            "1",
            "--max-ndcg-drop",
            value,
        ])
        .run()
        .fails(2, says);
    }
}
