"""Issue 17, operator side: tenants' API keys never leave their Secret, and the keys' SHA-256
hashes appear only in the one Secret of hashes the operator publishes (``zl-tenant-keys``,
docs/security.md finding 5).

The real operator (at ``--log-level debug``, its most talkative) reconciles a TenantQuota whose
key Secret holds two unique marker keys, and an InferenceNode on a kwok node, until both are Ready.
Then everything the run wrote is searched for the keys, in clear, base64 (any alignment) and
as their SHA-256 (hex, in clear or base64, and raw digest in base64): the operator's whole log
and its metrics, and every object of every listable kind in the cluster (Events, InferenceNodes,
TenantQuotas with status, Nodes, and all the operator's children: DaemonSets, Pods,
NetworkPolicies, Services, ServiceAccounts, Roles, ClusterRoles, ConfigMaps, other Secrets...).
The same sweep runs again after the operator has failed on the Secret three ways (an entry that
does not exist while the markers sit in another entry, a Secret that does not exist, an entry
that is not UTF-8 and holds a marker), each with the condition it must set.

A runtime-side grep is tests/integration/runtime/test_no_secrets_in_output.py.
"""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import uuid

import pytest

from tests.e2e.operator_harness import E2E_LABEL, Objects, OperatorProcess, free_port, new_run_id

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

HASHES_SECRET = "zl-tenant-keys"


# ---------------------------------------------------------------------------- what a leak looks like
def b64_forms(needle: bytes) -> set[str]:
    """The base64 text that ``needle`` always becomes inside any longer base64 string, one per
    alignment (0, 1 or 2 bytes before it): the characters that depend on its bytes only."""
    forms = set()
    for pad in range(3):
        encoded = base64.b64encode(b"\0" * pad + needle).decode()
        start = -(-8 * pad // 6)  # first character with no bit of the prefix
        end = 8 * (pad + len(needle)) // 6  # past the last character made only of needle bits
        forms.add(encoded[start:end])
    return forms


def key_forms(key: str) -> dict[str, set[str]]:
    """``{"key": ..., "hash": ...}``: the strings whose presence shows the key, or its hash, leaked."""
    digest = hashlib.sha256(key.encode())
    return {"key": {key} | b64_forms(key.encode()),
            "hash": {digest.hexdigest()} | b64_forms(digest.hexdigest().encode()) | b64_forms(digest.digest())}


def leaks(text: str, keys: list[str]) -> list[str]:
    """``"<key> <kind> as <form>"`` for every form of every key found in ``text``."""
    found = []
    for key in keys:
        for kind, forms in key_forms(key).items():
            found += [f"{key} {kind} as {form!r}" for form in sorted(forms) if form in text]
    return found


def test_the_leak_finder_sees_every_form():
    """The sweep below can fail: a key in clear, base64 at every offset and its hash are all found."""
    key = f"sk-zl-marker-{uuid.uuid4().hex}"
    digest = hashlib.sha256(key.encode())
    for prefix in ("", "a", "ab", "abc"):
        assert leaks(base64.b64encode(f"{prefix}{key}\n".encode()).decode(), [key]), prefix
        assert any("hash" in f for f in leaks(base64.b64encode(
            json.dumps({"hashes": [digest.hexdigest()]}).encode()).decode(), [key]))
        assert any("hash" in f for f in leaks(base64.b64encode(prefix.encode() + digest.digest()).decode(), [key]))
    assert leaks(f'"message": "bad key {key}"', [key]) and leaks(f"h={digest.hexdigest()}", [key])
    assert leaks(f"sk-zl-marker-{uuid.uuid4().hex}", [key]) == []


# ---------------------------------------------------------------------------- the run
class DebugOperator(OperatorProcess):
    """The harness's operator (same flags and environment), at ``--log-level debug``: kopf's
    and ours, the most it ever logs."""

    def start(self) -> None:
        self.health_port, self.metrics_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "zerolayer.cli", "operator", "--kubeconfig", self.kubeconfig,
               "--runtime-namespace", self.namespace, "--selector", f"{E2E_LABEL}={self.run_id}",
               "--resync-seconds", str(self.resync), "--health-port", str(self.health_port),
               "--metrics-port", str(self.metrics_port), "--log-level", "debug"]
        env = dict(self.cluster.env(), ZEROLAYER_RUNTIME_RESOURCES='{"requests": {"cpu": "100m", "memory": "128Mi"}}')
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.starts += 1


@pytest.fixture(scope="module")
def env(cluster, tmp_path_factory):
    run = new_run_id()
    namespace, tenant_ns = f"zl-e2e-nosec-{run}", f"zl-e2e-tenant-{run}"
    for ns in (namespace, tenant_ns):
        cluster.kubectl("create", "namespace", ns)
    objects = Objects(cluster, namespace, run)
    operator = DebugOperator(cluster, namespace, run, tmp_path_factory.mktemp("operator"))
    operator.start()
    try:
        yield objects, operator, tenant_ns
    finally:
        objects.delete_all(operator)
        operator.stop()
        cluster.kubectl("delete", "namespace", tenant_ns, "--wait=false", check=False)


def listable_kinds(cluster) -> list[str]:
    out = cluster.kubectl("api-resources", "--verbs=list", "-o", "name").stdout.split()
    return sorted(k for k in out if k)


def everything(cluster) -> list[dict]:
    """Every object of every listable kind, in every namespace (Events included)."""
    kinds = listable_kinds(cluster)
    return json.loads(cluster.kubectl("get", ",".join(kinds), "-A", "-o", "json", timeout=180).stdout)["items"]


def secret_text(secret: dict) -> str:
    """A Secret as JSON, with its data entries decoded too (so a copied key shows in clear)."""
    decoded = {k: base64.b64decode(v).decode("utf-8", "replace") for k, v in (secret.get("data") or {}).items()}
    return json.dumps(secret) + json.dumps(decoded)


def sweep(cluster, operator, keys: list[str], homes: set[tuple[str, str]]) -> dict:
    """Search the operator's log and metrics and every object in the cluster for ``keys``.

    Returns the counts searched, and ``published_hash_hits``: the forms of the hashes the same
    search found in ``zl-tenant-keys`` (so it is seen to find them where they are). Fails naming each place a key or a hash was found, except the
    tenants' own Secrets (``homes``: namespace, name), where the keys belong, and the hashes in
    ``zl-tenant-keys`` of the operator's runtime namespace, where they are published by design.
    """
    found: list[str] = []
    log = operator.log()
    metrics = operator.get(operator.metrics_port, "/metrics") or ""
    found += [f"operator log: {f}" for f in leaks(log, keys)]
    found += [f"operator metrics: {f}" for f in leaks(metrics, keys)]
    items = everything(cluster)
    kinds: dict[str, int] = {}
    published_hits = 0
    for obj in items:
        kind, meta = obj.get("kind", "?"), obj.get("metadata") or {}
        kinds[kind] = kinds.get(kind, 0) + 1
        where = (meta.get("namespace"), meta.get("name"))
        text = secret_text(obj) if kind == "Secret" else json.dumps(obj)
        hits = leaks(text, keys)
        if kind == "Secret" and where in homes:
            continue  # the keys' home
        if kind == "Secret" and where == (operator.namespace, HASHES_SECRET):
            published_hits = sum(" hash as " in h for h in hits)
            hits = [h for h in hits if " hash as " not in h]  # hashes published by design; keys never
        found += [f"{kind} {'/'.join(filter(None, where))}: {h}" for h in hits]
    assert found == [], "\n".join(found)
    assert kinds.get("Event", 0) > 0 and log.strip(), "nothing to search: the sweep would prove nothing"
    return {"objects": len(items), "kinds": kinds, "log_bytes": len(log), "metrics_bytes": len(metrics),
            "published_hash_hits": published_hits}


def published(objects) -> dict:
    secret = objects.get("secret", HASHES_SECRET, objects.namespace) or {}
    return {k: json.loads(base64.b64decode(v)) for k, v in (secret.get("data") or {}).items()}


def wait_condition(cluster, objects, kind, name, type_, status="True", reason=None, timeout=90):
    def check():
        obj = objects.get(kind, name)
        c = objects.condition(obj, type_)
        return obj if c.get("status") == status and (reason is None or c.get("reason") == reason) else None
    return cluster.wait_for(check, timeout=timeout, what=f"{kind}/{name} {type_}={status} {reason or ''}")


def create(cluster, doc: dict) -> None:
    """``kubectl create`` (not apply: no last-applied annotation copying a Secret's stringData)."""
    cluster.kubectl("create", "-f", "-", input=json.dumps(doc))


def test_keys_and_hashes_stay_where_they_belong(cluster, env, capsys):
    objects, operator, tenant_ns = env
    run = objects.run_id
    keys = [f"sk-zl-marker-{uuid.uuid4().hex}", f"sk-zl-marker-{uuid.uuid4().hex}"]
    secret, tq = f"keys-{run}", f"nosec-{run}"
    create(cluster, {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                     # in a tenant namespace, so it opts in to being read for this tenant (docs/security.md, 37)
                     "metadata": {"name": secret, "namespace": tenant_ns, "labels": {"zerolayer.io/tenant-keys": tq}},
                     "data": {"api-keys": base64.b64encode(f"{keys[0]}\n{keys[1]}\n".encode()).decode()}})
    quota = objects.tenant_quota(tq, secret, namespaces=(tenant_ns,))
    quota["spec"]["apiKeySecretRef"]["namespace"] = tenant_ns
    [node] = objects.add_nodes(1)
    inode = f"{node}-inode"
    create(cluster, quota)
    create(cluster, objects.inference_node(inode, node))

    obj = wait_condition(cluster, objects, "tenantquota", tq, "Ready")
    assert obj["status"]["keyCount"] == 2
    wait_condition(cluster, objects, "inferencenode", inode, "RuntimeReady")
    objects.heartbeat(inode)
    wait_condition(cluster, objects, "inferencenode", inode, "Ready")
    # The hashes are where the runtimes read them, and nowhere else (sweep).
    assert published(objects)[tq]["hashes"] == sorted(hashlib.sha256(k.encode()).hexdigest() for k in keys)
    ready = sweep(cluster, operator, keys, {(tenant_ns, secret)})
    assert ready["published_hash_hits"] >= len(keys)  # the search does find them where they are

    # Fail on the Secret, three ways; the markers are still in the cluster each time.
    failures = []
    other = f"other-{run}"
    create(cluster, {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                     "metadata": {"name": other, "namespace": tenant_ns, "labels": {"zerolayer.io/tenant-keys": tq}},
                     "data": {"api-keys": base64.b64encode(b"\xff\xfe" + keys[0].encode() + b"\n").decode()}})
    for reason, ref in (("KeyMissing", {"name": secret, "key": "no-such-entry"}),
                        ("SecretMissing", {"name": f"missing-{run}"}),
                        ("NoKeys", {"name": other})):
        cluster.kubectl("patch", "tenantquota", tq, "--type=merge",
                        "-p", json.dumps({"spec": {"apiKeySecretRef": {"key": "api-keys", **ref}}}))
        obj = wait_condition(cluster, objects, "tenantquota", tq, "SecretFound", "False", reason)
        assert objects.condition(obj, "Ready")["reason"] == reason
        assert obj["status"]["phase"] == "Pending" and obj["status"]["keyCount"] == 0
        assert tq not in published(objects)  # withdrawn: its hashes are nowhere now
        failures.append(f"{reason}: {objects.condition(obj, 'SecretFound')['message']}")
        # 'other' holds a marker too: a second tenant Secret, which the operator reads for NoKeys
        found = sweep(cluster, operator, keys, {(tenant_ns, secret), (tenant_ns, other)})
        assert found["published_hash_hits"] == 0
    assert leaks(json.dumps(objects.get("secret", other, tenant_ns)), keys[:1])  # the marker is really there
    warnings = [e["reason"] for e in objects.events("TenantQuota", tq) if e["type"] == "Warning"]
    with capsys.disabled():
        print(f"\n[no-secrets] ready sweep: {ready}\n[no-secrets] failure sweep: {found}\n"
              f"[no-secrets] conditions: {failures}\n[no-secrets] warning events on the quota: {warnings}",
              file=sys.stderr)
