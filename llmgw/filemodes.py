"""Files that hold secrets: made readable by their owner only, and refused at start when others can read them.

The store (a SQLite file, its -wal and -shm, and its directory), the controller's CURVE keys and the admin
API's token, node and gateway key files, the files `@/path` settings name, and a configuration file that
holds a secret itself. llmgw makes each one 0600 (a directory 0700), and every role checks the ones it
uses before it opens any: a local user who could read the store once forged an administrator's session.
A role refuses to start rather than warn, because a warning scrolls by and the secret stays readable;
the refusal names the `chmod` that fixes it.

Imported by: the role files, llmgw/store.py, llmgw/keyfiles.py, the CLI. Imports llmgw.settings only.
"""

from __future__ import annotations

import os
import shlex
import stat

from llmgw import settings

FILE_MODE = 0o600
DIR_MODE = 0o700
OTHERS = 0o077  # every bit for the group and the world
OTHERS_WRITE = 0o022


class LooseFiles(settings.ConfigError):
    """Secret files others may read or change; the message gives the commands that fix them. A configuration
    error, so each role's start refuses it as it refuses a bad setting."""


def make_private_dir(path: str) -> None:
    """Make directory PATH (and any missing parents) with the new one 0700; an existing one is left as it is,
    so that the start-up check can name it rather than have it silently changed."""
    os.makedirs(path, mode=DIR_MODE, exist_ok=True)


def create_private(path: str) -> None:
    """Create PATH empty and 0600 if it is missing. SQLite then makes its -wal and -shm files with the same
    mode as the database file, which it would otherwise create 0644."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))
    except FileExistsError:
        pass


def sqlite_path(url: str) -> str | None:
    """The file of a `sqlite:///PATH` store URL, or None for any other store (or an in-memory one)."""
    if not url.startswith("sqlite:///"):
        return None
    path = url[len("sqlite:///"):].partition("?")[0]
    return path if path and path != ":memory:" else None


def _fix(path: str, forbidden: int) -> str | None:
    """The command that takes FORBIDDEN bits off PATH, or None when it has none of them (or does not exist)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    if not mode & forbidden:
        return None
    quoted = shlex.quote(path)
    if forbidden == OTHERS_WRITE:
        return f"chmod go-w {quoted}"
    return f"chmod {DIR_MODE if stat.S_ISDIR(mode) else FILE_MODE:o} {quoted}"


def refuse_loose(paths: dict[str, int]) -> None:
    """Raise LooseFiles when any of PATHS (path -> bits nobody but the owner may have) has such a bit."""
    fixes = [fix for path, forbidden in paths.items() if (fix := _fix(os.path.abspath(path), forbidden))]
    if fixes:
        raise LooseFiles("other users of this machine can read or change files that hold secrets (the store, "
                         "keys, tokens, a configuration with a secret in it), so it will not start. Make them "
                         f"yours alone, then start again:\n  {'; '.join(fixes)}")


def store_files(url: str) -> list[str]:
    """The files a SQLite store URL stands for: its directory, the database, its -wal and -shm."""
    path = sqlite_path(url)
    if path is None:
        return []
    path = os.path.abspath(path)
    return [os.path.dirname(path), path, path + "-wal", path + "-shm"]


def role_files(cfg: settings.Config, role: str) -> dict[str, int]:
    """What ROLE holds secrets in, as CFG names them: path -> the bits nobody but the owner may have."""
    keys_dir = cfg["controller.keys_dir"]
    paths = {
        "controller": [*store_files(cfg["store.url"]), keys_dir, os.path.join(keys_dir, "controller.key"),
                       os.path.join(keys_dir, "admin.token")],
        # The pages read the admin API's token from keys_dir when the controller runs on this machine.
        "gateway": [*store_files(cfg["store.url"]), cfg["gateway.key_file"], os.path.join(keys_dir, "admin.token"),
                    *(p["client_secret_file"] for p in cfg.identity_providers if p["client_secret_file"])],
        "agent": [cfg["agent.key_file"]],
        "mirror": [],
    }[role]
    found = {path: OTHERS for path in [*paths, *cfg.secret_files]}
    if cfg.path:
        # Anyone who can change a role's configuration can point it anywhere; one that holds a secret is a secret.
        found[cfg.path] = OTHERS if cfg.holds_secret else OTHERS_WRITE
        # Its relative paths are its directory's (keys, secrets' files): a stranger who could put files there
        # could choose them.
        found.setdefault(os.path.dirname(os.path.abspath(cfg.path)), OTHERS_WRITE)
    if role == "mirror":
        # A stranger who can write the mirror's directory swaps the versions nodes fetch and plants its token.
        found[cfg["mirror.dir"]] = OTHERS_WRITE
    return found


def check_roles(cfg: settings.Config, *roles: str) -> None:
    """Refuse (LooseFiles) to start any of ROLES while others can read or change a file one holds secrets in."""
    refuse_loose({path: forbidden for role in roles for path, forbidden in role_files(cfg, role).items()})


def write_private(path: str, text: str) -> None:
    """Write TEXT to PATH, readable by this user only (0600) from the moment it exists; a directory made for it
    is 0700. Written to a new file that then takes PATH's place, so whatever PATH was (a looser file, a link
    another user planted to a file of theirs or of root's) is replaced, never written through: opened and
    truncated in place, a password went into another user's file, and root's own files were overwritten."""
    folder = os.path.dirname(os.path.abspath(path))
    make_private_dir(folder)
    temporary = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.new")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
