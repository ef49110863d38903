"""The Python package (`pip install ./python`, PyO3) against `recsys predict` and `recsys eval` on the
same engines: recommendations, re-ranking and embeddings bit for bit, scores against PyTorch's golden
logits, errors as Python exceptions, and the GIL released while the engine computes."""

from __future__ import annotations

import json
import re
from pathlib import Path
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import FIXTURES, convert, golden_cases

try:
    import recsys
except ImportError as missing:  # a collection error, not a skip: CI must not pass without the package
    raise ImportError("the recsys Python package is not installed: .venv/bin/pip install ./python "
                      "(scripts/test.sh does)") from missing

# PyTorch f32 against the engine's f32 kernels: only summation order differs.
LOGIT_ABS_TOL = 5e-5
USERS = 300


@pytest.fixture(scope="module")
def engines(recsys_bin, tmp_path_factory):
    root = tmp_path_factory.mktemp("python_engines")
    out = {}
    for name, kind, model_dir, extra in [
        ("bert4rec", "bert4rec", "bert4rec", []),
        ("vaecf", "vaecf", "multivae", []),
        ("vaecf_int8", "vaecf", "multivae", ["--precision", "int8"]),
        ("bert4rec_bf16", "bert4rec", "bert4rec", ["--precision", "bf16"]),
        ("sasrec", "sasrec", "sasrec", []),
        ("gru4rec", "gru4rec", "gru4rec", []),
    ]:
        convert(recsys_bin, kind, model_dir, "model.safetensors", root / name, extra=extra)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def users():
    rows = [line.split("\t") for line in (FIXTURES / "test_set.tsv").read_text().splitlines()[1:USERS + 1]]
    return [[int(x) for x in r[2].split()] for r in rows]


def predict(recsys_bin, engine, lines: list[dict], tmp_path, *flags) -> list[dict]:
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    subprocess.run([str(recsys_bin), "predict", "--engine", str(engine), "--input", str(src), "--output", str(dst),
                    *flags], check=True, capture_output=True)
    return [json.loads(line) for line in dst.read_text().splitlines()]


@pytest.mark.parametrize("name", ["bert4rec", "vaecf", "vaecf_int8", "bert4rec_bf16", "sasrec", "gru4rec"])
def test_recommend_equals_recsys_predict_bit_for_bit(recsys_bin, engines, users, tmp_path, name):
    # A bf16 engine pinned to AMX tiles at every batch size where the CPU has them: under "auto"
    # each front end measures its own plan, and tiles add in another order than the SIMD kernels.
    amx = "on" if name.endswith("_bf16") else "auto"
    engine = recsys.Engine(engines[name], threads=2, amx=amx)
    assert (engine.kind, engine.num_items, engine.threads) == (name.split("_")[0], 2000, 2)
    assert engine.precision == (name.split("_")[1] if "_" in name else "fp32")
    # The metadata as a plain dict, the manifest's own fields inside it.
    info = engine.info
    manifest = json.loads((Path(engines[name]) / "manifest.json").read_text())
    assert (info["kind"], info["num_items"], info["precision"], info["threads"]) == \
        (engine.kind, 2000, engine.precision, 2)
    assert info["manifest"]["source"] == manifest["source"] and info["id_type"] == manifest["id_type"]
    assert info["weights_sha256"] == manifest["files"]["weights.safetensors"]["sha256"]
    assert info["catalogue_version"] is None and json.loads(json.dumps(info)) == info
    ids, scores = engine.recommend(users, k=20)
    assert ids.shape == scores.shape == (len(users), 20) and ids.dtype == np.int64 and scores.dtype == np.float32
    want = predict(recsys_bin, engines[name], [{"item_ids": h} for h in users], tmp_path, "--k", "20",
                   "--amx", amx)
    for row, (got_ids, got_scores, line) in enumerate(zip(ids, scores, want)):
        assert got_ids.tolist() == line["item_ids"], f"user {row}"
        np.testing.assert_array_equal(got_scores, np.float32(line["scores"]))
    # numpy arrays in, the same answers out; an exclusion list per history is honoured.
    again, _ = engine.recommend([np.array(h, dtype=np.int64) for h in users[:8]], k=20)
    assert (again == ids[:8]).all()
    excluded, _ = engine.recommend(users[:8], k=20, exclude=[[int(i[0])] for i in ids[:8]])
    assert all(int(first[0]) not in row.tolist() for first, row in zip(ids[:8], excluded))


def test_rerank_and_embed_equal_recsys_predict_bit_for_bit(recsys_bin, engines, users, tmp_path):
    engine = recsys.Engine(engines["bert4rec"])
    rng = np.random.default_rng(4)
    catalogue = engine.item_ids
    assert catalogue.dtype == np.int64 and len(catalogue) == engine.num_items
    candidates = [[int(x) for x in rng.choice(catalogue, size=int(rng.integers(5, 400)), replace=False)]
                  for _ in users]
    ids, scores = engine.rerank(users, candidates, k=10)
    embeddings = engine.embed(users)
    assert embeddings.shape == (len(users), engine.embedding_dim) and (embeddings[:, -1] == 1.0).all()
    want = predict(recsys_bin, engines["bert4rec"],
                   [{"item_ids": h, "candidate_item_ids": c} for h, c in zip(users, candidates)], tmp_path,
                   "--k", "10", "--return-embedding")
    for row, line in enumerate(want):
        n = len(line["item_ids"])
        assert ids[row, :n].tolist() == line["item_ids"] and (ids[row, n:] == -1).all(), f"user {row}"
        np.testing.assert_array_equal(scores[row, :n], np.float32(line["scores"]))
        assert np.isneginf(scores[row, n:]).all()
        assert set(line["item_ids"]) <= set(candidates[row])
        np.testing.assert_array_equal(embeddings[row], np.float32(line["embedding"]))


@pytest.mark.parametrize("name,model_dir", [("bert4rec", "bert4rec"), ("vaecf", "multivae"), ("sasrec", "sasrec"),
                                            ("gru4rec", "gru4rec")])
def test_score_is_pytorchs_logits(engines, name, model_dir):
    engine = recsys.Engine(engines[name])
    cases = golden_cases(model_dir)[:16]
    scores = engine.score([c["history_ext"] for c in cases])
    assert scores.shape == (len(cases), engine.num_items)
    column = {int(e): j for j, e in enumerate(engine.item_ids)}
    for case, row in zip(cases, scores):
        for item in case["topk"][:50]:
            assert abs(row[column[item["external"]]] - item["score"]) <= LOGIT_ABS_TOL, case["case"]


def test_string_catalogues_answer_lists_of_strings(recsys_bin, tmp_path):
    lines = (FIXTURES / "bert4rec" / "item_id_map.tsv").read_text().splitlines()[1:]
    string_map = tmp_path / "map.tsv"
    string_map.write_text("".join(f"{i}\tsku-{e}\n" for i, e in (l.split("\t") for l in lines)))
    convert(recsys_bin, "bert4rec", "bert4rec", "model.safetensors", tmp_path / "engine", string_map)
    engine = recsys.Engine(tmp_path / "engine")
    assert engine.item_ids[0].startswith("sku-")
    ids, scores = engine.recommend([["sku-10011403", "sku-10011207"], []], k=5)
    assert isinstance(ids, list) and [len(r) for r in ids] == [5, 5] and all(i.startswith("sku-") for i in ids[0])
    assert np.isfinite(scores).all()


def test_errors_are_python_exceptions_with_the_engines_message(engines, tmp_path):
    with pytest.raises(FileNotFoundError):
        recsys.Engine(tmp_path / "nowhere")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "manifest.json").write_text("{}")
    with pytest.raises(recsys.RecsysError, match="manifest"):
        recsys.Engine(tmp_path / "broken")
    engine = recsys.Engine(engines["vaecf"])
    # In the package's terms: the argument and row, the id, and the strict= that refused it.
    with pytest.raises(ValueError, match=re.escape("histories[1] holds 1 id(s) the model does not know (-5); "
                                                   "strict=True refuses them")):
        engine.recommend([[10011403], [10011403, -5]], strict=True)
    with pytest.raises(ValueError, match=re.escape("candidates[0] holds 1 id(s) the model does not know (77)")):
        engine.rerank([[10011403]], [[10011207, 77]], strict=True)
    # An id of the wrong type: a TypeError under strict=True, a warning when it is dropped.
    with pytest.raises(TypeError, match=re.escape("histories[0][1] is 'abc', a str, but this engine's item "
                                                  "ids are integers")):
        engine.recommend([["10011403", "abc"]], strict=True)
    with pytest.warns(UserWarning, match=r"histories\[0\]\[0\] is 'abc'.*1 id\(s\) of the wrong type dropped"):
        ids, _ = engine.recommend([["abc", "10011403"]], k=5)
    assert ids.shape == (1, 5)
    with pytest.warns(UserWarning, match="of the wrong type dropped"):
        _, _, _, errors = engine.predict([["abc"], ["10011403"]])
    assert errors[1] is None
    # predict's rows carry the engine's words, as `recsys predict` (and recsys.ray) write them.
    _, _, _, errors = engine.predict([[10011403], [-5, -6]], strict=True)
    assert errors[0] is None and "holds 2 id(s) unknown to the model" in errors[1]
    assert engine.recommend([[10011403, -5]])[0].shape == (1, 10), "unknown ids are dropped by default"
    # A history with nothing the model knows, on a model that needs one; an unknown set name.
    sasrec = recsys.Engine(engines["sasrec"])
    for call in (lambda: sasrec.recommend([[10011403], [-5, -6]]), lambda: sasrec.embed([[10011403], []])):
        with pytest.raises(ValueError, match=re.escape("histories[1] holds no item the model knows (")) as refused:
            call()
        assert "sasrec answers from the history's last item" in str(refused.value)
        assert "interactions=" in str(refused.value) and "empty_history_policy" not in str(refused.value)
    with pytest.raises(ValueError, match=re.escape("include_sets / exclude_sets for histories[0]: unknown item "
                                                   "set \"colour=red\"")):
        sasrec.recommend([[10011403]], include_sets=["colour=red"])
    with pytest.raises(ValueError, match="k must be at least 1, got 0"):
        engine.recommend([[10011403]], k=0)
    with pytest.raises(TypeError, match="one per user"):
        engine.recommend([10011403, 10011207])
    with pytest.raises(ValueError, match="candidates has 1 lists for 2 histories"):
        engine.rerank([[10011403], [10011207]], [[10011739]])
    with pytest.raises(ValueError, match="threads must be between 1 and 1024"):
        recsys.Engine(engines["vaecf"], threads=0)
    for threads in (-1, 10**6):
        with pytest.raises(ValueError, match=re.escape(f"threads must be between 1 and 1024 (or None for one per CPU), "
                                                       f"got {threads}")):
            recsys.Engine(engines["vaecf"], threads=threads)


def test_the_gil_is_released_while_the_engine_computes(engines, users):
    """Another Python thread keeps running during a long call (it could not if the GIL were held)."""
    engine = recsys.Engine(engines["vaecf"], threads=1)
    histories = users * 40
    start = time.perf_counter()
    engine.recommend(histories, k=100)
    alone = time.perf_counter() - start
    ticks, done = [0], threading.Event()

    def work():
        engine.recommend(histories, k=100)
        done.set()

    worker = threading.Thread(target=work)
    worker.start()
    while not done.is_set():
        ticks[0] += 1
        time.sleep(0.001)
    worker.join()
    # One tick per millisecond at most; with the GIL held for the whole call there would be ~none.
    assert alone > 0.05, f"the call took {alone:.3f} s, too short to tell"
    assert ticks[0] >= 0.3 * alone * 1000, f"{ticks[0]} ticks during a {alone:.3f} s call"


def test_convert_and_evaluate_mirror_the_command_line(recsys_bin, engines, tmp_path):
    src = FIXTURES / "multivae"
    engine = recsys.convert("vaecf", src / "model.safetensors", src / "item_id_map.tsv", tmp_path / "engine",
                            config=src / "config.json", precision="int8")
    assert engine.precision == "int8"
    with pytest.raises(ValueError, match="already exists; pass force=True"):
        recsys.convert("vaecf", src / "model.safetensors", src / "item_id_map.tsv", tmp_path / "engine",
                       config=src / "config.json")
    with pytest.raises(ValueError, match="needs calibration="):
        recsys.convert("vaecf", src / "model.safetensors", src / "item_id_map.tsv", tmp_path / "w8a8",
                       config=src / "config.json", precision="int8", int8_mode="w8a8")
    # All-layer W8A8: every dense layer at its calibrated static scale, recorded in the manifest.
    cal = Path(__file__).resolve().parents[2] / "examples" / "calibration.jsonl"
    all_layers = recsys.convert("vaecf", src / "model.safetensors", src / "item_id_map.tsv", tmp_path / "w8a8-all",
                                config=src / "config.json", precision="int8", int8_mode="w8a8-all",
                                calibration=cal)
    quantization = json.loads((tmp_path / "w8a8-all" / "manifest.json").read_text())["quantization"]
    assert quantization["dense_activations"] == "static" and len(quantization["dense_activation_scales"]) == 2
    assert all_layers.recommend([[10011403, 10011207]], k=10)[0].shape == (1, 10)
    with pytest.raises(ValueError, match="w8a8-all"):
        recsys.convert("vaecf", src / "model.safetensors", src / "item_id_map.tsv", tmp_path / "w8a8-bad",
                       config=src / "config.json", precision="fp16", int8_mode="w8a8-all", calibration=cal)
    # A screened engine (int8 screen, exact fp32 rescoring) answers as the plain one.
    screened = recsys.convert("vaecf", src / "model.safetensors", src / "item_id_map.tsv", tmp_path / "screened",
                              config=src / "config.json", screen="int8")
    histories = [[10011403, 10011207], [10011739, 10011403, 10011550]]
    plain_ids, plain_scores = recsys.Engine(engines["vaecf"]).recommend(histories, k=50)
    ids, scores = screened.recommend(histories, k=50)
    assert (ids == plain_ids).all() and (scores == plain_scores).all()
    with pytest.raises(ValueError, match="unknown screen"):
        recsys.convert("vaecf", src / "model.safetensors", src / "item_id_map.tsv", tmp_path / "s2",
                       config=src / "config.json", screen="int4")
    report = recsys.evaluate(recsys.Engine(engines["vaecf"]), FIXTURES / "test_set.tsv", k=[10, 20])
    cli = json.loads(subprocess.run([str(recsys_bin), "eval", "--engine", str(engines["vaecf"]), "--test",
                                     str(FIXTURES / "test_set.tsv"), "--k", "10,20"],
                                    check=True, capture_output=True, text=True).stdout)
    assert report["metrics"] == cli["metrics"]
    assert report["unknown_targets"] == cli["unknown_targets"]


def _neutral(message: str) -> str:
    """A refusal with its options spelled neither as flags nor as keywords: `--int8-mode w8a8` and
    `int8_mode="w8a8"` both become `int8_mode w8a8`, `--calibration` and `calibration=` both
    `calibration`."""
    message = re.sub(r"--([a-z0-9-]+)", lambda m: m.group(1).replace("-", "_"), message)
    message = re.sub(r'([a-z0-9_]+)="([^"]*)"', r"\1 \2", message)
    return re.sub(r"([a-z0-9_]+)=", r"\1", message)


def test_the_command_line_and_python_take_the_same_options_to_the_same_engines(recsys_bin, tmp_path):
    """Every combination of precision, int8 mode, calibration and screen through `recsys convert`
    and `recsys.convert`: both accept it and write the same engine (weights, kernels, quantization,
    calibration), or both refuse it with the same reason (exit 2 on the command line), each naming
    the options in its own spelling. Defaults included: neither front end names the calibration
    method."""
    src = FIXTURES / "gru4rec"
    cal = Path(__file__).resolve().parents[2] / "examples" / "calibration.jsonl"
    accepted = refused = 0
    for precision in ("fp32", "fp16", "bf16", "int8"):
        for mode in ("weight-only", "w8a8", "w8a8-all"):
            for calibrated in (False, True):
                for screen in ("none", "int8"):
                    name = f"{precision}-{mode}-{'cal' if calibrated else 'nocal'}-{screen}"
                    cli_out, py_out = tmp_path / "cli" / name, tmp_path / "py" / name
                    flags = ["--precision", precision, "--int8-mode", mode, "--screen", screen]
                    flags += ["--calibration", str(cal)] if calibrated else []
                    cli = subprocess.run(
                        [str(recsys_bin), "convert", "--kind", "gru4rec", "--checkpoint", str(src / "model.safetensors"),
                         "--config", str(src / "config.json"), "--item-map", str(src / "item_id_map.tsv"),
                         "--output", str(cli_out), *flags], capture_output=True, text=True)
                    try:
                        recsys.convert("gru4rec", src / "model.safetensors", src / "item_id_map.tsv", py_out,
                                       config=src / "config.json", precision=precision, int8_mode=mode,
                                       screen=screen, calibration=cal if calibrated else None)
                        py_error = None
                    except ValueError as error:
                        py_error = str(error)
                    if cli.returncode == 0:
                        assert py_error is None, (name, py_error)
                        a, b = (json.loads((d / "manifest.json").read_text()) for d in (cli_out, py_out))
                        for key in ("precision", "screen", "quantization", "files"):
                            assert a.get(key) == b.get(key), (name, key)
                        accepted += 1
                    else:
                        assert cli.returncode == 2, (name, cli.returncode, cli.stderr)
                        assert py_error is not None, (name, "Python accepted what the command line refused")
                        assert _neutral(py_error) in _neutral(cli.stderr), (name, py_error, cli.stderr)
                        refused += 1
    # 8 valid: fp32 and fp16 with and without the screen, bf16 unscreened, int8 weight-only, int8
    # w8a8 and w8a8-all (both calibrated, unscreened).
    assert (accepted, refused) == (8, 40), (accepted, refused)


def test_the_installed_wheel_carries_the_package_metadata():
    """What pip and PyPI show of the wheel scripts/build-wheel.sh built: the package README as its
    long description, the supported Pythons, the licence and the typing marker."""
    from importlib import metadata

    meta = metadata.metadata("recsys")
    assert meta["Requires-Python"] == ">=3.9"
    assert meta["Description-Content-Type"].startswith("text/markdown")
    assert "engine.recommend(" in meta["Description"] or "engine.recommend(" in (meta.get_payload() or "")
    classifiers = meta.get_all("Classifier")
    for version in ("3.9", "3.10", "3.11", "3.12"):
        assert f"Programming Language :: Python :: {version}" in classifiers
    assert "License :: OSI Approved :: Apache Software License" in classifiers
    files = [str(f) for f in metadata.files("recsys")]
    assert any(f.endswith("recsys/py.typed") for f in files) and any(f.endswith("__init__.pyi") for f in files)


def test_the_stubs_accept_the_numpy_histories_the_engine_accepts(engines, users):
    """tests/typing/usage.py passes lists, lists of int64 arrays and 2-D int64 arrays, and mypy
    --strict and pyright (strict, by the file's own comment) accept them against the installed
    stubs; the engine answers all three alike."""
    import sys

    root = Path(__file__).resolve().parents[2]
    for checker in (["mypy", "--strict", "--no-incremental"], ["pyright", "--pythonpath", sys.executable]):
        check = subprocess.run([sys.executable, "-m", *checker, "tests/typing/usage.py"],
                               cwd=root, capture_output=True, text=True, timeout=300)
        assert check.returncode == 0, f"{checker[0]}:\n{check.stdout}{check.stderr}"
    engine = recsys.Engine(engines["vaecf"], threads=1)
    width = 5
    lists = [u[:width] for u in users[:8] if len(u) >= width]
    arrays = [np.array(u, dtype=np.int64) for u in lists]
    matrix = np.array(lists, dtype=np.int64)
    want_ids, want_scores = engine.recommend(lists, k=10)
    for histories in (arrays, matrix):
        ids, scores = engine.recommend(histories, k=10)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(scores, want_scores)
    np.testing.assert_array_equal(engine.embed(matrix), engine.embed(lists))


def test_an_engine_in_object_storage_answers_as_the_local_one(engines, users, tmp_path, monkeypatch):
    """recsys.Engine("s3://...") on a real S3-compatible server (moto), through the command line's
    object-store code and credential chain (the environment's keys here): the same answers as the
    same engine loaded from disk; a folder without an engine is an error naming the address."""
    from s3_harness import CREDENTIALS, S3Server

    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    with S3Server(tmp_path / "moto.log") as s3:
        client = s3.client()
        client.create_bucket(Bucket="models")
        for f in sorted(engines["vaecf"].iterdir()):
            client.upload_file(str(f), "models", f"engines/vaecf/1/{f.name}")
        remote = recsys.Engine(s3.uri("models", "engines/vaecf/1"), threads=1)
        local = recsys.Engine(engines["vaecf"], threads=1)
        want_ids, want_scores = local.recommend(users[:64], k=20)
        got_ids, got_scores = remote.recommend(users[:64], k=20)
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_array_equal(got_scores, want_scores)
        with pytest.raises(recsys.RecsysError, match=r"cannot fetch the engine at s3://.*nothing/here"):
            recsys.Engine(s3.uri("models", "nothing/here"))


def test_recbole_item_map_reads_the_files_recbole_saved(tmp_path):
    """`recsys.recbole.item_map` on the files RecBole 1.2.1 saved (tests/fixtures/recbole_dataset,
    made by scripts/make_recbole_dataset_fixture.py): RecBole's own field2id_token, taken from the
    live Dataset when the files were made. The written TSV is the demo models' hand-made map, byte
    for byte, and converts to the same engine."""
    import recsys.recbole

    saved = FIXTURES / "recbole_dataset"
    for name, file in [("recsys-demo", "recsys-demo-Dataset.pth"),
                       ("recsys-demo-sample", "recsys-demo-sample-for-MultiVAE-dataloader.pth")]:
        golden = json.loads((saved / f"{name}.field2id_token.json").read_text())["field2id_token"]
        assert golden[0] == "[PAD]"
        mapping = recsys.recbole.item_map(saved / file, tmp_path / f"{name}.tsv")
        assert mapping == {i: t for i, t in enumerate(golden) if i > 0}, name
        assert recsys.recbole.item_map(str(saved / file)) == mapping
    assert (tmp_path / "recsys-demo.tsv").read_bytes() == (FIXTURES / "sasrec" / "item_id_map.tsv").read_bytes()

    engine_dir = tmp_path / "engine"
    recsys.convert("sasrec", FIXTURES / "sasrec" / "recbole_checkpoint.pth", tmp_path / "recsys-demo.tsv", engine_dir)
    case = golden_cases("sasrec")[0]
    answer = recsys.Engine(engine_dir).recommend([case["history_ext"]], k=10)[0][0].tolist()
    assert answer == [t["external"] for t in case["topk"][:10]]  # RecBole's own top 10

    # The module as a command, for a shell without Python code.
    run = subprocess.run([sys.executable, "-m", "recsys.recbole", str(saved / "recsys-demo-Dataset.pth"),
                          str(tmp_path / "cli.tsv")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "2000 items written" in run.stdout
    assert (tmp_path / "cli.tsv").read_bytes() == (tmp_path / "recsys-demo.tsv").read_bytes()


def test_recbole_item_map_names_what_it_cannot_use(tmp_path):
    import recsys.recbole

    with pytest.raises(recsys.RecsysError, match="zip archive"):
        recsys.recbole.item_map(FIXTURES / "sasrec" / "recbole_checkpoint.pth")
    with pytest.raises(recsys.RecsysError, match="not a pickle"):
        recsys.recbole.item_map(FIXTURES / "sasrec" / "item_id_map.tsv")
    with pytest.raises(FileNotFoundError):
        recsys.recbole.item_map(tmp_path / "missing.pth")
    with pytest.raises(TypeError, match="RecBole Dataset or data loader"):
        recsys.recbole.item_map({"item_id": [1, 2]})


def test_a_screened_engine_answers_the_same_on_either_path_of_its_plan(repository):
    """screen_policy pins the plan; "auto" measures it on this CPU (or reads its file); the
    answers never depend on it."""
    path = str(repository / "vaecf_screened" / "1")
    histories = [[10011403, 10011207], [10011739], [10011403, 10011739, 10011207]]
    engines = {p: recsys.Engine(path, threads=1, screen_policy=p) for p in ("always", "never", "auto")}
    assert "pinned" in engines["never"].screen_plan and "plain scan" in engines["never"].screen_plan
    assert "int8 screen" in engines["always"].screen_plan
    assert "batch 64+" in engines["auto"].screen_plan
    answers = {p: e.recommend(histories, k=20) for p, e in engines.items()}
    for p in ("never", "auto"):
        assert answers[p][0].tolist() == answers["always"][0].tolist(), p
        np.testing.assert_array_equal(answers[p][1], answers["always"][1])
    assert recsys.Engine(str(repository / "vaecf" / "1"), threads=1).screen_plan is None
    with pytest.raises(ValueError, match="screen_policy"):
        recsys.Engine(path, screen_policy="sometimes")


def test_every_thread_plan_gives_the_same_answers(engines, users):
    """thread_plan pins how many of its threads each batch size gets ("all", a count); "auto"
    measures it on this CPU (or reads the kept plan); the answers are the same bits. An engine of
    one thread has nothing to plan."""
    path = str(engines["sasrec"])
    by_plan = {p: recsys.Engine(path, threads=2, thread_plan=p) for p in ("1", "all", "auto")}
    assert by_plan["1"].thread_plan.startswith("batch 1+: 1 thread — pinned (1)")
    assert by_plan["all"].thread_plan.startswith("batch 1+: 2 threads — pinned (all)")
    assert re.match(r"batch 1\+: [12] threads? \(.* ms on 1, .* ms on 2\); batch 8\+: .*; batch 64\+: ",
                    by_plan["auto"].thread_plan), by_plan["auto"].thread_plan
    answers = {p: e.recommend(users[:64], k=20) for p, e in by_plan.items()}
    for p in ("1", "auto"):
        assert answers[p][0].tolist() == answers["all"][0].tolist(), p
        np.testing.assert_array_equal(answers[p][1], answers["all"][1])
    assert recsys.Engine(path, threads=1).thread_plan is None
    with pytest.raises(ValueError, match="thread_plan must be"):
        recsys.Engine(path, threads=2, thread_plan="0")


def test_the_row_block_changes_no_answer(engines, users):
    """row_block pins the largest row group of AVX-512 kernels ("4" or "8"); "auto" measures both
    on this CPU (or reads the kept plan); the answers are the same bits at a batch of 40 (groups of
    8 and of 4). Without AVX-512 there is one row block (row_block_plan is None)."""
    path = str(engines["vaecf"])
    flags = Path("/proc/cpuinfo").read_text()
    avx512 = all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"))
    by_block = {b: recsys.Engine(path, threads=2, row_block=b) for b in ("4", "8", "auto")}
    if avx512:
        assert "row groups of up to 4 rows — pinned (4)" in by_block["4"].row_block_plan
        assert "row groups of up to 8 rows — pinned (8)" in by_block["8"].row_block_plan
        assert "batch 64:" in by_block["auto"].row_block_plan
    else:
        assert all(e.row_block_plan is None for e in by_block.values())
    answers = {b: e.recommend(users[:40], k=20) for b, e in by_block.items()}
    for b in ("8", "auto"):
        assert answers[b][0].tolist() == answers["4"][0].tolist(), b
        np.testing.assert_array_equal(answers[b][1], answers["4"][1])
    with pytest.raises(ValueError, match="row_block must be"):
        recsys.Engine(path, row_block="16")


def test_a_bf16_engine_answers_the_same_on_either_kernel_path(engines, users):
    """bf16_path pins a bf16 engine's kernels on a CPU with AVX512-BF16 ("native" vdpbf16ps or
    "widened" to f32); "auto" measures them per batch size on this CPU (or reads the kept plan);
    the answers are the same bits (AMX tiles, whose sums differ in the last bits, off). On a CPU
    without AVX512-BF16 there is nothing to choose (kernel_plan is None)."""
    path = str(engines["bert4rec_bf16"])
    has_bf16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    by_path = {
        p: recsys.Engine(path, threads=1, bf16_path=p, amx="off")
        for p in ("native", "widened", "auto")
    }
    if has_bf16:
        assert "pinned (native)" in by_path["native"].kernel_plan
        assert "widened to f32" in by_path["widened"].kernel_plan
        assert "batch 64+:" in by_path["auto"].kernel_plan
    else:
        assert all(e.kernel_plan is None for e in by_path.values())
    answers = {p: e.recommend(users[:40], k=20) for p, e in by_path.items()}
    for p in ("widened", "auto"):
        assert answers[p][0].tolist() == answers["native"][0].tolist(), p
        np.testing.assert_array_equal(answers[p][1], answers["native"][1])
    assert recsys.Engine(str(engines["bert4rec"]), threads=1).kernel_plan is None
    with pytest.raises(ValueError, match="bf16_path"):
        recsys.Engine(path, bf16_path="fastest")


def test_a_bf16_engine_names_its_amx_choice(engines, users):
    """amx ("auto", "on", "off") decides whether a bf16 engine's output layer runs on AMX tiles;
    kernel_plan names the choice, or why tiles are not used (a CPU without AMX), and a CPU without
    them answers as with amx="off". On an AMX CPU the tiles' answers hold the same items but where
    scores within rounding of each other swap."""
    path = str(engines["bert4rec_bf16"])
    has_amx = "amx_tile" in Path("/proc/cpuinfo").read_text()
    off = recsys.Engine(path, threads=1, amx="off")
    assert off.kernel_plan is None or "AMX" not in off.kernel_plan
    for policy in ("auto", "on"):
        engine = recsys.Engine(path, threads=1, amx=policy)
        if has_amx:
            assert "AMX bf16 layers batch 1+:" in engine.kernel_plan, engine.kernel_plan
        else:
            assert "AMX tiles not used: this CPU has no AMX" in engine.kernel_plan, engine.kernel_plan
            got, want = engine.recommend(users[:20], k=10), off.recommend(users[:20], k=10)
            assert got[0].tolist() == want[0].tolist()
            np.testing.assert_array_equal(got[1], want[1])
    fp32 = recsys.Engine(str(engines["bert4rec"]), threads=1, amx="on")
    assert fp32.kernel_plan is None, "an fp32 engine without a screen has no tiles to run"
    with pytest.raises(ValueError, match="amx must be"):
        recsys.Engine(path, amx="sometimes")


def test_the_examples_in_the_stubs_docstrings_run(engines, tmp_path, monkeypatch):
    """Every `>>>` example in the package's docstrings (the stubs IDEs and help() show) runs and
    prints what it says, against the SASRec fixture engine (`path`, `engine`) from the repository
    root, converting into `tmp`."""
    import ast
    import doctest
    import io

    root = Path(__file__).resolve().parents[2]
    stubs = root / "python" / "recsys" / "__init__.pyi"
    tree = ast.parse(stubs.read_text())
    documented = [(getattr(node, "name", "recsys"), ast.get_docstring(node)) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))]
    examples = [(name, text) for name, text in documented if text and ">>>" in text]
    calls = {name for name, _ in examples}
    for call in ("Engine", "info", "recommend", "rerank", "embed", "score", "predict", "timelines", "convert",
                 "evaluate"):
        assert call in calls, f"no example in the docstring of {call}"
    monkeypatch.chdir(root)
    path = str(engines["sasrec"])
    globs = {"recsys": recsys, "np": np, "path": path, "tmp": str(tmp_path),
             "engine": recsys.Engine(path, threads=1)}
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    report = io.StringIO()
    for name, text in examples:
        runner.run(doctest.DocTestParser().get_doctest(text, dict(globs), name, str(stubs), 0), out=report.write)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, report.getvalue()
    assert results.attempted >= 20, results
