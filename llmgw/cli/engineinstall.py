"""Installing an engine on a node now, and waiting until it is installed: `llmgw ctl install-engine` and
`llmgw node add --wait-engine`.

A node installs an engine from its catalogue (`[[engines]]`) when a replica first needs it; vLLM is
gigabytes, so the first replica of a model waits minutes for it. Asking ahead moves that wait to when the
node joins. The controller asks the agent (`install_engine`); the install's progress and outcome come
back in the node's heartbeats (`installs`), which this follows through the admin API.
"""

from __future__ import annotations

import time
from typing import Callable

from llmgw.apiclient import ApiClient, segment
from llmgw.units import human_bytes

SAY_EVERY = 10.0  # seconds between progress lines while the bytes go on arriving


class InstallFailed(Exception):
    """The install failed there, or did not finish in time; the message says why and what to do."""


def _state(node: dict, key: str) -> dict | None:
    installs = node.get("status", {}).get("installs") or node.get("facts", {}).get("installs") or {}
    return installs.get(key)


def install(admin: ApiClient, node: str, engine: str, timeout: float, say: Callable[[str], None]) -> str:
    """Ask NODE to install ENGINE and wait up to TIMEOUT seconds until it has; SAY(line) tells its progress.
    Returns the version. Raises InstallFailed, or the client's ApiError when the controller refuses."""
    asked = time.monotonic()
    version = admin.call("POST", f"/api/v1/nodes/{segment(node)}/engines/{segment(engine)}/install")["version"]
    key, said, last_said = f"{engine}/{version}", "", 0.0
    deadline = asked + timeout
    while time.monotonic() < deadline:
        found = {n["node_id"]: n for n in admin.call("GET", "/api/v1/nodes")["nodes"]}.get(node)
        if found is None:
            raise InstallFailed(f"{node} is no longer a node of this controller")
        state = _state(found, key) or {}
        # A state from before the request (an earlier failure) counts only once the node was heard after it.
        heard_since = found["last_heard_s"] < time.monotonic() - asked
        if state.get("state") == "installed":
            return version
        if state.get("state") == "failed" and heard_since:
            raise InstallFailed(f"installing {key} failed there: {state.get('detail')}; {state.get('fix')}")
        if state.get("state") == "installing":
            done, total = state.get("bytes_done"), state.get("bytes_total")
            line = f"installing {key}" + (f": {human_bytes(done)} of {human_bytes(total)}" if total else "")
            if not said or (line != said and time.monotonic() - last_said >= SAY_EVERY):
                say(line)
                said, last_said = line, time.monotonic()
        time.sleep(1.0)
    raise InstallFailed(f"{key} was not installed within {timeout:.0f} s; `llmgw ctl nodes` shows how far it got, "
                        "and the install goes on")
