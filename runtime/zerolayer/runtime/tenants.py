"""Tenant authentication: API keys checked against stored SHA-256 hashes.

A client never names its own tenant: the key it presents (``x-api-key`` or
``Authorization: Bearer``) is hashed and looked up. Only hashes are kept in memory
and in config files; a key given through an environment variable is hashed at load.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import hmac
from typing import Iterable, Mapping

from zerolayer.runtime.limits import TokenBucket
from zerolayer.runtime.scheduler.api import TenantPolicy


def key_hash(key: str) -> str:
    """The stored form of an API key: lower-case hex SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(key.encode()).hexdigest()


def presented_key(headers: Mapping[str, str]) -> str | None:
    key = headers.get("x-api-key")
    if key:
        return key.strip()
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None


@dataclasses.dataclass(frozen=True)
class Tenant:
    name: str
    key_hashes: frozenset[str]
    policy: TenantPolicy


class TenantDirectory:
    """Who is who. Replaced wholesale on config changes (``replace``); reads are lock-free.

    ``known`` is False for a directory whose tenants come from elsewhere (the cluster) until the first
    ``replace``: until then every key would be refused, so the runtime does not call itself ready.
    """

    def __init__(self, tenants: Iterable[Tenant] = (), *, known: bool = True) -> None:
        self._by_hash: dict[str, Tenant] = {}
        self._tenants: dict[str, Tenant] = {}
        self.replace(tenants)
        self.known = known

    def replace(self, tenants: Iterable[Tenant]) -> None:
        by_hash: dict[str, Tenant] = {}
        named: dict[str, Tenant] = {}
        for tenant in tenants:
            named[tenant.name] = tenant
            for digest in tenant.key_hashes:
                by_hash[digest.lower()] = tenant
        self._by_hash, self._tenants = by_hash, named
        self.known = True

    def authenticate(self, headers: Mapping[str, str]) -> Tenant | None:
        key = presented_key(headers)
        if key is None:
            return None
        digest = key_hash(key)
        tenant = self._by_hash.get(digest)
        # The dict lookup found a candidate by hash; compare in constant time anyway.
        if tenant is not None and any(hmac.compare_digest(digest, h) for h in tenant.key_hashes):
            return tenant
        return None

    def policies(self) -> dict[str, TenantPolicy]:
        return {name: t.policy for name, t in self._tenants.items()}

    def __len__(self) -> int:
        return len(self._tenants)


class AuthThrottle:
    """Failed authentications per peer address: a token bucket each (``burst``, then ``rate``/s).

    ``blocked`` says whether a peer has spent its budget (and for how long); only failures spend
    it, so a tenant with a valid key is never slowed by its own traffic. At most ``max_peers``
    addresses are remembered (least recently failed forgotten first), so the table is bounded.
    """

    def __init__(self, burst: int, rate: float, *, max_peers: int = 65536) -> None:
        self.burst = burst
        self.rate = rate
        self.max_peers = max_peers
        self._peers: collections.OrderedDict[str, TokenBucket] = collections.OrderedDict()

    def blocked(self, peer: str, now: float) -> float | None:
        """Seconds until ``peer`` may try a key again, or None if it may now."""
        bucket = self._peers.get(peer)
        if bucket is None:
            return None
        tokens = min(bucket.capacity, bucket.tokens + (now - bucket.stamp) * bucket.rate)
        if tokens >= 1:
            return None
        return (1 - tokens) / bucket.rate

    def failed(self, peer: str, now: float) -> None:
        bucket = self._peers.pop(peer, None) or TokenBucket(self.burst, self.rate, now)
        bucket.take(now)
        self._peers[peer] = bucket
        while len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)
