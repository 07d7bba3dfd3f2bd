"""The key `llmgw up` prints belongs to a project, not to a person: an administrator's account page said "No keys
yet" right after it was printed. It now lists the keys nobody owns, for administrators only, and says where
they are managed."""

from llmgw.people import accounts, keys
from tests.test_pages import sign_in, site  # noqa: F401  (the fixture)

PASSWORD = "a long enough password"


def test_an_administrator_sees_the_starter_key_and_where_to_manage_it(site):  # noqa: F811
    pages, engine, _ = site
    accounts.create_user(engine, "root@example.org", PASSWORD, state=accounts.ACTIVE, is_admin=True)
    starter, _ = keys.create_key(engine, "starter")  # as `llmgw up` makes it
    gone, _ = keys.create_key(engine, "retired-batch-job")
    keys.revoke_key(engine, gone.id)
    client = pages.test_client()
    sign_in(client, "root@example.org", PASSWORD)
    page = client.get("/account").data.decode()
    assert "No keys yet." in page  # none of their own
    unowned = page.split('id="unowned"')[1].split("<h3>")[0]
    assert "starter" in unowned and f"{starter.prefix}…" in unowned and "default/default/default" in unowned
    assert 'href="/admin/people"' in unowned and "llmgw keys list" in unowned
    assert "retired-batch-job" not in page  # revoked
    assert "/revoke" not in unowned  # managed on the People page, which lists it
    people = client.get("/admin/people").data.decode()
    assert "starter" in people and f"{starter.prefix}…" in people


def test_a_person_who_is_no_administrator_is_not_shown_them(site):  # noqa: F811
    pages, engine, _ = site
    accounts.create_user(engine, "plain@example.org", PASSWORD, state=accounts.ACTIVE)
    keys.create_key(engine, "starter")
    client = pages.test_client()
    sign_in(client, "plain@example.org", PASSWORD)
    page = client.get("/account").data.decode()
    assert "No keys yet." in page and "starter" not in page and 'id="unowned"' not in page
