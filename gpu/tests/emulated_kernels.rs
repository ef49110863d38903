//! The CUDA kernels, run on the CPU: `kernels/fused_topk.cu` compiled as host C++ in front of
//! `emulator/cuda_emulation.hpp` (every CUDA thread a fiber, barriers and warp primitives as
//! scheduling points; divergent barriers are reported) and driven through the same launch plan the
//! CUDA host uses (`stage1_launch`, `merge_plan`, `exclusion_csr`, `ranked_rows`). Checked against
//! the scalar f64 reference on fresh random inputs, so the kernels' logic is tested on machines
//! without a GPU; timing and the hardware itself need the device tests (scripts/gpu-check.sh).
//!
//! Needs a C++17 compiler (`c++`, or the one named by RECSYS_CXX).

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use common::{assert_row_matches, exclusions, matrix, reference, Rng};
use libloading::{Library, Symbol};
use recsys_engine::weights::Matrix;
use recsys_gpu::{exclusion_csr, merge_plan, ranked_rows, stage1_launch, Ranked, TILE};

type Stage1F32 = unsafe extern "C" fn(
    u32,
    u32,
    u32,
    *const f32,
    *const f32,
    *const f32,
    *const u32,
    *const u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    *mut f32,
    *mut u32,
) -> i32;
type Stage1F16 = unsafe extern "C" fn(
    u32,
    u32,
    u32,
    *const f32,
    *const u16,
    *const f32,
    *const u32,
    *const u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    *mut f32,
    *mut u32,
) -> i32;
type Stage1I8 = unsafe extern "C" fn(
    u32,
    u32,
    u32,
    *const f32,
    *const i8,
    *const f32,
    *const f32,
    *const u32,
    *const u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    *mut f32,
    *mut u32,
) -> i32;
type Merge =
    unsafe extern "C" fn(u32, u32, *const f32, *const u32, u32, u32, *mut f32, *mut u32) -> i32;
type Failure = unsafe extern "C" fn() -> *const std::ffi::c_char;

/// The host build of the kernels, compiled once per test process.
fn emulation() -> &'static Library {
    static LIBRARY: OnceLock<Library> = OnceLock::new();
    LIBRARY.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("recsys_cuda_emulation_{}.so", std::process::id()));
        let cxx = std::env::var("RECSYS_CXX").unwrap_or_else(|_| "c++".into());
        let run = Command::new(&cxx)
            .args([
                "-std=c++17",
                "-O2",
                "-g",
                "-Wall",
                "-Werror",
                "-Wno-unknown-pragmas",
            ])
            .args(["-fPIC", "-shared", "-o"])
            .arg(&out)
            .arg(root.join("emulator/kernels.cpp"))
            .output()
            .unwrap_or_else(|e| {
                panic!("cannot run the C++ compiler {cxx:?} ({e}); set RECSYS_CXX")
            });
        assert!(
            run.status.success(),
            "the kernels do not compile as host C++:\n{}",
            String::from_utf8_lossy(&run.stderr)
        );
        // SAFETY: the library is ours, built just above; its initialisers only set up C++ globals.
        let library = unsafe { Library::new(&out) }.expect("loading the emulated kernels");
        // Mapped now; the file itself is not needed and would pile up run after run.
        let _ = std::fs::remove_file(&out);
        library
    })
}

fn symbol<T>(name: &[u8]) -> Symbol<'static, T> {
    // SAFETY: each name is looked up with the signature of its definition in emulator/kernels.cpp.
    unsafe { emulation().get(name) }.expect("symbol of the emulated kernels")
}

fn check(status: i32) {
    if status != 0 {
        let failure: Symbol<Failure> = symbol(b"recsys_emu_failure");
        // SAFETY: returns a NUL-terminated string owned by the library, valid until the next launch.
        let msg = unsafe { std::ffi::CStr::from_ptr(failure()) };
        panic!("emulated launch failed: {}", msg.to_string_lossy());
    }
}

/// The GPU path's top-k, run in the emulation: stage 1, then the merge passes of `merge_plan`.
fn emulated_topk(
    w: &Matrix,
    bias: &[f32],
    hidden: &[f32],
    k: usize,
    exclude: &[Vec<u32>],
) -> Vec<Ranked> {
    let (n, d, rows) = (w.rows(), w.cols(), exclude.len());
    let launch = stage1_launch(n, d, rows, k).unwrap();
    let plan = merge_plan(n, k);
    let refs: Vec<&[u32]> = exclude.iter().map(Vec::as_slice).collect();
    let (offsets, ids) = exclusion_csr(&refs);
    // Poisoned outputs: every slot the kernels should write starts as a value they never produce.
    let mut scores = vec![f32::NAN; rows * plan[0]];
    let mut index = vec![0xDEAD_BEEFu32; rows * plan[0]];
    let common_args = (
        rows as u32,
        launch.rows_per_block,
        n as u32,
        d as u32,
        launch.keep,
    );
    // SAFETY (all three): pointer arguments point at buffers of the sizes the kernel reads or
    // writes: hidden rows x d, weights n x d (+ n scales), bias n, offsets rows + 1, ids as the
    // offsets say, outputs rows x plan[0].
    let status = match w {
        Matrix::F32(t) => unsafe {
            symbol::<Stage1F32>(b"recsys_emu_score_tile_topk_f32")(
                launch.tiles,
                launch.groups,
                launch.shared_bytes,
                hidden.as_ptr(),
                t.as_slice().as_ptr(),
                bias.as_ptr(),
                offsets.as_ptr(),
                ids.as_ptr(),
                common_args.0,
                common_args.1,
                common_args.2,
                common_args.3,
                common_args.4,
                scores.as_mut_ptr(),
                index.as_mut_ptr(),
            )
        },
        Matrix::F16 { bits, start, .. } => unsafe {
            symbol::<Stage1F16>(b"recsys_emu_score_tile_topk_f16")(
                launch.tiles,
                launch.groups,
                launch.shared_bytes,
                hidden.as_ptr(),
                bits[start * d..].as_ptr(),
                bias.as_ptr(),
                offsets.as_ptr(),
                ids.as_ptr(),
                common_args.0,
                common_args.1,
                common_args.2,
                common_args.3,
                common_args.4,
                scores.as_mut_ptr(),
                index.as_mut_ptr(),
            )
        },
        Matrix::I8 {
            q, scales, start, ..
        } => unsafe {
            symbol::<Stage1I8>(b"recsys_emu_score_tile_topk_i8")(
                launch.tiles,
                launch.groups,
                launch.shared_bytes,
                hidden.as_ptr(),
                q[start * d..].as_ptr(),
                scales[*start..].as_ptr(),
                bias.as_ptr(),
                offsets.as_ptr(),
                ids.as_ptr(),
                common_args.0,
                common_args.1,
                common_args.2,
                common_args.3,
                common_args.4,
                scores.as_mut_ptr(),
                index.as_mut_ptr(),
            )
        },
    };
    check(status);
    assert!(
        scores.iter().all(|s| !s.is_nan()),
        "stage 1 left output slots unwritten"
    );
    for window in plan.windows(2) {
        let (count, next) = (window[0], window[1]);
        let mut next_scores = vec![f32::NAN; rows * next];
        let mut next_index = vec![0xDEAD_BEEFu32; rows * next];
        // SAFETY: inputs rows x count, outputs rows x next = rows x blocks x keep.
        let status = unsafe {
            symbol::<Merge>(b"recsys_emu_merge_topk")(
                count.div_ceil(TILE) as u32,
                rows as u32,
                scores.as_ptr(),
                index.as_ptr(),
                count as u32,
                launch.keep,
                next_scores.as_mut_ptr(),
                next_index.as_mut_ptr(),
            )
        };
        check(status);
        assert!(
            next_scores.iter().all(|s| !s.is_nan()),
            "a merge left output slots unwritten"
        );
        scores = next_scores;
        index = next_index;
    }
    ranked_rows(&scores, &index, &plan, rows, k)
}

fn check_against_reference(
    kind: &str,
    n: usize,
    d: usize,
    rows: usize,
    ks: &[usize],
    rng: &mut Rng,
) -> usize {
    let w = matrix(kind, n, d, rng);
    let bias: Vec<f32> = (0..n).map(|_| rng.uniform() * 0.1).collect();
    let hidden: Vec<f32> = (0..rows * d).map(|_| rng.uniform()).collect();
    let excluded = exclusions(rows, n, 50, rng);
    let mut checked = 0;
    for &k in ks {
        let got = emulated_topk(&w, &bias, &hidden, k, &excluded);
        assert_eq!(got.len(), rows);
        for r in 0..rows {
            let want = reference(&w, &bias, &hidden[r * d..(r + 1) * d], k, &excluded[r]);
            assert_row_matches(
                &got[r],
                &want,
                &format!("{kind} n={n} d={d} rows={rows} k={k} row {r}"),
            );
            checked += 1;
        }
    }
    checked
}

#[test]
fn fp32_kernels_match_the_reference_around_tile_edges() {
    let mut rng = Rng(0x5EED_0001);
    let mut checked = 0;
    // Below, at and just above one tile; 5 rows = a full group of 4 and a group of 1.
    for &(n, rows) in &[(2000usize, 1usize), (2048, 5), (2049, 3)] {
        checked += check_against_reference("f32", n, 64, rows, &[1, 10, 100], &mut rng);
    }
    assert!(checked > 0);
}

#[test]
fn fp16_and_int8_kernels_match_the_reference() {
    let mut rng = Rng(0x5EED_0002);
    check_against_reference("f16", 2049, 48, 4, &[10, 100], &mut rng);
    check_against_reference("i8", 2049, 40, 6, &[1, 10], &mut rng);
}

#[test]
fn k_1024_needs_merge_passes_and_is_exact() {
    let mut rng = Rng(0x5EED_0003);
    // Five tiles keep 1024 each; merge passes of three blocks, two blocks, then one.
    assert_eq!(
        merge_plan(9000, 1024),
        vec![5 * 1024, 3 * 1024, 2 * 1024, 1024]
    );
    check_against_reference("f32", 9000, 16, 2, &[1024], &mut rng);
}

#[test]
fn wide_hidden_vectors_use_smaller_row_groups() {
    let mut rng = Rng(0x5EED_0004);
    let launch = stage1_launch(2100, 1500, 3, 10).unwrap();
    assert_eq!(launch.rows_per_block, 1);
    check_against_reference("f32", 2100, 1500, 3, &[10], &mut rng);
}

#[test]
fn small_catalogues_and_heavy_exclusions_return_what_qualifies() {
    let mut rng = Rng(0x5EED_0005);
    // 40 items (39 real), k above the catalogue, and a row excluding almost everything.
    let w = matrix("f32", 40, 8, &mut rng);
    let bias = vec![0.0f32; 40];
    let hidden: Vec<f32> = (0..2 * 8).map(|_| rng.uniform()).collect();
    let excluded = vec![(0..38).collect::<Vec<u32>>(), vec![]];
    let got = emulated_topk(&w, &bias, &hidden, 100, &excluded);
    let mut left: Vec<u32> = got[0].iter().map(|p| p.0).collect();
    left.sort_unstable();
    assert_eq!(left, vec![38, 39]);
    assert_row_matches(
        &got[0],
        &reference(&w, &bias, &hidden[..8], 100, &excluded[0]),
        "row 0",
    );
    assert_eq!(got[1].len(), 39);
    assert_row_matches(
        &got[1],
        &reference(&w, &bias, &hidden[8..], 100, &[]),
        "row 1",
    );
}

#[test]
fn the_emulation_models_warp_shuffles_and_reports_divergent_barriers() {
    type Probe = unsafe extern "C" fn(*mut u32) -> i32;
    let mut sums = vec![0u32; 64];
    // SAFETY: the probe writes 64 values.
    check(unsafe { symbol::<Probe>(b"recsys_emu_probe_warp_sums")(sums.as_mut_ptr()) });
    assert!(sums.iter().all(|&s| s == 32 * 33 / 2), "{sums:?}");

    let mut out = vec![0u32; 128];
    // SAFETY: the probe writes at most 128 values.
    let status =
        unsafe { symbol::<Probe>(b"recsys_emu_probe_divergent_barrier")(out.as_mut_ptr()) };
    assert_eq!(status, 1);
    let failure: Symbol<Failure> = symbol(b"recsys_emu_failure");
    // SAFETY: a NUL-terminated string owned by the library (this thread's last launch).
    let msg = unsafe { std::ffi::CStr::from_ptr(failure()) }
        .to_string_lossy()
        .into_owned();
    assert!(
        msg.contains("divergent_barrier, block (0, 0, 0): divergent barrier"),
        "{msg}"
    );
}
