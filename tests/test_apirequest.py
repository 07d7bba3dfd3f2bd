import json
import os
import subprocess
import sys
import tracemalloc

import pytest

from llmgw.gateway import apirequest, jsonbound
from llmgw.gateway.errors import ApiError


def parse(kind, body, prefix=2048):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return apirequest.parse(kind, raw, prefix)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def user(content, **fields):
    return {"model": "m", "messages": [{"role": "user", "content": content, **fields}]}


def tool(**function):
    return {**CHAT, "tools": [{"type": "function", "function": function}]}


def test_a_body_with_a_byte_order_mark_is_refused_saying_so():
    with pytest.raises(ApiError) as refused:
        jsonbound.loads(b'\xef\xbb\xbf{"model": "m"}')
    assert refused.value.status == 400 and "byte order mark" in refused.value.message


@pytest.mark.parametrize("kind, body, param", [
    ("chat", b"{not json", None),
    ("chat", b"\xff\xfe", None),
    ("chat", [1, 2], None),
    ("chat", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', None),
    ("chat", {"messages": []}, "model"),
    ("chat", {"model": 7, "messages": []}, "model"),
    ("chat", {"model": "m"}, "messages"),
    ("chat", {"model": "m", "messages": "hi"}, "messages"),
    ("chat", {"model": "m", "messages": [{"content": "x"}]}, "messages[0].role"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat", {**CHAT, "stream": "yes"}, "stream"),
    ("chat", {**CHAT, "stream_options": []}, "stream_options"),
    ("chat", {**CHAT, "max_tokens": "10"}, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": True}, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": 0}, "max_tokens"),
    ("chat", {**CHAT, "temperature": "hot"}, "temperature"),
    ("chat", {**CHAT, "temperature": 2.5}, "temperature"),
    ("completions", {"model": "m"}, "prompt"),
    ("completions", {"model": "m", "prompt": []}, "prompt"),
    ("embeddings", {"model": "m", "input": 3}, "input"),
    ("embeddings", {"model": "m", "input": "x", "stream": True}, "stream"),
    # Each of these made llama.cpp answer 500 (tried against the xllamacpp server with SmolLM2), which
    # the gateway took for a sick replica.
    ("chat", {**CHAT, "tools": "x"}, "tools"),
    ("chat", {**CHAT, "tools": ["x"]}, "tools[0]"),
    ("chat", {**CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
    ("chat", {**CHAT, "tools": [{"type": "x", "function": {"name": "f"}}]}, "tools[0].type"),
    ("chat", tool(), "tools[0].function.name"),
    ("chat", tool(name=3), "tools[0].function.name"),
    ("chat", tool(name="f", parameters="x"), "tools[0].function.parameters"),
    ("chat", user([{"type": "text"}]), "messages[0].content[0].text"),
    ("chat", user([{"type": "text", "text": 3}]), "messages[0].content[0].text"),
    ("chat", user([{"type": "image_url"}]), "messages[0].content[0].image_url"),
    ("chat", user([{"type": "image_url", "image_url": {"url": 5}}]), "messages[0].content[0].image_url.url"),
    ("chat", user([{"type": "input_audio", "input_audio": {"data": "AA"}}]),
     "messages[0].content[0].input_audio.format"),
    ("chat", user([{"type": "video", "video": "a"}]), "messages[0].content[0].type"),
    ("chat", user(["a"]), "messages[0].content[0]"),
    ("chat", user("a", name={}), "messages[0].name"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": "x"}]},
     "messages[1].tool_calls"),
    ("chat", {"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]}]},
     "messages[0].tool_calls[0].function"),
    ("chat", {"model": "m", "messages": [{"role": "tool", "tool_call_id": 3, "content": "r"}]},
     "messages[0].tool_call_id"),
    ("chat", user("a", name=None), "messages[0].name"),
    ("chat", user("a", tool_call_id=None), "messages[0].tool_call_id"),
    ("chat", user("a", reasoning_content=3), "messages[0].reasoning_content"),
    ("chat", tool(name="f", description=None), "tools[0].function.description"),
    ("chat", {"model": "m", "messages": [{"role": "assistant", "tool_calls": [
        {"id": "1", "type": 3, "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls[0].type"),
    ("chat", {"model": "m", "messages": [{"role": "assistant", "tool_calls": [
        {"id": None, "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls[0].id"),
    ("chat", {"model": "m", "messages": [{"role": "assistant", "tool_calls": [
        {"id": "1", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls[0].type"),
    ("chat", {"model": "m", "messages": [{"role": "wizard", "content": "a"}]}, "messages[0].role"),
    ("chat", {"model": "m", "messages": [{"role": ["user"], "content": "a"}]}, "messages[0].role"),
    ("chat", user([{"type": ["text"], "text": "a"}]), "messages[0].content[0].type"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "a"}, 7]}, "messages[1]"),
    # What the engines refuse themselves, or quietly misread (llama.cpp takes a stop of 3 as no stop).
    ("chat", {**CHAT, "tool_choice": "x"}, "tool_choice"),
    ("chat", {**CHAT, "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
    ("chat", {**CHAT, "stop": 3}, "stop"),
    ("chat", {**CHAT, "stop": ["a", 3]}, "stop[1]"),
    ("chat", {**CHAT, "n": 0}, "n"),
    ("chat", {**CHAT, "n": 129}, "n"),  # OpenAI's most; the engine runs a task for every answer
    ("chat", {**CHAT, "n": 2**64}, "n"),  # once held the engine for good
    ("chat", {**CHAT, "max_tokens": 2**31}, "max_tokens"),
    ("completions", {"model": "m", "prompt": "a", "best_of": 21}, "best_of"),
    ("chat", {**CHAT, "top_p": "x"}, "top_p"),
    ("chat", {**CHAT, "logprobs": "x"}, "logprobs"),
    ("chat", {**CHAT, "top_logprobs": 1000}, "top_logprobs"),
    ("chat", {**CHAT, "seed": 1.5}, "seed"),
    ("chat", {**CHAT, "logit_bias": {"1": "x"}}, "logit_bias.1"),
    ("chat", {**CHAT, "response_format": "x"}, "response_format"),
    ("chat", {**CHAT, "parallel_tool_calls": "x"}, "parallel_tool_calls"),
    ("chat", {**CHAT, "user": {}}, "user"),
    ("chat", {**CHAT, "n_predict": -1}, "n_predict"),
    ("completions", {"model": "m", "prompt": [{}]}, "prompt[0]"),
    ("completions", {"model": "m", "prompt": [1.5]}, "prompt[0]"),
    ("completions", {"model": "m", "prompt": [[1, "a"]]}, "prompt[0][1]"),
    ("completions", {"model": "m", "prompt": "a", "echo": "x"}, "echo"),
    ("completions", {"model": "m", "prompt": "a", "suffix": 3}, "suffix"),
    ("embeddings", {"model": "m", "input": [{}]}, "input[0]"),
    ("embeddings", {"model": "m", "input": "a", "encoding_format": "x"}, "encoding_format"),
    ("embeddings", {"model": "m", "input": "a", "dimensions": "x"}, "dimensions"),
])
def test_bad_bodies_get_a_400_naming_the_field(kind, body, param):
    with pytest.raises(ApiError) as e:
        parse(kind, body)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.message.endswith(".") and len(e.value.message) > 20
    assert e.value.payload()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("kind, body", [
    ("chat", user([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                   {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}], name="bob")),
    ("chat", {"model": "m", "messages": [
        {"role": "developer", "content": "d"}, {"role": "user", "content": None},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "r"}],
        "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}, "stop": ["\n"], "n": 1, "seed": 3,
        "logprobs": True, "top_logprobs": 2, "logit_bias": {"5": -100}, "response_format": {"type": "json_object"},
        "temperature": 0, "top_p": 1, "user": "u", "max_tokens": None, "tool_calls_unknown_field": {"x": [1]}}),
    ("chat", {**CHAT, "tool_choice": "required", "stop": "x", "parallel_tool_calls": False}),
    ("completions", {"model": "m", "prompt": [1, 2, 3], "echo": True, "logprobs": 2, "suffix": "s"}),
    ("completions", {"model": "m", "prompt": [[1, 2], "text", 3]}),
    ("embeddings", {"model": "m", "input": [[1, 2], [3]], "encoding_format": "base64", "dimensions": 64}),
])
def test_good_bodies_pass(kind, body):
    assert parse(kind, body).model == "m"


@pytest.mark.parametrize("model, fault", [
    ("m" * 8 * 1024 * 1024, "8,388,608 characters"),
    ("m" * 257, "257 characters"),
    ("a\nb", "control characters"),
    ("a\x00b", "control characters"),
    (["m"], "required"),
    ("", "required"),
])
def test_absurd_model_names_are_refused_at_the_door(model, fault):
    # The whole name went into the usage row: 8 MiB a row, and a batch PostgreSQL refused whole.
    with pytest.raises(ApiError) as e:
        parse("chat", {**CHAT, "model": model})
    assert e.value.status == 400 and e.value.param == "model" and fault in e.value.message
    assert len(e.value.message) < 200


def test_a_model_name_of_256_characters_is_a_name():
    assert parse("chat", {**CHAT, "model": "m" * 256}).model == "m" * 256


def test_body_goes_through_untouched_when_nothing_changes():
    raw = json.dumps({**CHAT, "unknown_field": {"kept": True}}).encode()
    req = apirequest.parse("chat", raw, 2048)
    assert req.upstream_body("m") is raw


def test_alias_is_rewritten_to_the_engines_name():
    req = parse("chat", {**CHAT, "model": "alias"})
    assert json.loads(req.upstream_body("m"))["model"] == "m"


def test_streams_always_ask_the_engine_for_usage():
    req = parse("chat", {**CHAT, "stream": True, "stream_options": {"other": 1}})
    assert not req.client_wants_usage
    sent = json.loads(req.upstream_body("m"))
    assert sent["stream_options"] == {"other": 1, "include_usage": True}
    asked = parse("chat", {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert asked.client_wants_usage and asked.upstream_body("m") is asked.raw


def test_a_named_tool_is_asked_for_as_its_arguments():
    # llama.cpp took the object for "auto" (and with the starter's template left tools out altogether).
    shell = {"name": "shell", "parameters": {"type": "object", "properties": {"c": {"type": "string"}}}}
    bare = {"name": "bare"}
    body = {**CHAT, "tools": [{"type": "function", "function": f} for f in (shell, bare)],
            "response_format": {"type": "json_object"}}
    forced = sent(parse("chat", {**body, "tool_choice": {"type": "function", "function": {"name": "shell"}}}))
    assert forced["tool_choice"] == "none" and forced["tools"] == body["tools"]  # still shown to the model
    assert forced["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "shell", "schema": shell["parameters"]}}
    without = sent(parse("chat", {**body, "tool_choice": {"type": "function", "function": {"name": "bare"}}}))
    assert without["response_format"]["json_schema"]["schema"] == {"type": "object"}
    for choice in ("auto", "required", "none"):
        req = parse("chat", {**body, "tool_choice": choice})
        assert req.forced_tool is None and req.upstream_body("m") is req.raw


@pytest.mark.parametrize("body", [CHAT, tool(name="other")])
def test_a_named_tool_not_offered_is_refused(body):
    with pytest.raises(ApiError) as refused:
        parse("chat", {**body, "tool_choice": {"type": "function", "function": {"name": "shell"}}})
    assert refused.value.status == 400 and refused.value.param == "tool_choice"
    assert "'shell', but no tool of that name is offered" in refused.value.message


def test_a_conversation_is_named_by_its_messages_up_to_the_first_user_message():
    system = {"role": "system", "content": "s" * 5000}
    first = parse("chat", {"model": "m", "messages": [system, {"role": "user", "content": "x"}]}, prefix=100)
    assert first.affinity is not None and not first.follows  # a first turn: nothing of it is cached yet
    later = parse("chat", {"model": "m", "messages": [system, {"role": "user", "content": "x"},
                                                      {"role": "assistant", "content": "y"},
                                                      {"role": "user", "content": "z"}]}, prefix=100)
    assert later.affinity == first.affinity and later.follows  # every turn of a conversation: one key
    other = parse("chat", {"model": "m", "messages": [system, {"role": "user", "content": "w"}]}, prefix=100)
    assert other.affinity != first.affinity  # the same system prompt, another conversation
    # Each message counts up to PREFIX bytes: a system prompt differing past them is the same one.
    longer = parse("chat", {"model": "m", "messages": [{"role": "system", "content": "s" * 6000},
                                                       {"role": "user", "content": "x"}]}, prefix=100)
    assert longer.affinity == first.affinity
    parts = parse("chat", {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}]}]})
    assert parts.affinity == parse("chat", user("ab")).affinity
    prompt = parse("completions", {"model": "m", "prompt": "abc"})
    assert prompt.affinity is not None and prompt.follows  # a prompt has no turns: its start is all it has
    assert parse("chat", user("")).affinity is None
    assert parse("chat", CHAT, prefix=0).affinity is None  # the policy is not `prefix`: no key is made


def test_usage_found_without_parsing_the_whole_answer():
    body = b'{"model":"m","usage":{"prompt_tokens":3,"total_tokens":3},"data":[' + b"0.1," * 100000 + b"0.2]}"
    assert apirequest.usage_of(body) == {"prompt_tokens": 3, "total_tokens": 3}
    assert apirequest.usage_of(b'{"choices":[]}') is None
    assert apirequest.usage_of(b'{"usage": null}') is None
    assert apirequest.usage_of(b'{"content":"say \\"usage\\": 1"}') is None


def sent(req, served="m"):
    return json.loads(req.upstream_body(served))


@pytest.mark.parametrize("fields", [
    {}, {"max_tokens": None}, {"max_completion_tokens": None}, {"max_completion_tokens": None, "max_tokens": None},
    {"n_predict": None}, {"stream": True}, {"stream": True, "stream_options": {"include_usage": True}},
])
def test_a_request_naming_no_limit_asks_for_the_models_max_output(fields):
    # With max_output = 64, a request without max_tokens got 976 tokens: the engine's default is its context.
    req = parse("chat", {**CHAT, **fields})
    req.bound_output("m", 64)
    assert req.max_tokens == 64
    body = sent(req)
    assert body["max_tokens"] == 64
    assert all(body.get(f) is None for f in ("max_completion_tokens", "n_predict"))


@pytest.mark.parametrize("fields, field", [
    ({"max_completion_tokens": None, "max_tokens": 300}, "max_tokens"),  # got 300 tokens of a 64 limit
    ({"max_tokens": 300}, "max_tokens"),
    ({"max_completion_tokens": 65}, "max_completion_tokens"),
    ({"max_tokens": 10, "max_completion_tokens": 300}, "max_completion_tokens"),
    ({"max_tokens": 10, "n_predict": 300}, "n_predict"),  # llama.cpp reads n_predict first
])
def test_asking_for_more_than_max_output_is_refused_naming_the_field(fields, field):
    req = parse("chat", {**CHAT, **fields})
    with pytest.raises(ApiError) as e:
        req.bound_output("small", 64)
    assert e.value.status == 400 and e.value.param == field
    assert e.value.message.startswith(f"{field} is ") and "small allows at most 64" in e.value.message


@pytest.mark.parametrize("fields", [{"max_tokens": 64}, {"max_completion_tokens": 10, "max_tokens": 20},
                                    {"n_predict": 5}, {"max_completion_tokens": 64, "max_tokens": None}])
def test_a_request_within_max_output_goes_as_it_came(fields):
    req = parse("chat", {**CHAT, **fields})
    req.bound_output("m", 64)
    assert req.upstream_body("m") is req.raw
    assert req.max_tokens == max(v for v in fields.values() if v is not None)


@pytest.mark.parametrize("fields, cut", [
    ({"max_tokens": 32000}, {"max_tokens": 64}),
    ({"max_tokens": 10, "max_completion_tokens": 300}, {"max_tokens": 10, "max_completion_tokens": 64}),
    ({"max_tokens": 20}, None),
])
def test_a_dialect_that_cuts_its_limit_asks_for_no_more_than_max_output(fields, cut):
    # Anthropic's max_tokens is required, and Claude Code fills it with its own ceiling whatever the model.
    req = parse("chat", {**CHAT, **fields})
    req.clamp_output = True
    req.bound_output("m", 64)
    if cut is None:
        assert req.upstream_body("m") is req.raw and req.max_tokens == 20
    else:
        assert req.max_tokens == 64 and {f: sent(req).get(f) for f in cut} == cut


def test_a_dialect_names_its_own_field_in_the_refusal():
    req = parse("chat", {**CHAT, "max_tokens": 300})
    req.output_field = "max_output_tokens"
    with pytest.raises(ApiError) as e:
        req.bound_output("m", 64)
    assert e.value.param == "max_output_tokens" and e.value.message.startswith("max_output_tokens is 300")


def test_no_max_output_and_embeddings_leave_the_limit_to_the_engine():
    req = parse("chat", CHAT)
    req.bound_output("m", None)
    assert req.max_tokens is None and req.upstream_body("m") is req.raw
    emb = parse("embeddings", {"model": "m", "input": "x"})
    emb.bound_output("m", 64)
    assert emb.upstream_body("m") is emb.raw
    completion = parse("completions", {"model": "m", "prompt": "x"})
    completion.bound_output("m", 64)
    assert sent(completion)["max_tokens"] == 64


def test_added_fields_keep_the_clients_bytes_after_them():
    raw = b' {"model": "m", "stream": true, "messages": [{"role": "user", "content": "caf\xc3\xa9 \\u00e9"}], "x": 1.10}'
    req = apirequest.parse("chat", raw, 0)
    req.bound_output("m", 64)
    body = req.upstream_body("m")
    assert body.endswith(raw[2:])  # 1.10 stays 1.10, the escape stays an escape
    assert json.loads(body) == {**json.loads(raw), "stream_options": {"include_usage": True}, "max_tokens": 64}


LIMIT = 32 * 1024 * 1024  # gateway.max_body_bytes' default
SHAPES = {  # the worst a JSON value can cost in Python for its bytes, and what fits in a prompt
    "tiny objects": b'{"role":"u"}', "empty objects": b"{}", "empty lists": b"[]", "tiny strings": b'"ab"',
    "small ints": b"0", "token ids": b"12345", "floats": b"1.5", "nulls": b"null",
}


def body_of(unit: bytes, size: int) -> bytes:
    head, tail = b'{"model":"m","messages":[', b"]}"
    count = (size - len(head) - len(tail)) // (len(unit) + 1)
    return head + (unit + b",") * (count - 1) + unit + tail


def growth(raw: bytes) -> tuple[int, ApiError | None]:
    """The most memory parsing RAW took beyond RAW itself, and the refusal if there was one."""
    tracemalloc.start()
    try:
        apirequest.parse("chat", raw, 2048)
        refusal = None
    except ApiError as e:
        refusal = e
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, refusal


@pytest.mark.parametrize("size", [64 * 1024, 4 * 1024 * 1024, LIMIT - 1024])
@pytest.mark.parametrize("shape", SHAPES)
def test_no_body_under_the_limit_grows_the_worker_past_three_times_its_size(shape, size):
    # 30 MB of {"role":"u"} took a worker from 66 MB to 551 MB, and four at once to 2 GB.
    raw = body_of(SHAPES[shape], size)
    peak, refusal = growth(raw)
    assert peak <= max(3 * len(raw), jsonbound.ALLOWANCE), (peak / len(raw), refusal)
    if refusal is not None and refusal.status == 413:
        assert "MiB to read" in refusal.message and "Send fewer" in refusal.message


@pytest.mark.parametrize("text", ["a" * (LIMIT - 100), "a, [b]: {c}; " * ((LIMIT - 100) // 13), "a" * (4 << 20) + "😀"])
def test_a_long_prompt_is_read_within_the_bound(text):
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}, ensure_ascii=False).encode()
    peak, refusal = growth(raw)
    assert peak <= max(3 * len(raw), jsonbound.ALLOWANCE)
    if text.isascii():
        assert refusal is None  # commas and brackets inside a string are not structure


def test_an_embeddings_batch_of_300000_token_ids_is_read():
    raw = json.dumps({"model": "m", "input": [[10000 + i % 5000 for i in range(1000)]] * 300}).encode()
    assert len(apirequest.parse("embeddings", raw, 0).body["input"]) == 300


@pytest.mark.parametrize("raw", [
    b"[" * 100_000,
    b"[" * 100_000 + b"]" * 100_000,
    b'{"model":"m","messages":[{"role":"user","content":"x"}],"x":' + b'{"a":' * 65 + b"1" + b"}" * 65 + b"}",
    # Lists and objects in turn: a pass that took "{}" out after "[]" took two levels at once, so 67 passed.
    b'{"model":"m","messages":[{"role":"user","content":"x"}],"x":' + b'[{"a":' * 33 + b"1" + b"}]" * 33 + b"}",
    # Brackets in strings must not hide real nesting, nor pass for it.
    b'{"model":"m","messages":[],"x":' + b'["]",' * 100 + b'"["' + b"]" * 100 + b"}",
])
def test_deep_nesting_is_a_400_not_a_500(raw):
    with pytest.raises(ApiError) as e:
        apirequest.parse("chat", raw, 0)
    assert e.value.status == 400 and "levels deep" in e.value.message


def test_nesting_64_deep_and_brackets_in_strings_are_fine():
    schema = {"type": "string"}
    for _ in range(59):  # the body, its tools list, the tool and its function hold the schema: 64 levels
        schema = {"items": schema}
    body = {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
            "stop": ["[[[[", "{" * 100, "]]"]}
    assert parse("chat", body).body["stop"][1] == "{" * 100
    body["tools"][0]["function"]["parameters"] = {"items": schema}
    with pytest.raises(ApiError, match="levels deep"):
        parse("chat", body)


RSS_PROBE = """
import json, sys
from llmgw.gateway import apirequest
from llmgw.gateway.errors import ApiError
from tests.test_apirequest import SHAPES, body_of, LIMIT

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

shape = sys.argv[1]
raw = (body_of(SHAPES[shape], LIMIT - 1024) if shape in SHAPES
       else json.dumps({"model": "m", "messages": [{"role": "user", "content": "a" * (LIMIT - 100)}]}).encode())
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from here
before = status("VmRSS")
try:
    apirequest.parse("chat", raw, 2048)
except ApiError:
    pass
print((status("VmHWM") - before) / len(raw))
"""


@pytest.mark.parametrize("shape", ["tiny objects", "small ints", "a long prompt"])
def test_a_worker_grows_by_at_most_three_times_the_body(shape):
    # The measure: resident memory, not only what Python's allocator counts.
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("this kernel cannot reset a process's peak memory")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", RSS_PROBE, shape], capture_output=True, text=True, timeout=300,
                         cwd=root, env={**os.environ, "PYTHONPATH": root}, check=True)
    assert float(out.stdout) <= 3, out.stdout
