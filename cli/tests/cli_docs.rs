//! `recsys completions` and `recsys man`: generated from the command-line definitions, so every
//! command is in them; the bash script is loaded by a real bash and registers the completion.

mod common;

use common::recsys;

/// The commands `recsys --help` lists (every one must be completed and have its page).
const COMMANDS: [&str; 14] = [
    "convert",
    "predict",
    "eval",
    "publish",
    "approve",
    "reject",
    "rollback",
    "versions",
    "sweep",
    "export-onnx",
    "export-items",
    "availability",
    "catalogue",
    "completions",
];

#[test]
fn completion_scripts_name_every_command_and_bash_loads_its_own() {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let out = recsys(["completions", shell]).output().unwrap();
        assert!(out.status.success(), "{shell}");
        let script = String::from_utf8(out.stdout).unwrap();
        for command in COMMANDS {
            assert!(script.contains(command), "{shell}: {command}");
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let script = tmp.path().join("recsys.bash");
    let out = recsys(["completions", "bash"]).output().unwrap();
    std::fs::write(&script, out.stdout).unwrap();
    let loaded = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!("source {} && complete -p recsys", script.display()))
        .output()
        .unwrap();
    assert!(loaded.status.success(), "{loaded:?}");
    let registered = String::from_utf8_lossy(&loaded.stdout);
    assert!(registered.contains("recsys"), "{registered}");

    let bad = recsys(["completions", "tcsh"]).output().unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("possible values"));
}

#[test]
fn manual_pages_cover_every_command_and_its_options() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("man");
    let run = recsys(["man", "--output", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(run.status.success(), "{run:?}");
    let top = std::fs::read_to_string(out.join("recsys.1")).unwrap();
    assert!(
        top.starts_with(".ie") || top.contains(".TH recsys 1"),
        "roff"
    );
    for command in COMMANDS {
        let page = std::fs::read_to_string(out.join(format!("recsys-{command}.1")))
            .unwrap_or_else(|e| panic!("recsys-{command}.1: {e}"));
        assert!(
            page.contains(&format!(".TH recsys-{command} 1")),
            "{command}"
        );
    }
    // A command's page lists its options (roff escapes the dashes).
    let convert = std::fs::read_to_string(out.join("recsys-convert.1")).unwrap();
    for option in ["checkpoint", "item\\-map", "precision", "calibration"] {
        assert!(convert.contains(&format!("\\-\\-{option}")), "{option}");
    }
}
