"""The plain client of tests/e2e/test_model_service_proxy.py, run inside its network namespace.

    python plain_client.py CLUSTER_IP API_KEY RUNTIME_IP...

Waits (bounded) for every runtime to answer on its own address and for the Service's ClusterIP to
answer (kube-proxy has programmed it); then sends chat completions with the official ``openai`` SDK
to ``http://CLUSTER_IP:8443/v1``: 45 clients with a connection each, then one client 10 times on its
kept-alive connection. Prints, as its last line, JSON of the requests each runtime counted in each
phase (its own ``zerolayer_requests_total`` for the chat route).
"""

from __future__ import annotations

import json
import sys
import time

import httpx
import openai

PORT = 8443


def answered(ip: str) -> float:
    """Chat requests the runtime at ``ip`` answered with 200, from its /metrics."""
    text = httpx.get(f"http://{ip}:{PORT}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("zerolayer_requests_total{") and "chat" in line and 'status="200"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait(what: str, check, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (httpx.HTTPError, openai.APIError, OSError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.5)


def ask(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="tiny", max_tokens=4,
                                           messages=[{"role": "user", "content": "hello"}])
    assert reply.choices[0].message.content is not None


def main() -> None:
    cluster_ip, key, *ips = sys.argv[1:]
    base = f"http://{cluster_ip}:{PORT}/v1"
    for ip in ips:
        wait(f"runtime {ip}", lambda ip=ip: httpx.get(f"http://{ip}:{PORT}/healthz", timeout=2).status_code == 200)
    wait("the ClusterIP", lambda: httpx.get(f"http://{cluster_ip}:{PORT}/healthz", timeout=2).status_code == 200)
    before = {ip: answered(ip) for ip in ips}
    for _ in range(45):
        with openai.OpenAI(base_url=base, api_key=key, max_retries=0) as client:  # a connection of its own
            ask(client)
    middle = {ip: answered(ip) for ip in ips}
    with openai.OpenAI(base_url=base, api_key=key, max_retries=0) as client:
        for _ in range(10):
            ask(client)
    after = {ip: answered(ip) for ip in ips}
    print(json.dumps({"fresh_connections": {ip: middle[ip] - before[ip] for ip in ips},
                      "one_connection": {ip: after[ip] - middle[ip] for ip in ips}}))


if __name__ == "__main__":
    main()
