//! [`CudaDevice`]: one GPU's context, stream and compiled kernels, and the typed launch of every
//! kernel (the [`Device`] trait on CUDA).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, HostSlice,
    LaunchArgs, LaunchConfig, PinnedHostSlice, PushKernelArg, SyncOnDrop,
};
use cudarc::nvrtc::Ptx;

use super::compile::{check_nvrtc_against_driver, compile_source, driver_present};
use crate::device::{
    AttentionArgs, BagArgs, Candidates, CandidatesMut, DenseArgs, Device, DeviceMatrix,
    GruGatesArgs, HstuAttentionArgs, NormArgs, Stage1Inputs, SurvivorsMut, Thresholds, TokenArgs,
};
use crate::{
    gemm_grid, GemvLaunch, GpuError, Result, ENC_THREADS, LINEAR_TILE, MODULES, THREADS, TILE,
};

/// Stream-ordered allocations come from the device's default memory pool, which by default hands
/// its free memory back to the system at every synchronisation: each batch then pays to map it
/// again. Keep it (the pool only grows to the largest batch's working set).
fn keep_pool_memory(ctx: &CudaContext) -> Result<()> {
    use cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: the context is current (CudaContext::new binds it); `pool` and `threshold` are
    // valid locals and CU_MEMPOOL_ATTR_RELEASE_THRESHOLD takes a cuuint64_t.
    let status = unsafe {
        match sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) {
            sys::CUresult::CUDA_SUCCESS => sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            ),
            failed => failed,
        }
    };
    if status != sys::CUresult::CUDA_SUCCESS {
        return Err(GpuError::Cuda {
            what: "keeping the memory pool's memory between batches",
            message: format!("{status:?}"),
        });
    }
    Ok(())
}

/// Page-locked buffers taken in turn by a device's uploads ([`CudaDevice`]'s staging).
struct StagingRing<T> {
    buffers: [Option<PinnedHostSlice<T>>; STAGING_BUFFERS],
    next: usize,
}

/// Uploads in flight before one waits for an earlier copy: more than a batch makes (an encoder's
/// inputs and the top-k's exclusions).
const STAGING_BUFFERS: usize = 8;

impl<T> Default for StagingRing<T> {
    fn default() -> Self {
        StagingRing {
            buffers: std::array::from_fn(|_| None),
            next: 0,
        }
    }
}

impl<T> StagingRing<T> {
    fn next_slot(&mut self) -> &mut Option<PinnedHostSlice<T>> {
        let at = self.next;
        self.next = (at + 1) % STAGING_BUFFERS;
        &mut self.buffers[at]
    }
}

#[derive(Default)]
struct Counters {
    launches: AtomicU64,
    copies_in: AtomicU64,
    copies_out: AtomicU64,
    allocations: AtomicU64,
}

/// Kernel launches, host-to-device and device-to-host copies and device allocations (stream-ordered,
/// from the memory pool) a [`CudaDevice`] has made: the difference across one call says what the
/// call costs besides its kernels' time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceCounts {
    pub launches: u64,
    pub copies_in: u64,
    pub copies_out: u64,
    pub allocations: u64,
}

impl std::ops::Sub for DeviceCounts {
    type Output = DeviceCounts;
    fn sub(self, earlier: DeviceCounts) -> DeviceCounts {
        DeviceCounts {
            launches: self.launches - earlier.launches,
            copies_in: self.copies_in - earlier.copies_in,
            copies_out: self.copies_out - earlier.copies_out,
            allocations: self.allocations - earlier.allocations,
        }
    }
}

/// The first `len` values of a page-locked buffer, as a copy's source: the copy reads only those
/// (a plain `&[T]` would be copied as pageable memory, synchronously) and still records the
/// buffer's event, so the next write to the buffer waits for it.
struct PinnedPrefix<'a, T> {
    pinned: &'a mut PinnedHostSlice<T>,
    len: usize,
}

impl<T> HostSlice<T> for PinnedPrefix<'_, T> {
    fn len(&self) -> usize {
        self.len
    }

    unsafe fn stream_synced_slice<'a>(
        &'a self,
        stream: &'a CudaStream,
    ) -> (&'a [T], SyncOnDrop<'a>) {
        // SAFETY: the caller's contract (the slice is used on `stream` only) is passed on.
        let (all, record) = unsafe { self.pinned.stream_synced_slice(stream) };
        (&all[..self.len], record)
    }

    unsafe fn stream_synced_mut_slice<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (&'a mut [T], SyncOnDrop<'a>) {
        // SAFETY: as above.
        let (all, record) = unsafe { self.pinned.stream_synced_mut_slice(stream) };
        (&mut all[..self.len], record)
    }
}

pub(super) fn cuda_err(what: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> GpuError {
    move |e| GpuError::Cuda {
        what,
        message: e.to_string(),
    }
}

/// One GPU: its context, one stream (every launch and copy of the device runs on it, in order)
/// and the compiled kernels.
pub struct CudaDevice {
    pub(super) stream: Arc<CudaStream>,
    _modules: Vec<Arc<CudaModule>>,
    functions: HashMap<&'static str, CudaFunction>,
    /// Page-locked staging for each batch's inputs (item indices, offsets, exclusions, and the
    /// output-layer benchmark's hidden vectors), so their copies are asynchronous DMA. Kept between
    /// batches (allocating page-locked memory costs far more than the copies), each buffer grown to
    /// the largest input it has carried. cudarc records an event on each copy from a buffer and
    /// makes the next write to it wait for that event, so reusing a buffer is safe; the uploads
    /// take the ring's buffers in turn, so that an upload does not wait for the one before it
    /// (with one buffer, the top-k's exclusion ids waited for their offsets' copy, which the
    /// stream runs after the encoder's kernels: the host stalled until the encoder finished).
    /// Outputs (top-k rows) are small and read on the host, which cudarc's write-combined
    /// page-locked memory is slow at, so they are copied back directly.
    staging_u32: Mutex<StagingRing<u32>>,
    staging_f32: Mutex<StagingRing<f32>>,
    /// Tests: fill every output buffer with NaN / 0xDEADBEEF when it is allocated, so a slot a
    /// kernel fails to write shows up in the results instead of holding stale memory (buffers
    /// the top-k keeps between batches are poisoned once, at their first use; the emulation
    /// poisons before every launch).
    pub poison_outputs: bool,
    /// Streaming multiprocessors, for the grids sized to what the device runs at once.
    multiprocessors: u32,
    /// What this device has been asked to do so far (for the benchmarks' per-call breakdown).
    counters: Counters,
    /// "NVIDIA H200 (sm_90)", for logs.
    pub name: String,
}

impl CudaDevice {
    /// Opens device `ordinal`, compiles (or takes from the cache) every kernel for its
    /// architecture and creates the stream.
    pub fn new(ordinal: usize) -> Result<CudaDevice> {
        if !driver_present() {
            return Err(GpuError::Unavailable(
                "the CUDA driver (libcuda.so.1) is not installed or not visible to this process"
                    .into(),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| {
            GpuError::Unavailable(format!("cannot open CUDA device {ordinal}: {e}"))
        })?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(cuda_err("querying the compute capability"))?;
        if major < 7 {
            return Err(GpuError::Unavailable(format!(
                "device {ordinal} has compute capability {major}.{minor}; recsys needs 7.0 or newer"
            )));
        }
        check_nvrtc_against_driver()?;
        let arch = format!("sm_{major}{minor}");
        let gpu = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let multiprocessors = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(cuda_err("querying the multiprocessor count"))?
            .max(1) as u32;
        let mut modules = Vec::new();
        let mut functions = HashMap::new();
        for ((file, source, kernels), _) in MODULES.iter().zip(0..) {
            let ptx = compile_source(file, source, &arch)?;
            let module = ctx
                .load_module(Ptx::from_src(ptx))
                .map_err(cuda_err("loading a compiled module"))?;
            for &kernel in *kernels {
                let function = module
                    .load_function(kernel)
                    .map_err(cuda_err("finding a kernel"))?;
                functions.insert(kernel, function);
            }
            modules.push(module);
        }
        // Its own stream, so that several instances on one GPU run side by side (the legacy
        // default stream would serialise them). A second stream makes cudarc record and wait on
        // events around every allocation, copy and launch, to order work across streams; this
        // device's buffers are only ever used on its one stream, so that ordering is already
        // given and the tracking is turned off.
        let stream = ctx.new_stream().map_err(cuda_err("creating a stream"))?;
        // SAFETY: every buffer this context allocates belongs to one CudaDevice and is used only
        // on that device's stream (page-locked staging keeps its own event, which tracking does
        // not affect).
        unsafe { ctx.disable_event_tracking() };
        keep_pool_memory(&ctx)?;
        Ok(CudaDevice {
            stream,
            _modules: modules,
            functions,
            staging_u32: Mutex::new(StagingRing::default()),
            staging_f32: Mutex::new(StagingRing::default()),
            poison_outputs: false,
            multiprocessors,
            counters: Counters::default(),
            name: format!("{gpu} ({arch})"),
        })
    }

    /// A launch of the scan kernel `prefix` for `a.weights`' precision with the arguments every
    /// scan kernel starts with already pushed: hidden, the weights (int8: with their row scales
    /// and the activation scale), bias, the exclusions' offsets and ids, and the batch's rows.
    fn scan_launch<'a>(
        &'a self,
        prefix: &'static str,
        a: &'a Stage1Inputs<'_, Self>,
    ) -> LaunchArgs<'a> {
        let mut b = self
            .stream
            .launch_builder(self.function(weight_kernel(prefix, a.weights)));
        b.arg(a.hidden);
        match a.weights {
            DeviceMatrix::F32(w) => {
                b.arg(w);
            }
            DeviceMatrix::F16(w) => {
                b.arg(w);
            }
            DeviceMatrix::I8 { q, scales } => {
                b.arg(q).arg(scales).arg(&a.activation_scale);
            }
        }
        b.arg(a.bias)
            .arg(a.exclude_offsets)
            .arg(a.exclude_ids)
            .arg(&a.batch);
        b
    }

    /// Stage 1 (`score_tile_topk_*`), or with a `stride` the threshold scan's sample
    /// (`sample_tile_topk_*`, whose last argument before the outputs is the stride).
    fn stage1(
        &self,
        prefix: &'static str,
        a: &Stage1Inputs<'_, Self>,
        stride: Option<u32>,
        out: CandidatesMut<'_, Self>,
    ) -> Result<()> {
        let launch = a.launch;
        let mut b = self.scan_launch(prefix, a);
        b.arg(&launch.rows_per_block)
            .arg(&a.n_items)
            .arg(&a.dim)
            .arg(&launch.pitch)
            .arg(&launch.keep);
        let stride_arg = stride.unwrap_or(1);
        if stride.is_some() {
            b.arg(&stride_arg);
        }
        b.arg(out.scores).arg(out.index);
        let (groups, tiles) = launch.grid();
        let cfg = Self::grid(groups, tiles, THREADS, launch.shared_bytes);
        // SAFETY: the arguments match score_tile_topk_{f32,f16,i8}(const float* hidden,
        // const W* weights, [const float* row_scales, float activation_scale,] const float* bias,
        // const u32* exclude_offsets, const u32* exclude_ids, u32 batch, u32 rows_per_block,
        // u32 n_items, u32 dim, u32 pitch, u32 keep, float* out_scores, u32* out_index) in
        // kernels/fused_topk.cu, and sample_tile_topk_* the same with `u32 stride` after keep;
        // DeviceOutputLayer sizes hidden batch x dim, the weights n_items x pitch, exclusions
        // batch + 1 offsets, outputs batch x tiles x keep, and the launch plan's groups x
        // rows_per_block cover the batch with shared_bytes holding one group's hidden rows.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching the scoring kernel"))?;
        Ok(())
    }

    fn function(&self, name: &str) -> &CudaFunction {
        self.counters.launches.fetch_add(1, Ordering::Relaxed);
        &self.functions[name] // every name in MODULES was loaded by `new`
    }

    /// Kernel launches, copies and allocations this device has made so far.
    pub fn counts(&self) -> DeviceCounts {
        let read = |c: &AtomicU64| c.load(Ordering::Relaxed);
        DeviceCounts {
            launches: read(&self.counters.launches),
            copies_in: read(&self.counters.copies_in),
            copies_out: read(&self.counters.copies_out),
            allocations: read(&self.counters.allocations),
        }
    }

    /// Waits for everything enqueued on the stream.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(cuda_err("waiting for the stream"))
    }

    fn upload<T: DeviceRepr + Copy>(
        &self,
        values: &[T],
        what: &'static str,
    ) -> Result<CudaSlice<T>> {
        // cudarc refuses zero-length buffers; a kernel never reads past the lengths it is given.
        let values = if values.is_empty() {
            // SAFETY: T is a plain device value type (DeviceRepr); all-zero bytes are one of its
            // values for the integer and float types used here, and the element is never read.
            &[unsafe { std::mem::zeroed::<T>() }][..]
        } else {
            values
        };
        self.counters.copies_in.fetch_add(1, Ordering::Relaxed);
        self.counters.allocations.fetch_add(1, Ordering::Relaxed);
        self.stream.memcpy_stod(values).map_err(cuda_err(what))
    }

    /// Copies `values` to a new device buffer through the page-locked `slot` (the buffer may be
    /// longer than `values`; kernels read only the lengths they are given).
    fn stage<T: DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy>(
        &self,
        slot: &Mutex<StagingRing<T>>,
        values: &[T],
    ) -> Result<CudaSlice<T>> {
        let mut device = self.alloc::<T>(values.len())?;
        self.stage_into(slot, values, &mut device)?;
        Ok(device)
    }

    /// Copies `values` into the start of `dst` (at least as long) through the page-locked
    /// `slot`, asynchronously on the stream.
    fn stage_into<T: DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy>(
        &self,
        ring: &Mutex<StagingRing<T>>,
        values: &[T],
        dst: &mut CudaSlice<T>,
    ) -> Result<()> {
        if values.is_empty() {
            return Ok(());
        }
        if dst.len() < values.len() {
            return Err(GpuError::Invalid(format!(
                "{} batch inputs for a device buffer of {}",
                values.len(),
                dst.len()
            )));
        }
        let mut ring = ring
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let slot = ring.next_slot();
        let large_enough = matches!(slot.as_ref(), Some(p) if p.len() >= values.len());
        if !large_enough {
            let len = values.len().next_power_of_two().max(4096);
            // SAFETY: the buffer's first values.len() elements are written below before any
            // copy reads them; only that prefix is ever copied.
            let fresh = unsafe { self.stream.context().alloc_pinned::<T>(len) }
                .map_err(cuda_err("allocating page-locked memory"))?;
            *slot = Some(fresh); // the old buffer's drop waits for its last copy
        }
        let pinned = slot.as_mut().expect("allocated above");
        // as_mut_slice waits for the previous copy from this buffer.
        pinned
            .as_mut_slice()
            .map_err(cuda_err("mapping page-locked memory"))?[..values.len()]
            .copy_from_slice(values);
        let staged = PinnedPrefix {
            pinned,
            len: values.len(),
        };
        self.counters.copies_in.fetch_add(1, Ordering::Relaxed);
        self.stream
            .memcpy_htod(&staged, &mut dst.slice_mut(..values.len()))
            .map_err(cuda_err("uploading batch inputs"))
    }

    /// Hidden vectors for the output layer alone, staged like every batch input.
    pub fn stage_f32(&self, values: &[f32]) -> Result<CudaSlice<f32>> {
        self.stage(&self.staging_f32, values)
    }

    fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>> {
        self.counters.allocations.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the buffer is an output that the next kernel writes in full before anything
        // reads it (the emulated tests check that every output slot is written).
        unsafe { self.stream.alloc::<T>(len.max(1)) }
            .map_err(cuda_err("allocating a device buffer"))
    }

    /// A launch of `{prefix}_{f32,f16,i8}` for `table`'s precision, with the table (and, for
    /// int8, its row scales) already pushed as the first arguments.
    fn table_launch<'a>(&'a self, prefix: &str, table: &'a DeviceMatrix<Self>) -> LaunchArgs<'a> {
        let suffix = match table {
            DeviceMatrix::F32(_) => "f32",
            DeviceMatrix::F16(_) => "f16",
            DeviceMatrix::I8 { .. } => "i8",
        };
        let name = format!("{prefix}_{suffix}");
        let mut b = self.stream.launch_builder(self.function(&name));
        match table {
            DeviceMatrix::F32(t) => b.arg(t),
            DeviceMatrix::F16(t) => b.arg(t),
            DeviceMatrix::I8 { q, scales } => b.arg(q).arg(scales),
        };
        b
    }

    fn grid(blocks_x: u32, blocks_y: u32, threads: u32, shared: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (blocks_x.max(1), blocks_y.max(1), 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: shared,
        }
    }
}

impl Device for CudaDevice {
    type F32 = CudaSlice<f32>;
    type U32 = CudaSlice<u32>;
    type U16 = CudaSlice<u16>;
    type I8 = CudaSlice<i8>;

    fn upload_f32(&self, values: &[f32]) -> Result<Self::F32> {
        self.upload(values, "uploading f32 values")
    }
    fn upload_u32(&self, values: &[u32]) -> Result<Self::U32> {
        // u32 buffers are only ever a batch's inputs (indices, offsets, exclusions).
        self.stage(&self.staging_u32, values)
    }
    fn upload_u16(&self, values: &[u16]) -> Result<Self::U16> {
        self.upload(values, "uploading fp16 weights")
    }
    fn upload_i8(&self, values: &[i8]) -> Result<Self::I8> {
        self.upload(values, "uploading int8 weights")
    }
    fn alloc_f32(&self, len: usize) -> Result<Self::F32> {
        if self.poison_outputs {
            return self.upload(&vec![f32::NAN; len.max(1)], "poisoning an output");
        }
        self.alloc(len)
    }
    fn alloc_u32(&self, len: usize) -> Result<Self::U32> {
        if self.poison_outputs {
            return self.upload(&vec![0xDEAD_BEEFu32; len.max(1)], "poisoning an output");
        }
        self.alloc(len)
    }
    fn upload_u32_into(&self, values: &[u32], dst: &mut Self::U32) -> Result<()> {
        self.stage_into(&self.staging_u32, values, dst)
    }
    fn download_f32(&self, buffer: &Self::F32, len: usize) -> Result<Vec<f32>> {
        self.counters.copies_out.fetch_add(1, Ordering::Relaxed);
        self.stream
            .memcpy_dtov(&buffer.slice(..len))
            .map_err(cuda_err("downloading results"))
    }
    fn download_u32(&self, buffer: &Self::U32, len: usize) -> Result<Vec<u32>> {
        self.counters.copies_out.fetch_add(1, Ordering::Relaxed);
        self.stream
            .memcpy_dtov(&buffer.slice(..len))
            .map_err(cuda_err("downloading results"))
    }

    fn score_tile_topk(
        &self,
        a: &Stage1Inputs<'_, Self>,
        out: CandidatesMut<'_, Self>,
    ) -> Result<()> {
        self.stage1("score_tile_topk", a, None, out)
    }

    fn sample_tile_topk(
        &self,
        a: &Stage1Inputs<'_, Self>,
        stride: u32,
        out: CandidatesMut<'_, Self>,
    ) -> Result<()> {
        self.stage1("sample_tile_topk", a, Some(stride), out)
    }

    fn reset_survivors(&self, rows: u32, survivors: SurvivorsMut<'_, Self>) -> Result<()> {
        let SurvivorsMut {
            counts,
            scores,
            index,
            capacity,
        } = survivors;
        let mut b = self.stream.launch_builder(self.function("reset_survivors"));
        b.arg(counts).arg(scores).arg(index).arg(&capacity);
        // SAFETY: matches reset_survivors(u32* counts, float* scores, u32* index, u32 capacity):
        // counts holds `rows` values, scores and index rows x capacity.
        unsafe { b.launch(Self::grid(rows, 1, THREADS, 0)) }
            .map_err(cuda_err("launching the survivor reset"))?;
        Ok(())
    }

    fn score_above(
        &self,
        a: &Stage1Inputs<'_, Self>,
        thresholds: Thresholds<'_, Self>,
        mut survivors: SurvivorsMut<'_, Self>,
    ) -> Result<()> {
        let launch = a.launch;
        let mut b = self.scan_launch("score_above", a);
        b.arg(&launch.rows_per_block)
            .arg(&a.n_items)
            .arg(&a.dim)
            .arg(&launch.pitch);
        push_threshold_outputs(&mut b, &thresholds, &mut survivors);
        let (groups, tiles) = launch.grid();
        let cfg = Self::grid(groups, tiles, THREADS, launch.shared_bytes);
        // SAFETY: the arguments match score_above_{f32,f16,i8}(const float* hidden, const W*
        // weights, [const float* row_scales, float activation_scale,] const float* bias,
        // const u32* exclude_offsets, const u32* exclude_ids, u32 batch, u32 rows_per_block,
        // u32 n_items, u32 dim, u32 pitch, const float* thresholds, u32 threshold_pitch,
        // u32 threshold_at, u32 capacity, u32* counts, float* out_scores, u32* out_index):
        // DeviceOutputLayer sizes hidden batch x dim, the weights n_items x pitch, exclusions
        // batch + 1 offsets, thresholds batch x threshold_pitch (at < pitch), counts batch and the
        // survivors batch x capacity; slots past the capacity are never written.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching the threshold scan"))?;
        Ok(())
    }

    fn gemv_resident_blocks(&self, weights: &DeviceMatrix<Self>, shared_bytes: u32) -> Result<u32> {
        // The full scan's kernel for the precision (its sample has the same body and bounds).
        let per_multiprocessor = self
            .function(weight_kernel("gemv_above", weights))
            .occupancy_max_active_blocks_per_multiprocessor(THREADS, shared_bytes as usize, None)
            .map_err(cuda_err("querying the coalesced scan's occupancy"))?;
        Ok(per_multiprocessor.max(1) * self.multiprocessors)
    }

    fn gemv_sample(
        &self,
        a: &Stage1Inputs<'_, Self>,
        gemv: &GemvLaunch,
        stride: u32,
        positions: u32,
        out: CandidatesMut<'_, Self>,
    ) -> Result<()> {
        let mut b = self.scan_launch("gemv_sample", a);
        b.arg(&a.n_items)
            .arg(&a.dim)
            .arg(&a.launch.pitch)
            .arg(&gemv.lanes)
            .arg(&stride)
            .arg(&positions)
            .arg(out.scores)
            .arg(out.index);
        let cfg = Self::grid(gemv.blocks, 1, THREADS, gemv.shared_bytes);
        // SAFETY: the arguments match gemv_sample_{f32,f16,i8}(const float* hidden, const W*
        // weights, [const float* row_scales, float activation_scale,] const float* bias,
        // const u32* exclude_offsets, const u32* exclude_ids, u32 batch, u32 n_items, u32 dim,
        // u32 pitch, u32 lanes, u32 stride, u32 positions, float* out_scores, u32* out_index):
        // DeviceOutputLayer sizes hidden batch x dim (batch <= MAX_ROWS), the weights n_items x
        // pitch, exclusions batch + 1 offsets, the outputs batch x positions (positions x stride
        // covers the catalogue once), and shared_bytes holds the batch's hidden rows at the pitch.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching the coalesced sample"))?;
        Ok(())
    }

    fn gemv_above(
        &self,
        a: &Stage1Inputs<'_, Self>,
        gemv: &GemvLaunch,
        thresholds: Thresholds<'_, Self>,
        mut survivors: SurvivorsMut<'_, Self>,
    ) -> Result<()> {
        let mut b = self.scan_launch("gemv_above", a);
        b.arg(&a.n_items)
            .arg(&a.dim)
            .arg(&a.launch.pitch)
            .arg(&gemv.lanes);
        push_threshold_outputs(&mut b, &thresholds, &mut survivors);
        let cfg = Self::grid(gemv.blocks, 1, THREADS, gemv.shared_bytes);
        // SAFETY: the arguments match gemv_above_{f32,f16,i8}(const float* hidden, const W*
        // weights, [const float* row_scales, float activation_scale,] const float* bias,
        // const u32* exclude_offsets, const u32* exclude_ids, u32 batch, u32 n_items, u32 dim,
        // u32 pitch, u32 lanes, const float* thresholds, u32 threshold_pitch, u32 threshold_at,
        // u32 capacity, u32* counts, float* out_scores, u32* out_index): sized as for
        // score_above, with batch <= MAX_ROWS and shared_bytes holding the batch's hidden rows.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching the coalesced threshold scan"))?;
        Ok(())
    }

    fn gemm_sample(
        &self,
        a: &Stage1Inputs<'_, Self>,
        stride: u32,
        positions: u32,
        out: CandidatesMut<'_, Self>,
    ) -> Result<()> {
        let mut b = self.scan_launch("gemm_sample", a);
        b.arg(&a.n_items)
            .arg(&a.dim)
            .arg(&a.launch.pitch)
            .arg(&stride)
            .arg(&positions)
            .arg(out.scores)
            .arg(out.index);
        let (tiles, groups) = gemm_grid(positions, a.batch);
        // SAFETY: the arguments match gemm_sample_{f32,f16,i8}(const float* hidden, const W*
        // weights, [const float* row_scales, float activation_scale,] const float* bias,
        // const u32* exclude_offsets, const u32* exclude_ids, u32 batch, u32 n_items, u32 dim,
        // u32 pitch, u32 stride, u32 positions, float* out_scores, u32* out_index):
        // DeviceOutputLayer sizes hidden batch x dim, the weights n_items x pitch, exclusions
        // batch + 1 offsets and the outputs batch x positions (positions x stride covers the
        // catalogue once); the grid covers positions and rows, the shared memory is static.
        unsafe { b.launch(Self::grid(tiles, groups, THREADS, 0)) }
            .map_err(cuda_err("launching the tiled sample"))?;
        Ok(())
    }

    fn gemm_above(
        &self,
        a: &Stage1Inputs<'_, Self>,
        thresholds: Thresholds<'_, Self>,
        mut survivors: SurvivorsMut<'_, Self>,
    ) -> Result<()> {
        let mut b = self.scan_launch("gemm_above", a);
        b.arg(&a.n_items).arg(&a.dim).arg(&a.launch.pitch);
        push_threshold_outputs(&mut b, &thresholds, &mut survivors);
        let (tiles, groups) = gemm_grid(a.n_items, a.batch);
        // SAFETY: the arguments match gemm_above_{f32,f16,i8}(const float* hidden, const W*
        // weights, [const float* row_scales, float activation_scale,] const float* bias,
        // const u32* exclude_offsets, const u32* exclude_ids, u32 batch, u32 n_items, u32 dim,
        // u32 pitch, const float* thresholds, u32 threshold_pitch, u32 threshold_at,
        // u32 capacity, u32* counts, float* out_scores, u32* out_index): sized as for
        // score_above; the grid covers the catalogue and the rows.
        unsafe { b.launch(Self::grid(tiles, groups, THREADS, 0)) }
            .map_err(cuda_err("launching the tiled threshold scan"))?;
        Ok(())
    }

    fn sample_threshold(
        &self,
        rows: u32,
        sample: &Self::F32,
        count: u32,
        k: u32,
        thresholds: &mut Self::F32,
        survivors: SurvivorsMut<'_, Self>,
    ) -> Result<()> {
        let SurvivorsMut {
            counts,
            scores,
            index,
            capacity,
        } = survivors;
        let mut b = self
            .stream
            .launch_builder(self.function("sample_threshold"));
        b.arg(sample)
            .arg(&count)
            .arg(&k)
            .arg(thresholds)
            .arg(counts)
            .arg(scores)
            .arg(index)
            .arg(&capacity);
        // SAFETY: matches sample_threshold(const float* sample, u32 count, u32 k,
        // float* thresholds, u32* counts, float* survivor_scores, u32* survivor_index,
        // u32 capacity): sample holds rows x count values, thresholds and counts `rows`, the
        // survivor slots rows x capacity.
        unsafe { b.launch(Self::grid(rows, 1, THREADS, 0)) }
            .map_err(cuda_err("launching the sample's threshold"))?;
        Ok(())
    }

    fn finalize_survivors(
        &self,
        rows: u32,
        counts: &mut Self::U32,
        survivors: Candidates<'_, Self>,
        capacity: u32,
        k: u32,
        out: CandidatesMut<'_, Self>,
    ) -> Result<()> {
        let mut b = self
            .stream
            .launch_builder(self.function("finalize_survivors"));
        b.arg(counts)
            .arg(survivors.scores)
            .arg(survivors.index)
            .arg(&capacity)
            .arg(&k)
            .arg(out.scores)
            .arg(out.index);
        // SAFETY: matches finalize_survivors(u32* counts, const float* scores, const u32* index,
        // u32 capacity, u32 k, float* out_scores, u32* out_index): counts holds `rows` values,
        // scores and index rows x capacity, the outputs rows x k.
        unsafe { b.launch(Self::grid(rows, 1, THREADS, 0)) }
            .map_err(cuda_err("launching the survivors' finish"))?;
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
        let mut b = self.stream.launch_builder(self.function("merge_topk"));
        b.arg(in_scores)
            .arg(in_index)
            .arg(&count)
            .arg(&keep)
            .arg(out_scores)
            .arg(out_index);
        let blocks = (count as usize).div_ceil(TILE) as u32;
        // SAFETY: matches merge_topk(const float* in_scores, const u32* in_index, u32 count,
        // u32 keep, float* out_scores, u32* out_index): inputs rows x count, outputs rows x
        // blocks x keep, as merge_plan sizes them.
        unsafe { b.launch(Self::grid(blocks, rows, THREADS, 0)) }
            .map_err(cuda_err("launching the merge kernel"))?;
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
        let act = activation as u32;
        let mut b = self.stream.launch_builder(self.function("linear_f32"));
        b.arg(x)
            .arg(weight)
            .arg(bias)
            .arg(y)
            .arg(&m)
            .arg(&n)
            .arg(&k)
            .arg(&act);
        let cfg = Self::grid(
            n.div_ceil(LINEAR_TILE),
            m.div_ceil(LINEAR_TILE),
            ENC_THREADS,
            0,
        );
        // SAFETY: matches linear_f32(const float* x, const float* w, const float* bias, float* y,
        // u32 m, u32 n, u32 k, u32 activation): x m x k, w n x k, bias n, y m x n (DeviceDense).
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching a dense layer"))?;
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
        let null: u64 = 0;
        let mut b = self.stream.launch_builder(self.function("add_layer_norm"));
        b.arg(x);
        match residual {
            Some(r) => b.arg(r),
            None => b.arg(&null),
        };
        b.arg(gamma).arg(beta).arg(y).arg(&width).arg(&eps);
        // SAFETY: matches add_layer_norm(const float* x, const float* residual (may be null),
        // const float* gamma, const float* beta, float* y, u32 width, double eps): x, residual
        // and y rows x width, gamma and beta width; a null residual is a zero device pointer.
        unsafe { b.launch(Self::grid(rows, 1, ENC_THREADS, 0)) }
            .map_err(cuda_err("launching a layer norm"))?;
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
        let mut b = self.table_launch("embed_tokens", table);
        b.arg(items)
            .arg(positions)
            .arg(position_table)
            .arg(x)
            .arg(&width);
        // SAFETY: matches embed_tokens_{f32,f16,i8}(const T* table, [const float* row_scales,]
        // const u32* items, const u32* positions, const float* position_table, float* x,
        // u32 width): items and positions hold `tokens` valid rows of the tables, x is
        // tokens x width.
        unsafe { b.launch(Self::grid(tokens, 1, ENC_THREADS, 0)) }
            .map_err(cuda_err("launching the embedding"))?;
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
        let causal = u32::from(causal);
        let mut b = self.stream.launch_builder(self.function("attention"));
        b.arg(q)
            .arg(k)
            .arg(v)
            .arg(seq_offsets)
            .arg(out)
            .arg(&head_dim)
            .arg(&width)
            .arg(&causal);
        // SAFETY: matches attention(const float* q, const float* k, const float* v,
        // const u32* seq_offsets, float* out, u32 head_dim, u32 width, u32 causal): q, k, v and
        // out are tokens x width, seq_offsets sequences + 1 ascending token offsets;
        // head_dim <= 64.
        unsafe { b.launch(Self::grid(sequences, heads, ENC_THREADS, 0)) }
            .map_err(cuda_err("launching attention"))?;
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
        let mut b = self.stream.launch_builder(self.function("gru_gates"));
        b.arg(input_gates)
            .arg(state_gates)
            .arg(state)
            .arg(outputs)
            .arg(&first_token)
            .arg(&hidden);
        // SAFETY: matches gru_gates(const float* input_gates, const float* state_gates,
        // float* state, float* outputs, u32 first_token, u32 hidden): input_gates and outputs
        // hold at least first_token + rows rows (3 x hidden and hidden wide), state_gates rows
        // x 3 hidden, state at least rows x hidden.
        unsafe { b.launch(Self::grid(rows, 1, ENC_THREADS, 0)) }
            .map_err(cuda_err("launching a GRU step"))?;
        Ok(())
    }

    fn gather_rows(
        &self,
        src: &Self::F32,
        rows: &Self::U32,
        dst: &mut Self::F32,
        count: u32,
        width: u32,
    ) -> Result<()> {
        let mut b = self.stream.launch_builder(self.function("gather_rows"));
        b.arg(src).arg(rows).arg(dst).arg(&width);
        // SAFETY: matches gather_rows(const float* src, const u32* rows, float* dst, u32 width):
        // rows holds `count` valid row numbers of src, dst is count x width.
        unsafe { b.launch(Self::grid(count, 1, ENC_THREADS, 0)) }
            .map_err(cuda_err("launching a row gather"))?;
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
        let mut b = self.table_launch("embedding_bag", table);
        b.arg(items).arg(offsets).arg(bias).arg(y).arg(&width);
        // SAFETY: matches embedding_bag_{f32,f16,i8}(const T* table, [const float* row_scales,]
        // const u32* items, const u32* offsets, const float* bias, float* y, u32 width): offsets
        // holds rows + 1 offsets into items (valid table rows), y is rows x width.
        unsafe { b.launch(Self::grid(rows, 1, ENC_THREADS, 0)) }
            .map_err(cuda_err("launching the first layer"))?;
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
        let mut b = self.stream.launch_builder(self.function("hstu_attention"));
        b.arg(uvqk)
            .arg(seq_offsets)
            .arg(buckets)
            .arg(bucket_offsets)
            .arg(position_bias)
            .arg(time_bias)
            .arg(out)
            .arg(&dqk)
            .arg(&dv)
            .arg(&width)
            .arg(&attention_width);
        // SAFETY: matches hstu_attention(const float* uvqk, const u32* seq_offsets,
        // const u16* buckets, const u32* bucket_offsets, const float* position_bias,
        // const float* time_bias, float* out, u32 dqk, u32 dv, u32 width, u32 attention_width):
        // uvqk is tokens x width, out tokens x heads dv, seq_offsets sequences + 1 ascending token
        // offsets, each history's n x n buckets (values at most the time table's last row) at its
        // offset, histories at most attention_width long; dqk and dv <= 64 (DeviceModel checks).
        unsafe { b.launch(Self::grid(sequences, heads, ENC_THREADS, 0)) }
            .map_err(cuda_err("launching HSTU's attention"))?;
        Ok(())
    }

    fn hstu_gate(
        &self,
        uvqk: &Self::F32,
        normed: &Self::F32,
        gated: &mut Self::F32,
        rows: u32,
        values: u32,
        width: u32,
    ) -> Result<()> {
        let mut b = self.stream.launch_builder(self.function("hstu_gate"));
        b.arg(uvqk).arg(normed).arg(gated).arg(&values).arg(&width);
        // SAFETY: matches hstu_gate(const float* uvqk, const float* normed, float* gated,
        // u32 values, u32 width): uvqk rows x width (values <= width), normed and gated rows x
        // values.
        unsafe { b.launch(Self::grid(rows, 1, ENC_THREADS, 0)) }
            .map_err(cuda_err("launching HSTU's gate"))?;
        Ok(())
    }

    fn add_rows(&self, y: &mut Self::F32, x: &Self::F32, rows: u32, width: u32) -> Result<()> {
        let mut b = self.stream.launch_builder(self.function("add_rows"));
        b.arg(y).arg(x).arg(&width);
        // SAFETY: matches add_rows(float* y, const float* x, u32 width): both rows x width.
        unsafe { b.launch(Self::grid(rows, 1, ENC_THREADS, 0)) }
            .map_err(cuda_err("launching a residual add"))?;
        Ok(())
    }

    fn l2_normalize_rows(&self, x: &mut Self::F32, rows: u32, width: u32, eps: f32) -> Result<()> {
        let mut b = self
            .stream
            .launch_builder(self.function("l2_normalize_rows"));
        b.arg(x).arg(&width).arg(&eps);
        // SAFETY: matches l2_normalize_rows(float* x, u32 width, float eps): x is rows x width.
        unsafe { b.launch(Self::grid(rows, 1, ENC_THREADS, 0)) }
            .map_err(cuda_err("launching a row normalisation"))?;
        Ok(())
    }
}

/// The kernel of `prefix` (`score_tile_topk`, `sample_tile_topk`, `score_above`, `gemv_sample`,
/// `gemv_above`, `gemm_sample`, `gemm_above`) for the weights'
/// precision.
fn weight_kernel(prefix: &'static str, weights: &DeviceMatrix<CudaDevice>) -> &'static str {
    match (prefix, weights) {
        ("score_tile_topk", DeviceMatrix::F32(_)) => "score_tile_topk_f32",
        ("score_tile_topk", DeviceMatrix::F16(_)) => "score_tile_topk_f16",
        ("score_tile_topk", DeviceMatrix::I8 { .. }) => "score_tile_topk_i8",
        ("sample_tile_topk", DeviceMatrix::F32(_)) => "sample_tile_topk_f32",
        ("sample_tile_topk", DeviceMatrix::F16(_)) => "sample_tile_topk_f16",
        ("sample_tile_topk", DeviceMatrix::I8 { .. }) => "sample_tile_topk_i8",
        ("score_above", DeviceMatrix::F32(_)) => "score_above_f32",
        ("score_above", DeviceMatrix::F16(_)) => "score_above_f16",
        ("score_above", DeviceMatrix::I8 { .. }) => "score_above_i8",
        ("gemv_sample", DeviceMatrix::F32(_)) => "gemv_sample_f32",
        ("gemv_sample", DeviceMatrix::F16(_)) => "gemv_sample_f16",
        ("gemv_sample", DeviceMatrix::I8 { .. }) => "gemv_sample_i8",
        ("gemv_above", DeviceMatrix::F32(_)) => "gemv_above_f32",
        ("gemv_above", DeviceMatrix::F16(_)) => "gemv_above_f16",
        ("gemv_above", DeviceMatrix::I8 { .. }) => "gemv_above_i8",
        ("gemm_sample", DeviceMatrix::F32(_)) => "gemm_sample_f32",
        ("gemm_sample", DeviceMatrix::F16(_)) => "gemm_sample_f16",
        ("gemm_sample", DeviceMatrix::I8 { .. }) => "gemm_sample_i8",
        ("gemm_above", DeviceMatrix::F32(_)) => "gemm_above_f32",
        ("gemm_above", DeviceMatrix::F16(_)) => "gemm_above_f16",
        ("gemm_above", DeviceMatrix::I8 { .. }) => "gemm_above_i8",
        _ => unreachable!("a scan kernel family of fused_topk.cu"),
    }
}

/// The arguments the threshold scans (`score_above_*`, `gemv_above_*`) end with: the thresholds
/// (buffer, pitch, column), the survivor capacity, counts and slots.
fn push_threshold_outputs<'a>(
    b: &mut LaunchArgs<'a>,
    thresholds: &'a Thresholds<'_, CudaDevice>,
    survivors: &'a mut SurvivorsMut<'_, CudaDevice>,
) {
    let SurvivorsMut {
        counts,
        scores,
        index,
        capacity,
    } = survivors;
    b.arg(thresholds.scores)
        .arg(&thresholds.pitch)
        .arg(&thresholds.at)
        .arg(&*capacity)
        .arg(&mut **counts)
        .arg(&mut **scores)
        .arg(&mut **index);
}
