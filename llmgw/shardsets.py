"""A model split into shards (`model-00001-of-00003.gguf`): the one way every part of llmgw names a set.

A shard is only useful with its whole set, so the mirror fetches the set for any one of its names, `ctl plan`
sizes the set, and the mirror page's registry view offers the set as one row. Pure names: no I/O.
"""

from __future__ import annotations

import re

SHARD = re.compile(r"^(?P<stem>.+)-(?P<n>\d{5})-of-(?P<total>\d{5})(?P<ext>\.[A-Za-z0-9]+)$")
MOST_PARTS = 1000  # more than any real set (a 1 TB model in 2 GB parts is 500); a name past it is no set


def siblings(name: str) -> list[str] | None:
    """Every file name of the set the file NAME is a shard of, in order; None when NAME is no shard (or
    names a part past its set's end, or a set past MOST_PARTS)."""
    match = SHARD.match(name)
    if match is None or not 1 <= int(match.group("n")) <= int(match.group("total")) <= MOST_PARTS:
        return None
    total = int(match.group("total"))
    return [f"{match.group('stem')}-{i:05d}-of-{total:05d}{match.group('ext')}" for i in range(1, total + 1)]


def set_name(name: str) -> str:
    """How a set is shown as one: `model-0000N-of-00003.gguf`, keeping `-of-`; NAME itself when no shard."""
    match = SHARD.match(name)
    if match is None or siblings(name) is None:
        return name
    return f"{match.group('stem')}-0000N-of-{match.group('total')}{match.group('ext')}"
