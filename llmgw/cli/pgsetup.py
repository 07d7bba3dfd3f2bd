"""`llmgw init --postgres local`: a role and a database for the store on this machine's PostgreSQL.

The role and the database are both `llmgw`. The role's password is made here and kept in the store's
address, in `store-dsn` beside the configuration (mode 0600) and then in the configuration (0600). The
file is written before the role is made, so an init stopped at any point takes the same role and password
up when run again, making what is still missing.

They are made through `psql` as a superuser: by default the `postgres` system user over the server's
local socket (what Debian and RHEL allow their superuser; init must run as root for it), or the address
`--postgres-admin` gives, passed in libpq's environment variables rather than psql's arguments, which
other users of the machine can read in `ps`. The SQL goes on psql's input, and the role's password in it
only as a SCRAM-SHA-256 verifier, so it is in no server log even with `log_statement = 'ddl'`.

A role or database `llmgw` that no `store-dsn` here names is never taken over: its password is not ours to
know or change, so init stops and asks for that role's address instead. Installing PostgreSQL itself is
the operator's (docs/operations.md).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import shutil
import subprocess

import click
import sqlalchemy as sa

from llmgw import addresses, filemodes, store
from llmgw.cli.bringup import Steps

NAME = "llmgw"  # the role and the database
SCRAM_ITERATIONS = 4096  # PostgreSQL's own default for the verifiers it makes


def scram_verifier(password: str) -> str:
    """PASSWORD as PostgreSQL keeps it (`SCRAM-SHA-256$iterations:salt$StoredKey:ServerKey`, RFC 5803), which
    `CREATE ROLE ... PASSWORD` takes as it is: the server never sees the password itself."""
    salt = secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, SCRAM_ITERATIONS)
    stored = hashlib.sha256(hmac.new(salted, b"Client Key", hashlib.sha256).digest()).digest()
    server = hmac.new(salted, b"Server Key", hashlib.sha256).digest()
    b64 = lambda data: base64.b64encode(data).decode()  # noqa: E731
    return f"SCRAM-SHA-256${SCRAM_ITERATIONS}:{b64(salt)}${b64(stored)}:{b64(server)}"


def _psql(admin: str | None, sql: str) -> str:
    """Run SQL through psql as the superuser ADMIN (an address), or as the `postgres` system user over the local
    socket when ADMIN is None; returns what it printed (unaligned, tuples only)."""
    if shutil.which("psql") is None:
        raise click.ClickException("psql is not installed here: install PostgreSQL's client (Debian: postgresql-"
                                   "client; RHEL: postgresql), or give the store's address with --postgres DSN")
    argv = ["psql", "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    if admin is None:
        if os.getuid() != 0:
            raise click.ClickException("--postgres local makes the role as the postgres system user, which needs "
                                       "root: run init with sudo, or give a superuser's address with "
                                       "--postgres-admin postgresql://USER:PASSWORD@HOST:PORT/postgres")
        argv = ["runuser", "-u", "postgres", "--", *argv, "-d", "postgres"]
    else:
        url = sa.engine.make_url(admin)
        env.update({k: str(v) for k, v in (("PGHOST", url.host), ("PGPORT", url.port), ("PGUSER", url.username),
                                           ("PGPASSWORD", url.password), ("PGDATABASE", url.database or "postgres"))
                    if v})
    try:
        ran = subprocess.run(argv, input=sql, capture_output=True, text=True, timeout=60, env=env)
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
    host, port = "127.0.0.1", 5432
    if admin:
        url = sa.engine.make_url(admin)
        host, port = url.host or host, url.port or port
    return f"postgresql+psycopg2://{NAME}:{password}@{addresses.join(host, port)}/{NAME}"


def _found(admin: str | None) -> set[str]:
    """Which of the role and the database NAME the server has: a subset of {"role", "database"}."""
    return set(_psql(admin, f"SELECT 'role' FROM pg_roles WHERE rolname = {_literal(NAME)} UNION ALL "
                            f"SELECT 'database' FROM pg_database WHERE datname = {_literal(NAME)};").split())


def ensure_local(steps: Steps, admin: str | None, dsn_file: str) -> str | None:
    """The store's address on this machine's PostgreSQL, its role and database made where missing: the address
    DSN_FILE keeps from an earlier run, else a new one (refused where another install's role or database is in
    the way). None when planning and there is no address yet."""
    kept = os.path.exists(dsn_file)
    if kept:
        with open(dsn_file, encoding="utf-8") as f:
            url = f.read().strip()
    where = store.describe(admin) if admin else "this machine's PostgreSQL"
    found = _found(admin)
    if kept and found == {"role", "database"}:
        steps.kept(f"PostgreSQL role and database {NAME} ({store.describe(url)}, its address in {dsn_file})")
        return url
    if not kept and found:
        raise click.ClickException(
            f"this PostgreSQL has a {' and a '.join(sorted(found))} named {NAME} already, which this machine's files "
            f"do not name: give its address with --postgres postgresql://{NAME}:PASSWORD@HOST/{NAME}, or drop it "
            "first if nothing uses it")
    made: list[str] = []  # the address, kept out of what Steps says: it holds the password

    def make() -> str:
        address = url if kept else store_url(admin, secrets.token_urlsafe(24))
        if not kept:
            filemodes.write_private(dsn_file, address + "\n")
        if "role" not in found:
            password = sa.engine.make_url(address).password or ""
            _psql(admin, f"CREATE ROLE {NAME} LOGIN PASSWORD {_literal(scram_verifier(password))};")
        if "database" not in found:  # CREATE DATABASE runs in no transaction: a statement of its own
            _psql(admin, f"CREATE DATABASE {NAME} OWNER {NAME};")
        _check(address)
        made.append(address)
        return "made " + " and ".join(sorted({"role", "database"} - found))

    steps.do(f"PostgreSQL role and database {NAME} on {where} (its address in {dsn_file}, mode 0600)", make,
             how="create")
    return made[0] if made else None


def _check(url: str) -> None:
    engine = store.open_engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except sa.exc.SQLAlchemyError as e:
        raise click.ClickException(f"the new database does not answer at {store.describe(url)}: {e.orig or e}. "
                                   "Its pg_hba.conf must allow password logins (scram-sha-256) from this machine "
                                   "over TCP; then run init again, which takes up the same role.") from None
    finally:
        engine.dispose()
