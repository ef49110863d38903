"""Fused score + top-k against its peers on the same weights, in one invocation and thread count:
recsys (fp32, fp16, int8 weight-only, and the int8 screen with exact fp32 rescoring, whose answer
must equal fp32's), ONNX Runtime (MatMul + Add + TopK graph), numpy (matmul +
argpartition), and this machine's floor (streaming bandwidth and FMA peak, measured in the same run).

    scripts/bench.sh kernels [--threads 2] [--full] [--n 1000000] [--d 64] [--out FILE.md]

On a CPU with AMX-INT8 the exact screen also runs with its int8 scores on AMX tiles
(screened-int8-amx: the same survivors and answer), compared with the screen on the SIMD tables.

For B histories against N items of dimension d the floor is max(weight bytes / bandwidth,
2*B*N*d / FMA peak): the weights must be read once per batch and every multiply-add done once.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from threadpoolctl import threadpool_info, threadpool_limits

from cpu_info import cpu_model

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "target" / "release" / "kernel_probe"
PRECISIONS = ["fp32", "fp16", "int8", "screened-int8"]
# The screen reads the int8 table; its rescoring of the survivors is a few rows of fp32.
BYTES_PER_WEIGHT = {"fp32": 4, "fp16": 2, "int8": 1, "screened-int8": 1, "screened-int8-amx": 1}


def cpu_has_amx_int8() -> bool:
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def probe(*args: str) -> dict:
    out = subprocess.run([str(PROBE), *args], check=True, capture_output=True, text=True, timeout=1800)
    return json.loads(out.stdout)


def median_time(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def reps_for(seconds_estimate: float) -> int:
    return int(np.clip(0.6 / max(seconds_estimate, 1e-6), 3, 30))


def ort_session(w: np.ndarray, b: np.ndarray, d: int, k: int, threads: int) -> ort.InferenceSession:
    wt = numpy_helper.from_array(np.ascontiguousarray(w.T), "W_T")
    bias = numpy_helper.from_array(b, "B")
    kk = numpy_helper.from_array(np.array([k], dtype=np.int64), "K")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["H", "W_T"], ["S0"]),
            helper.make_node("Add", ["S0", "B"], ["S"]),
            helper.make_node("TopK", ["S", "K"], ["VALUES", "INDICES"], axis=1, largest=1, sorted=1),
        ],
        "score_topk",
        [helper.make_tensor_value_info("H", TensorProto.FLOAT, ["batch", d])],
        [
            helper.make_tensor_value_info("VALUES", TensorProto.FLOAT, ["batch", k]),
            helper.make_tensor_value_info("INDICES", TensorProto.INT64, ["batch", k]),
        ],
        [wt, bias, kk],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--full", action="store_true", help="include N=1e6 with d=600 (2.4 GB of fp32 weights)")
    parser.add_argument("--n", type=int, action="append", help="only these catalogue sizes (repeatable)")
    parser.add_argument("--d", type=int, action="append", help="only these hidden sizes (repeatable)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    threads = args.threads
    precisions = PRECISIONS + (["screened-int8-amx"] if cpu_has_amx_int8() else [])

    bandwidth = probe("bandwidth", "1024", str(threads), "12")["bytes_per_s"]
    fma = probe("fma", str(threads))["flops"]
    print(f"floor inputs: read bandwidth {bandwidth / 1e9:.1f} GB/s, FMA peak {fma / 1e9:.0f} GFLOP/s ({threads} threads)",
          file=sys.stderr)

    configs = []
    for n in [100_000, 1_000_000]:
        for d in [64, 600]:
            if n == 1_000_000 and d == 600 and not args.full:
                continue
            if (args.n and n not in args.n) or (args.d and d not in args.d):
                continue
            for batch in [1, 8, 64]:
                for k in [10, 100]:
                    configs.append((n, d, batch, k))

    rows = []
    rng = np.random.default_rng(2026)
    with tempfile.TemporaryDirectory() as tmp, threadpool_limits(limits=threads):
        tmp = Path(tmp)
        current = None
        for n, d, batch, k in configs:
            if current != (n, d):
                w = (rng.standard_normal((n, d), dtype=np.float32) * 0.1).astype(np.float32)
                b = (rng.standard_normal(n, dtype=np.float32) * 0.1).astype(np.float32)
                hidden = rng.standard_normal((64, d), dtype=np.float32)
                w.tofile(tmp / "w.bin")
                b.tofile(tmp / "b.bin")
                hidden.tofile(tmp / "h.bin")
                current = (n, d)
            print(f"N={n} d={d} B={batch} k={k}", file=sys.stderr, flush=True)
            h = hidden[:batch]
            floor_flops = 2 * batch * n * d / fma
            ours = {}
            for precision in precisions:
                est = max(n * d * BYTES_PER_WEIGHT[precision] / bandwidth, floor_flops)
                r = probe("topk", str(tmp / "w.bin"), str(tmp / "b.bin"), str(tmp / "h.bin"), str(n), str(d),
                          str(batch), str(k), precision, str(threads), str(reps_for(3 * est)))
                ours[precision] = r
            sess = ort_session(w, b, d, k, threads)
            ort_s = median_time(lambda: sess.run(None, {"H": h}), reps_for(3 * floor_flops + 3 * n * d * 4 / bandwidth))
            ort_top = sess.run(None, {"H": h})[1][0].tolist()

            def numpy_topk():
                s = h @ w.T + b
                part = np.argpartition(-s, k, axis=1)[:, :k]
                order = np.argsort(-np.take_along_axis(s, part, axis=1), axis=1, kind="stable")
                return np.take_along_axis(part, order, axis=1)

            np_s = median_time(numpy_topk, reps_for(3 * floor_flops + 3 * n * d * 4 / bandwidth))
            agree = len(set(ours["fp32"]["top_row0"]) & set(ort_top)) / k
            floors = {p: max(n * d * BYTES_PER_WEIGHT[p] / bandwidth, floor_flops) for p in precisions}
            for screened in [p for p in precisions if p.startswith("screened")]:
                if ours[screened]["top_row0"] != ours["fp32"]["top_row0"]:
                    raise SystemExit(f"{screened} answered {ours[screened]['top_row0']}, fp32 "
                                     f"{ours['fp32']['top_row0']}: the screen must be exact")
            rows.append(dict(n=n, d=d, batch=batch, k=k, ours={p: ours[p]["median_s"] for p in precisions},
                             ort=ort_s, numpy=np_s, floors=floors, agree=agree,
                             survivors=ours["screened-int8"]["survivors_median"]))
            del sess

    ms = lambda s: f"{1000 * s:.3f}"  # noqa: E731
    blas = ", ".join(f"{i.get('internal_api')} {i.get('version')} ({i.get('architecture', '?')})" for i in threadpool_info())
    lines = [
        f"{datetime.date.today().isoformat()}, {platform.node()} ({cpu_model()}; AMX-INT8: "
        f"{'yes' if cpu_has_amx_int8() else 'no'}), {os.cpu_count()} cores, {threads} threads everywhere; "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s, FMA peak {fma / 1e9:.0f} GFLOP/s (both measured in this run); "
        f"onnxruntime {ort.__version__}, numpy {np.__version__} ({blas}); recsys kernels: {ours['fp32']['isa']}",
        "",
        "| N | d | B | k | floor fp32 ms | recsys fp32 ms | fp32 / floor | ORT ms | ORT / recsys | numpy ms | numpy / recsys | recsys fp16 ms | fp32 / fp16 | recsys int8 ms | fp32 / int8 | int8 / its floor | top-k agree (fp32 vs ORT) | screened int8 ms (exact) | fp32 / screened | ORT / screened | survivors (median) |"
        + (" screened on AMX ms | SIMD screen / AMX screen |" if "screened-int8-amx" in precisions else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        + ("---|---|" if "screened-int8-amx" in precisions else ""),
    ]
    for r in rows:
        o = r["ours"]
        lines.append(
            f"| {r['n']:.0e} | {r['d']} | {r['batch']} | {r['k']} | {ms(r['floors']['fp32'])} | {ms(o['fp32'])} | "
            f"{o['fp32'] / r['floors']['fp32']:.2f} | {ms(r['ort'])} | {r['ort'] / o['fp32']:.2f} | {ms(r['numpy'])} | "
            f"{r['numpy'] / o['fp32']:.2f} | {ms(o['fp16'])} | {o['fp32'] / o['fp16']:.2f} | {ms(o['int8'])} | "
            f"{o['fp32'] / o['int8']:.2f} | {o['int8'] / r['floors']['int8']:.2f} | {r['agree']:.2f} | "
            f"{ms(o['screened-int8'])} | {o['fp32'] / o['screened-int8']:.2f} | {r['ort'] / o['screened-int8']:.2f} | "
            f"{r['survivors']} |"
            + (f" {ms(o['screened-int8-amx'])} | {o['screened-int8'] / o['screened-int8-amx']:.2f} |"
               if "screened-int8-amx" in o else "")
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
