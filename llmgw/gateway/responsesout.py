"""The engine's chat answer as a Responses API response: a whole response object, or its typed events.

A stream goes `response.created`, `response.in_progress`, then for each
output item `response.output_item.added`, its deltas, and at the end its
`.done` events and `response.output_item.done`, and last `response.completed`
(`response.incomplete` when the answer stopped at its length limit) carrying
the whole response with its usage; no `[DONE]`, which the Responses API does
not send. Every event is `event: TYPE` and `data:` JSON with the same `type`
and a `sequence_number` counting from 0. Items stay open until the engine's
last event because a chat stream may interleave text and several tool calls,
whose fragments arrive by index, the call's id and name in its first only.
What a free-form tool (custom, local_shell) was given is only known whole: its
input is sent in one delta at the end, when the function's JSON arguments it
travelled in can be read. An engine that fails mid-way ends the stream with
`response.failed`, the error in the response object, as OpenAI's does; a
whole answer that cannot be read is a 502 in OpenAI's error shape. What the
engine sent is read with llmgw/gateway/chatout.py.
"""

from __future__ import annotations

import time

from llmgw.gateway import chatout
from llmgw.gateway.chatout import a_list, new_id
from llmgw.gateway.dialect import StreamTranslator, encode
from llmgw.gateway.errors import ApiError

# Why the chat answer ended, as the Responses API says why a response is incomplete.
INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}
CALL_PREFIXES = {"function": "fc_", "custom": "ctc_", "local_shell": "lsh_"}


def usage(chat_usage) -> dict | None:
    """The engine's chat usage as the Responses API counts it. The details' counts are 0 where the
    engine reports none: the API's schema requires them, and clients read them without checking."""
    used = chatout.usage(chat_usage)
    if used is None:
        return None
    return {"input_tokens": used.prompt, "input_tokens_details": {"cached_tokens": used.cached or 0},
            "output_tokens": used.completion, "output_tokens_details": {"reasoning_tokens": used.reasoning},
            "total_tokens": used.prompt + used.completion}


def response(req, rid: str, created: int, status: str, output: list, used: dict | None,
             finish: str | None = None, error: dict | None = None) -> bytes:
    """The response object, as JSON: what the answer holds, then the request's fields it repeats
    (`req.echo`, encoded once for a request's several response objects)."""
    reason = INCOMPLETE.get(finish or "") if status == "incomplete" else None
    head = {"id": rid, "object": "response", "created_at": created, "status": status, "error": error,
            "incomplete_details": {"reason": reason} if reason else None, "output": output, "usage": used}
    echo = req.echo
    return encode(head)[:-1] + (b"," + echo[1:] if echo != b"{}" else b"}")


def status_of(finish: str | None) -> str:
    return "incomplete" if finish in INCOMPLETE else "completed"


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def call_kind(req, name: str) -> tuple[str, str | None]:
    """(tool type, namespace) of the tool a call of NAME is of; a name no tool has is a function's."""
    return req.tools.get(name, ("function", None))


def call_item(req, item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    """A chat tool call as the item of the tool it calls: a function_call, a custom_tool_call with
    the raw input, or a local_shell_call with its command."""
    kind, namespace = call_kind(req, name)
    if kind == "custom":
        item = {"type": "custom_tool_call", "id": item_id, "call_id": call_id, "name": name,
                "input": _custom_input(arguments)}
    elif kind == "local_shell":
        return {"type": "local_shell_call", "id": item_id, "call_id": call_id, "status": status,
                "action": _shell_action(arguments)}
    else:
        item = {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
                "status": status}
    if namespace is not None:
        item["namespace"] = namespace
    return item


def _custom_input(arguments: str) -> str:
    """A free-form tool's input from the function arguments it travelled in; the arguments themselves
    where the model wrote no such object (a small model may write the input bare)."""
    value = (chatout.arguments(arguments) or {}).get("input")
    return value if isinstance(value, str) else arguments


def _shell_action(arguments: str) -> dict:
    given = chatout.arguments(arguments) or {}
    command = given.get("command")
    action = {"type": "exec", "command": command if isinstance(command, list) else [], "env": {}}
    if isinstance(given.get("workdir"), str):
        action["working_directory"] = given["workdir"]
    if isinstance(given.get("timeout_ms"), int):
        action["timeout_ms"] = given["timeout_ms"]
    return action


def failure(e: ApiError) -> dict:
    """E as a response's `error`: OpenAI's codes are few, and the message (with the request id) says the rest."""
    return {"code": "rate_limit_exceeded" if e.status == 429 else "server_error",
            "message": e.payload()["error"]["message"]}


def answer(req, data: bytes) -> bytes:
    """A whole chat answer DATA as the response object; raises ApiError(502) for one that cannot be read."""
    whole = chatout.whole(data)
    status = status_of(whole.finish)
    item_status = "incomplete" if status == "incomplete" else "completed"
    output = []
    if reasoning := chatout.reasoning(whole.message):
        output.append(reasoning_item(new_id("rs_"), reasoning, item_status))
    if text := chatout.a_string(whole.message.get("content")):
        output.append(message_item(new_id("msg_"), text, item_status))
    for value in a_list(whole.message.get("tool_calls")):
        if not isinstance(value, dict):
            continue  # as in a stream: nothing says what it was
        call = chatout.call(value)
        output.append(call_item(req, new_id(CALL_PREFIXES[call_kind(req, call.name)[0]]),
                                call.id or new_id("call_"), call.name, call.arguments, item_status))
    return response(req, req.rid, int(time.time()), status, output, usage(whole.usage), whole.finish)


class _Item:
    """One output item of a stream while it is built."""

    __slots__ = ("kind", "id", "index", "parts", "call_id", "name", "announced")

    def __init__(self, kind: str, index: int, call_id: str = "", name: str = ""):
        self.kind = kind  # "message", "reasoning" or "call"
        self.index = index
        self.id = ""
        self.parts: list[str] = []  # its text, or a call's arguments, as they came
        self.call_id = call_id
        self.name = name
        self.announced = False  # whether output_item.added went out (a call's waits for its name)


class EventStream(StreamTranslator):
    """Chat-completions events in, Responses events out, for one request."""

    def __init__(self, req):
        self.req = req
        self.rid = req.rid
        self.created = int(time.time())
        self.seq = 0
        self.started = False
        self.finished = False
        self.items: list[_Item] = []
        self.text: _Item | None = None
        self.reasoning: _Item | None = None
        self.calls: dict[int, _Item] = {}  # by the chat tool call's index
        self.finish: str | None = None
        self.usage = None
        self.final: bytes | None = None  # the finished response object, which a kept turn keeps

    # --- events --------------------------------------------------------------------------

    def _event(self, kind: str, fields: dict) -> bytes:
        fields["type"] = kind
        fields["sequence_number"] = self.seq
        self.seq += 1
        return b"event: %s\ndata: %s\n\n" % (kind.encode(), encode(fields))

    def _delta(self, kind: bytes, item: _Item, text: str, fields: bytes = b"") -> bytes:
        """A delta event, the one sent per token: formatted directly, at a third of json.dumps' cost."""
        seq = self.seq
        self.seq += 1
        return b'event: %s\ndata: {"type":"%s","sequence_number":%d,"item_id":"%s","output_index":%d%s,"delta":%s}\n\n' % (
            kind, kind, seq, item.id.encode(), item.index, fields, encode(text))

    def _response_event(self, kind: str, status: str, output: list, used=None, error=None,
                        body: bytes | None = None) -> bytes:
        body = body or response(self.req, self.rid, self.created, status, output, used, self.finish, error)
        data = b'{"type":"%s","sequence_number":%d,"response":%s}' % (kind.encode(), self.seq, body)
        self.seq += 1
        return b"event: %s\ndata: %s\n\n" % (kind.encode(), data)

    def _start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        return (self._response_event("response.created", "in_progress", [])
                + self._response_event("response.in_progress", "in_progress", []))

    # --- the translator ------------------------------------------------------------------

    def feed(self, events: bytes) -> bytes:
        out = [self._start()]
        for chunk in chatout.chunks(events):
            if self.finished:
                break
            out.append(self._complete() if chunk is None else self._chunk(chunk))
        return b"".join(out)

    def end(self) -> bytes:
        """An engine that ended its stream without `[DONE]`: the response ends with what it sent."""
        return self._start() + self._complete() if not self.finished else b""

    def fail(self, e: ApiError) -> bytes:
        if self.finished:
            return b""
        self.finished = True
        self.failure = e
        output = [self._item(item, "incomplete") for item in self.items]
        return self._start() + self._response_event("response.failed", "failed", output, usage(self.usage),
                                                     failure(e))

    def _chunk(self, chunk: dict) -> bytes:
        if (error := chatout.stream_error(chunk)) is not None:
            return self.fail(error)
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        out = []
        for choice, delta in chatout.deltas(chunk):
            if reasoning := chatout.reasoning(delta):
                out.append(self._text("reasoning", reasoning))
            if content := chatout.a_string(delta.get("content")):
                out.append(self._text("message", content))
            for piece in a_list(delta.get("tool_calls")):
                if isinstance(piece, dict):
                    out.append(self._call(chatout.call(piece)))
            if isinstance(choice.get("finish_reason"), str):
                self.finish = choice["finish_reason"]
        return b"".join(out)

    # --- items ---------------------------------------------------------------------------

    def _open(self, kind: str, **fields) -> _Item:
        item = _Item(kind, len(self.items), **fields)
        self.items.append(item)
        return item

    def _text(self, kind: str, text: str) -> bytes:
        item = self.text if kind == "message" else self.reasoning
        out = b""
        if item is None:
            item = self._open(kind)
            item.id = new_id("msg_" if kind == "message" else "rs_")
            item.announced = True
            if kind == "message":
                self.text = item
            else:
                self.reasoning = item
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []} if kind == "message" \
                else {"type": "reasoning_text", "text": ""}
            out = (self._event("response.output_item.added", {"output_index": item.index,
                                                              "item": self._item(item, "in_progress")})
                   + self._event("response.content_part.added", {"item_id": item.id, "output_index": item.index,
                                                                 "content_index": 0, "part": part}))
        item.parts.append(text)
        if kind == "message":
            return out + self._delta(b"response.output_text.delta", item, text, b',"content_index":0,"logprobs":[]')
        return out + self._delta(b"response.reasoning_text.delta", item, text, b',"content_index":0')

    def _call(self, piece: chatout.Call) -> bytes:
        item = self.calls.get(piece.index)
        if item is None:
            item = self.calls[piece.index] = self._open("call", call_id=piece.id or new_id("call_"))
        if not item.name:
            item.name = piece.name
        fragment = piece.arguments
        if fragment:
            item.parts.append(fragment)
        if item.announced or not item.name:
            # Only a function's arguments stream: a free-form tool's input is read from them whole, at the end.
            if item.announced and fragment and call_kind(self.req, item.name)[0] == "function":
                return self._delta(b"response.function_call_arguments.delta", item, fragment)
            return b""
        return self._announce(item)

    def _announce(self, item: _Item) -> bytes:
        """output_item.added for a call, once its name says what it is, with its arguments so far."""
        kind = call_kind(self.req, item.name)[0]
        item.id = new_id(CALL_PREFIXES[kind])
        item.announced = True
        arguments = "".join(item.parts)
        shown = self._item(item, "in_progress")
        if kind != "function":
            shown = call_item(self.req, item.id, item.call_id, item.name, "", "in_progress")
        out = self._event("response.output_item.added", {"output_index": item.index, "item": shown})
        if kind == "function" and arguments:
            out += self._delta(b"response.function_call_arguments.delta", item, arguments)
        return out

    def _item(self, item: _Item, status: str) -> dict:
        text = "".join(item.parts)
        if item.kind == "message":
            return message_item(item.id, text, status)
        if item.kind == "reasoning":
            return reasoning_item(item.id, text, status)
        return call_item(self.req, item.id, item.call_id, item.name, text, status)

    def _close(self, item: _Item, status: str) -> tuple[bytes, dict]:
        """The events that end ITEM, and the item as it ended."""
        out = b"" if item.announced else self._announce(item)  # a call whose name never came
        whole = self._item(item, status)
        at = {"item_id": item.id, "output_index": item.index}
        if item.kind == "message":
            part = whole["content"][0]
            out += (self._event("response.output_text.done", {**at, "content_index": 0, "text": part["text"],
                                                              "logprobs": []})
                    + self._event("response.content_part.done", {**at, "content_index": 0, "part": part}))
        elif item.kind == "reasoning":
            part = whole["content"][0]
            out += (self._event("response.reasoning_text.done", {**at, "content_index": 0, "text": part["text"]})
                    + self._event("response.content_part.done", {**at, "content_index": 0, "part": part}))
        elif whole["type"] == "function_call":
            out += self._event("response.function_call_arguments.done",
                               {**at, "name": whole["name"], "arguments": whole["arguments"]})
        elif whole["type"] == "custom_tool_call":
            out += (self._event("response.custom_tool_call_input.delta", {**at, "delta": whole["input"]})
                    + self._event("response.custom_tool_call_input.done", {**at, "input": whole["input"]}))
        return out + self._event("response.output_item.done", {"output_index": item.index, "item": whole}), whole

    def _complete(self) -> bytes:
        self.finished = True
        status = status_of(self.finish)
        item_status = "incomplete" if status == "incomplete" else "completed"
        out, output = [], []
        for item in self.items:
            events, whole = self._close(item, item_status)
            out.append(events)
            output.append(whole)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        self.final = response(self.req, self.rid, self.created, status, output, usage(self.usage), self.finish)
        out.append(self._response_event(kind, status, output, usage(self.usage), body=self.final))
        return b"".join(out)
