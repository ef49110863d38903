//! Numeric building blocks. `cpu` holds the portable kernels every path can run; faster versions
//! chosen at run time will sit beside them behind the same signatures.

pub mod cpu;
