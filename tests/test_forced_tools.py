"""A tool_choice naming one tool, through a real gateway to real llama.cpp serving the starter model
(SmolLM2-135M-Instruct), in each API a client may speak: the answer is a call of that tool.

llama.cpp reads only a string tool_choice: the object form was taken for "auto" (a warning in its log),
and the starter model's chat template has no place for tools at all, so llama.cpp left them out of the
prompt and "required" did nothing either. These tests fail wherever the gateway passes the choice on as
it came; they hold that it is asked for in a form every engine enforces (llmgw/gateway/apirequest.py)
and that the answer comes back as the call (llmgw/gateway/dialect.py)."""

import json

import anthropic
import openai
import pytest

from llmgw.cli import starter
from llmgw.gateway.dialect import ForcedCall, forced_answer
from tests.conftest import Gateway, make_key

# Two tools, the one forced second, with arguments a tiny model can finish: an enum, and nothing more.
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
        "required": ["city"], "additionalProperties": False}
ZONE = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                "parameters": CITY}},
              {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                                "parameters": ZONE}}]
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def gw(tmp_path_factory, starter_engine):
    tmp = tmp_path_factory.mktemp("forced-tools")
    store_url = f"sqlite:///{tmp}/gw.db"
    key = make_key(store_url)
    gateway = Gateway(tmp, store_url, endpoints=[{"id": "cpu", "url": starter_engine, "models": [starter.NAME]}],
                      models=[{"name": starter.NAME, "max_output": 64}], workers=1)
    yield gateway, key
    gateway.stop()


@pytest.fixture(scope="module")
def chat(gw):
    client = openai.OpenAI(base_url=gw[0].url + "/v1", api_key=gw[1], max_retries=0, timeout=240)
    yield client
    client.close()


def _zone(arguments: str) -> str:
    return json.loads(arguments)["zone"]


def test_chat_forced_call_whole(chat):
    reply = chat.chat.completions.create(
        model=starter.NAME, messages=[{"role": "user", "content": ASK}], tools=CHAT_TOOLS, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_time"
    assert _zone(call.function.arguments) in ("UTC", "CET")


def test_the_readme_example(chat):
    # README.md: told which tool, the starter model fills in its arguments.
    reply = chat.chat.completions.create(
        model=starter.NAME, messages=[{"role": "user", "content": "What's the weather in Paris?"}], temperature=0,
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(reply.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_chat_forced_call_streamed(chat):
    chunks = list(chat.chat.completions.create(
        model=starter.NAME, messages=[{"role": "user", "content": ASK}], tools=CHAT_TOOLS, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, stream=True,
        stream_options={"include_usage": True}))
    pieces = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or ()]
    assert pieces[0].function.name == "get_time" and pieces[0].id.startswith("call_")
    assert all(p.index == 0 and p.id is None for p in pieces[1:])
    assert _zone("".join(p.function.arguments or "" for p in pieces)) in ("UTC", "CET")
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens > 0


def test_chat_naming_a_tool_not_offered_is_refused(chat):
    with pytest.raises(openai.BadRequestError, match="no tool of that name is offered") as e:
        chat.chat.completions.create(model=starter.NAME, messages=[{"role": "user", "content": ASK}],
                                     tools=CHAT_TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice" and "'get_weather', 'get_time'" in e.value.body["message"]


def test_messages_forced_tool_use(gw):
    client = anthropic.Anthropic(base_url=gw[0].url, api_key=gw[1], max_retries=0, timeout=240)
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": CITY},
             {"name": "get_time", "description": "Time in a zone", "input_schema": ZONE}]
    ask = [{"role": "user", "content": ASK}]
    forced = {"tools": tools, "tool_choice": {"type": "tool", "name": "get_time"},
              "extra_body": {"temperature": 0}}  # this SDK takes no temperature argument
    message = client.messages.create(model=starter.NAME, max_tokens=64, messages=ask, **forced)
    assert message.stop_reason == "tool_use"
    [use] = message.content
    assert use.type == "tool_use" and use.name == "get_time" and use.input["zone"] in ("UTC", "CET")
    with client.messages.stream(model=starter.NAME, max_tokens=64, messages=ask, **forced) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.name for b in final.content] == ["get_time"]
    assert final.content[0].input["zone"] in ("UTC", "CET")
    # A tool that is not offered (a server tool is left out) is refused in Anthropic's shape, not dropped.
    with pytest.raises(anthropic.BadRequestError, match="no tool of that name is offered"):
        client.messages.create(model=starter.NAME, max_tokens=64, messages=ask, tools=tools[:1],
                               tool_choice={"type": "tool", "name": "get_time"})
    client.close()


def test_responses_forced_function_call(chat):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": CITY},
             {"type": "function", "name": "get_time", "description": "Time in a zone", "parameters": ZONE}]
    reply = chat.responses.create(model=starter.NAME, input=ASK, tools=tools, temperature=0,
                                  tool_choice={"type": "function", "name": "get_time"})
    [item] = reply.output
    assert item.type == "function_call" and item.name == "get_time" and _zone(item.arguments) in ("UTC", "CET")
    with chat.responses.stream(model=starter.NAME, input=ASK, tools=tools, temperature=0,
                               tool_choice={"type": "function", "name": "get_time"}) as stream:
        final = stream.get_final_response()
    assert [(i.type, i.name) for i in final.output] == [("function_call", "get_time")]
    assert _zone(final.output[0].arguments) in ("UTC", "CET")
    # Every tool left out (it runs on OpenAI's servers): naming a function is refused, not dropped.
    with pytest.raises(openai.BadRequestError, match="not among the tools offered"):
        chat.responses.create(model=starter.NAME, input=ASK, tools=[{"type": "web_search"}],
                              tool_choice={"type": "function", "name": "get_time"})


# --- the translation alone, for what a real engine seldom sends ------------------------------------


def test_an_answer_that_is_not_a_chat_answer_passes_as_it_came():
    for data in (b"not json", b"[]", b'{"error": {"message": "x"}}', b'{"choices": [{"message": 3}]}'):
        assert forced_answer(data, "f", "call_1") == data


def test_a_stream_choice_that_ends_before_any_text_still_calls_the_tool():
    forced = ForcedCall("f", None, "call_1")
    out = forced.feed(b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": null}}]}\n\n'
                      b': a comment\n\n'
                      b'data: {"choices": [{"index": [1], "delta": {}, "finish_reason": "stop"}]}\n\n'
                      b'data: {"choices": [], "usage": {"completion_tokens": 0}}\n\ndata: [DONE]\n\n')
    events = out.split(b"\n\n")
    assert json.loads(events[0][5:])["choices"][0]["delta"] == {"role": "assistant"}
    assert events[1] == b": a comment"
    last = json.loads(events[2][5:])["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    assert last["delta"]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert events[3:] == [b'data: {"choices": [], "usage": {"completion_tokens": 0}}', b"data: [DONE]", b""]
