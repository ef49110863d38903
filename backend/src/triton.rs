//! Safe wrappers over the Triton C API: errors, logging, requests (released exactly once), responses
//! (sent exactly once), model configuration messages. Every C call goes through [`ffi_call!`], so the
//! FFI surface can be found with one grep.

use std::ffi::{c_void, CStr, CString};
use std::os::raw::c_char;
use std::ptr;

use recsys_ffi as sys;

use crate::decode::{DType, InputTensor};
use crate::error::{BackendError, ErrorCode, Result};

/// Calls a Triton API function. The plain form is for the functions that report failure with a
/// returned `TRITONSERVER_Error*`, which it turns into a [`BackendError`]; `ffi_call!(value F(..))`
/// returns what the function returns, for the few that report no error (the error API itself,
/// parameter objects). Each use sits in an `unsafe` context whose `// SAFETY:` comment covers the
/// arguments.
macro_rules! ffi_call {
    (value $function:ident ( $($arg:expr),* $(,)? )) => {
        recsys_ffi::$function($($arg),*)
    };
    ($function:ident ( $($arg:expr),* $(,)? )) => {
        $crate::triton::check(stringify!($function), recsys_ffi::$function($($arg),*))
    };
}
pub(crate) use ffi_call;

fn code_to_c(code: ErrorCode) -> sys::TRITONSERVER_Error_Code {
    match code {
        ErrorCode::Internal => sys::TRITONSERVER_ERROR_INTERNAL,
        ErrorCode::NotFound => sys::TRITONSERVER_ERROR_NOT_FOUND,
        ErrorCode::InvalidArg => sys::TRITONSERVER_ERROR_INVALID_ARG,
        ErrorCode::Unsupported => sys::TRITONSERVER_ERROR_UNSUPPORTED,
        ErrorCode::Unavailable => sys::TRITONSERVER_ERROR_UNAVAILABLE,
    }
}

fn code_from_c(code: sys::TRITONSERVER_Error_Code) -> ErrorCode {
    match code {
        sys::TRITONSERVER_ERROR_NOT_FOUND => ErrorCode::NotFound,
        sys::TRITONSERVER_ERROR_INVALID_ARG => ErrorCode::InvalidArg,
        sys::TRITONSERVER_ERROR_UNSUPPORTED => ErrorCode::Unsupported,
        sys::TRITONSERVER_ERROR_UNAVAILABLE => ErrorCode::Unavailable,
        _ => ErrorCode::Internal,
    }
}

/// A C string for Triton; interior NULs (only possible in messages echoing user input) become spaces.
pub(crate) fn c_string(text: &str) -> CString {
    CString::new(text.replace('\0', " ")).expect("NULs were replaced")
}

/// A new Triton error carrying `error`'s code and full message; ownership passes to the caller.
pub(crate) fn new_error(error: &BackendError) -> *mut sys::TRITONSERVER_Error {
    let message = c_string(&error.full_message());
    // SAFETY: `message` is a valid NUL-terminated string that Triton copies before returning.
    unsafe { ffi_call!(value TRITONSERVER_ErrorNew(code_to_c(error.code()), message.as_ptr())) }
}

/// Converts (and frees) an error returned by a Triton call.
pub(crate) fn check(call: &'static str, error: *mut sys::TRITONSERVER_Error) -> Result<()> {
    if error.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null error returned by a Triton call is owned by the caller; it is read and then
    // deleted exactly once here. The message pointer is valid until the delete.
    let (code, message) = unsafe {
        let code = ffi_call!(value TRITONSERVER_ErrorCode(error));
        let message = CStr::from_ptr(ffi_call!(value TRITONSERVER_ErrorMessage(error)))
            .to_string_lossy()
            .into_owned();
        ffi_call!(value TRITONSERVER_ErrorDelete(error));
        (code, message)
    };
    Err(BackendError::Triton {
        call,
        code: code_from_c(code),
        message,
    })
}

#[derive(Clone, Copy)]
pub(crate) enum LogLevel {
    Info,
    Warn,
    Error,
}

/// Writes to the server's log.
pub(crate) fn log(level: LogLevel, message: &str) {
    let level = match level {
        LogLevel::Info => sys::TRITONSERVER_LOG_INFO,
        LogLevel::Warn => sys::TRITONSERVER_LOG_WARN,
        LogLevel::Error => sys::TRITONSERVER_LOG_ERROR,
    };
    let text = c_string(message);
    let file = c_string(file!());
    // SAFETY: both strings are valid for the call; the returned error (if any) is freed by check.
    let _ = unsafe {
        ffi_call!(TRITONSERVER_LogMessage(
            level,
            file.as_ptr(),
            line!() as i32,
            text.as_ptr()
        ))
    };
}

/// Reads a string that Triton owns for the lifetime of the object it was queried from.
///
/// # Safety
/// `ptr` must be null or point to a NUL-terminated string valid for the duration of the call.
pub(crate) unsafe fn borrowed_str(ptr: *const c_char) -> String {
    if ptr.is_null() {
        return String::new();
    }
    // SAFETY: non-null, and NUL-terminated and valid for the call by the caller's contract.
    unsafe { CStr::from_ptr(ptr) }
        .to_string_lossy()
        .into_owned()
}

/// A request handed to the backend by Execute; released (RELEASE_ALL) exactly once, on drop.
pub(crate) struct Request {
    raw: *mut sys::TRITONBACKEND_Request,
}

impl Request {
    /// # Safety
    /// `raw` must be a request passed to Execute, not yet released, and not wrapped twice.
    pub(crate) unsafe fn from_raw(raw: *mut sys::TRITONBACKEND_Request) -> Request {
        Request { raw }
    }

    pub(crate) fn raw(&self) -> *mut sys::TRITONBACKEND_Request {
        self.raw
    }

    /// The names of the outputs the client asked for. Triton lists every output of the model when
    /// the client named none.
    pub(crate) fn requested_outputs(&self) -> Result<Vec<String>> {
        let mut count = 0u32;
        // SAFETY: `self.raw` is a live request (not yet released); `count` is a valid out-pointer.
        unsafe { ffi_call!(TRITONBACKEND_RequestOutputCount(self.raw, &mut count))? };
        let mut names = Vec::with_capacity(count as usize);
        for index in 0..count {
            let mut name = ptr::null();
            // SAFETY: index < count; `name` is a valid out-pointer to a string the request owns.
            unsafe { ffi_call!(TRITONBACKEND_RequestOutputName(self.raw, index, &mut name))? };
            // SAFETY: Triton keeps the name alive as long as the request.
            names.push(unsafe { borrowed_str(name) });
        }
        Ok(names)
    }

    /// Every input of the request, its buffers copied into one contiguous vector each.
    pub(crate) fn inputs(&self) -> Result<Vec<InputTensor>> {
        let mut count = 0u32;
        // SAFETY: `self.raw` is a live request (not yet released); `count` is a valid out-pointer.
        unsafe { ffi_call!(TRITONBACKEND_RequestInputCount(self.raw, &mut count))? };
        let mut inputs = Vec::with_capacity(count as usize);
        for index in 0..count {
            let mut input = ptr::null_mut();
            // SAFETY: index < count; `input` is a valid out-pointer; the input lives as long as the request.
            unsafe {
                ffi_call!(TRITONBACKEND_RequestInputByIndex(
                    self.raw, index, &mut input
                ))?
            };
            let (mut name, mut dtype, mut shape, mut dims) = (ptr::null(), 0, ptr::null(), 0u32);
            let (mut byte_size, mut buffers) = (0u64, 0u32);
            // SAFETY: `input` was just returned by Triton; all out-pointers are valid locals.
            unsafe {
                ffi_call!(TRITONBACKEND_InputProperties(
                    input,
                    &mut name,
                    &mut dtype,
                    &mut shape,
                    &mut dims,
                    &mut byte_size,
                    &mut buffers
                ))?
            };
            // SAFETY: Triton keeps the name and the shape array alive as long as the request.
            let name = unsafe { borrowed_str(name) };
            let shape = if dims == 0 || shape.is_null() {
                Vec::new()
            } else {
                // SAFETY: `shape` points to `dims` int64 values owned by the request.
                unsafe { std::slice::from_raw_parts(shape, dims as usize) }.to_vec()
            };
            let mut data = Vec::with_capacity(byte_size.min(1 << 30) as usize);
            for b in 0..buffers {
                let (mut base, mut size, mut memory, mut memory_id) =
                    (ptr::null(), 0u64, sys::TRITONSERVER_MEMORY_CPU, 0i64);
                // SAFETY: b < buffer_count; out-pointers are valid locals.
                unsafe {
                    ffi_call!(TRITONBACKEND_InputBuffer(
                        input,
                        b,
                        &mut base,
                        &mut size,
                        &mut memory,
                        &mut memory_id
                    ))?
                };
                if memory == sys::TRITONSERVER_MEMORY_GPU {
                    return Err(BackendError::InvalidInput(format!(
                        "{name} arrived in GPU memory; the CPU backend reads host memory only"
                    )));
                }
                if size > 0 && !base.is_null() {
                    // SAFETY: Triton guarantees `size` readable bytes at `base` (host memory, checked
                    // above) for as long as the request lives; the bytes may be unaligned, so they
                    // are read as u8 and copied.
                    data.extend_from_slice(unsafe {
                        std::slice::from_raw_parts(base as *const u8, size as usize)
                    });
                }
            }
            inputs.push(InputTensor {
                name,
                dtype: dtype_from_c(dtype),
                shape,
                data,
            });
        }
        Ok(inputs)
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // SAFETY: the request is live and this is the only release (the wrapper is not Clone).
        if let Err(e) = unsafe {
            ffi_call!(TRITONBACKEND_RequestRelease(
                self.raw,
                sys::TRITONSERVER_REQUEST_RELEASE_ALL
            ))
        } {
            log(
                LogLevel::Error,
                &format!("recsys: failed to release a request: {e}"),
            );
        }
    }
}

fn dtype_from_c(dtype: sys::TRITONSERVER_DataType) -> DType {
    match dtype {
        sys::TRITONSERVER_TYPE_INT64 => DType::Int64,
        sys::TRITONSERVER_TYPE_INT32 => DType::Int32,
        sys::TRITONSERVER_TYPE_BYTES => DType::Bytes,
        sys::TRITONSERVER_TYPE_BOOL => DType::Other("BOOL"),
        sys::TRITONSERVER_TYPE_UINT8 => DType::Other("UINT8"),
        sys::TRITONSERVER_TYPE_UINT16 => DType::Other("UINT16"),
        sys::TRITONSERVER_TYPE_UINT32 => DType::Other("UINT32"),
        sys::TRITONSERVER_TYPE_UINT64 => DType::Other("UINT64"),
        sys::TRITONSERVER_TYPE_INT8 => DType::Other("INT8"),
        sys::TRITONSERVER_TYPE_INT16 => DType::Other("INT16"),
        sys::TRITONSERVER_TYPE_FP16 => DType::Other("FP16"),
        sys::TRITONSERVER_TYPE_FP32 => DType::Other("FP32"),
        sys::TRITONSERVER_TYPE_FP64 => DType::Other("FP64"),
        sys::TRITONSERVER_TYPE_BF16 => DType::Other("BF16"),
        _ => DType::Other("INVALID"),
    }
}

/// A response for one request; sent exactly once. Dropping an unsent response sends an INTERNAL
/// error, so a client is never left without an answer.
pub(crate) struct Response {
    raw: *mut sys::TRITONBACKEND_Response,
}

pub(crate) enum OutputType {
    Int64,
    Fp32,
    Bytes,
}

impl Response {
    pub(crate) fn new(request: &Request) -> Result<Response> {
        let mut raw = ptr::null_mut();
        // SAFETY: the request is live; `raw` is a valid out-pointer.
        unsafe { ffi_call!(TRITONBACKEND_ResponseNew(&mut raw, request.raw()))? };
        Ok(Response { raw })
    }

    /// Adds an output tensor and copies `bytes` into the buffer Triton provides.
    pub(crate) fn add_output(
        &mut self,
        name: &str,
        dtype: OutputType,
        shape: &[i64],
        bytes: &[u8],
    ) -> Result<()> {
        let dtype = match dtype {
            OutputType::Int64 => sys::TRITONSERVER_TYPE_INT64,
            OutputType::Fp32 => sys::TRITONSERVER_TYPE_FP32,
            OutputType::Bytes => sys::TRITONSERVER_TYPE_BYTES,
        };
        let c_name = c_string(name);
        let mut output = ptr::null_mut();
        // SAFETY: the response is live; name and shape are valid for the call (Triton copies them).
        unsafe {
            ffi_call!(TRITONBACKEND_ResponseOutput(
                self.raw,
                &mut output,
                c_name.as_ptr(),
                dtype,
                shape.as_ptr(),
                shape.len() as u32
            ))?
        };
        let mut buffer: *mut c_void = ptr::null_mut();
        let (mut memory, mut memory_id) = (sys::TRITONSERVER_MEMORY_CPU, 0i64);
        // SAFETY: `output` was just created; we ask for host memory of exactly `bytes.len()` bytes.
        unsafe {
            ffi_call!(TRITONBACKEND_OutputBuffer(
                output,
                &mut buffer,
                bytes.len() as u64,
                &mut memory,
                &mut memory_id
            ))?
        };
        if bytes.is_empty() {
            return Ok(());
        }
        if memory == sys::TRITONSERVER_MEMORY_GPU || buffer.is_null() {
            return Err(BackendError::Internal(format!(
                "Triton gave output {name} a buffer the CPU cannot write (memory type {memory})"
            )));
        }
        // SAFETY: Triton allocated `bytes.len()` writable host bytes at `buffer`; they do not overlap
        // `bytes`, which we own.
        unsafe { ptr::copy_nonoverlapping(bytes.as_ptr(), buffer as *mut u8, bytes.len()) };
        Ok(())
    }

    pub(crate) fn set_int_parameter(&mut self, name: &str, value: i64) -> Result<()> {
        let c_name = c_string(name);
        // SAFETY: the response is live; the name is copied by Triton.
        unsafe {
            ffi_call!(TRITONBACKEND_ResponseSetIntParameter(
                self.raw,
                c_name.as_ptr(),
                value
            ))
        }
    }

    /// Sends the response, as a success or as `error`.
    pub(crate) fn send(mut self, error: Option<&BackendError>) {
        self.send_raw(error);
    }

    fn send_raw(&mut self, error: Option<&BackendError>) {
        let raw = std::mem::replace(&mut self.raw, ptr::null_mut());
        if raw.is_null() {
            return;
        }
        let c_error = error.map_or(ptr::null_mut(), new_error);
        // SAFETY: `raw` is a live response, sent once (the field was nulled above). Triton does not
        // take ownership of the error passed in, so it is deleted right after.
        let sent = unsafe {
            ffi_call!(TRITONBACKEND_ResponseSend(
                raw,
                sys::TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                c_error
            ))
        };
        if !c_error.is_null() {
            // SAFETY: created above by new_error and not used after this point.
            unsafe { ffi_call!(value TRITONSERVER_ErrorDelete(c_error)) };
        }
        if let Err(e) = sent {
            log(
                LogLevel::Error,
                &format!("recsys: failed to send a response: {e}"),
            );
        }
    }
}

impl Drop for Response {
    fn drop(&mut self) {
        if !self.raw.is_null() {
            self.send_raw(Some(&BackendError::Internal(
                "the recsys backend did not complete this response".into(),
            )));
        }
    }
}

/// The model's configuration as JSON (config version 1).
pub(crate) fn model_config(model: *mut sys::TRITONBACKEND_Model) -> Result<serde_json::Value> {
    let mut message = ptr::null_mut();
    // SAFETY: `model` is the live model Triton passed to ModelInitialize.
    unsafe { ffi_call!(TRITONBACKEND_ModelConfig(model, 1, &mut message))? };
    let (mut base, mut size) = (ptr::null(), 0usize);
    // SAFETY: `message` is owned by us until deleted below; base/size stay valid until then.
    let parsed = unsafe {
        let serialized = ffi_call!(TRITONSERVER_MessageSerializeToJson(
            message, &mut base, &mut size
        ))
        .map(|_| {
            serde_json::from_slice::<serde_json::Value>(std::slice::from_raw_parts(
                base as *const u8,
                size,
            ))
        });
        let deleted = ffi_call!(TRITONSERVER_MessageDelete(message));
        deleted.and(serialized)
    }?;
    parsed.map_err(|e| {
        BackendError::Internal(format!("Triton's model config is not valid JSON: {e}"))
    })
}

/// Replaces the model's configuration (only allowed during ModelInitialize with auto-complete on).
pub(crate) fn set_model_config(
    model: *mut sys::TRITONBACKEND_Model,
    config: &serde_json::Value,
) -> Result<()> {
    let text = config.to_string();
    let mut message = ptr::null_mut();
    // SAFETY: the JSON text is valid for the call and copied into the message; the message is
    // deleted after Triton has copied it into the model.
    unsafe {
        ffi_call!(TRITONSERVER_MessageNewFromSerializedJson(
            &mut message,
            text.as_ptr() as *const c_char,
            text.len()
        ))?;
        let set = ffi_call!(TRITONBACKEND_ModelSetConfig(model, 1, message));
        let deleted = ffi_call!(TRITONSERVER_MessageDelete(message));
        set.and(deleted)
    }
}
