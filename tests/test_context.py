"""The context a request may use is one engine slot's, and every part of the cluster names that number.

llama.cpp divides its --ctx-size among its slots. It was started with a model's max_context as the whole,
so with four slots each request had a quarter of what the catalog, /v1/models and the gateway's own refusals
said; and it holds a slot to what the model was trained on whatever it is asked. Here real agents start the
real llama.cpp for a real controller, and a real gateway says what the engines say.
"""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from llmgw import gguf
from llmgw.cli import starter
from llmgw.control import catalog
from llmgw.engines import llamacpp, served_context
from llmgw.procs import wait_for
from tests.cluster import Agent, Controller
from tests.conftest import Gateway, make_key, post


@pytest.mark.parametrize("args, slots", [([], llamacpp.SLOTS), (["--parallel", "2"], 2), (["-np", "3"], 3),
                                         (["--parallel=5", "--threads", "1"], 5),
                                         (["--parallel", "2", "--parallel", "6"], 6), (["--parallel"], llamacpp.SLOTS)])
def test_a_profiles_slots_are_read_from_its_arguments(args, slots):
    assert llamacpp.slots(args) == slots


def test_llamacpp_is_given_a_context_a_slot():
    from llmgw import engines

    argv = engines.command("llamacpp", "/m.gguf", "m", "127.0.0.1", 8001, [], 16384, ["--parallel", "2"], "r1")
    assert argv[argv.index("--ctx-size") + 1] == "32768" and argv[argv.index("--parallel") + 1] == "2"
    argv = engines.command("llamacpp", "/m.gguf", "m", "127.0.0.1", 8001, [], None, [], "r1")
    assert argv[argv.index("--ctx-size") + 1] == str(llamacpp.CONTEXT * llamacpp.SLOTS)


def test_what_an_engine_says_it_serves_is_read_and_bounded():
    def answers(body):
        return lambda path: body

    assert served_context("llamacpp", answers({"default_generation_settings": {"n_ctx": 8192}})) == 8192
    assert served_context("vllm", answers({"data": [{"id": "m", "max_model_len": 4096}]})) == 4096
    for odd in ({}, {"data": []}, {"data": ["x"]}, {"data": [{"max_model_len": -1}]},
                {"data": [{"max_model_len": True}]}, {"data": [{"max_model_len": 10 ** 12}]}):
        assert served_context("vllm", answers(odd)) is None, odd


def test_the_starters_copy_says_it_takes_its_context(tmp_path):
    copy = tmp_path / "m.gguf"
    with open(starter.model_path(), "rb") as f:
        copy.write_bytes(f.read(gguf.HEAD_BYTES))
    assert gguf.context_length(copy.read_bytes()) == 8192  # what SmolLM2 was trained on
    assert gguf.raise_context_length(str(copy), starter.CONTEXT) == 8192
    head = copy.read_bytes()
    assert gguf.context_length(head) == starter.CONTEXT and gguf.architecture(head) == "llama"


def test_start_limit_is_the_profiles_and_leaves_the_fingerprint_alone():
    table = {"name": "m", "source": "/m", "profiles": [{"engine": "sim"}]}
    plain = catalog.parse_model(table)
    limited = catalog.parse_model({**table, "profiles": [{"engine": "sim", "start_limit": 1800}]})
    assert limited.profiles[0].start_limit == 1800.0
    # How long a start may take is supervision, not the engine: no running replica turns stale over it.
    assert plain.fingerprint(plain.profiles[0]) == limited.fingerprint(limited.profiles[0])
    for bad in (0, -1, float("nan"), 10 ** 9, "1h"):
        with pytest.raises(catalog.CatalogError, match="start_limit"):
            catalog.parse_model({**table, "profiles": [{"engine": "sim", "start_limit": bad}]})


def test_every_part_names_the_context_the_engine_serves(tmp_path, made):
    # "fits": 2,048 a request over two slots. "capped": 16,384 asked of the wheel's own file, which says it
    # was trained on 8,192: llama.cpp serves 8,192, and that is the number every part must name.
    source = starter.model_path()
    models = [{"name": "fits", "source": source, "max_context": 2048, "scaling": {"min": 1, "max": 1},
               "profiles": [{"engine": "llamacpp", "args": ["--parallel", "2", "--threads", "1"]}]},
              {"name": "capped", "source": source, "max_context": 16384, "scaling": {"min": 1, "max": 1},
               "profiles": [{"engine": "llamacpp", "args": ["--parallel", "1", "--threads", "1"]}]}]
    store_url = f"sqlite:///{tmp_path}/cluster.db"
    c = Controller(tmp_path, store_url=store_url, models=models)
    made.append(c)
    made.append(Agent(tmp_path, [f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1"),
                      agent__local_sources=[os.path.dirname(source)]))
    key = make_key(store_url)
    gw = Gateway(tmp_path, store_url, workers=1, gateway__controller=f"127.0.0.1:{c.gateway_port}",
                 gateway__key_file=c.gateway_key_file())
    made.append(gw)
    wait_for("both replicas ready", 180, lambda: c.ready("fits") and c.ready("capped"), interval=0.2)
    assert [r["context"] for r in c.ready("fits") + c.ready("capped")] == [2048, 8192]
    assert "serves 8192 tokens a request, not the 16384 its max_context asks" in c.log()

    def listed():
        request = urllib.request.Request(gw.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            return {m["id"]: m["max_context"] for m in json.loads(resp.read())["data"]}

    wait_for("the gateway to name what the engines serve", 30, lambda: listed() == {"fits": 2048, "capped": 8192})
    # A prompt of about 3,000 tokens fits neither a slot of "fits" nor what it said: refused naming 2,048.
    chat = {"model": "fits", "max_tokens": 8, "messages": [{"role": "user", "content": "word " * 3000}]}
    status, _, body = post(gw.url + "/v1/chat/completions", chat, key, timeout=120)
    error = json.loads(body)["error"]
    assert status == 400 and error["code"] == "context_length_exceeded", body
    assert "of 2048 tokens" in error["message"]
    # The same prompt fits "capped": its slot really holds 8,192 (a quarter of the old --ctx-size would not).
    status, _, body = post(gw.url + "/v1/chat/completions", {**chat, "model": "capped"}, key, timeout=120)
    assert status == 200 and json.loads(body)["usage"]["prompt_tokens"] > 2048, body


def test_an_engine_that_does_not_start_in_its_profiles_start_limit_fails_saying_so(tmp_path, made):
    model = {"name": "slow", "source": "/dev/null", "scaling": {"min": 1, "max": 1},
             "profiles": [{"engine": "sim", "args": ["--loading"], "start_limit": 2}]}
    c = Controller(tmp_path, models=[model], controller__base_backoff=60.0)
    made.append(c)
    agent = Agent(tmp_path, [f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1"))
    made.append(agent)
    wait_for("the start to fail", 60, lambda: "did not answer /health within 2 s" in agent.log())
