"""The administration pages (administrators only) and an organisation's page for its managers.

- `/admin`: the cluster, problems first: nodes, models, replicas, refreshed in place; below, history
  charts from Prometheus (llmgw/web/history.py). Each node links to its page (llmgw/web/nodepages.py).
- `/admin/people`: the tree with its people and keys, and every action on them.
- `/admin/quotas`: limits in every scope with what binds there and where it comes from, prices,
  and the log of every change.
- `/admin/usage`: requests, tokens and spend over time by organisation, team, project or person.
- `/org`: what a manager may see of their organisation, read-only.

Every change is a plain HTML form with a CSRF token, posted and redirected, so the pages work
without JavaScript; the cluster page refreshes itself in place when script runs.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from urllib.parse import urlencode

import flask_login
from flask import Blueprint, abort, flash, redirect, render_template, request

from llmgw import rules
from llmgw.apiclient import ApiError, leader_client
from llmgw.gateway.worker import Runtime
from llmgw.people import accounts, directory, identities, keys, limits, memberships, orgtree, sessions, usagereport
from llmgw.web import budgets, forms, history, safety, svgchart
from llmgw.web.site import EXPIRED_FORM, Site, site

log = logging.getLogger("llmgw.adminpages")

SPANS = {"24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400, "90d": 90 * 86400}
METRICS = {"requests": 0, "tokens": 1, "spend": 2}
# What the gateway's own columns on the cluster page mean; shown under the table, where a phone shows no tooltips.
LEGEND = {
    "outstanding": "Requests this gateway worker has sent to the replica and not yet had answered.",
    "waiting": "Requests the engine has accepted but not yet started, as its own metrics say: above 0, it is full.",
    "kv": "How full the engine's KV cache is (the memory holding the text of requests it serves); near 100%, "
          "new requests wait.",
    "unknown": "Not known now: this gateway worker reads an engine's figures only while it routes requests to its "
               "model, or the engine does not publish this figure.",
}
# The groups a usage page shows one by one, busiest first; the rest are one line (by person: everyone who used it).
PAGE_LINES = 50
LIMIT_FIELDS = (("rpm", "Requests/min"), ("tpm", "Tokens/min"), ("budget", "Budget"), ("models", "Models"),
                ("band", "Band"))


def admin_only(view):
    """A view for administrators: others signed in get 403, and those not signed in the sign-in page."""
    @functools.wraps(view)
    @flask_login.login_required
    def wrapped(*args, **kwargs):
        if not flask_login.current_user.user.is_admin:
            abort(403)
        return view(*args, **kwargs)
    return wrapped


def require_token() -> None:
    """Refuse a posted form without this session's CSRF token."""
    if not site().form(forms.ActionForm, request.form).validate():
        abort(400, EXPIRED_FORM)


def _me() -> accounts.User:
    return flask_login.current_user.user


bp = Blueprint("admin", __name__)


# --- the cluster ---------------------------------------------------------------------------

@bp.get("/admin")
@admin_only
def cluster():
    view = _cluster_view(site().runtime, site().cfg)
    if request.args.get("partial"):
        return render_template("_cluster.html", **view)
    # Drawn once per load, outside what refreshes every five seconds: each drawing asks Prometheus.
    window = history.window_of(request.args.get("window"))
    return render_template("admin_cluster.html", history=history.charts(site().cfg["monitoring.prometheus"], window),
                           **view)


# --- people and the tree -------------------------------------------------------------------

@bp.get("/admin/people")
@admin_only
def people():
    """The tree with each place's first members and keys, and a page of accounts: bounded by what it shows, at
    any number of people and keys (llmgw/people/directory.py). A team's projects past SHOWN_PROJECTS are one
    click away (`?team=ID`)."""
    q = search_text(request.args.get("q", ""))
    after = request.args.get("after", "")[:320]
    whole_team = request.args.get("team", "")
    with site().engine.connect() as conn:
        tree = orgtree.Tree.read(conn)
        shown, hidden = _shown_projects(tree, whole_team)
        places = {n.id for n in tree.of_kind("org") + tree.of_kind("team")} | {p.id for p in shown}
        members = directory.first_members(conn, places)
        keys_of = directory.first_keys(conn, {p.id for p in shown}, time.time())
        page, total, next_after = directory.accounts_page(conn, q, after)
        people_named = {row.user_id for s in (*members.values(), *keys_of.values()) for row in s.items}
        emails = directory.emails_of(conn, people_named)
        active = directory.emails_in_state(conn, accounts.ACTIVE, LISTED)
    ids = {u.id for u in page}
    everywhere = tree.of_kind("org") + tree.of_kind("team") + tree.of_kind("project")
    return render_template("admin_people.html", tree=tree, members=members, keys=keys_of, emails=emails,
                           shown_projects={p.id for p in shown}, hidden=hidden,
                           pending=accounts.list_users(site().engine, accounts.PENDING), accounts=page, q=q,
                           total=total, after=after, next_after=next_after,
                           signed_in_count=sessions.count(site().engine, ids),
                           identities=identities.of_everyone(site().engine, ids),
                           labels={name: p.label for name, p in site().providers.items()},
                           action=site().form(forms.ActionForm),
                           places=everywhere if len(everywhere) <= LISTED else [],
                           active_emails=active or [])


# Places and people offered as choices while there are no more than this; past it, they are typed (a path, an
# email), since a list of ten thousand on every row made the page megabytes.
LISTED = 500
SHOWN_PROJECTS = 50  # projects shown in the tree; a team's beyond it one click away
SHOWN_LIMITS = 200  # people's and keys' own limits shown on the quotas page; the rest counted


def _shown_projects(tree: orgtree.Tree, whole_team: str) -> tuple[list, dict[str, int]]:
    """The projects the tree shows, and how many each team hides: every project of WHOLE_TEAM, else SHOWN_PROJECTS
    in all, teams in the tree's order, each team's by name (a team past the budget shows none, and a link)."""
    shown, hidden = [], {}
    left = SHOWN_PROJECTS
    for org in tree.of_kind("org"):
        for team in sorted(tree.children.get(org.id, []), key=lambda n: n.name.lower()):
            projects = sorted(tree.children.get(team.id, []), key=lambda p: p.name.lower())
            cut = len(projects) if team.id == whole_team else 0 if whole_team else max(left, 0)
            shown += projects[:cut]
            left -= len(projects[:cut])
            if len(projects) > cut:
                hidden[team.id] = len(projects) - cut
    return shown, hidden


@bp.post("/admin/people")
@admin_only
def people_action():
    require_token()
    f = request.form
    do = f.get("do", "")
    q = search_text(f.get("q", ""))
    try:
        message = _people_action(site().engine, do, f)
    except (accounts.AccountError, orgtree.TreeError, keys.KeyRefused, identities.LinkError) as e:
        flash(Site.sentence(e), "problem")
    except KeyError as e:
        flash(f"The form lacks {e}.", "problem")
    else:
        flash(message, "done")
        log.info("%s: %s", _me().email, message)
    return redirect("/admin/people" + (f"?{urlencode({'q': q})}" if q else ""))


@bp.post("/admin/people/key")
@admin_only
def people_key():
    """An operator's key in a project (for a person, or nobody), shown once here or as a claim link.
    Answered as a page, never through a redirect: a secret must not travel in the session cookie."""
    require_token()
    f = request.form
    try:
        owner = accounts.find(site().engine, f["for"]).id if f.get("for") else None
        lifetime = keys.parse_duration(f["expires"]) if f.get("expires") else None
        record, secret = keys.create_key(site().engine, f.get("name", ""), f.get("project") or None, lifetime,
                                         user_id=owner)
    except (accounts.AccountError, keys.KeyRefused, ValueError) as e:
        flash(Site.sentence(e), "problem")
        return redirect("/admin/people")
    log.info("%s made the key %s (%s) in %s", _me().email, record.name, record.id, record.project)
    link = None
    if f.get("claim"):
        link = request.host_url.rstrip("/") + "/claim/" + keys.make_claim(site().engine, record.id, secret)
        secret = None
    safety.no_store()
    return render_template("admin_key.html", record=record, secret=secret, link=link)


# --- quotas --------------------------------------------------------------------------------

@bp.get("/admin/quotas")
@admin_only
def quotas():
    edit = request.args.get("edit")
    if edit and safety.has_control_characters(edit):
        # Looked up in the store: PostgreSQL refuses a NUL in a string, which answered 500.
        abort(400, "What to edit cannot contain control characters.")
    return render_template("admin_quotas.html", **_quotas_view(site().runtime, edit),
                           action=site().form(forms.ActionForm))


@bp.post("/admin/quotas")
@admin_only
def quotas_action():
    require_token()
    f = request.form
    try:
        if f.get("do") == "price":
            limits.set_price(site().engine, f["model"].strip(), f.get("input") or "0", f.get("output") or "0",
                             _me().email)
            flash(f"Price of {f['model'].strip()} set.", "done")
        else:
            scope, scope_id = f["scope"], f.get("id", "")
            if scope not in rules.SCOPES:
                abort(400, "No such scope.")
            changes = _limit_changes(f)
            limits.set_limits(site().engine, scope, scope_id, _me().email, **changes)
            flash("Limits saved. Gateways apply them within a few seconds.", "done")
    except (rules.LimitError, ValueError) as e:
        flash(Site.sentence(e), "problem")
        return redirect(_quota_form(f.get("scope", ""), f.get("id", "")))
    return redirect("/admin/quotas")


# --- usage ---------------------------------------------------------------------------------

@bp.get("/admin/usage")
@admin_only
def usage():
    return render_template("admin_usage.html", **_usage_view(site().engine, request.args, None,
                                                             ("org", "team", "project", "person", "model")))


@bp.get("/org")
@flask_login.login_required
def org_page():
    with site().engine.connect() as conn:
        mine = memberships.managed_orgs(conn, _me().id)
        tree = orgtree.Tree.read(conn)
        ruleset = limits.read_rules(conn)
        rows = memberships.all_memberships(conn)
    allowed = [tree.by_id[o] for o in (mine if not _me().is_admin else [n.id for n in tree.of_kind("org")])
               if o in tree.by_id]
    if not allowed:
        abort(403)
    chosen = next((o for o in allowed if o.id == request.args.get("org")), allowed[0])
    projects = tree.projects_under(chosen.id)
    view = _usage_view(site().engine, request.args, {p.id for p in projects}, ("team", "project", "person"))
    inside = {n.id for n in tree.by_id.values() if n.path.split("/")[0] == chosen.path}
    emails = {u.id: u.email for u in accounts.list_users(site().engine)}
    people_here = sorted({(emails.get(m.user_id, m.user_id), m.role) for m in rows if m.scope_id in inside})
    names = {f"{n.kind}:{n.id}": n.path for n in tree.by_id.values()}
    parts = [n for n in tree.of_kind("team") + tree.of_kind("project") if n.id in inside]
    table = [(n, rules.effective(ruleset, n.kind, n.id, names), _spent(site().runtime, n, ruleset)) for n in parts]
    return render_template("org.html", org=chosen, orgs=allowed, parts=table, people=people_here, **view)


def search_text(text: str) -> str:
    """A search as typed; one with line breaks or other control characters is refused (it once went into a
    redirect's Location header and answered 500)."""
    if safety.has_control_characters(text):
        abort(400, "A search cannot contain line breaks or other control characters.")
    return text.strip().lower()


def _people_action(engine, do: str, f) -> str:
    if do == "end-sessions":
        user, ended = accounts.end_sessions(engine, f["user"])
        return f"Ended {ended} session{'' if ended == 1 else 's'} of {user.email}; they sign in again."
    if do in ("approve", "reject", "suspend", "reinstate", "promote", "demote", "remove"):
        who = f["user"]
        if do == "approve":
            # The project first: a typo must leave the sign-up waiting, not approve it on its own.
            project = orgtree.Tree.load(engine).find("project", f["project"]) if f.get("project") else None
            user = accounts.approve(engine, who, _me().email)
            if project is not None:
                memberships.join(engine, user.id, "project", project.id)
                return f"Approved {user.email} into {project.path}."
            return f"Approved {user.email}, on their own."
        run = {"reject": accounts.reject, "suspend": accounts.suspend, "reinstate": accounts.reinstate,
               "promote": accounts.promote, "demote": lambda e, w: accounts.promote(e, w, admin=False),
               "remove": accounts.remove}[do]
        user = run(engine, who)
        return {"reject": f"Rejected the sign-up of {user.email}.", "suspend": f"Suspended {user.email}.",
                "reinstate": f"Reinstated {user.email}.", "promote": f"{user.email} is an administrator.",
                "demote": f"{user.email} is no longer an administrator.",
                "remove": f"Removed {user.email} and revoked their keys."}[do]
    if do == "link":
        user = identities.confirm_link(engine, f["user"], f["provider"], f.get("subject") or None)
        return f"Linked {user.email} to their sign-in through {f['provider']}; they can sign in with it now."
    if do == "join":
        kind, node_id = _place(engine, f["place"])
        user, membership = memberships.join(engine, f["user"], kind, node_id, f.get("role") or memberships.MEMBER)
        return f"{user.email} is a {membership.role} of {membership.path}."
    if do == "leave":
        membership, revoked = memberships.leave(engine, f["user"], f["kind"], f["node"])
        return f"Left {membership.path}; {revoked} key(s) revoked."
    if do == "revoke":
        record = keys.revoke_key(engine, f["key"])
        return f"Revoked the key {record.name} ({record.prefix}…)."
    if do == "add":
        node = orgtree.add(engine, f["kind"], f["name"], f.get("parent") or None)
        return f"Added {node.path}."
    if do == "rename":
        node = orgtree.rename(engine, f["kind"], f["node"], f["name"])
        return f"Renamed to {node.path}."
    if do == "move":
        node = orgtree.move(engine, f["kind"], f["node"], f["to"])
        return f"Moved to {node.path}."
    if do == "remove-node":
        node = orgtree.remove(engine, f["kind"], f["node"])
        return f"Removed {node.path}."
    raise orgtree.TreeError("that is not an action this page knows")


def _place(engine, text: str) -> tuple[str, str]:
    """(kind, id) of the place typed as TEXT: a path's depth says its kind; a bare name or id may be any kind,
    organisations first."""
    tree = orgtree.Tree.load(engine)
    text = text.strip().strip("/")
    kinds = (orgtree.KINDS[min(text.count("/"), 2)],) if "/" in text else orgtree.KINDS
    for kind in kinds:
        try:
            return kind, tree.find(kind, text).id
        except orgtree.TreeError as e:
            refused = e
    raise refused


def _quota_form(scope: str, scope_id: str) -> str:
    """The quotas page with SCOPE/SCOPE_ID's form open, to correct what was refused there (never wherever the
    Referer points). The id is quoted: posted with a line break, it once broke the Location header (a 500)."""
    if scope not in rules.SCOPES:
        return "/admin/quotas"
    return "/admin/quotas?" + urlencode({"edit": f"{scope}:{scope_id}"}, safe=":")


def _limit_changes(f) -> dict:
    changes: dict = {}
    for name in ("rpm", "tpm"):
        text = f.get(name, "").strip()
        changes[name] = rules.parse_count(name, text) if text else None
    budget = f.get("budget", "").strip()
    changes["budget"] = rules.parse_money(budget, "the budget") if budget else None
    # A period without a budget would keep the scope's limits row alive with nothing in it to limit.
    changes["period"] = (f.get("period") or None) if budget else None
    models = [m.strip() for m in f.get("models", "").split(",") if m.strip()]
    changes["models"] = models or None
    changes["band"] = f.get("band") or None
    return changes


def _spent(runtime: Runtime, node, ruleset) -> tuple[int, int] | None:
    """(spent, budget) of NODE's own budget pool, when it has one and the accountant answers."""
    own = ruleset.limits.get((node.kind, node.id))
    if own is None or own.budget is None:
        return None
    level = rules.Level(rules.counter(node.kind, node.id), None, None, own.budget, own.period or "month",
                        ruleset.tree_home(node.kind, node.id))
    used = budgets.spent(runtime, level)
    return None if used is None else (used, own.budget)


def _quotas_view(runtime: Runtime, edit: str | None) -> dict:
    engine = runtime.engine
    edit_scope, _, edit_id = (edit or "").partition(":")
    with engine.connect() as conn:
        tree = orgtree.Tree.read(conn)
        # People's and keys' own limits can be a million: the first SHOWN_LIMITS, and how many more, and only
        # those read (reading every one took 6 s at a million keys).
        others, below = limits.first_below(conn, SHOWN_LIMITS)
        log_rows = limits.changes_log(conn)
        named = {*others, *((r.scope, r.scope_id) for r in log_rows), (edit_scope, edit_id)}
        ruleset = limits.read_rules(conn, own=named)
        prices = limits.read_prices(conn)
        emails = directory.emails_of(conn, {sid for scope, sid in named if scope == "user"})
    shown_projects, hidden_projects = _shown_projects(tree, "")
    shown_ids = {p.id for p in shown_projects}
    hidden_others = below - len(others)
    key_names = {k.id: f"key {k.name} ({k.project})"
                 for k in keys.by_ids(engine, {sid for scope, sid in named if scope == "key"})}
    names = {f"{n.kind}:{n.id}": n.path for n in tree.by_id.values()}
    names.update({f"user:{i}": e for i, e in emails.items()})

    def describe(scope: str, scope_id: str) -> str:
        if scope == "cluster":
            return "Cluster defaults (keys nothing else limits)"
        if scope == "personal":
            off = ruleset.limits.get(("personal", ""), rules.Limits()).disabled
            return "Personal use, each person on their own" + (" (turned off)" if off else "")
        if scope.endswith("_member"):
            node = tree.by_id.get(scope_id)
            return f"each member of {node.path if node else scope_id}"
        if scope == "user":
            return emails.get(scope_id, scope_id)
        if scope == "key":
            return key_names.get(scope_id, scope_id)
        node = tree.by_id.get(scope_id)
        return node.path if node else scope_id

    rows = [("cluster", "", 0), ("personal", "", 0)]
    for org in tree.of_kind("org"):
        rows.append(("org", org.id, 0))
        for team in sorted(tree.children.get(org.id, []), key=lambda n: n.name.lower()):
            rows.append(("team", team.id, 1))
            for project in sorted(tree.children.get(team.id, []), key=lambda n: n.name.lower()):
                if project.id in shown_ids:
                    rows.append(("project", project.id, 2))
    rows += [(scope, sid, 0) for scope, sid in others]
    table = []
    for scope, sid, depth in rows:
        cells = rules.effective(ruleset, scope, sid, names)
        node = tree.by_id.get(sid)
        spent = _spent(runtime, node, ruleset) if node is not None else None
        table.append({"scope": scope, "id": sid, "name": describe(scope, sid), "depth": depth, "cells": cells,
                      "spent": spent})
    editing = None
    if edit:
        scope, _, sid = edit.partition(":")
        if scope in rules.SCOPES:
            editing = {"scope": scope, "id": sid, "name": describe(scope, sid),
                       "values": _form_values(ruleset.limits.get((scope, sid), rules.Limits())),
                       "inherited": _inherited(rules.effective(ruleset, scope, sid, names))}
    changes = [{"at": r.at, "who": r.who, "what": describe(r.scope, r.scope_id) if r.scope != "price" else
                f"price of {r.scope_id}", "field": r.field, "old": _shown(r.field, r.old), "new": _shown(r.field, r.new)}
               for r in log_rows]
    return {"rows": table, "hidden_projects": sum(hidden_projects.values()), "hidden_others": hidden_others,
            "fields": LIMIT_FIELDS, "editing": editing, "changes": changes, "prices": prices,
            "priced": prices.anything_priced(), "money": rules.show_money, "periods": rules.PERIODS,
            "bands": rules.BANDS, "nodes": tree.of_kind("org") + tree.of_kind("team") + tree.of_kind("project")}


def _form_values(own: rules.Limits) -> dict[str, str]:
    """The edit form's fields: the scope's own limits, written so that saving the form unchanged keeps them
    (a budget of 1,500 shown with its comma was refused when saved again). The period proposed is a
    month, as `llmgw limits set` assumes."""
    return {"rpm": "" if own.rpm is None else str(own.rpm), "tpm": "" if own.tpm is None else str(own.tpm),
            "budget": "" if own.budget is None else rules.show_money(own.budget).replace(",", ""),
            "period": own.period or "month", "models": ", ".join(own.models or ()), "band": own.band or ""}


def _inherited(cells: dict[str, rules.Cell]) -> dict[str, str]:
    """For each field set above this scope and not here: what binds when the field is left empty, and where
    it is set, as the field's placeholder."""
    shown = {"budget": rules.show_money, "models": ", ".join}
    return {name: f"{shown.get(name, str)(cell.value)} from {cell.source}" for name, cell in cells.items()
            if cell.own is None and cell.value is not None}


def _shown(field: str, value: str | None) -> str:
    if value is None:
        return "none"
    if field == "budget":
        return rules.show_money(int(json.loads(value)))
    if field == "disabled":
        return "turned off"
    if field == "price":
        a, _, b = value.partition("/")
        return f"{rules.show_money(int(a))} in, {rules.show_money(int(b))} out"
    loaded = json.loads(value)
    return ", ".join(loaded) if isinstance(loaded, list) else str(loaded)


def _usage_view(engine, args, project_ids: set[str] | None, choices: tuple[str, ...]) -> dict:
    by = args.get("by") if args.get("by") in choices else choices[0]
    span = args.get("since") if args.get("since") in SPANS else "7d"
    metric = args.get("metric") if args.get("metric") in METRICS else "requests"
    found = usagereport.report(engine, by, time.time() - SPANS[span], project_ids=project_ids, top=PAGE_LINES)
    index = METRICS[metric]
    groups = [(line.label, {b: figures[index] / (rules.MICROS if metric == "spend" else 1)
                            for b, figures in line.series.items()}) for line in found.lines]
    chart = svgchart.stacked_bars(found.buckets, groups, found.step, f"{metric} by {by}, last {span}")
    return {"report": found, "by": by, "since": span, "metric": metric, "chart": chart, "choices": choices,
            "spans": list(SPANS), "metrics": list(METRICS), "money": rules.show_money}


def _held_back(model: dict) -> str:
    """Why the controller could not place or start MODEL, in words: each node's reason, else the last failure.
    Empty when nothing held it back."""
    unplaced = model.get("unplaced") or {}
    if unplaced:
        return "; ".join(f"{node}: {reason}" for node, reason in sorted(unplaced.items()))
    return (model.get("last_failure") or {}).get("detail") or ""


def _why_not_more(model: dict) -> str:
    """The Models table's answer to why MODEL has no more replicas; a model at its maximum needs no reason
    beyond that, whatever the placer said about the nodes it did not use."""
    if model["replicas"] >= model["scaling"]["max"]:
        return f"At its maximum ({model['scaling']['max']})."
    return _held_back(model)


def _domains(node: dict) -> dict:
    """Each card's NVLink domain, as the node last said (a heartbeat's word over its registration's)."""
    said = [g for g in node["facts"].get("gpus") or [] if "index" in g] + \
        [g for g in node["status"].get("gpus") or [] if "index" in g and "nvlink_domain" in g]
    return {g["index"]: g.get("nvlink_domain") for g in said}


def _cluster_view(runtime: Runtime, cfg) -> dict:
    """Nodes, models and replicas from the controller's admin API, with this gateway's own view of each
    replica (its breaker, its load). Without a controller, only what the gateway routes to."""
    router = runtime.router
    # The engines' own figures only while fresh: a worker reads those of the models it routes to, so a
    # replica of a model it has not routed to lately keeps the last it read, perhaps hours ago.
    now, stale_after = time.monotonic(), cfg["routing.metrics_stale_after"]
    gateway_side = [{"id": s.spec.id, "url": s.spec.url, "models": ", ".join(s.spec.models),
                     "in_rotation": not s.breaker.is_open, "outstanding": s.outstanding,
                     "waiting": s.waiting if s.fresh(now, stale_after) else None,
                     "kv": s.kv_cache if s.fresh(now, stale_after) else None} for s in router.states.values()]
    view = {"gateway_replicas": gateway_side, "controller": None, "problem": None, "nodes": [], "models": [],
            "replicas": [], "fabric_nodes": [], "nvlink_nodes": []}
    if cfg["gateway.controller"]:
        admin = leader_client(cfg, cfg["gateway.controller_admin"])
        try:
            view["nodes"] = admin.call("GET", "/api/v1/nodes", timeout=2)["nodes"]
            view["models"] = admin.call("GET", "/api/v1/models", timeout=2)["models"]
            view["replicas"] = admin.call("GET", "/api/v1/replicas", timeout=2)["replicas"]
            view["controller"] = admin.url
        except (ApiError, KeyError) as e:
            view["problem"] = f"The cluster cannot be shown: {e}"
    problems = []
    for node in view["nodes"]:
        if node["state"] in ("unreachable", "lost"):
            problems.append(f"Node {node['node_id']} is {node['state']} (last heard {node['last_heard_s']:.0f} s ago).")
        checkup = node["facts"].get("doctor") or {}
        for finding in checkup.get("failures", []) + checkup.get("warnings", []):
            problems.append(f"Node {node['node_id']}: {finding['message']} (→ {finding['fix']})" if finding.get("fix")
                            else f"Node {node['node_id']}: {finding['message']}")
        # An engine install that failed (llmgw/node/installer.py) keeps the node from serving that engine.
        installs = node["status"].get("installs", node["facts"].get("installs")) or {}
        for key, install in sorted(installs.items()):
            if install.get("state") == "failed":
                problems.append(f"Node {node['node_id']}: installing engine {key} failed: {install.get('detail')} "
                                f"(→ {install.get('fix')})")
    for node in view["nodes"]:
        for said in node["status"].get("fabric_problems", node["facts"].get("fabric_problems")) or []:
            problems.append(f"Node {node['node_id']}: {said}.")
    view["fabric_nodes"] = sorted(n["node_id"] for n in view["nodes"]
                                  if n["status"].get("fabrics", n["facts"].get("fabrics")))
    view["nvlink_nodes"] = sorted(n["node_id"] for n in view["nodes"] if any(_domains(n).values()))
    for model in view["models"]:
        model["why_not_more"] = _why_not_more(model)
        if model["scaling"]["min"] > 0 and not model["ready"]:
            detail = _held_back(model) or "no replica is ready"
            problems.append(f"Model {model['name']} is not serving: {detail.rstrip('.')}.")
    for replica in gateway_side:
        if not replica["in_rotation"]:
            problems.append(f"Replica {replica['id']} is out of rotation: its last requests failed.")
    view["problems"] = problems
    view["checked_at"] = time.strftime("%H:%M:%S UTC", time.gmtime())
    view["legend"] = LEGEND
    return view

