"""The database: its schema, the migrations that build it, and how to open it.

SQLite (the default, one file under `./var/`) and PostgreSQL (several machines
sharing one store) hold the same schema. Migrations are numbered steps run at
start, inside one transaction, so no separate command is ever needed and two
processes starting together cannot both apply one. Nothing here is on the
request path: gateways serve from memory and write usage in batches.

A store that holds a migration this code does not know was migrated by a newer
llmgw, and every role refuses to start on it (`migrate` raises NewerSchema,
naming both versions): older code once used such a store silently, blind to
what the newer schema means. A role already running when a newer one migrates
keeps running, and keeps writing: that is how an upgrade goes, one machine at a
time (docs/operations.md, "Upgrades"), and why a migration must leave what
older code writes valid.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from llmgw import filemodes

metadata = sa.MetaData()

schema_migrations = sa.Table(
    "schema_migrations", metadata,
    sa.Column("version", sa.Integer, primary_key=True),
    sa.Column("description", sa.Text, nullable=False),
    # Seconds, as a float: an INTEGER of milliseconds overflowed 32 bits in the
    # Go version's first PostgreSQL port.
    sa.Column("applied_at", sa.Float, nullable=False),
)

# The tree people and spending are organised in: organisation, team, project.
# Names are unique among siblings only, so two organisations may each have a
# team called "ml"; ids are random and never reused.
orgs = sa.Table(
    "orgs", metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("name", sa.String(200), nullable=False, unique=True),
    sa.Column("created_at", sa.Float, nullable=False),
)

teams = sa.Table(
    "teams", metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("org_id", sa.String(32), sa.ForeignKey("orgs.id"), nullable=False),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.UniqueConstraint("org_id", "name", name="teams_sibling_name"),
)

projects = sa.Table(
    "projects", metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("team_id", sa.String(32), sa.ForeignKey("teams.id"), nullable=False),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    # How long the project's conversations are kept after their last turn (llmgw/conversations.py), in hours;
    # None: the project keeps none, which is every project's start (`llmgw keys threads`).
    sa.Column("threads_hours", sa.Float),
    # How long its agents' notes are kept after they were last written (llmgw/memory.py); None: none kept.
    sa.Column("memory_hours", sa.Float),
    sa.UniqueConstraint("team_id", "name", name="projects_sibling_name"),
)

api_keys = sa.Table(
    "api_keys", metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("name", sa.String(200), nullable=False),
    # None for a personal key: it spends against its owner alone.
    sa.Column("project_id", sa.String(32), sa.ForeignKey("projects.id")),
    sa.Column("hash", sa.String(64), nullable=False, unique=True),
    sa.Column("prefix", sa.String(32), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float),
    sa.Column("revoked_at", sa.Float),
    sa.Column("user_id", sa.String(32)),  # the person it belongs to; None for an operator's key in a project
    sa.Column("made_by", sa.String(32)),  # the person who made it, when a person did (leaving revokes these)
    # Listings page through keys in the order they were made, and read one person's or project's: without
    # these, each read a million keys (`llmgw keys list`, the account page; bench/keys.py).
    sa.Index("api_keys_created", "created_at", "id"),
    sa.Index("api_keys_user", "user_id"),
    sa.Index("api_keys_project", "project_id", "created_at"),
)

# Who belongs where. A member of an organisation or team may use every project in it.
memberships = sa.Table(
    "memberships", metadata,
    sa.Column("user_id", sa.String(32), sa.ForeignKey("users.id"), primary_key=True),
    sa.Column("scope", sa.String(16), primary_key=True),  # org, team, project
    sa.Column("scope_id", sa.String(32), primary_key=True),
    sa.Column("role", sa.String(16), nullable=False),  # member, manager (organisations only)
    sa.Column("created_at", sa.Float, nullable=False),
    # The identity provider whose groups gave it (`[[auth.oidc.map]]`), which takes it away when they no longer
    # do; none for one an operator made, which no provider touches.
    sa.Column("source", sa.String(64)),
    sa.Index("memberships_scope", "scope_id"),  # a place's members, for the people page
)

# Limits set on one scope: a key, a person, a project, team or organisation,
# each member of one (scope "project_member" with the project's id), or the
# whole cluster (scope "cluster", id ""). Absent means "not limited here".
limits = sa.Table(
    "limits", metadata,
    sa.Column("scope", sa.String(16), primary_key=True),
    sa.Column("scope_id", sa.String(32), primary_key=True),
    sa.Column("rpm", sa.Integer),
    sa.Column("tpm", sa.Integer),
    sa.Column("budget_micros", sa.BigInteger),
    sa.Column("period", sa.String(8)),  # day, month
    sa.Column("models", sa.Text),  # JSON list: the allowlist
    sa.Column("band", sa.String(16)),  # admission band: high, normal, low
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("disabled", sa.Boolean),  # true on the `personal` scope: personal use is turned off
    sa.Column("profile", sa.String(64)),  # the routing profile requests go by (a gateway's [[routing_profiles]])
)

# Every change to a limit: who, when, and what it was before.
limit_changes = sa.Table(
    "limit_changes", metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("who", sa.String(320), nullable=False),
    sa.Column("scope", sa.String(16), nullable=False),
    sa.Column("scope_id", sa.String(32), nullable=False),
    sa.Column("field", sa.String(16), nullable=False),
    sa.Column("old", sa.Text),
    sa.Column("new", sa.Text),
)

# Prices per million tokens in micro-units (a millionth of a unit of money);
# the model "*" is the price of every model without its own.
prices = sa.Table(
    "prices", metadata,
    sa.Column("model", sa.String(200), primary_key=True),
    sa.Column("input_micros", sa.BigInteger, nullable=False),
    sa.Column("output_micros", sa.BigInteger, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)

# A key waiting to be shown once at a link. The secret is sealed with the
# link's token, which is not kept (only its hash), and emptied when opened.
key_claims = sa.Table(
    "key_claims", metadata,
    sa.Column("token_hash", sa.String(64), primary_key=True),
    sa.Column("key_id", sa.String(32), sa.ForeignKey("api_keys.id"), nullable=False),
    sa.Column("sealed", sa.Text),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
    sa.Column("claimed_at", sa.Float),
)

# Counters that let every worker notice a change with one cheap read,
# instead of re-reading whole tables on a timer.
revisions = sa.Table(
    "revisions", metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("value", sa.BigInteger, nullable=False),
)

# What changed at each revision of the keys, as its writer named it (`bump_revision`): the controller reads the
# rows past the revision it sent and only what they name (llmgw/people/keys.py, `changed_since`), where it read
# every key, limit and person at each change. WHAT: key, user (a person's state and role), user_keys (every
# key of a person), limit ("scope:id"), none (nothing gateways hold: a membership), or all (the writer named
# nothing: read the set whole).
key_log = sa.Table(
    "key_log", metadata,
    sa.Column("revision", sa.BigInteger, nullable=False),
    sa.Column("what", sa.String(16), nullable=False),
    sa.Column("ident", sa.String(300), nullable=False),
    sa.Index("key_log_revision", "revision"),
)
# Revisions of the keys whose rows are kept: a reader further behind reads the set whole.
KEY_LOG_KEPT = 100_000

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
    sa.Column("user_id", sa.String(32)),  # whose spending it was: the key's person, or who chatted
    sa.Column("cost_micros", sa.BigInteger),
    # The guard's verdict (safe, unjudged, prompt_unsafe, answer_unsafe; null: not judged) and the categories
    # an unsafe one named, such as "S1,S10" (llmgw/gateway/guard.py).
    sa.Column("guard_verdict", sa.String(20)),
    sa.Column("guard_category", sa.String(100)),
    sa.Index("usage_at", "at"),
    sa.Index("usage_key_at", "key_id", "at"),
)


# Spool files (usage rows a stopping gateway could not write) that a later
# start has written. A file's rows and its name here are written in one
# transaction, so a crash before the file is removed cannot write them twice.
usage_spools = sa.Table(
    "usage_spools", metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("rows", sa.Integer, nullable=False),
    sa.Column("written_at", sa.Float, nullable=False),
)


# Kept conversations (llmgw/conversations.py), only for projects whose `threads_hours` is set. A thread is
# named by its project (`scope`) and the client's id together: the scope is part of every key, so no lookup
# can reach another project's thread. A turn is what one request added: the client's new messages and the
# answer, as chat messages in JSON.
threads = sa.Table(
    "threads", metadata,
    sa.Column("scope", sa.String(32), primary_key=True),
    sa.Column("id", sa.String(200), primary_key=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("last_at", sa.Float, nullable=False),  # its last turn: retention is measured from here
    sa.Column("last_seq", sa.Integer, nullable=False, server_default="0"),  # the place its last turn took
    # Its last turn plus the retention then: a window lengthened later does not bring back what had expired.
    sa.Column("expires_at", sa.Float, nullable=False),
    sa.Column("system", sa.Text),  # JSON list: the system messages its latest turn that had any sent
    sa.Index("threads_scope_expires", "scope", "expires_at"),  # the sweep's
)

thread_turns = sa.Table(
    "thread_turns", metadata,
    sa.Column("scope", sa.String(32), primary_key=True),
    sa.Column("thread_id", sa.String(200), primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("messages", sa.Text, nullable=False),
    sa.Column("tokens", sa.Integer, nullable=False),  # about how many tokens its messages are
    # A Responses API turn's response id and the response as answered (GET /v1/responses/{id}).
    sa.Column("response_id", sa.String(64)),
    sa.Column("response", sa.Text),
    # A turn copied into a branch (a Responses request continued from an earlier response): the turn it is a
    # copy of, so that deleting that turn, or its thread, deletes the copies too.
    sa.Column("origin_thread", sa.String(200)),
    sa.Column("origin_seq", sa.Integer),
    sa.Index("thread_turns_response", "scope", "response_id", unique=True),
    sa.Index("thread_turns_origin", "scope", "origin_thread", "origin_seq"),
)


# Agents' notes (llmgw/memory.py), only for projects whose `memory_hours` is set, scoped as threads are.
# Searched with the database's own full-text index, which is not part of this definition: an FTS5 table
# kept by triggers on SQLite, a generated tsvector column on PostgreSQL (`_memory`), so that every way a
# row is written (a store move included) keeps it searchable.
notes = sa.Table(
    "notes", metadata,
    # The index's key for the row: SQLite's rowid, named, so that a VACUUM cannot renumber it under FTS5.
    sa.Column("num", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("scope", sa.String(32), nullable=False),
    sa.Column("id", sa.String(32), nullable=False),
    sa.Column("text", sa.Text, nullable=False),
    # Its words as llmgw reads them (llmgw/memory.py: lowered, one space between), which the index is of:
    # both stores then find the same words, where their own parsers would not (PostgreSQL's kept
    # "deploy/ansible" one word).
    sa.Column("words", sa.Text, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),  # retention is measured from here
    sa.Column("expires_at", sa.Float, nullable=False),  # as a thread's
    sa.UniqueConstraint("scope", "id", name="notes_scope_id"),
    sa.Index("notes_scope_updated", "scope", "updated_at"),
    sa.Index("notes_scope_expires", "scope", "expires_at"),  # the sweep's
)


# Who uses the store now: the controllers' leader lease (llmgw/control/lease.py), seeded free, and a row per
# running gateway (llmgw/gateway/presence.py); `llmgw store move` refuses while any is held.
leases = sa.Table(
    "leases", metadata,
    sa.Column("name", sa.String(300), primary_key=True),  # "controller", or "gateway HOST LISTEN"
    sa.Column("owner", sa.String(32), nullable=False),  # a random id per process start; "" when free
    sa.Column("address", sa.String(300), nullable=False),  # the leader's agents' address; a gateway's listen
    sa.Column("expires_at", sa.Float, nullable=False),  # the database's clock, seconds since the epoch
)


def db_now(dialect: str):
    """The database's own clock in seconds since the epoch, as an SQL expression: every controller on one store
    then measures a lease by the same clock, however far apart their own clocks are."""
    if dialect == "postgresql":
        return sa.func.extract("epoch", sa.func.clock_timestamp())
    return (sa.func.julianday("now") - 2440587.5) * 86400.0


def _rollup(name: str, bucket: str) -> sa.Table:
    # Reports read these, never the raw rows: a page over ten million
    # requests sums a few thousand roll-up rows. "" stands for "none" in the
    # key columns, so they can be part of the primary key.
    return sa.Table(
        name, metadata,
        sa.Column(bucket, sa.Float, primary_key=True),
        sa.Column("key_id", sa.String(32), primary_key=True),
        sa.Column("project_id", sa.String(32), primary_key=True),
        sa.Column("user_id", sa.String(32), primary_key=True),
        sa.Column("model", sa.String(200), primary_key=True),
        sa.Column("requests", sa.BigInteger, nullable=False),
        sa.Column("errors", sa.BigInteger, nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger, nullable=False),
        sa.Column("completion_tokens", sa.BigInteger, nullable=False),
        sa.Column("cost_micros", sa.BigInteger, nullable=False),
    )


usage_hourly = _rollup("usage_hourly", "hour")
usage_daily = _rollup("usage_daily", "day")

# A node's CURVE public key, bound to its id: the controller admits a key only
# as the node it was issued to.
node_keys = sa.Table(
    "node_keys", metadata,
    sa.Column("node_id", sa.String(200), primary_key=True),
    sa.Column("public_key", sa.String(40), nullable=False, unique=True),
    sa.Column("created_at", sa.Float, nullable=False),
)

# A gateway's CURVE public key, bound to its name: the controller's gateway
# sockets (snapshots, demand, the accountant) admit only these.
gateway_keys = sa.Table(
    "gateway_keys", metadata,
    sa.Column("name", sa.String(200), primary_key=True),
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

# What `llmgw ctl bench --save` measured of a model's profile: how many requests its replicas take at once
# within the service level. Kept apart from the catalog's own tables because a configuration model has a
# profile (in the file) but no row in catalog_models, and a measurement belongs to either kind. FINGERPRINT
# is the profile's (catalog.Model.fingerprint) when it was measured: a profile edited since is another engine.
capacities = sa.Table(
    "capacities", metadata,
    sa.Column("model", sa.String(200), primary_key=True),
    sa.Column("profile", sa.String(200), primary_key=True),
    sa.Column("fingerprint", sa.String(64), nullable=False),
    sa.Column("max_in_flight", sa.Integer, nullable=False),
    sa.Column("measured", sa.Text, nullable=False),  # the figures behind it, as JSON (llmgw/control/capacity.py)
    sa.Column("measured_at", sa.Float, nullable=False),
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
    # Who let a sign-up in, and when: an operator's name (`users approve --by`) or an administrator's email.
    sa.Column("approved_by", sa.String(320)),
    sa.Column("approved_at", sa.Float),
    # The identity provider whose groups made this person an administrator, which takes it back when they no
    # longer do; none when an operator did, or nobody.
    sa.Column("admin_source", sa.String(64)),
)

# A person as an identity provider knows them: its `sub` for them, never reused, is what signs them in (an
# email can change hands). A link to an existing account that waits for an administrator (`link_existing =
# "confirm"`) has no confirmed_at. What the provider's groups changed at the last sign-in is kept as JSON,
# for the person's page.
identities = sa.Table(
    "identities", metadata,
    sa.Column("provider", sa.String(64), primary_key=True),
    sa.Column("subject", sa.String(255), primary_key=True),
    sa.Column("user_id", sa.String(32), sa.ForeignKey("users.id"), nullable=False),
    sa.Column("email", sa.String(320), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("confirmed_at", sa.Float),
    sa.Column("signed_in_at", sa.Float),
    sa.Column("changes", sa.Text),
    sa.Index("identities_user", "user_id"),
)

# Sign-ins under way or just finished: a browser's through a provider, kept until it would have expired so
# that its state is used once whatever copies of the cookie or the URL exist (the state, nonce and PKCE
# verifier themselves travel in the signed session cookie, so beginning a sign-in writes nothing here);
# `llmgw login`'s device flow, with the provider's device code, which never leaves the gateway, and when it
# was last asked; and `llmgw login --browser`'s one-time code (provider "browser"), for USER_ID, redeemed
# only with the verifier whose S256 CHALLENGE the command sent. Keyed by the hash of the state, of the
# handle the CLI polls with, or of the code.
sign_in_flows = sa.Table(
    "sign_in_flows", metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("provider", sa.String(64), nullable=False),
    sa.Column("device_code", sa.String(2048)),
    sa.Column("project", sa.String(300)),
    sa.Column("polled_at", sa.Float),
    sa.Column("user_id", sa.String(32)),
    sa.Column("challenge", sa.String(64)),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
)

# Values the system makes for itself once and keeps. (The key that signs session cookies was one
# until migration 10; it lives in a 0600 file now, see llmgw/people/sessions.py.)
secrets_table = sa.Table(
    "secrets", metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)

# A signed-in session of the pages. The cookie holds a random token; only its
# hash is kept here, so reading the store gives no one a session. Ending a
# session (sign-out, a password change, suspension, an administrator) deletes
# its row, and the cookie is worth nothing from then on.
sessions = sa.Table(
    "sessions", metadata,
    sa.Column("id", sa.String(64), primary_key=True),  # SHA-256 of the cookie's token
    sa.Column("user_id", sa.String(32), sa.ForeignKey("users.id"), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("seen_at", sa.Float, nullable=False),
    # When it ends however used: set for a sign-in through an identity provider (auth.provider_session_lifetime).
    sa.Column("expires_at", sa.Float),
    # The identity provider it began through, whose end-session page signing out offers.
    sa.Column("provider", sa.String(64)),
    sa.Index("sessions_user", "user_id"),
)

# Where keys go when nobody says: the project default/default/default.
DEFAULT_PROJECT = "default"
DEFAULT_PATH = "default/default/default"


def _create(tables: list[sa.Table]) -> Callable[[Connection], None]:
    def step(conn: Connection) -> None:
        metadata.create_all(conn, tables=tables)
    return step


def _default_team(conn: Connection) -> str:
    """The id of the team default/default, made when missing."""
    from llmgw.ids import new_id
    now = time.time()
    org = conn.execute(sa.select(orgs.c.id).where(orgs.c.name == DEFAULT_PROJECT)).scalar()
    if org is None:
        org = new_id()
        conn.execute(orgs.insert().values(id=org, name=DEFAULT_PROJECT, created_at=now))
    team = conn.execute(sa.select(teams.c.id).where(sa.and_(teams.c.org_id == org,
                                                            teams.c.name == DEFAULT_PROJECT))).scalar()
    if team is None:
        team = new_id()
        conn.execute(teams.insert().values(id=team, org_id=org, name=DEFAULT_PROJECT, created_at=now))
    return team


def _seed_default_project(conn: Connection) -> None:
    from llmgw.ids import new_id
    conn.execute(projects.insert().values(id=new_id(), team_id=_default_team(conn), name=DEFAULT_PROJECT,
                                          created_at=time.time()))
    conn.execute(revisions.insert().values(name="keys", value=1))


def _columns(conn: Connection, table: str) -> set[str]:
    return {c["name"] for c in sa.inspect(conn).get_columns(table)}


def _add_missing(conn: Connection, table: str, columns: dict[str, str]) -> None:
    """Add to TABLE each of COLUMNS (name -> SQL type) it lacks. Earlier steps create tables from today's
    definitions, so on a new database the columns are already there: a step that adds one must check."""
    have = _columns(conn, table)
    for name, kind in columns.items():
        if name not in have:
            conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")


def _columns_added(table: str, **columns: str) -> Callable[[Connection], None]:
    """A step that adds COLUMNS to TABLE (`_add_missing`)."""
    return lambda conn: _add_missing(conn, table, columns)


def _rebuild_sqlite(conn: Connection, table: sa.Table, fill: dict[str, str]) -> None:
    """Give TABLE today's definition on SQLite, which cannot drop a constraint in place:
    move the old table aside, create the new one, copy, drop the old. FILL gives an
    SQL value for each new column. Foreign keys are off during migrations (see
    `migrate`)."""
    old = _columns(conn, table.name)
    aside = table.name + "__old"
    # Legacy renaming leaves other tables' references naming TABLE.
    conn.exec_driver_sql("PRAGMA legacy_alter_table = ON")
    conn.exec_driver_sql(f"ALTER TABLE {table.name} RENAME TO {aside}")
    conn.exec_driver_sql("PRAGMA legacy_alter_table = OFF")
    table.create(conn)
    names = [c.name for c in table.columns if c.name in old or c.name in fill]
    values = [c if c in old else fill[c] for c in names]
    conn.exec_driver_sql(f"INSERT INTO {table.name} ({', '.join(names)}) SELECT {', '.join(values)} FROM {aside}")
    conn.exec_driver_sql(f"DROP TABLE {aside}")
    broken = conn.exec_driver_sql("PRAGMA foreign_key_check").all()
    if broken:
        raise RuntimeError(f"rebuilding {table.name} left rows whose references are missing: {broken[:5]}")


def _tree(conn: Connection) -> None:
    """Organisations and teams above projects, memberships, limits, prices, claim links, personal keys."""
    metadata.create_all(conn, tables=[orgs, teams, memberships, limits, limit_changes, prices, key_claims,
                                      usage_hourly, usage_daily])
    sqlite = conn.dialect.name == "sqlite"
    if "team_id" not in _columns(conn, "projects"):
        team = _default_team(conn)
        if sqlite:
            _rebuild_sqlite(conn, projects, {"team_id": f"'{team}'"})
        else:
            for unique in sa.inspect(conn).get_unique_constraints("projects"):
                conn.exec_driver_sql(f'ALTER TABLE projects DROP CONSTRAINT "{unique["name"]}"')
            conn.exec_driver_sql("ALTER TABLE projects ADD COLUMN team_id VARCHAR(32) REFERENCES teams(id)")
            conn.execute(projects.update().values(team_id=team))
            conn.exec_driver_sql("ALTER TABLE projects ALTER COLUMN team_id SET NOT NULL")
            conn.exec_driver_sql("ALTER TABLE projects ADD CONSTRAINT projects_sibling_name UNIQUE (team_id, name)")
    if "made_by" not in _columns(conn, "api_keys"):
        if sqlite:
            _rebuild_sqlite(conn, api_keys, {"made_by": "user_id"})
        else:
            conn.exec_driver_sql("ALTER TABLE api_keys ALTER COLUMN project_id DROP NOT NULL")
            conn.exec_driver_sql("ALTER TABLE api_keys ADD COLUMN made_by VARCHAR(32)")
            conn.exec_driver_sql("UPDATE api_keys SET made_by = user_id")
    _add_missing(conn, "usage", {"user_id": "VARCHAR(32)", "cost_micros": "BIGINT"})


def _sessions(conn: Connection) -> None:
    """Session records; the session secret leaves the store. It was readable by
    anyone who could read the store, and so were forged administrators' cookies; every session signed
    with it ends here, and people sign in again."""
    metadata.create_all(conn, tables=[sessions])
    conn.execute(secrets_table.delete().where(secrets_table.c.name == "session"))


def _threads(conn: Connection) -> None:
    metadata.create_all(conn, tables=[threads, thread_turns])
    _add_missing(conn, "projects", {"threads_hours": "FLOAT"})


def _memory(conn: Connection) -> None:
    metadata.create_all(conn, tables=[notes])
    _add_missing(conn, "projects", {"memory_hours": "FLOAT"})
    if conn.dialect.name == "sqlite":
        # The ascii tokenizer splits only at ASCII separators (a space, in `words`) and keeps every other
        # character, combining marks included, as llmgw read the words.
        conn.exec_driver_sql("CREATE VIRTUAL TABLE notes_fts USING fts5(words, content='notes', content_rowid='num', "
                             "tokenize=\"ascii tokenchars '_'\")")
        conn.exec_driver_sql("CREATE TRIGGER notes_added AFTER INSERT ON notes BEGIN "
                             "INSERT INTO notes_fts(rowid, words) VALUES (new.num, new.words); END")
        conn.exec_driver_sql("CREATE TRIGGER notes_removed AFTER DELETE ON notes BEGIN "
                             "INSERT INTO notes_fts(notes_fts, rowid, words) VALUES ('delete', old.num, old.words); END")
        conn.exec_driver_sql("CREATE TRIGGER notes_changed AFTER UPDATE OF words ON notes BEGIN "
                             "INSERT INTO notes_fts(notes_fts, rowid, words) VALUES ('delete', old.num, old.words); "
                             "INSERT INTO notes_fts(rowid, words) VALUES (new.num, new.words); END")
    else:
        # The words as lexemes, verbatim (no parser, so no word is split or joined otherwise than llmgw did).
        conn.exec_driver_sql("ALTER TABLE notes ADD COLUMN search tsvector "
                             "GENERATED ALWAYS AS (array_to_tsvector(string_to_array(words, ' '))) STORED")
        conn.exec_driver_sql("CREATE INDEX notes_search ON notes USING gin (search)")


def _identities(conn: Connection) -> None:
    metadata.create_all(conn, tables=[identities, sign_in_flows])
    _add_missing(conn, "memberships", {"source": "VARCHAR(64)"})
    _add_missing(conn, "users", {"admin_source": "VARCHAR(64)"})
    _add_missing(conn, "sessions", {"expires_at": "FLOAT", "provider": "VARCHAR(64)"})


def _listing_indexes(conn: Connection) -> None:
    # A store made since these were declared has them from its first steps already.
    for index in (*api_keys.indexes, *memberships.indexes):
        index.create(conn, checkfirst=True)


def _leases(conn: Connection) -> None:
    metadata.create_all(conn, tables=[leases])
    conn.execute(leases.insert().values(name="controller", owner="", address="", expires_at=0.0))


# Append only. A released step never changes: databases out there have run it.
# (Steps 1 and 2 were reshaped for the tree before any release, which is why
# step 8 must also bring databases made by their first form up to date.)
# A step adds and never takes away: a new column is nullable or has a default,
# and nothing older code reads or writes is renamed or dropped, because roles of
# the previous version keep running on the migrated store until each is upgraded.
MIGRATIONS: list[tuple[int, str, Callable[[Connection], None]]] = [
    (1, "projects, api keys, revisions", _create([orgs, teams, projects, api_keys, revisions])),
    (2, "the default project", _seed_default_project),
    (3, "usage rows", _create([usage])),
    (4, "node keys and node settings", _create([node_keys, node_settings])),
    (5, "runtime catalog", _create([catalog_models])),
    (6, "people and secrets", _create([users, secrets_table])),
    (7, "keys made by a person", _columns_added("api_keys", user_id="VARCHAR(32)")),
    (8, "organisations, teams, memberships, limits, prices, claim links, usage roll-ups", _tree),
    (9, "gateway keys", _create([gateway_keys])),
    (10, "sessions; the session secret leaves the store", _sessions),
    (11, "usage spool files written", _create([usage_spools])),
    (12, "the guard's verdict on usage rows", _columns_added("usage", guard_verdict="VARCHAR(20)",
                                                             guard_category="VARCHAR(100)")),
    (13, "the controllers' leader lease", _leases),
    (14, "measured capacities of models' profiles", _create([capacities])),
    (15, "kept conversations", _threads),
    (16, "agents' notes, searchable", _memory),
    (17, "who approved each sign-up", _columns_added("users", approved_by="VARCHAR(320)", approved_at="FLOAT")),
    (18, "personal use turned off", _columns_added("limits", disabled="BOOLEAN")),
    (19, "routing profiles of keys and the tree", _columns_added("limits", profile="VARCHAR(64)")),
    (20, "sign-in through identity providers", _identities),
    (21, "keys and members listed a page at a time", _listing_indexes),
    (22, "what changed at each revision of the keys", _create([key_log])),
]
KNOWN = {version for version, _, _ in MIGRATIONS}


class NewerSchema(RuntimeError):
    """The store holds migrations this code does not know: a newer llmgw migrated it. The message names the
    store's newest migration and this code's, and what to do."""


def applied_versions(conn: Connection) -> set[int]:
    """The migrations applied to the store on CONN (which has its schema_migrations table); raises NewerSchema
    where one is not among this code's."""
    applied = dict(conn.execute(sa.select(schema_migrations.c.version, schema_migrations.c.description)).all())
    unknown = sorted(set(applied) - KNOWN)
    if unknown:
        from llmgw import __version__

        newest, mine = max(applied), MIGRATIONS[-1]
        # No URL: each caller says which store ("cannot open the store URL: ...").
        raise NewerSchema(
            f"a newer llmgw migrated it, adding migration {', '.join(str(v) for v in unknown)}, which this llmgw "
            f"({__version__}) does not know. The store's newest migration is {newest} ({applied[newest]}); this "
            f"llmgw's is {mine[0]} ({mine[1]}). Nothing was changed. Run this with the llmgw that migrated the "
            'store (upgrade this machine: docs/operations.md, "Upgrades"), or, to go back to this version, stop '
            "every role and restore the backup taken before the upgrade.")
    return set(applied)


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


# PostgreSQL advisory locks, each a number only this code uses: migrating the schema; writing usage rows
# (gateways share it; the usage roller takes it alone to see every row whose id is given out: rollup.py).
MIGRATION_LOCK = 7306241
USAGE_WRITES_LOCK = 7306242


def open_engine(url: str) -> Engine:
    """An engine for URL. A SQLite file and its directory are created on first use, readable by this user
    only (0600, 0700): the store holds every key's hash and the people's password hashes."""
    if url.startswith("sqlite:///"):
        path = filemodes.sqlite_path(url)
        if path:
            filemodes.make_private_dir(os.path.dirname(os.path.abspath(path)))
            filemodes.create_private(path)
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        sa.event.listen(engine, "connect", _sqlite_connect)
        sa.event.listen(engine, "begin", _sqlite_begin)
        return engine
    return sa.create_engine(url, pool_pre_ping=True, pool_size=2, max_overflow=4)


def migrate(engine: Engine) -> list[int]:
    """Apply every migration not yet applied; returns the versions applied now. Raises NewerSchema, changing
    nothing, where the store holds a migration this code does not know: every role calls this as it starts."""
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            # SQLite rewrites or enforces references while a table is rebuilt
            # unless foreign keys are off, and that can only be switched
            # outside a transaction. This connection is used once and closed.
            conn.connection.dbapi_connection.execute("PRAGMA foreign_keys = OFF")
        with conn.execution_options(sqlite_immediate=True).begin():
            if engine.dialect.name == "postgresql":
                # Two gateways starting at once: the second waits here, then
                # finds the work done.
                conn.execute(sa.select(sa.func.pg_advisory_xact_lock(MIGRATION_LOCK)))
            metadata.create_all(conn, tables=[schema_migrations])
            done = applied_versions(conn)
            applied_now = []
            for version, description, step in MIGRATIONS:
                if version in done:
                    continue
                step(conn)
                conn.execute(schema_migrations.insert().values(
                    version=version, description=description, applied_at=time.time()))
                applied_now.append(version)
    return applied_now


def open_store(url: str) -> Engine:
    """Open the store at URL and bring its schema up to date; raises NewerSchema where newer code migrated it."""
    engine = open_engine(url)
    try:
        migrate(engine)
    except Exception:
        engine.dispose()
        raise
    return engine


def writing_first(engine: Engine) -> Engine:
    """ENGINE, with every transaction on SQLite taking the write lock at its BEGIN (BEGIN IMMEDIATE), for
    commands that read and then write. A transaction that read first and then wrote failed with "database
    is locked" whenever another process had written since its read (SQLite cannot upgrade a read lock whose
    snapshot is old, and no busy timeout helps): `llmgw keys create` failed 42 times in 300 beside a
    controller renewing its lease. Taking the lock first makes it wait its turn instead. Only for short-lived
    commands: every read through it waits for the write lock too."""
    return engine.execution_options(sqlite_immediate=True)


def writing(engine: Engine):
    """A transaction that means to write: `with store.writing(engine) as conn:`. On SQLite it takes the write
    lock at its BEGIN, so one that reads before it writes waits for another process's write instead of
    failing with "database is locked" (see `writing_first`); elsewhere it is `engine.begin()`. Every change
    to people, keys, limits and the catalog is made in one, wherever it runs: a gateway's pages, a test, a
    command."""
    return engine.execution_options(sqlite_immediate=True).begin()


def bounded(conn: Connection, seconds: float, silent: float | None = None) -> None:
    """Make CONN's statements give up after SECONDS waiting for a lock, where the store's usual wait is longer
    (SQLite's busy timeout of 10 s; PostgreSQL's, none). Call inside the transaction: on PostgreSQL it holds
    for that transaction only. SQLite's setting stays with the connection, which the store never pools.

    SILENT, on PostgreSQL: the server ends the session, and frees its locks, once its client has been silent
    that long inside the transaction. For transactions that hold a lock others wait on: a controller paused
    between renewing its lease and committing (a frozen virtual machine, SIGSTOP) held the lease's row, and the
    standby, waiting on that row, never took over until it woke. Give it a bound no live client on a busy
    machine comes near between two statements: an ended session fails the transaction. SQLite's lock is its
    holder's file lock, which nothing but the holder can give up."""
    ms = max(1, int(seconds * 1000))
    if conn.dialect.name == "sqlite":
        conn.exec_driver_sql(f"PRAGMA busy_timeout={ms}")
        return
    conn.exec_driver_sql(f"SET LOCAL lock_timeout = {ms}")
    conn.exec_driver_sql(f"SET LOCAL statement_timeout = {ms}")
    if silent is not None:
        conn.exec_driver_sql(f"SET LOCAL idle_in_transaction_session_timeout = {max(1, int(silent * 1000))}")


def one_moment(engine: Engine) -> Connection:
    """A connection whose reads, until it commits or closes, all see the store at one moment: SQLite's
    transaction does (WAL), and PostgreSQL's REPEATABLE READ; its default reads each statement at another
    moment, so a revision read first could label rows changed after it."""
    conn = engine.connect()
    if engine.dialect.name == "postgresql":
        conn = conn.execution_options(isolation_level="REPEATABLE READ")
    return conn


def bump_revision(conn: Connection, name: str, changes: list[tuple[str, str]] | None = None) -> None:
    """Move NAME's revision on, in CONN's transaction. For the keys, CHANGES names what changed (`key_log`'s
    what and ident); none names the whole set. The revision's row stays locked until the transaction ends,
    so changes are numbered in the order they commit, and a reader that sees a revision sees every row of
    `key_log` up to it."""
    conn.execute(revisions.update().where(revisions.c.name == name).values(value=revisions.c.value + 1))
    if name != "keys":
        return
    value = note_keys(conn, changes or [("all", "")])
    if value % 1000 == 0:  # now and then, not at each change: the rows of revisions long past
        conn.execute(key_log.delete().where(key_log.c.revision <= value - KEY_LOG_KEPT))


def note_keys(conn: Connection, changes: list[tuple[str, str]]) -> int:
    """Name more of what the keys' revision that CONN's transaction moved changed (known only once done);
    returns that revision."""
    value = read_revision(conn, "keys")
    if changes:
        conn.execute(key_log.insert(), [{"revision": value, "what": what, "ident": ident} for what, ident in changes])
    return value


def read_revision(conn: Connection, name: str) -> int:
    return conn.execute(sa.select(revisions.c.value).where(revisions.c.name == name)).scalar_one()


def describe(url: str) -> str:
    """URL with any password hidden, for logs and messages."""
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return "(unparseable database URL)"
