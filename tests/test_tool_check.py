"""`llmgw ctl tool-check MODEL` through a real gateway: a model that calls tools passes every step, one that
answers in words fails each, saying so."""

import os
import subprocess
import sys

from tests.conftest import make_key


def tool_check(gw, key, model) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmgw", "ctl", "tool-check", model, "--gateway", gw.url],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "LLMGW_API_KEY": key})


def test_tool_check_tells_a_model_that_calls_tools_from_one_that_does_not(tmp_path, make_gateway, make_sim):
    tooly = make_sim(model="tooly", replica="tooly", ttft_ms=1, tokens_per_s=0,
                     tool_call=("get_weather", '{"city": "Paris"}'))
    chatty = make_sim(model="chatty", replica="chatty", ttft_ms=1, tokens_per_s=0, reply="It is probably sunny.")
    url = f"sqlite:///{tmp_path}/t.db"
    key = make_key(url)
    gw = make_gateway(store_url=url, endpoints=[{"id": "tooly", "url": tooly.url, "models": ["tooly"]},
                                                {"id": "chatty", "url": chatty.url, "models": ["chatty"]}])
    good = tool_check(gw, key, "tooly")
    assert good.returncode == 0, good.stdout + good.stderr
    assert good.stdout.count("ok  ") == 4 and 'called get_weather({"city": "Paris"})' in good.stdout
    assert "tooly calls tools well: 4 of 4 steps." in good.stdout
    bad = tool_check(gw, key, "chatty")
    assert bad.returncode == 1 and bad.stdout.count("FAIL") == 3
    assert "it answered in words instead of calling the tool: 'It is probably sunny.'" in bad.stdout
    assert "chatty failed 3 of 3 steps: coding agents will stumble on it" in bad.stderr
    refused = tool_check(gw, "sk-llmgw-" + "x" * 43, "tooly")
    assert refused.returncode == 1 and "the gateway answered 401 (the key" in refused.stderr
