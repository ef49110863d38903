#!/usr/bin/env bash
# Writes the demo catalogues' interaction log in RecBole's atomic .inter format (user_id:token,
# item_id:token) from the histories of tests/fixtures/test_set.tsv, the log `recsys convert
# --interactions` counts into the popularity list that answers visitors without history.
#   scripts/demo-interactions.sh OUT.inter
set -euo pipefail
out=${1:?usage: scripts/demo-interactions.sh OUT.inter}
cd "$(dirname "$0")/.."
awk -F '\t' 'BEGIN { OFS = "\t"; print "user_id:token", "item_id:token" }
  NR > 1 { n = split($3, items, " "); for (i = 1; i <= n; i++) print $1, items[i] }' \
  tests/fixtures/test_set.tsv > "$out"
