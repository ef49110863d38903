//! HSTU as an ONNX graph, computing what the engine computes: the official eval-mode forward over
//! a right-padded window of items and their timestamps, the user embedding at the last item's
//! position divided by its norm, and the normalised item table as the output layer.
//!
//! Inputs: `item_seq` `[B, L]` (internal indices, oldest first, right-padded with 0) and
//! `timestamps` `[B, L + 1]` (each item's unix time in seconds, then the query time right after
//! the last item, as the official batch lays them out; the rest is ignored). Row `i`'s relative
//! bias reads the time of the event after it, `timestamps[i + 1]`, so the last item's row reads
//! the query time.
//!
//! The time-gap buckets are computed in fp32 in every graph (an FP16 graph included, in nodes
//! named under [`FP32_TIME_BUCKET_PREFIX`]): gaps of years do not fit FP16, and the bucket is
//! `trunc(ln(max(|dt|, 1)) / 0.301)` in f32, as the official code and the engine compute it.

use onnx_protobuf as pb;
use pb::tensor_proto::DataType;
use recsys_engine::config::HstuConfig;
use recsys_engine::models::hstu::names;
use recsys_engine::weights::Weights;

use crate::graph::{
    value_info, Attr, GraphBuilder, FP32_NORMALIZE_PREFIX, FP32_TIME_BUCKET_PREFIX,
};
use crate::models::{ActivationScales, ModelGraph};
use crate::Result;

/// The relative bias of every (query row, key row) pair within the window, `[B, L, L]` in the
/// compute type: the block's weight for the position offset plus its weight for the time gap's
/// bucket (`position_index` and `buckets` are shared by the blocks).
fn relative_bias(
    g: &mut GraphBuilder,
    block: usize,
    w: &Weights,
    c: &HstuConfig,
    position_index: &str,
    buckets: &str,
) -> Result<String> {
    let na = c.attention_width;
    let positions = w.tensor(&names::position_bias(block), &[2 * na - 1])?;
    let positions = g.init_float(
        &names::position_bias(block),
        &[2 * na - 1],
        positions.as_slice(),
    );
    let times = w.tensor(&names::time_bias(block), &[c.time_buckets + 1])?;
    let times = g.init_float(
        &names::time_bias(block),
        &[c.time_buckets + 1],
        times.as_slice(),
    );
    let by_position = g.op(
        "Gather",
        &[&positions, position_index],
        vec![("axis", Attr::Int(0))],
    );
    let by_time = g.op("Gather", &[&times, buckets], vec![("axis", Attr::Int(0))]);
    Ok(g.op("Add", &[&by_time, &by_position], vec![]))
}

/// The bucket of every (query row, key row) pair's time gap, `[B, L, L]` int64: row `i` against
/// key `j` reads `t_{i+1} - t_j`.
fn time_buckets(g: &mut GraphBuilder, timestamps: &str, c: &HstuConfig) -> String {
    let l = c.max_len as i64;
    let axes1 = g.init_i64("axes", &[1]);
    let axes2 = g.init_i64("axes", &[2]);
    let (s1, e1) = (g.init_i64("starts", &[1]), g.init_i64("ends", &[l + 1]));
    let next = g.op("Slice", &[timestamps, &s1, &e1, &axes1], vec![]);
    let (s0, e0) = (g.init_i64("starts", &[0]), g.init_i64("ends", &[l]));
    let own = g.op("Slice", &[timestamps, &s0, &e0, &axes1], vec![]);
    let next = g.op("Unsqueeze", &[&next, &axes2], vec![]);
    let own = g.op("Unsqueeze", &[&own, &axes1], vec![]);
    let gap = g.op("Sub", &[&next, &own], vec![]);
    let p = FP32_TIME_BUCKET_PREFIX;
    // |dt| as f32: the cast rounds symmetrically, so this is the engine's `|dt| as f32`.
    let gap = g.op_in(
        p,
        "Cast",
        &[&gap],
        vec![("to", Attr::Int(DataType::FLOAT as i64))],
    );
    let gap = g.op_in(p, "Abs", &[&gap], vec![]);
    let one = g.scalar_f32("one_second", 1.0);
    let gap = g.op_in(p, "Max", &[&gap, &one], vec![]);
    let log = g.op_in(p, "Log", &[&gap], vec![]);
    let step = g.scalar_f32("log_bucket_width", 0.301);
    let bucket = g.op_in(p, "Div", &[&log, &step], vec![]);
    // ln(max(|dt|, 1)) >= 0: Floor is the official trunc.
    let bucket = g.op_in(p, "Floor", &[&bucket], vec![]);
    let last = g.scalar_f32("last_bucket", c.time_buckets as f32);
    let bucket = g.op_in(p, "Min", &[&bucket, &last], vec![]);
    g.op_in(
        p,
        "Cast",
        &[&bucket],
        vec![("to", Attr::Int(DataType::INT64 as i64))],
    )
}

/// LayerNorm without affine parameters over the last axis, `width` wide.
fn normalise(g: &mut GraphBuilder, x: &str, name: &str, width: usize) -> String {
    let ones = recsys_engine::tensor::Tensor::from_vec(vec![width], vec![1.0; width]);
    let zeros = recsys_engine::tensor::Tensor::from_vec(vec![width], vec![0.0; width]);
    g.layer_norm(x, name, &ones, &zeros, HstuConfig::EPS)
}

fn silu(g: &mut GraphBuilder, x: &str) -> String {
    let gate = g.op("Sigmoid", &[x], vec![]);
    g.op("Mul", &[x, &gate], vec![])
}

/// Columns `from..to` of the last axis.
fn columns(g: &mut GraphBuilder, x: &str, from: usize, to: usize) -> String {
    let starts = g.init_i64("starts", &[from as i64]);
    let ends = g.init_i64("ends", &[to as i64]);
    let axes = g.init_i64("axes", &[-1]);
    g.op("Slice", &[x, &starts, &ends, &axes], vec![])
}

/// `[B, rows, heads x width]` as `[B, heads, rows, width]` (or `[B, heads, width, rows]` when
/// `keys`, ready to multiply queries with).
fn split_heads(g: &mut GraphBuilder, x: &str, heads: usize, width: usize, keys: bool) -> String {
    let shape = g.init_i64("split_heads", &[0, 0, heads as i64, width as i64]);
    let x = g.op("Reshape", &[x, &shape], vec![]);
    let perm = if keys {
        vec![0, 2, 3, 1]
    } else {
        vec![0, 2, 1, 3]
    };
    g.op("Transpose", &[&x], vec![("perm", Attr::Ints(perm))])
}

pub(crate) fn hstu(
    g: &mut GraphBuilder,
    c: &HstuConfig,
    w: &Weights,
    scales: &ActivationScales,
) -> Result<ModelGraph> {
    let (n, d, l, na) = (c.n_items, c.embedding_dim, c.max_len, c.attention_width);
    let (heads, dqk, dv) = (c.num_heads, c.dqk, c.dv);
    let values = heads * dv;
    let seq = "item_seq";
    let timestamps = "timestamps";

    // e_p = item_emb[x_p] * sqrt(D) + pos_emb[p].
    let input_rows = w.matrix(names::INPUT_ROWS, [n + 1, d])?;
    let input_rows = g.weight(names::INPUT_ROWS, &input_rows);
    let tokens = g.op("Gather", &[&input_rows, seq], vec![("axis", Attr::Int(0))]);
    let sqrt_d = g.scalar_float("sqrt_embedding_dim", (d as f32).sqrt());
    let tokens = g.op("Mul", &[&tokens, &sqrt_d], vec![]);
    let positions = w.tensor(names::POSITIONS, &[na, d])?;
    let positions = g.init_float(names::POSITIONS, &[l, d], &positions.as_slice()[..l * d]);
    let mut x = g.op("Add", &[&tokens, &positions], vec![]);

    // Shared by the blocks: the position offset's index (NA - 1 + j - i, valid for every pair),
    // the time buckets, and the masks.
    let offsets: Vec<i64> = (0..l * l)
        .map(|at| (na - 1 + at % l) as i64 - (at / l) as i64)
        .collect();
    let position_index = g.init_i64("position_offset_index", &offsets);
    let shape = g.init_i64("square", &[l as i64, l as i64]);
    let position_index = g.op("Reshape", &[&position_index, &shape], vec![]);
    let buckets = time_buckets(g, timestamps, c);
    // Causal (j <= i), [1, 1, L, L]: the blocks before the last compute every row.
    let causal: Vec<i64> = (0..l * l).map(|at| i64::from(at % l <= at / l)).collect();
    let causal = g.init_i64("causal", &causal);
    let shape4 = g.init_i64("square4", &[1, 1, l as i64, l as i64]);
    let causal = g.op("Reshape", &[&causal, &shape4], vec![]);
    let causal = g.op(
        "Cast",
        &[&causal],
        vec![("to", Attr::Int(DataType::BOOL as i64))],
    );
    // The last block computes the answer row alone, against the history's items: [B, 1, 1, L].
    let zero = g.scalar_i64("pad_index", 0);
    let is_pad = g.op("Equal", &[seq, &zero], vec![]);
    let is_item = g.op("Not", &[&is_pad], vec![]);
    let axes12 = g.init_i64("axes", &[1, 2]);
    let key_is_item = g.op("Unsqueeze", &[&is_item, &axes12], vec![]);
    let select = crate::models::answer_slot(g, seq, crate::models::Transformer::SasRec, n);
    let divisor = g.scalar_float("attention_width", na as f32);
    let zero_weight = g.scalar_float("zero_weight", 0.0);
    let axes1 = g.init_i64("axes", &[1]);
    let merge_heads = g.init_i64("merge_heads", &[0, 0, values as i64]);

    for b in 0..c.num_blocks {
        let last = b + 1 == c.num_blocks;
        let normed = normalise(g, &x, &format!("blocks.{b}.input_norm"), d);
        let prefix = names::uvqk(b);
        let weight = w.matrix(&format!("{prefix}.weight"), [c.uvqk_width(), d])?;
        let bias = w.tensor(&format!("{prefix}.bias"), &[c.uvqk_width()])?;
        let uvqk = g.linear(&normed, &prefix, &weight, &bias, scales.dense(&prefix));
        let uvqk = silu(g, &uvqk);
        let mut rab = relative_bias(g, b, w, c, &position_index, &buckets)?;
        // The rows whose outputs this block computes: all, or the answer row.
        let (rows, x_q) = if last {
            rab = g.op("MatMul", &[&select, &rab], vec![]);
            (
                g.op("MatMul", &[&select, &uvqk], vec![]),
                g.op("MatMul", &[&select, &x], vec![]),
            )
        } else {
            (uvqk.clone(), x.clone())
        };
        let u = columns(g, &rows, 0, values);
        let q = columns(g, &rows, 2 * values, 2 * values + heads * dqk);
        let v = columns(g, &uvqk, values, 2 * values);
        let k = columns(
            g,
            &uvqk,
            2 * values + heads * dqk,
            2 * values + 2 * heads * dqk,
        );
        let q = split_heads(g, &q, heads, dqk, false);
        let k = split_heads(g, &k, heads, dqk, true);
        let v = split_heads(g, &v, heads, dv, false);
        let scores = g.op("MatMul", &[&q, &k], vec![]);
        let rab = g.op("Unsqueeze", &[&rab, &axes1], vec![]);
        let scores = g.op("Add", &[&scores, &rab], vec![]);
        let weights = silu(g, &scores);
        let weights = g.op("Div", &[&weights, &divisor], vec![]);
        let mask = if last { &key_is_item } else { &causal };
        let weights = g.op("Where", &[mask, &weights, &zero_weight], vec![]);
        let attended = g.op("MatMul", &[&weights, &v], vec![]);
        let attended = g.op(
            "Transpose",
            &[&attended],
            vec![("perm", Attr::Ints(vec![0, 2, 1, 3]))],
        );
        let attended = g.op("Reshape", &[&attended, &merge_heads], vec![]);
        let attended = normalise(g, &attended, &format!("blocks.{b}.attention_norm"), values);
        let gated = g.op("Mul", &[&u, &attended], vec![]);
        let prefix = names::output(b);
        let weight = w.matrix(&format!("{prefix}.weight"), [d, values])?;
        let bias = w.tensor(&format!("{prefix}.bias"), &[d])?;
        let out = g.linear(&gated, &prefix, &weight, &bias, scales.dense(&prefix));
        x = g.op("Add", &[&out, &x_q], vec![]);
    }
    let flat = g.init_i64("rows", &[-1, d as i64]);
    let x = g.op("Reshape", &[&x, &flat], vec![]);
    let hidden = l2_normalise(g, &x);

    let table = w.matrix(names::OUTPUT_ROWS, [n + 1, d])?;
    let table = g.weight(names::OUTPUT_ROWS, &table);
    let bias = crate::models::no_output_bias(g, n + 1);
    let inputs = vec![
        value_info(
            seq,
            DataType::INT64,
            &[None, Some(l)],
            &["batch"],
            &format!(
                "internal item indices (1..={n}): the history's last {l} items oldest first (at \
                 least one), right-padded with 0 to {l} slots"
            ),
        ),
        value_info(
            timestamps,
            DataType::INT64,
            &[None, Some(l + 1)],
            &["batch"],
            "unix seconds: each item's timestamp in item_seq's order, then the query time in the \
             slot after the last item (the rest is ignored)",
        ),
    ];
    Ok(ModelGraph {
        inputs,
        hidden,
        hidden_size: d,
        out_weight: table,
        out_bias: bias,
        out_rows: n + 1,
        n_outputs: n + 1,
    })
}

/// Each row over `max(||row||, 1e-6)`, in fp32 (the official user-embedding normalisation).
fn l2_normalise(g: &mut GraphBuilder, x: &str) -> String {
    let p = FP32_NORMALIZE_PREFIX;
    let float = g.float;
    let x32 = g.cast(x, float, DataType::FLOAT);
    let squares = g.op_in(p, "Mul", &[&x32, &x32], vec![]);
    let axes = g.init_i64("axes", &[-1]);
    let sum = g.op_in(
        p,
        "ReduceSum",
        &[&squares, &axes],
        vec![("keepdims", Attr::Int(1))],
    );
    let norm = g.op_in(p, "Sqrt", &[&sum], vec![]);
    let floor = g.scalar_f32("l2_norm_floor", HstuConfig::EPS as f32);
    let norm = g.op_in(p, "Max", &[&norm, &floor], vec![]);
    let y = g.op_in(p, "Div", &[&x32, &norm], vec![]);
    g.cast(&y, DataType::FLOAT, float)
}
