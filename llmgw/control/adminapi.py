"""The controller's admin API, which `llmgw ctl` speaks: JSON under /api/v1, on loopback by default.

It can issue node keys, so it is never opened to the network by default, and
even on loopback it answers only requests that carry its token
(`Authorization: Bearer`, the token the controller keeps in `admin.token`
beside its CURVE keys) and name one of its own addresses in `Host`: a web page
in an operator's browser reaches loopback too, by DNS rebinding, but knows
neither. Errors are `{"error": "..."}` with a sentence that says what to do.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import time

from flask import Flask, jsonify, request
from sqlalchemy.engine import Engine

from llmgw import __version__, apiguard, keyfiles, settings, store
from llmgw.control import curvekeys, placement, weightsview
from llmgw.control.authenticator import KeyRing
from llmgw.control.capacity import CapacityError
from llmgw.control.catalog import Catalog, CatalogError, check_source, parse_model
from llmgw.control.fleet import LOST, STATES, UNREACHABLE, Fleet, FleetError
from llmgw.control.loop import ReconcileReport
from llmgw.control.reconciler import Replicas
from llmgw.egress import Egress

NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
STOP_WAIT = 5.0  # seconds a node removed by force has to say it is stopping a replica
WEIGHTS_WAIT = 10.0  # seconds a node has to list its weights directory (or remove from it)
LOG_LINES = 2000  # lines one logs answer holds at most: what the agent keeps of its own


def ensure_token(keys_dir: str) -> str:
    """The admin API's token, made on first use and kept in KEYS_DIR/admin.token (apiguard.ensure_token)."""
    return apiguard.ensure_token(apiguard.token_path(keys_dir))


@dataclasses.dataclass(frozen=True)
class Access:
    """Who the admin API answers: requests with TOKEN (kept in TOKEN_FILE) that name an allowed Host."""

    token: str
    token_file: str
    hosts: apiguard.HostCheck

    @classmethod
    def from_config(cls, cfg: settings.Config) -> "Access":
        """The token (made on the first start) and the Host names from CFG."""
        return cls(ensure_token(cfg["controller.keys_dir"]),
                   os.path.abspath(apiguard.token_path(cfg["controller.keys_dir"])),
                   apiguard.HostCheck(cfg["controller.admin_listen"], cfg["controller.admin_names"],
                                      "controller.admin_names"))


def create_app(fleet: Fleet, engine: Engine, ring: KeyRing | None, controller_public: bytes | None,
               plaintext: bool, catalog: Catalog, replicas: Replicas, report: ReconcileReport, ask_node,
               access: Access, egress: Egress, gateway_ring: KeyRing | None = None, lease=None,
               scaler=None) -> Flask:
    """ASK_NODE(node_id, kind, fields, timeout) sends a request to a node and returns its reply (or None).
    SCALER (llmgw/control/autoscale.py) says what load scaling sees and decided.
    REPORT is what the controller's reconcile passes found, and how to ask for one now. EGRESS is where a
    model's source may be checked. LEASE (llmgw/control/lease.py) says whether this controller leads: a standby
    answers its status only."""
    app = Flask("llmgw.admin")

    def error(status: int, message: str):
        return jsonify({"error": message}), status

    @app.before_request
    def admitted():
        # The Host first: a request by a name that is not ours is refused whatever it carries, a right token too.
        refused = access.hosts.refusal(request.headers.get("Host"))
        if refused:
            return error(421, refused)
        if apiguard.bearer_matches(request.headers.get("Authorization"), access.token):
            if lease is None or request.path == "/api/v1/status" or lease.held():
                return None
            # A standby knows no node or replica, and a change made here would be lost on the leader's next pass.
            return error(503, f"this controller stands by; the leader is {lease.leader or 'not known yet'} (where "
                              "its agents connect): run llmgw ctl against the leader's admin API")
        if request.headers.get("Authorization"):
            message = (f"that is not this controller's admin token: use the one in {access.token_file} (on another "
                       "machine, set controller.admin_token = \"@/path/to/a/copy\" of it; it changes when the "
                       "file is removed and the controller restarts)")
        else:
            message = (f"the admin API wants its token: send Authorization: Bearer TOKEN. The controller keeps it in "
                       f"{access.token_file} (mode 0600), where llmgw ctl and the gateway's pages on its machine read "
                       "it; elsewhere, set controller.admin_token = \"@/path/to/a/copy\"")
        body, status = error(401, message)
        body.headers["WWW-Authenticate"] = 'Bearer realm="llmgw admin API"'
        return body, status

    @app.errorhandler(FleetError)
    def fleet_error(e):
        return error(409, str(e))

    @app.errorhandler(CatalogError)
    def catalog_error(e):
        return error(400, str(e))

    @app.errorhandler(CapacityError)
    def capacity_error(e):
        return error(400, str(e))

    def replica_rows() -> list[dict]:
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
                         "restart_reason": r.restart_reason})
        return rows

    @app.get("/api/v1/models")
    def models():
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

    @app.post("/api/v1/models")
    def add_model():
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

    @app.delete("/api/v1/models/<name>")
    def remove_model(name):
        catalog.remove(name)
        report.kick()
        return jsonify({"name": name, "removed": True})

    @app.post("/api/v1/models/<name>/scale")
    def scale(name):
        body = apiguard.json_body(request) or {}
        if not isinstance(body, dict):
            return error(400, 'send {"min": N, "max": N} (llmgw ctl model scale does)')
        model = catalog.scale(name, body.get("min"), body.get("max"))
        report.kick()
        return jsonify({"name": name, "min": model.min_replicas, "max": model.max_replicas})

    @app.put("/api/v1/models/<name>/capacity")
    def save_capacity(name):
        """A measurement of one replica (`llmgw ctl bench --save`), filed under the profile it runs; PUT, since
        measuring again replaces it."""
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

    @app.delete("/api/v1/models/<name>/capacity")
    def forget_capacity(name):
        profile = request.args.get("profile")
        dropped = catalog.forget_capacity(name, profile)
        if not dropped:
            what = f"profile {profile!r} of {name}" if profile else name
            return error(404, f"nothing was measured of {what}; `llmgw ctl capacity` lists what was")
        return jsonify({"model": name, "profile": profile, "forgotten": dropped})

    @app.get("/api/v1/capacity")
    def capacities():
        rows = [cap.to_dict(catalog.current_fingerprint(cap.model, cap.profile))
                for _, cap in sorted(catalog.capacities.items())]
        return jsonify({"capacities": rows})

    @app.get("/api/v1/models/<name>/placement")
    def explain_placement(name):
        model = catalog.models().get(name)
        if model is None:
            return error(404, f"no model {name!r}; `llmgw ctl models` lists them")
        return jsonify({"model": name, "nodes": placement.explain(model, fleet.describe(time.monotonic()),
                                                                   replicas.claims()),
                        "scaling": scaler.explain(name) if scaler is not None else None})

    @app.get("/api/v1/replicas")
    def replica_list():
        return jsonify({"replicas": replica_rows()})

    @app.get("/api/v1/nodes/<node_id>/logs")
    def logs(node_id):
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

    def weights_of(node_id: str, kind: str = "weights_request", fields: dict | None = None) -> dict:
        """NODE_ID's weights directory as `weightsview.annotate` shows it, after KIND (a listing, or a
        reclaim that answers with one); {"node", "error"} when the node does not answer."""
        reply = ask_node(node_id, kind, fields or {}, WEIGHTS_WAIT)
        if reply is None:
            return {"node": node_id, "error": f"{node_id} did not answer within {WEIGHTS_WAIT:.0f} s; `llmgw ctl "
                                              "nodes` shows when it was last heard"}
        sources = {name: m.sources() for name, m in catalog.models().items()}
        mine = [(r.shard_id, r.model) for r in replicas.snapshot() if r.node_id == node_id]
        return {**weightsview.annotate(node_id, reply, sources, mine),
                "removed": reply.get("removed"), "refused": reply.get("refused")}

    @app.get("/api/v1/weights")
    def weights():
        views = fleet.describe(time.monotonic())
        wanted = request.args.get("node")
        if wanted and wanted not in {n.node_id for n in views}:
            return error(404, f"no node {wanted!r}; `llmgw ctl nodes` lists them")
        asked = [n for n in views if not wanted or n.node_id == wanted]
        silent = {n.node_id for n in asked if n.state in (UNREACHABLE, LOST)}
        with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
            # Every node at once: one that does not answer costs its WEIGHTS_WAIT once, not once per node.
            listed = dict(zip([n.node_id for n in asked if n.node_id not in silent],
                              pool.map(weights_of, [n.node_id for n in asked if n.node_id not in silent])))
        out = []
        for n in asked:
            out.append(listed.get(n.node_id) or {"node": n.node_id, "error": f"{n.node_id} is {n.state}: what it "
                                                 "holds is known once it is heard again"})
        return jsonify({"nodes": [{k: v for k, v in n.items() if k not in ("removed", "refused")} for n in out]})

    @app.post("/api/v1/nodes/<node_id>/weights/reclaim")
    def reclaim(node_id):
        body = apiguard.json_body(request)
        names = body.get("names") if isinstance(body, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            return error(400, 'send {"names": [...]}: entries `llmgw ctl weights NODE` lists as reclaimable')
        if node_id not in {n.node_id for n in fleet.describe(time.monotonic())}:
            return error(404, f"no node {node_id!r}; `llmgw ctl nodes` lists them")
        # Checked against what the node holds now, not what it held when the operator looked: the node is
        # only ever told names it has just listed, and only those nothing uses.
        now = weights_of(node_id)
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
            after = weights_of(node_id, "reclaim_weights", {"names": chosen})
            if "error" in after:
                return error(504, after["error"] + "; run `llmgw ctl weights` to see what was removed")
            removed = after["removed"] or []
            refused.update(after["refused"] or {})
        return jsonify({"node": node_id, "removed": removed, "refused": refused,
                        "freed_bytes": sum(entries[n]["bytes"] for n in removed if n in entries)})

    @app.get("/api/v1/status")
    def status():
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
                        # Whether a node may still bring back replicas placed before this controller led
                        # (llmgw/control/claims.py): while it does, a node late to register keeps its engines.
                        "adopting": role == "leader" and fleet.adopting(now)})

    @app.get("/api/v1/nodes")
    def nodes():
        return jsonify({"nodes": [n.to_dict() for n in fleet.describe(time.monotonic())]})

    @app.post("/api/v1/nodes/<node_id>/cordon")
    def cordon(node_id):
        fleet.set_cordon(node_id, True)
        _remember_cordon(engine, node_id, True)
        return jsonify({"node_id": node_id, "cordoned": True})

    @app.post("/api/v1/nodes/<node_id>/uncordon")
    def uncordon(node_id):
        fleet.set_cordon(node_id, False)
        _remember_cordon(engine, node_id, False)
        return jsonify({"node_id": node_id, "cordoned": False})

    @app.post("/api/v1/nodes/<node_id>/drain")
    def drain(node_id):
        fleet.drain(node_id)
        _remember_cordon(engine, node_id, True)
        return jsonify({"node_id": node_id, "draining": True})

    @app.delete("/api/v1/nodes/<node_id>")
    def remove(node_id):
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
        revoked = curvekeys.revoke_node_key(engine, node_id)
        ring.replace(curvekeys.authorised_keys(engine))
        return revoked

    @app.delete("/api/v1/node-keys/<node_id>")
    def revoke_key(node_id):
        if ring is None:
            return error(409, "this controller runs with controller.plaintext: agents use no keys")
        if not revoke(node_id):
            return error(404, f"no key is issued to {node_id!r}; `llmgw ctl nodes` lists the nodes")
        return jsonify({"node_id": node_id, "revoked": True})

    def issue(kind: str, field: str, example: str, key_ring: KeyRing | None, issue_key, issued, key_file):
        """Issue a key for the name in the body's FIELD and let the ring admit it at once."""
        body = apiguard.json_body(request)
        name = body.get(field) if isinstance(body, dict) else None
        if not isinstance(name, str) or not NODE_ID.match(name):
            return error(400, f"{field} must be a name of letters, digits, '.', '_' or '-', such as {example}")
        if key_ring is None:
            return error(409, f"this controller runs with controller.plaintext: {kind}s use no keys")
        public, secret = issue_key(engine, name)
        key_ring.replace(issued(engine))
        return jsonify({field: name, "key_file": key_file(name, public, secret, controller_public)})

    @app.post("/api/v1/node-keys")
    def issue_key():
        return issue("agent", "node_id", "gpu-01", ring, curvekeys.issue_node_key, curvekeys.authorised_keys,
                     keyfiles.node_key_file)

    @app.post("/api/v1/gateway-keys")
    def issue_gateway_key():
        return issue("gateway", "name", "gw-01", gateway_ring, curvekeys.issue_gateway_key, curvekeys.gateway_keys,
                     keyfiles.gateway_key_file)

    return app


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
