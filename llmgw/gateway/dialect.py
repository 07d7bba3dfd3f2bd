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
translated, and a stream's bytes go out as the engine sent them.
"""

from __future__ import annotations

import json

from llmgw.gateway import apirequest
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
        return data

    def stream(self, req: apirequest.ParsedRequest) -> StreamTranslator | None:
        """What turns the engine's events into this API's; None where they go out as they are."""
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


OPENAI = Dialect()
