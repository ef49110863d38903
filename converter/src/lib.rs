//! The parts of the `recsys` command line that other code (the fuzz targets) reuses.

pub mod jsonl;
