#!/usr/bin/env bash
# Builds recsys in release mode, converts the demo checkpoints into the Triton model repository
# (model_repository/<model>/1), and scores the example users offline with `recsys predict`.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "==> building (release)"
cargo build --release --locked -p recsys-converter
RECSYS=target/release/recsys

echo "==> converting the demo checkpoints into model_repository/"
"$RECSYS" convert --force --kind bert4rec \
  --checkpoint tests/fixtures/bert4rec/model.pt --config tests/fixtures/bert4rec/config.json \
  --item-map tests/fixtures/bert4rec/item_id_map.tsv --output model_repository/bert4rec/1
"$RECSYS" convert --force --kind vaecf \
  --checkpoint tests/fixtures/multivae/model.safetensors --config tests/fixtures/multivae/config.json \
  --item-map tests/fixtures/multivae/item_id_map.tsv --output model_repository/vaecf/1
# SASRec and GRU4Rec from RecBole's own checkpoints: the kind and hyper-parameters are the
# checkpoint's (read as data; nothing in it is executed).
for model in sasrec gru4rec; do
  "$RECSYS" convert --force --checkpoint "tests/fixtures/$model/recbole_checkpoint.pth" \
    --item-map "tests/fixtures/$model/item_id_map.tsv" --output "model_repository/$model/1"
done

for model in bert4rec vaecf sasrec gru4rec; do
  echo "==> recsys predict --engine model_repository/$model/1 --input examples/users.jsonl --k 5"
  "$RECSYS" predict --engine "model_repository/$model/1" --input examples/users.jsonl --output - --k 5
done
