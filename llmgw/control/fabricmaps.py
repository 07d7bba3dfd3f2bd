"""Each InfiniBand fabric's map: which leaf switch each node's adapter hangs off, from `ibnetdiscover`.

Nodes under one leaf switch talk through it alone; between leaves their traffic crosses the spine, where
it meets everyone else's. So placement puts a replica over several nodes under one leaf where it can
(llmgw/control/multinode.py). The controller asks one node per fabric to scan it (`scan_fabric`, through
the agent: no SSH), every SCAN_EVERY seconds, and keeps the last map; `GET /api/v1/fabrics/ID/topology`
shows it. The output read is infiniband-diags' `ibnetdiscover.c`: a `Switch` or `Ca` line opens a node
(`"S-<guid>"`, `"H-<guid>"`, then `# "<description>"`), and each `[port]` line under it is one link.
"""

from __future__ import annotations

import re
import threading
import time

SCAN_EVERY = 600.0  # seconds between scans of a fabric
SCAN_WAIT = 150.0  # seconds a node has to answer a scan (ibnetdiscover's own limit is 120)
FEATURE = "fabric-scan"
MOST_FABRICS = 16  # fabrics mapped: more physical fabrics than any cluster has
MOST_NODES = 50_000  # switches and adapters a map may hold (a 15 MiB scan parsed whole takes about 250 MiB)

_NODE = re.compile(r'^(Switch|Ca)\s+\d+\s+"([SH])-([0-9a-fA-F]+)"\s*#\s*"([^"]*)"')
_SWITCH_LINK = re.compile(r'^\[(\d+)\]\s+"([SH])-([0-9a-fA-F]+)"\[(\d+)\]')
_CA_LINK = re.compile(r'^\[(\d+)\](?:\([0-9a-fA-F]+\))?\s+"S-([0-9a-fA-F]+)"\[(\d+)\]')


def _guid(digits: str) -> str:
    return "0x" + digits.lower().zfill(16)


def parse(text: str) -> dict:
    """The map in TEXT: {"switches": {guid: {"description", "hosts", "switches"}}, "hosts": {node guid:
    {"description", "leaf"}}}; a leaf is a switch with a host on it. ValueError where there is no switch."""
    switches: dict[str, dict] = {}
    hosts: dict[str, dict] = {}
    current: tuple[str, str] | None = None
    for line in text.splitlines():
        line = line.strip()
        opened = _NODE.match(line)
        if opened:
            if len(switches) + len(hosts) >= MOST_NODES:
                raise ValueError(f"ibnetdiscover's map holds more than {MOST_NODES} switches and adapters")
            kind, guid = opened.group(1), _guid(opened.group(3))
            current = (kind, guid)
            if kind == "Switch":
                switches.setdefault(guid, {"description": opened.group(4), "hosts": [], "switches": []})
            else:
                hosts.setdefault(guid, {"description": opened.group(4), "leaf": None})
            continue
        if current is None or not line.startswith("["):
            continue
        kind, guid = current
        if kind == "Switch":
            link = _SWITCH_LINK.match(line)
            if link:
                switches[guid]["hosts" if link.group(2) == "H" else "switches"].append(_guid(link.group(3)))
        else:
            link = _CA_LINK.match(line)
            if link and hosts[guid]["leaf"] is None:
                hosts[guid]["leaf"] = _guid(link.group(2))
    if not switches:
        raise ValueError("ibnetdiscover's output names no switch")
    for switch in switches.values():
        switch["hosts"].sort()
        switch["switches"].sort()
    return {"switches": switches, "hosts": hosts}


class Maps:
    """The last map of each fabric (by its identity), or why there is none. Thread-safe: the scans run in
    the scheduler's thread, placement and the admin API read."""

    def __init__(self):
        self.lock = threading.Lock()
        self.maps: dict[str, dict] = {}  # fabric id -> {"at", "node", "map"} or {"at", "node", "error"}
        self.scanning: dict[str, threading.Event] = {}  # fabric id -> set once its scan under way ends

    def get(self, fabric: str) -> dict | None:
        with self.lock:
            return self.maps.get(fabric)

    def leaves(self) -> dict[str, dict[str, str]]:
        """Fabric -> adapter node GUID -> the leaf switch it hangs off: a map speaks for its own fabric only."""
        with self.lock:
            return {fabric: {guid: host["leaf"] for guid, host in entry["map"]["hosts"].items() if host["leaf"]}
                    for fabric, entry in self.maps.items() if "map" in entry}

    def scan(self, nodes, ask, fabric_id: str | None = None, now=time.time) -> None:
        """Map each InfiniBand fabric the NODES report (or only FABRIC_ID) that is due: through the first
        ready node that scans (its agent lists the feature) and has an active port on it. ASK: the
        controller's `ask_node`."""
        scanners = _scanners(nodes)
        with self.lock:  # a fabric no node reports any more is forgotten
            self.maps = {fabric: entry for fabric, entry in self.maps.items() if fabric in scanners}
        for fabric, (node_id, hca, port) in sorted(scanners.items()):
            if fabric_id not in (None, fabric):
                continue
            done = self.get(fabric)
            if fabric_id is None and done is not None and now() - done["at"] < SCAN_EVERY:
                continue
            with self.lock:
                under_way = self.scanning.get(fabric)
                if under_way is None:
                    self.scanning[fabric] = threading.Event()
            if under_way is not None:
                # One scan of a fabric at a time (the job's and each admin request's): a second waits for the
                # first's map rather than run ibnetdiscover over the fabric again beside it.
                under_way.wait(SCAN_WAIT + 5)
                continue
            try:
                self._scan(fabric, node_id, hca, port, ask, now)
            finally:
                with self.lock:
                    self.scanning.pop(fabric).set()

    def _scan(self, fabric: str, node_id: str, hca: str, port: int, ask, now) -> None:
        """Ask NODE_ID to scan FABRIC from HCA's PORT, and keep its map, or why there is none."""
        reply = ask(node_id, "scan_fabric", {"hca": hca, "port": port}, SCAN_WAIT)
        entry: dict = {"at": now(), "node": node_id}
        if reply is None:
            entry["error"] = f"{node_id} did not answer a scan within {SCAN_WAIT:.0f} s"
        elif reply.get("error"):
            entry["error"] = f"{node_id}: {reply['error']}"
        else:
            try:
                entry["map"] = parse(reply.get("output", ""))
            except ValueError as e:
                entry["error"] = f"{node_id}'s scan: {e}"
        with self.lock:
            self.maps[fabric] = entry


def _scanners(nodes) -> dict[str, tuple[str, str, int]]:
    """Fabric id -> (node, adapter, port) that can scan it: the fabrics some ready node uses for a declared
    fabric (a port's own say is not enough: a node whose key leaked could name hundreds), at most
    MOST_FABRICS of them, those the most nodes use first."""
    found: dict[str, tuple[str, str, int]] = {}
    users: dict[str, int] = {}
    for node in nodes:
        if node.state != "ready":
            continue
        used = {f.get("physical") for f in node.facts.fabrics} - {None, ""}
        for fabric in used:
            users[fabric] = users.get(fabric, 0) + 1
        if FEATURE not in (node.facts.registration.get("features") or []):
            continue
        for port in node.facts.ib_ports:
            fabric = port.get("fabric_id")
            if fabric in used and port.get("state", "").upper() == "ACTIVE" and fabric not in found:
                found[fabric] = (node.node_id, port["hca"], port["port"])
    kept = sorted(found, key=lambda fabric: (-users[fabric], fabric))[:MOST_FABRICS]
    return {fabric: found[fabric] for fabric in kept}
