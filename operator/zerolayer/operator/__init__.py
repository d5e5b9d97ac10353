"""The zerolayer operator (kopf): reconciles InferenceNode and TenantQuota.

Layers, one way (tests/unit/operator/test_layers.py checks them):

- ``handlers`` — thin kopf handlers; they call ``reconcile``.
- ``reconcile`` — the level-triggered logic; talks to Kubernetes only through ``kube``.
- ``kube`` — the one module that calls the Kubernetes API.
- ``manifests``, ``conditions``, ``validation``, ``config``, ``errors`` — pure data, no I/O.

The operator never imports the runtime (``zerolayer.runtime``).
"""
