//! The TensorRT 10 rules an ONNX graph can be checked against without TensorRT: what its ONNX
//! parser accepts and what its explicit-quantization and strongly-typed builders need to turn the
//! graph into INT8 and FP16 kernels. Every export runs through [`check`], so a graph that breaks
//! one fails at export time, not when a user builds it with `trtexec`.
//!
//! Where each rule comes from (TensorRT 10.x documentation):
//! - onnx-tensorrt's operator support matrix (`docs/operators.md`): the parser takes opsets 9 to
//!   20; TopK's `K`, Slice's `starts`/`ends`/`axes`/`steps` and Squeeze/Unsqueeze's `axes` must be
//!   initializers (constants); QuantizeLinear's and DequantizeLinear's zero points must be zero.
//!   The operator list below is the matrix's, restricted to what exports contain.
//! - The developer guide, "Working with Quantized Types" (explicit quantization): scales are
//!   positive and finite; activations are quantized per tensor (a scalar scale), weights may be
//!   quantized per channel, along the output-channel axis, and their DequantizeLinear must feed
//!   the consuming layer (MatMul, Gemm, Gather) directly so the Q/DQ fusion builds an INT8 kernel;
//!   an activation QuantizeLinear is followed by its DequantizeLinear.
//! - `NvInfer.h`, `ITopKLayer`: K is at most 3840 (`crate::TENSORRT_MAX_TOPK`).
//! - The developer guide, "Strongly Typed Networks": layers compute in their inputs' types, so an
//!   FP16 graph runs an operation in FP32 exactly where the graph casts to FP32; recsys keeps only
//!   LayerNormalization, Softmax and the L2 normalisation there (the accuracy-sensitive
//!   reductions the guide names), plus HSTU's time-gap buckets (a logarithm of gaps that do not
//!   fit FP16), and every other computation FP16.

use std::collections::{HashMap, HashSet};

use onnx_protobuf as pb;
use pb::tensor_proto::DataType;

use crate::graph::{FP32_NORMALIZE_PREFIX, FP32_TIME_BUCKET_PREFIX};
use crate::TENSORRT_MAX_TOPK;

/// The opsets TensorRT 10's ONNX parser supports.
pub const SUPPORTED_OPSETS: std::ops::RangeInclusive<i64> = 9..=20;

/// Operators of the support matrix that exports use (all supported by TensorRT 10's parser).
const SUPPORTED_OPS: &[&str] = &[
    "Abs",
    "Add",
    "And",
    "Cast",
    "Concat",
    "ConstantOfShape",
    "DequantizeLinear",
    "Div",
    "Equal",
    "Erf",
    "Floor",
    "Gather",
    "GatherElements",
    "Gemm",
    "GRU",
    "Identity",
    "LayerNormalization",
    "Less",
    "Log",
    "MatMul",
    "Max",
    "Min",
    "Mul",
    "Not",
    "Or",
    "QuantizeLinear",
    "Range",
    "ReduceMax",
    "ReduceSum",
    "Reshape",
    "ScatterElements",
    "Shape",
    "Sigmoid",
    "Slice",
    "Softmax",
    "Sqrt",
    "Squeeze",
    "Sub",
    "Tanh",
    "TopK",
    "Transpose",
    "Unsqueeze",
    "Where",
];

/// Operations that compute on floating-point values (what "compute in FP32" means).
const FLOAT_COMPUTE_OPS: &[&str] = &[
    "Abs",
    "Add",
    "Div",
    "Erf",
    "Floor",
    "Gemm",
    "GRU",
    "LayerNormalization",
    "Log",
    "MatMul",
    "Max",
    "Min",
    "Mul",
    "ReduceMax",
    "ReduceSum",
    "Sigmoid",
    "Softmax",
    "Sqrt",
    "Sub",
    "Tanh",
];

/// Operations an FP16 graph may run in FP32: the normalisations. Nodes named under
/// [`FP32_NORMALIZE_PREFIX`] may compute these parts of an L2 normalisation, and nodes named
/// under [`FP32_TIME_BUCKET_PREFIX`] these parts of HSTU's time-gap buckets (gaps of years do not
/// fit FP16).
const FP32_IN_FP16_GRAPH: &[&str] = &["LayerNormalization", "Softmax"];
const FP32_NORMALIZE_OPS: &[&str] = &["Mul", "ReduceSum", "Sqrt", "Max", "Div"];
const FP32_TIME_BUCKET_OPS: &[&str] = &["Abs", "Max", "Log", "Div", "Floor", "Min"];

/// Every rule the graph breaks, one message each; empty when it passes.
pub fn check(model: &pb::ModelProto) -> Vec<String> {
    let mut out = Vec::new();
    for opset in &model.opset_import {
        if opset.domain.is_empty() && !SUPPORTED_OPSETS.contains(&opset.version) {
            out.push(format!(
                "opset {} is outside the {}..={} TensorRT 10's parser takes",
                opset.version,
                SUPPORTED_OPSETS.start(),
                SUPPORTED_OPSETS.end()
            ));
        }
    }
    let Some(graph) = model.graph.as_ref() else {
        out.push("the model has no graph".into());
        return out;
    };
    let initializers: HashMap<&str, &pb::TensorProto> = graph
        .initializer
        .iter()
        .map(|t| (t.name.as_str(), t))
        .collect();
    let types = infer_types(graph);
    let mut consumers: HashMap<&str, Vec<(&pb::NodeProto, usize)>> = HashMap::new();
    for node in &graph.node {
        for (slot, input) in node.input.iter().enumerate() {
            consumers
                .entry(input.as_str())
                .or_default()
                .push((node, slot));
        }
    }
    let producer: HashMap<&str, &pb::NodeProto> = graph
        .node
        .iter()
        .flat_map(|n| n.output.iter().map(move |o| (o.as_str(), n)))
        .collect();
    let fp16_graph = graph.node.iter().any(|n| {
        FLOAT_COMPUTE_OPS.contains(&n.op_type.as_str())
            && n.output
                .first()
                .and_then(|o| types.get(o.as_str()))
                .is_some_and(|&t| t == DataType::FLOAT16)
    });

    for node in &graph.node {
        let op = node.op_type.as_str();
        let label = format!("{op} {:?}", node.name);
        if !node.domain.is_empty() || !SUPPORTED_OPS.contains(&op) {
            out.push(format!(
                "{label}: not an operator of TensorRT 10's ONNX support matrix"
            ));
        }
        let input = |i: usize| node.input.get(i).map(String::as_str).unwrap_or("");
        let constant = |i: usize| initializers.contains_key(input(i));
        match op {
            "QuantizeLinear" | "DequantizeLinear" => {
                check_qdq(node, &label, &initializers, &consumers, &producer, &mut out);
            }
            "TopK" => match initializers.get(input(1)) {
                Some(k) => match int64_values(k).as_deref() {
                    Some(&[k]) if (1..=TENSORRT_MAX_TOPK as i64).contains(&k) => {}
                    other => out.push(format!(
                        "{label}: K must be one value in 1..={TENSORRT_MAX_TOPK}, found {other:?}"
                    )),
                },
                None => out.push(format!("{label}: K must be an initializer")),
            },
            "Slice" => {
                for (i, what) in [(1, "starts"), (2, "ends"), (3, "axes"), (4, "steps")] {
                    if i < node.input.len() && !input(i).is_empty() && !constant(i) {
                        out.push(format!("{label}: {what} must be an initializer"));
                    }
                }
                if node.input.len() < 4 {
                    out.push(format!(
                        "{label}: axes must be given (as an initializer), not implied"
                    ));
                }
            }
            "Squeeze" | "Unsqueeze" | "ReduceSum" if node.input.len() > 1 && !constant(1) => {
                out.push(format!("{label}: axes must be an initializer"));
            }
            _ => {}
        }
        if fp16_graph && FLOAT_COMPUTE_OPS.contains(&op) {
            let output_type = node.output.first().and_then(|o| types.get(o.as_str()));
            let allowed = FP32_IN_FP16_GRAPH.contains(&op)
                || (node.name.starts_with(FP32_NORMALIZE_PREFIX)
                    && FP32_NORMALIZE_OPS.contains(&op))
                || (node.name.starts_with(FP32_TIME_BUCKET_PREFIX)
                    && FP32_TIME_BUCKET_OPS.contains(&op));
            if output_type == Some(&DataType::FLOAT) && !allowed {
                out.push(format!(
                    "{label}: computes in FP32 in an FP16 graph (only LayerNormalization, Softmax \
                     and the L2 normalisation may)"
                ));
            }
        }
    }
    out
}

/// The Q/DQ rules for one QuantizeLinear or DequantizeLinear node.
fn check_qdq(
    node: &pb::NodeProto,
    label: &str,
    initializers: &HashMap<&str, &pb::TensorProto>,
    consumers: &HashMap<&str, Vec<(&pb::NodeProto, usize)>>,
    producer: &HashMap<&str, &pb::NodeProto>,
    out: &mut Vec<String>,
) {
    let input = |i: usize| node.input.get(i).map(String::as_str).unwrap_or("");
    let Some(scale) = initializers.get(input(1)) else {
        out.push(format!("{label}: the scale must be an initializer"));
        return;
    };
    match float_values(scale) {
        Some(values) if values.iter().all(|s| s.is_finite() && *s > 0.0) => {}
        Some(values) => {
            let bad = values.iter().find(|s| !(s.is_finite() && **s > 0.0));
            out.push(format!(
                "{label}: scales must be positive and finite, found {bad:?}"
            ));
        }
        None => out.push(format!("{label}: the scale must be float")),
    }
    match initializers.get(input(2)) {
        Some(zp) if zp.data_type != DataType::INT8 as i32 => out.push(format!(
            "{label}: the zero point must be INT8 (symmetric int8)"
        )),
        Some(zp)
            if zp.raw_data.iter().any(|&b| b != 0) || zp.int32_data.iter().any(|&v| v != 0) =>
        {
            out.push(format!("{label}: the zero point must be zero"))
        }
        Some(_) => {}
        None => out.push(format!(
            "{label}: the zero point must be an INT8 initializer of zeros (absent means UINT8)"
        )),
    }
    let per_axis = !scale.dims.is_empty() && scale.dims.iter().product::<i64>() > 1;
    let weight = initializers.get(input(0));
    let axis = attr_int(node, "axis").unwrap_or(1);
    let output = node.output.first().map(String::as_str).unwrap_or("");
    let users = consumers.get(output).map(Vec::as_slice).unwrap_or(&[]);
    match (node.op_type.as_str(), weight) {
        ("QuantizeLinear", _) => {
            if per_axis {
                out.push(format!(
                    "{label}: activations are quantized per tensor (a scalar scale)"
                ));
            }
            if users.is_empty() || users.iter().any(|(n, _)| n.op_type != "DequantizeLinear") {
                out.push(format!(
                    "{label}: an activation QuantizeLinear must feed its DequantizeLinear"
                ));
            }
        }
        (_, None) => {
            if per_axis {
                out.push(format!(
                    "{label}: per-axis scales apply to weights (initializers) only"
                ));
            }
            if producer
                .get(input(0))
                .is_none_or(|p| p.op_type != "QuantizeLinear")
            {
                out.push(format!(
                    "{label}: an activation DequantizeLinear must read a QuantizeLinear"
                ));
            }
        }
        (_, Some(w)) => {
            let rank = w.dims.len() as i64;
            let axis = if axis < 0 { axis + rank } else { axis };
            if per_axis && w.dims.get(axis as usize) != scale.dims.first() {
                out.push(format!(
                    "{label}: {} scales for axis {axis} of a {:?} weight",
                    scale.dims.first().copied().unwrap_or(0),
                    w.dims
                ));
            }
            if users.is_empty() {
                out.push(format!("{label}: the dequantized weight is unused"));
            }
            for (user, slot) in users {
                let ok = match (user.op_type.as_str(), slot) {
                    // x @ B with B = [K, N]: output channels are B's last axis.
                    ("MatMul", 1) => !per_axis || axis == rank - 1,
                    // transB: B = [N, K], output channels along axis 0.
                    ("Gemm", 1) => {
                        let trans_b = attr_int(user, "transB").unwrap_or(0) == 1;
                        !per_axis || axis == if trans_b { 0 } else { 1 }
                    }
                    // A lookup table: rows are what is gathered.
                    ("Gather", 0) => attr_int(user, "axis").unwrap_or(0) == 0 && axis == 0,
                    _ => false,
                };
                if !ok {
                    out.push(format!(
                        "{label}: a weight DequantizeLinear must feed a MatMul or Gemm weight \
                         (scales along its output channels) or a Gather table directly, found \
                         {} {:?} input {slot}",
                        user.op_type, user.name
                    ));
                }
            }
        }
    }
}

fn attr_int(node: &pb::NodeProto, name: &str) -> Option<i64> {
    node.attribute.iter().find(|a| a.name == name).map(|a| a.i)
}

fn float_values(t: &pb::TensorProto) -> Option<Vec<f32>> {
    if t.data_type != DataType::FLOAT as i32 {
        return None;
    }
    if !t.raw_data.is_empty() {
        return Some(
            t.raw_data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect(),
        );
    }
    Some(t.float_data.clone())
}

fn int64_values(t: &pb::TensorProto) -> Option<Vec<i64>> {
    if t.data_type != DataType::INT64 as i32 {
        return None;
    }
    if !t.raw_data.is_empty() {
        return Some(
            t.raw_data
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect(),
        );
    }
    Some(t.int64_data.clone())
}

/// The element type of every tensor the graph names, propagated through the operators exports
/// use (enough for the FP16 rule; unknown operators leave their outputs untyped).
fn infer_types(graph: &pb::GraphProto) -> HashMap<&str, DataType> {
    let mut types: HashMap<&str, DataType> = HashMap::new();
    let known = |t: i32| protobuf::Enum::from_i32(t);
    for t in &graph.initializer {
        if let Some(dt) = known(t.data_type) {
            types.insert(t.name.as_str(), dt);
        }
    }
    for vi in &graph.input {
        if let Some(dt) = known(vi.type_.tensor_type().elem_type) {
            types.insert(vi.name.as_str(), dt);
        }
    }
    let bool_ops: HashSet<&str> = ["Equal", "Less", "Not", "And"].into();
    for node in &graph.node {
        let input_type = |i: usize| {
            node.input
                .get(i)
                .and_then(|name| types.get(name.as_str()).copied())
        };
        let first = match node.op_type.as_str() {
            "Cast" => attr_int(node, "to").and_then(|t| known(t as i32)),
            "Shape" => Some(DataType::INT64),
            op if bool_ops.contains(op) => Some(DataType::BOOL),
            "ConstantOfShape" => node
                .attribute
                .iter()
                .find(|a| a.name == "value")
                .map_or(Some(DataType::FLOAT), |a| known(a.t.data_type)),
            "QuantizeLinear" => input_type(2).or(Some(DataType::UINT8)),
            "DequantizeLinear" => input_type(1),
            "Where" => input_type(1),
            _ => input_type(0),
        };
        if let (Some(out), Some(dt)) = (node.output.first(), first) {
            types.insert(out.as_str(), dt);
        }
        if node.op_type == "TopK" {
            if let Some(indices) = node.output.get(1) {
                types.insert(indices.as_str(), DataType::INT64);
            }
        }
    }
    types
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{tensor_proto, value_info, Attr, GraphBuilder};

    fn model(g: GraphBuilder, inputs: Vec<pb::ValueInfoProto>) -> pb::ModelProto {
        pb::ModelProto {
            opset_import: vec![pb::OperatorSetIdProto {
                domain: String::new(),
                version: 17,
                ..Default::default()
            }],
            graph: protobuf::MessageField::some(pb::GraphProto {
                node: g.nodes,
                initializer: g.initializers,
                input: inputs,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn x_input(dtype: DataType) -> Vec<pb::ValueInfoProto> {
        vec![value_info("x", dtype, &[None, Some(2)], &["batch"], "")]
    }

    fn int8_weight(g: &mut GraphBuilder, scales: &[f32], zero_point: u8) -> String {
        g.initializers.push(tensor_proto(
            "w_int8",
            DataType::INT8,
            &[2, 2],
            vec![1, 2, 3, 4],
        ));
        g.init_f32("w_scale", &[scales.len()], scales);
        g.initializers.push(tensor_proto(
            "w_zp",
            DataType::INT8,
            &[scales.len()],
            vec![zero_point; scales.len()],
        ));
        g.op(
            "DequantizeLinear",
            &["w_int8", "w_scale", "w_zp"],
            vec![("axis", Attr::Int(1))],
        )
    }

    #[test]
    fn a_weight_dequantize_feeding_its_matmul_directly_passes() {
        let mut g = GraphBuilder::default();
        let w = int8_weight(&mut g, &[0.5, 0.25], 0);
        let q = g.fake_quantize("x", "x", 0.1);
        g.op("MatMul", &[&q, &w], vec![]);
        let violations = check(&model(g, x_input(DataType::FLOAT)));
        assert!(violations.is_empty(), "{violations:?}");
    }

    #[test]
    fn a_transpose_between_dequantize_and_matmul_is_refused() {
        let mut g = GraphBuilder::default();
        let w = int8_weight(&mut g, &[0.5, 0.25], 0);
        let t = g.op("Transpose", &[&w], vec![("perm", Attr::Ints(vec![1, 0]))]);
        g.op("MatMul", &["x", &t], vec![]);
        let violations = check(&model(g, x_input(DataType::FLOAT)));
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert!(
            violations[0].contains("must feed a MatMul"),
            "{violations:?}"
        );
    }

    #[test]
    fn zero_scales_nonzero_zero_points_and_per_axis_activations_are_refused() {
        let mut g = GraphBuilder::default();
        let w = int8_weight(&mut g, &[0.0, 0.25], 3);
        g.op("MatMul", &["x", &w], vec![]);
        // A per-axis activation scale.
        g.init_f32("act_scale", &[2], &[0.1, 0.2]);
        g.initializers
            .push(tensor_proto("act_zp", DataType::INT8, &[2], vec![0, 0]));
        let q = g.op(
            "QuantizeLinear",
            &["x", "act_scale", "act_zp"],
            vec![("axis", Attr::Int(1))],
        );
        g.op("DequantizeLinear", &[&q, "act_scale", "act_zp"], vec![]);
        let violations = check(&model(g, x_input(DataType::FLOAT))).join("\n");
        assert!(violations.contains("positive"), "{violations}");
        assert!(
            violations.contains("zero point must be zero"),
            "{violations}"
        );
        assert!(violations.contains("per tensor"), "{violations}");
        assert!(
            violations.contains("weights (initializers) only"),
            "{violations}"
        );
    }

    #[test]
    fn per_axis_scales_must_follow_the_output_channels() {
        let mut g = GraphBuilder::default();
        g.initializers.push(tensor_proto(
            "w_int8",
            DataType::INT8,
            &[2, 2],
            vec![1, 2, 3, 4],
        ));
        g.init_f32("w_scale", &[2], &[0.5, 0.25]);
        g.initializers
            .push(tensor_proto("w_zp", DataType::INT8, &[2], vec![0, 0]));
        // Axis 0 of a MatMul weight [K, N] is the reduction axis.
        let w = g.op(
            "DequantizeLinear",
            &["w_int8", "w_scale", "w_zp"],
            vec![("axis", Attr::Int(0))],
        );
        g.op("MatMul", &["x", &w], vec![]);
        let violations = check(&model(g, x_input(DataType::FLOAT)));
        assert_eq!(violations.len(), 1, "{violations:?}");
    }

    #[test]
    fn topk_above_tensorrts_limit_or_from_a_tensor_is_refused() {
        let mut g = GraphBuilder::default();
        let big = g.init_i64("k", &[TENSORRT_MAX_TOPK as i64 + 1]);
        g.node_with_outputs(
            "TopK",
            &["x", &big],
            &["s", "i"],
            vec![("axis", Attr::Int(1))],
        );
        g.node_with_outputs("TopK", &["x", "x"], &["s2", "i2"], vec![]);
        let violations = check(&model(g, x_input(DataType::FLOAT))).join("\n");
        assert!(violations.contains("1..=3840"), "{violations}");
        assert!(
            violations.contains("K must be an initializer"),
            "{violations}"
        );
    }

    #[test]
    fn fp16_graphs_compute_fp32_only_in_the_normalisations() {
        let mut g = GraphBuilder::new(DataType::FLOAT16);
        let w = g.init_float("w", &[2, 2], &[1.0, 2.0, 3.0, 4.0]);
        let y = g.op("MatMul", &["x", &w], vec![]);
        let gamma = recsys_engine::tensor::Tensor::from_vec(vec![2], vec![1.0, 1.0]);
        let beta = recsys_engine::tensor::Tensor::from_vec(vec![2], vec![0.0, 0.0]);
        let y = g.layer_norm(&y, "ln", &gamma, &beta, 1e-12);
        let y = g.softmax(&y);
        let clean = check(&model(g, x_input(DataType::FLOAT16)));
        assert!(clean.is_empty(), "{clean:?}");

        // The same MatMul fed a float cast of x computes in FP32.
        let mut g = GraphBuilder::new(DataType::FLOAT16);
        let w = g.init_float("w", &[2, 2], &[1.0, 2.0, 3.0, 4.0]);
        let h = g.op("MatMul", &["x", &w], vec![]);
        let h32 = g.cast(&h, DataType::FLOAT16, DataType::FLOAT);
        let w32 = g.init_f32("w32", &[2, 2], &[1.0, 2.0, 3.0, 4.0]);
        g.op("MatMul", &[&h32, &w32], vec![]);
        let _ = y;
        let violations = check(&model(g, x_input(DataType::FLOAT16)));
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert!(
            violations[0].contains("FP32 in an FP16 graph"),
            "{violations:?}"
        );
    }

    #[test]
    fn opsets_beyond_the_parser_and_unknown_operators_are_refused() {
        let mut g = GraphBuilder::default();
        g.op("NonZero", &["x"], vec![]);
        let mut m = model(g, x_input(DataType::FLOAT));
        m.opset_import[0].version = 23;
        let violations = check(&m).join("\n");
        assert!(violations.contains("opset 23"), "{violations}");
        assert!(violations.contains("support matrix"), "{violations}");
    }
}
