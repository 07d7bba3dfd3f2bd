"""A real OpenID provider for the sign-in tests (tests/clients/oidc-provider.mjs: npm's oidc-provider, which
`make` installs), started on a loopback port in a process of its own, with the accounts and clients a test
gives. Its accounts live in a file, read at each sign-in, so a test changes someone's groups by `set_account`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.parse

import requests

from tests.conftest import ROOT

SCRIPT = os.path.join(ROOT, "tests", "clients", "oidc-provider.mjs")


class OidcProvider:
    def __init__(self, folder, accounts: dict[str, dict], clients: list[dict]):
        """ACCOUNTS: login name -> claims (email, email_verified, name, groups). CLIENTS: oidc-provider's client
        metadata (client_id, client_secret, redirect_uris, ...)."""
        node = shutil.which("node")
        if node is None or not os.path.exists(os.path.join(ROOT, "tests", "clients", "node_modules", "oidc-provider")):
            raise RuntimeError("the OpenID provider needs Node.js and `make clients` (tests/clients/node_modules)")
        self.accounts_file = os.path.join(folder, "oidc-accounts.json")
        self.accounts = dict(accounts)
        self._write()
        setup = os.path.join(folder, "oidc-setup.json")
        with open(setup, "w") as f:
            json.dump({"clients": clients, "accounts": self.accounts_file}, f)
        self.log = open(os.path.join(folder, "oidc-provider.log"), "w")
        self.proc = subprocess.Popen([node, SCRIPT, setup], stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     cwd=os.path.dirname(SCRIPT))
        self.issuer = (self.proc.stdout.readline() or "").strip()
        if not self.issuer.startswith("http://127.0.0.1:"):
            self.stop()
            raise RuntimeError(f"the OpenID provider did not start (see {self.log.name})")

    def _write(self) -> None:
        with open(self.accounts_file + ".new", "w") as f:
            json.dump(self.accounts, f)
        os.replace(self.accounts_file + ".new", self.accounts_file)

    def set_account(self, login: str, **claims) -> None:
        """Change LOGIN's claims (its groups, say) as the provider answers them from its next sign-in."""
        self.accounts[login] = {**self.accounts.get(login, {}), **claims}
        self._write()

    def sign_in(self, start: str, login: str, back_to: str, browser: requests.Session | None = None) -> str:
        """Go from START (an authorization request's URL) through the provider's own login form as LOGIN, as a
        browser would; the address it finally sends the browser to, at BACK_TO, which is not followed. BROWSER
        keeps the provider's cookies between sign-ins (a person signed in there already)."""
        answer = self._walk(start, login, back_to, browser or requests.Session())
        if not answer.is_redirect:
            raise AssertionError(f"the provider did not send the browser back: {answer.status_code} {answer.text[:300]}")
        return answer.headers["location"]

    def confirm_device(self, url: str, login: str) -> str:
        """Confirm a device sign-in as LOGIN, from URL (its verification_uri_complete); the page that ends it."""
        return self._walk(url, login, "\0", requests.Session()).text

    @staticmethod
    def _walk(start: str, login: str, back_to: str, browser: requests.Session) -> requests.Response:
        def follow(answer):  # redirects, up to the one back to BACK_TO
            while answer.is_redirect and not answer.headers["location"].startswith(back_to):
                answer = browser.get(urllib.parse.urljoin(answer.url, answer.headers["location"]), timeout=10,
                                     allow_redirects=False)
            return answer

        answer = follow(browser.get(start, timeout=10, allow_redirects=False))
        for _ in range(6):  # its forms (the device code's, the login form), posted with their hidden fields
            form = re.search(r'<form[^>]*action="([^"]+)"', answer.text)
            if answer.status_code != 200 or not form:
                break
            fields = dict(re.findall(r'<input[^>]*type="hidden"[^>]*name="([^"]+)"[^>]*value="([^"]*)"', answer.text))
            fields.update(login=login, password="any password")
            answer = follow(browser.post(urllib.parse.urljoin(answer.url, form.group(1)), data=fields, timeout=10,
                                         allow_redirects=False))
        return answer

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.log.close()
