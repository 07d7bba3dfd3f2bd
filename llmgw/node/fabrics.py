"""The fabrics a node may carry a multi-node replica's collectives on: each name its configuration
declares (`[[fabrics]]` in the agent's file: name, adapters, rate), checked against the ports found.

A name is a person's word, and two physical fabrics given one name were placed as one: a replica given
adapters on both started, passed its health checks, and hung on its first all-reduce (the Go version's
lesson). So each declared fabric is kept only where what it names is one physical fabric: its active
ports all see the same subnet managers (InfiniBand, llmgw/node/subnetmanagers.py) or sit on the same IP
network (RoCE). A name whose adapters sit on two is refused, with both named; one whose physical identity
cannot be read yet (no `sminfo`) is kept, marked unverified, and the controller keeps it apart from the
nodes that can say. A fabric is usable while at least one of its adapters is active, at the rate of its
slowest active port (a collective runs at the slowest link), and degraded where that is below the rate
declared or below its fastest adapter: a cable that trained down.
"""

from __future__ import annotations

from llmgw.node import ibports, subnetmanagers


def port_identity(port: dict) -> str:
    """The physical fabric an active port is on ("sm:<lowest SM guid>", "roce:<network>"), "" unknown."""
    if not ibports.active(port):
        return ""
    if port.get("link_layer", "").lower() == "ethernet":
        return f"roce:{port['network']}" if port.get("network") else ""
    return port.get("fabric_id", "")


def check(declared: list[dict], ports: list[dict]) -> tuple[list[dict], list[tuple[str, bool]]]:
    """(usable fabrics, problems) for the DECLARED fabrics over the PORTS found.

    A usable fabric: {"name", "physical" (port_identity; "" unverified, where any active port's is not known),
    "adapters" (active, sorted), "declared" (every adapter it names, active or not), "link_layer", "rate_gbps",
    "degraded" (why, where it is)}. A problem: (a sentence naming the fabric
    and what to do, whether the configuration itself is wrong rather than a port down)."""
    usable, problems = [], []
    for fabric in declared:
        name = fabric["name"]
        adapters = fabric.get("adapters") or sorted({p["hca"] for p in ports})
        mine = [p for p in ports if p["hca"] in adapters]
        missing = sorted(set(adapters) - {p["hca"] for p in mine})
        if missing:
            problems.append((f"fabric {name}: this node has no adapter {', '.join(missing)} "
                             f"(it has {', '.join(sorted({p['hca'] for p in ports})) or 'none'})", True))
        up = [p for p in mine if ibports.active(p)]
        if not up:
            if mine:
                problems.append((f"fabric {name}: no port of {', '.join(sorted({p['hca'] for p in mine}))} is "
                                 f"active ({'; '.join(_state(p) for p in mine)})", False))
            continue
        identities = {port_identity(p) for p in up}
        physical = identities - {""}
        if len(physical) > 1:
            problems.append((f"fabric {name} names adapters on {len(physical)} physical fabrics ("
                             + "; ".join(f"{', '.join(p['hca'] for p in up if port_identity(p) == ident)} on {ident}"
                                         for ident in sorted(physical))
                             + "): a replica given both hangs on its first collective. Give each fabric its own "
                               "name in [[fabrics]]", True))
            continue
        rates = [p["rate_gbps"] for p in up if p.get("rate_gbps")]
        # One port whose identity is not known yet leaves the whole fabric unverified: it may be on another.
        entry = {"name": name, "physical": physical.pop() if physical and "" not in identities else "",
                 "adapters": sorted({p["hca"] for p in up}), "declared": sorted(adapters),
                 "link_layer": up[0].get("link_layer", ""), "rate_gbps": min(rates) if rates else 0.0}
        degraded = _degraded(fabric, up, entry["rate_gbps"])
        if degraded:
            entry["degraded"] = degraded
        usable.append(entry)
    return usable, problems


def _state(port: dict) -> str:
    return f"{port['hca']}/{port['port']} {port.get('state') or 'no state'}, {port.get('phys_state') or 'no link'}"


def _degraded(fabric: dict, up: list[dict], slowest: float) -> str:
    want = fabric.get("rate_gbps") or max((p.get("rate_gbps") or 0.0 for p in up), default=0.0)
    slow = [p for p in up if (p.get("rate_gbps") or 0.0) < want]
    if not slow or not slowest:
        return ""
    return ", ".join(f"{p['hca']}/{p['port']} at {p.get('rate_gbps') or 0:g} Gb/s" for p in slow) + \
        f" of {want:g}: a cable or port trained down"



class Finder:
    """What a node says of its fabrics (the register and heartbeat fields `ib_ports`, `fabrics`,
    `fabric_problems`), read again each time it is asked: every heartbeat. DECLARED: the agent's
    `[[fabrics]]`; FOLDER: sysfs's InfiniBand class; WATCH: the subnet managers' (asked once a minute)."""

    def __init__(self, declared: list[dict], folder: str = ibports.SYSFS, watch=None, netmask_of=None):
        self.declared = declared
        self.folder = folder
        self.watch = watch or subnetmanagers.Watch()
        self.netmask_of = netmask_of

    def read(self) -> dict:
        ports = ibports.read_ports(self.folder, self.netmask_of)
        self.watch.look(ports)
        facts: dict = {"ib_ports": ports}
        if self.declared:
            usable, problems = check(self.declared, ports)
            facts["fabrics"], facts["fabric_problems"] = usable, [message for message, _ in problems]
        return facts
