"""docs/operator.md renders the operator's RBAC rules from zerolayer.operator.rbac; they must agree."""

import pathlib
import re

import yaml

from zerolayer.operator import rbac

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "operator.md"


def test_documented_rbac_matches_the_rules_the_operator_is_tested_with():
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert [yaml.safe_load(b) for b in blocks] == [rbac.CLUSTER_RULES, rbac.RUNTIME_NAMESPACE_RULES,
                                                   rbac.operator_namespace_rules()]


def test_runtime_rbac_needs_nothing_the_operator_lacks():
    """RBAC forbids granting what the grantor does not hold: every verb in a runtime's
    ClusterRole and its key-hash Role must be held by the operator."""
    from zerolayer.operator import manifests as m
    from zerolayer.operator.config import OperatorConfig

    def grants(rules, names_matter=True):
        # (group, resource, verb, name): name None means every object of that resource
        return {(g, r, v, n) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]
                for v in rule["verbs"] for n in (rule.get("resourceNames") or [None])}

    cluster = grants(rbac.CLUSTER_RULES)
    runtime_ns = grants(rbac.RUNTIME_NAMESPACE_RULES)
    cfg = OperatorConfig()
    inode = {"apiVersion": "zerolayer.io/v1alpha1", "kind": "InferenceNode",
             "metadata": {"name": "n", "uid": "u"}, "spec": {"nodeName": "n"}}
    for role, held in ((m.build_clusterrole(inode, cfg), cluster),
                       (m.build_keys_role(inode, cfg), cluster | runtime_ns)):  # the Role lives in the runtime ns
        for g, r, v, n in grants(role["rules"]):
            assert (g, r, v, None) in held or (n is not None and (g, r, v, n) in held), (g, r, v, n)
