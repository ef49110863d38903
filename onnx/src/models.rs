//! The recommenders as ONNX graphs, computing what the engine computes (same weights at the
//! same precision). Both end in the output layer's input (the user's hidden vector) and the output
//! layer itself, whose bias has PAD (column 0) at -inf, so the shared tail scores the whole
//! catalogue or just a request's candidates, then applies the caller's exclusions and top-k.

use std::collections::BTreeMap;

use onnx_protobuf as pb;
use pb::tensor_proto::DataType;
use recsys_engine::config::{Gru4RecConfig, TransformerConfig, VaeCfConfig};
use recsys_engine::models::vaecf::{layer_shapes, FIRST_LAYER_BY_ITEM};
use recsys_engine::weights::Matrix;
use recsys_engine::weights::Weights;

use crate::graph::{value_info, Attr, GraphBuilder, FP32_NORMALIZE_PREFIX};
use crate::Result;

/// Static activation scales of a W8A8 export: the output layer's and, when the engine recorded
/// them, every dense layer's input (keyed by the layer's weight prefix).
#[derive(Clone, Debug, Default)]
pub(crate) struct ActivationScales {
    pub dense: BTreeMap<String, f32>,
    pub output: Option<f32>,
}

impl ActivationScales {
    pub(crate) fn dense(&self, prefix: &str) -> Option<f32> {
        self.dense.get(prefix).copied()
    }
}

/// Inputs, the user's hidden vector and the output layer, for the shared tail.
pub(crate) struct ModelGraph {
    pub inputs: Vec<pb::ValueInfoProto>,
    /// `[batch, d]`: the output layer's input, in the compute type.
    pub hidden: String,
    pub hidden_size: usize,
    /// The output layer in the compute type, one row per output `[rows, d]` (dequantized or cast
    /// where the engine stores less); `rows` may exceed `n_outputs` (BERT4Rec's tied table has
    /// the MASK row last, whose logit is sliced off).
    pub out_weight: String,
    /// `[rows]`, PAD (and anything past `n_outputs`) at -inf.
    pub out_bias: String,
    pub out_rows: usize,
    pub n_outputs: usize,
}

impl ModelGraph {
    /// `h @ W^T + b` over the whole catalogue, `[batch, n_outputs]`; with a W8A8 activation
    /// scale, `h` gets a static Q/DQ pair first (the int8 x int8 product TensorRT can then build).
    /// The Gemm reads the table's DequantizeLinear directly; rows past the catalogue are sliced
    /// off its result, never off the weights.
    pub fn logits(&self, g: &mut GraphBuilder, activation_scale: Option<f32>) -> String {
        let h = quantized_input(g, &self.hidden, activation_scale);
        let logits = g.op(
            "Gemm",
            &[&h, &self.out_weight, &self.out_bias],
            vec![("transB", Attr::Int(1))],
        );
        if self.out_rows == self.n_outputs {
            return logits;
        }
        let starts = g.init_i64("starts", &[0]);
        let ends = g.init_i64("ends", &[self.n_outputs as i64]);
        let axes1 = g.init_i64("axes", &[1]);
        g.op("Slice", &[&logits, &starts, &ends, &axes1], vec![])
    }

    /// The scores of `candidates` (`[batch, C]` internal indices) alone, `[batch, C]`: their rows
    /// of the output layer gathered and multiplied with each user's `h` (PAD, index 0, scores
    /// -inf like everywhere). The cost is the candidates', not the catalogue's.
    pub fn candidate_scores(
        &self,
        g: &mut GraphBuilder,
        candidates: &str,
        activation_scale: Option<f32>,
    ) -> String {
        let h = quantized_input(g, &self.hidden, activation_scale);
        let rows = g.op(
            "Gather",
            &[&self.out_weight, candidates],
            vec![("axis", Attr::Int(0))],
        );
        let bias = g.op(
            "Gather",
            &[&self.out_bias, candidates],
            vec![("axis", Attr::Int(0))],
        );
        let axes2 = g.init_i64("axes", &[2]);
        let column = g.op("Unsqueeze", &[&h, &axes2], vec![]);
        let dots = g.op("MatMul", &[&rows, &column], vec![]);
        let dots = g.op("Squeeze", &[&dots, &axes2], vec![]);
        g.op("Add", &[&dots, &bias], vec![])
    }
}

/// The output layer's input as the engine multiplies it: W8A8 engines round it to their static
/// activation scale.
fn quantized_input(g: &mut GraphBuilder, h: &str, activation_scale: Option<f32>) -> String {
    match activation_scale {
        Some(scale) => g.fake_quantize(h, "output_input", scale),
        None => h.to_string(),
    }
}

/// The output bias over `rows` outputs with PAD (index 0) and every row from `n_outputs` on at
/// -inf, so none is ever recommended.
fn output_bias(
    g: &mut GraphBuilder,
    weights: &Weights,
    name: &str,
    n_outputs: usize,
    rows: usize,
) -> Result<String> {
    let mut bias = weights.tensor(name, &[n_outputs])?.as_slice().to_vec();
    bias[0] = f32::NEG_INFINITY;
    bias.resize(rows, f32::NEG_INFINITY);
    Ok(g.init_float(&format!("{name}_pad_excluded"), &[rows], &bias))
}

/// Which transformer recommender [`transformer`] builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Transformer {
    /// The history then [MASK], bidirectional attention, the MASK slot's output through the
    /// head, an output bias.
    Bert4Rec,
    /// The history alone, causal attention, the last item's slot, no head and no bias.
    SasRec,
}

/// The answer slot of each sequence as a one-hot row, `[B, 1, L]`, in the compute type.
pub(crate) fn answer_slot(g: &mut GraphBuilder, seq: &str, kind: Transformer, n: usize) -> String {
    let axes1 = g.init_i64("axes", &[1]);
    let one_hot = match kind {
        Transformer::Bert4Rec => {
            let mask_index = g.scalar_i64("mask_index", n as i64 + 1);
            let at_mask = g.op("Equal", &[seq, &mask_index], vec![]);
            g.cast_to_compute(&at_mask)
        }
        Transformer::SasRec => {
            // Histories are left-aligned: the last item is the slot holding an item whose next
            // slot does not (the last slot's "next" is a PAD appended here).
            let zero = g.scalar_i64("pad_index", 0);
            let is_pad = g.op("Equal", &[seq, &zero], vec![]);
            let is_item = g.op("Not", &[&is_pad], vec![]);
            let (starts, ends) = (g.init_i64("starts", &[1]), g.init_i64("ends", &[i64::MAX]));
            let next = g.op("Slice", &[&is_pad, &starts, &ends, &axes1], vec![]);
            let (s0, s1) = (g.init_i64("starts", &[0]), g.init_i64("ends", &[1]));
            let first = g.op("Slice", &[&is_pad, &s0, &s1, &axes1], vec![]);
            let pad_column = g.op("Not", &[&first], vec![]);
            let pad_column = g.op("Or", &[&pad_column, &first], vec![]);
            let next_is_pad = g.op(
                "Concat",
                &[&next, &pad_column],
                vec![("axis", Attr::Int(1))],
            );
            let last = g.op("And", &[&is_item, &next_is_pad], vec![]);
            g.cast_to_compute(&last)
        }
    };
    g.op("Unsqueeze", &[&one_hot, &axes1], vec![])
}

/// BERT4Rec or SASRec (`kind`): the same post-LN layers as the engine runs them.
pub(crate) fn transformer(
    g: &mut GraphBuilder,
    kind: Transformer,
    c: &TransformerConfig,
    w: &Weights,
    scales: &ActivationScales,
) -> Result<ModelGraph> {
    let (h, inner, n, l) = (c.hidden_size, c.inner_size, c.n_items, c.max_len);
    let table_rows = match kind {
        Transformer::Bert4Rec => n + 2,
        Transformer::SasRec => n + 1,
    };
    let heads = c.n_heads;
    let head_dim = h / heads;
    let eps = c.layer_norm_eps;
    let seq = "item_seq";
    let float = g.float;

    // One table for the embedding Gather and the tied output Gemm (each reads its
    // DequantizeLinear directly when int8).
    let table = w.matrix("item_embedding.weight", [table_rows, h])?;
    let table = g.weight("item_embedding.weight", &table);
    let tokens = g.op("Gather", &[&table, seq], vec![("axis", Attr::Int(0))]);
    let pos = w.tensor("position_embedding.weight", &[l, h])?;
    let pos = g.init_float("position_embedding.weight", &[l, h], pos.as_slice());
    let x = g.op("Add", &[&tokens, &pos], vec![]);
    let ln = |g: &mut GraphBuilder, x: &str, prefix: &str| -> Result<String> {
        let gamma = w.tensor(&format!("{prefix}.weight"), &[h])?;
        let beta = w.tensor(&format!("{prefix}.bias"), &[h])?;
        Ok(g.layer_norm(x, prefix, &gamma, &beta, eps))
    };
    let mut x = ln(g, &x, "LayerNorm")?;

    // RecBole's additive key mask: -10000 on PAD keys, [B, 1, 1, L].
    let zero = g.scalar_i64("pad_index", 0);
    let is_pad = g.op("Equal", &[seq, &zero], vec![]);
    let is_pad = g.cast_to_compute(&is_pad);
    let minus = g.scalar_float("mask_value", -10000.0);
    let key_mask = g.op("Mul", &[&is_pad, &minus], vec![]);
    let axes12 = g.init_i64("axes", &[1, 2]);
    let key_mask = g.op("Unsqueeze", &[&key_mask, &axes12], vec![]);

    // SASRec's causal mask, [1, 1, L, L]: -10000 on keys after the query's slot (only the
    // layers before the last need it: the last one's query is the last item, after which every
    // key is PAD).
    let causal_mask = (kind == Transformer::SasRec).then(|| {
        let values: Vec<f32> = (0..l * l)
            .map(|i| if i % l > i / l { -10000.0 } else { 0.0 })
            .collect();
        g.init_float("causal_mask", &[1, 1, l, l], &values)
    });

    // One-hot of the answer slot, [B, 1, L]: selects the row the answer is read from.
    let select_mask = answer_slot(g, seq, kind, n);

    let split_heads = g.init_i64("split_heads", &[0, 0, heads as i64, head_dim as i64]);
    let merge_heads = g.init_i64("merge_heads", &[0, 0, h as i64]);
    let sqrt_d = g.scalar_float("sqrt_head_dim", (head_dim as f32).sqrt());

    let dense =
        |g: &mut GraphBuilder, x: &str, prefix: &str, out: usize, inp: usize| -> Result<String> {
            let weight = w.matrix(&format!("{prefix}.weight"), [out, inp])?;
            let bias = w.tensor(&format!("{prefix}.bias"), &[out])?;
            Ok(g.linear(x, prefix, &weight, &bias, scales.dense(prefix)))
        };

    for layer in 0..c.n_layers {
        let p = format!("trm_encoder.layer.{layer}");
        let a = format!("{p}.multi_head_attention");
        // Only the answer row is read after the last layer, so its queries, attention output
        // and feed-forward run for that row alone (as in the engine); keys and values see every
        // slot.
        let last_layer = layer + 1 == c.n_layers;
        let x_q = if last_layer {
            g.op("MatMul", &[&select_mask, &x], vec![])
        } else {
            x.clone()
        };
        let q = dense(g, &x_q, &format!("{a}.query"), h, h)?;
        let k = dense(g, &x, &format!("{a}.key"), h, h)?;
        let v = dense(g, &x, &format!("{a}.value"), h, h)?;
        let q = g.op("Reshape", &[&q, &split_heads], vec![]);
        let q = g.op(
            "Transpose",
            &[&q],
            vec![("perm", Attr::Ints(vec![0, 2, 1, 3]))],
        );
        let k = g.op("Reshape", &[&k, &split_heads], vec![]);
        let k = g.op(
            "Transpose",
            &[&k],
            vec![("perm", Attr::Ints(vec![0, 2, 3, 1]))],
        );
        let v = g.op("Reshape", &[&v, &split_heads], vec![]);
        let v = g.op(
            "Transpose",
            &[&v],
            vec![("perm", Attr::Ints(vec![0, 2, 1, 3]))],
        );
        let scores = g.op("MatMul", &[&q, &k], vec![]);
        let scores = g.op("Div", &[&scores, &sqrt_d], vec![]);
        let scores = g.op("Add", &[&scores, &key_mask], vec![]);
        let scores = match &causal_mask {
            Some(mask) if !last_layer => g.op("Add", &[&scores, mask], vec![]),
            _ => scores,
        };
        let probs = g.softmax(&scores);
        let ctx = g.op("MatMul", &[&probs, &v], vec![]);
        let ctx = g.op(
            "Transpose",
            &[&ctx],
            vec![("perm", Attr::Ints(vec![0, 2, 1, 3]))],
        );
        let ctx = g.op("Reshape", &[&ctx, &merge_heads], vec![]);
        let attended = dense(g, &ctx, &format!("{a}.dense"), h, h)?;
        let attended = g.op("Add", &[&attended, &x_q], vec![]);
        let attended = ln(g, &attended, &format!("{a}.LayerNorm"))?;
        let f = format!("{p}.feed_forward");
        let hidden = dense(g, &attended, &format!("{f}.dense_1"), inner, h)?;
        let hidden = g.gelu(&hidden);
        let out = dense(g, &hidden, &format!("{f}.dense_2"), h, inner)?;
        let out = g.op("Add", &[&out, &attended], vec![]);
        x = ln(g, &out, &format!("{f}.LayerNorm"))?;
    }
    if c.n_layers == 0 {
        x = g.op("MatMul", &[&select_mask, &x], vec![]);
    }
    let flat = g.init_i64("rows", &[-1, h as i64]);
    let mut hidden = g.op("Reshape", &[&x, &flat], vec![]);
    if kind == Transformer::Bert4Rec {
        hidden = dense(g, &hidden, "output_ffn", h, h)?;
        hidden = g.gelu(&hidden);
        hidden = ln(g, &hidden, "output_ln")?;
    }

    // Tied output layer: the whole table; BERT4Rec's MASK row's logit (bias -inf) is sliced off
    // the Gemm's result.
    let bias = match kind {
        Transformer::Bert4Rec => output_bias(g, w, "output_bias", n + 1, n + 2)?,
        Transformer::SasRec => no_output_bias(g, n + 1),
    };
    debug_assert_eq!(float, g.float);

    let meaning = match kind {
        Transformer::Bert4Rec => format!(
            "internal item indices (1..={n}): the history's last {} items oldest first, then the \
             MASK index {}, right-padded with 0 to {l} slots",
            l - 1,
            n + 1
        ),
        Transformer::SasRec => format!(
            "internal item indices (1..={n}): the history's last {l} items oldest first (at least \
             one), right-padded with 0 to {l} slots"
        ),
    };
    let inputs = vec![value_info(
        seq,
        DataType::INT64,
        &[None, Some(l)],
        &["batch"],
        &meaning,
    )];
    Ok(ModelGraph {
        inputs,
        hidden,
        hidden_size: h,
        out_weight: table,
        out_bias: bias,
        out_rows: table_rows,
        n_outputs: n + 1,
    })
}

/// A zero output bias over `rows` outputs with PAD (index 0) at -inf: the models whose scores
/// are the bare dot product (SASRec, GRU4Rec).
pub(crate) fn no_output_bias(g: &mut GraphBuilder, rows: usize) -> String {
    let mut bias = vec![0.0; rows];
    bias[0] = f32::NEG_INFINITY;
    g.init_float("output_bias_pad_excluded", &[rows], &bias)
}

/// The rows of a `[3 x hidden, width]` GRU weight (or `[3 x hidden]` bias, `width` 1) in ONNX's
/// gate order (update, reset, new) from PyTorch's (reset, update, new), dequantized to f32.
fn onnx_gate_order(m: &Matrix, hidden: usize) -> Vec<f32> {
    let width = m.cols();
    let mut out = vec![0f32; 3 * hidden * width];
    for (to, from) in [(0, 1), (1, 0), (2, 2)] {
        for r in 0..hidden {
            let row = &mut out[(to * hidden + r) * width..(to * hidden + r + 1) * width];
            m.add_row_into(from * hidden + r, row);
        }
    }
    out
}

/// GRU4Rec: item embedding, ONNX `GRU` layers (`linear_before_reset = 1`, PyTorch's form of the
/// new gate), the dense layer, scores against the item embedding. The GRU runs over all L slots
/// without `sequence_lens` (padding comes after each history's items, so the output at its last
/// item is unaffected) and the answer is read at the last item's slot.
pub(crate) fn gru4rec(
    g: &mut GraphBuilder,
    c: &Gru4RecConfig,
    w: &Weights,
    scales: &ActivationScales,
) -> Result<ModelGraph> {
    let (e, h, n, l) = (c.embedding_size, c.hidden_size, c.n_items, c.max_len);
    let seq = "item_seq";
    let table = w.matrix("item_embedding.weight", [n + 1, e])?;
    let table = g.weight("item_embedding.weight", &table);
    let tokens = g.op("Gather", &[&table, seq], vec![("axis", Attr::Int(0))]);
    // [B, L, E] -> [L, B, E]: the GRU's default layout is time first.
    let mut x = g.op(
        "Transpose",
        &[&tokens],
        vec![("perm", Attr::Ints(vec![1, 0, 2]))],
    );
    let axes1 = g.init_i64("axes", &[1]);
    for layer in 0..c.num_layers {
        let input = if layer == 0 { e } else { h };
        let weight = |name: &str, cols: usize| -> Result<Vec<f32>> {
            Ok(onnx_gate_order(&w.matrix(name, [3 * h, cols])?, h))
        };
        let bias = |name: &str| -> Result<Matrix> {
            let t = w.tensor(name, &[3 * h])?;
            Ok(Matrix::F32(recsys_engine::tensor::Tensor::from_vec(
                vec![3 * h, 1],
                t.as_slice().to_vec(),
            )))
        };
        let p = format!("gru_layers.l{layer}");
        let wi = weight(&format!("gru_layers.weight_ih_l{layer}"), input)?;
        let wi = g.init_float(&format!("{p}.W"), &[1, 3 * h, input], &wi);
        let wh = weight(&format!("gru_layers.weight_hh_l{layer}"), h)?;
        let wh = g.init_float(&format!("{p}.R"), &[1, 3 * h, h], &wh);
        let mut b = onnx_gate_order(&bias(&format!("gru_layers.bias_ih_l{layer}"))?, h);
        b.extend(onnx_gate_order(
            &bias(&format!("gru_layers.bias_hh_l{layer}"))?,
            h,
        ));
        let b = g.init_float(&format!("{p}.B"), &[1, 6 * h], &b);
        // All-layer W8A8 quantizes the input side at its static scale; the recurrent state stays
        // float (the GRU operator has no quantized form).
        if let Some(scale) = scales.dense(&format!("gru_layers.weight_ih_l{layer}")) {
            x = g.fake_quantize(&x, &format!("{p}.input"), scale);
        }
        let y = g.op(
            "GRU",
            &[&x, &wi, &wh, &b],
            vec![
                ("hidden_size", Attr::Int(h as i64)),
                ("linear_before_reset", Attr::Int(1)),
            ],
        );
        // Y is [L, directions = 1, B, H].
        x = g.op("Squeeze", &[&y, &axes1], vec![]);
    }
    // [L, B, H] -> [B, L, H], then the last item's row.
    let by_history = g.op(
        "Transpose",
        &[&x],
        vec![("perm", Attr::Ints(vec![1, 0, 2]))],
    );
    let select = answer_slot(g, seq, Transformer::SasRec, n);
    let last = g.op("MatMul", &[&select, &by_history], vec![]);
    let flat = g.init_i64("rows", &[-1, h as i64]);
    let last = g.op("Reshape", &[&last, &flat], vec![]);
    let weight = w.matrix("dense.weight", [e, h])?;
    let bias = w.tensor("dense.bias", &[e])?;
    let hidden = g.linear(&last, "dense", &weight, &bias, scales.dense("dense"));
    let out_bias = no_output_bias(g, n + 1);
    let inputs = vec![value_info(
        seq,
        DataType::INT64,
        &[None, Some(l)],
        &["batch"],
        &format!(
            "internal item indices (1..={n}): the history's last {l} items oldest first (at least \
             one), right-padded with 0 to {l} slots"
        ),
    )];
    Ok(ModelGraph {
        inputs,
        hidden,
        hidden_size: e,
        out_weight: table,
        out_bias,
        out_rows: n + 1,
        n_outputs: n + 1,
    })
}

/// With [`crate::Dedup::Auto`], catalogues below this many items drop a history's duplicates with a scatter over a row of
/// the catalogue per history (`[B, N+1]` int64, 512 KiB per history at the limit); larger ones
/// compare the history's slots pairwise (`[B, T, T]`), whose cost grows with the history's length
/// squared instead: with MovieLens-1M's lengths (hundreds to thousands of slots once a batch is
/// padded to its longest) the pairwise graph ran 40x slower in ONNX Runtime than the scatter.
const DEDUP_BY_SCATTER_MAX_ITEMS: usize = 1 << 16;

/// Per slot of `items` (`[B, T]`), whether it is the slot that counts for its item: each slot
/// writes its position into its item's cell of a `[B, N+1]` row (duplicates: one of them wins,
/// whichever the runtime lets), then reads its item's cell back; exactly the winner reads its own
/// position, so every distinct item counts once whatever the order of the writes.
fn first_of_each_item_by_scatter(
    g: &mut GraphBuilder,
    items: &str,
    positions: &str,
    n: usize,
) -> String {
    let zero = g.scalar_i64("zero", 0);
    // [B, T] positions and a [B, N+1] row of -1 per history, both shaped from `items` by
    // broadcasting (no shape arithmetic).
    let zeros = g.op("Mul", &[items, &zero], vec![]);
    let slot_positions = g.op("Add", &[&zeros, positions], vec![]);
    let (starts, ends, axes) = (
        g.init_i64("starts", &[0]),
        g.init_i64("ends", &[1]),
        g.init_i64("axes", &[1]),
    );
    let first_column = g.op("Slice", &[&zeros, &starts, &ends, &axes], vec![]);
    let empty_row = g.init_i64("empty_row", &vec![-1; n + 1]);
    let cells = g.op("Add", &[&first_column, &empty_row], vec![]);
    let owners = g.op(
        "ScatterElements",
        &[&cells, items, &slot_positions],
        vec![("axis", Attr::Int(1))],
    );
    let owner = g.op(
        "GatherElements",
        &[&owners, items],
        vec![("axis", Attr::Int(1))],
    );
    g.op("Equal", &[&owner, &slot_positions], vec![])
}

/// [`first_of_each_item_by_scatter`] for large catalogues: a slot counts when no earlier slot
/// holds the same item, from `[B, T, T]` equalities masked to earlier slots, any over the last
/// axis.
fn first_of_each_item_by_pairs(g: &mut GraphBuilder, items: &str, positions: &str) -> String {
    let (axes0, axes1, axes2) = (
        g.init_i64("axes", &[0]),
        g.init_i64("axes", &[1]),
        g.init_i64("axes", &[2]),
    );
    let later = g.op("Unsqueeze", &[positions, &axes1], vec![]);
    let sooner = g.op("Unsqueeze", &[positions, &axes0], vec![]);
    let earlier = g.op("Less", &[&sooner, &later], vec![]);
    let column = g.op("Unsqueeze", &[items, &axes2], vec![]);
    let row = g.op("Unsqueeze", &[items, &axes1], vec![]);
    let same = g.op("Equal", &[&column, &row], vec![]);
    let repeated = g.op("And", &[&same, &earlier], vec![]);
    let repeated = g.cast_to_compute(&repeated);
    let repeated = g.op(
        "ReduceMax",
        &[&repeated],
        vec![("axes", Attr::Ints(vec![2])), ("keepdims", Attr::Int(0))],
    );
    let repeated = g.op(
        "Cast",
        &[&repeated],
        vec![("to", Attr::Int(DataType::BOOL as i64))],
    );
    g.op("Not", &[&repeated], vec![])
}

pub(crate) fn vaecf(
    g: &mut GraphBuilder,
    c: &VaeCfConfig,
    w: &Weights,
    scales: &ActivationScales,
    dedup: crate::Dedup,
) -> Result<ModelGraph> {
    let n = c.n_items;
    let items = "items";
    let (encoder, decoder) = layer_shapes(c);

    // The first layer is a gather-sum, as in the engine: the rows of the history's distinct items
    // of the by-item weight ([N+1, hidden_0] = W^T), summed, divided by the multi-hot's L2 norm
    // sqrt(count). Its cost is the history's, not the catalogue's, and the int8 table's per-row
    // DequantizeLinear feeds the Gather directly.
    let (first_prefix, first_shape) = &encoder[0];
    let first = w.matrix(FIRST_LAYER_BY_ITEM, [first_shape[1], first_shape[0]])?;
    let first = g.weight(FIRST_LAYER_BY_ITEM, &first);
    let rows = g.op("Gather", &[&first, items], vec![("axis", Attr::Int(0))]);

    let zero = g.scalar_i64("zero", 0);
    let one = g.scalar_i64("one", 1);
    let is_pad = g.op("Equal", &[items, &zero], vec![]);
    let real = g.op("Not", &[&is_pad], vec![]);
    let shape = g.op("Shape", &[items], vec![]);
    let slots = g.op("Gather", &[&shape, &one], vec![("axis", Attr::Int(0))]);
    let positions = g.op("Range", &[&zero, &slots, &one], vec![]);
    let scatter = match dedup {
        crate::Dedup::Auto => n < DEDUP_BY_SCATTER_MAX_ITEMS,
        crate::Dedup::Scatter => true,
        crate::Dedup::Pairs => false,
    };
    let fresh = if scatter {
        first_of_each_item_by_scatter(g, items, &positions, n)
    } else {
        first_of_each_item_by_pairs(g, items, &positions)
    };
    let keep = g.op("And", &[&real, &fresh], vec![]);
    let (axes1, axes2) = (g.init_i64("axes", &[1]), g.init_i64("axes", &[2]));

    let weight = g.cast_to_compute(&keep);
    let weight = g.op("Unsqueeze", &[&weight, &axes2], vec![]);
    let weighted = g.op("Mul", &[&rows, &weight], vec![]);
    let sum = g.op(
        "ReduceSum",
        &[&weighted, &axes1],
        vec![("keepdims", Attr::Int(0))],
    );
    // F.normalize: x / max(||x||_2, 1e-12), in fp32 whatever the compute type.
    let keep32 = g.op(
        "Cast",
        &[&keep],
        vec![("to", Attr::Int(DataType::FLOAT as i64))],
    );
    let count = g.op_in(
        FP32_NORMALIZE_PREFIX,
        "ReduceSum",
        &[&keep32, &axes1],
        vec![("keepdims", Attr::Int(1))],
    );
    let norm = g.op_in(FP32_NORMALIZE_PREFIX, "Sqrt", &[&count], vec![]);
    let floor = g.scalar_f32("norm_floor", 1e-12);
    let norm = g.op_in(FP32_NORMALIZE_PREFIX, "Max", &[&norm, &floor], vec![]);
    let float = g.float;
    let norm = g.cast(&norm, DataType::FLOAT, float);
    let x = g.op("Div", &[&sum, &norm], vec![]);
    let first_bias = w.tensor(&format!("{first_prefix}.bias"), &first_shape[..1])?;
    let first_bias = g.init_float(
        &format!("{first_prefix}.bias"),
        &first_shape[..1],
        first_bias.as_slice(),
    );
    let x = g.op("Add", &[&x, &first_bias], vec![]);
    let mut x = g.op("Tanh", &[&x], vec![]);

    let n_rest = encoder.len() - 1;
    for (i, (prefix, shape)) in encoder[1..].iter().enumerate() {
        let mut weight = w.matrix(&format!("{prefix}.weight"), *shape)?;
        let mut bias = w.tensor(&format!("{prefix}.bias"), &shape[..1])?;
        if i + 1 == n_rest {
            // mu is the first half of the last encoder layer; logvar is unused at inference.
            weight = weight.slice_rows(0, c.latent_size);
            bias = bias.rows(0, c.latent_size);
        }
        x = g.linear(&x, prefix, &weight, &bias, scales.dense(prefix));
        if i + 1 < n_rest {
            x = g.op("Tanh", &[&x], vec![]);
        }
    }
    let (out_prefix, out_shape) = decoder.last().expect("decoder has an output layer");
    for (prefix, shape) in &decoder[..decoder.len() - 1] {
        let weight = w.matrix(&format!("{prefix}.weight"), *shape)?;
        let bias = w.tensor(&format!("{prefix}.bias"), &shape[..1])?;
        x = g.linear(&x, prefix, &weight, &bias, scales.dense(prefix));
        x = g.op("Tanh", &[&x], vec![]);
    }
    let out_w = w.matrix(&format!("{out_prefix}.weight"), *out_shape)?;
    let out_w = g.weight(&format!("{out_prefix}.weight"), &out_w);
    let bias = output_bias(g, w, &format!("{out_prefix}.bias"), n + 1, n + 1)?;

    let inputs = vec![value_info(
        items,
        DataType::INT64,
        &[None, None],
        &["batch", "history_slots"],
        &format!(
            "internal item indices (1..={n}) of the history, any order, right-padded with 0; \
             duplicates count once"
        ),
    )];
    Ok(ModelGraph {
        inputs,
        hidden: x,
        hidden_size: out_shape[1],
        out_weight: out_w,
        out_bias: bias,
        out_rows: n + 1,
        n_outputs: n + 1,
    })
}
