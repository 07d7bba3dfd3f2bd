"""What a model's name and each of its aliases may be, as pure values: no store, no I/O.

A name travels everywhere: in URLs (`/admin/models/NAME`, the admin API), log
lines, pages, the gateways' snapshot and the CLI's tables. So it is short and
plain: letters, digits and `._:-`, as real names are (`qwen2.5-7b-instruct`,
`llama3.1:8b`, `SmolLM2-135M-Instruct`), never starting with `.` or `-` (a
hidden file, an option). The catalog checks it on every way in
(llmgw/control/catalog.py); the gateways' snapshot schema (llmgw/wire/gateways.py)
bounds the same fields by the same constants, so the controller never sends a
snapshot a gateway refuses: a 250-character name once stopped every gateway
taking any snapshot at all.
"""

from __future__ import annotations

import re

LONGEST = 64  # characters in a model's name or one alias
MOST_ALIASES = 16  # aliases of one model: a few spellings, not a list of every client's
_NAME = re.compile(r"[A-Za-z0-9_:][A-Za-z0-9._:-]*")
RULE = (f"a model name or alias is 1 to {LONGEST} characters of letters, digits and . _ : - "
        "(such as qwen2.5-7b-instruct or llama3.1:8b), not starting with . or -")


def refusal(name) -> str | None:
    """Why NAME cannot be a model's name or alias: the rule, with NAME shown safely; None: it can."""
    if isinstance(name, str) and len(name) <= LONGEST and _NAME.fullmatch(name):
        return None
    shown = repr(name)  # repr: a newline or escape in it is shown, not acted on
    shown = shown if len(shown) <= LONGEST + 2 else shown[:LONGEST] + "..."
    return f"{shown} cannot be used: {RULE}"


# A guard judge's categories (its catalog entry's `guard.categories`), which travel in every snapshot.
MOST_CATEGORIES = 30
LONGEST_CATEGORY = 300
