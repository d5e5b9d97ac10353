"""Finding 18: failed authentications are throttled per peer address.

On 410a271 a peer could try API keys as fast as the connection allowed: every wrong key was a
cheap 401 and nothing slowed the next guess.
"""

from __future__ import annotations

import pytest

from tests.regression.wire import KEY, H2Peer, chat_body, connect, limits, runtime, until

pytestmark = [pytest.mark.regression, pytest.mark.timeout(30)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def ask(peer: H2Peer, key: str) -> int:
    sid = peer.request(chat_body(stream=False, max_tokens=2), key=key)
    await until(lambda: (peer.read(), peer.status(sid))[1] is not None)
    return peer.status(sid)  # type: ignore[return-value]


async def test_a_peer_guessing_keys_is_throttled_and_other_peers_are_not():
    clock = Clock()
    server = await runtime(limits=limits(auth_failure_burst=10, auth_failures_per_second=0.5), clock=clock)
    guesser = H2Peer(*connect(server, ("10.0.0.66", 1)))
    statuses = [await ask(guesser, f"sk-guess-{i}") for i in range(15)]
    assert statuses[:10] == [401] * 10
    assert set(statuses[10:]) == {429}  # throttled: the key is not even looked at
    assert await ask(guesser, KEY) == 429  # a right guess now is not confirmed either
    other = H2Peer(*connect(server, ("10.0.0.67", 1)))
    assert await ask(other, KEY) == 200  # other addresses are unaffected
    clock.now += 10  # the budget refills at 0.5 per second
    assert await ask(guesser, KEY) == 200


async def test_successful_authentications_cost_nothing():
    server = await runtime(limits=limits(auth_failure_burst=2, auth_failures_per_second=0.01))
    peer = H2Peer(*connect(server))
    assert [await ask(peer, KEY) for _ in range(10)] == [200] * 10
