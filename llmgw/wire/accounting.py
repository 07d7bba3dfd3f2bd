"""The messages between gateway workers and the accountant: admit, settle and status, checked to the last number.

Each message is one JSON object with `v` (the protocol version that wrote it)
and `op`. Anyone who reaches the accountant's socket can write to it, and its
numbers move budgets, so every field is checked deeply: a level is exactly
[counter, rpm, tpm, budget, period], amounts are whole, non-negative and
bounded, and a version the accountant does not know is refused rather than
guessed at. `docs/protocol.md` describes every message; a test keeps that page
and `MESSAGES` in step.
"""

from __future__ import annotations

from llmgw import rules
from llmgw.wire.schema import Int, ListOf, Nullable, ProtocolError, Row, Schema, Str

__all__ = ["GRANT_SECONDS", "LARGEST_GRANT", "MESSAGES", "VERSION", "ProtocolError", "decode", "encode"]

VERSION = 1

LARGEST = 64 * 1024  # bytes: a message with every level a key can have is under 10 KiB
JSON_INT = 2**53  # numbers beyond this are not exact in every JSON reader
ID = Int(0, JSON_INT)
TOKENS = Int(0, 10**9)
COST = Int(0, 10**15)  # micro-units: a thousand million units of money, far beyond any one request
COUNTER = Str(300)
# A worker's allowance (llmgw/control/accountant.py): at most this many requests, admitted by the worker
# within this many seconds of asking for it (by its own clock, from before it asked).
LARGEST_GRANT = 1024
GRANT_SECONDS = 1.0
GRANT = Int(0, LARGEST_GRANT)
LIMIT = Nullable(Int(0, JSON_INT))
LEVELS = ListOf(Row((COUNTER, LIMIT, LIMIT, LIMIT, Str(8, rules.PERIODS))), 64)

# op -> {field: (type, required)}. Add fields; never remove or retype one.
MESSAGES: dict[str, dict[str, tuple[object, bool]]] = {
    # gateway -> accountant
    "admit": {"id": (ID, True), "levels": (LEVELS, True), "priced": ("bool", True), "tokens": (TOKENS, True),
              "cost": (COST, True), "grant": (GRANT, False), "undo": ("bool", False)},
    "settle": {"r": (ID, True), "tokens": (TOKENS, True), "cost": (COST, True), "n": (GRANT, False)},
    "status": {"id": (ID, True), "levels": (LEVELS, True)},
    # accountant -> gateway
    "admitted": {"id": (ID, True), "ok": ("bool", True), "r": (ID, False), "status": ("object", True),
                 "n": (GRANT, False)},
    "refused": {"id": (ID, True), "ok": ("bool", True), "limit": (Str(8, ("budget", "rpm", "tpm")), True),
                "counter": (COUNTER, True), "retry_after": (Int(0, JSON_INT), True), "message": ("str", True),
                "status": ("object", True)},
    "status_reply": {"id": (ID, True), "status": ("object", True)},
}

_SCHEMA = Schema(MESSAGES, VERSION, kind_field="op", reads=frozenset({VERSION}), largest=LARGEST)
encode = _SCHEMA.encode
decode = _SCHEMA.decode
