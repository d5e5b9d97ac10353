"""Hypothesis strategies shared by the fuzz tier: JSON bodies, header values, HTTP/2 frames.

Each strategy mixes well-formed inputs (so the fuzzer reaches deep code) with the malformed
kinds a hostile client sends: wrong types, huge numbers, raw JSON escapes (lone surrogates),
non-UTF-8 encodings that ``json.loads`` still accepts, control characters in headers.
"""

from __future__ import annotations

import json
import struct

from hypothesis import strategies as st

MODEL = "synthetic"
API_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "stream", "temperature", "top_p",
              "stop", "stop_sequences", "seed", "priority", "n", "stream_options", "system", "metadata",
              "role", "content", "type", "text", "include_usage")

# Scalars a JSON body can hold, with the edges parsers trip on: bools as ints, huge ints, NaN/inf.
scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["", "user", "assistant", "system", "developer", "text", MODEL, "true"]),
)
keys = st.one_of(st.sampled_from(API_FIELDS), st.text(max_size=8))
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=5)),
    max_leaves=20,
)


@st.composite
def messages(draw, roles=("user", "assistant", "system", "developer")):  # type: ignore[no-untyped-def]
    """A message list that is often valid, sometimes not (role, content shape)."""
    out = []
    for _ in range(draw(st.integers(0, 3))):
        content = draw(st.one_of(
            st.text(max_size=30),
            st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}), max_size=2),
            json_values,
        ))
        role = draw(st.one_of(st.sampled_from(roles), json_values))
        out.append(draw(st.one_of(st.just({"role": role, "content": content}), json_values)))
    return out


def edges(*bounds: float) -> st.SearchStrategy:
    """Numbers at and around each bound (one step in, one out), as ints and floats, plus the
    values range checks miss: huge ints, the 64-bit edges and one past them, -0.0, inf, nan."""
    near = [b + d for b in bounds for d in (-1, 0, 1)] + [b + d for b in bounds for d in (-1e-9, 1e-9)]
    return st.sampled_from([*near, *(int(b) for b in bounds), 2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64,
                            10**30, -10**30, -0.0, float("inf"), float("-inf"), float("nan")])


# The numeric fields vLLM range-checks, each with the bounds the parsers (or vLLM) enforce: a value
# outside must be a 400 naming the field, never a 500 (issue 31 found seed -2**63-1 a 500 on vLLM).
NUMERIC = {
    "seed": edges(-2**63, 2**63 - 1, 0), "n": edges(1, 16), "max_tokens": edges(0, 1, 2**31),
    "max_completion_tokens": edges(0, 1), "temperature": edges(0, 2), "top_p": edges(0, 1),
    "top_k": edges(-1, 0, 1), "presence_penalty": edges(-2, 2), "frequency_penalty": edges(-2, 2),
    "priority": edges(-2**63, 2**63 - 1), "top_logprobs": edges(0, 20, 21), "logprobs": edges(0, 5, 20, 21),
}
logit_biases = st.dictionaries(st.one_of(st.integers(0, 40000).map(str), st.sampled_from(["-1", "1.5", "x", "\u00b2"])),
                               edges(-100, 100), max_size=3)


@st.composite
def numeric_fields(draw, api: str) -> dict:  # type: ignore[no-untyped-def]
    """A few of :data:`NUMERIC` (and ``logit_bias``) at their edges."""
    names = sorted(NUMERIC) + ([] if api == "anthropic" else ["logit_bias"])
    out = {}
    for name in draw(st.lists(st.sampled_from(names), max_size=3, unique=True)):
        out[name] = draw(logit_biases if name == "logit_bias" else NUMERIC[name])
    if api == "anthropic" and "seed" in out:
        out["metadata"] = {"seed": out.pop("seed")}
    if api == "openai" and "logprobs" in out:
        out["logprobs"] = True  # chat's logprobs is a boolean; top_logprobs carries the number
    return out


# /v1/completions prompts: every form OpenAI documents, and the malformed neighbours of each.
prompts = st.one_of(
    st.text(max_size=20), st.lists(st.text(max_size=10), max_size=3),
    st.lists(st.integers(-2, 40000), max_size=4), st.lists(st.lists(st.integers(-2, 40000), max_size=3), max_size=3),
    st.sampled_from([[], [[]], ["a", 1], [1.5], [True], [2**63]]),
)


@st.composite
def request_objects(draw, api: str):  # type: ignore[no-untyped-def]
    """A request object for ``api`` (anthropic|openai|completions) with some fields replaced by junk."""
    if api == "completions":
        base: dict = {"model": MODEL, "max_tokens": draw(st.integers(0, 8)), "prompt": draw(prompts)}
        if draw(st.booleans()):
            base["echo"] = draw(st.booleans())
    else:
        base = {"model": MODEL, "max_tokens": draw(st.integers(1, 8)), "messages": draw(messages())}
    base.update(draw(numeric_fields(api)))
    optional = {
        "stream": st.booleans(), "temperature": st.floats(0, 1), "top_p": st.floats(0, 1),
        ("stop_sequences" if api == "anthropic" else "stop"): st.lists(st.text(max_size=5), max_size=3),
        ("system" if api == "anthropic" else "seed"): st.one_of(st.text(max_size=10), st.integers()),
    }
    for name, strategy in optional.items():
        if draw(st.booleans()):
            base[name] = draw(strategy)
    # Break some fields: the parser must refuse them as 400, never crash or accept nonsense.
    for name in draw(st.lists(keys, max_size=3)):
        if draw(st.booleans()):
            base[name] = draw(json_values)
        else:
            base.pop(name, None)
    return base


# A JSON string literal written by hand, so it can hold any \\uXXXX escape json.dumps never writes
# (a lone surrogate is valid JSON and not text).
_escapes = st.one_of(
    st.sampled_from(['\\"', "\\\\", "\\/", "\\b", "\\f", "\\n", "\\r", "\\t"]),
    st.integers(0, 0xFFFF).map(lambda n: f"\\u{n:04x}"),
    st.integers(0xD800, 0xDFFF).map(lambda n: f"\\u{n:04X}"),
)
raw_strings = st.lists(st.one_of(st.text(alphabet=st.characters(exclude_characters='"\\', exclude_categories=["Cs", "Cc"]),
                                         max_size=5), _escapes), max_size=6).map(lambda parts: '"' + "".join(parts) + '"')


@st.composite
def bodies(draw, api: str) -> bytes:  # type: ignore[no-untyped-def]
    """Request bytes: a (broken) request object in any encoding JSON allows, raw escapes, or junk."""
    kind = draw(st.sampled_from(["object", "raw-escape", "any-json", "bytes", "truncated"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "any-json":
        text = json.dumps(draw(json_values))
    else:
        obj = draw(request_objects(api))
        text = json.dumps(obj)
        if kind == "raw-escape":
            literal = draw(raw_strings)
            text = json.dumps({**obj, "messages": [{"role": "user", "content": "\x00"}]}).replace('"\\u0000"', literal)
        elif kind == "truncated":
            text = text[: draw(st.integers(0, max(0, len(text) - 1)))]
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-8", "utf-8-sig", "utf-16-le", "utf-16-be", "utf-16",
                                     "utf-32"]))
    return text.encode(encoding, "surrogatepass")


# Header values as the cores hand them over: latin-1 decoded bytes, so any code point < 256.
header_values = st.one_of(
    st.text(alphabet=st.characters(max_codepoint=255), max_size=40),
    st.integers().map(str),
    st.sampled_from(["", " ", "high", "normal", "low", "HIGH", "json", "text", "inf", "-inf", "nan", "1e400",
                     "0", "-1", "150000000", "9" * 21, "1_000", " 5 ", "0x10", "١٢٣"]),
    st.floats().map(repr),
)


def frame(kind: int, flags: int, stream_id: int, payload: bytes, length: int | None = None) -> bytes:
    """One raw HTTP/2 frame (RFC 9113 §4.1); ``length`` may lie about the payload."""
    size = len(payload) if length is None else length
    return struct.pack(">I", size)[1:] + bytes([kind & 0xFF, flags & 0xFF]) + struct.pack(">I", stream_id & 0xFFFFFFFF) + payload


raw_frames = st.builds(
    frame,
    kind=st.one_of(st.integers(0, 9), st.integers(0, 255)),
    flags=st.one_of(st.sampled_from([0, 1, 4, 5, 8, 0x20, 0x25, 0x2D]), st.integers(0, 255)),
    stream_id=st.one_of(st.sampled_from([0, 1, 2, 3, 5, 7, 2**31 - 1, 2**31 + 1]), st.integers(0, 2**32 - 1)),
    payload=st.binary(max_size=64),
    length=st.one_of(st.none(), st.none(), st.none(), st.integers(0, 2**24 - 1)),
)
