"""The node agent: finds out what this machine has and keeps the controller told.

    python agent.py [--config FILE] [--controller HOST:PORT]... [--node-id NAME]

It dials out to the controller (a node needs no inbound port), registers with
what it found (CPU and vector extensions, memory, the disk holding its
weights, GPUs), and heartbeats every `agent.heartbeat_interval` with what
changed. Wiring only: what it reports is llmgw/node/reporter.py, what it does
on a command llmgw/node/commands.py, the engines llmgw/node/supervisor.py and
the connection llmgw/node/controllerlink.py.
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

from llmgw import addresses, engines, filemodes, keyfiles, settings
from llmgw.node import discovery
from llmgw.node.commands import commands
from llmgw.node.controllerlink import ControllerLink
from llmgw.node.installer import Installer, host_facts
from llmgw.node.logsources import LogRing, LogSources
from llmgw.node.reporter import Reporter
from llmgw.node.supervisor import Health, Supervisor

log = logging.getLogger("llmgw.agent")
LOG_FORMAT = "%(asctime)s [%(process)d] %(levelname)s %(name)s: %(message)s"

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
        filemodes.check_roles(cfg, "agent")
    except settings.ConfigError as e:
        raise click.ClickException(str(e)) from None
    logging.basicConfig(level=cfg["log.level"].upper(), format=LOG_FORMAT)
    # Its last lines also kept in memory, for `llmgw ctl logs NODE` and the node's logs page.
    ring = LogRing()
    ring.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger().addHandler(ring)
    if not cfg["agent.controllers"]:
        raise click.ClickException("no controller to connect to: give --controller HOST:PORT or set "
                                   "agent.controllers in the configuration")
    keys = None
    if cfg["agent.plaintext"]:
        log.warning("agent.plaintext is set: this node connects without encryption or a key")
    else:
        try:
            keys = keyfiles.read_node_key_file(cfg["agent.key_file"])
        except keyfiles.KeyFileError as e:
            raise click.ClickException(str(e)) from None
    node = cfg["agent.node_id"] or (keys or {}).get("node_id") or socket.gethostname()
    # Created at start, so the disk that will hold weights is reported before the first download.
    os.makedirs(cfg["agent.weights_dir"], exist_ok=True)
    os.makedirs(cfg["agent.work_dir"], exist_ok=True)

    # The address this machine reaches its first controller from: where its engines are reached too.
    host, port = addresses.parse(cfg["agent.controllers"][0], "agent.controllers")
    route = discovery.route_address(addresses.dial_host(host), port)
    address = route or "127.0.0.1"
    engine_host = cfg["agent.engine_host"]
    if route and engine_host not in addresses.WILDCARDS and not addresses.same_machine(engine_host, route):
        # The controller takes an engine only on the address the node connects from (llmgw/control/claims.py).
        raise click.ClickException(f"agent.engine_host is {engine_host}, but this node reaches the controller from "
                                   f"{route}, and the controller accepts engines only on that address: leave "
                                   "agent.engine_host empty, or set it to that address")
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    installer = Installer(cfg["agent.engines_dir"], cfg.engines, cfg["agent.mirror_url"],
                          host=lambda: host_facts(cfg["agent.engines_dir"], cfg["agent.nvidia_smi"]))
    def ports():  # read afresh: a port that went down since the last heartbeat is not given to NCCL
        return reporter.fabrics.read()["ib_ports"]

    supervisor = Supervisor(node, cfg["agent.work_dir"], cfg["agent.weights_dir"], cfg["agent.engine_host"],
                            address, report=lambda fields: outbox.put(("shard_status", fields)),
                            local_sources=cfg["agent.local_sources"], named=engines.named(cfg),
                            installer=installer, health=Health.from_settings(cfg), ports=ports)
    adopted = supervisor.adopt()
    if adopted:
        log.info("adopted %d engines left running: %s", len(adopted), ", ".join(adopted))
    reporter = Reporter(node, cfg, supervisor, route, installer)
    context = zmq.Context()
    link = ControllerLink(context, cfg["agent.controllers"], node, keys, cfg["agent.heartbeat_interval"],
                          cfg["agent.reconnect_max"], reporter.register, reporter.heartbeat,
                          on_command=commands(node, supervisor, LogSources(ring, supervisor.engine_logs),
                                              ports=ports, send=outbox.put),
                          outbox=outbox)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    log.info("node %s: connecting to %s", node, ", ".join(cfg["agent.controllers"]))

    def watch_engines():
        while not stopping.wait(1.0):
            supervisor.check()

    def recheck_installs():
        # At start too: a library may have gone while the agent was down.
        while True:
            installer.recheck()
            if stopping.wait(cfg["agent.engine_recheck_interval"]):
                return

    threading.Thread(target=watch_engines, name="watch-engines", daemon=True).start()
    # Its own thread: a version check may take a minute (vLLM imports torch), and engines are watched each second.
    threading.Thread(target=recheck_installs, name="recheck-installs", daemon=True).start()
    try:
        link.run(stopping.is_set)
    finally:
        context.term()
        log.info("agent stopped")


if __name__ == "__main__":
    sys.exit(main())
