//! Weight matrices at the engine's precision, views of the memory-mapped weights file at every
//! precision (fp32 as [`Tensor`]s, fp16, bf16 and int8 as [`Elements`]). Every model reads its 2-D
//! weights through [`Matrix`], so one model code path serves every precision.

use std::collections::HashMap;

use crate::elements::Elements;
use crate::error::{EngineError, Result};
use crate::kernels::packed::{bf16_to_f32, PackedOutput};
use crate::tensor::Tensor;

/// A tensor stored in a non-f32 dtype (quantized weights), as little-endian bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct RawTensor {
    pub dtype: safetensors::Dtype,
    pub shape: Vec<usize>,
    /// In memory when converting; where the weights file is mapped when loading.
    pub bytes: Elements<u8>,
}

/// A row-major `[rows, cols]` weight matrix.
#[derive(Clone, Debug)]
pub enum Matrix {
    F32(Tensor),
    /// IEEE half bits; `start` is the first row of this view into the shared storage.
    F16 {
        bits: Elements<u16>,
        start: usize,
        rows: usize,
        cols: usize,
    },
    /// bfloat16 bits (widened exactly where rows are read; see [`Matrix::pack`] for layers).
    Bf16 {
        bits: Elements<u16>,
        start: usize,
        rows: usize,
        cols: usize,
    },
    /// Symmetric int8 with one scale per row.
    I8 {
        q: Elements<i8>,
        scales: Elements<f32>,
        start: usize,
        rows: usize,
        cols: usize,
    },
}

impl Matrix {
    pub fn rows(&self) -> usize {
        match self {
            Matrix::F32(t) => t.shape()[0],
            Matrix::F16 { rows, .. } | Matrix::Bf16 { rows, .. } | Matrix::I8 { rows, .. } => *rows,
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            Matrix::F32(t) => t.shape()[1],
            Matrix::F16 { cols, .. } | Matrix::Bf16 { cols, .. } | Matrix::I8 { cols, .. } => *cols,
        }
    }

    /// Rows `from..to`, sharing the storage.
    pub fn slice_rows(&self, from: usize, to: usize) -> Matrix {
        assert!(from <= to && to <= self.rows(), "row range out of bounds");
        match self {
            Matrix::F32(t) => Matrix::F32(t.rows(from, to)),
            Matrix::F16 {
                bits, start, cols, ..
            } => Matrix::F16 {
                bits: bits.clone(),
                start: start + from,
                rows: to - from,
                cols: *cols,
            },
            Matrix::Bf16 {
                bits, start, cols, ..
            } => Matrix::Bf16 {
                bits: bits.clone(),
                start: start + from,
                rows: to - from,
                cols: *cols,
            },
            Matrix::I8 {
                q,
                scales,
                start,
                cols,
                ..
            } => Matrix::I8 {
                q: q.clone(),
                scales: scales.clone(),
                start: start + from,
                rows: to - from,
                cols: *cols,
            },
        }
    }

    /// Row `i` as f32 (dequantized), added into `out` (which must be `cols` long).
    pub fn add_row_into(&self, i: usize, out: &mut [f32]) {
        match self {
            Matrix::F32(t) => t.add_row_into(i, out),
            Matrix::F16 {
                bits, start, cols, ..
            } => bits.with_values((start + i) * cols, *cols, |row| {
                for (o, &b) in out.iter_mut().zip(row) {
                    *o += half::f16::from_bits(b).to_f32();
                }
            }),
            Matrix::Bf16 {
                bits, start, cols, ..
            } => bits.with_values((start + i) * cols, *cols, |row| {
                for (o, &b) in out.iter_mut().zip(row) {
                    *o += bf16_to_f32(b);
                }
            }),
            Matrix::I8 {
                q,
                scales,
                start,
                cols,
                ..
            } => {
                let scale = scales[start + i];
                q.with_values((start + i) * cols, *cols, |row| {
                    for (o, &v) in out.iter_mut().zip(row) {
                        *o += v as f32 * scale;
                    }
                })
            }
        }
    }

    /// Packs the matrix (as `[n, d]` output rows) with `bias` for the fused kernels.
    pub fn pack(&self, bias: &[f32]) -> PackedOutput {
        let (rows, cols) = (self.rows(), self.cols());
        match self {
            Matrix::F32(t) => PackedOutput::from_f32(t.as_slice(), bias, cols),
            Matrix::F16 { bits, start, .. } => {
                PackedOutput::from_f16_bits(&bits[start * cols..(start + rows) * cols], bias, cols)
            }
            Matrix::Bf16 { bits, start, .. } => {
                PackedOutput::from_bf16_bits(&bits[start * cols..(start + rows) * cols], bias, cols)
            }
            Matrix::I8 {
                q, scales, start, ..
            } => PackedOutput::from_i8(
                &q[start * cols..(start + rows) * cols],
                &scales[*start..start + rows],
                bias,
                cols,
            ),
        }
    }

    /// Packs rows `rows` of the matrix (in that order) with their `bias` for the fused kernels: the
    /// same layout and arithmetic as [`Matrix::pack`], so each row scores bit for bit as it does
    /// in the whole table.
    pub fn pack_rows(&self, rows: &[u32], bias: &[f32]) -> PackedOutput {
        let cols = self.cols();
        match self {
            Matrix::F32(t) => PackedOutput::gathered_f32(t.as_slice(), rows, bias, cols),
            Matrix::F16 { bits, start, .. } => {
                PackedOutput::gathered_f16_bits(&bits[start * cols..], rows, bias, cols)
            }
            Matrix::Bf16 { bits, start, .. } => {
                PackedOutput::gathered_bf16_bits(&bits[start * cols..], rows, bias, cols)
            }
            Matrix::I8 {
                q, scales, start, ..
            } => {
                let row_scales: Vec<f32> =
                    rows.iter().map(|&r| scales[start + r as usize]).collect();
                PackedOutput::gathered_i8(&q[start * cols..], rows, &row_scales, bias, cols)
            }
        }
    }

    /// [`Matrix::pack_rows`] for a few scattered rows of the table (the survivors a screen
    /// rescores): a large fp32 table in a mapped file gives them by positioned reads (see
    /// [`Tensor::copy_row_into`]) so that scanning never maps the table it screens out. The
    /// same layout and bits as [`Matrix::pack_rows`].
    pub fn pack_scattered_rows(&self, rows: &[u32], bias: &[f32]) -> PackedOutput {
        let cols = self.cols();
        match self {
            Matrix::F32(t) if t.reads_rows_from_file() => {
                let mut compact = vec![0f32; rows.len() * cols];
                for (out, &r) in compact.chunks_exact_mut(cols.max(1)).zip(rows) {
                    t.copy_row_into(r as usize, out);
                }
                PackedOutput::from_f32(&compact, bias, cols)
            }
            Matrix::F16 { bits, start, .. } if bits.reads_from_file() => {
                let mut compact = vec![0u16; rows.len() * cols];
                for (out, &r) in compact.chunks_exact_mut(cols.max(1)).zip(rows) {
                    bits.copy_into((start + r as usize) * cols, out);
                }
                PackedOutput::from_f16_bits(&compact, bias, cols)
            }
            Matrix::Bf16 { bits, start, .. } if bits.reads_from_file() => {
                let mut compact = vec![0u16; rows.len() * cols];
                for (out, &r) in compact.chunks_exact_mut(cols.max(1)).zip(rows) {
                    bits.copy_into((start + r as usize) * cols, out);
                }
                PackedOutput::from_bf16_bits(&compact, bias, cols)
            }
            Matrix::I8 {
                q, scales, start, ..
            } if q.reads_from_file() => {
                let mut compact = vec![0i8; rows.len() * cols];
                for (out, &r) in compact.chunks_exact_mut(cols.max(1)).zip(rows) {
                    q.copy_into((start + r as usize) * cols, out);
                }
                let row_scales: Vec<f32> =
                    rows.iter().map(|&r| scales[start + r as usize]).collect();
                PackedOutput::from_i8(&compact, &row_scales, bias, cols)
            }
            _ => self.pack_rows(rows, bias),
        }
    }

    /// The precision the matrix is stored in, by its manifest name.
    pub fn precision_name(&self) -> &'static str {
        match self {
            Matrix::F32(_) => "fp32",
            Matrix::F16 { .. } => "fp16",
            Matrix::Bf16 { .. } => "bf16",
            Matrix::I8 { .. } => "int8",
        }
    }
}

fn odd_bytes(name: &str) -> EngineError {
    EngineError::Config(format!(
        "tensor {name}'s bytes are not a whole number of its values"
    ))
}

/// Name of the per-row scales of an int8 matrix.
pub fn scale_name(name: &str) -> String {
    format!("{name}.scale")
}

/// All tensors of an engine: f32 ones (mapped) and quantized ones.
#[derive(Clone, Debug, Default)]
pub struct Weights {
    pub f32: HashMap<String, Tensor>,
    pub raw: HashMap<String, RawTensor>,
}

impl Weights {
    /// An f32 tensor of exactly `shape` (biases, norms, small embeddings).
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        crate::tensor::take(&self.f32, name, shape)
    }

    /// A 2-D weight at whatever precision it was stored in.
    pub fn matrix(&self, name: &str, shape: [usize; 2]) -> Result<Matrix> {
        if let Some(raw) = self.raw.get(name) {
            if raw.shape != shape {
                return Err(EngineError::ShapeMismatch {
                    name: name.into(),
                    expected: shape.to_vec(),
                    found: raw.shape.clone(),
                });
            }
            let [rows, cols] = shape;
            return match raw.dtype {
                // Views of the stored bytes (little-endian, as every target of this crate is):
                // where the weights file is mapped, no copy.
                safetensors::Dtype::F16 => Ok(Matrix::F16 {
                    bits: raw.bytes.cast().ok_or_else(|| odd_bytes(name))?,
                    start: 0,
                    rows,
                    cols,
                }),
                safetensors::Dtype::BF16 => Ok(Matrix::Bf16 {
                    bits: raw.bytes.cast().ok_or_else(|| odd_bytes(name))?,
                    start: 0,
                    rows,
                    cols,
                }),
                safetensors::Dtype::I8 => {
                    let scales = self.tensor(&scale_name(name), &[rows])?;
                    Ok(Matrix::I8 {
                        q: raw.bytes.cast().ok_or_else(|| odd_bytes(name))?,
                        scales: Elements::of_tensor(&scales),
                        start: 0,
                        rows,
                        cols,
                    })
                }
                other => Err(EngineError::UnsupportedDtype {
                    name: name.into(),
                    dtype: format!("{other:?}"),
                }),
            };
        }
        Ok(Matrix::F32(self.tensor(name, &shape)?))
    }
}
