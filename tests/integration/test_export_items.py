"""`recsys export-items` read by numpy, as an ANN library would read it: a float32 [N, d + 1] array in
item order, and the external ids one per line. That the rows give the model's scores by inner product
is checked in Rust (converter/tests/cli.rs) against the engine's own scores."""

from __future__ import annotations

import subprocess

import numpy as np

from conftest import FIXTURES, convert


def test_numpy_loads_the_item_table_and_its_ids(recsys_bin, tmp_path):
    engine = tmp_path / "vaecf"
    convert(recsys_bin, "vaecf", "multivae", "model.safetensors", engine)
    out = tmp_path / "items"
    subprocess.run([str(recsys_bin), "export-items", "--engine", str(engine), "--output", str(out)],
                   check=True, capture_output=True)
    table = np.load(tmp_path / "items.npy")
    ids = (tmp_path / "items.ids.txt").read_text().split("\n")[:-1]
    catalogue = [line.split("\t")[1] for line in (FIXTURES / "multivae" / "item_id_map.tsv").read_text().splitlines()[1:]]
    assert table.dtype == np.float32 and table.flags["C_CONTIGUOUS"]
    assert table.shape[0] == len(catalogue) == len(ids)
    assert table.shape[1] > 1 and np.isfinite(table).all()
    # Row r is the item with internal index r + 1, whose external id the item map gives.
    internal_to_external = {int(line.split("\t")[0]): line.split("\t")[1]
                            for line in (FIXTURES / "multivae" / "item_id_map.tsv").read_text().splitlines()[1:]}
    assert ids == [internal_to_external[r + 1] for r in range(len(ids))]
