//! Every `recsys <command> --flag` the README and the user guide (docs/guide/src) show exists on
//! that command: each command line of them (code blocks and inline code, `\` continuations joined)
//! is read for the flags given
//! to a recsys subcommand, and each one must appear in that subcommand's `--help` (as a flag or one
//! of its aliases). A README that promises a flag the command lacks fails here, not on a user.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

/// The CLI's subcommands, as `recsys --help` lists them (checked below).
const SUBCOMMANDS: &[&str] = &[
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
];

/// README.md followed by every page of the user guide.
fn readme() -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut text =
        std::fs::read_to_string(root.join("README.md")).expect("README.md at the repository root");
    let mut pages: Vec<_> = std::fs::read_dir(root.join("docs/guide/src"))
        .expect("the user guide in docs/guide/src")
        .map(|e| e.expect("a guide page").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.sort();
    assert!(pages.len() > 5, "the guide's pages: {pages:?}");
    for page in pages {
        text.push('\n');
        text.push_str(&std::fs::read_to_string(&page).expect("a readable guide page"));
    }
    text
}

/// The README's lines with shell continuations (`\` at the end) joined.
fn logical_lines(text: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        if let Some(head) = line.trim_end().strip_suffix('\\') {
            current.push_str(head);
            current.push(' ');
        } else {
            current.push_str(line);
            lines.push(std::mem::take(&mut current));
        }
    }
    lines.push(current);
    lines
}

/// `--flag` of a token (`--flag=value`, `--flag`, with code-span or punctuation around it).
fn flag_of(token: &str) -> Option<String> {
    let token = token.trim_start_matches(['`', '(', '[', '"', '\'']);
    let rest = token.strip_prefix("--")?;
    let name: String = rest
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
        .collect();
    let name = name.trim_end_matches('-');
    (!name.is_empty()).then(|| format!("--{name}"))
}

/// Every flag the README gives each subcommand: the tokens after `recsys <command>` (or a path
/// ending in `/recsys`) up to the end of the command (a pipe, `;`, `&&`, the end of a code span or
/// of the line).
fn flags_in_readme() -> BTreeMap<String, BTreeSet<String>> {
    let mut found: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in logical_lines(&readme()) {
        let tokens: Vec<&str> = line.split_whitespace().collect();
        let mut i = 0;
        while i + 1 < tokens.len() {
            let program = tokens[i].trim_start_matches(['`', '(', '$']);
            let command = tokens[i + 1].trim_end_matches(['`', ',', '.', ':', ')']);
            let is_recsys = program == "recsys" || program.ends_with("/recsys");
            if !is_recsys || !SUBCOMMANDS.contains(&command) {
                i += 1;
                continue;
            }
            let flags = found.entry(command.to_string()).or_default();
            let mut j = i + 2;
            if tokens[i + 1].ends_with('`') {
                i = j;
                continue;
            }
            while j < tokens.len() {
                let token = tokens[j];
                if ["|", ";", "&&", "||", ">"].contains(&token) {
                    break;
                }
                let next_program = token.trim_start_matches(['`', '(', '$']);
                if next_program == "recsys" || next_program.ends_with("/recsys") {
                    break;
                }
                if let Some(flag) = flag_of(token) {
                    flags.insert(flag);
                }
                if token.ends_with('`') || token.ends_with("`,") || token.ends_with("`.") {
                    break;
                }
                j += 1;
            }
            i = j.max(i + 1);
        }
    }
    found
}

fn help_of(command: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_recsys"))
        .args([command, "--help"])
        .output()
        .expect("run recsys");
    assert!(out.status.success(), "recsys {command} --help failed");
    String::from_utf8(out.stdout).expect("UTF-8 help")
}

/// Whether `help` names `flag` exactly (`--out` is not `--output`).
fn names(help: &str, flag: &str) -> bool {
    help.match_indices(flag).any(|(at, _)| {
        let after = help[at + flag.len()..].chars().next();
        let before = help[..at].chars().next_back();
        !matches!(after, Some(c) if c.is_ascii_alphanumeric() || c == '-')
            && !matches!(before, Some(c) if c.is_ascii_alphanumeric() || c == '-')
    })
}

#[test]
fn the_subcommand_list_is_the_clis() {
    let out = Command::new(env!("CARGO_BIN_EXE_recsys"))
        .arg("--help")
        .output()
        .expect("run recsys");
    let help = String::from_utf8(out.stdout).expect("UTF-8 help");
    for command in SUBCOMMANDS {
        assert!(
            help.lines()
                .any(|l| l.trim_start().starts_with(&format!("{command} "))),
            "recsys --help does not list {command}"
        );
    }
}

#[test]
fn every_flag_the_readme_gives_a_command_exists_on_it() {
    let found = flags_in_readme();
    // The reader must see the README's main commands, or this test checks nothing.
    for command in ["convert", "predict", "publish", "export-items"] {
        assert!(
            found.get(command).is_some_and(|f| !f.is_empty()),
            "no flags of recsys {command} found in README.md and the guide: {found:?}"
        );
    }
    let mut missing = Vec::new();
    for (command, flags) in &found {
        let help = help_of(command);
        for flag in flags {
            if !names(&help, flag) {
                missing.push(format!("recsys {command} {flag}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "README.md or the guide shows flags these commands do not accept: {missing:?}"
    );
}

#[test]
fn the_reader_finds_flags_in_code_blocks_and_inline_code() {
    let text =
        "x `recsys eval --output m.json` y\nrecsys predict --engine e \\\n  --out r.jsonl | head\n";
    let lines = logical_lines(text);
    assert_eq!(lines.len(), 3);
    assert!(lines[1].contains("--engine e") && lines[1].contains("--out r.jsonl"));
    assert_eq!(flag_of("`--k=5`,").as_deref(), Some("--k"));
    assert_eq!(flag_of("engine"), None);
    assert!(names("[aliases: --out]", "--out") && !names("--output <FILE>", "--out"));
}
