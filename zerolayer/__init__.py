"""zerolayer: LLM inference with no orchestration layer between client and engine.

Packages: ``zerolayer.cluster`` (local control plane), ``zerolayer.operator`` (kopf operator,
folder ``operator/``), ``zerolayer.runtime`` (HTTP/2 node runtime, folder ``runtime/``),
``zerolayer.client`` (SDK, folder ``client/``), ``zerolayer.contract`` (the wire contract the
runtime and the SDK share).
"""

__version__ = "0.1.0"
