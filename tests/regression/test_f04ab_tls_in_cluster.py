"""Review finding 4 (a, b): with ``tlsSecretName`` the operator mounted the certificate and switched
the probes to HTTPS, but the in-cluster runtime kept serving h2c, so the pod could never become
Ready and TLS could not be turned on in a cluster at all. The runtime now serves TLS (ALPN h2 and
http/1.1) from the mounted Secret; the live HTTPS probe and ALPN check is
tests/integration/runtime/test_incluster_tls.py."""

from __future__ import annotations

import pytest

from zerolayer.runtime.node.incluster import config_from_inferencenode

pytestmark = [pytest.mark.regression]


def test_tls_secret_name_turns_tls_on_in_the_runtime_config():
    node = {"metadata": {"name": "gpu-node-0"},
            "spec": {"nodeName": "gpu-node-0", "models": [{"name": "synthetic", "source": "/m"}],
                     "runtime": {"engine": "synthetic", "tlsSecretName": "serving-cert"}}}
    tls = config_from_inferencenode(node).get("tls")
    assert tls and tls["cert"].endswith("tls.crt") and tls["key"].endswith("tls.key")
