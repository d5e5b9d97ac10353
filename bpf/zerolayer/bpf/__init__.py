"""Token metering: the runtime's USDT probe, the BPF auditor, the audit store and billing.

Layers (imports go downward only): ``cli`` → ``auditor`` → (``loader``, ``journal``, ``store``,
``billing``, ``kube``) → ``events``, ``errors``. ``probes`` is what the runtime imports; it depends
on ``events`` and ``errors`` only, never on bcc, SQLite or Kubernetes. See docs/audit.md.
"""
