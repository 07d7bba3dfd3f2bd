"""Reading an OpenAI request body: check what engines choke on and what the gateway acts on, forward the rest.

The body is parsed at a bounded cost (llmgw/gateway/jsonbound.py) and its
fields checked for the shapes engines parse (llmgw/gateway/bodycheck.py), so
that a wrong type earns a clear 400 here rather than a 500 from the engine.
Fields the gateway does not know pass through untouched. The body is changed
only when the gateway must (an alias resolved to the engine's name, usage
asked for in a stream, the model's output limit where the request named
none, a tool the client forces the model to call); otherwise the client's
bytes are sent on as they came.

A `tool_choice` naming one function is not sent as it came: llama.cpp reads
only the strings "auto", "none" and "required", and took the object for
"auto" (a warning in its log: a forced call became optional). "required"
with only that tool left would not do either: llama.cpp lets text come
before the call (under a template that shows tools, SmolLM2-135M wrote 400
tokens of text and no call), and with a chat template that has no place for
tools (the starter model's) it leaves the tools out, and "required" with them. Asked instead for an answer in the
function's argument schema (`response_format`, which llama.cpp, vLLM and
SGLang all enforce while decoding), with `tool_choice: "none"` so that the
tools stay in the prompt of a template that shows them, every engine writes
the call's arguments and nothing else; the dialect turns them back into a
call of that tool (llmgw/gateway/dialect.py). That is what vLLM does itself
with a named choice, so a replica of either engine answers alike, and the
gateway, which does not know which engine a replica runs, need not.
"""

from __future__ import annotations

import json

from llmgw.gateway import balancer, bodycheck, chatout, jsonbound
from llmgw.gateway.errors import ApiError

# The engine's path for each kind of request.
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings"}
# The fields that limit an answer's length. Engines disagree on which wins when
# several are set (llama.cpp: n_predict, then max_completion_tokens, then
# max_tokens; vLLM: max_completion_tokens, then max_tokens), so each is held to
# the model's limit, and a null one counts as absent, as the engines take it.
OUTPUT_LIMITS = ("max_tokens", "max_completion_tokens", "n_predict")
_DECODER = json.JSONDecoder()  # made once, not for each answer read


class ParsedRequest:
    __slots__ = ("kind", "api", "dialect", "body", "raw", "model", "stream", "client_wants_usage", "max_tokens",
                 "added_limit", "affinity", "follows", "output_field", "clamp_output", "guard", "forced_tool",
                 "forced_call_id")

    def __init__(self, kind: str, body: dict, raw: bytes):
        self.kind = kind
        self.api = kind  # the API the client spoke, as usage rows record it (a dialect's name where it translated)
        self.dialect = None  # the client's API (llmgw/gateway/dialect.py), set by the proxy
        self.body = body
        self.raw = raw
        self.model: str = body["model"]
        self.stream: bool = bool(body.get("stream"))
        options = body.get("stream_options") or {}
        self.client_wants_usage: bool = bool(options.get("include_usage"))
        # The most this request may generate, whichever field an engine reads.
        self.max_tokens: int | None = max((v for f in OUTPUT_LIMITS if (v := body.get(f)) is not None), default=None)
        self.added_limit: int | None = None  # max_tokens the gateway adds, where the request named no limit
        self.affinity: int | None = None  # the key that ranks replicas for its conversation (balancer.py)
        self.follows = False  # it continues a conversation, whose history a replica may have cached
        # Set by a dialect: the field its client named the output limit in (errors name it), and whether a
        # limit above the model's is cut to it rather than refused (see bound_output).
        self.output_field: str | None = None
        self.clamp_output = False
        self.guard: tuple[str, str | None] | None = None  # the guard's (verdict, categories), llmgw/gateway/guard.py
        self.forced_tool: dict | None = None  # the function tool_choice names (its `function` object), if one
        self.forced_call_id = ""  # the id of the call of it the client is given

    def bound_output(self, model_name: str, max_output: int | None) -> None:
        """Hold the request to its model's MAX_OUTPUT: refuse asking for more, and ask for
        MAX_OUTPUT where the request names no limit (an engine's own default is its whole context).

        A larger ask is refused rather than cut, as the Go gateway does: a client
        that asked for 300 tokens and silently got 64 would read a truncated
        answer as a complete one. A dialect whose API requires a limit (Anthropic's
        `max_tokens`), which clients fill with their own ceiling rather than what
        they need, has it cut instead: its answer says it stopped at the limit.
        """
        if not max_output or self.kind == "embeddings":
            return
        for field in OUTPUT_LIMITS:
            asked = self.body.get(field)
            if asked is not None and asked > max_output and not self.clamp_output:
                shown = self.output_field or field
                raise ApiError(400, f"{shown} is {asked}, but {model_name} allows at most {max_output}. "
                                    f"Ask for {max_output} or fewer.", "max_tokens_too_large", shown)
        if self.max_tokens is None or self.max_tokens > max_output:
            self.max_tokens = self.added_limit = max_output

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
        if self.added_limit is not None:
            # The limit where none was named, and in place of each named one above it (cut, see bound_output).
            named = {field: asked for field in OUTPUT_LIMITS if (asked := self.body.get(field)) is not None}
            if not named:
                changes["max_tokens"] = self.added_limit
            changes.update((field, self.added_limit) for field, asked in named.items() if asked > self.added_limit)
        if self.forced_tool is not None:
            # The client's own response_format, if any, is replaced: a call has no text for it to shape.
            changes["tool_choice"] = "none"
            changes["response_format"] = {"type": "json_schema", "json_schema": {
                "name": self.forced_tool["name"], "schema": self.forced_tool.get("parameters") or {"type": "object"}}}
        if not changes:
            return self.raw
        if not any(name in self.body for name in changes):
            return _prepend(self.raw, changes)
        return json.dumps({**self.body, **changes}, ensure_ascii=False).encode()


def _prepend(raw: bytes, fields: dict) -> bytes:
    """RAW, a JSON object without any of FIELDS, with them added as its first members.

    One copy of the bytes instead of encoding the whole body again: the
    common changes (usage for a stream, a model's output limit) add a field.
    """
    start = raw.index(b"{") + 1
    return b"".join((raw[:start], json.dumps(fields, ensure_ascii=False)[1:-1].encode(), b",", raw[start:]))


def _leading(messages: list, prefix_bytes: int) -> list[bytes]:
    """What names a chat's conversation: the start of each message up to its first user message.

    The system prompt alone names an application, not a conversation: keyed on
    it, every conversation of one application went to one replica and the bound
    sent most elsewhere, where their history was not. The first user message
    tells conversations apart, and every later turn repeats it unchanged.
    """
    pieces = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(p["text"] for p in content if p["type"] == "text")  # bodycheck made each part whole
        # Cut in characters before encoding (as many bytes, for ASCII), so a long message is never copied whole.
        pieces.append(content[:prefix_bytes].encode("utf-8", "surrogatepass") if isinstance(content, str) else b"")
        if message.get("role") == "user":
            break
    return pieces


def _named_tool(body: dict) -> dict:
    """The `function` of the tool BODY's tool_choice names (bodycheck made both well formed); raises
    ApiError(400) where no tool offered has that name. The message names no field of one API: a
    Messages or Responses request's tool_choice came here translated."""
    name = body["tool_choice"]["function"]["name"]
    offered = [tool["function"] for tool in body.get("tools") or ()]
    for function in offered:
        if function["name"] == name:
            return function
    names = ", ".join(repr(f["name"][:60]) for f in offered[:20]) or "none"
    raise bodycheck.bad(f"tool_choice names the tool {name[:60]!r}, but no tool of that name is offered to the model "
                        f"(offered: {names}; tools that run on a provider's own servers are left out here). Name one "
                        "of the tools offered, or leave tool_choice out.", "tool_choice")


def read_object(raw: bytes) -> dict:
    """RAW parsed at a bounded cost as a JSON object; raises ApiError (400, or 413 for a body too costly to parse)."""
    body = jsonbound.loads(raw)
    if not isinstance(body, dict):
        raise bodycheck.bad(f"The request body must be a JSON object, not {bodycheck.JSON_NAMES[type(body)]}.")
    return body


def parse(kind: str, raw: bytes, prefix_bytes: int) -> ParsedRequest:
    """Check RAW as a request of KIND; raises ApiError (400, or 413 for a body too costly to parse) naming the field at fault."""
    return checked(kind, read_object(raw), raw, prefix_bytes)


def checked(kind: str, body: dict, raw: bytes, prefix_bytes: int, make=ParsedRequest) -> ParsedRequest:
    """BODY (RAW parsed) checked as a request of KIND, as a MAKE: ParsedRequest, or a dialect's subclass
    of it that carries what its answer needs (the dialect built BODY from its own request)."""
    bodycheck.check(kind, body)
    parsed = make(kind, body, raw)
    if kind == "chat" and isinstance(body.get("tool_choice"), dict):
        parsed.forced_tool = _named_tool(body)
        parsed.forced_call_id = chatout.new_id("call_")
    if prefix_bytes:
        conversation_key(parsed, prefix_bytes)
    return parsed


def conversation_key(parsed: ParsedRequest, prefix_bytes: int) -> None:
    """Set PARSED's affinity key and whether it follows earlier turns, from its body; again where its
    messages change (a kept conversation's history put before them, llmgw/gateway/threads.py)."""
    body = parsed.body
    if parsed.kind == "chat":
        leading = _leading(body["messages"], prefix_bytes)
        parsed.affinity = balancer.affinity_key(leading)
        # Anything after the first user message is an earlier turn (an answer, a tool's result).
        parsed.follows = len(body["messages"]) > len(leading)
    elif parsed.kind == "completions" and isinstance(body["prompt"], str):
        # A prompt has no turns to tell apart; a shared start (a file being edited, a template) is all it has.
        parsed.affinity = balancer.affinity_key([body["prompt"][:prefix_bytes].encode("utf-8", "surrogatepass")])
        parsed.follows = True


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
        value, _ = _DECODER.raw_decode(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
