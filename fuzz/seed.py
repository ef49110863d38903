"""Seed corpora for the fuzz targets from the fixtures (written to fuzz/seeds/<target>/, ignored by git).

checkpoint: the fixture .pt, RecBole .pth and .safetensors files (and truncations of them);
engine_dir: manifest + item_ids.tsv + weights of converted fixture engines joined by the marker line;
predict_jsonl: lines of examples/users.jsonl plus a few edge cases; request: a few hand-made inputs.
"""

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SEEDS = ROOT / "fuzz" / "seeds"
MARKER = b"\n--recsys-fuzz-part--\n"
RECSYS = ROOT / "target" / "release" / "recsys"


def write(target: str, name: str, data: bytes) -> None:
    (SEEDS / target).mkdir(parents=True, exist_ok=True)
    (SEEDS / target / name).write_bytes(data)


def safetensors(tensors: dict[str, np.ndarray]) -> bytes:
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        b = np.ascontiguousarray(t, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return len(h).to_bytes(8, "little") + h + b"".join(blobs)


def tiny_models(work: Path) -> list[tuple[str, Path, Path, Path]]:
    """Tiny BERT4Rec and Mult-VAE checkpoints (random weights), so engine-directory inputs are a few
    KiB and the fuzzer runs thousands of them a second."""
    rng = np.random.default_rng(0)
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 0.1  # noqa: E731
    n, h, length, inner = 12, 8, 6, 16
    bert = {"output_bias": r(n + 1), "item_embedding.weight": r(n + 2, h), "position_embedding.weight": r(length, h),
            "LayerNorm.weight": r(h) + 1, "LayerNorm.bias": r(h), "output_ffn.weight": r(h, h), "output_ffn.bias": r(h),
            "output_ln.weight": r(h) + 1, "output_ln.bias": r(h)}
    p = "trm_encoder.layer.0."
    for m in ["query", "key", "value", "dense"]:
        bert[f"{p}multi_head_attention.{m}.weight"], bert[f"{p}multi_head_attention.{m}.bias"] = r(h, h), r(h)
    for ln in ["multi_head_attention.LayerNorm", "feed_forward.LayerNorm"]:
        bert[f"{p}{ln}.weight"], bert[f"{p}{ln}.bias"] = r(h) + 1, r(h)
    bert[f"{p}feed_forward.dense_1.weight"], bert[f"{p}feed_forward.dense_1.bias"] = r(inner, h), r(inner)
    bert[f"{p}feed_forward.dense_2.weight"], bert[f"{p}feed_forward.dense_2.bias"] = r(h, inner), r(h)
    bert_cfg = {"n_items": n, "MAX_ITEM_LIST_LENGTH": length, "hidden_size": h, "n_layers": 1, "n_heads": 2,
                "inner_size": inner, "hidden_act": "gelu", "layer_norm_eps": 1e-12}
    vae = {"encoder.0.weight": r(10, n + 1), "encoder.0.bias": r(10), "encoder.2.weight": r(8, 10),
           "encoder.2.bias": r(8), "decoder.0.weight": r(10, 4), "decoder.0.bias": r(10),
           "decoder.2.weight": r(n + 1, 10), "decoder.2.bias": r(n + 1)}
    vae_cfg = {"n_items": n, "mlp_hidden_size": [10], "latent_dimension": 8}
    out = []
    for kind, tensors, cfg in [("bert4rec", bert, bert_cfg), ("vaecf", vae, vae_cfg)]:
        ckpt, cfg_path, ids = work / f"tiny-{kind}.safetensors", work / f"tiny-{kind}.json", work / "tiny-ids.tsv"
        ckpt.write_bytes(safetensors(tensors))
        cfg_path.write_text(json.dumps(cfg))
        ids.write_text("internal_index\texternal_item_id\n" + "".join(f"{i}\t{1000 + i}\n" for i in range(1, n + 1)))
        out.append((kind, ckpt, cfg_path, ids))
    return out


def main() -> None:
    shutil.rmtree(SEEDS, ignore_errors=True)
    fixtures = ROOT / "tests" / "fixtures"
    for path in [fixtures / "bert4rec" / "model.pt", fixtures / "bert4rec" / "recbole_checkpoint.pth",
                 fixtures / "bert4rec" / "model.safetensors"]:
        data = path.read_bytes()
        write("checkpoint", path.name, data)
        write("checkpoint", path.name + ".cut", data[: len(data) // 3])
    work = ROOT / "fuzz" / "work"
    work.mkdir(parents=True, exist_ok=True)
    for kind, ckpt, cfg, ids in tiny_models(work):
        write("checkpoint", ckpt.name, ckpt.read_bytes())
        for precision in ["fp32", "fp16", "int8"]:
            engine = work / f"seed-{kind}-{precision}"
            subprocess.run([str(RECSYS), "convert", "--kind", kind, "--checkpoint", str(ckpt), "--config", str(cfg),
                            "--item-map", str(ids), "--precision", precision, "--out", str(engine), "--force"],
                           check=True, capture_output=True, text=True)
            parts = [(engine / f).read_bytes() for f in ["manifest.json", "item_ids.tsv", "weights.safetensors"]]
            write("engine_dir", engine.name, MARKER.join(parts))
    for i, line in enumerate((ROOT / "examples" / "users.jsonl").read_text().splitlines()):
        write("predict_jsonl", f"user{i}", line.encode())
    for i, line in enumerate(['{"item_ids": ["a", 1, "b"], "k": 3, "exclude_item_ids": [2]}', '{"item_ids": []}',
                              '[1,2,3]', '{"item_ids": [1e400]}', '{"k": -1, "item_ids": [1]}']):
        write("predict_jsonl", f"edge{i}", line.encode())
    # request: arbitrary's encoding is opaque; a few random-ish starts are enough for libFuzzer.
    for i, data in enumerate([b"\x01\x00\x00" + bytes(range(64)), b"\x00\x01\x03" + b"\x10" * 40]):
        write("request", f"start{i}", data)


if __name__ == "__main__":
    main()
