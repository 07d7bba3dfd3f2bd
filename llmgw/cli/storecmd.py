"""`llmgw store move`: the store copied into another database, a line per table, and checked.

The copy itself is llmgw/storemove.py's; this is the command around it: reading the two URLs as store.url
is read (`@/path` for one kept in a file), refusing a SQLite source that does not exist rather than making
an empty one, and saying what to do next.
"""

from __future__ import annotations

import os
import time

import click

from llmgw import settings, store, storemove


def _url(value: str, flag: str) -> str:
    try:
        return settings.normalise_store_url(settings.coerce("store.url", value, f"flag {flag}"))
    except settings.ConfigError as e:
        raise click.BadParameter(str(e), param_hint=flag) from None


@click.group("store")
def store_cli():
    """The store: move it to another database."""


@store_cli.command("move")
@click.option("--from", "source", required=True, metavar="URL",
              help="The store to copy: a database URL, or @/path to a file holding one.")
@click.option("--to", "target", required=True, metavar="URL",
              help="An empty database to copy it into (URL or @/path); its schema is made first.")
@click.option("--force", is_flag=True,
              help="Move although gateways marked the source as in use: for gateways that were killed, not stopped.")
def move(source, target, force):
    """Copy every row of the store into an empty database, and check the copy.

    Stop every controller and gateway that uses the store first: the move refuses while one runs. The
    source is left as it was; afterwards set store.url to the new database in every configuration and
    start them again."""
    source, target = _url(source, "--from"), _url(target, "--to")
    if source.startswith("sqlite:///") and not os.path.exists(source[len("sqlite:///"):]):
        raise click.ClickException(f"there is no store at {os.path.abspath(source[len('sqlite:///'):])}: check --from")
    click.echo(f"moving {store.describe(source)} to {store.describe(target)}")
    started = time.monotonic()

    def progress(table: str, rows: int) -> None:
        click.echo(f"  {table:<24} {rows:>10} rows")

    try:
        copied = storemove.move(source, target, progress, force=force)
    except storemove.MoveRefused as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"moved {sum(copied.values())} rows in {time.monotonic() - started:.1f} s; every table's rows "
               "counted on both sides and the id sequences checked. The source is unchanged: set store.url to "
               f"{store.describe(target)} in every configuration, then start the controllers and gateways.")
