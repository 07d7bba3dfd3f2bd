"""One name for the environment variable that holds a person's API key, LLMGW_API_KEY, wherever people are told
to set or use it: the landing page's example once said $LLMGW_KEY while the account page, the setup scripts and
the docs said $LLMGW_API_KEY, so the copied example sent an empty key."""

import os
import re

from llmgw.web import editorconfig
from tests.conftest import ROOT
from tests.test_pages import site  # noqa: F401  (the fixture)

# Where a person reads what to put in their shell: the pages, their scripts, the docs.
TOLD = ["templates", "static", "docs", "README.md", "llmgw/web"]
KEY_VARIABLE = re.compile(r"\bLLMGW_\w*KEY\w*")


def test_the_landing_pages_example_uses_the_key_variable(site):  # noqa: F811
    pages, _, _ = site
    page = pages.test_client().get("/").data.decode()
    assert editorconfig.KEY_VARIABLE == "LLMGW_API_KEY"
    assert '-H "Authorization: Bearer $LLMGW_API_KEY"' in page and "export LLMGW_API_KEY=sk-llmgw-" in page
    assert set(KEY_VARIABLE.findall(page)) == {"LLMGW_API_KEY"}


def test_every_page_script_and_doc_names_the_same_variable():
    named = {}
    for place in TOLD:
        top = os.path.join(ROOT, place)
        paths = [top] if os.path.isfile(top) else [os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs]
        for path in paths:
            with open(path, encoding="utf-8", errors="replace") as f:
                for name in KEY_VARIABLE.findall(f.read()):
                    named.setdefault(name, os.path.relpath(path, ROOT))
    assert set(named) == {"LLMGW_API_KEY"}, named
