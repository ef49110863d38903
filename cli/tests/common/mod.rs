//! How the command-line tests run `recsys`: the binary, a finished run's outcome with the
//! assertions every test makes of it, and the fixture conversions most tests start from.
#![allow(dead_code)] // each test binary uses its own part

use std::ffi::OsStr;
use std::path::Path;
use std::process::Command;

pub use recsys_engine::fixtures::dir as fixtures;

/// The `recsys` binary with `args`.
pub fn recsys<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut command = Command::new(env!("CARGO_BIN_EXE_recsys"));
    command.args(args);
    // Screen plans of the tests' engines stay out of the user's cache.
    command.env(
        "RECSYS_PLAN_DIR",
        std::env::temp_dir().join("recsys-cli-test-plans"),
    );
    command
}

/// How a finished run ended and what it printed.
#[derive(Debug)]
pub struct Outcome {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    /// The command line, for failure messages.
    pub command: String,
}

/// Runs a command to its end, capturing what it prints.
pub trait Run {
    fn run(&mut self) -> Outcome;
}

impl Run for Command {
    fn run(&mut self) -> Outcome {
        let command = format!("{:?}", self);
        let out = self
            .output()
            .unwrap_or_else(|e| panic!("cannot run {command}: {e}"));
        Outcome {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            command,
        }
    }
}

impl From<std::process::Output> for Outcome {
    /// A run driven by hand (a child fed through its standard input).
    fn from(out: std::process::Output) -> Outcome {
        Outcome {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            command: "recsys (fed through its standard input)".into(),
        }
    }
}

impl Outcome {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }

    /// Asserts the run exited 0 (else panics with its stderr).
    #[track_caller]
    pub fn ok(self) -> Outcome {
        assert!(
            self.success(),
            "{} exited {:?}: {}",
            self.command,
            self.code,
            self.stderr
        );
        self
    }

    /// Asserts the run exited `code` with `needle` in its stderr.
    #[track_caller]
    pub fn fails(self, code: i32, needle: &str) -> Outcome {
        assert_eq!(
            self.code,
            Some(code),
            "{}: stderr {}",
            self.command,
            self.stderr
        );
        assert!(
            self.stderr.contains(needle),
            "{}: {needle:?} not in stderr: {}",
            self.command,
            self.stderr
        );
        self
    }

    /// Standard output as one JSON document.
    #[track_caller]
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("{} printed no JSON ({e}): {}", self.command, self.stdout))
    }
}

/// `recsys convert` of a fixture checkpoint with the fixture's config and the given item map.
pub fn convert_command(
    model_dir: &str,
    kind: &str,
    checkpoint: &str,
    item_map: &Path,
    out: &Path,
) -> Command {
    let dir = fixtures().join(model_dir);
    let mut cmd = recsys(["convert", "--kind", kind, "--checkpoint"]);
    cmd.arg(dir.join(checkpoint))
        .arg("--config")
        .arg(dir.join("config.json"))
        .arg("--item-map")
        .arg(item_map)
        .arg("--output")
        .arg(out);
    cmd
}

/// A fixture checkpoint converted with its own item map, asserted to succeed.
pub fn convert(model_dir: &str, kind: &str, checkpoint: &str, out: &Path) {
    let item_map = fixtures().join(model_dir).join("item_id_map.tsv");
    convert_command(model_dir, kind, checkpoint, &item_map, out)
        .run()
        .ok();
}

/// The JSON a successful run printed.
#[track_caller]
pub fn json_of<S: AsRef<OsStr>>(args: &[S]) -> serde_json::Value {
    recsys(args).run().ok().json()
}

/// Reads a `.npy` file that `recsys export-items` wrote: (shape, values).
pub fn read_npy(path: &Path) -> ((usize, usize), Vec<f32>) {
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
