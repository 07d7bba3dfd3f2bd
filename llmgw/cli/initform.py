"""The questions `llmgw init` asks in a terminal, when it was not told who the administrator is (`--admin`)
and not told to ask nothing (`--plain`).

Plain line prompts, one per choice, each with the answer a bare Enter takes: no full-screen form, nothing
that asks the terminal anything. The Go version's form asked the terminal for its colours and, in a
pseudo-terminal that never answered (an SSH session through some jump hosts, a CI runner), lost the
keystrokes typed meanwhile (lesson 58); a line prompt reads what was typed ahead, in order. At the end it
prints the same install as one `llmgw init --plain ...` command, to keep or to run on the next machine.
"""

from __future__ import annotations

import shlex
import socket
import sys
from dataclasses import dataclass, replace

import click

from llmgw import store as stores
from llmgw.cli import initmirror, starter

POSTGRES = ("postgresql://", "postgres://", "postgresql+psycopg2://")


@dataclass(frozen=True)
class Choices:
    admin: str
    address: str | None
    postgres: str | None  # None: SQLite; "local": a new database on this machine's PostgreSQL; else its address
    mirror: str | None  # None: beside the control plane; "none"; else another machine's management API
    mirror_token: str | None
    mirror_named: bool  # --mirror or --no-mirror given (or answered), rather than kept from the configuration
    node: bool
    model: bool
    admin_chosen: bool  # --admin given or answered, rather than the default

    def command(self, extra: dict) -> str:
        """This install as options of `llmgw init`, with EXTRA (option -> value, True for a flag, None when not
        given) that were not asked about, to run it again without the questions."""
        words = ["llmgw", "init", "--plain", "--admin", self.admin]
        if self.address:
            words += ["--address", self.address]
        if self.postgres:
            words += ["--postgres", self.postgres]
        if self.mirror == initmirror.NONE:
            words.append("--no-mirror")
        elif self.mirror:
            words += ["--mirror", self.mirror, "--mirror-token", self.mirror_token or "FILE"]
        words += [] if self.node else ["--no-node"]
        words += [] if self.model or self.mirror == initmirror.NONE else ["--no-model"]
        for option, value in extra.items():
            words += [option] if value is True else [option, value] if value else []
        # A password in a PostgreSQL address stays out of terminal history: it is shown as ***.
        return " ".join(shlex.quote(stores.describe(w) if w.startswith(POSTGRES) else w) for w in words)


def wanted() -> bool:
    """Whether a person is at a terminal to answer."""
    return sys.stdin.isatty() and sys.stdout.isatty()


def _addresses() -> list[str]:
    """This machine's addresses other machines might reach it at, as its own name resolves them."""
    try:
        found = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return []
    return sorted(a for a in found if not a.startswith("127.") and a != "::1")


def _email(value: str) -> str:
    value = value.strip()
    if "@" not in value or " " in value or len(value) > 254:
        raise click.BadParameter("an email address, such as you@example.org")
    return value


def _store(value: str) -> str:
    value = value.strip()
    if value in ("sqlite", "local") or value.startswith(POSTGRES):
        return value
    raise click.BadParameter("sqlite, local, or an address such as postgresql://llmgw:PASSWORD@HOST/llmgw")


def _mirror(value: str) -> str:
    value = value.strip()
    if value in ("here", initmirror.NONE) or value.startswith(("http://", "https://")):
        return value
    raise click.BadParameter("here, none, or the mirror's management address, such as http://models.internal:8082")


def ask(given: Choices, extra: dict) -> Choices:
    """The person's choices, each question offering what GIVEN (the options on the command line) says; EXTRA
    are the options not asked about, for the command it prints (Choices.command)."""
    click.echo("llmgw init: this machine becomes a cluster's control plane. Enter keeps the answer in [brackets].\n")
    admin = click.prompt("The first administrator's email", default=given.admin, value_proc=_email)
    seen = _addresses()
    address = click.prompt("The name or address other machines reach this one at"
                           + (f" (its addresses: {', '.join(seen)})" if seen else ""),
                           default=given.address or socket.getfqdn()).strip()
    given_store = given.postgres or "sqlite"
    store = click.prompt("The store: sqlite (a file here), local (a new database on this machine's PostgreSQL), "
                         "or a postgresql:// address" + (f" [{stores.describe(given_store)}]" if given_store.startswith(
                             POSTGRES) else ""), default=given_store, show_default=not given_store.startswith(POSTGRES),
                         value_proc=_store)
    mirror = click.prompt("The model mirror: here (beside the control plane), none, or another machine's "
                          "management address (http://HOST:8082)", default=given.mirror or "here",
                          value_proc=_mirror)
    token = given.mirror_token
    if mirror.startswith("http"):
        token = click.prompt("That mirror's token: the path of a copy of its api.token (`llmgw mirror init` "
                             "there said where it is)", default=token or None,
                             type=click.Path(exists=True, dir_okay=False))
    node = click.confirm("Make this machine a node too (an agent that runs engines)", default=given.node)
    model = mirror != initmirror.NONE and click.confirm(f"Serve the starter model ({starter.NAME})", default=given.model)
    chosen = replace(given, admin=admin, admin_chosen=True, address=address, postgres=None if store == "sqlite" else store,
                     mirror=None if mirror == "here" else mirror, mirror_token=token, mirror_named=mirror != "here",
                     node=node, model=model)
    click.echo(f"\nThe same without these questions:\n  {chosen.command(extra)}\n")
    if not click.confirm("Go ahead", default=True):
        raise click.ClickException("nothing was done")
    return chosen
