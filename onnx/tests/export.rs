//! The exporter on the fixture models: graph structure per precision, the Q/DQ it emits, the
//! external-data layout and its refusals. Numerical agreement is checked in onnxruntime by
//! tests/integration/test_onnx_export.py.

use std::path::{Path, PathBuf};

use onnx_protobuf::{tensor_proto::DataType, Message, ModelProto};
use recsys_engine::calibration::CalibrationMethod;
use recsys_engine::engine_dir::Precision;
use recsys_engine::{ConvertRequest, ModelKind};
use recsys_onnx::{ExportOptions, GraphOutput, OnnxError, RepositoryModel};

use recsys_engine::fixtures::dir as fixtures;

fn calibration_histories() -> Vec<Vec<String>> {
    std::fs::read_to_string(fixtures().join("test_set.tsv"))
        .unwrap()
        .lines()
        .skip(1)
        .take(200)
        .map(|l| {
            l.split('\t')
                .nth(2)
                .unwrap()
                .split(' ')
                .map(String::from)
                .collect()
        })
        .collect()
}

fn engine(dir: &Path, kind: ModelKind, precision: Precision, w8a8: bool) -> PathBuf {
    let src = recsys_engine::fixtures::model_dir(kind);
    let config = recsys_engine::fixtures::config(kind).unwrap();
    let out = dir.join(format!("{kind}_{precision:?}_{w8a8}"));
    let histories = calibration_histories();
    recsys_engine::convert(&ConvertRequest {
        kind: Some(kind),
        checkpoint: &src.join("model.safetensors"),
        config: Some(&config),
        item_map: recsys_engine::ItemMapSource::Tsv(&src.join("item_id_map.tsv")),
        out: &out,
        precision,
        calibration: w8a8.then_some((histories.as_slice(), CalibrationMethod::MinMax)),
        calibration_times: None,
        screen: Default::default(),
        w8a8_layers: Default::default(),
        catalogue: Default::default(),
    })
    .unwrap();
    out
}

fn ops(model: &ModelProto) -> Vec<&str> {
    model
        .graph
        .node
        .iter()
        .map(|n| n.op_type.as_str())
        .collect()
}

fn count(model: &ModelProto, op: &str) -> usize {
    ops(model).iter().filter(|o| **o == op).count()
}

#[test]
fn each_precision_is_expressed_in_the_graph() {
    let tmp = tempfile::tempdir().unwrap();
    for kind in [ModelKind::Bert4rec, ModelKind::Vaecf] {
        // BERT4Rec: item table + 2 layers x 6 dense + head dense; Mult-VAE: 2 encoder + 2 decoder.
        let quantized = if kind == ModelKind::Bert4rec { 14 } else { 4 };
        for (precision, w8a8) in [
            (Precision::Fp32, false),
            (Precision::Fp16, false),
            (Precision::Bf16, false),
            (Precision::Int8, false),
            (Precision::Int8, true),
        ] {
            let dir = engine(tmp.path(), kind, precision, w8a8);
            let (model, summary) = recsys_onnx::build(&dir, &ExportOptions::default()).unwrap();
            let types: Vec<i32> = model
                .graph
                .initializer
                .iter()
                .map(|t| t.data_type)
                .collect();
            let has = |t: DataType| types.contains(&(t as i32));
            let label = format!("{kind:?} {precision:?} w8a8={w8a8}");
            assert_eq!(model.opset_import[0].version, 17, "{label}");
            match precision {
                Precision::Fp32 => {
                    assert!(!has(DataType::FLOAT16) && !has(DataType::INT8), "{label}");
                    assert_eq!(count(&model, "DequantizeLinear"), 0, "{label}");
                }
                Precision::Fp16 => {
                    let fp16 = types
                        .iter()
                        .filter(|&&t| t == DataType::FLOAT16 as i32)
                        .count();
                    assert!(fp16 >= quantized, "{label}");
                    assert_eq!(count(&model, "DequantizeLinear"), 0, "{label}");
                    // Typed FP16: fp32 initializers are only the normalisations' parameters.
                    for t in &model.graph.initializer {
                        if t.data_type == DataType::FLOAT as i32 {
                            assert!(
                                t.name.contains("LayerNorm")
                                    || t.name.starts_with("output_ln")
                                    || t.name.starts_with("norm_floor"),
                                "{label}: {} is fp32",
                                t.name
                            );
                        }
                    }
                }
                Precision::Bf16 => {
                    // Typed BFLOAT16 weights, cast to the fp32 the graph computes in.
                    let bf16 = types
                        .iter()
                        .filter(|&&t| t == DataType::BFLOAT16 as i32)
                        .count();
                    assert!(bf16 >= quantized, "{label}");
                    assert!(!has(DataType::FLOAT16) && !has(DataType::INT8), "{label}");
                    assert_eq!(count(&model, "DequantizeLinear"), 0, "{label}");
                }
                Precision::Int8 => {
                    // W8A8: every dense layer's input and the output layer's.
                    let dense = if kind == ModelKind::Bert4rec { 13 } else { 2 };
                    let act = if w8a8 { dense + 1 } else { 0 };
                    assert_eq!(count(&model, "QuantizeLinear"), act, "{label}");
                    assert_eq!(
                        count(&model, "DequantizeLinear"),
                        quantized + act,
                        "{label}"
                    );
                    assert_eq!(summary.quantize_nodes, act);
                    assert_eq!(
                        summary.int8_mode.as_deref(),
                        Some(if w8a8 { "w8a8" } else { "weight-only" })
                    );
                    // No Transpose or Slice between a weight's DequantizeLinear and its consumer.
                    let dq_outputs: Vec<&str> = model
                        .graph
                        .node
                        .iter()
                        .filter(|n| n.op_type == "DequantizeLinear")
                        .map(|n| n.output[0].as_str())
                        .collect();
                    for n in &model.graph.node {
                        if n.input.iter().any(|i| dq_outputs.contains(&i.as_str())) {
                            assert!(
                                ["MatMul", "Gemm", "Gather", "QuantizeLinear"]
                                    .contains(&n.op_type.as_str()),
                                "{label}: {} reads a DequantizeLinear",
                                n.op_type
                            );
                        }
                    }
                }
            }
            assert!(
                recsys_onnx::tensorrt_rules::check(&model).is_empty(),
                "{label}"
            );
            assert_eq!(
                summary
                    .outputs
                    .iter()
                    .map(|o| o.name.as_str())
                    .collect::<Vec<_>>(),
                ["topk_scores", "topk_items"],
                "{label}"
            );
        }
    }
}

#[test]
fn int8_weights_are_the_engines_bytes_and_scales() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = engine(tmp.path(), ModelKind::Vaecf, Precision::Int8, false);
    let loaded = recsys_engine::engine_dir::load(&dir).unwrap();
    let (model, _) = recsys_onnx::build(&dir, &ExportOptions::default()).unwrap();
    let find = |name: &str| {
        model
            .graph
            .initializer
            .iter()
            .find(|t| t.name == name)
            .unwrap()
    };
    let raw = &loaded.weights.raw["decoder.2.weight"];
    assert_eq!(find("decoder.2.weight_int8").raw_data, raw.bytes.as_slice());
    let scales = loaded.weights.f32["decoder.2.weight.scale"]
        .as_slice()
        .to_vec();
    let exported: Vec<f32> = find("decoder.2.weight_scale")
        .raw_data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(exported, scales);
    assert!(exported.iter().all(|&s| s > 0.0), "every scale is positive");
}

#[test]
fn k_outside_the_catalogue_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = engine(tmp.path(), ModelKind::Vaecf, Precision::Fp32, false);
    for k in [0, 2001] {
        let options = ExportOptions {
            output: GraphOutput::TopK(k),
            ..Default::default()
        };
        match recsys_onnx::build(&dir, &options) {
            Err(OnnxError::Invalid(msg)) => assert!(msg.contains("1..=2000"), "{msg}"),
            other => panic!("k = {k}: expected a refusal, got {:?}", other.map(|_| ())),
        }
    }
    // Above TensorRT's TopK limit, whatever the catalogue: the message says what to do instead.
    let too_large = ExportOptions {
        output: GraphOutput::TopK(recsys_onnx::TENSORRT_MAX_TOPK + 1),
        ..Default::default()
    };
    match recsys_onnx::build(&dir, &too_large) {
        Err(OnnxError::Invalid(msg)) => {
            assert!(
                msg.contains("3840") && msg.contains("--all-scores"),
                "{msg}"
            )
        }
        other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
    }
    let ok = ExportOptions {
        output: GraphOutput::TopK(2000),
        ..Default::default()
    };
    assert!(recsys_onnx::build(&dir, &ok).is_ok());
}

#[test]
fn external_data_is_aligned_and_complete() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = engine(tmp.path(), ModelKind::Bert4rec, Precision::Fp32, false);
    let out = tmp.path().join("m.onnx");
    let options = ExportOptions {
        external_data: true,
        ..Default::default()
    };
    let summary = recsys_onnx::export(&dir, &out, &options).unwrap();
    let data = std::fs::read(summary.external_data.as_ref().unwrap()).unwrap();
    let model = ModelProto::parse_from_bytes(&std::fs::read(&out).unwrap()).unwrap();
    let mut external = 0;
    for t in &model.graph.initializer {
        if t.external_data.is_empty() {
            assert!(t.raw_data.len() < 1024, "{} stayed inline", t.name);
            continue;
        }
        external += 1;
        let get = |k: &str| {
            t.external_data
                .iter()
                .find(|e| e.key == k)
                .unwrap()
                .value
                .clone()
        };
        assert_eq!(get("location"), "m.onnx.data");
        let (offset, length): (usize, usize) = (
            get("offset").parse().unwrap(),
            get("length").parse().unwrap(),
        );
        assert_eq!(offset % 64, 0);
        assert!(offset + length <= data.len());
    }
    assert!(external >= 10);
}

#[test]
fn repository_names_and_versions_are_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = engine(tmp.path(), ModelKind::Vaecf, Precision::Fp32, false);
    let target = |name: &str, version: u64| RepositoryModel {
        repository: tmp.path().join("repo"),
        name: name.into(),
        version,
        max_batch_size: 8,
        gpu: true,
        force: false,
    };
    let options = ExportOptions::default();
    for bad in ["", "../x", ".hidden", "a/b"] {
        assert!(
            recsys_onnx::write_model_repository(&dir, &target(bad, 1), &options).is_err(),
            "{bad}"
        );
    }
    assert!(recsys_onnx::write_model_repository(&dir, &target("m", 0), &options).is_err());
    recsys_onnx::write_model_repository(&dir, &target("m", 2), &options).unwrap();
    let config = std::fs::read_to_string(tmp.path().join("repo/m/config.pbtxt")).unwrap();
    assert!(
        config.contains("kind: KIND_GPU") && config.contains("max_batch_size: 8"),
        "{config}"
    );
    assert!(tmp.path().join("repo/m/2/model.onnx").is_file());
    let again = recsys_onnx::write_model_repository(&dir, &target("m", 2), &options);
    assert!(matches!(again, Err(OnnxError::Invalid(m)) if m.contains("--force")));
}

#[test]
fn the_tensorrt_build_command_is_strongly_typed_with_a_profile_over_every_input() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = engine(tmp.path(), ModelKind::Bert4rec, Precision::Int8, true);
    let out = tmp.path().join("b.onnx");
    let options = ExportOptions {
        output: GraphOutput::TopK(10),
        candidates: true,
        ..Default::default()
    };
    let summary = recsys_onnx::export(&dir, &out, &options).unwrap();
    let command = recsys_onnx::trtexec_command(&summary, 32);
    assert!(command.contains("--stronglyTyped"), "{command}");
    assert!(
        !command.contains("--fp16") && !command.contains("--int8"),
        "{command}"
    );
    // BERT4Rec's sequence is fixed at max_len (50); the candidate axis never drops below k.
    assert!(
        command.contains("--minShapes=item_seq:1x50,candidate_ids:1x10,exclude_ids:1x1 "),
        "{command}"
    );
    assert!(
        command.contains("--maxShapes=item_seq:32x50,candidate_ids:32x1000,exclude_ids:32x512 "),
        "{command}"
    );
}

/// HSTU's graph at every precision: its two inputs (the window and the timestamps with the query
/// time after the last item), the TensorRT rules passed (`build` refuses a graph that breaks one),
/// the time-gap buckets computed in fp32 even in the FP16 graph (in the nodes the rules allow),
/// and an int8 graph dequantizing exactly the engine's int8 matrices, each into its consumer.
/// Numerical agreement with the engine and the official code: tests/integration/test_hstu.py.
#[test]
fn hstu_graphs_take_timestamps_and_keep_the_time_buckets_in_fp32() {
    let tmp = tempfile::tempdir().unwrap();
    for precision in [
        Precision::Fp32,
        Precision::Fp16,
        Precision::Bf16,
        Precision::Int8,
    ] {
        let out = engine(tmp.path(), ModelKind::Hstu, precision, false);
        let (model, summary) = recsys_onnx::build(&out, &ExportOptions::default()).unwrap();
        let label = format!("{precision:?}");
        let inputs: Vec<(&str, Vec<Option<usize>>)> = summary
            .inputs
            .iter()
            .map(|i| (i.name.as_str(), i.dims.clone()))
            .collect();
        assert_eq!(
            inputs[..2],
            [
                ("item_seq", vec![Some(200)]),
                ("timestamps", vec![Some(201)])
            ],
            "{label}"
        );
        let logs: Vec<_> = model
            .graph
            .node
            .iter()
            .filter(|n| n.op_type == "Log")
            .collect();
        assert_eq!(
            logs.len(),
            1,
            "{label}: one bucket computation shared by the blocks"
        );
        assert!(
            logs[0].name.starts_with("fp32_time_buckets/"),
            "{label}: {}",
            logs[0].name
        );
        // Two item tables and each block's two projections.
        let int8 = if precision == Precision::Int8 { 6 } else { 0 };
        assert_eq!(count(&model, "DequantizeLinear"), int8, "{label}");
        for node in model
            .graph
            .node
            .iter()
            .filter(|n| n.op_type == "DequantizeLinear")
        {
            let consumers: Vec<&str> = model
                .graph
                .node
                .iter()
                .filter(|c| c.input.contains(&node.output[0]))
                .map(|c| c.op_type.as_str())
                .collect();
            assert!(
                !consumers.is_empty()
                    && consumers
                        .iter()
                        .all(|c| ["Gather", "MatMul", "Gemm"].contains(c)),
                "{label}: {consumers:?}"
            );
        }
    }
}
