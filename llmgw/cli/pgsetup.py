"""`llmgw init --postgres local`: a role and a database for the store on this machine's PostgreSQL.

The role and the database are both `llmgw`; the role's password is made here and kept in the store's address,
in the configuration and in `store-dsn` beside it (both mode 0600). That file is written the moment the role
exists, so an init stopped after that point takes up the same role when run again. They are made through
`psql` as a superuser: by default the `postgres` system user over the server's local socket (what a Debian
or RHEL install allows its superuser), or the address `--postgres-admin` gives. The SQL goes to psql's
standard input, never its arguments, so the password is never on a command line others can read in `ps`.

A role that exists already is never taken over: its password is not ours to know or change, so init stops
and asks for that role's address instead. Installing PostgreSQL itself is the operator's (docs/operations.md).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess

import click
import sqlalchemy as sa

from llmgw import filemodes, store
from llmgw.cli.bringup import Steps

NAME = "llmgw"  # the role and the database
DEFAULT_HOST = "127.0.0.1:5432"


def _psql(admin: str | None, sql: str) -> str:
    """Run SQL through psql as the superuser ADMIN (an address), or as the `postgres` system user over the local
    socket when ADMIN is None; returns what it printed (unaligned, tuples only)."""
    if shutil.which("psql") is None:
        raise click.ClickException("psql is not installed here: install PostgreSQL's client (Debian: postgresql-"
                                   "client; RHEL: postgresql), or give the store's address with --postgres DSN")
    argv = ["psql", "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1"]
    if admin is None:
        argv = ["runuser", "-u", "postgres", "--", *argv, "-d", "postgres"]
    else:
        argv += ["-d", admin]
    try:
        ran = subprocess.run(argv, input=sql, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise click.ClickException(f"psql did not run: {e}") from None
    if ran.returncode != 0:
        who = f"at {store.describe(admin)}" if admin else "as the postgres system user over the local socket"
        raise click.ClickException(
            f"PostgreSQL {who} refused: {ran.stderr.strip() or ran.stdout.strip()}. Is it installed and running? "
            "Give a superuser's address with --postgres-admin postgresql://USER@HOST:PORT/postgres, or the "
            "store's own address with --postgres DSN.")
    return ran.stdout.strip()


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def store_url(admin: str | None, password: str) -> str:
    """The store's address: the role NAME on the host ADMIN names (this machine's port 5432 without one)."""
    host = DEFAULT_HOST
    if admin:
        url = sa.engine.make_url(admin)
        host = f"{url.host or '127.0.0.1'}:{url.port or 5432}"
    return f"postgresql+psycopg2://{NAME}:{password}@{host}/{NAME}"


def ensure_local(steps: Steps, admin: str | None, dsn_file: str) -> str | None:
    """The store's address on this machine's PostgreSQL: the one DSN_FILE keeps from an earlier run, else a role
    and a database made now. None when planning and there is none yet."""
    if os.path.exists(dsn_file):
        with open(dsn_file, encoding="utf-8") as f:
            url = f.read().strip()
        steps.kept(f"PostgreSQL role and database {NAME} ({store.describe(url)}, its address in {dsn_file})")
        return url
    where = store.describe(admin) if admin else "this machine's PostgreSQL"
    made: list[str] = []  # the address, kept out of what Steps says (it holds the password)
    steps.do(f"PostgreSQL role and database {NAME} on {where} (its address in {dsn_file}, mode 0600)",
             lambda: made.append(_create(admin, dsn_file)), how="create")
    return made[0] if made else None


def _create(admin: str | None, dsn_file: str) -> str:
    """Make the role and the database NAME with a new password, keep their address in DSN_FILE, check it answers,
    and return it. Refuses a role or database that exists: init would take over what another install made."""
    found = _psql(admin, f"SELECT 'role' FROM pg_roles WHERE rolname = {_literal(NAME)} "
                         f"UNION ALL SELECT 'database' FROM pg_database WHERE datname = {_literal(NAME)};")
    if found:
        raise click.ClickException(
            f"this PostgreSQL has a {' and a '.join(sorted(set(found.split())))} named {NAME} already, which this "
            f"configuration does not name: give its address with --postgres postgresql://{NAME}:PASSWORD@HOST/"
            f"{NAME}, or drop it first if nothing uses it")
    password = secrets.token_urlsafe(24)
    # CREATE DATABASE cannot run in a transaction block, so these are separate statements in autocommit.
    _psql(admin, f"CREATE ROLE {NAME} LOGIN PASSWORD {_literal(password)};\n"
                 f"CREATE DATABASE {NAME} OWNER {NAME};\n")
    url = store_url(admin, password)
    filemodes.write_private(dsn_file, url + "\n")
    engine = store.open_engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except sa.exc.SQLAlchemyError as e:
        raise click.ClickException(f"the new database does not answer at {store.describe(url)}: {e.orig or e}. "
                                   "Its pg_hba.conf must allow password logins (scram-sha-256 or md5) from "
                                   "this machine; then run init again, which takes up the same role.") from None
    finally:
        engine.dispose()
    return url
