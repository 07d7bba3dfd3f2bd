"""The doctor's fabric checks: what a node needs before a multi-node replica's collectives can run on it.

Each is a way such a replica has failed: NVSwitch cards with no fabric manager (CUDA does not start),
cards that have not joined their NVLink domain or no IMEX, GPUDirect RDMA or the verbs module missing,
ports down or counting errors, a fabric with no standby subnet manager, RoCE without a routable v2 GID,
declared fabrics that do not match the adapters, and the memlock limit RDMA needs. Each usable fabric
ends with the NCCL environment a shard there would get (llmgw/engines/nccl.py), on the interface NCCL
will bootstrap over, so an operator can compare it with what a job of their own uses.

Facts are read under ROOT (for fixture trees) by `collect`, and judged by `evaluate`.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

from llmgw.engines import nccl
from llmgw.node import fabrics, gputopology, ibports, subnetmanagers
from llmgw.node.findings import FAIL, OK, WARN, Finding

GIB = 1 << 30
NVIDIA_VENDOR = "0x10de"  # the PCI vendor id the doctor looks for cards and switches by
NVSWITCH_CLASS = "0x0680"  # PCI "bridge, other": how an NVSwitch shows on the bus



def collect(facts: dict, root: str, nvidia_smi: str, declared: list[dict], watch=None) -> None:
    """Add to FACTS what the fabric checks read under ROOT: ports (with their subnet managers, asked through
    WATCH), the DECLARED fabrics checked against them, kernel modules, NVSwitches and their fabric manager,
    each GPU's NVLink domain, IMEX."""
    ports = ibports.read_ports(os.path.join(root, "sys/class/infiniband"))
    (watch or subnetmanagers.Watch()).look(ports)
    facts["infiniband"] = ports
    if declared:
        usable, problems = fabrics.check(declared, ports)
        facts["fabrics"] = usable
        facts["fabric_problems"] = [{"message": m, "refused": refused} for m, refused in problems]
    modules = ibports.read_value(os.path.join(root, "proc/modules"))
    if modules is not None:
        facts["modules"] = sorted(line.split()[0] for line in modules.splitlines() if line.strip())
    facts["nvswitches"] = sum(1 for device in glob.glob(os.path.join(root, "sys/bus/pci/devices/*"))
                              if ibports.read_value(os.path.join(device, "vendor")) == NVIDIA_VENDOR
                              and (ibports.read_value(os.path.join(device, "class")) or "").startswith(NVSWITCH_CLASS))
    if facts["nvswitches"]:
        facts["fabricmanager"] = _unit_state("nvidia-fabricmanager")
    if facts.get("gpu", {}).get("gpus"):
        facts["gpu_fabric"] = gputopology.read_gpu_fabric(nvidia_smi)
        facts["imex"] = gputopology.imex(os.path.join(root, "dev/nvidia-caps-imex-channels"))


def _unit_state(unit: str) -> str:
    if shutil.which("systemctl") is None:
        return "unknown"
    try:
        run = subprocess.run(["systemctl", "is-active", unit], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return run.stdout.strip() or "unknown"


def evaluate(facts: dict) -> list[Finding]:
    out = _nvswitch(facts) + _nvlink_domain(facts)
    ports = facts.get("infiniband") or []
    if not ports:
        return out
    out += _modules(facts, ports)
    for port in ports:
        out += _port(port)
    out += _declared(facts, ports)
    memlock = facts.get("memlock", {})
    if memlock.get("soft") is not None and memlock["soft"] < 64 * GIB:
        out.append(Finding(WARN, "fabric", f"the memlock limit is {memlock['soft'] // 1024} KiB: RDMA needs it "
                                           "unlimited", "LimitMEMLOCK=infinity in the agent's systemd unit "
                                                        "(deploy/systemd/llmgw-agent.service has it)"))
    return out


def _nvswitch(facts: dict) -> list[Finding]:
    switches, state = facts.get("nvswitches", 0), facts.get("fabricmanager")
    if not switches:
        return []
    if state != "active":
        return [Finding(FAIL, "nvlink", f"{switches} NVSwitch(es) on the PCI bus and nvidia-fabricmanager is "
                                        f"{state}: CUDA will not start on these GPUs",
                        "sudo apt-get install nvidia-fabricmanager-<driver major> (the driver's own version), then "
                        "sudo systemctl enable --now nvidia-fabricmanager")]
    return [Finding(OK, "nvlink", f"{switches} NVSwitch(es), nvidia-fabricmanager active")]


def _nvlink_domain(facts: dict) -> list[Finding]:
    cards = facts.get("gpu_fabric") or {}
    joined = {gputopology.domain(card) for card in cards.values()} - {""}
    waiting = [bus for bus, card in cards.items() if not gputopology.domain(card)
               and card.get("cluster_uuid") and card.get("state", "").lower() != "completed"]
    out = []
    if waiting:
        out.append(Finding(WARN, "nvlink", f"{len(waiting)} GPU(s) have not joined their NVLink domain ("
                                           + ", ".join(f"{bus}: {cards[bus].get('state')}" for bus in sorted(waiting))
                                           + ")", "nvidia-smi -q shows each card's Fabric section; restart "
                                                  "nvidia-fabricmanager if it stays so"))
    if joined:
        imex = facts.get("imex") or {}
        if imex.get("state") != "active":
            out.append(Finding(WARN, "nvlink", f"the GPUs are in NVLink domain {', '.join(sorted(joined))} but IMEX "
                                               f"is {imex.get('state', 'not installed')}: a replica over several "
                                               "nodes cannot share memory across them, so it is placed over the "
                                               "network instead", "sudo systemctl enable --now nvidia-imex"))
        else:
            env = nccl.environment(2, [], None, facts.get("interface"), island=f"nvl:{min(joined)}")
            out.append(Finding(OK, "nvlink", f"NVLink domain {', '.join(sorted(joined))}, IMEX active with "
                                             f"{imex.get('channels', 0)} channel(s); a shard there gets "
                                             + " ".join(f"{k}={v}" for k, v in env.items())))
    return out


def _modules(facts: dict, ports: list[dict]) -> list[Finding]:
    modules = facts.get("modules")
    if modules is None:
        return []
    out = []
    if "ib_uverbs" not in modules:
        out.append(Finding(WARN, "fabric", "the ib_uverbs module is not loaded: NCCL cannot open the adapters",
                           "sudo modprobe ib_uverbs (and add it to /etc/modules-load.d/)"))
    if facts.get("gpu", {}).get("gpus") and "nvidia_peermem" not in modules:
        out.append(Finding(WARN, "fabric", "nvidia_peermem is not loaded: GPUDirect RDMA is off, and every transfer "
                                           "between nodes goes through host memory",
                           "sudo modprobe nvidia_peermem (and add it to /etc/modules-load.d/)"))
    return out


def _port(p: dict) -> list[Finding]:
    name = f"{p['hca']}/{p['port']}"
    if not ibports.active(p):
        return [Finding(WARN, "fabric", f"{name} ({p.get('link_layer')}) is {p.get('state') or 'in no state'} "
                                        f"({p.get('phys_state')})", "check the cable and the switch port; an "
                                        "InfiniBand port also needs a subnet manager (opensm) on the fabric")]
    out = []
    errors = {k: v for k, v in p.get("counters", {}).items() if k in ibports.ERROR_COUNTERS and v}
    if errors:
        out.append(Finding(WARN, "fabric", f"{name} counts errors: " + ", ".join(f"{k}={v}" for k, v in
                                                                                   sorted(errors.items())),
                           "a cable or transceiver going bad; reseat or replace it, then clear the counters"))
    if p.get("link_layer", "").lower() == "ethernet" and "roce_gid_index" not in p:
        out.append(Finding(WARN, "fabric", f"{name} (RoCE) has no RoCE v2 GID: NCCL would use a v1 link-local "
                                           "entry, which does not route, and hang",
                           "give the port's network interface an IPv4 address (a RoCE v2 GID follows it)"))
    if p.get("sm_error"):
        out.append(Finding(WARN, "fabric", f"{name}: its subnet managers could not be asked ({p['sm_error']}), so "
                                           "its fabric cannot be told from another", "install infiniband-diags "
                                           "(sminfo, saquery) and check that opensm runs on the fabric"))
    managers = p.get("subnet_managers")
    if managers is not None:
        standby = [m for m in managers if m.get("state") == "standby"]
        if not standby:
            out.append(Finding(WARN, "fabric", f"{p.get('fabric_id')} has one subnet manager and no standby: if it "
                                               "fails, the fabric stops taking new connections",
                               "run a second opensm, with a lower priority, on another host of the fabric"))
    if not errors:
        out.append(Finding(OK, "fabric", f"{name} active at {p['rate_gbps']:g} Gb/s ({p.get('link_layer')})"
                           if p.get("rate_gbps") else f"{name} active"))
    return out


def _declared(facts: dict, ports: list[dict]) -> list[Finding]:
    out = [Finding(FAIL if problem["refused"] else WARN, "fabric", problem["message"],
                   "correct [[fabrics]] in the agent's configuration" if problem["refused"] else
                   "check the cables and switch ports of its adapters")
           for problem in facts.get("fabric_problems", [])]
    interface = facts.get("interface")
    for fabric in facts.get("fabrics", []):
        adapters = fabric["adapters"]
        indexes = {p.get("roce_gid_index") for p in ports if p["hca"] in adapters and ibports.active(p)}
        if len(indexes - {None}) > 1:
            out.append(Finding(WARN, "fabric", f"fabric {fabric['name']}'s adapters have their RoCE v2 GID at "
                                               f"different indexes ({', '.join(map(str, sorted(indexes - {None})))}); "
                                               "NCCL takes one for all", "give every adapter's interface its IPv4 "
                                                                         "address in the same order"))
        env = nccl.environment(2, nccl.rails(ports, adapters), nccl.gid_index(ports, adapters), interface)
        said = " ".join(f"{k}={v}" for k, v in env.items())
        where = fabric["physical"] or "not verified yet"
        text = (f"fabric {fabric['name']}: {', '.join(adapters)} at {fabric['rate_gbps']:g} Gb/s on {where}; a shard "
                f"there gets {said}")
        if fabric.get("degraded"):
            out.append(Finding(WARN, "fabric", f"{text}; degraded: {fabric['degraded']}",
                               "reseat or replace the cable or transceiver; the node is placed last meanwhile"))
        else:
            out.append(Finding(OK, "fabric", text))
    if facts.get("fabrics") is not None and not interface:
        out.append(Finding(WARN, "fabric", "the interface NCCL will bootstrap over is not known (no route to the "
                                           "controller was found)", "set agent.controllers, then run the doctor "
                                                                    "again"))
    return out
