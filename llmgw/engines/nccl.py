"""The NCCL environment an engine's shard is started with: which adapters, which interface, which GID.

NCCL picks adapters, interfaces and GID entries by itself, and on a node of several fabrics or
interfaces it picks wrong without a word: the job starts, passes its health checks, and hangs on its
first collective (the Go version's lessons). So each shard is told:

- `NCCL_IB_HCA`: the adapters of the fabric its replica was placed on, and no others, each with its
  port and the list led by `=`: NCCL reads its lists as prefixes otherwise, and `mlx5_1` would take
  `mlx5_10` and `mlx5_11` too (often a storage network's); `NCCL_IB_DISABLE=1` where it has none (a
  replica on one node, or on no fabric);
- `NCCL_IB_GID_INDEX` on RoCE: the RoCE v2 entry with an IPv4 address (NCCL's default, index 0, is a
  RoCE v1 link-local entry on most hosts, which does not route);
- `NCCL_SOCKET_IFNAME` (`=` and the name: `bond0` alone would take `bond0.100`) and `GLOO_SOCKET_IFNAME`:
  this node's own management interface, for the bootstrap (one name for every node once left nodes on
  `ens3` or `bond0` binding nothing);
- `NCCL_MNNVL_ENABLE=1` and `NCCL_CUMEM_ENABLE=1` inside a multi-node NVLink domain.

A profile's own `env` is applied after these, so an operator can override any of them.
"""

from __future__ import annotations


def environment(nodes: int, rails: list[str], gid_index: int | None, interface: str | None,
                island: str = "") -> dict[str, str]:
    """The variables for a shard of a replica over NODES nodes sending on RAILS ("mlx5_0:1": adapter and port,
    `rails`; with RoCE's GID_INDEX), bootstrapping over INTERFACE, on ISLAND ("nvl:..." for a multi-node
    NVLink domain)."""
    env: dict[str, str] = {}
    if rails:
        env["NCCL_IB_HCA"] = "=" + ",".join(rails)
        env["NCCL_IB_DISABLE"] = "0"
        if gid_index is not None:
            env["NCCL_IB_GID_INDEX"] = str(gid_index)
    else:
        env["NCCL_IB_DISABLE"] = "1"
    if nodes > 1 and island.startswith("nvl:"):
        env["NCCL_MNNVL_ENABLE"] = "1"
        env["NCCL_CUMEM_ENABLE"] = "1"
    if interface:
        env["NCCL_SOCKET_IFNAME"] = "=" + interface
        env["GLOO_SOCKET_IFNAME"] = interface
    return env


def rails(ports: list[dict], adapters: list[str]) -> list[str]:
    """ADAPTERS' active ports (llmgw/node/ibports.py) as NCCL names them: "mlx5_0:1"."""
    return [f"{p['hca']}:{p['port']}" for p in sorted(ports, key=lambda p: (p["hca"], p["port"]))
            if p["hca"] in adapters and p.get("state", "").upper() == "ACTIVE"]


def gid_index(ports: list[dict], adapters: list[str]) -> int | None:
    """The RoCE v2 GID index of ADAPTERS' active ports (llmgw/node/ibports.py), None on InfiniBand. NCCL takes
    one index for all; adapters that disagree get the first's, which the doctor warns about."""
    for port in ports:
        if port["hca"] in adapters and port.get("state", "").upper() == "ACTIVE" and "roce_gid_index" in port:
            return port["roce_gid_index"]
    return None
