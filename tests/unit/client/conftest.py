"""Fixtures for the SDK's unit tests: real HTTP/2 peers (see h2peer.py)."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # h2peer.py: the test peer lives beside its tests
from h2peer import H2Peer  # noqa: E402

from zerolayer.client import RetryPolicy


@pytest.fixture
def peers():
    """Start H2Peer servers on demand: ``peers()`` -> a running peer; all closed at teardown."""
    started: list[H2Peer] = []

    def start(handler=None) -> H2Peer:
        peer = H2Peer(handler).start()
        started.append(peer)
        return peer

    yield start
    for peer in started:
        peer.close()


@pytest.fixture
def peer(peers) -> H2Peer:
    return peers()


@pytest.fixture
def fast_policy() -> RetryPolicy:
    """The reference policy with millisecond backoff, so fault tests stay quick."""
    return RetryPolicy(max_retries=3, base_delay_s=0.001, max_delay_s=0.05)
