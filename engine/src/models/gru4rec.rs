//! GRU4Rec as RecBole 1.2.1 runs it in eval mode: the last L items' embeddings go through a
//! stacked GRU (PyTorch's gate order: reset, update, new), the hidden state after the last item
//! through a dense layer back to the embedding width, and that vector is scored against the item
//! embedding (no bias).
//!
//! A history's answer is the state after its own last item, so right padding never reaches it and
//! histories run unpadded. The recurrence is batched over histories of different lengths: the
//! histories are ordered longest first and laid out time step after time step, so the ones still
//! running at step t are a prefix of the batch, and each step is one GEMM of those rows' states
//! against the recurrent weights. The input side (every token's `x W_ih^T + b_ih`) is one GEMM over
//! all tokens of a layer before its recurrence starts; for the first layer, whose input is an item
//! embedding, it depends on the item alone, so it is computed once per item (by the same kernels,
//! so with the same bits) and each token copies its item's row.

use super::{ActivationObserver, Carry, DenseLayer, HistoryNote, OutputLayer};
use crate::config::Gru4RecConfig;
use crate::error::Result;
use crate::import::Checkpoint;
use crate::kernels::packed::QuantizedActivations;
use crate::kernels::KernelTable;
use crate::tensor::Tensor;
use crate::weights::{Matrix, Weights};

/// One GRU layer: its input and recurrent projections to the three gates' pre-activations
/// (`[3 x hidden]`: reset, update, new).
#[derive(Clone, Debug)]
struct GruLayer {
    input: DenseLayer,
    recurrent: DenseLayer,
}

/// Largest first-layer input table ([`Gru4Rec::input_table`]) kept in memory: `[N+1, 3 x hidden]`
/// floats, 5 MiB at MovieLens-1M's 3,416 items and hidden 128. Larger catalogues compute the
/// input side per token (a 1e6-item catalogue's table would be 1.5 GiB).
const INPUT_TABLE_MAX_BYTES: usize = 64 << 20;

#[derive(Clone, Debug)]
pub struct Gru4Rec {
    config: Gru4RecConfig,
    /// Every item's first-layer input gates, built on first use with the serving kernels (and
    /// dropped when the kernels or the layers change).
    input_table: std::sync::OnceLock<Vec<f32>>,
    item_embedding: Matrix,
    layers: Vec<GruLayer>,
    /// `Linear(hidden, embedding)` after the last GRU layer.
    dense: DenseLayer,
    /// The item embedding, rows 0..=N, with a zero bias.
    pub output: OutputLayer,
    kernels: &'static KernelTable,
}

/// The name every recurrent (`h W_hh^T + b_hh`) layer's starts with.
pub const RECURRENT_PREFIX: &str = "gru_layers.weight_hh_l";

/// The state-dict names of GRU layer `l`'s weights and biases.
fn gru_names(l: usize) -> [String; 4] {
    [
        format!("gru_layers.weight_ih_l{l}"),
        format!("gru_layers.weight_hh_l{l}"),
        format!("gru_layers.bias_ih_l{l}"),
        format!("gru_layers.bias_hh_l{l}"),
    ]
}

/// The engine's tensors with their shapes: the state dict's, with every GRU layer's two biases
/// (zeros when the checkpoint's GRU has none, as RecBole's does) so that every layer has the same
/// form downstream.
fn tensor_shapes(c: &Gru4RecConfig) -> Vec<(String, Vec<usize>)> {
    let (e, h) = (c.embedding_size, c.hidden_size);
    let mut shapes = vec![("item_embedding.weight".to_string(), vec![c.n_items + 1, e])];
    for l in 0..c.num_layers {
        let input = if l == 0 { e } else { h };
        let [ih, hh, bih, bhh] = gru_names(l);
        shapes.extend([
            (ih, vec![3 * h, input]),
            (hh, vec![3 * h, h]),
            (bih, vec![3 * h]),
            (bhh, vec![3 * h]),
        ]);
    }
    shapes.push(("dense.weight".into(), vec![e, h]));
    shapes.push(("dense.bias".into(), vec![e]));
    shapes
}

/// The 2-D weights a reduced precision applies to: the item embedding (and so the tied output
/// layer), the GRU's weights and the dense layer. Biases stay fp32.
pub(super) fn quantizable(c: &Gru4RecConfig) -> Vec<String> {
    tensor_shapes(c)
        .into_iter()
        .filter(|(_, shape)| shape.len() == 2)
        .map(|(name, _)| name)
        .collect()
}

pub(super) fn engine_tensors(
    c: &Gru4RecConfig,
    ckpt: &Checkpoint,
) -> Result<Vec<(String, Tensor)>> {
    tensor_shapes(c)
        .into_iter()
        .map(|(name, shape)| {
            let is_bias = name.starts_with("gru_layers.bias_");
            let t = if is_bias && !c.gru_bias {
                Tensor::from_vec(shape.clone(), vec![0.0; shape[0]])
            } else {
                ckpt.tensor_f32(&name, &shape)?
            };
            Ok((name, t))
        })
        .collect()
}

impl Gru4Rec {
    pub fn from_tensors(config: Gru4RecConfig, t: &Weights) -> Result<Gru4Rec> {
        let (e, h, n) = (config.embedding_size, config.hidden_size, config.n_items);
        let mut layers = Vec::with_capacity(config.num_layers);
        for l in 0..config.num_layers {
            let input_width = if l == 0 { e } else { h };
            let [ih, hh, bih, bhh] = gru_names(l);
            layers.push(GruLayer {
                input: DenseLayer::new(
                    &ih,
                    &t.matrix(&ih, [3 * h, input_width])?,
                    &t.tensor(&bih, &[3 * h])?,
                ),
                recurrent: DenseLayer::new(
                    &hh,
                    &t.matrix(&hh, [3 * h, h])?,
                    &t.tensor(&bhh, &[3 * h])?,
                ),
            });
        }
        let item_embedding = t.matrix("item_embedding.weight", [n + 1, e])?;
        Ok(Gru4Rec {
            dense: DenseLayer::new(
                "dense",
                &t.matrix("dense.weight", [e, h])?,
                &t.tensor("dense.bias", &[e])?,
            ),
            output: OutputLayer {
                weight: item_embedding.clone(),
                bias: Tensor::from_vec(vec![n + 1], vec![0.0; n + 1]),
            },
            item_embedding,
            layers,
            config,
            input_table: Default::default(),
            kernels: KernelTable::detect(),
        })
    }

    /// The first layer's input gates of every item (`[N+1, 3 x hidden]`, `x W_ih^T + b_ih` of its
    /// embedding), when small enough to keep ([`INPUT_TABLE_MAX_BYTES`]). Each row is what the
    /// layer gives that item's token in a batch: the kernels compute a row the same way whatever
    /// rows surround it.
    fn input_table(&self) -> Option<&[f32]> {
        let (rows, e, h) = (
            self.config.n_items + 1,
            self.config.embedding_size,
            self.config.hidden_size,
        );
        if rows * 3 * h * 4 > INPUT_TABLE_MAX_BYTES {
            return None;
        }
        let table = self.input_table.get_or_init(|| {
            let mut x = vec![0f32; rows * e];
            for (item, row) in x.chunks_exact_mut(e).enumerate() {
                self.item_embedding.add_row_into(item, row);
            }
            let (mut y, mut quantized) = (Vec::new(), QuantizedActivations::default());
            self.layers[0].input.forward_into(
                self.kernels,
                &x,
                &mut y,
                &mut quantized,
                1,
                &mut |_, _| {},
            );
            y
        });
        Some(table)
    }

    pub fn config(&self) -> &Gru4RecConfig {
        &self.config
    }

    pub(crate) fn packed_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| l.input.packed_bytes() + l.recurrent.packed_bytes())
            .sum::<usize>()
            + self.dense.packed_bytes()
    }

    pub(crate) fn set_kernels(&mut self, kernels: &'static KernelTable) {
        self.kernels = kernels;
        self.input_table = Default::default();
    }

    /// The kernels the model runs when a call names none.
    pub(crate) fn kernels(&self) -> &'static KernelTable {
        self.kernels
    }

    /// The layers by role, for a device that runs the whole model.
    pub fn view(&self) -> super::Gru4RecView<'_> {
        super::Gru4RecView {
            model: self,
            item_embedding: &self.item_embedding,
            layers: self
                .layers
                .iter()
                .map(|l| super::GruLayerView {
                    input: &l.input,
                    recurrent: &l.recurrent,
                })
                .collect(),
            dense: &self.dense,
        }
    }

    /// The part of `history` the model reads: its last L items.
    pub fn model_input<'h>(&self, history: &'h [u32]) -> (&'h [u32], HistoryNote) {
        super::most_recent(history, self.config.max_len)
    }

    /// The dense layers in the order they run.
    pub(crate) fn dense_layers_mut(&mut self) -> Vec<&mut DenseLayer> {
        // The caller may change them (static activation scales): the table follows.
        self.input_table = Default::default();
        let mut out = Vec::new();
        for layer in &mut self.layers {
            out.push(&mut layer.input);
            out.push(&mut layer.recurrent);
        }
        out.push(&mut self.dense);
        out
    }

    /// The hidden vectors of `histories` into `hidden` and `notes` (replacing what they held), working
    /// in `scratch`, the GEMMs' rows split over up to `threads` threads when large enough: once
    /// the buffers have grown to a batch's size, batches no larger allocate nothing (on one
    /// thread). An empty history's state stays at the GRU's initial zeros. `observing`: `observe`
    /// must see the first layer's input (calibration), so it is computed per token rather than
    /// read from [`Gru4Rec::input_table`] (the same bits either way).
    #[allow(clippy::too_many_arguments)]
    pub fn encode_into(
        &self,
        k: &KernelTable,
        histories: &[&[u32]],
        scratch: &mut Gru4RecScratch,
        hidden: &mut Vec<f32>,
        notes: &mut Vec<HistoryNote>,
        threads: usize,
        observing: bool,
        observe: ActivationObserver<'_>,
    ) {
        self.encode_carried(
            k, histories, scratch, hidden, notes, threads, observing, observe, None,
        )
    }

    /// The layers' states after a history's model input (`[layers x hidden]`, layer after
    /// layer): what lets a later call that extends the history compute only its new items.
    pub fn state_len(&self) -> usize {
        self.layers.len() * self.config.hidden_size
    }

    /// [`Gru4Rec::encode_into`], each history resuming from `carry`'s state after the first
    /// items of its model input (computing only the items after them) and leaving its states
    /// after its last item in `carry.ends`. The GRU's rows are independent of one another and a
    /// resumed state holds the very bits the full pass computed at that item, so the hidden
    /// vectors are the full pass's, bit for bit.
    #[allow(clippy::too_many_arguments)]
    pub fn encode_carried(
        &self,
        k: &KernelTable,
        histories: &[&[u32]],
        scratch: &mut Gru4RecScratch,
        hidden: &mut Vec<f32>,
        notes: &mut Vec<HistoryNote>,
        threads: usize,
        observing: bool,
        observe: ActivationObserver<'_>,
        mut carry: Option<Carry<'_>>,
    ) {
        let (e, h) = (self.config.embedding_size, self.config.hidden_size);
        let s = scratch;
        let batch = histories.len();
        notes.clear();
        s.kept.clear();
        s.done.clear();
        for (b, history) in histories.iter().enumerate() {
            let (kept, note) = self.model_input(history);
            notes.push(note);
            let done =
                carry
                    .as_ref()
                    .and_then(|c| c.starts[b].as_ref())
                    .map_or(0, |(done, state)| {
                        assert!(
                            *done <= kept.len() && state.len() == self.state_len(),
                            "a carried state covers part of its history's model input"
                        );
                        *done
                    });
            s.kept.push(kept.len());
            s.done.push(done);
        }
        // Most items left first (stable), so the histories still running at any step are a prefix.
        s.order.clear();
        s.order.extend(0..batch);
        s.order
            .sort_by_key(|&b| std::cmp::Reverse(s.kept[b] - s.done[b]));
        let steps = s.order.first().map_or(0, |&b| s.kept[b] - s.done[b]);
        // Histories still running at each step, and where each step's rows start.
        s.running.clear();
        s.step_starts.clear();
        let mut tokens = 0;
        for t in 0..steps {
            let running = s
                .order
                .iter()
                .take_while(|&&b| s.kept[b] - s.done[b] > t)
                .count();
            s.step_starts.push(tokens);
            s.running.push(running);
            tokens += running;
        }
        // The tokens' items, step after step, each step's rows in the batch's order.
        s.items.clear();
        for t in 0..steps {
            s.items.extend(s.order[..s.running[t]].iter().map(|&b| {
                let history = histories[b];
                history[history.len() - s.kept[b] + s.done[b] + t]
            }));
        }
        let table = if observing { None } else { self.input_table() };
        if table.is_none() {
            s.x.clear();
            s.x.resize(tokens * e, 0.0);
            for (&item, row) in s.items.iter().zip(s.x.chunks_exact_mut(e)) {
                self.item_embedding.add_row_into(item as usize, row);
            }
        }
        s.state.clear();
        s.state.resize(batch * h, 0.0);
        let n_layers = self.layers.len();
        for (l, layer) in self.layers.iter().enumerate() {
            let last = l + 1 == n_layers;
            // The input side: read from the first layer's table by item, else computed per token.
            let from_table = table.filter(|_| l == 0);
            if from_table.is_none() {
                layer.input.forward_into(
                    k,
                    &s.x,
                    &mut s.input_gates,
                    &mut s.quantized,
                    threads,
                    observe,
                );
            }
            // Each history's state: where its carried prefix left this layer, else the GRU's zeros.
            for (i, &b) in s.order.iter().enumerate() {
                let row = &mut s.state[i * h..(i + 1) * h];
                match carry.as_ref().and_then(|c| c.starts[b].as_ref()) {
                    Some((_, state)) => {
                        row.copy_from_slice(&state.contiguous()[l * h..(l + 1) * h])
                    }
                    None => row.fill(0.0),
                }
            }
            if !last {
                s.next.resize(tokens * h, 0.0);
            }
            for t in 0..steps {
                let running = s.running[t];
                let state = &mut s.state[..running * h];
                layer.recurrent.forward_into(
                    k,
                    state,
                    &mut s.recurrent_gates,
                    &mut s.quantized,
                    threads,
                    observe,
                );
                let start = s.step_starts[t];
                let input_gates = |r: usize| -> &[f32] {
                    match from_table {
                        Some(table) => {
                            let item = s.items[start + r] as usize;
                            &table[item * 3 * h..(item + 1) * 3 * h]
                        }
                        None => &s.input_gates[(start + r) * 3 * h..(start + r + 1) * 3 * h],
                    }
                };
                self.gru_step(
                    k,
                    input_gates,
                    &s.recurrent_gates,
                    state,
                    &mut s.reset_update,
                    &mut s.candidate,
                );
                if !last {
                    s.next[start * h..(start + running) * h].copy_from_slice(state);
                }
            }
            if let Some(c) = carry.as_mut() {
                let width = self.state_len();
                c.ends.resize(batch * width, 0.0);
                c.ends_at.clear();
                c.ends_at.extend((0..=batch).map(|b| b * width));
                for (i, &b) in s.order.iter().enumerate() {
                    c.ends[b * width + l * h..b * width + (l + 1) * h]
                        .copy_from_slice(&s.state[i * h..(i + 1) * h]);
                }
            }
            if !last {
                std::mem::swap(&mut s.x, &mut s.next);
            }
        }
        // The dense layer on the final states, then back into the batch's order.
        self.dense.forward_into(
            k,
            &s.state,
            &mut s.projected,
            &mut s.quantized,
            threads,
            observe,
        );
        hidden.clear();
        hidden.resize(batch * e, 0.0);
        for (i, &b) in s.order.iter().enumerate() {
            hidden[b * e..(b + 1) * e].copy_from_slice(&s.projected[i * e..(i + 1) * e]);
        }
    }

    /// One GRU step for the running rows, from their gates' pre-activations (`[rows, 3 x hidden]`
    /// from the input and from the state, biases included), updating `state` in place:
    /// `r = σ(i_r + h_r)`, `z = σ(i_z + h_z)`, `n = tanh(i_n + r h_n)`, `h = (1 - z) n + z h`.
    /// The sigmoid is `(1 + tanh(x / 2)) / 2`, on the ISA's vectorised tanh.
    fn gru_step<'a>(
        &self,
        k: &KernelTable,
        input_gates: impl Fn(usize) -> &'a [f32],
        recurrent_gates: &[f32],
        state: &mut [f32],
        reset_update: &mut Vec<f32>,
        candidate: &mut Vec<f32>,
    ) {
        let h = self.config.hidden_size;
        let rows = state.len() / h;
        let tanh = k.elementwise.tanh;
        reset_update.resize(rows * 2 * h, 0.0);
        for (r, out) in reset_update.chunks_exact_mut(2 * h).enumerate() {
            let (i, g) = (
                &input_gates(r)[..2 * h],
                &recurrent_gates[r * 3 * h..r * 3 * h + 2 * h],
            );
            for ((o, a), b) in out.iter_mut().zip(i).zip(g) {
                *o = 0.5 * (a + b);
            }
        }
        tanh(reset_update);
        candidate.resize(rows * h, 0.0);
        for (r, out) in candidate.chunks_exact_mut(h).enumerate() {
            let reset = &reset_update[r * 2 * h..r * 2 * h + h];
            let i_n = &input_gates(r)[2 * h..];
            let h_n = &recurrent_gates[r * 3 * h + 2 * h..(r + 1) * 3 * h];
            for (((o, a), b), t) in out.iter_mut().zip(i_n).zip(h_n).zip(reset) {
                *o = a + (0.5 + 0.5 * t) * b;
            }
        }
        tanh(candidate);
        for (r, state) in state.chunks_exact_mut(h).enumerate() {
            let update = &reset_update[r * 2 * h + h..(r + 1) * 2 * h];
            let new = &candidate[r * h..(r + 1) * h];
            for ((s, t), n) in state.iter_mut().zip(update).zip(new) {
                let z = 0.5 + 0.5 * t;
                *s = (1.0 - z) * n + z * *s;
            }
        }
    }
}

/// The buffers one GRU4Rec pass works in (see [`Gru4Rec::encode_into`]).
#[derive(Debug, Default)]
pub struct Gru4RecScratch {
    /// Items kept per history, in the batch's order.
    kept: Vec<usize>,
    /// Items of each history's model input a carried state covers (not computed again).
    done: Vec<usize>,
    /// The batch's histories, longest first.
    order: Vec<usize>,
    /// The tokens' items, step after step.
    items: Vec<u32>,
    /// Per step: how many histories are still running, and the row their tokens start at.
    running: Vec<usize>,
    step_starts: Vec<usize>,
    /// A layer's input by token (`[tokens, width]`, step after step) and the next layer's.
    x: Vec<f32>,
    next: Vec<f32>,
    /// The input side of every token's gates, `[tokens, 3 x hidden]`.
    input_gates: Vec<f32>,
    /// The state side of one step's gates, `[running, 3 x hidden]`.
    recurrent_gates: Vec<f32>,
    reset_update: Vec<f32>,
    candidate: Vec<f32>,
    /// The state of every history, longest first, `[B, hidden]`.
    state: Vec<f32>,
    /// The dense layer's output, longest first.
    projected: Vec<f32>,
    quantized: QuantizedActivations,
}
