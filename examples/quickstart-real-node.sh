#!/usr/bin/env bash
# zerolayer on one real node of this machine, no Docker, no registry (root): a local control plane with
# one real kubelet + containerd node (kube-proxy for Services, kube-router enforcing NetworkPolicies);
# the runtime image built locally and imported into the node; `helm install` (the operator runs as a
# pod); a tenant and an InferenceNode whose model comes from a hostPath; then the operator's runtime
# pod (server with the real vLLM engine on the CPU, defragd, auditor) serving a request over HTTP/2
# at its pod IP. The first run builds the runtime image (~10 min) and the node binaries; later runs
# reuse them. The cluster stays up until `zerolayer cluster down`. What it shows is tested by
# tests/e2e/test_real_node_runtime.py (docs/real-nodes.md).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "real nodes need root (kubelet, containerd, iptables)" >&2; exit 1; }

python3 -m pip install -q --root-user-action=ignore -e .
# Real nodes join a local cluster only when its control plane starts. A running one without a real node
# (what examples/quickstart.sh leaves up; it holds only what that script put there) is taken down first.
if zerolayer cluster status -o json | python3 -c 'import json, sys; s = json.load(sys.stdin)
sys.exit(0 if s["running"] and not s.get("real_nodes") else 1)'; then
  echo "a local cluster without a real node is running (the kwok quick start's): taking it down to start one with a real node"
  zerolayer cluster down
fi
zerolayer cluster up --nodes 0 --real-nodes 1
eval "$(zerolayer cluster env)"   # KUBECONFIG plus the matching kubectl and helm on PATH
NS=zerolayer-system RUNTIME_NS=zerolayer-system-runtime NODE=real-node-0

read -r TAG ARCHIVE < <(bash hack/build-image.sh)          # built or cached
zerolayer cluster import-image "$ARCHIVE"                  # into the node's containerd (~2 min for 6 GB)

MODEL=/var/lib/zerolayer/quickstart-models/tiny-llama      # a directory on the node (this host)
[ -f "$MODEL/config.json" ] || python3 -m zerolayer.runtime.node.tinymodel "$MODEL"
chmod -R a+rX /var/lib/zerolayer/quickstart-models         # the server runs as uid 65532

# The runtime's egress policy names the API server's own address and port (Services are DNATed first).
API_IP=$(kubectl get endpointslices -n default -l kubernetes.io/service-name=kubernetes -o jsonpath='{.items[0].endpoints[0].addresses[0]}')
API_PORT=$(kubectl get endpointslices -n default -l kubernetes.io/service-name=kubernetes -o jsonpath='{.items[0].ports[0].port}')
helm upgrade --install zerolayer helm/zerolayer -n "$NS" --create-namespace --wait --timeout 300s \
    --set operator.image.repository="${TAG%:*}" --set operator.image.tag="${TAG##*:}" --set operator.image.pullPolicy=Never \
    --set runtime.image.repository="${TAG%:*}" --set runtime.image.tag="${TAG##*:}" --set runtime.image.pullPolicy=Never \
    --set runtime.resources.requests.cpu=200m --set runtime.resources.requests.memory=512Mi \
    --set runtime.resources.limits.memory=8Gi \
    --set "runtime.apiServerCIDRs={$API_IP/32}" --set "runtime.apiServerPorts={$API_PORT}"
kubectl create namespace team-a --dry-run=client -o yaml | kubectl apply -f -
kubectl apply -f examples/tenantquota.yaml
kubectl apply -f - <<YAML
apiVersion: zerolayer.io/v1alpha1
kind: InferenceNode
metadata:
  name: $NODE
spec:
  nodeName: $NODE
  models:
    - name: tiny-llama
      default: true
      source:
        hostPath: {path: $MODEL}
  runtime:
    engine: vllm
    gpus: 1               # the node advertises nvidia.com/gpu: 1
    kvCacheBytes: 268435456
    enforceEager: true    # CPU settings: the defaults target GPUs
    dtype: float32
    drainSeconds: 20
    resources:
      requests: {cpu: 200m, memory: 512Mi}
      limits: {memory: 8Gi}
YAML

echo "waiting for the runtime pod (server + defragd + auditor) and the InferenceNode to be Ready..."
kubectl wait --for=condition=Ready inferencenode/$NODE --timeout=300s
POD=$(kubectl get pods -n "$RUNTIME_NS" -l zerolayer.io/inference-node=$NODE -o jsonpath='{.items[0].metadata.name}')
POD_IP=$(kubectl get pod -n "$RUNTIME_NS" "$POD" -o jsonpath='{.status.podIP}')

echo; echo "== the real node and what runs on it"
kubectl get nodes -L nvidia.com/gpu.product,zerolayer.io/inference-node
kubectl get pods -A -o wide --field-selector spec.nodeName=$NODE
echo; echo "== zerolayer resources"
kubectl get zerolayer
echo; echo "== the server container's log"
kubectl logs -n "$RUNTIME_NS" "$POD" -c server --tail=3
echo; echo "== a request to the runtime pod at $POD_IP over HTTP/2 (tenant team-a, the real tiny vLLM; its weights are random, so its words are noise)"
curl -sS --fail-with-body --http2-prior-knowledge -w '\n(HTTP/%{http_version} %{http_code})\n' "http://$POD_IP:8443/v1/messages" \
    -H 'x-api-key: zl-team-a-example-key-1' \
    -d '{"model":"tiny-llama","max_tokens":8,"messages":[{"role":"user","content":"hello"}]}'
echo
echo "Explore:   eval \"\$(zerolayer cluster env)\"; kubectl describe inferencenode $NODE"
echo "Clean up:  zerolayer cluster down; rm -rf /var/lib/zerolayer/quickstart-models"
