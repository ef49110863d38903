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

/// The best `k` of `scores` (index = position) that are not excluded, best first. Returns fewer than
/// `k` when fewer items are eligible. Runs in O(n + k log k) with a candidate buffer of at most 2k.
pub fn top_k(scores: &[f32], k: usize, excluded: &ExclusionSet) -> Vec<Scored> {
    if k == 0 {
        return Vec::new();
    }
    let mut buffer: Vec<Scored> = Vec::with_capacity(2 * k.min(scores.len()) + 1);
    // The k-th best seen so far once the buffer has been pruned: anything not better is skipped.
    let mut threshold: Option<Scored> = None;
    for (i, &score) in scores.iter().enumerate() {
        let candidate = Scored {
            index: i as u32,
            score,
        };
        if let Some(t) = &threshold {
            if rank_order(&candidate, t) != Ordering::Less {
                continue;
            }
        }
        if excluded.contains(i as u32) {
            continue;
        }
        buffer.push(candidate);
        if buffer.len() == 2 * k {
            buffer.select_nth_unstable_by(k - 1, rank_order);
            buffer.truncate(k);
            threshold = Some(buffer[k - 1]);
            // select_nth puts the k-th element at k-1 with everything better before it.
        }
    }
    buffer.sort_unstable_by(rank_order);
    buffer.truncate(k);
    buffer
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reference(scores: &[f32], k: usize, excluded: &[u32]) -> Vec<Scored> {
        let mut all: Vec<Scored> = scores
            .iter()
            .enumerate()
            .filter(|(i, _)| !excluded.contains(&(*i as u32)))
            .map(|(i, &s)| Scored {
                index: i as u32,
                score: s,
            })
            .collect();
        all.sort_by(rank_order);
        all.truncate(k);
        all
    }

    proptest! {
        // Scores drawn from a few distinct values force many exact ties.
        #[test]
        fn matches_full_sort(
            scores in prop::collection::vec(prop_oneof![Just(1.0f32), Just(-2.5), Just(0.0), -1e30f32..1e30], 0..400),
            k in 0usize..450,
            excluded in prop::collection::vec(0u32..420, 0..200),
        ) {
            let mut set = ExclusionSet::new(scores.len());
            for &e in &excluded { set.insert(e); }
            prop_assert_eq!(top_k(&scores, k, &set), reference(&scores, k, &excluded));
        }
    }

    #[test]
    fn ties_go_to_lower_index_and_k_beyond_eligible_returns_all() {
        let scores = [3.0, 5.0, 5.0, 1.0, 5.0];
        let mut set = ExclusionSet::new(5);
        set.insert(2);
        let got = top_k(&scores, 10, &set);
        let idx: Vec<u32> = got.iter().map(|s| s.index).collect();
        assert_eq!(idx, vec![1, 4, 0, 3]);
    }

    #[test]
    fn all_excluded_gives_nothing() {
        let mut set = ExclusionSet::new(3);
        for i in 0..3 {
            set.insert(i);
        }
        assert!(top_k(&[1.0, 2.0, 3.0], 2, &set).is_empty());
        set.clear();
        assert!(set.is_empty());
        assert_eq!(top_k(&[1.0, 2.0, 3.0], 1, &set)[0].index, 2);
    }

    #[test]
    fn nan_ranks_last() {
        let set = ExclusionSet::new(3);
        let got = top_k(&[f32::NAN, 1.0, -1.0], 3, &set);
        let idx: Vec<u32> = got.iter().map(|s| s.index).collect();
        assert_eq!(idx, vec![1, 2, 0]);
    }
}
