"""Offline scoring of a whole user base on Ray Data: the rows of a ``ray.data.Dataset`` go through an
actor pool in which every actor loads the engine once (memory-mapped, so actors on one node share
its pages) and answers batches exactly as ``recsys predict`` answers JSON lines.

    import ray, recsys.ray
    users = ray.data.read_json("users.jsonl")            # {"user_id": 7, "item_ids": [...]} per line
    recsys.ray.predict(users, "model_repository/bert4rec/1", k=10).write_json("recommendations/")

Input columns, as in ``recsys predict``'s lines: ``item_ids`` (the history, oldest first; required),
and optionally ``exclude_item_ids``, ``candidate_item_ids`` (rank only these), ``k`` and
``return_embedding``; null values mean "not given". Every other column (``user_id``...) passes
through. The output has the pass-through columns plus ``item_ids`` (the recommendations, best
first), ``scores`` (float32), ``embedding`` (when asked) and ``error``: null for answered rows; for a
row the engine refuses, the message ``recsys predict`` would print, with null ``item_ids`` and
``scores``. Ray retries the batches of a failed actor on a restarted one (its defaults: restarts
and task retries unbounded), so no user is lost or answered twice.

The pool has ``concurrency`` actors of ``threads`` scoring threads (and CPUs) each, or, with
``concurrency=(min, max)``, from ``min`` actors growing to ``max`` as Ray Data finds room (an
autoscaling cluster adds nodes for it). Ray Data's read and write tasks need CPUs of their own, so a
pool whose starting size would hold every CPU the cluster can have is refused rather than left
waiting: every CPU it has now or, where an autoscaler has told the cluster its limits (the cluster
config Ray Data and Ray Train read too), every CPU it can grow to. A ``max`` beyond that is what
autoscaling is for and is accepted.

``num_gpus`` (per actor; fractions share a GPU, as Ray takes them) runs each actor's model on the
GPU Ray gives it (``recsys.Engine(device="cuda")``): the package must be built with CUDA support
(``scripts/build-wheel.sh --cuda 12|13``), and a pool needing more GPUs than the cluster has or can
grow to is refused before anything starts.

``engine_path`` is a local engine directory (the same path on every node: shared storage) or its
folder in object storage (``s3://...``, ``gs://...``, as ``recsys predict --engine`` takes them, with
the same credential chains): each actor then fetches its own copy into its temporary directory.
Run ``cores / threads`` actors per node.
"""

from __future__ import annotations

import inspect
import json
import os
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

if TYPE_CHECKING:  # Ray is an optional dependency: `pip install "recsys[ray]"`.
    import pyarrow
    import ray.data

__all__ = ["predict"]

_NONE = np.empty(0, dtype=np.int64)  # no ids (a row without exclusions)

# The columns recsys predict reads from a line; everything else passes through.
_CONSUMED = ("item_ids", "exclude_item_ids", "candidate_item_ids", "k", "return_embedding")


def predict(
    dataset: "ray.data.Dataset",
    engine_path: "str | os.PathLike[str]",
    k: int = 10,
    *,
    batch_size: int = 1024,
    concurrency: "int | tuple[int, int]" = 1,
    threads: int = 1,
    exclude_seen: bool = True,
    strict_ids: bool = False,
    return_embedding: bool = False,
    num_gpus: float = 0,
    **ray_remote_args: Any,
) -> "ray.data.Dataset":
    """Recommendations for every row of ``dataset`` (lazy, like any Ray Data transform).

    ``k``: the default number of items per row (a row's own ``k`` overrides it). ``batch_size``
    rows go to the engine as one batch. ``concurrency`` actors (or ``(min, max)``: an autoscaling
    pool), each with ``threads`` scoring threads (and as many CPUs reserved). ``exclude_seen`` leaves a history's own items out;
    ``strict_ids`` refuses rows whose ids are unknown to the model instead of dropping those ids;
    ``return_embedding`` adds every row's user embedding. ``num_gpus``: GPUs per actor (0: the
    CPU engine); each actor's model then runs on its GPU. Other keyword arguments go to Ray with
    the actors (e.g. ``max_restarts=0`` to fail fast instead of retrying).
    """
    from ray.data import ActorPoolStrategy

    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    for name, value in (("batch_size", batch_size), ("threads", threads)):
        if not _positive_integer(value):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, (int, float)) or not num_gpus >= 0:
        raise ValueError(f"num_gpus must be a number of GPUs per actor, 0 or more, got {num_gpus!r}")
    smallest, largest = _pool_sizes(concurrency)
    engine_path = os.fspath(engine_path)
    if not engine_path.startswith(("s3://", "gs://")):
        # Actors may start in another working directory: they get an absolute path.
        engine_path = os.path.abspath(engine_path)
        if not os.path.isfile(os.path.join(engine_path, "manifest.json")):
            raise FileNotFoundError(
                f"{engine_path} is not an engine directory (no manifest.json): give the directory "
                "`recsys convert` wrote, at the same path on every node, or its s3:// or gs:// folder"
            )
    _check_resources(smallest, threads, num_gpus, autoscaling=largest > smallest)
    options = dict(ray_remote_args)
    # Rows in = rows out, which lets Ray push limits past the scoring (newer Ray versions).
    if "udf_modifying_row_count" in inspect.signature(dataset.map_batches).parameters:
        options.setdefault("udf_modifying_row_count", False)
    return dataset.map_batches(
        _Predictor,
        fn_constructor_kwargs={
            "engine_path": engine_path,
            "threads": threads,
            "k": k,
            "exclude_seen": exclude_seen,
            "strict_ids": strict_ids,
            "return_embedding": return_embedding,
            "device": "cuda" if num_gpus else "cpu",
        },
        batch_size=batch_size,
        batch_format="pyarrow",
        compute=(ActorPoolStrategy(size=smallest) if smallest == largest
                 else ActorPoolStrategy(min_size=smallest, max_size=largest)),
        num_cpus=threads,
        **({"num_gpus": num_gpus} if num_gpus else {}),
        **options,
    )


def _pool_sizes(concurrency: Any) -> tuple[int, int]:
    """``concurrency`` as (smallest, largest) pool: an int n is (n, n), a pair is (min, max)."""
    if _positive_integer(concurrency):
        return concurrency, concurrency
    if (isinstance(concurrency, (tuple, list)) and len(concurrency) == 2
            and all(_positive_integer(v) for v in concurrency) and concurrency[0] <= concurrency[1]):
        return concurrency[0], concurrency[1]
    raise ValueError(
        f"concurrency must be a positive integer or a (min, max) pair of them with min <= max, "
        f"got {concurrency!r}"
    )


def _autoscaler_maximum() -> Optional[dict[str, float]]:
    """The most of each resource the cluster can grow to, where an autoscaler has reported its
    node groups to the cluster (KubeRay's and Anyscale's do); None where none has. Ray has no
    public call for it: this is the one Ray Data and Ray Train use, guarded, so a Ray without it
    falls back to the cluster's current resources."""
    try:
        from ray._private.state import state

        limits = state.get_max_resources_from_cluster_config()
    except Exception:  # an older or newer Ray without it: judge by today's resources
        return None
    return {name: float(value) for name, value in limits.items()} if limits else None


def _check_resources(actors: int, threads: int, num_gpus: float = 0, autoscaling: bool = False) -> None:
    """Refuses a pool that could never start as asked: its starting size holding every CPU the
    cluster can have (Ray Data would then find none for the tasks that read and write the dataset,
    and wait forever), or needing more GPUs than the cluster can have. "Can have" is what the
    cluster has now, or, where an autoscaler reported its limits, the most it can grow to. An
    autoscaling pool is judged by its minimum: its maximum may wait for nodes."""
    import ray

    if not ray.is_initialized():
        return  # map_batches starts (or joins) the cluster; Ray's own checks apply then.
    now = ray.cluster_resources()
    most = _autoscaler_maximum()

    def limit(resource: str) -> tuple[float, str]:
        current = float(now.get(resource, 0))
        if most is not None and most.get(resource, 0) > current:
            return most[resource], f"the {most[resource]:g} its autoscaler can grow it to ({current:g} now)"
        return current, f"all {current:g}"

    cpus, cpus_said = limit("CPU")
    what = f"the pool's minimum of {actors}" if autoscaling else f"{actors}"
    if cpus and actors * threads >= cpus:
        room = max(int(cpus) - 1, 0) // threads
        raise ValueError(
            f"{what} actor(s) x {threads} thread(s) would hold {cpus_said} CPUs of the Ray "
            f"cluster and leave none to read and write the dataset (the job would never finish): "
            f"start with at most {room} actor(s) of {threads} thread(s) here (concurrency=(min, max) "
            f"lets the pool grow with the cluster), or use a cluster with more CPUs"
        )
    if num_gpus:
        gpus, gpus_said = limit("GPU")
        if actors * num_gpus > gpus:
            raise ValueError(
                f"{what} actor(s) x {num_gpus:g} GPU(s) need {actors * num_gpus:g} GPUs, and the Ray "
                f"cluster has {gpus_said if gpus else 'none'}: use fewer actors or a fraction of a GPU "
                f"each (num_gpus=0.5 shares one between two), or a cluster with GPUs"
            )


class _Predictor:
    """One actor's engine, loaded once, answering batches of rows."""

    def __init__(
        self,
        engine_path: str,
        threads: int,
        k: int,
        exclude_seen: bool,
        strict_ids: bool,
        return_embedding: bool,
        device: str = "cpu",
    ) -> None:
        import recsys

        # Ray makes the actor's GPU its CUDA device 0 (CUDA_VISIBLE_DEVICES).
        self.engine = recsys.Engine(engine_path, threads=threads, device=device)
        self.string_ids = not isinstance(self.engine.item_ids, np.ndarray)
        self.k = k
        self.exclude_seen = exclude_seen
        self.strict_ids = strict_ids
        self.return_embedding = return_embedding

    def __call__(self, batch: "pyarrow.Table") -> "pyarrow.Table":
        import pyarrow as pa

        if "item_ids" not in batch.column_names:
            raise ValueError(
                f'the dataset has no "item_ids" column (the history, oldest first); it has: '
                f"{', '.join(batch.column_names) or 'no columns'}"
            )
        rows = batch.num_rows
        histories = _id_lists(batch.column("item_ids"))
        exclude = _optional_column(batch, "exclude_item_ids")
        candidates = _optional_column(batch, "candidate_item_ids")
        ks_given = _optional_column(batch, "k")
        embedding_asked = _optional_column(batch, "return_embedding")

        ids: list[Any] = [None] * rows
        scores: list[Any] = [None] * rows
        embeddings: list[Any] = [None] * rows
        errors: list[Optional[str]] = [None] * rows
        # Rows refused before the engine sees them, with recsys predict's messages.
        ks: list[Optional[int]] = [None] * rows
        wants_embedding = [self.return_embedding] * rows
        for r in range(rows):
            if histories[r] is None:
                errors[r] = 'missing "item_ids"'
            elif ks_given is not None and ks_given[r] is not None:
                value = ks_given[r]
                if _positive_integer(value):
                    ks[r] = int(value)
                else:
                    errors[r] = f'"k" must be a positive integer, found {json.dumps(value)}'
            if embedding_asked is not None and embedding_asked[r]:
                wants_embedding[r] = True

        # One engine batch for the rows ranking the whole catalogue, one for those ranking their
        # own candidates (the engine takes candidates for all of a batch or none).
        with_candidates = [r for r in range(rows) if errors[r] is None and candidates is not None
                           and candidates[r] is not None]
        whole = [r for r in range(rows) if errors[r] is None
                 and (candidates is None or candidates[r] is None)]
        for group, use_candidates in ((whole, False), (with_candidates, True)):
            if not group:
                continue
            embed = any(wants_embedding[r] for r in group)
            answer = self.engine.predict(
                [histories[r] for r in group],
                k=[ks[r] for r in group],
                exclude=None if exclude is None else [_NONE if exclude[r] is None else exclude[r] for r in group],
                candidates=[candidates[r] for r in group] if use_candidates else None,
                default_k=self.k,
                exclude_seen=self.exclude_seen,
                strict=self.strict_ids,
                embedding=embed,
            )
            for r, row_ids, row_scores, row_embedding, error in zip(group, *answer):
                if error is not None:
                    errors[r] = error
                    continue
                ids[r], scores[r] = row_ids, row_scores
                if wants_embedding[r]:
                    embeddings[r] = row_embedding

        keep = [name for name in batch.column_names if name not in _CONSUMED]
        out = batch.select(keep)
        id_type = pa.string() if self.string_ids else pa.int64()
        out = out.append_column("item_ids", _list_array(ids, id_type))
        out = out.append_column("scores", _list_array(scores, pa.float32()))
        if self.return_embedding or embedding_asked is not None:
            out = out.append_column("embedding", _list_array(embeddings, pa.float32()))
        return out.append_column("error", pa.array(errors, type=pa.string()))


def _optional_column(batch: "pyarrow.Table", name: str) -> Optional[list[Any]]:
    if name not in batch.column_names:
        return None
    if name.endswith("item_ids"):
        return _id_lists(batch.column(name))
    return batch.column(name).to_pylist()


def _id_lists(column: "pyarrow.ChunkedArray") -> list[Any]:
    """A list column as one entry per row (None for nulls): int64 numpy views into the column's
    values for integer ids (the engine copies each as one slice), Python lists otherwise."""
    import pyarrow as pa

    array = column.combine_chunks()
    if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)) \
            or not pa.types.is_integer(array.type.value_type) or array.values.null_count:
        return array.to_pylist()
    values = array.values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    offsets = array.offsets.to_numpy()
    valid = array.is_valid().to_numpy(zero_copy_only=False)
    return [values[offsets[r]:offsets[r + 1]] if valid[r] else None for r in range(len(array))]


def _positive_integer(value: Any) -> bool:
    # A column holding a fraction anywhere is read as floats, so 3.0 stands for 3 there.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return float(value).is_integer() and value >= 1


def _list_array(rows: list[Any], value_type: "pyarrow.DataType") -> "pyarrow.Array":
    """A list column from per-row arrays (None: a null row), built from one flat values array."""
    import pyarrow as pa

    lengths = np.fromiter((0 if row is None else len(row) for row in rows), dtype=np.int32, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    present = [row for row in rows if row is not None and len(row)]
    if value_type == pa.string():
        values = pa.array([v for row in present for v in row], type=value_type)
    elif present:
        values = pa.array(np.concatenate(present).astype(value_type.to_pandas_dtype(), copy=False))
    else:
        values = pa.array([], type=value_type)
    mask = pa.array([row is None for row in rows], type=pa.bool_())
    return pa.ListArray.from_arrays(pa.array(offsets), values, mask=mask)
