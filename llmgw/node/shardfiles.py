"""Each engine's state file, `WORK_DIR/shards/ID.json` (0600: it holds the engine's key): what lets a
restarted agent adopt the engines its predecessor left running, and what `llmgw up`, `node add` and the
tests read to find the engines a node runs.
"""

from __future__ import annotations

import json
import os


def path_of(work_dir: str, shard_id: str) -> str:
    return os.path.join(work_dir, "shards", f"{shard_id}.json")


def save(work_dir: str, shard_id: str, data: dict | None) -> None:
    """Write DATA as SHARD_ID's state (replacing the file whole), or remove it when DATA is None."""
    path = path_of(work_dir, shard_id)
    if data is None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        return
    tmp = path + ".tmp"
    # Mode 0600 from the start: it holds the engine's key.
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def alive(pid: int) -> bool:
    """Whether PID runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _states(work_dir: str):
    """(shard id, path, its state or None where the file cannot be read) for each state file in WORK_DIR."""
    folder = os.path.join(work_dir, "shards")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        if not name.endswith(".json"):
            continue
        path = os.path.join(folder, name)
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = None
        yield name[:-len(".json")], path, data if isinstance(data, dict) else None


def left_running(work_dir: str) -> list[dict]:
    """The state of each engine in WORK_DIR whose process still runs, by shard id; the files of engines that
    died, and those that cannot be read, are removed."""
    found = []
    for _, path, data in _states(work_dir):
        if data is None or not data.get("pid") or not alive(data["pid"]):
            os.remove(path)
            continue
        found.append(data)
    return found


def running_engines(work_dir: str) -> dict[str, int]:
    """shard id -> pid of every engine the state files in WORK_DIR list as running (nothing is removed)."""
    return {shard_id: data["pid"] for shard_id, _, data in _states(work_dir)
            if data is not None and data.get("pid") and alive(data["pid"])}
