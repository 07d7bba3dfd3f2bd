"""OpenAI's Responses API (`POST /v1/responses`, what Codex CLI speaks) as a dialect over chat completions.

A Responses request is read into a chat-completions request here, which then
takes every request's path; llmgw/gateway/responsesout.py turns the engine's
chat answer, whole or streamed, back into a response object and its events.

A response is kept (`store`, true unless the request says false) only where
the key's project keeps conversations, as a turn of a thread
(llmgw/gateway/threads.py); `previous_response_id` continues from a kept one,
under the same rules, and the response object says `store: false` where
nothing was kept. What else the Responses API keeps for a client
(`conversation`, `background`, stored prompts) is refused with a 400 that says
what to send instead. Tools the engine can run as functions are
offered as functions: `function` tools as they are, those in a `namespace`
flattened, Codex's free-form `custom` tools (apply_patch) as a function of one
string `input`, and `local_shell` as a function of its command; each comes
back as the item its client expects. Tools OpenAI runs on its own servers
(web search, file search, code interpreter, MCP, ...) cannot run here: they are
left out rather than refused, because Codex offers web_search on every request,
and the response says which were (`tools` lists what the model was offered,
`llmgw_tools_left_out` what it was not). Fields that mean nothing here
(`include`, `truncation`, `prompt_cache_key`, `service_tier`, `reasoning`'s
effort, `text.verbosity`, ...) and fields this module does not know are
ignored, as the API grows faster than any copy of it.
"""

from __future__ import annotations

import itertools
import json
import logging

from llmgw.gateway import apirequest, bodycheck, chatout, responsesout
from llmgw.gateway.apirequest import ParsedRequest
from llmgw.gateway.bodycheck import bad, need
from llmgw.gateway.dialect import Dialect, StreamTranslator, chat_content, encode
from llmgw.gateway.errors import ApiError

log = logging.getLogger("llmgw.responses")

# What the Responses API keeps between requests, which this gateway does not.
STATEFUL = {
    "conversation": "This gateway keeps no conversation objects. Leave conversation out, and continue from a "
                    "stored response with previous_response_id, or send the whole conversation in input.",
    "prompt": "This gateway keeps no stored prompts. Send the prompt's text as instructions and input instead.",
}
PREVIOUS_MOST = 64  # characters of a response id (`resp_` and 24 hex digits here)
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
# A free-form tool's text travels as this one argument of a function (see the top of the module).
CUSTOM_ARGUMENT = "input"
LOCAL_SHELL = {
    "type": "function", "function": {
        "name": "local_shell", "description": "Run a command on the user's machine and see its output.",
        "parameters": {"type": "object", "required": ["command"], "properties": {
            "command": {"type": "array", "items": {"type": "string"},
                        "description": "The program and its arguments, e.g. [\"ls\", \"-l\"]."},
            "workdir": {"type": "string", "description": "The directory to run it in."},
            "timeout_ms": {"type": "integer", "description": "How long it may run, in milliseconds."}}}}}
# Tool types left out already said so in this worker's log: Codex sends web_search with every request.
_logged_left_out: set[str] = set()


class ResponsesRequest(ParsedRequest):
    """A chat request read from a Responses request, with what its answer repeats (`echo`, pre-encoded
    as it goes out up to three times in a stream) and which kind of tool each function name stands for."""

    __slots__ = ("echo", "echo_fields", "tools", "rid", "previous", "store")

    def __init__(self, kind: str, body: dict, raw: bytes):
        super().__init__(kind, body, raw)
        self.echo = b"{}"
        self.echo_fields: dict = {}
        self.tools: dict[str, tuple[str, str | None]] = {}  # function name: (tool type, its namespace)
        self.rid = chatout.new_id("resp_")  # its response's id, known before the answer, to keep it under
        self.previous: str | None = None  # previous_response_id
        self.store = False  # whether the client asked to keep it (what OpenAI does where it says nothing)

    def stored(self) -> None:
        """Say `store: true` in its response objects: it is kept."""
        self.echo_fields["store"] = True
        self.echo = encode(self.echo_fields)


class Responses(Dialect):
    name = "responses"

    def parse(self, kind: str, raw: bytes, prefix_bytes: int) -> ResponsesRequest:
        body = apirequest.read_object(raw)
        chat, echo, tools = to_chat(body)
        req = apirequest.checked(kind, chat, encode(chat), prefix_bytes, ResponsesRequest)
        req.api = self.name
        req.output_field = "max_output_tokens"
        req.echo_fields = echo
        req.echo = encode(echo)
        req.previous = echo["previous_response_id"]
        req.store = body.get("store") is not False
        req.tools = tools
        return req

    def shape(self, req: ResponsesRequest, data: bytes) -> bytes:
        return responsesout.answer(req, data)

    def translator(self, req: ResponsesRequest) -> StreamTranslator:
        return responsesout.EventStream(req)

    def stream_error(self, req: ResponsesRequest, e: ApiError) -> bytes:
        return responsesout.EventStream(req).fail(e)


RESPONSES = Responses()


def to_chat(body: dict) -> tuple[dict, dict, dict]:
    """BODY, a Responses request, as (a chat-completions body, the request's fields its response repeats,
    {function name: (tool type, namespace)}); raises ApiError naming the Responses field at fault."""
    bodycheck.check_model(body.get("model"))
    for name, why in STATEFUL.items():
        if body.get(name) is not None:
            raise bad(why, name)
    previous = body.get("previous_response_id")
    if previous is not None:
        need(previous, (str,), "a string, the id of a stored response", "previous_response_id")
        if not 0 < len(previous) <= PREVIOUS_MOST:
            raise bad(f"previous_response_id must be 1 to {PREVIOUS_MOST} characters.", "previous_response_id")
    if body.get("store") is not None:
        bodycheck.BOOLEAN(body["store"], "store")
    if body.get("background"):
        raise bad("This gateway answers while the client waits; leave background out (or false).", "background")
    chat: dict = {"model": body["model"]}
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        need(instructions, (str,), "a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    if body.get("input") is None:
        raise bad("input is required: a string, or a list of messages and items.", "input")
    _input(body["input"], messages)
    chat["messages"] = _merge_system(messages)
    offered, tools, kinds, left_out = _tools(body.get("tools"))
    # Read even with no tool offered: a choice naming one is refused then, not dropped (a forced call would
    # silently have become text).
    choice = _tool_choice(body["tool_choice"], kinds) if body.get("tool_choice") is not None else None
    if tools:
        chat["tools"] = tools
        if choice is not None:
            chat["tool_choice"] = choice
        if body.get("parallel_tool_calls") is not None:
            bodycheck.BOOLEAN(body["parallel_tool_calls"], "parallel_tool_calls")
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    for field, chat_field, rule in (("max_output_tokens", "max_tokens", bodycheck.COUNT),
                                    ("temperature", "temperature", bodycheck.COMMON["temperature"]),
                                    ("top_p", "top_p", bodycheck.NUMBER), ("user", "user", bodycheck.STRING),
                                    ("stream", "stream", bodycheck.BOOLEAN)):
        if body.get(field) is not None:
            rule(body[field], field)
            chat[chat_field] = body[field]
    if chat.get("stream"):
        # The translator reads the engine's usage for the response's own (response.completed carries it).
        chat["stream_options"] = {"include_usage": True}
    text = body.get("text")
    if text is not None:
        need(text, (dict,), 'an object such as {"format": {"type": "text"}}', "text")
        response_format = _format(text.get("format"))
        if response_format is not None:
            chat["response_format"] = response_format
    for name in ("reasoning", "metadata"):
        if body.get(name) is not None:
            need(body[name], (dict,), "an object", name)
    echo = {
        "instructions": instructions, "metadata": body.get("metadata") or {}, "model": body["model"],
        "parallel_tool_calls": body.get("parallel_tool_calls", True), "temperature": body.get("temperature"),
        "top_p": body.get("top_p"), "max_output_tokens": body.get("max_output_tokens"), "tools": offered,
        "tool_choice": body.get("tool_choice") or "auto", "text": text or {"format": {"type": "text"}},
        # No engine here takes an effort; saying null is true where echoing the ask would not be.
        "reasoning": {"effort": None, "summary": None},
        "store": False, "background": False, "previous_response_id": previous, "truncation": "disabled",
        "user": body.get("user"), "service_tier": "default", "llmgw_tools_left_out": left_out,
    }
    return chat, echo, kinds


# --- input ------------------------------------------------------------------------------------


def _input(value, messages: list) -> None:
    """VALUE, the request's `input`, appended to MESSAGES as chat messages."""
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
        return
    need(value, (list,), "a string or a list of items", "input")
    calls: set[str] = set()  # call ids the conversation has made, which outputs must answer
    for i, item in enumerate(value):
        where = f"input[{i}]"
        need(item, (dict,), "an object (a message or an item)", where)
        kind = item.get("type", "message")  # a bare {role, content} is a message
        translate = ITEMS.get(kind) if isinstance(kind, str) else None
        if translate is None:
            raise bad(f"{where}.type is {str(kind)[:40]!r}, which this gateway cannot give a model: it takes "
                      f"{', '.join(sorted(ITEMS))}. Leave the item out.", f"{where}.type")
        translate(item, where, messages, calls)


def _message(item: dict, where: str, messages: list, calls: set) -> None:
    role = item.get("role")
    need(role, (str,), "a string", f"{where}.role")
    if role not in ROLES:
        raise bad(f"{where}.role is {role[:40]!r}; a message's role is one of {', '.join(ROLES)}.", f"{where}.role")
    messages.append({"role": ROLES[role], "content": _content(item.get("content"), f"{where}.content")})


def _content(content, where: str):
    """A message's content as chat content: a string, or parts where it holds images."""
    if isinstance(content, str):
        return content
    need(content, (list,), "a string or a list of content parts", where)
    parts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        need(part, (dict,), "an object with a type", at)
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            need(part.get("text"), (str,), "a string", f"{at}.text")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal":
            need(part.get("refusal"), (str,), "a string", f"{at}.refusal")
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image":
            url = part.get("image_url")
            if url is None:
                raise bad(f"{at} names no image_url. This gateway keeps no files, so file_id cannot be used: send "
                          "the image as a URL or a data: URL.", f"{at}.image_url")
            need(url, (str,), "a string (a URL or a data: URL)", f"{at}.image_url")
            image = {"url": url}
            if isinstance(part.get("detail"), str):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            need(kind, (str,), "a string", f"{at}.type")
            raise bad(f"{at}.type is {kind[:40]!r}; the engines here read input_text, output_text, refusal and "
                      "input_image parts (no files).", f"{at}.type")
    return chat_content(parts)


def _call(item: dict, where: str, messages: list, calls: set, arguments: str, name: str) -> None:
    """A call the model made, as a tool call of the assistant message it belongs to.

    Consecutive calls, and the text the model wrote before them, were one
    assistant turn: they become one message, as the model produced them.
    """
    call_id = item.get("call_id")
    need(call_id, (str,), "a string", f"{where}.call_id")
    calls.add(call_id)
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _function_call(item: dict, where: str, messages: list, calls: set) -> None:
    need(item.get("name"), (str,), "a string", f"{where}.name")
    need(item.get("arguments"), (str,), "a string (JSON)", f"{where}.arguments")
    _call(item, where, messages, calls, item["arguments"], item["name"])


def _custom_call(item: dict, where: str, messages: list, calls: set) -> None:
    need(item.get("name"), (str,), "a string", f"{where}.name")
    need(item.get("input"), (str,), "a string", f"{where}.input")
    _call(item, where, messages, calls, json.dumps({CUSTOM_ARGUMENT: item["input"]}, ensure_ascii=False),
          item["name"])


def _local_shell_call(item: dict, where: str, messages: list, calls: set) -> None:
    action = item.get("action")
    need(action, (dict,), "an object with a command", f"{where}.action")
    need(action.get("command"), (list,), "a list of strings", f"{where}.action.command")
    arguments = {"command": action["command"]}
    for name, field in (("workdir", "working_directory"), ("timeout_ms", "timeout_ms")):
        if action.get(field) is not None:
            arguments[name] = action[field]
    _call(item, where, messages, calls, json.dumps(arguments, ensure_ascii=False), "local_shell")


def _output(item: dict, where: str, messages: list, calls: set) -> None:
    """A tool's output, as the tool message that answers the call with its call_id."""
    field = "call_id"
    if item.get("type") == "local_shell_call_output" and "call_id" not in item:
        field = "id"  # the Responses API names local_shell's call so, and every other by call_id
    call_id = item.get(field)
    need(call_id, (str,), "a string", f"{where}.{field}")
    if call_id not in calls:
        raise bad(f"{where}.{field} is {call_id[:60]!r}, but no call before it in input has that call_id. Send "
                  "each tool call before its output.", f"{where}.{field}")
    output = item.get("output")
    content = output if isinstance(output, str) else _content(output, f"{where}.output")
    messages.append({"role": "tool", "tool_call_id": call_id, "content": content})


def _drop(item: dict, where: str, messages: list, calls: set) -> None:
    """A reasoning item: the engine's own reasoning from an earlier turn, which chat templates leave out
    (and encrypted, when it came from OpenAI)."""


ITEMS = {
    "message": _message, "function_call": _function_call, "custom_tool_call": _custom_call,
    "local_shell_call": _local_shell_call, "function_call_output": _output, "custom_tool_call_output": _output,
    "local_shell_call_output": _output, "reasoning": _drop,
}


def _merge_system(messages: list) -> list:
    """MESSAGES with each run of system messages made one: Codex opens with several (its instructions,
    then its developer messages), and many chat templates take one system message, first. A run's texts
    are joined once: adding each to the text so far took time in the square of the run's length."""
    merged: list = []
    for texts, run in itertools.groupby(messages, lambda m: m["role"] == "system" and isinstance(m["content"], str)):
        run = list(run)
        if texts and len(run) > 1:
            merged.append({"role": "system", "content": "\n\n".join(m["content"] for m in run)})
        else:
            merged.extend(run)
    return merged


# --- tools ------------------------------------------------------------------------------------


def _tools(value) -> tuple[list, list, dict, list]:
    """The request's `tools` as (those offered to the model, in their Responses shape; the chat tools
    they become; {function name: (tool type, namespace)}; the types of those left out)."""
    if value is None:
        return [], [], {}, []
    need(value, (list,), "a list of tools", "tools")
    offered, chat, kinds, left_out = [], [], {}, []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        need(tool, (dict,), "an object with a type", where)
        kind = tool.get("type")
        if kind == "namespace":
            need(tool.get("tools"), (list,), "a list of tools", f"{where}.tools")
            need(tool.get("name"), (str,), "a string", f"{where}.name")
            for j, inner in enumerate(tool["tools"]):
                need(inner, (dict,), "an object with a type", f"{where}.tools[{j}]")
                _tool(inner, f"{where}.tools[{j}]", tool["name"], chat, kinds)
            offered.append(tool)
        elif kind in ("function", "custom", "local_shell"):
            _tool(tool, where, None, chat, kinds)
            offered.append(tool)
        else:
            need(kind, (str,), "a string", f"{where}.type")
            left_out.append(kind)
            if kind not in _logged_left_out:
                _logged_left_out.add(kind)
                log.info("a Responses request offered a %s tool, which no engine here runs: it was left out "
                         "(said once per worker; the response's llmgw_tools_left_out names it each time)", kind)
    return offered, chat, kinds, left_out


def _tool(tool: dict, where: str, namespace: str | None, chat: list, kinds: dict) -> None:
    kind = tool.get("type")
    if kind == "local_shell":
        function = LOCAL_SHELL
    else:
        if kind not in ("function", "custom"):
            need(kind, (str,), "a string", f"{where}.type")
            raise bad(f'{where}.type is {kind[:40]!r}; a namespace holds "function" and "custom" tools.',
                      f"{where}.type")
        need(tool.get("name"), (str,), "a string", f"{where}.name")
        description = tool.get("description")
        if description is not None:
            need(description, (str,), "a string", f"{where}.description")
        inner = {"name": tool["name"]}
        if kind == "function":
            parameters = tool.get("parameters")
            if parameters is not None:
                need(parameters, (dict,), "an object (a JSON schema)", f"{where}.parameters")
                inner["parameters"] = parameters
            # `strict` is left out: no engine here enforces it, and vLLM warns of every field it does not know.
        else:
            inner["parameters"] = {"type": "object", "required": [CUSTOM_ARGUMENT], "properties": {
                CUSTOM_ARGUMENT: {"type": "string", "description": "The tool's input, as free text."}}}
            description = _custom_description(tool, description, where)
        if description:
            inner["description"] = description
        function = {"type": "function", "function": inner}
    name = function["function"]["name"]
    if name in kinds:
        raise bad(f"Two tools are named {name[:60]!r}; the model calls tools by name, so each needs its own.",
                  f"{where}.name")
    kinds[name] = (kind, namespace)
    chat.append(function)


def _custom_description(tool: dict, description: str | None, where: str) -> str:
    """A free-form tool's description, with its grammar: the model has only the text to follow it by."""
    text = description or ""
    fmt = tool.get("format")
    if fmt is not None:
        need(fmt, (dict,), 'an object such as {"type": "text"}', f"{where}.format")
        if fmt.get("type") == "grammar":
            need(fmt.get("definition"), (str,), "a string", f"{where}.format.definition")
            text += (f"\n\nPut the tool's whole input in `{CUSTOM_ARGUMENT}`, written in this "
                     f"{fmt.get('syntax', '')} grammar:\n{fmt['definition']}")
    return text.strip()


def _tool_choice(choice, kinds: dict):
    if choice in ("auto", "none", "required"):
        return choice
    need(choice, (str, dict), '"auto", "none", "required" or an object naming a tool', "tool_choice")
    if isinstance(choice, str):
        raise bad(f'tool_choice is {choice[:40]!r}; use "auto", "none", "required" or an object naming a tool.',
                  "tool_choice")
    kind = choice.get("type")
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise bad('tool_choice.mode must be "auto" or "required".', "tool_choice.mode")
        return mode
    name = "local_shell" if kind == "local_shell" else choice.get("name")
    if kind not in ("function", "custom", "local_shell") or not isinstance(name, str) or name not in kinds:
        raise bad(f"tool_choice names a tool ({kind!s:.40} {name!s:.60}) that is not among the tools offered to "
                  "the model here (tools OpenAI runs itself, such as web search, are left out). Name a function, "
                  "custom or local_shell tool from tools.", "tool_choice")
    return {"type": "function", "function": {"name": name}}


def _format(fmt):
    """`text.format` as chat's response_format; None for plain text."""
    if fmt is None:
        return None
    need(fmt, (dict,), 'an object such as {"type": "json_schema", ...}', "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        need(fmt.get("name"), (str,), "a string", "text.format.name")
        need(fmt.get("schema"), (dict,), "an object (a JSON schema)", "text.format.schema")
        schema = {"name": fmt["name"], "schema": fmt["schema"]}
        for field in ("strict", "description"):
            if fmt.get(field) is not None:
                schema[field] = fmt[field]
        return {"type": "json_schema", "json_schema": schema}
    need(kind, (str,), "a string", "text.format.type")
    raise bad(f'text.format.type is {kind[:40]!r}; use "text", "json_object" or "json_schema".', "text.format.type")
