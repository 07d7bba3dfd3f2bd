"""`llmgw org`, `llmgw limits` and `llmgw prices`: the tree, its limits and the price list from a shell."""

from __future__ import annotations

import getpass
import json
import os

import click

from llmgw import rules
from llmgw.cli.tables import print_table
from llmgw.people import accounts, limits, memberships, orgtree

KIND = click.Choice(orgtree.KINDS)


def _fail(e: Exception):
    raise click.ClickException(str(e)) from None


def operator() -> str:
    """Who a change from the shell is logged as: the person behind sudo where there is one, not root."""
    try:
        return f"{os.environ.get('SUDO_USER') or getpass.getuser()} (shell)"
    except (KeyError, OSError):  # a user id with no name (a container's): say where, not who
        return "shell"


@click.group()
def org():
    """Organisations, teams and projects: add, rename, move, remove, show."""


@org.command("add")
@click.argument("kind", type=KIND)
@click.argument("name")
@click.option("--in", "parent", metavar="PARENT", help="The organisation a team goes in, or the ORG/TEAM a project goes in.")
@click.pass_obj
def org_add(obj, kind, name, parent):
    """Add an organisation, a team (--in ORG) or a project (--in ORG/TEAM)."""
    try:
        node = orgtree.add(obj.engine(), kind, name, parent)
    except orgtree.TreeError as e:
        _fail(e)
    click.echo(f"added {kind} {node.path} ({node.id})", err=True)


@org.command("rename")
@click.argument("kind", type=KIND)
@click.argument("which")
@click.argument("new_name")
@click.pass_obj
def org_rename(obj, kind, which, new_name):
    """Rename the KIND WHICH (id, path or unique name) to NEW_NAME."""
    try:
        node = orgtree.rename(obj.engine(), kind, which, new_name)
    except orgtree.TreeError as e:
        _fail(e)
    click.echo(f"renamed: {node.path}", err=True)


@org.command("move")
@click.argument("kind", type=click.Choice(["team", "project"]))
@click.argument("which")
@click.option("--to", required=True, help="The organisation (for a team) or ORG/TEAM (for a project).")
@click.pass_obj
def org_move(obj, kind, which, to):
    """Move a team to another organisation or a project to another team; keys and limits go with it."""
    try:
        node = orgtree.move(obj.engine(), kind, which, to)
    except orgtree.TreeError as e:
        _fail(e)
    click.echo(f"moved: {node.path}", err=True)


@org.command("remove")
@click.argument("kind", type=KIND)
@click.argument("which")
@click.pass_obj
def org_remove(obj, kind, which):
    """Remove an empty KIND. A project that ever had a key is never removed; rename it instead."""
    try:
        node = orgtree.remove(obj.engine(), kind, which)
    except orgtree.TreeError as e:
        _fail(e)
    click.echo(f"removed {kind} {node.path}", err=True)


@org.command("tree")
@click.option("--people", is_flag=True, help="Show who belongs to each part (a star marks a manager).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per organisation, team or project.")
@click.pass_obj
def org_tree(obj, people, as_json):
    """The tree, organisations first, each with what is in it."""
    engine = obj.engine()
    with engine.connect() as conn:
        tree = orgtree.Tree.read(conn)
        members = memberships.all_memberships(conn) if people else []
    emails = {u.id: u.email for u in accounts.list_users(engine)} if people else {}
    by_scope: dict[str, list[str]] = {}
    for m in members:
        by_scope.setdefault(m.scope_id, []).append(emails.get(m.user_id, m.user_id) + ("*" if m.role == "manager" else ""))
    if as_json:
        for node in tree.of_kind("org") + tree.of_kind("team") + tree.of_kind("project"):
            click.echo(json.dumps({"kind": node.kind, "id": node.id, "path": node.path,
                                   **({"people": sorted(by_scope.get(node.id, []))} if people else {})}))
        return
    if not tree.by_id:
        click.echo("the tree is empty; start it with `llmgw org add org NAME`", err=True)
        return

    def show(node, depth):
        who = f"  [{', '.join(sorted(by_scope[node.id]))}]" if node.id in by_scope else ""
        click.echo(f"{'  ' * depth}{node.name}  ({node.kind} {node.id}){who}")
        for child in sorted(tree.children.get(node.id, []), key=lambda n: n.name.lower()):
            show(child, depth + 1)

    for top in tree.of_kind("org"):
        show(top, 0)


# --- limits ------------------------------------------------------------------------------------

def _scope_id(engine, scope: str, which: str | None) -> str:
    """The id a limit is stored under for SCOPE named WHICH."""
    if scope in ("cluster", "personal"):
        return ""
    if not which:
        raise click.UsageError(f"say which {scope}: --id ID, PATH or NAME")
    base = scope.removesuffix("_member")
    if base in orgtree.KINDS:
        return orgtree.Tree.load(engine).find(base, which).id
    if scope == "user":
        return accounts.find(engine, which).id
    from llmgw.people import keys as keymod

    found = keymod.named(engine, which)
    if len(found) != 1:
        raise click.ClickException(f"{len(found) or 'no'} keys match {which!r}; name the key by its id")
    return found[0].id


@click.group("limits")
def limits_cli():
    """Limits: requests and tokens a minute, budgets, model allowlists, admission bands."""


@limits_cli.command("set")
@click.option("--scope", required=True,
              type=click.Choice(rules.TREE_SCOPES + ("user", "key", "cluster", "personal")),
              help="What the limit is on; `cluster` sets the defaults for keys nothing else limits, `personal` "
              "each person's use on their own (keys of no project, the chat page), one pool a person.")
@click.option("--id", "which", help="The org, team or project (id, path or name), person (email) or key.")
@click.option("--per-member", is_flag=True, help="On an org, team or project: each member gets their own share.")
@click.option("--rpm", help="Requests a minute ('none' clears).")
@click.option("--tpm", help="Tokens a minute ('none' clears).")
@click.option("--budget", help="Spend per period in whole units, such as 50 or 0.25 ('none' clears).")
@click.option("--period", type=click.Choice(rules.PERIODS), help="The budget's period (month by default).")
@click.option("--models", help="Comma-separated allowlist of models ('none' clears: every model).")
@click.option("--band", type=click.Choice(rules.BANDS + ("none",)), help="Admission band when replicas are full.")
@click.option("--profile", help="The routing profile its requests go by, a gateway's [[routing_profiles]] entry "
              "('none' clears).")
@click.option("--disabled", type=click.Choice(["yes", "no"]),
              help="With --scope personal: yes turns personal use off, so people use the gateway only through "
              "their projects.")
@click.pass_obj
def limits_set(obj, scope, which, per_member, rpm, tpm, budget, period, models, band, profile, disabled):
    """Set (or with 'none' clear) limits on one scope. Unnamed limits are left as they are."""
    engine = obj.engine()
    if per_member:
        if scope not in rules.TREE_SCOPES:
            raise click.UsageError("--per-member applies to an org, team or project")
        scope = f"{scope}_member"
    changes: dict = {}
    try:
        for name, value in (("rpm", rpm), ("tpm", tpm)):
            if value is not None:
                changes[name] = None if value == "none" else rules.parse_count(f"--{name}", value)
        if budget is not None:
            changes["budget"] = None if budget == "none" else rules.parse_money(budget, "--budget")
        if period is not None:
            changes["period"] = period
        if models is not None:
            changes["models"] = None if models == "none" else [m for m in models.split(",") if m.strip()]
        if band is not None:
            changes["band"] = None if band == "none" else band
        if disabled is not None:
            changes["disabled"] = True if disabled == "yes" else None
        if profile is not None:
            changes["profile"] = None if profile == "none" else profile
        if not changes:
            raise click.UsageError("say what to set: --rpm, --tpm, --budget, --period, --models, --band, --profile "
                                   "or --disabled")
        after = limits.set_limits(engine, scope, _scope_id(engine, scope, which), operator(), **changes)
    except (rules.LimitError, orgtree.TreeError, accounts.AccountError) as e:
        _fail(e)
    click.echo(f"{scope} {which or ''}: {describe(after)}", err=True)
    if changes.get("profile"):
        note_unknown_profile(obj.config(), changes["profile"])
    with engine.connect() as conn:
        if after.budget is not None and not limits.read_prices(conn).anything_priced():
            click.echo("note: no model has a price, so every request costs nothing and this budget never binds; "
                       "set one with `llmgw prices set MODEL --input N --output N`", err=True)


def note_unknown_profile(cfg, name: str) -> None:
    """Say so where the configuration at hand defines routing profiles but not NAME: gateways without it route
    as if none were named. Not refused: profiles live in each gateway's file, which may not be this one."""
    known = [t["name"] for t in cfg.routing_profiles]
    if known and name not in known:
        click.echo(f"note: {cfg.source} defines no routing profile {name!r} (it has: {', '.join(known)}); a gateway "
                   "without it routes these requests as if none were named", err=True)


def describe(lim: rules.Limits) -> str:
    parts = []
    if lim.rpm is not None:
        parts.append(f"{lim.rpm} requests/min")
    if lim.tpm is not None:
        parts.append(f"{lim.tpm} tokens/min")
    if lim.budget is not None:
        parts.append(f"budget {rules.show_money(lim.budget)} a {lim.period or 'month'}")
    if lim.models is not None:
        parts.append("models " + (", ".join(lim.models) or "(none)"))
    if lim.band:
        parts.append(f"band {lim.band}")
    if lim.profile:
        parts.append(f"routing profile {lim.profile}")
    if lim.disabled:
        parts.append("turned off")
    return "; ".join(parts) or "no limits"


@limits_cli.command("show")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per scope with limits.")
@click.pass_obj
def limits_show(obj, as_json):
    """Every scope that sets a limit."""
    engine = obj.engine()
    with engine.connect() as conn:
        found = limits.read_all(conn)
        tree = orgtree.Tree.read(conn)
    emails = {u.id: u.email for u in accounts.list_users(engine)}

    def name(scope, sid):
        if scope in ("cluster", "personal"):
            return "(defaults)" if scope == "cluster" else "(each person on their own)"
        node = tree.by_id.get(sid)
        return node.path if node else emails.get(sid, sid)

    if as_json:
        for (scope, sid), lim in sorted(found.items()):
            click.echo(json.dumps({"scope": scope, "id": sid, "name": name(scope, sid), "rpm": lim.rpm, "tpm": lim.tpm,
                                   "budget_micros": lim.budget, "period": lim.period,
                                   "models": list(lim.models) if lim.models is not None else None, "band": lim.band,
                                   "disabled": bool(lim.disabled), "profile": lim.profile}))
        return
    if not found:
        click.echo("no limits are set; every key is unlimited", err=True)
        return
    rows = [("SCOPE", "WHO", "LIMITS")]
    rows += [(scope, name(scope, sid), describe(lim)) for (scope, sid), lim in sorted(found.items())]
    print_table(rows)


@click.group()
def prices():
    """What models cost, per million tokens in whole units; budgets bind only on priced models."""


@prices.command("set")
@click.argument("model")
@click.option("--input", "input_units", required=True, help="Price of a million prompt tokens, such as 0.5.")
@click.option("--output", "output_units", required=True, help="Price of a million completion tokens.")
@click.pass_obj
def prices_set(obj, model, input_units, output_units):
    """Price MODEL ('*' prices every model without its own price)."""
    try:
        price = limits.set_price(obj.engine(), model, input_units, output_units, operator())
    except rules.LimitError as e:
        _fail(e)
    click.echo(f"{model}: {rules.show_money(price.input)} in, {rules.show_money(price.output)} out "
               "per million tokens", err=True)


@prices.command("list")
@click.pass_obj
def prices_list(obj):
    """The price list."""
    with obj.engine().connect() as conn:
        found = limits.read_prices(conn)
    if not found.by_model:
        click.echo("no prices: every request costs nothing and budgets never bind", err=True)
        return
    rows = [("MODEL", "INPUT / 1M", "OUTPUT / 1M")]
    rows += [(m, rules.show_money(p.input), rules.show_money(p.output)) for m, p in sorted(found.by_model.items())]
    print_table(rows)
