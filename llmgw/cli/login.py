"""`llmgw login`: a key for this person, through the organisation's identity provider, without a password.

The gateway runs the provider's device authorization grant (llmgw/web/oidcpages.py): this command asks it
to begin, shows the address and code to confirm at the provider (in any browser, on any device), and asks
again every few seconds until the person has confirmed; the gateway then makes a key for them, once, and
this command prints it with the address to use it at. Nothing here holds the provider's client secret or
its tokens: the gateway keeps the device code and answers only a handle.
"""

from __future__ import annotations

import json
import time

import click

from llmgw.apiclient import ApiClient, ApiError, Refused
from llmgw.principals import KEY_VARIABLE


@click.command()
@click.argument("gateway", required=False, envvar="LLMGW_URL")
@click.option("--provider", help="Which identity provider, where the gateway has several.")
@click.option("--project", metavar="PATH", help="Make the key in this project (one you belong to); default: a "
                                                "personal key.")
@click.option("--json", "as_json", is_flag=True, help="Print the key and address as one JSON object.")
@click.pass_obj
def login(obj, gateway, provider, project, as_json):
    """Sign in through the identity provider and get an API key.

    GATEWAY is the gateway's address (https://llm.example.com), or $LLMGW_URL, or gateway.public_url from
    --config. The key is printed once; keep it where your tools read it (`export LLMGW_API_KEY=...`)."""
    if not gateway:
        gateway = obj.config().values["gateway.public_url"] if obj.config_path else ""
    if not gateway:
        raise click.UsageError("say which gateway: llmgw login https://llm.example.com (or set LLMGW_URL)")
    client = ApiClient(gateway, "the gateway", hint="Check the address, and that the gateway runs.")
    try:
        started = client.call("POST", "/login/device", {"provider": provider, "project": project})
        done = _wait(client, started, as_json)
    except ApiError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps({k: done[k] for k in ("email", "key", "key_id", "project", "base_url")}))
        return
    click.echo(f"Signed in as {done['email']}. Your key ({done['project']}), shown once:\n")
    click.echo(f"  export {KEY_VARIABLE}={done['key']}")
    click.echo(f"  export OPENAI_API_KEY=${KEY_VARIABLE} OPENAI_BASE_URL={done['base_url']}\n")
    click.echo("Your account page lists and revokes your keys; its editor settings use the key from "
               f"${KEY_VARIABLE}.")


def _wait(client: ApiClient, started: dict, quiet: bool) -> dict:
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
