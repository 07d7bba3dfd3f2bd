"""`llmgw users`: accounts from a shell, for the people who run the cluster."""

from __future__ import annotations

import json
import sys
import time

import click

from llmgw.cli.org import operator
from llmgw.cli.tables import print_table
from llmgw.people import accounts, identities, memberships
from llmgw.people.orgtree import Tree, TreeError


def _fail(e: Exception):
    raise click.ClickException(str(e)) from None


@click.group()
def users():
    """Accounts: create, approve, promote, suspend, reinstate, remove."""


@users.command("list")
@click.option("--pending", is_flag=True, help="Only sign-ups waiting for approval.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per account.")
@click.pass_obj
def users_list(obj, pending, as_json):
    """The accounts, oldest first."""
    engine = obj.engine()
    found = accounts.list_users(engine, accounts.PENDING if pending else None)
    with engine.connect() as conn:
        tree = Tree.read(conn)
        where = {u.id: [m.path + ("*" if m.role == memberships.MANAGER else "")
                        for m in memberships.of_user(conn, tree, u.id)] for u in found}
    linked = identities.of_everyone(engine)
    if as_json:
        for u in found:
            click.echo(json.dumps({"id": u.id, "email": u.email, "state": u.state, "admin": u.is_admin,
                                   "member_of": where[u.id], "created_at": u.created_at,
                                   "approved_by": u.approved_by, "approved_at": u.approved_at,
                                   "sign_ins": [{k: i[k] for k in ("provider", "subject", "confirmed")}
                                                for i in linked.get(u.id, [])]}))
        return
    if not found:
        click.echo("no accounts" + (" waiting for approval" if pending else ""), err=True)
        return
    rows = [("ID", "EMAIL", "STATE", "ADMIN", "MEMBER OF", "SIGNED UP", "APPROVED BY", "SIGNS IN WITH")]
    rows += [(u.id, u.email, u.state, "yes" if u.is_admin else "", ", ".join(where[u.id]) or "on their own",
              time.strftime("%Y-%m-%d", time.gmtime(u.created_at)), u.approved_by or "-",
              ", ".join(i["provider"] if i["confirmed"] else f"{i['provider']} (waits: --subject {i['subject']})"
                        for i in linked.get(u.id, [])) or "a password") for u in found]
    print_table(rows)


def _password(ctx, param, value: str | None) -> str:
    """The password: --password's value; else asked for twice at a terminal; else the first line of
    standard input. click's password_option asks twice wherever it is: with a pipe (`echo PW | llmgw users
    create ...`) getpass warned it could not hide the input, read the one line, and the second asking met
    the end of the input and aborted."""
    if value is not None:
        return value
    if sys.stdin.isatty():
        return click.prompt("Password", hide_input=True, confirmation_prompt=True, err=True)
    password = sys.stdin.readline().rstrip("\r\n")
    if not password:
        raise click.UsageError("no password came on standard input: pipe it as one line "
                               "(echo \"$PASSWORD\" | llmgw users create EMAIL), or run the command at a terminal "
                               "to be asked for it")
    return password


@users.command("create")
@click.argument("email")
@click.option("--admin", is_flag=True, help="An administrator.")
@click.option("--password", callback=_password,
              help="Asked for twice when not given at a terminal; otherwise the first line of standard input.")
@click.pass_obj
def users_create(obj, email, admin, password):
    """Make an active account for EMAIL."""
    try:
        user = accounts.create_user(obj.engine(), email, password, state=accounts.ACTIVE, is_admin=admin)
    except accounts.AccountError as e:
        _fail(e)
    click.echo(f"created {user.email} ({user.id}){', an administrator' if admin else ''}", err=True)


def _action(name: str, verb: str, run, help: str):
    # The help is given to click, not set as __doc__ afterwards: click reads the docstring when the
    # decorator runs, and six commands once showed no help at all.
    @users.command(name, help=f"{help}\n\nWHO is the account's id or email.")
    @click.argument("who")
    @click.pass_obj
    def command(obj, who):
        try:
            user = run(obj.engine(), who)
        except accounts.AccountError as e:
            _fail(e)
        click.echo(f"{verb} {user.email}", err=True)

    return command


@users.command("approve")
@click.argument("who")
@click.option("--project", help="Also make them a member of this project (id, path or unique name).")
@click.option("--by", metavar="NAME", help="Who approves, kept with the account (default: your login name).")
@click.pass_obj
def users_approve(obj, who, project, by):
    """Approve the sign-up WHO (an id or an email), on their own or straight into a project."""
    engine = obj.engine()
    try:
        user = accounts.approve(engine, who, by if by is not None else operator())
        if project:
            memberships.join(engine, user.id, "project", project)
    except (accounts.AccountError, TreeError) as e:
        _fail(e)
    click.echo(f"approved {user.email}" + (f", a member of {project}" if project else ", on their own"), err=True)


def _place(team, project, org):
    given = [(kind, value) for kind, value in (("org", org), ("team", team), ("project", project)) if value]
    if len(given) != 1:
        raise click.UsageError("say exactly one of --org, --team or --project")
    return given[0]


@users.command("join")
@click.argument("who")
@click.option("--org", help="An organisation (every project in it).")
@click.option("--team", help="A team, ORG/TEAM (every project in it).")
@click.option("--project", help="A project, ORG/TEAM/PROJECT.")
@click.option("--role", type=click.Choice([memberships.MEMBER, memberships.MANAGER]), default=memberships.MEMBER,
              show_default=True, help="A manager of an organisation sees its page (read-only).")
@click.pass_obj
def users_join(obj, who, org, team, project, role):
    """Make WHO a member of an organisation, team or project."""
    kind, which = _place(team, project, org)
    try:
        user, membership = memberships.join(obj.engine(), who, kind, which, role)
    except (accounts.AccountError, TreeError) as e:
        _fail(e)
    click.echo(f"{user.email} is a {role} of {membership.path}", err=True)


@users.command("leave")
@click.argument("who")
@click.option("--org", help="An organisation.")
@click.option("--team", help="A team.")
@click.option("--project", help="A project.")
@click.pass_obj
def users_leave(obj, who, org, team, project):
    """End WHO's membership; the keys they made in projects they can no longer reach are revoked."""
    kind, which = _place(team, project, org)
    try:
        membership, revoked = memberships.leave(obj.engine(), who, kind, which)
    except (accounts.AccountError, TreeError) as e:
        _fail(e)
    click.echo(f"left {membership.path}; {revoked} key(s) revoked", err=True)


_action("reject", "rejected (and deleted) the sign-up of", accounts.reject,
        "Turn down the sign-up WHO; the account is deleted.")
_action("suspend", "suspended", accounts.suspend,
        "Suspend WHO: no sign-in and no keys until reinstated.")
_action("reinstate", "reinstated", accounts.reinstate,
        "Reinstate the suspended WHO: sign-in and keys work again.")
_action("promote", "made an administrator:", accounts.promote,
        "Make WHO an administrator of the whole cluster.")
_action("demote", "no longer an administrator:", lambda engine, who: accounts.promote(engine, who, admin=False),
        "Make WHO no longer an administrator; the account stays.")
_action("remove", "removed (and revoked the keys of)", accounts.remove,
        "Delete the account WHO and revoke every key it holds.")


@users.command("end-sessions")
@click.argument("who")
@click.pass_obj
def users_end_sessions(obj, who):
    """Sign WHO (an id or an email) out everywhere: every session of theirs ends at once."""
    try:
        user, ended = accounts.end_sessions(obj.engine(), who)
    except accounts.AccountError as e:
        _fail(e)
    click.echo(f"ended {ended} session(s) of {user.email}", err=True)


@users.command("link")
@click.argument("who")
@click.option("--provider", required=True, help="The identity provider (`[[auth.oidc]]` name) they signed in with.")
@click.option("--subject", help="The provider's id for them, where several sign-ins wait (`llmgw users list` "
                                "shows them).")
@click.pass_obj
def users_link(obj, who, provider, subject):
    """Confirm that the sign-in through PROVIDER waiting to be linked to WHO's account is theirs.

    Asked for by a provider with `link_existing = "confirm"`: the first sign-in whose verified email has an
    account here waits for this. Make sure it is the same person (ask them) before you confirm."""
    try:
        user = identities.confirm_link(obj.engine(), who, provider, subject)
    except (accounts.AccountError, identities.LinkError) as e:
        _fail(e)
    click.echo(f"linked {user.email} to their sign-in through {provider}; they can sign in with it now", err=True)
