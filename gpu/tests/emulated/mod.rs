//! [`EmulatedDevice`]: the [`Device`] whose kernels are `kernels/*.cu` compiled as host C++ in
//! front of `emulator/cuda_emulation.hpp` (every CUDA thread a fiber; barriers and warp
//! primitives are scheduling points; divergent barriers are reported). Buffers are host vectors.
//! Beyond what a GPU checks, every launch asserts that its buffers are as large as the kernel
//! will index and that it wrote every slot of its output (outputs start poisoned), and the kernels
//! run under UBSan (out-of-bounds indexing of shared and local arrays aborts the test).
//!
//! Needs a C++17 compiler (`c++`, or the one named by RECSYS_CXX).
#![allow(dead_code)] // each test binary uses its own part

use std::ffi::{c_char, c_void, CStr};
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use libloading::{Library, Symbol};
use recsys_gpu::device::{
    AttentionArgs, BagArgs, Candidates, CandidatesMut, DenseArgs, Device, DeviceMatrix,
    GruGatesArgs, HstuAttentionArgs, NormArgs, Stage1Inputs, SurvivorsMut, Thresholds, TokenArgs,
};
use recsys_gpu::{
    gemm_grid, GemvLaunch, Result, ENCODER_SOURCE, LINEAR_TILE, MAX_ROWS, SOURCE, TILE,
};

/// What an alloc'd f32 / u32 output holds until a kernel writes it.
const POISON_U32: u32 = 0xDEAD_BEEF;

/// The host build of the kernels, compiled once per test process.
pub fn library() -> &'static Library {
    static LIBRARY: OnceLock<Library> = OnceLock::new();
    LIBRARY.get_or_init(|| {
        // The sources the CUDA path compiles are the ones built here.
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        for (file, embedded) in [("fused_topk.cu", SOURCE), ("encoders.cu", ENCODER_SOURCE)] {
            let on_disk = std::fs::read_to_string(root.join("kernels").join(file)).unwrap();
            assert_eq!(
                on_disk, embedded,
                "{file} changed since this test was built"
            );
        }
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("recsys_cuda_emulation_{}.so", std::process::id()));
        let cxx = std::env::var("RECSYS_CXX").unwrap_or_else(|_| "c++".into());
        // UBSan (linked into the library itself) stops at the first undefined behaviour: an
        // index past a fixed-size array (shared or local), a misaligned access, a shift too far.
        let run = Command::new(&cxx)
            .args(["-std=c++17", "-O2", "-g", "-Wall", "-Werror"])
            .args(["-Wno-unknown-pragmas", "-fsanitize=undefined,bounds"])
            .args([
                "-fno-sanitize-recover=all",
                "-static-libubsan",
                "-fno-strict-aliasing",
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

pub fn symbol<T>(name: &str) -> Symbol<'static, T> {
    // SAFETY: each name is looked up with the signature of its definition in emulator/kernels.cpp
    // (the aliases below).
    unsafe { library().get(name.as_bytes()) }
        .unwrap_or_else(|e| panic!("symbol {name} of the emulated kernels: {e}"))
}

/// The message of this thread's last failed launch.
pub fn last_failure() -> String {
    let failure: Symbol<unsafe extern "C" fn() -> *const c_char> = symbol("recsys_emu_failure");
    // SAFETY: a NUL-terminated string owned by the library, valid until this thread's next launch.
    unsafe { CStr::from_ptr(failure()) }
        .to_string_lossy()
        .into_owned()
}

pub fn check(status: i32) {
    if status != 0 {
        panic!("emulated launch failed: {}", last_failure());
    }
}

fn assert_len<T>(buffer: &[T], needed: usize, what: &str) {
    assert!(
        buffer.len() >= needed,
        "{what}: buffer of {} for {needed} values",
        buffer.len()
    );
}

/// Poisons the part of a (score, index) output a launch is about to write: kept buffers hold
/// an earlier batch's values, which would hide a slot the kernel fails to write.
fn poison(scores: &mut [f32], index: &mut [u32]) {
    scores.fill(f32::NAN);
    index.fill(POISON_U32);
}

fn assert_written(out: &[f32], what: &str) {
    assert!(
        out.iter().all(|v| !v.is_nan()),
        "{what} left output slots unwritten"
    );
}

/// Calls `recsys_emu_{prefix}_{f32,f16,i8}` (embed_tokens, embedding_bag) for `table`'s precision
/// over `blocks` blocks, after checking that the table holds `rows_used` rows of `width`.
fn table_entry(
    prefix: &str,
    table: &DeviceMatrix<EmulatedDevice>,
    rows_used: usize,
    width: usize,
    blocks: u32,
    (a, b, c, d): (P<u32>, P<u32>, P<f32>, M<f32>),
) -> i32 {
    let w = width as u32;
    // SAFETY (each arm): the entry points' C signatures (TableEntry / TableEntryI8); the table is
    // checked to hold every row the kernel reads, the other buffers by the caller.
    match table {
        // SAFETY: see above.
        DeviceMatrix::F32(tab) => unsafe {
            assert_len(tab, rows_used * width, "table");
            symbol::<TableEntry<f32>>(&format!("recsys_emu_{prefix}_f32"))(
                blocks,
                tab.as_ptr(),
                a,
                b,
                c,
                d,
                w,
            )
        },
        // SAFETY: see above.
        DeviceMatrix::F16(tab) => unsafe {
            assert_len(tab, rows_used * width, "table");
            symbol::<TableEntry<u16>>(&format!("recsys_emu_{prefix}_f16"))(
                blocks,
                tab.as_ptr(),
                a,
                b,
                c,
                d,
                w,
            )
        },
        // SAFETY: see above.
        DeviceMatrix::I8 { q, scales } => unsafe {
            assert_len(q, rows_used * width, "table");
            assert_len(scales, rows_used, "table scales");
            symbol::<TableEntryI8>(&format!("recsys_emu_{prefix}_i8"))(
                blocks,
                q.as_ptr(),
                scales.as_ptr(),
                a,
                b,
                c,
                d,
                w,
            )
        },
    }
}

/// Runs the kernels on this thread, on host memory.
#[derive(Default)]
pub struct EmulatedDevice {
    /// Added to every dense layer's outputs: a device that computes wrongly, for the tests of
    /// the load-time self-check. 0 for the faithful device.
    pub dense_layer_error: f32,
}

type P<T> = *const T;
type M<T> = *mut T;
/// score_tile_topk_{f32,f16} entry points (`T` the weights' element type, or c_void): grid x,
/// grid y, shared bytes, then the kernel's own parameters.
type Stage1<T> = unsafe extern "C" fn(
    u32,
    u32,
    u32,
    P<f32>,
    P<T>,
    P<f32>,
    P<u32>,
    P<u32>,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    M<f32>,
    M<u32>,
) -> i32;
/// sample_tile_topk_{f32,f16}: stage 1's parameters with the stride after keep.
type Sample<T> = unsafe extern "C" fn(
    u32,
    u32,
    u32,
    P<f32>,
    P<T>,
    P<f32>,
    P<u32>,
    P<u32>,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    M<f32>,
    M<u32>,
) -> i32;
/// The int8 variant, with the row scales and activation scale after the weights.
type SampleI8 = unsafe extern "C" fn(
    u32,
    u32,
    u32,
    P<f32>,
    P<i8>,
    P<f32>,
    f32,
    P<f32>,
    P<u32>,
    P<u32>,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    M<f32>,
    M<u32>,
) -> i32;
/// score_above_{f32,f16}: grid, shared bytes, hidden, weights, bias, exclusions, batch,
/// rows per block, n_items, dim, pitch, thresholds (buffer, pitch, at), capacity, counts, slots.
type Above<T> = unsafe extern "C" fn(
    u32,
    u32,
    u32,
    P<f32>,
    P<T>,
    P<f32>,
    P<u32>,
    P<u32>,
    u32,
    u32,
    u32,
    u32,
    u32,
    P<f32>,
    u32,
    u32,
    u32,
    M<u32>,
    M<f32>,
    M<u32>,
) -> i32;
/// The int8 variant, with the row scales and activation scale after the weights.
type AboveI8 = unsafe extern "C" fn(
    u32,
    u32,
    u32,
    P<f32>,
    P<i8>,
    P<f32>,
    f32,
    P<f32>,
    P<u32>,
    P<u32>,
    u32,
    u32,
    u32,
    u32,
    u32,
    P<f32>,
    u32,
    u32,
    u32,
    M<u32>,
    M<f32>,
    M<u32>,
) -> i32;

/// gemv_sample_{f32,f16}: blocks, shared bytes, hidden, weights, bias, exclusions, batch,
/// n_items, dim, pitch, lanes, stride, positions, outputs.
type GemvSample<T> = unsafe extern "C" fn(
    u32,
    u32,
    P<f32>,
    P<T>,
    P<f32>,
    P<u32>,
    P<u32>,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    M<f32>,
    M<u32>,
) -> i32;
/// The int8 variant, with the row scales and activation scale after the weights.
type GemvSampleI8 = unsafe extern "C" fn(
    u32,
    u32,
    P<f32>,
    P<i8>,
    P<f32>,
    f32,
    P<f32>,
    P<u32>,
    P<u32>,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    M<f32>,
    M<u32>,
) -> i32;
/// gemv_above_{f32,f16}: blocks, shared bytes, hidden, weights, bias, exclusions, batch,
/// n_items, dim, pitch, lanes, thresholds (buffer, pitch, at), capacity, counts, slots.
type GemvAbove<T> = unsafe extern "C" fn(
    u32,
    u32,
    P<f32>,
    P<T>,
    P<f32>,
    P<u32>,
    P<u32>,
    u32,
    u32,
    u32,
    u32,
    u32,
    P<f32>,
    u32,
    u32,
    u32,
    M<u32>,
    M<f32>,
    M<u32>,
) -> i32;
/// The int8 variant, with the row scales and activation scale after the weights.
type GemvAboveI8 = unsafe extern "C" fn(
    u32,
    u32,
    P<f32>,
    P<i8>,
    P<f32>,
    f32,
    P<f32>,
    P<u32>,
    P<u32>,
    u32,
    u32,
    u32,
    u32,
    u32,
    P<f32>,
    u32,
    u32,
    u32,
    M<u32>,
    M<f32>,
    M<u32>,
) -> i32;

/// gemm_sample_{f32,f16}: grid x, grid y, hidden, weights, bias, exclusions, batch, n_items,
/// dim, pitch, stride, positions, outputs.
type GemmSample<T> = unsafe extern "C" fn(
    u32,
    u32,
    P<f32>,
    P<T>,
    P<f32>,
    P<u32>,
    P<u32>,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    M<f32>,
    M<u32>,
) -> i32;
/// The int8 variant, with the row scales and activation scale after the weights.
type GemmSampleI8 = unsafe extern "C" fn(
    u32,
    u32,
    P<f32>,
    P<i8>,
    P<f32>,
    f32,
    P<f32>,
    P<u32>,
    P<u32>,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    M<f32>,
    M<u32>,
) -> i32;
/// gemm_above_{f32,f16}: grid x, grid y, hidden, weights, bias, exclusions, batch, n_items, dim,
/// pitch, thresholds (buffer, pitch, at), capacity, counts, slots.
type GemmAbove<T> = unsafe extern "C" fn(
    u32,
    u32,
    P<f32>,
    P<T>,
    P<f32>,
    P<u32>,
    P<u32>,
    u32,
    u32,
    u32,
    u32,
    P<f32>,
    u32,
    u32,
    u32,
    M<u32>,
    M<f32>,
    M<u32>,
) -> i32;
/// The int8 variant, with the row scales and activation scale after the weights.
type GemmAboveI8 = unsafe extern "C" fn(
    u32,
    u32,
    P<f32>,
    P<i8>,
    P<f32>,
    f32,
    P<f32>,
    P<u32>,
    P<u32>,
    u32,
    u32,
    u32,
    u32,
    P<f32>,
    u32,
    u32,
    u32,
    M<u32>,
    M<f32>,
    M<u32>,
) -> i32;

/// Checks that `positions` positions of `stride` cover `n_items` items once.
fn check_sample_positions(positions: u32, stride: u32, n_items: u32) {
    let (p, s, n) = (positions as usize, stride as usize, n_items as usize);
    assert!(
        p * s >= n && (p - 1) * s < n,
        "{p} positions of stride {s} do not cover {n} items once"
    );
}

/// Blocks the emulation runs the coalesced scans' grid with: few, so that their grid-stride loop
/// goes round a test's catalogue many times, as it does on a device with a large catalogue.
pub const EMULATED_GEMV_BLOCKS: u32 = 3;

/// Checks what the coalesced scans add to [`scan_inputs`]' checks: a batch they take, lanes a
/// power of two within a warp, and shared memory for the batch's hidden rows at the pitch.
fn check_gemv(a: &Stage1Inputs<'_, EmulatedDevice>, gemv: &GemvLaunch) {
    assert!(
        (1..=MAX_ROWS as u32).contains(&a.batch),
        "a batch of {} rows",
        a.batch
    );
    assert!(gemv.lanes.is_power_of_two() && gemv.lanes <= 32, "{gemv:?}");
    assert!(
        gemv.shared_bytes >= 4 * a.launch.pitch * a.batch,
        "{gemv:?}"
    );
}

/// Checks the inputs every scan kernel reads (hidden rows, bias, exclusions, the weights at the
/// launch's pitch) and returns the weights' pointer with the int8 extras.
fn scan_inputs(a: &Stage1Inputs<'_, EmulatedDevice>) -> (*const c_void, Option<(P<f32>, f32)>) {
    let (b, n, d) = (a.batch as usize, a.n_items as usize, a.dim as usize);
    assert_len(a.hidden, b * d, "hidden");
    assert_len(a.bias, n, "bias");
    assert_len(a.exclude_offsets, b + 1, "exclusion offsets");
    assert_len(a.exclude_ids, a.exclude_offsets[b] as usize, "exclusions");
    assert!(a.launch.groups * a.launch.rows_per_block >= a.batch);
    let rows = n * a.launch.pitch as usize;
    match a.weights {
        DeviceMatrix::F32(w) => {
            assert_len(w, rows, "weights");
            (w.as_ptr().cast(), None)
        }
        DeviceMatrix::F16(w) => {
            assert_len(w, rows, "weights");
            (w.as_ptr().cast(), None)
        }
        DeviceMatrix::I8 { q, scales } => {
            assert_len(q, rows, "weights");
            assert_len(scales, n, "row scales");
            (
                q.as_ptr().cast(),
                Some((scales.as_ptr(), a.activation_scale)),
            )
        }
    }
}

/// The entry point of `prefix` for the weights' precision.
fn scan_entry(prefix: &str, weights: &DeviceMatrix<EmulatedDevice>) -> String {
    let suffix = match weights {
        DeviceMatrix::F32(_) => "f32",
        DeviceMatrix::F16(_) => "f16",
        DeviceMatrix::I8 { .. } => "i8",
    };
    format!("recsys_emu_{prefix}_{suffix}")
}

/// embed_tokens_* / embedding_bag_* entry points: blocks, table, four buffers, width.
type TableEntry<T> = unsafe extern "C" fn(u32, P<T>, P<u32>, P<u32>, P<f32>, M<f32>, u32) -> i32;
/// The int8 variants, with the table's row scales.
type TableEntryI8 =
    unsafe extern "C" fn(u32, P<i8>, P<f32>, P<u32>, P<u32>, P<f32>, M<f32>, u32) -> i32;

impl Device for EmulatedDevice {
    type F32 = Vec<f32>;
    type U32 = Vec<u32>;
    type U16 = Vec<u16>;
    type I8 = Vec<i8>;

    fn upload_f32(&self, values: &[f32]) -> Result<Vec<f32>> {
        Ok(values.to_vec())
    }
    fn upload_u32(&self, values: &[u32]) -> Result<Vec<u32>> {
        Ok(values.to_vec())
    }
    fn upload_u16(&self, values: &[u16]) -> Result<Vec<u16>> {
        Ok(values.to_vec())
    }
    fn upload_i8(&self, values: &[i8]) -> Result<Vec<i8>> {
        Ok(values.to_vec())
    }
    fn alloc_f32(&self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![f32::NAN; len])
    }
    fn alloc_u32(&self, len: usize) -> Result<Vec<u32>> {
        Ok(vec![POISON_U32; len])
    }
    fn upload_u32_into(&self, values: &[u32], dst: &mut Vec<u32>) -> Result<()> {
        assert_len(dst, values.len(), "a kept input buffer");
        dst[..values.len()].copy_from_slice(values);
        Ok(())
    }
    fn download_f32(&self, buffer: &Vec<f32>, len: usize) -> Result<Vec<f32>> {
        assert_len(buffer, len, "a download");
        Ok(buffer[..len].to_vec())
    }
    fn download_u32(&self, buffer: &Vec<u32>, len: usize) -> Result<Vec<u32>> {
        assert_len(buffer, len, "a download");
        Ok(buffer[..len].to_vec())
    }

    fn score_tile_topk(
        &self,
        a: &Stage1Inputs<'_, Self>,
        out: CandidatesMut<'_, Self>,
    ) -> Result<()> {
        let Stage1Inputs {
            launch,
            hidden,
            weights,
            activation_scale,
            bias,
            exclude_offsets,
            exclude_ids,
            batch,
            n_items,
            dim,
        } = *a;
        let (out_scores, out_index) = (out.scores, out.index);
        let (b, n, d) = (batch as usize, n_items as usize, dim as usize);
        assert_len(hidden, b * d, "hidden");
        assert_len(bias, n, "bias");
        assert_len(exclude_offsets, b + 1, "exclusion offsets");
        assert_len(exclude_ids, exclude_offsets[b] as usize, "exclusions");
        let out = b * launch.tiles as usize * launch.keep as usize;
        assert_len(out_scores, out, "stage-1 scores");
        assert_len(out_index, out, "stage-1 indices");
        poison(&mut out_scores[..out], &mut out_index[..out]);
        assert!(launch.groups * launch.rows_per_block >= batch);
        let ((gx, gy), sh) = (launch.grid(), launch.shared_bytes);
        let (rpb, keep) = (launch.rows_per_block, launch.keep);
        let (os, oi) = (out_scores.as_mut_ptr(), out_index.as_mut_ptr());
        let (eo, ei) = (exclude_offsets.as_ptr(), exclude_ids.as_ptr());
        // SAFETY (each arm): the arguments match the entry point's C signature in
        // emulator/kernels.cpp, and every buffer was checked above to be as large as the kernel
        // indexes it.
        // The f32 and f16 entry points differ only in the weights' element type.
        let plain = match weights {
            DeviceMatrix::F32(w) => {
                assert_len(w, n * launch.pitch as usize, "weights");
                Some((
                    "recsys_emu_score_tile_topk_f32",
                    w.as_ptr().cast::<c_void>(),
                ))
            }
            DeviceMatrix::F16(w) => {
                assert_len(w, n * launch.pitch as usize, "weights");
                Some((
                    "recsys_emu_score_tile_topk_f16",
                    w.as_ptr().cast::<c_void>(),
                ))
            }
            DeviceMatrix::I8 { .. } => None,
        };
        let status = match weights {
            // SAFETY: see above.
            DeviceMatrix::F32(_) | DeviceMatrix::F16(_) => unsafe {
                let (name, w) = plain.expect("f32 or f16 weights");
                symbol::<Stage1<c_void>>(name)(
                    gx,
                    gy,
                    sh,
                    hidden.as_ptr(),
                    w,
                    bias.as_ptr(),
                    eo,
                    ei,
                    batch,
                    rpb,
                    n_items,
                    dim,
                    launch.pitch,
                    keep,
                    os,
                    oi,
                )
            },
            // SAFETY: see above.
            DeviceMatrix::I8 { q, scales } => unsafe {
                assert_len(q, n * launch.pitch as usize, "weights");
                assert_len(scales, n, "row scales");
                type F = unsafe extern "C" fn(
                    u32,
                    u32,
                    u32,
                    P<f32>,
                    P<i8>,
                    P<f32>,
                    f32,
                    P<f32>,
                    P<u32>,
                    P<u32>,
                    u32,
                    u32,
                    u32,
                    u32,
                    u32,
                    u32,
                    M<f32>,
                    M<u32>,
                ) -> i32;
                symbol::<F>("recsys_emu_score_tile_topk_i8")(
                    gx,
                    gy,
                    sh,
                    hidden.as_ptr(),
                    q.as_ptr(),
                    scales.as_ptr(),
                    activation_scale,
                    bias.as_ptr(),
                    eo,
                    ei,
                    batch,
                    rpb,
                    n_items,
                    dim,
                    launch.pitch,
                    keep,
                    os,
                    oi,
                )
            },
        };
        check(status);
        assert_written(&out_scores[..out], "stage 1");
        assert!(
            out_index[..out].iter().all(|&i| i != POISON_U32),
            "stage 1 left indices unwritten"
        );
        Ok(())
    }

    fn sample_tile_topk(
        &self,
        a: &Stage1Inputs<'_, Self>,
        stride: u32,
        out: CandidatesMut<'_, Self>,
    ) -> Result<()> {
        let (weights, int8) = scan_inputs(a);
        let launch = a.launch;
        let out_len = a.batch as usize * launch.tiles as usize * launch.keep as usize;
        assert_len(out.scores, out_len, "sample scores");
        assert_len(out.index, out_len, "sample indices");
        poison(&mut out.scores[..out_len], &mut out.index[..out_len]);
        let positions = (launch.tiles as usize) * TILE;
        assert!(
            (positions - TILE) * stride as usize <= a.n_items as usize,
            "a whole tile of the sample past the catalogue"
        );
        let ((gx, gy), sh) = (launch.grid(), launch.shared_bytes);
        let name = scan_entry("sample_tile_topk", a.weights);
        let (os, oi) = (out.scores.as_mut_ptr(), out.index.as_mut_ptr());
        let (eo, ei) = (a.exclude_offsets.as_ptr(), a.exclude_ids.as_ptr());
        // SAFETY: the arguments match the entry point's C signature in emulator/kernels.cpp
        // (Sample / SampleI8), and every buffer was checked above to be as large as the kernel
        // indexes it.
        let status = unsafe {
            match int8 {
                None => symbol::<Sample<c_void>>(&name)(
                    gx,
                    gy,
                    sh,
                    a.hidden.as_ptr(),
                    weights,
                    a.bias.as_ptr(),
                    eo,
                    ei,
                    a.batch,
                    launch.rows_per_block,
                    a.n_items,
                    a.dim,
                    launch.pitch,
                    launch.keep,
                    stride,
                    os,
                    oi,
                ),
                Some((scales, activation)) => symbol::<SampleI8>(&name)(
                    gx,
                    gy,
                    sh,
                    a.hidden.as_ptr(),
                    weights.cast(),
                    scales,
                    activation,
                    a.bias.as_ptr(),
                    eo,
                    ei,
                    a.batch,
                    launch.rows_per_block,
                    a.n_items,
                    a.dim,
                    launch.pitch,
                    launch.keep,
                    stride,
                    os,
                    oi,
                ),
            }
        };
        check(status);
        assert_written(&out.scores[..out_len], "the sample's stage 1");
        assert!(
            out.index[..out_len].iter().all(|&i| i != POISON_U32),
            "the sample's stage 1 left indices unwritten"
        );
        Ok(())
    }

    fn reset_survivors(&self, rows: u32, survivors: SurvivorsMut<'_, Self>) -> Result<()> {
        let SurvivorsMut {
            counts,
            scores,
            index,
            capacity,
        } = survivors;
        let slots = rows as usize * capacity as usize;
        assert_len(counts, rows as usize, "survivor counts");
        assert_len(scores, slots, "survivor scores");
        assert_len(index, slots, "survivor indices");
        poison(&mut scores[..slots], &mut index[..slots]);
        counts[..rows as usize].fill(POISON_U32);
        type F = unsafe extern "C" fn(u32, M<u32>, M<f32>, M<u32>, u32) -> i32;
        // SAFETY: the signature of recsys_emu_reset_survivors; buffer sizes checked above.
        check(unsafe {
            symbol::<F>("recsys_emu_reset_survivors")(
                rows,
                counts.as_mut_ptr(),
                scores.as_mut_ptr(),
                index.as_mut_ptr(),
                capacity,
            )
        });
        assert_written(&scores[..slots], "reset_survivors");
        Ok(())
    }

    fn score_above(
        &self,
        a: &Stage1Inputs<'_, Self>,
        thresholds: Thresholds<'_, Self>,
        survivors: SurvivorsMut<'_, Self>,
    ) -> Result<()> {
        let (weights, int8) = scan_inputs(a);
        let launch = a.launch;
        let b = a.batch as usize;
        assert!(thresholds.at < thresholds.pitch, "the threshold's column");
        assert_len(
            thresholds.scores,
            b * thresholds.pitch as usize,
            "thresholds",
        );
        let SurvivorsMut {
            counts,
            scores,
            index,
            capacity,
        } = survivors;
        assert_len(counts, b, "survivor counts");
        assert_len(scores, b * capacity as usize, "survivor scores");
        assert_len(index, b * capacity as usize, "survivor indices");
        let ((gx, gy), sh) = (launch.grid(), launch.shared_bytes);
        let name = scan_entry("score_above", a.weights);
        let (eo, ei) = (a.exclude_offsets.as_ptr(), a.exclude_ids.as_ptr());
        let (t, tp, ta) = (thresholds.scores.as_ptr(), thresholds.pitch, thresholds.at);
        let (c, os, oi) = (counts.as_mut_ptr(), scores.as_mut_ptr(), index.as_mut_ptr());
        // SAFETY: the arguments match the entry point's C signature in emulator/kernels.cpp
        // (Above / AboveI8), and every buffer was checked above to be as large as the kernel
        // indexes it (slots past the capacity are never written).
        let status = unsafe {
            match int8 {
                None => symbol::<Above<c_void>>(&name)(
                    gx,
                    gy,
                    sh,
                    a.hidden.as_ptr(),
                    weights,
                    a.bias.as_ptr(),
                    eo,
                    ei,
                    a.batch,
                    launch.rows_per_block,
                    a.n_items,
                    a.dim,
                    launch.pitch,
                    t,
                    tp,
                    ta,
                    capacity,
                    c,
                    os,
                    oi,
                ),
                Some((row_scales, activation)) => symbol::<AboveI8>(&name)(
                    gx,
                    gy,
                    sh,
                    a.hidden.as_ptr(),
                    weights.cast(),
                    row_scales,
                    activation,
                    a.bias.as_ptr(),
                    eo,
                    ei,
                    a.batch,
                    launch.rows_per_block,
                    a.n_items,
                    a.dim,
                    launch.pitch,
                    t,
                    tp,
                    ta,
                    capacity,
                    c,
                    os,
                    oi,
                ),
            }
        };
        check(status);
        Ok(())
    }

    fn gemv_resident_blocks(
        &self,
        _weights: &DeviceMatrix<Self>,
        _shared_bytes: u32,
    ) -> Result<u32> {
        Ok(EMULATED_GEMV_BLOCKS)
    }

    fn gemv_sample(
        &self,
        a: &Stage1Inputs<'_, Self>,
        gemv: &GemvLaunch,
        stride: u32,
        positions: u32,
        out: CandidatesMut<'_, Self>,
    ) -> Result<()> {
        let (weights, int8) = scan_inputs(a);
        check_gemv(a, gemv);
        check_sample_positions(positions, stride, a.n_items);
        let out_len = a.batch as usize * positions as usize;
        assert_len(out.scores, out_len, "sample scores");
        assert_len(out.index, out_len, "sample indices");
        poison(&mut out.scores[..out_len], &mut out.index[..out_len]);
        let name = scan_entry("gemv_sample", a.weights);
        let (os, oi) = (out.scores.as_mut_ptr(), out.index.as_mut_ptr());
        let (eo, ei) = (a.exclude_offsets.as_ptr(), a.exclude_ids.as_ptr());
        let (blocks, sh, pitch) = (gemv.blocks, gemv.shared_bytes, a.launch.pitch);
        // SAFETY: the arguments match the entry point's C signature in emulator/kernels.cpp
        // (GemvSample / GemvSampleI8), and every buffer was checked above to be as large as the
        // kernel indexes it.
        let status = unsafe {
            match int8 {
                None => symbol::<GemvSample<c_void>>(&name)(
                    blocks,
                    sh,
                    a.hidden.as_ptr(),
                    weights,
                    a.bias.as_ptr(),
                    eo,
                    ei,
                    a.batch,
                    a.n_items,
                    a.dim,
                    pitch,
                    gemv.lanes,
                    stride,
                    positions,
                    os,
                    oi,
                ),
                Some((scales, activation)) => symbol::<GemvSampleI8>(&name)(
                    blocks,
                    sh,
                    a.hidden.as_ptr(),
                    weights.cast(),
                    scales,
                    activation,
                    a.bias.as_ptr(),
                    eo,
                    ei,
                    a.batch,
                    a.n_items,
                    a.dim,
                    pitch,
                    gemv.lanes,
                    stride,
                    positions,
                    os,
                    oi,
                ),
            }
        };
        check(status);
        assert_written(&out.scores[..out_len], "the coalesced sample");
        assert!(
            out.index[..out_len].iter().all(|&i| i != POISON_U32),
            "the coalesced sample left indices unwritten"
        );
        Ok(())
    }

    fn gemv_above(
        &self,
        a: &Stage1Inputs<'_, Self>,
        gemv: &GemvLaunch,
        thresholds: Thresholds<'_, Self>,
        survivors: SurvivorsMut<'_, Self>,
    ) -> Result<()> {
        let (weights, int8) = scan_inputs(a);
        check_gemv(a, gemv);
        let b = a.batch as usize;
        assert!(thresholds.at < thresholds.pitch, "the threshold's column");
        assert_len(
            thresholds.scores,
            b * thresholds.pitch as usize,
            "thresholds",
        );
        let SurvivorsMut {
            counts,
            scores,
            index,
            capacity,
        } = survivors;
        assert_len(counts, b, "survivor counts");
        assert_len(scores, b * capacity as usize, "survivor scores");
        assert_len(index, b * capacity as usize, "survivor indices");
        let name = scan_entry("gemv_above", a.weights);
        let (eo, ei) = (a.exclude_offsets.as_ptr(), a.exclude_ids.as_ptr());
        let (t, tp, ta) = (thresholds.scores.as_ptr(), thresholds.pitch, thresholds.at);
        let (c, os, oi) = (counts.as_mut_ptr(), scores.as_mut_ptr(), index.as_mut_ptr());
        let (blocks, sh, pitch) = (gemv.blocks, gemv.shared_bytes, a.launch.pitch);
        // SAFETY: the arguments match the entry point's C signature in emulator/kernels.cpp
        // (GemvAbove / GemvAboveI8), and every buffer was checked above to be as large as the
        // kernel indexes it (slots past the capacity are never written).
        let status = unsafe {
            match int8 {
                None => symbol::<GemvAbove<c_void>>(&name)(
                    blocks,
                    sh,
                    a.hidden.as_ptr(),
                    weights,
                    a.bias.as_ptr(),
                    eo,
                    ei,
                    a.batch,
                    a.n_items,
                    a.dim,
                    pitch,
                    gemv.lanes,
                    t,
                    tp,
                    ta,
                    capacity,
                    c,
                    os,
                    oi,
                ),
                Some((row_scales, activation)) => symbol::<GemvAboveI8>(&name)(
                    blocks,
                    sh,
                    a.hidden.as_ptr(),
                    weights.cast(),
                    row_scales,
                    activation,
                    a.bias.as_ptr(),
                    eo,
                    ei,
                    a.batch,
                    a.n_items,
                    a.dim,
                    pitch,
                    gemv.lanes,
                    t,
                    tp,
                    ta,
                    capacity,
                    c,
                    os,
                    oi,
                ),
            }
        };
        check(status);
        Ok(())
    }

    fn gemm_sample(
        &self,
        a: &Stage1Inputs<'_, Self>,
        stride: u32,
        positions: u32,
        out: CandidatesMut<'_, Self>,
    ) -> Result<()> {
        let (weights, int8) = scan_inputs(a);
        check_sample_positions(positions, stride, a.n_items);
        let out_len = a.batch as usize * positions as usize;
        assert_len(out.scores, out_len, "sample scores");
        assert_len(out.index, out_len, "sample indices");
        poison(&mut out.scores[..out_len], &mut out.index[..out_len]);
        let name = scan_entry("gemm_sample", a.weights);
        let (os, oi) = (out.scores.as_mut_ptr(), out.index.as_mut_ptr());
        let (eo, ei) = (a.exclude_offsets.as_ptr(), a.exclude_ids.as_ptr());
        let ((gx, gy), pitch) = (gemm_grid(positions, a.batch), a.launch.pitch);
        // SAFETY: the arguments match the entry point's C signature in emulator/kernels.cpp
        // (GemmSample / GemmSampleI8), and every buffer was checked above to be as large as the
        // kernel indexes it.
        let status = unsafe {
            match int8 {
                None => symbol::<GemmSample<c_void>>(&name)(
                    gx,
                    gy,
                    a.hidden.as_ptr(),
                    weights,
                    a.bias.as_ptr(),
                    eo,
                    ei,
                    a.batch,
                    a.n_items,
                    a.dim,
                    pitch,
                    stride,
                    positions,
                    os,
                    oi,
                ),
                Some((scales, activation)) => symbol::<GemmSampleI8>(&name)(
                    gx,
                    gy,
                    a.hidden.as_ptr(),
                    weights.cast(),
                    scales,
                    activation,
                    a.bias.as_ptr(),
                    eo,
                    ei,
                    a.batch,
                    a.n_items,
                    a.dim,
                    pitch,
                    stride,
                    positions,
                    os,
                    oi,
                ),
            }
        };
        check(status);
        assert_written(&out.scores[..out_len], "the tiled sample");
        assert!(
            out.index[..out_len].iter().all(|&i| i != POISON_U32),
            "the tiled sample left indices unwritten"
        );
        Ok(())
    }

    fn gemm_above(
        &self,
        a: &Stage1Inputs<'_, Self>,
        thresholds: Thresholds<'_, Self>,
        survivors: SurvivorsMut<'_, Self>,
    ) -> Result<()> {
        let (weights, int8) = scan_inputs(a);
        let b = a.batch as usize;
        assert!(thresholds.at < thresholds.pitch, "the threshold's column");
        assert_len(
            thresholds.scores,
            b * thresholds.pitch as usize,
            "thresholds",
        );
        let SurvivorsMut {
            counts,
            scores,
            index,
            capacity,
        } = survivors;
        assert_len(counts, b, "survivor counts");
        assert_len(scores, b * capacity as usize, "survivor scores");
        assert_len(index, b * capacity as usize, "survivor indices");
        let name = scan_entry("gemm_above", a.weights);
        let (eo, ei) = (a.exclude_offsets.as_ptr(), a.exclude_ids.as_ptr());
        let (t, tp, ta) = (thresholds.scores.as_ptr(), thresholds.pitch, thresholds.at);
        let (c, os, oi) = (counts.as_mut_ptr(), scores.as_mut_ptr(), index.as_mut_ptr());
        let ((gx, gy), pitch) = (gemm_grid(a.n_items, a.batch), a.launch.pitch);
        // SAFETY: the arguments match the entry point's C signature in emulator/kernels.cpp
        // (GemmAbove / GemmAboveI8), and every buffer was checked above to be as large as the
        // kernel indexes it (slots past the capacity are never written).
        let status = unsafe {
            match int8 {
                None => symbol::<GemmAbove<c_void>>(&name)(
                    gx,
                    gy,
                    a.hidden.as_ptr(),
                    weights,
                    a.bias.as_ptr(),
                    eo,
                    ei,
                    a.batch,
                    a.n_items,
                    a.dim,
                    pitch,
                    t,
                    tp,
                    ta,
                    capacity,
                    c,
                    os,
                    oi,
                ),
                Some((row_scales, activation)) => symbol::<GemmAboveI8>(&name)(
                    gx,
                    gy,
                    a.hidden.as_ptr(),
                    weights.cast(),
                    row_scales,
                    activation,
                    a.bias.as_ptr(),
                    eo,
                    ei,
                    a.batch,
                    a.n_items,
                    a.dim,
                    pitch,
                    t,
                    tp,
                    ta,
                    capacity,
                    c,
                    os,
                    oi,
                ),
            }
        };
        check(status);
        Ok(())
    }

    fn sample_threshold(
        &self,
        rows: u32,
        sample: &Vec<f32>,
        count: u32,
        k: u32,
        thresholds: &mut Vec<f32>,
        survivors: SurvivorsMut<'_, Self>,
    ) -> Result<()> {
        let (r, n) = (rows as usize, count as usize);
        let SurvivorsMut {
            counts,
            scores,
            index,
            capacity,
        } = survivors;
        let slots = r * capacity as usize;
        assert_len(sample, r * n, "sampled scores");
        assert_len(thresholds, r, "thresholds");
        assert_len(counts, r, "survivor counts");
        assert_len(scores, slots, "survivor scores");
        assert_len(index, slots, "survivor indices");
        poison(&mut scores[..slots], &mut index[..slots]);
        counts[..r].fill(POISON_U32);
        thresholds[..r].fill(f32::NAN);
        type F =
            unsafe extern "C" fn(u32, P<f32>, u32, u32, M<f32>, M<u32>, M<f32>, M<u32>, u32) -> i32;
        // SAFETY: the signature of recsys_emu_sample_threshold; buffer sizes checked above.
        check(unsafe {
            symbol::<F>("recsys_emu_sample_threshold")(
                rows,
                sample.as_ptr(),
                count,
                k,
                thresholds.as_mut_ptr(),
                counts.as_mut_ptr(),
                scores.as_mut_ptr(),
                index.as_mut_ptr(),
                capacity,
            )
        });
        assert_written(&thresholds[..r], "the sample's thresholds");
        assert_written(&scores[..slots], "the survivors' reset");
        Ok(())
    }

    fn finalize_survivors(
        &self,
        rows: u32,
        counts: &mut Vec<u32>,
        survivors: Candidates<'_, Self>,
        capacity: u32,
        k: u32,
        out: CandidatesMut<'_, Self>,
    ) -> Result<()> {
        let (r, c, k_) = (rows as usize, capacity as usize, k as usize);
        assert_len(counts, r, "survivor counts");
        assert_len(survivors.scores, r * c, "survivor scores");
        assert_len(survivors.index, r * c, "survivor indices");
        assert_len(out.scores, r * k_, "finished scores");
        assert_len(out.index, r * k_, "finished indices");
        poison(&mut out.scores[..r * k_], &mut out.index[..r * k_]);
        type F = unsafe extern "C" fn(u32, M<u32>, P<f32>, P<u32>, u32, u32, M<f32>, M<u32>) -> i32;
        // SAFETY: the signature of recsys_emu_finalize_survivors; buffer sizes checked above.
        check(unsafe {
            symbol::<F>("recsys_emu_finalize_survivors")(
                rows,
                counts.as_mut_ptr(),
                survivors.scores.as_ptr(),
                survivors.index.as_ptr(),
                capacity,
                k,
                out.scores.as_mut_ptr(),
                out.index.as_mut_ptr(),
            )
        });
        assert_written(&out.scores[..r * k_], "the survivors' finish");
        Ok(())
    }

    fn merge_topk(
        &self,
        rows: u32,
        input: Candidates<'_, Self>,
        count: u32,
        keep: u32,
        out: CandidatesMut<'_, Self>,
    ) -> Result<()> {
        let (in_scores, in_index) = (input.scores, input.index);
        let (out_scores, out_index) = (out.scores, out.index);
        let blocks = (count as usize).div_ceil(TILE);
        let (r, c) = (rows as usize, count as usize);
        assert_len(in_scores, r * c, "merge input");
        assert_len(in_index, r * c, "merge input");
        let out = r * blocks * keep as usize;
        assert_len(out_scores, out, "merge output");
        assert_len(out_index, out, "merge output");
        poison(&mut out_scores[..out], &mut out_index[..out]);
        type F = unsafe extern "C" fn(u32, u32, P<f32>, P<u32>, u32, u32, M<f32>, M<u32>) -> i32;
        // SAFETY: the signature of recsys_emu_merge_topk; buffer sizes checked above.
        check(unsafe {
            symbol::<F>("recsys_emu_merge_topk")(
                blocks as u32,
                rows,
                in_scores.as_ptr(),
                in_index.as_ptr(),
                count,
                keep,
                out_scores.as_mut_ptr(),
                out_index.as_mut_ptr(),
            )
        });
        assert_written(&out_scores[..out], "a merge pass");
        Ok(())
    }

    fn linear(&self, x: &Self::F32, layer: &DenseArgs<'_, Self>, y: &mut Self::F32) -> Result<()> {
        let DenseArgs {
            weight,
            bias,
            m,
            n,
            k,
            activation,
        } = *layer;
        let (mu, nu, ku) = (m as usize, n as usize, k as usize);
        assert_len(x, mu * ku, "dense input");
        assert_len(weight, nu * ku, "dense weight");
        assert_len(bias, nu, "dense bias");
        assert_len(y, mu * nu, "dense output");
        type F = unsafe extern "C" fn(
            u32,
            u32,
            P<f32>,
            P<f32>,
            P<f32>,
            M<f32>,
            u32,
            u32,
            u32,
            u32,
        ) -> i32;
        // SAFETY: the signature of recsys_emu_linear_f32; buffer sizes checked above.
        check(unsafe {
            symbol::<F>("recsys_emu_linear_f32")(
                n.div_ceil(LINEAR_TILE),
                m.div_ceil(LINEAR_TILE),
                x.as_ptr(),
                weight.as_ptr(),
                bias.as_ptr(),
                y.as_mut_ptr(),
                m,
                n,
                k,
                activation as u32,
            )
        });
        assert_written(&y[..mu * nu], "linear_f32");
        if self.dense_layer_error != 0.0 {
            y[..mu * nu]
                .iter_mut()
                .for_each(|v| *v += self.dense_layer_error);
        }
        Ok(())
    }

    fn add_layer_norm(
        &self,
        x: &Self::F32,
        residual: Option<&Self::F32>,
        norm: &NormArgs<'_, Self>,
        y: &mut Self::F32,
    ) -> Result<()> {
        let NormArgs {
            gamma,
            beta,
            rows,
            width,
            eps,
        } = *norm;
        let size = rows as usize * width as usize;
        assert_len(x, size, "norm input");
        if let Some(r) = residual {
            assert_len(r, size, "residual");
        }
        assert_len(gamma, width as usize, "gamma");
        assert_len(beta, width as usize, "beta");
        assert_len(y, size, "norm output");
        type F = unsafe extern "C" fn(u32, P<f32>, P<f32>, P<f32>, P<f32>, M<f32>, u32, f64) -> i32;
        // SAFETY: the signature of recsys_emu_add_layer_norm; buffer sizes checked above; a
        // missing residual is a null pointer, as the kernel expects.
        check(unsafe {
            symbol::<F>("recsys_emu_add_layer_norm")(
                rows,
                x.as_ptr(),
                residual.map_or(std::ptr::null(), |r| r.as_ptr()),
                gamma.as_ptr(),
                beta.as_ptr(),
                y.as_mut_ptr(),
                width,
                eps,
            )
        });
        assert_written(&y[..size], "add_layer_norm");
        Ok(())
    }

    fn embed_tokens(
        &self,
        table: &DeviceMatrix<Self>,
        token_args: &TokenArgs<'_, Self>,
        x: &mut Self::F32,
    ) -> Result<()> {
        let TokenArgs {
            items,
            positions,
            position_table,
            tokens,
            width,
        } = *token_args;
        let (t, w) = (tokens as usize, width as usize);
        assert_len(items, t, "token items");
        assert_len(positions, t, "token positions");
        let rows = items[..t].iter().max().map_or(0, |&m| m as usize + 1);
        let positions_used = positions[..t].iter().max().map_or(0, |&m| m as usize + 1);
        assert_len(position_table, positions_used * w, "position table");
        assert_len(x, t * w, "embeddings");
        let tail = (
            items.as_ptr(),
            positions.as_ptr(),
            position_table.as_ptr(),
            x.as_mut_ptr(),
        );
        let status = table_entry("embed_tokens", table, rows, w, tokens, tail);
        check(status);
        assert_written(&x[..t * w], "embed_tokens");
        Ok(())
    }

    fn attention(&self, a: &AttentionArgs<'_, Self>, out: &mut Self::F32) -> Result<()> {
        let AttentionArgs {
            q,
            k,
            v,
            seq_offsets,
            sequences,
            heads,
            head_dim,
            causal,
        } = *a;
        let width = heads * head_dim;
        assert_len(seq_offsets, sequences as usize + 1, "sequence offsets");
        let tokens = seq_offsets[sequences as usize] as usize;
        for buffer in [q, k, v] {
            assert_len(buffer, tokens * width as usize, "q/k/v");
        }
        assert_len(out, tokens * width as usize, "attention output");
        type F = unsafe extern "C" fn(
            u32,
            u32,
            P<f32>,
            P<f32>,
            P<f32>,
            P<u32>,
            M<f32>,
            u32,
            u32,
            u32,
        ) -> i32;
        // SAFETY: the signature of recsys_emu_attention; buffer sizes checked above.
        check(unsafe {
            symbol::<F>("recsys_emu_attention")(
                sequences,
                heads,
                q.as_ptr(),
                k.as_ptr(),
                v.as_ptr(),
                seq_offsets.as_ptr(),
                out.as_mut_ptr(),
                head_dim,
                width,
                u32::from(causal),
            )
        });
        assert_written(&out[..tokens * width as usize], "attention");
        Ok(())
    }

    fn gru_gates(
        &self,
        a: &GruGatesArgs<'_, Self>,
        state: &mut Self::F32,
        outputs: &mut Self::F32,
    ) -> Result<()> {
        let GruGatesArgs {
            input_gates,
            state_gates,
            rows,
            first_token,
            hidden,
        } = *a;
        let (rows_end, h) = ((first_token + rows) as usize, hidden as usize);
        assert_len(input_gates, rows_end * 3 * h, "input-side gates");
        assert_len(state_gates, rows as usize * 3 * h, "state-side gates");
        assert_len(state, rows as usize * h, "GRU state");
        assert_len(outputs, rows_end * h, "GRU outputs");
        type F = unsafe extern "C" fn(u32, P<f32>, P<f32>, M<f32>, M<f32>, u32, u32) -> i32;
        // SAFETY: the signature of recsys_emu_gru_gates; buffer sizes checked above.
        check(unsafe {
            symbol::<F>("recsys_emu_gru_gates")(
                rows,
                input_gates.as_ptr(),
                state_gates.as_ptr(),
                state.as_mut_ptr(),
                outputs.as_mut_ptr(),
                first_token,
                hidden,
            )
        });
        assert_written(&state[..rows as usize * h], "gru_gates");
        Ok(())
    }

    fn gather_rows(
        &self,
        src: &Vec<f32>,
        rows: &Vec<u32>,
        dst: &mut Vec<f32>,
        count: u32,
        width: u32,
    ) -> Result<()> {
        let (c, w) = (count as usize, width as usize);
        assert_len(rows, c, "row numbers");
        let needed = rows[..c].iter().max().map_or(0, |&m| m as usize + 1);
        assert_len(src, needed * w, "gather source");
        assert_len(dst, c * w, "gather output");
        dst[..c * w].fill(f32::NAN);
        type F = unsafe extern "C" fn(u32, P<f32>, P<u32>, M<f32>, u32) -> i32;
        // SAFETY: the signature of recsys_emu_gather_rows; buffer sizes checked above.
        check(unsafe {
            symbol::<F>("recsys_emu_gather_rows")(
                count,
                src.as_ptr(),
                rows.as_ptr(),
                dst.as_mut_ptr(),
                width,
            )
        });
        assert_written(&dst[..c * w], "gather_rows");
        Ok(())
    }

    fn embedding_bag(
        &self,
        table: &DeviceMatrix<Self>,
        bag: &BagArgs<'_, Self>,
        y: &mut Self::F32,
    ) -> Result<()> {
        let BagArgs {
            items,
            offsets,
            bias,
            rows,
            width,
        } = *bag;
        let (r, w) = (rows as usize, width as usize);
        assert_len(offsets, r + 1, "bag offsets");
        let used = offsets[r] as usize;
        assert_len(items, used, "bag items");
        let table_rows = items[..used].iter().max().map_or(0, |&m| m as usize + 1);
        assert_len(bias, w, "first-layer bias");
        assert_len(y, r * w, "first-layer output");
        let tail = (
            items.as_ptr(),
            offsets.as_ptr(),
            bias.as_ptr(),
            y.as_mut_ptr(),
        );
        let status = table_entry("embedding_bag", table, table_rows, w, rows, tail);
        check(status);
        assert_written(&y[..r * w], "embedding_bag");
        Ok(())
    }

    fn hstu_attention(&self, a: &HstuAttentionArgs<'_, Self>, out: &mut Self::F32) -> Result<()> {
        let width = a.width();
        let HstuAttentionArgs {
            uvqk,
            seq_offsets,
            buckets,
            bucket_offsets,
            position_bias,
            time_bias,
            sequences,
            heads,
            dqk,
            dv,
            attention_width,
        } = *a;
        let s = sequences as usize;
        assert_len(seq_offsets, s + 1, "sequence offsets");
        assert_len(bucket_offsets, s, "bucket offsets");
        let tokens = seq_offsets[s] as usize;
        assert_len(uvqk, tokens * width as usize, "uvqk");
        let values = (heads * dv) as usize;
        assert_len(out, tokens * values, "HSTU attention output");
        for h in 0..s {
            let n = (seq_offsets[h + 1] - seq_offsets[h]) as usize;
            assert!(
                n <= attention_width as usize,
                "history {h}: {n} rows past the attention width"
            );
            assert_len(
                &buckets[bucket_offsets[h] as usize..],
                n * n,
                "time buckets",
            );
        }
        let largest_bucket = buckets.iter().max().map_or(0, |&b| b as usize);
        assert_len(time_bias, largest_bucket + 1, "time bias");
        assert_len(
            position_bias,
            2 * attention_width as usize - 1,
            "position bias",
        );
        type F = unsafe extern "C" fn(
            u32,
            u32,
            P<f32>,
            P<u32>,
            P<u16>,
            P<u32>,
            P<f32>,
            P<f32>,
            M<f32>,
            u32,
            u32,
            u32,
            u32,
        ) -> i32;
        // SAFETY: the signature of recsys_emu_hstu_attention; buffer sizes checked above.
        check(unsafe {
            symbol::<F>("recsys_emu_hstu_attention")(
                sequences,
                heads,
                uvqk.as_ptr(),
                seq_offsets.as_ptr(),
                buckets.as_ptr(),
                bucket_offsets.as_ptr(),
                position_bias.as_ptr(),
                time_bias.as_ptr(),
                out.as_mut_ptr(),
                dqk,
                dv,
                width,
                attention_width,
            )
        });
        assert_written(&out[..tokens * values], "hstu_attention");
        Ok(())
    }

    fn hstu_gate(
        &self,
        uvqk: &Vec<f32>,
        normed: &Vec<f32>,
        gated: &mut Vec<f32>,
        rows: u32,
        values: u32,
        width: u32,
    ) -> Result<()> {
        let (r, v) = (rows as usize, values as usize);
        assert!(values <= width, "u is part of the uvqk row");
        assert_len(uvqk, r * width as usize, "uvqk");
        assert_len(normed, r * v, "normalised attention");
        assert_len(gated, r * v, "gated");
        type F = unsafe extern "C" fn(u32, P<f32>, P<f32>, M<f32>, u32, u32) -> i32;
        // SAFETY: the signature of recsys_emu_hstu_gate; buffer sizes checked above.
        check(unsafe {
            symbol::<F>("recsys_emu_hstu_gate")(
                rows,
                uvqk.as_ptr(),
                normed.as_ptr(),
                gated.as_mut_ptr(),
                values,
                width,
            )
        });
        assert_written(&gated[..r * v], "hstu_gate");
        Ok(())
    }

    fn add_rows(&self, y: &mut Vec<f32>, x: &Vec<f32>, rows: u32, width: u32) -> Result<()> {
        let len = rows as usize * width as usize;
        assert_len(y, len, "sum");
        assert_len(x, len, "addend");
        type F = unsafe extern "C" fn(u32, M<f32>, P<f32>, u32) -> i32;
        // SAFETY: the signature of recsys_emu_add_rows; buffer sizes checked above.
        check(unsafe {
            symbol::<F>("recsys_emu_add_rows")(rows, y.as_mut_ptr(), x.as_ptr(), width)
        });
        Ok(())
    }

    fn l2_normalize_rows(&self, x: &mut Vec<f32>, rows: u32, width: u32, eps: f32) -> Result<()> {
        assert_len(x, rows as usize * width as usize, "rows to normalise");
        type F = unsafe extern "C" fn(u32, M<f32>, u32, f32) -> i32;
        // SAFETY: the signature of recsys_emu_l2_normalize_rows; buffer sizes checked above.
        check(unsafe {
            symbol::<F>("recsys_emu_l2_normalize_rows")(rows, x.as_mut_ptr(), width, eps)
        });
        Ok(())
    }
}
