//! `LD_PRELOAD=librecsys_secret_args.so tritonserver ... --http-restricted-api=model-repository:recsys-admin-key=@file:/var/run/secrets/recsys-admin/key`
//!
//! tritonserver 2.51 takes the key that guards its model-control APIs only on its command line,
//! and a process's arguments are readable by every process of the host in `/proc/PID/cmdline`.
//! This library, preloaded, runs before the program's `main`: every argument that ends in
//! `@file:PATH` (the first line of that file, a mounted Secret) or `@env:NAME` (that environment
//! variable, which only the process's own user and root can read) gets a copy with the secret in
//! place of the reference, and the program's `argv` array points at the copy. The memory
//! `/proc/PID/cmdline` shows is never written: it keeps the reference, never the secret.
//!
//! A reference that cannot be resolved (a missing or empty file, an unset variable) ends the
//! process before `main` with the reason on stderr: a server started with the literal reference
//! as its key would accept whoever reads the command line.
//!
//! The images set `LD_PRELOAD` to this library themselves, so `podman run IMAGE tritonserver ...
//! key=@file:...` resolves the key without the manifests' help (without it, tritonserver would
//! take the public `@file:...` text as its key). Every process of the image then loads it, so it
//! acts on `tritonserver` alone (the program's file name, from `argv[0]`): a health check, a
//! shell or the `recsys` command keep their arguments exactly as given.

use std::ffi::{c_char, c_int, CStr, CString};
use std::io::Write;

/// The markers an argument's secret reference starts with.
const FILE_MARKER: &str = "@file:";
const ENV_MARKER: &str = "@env:";

/// An argument with its secret reference resolved, or why it cannot be (`Ok(None)`: the argument
/// holds no reference).
pub fn resolve(
    argument: &str,
    read_file: &dyn Fn(&str) -> std::io::Result<String>,
    read_env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<String>, String> {
    let (at, secret) = if let Some(at) = argument.find(FILE_MARKER) {
        let path = &argument[at + FILE_MARKER.len()..];
        let text =
            read_file(path).map_err(|e| format!("cannot read the secret file {path}: {e}"))?;
        let first = text.lines().next().unwrap_or("").trim().to_string();
        if first.is_empty() {
            return Err(format!("the secret file {path} is empty"));
        }
        (at, first)
    } else if let Some(at) = argument.find(ENV_MARKER) {
        let name = &argument[at + ENV_MARKER.len()..];
        let value = read_env(name)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
            .ok_or_else(|| format!("the secret variable {name} is not set or empty"))?;
        (at, value)
    } else {
        return Ok(None);
    };
    if secret.contains('\0') {
        return Err("the secret holds a NUL byte".into());
    }
    Ok(Some(format!("{}{secret}", &argument[..at])))
}

/// The program this library resolves arguments for.
const PROGRAM: &str = "tritonserver";

/// Whether a program started as `argv0` is the one this library acts on: its file name is
/// `tritonserver` (`tritonserver`, `/opt/tritonserver/bin/tritonserver`, a symlink of that name).
pub fn acts_on(argv0: &str) -> bool {
    argv0.rsplit('/').next() == Some(PROGRAM)
}

/// Resolves every argument of `argv` in place (see the crate documentation).
///
/// # Safety
/// `argv` must point at `argc` valid, NUL-terminated C strings (what the C runtime passes to
/// `.init_array` functions), and nothing else may use the array while this runs.
unsafe fn resolve_all(argc: c_int, argv: *mut *mut c_char) -> Result<(), String> {
    for i in 0..usize::try_from(argc).unwrap_or(0) {
        // SAFETY: i < argc, so the slot is within the array the caller describes.
        let slot = unsafe { argv.add(i) };
        // SAFETY: every slot below argc holds a valid C string (the caller's contract).
        let argument = unsafe { CStr::from_ptr(*slot) }
            .to_string_lossy()
            .into_owned();
        let resolved = resolve(&argument, &|p| std::fs::read_to_string(p), &|n| {
            std::env::var(n).ok()
        })
        .map_err(|e| format!("argument {i}: {e}"))?;
        if let Some(resolved) = resolved {
            let owned = CString::new(resolved).map_err(|e| format!("argument {i}: {e}"))?;
            // SAFETY: the slot is valid and writable (argv is the process's own array); the new
            // string is leaked, so it lives as long as the process, as argv strings do.
            unsafe { *slot = owned.into_raw() };
        }
    }
    Ok(())
}

extern "C" fn resolve_secret_arguments(
    argc: c_int,
    argv: *mut *mut c_char,
    _env: *mut *mut c_char,
) {
    // A panic must not unwind into the C runtime: it ends the process like any other failure.
    let outcome = std::panic::catch_unwind(|| {
        if argv.is_null() || argc < 1 {
            return Ok(());
        }
        // SAFETY: glibc passes argc >= 1 valid C strings in argv (checked non-null above);
        // argv[0] is the first of them.
        let argv0 = unsafe { CStr::from_ptr(*argv) }.to_string_lossy();
        if !acts_on(&argv0) {
            return Ok(());
        }
        // SAFETY: glibc calls `.init_array` functions with the program's argc and argv, before
        // main and before any other thread exists.
        unsafe { resolve_all(argc, argv) }
    });
    let error = match outcome {
        Ok(Ok(())) => return,
        Ok(Err(e)) => e,
        Err(_) => "an internal error".to_string(),
    };
    // `eprintln!` panics when stderr is closed, and a panic here would unwind into C: write and
    // ignore a failure instead.
    let _ = writeln!(
        std::io::stderr(),
        "recsys-secret-args: {error}; refusing to start with an unresolved secret reference"
    );
    std::process::exit(78);
}

/// Run by the dynamic loader when the library is loaded (preloaded: before `main`), with the
/// program's arguments.
#[used]
#[link_section = ".init_array"]
static RESOLVE_AT_LOAD: extern "C" fn(c_int, *mut *mut c_char, *mut *mut c_char) =
    resolve_secret_arguments;

#[cfg(test)]
mod tests {
    use super::*;

    fn files(path: &str) -> std::io::Result<String> {
        match path {
            "/secrets/key" => Ok("s3cret\nignored second line\n".into()),
            "/secrets/empty" => Ok("\n".into()),
            _ => Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "No such file",
            )),
        }
    }

    fn env(name: &str) -> Option<String> {
        (name == "ADMIN_KEY").then(|| "from-env".to_string())
    }

    #[test]
    fn references_are_replaced_by_the_secret_and_other_arguments_left_alone() {
        let flag = "--http-restricted-api=model-repository,model-config:recsys-admin-key=";
        assert_eq!(
            resolve(&format!("{flag}@file:/secrets/key"), &files, &env).unwrap(),
            Some(format!("{flag}s3cret"))
        );
        assert_eq!(
            resolve(&format!("{flag}@env:ADMIN_KEY"), &files, &env).unwrap(),
            Some(format!("{flag}from-env"))
        );
        assert_eq!(resolve("--http-port=8000", &files, &env).unwrap(), None);
    }

    #[test]
    fn only_tritonserver_has_its_arguments_resolved() {
        for yes in [
            "tritonserver",
            "/opt/tritonserver/bin/tritonserver",
            "./tritonserver",
        ] {
            assert!(acts_on(yes), "{yes}");
        }
        for no in [
            "python3",
            "/bin/bash",
            "recsys",
            "tritonserver.sh",
            "/tritonserver/bin/x",
        ] {
            assert!(!acts_on(no), "{no}");
        }
    }

    #[test]
    fn an_unresolvable_reference_is_an_error_naming_it() {
        let err = resolve("k=@file:/secrets/missing", &files, &env).unwrap_err();
        assert!(
            err.contains("/secrets/missing") && err.contains("No such file"),
            "{err}"
        );
        let err = resolve("k=@file:/secrets/empty", &files, &env).unwrap_err();
        assert!(err.contains("empty"), "{err}");
        let err = resolve("k=@env:UNSET", &files, &env).unwrap_err();
        assert!(err.contains("UNSET"), "{err}");
    }
}
