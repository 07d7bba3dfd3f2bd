"""How a node's GPUs are joined: NVLink pairs, each card's distance to each fabric adapter, its NUMA
node (`nvidia-smi topo -m`), and multi-node NVLink domains (`nvidia-smi -q`, `nvidia-imex`).

Placement picks the set of cards a replica gets from these: cards joined by
NVLink to each other, near the adapter their share of a multi-node job goes out on, on few NUMA nodes.
Without them it can only pick by index, which on a machine with NVLink pairs (two cards bridged, not
all eight switched) gives a tensor-parallel group that talks over PCIe.

`topo -m` has two layouts: drivers since about 520 name adapters `NIC0`, `NIC1` in the matrix and map
them to devices in a "NIC Legend" below it; older ones put the device names (`mlx5_0`) in the header.
Both are read by column heading, never by position. What cannot be read is left out: a matrix that is
not there is an empty topology, so the GPUs are still reported and placement falls back to indices.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

# What a GPU's traffic to an adapter crosses, nearest first: one PCIe bridge, several, the host bridge,
# host bridges within a NUMA node, NUMA nodes (placement ranks them: llmgw/control/gpusets.py).
PATHS = ("PIX", "PXB", "PHB", "NODE", "SYS")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NVLINK = re.compile(r"NV(\d+)$")
_LEGEND = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")
# A single machine's NVSwitch reports a cluster UUID of zeros (or dashes): it is no multi-node domain.
_NO_UUID = re.compile(r"^[0\-]*$")


def parse_topo(text: str) -> dict:
    """`nvidia-smi topo -m` as {gpu index: {"nvlink": {peer: links}, "nics": {adapter: PIX..SYS}, "numa": n}}.

    Raises ValueError where TEXT holds no matrix (nvidia-smi printed an error instead)."""
    lines = [_ANSI.sub("", line.rstrip("\n")) for line in text.splitlines()]
    legend = {m.group(1): m.group(2) for m in map(_LEGEND.match, lines) if m}
    header = None
    rows: dict[int, dict] = {}
    for line in lines:
        cells = [c.strip() for c in line.split("\t")]
        if header is None:
            if len(cells) > 1 and cells[0] == "" and re.fullmatch(r"GPU\d+", cells[1]):
                header = cells
            continue
        if not line.strip():
            break  # the matrix ends at its first blank line; the legend follows
        if not re.fullmatch(r"GPU\d+", cells[0]):
            continue  # an adapter's own row
        rows[int(cells[0][3:])] = _row(header, cells, legend)
    if header is None or not rows:
        raise ValueError("nvidia-smi topo -m printed no GPU matrix: "
                         + (next((line for line in lines if line.strip()), "nothing")[:200]))
    return rows


def _row(header: list[str], cells: list[str], legend: dict[str, str]) -> dict:
    gpu = int(cells[0][3:])
    row: dict = {"nvlink": {}, "nics": {}}
    for name, value in zip(header[1:], cells[1:]):
        if not name or not value:
            continue
        if re.fullmatch(r"GPU\d+", name):
            link = _NVLINK.match(value)
            if link and int(name[3:]) != gpu:
                row["nvlink"][int(name[3:])] = int(link.group(1))
        elif name == "NUMA Affinity":
            if value.isdigit():
                row["numa"] = int(value)
        elif name in ("CPU Affinity", "GPU NUMA ID"):
            continue
        elif value.upper() in PATHS:
            row["nics"][legend.get(name, name)] = value.upper()
    return row


def read_topo(nvidia_smi: str = "") -> dict:
    """This node's topology (parse_topo's shape); {} without nvidia-smi or where it cannot be read."""
    binary = nvidia_smi or shutil.which("nvidia-smi")
    if not binary:
        return {}
    try:
        run = subprocess.run([binary, "topo", "-m"], capture_output=True, text=True, timeout=20)
        return parse_topo(run.stdout) if run.returncode == 0 else {}
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return {}


def parse_gpu_fabric(text: str) -> dict[str, dict]:
    """The `Fabric` section of each GPU in `nvidia-smi -q`, by PCI bus id (lower case): {"state", "status",
    "cluster_uuid", "clique_id", "bandwidth"}, "N/A" left out. A GPU whose section has no state has none."""
    found: dict[str, dict] = {}
    bus = None
    fabric_indent = None
    section: dict = {}
    for raw in text.splitlines():
        if not raw.strip():
            continue
        indent = len(raw) - len(raw.lstrip())
        line = raw.strip()
        if indent == 0:
            _keep(found, bus, section)
            match = re.match(r"GPU\s+(\S+)$", line)
            bus, fabric_indent, section = (match.group(1).lower() if match else None), None, {}
            continue
        if fabric_indent is not None and indent <= fabric_indent:
            fabric_indent = None  # the section ended
        if line == "Fabric" and bus is not None:
            fabric_indent = indent
            continue
        if fabric_indent is None or ":" not in line:
            continue
        key, value = (part.strip() for part in line.split(":", 1))
        field = {"State": "state", "Status": "status", "ClusterUUID": "cluster_uuid", "Cluster UUID": "cluster_uuid",
                 "CliqueId": "clique_id", "Clique ID": "clique_id", "Bandwidth": "bandwidth"}.get(key)
        if field and value and value != "N/A":
            section[field] = value
    _keep(found, bus, section)
    return found


def _keep(found: dict, bus: str | None, section: dict) -> None:
    if bus is not None and section.get("state"):
        found[bus] = section


def domain(fabric: dict) -> str:
    """The multi-node NVLink domain a GPU has joined ("<cluster uuid>/<clique>"), or "" for none: a card the
    fabric manager has not finished with, or a single machine's NVSwitch (all-zero cluster)."""
    uuid = fabric.get("cluster_uuid", "")
    if fabric.get("state", "").lower() != "completed" or _NO_UUID.match(uuid):
        return ""
    return f"{uuid.lower()}/{fabric.get('clique_id', '')}"


def read_gpu_fabric(nvidia_smi: str = "") -> dict[str, dict]:
    binary = nvidia_smi or shutil.which("nvidia-smi")
    if not binary:
        return {}
    try:
        run = subprocess.run([binary, "-q"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_gpu_fabric(run.stdout) if run.returncode == 0 else {}


def imex(channels_dir: str = "/dev/nvidia-caps-imex-channels", systemctl: str = "systemctl") -> dict:
    """`nvidia-imex`'s state as systemd says it ("active", "failed", ...; left out where it is not installed)
    and how many IMEX channels exist: what a GPU needs to share memory across nodes of its domain."""
    out: dict = {}
    channels = glob.glob(os.path.join(channels_dir, "*"))
    if channels:
        out["channels"] = len(channels)
    if shutil.which(systemctl) is None:
        return out
    try:
        run = subprocess.run([systemctl, "is-active", "nvidia-imex"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return out
    state = run.stdout.strip()
    # systemd calls a unit that does not exist "inactive": without the daemon, IMEX is not there at all.
    if state and (state != "inactive" or shutil.which("nvidia-imex") or os.path.exists("/usr/bin/nvidia-imex")):
        out["state"] = state
    return out


def apply(gpus: list[dict], topo: dict, fabric: dict[str, dict]) -> None:
    """Put TOPO (by index) and FABRIC (by PCI bus id) on each GPU of GPUS: `nvlink` {peer: links},
    `nic_paths` {adapter: PIX..SYS}, `numa_node`, and `nvlink_domain` / `nvlink_fabric` for a card in a
    multi-node NVLink domain."""
    for gpu in gpus:
        row = topo.get(gpu.get("index"))
        if row:
            if row["nvlink"]:
                gpu["nvlink"] = {str(peer): links for peer, links in sorted(row["nvlink"].items())}
            if row["nics"]:
                gpu["nic_paths"] = dict(sorted(row["nics"].items()))
            if "numa" in row:
                gpu["numa_node"] = row["numa"]
        card = fabric.get((gpu.get("pci_bus") or "").lower())
        if card:
            gpu["nvlink_fabric"] = card
        # Said even when empty: a card that leaves its domain (a fabric manager restart drops every card)
        # must replace what the controller holds, which a missing field would not.
        gpu["nvlink_domain"] = domain(card) if card else ""
