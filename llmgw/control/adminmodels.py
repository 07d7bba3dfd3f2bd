"""The admin API's models and replicas: the catalog (added, removed, scaled), measured capacities, where
a model can be placed and why not, every replica with its state, and the controller's status.
"""

from __future__ import annotations

import time

from flask import Blueprint, jsonify, request

from llmgw import __version__, apiguard
from llmgw.control import placement
from llmgw.control.adminparts import error, parts
from llmgw.control.catalog import check_source, parse_model
from llmgw.control.fleet import STATES

bp = Blueprint("models", __name__)


def replica_rows() -> list[dict]:
    ours = parts()
    catalog, replicas = ours.catalog, ours.replicas
    models = catalog.models()
    rows = []
    for r in sorted(replicas.snapshot(), key=lambda r: (r.model, r.node_id, r.shard_id)):
        model = models.get(r.model)
        current = {model.fingerprint(p) for p in model.profiles} if model else set()
        stale = r.profile_fp is not None and r.profile_fp not in current
        profile = catalog.profile_of(r.model, r.profile_fp)
        rows.append({"shard_id": r.shard_id, "model": r.model, "node": r.node_id, "state": r.state,
                     "stale_profile": stale, "url": r.url, "engine": r.engine, "gpus": list(r.gpus),
                     "fetch": r.fetch, "age_s": round(time.monotonic() - r.since, 1), "context": r.context,
                     "profile": profile.name if profile else None, "detail": r.detail, "restarts": r.restarts,
                     "restart_reason": r.restart_reason,
                     **({"group": r.group, "rank": r.rank, "ranks": r.ranks} if r.group else {})})
    return rows


@bp.get("/api/v1/models")
def models():
    ours = parts()
    catalog, replicas, report, scaler = ours.catalog, ours.replicas, ours.report, ours.scaler
    live = replica_rows()
    out = []
    for m in sorted(catalog.models().values(), key=lambda m: m.name):
        mine = [r for r in live if r["model"] == m.name]
        failure = replicas.failures.get(m.name)
        out.append({"name": m.name, "aliases": list(m.aliases), "origin": m.origin, "source": m.source,
                    "sources": m.sources(),
                    "scaling": {"min": m.min_replicas, "max": m.max_replicas, "idle_timeout": m.idle_timeout},
                    "profiles": [p.name for p in m.profiles],
                    "ready": sum(1 for r in mine if r["state"] == "ready"), "replicas": len(mine),
                    "last_failure": failure and {"node": failure.node_id, "detail": failure.detail,
                                                 "last_output": failure.last_output, "count": failure.count},
                    "unplaced": report.unplaced_for(m.name),
                    "load_scaling": scaler.explain(m.name) if scaler is not None else None})
    return jsonify({"models": out})


@bp.post("/api/v1/models")
def add_model():
    ours = parts()
    catalog, egress, report = ours.catalog, ours.egress, ours.report
    table = apiguard.json_body(request)
    if not isinstance(table, dict):
        return error(400, "send the model as a JSON object (llmgw ctl model add -f model.toml does)")
    model = parse_model(table, origin="runtime")
    if request.args.get("source_check", "1") != "0":
        size = check_source(model.source, egress)
        for other in model.sources()[1:]:
            check_source(other, egress)
        if size is not None and "size_bytes" not in table:
            table["size_bytes"] = size  # placement skips nodes without the disk for it
    catalog.add(table)
    report.kick()
    return jsonify({"name": model.name, "added": True})


@bp.delete("/api/v1/models/<name>")
def remove_model(name):
    ours = parts()
    catalog, report = ours.catalog, ours.report
    catalog.remove(name)
    report.kick()
    return jsonify({"name": name, "removed": True})


@bp.post("/api/v1/models/<name>/scale")
def scale(name):
    ours = parts()
    catalog, report = ours.catalog, ours.report
    body = apiguard.json_body(request) or {}
    if not isinstance(body, dict):
        return error(400, 'send {"min": N, "max": N} (llmgw ctl model scale does)')
    model = catalog.scale(name, body.get("min"), body.get("max"))
    report.kick()
    return jsonify({"name": name, "min": model.min_replicas, "max": model.max_replicas})


@bp.put("/api/v1/models/<name>/capacity")
def save_capacity(name):
    """A measurement of one replica (`llmgw ctl bench --save`), filed under the profile it runs; PUT, since
    measuring again replaces it."""
    ours = parts()
    catalog, replicas = ours.catalog, ours.replicas
    body = apiguard.json_body(request)
    if not isinstance(body, dict) or not isinstance(body.get("replica"), str):
        return error(400, 'send {"replica": ID, "max_in_flight": N, ...} (llmgw ctl bench --save does)')
    if name not in catalog.models():
        return error(404, f"no model {name!r}; `llmgw ctl models` lists them")
    replica = next((r for r in replicas.snapshot() if r.shard_id == body["replica"] and r.model == name), None)
    if replica is None:
        return error(404, f"{name} has no replica {body['replica'][:200]!r} now; `llmgw ctl replicas --model "
                          f"{name}` lists them, and a measurement is saved while its replica runs")
    saved = catalog.save_capacity(name, replica.profile_fp, body.get("max_in_flight"), body)
    return jsonify(saved.to_dict(saved.fingerprint))


@bp.delete("/api/v1/models/<name>/capacity")
def forget_capacity(name):
    catalog = parts().catalog
    profile = request.args.get("profile")
    dropped = catalog.forget_capacity(name, profile)
    if not dropped:
        what = f"profile {profile!r} of {name}" if profile else name
        return error(404, f"nothing was measured of {what}; `llmgw ctl capacity` lists what was")
    return jsonify({"model": name, "profile": profile, "forgotten": dropped})


@bp.get("/api/v1/capacity")
def capacities():
    catalog = parts().catalog
    rows = [cap.to_dict(catalog.current_fingerprint(cap.model, cap.profile))
            for _, cap in sorted(catalog.capacities.items())]
    return jsonify({"capacities": rows})


@bp.get("/api/v1/models/<name>/placement")
def explain_placement(name):
    ours = parts()
    catalog, fleet, replicas, scaler = ours.catalog, ours.fleet, ours.replicas, ours.scaler
    model = catalog.models().get(name)
    if model is None:
        return error(404, f"no model {name!r}; `llmgw ctl models` lists them")
    leaves = ours.maps.leaves() if ours.maps is not None else None
    return jsonify({"model": name, "nodes": placement.explain(model, fleet.describe(time.monotonic()),
                                                               replicas.claims(), leaves),
                    "scaling": scaler.explain(name) if scaler is not None else None})


@bp.get("/api/v1/replicas")
def replica_list():
    return jsonify({"replicas": replica_rows()})


@bp.get("/api/v1/status")
def status():
    ours = parts()
    catalog, fleet, lease, plaintext, report = ours.catalog, ours.fleet, ours.lease, ours.plaintext, ours.report
    now = time.monotonic()
    nodes = fleet.describe(now)
    counts = {state: sum(1 for n in nodes if n.state == state) for state in STATES}
    rows = replica_rows()
    models_ = catalog.models()
    took, took_max = report.timings()
    serving = sum(1 for name in models_ if any(r["model"] == name and r["state"] == "ready" for r in rows))
    role = "leader" if lease is None or lease.held() else "standby"
    return jsonify({"version": __version__, "plaintext": plaintext, "role": role,
                    "leader": lease.leader_address() if lease is not None else "",
                    "nodes": counts, "models": len(models_),
                    "models_serving": serving, "replicas": len(rows),
                    "replicas_ready": sum(1 for r in rows if r["state"] == "ready"),
                    "reconcile_seconds": took, "reconcile_seconds_max": took_max,
                    "reconcile_passes": report.passes(),
                    # Whether a node may still bring back replicas placed before this controller led
                    # (llmgw/control/claims.py): while it does, a node late to register keeps its engines.
                    "adopting": role == "leader" and fleet.adopting(now)})
