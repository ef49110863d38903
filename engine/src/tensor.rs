//! Read-only f32 tensors whose bytes either live in a memory-mapped engine file or in memory.
//!
//! Engines are loaded once and shared by every model instance, so the weights are mapped, not copied:
//! a [`Tensor`] is a cheap handle (an `Arc` and a range) that can also be a row slice of another tensor
//! (BERT4Rec's output layer is a view of its item embedding).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use crate::error::{EngineError, Result};

enum Backing {
    /// A read-only mapping of a whole file; tensors index into it by element range.
    Mapped(memmap2::Mmap),
    Owned(Vec<f32>),
    /// Arbitrary bytes copied into f32-aligned memory; `len` is the byte length.
    Bytes {
        words: Vec<f32>,
        len: usize,
    },
}

/// Shared, immutable f32 storage.
#[derive(Clone)]
pub struct Storage {
    backing: Arc<Backing>,
}

impl Storage {
    pub fn owned(values: Vec<f32>) -> Self {
        Storage {
            backing: Arc::new(Backing::Owned(values)),
        }
    }

    /// A copy of `bytes` (a weights file read into memory), aligned for f32 views.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let mut words = vec![0f32; bytes.len().div_ceil(4)];
        bytemuck::cast_slice_mut::<f32, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
        Storage {
            backing: Arc::new(Backing::Bytes {
                words,
                len: bytes.len(),
            }),
        }
    }

    pub(crate) fn mapped(map: memmap2::Mmap) -> Self {
        Storage {
            backing: Arc::new(Backing::Mapped(map)),
        }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        match &*self.backing {
            Backing::Mapped(map) => map,
            Backing::Owned(values) => bytemuck::cast_slice(values),
            Backing::Bytes { words, len } => &bytemuck::cast_slice(words)[..*len],
        }
    }
}

/// A row-major f32 tensor view into a [`Storage`].
#[derive(Clone)]
pub struct Tensor {
    storage: Storage,
    /// Byte offset of the first element inside the storage; always a multiple of 4 (checked on creation).
    byte_offset: usize,
    shape: Vec<usize>,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("shape", &self.shape)
            .finish()
    }
}

impl Tensor {
    pub fn from_vec(shape: Vec<usize>, values: Vec<f32>) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            values.len(),
            "shape does not match the number of values"
        );
        Tensor {
            storage: Storage::owned(values),
            byte_offset: 0,
            shape,
        }
    }

    /// A view of `shape` starting at `byte_offset` in `storage`. Fails if the range is out of bounds or
    /// not 4-byte aligned, which a damaged or hand-made weights file could produce.
    pub(crate) fn view(storage: &Storage, byte_offset: usize, shape: Vec<usize>) -> Result<Self> {
        let len_bytes = shape
            .iter()
            .try_fold(4usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| EngineError::Config(format!("tensor shape {shape:?} overflows")))?;
        let bytes = storage.bytes();
        let end = byte_offset.checked_add(len_bytes);
        let in_bounds = end.is_some_and(|end| end <= bytes.len());
        let aligned =
            (bytes.as_ptr() as usize + byte_offset).is_multiple_of(std::mem::align_of::<f32>());
        if !in_bounds || !aligned {
            return Err(EngineError::Config(format!(
                "tensor of shape {shape:?} at byte {byte_offset} does not fit the weights file \
                 (in bounds: {in_bounds}, aligned: {aligned})"
            )));
        }
        Ok(Tensor {
            storage: storage.clone(),
            byte_offset,
            shape,
        })
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn as_slice(&self) -> &[f32] {
        let bytes = &self.storage.bytes()[self.byte_offset..self.byte_offset + 4 * self.len()];
        // Alignment and bounds were checked when the view was made.
        bytemuck::cast_slice(bytes)
    }

    /// Rows `start..end` of a 1-D or 2-D tensor, sharing the storage.
    pub fn rows(&self, start: usize, end: usize) -> Tensor {
        assert!(
            matches!(self.shape.len(), 1 | 2),
            "rows() needs a 1-D or 2-D tensor"
        );
        assert!(
            start <= end && end <= self.shape[0],
            "row range out of bounds"
        );
        let width: usize = self.shape[1..].iter().product();
        let mut shape = self.shape.clone();
        shape[0] = end - start;
        Tensor {
            storage: self.storage.clone(),
            byte_offset: self.byte_offset + 4 * start * width,
            shape,
        }
    }

    /// Row `i` of a 2-D tensor.
    pub fn row(&self, i: usize) -> &[f32] {
        let cols = self.shape[1];
        &self.as_slice()[i * cols..(i + 1) * cols]
    }

    /// A transposed owned copy of a 2-D tensor.
    pub fn transposed(&self) -> Tensor {
        assert_eq!(self.shape.len(), 2, "transposed() needs a 2-D tensor");
        let (rows, cols) = (self.shape[0], self.shape[1]);
        let src = self.as_slice();
        let mut out = vec![0f32; rows * cols];
        for r in 0..rows {
            for c in 0..cols {
                out[c * rows + r] = src[r * cols + c];
            }
        }
        Tensor::from_vec(vec![cols, rows], out)
    }
}

/// The tensors an engine stores, by name, in the layout the model computes with.
pub type TensorMap = HashMap<String, Tensor>;

/// Fetches `name` from an engine tensor map, checking its shape.
pub fn take(tensors: &TensorMap, name: &str, shape: &[usize]) -> Result<Tensor> {
    let t = tensors
        .get(name)
        .ok_or_else(|| EngineError::MissingTensor { name: name.into() })?;
    if t.shape() != shape {
        return Err(EngineError::ShapeMismatch {
            name: name.into(),
            expected: shape.to_vec(),
            found: t.shape().to_vec(),
        });
    }
    Ok(t.clone())
}
