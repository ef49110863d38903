//! Host side of the CUDA kernels: NVRTC compilation (cached per source hash, architecture and
//! options), the output layer's weights on the device, and typed launches of the fused score +
//! top-k kernels on one stream per scorer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PinnedHostSlice,
    PushKernelArg,
};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};
use recsys_engine::tensor::Tensor;
use recsys_engine::weights::Matrix;

use crate::{
    cache_key, compile_options, exclusion_csr, merge_plan, ranked_rows, stage1_launch, GpuError,
    Result, THREADS, TILE,
};

fn cuda_err(what: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> GpuError {
    move |e| GpuError::Cuda {
        what,
        message: e.to_string(),
    }
}

/// Whether the CUDA driver library can be opened (cudarc panics on first use otherwise).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library by its usual names; no CUDA call is made.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether NVRTC can be opened.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen libnvrtc by its usual names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// PTX of the kernels for `arch` ("sm_90"), compiled once per process and cache key.
pub fn compile(arch: &str) -> Result<String> {
    static CACHE: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();
    let key = cache_key(arch);
    let cache = CACHE.get_or_init(Default::default);
    if let Some(ptx) = cache
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&key)
    {
        return Ok(ptx.clone());
    }
    if !nvrtc_present() {
        return Err(GpuError::Unavailable(
            "libnvrtc.so.12 not found (install the CUDA toolkit's NVRTC or PyPI nvidia-cuda-nvrtc-cu12 \
             and put its lib directory on LD_LIBRARY_PATH)"
                .into(),
        ));
    }
    let opts = CompileOptions {
        options: compile_options(arch),
        name: Some("fused_topk.cu".into()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(crate::SOURCE, opts).map_err(|e| {
        GpuError::Compile {
            arch: arch.into(),
            log: match e {
                CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
                other => format!("{other:?}"),
            },
        }
    })?;
    let text = ptx.to_src();
    cache
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(key, text.clone());
    Ok(text)
}

/// The output layer's weights as the kernels read them.
enum DeviceWeights {
    F32(CudaSlice<f32>),
    F16(CudaSlice<u16>),
    I8 {
        q: CudaSlice<i8>,
        scales: CudaSlice<f32>,
    },
}

/// Fused score + top-k of one output layer on one GPU, with its own stream.
pub struct GpuOutputLayer {
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    score: CudaFunction,
    merge: CudaFunction,
    weights: DeviceWeights,
    bias: CudaSlice<f32>,
    n_items: usize,
    dim: usize,
    /// Page-locked staging for the hidden vectors, kept between batches (allocating page-locked
    /// memory costs far more than the copy) and grown to the largest batch seen.
    staging: Mutex<Option<PinnedHostSlice<f32>>>,
    /// "NVIDIA H200 (sm_90)", for logs.
    pub device: String,
}

pub use crate::Ranked;

impl GpuOutputLayer {
    /// Uploads `weight` (`[n_items, dim]`, any precision) and `bias` to device `ordinal` and compiles
    /// the kernels for its architecture.
    pub fn new(ordinal: usize, weight: &Matrix, bias: &Tensor) -> Result<GpuOutputLayer> {
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
        if weight.cols() == 0 || weight.cols() > crate::MAX_DIM {
            return Err(GpuError::Invalid(format!(
                "hidden size {}: the GPU kernels take 1..={}",
                weight.cols(),
                crate::MAX_DIM
            )));
        }
        let arch = format!("sm_{major}{minor}");
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let ptx = compile(&arch)?;
        let module = ctx
            .load_module(Ptx::from_src(ptx))
            .map_err(cuda_err("loading the compiled module"))?;
        let stream = ctx.new_stream().map_err(cuda_err("creating a stream"))?;
        let (n_items, dim) = (weight.rows(), weight.cols());
        let (weights, score_name) = match weight {
            Matrix::F32(t) => (
                DeviceWeights::F32(
                    stream
                        .memcpy_stod(t.as_slice())
                        .map_err(cuda_err("uploading weights"))?,
                ),
                "score_tile_topk_f32",
            ),
            Matrix::F16 { bits, start, .. } => (
                DeviceWeights::F16(
                    stream
                        .memcpy_stod(&bits[start * dim..(start + n_items) * dim])
                        .map_err(cuda_err("uploading weights"))?,
                ),
                "score_tile_topk_f16",
            ),
            Matrix::I8 {
                q, scales, start, ..
            } => (
                DeviceWeights::I8 {
                    q: stream
                        .memcpy_stod(&q[start * dim..(start + n_items) * dim])
                        .map_err(cuda_err("uploading weights"))?,
                    scales: stream
                        .memcpy_stod(&scales[*start..start + n_items])
                        .map_err(cuda_err("uploading scales"))?,
                },
                "score_tile_topk_i8",
            ),
        };
        let bias = stream
            .memcpy_stod(bias.as_slice())
            .map_err(cuda_err("uploading the bias"))?;
        let score = module
            .load_function(score_name)
            .map_err(cuda_err("finding the scoring kernel"))?;
        let merge = module
            .load_function("merge_topk")
            .map_err(cuda_err("finding the merge kernel"))?;
        Ok(GpuOutputLayer {
            stream,
            _module: module,
            score,
            merge,
            weights,
            bias,
            n_items,
            dim,
            staging: Mutex::new(None),
            device: format!("{name} ({arch})"),
        })
    }

    /// Top-`k` items for each of `rows` hidden vectors (`hidden` is `[rows, dim]`), leaving out
    /// index 0 (PAD) and each row's `exclude` list.
    pub fn topk(&self, hidden: &[f32], k: usize, exclude: &[&[u32]]) -> Result<Vec<Ranked>> {
        let rows = exclude.len();
        if hidden.len() != rows * self.dim {
            return Err(GpuError::Invalid(format!(
                "{} hidden values for {rows} rows of width {}",
                hidden.len(),
                self.dim
            )));
        }
        if rows == 0 {
            return Ok(Vec::new());
        }
        let stage1 = stage1_launch(self.n_items, self.dim, rows, k)?;
        let (offsets, mut ids) = exclusion_csr(exclude);
        if ids.is_empty() {
            ids.push(u32::MAX); // cudarc refuses zero-length allocations
        }
        let s = &self.stream;
        // Inputs staged through page-locked memory so the copies are true async DMA; the lock is
        // held to the end, when the downloads have synchronised the stream.
        let mut staging = self
            .staging
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let hidden_dev = self.upload_pinned(&mut staging, hidden)?;
        let offsets_dev = s
            .memcpy_stod(&offsets)
            .map_err(cuda_err("uploading exclusions"))?;
        let ids_dev = s
            .memcpy_stod(&ids)
            .map_err(cuda_err("uploading exclusions"))?;

        let plan = merge_plan(self.n_items, k);
        let mut scores = s
            .alloc_zeros::<f32>(rows * plan[0])
            .map_err(cuda_err("allocating candidates"))?;
        let mut index = s
            .alloc_zeros::<u32>(rows * plan[0])
            .map_err(cuda_err("allocating candidates"))?;
        let (n, d, kp) = (self.n_items as u32, self.dim as u32, stage1.keep);
        let batch = rows as u32;
        let cfg = LaunchConfig {
            grid_dim: (stage1.tiles, stage1.groups, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: stage1.shared_bytes,
        };
        let mut launch = s.launch_builder(&self.score);
        launch.arg(&hidden_dev);
        match &self.weights {
            DeviceWeights::F32(w) => {
                launch.arg(w);
            }
            DeviceWeights::F16(w) => {
                launch.arg(w);
            }
            DeviceWeights::I8 { q, scales } => {
                launch.arg(q).arg(scales);
            }
        }
        launch
            .arg(&self.bias)
            .arg(&offsets_dev)
            .arg(&ids_dev)
            .arg(&batch)
            .arg(&stage1.rows_per_block)
            .arg(&n)
            .arg(&d)
            .arg(&kp)
            .arg(&mut scores)
            .arg(&mut index);
        // SAFETY: the arguments match score_tile_topk_{f32,f16,i8}(const float* hidden,
        // const W* weights, [const float* row_scales,] const float* bias, const u32* exclude_offsets,
        // const u32* exclude_ids, u32 batch, u32 rows_per_block, u32 n_items, u32 dim, u32 keep,
        // float* out_scores, u32* out_index) in kernels/fused_topk.cu; hidden is batch x dim,
        // weights n_items x dim (+ n_items scales), exclusions batch + 1 offsets into ids, outputs
        // batch x tiles x keep = batch x plan[0]; the grid's groups x rows_per_block covers the
        // batch, and the dynamic shared memory holds one group's hidden rows.
        unsafe { launch.launch(cfg) }.map_err(cuda_err("launching the scoring kernel"))?;

        for window in plan.windows(2) {
            let (count, next) = (window[0] as u32, window[1]);
            let mut next_scores = s
                .alloc_zeros::<f32>(rows * next)
                .map_err(cuda_err("allocating candidates"))?;
            let mut next_index = s
                .alloc_zeros::<u32>(rows * next)
                .map_err(cuda_err("allocating candidates"))?;
            let cfg = LaunchConfig {
                grid_dim: ((count as usize).div_ceil(TILE) as u32, rows as u32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut launch = s.launch_builder(&self.merge);
            launch
                .arg(&scores)
                .arg(&index)
                .arg(&count)
                .arg(&kp)
                .arg(&mut next_scores)
                .arg(&mut next_index);
            // SAFETY: matches merge_topk(const float* in_scores, const u32* in_index, u32 count,
            // u32 keep, float* out_scores, u32* out_index): inputs rows x count, outputs rows x
            // blocks x keep = rows x next.
            unsafe { launch.launch(cfg) }.map_err(cuda_err("launching the merge kernel"))?;
            scores = next_scores;
            index = next_index;
        }
        let top_scores = s
            .memcpy_dtov(&scores)
            .map_err(cuda_err("downloading results"))?;
        let top_index = s
            .memcpy_dtov(&index)
            .map_err(cuda_err("downloading results"))?;
        Ok(ranked_rows(&top_scores, &top_index, &plan, rows, k))
    }

    /// Copies `values` into the staging buffer and from there to the device. The caller holds the
    /// staging lock until the stream has finished with the copy (its results are downloaded).
    fn upload_pinned(
        &self,
        staging: &mut Option<PinnedHostSlice<f32>>,
        values: &[f32],
    ) -> Result<CudaSlice<f32>> {
        let pinned = match staging {
            Some(p) if p.len() >= values.len() => p,
            _ => {
                // SAFETY: the new buffer is written below (up to values.len()) before any read,
                // and only that prefix is ever copied.
                let fresh = unsafe { self.stream.context().alloc_pinned::<f32>(values.len()) }
                    .map_err(cuda_err("allocating page-locked memory"))?;
                staging.insert(fresh)
            }
        };
        // as_mut_slice waits for any copy still reading the buffer.
        let host = pinned
            .as_mut_slice()
            .map_err(cuda_err("mapping page-locked memory"))?;
        host[..values.len()].copy_from_slice(values);
        let mut dev = self
            .stream
            .alloc_zeros::<f32>(values.len())
            .map_err(cuda_err("allocating hidden vectors"))?;
        self.stream
            .memcpy_htod(&host[..values.len()], &mut dev)
            .map_err(cuda_err("uploading hidden vectors"))?;
        Ok(dev)
    }
}

impl recsys_engine::OutputScorer for GpuOutputLayer {
    fn top_k(
        &self,
        hidden: &[f32],
        ks: &[usize],
        excluded: Vec<Vec<u32>>,
    ) -> std::result::Result<recsys_engine::RankedRows, String> {
        // One launch for the batch at its largest k; each row is cut to its own k.
        let k = ks.iter().copied().max().unwrap_or(1).max(1);
        let refs: Vec<&[u32]> = excluded.iter().map(Vec::as_slice).collect();
        let ranked = self.topk(hidden, k, &refs).map_err(|e| e.to_string())?;
        Ok(ranked
            .into_iter()
            .zip(ks)
            .map(|(row, &k)| {
                row.into_iter()
                    .take(k)
                    .map(|(index, score)| recsys_engine::topk::Scored { index, score })
                    .collect()
            })
            .collect())
    }
}
