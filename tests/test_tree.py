"""The organisation tree, memberships, personal keys and claim links, on SQLite and PostgreSQL."""

import time

import pytest
import sqlalchemy as sa

from llmgw import store
from llmgw.gateway.keytable import KeyTable
from llmgw.people import accounts, keys, memberships, orgtree
from llmgw.people.orgtree import TreeError
from llmgw.principals import KeyRecord
from tests.conftest import store_url_for, wipe


def acme(engine):
    orgtree.add(engine, "org", "Acme")
    orgtree.add(engine, "team", "ml", "Acme")
    orgtree.add(engine, "project", "training", "Acme/ml")
    orgtree.add(engine, "org", "Scania")
    orgtree.add(engine, "team", "ml", "Scania")
    return orgtree.add(engine, "project", "vision", "Scania/ml")


def person(engine, email="ayse@example.com"):
    return accounts.create_user(engine, email, "a long enough password", state=accounts.ACTIVE)


def test_things_are_found_by_id_path_or_unique_name(engine):
    vision = acme(engine)
    tree = orgtree.Tree.load(engine)
    assert tree.find("project", vision.id) == tree.find("project", "Scania/ml/vision") == tree.find("project", "vision")
    assert tree.find("team", "Acme/ml").path == "Acme/ml"
    with pytest.raises(TreeError, match=r"2 teams are called 'ml' \(Acme/ml, Scania/ml\); name one by its path"):
        tree.find("team", "ml")
    with pytest.raises(TreeError, match="no project 'nope'; projects: Acme/ml/training"):
        tree.find("project", "nope")


def test_names_are_unique_among_siblings_only(engine):
    acme(engine)
    with pytest.raises(TreeError, match="already a team 'ml' in Acme"):
        orgtree.add(engine, "team", "ml", "Acme")
    with pytest.raises(TreeError, match="already an organisation 'Acme'"):
        orgtree.add(engine, "org", "Acme")
    with pytest.raises(TreeError, match="without '/'"):
        orgtree.add(engine, "team", "a/b", "Acme")
    with pytest.raises(TreeError, match="--in ORG/TEAM"):
        orgtree.add(engine, "project", "lost")
    orgtree.add(engine, "project", "training", "Scania/ml")  # the same name under another team is fine


def test_rename_move_and_remove_only_what_is_empty(engine):
    acme(engine)
    moved = orgtree.move(engine, "project", "Acme/ml/training", "Scania/ml")
    assert moved.path == "Scania/ml/training"
    assert orgtree.rename(engine, "team", "Scania/ml", "research").path == "Scania/research"
    assert orgtree.Tree.load(engine).find("project", "training").path == "Scania/research/training"
    with pytest.raises(TreeError, match="is not empty: it holds"):
        orgtree.remove(engine, "team", "Scania/research")
    keys.create_key(engine, "ci", "Scania/research/training")
    with pytest.raises(TreeError, match="has had keys.*never removed. Rename it instead"):
        orgtree.remove(engine, "project", "training")
    orgtree.remove(engine, "project", "vision")  # never had a key
    with pytest.raises(TreeError, match="nothing above it to move to"):
        orgtree.move(engine, "org", "Acme", "Scania")
    orgtree.remove(engine, "team", "Acme/ml")
    orgtree.remove(engine, "org", "Acme")
    assert [n.path for n in orgtree.Tree.load(engine).of_kind("org")] == ["default", "Scania"]


def test_a_member_of_a_team_uses_every_project_in_it(engine):
    acme(engine)
    orgtree.add(engine, "project", "serving", "Acme/ml")
    user = person(engine)
    memberships.join(engine, user.email, "team", "Acme/ml")
    with engine.connect() as conn:
        tree = orgtree.Tree.read(conn)
        reach = {tree.by_id[p].path for p in memberships.reachable_projects(conn, tree, user.id)}
    assert reach == {"Acme/ml/training", "Acme/ml/serving"}
    with pytest.raises(keys.KeyRefused, match="not a member of Scania/ml/vision"):
        keys.create_key(engine, "mine", "Scania/ml/vision", user_id=user.id, made_by=user.id, member_only=True)
    with pytest.raises(TreeError, match="managers are managers of an organisation"):
        memberships.join(engine, user.email, "team", "Acme/ml", memberships.MANAGER)


def test_leaving_revokes_what_no_other_membership_reaches(engine):
    acme(engine)
    user = person(engine)
    memberships.join(engine, user.email, "team", "Acme/ml")
    memberships.join(engine, user.email, "project", "Acme/ml/training")
    memberships.join(engine, user.email, "project", "Scania/ml/vision")
    made = dict(user_id=user.id, made_by=user.id, member_only=True)
    keys.create_key(engine, "train", "Acme/ml/training", **made)
    keys.create_key(engine, "see", "Scania/ml/vision", **made)
    issued, _ = keys.create_key(engine, "issued", "Scania/ml/vision", user_id=user.id)  # an operator's, for her
    personal, _ = keys.create_key(engine, "laptop", None, user_id=user.id, made_by=user.id)
    # The team still reaches training: nothing is revoked.
    assert memberships.leave(engine, user.email, "project", "Acme/ml/training")[1] == 0
    # Nothing else reaches vision: the key she made there goes, the operator's and her personal one stay.
    assert memberships.leave(engine, user.email, "project", "Scania/ml/vision")[1] == 1
    state = {r.name: r.revoked_at is not None for r in keys.list_keys(engine, user_id=user.id)}
    assert state == {"train": False, "see": True, "issued": False, "laptop": False}
    assert personal.project == keys.PERSONAL and issued.project == "Scania/ml/vision"
    with pytest.raises(TreeError, match="not a member of Scania/ml/vision"):
        memberships.leave(engine, user.email, "project", "Scania/ml/vision")
    orgtree.add(engine, "team", "solo", "Acme")
    memberships.join(engine, user.email, "team", "Acme/solo")
    with pytest.raises(TreeError, match="still has 1 member"):
        orgtree.remove(engine, "team", "Acme/solo")


def test_a_personal_key_needs_a_person(engine):
    with pytest.raises(keys.KeyRefused, match="a personal key belongs to a person"):
        keys.create_key(engine, "nobody's", None)
    with pytest.raises(keys.KeyRefused, match="an admission band is high, normal, low"):
        keys.create_key(engine, "k", band="urgent")


def test_a_suspended_persons_keys_stop_working(engine):
    user = person(engine)
    _, secret = keys.create_key(engine, "laptop", None, user_id=user.id)
    assert isinstance(KeyTable.from_message(keys.key_set(engine)).authenticate(f"Bearer {secret}", time.time()), KeyRecord)
    accounts.suspend(engine, user.email)
    refusal = KeyTable.from_message(keys.key_set(engine)).authenticate(f"Bearer {secret}", time.time())
    assert refusal.code == "account_inactive"


def test_a_claim_link_shows_the_key_once(engine):
    record, secret = keys.create_key(engine, "for-deniz")
    token = keys.make_claim(engine, record.id, secret)
    with engine.connect() as conn:
        sealed = conn.execute(sa.select(store.key_claims.c.sealed)).scalar_one()
    assert secret not in sealed and secret.encode().hex() not in sealed  # the store alone cannot show it
    shown, key = keys.claim(engine, token)
    assert shown == secret and key.id == record.id
    assert "already shown" in keys.claim(engine, token)
    assert "not known" in keys.claim(engine, token + "x")
    expired = keys.make_claim(engine, record.id, secret, ttl=-1)
    assert "expired" in keys.claim(engine, expired)


def test_rejecting_a_sign_up_deletes_it(engine):
    pending = accounts.create_user(engine, "new@example.com", "a long enough password")
    accounts.reject(engine, pending.email)
    assert accounts.list_users(engine) == []
    active = person(engine)
    with pytest.raises(accounts.AccountError, match="not waiting for approval"):
        accounts.reject(engine, active.email)


# The schema as the first release candidate left it: one global project namespace,
# keys always in a project. Step 8 must bring such a database up to date.
def _version_7(conn):
    md = sa.MetaData()
    sa.Table("projects", md, sa.Column("id", sa.String(32), primary_key=True),
             sa.Column("name", sa.String(200), nullable=False, unique=True),
             sa.Column("created_at", sa.Float, nullable=False))
    sa.Table("api_keys", md, sa.Column("id", sa.String(32), primary_key=True),
             sa.Column("name", sa.String(200), nullable=False),
             sa.Column("project_id", sa.String(32), sa.ForeignKey("projects.id"), nullable=False),
             sa.Column("hash", sa.String(64), nullable=False, unique=True),
             sa.Column("prefix", sa.String(32), nullable=False), sa.Column("created_at", sa.Float, nullable=False),
             sa.Column("expires_at", sa.Float), sa.Column("revoked_at", sa.Float), sa.Column("user_id", sa.String(32)))
    usage = [c._copy() for c in store.usage.columns if c.name not in ("user_id", "cost_micros")]
    sa.Table("usage", md, *usage)
    md.create_all(conn)
    store.metadata.create_all(conn, tables=[store.schema_migrations, store.revisions, store.node_keys,
                                            store.node_settings, store.catalog_models, store.users,
                                            store.secrets_table])
    conn.execute(sa.text("INSERT INTO projects VALUES ('p1', 'default', 1), ('p2', 'research', 2)"))
    conn.execute(sa.text("INSERT INTO api_keys (id, name, project_id, hash, prefix, created_at, user_id) "
                         "VALUES ('k1', 'ci', 'p2', 'h1', 'sk-1', 3, 'u1')"))
    conn.execute(store.revisions.insert().values(name="keys", value=1))
    for version in range(1, 8):
        conn.execute(store.schema_migrations.insert().values(version=version, description="", applied_at=0))


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_version_7_store_is_brought_up_to_date(kind, tmp_path, request):
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path}/old.db"
    else:
        url = request.getfixturevalue("pg_url")
        wipe(url)
    url = store_url_for(url)
    engine = store.open_engine(url)
    with engine.begin() as conn:
        _version_7(conn)
    assert store.migrate(engine) == [version for version, _, _ in store.MIGRATIONS if version > 7]
    tree = orgtree.Tree.load(engine)
    assert sorted(n.path for n in tree.of_kind("project")) == ["default/default/default", "default/default/research"]
    (key,) = keys.list_keys(engine)
    assert (key.project, key.user_id) == ("default/default/research", "u1")
    keys.create_key(engine, "now possible", None, user_id="u1")  # a personal key: no project
    orgtree.add(engine, "org", "Other")
    orgtree.add(engine, "team", "t", "Other")
    orgtree.add(engine, "project", "research", "Other/t")  # no longer a clash: names are per team
    engine.dispose()
