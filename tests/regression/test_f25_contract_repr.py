"""Finding 25: the SDK's RequestContract must not print the tenant's API key.

On 410a271 ``repr(client.contract)`` was ``RequestContract(api_key='sk-secret-123', ...)``: the key
landed in logs, tracebacks and debuggers.
"""

from __future__ import annotations

import pytest

from zerolayer.client import wire
from zerolayer.client._core import make_contract

pytestmark = pytest.mark.regression
SECRET = "sk-secret-regression-0123456789"


def test_repr_and_str_of_the_contract_leave_the_key_out():
    contract = make_contract(SECRET, priority="high", session="s1")
    for text in (repr(contract), str(contract), f"{contract!r}", repr([contract])):
        assert SECRET not in text
    assert "session='s1'" in repr(contract)  # the rest is still there for debugging


def test_the_key_is_still_sent():
    contract = wire.RequestContract(api_key=SECRET)
    assert contract.headers(model="m")["x-api-key"] == SECRET
