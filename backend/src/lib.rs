//! The Triton backend; see docs/ARCHITECTURE.md.
