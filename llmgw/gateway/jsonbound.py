"""Parsing a request body as JSON at a cost known before it is parsed.

`json.loads` turned a 30 MB body of 2.3 million `{"role":"u"}` into half a
gigabyte of dicts and held the worker for seconds; 100,000 `[` ran it out of
recursion mid-parse (a 500 and a traceback). A thread pool does not help: the
C decoder holds the GIL throughout, and a greenlet ticking every millisecond
beside a parse in gevent's pool waited as long as the parse took (measured,
issue 9). So the body's shape is measured first, at C speed (`bytes.count`,
`bytes.translate`, one regex over bodies that need it), and a body that would
grow the worker by more than three times its size (or ALLOWANCE, for a small
body) or nests deeper than MAX_DEPTH is refused before it is parsed. Bounding
the memory bounds the time too: what fits the budget parses in tens of
milliseconds at worst.
"""

from __future__ import annotations

import json
import re
import sys

from llmgw.gateway.errors import ApiError

MiB = 1 << 20
# Deep enough for any JSON schema a tool declares; shallow enough that nothing
# after the parse (checks, re-encoding, the engine's own parser) recurses far.
MAX_DEPTH = 64
# What a small body may cost in any case: room for 300,000 token ids (an
# embeddings batch at OpenAI's limit), whose Python ints take 42 bytes each
# against 6 in JSON. Past it a body may cost three times its size.
ALLOWANCE = 24 * MiB
# Parsed costs, measured with tracemalloc (Python 3.11) and rounded up: a small
# dict is about 190 bytes and `{}` 64; a short string 59, an int 36, a float
# 32, each with its slot in a list.
CONTAINER_COST = 200
VALUE_COST = 64

# A JSON string: no raw quote inside one, and a backslash escapes what follows.
STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


def _bad(message: str) -> ApiError:
    return ApiError(400, message, "invalid_request")


def loads(raw: bytes):
    """RAW parsed, or ApiError: 400 when it is not JSON or nests too deep, 413 when it would cost too much."""
    try:
        # As json.loads decodes bytes; decoding here tells the text's size in memory (a single
        # emoji makes every character of a string four bytes wide).
        text = raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as e:
        raise _bad(f"The request body is not valid JSON: it is not UTF-8 ({e}). Send a JSON object "
                   "encoded as UTF-8 with Content-Type: application/json.") from None
    check_shape(raw, sys.getsizeof(text))
    try:
        return json.loads(text)
    except ValueError as e:
        raise _bad(f"The request body is not valid JSON ({e}). Send a JSON object with "
                   "Content-Type: application/json.") from None
    except RecursionError:  # check_shape should have refused it; never a 500 for a body
        raise _depth_error() from None


def check_shape(raw: bytes, text_size: int) -> None:
    """Refuse RAW when parsing it would cost more than it may, or it nests deeper than MAX_DEPTH.

    The first counts take commas and brackets inside strings for structure,
    which only overstates: when they pass, the body passes without a copy.
    When they do not, the strings are emptied and the body counted again, so
    a prompt of CSV or code is not taken for a million values.
    """
    allowed = max(3 * len(raw), ALLOWANCE)
    containers, values = _counts(raw)
    if _cost(containers, values, text_size) <= allowed and containers <= MAX_DEPTH:
        return
    # Every string is a value: when they alone are too many, say so before
    # emptying them (which would itself allocate per string).
    strings = (raw.count(b'"') - raw.count(b'\\"')) // 2
    if _cost(0, strings, text_size) > allowed:
        raise _too_costly(len(raw), strings, allowed)
    skeleton = STRINGS.sub(b'""', raw)
    containers, values = _counts(skeleton)
    if _cost(containers, values, text_size) > allowed:
        raise _too_costly(len(raw), containers + values, allowed)
    if containers > MAX_DEPTH and not _shallow(skeleton):
        raise _depth_error()


def _counts(data: bytes) -> tuple[int, int]:
    """Upper bounds of the containers in DATA and of its other values (each follows a `,` or `:`, or is the first)."""
    return data.count(b"{") + data.count(b"["), data.count(b",") + data.count(b":") + 1


def _cost(containers: int, values: int, text_size: int) -> int:
    # The text is held while it is parsed, and its strings are copied out of it.
    return CONTAINER_COST * containers + VALUE_COST * values + 2 * text_size


def _shallow(skeleton: bytes) -> bool:
    """Whether the brackets of SKELETON (a body without its strings) pair up within MAX_DEPTH levels.

    Each pass removes the innermost pairs, so a body MAX_DEPTH deep is empty
    after MAX_DEPTH passes; a pass that removes nothing ends the search.
    """
    brackets = skeleton.translate(None, NOT_BRACKETS)
    for _ in range(MAX_DEPTH):
        inner = brackets.replace(b"[]", b"").replace(b"{}", b"")
        if len(inner) == len(brackets):
            break
        brackets = inner
    return not brackets


def _depth_error() -> ApiError:
    return _bad(f"The request body nests lists and objects more than {MAX_DEPTH} levels deep, or its brackets do "
                "not pair up. Send a flatter body.")


def _too_costly(size: int, values: int, allowed: int) -> ApiError:
    return ApiError(413, f"The request body holds about {values:,} JSON values in {size:,} bytes; reading it would "
                         f"take more memory than this gateway gives one request ({allowed // MiB} MiB: three times "
                         f"the body's size, or {ALLOWANCE // MiB} MiB for a small body). Send fewer, larger values, "
                         "or split the request.", "body_too_complex")
