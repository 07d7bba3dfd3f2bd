"""`llmgw ctl bench` as an operator runs it: real controller, agent, sim engines of known capacity, a gateway.

The sim runs 4 requests at once and queues the rest, so past 4 every request of a closed loop waits its
turn: the bench must find 4 (within 10%, which for 4 is exactly 4), and `--save` must make the gateway hold
every replica of that profile to 4 requests at once, which the engine's own count of requests it held
proves. Choosing a replica (`X-Llmgw-Replica`, how the bench reaches one replica through the gateway) is
an administrator's key's alone.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from llmgw.procs import free_port, wait_for
from tests.cluster import Agent, Controller
from tests.conftest import Gateway, post
from tests.test_capacity import people

SLOTS = 4
TOKENS = 36  # at 25 a second: a request takes about 1.45 s, so past 4 at once each waits 0.36 s or more
SIM_ARGS = ["--ttft-ms", "10", "--tokens-per-s", "25", "--max-concurrency", str(SLOTS)]
MODEL_FILE = ('name = "cap"\nsource = "/dev/null"\nscaling = {min = 1, max = 2}\n'
              f'[[profiles]]\nname = "simcpu"\nengine = "sim"\nargs = {json.dumps(SIM_ARGS)}\n')
# A wait of 0.36 s breaks it; 4 at once (TTFT 0.01 s and what a loaded machine adds) holds it. (Its requests
# all take the same time, so they run in lock-step rounds, and at 5 one request of each round waits a whole
# request's time: p90 of 5 at once is about 1.5 s, far past the SLO.)
SLO = ["--slo-ttft", "0.25", "--slo-tpot", "0.1"]


def ctl(c: Controller, *args, key: str | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LLMGW_API_KEY"}
    if key is not None:
        env["LLMGW_API_KEY"] = key
    return subprocess.run([sys.executable, "-m", "llmgw", "--config", c.config, "ctl", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def sim_figures(agent: Agent, replica: dict) -> dict[str, float]:
    """The engine's own /metrics, with the key only the agent and the gateways hold."""
    state = json.loads((agent.folder / "work" / "shards" / f"{replica['shard_id']}.json").read_text())
    req = urllib.request.Request(replica["url"] + "/metrics", headers={"Authorization": f"Bearer {state['api_key']}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    return {line.rsplit(" ", 1)[0].split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_the_bench_finds_a_replicas_capacity_and_save_makes_admission_hold_it(tmp_path, made):
    store_url = f"sqlite:///{tmp_path}/cluster.db"
    c = Controller(tmp_path, store_url=store_url)
    made.append(c)
    agent = Agent(tmp_path, [f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1"))
    made.append(agent)
    # One worker: it sees every request it sends, so "at most 4 at once" is exact, not within a metrics read.
    gw = Gateway(tmp_path, store_url, workers=1, gateway__controller=f"127.0.0.1:{c.gateway_port}",
                 gateway__key_file=c.gateway_key_file())
    made.append(gw)
    admin_key, person_key, project_key = people(store_url)
    (tmp_path / "cap.toml").write_text(MODEL_FILE)
    assert ctl(c, "model", "add", "-f", str(tmp_path / "cap.toml")).returncode == 0
    wait_for("a ready replica", 60, lambda: len(c.ready("cap")) == 1, interval=0.2)
    (first,) = c.ready("cap")
    assert first["profile"] == "simcpu"
    chat = {"model": "cap", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    wait_for("the gateway routing to it", 60, lambda: post(gw.url + "/v1/chat/completions", chat, project_key)[0] == 200)

    # Only an administrator's key may send the bench's requests; the others are told so, and nothing runs.
    for key in (person_key, project_key):
        refused = ctl(c, "bench", "cap", "--gateway", gw.url, *SLO, key=key)
        assert refused.returncode == 1 and "Only an administrator's key may choose a replica" in refused.stderr, \
            refused.stderr
    unreachable = f"http://127.0.0.1:{free_port()}"
    down = ctl(c, "bench", "cap", "--gateway", unreachable, *SLO, key=admin_key)
    assert down.returncode == 1 and f"the gateway at {unreachable} does not answer" in down.stderr, down.stderr

    run = ctl(c, "bench", "cap", "--gateway", gw.url, *SLO, "--samples", "6", "--max-tokens", str(TOKENS),
              "--prompt-words", "20", "--save", "--json", key=admin_key, timeout=400)
    print(run.stderr)
    assert run.returncode == 0, run.stderr
    (result,) = [json.loads(line) for line in run.stdout.splitlines()]
    assert result["replica"] == first["shard_id"] and result["profile"] == "simcpu"
    assert SLOTS * 0.9 <= result["max_in_flight"] <= SLOTS * 1.1, run.stderr
    assert "  4 at once ... " in run.stderr and "held" in run.stderr and "broke: time to first token" in run.stderr
    assert "saved: cap on profile simcpu takes 4 requests at once" in run.stderr
    # The ramp went past 4 at once, and the gateway let it: before the figure, nothing held the replica back.
    assert sim_figures(agent, first)["llmgw_sim_held_peak"] > SLOTS

    shown = [json.loads(line) for line in ctl(c, "capacity", "--json").stdout.splitlines()]
    assert [(r["model"], r["profile"], r["max_in_flight"], r["current"]) for r in shown] == \
        [("cap", "simcpu", result["max_in_flight"], True)]
    assert shown[0]["ttft_s"] <= 0.25 and shown[0]["percentile"] == 90 and shown[0]["gateway"] == gw.url
    assert "simcpu" in ctl(c, "capacity").stdout

    # A second replica of the profile starts fresh, and is held to the figure from its first request:
    # with 16 clients at once on two replicas, neither engine is ever sent more than 4 at once.
    assert ctl(c, "scale", "cap", "--min", "2").returncode == 0
    wait_for("two ready replicas", 60, lambda: len(c.ready("cap")) == 2, interval=0.2)
    (second,) = [r for r in c.ready("cap") if r["shard_id"] != first["shard_id"]]
    pinned = {**chat, "model": "cap"}
    wait_for("the gateway knowing the second replica", 60, lambda: post(
        gw.url + "/v1/chat/completions", pinned, admin_key, headers={"X-Llmgw-Replica": second["shard_id"]})[0] == 200)
    assert sim_figures(agent, second)["llmgw_sim_held_peak"] == 1
    load = {"model": "cap", "max_tokens": TOKENS, "messages": [{"role": "user", "content": "load"}]}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(lambda _: post(gw.url + "/v1/chat/completions", load, project_key, timeout=120)[0],
                                 range(48)))
    assert statuses == [200] * 48
    figures = sim_figures(agent, second)
    assert figures["llmgw_sim_held_peak"] <= SLOTS and figures["llmgw_sim_requests_total"] >= 10, figures

    # Forgotten, the replicas are admitted as before it was measured.
    assert ctl(c, "capacity", "forget", "cap").returncode == 0
    assert ctl(c, "capacity", "--json").stdout == ""


def test_the_bench_refuses_clearly_what_it_cannot_measure(tmp_path, made):
    c = Controller(tmp_path)
    made.append(c)
    # No agent: the model is in the catalog but nothing can run it.
    (tmp_path / "m.toml").write_text(MODEL_FILE)
    assert ctl(c, "model", "add", "-f", str(tmp_path / "m.toml")).returncode == 0
    cases = [
        (["cap", "--slo-ttft", "0"], None, "0 is not a time to first token in seconds: give more than 0"),
        (["cap", "--slo-tpot", "-1"], None, "-1 is not a time per output token in seconds"),
        (["cap", "--slo-ttft", "7200"], None, "at most 3600"),
        (["cap"], None, "give an administrator's API key in $LLMGW_API_KEY or in a file named by --key-file"),
        (["nope"], "sk-llmgw-x", "no model 'nope' in the catalog; `llmgw ctl models` lists them"),
        (["cap"], "sk-llmgw-x", "cap has no ready replica to measure (none is placed)"),
    ]
    for args, key, says in cases:
        run = ctl(c, "bench", *args, key=key)
        assert run.returncode != 0 and says in run.stderr, (args, run.stderr)
    assert ctl(c, "capacity").stderr.startswith("nothing has been measured")
    bad = urllib.request.Request(f"http://127.0.0.1:{c.admin_port}/api/v1/models/cap/capacity", method="PUT",
                                 data=json.dumps({"replica": "cap-x", "max_in_flight": 4}).encode(),
                                 headers={"Authorization": f"Bearer {c.token()}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(bad, timeout=10)
    assert refused.value.code == 404 and "cap has no replica 'cap-x' now" in json.loads(refused.value.read())["error"]
