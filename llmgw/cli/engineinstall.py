"""Installing an engine on a node now, and waiting until it is installed: `llmgw ctl install-engine` and
`llmgw node add --wait-engine`.

A node installs an engine from its catalogue (`[[engines]]`) when a replica first needs it; vLLM is
gigabytes, so the first replica of a model waits minutes for it. Asking ahead moves that wait to when the
node joins. The controller asks the agent (`install_engine`); the install's progress and outcome come
back in the node's heartbeats (`installs`), which this follows through the admin API, riding out a
controller that restarts or fails over meanwhile.
"""

from __future__ import annotations

import time
from typing import Callable

from llmgw.apiclient import ApiClient, ApiError, segment
from llmgw.units import human_bytes

POLL = 2.0  # seconds between looks at the node
SAY_EVERY = 10.0  # seconds between progress lines while the bytes go on arriving
# A "failed" already there when asked is an earlier attempt's until the node has said "installing" since, or
# until this long has passed with it still failed (this attempt failed before any heartbeat showed it going).
STALE_FOR = 15.0


class InstallFailed(Exception):
    """The install failed there, or did not finish in time; the message says why and what to do."""


def _state(node: dict, key: str) -> dict | None:
    """KEY's install state: the latest heartbeat's `installs` when it carried them, else the registration's."""
    status = node.get("status") or {}
    installs = status["installs"] if "installs" in status else (node.get("facts") or {}).get("installs")
    return (installs or {}).get(key)


def install(admin: ApiClient, node: str, engine: str, timeout: float, say: Callable[[str], None]) -> str:
    """Ask NODE to install ENGINE and wait up to TIMEOUT seconds until it has; SAY(line) tells its progress.
    Returns the version. Raises InstallFailed, or the client's ApiError when the controller refuses the ask."""
    version = admin.call("POST", f"/api/v1/nodes/{segment(node)}/engines/{segment(engine)}/install")["version"]
    asked = time.monotonic()
    key, said, last_said, seen_installing = f"{engine}/{version}", "", 0.0, False
    while time.monotonic() < asked + timeout:
        time.sleep(POLL)
        try:
            found = {n["node_id"]: n for n in admin.call("GET", "/api/v1/nodes")["nodes"]}.get(node)
        except ApiError:
            continue  # the controller restarting, or another taking over: the deadline decides
        if found is None:
            continue
        state = _state(found, key) or {}
        elapsed = time.monotonic() - asked
        if state.get("state") == "installed":
            return version
        if state.get("state") == "installing":
            seen_installing = True
            done, total = state.get("bytes_done"), state.get("bytes_total")
            line = f"installing {key}" + (f": {human_bytes(done)} of {human_bytes(total)}" if total else "")
            if not said or (line != said and time.monotonic() - last_said >= SAY_EVERY):
                say(line)
                said, last_said = line, time.monotonic()
        elif state.get("state") == "failed" and (seen_installing or elapsed >= STALE_FOR):
            raise InstallFailed(f"installing {key} failed there: {state.get('detail')}; {state.get('fix')}")
        elif not state and found.get("registered_s", elapsed) < elapsed - POLL:
            raise InstallFailed(f"{node}'s agent started again during the install, which stopped; ask again")
    raise InstallFailed(f"{key} was not installed within {timeout:.0f} s; `llmgw ctl nodes` shows how far it got, "
                        "and the install goes on")
