//! What the device tests and the emulated tests share: random inputs and the scalar f64 reference
//! they are checked against.
#![allow(dead_code)] // each test binary uses its own part

use recsys_engine::tensor::Tensor;
use recsys_engine::weights::Matrix;
use recsys_gpu::device::{CandidatesMut, Device, Stage1Inputs};
use recsys_gpu::{gemv_launch, row_pitch, stage1_launch, Ranked, MAX_ROWS};

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

/// Every item's score on `device` through the sample kernel of the coalesced strategy (GEMV up
/// to 4 rows, GEMM above) at stride 1, ranked on the host: the exact top-`k` in the very bits the
/// strategy's threshold scan computes, which must therefore return exactly this.
pub fn coalesced_exhaustive_topk<D: Device>(
    device: &D,
    w: &Matrix,
    bias: &[f32],
    hidden: &[f32],
    k: usize,
    exclude: &[Vec<u32>],
) -> Vec<Ranked> {
    let (n, d, rows) = (w.rows(), w.cols(), exclude.len());
    let bytes = match w {
        Matrix::F32(_) => 4,
        Matrix::F16 { .. } => 2,
        Matrix::I8 { .. } => 1,
        other => panic!("no GPU table for {other:?}"),
    };
    let pitch = row_pitch(d, bytes);
    let weights = recsys_gpu::upload::upload_padded_matrix(device, w, pitch).unwrap();
    let bias_on_device = device.upload_f32(bias).unwrap();
    let refs: Vec<&[u32]> = exclude.iter().map(Vec::as_slice).collect();
    let (offsets, ids) = recsys_gpu::exclusion_csr(&refs);
    let (offsets, ids) = (
        device.upload_u32(&offsets).unwrap(),
        device.upload_u32(&ids).unwrap(),
    );
    let hidden = device.upload_f32(hidden).unwrap();
    let launch = stage1_launch(n, d, pitch, rows, k).unwrap();
    let inputs = Stage1Inputs {
        launch: &launch,
        hidden: &hidden,
        weights: &weights,
        activation_scale: 0.0,
        bias: &bias_on_device,
        exclude_offsets: &offsets,
        exclude_ids: &ids,
        batch: rows as u32,
        n_items: n as u32,
        dim: d as u32,
    };
    let (mut scores, mut index) = (
        device.alloc_f32(rows * n).unwrap(),
        device.alloc_u32(rows * n).unwrap(),
    );
    let out = CandidatesMut {
        scores: &mut scores,
        index: &mut index,
    };
    let blocks = device
        .gemv_resident_blocks(&weights, (4 * pitch * MAX_ROWS) as u32)
        .unwrap();
    match gemv_launch(pitch, bytes, rows, blocks) {
        Some(gemv) => device.gemv_sample(&inputs, &gemv, 1, n as u32, out),
        None => device.gemm_sample(&inputs, 1, n as u32, out),
    }
    .unwrap();
    let (scores, index) = (
        device.download_f32(&scores, rows * n).unwrap(),
        device.download_u32(&index, rows * n).unwrap(),
    );
    (0..rows)
        .map(|r| {
            let mut row: Vec<(u32, f32)> = (0..n)
                .map(|i| (index[r * n + i], scores[r * n + i]))
                .filter(|(i, _)| *i != u32::MAX)
                .collect();
            row.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            row.truncate(k);
            row
        })
        .collect()
}
