#!/usr/bin/env bash
# Converts the demo checkpoints into the Triton model repository (model_repository/<model>/1) with
# the recsys binary given as $1 (scripts/serve.sh and scripts/demo.sh build it first).
set -euo pipefail
cd "$(dirname "$0")/.."
RECSYS=${1:?usage: scripts/convert-demo-models.sh PATH/TO/recsys}

echo "==> converting the demo checkpoints into model_repository/"
# Made-up item attributes (category, region, age_rating) for each demo catalogue, so requests can
# filter by them (INCLUDE_ITEM_SETS / EXCLUDE_ITEM_SETS).
mkdir -p build/demo-attributes
for fixture in bert4rec multivae sasrec gru4rec; do
  scripts/demo-item-attributes.sh "tests/fixtures/$fixture/item_id_map.tsv" "build/demo-attributes/$fixture.tsv"
done
# The interaction log of the demo users, counted into each engine's popularity list: the answer to a
# visitor without history (empty_history_policy).
scripts/demo-interactions.sh build/demo-attributes/interactions.inter
popular=(--interactions build/demo-attributes/interactions.inter)
"$RECSYS" convert --force --kind bert4rec \
  --checkpoint tests/fixtures/bert4rec/model.pt --config tests/fixtures/bert4rec/config.json \
  --item-map tests/fixtures/bert4rec/item_id_map.tsv --item-attributes build/demo-attributes/bert4rec.tsv "${popular[@]}" \
  --output model_repository/bert4rec/1
"$RECSYS" convert --force --kind vaecf \
  --checkpoint tests/fixtures/multivae/model.safetensors --config tests/fixtures/multivae/config.json \
  --item-map tests/fixtures/multivae/item_id_map.tsv --item-attributes build/demo-attributes/multivae.tsv "${popular[@]}" \
  --output model_repository/vaecf/1
# SASRec and GRU4Rec from RecBole's own checkpoints: the kind and hyper-parameters are the
# checkpoint's (read as data; nothing in it is executed).
for model in sasrec gru4rec; do
  "$RECSYS" convert --force --checkpoint "tests/fixtures/$model/recbole_checkpoint.pth" \
    --item-map "tests/fixtures/$model/item_id_map.tsv" --item-attributes "build/demo-attributes/$model.tsv" "${popular[@]}" \
    --output "model_repository/$model/1"
done
# A made-up stock feed for VAE-CF, published as its live availability (its config names the object;
# the server polls it, so publishing another feed changes the answers without a reload).
scripts/demo-stock.sh tests/fixtures/multivae/item_id_map.tsv build/demo-attributes/stock.tsv
"$RECSYS" availability publish --repository model_repository --model vaecf build/demo-attributes/stock.tsv
# The retrieve_and_rank ensemble: its retrieval stage serves the VAE-CF engine under its own
# config (hard links, not a second copy), and the ensemble itself needs an empty version directory.
rm -rf model_repository/vaecf_candidates/1
cp -al model_repository/vaecf/1 model_repository/vaecf_candidates/1
mkdir -p model_repository/retrieve_and_rank/1
