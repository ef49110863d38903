"""RecBole's item map, without hand work.

A RecBole model's item embedding rows follow RecBole's own numbering of the items: the dataset's
``field2id_token`` for the item field, ``[PAD]`` at 0. ``item_map`` returns that numbering and
writes it as the TSV ``recsys convert --item-map`` takes:

    import recsys.recbole
    recsys.recbole.item_map(dataset, "item_id_map.tsv")                        # where RecBole runs
    recsys.recbole.item_map("saved/ml-1m-SequentialDataset.pth", "item_id_map.tsv")

A file is the one RecBole wrote with ``save_dataset: True`` (``<dataset>-<DatasetClass>.pth``) or
``save_dataloaders: True`` (``<dataset>-for-<model>-dataloader.pth``); it is read as data by the
same reader as ``recsys convert --recbole-dataset`` (nothing in it is executed, and neither RecBole
nor PyTorch is needed). An object is a RecBole ``Dataset``, or a RecBole data loader (its dataset is
used), as ``create_dataset`` and ``data_preparation`` return them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from ._recsys import recbole_item_tokens

__all__ = ["item_map"]

PAD_TOKEN = "[PAD]"


def item_map(source: Union[str, "os.PathLike[str]", Any],
             out: Union[str, "os.PathLike[str]", None] = None) -> Dict[int, str]:
    """The item map of a RecBole dataset: ``{internal_index: external_item_id}`` for 1..N, the
    external ids as RecBole's tokens (text). With ``out``, also written as
    ``internal_index<TAB>external_item_id`` lines under a header (``recsys convert --item-map``)."""
    if isinstance(source, (str, os.PathLike)):
        tokens = recbole_item_tokens(os.fspath(source))
    else:
        tokens = _tokens_of(source)
    mapping = {index: token for index, token in enumerate(tokens, start=1)}
    if out is not None:
        with open(out, "w", encoding="utf-8", newline="\n") as f:
            f.write("internal_index\texternal_item_id\n")
            f.writelines(f"{index}\t{token}\n" for index, token in mapping.items())
    return mapping


def _tokens_of(obj: Any) -> List[str]:
    """The item tokens 1..N of a live RecBole Dataset, or of a data loader's dataset."""
    dataset = obj
    if not hasattr(dataset, "field2id_token"):
        dataset = getattr(obj, "_dataset", None) or getattr(obj, "dataset", None)
    if dataset is None or not hasattr(dataset, "field2id_token") or not hasattr(dataset, "iid_field"):
        raise TypeError(
            f"expected a RecBole Dataset or data loader, or the path of a file RecBole saved; got {type(obj).__name__}")
    field: Optional[str] = dataset.iid_field
    table = dataset.field2id_token
    if field not in table:
        raise ValueError(f"the dataset's field2id_token has no entry for its item field {field!r}")
    tokens = [str(t) for t in table[field]]
    if not tokens or tokens[0] != PAD_TOKEN:
        raise ValueError(f"field2id_token[{field!r}] does not start with RecBole's {PAD_TOKEN!r}")
    if len(tokens) < 2:
        raise ValueError(f"field2id_token[{field!r}] holds no item")
    return tokens[1:]


def _main() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m recsys.recbole",
                                     description="Write the item map of a dataset file RecBole saved.")
    parser.add_argument("saved_file", type=Path, help="<dataset>-<DatasetClass>.pth or <dataset>-for-<model>-dataloader.pth")
    parser.add_argument("out", type=Path, help="the TSV to write (recsys convert --item-map)")
    args = parser.parse_args()
    mapping = item_map(args.saved_file, args.out)
    print(f"{len(mapping)} items written to {args.out}")


if __name__ == "__main__":
    _main()
