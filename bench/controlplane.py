"""The controller under a fleet: 500 light simulated agents heartbeating every 5 s.

    python bench/controlplane.py [--agents 500] [--replicas 100] [--quick]

Simulated agents live many to a process (ZeroMQ DEALERs with CURVE keys issued
like any node's, one poller thread per process) and behave like real ones on
the wire: they register with a full description (8 GPUs, CPU, memory, disk,
engines), heartbeat every 5 s with their load, and answer start_shard by
reporting starting, then ready half a second later (no engine runs: this
measures the control plane, not engines). Measured: the controller's CPU use
with the fleet idle, the time of one reconcile pass, the time from adding a
model with 100 replicas to all of them ready, and the time until a silent
agent is marked unreachable (the promise: 15 s plus one heartbeat interval).
The controller is pinned to CPU 0, the agents to CPU 1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import zmq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.procstat import cpu_seconds  # noqa: E402
from llmgw import addresses, keyfiles, settings, store  # noqa: E402
from llmgw.apiclient import ApiClient, ApiError  # noqa: E402
from llmgw.control import curvekeys  # noqa: E402
from llmgw.node.discovery import parse_nvidia_smi  # noqa: E402
from llmgw.procs import free_port, raise_fd_limit, wait_for  # noqa: E402
from llmgw.wire import agent as protocol  # noqa: E402


def run_agents(address: str, key_files: list[str], interval: float, silent: str | None) -> None:
    """Many agents in this process: register, heartbeat, answer start_shard."""
    with open(os.path.join(ROOT, "tests", "fixtures", "nvidia-smi-8xh100.csv")) as f:
        gpus = parse_nvidia_smi(f.read())
    context = zmq.Context()
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
            if a["node"] == silent and os.path.exists(silent_flag()):
                continue
            if now >= a["next"]:
                a["seq"] += 1
                sock.send(protocol.encode("heartbeat", node_id=a["node"], seq=a["seq"],
                                          memory={"available_bytes": random.randint(400, 500) << 30},
                                          load={"load1": round(random.random() * 4, 2)}))
                a["next"] = now + interval
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


def silent_flag() -> str:
    return os.path.join(tempfile.gettempdir(), "llmgw-bench-silent")


def main() -> int:
    # Here, not at the top: the agents this file also runs need neither Flask nor the admin API.
    from llmgw.control.adminapi import ensure_token

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=500)
    parser.add_argument("--replicas", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="50 agents, 10 replicas")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "controlplane.json"))
    parser.add_argument("--run-agents", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_agents is not None:
        address, interval, silent, *files = args.run_agents
        run_agents(address, files, float(interval), silent or None)
        return 0
    raise_fd_limit()
    if args.quick:
        args.agents, args.replicas = 50, 10
    tmp = tempfile.mkdtemp(prefix="llmgw-cpbench-")
    if os.path.exists(silent_flag()):
        os.remove(silent_flag())
    ports = {k: f"127.0.0.1:{free_port()}" for k in ("agent_listen", "admin_listen", "metrics_listen",
                                                       "gateway_listen", "demand_listen", "accountant_listen")}
    values = {"store.url": f"sqlite:///{tmp}/cp.db", "controller.keys_dir": f"{tmp}/keys",
              **{f"controller.{k}": v for k, v in ports.items()}, "log.level": "warning"}
    config = os.path.join(tmp, "controller.toml")
    with open(config, "w") as f:
        f.write(settings.to_toml(values))
    engine = store.open_store(values["store.url"])
    controller_public, _ = keyfiles.controller_keypair(values["controller.keys_dir"])
    key_files = []
    for i in range(args.agents):
        node = f"node-{i:04d}"
        public, secret = curvekeys.issue_node_key(engine, node)
        path = os.path.join(tmp, f"{node}.key")
        with open(path, "w") as f:
            f.write(keyfiles.node_key_file(node, public, secret, controller_public))
        key_files.append(path)
    engine.dispose()
    procs = []
    admin = ApiClient(f"http://{ports['admin_listen']}", "the controller's admin API",
                      token=ensure_token(values["controller.keys_dir"]))

    def api(path, body=None, method="GET"):
        return admin.call(method, path, body)

    results = {"agents": args.agents, "replicas": args.replicas, "heartbeat_interval_s": 5.0,
               "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        controller = subprocess.Popen(["taskset", "-c", "0", sys.executable, os.path.join(ROOT, "controller.py"),
                                       "--config", config], stdout=open(os.path.join(tmp, "controller.log"), "wb"),
                                      stderr=subprocess.STDOUT)
        procs.append(controller)
        wait_for("the controller", 30, lambda: _ok(admin))
        silent = "node-0001"
        half = len(key_files) // 2
        for chunk in (key_files[:half], key_files[half:]):
            procs.append(subprocess.Popen(["taskset", "-c", "1", sys.executable, __file__, "--run-agents",
                                           ports["agent_listen"], "5.0", silent, *chunk]))
        started = time.monotonic()
        wait_for("every agent registered", 120, lambda: api("/api/v1/status")["nodes"]["ready"] == args.agents,
                 interval=0.5)
        results["all_registered_s"] = round(time.monotonic() - started, 2)
        time.sleep(6)  # one full heartbeat round
        before, t0 = cpu_seconds(controller.pid), time.monotonic()
        time.sleep(20)
        results["controller_cpu_percent_idle_fleet"] = round(100 * (cpu_seconds(controller.pid) - before) /
                                                             (time.monotonic() - t0), 1)
        results["reconcile_pass_s_idle"] = api("/api/v1/status")["reconcile_seconds"]
        model = {"name": "wide", "source": "/dev/null", "scaling": {"min": args.replicas, "max": args.replicas},
                 "profiles": [{"engine": "sim", "gpu_class": "h100-80g", "gpus": 1}]}
        added = time.monotonic()
        api("/api/v1/models?source_check=0", model, "POST")
        wait_for(f"{args.replicas} ready", 300,
                 lambda: api("/api/v1/status")["replicas_ready"] >= args.replicas, interval=0.1)
        results["model_added_to_all_ready_s"] = round(time.monotonic() - added, 2)
        time.sleep(6)  # past the next regular pass, which has nothing to place
        status = api("/api/v1/status")
        results["reconcile_pass_s_with_replicas"] = status["reconcile_seconds"]
        results["reconcile_pass_s_placing_all"] = status["reconcile_seconds_max"]
        before, t0 = cpu_seconds(controller.pid), time.monotonic()
        time.sleep(20)
        results["controller_cpu_percent_with_replicas"] = round(100 * (cpu_seconds(controller.pid) - before) /
                                                                (time.monotonic() - t0), 1)
        open(silent_flag(), "w").close()
        quiet = time.monotonic()

        def state():
            nodes = {n["node_id"]: n for n in api("/api/v1/nodes")["nodes"]}
            return nodes[silent]["state"]

        wait_for("the silent agent unreachable", 60, lambda: state() == "unreachable", interval=0.1)
        results["silent_to_unreachable_s"] = round(time.monotonic() - quiet, 2)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        if os.path.exists(silent_flag()):
            os.remove(silent_flag())
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))
    return 0


def _ok(admin: ApiClient) -> bool:
    try:
        admin.call("GET", "/api/v1/status", timeout=2)
        return True
    except ApiError:
        return False


if __name__ == "__main__":
    sys.exit(main())
