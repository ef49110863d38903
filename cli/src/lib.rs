//! The parts of the `recsys` command line that other code (the fuzz targets) reuses.
#![forbid(unsafe_code)]

pub mod jsonl;
