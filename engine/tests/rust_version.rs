//! The workspace's `rust-version` is the real minimum: no locked dependency needs a newer compiler
//! (Cargo.lock pins versions whose own `rust-version` can only rise), and the declared version is not
//! higher than what the dependencies and recsys's own code need. Reads `cargo metadata --locked`.

use std::process::Command;

/// What recsys's own code needs, independent of its dependencies: `u32::is_multiple_of` and
/// `usize::is_multiple_of` (stable in Rust 1.87).
const OWN_MINIMUM: (u64, u64) = (1, 87);

fn version(text: &str) -> (u64, u64) {
    let mut parts = text
        .split('.')
        .map(|p| p.parse::<u64>().expect("a numeric rust-version"));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

#[test]
fn rust_version_is_the_real_minimum_of_the_locked_dependencies() {
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml");
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--locked",
            "--manifest-path",
            manifest,
        ])
        .output()
        .expect("runs cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let members: Vec<&str> = metadata["workspace_members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap())
        .collect();
    let resolved: Vec<&str> = metadata["resolve"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["id"].as_str().unwrap())
        .collect();
    let mut declared = None;
    let mut needed = (OWN_MINIMUM, "recsys's own code".to_string());
    for package in metadata["packages"].as_array().unwrap() {
        let id = package["id"].as_str().unwrap();
        let Some(rust_version) = package["rust_version"].as_str() else {
            continue;
        };
        if members.contains(&id) {
            let v = version(rust_version);
            assert!(
                declared.is_none() || declared == Some(v),
                "{}: rust-version {rust_version} differs from the workspace's",
                package["name"]
            );
            declared = Some(v);
        } else if resolved.contains(&id) && version(rust_version) > needed.0 {
            needed = (
                version(rust_version),
                format!(
                    "{} {}",
                    package["name"].as_str().unwrap(),
                    package["version"].as_str().unwrap()
                ),
            );
        }
    }
    let declared = declared.expect("the workspace declares rust-version");
    let ((major, minor), by) = needed;
    assert_eq!(
        declared,
        (major, minor),
        "the workspace's rust-version is {}.{}, but the real minimum is {major}.{minor} (set by {by}): \
         set [workspace.package] rust-version = \"{major}.{minor}\" and the README's Requirements",
        declared.0,
        declared.1
    );
}
