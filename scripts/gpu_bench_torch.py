"""The peer of the GPU check: torch.matmul + bias + torch.topk on the data gpu_bench wrote, timed with
CUDA events (median of 30 after 5 warm-ups), then one markdown table with the fused kernel's numbers.

    python3 scripts/gpu_bench_torch.py OUT_DIR      (after gpu_bench has written OUT_DIR/*.f32 and fused.json)
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch


def timed(fn, reps=30):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def main() -> None:
    out = Path(sys.argv[1])
    fused = json.loads((out / "fused.json").read_text())
    n, d, k = fused["n"], fused["d"], fused["k"]
    weights = torch.from_numpy(np.fromfile(out / "weights.f32", dtype=np.float32).reshape(n, d)).cuda()
    bias = torch.from_numpy(np.fromfile(out / "bias.f32", dtype=np.float32)).cuda()
    hidden = torch.from_numpy(np.fromfile(out / "hidden.f32", dtype=np.float32).reshape(-1, d)).cuda()
    rows = [f"{torch.cuda.get_device_name()}; N = {n}, d = {d}, k = {k}; measured copy bandwidth "
            f"{fused['copy_gb_s']:.0f} GB/s", "",
            "| precision | batch | fused ms | torch matmul+topk ms | speed-up | fused GB/s | share of copy bandwidth |",
            "|---|---|---|---|---|---|---|"]
    for entry in fused["fused"]:
        precision, batch = entry["precision"], entry["batch"]
        w = weights if precision == "fp32" else weights.half()
        b = bias if precision == "fp32" else bias.half()
        h = hidden[:batch] if precision == "fp32" else hidden[:batch].half()
        ms = timed(lambda: torch.topk(torch.matmul(h, w.T) + b, k, dim=1))
        rows.append(f"| {precision} | {batch} | {entry['median_ms']:.3f} | {ms:.3f} | {ms / entry['median_ms']:.2f}x | "
                    f"{entry['achieved_gb_s']:.0f} | {100 * entry['achieved_gb_s'] / fused['copy_gb_s']:.0f} % |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
