"""The pure builders: runtime pod shape, RBAC, policies, names. No cluster."""

import pytest

from zerolayer.operator import manifests as m
from zerolayer.operator.config import OperatorConfig

CONFIG = OperatorConfig(runtime_namespace="zl-run", operator_namespace="zl-op",
                        metrics_scraper_namespaces=("monitoring",), runtime_image="img:1")


def inode(name="gpu-node-0", **spec):
    return {"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode",
            "metadata": {"name": name, "uid": "u-1", "generation": 1},
            "spec": {"nodeName": name, "models": [{"name": "tiny", "source": "/m"}], **spec}}


def tquota(name="team-a", **spec):
    return {"apiVersion": "zerolayer.io/v1alpha1", "kind": "TenantQuota",
            "metadata": {"name": name, "uid": "u-2", "generation": 1},
            "spec": {"tenant": name, "apiKeySecretRef": {"name": f"{name}-keys"}, "namespaces": ["b", "a"],
                     "tokensPerMinute": 100, "requestsPerMinute": 10, **spec}}


def build_ds(body, config=CONFIG):
    """The DaemonSet for a Node whose GPUs the runtime requests entirely (so defragd is included)."""
    return m.build_daemonset(body, config, node_gpus=int((body["spec"].get("runtime") or {}).get("gpus", 1)) or None)


def containers(ds):
    return {c["name"]: c for c in ds["spec"]["template"]["spec"]["containers"]}


def test_daemonset_runs_three_containers_on_exactly_its_node():
    ds = build_ds(inode(), CONFIG)
    pod = ds["spec"]["template"]["spec"]
    assert set(containers(ds)) == {"server", "defragd", "auditor"}
    assert pod["nodeSelector"] == {m.INFERENCE_NODE_LABEL: "true"}
    term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-node-0"]}]}]
    assert pod["shareProcessNamespace"] is True
    assert pod["serviceAccountName"] == "zl-runtime-gpu-node-0"
    assert ds["metadata"]["namespace"] == "zl-run"
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()


def test_server_is_non_root_read_only_with_gpu_probes_and_drain():
    ds = build_ds(inode(runtime={"gpus": 2, "drainSeconds": 60, "port": 9443}), CONFIG)
    server = containers(ds)["server"]
    sc = server["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert server["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert server["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert server["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert server["ports"] == [{"name": "serving", "containerPort": 9443, "protocol": "TCP"},
                               {"name": "metrics", "containerPort": 9464, "protocol": "TCP"}]
    assert ds["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 70
    env = {e["name"]: e for e in server["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["ZEROLAYER_NODE_NAME"]["value"] == "gpu-node-0"  # the InferenceNode, as the gossip hook reads it
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert server["args"][:2] == ["runtime", "--node-name=gpu-node-0"] and "--port=9443" in server["args"]


def test_container_commands_follow_audit_and_defrag_settings():
    ds = build_ds(inode(audit={"mode": "inprocess", "store": "clickhouse", "clickhouseUrl": "http://ch:8123/db"},
                                 defrag={"dryRun": True}), CONFIG)
    c = containers(ds)
    assert "--audit-journal" in c["server"]["args"]
    assert "--source=journal" in c["auditor"]["args"] and "--clickhouse=http://ch:8123/db" in c["auditor"]["args"]
    assert "--spool=/run/zerolayer/audit" in c["auditor"]["args"]
    assert c["defragd"]["args"] == ["defragd", "--node-name=gpu-node-0", "--dry-run"]
    default = containers(build_ds(inode(), CONFIG))
    # auto may fall back to the journal, so the server writes one (review finding 9d)
    assert "--source=auto" in default["auditor"]["args"] and "--audit-journal" in default["server"]["args"]


def test_images_and_resources_come_from_spec_over_chart_defaults():
    ds = build_ds(inode(), CONFIG)
    assert containers(ds)["server"]["image"] == "img:1"
    assert containers(ds)["server"]["resources"]["requests"]["memory"] == "16Gi"
    ds = build_ds(inode(runtime={"image": "mine:2", "imagePullPolicy": "Always",
                                          "resources": {"requests": {"memory": "4Gi"}}}), CONFIG)
    server = containers(ds)["server"]
    assert server["image"] == "mine:2" and server["imagePullPolicy"] == "Always"
    assert server["resources"]["requests"] == {"cpu": "4", "memory": "4Gi", "nvidia.com/gpu": "1"}
    # only the server follows spec.runtime.image; root/capable containers run the operator's image
    assert {n: c["image"] for n, c in containers(ds).items()} == {"server": "mine:2", "defragd": "img:1",
                                                                   "auditor": "img:1"}


def test_zero_gpus_requests_none():
    server = containers(build_ds(inode(runtime={"gpus": 0}), CONFIG))["server"]
    assert "nvidia.com/gpu" not in server["resources"].get("requests", {})


def test_auditor_has_bpf_capabilities_and_host_mounts_but_is_not_privileged():
    ds = build_ds(inode(), CONFIG)
    auditor = containers(ds)["auditor"]
    sc = auditor["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert {"BPF", "PERFMON", "SYS_RESOURCE"} <= set(sc["capabilities"]["add"])
    assert "SYS_ADMIN" not in sc["capabilities"]["add"]
    mounts = {v["mountPath"] for v in auditor["volumeMounts"]}
    assert {"/sys/kernel/tracing", "/sys/fs/bpf", "/lib/modules", "/usr/src"} <= mounts
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tracefs"]["hostPath"]["path"] == "/sys/kernel/tracing"
    # It meters its own pod only: the pod's UID from the downward API, its cgroup in the host's tree (read-only).
    assert "--pod-uid=$(POD_UID)" in auditor["args"] and "--cgroup-root=/host/sys/fs/cgroup" in auditor["args"]
    assert {"name": "POD_UID", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.uid"}}} \
        in auditor["env"]
    assert volumes["cgroup"]["hostPath"]["path"] == "/sys/fs/cgroup"
    assert {"name": "cgroup", "mountPath": "/host/sys/fs/cgroup", "readOnly": True} in auditor["volumeMounts"]


def test_optional_containers_follow_spec():
    ds = build_ds(inode(defrag={"enabled": False}, audit={"enabled": False}), CONFIG)
    assert set(containers(ds)) == {"server"}
    assert not any("hostPath" in v for v in ds["spec"]["template"]["spec"]["volumes"])
    reset = containers(build_ds(inode(defrag={"enabled": True, "allowReset": True}), CONFIG))["defragd"]
    assert reset["securityContext"]["capabilities"]["add"] == ["SYS_ADMIN"]
    plain = containers(build_ds(inode(), CONFIG))["defragd"]
    assert plain["securityContext"]["runAsNonRoot"] is True and "add" not in plain["securityContext"]["capabilities"]


def test_tls_switches_probes_to_https_and_mounts_the_secret():
    ds = build_ds(inode(runtime={"tlsSecretName": "cert"}), CONFIG)
    server = containers(ds)["server"]
    assert server["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert {"name": "tls", "secret": {"secretName": "cert"}} in ds["spec"]["template"]["spec"]["volumes"]


def test_children_are_owned_by_their_custom_resource():
    body = inode()
    for build in (m.build_daemonset, m.build_serviceaccount, m.build_clusterrole, m.build_clusterrolebinding,
                  m.build_headless_service, m.build_runtime_networkpolicy, m.build_keys_role,
                  m.build_keys_rolebinding):
        meta = build(body, CONFIG)["metadata"]
        assert meta["ownerReferences"] == [{"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode",
                                            "name": "gpu-node-0", "uid": "u-1", "controller": True}]
        assert meta["name"] == "zl-runtime-gpu-node-0"
        assert meta["annotations"][m.OWNER_NAME_ANNOTATION] == "InferenceNode/gpu-node-0"
    for build in (m.build_tenant_networkpolicy, m.build_ciliumnetworkpolicy):
        meta = build(tquota(), CONFIG)["metadata"]
        assert meta["ownerReferences"][0]["kind"] == "TenantQuota"
        assert meta["name"] == "zl-tenant-team-a"


def test_runtime_rbac_is_least_privilege():
    role = m.build_clusterrole(inode(), CONFIG)
    status_rule = [r for r in role["rules"] if r["resources"] == ["inferencenodes/status"]][0]
    assert status_rule["resourceNames"] == ["gpu-node-0"]
    verbs = {v for r in role["rules"] if r["resources"] != ["events"] for v in r["verbs"]}
    assert verbs <= {"get", "list", "watch", "patch"}
    assert [r["verbs"] for r in role["rules"] if r["resources"] == ["events"]] == [["create"]]
    assert not any("secrets" in r["resources"] for r in role["rules"])
    binding = m.build_clusterrolebinding(inode(), CONFIG)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "zl-runtime-gpu-node-0", "namespace": "zl-run"}]
    keys_role = m.build_keys_role(inode(), CONFIG)
    assert keys_role["metadata"]["namespace"] == "zl-run"
    assert keys_role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["zl-tenant-keys"],
                                   "verbs": ["get", "list", "watch"]}]
    rb = m.build_keys_rolebinding(inode(), CONFIG)
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "zl-runtime-gpu-node-0", "namespace": "zl-run"}]


def test_key_hashes_are_the_runtimes_digest_and_the_entry_round_trips():
    from zerolayer.runtime.node.incluster import published_entries
    from zerolayer.runtime.tenants import key_hash

    assert m.key_hashes("sk-b\n\n sk-a \nsk-b\n") == sorted({key_hash("sk-a"), key_hash("sk-b")})
    body = tquota()
    body["metadata"]["creationTimestamp"] = "2026-01-02T03:04:05Z"
    entry = m.build_tenant_key_entry(body, m.key_hashes("sk-a"))
    assert m.read_tenant_key_entry(entry) == {"tenant": "team-a", "created": "2026-01-02T03:04:05Z",
                                              "hashes": [key_hash("sk-a")]}
    assert published_entries({"data": {"team-a": entry}}) == {
        "team-a": {"tenant": "team-a", "created": "2026-01-02T03:04:05Z", "hashes": frozenset({key_hash("sk-a")})}}
    assert "sk-a" not in entry and "sk-a" not in m.read_tenant_key_entry(entry)["hashes"]


def test_network_policies_admit_only_declared_namespaces_on_the_serving_port():
    base = m.build_runtime_networkpolicy(inode(), CONFIG)
    rule = base["spec"]["ingress"][0]
    assert rule["ports"] == [{"protocol": "TCP", "port": "serving"}]
    assert rule["from"][0]["namespaceSelector"]["matchExpressions"][0]["values"] == ["zl-op"]
    metrics = base["spec"]["ingress"][1]
    assert metrics["ports"] == [{"protocol": "TCP", "port": "metrics"}, {"protocol": "TCP", "port": "audit-metrics"}]
    assert metrics["from"][0]["namespaceSelector"]["matchExpressions"][0]["values"] == ["monitoring"]
    assert base["spec"]["policyTypes"] == ["Ingress", "Egress"]
    tenant = m.build_tenant_networkpolicy(tquota(), CONFIG)
    assert tenant["metadata"]["namespace"] == "zl-run"
    assert tenant["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "zerolayer-runtime"}}
    assert tenant["spec"]["ingress"][0]["from"][0]["namespaceSelector"]["matchExpressions"][0]["values"] == ["a", "b"]


def test_cilium_policy_requires_an_api_key_header_from_tenant_namespaces():
    cnp = m.build_ciliumnetworkpolicy(tquota(), CONFIG)
    assert cnp["apiVersion"] == "cilium.io/v2"
    ingress = cnp["spec"]["ingress"][0]
    assert [e["matchLabels"]["k8s:io.kubernetes.pod.namespace"] for e in ingress["fromEndpoints"]] == ["a", "b"]
    assert ingress["toPorts"][0]["rules"]["http"] == [{"headers": ["x-api-key"]}, {"headers": ["authorization"]}]


def test_names_stay_valid_for_long_resource_names():
    long = "n" * 240
    name = m.runtime_name(long)
    assert len(name) <= 52 and name == m.runtime_name(long)
    assert m.runtime_name(long) != m.runtime_name(long + "x")
    assert len(m.label_value("x" * 100)) <= 63
    assert m.label_value("NVIDIA H100 80GB") == "NVIDIA-H100-80GB"


def test_node_labels_and_gpu_type():
    node = {"metadata": {"labels": {m.GFD_PRODUCT_LABEL: "NVIDIA-H100-80GB-HBM3"}}}
    assert m.gpu_type_of({}, node) == "NVIDIA-H100-80GB-HBM3"
    assert m.gpu_type_of({"gpuType": "A100"}, node) == "A100"
    assert m.node_labels("A100") == {m.INFERENCE_NODE_LABEL: "true", m.GPU_TYPE_LABEL: "A100"}
    assert m.node_labels(None) == {m.INFERENCE_NODE_LABEL: "true"}


@pytest.mark.parametrize("kernel, has_sys_resource", [
    ("6.18.44-fc-v1147", False), ("5.11.0", False), ("5.15.0-105-generic", False),
    ("5.10.0-28-amd64", True), ("4.18.0-513.el8.x86_64", True), (None, True), ("", True), ("weird", True)])
def test_auditor_asks_for_sys_resource_only_on_kernels_that_charge_bpf_to_memlock(kernel, has_sys_resource):
    caps = containers(m.build_daemonset(inode(), CONFIG, node_gpus=1, node_kernel=kernel))["auditor"][
        "securityContext"]["capabilities"]["add"]
    assert ("SYS_RESOURCE" in caps) == has_sys_resource
    assert {"BPF", "PERFMON", "SYS_PTRACE", "DAC_READ_SEARCH"} <= set(caps)


def _api_server_egress(config):
    egress = m.build_runtime_networkpolicy(inode(), config)["spec"]["egress"]
    return [r for r in egress if any(p["port"] not in (53,) for p in r["ports"])][0]


def test_runtime_egress_reaches_the_api_server_on_its_own_ports():
    # CNIs match egress after the `kubernetes` Service's DNAT: the policy names the API server's own port.
    assert sorted(p["port"] for p in _api_server_egress(CONFIG)["ports"]) == [443, 6443]
    config = OperatorConfig.from_env({"ZEROLAYER_RUNTIME_NAMESPACE": "zl-run", "ZEROLAYER_API_SERVER_PORTS": "40191",
                                      "ZEROLAYER_API_SERVER_CIDRS": "10.233.0.1/32"})
    rule = _api_server_egress(config)
    assert rule["ports"] == [{"protocol": "TCP", "port": 40191}]
    assert rule["to"] == [{"ipBlock": {"cidr": "10.233.0.1/32"}}]


def test_server_gets_a_memory_backed_dev_shm_for_the_engine():
    ds = build_ds(inode(), CONFIG)
    server = containers(ds)["server"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in server["volumeMounts"]
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": m.SHM_SIZE_LIMIT}


@pytest.mark.parametrize("spec, node_gpus, names", [
    ({}, 1, ["server", "defragd", "auditor"]),
    ({}, 8, ["server", "auditor"]),  # the runtime holds 1 of 8 GPUs: no defragd
    ({"defrag": {"enabled": False}, "audit": {"enabled": False}}, 1, ["server"]),
    ({"runtime": {"tlsSecretName": "tls"}, "models": [{"name": "a", "source": {"pvc": {"claimName": "c"}}}]}, None,
     ["server", "auditor"]),
])
def test_each_container_brings_the_volumes_it_mounts(spec, node_gpus, names):
    ds = m.build_daemonset(inode(**spec), CONFIG, node_gpus=node_gpus, node_kernel="6.8.0")
    pod = ds["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == names
    volumes = [v["name"] for v in pod["volumes"]]
    assert len(volumes) == len(set(volumes))
    for container in pod["containers"] + pod["initContainers"]:
        assert {mount["name"] for mount in container.get("volumeMounts", ())} <= set(volumes), container["name"]


def test_auditor_kernel_mode_is_the_charts_choice_adds_sys_admin_and_is_named_on_the_pod():
    """runtime.auditor.kernelMode (ZEROLAYER_AUDITOR_KERNEL_MODE): off by default, the auditor never holds
    SYS_ADMIN; on, it gets SYS_ADMIN (what lets the USDT probe attach on 6.18). Either way the pod says
    which was asked (an annotation) and the auditor records the mode it runs as an Event on its pod."""
    import dataclasses

    default = build_ds(inode(), CONFIG)
    kernel = m.build_daemonset(inode(), dataclasses.replace(CONFIG, auditor_kernel_mode=True), node_gpus=1,
                               node_kernel="6.18.44-fc-v1147")
    for ds, mode in ((default, "false"), (kernel, "true")):
        assert ds["spec"]["template"]["metadata"]["annotations"][m.AUDITOR_KERNEL_MODE_ANNOTATION] == mode
        auditor = containers(ds)["auditor"]
        assert "--mode-event-pod=$(POD_NAMESPACE)/$(POD_NAME)" in auditor["args"]
        assert {e["name"] for e in auditor["env"]} >= {"POD_NAMESPACE", "POD_NAME", "POD_UID"}
    assert "SYS_ADMIN" not in containers(default)["auditor"]["securityContext"]["capabilities"]["add"]
    caps = containers(kernel)["auditor"]["securityContext"]["capabilities"]
    assert caps == {"drop": ["ALL"], "add": ["BPF", "PERFMON", "SYS_PTRACE", "DAC_READ_SEARCH", "SYS_ADMIN"]}
    assert containers(kernel)["auditor"]["securityContext"]["privileged"] is False
    # the server is untouched by the auditor's mode
    assert containers(kernel)["server"]["securityContext"] == containers(default)["server"]["securityContext"]


@pytest.mark.parametrize("raw, expected", [("true", True), ("false", False), ("1", True), ("0", False)])
def test_auditor_kernel_mode_from_the_charts_environment(raw, expected):
    config = OperatorConfig.from_env({"ZEROLAYER_AUDITOR_KERNEL_MODE": raw})
    assert config.auditor_kernel_mode is expected
    assert OperatorConfig.from_env({}).auditor_kernel_mode is False


def test_auditor_kernel_mode_refuses_a_value_that_is_not_a_boolean():
    from zerolayer.operator.errors import ConfigError

    with pytest.raises(ConfigError, match="ZEROLAYER_AUDITOR_KERNEL_MODE"):
        OperatorConfig.from_env({"ZEROLAYER_AUDITOR_KERNEL_MODE": "yes please"})
