//! Finding CUDA's libraries and compiling the kernels: probes that never panic, the NVRTC and
//! driver versions, and NVRTC compilation (cached per source hash, architecture and options).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cudarc::nvrtc::{CompileError, CompileOptions};

use crate::{cache_key, compile_options, GpuError, Result, MODULES};

/// Runs a probe of a CUDA library through cudarc, turning its panics into an error: cudarc loads
/// every symbol of its bindings when it first opens a library and panics on a missing one (a
/// CUDA 13 libnvrtc.so opened through the CUDA 12 bindings lacks `nvrtcGetNVVM`), and a panic
/// must never reach the caller, let alone Triton.
fn probe<T>(library: &str, f: impl FnOnce() -> T + std::panic::UnwindSafe) -> Result<T> {
    std::panic::catch_unwind(f).map_err(|panic| {
        let why = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic without a message".into());
        GpuError::Unavailable(format!(
            "{library} was found but cannot be used by this build (made for CUDA {}): {why}",
            BUILT_FOR_CUDA
        ))
    })
}

/// The CUDA major version whose bindings this build uses (the `cuda-12` or `cuda-13` feature).
pub const BUILT_FOR_CUDA: &str = if cfg!(feature = "cuda-13") {
    "13"
} else {
    "12"
};

/// Whether the CUDA driver library can be opened and has every symbol this build needs.
pub fn driver_present() -> bool {
    // SAFETY: only dlopens the driver library by its usual names and resolves its symbols; no
    // CUDA call is made.
    probe("libcuda.so.1", || unsafe {
        cudarc::driver::sys::is_culib_present() && {
            cudarc::driver::sys::culib();
            true
        }
    })
    .unwrap_or(false)
}

/// Whether NVRTC can be opened and has every symbol this build needs.
pub fn nvrtc_present() -> bool {
    nvrtc_check().is_ok()
}

/// Why NVRTC cannot be used, if it cannot: not found, or found without the symbols of the CUDA
/// version this build is for.
pub fn nvrtc_check() -> Result<()> {
    // SAFETY: only dlopens libnvrtc by its usual names and resolves its symbols.
    let found = probe("libnvrtc", || unsafe {
        cudarc::nvrtc::sys::is_culib_present() && {
            cudarc::nvrtc::sys::culib();
            true
        }
    })?;
    if found {
        Ok(())
    } else {
        Err(GpuError::Unavailable(format!(
            "NVRTC (libnvrtc.so.{BUILT_FOR_CUDA}) not found: install the CUDA toolkit's NVRTC or PyPI \
             {} and put its lib directory on LD_LIBRARY_PATH",
            if BUILT_FOR_CUDA == "13" {
                "nvidia-cuda-nvrtc (13.x)"
            } else {
                "nvidia-cuda-nvrtc-cu12"
            }
        )))
    }
}

/// NVRTC's version (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    nvrtc_check()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library was opened and checked above; the out-pointers are valid locals.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if status != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(GpuError::Unavailable(format!(
            "nvrtcVersion failed: {status:?}"
        )));
    }
    Ok((major, minor))
}

/// The newest CUDA version the driver supports (major, minor), e.g. (13, 0) for driver 580.
pub fn driver_cuda_version() -> Result<(i32, i32)> {
    if !driver_present() {
        return Err(GpuError::Unavailable(
            "the CUDA driver (libcuda.so.1) is not installed or not visible to this process".into(),
        ));
    }
    let mut version = 0;
    // SAFETY: the library was opened and checked above; cuDriverGetVersion needs no cuInit.
    let status = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) };
    if status != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return Err(GpuError::Unavailable(format!(
            "cuDriverGetVersion failed: {status:?}"
        )));
    }
    Ok((version / 1000, version % 1000 / 10))
}

/// PTX from an NVRTC newer than the driver cannot be loaded (CUDA_ERROR_UNSUPPORTED_PTX_VERSION, at
/// the first module load); say so before compiling, with what to do.
pub fn check_nvrtc_against_driver() -> Result<()> {
    let nvrtc = nvrtc_version()?;
    let driver = driver_cuda_version()?;
    if nvrtc > driver {
        return Err(GpuError::Unavailable(format!(
            "NVRTC {}.{} is newer than the driver, which supports CUDA {}.{}: the driver cannot load \
             its PTX. Put an NVRTC no newer than {}.{} first on LD_LIBRARY_PATH (the toolkit's, or \
             PyTorch's nvidia/cu{}/lib), or update the driver",
            nvrtc.0, nvrtc.1, driver.0, driver.1, driver.0, driver.1, driver.0
        )));
    }
    Ok(())
}

/// PTX of one kernel source for `arch` ("sm_90"), compiled once per process and cache key.
pub fn compile_source(name: &str, source: &str, arch: &str) -> Result<String> {
    static CACHE: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();
    let key = format!("{name}-{}", cache_key(source, arch));
    let cache = CACHE.get_or_init(Default::default);
    if let Some(ptx) = cache
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&key)
    {
        return Ok(ptx.clone());
    }
    nvrtc_check()?;
    let opts = CompileOptions {
        options: compile_options(arch),
        name: Some(name.into()),
        ..Default::default()
    };
    let ptx =
        cudarc::nvrtc::compile_ptx_with_opts(source, opts).map_err(|e| GpuError::Compile {
            arch: arch.into(),
            log: match e {
                CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
                other => format!("{other:?}"),
            },
        })?;
    let text = ptx.to_src();
    cache
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(key, text.clone());
    Ok(text)
}

/// PTX of every module ([`MODULES`]) for `arch`, in that order.
pub fn compile(arch: &str) -> Result<Vec<String>> {
    MODULES
        .iter()
        .map(|(name, source, _)| compile_source(name, source, arch))
        .collect()
}
