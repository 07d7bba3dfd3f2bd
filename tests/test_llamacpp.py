"""A real model behind a real gateway: llama.cpp serving SmolLM2-135M-Instruct, called with the openai client."""


import openai
import pytest

from llmgw.cli import starter
from llmgw.procs import wait_for
from tests.conftest import Gateway, make_key

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def real(tmp_path_factory, starter_engine):
    tmp = tmp_path_factory.mktemp("llamacpp-gateway")
    store_url = f"sqlite:///{tmp}/real.db"
    key = make_key(store_url)
    gw = Gateway(tmp, store_url, endpoints=[{"id": "cpu", "url": starter_engine, "models": [starter.NAME]}],
                 models=[{"name": starter.NAME, "aliases": ["smollm2"], "max_output": 512}], workers=2)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)
    yield client, gw
    client.close()
    gw.stop()


def test_a_real_answer(real):
    client, _ = real
    reply = client.chat.completions.create(model=starter.NAME, messages=QUESTION, max_tokens=40, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.prompt_tokens > 10 and reply.usage.completion_tokens > 0


def test_a_real_stream_with_usage(real):
    client, _ = real
    chunks = list(client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=40, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_a_real_stream_without_usage(real):
    client, _ = real
    chunks = list(client.chat.completions.create(model=starter.NAME, messages=QUESTION, max_tokens=10,
                                                 stream=True))
    assert chunks and all(c.usage is None for c in chunks)


def test_completions(real):
    client, _ = real
    reply = client.completions.create(model=starter.NAME, prompt="The capital of France is", max_tokens=5,
                                      temperature=0)
    assert reply.choices[0].text.strip()


def test_embeddings(real):
    client, _ = real
    result = client.embeddings.create(model=starter.NAME, input=["Paris is in France.", "Berlin is in Germany."])
    assert len(result.data) == 2 and len(result.data[0].embedding) >= 64


def test_model_list(real):
    client, _ = real
    assert {m.id for m in client.models.list()} == {starter.NAME, "smollm2"}


def test_the_gateway_reads_llamacpps_own_load_figures(real):
    client, gw = real
    # A worker reads the engines of the models it routes to: this one, once it has sent it a request.
    client.chat.completions.create(model=starter.NAME, messages=QUESTION, max_tokens=1)
    wait_for("fresh engine figures", 30, lambda: 'llmgw_endpoint_metrics_stale{replica="cpu"} 0.0' in gw.metrics())


def test_a_request_naming_no_limit_is_held_to_max_output(real):
    # max_output is 512 here. Without max_tokens, llama.cpp generated until its context was full
    # (976 tokens of a model allowed 64); a null max_completion_tokens hid a max_tokens of 300.
    client, _ = real
    count = [{"role": "user", "content": "Count from 1 to 3000, one number a line, and nothing else."}]
    reply = client.chat.completions.create(model=starter.NAME, messages=count, temperature=0,
                                           extra_body={"max_completion_tokens": None})
    assert 0 < reply.usage.completion_tokens <= 512
    with pytest.raises(openai.BadRequestError, match="max_tokens is 600, but smollm2-135m-instruct allows at most 512"):
        client.chat.completions.create(model=starter.NAME, messages=count, max_tokens=600,
                                       extra_body={"max_completion_tokens": None})


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_chats_with_tools_are_answered_whole_and_streamed(real):
    # llama.cpp takes `tools` only with its Jinja templates on (`--jinja`); without, 500 "tools param
    # requires --jinja flag". SmolLM2-135M's template leaves the tools out of its prompt, so the model never
    # calls one: what this holds is that the request, and the tool result that would follow a call, pass.
    client, _ = real
    ask = [{"role": "user", "content": "What is the weather in Paris? Use the get_weather tool."}]
    reply = client.chat.completions.create(model=starter.NAME, messages=ask, tools=WEATHER, max_tokens=20,
                                           temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    chunks = list(client.chat.completions.create(model=starter.NAME, messages=ask, tools=WEATHER, max_tokens=20,
                                                 temperature=0, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    back = ask + [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees"}]
    reply = client.chat.completions.create(model=starter.NAME, messages=back, tools=WEATHER, max_tokens=20,
                                           temperature=0)
    assert reply.choices[0].message.content


def test_a_prompt_longer_than_the_context_is_refused_saying_so(real):
    # Claude Code's 9,000-token prompt to this model got a 400 that did not say why, and was sent six times.
    client, _ = real
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=starter.NAME, messages=[{"role": "user", "content": "hello " * 3000}],
                                       max_tokens=8)
    error = refused.value.body
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "does not fit smollm2-135m-instruct's context" in error["message"]
