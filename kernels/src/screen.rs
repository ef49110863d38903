//! Exact top-k at the cost of reading int8 weights: screen every item with an int8 copy of the
//! output layer, keep only the items whose score bound can still reach the top k, and rescore
//! those from the reference weights (fp32, or fp16 bits) with the dense path's own arithmetic.
//!
//! For a hidden row `h`, item `i` has reference weights `w_i` (the values the dense kernel reads),
//! int8 weights `q_i` with scale `s_i`, and the screen quantizes `h` to int16 levels `hq` of scale
//! `a`. With `e_i = w_i - s_i q_i` and `f = h - a hq` (both measured exactly, not assumed), the
//! real score splits as
//!
//! ```text
//! w_i . h + b_i = s_i a (q_i . hq) + s_i (q_i . f) + e_i . h + b_i
//! ```
//!
//! The first term is what the int8 kernel computes (exactly in i32, then scaled in f32), so the
//! screened score `ŝ_i` differs from the dense kernel's computed score `t_i` by at most
//!
//! ```text
//! B_i = max|e_i| ||h||_1  +  s_i ||q_i||_1 max|f|           (rounding of weights, activations)
//!     + 4u (s_i ||q_i||_1 (max|h| + max|f|) + |b_i|)          (the screen's f32 epilogue)
//!     + γ(d+1) (max|w_i| ||h||_1 + |b_i|)                    (the dense kernel's f32 sums)
//! ```
//!
//! with `u = 2^-24` and `γ(n) = n u / (1 - n u)`. Every item with `ŝ_i + B_i` below the k-th
//! largest `ŝ_j - B_j` among eligible items has k eligible items scoring strictly above it, so it
//! cannot be in the top k, ties included; the survivors are rescored exactly and ranked by the
//! dense path's rule, so the answer is the reference engine's, ids and scores.

use super::fused::{self, over_panel_ranges, scan, Exclusions, RowQuery, Sink};
use super::fused_amx_i8::{self, AmxI8Layer};
use super::item_mask::ItemMask;
use super::packed::{quantize_activations, quantize_int8_per_row, PackedOutput};
use super::shared::Shared;
use super::KernelTable;
use crate::topk::{rank_order, Scored};

/// Unit roundoff of f32.
const U: f64 = 1.0 / (1u64 << 24) as f64;

/// The int8 screening copy of an output layer, with what each item's bound needs.
#[derive(Clone, Debug)]
pub struct ScreenTable {
    /// int8 weights with per-item scales, the reference bias; activations quantized per row.
    pub packed: PackedOutput,
    /// Per item (PAD included), side by side so an item's bound costs one cache line:
    /// `[max_j |w_ij - s_i q_ij|, s_i ||q_i||_1, max_j |w_ij|, |b_i|]` (`|b_i|` is 0 for -inf
    /// padding, never offered).
    terms: Shared<[f32; 4]>,
    /// Largest of each per-item quantity, for one conservative bar per row in the kernel.
    max_of: [f32; 4],
    /// The int8 table in AMX tiles, where [`ScreenTable::prepare_tiles`] made it: scans with a
    /// tiled kernel table ([`KernelTable::tiles`]) run on it, with the same scores to the bit.
    tiles: Option<std::sync::Arc<AmxI8Layer>>,
}

impl ScreenTable {
    /// From the reference weights as the dense kernel reads them (`[n, d]` row-major f32; fp16
    /// engines pass their half values widened) and the bias.
    pub fn new(reference: &[f32], bias: &[f32], d: usize) -> Self {
        assert_eq!(reference.len(), bias.len() * d, "weights must be [n, d]");
        let (q, scales) = quantize_int8_per_row(reference, d);
        let mut terms = Vec::with_capacity(bias.len());
        for (((w, q), &s), &b) in reference
            .chunks_exact(d)
            .zip(q.chunks_exact(d))
            .zip(&scales)
            .zip(bias)
        {
            let s64 = s as f64;
            let error = w
                .iter()
                .zip(q)
                .map(|(&w, &q)| (w as f64 - s64 * q as f64).abs())
                .fold(0f64, f64::max);
            let l1: f64 = q.iter().map(|&q| (q as f64).abs()).sum();
            terms.push([
                round_up(error),
                round_up(s64 * l1),
                w.iter().fold(0f32, |m, &w| m.max(w.abs())),
                if b.is_finite() { b.abs() } else { 0.0 },
            ]);
        }
        Self::from_parts(PackedOutput::from_i8(&q, &scales, bias, d), terms.into())
    }

    /// From its stored parts (an engine's kernels file): the packed int8 table and the per-item
    /// bound terms in [`Self::bound_terms`]' order, one `[f32; 4]` per item of `packed.n`.
    pub fn from_parts(packed: PackedOutput, terms: Shared<[f32; 4]>) -> Self {
        let mut max_of = [0f32; 4];
        for t in terms.iter() {
            for (m, &x) in max_of.iter_mut().zip(t) {
                *m = m.max(x);
            }
        }
        ScreenTable {
            packed,
            terms,
            max_of,
            tiles: None,
        }
    }

    /// Makes the AMX-INT8 copy of the int8 table that tiled scans run on (as many bytes again
    /// as the table). Errors, leaving the screen on the SIMD tables, where this CPU or process
    /// cannot run tiles.
    pub fn prepare_tiles(&mut self) -> Result<(), String> {
        crate::amx::availability().clone()?;
        if self.tiles.is_none() {
            let tiles = AmxI8Layer::from_packed(&self.packed)
                .expect("a screen's table is int8, which has tiles");
            self.tiles = Some(std::sync::Arc::new(tiles));
        }
        Ok(())
    }

    /// Drops the AMX copy (no batch size runs the screen on tiles).
    pub fn drop_tiles(&mut self) {
        self.tiles = None;
    }

    /// Whether the AMX copy exists ([`ScreenTable::prepare_tiles`]).
    pub fn has_tiles(&self) -> bool {
        self.tiles.is_some()
    }

    /// The per-item bound terms, `[weight_error, scaled_q_l1, max_weight, abs_bias]` per item.
    pub fn bound_terms(&self) -> &Shared<[f32; 4]> {
        &self.terms
    }

    /// Bytes the screen reads per scan (int8 weights and scales).
    pub fn weight_bytes(&self) -> usize {
        self.packed.weight_bytes()
    }

    /// Bytes the screen holds: its int8 table and scales, the bias, the per-item bound terms and
    /// the AMX copy where there is one.
    pub fn memory_bytes(&self) -> usize {
        self.packed.weight_bytes()
            + 4 * self.packed.bias.len()
            + 16 * self.terms.len()
            + self.tiles.as_ref().map_or(0, |t| t.bytes())
    }
}

/// f64 to the f32 at or above it, so a stored bound never shrinks.
fn round_up(x: f64) -> f32 {
    let f = x as f32;
    if (f as f64) < x {
        f.next_up()
    } else {
        f
    }
}

/// What a row's bounds need from its hidden vector.
#[derive(Clone, Copy, Debug)]
struct RowTerms {
    /// ||h||_1
    h_l1: f64,
    /// max_j |h_j - a hq_j|
    f_max: f64,
    /// max_j |h_j|
    h_max: f64,
    /// 1 but in the test that shows a smaller bound fails.
    bound_scale: f64,
}

impl RowTerms {
    /// The bound of an item from its four per-item quantities.
    #[inline]
    fn bound(
        &self,
        d: usize,
        weight_error: f32,
        scaled_q_l1: f32,
        max_weight: f32,
        abs_bias: f32,
    ) -> f64 {
        self.coefficients(d)
            .bound(weight_error, scaled_q_l1, max_weight, abs_bias)
    }

    /// The row's bound as a linear form of the item's quantities, evaluated once per row rather
    /// than once per item offered.
    fn coefficients(&self, d: usize) -> BoundCoefficients {
        let n = (d + 1) as f64;
        let gamma = n * U / (1.0 - n * U);
        BoundCoefficients {
            weight_error: self.h_l1,
            scaled_q_l1: self.f_max + 4.0 * U * (self.h_max + self.f_max),
            max_weight: gamma * self.h_l1,
            abs_bias: 4.0 * U + gamma,
            scale: self.bound_scale,
        }
    }
}

/// A row's bound of an item,
///
/// ```text
/// B_i = e_i ||h||_1 + s_i ||q_i||_1 max|f| + 4u (s_i ||q_i||_1 (max|h| + max|f|) + |b_i|)
///     + γ(d+1) (max|w_i| ||h||_1 + |b_i|)
/// ```
///
/// gathered per item quantity: four products and three sums per item offered.
#[derive(Clone, Copy, Debug)]
struct BoundCoefficients {
    weight_error: f64,
    scaled_q_l1: f64,
    max_weight: f64,
    abs_bias: f64,
    /// 1 but in the test that shows a smaller bound fails.
    scale: f64,
}

impl BoundCoefficients {
    #[inline]
    fn bound(&self, weight_error: f32, scaled_q_l1: f32, max_weight: f32, abs_bias: f32) -> f64 {
        let bound = self.weight_error * weight_error as f64
            + self.scaled_q_l1 * scaled_q_l1 as f64
            + self.max_weight * max_weight as f64
            + self.abs_bias * abs_bias as f64;
        // The f64 evaluation above rounds too: a relative hair, and an absolute one for zeros.
        (bound * (1.0 + 1e-9) + f64::MIN_POSITIVE) * self.scale
    }
}

/// One row's screen: the k largest lower bounds seen (their k-th is the level every survivor's
/// upper bound must reach) and the items whose upper bound reached the level when seen.
struct ScreenRow<'a> {
    k: usize,
    excluded: &'a Exclusions,
    eligible: Option<&'a ItemMask>,
    coefficients: BoundCoefficients,
    /// The bound no item exceeds, for the kernel's bar.
    max_bound: f64,
    lowers: Vec<f64>,
    level: f64,
    survivors: Vec<(u32, f64)>,
    /// Survivor count at which the level is applied to the buffer again.
    prune_at: usize,
}

impl ScreenRow<'_> {
    fn offer(&mut self, screen: &ScreenTable, index: u32, score: f32) {
        if self.k == 0 {
            return;
        }
        let [e, sq, wm, b] = screen.terms[index as usize];
        let bound = self.coefficients.bound(e, sq, wm, b);
        let (lower, upper) = (score as f64 - bound, score as f64 + bound);
        // Most items offered fall below the level: they are dropped before the filter and the
        // exclusions are looked up.
        if upper < self.level
            || self.eligible.is_some_and(|m| !m.allows(index))
            || self.excluded.contains(index)
        {
            return;
        }
        self.survivors.push((index, upper));
        if lower > self.level {
            self.lowers.push(lower);
            if self.lowers.len() >= 2 * self.k {
                self.raise_level();
            }
        }
        // Forget survivors the level has passed; if many remain (near-ties), filter again only
        // once the buffer has doubled, so the cost stays linear.
        if self.survivors.len() >= self.prune_at {
            let level = self.level;
            self.survivors.retain(|&(_, u)| u >= level);
            self.prune_at = self.prune_at.max(2 * self.survivors.len());
        }
    }

    /// Keeps the k largest lower bounds; the level becomes the k-th.
    fn raise_level(&mut self) {
        if self.k > 0 && self.lowers.len() >= self.k {
            let k = self.k;
            self.lowers
                .select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
            self.lowers.truncate(k);
            self.level = self.lowers[k - 1];
        }
    }
}

impl Sink for (&ScreenTable, Vec<ScreenRow<'_>>) {
    fn bar(&self, row: usize) -> f32 {
        let r = &self.1[row];
        if r.k == 0 {
            return f32::INFINITY; // nothing asked: flag nothing
        }
        if r.level == f64::NEG_INFINITY {
            return f32::NEG_INFINITY;
        }
        // Below every score that could survive: ŝ >= level - B_i >= level - max B.
        let bar = (r.level - r.max_bound) as f32;
        bar.next_down()
    }

    fn take(&mut self, row: usize, item: u32, score: f32) {
        self.1[row].offer(self.0, item, score);
    }

    fn eligible(&self, row: usize) -> Option<&ItemMask> {
        self.1[row].eligible
    }
}

/// One thread's screen of one row: its k largest lower bounds and its survivors with their upper
/// bounds.
type PartialScreen = (Vec<f64>, Vec<(u32, f64)>);

/// Per row of a screened scan: the items that may be in the exact top k, ascending.
pub struct Survivors {
    pub items: Vec<u32>,
}

/// Screens every item for each row of `hidden` (`[B, d]`) and returns, per row, the eligible
/// items that can still be in its exact top k (all eligible items when fewer than k are).
pub fn survivors(
    table: &KernelTable,
    screen: &ScreenTable,
    hidden: &[f32],
    queries: &[RowQuery<'_>],
    threads: usize,
) -> Vec<Survivors> {
    survivors_with_bounds_scaled(table, screen, hidden, queries, threads, 1.0)
}

/// [`survivors`] with every bound multiplied by `bound_scale` (1: the proven bound; the tests
/// show that a smaller one loses answers).
fn survivors_with_bounds_scaled(
    table: &KernelTable,
    screen: &ScreenTable,
    hidden: &[f32],
    queries: &[RowQuery<'_>],
    threads: usize,
    bound_scale: f64,
) -> Vec<Survivors> {
    let d = screen.packed.d;
    assert_eq!(hidden.len(), queries.len() * d, "one hidden row per query");
    if queries.is_empty() {
        return Vec::new();
    }
    let terms: Vec<RowTerms> = row_terms(hidden, d, bound_scale);
    let max_bound = |t: &RowTerms| {
        let [e, sq, wm, b] = screen.max_of;
        t.bound(d, e, sq, wm, b)
    };
    let input = fused::prepared(&screen.packed, hidden);
    // On tiles where the kernel table says so and the screen has them: the ranges count blocks of
    // 32 items rather than panels of 8.
    let tiles = screen.tiles.as_deref().filter(|_| table.tiles);
    let split = tiles.map(|t| t.split(&input, queries.len()));
    let (units, items_per_unit) = match tiles {
        Some(t) => (t.blocks(), crate::amx::BLOCK_OUTPUTS),
        None => (screen.packed.panels(), 8),
    };
    let per_thread: Vec<Vec<PartialScreen>> = over_panel_ranges(
        units,
        queries.len() * items_per_unit * d,
        threads,
        |range| {
            let rows: Vec<ScreenRow<'_>> = queries
                .iter()
                .zip(&terms)
                .map(|(q, t)| ScreenRow {
                    k: q.k,
                    excluded: q.excluded,
                    eligible: q.eligible,
                    coefficients: t.coefficients(d),
                    max_bound: max_bound(t),
                    lowers: Vec::with_capacity(2 * q.k.min(1 << 16)),
                    level: f64::NEG_INFINITY,
                    survivors: Vec::new(),
                    prune_at: 4 * q.k.max(64),
                })
                .collect();
            let mut sink = (screen, rows);
            if queries.iter().any(|q| q.k > 0) {
                let on_tiles = match (tiles, &split) {
                    (Some(t), Some(x)) => {
                        fused_amx_i8::scan(t, x, &input.scales, range.clone(), &mut sink).is_ok()
                    }
                    _ => false,
                };
                if !on_tiles {
                    // No tiles, or they refused before any item reached the sink: the SIMD scan
                    // of the same items (the same scores).
                    let panels = screen.packed.panels();
                    let range = (range.start * items_per_unit / 8).min(panels)
                        ..(range.end * items_per_unit / 8).min(panels);
                    scan(table, &screen.packed, hidden, &input, range, &mut sink);
                }
            }
            sink.1
                .into_iter()
                .map(|mut r| {
                    r.raise_level();
                    (r.lowers, r.survivors)
                })
                .collect::<Vec<_>>()
        },
    );
    queries
        .iter()
        .enumerate()
        .map(|(row, query)| {
            if query.k == 0 {
                return Survivors { items: Vec::new() };
            }
            // Each thread kept its k largest lower bounds, so the k-th largest of their union is
            // the whole catalogue's.
            let mut lowers: Vec<f64> = per_thread
                .iter()
                .flat_map(|t| t[row].0.iter().copied())
                .collect();
            let level = if lowers.len() >= query.k {
                lowers.select_nth_unstable_by(query.k - 1, |a, b| b.total_cmp(a));
                lowers[query.k - 1]
            } else {
                f64::NEG_INFINITY
            };
            let mut items: Vec<u32> = per_thread
                .iter()
                .flat_map(|t| t[row].1.iter())
                .filter(|&&(_, upper)| upper >= level)
                .map(|&(i, _)| i)
                .collect();
            items.sort_unstable();
            Survivors { items }
        })
        .collect()
}

fn row_terms(hidden: &[f32], d: usize, bound_scale: f64) -> Vec<RowTerms> {
    let (hq, scales) = quantize_activations(hidden, d);
    let width = d.div_ceil(2) * 2;
    hidden
        .chunks_exact(d)
        .zip(&scales)
        .enumerate()
        .map(|(r, (h, &a))| {
            let (mut h_l1, mut f_max, mut h_max) = (0f64, 0f64, 0f64);
            for (j, &x) in h.iter().enumerate() {
                let x = x as f64;
                h_l1 += x.abs();
                h_max = h_max.max(x.abs());
                f_max = f_max.max((x - a as f64 * hq[r * width + j] as f64).abs());
            }
            RowTerms {
                // Sums of non-negative f64 terms round up by at most d ulps: a relative hair more.
                h_l1: h_l1 * (1.0 + (d as f64 + 1.0) * f64::EPSILON),
                f_max,
                h_max,
                bound_scale,
            }
        })
        .collect()
}

/// The exact top k from the screen: survivors rescored by `rescore(row, items)` (the dense path's
/// best `k` among `items`, ascending distinct indices, with its exclusions), so the answer is the
/// reference's. Also returns each row's survivor count (the screen's cost).
///
/// The rows' rescoring is spread over `threads` (contiguous runs of rows): each row's survivors
/// are scattered rows of the reference table, gathered and packed before they are scored, which
/// at batch 64 and k = 100 (500 survivors of 600 features per row) ran on one thread while the
/// others waited. Each row's answer is its own, so the split changes nothing.
pub fn top_k(
    table: &KernelTable,
    screen: &ScreenTable,
    hidden: &[f32],
    queries: &[RowQuery<'_>],
    threads: usize,
    rescore: impl Fn(usize, &[u32]) -> Vec<Scored> + Sync + Send,
) -> (Vec<Vec<Scored>>, Vec<usize>) {
    let kept = survivors(table, screen, hidden, queries, threads);
    let counts = kept.iter().map(|s| s.items.len()).collect();
    let rank = |row: usize| {
        let items = &kept[row].items;
        if items.is_empty() {
            return Vec::new();
        }
        let mut ranked = rescore(row, items);
        ranked.sort_unstable_by(rank_order);
        ranked.truncate(queries[row].k);
        ranked
    };
    let pieces = threads.clamp(1, kept.len().max(1));
    let per_piece = kept.len().div_ceil(pieces);
    let answers = crate::parallel::map_pieces(pieces, |piece| {
        let rows = piece * per_piece..((piece + 1) * per_piece).min(kept.len());
        rows.map(rank).collect::<Vec<_>>()
    })
    .into_iter()
    .flatten()
    .collect();
    (answers, counts)
}

/// [`top_k`] rescoring from a row-major f32 reference table with the f32 dense kernel: the
/// survivors' rows packed as the whole table is, so each score is the dense scan's.
pub fn top_k_from_f32(
    table: &KernelTable,
    screen: &ScreenTable,
    reference: &[f32],
    bias: &[f32],
    hidden: &[f32],
    queries: &[RowQuery<'_>],
    threads: usize,
) -> (Vec<Vec<Scored>>, Vec<usize>) {
    let d = screen.packed.d;
    top_k(table, screen, hidden, queries, threads, |row, items| {
        let row_bias: Vec<f32> = items.iter().map(|&i| bias[i as usize]).collect();
        let packed = PackedOutput::gathered_f32(reference, items, &row_bias, d);
        let none = Exclusions::default();
        let query = RowQuery::new(queries[row].k.min(items.len()), &none);
        fused::top_k(table, &packed, &hidden[row * d..(row + 1) * d], &[query], 1)
            .remove(0)
            .into_iter()
            .map(|s| Scored {
                index: items[s.index as usize],
                score: s.score,
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::{scan_threads, top_k as dense_top_k, MIN_MACS_PER_THREAD};
    use crate::{Isa, KernelTable};
    use proptest::prelude::*;

    fn lcg(seed: u64) -> impl FnMut() -> f32 {
        let mut state = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    /// The screened answer against the dense f32 scan of the same weights, on every ISA.
    fn assert_exact(
        w: &[f32],
        b: &[f32],
        d: usize,
        hidden: &[f32],
        queries: &[RowQuery<'_>],
        threads: usize,
    ) -> Vec<usize> {
        let screen = ScreenTable::new(w, b, d);
        let dense = PackedOutput::from_f32(w, b, d);
        let mut counts = Vec::new();
        for isa in Isa::available() {
            let table = KernelTable::for_isa(isa);
            let want = dense_top_k(table, &dense, hidden, queries, 1);
            let (got, kept) = top_k_from_f32(table, &screen, w, b, hidden, queries, threads);
            for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g, w, "{isa:?} row {r} ({} survivors)", kept[r]);
            }
            counts = kept;
        }
        counts
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Random shapes, per-item scales over six orders of magnitude, exact ties from duplicate
        /// rows, exclusions (none, a third, all), k from 0 past the eligible items: the screened
        /// answer is the dense scan's, ids and scores.
        #[test]
        fn screened_answers_are_the_dense_answers(
            n in 1usize..1500, d in 1usize..80, rows in 1usize..6, k in 0usize..120,
            seed in 0u64..100_000, spread in 0i32..4, tie_every in 0usize..4, big_bias in prop::bool::ANY,
        ) {
            let mut next = lcg(seed);
            let mut w: Vec<f32> = Vec::with_capacity(n * d);
            for _ in 0..n {
                let row_scale = 10f32.powi(((next() + 1.0) * spread as f32) as i32 - spread / 2);
                w.extend((0..d).map(|_| next() * row_scale));
            }
            if tie_every > 0 {
                for i in (tie_every..n).step_by(tie_every + 1) {
                    let (a, c) = (i - tie_every, i);
                    for j in 0..d { w[c * d + j] = w[a * d + j]; }
                }
            }
            let b: Vec<f32> = (0..n)
                .map(|_| if tie_every > 0 { 0.0 } else if big_bias { next() * 100.0 } else { next() })
                .collect();
            let hidden: Vec<f32> = (0..rows * d).map(|_| next() * 3.0).collect();
            let exclusions: Vec<Exclusions> = (0..rows)
                .map(|r| match r % 3 {
                    0 => Exclusions::default(),
                    1 => Exclusions::new((0..n as u32).filter(|i| i % 3 == 0).collect()),
                    _ => Exclusions::new((0..n as u32).collect()),
                })
                .collect();
            let queries: Vec<RowQuery> = exclusions.iter().map(|e| RowQuery::new(k, e)).collect();
            assert_exact(&w, &b, d, &hidden, &queries, 1);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Eligible-item masks (sparse, dense, in runs, empty, none) with exclusions: the screen
        /// ranks only eligible items, so its level is the k-th best eligible bound and the
        /// answer is the dense filtered scan's (itself checked against a full sort in `fused`).
        #[test]
        fn screened_answers_under_filters_are_the_dense_answers(
            n in 1usize..2500, d in 1usize..40, rows in 1usize..6, k in 1usize..60,
            seed in 0u64..100_000, kinds in prop::collection::vec(0usize..5, 6), threads in 1usize..4,
        ) {
            let mut next = lcg(seed);
            let w: Vec<f32> = (0..n * d).map(|_| next()).collect();
            let b: Vec<f32> = (0..n).map(|_| next()).collect();
            let hidden: Vec<f32> = (0..rows * d).map(|_| next() * 3.0).collect();
            let masks: Vec<Option<ItemMask>> = (0..rows)
                .map(|r| match kinds[r] {
                    0 => None,
                    1 => Some(ItemMask::of(n, (0..n as u32).filter(|_| next() < -0.96))),
                    2 => Some(ItemMask::of(n, (0..n as u32).filter(|_| next() < -0.8))),
                    3 => Some(ItemMask::of(n, (0..n as u32).filter(|i| (i / 200) % 4 == 2))),
                    _ => Some(ItemMask::none(n)),
                })
                .collect();
            let exclusions: Vec<Exclusions> = (0..rows)
                .map(|r| if r % 2 == 1 {
                    Exclusions::new((0..n as u32).filter(|i| i % 4 == 0).collect())
                } else {
                    Exclusions::default()
                })
                .collect();
            let queries: Vec<RowQuery> = (0..rows)
                .map(|r| RowQuery { k, excluded: &exclusions[r], eligible: masks[r].as_ref() })
                .collect();
            assert_exact(&w, &b, d, &hidden, &queries, threads);
        }
    }

    #[test]
    fn all_equal_scores_keep_every_item_and_stay_exact() {
        let (n, d) = (300, 16);
        let mut next = lcg(7);
        let row: Vec<f32> = (0..d).map(|_| next()).collect();
        let w: Vec<f32> = (0..n).flat_map(|_| row.iter().copied()).collect();
        let b = vec![0.25; n];
        let hidden: Vec<f32> = (0..d).map(|_| next()).collect();
        let none = Exclusions::default();
        let counts = assert_exact(&w, &b, d, &hidden, &[RowQuery::new(10, &none)], 1);
        assert_eq!(counts, [n], "every item ties, so every item survives");
    }

    #[test]
    fn threads_share_the_catalogue_and_keep_the_answer() {
        // Enough work for three threads (MIN_MACS_PER_THREAD each).
        let (d, rows) = (12, 3);
        let n = 8 * (3 * MIN_MACS_PER_THREAD / (rows * 8 * d) + 1) + 13;
        assert_eq!(scan_threads(n.div_ceil(8), rows * 8 * d, 3), 3);
        let mut next = lcg(11);
        let w: Vec<f32> = (0..n * d).map(|_| next()).collect();
        let b: Vec<f32> = (0..n).map(|_| next() * 0.1).collect();
        let hidden: Vec<f32> = (0..rows * d).map(|_| next()).collect();
        let none = Exclusions::default();
        let some = Exclusions::new((0..n as u32).step_by(2).collect());
        for k in [1, 10, 100, 1000] {
            let queries = [
                RowQuery::new(k, &none),
                RowQuery::new(k, &some),
                RowQuery::new(k, &none),
            ];
            let one = assert_exact(&w, &b, d, &hidden, &queries, 1);
            let three = assert_exact(&w, &b, d, &hidden, &queries, 3);
            assert_eq!(one, three, "the same survivors whatever the threads");
            // Random weights are the hard case; still, far fewer than the catalogue survive.
            assert!(
                one.iter().all(|&c| c >= k && c < n / 4),
                "k {k}: {one:?} of {n}"
            );
        }
    }

    /// Weights half a quantization step off in every feature but the one that sets the scale,
    /// all errors of the sign of h: the screen underestimates item 1 by 63/64 of its bound. Item 0
    /// sits on the int8 grid and scores just below item 1's true score, so with 90 % of the bound
    /// item 1 is screened out and the answer would be item 0: wrong. The real bound keeps it.
    #[test]
    fn a_bound_ten_percent_too_small_loses_the_answer_and_the_real_one_does_not() {
        let d = 64;
        let mut on_grid = vec![0f32; d];
        on_grid[0] = 127.0;
        on_grid[1] = 31.0; // exact: scores 158
        let mut half_off = vec![0.499_99f32; d];
        half_off[0] = 127.0; // scale 1; the rest rounds to 0: screened 127, true 158.49937
        let w: Vec<f32> = on_grid.iter().chain(&half_off).copied().collect();
        let b = vec![0.0; 2];
        let hidden = vec![1.0f32; d]; // quantizes exactly: the weights carry all the error
        let none = Exclusions::default();
        let queries = [RowQuery::new(1, &none)];
        let screen = ScreenTable::new(&w, &b, d);
        for isa in Isa::available() {
            let table = KernelTable::for_isa(isa);
            let dense = dense_top_k(
                table,
                &PackedOutput::from_f32(&w, &b, d),
                &hidden,
                &queries,
                1,
            );
            assert_eq!(dense[0][0].index, 1, "item 1 is the true best");
            let too_small = survivors_with_bounds_scaled(table, &screen, &hidden, &queries, 1, 0.9);
            assert_eq!(
                too_small[0].items,
                [0],
                "{isa:?}: 90 % of the bound drops the true best"
            );
            let real = survivors(table, &screen, &hidden, &queries, 1);
            assert!(real[0].items.contains(&1), "{isa:?}: the bound keeps it");
            let (got, _) = top_k_from_f32(table, &screen, &w, &b, &hidden, &queries, 1);
            assert_eq!(got, dense, "{isa:?}");
        }
    }
}
