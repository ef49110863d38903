//! Stored tensors of element types other than f32 (half bits, int8, and the bytes of either) as
//! typed views of a [`Storage`]: an engine's fp16 and int8 weights are read where the weights file
//! is mapped, as its f32 tensors are, instead of being copied into memory at every load.

use std::cell::RefCell;
use std::fmt;
use std::marker::PhantomData;
use std::ops::Deref;

use crate::tensor::Storage;

/// `len` values of `T` at byte `byte_offset` of a storage (a mapped weights file or memory).
pub struct Elements<T> {
    storage: Storage,
    byte_offset: usize,
    len: usize,
    marker: PhantomData<T>,
}

impl<T: bytemuck::Pod> Elements<T> {
    /// The values in memory of their own.
    pub fn from_vec(values: Vec<T>) -> Self {
        let len = values.len();
        Elements {
            storage: Storage::from_bytes(bytemuck::cast_slice(&values)),
            byte_offset: 0,
            len,
            marker: PhantomData,
        }
    }

    /// `len` values at `byte_offset` of `storage`, in place when that is aligned for `T`, else
    /// copied into memory aligned for it (a file writer may place a half tensor at an odd byte).
    /// Fails, naming the range, when it runs past the end.
    pub(crate) fn view(storage: &Storage, byte_offset: usize, len: usize) -> Result<Self, String> {
        let size = std::mem::size_of::<T>();
        let all = storage.bytes();
        let end = len
            .checked_mul(size)
            .and_then(|b| b.checked_add(byte_offset))
            .filter(|&end| end <= all.len())
            .ok_or_else(|| {
                format!(
                    "{len} values of {size} bytes at byte {byte_offset} run past the end of the \
                     weights ({} bytes)",
                    all.len()
                )
            })?;
        let bytes = &all[byte_offset..end];
        if bytemuck::try_cast_slice::<u8, T>(bytes).is_err() {
            return Ok(Elements {
                storage: Storage::from_bytes(bytes),
                byte_offset: 0,
                len,
                marker: PhantomData,
            });
        }
        Ok(Elements {
            storage: storage.clone(),
            byte_offset,
            len,
            marker: PhantomData,
        })
    }

    /// The same bytes as values of `U` (the stored bytes of a half or int8 tensor as its values),
    /// in place when aligned; `None` when the byte length is not a whole number of `U`.
    pub fn cast<U: bytemuck::Pod>(&self) -> Option<Elements<U>> {
        let bytes = self.len * std::mem::size_of::<T>();
        let size = std::mem::size_of::<U>();
        if size == 0 || !bytes.is_multiple_of(size) {
            return None;
        }
        Elements::view(&self.storage, self.byte_offset, bytes / size).ok()
    }

    /// The values `start..start + out.len()` copied into `out`: by a positioned read of the
    /// weights file when these values are a large table in it (see
    /// [`Storage::row_file`] for why), else from memory or the mapping.
    pub fn copy_into(&self, start: usize, out: &mut [T]) {
        assert!(
            start + out.len() <= self.len,
            "values {start}..{} of {}",
            start + out.len(),
            self.len
        );
        let size = std::mem::size_of::<T>();
        self.storage.read_into(
            self.len * size,
            self.byte_offset + start * size,
            bytemuck::cast_slice_mut(out),
        );
    }

    /// Calls `f` with the values `start..start + len`, read as [`Self::copy_into`] reads them:
    /// in place when they are in memory or a small mapped table, else into a buffer this thread
    /// reuses (so a row read costs no allocation). `f` must not call it again.
    pub fn with_values<R>(&self, start: usize, len: usize, f: impl FnOnce(&[T]) -> R) -> R {
        if !self.reads_from_file() {
            return f(&self.as_slice()[start..start + len]);
        }
        thread_local! {
            /// 4-byte aligned, so it holds values of every element type stored here.
            static BUFFER: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
        }
        const { assert!(std::mem::align_of::<T>() <= std::mem::align_of::<f32>()) };
        let size = std::mem::size_of::<T>();
        BUFFER.with(|buffer| {
            let mut buffer = buffer.borrow_mut();
            let words = (len * size).div_ceil(4);
            if buffer.len() < words {
                buffer.resize(words, 0.0);
            }
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut buffer[..words]);
            let values: &mut [T] = bytemuck::cast_slice_mut(&mut bytes[..len * size]);
            self.copy_into(start, values);
            f(values)
        })
    }

    /// Whether [`Self::copy_into`] reads from the file rather than the mapping.
    pub fn reads_from_file(&self) -> bool {
        self.storage
            .row_file(self.len * std::mem::size_of::<T>())
            .is_some()
    }

    /// The stored values.
    pub fn as_slice(&self) -> &[T] {
        let size = std::mem::size_of::<T>();
        let bytes = &self.storage.bytes()[self.byte_offset..self.byte_offset + self.len * size];
        // Bounds and alignment were checked (or made so by a copy) when the view was made.
        bytemuck::cast_slice(bytes)
    }
}

impl Elements<f32> {
    /// The values of an f32 tensor, sharing its storage.
    pub fn of_tensor(tensor: &crate::tensor::Tensor) -> Self {
        let (storage, byte_offset) = tensor.storage_at();
        Elements {
            storage: storage.clone(),
            byte_offset,
            len: tensor.len(),
            marker: PhantomData,
        }
    }
}

impl<T: bytemuck::Pod> Deref for Elements<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        self.as_slice()
    }
}

impl<T: bytemuck::Pod> From<Vec<T>> for Elements<T> {
    fn from(values: Vec<T>) -> Self {
        Elements::from_vec(values)
    }
}

impl<T> Clone for Elements<T> {
    fn clone(&self) -> Self {
        Elements {
            storage: self.storage.clone(),
            byte_offset: self.byte_offset,
            len: self.len,
            marker: PhantomData,
        }
    }
}

impl<T> fmt::Debug for Elements<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Elements<{}>[{}]", std::any::type_name::<T>(), self.len)
    }
}

impl<T: bytemuck::Pod + PartialEq> PartialEq for Elements<T> {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_misaligned_view_is_copied_and_keeps_its_values() {
        let bytes: Vec<u8> = (0u8..16).collect();
        let storage = Storage::from_bytes(&bytes);
        let halves = Elements::<u16>::view(&storage, 1, 4).unwrap();
        let want: Vec<u16> = (0..4)
            .map(|i| u16::from_le_bytes([1 + 2 * i as u8, 2 + 2 * i as u8]))
            .collect();
        assert_eq!(halves.as_slice(), want.as_slice());
        let mut out = [0u16; 2];
        halves.copy_into(1, &mut out);
        assert_eq!(out, [want[1], want[2]]);
        let aligned = Elements::<u8>::view(&storage, 2, 8).unwrap();
        assert_eq!(
            aligned.cast::<u16>().unwrap().as_slice(),
            &want_at(&bytes, 2)[..]
        );
        assert!(
            aligned.cast::<f32>().is_some()
                && Elements::<u8>::view(&storage, 2, 7)
                    .unwrap()
                    .cast::<u16>()
                    .is_none()
        );
        assert!(Elements::<u16>::view(&storage, 10, 4).is_err());
    }

    fn want_at(bytes: &[u8], at: usize) -> Vec<u16> {
        bytes[at..at + 8]
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect()
    }
}
