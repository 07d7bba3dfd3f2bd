"""`llmgw users`: accounts from a shell, for the people who run the cluster."""

from __future__ import annotations

import json
import time

import click

from llmgw import accounts
from llmgw.tables import print_table


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
    found = accounts.list_users(obj.engine(), accounts.PENDING if pending else None)
    if as_json:
        for u in found:
            click.echo(json.dumps({"id": u.id, "email": u.email, "state": u.state, "admin": u.is_admin,
                                   "created_at": u.created_at}))
        return
    if not found:
        click.echo("no accounts" + (" waiting for approval" if pending else ""), err=True)
        return
    rows = [("ID", "EMAIL", "STATE", "ADMIN", "SIGNED UP")]
    rows += [(u.id, u.email, u.state, "yes" if u.is_admin else "", time.strftime("%Y-%m-%d", time.gmtime(u.created_at)))
             for u in found]
    print_table(rows)


@users.command("create")
@click.argument("email")
@click.option("--admin", is_flag=True, help="An administrator.")
@click.password_option(help="Asked for when not given (read from standard input when it is not a terminal).")
@click.pass_obj
def users_create(obj, email, admin, password):
    """Make an active account for EMAIL."""
    try:
        user = accounts.create_user(obj.engine(), email, password, state=accounts.ACTIVE, is_admin=admin)
    except accounts.AccountError as e:
        _fail(e)
    click.echo(f"created {user.email} ({user.id}){', an administrator' if admin else ''}", err=True)


def _action(name: str, verb: str, run):
    @users.command(name)
    @click.argument("who")
    @click.pass_obj
    def command(obj, who):
        try:
            user = run(obj.engine(), who)
        except accounts.AccountError as e:
            _fail(e)
        click.echo(f"{verb} {user.email}", err=True)

    command.__doc__ = f"{verb.capitalize()} the account WHO (an id or an email)."
    return command


_action("approve", "approved", accounts.approve)
_action("suspend", "suspended", accounts.suspend)
_action("reinstate", "reinstated", accounts.reinstate)
_action("promote", "made an administrator:", accounts.promote)
_action("demote", "no longer an administrator:", lambda engine, who: accounts.promote(engine, who, admin=False))
_action("remove", "removed (and revoked the keys of)", accounts.remove)
