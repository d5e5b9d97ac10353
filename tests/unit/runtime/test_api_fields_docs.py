"""docs/api-fields.md lists every top-level request field exactly as the parsers treat it."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from zerolayer.runtime.api import anthropic, openai
from zerolayer.runtime.errors import RequestRefused

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "api-fields.md"
SECTIONS = {
    "chat": ("## OpenAI Chat Completions", openai.CHAT_HONOURED, openai.CHAT_REFUSED),
    "completions": ("## OpenAI Completions", openai.COMPLETIONS_HONOURED, openai.COMPLETIONS_REFUSED),
    "messages": ("## Anthropic Messages", anthropic.HONOURED, anthropic.REFUSED),
    "count_tokens": ("## Anthropic token counting", anthropic.COUNT_HONOURED, anthropic.COUNT_REFUSED),
}


def table(heading: str) -> dict[str, str]:
    """Field -> "honoured" | "refused" from the section's table."""
    text = DOC.read_text()
    section = text[text.index(heading):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    rows = re.findall(r"^\| `([a-z_]+)` \| (honoured|refused)", section, flags=re.M)
    return dict(rows)


@pytest.mark.parametrize("api", sorted(SECTIONS))
def test_docs_table_matches_the_parser(api):
    heading, honoured, refused = SECTIONS[api]
    documented = table(heading)
    expected = {**dict.fromkeys(honoured, "honoured"), **dict.fromkeys(refused, "refused")}
    assert documented == expected


@pytest.mark.parametrize("field", sorted(openai.CHAT_REFUSED))
def test_every_refused_chat_field_is_refused_by_parse(field):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], field: {"something": 1}}
    with pytest.raises(RequestRefused, match=f"^{field}: not supported: "):
        openai.parse(json.dumps(body).encode())


def vllm_extensions() -> list[tuple[str, str, str]]:
    """(field, Chat Completions status, Completions status) from the vLLM's extensions table."""
    text = DOC.read_text()
    section = text[text.index("## vLLM's extensions"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"^\| `([a-z_]+)` \| (honoured|refused|unknown|n/a) \| (honoured|refused|unknown|n/a) \|",
                      section, flags=re.M)


def status(parse, honoured, refused, body: dict, field: str) -> str:
    if field in honoured:
        return "honoured"
    if field in refused:
        return "refused"
    with pytest.raises(RequestRefused, match=f"^{field}: unknown field$"):
        parse(json.dumps({**body, field: {"x": 1}}).encode())
    return "unknown"


def test_the_vllm_extensions_table_says_what_the_parsers_do():
    rows = vllm_extensions()
    assert len(rows) > 20
    chat_body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    completions_body = {"model": "m", "prompt": "x"}
    for field, chat, completions in rows:
        if chat != "n/a":
            assert status(openai.parse, openai.CHAT_HONOURED, openai.CHAT_REFUSED, chat_body, field) == chat, field
        if completions != "n/a":
            assert status(openai.parse_completions, openai.COMPLETIONS_HONOURED, openai.COMPLETIONS_REFUSED,
                          completions_body, field) == completions, field
