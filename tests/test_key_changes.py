"""A `key_changes` message takes a gateway's table exactly where the whole set would: any two key sets, any change.

The tables are compared part by part, and by what every key and person is held to, asked of the old table
first so that what it had worked out must not survive a change it depends on.
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw import rules, store
from llmgw.gateway.keytable import KeyTable
from llmgw.people import accounts, keys, limits, memberships, orgtree
from llmgw.wire import gateways, keychanges

PEOPLE = [f"u{i}" for i in range(5)]
PROJECTS = [f"p{i}" for i in range(4)]
TEAMS = ["t0", "t1"]
ORGS = ["o0", "o1"]
SCOPES = ("cluster", "org", "team", "project", "project_member", "user", "key")
SIDS = ["", *PROJECTS, *TEAMS, *ORGS, *PEOPLE, "k0", "k1", "k2"]  # some keys' ids

maybe_count = st.none() | st.integers(0, 10**6)
limit_values = st.tuples(maybe_count, maybe_count, maybe_count, st.none() | st.sampled_from(rules.PERIODS),
                         st.none() | st.lists(st.sampled_from(["a", "b", "c"]), max_size=2, unique=True),
                         st.none() | st.sampled_from(rules.BANDS))


@st.composite
def key_sets(draw, revision: int) -> dict:
    entries = {}
    for hash_ in draw(st.lists(st.sampled_from([f"{i:064x}" for i in range(8)]), unique=True, max_size=8)):
        key_id = f"k{int(hash_, 16)}"  # a key's id and hash never part
        project_id = draw(st.none() | st.sampled_from(PROJECTS))
        entries[hash_] = {"hash": hash_, "id": key_id, "name": draw(st.sampled_from(["ci", "laptop"])),
                          "project_id": project_id, "project": project_id or "personal", "prefix": "sk-llmgw-x",
                          "created_at": 1.0, "expires_at": draw(st.none() | st.just(2e9)),
                          "revoked_at": draw(st.none() | st.just(5.0)),
                          "user_id": draw(st.none() | st.sampled_from(PEOPLE))}
    limit_rows = draw(st.dictionaries(st.tuples(st.sampled_from(SCOPES), st.sampled_from(SIDS)), limit_values,
                                      max_size=8))
    profiles = draw(st.dictionaries(st.tuples(st.sampled_from(SCOPES + ("personal",)), st.sampled_from(SIDS)),
                                    st.sampled_from(["fast", "cheap"]), max_size=3))
    personal = draw(st.none() | st.tuples(limit_values, st.booleans()))
    people = draw(st.lists(st.sampled_from(PEOPLE), unique=True))
    return {"revision": revision, "keys": list(entries.values()),
            **({"personal": [*personal[0], personal[1]]} if personal else {}),
            "profiles": [[scope, sid, name] for (scope, sid), name in profiles.items()],
            "limits": [[scope, sid, *values] for (scope, sid), values in limit_rows.items()],
            "parents": draw(st.dictionaries(st.sampled_from(PROJECTS), st.tuples(st.sampled_from(TEAMS),
                                                                              st.sampled_from(ORGS)).map(list))),
            "team_org": draw(st.dictionaries(st.sampled_from(TEAMS), st.sampled_from(ORGS))),
            "prices": [[m, i, o] for m, (i, o) in draw(st.dictionaries(st.sampled_from(["*", "a", "b"]), st.tuples(
                st.integers(0, 100), st.integers(0, 100)))).items()],
            "suspended": [p for p in PEOPLE if p not in people], "active": people,
            "admins": draw(st.lists(st.sampled_from(people), unique=True)) if people else [],
            "threads": [[p, h] for p, h in draw(st.dictionaries(st.sampled_from(PROJECTS), st.sampled_from([1, 24]))).items()],
            "memory": [[p, h] for p, h in draw(st.dictionaries(st.sampled_from(PROJECTS), st.just(48))).items()]}


def wire(kind: str, **fields) -> dict:
    """FIELDS as a gateway reads them: encoded, then decoded and checked against the schema."""
    return gateways.decode(gateways.encode(kind, epoch="e", **fields))


def asked(table: KeyTable) -> dict:
    """What every key and person is held to, asked of TABLE (which remembers what it worked out)."""
    return {**{r.id + h: table.access(r) for h, r in table.by_hash.items()},
            **{p: table.person(p) for p in PEOPLE}}


def same(changed: KeyTable, whole: KeyTable) -> None:
    assert changed.revision == whole.revision
    assert changed.by_hash == whole.by_hash
    assert changed.rules.limits == whole.rules.limits
    assert changed.rules.parents == whole.rules.parents and changed.rules.team_org == whole.rules.team_org
    assert changed.prices.by_model == whole.prices.by_model and changed.prices.fallback == whole.prices.fallback
    assert (changed.suspended, changed.active_people, changed.admins) == (whole.suspended, whole.active_people,
                                                                        whole.admins)
    assert (changed.threads, changed.memory) == (whole.threads, whole.memory)
    assert asked(changed) == asked(whole)


@settings(max_examples=300, deadline=None)
@given(key_sets(1), key_sets(2))
def test_any_change_applied_is_the_whole_set(old, new):
    held = KeyTable.from_message(wire("keys", **old))
    asked(held)  # worked out at the old revision: what the change touches must be worked out again
    changes = keychanges.difference(keychanges.view(old), keychanges.view(new))
    same(held.changed(wire("key_changes", base=1, revision=2, **changes)), KeyTable.from_message(wire("keys", **new)))


def test_nothing_changed_is_an_empty_message_and_the_same_parts():
    whole = {"revision": 3, "keys": [], "limits": [["key", "k", 5, None, None, None, None, None]], "parents": {},
             "team_org": {}, "prices": [], "suspended": [], "active": ["u0"]}
    assert keychanges.difference(keychanges.view(whole), keychanges.view(whole)) == {}
    held = KeyTable.from_message(wire("keys", **whole))
    after = held.changed(wire("key_changes", base=3, revision=4))
    assert after.revision == 4 and after.rules is held.rules and after.by_hash is held.by_hash


def test_a_store_changed_every_way_a_person_can(engine):
    """From a real store: the changes an operator and people make, each sent as changes and checked whole."""
    orgtree.add(engine, "org", "acme")
    orgtree.add(engine, "team", "ml", "acme")
    project = orgtree.add(engine, "project", "chat", "acme/ml")
    ayse = accounts.create_user(engine, "ayse@example.com", "a long password", state="active")
    first, _ = keys.create_key(engine, "first", project.id)
    gone, _ = keys.create_key(engine, "gone", project.id, user_id=ayse.id)
    before = keys.key_set(engine)
    held = KeyTable.from_message(wire("keys", **before))
    asked(held)
    keys.create_key(engine, "new", None, user_id=ayse.id, profile="fast")
    keys.revoke_key(engine, gone.id)
    limits.set_limits(engine, "project", project.id, "test", rpm=60, models=["sim"])
    limits.set_limits(engine, "key", first.id, "test", band="low")
    orgtree.rename(engine, "project", "acme/ml/chat", "talk")
    accounts.suspend(engine, ayse.email)
    limits.set_price(engine, "sim", "1", "2", "test")
    after = keys.key_set(engine)
    changes = keychanges.difference(keychanges.view(before), keychanges.view(after))
    assert {e["name"] for e in changes["keys"]} == {"new", "gone", "first"}  # made, revoked, renamed project
    assert changes["suspended"] == [ayse.id] and changes["active_gone"] == [ayse.id]
    changed = held.changed(wire("key_changes", base=before["revision"], revision=after["revision"], **changes))
    same(changed, KeyTable.from_message(wire("keys", **after)))
    assert changed.access(changed.by_hash[next(h for h, r in changed.by_hash.items() if r.id == first.id)]).band == "low"


def test_the_controller_sends_changes_then_the_whole_set_made_from_what_it_holds(engine, monkeypatch):
    from llmgw.control.publisher import KeyPusher

    pusher = KeyPusher(engine, "epoch-1")
    try:
        pusher.check()
        ((topic, whole),) = pusher.take()  # a controller's first word is the whole set: it knows no base
        assert topic == gateways.KEYS and gateways.keys_revision(whole) == gateways.decode(whole)["revision"]
        read_whole = keys.key_set
        monkeypatch.setattr(keys, "key_set", lambda engine: pytest.fail("the whole set read for a named change"))
        made, _ = keys.create_key(engine, "new")
        pusher.check()
        ((changes_topic, changes),) = pusher.take()  # the change alone, read alone
        assert changes_topic == gateways.KEY_CHANGES
        message = gateways.decode(changes)
        assert message["base"] == gateways.keys_revision(whole) and message["revision"] == keys.current_revision(engine)
        assert [e["id"] for e in message["keys"]] == [made.id] and set(message) <= {"v", "type", "epoch", "base",
                                                                                 "revision", "keys"}
        pusher.check()
        ((topic, again),) = pusher.take()  # at the next look, the whole set, made from what the controller holds
        assert topic == gateways.KEYS and gateways.keys_revision(again) == message["revision"]
        assert keychanges.view(gateways.decode(again)) == keychanges.view(wire("keys", **read_whole(engine)))
        pusher.check()
        assert pusher.take() == []  # nothing changed, and the repeat is not due
        pusher.sent_at -= gateways.KEYS_REPEAT
        pusher.check()
        assert pusher.take() == [(gateways.KEYS, again)]  # the same bytes: not read nor encoded again
        # A set that takes long to make follows changes, and is repeated, only ten times what it took apart.
        pusher.made_s = 5.0
        keys.create_key(engine, "another")
        pusher.check()
        assert [topic for topic, _ in pusher.take()] == [gateways.KEY_CHANGES]
        pusher.sent_at -= gateways.KEYS_REPEAT
        pusher.check()
        assert pusher.take() == []
        pusher.sent_at -= 40.0
        pusher.check()
        assert [topic for topic, _ in pusher.take()] == [gateways.KEYS]
    finally:
        pusher.close()


def test_each_change_a_writer_names_is_read_alone_and_makes_what_the_whole_set_would(engine):
    orgtree.add(engine, "org", "acme")
    orgtree.add(engine, "team", "ml", "acme")
    project = orgtree.add(engine, "project", "chat", "acme/ml")
    ayse = accounts.create_user(engine, "ayse@example.com", "a long password", state="active")
    deniz = accounts.create_user(engine, "deniz@example.com", "a long password")  # waits for approval
    first, _ = keys.create_key(engine, "first", project.id, user_id=ayse.id)
    seen = keychanges.view(keys.key_set(engine))
    held = KeyTable.from_message(wire("keys", **keys.key_set(engine)))
    changes_of = [
        lambda: keys.create_key(engine, "new", None, user_id=ayse.id, profile="fast", models=["sim"]),
        lambda: keys.revoke_key(engine, first.id),
        lambda: limits.set_limits(engine, "key", first.id, "test", rpm=5, band="low"),
        lambda: limits.set_limits(engine, "user", ayse.id, "test", budget=10**6, period="day"),
        lambda: limits.set_limits(engine, "personal", "", "test", rpm=3, disabled=True, profile="cheap"),
        lambda: limits.set_limits(engine, "cluster", "", "test", tpm=1000),
        lambda: limits.set_limits(engine, "project", project.id, "test", rpm=60, models=["sim"]),
        lambda: limits.set_limits(engine, "key", first.id, "test", rpm=None, band=None),  # cleared: gone
        lambda: accounts.approve(engine, deniz.email, "test"),
        lambda: accounts.promote(engine, deniz.email),
        lambda: accounts.suspend(engine, ayse.email),
        lambda: accounts.reinstate(engine, ayse.email),
        lambda: accounts.create_user(engine, "ece@example.com", "a long password", state="active"),
        lambda: memberships.join(engine, deniz.email, "project", "acme/ml/chat"),  # nothing gateways hold
        lambda: keys.create_key(engine, "deniz's", project.id, user_id=deniz.id, made_by=deniz.id),
        lambda: memberships.leave(engine, deniz.email, "project", "acme/ml/chat"),  # the key he made revoked
        lambda: accounts.remove(engine, ayse.email),  # her keys revoked, her own limits gone
    ]
    for change in changes_of:
        revision = keys.current_revision(engine)
        change()
        changed = keys.changed_since(engine, revision)
        assert changed is not None and changed["revision"] == revision + 1
        message = keychanges.advance(seen, changed)
        whole = keys.key_set(engine)
        assert seen == keychanges.view(whole)
        assert keychanges.view(wire("keys", **keychanges.message_of(seen, whole["revision"]))) == seen
        held = held.changed(wire("key_changes", base=revision, revision=changed["revision"], **message))
        same(held, KeyTable.from_message(wire("keys", **whole)))
    # Several changes read at once; nothing changed is nothing read.
    revision = keys.current_revision(engine)
    keys.create_key(engine, "one", project.id)
    keys.create_key(engine, "two", project.id)
    changed = keys.changed_since(engine, revision)
    assert {e["name"] for e in changed["keys"]} == {"one", "two"}
    assert keys.changed_since(engine, changed["revision"])["keys"] == []


def test_what_a_writer_did_not_name_reaches_gateways_at_the_next_whole_read(engine, caplog):
    from llmgw.control.publisher import KEYS_WHOLE_EVERY, KeyPusher

    made, _ = keys.create_key(engine, "quiet")
    pusher = KeyPusher(engine, "epoch-1")
    try:
        pusher.check()
        held = KeyTable.from_message(gateways.decode(pusher.take()[0][1]))
        # A writer that revokes a key and names nothing gateways hold: the change read alone sends nothing of it.
        with store.writing(engine) as conn:
            conn.execute(store.api_keys.update().where(store.api_keys.c.id == made.id).values(revoked_at=5.0))
            store.bump_revision(conn, "keys", [("none", "")])
        pusher.check()
        ((topic, empty),) = [m for m in pusher.take() if m[0] == gateways.KEY_CHANGES]
        held = held.changed(gateways.decode(empty))
        assert next(r for r in held.by_hash.values() if r.id == made.id).revoked_at is None
        # The whole read finds it at the revision gateways hold, which they take no changes at: the revision
        # moves, and the next look sends the difference.
        pusher.read_whole_at -= KEYS_WHOLE_EVERY
        pusher.check()
        assert "a writer named less than it changed" in caplog.text and pusher.take() == []
        pusher.check()
        (topic, fix), (whole_topic, _whole) = pusher.take()
        assert (topic, whole_topic) == (gateways.KEY_CHANGES, gateways.KEYS)
        held = held.changed(gateways.decode(fix))
        assert next(r for r in held.by_hash.values() if r.id == made.id).revoked_at == 5.0
    finally:
        pusher.close()


def test_while_changes_keep_coming_the_whole_set_follows_a_repeat_apart(engine):
    from llmgw.control.publisher import KeyPusher

    pusher = KeyPusher(engine, "epoch-1")
    try:
        pusher.check()
        pusher.take()
        sent = []
        for i in range(6):  # a change before every look: no look finds the revision still
            keys.create_key(engine, f"burst-{i}")
            if i == 3:
                pusher.sent_at -= gateways.KEYS_REPEAT  # a repeat's time has passed since the last whole set
            pusher.check()
            sent += [topic for topic, _ in pusher.take()]
        assert sent.count(gateways.KEY_CHANGES) == 6 and sent.count(gateways.KEYS) == 1
        assert sent.index(gateways.KEYS) == 4  # after the changes of that look
    finally:
        pusher.close()


def test_a_change_that_names_nothing_or_is_missing_is_read_whole(engine):
    orgtree.add(engine, "org", "acme")
    revision = keys.current_revision(engine)
    orgtree.rename(engine, "org", "acme", "acme-corp")  # every key under it carries its path: named nothing
    assert keys.changed_since(engine, revision) is None
    revision = keys.current_revision(engine)
    limits.set_price(engine, "sim", "1", "2", "test")
    assert keys.changed_since(engine, revision) is None
    # A writer of the version before moves the revision and writes nothing of what changed.
    revision = keys.current_revision(engine)
    with store.writing(engine) as conn:
        conn.execute(store.revisions.update().where(store.revisions.c.name == "keys")
                     .values(value=store.revisions.c.value + 1))
    keys.create_key(engine, "after", None, user_id=accounts.create_user(
        engine, "ece@example.com", "a long password", state="active").id)
    assert keys.changed_since(engine, revision) is None
    assert keys.changed_since(engine, revision + 1) is not None  # past it, changes are named again
    # A writer of a later version naming what this one does not know.
    revision = keys.current_revision(engine)
    with store.writing(engine) as conn:
        store.bump_revision(conn, "keys", [("project", "p1")])
    assert keys.changed_since(engine, revision) is None


def test_a_held_set_is_dropped_unread_and_an_old_gateway_never_hears_changes():
    import threading

    import zmq

    from llmgw.gateway.follower import follow
    from llmgw.procs import free_port, wait_for

    context = zmq.Context()
    port = free_port()
    pub = context.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    old = context.socket(zmq.SUB)
    old.setsockopt(zmq.SUBSCRIBE, gateways.KEYS)  # what a gateway of the version before subscribes to
    old.connect(f"tcp://127.0.0.1:{port}")
    heard: list = []
    held = {"revision": 4}
    whole = {"revision": 4, "keys": [], "limits": [], "parents": {}, "team_org": {}, "prices": [], "suspended": [],
             "active": []}
    threading.Thread(target=follow, daemon=True, args=([f"127.0.0.1:{port}"], None, None,
                                                       lambda m: heard.append(("keys", m["revision"])), None, context),
                     kwargs={"on_key_changes": lambda m: heard.append(("changes", m["revision"])),
                             "keys_held": lambda revision: revision == held["revision"]}).start()
    try:
        def send(topic, kind, **fields):
            pub.send_multipart([topic, gateways.encode(kind, epoch="e", **fields)])

        # A SUB hears only what is sent after it joined: send until the first whole set arrives.
        wait_for("the follower to hear a whole set", 30,
                 lambda: send(gateways.KEYS, "keys", **{**whole, "revision": 3}) or heard)
        send(gateways.KEYS, "keys", **whole)  # the revision held: dropped unread
        send(gateways.KEY_CHANGES, "key_changes", base=4, revision=5, active=["u1"])
        send(gateways.KEYS, "keys", **{**whole, "revision": 5, "active": ["u1"]})
        wait_for("the changes and the next whole set", 30, lambda: heard[-1] == ("keys", 5))
        assert [h for h in heard if h[1] != 3] == [("changes", 5), ("keys", 5)]
        topics = set()
        while old.poll(1000):
            topics.add(old.recv_multipart()[0])
        assert topics == {gateways.KEYS}
    finally:
        pub.close(0)
        old.close(0)


def test_what_is_published_between_subscribing_and_following_is_taken():
    """A worker subscribes before it reads the keys at its start, and follows once it has them: a change made
    during the read waits in the socket and is taken."""
    import threading

    import zmq

    from llmgw.gateway.follower import follow, subscribe
    from llmgw.procs import free_port, wait_for

    context = zmq.Context()
    port = free_port()
    pub = context.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    sock = subscribe([f"127.0.0.1:{port}"], None, context)
    heard: list = []
    probes = [0]
    try:
        def joined() -> bool:  # a SUB hears only what is sent after it joined
            probes[0] += 1
            pub.send_multipart([gateways.LEADING, b"%d" % probes[0]])
            return bool(sock.poll(50))

        wait_for("the subscription to reach the publisher", 30, joined)
        # Messages arrive in order: once the last probe is read, none is still on its way.
        while sock.recv_multipart()[1] != b"%d" % probes[0]:
            pass
        # The worker is reading its keys: nothing takes messages from the socket yet. The change is in the
        # socket before following begins (sent is not yet arrived: once on CI, a loaded machine's follower
        # found the socket empty, said it had caught up, and only then got the change).
        pub.send_multipart([gateways.KEY_CHANGES, gateways.encode("key_changes", epoch="e", base=4, revision=5)])
        wait_for("the change to arrive", 30, lambda: sock.poll(50))
        threading.Thread(target=follow, daemon=True, args=([], None, None, None, lambda m, host: None),
                         kwargs={"on_key_changes": lambda m: heard.append(m["revision"]), "subscribed": sock,
                                 "caught_up": lambda: heard.append("caught up")}).start()
        wait_for("the change sent before following, then the end of what was held", 30,
                 lambda: heard[-2:] == [5, "caught up"])
    finally:
        pub.close(0)


def test_only_the_controllers_own_beginning_is_read_short():
    message = gateways.encode("keys", epoch="e", revision=9, keys=[], limits=[], parents={}, team_org={}, prices=[],
                              suspended=[], active=[])
    assert gateways.keys_revision(message) == 9
    reordered = json.dumps({"v": 1, "type": "keys", "revision": 9, "epoch": "e"}).encode()
    assert gateways.keys_revision(reordered) is None  # read whole, as any other writer's
    assert gateways.keys_revision(b'{"v":1,"type":"keys","epoch":"a\\"","revision":9,') is None
    assert gateways.keys_revision(message.replace(b'"v":1', b'"v":2')) is None


def _whole(revision: int, **fields) -> dict:
    return wire("keys", **{"revision": revision, "keys": [], "limits": [], "parents": {}, "team_org": {},
                           "prices": [], "suspended": [], "active": [], **fields})


def test_a_workers_own_read_takes_changes_at_once_and_passes_over_what_was_sent_before_it():
    from llmgw.gateway.keytable import HeldKeys

    own_read = KeyTable.from_message(_whole(5, active=["u0"]))  # a worker's read of the store at its start
    held = HeldKeys(own_read, read_here=True)
    # Published during the read and waiting in the socket: a set and a change below it, passed over unread.
    assert held.holds(4) and held.whole(_whole(4, active=["old"])) is None and held.trusted
    assert held.changes(wire("key_changes", base=3, revision=4, active=["x"])) is None
    assert held.holds(5) and not held.holds(None)  # the controller's set at the revision read: dropped unread
    changed = held.changes(wire("key_changes", base=5, revision=6, active=["u1"]))
    assert changed.active_people == {"u0", "u1"} and held.holds(6) and not held.holds(7)
    assert held.changes(wire("key_changes", base=4, revision=7, active=["x"])) is None  # not from the one held
    # The controller heard at and past the revision read: a set below it now is a store gone back.
    assert not held.holds(3)
    assert held.whole(_whole(3, active=["old"])) is None and not held.trusted and not held.holds(6)
    assert held.changes(wire("key_changes", base=6, revision=7, active=["x"])) is None
    taken = held.whole(_whole(6, active=["u0", "u9"]))  # the controller's set at the revision held is read
    assert taken is not None and taken.active_people == {"u0", "u9"} and held.holds(6)
    assert held.changes(wire("key_changes", base=6, revision=7, active_gone=["u9"])).active_people == {"u0"}
    # Once what was published during the read has been read, a set below it is a store gone back too.
    held = HeldKeys(KeyTable.from_message(_whole(5)), read_here=True)
    held.caught_up()
    assert not held.holds(4) and held.whole(_whole(4)) is None and not held.trusted


def test_a_worker_starts_from_its_own_read_or_its_masters_newer_table_trusted_as_the_master_trusts_it():
    from llmgw.gateway.keytable import HeldKeys

    own = KeyTable.from_message(_whole(5, active=["own"]))
    assert HeldKeys.at_start(own, None).table is own and HeldKeys.at_start(own, None).holds(5)
    older = KeyTable.from_message(_whole(4))
    kept = HeldKeys.at_start(own, (older, True))  # a master behind its worker's read: the read is kept
    assert kept.table is own and kept.changes(wire("key_changes", base=5, revision=6, active=["x"])) is not None
    newer = KeyTable.from_message(_whole(9, active=["later"]))
    trusted = HeldKeys.at_start(own, (newer, True))
    assert trusted.table is newer and trusted.holds(9) and not trusted.holds(8)  # no read of its own to be ahead of
    # A master that kept its table over a store gone back: the worker takes it, and no change until a whole set.
    untrusted = HeldKeys.at_start(own, (newer, False))
    assert untrusted.table is newer and not untrusted.holds(9)
    assert untrusted.changes(wire("key_changes", base=9, revision=10, active=["x"])) is None


def test_a_store_restored_from_a_backup_heals_at_the_revision_held(caplog):
    from llmgw.gateway.keytable import HeldKeys

    held = HeldKeys(KeyTable({}, -1))
    held.whole(_whole(9, active=["later"]))  # held before the restore
    assert held.whole(_whole(4, active=["before"])) is None  # the store went back: kept, and said
    assert "restored from a backup" in caplog.text and not held.holds(9)
    assert held.changes(wire("key_changes", base=9, revision=10, active=["x"])) is None
    back = held.whole(_whole(9, active=["since"]))  # the restored store's own 9 is not the 9 held
    assert back.active_people == {"since"} and held.holds(9)


def test_the_set_is_read_at_one_moment(engine):
    """A revision read first must not label rows changed after it (PostgreSQL's default isolation would)."""
    from llmgw import store

    record, _ = keys.create_key(engine, "seen")
    with store.one_moment(engine) as conn:
        revision = store.read_revision(conn, "keys")
        keys.revoke_key(engine, record.id)  # committed by another connection meanwhile
        row = conn.execute(store.api_keys.select().where(store.api_keys.c.id == record.id)).one()
        assert row.revoked_at is None and store.read_revision(conn, "keys") == revision
