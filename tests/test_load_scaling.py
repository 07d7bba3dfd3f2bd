"""Scaling with load, the whole loop: a real controller, an agent running simulated engines that take two requests
at once (the rest wait, and say so on /metrics as vLLM does), a real gateway, and clients that ramp up and stop.

The decisions themselves, pass by pass, are tests/test_autoscale.py's.
"""

from __future__ import annotations

from llmgw.procs import wait_for
from tests.cluster import Agent, Clients, Controller
from tests.conftest import Gateway, make_key

# Two at once, a second an answer of 20 tokens: four clients keep one replica's queue full.
ASK = {"model": "ramp", "max_tokens": 20, "messages": [{"role": "user", "content": "go"}]}
MODEL = {"name": "ramp", "source": "/dev/null", "scaling": {"min": 1, "max": 3},
         "profiles": [{"engine": "sim", "args": ["--max-concurrency", "2", "--ttft-ms", "5", "--tokens-per-s", "20"]}]}


def test_replicas_follow_the_load_between_min_and_max_and_say_why(tmp_path, made):
    store_url = f"sqlite:///{tmp_path}/cluster.db"
    c = Controller(tmp_path, store_url=store_url, models=[MODEL], controller__scale_up_after=3.0,
                   controller__scale_down_after=6.0)
    made.append(c)
    made.append(Agent(tmp_path, [f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1")))
    gw = Gateway(tmp_path, store_url, workers=1, gateway__controller=f"127.0.0.1:{c.gateway_port}",
                 gateway__key_file=c.gateway_key_file())
    made.append(gw)
    key = make_key(store_url)
    wait_for("one replica ready", 60, lambda: len(c.ready("ramp")) == 1)

    # Two clients: the one replica runs both, nothing waits, nothing is added.
    light = Clients(gw.url, key, ASK, 2)
    made.append(light)
    wait_for("light load answered", 60, lambda: light.answered() >= 20)
    assert len(c.replicas("ramp")) == 1
    assert c.api("/api/v1/models/ramp/placement")["scaling"]["extra"] == 0

    # Ten: every replica's queue stays full, so one is added after 3 s, and when it is ready and still full,
    # a third; never more than scaling.max.
    heavy = Clients(gw.url, key, ASK, 8)
    made.append(heavy)
    wait_for("three replicas ready", 120, lambda: len(c.ready("ramp")) == 3, interval=0.2)
    assert len(c.replicas("ramp")) == 3
    scaling = c.api("/api/v1/models/ramp/placement")["scaling"]
    assert [d["step"] for d in scaling["decisions"]] == [1, 1]
    assert "ready replicas are busy" in scaling["decisions"][0]["reason"]
    shown = c.ctl("explain-placement", "ramp")
    assert "one replica more: all 1 ready replicas are busy" in shown.stderr
    assert "2 replicas added for load" in shown.stderr  # saturated or not by now: the clients come and go

    # Quiet: back to the minimum, one replica at a time, each drained, with no request failed throughout.
    heavy.stop()
    light.stop()
    assert heavy.failures() == [] and light.failures() == []
    wait_for("back to one replica", 120, lambda: len(c.replicas("ramp")) == 1, interval=0.2)
    decisions = c.api("/api/v1/models/ramp/placement")["scaling"]["decisions"]
    assert [d["step"] for d in decisions] == [1, 1, -1, -1]
    assert "controller.scale_down_after" in decisions[-1]["reason"]
    assert "scaling ramp: one replica fewer" in c.log()
