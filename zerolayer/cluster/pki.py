"""Certificates for the local control plane: one CA, a serving cert and client certs.

Written with ``cryptography`` rather than by shelling out to openssl/cfssl so that
nothing beyond the Python dependencies is needed. Keys are EC P-256 (fast to make);
the service-account signing key is RSA because every Kubernetes version accepts it.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import pathlib

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=365)


def _write_key(key, path: pathlib.Path) -> None:
    """Private keys are created 0600 (never readable by others, not even between write and chmod)."""
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _write_cert(cert: x509.Certificate, path: pathlib.Path) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
    )


def _sans(dns: list[str], ips: list[str]) -> x509.SubjectAlternativeName:
    return x509.SubjectAlternativeName([x509.DNSName(d) for d in dns]
                                       + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips])


def _leaf(pki: pathlib.Path, stem: str, cn: str, org: str | None, *, ca_key, ca_name: x509.Name,
          server_sans: x509.SubjectAlternativeName | None = None, client: bool = True) -> None:
    """Write ``stem.crt``/``stem.key``: a client certificate, a serving one (``server_sans``), or both."""
    key = ec.generate_private_key(ec.SECP256R1())
    b = _builder(_name(cn, org), ca_name, key.public_key())
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server_sans is not None else []) + (
        [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
    b = b.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if server_sans is not None:
        b = b.add_extension(server_sans, critical=False)
    _write_key(key, pki / f"{stem}.key")
    _write_cert(b.sign(ca_key, hashes.SHA256()), pki / f"{stem}.crt")


def _load_ca(pki: pathlib.Path):
    ca = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), password=None)
    return key, ca.subject


def create(pki: pathlib.Path, extra_ips: tuple[str, ...] = ()) -> None:
    """Write ca.crt/key, apiserver.crt/key, admin/controller-manager/scheduler client pairs, sa.key/pub.

    ``extra_ips`` are added to the API server's serving certificate (the address real nodes and
    their pods reach it on). ``apiserver-kubelet-client`` is the API server's identity towards
    kubelets (``kubectl logs/exec``): in ``system:masters`` so the kubelets' webhook authorizer allows it.
    """
    pki.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("zerolayer-local-ca")
    ca = (
        _builder(ca_name, ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(ca_key, pki / "ca.key")
    _write_cert(ca, pki / "ca.crt")
    signer = {"ca_key": ca_key, "ca_name": ca_name}
    apiserver_sans = _sans(
        ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
         "kubernetes.default.svc.cluster.local"],
        ["127.0.0.1", "10.96.0.1", *extra_ips],
    )
    _leaf(pki, "apiserver", "kube-apiserver", None, server_sans=apiserver_sans, client=False, **signer)
    _leaf(pki, "admin", "zerolayer-admin", "system:masters", **signer)
    _leaf(pki, "controller-manager", "system:kube-controller-manager", None, **signer)
    _leaf(pki, "scheduler", "system:kube-scheduler", None, **signer)
    _leaf(pki, "apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters", **signer)

    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(sa_key, pki / "sa.key")
    (pki / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                         serialization.PublicFormat.SubjectPublicKeyInfo)
    )


def create_node(pki: pathlib.Path, node: str, ip: str) -> None:
    """Write a real node's kubelet pairs, signed by the cluster CA made by :func:`create`.

    ``<node>.crt`` is its client identity (``system:node:<node>`` in ``system:nodes``, what the
    Node authorizer expects); ``<node>-serving.crt`` its kubelet serving certificate for ``ip``
    and the node name, which the API server verifies when it proxies ``logs``/``exec``.
    """
    ca_key, ca_name = _load_ca(pki)
    signer = {"ca_key": ca_key, "ca_name": ca_name}
    _leaf(pki, node, f"system:node:{node}", "system:nodes", **signer)
    _leaf(pki, f"{node}-serving", f"system:node:{node}", "system:nodes", server_sans=_sans([node], [ip]),
          client=False, **signer)


def kubeconfig(server: str, pki: pathlib.Path, user: str) -> str:
    """A kubeconfig (YAML text) for ``user`` (admin, controller-manager, scheduler) with file references."""
    return f"""apiVersion: v1
kind: Config
clusters:
- name: zerolayer-local
  cluster:
    server: {server}
    certificate-authority: {pki / 'ca.crt'}
users:
- name: {user}
  user:
    client-certificate: {pki / f'{user}.crt'}
    client-key: {pki / f'{user}.key'}
contexts:
- name: zerolayer-local
  context:
    cluster: zerolayer-local
    user: {user}
    namespace: default
current-context: zerolayer-local
"""
