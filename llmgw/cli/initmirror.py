"""Where `llmgw init` finds the model mirror: beside the control plane (the default), on another machine
(`--mirror URL`, a mirror `llmgw mirror init` made), or nowhere (`--no-mirror`).

For another machine's mirror, init asks its management API two things before writing a line: the address
nodes fetch files at (its health answer's `base_url`), and what it holds, so that the starter model and the
guard judge go into the catalog only when nodes can fetch them. It copies the mirror's token beside the
configuration (mode 0600), where `llmgw mirror` and the mirror page read it.
"""

from __future__ import annotations

import os

import click

from llmgw import filemodes
from llmgw.apiclient import ApiClient, ApiError
from llmgw.cli.bringup import Steps

NONE = "none"


class Mirror:
    """What init writes about the mirror and what it holds (`held`, as MirrorDir.versions gives it)."""

    def __init__(self, settings: dict, base_url: str | None, held: list[dict], runs_here: bool):
        self.settings = settings  # mirror.* settings for the configuration
        self.base_url = base_url  # where nodes fetch files; None without a mirror
        self.held = held
        self.runs_here = runs_here  # the mirror role runs on this machine


def elsewhere(steps: Steps, url: str, token_file: str | None, config_dir: str) -> Mirror:
    """Another machine's mirror, whose management API answers at URL with the token in TOKEN_FILE (a copy)."""
    if not url.startswith(("http://", "https://")):
        raise click.BadParameter("the mirror's management address, such as http://models.internal:8082",
                                 param_hint="--mirror")
    if not token_file:
        raise click.UsageError("--mirror needs --mirror-token FILE: a copy of that mirror's api.token (`llmgw mirror "
                               "init` there said where it is)")
    try:
        with open(token_file, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise click.BadParameter(f"cannot read it: {e.strerror}", param_hint="--mirror-token") from None
    client = ApiClient(url, "the mirror's management API", "Is it running, and does its mirror.api_allow list this "
                       "machine? (`llmgw mirror init --controller ADDRESS` sets it.)", token)
    try:
        health = client.call("GET", "/api/v1/health", timeout=10)
        held = client.call("GET", "/api/v1/models", timeout=30)["held"]
    except ApiError as e:
        raise click.ClickException(f"{e}") from None
    except (KeyError, TypeError):
        raise click.ClickException(f"{url} does not answer as a llmgw mirror's management API") from None
    base_url = str(health.get("base_url") or "").rstrip("/")
    if not base_url:
        raise click.ClickException(f"the mirror at {url} does not say where nodes fetch its files")
    copy = os.path.join(config_dir, "mirror.token")
    _ensure_copy(steps, copy, token)
    steps.kept(f"the mirror at {url}: nodes fetch its files at {base_url}; it holds {len(held)} model versions")
    return Mirror({"mirror.api": url.rstrip("/"), "mirror.base_url": base_url, "mirror.token_file": copy},
                  base_url, held, runs_here=False)


def _ensure_copy(steps: Steps, path: str, token: str) -> None:
    try:
        with open(path, encoding="utf-8") as f:
            same = f.read().strip() == token
    except OSError:
        same = False
    if same:
        steps.kept(f"the mirror's token ({path})")
    else:
        steps.do(f"the mirror's token ({path}, mode 0600)", lambda: filemodes.write_private(path, token + "\n"),
                 how="copy")


def nowhere(steps: Steps) -> Mirror:
    steps.skip("the mirror (--no-mirror): nodes have nowhere to fetch weights from until `mirror.api` and "
               "`mirror.base_url` name one, so no model is put in the catalog")
    return Mirror({"mirror.api": ""}, None, [], runs_here=False)


def beside(models_dir: str, base_url: str) -> Mirror:
    """The mirror this machine runs, serving MODELS_DIR at BASE_URL."""
    from llmgw.mirror.store import MirrorDir

    return Mirror({}, base_url, MirrorDir(models_dir).versions(), runs_here=True)
