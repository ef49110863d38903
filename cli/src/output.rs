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

/// Writes one line of the report to stdout; a write error (the reader left) drops this line and
/// every later one.
pub fn line(text: std::fmt::Arguments<'_>) {
    if STDOUT_CLOSED.load(Ordering::Relaxed) {
        return;
    }
    let mut out = std::io::stdout().lock();
    if writeln!(out, "{text}").and_then(|()| out.flush()).is_err() {
        STDOUT_CLOSED.store(true, Ordering::Relaxed);
    }
}

/// Writes one line to stderr (a note, a warning, the error the command ends with); a write error
/// drops this line and every later one, as for stdout.
pub fn note(text: std::fmt::Arguments<'_>) {
    if STDERR_CLOSED.load(Ordering::Relaxed) {
        return;
    }
    let mut err = std::io::stderr().lock();
    if writeln!(err, "{text}").and_then(|()| err.flush()).is_err() {
        STDERR_CLOSED.store(true, Ordering::Relaxed);
    }
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
