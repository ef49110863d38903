//! Read-only f32 tensors whose bytes either live in a memory-mapped engine file or in memory.
//!
//! Engines are loaded once and shared by every model instance, so the weights are mapped, not copied:
//! a [`Tensor`] is a cheap handle (an `Arc` and a range) that can also be a row slice of another tensor
//! (BERT4Rec's output layer is a view of its item embedding).

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use crate::error::{EngineError, Result};

enum Backing {
    /// A read-only mapping of a whole file; tensors index into it by element range.
    Mapped {
        map: memmap2::Mmap,
        /// The mapped file, for positioned reads of the rows of large tables (see
        /// [`Tensor::copy_row_into`]).
        file: std::fs::File,
        /// Tables of at least this many bytes are read by row from `file`, not through `map`.
        row_reads_min_bytes: usize,
    },
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

    /// The mapping `map` of the whole of `file`; tensors of at least `row_reads_min_bytes` read
    /// their rows from `file` (see [`Tensor::copy_row_into`]).
    pub(crate) fn mapped(map: memmap2::Mmap, file: File, row_reads_min_bytes: usize) -> Self {
        Storage {
            backing: Arc::new(Backing::Mapped {
                map,
                file,
                row_reads_min_bytes,
            }),
        }
    }

    /// The file to read a table of `table_bytes` from, row by row, when it is a large table in a
    /// mapped file.
    ///
    /// Why not the mapping: Linux maps whole page-cache folios (up to 2 MiB on this project's
    /// kernels, whatever `madvise` says) around every page a mapping touches, so a table read a
    /// few scattered rows at a time (a Mult-VAE's history rows, the rows a screen rescores) ends
    /// up mapped almost whole into the process after a few hundred requests, although each one
    /// reads a few hundred KiB of it. A positioned read copies the row and maps nothing; it costs
    /// a system call (under a microsecond here), which is why small tables, read many rows per
    /// request, stay on the mapping.
    pub(crate) fn row_file(&self, table_bytes: usize) -> Option<&File> {
        match &*self.backing {
            Backing::Mapped {
                file,
                row_reads_min_bytes,
                ..
            } if table_bytes >= *row_reads_min_bytes => Some(file),
            _ => None,
        }
    }

    /// Copies the bytes at `offset..offset + out.len()` (inside a table of `table_bytes`) into
    /// `out`: by a positioned read of the file when [`Self::row_file`] says so, else from memory.
    /// The same bytes either way; a read that fails (the file replaced under a running server)
    /// falls back to the mapping.
    pub(crate) fn read_into(&self, table_bytes: usize, offset: usize, out: &mut [u8]) {
        if let Some(file) = self.row_file(table_bytes) {
            if file.read_exact_at(out, offset as u64).is_ok() {
                return;
            }
        }
        out.copy_from_slice(&self.bytes()[offset..offset + out.len()]);
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        match &*self.backing {
            Backing::Mapped { map, .. } => map,
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

    /// The storage this tensor views and the byte offset of its first element.
    pub(crate) fn storage_at(&self) -> (&Storage, usize) {
        (&self.storage, self.byte_offset)
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

    /// Whether [`Self::copy_row_into`] reads rows from the file rather than the mapping (see
    /// [`Storage::row_file`]).
    pub fn reads_rows_from_file(&self) -> bool {
        self.storage.row_file(4 * self.len()).is_some()
    }

    /// Row `i` of a 2-D tensor copied into `out` (`cols` long): by a positioned read of the file
    /// for a large mapped table, else from the mapping (see [`Storage::read_into`]).
    pub fn copy_row_into(&self, i: usize, out: &mut [f32]) {
        let cols = self.shape[1];
        assert_eq!(out.len(), cols, "the row buffer must be one row long");
        assert!(i < self.shape[0], "row {i} out of bounds");
        let offset = self.byte_offset + 4 * i * cols;
        self.storage
            .read_into(4 * self.len(), offset, bytemuck::cast_slice_mut(out));
    }

    /// Row `i` of a 2-D tensor added into `out` (`cols` long), read as [`Self::copy_row_into`]
    /// reads it.
    pub fn add_row_into(&self, i: usize, out: &mut [f32]) {
        if !self.reads_rows_from_file() {
            for (o, w) in out.iter_mut().zip(self.row(i)) {
                *o += w;
            }
            return;
        }
        thread_local! {
            /// One row of a table read from its file, reused by every read on this thread.
            static ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
        }
        ROW.with(|row| {
            let mut row = row.borrow_mut();
            row.resize(out.len(), 0.0);
            self.copy_row_into(i, &mut row);
            for (o, w) in out.iter_mut().zip(row.iter()) {
                *o += w;
            }
        });
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
