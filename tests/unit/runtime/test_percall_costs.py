"""Per-request work on the non-streaming path that was done twice or rebuilt on every call (issue 29):
each test pins the cheaper way and that the answer, the parsed request and the errors are what they were.

* ``load_json`` finds the body's encoding once (``json.loads(bytes)`` found it a second time);
* ``dumps`` reuses one encoder (``json.dumps`` with options builds a ``JSONEncoder`` per call);
* ``parse_contract`` skips the header-by-header parse when no contract header is present;
* the gate reads ``traceparent`` once and builds one ``Accept`` per admitted chat request (the
  application opened the session and wrapped it in a second one);
* the objects every request builds are slotted dataclasses, not frozen ones (a frozen one sets each
  field through ``object.__setattr__``: a ``Ticket`` took 1.11 µs to build frozen, 0.26 µs slotted,
  ``python3 bench/percall_micro.py``).
"""

from __future__ import annotations

import json

import pytest

from zerolayer import contract
from zerolayer.contract import Priority
from zerolayer.runtime.api import common, openai
from zerolayer.runtime.engine.synthetic import SyntheticEngine
from zerolayer.runtime.errors import RequestRefused
from zerolayer.runtime.limits import Limits
from zerolayer.runtime.api.common import Choice
from zerolayer.runtime.api.wire import StreamFrame
from zerolayer.runtime.engine.base import ChatMessage, Prompt
from zerolayer.runtime.protocol.events import Accept, RequestHead, RequestReady
from zerolayer.runtime.scheduler import MicroScheduler, SchedulerConfig, TenantPolicy
from zerolayer.runtime.scheduler.api import Admission, Reservation, Ticket
from zerolayer.runtime.scheduler.plugins import AdmissionContext
from zerolayer.runtime.serving import app as app_module
from zerolayer.runtime.serving import gate as gate_module
from zerolayer.runtime.serving import headers as headers_module
from zerolayer.runtime.serving.app import Application
from zerolayer.runtime.serving.gate import Admitted, AdmissionGate
from zerolayer.runtime.serving.headers import CONTRACT_HEADERS, RequestContract, parse_contract
from zerolayer.runtime.serving.metrics import RuntimeMetrics
from zerolayer.runtime.serving.session import StreamSession
from zerolayer.runtime.tenants import Tenant, TenantDirectory, key_hash

KEY = "sk-percall"
NOW, WALL_NS = 1000.0, 1_700_000_000 * 10**9


# ---------------------------------------------------------------------------------------- load_json
def old_load_json(body: bytes) -> dict:
    """load_json as it was: json.loads on the bytes, then the encoding found again."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise common.invalid(f"body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise common.invalid("body is nested too deeply") from None
    if not isinstance(data, dict):
        raise common.invalid("body must be a JSON object")
    suspect = (json.detect_encoding(body) not in common._ASCII_COMPATIBLE
               or common._SURROGATE_ESCAPE.search(body))
    if suspect and not common._encodable(data):
        raise common.invalid("body contains a lone UTF-16 surrogate escape (\\ud800-\\udfff), which is not text")
    return data


def outcome(load, body: bytes) -> tuple[str, object]:
    try:
        return "ok", load(body)
    except RequestRefused as refused:
        return "refused", (refused.code, refused.message, refused.reason)


TEXT = '{"model": "m", "messages": [{"role": "user", "content": "h\u00e9llo \u2603 \U0001f600"}]}'
BODIES = [
    TEXT.encode(),
    b"\xef\xbb\xbf" + TEXT.encode(),  # UTF-8 with a BOM
    b"\xef\xbb\xbf\xef\xbb\xbf{}",  # two BOMs: the second is not stripped
    TEXT.encode("utf-16"), TEXT.encode("utf-16-le"), TEXT.encode("utf-16-be"),
    TEXT.encode("utf-32"), TEXT.encode("utf-32-le"), TEXT.encode("utf-32-be"),
    b'{"a": "\\ud800"}', '{"a": "\\ud800"}'.encode("utf-16-le"), b'{"a": "\\ud83d\\ude00"}',
    b'{"a": "\xff"}', b"\xff\xfe\x00", b"", b"   ", b"[1, 2]", b"null", b"{", b'{"a": 1} x',
    b"[" * 100_000 + b"]" * 100_000,
]


@pytest.mark.parametrize("body", BODIES, ids=range(len(BODIES)))
def test_load_json_answers_as_it_did(body):
    assert outcome(common.load_json, body) == outcome(old_load_json, body)


def test_load_json_finds_the_encoding_once(monkeypatch):
    calls = []
    detect = json.detect_encoding

    def counting(body):
        calls.append(body)
        return detect(body)

    monkeypatch.setattr(json, "detect_encoding", counting)
    common.load_json(TEXT.encode())
    assert len(calls) == 1


# --------------------------------------------------------------------------------------------- dumps
OBJECTS = [{"a": [1, 2.5, None, True, False], "b": {"c": "d"}}, "h\u00e9llo \u2603 \U0001f600", [], {},
           {"text": "line\nbreak \"quoted\" \\ \u2028 \x00"}, [float("1e300"), -0.0, 10**30]]


@pytest.mark.parametrize("obj", OBJECTS, ids=range(len(OBJECTS)))
def test_dumps_bytes_are_those_of_json_dumps(obj):
    assert common.dumps(obj) == json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def test_dumps_raises_as_json_dumps_does():
    for bad in ({"x": object()}, {"x": {1j: 2}}):
        with pytest.raises(TypeError):
            json.dumps(bad, separators=(",", ":"), ensure_ascii=False)
        with pytest.raises(TypeError):
            common.dumps(bad)


def test_dumps_differs_from_json_dumps_only_where_documented():
    """orjson encodes: a non-finite float is null (the standard library wrote NaN/Infinity, which is not
    JSON), and a float is in its shortest form (the same number); what orjson refuses (big integers,
    non-string keys) is encoded by the standard library, byte for byte as before."""
    assert common.dumps({"x": float("nan"), "y": float("-inf")}) == b'{"x":null,"y":null}'
    assert common.dumps(-2.7332800579786138e-05) == b"-0.000027332800579786138"
    assert json.loads(common.dumps(3.8409980565845195e-07)) == 3.8409980565845195e-07
    for refused in ({"big": 10**30}, {1: "int key"}):
        assert common.dumps(refused) == json.dumps(refused, separators=(",", ":"), ensure_ascii=False).encode()
    with pytest.raises(UnicodeEncodeError):  # a lone surrogate: UTF-8 cannot carry it, as before
        common.dumps({"s": "\ud800"})


def test_dumps_builds_no_encoder_per_call(monkeypatch):
    built = []
    init = json.JSONEncoder.__init__

    def counting(self, *args, **kwargs):
        built.append(kwargs)
        init(self, *args, **kwargs)

    monkeypatch.setattr(json.JSONEncoder, "__init__", counting)
    common.dumps({"a": 1})
    assert built == []


# ------------------------------------------------------------------------------------ parse_contract
PLAIN = {"authorization": "Bearer x", "content-type": "application/json", "content-length": "120",
         "user-agent": "h2load", "accept": "*/*", "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}


@pytest.mark.parametrize("default", list(Priority))
def test_no_contract_header_gives_the_terms_the_full_parse_gives(default):
    fast = parse_contract(PLAIN, NOW, WALL_NS, (), default)
    # A contract header sent blank counts as absent: the full parse then runs and must agree.
    for name in CONTRACT_HEADERS:
        assert parse_contract({**PLAIN, name: "  "}, NOW, WALL_NS, (), default) == fast
    assert fast == RequestContract(default, False, None, None, None, None, None)


def test_no_contract_header_reads_no_header_one_by_one(monkeypatch):
    asked = []
    monkeypatch.setattr(headers_module, "first", lambda headers, names: asked.append(names))
    terms = parse_contract(PLAIN, NOW, WALL_NS)
    assert asked == [] and terms is parse_contract(dict(PLAIN), NOW + 1, WALL_NS)  # one shared frozen instance


def test_contract_headers_name_every_header_the_full_parse_reads(monkeypatch):
    asked: set[str] = set()
    first = headers_module.first

    def recording(headers, names):
        asked.update(names)
        return first(headers, names)

    monkeypatch.setattr(headers_module, "first", recording)
    every = {"x-zerolayer-session": "s", "x-zerolayer-priority": "high", "x-zerolayer-model-hint": "m",
             "x-zerolayer-output-format": "json", "x-zerolayer-deadline-nanos": "2000000000", "x-slo-ttft-ms": "50"}
    parse_contract(every, NOW, WALL_NS, tuple(headers_module.REQUIRABLE))
    assert asked and asked <= CONTRACT_HEADERS
    assert CONTRACT_HEADERS == {*contract.SESSION, *contract.PRIORITY, *contract.MODEL_HINT, *contract.OUTPUT_FORMAT,
                                *contract.DEADLINE_NANOS, *contract.SLO_TTFT_MS}


@pytest.mark.parametrize("name", sorted(CONTRACT_HEADERS))
def test_any_one_contract_header_is_parsed(name):
    value = {"x-slo-ttft-ms": "50"}.get(name, "high" if "priority" in name else
                                        "2000000000" if "deadline" in name else
                                        "json" if "output-format" in name else "synthetic")
    terms = parse_contract({**PLAIN, name: value}, NOW, WALL_NS)
    assert terms != parse_contract(PLAIN, NOW, WALL_NS)


def test_required_headers_are_still_required_when_no_contract_header_is_sent():
    with pytest.raises(RequestRefused):
        parse_contract(PLAIN, NOW, WALL_NS, ("session",))


@pytest.mark.parametrize("deadline", [None, 5.0, 9.0])
@pytest.mark.parametrize("ttft", [None, 5.0, 7.0])
@pytest.mark.parametrize("sent", [False, True])
def test_effective_deadline_is_the_earliest_that_applies(deadline, ttft, sent):
    terms = RequestContract(Priority.NORMAL, False, None, None, None, deadline, ttft)
    applying = [d for d in (deadline, None if sent else ttft) if d is not None]
    assert terms.effective_deadline(sent) == (min(applying) if applying else None)


# ------------------------------------------------------------------------------------------- the gate
class CountingHeaders(dict):
    """A header mapping that counts the lookups of each name."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lookups: dict[str, int] = {}

    def get(self, name, default=None):  # type: ignore[override]
        self.lookups[name] = self.lookups.get(name, 0) + 1
        return super().get(name, default)


def chat_head(stream_id: int = 1, **extra: str) -> RequestHead:
    headers = CountingHeaders({"authorization": f"Bearer {KEY}", "content-type": "application/json",
                               "content-length": "100", **extra})
    return RequestHead(stream_id, "POST", "/v1/chat/completions", headers, "node", False)


def parts(open_session=None):
    engine = SyntheticEngine(("synthetic",))
    engine._started = True  # ready() without an event loop
    tenants = TenantDirectory([Tenant("acme", frozenset({key_hash(KEY)}), TenantPolicy("acme"))])
    return dict(engine=engine, scheduler=MicroScheduler(SchedulerConfig()), tenants=tenants,
                metrics=RuntimeMetrics(), limits=Limits())


def test_an_admitted_chat_request_is_one_accept_holding_its_session(monkeypatch):
    built = []

    class CountingAccept(Accept):
        def __init__(self, *args, **kwargs) -> None:
            built.append(args)
            super().__init__(*args, **kwargs)

    app = Application(**parts())
    monkeypatch.setattr(gate_module, "Accept", CountingAccept)
    monkeypatch.setattr(app_module, "Accept", CountingAccept)
    traceparent = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    head = chat_head(traceparent=traceparent)
    verdict = app.gate(7, head, "10.0.0.1")
    assert isinstance(verdict, Accept) and len(built) == 1
    session = verdict.context
    assert isinstance(session, StreamSession) and app.streams[session.key] is session
    assert session.key == "7/1" and session.traceparent == traceparent
    assert verdict.owner == "acme" and verdict.max_body == Limits().max_body_bytes
    assert head.headers.lookups["traceparent"] == 1  # read once, for the refusal and the admitted request alike
    session.settle()


def test_the_gate_alone_still_answers_with_what_it_admitted():
    gate = AdmissionGate(**parts())
    verdict = gate.decide(3, chat_head(5), None)
    assert isinstance(verdict, Accept) and isinstance(verdict.context, Admitted)
    assert verdict.context.key == "3/5" and verdict.context.ticket is not None


def test_keyed_and_open_routes_open_no_session():
    app = Application(**parts())
    models = RequestHead(1, "GET", "/v1/models", {"authorization": f"Bearer {KEY}"}, "node", True)
    health = RequestHead(3, "GET", "/healthz", {}, "node", True)
    for head in (models, health):
        verdict = app.gate(1, head)
        assert isinstance(verdict, Accept) and isinstance(verdict.context, Admitted)
    assert app.streams == {}


def test_the_parsed_chat_request_is_unchanged_by_the_cheaper_json():
    body = json.dumps({"model": "synthetic", "max_tokens": 16,
                       "messages": [{"role": "user", "content": "what does a zero layer cost?"}]}).encode()
    request = openai.parse(body)
    assert request.model == "synthetic" and request.max_tokens == 16 and len(request.messages) == 1
    assert request.messages[0].content == "what does a zero layer cost?"


def test_default_terms_keep_the_priority_object_they_were_given():
    assert type(parse_contract(PLAIN, NOW, WALL_NS, (), Priority.NORMAL).priority) is Priority
    assert type(parse_contract(PLAIN, NOW, WALL_NS, (), 1).priority) is int  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- objects per request
PER_REQUEST = (RequestHead, Accept, RequestReady, Admitted, Ticket, AdmissionContext, Reservation, Admission,
               ChatMessage, Prompt, StreamFrame, Choice)


@pytest.mark.parametrize("cls", PER_REQUEST, ids=lambda c: c.__name__)
def test_objects_built_per_request_are_slotted_not_frozen(cls):
    assert "__slots__" in cls.__dict__ and not cls.__dataclass_params__.frozen


def test_objects_built_per_request_still_compare_by_value():
    ticket = Ticket("1/3", "acme", Priority.NORMAL, "m", 10, 16, None)
    assert ticket.sized("m", Priority.HIGH, 12, 16) == Ticket("1/3", "acme", Priority.HIGH, "m", 12, 16, None)
    assert Prompt("a b", (1, 2)) == Prompt("a b", (1, 2)) and Prompt("a b", (1, 2)) != Prompt("a b", (1, 3))
    with pytest.raises(AttributeError):  # slotted: a misspelt field is an error, not a new attribute
        ticket.prompt_token = 3  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------- request ids
def test_request_ids_are_24_hex_digits_and_never_repeat():
    from zerolayer.runtime.serving.session import _RandomBytes

    ids = _RandomBytes()
    drawn = [ids.hex12() for _ in range(5000)]  # several 4 KiB pools
    assert all(len(d) == 24 and int(d, 16) >= 0 for d in drawn) and len(set(drawn)) == len(drawn)


def test_a_forked_child_draws_other_request_ids_than_its_parent():
    import os

    from zerolayer.runtime.serving.session import _RandomBytes

    ids = _RandomBytes()
    ids.hex12()  # the pool is filled before the fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.write(write, "".join(ids.hex12() for _ in range(4)).encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 4096).decode()
    os.waitpid(pid, 0)
    parent = "".join(ids.hex12() for _ in range(4))
    assert len(child) == len(parent) == 96 and child != parent


# ---------------------------------------------------------------------------------------- sampling defaults
class _Recording(dict):
    """A JSON object that records every field read from it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


def test_sampling_fields_name_every_field_the_full_read_reads():
    body = _Recording(model="m", messages=[])
    openai._sampling_given(body, "m")
    assert body.read <= openai.SAMPLING_FIELDS
    assert body.read == openai.SAMPLING_FIELDS  # and nothing listed that it does not read


@pytest.mark.parametrize("body", [
    {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
    {"model": "m", "messages": [], "metadata": None},
])
def test_a_body_without_sampling_fields_gets_what_the_full_read_gives(body):
    fast = openai._sampling(body, "m")
    assert fast == openai._sampling_given(body, "m") and fast["model"] == "m"
    fast["stop"] = "changed"  # each request gets its own dict
    assert openai._sampling(body, "m")["stop"] == openai._sampling_given(body, "m")["stop"]


@pytest.mark.parametrize("field", sorted(openai.SAMPLING_FIELDS))
def test_any_one_sampling_field_is_read_in_full(field, monkeypatch):
    calls = []
    monkeypatch.setattr(openai, "_sampling_given", lambda data, model: calls.append(field) or {})
    openai._sampling({"model": "m", field: None}, "m")
    assert calls == [field]
