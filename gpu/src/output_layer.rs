//! The fused score + top-k on a device, sequenced from the host: the output layer uploaded once,
//! then per batch the exclusions staged, the scan (by tiles, or by a sampled threshold:
//! [`ScanStrategy`]) and the merge passes, and the answers read back; every buffer a batch writes
//! is one the layer keeps ([`TopKWorkspace`]).

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use recsys_engine::tensor::Tensor;
use recsys_engine::weights::Matrix;

use crate::device::{
    Candidates, CandidatesMut, Device, DeviceMatrix, Stage1Inputs, SurvivorsMut, Thresholds,
};
use crate::upload::{element_bytes, upload_padded_matrix};
use crate::workspace::{CandidateSlots, Grown, Slot, TopKWorkspace};
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
    /// The buffers every batch's scan reuses: one model instance owns this layer, and its
    /// batches run one at a time.
    workspace: Mutex<TopKWorkspace<D>>,
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
            workspace: Mutex::new(TopKWorkspace::default()),
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
    /// batch's exclusions (uploaded by [`upload_exclusions`]).
    fn scan_inputs<'a>(
        &'a self,
        launch: &'a Stage1Launch,
        hidden: &'a D::F32,
        (offsets, ids): (&'a Grown<D::U32>, &'a Grown<D::U32>),
        rows: usize,
    ) -> Stage1Inputs<'a, D> {
        Stage1Inputs {
            launch,
            hidden,
            weights: &self.weights,
            activation_scale: self.activation_scale,
            bias: &self.bias,
            exclude_offsets: offsets.get(),
            exclude_ids: ids.get(),
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

    /// This layer's kept buffers ([`TopKWorkspace`]); one batch at a time uses them.
    fn workspace(&self) -> MutexGuard<'_, TopKWorkspace<D>> {
        self.workspace
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Device allocations the scans have made so far (their kept buffers' first uses and
    /// growths): batches no larger than earlier ones add none.
    pub fn workspace_allocations(&self) -> usize {
        self.workspace().allocations()
    }

    /// [`Self::top_k`] by the tile scan.
    pub fn top_k_by_tiles(
        &self,
        device: &D,
        hidden: &D::F32,
        k: usize,
        exclude: &[&[u32]],
    ) -> Result<Vec<Ranked>> {
        let mut workspace = self.workspace();
        self.tiles_in(&mut workspace, device, hidden, k, exclude)
    }

    fn tiles_in(
        &self,
        workspace: &mut TopKWorkspace<D>,
        device: &D,
        hidden: &D::F32,
        k: usize,
        exclude: &[&[u32]],
    ) -> Result<Vec<Ranked>> {
        let rows = exclude.len();
        let Some(launched) = self.enqueue_tiles(workspace, device, hidden, k, exclude)? else {
            return Ok(Vec::new());
        };
        let len = rows * launched.width();
        let slots = &workspace.candidates[launched.slot];
        let scores = device.download_f32(slots.scores.get(), len)?;
        let index = device.download_u32(slots.index.get(), len)?;
        Ok(ranked_rows(&scores, &index, &launched.plan, rows, k))
    }

    /// Enqueues the kernels of [`Self::top_k`] by the tile scan (exclusions staged, stage 1, the
    /// merge passes) without waiting, into this layer's kept buffers: the benchmark times exactly
    /// this span with device events. `None` for an empty batch.
    pub fn launch_top_k(
        &self,
        device: &D,
        hidden: &D::F32,
        k: usize,
        exclude: &[&[u32]],
    ) -> Result<Option<Enqueued>> {
        let mut workspace = self.workspace();
        self.enqueue_tiles(&mut workspace, device, hidden, k, exclude)
    }

    fn enqueue_tiles(
        &self,
        workspace: &mut TopKWorkspace<D>,
        device: &D,
        hidden: &D::F32,
        k: usize,
        exclude: &[&[u32]],
    ) -> Result<Option<Enqueued>> {
        let rows = exclude.len();
        if rows == 0 {
            return Ok(None);
        }
        let launch = stage1_launch(self.n_items, self.dim, self.pitch, rows, k)?;
        let plan = merge_plan(self.n_items, k);
        upload_exclusions(workspace, device, exclude)?;
        reserve_merge(workspace, device, rows, &plan)?;
        let ws = workspace;
        let [first, _] = &mut ws.candidates;
        device.score_tile_topk(
            &self.scan_inputs(
                &launch,
                hidden,
                (&ws.exclude_offsets, &ws.exclude_ids),
                rows,
            ),
            CandidatesMut {
                scores: first.scores.get_mut(),
                index: first.index.get_mut(),
            },
        )?;
        let slot = merge_passes(device, rows, &mut ws.candidates, &plan, launch.keep)?;
        Ok(Some(Enqueued { plan, slot }))
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
        let mut workspace = self.workspace();
        let ws = &mut *workspace;
        let Some(launched) = self.enqueue_threshold(ws, device, hidden, k, exclude, plan)? else {
            return Ok(ThresholdAnswer {
                ranked: Vec::new(),
                overflowed: Vec::new(),
            });
        };
        let scores = device.download_f32(ws.answers.scores.get(), rows * k)?;
        let index = device.download_u32(ws.answers.index.get(), rows * k)?;
        let counts = device.download_u32(ws.counts.get(), rows)?;
        let mut ranked = ranked_rows(&scores, &index, &launched.plan, rows, k);
        let overflowed: Vec<usize> = (0..rows)
            .filter(|&r| counts[r] as usize > plan.capacity)
            .collect();
        if !overflowed.is_empty() {
            let picked: Vec<u32> = overflowed.iter().map(|&r| r as u32).collect();
            let mut again = ws.take_overflow(device, &picked, self.dim)?;
            device.gather_rows(
                hidden,
                &again.rows.0,
                &mut again.hidden.0,
                picked.len() as u32,
                self.dim as u32,
            )?;
            let their_exclusions: Vec<&[u32]> = overflowed.iter().map(|&r| exclude[r]).collect();
            let exact = self.tiles_in(ws, device, &again.hidden.0, k, &their_exclusions);
            ws.restore_overflow(again);
            for (&r, answer) in overflowed.iter().zip(exact?) {
                ranked[r] = answer;
            }
        }
        Ok(ThresholdAnswer { ranked, overflowed })
    }

    /// Enqueues the threshold scan without waiting, into this layer's kept buffers: the sample's
    /// scan and its k-th best (each row's threshold stays on the device; by merge passes after
    /// the tile kernels, by a radix select after the coalesced ones), the survivors emptied, the
    /// full scan against the thresholds, and the finish of the survivors; both scans through the
    /// kernels that read rows contiguously where the strategy asks for them
    /// ([`ScanStrategy::CoalescedThreshold`]), else by tiles. `None` for an empty batch.
    pub fn launch_above_threshold(
        &self,
        device: &D,
        hidden: &D::F32,
        k: usize,
        exclude: &[&[u32]],
        plan: &ThresholdPlan,
    ) -> Result<Option<Enqueued>> {
        let mut workspace = self.workspace();
        self.enqueue_threshold(&mut workspace, device, hidden, k, exclude, plan)
    }

    fn enqueue_threshold(
        &self,
        workspace: &mut TopKWorkspace<D>,
        device: &D,
        hidden: &D::F32,
        k: usize,
        exclude: &[&[u32]],
        plan: &ThresholdPlan,
    ) -> Result<Option<Enqueued>> {
        let rows = exclude.len();
        if rows == 0 {
            return Ok(None);
        }
        let scan = stage1_launch(self.n_items, self.dim, self.pitch, rows, k)?;
        let sample = stage1_launch(plan.positions, self.dim, self.pitch, rows, k)?;
        let passes = self.passes_for(device, rows)?;
        let capacity = plan.capacity as u32;
        let sample_plan = merge_plan(plan.positions, k);
        // Every buffer first, so that the launches below borrow the workspace's fields apart.
        upload_exclusions(workspace, device, exclude)?;
        workspace.reserve_rows(device, rows)?;
        workspace.reserve(device, Slot::Survivors, rows * plan.capacity)?;
        workspace.reserve(device, Slot::Answers, rows * k)?;
        if passes == ThresholdPasses::Tiles {
            reserve_merge(workspace, device, rows, &sample_plan)?;
        } else {
            workspace.reserve(device, Slot::Sample, rows * plan.positions)?;
        }
        let ws = workspace;
        let exclusions = (&ws.exclude_offsets, &ws.exclude_ids);
        let inputs = |launch| self.scan_inputs(launch, hidden, exclusions, rows);
        // The sample's k-th best (or -inf) is the row's threshold; the survivors start empty.
        let (thresholds, threshold_pitch, threshold_at) = if passes == ThresholdPasses::Tiles {
            let [first, _] = &mut ws.candidates;
            device.sample_tile_topk(
                &inputs(&sample),
                plan.stride as u32,
                CandidatesMut {
                    scores: first.scores.get_mut(),
                    index: first.index.get_mut(),
                },
            )?;
            let at = merge_passes(device, rows, &mut ws.candidates, &sample_plan, sample.keep)?;
            device.reset_survivors(
                rows as u32,
                survivor_slots(&mut ws.counts, &mut ws.survivors, capacity),
            )?;
            let pitch = *sample_plan.last().expect("a plan is never empty");
            (ws.candidates[at].scores.get(), pitch, k - 1)
        } else {
            // Every sampled score, in the bits the full scan will compute; one launch then
            // selects each row's k-th best and empties its survivor slots.
            let (stride, positions) = (plan.stride as u32, plan.positions as u32);
            let out = CandidatesMut {
                scores: ws.sample.scores.get_mut(),
                index: ws.sample.index.get_mut(),
            };
            match &passes {
                ThresholdPasses::Gemv(gemv) => {
                    device.gemv_sample(&inputs(&scan), gemv, stride, positions, out)?
                }
                _ => device.gemm_sample(&inputs(&scan), stride, positions, out)?,
            }
            device.sample_threshold(
                rows as u32,
                ws.sample.scores.get(),
                positions,
                k as u32,
                ws.thresholds.get_mut(),
                survivor_slots(&mut ws.counts, &mut ws.survivors, capacity),
            )?;
            (ws.thresholds.get(), 1, 0)
        };
        let thresholds = Thresholds {
            scores: thresholds,
            pitch: threshold_pitch as u32,
            at: threshold_at as u32,
        };
        let slots = survivor_slots(&mut ws.counts, &mut ws.survivors, capacity);
        match &passes {
            ThresholdPasses::Tiles => device.score_above(&inputs(&scan), thresholds, slots)?,
            ThresholdPasses::Gemv(gemv) => {
                device.gemv_above(&inputs(&scan), gemv, thresholds, slots)?
            }
            ThresholdPasses::Gemm => device.gemm_above(&inputs(&scan), thresholds, slots)?,
        }
        // One launch finishes every row: a radix select of its k-th best, then a sort of those
        // at or above it.
        device.finalize_survivors(
            rows as u32,
            ws.counts.get_mut(),
            Candidates {
                scores: ws.survivors.scores.get(),
                index: ws.survivors.index.get(),
            },
            capacity,
            k as u32,
            CandidatesMut {
                scores: ws.answers.scores.get_mut(),
                index: ws.answers.index.get_mut(),
            },
        )?;
        Ok(Some(Enqueued {
            plan: vec![k],
            slot: 0,
        }))
    }
}

/// The survivor slots of the workspace as a kernel writes them.
fn survivor_slots<'a, D: Device>(
    counts: &'a mut Grown<D::U32>,
    survivors: &'a mut CandidateSlots<D>,
    capacity: u32,
) -> SurvivorsMut<'a, D> {
    SurvivorsMut {
        counts: counts.get_mut(),
        scores: survivors.scores.get_mut(),
        index: survivors.index.get_mut(),
        capacity,
    }
}

/// Copies each row's exclusions, as CSR (offsets, ids), into the workspace: what every scan of
/// the batch reads.
fn upload_exclusions<D: Device>(
    workspace: &mut TopKWorkspace<D>,
    device: &D,
    exclude: &[&[u32]],
) -> Result<()> {
    let (offsets, ids) = exclusion_csr(exclude);
    workspace.upload_exclusions(device, &offsets, &ids)
}

/// Reserves the two candidate pairs that stage 1 and the merge passes of `plan` alternate
/// between: the first holds stage 1's output and every second pass's.
fn reserve_merge<D: Device>(
    workspace: &mut TopKWorkspace<D>,
    device: &D,
    rows: usize,
    plan: &[usize],
) -> Result<()> {
    for parity in 0..2 {
        let most = plan
            .iter()
            .skip(parity)
            .step_by(2)
            .max()
            .copied()
            .unwrap_or(0);
        if most > 0 {
            workspace.reserve(device, Slot::Candidates(parity), rows * most)?;
        }
    }
    Ok(())
}

/// Merge passes over `rows` rows of candidates, `plan[0]` per row in `pairs[0]`, down to
/// `plan.last()` (each pass keeping `keep` of every block of the tile size, from one pair into
/// the other); returns the pair that holds the last pass's output.
fn merge_passes<D: Device>(
    device: &D,
    rows: usize,
    pairs: &mut [CandidateSlots<D>; 2],
    plan: &[usize],
    keep: u32,
) -> Result<usize> {
    let mut at = 0;
    for window in plan.windows(2) {
        let (count, next) = (window[0], window[1]);
        debug_assert_eq!(next, count.div_ceil(TILE) * keep as usize);
        let [first, second] = &mut *pairs;
        let (from, to) = if at == 0 {
            (&*first, second)
        } else {
            (&*second, first)
        };
        device.merge_topk(
            rows as u32,
            Candidates {
                scores: from.scores.get(),
                index: from.index.get(),
            },
            count as u32,
            keep,
            CandidatesMut {
                scores: to.scores.get_mut(),
                index: to.index.get_mut(),
            },
        )?;
        at = 1 - at;
    }
    Ok(at)
}

/// What a launch enqueued into the layer's kept buffers: the merge plan its answers follow
/// (`rows x plan.last()`, sorted within each row) and, for the tile scan, which candidate pair
/// holds them.
pub struct Enqueued {
    pub plan: Vec<usize>,
    slot: usize,
}

impl Enqueued {
    /// Answers per row in the output.
    fn width(&self) -> usize {
        *self.plan.last().expect("a plan is never empty")
    }
}
