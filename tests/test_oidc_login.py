"""`llmgw login` gets a person a key without a password (issue 31): through the identity provider's device flow,
and through a browser on the person's computer with a loopback redirect. The command, as a person runs it,
against the gateway's pages served on a loopback port, and the real provider (npm's oidc-provider) where
the person confirms the code or signs in."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.parse

import pytest
import requests
from werkzeug.serving import make_server

from llmgw.people import accounts, keys, orgtree
from llmgw.procs import free_port
from tests.oidcprovider import OidcProvider
from tests.test_oidc_signin import CALLBACK, gateway
from tests.test_pages import token

LLMGW = os.path.join(os.path.dirname(sys.executable), "llmgw")


@pytest.fixture(scope="module")
def provider(tmp_path_factory):
    port = free_port()  # where the gateway's pages will be served, so that the provider knows its callback
    p = OidcProvider(tmp_path_factory.mktemp("oidc"), {
        "ada": {"email": "ada@example.org", "email_verified": True, "groups": []}}, [{
            "client_id": "llmgw", "client_secret": "a-client-secret",
            "redirect_uris": [CALLBACK, f"http://127.0.0.1:{port}/login/oidc/corp/callback"],
            "grant_types": ["authorization_code", "urn:ietf:params:oauth:grant-type:device_code"],
            "response_types": ["code"]}, {
            # A client the provider does not let use the device grant, though it offers the grant to others.
            "client_id": "web-only", "client_secret": "a-client-secret",
            "redirect_uris": [f"http://127.0.0.1:{port}/login/oidc/corp/callback"],
            "grant_types": ["authorization_code"], "response_types": ["code"]}])
    p.gateway_port = port
    yield p
    p.stop()


@pytest.fixture(params=["llmgw"])
def served(request, tmp_path, provider):
    """The gateway's pages on a loopback port, and their store; the client id it uses at the provider is the
    fixture's parameter."""
    port = provider.gateway_port
    app, engine = gateway(tmp_path, provider, public_url=f"http://127.0.0.1:{port}",
                          oidc_approve_domains=["example.org"], oidc_client_id=request.param)
    server = make_server("127.0.0.1", port, app.pages, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", engine
    server.shutdown()
    thread.join(timeout=10)


def run_login(provider, url: str, *args: str, browser=None) -> subprocess.CompletedProcess:
    """Run `llmgw login URL ARGS --json`, confirming its code at the provider as ada when it shows one, or
    handing BROWSER(address, words) the address it asks a browser to open."""
    proc = subprocess.Popen([LLMGW, "login", url, *args, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "LLMGW_CONFIG": "", "BROWSER": "true"})
    try:
        shown = proc.stderr.readline()
        shown += proc.stderr.readline() + (proc.stderr.readline() if "Signing in through a browser" in shown else "")
        where = re.search(r"Open (\S+)", shown)
        if where and browser:
            browser(where.group(1), re.search(r"shows ([0-9]+ [A-Za-z0-9_-]{12})", shown).group(1))
        elif where:
            assert "Sign-in Success" in provider.confirm_device(where.group(1), "ada")
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, shown + err)


def test_llmgw_login_gives_a_key_through_the_device_flow(served, provider):
    url, engine = served
    done = run_login(provider, url)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["email"] == "ada@example.org" and got["project"] == "personal" and got["base_url"] == url + "/v1"
    ada = accounts.find(engine, "ada@example.org")
    made = keys.list_keys(engine, user_id=ada.id)
    assert [k.id for k in made] == [got["key_id"]] and got["key"].startswith(made[0].prefix)
    assert made[0].expires_at == pytest.approx(time.time() + 30 * 86400, abs=600)  # auth.login_key_lifetime
    assert "at Corp SSO" in done.stderr  # where to confirm, said to the person

    # The handle is good once: asking again after the key was made gets nothing.
    started = requests.post(url + "/login/device", json={}, timeout=10).json()
    asked = requests.post(url + "/login/device/poll", json={"handle": started["handle"]}, timeout=10)
    # Asked at once: told to slow down, without the provider being asked.
    assert asked.status_code == 202 and asked.json() == {"status": "pending", "slow_down": True}
    assert requests.post(url + "/login/device/poll", json={"handle": "made-up"}, timeout=10).status_code == 410


def test_a_project_the_person_is_not_in_is_refused_and_said(served, provider):
    url, engine = served
    orgtree.add(engine, "org", "acme")
    orgtree.add(engine, "team", "research", "acme")
    orgtree.add(engine, "project", "chat", "acme/research")
    done = run_login(provider, url, "--project", "acme/research/chat")
    assert done.returncode == 1 and "You are not a member of acme/research/chat" in done.stderr


@pytest.mark.parametrize("served,how", [("llmgw", "--browser"), ("web-only", None)], indirect=["served"])
def test_llmgw_login_through_a_browser_on_this_computer(served, how, provider):
    # Asked for, or where the provider does not let this gateway's client use the device grant.
    url, engine = served

    def browser(address, words):  # ada's browser: the provider's sign-in, then the gateway's button
        at = requests.Session()
        wanted = urllib.parse.urlsplit(address)
        begun = at.get(f"{url}/login/oidc/corp", params={"next": f"{wanted.path}?{wanted.query}"},
                       allow_redirects=False, timeout=10)
        back = provider.sign_in(begun.headers["Location"], "ada", f"{url}/login/oidc/corp/callback", browser=at)
        page = at.get(back, timeout=10)  # through the callback, to the page that was asked for
        assert page.url == address and words in page.text and "ada@example.org" in page.text
        fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', page.text))
        fields["csrf_token"] = token(page.content)
        done = at.post(f"{url}/login/cli", data=fields, timeout=10)
        assert done.status_code == 200 and done.headers["Cache-Control"] == "no-store"
        code_at = re.search(r'id="back" href="([^"]+)"', done.text).group(1).replace("&amp;", "&")
        assert requests.get(code_at, timeout=10).status_code == 200  # what follow.js does

    done = run_login(provider, url, *([how] if how else []), browser=browser)
    assert done.returncode == 0, done.stderr
    assert how or "does not let this gateway sign in from a device" in done.stderr
    got = json.loads(done.stdout)
    ada = accounts.find(engine, "ada@example.org")
    assert got["email"] == "ada@example.org" and [k.id for k in keys.list_keys(engine, user_id=ada.id)] == \
        [got["key_id"]]


def test_a_browser_code_is_redeemed_once_and_only_with_its_verifier(served):
    url, engine = served
    for body, status in (({"code": "made-up", "verifier": "v" * 43}, 410), ({"code": "x"}, 400)):
        assert requests.post(url + "/login/cli/token", json=body, timeout=10).status_code == status
    # The page that makes the code takes only what a command sends, and only from someone signed in.
    assert requests.get(url + "/login/cli?port=80&challenge=x&state=y", timeout=10,
                        allow_redirects=False).headers["Location"].startswith("/login?next=")


def test_a_gateway_without_a_provider_sends_llmgw_login_to_the_browser(tmp_path):
    from llmgw import settings, store
    from llmgw.web.app import GatewayApp
    store.open_store(f"sqlite:///{tmp_path}/p.db").dispose()
    app = GatewayApp(settings.load(None, {"store.url": f"sqlite:///{tmp_path}/p.db"}), key_source=keys)
    answer = app.pages.test_client().post("/login/device", json={})
    assert answer.status_code == 501 and "llmgw login --browser" in answer.json["error"]
