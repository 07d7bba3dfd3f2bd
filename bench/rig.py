"""The benchmarks' processes: a simulated engine on CPU 1, a gateway with one worker on CPU 0 in front of it.

Shared by bench/gateway.py, bench/limits.py, bench/dialects.py and bench/profile.py. The gateway runs as in
service (authentication, usage rows written to SQLite in batches, metrics); its store holds a key nothing
limits and one limited at four levels (key, project, team, organisation), both made before the gateway
starts, so its worker reads them at once. With no controller, the limited key's accountant is the gateway
master's own, pinned to CPU 0 with the worker, and its CPU counts as the gateway's. The load generator
(bench/loadgen.py) runs on CPU 1 with the engine, so what CPU 0 spends is the gateway's alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.procstat import children, cpu_seconds  # noqa: E402
from llmgw import settings, store  # noqa: E402
from llmgw.people import keys, limits, orgtree  # noqa: E402
from llmgw.procs import free_port, http_status, wait_for  # noqa: E402

SUBJECT_CPU, LOAD_CPU = "0", "1"
# Far from binding, so every check runs at every level and none refuses.
FOUR_LEVELS = dict(rpm=10_000_000, tpm=2_000_000_000, budget=10 ** 15)


def limited_key(url: str) -> str:
    """A key of project Acme/ml/bench, limited at its own level and its project's, team's and organisation's,
    in the store at URL, with a price for the model so that the budgets are checked too; returns its secret."""
    engine = store.open_engine(url)
    try:
        orgtree.add(engine, "org", "Acme")
        orgtree.add(engine, "team", "ml", "Acme")
        project = orgtree.add(engine, "project", "bench", "Acme/ml")
        tree = orgtree.Tree.load(engine)
        key, secret = keys.create_key(engine, "limited", project.id)
        for scope, scope_id in (("key", key.id), ("project", project.id), ("team", tree.find("team", "Acme/ml").id),
                                ("org", tree.find("org", "Acme").id)):
            limits.set_limits(engine, scope, scope_id, "bench", **FOUR_LEVELS)
        limits.set_price(engine, "sim", "0.1", "0.2", "bench")
        return secret
    finally:
        engine.dispose()


class Procs:
    """Processes started for a benchmark, their logs in one folder, stopped together."""

    def __init__(self, tmp: str):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def start(self, argv, log, env=None) -> subprocess.Popen:
        with open(os.path.join(self.tmp, log), "wb") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
        self.procs.append(proc)
        return proc

    def stop(self):
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

    def sim(self, name: str, model: str, args: list) -> str:
        """A simulated engine serving MODEL on the load's CPU, started with ARGS; its URL once it answers."""
        port = free_port()
        proc = self.start(["taskset", "-c", LOAD_CPU, sys.executable, "-m", "llmgw", "sim", "--listen",
                           f"127.0.0.1:{port}", "--model", model, "--no-prefix-cache", *args], f"{name}-{model}.log")
        url = f"http://127.0.0.1:{port}"
        wait_for("the simulated engine", 30, lambda: http_status(url + "/health") == 200,
                 alive=lambda: proc.poll() is None)
        return url


def tree_cpu(pid: int) -> float:
    """CPU seconds PID and its children have spent (their threads', including those that ended)."""
    return cpu_seconds(pid) + sum(cpu_seconds(p) for p in children(pid))


def load(url: str, key: str = "", background=False, **options) -> dict | subprocess.Popen:
    """Run bench/loadgen.py on the load's CPU with OPTIONS as its flags; its JSON, or the process."""
    argv = ["taskset", "-c", LOAD_CPU, sys.executable, os.path.join(ROOT, "bench", "loadgen.py"), "--url", url]
    if key:
        argv += ["--key", key]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is not False:
            argv += [flag] if value is True else [flag, str(value)]
    if background:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    run = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    try:
        return json.loads(run.stdout)
    except ValueError:
        raise RuntimeError(f"the load generator failed: {run.stderr.strip()[-2000:]}") from None


class Rig(Procs):
    def __init__(self, tmp: str, tokens_per_s: float = 0.0, ttft_ms: float = 0.0, name: str = "sim",
                 gateway_settings: dict | None = None, sim_args: tuple = (), warm_model: bool = False,
                 gateway_command: tuple = (), engines: dict[str, str] | None = None, store_url: str = "",
                 start_limit: float = 60):
        """GATEWAY_SETTINGS: dotted settings for the gateway's configuration file, beside the rig's own;
        SIM_ARGS: more flags for the engine. ENGINES: model name to the URL of an engine already running, in
        place of the simulated one (the first is `engine_url`). WARM_MODEL: a second engine, answering at once, as model
        `warm`, for warming the gateway when the first engine must not see those requests.
        GATEWAY_COMMAND: what runs the gateway, given its options (`python gateway.py`). STORE_URL: a store
        already made (bench/keys.py's, full of keys) to add the two keys to, in place of a new one; START_LIMIT:
        the seconds the gateway may take to answer."""
        super().__init__(tmp)
        try:
            self._start(name, tokens_per_s, ttft_ms, gateway_settings or {}, list(sim_args), warm_model,
                        list(gateway_command) or [sys.executable, os.path.join(ROOT, "gateway.py")], engines,
                        store_url or f"sqlite:///{tmp}/{name}.db", start_limit)
        except BaseException:
            self.stop()  # nothing it started may outlive a rig that failed to start
            raise

    def _start(self, name: str, tokens_per_s: float, ttft_ms: float, gateway_settings: dict, sim_args: list,
               warm_model: bool, gateway_command: list, engines: dict[str, str] | None, url: str,
               start_limit: float) -> None:
        tmp = self.tmp
        engines = engines or {"sim": self.sim(name, "sim", ["--ttft-ms", str(ttft_ms), "--tokens-per-s",
                                                            str(tokens_per_s), *sim_args])}
        self.engine_url = next(iter(engines.values()))
        endpoints = [arg for model, url in engines.items() for arg in ("--endpoint", f"{model}={url}={model}")]
        if warm_model:
            endpoints += ["--endpoint", f"warm={self.sim(name, 'warm', ['--ttft-ms', '0', '--tokens-per-s', '0'])}=warm"]
        engine = store.open_store(url)
        self.key = keys.create_key(engine, "bench")[1]
        engine.dispose()
        self.limited_key = limited_key(url)
        self.port = free_port()
        values = {"gateway.listen": f"127.0.0.1:{self.port}", "gateway.workers": 1,
                  "gateway.metrics_listen": f"127.0.0.1:{free_port()}", "store.url": url,
                  "usage.spool_dir": os.path.join(tmp, f"{name}-spool"), **gateway_settings}
        config = os.path.join(tmp, f"{name}-gateway.toml")
        with open(config, "w") as f:
            f.write(settings.to_toml(values, [], [], []))
        self.gateway = self.start(["taskset", "-c", SUBJECT_CPU, *gateway_command, "--config", config, *endpoints],
                                  f"{name}-gateway.log")
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            wait_for("the gateway", start_limit, lambda: http_status(self.url + "/ready") == 200,
                     alive=lambda: self.gateway.poll() is None)
        except (RuntimeError, TimeoutError) as e:
            with open(os.path.join(tmp, f"{name}-gateway.log"), errors="replace") as f:
                said = f.read()[-2000:]
            raise RuntimeError(f"{e}; its log ends:\n{said}") from None
        wait_for("its worker", 20, lambda: children(self.gateway.pid))
        self.worker = children(self.gateway.pid)[0]

    def gateway_cpu(self) -> float:
        return tree_cpu(self.gateway.pid)

    def load(self, url: str, key: str = "", background=False, **options) -> dict | subprocess.Popen:
        return load(url, key, background, **options)
