"""The client APIs the gateway speaks, and how each maps onto what engines serve.

Engines speak OpenAI's chat completions (and completions, embeddings).
Clients also speak other APIs over the same models: Codex only the Responses
API, Claude Code only Anthropic's Messages API. A dialect is one such API: it
reads its request into a chat-completions request, which then takes the one
path every request takes (keys, limits, admission, routing, metering, usage),
and turns the engine's answer, whole or streamed, and every error, back into
its own shape. Translating at the edge keeps one pipeline: a limit, a metric
or a fix to routing holds for every API at once.

`OpenAI` is the dialect of the routes engines serve themselves: nothing is
translated, and a stream's bytes go out as the engine sent them, but for one
thing every dialect shares: a request whose tool_choice named a function was
sent as a request for that function's arguments (llmgw/gateway/apirequest.py),
and what the engine wrote is made a call of that function here, whole or
streamed, before the dialect reads it as any other chat answer.
"""

from __future__ import annotations

import json

from llmgw.gateway import apirequest
from llmgw.gateway.chatout import a_list, a_string
from llmgw.gateway.errors import ApiError
from llmgw.gateway.sse import DONE


def encode(value) -> bytes:
    """VALUE as JSON bytes, for the engine or the client, each dialect alike: characters as themselves
    rather than escaped, except a lone surrogate, which JSON allows and UTF-8 cannot hold: it goes as the
    `\\uXXXX` escape it came in, so the engine gets what a chat client's same text would send it and the
    bytes stay UTF-8. (json.dumps writes characters only inside string literals, where that escape is valid.)"""
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "backslashreplace")


def chat_content(parts: list[dict]):
    """A translated message's chat content parts as its content: text alone as one string, which every
    engine's chat template reads alike (and metering counts); the parts where an image is among them."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


class Dialect:
    """One client API. `name` is what usage rows record as the request's endpoint."""

    name = "openai"

    def credential(self, environ) -> str | None:
        """The `Authorization` header value to check, as `Bearer KEY`."""
        return environ.get("HTTP_AUTHORIZATION")

    def parse(self, kind: str, raw: bytes, prefix_bytes: int) -> apirequest.ParsedRequest:
        """RAW, this API's request body, as the request sent to the engine; raises ApiError."""
        return apirequest.parse(kind, raw, prefix_bytes)

    def error(self, e: ApiError) -> tuple[bytes, list[tuple[str, str]]]:
        """E as this API's error body, with its headers."""
        body = e.body()
        return body, e.headers(body)

    def answer(self, req: apirequest.ParsedRequest, data: bytes) -> bytes:
        """A whole (2xx) chat answer DATA from the engine, in this API's shape."""
        if req.forced_tool is not None:
            data = forced_answer(data, req.forced_tool["name"], req.forced_call_id)
        return self.shape(req, data)

    def stream(self, req: apirequest.ParsedRequest) -> StreamTranslator | None:
        """What turns the engine's events into this API's; None where they go out as they are."""
        translator = self.translator(req)
        if req.forced_tool is not None:
            return ForcedCall(req.forced_tool["name"], translator, req.forced_call_id)
        return translator

    def shape(self, req: apirequest.ParsedRequest, data: bytes) -> bytes:
        """A whole chat answer DATA, a forced call already made one, in this API's shape."""
        return data

    def translator(self, req: apirequest.ParsedRequest) -> StreamTranslator | None:
        """What turns chat events, a forced call already made one, into this API's; None: they go out as
        they are."""
        return None

    def tokens(self, req: apirequest.ParsedRequest, count: int) -> bytes:
        """The answer to REQ, a route of kind "tokens": how many tokens its prompt is (COUNT)."""
        raise NotImplementedError

    def stream_error(self, req: apirequest.ParsedRequest, e: ApiError) -> bytes:
        """The events that end REQ's stream with E before the engine sent any (it was held while its model
        loaded); REQ is there for an API whose error events describe the request (the Responses API's)."""
        return e.sse_event() + DONE


class StreamTranslator:
    """Whole chat-completions events in (usage events included), this API's events out. `failure` is the
    error a stream was ended with (`fail`), which its usage row records."""

    failure: ApiError | None = None

    def feed(self, events: bytes) -> bytes:
        raise NotImplementedError

    def end(self) -> bytes:
        """What follows the engine's last event (its `[DONE]` included, which `feed` had)."""
        return b""

    def fail(self, e: ApiError) -> bytes:
        """The events that end the stream with E after the engine failed mid-way."""
        raise NotImplementedError


def _call(name: str, arguments: str, call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _finish(choice: dict) -> None:
    # The message holds a call, as "tool_calls" says (OpenAI says "stop" for a named choice; Anthropic's
    # stop_reason, "tool_use", is read from this). "length" stays: the arguments were cut short.
    if choice.get("finish_reason") == "stop":
        choice["finish_reason"] = "tool_calls"


def forced_answer(data: bytes, name: str, call_id: str) -> bytes:
    """DATA, a whole chat answer whose text is the arguments of a call of NAME, with each choice's text
    made that call, CALL_ID (the request's: a kept conversation keeps the id its client was given); DATA
    as it came where it is no chat answer (the dialect's reader refuses it)."""
    try:
        answer = json.loads(data)
    except ValueError:
        return data
    choices = a_list(answer.get("choices")) if isinstance(answer, dict) else []
    messages = [(c, c["message"]) for c in choices if isinstance(c, dict) and isinstance(c.get("message"), dict)]
    if not messages:
        return data
    for choice, message in messages:
        message["tool_calls"] = [_call(name, a_string(message.get("content")), call_id)]
        message["content"] = None
        _finish(choice)
    return encode(answer)


class ForcedCall(StreamTranslator):
    """A stream whose text is the arguments of a call of one tool, as that call's pieces: the first
    piece of each choice names the tool, as an engine's own streamed call does. INNER, where there is
    one, takes the events so made (a dialect's translator)."""

    def __init__(self, name: str, inner: StreamTranslator | None, call_id: str):
        self.name = name
        self.inner = inner
        self.call_id = call_id
        self.started: set[int] = set()  # the choices whose call has begun

    @property
    def failure(self) -> ApiError | None:
        return self.inner.failure if self.inner is not None else None

    def feed(self, events: bytes) -> bytes:
        out = b"\n\n".join(self._event(event) for event in events.split(b"\n\n"))
        return self.inner.feed(out) if self.inner is not None else out

    def end(self) -> bytes:
        return self.inner.end() if self.inner is not None else b""

    def fail(self, e: ApiError) -> bytes:
        return self.inner.fail(e) if self.inner is not None else e.sse_event() + DONE

    def _event(self, event: bytes) -> bytes:
        """EVENT with its text made call pieces; as it came where it has no choices (a comment, usage,
        `[DONE]`, an error)."""
        if not event.startswith(b"data:"):
            return event
        try:
            chunk = json.loads(event[5:])
        except ValueError:
            return event
        choices = a_list(chunk.get("choices")) if isinstance(chunk, dict) else []
        if not choices:
            return event
        for choice in choices:
            if isinstance(choice, dict) and isinstance(choice.get("delta"), dict):
                self._piece(choice, choice["delta"])
        return b"data: " + encode(chunk)

    def _piece(self, choice: dict, delta: dict) -> None:
        text = a_string(delta.pop("content", None))
        index = choice.get("index", 0)
        which = index if type(index) is int else 0  # an index that is not one counts as the one choice asked for
        # A choice that ends without having begun its call still gets one: the client asked for a call.
        if text or (choice.get("finish_reason") is not None and which not in self.started):
            if which in self.started:
                piece = {"index": 0, "function": {"arguments": text}}
            else:
                self.started.add(which)
                piece = {"index": 0, **_call(self.name, text, self.call_id)}
            delta["tool_calls"] = [piece]
        _finish(choice)


OPENAI = Dialect()
