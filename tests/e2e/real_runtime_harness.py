"""Helpers for the runtime pod on a real node (tests/e2e/test_real_node_runtime.py).

What they do on this host, and nothing else: import the runtime image into the real node's
containerd, generate the tiny model into a directory they create, install the chart, read pods,
find a container's main process through containerd, probe ports from busybox pods, and make a
throwaway CA and serving certificate. Traffic goes only to pod addresses of this cluster.
Every wait is bounded (``RealCluster.wait_for``).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import pathlib
import shutil
import subprocess
import tempfile
import time

from zerolayer.cluster import images

from tests.conftest import REPO
from tests.e2e.real_node_harness import REAL_NODE, RealCluster

CHART = REPO / "helm" / "zerolayer"
API = "zerolayer.io/v1alpha1"


# ------------------------------------------------------------------ image
def import_runtime_image(cluster: RealCluster, log=print) -> str:
    """Build (or find cached) the ``cpu`` runtime image and import it into the real node's
    containerd once per cluster; returns its tag. A marker named after the archive (its name
    carries the sources' hash) in the cluster's state directory makes a second call free, and a
    source edit between two calls imports the new image."""
    from zerolayer.cluster.image import ensure_image

    started = time.monotonic()
    img = ensure_image(log=log)
    marker = cluster.local.dir / f"imported-{pathlib.Path(img.archive).name}"
    if not marker.exists():
        cluster.local.import_image(img.archive)
        marker.write_text(img.tag)
        log(f"[runtime-image] imported {img.tag} in {time.monotonic() - started:.0f}s")
    return img.tag


def images_on_node(cluster: RealCluster) -> str:
    [node] = cluster.local.real_nodes()
    return subprocess.run(["ctr", "--address", str(node.socket), "-n", images.CRI_NAMESPACE, "images", "ls", "-q"],
                          stdout=subprocess.PIPE, text=True, check=True).stdout


# ------------------------------------------------------------------ model
def tiny_model(parent: pathlib.Path, name: str = "tiny", seed: int = 0, init_std: float = 0.02) -> pathlib.Path:
    """The generated tiny Llama model in ``parent/<name>`` (``seed``, ``init_std``: its random weights,
    see :func:`zerolayer.runtime.node.tinymodel.generate`), world-readable (the server runs as uid 65532;
    a hostPath volume keeps the host's modes)."""
    out = parent / name
    subprocess.run(["python3", "-c", "import sys; from zerolayer.runtime.node import tinymodel; "
                    "tinymodel.generate(sys.argv[1], seed=int(sys.argv[2]), init_std=float(sys.argv[3]))",
                    str(out), str(seed), str(init_std)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
    _readable(parent, out)
    return out


def tiny_adapter(parent: pathlib.Path, base: pathlib.Path, name: str) -> pathlib.Path:
    """A LoRA adapter (random A/B, PEFT layout) for the tiny model ``base``, in ``parent/<name>``."""
    out = parent / name
    subprocess.run(["python3", "-c", "import sys; from zerolayer.runtime.node import tinymodel; "
                    "tinymodel.generate_lora(sys.argv[1], sys.argv[2])", str(base), str(out)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
    _readable(parent, out)
    return out


def _readable(parent: pathlib.Path, out: pathlib.Path) -> None:
    for path in [parent, out, *out.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def model_dir() -> pathlib.Path:
    """A fresh directory for the model, outside every 0700 temp directory."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="zl-real-model-"))
    d.chmod(0o755)
    return d


# ------------------------------------------------------------------ pods
def ready(pod: dict) -> bool:
    conds = {c["type"]: c["status"] for c in (pod.get("status") or {}).get("conditions") or ()}
    return conds.get("Ready") == "True" and not pod["metadata"].get("deletionTimestamp")


def container_statuses(pod: dict) -> dict[str, dict]:
    return {s["name"]: s for s in (pod.get("status") or {}).get("containerStatuses") or ()}


def pods(cluster: RealCluster, namespace: str, selector: str) -> list[dict]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json", check=False)
    return json.loads(out.stdout)["items"] if out.returncode == 0 else []


def container_pid(cluster: RealCluster, container_id: str) -> int:
    """Host PID of a container's main process, from the node's containerd (``containerd://<id>``)."""
    [node] = cluster.local.real_nodes()
    cid = container_id.split("://", 1)[-1]
    out = subprocess.run(["ctr", "--address", str(node.socket), "-n", images.CRI_NAMESPACE, "tasks", "ls"],
                         stdout=subprocess.PIPE, text=True, check=True).stdout
    for line in out.splitlines()[1:]:
        parts = line.split()
        if parts and parts[0] == cid:
            return int(parts[1])
    raise AssertionError(f"container {cid} has no task in {REAL_NODE}'s containerd:\n{out}")


# ------------------------------------------------------------------ reachability
def probe_command(ip: str, port: int, path: str) -> str:
    """A shell line that prints the first line of an HTTP/1.0 answer from ``ip:port``, or nothing."""
    return (f"printf 'GET {path} HTTP/1.0\\r\\nHost: {ip}\\r\\n\\r\\n' | nc -w 2 {ip} {port} | head -n 1")


def reaches(cluster: RealCluster, namespace: str, client: str, ip: str, port: int, path: str) -> bool:
    """Whether the busybox ``client`` gets an HTTP answer (any status) from ``ip:port``: a refused
    or dropped connection gives none."""
    out = cluster.exec(namespace, client, "timeout", "5", "sh", "-c", probe_command(ip, port, path), timeout=20)
    return out.stdout.startswith("HTTP/1.")


# ------------------------------------------------------------------ TLS
def make_tls(node_pod_cidr: str, dns_names: list[str]) -> tuple[bytes, bytes, bytes]:
    """(CA certificate, serving certificate, serving key) in PEM. The serving certificate names
    ``dns_names`` and every address of the node's pod CIDR: a DaemonSet pod's address changes at
    every roll, and the pod must already hold the certificate when it starts."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "zerolayer e2e CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False),
                         critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    hosts = list(ipaddress.ip_network(node_pod_cidr).hosts())
    sans = [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(ip) for ip in hosts]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return (ca.public_bytes(pem), cert.public_bytes(pem),
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


# ------------------------------------------------------------------ host paths
AUDIT_HOST_DIR = pathlib.Path("/var/lib/zerolayer/audit")  # the auditor's hostPath (operator/manifests.py AUDIT_DB)
ADAPTERS_HOST_DIR = pathlib.Path("/var/lib/zerolayer/adapters")  # zerolayer.models.ADAPTERS_HOST_DIR


def remove_if_created(path: pathlib.Path, existed: bool) -> None:
    """Remove a host directory the pods created (hostPath DirectoryOrCreate), and its empty parent."""
    if existed:
        return
    shutil.rmtree(path, ignore_errors=True)
    try:
        os.rmdir(path.parent)
    except OSError:
        pass
