"""The peer of the serving benchmark: the recsys model exported with `recsys export-onnx`, served by
Triton's Python backend running ONNX Runtime or OpenVINO. It speaks the recsys backend's contract
(ITEM_IDS, optional K and EXCLUDE_ITEM_IDS in; TOP_ITEM_IDS, TOP_SCORES out), so perf_analyzer drives
both with the same requests. This is the closest deployment a Triton user can build on CPU without
recsys: id mapping and padding in Python, the model in a CPU runtime, one call per dynamic batch.

Model directory: <model>/1/model.py (this file), <model>/1/model.onnx (top-k graph), <model>/item_ids.tsv.
Parameters: `threads` (the runtime's intra-op threads, default 1), `top_k` (default 10), `runtime`
(`onnxruntime`, the default, or `openvino`), `precision` (OpenVINO only: `f32` forces f32 inference,
`default` leaves OpenVINO's own choice, bf16 on CPUs with AVX512-BF16 or AMX), `site_packages` (a
folder searched first for the runtimes: the benchmark's latest releases beside the venv's own).
"""

import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        if params.get("site_packages"):
            sys.path.insert(0, params["site_packages"])
        version_dir = Path(args["model_repository"]) / args["model_version"]
        threads = int(params.get("threads", "1"))
        # The graph's metadata (kind, [MASK] index, max_len) and its k, read with the onnx package.
        import onnx  # noqa: PLC0415

        graph = onnx.load(str(version_dir / "model.onnx"), load_external_data=False)
        meta = {p.key: p.value for p in graph.metadata_props}
        self.kind = meta["recsys.kind"]
        self.mask_index = int(meta.get("recsys.mask_index", 0))
        self.max_len = int(meta.get("recsys.max_len", 0))
        self.graph_k = graph.graph.output[0].type.tensor_type.shape.dim[1].dim_value
        if params.get("runtime", "onnxruntime") == "openvino":
            import openvino as ov  # noqa: PLC0415

            config = {"INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"}
            if params.get("precision", "f32") == "f32":
                config["INFERENCE_PRECISION_HINT"] = "f32"
            compiled = ov.Core().compile_model(str(version_dir / "model.onnx"), "CPU", config)
            request = compiled.create_infer_request()
            self.run = lambda feeds: tuple(request.infer(feeds).values())
        else:
            import onnxruntime as ort  # noqa: PLC0415

            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            session = ort.InferenceSession(str(version_dir / "model.onnx"), options,
                                           providers=["CPUExecutionProvider"])
            self.run = lambda feeds: session.run(None, feeds)
        self.default_k = int(params.get("top_k", "10"))
        rows = (Path(args["model_repository"]) / "item_ids.tsv").read_text().splitlines()[1:]
        self.index = {}
        self.external = np.zeros(len(rows) + 1, dtype=np.int64)
        for row in rows:
            idx, ext = row.split("\t")
            self.index[int(ext)] = int(idx)
            self.external[int(idx)] = int(ext)

    def execute(self, requests):
        histories, excludes, ks, responses = [], [], [], [None] * len(requests)
        for r in requests:
            ids = pb_utils.get_input_tensor_by_name(r, "ITEM_IDS").as_numpy().reshape(-1)
            mapped = [self.index[i] for i in ids.tolist() if i in self.index]
            extra = pb_utils.get_input_tensor_by_name(r, "EXCLUDE_ITEM_IDS")
            excl = list(mapped)
            if extra is not None:
                excl += [self.index[i] for i in extra.as_numpy().reshape(-1).tolist() if i in self.index]
            k_in = pb_utils.get_input_tensor_by_name(r, "K")
            k = int(k_in.as_numpy().reshape(-1)[0]) if k_in is not None else self.default_k
            histories.append(mapped)
            excludes.append(excl)
            ks.append(k)
        valid = [i for i, k in enumerate(ks) if 1 <= k <= self.graph_k]
        for i, k in enumerate(ks):
            if i not in valid:
                responses[i] = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"K must be 1..{self.graph_k}, got {k}"))
        if valid:
            batch = len(valid)
            width = max(1, max(len(excludes[i]) for i in valid))
            exclude = np.zeros((batch, width), dtype=np.int64)
            for row, i in enumerate(valid):
                exclude[row, : len(excludes[i])] = excludes[i]
            if self.kind == "bert4rec":
                seq = np.zeros((batch, self.max_len), dtype=np.int64)
                for row, i in enumerate(valid):
                    tail = histories[i][-(self.max_len - 1):] if self.max_len > 1 else []
                    seq[row, : len(tail)] = tail
                    seq[row, len(tail)] = self.mask_index
                feeds = {"item_seq": seq, "exclude_ids": exclude}
            else:
                hist_width = max(1, max(len(histories[i]) for i in valid))
                items = np.zeros((batch, hist_width), dtype=np.int64)
                for row, i in enumerate(valid):
                    items[row, : len(histories[i])] = histories[i]
                feeds = {"items": items, "exclude_ids": exclude}
            scores, items_out = self.run(feeds)
            for row, i in enumerate(valid):
                k = ks[i]
                responses[i] = pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("TOP_ITEM_IDS", self.external[items_out[row, :k]].reshape(1, k)),
                    pb_utils.Tensor("TOP_SCORES", scores[row, :k].astype(np.float32).reshape(1, k)),
                ])
        return responses
