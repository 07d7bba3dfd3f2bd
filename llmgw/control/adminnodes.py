"""The admin API's nodes: listed, cordoned, drained and removed (by force: its replicas stopped and its key
revoked), their logs and weights directories, engines installed on demand, and the keys issued to nodes and
gateways.
"""

from __future__ import annotations

import concurrent.futures
import functools
import re
import time

from flask import Blueprint, jsonify, request
from sqlalchemy.engine import Engine

from llmgw import apiguard, keyfiles, store
from llmgw.control import curvekeys, weightsview
from llmgw.control.adminparts import Parts, error, parts
from llmgw.control.authenticator import KeyRing
from llmgw.control.fleet import LOST, UNREACHABLE

NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
STOP_WAIT = 5.0  # seconds a node removed by force has to say it is stopping a replica
WEIGHTS_WAIT = 10.0  # seconds a node has to list its weights directory (or remove from it)
LOG_LINES = 2000  # lines one logs answer holds at most: what the agent keeps of its own
INSTALL_WAIT = 10.0  # seconds a node has to say it starts an install (the install itself is followed in heartbeats)
INSTALL_FEATURE = "install-engine"  # what an agent that installs an engine on request lists in its `features`

bp = Blueprint("nodes", __name__)


@bp.get("/api/v1/nodes/<node_id>/logs")
def logs(node_id):
    ours = parts()
    ask_node, fleet = ours.ask_node, ours.fleet
    if node_id not in {n.node_id for n in fleet.describe(time.monotonic())}:
        return error(404, f"no node {node_id!r}; `llmgw ctl nodes` lists them")
    fields, refusal = _logs_fields(request.args)
    if refusal:
        return error(400, refusal)
    reply = ask_node(node_id, "logs_request", fields, 10.0)
    if reply is None:
        return error(504, f"{node_id} did not answer within 10 s; `llmgw ctl nodes` shows when it was last heard")
    if reply.get("error"):
        return error(404, reply["error"])
    return jsonify({"node": node_id, "sources": reply.get("sources", []),
                    **{k: reply[k] for k in ("lines", "cursor", "skipped") if k in reply}})


def weights_of(ours: Parts, node_id: str, kind: str = "weights_request", fields: dict | None = None) -> dict:
    """NODE_ID's weights directory as `weightsview.annotate` shows it, after KIND (a listing, or a
    reclaim that answers with one); {"node", "error"} when the node does not answer. OURS is passed in:
    the listings are asked for in threads of their own, outside the request's app context."""
    ask_node, catalog, replicas = ours.ask_node, ours.catalog, ours.replicas
    reply = ask_node(node_id, kind, fields or {}, WEIGHTS_WAIT)
    if reply is None:
        return {"node": node_id, "error": f"{node_id} did not answer within {WEIGHTS_WAIT:.0f} s; `llmgw ctl "
                                          "nodes` shows when it was last heard"}
    sources = {name: m.sources() for name, m in catalog.models().items()}
    mine = [(r.shard_id, r.model) for r in replicas.snapshot() if r.node_id == node_id]
    return {**weightsview.annotate(node_id, reply, sources, mine),
            "removed": reply.get("removed"), "refused": reply.get("refused")}


@bp.get("/api/v1/weights")
def weights():
    fleet = parts().fleet
    views = fleet.describe(time.monotonic())
    wanted = request.args.get("node")
    if wanted and wanted not in {n.node_id for n in views}:
        return error(404, f"no node {wanted!r}; `llmgw ctl nodes` lists them")
    asked = [n for n in views if not wanted or n.node_id == wanted]
    silent = {n.node_id for n in asked if n.state in (UNREACHABLE, LOST)}
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        # Every node at once: one that does not answer costs its WEIGHTS_WAIT once, not once per node.
        listed = dict(zip([n.node_id for n in asked if n.node_id not in silent],
                          pool.map(functools.partial(weights_of, parts()), [n.node_id for n in asked if n.node_id not in silent])))
    out = []
    for n in asked:
        out.append(listed.get(n.node_id) or {"node": n.node_id, "error": f"{n.node_id} is {n.state}: what it "
                                             "holds is known once it is heard again"})
    return jsonify({"nodes": [{k: v for k, v in n.items() if k not in ("removed", "refused")} for n in out]})


@bp.post("/api/v1/nodes/<node_id>/weights/reclaim")
def reclaim(node_id):
    fleet = parts().fleet
    body = apiguard.json_body(request)
    names = body.get("names") if isinstance(body, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return error(400, 'send {"names": [...]}: entries `llmgw ctl weights NODE` lists as reclaimable')
    if node_id not in {n.node_id for n in fleet.describe(time.monotonic())}:
        return error(404, f"no node {node_id!r}; `llmgw ctl nodes` lists them")
    # Checked against what the node holds now, not what it held when the operator looked: the node is
    # only ever told names it has just listed, and only those nothing uses.
    now = weights_of(parts(), node_id)
    if "error" in now:
        return error(504, now["error"])
    entries = {f["name"]: f for f in now["files"]}
    refused = {}
    for name in names:
        entry = entries.get(name)
        if entry is None:
            refused[name] = f"{node_id} does not hold it now (or it is past the listing's first {len(entries)})"
        elif not entry["reclaimable"]:
            refused[name] = entry["kept"]
    chosen = [n for n in dict.fromkeys(names) if n not in refused]
    removed = []
    if chosen:
        after = weights_of(parts(), node_id, "reclaim_weights", {"names": chosen})
        if "error" in after:
            return error(504, after["error"] + "; run `llmgw ctl weights` to see what was removed")
        removed = after["removed"] or []
        refused.update(after["refused"] or {})
    return jsonify({"node": node_id, "removed": removed, "refused": refused,
                    "freed_bytes": sum(entries[n]["bytes"] for n in removed if n in entries)})


@bp.post("/api/v1/nodes/<node_id>/engines/<engine>/install")
def install_engine(node_id, engine):
    """Install ENGINE on NODE_ID now, from its engine catalogue, rather than when a replica first needs it
    (`llmgw node add --wait-engine`, `llmgw ctl install-engine`). 202 once the node started; the install's
    progress and outcome are the node's `installs`, in its heartbeats."""
    ours = parts()
    node = next((n for n in ours.fleet.describe(time.monotonic()) if n.node_id == node_id), None)
    refused = install_refusal(node, node_id, engine)
    if refused:
        return error(*refused)
    reply = ours.ask_node(node_id, "install_engine", {"engine": engine}, INSTALL_WAIT)
    if reply is None:
        return error(504, f"{node_id} did not answer within {INSTALL_WAIT:.0f} s; `llmgw ctl nodes` shows when it "
                          "was last heard")
    if not reply.get("ok"):
        return error(409, reply.get("error") or f"{node_id} refused")
    return jsonify({"node": node_id, "engine": engine, "version": node.facts.registration["installable"][engine]}), 202


def install_refusal(node, node_id: str, engine: str) -> tuple[int, str] | None:
    """Why NODE (NODE_ID as `Fleet.describe` shows it, None when there is none) cannot be asked to install ENGINE,
    as (status, sentence), before anything is sent: a node that could not answer is refused at once."""
    if node is None:
        return 404, f"no node {node_id!r}; `llmgw ctl nodes` lists them"
    if node.state in (UNREACHABLE, LOST):
        return 409, f"{node_id} is {node.state}: its agent cannot install anything until it is heard again"
    registration = node.facts.registration
    if INSTALL_FEATURE not in (registration.get("features") or []):
        return 409, (f"the agent on {node_id} does not install engines on request (an older llmgw): upgrade it, "
                     "or let the first replica that needs the engine install it")
    installable = registration.get("installable") or {}
    if engine not in installable:
        have = ", ".join(f"{k} {v}" for k, v in sorted(installable.items())) or "nothing"
        return 409, (f"{node_id}'s engine catalogue ([[engines]]) has no {engine} for its platform (it can install: "
                     f"{have}); `llmgw node add` copies the control plane's catalogue to a node")
    return None


@bp.get("/api/v1/nodes")
def nodes():
    fleet = parts().fleet
    return jsonify({"nodes": [n.to_dict() for n in fleet.describe(time.monotonic())]})


@bp.post("/api/v1/nodes/<node_id>/cordon")
def cordon(node_id):
    ours = parts()
    engine, fleet = ours.engine, ours.fleet
    fleet.set_cordon(node_id, True)
    _remember_cordon(engine, node_id, True)
    return jsonify({"node_id": node_id, "cordoned": True})


@bp.post("/api/v1/nodes/<node_id>/uncordon")
def uncordon(node_id):
    ours = parts()
    engine, fleet = ours.engine, ours.fleet
    fleet.set_cordon(node_id, False)
    _remember_cordon(engine, node_id, False)
    return jsonify({"node_id": node_id, "cordoned": False})


@bp.post("/api/v1/nodes/<node_id>/drain")
def drain(node_id):
    ours = parts()
    engine, fleet = ours.engine, ours.fleet
    fleet.drain(node_id)
    _remember_cordon(engine, node_id, True)
    return jsonify({"node_id": node_id, "draining": True})


@bp.delete("/api/v1/nodes/<node_id>")
def remove(node_id):
    ours = parts()
    fleet, ring = ours.fleet, ours.ring
    if request.args.get("force") != "1":
        fleet.remove(node_id, time.monotonic())
        return jsonify({"node_id": node_id, "removed": True})
    if ring is None:
        # With no key to revoke, a node still connected would register again at its next heartbeat.
        return error(409, f"this controller runs with controller.plaintext: {node_id} has no key to revoke, "
                          f"so it would register again at once. Stop its agent, then `llmgw ctl node remove "
                          f"{node_id}` once it is lost.")
    if node_id not in ring.keys.values():
        return error(404, f"no node {node_id!r} holds a key; `llmgw ctl nodes` lists the nodes")
    fleet.hold(node_id)
    stopped, unconfirmed = stop_replicas(node_id)
    revoke(node_id)
    return jsonify({"node_id": node_id, "removed": True, "key_revoked": True, "stopped": stopped,
                    "unconfirmed": unconfirmed})


def stop_replicas(node_id: str) -> tuple[list[str], list[str]]:
    """Tell NODE_ID to stop each of its replicas while it still may be told anything: (those it said it
    stops, those it did not answer for). A node that does not answer is not asked again."""
    ours = parts()
    ask_node, fleet, replicas = ours.ask_node, ours.fleet, ours.replicas
    mine = sorted(r.shard_id for r in replicas.snapshot() if r.node_id == node_id)
    reachable = any(n.node_id == node_id and n.state not in (UNREACHABLE, LOST)
                    for n in fleet.describe(time.monotonic()))
    stopped: list[str] = []
    for shard_id in mine if reachable else ():
        if ask_node(node_id, "stop_shard", {"shard_id": shard_id}, STOP_WAIT) is None:
            break
        stopped.append(shard_id)
    return stopped, [s for s in mine if s not in stopped]


def revoke(node_id: str) -> bool:
    """Withdraw NODE_ID's key from the store and the ring; the agent server then refuses its session and
    forgets it (llmgw/control/agentserver.py). False when it held none."""
    ours = parts()
    engine, ring = ours.engine, ours.ring
    revoked = curvekeys.revoke_node_key(engine, node_id)
    ring.replace(curvekeys.authorised_keys(engine))
    return revoked


@bp.delete("/api/v1/node-keys/<node_id>")
def revoke_key(node_id):
    ring = parts().ring
    if ring is None:
        return error(409, "this controller runs with controller.plaintext: agents use no keys")
    if not revoke(node_id):
        return error(404, f"no key is issued to {node_id!r}; `llmgw ctl nodes` lists the nodes")
    return jsonify({"node_id": node_id, "revoked": True})


def issue(kind: str, field: str, example: str, key_ring: KeyRing | None, issue_key, issued, key_file):
    """Issue a key for the name in the body's FIELD and let the ring admit it at once."""
    ours = parts()
    controller_public, engine = ours.controller_public, ours.engine
    body = apiguard.json_body(request)
    name = body.get(field) if isinstance(body, dict) else None
    if not isinstance(name, str) or not NODE_ID.match(name):
        return error(400, f"{field} must be a name of letters, digits, '.', '_' or '-', such as {example}")
    if key_ring is None:
        return error(409, f"this controller runs with controller.plaintext: {kind}s use no keys")
    public, secret = issue_key(engine, name)
    key_ring.replace(issued(engine))
    return jsonify({field: name, "key_file": key_file(name, public, secret, controller_public)})


@bp.post("/api/v1/node-keys")
def issue_key():
    ring = parts().ring
    return issue("agent", "node_id", "gpu-01", ring, curvekeys.issue_node_key, curvekeys.authorised_keys,
                 keyfiles.node_key_file)


@bp.post("/api/v1/gateway-keys")
def issue_gateway_key():
    gateway_ring = parts().gateway_ring
    return issue("gateway", "name", "gw-01", gateway_ring, curvekeys.issue_gateway_key, curvekeys.gateway_keys,
                 keyfiles.gateway_key_file)


def _remember_cordon(engine: Engine, node_id: str, cordoned: bool) -> None:
    with store.writing(engine) as conn:
        conn.execute(store.node_settings.delete().where(store.node_settings.c.node_id == node_id))
        conn.execute(store.node_settings.insert().values(node_id=node_id, cordoned=cordoned, updated_at=time.time()))


def _logs_fields(args) -> tuple[dict, str | None]:
    """The `logs_request` fields for a logs query (source, lines, after), or why the query is refused."""
    fields: dict = {}
    lines = args.get("lines", "200")
    # isascii too: "²".isdigit() is true, and int("²") raises.
    if not (lines.isascii() and lines.isdigit() and len(lines) < 6) or not 1 <= int(lines) <= LOG_LINES:
        return fields, f"lines is a whole number from 1 to {LOG_LINES}, not {lines[:20]!r}"
    fields["lines"] = int(lines)
    after = args.get("after")
    if after is not None:
        if not (after.isascii() and after.isdigit() and len(after) <= 18):
            return fields, f"after is a cursor from an earlier answer (a whole number), not {after[:20]!r}"
        fields["after"] = int(after)
    source = args.get("source")
    if source:
        # Refused here too, not only by the node: an agent older than this controller still joined a source
        # onto its shards folder, and a name without a slash cannot leave it.
        if "/" in source or "\0" in source or len(source) > 200:
            return fields, (f"{source[:60]!r} is not a source: a source is a name the node lists (agent, or a "
                            "shard id), never a path; `llmgw ctl logs NODE` lists them")
        fields["source"] = source
    return fields, None


def cordoned_nodes(engine: Engine) -> set[str]:
    with engine.connect() as conn:
        rows = conn.execute(store.node_settings.select().where(store.node_settings.c.cordoned.is_(True))).all()
    return {row.node_id for row in rows}
