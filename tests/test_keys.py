import time

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from llmgw import store
from llmgw.cli.main import main
from llmgw.gateway.keytable import KeyTable
from llmgw.people import keys
from llmgw.principals import KeyRecord, hash_secret


def test_secret_is_stored_only_as_a_hash(store_url):
    engine = store.open_engine(store_url)
    record, secret = keys.create_key(engine, "alice")
    assert secret.startswith("sk-llmgw-") and len(secret) > 40
    assert record.prefix == secret[:keys.DISPLAY_CHARS]
    with engine.connect() as conn:
        row = conn.execute(store.api_keys.select()).one()
    assert row.hash == hash_secret(secret)
    assert secret not in [str(v) for v in row]
    engine.dispose()


def test_key_table_authenticates_from_memory(store_url):
    engine = store.open_engine(store_url)
    _, secret = keys.create_key(engine, "alice")
    table = KeyTable.from_message(keys.key_set(engine))
    now = time.time()
    assert isinstance(table.authenticate(f"Bearer {secret}", now), KeyRecord)
    assert table.authenticate(None, now).code == "missing_api_key"
    assert table.authenticate("Basic abc", now).code == "invalid_api_key"
    assert table.authenticate("Bearer sk-llmgw-nope", now).code == "invalid_api_key"
    engine.dispose()


def test_revoked_and_expired_keys_are_refused_with_the_reason(store_url):
    engine = store.open_engine(store_url)
    revoked, revoked_secret = keys.create_key(engine, "gone")
    _, expiring_secret = keys.create_key(engine, "brief", expires_in=60)
    keys.revoke_key(engine, revoked.id)
    table = KeyTable.from_message(keys.key_set(engine))
    assert table.authenticate(f"Bearer {revoked_secret}", time.time()).code == "revoked_api_key"
    assert isinstance(table.authenticate(f"Bearer {expiring_secret}", time.time()), KeyRecord)
    # Expiry needs no refresh of the table: the clock decides.
    assert table.authenticate(f"Bearer {expiring_secret}", time.time() + 61).code == "expired_api_key"
    engine.dispose()


def test_every_change_bumps_the_revision_workers_watch(store_url):
    engine = store.open_engine(store_url)
    first = keys.current_revision(engine)
    record, _ = keys.create_key(engine, "a")
    assert keys.current_revision(engine) == first + 1
    keys.revoke_key(engine, record.prefix)
    assert keys.current_revision(engine) == first + 2
    keys.revoke_key(engine, record.id)  # already revoked: nothing changes
    assert keys.current_revision(engine) == first + 2
    engine.dispose()


def test_revoke_refuses_an_ambiguous_or_unknown_key(store_url):
    engine = store.open_engine(store_url)
    keys.create_key(engine, "same")
    keys.create_key(engine, "same")
    with pytest.raises(keys.KeyRefused, match="2 keys match 'same'"):
        keys.revoke_key(engine, "same")
    with pytest.raises(keys.KeyRefused, match="llmgw keys list"):
        keys.revoke_key(engine, "nothing-like-it")
    with pytest.raises(keys.KeyRefused, match="no project 'nope'; projects: default/default/default"):
        keys.create_key(engine, "x", project="nope")
    engine.dispose()


@pytest.mark.parametrize("text, seconds", [("30d", 30 * 86400), ("12h", 43200), ("90m", 5400), ("2w", 1209600)])
def test_durations(text, seconds):
    assert keys.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "30", "d", "1.5d", "0d", "-1d", "3y"])
def test_bad_durations(text):
    with pytest.raises(ValueError, match="such as 30d"):
        keys.parse_duration(text)


def test_cli_prints_the_secret_alone_on_stdout(store_url):
    runner = CliRunner()
    result = runner.invoke(main, ["--store", store_url, "keys", "create", "ci-bot", "--expires-in", "30d"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().startswith("sk-llmgw-")
    assert len(result.stdout.strip().splitlines()) == 1
    assert "will not be shown again" in result.stderr and "expires" in result.stderr

    listed = runner.invoke(main, ["--store", store_url, "keys", "list"])
    assert "ci-bot" in listed.stdout and result.stdout.strip() not in listed.stdout
    assert "expires" in listed.stdout

    prefix = result.stdout.strip()[:keys.DISPLAY_CHARS]
    revoked = runner.invoke(main, ["--store", store_url, "keys", "revoke", prefix])
    assert revoked.exit_code == 0 and "revoked key" in revoked.stderr
    assert runner.invoke(main, ["--store", store_url, "keys", "list", "--json"]).stdout == ""  # what works, by default
    listed = runner.invoke(main, ["--store", store_url, "keys", "list", "--json", "--all"])
    assert '"ci-bot"' in listed.stdout and '"revoked_at": null' not in listed.stdout
    said = runner.invoke(main, ["--store", store_url, "keys", "list"])
    assert "no key works now; --all lists the 1 revoked or expired" in said.stderr


def test_keys_are_listed_a_page_at_a_time_and_a_script_gets_them_all(store_url):
    engine = store.open_engine(store_url)
    made = [keys.create_key(engine, f"k{i:03d}")[0] for i in range(105)]
    keys.revoke_key(engine, made[3].id)
    engine.dispose()
    runner = CliRunner()
    first = runner.invoke(main, ["--store", store_url, "keys", "list"])
    assert first.exit_code == 0, first.output
    names = [line.split()[1] for line in first.stdout.splitlines()[1:]]
    assert len(names) == 100 and names[:4] == ["k000", "k001", "k002", "k004"]  # the revoked one left out
    last = made[100].id
    assert f"100 of 104 keys shown; the next: llmgw keys list --after {last}; every key: --limit 0" in first.stderr
    rest = runner.invoke(main, ["--store", store_url, "keys", "list", "--after", last])
    assert [line.split()[1] for line in rest.stdout.splitlines()[1:]] == ["k101", "k102", "k103", "k104"]
    assert rest.stderr == ""  # nothing follows
    small = runner.invoke(main, ["--store", store_url, "keys", "list", "--all", "--limit", "2", "--after", made[2].id])
    assert [line.split()[1] for line in small.stdout.splitlines()[1:]] == ["k003", "k004"]
    assert f"--all --after {made[4].id}" in small.stderr
    every = runner.invoke(main, ["--store", store_url, "keys", "list", "--json"])
    assert len(every.stdout.splitlines()) == 104 and every.stderr == ""  # a script is not cut short
    unknown = runner.invoke(main, ["--store", store_url, "keys", "list", "--after", "nokey"])
    assert unknown.exit_code == 2 and "no key has the id 'nokey'" in unknown.stderr


def test_cli_errors_say_what_to_do(tmp_path):
    url = f"sqlite:///{tmp_path}/cli.db"
    runner = CliRunner()
    bad = runner.invoke(main, ["--store", url, "keys", "create", "x", "--expires-in", "soon"])
    assert bad.exit_code == 2 and "such as 30d" in bad.stderr
    unknown = runner.invoke(main, ["--store", url, "keys", "revoke", "zzz"])
    assert unknown.exit_code == 1 and "llmgw keys list" in unknown.stderr
    empty = runner.invoke(main, ["--store", url, "keys", "list"])
    assert "llmgw keys create NAME" in empty.stderr


def test_cli_reads_the_gateways_configuration(tmp_path):
    config = tmp_path / "gw.toml"
    config.write_text(f'[store]\nurl = "sqlite:///{tmp_path}/from-config.db"\n')
    result = CliRunner().invoke(main, ["--config", str(config), "keys", "create", "x"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "from-config.db").exists()


def test_users_cli(store_url):
    runner = CliRunner()
    made = runner.invoke(main, ["--store", store_url, "users", "create", "ops@example.org", "--admin"],
                         input="a long enough password\na long enough password\n")
    assert made.exit_code == 0 and "an administrator" in made.stderr
    from llmgw.people import accounts

    engine = store.open_engine(store_url)
    accounts.create_user(engine, "new@example.org", "another long password")
    listed = runner.invoke(main, ["--store", store_url, "users", "list", "--pending"])
    assert "new@example.org" in listed.stdout and "ops@example.org" not in listed.stdout
    approved = runner.invoke(main, ["--store", store_url, "users", "approve", "new@example.org", "--by", "ilker"])
    assert approved.exit_code == 0, approved.output
    assert accounts.find(engine, "new@example.org").approved_by == "ilker"  # kept with the account, and shown
    assert "ilker" in runner.invoke(main, ["--store", store_url, "users", "list"]).stdout
    assert '"approved_by": "ilker"' in runner.invoke(main, ["--store", store_url, "users", "list", "--json"]).stdout
    again = runner.invoke(main, ["--store", store_url, "users", "approve", "new@example.org"])
    assert again.exit_code == 1 and "not waiting for approval" in again.stderr
    user = accounts.find(engine, "new@example.org")
    keys.create_key(engine, "theirs", user_id=user.id)
    assert runner.invoke(main, ["--store", store_url, "users", "suspend", user.id]).exit_code == 0
    assert runner.invoke(main, ["--store", store_url, "users", "reinstate", user.id]).exit_code == 0
    assert runner.invoke(main, ["--store", store_url, "users", "remove", user.id]).exit_code == 0
    assert keys.list_keys(engine)[0].revoked_at is not None  # a removed account's keys stop working
    missing = runner.invoke(main, ["--store", store_url, "users", "promote", "ghost@example.org"])
    assert missing.exit_code == 1 and "llmgw users list" in missing.stderr
    engine.dispose()


def test_every_change_to_a_person_moves_the_key_revision(store_url):
    # Gateways hold who is active beside the keys and reload both when the revision moves: a suspended
    # person's key once kept working until some unrelated key changed.
    from llmgw.people import accounts

    engine = store.open_engine(store_url)
    accounts.create_user(engine, "admin@example.org", "a long enough password", state=accounts.ACTIVE, is_admin=True)
    seen = [keys.current_revision(engine)]

    def moved(change) -> None:
        change()
        seen.append(keys.current_revision(engine))
        assert seen[-1] > seen[-2], change

    moved(lambda: accounts.create_user(engine, "bob@example.org", "a long enough password"))
    table = KeyTable.from_message(keys.key_set(engine))
    bob = accounts.find(engine, "bob@example.org")
    assert bob.id not in table.active_people
    moved(lambda: accounts.approve(engine, "bob@example.org", "admin@example.org"))
    assert bob.id in KeyTable.from_message(keys.key_set(engine)).active_people  # may chat at once
    moved(lambda: accounts.promote(engine, "bob@example.org"))
    moved(lambda: accounts.promote(engine, "bob@example.org", admin=False))
    moved(lambda: accounts.suspend(engine, "bob@example.org"))
    moved(lambda: accounts.reinstate(engine, "bob@example.org"))
    moved(lambda: accounts.remove(engine, "bob@example.org"))
    engine.dispose()


def test_a_suspended_persons_key_stops_on_every_worker_of_every_gateway_within_a_second(tmp_path, make_gateway):
    from llmgw.people import accounts
    from tests.cluster import Controller
    from tests.conftest import wait_until
    from tests.test_wire_auth import status_of

    url = f"sqlite:///{tmp_path}/c.db"
    c = Controller(tmp_path, store_url=url)
    gws = [make_gateway(store_url=url, workers=2, gateway__controller=f"127.0.0.1:{c.gateway_port}",
                        gateway__key_file=c.gateway_key_file(f"gw{i}")) for i in range(2)]
    engine = store.open_engine(url)
    try:
        bob = accounts.create_user(engine, "bob@example.org", "a long enough password", state=accounts.ACTIVE)
        _, secret = keys.create_key(engine, "bobs", user_id=bob.id)
        wait_until("bob's key on every worker", 30, lambda: all(status_of(g, secret) == 200 for g in gws for _ in range(8)))
        for change, status in ((accounts.suspend, 401), (accounts.reinstate, 200)):
            change(engine, "bob@example.org")
            changed_at = time.monotonic()
            wait_until(f"{change.__name__} on every worker", 10,
                       lambda want=status: all(status_of(g, secret) == want for g in gws for _ in range(8)),
                       interval=0.02)
            took = time.monotonic() - changed_at
            print(f"{change.__name__} reached every worker of 2 gateways in {took:.3f} s")
            # The aim is 1 s, as for a revoked key; a busy 2-core machine may stretch it, never past 2 s.
            assert took < 2.0, took
    finally:
        engine.dispose()
        c.stop()


def test_a_key_spends_in_the_one_project_or_says_which_to_choose(tmp_path):
    # A tree built on the pages may have no default/default/default: the command once put such keys there.
    from llmgw.people import orgtree

    url = f"sqlite:///{tmp_path}/k.db"
    runner = CliRunner()
    made = runner.invoke(main, ["--store", url, "keys", "create", "only"])
    assert made.exit_code == 0 and "in project default/default/default" in made.stderr, made.output
    engine = store.open_store(url)
    try:
        orgtree.add(engine, "project", "training", "default/default")
    finally:
        engine.dispose()
    unsaid = runner.invoke(main, ["--store", url, "keys", "create", "which"])
    assert unsaid.exit_code == 2 and unsaid.stdout == ""
    assert ("say which project the key spends in with --project; there are 2: default/default/default, "
            "default/default/training") in unsaid.stderr
    made = runner.invoke(main, ["--store", url, "keys", "create", "ci", "--project", "training"])
    assert made.exit_code == 0 and "in project default/default/training" in made.stderr

    listed = runner.invoke(main, ["--store", url, "keys", "list", "--project", "training"])
    assert "ci" in listed.stdout and "only" not in listed.stdout
    assert runner.invoke(main, ["--store", url, "keys", "list"]).stdout.count("default/default/") == 2
    unknown = runner.invoke(main, ["--store", url, "keys", "list", "--project", "nope"])
    assert unknown.exit_code == 2 and "no project 'nope'" in unknown.stderr
    engine = store.open_store(url)
    try:
        orgtree.add(engine, "project", "empty", "default/default")
    finally:
        engine.dispose()
    none = runner.invoke(main, ["--store", url, "keys", "list", "--project", "empty"])
    assert none.exit_code == 0 and "no keys in default/default/empty yet" in none.stderr


def test_a_claim_link_lasts_what_it_is_given_at_the_address_given(tmp_path):
    url = f"sqlite:///{tmp_path}/c.db"
    runner = CliRunner()
    made = runner.invoke(main, ["--store", url, "keys", "create", "for-deniz", "--claim", "--claim-ttl", "2h",
                                "--base-url", "https://llm.example.org/"])
    assert made.exit_code == 0, made.output
    link = made.stdout.strip()
    assert link.startswith("https://llm.example.org/claim/") and "sk-llmgw-" not in made.stdout
    engine = store.open_store(url)
    try:
        (created, expires), = engine.connect().execute(sa.select(store.key_claims.c.created_at,
                                                                   store.key_claims.c.expires_at)).all()
    finally:
        engine.dispose()
    assert expires - created == 7200
    for args, said in ((["--claim", "--claim-ttl", "soon"], "such as 30d"),
                       (["--claim", "--base-url", "llm.example.org"], "http:// or https://"),
                       (["--base-url", "https://llm.example.org"], "give --claim too")):
        refused = runner.invoke(main, ["--store", url, "keys", "create", "x", *args])
        assert refused.exit_code == 2 and said in refused.stderr, refused.stderr


def test_a_routing_profile_is_given_to_a_key_or_a_project_and_a_name_the_file_lacks_is_noted(tmp_path):
    config = tmp_path / "gw.toml"
    config.write_text(f'[store]\nurl = "sqlite:///{tmp_path}/p.db"\n[[routing_profiles]]\nname = "batch"\n'
                      'policy = "least-load"\n')
    runner = CliRunner()
    made = runner.invoke(main, ["--config", str(config), "keys", "create", "nightly", "--profile", "nightly"])
    assert made.exit_code == 0, made.output
    assert "defines no routing profile 'nightly' (it has: batch)" in made.stderr
    set_on = runner.invoke(main, ["--config", str(config), "limits", "set", "--scope", "project", "--id", "default",
                                  "--profile", "batch"])
    assert set_on.exit_code == 0 and "routing profile batch" in set_on.stderr and "note:" not in set_on.stderr
    shown = runner.invoke(main, ["--config", str(config), "limits", "show", "--json"]).stdout
    assert '"profile": "nightly"' in shown and '"profile": "batch"' in shown
    cleared = runner.invoke(main, ["--config", str(config), "limits", "set", "--scope", "project", "--id", "default",
                                   "--profile", "none"])
    assert cleared.exit_code == 0 and '"profile": "batch"' not in runner.invoke(
        main, ["--config", str(config), "limits", "show", "--json"]).stdout
