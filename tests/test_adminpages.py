"""The administration pages and the organisation page through Flask's test client: every action,
CSRF, escaping, and who may see what."""

import re

import pytest
from markupsafe import escape

from llmgw.people import accounts, keys, limits, memberships, orgtree, usagereport
from tests.test_pages import sign_in, site, token  # noqa: F401  (the fixture and helpers)

PASSWORD = "a long enough password"


@pytest.fixture
def admin(site):  # noqa: F811
    pages, engine, app = site
    accounts.create_user(engine, "root@example.org", PASSWORD, state=accounts.ACTIVE, is_admin=True)
    client = pages.test_client()
    sign_in(client, "root@example.org", PASSWORD)
    return client, engine, app


def act(client, path, **fields):
    page = client.get(path).data
    return client.post(path, data={"csrf_token": token(page), **fields})


def flashed(client, path="/admin/people") -> str:
    return client.get(path).data.decode()


def test_only_administrators_see_the_admin_pages(site):  # noqa: F811
    pages, engine, _ = site
    accounts.create_user(engine, "plain@example.org", PASSWORD, state=accounts.ACTIVE)
    client = pages.test_client()
    assert client.get("/admin").status_code == 302  # to sign in
    sign_in(client, "plain@example.org", PASSWORD)
    for path in ("/admin", "/admin/people", "/admin/quotas", "/admin/usage", "/org", "/admin/nodes/n1",
                 "/admin/nodes/n1/logs", "/admin/nodes/n1/logs/more"):
        assert client.get(path).status_code == 403, path
    assert b'href="/admin"' not in client.get("/account").data


def test_people_page_runs_the_tree_and_accounts(admin):
    client, engine, _ = admin
    accounts.create_user(engine, "new@example.org", PASSWORD)
    assert "new@example.org" in flashed(client)
    act(client, "/admin/people", do="add", kind="org", name="Acme")
    acme = orgtree.Tree.load(engine).find("org", "Acme")
    act(client, "/admin/people", do="add", kind="team", name="ml", parent=acme.id)
    team = orgtree.Tree.load(engine).find("team", "Acme/ml")
    act(client, "/admin/people", do="add", kind="project", name="training", parent=team.id)
    project = orgtree.Tree.load(engine).find("project", "Acme/ml/training")
    user = accounts.find(engine, "new@example.org")
    act(client, "/admin/people", do="approve", user=user.id, project=project.id)
    assert "Approved new@example.org into Acme/ml/training." in flashed(client)
    act(client, "/admin/people", do="join", user=user.id, place=acme.id, role="manager")
    with engine.connect() as conn:
        tree = orgtree.Tree.read(conn)
        assert [(m.path, m.role) for m in memberships.of_user(conn, tree, user.id)] == [
            ("Acme", "manager"), ("Acme/ml/training", "member")]
    act(client, "/admin/people", do="rename", kind="project", node=project.id, name="train")
    act(client, "/admin/people", do="add", kind="team", name="other", parent=acme.id)
    other = orgtree.Tree.load(engine).find("team", "Acme/other")
    act(client, "/admin/people", do="move", kind="project", node=project.id, to=other.id)
    assert orgtree.Tree.load(engine).find("project", project.id).path == "Acme/other/train"
    record, _ = keys.create_key(engine, "ci", project.id, user_id=user.id)
    act(client, "/admin/people", do="remove-node", kind="project", node=project.id)
    assert "never removed. Rename it instead." in flashed(client)
    act(client, "/admin/people", do="revoke", key=record.id)
    assert keys.list_keys(engine)[-1].revoked_at is not None
    act(client, "/admin/people", do="suspend", user=user.id)
    assert accounts.find(engine, user.id).state == "suspended"
    act(client, "/admin/people", do="reinstate", user=user.id)
    act(client, "/admin/people", do="promote", user=user.id)
    assert accounts.find(engine, user.id).is_admin
    act(client, "/admin/people", do="leave", user=user.id, kind="project", node=project.id)
    pending = accounts.create_user(engine, "late@example.org", PASSWORD)
    act(client, "/admin/people", do="reject", user=pending.id)
    assert "Rejected the sign-up of late@example.org." in flashed(client)
    assert "late@example.org" not in flashed(client, "/admin/people?q=late")


def test_the_people_page_shows_a_page_of_each_and_says_where_the_rest_are(admin):
    """Past what a page shows: accounts a page at a time, a project's first keys, a team's first projects, places
    and people typed rather than listed on every row; each says how many more and where they are."""
    from llmgw import store
    from llmgw.web import adminpages

    client, engine, _ = admin
    orgtree.add(engine, "org", "Acme")
    orgtree.add(engine, "team", "ml", "Acme")
    paths = [orgtree.add(engine, "project", f"p{i:03d}", "Acme/ml").path for i in range(adminpages.SHOWN_PROJECTS + 3)]
    for i in range(25):
        keys.create_key(engine, f"key{i:02d}", paths[0])
    with store.writing(engine) as conn:  # 120 more accounts, as fast as the store takes them
        for i in range(120):
            accounts.insert_user(conn, f"u{i:03d}@example.org", "!", accounts.ACTIVE)
    page = flashed(client)
    assert page.count('name="place"') == 50 and "50 of 121 accounts, by email." in page
    assert "key09" in page and "key10" not in page
    assert "and 15 more: <code>llmgw keys list --project Acme/ml/p000</code>" in page
    tree = page.split('id="accounts"')[0]
    assert "p052" not in tree and "3 projects of ml not shown here" in tree
    assert '<option value="Acme/ml/p052">project</option>' in page  # few enough places to offer them all
    whole = flashed(client, "/admin/people?team=" + orgtree.Tree.load(engine).find("team", "Acme/ml").id)
    assert "p052" in whole.split('id="accounts"')[0] and "of ml not shown here" not in whole
    following = flashed(client, "/admin/people?after=u048%40example.org")
    table = following.split("<tbody>")[1].split("</tbody>")[0]
    assert "u049@example.org" in table and "u048@example.org" not in table and "Next 50" in following
    act(client, "/admin/people", do="join", user=accounts.find(engine, "u001@example.org").id, place="Acme/ml/p001")
    assert "u001@example.org is a member of Acme/ml/p001." in flashed(client)
    act(client, "/admin/people", do="join", user=accounts.find(engine, "u002@example.org").id, place="Acme",
        role="manager")
    assert "u002@example.org is a manager of Acme." in flashed(client)
    act(client, "/admin/people", do="join", user=accounts.find(engine, "u004@example.org").id, place="p002")
    assert "u004@example.org is a member of Acme/ml/p002." in flashed(client)  # a bare name, of any kind
    waiting = accounts.create_user(engine, "late@example.org", PASSWORD)
    act(client, "/admin/people", do="approve", user=waiting.id, project="Acme/ml/nosuch")
    assert accounts.find(engine, waiting.id).state == accounts.PENDING  # a typo approves nobody
    made = client.post("/admin/people/key", data={"csrf_token": token(client.get("/admin/people").data),
                                                  "name": "theirs", "project": paths[1], "for": "u003@example.org"})
    assert made.status_code == 200 and b"theirs" in made.data
    assert [k.user_id for k in keys.list_keys(engine) if k.name == "theirs"] == [accounts.find(engine, "u003@example.org").id]


def test_the_quotas_page_shows_the_first_of_many_own_limits_and_counts_the_rest(admin):
    import time

    from llmgw import store
    from llmgw.web import adminpages

    client, engine, _ = admin
    made = [keys.create_key(engine, f"k{i:03d}")[0] for i in range(adminpages.SHOWN_LIMITS + 5)]
    with store.writing(engine) as conn:
        for record in made:
            conn.execute(store.limits.insert().values(scope="key", scope_id=record.id, rpm=60, updated_at=time.time()))
        store.bump_revision(conn, "keys")
    page = flashed(client, "/admin/quotas")
    assert page.count("edit=key:") == adminpages.SHOWN_LIMITS and "5 more people's and keys' own limits" in page
    last = sorted(r.id for r in made)[-1]
    editing = flashed(client, f"/admin/quotas?edit=key:{last}")  # one not shown is still edited by its address
    assert "key k" in editing and 'name="rpm"' in editing and 'value="60"' in editing
    # The page reads people's and keys' own limits only for what it shows: the tree's all, and those named.
    limits.set_limits(engine, "cluster", "", "test", rpm=1000)
    with engine.connect() as conn:
        read = limits.read_all(conn, own=[("key", last), ("project", "ignored")])
    assert set(read) == {("cluster", ""), ("key", last)}
    # What an administrator's browser may be sent to: any text as the scope and id to edit.
    for edit in ("key:" + "x" * 5000, "user:%FF", "key:' OR 1=1 --", "nosuch:1", ":", "key"):
        page = client.get("/admin/quotas?edit=" + edit)
        assert page.status_code == 200, edit
    assert client.get("/admin/quotas?edit=user:a%00b").status_code == 400  # PostgreSQL takes no NUL in a string


def test_the_people_pages_paging_takes_any_text_and_finds_only_what_it_says(admin):
    client, engine, _ = admin
    accounts.create_user(engine, "a_b@example.org", PASSWORD)
    accounts.create_user(engine, "axb@example.org", PASSWORD)
    for query in ("after=" + "z" * 5000, "team=%3Cscript%3Ealert(1)%3C/script%3E", "after=%00%FF", "q=%25", "team="):
        page = client.get("/admin/people?" + query)
        assert page.status_code == 200 and b"<script>alert(1)" not in page.data, query
    found = flashed(client, "/admin/people?q=a_b").split("<tbody>")[1]
    assert "a_b@example.org" in found and "axb@example.org" not in found  # "_" is a character, not a wildcard
    act(client, "/admin/people", do="join", user=accounts.find(engine, "a_b@example.org").id, place="../../etc")
    assert "a_b@example.org is a" not in flashed(client)


def test_names_people_chose_are_shown_inert(admin):
    client, engine, _ = admin
    orgtree.add(engine, "org", "<script>alert(1)<\\script>")
    evil = accounts.create_user(engine, "x<img/src=x/onerror=alert(1)>@example.org", PASSWORD)
    keys.create_key(engine, "<b>key</b>", None, user_id=evil.id)
    for path in ("/admin/people", "/admin/quotas"):
        page = flashed(client, path)
        assert "<script>alert(1)" not in page and "&lt;script&gt;" in page
        assert "<img/src=x" not in page and "<b>key</b>" not in page


def test_every_admin_form_needs_its_token(admin):
    client, engine, _ = admin
    for path, fields in (("/admin/people", {"do": "add", "kind": "org", "name": "X"}),
                         ("/admin/quotas", {"scope": "cluster", "id": "", "rpm": "5"})):
        assert client.post(path, data=fields).status_code == 400
        assert client.post(path, data={**fields, "csrf_token": "forged"}).status_code == 400
    assert orgtree.Tree.load(engine).of_kind("org")[0].name == "default"  # nothing changed


def test_quotas_show_what_binds_and_log_each_change(admin):
    client, engine, _ = admin
    orgtree.add(engine, "org", "Acme")
    orgtree.add(engine, "team", "ml", "Acme")
    project = orgtree.add(engine, "project", "training", "Acme/ml")
    acme = orgtree.Tree.load(engine).find("org", "Acme")
    page = flashed(client, "/admin/quotas")
    assert "budgets never bind" in page
    act(client, "/admin/quotas", scope="org", id=acme.id, rpm="10", budget="50", period="month")
    act(client, "/admin/quotas", scope="project", id=project.id, rpm="100")
    page = flashed(client, "/admin/quotas")
    row = re.search(r"Acme/ml/training</td>(.*?)</tr>", page, re.S).group(1)
    assert "<strong>100</strong>" in row and "unreachable: Acme allows 10" in row  # written below a stricter one
    assert 'title="from Acme">↑ 50' in row  # the budget is inherited, marked with where from
    assert "root@example.org" in page and "none</td><td>10" in page.replace("\n", "")
    act(client, "/admin/quotas", do="price", model="*", input="0.5", output="1.5")
    page = flashed(client, "/admin/quotas")
    assert "budgets never bind" not in page and "*: 0.5 in, 1.5 out" in page
    bad = act(client, "/admin/quotas", scope="org", id=acme.id, rpm="ten")
    assert bad.status_code == 302 and "Rpm is a whole number" in flashed(client, "/admin/quotas")
    edit = flashed(client, f"/admin/quotas?edit=project_member:{project.id}")
    assert "Limits of each member of Acme/ml/training" in edit
    # Personal use is a row of its own, set like any other; turned off from a shell, it says so.
    act(client, "/admin/quotas", scope="personal", id="", rpm="20")
    limits.set_limits(engine, "personal", "", "ops (shell)", disabled=True)
    row = re.search(r"Personal use, each person on their own \(turned off\)</td>(.*?)</tr>",
                    flashed(client, "/admin/quotas"), re.S).group(1)
    assert "<strong>20</strong>" in row
    with engine.connect() as conn:
        assert limits.read_all(conn)[("org", acme.id)].budget == 50_000_000


def test_usage_page_draws_svg_from_the_roll_ups(admin):
    client, engine, _ = admin
    import time

    from llmgw.gateway.usage import UsageRecorder
    project = orgtree.add(engine, "project", "p<b>", "default/default")
    recorder = UsageRecorder(engine, 100)
    for i in range(5):
        recorder.record((time.time() - i * 3600, "k", project.id, "m", "m", "r", "chat", False, 200, 10, 10, 1.0,
                         None, None, 1000))
    recorder.flush()
    page = flashed(client, "/admin/usage?by=project&since=7d&metric=tokens")
    assert "<svg" in page and "default/default/p&lt;b&gt;" in page and "<b>" not in page.split("<main>")[1]
    assert usagereport.report(engine, "project", time.time() - 86400).lines[0].requests == 5
    assert "<th>Budget</th>" not in page  # no row's own level sets one
    limits.set_limits(engine, "project", project.id, "test", budget=50_000_000)
    assert "<td class=\"num\">50 a month</td>" in flashed(client, "/admin/usage?by=project&since=7d&metric=tokens")


def test_the_usage_page_shows_the_busiest_groups_and_sums_the_rest(admin, monkeypatch):
    client, engine, _ = admin
    import time

    from llmgw.gateway.usage import UsageRecorder
    from llmgw.web import adminpages
    monkeypatch.setattr(adminpages, "PAGE_LINES", 1)
    recorder = UsageRecorder(engine, 100)
    for person, requests in (("busy", 3), ("quiet", 1), ("quieter", 1)):
        for _ in range(requests):
            recorder.record((time.time() - 60, "k", None, "m", "m", "r", "chat", False, 200, 10, 10, 1.0, None, person, 0))
    recorder.flush()
    page = flashed(client, "/admin/usage?by=person&since=7d")
    rows = re.findall(r"<tr><td>([^<]*)</td><td class=\"num\">(\d+)</td>", page)
    assert rows == [("busy", "3"), ("2 others", "2")]


def test_a_manager_sees_only_their_organisation(site):  # noqa: F811
    pages, engine, _ = site
    for org in ("Acme", "Scania"):
        orgtree.add(engine, "org", org)
        orgtree.add(engine, "team", "ml", org)
        orgtree.add(engine, "project", "p", f"{org}/ml")
    boss = accounts.create_user(engine, "boss@acme.example", PASSWORD, state=accounts.ACTIVE)
    memberships.join(engine, boss.email, "org", "Acme", memberships.MANAGER)
    client = pages.test_client()
    sign_in(client, boss.email, PASSWORD)
    page = client.get("/org").data.decode()
    assert "<h1>Acme</h1>" in page and "Acme/ml/p" in page and "Scania" not in page
    scania = orgtree.Tree.load(engine).find("org", "Scania")
    assert "Scania" not in client.get(f"/org?org={scania.id}").data.decode()  # asking does not help
    assert b'href="/org"' in client.get("/account").data
    assert client.get("/admin/quotas").status_code == 403


def test_the_cluster_page_says_what_needs_attention(admin):
    client, engine, app = admin
    page = flashed(client, "/admin")
    assert "Nothing needs attention." in page and "no controller" in page
    partial = client.get("/admin?partial=1").data.decode()
    assert "<html" not in partial and "Health" in partial
    # No Prometheus configured: the history section says how to have one, and draws nothing.
    assert "History charts need Prometheus" in page and "monitoring.prometheus" in page and "<svg" not in page
    # No controller: no node is known, and its pages say why rather than showing an empty page.
    for path in ("/admin/nodes/n1", "/admin/nodes/n1/logs", "/admin/nodes/n1/logs/more?after=1"):
        answer = client.get(path)
        assert answer.status_code == 404 and "This gateway has no controller" in answer.data.decode(), path


def test_an_operator_makes_a_key_in_a_project_shown_once_or_as_a_claim_link(admin):
    client, engine, _ = admin
    project = orgtree.add(engine, "project", "ci", "default/default")
    person = accounts.create_user(engine, "dev@example.org", PASSWORD, state=accounts.ACTIVE)
    def make(**fields):
        return client.post("/admin/people/key", data={"csrf_token": token(client.get("/admin/people").data), **fields})

    made = make(project=project.id, name="runner", expires="30d")
    secret = re.search(r"sk-llmgw-[\w-]+", made.data.decode()).group(0)
    assert secret not in made.headers.get("Set-Cookie", "")  # not kept in the session
    assert secret not in flashed(client)  # never shown again
    linked = make(project=project.id, name="for-dev", expires="", claim="1", **{"for": person.id}).data.decode()
    link = re.search(r"http://[^\s<]+/claim/[\w-]+", linked).group(0)
    assert "sk-llmgw-" not in linked
    records = {r.name: r for r in keys.list_keys(engine)}
    assert records["for-dev"].user_id == person.id and records["runner"].project == "default/default/ci"
    claim_path = link.split("localhost", 1)[-1]
    other = client.application.test_client()
    page = other.get(claim_path).data
    assert b"sk-llmgw-" in other.post(claim_path, data={"csrf_token": token(page)}).data


def test_hostile_quota_values_are_refused_in_a_sentence_never_a_500(admin):
    client, engine, _ = admin
    project = orgtree.add(engine, "project", "p", "default/default")

    def refused(expected: str, **fields):
        answer = act(client, "/admin/quotas", **fields)
        assert answer.status_code == 302, fields
        location = answer.headers["Location"]
        assert location.startswith("/admin/quotas") and not re.search(r"[\r\n ]", location), location
        assert str(escape(expected)) in flashed(client, "/admin/quotas"), fields
        return location

    # An id with a line break goes back to its form quoted: it once broke the Location header.
    location = refused("Rpm is a whole number", scope="key", id="x\r\nSet-Cookie:a=b", rpm="abc")
    assert location == "/admin/quotas?edit=key:x%0D%0ASet-Cookie:a%3Db"
    for name, value in (("rpm", "99999999999999999999"), ("tpm", "9223372036854775808"), ("rpm", "2147483648"),
                        ("tpm", "1" * 5000), ("rpm", "²"), ("rpm", "-1")):
        refused(f"{name.capitalize()} is a whole number from 0 to 2,147,483,647", scope="project", id=project.id,
                **{name: value})
    for value in ("1e400", "nan", "-Infinity", "1e999999999", "-1", "1000000000.5", "ten"):
        refused(f"The budget {value[:20]!r} is not an amount; write a number of whole units from 0 to 1,000,000,000",
                scope="project", id=project.id, budget=value)
    for name, value in (("input", "nan"), ("input", "1e999"), ("output", "1e400"), ("output", "9223372036854775808")):
        refused(f"The {name} price {value!r} is not an amount", do="price", model="m", **{name: value})
    refused("A price is for a model named in 1 to 200 characters", do="price", model="m" * 201, input="1")
    refused("No key has an id that long: ids are at most 32 characters", scope="key", id="k" * 33, rpm="1")
    with engine.connect() as conn:
        assert limits.read_all(conn) == {} and limits.read_prices(conn).by_model == {}
    # The largest values are kept, and shown again as they were written.
    act(client, "/admin/quotas", scope="project", id=project.id, rpm="2147483647", budget="1000000000")
    with engine.connect() as conn:
        kept = limits.read_all(conn)[("project", project.id)]
    assert (kept.rpm, kept.budget) == (2147483647, 10**15)
    assert 'value="1000000000"' in flashed(client, f"/admin/quotas?edit=project:{project.id}")


def test_a_key_lifetime_past_a_century_is_refused_in_a_sentence(admin):
    client, engine, _ = admin
    page = client.get("/admin/people").data
    answer = client.post("/admin/people/key", data={"csrf_token": token(page), "project": "default/default/default",
                                                   "name": "forever", "expires": "9" * 400 + "w"})
    assert answer.status_code == 302 and answer.headers["Location"] == "/admin/people"
    assert "is not a duration of up to a century" in flashed(client)
    assert keys.list_keys(engine) == []
