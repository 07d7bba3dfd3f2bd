"""`llmgw login`: a key for this person, through the organisation's identity provider or the pages, without
typing a password here.

Two ways, both run with the gateway (llmgw/web/clilogin.py):

- the provider's device flow, where it has one: the gateway begins it, this command shows the address and
  code to confirm at the provider (in any browser, on any device) and asks again every few seconds until
  the person has; the gateway then makes the key, once. Nothing here holds the provider's client secret or
  its tokens: the gateway keeps the device code and answers only a handle.
- the browser on this computer (`--browser`, and where the provider has no device flow, or the gateway no
  provider), as RFC 8252 has native apps do: this command listens on a loopback port and opens the
  gateway's `/login/cli` with it and the S256 challenge of a verifier it keeps; the person signs in as on any
  page, checks that the page shows the words printed here, and makes the key; the browser brings a one-time
  code back to the port, and only this command's verifier redeems it.
"""

from __future__ import annotations

import http.server
import json
import secrets
import threading
import time
import urllib.parse
import webbrowser

import click

from llmgw import pkce
from llmgw.apiclient import ApiClient, ApiError, Refused
from llmgw.principals import KEY_VARIABLE

BROWSER_SECONDS = 600.0  # the person has this long to sign in and press the button


@click.command()
@click.argument("gateway", required=False, envvar="LLMGW_URL")
@click.option("--provider", help="Which identity provider, where the gateway has several.")
@click.option("--project", metavar="PATH", help="Make the key in this project (one you belong to); default: a "
                                                "personal key.")
@click.option("--browser", "use_browser", is_flag=True,
              help="Sign in through a browser on this computer rather than the provider's device flow.")
@click.option("--json", "as_json", is_flag=True, help="Print the key and address as one JSON object.")
@click.pass_obj
def login(obj, gateway, provider, project, use_browser, as_json):
    """Sign in through the identity provider (or the pages) and get an API key.

    GATEWAY is the gateway's address (https://llm.example.com), or $LLMGW_URL, or gateway.public_url from
    --config. The key is printed once and expires after the gateway's auth.login_key_lifetime; keep it where
    your tools read it (`export LLMGW_API_KEY=...`)."""
    if not gateway:
        gateway = obj.config().values["gateway.public_url"] if obj.config_path else ""
    if not gateway:
        raise click.UsageError("say which gateway: llmgw login https://llm.example.com (or set LLMGW_URL)")
    client = ApiClient(gateway, "the gateway", hint="Check the address, and that the gateway runs.")
    try:
        done = None
        if not use_browser:
            try:
                started = client.call("POST", "/login/device", {"provider": provider, "project": project})
            except Refused as e:
                if e.status != 501:  # 501: no device flow here; the browser it is
                    raise
                click.echo(f"{e} Signing in through a browser.", err=True)
            else:
                done = _by_device(client, started, as_json)
        done = done or _by_browser(client, gateway, project, as_json)
    except ApiError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps({k: done[k] for k in ("email", "key", "key_id", "project", "expires_at", "base_url")}))
        return
    expires = (f", until {time.strftime('%Y-%m-%d', time.localtime(done['expires_at']))}" if done.get("expires_at")
               else "")
    click.echo(f"Signed in as {done['email']}. Your key ({done['project']}{expires}), shown once:\n")
    click.echo(f"  export {KEY_VARIABLE}={done['key']}")
    click.echo(f"  export OPENAI_API_KEY=${KEY_VARIABLE} OPENAI_BASE_URL={done['base_url']}\n")
    click.echo("Your account page lists and revokes your keys; its editor settings use the key from "
               f"${KEY_VARIABLE}.")


def _by_device(client: ApiClient, started: dict, quiet: bool) -> dict:
    """Show where to confirm, then ask until the person has; what the gateway answered at the end."""
    where = started.get("verification_uri_complete") or started["verification_uri"]
    click.echo(f"Open {where}\nand confirm the code {started['user_code']} at {started['label']}.", err=quiet)
    interval = started["interval"]
    deadline = time.monotonic() + started["expires_in"]
    while time.monotonic() < deadline:
        time.sleep(interval)
        try:
            answer = client.call("POST", "/login/device/poll", {"handle": started["handle"]})
        except Refused as e:
            if e.status == 429:
                interval += 5
                continue
            raise
        if answer.get("status") == "done":
            return answer
        if answer.get("slow_down"):
            interval += 5
    raise click.ClickException(f"the code expired before it was confirmed at {started['label']}; run llmgw login "
                               "again")


class _Catch(http.server.BaseHTTPRequestHandler):
    """The one request the browser brings back to the loopback port: its code, for the state sent."""

    timeout = 5  # a connection that sends nothing (another local user's) does not hold the port

    def do_GET(self):  # noqa: N802 (http.server's name)
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        given = query.get("state", [""])[0].encode("utf-8", "surrogatepass")
        ours = secrets.compare_digest(given, self.server.state.encode())
        if ours and query.get("code"):
            self.server.code = query["code"][0]
        text = ("The key is in your terminal; you can close this tab." if ours else
                "This did not come from the llmgw login waiting here.").encode()
        self.send_response(200 if ours else 400)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)

    def log_message(self, *args):  # the terminal is for the person, not an access log
        pass


def _by_browser(client: ApiClient, gateway: str, project: str | None, quiet: bool) -> dict:
    verifier = secrets.token_urlsafe(48)
    challenge = pkce.challenge_of(verifier)
    server = http.server.HTTPServer(("127.0.0.1", 0), _Catch)
    server.state, server.code = secrets.token_urlsafe(24), None
    server.timeout = 1.0
    query = {"port": server.server_port, "challenge": challenge, "state": server.state,
             **({"project": project} if project else {})}
    url = f"{gateway.rstrip('/')}/login/cli?{urllib.parse.urlencode(query)}"
    words = pkce.confirmation_words(server.server_port, challenge)
    click.echo(f"Open {url}\nsign in, and make the key if the page shows {words}", err=quiet)
    threading.Thread(target=webbrowser.open, args=(url,), daemon=True).start()
    deadline = time.monotonic() + BROWSER_SECONDS
    try:
        while server.code is None and time.monotonic() < deadline:
            server.handle_request()
    finally:
        server.server_close()
    if server.code is None:
        raise click.ClickException("no key was made in the browser in time; run llmgw login again")
    return client.call("POST", "/login/cli/token", {"code": server.code, "verifier": verifier})
