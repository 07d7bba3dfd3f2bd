"""The node agent: finds out what this machine has and keeps the controller told.

    python agent.py [--config FILE] [--controller HOST:PORT]... [--node-id NAME]

It dials out to the controller (a node needs no inbound port), registers with
what it found (CPU and vector extensions, memory, the disk holding its
weights, GPUs), and heartbeats every `agent.heartbeat_interval` with what
changed. Wiring only: discovery is llmgw/discovery.py, the connection
llmgw/controllerlink.py.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import sys
import threading

import click
import zmq

from llmgw import __version__, engines, settings
from llmgw.control import curvekeys
from llmgw.node import discovery, doctor
from llmgw.node.controllerlink import ControllerLink
from llmgw.node.supervisor import Supervisor

log = logging.getLogger("llmgw.agent")

DRAIN_TIMEOUT = 60.0  # seconds a draining engine may take to finish what it is answering


class Reporter:
    """Makes the register and heartbeat messages' fields; a heartbeat carries only what changed."""

    def __init__(self, node_id: str, cfg: settings.Config, supervisor: Supervisor):
        self.node_id = node_id
        self.cfg = cfg
        self.supervisor = supervisor
        self.cpu = discovery.CpuSampler()
        self.cpu.percent()
        self.sent: dict = {}
        self.has_gpus = False

    def register(self) -> dict:
        host, _, port = self.cfg["agent.controllers"][0].rpartition(":")
        facts = dict(node_id=self.node_id, agent_version=__version__, hostname=socket.gethostname(),
                     address=discovery.route_address(host, int(port)), labels=self.cfg["agent.labels"],
                     cpu=discovery.cpu_facts(), memory=discovery.memory_facts(),
                     disk=discovery.disk_facts(self.cfg["agent.weights_dir"]))
        facts.update(discovery.gpu_facts(self.cfg["agent.nvidia_smi"]))
        facts.update(engines=engines.installed(), engines_probed=True, shards=self.supervisor.describe())
        facts["doctor"] = self.checkup(facts)
        self.has_gpus = bool(facts.get("gpus"))
        self.sent = {}
        return facts

    def checkup(self, facts: dict) -> dict:
        """The doctor's warnings and failures, from what was just found (the connection to the controller
        is what is being made, so it is not checked here)."""
        gpu = {k: facts[k] for k in ("gpus", "gpus_probed", "gpu_probe_error") if k in facts}
        found = doctor.collect(weights_dir=self.cfg["agent.weights_dir"], known={
            "cpu": facts["cpu"], "memory": facts["memory"], "disk": facts["disk"], "gpu": gpu,
            "engines": facts["engines"]})
        findings = [f for f in doctor.evaluate(found) if f.area != "agent"]
        return doctor.summary(findings)

    def heartbeat(self) -> dict:
        current = {"memory": discovery.memory_facts(), "disk": discovery.disk_facts(self.cfg["agent.weights_dir"]),
                   "load": {**discovery.load_facts(), **_present(cpu_percent=self.cpu.percent()),
                            "shards": self.supervisor.loads()}}
        if self.has_gpus:
            # GPU memory in use catches a process outside llmgw taking a card.
            keep = ("index", "memory_used_bytes", "utilization_percent", "health")
            gpus = discovery.gpu_facts(self.cfg["agent.nvidia_smi"]).get("gpus")
            if gpus is not None:
                current["gpus"] = [{k: g[k] for k in keep if k in g} for g in gpus]
        changed = {k: v for k, v in current.items() if v and self.sent.get(k) != v}
        self.sent.update(changed)
        return changed


def commands(node_id: str, supervisor: Supervisor):
    """What the agent does with each command from the controller; returns the replies to send."""

    def handle(message: dict) -> list[tuple[str, dict]]:
        kind, request_id = message["type"], message["request_id"]
        if kind == "start_shard":
            supervisor.start({k: v for k, v in message.items() if k not in ("v", "type", "request_id")})
            return [("ack", {"node_id": node_id, "request_id": request_id, "ok": True})]
        if kind in ("stop_shard", "drain_shard"):
            # Stopping what is not running is done already: commands are idempotent.
            drain = message.get("timeout", DRAIN_TIMEOUT) if kind == "drain_shard" else None
            supervisor.stop(message["shard_id"], drain=drain)
            return [("ack", {"node_id": node_id, "request_id": request_id, "ok": True})]
        if kind == "remove_weights":
            refusal = supervisor.remove_weights(message["source"])
            return [("ack", {"node_id": node_id, "request_id": request_id, "ok": refusal is None,
                             **({"error": refusal} if refusal else {})})]
        lines, sources = supervisor.logs(message.get("source"), message.get("lines", 200))
        if message.get("source") and not lines and message["source"] not in sources:
            return [("logs_reply", {"node_id": node_id, "request_id": request_id, "sources": sources,
                                    "error": f"no shard {message['source']!r} on {node_id}; sources: "
                                             f"{', '.join(sources) or 'none'}"})]
        return [("logs_reply", {"node_id": node_id, "request_id": request_id, "lines": lines,
                                "sources": sources})]

    return handle


def _present(**fields) -> dict:
    return {k: v for k, v in fields.items() if v is not None}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", envvar="LLMGW_CONFIG", type=click.Path(dir_okay=False),
              help="TOML configuration file (also $LLMGW_CONFIG).")
@click.option("--controller", "controllers", multiple=True, metavar="HOST:PORT",
              help="A controller address (repeatable, tried in turn) [agent.controllers].")
@click.option("--node-id", help="This node's name [agent.node_id; else the key file's, else the host name].")
@click.option("--key-file", help="The node's CURVE key file [agent.key_file].")
def main(config_path, controllers, node_id, key_file):
    """Run the llmgw node agent."""
    try:
        cfg = settings.load(config_path, {"agent.controllers": list(controllers) or None,
                                          "agent.node_id": node_id, "agent.key_file": key_file})
    except settings.ConfigError as e:
        raise click.ClickException(str(e)) from None
    logging.basicConfig(level=cfg["log.level"].upper(),
                        format="%(asctime)s [%(process)d] %(levelname)s %(name)s: %(message)s")
    if not cfg["agent.controllers"]:
        raise click.ClickException("no controller to connect to: give --controller HOST:PORT or set "
                                   "agent.controllers in the configuration")
    keys = None
    if cfg["agent.plaintext"]:
        log.warning("agent.plaintext is set: this node connects without encryption or a key")
    else:
        try:
            keys = curvekeys.read_node_key_file(cfg["agent.key_file"])
        except curvekeys.KeyFileError as e:
            raise click.ClickException(str(e)) from None
    node = cfg["agent.node_id"] or (keys or {}).get("node_id") or socket.gethostname()
    # Created at start, so the disk that will hold weights is reported before the first download.
    os.makedirs(cfg["agent.weights_dir"], exist_ok=True)
    os.makedirs(cfg["agent.work_dir"], exist_ok=True)

    host, _, port = cfg["agent.controllers"][0].rpartition(":")
    address = discovery.route_address(host, int(port)) or "127.0.0.1"
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    supervisor = Supervisor(node, cfg["agent.work_dir"], cfg["agent.weights_dir"], cfg["agent.engine_host"],
                            address, report=lambda fields: outbox.put(("shard_status", fields)))
    adopted = supervisor.adopt()
    if adopted:
        log.info("adopted %d engines left running: %s", len(adopted), ", ".join(adopted))
    reporter = Reporter(node, cfg, supervisor)
    context = zmq.Context()
    link = ControllerLink(context, cfg["agent.controllers"], node, keys, cfg["agent.heartbeat_interval"],
                          cfg["agent.reconnect_max"], reporter.register, reporter.heartbeat,
                          on_command=commands(node, supervisor), outbox=outbox)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    log.info("node %s: connecting to %s", node, ", ".join(cfg["agent.controllers"]))

    def watch_engines():
        while not stopping.wait(1.0):
            supervisor.check()

    threading.Thread(target=watch_engines, name="watch-engines", daemon=True).start()
    try:
        link.run(stopping.is_set)
    finally:
        context.term()
        log.info("agent stopped")


if __name__ == "__main__":
    sys.exit(main())
