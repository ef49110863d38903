"""Session fixtures: a model repository built with the real `recsys convert` from the fixture
checkpoints, and one real tritonserver serving it (explicit model control), always stopped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from triton_harness import ROOT, TritonServer  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"

# Screen plans (measured when a screened engine loads) go to a folder of the test run, not the
# user's cache; every server and command started by the tests inherits it.
os.environ.setdefault("RECSYS_PLAN_DIR", str(Path(tempfile.mkdtemp(prefix="recsys-plans-"))))

# Models the shared server loads at start; the broken ones are loaded by the tests that need them.
GOOD_MODELS = ["bert4rec", "vaecf", "bert4rec_str", "bert4rec_strict", "minimal", "bert4rec_x2", "bert4rec_batching",
               "vaecf_int8", "bert4rec_mixed", "vaecf_screened", "bert4rec_emb", "vaecf_emb",
               "sasrec", "gru4rec", "sasrec_emb", "gru4rec_emb", "sasrec_mixed", "gru4rec_mixed", "gru4rec_minimal",
               "vaecf_candidates", "retrieve_and_rank", "sasrec_cold", "vaecf_cold", "vaecf_cold_model",
               "gru4rec_nocache", "sasrec_nocache", "hstu", "hstu_nocache"]
BROKEN_MODELS = [
    "bert4rec_prefix_cache",
    "missing_engine",
    "corrupted_engine",
    "future_format",
    "bad_parameter",
    "contradicting",
    "gpu_instance",
    "engine_too_big",
    "popular_without_list",
]


def _path_from_env(var: str, default: Path) -> Path:
    return Path(os.environ.get(var, default))


@pytest.fixture(scope="session")
def recsys_bin() -> Path:
    path = _path_from_env("RECSYS_BIN", ROOT / "target" / "release" / "recsys")
    if not path.exists():
        pytest.fail(f"{path} is missing: run scripts/test.sh (it builds it)")
    return path


@pytest.fixture(scope="session")
def backend_dir() -> Path:
    path = _path_from_env("RECSYS_TEST_BACKEND_DIR", ROOT / "build" / "test-backends")
    if not (path / "recsys" / "libtriton_recsys.so").exists():
        pytest.fail(f"{path}/recsys/libtriton_recsys.so is missing: run scripts/test.sh (it builds it)")
    return path


def demo_attributes(model_dir: str) -> Path:
    """The demo item attribute table of a fixture's catalogue (scripts/demo-item-attributes.sh), as
    scripts/convert-demo-models.sh makes it: category, region (a list), age_rating."""
    out = ROOT / "build" / "demo-attributes" / f"{model_dir}.tsv"
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(ROOT / "scripts" / "demo-item-attributes.sh"),
                    str(FIXTURES / model_dir / "item_id_map.tsv"), str(out)], check=True)
    return out


def read_attributes(path: Path) -> dict[str, set[int]]:
    """The item sets of an attribute table, by name ("category=shoes"), read here independently of
    recsys: ids as the table writes them."""
    sets: dict[str, set[int]] = {}
    lines = path.read_text().splitlines()
    columns = lines[0].split("\t")[1:]
    for line in lines[1:]:
        fields = line.split("\t")
        for column, cell in zip(columns, fields[1:]):
            for value in filter(None, cell.split("|")):
                sets.setdefault(f"{column}={value}", set()).add(int(fields[0]))
    return sets


def convert(recsys_bin: Path, kind: str, model_dir: str, checkpoint: str, out: Path, item_map: Path | None = None,
            extra: list[str] | None = None):
    """`recsys convert` of a fixture; with its own item map, with the demo item attributes too."""
    src = FIXTURES / model_dir
    attributes = [] if item_map else ["--item-attributes", str(demo_attributes(model_dir))]
    subprocess.run(
        [
            str(recsys_bin), "convert", "--force", "--kind", kind,
            "--checkpoint", str(src / checkpoint),
            "--config", str(src / "config.json"),
            "--item-map", str(item_map or src / "item_id_map.tsv"),
            "--out", str(out),
            *attributes,
            *(extra or []),
        ],
        check=True,
        capture_output=True,
    )


def contract_config(name: str, *, id_type: str = "TYPE_INT64", params: dict | None = None,
                    kind: str = "KIND_CPU", count: int = 1, score_type: str = "TYPE_FP32",
                    queue_delay_us: int = 100, embedding_width: int | None = None) -> str:
    """config.pbtxt following the serving contract of design.md section 2 (with the USER_EMBEDDING
    output when embedding_width is given)."""
    params = {"top_k": "10", **(params or {})}
    embedding = ("" if embedding_width is None else
                 f',\n  {{ name: "USER_EMBEDDING" data_type: TYPE_FP32 dims: [ {embedding_width} ] }}')
    param_text = ",\n  ".join(
        f'{{ key: "{k}" value {{ string_value: "{v}" }} }}' for k, v in params.items()
    )
    return f"""name: "{name}"
backend: "recsys"
max_batch_size: 64
input [
  {{ name: "ITEM_IDS" data_type: {id_type} dims: [ -1 ] allow_ragged_batch: true }},
  {{ name: "K" data_type: TYPE_INT32 dims: [ 1 ] optional: true }},
  {{ name: "EXCLUDE_ITEM_IDS" data_type: {id_type} dims: [ -1 ] optional: true allow_ragged_batch: true }},
  {{ name: "CANDIDATE_ITEM_IDS" data_type: {id_type} dims: [ -1 ] optional: true allow_ragged_batch: true }},
  {{ name: "INCLUDE_ITEM_SETS" data_type: TYPE_STRING dims: [ -1 ] optional: true allow_ragged_batch: true }},
  {{ name: "EXCLUDE_ITEM_SETS" data_type: TYPE_STRING dims: [ -1 ] optional: true allow_ragged_batch: true }}
]
output [
  {{ name: "TOP_ITEM_IDS" data_type: {id_type} dims: [ -1 ] }},
  {{ name: "TOP_SCORES" data_type: {score_type} dims: [ -1 ] }}{embedding}
]
dynamic_batching {{ max_queue_delay_microseconds: {queue_delay_us} }}
instance_group [ {{ kind: {kind} count: {count} }} ]
parameters [
  {param_text}
]
"""


def with_user_embedding(demo_config: str) -> str:
    """A demo config with its USER_EMBEDDING line uncommented, as its comment tells users to do."""
    line = '  # , { name: "USER_EMBEDDING"'
    assert demo_config.count(line) == 1, "the demo config no longer carries the line to uncomment"
    return demo_config.replace(line, '  , { name: "USER_EMBEDDING"')


@pytest.fixture(scope="session")
def repository(tmp_path_factory, recsys_bin) -> Path:
    repo = tmp_path_factory.mktemp("triton") / "model_repository"
    repo.mkdir()

    def model(name: str, config: str, engine: Path | None) -> Path:
        d = repo / name
        d.mkdir()
        (d / "config.pbtxt").write_text(config)
        if engine is not None:
            shutil.copytree(engine, d / "1")
        return d

    engines = repo.parent / "engines"
    convert(recsys_bin, "bert4rec", "bert4rec", "model.pt", engines / "bert4rec")
    convert(recsys_bin, "vaecf", "multivae", "model.safetensors", engines / "vaecf")
    convert(recsys_bin, "vaecf", "multivae", "model.safetensors", engines / "vaecf_int8", extra=["--precision", "int8"])
    convert(recsys_bin, "vaecf", "multivae", "model.safetensors", engines / "vaecf_screened", extra=["--screen", "int8"])
    # SASRec from RecBole's own checkpoint (kind and config read from it), GRU4Rec from its state dict.
    subprocess.run([str(recsys_bin), "convert", "--force", "--checkpoint", str(FIXTURES / "sasrec" / "recbole_checkpoint.pth"),
                    "--item-map", str(FIXTURES / "sasrec" / "item_id_map.tsv"), "--output", str(engines / "sasrec"),
                    "--item-attributes", str(demo_attributes("sasrec"))],
                   check=True, capture_output=True)
    convert(recsys_bin, "gru4rec", "gru4rec", "model.pt", engines / "gru4rec")
    # HSTU from the official trainer's checkpoint and the gin config it was trained with (the
    # kind read from its tensor names); served with a minimal config the backend completes.
    subprocess.run([str(recsys_bin), "convert", "--checkpoint", str(FIXTURES / "hstu" / "official_trainer_checkpoint.pt"),
                    "--gin", str(FIXTURES / "hstu" / "train.gin"), "--item-map", str(FIXTURES / "hstu" / "item_id_map.tsv"),
                    "--output", str(engines / "hstu")], check=True, capture_output=True)
    model("hstu", 'backend: "recsys"\nmax_batch_size: 16\ndynamic_batching { max_queue_delay_microseconds: 100 }\n',
          engines / "hstu")
    # Without its prefix cache (on by default): the reference the cached answers must equal.
    model("hstu_nocache", 'backend: "recsys"\nmax_batch_size: 16\n'
          'parameters { key: "prefix_cache_bytes" value: { string_value: "0" } }\n', engines / "hstu")
    # The same BERT4Rec with a catalogue keyed by strings ("sku-<id>").
    lines = (FIXTURES / "bert4rec" / "item_id_map.tsv").read_text().splitlines()[1:]
    string_map = repo.parent / "string_map.tsv"
    string_map.write_text("".join(f"{i}\tsku-{e}\n" for i, e in (l.split("\t") for l in lines)))
    convert(recsys_bin, "bert4rec", "bert4rec", "model.safetensors", engines / "bert4rec_str", string_map)

    # The demo configs as shipped, so the tests cover what users deploy; and each with the one line
    # its comment says to uncomment for a retrieval stage (the USER_EMBEDDING output).
    for name in ["bert4rec", "vaecf", "sasrec", "gru4rec"]:
        config = (ROOT / "model_repository" / name / "config.pbtxt").read_text()
        model(name, config, engines / name)
        if name == "vaecf":
            # Its live stock feed, as scripts/convert-demo-models.sh publishes it.
            assert "availability_source" in config
            feed = repo.parent / f"{name}-stock.tsv"
            subprocess.run([str(ROOT / "scripts" / "demo-stock.sh"),
                            str(FIXTURES / "multivae" / "item_id_map.tsv"), str(feed)], check=True)
            subprocess.run([str(recsys_bin), "availability", "publish", "--repository", str(repo), "--model", name,
                            str(feed)], check=True, capture_output=True)
        model(f"{name}_emb", with_user_embedding(config).replace(f'name: "{name}"', f'name: "{name}_emb"'),
              engines / name)
    # The demo repository's ensemble as shipped: VAE-CF's candidates ranked by BERT4Rec in one call.
    model("vaecf_candidates", (ROOT / "model_repository" / "vaecf_candidates" / "config.pbtxt").read_text(),
          engines / "vaecf")
    model("retrieve_and_rank", (ROOT / "model_repository" / "retrieve_and_rank" / "config.pbtxt").read_text(), None)
    (repo / "retrieve_and_rank" / "1").mkdir()
    model("bert4rec_str", contract_config("bert4rec_str", id_type="TYPE_STRING"), engines / "bert4rec_str")
    model("vaecf_int8", contract_config("vaecf_int8"), engines / "vaecf_int8")
    # Two threads: its log names the thread plan (measured at load). The screen is pinned on: its
    # tests count the screen's survivors, and a plan measured on a loaded machine may choose the
    # plain scan (the same answers, no survivors to count).
    model("vaecf_screened", contract_config("vaecf_screened", params={"threads": "2", "screen_policy": "always"}),
          engines / "vaecf_screened")
    model("bert4rec_strict", contract_config("bert4rec_strict", params={"unknown_item_policy": "error"}), engines / "bert4rec")
    model("minimal", 'backend: "recsys"\nmax_batch_size: 16\n', engines / "bert4rec")
    model("gru4rec_minimal", 'backend: "recsys"\nmax_batch_size: 16\n', engines / "gru4rec")
    model("bert4rec_x2", contract_config("bert4rec_x2", count=2), engines / "bert4rec")
    # A 20 ms queue delay: requests sent together are certain to be batched, however fast the engine.
    model("bert4rec_batching", contract_config("bert4rec_batching", queue_delay_us=20000), engines / "bert4rec")
    # The same window, unknown ids refused, and the USER_EMBEDDING output: one Execute mixes every
    # kind of request (whole catalogue, candidates, embeddings) and every kind of refusal.
    for name in ["bert4rec", "sasrec", "gru4rec"]:
        model(f"{name}_mixed", contract_config(f"{name}_mixed", queue_delay_us=20000, embedding_width=65,
                                               params={"unknown_item_policy": "error"}), engines / name)

    # Visitors without history: SASRec (no answer of its own for them) and Mult-VAE converted with
    # the demo interaction log's popularity list, under the explicit and the default policy.
    interactions = ROOT / "build" / "demo-attributes" / "interactions.inter"
    subprocess.run([str(ROOT / "scripts" / "demo-interactions.sh"), str(interactions)], check=True)
    subprocess.run([str(recsys_bin), "convert", "--force", "--checkpoint", str(FIXTURES / "sasrec" / "recbole_checkpoint.pth"),
                    "--item-map", str(FIXTURES / "sasrec" / "item_id_map.tsv"), "--output", str(engines / "sasrec_cold"),
                    "--item-attributes", str(demo_attributes("sasrec")), "--interactions", str(interactions)],
                   check=True, capture_output=True)
    convert(recsys_bin, "vaecf", "multivae", "model.safetensors", engines / "vaecf_cold",
            extra=["--interactions", str(interactions)])
    model("sasrec_cold", contract_config("sasrec_cold", params={"empty_history_policy": "popular"}),
          engines / "sasrec_cold")
    model("vaecf_cold", contract_config("vaecf_cold"), engines / "vaecf_cold")
    model("vaecf_cold_model", contract_config("vaecf_cold_model", params={"empty_history_policy": "model"}),
          engines / "vaecf_cold")
    # Popular without a popularity list: refused at load, naming the fix.
    model("popular_without_list", contract_config("popular_without_list", params={"empty_history_policy": "popular"}),
          engines / "vaecf")

    # GRU4Rec and SASRec without their prefix caches (on by default): the references the cached
    # answers must equal.
    model("gru4rec_nocache", contract_config("gru4rec_nocache", params={"prefix_cache_bytes": "0"}),
          engines / "gru4rec")
    model("sasrec_nocache", contract_config("sasrec_nocache", params={"prefix_cache_bytes": "0"}),
          engines / "sasrec")
    # A prefix cache asked of a model that recomputes every history: refused at load, naming why.
    model("bert4rec_prefix_cache", contract_config("bert4rec_prefix_cache", params={"prefix_cache_bytes": "1000000"}),
          engines / "bert4rec")

    # Models that must fail to load, each for one reason.
    model("missing_engine", contract_config("missing_engine"), None)
    (repo / "missing_engine" / "1").mkdir()
    d = model("corrupted_engine", contract_config("corrupted_engine"), engines / "bert4rec")
    weights = d / "1" / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    d = model("future_format", contract_config("future_format"), engines / "bert4rec")
    manifest = json.loads((d / "1" / "manifest.json").read_text())
    manifest["format_version"] = 99
    (d / "1" / "manifest.json").write_text(json.dumps(manifest))
    model("bad_parameter", contract_config("bad_parameter", params={"top_k": "many"}), engines / "bert4rec")
    # A string catalogue cannot answer with INT64 ids.
    model("contradicting", contract_config("contradicting"), engines / "bert4rec_str")
    model("gpu_instance", contract_config("gpu_instance", kind="KIND_GPU"), engines / "bert4rec")
    model("engine_too_big", contract_config("engine_too_big", params={"max_engine_bytes": "4096"}),
          engines / "bert4rec")
    return repo


@pytest.fixture(scope="session")
def server(repository, backend_dir):
    srv = TritonServer(repository, backend_dir, explicit=True, load_models=GOOD_MODELS,
                       log_path=repository.parent / "tritonserver.log")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    """The real tritonclient over HTTP (8 connections, for the concurrent tests)."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url, concurrency=8)
    yield client
    # An open keep-alive connection holds a stopping tritonserver for its whole exit timeout.
    client.close()


@pytest.fixture(scope="module")
def grpc(server):
    """The real tritonclient over gRPC."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def predict(recsys_bin, repository, tmp_path_factory):
    """Runs `recsys predict` (the engine offline) on histories; returns [(ids, scores)]."""
    workdir = tmp_path_factory.mktemp("predict")

    def run(model: str, histories: list[list], k: int) -> list[tuple[list, list]]:
        src = workdir / f"{model}-in.jsonl"
        dst = workdir / f"{model}-out.jsonl"
        src.write_text("".join(json.dumps({"item_ids": h}) + "\n" for h in histories))
        subprocess.run(
            [str(recsys_bin), "predict", "--engine", str(repository / model / "1"),
             "--input", str(src), "--output", str(dst), "--k", str(k)],
            check=True, capture_output=True,
        )
        out = [json.loads(l) for l in dst.read_text().splitlines()]
        return [(o["item_ids"], o["scores"]) for o in out]

    return run


def golden_cases(model_dir: str) -> list[dict]:
    return json.loads((FIXTURES / model_dir / "golden.json").read_text())["cases"]
