"""A node's InfiniBand and RoCE ports, read from sysfs: state, link, rate, counters, GUIDs, and for RoCE
the GID index NCCL must use and the IP network the port is on.

Read on every heartbeat, not once: a port read at registration and never again stayed "on the fabric"
after its cable was pulled, and the node kept being given multi-node work that hung (the Go version's
lesson). The layout is the kernel's (Documentation/ABI/stable/sysfs-class-infiniband):
`/sys/class/infiniband/HCA/{node_guid,fw_ver,device/numa_node}` and
`.../ports/N/{state,phys_state,rate,link_layer,lid,sm_lid,gids/I,gid_attrs/types/I,gid_attrs/ndevs/I,counters/*}`.
Paths are parameters, so tests read fixture trees.
"""

from __future__ import annotations

import fcntl
import glob
import ipaddress
import os
import re
import socket
import struct

# The counters an operator reads; error counters mean trouble when they grow. A counter the driver does
# not have is absent, never 0.
ERROR_COUNTERS = ("symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors",
                  "port_rcv_remote_physical_errors", "local_link_integrity_errors", "excessive_buffer_overrun_errors",
                  "port_xmit_discards")
DATA_COUNTERS = ("port_xmit_data", "port_rcv_data")  # in 4-byte words in sysfs; reported in bytes
GID_ENTRIES = 64  # GID table entries looked at for a RoCE v2 one
_IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:"


def read_value(path: str) -> str | None:
    """A sysfs or /proc file's content, stripped; None where it cannot be read (the doctor's reader too)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def normal_guid(text: str | None) -> str:
    """A GUID as "0x" and 16 lower-case hex digits, however it was written (sysfs's "0c42:a103:0045:bd6c",
    sminfo's "0xc42a1030045bd6c"); "" for none or all zeros, which no device has."""
    digits = (text or "").strip().lower().removeprefix("0x").replace(":", "")
    if not digits or not re.fullmatch(r"[0-9a-f]{1,16}", digits) or int(digits, 16) == 0:
        return ""
    return "0x" + digits.zfill(16)


def _word(text: str | None) -> str:
    """"4: ACTIVE" -> "ACTIVE"."""
    return (text or "").split(":")[-1].strip()


SYSFS = "/sys/class/infiniband"


def read_ports(folder: str = SYSFS, netmask_of=None) -> list[dict]:
    """Every port of every adapter in FOLDER (sysfs's InfiniBand class), sorted by adapter and port.
    NETMASK_OF(interface) -> prefix length or None: how a RoCE port's network is found (this machine's
    own interfaces by default)."""
    netmask_of = netmask_of or prefix_length
    ports = []
    for port_dir in sorted(glob.glob(os.path.join(folder, "*/ports/*"))):
        hca_dir = os.path.dirname(os.path.dirname(port_dir))
        try:
            number = int(os.path.basename(port_dir))
        except ValueError:
            continue
        ports.append(_port(hca_dir, port_dir, number, netmask_of))
    return ports


def _port(hca_dir: str, folder: str, number: int, netmask_of) -> dict:
    rate = re.match(r"([\d.]+) Gb/sec", read_value(os.path.join(folder, "rate")) or "")
    port: dict = {"hca": os.path.basename(hca_dir), "port": number,
                  "state": _word(read_value(os.path.join(folder, "state"))),
                  "phys_state": _word(read_value(os.path.join(folder, "phys_state"))),
                  "link_layer": read_value(os.path.join(folder, "link_layer")) or "",
                  "counters": _counters(folder)}
    if rate:
        port["rate_gbps"] = float(rate.group(1))
    node_guid = normal_guid(read_value(os.path.join(hca_dir, "node_guid")))
    if node_guid:
        port["node_guid"] = node_guid
    gid0 = read_value(os.path.join(folder, "gids", "0")) or ""
    port_guid = normal_guid(":".join(gid0.split(":")[4:]))  # a GID's last 64 bits are the port's GUID
    if port_guid:
        port["port_guid"] = port_guid
    for name in ("lid", "sm_lid"):
        value = read_value(os.path.join(folder, name))
        if value:
            try:
                port[name] = int(value, 0)
            except ValueError:
                pass
    numa = read_value(os.path.join(hca_dir, "device", "numa_node"))
    if numa and numa.lstrip("-").isdigit() and int(numa) >= 0:
        port["numa_node"] = int(numa)
    firmware = read_value(os.path.join(hca_dir, "fw_ver"))
    if firmware:
        port["firmware"] = firmware
    if port["link_layer"].lower() == "ethernet":
        index = roce_v2_gid(folder)
        if index is not None:
            port["roce_gid_index"] = index
            network = roce_network(folder, index, netmask_of)
            if network:
                port["network"] = network
    return port


def _counters(folder: str) -> dict[str, int]:
    out = {}
    for name in ERROR_COUNTERS + DATA_COUNTERS:
        value = read_value(os.path.join(folder, "counters", name))
        if value and value.isdigit():
            out[name] = int(value) * (4 if name in DATA_COUNTERS else 1)
    return out


def roce_v2_gid(folder: str) -> int | None:
    """The GID index NCCL must use on a RoCE port: the first RoCE v2 entry holding an IPv4 address, else the
    first RoCE v2 entry; None where there is none. NCCL's default, index 0, is a RoCE v1 link-local entry on
    most hosts, which does not route, and a job on it hangs."""
    first = None
    for index in range(GID_ENTRIES):
        kind = read_value(os.path.join(folder, "gid_attrs", "types", str(index)))
        if kind is None or kind.lower() != "roce v2":
            continue
        if (read_value(os.path.join(folder, "gids", str(index))) or "").lower().startswith(_IPV4_MAPPED):
            return index
        if first is None:
            first = index
    return first


def gid_ipv4(gid: str) -> str | None:
    """The IPv4 address in an IPv4-mapped GID ("0000:...:ffff:0a00:0005" -> "10.0.0.5")."""
    if not gid.lower().startswith(_IPV4_MAPPED):
        return None
    digits = gid.replace(":", "")[-8:]
    try:
        return str(ipaddress.IPv4Address(int(digits, 16)))
    except ValueError:
        return None


def roce_network(folder: str, index: int, netmask_of) -> str | None:
    """The IP network ("10.0.0.0/24") of a RoCE port's GID INDEX: what tells one RoCE fabric from another."""
    address = gid_ipv4(read_value(os.path.join(folder, "gids", str(index))) or "")
    device = read_value(os.path.join(folder, "gid_attrs", "ndevs", str(index)))
    if address is None or not device:
        return None
    prefix = netmask_of(device)
    if prefix is None:
        return None
    return str(ipaddress.IPv4Network(f"{address}/{prefix}", strict=False))


SIOCGIFNETMASK = 0x891B


def prefix_length(interface: str) -> int | None:
    """The IPv4 prefix length of INTERFACE on this machine (its netmask, asked of the kernel)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            answer = fcntl.ioctl(s.fileno(), SIOCGIFNETMASK, struct.pack("256s", interface.encode()[:15]))
    except OSError:
        return None
    mask = int.from_bytes(answer[20:24], "big")
    return bin(mask).count("1")


def active(port: dict) -> bool:
    return port.get("state", "").upper() == "ACTIVE"
