"""Anthropic's Messages API through a real gateway (gunicorn, two gevent workers) in front of scripted
`llmgw sim` engines, spoken by the official `anthropic` SDK, and the requests Claude Code itself sends."""

import json
import os
import time
import urllib.request
from types import SimpleNamespace

import anthropic
import pytest

from llmgw import store
from llmgw.gateway.errors import ApiError
from llmgw.gateway.messages import MESSAGES, to_chat
from llmgw.gateway.sse import DONE
from tests.conftest import Gateway, Sim, count_usage, gateway_over, make_key, post, wait_until

REPLY = "Hello from the sim."
COMMAND = '{"command": "echo hello-from-tool"}'
BASH = {"name": "Bash", "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
CLAUDE_REQUESTS = os.path.join(os.path.dirname(__file__), "fixtures", "clients", "claude-requests.json")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("messages")
    url = f"sqlite:///{tmp}/gw.db"
    key = make_key(url)  # before the gateway, whose workers read the keys as they start
    only_coder = make_key(url, "coder only", models=["coder"])
    sims = {"local": Sim(model="local", replica="l", ttft_ms=1, tokens_per_s=500, reply=REPLY),
            # Calls Bash when offered it, then quotes the tool's result; eight words a reply otherwise.
            "coder": Sim(model="coder", replica="c", ttft_ms=1, tokens_per_s=500, tool_call=("Bash", COMMAND),
                         reply="one two three four five six seven eight"),
            # One answer at a time and none waiting: a second request meets a 429.
            "busy": Sim(model="busy", replica="b", ttft_ms=1, tokens_per_s=5, max_concurrency=1, max_queue=0),
            # Whole answers that are not JSON, and streams that end in an engine's error event.
            "garbled": Sim(model="garbled", replica="g", ttft_ms=1, tokens_per_s=500, garbled=True)}
    # Claude Code asks for claude-* names (a main model and a small fast one), which operators alias.
    models = [{"name": "local", "aliases": ["claude-sonnet-4-6", "claude-sonnet-4-5", "claude-haiku-4-5"], "max_output": 1000},
              {"name": "coder", "aliases": ["test-model"], "max_output": 4},
              {"name": "busy"}, {"name": "garbled"}]
    with gateway_over(tmp, url, sims, models, workers=2, gateway__queue_wait=0.0) as gw:
        e = SimpleNamespace(gw=gw, url=gw.url, key=key, only_coder=only_coder, sims=sims, store=url)
        e.client = anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=30)
        yield e
        e.client.close()


def events_of(url: str, body: dict, headers: dict) -> list[tuple[str, dict]]:
    """The (event, data) pairs of a raw streamed answer."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["Content-Type"] == "text/event-stream"
        text = resp.read().decode()
    pairs = []
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if line and not line.startswith(":"))
        if lines:
            pairs.append((lines["event"], json.loads(lines["data"])))
    return pairs


def assert_well_formed(events: list[tuple[str, dict]]) -> None:
    """Anthropic's order: message_start, blocks each started, filled and stopped in turn, message_delta, message_stop;
    every event's data names its own type, and each delta is of its block's kind."""
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    assert all(data["type"] == name for name, data in events)
    usage = events[0][1]["message"]["usage"]
    assert isinstance(usage["input_tokens"], int) and isinstance(usage["output_tokens"], int)
    open_block, next_index, kind = None, 0, None
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_block is None and data["index"] == next_index
            open_block, next_index, kind = data["index"], next_index + 1, data["content_block"]["type"]
        elif name == "content_block_delta":
            assert data["index"] == open_block, (data, open_block)
            assert data["delta"]["type"] == {"text": "text_delta", "tool_use": "input_json_delta"}[kind], data
        elif name == "content_block_stop":
            assert data["index"] == open_block
            open_block = None
        else:
            assert name == "ping"
    assert open_block is None


def test_a_message(env):
    message = env.client.messages.create(model="claude-sonnet-4-6", max_tokens=100,
                                         messages=[{"role": "user", "content": "Hello?"}])
    assert message.model == "claude-sonnet-4-6" and message.role == "assistant"
    assert message.id.startswith("msg_") and [b.type for b in message.content] == ["text"]
    assert message.content[0].text == REPLY and message.stop_reason == "end_turn"
    assert message.usage.input_tokens == 1 and message.usage.output_tokens == 4


def test_a_system_prompt_as_a_string_and_as_blocks(env):
    for system in ("You are terse.", [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
                                      {"type": "text", "text": "Answer in English."}]):
        message = env.client.messages.create(model="claude-haiku-4-5", max_tokens=50, system=system,
                                             messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
        assert message.content[0].text == REPLY
        # The sim counts the words of every message's text: the system prompt reached the engine.
        assert message.usage.input_tokens == len(_text(system).split()) + 1


def _text(system) -> str:
    return system if isinstance(system, str) else " ".join(b["text"] for b in system)


def test_a_stream(env):
    with env.client.messages.stream(model="claude-sonnet-4-6", max_tokens=100,
                                    messages=[{"role": "user", "content": "Stream, please"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == REPLY
    assert [e.type for e in events if e.type in ("message_start", "message_stop")] == ["message_start",
                                                                                        "message_stop"]
    assert final.content[0].text == REPLY and final.stop_reason == "end_turn" and final.model == "claude-sonnet-4-6"
    # message_start's input_tokens is an estimate; message_delta carries the engine's count.
    assert final.usage.input_tokens == 2 and final.usage.output_tokens == 4


def test_a_raw_stream_is_well_formed_with_either_credential_and_a_query_string(env):
    # The SDK warns of claude-sonnet-4-5 as deprecated at Anthropic; Claude Code versions that ask for it remain.
    body = {"model": "claude-sonnet-4-5", "max_tokens": 100, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    beta = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}
    for credential in ({"x-api-key": env.key}, {"Authorization": f"Bearer {env.key}"}):
        events = events_of(env.url + "/v1/messages?beta=true", body, {**credential, **beta})
        assert_well_formed(events)
        assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == REPLY
        assert events[-2][1]["delta"]["stop_reason"] == "end_turn"
        assert events[0][1]["message"]["model"] == "claude-sonnet-4-5"
    bearer = anthropic.Anthropic(base_url=env.url, auth_token=env.key, max_retries=0, timeout=30)
    assert bearer.messages.create(model="claude-sonnet-4-6", max_tokens=10,
                                  messages=[{"role": "user", "content": "hi"}]).content[0].text == REPLY
    bearer.close()


def test_a_tool_round_trip(env):
    ask = [{"role": "user", "content": "Say hello with Bash."}]
    message = env.client.messages.create(model="coder", max_tokens=1000, tools=[BASH], messages=ask)
    assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["tool_use"]
    call = message.content[0]
    assert call.name == "Bash" and call.input == json.loads(COMMAND)
    history = ask + [{"role": "assistant", "content": [c.model_dump(exclude_none=True) for c in message.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": [{"type": "text", "text": "hello-from-tool"}]}]}]
    answer = env.client.messages.create(model="coder", max_tokens=1000, tools=[BASH], messages=history)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.content[0].text.startswith("The tool said:")


def test_a_streamed_tool_call_fills_one_block(env):
    with env.client.messages.stream(model="coder", max_tokens=1000, tools=[BASH], tool_choice={"type": "any"},
                                    messages=[{"role": "user", "content": "Run it"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(deltas) > 1 and "".join(deltas) == COMMAND  # the engine's fragments, each passed on
    assert final.stop_reason == "tool_use" and final.content[0].input == json.loads(COMMAND)
    body = {"model": "coder", "max_tokens": 100, "stream": True, "tools": [BASH],
            "messages": [{"role": "user", "content": "Run it"}]}
    assert_well_formed(events_of(env.url + "/v1/messages", body, {"x-api-key": env.key}))


def test_count_tokens(env):
    counted = env.client.messages.count_tokens(model="claude-sonnet-4-6", system="Be brief.",
                                               messages=[{"role": "user", "content": "two words"}])
    # The sim's tokenizer: a token a word of the chat's text (no template of its own).
    assert counted.input_tokens == 4
    with pytest.raises(anthropic.NotFoundError):
        env.client.messages.count_tokens(model="claude-opus-9", messages=[{"role": "user", "content": "x"}])
    wait_until("the count's usage row", 30,
               lambda: count_usage(env.store, endpoint="messages.count_tokens", status=200) >= 1)


def test_max_tokens_is_required(env):
    status, _, raw = post(env.url + "/v1/messages", {"model": "local", "messages": [{"role": "user", "content": "x"}]},
                          env.key)
    body = json.loads(raw)
    assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens is required" in body["error"]["message"] and "request id" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="messages"):
        env.client.messages.create(model="local", max_tokens=10, messages=[])


def test_errors_in_anthropics_shape(env):
    bad = anthropic.Anthropic(base_url=env.url, api_key="llmgw-not-a-key", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="local", max_tokens=10, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    assert e.value.response.headers["x-should-retry"] == "false"  # Claude Code would try ten times
    bad.close()
    with pytest.raises(anthropic.NotFoundError) as e:
        env.client.messages.create(model="claude-opus-9", max_tokens=10, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-sonnet-4-6" in e.value.body["error"]["message"]
    limited = anthropic.Anthropic(base_url=env.url, api_key=env.only_coder, max_retries=0, timeout=30)
    with pytest.raises(anthropic.PermissionDeniedError) as e:
        limited.messages.create(model="local", max_tokens=10, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "permission_error"
    with pytest.raises(anthropic.PermissionDeniedError):
        limited.messages.count_tokens(model="local", messages=[{"role": "user", "content": "x"}])
    limited.close()


def test_a_full_engine_is_a_429_with_retry_after(env):
    with env.client.messages.stream(model="busy", max_tokens=50, messages=[{"role": "user", "content": "x"}]) as held:
        wait_until("the engine to be busy", 30,
                   lambda: env.sims["busy"].metrics()["vllm:num_requests_running"] == 1)
        with pytest.raises(anthropic.RateLimitError) as e:
            env.client.messages.create(model="busy", max_tokens=5, messages=[{"role": "user", "content": "y"}])
        held.close()
    assert e.value.body["error"]["type"] == "rate_limit_error" and e.value.response.headers["Retry-After"]
    assert "x-should-retry" not in e.value.response.headers


def test_a_limit_above_the_models_is_cut_and_says_so(env):
    # Claude Code sends max_tokens 32000 whatever the model; coder allows 4.
    message = env.client.messages.create(model="test-model", max_tokens=32000,
                                         messages=[{"role": "user", "content": "Count to eight"}])
    assert message.stop_reason == "max_tokens" and message.content[0].text == "one two three four"
    assert message.usage.output_tokens == 4 and message.model == "test-model"


def test_usage_rows_say_messages(env):
    started = time.time()
    env.client.messages.create(model="claude-haiku-4-5", max_tokens=10, messages=[{"role": "user", "content": "row"}])
    with env.client.messages.stream(model="claude-haiku-4-5", max_tokens=10,
                                    messages=[{"role": "user", "content": "a row"}]) as stream:
        stream.get_final_message()
    engine = store.open_engine(env.store)

    def rows():
        with engine.connect() as conn:
            return conn.execute(store.usage.select().where(store.usage.c.at >= started)
                                .where(store.usage.c.endpoint == "messages")).all()

    try:
        wait_until("two usage rows", 30, lambda: len(rows()) == 2)
        for row in rows():
            assert (row.model_asked, row.model_served, row.status) == ("claude-haiku-4-5", "local", 200)
            assert row.completion_tokens == 4 and row.prompt_tokens in (1, 2)
    finally:
        engine.dispose()


def test_every_answer_says_what_the_gateway_added(env):
    status, headers, _ = post(env.url + "/v1/messages", {"model": "local", "max_tokens": 5,
                                                          "messages": [{"role": "user", "content": "x"}]}, env.key)
    assert status == 200 and float(headers["X-Llmgw-Overhead-Ms"]) < 200


def test_an_engine_dying_mid_stream_ends_with_an_error_event(tmp_path, make_sim, make_gateway):
    dying = make_sim(model="sim", replica="dying", ttft_ms=1, tokens_per_s=50, die_after=1)
    url = f"sqlite:///{tmp_path}/gw.db"
    key = make_key(url)
    gw = make_gateway(store_url=url, endpoints=[{"id": "dying", "url": dying.url, "models": ["sim"]}])
    client = anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=20)
    seen = []
    with pytest.raises(anthropic.APIStatusError, match="failed") as e:
        with client.messages.stream(model="sim", max_tokens=10, messages=[{"role": "user", "content": "x"}]) as s:
            for event in s:
                seen.append(event.type)
    assert "content_block_delta" in seen and e.value.body["error"]["type"] == "api_error"
    client.close()
    wait_until("the usage row", 30, lambda: count_usage(url, status=502, endpoint="messages") == 1)


def claude_code_requests() -> list:
    """Every Messages request Claude Code made in the recorded scenarios (tests/fixtures/clients)."""
    with open(CLAUDE_REQUESTS) as f:
        recorded = json.load(f)
    return [pytest.param(r, id=f"{s['name']}-{i}") for s in recorded["scenarios"]
            for i, r in enumerate(s["requests"]) if r["method"] == "POST" and r["path"].startswith("/v1/messages")]


@pytest.mark.parametrize("recorded", claude_code_requests())
def test_claude_codes_own_requests_are_answered(env, recorded):
    body, headers = recorded["body"], dict(recorded["headers"])
    headers = {k: v for k, v in headers.items() if k not in ("x-api-key", "authorization", "accept-encoding",
                                                             "connection")}
    headers["x-api-key"] = env.key
    url = env.url + recorded["path"]
    offered_result = body["messages"][-1]["content"][-1].get("type") == "tool_result" \
        if isinstance(body["messages"][-1]["content"], list) else False
    if body.get("stream"):
        events = events_of(url, body, headers)
        assert_well_formed(events)
        blocks = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
        stop = events[-2][1]["delta"]["stop_reason"]
    else:
        status, _, raw = post(url, body, headers=headers)
        assert status == 200, raw
        message = json.loads(raw)
        blocks, stop = [b["type"] for b in message["content"]], message["stop_reason"]
    # The scripted engine calls Bash when offered it, and quotes the result once it has one.
    if offered_result:
        assert blocks == ["text"] and stop in ("end_turn", "max_tokens")
    else:
        assert blocks == ["tool_use"] and stop == "tool_use"


# --- the translation alone, on engine streams the sim does not make -----------------------------------------


def chunk(delta: dict | None = None, finish: str | None = None, **extra) -> bytes:
    choices = [{"index": 0, "delta": delta or {}, "finish_reason": finish, **extra}]
    return b"data: " + json.dumps({"choices": choices}).encode() + b"\n\n"


def translated(*pieces: bytes, stop_sequences=None) -> list[tuple[str, dict]]:
    body = {"model": "m", "max_tokens": 10, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    if stop_sequences:
        body["stop_sequences"] = stop_sequences
    req = MESSAGES.parse("chat", json.dumps(body).encode(), 0)
    stream = MESSAGES.stream(req)
    out = b"".join(stream.feed(p) for p in pieces) + stream.end()
    return [(block.split("\n")[0][7:], json.loads(block.split("\n")[1][6:]))
            for block in out.decode().split("\n\n") if block]


def call(index: int, name=None, arguments="", id=None) -> dict:
    function = {"arguments": arguments, **({"name": name} if name else {})}
    return {"tool_calls": [{"index": index, **({"id": id, "type": "function"} if id else {}), "function": function}]}


def test_text_after_a_call_is_held_for_a_block_of_its_own():
    events = translated(chunk({"role": "assistant", "content": "Let me look."}),
                        chunk(call(0, "Read", "", "c0")), chunk({"content": " (thinking aloud)"}),
                        chunk(call(0, arguments='{"path": ')), chunk(call(0, arguments='"a"}')),
                        chunk(call(1, "Bash", '{"command": "ls"}', "c1")), chunk(finish="tool_calls"),
                        b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 9}}\n\n' + DONE)
    assert_well_formed(events)
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [(b["type"], b.get("name")) for b in starts] == [("text", None), ("tool_use", "Read"),
                                                           ("tool_use", "Bash"), ("text", None)]
    deltas = {}
    for name, data in events:
        if name == "content_block_delta":
            piece = data["delta"].get("partial_json", data["delta"].get("text"))
            deltas[data["index"]] = deltas.get(data["index"], "") + piece
    assert deltas == {0: "Let me look.", 1: '{"path": "a"}', 2: '{"command": "ls"}', 3: " (thinking aloud)"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert events[-2][1]["usage"]["input_tokens"] == 7 and events[-2][1]["usage"]["output_tokens"] == 9


def test_a_call_whose_name_comes_late_keeps_its_arguments():
    events = translated(chunk(call(0, id="c0", arguments='{"a":')), chunk(call(0, "Edit", " 1}")),
                        chunk(finish="tool_calls"))
    assert_well_formed(events)
    start = next(d for n, d in events if n == "content_block_start")["content_block"]
    assert (start["id"], start["name"]) == ("c0", "Edit")
    assert "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta") == '{"a": 1}'


def test_a_call_index_that_is_not_a_number_is_the_first_call():
    # llama.cpp and others leave the index out of a lone call; null is taken so too, not as "no call open".
    events = translated(chunk({"content": "hi"}), chunk({"tool_calls": [{"index": None, "id": "c0",
                                                                        "function": {"name": "f"}}]}),
                        chunk({"tool_calls": [{"index": None, "function": {"arguments": '{"a":1}'}}]}),
                        chunk({"tool_calls": [{"index": [], "function": {"arguments": "}"}}]}), chunk(finish="stop"))
    assert_well_formed(events)
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [(b["type"], b.get("name")) for b in starts] == [("text", None), ("tool_use", "f")]
    assert "".join(d["delta"].get("partial_json", "") for n, d in events if n == "content_block_delta") == \
        '{"a":1}}'


def test_a_name_that_comes_after_a_later_call_began_is_kept():
    events = translated(chunk(call(0, arguments='{"a"')), chunk(call(1, "f", "{}", "c1")),
                        chunk(call(0, "g", ":1}", "c0")), chunk(finish="tool_calls"))
    assert_well_formed(events)
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [(b["id"], b["name"]) for b in starts] == [("c0", "g"), ("c1", "f")]
    deltas = [(d["index"], d["delta"]["partial_json"]) for n, d in events if n == "content_block_delta"]
    assert deltas == [(0, '{"a":1}'), (1, "{}")]
    # A call whose name never comes still gets its block, nameless, so its arguments are not lost.
    events = translated(chunk(call(0, arguments='{"b": 2}')), chunk(finish="tool_calls"))
    assert_well_formed(events)
    assert [d["content_block"]["name"] for n, d in events if n == "content_block_start"] == [""]


def test_an_engine_error_mid_stream_ends_it_with_an_error_event():
    body = {"model": "m", "max_tokens": 10, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    stream = MESSAGES.stream(MESSAGES.parse("chat", json.dumps(body).encode(), 0))
    out = stream.feed(chunk({"content": "partial"}) + b'data: {"error": {"message": "secret 10.0.0.5 boom"}}\n\n'
                      + chunk({"content": "never"}) + DONE) + stream.end()
    events = [(block.split("\n")[0][7:], json.loads(block.split("\n")[1][6:]))
              for block in out.decode().split("\n\n") if block]
    assert [n for n, _ in events] == ["message_start", "ping", "content_block_start", "content_block_delta", "error"]
    assert events[-1][1]["error"]["type"] == "api_error" and "10.0.0.5" not in out.decode()
    assert stream.fail(ApiError(502, "x", "y")) == b""  # ended once


def test_odd_types_in_a_whole_answer_cost_only_themselves():
    req = MESSAGES.parse("chat", json.dumps({"model": "m", "max_tokens": 5,
                                             "messages": [{"role": "user", "content": "x"}]}).encode(), 0)
    data = json.dumps({"choices": [{"index": 0, "finish_reason": ["stop"], "message": {
        "content": ["not", "text"],
        "tool_calls": [1, None, {"id": 7, "function": {"name": "Bash", "arguments": {"command": "ls"}}},
                       {"function": {"name": "Read", "arguments": "[1]"}}]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": "9"}}).encode()
    message = json.loads(MESSAGES.answer(req, data))
    assert [(b["type"], b["name"], b["input"]) for b in message["content"]] == [
        ("tool_use", "Bash", {}), ("tool_use", "Read", {})]
    assert message["stop_reason"] == "tool_use" and message["usage"]["output_tokens"] == 0
    for data in (b"<html>oops</html>", b"[]", b'{"choices": []}', b'{"choices": [{"message": null}]}'):
        with pytest.raises(ApiError) as e:
            MESSAGES.answer(req, data)
        assert e.value.status == 502


def test_an_unreadable_answer_is_a_502_in_anthropics_shape_and_is_accounted_for(env):
    with pytest.raises(anthropic.APIStatusError) as e:
        env.client.messages.create(model="garbled", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 502 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "api_error" and "could not be read" in e.value.body["error"]["message"]
    wait_until("the usage row", 30, lambda: count_usage(env.store, status=502, endpoint="messages") == 1)
    seen = []
    with pytest.raises(anthropic.APIStatusError, match="engine failed while answering"):
        with env.client.messages.stream(model="garbled", max_tokens=5,
                                        messages=[{"role": "user", "content": "x"}]) as s:
            for event in s:
                seen.append(event.type)
    assert "content_block_delta" in seen
    # Its usage row says it failed, not 200.
    wait_until("the stream's usage row", 30, lambda: count_usage(env.store, status=502, endpoint="messages") == 2)


def test_a_stop_sequence_vllm_names_is_reported():
    events = translated(chunk({"content": "one two"}), chunk(finish="stop", stop_reason="END"),
                        stop_sequences=["END"])
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    empty = translated(chunk(finish="length"))
    assert_well_formed(empty)
    assert empty[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_the_request_is_read_into_a_chat():
    chat = to_chat({
        "model": "m", "max_tokens": 5, "top_k": 20, "stop_sequences": ["x"], "metadata": {"user_id": "u"},
        "thinking": {"type": "adaptive"}, "service_tier": "auto", "mcp_servers": [], "container": "c",
        "tool_choice": {"type": "tool", "name": "Bash", "disable_parallel_tool_use": True},
        "tools": [BASH, {"type": "web_search_20250305", "name": "web_search"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                          "content": "boom"}, {"type": "text", "text": "and?"}]}]}, True)
    assert chat["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "see"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "Bash", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: boom"},
        {"role": "user", "content": "and?"}]
    assert [t["function"]["name"] for t in chat["tools"]] == ["Bash"]  # the server tool is left out
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "Bash"}}
    assert (chat["parallel_tool_calls"], chat["top_k"], chat["stop"]) == (False, 20, ["x"])
    assert not {"metadata", "thinking", "service_tier", "mcp_servers", "container"} & set(chat)


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "t"}]}, "tools[0].input_schema"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "some"}}, "tool_choice.type"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": []}}, "tool_choice.type"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": {}}}, "tool_choice.type"),
    ({"messages": [{"role": "user", "content": [{"type": []}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": {}}]}, None),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
])
def test_a_bad_request_names_the_field(body, field):
    if field is None:  # taken: what this gateway does not run is left out
        to_chat({"model": "m", "max_tokens": 5, **body}, True)
        return
    with pytest.raises(ApiError) as e:
        to_chat({"model": "m", "max_tokens": 5, **body}, True)
    assert e.value.status == 400 and e.value.param == field


def test_a_wrong_role_names_every_role_taken():
    with pytest.raises(ApiError, match="a role is user, assistant or system"):
        to_chat({"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, True)


def test_lone_surrogates_go_to_the_engine_as_the_escapes_they_came_in():
    raw = json.dumps({"model": "m", "max_tokens": 5, "system": "\udfff",
                      "messages": [{"role": "user", "content": "hi \ud800"}]}).encode()
    req = MESSAGES.parse("chat", raw, 2048)
    assert b"hi \\ud800" in req.raw  # UTF-8 the engine can read, as a chat client's same text would be
    assert json.loads(req.raw.decode())["messages"] == [{"role": "system", "content": "\udfff"},
                                                        {"role": "user", "content": "hi \ud800"}]
    answer = json.dumps({"choices": [{"message": {"content": "\udc00"}, "finish_reason": "stop"}]}).encode()
    assert json.loads(MESSAGES.answer(req, answer).decode())["content"][0]["text"] == "\udc00"


def test_a_real_model_counts_and_answers(tmp_path, starter_engine):
    """llama.cpp serving SmolLM2: count_tokens renders the chat with the model's template, to the token the
    engine then reads."""
    from llmgw.cli import starter

    url = f"sqlite:///{tmp_path}/real.db"
    key = make_key(url)
    gw = Gateway(tmp_path, url, endpoints=[{"id": "cpu", "url": starter_engine, "models": [starter.NAME]}],
                 models=[{"name": starter.NAME, "aliases": ["claude-haiku-4-5"], "max_output": 64}], workers=1)
    client = anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=60)
    try:
        ask = dict(model="claude-haiku-4-5", system="You answer in one sentence.",
                   messages=[{"role": "user", "content": "What is the capital of France?"}])
        counted = client.messages.count_tokens(**ask).input_tokens
        message = client.messages.create(max_tokens=32000, extra_body={"temperature": 0}, **ask)
        assert "Paris" in message.content[0].text
        assert counted == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
        with client.messages.stream(max_tokens=32000, extra_body={"temperature": 0}, **ask) as stream:
            assert "Paris" in "".join(stream.text_stream)
            assert stream.get_final_message().stop_reason in ("end_turn", "max_tokens")
    finally:
        client.close()
        gw.stop()
