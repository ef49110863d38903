//! The command's report on stdout and its notes on stderr, written so that a reader going away
//! never stops the command.
//!
//! `println!` panics when stdout is a closed pipe (`recsys approve ... | head -n1`). In a release
//! command that panic would land in the middle of a rollout, between two writes to the fleet; the
//! report is for the operator, the release is what must finish. So each line is written with its
//! error kept here: once stdout is gone the command carries on silently to its end (and its exit
//! status), and nothing more is written.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);
static STDERR_CLOSED: AtomicBool = AtomicBool::new(false);

/// Writes one line to `stream` unless it was found closed; a write error marks it closed, so this
/// line and every later one are dropped.
fn write_line(mut stream: impl Write, closed: &AtomicBool, text: std::fmt::Arguments<'_>) {
    if closed.load(Ordering::Relaxed) {
        return;
    }
    if writeln!(stream, "{text}")
        .and_then(|()| stream.flush())
        .is_err()
    {
        closed.store(true, Ordering::Relaxed);
    }
}

/// Writes one line of the report to stdout (see [`write_line`]).
pub fn line(text: std::fmt::Arguments<'_>) {
    write_line(std::io::stdout().lock(), &STDOUT_CLOSED, text);
}

/// Writes one line to stderr (a note, a warning, the error the command ends with), as for stdout.
pub fn note(text: std::fmt::Arguments<'_>) {
    write_line(std::io::stderr().lock(), &STDERR_CLOSED, text);
}

/// `eprintln!` for the command's notes and errors: never panics on a closed stderr.
macro_rules! tell {
    ($($arg:tt)*) => {
        $crate::output::note(format_args!($($arg)*))
    };
}
pub(crate) use tell;

/// `println!` for the command's report: never panics on a closed stdout (see [`line`]).
macro_rules! say {
    () => {
        $crate::output::line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::output::line(format_args!($($arg)*))
    };
}
pub(crate) use say;
