"""Pure parts of the local control plane: manifests, kubeconfigs, certificates, CLI wiring."""

from __future__ import annotations

import pathlib

import pytest
import yaml
from cryptography import x509

from zerolayer import cli
from zerolayer.cluster import build, controlplane, local, pki, versions


def test_fake_node_is_managed_by_kwok_and_labelled_like_gpu_feature_discovery():
    node = local.node_manifest("gpu-node-7")
    assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
    labels = node["metadata"]["labels"]
    assert labels["nvidia.com/gpu.present"] == "true"
    assert labels["nvidia.com/gpu.count"] == node["status"]["capacity"]["nvidia.com/gpu"]
    assert labels["kubernetes.io/hostname"] == "gpu-node-7"


def _plane(real_nodes: bool) -> controlplane.Plane:
    ports = {name: 40000 + i for i, name in enumerate(controlplane.PORTS)}
    return controlplane.Plane(pathlib.Path("/c"), "10.1.0.1" if real_nodes else "127.0.0.1", ports, real_nodes)


def _flags(args: list[str]) -> dict[str, str]:
    return {a[2:].partition("=")[0]: a.partition("=")[2] for a in args}


def test_the_api_server_reaches_kubelets_only_when_real_nodes_join():
    kwok_only, real = _flags(controlplane.apiserver_args(_plane(False))), \
        _flags(controlplane.apiserver_args(_plane(True)))
    assert kwok_only["endpoint-reconciler-type"] == "none" and "kubelet-client-certificate" not in kwok_only
    assert real["kubelet-client-certificate"] == "/c/pki/apiserver-kubelet-client.crt"
    assert "endpoint-reconciler-type" not in real
    assert real["bind-address"] == real["advertise-address"] == "10.1.0.1"
    assert real["etcd-servers"] == "http://127.0.0.1:40000" and real["secure-port"] == "40002"


def test_each_controller_has_its_own_kubeconfig_and_port():
    plane = _plane(False)
    manager, scheduler = _flags(controlplane.controller_manager_args(plane)), \
        _flags(controlplane.scheduler_args(plane))
    assert manager["kubeconfig"] == manager["authorization-kubeconfig"] == "/c/controller-manager.kubeconfig"
    assert scheduler["kubeconfig"] == scheduler["authentication-kubeconfig"] == "/c/scheduler.kubeconfig"
    assert (manager["secure-port"], scheduler["secure-port"]) == ("40003", "40004")
    assert manager["concurrent-daemonset-syncs"] == "8" and "root-ca-file" not in scheduler
    assert _flags(controlplane.etcd_args(plane))["initial-cluster"] == "zerolayer=http://127.0.0.1:40001"


def test_certificates_and_kubeconfig(tmp_path: pathlib.Path):
    pki.create(tmp_path)
    admin = x509.load_pem_x509_certificate((tmp_path / "admin.crt").read_bytes())
    orgs = [a.value for a in admin.subject.get_attributes_for_oid(x509.oid.NameOID.ORGANIZATION_NAME)]
    assert orgs == ["system:masters"]
    server = x509.load_pem_x509_certificate((tmp_path / "apiserver.crt").read_bytes())
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "127.0.0.1" in [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]
    assert oct((tmp_path / "ca.key").stat().st_mode & 0o777) == "0o600"
    cfg = yaml.safe_load(pki.kubeconfig("https://127.0.0.1:1", tmp_path, "admin"))
    assert cfg["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:1"
    assert cfg["users"][0]["user"]["client-certificate"].endswith("admin.crt")


def test_cache_key_changes_with_pinned_versions(monkeypatch, tmp_path):
    monkeypatch.setenv("ZEROLAYER_CACHE", str(tmp_path))
    assert build.toolchain_dir() == tmp_path / f"controlplane-{versions.STAMP}" / "bin"
    assert versions.KUBERNETES in versions.STAMP
    major, minor = versions.KUBERNETES.removeprefix("v").split(".")[:2]
    assert (int(major), int(minor)) >= (1, 34)


def test_version_ldflags_stamp_kubernetes_binaries():
    flags = versions.ldflags("kubectl")
    assert f"gitVersion={versions.KUBERNETES}" in flags


def test_missing_go_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("ZEROLAYER_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(build.BuildError, match="'go'"):
        build.ensure_binaries(log=lambda m: None)


def test_cluster_commands_are_registered():
    parser = cli.build_parser()
    for action in ("up", "down", "status", "kubeconfig", "env"):
        args = parser.parse_args(["cluster", action])
        assert callable(args.handler)


def test_status_without_a_cluster(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("ZEROLAYER_STATE", str(tmp_path))
    assert cli.main(["cluster", "status"]) == 3
    assert "no local cluster" in capsys.readouterr().out
    assert cli.main(["cluster", "kubeconfig"]) == 1
    assert "zerolayer cluster up" in capsys.readouterr().err
