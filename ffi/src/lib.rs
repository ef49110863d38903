//! Raw declarations of the Triton C API used by the recsys backend, written from the r24.10 headers
//! (`tritonbackend.h`: backend API 1.19; `tritonserver.h`: server API 1.34). No logic lives here.
//!
//! The symbols are left undefined in the shared library and resolve against the server process when
//! Triton loads the backend, so nothing here links against `libtritonserver.so`.
#![forbid(unsafe_code)]
#![allow(non_camel_case_types, non_snake_case)]

use std::os::raw::{c_char, c_int, c_void};

pub const TRITONBACKEND_API_VERSION_MAJOR: u32 = 1;
pub const TRITONBACKEND_API_VERSION_MINOR: u32 = 19;

/// Opaque handles owned by the server.
macro_rules! opaque {
    ($($name:ident),* $(,)?) => {
        $(
            #[repr(C)]
            pub struct $name {
                _private: [u8; 0],
            }
        )*
    };
}

opaque!(
    TRITONSERVER_Error,
    TRITONSERVER_Message,
    TRITONSERVER_MetricFamily,
    TRITONSERVER_Metric,
    TRITONSERVER_MetricArgs,
    TRITONSERVER_Parameter,
    TRITONBACKEND_Backend,
    TRITONBACKEND_Model,
    TRITONBACKEND_ModelInstance,
    TRITONBACKEND_Request,
    TRITONBACKEND_Response,
    TRITONBACKEND_Input,
    TRITONBACKEND_Output,
);

/// `TRITONSERVER_DataType`.
pub type TRITONSERVER_DataType = c_int;
pub const TRITONSERVER_TYPE_INVALID: TRITONSERVER_DataType = 0;
pub const TRITONSERVER_TYPE_BOOL: TRITONSERVER_DataType = 1;
pub const TRITONSERVER_TYPE_UINT8: TRITONSERVER_DataType = 2;
pub const TRITONSERVER_TYPE_UINT16: TRITONSERVER_DataType = 3;
pub const TRITONSERVER_TYPE_UINT32: TRITONSERVER_DataType = 4;
pub const TRITONSERVER_TYPE_UINT64: TRITONSERVER_DataType = 5;
pub const TRITONSERVER_TYPE_INT8: TRITONSERVER_DataType = 6;
pub const TRITONSERVER_TYPE_INT16: TRITONSERVER_DataType = 7;
pub const TRITONSERVER_TYPE_INT32: TRITONSERVER_DataType = 8;
pub const TRITONSERVER_TYPE_INT64: TRITONSERVER_DataType = 9;
pub const TRITONSERVER_TYPE_FP16: TRITONSERVER_DataType = 10;
pub const TRITONSERVER_TYPE_FP32: TRITONSERVER_DataType = 11;
pub const TRITONSERVER_TYPE_FP64: TRITONSERVER_DataType = 12;
pub const TRITONSERVER_TYPE_BYTES: TRITONSERVER_DataType = 13;
pub const TRITONSERVER_TYPE_BF16: TRITONSERVER_DataType = 14;

/// `TRITONSERVER_MemoryType`.
pub type TRITONSERVER_MemoryType = c_int;
pub const TRITONSERVER_MEMORY_CPU: TRITONSERVER_MemoryType = 0;
pub const TRITONSERVER_MEMORY_CPU_PINNED: TRITONSERVER_MemoryType = 1;
pub const TRITONSERVER_MEMORY_GPU: TRITONSERVER_MemoryType = 2;

/// `TRITONSERVER_ParameterType`.
pub type TRITONSERVER_ParameterType = c_int;
pub const TRITONSERVER_PARAMETER_STRING: TRITONSERVER_ParameterType = 0;
pub const TRITONSERVER_PARAMETER_INT: TRITONSERVER_ParameterType = 1;
pub const TRITONSERVER_PARAMETER_BOOL: TRITONSERVER_ParameterType = 2;

/// `TRITONSERVER_InstanceGroupKind`.
pub type TRITONSERVER_InstanceGroupKind = c_int;
pub const TRITONSERVER_INSTANCEGROUPKIND_AUTO: TRITONSERVER_InstanceGroupKind = 0;
pub const TRITONSERVER_INSTANCEGROUPKIND_CPU: TRITONSERVER_InstanceGroupKind = 1;
pub const TRITONSERVER_INSTANCEGROUPKIND_GPU: TRITONSERVER_InstanceGroupKind = 2;
pub const TRITONSERVER_INSTANCEGROUPKIND_MODEL: TRITONSERVER_InstanceGroupKind = 3;

/// `TRITONSERVER_LogLevel`.
pub type TRITONSERVER_LogLevel = c_int;
pub const TRITONSERVER_LOG_INFO: TRITONSERVER_LogLevel = 0;
pub const TRITONSERVER_LOG_WARN: TRITONSERVER_LogLevel = 1;
pub const TRITONSERVER_LOG_ERROR: TRITONSERVER_LogLevel = 2;
pub const TRITONSERVER_LOG_VERBOSE: TRITONSERVER_LogLevel = 3;

/// `TRITONSERVER_Error_Code`.
pub type TRITONSERVER_Error_Code = c_int;
pub const TRITONSERVER_ERROR_UNKNOWN: TRITONSERVER_Error_Code = 0;
pub const TRITONSERVER_ERROR_INTERNAL: TRITONSERVER_Error_Code = 1;
pub const TRITONSERVER_ERROR_NOT_FOUND: TRITONSERVER_Error_Code = 2;
pub const TRITONSERVER_ERROR_INVALID_ARG: TRITONSERVER_Error_Code = 3;
pub const TRITONSERVER_ERROR_UNAVAILABLE: TRITONSERVER_Error_Code = 4;
pub const TRITONSERVER_ERROR_UNSUPPORTED: TRITONSERVER_Error_Code = 5;
pub const TRITONSERVER_ERROR_ALREADY_EXISTS: TRITONSERVER_Error_Code = 6;
pub const TRITONSERVER_ERROR_CANCELLED: TRITONSERVER_Error_Code = 7;

/// `TRITONSERVER_MetricKind`.
pub type TRITONSERVER_MetricKind = c_int;
pub const TRITONSERVER_METRIC_KIND_COUNTER: TRITONSERVER_MetricKind = 0;
pub const TRITONSERVER_METRIC_KIND_GAUGE: TRITONSERVER_MetricKind = 1;
pub const TRITONSERVER_METRIC_KIND_HISTOGRAM: TRITONSERVER_MetricKind = 2;

/// `TRITONBACKEND_ArtifactType`.
pub type TRITONBACKEND_ArtifactType = c_int;
pub const TRITONBACKEND_ARTIFACT_FILESYSTEM: TRITONBACKEND_ArtifactType = 0;

pub const TRITONSERVER_REQUEST_RELEASE_ALL: u32 = 1;
pub const TRITONSERVER_RESPONSE_COMPLETE_FINAL: u32 = 1;

extern "C" {
    // --- tritonserver.h: errors, messages, logging, parameters, metrics ---
    pub fn TRITONSERVER_ErrorNew(
        code: TRITONSERVER_Error_Code,
        msg: *const c_char,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONSERVER_ErrorDelete(error: *mut TRITONSERVER_Error);
    pub fn TRITONSERVER_ErrorCode(error: *mut TRITONSERVER_Error) -> TRITONSERVER_Error_Code;
    pub fn TRITONSERVER_ErrorMessage(error: *mut TRITONSERVER_Error) -> *const c_char;

    pub fn TRITONSERVER_MessageNewFromSerializedJson(
        message: *mut *mut TRITONSERVER_Message,
        base: *const c_char,
        byte_size: usize,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONSERVER_MessageDelete(
        message: *mut TRITONSERVER_Message,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONSERVER_MessageSerializeToJson(
        message: *mut TRITONSERVER_Message,
        base: *mut *const c_char,
        byte_size: *mut usize,
    ) -> *mut TRITONSERVER_Error;

    pub fn TRITONSERVER_LogIsEnabled(level: TRITONSERVER_LogLevel) -> bool;
    pub fn TRITONSERVER_LogMessage(
        level: TRITONSERVER_LogLevel,
        filename: *const c_char,
        line: c_int,
        msg: *const c_char,
    ) -> *mut TRITONSERVER_Error;

    pub fn TRITONSERVER_ParameterNew(
        name: *const c_char,
        kind: TRITONSERVER_ParameterType,
        value: *const c_void,
    ) -> *mut TRITONSERVER_Parameter;
    pub fn TRITONSERVER_ParameterDelete(parameter: *mut TRITONSERVER_Parameter);

    pub fn TRITONSERVER_MetricFamilyNew(
        family: *mut *mut TRITONSERVER_MetricFamily,
        kind: TRITONSERVER_MetricKind,
        name: *const c_char,
        description: *const c_char,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONSERVER_MetricFamilyDelete(
        family: *mut TRITONSERVER_MetricFamily,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONSERVER_MetricArgsNew(
        args: *mut *mut TRITONSERVER_MetricArgs,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONSERVER_MetricArgsSetHistogram(
        args: *mut TRITONSERVER_MetricArgs,
        buckets: *const f64,
        buckets_count: u64,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONSERVER_MetricArgsDelete(
        args: *mut TRITONSERVER_MetricArgs,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONSERVER_MetricNew(
        metric: *mut *mut TRITONSERVER_Metric,
        family: *mut TRITONSERVER_MetricFamily,
        labels: *mut *const TRITONSERVER_Parameter,
        label_count: u64,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONSERVER_MetricNewWithArgs(
        metric: *mut *mut TRITONSERVER_Metric,
        family: *mut TRITONSERVER_MetricFamily,
        labels: *mut *const TRITONSERVER_Parameter,
        label_count: u64,
        args: *const TRITONSERVER_MetricArgs,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONSERVER_MetricDelete(metric: *mut TRITONSERVER_Metric) -> *mut TRITONSERVER_Error;
    pub fn TRITONSERVER_MetricIncrement(
        metric: *mut TRITONSERVER_Metric,
        value: f64,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONSERVER_MetricSet(
        metric: *mut TRITONSERVER_Metric,
        value: f64,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONSERVER_MetricObserve(
        metric: *mut TRITONSERVER_Metric,
        value: f64,
    ) -> *mut TRITONSERVER_Error;

    // --- tritonbackend.h ---
    pub fn TRITONBACKEND_ApiVersion(major: *mut u32, minor: *mut u32) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_BackendName(
        backend: *mut TRITONBACKEND_Backend,
        name: *mut *const c_char,
    ) -> *mut TRITONSERVER_Error;

    pub fn TRITONBACKEND_ModelName(
        model: *mut TRITONBACKEND_Model,
        name: *mut *const c_char,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_ModelVersion(
        model: *mut TRITONBACKEND_Model,
        version: *mut u64,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_ModelRepository(
        model: *mut TRITONBACKEND_Model,
        artifact_type: *mut TRITONBACKEND_ArtifactType,
        location: *mut *const c_char,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_ModelConfig(
        model: *mut TRITONBACKEND_Model,
        config_version: u32,
        model_config: *mut *mut TRITONSERVER_Message,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_ModelAutoCompleteConfig(
        model: *mut TRITONBACKEND_Model,
        auto_complete_config: *mut bool,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_ModelSetConfig(
        model: *mut TRITONBACKEND_Model,
        config_version: u32,
        model_config: *mut TRITONSERVER_Message,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_ModelState(
        model: *mut TRITONBACKEND_Model,
        state: *mut *mut c_void,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_ModelSetState(
        model: *mut TRITONBACKEND_Model,
        state: *mut c_void,
    ) -> *mut TRITONSERVER_Error;

    pub fn TRITONBACKEND_ModelInstanceName(
        instance: *mut TRITONBACKEND_ModelInstance,
        name: *mut *const c_char,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_ModelInstanceKind(
        instance: *mut TRITONBACKEND_ModelInstance,
        kind: *mut TRITONSERVER_InstanceGroupKind,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_ModelInstanceDeviceId(
        instance: *mut TRITONBACKEND_ModelInstance,
        device_id: *mut i32,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_ModelInstanceModel(
        instance: *mut TRITONBACKEND_ModelInstance,
        model: *mut *mut TRITONBACKEND_Model,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_ModelInstanceState(
        instance: *mut TRITONBACKEND_ModelInstance,
        state: *mut *mut c_void,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_ModelInstanceSetState(
        instance: *mut TRITONBACKEND_ModelInstance,
        state: *mut c_void,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_ModelInstanceReportStatistics(
        instance: *mut TRITONBACKEND_ModelInstance,
        request: *mut TRITONBACKEND_Request,
        success: bool,
        exec_start_ns: u64,
        compute_start_ns: u64,
        compute_end_ns: u64,
        exec_end_ns: u64,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_ModelInstanceReportBatchStatistics(
        instance: *mut TRITONBACKEND_ModelInstance,
        batch_size: u64,
        exec_start_ns: u64,
        compute_start_ns: u64,
        compute_end_ns: u64,
        exec_end_ns: u64,
    ) -> *mut TRITONSERVER_Error;

    pub fn TRITONBACKEND_RequestId(
        request: *mut TRITONBACKEND_Request,
        id: *mut *const c_char,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_RequestInputCount(
        request: *mut TRITONBACKEND_Request,
        count: *mut u32,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_RequestInputByIndex(
        request: *mut TRITONBACKEND_Request,
        index: u32,
        input: *mut *mut TRITONBACKEND_Input,
    ) -> *mut TRITONSERVER_Error;
    /// The outputs the client asked for (all of the model's when it named none).
    pub fn TRITONBACKEND_RequestOutputCount(
        request: *mut TRITONBACKEND_Request,
        count: *mut u32,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_RequestOutputName(
        request: *mut TRITONBACKEND_Request,
        index: u32,
        output_name: *mut *const c_char,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_RequestRelease(
        request: *mut TRITONBACKEND_Request,
        release_flags: u32,
    ) -> *mut TRITONSERVER_Error;

    pub fn TRITONBACKEND_InputProperties(
        input: *mut TRITONBACKEND_Input,
        name: *mut *const c_char,
        datatype: *mut TRITONSERVER_DataType,
        shape: *mut *const i64,
        dims_count: *mut u32,
        byte_size: *mut u64,
        buffer_count: *mut u32,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_InputBuffer(
        input: *mut TRITONBACKEND_Input,
        index: u32,
        buffer: *mut *const c_void,
        buffer_byte_size: *mut u64,
        memory_type: *mut TRITONSERVER_MemoryType,
        memory_type_id: *mut i64,
    ) -> *mut TRITONSERVER_Error;

    pub fn TRITONBACKEND_ResponseNew(
        response: *mut *mut TRITONBACKEND_Response,
        request: *mut TRITONBACKEND_Request,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_ResponseDelete(
        response: *mut TRITONBACKEND_Response,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_ResponseSetIntParameter(
        response: *mut TRITONBACKEND_Response,
        name: *const c_char,
        value: i64,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_ResponseOutput(
        response: *mut TRITONBACKEND_Response,
        output: *mut *mut TRITONBACKEND_Output,
        name: *const c_char,
        datatype: TRITONSERVER_DataType,
        shape: *const i64,
        dims_count: u32,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_OutputBuffer(
        output: *mut TRITONBACKEND_Output,
        buffer: *mut *mut c_void,
        buffer_byte_size: u64,
        memory_type: *mut TRITONSERVER_MemoryType,
        memory_type_id: *mut i64,
    ) -> *mut TRITONSERVER_Error;
    pub fn TRITONBACKEND_ResponseSend(
        response: *mut TRITONBACKEND_Response,
        send_flags: u32,
        error: *mut TRITONSERVER_Error,
    ) -> *mut TRITONSERVER_Error;
}
