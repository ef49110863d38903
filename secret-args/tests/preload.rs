//! The library as the images load it: preloaded into every process, resolving the arguments of
//! `tritonserver` only. A program named `tritonserver` here is a copy of `echo`, so what it prints
//! is the arguments its `main` received.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The cdylib cargo built for this test: beside it in target/<profile>/deps (a test run), or
/// in target/<profile> (a build of the library).
fn library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let candidates = [
        deps.join("librecsys_secret_args.so"),
        deps.parent().unwrap().join("librecsys_secret_args.so"),
    ];
    candidates
        .iter()
        .find(|lib| lib.exists())
        .unwrap_or_else(|| panic!("librecsys_secret_args.so was not built: {candidates:?}"))
        .clone()
}

fn echo_as(dir: &Path, name: &str) -> PathBuf {
    let program = dir.join(name);
    std::fs::copy("/bin/echo", &program).unwrap();
    program
}

fn run(program: &Path, args: &[&str]) -> std::process::Output {
    Command::new(program)
        .args(args)
        .env("LD_PRELOAD", library())
        .env("RECSYS_TEST_KEY", "s3cret")
        .output()
        .unwrap()
}

#[test]
fn tritonserver_gets_the_secret_and_every_other_program_its_arguments_as_given() {
    let dir = tempfile::tempdir().unwrap();
    let flag = "--http-restricted-api=model-repository:recsys-admin-key=@env:RECSYS_TEST_KEY";
    let server = run(&echo_as(dir.path(), "tritonserver"), &[flag]);
    assert!(server.status.success());
    assert_eq!(
        String::from_utf8_lossy(&server.stdout).trim(),
        "--http-restricted-api=model-repository:recsys-admin-key=s3cret"
    );
    let other = run(&echo_as(dir.path(), "healthcheck"), &[flag]);
    assert!(other.status.success());
    assert_eq!(String::from_utf8_lossy(&other.stdout).trim(), flag);
    // An unresolvable reference stops tritonserver before main, naming it; others are untouched.
    let missing = "key=@env:RECSYS_UNSET_KEY";
    let refused = run(&echo_as(dir.path(), "tritonserver"), &[missing]);
    assert_eq!(refused.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("RECSYS_UNSET_KEY"));
    let untouched = run(&echo_as(dir.path(), "bash-like"), &[missing]);
    assert_eq!(String::from_utf8_lossy(&untouched.stdout).trim(), missing);
}
