"""recsys.ray.predict on a real local Ray cluster (PyPI `ray`, `ray.init(num_cpus=2)`): 20,000 users
read and written through Ray's own JSON-lines and Parquet readers and writers give exactly the
records of `recsys predict` (per-user k, exclusions, candidates, refused rows), in whatever order
Ray's blocks come back; the actor killed with SIGKILL mid-run is restarted by Ray and its batches
retried, with no user lost or answered twice. One actor of one thread: the second CPU runs Ray
Data's read and write tasks."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import FIXTURES, convert
from triton_harness import ROOT

try:
    import ray
    import ray.data

    import recsys.ray
except ImportError as missing:  # a collection error, not a skip: CI must not pass without them
    raise ImportError("ray and the recsys package must be installed: scripts/test.sh does") from missing

USERS = 20_000
UNKNOWN_ID = 99_999_999


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    # Progress bars would flood the test log.
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def engine(recsys_bin, tmp_path_factory):
    out = tmp_path_factory.mktemp("ray_engine") / "bert4rec"
    convert(recsys_bin, "bert4rec", "bert4rec", "model.safetensors", out)
    return out


@pytest.fixture(scope="module")
def users(tmp_path_factory):
    """20,000 JSON lines from the fixture's histories (suffixes of them beyond the first pass),
    with per-user k, exclusions and candidates on some, and an id the model does not know on a
    few (refused under --strict-ids)."""
    rows = [line.split("\t") for line in (FIXTURES / "test_set.tsv").read_text().splitlines()[1:]]
    histories = [[int(x) for x in r[2].split()] for r in rows]
    catalogue = [int(line.split("\t")[1])
                 for line in (FIXTURES / "bert4rec" / "item_id_map.tsv").read_text().splitlines()[1:]]
    rng = random.Random(20_000)
    lines = []
    for user in range(USERS):
        history = histories[user % len(histories)]
        if user >= len(histories):
            history = history[rng.randrange(len(history)):] or history
        line = {"user_id": user, "item_ids": history}
        if user % 7 == 0:
            line["k"] = rng.choice([1, 5, 20])
        if user % 5 == 0:
            line["exclude_item_ids"] = rng.sample(catalogue, 3)
        if user % 11 == 0:
            line["candidate_item_ids"] = rng.sample(catalogue, 50)
        if user % 997 == 0:
            line["item_ids"] = history + [UNKNOWN_ID]
        lines.append(line)
    path = tmp_path_factory.mktemp("ray_users") / "users.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def expected(recsys_bin, engine, users, tmp_path_factory):
    """`recsys predict`'s records by user (without "line": Ray rows have no line numbers)."""
    out = tmp_path_factory.mktemp("ray_expected") / "out.jsonl"
    done = subprocess.run([str(recsys_bin), "predict", "--engine", str(engine), "--input", str(users),
                           "--output", str(out), "--strict-ids", "--batch-size", "256"], capture_output=True, text=True)
    assert done.returncode == 3, f"exit 3 (some lines refused) expected: {done.stderr}"
    records = {}
    for text in out.read_text().splitlines():
        record = json.loads(text)
        record.pop("line", None)
        records[record["user_id"]] = record
    assert len(records) == USERS
    assert sum("error" in r for r in records.values()) == len(range(0, USERS, 997))
    return records


def as_records(rows: list[dict]) -> dict[int, dict]:
    """Ray rows as recsys predict's records: null columns left out, arrays as lists."""
    out = {}
    for row in rows:
        record = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in row.items() if v is not None}
        assert record["user_id"] not in out, f"user {record['user_id']} answered twice"
        out[record["user_id"]] = record
    return out


def assert_same(got: dict[int, dict], want: dict[int, dict]):
    assert len(got) == len(want), f"{len(got)} users answered, {len(want)} expected"
    for user, record in want.items():
        assert got[user] == record, f"user {user}"


def test_json_lines_in_parquet_out_equal_recsys_predict(cluster, engine, users, expected, tmp_path):
    dataset = ray.data.read_json(str(users))
    out_dir = tmp_path / "parquet"
    recsys.ray.predict(dataset, engine, k=10, batch_size=512, concurrency=1, strict_ids=True).write_parquet(
        str(out_dir))
    table = pq.read_table(out_dir)
    assert table.schema.field("scores").type == pa.list_(pa.float32())
    assert table.schema.field("item_ids").type == pa.list_(pa.int64())
    # Parquet keeps float32 exactly: the scores are recsys predict's bit for bit.
    assert_same(as_records(table.to_pylist()), expected)


@pytest.mark.parametrize("kind", ["sasrec", "gru4rec"])
def test_sasrec_and_gru4rec_equal_recsys_predict(cluster, recsys_bin, users, kind, tmp_path):
    """The two sequential models run by Ray exactly as by `recsys predict` (2,000 of the users, their
    per-user k, exclusions, candidates and refused ids included)."""
    engine = tmp_path / kind
    convert(recsys_bin, kind, kind, "model.safetensors", engine)
    subset = tmp_path / "users.jsonl"
    subset.write_text("".join(users.read_text().splitlines(keepends=True)[:2_000]))
    out = tmp_path / "expected.jsonl"
    subprocess.run([str(recsys_bin), "predict", "--engine", str(engine), "--input", str(subset), "--output", str(out),
                    "--strict-ids", "--batch-size", "256"], capture_output=True, text=True)
    want = {}
    for text in out.read_text().splitlines():
        record = json.loads(text)
        record.pop("line", None)
        want[record["user_id"]] = record
    assert len(want) == 2_000 and sum("error" in r for r in want.values()) == 3
    dataset = ray.data.read_json(str(subset))
    rows = recsys.ray.predict(dataset, engine, k=10, batch_size=256, concurrency=1, strict_ids=True).take_all()
    assert_same(as_records(rows), want)


def test_parquet_in_json_lines_out_equal_recsys_predict(cluster, engine, users, expected, tmp_path):
    source = tmp_path / "users.parquet"
    pq.write_table(pa.Table.from_pylist([json.loads(t) for t in users.read_text().splitlines()]), source)
    out_dir = tmp_path / "jsonl"
    # 15 significant digits (pandas' most) carry a float32 exactly through JSON.
    recsys.ray.predict(ray.data.read_parquet(str(source)), str(engine), batch_size=300, concurrency=1,
                       strict_ids=True).write_json(str(out_dir), double_precision=15)
    rows = [json.loads(t) for f in sorted(out_dir.iterdir()) for t in f.read_text().splitlines()]
    got = as_records(rows)
    for record in got.values():
        if "scores" in record:
            record["scores"] = [float(np.float32(s)) for s in record["scores"]]
    assert_same(got, expected)


def _map_workers() -> list[tuple[int, bool, float]]:
    """Ray's MapWorker processes: pid, whether the engine is mapped, CPU seconds used."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if not f.read().startswith(b"ray::MapWorker"):
                    continue
            with open(f"/proc/{pid}/maps") as f:
                loaded = "weights.safetensors" in f.read()
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found.append((int(pid), loaded, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")))
    return found


def test_an_actor_killed_mid_run_is_retried_without_losing_or_repeating_a_user(cluster, engine, users, expected):
    killed: dict = {}
    finished = threading.Event()

    def kill_one_scoring_actor():
        # Wait until an actor has loaded the engine and scored for a while, then SIGKILL it.
        cpu_at_load: dict[int, float] = {}
        while not finished.is_set():
            for pid, loaded, cpu in _map_workers():
                if loaded:
                    cpu_at_load.setdefault(pid, cpu)
                    if cpu - cpu_at_load[pid] > 0.5:
                        os.kill(pid, signal.SIGKILL)
                        killed.update(pid=pid, at=time.monotonic())
                        return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_one_scoring_actor)
    killer.start()
    try:
        # The only actor is killed: Ray restarts it and retries the batches it held.
        rows = recsys.ray.predict(ray.data.read_json(str(users), override_num_blocks=40), engine, batch_size=64,
                                  concurrency=1, strict_ids=True).take_all()
    finally:
        done_at = time.monotonic()
        finished.set()
        killer.join()
    assert killed, "no actor was seen scoring, so none was killed"
    assert done_at - killed["at"] > 0.5, "the actor was killed only as the job ended"
    assert_same(as_records(rows), expected)


def test_bad_input_gets_clear_errors(cluster, engine, tmp_path):
    with pytest.raises(FileNotFoundError, match="not an engine directory"):
        recsys.ray.predict(ray.data.from_items([{"item_ids": [1]}]), tmp_path / "nowhere")
    with pytest.raises(ValueError, match="concurrency must be a positive integer"):
        recsys.ray.predict(ray.data.from_items([{"item_ids": [1]}]), engine, concurrency=0)
    # Two one-thread actors would hold both CPUs and starve Ray's read and write tasks forever.
    with pytest.raises(ValueError, match=r"hold all 2 CPUs .* start with at most 1 actor"):
        recsys.ray.predict(ray.data.from_items([{"item_ids": [1]}]), engine, concurrency=2)
    # An autoscaling pool is judged by its minimum, and its bounds must be a (min, max) pair.
    with pytest.raises(ValueError, match=r"the pool's minimum of 2 actor\(s\) .* hold all 2 CPUs"):
        recsys.ray.predict(ray.data.from_items([{"item_ids": [1]}]), engine, concurrency=(2, 4))
    for bad in [(3, 1), (0, 2), (1, 2, 3), "2"]:
        with pytest.raises(ValueError, match=r"a \(min, max\) pair"):
            recsys.ray.predict(ray.data.from_items([{"item_ids": [1]}]), engine, concurrency=bad)
    # A dataset without histories: the job fails naming the column it lacks and those it has.
    with pytest.raises(Exception, match='no "item_ids" column.*history_ids'):
        recsys.ray.predict(ray.data.from_items([{"history_ids": [1]}]), engine, max_restarts=0).take_all()
    # A row's own bad k is that row's error, as in recsys predict; the others are answered.
    rows = recsys.ray.predict(ray.data.from_items([
        {"user_id": 1, "item_ids": [10011403], "k": 0},
        {"user_id": 2, "item_ids": [10011403], "k": 3},
    ]), engine).take_all()
    by_user = {r["user_id"]: r for r in rows}
    assert by_user[1]["error"] == '"k" must be a positive integer, found 0'
    assert by_user[1]["item_ids"] is None
    assert by_user[2]["error"] is None and len(by_user[2]["item_ids"]) == 3


def _report_cluster_config(groups: list[tuple[str, dict, int]]) -> None:
    """Reports node groups to the cluster's GCS the way an autoscaler does (KubeRay's reports its
    worker groups through this same call); an empty list clears them."""
    from ray.core.generated import autoscaler_pb2

    config = autoscaler_pb2.ClusterConfig()
    for name, resources, max_count in groups:
        group = config.node_group_configs.add()
        group.name, group.max_count = name, max_count
        for key, value in resources.items():
            group.resources[key] = value
    ray._private.worker.global_worker.gcs_client.report_cluster_config(config.SerializeToString())


def test_the_resource_check_counts_what_an_autoscaler_can_add(cluster, engine):
    """The 2-CPU cluster with an autoscaler's limits reported to it: a head of 2 CPUs and up to two
    workers of 4 CPUs and 1 GPU, 10 CPUs and 2 GPUs at most. A pool is judged against that maximum,
    not against the 2 CPUs and no GPU of today."""
    users = ray.data.from_items([{"item_ids": [10011403]}])
    try:
        _report_cluster_config([("head", {"CPU": 2}, 1), ("gpu-workers", {"CPU": 4, "GPU": 1}, 2)])
        recsys.ray.predict(users, engine, concurrency=4)  # 4 CPUs: the autoscaler adds a worker
        recsys.ray.predict(users, engine, concurrency=(9, 12))
        recsys.ray.predict(users, engine, concurrency=2, num_gpus=1)
        recsys.ray.predict(users, engine, concurrency=4, num_gpus=0.5)
        with pytest.raises(ValueError, match=r"10 actor\(s\) x 1 thread\(s\) would hold the 10 its autoscaler "
                                             r"can grow it to \(2 now\) CPUs .* at most 9 actor"):
            recsys.ray.predict(users, engine, concurrency=10)
        with pytest.raises(ValueError, match=r"3 actor\(s\) x 1 GPU\(s\) need 3 GPUs, and the Ray cluster has "
                                             r"the 2 its autoscaler can grow it to \(0 now\)"):
            recsys.ray.predict(users, engine, concurrency=3, num_gpus=1)
    finally:
        _report_cluster_config([])
    # Without the autoscaler's limits, today's resources are the limit again.
    with pytest.raises(ValueError, match=r"hold all 2 CPUs"):
        recsys.ray.predict(users, engine, concurrency=4)
    with pytest.raises(ValueError, match=r"need 1 GPUs, and the Ray cluster has none"):
        recsys.ray.predict(users, engine, num_gpus=1)
    for bad in [-1, "1", True]:
        with pytest.raises(ValueError, match="num_gpus must be a number of GPUs per actor"):
            recsys.ray.predict(users, engine, num_gpus=bad)


def test_gpu_actors_ask_the_engine_for_their_gpu(engine, tmp_path):
    """num_gpus on a cluster that declares a GPU: the actor gets it and loads its engine with
    device="cuda". The package under test is built for the CPU only, so that load fails, with the
    message that says how to get a package with CUDA support; the job fails with it, no row
    answered on the CPU behind the user's back. (Its own Ray cluster, in a process of its own.)"""
    script = tmp_path / "gpu_job.py"
    script.write_text(f"""
import ray, recsys.ray
ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
ray.data.DataContext.get_current().enable_progress_bars = False
try:
    recsys.ray.predict(ray.data.from_items([{{"item_ids": [10011403]}}]), {str(engine)!r}, num_gpus=1,
                       max_restarts=0).take_all()
except Exception as error:
    print("FAILED:", error)
else:
    print("ANSWERED")
""")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert "FAILED:" in run.stdout, run.stdout + run.stderr
    assert "this recsys package runs on the CPU only" in run.stdout, run.stdout
    assert "scripts/build-wheel.sh --cuda 12" in run.stdout, run.stdout


def test_the_example_job_writes_what_recsys_predict_writes(cluster, engine, users, expected, tmp_path):
    """examples/ray_batch_scoring.py on the first 2,000 users, joining the running cluster."""
    source = tmp_path / "users.jsonl"
    source.write_text("".join(users.read_text().splitlines(keepends=True)[:2000]))
    out_dir = tmp_path / "out"
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "ray_batch_scoring.py"), "--engine", str(engine),
                           "--input", str(source), "--output", str(out_dir), "--address", ray.get_runtime_context().gcs_address],
                          capture_output=True, text=True, timeout=300)
    # Users 0 and 997 hold an id the model does not know: dropped here (no --strict-ids), so all
    # are answered.
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2000 users scored by 1 actor(s) x 1 thread(s)" in done.stdout
    rows = [json.loads(t) for f in sorted(out_dir.iterdir()) for t in f.read_text().splitlines()]
    got = as_records(rows)
    assert len(got) == 2000
    for user, record in got.items():
        if user % 997 == 0:
            continue  # recsys predict ran with --strict-ids for the others' sake
        record["scores"] = [float(np.float32(s)) for s in record["scores"]]
        assert record == expected[user], f"user {user}"


def test_an_autoscaling_pool_larger_than_the_cluster_runs_and_answers_as_recsys_predict(cluster, engine, users,
                                                                                        expected, tmp_path):
    """concurrency=(1, 4) on a 2-CPU cluster: the maximum waits for CPUs an autoscaler would add
    (none here), the pool starts with one actor, and every user gets recsys predict's answer."""
    lines = users.read_text().splitlines(keepends=True)[:3000]
    source = tmp_path / "users.jsonl"
    source.write_text("".join(lines))
    rows = recsys.ray.predict(ray.data.read_json(str(source)), engine, k=10, strict_ids=True,
                              concurrency=(1, 4), batch_size=256).take_all()
    got = as_records(rows)
    assert_same(got, {user: expected[user] for user in got})
    assert len(got) == len(lines)



def test_an_engine_in_object_storage_serves_every_actor(cluster, engine, users, expected, tmp_path):
    """engine_path="s3://..." (a real S3-compatible server): each actor fetches the engine with the
    credentials Ray hands it, and the answers are recsys predict's on the local engine."""
    from s3_harness import CREDENTIALS, S3Server

    lines = users.read_text().splitlines(keepends=True)[:1000]
    source = tmp_path / "users.jsonl"
    source.write_text("".join(lines))
    with S3Server(tmp_path / "moto.log") as s3:
        client = s3.client()
        client.create_bucket(Bucket="models")
        for f in sorted(engine.iterdir()):
            client.upload_file(str(f), "models", f"bert4rec/1/{f.name}")
        rows = recsys.ray.predict(ray.data.read_json(str(source)), s3.uri("models", "bert4rec/1"), k=10,
                                  strict_ids=True, batch_size=256,
                                  runtime_env={"env_vars": dict(CREDENTIALS)}).take_all()
    got = as_records(rows)
    assert len(got) == len(lines)
    assert_same(got, {user: expected[user] for user in got})
