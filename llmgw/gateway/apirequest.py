"""Reading an OpenAI request body: check what routing and metering depend on, forward the rest.

The gateway is not the engine's validator: fields it does not use pass
through untouched, and the engine answers for them. What it does check is what
it acts on (the model, streaming, usage, limits on tokens and temperature) and
the body's shape, so that a wrong type earns a clear 400 here rather than a
confusing error, or a crash, further on. The body is re-encoded only when the
gateway must change it (an alias resolved to the engine's name, usage asked for
in a stream); otherwise the client's bytes are sent on as they came.
"""

from __future__ import annotations

import json

from llmgw.gateway.errors import ApiError

KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request", param)


def _check(body: dict, name: str, types: tuple, what: str) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) and bool not in types:
        raise _bad(f"{name} must be {what}, not a boolean.", name)
    if not isinstance(value, types):
        raise _bad(f"{name} must be {what}, not {type(value).__name__}.", name)


class ParsedRequest:
    __slots__ = ("kind", "body", "raw", "model", "stream", "client_wants_usage", "max_tokens", "prompt_text")

    def __init__(self, kind: str, body: dict, raw: bytes):
        self.kind = kind
        self.body = body
        self.raw = raw
        self.model: str = body["model"]
        self.stream: bool = bool(body.get("stream"))
        options = body.get("stream_options") or {}
        self.client_wants_usage: bool = bool(options.get("include_usage"))
        self.max_tokens: int | None = body.get("max_completion_tokens", body.get("max_tokens"))
        self.prompt_text: bytes = b""

    def upstream_body(self, served_name: str) -> bytes:
        """The bytes to send the engine: the client's own unless something must change.

        Streams always ask the engine for usage, so that every request is
        metered; the usage event is dropped on the way back when the client
        did not ask for it.
        """
        changes = {}
        if served_name != self.model:
            changes["model"] = served_name
        if self.stream and self.kind != "embeddings" and not self.client_wants_usage:
            options = dict(self.body.get("stream_options") or {})
            options["include_usage"] = True
            changes["stream_options"] = options
        if not changes:
            return self.raw
        return json.dumps({**self.body, **changes}, ensure_ascii=False).encode()


def _affinity_text(messages: list) -> bytes:
    """What decides which replica's prompt cache a chat belongs to: its first message.

    The first message (a system prompt, or the opening of a conversation) is
    what stays the same across every turn of a conversation and across every
    request of an application, so keying on it keeps both on the replica that
    has it cached. Keying on more would move a conversation at each turn.
    """
    content = messages[0].get("content")
    if isinstance(content, list):
        content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content.encode("utf-8", "surrogatepass") if isinstance(content, str) else b""


def parse(kind: str, raw: bytes, prefix_bytes: int) -> ParsedRequest:
    """Check RAW as a request of KIND; raises ApiError(400) with the field at fault."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(f"The request body is not valid JSON ({e}). Send a JSON object with Content-Type: application/json.") from None
    if not isinstance(body, dict):
        raise _bad(f"The request body must be a JSON object, not a JSON {type(body).__name__}.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model is required: the name of a model, as `GET /v1/models` lists them.", "model")
    _check(body, "stream", (bool,), "true or false")
    _check(body, "stream_options", (dict,), "an object")
    if isinstance(body.get("stream_options"), dict):
        _check(body["stream_options"], "include_usage", (bool,), "true or false")
    for name in ("max_tokens", "max_completion_tokens", "n"):
        _check(body, name, (int,), "a whole number")
        if body.get(name) is not None and body[name] < 1:
            raise _bad(f"{name} must be at least 1.", name)
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        _check(body, name, (int, float), "a number")
    temperature = body.get("temperature")
    if temperature is not None and not 0 <= temperature <= 2:
        raise _bad(f"temperature must be between 0 and 2, not {temperature}.", "temperature")

    parsed = ParsedRequest(kind, body, raw)
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages must be a non-empty list of {role, content} objects.", "messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise _bad(f"messages[{i}] must be an object with a string role.", "messages")
            content = message.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise _bad(f"messages[{i}].content must be a string or a list of parts.", "messages")
        if prefix_bytes:
            parsed.prompt_text = _affinity_text(messages)[:prefix_bytes]
    elif kind == "completions":
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
            raise _bad("prompt must be a string or a non-empty list.", "prompt")
        if prefix_bytes and isinstance(prompt, str):
            parsed.prompt_text = prompt[:prefix_bytes].encode("utf-8", "surrogatepass")
    else:
        value = body.get("input")
        if not isinstance(value, (str, list)) or (isinstance(value, list) and not value):
            raise _bad("input must be a string or a non-empty list.", "input")
        if body.get("stream"):
            raise _bad("Embeddings cannot be streamed; leave stream out.", "stream")
    return parsed


def usage_of(body: bytes) -> dict | None:
    """The `usage` object of a whole JSON answer, found without parsing the rest
    (an embeddings answer can be megabytes of numbers before it)."""
    pos = body.rfind(b'"usage"')
    if pos < 0:
        return None
    colon = body.find(b":", pos + 7)
    if colon < 0:
        return None
    try:
        # The object is small; decoding only what can hold it keeps this cheap.
        text = body[colon + 1:colon + 4097].decode("utf-8", "replace").lstrip()
        value, _ = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
