"""Tool calls through a real gateway, whole and streamed: a scripted `llmgw sim` calls a tool, the client runs
it and sends the result back, and the answer quotes it. What the Responses and Messages APIs will translate
into chat completions must pass these intact."""

import json

import openai
import pytest

from tests.conftest import Gateway, Sim, make_key

ARGUMENTS = '{"command": ["echo", "hi"], "timeout": 10}'
SHELL = [{"type": "function", "function": {
    "name": "shell", "description": "Run a command",
    "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}},
                                                    "timeout": {"type": "integer"}}}}}]
ASK = [{"role": "user", "content": "Say hi with the shell."}]
OUTPUT = "hi\n(exit 0)"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools")
    url = f"sqlite:///{tmp}/gw.db"
    key = make_key(url)  # before the gateway, whose workers read the keys as they start
    # A token every 5 ms: each fragment of the arguments leaves the engine in a write of its own.
    sim = Sim(model="sim", replica="t", ttft_ms=1, tokens_per_s=200, tool_call=("shell", ARGUMENTS))
    try:
        gw = Gateway(tmp, url, endpoints=[{"id": "t", "url": sim.url, "models": ["sim"]}], workers=2)
    except Exception:
        sim.stop()
        raise
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)
    yield client
    client.close()
    gw.stop()
    sim.stop()


def result_of(call_id: str, name: str, arguments: str) -> list[dict]:
    """The conversation after the model called NAME and the client ran it."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": call_id, "content": OUTPUT}]


def test_a_tool_round_trip_whole(client):
    reply = client.chat.completions.create(model="sim", messages=ASK, tools=SHELL)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "shell"
    assert call.function.arguments == ARGUMENTS and json.loads(call.function.arguments)["command"] == ["echo", "hi"]
    assert reply.usage.completion_tokens > 0

    answer = client.chat.completions.create(model="sim", messages=result_of(call.id, "shell", ARGUMENTS),
                                            tools=SHELL)
    assert answer.choices[0].finish_reason == "stop" and OUTPUT in answer.choices[0].message.content


def test_a_tool_round_trip_streamed(client):
    chunks = list(client.chat.completions.create(model="sim", messages=ASK, tools=SHELL, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [c.choices[0] for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in d.delta.tool_calls or []]
    # The first piece names the call; the arguments follow in several pieces, to be joined by the client.
    assert calls[0].id.startswith("call_") and calls[0].function.name == "shell" and calls[0].type == "function"
    assert all(tc.index == 0 for tc in calls) and all(tc.id is None for tc in calls[1:])
    assert len(calls) > 3 and "".join(tc.function.arguments or "" for tc in calls) == ARGUMENTS
    assert deltas[-1].finish_reason == "tool_calls"
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(calls)

    stream = client.chat.completions.create(model="sim", messages=result_of(calls[0].id, "shell", ARGUMENTS),
                                            tools=SHELL, stream=True)
    pieces = [c.choices[0] for c in stream if c.choices]
    text = "".join(p.delta.content or "" for p in pieces)
    assert len(pieces) > 2 and OUTPUT in text and pieces[-1].finish_reason == "stop"


def test_a_chat_offering_other_tools_is_answered_with_text(client):
    other = [{"type": "function", "function": {"name": "Bash", "parameters": {"type": "object"}}}]
    reply = client.chat.completions.create(model="sim", messages=ASK, tools=other, max_tokens=3)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content == "tok0 tok1 tok2 "
