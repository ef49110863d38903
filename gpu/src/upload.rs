//! Weights onto a device at their stored precision: the item tables as they are (they grow with
//! the catalogue), the output layer's rows padded for 16-byte loads, and dense layers read back
//! as f32. A bf16 engine is refused: no kernel reads bfloat16.

use recsys_engine::weights::Matrix;

use crate::device::{Device, DeviceMatrix};
use crate::{GpuError, Result};

/// Why a bf16 engine is refused: the CUDA kernels have no bfloat16 path.
pub const BF16_ON_GPU: &str = "this engine is bf16 (--precision bf16), which the GPU kernels do \
     not implement; serve it on the CPU, or convert with --precision fp16 for the GPU";

/// The refusal of a matrix no GPU kernel reads.
fn bf16_refused() -> GpuError {
    GpuError::Invalid(BF16_ON_GPU.into())
}

/// Uploads a matrix at its stored precision (the item tables, which grow with the catalogue).
pub fn upload_matrix<D: Device>(device: &D, m: &Matrix) -> Result<DeviceMatrix<D>> {
    let (rows, cols) = (m.rows(), m.cols());
    Ok(match m {
        Matrix::F32(t) => DeviceMatrix::F32(device.upload_f32(t.as_slice())?),
        Matrix::F16 { bits, start, .. } => {
            DeviceMatrix::F16(device.upload_u16(&bits[start * cols..(start + rows) * cols])?)
        }
        Matrix::I8 {
            q, scales, start, ..
        } => DeviceMatrix::I8 {
            q: device.upload_i8(&q[start * cols..(start + rows) * cols])?,
            scales: device.upload_f32(&scales[*start..start + rows])?,
        },
        Matrix::Bf16 { .. } => return Err(bf16_refused()),
    })
}

/// Bytes of one stored element of `m`.
pub(crate) fn element_bytes(m: &Matrix) -> usize {
    match m {
        Matrix::F32(_) => 4,
        Matrix::F16 { .. } | Matrix::Bf16 { .. } => 2,
        Matrix::I8 { .. } => 1,
    }
}

/// Each `cols`-wide row of `values` followed by zeros up to `pitch`.
fn padded_rows<T: Copy + Default>(values: &[T], cols: usize, pitch: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(values.len() / cols.max(1) * pitch);
    for row in values.chunks_exact(cols.max(1)) {
        out.extend_from_slice(row);
        out.resize(out.len() + pitch - cols, T::default());
    }
    out
}

/// Uploads an output-layer table with its rows padded to `pitch` elements ([`crate::row_pitch`]).
pub fn upload_padded_matrix<D: Device>(
    device: &D,
    m: &Matrix,
    pitch: usize,
) -> Result<DeviceMatrix<D>> {
    let (rows, cols) = (m.rows(), m.cols());
    if pitch == cols {
        return upload_matrix(device, m);
    }
    Ok(match m {
        Matrix::F32(t) => {
            DeviceMatrix::F32(device.upload_f32(&padded_rows(t.as_slice(), cols, pitch))?)
        }
        Matrix::F16 { bits, start, .. } => DeviceMatrix::F16(device.upload_u16(&padded_rows(
            &bits[start * cols..(start + rows) * cols],
            cols,
            pitch,
        ))?),
        Matrix::I8 {
            q, scales, start, ..
        } => DeviceMatrix::I8 {
            q: device.upload_i8(&padded_rows(
                &q[start * cols..(start + rows) * cols],
                cols,
                pitch,
            ))?,
            scales: device.upload_f32(&scales[*start..start + rows])?,
        },
        Matrix::Bf16 { .. } => return Err(bf16_refused()),
    })
}

/// A matrix's values as f32 (each row as the CPU engine reads it).
pub fn dequantized(m: &Matrix) -> Vec<f32> {
    let cols = m.cols();
    let mut out = vec![0f32; m.rows() * cols];
    for (r, row) in out.chunks_exact_mut(cols.max(1)).enumerate() {
        m.add_row_into(r, row);
    }
    out
}
