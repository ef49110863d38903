//! Every relative link of the README, the user guide (docs/guide/src), the docs in docs/ and the
//! benchmark logs (docs/benchmarks) leads to a file of the repository, and every guide page is in
//! the guide's table of contents: pages moved or renamed fail here, not on a reader.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn markdown_files() -> Vec<PathBuf> {
    let root = root();
    let mut files = vec![root.join("README.md")];
    for dir in ["docs", "docs/benchmarks", "docs/guide/src"] {
        for entry in std::fs::read_dir(root.join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "md") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The targets of `[text](target)` links outside code blocks and code spans.
fn link_targets(text: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Code spans hold commands and paths, not links.
        let prose: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = prose.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            targets.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    targets
}

#[test]
fn every_relative_link_leads_to_a_file() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        for target in link_targets(&text) {
            if target.contains("://") || target.starts_with('#') || target.starts_with("mailto:") {
                continue;
            }
            let path = target.split('#').next().unwrap();
            checked += 1;
            if !file.parent().unwrap().join(path).exists() {
                broken.push(format!("{}: {target}", file.display()));
            }
        }
    }
    assert!(
        checked > 20,
        "only {checked} links found: the reader is broken"
    );
    assert!(broken.is_empty(), "links to nothing: {broken:#?}");
}

#[test]
fn every_guide_page_is_in_the_table_of_contents() {
    let src = root().join("docs/guide/src");
    let summary = std::fs::read_to_string(src.join("SUMMARY.md")).unwrap();
    let listed = link_targets(&summary);
    for entry in std::fs::read_dir(&src).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if name.ends_with(".md") && name != "SUMMARY.md" {
            assert!(listed.contains(&name), "{name} is not in SUMMARY.md");
        }
    }
}
