//! SASRec resuming from carried keys and values: the incremental pass behind the prefix cache.
//!
//! SASRec's attention is causal and its positions are left-aligned (slot 0 is the oldest item
//! kept), so while a history stays within the window, the keys and values every layer computed
//! for its earlier slots are exactly what a pass over the longer history computes for them. A
//! carried state holds those keys and values, position after position (for each slot: every
//! layer's key row, then its value row), so the state of a prefix is a prefix of the state. A
//! pass then embeds only the new slots, projects only their rows, lets them attend over the
//! carried keys and values followed by their own, and runs the rest of each layer for them alone
//! (the last layer for the answer slot alone, as the full pass does).
//!
//! Bit for bit the full pass: every dense layer, norm and softmax computes a row as it does in
//! any batch, the attention scores of a query and a key do not depend on the other keys, and a
//! slot's context adds its weighted values in increasing key order with weights exactly 0 past
//! the slot, the same products in the same order whatever the sequence's length.

use super::attention::{AttentionScratch, KeyValues, RowAt};
use super::layers::{project, Columns};
use super::{Flavor, Transformer, TransformerLayer};
use crate::kernels::packed::QuantizedActivations;
use crate::kernels::KernelTable;
use crate::models::{Carry, HistoryNote};
use crate::prefix_cache::State;

/// The buffers one carried pass works in (see [`Transformer::encode_carried`]).
#[derive(Debug, Default)]
pub struct CarriedScratch {
    /// Per history: slots of its model input, and how many a carried state covers.
    slots: Vec<usize>,
    done: Vec<usize>,
    /// The new slots' rows of a layer's input (`[new, hidden]`), and its output.
    x: Vec<f32>,
    out: Vec<f32>,
    /// Rows of `x` whose outputs a layer computes (indices into the new rows), and those rows.
    query_rows: Vec<usize>,
    x_q: Vec<f32>,
    /// The same query rows as indices into `rows_at`.
    query_slots: Vec<usize>,
    /// The new rows' projections (keys and values, and queries when every row is a query).
    projected: Vec<f32>,
    queries: Vec<f32>,
    /// Where every slot's key and value rows of one layer lie, carried then new.
    rows_at: Vec<RowAt>,
    spans: Vec<std::ops::Range<usize>>,
    context: Vec<f32>,
    attended: Vec<f32>,
    inner: Vec<f32>,
    quantized: QuantizedActivations,
    attention: Vec<AttentionScratch>,
}

impl Transformer {
    /// Floats a carried state holds per slot: every layer's key and value rows.
    pub fn carried_floats_per_slot(&self) -> usize {
        2 * self.layers.len() * self.config.hidden_size
    }

    /// SASRec's encoder resuming each history from `carry.starts` (how many slots of its model
    /// input a state covers, and the state: [`Transformer::carried_floats_per_slot`] floats per
    /// slot, at least that many slots). A state covering the whole input is resumed one slot
    /// short, since the answer slot's output is not carried. Each history's new slots' keys and
    /// values go to `carry.ends` (history after history, `new slots x floats per slot` each): its
    /// state after the pass is the carried state, as far as it was resumed, followed by them.
    /// The hidden vectors have the full pass's bits (see the module's note).
    ///
    /// # Panics
    /// On a BERT4Rec model (bidirectional: a new event changes every slot), and when a state is
    /// shorter than the slots it claims to cover.
    #[allow(clippy::too_many_arguments)]
    pub fn encode_carried(
        &self,
        k: &'static KernelTable,
        histories: &[&[u32]],
        s: &mut CarriedScratch,
        hidden: &mut Vec<f32>,
        notes: &mut Vec<HistoryNote>,
        threads: usize,
        carry: Carry<'_>,
    ) {
        assert_eq!(
            self.flavor,
            Flavor::SasRec,
            "only a causal transformer resumes"
        );
        let h = self.config.hidden_size;
        let eps = self.config.layer_norm_eps;
        let per_slot = self.carried_floats_per_slot();
        notes.clear();
        s.slots.clear();
        s.done.clear();
        s.x.clear();
        for (b, history) in histories.iter().enumerate() {
            let (kept, note) = self.kept_history(history);
            notes.push(note);
            // An empty history runs as one PAD slot (see `model_input`).
            let slots = kept.len().max(1);
            let done = carry.starts[b].as_ref().map_or(0, |(done, state)| {
                assert!(
                    *done <= kept.len() && state.len() >= done * per_slot,
                    "a carried state covers part of its history's model input"
                );
                (*done).min(slots - 1)
            });
            for slot in done..slots {
                let id = kept.get(slot).copied().unwrap_or(0);
                let start = s.x.len();
                s.x.extend_from_slice(self.position_embedding.row(slot));
                self.item_embedding
                    .add_row_into(id as usize, &mut s.x[start..]);
            }
            s.slots.push(slots);
            s.done.push(done);
        }
        self.embedding_ln.apply(k, &mut s.x, eps);

        // The ends: each history's new slots, filled layer by layer.
        carry.ends.clear();
        carry.ends_at.clear();
        for (&slots, &done) in s.slots.iter().zip(&s.done) {
            carry.ends_at.push(carry.ends.len());
            carry
                .ends
                .resize(carry.ends.len() + (slots - done) * per_slot, 0.0);
        }
        carry.ends_at.push(carry.ends.len());

        let n_layers = self.layers.len();
        for (l, layer) in self.layers.iter().enumerate() {
            let last = l + 1 == n_layers;
            self.carried_layer(k, l, layer, last, s, carry.starts, carry.ends, threads);
            std::mem::swap(&mut s.x, &mut s.out);
        }
        debug_assert_eq!(s.x.len(), histories.len() * h, "one row per history");
        hidden.clear();
        hidden.extend_from_slice(&s.x);
    }

    /// Layer `l` over the new slots in `s.x`: their keys and values into `ends` (at this layer's
    /// place in each new slot), attention over every slot (the carried ones read from `starts`),
    /// and the rest of the layer for the query rows (every new slot, or the answer slot in the
    /// last layer) into `s.out`.
    #[allow(clippy::too_many_arguments)]
    fn carried_layer(
        &self,
        k: &'static KernelTable,
        l: usize,
        layer: &TransformerLayer,
        last: bool,
        s: &mut CarriedScratch,
        starts: &[Option<(usize, &State)>],
        ends: &mut [f32],
        threads: usize,
    ) {
        let h = self.config.hidden_size;
        let per_slot = self.carried_floats_per_slot();
        let new_rows = s.x.len() / h;

        // Query rows, as new-row indices and as indices into `rows_at`.
        s.query_rows.clear();
        s.query_slots.clear();
        s.spans.clear();
        let mut new_start = 0;
        let mut all_start = 0;
        for (&slots, &done) in s.slots.iter().zip(&s.done) {
            let fresh = slots - done;
            let first = if last { slots - 1 } else { done };
            s.query_rows
                .extend((first - done..fresh).map(|r| new_start + r));
            s.query_slots.extend((first..slots).map(|r| all_start + r));
            s.spans.push(all_start..all_start + slots);
            new_start += fresh;
            all_start += slots;
        }
        let every_row = s.query_rows.len() == new_rows;
        if !every_row {
            s.x_q.clear();
            for &r in &s.query_rows {
                s.x_q.extend_from_slice(&s.x[r * h..(r + 1) * h]);
            }
        }
        let x_q: &[f32] = if every_row { &s.x } else { &s.x_q };

        // Projections of the new rows, as the full pass makes them.
        let p = &layer.projections;
        let w = p.width;
        let (stride, queries) = match p.all(k).filter(|_| every_row) {
            Some(all) => {
                project(k, &all, &s.x, &mut s.projected, &mut s.quantized, threads);
                (3 * w, None)
            }
            None => {
                let kv = p.keys_values(k);
                project(k, &kv, &s.x, &mut s.projected, &mut s.quantized, threads);
                project(
                    k,
                    &p.queries(k),
                    x_q,
                    &mut s.queries,
                    &mut s.quantized,
                    threads,
                );
                (2 * w, Some(()))
            }
        };

        // The new rows' keys and values into the ends (at this layer's place in each new slot),
        // then where every slot's rows lie for the attention: the carried ones in the cached
        // runs, the new ones in the projections (nothing gathered).
        let mut new_row = 0;
        for (&slots, &done) in s.slots.iter().zip(&s.done) {
            for _ in done..slots {
                let from = &s.projected[new_row * stride..];
                let at = new_row * per_slot + l * 2 * h;
                ends[at..at + h].copy_from_slice(&from[..h]);
                ends[at + h..at + 2 * h].copy_from_slice(&from[w..w + h]);
                new_row += 1;
            }
        }
        let mut sources: Vec<&[f32]> = Vec::new();
        s.rows_at.clear();
        let mut new_row = 0;
        for (b, (&slots, &done)) in s.slots.iter().zip(&s.done).enumerate() {
            if let Some((_, state)) = starts[b] {
                let mut left = done;
                for run in state.runs() {
                    if left == 0 {
                        break;
                    }
                    let here = (run.len() / per_slot).min(left);
                    let source = sources.len();
                    sources.push(run);
                    s.rows_at.extend((0..here).map(|slot| {
                        let key = slot * per_slot + l * 2 * h;
                        RowAt {
                            source,
                            key,
                            value: key + h,
                        }
                    }));
                    left -= here;
                }
            }
            s.rows_at.extend((done..slots).map(|_| {
                let key = new_row * stride;
                new_row += 1;
                RowAt {
                    source: usize::MAX,
                    key,
                    value: key + w,
                }
            }));
        }
        // The new rows' source: the projections, after the runs.
        let projected = sources.len();
        sources.push(&s.projected);
        for at in &mut s.rows_at {
            if at.source == usize::MAX {
                at.source = projected;
            }
        }
        let queries = match queries {
            Some(()) => Columns {
                data: &s.queries,
                stride: w,
                offset: 0,
            },
            None => Columns {
                data: &s.projected,
                stride: 3 * w,
                offset: 2 * w,
            },
        };
        self.attention(
            k,
            KeyValues::Table {
                sources: &sources,
                at: &s.rows_at,
            },
            queries,
            &s.spans,
            &s.query_slots,
            &mut s.context,
            &mut s.attention,
            threads,
        );

        s.out.resize(s.query_rows.len() * h, 0.0);
        self.finish_rows(
            k,
            layer,
            &s.context,
            x_q,
            &mut s.out,
            &mut s.attended,
            &mut s.inner,
            &mut s.quantized,
            &mut |_: &str, _: &[f32]| {},
        );
    }
}
