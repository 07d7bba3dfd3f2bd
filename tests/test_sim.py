"""The simulated engine keeps its promises: queueing, faults, usage, vLLM's metric names."""

import concurrent.futures
import json
import subprocess
import sys
import time

from tests.conftest import post, wait_until


def test_excess_requests_wait_and_are_reported_waiting(make_sim):
    sim = make_sim(ttft_ms=1, tokens_per_s=20, max_concurrency=1)
    body = {"model": "sim", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}]}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(post, sim.url + "/v1/chat/completions", body) for _ in range(3)]
        wait_until("two requests waiting", 30, lambda: sim.metrics()["vllm:num_requests_waiting"] == 2)
        assert sim.metrics()["vllm:num_requests_running"] == 1
        assert all(f.result()[0] == 200 for f in futures)
    assert sim.metrics()["llmgw_sim_running_peak"] == 1


def words(n, tag="w"):
    return " ".join(f"{tag}{i}" for i in range(n))


def ask(sim, *contents, max_tokens=1):
    """Chat CONTENTS (user, assistant, user, ...) to SIM: (seconds it took, prefix cache hits it made, answer)."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(contents)]
    before = sim.metrics()["vllm:prefix_cache_hits_total"]
    started = time.monotonic()
    status, _, raw = post(sim.url + "/v1/chat/completions", {"model": "sim", "max_tokens": max_tokens,
                                                             "messages": messages})
    took = time.monotonic() - started
    assert status == 200, raw
    return took, sim.metrics()["vllm:prefix_cache_hits_total"] - before, json.loads(raw)["choices"][0]["message"]


def test_time_to_first_token_grows_with_the_tokens_not_cached(make_sim):
    sim = make_sim(ttft_ms=20, tokens_per_s=0, prefill_ms_per_token=10)
    prompt = words(160)  # ten blocks of 16 tokens
    first, hits, _ = ask(sim, prompt)
    assert first >= 0.02 + 1.6 and hits == 0  # every token prefilled
    second, hits, _ = ask(sim, prompt)
    assert hits == 160 and second < 1.0, second  # all of it cached: the fixed 20 ms, and the gateway-free trip
    # A longer prompt reuses its cached start; the 16 new tokens make a block of their own for next time.
    third, hits, _ = ask(sim, prompt + " " + words(16, "x"))
    assert hits == 160 and third >= 0.02 + 0.16
    assert ask(sim, prompt + " " + words(16, "x"))[1] == 176
    # Only a prompt's start can hit: the same tokens after a different first word find nothing.
    assert ask(sim, "other " + prompt)[1] == 0
    m = sim.metrics()
    assert m["vllm:prefix_cache_queries_total"] == 160 + 160 + 176 + 176 + 161  # tokens, as vLLM counts


def test_a_conversations_next_turn_finds_its_history(make_sim):
    sim = make_sim(ttft_ms=1, tokens_per_s=0)
    question = words(40)
    _, _, answer = ask(sim, question, max_tokens=16)
    # Turn two repeats turn one and its answer: 40 + 16 tokens, of which three whole blocks are cached.
    _, hits, _ = ask(sim, question, answer["content"], "and then?", max_tokens=16)
    assert hits == 48


def test_the_cache_evicts_the_least_recently_used_tail_first(make_sim):
    sim = make_sim(ttft_ms=1, tokens_per_s=0, prefix_cache_tokens=96)  # six blocks
    a, b = words(64, "a"), words(64, "b")  # four blocks each
    ask(sim, a)
    ask(sim, b)
    # B's four blocks pushed out two of A's, its last two: A's first 32 tokens are still there.
    assert ask(sim, a)[1] == 32
    # That made A the most recent, so B lost its tail in turn; B's start is kept.
    assert ask(sim, b)[1] == 32
    nothing = make_sim(ttft_ms=1, tokens_per_s=0, no_prefix_cache=True)
    ask(nothing, a)
    assert ask(nothing, a)[1] == 0


def test_prefills_run_one_at_a_time(make_sim):
    sim = make_sim(ttft_ms=1, tokens_per_s=0, prefill_ms_per_token=5)
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda tag: ask(sim, words(100, tag)), ["p", "q"]))
    # Two uncached prompts of 100 tokens, 0.5 s of prefill each: the second waits for the first.
    assert time.monotonic() - started >= 1.0


def test_failures_on_demand_and_unknown_models(make_sim):
    sim = make_sim(fail_rate=1.0)
    status, _, raw = post(sim.url + "/v1/chat/completions",
                          {"model": "sim", "messages": [{"role": "user", "content": "x"}]})
    assert status == 500
    status, _, raw = post(sim.url + "/v1/chat/completions", {"model": "other", "messages": []})
    assert status == 404 and "does not exist" in json.loads(raw)["error"]["message"]


BASH = ("Bash", '{"command": "echo hi"}')
OFFERED = [{"type": "function", "function": {"name": "Bash", "description": "Run a command",
                                              "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "say hi"}]


def chat(sim, stream=False, **body):
    """A chat's whole answer, or a stream's events (JSON objects, without `[DONE]`)."""
    status, _, raw = post(sim.url + "/v1/chat/completions", {"model": "sim", "stream": stream, **body})
    assert status == 200, raw
    if not stream:
        return json.loads(raw)
    events = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_a_scripted_reply_is_every_answer_streamed_a_word_a_token(make_sim):
    sim = make_sim(ttft_ms=1, tokens_per_s=0, reply="unsafe\nS1")
    whole = chat(sim, messages=ASK)
    assert whole["choices"][0]["message"]["content"] == "unsafe\nS1"
    assert whole["choices"][0]["finish_reason"] == "stop" and whole["usage"]["completion_tokens"] == 2
    events = chat(sim, stream=True, messages=ASK, stream_options={"include_usage": True})
    deltas = [e["choices"][0]["delta"].get("content") for e in events if e["choices"]]
    assert deltas[:2] == ["unsafe", "\nS1"] and events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["usage"]["completion_tokens"] == 2
    # Cut short like any engine's answer; completions give the same text.
    cut = chat(sim, messages=ASK, max_tokens=1)["choices"][0]
    assert (cut["message"]["content"], cut["finish_reason"]) == ("unsafe", "length")
    status, _, raw = post(sim.url + "/v1/completions", {"model": "sim", "prompt": "x"})
    assert json.loads(raw)["choices"][0]["text"] == "unsafe\nS1"


def test_a_scripted_tool_call_then_its_result(make_sim):
    sim = make_sim(ttft_ms=1, tokens_per_s=0, tool_call=BASH)
    whole = chat(sim, messages=ASK, tools=OFFERED)["choices"][0]
    call = whole["message"]["tool_calls"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "Bash", "arguments": BASH[1]}

    # Streamed as OpenAI and vLLM stream calls: the first delta names it, the arguments come in pieces.
    events = chat(sim, stream=True, messages=ASK, tools=OFFERED)
    deltas = [e["choices"][0]["delta"] for e in events]
    first = deltas[0]["tool_calls"][0]
    assert deltas[0]["role"] == "assistant" and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "Bash", "arguments": ""} and first["index"] == 0
    fragments = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:] if "tool_calls" in d]
    assert len(fragments) > 2 and "".join(fragments) == BASH[1]
    assert [e["choices"][0]["finish_reason"] for e in events] == [None] * (len(events) - 1) + ["tool_calls"]

    # The result goes back; the answer quotes it, whole and streamed.
    back = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": call["id"], "content": "hi\n"}]
    answer = chat(sim, messages=back, tools=OFFERED)["choices"][0]
    assert (answer["message"]["content"], answer["finish_reason"]) == ("The tool said: hi\n", "stop")
    events = chat(sim, stream=True, messages=back, tools=OFFERED)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "The tool said: hi\n"

    # A chat that offers no such tool, or forbids calls, is answered as without a script.
    other = [{"type": "function", "function": {"name": "shell", "parameters": {}}}]
    for body in ({"tools": other}, {"tools": OFFERED, "tool_choice": "none"}, {}):
        answer = chat(sim, messages=ASK, max_tokens=2, **body)["choices"][0]
        assert (answer["message"]["content"], answer["finish_reason"]) == ("tok0 tok1 ", "length")


def test_a_tool_call_whose_arguments_are_no_json_object_is_refused_at_start():
    run = subprocess.run([sys.executable, "-m", "llmgw", "sim", "--tool-call", "Bash", "echo hi"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "the arguments of Bash are not a JSON object" in run.stderr
