//! Kernel data that is either owned or a view into a read-only mapping of an engine file, so an
//! engine whose packed layout is stored on disk loads by mapping it (no copy, pages shared by every
//! instance and version that maps the same file) and one without packs it into memory as before.

use std::ops::Deref;
use std::sync::Arc;

/// The bytes a mapped view reads from: a memory map, shared by every view into it.
pub type Backing = Arc<dyn AsRef<[u8]> + Send + Sync>;

enum Repr<T> {
    Owned(Vec<T>),
    Mapped {
        bytes: Backing,
        offset: usize,
        len: usize,
    },
}

/// `[T]` owned or mapped; reads through `Deref`.
pub struct Shared<T> {
    repr: Repr<T>,
}

impl<T: bytemuck::Pod> Shared<T> {
    /// `len` values of `T` at byte `offset` of `bytes`; fails (naming why) when the range does not
    /// fit or is not aligned for `T`, which a damaged file could produce.
    pub fn mapped(bytes: Backing, offset: usize, len: usize) -> Result<Self, String> {
        let size = std::mem::size_of::<T>();
        let end = len
            .checked_mul(size)
            .and_then(|b| b.checked_add(offset))
            .ok_or_else(|| format!("{len} values at byte {offset} overflow"))?;
        let all = (*bytes).as_ref();
        if end > all.len() {
            return Err(format!(
                "{len} values of {size} bytes at byte {offset} run past the end ({} bytes)",
                all.len()
            ));
        }
        bytemuck::try_cast_slice::<u8, T>(&all[offset..end])
            .map_err(|e| format!("values at byte {offset} are not aligned for their type: {e}"))?;
        Ok(Shared {
            repr: Repr::Mapped { bytes, offset, len },
        })
    }

    /// Whether the values live in a mapping rather than in memory this process owns.
    pub fn is_mapped(&self) -> bool {
        matches!(self.repr, Repr::Mapped { .. })
    }

    /// The values as bytes (what is written to an engine file).
    pub fn as_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(self)
    }
}

impl<T: bytemuck::Pod> Deref for Shared<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.repr {
            Repr::Owned(values) => values,
            Repr::Mapped { bytes, offset, len } => bytemuck::cast_slice(
                &(**bytes).as_ref()[*offset..*offset + len * std::mem::size_of::<T>()],
            ),
        }
    }
}

impl<T> From<Vec<T>> for Shared<T> {
    fn from(values: Vec<T>) -> Self {
        Shared {
            repr: Repr::Owned(values),
        }
    }
}

impl<T: Clone> Clone for Shared<T> {
    fn clone(&self) -> Self {
        Shared {
            repr: match &self.repr {
                Repr::Owned(values) => Repr::Owned(values.clone()),
                Repr::Mapped { bytes, offset, len } => Repr::Mapped {
                    bytes: bytes.clone(),
                    offset: *offset,
                    len: *len,
                },
            },
        }
    }
}

impl<T: bytemuck::Pod> std::fmt::Debug for Shared<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} values",
            if self.is_mapped() { "mapped" } else { "owned" },
            self.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_check_bounds_and_alignment_and_read_in_place() {
        let words: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let bytes: Backing = Arc::new(bytemuck::cast_slice::<f32, u8>(&words).to_vec());
        let view = Shared::<f32>::mapped(bytes.clone(), 8, 4).unwrap();
        assert!(view.is_mapped());
        assert_eq!(&*view, &[2.0, 3.0, 4.0, 5.0]);
        assert_eq!(&*view.clone(), &*view);
        assert!(Shared::<f32>::mapped(bytes.clone(), 60, 2)
            .unwrap_err()
            .contains("past the end"));
        assert!(Shared::<f32>::mapped(bytes.clone(), 2, 2)
            .unwrap_err()
            .contains("aligned"));
        let owned: Shared<i8> = vec![1i8, -2].into();
        assert!(!owned.is_mapped());
        assert_eq!(owned.as_bytes(), &[1u8, 254]);
    }
}
