"""Retrieval then ranking through Triton: one model's USER_EMBEDDING queries an inner-product index
(FAISS) over its exported item table, and another model re-ranks the candidates it returns
(CANDIDATE_ITEM_IDS). Prints one JSON object per history.

    recsys export-items --engine model_repository/vaecf/1 --output items
    .venv/bin/python examples/retrieve_then_rank.py --grpc 127.0.0.1:8001 --items items \\
        --retriever vaecf --ranker bert4rec --history 10011403 10011207

The retriever's config must declare the USER_EMBEDDING output: the demo configs carry it as a
commented line (model_repository/vaecf/config.pbtxt) to uncomment before the server starts.
Needs numpy, faiss-cpu and tritonclient[grpc].
"""

from __future__ import annotations

import argparse
import json

import faiss
import numpy as np
import tritonclient.grpc as grpcclient


def ids_input(name: str, ids: list[int]) -> grpcclient.InferInput:
    array = np.array([ids], dtype=np.int64)
    tensor = grpcclient.InferInput(name, list(array.shape), "INT64")
    tensor.set_data_from_numpy(array)
    return tensor


def retrieve_then_rank(client, index, item_ids, retriever: str, ranker: str, history: list[int],
                       candidates: int, k: int) -> dict:
    # Stage 1: the user embedding alone (nothing is scored on the server), then the index.
    answer = client.infer(retriever, [ids_input("ITEM_IDS", history)],
                          outputs=[grpcclient.InferRequestedOutput("USER_EMBEDDING")])
    user = answer.as_numpy("USER_EMBEDDING")
    _, rows = index.search(user, candidates + len(history))
    seen = set(history)
    pool = [item_ids[r] for r in rows[0] if item_ids[r] not in seen][:candidates]
    # Stage 2: the ranker scores only the pool (its history is left out as always).
    k_input = grpcclient.InferInput("K", [1, 1], "INT32")
    k_input.set_data_from_numpy(np.array([[k]], dtype=np.int32))
    ranked = client.infer(ranker, [ids_input("ITEM_IDS", history), k_input, ids_input("CANDIDATE_ITEM_IDS", pool)],
                          outputs=[grpcclient.InferRequestedOutput("TOP_ITEM_IDS"),
                                   grpcclient.InferRequestedOutput("TOP_SCORES")])
    return {
        "history": history,
        "candidates": pool,
        "item_ids": ranked.as_numpy("TOP_ITEM_IDS")[0].tolist(),
        "scores": ranked.as_numpy("TOP_SCORES")[0].tolist(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpc", default="127.0.0.1:8001", help="tritonserver's gRPC address")
    parser.add_argument("--items", required=True, help="what `recsys export-items --output` was given (FILE.npy, FILE.ids.txt)")
    parser.add_argument("--retriever", default="vaecf", help="model whose USER_EMBEDDING queries the index")
    parser.add_argument("--ranker", default="bert4rec", help="model that ranks the candidates (same catalogue)")
    parser.add_argument("--history", type=int, nargs="+", action="append", required=True,
                        help="a history, oldest first (repeat the flag for more users)")
    parser.add_argument("--candidates", type=int, default=200, help="candidates retrieved per user")
    parser.add_argument("--k", type=int, default=10, help="items returned per user")
    args = parser.parse_args()

    table = np.load(f"{args.items}.npy")
    item_ids = [int(i) for i in open(f"{args.items}.ids.txt").read().split()]
    index = faiss.IndexFlatIP(table.shape[1])
    index.add(table)
    client = grpcclient.InferenceServerClient(args.grpc)
    for history in args.history:
        print(json.dumps(retrieve_then_rank(client, index, item_ids, args.retriever, args.ranker, history,
                                            args.candidates, args.k)))


if __name__ == "__main__":
    main()
