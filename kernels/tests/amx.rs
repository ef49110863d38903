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

/// Whether the test can run here; `false` (after saying why) when it is skipped.
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
