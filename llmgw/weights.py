"""Fetching a model's weights onto a node: once, resumable, and never visible half-written.

A source that is a URL is downloaded into the node's weights directory under
a name made from the URL (so two replicas of one model share one download).
Bytes go to `NAME.part`; an interrupted download resumes from where it
stopped with a Range request; the file appears under its final name only when
complete. Progress reports bytes done and, when the server says, the total:
no invented percentage.

A path is used where it is, but only inside the node's weights directory or a
directory `agent.local_sources` lists (symlinks and `..` resolved first): an
administrator's catalog entry `source = "/etc/shadow"` had llama.cpp open the
file and print its first bytes into the shard's log. The mirror bounds its
local sources with the same function (`inside_listed`).

Each download is marked as llmgw's: before its first byte, a small file in
`WEIGHTS_DIR/.llmgw-fetched/` records the source it comes from. Only a marked
entry whose name is the one `fetch` makes for that source is ever removed
(`reclaim`), so an operator's own files in the weights directory are never
touched. What the directory holds is listed by `inventory`, bounded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request

CHUNK = 1 << 20
PROGRESS_EVERY = 1.0  # seconds between progress reports

_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


class FetchError(Exception):
    """A download that failed; the message says what the server or the disk said."""


class LocalRefused(FetchError):
    """A local source outside the directories this node may read weights from."""


def is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def inside_listed(path: str, folders: list[str]) -> str | None:
    """PATH's real path when it lies inside one of FOLDERS (each resolved too: a listed directory that is a
    symlink is the place it points to), else None. Nothing is opened, so a refusal says nothing of what
    lies outside."""
    real = os.path.realpath(path)
    for folder in folders:
        folder = os.path.realpath(folder)
        if os.path.commonpath([real, folder]) == folder:
            return real
    return None


def local_file(source: str, weights_dir: str, local_sources: list[str]) -> str:
    """The real path of the local SOURCE (a path or `file://` URL) an engine may be given: inside WEIGHTS_DIR
    or one of LOCAL_SOURCES. Raises LocalRefused naming the setting to change."""
    path = source[len("file://"):] if source.startswith("file://") else source
    real = inside_listed(path, [weights_dir, *local_sources]) if os.path.isabs(path) else None
    if real is None:
        listed = ", ".join([weights_dir, *local_sources])
        raise LocalRefused(f"{source} is not inside a directory this node reads weights from ({listed}); add "
                           "its directory to agent.local_sources in this node's configuration, or serve the "
                           "file from the mirror and use its http(s) URL as the source")
    return real


def local_name(source: str, weights_dir: str) -> str:
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    base = os.path.basename(source.split("?", 1)[0]) or "model"
    return os.path.join(weights_dir, f"{digest}-{base}")


SHA_HEADER = "X-Llmgw-Sha256"  # the mirror says what a file's bytes hash to


def fetch(source: str, weights_dir: str, progress=lambda done, total: None, local_sources: list[str] = ()) -> str:
    """The local path of SOURCE, downloading it first when it is a URL. A mirror version's URL (ending
    in "/") is a set of files, fetched whole: the path is then its directory, or its first GGUF shard
    (llama.cpp finds the other shards beside it). A path must be inside WEIGHTS_DIR or LOCAL_SOURCES."""
    if not is_url(source):
        return local_file(source, weights_dir, local_sources)
    if source.endswith("/"):
        return _fetch_set(source, weights_dir, progress)
    target = local_name(source, weights_dir)
    with _locks_guard:
        lock = _locks.setdefault(target, threading.Lock())
    with lock:  # a second shard of the same model waits for the first download
        mark(source, weights_dir)
        if os.path.exists(target):
            return target
        expected = download(source, target, progress)
        if expected:
            got = sha256_of(target)
            if got != expected:
                os.remove(target)
                raise FetchError(f"{source} arrived corrupt: its sha256 is {got}, the mirror says {expected}; "
                                 "it is fetched again on the next try")
        return target


def _fetch_set(source: str, weights_dir: str, progress) -> str:
    folder = local_name(source.rstrip("/"), weights_dir)
    marker = os.path.join(folder, ".complete")  # written last: a folder with some shards is no model
    with _locks_guard:
        lock = _locks.setdefault(folder, threading.Lock())
    with lock:
        mark(source, weights_dir)
        if not os.path.exists(marker):
            try:
                with urllib.request.urlopen(source, timeout=60) as resp:
                    manifest = json.load(resp)
                files = [(f["name"], f["url"], f.get("sha256")) for f in manifest["files"]]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise FetchError(f"{source} has to be a mirror version (a manifest of files): {e}") from None
            os.makedirs(folder, exist_ok=True)
            base = 0
            for name, url, expected in files:
                target = os.path.join(folder, os.path.basename(name))
                if not os.path.exists(target):
                    vouched = download(url, target, lambda done, total, base=base: progress(base + done, None))
                    if (expected or vouched) and sha256_of(target) != (expected or vouched):
                        os.remove(target)
                        raise FetchError(f"{url} arrived corrupt (its sha256 differs from the mirror's); "
                                         "it is fetched again on the next try")
                base += os.path.getsize(target)
            open(marker, "w").close()
            progress(base, base)
    names = sorted(n for n in os.listdir(folder) if not n.startswith("."))
    ggufs = [n for n in names if n.endswith(".gguf")]
    return os.path.join(folder, ggufs[0]) if ggufs else folder


def download(source: str, target: str, progress=lambda done, total: None,
             urlopen=urllib.request.urlopen) -> str | None:
    """Download SOURCE to TARGET through `TARGET.part`, resuming a part left by an earlier try, with URLOPEN
    (the mirror's checks where it may connect). Returns the sha256 the server vouched for
    (`X-Llmgw-Sha256`), if it did."""
    partial = target + ".part"
    done = os.path.getsize(partial) if os.path.exists(partial) else 0
    req = urllib.request.Request(source, headers={"Range": f"bytes={done}-"} if done else {})
    try:
        resp = urlopen(req, timeout=60)
    except urllib.error.HTTPError as e:
        vouched = e.headers.get(SHA_HEADER)
        e.close()
        if e.code == 416 and done:  # asked for bytes past the end: the part is whole
            os.replace(partial, target)
            return vouched
        raise FetchError(f"{source} answered {e.code} {e.reason}") from None
    except OSError as e:
        raise FetchError(f"cannot fetch {source}: {e}") from None
    with resp:
        vouched = resp.headers.get(SHA_HEADER)
        if done and resp.status != 206:
            done = 0  # the server ignored the Range: start again
        total = None
        length = resp.headers.get("Content-Length")
        if length is not None and length.isdigit():
            total = done + int(length)
        mode = "ab" if done else "wb"
        last = 0.0
        try:
            with open(partial, mode) as out:
                while True:
                    chunk = resp.read(CHUNK)
                    if not chunk:
                        break
                    out.write(chunk)
                    done += len(chunk)
                    if time.monotonic() - last >= PROGRESS_EVERY:
                        progress(done, total)
                        last = time.monotonic()
        except OSError as e:
            raise FetchError(f"downloading {source} broke off after {done} bytes: {e}") from None
    if total is not None and done < total:
        raise FetchError(f"downloading {source} broke off after {done} of {total} bytes; it resumes next time")
    progress(done, total)
    os.replace(partial, target)
    return vouched


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK)
            if not chunk:
                return digest.hexdigest()
            digest.update(chunk)


# --- what the weights directory holds, and taking back what llmgw fetched and nothing uses ------------------

MARKS = ".llmgw-fetched"  # beside the entries; hidden, so never an entry itself
LISTED_MOST = 1000  # entries a listing names, largest first: a reply stays well under a megabyte


def fetched_name(source: str) -> str:
    """The entry `fetch` makes in the weights directory for the URL SOURCE (a file, or a mirror version's folder)."""
    return os.path.basename(local_name(source.rstrip("/"), ""))


def mark(source: str, weights_dir: str) -> None:
    """Record that SOURCE's entry is llmgw's download. Written before the first byte (a broken-off download is
    llmgw's too), and again when an entry fetched before marks existed is used, so it becomes reclaimable."""
    folder = os.path.join(weights_dir, MARKS)
    path = os.path.join(folder, fetched_name(source) + ".json")
    if os.path.exists(path):
        return
    os.makedirs(folder, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump({"source": source, "marked_at": round(time.time())}, f)
    os.replace(path + ".tmp", path)


def fetched_source(weights_dir: str, name: str) -> str | None:
    """The URL entry NAME was fetched from, when llmgw fetched it: its mark says so, and NAME is the name
    `fetch` makes for that URL (a mark copied beside another file vouches for nothing)."""
    try:
        with open(os.path.join(weights_dir, MARKS, name + ".json")) as f:
            source = json.load(f).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    return source if isinstance(source, str) and is_url(source) and fetched_name(source) == name else None


def _entry_name(name: str) -> str:
    """The entry a top-level NAME belongs to: a download's `.part` belongs to the file it becomes."""
    return name[:-len(".part")] if name.endswith(".part") else name


def _size(path: str) -> int:
    """Bytes under PATH, links not followed (a link counts as itself, never as what it points to)."""
    if not os.path.isdir(path) or os.path.islink(path):
        return os.lstat(path).st_size
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass  # gone meanwhile
    return total


def inventory(weights_dir: str, local_sources: list[str] = (), in_use: dict[str, list[str]] | None = None,
              most: int = LISTED_MOST) -> dict:
    """What WEIGHTS_DIR holds, one entry per top-level name: `name`, `bytes`, `fetched` (and its `source`),
    `partial` (a download not finished), `local_source` (inside a directory `agent.local_sources` lists),
    `shards` (the engines IN_USE says use it). The MOST largest are named; `entries` and `bytes` count all."""
    in_use = in_use or {}
    try:
        names = [n for n in os.listdir(weights_dir) if n != MARKS]
    except FileNotFoundError:
        names = []
    entries: dict[str, dict] = {}
    for name in names:
        path = os.path.join(weights_dir, name)
        try:
            size = _size(path)
        except OSError:
            continue  # removed while it was being listed
        entry = entries.setdefault(_entry_name(name), {"name": _entry_name(name), "bytes": 0})
        entry["bytes"] += size
        if name.endswith(".part"):
            entry["partial"] = True
    for name, entry in entries.items():
        path = os.path.join(weights_dir, name)
        # A link is never llmgw's download, whatever mark lies beside it (reclaim refuses it too).
        source = None if os.path.islink(path) else fetched_source(weights_dir, name)
        entry["fetched"] = source is not None
        if source is not None:
            entry["source"] = source
            if source.endswith("/") and not os.path.exists(os.path.join(path, ".complete")):
                entry["partial"] = True  # a mirror version's folder is whole only once its marker is written
        entry.setdefault("partial", False)
        entry["local_source"] = bool(local_sources) and inside_listed(path, list(local_sources)) is not None
        entry["shards"] = sorted(in_use.get(name, []))
    ordered = sorted(entries.values(), key=lambda e: (-e["bytes"], e["name"]))
    return {"weights_dir": weights_dir, "entries": len(ordered), "bytes": sum(e["bytes"] for e in ordered),
            "fetched_bytes": sum(e["bytes"] for e in ordered if e["fetched"]), "files": ordered[:most],
            "truncated": len(ordered) > most}


def entry_of(path: str, weights_dir: str) -> str | None:
    """The top-level entry of WEIGHTS_DIR that PATH (resolved) lies in, or None when it lies outside."""
    real, folder = os.path.realpath(path), os.path.realpath(weights_dir)
    if real == folder or os.path.commonpath([real, folder]) != folder:
        return None
    return os.path.relpath(real, folder).split(os.sep, 1)[0]


def reclaim(name, weights_dir: str, local_sources: list[str] = (), in_use: dict[str, list[str]] | None = None
            ) -> str | None:
    """Remove entry NAME of WEIGHTS_DIR, with its partial download and its mark; the reason when it is refused.
    The controller names only what the node listed, but NAME is checked here as if it came from anyone: a
    plain name of an entry right inside WEIGHTS_DIR (symlinks resolved), fetched by llmgw, not inside a
    directory `agent.local_sources` lists, and used by none of the engines IN_USE names."""
    if (not isinstance(name, str) or not name or name in (".", "..") or name.startswith(".") or "/" in name
            or "\0" in name or name.endswith(".part")):
        return (f"{name!r} is not the name of an entry in the weights directory; `llmgw ctl weights` lists "
                "what may be reclaimed")
    path = os.path.join(weights_dir, name)
    present = [p for p in (path, path + ".part") if os.path.lexists(p)]
    if not present:
        return None  # gone already: removing is idempotent
    for p in present:
        if os.path.islink(p) or os.path.dirname(os.path.realpath(p)) != os.path.realpath(weights_dir):
            return f"{name} is a link or leads outside {weights_dir}: llmgw never made it, so it never removes it"
    if fetched_source(weights_dir, name) is None:
        return f"{name} was not fetched by llmgw (it has no mark in {MARKS}/): llmgw never removes it"
    if local_sources and inside_listed(path, list(local_sources)) is not None:
        return f"{name} lies inside a directory agent.local_sources lists: an operator's source is never removed"
    users = (in_use or {}).get(name)
    if users:
        return f"{name} is in use by {', '.join(sorted(users))}; stop those replicas first"
    for p in present:
        if os.path.isdir(p):
            shutil.rmtree(p)
        else:
            os.remove(p)
    # The mark goes last: a removal broken off halfway is still llmgw's, and reclaimed next time.
    os.remove(os.path.join(weights_dir, MARKS, name + ".json"))
    return None
