"""Parsing a request body as JSON at a cost known before it is parsed.

`json.loads` turned a 30 MB body of 2.3 million `{"role":"u"}` into half a
gigabyte of dicts and held the worker for seconds; 100,000 `[` ran it out of
recursion mid-parse (a 500 and a traceback). A thread pool does not help: the
C decoder holds the GIL throughout, and a greenlet ticking every millisecond
beside a parse in gevent's pool waited as long as the parse took (measured,
issue 9). So the body's shape is measured first, at C speed (`bytes.count`,
`bytes.split`, `bytes.translate`), and a body that would
grow the worker by more than three times its size (or ALLOWANCE, for a small
body) or nests deeper than MAX_DEPTH is refused before it is parsed. Bounding
the memory bounds the time too: what fits the budget parses in tens of
milliseconds at worst.
"""

from __future__ import annotations

import json
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

NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
NOT_STRUCTURE = bytes(sorted(set(range(256)) - set(b"[]{},:")))


def _bad(message: str) -> ApiError:
    return ApiError(400, message, "invalid_request")


def loads(raw: bytes):
    """RAW parsed, or ApiError: 400 when it is not JSON or nests too deep, 413 when it would cost too much."""
    allowed = max(3 * len(raw), ALLOWANCE)
    # The structure is measured before the text is decoded, so that the copies
    # the measuring may make are gone by the time the text exists.
    structure = _structure_cost(raw, allowed)
    try:
        text = raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as e:
        raise _bad(f"The request body is not valid JSON: it is not UTF-8 ({e}). Send a JSON object "
                   "encoded as UTF-8 with Content-Type: application/json.") from None
    # One emoji makes every character of its string four bytes wide in memory, and json.loads
    # would have decoded the same text.
    cost = structure + _text_cost(sys.getsizeof(text))
    if cost > allowed:
        raise _too_costly(len(raw), cost, allowed, "text whose characters take up to four bytes each once read")
    if text.startswith("\ufeff"):  # which json.loads names, and the decoder alone takes for no value at all
        raise _bad("The request body is not valid JSON: it begins with a byte order mark (U+FEFF). Send the JSON "
                   "object without one, encoded as UTF-8, with Content-Type: application/json.")
    try:
        return _DECODER.decode(text)
    except ValueError as e:
        raise _bad(f"The request body is not valid JSON ({e}). Send a JSON object with "
                   "Content-Type: application/json.") from None
    except RecursionError:  # _structure_cost should have refused it; never a 500 for a body
        raise _depth_error() from None


def _not_json(name: str):
    # Python reads NaN and Infinity; JSON has no such thing, and engines refuse them.
    raise ValueError(f"{name} is not a JSON value")


# One for every body: json.loads with an argument makes a decoder a call, 2.4% of a plain request's CPU.
_DECODER = json.JSONDecoder(parse_constant=_not_json)


def _structure_cost(raw: bytes, allowed: int) -> int:
    """What RAW's lists, objects and values will cost once parsed; ApiError when, with
    RAW's text, that is more than ALLOWED, or RAW nests deeper than MAX_DEPTH.

    The first counts take commas and brackets inside strings for structure,
    which only overstates: when they pass, the body passes without a copy.
    When they do not, the strings are emptied and the body counted again, so
    a prompt of CSV or code is not taken for a million values.
    """
    text = _text_cost(len(raw))  # the text as ASCII; wider text is counted once decoded
    containers, values = _counts(raw)
    cost = _cost(containers, values)
    if cost + text <= allowed:
        if containers <= MAX_DEPTH:
            return cost
    else:
        # Every string is a value: when they alone are too many, say so before emptying
        # them, which allocates for each (and costs less than parsing them, when they are fewer).
        strings = (raw.count(b'"') - raw.count(b'\\"')) // 2
        if _cost(0, strings) + text > allowed:
            raise _too_costly(len(raw), _cost(0, strings) + text, allowed, f"{strings:,} strings at least")
    skeleton = _without_strings(raw)
    containers, values = _counts(skeleton)
    cost = _cost(containers, values)
    if cost + text > allowed:
        raise _too_costly(len(raw), cost + text, allowed, f"about {containers + values:,} JSON values")
    if containers > MAX_DEPTH and not _shallow(skeleton):
        raise _depth_error()
    return cost


def _without_strings(raw: bytes) -> bytes:
    """RAW with the contents of its strings removed, so that only its structure is left.

    With escaped backslashes and then escaped quotes taken out (left to
    right, as a JSON reader pairs them), every quote left opens or closes a
    string, and what lies between every other pair of quotes is structure.
    Each step is one C loop; a regex did the same at four times json.loads' cost.
    """
    plain = raw.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in raw else raw
    return b"".join(plain.split(b'"')[::2])


def _counts(data: bytes) -> tuple[int, int]:
    """Upper bounds of the containers in DATA and of its other values (each follows a `,` or `:`, or is the first).

    One pass keeps only the six structural bytes, and the counts run over
    what is left: four `bytes.count` over a whole body cost as much as parsing it.
    """
    structure = data.translate(None, NOT_STRUCTURE)
    return (structure.count(b"{") + structure.count(b"["),
            structure.count(b",") + structure.count(b":") + 1)


def _cost(containers: int, values: int) -> int:
    return CONTAINER_COST * containers + VALUE_COST * values


def _text_cost(text_size: int) -> int:
    # The text is held while it is parsed, and its strings are copied out of it.
    return 2 * text_size


def _shallow(skeleton: bytes) -> bool:
    """Whether the brackets of SKELETON (a body without its strings) pair up within MAX_DEPTH levels.

    Each pass removes the innermost pairs, so a body MAX_DEPTH deep is empty
    after MAX_DEPTH passes; a pass that removes nothing ends the search. A
    removed pair leaves a mark until the pass ends: without it, `{[]}` lost
    both levels in one pass, and lists and objects in turn passed twice as deep.
    """
    brackets = skeleton.translate(None, NOT_BRACKETS)
    for _ in range(MAX_DEPTH):
        inner = brackets.replace(b"[]", b".").replace(b"{}", b".").replace(b".", b"")
        if len(inner) == len(brackets):
            break
        brackets = inner
    return not brackets


def _depth_error() -> ApiError:
    return _bad(f"The request body nests lists and objects more than {MAX_DEPTH} levels deep, or its brackets do "
                "not pair up. Send a flatter body.")


def _too_costly(size: int, cost: int, allowed: int, what: str) -> ApiError:
    return ApiError(413, f"The request body ({size:,} bytes, {what}) would take about {cost // MiB:,} MiB to "
                         f"read, more than this gateway gives one request ({allowed // MiB} MiB: three times the "
                         f"body's size, or {ALLOWANCE // MiB} MiB for a small body). Send fewer, larger values, "
                         "or split the request.", "body_too_complex")
