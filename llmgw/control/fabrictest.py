"""A fabric test between two nodes, run through their agents (no SSH between nodes): perftest's
`ib_write_bw` on each rail of the fabric they share, one rail at a time, graded against the link rate.

A rail is an adapter on each node, paired as NCCL pairs them: by name where both nodes have it
(mlx5_0 with mlx5_0), else in order. Every adapter the fabric names is a rail: one that is down, or left
without a partner, fails the test without running. Node B runs the server and node A the client, on B's address.
Graded against the slower of the two ports' rates: ok at 80% or more, slow at 50% or more, fail below or
when nothing got through. An agent that does not run fabric tests (it did not list the feature when it
registered) is refused at once, rather than waited for.
"""

from __future__ import annotations

import concurrent.futures
import secrets

from llmgw.control.fleet import LOST, UNREACHABLE, NodeView

FEATURE = "fabric-test"
FIRST_TCP_PORT = 18515  # perftest's own default; a test starts at a random step above it, one more a rail
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


def rails(mine: list[str], theirs: list[str]) -> list[tuple[str | None, str | None]]:
    """Adapter pairs, each declared adapter of either node in one: by name where both have it, the rest in
    order; an adapter left without a partner is paired with None (a rail that cannot pass)."""
    common = sorted(set(mine) & set(theirs))
    rest_a, rest_b = sorted(set(mine) - set(common)), sorted(set(theirs) - set(common))
    extra = max(len(rest_a), len(rest_b))
    padded_a, padded_b = rest_a + [None] * (extra - len(rest_a)), rest_b + [None] * (extra - len(rest_b))
    return [(h, h) for h in common] + list(zip(padded_a, padded_b))


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
    # Every adapter the fabric names on either node is a rail, active or not: a rail that is down fails
    # the test, rather than leaving it.
    pairs = rails(mine.get("declared") or mine.get("adapters", []), theirs.get("declared") or theirs.get("adapters", []))
    first = FIRST_TCP_PORT + secrets.randbelow(1000) * 8  # two tests at once on one node use other ports
    for i, (hca_a, hca_b) in enumerate(pairs):
        port_a, port_b = _port(a, hca_a), _port(b, hca_b)
        rate = min((p["rate_gbps"] for p in (port_a, port_b) if p and p.get("rate_gbps")), default=None)
        missing = []
        for hca, other, node_id, port in ((hca_a, hca_b, a_id, port_a), (hca_b, hca_a, b_id, port_b)):
            if hca is not None and other is None:
                missing.append(f"{hca} on {node_id} has no partner on the other node")
            elif hca is not None and port is None:
                missing.append(f"{hca} on {node_id} is not active")
        if missing or port_a is None or port_b is None:
            results.append({"a": hca_a or "-", "b": hca_b or "-", "gbps": None, "rate_gbps": rate, "grade": "fail",
                            "error": "; ".join(missing)})
            continue
        tcp_port, wait = first + i, seconds + ANSWER_GRACE
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            serving = pool.submit(ask, b_id, "fabric_test", {"role": "server", "hca": hca_b, "tcp_port": tcp_port,
                                                             "port": port_b["port"], "seconds": seconds}, wait)
            client = ask(a_id, "fabric_test", {"role": "client", "hca": hca_a, "tcp_port": tcp_port, "seconds": seconds,
                                               "port": port_a["port"], "peer": b.address}, wait)
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
