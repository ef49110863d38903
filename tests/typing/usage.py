"""How the README and the package's docs call recsys, type-checked against its stubs (mypy --strict
and pyright in strict mode, in tests/integration/test_python.py): lists, numpy arrays of ids and
rows of a 2-D array are all histories. Never run, only checked."""
# pyright: strict

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

import recsys
import recsys.recbole


def calls(engine: recsys.Engine) -> None:
    info: dict[str, Any] = engine.info
    sha: str = info["weights_sha256"]
    assert len(sha) == 64
    lists = [[10011403, 10011207], [10011739]]
    arrays = [np.array([10011403, 10011207], dtype=np.int64), np.array([10011739], dtype=np.int64)]
    matrix = np.array([[10011403, 10011207], [10011739, 10011207]], dtype=np.int64)
    strings = [["sku-1", "sku-2"]]
    for histories in (lists, arrays, matrix, strings):
        ids, scores = engine.recommend(histories, k=10)
        top: npt.NDArray[np.float32] = scores
        engine.embed(histories)
        engine.score(histories)
    engine.rerank(lists, candidates=arrays, k=5, exclude=matrix)
    engine.predict(arrays, k=[5, None], candidates=lists, embedding=True)
    # Item set filters: one list for every history, or one per history.
    engine.recommend(lists, k=10, include_sets=["category=shoes", "region=EU"], exclude_sets=["age_rating=adult"])
    engine.predict(lists, include_sets=[["category=shoes"], ["category=hats"]])
    engine.rerank(lists, candidates=lists, exclude_sets=["age_rating=adult"])
    sets: dict[str, int] = engine.item_sets
    # Models that read time (HSTU): each history's event times, and when the event to predict is.
    times = [[1_700_000_000, 1_700_000_600], [1_700_000_000]]
    engine.recommend(lists, k=10, timestamps=times, query_timestamp=1_700_001_200)
    engine.predict(lists, timestamps=np.array([[1, 2], [3, 4]], dtype=np.int64), query_timestamp=[5, 6])
    engine.embed(lists, timestamps=times)
    engine.score(lists, timestamps=times, query_timestamp=1_700_001_200)
    engine.rerank(lists, candidates=lists, timestamps=times, query_timestamp=[1, 2])
    # Live availability: an object published by `recsys availability publish`.
    version: int = engine.load_availability("s3://models/shop/recsys-availability.bin")
    in_force: int | None = engine.availability_version
    sessions = recsys.Engine("engine", prefix_cache_bytes=64 << 20)
    cache: dict[str, int] | None = sessions.prefix_cache_stats
    plan: str | None = recsys.Engine("engine", screen_policy="never").screen_plan
    _ = plan
    _ = cache
    _ = (version, in_force)
    recsys.convert("bert4rec", "model.pt", "items.tsv", "out", item_attributes="attributes.tsv")
    _ = sets
    n: int = engine.num_items
    where: str = recsys.Engine("engine", threads=2, device="cuda:0").device
    _ = (ids, top, n, where)


def conversions(path: str) -> recsys.Engine:
    engine = recsys.convert("vaecf", "model.safetensors", "item_id_map.tsv", path, precision="fp16")
    report = recsys.evaluate(engine, "test_set.tsv", k=(10, 20))
    assert isinstance(report["metrics"], dict)
    return recsys.Engine(path, threads=2)


def recbole_maps(saved: str) -> dict[int, str]:
    from pathlib import Path

    recsys.recbole.item_map(Path(saved), "item_id_map.tsv")
    return recsys.recbole.item_map(saved)
