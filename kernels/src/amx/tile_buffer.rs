//! Cache-line-aligned storage for tiles: every 64-byte tile row a `tileloadd` reads starts a
//! cache line, so a row costs one line fill, not two (a bf16 output layer's scan on weights
//! 16 bytes off a line boundary, as the allocator hands out large vectors, ran about 5 % slower).

use std::marker::PhantomData;

/// Bytes of a cache line and of a full tile row.
pub const LINE_BYTES: usize = 64;

/// One cache line, the unit a [`TileBuffer`] is allocated in.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct CacheLine([u8; LINE_BYTES]);

// SAFETY: `CacheLine` is `repr(C)` over one `[u8; 64]` with alignment 64, so its size is 64 with
// no padding, every bit pattern is valid, and all zeros is a valid value.
unsafe impl bytemuck::Zeroable for CacheLine {}
// SAFETY: as above: plain bytes, no padding, no pointers, `Copy` and `'static`.
unsafe impl bytemuck::Pod for CacheLine {}

/// `len` values of `T` starting on a cache line, zero-initialised; derefs to `[T]`.
pub struct TileBuffer<T: bytemuck::Pod> {
    lines: Vec<CacheLine>,
    len: usize,
    values: PhantomData<T>,
}

impl<T: bytemuck::Pod> TileBuffer<T> {
    /// `len` zeros.
    pub fn zeroed(len: usize) -> Self {
        let bytes = len * std::mem::size_of::<T>();
        TileBuffer {
            lines: vec![CacheLine([0; LINE_BYTES]); bytes.div_ceil(LINE_BYTES)],
            len,
            values: PhantomData,
        }
    }

    /// A copy of `values`, aligned.
    pub fn from_slice(values: &[T]) -> Self {
        let mut buffer = Self::zeroed(values.len());
        buffer.copy_from_slice(values);
        buffer
    }
}

impl<T: bytemuck::Pod> std::ops::Deref for TileBuffer<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        let bytes: &[u8] = bytemuck::cast_slice(&self.lines);
        bytemuck::cast_slice(&bytes[..self.len * std::mem::size_of::<T>()])
    }
}

impl<T: bytemuck::Pod> std::ops::DerefMut for TileBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.lines);
        bytemuck::cast_slice_mut(&mut bytes[..self.len * std::mem::size_of::<T>()])
    }
}

impl<T: bytemuck::Pod> Clone for TileBuffer<T> {
    fn clone(&self) -> Self {
        TileBuffer {
            lines: self.lines.clone(),
            len: self.len,
            values: PhantomData,
        }
    }
}

impl<T: bytemuck::Pod + PartialEq> PartialEq for TileBuffer<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: bytemuck::Pod + std::fmt::Debug> std::fmt::Debug for TileBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TileBuffer")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_start_on_a_line_and_hold_what_was_written() {
        for len in [0, 1, 31, 32, 33, 512, 4097] {
            let mut b = TileBuffer::<u16>::zeroed(len);
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % LINE_BYTES, 0, "len {len}");
            assert!(b.iter().all(|&v| v == 0));
            for (i, v) in b.iter_mut().enumerate() {
                *v = i as u16;
            }
            let copy = b.clone();
            assert_eq!(copy.as_ptr() as usize % LINE_BYTES, 0);
            assert_eq!(copy, b);
            assert_eq!(&*TileBuffer::from_slice(&b[..]), &b[..]);
        }
    }
}
