"""The mirror's directory: model / version / files, their checksums, and manifests.

A version is the pin: catalog entries name a version, and a version that
exists is never overwritten, which is what makes going back to an older one
safe. Downloads are assembled under `.arriving/model/version/` and the whole
version directory is renamed into place when every file is complete, so a
reader never sees half a version. Each version keeps the sha256 of its files
in `.sha256.json` beside them; files copied in by hand count too (their sum
is computed the first time it is asked for).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading

from llmgw.weights import sha256_of

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")
SUMS = ".sha256.json"
ARRIVING = ".arriving"


class MirrorError(Exception):
    """A request the mirror refuses; the message says why, `status` is the management API's answer."""

    status = 400


class Conflict(MirrorError):
    """A request that clashes with what the mirror holds or is doing: a version that exists, one that arrives."""

    status = 409


def check_name(what: str, value: str) -> str:
    if not NAME.match(value or "") or ".." in value:
        raise MirrorError(f"{what} {value!r} must be letters, digits, '.', '_', '+' or '-' (at most 128), "
                          "starting with a letter or digit")
    return value


class MirrorDir:
    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.sums_lock = threading.Lock()

    def version_dir(self, model: str, version: str) -> str:
        return os.path.join(self.root, check_name("a model name", model), check_name("a version", version))

    def arriving_dir(self, model: str, version: str) -> str:
        return os.path.join(self.root, ARRIVING, check_name("a model name", model), check_name("a version", version))

    def file_path(self, model: str, version: str, name: str) -> str:
        return os.path.join(self.version_dir(model, version), check_name("a file name", name))

    def exists(self, model: str, version: str) -> bool:
        return os.path.isdir(self.version_dir(model, version))

    def readable(self) -> bool:
        return os.path.isdir(self.root) and os.access(self.root, os.R_OK | os.X_OK)

    def files(self, model: str, version: str) -> list[dict]:
        """The files of a present version: name, size, sha256."""
        folder = self.version_dir(model, version)
        sums = self._sums(folder)
        out = []
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if name.startswith(".") or not os.path.isfile(path):
                continue
            out.append({"name": name, "size": os.path.getsize(path), "sha256": sums.get(name)})
        return out

    def sha256(self, model: str, version: str, name: str) -> str | None:
        """A file's sha256, computed and kept the first time for a file put here by hand."""
        folder = self.version_dir(model, version)
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return None
        with self.sums_lock:
            sums = self._sums(folder)
            if name not in sums:
                sums[name] = sha256_of(path)
                try:
                    self._write_sums(folder, sums)
                except OSError:
                    pass  # a read-only directory still serves; the sum is computed again next time
            return sums[name]

    def versions(self) -> list[dict]:
        """Every present version, with its files."""
        out = []
        if not os.path.isdir(self.root):
            return out
        for model in sorted(os.listdir(self.root)):
            if model.startswith(".") or not NAME.match(model) or not os.path.isdir(os.path.join(self.root, model)):
                continue
            for version in sorted(os.listdir(os.path.join(self.root, model))):
                if NAME.match(version) and os.path.isdir(os.path.join(self.root, model, version)):
                    files = self.files(model, version)
                    out.append({"model": model, "version": version, "files": files,
                                "bytes": sum(f["size"] for f in files)})
        return out

    def manifest(self, model: str, version: str, base_url: str) -> dict:
        files = self.files(model, version)
        for f in files:
            f["url"] = f"{base_url}/{model}/{version}/{f['name']}"
        return {"model": model, "version": version, "files": files}

    def publish(self, model: str, version: str, sums: dict[str, str]) -> None:
        """Move a complete arriving version into place (one rename), with its checksums."""
        source = self.arriving_dir(model, version)
        self._write_sums(source, sums)
        target = self.version_dir(model, version)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.exists(target):
            raise Conflict(f"{model}/{version} already exists; a version is never overwritten")
        os.rename(source, target)

    def remove(self, model: str, version: str) -> None:
        shutil.rmtree(self.version_dir(model, version))
        parent = os.path.join(self.root, model)
        if os.path.isdir(parent) and not os.listdir(parent):
            os.rmdir(parent)

    @staticmethod
    def _sums(folder: str) -> dict[str, str]:
        try:
            with open(os.path.join(folder, SUMS)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    @staticmethod
    def _write_sums(folder: str, sums: dict[str, str]) -> None:
        tmp = os.path.join(folder, SUMS + ".tmp")
        with open(tmp, "w") as f:
            json.dump(sums, f, indent=1, sort_keys=True)
        os.replace(tmp, os.path.join(folder, SUMS))
