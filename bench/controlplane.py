"""The control plane as the fleet grows: 100, 1,000 and 5,000 simulated agents with 4 replicas each.

    python bench/controlplane.py [--quick] [--sizes 100,1000,5000] [--baseline CHECKOUT] [--out FILE]
                                 [--chart FILE]

Simulated agents live many to a process (ZeroMQ DEALERs with CURVE keys issued like any node's, one poller
thread per process, 2,500 agents a process at most) and behave like real ones on the wire: they register
with a full description (8 GPUs, CPU, memory, disk, engines), heartbeat every 5 s with their load, and
answer start_shard by reporting starting, then ready half a second later (no engine runs: this measures
the control plane, not engines). The controller is pinned to CPU 0 with its SQLite store; the agents, and a
gateway of two workers following the controller over CURVE as deployed, to CPU 1.

For each size N (nodes), with N/10 models of 40 replicas each (4 replicas a node on average):
- every agent registered, from their start;
- the controller's CPU share and resident memory with the fleet idle, then with every replica running;
- a reconcile pass with the fleet steady, and the pass that placed every replica; from the models added
  to every replica ready;
- the snapshot: its size, and what a gateway worker stops for to read one (decoded and built into its
  routing table, with this checkout's code);
- from a model added to the catalog to the gateway listing it on 20 new connections in a row (each of
  its workers, whichever takes them), and `/v1/models`'s latency, one request at a time, meanwhile
  (the controller repeats the snapshot every 2 s);
- from an agent falling silent to its node marked unreachable (the promise: `unreachable_after`, 15 s,
  plus the pass that notices).
A step that does not finish within its limit is recorded as such and ends that size's run for that
checkout (a controller that cannot place 20,000 replicas in five minutes is the finding). With `--baseline
CHECKOUT`, the same from CHECKOUT's controller.py and gateway.py, one after the other in this run. The
store is made with this checkout's code, so the baseline must share its migrations.

The 1-minute load average is recorded at the start and end of each size; above 1.0 at the start (two
cores, nothing else should run), the figures are marked noisy and no aim is judged on them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import curves  # noqa: E402
from bench.chart import log_lines  # noqa: E402
from bench.procstat import children, cpu_seconds, rss_kib  # noqa: E402
from llmgw import addresses, keyfiles, settings, store  # noqa: E402
from llmgw.apiclient import ApiClient, ApiError  # noqa: E402
from llmgw.control import curvekeys  # noqa: E402
from llmgw.node.discovery import parse_nvidia_smi  # noqa: E402
from llmgw.procs import free_port, raise_fd_limit, wait_for  # noqa: E402
from llmgw.wire import agent as protocol  # noqa: E402

SIZES = (100, 1_000, 5_000)
QUICK_SIZES = (20,)
PER_NODE = 4  # replicas a node, on average
PER_MODEL = 40  # replicas a model
PER_PROCESS = 2_500  # agents a process: two descriptors each, within the machine's 20,000


class Gave(Exception):
    """A step that did not finish within its limit: the size's run for this checkout ends there."""


def run_agents(address: str, key_files: list[str], interval: float, silent: str | None) -> None:
    """Many agents in this process: register, heartbeat, answer start_shard."""
    with open(os.path.join(ROOT, "tests", "fixtures", "nvidia-smi-8xh100.csv")) as f:
        gpus = parse_nvidia_smi(f.read())
    context = zmq.Context()
    context.set(zmq.MAX_SOCKETS, len(key_files) + 64)
    poller = zmq.Poller()
    agents = {}
    for path in key_files:
        keys = keyfiles.read_node_key_file(path)
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_secretkey = keys["secret_key"].encode()
        sock.curve_publickey = keys["public_key"].encode()
        sock.curve_serverkey = keys["controller_public_key"].encode()
        sock.connect(addresses.zmq_connect(address, "controller.agent_listen"))
        node = keys["node_id"]
        sock.send(protocol.encode(
            "register", node_id=node, agent_version="bench", address="127.0.0.1", labels={"rack": node[-1]},
            cpu={"count": 64, "flags": ["avx2", "avx512f"]}, memory={"total_bytes": 512 << 30},
            disk={"path": "/w", "total_bytes": 4 << 40, "free_bytes": 3 << 40}, gpus=gpus, gpus_probed=True,
            engines={"sim": "bench"}, engines_probed=True, shards=[]))
        poller.register(sock, zmq.POLLIN)
        agents[sock] = {"node": node, "next": time.monotonic() + random.random() * interval, "seq": 0, "later": []}
    while True:
        now = time.monotonic()
        for sock, a in agents.items():
            if a["node"] == silent and os.path.exists(silent_flag(address)):
                continue
            if now >= a["next"]:
                a["seq"] += 1
                sock.send(protocol.encode("heartbeat", node_id=a["node"], seq=a["seq"],
                                          memory={"available_bytes": random.randint(400, 500) << 30},
                                          load={"load1": round(random.random() * 4, 2)}))
                a["next"] = now + interval
            if a["later"]:
                for due, status in [x for x in a["later"] if x[0] <= now]:
                    sock.send(protocol.encode("shard_status", **status))
                    a["later"].remove((due, status))
        for sock, _ in poller.poll(50):
            message = protocol.decode(sock.recv())
            a = agents[sock]
            if message["type"] == "start_shard":
                base = dict(node_id=a["node"], shard_id=message["shard_id"], model=message["model"],
                            engine="sim", profile_fp=message.get("profile_fp"), port=1, url="http://127.0.0.1:1")
                sock.send(protocol.encode("ack", node_id=a["node"], request_id=message["request_id"], ok=True))
                sock.send(protocol.encode("shard_status", state="starting", **base))
                a["later"].append((time.monotonic() + 0.5, {**base, "state": "ready"}))


def silent_flag(address: str) -> str:
    """The file that silences one agent of the fleet at ADDRESS (a run's own, so that runs side by side do not
    silence each other's)."""
    return os.path.join(tempfile.gettempdir(), f"llmgw-bench-silent-{address.replace(':', '-')}")


class Fleet:
    """A store with N nodes' keys, a gateway's key and an API key, and a controller's configuration; made once
    a size and run from each checkout in turn."""

    def __init__(self, tmp: Path, size: int):
        from llmgw.people import keys

        self.tmp, self.size = tmp, size
        self.pristine = tmp / "cp.db"  # each run takes a copy: a run's catalog must not be the next one's
        self.keys_dir = str(tmp / "keys")
        engine = store.open_store(f"sqlite:///{self.pristine}")
        controller_public, _ = keyfiles.controller_keypair(self.keys_dir)
        self.key_files = []
        for i in range(size):
            node = f"node-{i:05d}"
            public, secret = curvekeys.issue_node_key(engine, node)
            path = tmp / f"{node}.key"
            path.write_text(keyfiles.node_key_file(node, public, secret, controller_public))
            self.key_files.append(str(path))
        public, secret = curvekeys.issue_gateway_key(engine, "bench")
        self.gateway_key = tmp / "gateway.key"
        self.gateway_key.write_text(keyfiles.gateway_key_file("bench", public, secret, controller_public))
        self.gateway_key.chmod(0o600)
        self.api_key = keys.create_key(engine, "bench")[1]
        engine.dispose()


def run(fleet: Fleet, root: str, window: float, quick: bool, read: bool) -> dict:
    """One checkout's controller (from ROOT) under FLEET: what the module's docstring lists, as far as it got;
    READ: the snapshot read in this process too (this checkout's run)."""
    from llmgw.control.adminapi import ensure_token
    from tests.conftest import Gateway

    ports = {k: f"127.0.0.1:{free_port()}" for k in ("agent_listen", "admin_listen", "metrics_listen",
                                                       "gateway_listen", "demand_listen", "accountant_listen")}
    copy = fleet.tmp / f"cp-{ports['admin_listen'].split(':')[1]}.db"
    shutil.copyfile(fleet.pristine, copy)
    copy.chmod(0o600)  # a store others may read is refused
    url = f"sqlite:///{copy}"
    values = {"store.url": url, "controller.keys_dir": fleet.keys_dir, "log.level": "warning",
              **{f"controller.{k}": v for k, v in ports.items()}}
    config = fleet.tmp / f"controller-{ports['admin_listen'].split(':')[1]}.toml"
    config.write_text(settings.to_toml(values))
    log_path = fleet.tmp / f"controller-{ports['admin_listen'].split(':')[1]}.log"
    admin = ApiClient(f"http://{ports['admin_listen']}", "the controller's admin API",
                      token=ensure_token(fleet.keys_dir))
    flag = silent_flag(ports["agent_listen"])
    if os.path.exists(flag):
        os.remove(flag)
    size, replicas = fleet.size, fleet.size * PER_NODE
    out: dict = {"replicas": replicas, "models": math.ceil(replicas / PER_MODEL)}
    procs: list[subprocess.Popen] = []
    gateway = None

    def status() -> dict:
        return admin.call("GET", "/api/v1/status", timeout=30)

    def until(what: str, limit: float, done, interval: float = 0.2) -> float:
        began = time.monotonic()
        try:
            wait_for(what, limit, lambda: _answers(done), interval=interval)
        except TimeoutError as e:
            raise Gave(str(e)) from None
        return round(time.monotonic() - began, 2)

    def cpu_share(pid: int, seconds: float) -> float:
        before, began = cpu_seconds(pid), time.monotonic()
        time.sleep(seconds)
        return round((cpu_seconds(pid) - before) / (time.monotonic() - began), 3)

    try:
        with open(log_path, "wb") as log:
            controller = subprocess.Popen(["taskset", "-c", "0", sys.executable, os.path.join(root, "controller.py"),
                                           "--config", str(config)], stdout=log, stderr=subprocess.STDOUT)
        procs.append(controller)
        until("the controller", 60, status)
        silent = Path(fleet.key_files[1]).stem
        started = time.monotonic()
        for i in range(0, size, PER_PROCESS):
            chunk = fleet.key_files[i:i + PER_PROCESS]
            procs.append(subprocess.Popen(["taskset", "-c", "1", sys.executable, __file__, "--run-agents",
                                           ports["agent_listen"], "5.0", silent, *chunk]))
        until("every agent registered", 300, lambda: status()["nodes"]["ready"] == size, interval=0.5)
        out["all_registered_s"] = round(time.monotonic() - started, 2)
        time.sleep(6)  # one full heartbeat round
        out["cpu_idle"] = cpu_share(controller.pid, window)
        out["rss_idle_mib"] = round(rss_kib(controller.pid) / 1024)
        out["pass_idle_s"] = status()["reconcile_seconds"]

        added = time.monotonic()
        for m in range(out["models"]):
            model = {"name": f"wide-{m:04d}", "source": "/dev/null",
                     "scaling": {"min": PER_MODEL, "max": PER_MODEL},
                     "profiles": [{"engine": "sim", "gpu_class": "h100-80g", "gpus": 1}]}
            admin.call("POST", "/api/v1/models?source_check=0", model, timeout=120)
        limit = 120 if quick else 300
        try:
            until(f"{replicas} replicas ready", limit, lambda: status()["replicas_ready"] >= replicas, interval=1)
        except Gave:
            out["ready_after_limit"] = _answers(lambda: status()["replicas_ready"]) or 0
            out["gave_up"] = f"{out['ready_after_limit']:,} of {replicas:,} replicas ready after {limit} s"
            raise
        out["all_ready_s"] = round(time.monotonic() - added, 2)
        time.sleep(6)  # past the next regular pass, which has nothing to place
        now = status()
        out["pass_steady_s"], out["pass_placing_s"] = now["reconcile_seconds"], now["reconcile_seconds_max"]
        out["cpu_replicas"] = cpu_share(controller.pid, window)
        out["rss_replicas_mib"] = round(rss_kib(controller.pid) / 1024)
        out["snapshot"] = snapshot_cost(ports["gateway_listen"], fleet.gateway_key, read)

        gateway = Gateway(fleet.tmp, url, workers=2, root=root, start_limit=300,
                          gateway__controller=ports["gateway_listen"], gateway__key_file=str(fleet.gateway_key))
        for pid in (gateway.proc.pid, *children(gateway.proc.pid)):
            subprocess.run(["taskset", "-pc", "1", str(pid)], capture_output=True)
        until("the gateway listing the fleet's models", 120,
              lambda: f"wide-{out['models'] - 1:04d}" in models_listed(gateway.port, fleet.api_key))
        out.update(model_added(admin, ports["gateway_listen"], gateway.port, fleet))
        out.update(serving(gateway, fleet.api_key, window))
        out["gateway_rss_mib"] = round(sum(rss_kib(p) for p in (gateway.proc.pid, *children(gateway.proc.pid)))
                                       / 1024)

        open(flag, "w").close()
        out["silent_to_unreachable_s"] = until(
            "the silent agent unreachable", 90,
            lambda: {n["node_id"]: n for n in admin.call("GET", "/api/v1/nodes", timeout=30)["nodes"]}
            [silent]["state"] == "unreachable", interval=0.2)
        out.update(every_model_routed(admin, ports["gateway_listen"], gateway, fleet, window, out["models"]))
    except Gave as e:
        out["gave_up"] = out.get("gave_up") or str(e)
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-8:])
        print(f"  gave up: {out['gave_up']}; the controller's log ends:\n{tail}", file=sys.stderr)
    finally:
        if gateway is not None:
            gateway.stop()
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if os.path.exists(flag):
            os.remove(flag)
    return out


def every_model_routed(admin: ApiClient, address: str, gateway, fleet: Fleet, window: float, models: int) -> dict:
    """A model added and `/v1/models` again, with every model routed to lately, as by a gateway in service:
    each asked for six times on new connections, which the workers share out (so each of two workers asks
    for all but one in 32 of them). No engine answers here, so a worker's read of a replica is a refused
    connection, cheaper than the `/metrics` of an engine in service; asking is what makes a worker read a
    model's engines. A limit passed, or a request that fails, is recorded; the run goes on."""
    chat = {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}

    def ask(m: int) -> str | None:
        conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=120)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps({**chat, "model": f"wide-{m % models:04d}"}),
                         headers={"Authorization": f"Bearer {fleet.api_key}", "Content-Type": "application/json"})
            conn.getresponse().read()
            return None
        except (OSError, http.client.HTTPException) as e:
            return f"a request failed: {type(e).__name__}: {e}"
        finally:
            conn.close()

    # Many at once: a gateway whose workers read every replica answers each slowly (seconds at 5,000 nodes).
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        failed = [why for why in pool.map(ask, range(6 * models)) if why]
    if failed:
        return {"routed_gave_up": f"{len(failed)} of {6 * models} requests failed, the first: {failed[0]}"}
    try:
        figures = {**model_added(admin, address, gateway.port, fleet, "probe-routed"),
                   **serving(gateway, fleet.api_key, window)}
    except Gave as e:
        return {"routed_gave_up": str(e)}
    return {f"{key}_routed": value for key, value in figures.items()}


def model_added(admin: ApiClient, address: str, port: int, fleet: Fleet, name: str = "probe") -> dict:
    """From model NAME added through the admin API to the controller answering, its snapshot at ADDRESS
    carrying it, and the gateway at PORT listing it on 20 new connections in a row (each worker, whichever
    takes them)."""
    out = {}
    context, sub = subscriber(address, fleet.gateway_key)
    try:
        time.sleep(1)  # joined before the change (a SUB hears only what is sent after it joined)
        added = time.monotonic()
        admin.call("POST", "/api/v1/models?source_check=0",
                   {"name": name, "source": "/dev/null", "scaling": {"min": 0, "max": 1},
                    "profiles": [{"engine": "sim", "gpu_class": "h100-80g", "gpus": 1}]}, timeout=120)
        out["change_answered_s"] = round(time.monotonic() - added, 3)
        while f'"name":"{name}"'.encode() not in sub.recv_multipart()[1]:
            pass
        out["change_published_s"] = round(time.monotonic() - added, 3)
    except zmq.Again:
        raise Gave("the controller published no snapshot with the model added within 30 s") from None
    finally:
        sub.close(0)
        context.term()
    streak = 0
    while streak < 20:
        if time.monotonic() - added > 120:
            raise Gave("the gateway did not list a model added 120 s ago")
        streak = streak + 1 if f'"{name}"' in models_listed(port, fleet.api_key) else 0
    out["change_to_gateway_s"] = round(time.monotonic() - added, 3)
    return out


def serving(gateway, key: str, window: float) -> dict:
    """`/v1/models`, one request at a time for WINDOW seconds: its latency, and the gateway's CPU meanwhile
    (these requests included: nothing else asks anything of it)."""
    pids = (gateway.proc.pid, *children(gateway.proc.pid))
    conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=60)
    latencies: list[float] = []
    cpu_before, began = sum(cpu_seconds(p) for p in pids), time.monotonic()
    while time.monotonic() < began + window:
        sent = time.perf_counter()
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
        conn.getresponse().read()
        latencies.append(time.perf_counter() - sent)
    conn.close()
    return {"gateway_cpu": round((sum(cpu_seconds(p) for p in pids) - cpu_before) / (time.monotonic() - began), 3),
            "models_p50_ms": round(statistics.median(latencies) * 1000, 2),
            "models_p99_ms": round(curves.pct(latencies, 0.99) * 1000, 2),
            "models_max_ms": round(max(latencies) * 1000, 1)}


def subscriber(address: str, key_file: Path) -> tuple[zmq.Context, zmq.Socket]:
    """A SUB socket to the controller's snapshots at ADDRESS, as a gateway with KEY_FILE dials it; a receive
    waits 30 s at most."""
    from llmgw.wire import gateways
    from llmgw.wire.curve import ClientKeys, dial

    keys = keyfiles.read_gateway_key_file(str(key_file))
    context = zmq.Context()
    sock = context.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    dial(sock, ClientKeys(server_public=keys["controller_public_key"].encode(),
                          public=keys["public_key"].encode(), secret=keys["secret_key"].encode()))
    sock.setsockopt(zmq.SUBSCRIBE, gateways.SNAPSHOT)
    sock.connect(addresses.zmq_connect(address, "gateway.controller"))
    return context, sock


def snapshot_cost(address: str, key_file: Path, read: bool) -> dict:
    """The next snapshot the controller publishes, as a gateway receives it: its bytes, and with READ what a
    worker stops for to read it and build its routing table from it (this checkout's code, in this process:
    a baseline's gateway code is measured only by its requests' latency)."""
    from llmgw.gateway.follower import from_controller
    from llmgw.gateway.snapshot import Snapshot
    from llmgw.wire import gateways

    context, sock = subscriber(address, key_file)
    try:
        data = sock.recv_multipart()[1]
    except zmq.Again:
        raise Gave("no snapshot within 30 s") from None
    finally:
        sock.close(0)
        context.term()
    if not read:
        return {"bytes": len(data)}
    times = []
    for _ in range(4):
        began = time.perf_counter()
        from_controller(gateways.decode(data), Snapshot(version=0, models={}, replicas={}))
        times.append(time.perf_counter() - began)
    # The first read of a fleet, and then the best of the next three: a change, with the replicas known.
    return {"bytes": len(data), "worker_first_ms": round(times[0] * 1000, 2),
            "worker_stop_ms": round(min(times[1:]) * 1000, 2)}


def models_listed(port: int, key: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def _answers(call):
    """CALL's result, or None where the controller did not answer in time (it is busy: the caller waits on)."""
    try:
        return call()
    except (ApiError, OSError, http.client.HTTPException):
        return None


def measure(size: int, window: float, baseline: str | None, quick: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"llmgw-cp-{size}-") as tmp:
        def figures() -> dict:
            fleet = Fleet(Path(tmp), size)
            out = {"this": run(fleet, ROOT, window, quick, read=True)}
            print(f"{size:,} agents: this checkout {json.dumps(out['this'])}", file=sys.stderr)
            if baseline:
                out["baseline"] = run(fleet, baseline, window, quick, read=False)
                print(f"{size:,} agents: baseline {json.dumps(out['baseline'])}", file=sys.stderr)
            return out

        return curves.under_load(size, figures)


# Each row of the report: its label, and the figures it shows (joined by " / "), each as (key, format, scale).
ROWS = (("every agent registered (s)", [("all_registered_s", ".1f")]),
        ("controller CPU, fleet idle (share of a core)", [("cpu_idle", ".3f")]),
        ("a reconcile pass, fleet idle (ms)", [("pass_idle_s", ".1f", 1000)]),
        ("models added to every replica ready (s)", [("all_ready_s", ".1f")]),
        ("the pass that placed them (s)", [("pass_placing_s", ".2f")]),
        ("a reconcile pass, every replica running (ms)", [("pass_steady_s", ".1f", 1000)]),
        ("controller CPU, every replica running (share of a core)", [("cpu_replicas", ".3f")]),
        ("controller memory, idle / running (MiB)", [("rss_idle_mib", ","), ("rss_replicas_mib", ",")]),
        ("a snapshot (KB)", [("snapshot.bytes", ",.0f", 0.001)]),
        ("a worker stops to read a snapshot, the first / a change (ms)",
         [("snapshot.worker_first_ms", ".1f"), ("snapshot.worker_stop_ms", ".1f")]),
        ("a model added: the controller answered / published it (s)",
         [("change_answered_s", ".2f"), ("change_published_s", ".2f")]),
        ("a model added to the gateway listing it (s)", [("change_to_gateway_s", ".2f")]),
        ("`/v1/models` p50 / p99 / longest (ms)",
         [("models_p50_ms", ".1f"), ("models_p99_ms", ".1f"), ("models_max_ms", ".1f")]),
        ("gateway CPU meanwhile, three processes (share of a core)", [("gateway_cpu", ".2f")]),
        ("gateway memory, three processes (MiB)", [("gateway_rss_mib", ",.0f")]),
        ("an agent silent to its node unreachable (s)", [("silent_to_unreachable_s", ".1f")]),
        ("every model routed to: a model added to the gateway listing it (s)", [("change_to_gateway_s_routed", ".2f")]),
        ("every model routed to: `/v1/models` p50 / p99 / longest (ms)",
         [("models_p50_ms_routed", ".1f"), ("models_p99_ms_routed", ".1f"), ("models_max_ms_routed", ".1f")]),
        ("every model routed to: gateway CPU (share of a core)", [("gateway_cpu_routed", ".2f")]))


def _figure(run: dict, key: str, form: str, scale: float = 1) -> str:
    """The figure at KEY (dotted: within a part) of RUN, formatted; "-" where that run did not get to it."""
    value = run
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "-" if value is None else format(value * scale, form)


def report(results: list[dict]) -> str:
    row = curves.row
    lines = [curves.header(results, "agents"),
             row("replicas, models", (f"{r['this']['replicas']:,}, {r['this']['models']:,}" for r in results))]
    for label, which in (("this checkout", "this"), ("baseline", "baseline")):
        if which not in results[0]:
            continue
        for name, shown in ROWS:
            lines.append(row(f"{label}: {name}", (" / ".join(_figure(r[which], *figure) for figure in shown)
                                                  for r in results)))
        lines.append(row(f"{label}: gave up", (r[which].get("gave_up", "-") for r in results)))
        lines.append(row(f"{label}: gave up, every model routed to", (r[which].get("routed_gave_up", "-")
                                                                       for r in results)))
    lines.append(curves.load_row(results))
    return "".join(lines)


def chart(results: list[dict]) -> str:
    sizes = [r["size"] for r in results]
    series = {}
    for which, name in (("this", "this checkout"), ("baseline", "baseline")):
        if which in results[0]:
            series[f"placing every replica (s), {name}"] = [r[which].get("all_ready_s") for r in results]
            series[f"controller CPU, running (% of a core), {name}"] = [
                None if r[which].get("cpu_replicas") is None else 100 * r[which]["cpu_replicas"] for r in results]
    series["a worker reading a snapshot (ms)"] = [(r["this"].get("snapshot") or {}).get("worker_stop_ms")
                                                  for r in results]
    return log_lines("The controller as the fleet grows", "agents", "seconds, %, milliseconds", sizes, series)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    curves.arguments(parser, "agents", SIZES, f"{QUICK_SIZES} agents and 3 s windows: a smoke run",
                     "seconds each CPU share and latency is measured over [20; --quick 3]")
    parser.add_argument("--run-agents", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_agents is not None:
        address, interval, silent, *files = args.run_agents
        run_agents(address, files, float(interval), silent or None)
        return 0
    if args.baseline and not os.path.isfile(os.path.join(args.baseline, "controller.py")):
        parser.error(f"--baseline: {args.baseline} holds no controller.py")
    limit = raise_fd_limit()
    sizes = curves.sizes_of(args, SIZES, QUICK_SIZES)
    if max(sizes) * 2 + 1000 > limit:
        parser.error(f"{max(sizes):,} agents need about {max(sizes) * 2 + 1000:,} open files; this machine "
                     f"allows {limit:,} (raise the hard limit: ulimit -Hn)")
    window = args.seconds or (3.0 if args.quick else 20.0)
    results = [measure(size, window, args.baseline, args.quick) for size in sizes]
    curves.finish(args, sizes, window, results, report(results), chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
