#!/usr/bin/env bash
# Writes a made-up item attribute table for a demo catalogue (TSV: item_id, category, region,
# age_rating), so the demo models can show attribute filters: categories of unequal size (the
# rarest, toys, holds under 2 % of the items), one or two regions per item (a list cell: EU|US), and an
# adult rating for one item in twenty. Deterministic: the same item id gets the same attributes.
#   scripts/demo-item-attributes.sh ITEM_MAP.tsv OUT.tsv
set -euo pipefail
map=${1:?usage: scripts/demo-item-attributes.sh ITEM_MAP.tsv OUT.tsv}
out=${2:?usage: scripts/demo-item-attributes.sh ITEM_MAP.tsv OUT.tsv}
awk -F '\t' '
  BEGIN {
    OFS = "\t"; print "item_id", "category", "region", "age_rating"
    split("books music games shoes hats bags coats toys", category, " ")
    split("EU US APAC", region, " ")
  }
  # The header line of an item map, if any, has a non-numeric first field.
  $1 !~ /^[0-9]+$/ { next }
  {
    h = 0
    for (i = 1; i <= length($2); i++) h = (h * 31 + index("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_", substr($2, i, 1))) % 1000003
    h = (h * 7919 + 104729) % 1000003
    c = int(sqrt(h % 64)) + 1              # 1 .. 8, the higher the commoner: toys (c = 1) are rare
    r = region[h % 3 + 1]
    if (int(h / 3) % 3 == 0) r = r "|" region[(h + 1) % 3 + 1]
    print $2, category[9 - c], r, (int(h / 9) % 20 == 0 ? "adult" : "all")
  }' "$map" > "$out"
