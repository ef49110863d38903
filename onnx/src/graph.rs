//! A small builder over the ONNX protobuf types: named initializers, single-output nodes and the
//! few composite layers (linear, LayerNorm, GELU) both models share. Every weight goes through
//! [`GraphBuilder::weight`] or [`GraphBuilder::weight_transposed`], and every float constant
//! through the builder's compute type, so one place decides how a precision is expressed.

use onnx_protobuf as pb;
use pb::tensor_proto::DataType;
use protobuf::{EnumOrUnknown, MessageField};
use recsys_engine::tensor::Tensor;
use recsys_engine::weights::Matrix;
use recsys_kernels::packed::to_f16_bits;

/// Name prefix of the nodes of an L2 normalisation, the one place besides LayerNormalization and
/// Softmax where an fp16 graph computes in fp32 (the rules check allows exactly these).
pub(crate) const FP32_NORMALIZE_PREFIX: &str = "l2_normalize/";
/// Name prefix of the nodes computing HSTU's time-gap buckets, which every graph computes in fp32
/// (a gap of years does not fit FP16; the rules check allows these nodes in an FP16 graph).
pub(crate) const FP32_TIME_BUCKET_PREFIX: &str = "fp32_time_buckets/";

/// An attribute value of a node.
pub(crate) enum Attr {
    Int(i64),
    Ints(Vec<i64>),
    Float(f32),
    Tensor(Box<pb::TensorProto>),
}

pub(crate) struct GraphBuilder {
    pub nodes: Vec<pb::NodeProto>,
    pub initializers: Vec<pb::TensorProto>,
    next_id: usize,
    /// Q/DQ nodes emitted (reported in the export summary).
    pub quantize_nodes: usize,
    pub dequantize_nodes: usize,
    /// The type activations are computed in: FLOAT, or FLOAT16 for fp16 engines (typed end to end
    /// so a strongly typed TensorRT build runs FP16 GEMMs).
    pub float: DataType,
}

impl Default for GraphBuilder {
    fn default() -> Self {
        GraphBuilder::new(DataType::FLOAT)
    }
}

pub(crate) fn tensor_proto(
    name: &str,
    dtype: DataType,
    dims: &[usize],
    raw: Vec<u8>,
) -> pb::TensorProto {
    pb::TensorProto {
        name: name.to_string(),
        data_type: dtype as i32,
        dims: dims.iter().map(|&d| d as i64).collect(),
        raw_data: raw,
        ..Default::default()
    }
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn f16_bytes(values: &[f32]) -> Vec<u8> {
    to_f16_bits(values)
        .iter()
        .flat_map(|b| b.to_le_bytes())
        .collect()
}

fn i64_bytes(values: &[i64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// `[rows, cols]` row-major values as `[cols, rows]`.
fn transpose<T: Copy>(values: &[T], rows: usize, cols: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(values.len());
    for c in 0..cols {
        out.extend((0..rows).map(|r| values[r * cols + c]));
    }
    out
}

impl GraphBuilder {
    pub fn new(float: DataType) -> GraphBuilder {
        GraphBuilder {
            nodes: Vec::new(),
            initializers: Vec::new(),
            next_id: 0,
            quantize_nodes: 0,
            dequantize_nodes: 0,
            float,
        }
    }

    fn fresh(&mut self, hint: &str) -> String {
        self.next_id += 1;
        format!("{hint}_{}", self.next_id)
    }

    /// Values in the compute type's encoding.
    fn float_bytes(&self, values: &[f32]) -> Vec<u8> {
        if self.float == DataType::FLOAT16 {
            f16_bytes(values)
        } else {
            f32_bytes(values)
        }
    }

    /// An fp32 initializer whatever the compute type (LayerNorm parameters, which stay fp32).
    pub fn init_f32(&mut self, name: &str, dims: &[usize], values: &[f32]) -> String {
        debug_assert_eq!(dims.iter().product::<usize>(), values.len());
        self.initializers
            .push(tensor_proto(name, DataType::FLOAT, dims, f32_bytes(values)));
        name.to_string()
    }

    /// An initializer in the compute type (biases, embeddings, constants of the graph's math).
    pub fn init_float(&mut self, name: &str, dims: &[usize], values: &[f32]) -> String {
        debug_assert_eq!(dims.iter().product::<usize>(), values.len());
        let raw = self.float_bytes(values);
        self.initializers
            .push(tensor_proto(name, self.float, dims, raw));
        name.to_string()
    }

    pub fn init_i64(&mut self, hint: &str, values: &[i64]) -> String {
        let name = self.fresh(hint);
        self.initializers.push(tensor_proto(
            &name,
            DataType::INT64,
            &[values.len()],
            i64_bytes(values),
        ));
        name
    }

    /// A scalar constant in the compute type (broadcasts against any tensor).
    pub fn scalar_float(&mut self, hint: &str, value: f32) -> String {
        let name = self.fresh(hint);
        let raw = self.float_bytes(&[value]);
        self.initializers
            .push(tensor_proto(&name, self.float, &[], raw));
        name
    }

    /// A scalar fp32 constant whatever the compute type.
    pub fn scalar_f32(&mut self, hint: &str, value: f32) -> String {
        let name = self.fresh(hint);
        self.initializers.push(tensor_proto(
            &name,
            DataType::FLOAT,
            &[],
            f32_bytes(&[value]),
        ));
        name
    }

    pub fn scalar_i64(&mut self, hint: &str, value: i64) -> String {
        let name = self.fresh(hint);
        self.initializers.push(tensor_proto(
            &name,
            DataType::INT64,
            &[],
            i64_bytes(&[value]),
        ));
        name
    }

    /// Adds a node with named outputs.
    pub fn node_with_outputs(
        &mut self,
        op_type: &str,
        inputs: &[&str],
        outputs: &[&str],
        attrs: Vec<(&str, Attr)>,
    ) {
        let name = self.fresh(&op_type.to_lowercase());
        self.named_node(name, op_type, inputs, outputs, attrs);
    }

    fn named_node(
        &mut self,
        name: String,
        op_type: &str,
        inputs: &[&str],
        outputs: &[&str],
        attrs: Vec<(&str, Attr)>,
    ) {
        if op_type == "QuantizeLinear" {
            self.quantize_nodes += 1;
        } else if op_type == "DequantizeLinear" {
            self.dequantize_nodes += 1;
        }
        let attribute = attrs
            .into_iter()
            .map(|(name, value)| {
                use pb::attribute_proto::AttributeType as T;
                let mut a = pb::AttributeProto {
                    name: name.to_string(),
                    ..Default::default()
                };
                let kind = match value {
                    Attr::Int(i) => {
                        a.i = i;
                        T::INT
                    }
                    Attr::Ints(v) => {
                        a.ints = v;
                        T::INTS
                    }
                    Attr::Float(f) => {
                        a.f = f;
                        T::FLOAT
                    }
                    Attr::Tensor(t) => {
                        a.t = MessageField(Some(t));
                        T::TENSOR
                    }
                };
                a.type_ = EnumOrUnknown::new(kind);
                a
            })
            .collect();
        self.nodes.push(pb::NodeProto {
            name,
            op_type: op_type.to_string(),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: outputs.iter().map(|s| s.to_string()).collect(),
            attribute,
            ..Default::default()
        });
    }

    /// Adds a single-output node; returns the output's name.
    pub fn op(&mut self, op_type: &str, inputs: &[&str], attrs: Vec<(&str, Attr)>) -> String {
        let out = self.fresh(&op_type.to_lowercase());
        self.node_with_outputs(op_type, inputs, &[&out], attrs);
        out
    }

    /// [`GraphBuilder::op`] with the node's name under `prefix` (a group the rules check knows).
    pub fn op_in(
        &mut self,
        prefix: &str,
        op_type: &str,
        inputs: &[&str],
        attrs: Vec<(&str, Attr)>,
    ) -> String {
        let out = self.fresh(&op_type.to_lowercase());
        let name = format!("{prefix}{out}");
        self.named_node(name, op_type, inputs, &[&out], attrs);
        out
    }

    /// `x` cast to `to` (no node when the compute type is already `to`).
    pub fn cast(&mut self, x: &str, from: DataType, to: DataType) -> String {
        if from == to {
            return x.to_string();
        }
        self.op("Cast", &[x], vec![("to", Attr::Int(to as i64))])
    }

    /// A cast to the compute type.
    pub fn cast_to_compute(&mut self, x: &str) -> String {
        let to = self.float;
        self.op("Cast", &[x], vec![("to", Attr::Int(to as i64))])
    }

    /// A weight matrix `[rows, cols]` as a tensor of the compute type, expressed at its stored
    /// precision: fp32, fp16 and bf16 as initializers (cast only where stored and compute types
    /// differ; a bf16 engine's graph computes in fp32 from its BFLOAT16 weights);
    /// int8 as an INT8 initializer with the engine's per-row scales through DequantizeLinear
    /// (axis 0), the weight half of the Q/DQ form TensorRT builds from. Its consumers must take
    /// rows as output channels (Gemm with transB, Gather).
    pub fn weight(&mut self, name: &str, m: &Matrix) -> String {
        self.weight_laid_out(name, m, false)
    }

    /// The same weight stored `[cols, rows]`, as MatMul's right operand wants it: `x @ W^T` reads
    /// it directly (no Transpose node between a DequantizeLinear and its MatMul, which TensorRT's
    /// Q/DQ fusion needs); int8 scales then run along axis 1, the output channels.
    pub fn weight_transposed(&mut self, name: &str, m: &Matrix) -> String {
        self.weight_laid_out(name, m, true)
    }

    fn weight_laid_out(&mut self, name: &str, m: &Matrix, transposed: bool) -> String {
        let (rows, cols) = (m.rows(), m.cols());
        let dims = if transposed {
            [cols, rows]
        } else {
            [rows, cols]
        };
        match m {
            Matrix::F32(t) => {
                let values = if transposed {
                    transpose(t.as_slice(), rows, cols)
                } else {
                    t.as_slice().to_vec()
                };
                self.init_float(name, &dims, &values)
            }
            Matrix::F16 { bits, start, .. } | Matrix::Bf16 { bits, start, .. } => {
                let (dtype, suffix) = match m {
                    Matrix::F16 { .. } => (DataType::FLOAT16, "fp16"),
                    _ => (DataType::BFLOAT16, "bf16"),
                };
                let stored = &bits[start * cols..(start + rows) * cols];
                let stored = if transposed {
                    transpose(stored, rows, cols)
                } else {
                    stored.to_vec()
                };
                let raw = stored.iter().flat_map(|b| b.to_le_bytes()).collect();
                let name16 = format!("{name}_{suffix}");
                self.initializers
                    .push(tensor_proto(&name16, dtype, &dims, raw));
                let float = self.float;
                self.cast(&name16, dtype, float)
            }
            Matrix::I8 {
                q, scales, start, ..
            } => {
                let stored = &q[start * cols..(start + rows) * cols];
                let stored = if transposed {
                    transpose(stored, rows, cols)
                } else {
                    stored.to_vec()
                };
                let raw = stored.iter().map(|&v| v as u8).collect();
                let name8 = format!("{name}_int8");
                self.initializers
                    .push(tensor_proto(&name8, DataType::INT8, &dims, raw));
                // DequantizeLinear consumers (TensorRT's Q/DQ importer) refuse non-positive
                // scales; an all-zero row of an engine converted before scales were kept positive
                // has scale 0, and with all-zero values any scale gives the same zeros.
                let positive: Vec<f32> = scales[*start..start + rows]
                    .iter()
                    .map(|&s| if s > 0.0 { s } else { 1.0 })
                    .collect();
                let scale = self.init_f32(&format!("{name}_scale"), &[rows], &positive);
                let zero_point = format!("{name}_zero_point");
                self.initializers.push(tensor_proto(
                    &zero_point,
                    DataType::INT8,
                    &[rows],
                    vec![0; rows],
                ));
                let dq = self.op(
                    "DequantizeLinear",
                    &[&name8, &scale, &zero_point],
                    vec![("axis", Attr::Int(if transposed { 1 } else { 0 }))],
                );
                let float = self.float;
                self.cast(&dq, DataType::FLOAT, float)
            }
        }
    }

    /// `x @ W^T + b` for a PyTorch-layout weight `[out, in]`; `x` may have any leading dims. With
    /// an activation scale (all-layer W8A8), `x` gets its static Q/DQ pair first, so TensorRT
    /// sees an int8 x int8 MatMul.
    pub fn linear(
        &mut self,
        x: &str,
        name: &str,
        weight: &Matrix,
        bias: &Tensor,
        activation_scale: Option<f32>,
    ) -> String {
        let x = match activation_scale {
            Some(scale) => self.fake_quantize(x, name, scale),
            None => x.to_string(),
        };
        let w = self.weight_transposed(&format!("{name}.weight"), weight);
        let b = self.init_float(&format!("{name}.bias"), &[bias.len()], bias.as_slice());
        let y = self.op("MatMul", &[&x, &w], vec![]);
        self.op("Add", &[&y, &b], vec![])
    }

    /// LayerNormalization over the last axis (opset 17), always in fp32: an fp16 graph casts its
    /// input up and the result back (TensorRT's guidance for FP16 LayerNorm accuracy).
    pub fn layer_norm(
        &mut self,
        x: &str,
        name: &str,
        gamma: &Tensor,
        beta: &Tensor,
        eps: f64,
    ) -> String {
        let g = self.init_f32(&format!("{name}.weight"), &[gamma.len()], gamma.as_slice());
        let b = self.init_f32(&format!("{name}.bias"), &[beta.len()], beta.as_slice());
        let float = self.float;
        let x32 = self.cast(x, float, DataType::FLOAT);
        let y = self.op(
            "LayerNormalization",
            &[&x32, &g, &b],
            vec![
                ("axis", Attr::Int(-1)),
                ("epsilon", Attr::Float(eps as f32)),
            ],
        );
        self.cast(&y, DataType::FLOAT, float)
    }

    /// Softmax over the last axis, in fp32 like LayerNorm.
    pub fn softmax(&mut self, x: &str) -> String {
        let float = self.float;
        let x32 = self.cast(x, float, DataType::FLOAT);
        let y = self.op("Softmax", &[&x32], vec![("axis", Attr::Int(-1))]);
        self.cast(&y, DataType::FLOAT, float)
    }

    /// Exact GELU, `0.5 x (1 + erf(x / sqrt 2))` (PyTorch's default and RecBole's "gelu").
    pub fn gelu(&mut self, x: &str) -> String {
        let sqrt2 = self.scalar_float("sqrt2", std::f32::consts::SQRT_2);
        let one = self.scalar_float("one", 1.0);
        let half = self.scalar_float("half", 0.5);
        let scaled = self.op("Div", &[x, &sqrt2], vec![]);
        let erf = self.op("Erf", &[&scaled], vec![]);
        let shifted = self.op("Add", &[&erf, &one], vec![]);
        let prod = self.op("Mul", &[x, &shifted], vec![]);
        self.op("Mul", &[&prod, &half], vec![])
    }

    /// A Quantize/Dequantize pair with one static per-tensor scale (symmetric int8): what TensorRT
    /// reads as "this activation is int8 with this scale". Only fp32 graphs quantize.
    pub fn fake_quantize(&mut self, x: &str, hint: &str, scale: f32) -> String {
        debug_assert_eq!(self.float, DataType::FLOAT, "int8 graphs compute in fp32");
        let s = self.scalar_f32(&format!("{hint}_act_scale"), scale);
        let zp = self.fresh(&format!("{hint}_act_zero_point"));
        self.initializers
            .push(tensor_proto(&zp, DataType::INT8, &[], vec![0]));
        let q = self.op("QuantizeLinear", &[x, &s, &zp], vec![]);
        self.op("DequantizeLinear", &[&q, &s, &zp], vec![])
    }

    /// A tensor of the compute type shaped like `shape_of`, filled with `value`.
    pub fn filled_like(&mut self, shape_of: &str, value: f32) -> String {
        let shape = self.op("Shape", &[shape_of], vec![]);
        let raw = self.float_bytes(&[value]);
        let fill = tensor_proto("", self.float, &[1], raw);
        self.op(
            "ConstantOfShape",
            &[&shape],
            vec![("value", Attr::Tensor(Box::new(fill)))],
        )
    }
}

/// A graph input or output with a symbolic batch dimension and the given other dims (`None` =
/// dynamic, named by `dynamic_name`).
pub(crate) fn value_info(
    name: &str,
    dtype: DataType,
    dims: &[Option<usize>],
    dynamic_names: &[&str],
    doc: &str,
) -> pb::ValueInfoProto {
    use pb::tensor_shape_proto::{dimension, Dimension};
    let mut names = dynamic_names.iter();
    let dim = dims
        .iter()
        .map(|d| Dimension {
            value: Some(match d {
                Some(v) => dimension::Value::DimValue(*v as i64),
                None => dimension::Value::DimParam(
                    names.next().copied().unwrap_or("dynamic").to_string(),
                ),
            }),
            ..Default::default()
        })
        .collect();
    pb::ValueInfoProto {
        name: name.to_string(),
        doc_string: doc.to_string(),
        type_: MessageField::some(pb::TypeProto {
            value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                elem_type: dtype as i32,
                shape: MessageField::some(pb::TensorShapeProto {
                    dim,
                    ..Default::default()
                }),
                ..Default::default()
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    #[test]
    fn int8_scales_are_exported_positive_even_when_the_engine_stored_zero() {
        // An all-zero row as engines converted before scales were kept positive stored it.
        let matrix = Matrix::I8 {
            q: recsys_engine::elements::Elements::from_vec(vec![0, 0, 5, -3]),
            scales: recsys_engine::elements::Elements::from_vec(vec![0.0, 0.5]),
            start: 0,
            rows: 2,
            cols: 2,
        };
        let mut g = GraphBuilder::default();
        g.weight("w", &matrix);
        g.weight_transposed("wt", &matrix);
        let scale = g
            .initializers
            .iter()
            .find(|t| t.name == "w_scale")
            .expect("the scale initializer");
        let values: Vec<f32> = scale
            .raw_data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(values, vec![1.0, 0.5]);
        let transposed = g
            .initializers
            .iter()
            .find(|t| t.name == "wt_int8")
            .expect("the transposed int8 weight");
        assert_eq!(transposed.dims, vec![2, 2]);
        assert_eq!(transposed.raw_data, vec![0, 5, 0, (-3i8) as u8]);
    }
}
