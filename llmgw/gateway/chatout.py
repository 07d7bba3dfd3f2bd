"""Reading what an engine sends back for a chat request, for the dialects that give it to their clients.

One reader for every dialect (llmgw/gateway/responsesout.py, messages.py),
so that an engine's odd answer meets the same tolerance whichever API the
client speaks. An engine is a program the gateway does not control: each
reader here takes whatever JSON came and gives the type its caller expects,
so that the engine's mistake costs at most its own answer (a text left out,
a count of 0, a call's arguments as {}), never the worker. A whole answer that
cannot be read at all is a 502 in the client's API (`whole`); an engine that
reports an error mid-stream ends the client's stream with one (`stream_error`).

A stream comes as runs of whole server-sent events: llmgw/gateway/sse.py's
EventRelay cuts the engine's bytes at event boundaries before a translator
sees them.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Iterator, NamedTuple

from llmgw.gateway import metering
from llmgw.gateway.errors import ApiError

log = logging.getLogger("llmgw.chatout")

# The data of the engine's last event (sse.DONE is that event whole).
DONE_DATA = b"[DONE]"


def new_id(prefix: str) -> str:
    return prefix + os.urandom(12).hex()


# --- types ----------------------------------------------------------------------------------------


def a_list(value) -> list:
    return value if isinstance(value, list) else []


def a_dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def a_string(value) -> str:
    return value if isinstance(value, str) else ""


def a_count(value) -> int:
    """VALUE as a client is shown it: a count an engine can have made (metering.count), else 0; a hostile
    engine's -5 once reached a Messages client as input_tokens."""
    return metering.count(value) or 0


def reasoning(fields: dict) -> str:
    """The reasoning in a message or a delta: vLLM and llama.cpp say reasoning_content, others reasoning."""
    return a_string(fields.get("reasoning_content") or fields.get("reasoning"))


class Call(NamedTuple):
    """A tool call, or a streamed piece of one: a piece's index says which call it belongs to."""

    index: int
    id: str
    name: str
    arguments: str


def call(value: dict) -> Call:
    """VALUE, a chat tool call (or a piece of one), with each field of the type it must be: an index that
    is not a whole number counts as 0, as the engines that leave it out mean their one call."""
    index = value.get("index", 0)
    function = a_dict(value.get("function"))
    return Call(index if isinstance(index, int) and not isinstance(index, bool) else 0, a_string(value.get("id")),
                a_string(function.get("name")), a_string(function.get("arguments")))


def arguments(text: str) -> dict | None:
    """A call's arguments as the object they are; {} for none, None where they are not a JSON object
    (a small model's malformed JSON)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class Usage(NamedTuple):
    """An engine's chat usage as whole numbers: 0 where it gave none, or not a number; `cached` None
    where it did not say."""

    prompt: int
    completion: int
    cached: int | None
    reasoning: int


def usage(value) -> Usage | None:
    """VALUE, a chat usage object, read; None where it is not one (an engine that sent no usage)."""
    if not isinstance(value, dict):
        return None
    cached = a_dict(value.get("prompt_tokens_details")).get("cached_tokens")
    return Usage(a_count(value.get("prompt_tokens")), a_count(value.get("completion_tokens")),
                 cached if isinstance(cached, int) and not isinstance(cached, bool) else None,
                 a_count(a_dict(value.get("completion_tokens_details")).get("reasoning_tokens")))


# --- a whole answer -------------------------------------------------------------------------------


class Answer(NamedTuple):
    """A whole chat answer's first choice: its message, why it ended, the stop string vLLM says it met
    (`stop_reason`), and the answer's usage object as it came."""

    message: dict
    finish: str | None
    matched: object
    usage: object


def whole(data: bytes) -> Answer:
    """DATA, an engine's whole (2xx) chat answer, read; raises ApiError(502) where it is not one (not
    JSON, or no choice with a message): the client gets its API's error, and the log the engine's words."""
    try:
        chat = json.loads(data)
        choice = chat["choices"][0]
        message = choice["message"]
        if not isinstance(message, dict):
            raise TypeError("the message is not an object")
        finish = choice.get("finish_reason")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        log.warning("an engine's chat answer could not be read as one: %s", data[:300].decode("utf-8", "replace"))
        raise ApiError(502, "The engine's answer could not be read. Try again; an operator can find it in the "
                            "gateway's log under the request id.", "upstream_error") from None
    return Answer(message, finish if isinstance(finish, str) else None, choice.get("stop_reason"), chat.get("usage"))


# --- a stream -------------------------------------------------------------------------------------


def chunks(events: bytes) -> Iterator[dict | None]:
    """Each event's JSON object in EVENTS (whole events), None for `[DONE]`. Data that is not a JSON
    object is skipped, as a chat client would skip it; an event of several data lines is their data
    joined, as server-sent events are read."""
    for event in events.split(b"\n\n"):
        if b"data:" not in event:
            continue  # a comment, or the empty tail
        lines = [line[5:] for line in event.split(b"\n") if line.startswith(b"data:")]
        data = lines[0] if len(lines) == 1 else b"\n".join(lines)
        if data.strip() == DONE_DATA:
            yield None
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            continue
        if isinstance(chunk, dict):
            yield chunk


def stream_error(chunk: dict) -> ApiError | None:
    """The client's error for CHUNK where it is the engine's report of a failure mid-stream, else None.
    The engine's words go to the log only: they may name its host or quote the request."""
    if chunk.get("error") is None:
        return None
    log.warning("an engine sent an error mid-stream: %.300s", json.dumps(chunk.get("error"), ensure_ascii=False))
    return ApiError(502, "The engine failed while answering. Try again; an operator can find its words in the "
                         "gateway's log under the request id.", "upstream_error")


def deltas(chunk: dict) -> Iterator[tuple[dict, dict]]:
    """(choice, its delta) for CHUNK's first choice: the other APIs have one answer, and the requests made
    for them ask for one."""
    for choice in a_list(chunk.get("choices")):
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            yield choice, a_dict(choice.get("delta"))
