"""Makes tests/fixtures/recbole_dataset/: the files RecBole 1.2.1 itself saves for the demo data
(`save_dataset` and `save_dataloaders`), and RecBole's own item token list as the golden answer.

Run where RecBole is installed (it needs PyTorch; the test environment does not carry either):

    python scripts/make_recbole_dataset_fixture.py INTERACTIONS.txt tests/fixtures/recbole_dataset

INTERACTIONS.txt is the demo models' training data (`user_id item_id timestamp` per line, the data
the fixtures in tests/fixtures/ were trained on). RecBole 1.2.1 wants numpy < 2. With the recsys
package installed in the same environment, it also checks `recsys.recbole.item_map` on the live
RecBole Dataset against the saved files.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path


def save(interactions: list[str], name: str, out: Path, **saving: bool) -> list[str]:
    """Runs RecBole on `interactions` as dataset `name` with the given saving flags, copies what it
    saved into `out`, and returns RecBole's own item tokens (index 0 is [PAD])."""
    from recbole.config import Config
    from recbole.data import create_dataset, data_preparation

    work = Path(tempfile.mkdtemp())
    (work / name).mkdir()
    with open(work / name / f"{name}.inter", "w") as atomic:
        atomic.write("user_id:token\titem_id:token\ttimestamp:float\n")
        for line in interactions:
            user, item, ts = line.split()
            atomic.write(f"{user}\t{item}\t{ts}\n")
    config = Config(model="MultiVAE", dataset=name, config_dict={
        "data_path": str(work), "checkpoint_dir": str(work / "saved"),
        "load_col": {"inter": ["user_id", "item_id", "timestamp"]},
        "user_inter_num_interval": "[0,inf)", "item_inter_num_interval": "[0,inf)",
        "show_progress": False, "use_gpu": False, "state": "WARNING", **saving,
    })
    dataset = create_dataset(config)
    loaders = data_preparation(config, dataset)
    for saved in sorted((work / "saved").iterdir()):
        shutil.copy(saved, out / saved.name)
        print(f"{saved.name}: {saved.stat().st_size} bytes")
    tokens = [str(t) for t in dataset.field2id_token[dataset.iid_field]]
    (out / f"{name}.field2id_token.json").write_text(json.dumps(
        {"recbole": "1.2.1", "iid_field": dataset.iid_field, "field2id_token": tokens}) + "\n")
    print(f"{name}: {len(tokens) - 1} items; first {tokens[:4]}")
    check_live([dataset, *loaders], out, name, tokens)
    return tokens


def check_live(live: list[object], out: Path, name: str, tokens: list[str]) -> None:
    """recsys.recbole.item_map of the live Dataset, of each live data loader and of each saved
    file: RecBole's own tokens every time."""
    try:
        import recsys.recbole
    except ImportError:
        print("recsys is not installed here: the live Dataset check is skipped")
        return
    from_object = {i: t for i, t in enumerate(tokens) if i > 0}
    for obj in live:
        assert recsys.recbole.item_map(obj) == from_object, type(obj).__name__
    for saved in sorted(out.glob(f"{name}-*.pth")):
        assert recsys.recbole.item_map(saved) == from_object, saved
    print(f"{name}: recsys.recbole.item_map gives RecBole's own tokens from the live Dataset, its data loaders and the saved files")


def main() -> None:
    interactions_file, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    lines = interactions_file.read_text().splitlines()
    # The whole training data, saved as a dataset (4.6 MB): its map is the demo models' own.
    save(lines, "recsys-demo", out, save_dataset=True)
    # The first 300 users, saved as data loaders (the whole data would make an 18 MB file).
    users = sorted({line.split()[0] for line in lines}, key=int)[:300]
    keep = set(users)
    save([line for line in lines if line.split()[0] in keep], "recsys-demo-sample", out, save_dataloaders=True)


if __name__ == "__main__":
    main()
