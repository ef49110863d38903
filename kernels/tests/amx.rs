//! AMX tiles against f64: the bf16 product of `recsys_kernels::amx` on every shape edge (rows,
//! outputs and depth below, at and past a tile), within the bound of f32 accumulation.
//!
//! Runs where this CPU has AMX, on an emulated Sapphire Rapids elsewhere
//! (`scripts/amx-emulator.sh`, which CI runs it under); skipped with the reason otherwise, and
//! refused instead when `RECSYS_REQUIRE_AMX=1` (so the emulated run cannot skip silently).

use recsys_kernels::amx::{self, AmxBf16Weights, AmxI8Weights, SplitI16Rows};
use recsys_kernels::lcg;

/// `x` rounded to bf16 (nearest, ties to even; finite inputs), as f64: written here rather than
/// taken from the crate, so the packing's rounding is checked too.
fn bf16_value(x: f32) -> f64 {
    let bits = x.to_bits();
    let rounded = (bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff_0000;
    f64::from(f32::from_bits(rounded))
}

/// What each of `m` rows of a scan test may receive: PAD and two items excluded, every third row
/// filtered to a quarter of the `n` items, k cycling through `ks` (0 and past the catalogue
/// among them, as the tests pick).
struct RowLimits {
    exclusions: Vec<recsys_kernels::fused::Exclusions>,
    masks: Vec<Option<recsys_kernels::item_mask::ItemMask>>,
    ks: Vec<usize>,
}

impl RowLimits {
    fn new(m: usize, n: usize, ks: [usize; 5]) -> Self {
        use recsys_kernels::fused::Exclusions;
        use recsys_kernels::item_mask::ItemMask;
        RowLimits {
            exclusions: (0..m)
                .map(|r| Exclusions::new(vec![0, (r * 7 % n) as u32, (r * 13 % n) as u32]))
                .collect(),
            masks: (0..m)
                .map(|r| {
                    (r % 3 == 2).then(|| {
                        ItemMask::of(
                            n,
                            (0..n as u32).filter(|&j| (j as usize * 31 + r).is_multiple_of(4)),
                        )
                    })
                })
                .collect(),
            ks: (0..m).map(|r| ks[r % 5]).collect(),
        }
    }

    fn queries(&self) -> Vec<recsys_kernels::fused::RowQuery<'_>> {
        (0..self.ks.len())
            .map(|r| recsys_kernels::fused::RowQuery {
                k: self.ks[r],
                excluded: &self.exclusions[r],
                eligible: self.masks[r].as_ref(),
            })
            .collect()
    }
}

/// Whether the test can run here; `false` (after saying why) when it is skipped.
/// A bf16 layer on tiles holding `w` (`[n, d]`) rounded to bf16 by this file's own rounding, and
/// its bias.
fn bf16_layer(w: &[f32], bias: &[f32], d: usize) -> recsys_kernels::fused_amx::AmxLayer {
    let bits: Vec<u16> = w
        .iter()
        .map(|&v| ((bf16_value(v) as f32).to_bits() >> 16) as u16)
        .collect();
    recsys_kernels::fused_amx::AmxLayer::from_packed(
        &recsys_kernels::packed::PackedOutput::from_bf16_bits(&bits, bias, d),
    )
    .unwrap()
}

fn tiles_here() -> bool {
    match amx::availability() {
        Ok(()) => true,
        Err(why) if std::env::var("RECSYS_REQUIRE_AMX").as_deref() == Ok("1") => {
            panic!("RECSYS_REQUIRE_AMX=1 but {why}")
        }
        Err(why) => {
            eprintln!(
                "skipped: {why} (scripts/amx-emulator.sh runs this test on an emulated AMX CPU)"
            );
            false
        }
    }
}

#[test]
fn bf16_tiles_match_f64_on_every_edge() {
    if !tiles_here() {
        return;
    }
    let mut next = lcg(7);
    for &(m, n, k) in &[
        (1, 1, 1),
        (1, 16, 32),
        (3, 17, 31),
        (16, 16, 64),
        (17, 33, 65),
        (40, 48, 100),
    ] {
        let x: Vec<f32> = (0..m * k).map(|_| next()).collect();
        let w: Vec<f32> = (0..n * k).map(|_| next()).collect();
        let packed = AmxBf16Weights::pack(&w, n, k);
        let rows = amx::bf16_rows(&x, m, k, packed.padded_k());
        let mut out = vec![f32::NAN; m * n];
        amx::gemm_bf16(&rows, m, &packed, &mut out).unwrap();
        for r in 0..m {
            for j in 0..n {
                let (mut exact, mut magnitude) = (0f64, 0f64);
                for i in 0..k {
                    let term = bf16_value(x[r * k + i]) * bf16_value(w[j * k + i]);
                    exact += term;
                    magnitude += term.abs();
                }
                // Each product is exact in f32; k additions in f32 each round by at most
                // 2^-24 of a partial sum no larger than the magnitudes' sum.
                let bound = (k as f64 + 1.0) * 2f64.powi(-24) * magnitude + 1e-30;
                let got = f64::from(out[r * n + j]);
                assert!(
                    (got - exact).abs() <= bound,
                    "[{m}x{k}]x[{k}x{n}] at ({r}, {j}): {got} vs {exact} (bound {bound:e})"
                );
            }
        }
        eprintln!("[{m}x{k}] x [{k}x{n}]: every output within the f32 accumulation bound");
    }
}

#[test]
fn int16_by_int8_tiles_are_exact_on_every_edge() {
    if !tiles_here() {
        return;
    }
    let mut next = lcg(11);
    for &(m, n, k) in &[
        (1, 1, 1),
        (2, 16, 64),
        (5, 17, 63),
        (17, 33, 130),
        (33, 20, 200),
    ] {
        // The full int16 and int8 ranges, the extremes included.
        let mut x: Vec<i16> = (0..m * k).map(|_| (next() * 32768.0) as i16).collect();
        let mut w: Vec<i8> = (0..n * k).map(|_| (next() * 128.0) as i8).collect();
        x[0] = i16::MIN;
        w[0] = i8::MIN;
        if x.len() > 1 {
            x[1] = i16::MAX;
            w[n * k - 1] = i8::MAX;
        }
        let packed = AmxI8Weights::pack(&w, n, k);
        let rows = SplitI16Rows::new(&x, m, k, packed.padded_k());
        let mut out = vec![0i32; m * n];
        amx::gemm_i16_i8(&rows, &packed, &mut out).unwrap();
        for r in 0..m {
            for j in 0..n {
                let exact: i64 = (0..k)
                    .map(|i| i64::from(x[r * k + i]) * i64::from(w[j * k + i]))
                    .sum();
                assert_eq!(
                    i64::from(out[r * n + j]),
                    exact,
                    "[{m}x{k}]x[{k}x{n}] at ({r}, {j})"
                );
            }
        }
        eprintln!("[{m}x{k}] x [{k}x{n}]: every output exact");
    }
}

/// Each row's answer from the tile scan against f64 scores of the bf16-rounded layer: the right
/// count, only items the row may receive, ranked, every score within the rounding bound of its
/// exact value, and no item left out that could beat the last one taken within the bounds.
#[test]
fn bf16_tile_scan_selects_each_rows_best_within_the_rounding_bound() {
    use recsys_kernels::fused_amx;
    if !tiles_here() {
        return;
    }
    let mut next = lcg(23);
    // (rows, items, features, threads): one and two A tiles, a partial last block, depth below,
    // at and past one tile's 32.
    for &(m, n, d, threads) in &[
        (1, 70, 3, 1),
        (5, 100, 32, 1),
        (16, 257, 64, 2),
        (37, 1000, 50, 2),
    ] {
        let w: Vec<f32> = (0..n * d).map(|_| next()).collect();
        let bias: Vec<f32> = (0..n).map(|_| next() * 0.2).collect();
        let out = bf16_layer(&w, &bias, d);
        let hidden: Vec<f32> = (0..m * d).map(|_| next()).collect();
        // Row r: k from 0 to past the catalogue; every third row filtered to a random quarter,
        // every row excluding PAD and a few items.
        let limits = RowLimits::new(m, n, [10, 0, 1, 3 * n, 50]);
        let (exclusions, masks, ks) = (&limits.exclusions, &limits.masks, &limits.ks);
        let queries = limits.queries();
        let answers = fused_amx::top_k_bf16(&out, &hidden, &queries, threads).unwrap();
        assert_eq!(answers.len(), m);
        for (r, answer) in answers.iter().enumerate() {
            let allowed = |j: usize| {
                !exclusions[r].contains(j as u32)
                    && masks[r].as_ref().is_none_or(|mask| mask.allows(j as u32))
            };
            // (exact score, bound) per item.
            let reference: Vec<(f64, f64)> = (0..n)
                .map(|j| {
                    let (mut dot, mut magnitude) = (0f64, 0f64);
                    for i in 0..d {
                        let term = bf16_value(hidden[r * d + i]) * bf16_value(w[j * d + i]);
                        dot += term;
                        magnitude += term.abs();
                    }
                    let b = f64::from(bias[j]);
                    let bound = (d as f64 + 2.0) * 2f64.powi(-24) * (magnitude + b.abs()) + 1e-30;
                    (dot + b, bound)
                })
                .collect();
            let eligible = (0..n).filter(|&j| allowed(j)).count();
            assert_eq!(answer.len(), ks[r].min(eligible), "row {r}: how many");
            let mut seen = std::collections::HashSet::new();
            for pair in answer.windows(2) {
                assert!(pair[0].score >= pair[1].score, "row {r}: ranked");
            }
            for s in answer {
                let j = s.index as usize;
                assert!(
                    j < n && allowed(j),
                    "row {r}: item {j} may not be recommended"
                );
                assert!(seen.insert(j), "row {r}: item {j} twice");
                let (exact, bound) = reference[j];
                assert!(
                    (f64::from(s.score) - exact).abs() <= bound,
                    "row {r} item {j}: {} vs {exact} (bound {bound:e})",
                    s.score
                );
            }
            if let Some(last) = answer.last() {
                let (last_exact, last_bound) = reference[last.index as usize];
                for j in (0..n).filter(|&j| allowed(j) && !seen.contains(&j)) {
                    let (exact, bound) = reference[j];
                    assert!(
                        exact - bound <= last_exact + last_bound,
                        "row {r}: item {j} ({exact}) left out for item {} ({last_exact})",
                        last.index
                    );
                }
            }
        }
        eprintln!("{m} rows x {n} items x {d} features on {threads} threads: every answer within the bound");
    }
}

/// A tile routine called from inside another's block callback is refused, and the outer one
/// carries on with its own configuration intact.
#[test]
fn a_nested_tile_routine_is_refused() {
    if !tiles_here() {
        return;
    }
    let w = AmxBf16Weights::pack(&[0.5; 64 * 32], 64, 32);
    let x = amx::bf16_rows(&[1.0; 32], 1, 32, w.padded_k());
    let mut sums = Vec::new();
    amx::for_each_block_bf16(&x, 1, &w, 0..2, |_, block| {
        let mut out = [0f32; 64];
        let nested = amx::gemm_bf16(&x, 1, &w, &mut out).unwrap_err();
        assert!(nested.contains("already in use"), "{nested}");
        sums.push(block[..32].to_vec());
    })
    .unwrap();
    // 32 products of 1 x 0.5 per output, in both blocks.
    assert_eq!(sums, vec![vec![16.0; 32], vec![16.0; 32]]);
    // The claim was released: a later routine runs.
    let mut out = [0f32; 64];
    amx::gemm_bf16(&x, 1, &w, &mut out).unwrap();
    assert_eq!(out, [16.0; 64]);
}

/// A bf16 dense layer on tiles against f64 of the bf16-rounded layer: every output within the
/// bound of f32 accumulation plus the bias addition, on every edge of rows, outputs and depth.
#[test]
fn bf16_dense_layers_on_tiles_match_f64_on_every_edge() {
    use recsys_kernels::dense_amx;
    if !tiles_here() {
        return;
    }
    let mut next = lcg(31);
    for &(rows, n, d) in &[(1, 5, 3), (17, 33, 64), (40, 70, 100), (33, 32, 32)] {
        let w: Vec<f32> = (0..n * d).map(|_| next()).collect();
        let bias: Vec<f32> = (0..n).map(|_| next()).collect();
        let layer = bf16_layer(&w, &bias, d);
        let x: Vec<f32> = (0..rows * d).map(|_| next()).collect();
        let mut y = vec![f32::NAN; rows * n];
        dense_amx::linear_into(&layer, &x, &mut y).unwrap();
        for r in 0..rows {
            for j in 0..n {
                let (mut dot, mut magnitude) = (0f64, 0f64);
                for i in 0..d {
                    let term = bf16_value(x[r * d + i]) * bf16_value(w[j * d + i]);
                    dot += term;
                    magnitude += term.abs();
                }
                let b = f64::from(bias[j]);
                let bound = (d as f64 + 2.0) * 2f64.powi(-24) * (magnitude + b.abs()) + 1e-30;
                let got = f64::from(y[r * n + j]);
                assert!(
                    (got - (dot + b)).abs() <= bound,
                    "[{rows}x{d}] -> {n} at ({r}, {j}): {got} vs {} (bound {bound:e})",
                    dot + b
                );
            }
        }
        let mut short = vec![0f32; rows * n - 1];
        let err = dense_amx::linear_into(&layer, &x, &mut short).unwrap_err();
        assert!(err.contains("the output holds"), "{err}");
        eprintln!("[{rows}x{d}] -> {n}: every output within the bound");
    }
}

/// The int16 x int8 block routine against i64 sums: batches of one row, a partial row group,
/// a whole one and several, outputs across a partial last block, depth below, at and past one
/// tile's 64, the extremes of both types, a range of blocks that starts past the first.
#[test]
fn int16_by_int8_blocks_are_exact_on_every_edge() {
    if !tiles_here() {
        return;
    }
    let mut next = lcg(41);
    for &(m, n, k, first_block) in &[
        (1, 5, 3, 0),
        (16, 32, 64, 0),
        (20, 70, 65, 1),
        (40, 100, 200, 2),
    ] {
        let mut x: Vec<i16> = (0..m * k).map(|_| (next() * 32768.0) as i16).collect();
        let mut w: Vec<i8> = (0..n * k).map(|_| (next() * 128.0) as i8).collect();
        x[0] = i16::MIN;
        x[m * k - 1] = i16::MAX;
        w[0] = i8::MIN;
        w[n * k - 1] = i8::MAX;
        let packed = AmxI8Weights::pack(&w, n, k);
        let split = SplitI16Rows::new(&x, m, k, packed.padded_k());
        let blocks = packed.output_blocks();
        let mut seen = Vec::new();
        amx::for_each_block_i8(&split, &packed, first_block..blocks, 2048, |b, g, block| {
            seen.push((b, g));
            for r in 0..16 {
                let row = 16 * g + r;
                for c in 0..32 {
                    let j = 32 * b + c;
                    let got = block.high[32 * r + c]
                        .wrapping_mul(256)
                        .wrapping_add(block.low[32 * r + c]);
                    let exact: i64 = if j < n && row < m {
                        (0..k)
                            .map(|i| i64::from(x[row * k + i]) * i64::from(w[j * k + i]))
                            .sum()
                    } else {
                        0
                    };
                    assert_eq!(
                        i64::from(got),
                        exact,
                        "[{m}x{k}]x[{k}x{n}] row {row} output {j}"
                    );
                }
            }
        })
        .unwrap();
        let groups = m.div_ceil(16);
        let expected: Vec<(usize, usize)> = (first_block..blocks)
            .flat_map(|b| (0..groups).map(move |g| (b, g)))
            .collect();
        assert_eq!(seen, expected, "every block, each row group, in order");
        let err =
            amx::for_each_block_i8(&split, &packed, 0..blocks + 1, 0, |_, _, _| {}).unwrap_err();
        assert!(err.contains("blocks up to"), "{err}");
        eprintln!("[{m}x{k}] x [{k}x{n}]: every sum exact");
    }
}

/// The exact screen with its int8 scores on tiles: per row the same survivors as on the scalar
/// and AVX-512 tables (the same scores to the bit, so the same bounds), and the answers the dense
/// f32 scan's, ids and scores, with exclusions, filters, k from 0 past the catalogue, one to three
/// row groups of 16 and one or two threads (a tile routine preempted mid-block included, which
/// the emulated CPU's tile-state bug made lose survivors).
#[test]
fn the_screen_on_tiles_keeps_the_simd_screens_survivors_and_answers() {
    use recsys_kernels::fused;
    use recsys_kernels::packed::PackedOutput;
    use recsys_kernels::screen::{self, ScreenTable};
    use recsys_kernels::{Isa, KernelTable};
    if !tiles_here() {
        return;
    }
    let mut next = lcg(53);
    for &(m, n, d, threads) in &[
        (1, 40, 3, 1),
        (5, 300, 64, 1),
        (16, 1000, 65, 2),
        (37, 2000, 50, 2),
    ] {
        // Per-item scales over three orders of magnitude, a few duplicate rows (exact ties).
        let mut w: Vec<f32> = Vec::with_capacity(n * d);
        for _ in 0..n {
            let scale = 10f32.powi((next() * 1.5) as i32);
            w.extend((0..d).map(|_| next() * scale));
        }
        for j in (5..n).step_by(7) {
            let (from, to) = ((j - 5) * d, j * d);
            w.copy_within(from..from + d, to);
        }
        let bias: Vec<f32> = (0..n).map(|_| next() * 0.1).collect();
        let hidden: Vec<f32> = (0..m * d).map(|_| next() * 2.0).collect();
        let limits = RowLimits::new(m, n, [10, 0, 1, 2 * n, 100]);
        let queries = limits.queries();
        let mut table = ScreenTable::new(&w, &bias, d);
        table.prepare_tiles().unwrap();
        assert!(table.has_tiles());
        // The same survivors as the screen on the scalar and the AVX-512 tables (the same
        // epilogue, so the same scores).
        let simd = KernelTable::for_isa(Isa::Avx512);
        let tiled = simd.tiled().expect("AVX-512 has a tiled table");
        let on_tiles = screen::survivors(tiled, &table, &hidden, &queries, threads);
        for reference in [KernelTable::for_isa(Isa::Scalar), simd] {
            let want = screen::survivors(reference, &table, &hidden, &queries, threads);
            for (r, (a, b)) in want.iter().zip(&on_tiles).enumerate() {
                assert!(
                    a.items == b.items,
                    "{:?}, [{m}x{d}] x {n} items, row {r}: {} survivors against {} on tiles",
                    reference.isa,
                    a.items.len(),
                    b.items.len()
                );
            }
        }
        // The answers: the survivors rescored with the tiled table's f32 kernels, the dense
        // scan's, ids and scores.
        let dense = PackedOutput::from_f32(&w, &bias, d);
        let want = fused::top_k(tiled, &dense, &hidden, &queries, 1);
        let (got, _) = screen::top_k_from_f32(tiled, &table, &w, &bias, &hidden, &queries, threads);
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g == w,
                "[{m}x{d}] x {n} items, row {r}: not the dense answer"
            );
        }
        eprintln!("{m} rows x {n} items x {d} features on {threads} threads: the same survivors, the dense answers");
    }
}

/// An int8 output layer's top-k on tiles, per-row activation scales (int8 weight-only engines)
/// and one static scale (W8A8): the scalar table's answer, ids and scores to the bit, with
/// exclusions, filters, k from 0 past the catalogue, one to three row groups and two threads.
#[test]
fn int8_layers_on_tiles_answer_as_the_scalar_scan() {
    use recsys_kernels::fused;
    use recsys_kernels::fused_amx_i8::{self, AmxI8Layer};
    use recsys_kernels::packed::{quantize_int8_per_row, PackedOutput};
    use recsys_kernels::{Isa, KernelTable};
    if !tiles_here() {
        return;
    }
    let mut next = lcg(61);
    for &(m, n, d, threads) in &[(1, 50, 5, 1), (16, 700, 64, 2), (37, 1500, 100, 2)] {
        let w: Vec<f32> = (0..n * d).map(|_| next()).collect();
        let bias: Vec<f32> = (0..n).map(|_| next() * 0.1).collect();
        let (q, scales) = quantize_int8_per_row(&w, d);
        let hidden: Vec<f32> = (0..m * d).map(|_| next() * 2.0).collect();
        let limits = RowLimits::new(m, n, [10, 0, 2 * n, 1, 50]);
        let queries = limits.queries();
        let per_row = PackedOutput::from_i8(&q, &scales, &bias, d);
        let static_scale = per_row.clone().with_static_activation_scale(2.0 / 127.0);
        for (name, out) in [("per-row scales", per_row), ("static scale", static_scale)] {
            let tiles = AmxI8Layer::from_packed(&out).expect("an int8 layer");
            let want = fused::top_k(
                KernelTable::for_isa(Isa::Scalar),
                &out,
                &hidden,
                &queries,
                1,
            );
            let got = fused_amx_i8::top_k(&tiles, &out, &hidden, &queries, threads).unwrap();
            for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g == w,
                    "{name}, [{m}x{d}] x {n} items, row {r}: not the scalar answer"
                );
            }
        }
        eprintln!("{m} rows x {n} items x {d} features on {threads} threads: the scalar answers");
    }
}

/// A multi-hot layer on tiles (Mult-VAE's first layer): each output the sum of the listed
/// inputs' bf16 weights plus the bias, within the bound of f32 accumulation, for 1 to 70 rows
/// (partial and whole groups of 32), empty rows included; one and three threads give the same
/// bits; an input past the layer is refused.
#[test]
fn multi_hot_rows_on_tiles_sum_the_listed_inputs() {
    use recsys_kernels::dense_amx;
    use recsys_kernels::fused_amx::AmxLayer;
    if !tiles_here() {
        return;
    }
    let mut next = lcg(71);
    let (n, d) = (70, 500);
    let w: Vec<f32> = (0..n * d).map(|_| next()).collect();
    let bits: Vec<u16> = w
        .iter()
        .map(|&v| ((bf16_value(v) as f32).to_bits() >> 16) as u16)
        .collect();
    let bias: Vec<f32> = (0..n).map(|_| next()).collect();
    let layer = AmxLayer::from_bits(n, d, |j, i| bits[j * d + i], &bias);
    for rows in [1, 5, 32, 33, 70] {
        let hot: Vec<Vec<u32>> = (0..rows)
            .map(|r| {
                if r % 9 == 4 {
                    return Vec::new();
                }
                let mut items: Vec<u32> = (0..d as u32).filter(|_| next() > 0.6).collect();
                items.dedup();
                items
            })
            .collect();
        let hot_refs: Vec<&[u32]> = hot.iter().map(Vec::as_slice).collect();
        let mut one = vec![f32::NAN; rows * n];
        dense_amx::multi_hot_into(&layer, &hot_refs, &mut one, 1).unwrap();
        let mut three = vec![f32::NAN; rows * n];
        dense_amx::multi_hot_into(&layer, &hot_refs, &mut three, 3).unwrap();
        assert_eq!(
            one.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            three.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{rows} rows: threads change no bit"
        );
        for (r, items) in hot.iter().enumerate() {
            for j in 0..n {
                let (mut sum, mut magnitude) = (f64::from(bias[j]), f64::from(bias[j]).abs());
                for &i in items {
                    let v = bf16_value(w[j * d + i as usize]);
                    sum += v;
                    magnitude += v.abs();
                }
                let bound = (items.len() as f64 + 2.0) * 2f64.powi(-24) * magnitude + 1e-30;
                let got = f64::from(one[r * n + j]);
                assert!(
                    (got - sum).abs() <= bound,
                    "{rows} rows, row {r} output {j}: {got} vs {sum} (bound {bound:e})"
                );
            }
        }
    }
    let past: &[u32] = &[3, d as u32];
    let err = dense_amx::multi_hot_into(&layer, &[past], &mut vec![0.0; n], 1).unwrap_err();
    assert!(
        err.contains("input 500 of a layer with 500 inputs"),
        "{err}"
    );
}

/// A dense layer on tiles split over the pool: the same bits as on one thread, the activation
/// applied to every row once, for row counts across whole and partial groups of 32.
#[test]
fn dense_layers_on_tiles_split_over_threads_keep_their_bits() {
    use recsys_kernels::dense_amx;
    if !tiles_here() {
        return;
    }
    let mut next = lcg(83);
    let (n, d) = (48, 96);
    let w: Vec<f32> = (0..n * d).map(|_| next()).collect();
    let bias: Vec<f32> = (0..n).map(|_| next()).collect();
    let layer = bf16_layer(&w, &bias, d);
    let double = |piece: &mut [f32]| piece.iter_mut().for_each(|v| *v = 2.0 * *v - 1.0);
    for rows in [1, 31, 64, 100, 2000] {
        let x: Vec<f32> = (0..rows * d).map(|_| next()).collect();
        let mut one = vec![f32::NAN; rows * n];
        dense_amx::linear_into(&layer, &x, &mut one).unwrap();
        double(&mut one);
        for threads in [2, 3] {
            let mut split = vec![f32::NAN; rows * n];
            dense_amx::linear_into_then(&layer, &x, &mut split, threads, double).unwrap();
            assert_eq!(
                one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                split.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{rows} rows on {threads} threads"
            );
        }
    }
}

/// Some of a layer's outputs on tiles (a transformer's keys and values without its queries):
/// each output has its bits in the whole layer, the last block partial or not, on one thread and
/// split; a range that does not start at a block of 32 outputs is refused with the reason.
#[test]
fn a_layers_outputs_on_tiles_keep_their_bits_in_the_whole_layer() {
    use recsys_kernels::dense_amx;
    if !tiles_here() {
        return;
    }
    let mut next = lcg(89);
    let (n, d, rows) = (100, 72, 45);
    let w: Vec<f32> = (0..n * d).map(|_| next()).collect();
    let bias: Vec<f32> = (0..n).map(|_| next()).collect();
    let layer = bf16_layer(&w, &bias, d);
    let x: Vec<f32> = (0..rows * d).map(|_| next()).collect();
    let mut whole = vec![f32::NAN; rows * n];
    dense_amx::linear_into(&layer, &x, &mut whole).unwrap();
    for outputs in [0..100, 0..64, 32..100, 64..70, 96..100, 32..32] {
        for threads in [1, 2] {
            let width = outputs.len();
            let mut some = vec![f32::NAN; rows * width];
            dense_amx::linear_outputs_into_then(
                &layer,
                outputs.clone(),
                &x,
                &mut some,
                threads,
                |_| {},
            )
            .unwrap();
            for r in 0..rows {
                let want: Vec<u32> = whole[r * n + outputs.start..r * n + outputs.end]
                    .iter()
                    .map(|v| v.to_bits())
                    .collect();
                let got: Vec<u32> = some[r * width..(r + 1) * width]
                    .iter()
                    .map(|v| v.to_bits())
                    .collect();
                assert_eq!(got, want, "outputs {outputs:?}, row {r}, {threads} threads");
            }
        }
    }
    let mut y = vec![0.0; rows * 32];
    let refused =
        dense_amx::linear_outputs_into_then(&layer, 8..40, &x, &mut y, 1, |_| {}).unwrap_err();
    assert!(refused.contains("multiple of 32"), "{refused}");
    let past = dense_amx::linear_outputs_into_then(&layer, 96..128, &x, &mut y, 1, |_| {});
    assert!(past.unwrap_err().contains("within the layer"));
}

/// The scan's blocks (two A tiles by two B tiles, four accumulators) hold the bits of the plain
/// product (`gemm_bf16`, one accumulator per output tile), every block handed over once and in
/// order: depths of 256 to the multi-hot first layer's 3,417, rows in one tile group and two.
#[test]
fn blocks_hold_the_plain_products_bits_at_every_depth() {
    if !tiles_here() {
        return;
    }
    let mut next = lcg(97);
    for &(rows, n, k) in &[(32, 64, 256), (20, 96, 600), (7, 40, 300), (32, 96, 3417)] {
        let w: Vec<f32> = (0..n * k).map(|_| next()).collect();
        let weights = AmxBf16Weights::pack(&w, n, k);
        let x: Vec<f32> = (0..rows * k).map(|_| next()).collect();
        let xb = amx::bf16_rows(&x, rows, k, weights.padded_k());
        let mut want = vec![0f32; rows * n];
        amx::gemm_bf16(&xb, rows, &weights, &mut want).unwrap();
        let mut got = vec![f32::NAN; rows * n];
        let mut seen = Vec::new();
        amx::for_each_block_bf16(
            &xb,
            rows,
            &weights,
            0..weights.output_blocks(),
            |b, block| {
                seen.push(b);
                for r in 0..rows {
                    for c in 0..32.min(n - 32 * b) {
                        got[r * n + 32 * b + c] = block[32 * r + c];
                    }
                }
            },
        )
        .unwrap();
        assert_eq!(seen, (0..weights.output_blocks()).collect::<Vec<_>>());
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got),
            bits(&want),
            "{rows} rows, {n} outputs, depth {k}"
        );
    }
}

/// The tile unit's rate probe runs where tiles do and gives a positive, finite rate; elsewhere it
/// refuses with the reason.
#[test]
fn the_tile_rate_probe_reports_a_rate_or_why_not() {
    match amx::availability() {
        Ok(()) => {
            let rate = amx::bf16_peak_macs_per_second(1000).unwrap();
            assert!(rate.is_finite() && rate > 0.0, "{rate}");
        }
        Err(why) => assert_eq!(&amx::bf16_peak_macs_per_second(10).unwrap_err(), why),
    }
}
