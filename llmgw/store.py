"""The database: its schema, the migrations that build it, and how to open it.

SQLite (the default, one file under `./var/`) and PostgreSQL (several machines
sharing one store) hold the same schema. Migrations are numbered steps run at
start, inside one transaction, so no separate command is ever needed and two
processes starting together cannot both apply one. Nothing here is on the
request path: gateways serve from memory and write usage in batches.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

metadata = sa.MetaData()

schema_migrations = sa.Table(
    "schema_migrations", metadata,
    sa.Column("version", sa.Integer, primary_key=True),
    sa.Column("description", sa.Text, nullable=False),
    # Seconds, as a float: an INTEGER of milliseconds overflowed 32 bits in the
    # Go version's first PostgreSQL port.
    sa.Column("applied_at", sa.Float, nullable=False),
)

projects = sa.Table(
    "projects", metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("name", sa.String(200), nullable=False, unique=True),
    sa.Column("created_at", sa.Float, nullable=False),
)

api_keys = sa.Table(
    "api_keys", metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("project_id", sa.String(32), sa.ForeignKey("projects.id"), nullable=False),
    sa.Column("hash", sa.String(64), nullable=False, unique=True),
    sa.Column("prefix", sa.String(32), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float),
    sa.Column("revoked_at", sa.Float),
    sa.Column("user_id", sa.String(32)),  # who made it on the account page; None for an operator's key
)

# Counters that let every worker notice a change with one cheap read,
# instead of re-reading whole tables on a timer.
revisions = sa.Table(
    "revisions", metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("value", sa.BigInteger, nullable=False),
)

usage = sa.Table(
    "usage", metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("key_id", sa.String(32)),
    sa.Column("project_id", sa.String(32)),
    sa.Column("model_asked", sa.String(200)),
    sa.Column("model_served", sa.String(200)),
    sa.Column("replica", sa.String(200)),
    sa.Column("endpoint", sa.String(32), nullable=False),
    sa.Column("stream", sa.Boolean, nullable=False),
    sa.Column("status", sa.Integer, nullable=False),
    sa.Column("prompt_tokens", sa.Integer),
    sa.Column("completion_tokens", sa.Integer),
    sa.Column("latency_ms", sa.Float, nullable=False),
    sa.Column("ttft_ms", sa.Float),
    sa.Index("usage_at", "at"),
    sa.Index("usage_key_at", "key_id", "at"),
)

# A node's CURVE public key, bound to its id: the controller admits a key only
# as the node it was issued to.
node_keys = sa.Table(
    "node_keys", metadata,
    sa.Column("node_id", sa.String(200), primary_key=True),
    sa.Column("public_key", sa.String(40), nullable=False, unique=True),
    sa.Column("created_at", sa.Float, nullable=False),
)

# What an operator decided about a node (cordoned), kept across controller restarts.
node_settings = sa.Table(
    "node_settings", metadata,
    sa.Column("node_id", sa.String(200), primary_key=True),
    sa.Column("cordoned", sa.Boolean, nullable=False, default=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)

# Models added while running (`llmgw ctl model add`); configuration models are not stored.
catalog_models = sa.Table(
    "catalog_models", metadata,
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("spec", sa.Text, nullable=False),  # the model's table, as JSON
    sa.Column("updated_at", sa.Float, nullable=False),
)

# People who sign in to the pages. Passwords are kept only as slow salted hashes.
users = sa.Table(
    "users", metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("email", sa.String(320), nullable=False, unique=True),
    sa.Column("password_hash", sa.String(256), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),  # pending, active, suspended
    sa.Column("is_admin", sa.Boolean, nullable=False, default=False),
    sa.Column("created_at", sa.Float, nullable=False),
)

# Values the system makes for itself once and keeps, such as the key that signs session cookies.
secrets_table = sa.Table(
    "secrets", metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)

DEFAULT_PROJECT = "default"


def _create(tables: list[sa.Table]) -> Callable[[Connection], None]:
    def step(conn: Connection) -> None:
        metadata.create_all(conn, tables=tables)
    return step


def _seed_default_project(conn: Connection) -> None:
    from llmgw.ids import new_id
    conn.execute(projects.insert().values(id=new_id(), name=DEFAULT_PROJECT, created_at=time.time()))
    conn.execute(revisions.insert().values(name="keys", value=1))


def _add_key_owner(conn: Connection) -> None:
    # Earlier steps create tables from today's definitions, so on a new
    # database the column is already there: a step that adds one must check.
    if "user_id" not in {c["name"] for c in sa.inspect(conn).get_columns("api_keys")}:
        conn.exec_driver_sql("ALTER TABLE api_keys ADD COLUMN user_id VARCHAR(32)")


# Append only. A released step never changes: databases out there have run it.
MIGRATIONS: list[tuple[int, str, Callable[[Connection], None]]] = [
    (1, "projects, api keys, revisions", _create([projects, api_keys, revisions])),
    (2, "the default project", _seed_default_project),
    (3, "usage rows", _create([usage])),
    (4, "node keys and node settings", _create([node_keys, node_settings])),
    (5, "runtime catalog", _create([catalog_models])),
    (6, "people and secrets", _create([users, secrets_table])),
    (7, "keys made by a person", _add_key_owner),
]


def _sqlite_connect(dbapi_conn, _record) -> None:
    # pysqlite opens transactions itself, and not before DDL, so a migration
    # would not be atomic; we take over BEGIN (see _sqlite_begin).
    dbapi_conn.isolation_level = None
    # WAL lets gateway workers read keys while a batch of usage is written;
    # busy_timeout turns a brief lock into a wait instead of an error.
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _sqlite_begin(conn: Connection) -> None:
    # IMMEDIATE takes the write lock at once: two processes migrating together
    # then queue instead of deadlocking on a read lock each wants to upgrade.
    immediate = conn.get_execution_options().get("sqlite_immediate")
    conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def open_engine(url: str) -> Engine:
    """An engine for URL; a SQLite file's directory is created on first use."""
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///"):]
        if path and path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        sa.event.listen(engine, "connect", _sqlite_connect)
        sa.event.listen(engine, "begin", _sqlite_begin)
        return engine
    return sa.create_engine(url, pool_pre_ping=True, pool_size=2, max_overflow=4)


def migrate(engine: Engine) -> list[int]:
    """Apply every migration not yet applied; returns the versions applied now."""
    applied_now = []
    with engine.execution_options(sqlite_immediate=True).begin() as conn:
        if engine.dialect.name == "postgresql":
            # Two gateways starting at once: the second waits here, then finds
            # the work done.
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(7306241)"))
        metadata.create_all(conn, tables=[schema_migrations])
        done = {row[0] for row in conn.execute(sa.select(schema_migrations.c.version))}
        for version, description, step in MIGRATIONS:
            if version in done:
                continue
            step(conn)
            conn.execute(schema_migrations.insert().values(
                version=version, description=description, applied_at=time.time()))
            applied_now.append(version)
    return applied_now


def open_store(url: str) -> Engine:
    """Open the store at URL and bring its schema up to date."""
    engine = open_engine(url)
    migrate(engine)
    return engine


def bump_revision(conn: Connection, name: str) -> None:
    conn.execute(revisions.update().where(revisions.c.name == name).values(value=revisions.c.value + 1))


def read_revision(conn: Connection, name: str) -> int:
    return conn.execute(sa.select(revisions.c.value).where(revisions.c.name == name)).scalar_one()


def describe(url: str) -> str:
    """URL with any password hidden, for logs and messages."""
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return "(unparseable database URL)"
