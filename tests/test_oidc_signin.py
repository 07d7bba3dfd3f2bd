"""Signing in to the pages through a real OpenID provider (npm's oidc-provider, tests/oidcprovider.py): the first
sign-in makes an account, pending or approved as the provider's rules say; groups give places and the
administrator role and take them back at the next sign-in; an existing account is linked only by a verified
address; local sign-in can be turned off but for the break-glass administrators; and a state is good once,
in the browser that began it (issue 31). The ID token's checks are in tests/test_oidc_tokens.py; Chromium's
walk through the provider's own form in tests/test_browser_oidc.py."""

from __future__ import annotations

import json
import logging
import os
import re
import urllib.parse

import pytest
import sqlalchemy as sa

from llmgw import settings, store
from llmgw.people import accounts, identities, keys, memberships, orgtree
from llmgw.web.app import GatewayApp
from tests.oidcprovider import OidcProvider
from tests.test_pages import sign_in as password_sign_in
from tests.test_pages import token

CALLBACK = "http://localhost/login/oidc/corp/callback"
PEOPLE = {
    "ada": {"email": "ada@example.org", "email_verified": True, "name": "Ada", "groups": ["ml-team"]},
    "bob": {"email": "bob@elsewhere.net", "email_verified": True, "groups": []},
    "eve": {"email": "root@example.org", "email_verified": False, "groups": ["llmgw-admins"]},
    "root": {"email": "root@example.org", "email_verified": True, "groups": []},
    "cyd": {"email": "cyd@elsewhere.net", "email_verified": True, "groups": []},
    "kelvin": {"email": "\u212aate@example.org", "email_verified": True, "groups": []},
}


@pytest.fixture(scope="module")
def provider(tmp_path_factory):
    p = OidcProvider(tmp_path_factory.mktemp("oidc"), PEOPLE, [{
        "client_id": "llmgw", "client_secret": "a-client-secret", "redirect_uris": [CALLBACK],
        "post_logout_redirect_uris": ["http://localhost/"],
        "grant_types": ["authorization_code", "urn:ietf:params:oauth:grant-type:device_code"],
        "response_types": ["code"]}])
    yield p
    p.stop()


def gateway(tmp_path, provider, public_url="http://localhost", pending=50, **auth):
    """A gateway's pages whose file names PROVIDER as `corp`, with AUTH's `[auth]` settings and the map and
    rules a test gives (as `oidc_*` keys). A second one in the same TMP_PATH shares the first's store."""
    secret = tmp_path / "corp.secret"
    secret.write_text("a-client-secret\n")
    os.chmod(secret, 0o600)
    entry = {"name": "corp", "label": "Corp SSO", "issuer": provider.issuer, "client_id": "llmgw",
             "client_secret_file": str(secret), "scopes": ["openid", "email", "profile", "groups"],
             **{k[5:]: v for k, v in auth.items() if k.startswith("oidc_")}}
    maps = entry.pop("map", [])
    lines = [f'[store]\nurl = "sqlite:///{tmp_path}/pages.db"',
             f'[gateway]\npublic_url = "{public_url}"\nsign_ups_pending = {pending}', "[auth]",
             *(f"{k} = {settings.toml_value(v)}" for k, v in auth.items() if not k.startswith("oidc_")),
             "[[auth.oidc]]", *(f"{k} = {settings.toml_value(v)}" for k, v in entry.items())]
    for m in maps:
        lines += ["[[auth.oidc.map]]", *(f"{k} = {settings.toml_value(v)}" for k, v in m.items())]
    path = tmp_path / "gateway.toml"
    path.write_text("\n".join(lines) + "\n")
    engine = store.open_store(f"sqlite:///{tmp_path}/pages.db")
    app = GatewayApp(settings.load(str(path)), key_source=keys)
    app.pages.testing = True
    return app, engine


@pytest.fixture
def tree(tmp_path):
    """Make the places the map names, in the store a gateway will open."""
    def make(engine):
        orgtree.add(engine, "org", "acme")
        orgtree.add(engine, "team", "research", "acme")
        orgtree.add(engine, "project", "chat", "acme/research")
    return make


def provider_sign_in(client, provider, login, start="/login/oidc/corp"):
    """Sign LOGIN in through the provider's own form; the gateway's answer to the callback."""
    begun = client.get(start)
    assert begun.status_code == 302, begun.data
    back = provider.sign_in(begun.headers["Location"], login, CALLBACK)
    parts = urllib.parse.urlsplit(back)
    return client.get(f"{parts.path}?{parts.query}")


def state_of(engine, email):
    with engine.connect() as conn:
        return conn.execute(sa.select(store.users.c.state, store.users.c.is_admin)
                            .where(store.users.c.email == email)).one()


def places_of(engine, email):
    user = accounts.find(engine, email)
    with engine.connect() as conn:
        return {(m.path, m.role) for m in memberships.of_user(conn, orgtree.Tree.read(conn), user.id)}


def test_a_first_sign_in_makes_an_account_that_waits_unless_the_rules_approve_it(tmp_path, provider):
    app, engine = gateway(tmp_path, provider, oidc_approve_domains=["example.org"])
    client = app.pages.test_client()
    assert b"Sign in with Corp SSO" in client.get("/login").data

    waiting = provider_sign_in(client, provider, "bob")  # elsewhere.net: not an approved domain
    assert waiting.status_code == 403 and b"waits for an operator" in waiting.data
    assert state_of(engine, "bob@elsewhere.net") == ("pending", False)
    assert client.get("/account").status_code == 302  # not signed in

    done = provider_sign_in(client, provider, "ada")
    assert done.status_code == 302 and done.headers["Location"] == "/account"
    page = client.get("/account").data
    assert b"Signed in as <strong>ada@example.org</strong>" in page and b"Change password" not in page
    assert accounts.find(engine, "ada@example.org").approved_by == "identity provider corp"
    # The account has no password: the password form answers as for an unknown address.
    other = app.pages.test_client()
    assert password_sign_in(other, "ada@example.org", "!").status_code == 400
    # An operator approves bob as any sign-up; then he is in.
    accounts.approve(engine, "bob@elsewhere.net", "ops")
    assert provider_sign_in(app.pages.test_client(), provider, "bob").status_code == 302


def test_groups_give_a_team_and_the_administrator_role_and_take_them_back_at_the_next_sign_in(
        tmp_path, provider, tree, caplog):
    app, engine = gateway(tmp_path, provider, oidc_approve_groups=["ml-team"], oidc_map=[
        {"group": "ml-team", "team": "acme/research"}, {"group": "llmgw-admins", "role": "admin"},
        {"group": "acme-leads", "org": "acme", "role": "manager"}])
    tree(engine)
    accounts.create_user(engine, "ops@example.org", "a long enough password", state=accounts.ACTIVE, is_admin=True)
    provider.set_account("ada", groups=["ml-team", "llmgw-admins"])
    caplog.set_level(logging.INFO, logger="llmgw.identities")
    client = app.pages.test_client()
    assert provider_sign_in(client, provider, "ada").status_code == 302
    assert places_of(engine, "ada@example.org") == {("acme/research", "member")}
    assert state_of(engine, "ada@example.org") == ("active", True)
    assert "ada@example.org signed in through corp: joined team acme/research as member" in caplog.text
    assert client.get("/admin/people").status_code == 200
    assert b"joined team acme/research as member; became an administrator" in client.get("/account").data
    # A key made in the team's project, and a membership an operator gave by hand.
    keys.create_key(engine, "ada's", "acme/research/chat", user_id=accounts.find(engine, "ada@example.org").id,
                    made_by=accounts.find(engine, "ada@example.org").id, member_only=True)
    memberships.join(engine, "ada@example.org", "project", "acme/research/chat")

    provider.set_account("ada", groups=["acme-leads"])
    client = app.pages.test_client()
    assert provider_sign_in(client, provider, "ada").status_code == 302
    # The team the provider gave is gone, the operator's project stays (so the key does too), the manager role
    # came, and the administrator role the provider gave went.
    assert places_of(engine, "ada@example.org") == {("acme", "manager"), ("acme/research/chat", "member")}
    assert state_of(engine, "ada@example.org") == ("active", False)
    assert client.get("/admin/people").status_code in (302, 403)
    page = client.get("/account").data
    assert b"left team acme/research" in page and b"no longer an administrator" in page

    # Without the project the operator gave, leaving the team revokes the key made there.
    memberships.leave(engine, "ada@example.org", "project", "acme/research/chat")
    provider.set_account("ada", groups=["ml-team"])
    provider_sign_in(app.pages.test_client(), provider, "ada")
    provider.set_account("ada", groups=[])
    provider_sign_in(app.pages.test_client(), provider, "ada")
    assert places_of(engine, "ada@example.org") == set()
    assert all(k.revoked_at for k in keys.list_keys(engine, user_id=accounts.find(engine, "ada@example.org").id))
    provider.set_account("ada", groups=["ml-team"])


def test_a_suspended_person_stays_out_whatever_the_provider_says(tmp_path, provider, tree):
    app, engine = gateway(tmp_path, provider, oidc_approve_domains=["example.org"],
                          oidc_map=[{"group": "ml-team", "team": "acme/research"}])
    tree(engine)
    client = app.pages.test_client()
    provider_sign_in(client, provider, "ada")
    accounts.suspend(engine, "ada@example.org")
    assert client.get("/account").status_code == 302  # suspension ended the session
    refused = provider_sign_in(app.pages.test_client(), provider, "ada")
    assert refused.status_code == 403 and b"suspended" in refused.data
    assert state_of(engine, "ada@example.org")[0] == "suspended"


def test_an_existing_account_is_linked_only_through_a_verified_address(tmp_path, provider):
    app, engine = gateway(tmp_path, provider)
    accounts.create_user(engine, "root@example.org", "a long enough password", state=accounts.ACTIVE, is_admin=True)
    # eve's provider profile claims root's address without the provider having verified it: no link.
    refused = provider_sign_in(app.pages.test_client(), provider, "eve")
    assert refused.status_code == 403 and b"does not say your address is verified" in refused.data
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(store.identities)).scalar_one() == 0
    # root's own, verified, links to the account (and keeps its password).
    client = app.pages.test_client()
    assert provider_sign_in(client, provider, "root").status_code == 302
    assert b"root@example.org" in client.get("/account").data and b"Change password" in client.get("/account").data


def test_an_administrator_can_be_made_to_confirm_each_link(tmp_path, provider):
    app, engine = gateway(tmp_path, provider, oidc_link_existing="confirm")
    accounts.create_user(engine, "root@example.org", "a long enough password", state=accounts.ACTIVE, is_admin=True)
    waiting = provider_sign_in(app.pages.test_client(), provider, "root")
    assert waiting.status_code == 403 and b"llmgw users link YOUR-ADDRESS --provider corp" in waiting.data
    assert provider_sign_in(app.pages.test_client(), provider, "root").status_code == 403  # still waiting
    # Another administrator sees it waiting on the people page, and confirms it there.
    accounts.create_user(engine, "ops@example.org", "a long enough password", state=accounts.ACTIVE, is_admin=True)
    ops = app.pages.test_client()
    password_sign_in(ops, "ops@example.org", "a long enough password")
    page = ops.get("/admin/people").data
    assert b"a sign-in with Corp SSO as root@example.org (root) waits to be linked" in page
    done = ops.post("/admin/people", data={"do": "link", "user": accounts.find(engine, "root@example.org").id,
                                           "provider": "corp", "subject": "root", "csrf_token": token(page)},
                    follow_redirects=True)
    assert b"Linked root@example.org to their sign-in through corp" in done.data
    assert provider_sign_in(app.pages.test_client(), provider, "root").status_code == 302
    assert b"signs in with Corp SSO, last" in ops.get("/admin/people").data
    with pytest.raises(identities.LinkError):
        identities.confirm_link(engine, "root@example.org", "corp")  # nothing waits now


def test_local_sign_in_turned_off_lets_in_only_the_break_glass_administrators(tmp_path, provider):
    app, engine = gateway(tmp_path, provider, local_sign_in=False, break_glass=["ops@example.org"])
    for email in ("ops@example.org", "dev@example.org"):
        accounts.create_user(engine, email, "a long enough password", state=accounts.ACTIVE, is_admin=True)
    client = app.pages.test_client()
    page = client.get("/login").data
    assert b"Sign in with Corp SSO" in page and b'name="password"' not in page
    assert b"Administrators&#39; sign-in with a password" in page or b"Administrators' sign-in" in page

    def local(email):
        form = client.get("/login?local=1").data
        return client.post("/login", data={"email": email, "password": "a long enough password",
                                           "csrf_token": token(form)})

    refused = local("dev@example.org")
    assert refused.status_code == 400 and b"turned off here; sign in with Corp SSO" in refused.data
    assert local("ops@example.org").status_code == 302
    assert client.get("/signup").status_code == 404
    (tmp_path / "nobody").mkdir()
    with pytest.raises(settings.ConfigError, match="break_glass names nobody"):
        gateway(tmp_path / "nobody", provider, local_sign_in=False)


def test_a_state_is_good_once_and_only_in_the_browser_that_began_it(tmp_path, provider, caplog):
    app, engine = gateway(tmp_path, provider, oidc_approve_domains=["example.org"])
    caplog.set_level(logging.INFO, logger="llmgw.oidc")
    victim, attacker = app.pages.test_client(), app.pages.test_client()
    # The attacker begins a sign-in as themselves and sends the victim the callback link: the victim's browser
    # did not begin it, so it signs nobody in (login CSRF).
    begun = attacker.get("/login/oidc/corp")
    back = urllib.parse.urlsplit(provider.sign_in(begun.headers["Location"], "bob", CALLBACK))
    planted = victim.get(f"{back.path}?{back.query}")
    assert planted.status_code == 400 and b"not begun in this browser" in planted.data
    assert "its state is not one this browser began" in caplog.text
    # The right browser, once; the same answer again (the URL replayed with the cookie copied) is refused.
    begun = victim.get("/login/oidc/corp")
    cookie = victim.get_cookie("llmgw_session").value
    back = urllib.parse.urlsplit(provider.sign_in(begun.headers["Location"], "ada", CALLBACK))
    assert victim.get(f"{back.path}?{back.query}").status_code == 302
    replay = app.pages.test_client()
    replay.set_cookie("llmgw_session", cookie)
    again = replay.get(f"{back.path}?{back.query}")
    assert again.status_code == 400 and b"finished already" in again.data
    assert "its state was used already" in caplog.text
    with engine.connect() as conn:
        # One state recorded as used: the victim's (the planted one was refused before).
        assert conn.execute(sa.select(sa.func.count()).select_from(store.sign_in_flows)).scalar_one() == 1


def test_signing_out_ends_the_session_and_offers_the_providers_own_sign_out(tmp_path, provider):
    app, engine = gateway(tmp_path, provider, oidc_approve_domains=["example.org"])
    client = app.pages.test_client()
    provider_sign_in(client, provider, "ada")
    with engine.connect() as conn:
        row = conn.execute(sa.select(store.sessions.c.provider, store.sessions.c.created_at,
                                     store.sessions.c.expires_at)).one()
    assert row.provider == "corp" and row.expires_at - row.created_at == pytest.approx(8 * 3600)
    page = client.get("/account").data
    out = client.post("/logout", data={"csrf_token": token(page)})
    assert out.status_code == 200 and b"Sign out of Corp SSO too" in out.data
    assert (provider.issuer + "/session/end?client_id=llmgw").encode() in out.data.replace(b"&amp;", b"&")
    assert client.get("/account").status_code == 302
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(store.sessions)).scalar_one() == 0


def test_a_provider_session_ends_at_its_own_lifetime(tmp_path, provider, monkeypatch):
    app, engine = gateway(tmp_path, provider, oidc_approve_domains=["example.org"], provider_session_lifetime=600.0)
    client = app.pages.test_client()
    provider_sign_in(client, provider, "ada")
    assert client.get("/account").status_code == 200
    with store.writing(engine) as conn:  # ten minutes on
        conn.execute(store.sessions.update().values(expires_at=store.sessions.c.expires_at - 601))
    assert client.get("/account").status_code == 302


def test_the_provider_down_is_said_on_a_page_and_logged(tmp_path, provider, caplog):
    app, _ = gateway(tmp_path, provider)
    app.pages.extensions["llmgw"].providers["corp"].issuer = "http://127.0.0.1:9"
    app.pages.extensions["llmgw"].providers["corp"]._meta = None
    answer = app.pages.test_client().get("/login/oidc/corp")
    assert answer.status_code == 502 and b"cannot be reached from this gateway just now" in answer.data
    assert "identity provider corp: its discovery at http://127.0.0.1:9" in caplog.text
    assert app.pages.test_client().get("/login/oidc/nobody").status_code == 404


def test_the_configuration_is_checked_when_it_is_read(tmp_path):
    def load(text):
        path = tmp_path / "c.toml"
        path.write_text(text)
        return settings.load(str(path))

    base = '[gateway]\npublic_url = "https://llm.example.com"\n[[auth.oidc]]\nname = "corp"\nclient_id = "x"\n'
    with pytest.raises(settings.ConfigError, match="must be an https:// URL"):
        load(base + 'issuer = "http://sso.example.com"\n')
    with pytest.raises(settings.ConfigError, match="give one of org, team or project"):
        load(base + 'issuer = "https://sso.example.com"\n[[auth.oidc.map]]\ngroup = "g"\n')
    with pytest.raises(settings.ConfigError, match="manager, of an organisation"):
        load(base + 'issuer = "https://sso.example.com"\n[[auth.oidc.map]]\ngroup = "g"\nteam = "a/b"\nrole = "manager"\n')
    with pytest.raises(settings.ConfigError, match="the name browser is llmgw's own"):
        load(base.replace('"corp"', '"browser"') + 'issuer = "https://sso.example.com"\n')
    with pytest.raises(settings.ConfigError, match="write identity providers as an array of tables"):
        load('[auth.oidc]\nname = "corp"\n')
    with pytest.raises(settings.ConfigError, match="needs gateway.public_url"):
        load('[[auth.oidc]]\nname = "corp"\nclient_id = "x"\nissuer = "https://sso.example.com"\n')
    found = load(base + 'issuer = "https://sso.example.com"\nclient_secret_file = "corp.secret"\n')
    assert found.identity_providers[0]["client_secret_file"] == str(tmp_path / "corp.secret")
    assert json.dumps(found.identity_providers)  # every value is plain data


def test_an_administrator_an_operator_confirmed_is_not_taken_back_by_the_provider(tmp_path, provider):
    app, engine = gateway(tmp_path, provider, oidc_approve_domains=["example.org"],
                          oidc_map=[{"group": "llmgw-admins", "role": "admin"}])
    accounts.create_user(engine, "ops@example.org", "a long enough password", state=accounts.ACTIVE, is_admin=True)
    provider.set_account("ada", groups=["llmgw-admins"])
    provider_sign_in(app.pages.test_client(), provider, "ada")
    assert state_of(engine, "ada@example.org") == ("active", True)
    accounts.promote(engine, "ada@example.org")  # the operator makes it theirs
    provider.set_account("ada", groups=[])
    provider_sign_in(app.pages.test_client(), provider, "ada")
    assert state_of(engine, "ada@example.org") == ("active", True)
    provider.set_account("ada", groups=["ml-team"])


def test_an_address_written_into_a_profile_opens_nothing_and_takes_no_address(tmp_path, provider):
    # eve says she is root@example.org, unverified, before root has an account here: nothing is made for
    # that address, so root's own verified sign-in later finds it free.
    app, engine = gateway(tmp_path, provider, oidc_approve_domains=["example.org"])
    refused = provider_sign_in(app.pages.test_client(), provider, "eve")
    assert refused.status_code == 403 and b"does not say your address is verified" in refused.data
    assert accounts.list_users(engine) == []
    client = app.pages.test_client()
    assert provider_sign_in(client, provider, "root").status_code == 302
    assert b"root@example.org" in client.get("/account").data


def test_a_provider_whose_addresses_the_operator_trusts_makes_accounts_from_them(tmp_path, provider):
    app, engine = gateway(tmp_path, provider, oidc_trust_email=True)
    assert provider_sign_in(app.pages.test_client(), provider, "eve").status_code == 403  # waits for approval
    assert state_of(engine, "root@example.org") == ("pending", False)


def test_an_address_that_only_lowers_to_an_accounts_is_not_linked_to_it(tmp_path, provider):
    app, engine = gateway(tmp_path, provider)
    accounts.create_user(engine, "kate@example.org", "a long enough password", state=accounts.ACTIVE)
    refused = provider_sign_in(app.pages.test_client(), provider, "kelvin")  # "\u212aate".lower() == "kate"
    assert refused.status_code == 403 and b"no account here is made or linked" in refused.data
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(store.identities)).scalar_one() == 0


def test_people_new_here_wait_only_while_the_queue_has_room(tmp_path, provider):
    app, engine = gateway(tmp_path, provider, pending=1)
    assert provider_sign_in(app.pages.test_client(), provider, "bob").status_code == 403
    paused = provider_sign_in(app.pages.test_client(), provider, "cyd")
    assert paused.status_code == 403 and b"paused" in paused.data
    assert [u.email for u in accounts.list_users(engine)] == ["bob@elsewhere.net"]


def test_what_a_map_entry_gave_goes_when_the_entry_goes(tmp_path, provider, tree):
    app, engine = gateway(tmp_path, provider, oidc_approve_domains=["example.org"], oidc_map=[
        {"group": "ml-team", "team": "acme/research"}, {"group": "ml-team", "role": "admin"}])
    tree(engine)
    accounts.create_user(engine, "ops@example.org", "a long enough password", state=accounts.ACTIVE, is_admin=True)
    provider_sign_in(app.pages.test_client(), provider, "ada")
    assert state_of(engine, "ada@example.org") == ("active", True)
    app, _ = gateway(tmp_path, provider, oidc_approve_domains=["example.org"])  # the map taken out of the file
    provider_sign_in(app.pages.test_client(), provider, "ada")
    assert state_of(engine, "ada@example.org") == ("active", False)
    assert places_of(engine, "ada@example.org") == set()


def test_an_operators_join_makes_a_provider_membership_the_operators(tmp_path, provider, tree):
    app, engine = gateway(tmp_path, provider, oidc_approve_domains=["example.org"],
                          oidc_map=[{"group": "ml-team", "team": "acme/research"}])
    tree(engine)
    provider_sign_in(app.pages.test_client(), provider, "ada")
    memberships.join(engine, "ada@example.org", "team", "acme/research")  # the operator's from now on
    provider.set_account("ada", groups=[])
    provider_sign_in(app.pages.test_client(), provider, "ada")
    assert places_of(engine, "ada@example.org") == {("acme/research", "member")}
    provider.set_account("ada", groups=["ml-team"])


def test_a_callback_with_any_state_at_all_gets_a_page(tmp_path, provider):
    app, _ = gateway(tmp_path, provider)
    client = app.pages.test_client()
    for state in ("\u00e9t\u00e9", "x" * 5000, ""):
        answer = client.get("/login/oidc/corp/callback", query_string={"state": state, "code": "c"})
        assert answer.status_code == 400 and b"Not signed in" in answer.data
    told = client.get("/login/oidc/corp/callback", query_string={"error": "access_denied\nforged log line",
                                                                 "error_description": "<b>chosen text</b>"})
    assert told.status_code == 400 and b"chosen text" not in told.data and b"forged" not in told.data


def test_llmgw_users_shows_and_confirms_a_waiting_link(tmp_path, provider):
    from click.testing import CliRunner

    from llmgw.cli.main import main
    app, engine = gateway(tmp_path, provider, oidc_link_existing="confirm")
    accounts.create_user(engine, "root@example.org", "a long enough password", state=accounts.ACTIVE, is_admin=True)
    provider_sign_in(app.pages.test_client(), provider, "root")
    store_url = f"sqlite:///{tmp_path}/pages.db"
    listed = CliRunner().invoke(main, ["--store", store_url, "users", "list"])
    assert "corp (waits: --subject root)" in listed.stdout
    linked = CliRunner().invoke(main, ["--store", store_url, "users", "link", "root@example.org", "--provider", "corp"])
    assert linked.exit_code == 0 and "they can sign in with it now" in linked.stderr
    again = CliRunner().invoke(main, ["--store", store_url, "users", "link", "root@example.org", "--provider", "corp"])
    assert again.exit_code == 1 and "no sign-in through corp waits" in again.stderr
    assert '"sign_ins": [{"provider": "corp", "subject": "root", "confirmed": true}]' in CliRunner().invoke(
        main, ["--store", store_url, "users", "list", "--json"]).stdout


def test_callbacks_that_end_in_no_session_are_bounded_per_address(tmp_path, provider):
    # Each asks the provider under the client every sign-in shares; a loop of junk ones is held back.
    app, _ = gateway(tmp_path, provider)
    client = app.pages.test_client()
    answers = [client.get("/login/oidc/corp/callback", query_string={"state": f"s{i}", "code": "junk"}).status_code
               for i in range(21)]
    assert answers[:20] == [400] * 20 and answers[20] == 429


def test_the_key_page_for_the_command_takes_only_what_a_command_sends(tmp_path, provider):
    app, _ = gateway(tmp_path, provider, oidc_approve_domains=["example.org"])
    client = app.pages.test_client()
    provider_sign_in(client, provider, "ada")
    good = {"port": "40000", "challenge": "a" * 43, "state": "s" * 20}
    page = client.get("/login/cli", query_string=good)
    assert page.status_code == 200 and b"40000 aaaaaaaaaaaa" in page.data
    for bad in ({"port": "\u00b2\u00b2\u00b2\u00b2"}, {"port": "80"}, {"port": "9" * 40}, {"challenge": "x"},
                {"state": "<script>"}, {"project": "p" * 301}):
        assert client.get("/login/cli", query_string={**good, **bad}).status_code == 400, bad
    # A page to go back to longer than the session should carry is not carried.
    begun = client.get("/login/oidc/corp", query_string={"next": "/account?" + "x" * 300})
    assert begun.status_code == 302
    with client.session_transaction() as kept:
        assert kept["oidc"][-1]["next"] == "/account"


def test_a_groups_claim_missing_altogether_leaves_places_as_they_were(tmp_path, provider, tree):
    app, engine = gateway(tmp_path, provider, oidc_approve_domains=["example.org"],
                          oidc_map=[{"group": "ml-team", "team": "acme/research"}])
    tree(engine)
    provider_sign_in(app.pages.test_client(), provider, "ada")
    provider.set_account("ada", groups=None)  # a mapper switched off at the provider
    client = app.pages.test_client()
    provider_sign_in(client, provider, "ada")
    assert places_of(engine, "ada@example.org") == {("acme/research", "member")}
    assert b"did not say your groups (groups); places left as they were" in client.get("/account").data
    provider.set_account("ada", groups=["ml-team"])


def test_a_gateway_whose_client_secret_is_missing_or_loose_does_not_start(tmp_path, provider):
    import subprocess
    import sys

    from tests.conftest import ROOT, write_config
    entry = {"name": "corp", "issuer": provider.issuer, "client_id": "llmgw",
             "client_secret_file": str(tmp_path / "absent.secret")}
    config = write_config(tmp_path / "gw.toml", {"gateway.public_url": "http://localhost",
                                                 "store.url": f"sqlite:///{tmp_path}/gw.db"},
                          identity_providers=[entry])
    ran = subprocess.run([sys.executable, f"{ROOT}/gateway.py", "--config", config], capture_output=True, text=True,
                         timeout=60)
    assert ran.returncode == 1 and "cannot read the identity provider's client secret" in ran.stderr
    (tmp_path / "absent.secret").write_text("s\n")
    os.chmod(tmp_path / "absent.secret", 0o644)
    ran = subprocess.run([sys.executable, f"{ROOT}/gateway.py", "--config", config], capture_output=True, text=True,
                         timeout=60)
    assert ran.returncode == 1 and "chmod" in ran.stderr and "absent.secret" in ran.stderr


def test_a_code_for_the_command_is_spent_by_a_wrong_verifier_and_good_once(tmp_path, provider):
    from llmgw import pkce
    app, _ = gateway(tmp_path, provider, oidc_approve_domains=["example.org"])
    client = app.pages.test_client()
    provider_sign_in(client, provider, "ada")

    def code_for(verifier):
        asked = {"port": "40000", "challenge": pkce.challenge_of(verifier), "state": "s" * 20}
        page = client.get("/login/cli", query_string=asked)
        done = client.post("/login/cli", data={**asked, "csrf_token": token(page.data)})
        assert done.headers["Cache-Control"] == "no-store"
        return re.search(rb"code=([A-Za-z0-9_-]+)", done.data).group(1).decode()

    verifier = "v" * 50
    code = code_for(verifier)
    wrong = client.post("/login/cli/token", json={"code": code, "verifier": "w" * 50})
    assert wrong.status_code == 403
    assert client.post("/login/cli/token", json={"code": code, "verifier": verifier}).status_code == 410  # spent
    code = code_for(verifier)
    made = client.post("/login/cli/token", json={"code": code, "verifier": verifier})
    assert made.status_code == 200 and made.json["email"] == "ada@example.org"
    assert client.post("/login/cli/token", json={"code": code, "verifier": verifier}).status_code == 410  # once
