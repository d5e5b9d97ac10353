"""Finding 4c: the SDK follows ``x-zerolayer-alternatives`` only to nodes it already trusts.

On 410a271 any endpoint named in the header was tried at once with the tenant's ``x-api-key``:
anyone able to alter a 503/429 (cleartext MITM, a rogue runtime) could harvest keys, and a bare
``host:port`` or an ``http://`` URL downgraded an ``https`` client to cleartext.
"""

from __future__ import annotations

import pytest

from zerolayer.client.nodes import Node, StaticNodeMap
from zerolayer.client.routing import Router

pytestmark = pytest.mark.regression


def router(*endpoints: str, fallback: str | None = None) -> Router:
    return Router(StaticNodeMap([Node(f"n{i}", e) for i, e in enumerate(endpoints)]), fallback=fallback)


@pytest.mark.parametrize("evil", ["http://evil:80", "evil:80", "https://evil.example:443"])
def test_an_alternative_outside_the_node_map_is_ignored(evil):
    r = router("https://a:8443", "https://b:8443")
    target = r.choose("s", failed=["https://a:8443"], prefer=[evil])
    assert target.endpoint == "https://b:8443" and target.via == "ring"


@pytest.mark.parametrize("downgrade", ["http://b:8443", "b:8443"])
def test_an_alternative_never_downgrades_https_to_http(downgrade):
    r = router("https://a:8443", "https://b:8443")
    target = r.choose("s", failed=["https://a:8443"], prefer=[downgrade])
    assert target.endpoint == "https://b:8443"  # the map's endpoint, with the map's scheme


def test_a_node_of_the_map_and_the_configured_fallback_are_followed():
    r = router("http://a:80", "http://b:80", fallback="http://spare:80")
    assert r.choose("s", failed=["http://a:80"], prefer=["http://b:80"]).via == "alternative"
    assert r.choose("s", failed=["http://a:80"], prefer=["http://spare:80"]).endpoint == "http://spare:80"
