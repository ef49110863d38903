#!/usr/bin/env bash
# Builds recsys in release mode, converts the demo checkpoints into the Triton model repository
# (model_repository/<model>/1), and scores the example users offline with `recsys predict`.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "==> building (release)"
cargo build --release --locked -p recsys-cli
RECSYS=target/release/recsys

./scripts/convert-demo-models.sh "$RECSYS"

for model in bert4rec vaecf sasrec gru4rec; do
  echo "==> recsys predict --engine model_repository/$model/1 --input examples/users.jsonl --k 5"
  "$RECSYS" predict --engine "model_repository/$model/1" --input examples/users.jsonl --output - --k 5
done
