"""Every command block of the user guide (docs/guide/src) runs as a reader would run it: each page,
in the order of SUMMARY.md, in a fresh folder holding the demo model repository (converted by
scripts/convert-demo-models.sh, as `scripts/serve.sh` converts it), the fixtures under the names the
page gives them (model.pt, config.json, items.tsv, users.jsonl, ...), `recsys` on the PATH and
the built binary at target/release/recsys. A page that talks to a server gets a real tritonserver
over its folder's repository, started when its first command addresses 127.0.0.1:8000 or :8001
(those addresses are rewritten to the server's ports); a page that reads `s3://my-bucket/...` gets
a real S3-compatible server (moto) holding what the page expects there.

Every shell block runs under `set -euo pipefail` and must exit 0; every `curl` must get an HTTP 200
answer without an error; every Python block runs with the venv's interpreter and must exit 0. A
block the tests cannot run here says so in the page, right above it, with an HTML comment that
mdBook does not render:

    <!-- tests skip: all; REASON -->        the whole block (a Kubernetes cluster, a GPU, ...)
    <!-- tests skip: trtexec; REASON -->    only the commands that start with these words
    <!-- tests save as: retrieve.py -->     a file the page's commands run, written, not run

and the reason must say what is missing and where the same thing is tested instead. The one line
changed everywhere: `cargo build` is the test run's own build (scripts/test.sh), so it is not
repeated."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import FIXTURES
from triton_harness import ROOT, TritonServer

GUIDE = ROOT / "docs" / "guide" / "src"
MARKER = re.compile(r"<!--\s*tests (skip|save as):\s*(.*?)\s*-->\s*\n$")


@dataclass
class Block:
    page: str
    index: int
    lang: str
    text: str
    skip: list[str] = field(default_factory=list)  # command words, or ["all"]
    reason: str = ""
    save_as: str | None = None

    def where(self) -> str:
        return f"{self.page} block {self.index + 1} ({self.lang})"


def pages() -> list[str]:
    """The guide's pages in the reading order of SUMMARY.md."""
    return re.findall(r"\]\(([\w-]+\.md)\)", (GUIDE / "SUMMARY.md").read_text())


def blocks(page: str) -> list[Block]:
    text = (GUIDE / page).read_text()
    found = []
    for index, match in enumerate(re.finditer(r"^```(\w+)\n(.*?)^```", text, flags=re.S | re.M)):
        block = Block(page, index, match.group(1), match.group(2))
        marker = MARKER.search(text[:match.start()][-400:])
        if marker and marker.group(1) == "skip":
            words, _, block.reason = marker.group(2).partition(";")
            block.skip = [w.strip() for w in words.split(",")]
            block.reason = block.reason.strip()
        elif marker:
            block.save_as = marker.group(2)
        found.append(block)
    return found


def test_every_block_of_the_guide_is_run_or_says_why_not():
    """The guide's fenced blocks are shell or Python; each one not run names what is missing here."""
    assert pages(), "SUMMARY.md lists no page"
    assert sorted(pages()) == sorted(p.name for p in GUIDE.glob("*.md") if p.name != "SUMMARY.md")
    every = [b for page in pages() for b in blocks(page)]
    assert {b.lang for b in every} <= {"sh", "python"}, {b.lang for b in every}
    skipped = [b for b in every if b.skip]
    for b in skipped:
        assert len(b.reason) > 40, f"{b.where()}: a skipped block says why, and where it is tested instead"
    # Most of the guide runs: what is skipped is what this machine cannot have (a cluster, a GPU).
    assert len(skipped) <= len(every) // 3, [b.where() for b in skipped]


# What a reader of each page has in their folder, under the names the page uses: (name, source),
# the source relative to the page's folder (the demo files) or absolute (the fixtures).
COMMON_FILES = {
    "item_id_map.tsv": FIXTURES / "multivae" / "item_id_map.tsv",
    "model.pt": FIXTURES / "bert4rec" / "model.pt",
    "model.safetensors": FIXTURES / "multivae" / "model.safetensors",
    "config.json": FIXTURES / "multivae" / "config.json",
    "test_set.tsv": FIXTURES / "test_set.tsv",
    "items.tsv": "build/demo-attributes/multivae.tsv",
    "train.inter": "build/demo-attributes/interactions.inter",
}
PAGE_FILES: dict[str, dict[str, Path | str]] = {
    "convert.md": {
        "config.json": FIXTURES / "bert4rec" / "config.json",
        "official_trainer_checkpoint.pt": FIXTURES / "hstu" / "official_trainer_checkpoint.pt",
        "hstu-sampled-softmax-n128-final.gin": FIXTURES / "hstu" / "train.gin",
    },
    "onnx.md": {"config.json": FIXTURES / "bert4rec" / "config.json"},
    "serving.md": {"engines/vaecf": "model_repository/vaecf/1", "engines/bert4rec": "model_repository/bert4rec/1"},
}
# Python blocks run after these lines: what the reader's machine has that this one lacks.
PRELUDE = {
    # Ray on a machine with room for the page's four one-thread actors and Ray Data's own tasks
    # (this one has two cores; Ray takes the CPU count it is given as the schedule's).
    ("python.md", 3): "import ray\nray.init(num_cpus=6, include_dashboard=False)\n",
}


def held_out_rows() -> list[list[str]]:
    return [line.split("\t") for line in (FIXTURES / "test_set.tsv").read_text().splitlines()[1:]]


def write_users(path: Path, n: int = 40) -> None:
    """users.jsonl: held-out histories of the fixture's test set, as `recsys predict` reads them."""
    with path.open("w") as out:
        for user, _, history in held_out_rows()[:n]:
            out.write(json.dumps({"user_id": int(user), "item_ids": [int(i) for i in history.split()]}) + "\n")


@pytest.fixture(scope="module")
def demo_site(tmp_path_factory, recsys_bin) -> Path:
    """The demo repository as scripts/serve.sh converts it (its scripts run in a copy, so they write
    here and not into the checkout)."""
    site = tmp_path_factory.mktemp("guide-site")
    shutil.copytree(ROOT / "scripts", site / "scripts")
    (site / "tests").mkdir()
    (site / "tests" / "fixtures").symlink_to(FIXTURES)
    for config in (ROOT / "model_repository").glob("*/config.pbtxt"):
        (site / "model_repository" / config.parent.name).mkdir(parents=True)
        shutil.copy(config, site / "model_repository" / config.parent.name / "config.pbtxt")
    run = subprocess.run(["scripts/convert-demo-models.sh", str(recsys_bin)], cwd=site, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    return site


def place(folder: Path, name: str, source: Path | str) -> None:
    target = folder / name
    source = Path(source) if Path(source).is_absolute() else folder / source
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.is_dir():
        shutil.rmtree(target)
    target.symlink_to(source)


def prepare_release(folder: Path, recsys_bin: Path) -> None:
    """A repository whose bert4rec has no version yet (the page publishes the first), and three
    engines of it to publish: fp32, fp16, int8."""
    for version in (folder / "model_repository" / "bert4rec").iterdir():
        if version.is_dir():
            shutil.rmtree(version)
    for name, precision in [("v1", "fp32"), ("v2", "fp16"), ("v3", "int8")]:
        subprocess.run([str(recsys_bin), "convert", "--kind", "bert4rec", "--checkpoint", str(FIXTURES / "bert4rec" / "model.pt"),
                        "--config", str(FIXTURES / "bert4rec" / "config.json"), "--item-map",
                        str(FIXTURES / "bert4rec" / "item_id_map.tsv"), "--precision", precision,
                        "--output", str(folder / "out" / f"bert4rec-{name}")], check=True, capture_output=True)


def prepare_live_data(folder: Path, recsys_bin: Path) -> None:
    """delta.parquet as the page's comment describes it (12 items added, 3 replaced, 2 retired),
    made from the engine's own rows, and new.inter: the test users' sessions with five new
    products in them (what fold-in fits)."""
    items = folder / "exported"
    subprocess.run([str(recsys_bin), "export-items", "--engine", str(folder / "model_repository/vaecf/1"),
                    "--output", str(items), "--format", "parquet", "--with-input-rows"], check=True, capture_output=True)
    table = pq.read_table(items.with_suffix(".parquet"))
    rows = table.slice(0, 17).to_pylist()
    for n, row in enumerate(rows[:12]):
        row["item_id"] = 20_000_000 + n
    for n, row in enumerate(rows):
        row["op"] = "upsert" if n < 15 else "retire"
        if row["op"] == "retire":  # an item withdrawn: its id alone
            row["vector"] = row["input_vector"] = None
    pq.write_table(pa.Table.from_pylist(rows), folder / "delta.parquet")
    lines = ["user_id:token\titem_id:token\ttimestamp:float"]
    for u, (user, _, history) in enumerate(held_out_rows()[:400]):
        session = history.split()
        session.insert(len(session) // 2, str(30_000_000 + u % 5))
        lines += [f"{user}\t{item}\t{1_600_000_000 + 60 * t}" for t, item in enumerate(session)]
    (folder / "new.inter").write_text("\n".join(lines) + "\n")
    # The release path manages the model the page compacts: its version 1 published as the first.
    engine = folder / "model_repository" / "vaecf" / "1"
    engine.rename(folder / "vaecf-v1")
    subprocess.run([str(recsys_bin), "publish", "--repository", str(folder / "model_repository"), "--model", "vaecf",
                    "--engine", str(folder / "vaecf-v1"), "--approve"], check=True, capture_output=True)


def prepare_serving(folder: Path, recsys_bin: Path) -> None:
    """The retrieval example's config: the USER_EMBEDDING line of vaecf's config uncommented, as
    the page says to."""
    config = folder / "model_repository" / "vaecf" / "config.pbtxt"
    text = config.read_text()
    line = '  # , { name: "USER_EMBEDDING"'
    assert line in text, "the page's instruction no longer matches the demo config"
    config.write_text(text.replace(line, '  , { name: "USER_EMBEDDING"'))


def prepare_convert(folder: Path, recsys_bin: Path) -> None:
    """The page converts BERT4Rec into the repository itself."""
    shutil.rmtree(folder / "model_repository" / "bert4rec" / "1")


PREPARE = {"convert.md": prepare_convert, "release.md": prepare_release, "live-data.md": prepare_live_data, "serving.md": prepare_serving}


def shell_script(block: Block) -> str:
    """The block as bash runs it: skipped commands and `cargo build` left out, with the lines
    that continue them."""
    kept, dropping, continued = [], False, False
    for line in block.text.splitlines():
        # A command starts at a line that is not indented (a quoted body's lines are) and that no
        # backslash continues.
        if not continued and line.strip() and not line[0].isspace():
            dropping = line.split()[0] in block.skip or line.startswith("cargo build")
        if not dropping:
            kept.append(line)
        continued = line.rstrip().endswith("\\")
    return "\n".join(kept) + "\n"


class PageRun:
    """The page's folder, its environment and, once needed, its tritonserver."""

    def __init__(self, page: str, folder: Path, backend_dir: Path, recsys_bin: Path):
        self.page, self.folder, self.backend_dir = page, folder, backend_dir
        self.server: TritonServer | None = None
        venv_bin = Path(sys.executable).parent
        self.env = {**os.environ, "PATH": f"{recsys_bin.parent}:{venv_bin}:{os.environ['PATH']}"}

    def addresses(self, text: str) -> str:
        if "127.0.0.1:800" not in text:
            return text
        if self.server is None:
            self.server = TritonServer(self.folder / "model_repository", self.backend_dir, explicit=True,
                                       load_models=["*"], log_path=self.folder / "tritonserver.log")
            self.server.start(timeout=120)
        host, grpc = self.server.http_url, self.server.grpc_url
        return text.replace("127.0.0.1:8000", host).replace("127.0.0.1:8001", grpc)

    def run_shell(self, block: Block) -> str:
        script = shell_script(block)
        # The server starts before the first command that addresses it (the commands above it may
        # be what makes its repository loadable).
        lines = script.splitlines(keepends=True)
        first = next((i for i, line in enumerate(lines) if "127.0.0.1:800" in line), len(lines))
        out = self._bash(block, "".join(lines[:first]))
        if first < len(lines):
            out += self._bash(block, self.addresses("".join(lines[first:])))
        return out

    def _bash(self, block: Block, script: str) -> str:
        prelude = ("set -euo pipefail\n"
                   "curl() { command curl --fail-with-body --max-time 60 \"$@\"; echo; }\n")
        run = subprocess.run(["bash", "-c", prelude + script], cwd=self.folder, env=self.env, capture_output=True,
                             text=True, timeout=600)
        assert run.returncode == 0, f"{block.where()} failed ({run.returncode}):\n{script}\n{run.stdout}\n{run.stderr}"
        # A server's answers (curl): no error, and the page's examples each recommend something.
        for line in (line for line in run.stdout.splitlines() if line.startswith('{"model_name"')):
            answer = json.loads(line)
            assert "error" not in answer and answer["outputs"], f"{block.where()}: {line}"
            assert all(out["shape"][-1] > 0 for out in answer["outputs"]), f"{block.where()}: an empty answer: {line}"
        return run.stdout

    def run_python(self, block: Block) -> None:
        code = PRELUDE.get((block.page, block.index), "") + block.text
        run = subprocess.run([sys.executable, "-c", self.addresses(code)], cwd=self.folder, env=self.env,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, f"{block.where()} failed:\n{block.text}\n{run.stderr[-4000:]}"

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


@pytest.mark.parametrize("page", pages())
def test_the_guide_page_runs_as_written(page, demo_site, recsys_bin, backend_dir, tmp_path):
    page_blocks = blocks(page)
    if not page_blocks:
        pytest.skip(f"{page} has no command block")
    folder = tmp_path / "site"
    shutil.copytree(demo_site, folder, symlinks=True)
    (folder / "target" / "release").mkdir(parents=True)
    (folder / "target" / "release" / "recsys").symlink_to(recsys_bin)
    for name in (".venv", "examples", "deploy", "python", "docker"):
        (folder / name).symlink_to(ROOT / name)
    for name, source in {**COMMON_FILES, **PAGE_FILES.get(page, {})}.items():
        place(folder, name, source)
    write_users(folder / "users.jsonl")
    write_users(folder / "calib.jsonl", n=200)
    if page in PREPARE:
        PREPARE[page](folder, recsys_bin)
    for block in page_blocks:
        if block.save_as:
            (folder / block.save_as).write_text(block.text)
    run = PageRun(page, folder, backend_dir, recsys_bin)
    s3 = None
    try:
        if any("s3://my-bucket/" in b.text for b in page_blocks if "all" not in b.skip):
            s3 = s3_bucket(folder, run.env)
        for block in page_blocks:
            if block.save_as or "all" in block.skip:
                continue
            if block.lang == "sh":
                out = run.run_shell(block)
                for shown in published_lines(block):
                    pattern = ".*".join(re.escape(part) for part in shown.split("..."))
                    assert re.search(pattern, out), f"{block.where()} shows {shown!r}; the commands printed:\n{out}"
                CHECKS.get((page, block.index), lambda _b, _o: None)(block, out)
            else:
                run.run_python(block)
    finally:
        run.stop()
        if s3 is not None:
            s3.stop()


def s3_bucket(folder: Path, env: dict):
    """A real S3-compatible server holding the demo BERT4Rec engine at s3://my-bucket/repo/bert4rec/7,
    reached through the standard AWS variables (endpoint, keys)."""
    from s3_harness import CREDENTIALS, S3Server

    s3 = S3Server(folder / "moto.log").start()
    client = s3.client()
    client.create_bucket(Bucket="my-bucket")
    for f in sorted((folder / "model_repository" / "bert4rec" / "1").iterdir()):
        client.upload_file(str(f), "my-bucket", f"repo/bert4rec/7/{f.name}")
    env.update(CREDENTIALS, AWS_ENDPOINT_URL=s3.endpoint, AWS_ALLOW_HTTP="true")
    return s3


def published_lines(block: Block) -> list[str]:
    """The page's "# published ..." comments (joined over the comment lines that continue them): what
    a publishing command above them prints, `...` standing for what varies."""
    shown, current = [], None
    for line in block.text.splitlines():
        if line.startswith("# published "):
            current = line[2:]
            shown.append(current)
        elif current is not None and line.startswith("# ") and shown[-1].endswith(","):
            shown[-1] += " " + line[2:]
        else:
            current = None
    return shown


def shows_its_output(block: Block, out: str) -> None:
    """The comment lines under the block's first command are what that command prints."""
    lines = block.text.splitlines()
    shown = []
    for line in lines[1:]:
        if not line.startswith("# "):
            break
        shown.append(" ".join(line[1:].split()))
    printed = [" ".join(line.split()) for line in out.splitlines()[:len(shown)]]
    assert printed == shown, f"{block.where()}: the page shows {shown}, the command prints {printed}"


CHECKS = {("business-rules.md", 0): shows_its_output}
