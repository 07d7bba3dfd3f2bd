"""The cluster keeps the right replicas running: placement, failures, lost nodes, restarts, the gateway following.

The tests of replicas in flux (a drain, an agent killed, a controller killed, a node gone silent) run
on a loaded machine (`busy_machine`) with a client sending all along, which must see no failed
request, and end with no replica running twice.
"""

import json
import os
import re
import signal
import threading
import time
import urllib.request

import pytest

from llmgw import filemodes, keyfiles, store
from llmgw.control import curvekeys
from llmgw.procs import free_port, wait_for
from tests.cluster import Agent, Controller, Traffic, wait_for_no_duplicates
from tests.conftest import Gateway, make_key, post, write_config


def sim_model(name="simmy", low=2, high=3, args=("--ttft-ms", "5", "--tokens-per-s", "0"), **extra):
    return {"name": name, "source": "/dev/null", "scaling": {"min": low, "max": high},
            "profiles": [{"engine": "sim", "args": list(args)}], **extra}


@pytest.fixture
def cluster(tmp_path):
    made = []

    class Cluster:
        # One store for the controller and the gateway, as in any deployment: the controller pushes the
        # gateway the keys it reads there.
        store = f"sqlite:///{tmp_path}/cluster.db"

        def __init__(self):
            self.agents = []
            self.c = None

        def controller(self, **kw):
            c = Controller(tmp_path, store_url=self.store, **kw)
            made.append(c)
            self.c = c
            return c

        def agent(self, node_id, **kw):
            a = Agent(tmp_path, [f"127.0.0.1:{self.c.agent_port}"], node_id, self.c.issue_key(node_id), **kw)
            made.append(a)
            self.agents.append(a)
            return a

        def gateway(self, controller_port=None):
            self.key = make_key(self.store)
            port = controller_port or self.c.gateway_port
            gw = Gateway(tmp_path, self.store, workers=2, gateway__controller=f"127.0.0.1:{port}",
                         gateway__key_file=self.c.gateway_key_file() if self.c else self.early_gateway_key())
            made.append(gw)
            return gw

        def early_gateway_key(self) -> str:
            """A gateway key issued in the store before any controller runs, as `llmgw up` does; the controller
            started later reads it there, and its key pair, made now, in its keys folder."""
            engine = store.open_store(self.store)
            public, secret = curvekeys.issue_gateway_key(engine, "gw")
            engine.dispose()
            controller_public, _ = keyfiles.controller_keypair(f"{tmp_path}/controller-keys")
            path = f"{tmp_path}/gateway-early.key"
            filemodes.write_private(path, keyfiles.gateway_key_file("gw", public, secret, controller_public))
            return path

        def traffic(self, gw, models=("simmy",)):
            t = Traffic(gw.url, self.key, models)
            made.append(t)
            return t

    yield Cluster()
    for thing in reversed(made):
        thing.stop()


CHAT = {"model": "simmy", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def test_replicas_are_placed_spread_and_served_through_the_gateway(cluster, tmp_path):
    c = cluster.controller()
    cluster.agent("n1")
    cluster.agent("n2")
    gw = cluster.gateway()
    wait_for("both nodes", 10, lambda: len(c.nodes()) == 2)
    (tmp_path / "m.toml").write_text('name = "simmy"\naliases = ["s"]\nsource = "/dev/null"\n'
                                     'scaling = {min = 2, max = 3}\n[[profiles]]\nengine = "sim"\n')
    assert c.ctl("model", "add", "-f", str(tmp_path / "m.toml")).returncode == 0
    wait_for("two ready replicas", 20, lambda: len(c.ready("simmy")) == 2)
    assert {r["node"] for r in c.ready("simmy")} == {"n1", "n2"}  # spread over the nodes
    wait_for("the gateway to route to them", 10,
             lambda: post(gw.url + "/v1/chat/completions", {**CHAT, "model": "s"}, cluster.key)[0] == 200)
    def ask(i):
        body = {**CHAT, "messages": [{"role": "user", "content": f"question {i}"}]}
        return json.loads(post(gw.url + "/v1/chat/completions", body, cluster.key)[2])["system_fingerprint"]

    wait_for("the gateway to know both", 30, lambda: len({ask(i) for i in range(20)}) == 2)
    served = {ask(i) for i in range(20)}
    assert served == {f"sim-{r['shard_id']}" for r in c.ready("simmy")}
    table = c.ctl("replicas").stdout
    assert table.count(" ready ") == 2
    assert "2        2" in c.ctl("models").stdout.replace("  ", " " * 2)


def test_agent_killed_and_restarted_adopts_its_engines_with_no_failed_request(cluster, busy_machine):
    c = cluster.controller(models=[sim_model(low=1, high=1)])
    a = cluster.agent("n1")
    gw = cluster.gateway()
    wait_for("a ready replica", 30, lambda: len(c.ready("simmy")) == 1)
    wait_for("the gateway", 20, lambda: post(gw.url + "/v1/chat/completions", CHAT, cluster.key)[0] == 200)
    before = a.engines()
    traffic = cluster.traffic(gw)
    traffic.more(5)
    a.stop(sig=signal.SIGKILL, engines=False)
    # A slow restart (a loaded machine, a package upgrade): the node is lost before the agent is back,
    # and its replica, whose engine still answers, stays served meanwhile.
    wait_for("n1 lost", 20, lambda: c.state("n1") == "lost")
    traffic.more(5)
    a.start()
    wait_for("the agent to adopt", 30, lambda: "adopted shard" in a.log())
    # Registered again, in one message, with the engine it adopted.
    wait_for("the second registration", 30, lambda: c.log().count("node n1 registered") == 2)
    assert c.log().rsplit("node n1 registered", 1)[1].split("\n", 1)[0].endswith("1 shards running)")
    traffic.more(20)
    assert traffic.stop() == []
    assert a.engines() == before  # the same processes
    assert [r["shard_id"] for r in c.ready("simmy")] == list(before)
    wait_for_no_duplicates(c, cluster.agents, {"simmy": 1})


def test_controller_restart_rebuilds_from_agents_and_places_nothing_twice(cluster):
    c = cluster.controller(models=[sim_model(low=2, high=2)])
    cluster.agent("n1")
    cluster.agent("n2")
    wait_for("two ready", 20, lambda: len(c.ready("simmy")) == 2)
    shards = sorted(r["shard_id"] for r in c.ready("simmy"))
    c.stop()
    c.start(lead=True)
    wait_for("the replicas known again", 10, lambda: len(c.ready("simmy")) == 2)
    # Nothing may change: watched for five reconcile passes; a pass that would place or stop a replica does
    # so in the first.
    c.passes_made(5)
    assert sorted(r["shard_id"] for r in c.replicas("simmy")) == shards


def test_a_lost_nodes_replica_is_replaced_elsewhere(cluster):
    c = cluster.controller(models=[sim_model(low=1, high=1)])
    a1 = cluster.agent("n1")
    wait_for("a ready replica", 20, lambda: len(c.ready("simmy")) == 1)
    a2 = cluster.agent("n2")
    wait_for("n2", 10, lambda: c.state("n2") == "ready")
    first = c.ready("simmy")[0]
    gone = a1 if first["node"] == "n1" else a2
    gone.stop(sig=signal.SIGKILL)  # the node, engines and all
    wait_for("a replacement on the other node", 15,
             lambda: [r["node"] for r in c.ready("simmy")] == [("n2" if first["node"] == "n1" else "n1")])


def test_an_engine_that_fails_to_start_backs_off_and_shows_its_output(cluster):
    c = cluster.controller(models=[sim_model(low=1, high=1, args=["--no-such-flag"])])
    cluster.agent("n1")
    wait_for("a failure recorded", 15, lambda: c.api("/api/v1/models")["models"][0]["last_failure"])
    failure = c.api("/api/v1/models")["models"][0]["last_failure"]
    assert "exited with status 2" in failure["detail"]
    assert any("No such option" in line for line in failure["last_output"])
    shown = c.ctl("models")
    assert "No such option" in shown.stderr and "failed on n1" in shown.stderr
    # Backoff: 1 s, then 2 s, then 4 s... so it is tried again, but not every pass. Seen at COUNT before its
    # next failure, it fails twice more no sooner than the backoff after that next one (base 1 s x 2^COUNT);
    # a loaded machine only makes it later.
    asked = time.monotonic()
    count = c.api("/api/v1/models")["models"][0]["last_failure"]["count"]
    wait_for("two more failures", 120,
             lambda: c.api("/api/v1/models")["models"][0]["last_failure"]["count"] >= count + 2)
    assert time.monotonic() - asked >= 2 ** count


def test_a_changed_profile_marks_replicas_stale_without_restarting_them(cluster, tmp_path):
    c = cluster.controller()
    cluster.agent("n1")
    model_file = write_config(tmp_path / "m.toml", {})
    (tmp_path / "m.toml").write_text('name = "rt"\nsource = "/dev/null"\nscaling = {min = 1, max = 1}\n'
                                     '[[profiles]]\nengine = "sim"\nargs = ["--ttft-ms", "1"]\n')
    assert c.ctl("model", "add", "-f", model_file, "--no-source-check").returncode == 0
    wait_for("rt ready", 20, lambda: len(c.ready("rt")) == 1)
    shard = c.ready("rt")[0]["shard_id"]
    (tmp_path / "m.toml").write_text('name = "rt"\nsource = "/dev/null"\nscaling = {min = 1, max = 1}\n'
                                     '[[profiles]]\nengine = "sim"\nargs = ["--ttft-ms", "2"]\n')
    assert c.ctl("model", "add", "-f", model_file, "--no-source-check").returncode == 0
    wait_for("the replica marked stale", 30, lambda: c.replicas("rt")[0]["stale_profile"])
    replicas = c.replicas("rt")
    assert [(r["shard_id"], r["stale_profile"]) for r in replicas] == [(shard, True)]
    assert "ready (stale profile)" in c.ctl("replicas").stdout


def test_scale_and_remove_a_runtime_model(cluster, tmp_path):
    c = cluster.controller()
    cluster.agent("n1")
    (tmp_path / "m.toml").write_text('name = "rt"\nsource = "/dev/null"\n[[profiles]]\nengine = "sim"\n')
    assert c.ctl("model", "add", "-f", str(tmp_path / "m.toml")).returncode == 0  # /dev/null exists here
    wait_for("one", 20, lambda: len(c.ready("rt")) == 1)
    assert c.ctl("scale", "rt", "--min", "3").returncode == 0
    wait_for("three", 20, lambda: len(c.ready("rt")) == 3)
    assert c.ctl("scale", "rt", "--min", "1", "--max", "1").returncode == 0
    wait_for("back to one", 20, lambda: len(c.replicas("rt")) == 1)
    assert c.ctl("model", "remove", "rt").returncode == 0
    wait_for("none", 20, lambda: c.replicas("rt") == [])
    refused = c.ctl("model", "add", "-f", str(tmp_path / "nope.toml"))
    assert refused.returncode == 1 and "cannot read" in refused.stderr


def test_a_source_that_does_not_exist_is_refused_early(cluster, tmp_path):
    c = cluster.controller()
    (tmp_path / "m.toml").write_text('name = "x"\nsource = "/no/such/file.gguf"\n[[profiles]]\nengine = "sim"\n')
    refused = c.ctl("model", "add", "-f", str(tmp_path / "m.toml"))
    assert refused.returncode == 1 and "does not exist" in refused.stderr and "--no-source-check" in refused.stderr


def test_placement_explains_every_refusal(cluster):
    gpu_model = {"name": "big", "source": "/dev/null", "scaling": {"min": 1, "max": 1},
                 "profiles": [{"engine": "sim", "gpu_class": "h100-80g", "gpus": 2, "node_selector": {"rack": "r1"}}]}
    vllm_model = {"name": "vl", "source": "/dev/null", "profiles": [{"engine": "vllm", "gpus": 1}]}
    c = cluster.controller(models=[gpu_model, vllm_model])
    cluster.agent("gpu-a", labels={"rack": "r1"}, nvidia_smi_capture="nvidia-smi-8xh100.csv")
    cluster.agent("gpu-b", labels={"rack": "r2"}, nvidia_smi_capture="nvidia-smi-8xh100.csv")
    cluster.agent("cpu", labels={"rack": "r1"})
    wait_for("three nodes", 10, lambda: len(c.nodes()) == 3)
    wait_for("big placed", 20, lambda: len(c.ready("big")) == 1)
    replica = c.ready("big")[0]
    assert replica["node"] == "gpu-a" and replica["gpus"] == [0, 1]
    why = c.ctl("explain-placement", "big").stdout
    assert "label rack=r1 wanted, node has rack=r2" in why
    assert "needs 2 x h100-80g, 0 free of 0" in why  # the CPU node
    assert "fits (GPUs 2, 3)" in why  # gpu-a could take another: 0 and 1 are held by the first
    vl = c.api("/api/v1/models")
    unplaced = next(m for m in vl["models"] if m["name"] == "vl")["unplaced"]
    assert unplaced and all("engine vllm is not installed there" in r for r in unplaced.values())
    assert "cannot be placed" in c.ctl("models").stderr


def test_replicas_get_their_gpus_and_logs_come_back(cluster):
    model = {"name": "g", "source": "/dev/null", "profiles": [{"engine": "sim", "gpu_class": "h100-80g", "gpus": 1}]}
    c = cluster.controller(models=[model])
    a = cluster.agent("gpu-a", nvidia_smi_capture="nvidia-smi-8xh100.csv")
    wait_for("g ready", 20, lambda: len(c.ready("g")) == 1)
    shard = c.ready("g")[0]["shard_id"]
    pid = a.engines()[shard]
    with open(f"/proc/{pid}/environ", "rb") as f:
        environ = f.read().split(b"\0")
    # NVML's indices, in PCI bus order: CUDA's own order puts the fastest card first.
    assert b"CUDA_VISIBLE_DEVICES=0" in environ and b"CUDA_DEVICE_ORDER=PCI_BUS_ID" in environ
    # The agent reports what the engine itself says about its load, and its CPU and memory.
    wait_for("the engine's own figures", 30,
             lambda: f'llmgw_shard_requests_running{{node="gpu-a",shard="{shard}"}} 0.0' in c.metrics())
    assert f'llmgw_shard_memory_bytes{{node="gpu-a",shard="{shard}"}}' in c.metrics()
    logs = c.ctl("logs", "gpu-a", "--source", shard)
    assert logs.returncode == 0 and "llmgw: starting" in logs.stdout
    missing = c.ctl("logs", "gpu-a", "--source", "nope")
    assert missing.returncode == 1 and shard in missing.stderr


def test_an_on_demand_model_starts_for_a_request_and_stops_when_idle(cluster):
    model = {
        "name": "lazy", "source": "/dev/null", "scaling": {"min": 0, "max": 1, "idle_timeout": "3s"},
        "profiles": [{"engine": "sim", "args": ["--ttft-ms", "5"]}]}
    c = cluster.controller(models=[model])
    cluster.agent("n1")
    gw = cluster.gateway()
    def models():
        req = urllib.request.Request(gw.url + "/v1/models", headers={"Authorization": f"Bearer {cluster.key}"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.loads(resp.read())["data"]

    wait_for("the gateway to know the model", 10, lambda: any(m["id"] == "lazy" for m in models()))
    assert c.replicas("lazy") == []  # nobody asked: nothing runs
    started = time.monotonic()
    status, _, raw = post(gw.url + "/v1/chat/completions", {**CHAT, "model": "lazy"}, cluster.key, timeout=60)
    assert status == 200 and json.loads(raw)["model"] == "lazy"
    assert time.monotonic() - started < 15
    # A stream for it while it runs is answered at once; then, unused for 3 s, it stops.
    wait_for("the idle model to stop", 15, lambda: c.replicas("lazy") == [])
    # Asked for again as a stream: kept alive with comments while it loads, then the answer.
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({**CHAT, "model": "lazy", "stream": True}),
                 {"Authorization": f"Bearer {cluster.key}", "Content-Type": "application/json"})
    text = conn.getresponse().read().decode()
    conn.close()
    assert text.startswith(": lazy is loading") and "tok0" in text and text.rstrip().endswith("[DONE]")


def test_a_model_that_cannot_start_is_503_loading_with_retry_after(cluster, tmp_path):
    model = {"name": "never", "source": "/dev/null", "scaling": {"min": 0, "max": 1},
             "profiles": [{"engine": "vllm"}]}
    c = cluster.controller(models=[model])
    cluster.agent("n1")
    url = cluster.store
    key = make_key(url)
    gw = Gateway(tmp_path, url, workers=1, gateway__controller=f"127.0.0.1:{c.gateway_port}", gateway__load_wait=1.0,
                 gateway__key_file=c.gateway_key_file())
    try:
        wait_for("the gateway to know the model", 20,
                 lambda: b"catalog_unknown" not in post(gw.url + "/v1/chat/completions", {**CHAT, "model": "never"},
                                                        key)[2])
        status, headers, raw = post(gw.url + "/v1/chat/completions", {**CHAT, "model": "never"}, key)
        assert status == 503 and headers["Retry-After"] == "60" and "is loading" in json.loads(raw)["error"]["message"]
        unplaced = c.api("/api/v1/models")["models"][0]["unplaced"]
        assert "engine vllm is not installed" in unplaced["n1"]  # wanted, and the operator can see why not
    finally:
        gw.stop()


def test_drain_moves_replicas_one_at_a_time_with_no_failed_request(cluster, tmp_path, busy_machine):
    c = cluster.controller()
    cluster.agent("n1")
    wait_for("n1", 20, lambda: c.state("n1") == "ready")
    for name in ("ma", "mb"):
        (tmp_path / f"{name}.toml").write_text(f'name = "{name}"\nsource = "/dev/null"\n[[profiles]]\nengine = "sim"\n')
        assert c.ctl("model", "add", "-f", str(tmp_path / f"{name}.toml")).returncode == 0
    wait_for("both on n1", 30, lambda: len(c.ready("ma")) == 1 and len(c.ready("mb")) == 1)
    cluster.agent("n2")
    wait_for("n2", 20, lambda: c.state("n2") == "ready")
    gw = cluster.gateway()
    wait_for("the gateway", 20, lambda: post(gw.url + "/v1/chat/completions", {**CHAT, "model": "ma"},
                                             cluster.key)[0] == 200)
    traffic = cluster.traffic(gw, models=("ma", "mb"))
    assert c.ctl("drain", "n1").returncode == 0
    most_starting = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rows = c.replicas()
        most_starting = max(most_starting, sum(1 for r in rows if r["node"] == "n2" and r["state"] != "ready"))
        if all(r["node"] == "n2" and r["state"] == "ready" for r in rows) and len(rows) == 2:
            break
        time.sleep(0.05)
    traffic.more(20)  # served by the new replicas, the old ones stopping
    assert traffic.stop() == []
    assert sorted(r["model"] for r in c.replicas() if r["node"] == "n2") == ["ma", "mb"]
    assert most_starting <= 1  # one move at a time
    assert c.state("n1") == "draining"
    wait_for_no_duplicates(c, cluster.agents, {"ma": 1, "mb": 1})


def test_a_removed_models_replica_finishes_its_streams_before_it_stops(cluster, tmp_path):
    c = cluster.controller()
    cluster.agent("n1")
    gw = cluster.gateway()
    (tmp_path / "m.toml").write_text('name = "rt"\nsource = "/dev/null"\n[[profiles]]\nengine = "sim"\n'
                                     'args = ["--ttft-ms", "1", "--tokens-per-s", "5"]\n')
    assert c.ctl("model", "add", "-f", str(tmp_path / "m.toml")).returncode == 0
    wait_for("rt ready", 20, lambda: len(c.ready("rt")) == 1)
    wait_for("the gateway", 10, lambda: post(gw.url + "/v1/chat/completions",
                                             {**CHAT, "model": "rt", "max_tokens": 1}, cluster.key)[0] == 200)
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({**CHAT, "model": "rt", "stream": True, "max_tokens": 20}),
                 {"Authorization": f"Bearer {cluster.key}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert c.ctl("model", "remove", "rt").returncode == 0  # four seconds of stream still to come
    text = resp.read().decode()
    conn.close()
    assert "tok19" in text and text.rstrip().endswith("[DONE]")  # drained, not cut
    wait_for("the replica gone", 20, lambda: c.replicas("rt") == [])


def test_a_url_source_is_fetched_resumed_after_an_interruption_and_served(cluster, tmp_path):
    import http.server

    blob = b"GGUF" + bytes(400_000)
    served = []

    class Flaky(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(blob)))
            self.end_headers()

        def do_GET(self):
            start = int(self.headers["Range"].split("=")[1].rstrip("-")) if self.headers.get("Range") else 0
            self.send_response(206 if start else 200)
            self.send_header("Content-Length", str(len(blob) - start))
            self.end_headers()
            served.append(start)
            if len(served) == 1:
                self.wfile.write(blob[:150_000])  # the first try breaks off
                self.wfile.flush()
                self.connection.shutdown(2)
                return
            self.wfile.write(blob[start:])

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        c = cluster.controller(controller__source_allow=["127.0.0.0/8"])  # the model's server here is on loopback
        a = cluster.agent("n1")
        url = f"http://127.0.0.1:{httpd.server_address[1]}/tiny/v1/tiny.gguf"
        (tmp_path / "m.toml").write_text(f'name = "fetched"\nsource = "{url}"\n[[profiles]]\nengine = "sim"\n')
        assert c.ctl("model", "add", "-f", str(tmp_path / "m.toml")).returncode == 0  # HEAD answers
        wait_for("the model served after a retry", 30, lambda: len(c.ready("fetched")) == 1)
        assert served == [0, 150_000]  # the second request resumed where the first stopped
        failure = c.api("/api/v1/models")["models"][0]["last_failure"]
        assert "broke off after 150000 of 400004 bytes" in failure["detail"]
        files = sorted(p.name for p in (a.folder / "weights").iterdir() if p.name != ".llmgw-fetched")  # its marks
        assert len(files) == 1 and files[0].endswith("-tiny.gguf")  # complete, under its final name
        assert (a.folder / "weights" / files[0]).read_bytes() == blob
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_gateway_worker_waits_for_the_catalog_rather_than_answer_404(cluster, busy_machine):
    # The gateway starts before its controller: its workers have heard no catalog yet. A request
    # then must wait for it, not be told that the model does not exist ("Models: none yet").
    snapshots = free_port()
    gw = cluster.gateway(controller_port=snapshots)
    early = {}
    asked = threading.Thread(target=lambda: early.update(answer=post(gw.url + "/v1/chat/completions", CHAT,
                                                                     cluster.key, timeout=150)))
    asked.start()
    c = cluster.controller(models=[sim_model(low=1, high=1)], controller__gateway_listen=f"127.0.0.1:{snapshots}")
    cluster.agent("n1")
    asked.join(timeout=150)
    status, _, raw = early["answer"]
    assert status == 200, raw
    assert len(c.ready("simmy")) == 1
    # Once the catalog is known, a name it does not hold is a 404 at once.
    status, _, raw = post(gw.url + "/v1/chat/completions", {**CHAT, "model": "nope"}, cluster.key)
    assert status == 404 and "simmy" in json.loads(raw)["error"]["message"]


def _one_replica_on_n1_and_traffic(cluster, **settings):
    """A controller, n1 serving simmy's one replica, n2 empty, a gateway and a client sending."""
    c = cluster.controller(models=[sim_model(low=1, high=1)], **settings)
    n1 = cluster.agent("n1")
    wait_for("a ready replica on n1", 30, lambda: [r["node"] for r in c.ready("simmy")] == ["n1"])
    n2 = cluster.agent("n2")
    wait_for("n2", 20, lambda: c.state("n2") == "ready")
    gw = cluster.gateway()
    wait_for("the gateway", 20, lambda: post(gw.url + "/v1/chat/completions", CHAT, cluster.key)[0] == 200)
    traffic = cluster.traffic(gw)
    traffic.more(5)
    return c, n1, n2, c.ready("simmy")[0]["shard_id"], traffic


def _placed_on(agent) -> list[str]:
    """Every shard ever started on AGENT's node (each leaves its log file)."""
    return sorted(p.stem for p in (agent.folder / "work" / "shards").glob("*.log"))


def test_a_restarted_controller_places_nothing_until_a_late_agent_is_back(cluster, busy_machine):
    # Nodes have 30 s to come back to a restarted controller (controller.unreachable_after): the steps below
    # must all fall within it, and ten requests through a loaded machine once took longer than 10 s. A
    # window longer than needed costs nothing: the controller stops waiting once every node is back.
    c, n1, n2, original, traffic = _one_replica_on_n1_and_traffic(
        cluster, controller__unreachable_after=30.0, controller__lost_after=60.0)
    n1.pause()  # its agent will be late; its engine goes on answering
    c.stop(sig=signal.SIGKILL)
    c.start(lead=True)
    wait_for("n2 registered with the new controller", 20, lambda: c.state("n2") == "ready")
    traffic.more(10)  # the gateways still route to n1's replica, which the controller does not know yet
    assert c.replicas("simmy") == []
    n1.resume()
    wait_for("n1's replica known again", 20, lambda: [r["shard_id"] for r in c.ready("simmy")] == [original])
    traffic.more(20)
    assert traffic.stop() == []
    wait_for_no_duplicates(c, cluster.agents, {"simmy": 1})
    assert [r["shard_id"] for r in c.replicas("simmy")] == [original]
    assert _placed_on(n2) == []  # nothing was ever started twice


def test_a_restarted_controller_stops_a_late_agents_replica_and_keeps_the_one_placed_meanwhile(cluster, busy_machine):
    c, n1, n2, original, traffic = _one_replica_on_n1_and_traffic(cluster)
    n1.pause()
    c.stop(sig=signal.SIGKILL)
    c.start(lead=True)
    # n1 is later than the 1 s a node has to come back: a replica is placed on n2.
    wait_for("a replica placed on n2", 30, lambda: [r["node"] for r in c.ready("simmy")] == ["n2"])
    duplicate = c.ready("simmy")[0]["shard_id"]
    traffic.more(10)
    # Later than the 2 s (lost_after) in which a node may bring back what the last controller placed.
    wait_for("the adoption window to close", 30, lambda: not c.api("/api/v1/status")["adopting"])
    n1.resume()
    # Past its window, this controller takes only shards it placed: n1's is stopped, and the one placed
    # meanwhile serves on, never interrupted. (It once kept whichever had served longest, so any node could
    # bring in a replica nobody placed.)
    wait_for("the late agent's engine stopped", 30, lambda: n1.engines() == {})
    traffic.more(20)
    assert traffic.stop() == []
    wait_for_no_duplicates(c, cluster.agents, {"simmy": 1})
    assert [r["shard_id"] for r in c.replicas("simmy")] == [duplicate] != [original]
    assert f"this controller did not place {original}" in c.log()


def test_a_silent_nodes_replica_serves_until_its_replacement_is_ready(cluster, busy_machine):
    c, n1, n2, original, traffic = _one_replica_on_n1_and_traffic(cluster)
    n1.pause()  # silent past lost_after (2 s), its engine still answering
    seen_lost_and_served = []

    def replaced():
        rows = {r["shard_id"]: r for r in c.replicas("simmy")}
        if c.state("n1") == "lost" and rows.get(original, {}).get("state") == "ready":
            seen_lost_and_served.append(True)
        return any(r["node"] == "n2" and r["state"] == "ready" for r in rows.values())

    wait_for("a replacement ready on n2", 30, replaced)
    wait_for("the lost node's replica retired", 20, lambda: [r["node"] for r in c.replicas("simmy")] == ["n2"])
    assert seen_lost_and_served  # the old replica stayed in the snapshot while n1 was lost
    traffic.more(10)
    n1.resume()  # back: its replaced engine is stopped
    wait_for("n1's old engine stopped", 30, lambda: n1.engines() == {})
    traffic.more(10)
    assert traffic.stop() == []
    wait_for_no_duplicates(c, cluster.agents, {"simmy": 1})
    assert c.state("n1") == "ready"


def test_a_replaced_gateway_worker_serves_at_once_from_the_masters_last_word(cluster, busy_machine):
    # A worker that replaces a crashed one used to answer 503 until the controller's next snapshot
    # reached it (610 failures over 3 kills); it now starts from what the master heard last.
    c = cluster.controller(models=[sim_model(low=1, high=1)])
    cluster.agent("n1")
    wait_for("a ready replica", 30, lambda: len(c.ready("simmy")) == 1)
    gw = cluster.gateway()
    wait_for("the gateway", 30, lambda: post(gw.url + "/v1/chat/completions", CHAT, cluster.key)[0] == 200)
    traffic = cluster.traffic(gw)
    traffic.more(5)
    def count(pattern: str) -> int:
        return len(re.findall(pattern, gw.log()))

    for _ in range(3):
        pids = [int(p) for p in re.findall(r"Booting worker with pid: (\d+)", gw.log())]
        booted, started = len(pids), count("started from the master's last snapshot")
        os.kill(pids[-1], signal.SIGKILL)
        wait_for("the replacement worker", 60, lambda b=booted: count("Booting worker with pid") > b)
        wait_for("the replacement to start from the master's copy", 60,
                 lambda s=started: count("started from the master's last snapshot") > s)
        traffic.more(10)
    failures = traffic.stop()
    # A request in flight on the worker killed dies with it (no answer at all); no request may get an
    # error answer from the gateway.
    resets = [f for f in failures if f[1] is None]
    assert [f for f in failures if f[1] is not None] == [] and len(resets) <= 3, failures
