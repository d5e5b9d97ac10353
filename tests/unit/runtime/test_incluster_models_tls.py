"""In-cluster config: model container paths, TLS from tlsSecretName, and the agreement between
what the runtime must restart for and what rolls its pod (the operator's config hash)."""

from __future__ import annotations

import copy
import datetime
import pathlib
import ssl

import pytest

from zerolayer.operator import manifests, validation
from zerolayer.operator.config import OperatorConfig
from zerolayer.runtime.node import incluster
from zerolayer.runtime.config import build_server, parse_config
from zerolayer.runtime.errors import ConfigError
from zerolayer.runtime.node.incluster import RESTART_KEYS, config_from_inferencenode


def inode(models, **spec):
    return {"metadata": {"name": "gpu-node-0"}, "spec": {"nodeName": "gpu-node-0", "models": models, **spec}}


@pytest.mark.parametrize("source, path", [
    ({"hostPath": {"path": "/srv/tiny"}}, "/models/tiny"),
    ({"pvc": {"claimName": "w", "subPath": "a/b"}}, "/models/tiny"),
    ({"huggingFace": {"repo": "org/name"}}, "/models/tiny"),
    ({"path": "/opt/baked"}, "/opt/baked"),
    ("/opt/legacy", "/opt/legacy"),
])
def test_the_engine_loads_the_default_model_where_the_operator_mounts_it(source, path):
    config = config_from_inferencenode(inode([{"name": "tiny", "source": source, "default": True}]))
    assert config["engine"]["model_path"] == path and config["engine"]["served_name"] == "tiny"


def test_a_source_with_two_kinds_is_a_config_error():
    with pytest.raises(ConfigError, match="exactly one"):
        config_from_inferencenode(inode([{"name": "x", "source": {"path": "/a", "hostPath": {"path": "/b"}}}]))


def _self_signed(directory: pathlib.Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "zl-runtime")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    (directory / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))


def test_tls_secret_name_gives_tls_config_and_the_server_an_h2_ssl_context(tmp_path, monkeypatch):
    node = inode([{"name": "synthetic", "source": "/m"}], runtime={"engine": "synthetic", "tlsSecretName": "c"})
    mapping = config_from_inferencenode(node)
    assert mapping["tls"] == {"cert": "/etc/zerolayer/tls/tls.crt", "key": "/etc/zerolayer/tls/tls.key"}
    assert incluster.TLS_DIR == manifests.TLS_MOUNT  # the runtime reads where the operator mounts

    _self_signed(tmp_path)  # what the kubelet puts in the mounted Secret
    monkeypatch.setattr(incluster, "TLS_DIR", str(tmp_path))
    config = parse_config(config_from_inferencenode(node), tmp_path)
    assert config.tls_cert == str(tmp_path / "tls.crt")
    server = build_server(config)
    assert isinstance(server.ssl_context, ssl.SSLContext) and server.base_url.startswith("https://")

    plain = parse_config(config_from_inferencenode(inode([{"name": "synthetic", "source": "/m"}],
                                                          runtime={"engine": "synthetic"})), tmp_path)
    assert plain.tls_cert is None and build_server(plain).ssl_context is None  # h2c: cleartext


# --------------------------------------------------------------------------- the HTTP/2 core
@pytest.mark.parametrize("core", ["python", "native"])
def test_server_core_becomes_the_runtime_configs_server_core(core, monkeypatch):
    import sys
    import types

    from zerolayer.runtime import config as runtime_config

    # parse_config checks the compiled core imports; this test is about the mapping, not the build.
    monkeypatch.setitem(sys.modules, "zerolayer_h2core", sys.modules.get("zerolayer_h2core")
                        or types.ModuleType("zerolayer_h2core"))
    node = inode([{"name": "synthetic", "source": "/m"}], runtime={"engine": "synthetic", "serverCore": core})
    mapping = config_from_inferencenode(node)
    assert mapping["server"] == {"core": core}
    assert parse_config(mapping, pathlib.Path.cwd()).server_core == core
    assert runtime_config.SERVER_CORES == validation.SERVER_CORES  # the operator validates what the runtime takes


def test_without_server_core_the_base_configs_stays():
    node = inode([{"name": "synthetic", "source": "/m"}], runtime={"engine": "synthetic"})
    assert "server" not in config_from_inferencenode(node)
    assert config_from_inferencenode(node, {"server": {"core": "native"}})["server"] == {"core": "native"}


# --------------------------------------------------------------------------- restart vs roll
BASE = {"models": [{"name": "tiny", "source": {"hostPath": {"path": "/srv/tiny"}}}],
        "runtime": {"port": 8443}, "scheduler": {"memoryThreshold": 0.92, "resumeThreshold": 0.88}}
EDITS = {
    "model source": ("models", [{"name": "tiny", "source": {"pvc": {"claimName": "w"}}}]),
    "model added as default": ("models", BASE["models"] + [{"name": "b", "source": {"path": "/b"}, "default": True}]),
    "port": ("runtime", {"port": 9443}),
    "tls": ("runtime", {"port": 8443, "tlsSecretName": "cert"}),
    "engine": ("runtime", {"port": 8443, "engine": "synthetic"}),
    "kv cache": ("runtime", {"port": 8443, "kvCacheBytes": 1 << 28}),
    "drain": ("runtime", {"port": 8443, "drainSeconds": 5}),
    "server core": ("runtime", {"port": 8443, "serverCore": "native"}),
    "sampling": ("scheduler", {**BASE["scheduler"], "sampleIntervalMs": 50}),
    "shedding marks (live)": ("scheduler", {"memoryThreshold": 0.8, "resumeThreshold": 0.7}),
    "gossip (live)": ("gossip", {"heartbeatSeconds": 2}),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_the_pod_rolls_exactly_when_the_runtime_would_need_a_restart(edit):
    key, value = EDITS[edit]
    before, after = copy.deepcopy(BASE), {**copy.deepcopy(BASE), key: value}
    old, new = config_from_inferencenode(inode(**before)), config_from_inferencenode(inode(**after))
    needs_restart = any(old.get(k) != new.get(k) for k in RESTART_KEYS)
    # A new source at the same container path needs no new engine settings, but a new volume.
    needs_restart = needs_restart or before["models"] != after["models"]
    rolls = manifests.runtime_config_hash(before) != manifests.runtime_config_hash(after)
    assert rolls == needs_restart, edit


def test_the_hash_sits_on_the_pod_template():
    body = {"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode",
            "metadata": {"name": "gpu-node-0", "uid": "u"}, "spec": {"nodeName": "gpu-node-0", **BASE}}
    ds = manifests.build_daemonset(body, OperatorConfig(runtime_namespace="zl"))
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations[manifests.CONFIG_HASH_ANNOTATION] == manifests.runtime_config_hash(body["spec"])
