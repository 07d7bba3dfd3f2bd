"""Sessions of the pages end for good, sign-in is throttled and hashed off the event loop, the cookie
secret is a private file, and the last administrator cannot be taken away (issue 9, people and sessions)."""

import os
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.cookiejar import CookieJar

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from llmgw import settings, store
from llmgw.cli.main import main as cli
from llmgw.people import accounts, keys, sessions
from llmgw.web import throttle
from llmgw.web.app import GatewayApp
from tests.conftest import counted, wait_until
from tests.test_pages import sign_in, site, token  # noqa: F401  (the fixture and helpers)

PASSWORD = "a long enough password"


def admin_client(site):  # noqa: F811
    pages, engine, _ = site
    accounts.create_user(engine, "root@example.org", PASSWORD, state=accounts.ACTIVE, is_admin=True)
    client = pages.test_client()
    assert sign_in(client, "root@example.org", PASSWORD).status_code == 302
    return client


def copy_of(client, pages):
    """A second client holding the same cookie: what someone who copied it holds."""
    thief = pages.test_client()
    cookie = client.get_cookie("llmgw_session")
    thief.set_cookie("llmgw_session", cookie.value)
    return thief


def signed_in(client, path="/admin/people") -> bool:
    return client.get(path).status_code == 200


def test_a_cookie_copied_before_sign_out_opens_nothing_after_it(site):  # noqa: F811
    pages, engine, _ = site
    client = admin_client(site)
    thief = copy_of(client, pages)
    assert signed_in(thief)
    page = client.get("/account").data
    assert client.post("/logout", data={"csrf_token": token(page)}).status_code == 302
    assert thief.get("/admin/people").headers["Location"].startswith("/login")
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(store.sessions)).scalar_one() == 0


def test_a_password_change_ends_every_other_session_of_the_person(site):  # noqa: F811
    pages, engine, _ = site
    accounts.create_user(engine, "p@example.org", PASSWORD, state=accounts.ACTIVE)
    laptop, phone = pages.test_client(), pages.test_client()
    sign_in(laptop, "p@example.org", PASSWORD)
    sign_in(phone, "p@example.org", PASSWORD)
    page = laptop.get("/account/password").data
    done = laptop.post("/account/password", data={"current": PASSWORD, "password": "n" * 12, "repeat": "n" * 12,
                                                  "csrf_token": token(page)})
    assert b"Password changed" in done.data
    assert signed_in(laptop, "/account")  # the browser that changed it has a new session
    assert not signed_in(phone, "/account")


def test_suspension_ends_sessions_and_reinstating_does_not_revive_them(site):  # noqa: F811
    pages, engine, _ = site
    accounts.create_user(engine, "s@example.org", PASSWORD, state=accounts.ACTIVE)
    client = pages.test_client()
    sign_in(client, "s@example.org", PASSWORD)
    accounts.suspend(engine, "s@example.org")
    accounts.reinstate(engine, "s@example.org")
    assert not signed_in(client, "/account")


def test_sessions_end_when_idle_and_at_their_absolute_lifetime(site):  # noqa: F811
    pages, engine, app = site
    idle, lifetime = app.runtime.cfg["gateway.session_idle"], app.runtime.cfg["gateway.session_lifetime"]
    accounts.create_user(engine, "t@example.org", PASSWORD, state=accounts.ACTIVE)
    s = store.sessions

    def aged(**back):
        client = pages.test_client()
        sign_in(client, "t@example.org", PASSWORD)
        assert signed_in(client, "/account")
        with engine.begin() as conn:  # the newest session, moved into the past
            newest = conn.execute(sa.select(s.c.id).order_by(s.c.created_at.desc())).scalars().first()
            conn.execute(s.update().where(s.c.id == newest).values(
                **{column: s.c[column] - seconds for column, seconds in back.items()}))
        return client

    assert signed_in(aged(seen_at=idle - 120), "/account")  # used two minutes within the idle limit
    assert not signed_in(aged(seen_at=idle + 1), "/account")
    # Used a moment ago, but signed in longer ago than a session may last.
    assert not signed_in(aged(created_at=lifetime + 1, seen_at=30), "/account")


def test_an_administrator_ends_a_persons_sessions_on_the_page_and_with_the_cli(site):  # noqa: F811
    pages, engine, _ = site
    admin = admin_client(site)
    bob = accounts.create_user(engine, "bob@example.org", PASSWORD, state=accounts.ACTIVE)
    browser = pages.test_client()
    sign_in(browser, "bob@example.org", PASSWORD)
    page = admin.get("/admin/people").data.decode()
    assert re.search(r"1 session\s*<form[^>]*>.*?name=\"do\" value=\"end-sessions\"", page)
    admin.post("/admin/people", data={"csrf_token": token(page.encode()), "do": "end-sessions", "user": bob.id})
    assert "Ended 1 session of bob@example.org" in admin.get("/admin/people").data.decode()
    assert not signed_in(browser, "/account")
    sign_in(browser, "bob@example.org", PASSWORD)
    url = str(engine.url)
    result = CliRunner().invoke(cli, ["--store", url, "users", "end-sessions", "bob@example.org"])
    assert result.exit_code == 0 and "ended 1 session(s) of bob@example.org" in result.output
    assert not signed_in(browser, "/account")
    assert signed_in(admin)  # nobody else's


def test_the_chat_endpoint_refuses_an_ended_session(site):  # noqa: F811
    import io
    import json

    pages, engine, app = site
    accounts.create_user(engine, "c@example.org", PASSWORD, state=accounts.ACTIVE)
    client = pages.test_client()
    sign_in(client, "c@example.org", PASSWORD)
    app.runtime.refresh_keys()
    csrf = re.search(r'<meta name="csrf-token" content="([^"]+)"', client.get("/chat").data.decode()).group(1)
    cookie = client.get_cookie("llmgw_session").value

    def status():
        body = json.dumps({"model": "nothing-here", "messages": [{"role": "user", "content": "hi"}]}).encode()
        environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/chat/completions", "wsgi.input": io.BytesIO(body),
                   "CONTENT_LENGTH": str(len(body)), "CONTENT_TYPE": "application/json", "SERVER_NAME": "t",
                   "SERVER_PORT": "80", "wsgi.url_scheme": "http", "REMOTE_ADDR": "127.0.0.1",
                   "HTTP_COOKIE": f"llmgw_session={cookie}", "HTTP_X_CSRF_TOKEN": csrf}
        seen = {}
        b"".join(app(environ, lambda s, h: seen.update(status=s)))
        return int(seen["status"][:3])

    assert status() != 401  # signed in: past the session check (the model is unknown)
    page = client.get("/account").data
    client.post("/logout", data={"csrf_token": token(page)})
    assert status() == 401
    # Suspended: the chat stops at once, on the worker that has not yet heard of it too.
    sign_in(client, "c@example.org", PASSWORD)
    cookie = client.get_cookie("llmgw_session").value
    csrf = re.search(r'<meta name="csrf-token" content="([^"]+)"', client.get("/chat").data.decode()).group(1)
    assert status() != 401
    accounts.suspend(engine, "c@example.org")
    assert status() == 401


# --- the session secret --------------------------------------------------------------------------

def test_the_session_secret_is_a_private_file_and_not_in_the_store(site, tmp_path):  # noqa: F811
    from flask.sessions import SecureCookieSessionInterface

    pages, engine, _ = site
    admin_client(site)
    path = tmp_path / "session.key"
    assert path.exists() and (path.stat().st_mode & 0o777) == 0o600
    with engine.connect() as conn:
        stored = [row.value for row in conn.execute(store.secrets_table.select())]
    assert path.read_text().strip() not in stored
    # What a local user could read in the store signs no cookie that opens the admin pages.
    root = accounts.find(engine, "root@example.org")
    for value in stored + [""]:
        pages.secret_key = value or "guess"
        forged = SecureCookieSessionInterface().get_signing_serializer(pages).dumps({"_user_id": root.id,
                                                                                     "_fresh": True})
        pages.secret_key = path.read_text().strip()
        thief = pages.test_client()
        thief.set_cookie("llmgw_session", forged)
        assert thief.get("/admin/people").status_code == 302


def test_a_secret_others_may_read_stops_the_gateway_with_the_command_that_fixes_it(tmp_path):
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import gateway

    path = tmp_path / "session.key"
    assert sessions.ensure_secret(str(path)) == sessions.ensure_secret(str(path))  # made once, then kept
    os.chmod(path, 0o644)
    result = CliRunner().invoke(gateway.main, ["--store", f"sqlite:///{tmp_path}/g.db"])
    assert result.exit_code != 0 and f"chmod 600 {path}" in result.output, result.output
    url = f"sqlite:///{tmp_path}/g.db"
    store.open_store(url).dispose()
    with pytest.raises(settings.ConfigError, match="chmod 600"):
        GatewayApp(settings.load(None, {"store.url": url}), key_source=keys)


def test_workers_starting_together_make_one_secret(tmp_path):
    path = str(tmp_path / "deep" / "session.key")
    found = []
    threads = [threading.Thread(target=lambda: found.append(sessions.ensure_secret(path))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(found)) == 1 and len(found) == 8
    assert [n for n in os.listdir(tmp_path / "deep")] == ["session.key"]


def test_an_upgrade_takes_the_old_secret_out_of_the_store(tmp_path):
    url = f"sqlite:///{tmp_path}/old.db"
    engine = store.open_engine(url)
    with engine.begin() as conn:  # a store as version 9 left it, with the secret inside
        store.metadata.create_all(conn, tables=[store.schema_migrations])
    store.MIGRATIONS, kept = store.MIGRATIONS[:9], store.MIGRATIONS
    try:
        store.migrate(engine)
    finally:
        store.MIGRATIONS = kept
    with engine.begin() as conn:
        conn.execute(store.secrets_table.insert().values(name="session", value="x" * 64))
    assert store.migrate(engine)[0] == 10  # and every later one
    with engine.connect() as conn:
        assert conn.execute(store.secrets_table.select()).all() == []
    engine.dispose()


# --- the sign-in throttle ------------------------------------------------------------------------

def held_back(app, limit: str) -> float:
    """Attempts the throttle held back at LIMIT, as llmgw_sign_in_throttled_total counts them."""
    return counted(app.runtime.metrics, app.runtime.metrics.sign_in_throttled.labels(limit))


def test_after_five_failures_the_right_password_is_refused_until_the_window_passes(site, tmp_path):  # noqa: F811
    pages, engine, gateway = site
    accounts.create_user(engine, "v@example.org", PASSWORD, state=accounts.ACTIVE)
    client = pages.test_client()
    for _ in range(5):
        assert b"Wrong email or password." in sign_in(client, "v@example.org", "not the password").data
    refused = sign_in(client, "v@example.org", PASSWORD)
    assert refused.status_code == 400
    assert b"Too many wrong passwords for this account. Try again in 15 minutes." in refused.data
    # An unknown account is held the same way: the refusal says nothing about who has an account.
    for _ in range(5):
        sign_in(client, "nobody@example.org", "not the password")
    assert b"Too many wrong passwords for this account" in sign_in(client, "nobody@example.org", PASSWORD).data
    assert held_back(gateway, "account") == 2 and held_back(gateway, "address") == 0

    # With a window of two seconds, the right password works once it has passed, and not before.
    url = f"sqlite:///{tmp_path}/short.db"
    short = store.open_store(url)
    accounts.create_user(short, "v@example.org", PASSWORD, state=accounts.ACTIVE)
    app = GatewayApp(settings.load(None, {"store.url": url, "gateway.sign_in_window": 2.0}), key_source=keys)
    client = app.pages.test_client()
    first = time.monotonic()
    for _ in range(5):
        sign_in(client, "v@example.org", "not the password")
    wait_until("the window to pass", 30, lambda: sign_in(client, "v@example.org", PASSWORD).status_code == 302,
               interval=0.2)
    assert time.monotonic() - first >= 2.0
    app.runtime.engine.dispose()
    short.dispose()


def test_the_throttle_forgets_failures_as_they_leave_the_window_and_stays_small():
    guard = throttle.Throttle(throttle.Limits(per_account=2, per_address=3, window=60, sign_ups_per_address=1))
    assert guard.begin("a@x", "1.1.1.1", 0) is None and guard.begin("A@x ", "1.1.1.1", 1) is None
    assert guard.begin("a@x", "1.1.1.1", 59) == "Too many wrong passwords for this account. Try again in 1 minute."
    assert guard.begin("a@x", "1.1.1.1", 60) is None  # the first failure left the window
    guard.succeeded("a@x", "1.1.1.1", 60)  # forgives the account, takes its own attempt back: [1] left
    assert guard.begin("b@x", "1.1.1.1", 60.5) is None and guard.begin("c@x", "1.1.1.1", 60.5) is None
    assert guard.begin("d@x", "1.1.1.1", 60.5) == "Too many wrong passwords from your address. Try again in 1 minute."
    assert guard.sign_up("1.1.1.1", 61) is None
    assert guard.sign_up("1.1.1.1", 62) == "Too many sign-ups from your address. Try again in 1 minute."
    # An account and an address each, until the table is just past the size that sweeps it.
    for i in range((throttle.SWEEP_AT - len(guard.counted)) // 2 + 1):
        guard.begin(f"{i}@x", f"10.0.{i // 256}.{i % 256}", 1000)
    guard.begin("late@x", "2.2.2.2", 2000)
    assert len(guard.counted) == 2


def test_an_ipv6_host_counts_as_its_64_and_a_mapped_ipv4_as_itself():
    guard = throttle.Throttle(throttle.Limits(per_account=5, per_address=3, window=60, sign_ups_per_address=1))
    for i in range(3):
        assert guard.begin(f"{i}@x", f"2001:db8:0:1::{i + 1:x}", 0) is None
    assert guard.begin("a@x", "2001:db8:0:1:ffff::9", 1).startswith("Too many wrong passwords from your address")
    assert guard.begin("a@x", "2001:db8:0:2::1", 1) is None  # another /64: another host
    assert throttle.place("::ffff:192.0.2.1") == "192.0.2.1" and throttle.place("unix") == "unix"


def test_wrong_passwords_from_anyone_do_not_lock_the_owner_out(site):  # noqa: F811
    """Twelve wrong passwords for an administrator once locked the real one out for a quarter of an hour,
    again and again: the account's failures are counted per address, so only the guesser is held."""
    pages, engine, _ = site
    accounts.create_user(engine, "root@example.org", PASSWORD, state=accounts.ACTIVE, is_admin=True)

    def attempt(password, address):
        client = pages.test_client()
        page = client.get("/login").data
        return client.post("/login", data={"email": "root@example.org", "password": password,
                                           "csrf_token": token(page)}, environ_base={"REMOTE_ADDR": address})

    for _ in range(12):
        assert attempt("not the password", "203.0.113.7").status_code == 400
    held = attempt(PASSWORD, "203.0.113.7")  # the guesser is held, right password or not
    assert b"Too many wrong passwords for this account" in held.data
    assert attempt(PASSWORD, "198.51.100.1").headers["Location"] == "/account"


def test_a_stolen_session_cannot_guess_the_password_it_would_change(site):  # noqa: F811
    pages, engine, _ = site
    accounts.create_user(engine, "p@example.org", PASSWORD, state=accounts.ACTIVE)
    client = pages.test_client()
    assert sign_in(client, "p@example.org", PASSWORD).status_code == 302

    def change(current):
        page = client.get("/account/password").data
        return client.post("/account/password", data={"current": current, "password": "a new long password",
                                                      "repeat": "a new long password", "csrf_token": token(page)})

    for _ in range(5):
        wrong = change("not the password")
        assert wrong.status_code == 400 and b"The current password is wrong." in wrong.data
    refused = change(PASSWORD)
    assert refused.status_code == 400 and b"Too many wrong passwords for this account. Try again in 15" in refused.data
    assert not isinstance(accounts.authenticate(engine, "p@example.org", PASSWORD), str)  # unchanged
    # The guesses count against sign-in from that address too.
    assert b"Too many wrong passwords" in sign_in(pages.test_client(), "p@example.org", PASSWORD).data


def test_sign_up_is_throttled_per_address_and_paused_when_many_wait(site, tmp_path):  # noqa: F811
    pages, engine, gateway = site

    def sign_up(client, email, address="192.0.2.10"):
        page = client.get("/signup").data
        return client.post("/signup", data={"email": email, "password": PASSWORD, "repeat": PASSWORD,
                                            "csrf_token": token(page)}, environ_base={"REMOTE_ADDR": address})

    client = pages.test_client()
    for i in range(5):
        assert b"waits for an operator" in sign_up(client, f"s{i}@example.org").data
    refused = sign_up(client, "s5@example.org")
    assert refused.status_code == 400 and b"Too many sign-ups from your address. Try again in 15" in refused.data
    assert b"waits for an operator" in sign_up(client, "t@example.org", "192.0.2.11").data
    assert len(accounts.list_users(engine, accounts.PENDING)) == 6
    assert held_back(gateway, "sign_up") == 1

    url = f"sqlite:///{tmp_path}/full.db"
    full = store.open_store(url)
    app = GatewayApp(settings.load(None, {"store.url": url, "gateway.signup_open": True, "gateway.sign_ups_pending": 3,
                                          "gateway.contact": "ops@example.org"}), key_source=keys)
    for i in range(3):
        accounts.create_user(full, f"w{i}@example.org", PASSWORD)
    paused = sign_up(app.pages.test_client(), "late@example.org")
    assert paused.status_code == 400
    assert (b"Sign-up is paused: 3 accounts already wait for approval. Ask ops@example.org for an account."
            in paused.data)
    accounts.approve(full, "w0@example.org", "ops")
    assert b"waits for an operator" in sign_up(app.pages.test_client(), "late@example.org").data
    app.runtime.engine.dispose()
    full.dispose()


def test_an_address_trying_many_accounts_is_throttled_and_a_proxy_forwards_whose_address(site):  # noqa: F811
    pages, engine, gateway = site
    accounts.create_user(engine, "w@example.org", PASSWORD, state=accounts.ACTIVE)

    def attempt(email, password, forwarded):
        client = pages.test_client()
        page = client.get("/login").data
        # 127.0.0.1 is a trusted proxy in this site: the address it forwards is the client's.
        return client.post("/login", data={"email": email, "password": password, "csrf_token": token(page)},
                           headers={"X-Forwarded-For": forwarded}, environ_base={"REMOTE_ADDR": "127.0.0.1"})

    for i in range(20):
        assert b"Wrong email or password." in attempt(f"guess{i}@example.org", "nope nope nope", "203.0.113.7").data
    refused = attempt("w@example.org", PASSWORD, "203.0.113.7")
    assert b"Too many wrong passwords from your address." in refused.data
    assert held_back(gateway, "address") == 1
    # Another client behind the same proxy is not held to the first one's failures.
    assert attempt("w@example.org", PASSWORD, "203.0.113.8").status_code == 302


def page_session(base: str):
    """An opener with its own cookies, and the sign-in form's token."""
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(CookieJar()))
    with opener.open(base + "/login", timeout=30) as resp:
        csrf = token(resp.read())
    return opener, csrf


def test_health_stays_fast_during_a_burst_of_sign_ins(tmp_path, make_gateway):
    url = f"sqlite:///{tmp_path}/burst.db"
    engine = store.open_store(url)
    accounts.create_user(engine, "x@example.org", PASSWORD, state=accounts.ACTIVE)
    engine.dispose()
    # Throttles out of the way: every attempt hashes.
    gw = make_gateway(store_url=url, workers=1, gateway__sign_in_failures_per_account=1000,
                      gateway__sign_in_failures_per_address=1000)
    forms = [page_session(gw.url) for _ in range(40)]
    go = threading.Event()

    def attempt(opener, csrf):
        go.wait()
        data = urllib.parse.urlencode({"email": "x@example.org", "password": "wrong wrong wrong",
                                       "csrf_token": csrf}).encode()
        try:
            opener.open(gw.url + "/login", data=data, timeout=120).close()
        except urllib.error.HTTPError as e:
            e.close()

    threads = [threading.Thread(target=attempt, args=f) for f in forms]
    for t in threads:
        t.start()
    began = time.monotonic()
    go.set()
    slowest = 0.0
    while any(t.is_alive() for t in threads):
        started = time.monotonic()
        with urllib.request.urlopen(gw.url + "/health", timeout=60):
            slowest = max(slowest, time.monotonic() - started)
        time.sleep(0.01)
    burst = time.monotonic() - began
    for t in threads:
        t.join()
    print(f"40 sign-ins on one worker took {burst:.2f} s; the slowest /health meanwhile {slowest * 1000:.0f} ms")
    # Hashed on the event loop, /health waited for the whole burst (7.5 s of 7.6 on a loaded two-core machine);
    # in the hashing threads it waited 0.47 s of 4.3, and once 0.63 s of a burst of 1.7 on a loaded machine.
    # Relative, so that a machine's load moves both alike: on the loop it waits for all of the burst.
    assert slowest < burst / 2, (slowest, burst)


# --- the last administrator ----------------------------------------------------------------------

def test_the_last_administrator_cannot_be_demoted_suspended_or_removed(site):  # noqa: F811
    pages, engine, _ = site
    admin = admin_client(site)
    root = accounts.find(engine, "root@example.org")
    for do in ("demote", "suspend", "remove"):
        page = admin.get("/admin/people").data
        admin.post("/admin/people", data={"csrf_token": token(page), "do": do, "user": root.id})
        shown = admin.get("/admin/people").data.decode()
        assert "root@example.org is the last active administrator" in shown, do
        assert "llmgw users promote EMAIL" in shown
    url = str(engine.url)
    for command in ("demote", "suspend", "remove"):
        result = CliRunner().invoke(cli, ["--store", url, "users", command, "root@example.org"])
        assert result.exit_code != 0 and "last active administrator" in result.output, command
    assert accounts.find(engine, "root@example.org") == root
    # With a second administrator, either may step down.
    accounts.create_user(engine, "second@example.org", PASSWORD, state=accounts.ACTIVE, is_admin=True)
    assert not accounts.promote(engine, "root@example.org", admin=False).is_admin
    with pytest.raises(accounts.AccountError, match="last active administrator"):
        accounts.suspend(engine, "second@example.org")


def test_two_administrators_stepping_down_at_once_leave_one(engine):
    # Each saw the other still administering and both went: nobody was left. Every change to a person
    # now takes the keys' revision row first, so two such changes run one after the other.
    for round_ in range(10):
        names = [f"a{round_}@example.org", f"b{round_}@example.org"]
        for name in names:
            accounts.create_user(engine, name, PASSWORD, state=accounts.ACTIVE, is_admin=True)
        for user in accounts.list_users(engine):
            if user.email not in names and user.is_admin:
                accounts.promote(engine, user.email, admin=False)
        barrier = threading.Barrier(2)
        outcomes = []

        def step_down(name, barrier=barrier, outcomes=outcomes):
            barrier.wait()
            try:
                accounts.promote(engine, name, admin=False)
                outcomes.append("done")
            except accounts.AccountError:
                outcomes.append("refused")

        threads = [threading.Thread(target=step_down, args=(name,)) for name in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcomes) == ["done", "refused"], round_
        assert sum(u.is_admin and u.state == accounts.ACTIVE for u in accounts.list_users(engine)) == 1
