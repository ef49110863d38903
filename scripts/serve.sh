#!/usr/bin/env bash
# The main command: builds recsys (release), sets up the Python venv with the real Triton server and
# client, converts the demo checkpoints into model_repository/, installs libtriton_recsys.so, and
# serves the four demo models from tritonserver on 127.0.0.1 (HOST) until Ctrl-C (which stops everything).
#
#   scripts/serve.sh            serve in the foreground
#   scripts/serve.sh --check    start, run the printed examples once, stop (used by the tests)
#
# Ports: HTTP_PORT (8000), GRPC_PORT (8001), METRICS_PORT (8002); HOST (127.0.0.1) is the address
# tritonserver binds; PYTHON (python3) the interpreter for the venv (3.9..3.12); RECSYS_VENV (.venv).
set -euo pipefail
cd "$(dirname "$0")/.."

HOST=${HOST:-127.0.0.1}
VENV=${RECSYS_VENV:-.venv}
# Where this script and its examples reach the server: HOST itself, or loopback for a wildcard bind.
case "$HOST" in
  0.0.0.0 | "::" | "[::]") CLIENT_HOST=127.0.0.1 ;;
  *) CLIENT_HOST=$HOST ;;
esac
HTTP_PORT=${HTTP_PORT:-8000}
GRPC_PORT=${GRPC_PORT:-8001}
METRICS_PORT=${METRICS_PORT:-8002}
CHECK=false
[[ "${1:-}" == "--check" ]] && CHECK=true

./scripts/python-env.sh --serve
echo "==> building recsys (release)"
cargo build --release --locked -p recsys-cli -p recsys-backend
mkdir -p build/backends/recsys
cp target/release/libtriton_recsys.so build/backends/recsys/

./scripts/convert-demo-models.sh target/release/recsys

TRITONSERVER=$("$VENV/bin/python" -c 'import pytriton, pathlib; print(pathlib.Path(pytriton.__file__).parent / "tritonserver/bin/tritonserver")')
mkdir -p build
LOG=build/tritonserver.log
echo "==> starting tritonserver on $HOST (HTTP $HTTP_PORT, gRPC $GRPC_PORT, metrics $METRICS_PORT; log: $LOG)"
# A model that cannot load leaves the server up and not ready, its log naming the reason, rather
# than exiting (--exit-on-error=false with --strict-readiness): the next approve's reload, or a
# fixed repository and a reload, brings it back without a restart.
setsid "$TRITONSERVER" \
  --model-repository="$PWD/model_repository" --backend-directory="$PWD/build/backends" \
  --model-control-mode=explicit --load-model='*' --exit-on-error=false --strict-readiness=true \
  --http-address="$HOST" --grpc-address="$HOST" --metrics-address="$HOST" \
  --http-port="$HTTP_PORT" --grpc-port="$GRPC_PORT" --metrics-port="$METRICS_PORT" \
  --pinned-memory-pool-byte-size=0 --allow-gpu-metrics=false >"$LOG" 2>&1 &
SERVER=$!
stop() {
  if kill -0 "$SERVER" 2>/dev/null; then
    kill -TERM -- "-$SERVER" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$SERVER" 2>/dev/null || true
  fi
}
trap stop EXIT
trap 'exit 130' INT TERM

for _ in $(seq 600); do
  if curl -sf "http://$CLIENT_HOST:$HTTP_PORT/v2/health/ready" >/dev/null; then break; fi
  if ! kill -0 "$SERVER" 2>/dev/null; then echo "tritonserver exited; see $LOG" >&2; tail -20 "$LOG" >&2; exit 1; fi
  sleep 0.1
done
curl -sf "http://$CLIENT_HOST:$HTTP_PORT/v2/health/ready" >/dev/null || {
  echo "tritonserver not ready after 60 s (a model that cannot load; see $LOG):" >&2
  grep -iE "failed to load|error" "$LOG" | tail -5 >&2
  exit 1
}

CURL_EXAMPLE="curl -s -X POST http://$CLIENT_HOST:$HTTP_PORT/v2/models/bert4rec/infer -d '{\"inputs\": [{\"name\": \"ITEM_IDS\", \"datatype\": \"INT64\", \"shape\": [1, 3], \"data\": [10011403, 10011207, 10011739]}, {\"name\": \"K\", \"datatype\": \"INT32\", \"shape\": [1, 1], \"data\": [5]}]}'"
ENSEMBLE_EXAMPLE="curl -s -X POST http://$CLIENT_HOST:$HTTP_PORT/v2/models/retrieve_and_rank/infer -d '{\"inputs\": [{\"name\": \"ITEM_IDS\", \"datatype\": \"INT64\", \"shape\": [1, 3], \"data\": [10011403, 10011207, 10011739]}, {\"name\": \"K\", \"datatype\": \"INT32\", \"shape\": [1, 1], \"data\": [5]}]}'"
STOCK_EXAMPLE="curl -s -X POST http://$CLIENT_HOST:$HTTP_PORT/v2/models/vaecf/infer -d '{\"inputs\": [{\"name\": \"ITEM_IDS\", \"datatype\": \"INT64\", \"shape\": [1, 2], \"data\": [10011403, 10011207]}, {\"name\": \"EXCLUDE_ITEM_SETS\", \"datatype\": \"BYTES\", \"shape\": [1, 1], \"data\": [\"stock=out\"]}]}'"
PY_EXAMPLE="$VENV/bin/python examples/client.py --http $CLIENT_HOST:$HTTP_PORT --grpc $CLIENT_HOST:$GRPC_PORT"
cat <<MSG

recsys is serving bert4rec, vaecf, sasrec and gru4rec, and retrieve_and_rank (VAE-CF's 500 best
items ranked by BERT4Rec, one request). Try:

  $CURL_EXAMPLE

  $ENSEMBLE_EXAMPLE

  $STOCK_EXAMPLE

  $PY_EXAMPLE

The last curl leaves out what the live stock feed marks out of stock; publish another feed
(scripts/demo-stock.sh ... stock.tsv 2, then target/release/recsys availability publish
--repository model_repository --model vaecf stock.tsv) and the answers change within 10 s.

Metrics: curl -s http://$CLIENT_HOST:$METRICS_PORT/metrics | grep recsys_
MSG
echo
echo "--- curl example ---"
eval "$CURL_EXAMPLE"
echo
echo "--- retrieval and ranking in one call (the retrieve_and_rank ensemble) ---"
eval "$ENSEMBLE_EXAMPLE"
echo
echo "--- an out-of-stock feed (vaecf, live availability) ---"
eval "$STOCK_EXAMPLE" | tee build/stock-example.json
grep -q '"availability_version":[1-9]' build/stock-example.json || {
  echo "the stock example names no availability version; see $LOG" >&2
  exit 1
}
echo
echo "--- Python example ---"
$PY_EXAMPLE
if $CHECK; then
  echo "==> --check: examples answered; stopping"
  exit 0
fi
echo
echo "Serving until Ctrl-C."
wait "$SERVER"
