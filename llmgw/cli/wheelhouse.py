"""A wheelhouse of this installation: llmgw's own wheel and one for every distribution it needs,
repacked from what is installed here, so a node installs exactly these versions with `pip --no-index`.

Repacked rather than downloaded: a node, and often the machine running `llmgw node add`, has no
package index to reach, and pip cannot make a wheel of an installed distribution. An installed
distribution is a wheel unpacked (its files, its `.dist-info` with `WHEEL` and its tags), so zipping
those files back with a fresh RECORD gives the wheel it came from, less its console scripts, which pip
writes again from `entry_points.txt`. llmgw itself is packed from the package this process runs (an
editable install lists no files of its own), with the metadata of its installed distribution.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import os
import re
import sys
import zipfile

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import llmgw

# Written again by pip at install time, or meaningless on another machine.
_SKIPPED_META = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}


class WheelhouseError(Exception):
    """This installation cannot be packed; the message says why and what to do."""


def needed(extras: tuple[str, ...]) -> list[md.Distribution]:
    """The installed distributions llmgw (with EXTRAS) needs here, itself excluded, each once."""
    found: dict[str, md.Distribution] = {}
    pending = [(req, extras) for req in md.requires("llmgw") or []]
    base_env = default_environment()
    while pending:
        text, wanted = pending.pop()
        req = Requirement(text)
        if req.marker and not any(req.marker.evaluate({**base_env, "extra": e}) for e in ("", *wanted)):
            continue
        key = canonicalize_name(req.name)
        if key in found:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            raise WheelhouseError(f"{req.name}, which llmgw needs, is not installed here; install llmgw's "
                                  "dependencies on this machine first (pip install -e .)") from None
        found[key] = dist
        pending += [(r, tuple(req.extras)) for r in dist.requires or []]
    return sorted(found.values(), key=lambda d: canonicalize_name(d.metadata["Name"]))


def _tag(dist: md.Distribution) -> str:
    wheel = dist.read_text("WHEEL")
    tags = re.findall(r"^Tag: (\S+)$", wheel or "", re.M)
    if not tags:
        raise WheelhouseError(f"{dist.metadata['Name']} {dist.version} was not installed from a wheel, so it cannot "
                              f"be repacked; reinstall it here with pip (pip install --force-reinstall "
                              f"{dist.metadata['Name']}=={dist.version})")
    # A wheel's name carries its tags compressed: py2.py3-none-any, cp311-cp311-manylinux_2_28_x86_64.
    parts = [t.split("-") for t in tags]
    return "-".join(".".join(dict.fromkeys(p[i] for p in parts)) for i in range(3))


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _write_wheel(path: str, files: list[tuple[str, bytes]], dist_info: str) -> None:
    record = [_record_line(name, data) for name, data in files] + [f"{dist_info}/RECORD,,"]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for name, data in files:
            z.writestr(name, data)
        z.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")


def _file_name(name: str, version: str, tag: str) -> str:
    return f"{re.sub(r'[^A-Za-z0-9.]+', '_', name)}-{version}-{tag}.whl"


def repack(dist: md.Distribution, dest: str) -> str:
    """A wheel of the installed DIST in DEST; its path."""
    name, tag = dist.metadata["Name"], _tag(dist)
    files, dist_info = [], None
    for entry in dist.files or []:
        parts = entry.parts
        # Scripts and data installed outside site-packages (bin/, share/) are written again by pip, or unused.
        if parts[0] == ".." or "__pycache__" in parts or entry.suffix == ".pyc":
            continue
        if parts[0].endswith(".dist-info"):
            dist_info = parts[0]
            if len(parts) == 2 and parts[1] in _SKIPPED_META:
                continue
        with open(dist.locate_file(entry), "rb") as f:
            files.append((entry.as_posix(), f.read()))
    if dist_info is None:
        raise WheelhouseError(f"{name} {dist.version} has no .dist-info here, so it cannot be repacked; reinstall it "
                              f"with pip (pip install --force-reinstall {name}=={dist.version})")
    path = os.path.join(dest, _file_name(name, dist.version, tag))
    _write_wheel(path, files, dist_info)
    return path


def pack_llmgw(dest: str) -> str:
    """A wheel of the llmgw package this process runs, with its installed distribution's metadata."""
    dist = md.distribution("llmgw")
    if dist.version != llmgw.__version__:
        raise WheelhouseError(f"the llmgw package here is {llmgw.__version__} but its installed metadata says "
                              f"{dist.version}; reinstall it (pip install -e .) so the node gets what runs here")
    package = os.path.dirname(os.path.abspath(llmgw.__file__))
    base = os.path.dirname(package)
    files = []
    for folder, dirs, names in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for n in sorted(names):
            if not n.endswith(".pyc"):
                full = os.path.join(folder, n)
                with open(full, "rb") as f:
                    files.append((os.path.relpath(full, base).replace(os.sep, "/"), f.read()))
    dist_info = f"llmgw-{dist.version}.dist-info"
    entry_points = dist.read_text("entry_points.txt") or ""
    files += [(f"{dist_info}/METADATA", (dist.read_text("METADATA") or dist.read_text("PKG-INFO")).encode()),
              (f"{dist_info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: llmgw node add\nRoot-Is-Purelib: true\n"
                                     b"Tag: py3-none-any\n"),
              (f"{dist_info}/entry_points.txt", entry_points.encode()),
              (f"{dist_info}/top_level.txt", b"llmgw\n")]
    path = os.path.join(dest, _file_name("llmgw", dist.version, "py3-none-any"))
    _write_wheel(path, files, dist_info)
    return path


def build(dest: str, extras: tuple[str, ...] = ()) -> list[str]:
    """Every wheel a node needs to install llmgw with EXTRAS and nothing from an index, in DEST."""
    os.makedirs(dest, exist_ok=True)
    return [pack_llmgw(dest)] + [repack(d, dest) for d in needed(extras)]


def installed_extras() -> tuple[str, ...]:
    """llmgw's extras whose distributions are all installed here (`engine` where xllamacpp is)."""
    out = []
    for extra in md.metadata("llmgw").get_all("Provides-Extra") or []:
        if extra == "test":
            continue
        try:
            needed((extra,))
        except WheelhouseError:
            continue
        out.append(extra)
    return tuple(out)


def python_tag() -> str:
    """This Python's version, as a node's must match for the compiled wheels here (3.11)."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"
