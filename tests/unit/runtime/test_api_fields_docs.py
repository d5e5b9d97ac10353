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
