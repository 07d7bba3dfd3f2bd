"""What the agent tells the controller about its node: the register message's facts, and heartbeats.

A heartbeat carries only what changed since the last one sent, so a quiet node
sends little; a registration (to another controller, or the same one again)
forgets what was sent, so the next heartbeat is whole. Fabric ports are read
again for every heartbeat (a cable pulled after registration must take the node
off its fabric); when the usable fabrics change, the heartbeat says so once
(`fabrics_changed`). A GPU's multi-node NVLink domain and IMEX are asked once a
minute (a fabric manager's restart drops every card from its domain).
"""

from __future__ import annotations

import socket
import threading
import time

from llmgw import __version__, engines, settings
from llmgw.node import discovery, doctor, fabrics, gputopology
from llmgw.node.installer import Installer
from llmgw.node.supervisor import Supervisor

# The requests this agent answers beyond the basics: the controller refuses at once what a node's agent
# cannot do, rather than waiting for a reply that never comes.
FEATURES = ("fabric-test", "fabric-scan", "install-engine")
ANSWERS_WHEN_EMPTY = ("installs", "fabrics", "fabric_problems", "ib_ports")
GPU_FABRIC_EVERY = 60.0  # seconds between asking nvidia-smi -q and IMEX (a MAD-free but slow query)


class Reporter:
    """Makes the register and heartbeat messages' fields; a heartbeat carries only what changed."""

    def __init__(self, node_id: str, cfg: settings.Config, supervisor: Supervisor, address: str | None,
                 installer: Installer | None = None):
        """ADDRESS: where this machine reaches its first controller from (None: not known). INSTALLER: the
        engines this node installs from its catalogue."""
        self.node_id = node_id
        self.installer = installer
        self.address = address
        self.cfg = cfg
        self.supervisor = supervisor
        self.cpu = discovery.CpuSampler()
        self.cpu.percent()
        self.sent: dict = {}
        self.has_gpus = False
        self.named: dict = {}
        self.probed: dict = {}  # what `register` found, besides the catalogue's installs
        self.fabrics = fabrics.Finder(cfg.fabrics, cfg["agent.infiniband_dir"])
        self.gpu_fabric: dict = {}  # nvidia-smi -q's fabric section of each card, by PCI bus
        self.gpu_fabric_at: float | None = None
        self.imex: dict | None = None

    def register(self) -> dict:
        facts = dict(node_id=self.node_id, agent_version=__version__, hostname=socket.gethostname(),
                     address=self.address, labels=self.cfg["agent.labels"],
                     cpu=discovery.cpu_facts(), memory=discovery.memory_facts(),
                     disk=discovery.disk_facts(self.cfg["agent.weights_dir"]))
        facts.update(discovery.gpu_facts(self.cfg["agent.nvidia_smi"]))
        if facts.get("gpus"):
            self.gpu_fabric_at = time.monotonic()
            self.gpu_fabric = gputopology.read_gpu_fabric(self.cfg["agent.nvidia_smi"])
            gputopology.apply(facts["gpus"], gputopology.read_topo(self.cfg["agent.nvidia_smi"]), self.gpu_fabric)
            facts["imex"] = self.imex = gputopology.imex()
        fabric_facts = self.fabrics.read()
        facts.update(fabric_facts)
        self.named = engines.named(self.cfg)
        self.probed = engines.installed(self.named)
        facts.update(engines=self.engines(), engines_probed=True, shards=self.supervisor.describe())
        if self.installer is not None:
            facts.update(installable=self.installer.installable(), installs=self.installer.report())
        facts["doctor"] = self.checkup(facts)
        facts["weights"] = self.weights_use()
        facts["features"] = list(FEATURES)
        self.has_gpus = bool(facts.get("gpus"))
        self.sent = dict(fabric_facts)  # said in the registration: a heartbeat repeats them only once changed
        return facts

    def engines(self) -> dict[str, str]:
        return engines_here(self.probed, self.named, self.installer)

    def checkup(self, facts: dict) -> dict:
        """The doctor's warnings and failures, from what was just found (the connection to the controller
        is what is being made, so it is not checked here)."""
        gpu = {k: facts[k] for k in ("gpus", "gpus_probed", "gpu_probe_error") if k in facts}
        found = doctor.collect(weights_dir=self.cfg["agent.weights_dir"], declared=self.cfg.fabrics, known={
            "cpu": facts["cpu"], "memory": facts["memory"], "disk": facts["disk"], "gpu": gpu,
            "engines": facts["engines"], "installable": facts.get("installable", {})})
        findings = [f for f in doctor.evaluate(found) if f.area != "agent"]
        return doctor.summary(findings)

    def heartbeat(self) -> dict:
        current = {"memory": discovery.memory_facts(), "disk": discovery.disk_facts(self.cfg["agent.weights_dir"]),
                   "load": {**discovery.load_facts(), **_present(cpu_percent=self.cpu.percent()),
                            "shards": self.supervisor.loads()}, "weights": self.weights_use()}
        if self.installer is not None:
            current.update(installs=self.installer.report(), engines=self.engines())
        current.update(self.fabrics.read())
        if self.has_gpus:
            current.update(self._gpus())
        # An empty `installs` is an answer (a failed install forgotten, so placement may ask again), not unknown;
        # so is an empty list of fabrics (the last one withdrawn), of their problems (all mended) or of ports
        # (the adapters' driver unloaded).
        changed: dict = {k: v for k, v in current.items()
                         if (v or k in ANSWERS_WHEN_EMPTY) and self.sent.get(k) != v}
        self.sent.update(changed)
        if "engines" in changed:
            changed["engines_changed"] = True
        if "fabrics" in changed:
            changed["fabrics_changed"] = True
        return changed

    def _gpus(self) -> dict:
        """The heartbeat's `gpus` (and `imex`, once a minute): what changes on a card."""
        out: dict = {}
        # GPU memory in use catches a process outside llmgw taking a card.
        keep = ("index", "memory_used_bytes", "utilization_percent", "health", "nvlink_domain")
        gpus = discovery.gpu_facts(self.cfg["agent.nvidia_smi"]).get("gpus")
        if self.gpu_fabric_at is None or time.monotonic() - self.gpu_fabric_at >= GPU_FABRIC_EVERY:
            # `nvidia-smi -q` may take its 20 s on a sick driver: asked in a thread, its answer used from
            # the next heartbeat on, so heartbeats never wait for it.
            self.gpu_fabric_at = time.monotonic()
            threading.Thread(target=self._read_gpu_fabric, name="gpu-fabric", daemon=True).start()
        if self.imex is not None:
            out["imex"] = self.imex
        if gpus is not None:
            gputopology.apply(gpus, {}, self.gpu_fabric)
            out["gpus"] = [{k: g[k] for k in keep if k in g} for g in gpus]
        return out

    def _read_gpu_fabric(self) -> None:
        self.gpu_fabric = gputopology.read_gpu_fabric(self.cfg["agent.nvidia_smi"])
        self.imex = gputopology.imex()

    def weights_use(self) -> dict:
        """How much the weights directory holds, and how much of it llmgw fetched: the cluster page's figure.
        The listing itself is asked for (`weights_request`): it can be long, and is rarely wanted."""
        listing = self.supervisor.weights(most=0)
        return {k: listing[k] for k in ("bytes", "entries", "fetched_bytes")}


def engines_here(probed: dict[str, str], named: dict, installer: Installer | None) -> dict[str, str]:
    """Engine -> version of what runs here, as the supervisor chooses it: a binary the configuration NAMED,
    else what the catalogue installed (an engine the catalogue lists counts only once installed from it),
    else llmgw's own environment. PROBED: `engines.installed(NAMED)`, the only call that runs anything."""
    found = dict(probed)
    if installer is not None:
        installed = installer.installed()
        for name in installer.entries:
            if name not in named:
                found.pop(name, None)
                if name in installed:
                    found[name] = installed[name]
    return found


def _present(**fields) -> dict:
    return {k: v for k, v in fields.items() if v is not None}
