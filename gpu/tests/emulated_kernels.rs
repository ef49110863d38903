//! The fused score + top-k kernels, run on the CPU through the emulation (tests/emulated) and
//! sequenced by the CUDA path's own host code ([`DeviceOutputLayer::top_k`]: launch plan,
//! exclusion CSR, merge passes, result extraction), against the scalar f64 reference on fresh
//! random inputs. Timing and the hardware itself need the device tests (scripts/gpu-check.sh).

mod common;
mod emulated;

use common::{assert_top_k_matches, coalesced_exhaustive_topk, exclusions, matrix, reference, Rng};
use emulated::{check, last_failure, symbol, EmulatedDevice};
use recsys_engine::tensor::Tensor;
use recsys_engine::weights::Matrix;
use recsys_gpu::device::CandidatesMut;
use recsys_gpu::device::Device;
use recsys_gpu::output_layer::{DeviceOutputLayer, ScanStrategy};
use recsys_gpu::{
    gemv_launch, merge_plan, stage1_launch, threshold_plan, Ranked, SURVIVOR_CAPACITY, TILE,
};

fn emulated_topk(
    w: &Matrix,
    bias: &[f32],
    hidden: &[f32],
    k: usize,
    exclude: &[Vec<u32>],
) -> Vec<Ranked> {
    let device = EmulatedDevice::default();
    let layer = DeviceOutputLayer::new(
        &device,
        w,
        &Tensor::from_vec(vec![bias.len()], bias.to_vec()),
        None,
    )
    .unwrap();
    let refs: Vec<&[u32]> = exclude.iter().map(Vec::as_slice).collect();
    let hidden = device.upload_f32(hidden).unwrap();
    layer.top_k(&device, &hidden, k, &refs).unwrap()
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
            assert_top_k_matches(
                &got[r],
                &w,
                &bias,
                &hidden[r * d..(r + 1) * d],
                k,
                &excluded[r],
                &format!("{kind} n={n} d={d} rows={rows} k={k} row {r}"),
            );
            checked += 1;
        }
    }
    checked
}

/// The threshold scan's answers and the rows it handed to the tile scan (their survivors
/// overflowed), with `capacity` survivor slots per row.
fn emulated_threshold_topk(
    w: &Matrix,
    bias: &[f32],
    hidden: &[f32],
    k: usize,
    exclude: &[Vec<u32>],
    capacity: usize,
) -> (Vec<Ranked>, Vec<usize>) {
    threshold_topk_by(
        ScanStrategy::Threshold,
        w,
        bias,
        hidden,
        k,
        exclude,
        capacity,
    )
}

/// [`emulated_threshold_topk`] with the threshold scan's kernels chosen by `strategy`.
fn threshold_topk_by(
    strategy: ScanStrategy,
    w: &Matrix,
    bias: &[f32],
    hidden: &[f32],
    k: usize,
    exclude: &[Vec<u32>],
    capacity: usize,
) -> (Vec<Ranked>, Vec<usize>) {
    let device = EmulatedDevice::default();
    let mut layer = DeviceOutputLayer::new(
        &device,
        w,
        &Tensor::from_vec(vec![bias.len()], bias.to_vec()),
        None,
    )
    .unwrap();
    layer.strategy = strategy;
    layer.survivor_capacity = capacity;
    let plan = threshold_plan(w.rows(), k, capacity).expect("a catalogue the threshold scan takes");
    let refs: Vec<&[u32]> = exclude.iter().map(Vec::as_slice).collect();
    let hidden = device.upload_f32(hidden).unwrap();
    let answer = layer
        .top_k_above_threshold(&device, &hidden, k, &refs, &plan)
        .unwrap();
    // top_k with the strategy set takes the same path.
    assert_eq!(
        layer.top_k(&device, &hidden, k, &refs).unwrap(),
        answer.ranked
    );
    (answer.ranked, answer.overflowed)
}

#[test]
fn the_threshold_scan_samples_only_where_it_pays() {
    // One item in capacity / 4k: k = 100 samples every 20th item of a 1e6 catalogue.
    let plan = threshold_plan(1_000_000, 100, SURVIVOR_CAPACITY).unwrap();
    assert_eq!((plan.stride, plan.positions), (20, 50_000));
    // A catalogue under 8 tiles, or a k whose sample would be an eighth of the catalogue or more:
    // the tile scan.
    assert_eq!(threshold_plan(8 * TILE - 1, 10, SURVIVOR_CAPACITY), None);
    assert_eq!(threshold_plan(1_000_000, 257, SURVIVOR_CAPACITY), None);
    assert!(threshold_plan(8 * TILE, 256, SURVIVOR_CAPACITY).is_some());
}

#[test]
fn the_threshold_scan_matches_the_reference_at_every_precision() {
    let mut rng = Rng(0x5EED_0008);
    // Not a multiple of the tile or of the strides; 5 rows = a group of 4 and a group of 1.
    let (n, d, rows) = (20_011usize, 16usize, 5usize);
    for kind in ["f32", "f16", "i8"] {
        let w = matrix(kind, n, d, &mut rng);
        let bias: Vec<f32> = (0..n).map(|_| rng.uniform() * 0.1).collect();
        let hidden: Vec<f32> = (0..rows * d).map(|_| rng.uniform()).collect();
        let excluded = exclusions(rows, n, 50, &mut rng);
        for k in [1, 10, 100, 256] {
            let (got, overflowed) =
                emulated_threshold_topk(&w, &bias, &hidden, k, &excluded, SURVIVOR_CAPACITY);
            assert_eq!(
                overflowed,
                Vec::<usize>::new(),
                "{kind} k={k}: random scores fit"
            );
            for r in 0..rows {
                assert_top_k_matches(
                    &got[r],
                    &w,
                    &bias,
                    &hidden[r * d..(r + 1) * d],
                    k,
                    &excluded[r],
                    &format!("threshold {kind} n={n} k={k} row {r}"),
                );
            }
        }
    }
}

#[test]
fn the_coalesced_scans_give_each_item_lanes_for_about_one_chunk_of_its_row() {
    // d = 64: 16 lanes of f32 (256 B), 8 of f16, 4 of int8; wide rows take the whole warp.
    let lanes = |pitch, bytes| gemv_launch(pitch, bytes, 1, 7).unwrap().lanes;
    assert_eq!((lanes(64, 4), lanes(64, 2), lanes(64, 1)), (16, 8, 4));
    assert_eq!((lanes(600, 4), lanes(608, 1), lanes(4, 4)), (32, 32, 1));
    let launch = gemv_launch(600, 2, 3, 7).unwrap();
    assert_eq!((launch.blocks, launch.shared_bytes), (7, 3 * 600 * 4));
    // Batches over four rows are the tile kernels'.
    assert_eq!(gemv_launch(64, 4, 5, 7), None);
    assert_eq!(gemv_launch(64, 4, 0, 7), None);
}

#[test]
fn the_coalesced_threshold_scan_is_exact_at_every_precision_and_width() {
    let mut rng = Rng(0x5EED_000A);
    // Not a multiple of the tile or of the strides. Widths: lanes of 16 / 8 / 4 at d = 64, a
    // whole warp with a partial last round at d = 600, and d = 30, whose f32 rows are padded.
    let n = 20_011usize;
    let mut checked = 0;
    for (kind, d) in [
        ("f32", 64),
        ("f16", 64),
        ("i8", 64),
        ("f32", 600),
        ("f16", 600),
        ("i8", 600),
        ("f32", 30),
    ] {
        let w = matrix(kind, n, d, &mut rng);
        let bias: Vec<f32> = (0..n).map(|_| rng.uniform() * 0.1).collect();
        let rows = 1 + (checked % 4);
        let hidden: Vec<f32> = (0..rows * d).map(|_| rng.uniform()).collect();
        let excluded = exclusions(rows, n, 50, &mut rng);
        for k in [1, 100] {
            let (got, overflowed) = threshold_topk_by(
                ScanStrategy::CoalescedThreshold,
                &w,
                &bias,
                &hidden,
                k,
                &excluded,
                SURVIVOR_CAPACITY,
            );
            let what = format!("coalesced {kind} d={d} rows={rows} k={k}");
            assert_eq!(overflowed, Vec::<usize>::new(), "{what}: random scores fit");
            // Exact in its own arithmetic: the same items and score bits as ranking every
            // item's coalesced score, so the threshold never lost one.
            assert_eq!(
                got,
                coalesced_exhaustive_topk(
                    &EmulatedDevice::default(),
                    &w,
                    &bias,
                    &hidden,
                    k,
                    &excluded
                ),
                "{what}"
            );
            for r in 0..rows {
                assert_top_k_matches(
                    &got[r],
                    &w,
                    &bias,
                    &hidden[r * d..(r + 1) * d],
                    k,
                    &excluded[r],
                    &format!("{what} row {r}"),
                );
            }
        }
        checked += 1;
    }
    assert_eq!(checked, 7);
}

#[test]
fn the_tiled_threshold_scan_is_exact_for_larger_batches() {
    let mut rng = Rng(0x5EED_000C);
    // Batches over 4 rows take the GEMM kernels: 64 rows (one row group), 70 (two, the second
    // nearly empty), 5; widths that fill whole 32-column steps (64), end in a partial one (100:
    // f16 rows of 104, int8 rows of 112) or are padded (30); a catalogue not a multiple of the
    // 128-item tile. (Every block computes 64 rows, so wide rows cost the emulation dearly.)
    let mut checked = 0;
    for (kind, n, d, rows) in [
        ("f32", 20_011usize, 64usize, 64usize),
        ("f16", 20_011, 64, 70),
        ("i8", 20_011, 64, 5),
        ("f16", 16_500, 100, 6),
        ("i8", 16_500, 100, 5),
        ("f32", 16_500, 30, 9),
    ] {
        let w = matrix(kind, n, d, &mut rng);
        let bias: Vec<f32> = (0..n).map(|_| rng.uniform() * 0.1).collect();
        let hidden: Vec<f32> = (0..rows * d).map(|_| rng.uniform()).collect();
        let excluded = exclusions(rows, n, 50, &mut rng);
        let k = 100;
        let (got, overflowed) = threshold_topk_by(
            ScanStrategy::CoalescedThreshold,
            &w,
            &bias,
            &hidden,
            k,
            &excluded,
            SURVIVOR_CAPACITY,
        );
        let what = format!("tiled {kind} n={n} d={d} rows={rows}");
        assert_eq!(overflowed, Vec::<usize>::new(), "{what}: random scores fit");
        assert_eq!(
            got,
            coalesced_exhaustive_topk(&EmulatedDevice::default(), &w, &bias, &hidden, k, &excluded),
            "{what}"
        );
        for r in 0..rows {
            assert_top_k_matches(
                &got[r],
                &w,
                &bias,
                &hidden[r * d..(r + 1) * d],
                k,
                &excluded[r],
                &format!("{what} row {r}"),
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 64 + 70 + 5 + 6 + 5 + 9);
}

#[test]
fn the_tensor_core_tiles_keep_hidden_rows_far_outside_f16s_range() {
    // f16 reaches 65504 and resolves down to 6e-8: hidden rows scaled by 2^17 or 2^-30 would
    // overflow or vanish as f16 numbers. Each row's own power-of-two scale undoes that exactly,
    // so with zero biases the scores are the unscaled row's scores times the factor, bit for bit.
    let mut rng = Rng(0x5EED_000D);
    let (n, d, rows, k) = (16_500usize, 64usize, 5usize, 50usize);
    for kind in ["f16", "i8"] {
        let w = matrix(kind, n, d, &mut rng);
        let bias = vec![0.0f32; n];
        let hidden: Vec<f32> = (0..rows * d).map(|_| rng.uniform()).collect();
        let excluded = exclusions(rows, n, 20, &mut rng);
        let (plain, _) = threshold_topk_by(
            ScanStrategy::CoalescedThreshold,
            &w,
            &bias,
            &hidden,
            k,
            &excluded,
            SURVIVOR_CAPACITY,
        );
        for factor in [2f32.powi(17), 2f32.powi(-30)] {
            let scaled: Vec<f32> = hidden.iter().map(|h| h * factor).collect();
            let (got, _) = threshold_topk_by(
                ScanStrategy::CoalescedThreshold,
                &w,
                &bias,
                &scaled,
                k,
                &excluded,
                SURVIVOR_CAPACITY,
            );
            let want: Vec<Ranked> = plain
                .iter()
                .map(|row| row.iter().map(|&(i, s)| (i, s * factor)).collect())
                .collect();
            assert_eq!(got, want, "{kind} x {factor}");
        }
        for r in 0..rows {
            assert_top_k_matches(
                &plain[r],
                &w,
                &bias,
                &hidden[r * d..(r + 1) * d],
                k,
                &excluded[r],
                &format!("{kind} row {r}"),
            );
        }
    }
}

#[test]
fn the_coalesced_threshold_scan_hands_overflowing_rows_to_the_tile_scan() {
    let mut rng = Rng(0x5EED_000B);
    let (n, d) = (17_000usize, 8usize);
    // As below for the tile kernels' threshold scan: row 0 ties a quarter of the catalogue at
    // its threshold and overflows; row 1 may get only 20 items, so its threshold is -inf.
    let w = Matrix::F32(Tensor::from_vec(vec![n, d], vec![0.0; n * d]));
    let bias: Vec<f32> = (0..n).map(|_| (rng.next() % 4) as f32 * 0.25).collect();
    let hidden: Vec<f32> = (0..2 * d).map(|_| rng.uniform()).collect();
    let excluded = vec![vec![], (0..n as u32 - 20).collect()];
    let (got, overflowed) = threshold_topk_by(
        ScanStrategy::CoalescedThreshold,
        &w,
        &bias,
        &hidden,
        50,
        &excluded,
        2048,
    );
    assert_eq!(overflowed, vec![0]);
    for r in 0..2 {
        let want = reference(&w, &bias, &hidden[r * d..(r + 1) * d], 50, &excluded[r]);
        assert_eq!(got[r], want, "row {r}");
    }
    assert_eq!(got[1].len(), 20);
}

#[test]
fn the_survivors_finish_selects_and_sorts_each_row_in_one_launch() {
    // Rows of survivors as the threshold scans leave them: none, a few, exactly a tile (no radix
    // select), one more than a tile and more (select), the capacity full, and an overflowed count
    // (more found than slots: the slots hold the first ones). Scores drawn from 40 values, so
    // ties are everywhere, and some negative; k = 1, 100 and 256.
    let mut rng = Rng(0x5EED_000E);
    let capacity = 8192usize;
    let fills = [0usize, 5, 2048, 2049, 5000, 8192, 9000];
    let rows = fills.len();
    let device = EmulatedDevice::default();
    let counts: Vec<u32> = fills.iter().map(|&f| f as u32).collect();
    let mut scores = vec![f32::NEG_INFINITY; rows * capacity];
    let mut index = vec![u32::MAX; rows * capacity];
    for (r, &fill) in fills.iter().enumerate() {
        // Distinct item indices in a shuffled order, as the atomics leave them.
        let mut items: Vec<u32> = (0..fill.min(capacity) as u32).map(|i| i * 7 + 3).collect();
        for i in (1..items.len()).rev() {
            items.swap(i, (rng.next() % (i as u64 + 1)) as usize);
        }
        for (slot, item) in items.into_iter().enumerate() {
            scores[r * capacity + slot] = (rng.next() % 40) as f32 * 0.25 - 3.0;
            index[r * capacity + slot] = item;
        }
    }
    for k in [1usize, 100, 256] {
        let mut out_scores = device.alloc_f32(rows * k).unwrap();
        let mut out_index = device.alloc_u32(rows * k).unwrap();
        let mut finished_counts = counts.clone();
        device
            .finalize_survivors(
                rows as u32,
                &mut finished_counts,
                recsys_gpu::device::Candidates {
                    scores: &scores,
                    index: &index,
                },
                capacity as u32,
                k as u32,
                CandidatesMut {
                    scores: &mut out_scores,
                    index: &mut out_index,
                },
            )
            .unwrap();
        assert_eq!(finished_counts, counts, "k={k}: no row tied past the tile");
        for r in 0..rows {
            let mut want: Vec<(u32, f32)> = (0..fills[r].min(capacity))
                .map(|slot| (index[r * capacity + slot], scores[r * capacity + slot]))
                .collect();
            want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            want.truncate(k);
            let got: Vec<(u32, f32)> = (0..want.len())
                .map(|i| (out_index[r * k + i], out_scores[r * k + i]))
                .collect();
            assert_eq!(got, want, "k={k} row {r} ({} survivors)", fills[r]);
            assert!(
                out_index[r * k + want.len()..(r + 1) * k]
                    .iter()
                    .all(|&i| i == u32::MAX),
                "k={k} row {r}: padding after the survivors"
            );
        }
    }
    // A tie wider than the tile at the k-th best: 3000 survivors with one score. The row cannot
    // be sorted on chip, so its count goes past the capacity for the host to answer it.
    let mut tied_counts = vec![3000u32];
    let tied_scores = vec![1.5f32; 3000];
    let tied_index: Vec<u32> = (0..3000).collect();
    let mut out_scores = device.alloc_f32(10).unwrap();
    let mut out_index = device.alloc_u32(10).unwrap();
    device
        .finalize_survivors(
            1,
            &mut tied_counts,
            recsys_gpu::device::Candidates {
                scores: &tied_scores,
                index: &tied_index,
            },
            3000,
            10,
            CandidatesMut {
                scores: &mut out_scores,
                index: &mut out_index,
            },
        )
        .unwrap();
    assert_eq!(tied_counts, vec![3001]);
}

#[test]
fn rows_whose_survivors_overflow_are_answered_exactly_by_the_tile_scan() {
    let mut rng = Rng(0x5EED_0009);
    let (n, d) = (17_000usize, 8usize);
    // Zero weights: every score is its bias, one of four values, so a quarter of the catalogue
    // ties at the sample's k-th best and overflows the slots (row 0); row 1 excludes all but 20
    // items, so its sample holds fewer than k and its threshold is -inf: every item it may get
    // survives, 20 of them, within the slots. (Random distinct scores: the test above.)
    let w = Matrix::F32(Tensor::from_vec(vec![n, d], vec![0.0; n * d]));
    let bias: Vec<f32> = (0..n).map(|_| (rng.next() % 4) as f32 * 0.25).collect();
    let hidden: Vec<f32> = (0..2 * d).map(|_| rng.uniform()).collect();
    let excluded = vec![vec![], (0..n as u32 - 20).collect()];
    let (got, overflowed) = emulated_threshold_topk(&w, &bias, &hidden, 50, &excluded, 2048);
    assert_eq!(
        overflowed,
        vec![0],
        "the tied row overflows, the other fits"
    );
    for r in 0..2 {
        // Exact ties go to the lower index on either path.
        let want = reference(&w, &bias, &hidden[r * d..(r + 1) * d], 50, &excluded[r]);
        assert_eq!(got[r], want, "row {r}");
    }
    assert_eq!(got[1].len(), 20);
}

#[test]
fn fp32_kernels_match_the_reference_around_tile_edges() {
    let mut rng = Rng(0x5EED_0001);
    let mut checked = 0;
    // Below, at and just above one tile; 5 rows = a full group of 4 and a group of 1.
    for &(n, rows) in &[(2000usize, 1usize), (2048, 5), (2049, 3)] {
        checked += check_against_reference("f32", n, 64, rows, &[1, 10, 100], &mut rng);
    }
    // A width the 16-byte loads cannot take.
    checked += check_against_reference("f32", 2049, 30, 2, &[10], &mut rng);
    assert_eq!(checked, 3 * (1 + 5 + 3) + 2);
}

#[test]
fn fp16_and_int8_kernels_match_the_reference() {
    let mut rng = Rng(0x5EED_0002);
    // Widths that take the 16-byte loads (f16 48, int8 48) and ones that cannot (f16 20, int8 40).
    check_against_reference("f16", 2049, 48, 4, &[10, 100], &mut rng);
    check_against_reference("f16", 2049, 20, 3, &[10], &mut rng);
    check_against_reference("i8", 2049, 40, 6, &[1, 10], &mut rng);
    check_against_reference("i8", 2049, 48, 2, &[10], &mut rng);
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
    let launch = stage1_launch(2100, 1500, 1500, 3, 10).unwrap();
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
    assert_top_k_matches(&got[0], &w, &bias, &hidden[..8], 100, &excluded[0], "row 0");
    assert_eq!(got[1].len(), 39);
    assert_top_k_matches(&got[1], &w, &bias, &hidden[8..], 100, &[], "row 1");
}

#[test]
fn exact_ties_go_to_the_lower_index_in_both_selection_paths() {
    // Zero weights: every score is its bias, drawn from four values, so most items tie exactly.
    let mut rng = Rng(0x5EED_0007);
    let n = 5000;
    let w = Matrix::F32(Tensor::from_vec(vec![n, 8], vec![0.0; n * 8]));
    let bias: Vec<f32> = (0..n).map(|_| (rng.next() % 4) as f32 * 0.25).collect();
    let hidden: Vec<f32> = (0..2 * 8).map(|_| rng.uniform()).collect();
    let excluded = exclusions(2, n, 30, &mut rng);
    // k = 32 takes the warp path at its limit; k = 33 and 500 the sort.
    for k in [1, 7, 32, 33, 500] {
        let got = emulated_topk(&w, &bias, &hidden, k, &excluded);
        for r in 0..2 {
            let want = reference(&w, &bias, &hidden[r * 8..(r + 1) * 8], k, &excluded[r]);
            assert_eq!(got[r], want, "k={k} row {r}");
        }
    }
}

#[test]
fn w8a8_quantizes_the_hidden_vector_with_the_static_scale() {
    let mut rng = Rng(0x5EED_0006);
    let (n, d, scale) = (300usize, 32usize, 0.02f32);
    let w = matrix("i8", n, d, &mut rng);
    let bias: Vec<f32> = (0..n).map(|_| rng.uniform() * 0.1).collect();
    let hidden: Vec<f32> = (0..d).map(|_| rng.uniform() * 3.0).collect();
    let device = EmulatedDevice::default();
    let layer = DeviceOutputLayer::new(
        &device,
        &w,
        &Tensor::from_vec(vec![n], bias.clone()),
        Some(scale),
    )
    .unwrap();
    let got = layer
        .top_k(&device, &device.upload_f32(&hidden).unwrap(), 20, &[&[]])
        .unwrap();
    // The reference sees the hidden vector as the engine's static quantization leaves it:
    // levels of `scale`, saturating to [-128, 127] levels (|h| reaches 3, so some values clamp).
    let quantized: Vec<f32> = hidden
        .iter()
        .map(|h| (h / scale).round_ties_even().clamp(-128.0, 127.0) * scale)
        .collect();
    assert!(quantized.iter().any(|q| q.abs() >= 127.0 * scale * 0.999));
    assert_top_k_matches(&got[0], &w, &bias, &quantized, 20, &[], "w8a8");
}

#[test]
fn the_emulation_models_warp_shuffles_and_reports_divergent_barriers() {
    type Probe = unsafe extern "C" fn(*mut u32) -> i32;
    let mut sums = vec![0u32; 64];
    // SAFETY: the probe writes 64 values.
    check(unsafe { symbol::<Probe>("recsys_emu_probe_warp_sums")(sums.as_mut_ptr()) });
    assert!(sums.iter().all(|&s| s == 32 * 33 / 2), "{sums:?}");

    let mut out = vec![0u32; 128];
    // SAFETY: the probe writes at most 128 values.
    let status = unsafe { symbol::<Probe>("recsys_emu_probe_divergent_barrier")(out.as_mut_ptr()) };
    assert_eq!(status, 1);
    let msg = last_failure();
    assert!(
        msg.contains("divergent_barrier, block (0, 0, 0): divergent barrier"),
        "{msg}"
    );
}

#[test]
fn kept_buffers_carry_nothing_from_one_batch_to_the_next_and_stop_growing() {
    // One layer answers a run of batches of changing sizes, k and exclusions, each strategy in
    // turn, through the buffers it keeps between batches: every answer must equal a fresh
    // layer's (an earlier, larger batch's leftovers in the kept candidates, survivors or
    // exclusions would change it) and the f64 reference; the run's second pass must allocate
    // nothing on the device.
    let mut rng = Rng(0x5EED_0010);
    let (n, d) = (17_000usize, 16usize);
    let w = matrix("f32", n, d, &mut rng);
    let bias: Vec<f32> = (0..n).map(|_| rng.uniform() * 0.1).collect();
    let bias_tensor = Tensor::from_vec(vec![n], bias.clone());
    // (rows, k, most exclusions per row): larger first, then smaller, some without any.
    let batches: Vec<(usize, usize, u64)> = vec![
        (6, 100, 200),
        (1, 7, 0),
        (3, 100, 40),
        (2, 1, 5),
        (5, 64, 0),
    ];
    let inputs: Vec<(Vec<f32>, Vec<Vec<u32>>)> = batches
        .iter()
        .map(|&(rows, _, excluded)| {
            let hidden = (0..rows * d).map(|_| rng.uniform()).collect();
            (hidden, exclusions(rows, n, excluded, &mut rng))
        })
        .collect();
    for strategy in [
        ScanStrategy::Tiles,
        ScanStrategy::Threshold,
        ScanStrategy::CoalescedThreshold,
    ] {
        let device = EmulatedDevice::default();
        let mut kept = DeviceOutputLayer::new(&device, &w, &bias_tensor, None).unwrap();
        kept.strategy = strategy;
        let mut after_first_pass = 0;
        for pass in 0..2 {
            for (&(rows, k, _), (hidden, excluded)) in batches.iter().zip(&inputs) {
                let what = format!("{strategy:?} pass {pass} rows={rows} k={k}");
                let refs: Vec<&[u32]> = excluded.iter().map(Vec::as_slice).collect();
                let on_device = device.upload_f32(hidden).unwrap();
                let got = kept.top_k(&device, &on_device, k, &refs).unwrap();
                let mut fresh = DeviceOutputLayer::new(&device, &w, &bias_tensor, None).unwrap();
                fresh.strategy = strategy;
                assert_eq!(
                    got,
                    fresh.top_k(&device, &on_device, k, &refs).unwrap(),
                    "{what}: the kept buffers changed the answer"
                );
                for r in 0..rows {
                    assert_top_k_matches(
                        &got[r],
                        &w,
                        &bias,
                        &hidden[r * d..(r + 1) * d],
                        k,
                        &excluded[r],
                        &format!("{what} row {r}"),
                    );
                }
            }
            if pass == 0 {
                after_first_pass = kept.workspace_allocations();
                assert!(
                    after_first_pass > 0,
                    "{strategy:?}: the first batch allocates"
                );
            }
        }
        assert_eq!(
            kept.workspace_allocations(),
            after_first_pass,
            "{strategy:?}: batches no larger than earlier ones allocated device buffers"
        );
    }
}

#[test]
fn kept_buffers_serve_the_overflow_fallback_and_the_next_batch() {
    // A batch whose row 0 overflows (a quarter of the catalogue tied at its threshold, as in
    // the overflow tests above) is answered through the tile scan in the same kept buffers; the
    // next batch, with distinct scores, must not see any of it.
    let mut rng = Rng(0x5EED_0011);
    let (n, d) = (17_000usize, 8usize);
    let tied = Matrix::F32(Tensor::from_vec(vec![n, d], vec![0.0; n * d]));
    let tied_bias: Vec<f32> = (0..n).map(|_| (rng.next() % 4) as f32 * 0.25).collect();
    let hidden: Vec<f32> = (0..2 * d).map(|_| rng.uniform()).collect();
    let excluded = [vec![], (0..n as u32 - 20).collect::<Vec<u32>>()];
    let refs: Vec<&[u32]> = excluded.iter().map(Vec::as_slice).collect();
    for strategy in [ScanStrategy::Threshold, ScanStrategy::CoalescedThreshold] {
        let device = EmulatedDevice::default();
        let mut layer = DeviceOutputLayer::new(
            &device,
            &tied,
            &Tensor::from_vec(vec![n], tied_bias.clone()),
            None,
        )
        .unwrap();
        layer.strategy = strategy;
        let plan = threshold_plan(n, 50, layer.survivor_capacity).unwrap();
        let on_device = device.upload_f32(&hidden).unwrap();
        for round in 0..2 {
            let answer = layer
                .top_k_above_threshold(&device, &on_device, 50, &refs, &plan)
                .unwrap();
            assert_eq!(answer.overflowed, vec![0], "{strategy:?} round {round}");
            for r in 0..2 {
                let want = reference(
                    &tied,
                    &tied_bias,
                    &hidden[r * d..(r + 1) * d],
                    50,
                    &excluded[r],
                );
                assert_eq!(answer.ranked[r], want, "{strategy:?} round {round} row {r}");
            }
            // Then a batch of one row without exclusions: everything of the last batch in the
            // kept buffers (its exclusions, its survivors) must be gone from the answer.
            let one = &hidden[d..2 * d];
            let single = layer
                .top_k(&device, &device.upload_f32(one).unwrap(), 50, &[&[]])
                .unwrap();
            assert_eq!(
                single[0],
                reference(&tied, &tied_bias, one, 50, &[]),
                "{strategy:?} round {round}: the batch after the overflow"
            );
        }
    }
}
