"""OpenAI's Responses API (`POST /v1/responses`) through a real gateway in front of simulated engines,
with the official openai SDK; and the translation both ways, as pure functions, for the edge cases."""

import json
import os
import time
from types import SimpleNamespace

import openai
import pytest

from llmgw import store
from llmgw.gateway import requestid, responsesout
from llmgw.gateway.errors import ApiError
from llmgw.gateway.responses import RESPONSES, to_chat
from llmgw.people import keys, limits
from tests.conftest import Sim, codex, count_usage, gateway_over, post, wait_until

SHELL_ARGUMENTS = '{"command": ["echo", "hi"]}'
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hello\n*** End Patch\n"
SHELL = {"type": "function", "name": "shell", "description": "Run a command",
         "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}}}
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
               "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch hunk+ end_patch"}}
CODEX_REQUESTS = os.path.join(os.path.dirname(__file__), "fixtures", "clients", "codex-requests.json")
CODEX_COMMAND = "echo hello-from-tool > out.txt; cat out.txt"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses")
    url = f"sqlite:///{tmp}/gw.db"
    engine = store.open_store(url)
    try:
        key = keys.create_key(engine, "responses")[1]
        record, limited = keys.create_key(engine, "limited")
        limits.set_limits(engine, "key", record.id, "test", rpm=2)
    finally:
        engine.dispose()
    sims = {
        "sim": Sim(model="sim", replica="s", ttft_ms=5, tokens_per_s=500),
        # A token every 5 ms: each fragment of a call's arguments leaves the engine in a write of its own.
        "shell": Sim(model="shell", replica="t", ttft_ms=1, tokens_per_s=200, tool_call=("shell", SHELL_ARGUMENTS)),
        "patcher": Sim(model="patcher", replica="p", ttft_ms=1, tokens_per_s=200,
                       tool_call=("apply_patch", json.dumps({"input": PATCH}))),
        "codex": Sim(model="codex", replica="c", ttft_ms=1, tokens_per_s=500,
                     tool_call=("exec_command", json.dumps({"cmd": CODEX_COMMAND}))),
        "dying": Sim(model="dying", replica="d", ttft_ms=1, tokens_per_s=50, die_after=1),
        "garbled": Sim(model="garbled", replica="g", ttft_ms=1, tokens_per_s=500, garbled=True),
    }
    # Codex offers its free-form apply_patch only to models it knows, such as gpt-5.5.
    models = [{"name": "sim", "aliases": ["fast"], "max_output": 1000},
              {"name": "codex", "aliases": ["test-model"]}, {"name": "patcher", "aliases": ["gpt-5.5"]}]
    with gateway_over(tmp, url, sims, models, workers=2) as gw:
        e = SimpleNamespace(gw=gw, url=gw.url, key=key, limited=limited, store=url)
        e.client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)
        yield e
        e.client.close()


def raw_events(env, body: dict, key=None) -> list[tuple[str, dict]]:
    """(event name, data) of each event of a Responses stream, read off the wire."""
    status, headers, raw = post(env.url + "/v1/responses", {**body, "stream": True}, key or env.key)
    assert status == 200 and headers["Content-Type"] == "text/event-stream", raw[:300]
    assert b"[DONE]" not in raw  # the Responses API sends none
    events = []
    for block in raw.decode().split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if lines:
            assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
            events.append((lines[0][7:], json.loads(lines[1][6:])))
    for name, data in events:
        assert data["type"] == name
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    return events


# --- through the gateway --------------------------------------------------------------------


def test_plain_response(env):
    reply = env.client.responses.create(model="fast", input="hello there", max_output_tokens=4)
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.model == "fast"
    assert reply.output_text == "tok0 tok1 tok2 tok3 " and reply.status == "incomplete"
    assert reply.incomplete_details.reason == "max_output_tokens"
    message = reply.output[0]
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    assert message.content[0].annotations == []
    assert (reply.usage.input_tokens, reply.usage.output_tokens, reply.usage.total_tokens) == (2, 4, 6)
    assert reply.usage.input_tokens_details.cached_tokens == 0
    assert reply.usage.output_tokens_details.reasoning_tokens == 0
    assert reply.max_output_tokens == 4 and reply.store is False and reply.error is None
    assert reply.reasoning.effort is None and reply.tools == [] and reply.tool_choice == "auto"


def test_streamed_response_with_the_sdk(env):
    events = list(env.client.responses.create(model="sim", input="hi", max_output_tokens=3, stream=True,
                                              instructions="Be brief."))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * 3 + [
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "tok0 tok1 tok2 "
    final = events[-1].response
    assert final.output_text == "tok0 tok1 tok2 " and final.usage.output_tokens == 3
    assert final.instructions == "Be brief." and final.id == events[0].response.id
    assert events[0].response.status == "in_progress" and events[0].response.usage is None


def test_the_sdk_stream_helper_accumulates_the_events(env):
    # The helper checks each delta against what it built from the events before (and wants response.completed:
    # the unscripted sim always stops at its length limit, so the tool-calling one answers).
    with env.client.responses.stream(model="shell", input="Say hi with the shell.", tools=[SHELL]) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output[0].arguments == SHELL_ARGUMENTS and final.usage.output_tokens > 0


def test_stream_events_on_the_wire(env):
    events = raw_events(env, {"model": "sim", "input": "hi", "max_output_tokens": 2})
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"]["usage"]["output_tokens"] == 2


def test_instructions_and_input_items(env):
    reply = env.client.responses.create(model="sim", max_output_tokens=2, instructions="You are terse.", input=[
        {"role": "developer", "content": "Answer in English."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is 2+2?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4."}]},
        {"role": "user", "content": "And 3+3?"}])
    assert reply.output_text == "tok0 tok1 "
    # The sim counts a word a token: what reached it is every message's text, the reasoning item left out.
    assert reply.usage.input_tokens == len("You are terse. Answer in English. What is 2+2? 4. And 3+3?".split())


def test_a_function_tool_round_trip(env):
    ask = [{"role": "user", "content": "Say hi with the shell."}]
    reply = env.client.responses.create(model="shell", input=ask, tools=[SHELL])
    (call,) = reply.output
    assert call.type == "function_call" and call.name == "shell" and call.arguments == SHELL_ARGUMENTS
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and reply.status == "completed"
    history = ask + [call.model_dump(exclude_none=True),
                     {"type": "function_call_output", "call_id": call.call_id, "output": "hi\n(exit 0)"}]
    answer = env.client.responses.create(model="shell", input=history, tools=[SHELL])
    assert answer.output_text == "The tool said: hi\n(exit 0)"


def test_a_function_tool_streamed(env):
    events = raw_events(env, {"model": "shell", "input": "Say hi with the shell.", "tools": [SHELL]})
    kinds = [name for name, _ in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    deltas = [data["delta"] for name, data in events if name == "response.function_call_arguments.delta"]
    assert len(deltas) > 2 and "".join(deltas) == SHELL_ARGUMENTS  # fragments, in order
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    item = events[-1][1]["response"]["output"][0]
    assert item["type"] == "function_call" and item["arguments"] == SHELL_ARGUMENTS and item["name"] == "shell"
    assert events[2][1]["item"]["call_id"] == item["call_id"] and events[2][1]["item"]["id"] == item["id"]


def test_a_custom_tool_round_trip(env):
    reply = env.client.responses.create(model="patcher", input="Add a.txt.", tools=[APPLY_PATCH])
    (call,) = reply.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and call.input == PATCH
    history = [{"role": "user", "content": "Add a.txt."}, call.model_dump(exclude_none=True),
               {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"}]
    answer = env.client.responses.create(model="patcher", input=history, tools=[APPLY_PATCH])
    assert answer.output_text == "The tool said: Done!"
    events = raw_events(env, {"model": "patcher", "input": "Add a.txt.", "tools": [APPLY_PATCH]})
    inputs = [data for name, data in events if name.startswith("response.custom_tool_call_input.")]
    assert [d["type"] for d in inputs] == ["response.custom_tool_call_input.delta",
                                           "response.custom_tool_call_input.done"]
    assert inputs[0]["delta"] == inputs[1]["input"] == PATCH
    assert events[-1][1]["response"]["output"][0]["input"] == PATCH


def test_tools_no_engine_runs_are_left_out_and_named(env):
    reply = env.client.responses.create(model="sim", input="hi", max_output_tokens=1,
                                        tools=[SHELL, {"type": "web_search"}, {"type": "file_search",
                                                                               "vector_store_ids": ["vs_1"]}])
    assert [t.type for t in reply.tools] == ["function"]
    assert reply.model_extra["llmgw_tools_left_out"] == ["web_search", "file_search"]


def test_previous_response_id_is_refused_where_the_project_keeps_no_conversations(env):
    """A project keeps none until an operator says (tests/test_threads.py has the rest)."""
    with pytest.raises(openai.PermissionDeniedError) as e:
        env.client.responses.create(model="sim", input="hi", previous_response_id="resp_123")
    assert e.value.code == "threads_off" and "llmgw keys threads" in e.value.body["message"]
    assert env.client.responses.create(model="sim", input="hi", store=True).store is False


@pytest.mark.parametrize("body, param", [
    ({"model": "sim"}, "input"),
    ({"model": "sim", "input": 5}, "input"),
    ({"model": "sim", "input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"model": "sim", "input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]},
     "input[0].call_id"),
    ({"model": "sim", "input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"model": "sim", "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type"),
    ({"model": "sim", "input": "x", "max_output_tokens": "many"}, "max_output_tokens"),
    ({"model": "sim", "input": "x", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"model": "sim", "input": "x", "temperature": 7}, "temperature"),
    ({"model": "sim", "input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"model": "sim", "input": "x", "tools": [SHELL], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"model": "sim", "input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
    ({"model": "sim", "input": "x", "conversation": "conv_1"}, "conversation"),
    ({"model": "sim", "input": "x", "background": True}, "background"),
    ({"model": "sim", "input": "x", "previous_response_id": 7}, "previous_response_id"),
    ({"model": "sim", "input": "x", "previous_response_id": "r" * 65}, "previous_response_id"),
    ({"model": "sim", "input": "x", "store": "yes"}, "store"),
    ({"input": "x"}, "model"),
])
def test_bad_fields_are_400_naming_the_param(env, body, param):
    status, _, raw = post(env.url + "/v1/responses", body, env.key)
    error = json.loads(raw)["error"]
    assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == param, error


def test_usage_rows_record_the_responses_endpoint(env):
    started = time.time()
    env.client.responses.create(model="fast", input="count me", max_output_tokens=2)
    list(env.client.responses.create(model="fast", input="count me", max_output_tokens=3, stream=True))
    engine = store.open_engine(env.store)

    def rows():
        with engine.connect() as conn:
            return conn.execute(store.usage.select().where(store.usage.c.at >= started)
                                .where(store.usage.c.endpoint == "responses")).all()

    try:
        wait_until("usage rows", 30, lambda: len(rows()) == 2)
        assert sorted((r.stream, r.status, r.prompt_tokens, r.completion_tokens, r.model_asked, r.model_served)
                      for r in rows()) == [(False, 200, 2, 2, "fast", "sim"), (True, 200, 2, 3, "fast", "sim")]
    finally:
        engine.dispose()


def test_the_overhead_header_is_set(env):
    status, headers, _ = post(env.url + "/v1/responses", {"model": "sim", "input": "x", "max_output_tokens": 1},
                              env.key)
    assert status == 200 and float(headers["X-Llmgw-Overhead-Ms"]) < 50


def test_the_rate_limit_applies(env):
    client = openai.OpenAI(base_url=env.url + "/v1", api_key=env.limited, max_retries=0, timeout=30)
    try:
        for _ in range(2):
            client.responses.create(model="sim", input="x", max_output_tokens=1)
        with pytest.raises(openai.RateLimitError) as e:
            client.responses.create(model="sim", input="x", max_output_tokens=1)
    finally:
        client.close()
    assert e.value.body["code"] == "rate_limit_exceeded" and e.value.body["type"] == "rate_limit_error"
    assert int(e.value.response.headers["Retry-After"]) >= 1


def test_an_engine_dying_mid_stream_ends_it_with_response_failed(env):
    events = raw_events(env, {"model": "dying", "input": "hi", "max_output_tokens": 50})
    name, data = events[-1]
    assert name == "response.failed" and data["response"]["status"] == "failed"
    error = data["response"]["error"]
    assert error["code"] == "server_error" and "request id" in error["message"]
    assert "127.0.0.1" not in error["message"]
    # What was said before it died is in the failed response.
    assert data["response"]["output"][0]["content"][0]["text"].startswith("tok0 ")


def test_every_captured_codex_request_is_answered(env):
    with open(CODEX_REQUESTS) as f:
        scenarios = json.load(f)["scenarios"]
    replayed = 0
    for scenario in scenarios:
        for request in scenario["requests"]:
            if request["path"] != "/v1/responses":
                continue
            body = request["body"]
            events = raw_events(env, body)
            final = events[-1][1]["response"]
            assert events[-1][0] == "response.completed", (scenario["name"], events[-1])
            assert final["model"] == body["model"] and final["usage"]["input_tokens"] > 0
            last = body["input"][-1]
            if last.get("type") == "function_call_output":
                # The engine saw the tool's output, and answered with text.
                assert final["output"][0]["type"] == "message"
                assert final["output"][0]["content"][0]["text"].startswith("The tool said: " + last["output"][:40])
            elif body["model"] == "gpt-5.5":
                (call,) = final["output"]
                assert call["type"] == "custom_tool_call" and call["name"] == "apply_patch" and call["input"] == PATCH
            else:
                (call,) = final["output"]
                assert call["type"] == "function_call" and call["name"] == "exec_command"
                assert json.loads(call["arguments"]) == {"cmd": CODEX_COMMAND}
            replayed += 1
    assert replayed >= 4


def test_codex_cli_runs_a_shell_tool_loop(codex_cli, env, tmp_path):
    run = codex(codex_cli, env.url, env.key, tmp_path, "test-model", "Create out.txt")
    assert (tmp_path / "out.txt").read_text() == "hello-from-tool\n"
    assert "The tool said: " in run.stdout and "hello-from-tool" in run.stdout


def test_codex_cli_applies_a_free_form_patch(codex_cli, env, tmp_path):
    # The model's apply_patch input reaches Codex raw (a custom_tool_call), and Codex applies it.
    run = codex(codex_cli, env.url, env.key, tmp_path, "gpt-5.5", "Add a.txt")
    assert (tmp_path / "a.txt").read_text() == "hello\n"
    assert "The tool said: " in run.stdout


# --- the translation, as pure functions -------------------------------------------------------


def chat_of(body: dict) -> dict:
    return to_chat({"model": "m", **body})[0]


def test_json_schema_format_becomes_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = chat_of({"input": "x", "text": {"format": {"type": "json_schema", "name": "thing", "schema": schema,
                                                      "strict": True}, "verbosity": "low"}})
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    assert chat_of({"input": "x", "text": {"format": {"type": "json_object"}}})["response_format"] == {
        "type": "json_object"}
    assert "response_format" not in chat_of({"input": "x", "text": {"format": {"type": "text"}}})


def test_calls_and_outputs_become_one_assistant_turn_and_tool_messages():
    chat = chat_of({"instructions": "sys", "tools": [SHELL, APPLY_PATCH], "input": [
        {"role": "developer", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"role": "user", "content": "go"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "On it."}]},
        {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": PATCH},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "done"}]},
    ]})
    messages = chat["messages"]
    assert messages[0] == {"role": "system", "content": "sys\n\na\nb"}  # one system message, first
    assert messages[2]["content"] == "On it." and [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert json.loads(messages[2]["tool_calls"][1]["function"]["arguments"]) == {"input": PATCH}
    assert messages[3:] == [{"role": "tool", "tool_call_id": "c1", "content": "ok"},
                            {"role": "tool", "tool_call_id": "c2", "content": "done"}]
    patch = chat["tools"][1]["function"]
    assert patch["name"] == "apply_patch" and patch["parameters"]["required"] == ["input"]
    assert "start: begin_patch" in patch["description"]  # the grammar is all the model has to go by


def test_images_stay_parts():
    chat = chat_of({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"}]}]})
    assert chat["messages"][0]["content"] == [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}}]


def test_tool_choice_and_limits():
    chat = chat_of({"input": "x", "tools": [SHELL], "tool_choice": {"type": "function", "name": "shell"},
                    "parallel_tool_calls": False, "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                    "store": True, "include": ["reasoning.encrypted_content"], "reasoning": {"effort": "high"},
                    "metadata": {"a": "b"}, "prompt_cache_key": "k", "some_future_field": 1})
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "shell"}}
    assert (chat["parallel_tool_calls"], chat["max_tokens"], chat["temperature"], chat["top_p"]) == (False, 7, 0.5, 0.9)
    assert set(chat) == {"model", "messages", "tools", "tool_choice", "parallel_tool_calls", "max_tokens",
                         "temperature", "top_p"}
    # Without a tool the engine can run, no tool_choice goes to it (an engine refuses "required" with no tools).
    assert "tool_choice" not in chat_of({"input": "x", "tools": [{"type": "web_search"}], "tool_choice": "required"})


def test_namespaces_flatten_and_local_shell_maps_to_a_function():
    namespace = {"type": "namespace", "name": "agents", "description": "d", "tools": [
        {"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}]}
    chat, echo, tools = to_chat({"model": "m", "input": "x", "tools": [namespace, {"type": "local_shell"}]})
    assert [t["function"]["name"] for t in chat["tools"]] == ["spawn_agent", "local_shell"]
    assert tools == {"spawn_agent": ("function", "agents"), "local_shell": ("local_shell", None)}
    chat = chat_of({"input": [
        {"type": "local_shell_call", "call_id": "c", "id": "lsh_1", "status": "completed",
         "action": {"type": "exec", "command": ["ls"], "env": {}, "working_directory": "/tmp"}},
        {"type": "local_shell_call_output", "id": "c", "output": "a.txt"}], "tools": [{"type": "local_shell"}]})
    call = chat["messages"][0]["tool_calls"][0]["function"]
    assert call["name"] == "local_shell" and json.loads(call["arguments"]) == {"command": ["ls"], "workdir": "/tmp"}
    assert chat["messages"][1] == {"role": "tool", "tool_call_id": "c", "content": "a.txt"}


def request(body: dict):
    return RESPONSES.parse("chat", json.dumps({"model": "m", **body}).encode(), 0)


def event(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def delta(**fields) -> bytes:
    return event({"choices": [{"index": 0, "delta": fields, "finish_reason": None}]})


def translated(req, chunks: list[bytes], done=True) -> list[dict]:
    stream = RESPONSES.stream(req)
    out = b"".join(stream.feed(c) for c in chunks) + stream.feed(b"data: [DONE]\n\n" if done else b"") + stream.end()
    events = [json.loads(block.split("\n")[1][6:]) for block in out.decode().split("\n\n") if block]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_fragmented_interleaved_tool_calls_and_text():
    req = request({"input": "x", "stream": True, "tools": [SHELL, APPLY_PATCH]})
    finish = event({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    usage = event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12,
                                            "prompt_tokens_details": {"cached_tokens": 2}}})
    events = translated(req, [
        delta(role="assistant", content="Let me"),
        delta(tool_calls=[{"index": 0, "id": "call_a", "type": "function", "function": {"name": "shell",
                                                                                     "arguments": ""}}]),
        delta(content=" look."),
        delta(tool_calls=[{"index": 1, "id": "call_b", "function": {"name": "apply_patch", "arguments": '{"inp'}}]),
        delta(tool_calls=[{"index": 0, "function": {"arguments": '{"command":'}}]),
        delta(tool_calls=[{"index": 1, "function": {"arguments": 'ut": "P"}'}}]),
        delta(tool_calls=[{"index": 0, "function": {"arguments": ' ["ls"]}'}}]),
        finish, usage])
    final = events[-1]
    assert final["type"] == "response.completed"
    message, shell, patch = final["response"]["output"]
    assert message["content"][0]["text"] == "Let me look."
    assert (shell["type"], shell["call_id"], shell["arguments"]) == ("function_call", "call_a", '{"command": ["ls"]}')
    assert (patch["type"], patch["call_id"], patch["input"]) == ("custom_tool_call", "call_b", "P")
    args = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert args == ['{"command":', ' ["ls"]}']
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    assert final["response"]["usage"]["input_tokens_details"] == {"cached_tokens": 2}


def test_a_call_whose_name_comes_late_is_announced_when_it_does():
    req = request({"input": "x", "stream": True, "tools": [SHELL]})
    events = translated(req, [
        delta(tool_calls=[{"index": 0, "id": "call_x", "function": {"arguments": '{"com'}}]),
        delta(tool_calls=[{"index": 0, "function": {"name": "shell", "arguments": 'mand": []}'}}])])
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert len(added) == 1 and added[0]["item"]["name"] == "shell"
    args = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(args) == '{"command": []}'
    # No usage came (an engine that sends none): the response says so rather than inventing zeros.
    assert events[-1]["response"]["usage"] is None


def test_a_stream_without_done_still_completes():
    events = translated(request({"input": "x", "stream": True}), [delta(content="hi")], done=False)
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["output"][0]["status"] == "completed"


def test_a_failure_before_any_event_still_opens_the_response():
    req = request({"input": "x", "stream": True})
    error = ApiError(503, "sim is loading.", "model_loading", retry_after=60)
    token = requestid.current.set("5eed")  # as the gateway sets it for each request it serves
    try:
        out = RESPONSES.stream_error(req, error).decode()
    finally:
        requestid.current.reset(token)
    events = [json.loads(block.split("\n")[1][6:]) for block in out.split("\n\n") if block]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
    assert events[-1]["response"]["error"] == {"code": "server_error",
                                               "message": "sim is loading. (request id 5eed)"}


def test_a_whole_answer_with_reasoning_and_a_namespaced_call():
    req = request({"input": "x", "tools": [{"type": "namespace", "name": "agents", "description": "d", "tools": [
        {"type": "function", "name": "spawn_agent"}]}]})
    data = json.dumps({"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "", "reasoning_content": "Think.",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "spawn_agent",
                                                                         "arguments": "{}"}}]}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}).encode()
    body = json.loads(RESPONSES.answer(req, data))
    reasoning, call = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == "Think."
    assert call == {"type": "function_call", "id": call["id"], "call_id": "call_1", "name": "spawn_agent",
                    "arguments": "{}", "status": "completed", "namespace": "agents"}
    assert body["status"] == "completed" and body["usage"]["total_tokens"] == 3 and body["model"] == "m"


def test_an_unreadable_whole_answer_is_a_502():
    for data in (b"not json", b"[]", b'{"choices": []}', b'{"choices": [{"message": "hi"}]}'):
        with pytest.raises(ApiError) as e:
            responsesout.answer(request({"input": "x"}), data)
        assert e.value.status == 502 and e.value.code == "upstream_error"


def test_odd_types_in_a_whole_answer_cost_only_themselves():
    req = request({"input": "x", "tools": [SHELL]})
    data = json.dumps({"choices": [{"index": 0, "finish_reason": ["stop"], "message": {
        "content": ["not", "text"], "reasoning_content": 5,
        "tool_calls": [1, None, {"id": 7, "function": {"name": "shell", "arguments": {"command": ["ls"]}}}]}}],
        "usage": {"prompt_tokens": "3", "completion_tokens": True}}).encode()
    body = json.loads(RESPONSES.answer(req, data))
    [call] = body["output"]
    assert (call["type"], call["name"], call["arguments"]) == ("function_call", "shell", "")
    assert call["call_id"].startswith("call_") and body["status"] == "completed"
    assert (body["usage"]["input_tokens"], body["usage"]["output_tokens"]) == (0, 0)


def test_an_unreadable_answer_through_the_gateway_is_a_502_and_is_accounted_for(env):
    with pytest.raises(openai.APIStatusError) as e:
        env.client.responses.create(model="garbled", input="hi", max_output_tokens=3)
    assert e.value.status_code == 502 and e.value.body["code"] == "upstream_error"
    assert "could not be read" in e.value.body["message"]
    wait_until("the usage row", 30, lambda: count_usage(env.store, status=502, endpoint="responses", model_asked="garbled") == 1)
    # Mid-stream, the engine's error event ends the stream with response.failed.
    events = raw_events(env, {"model": "garbled", "input": "hi", "max_output_tokens": 3})
    assert events[-1][0] == "response.failed"
    assert events[-1][1]["response"]["output"][0]["content"][0]["text"] == "tok0 "
    assert "simulated failure" not in json.dumps(events)  # the engine's words go to the log only
    wait_until("the stream's usage row", 30, lambda: count_usage(env.store, status=502, endpoint="responses", model_asked="garbled") == 2)


def test_an_engine_error_event_mid_stream_ends_it_with_response_failed():
    events = translated(request({"input": "x", "stream": True}), [
        delta(content="partial"), event({"error": {"message": "secret internal 10.0.0.5 boom"}}),
        delta(content="never")], done=True)
    assert [e["type"] for e in events][-1] == "response.failed"
    assert "10.0.0.5" not in json.dumps(events) and "never" not in json.dumps(events)


def test_a_long_run_of_system_messages_is_merged_in_linear_time():
    body = {"model": "m", "input": [{"role": "developer", "content": "x" * 600}] * 4000}
    started = time.process_time()
    chat = to_chat(body)[0]
    # Adding each text to the run so far took minutes at 14,000 (8.9 MB); joining once takes milliseconds.
    assert time.process_time() - started < 2
    assert chat["messages"] == [{"role": "system", "content": "\n\n".join(["x" * 600] * 4000)}]
    chat = chat_of({"instructions": "a", "input": [
        {"role": "developer", "content": "b"}, {"role": "user", "content": "u"}, {"role": "system", "content": "c"},
        {"role": "developer", "content": [{"type": "input_image", "image_url": "data:x"}]},
        {"role": "system", "content": "d"}, {"role": "developer", "content": "e"}]})
    assert [m["content"] for m in chat["messages"]] == [
        "a\n\nb", "u", "c", [{"type": "image_url", "image_url": {"url": "data:x"}}], "d\n\ne"]


def test_lone_surrogates_go_to_the_engine_as_the_escapes_they_came_in():
    raw = json.dumps({"model": "m", "input": "hi \ud800", "instructions": "\udfff",
                      "tools": [{"type": "\udfff"}]}).encode()
    req = RESPONSES.parse("chat", raw, 2048)
    assert b"hi \\ud800" in req.raw  # UTF-8 the engine can read, as a chat client's same text would be
    assert json.loads(req.raw.decode())["messages"] == [{"role": "system", "content": "\udfff"},
                                                        {"role": "user", "content": "hi \ud800"}]
    assert json.loads(req.echo.decode())["llmgw_tools_left_out"] == ["\udfff"]
    # And the engine's own lone surrogates go to the client so, whole or streamed.
    answer = json.dumps({"choices": [{"message": {"content": "\udc00"}, "finish_reason": "stop"}]}).encode()
    assert json.loads(RESPONSES.answer(req, answer).decode())["output"][0]["content"][0]["text"] == "\udc00"
    events = translated(req, [delta(content="\udc00")])
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "\udc00"
