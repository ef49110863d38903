#!/usr/bin/env bash
# The entry point of a GPU bundle made by scripts/gpu-bundle.sh (installed as DIR/run.sh). The
# bundle's programs travel xz-compressed in payload.tar.xz, because a device call carries the
# checkout as well and the programs are 6x smaller packed; this script unpacks them into a
# temporary folder, links the trained fixtures in and runs the unpacked run.sh with the same
# arguments:
#
#   run.sh RESULTS_DIR              device tests, whole models GPU vs CPU, timings; at most ~8 minutes
#   run.sh --dry-run RESULTS_DIR    on any machine: every binary starts and links, fixtures found
#   run.sh --unpack DIR             unpacks into DIR (kept) and stops, to run one binary by hand
#
# Fixtures: the bundle's own when it was built with --standalone; otherwise RECSYS_FIXTURES, or
# the tests/fixtures of the checkout the bundle sits in (DIR = <checkout>/build/gpu-bundle).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)

fixtures_dir() {
  local candidate
  for candidate in "${RECSYS_FIXTURES:-}" "$here/../../tests/fixtures"; do
    if [[ -n "$candidate" && -f "$candidate/test_set.tsv" ]]; then
      (cd "$candidate" && pwd)
      return 0
    fi
  done
  return 1
}

unpack() { # unpack DIR
  local into=$1
  mkdir -p "$into" || return 1
  # Through Python's lzma (which decodes the x86 filter), so the machine needs no xz.
  if ! python3 - "$here/payload.tar.xz" "$into" <<'PY'; then
import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as archive:
    if hasattr(tarfile, "data_filter"):
        archive.extractall(sys.argv[2], filter="data")
    else:
        archive.extractall(sys.argv[2])
PY
    echo "error: cannot unpack $here/payload.tar.xz into $into" >&2
    return 1
  fi
  cp "$here/BUILD" "$into/BUILD"
  [[ -d "$into/fixtures" ]] && return 0 # a --standalone bundle carries its own
  local fixtures
  if ! fixtures=$(fixtures_dir); then
    echo "error: no trained fixtures: the bundle was built without --standalone and neither" \
      "RECSYS_FIXTURES nor $here/../../tests/fixtures holds test_set.tsv" >&2
    return 1
  fi
  ln -sfn "$fixtures" "$into/fixtures"
}

if [[ "${1:-}" == "--unpack" ]]; then
  [[ $# -eq 2 ]] || { echo "usage: run.sh --unpack DIR" >&2; exit 2; }
  unpack "$2" || exit 1
  echo "unpacked into $2 (fixtures: $(readlink "$2/fixtures"))"
  exit 0
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/recsys-gpu-bundle.XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
unpack "$work" || exit 1
"$work/run.sh" "$@"
