//! A small builder over the ONNX protobuf types: named initializers, single-output nodes and the
//! few composite layers (linear, LayerNorm, GELU) both models share. Every weight goes through
//! [`GraphBuilder::weight`], so one call site decides how a precision is expressed in the graph.

use onnx_protobuf as pb;
use pb::tensor_proto::DataType;
use protobuf::{EnumOrUnknown, MessageField};
use recsys_engine::tensor::Tensor;
use recsys_engine::weights::Matrix;

/// An attribute value of a node.
pub(crate) enum Attr {
    Int(i64),
    Ints(Vec<i64>),
    Float(f32),
    Tensor(Box<pb::TensorProto>),
}

#[derive(Default)]
pub(crate) struct GraphBuilder {
    pub nodes: Vec<pb::NodeProto>,
    pub initializers: Vec<pb::TensorProto>,
    next_id: usize,
    /// Q/DQ nodes emitted (reported in the export summary).
    pub quantize_nodes: usize,
    pub dequantize_nodes: usize,
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

fn i64_bytes(values: &[i64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

impl GraphBuilder {
    fn fresh(&mut self, hint: &str) -> String {
        self.next_id += 1;
        format!("{hint}_{}", self.next_id)
    }

    pub fn init_f32(&mut self, name: &str, dims: &[usize], values: &[f32]) -> String {
        debug_assert_eq!(dims.iter().product::<usize>(), values.len());
        self.initializers
            .push(tensor_proto(name, DataType::FLOAT, dims, f32_bytes(values)));
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

    /// A scalar f32 constant (broadcasts against any tensor).
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
        let name = self.fresh(&op_type.to_lowercase());
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

    /// A weight matrix `[rows, cols]` as an f32 tensor in the graph, expressed at its stored
    /// precision: fp32 as is; fp16 as a FLOAT16 initializer cast to float (the engine computes in
    /// fp32 from fp16 weights); int8 as an INT8 initializer with the engine's per-row scales
    /// through DequantizeLinear (axis 0), the weight half of the Q/DQ form TensorRT builds from.
    pub fn weight(&mut self, name: &str, m: &Matrix) -> String {
        let (rows, cols) = (m.rows(), m.cols());
        match m {
            Matrix::F32(t) => self.init_f32(name, &[rows, cols], t.as_slice()),
            Matrix::F16 { bits, start, .. } => {
                let raw = bits[start * cols..(start + rows) * cols]
                    .iter()
                    .flat_map(|b| b.to_le_bytes())
                    .collect();
                let stored = format!("{name}_fp16");
                self.initializers.push(tensor_proto(
                    &stored,
                    DataType::FLOAT16,
                    &[rows, cols],
                    raw,
                ));
                self.op(
                    "Cast",
                    &[&stored],
                    vec![("to", Attr::Int(DataType::FLOAT as i64))],
                )
            }
            Matrix::I8 {
                q, scales, start, ..
            } => {
                let raw = q[start * cols..(start + rows) * cols]
                    .iter()
                    .map(|&v| v as u8)
                    .collect();
                let stored = format!("{name}_int8");
                self.initializers
                    .push(tensor_proto(&stored, DataType::INT8, &[rows, cols], raw));
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
                self.op(
                    "DequantizeLinear",
                    &[&stored, &scale, &zero_point],
                    vec![("axis", Attr::Int(0))],
                )
            }
        }
    }

    /// `x @ W^T + b` for a PyTorch-layout weight `[out, in]`; `x` may have any leading dims.
    pub fn linear(&mut self, x: &str, name: &str, weight: &Matrix, bias: &Tensor) -> String {
        let w = self.weight(&format!("{name}.weight"), weight);
        let wt = self.op("Transpose", &[&w], vec![("perm", Attr::Ints(vec![1, 0]))]);
        let b = self.init_f32(&format!("{name}.bias"), &[bias.len()], bias.as_slice());
        let y = self.op("MatMul", &[x, &wt], vec![]);
        self.op("Add", &[&y, &b], vec![])
    }

    /// LayerNormalization over the last axis (opset 17).
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
        self.op(
            "LayerNormalization",
            &[x, &g, &b],
            vec![
                ("axis", Attr::Int(-1)),
                ("epsilon", Attr::Float(eps as f32)),
            ],
        )
    }

    /// Exact GELU, `0.5 x (1 + erf(x / sqrt 2))` (PyTorch's default and RecBole's "gelu").
    pub fn gelu(&mut self, x: &str) -> String {
        let sqrt2 = self.scalar_f32("sqrt2", std::f32::consts::SQRT_2);
        let one = self.scalar_f32("one", 1.0);
        let half = self.scalar_f32("half", 0.5);
        let scaled = self.op("Div", &[x, &sqrt2], vec![]);
        let erf = self.op("Erf", &[&scaled], vec![]);
        let shifted = self.op("Add", &[&erf, &one], vec![]);
        let prod = self.op("Mul", &[x, &shifted], vec![]);
        self.op("Mul", &[&prod, &half], vec![])
    }

    /// A Quantize/Dequantize pair with one static per-tensor scale (symmetric int8): what TensorRT
    /// reads as "this activation is int8 with this scale".
    pub fn fake_quantize(&mut self, x: &str, hint: &str, scale: f32) -> String {
        let s = self.scalar_f32(&format!("{hint}_act_scale"), scale);
        let zp = self.fresh(&format!("{hint}_act_zero_point"));
        self.initializers
            .push(tensor_proto(&zp, DataType::INT8, &[], vec![0]));
        let q = self.op("QuantizeLinear", &[x, &s, &zp], vec![]);
        self.op("DequantizeLinear", &[&q, &s, &zp], vec![])
    }

    /// A float tensor of `shape_of`'s shape filled with `value`.
    pub fn filled_like(&mut self, shape_of: &str, value: f32) -> String {
        let shape = self.op("Shape", &[shape_of], vec![]);
        let fill = tensor_proto("", DataType::FLOAT, &[1], f32_bytes(&[value]));
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
    use std::sync::Arc;

    use super::*;

    #[test]
    fn int8_scales_are_exported_positive_even_when_the_engine_stored_zero() {
        // An all-zero row as engines converted before scales were kept positive stored it.
        let matrix = Matrix::I8 {
            q: Arc::new(vec![0, 0, 5, -3]),
            scales: Arc::new(vec![0.0, 0.5]),
            start: 0,
            rows: 2,
            cols: 2,
        };
        let mut g = GraphBuilder::default();
        g.weight("w", &matrix);
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
    }
}
