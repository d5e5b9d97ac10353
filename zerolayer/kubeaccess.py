"""The one place that turns "where is the cluster?" into Kubernetes client configuration.

Every component (operator, runtime, auditor, defragd, SDK) asks this module, so they all
find the API server the same way:

1. an explicit kubeconfig path (a ``--kubeconfig`` flag), else
2. ``$KUBECONFIG`` when set, else
3. the pod's service account (in-cluster), else
4. ``~/.kube/config``.

Configuration is built per call into a fresh ``kubernetes.client.Configuration`` (never the
library's process-global default), so one process can hold clients for several clusters.
A missing or unusable configuration is a :class:`KubeConfigError` naming why.
"""

from __future__ import annotations

import os
from typing import Any


class KubeConfigError(RuntimeError):
    """No usable Kubernetes configuration: no kubeconfig and not inside a pod, or a broken file."""


def load_configuration(kubeconfig: str | None = None) -> Any:
    """A ``kubernetes.client.Configuration`` found in the order the module docstring gives."""
    import yaml
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        explicit = kubeconfig or os.environ.get("KUBECONFIG")  # read now: the library reads it at import
        if explicit:
            config.load_kube_config(config_file=explicit, client_configuration=configuration)
            return configuration
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
    except (config.ConfigException, OSError, TypeError, ValueError, yaml.YAMLError) as exc:
        where = kubeconfig or os.environ.get("KUBECONFIG") or "in-cluster or ~/.kube/config"
        raise KubeConfigError(f"no usable Kubernetes configuration ({where}): {exc}") from exc
    return configuration


def api_client(kubeconfig: str | None = None, *, retries: int | None = None) -> Any:
    """A ``kubernetes.client.ApiClient`` on :func:`load_configuration`.

    ``retries`` sets urllib3's retry count (None: the library default); components that
    have their own backoff pass 1 so a gone API server fails fast.
    """
    from kubernetes import client

    configuration = load_configuration(kubeconfig)
    if retries is not None:
        configuration.retries = retries
    return client.ApiClient(configuration)
