//! `ffi/` is written by hand from Triton's C headers; this test checks it against the headers
//! themselves. bindgen (libclang) parses `tritonbackend.h` (which includes `tritonserver.h`) as the
//! registry package triton-sys 0.2.0 ships them (backend API 1.16, server API 1.25; found by
//! scripts/triton-headers.sh, or `TRITON_HEADERS_DIR`), and every function, constant and opaque
//! struct that both declare must agree: names, argument and return types (through type aliases,
//! down to primitives; a C enum parameter may be declared as a 32-bit integer, as the ABI passes
//! it), and values. What `ffi/` declares beyond those headers (the server we target is r24.10:
//! backend API 1.19, server API 1.34) is listed in [`ADDED_AFTER`] with how it was checked; an
//! entry the headers do declare, or a declaration in neither, fails the test.
//! Needs libclang at run time (Debian's libclang-dev; scripts/test.sh installs it); the build of
//! recsys itself needs neither libclang nor the headers.

use std::collections::BTreeMap;
use std::path::PathBuf;

use quote::ToTokens;
use syn::{ForeignItem, Item, ReturnType, Type};

/// Declarations of `ffi/` that are newer than the headers of triton-sys 0.2.0 (histogram metrics
/// came with server API 1.33), with how each was checked: read against `tritonserver.h` of
/// triton-inference-server/core at branch r24.10 (server API 1.34), line by line.
const ADDED_AFTER: &[(&str, &str)] = &[
    (
        "TRITONSERVER_MetricArgs",
        "r24.10 tritonserver.h:67 `struct TRITONSERVER_MetricArgs;` (opaque)",
    ),
    (
        "TRITONSERVER_METRIC_KIND_HISTOGRAM",
        "r24.10 tritonserver.h:2620, third enumerator of TRITONSERVER_MetricKind after COUNTER = 0 \
         and GAUGE = 1, so 2",
    ),
    (
        "TRITONSERVER_MetricArgsNew",
        "r24.10 tritonserver.h:2664 `TRITONSERVER_Error* (TRITONSERVER_MetricArgs** args)`",
    ),
    (
        "TRITONSERVER_MetricArgsSetHistogram",
        "r24.10 tritonserver.h:2676 `TRITONSERVER_Error* (TRITONSERVER_MetricArgs* args, const \
         double* buckets, const uint64_t buckets_count)`",
    ),
    (
        "TRITONSERVER_MetricArgsDelete",
        "r24.10 tritonserver.h:2684 `TRITONSERVER_Error* (TRITONSERVER_MetricArgs* args)`",
    ),
    (
        "TRITONSERVER_MetricNewWithArgs",
        "r24.10 tritonserver.h:2720 `TRITONSERVER_Error* (TRITONSERVER_Metric** metric, \
         TRITONSERVER_MetricFamily* family, const TRITONSERVER_Parameter** labels, const uint64_t \
         label_count, const TRITONSERVER_MetricArgs* args)`",
    ),
    (
        "TRITONSERVER_MetricObserve",
        "r24.10 tritonserver.h:2777 `TRITONSERVER_Error* (TRITONSERVER_Metric* metric, double value)`",
    ),
];

/// Constants whose value moved on between those headers and r24.10, with the r24.10 value.
const NEWER_VALUES: &[(&str, &str)] = &[(
    "TRITONBACKEND_API_VERSION_MINOR",
    "19: r24.10 tritonbackend.h:2888 `#define TRITONBACKEND_API_VERSION_MINOR 19` (the headers of \
     triton-sys 0.2.0 say 16); Triton 2.51 is the server recsys targets",
)];

#[derive(Default, Debug)]
struct Declarations {
    /// Function name -> (argument types, return type), canonical.
    functions: BTreeMap<String, (Vec<String>, String)>,
    /// Constant name -> value.
    constants: BTreeMap<String, String>,
    structs: Vec<String>,
    aliases: BTreeMap<String, Type>,
}

fn headers_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("TRITON_HEADERS_DIR") {
        return dir.into();
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/triton-headers.sh");
    let out = std::process::Command::new("bash")
        .arg(script)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {script}: {e}"));
    assert!(
        out.status.success(),
        "{script} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// Fails with what to install when libclang cannot be loaded, rather than with bindgen's own panic
/// from inside its loader.
fn require_libclang() {
    let quiet = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let loaded = std::panic::catch_unwind(bindgen::clang_version);
    std::panic::set_hook(quiet);
    if loaded.is_err() {
        panic!(
            "the FFI drift test needs libclang, which bindgen loads at run time and could not find: \
             install libclang (apt-get install libclang-dev) or run scripts/test.sh, which installs it"
        );
    }
}

fn header_bindings() -> String {
    require_libclang();
    let include = headers_dir();
    let header = include.join("triton/core/tritonbackend.h");
    assert!(header.is_file(), "{} missing", header.display());
    bindgen::Builder::default()
        .header(header.to_str().unwrap())
        .clang_arg(format!("-I{}", include.display()))
        // The headers use their struct names without `struct`, as C++ allows: parse them as C++.
        .clang_args(["-xc++", "-std=c++11"])
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .layout_tests(false)
        .generate_comments(false)
        .allowlist_item("TRITON.*")
        .generate()
        .unwrap_or_else(|e| {
            panic!(
                "bindgen could not parse {}: {e} (libclang: apt-get install libclang-dev)",
                header.display()
            )
        })
        .to_string()
}

fn collect(source: &str) -> Declarations {
    let file = syn::parse_file(source).expect("parses as Rust");
    let mut d = Declarations::default();
    for item in file.items {
        match item {
            Item::Type(t) => {
                d.aliases.insert(t.ident.to_string(), *t.ty);
            }
            Item::Const(c) => {
                d.constants
                    .insert(c.ident.to_string(), c.expr.to_token_stream().to_string());
            }
            Item::Struct(s) => d.structs.push(s.ident.to_string()),
            // bindgen's C++ mode names a typedef'd enum with `pub use self::tag_enum as Name;`.
            Item::Use(u) => {
                if let syn::UseTree::Path(p) = &u.tree {
                    if let syn::UseTree::Rename(r) = &*p.tree {
                        let target: Type = syn::parse_str(&r.ident.to_string()).unwrap();
                        d.aliases.insert(r.rename.to_string(), target);
                    }
                }
            }
            // ffi/'s `opaque!(A, B, ...)`: one opaque struct per name.
            Item::Macro(m) if m.mac.path.is_ident("opaque") => {
                let names = m
                    .mac
                    .parse_body_with(
                        syn::punctuated::Punctuated::<syn::Ident, syn::Token![,]>::parse_terminated,
                    )
                    .expect("opaque!(Name, ...)");
                d.structs.extend(names.iter().map(|n| n.to_string()));
            }
            Item::ForeignMod(m) => {
                for f in m.items {
                    if let ForeignItem::Fn(f) = f {
                        let args = f
                            .sig
                            .inputs
                            .iter()
                            .map(|a| match a {
                                syn::FnArg::Typed(p) => (*p.ty).clone(),
                                syn::FnArg::Receiver(_) => unreachable!("no methods in C"),
                            })
                            .collect::<Vec<_>>();
                        let ret = match &f.sig.output {
                            ReturnType::Default => None,
                            ReturnType::Type(_, t) => Some((**t).clone()),
                        };
                        d.functions.insert(
                            f.sig.ident.to_string(),
                            (
                                args.iter()
                                    .map(|t| t.to_token_stream().to_string())
                                    .collect(),
                                ret.map_or("()".into(), |t| t.to_token_stream().to_string()),
                            ),
                        );
                    }
                }
            }
            _ => {}
        }
    }
    // Canonical types need every alias, so resolve after collecting.
    let raw = std::mem::take(&mut d.functions);
    for (name, (args, ret)) in raw {
        let canon = |s: &str| {
            if s == "()" {
                return s.to_string();
            }
            canonical(&syn::parse_str::<Type>(s).unwrap(), &d.aliases, 0)
        };
        d.functions
            .insert(name, (args.iter().map(|a| canon(a)).collect(), canon(&ret)));
    }
    d
}

/// A type through its aliases, down to primitives, pointers and struct names. A C enum (bindgen
/// keeps C's `..._enum` tag as the alias name) becomes `enum32`.
fn canonical(ty: &Type, aliases: &BTreeMap<String, Type>, depth: usize) -> String {
    assert!(depth < 32, "alias cycle at {}", ty.to_token_stream());
    match ty {
        Type::Ptr(p) => format!(
            "*{} {}",
            if p.mutability.is_some() {
                "mut"
            } else {
                "const"
            },
            canonical(&p.elem, aliases, depth + 1)
        ),
        Type::Path(p) => {
            let name = p
                .path
                .segments
                .last()
                .expect("a type name")
                .ident
                .to_string();
            if name.ends_with("_enum") {
                return "enum32".into();
            }
            match aliases.get(&name) {
                Some(target) => canonical(target, aliases, depth + 1),
                None => name,
            }
        }
        Type::Tuple(t) if t.elems.is_empty() => "()".into(),
        other => other.to_token_stream().to_string(),
    }
}

/// Whether our canonical type matches the header's: equal, or a C enum that we pass as a 32-bit
/// integer (identical in the C ABI).
fn same_type(ours: &str, theirs: &str) -> bool {
    ours == theirs
        || ["c_int", "c_uint", "i32", "u32"]
            .iter()
            .any(|int| theirs.replace("enum32", int) == ours)
}

/// An integer constant's value, whatever its spelling (`1`, `1u32`, `0x1`).
fn value(expr: &str) -> String {
    let digits: String = expr.chars().filter(|c| !c.is_whitespace()).collect();
    let digits = digits.trim_end_matches(|c: char| c.is_ascii_alphabetic() && c != 'x');
    match digits.strip_prefix("0x") {
        Some(hex) => i64::from_str_radix(hex, 16).map_or(expr.into(), |v| v.to_string()),
        None => digits.parse::<i64>().map_or(expr.into(), |v| v.to_string()),
    }
}

#[test]
fn ffi_declarations_match_tritons_headers() {
    let theirs = collect(&header_bindings());
    let ours = collect(include_str!("../src/lib.rs"));
    assert!(
        theirs.functions.len() > 100,
        "bindgen found only {} functions",
        theirs.functions.len()
    );
    let added: BTreeMap<&str, &str> = ADDED_AFTER.iter().copied().collect();
    let newer: BTreeMap<&str, &str> = NEWER_VALUES.iter().copied().collect();
    let mut problems = Vec::new();
    let mut checked = 0;

    for (name, (args, ret)) in &ours.functions {
        match theirs.functions.get(name) {
            Some((their_args, their_ret)) => {
                checked += 1;
                if added.contains_key(name.as_str()) {
                    problems.push(format!(
                        "{name}: listed in ADDED_AFTER but the headers declare it"
                    ));
                }
                if args.len() != their_args.len() {
                    problems.push(format!(
                        "{name}: {} arguments, the header has {}: ours {args:?}, header {their_args:?}",
                        args.len(),
                        their_args.len()
                    ));
                    continue;
                }
                for (i, (a, b)) in args.iter().zip(their_args).enumerate() {
                    if !same_type(a, b) {
                        problems.push(format!(
                            "{name}: argument {i} is `{a}`, the header's is `{b}`"
                        ));
                    }
                }
                if !same_type(ret, their_ret) {
                    problems.push(format!(
                        "{name}: returns `{ret}`, the header's returns `{their_ret}`"
                    ));
                }
            }
            None if added.contains_key(name.as_str()) => {}
            None => problems.push(format!(
                "{name}: not in the headers of triton-sys 0.2.0 and not listed in ADDED_AFTER"
            )),
        }
    }
    for (name, ours_value) in &ours.constants {
        match theirs.constants.get(name) {
            Some(their_value) => {
                checked += 1;
                let (a, b) = (value(ours_value), value(their_value));
                if a != b && !newer.contains_key(name.as_str()) {
                    problems.push(format!("{name} = {a}, the header says {b}"));
                }
            }
            None if added.contains_key(name.as_str()) => {}
            None => problems.push(format!(
                "constant {name}: not in the headers of triton-sys 0.2.0 and not listed in ADDED_AFTER"
            )),
        }
    }
    for name in &ours.structs {
        if theirs.structs.contains(name) {
            checked += 1;
        } else if !added.contains_key(name.as_str()) {
            problems.push(format!("struct {name}: not declared by the headers"));
        }
    }
    println!(
        "{checked} declarations of ffi/ checked against the headers; {} listed as newer",
        ADDED_AFTER.len() + NEWER_VALUES.len()
    );
    assert!(
        problems.is_empty(),
        "ffi/ disagrees with Triton's headers:\n{}",
        problems.join("\n")
    );
}

/// On a machine without libclang the drift test says what to install, without a bindgen
/// backtrace: this test runs it again in a child process whose libclang search path leads nowhere
/// (clang-sys looks only there when `LIBCLANG_PATH` names a missing directory).
#[test]
fn without_libclang_the_drift_test_says_what_to_install() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "ffi_declarations_match_tritons_headers",
            "--nocapture",
        ])
        .env("LIBCLANG_PATH", "/nonexistent/libclang")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("install libclang (apt-get install libclang-dev) or run scripts/test.sh"),
        "{text}"
    );
    assert!(
        !text.contains("Unable to find libclang") && !text.contains("bindgen-"),
        "bindgen's own panic leaked: {text}"
    );
}
