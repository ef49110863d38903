//! The fused score + top-k on a device, sequenced from the host: the output layer uploaded once,
//! then per batch the exclusions staged, the scan (by tiles, or by a sampled threshold:
//! [`ScanStrategy`]) and the merge passes, and the answers read back.

use std::sync::{Arc, OnceLock};

use recsys_engine::tensor::Tensor;
use recsys_engine::weights::Matrix;

use crate::device::{
    Candidates, CandidatesMut, Device, DeviceMatrix, Stage1Inputs, SurvivorsMut, Thresholds,
};
use crate::upload::{element_bytes, upload_padded_matrix};
use crate::{
    exclusion_csr, gemv_launch, merge_plan, ranked_rows, stage1_launch, threshold_plan, GemvLaunch,
    GpuError, Ranked, Result, Stage1Launch, ThresholdPlan, MAX_ROWS, SURVIVOR_CAPACITY, TILE,
};

/// How the fused score + top-k scans the catalogue. Both give the same answers (each exact, the
/// tests hold them to the same reference); which is faster is the GPU's to say (the bundle's
/// benchmark times both).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ScanStrategy {
    /// Stage 1 keeps each tile's best `k` on chip (selecting, or sorting the tile above k = 32);
    /// merge passes finish.
    #[default]
    Tiles,
    /// A strided sample's k-th best is each row's threshold; the full scan keeps only the scores
    /// that reach it, and merge passes finish those. Where [`threshold_plan`] finds no sample
    /// worth taking (a small catalogue, a large k), the tile scan runs instead; a row whose
    /// survivors overflow their slots is answered by the tile scan too.
    Threshold,
    /// The threshold scan with both its passes (the sample and the full scan) through kernels
    /// that read weight rows contiguously: for batches of at most [`crate::MAX_ROWS`] rows (the
    /// serving case at batch 1) the coalesced scans (`gemv_*`: a warp reads consecutive item rows
    /// whole), for larger ones the tiled scans (`gemm_*`: the batch's scores as a matrix product
    /// over shared-memory tiles, each weight read from HBM once for up to 64 rows).
    CoalescedThreshold,
}

/// The kernels of one threshold scan's sample and full pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ThresholdPasses {
    /// `sample_tile_topk_*` and `score_above_*`.
    Tiles,
    /// `gemv_sample_*` and `gemv_above_*`.
    Gemv(GemvLaunch),
    /// `gemm_sample_*` and `gemm_above_*`.
    Gemm,
}

/// The output layer on a device, for the fused score + top-k.
pub struct DeviceOutputLayer<D: Device> {
    /// `[n_items, pitch]` (or more rows, of which the first n_items are read): BERT4Rec's output
    /// layer shares its item embedding's upload when its rows need no padding.
    weights: Arc<DeviceMatrix<D>>,
    /// Elements per stored row ([`crate::row_pitch`]).
    pub pitch: usize,
    bias: D::F32,
    /// W8A8 engines' static activation scale; 0 for the others.
    activation_scale: f32,
    pub n_items: usize,
    pub dim: usize,
    pub strategy: ScanStrategy,
    /// Survivor slots per row of the threshold scan ([`SURVIVOR_CAPACITY`]; the tests lower it
    /// to make rows overflow).
    pub survivor_capacity: usize,
    /// Blocks of the coalesced scans the device runs at once, asked once (for the largest batch
    /// they take, whose shared memory bounds occupancy the most).
    gemv_blocks: OnceLock<u32>,
}

/// What a threshold scan answered: every row's top-k, and the rows whose survivors overflowed
/// their slots and were answered by the tile scan instead.
pub struct ThresholdAnswer {
    pub ranked: Vec<Ranked>,
    pub overflowed: Vec<usize>,
}

impl<D: Device> DeviceOutputLayer<D> {
    /// Uploads `weight` (`[n_items, dim]`) and `bias`.
    pub fn new(
        device: &D,
        weight: &Matrix,
        bias: &Tensor,
        activation_scale: Option<f32>,
    ) -> Result<Self> {
        Self::check(weight, bias, activation_scale)?;
        let pitch = crate::row_pitch(weight.cols(), element_bytes(weight));
        let uploaded = Arc::new(upload_padded_matrix(device, weight, pitch)?);
        Self::assemble(device, uploaded, pitch, weight, bias, activation_scale)
    }

    /// Uses `uploaded`, whose first rows hold `weight` already on the device, and uploads `bias`;
    /// when the scoring kernel needs the rows padded ([`crate::row_pitch`]), it uploads a padded
    /// copy of its own instead.
    pub fn sharing(
        device: &D,
        uploaded: Arc<DeviceMatrix<D>>,
        weight: &Matrix,
        bias: &Tensor,
        activation_scale: Option<f32>,
    ) -> Result<Self> {
        Self::check(weight, bias, activation_scale)?;
        let pitch = crate::row_pitch(weight.cols(), element_bytes(weight));
        let uploaded = if pitch == weight.cols() {
            uploaded
        } else {
            Arc::new(upload_padded_matrix(device, weight, pitch)?)
        };
        Self::assemble(device, uploaded, pitch, weight, bias, activation_scale)
    }

    fn assemble(
        device: &D,
        uploaded: Arc<DeviceMatrix<D>>,
        pitch: usize,
        weight: &Matrix,
        bias: &Tensor,
        activation_scale: Option<f32>,
    ) -> Result<Self> {
        Ok(DeviceOutputLayer {
            weights: uploaded,
            pitch,
            bias: device.upload_f32(bias.as_slice())?,
            activation_scale: activation_scale.unwrap_or(0.0),
            n_items: weight.rows(),
            dim: weight.cols(),
            strategy: ScanStrategy::default(),
            survivor_capacity: SURVIVOR_CAPACITY,
            gemv_blocks: OnceLock::new(),
        })
    }

    fn check(weight: &Matrix, bias: &Tensor, activation_scale: Option<f32>) -> Result<()> {
        let (n_items, dim) = (weight.rows(), weight.cols());
        if dim == 0 || dim > crate::MAX_DIM {
            return Err(GpuError::Invalid(format!(
                "hidden size {dim}: the GPU kernels take 1..={}",
                crate::MAX_DIM
            )));
        }
        if bias.len() != n_items {
            return Err(GpuError::Invalid(format!(
                "{} biases for {n_items} items",
                bias.len()
            )));
        }
        if activation_scale.is_some() && !matches!(weight, Matrix::I8 { .. }) {
            return Err(GpuError::Invalid(
                "a static activation scale needs int8 output weights".into(),
            ));
        }
        Ok(())
    }

    /// What a scan launched as `launch` reads: `rows` hidden vectors, this layer's tables and the
    /// batch's exclusions ([`upload_exclusions`]).
    fn scan_inputs<'a>(
        &'a self,
        launch: &'a Stage1Launch,
        hidden: &'a D::F32,
        (offsets, ids): &'a (D::U32, D::U32),
        rows: usize,
    ) -> Stage1Inputs<'a, D> {
        Stage1Inputs {
            launch,
            hidden,
            weights: &self.weights,
            activation_scale: self.activation_scale,
            bias: &self.bias,
            exclude_offsets: offsets,
            exclude_ids: ids,
            batch: rows as u32,
            n_items: self.n_items as u32,
            dim: self.dim as u32,
        }
    }

    /// The kernels of the threshold scan's two passes for a batch of `rows` under this layer's
    /// strategy.
    fn passes_for(&self, device: &D, rows: usize) -> Result<ThresholdPasses> {
        if self.strategy != ScanStrategy::CoalescedThreshold {
            return Ok(ThresholdPasses::Tiles);
        }
        if rows > MAX_ROWS {
            return Ok(ThresholdPasses::Gemm);
        }
        let element_bytes = match &*self.weights {
            DeviceMatrix::F32(_) => 4,
            DeviceMatrix::F16(_) => 2,
            DeviceMatrix::I8 { .. } => 1,
        };
        let blocks = match self.gemv_blocks.get() {
            Some(&blocks) => blocks,
            None => {
                let most = (4 * self.pitch * MAX_ROWS) as u32;
                let blocks = device.gemv_resident_blocks(&self.weights, most)?;
                *self.gemv_blocks.get_or_init(|| blocks)
            }
        };
        Ok(gemv_launch(self.pitch, element_bytes, rows, blocks)
            .map_or(ThresholdPasses::Gemm, ThresholdPasses::Gemv))
    }

    /// Top-`k` items for each of the `exclude.len()` hidden vectors in `hidden` (`[rows, dim]`,
    /// already on the device), leaving out index 0 (PAD) and each row's `exclude` list.
    pub fn top_k(
        &self,
        device: &D,
        hidden: &D::F32,
        k: usize,
        exclude: &[&[u32]],
    ) -> Result<Vec<Ranked>> {
        if self.strategy != ScanStrategy::Tiles {
            if let Some(plan) = threshold_plan(self.n_items, k, self.survivor_capacity) {
                return Ok(self
                    .top_k_above_threshold(device, hidden, k, exclude, &plan)?
                    .ranked);
            }
        }
        self.top_k_by_tiles(device, hidden, k, exclude)
    }

    /// [`Self::top_k`] by the tile scan.
    pub fn top_k_by_tiles(
        &self,
        device: &D,
        hidden: &D::F32,
        k: usize,
        exclude: &[&[u32]],
    ) -> Result<Vec<Ranked>> {
        let rows = exclude.len();
        let Some(launched) = self.launch_top_k(device, hidden, k, exclude)? else {
            return Ok(Vec::new());
        };
        let scores = device.download_f32(&launched.scores)?;
        let index = device.download_u32(&launched.index)?;
        Ok(ranked_rows(&scores, &index, &launched.plan, rows, k))
    }

    /// Enqueues the kernels of [`Self::top_k`] (exclusions staged, stage 1, the merge passes) and
    /// returns their output buffers without waiting: the benchmark times exactly this span with
    /// device events. `None` for an empty batch.
    pub fn launch_top_k(
        &self,
        device: &D,
        hidden: &D::F32,
        k: usize,
        exclude: &[&[u32]],
    ) -> Result<Option<LaunchedTopK<D>>> {
        let rows = exclude.len();
        if rows == 0 {
            return Ok(None);
        }
        let launch = stage1_launch(self.n_items, self.dim, self.pitch, rows, k)?;
        let plan = merge_plan(self.n_items, k);
        let exclusions = upload_exclusions(device, exclude)?;
        let mut scores = device.alloc_f32(rows * plan[0])?;
        let mut index = device.alloc_u32(rows * plan[0])?;
        device.score_tile_topk(
            &self.scan_inputs(&launch, hidden, &exclusions, rows),
            CandidatesMut {
                scores: &mut scores,
                index: &mut index,
            },
        )?;
        let (scores, index) = merge_passes(device, rows, scores, index, &plan, launch.keep)?;
        Ok(Some(LaunchedTopK {
            scores,
            index,
            plan,
        }))
    }

    /// The threshold scan for `plan` ([`threshold_plan`]): each row's top-`k`, the rows whose
    /// survivors overflowed answered by the tile scan.
    pub fn top_k_above_threshold(
        &self,
        device: &D,
        hidden: &D::F32,
        k: usize,
        exclude: &[&[u32]],
        plan: &ThresholdPlan,
    ) -> Result<ThresholdAnswer> {
        let rows = exclude.len();
        let Some(launched) = self.launch_above_threshold(device, hidden, k, exclude, plan)? else {
            return Ok(ThresholdAnswer {
                ranked: Vec::new(),
                overflowed: Vec::new(),
            });
        };
        let scores = device.download_f32(&launched.scores)?;
        let index = device.download_u32(&launched.index)?;
        let counts = device.download_u32(&launched.counts)?;
        let mut ranked = ranked_rows(&scores, &index, &launched.plan, rows, k);
        let overflowed: Vec<usize> = (0..rows)
            .filter(|&r| counts[r] as usize > plan.capacity)
            .collect();
        if !overflowed.is_empty() {
            let picked: Vec<u32> = overflowed.iter().map(|&r| r as u32).collect();
            let mut again = device.alloc_f32(picked.len() * self.dim)?;
            device.gather_rows(
                hidden,
                &device.upload_u32(&picked)?,
                &mut again,
                picked.len() as u32,
                self.dim as u32,
            )?;
            let their_exclusions: Vec<&[u32]> = overflowed.iter().map(|&r| exclude[r]).collect();
            let exact = self.top_k_by_tiles(device, &again, k, &their_exclusions)?;
            for (&r, answer) in overflowed.iter().zip(exact) {
                ranked[r] = answer;
            }
        }
        Ok(ThresholdAnswer { ranked, overflowed })
    }

    /// Enqueues the threshold scan without waiting: the sample's scan and its k-th best (each
    /// row's threshold stays on the device; by merge passes after the tile kernels, by a radix
    /// select after the coalesced ones), the survivors emptied, the full scan against the
    /// thresholds, and the finish of the survivors; both scans through the kernels that read rows
    /// contiguously where the strategy asks for them ([`ScanStrategy::CoalescedThreshold`]),
    /// else by tiles. `None` for an empty batch.
    pub fn launch_above_threshold(
        &self,
        device: &D,
        hidden: &D::F32,
        k: usize,
        exclude: &[&[u32]],
        plan: &ThresholdPlan,
    ) -> Result<Option<LaunchedThreshold<D>>> {
        let rows = exclude.len();
        if rows == 0 {
            return Ok(None);
        }
        let exclusions = upload_exclusions(device, exclude)?;
        let inputs = |launch| self.scan_inputs(launch, hidden, &exclusions, rows);
        let scan = stage1_launch(self.n_items, self.dim, self.pitch, rows, k)?;
        let sample = stage1_launch(plan.positions, self.dim, self.pitch, rows, k)?;
        let passes = self.passes_for(device, rows)?;
        let capacity = plan.capacity as u32;
        let mut counts = device.alloc_u32(rows)?;
        let mut survivors = device.alloc_f32(rows * plan.capacity)?;
        let mut survivor_index = device.alloc_u32(rows * plan.capacity)?;
        // The sample's k-th best (or -inf) is the row's threshold; the survivors start empty.
        let (thresholds, threshold_pitch, threshold_at) = if passes == ThresholdPasses::Tiles {
            let sample_plan = merge_plan(plan.positions, k);
            let mut scores = device.alloc_f32(rows * sample_plan[0])?;
            let mut index = device.alloc_u32(rows * sample_plan[0])?;
            device.sample_tile_topk(
                &inputs(&sample),
                plan.stride as u32,
                CandidatesMut {
                    scores: &mut scores,
                    index: &mut index,
                },
            )?;
            let (thresholds, _) =
                merge_passes(device, rows, scores, index, &sample_plan, sample.keep)?;
            device.reset_survivors(
                rows as u32,
                SurvivorsMut {
                    counts: &mut counts,
                    scores: &mut survivors,
                    index: &mut survivor_index,
                    capacity,
                },
            )?;
            let pitch = *sample_plan.last().expect("a plan is never empty");
            (thresholds, pitch, k - 1)
        } else {
            // Every sampled score, in the bits the full scan will compute; one launch then
            // selects each row's k-th best and empties its survivor slots.
            let mut scores = device.alloc_f32(rows * plan.positions)?;
            let mut index = device.alloc_u32(rows * plan.positions)?;
            let (stride, positions) = (plan.stride as u32, plan.positions as u32);
            let out = CandidatesMut {
                scores: &mut scores,
                index: &mut index,
            };
            match &passes {
                ThresholdPasses::Gemv(gemv) => {
                    device.gemv_sample(&inputs(&scan), gemv, stride, positions, out)?
                }
                _ => device.gemm_sample(&inputs(&scan), stride, positions, out)?,
            }
            let mut thresholds = device.alloc_f32(rows)?;
            device.sample_threshold(
                rows as u32,
                &scores,
                positions,
                k as u32,
                &mut thresholds,
                SurvivorsMut {
                    counts: &mut counts,
                    scores: &mut survivors,
                    index: &mut survivor_index,
                    capacity,
                },
            )?;
            (thresholds, 1, 0)
        };
        let thresholds = Thresholds {
            scores: &thresholds,
            pitch: threshold_pitch as u32,
            at: threshold_at as u32,
        };
        let slots = SurvivorsMut {
            counts: &mut counts,
            scores: &mut survivors,
            index: &mut survivor_index,
            capacity,
        };
        match &passes {
            ThresholdPasses::Tiles => device.score_above(&inputs(&scan), thresholds, slots)?,
            ThresholdPasses::Gemv(gemv) => {
                device.gemv_above(&inputs(&scan), gemv, thresholds, slots)?
            }
            ThresholdPasses::Gemm => device.gemm_above(&inputs(&scan), thresholds, slots)?,
        }
        // One launch finishes every row: a radix select of its k-th best, then a sort of those
        // at or above it.
        let mut scores = device.alloc_f32(rows * k)?;
        let mut index = device.alloc_u32(rows * k)?;
        device.finalize_survivors(
            rows as u32,
            &mut counts,
            Candidates {
                scores: &survivors,
                index: &survivor_index,
            },
            capacity,
            k as u32,
            CandidatesMut {
                scores: &mut scores,
                index: &mut index,
            },
        )?;
        Ok(Some(LaunchedThreshold {
            scores,
            index,
            plan: vec![k],
            counts,
        }))
    }
}

/// Each row's exclusions on the device, as CSR (offsets, ids): what every scan of the batch reads.
fn upload_exclusions<D: Device>(device: &D, exclude: &[&[u32]]) -> Result<(D::U32, D::U32)> {
    let (offsets, ids) = exclusion_csr(exclude);
    Ok((device.upload_u32(&offsets)?, device.upload_u32(&ids)?))
}

/// Merge passes over `rows` rows of candidates, `plan[0]` per row, down to `plan.last()`
/// (each pass keeping `keep` of every block of the tile size).
fn merge_passes<D: Device>(
    device: &D,
    rows: usize,
    mut scores: D::F32,
    mut index: D::U32,
    plan: &[usize],
    keep: u32,
) -> Result<(D::F32, D::U32)> {
    for window in plan.windows(2) {
        let (count, next) = (window[0], window[1]);
        debug_assert_eq!(next, count.div_ceil(TILE) * keep as usize);
        let mut next_scores = device.alloc_f32(rows * next)?;
        let mut next_index = device.alloc_u32(rows * next)?;
        device.merge_topk(
            rows as u32,
            Candidates {
                scores: &scores,
                index: &index,
            },
            count as u32,
            keep,
            CandidatesMut {
                scores: &mut next_scores,
                index: &mut next_index,
            },
        )?;
        scores = next_scores;
        index = next_index;
    }
    Ok((scores, index))
}

/// The device buffers a threshold scan's finish writes (`rows x plan.last()`, `plan` being
/// `[k]`, sorted within each row), and each row's survivor count (more than the capacity:
/// overflowed, or tied too widely to finish; the host answers it by the tile scan).
pub struct LaunchedThreshold<D: Device> {
    pub scores: D::F32,
    pub index: D::U32,
    pub plan: Vec<usize>,
    pub counts: D::U32,
}

/// The device buffers the last merge pass writes (`rows x plan.last()`, sorted within each row).
pub struct LaunchedTopK<D: Device> {
    pub scores: D::F32,
    pub index: D::U32,
    pub plan: Vec<usize>,
}
