"""One sync ``Client`` shared by many threads, as a web app's worker threads share it.

httpx's sync HTTP/2 connection is not safe to share between threads (encode/httpx#3566: concurrent
streams on one connection raise ``RuntimeError: deque mutated during iteration``, which no retry
covers): the SDK keeps one httpx pool per thread, so a shared Client loses nothing.
"""

from __future__ import annotations

import collections
import threading

import pytest

from zerolayer.client import Client

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
KEY = "tenant-key"
THREADS, EACH = 16, 40


def test_a_client_shared_by_threads_answers_every_request(runtimes):
    node = runtimes()
    outcomes: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    with Client(api_key=KEY, base_url=node.url, max_retries=0) as client:

        def worker(n: int) -> None:
            for i in range(EACH):
                try:
                    if i % 2:
                        with client.messages.create(model="tiny", max_tokens=12, stream=True,
                                                    messages=[{"role": "user", "content": f"t{n} q{i}"}]) as s:
                            ok = len("".join(s.text_stream).split()) == 12
                    else:
                        ok = client.messages.create(model="tiny", max_tokens=3, messages=[
                            {"role": "user", "content": f"t{n} q{i}"}]).usage.output_tokens == 3
                    outcome = "ok" if ok else "short"
                except Exception as exc:  # noqa: BLE001 - counted and shown, the test fails on any
                    outcome = f"{type(exc).__name__}: {exc}"[:120]
                with lock:
                    outcomes[outcome] += 1

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    print(f"\n{THREADS} threads x {EACH} requests on one Client: {dict(outcomes)}")
    assert outcomes == {"ok": THREADS * EACH}
