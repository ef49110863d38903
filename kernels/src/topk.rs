//! Top-k selection with exclusions.
//!
//! Order: higher score first, ties to the lower internal index; NaN ranks below every number (it can
//! only come from broken weights, which the importer refuses, but selection must still be total).

use std::cmp::Ordering;

/// One recommended item: internal index and score.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scored {
    pub index: u32,
    pub score: f32,
}

/// The ranking order: `Less` means `a` ranks before `b`.
#[inline]
pub fn rank_order(a: &Scored, b: &Scored) -> Ordering {
    match (a.score.is_nan(), b.score.is_nan()) {
        (false, false) => b
            .score
            .partial_cmp(&a.score)
            .expect("neither is NaN")
            .then(a.index.cmp(&b.index)),
        (true, false) => Ordering::Greater,
        (false, true) => Ordering::Less,
        (true, true) => a.index.cmp(&b.index),
    }
}

/// A set of internal indices as a bitmap over the catalogue; reused across rows to avoid allocation.
#[derive(Clone, Debug)]
pub struct ExclusionSet {
    bits: Vec<u64>,
    marked: Vec<u32>,
}

impl ExclusionSet {
    pub fn new(n_outputs: usize) -> Self {
        ExclusionSet {
            bits: vec![0; n_outputs.div_ceil(64)],
            marked: Vec::new(),
        }
    }

    /// Marks `index`; indices outside the catalogue are ignored (they can never be recommended).
    #[inline]
    pub fn insert(&mut self, index: u32) {
        let (word, bit) = (index as usize / 64, index % 64);
        if let Some(w) = self.bits.get_mut(word) {
            if *w & (1 << bit) == 0 {
                *w |= 1 << bit;
                self.marked.push(index);
            }
        }
    }

    #[inline]
    pub fn contains(&self, index: u32) -> bool {
        let (word, bit) = (index as usize / 64, index % 64);
        self.bits.get(word).is_some_and(|w| w & (1 << bit) != 0)
    }

    /// Number of distinct excluded indices.
    pub fn len(&self) -> usize {
        self.marked.len()
    }

    pub fn is_empty(&self) -> bool {
        self.marked.is_empty()
    }

    /// Empties the set in time proportional to what was inserted.
    pub fn clear(&mut self) {
        for &i in &self.marked {
            self.bits[i as usize / 64] &= !(1 << (i % 64));
        }
        self.marked.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scored(index: u32, score: f32) -> Scored {
        Scored { index, score }
    }

    #[test]
    fn higher_scores_first_ties_to_the_lower_index_nan_last() {
        let mut items = [
            scored(3, 1.0),
            scored(4, 5.0),
            scored(0, f32::NAN),
            scored(1, 5.0),
            scored(2, -1.0),
        ];
        items.sort_by(rank_order);
        let order: Vec<u32> = items.iter().map(|s| s.index).collect();
        assert_eq!(order, vec![1, 4, 3, 2, 0]);
    }

    #[test]
    fn exclusions_are_a_set_cleared_in_place() {
        let mut set = ExclusionSet::new(5);
        assert!(set.is_empty());
        for i in [2, 4, 2] {
            set.insert(i);
        }
        assert!(set.contains(2) && set.contains(4) && !set.contains(3));
        set.clear();
        assert!(set.is_empty() && !set.contains(2));
    }
}
