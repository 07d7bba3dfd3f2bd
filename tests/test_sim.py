"""The simulated engine keeps its promises: queueing, faults, usage, vLLM's metric names."""

import concurrent.futures
import json
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


def test_time_to_first_token_and_the_prefix_cache(make_sim):
    sim = make_sim(ttft_ms=300, tokens_per_s=0)
    body = {"model": "sim", "max_tokens": 1, "messages": [{"role": "user", "content": "same prompt"}]}
    started = time.monotonic()
    post(sim.url + "/v1/chat/completions", body)
    first = time.monotonic() - started
    started = time.monotonic()
    post(sim.url + "/v1/chat/completions", body)
    second = time.monotonic() - started
    assert first >= 0.3 and second < 0.1  # the cached prefix skips most of the time to first token
    assert sim.metrics()["vllm:prefix_cache_hits_total"] == 1


def test_failures_on_demand_and_unknown_models(make_sim):
    sim = make_sim(fail_rate=1.0)
    status, _, raw = post(sim.url + "/v1/chat/completions",
                          {"model": "sim", "messages": [{"role": "user", "content": "x"}]})
    assert status == 500
    status, _, raw = post(sim.url + "/v1/chat/completions", {"model": "other", "messages": []})
    assert status == 404 and "does not exist" in json.loads(raw)["error"]["message"]
