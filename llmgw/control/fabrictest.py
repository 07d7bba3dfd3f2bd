"""A fabric test between two nodes, run through their agents (no SSH between nodes): perftest's
`ib_write_bw` on each rail of the fabric they share, one rail at a time, graded against the link rate.

A rail is an adapter on each node, paired as NCCL pairs them: by name where both nodes have it
(mlx5_0 with mlx5_0), else in order. Node B runs the server and node A the client, on B's address.
Graded against the slower of the two ports' rates: ok at 80% or more, slow at 50% or more, fail below or
when nothing got through. An agent that does not run fabric tests (it did not list the feature when it
registered) is refused at once, rather than waited for.
"""

from __future__ import annotations

import concurrent.futures

from llmgw.control.fleet import LOST, UNREACHABLE, NodeView

FEATURE = "fabric-test"
FIRST_TCP_PORT = 18515  # perftest's own default, one more a rail
ANSWER_GRACE = 90.0  # seconds past the test's own a node has to answer (installing perftest the first time)
OK_AT, SLOW_AT = 0.8, 0.5


class TestRefused(Exception):
    """A fabric test that cannot run; the message says why and what to do."""


def _island(fabric: dict) -> str:
    return fabric.get("physical") or f"unverified:{fabric['name']}"


def shared_fabric(a: NodeView, b: NodeView, name: str | None) -> tuple[dict, dict]:
    """The fabric A and B share (the one named NAME on A, where given), as each declares it."""
    theirs = {_island(f): f for f in b.facts.fabrics}
    mine = [f for f in a.facts.fabrics if name in (None, f["name"])]
    shared = [(f, theirs[_island(f)]) for f in mine if _island(f) in theirs]
    if not shared:
        said = "; ".join(f"{n.node_id}: {', '.join(f['name'] for f in n.facts.fabrics) or 'none usable'}"
                         for n in (a, b))
        wanted = f"fabric {name}" if name else "a fabric"
        raise TestRefused(f"{a.node_id} and {b.node_id} do not share {wanted} ({said}); `llmgw ctl nodes --json` "
                          "shows each node's fabrics and why one is not usable")
    if len(shared) > 1:
        raise TestRefused(f"{a.node_id} and {b.node_id} share {len(shared)} fabrics ("
                          f"{', '.join(f['name'] for f, _ in shared)}): say which with --fabric")
    return shared[0]


def rails(mine: list[str], theirs: list[str]) -> list[tuple[str, str]]:
    """Adapter pairs: those both nodes have by name, else in order."""
    common = sorted(set(mine) & set(theirs))
    return [(h, h) for h in common] if common else list(zip(sorted(mine), sorted(theirs)))


def _port(node: NodeView, hca: str) -> dict | None:
    return next((p for p in node.facts.ib_ports if p["hca"] == hca and p.get("state", "").upper() == "ACTIVE"), None)


def grade(gbps: float | None, rate: float | None) -> str:
    if not gbps:
        return "fail"
    if not rate:
        return "ok"  # no rate to grade against: it got through
    return "ok" if gbps >= OK_AT * rate else "slow" if gbps >= SLOW_AT * rate else "fail"


def run(nodes: list[NodeView], a_id: str, b_id: str, fabric: str | None, seconds: int, ask) -> dict:
    """Test the fabric A_ID and B_ID share for SECONDS a rail. ASK(node, kind, fields, timeout) -> the node's
    reply or None (the controller's `ask_node`). Raises TestRefused."""
    by_id = {n.node_id: n for n in nodes}
    for node_id in (a_id, b_id):
        node = by_id.get(node_id)
        if node is None:
            raise TestRefused(f"no node {node_id!r}; `llmgw ctl nodes` lists them")
        if node.state in (UNREACHABLE, LOST):
            raise TestRefused(f"{node_id} is {node.state}: its agent cannot run a test")
        if FEATURE not in (node.facts.registration.get("features") or []):
            raise TestRefused(f"the agent on {node_id} does not run fabric tests (an older llmgw): upgrade it")
    a, b = by_id[a_id], by_id[b_id]
    if not b.address:
        raise TestRefused(f"{b_id}'s address is not known, so {a_id} cannot reach it")
    mine, theirs = shared_fabric(a, b, fabric)
    results = []
    for i, (hca_a, hca_b) in enumerate(rails(mine.get("adapters", []), theirs.get("adapters", []))):
        port_a, port_b = _port(a, hca_a), _port(b, hca_b)
        rate = min((p["rate_gbps"] for p in (port_a, port_b) if p and p.get("rate_gbps")), default=None)
        tcp_port, wait = FIRST_TCP_PORT + i, seconds + ANSWER_GRACE
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            serving = pool.submit(ask, b_id, "fabric_test", {"role": "server", "hca": hca_b, "tcp_port": tcp_port,
                                                             "port": port_b["port"] if port_b else 1,
                                                             "seconds": seconds}, wait)
            client = ask(a_id, "fabric_test", {"role": "client", "hca": hca_a, "tcp_port": tcp_port, "seconds": seconds,
                                               "port": port_a["port"] if port_a else 1, "peer": b.address}, wait)
            reply = serving.result()
        error = _error(a_id, client) or _error(b_id, reply)
        gbps = client.get("gbps") if client and not error else None
        results.append({"a": hca_a, "b": hca_b, "gbps": gbps, "rate_gbps": rate, "grade": grade(gbps, rate),
                        **({"error": error} if error else {})})
    return {"a": a_id, "b": b_id, "fabric": mine["name"], "physical": mine.get("physical", ""), "seconds": seconds,
            "rails": results, "passed": bool(results) and all(r["grade"] == "ok" for r in results)}


def _error(node_id: str, reply: dict | None) -> str:
    if reply is None:
        return f"{node_id} did not answer in time"
    return f"{node_id}: {reply['error']}" if reply.get("error") else ""
