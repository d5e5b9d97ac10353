"""Pinned versions of the local control plane (one place; the cache key derives from them)."""

KUBERNETES = "v1.35.4"  # kube-apiserver, controller-manager, scheduler, kubectl
ETCD = "v3.6.16"  # go.etcd.io/etcd/server/v3 (Kubernetes 1.35 is tested against etcd 3.6)
KWOK = "v0.8.0"  # fake nodes whose pods become Running
HELM = "v3.19.5"
H2SPEC = "v2.2.1+incompatible"  # conformance suite for the runtime's HTTP/2 server
KUBE_ROUTER = "v2.1.0"  # NetworkPolicy enforcer on real nodes (the only v2 version the Go proxy serves)
# Jaeger v2 (cmd/jaeger: an OTLP receiver with in-memory storage and a query API), the real trace
# receiver of the tracing tests. The Go module carries the v1.x tags (v1.76.0 is the v2.13.0 release).
JAEGER = "v1.76.0"
GO_DIRECTIVE = "1.25.0"

BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
    "helm",
    "h2spec",
)

# Real nodes (``cluster up --real-nodes N``): built into their own cache directory so the kwok-only
# path never waits for them. kubelet and kube-proxy share the control plane's Kubernetes version.
NODE_BINARIES = (
    "kubelet",
    "kube-proxy",
    "kube-router",
)

NODE_STAMP = f"k8s{KUBERNETES}-kube-router{KUBE_ROUTER}"

JAEGER_STAMP = f"jaeger{JAEGER}"

STAMP = f"k8s{KUBERNETES}-etcd{ETCD}-kwok{KWOK}-helm{HELM}-h2spec{H2SPEC.split('+')[0]}"


def ldflags(binary: str) -> str:
    """Version stamps so `kubectl version` and `helm version` report the pinned releases."""
    if binary in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kubelet", "kube-proxy"):
        major, minor = KUBERNETES.removeprefix("v").split(".")[:2]
        flags = []
        for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
            flags += [
                f"-X {pkg}.gitVersion={KUBERNETES}",
                f"-X {pkg}.gitMajor={major}",
                f"-X {pkg}.gitMinor={minor}",
                f"-X {pkg}.gitTreeState=clean",
            ]
        return " ".join(flags)
    if binary == "helm":
        return f"-X helm.sh/helm/v3/internal/version.version={HELM}"
    if binary == "kube-router":
        return f"-X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version={KUBE_ROUTER}"
    if binary == "kwok":
        return f"-X sigs.k8s.io/kwok/pkg/consts.Version={KWOK.removeprefix('v')}"
    return ""
