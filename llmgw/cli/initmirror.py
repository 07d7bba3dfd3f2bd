"""Where `llmgw init` finds the model mirror: beside the control plane (the default), on another machine
(`--mirror URL`, a mirror `llmgw mirror init` made), or nowhere (`--no-mirror`).

For another machine's mirror, init asks its management API two things before it makes anything: the
address nodes fetch files at (its health answer's `base_url`), and what it holds, so that the starter
model and the guard judge go into the catalog only when nodes can fetch them. What that mirror answers is
checked as an answer from another machine: the address must be an http(s) URL with a host, and only
names the mirror itself would accept become catalog sources. Its token is copied beside the
configuration (mode 0600), where `llmgw mirror` and the mirror page read it.

A rerun without `--mirror` or `--no-mirror` keeps what the configuration says (`current`), so a plain
`llmgw init` on such a machine never brings a local mirror up beside the one it uses.
"""

from __future__ import annotations

import os
import urllib.parse

import click

from llmgw import filemodes, settings
from llmgw.apiclient import ApiClient, ApiError
from llmgw.cli.bringup import Steps, say
from llmgw.mirror.store import NAME

NONE = "none"


class Mirror:
    """What init writes about the mirror (`settings`), where nodes fetch from (`base_url`, None without a
    mirror), what it holds (`held`, as MirrorDir.versions gives it) and whether it runs here."""

    def __init__(self, settings_: dict, base_url: str | None, held: list[dict], runs_here: bool, token: str = ""):
        self.settings = settings_
        self.base_url = base_url
        self.held = held
        self.runs_here = runs_here
        self.token = token  # another machine's management token, copied by keep_token

    def keep_token(self, steps: Steps) -> None:
        """The copy of another machine's token, where `mirror.token_file` says (made, or kept when the same)."""
        if not self.token:
            return
        path = self.settings["mirror.token_file"]
        try:
            with open(path, encoding="utf-8") as f:
                same = f.read().strip() == self.token
        except OSError:
            same = False
        if same:
            steps.kept(f"the mirror's token ({path})")
        else:
            steps.do(f"the mirror's token ({path}, mode 0600)",
                     lambda: filemodes.write_private(path, self.token + "\n"), how="copy")


def current(have: settings.Config | None) -> tuple[str | None, str | None]:
    """(mirror, token file) as a configuration an earlier init wrote chose them: (None, None) for a mirror beside
    the control plane (or no configuration), (NONE, None), or another machine's (URL, its token's copy)."""
    if have is None or "mirror.dir" in have.written or "mirror.api" not in have.written:
        return None, None
    api = have.written["mirror.api"]
    if not api:
        return NONE, None
    return api, have["mirror.token_file"] or None


def _base_url(value, asked: str) -> str:
    """The files' address a mirror gave (its health's `base_url`), refused unless it is an http(s) URL with a host
    and nothing but printable ASCII: it goes into every catalog source and the controller's source checks."""
    text = str(value or "").rstrip("/")
    parts = urllib.parse.urlsplit(text)
    if not (text.isascii() and text.isprintable() and " " not in text and parts.scheme in ("http", "https")
            and parts.hostname and not parts.query and not parts.fragment and not parts.username):
        raise click.ClickException(f"the mirror at {asked} says nodes fetch its files at {text[:200]!r}, which is not "
                                   "an http(s) address with a host; check mirror.base_url in its configuration")
    return text


def _well_formed(held) -> list[dict]:
    """The versions in another machine's listing that are what a mirror could hold: names its own store
    accepts (so a source built of them stays inside the mirror), files with such names."""
    out = []
    for v in held if isinstance(held, list) else []:
        if not isinstance(v, dict) or not all(isinstance(v.get(k), str) and NAME.match(v[k]) for k in ("model", "version")):
            continue
        files = [f for f in v.get("files") or [] if isinstance(f, dict) and isinstance(f.get("name"), str)
                 and NAME.match(f["name"])]
        out.append({"model": v["model"], "version": v["version"], "files": files})
    return out


def elsewhere(url: str, token_file: str | None, config_dir: str) -> Mirror:
    """Another machine's mirror, whose management API answers at URL with the token in TOKEN_FILE (a copy). Asks
    it, and makes nothing: the token is copied by keep_token."""
    if not url.startswith(("http://", "https://")):
        raise click.BadParameter("the mirror's management address, such as http://models.internal:8082",
                                 param_hint="--mirror")
    if not token_file:
        raise click.UsageError("--mirror needs --mirror-token FILE: a copy of that mirror's api.token (`llmgw mirror "
                               "init` there said where it is)")
    try:
        with open(token_file, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise click.BadParameter(f"cannot read {token_file}: {e}", param_hint="--mirror-token") from None
    client = ApiClient(url, "the mirror's management API", "Is it running, and does its mirror.api_allow list this "
                       "machine? (`llmgw mirror init --controller ADDRESS` sets it.)", token)
    try:
        health = client.call("GET", "/api/v1/health", timeout=10)
        listing = client.call("GET", "/api/v1/models", timeout=30)
    except ApiError as e:
        raise click.ClickException(str(e)) from None
    if not isinstance(health, dict) or not isinstance(listing, dict):
        raise click.ClickException(f"{url} does not answer as a llmgw mirror's management API")
    base_url = _base_url(health.get("base_url"), url)
    held = _well_formed(listing.get("held"))
    say(f"...   the mirror at {url}: nodes fetch its files at {base_url}; it holds {len(held)} model versions")
    copy = os.path.join(config_dir, "mirror.token")
    return Mirror({"mirror.api": url.rstrip("/"), "mirror.base_url": base_url, "mirror.token_file": copy},
                  base_url, held, runs_here=False, token=token)


def nowhere() -> Mirror:
    return Mirror({"mirror.api": ""}, None, [], runs_here=False)


def beside(settings_: dict) -> Mirror:
    """The mirror this machine runs, with SETTINGS_ (its `mirror.*`, `mirror.dir` among them)."""
    from llmgw.mirror.store import MirrorDir

    return Mirror(settings_, settings_["mirror.base_url"], MirrorDir(settings_["mirror.dir"]).versions(), runs_here=True)
