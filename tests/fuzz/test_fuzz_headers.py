"""Fuzz the header contract parser (runtime/serving/headers.py), which runs at HEADERS time on every request.

Contract: ``parse_contract`` returns a :class:`RequestContract` whose deadlines are finite and at
most ``MAX_DEADLINE_S`` ahead, or raises ``RequestRefused``: INVALID_REQUEST (answered 400 with the
API's error body) for a malformed value, DEADLINE_EXCEEDED only for a well-formed deadline that
has already passed. Nothing else escapes.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.fuzz.seeds import reproducible
from tests.fuzz.strategies import header_values
from tests.fuzz.test_fuzz_json import check_error_answer
from zerolayer import contract
from zerolayer.contract import ErrorCode, Priority
from zerolayer.runtime.errors import RequestRefused
from zerolayer.runtime.serving.headers import REQUIRABLE, parse_contract

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(120)]

NAMES = (*contract.SESSION, *contract.PRIORITY, *contract.MODEL_HINT, *contract.OUTPUT_FORMAT,
         *contract.DEADLINE_NANOS, *contract.SLO_TTFT_MS, "x-api-key", "content-length")
NOW_MONO = 5000.0
contract_headers = st.dictionaries(st.one_of(st.sampled_from(NAMES), st.text(max_size=10)), header_values, max_size=8)


@reproducible
@given(headers=contract_headers, now_wall_ns=st.integers(0, 2**63), required=st.lists(st.sampled_from(sorted(REQUIRABLE)),
                                                                                         unique=True))
@example(headers={"x-slo-ttft-ms": "1e400"}, now_wall_ns=0, required=[])
@example(headers={"x-slo-ttft-ms": "1E-10"}, now_wall_ns=0, required=[])
@example(headers={"x-zerolayer-deadline-nanos": "9" * 21}, now_wall_ns=0, required=[])
@example(headers={"x-zerolayer-deadline-nanos": "1_000"}, now_wall_ns=0, required=[])
@example(headers={"x-zerolayer-deadline-nanos": "１２３"}, now_wall_ns=0, required=[])  # fullwidth digits: int() takes them
def test_contract_parses_or_refuses_with_a_client_error(headers, now_wall_ns, required):
    try:
        terms = parse_contract(headers, NOW_MONO, now_wall_ns, required)
    except RequestRefused as refused:
        assert refused.code in (ErrorCode.INVALID_REQUEST, ErrorCode.DEADLINE_EXCEEDED), refused.code
        if refused.code is ErrorCode.DEADLINE_EXCEEDED:
            assert refused.reason == "deadline_on_arrival"
        else:
            for api in ("anthropic", "openai"):
                check_error_answer(api, refused)
        return
    assert isinstance(terms.priority, Priority)
    for deadline in (terms.deadline, terms.ttft_deadline):
        if deadline is not None:
            # <=: a TTFT budget below float resolution (1e-10 ms, found by the explore profile) lands on arrival.
            assert math.isfinite(deadline) and NOW_MONO <= deadline <= NOW_MONO + contract.MAX_DEADLINE_S + 1e-6
    assert terms.output_format in (None, "json", "text")
    for field in required:
        assert any(headers.get(n, "").strip() for n in REQUIRABLE[field]), f"required {field} missing but accepted"
