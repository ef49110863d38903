//! The device buffers one model instance's fused score + top-k reuses from batch to batch:
//! candidates, thresholds, survivor slots and counters, answers and the batch's exclusions.
//! Each grows (to the next power of two) the first time a batch needs more than it holds and is
//! kept after that, so a serving instance in its steady state allocates nothing per batch, and
//! every launch of a batch reads and writes buffers whose addresses do not change (what a
//! captured launch sequence needs).
//!
//! Buffers may be longer than a batch uses: every kernel is given its lengths explicitly, and
//! answers are read back as prefixes ([`crate::device::Device::download_f32`]).

use crate::device::Device;
use crate::Result;

/// One buffer that grows on demand and is kept.
pub struct Grown<B> {
    buffer: Option<B>,
    len: usize,
}

impl<B> Default for Grown<B> {
    fn default() -> Self {
        Grown {
            buffer: None,
            len: 0,
        }
    }
}

impl<B> Grown<B> {
    /// The buffer, at least `len` long: the kept one, or a new one from `alloc` (the kept one
    /// is released first, so the device never holds both).
    fn at_least(
        &mut self,
        len: usize,
        allocations: &mut usize,
        alloc: impl FnOnce(usize) -> Result<B>,
    ) -> Result<&mut B> {
        if self.buffer.is_none() || self.len < len {
            let grown = len.max(1).next_power_of_two();
            self.buffer = None;
            self.len = 0;
            self.buffer = Some(alloc(grown)?);
            self.len = grown;
            *allocations += 1;
        }
        Ok(self.buffer.as_mut().expect("allocated above"))
    }

    /// Moves the buffer out (at least `len` long), for a call that needs the rest of the
    /// workspace beside it; [`Grown::restore`] puts it back.
    fn take_at_least(
        &mut self,
        len: usize,
        allocations: &mut usize,
        alloc: impl FnOnce(usize) -> Result<B>,
    ) -> Result<(B, usize)> {
        self.at_least(len, allocations, alloc)?;
        let len = std::mem::take(&mut self.len);
        Ok((self.buffer.take().expect("allocated above"), len))
    }

    fn restore(&mut self, (buffer, len): (B, usize)) {
        self.buffer = Some(buffer);
        self.len = len;
    }

    /// The buffer; [`TopKWorkspace`]'s reserve calls come first.
    pub(crate) fn get(&self) -> &B {
        self.buffer
            .as_ref()
            .expect("a workspace buffer is reserved before use")
    }

    pub(crate) fn get_mut(&mut self) -> &mut B {
        self.buffer
            .as_mut()
            .expect("a workspace buffer is reserved before use")
    }

    /// Elements held (0 before the first use).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A (score, item index) pair of buffers.
pub struct CandidateSlots<D: Device> {
    pub scores: Grown<D::F32>,
    pub index: Grown<D::U32>,
}

impl<D: Device> Default for CandidateSlots<D> {
    fn default() -> Self {
        CandidateSlots {
            scores: Grown::default(),
            index: Grown::default(),
        }
    }
}

/// What a scan writes and reads besides the model's tables, kept per instance.
pub struct TopKWorkspace<D: Device> {
    /// The batch's exclusions as CSR: offsets (`rows + 1`) and ids.
    pub(crate) exclude_offsets: Grown<D::U32>,
    pub(crate) exclude_ids: Grown<D::U32>,
    /// Stage 1's candidates and the merge passes', alternating between the two.
    pub(crate) candidates: [CandidateSlots<D>; 2],
    /// The coalesced strategy's sampled scores (`rows x positions`).
    pub(crate) sample: CandidateSlots<D>,
    /// The coalesced strategy's per-row thresholds.
    pub(crate) thresholds: Grown<D::F32>,
    /// The threshold scan's survivors: a count per row and `capacity` slots per row.
    pub(crate) counts: Grown<D::U32>,
    pub(crate) survivors: CandidateSlots<D>,
    /// The threshold scan's finished answers (`rows x k`).
    pub(crate) answers: CandidateSlots<D>,
    /// Rows answered again by the tile scan after their survivors overflowed: their positions
    /// in the batch and their hidden vectors.
    pub(crate) overflow_rows: Grown<D::U32>,
    pub(crate) overflow_hidden: Grown<D::F32>,
    /// Device allocations made so far (each buffer's first use and each growth).
    allocations: usize,
}

impl<D: Device> Default for TopKWorkspace<D> {
    fn default() -> Self {
        TopKWorkspace {
            exclude_offsets: Grown::default(),
            exclude_ids: Grown::default(),
            candidates: Default::default(),
            sample: CandidateSlots::default(),
            thresholds: Grown::default(),
            counts: Grown::default(),
            survivors: CandidateSlots::default(),
            answers: CandidateSlots::default(),
            overflow_rows: Grown::default(),
            overflow_hidden: Grown::default(),
            allocations: 0,
        }
    }
}

/// Which of the workspace's buffers a call asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Slot {
    Candidates(usize),
    Sample,
    Survivors,
    Answers,
}

impl<D: Device> TopKWorkspace<D> {
    /// Device allocations made so far: a steady state of batches no larger than earlier ones
    /// adds none.
    pub fn allocations(&self) -> usize {
        self.allocations
    }

    fn pair(&mut self, slot: Slot) -> &mut CandidateSlots<D> {
        match slot {
            Slot::Candidates(i) => &mut self.candidates[i],
            Slot::Sample => &mut self.sample,
            Slot::Survivors => &mut self.survivors,
            Slot::Answers => &mut self.answers,
        }
    }

    /// Makes `slot`'s pair at least `len` long.
    pub(crate) fn reserve(&mut self, device: &D, slot: Slot, len: usize) -> Result<()> {
        let mut allocations = self.allocations;
        let pair = self.pair(slot);
        pair.scores
            .at_least(len, &mut allocations, |n| device.alloc_f32(n))?;
        pair.index
            .at_least(len, &mut allocations, |n| device.alloc_u32(n))?;
        self.allocations = allocations;
        Ok(())
    }

    /// Makes the per-row buffers (thresholds, counts) at least `rows` long.
    pub(crate) fn reserve_rows(&mut self, device: &D, rows: usize) -> Result<()> {
        self.thresholds
            .at_least(rows, &mut self.allocations, |n| device.alloc_f32(n))?;
        self.counts
            .at_least(rows, &mut self.allocations, |n| device.alloc_u32(n))?;
        Ok(())
    }

    /// Copies the batch's exclusions (CSR) into the kept buffers.
    pub(crate) fn upload_exclusions(
        &mut self,
        device: &D,
        offsets: &[u32],
        ids: &[u32],
    ) -> Result<()> {
        for (values, grown) in [
            (offsets, &mut self.exclude_offsets),
            (ids, &mut self.exclude_ids),
        ] {
            let buffer =
                grown.at_least(values.len(), &mut self.allocations, |n| device.alloc_u32(n))?;
            device.upload_u32_into(values, buffer)?;
        }
        Ok(())
    }

    /// The overflowing rows' positions (uploaded) and a buffer for their hidden vectors, moved out
    /// of the workspace for the tile scan that answers them ([`Self::restore_overflow`]; after
    /// an error they are simply not restored, and the next overflow allocates them again).
    pub(crate) fn take_overflow(
        &mut self,
        device: &D,
        rows: &[u32],
        dim: usize,
    ) -> Result<OverflowBuffers<D>> {
        let mut positions =
            self.overflow_rows
                .take_at_least(rows.len(), &mut self.allocations, |n| device.alloc_u32(n))?;
        device.upload_u32_into(rows, &mut positions.0)?;
        let hidden =
            self.overflow_hidden
                .take_at_least(rows.len() * dim, &mut self.allocations, |n| {
                    device.alloc_f32(n)
                })?;
        Ok(OverflowBuffers {
            rows: positions,
            hidden,
        })
    }

    pub(crate) fn restore_overflow(&mut self, buffers: OverflowBuffers<D>) {
        self.overflow_rows.restore(buffers.rows);
        self.overflow_hidden.restore(buffers.hidden);
    }
}

/// See [`TopKWorkspace::take_overflow`].
pub(crate) struct OverflowBuffers<D: Device> {
    pub rows: (D::U32, usize),
    pub hidden: (D::F32, usize),
}
