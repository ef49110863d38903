"""The peer of the fused kernel: torch.matmul + bias + torch.topk on the data gpu_bench wrote, timed
with CUDA events around the GPU work only (median of 30 after 5 warm-ups), like gpu_bench's kernel
time. fp32 and fp16 run at their own precision; torch has no int8 GEMV, so the int8 rows are
compared with torch's fp16 matmul on the same items (the fastest torch path a user would deploy).

    python3 gpu_bench_torch.py DATA_DIR FUSED_JSON OUT_JSON
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch


def timed_ms(fn, warmup=5, reps=30):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def main() -> None:
    data, fused_path, out_path = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    fused = json.loads(fused_path.read_text())
    n, k = fused["n"], fused["k"]
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for dim in fused["dims"]:
        weights = torch.from_numpy(np.fromfile(data / f"weights_d{dim}.f32", dtype=np.float32).reshape(n, dim)).cuda()
        bias = torch.from_numpy(np.fromfile(data / f"bias_d{dim}.f32", dtype=np.float32)).cuda()
        hidden = torch.from_numpy(np.fromfile(data / f"hidden_d{dim}.f32", dtype=np.float32).reshape(-1, dim)).cuda()
        by_dtype = {"fp32": (weights, bias, hidden)}
        by_dtype["fp16"] = (weights.half(), bias.half(), hidden.half())
        by_dtype["int8"] = by_dtype["fp16"]
        measured = set()
        for entry in fused["fused"]:
            # One torch time per cell, whichever scans the fused kernel ran.
            if entry["dim"] != dim or (entry["precision"], entry["batch"]) in measured:
                continue
            measured.add((entry["precision"], entry["batch"]))
            w, b, h = by_dtype[entry["precision"]]
            batch = entry["batch"]
            hb = h[:batch].contiguous()
            ms = timed_ms(lambda: torch.topk(torch.addmm(b, hb, w.T), k, dim=1))
            results["rows"].append({"precision": entry["precision"], "dim": dim, "batch": batch, "torch_ms": ms})
        del weights, bias, hidden, by_dtype
        torch.cuda.empty_cache()
    out_path.write_text(json.dumps(results, indent=1))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
