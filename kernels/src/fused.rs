//! Fused scoring + top-k over the output layer.
//!
//! The items are walked in cache-sized tiles of packed panels; for each tile every batch row is
//! scored (so the tile is read from memory once per batch, not once per row) and each row's scores go
//! straight into that row's bounded selection, which honours its exclusions. Only the tile's raw dot
//! products for one row group ever exist; the batch x items score matrix is never built (except by
//! [`score_all`], on request, for evaluation).
//!
//! Parallelism splits the items into contiguous ranges, one per thread; each thread keeps its own
//! selections, merged at the end by the total ranking order (score, then lower index), so the result
//! is identical whatever the thread count.

use super::item_mask::{busy_in_word, ItemMask};
use super::packed::{PackedOutput, PanelData, QuantizedActivations};
use super::{
    panels_slot, prefetch, row_group_at, rows_slot, Epilogue, KernelTable, MAX_CALL_PANELS,
    MAX_CALL_SCORES, MAX_GROUP_ROWS,
};
use crate::topk::{rank_order, Scored};

/// Items never to recommend to one row: sorted, distinct internal indices. Checked only for
/// candidates that beat the row's current k-th best, so its cost does not grow with the catalogue.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Exclusions(Vec<u32>);

impl Exclusions {
    pub fn new(mut indices: Vec<u32>) -> Self {
        crate::indices::sort_distinct(&mut indices);
        Exclusions(indices)
    }

    #[inline]
    pub fn contains(&self, index: u32) -> bool {
        self.0.binary_search(&index).is_ok()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// What one batch row asks for.
#[derive(Clone, Copy, Debug)]
pub struct RowQuery<'a> {
    pub k: usize,
    pub excluded: &'a Exclusions,
    /// Only these items may be recommended (a request's attribute and availability filters);
    /// `None`: every item. Panels with no eligible item for any row of a row group are skipped
    /// unscored.
    pub eligible: Option<&'a ItemMask>,
}

impl<'a> RowQuery<'a> {
    /// The best `k` of every item not in `excluded`.
    pub fn new(k: usize, excluded: &'a Exclusions) -> Self {
        RowQuery {
            k,
            excluded,
            eligible: None,
        }
    }
}

/// Bounded selection of one row's best `k`: candidates that beat the current k-th best are buffered
/// (up to 2k), and the buffer is pruned back to k when full, raising the bar.
pub(crate) struct Selection<'a> {
    k: usize,
    excluded: &'a Exclusions,
    eligible: Option<&'a ItemMask>,
    pub(crate) buffer: Vec<Scored>,
    /// Score a candidate must strictly exceed. Items arrive in increasing index order within one
    /// scan, so a later item tying the bar ranks after it and is rightly refused.
    pub(crate) bar: f32,
}

impl<'a> Selection<'a> {
    pub(crate) fn new(query: &RowQuery<'a>) -> Self {
        Selection {
            k: query.k,
            excluded: query.excluded,
            eligible: query.eligible,
            buffer: Vec::with_capacity(2 * query.k.min(1 << 16)),
            bar: if query.k == 0 {
                f32::INFINITY
            } else {
                f32::NEG_INFINITY
            },
        }
    }

    #[inline]
    pub(crate) fn offer(&mut self, index: u32, score: f32) {
        // Only a score strictly above the bar gets in; NaN (impossible with finite weights) never does.
        if score.partial_cmp(&self.bar) != Some(std::cmp::Ordering::Greater)
            || self.eligible.is_some_and(|m| !m.allows(index))
            || self.excluded.contains(index)
        {
            return;
        }
        self.buffer.push(Scored { index, score });
        if self.buffer.len() >= 2 * self.k {
            self.prune();
        }
    }

    fn prune(&mut self) {
        if self.buffer.len() > self.k {
            // The buffer holds no NaN (`offer` refuses it), so `rank_order` is the order of
            // `rank_key`: integer comparisons instead of its NaN cases (a bf16 Mult-VAE batch of
            // 64 ML-1M rows spent about 11 % of its caller thread's samples pruning, 6 % since).
            self.buffer.select_nth_unstable_by_key(self.k - 1, rank_key);
            self.buffer.truncate(self.k);
            self.bar = self.buffer[self.k - 1].score;
        }
    }
}

/// A key whose ascending order is [`rank_order`] for scores that are not NaN: the score's bits
/// mapped to an order-preserving integer and inverted (higher first; both zeros as one, as
/// `partial_cmp` has them equal), then the index (lower first).
#[inline]
fn rank_key(s: &Scored) -> u64 {
    let bits = if s.score == 0.0 { 0 } else { s.score.to_bits() };
    let ascending = if bits >> 31 == 1 {
        !bits
    } else {
        bits | 0x8000_0000
    };
    (u64::from(!ascending) << 32) | u64::from(s.index)
}

/// Every row group of a batch of `rows`: `(first row, rows, panels per call)`.
fn row_groups(rows: usize, panels_per_call: [usize; 4]) -> Vec<(usize, usize, usize)> {
    let mut groups = Vec::new();
    let mut start = 0;
    while start < rows {
        let (size, panels) = row_group_at(rows - start, panels_per_call);
        groups.push((start, size, panels));
        start += size;
    }
    groups
}

/// Panels per tile: about 96 KiB of weights, so a tile stays in L2 while every row group uses it.
fn tile_panels(out: &PackedOutput) -> usize {
    let bytes_per_panel = out.weight_bytes() / out.panels().max(1);
    (96 * 1024 / bytes_per_panel.max(1)).clamp(8, 4096) / 8 * 8
}

/// Receives the flagged scores of a scan.
pub(crate) trait Sink {
    /// The score row `row` must beat to be of interest (-inf: every score).
    fn bar(&self, row: usize) -> f32;
    fn take(&mut self, row: usize, item: u32, score: f32);
    /// The items row `row` may receive (`None`: all). The scan skips a panel that no row of a
    /// row group may receive; `take` must still refuse the ineligible items of a scored panel.
    fn eligible(&self, _row: usize) -> Option<&ItemMask> {
        None
    }
}

impl Sink for Vec<Selection<'_>> {
    fn bar(&self, row: usize) -> f32 {
        self[row].bar
    }

    fn eligible(&self, row: usize) -> Option<&ItemMask> {
        self[row].eligible
    }

    fn take(&mut self, row: usize, item: u32, score: f32) {
        self[row].offer(item, score);
    }
}

/// Writes every score into a `[rows, n]` matrix.
struct ScoreMatrix<'a> {
    scores: &'a mut [f32],
    n: usize,
}

impl Sink for ScoreMatrix<'_> {
    fn bar(&self, _row: usize) -> f32 {
        f32::NEG_INFINITY
    }

    fn take(&mut self, row: usize, item: u32, score: f32) {
        self.scores[row * self.n + item as usize] = score;
    }
}

/// Which panels of a tile any row of one row group may receive: the union of the rows' eligible
/// items, as panel bytes packed eight to a word.
#[derive(Default)]
struct PanelUnion {
    /// Word `j` holds panels `8 (first_word + j) ..`.
    words: Vec<u64>,
    first_word: usize,
}

impl PanelUnion {
    #[inline]
    fn panel(&self, p: usize) -> u8 {
        (self.words[p / 8 - self.first_word] >> (8 * (p % 8))) as u8
    }

    /// The next call of a filtered scan from panel `p` (before `end`): its first panel and its
    /// panel count, or `None` when no panel left has an eligible item. Empty panels are skipped
    /// (eight at a time where a whole word is empty); a full call of `per_call` panels is made when
    /// at least half of them hold an eligible item, else the one panel alone, so a sparse filter
    /// scores few panels and a dense one keeps the wide calls.
    fn next_call(&self, mut p: usize, end: usize, per_call: usize) -> Option<(usize, usize)> {
        loop {
            if p >= end {
                return None;
            }
            if p.is_multiple_of(8) && p + 8 <= end && self.words[p / 8 - self.first_word] == 0 {
                p += 8;
            } else if self.panel(p) == 0 {
                p += 1;
            } else {
                break;
            }
        }
        if end - p >= per_call {
            let busy = (p..p + per_call).filter(|&q| self.panel(q) != 0).count();
            if 2 * busy >= per_call {
                return Some((p, per_call));
            }
        }
        Some((p, 1))
    }
}

/// Whether rows `row0 .. row0 + size` may skip panels at all: not when a row has no filter (it
/// may receive every item), nor when a row's own eligible items fill half the panels of the
/// catalogue (so the group's union does too). Decided once per scan from the masks' counts.
fn group_may_skip(sink: &impl Sink, row0: usize, size: usize) -> bool {
    (0..size).all(|r| {
        sink.eligible(row0 + r)
            .is_some_and(|m| 2 * m.busy_panels() < m.n().div_ceil(8))
    })
}

/// Fills `union` with the panels of `tile` that rows `row0 .. row0 + size` (a group that may
/// skip, [`group_may_skip`]) may receive, and says whether the group skips panels in this tile:
/// not when at least half of the tile's panels hold an eligible item (a 10 % random filter leaves
/// few 8-panel calls empty, and single-panel calls cost about three panels' time, so the plain
/// scan of such a tile is as fast as any skipping, and the ineligible items' flags are dropped).
fn eligible_panels(
    sink: &impl Sink,
    row0: usize,
    size: usize,
    tile: std::ops::Range<usize>,
    union: &mut PanelUnion,
) -> bool {
    let (first, last) = (tile.start / 8, (tile.end - 1) / 8);
    union.first_word = first;
    union.words.clear();
    union.words.resize(last - first + 1, 0);
    for r in 0..size {
        let mask = sink
            .eligible(row0 + r)
            .expect("a group that may skip filters every row");
        for (j, word) in union.words.iter_mut().enumerate() {
            *word |= mask.word(first + j);
        }
    }
    // Panels holding an eligible item, a word (eight panels) at a time: a byte is non-zero when
    // any of its bits is, folded onto its lowest bit. Whole words, so the tile's edges may count
    // a few panels of its neighbours: the choice is an estimate either way.
    let busy: usize = union.words.iter().map(|&w| busy_in_word(w)).sum();
    2 * busy < tile.len()
}

/// Scores panels `range` for every row and hands the flagged items to `sink`, in increasing item
/// order per row. `prepared` holds `hidden` as int8 or bf16 weights multiply it ([`prepared`]),
/// made once per call rather than once per thread's range.
pub(super) fn scan(
    table: &KernelTable,
    out: &PackedOutput,
    hidden: &[f32],
    prepared: &QuantizedActivations,
    range: std::ops::Range<usize>,
    sink: &mut impl Sink,
) {
    let d = out.d;
    let rows = hidden.len() / d;
    let groups = row_groups(rows, out.view().panels_per_call(table));
    let tile = tile_panels(out);
    let mut scores = [0f32; MAX_CALL_SCORES];
    let mut masks = [0u8; MAX_CALL_PANELS];
    let (hidden_q, hidden_scales) = (&prepared.values, &prepared.scales);
    let width_q = d.div_ceil(2) * 2;
    let (table_bytes, panel_bytes) = (out.weight_bytes(), out.panel_bytes());
    let mut union = PanelUnion::default();
    // Per row group, decided once: whether any row is filtered, and whether the group may skip.
    let group_filters: Vec<(bool, bool)> = groups
        .iter()
        .map(|&(row0, size, _)| {
            let any = (0..size).any(|r| sink.eligible(row0 + r).is_some());
            (any, any && group_may_skip(sink, row0, size))
        })
        .collect();
    let mut tile_start = range.start;
    while tile_start < range.end {
        let tile_end = (tile_start + tile).min(range.end);
        for (&(row0, size, per_call), &(any_filtered, may_skip)) in
            groups.iter().zip(&group_filters)
        {
            let h = &hidden[row0 * d..(row0 + size) * d];
            let filtered =
                may_skip && eligible_panels(sink, row0, size, tile_start..tile_end, &mut union);
            let mut p = tile_start;
            while p < tile_end {
                let count = if filtered {
                    match union.next_call(p, tile_end, per_call) {
                        Some((start, count)) => {
                            p = start;
                            count
                        }
                        None => break,
                    }
                } else if tile_end - p >= per_call {
                    per_call
                } else {
                    1
                };
                let (rs, ps) = (rows_slot(size), panels_slot(count));
                let span = p * d * 8..(p + count) * d * 8;
                let items = p * 8..(p + count) * 8;
                let mut bars = [f32::INFINITY; MAX_GROUP_ROWS];
                let mut row_scales = [1f32; MAX_GROUP_ROWS];
                for r in 0..size {
                    bars[r] = sink.bar(row0 + r);
                    if let Some(&s) = hidden_scales.get(row0 + r) {
                        row_scales[r] = s;
                    }
                }
                let no_scales: &[f32] = &[];
                let epilogue = Epilogue {
                    bias: &out.bias[items.clone()],
                    scales: match &out.data {
                        PanelData::I8 { scales, .. } => &scales[items.clone()],
                        _ => no_scales,
                    },
                    bars,
                    row_scales,
                    prefetch: prefetch::distance(table_bytes, count * panel_bytes),
                };
                match &out.data {
                    PanelData::F32(w) => {
                        (table.f32[rs][ps])(h, d, &w[span], &epilogue, &mut scores, &mut masks)
                    }
                    PanelData::F16(w) => {
                        (table.f16[rs][ps])(h, d, &w[span], &epilogue, &mut scores, &mut masks)
                    }
                    PanelData::Bf16(w) => {
                        let pairs = d.div_ceil(2);
                        let hb = prepared.bf16_rows(row0..row0 + size, width_q);
                        let span_b = p * pairs * 16..(p + count) * pairs * 16;
                        (table.bf16[rs][ps])(hb, d, &w[span_b], &epilogue, &mut scores, &mut masks)
                    }
                    PanelData::Bf16Wide(w) => {
                        let hw = &prepared.bf16_wide[row0 * width_q..(row0 + size) * width_q];
                        let span_w = p * width_q * 8..(p + count) * width_q * 8;
                        (table.f32[rs][ps])(
                            hw,
                            width_q,
                            &w[span_w],
                            &epilogue,
                            &mut scores,
                            &mut masks,
                        )
                    }
                    PanelData::I8 { q, .. } => {
                        let pairs = d.div_ceil(2);
                        let hq = &hidden_q[row0 * width_q..(row0 + size) * width_q];
                        let span_q = p * pairs * 16..(p + count) * pairs * 16;
                        (table.i8[rs][ps])(hq, d, &q[span_q], &epilogue, &mut scores, &mut masks)
                    }
                }
                // The call's flag bytes (row-major: byte r * count + c, bit l) as words of eight,
                // so a call that flagged nothing, almost every call once the bars have risen,
                // costs a few word tests instead of a loop over its bytes; set bits come out row
                // by row, each row's items in increasing order.
                let flag_bytes = size * count;
                // One spare word: a row's bytes may straddle two words.
                let mut words = [0u64; MAX_CALL_PANELS.div_ceil(8) + 1];
                let mut any = 0u64;
                for (word, bytes) in words.iter_mut().zip(masks[..flag_bytes].chunks(8)) {
                    let mut eight = [0u8; 8];
                    eight[..bytes.len()].copy_from_slice(bytes);
                    *word = u64::from_le_bytes(eight);
                    any |= *word;
                }
                if any != 0 && any_filtered {
                    // A filtered row's flags of items it may not receive are dropped here, a row's
                    // flag bytes ANDed with its mask's bytes for the call's panels as one word,
                    // rather than one refusal per item in the selection: a 10 % filter's bar sits
                    // lower than the unfiltered one, so many more items beat it.
                    let row_bytes = if count >= 8 {
                        u128::from(u64::MAX)
                    } else {
                        (1u128 << (8 * count)) - 1
                    };
                    for r in 0..size {
                        if let Some(mask) = sink.eligible(row0 + r) {
                            let (at, shift) = ((r * count) / 8, 8 * ((r * count) % 8));
                            let window = u128::from(words[at]) | (u128::from(words[at + 1]) << 64);
                            let keep = (u128::from(mask.panels(p, count)) << shift)
                                | !(row_bytes << shift);
                            let window = window & keep;
                            words[at] = window as u64;
                            words[at + 1] = (window >> 64) as u64;
                        }
                    }
                }
                if any != 0 {
                    for (word, &flags) in words[..flag_bytes.div_ceil(8)].iter().enumerate() {
                        let mut flags = flags;
                        while flags != 0 {
                            let bit = 64 * word + flags.trailing_zeros() as usize;
                            flags &= flags - 1;
                            let (r, c, l) = (bit / 8 / count, bit / 8 % count, bit % 8);
                            sink.take(row0 + r, ((p + c) * 8 + l) as u32, scores[bit]);
                        }
                    }
                }
                p += count;
            }
        }
        tile_start = tile_end;
    }
}

/// `hidden` as the output layer's kernels read it when its weights are int8 (int16 levels, at each
/// row's own scale or the layer's static one) or bf16 (rounded to bfloat16); empty for f32 and fp16.
pub(super) fn prepared(out: &PackedOutput, hidden: &[f32]) -> QuantizedActivations {
    let mut input = QuantizedActivations::default();
    crate::dense::prepare_input(out.view(), hidden, &mut input);
    input
}

/// Smallest share of a scan worth a thread of its own, in multiply-adds (spawning a thread costs
/// tens of microseconds; this is 0.1-0.3 ms of one core's work). Counting work rather than panels
/// lets a small catalogue with wide rows (Mult-VAE: 2,000 items x 600) or a batch of rows use
/// every thread, where a panel count alone kept them on one.
pub(super) const MIN_MACS_PER_THREAD: usize = 1 << 19;

/// Threads a scan of `panels` panels gets when each panel costs `macs_per_panel` multiply-adds:
/// at most `threads`, each with at least [`MIN_MACS_PER_THREAD`] of work and one panel.
pub(super) fn scan_threads(panels: usize, macs_per_panel: usize, threads: usize) -> usize {
    let by_work = panels.saturating_mul(macs_per_panel)
        / crate::parallel::min_macs_per_piece(MIN_MACS_PER_THREAD);
    threads.min(by_work).min(panels).max(1)
}

/// Runs `run` over `panels` split into contiguous ranges, one per thread (as many as
/// [`scan_threads`] allows), and returns each range's result in order.
pub(crate) fn over_panel_ranges<T: Send>(
    panels: usize,
    macs_per_panel: usize,
    threads: usize,
    run: impl Fn(std::ops::Range<usize>) -> T + Sync + Send,
) -> Vec<T> {
    let threads = scan_threads(panels, macs_per_panel, threads);
    let output = crate::profile::Work::Output;
    if threads == 1 {
        return vec![crate::profile::account(output, || run(0..panels))];
    }
    let chunk = panels.div_ceil(threads);
    crate::parallel::map_pieces(threads, |t| {
        crate::profile::account(output, || {
            run((t * chunk).min(panels)..((t + 1) * chunk).min(panels))
        })
    })
}

/// The best `k` items of each row of `hidden` (`[B, d]`), best first, without materialising scores.
pub fn top_k(
    table: &KernelTable,
    out: &PackedOutput,
    hidden: &[f32],
    queries: &[RowQuery<'_>],
    threads: usize,
) -> Vec<Vec<Scored>> {
    assert_eq!(
        hidden.len(),
        queries.len() * out.d,
        "one hidden row per query"
    );
    if queries.is_empty() {
        return Vec::new();
    }
    let macs_per_panel = queries.len() * 8 * out.d;
    let input = prepared(out, hidden);
    let per_thread = over_panel_ranges(out.panels(), macs_per_panel, threads, |range| {
        let mut selections: Vec<Selection<'_>> = queries.iter().map(Selection::new).collect();
        scan(table, out, hidden, &input, range, &mut selections);
        selections.into_iter().map(|s| s.buffer).collect::<Vec<_>>()
    });
    merge_ranges(queries, &per_thread)
}

/// Refuses hidden rows that are not one row of `d` features per query (the tile scans' check;
/// the SIMD scan asserts it).
pub(crate) fn check_hidden(hidden: &[f32], queries: usize, d: usize) -> Result<(), String> {
    if hidden.len() != queries * d {
        return Err(format!(
            "{} hidden values for {queries} queries of {d} features",
            hidden.len()
        ));
    }
    Ok(())
}

/// Each row's best `k` of the candidates its ranges' selections kept, best first.
pub(crate) fn merge_ranges(
    queries: &[RowQuery<'_>],
    per_thread: &[Vec<Vec<Scored>>],
) -> Vec<Vec<Scored>> {
    queries
        .iter()
        .enumerate()
        .map(|(row, query)| {
            let mut merged: Vec<Scored> = per_thread
                .iter()
                .flat_map(|t| t[row].iter().copied())
                .collect();
            merged.sort_unstable_by(rank_order);
            merged.truncate(query.k);
            merged
        })
        .collect()
}

/// Every score, `[B, n]`, computed by the same kernels as [`top_k`] (for evaluation and tests).
pub fn score_all(table: &KernelTable, out: &PackedOutput, hidden: &[f32]) -> Vec<f32> {
    let rows = hidden.len() / out.d;
    let mut scores = vec![0f32; rows * out.n];
    let mut sink = ScoreMatrix {
        scores: &mut scores,
        n: out.n,
    };
    let input = prepared(out, hidden);
    scan(table, out, hidden, &input, 0..out.panels(), &mut sink);
    scores
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rank_key_orders_as_the_rank_order() {
        let scores = [
            f32::INFINITY,
            f32::MAX,
            1.5,
            1.0,
            f32::MIN_POSITIVE,
            1e-45,
            0.0,
            -0.0,
            -1e-45,
            -1.0,
            f32::MIN,
            f32::NEG_INFINITY,
        ];
        let all: Vec<Scored> = scores
            .iter()
            .flat_map(|&score| [7, 0, 3].map(|index| Scored { index, score }))
            .collect();
        for a in &all {
            for b in &all {
                assert_eq!(
                    rank_key(a).cmp(&rank_key(b)),
                    rank_order(a, b),
                    "{a:?} against {b:?}"
                );
            }
        }
    }
    use crate::dense::linear;
    use crate::lcg;
    use crate::packed::{
        activation_levels, bf16_to_f32, quantize_int8_per_row, round_to_bf16, to_bf16_bits,
        to_f16_bits,
    };
    use crate::Isa;
    use proptest::prelude::*;

    /// f32 scores of a d-long dot product against the f64 formula: relative to the sum of |terms|.
    const F32_DOT_REL_TOL: f64 = 1e-5;

    fn reference_top_k(scores: &[f32], k: usize, excluded: &Exclusions) -> Vec<Scored> {
        let mut all: Vec<Scored> = scores
            .iter()
            .enumerate()
            .filter(|(i, s)| !excluded.contains(*i as u32) && !s.is_nan())
            .map(|(i, &s)| Scored {
                index: i as u32,
                score: s,
            })
            .collect();
        all.sort_by(rank_order);
        all.truncate(k);
        all
    }

    fn packed_variants(
        w: &[f32],
        b: &[f32],
        d: usize,
    ) -> Vec<(&'static str, PackedOutput, Vec<f32>)> {
        let bits = to_f16_bits(w);
        let (q, s) = quantize_int8_per_row(w, d);
        // The weights each precision really holds, for its f64 reference.
        let w16: Vec<f32> = bits
            .iter()
            .map(|&x| half::f16::from_bits(x).to_f32())
            .collect();
        let w8: Vec<f32> = q
            .iter()
            .enumerate()
            .map(|(i, &x)| x as f32 * s[i / d])
            .collect();
        let bf = to_bf16_bits(w);
        let wbf: Vec<f32> = bf.iter().map(|&x| bf16_to_f32(x)).collect();
        vec![
            ("f32", PackedOutput::from_f32(w, b, d), w.to_vec()),
            ("f16", PackedOutput::from_f16_bits(&bits, b, d), w16),
            ("bf16", PackedOutput::from_bf16_bits(&bf, b, d), wbf),
            ("i8", PackedOutput::from_i8(&q, &s, b, d), w8),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Every ISA and precision: scores within tolerance of f64 over the weights it holds; fused
        /// top-k equal to a full sort of its own materialised scores (ties, k > eligible, exclusions,
        /// all-excluded rows, N not a multiple of 8 or of the tile); and independent of threads.
        #[test]
        fn fused_top_k_matches_reference(
            n in 1usize..700, d in 1usize..40, rows in 1usize..7, k in 0usize..80, seed in 0u64..10_000,
            extreme in prop::bool::ANY, tie_every in 0usize..5,
        ) {
            let mut next = lcg(seed);
            let scale = if extreme { 1e3 } else { 1.0 };
            let mut w: Vec<f32> = (0..n * d).map(|_| next() * scale).collect();
            if tie_every > 0 {
                // Duplicate rows force exact score ties.
                for i in (tie_every..n).step_by(tie_every + 1) {
                    let (a, b) = (i - tie_every, i);
                    for j in 0..d { w[b * d + j] = w[a * d + j]; }
                }
            }
            let b: Vec<f32> = (0..n).map(|i| if tie_every > 0 { 0.0 } else { next() + i as f32 * 0.0 }).collect();
            let hidden: Vec<f32> = (0..rows * d).map(|_| next()).collect();
            let exclusions: Vec<Exclusions> = (0..rows)
                .map(|r| match r % 3 {
                    0 => Exclusions::default(),
                    1 => Exclusions::new((0..n as u32).filter(|i| i % 3 == 0).collect()),
                    _ => Exclusions::new((0..n as u32).collect()), // everything excluded
                })
                .collect();
            let queries: Vec<RowQuery> = exclusions.iter().map(|e| RowQuery::new(k, e)).collect();
            for isa in Isa::available() {
                let table = KernelTable::for_isa(isa);
                for (name, packed, held) in packed_variants(&w, &b, d) {
                    let scores = score_all(table, &packed, &hidden);
                    // bf16 layers compute with their activations rounded to bf16 too.
                    let hidden_held: Vec<f32> = if name == "bf16" {
                        hidden.iter().map(|&h| bf16_to_f32(round_to_bf16(h))).collect()
                    } else {
                        hidden.clone()
                    };
                    for r in 0..rows {
                        for i in 0..n {
                            let terms: Vec<f64> = (0..d).map(|j| hidden_held[r * d + j] as f64 * held[i * d + j] as f64).collect();
                            let want = terms.iter().sum::<f64>() + b[i] as f64;
                            let mag = terms.iter().map(|t| t.abs()).sum::<f64>() + (b[i] as f64).abs();
                            // int8 also quantizes the activations to int16 (half a level per
                            // element, exact integer sums) and rounds the scale product once.
                            let activation_err = if name == "i8" {
                                let hmax = hidden[r * d..(r + 1) * d].iter().fold(0f32, |m, h| m.max(h.abs())) as f64;
                                let step = hmax / activation_levels(d) as f64;
                                0.5 * step * (0..d).map(|j| (held[i * d + j] as f64).abs()).sum::<f64>() + 1e-6 * mag
                            } else {
                                0.0
                            };
                            let tol = F32_DOT_REL_TOL * mag + activation_err + 1e-30;
                            prop_assert!((scores[r * n + i] as f64 - want).abs() <= tol,
                                "{:?} {} row {} item {}: {} vs {}", isa, name, r, i, scores[r * n + i], want);
                        }
                    }
                    let fused = top_k(table, &packed, &hidden, &queries, 1);
                    for r in 0..rows {
                        let want = reference_top_k(&scores[r * n..(r + 1) * n], k, &exclusions[r]);
                        prop_assert_eq!(&fused[r], &want, "{:?} {} row {}", isa, name, r);
                    }
                    // Single rows give the same answers as the batch.
                    let alone = top_k(table, &packed, &hidden[..d], &queries[..1], 1);
                    prop_assert_eq!(&alone[0], &fused[0]);
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// Row groups of 8 (where an ISA has them) and of at most 4 give every score, top-k and
        /// dense layer output the bits of each row scored alone, on every ISA and precision, for
        /// batches that mix groups of 8, 4, 2 and 1 rows, and with filters that skip panels.
        #[test]
        fn row_blocks_never_change_a_bit(
            n in 1usize..400, d in 1usize..70, rows in 1usize..20, k in 1usize..30, seed in 0u64..10_000,
        ) {
            use crate::RowBlock;
            let mut next = lcg(seed);
            let w: Vec<f32> = (0..n * d).map(|_| next()).collect();
            let b: Vec<f32> = (0..n).map(|_| next()).collect();
            let hidden: Vec<f32> = (0..rows * d).map(|_| next()).collect();
            let masks: Vec<Option<ItemMask>> = (0..rows).map(|r| random_mask(n, r, &mut next)).collect();
            let none = Exclusions::default();
            let queries: Vec<RowQuery> = (0..rows)
                .map(|r| RowQuery { k, excluded: &none, eligible: masks[r].as_ref() })
                .collect();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for isa in Isa::available() {
                let eight = KernelTable::for_isa_rows(isa, RowBlock::Eight);
                let four = KernelTable::for_isa_rows(isa, RowBlock::Four);
                prop_assert_eq!(four.row_block(), RowBlock::Four);
                for (name, packed, _) in packed_variants(&w, &b, d) {
                    let alone: Vec<f32> = (0..rows)
                        .flat_map(|r| score_all(four, &packed, &hidden[r * d..(r + 1) * d]))
                        .collect();
                    for table in [eight, four] {
                        let label = (isa, name, table.row_block());
                        prop_assert_eq!(bits(&score_all(table, &packed, &hidden)), bits(&alone), "{:?}", label);
                        prop_assert_eq!(bits(&linear(table, &packed, &hidden)), bits(&alone), "{:?}", label);
                        let batch = top_k(table, &packed, &hidden, &queries, 1);
                        for r in 0..rows {
                            let single = top_k(four, &packed, &hidden[r * d..(r + 1) * d], &queries[r..r + 1], 1);
                            prop_assert_eq!(&batch[r], &single[0], "{:?} row {}", label, r);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn avx512_offers_both_row_blocks() {
        use crate::RowBlock;
        for isa in Isa::available() {
            let eight = KernelTable::for_isa_rows(isa, RowBlock::Eight);
            let both = matches!(isa, Isa::Avx512 | Isa::Avx512Bf16);
            assert_eq!(KernelTable::offers_row_blocks(isa), both, "{isa:?}");
            assert_eq!(eight.row_block() == RowBlock::Eight, both, "{isa:?}");
            assert!(
                std::ptr::eq(KernelTable::for_isa(isa), eight),
                "{isa:?}: the default"
            );
            assert_eq!(KernelTable::for_isa_rows(isa, RowBlock::Four).isa, isa);
        }
    }

    /// One row's eligible items for the filtered tests: by `kind`, none, a sparse random few, a
    /// dense random share, long runs (whole words empty and whole words full), every item, or no
    /// filter at all.
    fn random_mask(n: usize, kind: usize, next: &mut impl FnMut() -> f32) -> Option<ItemMask> {
        let pick = |share: f32, next: &mut dyn FnMut() -> f32| {
            ItemMask::of(n, (0..n as u32).filter(|_| (next() + 1.0) / 2.0 < share))
        };
        match kind % 7 {
            0 => Some(ItemMask::none(n)),
            1 => Some(pick(0.01, next)),
            2 => Some(pick(0.1, next)),
            3 => Some(pick(0.5, next)),
            4 => Some(ItemMask::of(
                n,
                (0..n as u32).filter(|i| (i / 150) % 3 == 1),
            )),
            5 => Some(ItemMask::all(n)),
            _ => None,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        /// Rows with eligible-item masks (sparse, dense, runs, empty, full, mixed with unfiltered
        /// rows in one row group) and exclusions: the fused top-k equals a full sort of the
        /// materialised scores over the eligible, not excluded items, on every ISA, precision and
        /// thread count; a row gets k items whenever k are eligible.
        #[test]
        fn filtered_top_k_matches_reference(
            n in 1usize..3000, d in 1usize..24, rows in 1usize..7, k in 1usize..40, seed in 0u64..10_000,
            kinds in prop::collection::vec(0usize..7, 6),
        ) {
            let mut next = lcg(seed);
            let w: Vec<f32> = (0..n * d).map(|_| next()).collect();
            let b: Vec<f32> = (0..n).map(|_| next()).collect();
            let hidden: Vec<f32> = (0..rows * d).map(|_| next()).collect();
            let masks: Vec<Option<ItemMask>> = (0..rows).map(|r| random_mask(n, kinds[r], &mut next)).collect();
            let exclusions: Vec<Exclusions> = (0..rows)
                .map(|r| if r % 2 == 0 { Exclusions::default() } else {
                    Exclusions::new((0..n as u32).filter(|i| i % 5 == 0).collect())
                })
                .collect();
            let queries: Vec<RowQuery> = (0..rows)
                .map(|r| RowQuery { k, excluded: &exclusions[r], eligible: masks[r].as_ref() })
                .collect();
            for isa in Isa::available() {
                let table = KernelTable::for_isa(isa);
                for (name, packed, _) in packed_variants(&w, &b, d) {
                    let scores = score_all(table, &packed, &hidden);
                    for threads in [1, 3] {
                        let fused = top_k(table, &packed, &hidden, &queries, threads);
                        for r in 0..rows {
                            let mut row = scores[r * n..(r + 1) * n].to_vec();
                            if let Some(mask) = &masks[r] {
                                for (i, s) in row.iter_mut().enumerate() {
                                    if !mask.allows(i as u32) { *s = f32::NAN; }
                                }
                            }
                            let want = reference_top_k(&row, k, &exclusions[r]);
                            prop_assert_eq!(&fused[r], &want, "{:?} {} row {} threads {}", isa, name, r, threads);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn thread_count_does_not_change_results() {
        let (n, d, rows) = (40_000, 16, 3);
        assert_eq!(
            scan_threads(n / 8, rows * 8 * d, 4),
            3,
            "the scan must really split"
        );
        let mut next = lcg(42);
        let w: Vec<f32> = (0..n * d).map(|_| (next() * 4.0).round() / 4.0).collect(); // many ties
        let b = vec![0f32; n];
        let hidden: Vec<f32> = (0..rows * d).map(|_| (next() * 2.0).round()).collect();
        let none = Exclusions::default();
        let queries = vec![RowQuery::new(100, &none); rows];
        for isa in Isa::available() {
            let table = KernelTable::for_isa(isa);
            let packed = PackedOutput::from_f32(&w, &b, d);
            let one = top_k(table, &packed, &hidden, &queries, 1);
            for threads in [2, 3, 4] {
                assert_eq!(
                    top_k(table, &packed, &hidden, &queries, threads),
                    one,
                    "{isa:?} threads {threads}"
                );
            }
        }
    }

    #[test]
    fn int8_scores_are_bit_identical_on_every_isa() {
        // Widths with an odd and an even number of feature pairs, fewer than two pairs (the
        // AVX-512 kernel's two-pair steps never run), and the encoders' widths; 7 rows run as row
        // groups of 4, 2 and 1; dynamic (full int16 range) and static activation scales.
        for d in [1, 2, 3, 4, 5, 61, 64, 66, 600] {
            let n = 777;
            let mut next = lcg(9 + d as u64);
            let w: Vec<f32> = (0..n * d).map(|_| next()).collect();
            let b: Vec<f32> = (0..n).map(|_| next()).collect();
            let hidden: Vec<f32> = (0..7 * d).map(|_| next() * 3.0).collect();
            let (q, s) = quantize_int8_per_row(&w, d);
            for packed in [
                PackedOutput::from_i8(&q, &s, &b, d),
                PackedOutput::from_i8(&q, &s, &b, d).with_static_activation_scale(0.01),
            ] {
                let reference = score_all(KernelTable::for_isa(Isa::Scalar), &packed, &hidden);
                for isa in Isa::available() {
                    let got = score_all(KernelTable::for_isa(isa), &packed, &hidden);
                    assert!(
                        got.iter()
                            .zip(&reference)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{isa:?} at d = {d}"
                    );
                }
            }
        }
    }

    /// bfloat16 layers compute one function on every path (the crate documentation's), so
    /// every ISA, `vdpbf16ps` included, gives the scalar path's bits: at widths with an odd and
    /// an even number of pairs, one feature, and the encoders' widths; 7 rows (row groups 4, 2,
    /// 1); 777 items (calls of one panel at the end); as a scan and as a dense layer.
    #[test]
    fn bf16_scores_are_bit_identical_on_every_isa() {
        for d in [1, 2, 3, 4, 5, 7, 61, 64, 66, 600] {
            let n = 777;
            let mut next = lcg(77 + d as u64);
            let w: Vec<f32> = (0..n * d).map(|_| next()).collect();
            let b: Vec<f32> = (0..n).map(|_| next()).collect();
            let hidden: Vec<f32> = (0..7 * d).map(|_| next() * 3.0).collect();
            let packed = PackedOutput::from_bf16_bits(&to_bf16_bits(&w), &b, d);
            let scalar = KernelTable::for_isa(Isa::Scalar);
            let want = score_all(scalar, &packed, &hidden);
            let want_layer = linear(scalar, &packed, &hidden);
            for isa in Isa::available() {
                let table = KernelTable::for_isa(isa);
                let got = score_all(table, &packed, &hidden);
                let same =
                    |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same(&got, &want), "{isa:?} scan at d = {d}");
                assert!(
                    same(&linear(table, &packed, &hidden), &want_layer),
                    "{isa:?} layer at d = {d}"
                );
            }
        }
    }

    /// Against fp32 on the unrounded weights and activations: each of the two factors of a
    /// product is off by at most 2^-9 of itself after rounding to bfloat16, so a product by at
    /// most 2^-8 + 2^-18 of itself; the sum by that share of the sum of |products|, plus fp32's
    /// own rounding.
    const BF16_ROUNDING_REL_TOL: f64 = 1.0 / 256.0 + 1.0 / 262_144.0;

    #[test]
    fn bf16_scores_stay_within_rounding_of_fp32() {
        let (n, d, rows) = (300, 600, 5);
        let mut next = lcg(5);
        let w: Vec<f32> = (0..n * d).map(|_| next() * 0.1).collect();
        let b: Vec<f32> = (0..n).map(|_| next()).collect();
        let hidden: Vec<f32> = (0..rows * d).map(|_| next() * 4.0).collect();
        let packed = PackedOutput::from_bf16_bits(&to_bf16_bits(&w), &b, d);
        for isa in Isa::available() {
            let scores = score_all(KernelTable::for_isa(isa), &packed, &hidden);
            for r in 0..rows {
                for i in 0..n {
                    let terms = (0..d).map(|j| hidden[r * d + j] as f64 * w[i * d + j] as f64);
                    let (sum, mag) = terms.fold((0.0, 0.0), |(s, m), t| (s + t, m + t.abs()));
                    let want = sum + b[i] as f64;
                    let tol =
                        (BF16_ROUNDING_REL_TOL + F32_DOT_REL_TOL) * (mag + (b[i] as f64).abs());
                    let got = scores[r * n + i] as f64;
                    assert!(
                        (got - want).abs() <= tol,
                        "{isa:?} row {r} item {i}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn bf16_rounding_is_to_nearest_even() {
        // Against the `half` crate's conversion for normal values, signs, infinities and values
        // that round up into the next binade or to infinity.
        let mut next = lcg(3);
        let mut values: Vec<f32> = (0..100_000).map(|_| next() * 1e4).collect();
        values.extend([
            0.0,
            -0.0,
            1.0,
            -1.0,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ]);
        // Exact ties: 1 + 2^-8 (to 1, even) and 1 + 3 * 2^-8 (to 1 + 2^-6, even).
        values.extend([
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            f32::from_bits(0x3fff_ffff),
        ]);
        values.push(f32::MIN_POSITIVE);
        for &x in &values {
            assert_eq!(round_to_bf16(x), half::bf16::from_f32(x).to_bits(), "{x:e}");
        }
        assert_eq!(round_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(round_to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        // Subnormals become zeros of their sign (as vdpbf16ps reads them); NaN stays NaN.
        assert_eq!(round_to_bf16(f32::from_bits(1)), 0x0000);
        assert_eq!(round_to_bf16(-f32::from_bits(0x007f_ffff)), 0x8000);
        assert!(bf16_to_f32(round_to_bf16(f32::NAN)).is_nan());
        assert!(bf16_to_f32(round_to_bf16(f32::from_bits(0x7f80_0001))).is_nan());
    }

    #[test]
    fn avx512_float_scores_are_avx2_bits() {
        // The AVX-512 fp32/fp16 kernels run two panels per register with AVX2's fused
        // multiply-add per item in the same order: the same bits, at every row group (7 rows:
        // 4, 2, 1) and panel count (777 items end in single-panel calls).
        let available = Isa::available();
        if !available.contains(&Isa::Avx512) {
            return;
        }
        for d in [1, 2, 7, 64, 600] {
            let n = 777;
            let mut next = lcg(31 + d as u64);
            let w: Vec<f32> = (0..n * d).map(|_| next()).collect();
            let b: Vec<f32> = (0..n).map(|_| next()).collect();
            let hidden: Vec<f32> = (0..7 * d).map(|_| next() * 3.0).collect();
            for packed in [
                PackedOutput::from_f32(&w, &b, d),
                PackedOutput::from_f16_bits(&to_f16_bits(&w), &b, d),
            ] {
                let want = score_all(KernelTable::for_isa(Isa::Avx2), &packed, &hidden);
                let got = score_all(KernelTable::for_isa(Isa::Avx512), &packed, &hidden);
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{:?} at d = {d}",
                    packed.precision()
                );
                let layer = linear(KernelTable::for_isa(Isa::Avx512), &packed, &hidden);
                assert_eq!(
                    layer,
                    linear(KernelTable::for_isa(Isa::Avx2), &packed, &hidden)
                );
            }
        }
    }

    #[test]
    fn isa_paths_agree_within_tolerance() {
        let (n, d) = (1000, 64);
        let mut next = lcg(7);
        let w: Vec<f32> = (0..n * d).map(|_| next()).collect();
        let b: Vec<f32> = (0..n).map(|_| next()).collect();
        let hidden: Vec<f32> = (0..d).map(|_| next()).collect();
        let packed = PackedOutput::from_f32(&w, &b, d);
        let reference = score_all(KernelTable::for_isa(Isa::Scalar), &packed, &hidden);
        for isa in Isa::available() {
            let scores = score_all(KernelTable::for_isa(isa), &packed, &hidden);
            let max = scores
                .iter()
                .zip(&reference)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(max < 1e-4, "{isa:?}: {max}");
        }
    }
}
