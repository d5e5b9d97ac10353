#!/usr/bin/env python3
"""Write docs/crds.md from crds/ (the source of truth). tests/unit/test_layout.py checks it is current."""

from __future__ import annotations

import pathlib
import sys

import yaml

REPO = pathlib.Path(__file__).resolve().parent.parent
RULE_KEYS = ("enum", "pattern", "minItems", "maxItems", "minLength", "maxLength")


def _rules(sub: dict) -> str:
    rules = []
    if "minimum" in sub:
        rules.append(f"{'>' if sub.get('exclusiveMinimum') else '≥'} {sub['minimum']}")
    if "maximum" in sub:
        rules.append(f"≤ {sub['maximum']}")
    for key in RULE_KEYS:
        if key in sub:
            rules.append(f"{key} `{sub[key]}`")
    items = sub.get("items") or {}
    if "enum" in items:
        rules.append(f"each one of `{items['enum']}`")
    return "; ".join(rules).replace("|", "\\|")


def _walk(schema: dict, path: str, rows: list[str]) -> None:
    for name, sub in (schema.get("properties") or {}).items():
        p = f"{path}.{name}"
        kind = sub.get("type", "int-or-string" if sub.get("x-kubernetes-int-or-string") else "")
        if kind == "array":
            kind = f"[]{(sub.get('items') or {}).get('type', '')}"
        default = "" if "default" not in sub else f"`{sub['default']}`"
        desc = " ".join(sub.get("description", "").split()).replace("|", "\\|")
        rows.append(f"| `{p}` | {kind} | {default} | {_rules(sub)} | {desc} |")
        if sub.get("type") == "object":
            _walk(sub, p, rows)
        if sub.get("type") == "array" and (sub.get("items") or {}).get("type") == "object":
            _walk(sub["items"], p + "[]", rows)


def _cel(schema: dict, path: str, out: list[str]) -> None:
    for rule in schema.get("x-kubernetes-validations", []):
        out.append(f"- `{path}`: {rule['message']} — `{rule['rule']}`")
    for name, sub in (schema.get("properties") or {}).items():
        _cel(sub, f"{path}.{name}", out)


def render() -> str:
    out = ["# Custom resources", "",
           "Written by `hack/crd_docs.py` from `crds/` (the source of truth); `kubectl explain` shows the same",
           "descriptions. Group `zerolayer.io`, version `v1alpha1`, category `zerolayer`.", ""]
    for path in sorted((REPO / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        names, version = crd["spec"]["names"], crd["spec"]["versions"][0]
        schema = version["schema"]["openAPIV3Schema"]
        out += [f"## {names['kind']}", "",
                f"{crd['spec']['scope']}-scoped; plural `{names['plural']}`, short names "
                f"{', '.join('`' + s + '`' for s in names['shortNames'])}.", "",
                " ".join(schema["description"].split()), "",
                "| field | type | default | validation | description |", "|---|---|---|---|---|"]
        rows: list[str] = []
        _walk(schema["properties"]["spec"], "spec", rows)
        _walk(schema["properties"]["status"], "status", rows)
        cel: list[str] = []
        _cel(schema, "", cel)
        out += rows + ["", "Cross-field rules (CEL):", ""] + cel + [""]
        out += ["Printer columns (`kubectl get`): "
                + ", ".join(c["name"] for c in version["additionalPrinterColumns"]) + ".", ""]
    return "\n".join(out)


if __name__ == "__main__":
    target = REPO / "docs" / "crds.md"
    if "--check" in sys.argv:
        sys.exit(0 if target.read_text() == render() else 1)
    target.write_text(render())
