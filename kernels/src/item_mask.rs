//! Which items one request may be recommended: a dense bitset over the catalogue's internal
//! indices, laid out so that byte `p` of it is packed panel `p` (items `8p .. 8p + 8`).
//!
//! The scan reads a panel's byte to skip panels no row of its group may receive without scoring
//! them, and the selection tests one bit for an item that beats a row's bar. A dense bitset is the
//! form both tests cost least in (one load and a mask); the compressed sets an engine stores
//! become one of these per distinct filter.

/// Eligible items of one request; items at or past `n` (the last panel's padding) never are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ItemMask {
    /// Bit `i % 64` of word `i / 64` is item `i`: little-endian, so byte `p` is panel `p`.
    words: Vec<u64>,
    n: usize,
    /// Panels holding an eligible item, counted once when first asked (a mask is built, then
    /// shared read-only by the requests that use it; a change forgets the count).
    busy: std::sync::OnceLock<usize>,
}

impl ItemMask {
    /// No item of an `n`-item catalogue.
    pub fn none(n: usize) -> Self {
        ItemMask {
            words: vec![0; n.div_ceil(64)],
            n,
            busy: Default::default(),
        }
    }

    /// Every item of an `n`-item catalogue.
    pub fn all(n: usize) -> Self {
        let mut mask = ItemMask {
            words: vec![u64::MAX; n.div_ceil(64)],
            n,
            busy: Default::default(),
        };
        mask.clear_tail();
        mask
    }

    /// The items of `indices` (each below `n`; larger ones are ignored).
    pub fn of(n: usize, indices: impl IntoIterator<Item = u32>) -> Self {
        let mut mask = Self::none(n);
        for i in indices {
            mask.insert(i);
        }
        mask
    }

    /// The same items over an `n`-item catalogue: items at or past `n` are dropped, new ones are
    /// not eligible (an output layer with rows past the id map's, such as a mask token's).
    pub fn resized(mut self, n: usize) -> Self {
        self.words.resize(n.div_ceil(64), 0);
        self.n = n;
        self.clear_tail();
        self.busy = Default::default();
        self
    }

    /// Catalogue size.
    pub fn n(&self) -> usize {
        self.n
    }

    #[inline]
    pub fn allows(&self, index: u32) -> bool {
        let i = index as usize;
        i < self.n && self.words[i / 64] >> (i % 64) & 1 == 1
    }

    pub fn insert(&mut self, index: u32) {
        let i = index as usize;
        if i < self.n {
            self.words[i / 64] |= 1 << (i % 64);
            self.busy = Default::default();
        }
    }

    pub fn remove(&mut self, index: u32) {
        let i = index as usize;
        if i < self.n {
            self.words[i / 64] &= !(1 << (i % 64));
            self.busy = Default::default();
        }
    }

    /// Keeps only the items `other` also allows (same catalogue size).
    pub fn intersect(&mut self, other: &ItemMask) {
        debug_assert_eq!(self.n, other.n);
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a &= b;
        }
        self.busy = Default::default();
    }

    /// Adds the items `other` allows (same catalogue size).
    pub fn union(&mut self, other: &ItemMask) {
        debug_assert_eq!(self.n, other.n);
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a |= b;
        }
        self.busy = Default::default();
    }

    /// Eligible items.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The eligible items, ascending.
    pub fn indices(&self) -> impl Iterator<Item = u32> + '_ {
        self.words.iter().enumerate().flat_map(|(w, &word)| {
            let mut bits = word;
            std::iter::from_fn(move || {
                if bits == 0 {
                    return None;
                }
                let b = bits.trailing_zeros();
                bits &= bits - 1;
                Some(64 * w as u32 + b)
            })
        })
    }

    /// Panel `p`'s eight items as the bits of one byte (0 past the catalogue).
    #[inline]
    pub fn panel(&self, p: usize) -> u8 {
        self.words
            .get(p / 8)
            .map_or(0, |w| (w >> (8 * (p % 8))) as u8)
    }

    /// Panels `p .. p + count` (`count` at most 8) as bytes of one word, panel `p` lowest: what a
    /// call over those panels ANDs its flag bytes with. Panels past the mask are empty.
    #[inline]
    pub fn panels(&self, p: usize, count: usize) -> u64 {
        debug_assert!(count <= 8);
        let (word, shift) = (p / 8, 8 * (p % 8));
        let lo = self.words.get(word).map_or(0, |w| w >> shift);
        let hi = if shift == 0 {
            0
        } else {
            self.words.get(word + 1).map_or(0, |w| w << (64 - shift))
        };
        let keep = if count >= 8 {
            u64::MAX
        } else {
            (1u64 << (8 * count)) - 1
        };
        (lo | hi) & keep
    }

    /// Panels (of eight items) holding at least one eligible item.
    pub fn busy_panels(&self) -> usize {
        *self
            .busy
            .get_or_init(|| self.words.iter().map(|&w| busy_in_word(w)).sum())
    }

    /// Whether any of the 64 items of panels `8w .. 8w + 8` is eligible (a whole word at once, so
    /// a sparse filter's empty stretches are skipped eight panels at a time).
    #[inline]
    pub(crate) fn word(&self, w: usize) -> u64 {
        self.words.get(w).copied().unwrap_or(0)
    }

    fn clear_tail(&mut self) {
        if !self.n.is_multiple_of(64) {
            if let Some(last) = self.words.last_mut() {
                *last &= (1u64 << (self.n % 64)) - 1;
            }
        }
    }
}

/// Non-zero bytes of `word` (panels with an eligible item among its eight): each byte folded
/// onto its lowest bit.
#[inline]
pub(crate) fn busy_in_word(word: u64) -> usize {
    let folded = word | (word >> 4);
    let folded = folded | (folded >> 2);
    let folded = folded | (folded >> 1);
    (folded & 0x0101_0101_0101_0101).count_ones() as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_of_panels_is_their_bytes_in_order() {
        // Items spread so that every byte differs, across word boundaries and past the end.
        let mask = ItemMask::of(300, (0..300).filter(|i| (i * 7 + i / 5) % 3 != 0));
        for p in 0..40 {
            for count in 1..=8 {
                let word = mask.panels(p, count);
                for c in 0..8 {
                    let byte = (word >> (8 * c)) as u8;
                    let want = if c < count { mask.panel(p + c) } else { 0 };
                    assert_eq!(byte, want, "panels({p}, {count}) byte {c}");
                }
            }
        }
    }

    #[test]
    fn bytes_are_panels_and_the_tail_is_never_eligible() {
        let mask = ItemMask::of(70, [0, 7, 8, 63, 64, 69, 70, 500]);
        assert_eq!(mask.panel(0), 0b1000_0001);
        assert_eq!(mask.panel(1), 0b0000_0001);
        assert_eq!(mask.panel(7), 0b1000_0000);
        assert_eq!(mask.panel(8), 0b0010_0001);
        assert_eq!(mask.panel(9), 0);
        assert_eq!(mask.count(), 6);
        assert_eq!(mask.busy_panels(), 4);
        assert!(!mask.allows(70) && !mask.allows(500));
        assert_eq!(
            mask.indices().collect::<Vec<_>>(),
            vec![0, 7, 8, 63, 64, 69]
        );
        let all = ItemMask::all(70);
        assert_eq!(all.count(), 70);
        assert_eq!(all.panel(8), 0b0011_1111);
        assert_eq!(all.clone().resized(65).count(), 65);
        let grown = all.resized(200);
        assert_eq!(
            (grown.count(), grown.allows(69), grown.allows(70)),
            (70, true, false)
        );
    }

    #[test]
    fn set_operations() {
        let mut a = ItemMask::of(100, [1, 2, 3, 99]);
        let b = ItemMask::of(100, [2, 3, 4]);
        let mut u = a.clone();
        u.union(&b);
        assert_eq!(u.indices().collect::<Vec<_>>(), vec![1, 2, 3, 4, 99]);
        a.intersect(&b);
        assert_eq!(a.indices().collect::<Vec<_>>(), vec![2, 3]);
        a.remove(2);
        assert_eq!(a.indices().collect::<Vec<_>>(), vec![3]);
    }
}
