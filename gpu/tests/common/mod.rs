//! What the device tests and the emulated tests share: random inputs and the scalar f64 reference
//! they are checked against.
#![allow(dead_code)] // each test binary uses its own part

use recsys_engine::tensor::Tensor;
use recsys_engine::weights::Matrix;

/// Score tolerance of the kernels (f32 accumulation in another order) against f64.
pub const SCORE_ABS_TOL: f32 = 1e-4;

pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// A random `[n, d]` output-layer weight at precision `kind` ("f32", "f16" or "i8").
pub fn matrix(kind: &str, n: usize, d: usize, rng: &mut Rng) -> Matrix {
    let values: Vec<f32> = (0..n * d).map(|_| rng.uniform()).collect();
    match kind {
        "f32" => Matrix::F32(Tensor::from_vec(vec![n, d], values)),
        "f16" => Matrix::F16 {
            bits: recsys_engine::elements::Elements::from_vec(
                values
                    .iter()
                    .map(|v| half::f16::from_f32(*v).to_bits())
                    .collect(),
            ),
            start: 0,
            rows: n,
            cols: d,
        },
        _ => {
            let scales: Vec<f32> = (0..n).map(|_| 0.5 + rng.uniform().abs()).collect();
            Matrix::I8 {
                q: recsys_engine::elements::Elements::from_vec(
                    (0..n * d).map(|_| (rng.next() % 255) as i8).collect(),
                ),
                scales: recsys_engine::elements::Elements::from_vec(
                    scales.iter().map(|s| s / 127.0).collect(),
                ),
                start: 0,
                rows: n,
                cols: d,
            }
        }
    }
}

/// Up to `max_len` random exclusions per row, duplicates and index 0 included on purpose.
pub fn exclusions(rows: usize, n: usize, max_len: u64, rng: &mut Rng) -> Vec<Vec<u32>> {
    (0..rows)
        .map(|_| {
            (0..(rng.next() % (max_len + 1)))
                .map(|_| (rng.next() % n as u64) as u32)
                .collect()
        })
        .collect()
}

/// Reference top-k in f64 with the engine's rules: PAD (index 0) and `excluded` never appear,
/// higher score first, ties to the lower index.
pub fn reference(
    w: &Matrix,
    bias: &[f32],
    h: &[f32],
    k: usize,
    excluded: &[u32],
) -> Vec<(u32, f32)> {
    let d = w.cols();
    let mut all: Vec<(u32, f64)> = (1..w.rows())
        .filter(|i| !excluded.contains(&(*i as u32)))
        .map(|i| {
            let mut row = vec![0f32; d];
            w.add_row_into(i, &mut row);
            let dot: f64 = row.iter().zip(h).map(|(a, b)| *a as f64 * *b as f64).sum();
            (i as u32, dot + bias[i] as f64)
        })
        .collect();
    all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    all.truncate(k);
    all.into_iter().map(|(i, s)| (i, s as f32)).collect()
}

/// Items past k the reference keeps, so that a near-tie swap at the last rank (a kernel keeping
/// the item the reference ranks k+1 by a rounding difference) finds that item's reference score.
const TIE_MARGIN: usize = 16;

/// Asserts one row's top-`k` answer against the f64 reference computed here (see
/// [`assert_row_matches`]).
#[allow(clippy::too_many_arguments)]
pub fn assert_top_k_matches(
    got: &[(u32, f32)],
    w: &Matrix,
    bias: &[f32],
    h: &[f32],
    k: usize,
    excluded: &[u32],
    what: &str,
) {
    let want = reference(w, bias, h, k + TIE_MARGIN, excluded);
    assert_row_matches(got, &want, k, what);
}

/// Asserts one row's top-`k` answer against a reference ranking of at least k entries where the
/// catalogue allows (more are only consulted for ties): the length the reference allows, every
/// score within SCORE_ABS_TOL of the reference's at that rank, and an index different from the
/// reference's only where the reference holds that index at a near-tie score.
pub fn assert_row_matches(got: &[(u32, f32)], want: &[(u32, f32)], k: usize, what: &str) {
    assert_eq!(got.len(), want.len().min(k), "{what}: length");
    for (pos, (g, e)) in got.iter().zip(want).enumerate() {
        assert!(
            (g.1 - e.1).abs() <= SCORE_ABS_TOL,
            "{what} rank {pos}: {g:?} vs {e:?}"
        );
        if g.0 != e.0 {
            let tie = want
                .iter()
                .any(|o| o.0 == g.0 && (o.1 - e.1).abs() <= 2.0 * SCORE_ABS_TOL);
            assert!(tie, "{what} rank {pos}: {g:?} vs {e:?}");
        }
    }
}
