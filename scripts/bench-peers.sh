#!/usr/bin/env bash
# recsys against the Python backend + onnxruntime peer, and the dynamic-batching study.
exec "$(dirname "$0")/bench-serving.sh" --peers "$@"
