"""Signing in through the organisation's identity provider, in a real headless Chromium, against a real gateway
(gunicorn, gevent workers) and a real OpenID provider (npm's oidc-provider) on loopback ports (issue 31): the
button, the provider's own login form, the account made with its groups' places, signing out here and there,
a changed group at the next sign-in, and a refused sign-in's page, each at a phone's width."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import requests
from playwright.sync_api import sync_playwright

from llmgw import store
from llmgw.people import accounts, orgtree
from llmgw.procs import free_port
from tests.conftest import Gateway, chromium
from tests.oidcprovider import OidcProvider
from tests.test_browser import PHONE, fits_the_screen
from tests.test_oidc_signin import places_of


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("browser-oidc")
    url = f"sqlite:///{tmp}/oidc.db"
    engine = store.open_store(url)
    orgtree.add(engine, "org", "acme")
    orgtree.add(engine, "team", "research", "acme")
    orgtree.add(engine, "team", "platform", "acme")
    # An operator's administrator, so that the one the provider makes is not the last (who stays one).
    accounts.create_user(engine, "ops@example.org", "a long enough password", state=accounts.ACTIVE, is_admin=True)
    port = free_port()
    gateway_url = f"http://127.0.0.1:{port}"
    provider = OidcProvider(tmp, {"ada": {"email": "ada@example.org", "email_verified": True, "name": "Ada",
                                          "groups": ["research", "llmgw-admins"]},
                                  "bob": {"email": "bob@elsewhere.net", "email_verified": True, "groups": []}}, [{
        "client_id": "llmgw", "client_secret": "a-client-secret",
        "redirect_uris": [f"{gateway_url}/login/oidc/corp/callback"], "post_logout_redirect_uris": [gateway_url + "/"],
        "grant_types": ["authorization_code", "urn:ietf:params:oauth:grant-type:device_code"],
        "response_types": ["code"]}])
    secret = tmp / "corp.secret"
    secret.write_text("a-client-secret\n")
    os.chmod(secret, 0o600)
    gw = Gateway(tmp, url, port=port, gateway__public_url=gateway_url, identity_providers=[{
        "name": "corp", "label": "Corp SSO", "issuer": provider.issuer, "client_id": "llmgw",
        "client_secret_file": str(secret), "scopes": ["openid", "email", "profile", "groups"],
        "approve_domains": ["example.org"],
        "map": [{"group": "research", "team": "acme/research"}, {"group": "platform", "team": "acme/platform"},
                {"group": "llmgw-admins", "role": "admin"}]}])
    with sync_playwright() as p:
        browser = chromium(p)
        yield browser, gw, provider, engine
        browser.close()
    gw.stop()
    provider.stop()
    engine.dispose()


def through_the_provider(page, gw, login="ada", back="/account"):
    """From the gateway's sign-in page, through the provider's own login form, back to BACK."""
    page.goto(gw.url + "/login")
    assert fits_the_screen(page)
    page.click("text=Sign in with Corp SSO")
    page.wait_for_selector("input[name=login]")
    page.fill("input[name=login]", login)
    page.fill("input[name=password]", "any password")
    page.click("button[type=submit]")
    page.wait_for_url(gw.url + back)


def test_sign_in_through_the_provider_then_out_here_and_there_and_a_changed_group_at_the_next(site):
    browser, gw, provider, engine = site
    context = browser.new_context(viewport=PHONE)
    page = context.new_page()
    through_the_provider(page, gw)
    main = page.inner_text("main")
    assert "Signed in as ada@example.org" in main and "Change password" not in main
    assert "You sign in with Corp SSO" in main and "joined team acme/research as member" in main
    assert fits_the_screen(page)
    assert accounts.find(engine, "ada@example.org").state == "active"
    assert places_of(engine, "ada@example.org") == {("acme/research", "member")}
    assert page.goto(gw.url + "/admin/people").status == 200  # the group made her an administrator
    assert "signs in with Corp SSO" in page.inner_text("main")

    page.click("text=Sign out")
    page.wait_for_selector("text=Sign out of Corp SSO too")
    assert fits_the_screen(page)
    page.click("text=Sign out of Corp SSO too")
    page.wait_for_selector("button[type=submit]")  # the provider asks whether to sign out there too
    page.click("button[type=submit] >> nth=0")
    page.wait_for_url(gw.url + "/")
    assert page.goto(gw.url + "/account").url.startswith(gw.url + "/login")

    provider.set_account("ada", groups=["platform"])
    through_the_provider(page, gw)  # the provider's session ended too: its form again
    assert "left team acme/research" in page.inner_text("main")
    assert "no longer an administrator" in page.inner_text("main")
    assert places_of(engine, "ada@example.org") == {("acme/platform", "member")}
    assert page.goto(gw.url + "/admin/people").status == 403  # not an administrator now
    context.close()


def test_someone_new_from_elsewhere_waits_for_an_operator_and_is_told_so(site):
    browser, gw, provider, engine = site
    context = browser.new_context(viewport=PHONE)
    page = context.new_page()
    through_the_provider(page, gw, "bob", back="/login/oidc/corp/callback?*")
    assert page.title() == "Not signed in · llmgw"
    assert "waits for an operator's approval" in page.inner_text("main") and fits_the_screen(page)
    assert accounts.find(engine, "bob@elsewhere.net").state == "pending"
    context.close()
    # Each result counted for the operator's alerts (llmgw_provider_sign_ins_total).
    gw.metrics_once("sign-ins by result", lambda text: all(
        f'llmgw_provider_sign_ins_total{{provider="corp",result="{result}"}}' in text
        for result in ("signed_in", "waiting")))


def test_a_sign_in_replayed_from_the_history_gets_a_page_that_says_what_to_do(site):
    browser, gw, provider, engine = site
    context = browser.new_context(viewport=PHONE)
    page = context.new_page()
    callbacks = []
    page.on("request", lambda r: callbacks.append(r.url) if "/login/oidc/corp/callback" in r.url else None)
    through_the_provider(page, gw)
    page.goto(callbacks[0])  # the provider's answer again, as the back button would send it
    assert page.title() == "Not signed in · llmgw"
    assert "finished already" in page.inner_text("main") and "Sign in with Corp SSO again" in page.inner_text("main")
    assert fits_the_screen(page)
    context.close()


def test_llmgw_login_gets_a_key_once_the_code_is_confirmed_in_the_providers_own_pages(site):
    browser, gw, provider, engine = site
    command = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "llmgw"), "login", gw.url, "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "LLMGW_CONFIG": "", "BROWSER": "true"})
    try:
        shown = command.stderr.readline() + command.stderr.readline()
        where = re.search(r"Open (\S+)", shown).group(1)
        context = browser.new_context(viewport=PHONE)
        page = context.new_page()
        code = re.search(r"confirm the code (\S+) at Corp SSO", shown).group(1)
        page.goto(where)  # the provider shows the code it was given, to compare with the command's
        page.wait_for_selector("text=Confirm Device")
        assert code in page.inner_text("body")
        page.click("text=Continue")
        page.wait_for_selector("input[name=login]")
        page.fill("input[name=login]", "ada")
        page.fill("input[name=password]", "any password")
        page.click("button[type=submit]")
        page.wait_for_selector("text=Sign-in Success")
        context.close()
        out, err = command.communicate(timeout=120)
    finally:
        if command.poll() is None:
            command.kill()
            command.communicate()
    assert command.returncode == 0, err
    got = json.loads(out)
    assert got["email"] == "ada@example.org" and got["key"].startswith("sk-llmgw-")
    # The key works at the gateway.
    answer = requests.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {got['key']}"}, timeout=10)
    assert answer.status_code == 200
