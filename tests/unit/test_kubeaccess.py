"""zerolayer.kubeaccess: the one module that finds the cluster."""

from __future__ import annotations

import pytest

from zerolayer import kubeaccess

KUBECONFIG = """apiVersion: v1
kind: Config
clusters:
- name: c
  cluster: {server: "https://10.9.8.7:6443", insecure-skip-tls-verify: true}
users:
- name: u
  user: {token: "t0ken"}
contexts:
- name: x
  context: {cluster: c, user: u}
current-context: x
"""


def test_explicit_kubeconfig_wins(tmp_path, monkeypatch):
    path = tmp_path / "kc"
    path.write_text(KUBECONFIG)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    configuration = kubeaccess.load_configuration(str(path))
    assert configuration.host == "https://10.9.8.7:6443"


def test_env_kubeconfig_used(tmp_path, monkeypatch):
    path = tmp_path / "kc"
    path.write_text(KUBECONFIG)
    monkeypatch.setenv("KUBECONFIG", str(path))
    client = kubeaccess.api_client(retries=1)
    assert client.configuration.host == "https://10.9.8.7:6443"
    assert client.configuration.retries == 1


def test_nothing_usable_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "none"))
    with pytest.raises(kubeaccess.KubeConfigError, match="no usable Kubernetes configuration"):
        kubeaccess.load_configuration()


def test_broken_file_is_a_clear_error(tmp_path):
    path = tmp_path / "kc"
    path.write_text("clusters: [")
    with pytest.raises(kubeaccess.KubeConfigError, match=str(path)):
        kubeaccess.load_configuration(str(path))
