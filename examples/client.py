"""Ask the demo models for recommendations through Triton's Python client (HTTP and gRPC).

    .venv/bin/python examples/client.py [--http 127.0.0.1:8000] [--grpc 127.0.0.1:8001]
"""

import argparse

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def request(module, history, k=5, exclude=None):
    items = np.array([history], dtype=np.int64)
    inputs = [module.InferInput("ITEM_IDS", list(items.shape), "INT64")]
    inputs[0].set_data_from_numpy(items)
    k_input = module.InferInput("K", [1, 1], "INT32")
    k_input.set_data_from_numpy(np.array([[k]], dtype=np.int32))
    inputs.append(k_input)
    if exclude:
        ex = np.array([exclude], dtype=np.int64)
        inputs.append(module.InferInput("EXCLUDE_ITEM_IDS", list(ex.shape), "INT64"))
        inputs[-1].set_data_from_numpy(ex)
    return inputs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", default="127.0.0.1:8000")
    parser.add_argument("--grpc", default="127.0.0.1:8001")
    args = parser.parse_args()

    history = [10011403, 10011207, 10011739]  # a user's items, oldest first
    http = httpclient.InferenceServerClient(args.http)
    for model in ["bert4rec", "vaecf", "sasrec", "gru4rec"]:
        result = http.infer(model, request(httpclient, history))
        print(f"{model} (HTTP): items {result.as_numpy('TOP_ITEM_IDS')[0].tolist()}")
        scores = ", ".join(f"{s:.3f}" for s in result.as_numpy("TOP_SCORES")[0])
        print(f"{' ' * len(model)}         scores [{scores}]")

    grpc = grpcclient.InferenceServerClient(args.grpc)
    result = grpc.infer("bert4rec", request(grpcclient, history, k=3, exclude=[10011445]))
    print(f"bert4rec (gRPC, k=3, excluding 10011445): {result.as_numpy('TOP_ITEM_IDS')[0].tolist()}")


if __name__ == "__main__":
    main()
