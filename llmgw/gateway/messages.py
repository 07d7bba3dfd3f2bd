"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), the one Claude Code speaks.

A Messages request is read into a chat-completions request (system prompt,
text, images, tool use and tool results, tools, sampling) and takes the path
every request takes; the engine's answer, whole or streamed, and every error
come back in Anthropic's shapes, as the `anthropic` SDK parses them. Fields
that mean nothing on a local engine (metadata, thinking, service_tier,
container, mcp_servers, context_management, output_config, and whatever
beta field a client adds) are accepted and ignored, as are the
`anthropic-version` and `anthropic-beta` headers: a client that names a
newer beta must not be refused for it (Claude Code retries a 400 dropping
one beta at a time, six requests, before it gives up). A refusal that the
same request would meet again carries `x-should-retry: false`, which the
SDKs and Claude Code obey; without it Claude Code retries a 401 ten times.

`max_tokens` is required, as Anthropic requires it, and a value above the
model's limit is cut to it rather than refused: Claude Code sends its own
ceiling (32,000) whatever the model, and the answer's `stop_reason:
max_tokens` says when the cut was reached.

Choices made where the two APIs differ (docs/clients/sdks.md has
the client's view):
- Anthropic's server tools (a `type` other than `custom`: web_search, bash,
  text_editor, ...) have no schema to give a local model; they are left out
  and the log says which.
- `thinking` and `redacted_thinking` blocks are dropped from the history:
  their signatures mean nothing to another model. Reasoning an engine streams
  (`reasoning_content`) is not passed on as thinking blocks, which would need
  Anthropic's signatures.
- A `system` message inside `messages` (Claude Code sends its environment
  so) stays where it is, as a chat system message.
- A stream's `message_start` must carry `input_tokens`, but an engine counts
  the prompt only at the end of its answer: message_start carries an
  estimate (the translated request's bytes over four, `promptcount.estimate`),
  and `message_delta` carries the engine's count, which the SDK puts in the
  final message's usage.
- An engine that fails mid-stream (its connection cut, or an error event)
  ends the stream with Anthropic's `error` event; a whole answer that cannot
  be read is a 502 in Anthropic's shape. What the engine sent is read with
  llmgw/gateway/chatout.py, as the Responses API's is.
"""

from __future__ import annotations

import json
import logging

from llmgw.gateway import apirequest, bodycheck, chatout, promptcount, requestid
from llmgw.gateway.bodycheck import bad, need
from llmgw.gateway.chatout import a_list, new_id
from llmgw.gateway.dialect import Dialect, StreamTranslator, chat_content, encode
from llmgw.gateway.errors import ApiError

log = logging.getLogger("llmgw.messages")

# Anthropic's error types by HTTP status (its API reference, "Errors"); other 4xx are invalid_request_error.
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               502: "api_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}
# The refusals a client may meet again with the same request: a timeout, a conflict, a limit.
RETRIED = (408, 409, 429)
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use",
                "content_filter": "refusal"}
ROLES = ("user", "assistant", "system")
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's type: chat's tool_choice
# Sampling fields with the same name and meaning in both APIs (top_k: llama.cpp and vLLM read it in a chat).
SAMPLING = {"temperature": "a number", "top_p": "a number", "top_k": "a whole number"}


# --- the request ---------------------------------------------------------------------


def _text(blocks, param: str) -> str:
    """A string, or a list of text blocks (a system prompt, a tool's result), as one text."""
    if isinstance(blocks, str):
        return blocks
    need(blocks, (list,), "a string or a list of text blocks", param)
    texts = []
    for i, block in enumerate(blocks):
        where = f"{param}[{i}]"
        need(block, (dict,), "a text block", where)
        if block.get("type") != "text":
            raise bad(f'{where}.type must be "text" here, not {str(block.get("type"))[:40]!r}.', f"{where}.type")
        bodycheck.STRING(block.get("text"), f"{where}.text")
        texts.append(block["text"])
    return "\n".join(texts)


def _image(block: dict, param: str) -> dict:
    source = block.get("source")
    need(source, (dict,), "an object with a type (base64 or url)", f"{param}.source")
    if source.get("type") == "base64":
        bodycheck.STRING(source.get("media_type"), f"{param}.source.media_type")
        bodycheck.STRING(source.get("data"), f"{param}.source.data")
        url = f"data:{source['media_type']};base64,{source['data']}"
    elif source.get("type") == "url":
        bodycheck.STRING(source.get("url"), f"{param}.source.url")
        url = source["url"]
    else:
        raise bad(f'{param}.source.type must be "base64" or "url"; this gateway takes no file ids.',
                  f"{param}.source.type")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result(block: dict, param: str) -> dict:
    bodycheck.STRING(block.get("tool_use_id"), f"{param}.tool_use_id")
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        need(content, (list,), "a string or a list of blocks", f"{param}.content")
        texts = []
        for j, part in enumerate(content):
            need(part, (dict,), "a block", f"{param}.content[{j}]")
            if part.get("type") == "text":
                bodycheck.STRING(part.get("text"), f"{param}.content[{j}].text")
                texts.append(part["text"])
            else:
                # A chat tool message carries text only; the model is told something was there.
                texts.append(f"[a {str(part.get('type'))[:40]} block the tool returned is not shown]")
        text = "\n".join(texts)
    if block.get("is_error"):
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _message(message, param: str) -> list[dict]:
    """One Messages message as chat messages: a user's tool results become `tool` messages before the rest."""
    need(message, (dict,), "an object with a role and content", param)
    role = message.get("role")
    if role not in ROLES:
        raise bad(f"{param}.role is {str(role)[:40]!r}; a role is user, assistant or system.", f"{param}.role")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    need(content, (list,), "a string or a list of content blocks", f"{param}.content")
    if role == "system":
        return [{"role": "system", "content": _text(content, f"{param}.content")}]
    parts, calls, results = [], [], []
    for j, block in enumerate(content):
        where = f"{param}.content[{j}]"
        need(block, (dict,), "a content block with a type", where)
        kind = block.get("type")
        if kind == "text":
            bodycheck.STRING(block.get("text"), f"{where}.text")
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user":
            parts.append(_image(block, where))
        elif kind == "tool_use" and role == "assistant":
            bodycheck.STRING(block.get("id"), f"{where}.id")
            bodycheck.STRING(block.get("name"), f"{where}.name")
            need(block.get("input"), (dict,), "an object", f"{where}.input")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"],
                                       "arguments": json.dumps(block["input"], ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, where))
        elif kind in ("thinking", "redacted_thinking"):
            continue  # signed for Anthropic's models; nothing another model can read
        else:
            raise bad(f"{where}.type is {str(kind)[:40]!r}, which this gateway does not take in a {role} message. "
                      "It takes text, image and tool_result blocks from the user, text and tool_use blocks "
                      "from the assistant.", f"{where}.type")
    out = results
    if role == "assistant":
        text = "".join(p["text"] for p in parts)
        if calls:
            out.append({"role": "assistant", "content": text or None, "tool_calls": calls})
        else:
            out.append({"role": "assistant", "content": text})
    elif parts:
        out.append({"role": "user", "content": chat_content(parts)})
    return out


def _tools(tools, param: str) -> list[dict]:
    need(tools, (list,), "a list of tools", param)
    functions, left_out = [], []
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        need(tool, (dict,), "a tool object", where)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            left_out.append(str(kind)[:40])
            continue
        bodycheck.STRING(tool.get("name"), f"{where}.name")
        need(tool.get("input_schema"), (dict,), "an object (a JSON schema)", f"{where}.input_schema")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            bodycheck.STRING(tool["description"], f"{where}.description")
            function["description"] = tool["description"]
        functions.append({"type": "function", "function": function})
    if left_out:
        log.info("left out Anthropic server tools a local model cannot run: %s", ", ".join(left_out))
    return functions


def _tool_choice(choice, param: str) -> tuple[object, bool]:
    """(chat tool_choice, whether parallel calls are allowed)."""
    need(choice, (dict,), 'an object such as {"type": "auto"}', param)
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use")
    if kind == "tool":
        bodycheck.STRING(choice.get("name"), f"{param}.name")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    mapped = TOOL_CHOICES.get(kind) if isinstance(kind, str) else None
    if mapped is None:
        raise bad(f'{param}.type is {str(kind)[:40]!r}; it is one of "auto", "any", "tool" or "none".',
                  f"{param}.type")
    return mapped, parallel


def to_chat(body: dict, needs_limit: bool) -> dict:
    """BODY, a Messages request, as a chat-completions request; raises ApiError(400) naming the field at fault."""
    bodycheck.check_model(body.get("model"))
    chat: dict = {"model": body["model"]}
    limit = body.get("max_tokens")
    if limit is None:
        if needs_limit:
            raise bad("max_tokens is required: the most tokens the answer may have, such as 1024.", "max_tokens")
    else:
        bodycheck.COUNT(limit, "max_tokens")
        chat["max_tokens"] = limit
    messages = []
    system = body.get("system")
    if system is not None and (text := _text(system, "system")):
        messages.append({"role": "system", "content": text})
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise bad("messages must be a non-empty list of {role, content} objects.", "messages")
    for i, message in enumerate(given):
        messages.extend(_message(message, f"messages[{i}]"))
    chat["messages"] = messages
    if body.get("tools") is not None and (tools := _tools(body["tools"], "tools")):
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        choice, parallel = _tool_choice(body["tool_choice"], "tool_choice")
        # A named tool goes on even with none offered, to be refused (llmgw/gateway/apirequest.py): dropped,
        # the call the client forced would silently have become text.
        if "tools" in chat or choice == "none" or isinstance(choice, dict):
            chat["tool_choice"] = choice
        if not parallel:
            chat["parallel_tool_calls"] = False
    if body.get("stop_sequences") is not None:
        stops = body["stop_sequences"]
        need(stops, (list,), "a list of strings", "stop_sequences")
        for i, stop in enumerate(stops):
            bodycheck.STRING(stop, f"stop_sequences[{i}]")
        if stops:
            chat["stop"] = stops
    for name, what in SAMPLING.items():
        if body.get(name) is not None:
            need(body[name], (int,) if name == "top_k" else (int, float), what, name)
            chat[name] = body[name]
    if body.get("stream") is not None:
        need(body["stream"], (bool,), "true or false", "stream")
        if body["stream"]:
            # Usage always: the client's message_delta carries it, and every request is metered.
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
    return chat


class MessagesRequest(apirequest.ParsedRequest):
    """A chat request read from a Messages request; `stop_sequences` names what a `stop` finish matched."""

    __slots__ = ("stop_sequences",)

    def __init__(self, kind: str, body: dict, raw: bytes):
        super().__init__(kind, body, raw)
        self.stop_sequences: list[str] = body.get("stop") or []


# --- the answer -------------------------------------------------------------------------


def _usage(value) -> dict:
    """An engine's chat usage (VALUE) as Anthropic's: prompt tokens the engine read from its cache are cache
    reads; 0s where the engine sent none.

    cache_creation_input_tokens is 0, a true figure: nothing here charges for writing a cache.
    """
    used = chatout.usage(value) or chatout.Usage(0, 0, None, 0)
    out = {"input_tokens": used.prompt, "output_tokens": used.completion, "cache_creation_input_tokens": 0}
    if used.cached is not None and 0 <= used.cached <= used.prompt:
        out["input_tokens"] = used.prompt - used.cached
        out["cache_read_input_tokens"] = used.cached
    return out


def _stop(req: MessagesRequest, finish: str | None, matched) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for an engine's FINISH; MATCHED is the stop string vLLM says it met."""
    if finish == "stop" and isinstance(matched, str) and matched in req.stop_sequences:
        return "stop_sequence", matched
    return STOP_REASONS.get(finish, "end_turn"), None


def _input(arguments: str) -> dict:
    """A call's arguments as the object Anthropic's `input` is; a model's malformed JSON becomes {}."""
    value = chatout.arguments(arguments)
    if value is None:
        log.info("a tool call's arguments were not a JSON object; sent as {}: %.200s", arguments)
        return {}
    return value


def answer(req: MessagesRequest, data: bytes) -> bytes:
    """A whole chat answer as a Messages answer; raises ApiError(502) for one that cannot be read."""
    whole = chatout.whole(data)
    content = []
    if text := chatout.a_string(whole.message.get("content")):
        content.append({"type": "text", "text": text})
    calls = [chatout.call(value) for value in a_list(whole.message.get("tool_calls")) if isinstance(value, dict)]
    for call in calls:
        content.append({"type": "tool_use", "id": call.id or new_id("toolu_"), "name": call.name,
                        "input": _input(call.arguments)})
    stop_reason, sequence = _stop(req, whole.finish, whole.matched)
    if calls:
        stop_reason = "tool_use"
    return encode({"id": new_id("msg_"), "type": "message", "role": "assistant", "model": req.model,
                   "content": content, "stop_reason": stop_reason, "stop_sequence": sequence,
                   "usage": _usage(whole.usage)})


def event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: ".encode() + encode(data) + b"\n\n"


class Stream(StreamTranslator):
    """A chat stream as Messages events: message_start, blocks started, filled and stopped one after another,
    message_delta, message_stop; or, where the engine fails mid-way, an `error` event last, as Anthropic's
    API ends a stream it cannot finish.

    Every delta belongs to a block started before it and stopped after it
    (Claude Code fails with "Content block not found" otherwise), and blocks
    never overlap. Text streams as it comes until the first tool call; text
    an engine sends after a call has begun is held and given as a last text
    block, so that a call's arguments, which may arrive in many pieces, always
    fill one open block. A call's block starts once its name is known (a
    tool_use block carries it) and every call begun before it has started:
    until then its pieces are kept, so that a name arriving late is not lost.
    """

    def __init__(self, req: MessagesRequest):
        self.req = req
        self.started = False
        self.finished = False  # the stream ended with an error event: nothing more goes out
        self.index = -1  # the block open now, or the last one
        self.open: str | None = None  # "text" or "tool_use" while a block is open
        self.calls: dict[int, int] = {}  # the engine's tool call index -> its block (started)
        # Calls not started yet, in the order they began: index -> {id, name, arguments}.
        self.pending: dict[int, dict] = {}
        self.call: int | None = None  # the engine's index of the call whose block is open
        self.held: list[str] = []  # text after a call began
        self.finish: str | None = None
        self.matched = None
        self.usage: dict | None = None

    def _start(self) -> bytes:
        self.started = True
        message = {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": self.req.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": promptcount.estimate(self.req.raw), "output_tokens": 0}}
        return event("message_start", {"type": "message_start", "message": message}) + \
            event("ping", {"type": "ping"})

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        self.call = None
        return event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _open(self, block: dict) -> bytes:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                   "content_block": block})

    def _text(self, text: str) -> bytes:
        if self.calls or self.pending:
            self.held.append(text)
            return b""
        out = b"" if self.open == "text" else self._open({"type": "text", "text": ""})
        return out + event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": {"type": "text_delta", "text": text}})

    def _arguments(self, fragment: str) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                             "delta": {"type": "input_json_delta", "partial_json": fragment}})

    def _tool_call(self, piece: chatout.Call) -> bytes:
        if piece.index == self.call:
            return self._arguments(piece.arguments) if piece.arguments else b""
        if piece.index in self.calls:
            # Calls come one after another from every engine seen; a piece of one already stopped has no block.
            log.warning("dropped a piece of tool call %s that came after the next call began", piece.index)
            return b""
        pending = self.pending.setdefault(piece.index, {"id": "", "name": "", "arguments": []})
        pending["id"] = pending["id"] or piece.id
        pending["name"] = pending["name"] or piece.name
        pending["arguments"].append(piece.arguments)
        return self._begin_calls(until_nameless=True)

    def _begin_calls(self, until_nameless: bool) -> bytes:
        """Start the pending calls in the order they began, up to the first whose name has not come (all
        of them, those nameless, at the end: their arguments are not lost)."""
        out = []
        while self.pending:
            index, pending = next(iter(self.pending.items()))
            if until_nameless and not pending["name"]:
                break
            del self.pending[index]
            out.append(self._open({"type": "tool_use", "id": pending["id"] or new_id("toolu_"),
                                   "name": pending["name"], "input": {}}))
            self.calls[index] = self.index
            self.call = index
            if arguments := "".join(pending["arguments"]):
                out.append(self._arguments(arguments))
        return b"".join(out)

    def feed(self, events: bytes) -> bytes:
        out = [] if self.started else [self._start()]
        for chunk in chatout.chunks(events):
            if self.finished:
                break
            if chunk is None:
                continue  # [DONE]: `end` closes the message
            if (error := chatout.stream_error(chunk)) is not None:
                out.append(self.fail(error))
                break
            if isinstance(chunk.get("usage"), dict):
                self.usage = chunk["usage"]
            for choice, delta in chatout.deltas(chunk):
                if text := chatout.a_string(delta.get("content")):
                    out.append(self._text(text))
                for piece in a_list(delta.get("tool_calls")):
                    if isinstance(piece, dict):
                        out.append(self._tool_call(chatout.call(piece)))
                if isinstance(choice.get("finish_reason"), str):
                    self.finish = choice["finish_reason"]
                    self.matched = choice.get("stop_reason")
        return b"".join(out)

    def end(self) -> bytes:
        if self.finished:
            return b""
        out = [b"" if self.started else self._start(), self._begin_calls(until_nameless=False)]
        if self.held:
            out.append(self._open({"type": "text", "text": ""}))
            out.append(event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                     "delta": {"type": "text_delta", "text": "".join(self.held)}}))
        out.append(self._close())
        stop_reason, sequence = _stop(self.req, self.finish, self.matched)
        if self.calls:
            stop_reason = "tool_use"
        out.append(event("message_delta", {"type": "message_delta",
                                           "delta": {"stop_reason": stop_reason, "stop_sequence": sequence},
                                           "usage": _usage(self.usage)}))
        out.append(event("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def fail(self, e: ApiError) -> bytes:
        if self.finished:
            return b""
        self.finished = True
        self.failure = e
        return error_event(e)


# --- errors -----------------------------------------------------------------------------


def error_body(e: ApiError) -> bytes:
    """E in Anthropic's shape; the message ends with the request id, as on every other route."""
    rid = requestid.current.get()
    payload = {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "invalid_request_error"
                                                                  if e.status < 500 else "api_error"),
                                          "message": e.payload()["error"]["message"]}}
    if rid is not None:
        payload["request_id"] = rid
    return json.dumps(payload).encode()


def error_event(e: ApiError) -> bytes:
    return b"event: error\ndata: " + error_body(e) + b"\n\n"


class Messages(Dialect):
    name = "messages"

    def credential(self, environ) -> str | None:
        key = environ.get("HTTP_X_API_KEY")
        return f"Bearer {key}" if key else environ.get("HTTP_AUTHORIZATION")

    def parse(self, kind: str, raw: bytes, prefix_bytes: int) -> MessagesRequest:
        chat = to_chat(apirequest.read_object(raw), needs_limit=kind == "chat")
        req = apirequest.checked("chat", chat, encode(chat), prefix_bytes, MessagesRequest)
        req.kind = kind
        req.api = self.name if kind == "chat" else f"{self.name}.count_tokens"
        req.output_field = "max_tokens"
        req.clamp_output = True
        return req

    def error(self, e: ApiError) -> tuple[bytes, list[tuple[str, str]]]:
        body = error_body(e)
        headers = e.headers(body)
        if e.status < 500 and e.status not in RETRIED:
            # Claude Code retries 401s, like 429s and 500s, ten times over three minutes unless told not to.
            headers.append(("x-should-retry", "false"))
        return body, headers

    def shape(self, req: MessagesRequest, data: bytes) -> bytes:
        return answer(req, data)

    def translator(self, req: MessagesRequest) -> Stream:
        return Stream(req)

    def stream_error(self, req, e: ApiError) -> bytes:
        return error_event(e)

    def tokens(self, req, count: int) -> bytes:
        return json.dumps({"input_tokens": count}).encode()


MESSAGES = Messages()
