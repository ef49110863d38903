"""Loading by mapping: load time and resident memory of engines whose kernels' layout is stored in
the engine file (`kernels.bin`, mapped at load) against the same engines in the previous format
(no kernels file: the layout packed into owned memory at every load), at catalogue scale.

    scripts/bench.sh load [--items 100000,1000000] [--models vaecf,bert4rec] [--precisions fp32,fp16,int8]
                          [--out FILE.md]

Random-weight models as scripts/bench_catalogue.py builds them (Mult-VAE 600-200-600; BERT4Rec
the fixture's encoder with a random item table), at each precision asked (fp32 by default), with
and without the int8 screen (fp32 and fp16; int8 engines are not screened). Each
measurement is a fresh process that loads the engine with the Python package (`recsys.Engine`,
2 threads; the page cache warm, as when a server reloads) and reads its own /proc/self/smaps: the
load's seconds, the memory it owns after loading (anonymous pages: copies), and the engine files'
resident pages after 1 history (one scan) and after 256 more.
The previous-format twin shares the new engine's weights and item map by hard link; only its
manifest differs, so both read the same bytes from the same page cache. "kernel bytes" is what one
scan reads: the packed output layer, or for a screened engine the int8 screen with its scales and
bound terms (plus the survivors' rows).
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_catalogue import FIRST_ID, checkpoints, convert  # noqa: E402

KERNELS = "kernels.bin"


def previous_format(new: Path, old: Path) -> None:
    """`new` as an engine written before kernels.bin existed (hard links, edited manifest)."""
    old.mkdir()
    manifest = json.loads((new / "manifest.json").read_text())
    manifest.pop("kernel_layout")
    manifest["files"].pop(KERNELS)
    for name in manifest["files"]:
        os.link(new / name, old / name)
    (old / "manifest.json").write_text(json.dumps(manifest, indent=2))


def kernel_bytes(engine: Path) -> int:
    layout = json.loads((engine / "manifest.json").read_text())["kernel_layout"]["sections"]
    screened = any(name.startswith("screen.") for name in layout)
    prefix = "screen." if screened else "output."
    return sum(s["bytes"] for name, s in layout.items() if name.startswith(prefix))


CHILD = r"""
import json, re, sys, time
import recsys

def resident(prefix):
    per, current = {}, None
    for line in open("/proc/self/smaps"):
        head = re.match(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \d+\s*(.*)$", line)
        if head:
            current = head.group(1)
            continue
        if line.startswith("Rss:"):
            per[current] = per.get(current, 0) + int(line.split()[1])
    files = sum(v for k, v in per.items() if k.startswith(prefix))
    owned = sum(v for k, v in per.items() if k in ("", "[heap]") or k.startswith("[anon"))
    return files / 1024, owned / 1024

engine, histories = sys.argv[1], json.load(open(sys.argv[2]))
_, owned_before = resident(engine)
started = time.monotonic()
model = recsys.Engine(engine, threads=2)
load_s = time.monotonic() - started
files_loaded, owned_loaded = resident(engine)
model.recommend(histories[:1], k=10)
files_one, _ = resident(engine)
model.recommend(histories[1:], k=10)
files_all, owned_all = resident(engine)
print(json.dumps({"load_s": load_s, "owned": owned_loaded - owned_before, "files_loaded": files_loaded,
                  "files_one": files_one, "files_all": files_all, "owned_all": owned_all - owned_before}))
"""


def run(engine: Path, users: Path) -> dict:
    """One fresh process: load, one history, 256 more; what it measured of itself."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(engine.resolve()), str(users)],
                         capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", default="100000")
    parser.add_argument("--models", default="vaecf,bert4rec")
    parser.add_argument("--precisions", default="fp32", help="comma-separated: fp32, fp16, int8")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="recsys-bench-load-") as tmp_name:
        tmp = Path(tmp_name)
        import numpy as np  # noqa: PLC0415

        rng = np.random.default_rng(3)
        for items in [int(x) for x in args.items.split(",")]:
            for kind in args.models.split(","):
                work = tmp / f"{kind}-{items}"
                work.mkdir()
                ckpt, cfg, item_map = checkpoints(kind, items, work)
                users = work / "users.json"
                users.write_text(json.dumps([[int(FIRST_ID + i) for i in rng.integers(0, items, 20)]
                                             for _ in range(257)]))
                variants = [(p, screen) for p in args.precisions.split(",")
                            for screen in (("none",) if p == "int8" else ("none", "int8"))]
                for precision, screen in variants:
                    new = work / f"engine-{precision}-{screen}"
                    convert(kind, ckpt, cfg, item_map, new, ["--precision", precision, "--screen", screen])
                    old = work / f"engine-{precision}-{screen}-previous"
                    previous_format(new, old)
                    size = sum(f.stat().st_size for f in new.iterdir())
                    for label, engine in (("mapped", new), ("packed at load", old)):
                        run(engine, users)  # warm the page cache: both read the same files
                        m = run(engine, users)
                        rows.append((kind, items, precision, screen, label, size / 2**20,
                                     kernel_bytes(new) / 2**20, m))
                        print(rows[-1], flush=True)
                    for engine in (new, old):
                        for f in engine.iterdir():
                            f.unlink()
                        engine.rmdir()
                for f in (ckpt, cfg, item_map):
                    f.unlink()
    lines = [
        f"## {datetime.date.today()} — loading by mapping (`scripts/bench.sh load --items {args.items} "
        f"--models {args.models} --precisions {args.precisions}`)",
        "",
        f"{platform.processor() or platform.machine()}, `recsys.Engine(threads=2)` in a fresh process, page cache "
        "warm. Engine = all its files; kernel = what one scan reads (the packed output layer, or the int8 "
        "screen with its scales and bound terms); owned = anonymous memory the load added; resident = the "
        "engine files' pages in the process after 1 history and after 257 (20 random items each).",
        "",
        "| model | items | precision | screen | layout | engine MiB | kernel MiB | load s | owned MiB | "
        "resident MiB, loaded / 1 / 257 histories | (owned + resident at 1) / kernel |",
        "|---|---:|---|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for kind, items, precision, screen, label, size, kern, m in rows:
        lines.append(
            f"| {kind} | {items:,} | {precision} | {screen} | {label} | {size:,.0f} | {kern:,.0f} | {m['load_s']:.2f} | "
            f"{m['owned']:,.0f} | {m['files_loaded']:,.0f} / {m['files_one']:,.0f} / {m['files_all']:,.0f} | "
            f"{(m['owned'] + m['files_one']) / kern:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
