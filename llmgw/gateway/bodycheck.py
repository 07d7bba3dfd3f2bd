"""The fields of an OpenAI request that engines choke on, checked before a body is forwarded.

llama.cpp answers 500 to a request whose `tools` is a string, whose text part
has no text, or whose message `name` is an object (a fuzz of 462 bodies found
20 such); the gateway took each for a sick replica, and twelve requests from
one key took a model offline for everyone (issue 9). So the fields an engine
parses are checked here, with a 400 in OpenAI's shape naming the field's path
(`messages[2].content[0].text`). Fields the gateway does not know pass through
untouched, and values in range are the engine's business: this is a check of
shapes, not a copy of any engine's validator.
"""

from __future__ import annotations

import re

from llmgw.gateway.errors import ApiError

# A tuple, not a set: `in` compares, where a set would hash, and a role that is a list cannot be hashed.
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# What a message may carry besides its content: strings when present (llama.cpp answers 500 to a null).
MESSAGE_STRINGS = ("name", "tool_call_id", "reasoning_content")
# A model's name is stored with every usage row: a name of megabytes made rows of megabytes.
MAX_MODEL_NAME = 256
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
SURROGATE = re.compile("[\ud800-\udfff]")

JSON_NAMES = {str: "a string", int: "a number", float: "a number", bool: "a boolean", dict: "an object",
              list: "a list", type(None): "null"}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request", param)


def need(value, types: tuple, what: str, param: str) -> None:
    """Refuse VALUE unless it is one of TYPES (a boolean is not a number here unless bool is among them)."""
    if not isinstance(value, types) or (value.__class__ is bool and bool not in types):
        raise bad(f"{param} must be {what}, not {JSON_NAMES.get(type(value), type(value).__name__)}.", param)


def _string(value, param: str) -> None:
    need(value, (str,), "a string", param)


def _optional_string(obj: dict, name: str, param: str) -> None:
    # Present means a string: llama.cpp answers 500 to a null name, tool_call_id or description.
    if name in obj:
        _string(obj[name], f"{param}.{name}")


def _scalar(types: tuple, what: str, least: float | None = None, most: float | None = None):
    def check(value, param: str) -> None:
        need(value, types, what, param)
        if (least is not None and value < least) or (most is not None and value > most):
            span = f"at least {least}" if most is None else f"between {least} and {most}"
            raise bad(f"{param} must be {span}, not {value}.", param)
    return check


def check_model(model) -> None:
    """Refuse a model name no catalog holds by its shape: not a string, empty, too long, or with control characters."""
    if not isinstance(model, str) or not model:
        raise bad("model is required: the name of a model, as `GET /v1/models` lists them.", "model")
    if len(model) > MAX_MODEL_NAME:
        raise bad(f"model is {len(model):,} characters long; a model's name has at most {MAX_MODEL_NAME}. "
                  "Use a name `GET /v1/models` lists.", "model")
    if CONTROL.search(model):
        raise bad("model holds control characters; no model's name does. Use a name `GET /v1/models` lists.",
                  "model")
    if SURROGATE.search(model):
        # Nor could the usage row that records the request be written: a database holds UTF-8.
        raise bad("model holds a lone surrogate (\\ud800 to \\udfff), which is not a character; no model's name "
                  "does. Use a name `GET /v1/models` lists.", "model")



def _text_part(part: dict, param: str) -> None:
    _string(part.get("text"), f"{param}.text")


def _image_part(part: dict, param: str) -> None:
    image = part.get("image_url")
    need(image, (dict,), "an object with a url", f"{param}.image_url")
    _string(image.get("url"), f"{param}.image_url.url")


def _audio_part(part: dict, param: str) -> None:
    audio = part.get("input_audio")
    need(audio, (dict,), "an object with data and format", f"{param}.input_audio")
    _string(audio.get("data"), f"{param}.input_audio.data")
    _string(audio.get("format"), f"{param}.input_audio.format")


# The content parts the engines behind this gateway read (llama.cpp, vLLM, SGLang); a model
# without a vision or audio projector still refuses image and audio parts itself.
PARTS = {"text": _text_part, "image_url": _image_part, "input_audio": _audio_part}


def _content(content, param: str) -> None:
    if content is None or isinstance(content, str):
        return
    need(content, (list,), "a string or a list of parts", param)
    for j, part in enumerate(content):
        if part.__class__ is dict and part.get("type") == "text" and part.get("text").__class__ is str:
            continue  # the common part, accepted without building its path
        where = f"{param}[{j}]"
        need(part, (dict,), "an object with a type", where)
        kind = part.get("type")
        check = PARTS.get(kind) if isinstance(kind, str) else None
        if check is None:
            raise bad(f"{where}.type is {str(kind)[:40]!r}; a content part's type is one of "
                      f"{', '.join(PARTS)}.", f"{where}.type")
        check(part, where)


def _tool_call(call, param: str) -> None:
    need(call, (dict,), "an object", param)
    _optional_string(call, "id", param)
    if call.get("type") != "function":  # llama.cpp: "Missing tool call type", a 500
        raise bad(f'{param}.type must be "function".', f"{param}.type")
    function = call.get("function")
    need(function, (dict,), "an object with a name and arguments", f"{param}.function")
    _string(function.get("name"), f"{param}.function.name")
    _optional_string(function, "arguments", f"{param}.function")


def _message(message, param: str) -> None:
    need(message, (dict,), "an object with a role and content", param)
    role = message.get("role")
    if role not in ROLES:
        need(role, (str,), "a string", f"{param}.role")
        raise bad(f"{param}.role is {role[:40]!r}; a role is one of {', '.join(ROLES)}.", f"{param}.role")
    content = message.get("content")
    if content.__class__ is not str:
        _content(content, f"{param}.content")
    for name in MESSAGE_STRINGS:
        _optional_string(message, name, param)
    calls = message.get("tool_calls")
    if calls is not None:
        need(calls, (list,), "a list of tool calls", f"{param}.tool_calls")
        for k, call in enumerate(calls):
            _tool_call(call, f"{param}.tool_calls[{k}]")


def _messages(messages, param: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of {role, content} objects.", param)
    for i, message in enumerate(messages):
        # Most messages are a role and a string; those are accepted without building a path for each.
        if message.__class__ is dict and len(message) == 2 and message.get("role") in ROLES \
                and message.get("content").__class__ is str:
            continue
        _message(message, f"{param}[{i}]")



def _tools(tools, param: str) -> None:
    need(tools, (list,), 'a list of {"type": "function", "function": {...}} objects', param)
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        need(tool, (dict,), 'an object {"type": "function", "function": {...}}', where)
        if tool.get("type") != "function":
            raise bad(f'{where}.type must be "function".', f"{where}.type")
        function = tool.get("function")
        need(function, (dict,), "an object with a name", f"{where}.function")
        _string(function.get("name"), f"{where}.function.name")
        _optional_string(function, "description", f"{where}.function")
        if function.get("parameters") is not None:
            need(function["parameters"], (dict,), "an object (a JSON schema)", f"{where}.function.parameters")


def _tool_choice(choice, param: str) -> None:
    if choice in ("none", "auto", "required"):
        return
    need(choice, (str, dict), '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}', param)
    if isinstance(choice, str):
        raise bad(f'{param} is {choice[:40]!r}; use "none", "auto", "required" or an object naming a function.',
                  param)
    function = choice.get("function")
    need(function, (dict,), "an object with a name", f"{param}.function")
    _string(function.get("name"), f"{param}.function.name")


def _stop(stop, param: str) -> None:
    if isinstance(stop, str):
        return
    need(stop, (list,), "a string or a list of strings", param)
    for i, item in enumerate(stop):
        _string(item, f"{param}[{i}]")


def _response_format(value, param: str) -> None:
    need(value, (dict,), 'an object such as {"type": "json_object"}', param)
    _string(value.get("type"), f"{param}.type")


def _logit_bias(value, param: str) -> None:
    need(value, (dict,), "an object of token ids to numbers", param)
    for token, bias in value.items():
        need(bias, (int, float), "a number", f"{param}.{token[:40]}")


def _stream_options(value, param: str) -> None:
    need(value, (dict,), "an object", param)
    if value.get("include_usage") is not None:
        need(value["include_usage"], (bool,), "true or false", f"{param}.include_usage")


def _tokens_or_texts(value, param: str) -> None:
    """A prompt or an embeddings input: a string, or a non-empty list of strings, token ids, or lists of token ids."""
    if isinstance(value, str):
        return
    if not isinstance(value, list) or not value:
        raise bad(f"{param} must be a string or a non-empty list.", param)
    for i, item in enumerate(value):
        if isinstance(item, str) or (isinstance(item, int) and item.__class__ is not bool):
            continue
        need(item, (list,), "a string, a token id or a list of token ids", f"{param}[{i}]")
        for k, token in enumerate(item):
            need(token, (int,), "a token id (a whole number)", f"{param}[{i}][{k}]")


def _encoding_format(value, param: str) -> None:
    if value not in ("float", "base64"):
        need(value, (str,), '"float" or "base64"', param)
        raise bad(f'{param} is {value[:40]!r}; use "float" or "base64".', param)


# A count an engine keeps in a 32-bit int; and how many answers one request may ask for, as OpenAI allows
# (n up to 128, best_of up to 20): the engine runs a task for each, and n = 2**64 once held one for good.
COUNT = _scalar((int,), "a whole number", 1, 2**31 - 1)
CHOICES = _scalar((int,), "a whole number", 1, 128)
NUMBER = _scalar((int, float), "a number")
BOOLEAN = _scalar((bool,), "true or false")
STRING = _string

# Every OpenAI field that any of the three routes takes, checked when present and not null.
COMMON = {
    "stream": BOOLEAN, "stream_options": _stream_options, "user": STRING,
    "max_tokens": COUNT, "max_completion_tokens": COUNT, "n_predict": COUNT, "n": CHOICES,
    "temperature": _scalar((int, float), "a number", 0, 2), "top_p": NUMBER,
    "presence_penalty": NUMBER, "frequency_penalty": NUMBER, "seed": _scalar((int,), "a whole number"),
    "stop": _stop, "logit_bias": _logit_bias,
}
FIELDS = {
    "chat": {**COMMON, "messages": _messages, "tools": _tools, "tool_choice": _tool_choice,
             "parallel_tool_calls": BOOLEAN, "logprobs": BOOLEAN,
             "top_logprobs": _scalar((int,), "a whole number", 0, 20), "response_format": _response_format},
    "completions": {**COMMON, "prompt": _tokens_or_texts, "suffix": STRING, "echo": BOOLEAN,
                    "best_of": _scalar((int,), "a whole number", 1, 20), "logprobs": _scalar((int,), "a whole number", 0, 20)},
    "embeddings": {"input": _tokens_or_texts, "encoding_format": _encoding_format, "dimensions": COUNT,
                   "user": STRING},
}
REQUIRED = {"chat": "messages", "completions": "prompt", "embeddings": "input"}


def check(kind: str, body: dict) -> None:
    """Refuse BODY, a request of KIND, with a 400 naming the first field an engine would choke on."""
    check_model(body.get("model"))
    required = REQUIRED[kind]
    if body.get(required) is None:
        FIELDS[kind][required](None, required)
    rules = FIELDS[kind]
    for name, value in body.items():
        rule = rules.get(name)
        if rule is not None and value is not None:
            rule(value, name)
    if kind == "embeddings" and body.get("stream"):
        raise bad("Embeddings cannot be streamed; leave stream out.", "stream")
