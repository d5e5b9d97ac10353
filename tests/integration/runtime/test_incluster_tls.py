"""A runtime built from an InferenceNode with ``tlsSecretName`` serves what the kubelet's HTTPS
probes and clients need: TLS with ALPN h2 and http/1.1 on the configured port."""

from __future__ import annotations

import datetime
import ipaddress
import pathlib
import ssl

import pytest
from runtime_helpers import KEY, chat_body, tenants

from zerolayer.runtime.node import incluster
from zerolayer.runtime.config import build_server, parse_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60), pytest.mark.asyncio(loop_scope="session")]


def _write_tls_secret(directory: pathlib.Path) -> str:
    """tls.crt and tls.key as a kubernetes.io/tls Secret mount holds them; returns the cert path."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "zl-runtime-gpu-node-0")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    (directory / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    return str(directory / "tls.crt")


async def test_tls_secret_name_serves_https_probes_and_h2_over_alpn(tmp_path, monkeypatch):
    import httpx

    cert = _write_tls_secret(tmp_path)
    monkeypatch.setattr(incluster, "TLS_DIR", str(tmp_path))  # where the Secret is mounted in this test
    inode = {"metadata": {"name": "gpu-node-0"},
             "spec": {"nodeName": "gpu-node-0", "models": [{"name": "synthetic", "source": {"path": "/unused"}}],
                      "runtime": {"engine": "synthetic", "tlsSecretName": "serving-cert"}}}
    mapping = incluster.config_from_inferencenode(inode, {"listen": {"host": "127.0.0.1"}})
    config = parse_config(mapping, tmp_path)
    server = build_server(config, port=0)
    server.replace_tenants(tenants())
    await server.start()
    try:
        assert server.base_url.startswith("https://")
        verify = ssl.create_default_context(cafile=cert)
        async with httpx.AsyncClient(verify=verify) as probe:  # what an HTTPS httpGet probe does
            for path in ("/healthz", "/readyz"):
                assert (await probe.get(f"{server.base_url}{path}")).status_code == 200
        async with httpx.AsyncClient(http2=True, verify=verify) as h2, httpx.AsyncClient(verify=verify) as h1:
            for client, version in ((h2, "HTTP/2"), (h1, "HTTP/1.1")):
                response = await client.post(f"{server.base_url}/v1/messages", content=chat_body(stream=False),
                                             headers={"x-api-key": KEY})
                assert response.status_code == 200 and response.http_version == version
        with pytest.raises(httpx.HTTPError):  # no cleartext on the TLS port
            async with httpx.AsyncClient() as plain:
                await plain.get(f"http://127.0.0.1:{server.port}/healthz")
    finally:
        await server.stop(drain_timeout_s=1.0)
