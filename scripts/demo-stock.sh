#!/usr/bin/env bash
# Writes a made-up stock feed for a demo catalogue (TSV: item_id, stock), the table a shop's stock
# job would publish as the model's live availability (`recsys availability publish`): about one
# item in ten is out of stock. ROUND picks which (the same round gives the same feed), so a demo
# can publish a changed feed.
#   scripts/demo-stock.sh ITEM_MAP.tsv OUT.tsv [ROUND]
set -euo pipefail
map=${1:?usage: scripts/demo-stock.sh ITEM_MAP.tsv OUT.tsv [ROUND]}
out=${2:?usage: scripts/demo-stock.sh ITEM_MAP.tsv OUT.tsv [ROUND]}
round=${3:-1}
awk -F '\t' -v round="$round" '
  BEGIN { OFS = "\t"; print "item_id", "stock" }
  # The header line of an item map, if any, has a non-numeric first field.
  $1 !~ /^[0-9]+$/ { next }
  {
    h = round * 7919
    for (i = 1; i <= length($2); i++) h = (h * 31 + index("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_", substr($2, i, 1))) % 1000003
    print $2, (h % 10 == 0 ? "out" : "in")
  }' "$map" > "$out"
