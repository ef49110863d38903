"""A live catalogue through the CLI: `recsys export-items --with-input-rows` writes a table that
`recsys predict --catalogue` takes back as a catalogue delta. Items cut out of each fixture
checkpoint (all four families; the checkpoint rewritten here with numpy, independently of recsys)
and given back as a delta answer as the engine converted from the whole checkpoint; retired items
are never returned while every other answer stays; a table that cannot apply is refused naming
the item. The engine-level equality at every precision and with the screen is tested in Rust
(engine/tests/catalogue.rs)."""

from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from conftest import FIXTURES, convert

KINDS = [("bert4rec", "bert4rec"), ("vaecf", "multivae"), ("sasrec", "sasrec"), ("gru4rec", "gru4rec")]
N_ITEMS = 2000
# Mult-VAE sums a history's input rows in index order, and a delta's new items come after every
# converted one: f32 rounding of that sum (the Rust test measures up to 6.1e-7).
VAECF_SCORE_REL_TOL = 1e-6


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    data = raw[8 + header_len:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", name
        start, end = info["data_offsets"]
        tensors[name] = np.frombuffer(data[start:end], dtype="<f4").reshape(info["shape"])
    return tensors


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        blob = np.ascontiguousarray(tensors[name], dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def cut_fixture(model_dir: str, cut: list[int], out: Path) -> tuple[Path, Path, Path]:
    """The fixture checkpoint without the items at internal indices `cut`: every axis over the
    items (N+1, or N+2 with BERT4Rec's mask token) loses them; the item map and config follow."""
    out.mkdir(parents=True)
    tensors = read_safetensors(FIXTURES / model_dir / "model.safetensors")
    for name, tensor in tensors.items():
        for axis, size in enumerate(tensor.shape):
            if size in (N_ITEMS + 1, N_ITEMS + 2):
                tensor = np.delete(tensor, cut, axis=axis)
        tensors[name] = tensor
    checkpoint = out / "model.safetensors"
    write_safetensors(checkpoint, tensors)
    lines = (FIXTURES / model_dir / "item_id_map.tsv").read_text().splitlines()[1:]
    kept = [line.split("\t")[1] for line in lines if int(line.split("\t")[0]) not in set(cut)]
    item_map = out / "item_id_map.tsv"
    item_map.write_text("internal_index\texternal_item_id\n" + "".join(f"{i + 1}\t{e}\n" for i, e in enumerate(kept)))
    config = json.loads((FIXTURES / model_dir / "config.json").read_text())
    n = N_ITEMS - len(cut)
    for key, value in [("n_real_items", n), ("recbole_n_items", n + 1), ("input_dim", n + 1),
                       ("mask_index", n + 1), ("item_embedding_rows", n + 2)]:
        if key in config:
            config[key] = value
    config_path = out / "config.json"
    config_path.write_text(json.dumps(config))
    return checkpoint, config_path, item_map


def predict(recsys_bin: Path, engine: Path, users: Path, *extra: str, k: int = 20) -> tuple[list[dict], str]:
    run = subprocess.run([str(recsys_bin), "predict", "--engine", str(engine), "--input", str(users), "--output", "-",
                          "--k", str(k), *extra], check=True, capture_output=True, text=True)
    return [json.loads(line) for line in run.stdout.splitlines()], run.stderr


def users_file(tmp_path: Path) -> Path:
    cases = [line.split("\t") for line in (FIXTURES / "test_set.tsv").read_text().splitlines()[1:201]]
    users = tmp_path / "users.jsonl"
    users.write_text("".join(json.dumps({"item_ids": [int(i) for i in case[2].split()]}) + "\n" for case in cases))
    return users


def export(recsys_bin: Path, engine: Path, out: Path) -> pa.Table:
    subprocess.run([str(recsys_bin), "export-items", "--engine", str(engine), "--output", str(out),
                    "--format", "parquet", "--with-input-rows"], check=True, capture_output=True)
    return pq.read_table(f"{out}.parquet")


def assert_same(kind: str, got: list[dict], want: list[dict]) -> None:
    for row, (g, w) in enumerate(zip(got, want)):
        if kind == "vaecf":
            np.testing.assert_allclose(g["scores"], w["scores"], rtol=VAECF_SCORE_REL_TOL, err_msg=f"row {row}")
            # Ranks may differ only between items whose scores agree to that tolerance.
            for rank, (gi, wi) in enumerate(zip(g["item_ids"], w["item_ids"])):
                if gi != wi:
                    assert abs(g["scores"][rank] - w["scores"][w["item_ids"].index(gi)]) <= \
                        VAECF_SCORE_REL_TOL * abs(w["scores"][rank]), (kind, row, rank)
        else:
            assert g == w, (kind, row)


def test_items_cut_from_the_checkpoint_and_given_back_answer_as_the_whole_engine(recsys_bin, tmp_path):
    users = users_file(tmp_path)
    cut = list(range(1, N_ITEMS + 1, 41)) + [N_ITEMS]
    for kind, model_dir in KINDS:
        full = tmp_path / f"{kind}-full"
        convert(recsys_bin, kind, model_dir, "model.safetensors", full, FIXTURES / model_dir / "item_id_map.tsv")
        table = export(recsys_bin, full, tmp_path / f"{kind}-items")
        assert table.schema.field("input_vector").type.list_size == (
            600 if kind == "vaecf" else table.schema.field("vector").type.list_size - 1)
        if kind != "vaecf":
            # Tied models: the input row is the vector's embedding.
            vectors = np.stack(table["vector"].to_numpy(zero_copy_only=False))
            inputs = np.stack(table["input_vector"].to_numpy(zero_copy_only=False))
            np.testing.assert_array_equal(vectors[:, :-1], inputs)
        # The cut items' rows as the whole engine exported them: the delta.
        delta = table.take([i - 1 for i in cut])
        pq.write_table(delta, tmp_path / f"{kind}-delta.parquet")

        checkpoint, config, item_map = cut_fixture(model_dir, cut, tmp_path / f"{kind}-cut-checkpoint")
        engine = tmp_path / f"{kind}-cut"
        subprocess.run([str(recsys_bin), "convert", "--force", "--kind", kind, "--checkpoint", str(checkpoint),
                        "--config", str(config), "--item-map", str(item_map), "--out", str(engine)],
                       check=True, capture_output=True)
        want, _ = predict(recsys_bin, full, users)
        alone, _ = predict(recsys_bin, engine, users)
        assert alone != want, kind
        got, note = predict(recsys_bin, engine, users, "--catalogue", str(tmp_path / f"{kind}-delta.parquet"))
        assert f"{len(cut)} item(s) added, 0 replaced, 0 retired ({N_ITEMS} items in all)" in note, note
        assert_same(kind, got, want)


def test_retired_items_leave_every_answer_and_others_stay(recsys_bin, tmp_path):
    users = users_file(tmp_path)
    for kind, model_dir in KINDS:
        engine = tmp_path / kind
        convert(recsys_bin, kind, model_dir, "model.safetensors", engine, FIXTURES / model_dir / "item_id_map.tsv")
        before, _ = predict(recsys_bin, engine, users, k=40)
        counts: dict[int, int] = {}
        for answer in before:
            for item in answer["item_ids"][:5]:
                counts[item] = counts.get(item, 0) + 1
        retired = sorted(counts, key=lambda i: (-counts[i], i))[:5]
        # A bare retirement: ids and op, vectors null (pyarrow writes variable-size lists).
        table = pa.table({"item_id": pa.array(retired, pa.int64()),
                          "vector": pa.array([None] * len(retired), pa.list_(pa.float32())),
                          "op": ["retire"] * len(retired)})
        pq.write_table(table, tmp_path / f"{kind}-retire.parquet")
        after, note = predict(recsys_bin, engine, users, "--catalogue", str(tmp_path / f"{kind}-retire.parquet"))
        assert "0 item(s) added, 0 replaced, 5 retired" in note, note
        for row, (got, all_) in enumerate(zip(after, before)):
            assert not set(got["item_ids"]) & set(retired), (kind, row)
            keep = [(i, s) for i, s in zip(all_["item_ids"], all_["scores"]) if i not in retired][:20]
            assert list(zip(got["item_ids"], got["scores"])) == keep, (kind, row)


def test_a_table_that_cannot_apply_is_refused_naming_the_item(recsys_bin, tmp_path):
    users = users_file(tmp_path)
    engine = tmp_path / "sasrec"
    convert(recsys_bin, "sasrec", "sasrec", "model.safetensors", engine, FIXTURES / "sasrec" / "item_id_map.tsv")
    first_id = int((FIXTURES / "sasrec" / "item_id_map.tsv").read_text().splitlines()[1].split("\t")[1])
    cases = [
        ({"item_id": [first_id], "vector": [[0.5] * 3]}, f"item {first_id}: vector holds 3 values"),
        ({"item_id": [123456789], "vector": [None], "op": ["retire"]}, "item 123456789 is not in the engine"),
        ({"item_id": [first_id], "vector": [[0.0] * 65], "op": ["delete"]}, 'op "delete" is neither'),
        ({"id": [1]}, 'no "item_id" column'),
    ]
    for columns, expected in cases:
        path = tmp_path / "bad.parquet"
        pq.write_table(pa.table(columns), path)
        run = subprocess.run([str(recsys_bin), "predict", "--engine", str(engine), "--input", str(users),
                              "--output", "-", "--catalogue", str(path)], capture_output=True, text=True)
        assert run.returncode != 0 and expected in run.stderr, (expected, run.stderr)
