#!/usr/bin/env bash
# zerolayer on one fresh machine, no Docker: a real local Kubernetes control plane with fake GPU
# nodes, the Helm chart, and the example InferenceNodes and TenantQuotas, shown with kubectl.
# The first run builds the control plane from Go modules into ~/.cache/zerolayer (~9 min on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install -q -e .
zerolayer cluster up --nodes 3
eval "$(zerolayer cluster env)"   # KUBECONFIG plus the matching kubectl and helm on PATH

helm upgrade --install zerolayer helm/zerolayer -n zerolayer-system --create-namespace --wait --timeout 180s
kubectl apply -f examples/tenantquota.yaml -f examples/inferencenode.yaml

echo; echo "== GPU nodes (fake, kwok-managed, labelled like NVIDIA GPU feature discovery)"
kubectl get nodes -L nvidia.com/gpu.product,nvidia.com/gpu.count
echo; echo "== zerolayer resources"
kubectl get zerolayer
echo; echo "== operator"
kubectl get pods -n zerolayer-system
echo
echo "Explore:   eval \"\$(zerolayer cluster env)\"; kubectl explain inferencenode.spec"
echo "Clean up:  zerolayer cluster down"
