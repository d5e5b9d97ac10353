#!/usr/bin/env bash
# zerolayer on one fresh machine, no Docker: a real local Kubernetes control plane with fake GPU
# nodes, the Helm chart, tenants and InferenceNodes; then the operator and one runtime per node as
# local processes (kwok's pods are records, not processes), until every InferenceNode is Ready and
# gossips its GPU map; then a request straight to a node over HTTP/2. Ctrl-C or the end of the
# script stops the local processes; the cluster stays up until `zerolayer cluster down`.
# The first run builds the control plane from Go modules into ~/.cache/zerolayer (~9 min on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install -q --root-user-action=ignore -e .
zerolayer cluster up --nodes 3
eval "$(zerolayer cluster env)"   # KUBECONFIG plus the matching kubectl and helm on PATH
NS=zerolayer-system            # the chart's release: the operator's namespace
RUNTIME_NS=zerolayer-system-runtime   # the chart's runtime namespace (<release namespace>-runtime)

helm upgrade --install zerolayer helm/zerolayer -n "$NS" --create-namespace --wait --timeout 180s
kubectl apply -f examples/tenantquota.yaml -f examples/quickstart/fleet.yaml

logs=.state/quickstart; mkdir -p "$logs"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

# What the operator Deployment and the runtime DaemonSet pods would run on a real cluster:
zerolayer operator --kubeconfig "$KUBECONFIG" --runtime-namespace "$RUNTIME_NS" --operator-namespace "$NS" \
    --health-port 0 --metrics-port 0 \
    --log-level warning >"$logs/operator.log" 2>&1 & pids+=($!)
for node in gpu-node-0 gpu-node-1; do
    zerolayer runtime --node-name "$node" --kubeconfig "$KUBECONFIG" --tenant-namespace "$RUNTIME_NS" \
        --tenant-sync-seconds 2 --in-cluster --config "examples/quickstart/runtime-$node.yaml" --log-level WARNING >"$logs/runtime-$node.log" 2>&1 & pids+=($!)
done

echo "waiting for the InferenceNodes to be Ready (operator reconciles, runtimes gossip)..."
kubectl wait --for=condition=Ready inferencenode/gpu-node-0 inferencenode/gpu-node-1 --timeout=120s
kubectl wait --for=condition=Ready tenantquota --all --timeout=60s
# Ready means the operator published the tenant's key hashes (Secret zl-tenant-keys); each runtime
# picks them up at its next tenant sync (every 2 s here): until then it answers 401, hence the wait
# below. A node's first request for a tenant is admitted at once under a small credit while the node
# claims its share of the tenant's fleet-wide limit (docs/fleet-scale.md), so no retry is needed.
ask() {
    curl -sS --http2-prior-knowledge "http://127.0.0.1:$1/v1/messages" \
        -H 'x-api-key: zl-team-a-example-key-1' -H 'x-zerolayer-priority: high' \
        -d '{"model":"tiny-llama","max_tokens":8,"messages":[{"role":"user","content":"hello"}]}' "${@:2}"
}
for port in 18080 18081; do
    for _ in $(seq 30); do
        [ "$(ask "$port" -o /dev/null -w '%{http_code}')" = 200 ] && break
        sleep 1
    done
done
for p in "${pids[@]}"; do
    kill -0 "$p" 2>/dev/null || { echo "a local process exited; see $logs/*.log" >&2; tail -n 5 "$logs"/*.log >&2; exit 1; }
done

echo; echo "== GPU nodes (fake, kwok-managed, labelled like NVIDIA GPU feature discovery)"
kubectl get nodes -L nvidia.com/gpu.product,nvidia.com/gpu.count,zerolayer.io/inference-node
echo; echo "== zerolayer resources"
kubectl get zerolayer
echo; echo "== what the operator created"
kubectl get daemonsets,services,networkpolicies -n "$RUNTIME_NS"
echo; echo "== the GPU map, as runtimes gossip it through InferenceNode status"
zerolayer map --once
echo; echo "== a request straight to gpu-node-0 over HTTP/2 (tenant team-a)"
ask 18080 --fail-with-body -w '\n(HTTP/%{http_version} %{http_code})\n'
echo; echo; echo "== the story of a reconciliation"
kubectl get events -n default --field-selector involvedObject.kind=InferenceNode --sort-by=.lastTimestamp | tail -8
echo
echo "Explore:   eval \"\$(zerolayer cluster env)\"; kubectl explain inferencenode.spec"
echo "Clean up:  zerolayer cluster down"
