//! Portable CPU kernels.
//!
//! Every kernel computes each output row with an accumulation order that depends only on that row's
//! inputs, never on how many rows are in the batch: a history scored alone and the same history in a
//! batch of 64 give bit-identical results.

/// LayerNorm over one row with biased variance, statistics in f64: with f32 statistics a row whose
/// mean is large against its spread (a case the property test found: two values near -245 that
/// differ by 0.5) loses the mean's rounding error relative to the tiny variance; f64 keeps the
/// 1e-12 epsilon and such rows exact. The cost is a few percent of BERT4Rec's encoder.
#[inline(always)]
pub fn layer_norm(row: &mut [f32], gamma: &[f32], beta: &[f32], eps: f64) {
    let n = row.len() as f64;
    let mean = sum_f64(row, |v| v as f64) / n;
    let var = sum_f64(row, |v| (v as f64 - mean).powi(2)) / n;
    let inv = 1.0 / (var + eps).sqrt();
    for ((v, g), b) in row.iter_mut().zip(gamma).zip(beta) {
        *v = ((*v as f64 - mean) * inv) as f32 * *g + *b;
    }
}

/// The sum of `f(v)` over `x` in f64, in 8 independent partial sums (fixed order): a single
/// running sum is one dependency chain of `x.len()` adds, which kept LayerNorm over 64-wide rows
/// waiting on add latency (7 % of BERT4Rec's time at batch 64); the partial sums overlap and
/// vectorise, and in f64 the order changes nothing an f32 result shows but its last bit, rarely.
#[inline(always)]
fn sum_f64(x: &[f32], f: impl Fn(f32) -> f64) -> f64 {
    let mut acc = [0f64; 8];
    let mut chunks = x.chunks_exact(8);
    for chunk in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(chunk) {
            *a += f(v);
        }
    }
    for (a, &v) in acc.iter_mut().zip(chunks.remainder()) {
        *a += f(v);
    }
    acc.iter().sum()
}

/// Sum with 8 independent partial sums (vectorises; fixed order).
#[inline(always)]
fn sum_f32(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    // Whole chunks first, so the loop is eight lanes wide with no length check per chunk; the
    // tail then adds into the first lanes, as before.
    let mut chunks = x.chunks_exact(8);
    for chunk in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(chunk) {
            *a += v;
        }
    }
    for (a, &v) in acc.iter_mut().zip(chunks.remainder()) {
        *a += v;
    }
    acc.iter().sum()
}

/// The largest value of `x` (NaN ignored; -inf for an empty or all-NaN slice), in 16 lanes: a
/// fold through `f32::max` stayed scalar (its NaN rule lane by lane), a third of a softmax over
/// attention scores. The maximum does not depend on the order, so every width gives its bits.
#[inline(always)]
fn max_f32(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let mut chunks = x.chunks_exact(16);
    for chunk in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(chunk) {
            // A NaN is never greater: ignored, as `f32::max` ignores it.
            *a = if v > *a { v } else { *a };
        }
    }
    for (a, &v) in acc.iter_mut().zip(chunks.remainder()) {
        *a = if v > *a { v } else { *a };
    }
    acc.iter()
        .copied()
        .fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m })
}

/// LayerNorm applied to every row of a row-major matrix.
#[inline(always)]
pub fn layer_norm_rows(x: &mut [f32], width: usize, gamma: &[f32], beta: &[f32], eps: f64) {
    for row in x.chunks_exact_mut(width) {
        layer_norm(row, gamma, beta, eps);
    }
}

/// The exact GELU, `x * 0.5 * (1 + erf(x / sqrt(2)))`, evaluated in f64.
#[inline]
pub fn gelu_erf(x: f32) -> f32 {
    let x = x as f64;
    (x * 0.5 * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2))) as f32
}

/// `e^x` for x <= 0 in plain f32 arithmetic that the compiler can vectorise: x = k ln2 + r with
/// |r| <= ln2/2, 2^k built in the exponent bits, e^r by its Taylor series to r^7 (relative error
/// below 3e-8). Arguments below -87 return 0.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    let x = x.max(-87.0);
    // Round-to-nearest of x / ln2 with the 1.5 * 2^23 trick (no libm call, vectorises).
    let k = (x * std::f32::consts::LOG2_E + 12_582_912.0) - 12_582_912.0;
    let r = x - k * std::f32::consts::LN_2;
    // Estrin's scheme: the four pairs and the powers of r are independent, so the series is
    // four dependent steps deep rather than Horner's fourteen. Elementwise loops over HSTU's
    // projections and attention weights were bound by that chain's latency (SiLU 18 % faster).
    let r2 = r * r;
    let r4 = r2 * r2;
    let low = (1.0 + r) + r2 * (0.5 + r * (1.0 / 6.0));
    let high = (1.0 / 24.0 + r * (1.0 / 120.0)) + r2 * (1.0 / 720.0 + r * (1.0 / 5040.0));
    let p = low + r4 * high;
    // 2^k from its exponent bits. k + 127 is an integer in [1, 127]; adding 1.5 * 2^23 puts it in
    // the low mantissa bits, which an integer subtraction then isolates. Written with bit casts
    // only: `k as i32` is a saturating conversion, which kept this loop scalar (its NaN and range
    // checks, lane by lane), at the same value for every k that occurs here.
    let biased = ((k + 127.0) + 12_582_912.0).to_bits() - 0x4B40_0000;
    let two_k = f32::from_bits(biased << 23);
    p * two_k
}

/// erf(x) by Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7), written branch-free so
/// that a whole slice vectorises.
#[inline(always)]
fn erf_fast(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let poly = t
        * (0.254_829_6
            + t * (-0.284_496_74 + t * (1.421_413_7 + t * (-1.453_152 + t * 1.061_405_4))));
    let y = 1.0 - poly * exp_nonpositive(-a * a);
    y.copysign(x)
}

/// The exact-erf GELU over a slice, `x * 0.5 * (1 + erf(x / sqrt(2)))`, with the vectorisable erf
/// above: within 2e-7 * |x| of the f64 formula (tested), far inside the model tolerances, and ~20x
/// cheaper than calling libm's erf per element (GELU was a third of BERT4Rec's encoder time).
#[inline(always)]
pub fn gelu_erf_inplace(x: &mut [f32]) {
    for v in x.iter_mut() {
        *v = *v * 0.5 * (1.0 + erf_fast(*v * std::f32::consts::FRAC_1_SQRT_2));
    }
}

/// SiLU, `x / (1 + e^(-x))`, in plain f32 arithmetic that vectorises: with `t = e^(-|x|)` from the
/// vectorisable exp, `x / (1 + t)` for x >= 0 and `x t / (1 + t)` below (the same value, without
/// e^(-x) overflowing for large negative x). Within `(2e-7 + 1e-7 |x|)` relative of f64 (tested:
/// the exp's reduction by `k ln2` is in f32); HSTU runs it on
/// every projection and every attention weight, where libm's `expf` per element cost a sixth of
/// the pass.
#[inline(always)]
fn silu_fast(x: f32) -> f32 {
    let t = exp_nonpositive(-x.abs());
    let numerator = if x >= 0.0 { x } else { x * t };
    // The exp stops at e^-87: past it, x t would grow again with |x| (f32::MIN gives -5.5).
    let numerator = if x < -87.0 { 0.0 } else { numerator };
    numerator / (1.0 + t)
}

/// [`silu_fast`] over a slice, in place.
pub fn silu_inplace(x: &mut [f32]) {
    for v in x {
        *v = silu_fast(*v);
    }
}

/// Below this |x|, tanh is its Taylor series (to x^11: relative truncation error under 7e-8);
/// above it, `1 - e^(-2|x|)` has no cancellation left to speak of (1 - e^(-0.8) = 0.55).
const TANH_SERIES_BELOW: f32 = 0.4;

/// tanh in plain f32 arithmetic that vectorises: the odd Taylor series near 0, else
/// `(1 - t) / (1 + t)` with `t = e^(-2|x|)` from the vectorisable exp, sign restored. Within
/// 3e-7 relative (tested against f64) and ~10x cheaper than libm's `tanhf` per element, which was
/// 17 % of Mult-VAE's time at batch 64.
#[inline(always)]
pub fn tanh_fast(x: f32) -> f32 {
    let a = x.abs();
    let a2 = a * a;
    let series = a
        * (1.0
            + a2 * (-1.0 / 3.0
                + a2 * (2.0 / 15.0
                    + a2 * (-17.0 / 315.0 + a2 * (62.0 / 2835.0 + a2 * (-1382.0 / 155_925.0))))));
    let t = exp_nonpositive(-2.0 * a);
    let ratio = (1.0 - t) / (1.0 + t);
    // Written so that NaN (which fails every comparison) takes the series and stays NaN.
    let magnitude = if a >= TANH_SERIES_BELOW {
        ratio
    } else {
        series
    };
    magnitude.copysign(x)
}

/// [`tanh_fast`] over a slice.
#[inline(always)]
pub fn tanh_inplace(x: &mut [f32]) {
    for v in x {
        *v = tanh_fast(*v);
    }
}

/// Adds rows `rows` of `table` (`width` floats each, row-major) into `acc`, one row after
/// another (so each column adds the rows in the order given). Vectorised by the ISA it is
/// compiled for; bound by reading the rows (Mult-VAE's first layer, ~165 rows of 600 per
/// history, where chunking the columns into registers and prefetching rows ahead measured no
/// faster).
#[inline(always)]
pub fn add_rows(table: &[f32], width: usize, rows: &[u32], acc: &mut [f32]) {
    assert_eq!(acc.len(), width, "one accumulator per column");
    for &row in rows {
        let base = row as usize * width;
        for (c, w) in acc.iter_mut().zip(&table[base..base + width]) {
            *c += w;
        }
    }
}

/// [`add_rows`] for a table of bfloat16 bits: each value widened exactly to f32 (its bits shifted
/// up 16) and added as [`add_rows`] adds, so a bf16 table sums to the bits of its widened f32
/// copy.
#[inline(always)]
pub fn add_rows_bf16(table: &[u16], width: usize, rows: &[u32], acc: &mut [f32]) {
    assert_eq!(acc.len(), width, "one accumulator per column");
    for &row in rows {
        let base = row as usize * width;
        for (c, &w) in acc.iter_mut().zip(&table[base..base + width]) {
            *c += f32::from_bits(u32::from(w) << 16);
        }
    }
}

/// Numerically stable softmax in place (every exponent is <= 0, so the vectorisable exp applies).
#[inline(always)]
pub fn softmax(x: &mut [f32]) {
    let max = max_f32(x);
    for v in x.iter_mut() {
        *v = exp_nonpositive(*v - max);
    }
    let sum = sum_f32(x);
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    //! Each kernel against a plain f64 evaluation of its formula.
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_lane_maximum_is_the_folds_and_ignores_nan() {
        let fold = |x: &[f32]| x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut x: Vec<f32> = (0..53).map(|i| ((i * 37) % 29) as f32 - 14.5).collect();
        for len in [0, 1, 15, 16, 17, 53] {
            assert_eq!(max_f32(&x[..len]), fold(&x[..len]), "{len} values");
        }
        x[40] = f32::NAN;
        x[3] = f32::NAN;
        assert_eq!(max_f32(&x), fold(&x));
        assert_eq!(max_f32(&[f32::NAN; 20]), f32::NEG_INFINITY);
        x[50] = f32::INFINITY;
        assert_eq!(max_f32(&x), f32::INFINITY);
    }

    proptest! {
        #[test]
        fn layer_norm_matches_f64(row in prop::collection::vec(-100f32..100.0, 2..200), shift in -1000f32..1000.0) {
            let row: Vec<f32> = row.iter().map(|v| v + shift).collect();
            let gamma: Vec<f32> = (0..row.len()).map(|i| 1.0 + i as f32 * 0.01).collect();
            let beta: Vec<f32> = (0..row.len()).map(|i| i as f32 * -0.02).collect();
            let mut got = row.clone();
            layer_norm(&mut got, &gamma, &beta, 1e-12);
            let n = row.len() as f64;
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / n;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
            for i in 0..row.len() {
                let want = (row[i] as f64 - mean) / (var + 1e-12).sqrt() * gamma[i] as f64 + beta[i] as f64;
                prop_assert!((got[i] as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()), "{} vs {}", got[i], want);
            }
        }

        #[test]
        fn softmax_matches_f64(x in prop::collection::vec(-50f32..50.0, 1..100)) {
            let mut got = x.clone();
            softmax(&mut got);
            let max = x.iter().map(|&v| v as f64).fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = x.iter().map(|&v| (v as f64 - max).exp()).sum();
            for i in 0..x.len() {
                let want = (x[i] as f64 - max).exp() / sum;
                prop_assert!((got[i] as f64 - want).abs() <= 1e-6 + 1e-5 * want);
            }
        }
    }

    /// The case the property test once found against f32 statistics: a large mean, a tiny spread.
    #[test]
    fn layer_norm_keeps_a_large_mean_with_a_tiny_spread_exact() {
        let mut row = [-54.906452f32 - 190.5969, -54.401516 - 190.5969];
        layer_norm(&mut row, &[1.0, 1.0], &[0.0, 0.0], 1e-12);
        assert!(
            (row[0] + 1.0).abs() < 1e-5 && (row[1] - 1.0).abs() < 1e-5,
            "{row:?}"
        );
    }

    #[test]
    fn fast_tanh_matches_f64() {
        // Dense near 0 and the series/exp switch, then out to where tanh is 1 in f32.
        let xs = (-40_000..=40_000)
            .map(|i| i as f32 / 4000.0)
            .chain((0..2000).map(|i| 1e-30f32 * 1.1f32.powi(i)))
            .chain([
                0.0,
                -0.0,
                0.4,
                0.399_999_98,
                50.0,
                -100.0,
                f32::MAX,
                f32::MIN,
            ]);
        for x in xs {
            let want = (x as f64).tanh();
            let got = tanh_fast(x) as f64;
            assert!(
                (got - want).abs() <= 3e-7 * want.abs(),
                "tanh({x}) = {got}, want {want}"
            );
            assert_eq!(
                tanh_fast(x).is_sign_negative(),
                x.is_sign_negative(),
                "sign of tanh({x})"
            );
        }
        assert!(tanh_fast(f32::NAN).is_nan());
    }

    /// SiLU against `x / (1 + e^-x)` in f64, over the range HSTU's projections and attention
    /// scores reach and its extremes; NaN stays NaN.
    #[test]
    fn fast_silu_matches_the_f64_formula() {
        let xs = (-32_000..=40_000).map(|i| i as f32 / 400.0).chain([
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            f32::MAX,
        ]);
        for x in xs {
            let want = x as f64 / (1.0 + (-(x as f64)).exp());
            let got = silu_fast(x) as f64;
            // The exp's relative error grows with |x| (its reduction by k ln2 is done in f32).
            let bound = (2e-7 + 1e-7 * (x as f64).abs()) * want.abs();
            assert!(
                (got - want).abs() <= bound,
                "silu({x}) = {got}, want {want}"
            );
        }
        // Below -87 (where the exp stops) 0, for every x down to f32::MIN.
        for x in [-87.5f32, -100.0, -1e4, -1e30, f32::MIN] {
            assert_eq!(silu_fast(x), 0.0, "silu({x})");
        }
        assert!(silu_fast(f32::NAN).is_nan());
    }

    #[test]
    fn fast_gelu_matches_the_f64_formula() {
        let xs: Vec<f32> = (-20_000..=20_000).map(|i| i as f32 / 1000.0).collect();
        let mut got = xs.clone();
        gelu_erf_inplace(&mut got);
        for (x, g) in xs.iter().zip(&got) {
            let want = gelu_erf(*x) as f64;
            assert!(
                (*g as f64 - want).abs() <= 2e-7 * (1.0 + x.abs() as f64),
                "gelu({x}) = {g}, want {want}"
            );
        }
    }

    #[test]
    fn gelu_matches_reference_values() {
        // Values of x * Phi(x) computed independently (erf from the standard normal CDF table).
        for (x, want) in [
            (0.0f32, 0.0f64),
            (1.0, 0.841_344_746_068_542_9),
            (-1.0, -0.158_655_253_931_457_05),
            (3.0, 2.995_950_094_208_920_5),
            (-3.0, -0.004_049_905_791_079_5),
        ] {
            assert!(
                (gelu_erf(x) as f64 - want).abs() < 1e-6,
                "gelu({x}) = {} want {want}",
                gelu_erf(x)
            );
        }
    }
}
