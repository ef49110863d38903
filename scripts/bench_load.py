"""Loading by mapping: load time and resident memory of engines whose kernels' layout is stored in
the engine file (`kernels.bin`, mapped at load) against the same engines in the previous format
(no kernels file: the layout packed into owned memory at every load), at catalogue scale.

    scripts/bench.sh load [--items 100000,1000000] [--models vaecf,bert4rec] [--out FILE.md]

Random-weight models as scripts/bench_catalogue.py builds them (Mult-VAE 600-200-600; BERT4Rec
the fixture's encoder with a random item table), fp32 with and without the int8 screen. Each
measurement is one `recsys predict --threads 2` process under /usr/bin/time (wall seconds, peak
resident set): with 1 history (load, one scan) and with 256 (every page the kernels read touched).
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
from bench_catalogue import FIRST_ID, RECSYS, checkpoints, convert  # noqa: E402

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


def run(engine: Path, users: Path) -> tuple[float, float]:
    """(wall seconds, peak resident MiB) of one predict process."""
    out = users.with_suffix(".out.jsonl")
    timed = subprocess.run(["/usr/bin/time", "-f", "%e %M", str(RECSYS), "predict", "--engine", str(engine),
                            "--input", str(users), "--output", str(out), "--threads", "2", "--k", "10"],
                           capture_output=True, text=True, timeout=1800, check=True)
    seconds, kib = timed.stderr.strip().splitlines()[-1].split()
    return float(seconds), int(kib) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", default="100000")
    parser.add_argument("--models", default="vaecf,bert4rec")
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
                users = {}
                for n in (1, 256):
                    path = work / f"users{n}.jsonl"
                    path.write_text("".join(
                        json.dumps({"item_ids": [int(FIRST_ID + i) for i in rng.integers(0, items, 20)]}) + "\n"
                        for _ in range(n)))
                    users[n] = path
                for screen in ("none", "int8"):
                    new = work / f"engine-{screen}"
                    convert(kind, ckpt, cfg, item_map, new, ["--screen", screen])
                    old = work / f"engine-{screen}-previous"
                    previous_format(new, old)
                    size = sum(f.stat().st_size for f in new.iterdir())
                    for label, engine in (("mapped", new), ("packed at load", old)):
                        run(engine, users[1])  # warm the page cache: both read the same files
                        load_s, load_mib = run(engine, users[1])
                        full_s, full_mib = run(engine, users[256])
                        rows.append((kind, items, screen, label, size / 2**20, kernel_bytes(new) / 2**20,
                                     load_s, load_mib, full_s, full_mib))
                        print(rows[-1], flush=True)
                    for engine in (new, old):
                        for f in engine.iterdir():
                            f.unlink()
                        engine.rmdir()
                for f in (ckpt, cfg, item_map):
                    f.unlink()
    lines = [
        f"## {datetime.date.today()} — loading by mapping (`scripts/bench.sh load --items {args.items}`)",
        "",
        f"{platform.processor() or platform.machine()}, `recsys predict --threads 2`, peak resident set from "
        "/usr/bin/time, page cache warm. Engine = all files; kernel bytes = what one scan reads.",
        "",
        "| model | items | screen | layout | engine MiB | kernel MiB | 1 history: s | peak MiB | "
        "256 histories: s | peak MiB | peak / kernel bytes |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, items, screen, label, size, kern, ls, lm, fs, fm in rows:
        lines.append(f"| {kind} | {items:,} | {screen} | {label} | {size:,.0f} | {kern:,.0f} | {ls:.2f} | {lm:,.0f} | "
                     f"{fs:.2f} | {fm:,.0f} | {fm / kern:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
