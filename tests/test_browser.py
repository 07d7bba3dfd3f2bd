"""The pages in a real headless Chromium: sign up, approval, sign in, a key made and used, phone width."""

import re
import subprocess
import sys
import time

import openai
import pytest
from playwright.sync_api import sync_playwright

from llmgw import store
from llmgw.people import accounts
from tests.conftest import Gateway, Sim, chromium, wait_until

PHONE = {"width": 390, "height": 844}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("browser")
    url = f"sqlite:///{tmp}/browser.db"
    engine = store.open_store(url)
    engine.dispose()
    sim = Sim(model="sim", replica="s", ttft_ms=1, tokens_per_s=0)
    gw = Gateway(tmp, url, endpoints=[{"id": "s", "url": sim.url, "models": ["sim"]}], workers=2,
                 gateway__signup_open=True, gateway__contact="the platform team",
                 models=[{"name": "sim", "description": "A simulated model with a rather long description "
                                                        "that must wrap on a phone rather than widen the page."}])
    with sync_playwright() as p:
        browser = chromium(p)
        yield browser, gw, url, tmp
        browser.close()
    gw.stop()
    sim.stop()


def fits_the_screen(page) -> bool:
    return page.evaluate("document.documentElement.scrollWidth") <= page.viewport_size["width"]


def test_sign_up_approve_sign_in_make_a_key_and_use_it(site):
    browser, gw, url, tmp = site
    page = browser.new_page(viewport=PHONE)
    page.goto(gw.url + "/signup")
    page.fill("#email", "ada@example.org")
    page.fill("#password", "correct horse battery")
    page.fill("#repeat", "correct horse battery")
    page.click("button[type=submit]")
    assert "waits for an operator" in page.inner_text("main")
    approved = subprocess.run([sys.executable, "-m", "llmgw", "--store", url, "users", "approve", "ada@example.org"],
                              capture_output=True, text=True)
    assert approved.returncode == 0, approved.stderr
    page.goto(gw.url + "/login")
    page.fill("#email", "ada@example.org")
    page.fill("#password", "correct horse battery")
    page.click("button[type=submit]")
    page.wait_for_url("**/account")
    page.fill("#name", "my editor")
    page.click("form[action='/account/keys'] button")
    secret = re.search(r"sk-llmgw-[\w-]+", page.inner_text(".secret")).group(0)
    page.screenshot(path=str(tmp / "account-phone.png"), full_page=True)
    assert fits_the_screen(page)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=secret, max_retries=0)
    deadline = time.monotonic() + 30
    while True:  # the workers learn of the new key within a second, later on a loaded machine
        try:
            reply = client.chat.completions.create(model="sim", max_tokens=2,
                                                   messages=[{"role": "user", "content": "hi"}])
            break
        except openai.AuthenticationError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert reply.choices[0].message.content
    page.click("text=Revoke")
    page.wait_for_url("**/account")
    assert "No keys yet." in page.inner_text("main")
    def refused() -> bool:  # the workers learn of the revocation within a second, later on a loaded machine
        try:
            client.chat.completions.create(model="sim", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        except openai.AuthenticationError as e:
            return "revoked" in str(e)
        return False
    wait_until("the revoked key to be refused", 30, refused)
    client.close()
    page.click("text=Sign out")
    page.wait_for_url(gw.url + "/")
    assert "Sign in" in page.inner_text("header")
    page.close()


@pytest.mark.parametrize("path", ["/", "/login", "/signup", "/claim/some-token"])
def test_every_page_fits_a_phone(site, path):
    browser, gw, _, tmp = site
    page = browser.new_page(viewport=PHONE)
    page.goto(gw.url + path)
    page.screenshot(path=str(tmp / f"phone{path.replace('/', '-') or '-landing'}.png"), full_page=True)
    assert fits_the_screen(page), path
    page.close()


def test_a_wrong_password_is_said_without_javascript(site):
    browser, gw, url, _ = site
    engine = store.open_engine(url)
    accounts.create_user(engine, "bob@example.org", "a long enough password", state=accounts.ACTIVE)
    engine.dispose()
    context = browser.new_context(java_script_enabled=False, viewport=PHONE)
    page = context.new_page()
    page.goto(gw.url + "/login")
    page.fill("#email", "bob@example.org")
    page.fill("#password", "wrong password!")
    page.click("button[type=submit]")
    assert "Wrong email or password." in page.inner_text("[role=alert]")
    context.close()
