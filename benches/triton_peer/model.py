"""The peer of the serving benchmark: the recsys model exported with `recsys export-onnx`, served by
Triton's Python backend running onnxruntime. It speaks the recsys backend's contract (ITEM_IDS,
optional K and EXCLUDE_ITEM_IDS in; TOP_ITEM_IDS, TOP_SCORES out), so perf_analyzer drives both with
the same requests. This is the closest deployment a Triton user can build on CPU without recsys:
id mapping and padding in Python, the model in onnxruntime, one ORT call per dynamic batch.

Model directory: <model>/1/model.py (this file), <model>/1/model.onnx (top-k graph), <model>/item_ids.tsv.
Parameters: `threads` (onnxruntime intra-op threads, default 1), `top_k` (default 10).
"""

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        version_dir = Path(args["model_repository"]) / args["model_version"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(params.get("threads", "1"))
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(version_dir / "model.onnx"), options,
                                            providers=["CPUExecutionProvider"])
        meta = self.session.get_modelmeta().custom_metadata_map
        self.kind = meta["recsys.kind"]
        self.mask_index = int(meta.get("recsys.mask_index", 0))
        self.max_len = int(meta.get("recsys.max_len", 0))
        self.graph_k = self.session.get_outputs()[0].shape[1]
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
            scores, items_out = self.session.run(None, feeds)
            for row, i in enumerate(valid):
                k = ks[i]
                responses[i] = pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("TOP_ITEM_IDS", self.external[items_out[row, :k]].reshape(1, k)),
                    pb_utils.Tensor("TOP_SCORES", scores[row, :k].astype(np.float32).reshape(1, k)),
                ])
        return responses
