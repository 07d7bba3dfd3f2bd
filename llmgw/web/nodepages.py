"""A node's pages, for administrators: what it is and runs, with the last hour of its charts, and its logs.

- `/admin/nodes/<node>`: hardware, CPU, memory, load, disk, GPUs (their NVLink matrix), fabric ports and
  fabrics, engines and their install state,
  the replicas there with their CPU and memory, the doctor's findings, history charts. Its figures
  refresh in place (static/refresh.js); the charts are drawn once per load.
- `/admin/nodes/<node>/logs?source=agent`: the agent's own last lines or an engine's, followed live
  by static/logs.js, which asks `/admin/nodes/<node>/logs/more` for what came after its cursor.

Everything comes from the controller's admin API (`gateway.controller_admin`), which asks the node:
the page reads no file and names no path. A log source is a name the node listed; the admin API and
the node both refuse anything else.
"""

from __future__ import annotations

import urllib.parse

from flask import Blueprint, abort, jsonify, render_template, request

from llmgw.apiclient import ApiError, Refused, leader_client
from llmgw.web import history, safety
from llmgw.web.adminpages import admin_only
from llmgw.web.site import site

FIRST_LINES = 500  # lines the logs page opens with; it keeps at most 2,000 as it follows
NO_CONTROLLER = ("This gateway has no controller (gateway.controller is empty), so it knows no nodes: it routes "
                 "only to the [[endpoints]] of its configuration.")


bp = Blueprint("nodes", __name__)


bp.add_app_template_filter(history.rounded, "rounded")


def admin():
    if not site().cfg["gateway.controller"]:
        abort(404, NO_CONTROLLER)
    return leader_client(site().cfg, site().cfg["gateway.controller_admin"])


def node_path(node_id: str) -> str:
    return f"/api/v1/nodes/{urllib.parse.quote(node_id, safe='')}"


@bp.get("/admin/nodes/<node_id>")
@admin_only
def node_page(node_id):
    client = admin()
    try:
        nodes = client.call("GET", "/api/v1/nodes", timeout=2)["nodes"]
        replicas = client.call("GET", "/api/v1/replicas", timeout=2)["replicas"]
    except (ApiError, KeyError) as e:
        view = {"node_id": node_id, "problem": f"The node cannot be shown: {e}"}
    else:
        node = next((n for n in nodes if n.get("node_id") == node_id), None)
        if node is None:
            abort(404, f"No node {node_id} has registered with the controller. The cluster page lists the nodes.")
        view = {"node_id": node_id, "problem": None, **node_view(node, replicas)}
    if request.args.get("partial"):
        return render_template("_node.html", **view)
    window = history.window_of(request.args.get("window"))
    return render_template("admin_node.html", history=history.charts(site().cfg["monitoring.prometheus"], window,
                                                                      node=node_id), **view)


@bp.get("/admin/nodes/<node_id>/logs")
@admin_only
def logs_page(node_id):
    source = request.args.get("source") or "agent"
    found = _logs(admin(), node_path(node_id), {"source": source, "lines": FIRST_LINES})
    safety.no_store()  # an engine's log may hold what a prompt said
    return render_template("admin_logs.html", node_id=node_id, source=source, **found)


@bp.get("/admin/nodes/<node_id>/logs/more")
@admin_only
def logs_more(node_id):
    query = {"source": request.args.get("source") or "agent", "lines": 2000}
    if request.args.get("after"):
        query["after"] = request.args["after"]
    found = _logs(admin(), node_path(node_id), query)
    safety.no_store()
    return jsonify({k: found[k] for k in ("lines", "cursor", "skipped", "problem")})


def _logs(client, path: str, query: dict) -> dict:
    """A source's lines from the admin API, with the sources the node lists; a sentence when there are none."""
    try:
        answer = client.call("GET", f"{path}/logs?{urllib.parse.urlencode(query)}", timeout=15)
    except Refused as e:
        return {"lines": [], "cursor": None, "skipped": False, "sources": [], "problem": _sentence(str(e))}
    except ApiError as e:
        return {"lines": [], "cursor": None, "skipped": False, "sources": [],
                "problem": f"The log cannot be read now: {e}"}
    return {"lines": answer.get("lines", []), "cursor": answer.get("cursor"), "skipped": answer.get("skipped", False),
            "sources": answer.get("sources", []), "problem": None}


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:].rstrip(".") + "."


def _merged(facts: dict, status: dict, field: str) -> dict:
    """A figure's latest values: the registration's, updated by the heartbeats' (which send what changed)."""
    return {**(facts.get(field) or {}), **(status.get(field) or {})}


def node_view(node: dict, replicas: list[dict]) -> dict:
    """What the node page shows of NODE (the admin API's JSON: its registration and latest heartbeat fields)
    and of the REPLICAS placed on it. A figure the node has not reported is None, shown as not known."""
    facts, status = node.get("facts") or {}, node.get("status") or {}
    load = status.get("load") or {}
    gpus = {g["index"]: dict(g) for g in facts.get("gpus") or [] if "index" in g}
    for g in status.get("gpus") or []:  # a heartbeat's cards update the registration's by index
        if g.get("index") in gpus:
            gpus[g["index"]].update(g)
    engines = status.get("engines", facts.get("engines")) or {}
    installs = status.get("installs", facts.get("installs")) or {}
    installable = facts.get("installable") or {}
    rows = []
    for name in sorted(set(engines) | set(installable) | {key.split("/")[0] for key in installs}):
        install = next((i | {"version": key.split("/", 1)[-1]} for key, i in sorted(installs.items())
                        if key.split("/")[0] == name), None)
        rows.append({"name": name, "version": engines.get(name), "installable": installable.get(name),
                     "install": install})
    shard_loads = {s.get("shard_id"): s for s in load.get("shards") or []}
    here = [{**r, "load": shard_loads.get(r["shard_id"], {})} for r in replicas if r.get("node") == node["node_id"]]
    doctor = facts.get("doctor")
    cards = [gpus[i] for i in sorted(gpus)]
    return {**fabric_view(facts, status, cards), "node": node, "cpu": facts.get("cpu") or {}, "memory": _merged(facts, status, "memory"),
            "disk": _merged(facts, status, "disk"), "load": load, "gpus": cards,
            "gpus_probed": facts.get("gpus_probed"), "gpu_probe_error": facts.get("gpu_probe_error"),
            "engines": rows, "engines_probed": facts.get("engines_probed"), "replicas": here,
            "weights": status.get("weights") or facts.get("weights"),
            "findings": None if doctor is None else [("failure", f) for f in doctor.get("failures", [])]
            + [("warning", f) for f in doctor.get("warnings", [])],
            "labels": facts.get("labels") or {}}


def fabric_view(facts: dict, status: dict, cards: list[dict]) -> dict:
    """The node page's fabric section: its ports, its usable fabrics and why others are not, and its GPUs'
    NVLink matrix (a row a card: the links to each other card, "" for none), shown where it has any."""
    linked = any(card.get("nvlink") for card in cards)
    matrix = [[None if a is b else (f"NV{a['nvlink'][str(b['index'])]}" if str(b["index"]) in (a.get("nvlink") or {})
                                    else "") for b in cards] for a in cards] if linked else []
    return {"ports": status.get("ib_ports", facts.get("ib_ports")) or [],
            "fabrics": status.get("fabrics", facts.get("fabrics")) or [],
            "fabric_problems": status.get("fabric_problems", facts.get("fabric_problems")) or [],
            "nvlink": matrix}
