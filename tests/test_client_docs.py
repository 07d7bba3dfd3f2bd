"""The client pages (docs/clients/) name only models a reader has: the starter model `make run` serves, a
placeholder to fill in (MODEL), or a name the same page first tells the reader to put in the catalog.

A newcomer who ran `make run` and pasted the SDK page's examples met 404s: they asked for `starter`,
`coder` and `claude-sonnet-4-6`, which no catalog of theirs held (issue 25)."""

import pathlib
import re

import pytest

from llmgw.cli import starter
from tests.conftest import ROOT

PAGES = sorted(pathlib.Path(ROOT, "docs", "clients").glob("*.md"))
FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
# Where an example names the model it asks for: a keyword argument or TOML key, a JSON or YAML member, a
# query string, a command-line flag.
ASKED = [re.compile(p, re.M) for p in (r'\bmodel\s*=\s*"([^"]+)"', r'"model"\s*:\s*"([^"]+)"',
                                       r'^\s*model:\s*"?([^"\s]+)"?', r"[?&]model=([\w.:-]+)",
                                       r"(?:^|\s)(?:-m|--model)\s+([\w.:-]+)")]
# What a page may tell the reader to put in the catalog: a model's name and its aliases.
INTRODUCED = [re.compile(r'^name\s*=\s*"([^"]+)"', re.M), re.compile(r"^aliases\s*=\s*\[([^\]]*)\]", re.M)]
PLACEHOLDER = re.compile(r"[A-Z][A-Z_]*")


def names(patterns, text: str) -> set[str]:
    found = set()
    for pattern in patterns:
        for match in pattern.findall(text):
            found.update(re.findall(r'"([^"]+)"', match) or [match])
    return found


def test_the_check_sees_what_the_old_page_asked_for():
    old = '```python\nclient.chat.completions.create(model="coder", messages=m)\n```\n' \
          '```sh\ncodex -m starter exec "hi"\ncurl -fsSL "https://G/setup/codex?model=claude-sonnet-4-6"\n```\n'
    assert names(ASKED, "".join(FENCED.findall(old))) == {"coder", "starter", "claude-sonnet-4-6"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_example_model_names_are_ones_the_reader_has(page):
    text = page.read_text(encoding="utf-8")
    code = FENCED.findall(text)
    introduced = names(INTRODUCED, "".join(code))
    for block in code:
        for name in names(ASKED, block):
            assert name == starter.NAME or PLACEHOLDER.fullmatch(name) or name in introduced, (
                f"{page.name} asks for the model {name!r}, which a reader who ran `make run` does not have: use "
                f"{starter.NAME}, a placeholder such as MODEL, or a name the page first puts in the catalog")
