//! Raw declarations of the TRITONBACKEND/TRITONSERVER C API; filled in with the backend.
