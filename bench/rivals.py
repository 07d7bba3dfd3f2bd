"""Other gateways, measured beside llmgw's in the same run: vllm-router (Rust) and LiteLLM's proxy.

Each is installed, pinned, into a virtual environment of its own under the benchmarks' cache
(`$XDG_CACHE_HOME/llmgw-bench`, else `~/.cache/llmgw-bench`; `$LLMGW_BENCH_CACHE` to put it elsewhere),
outside any checkout, so that every worktree and CI run reuses one install: vllm-router takes about 40 s
to install here, LiteLLM about three minutes. Each rival is started as the gateway is, pinned to CPU 0,
in front of the same simulated engine, with its metrics on and its logging at warnings, as llmgw's
gateway writes no access log.

What each does a request, against llmgw's gateway with authentication, usage rows and metrics:
vllm-router authenticates nobody, limits nothing and writes no usage (it has Prometheus metrics and a
token bucket that is not reached here); LiteLLM checks a master key (it refuses to start without one)
and has no database, so no limits or usage rows either.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
import urllib.request

from bench.rig import SUBJECT_CPU, Procs, tree_cpu
from llmgw.procs import free_port, http_status, wait_for

INSTALL_LIMIT = 900  # seconds for pip to install one tool (LiteLLM pulls about 190 packages)


class Unavailable(Exception):
    """A rival that could not be installed or started here: the reason, for the report."""


class Tool:
    def __init__(self, name: str, spec: str, command: str):
        self.name, self.spec, self.command = name, spec, command

    @property
    def home(self) -> str:
        cache = os.environ.get("LLMGW_BENCH_CACHE") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llmgw-bench")
        version = f"py{sys.version_info.major}{sys.version_info.minor}"
        return os.path.join(cache, f"{self.spec.replace('[', '-').replace(']', '').replace('==', '-')}-{version}")

    @property
    def executable(self) -> str:
        return os.path.join(self.home, "bin", self.command)

    def installed(self) -> bool:
        return os.path.exists(os.path.join(self.home, ".installed"))

    def install(self) -> str:
        """The tool's executable, installing it first when its environment is missing; raises Unavailable.

        The stamp is written last, so an install that was interrupted is started again from nothing; a lock
        keeps two benchmarks starting at once from installing into one folder."""
        os.makedirs(os.path.dirname(self.home), exist_ok=True)
        with open(self.home + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not self.installed():
                self._install()
        return self.executable

    def _install(self) -> None:
        subprocess.run(["rm", "-rf", self.home], check=True)
        started = time.monotonic()
        try:
            subprocess.run([sys.executable, "-m", "venv", self.home], check=True, capture_output=True, text=True)
            pip = subprocess.run([os.path.join(self.home, "bin", "pip"), "install", "--quiet",
                                  "--disable-pip-version-check", self.spec],
                                 capture_output=True, text=True, timeout=INSTALL_LIMIT)
        except subprocess.TimeoutExpired:
            raise Unavailable(f"pip install {self.spec} took more than {INSTALL_LIMIT} s") from None
        except subprocess.CalledProcessError as e:
            raise Unavailable(f"cannot make a virtual environment for {self.name}: {e.stderr.strip()}") from None
        if pip.returncode != 0:
            said = [line for line in pip.stderr.splitlines() if "is ignored" not in line][-3:]
            raise Unavailable(f"pip install {self.spec} failed: {' '.join(said) or pip.returncode}")
        freeze = subprocess.run([os.path.join(self.home, "bin", "pip"), "freeze"], capture_output=True, text=True)
        with open(os.path.join(self.home, ".installed"), "w") as f:
            f.write(f"# installed in {time.monotonic() - started:.0f} s\n{freeze.stdout}")


VLLM_ROUTER = Tool("vllm-router", "vllm-router==0.1.17", "vllm-router")
LITELLM = Tool("LiteLLM", "litellm[proxy]==1.108.7", "litellm")


class Rival:
    """A rival gateway running on CPU 0 in front of ENGINE_URL: its URL, the key it wants, its CPU."""

    name = ""
    key = ""

    def __init__(self, procs: Procs, engine_url: str):
        self.procs = procs
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = self.launch(engine_url)

    def launch(self, engine_url: str) -> subprocess.Popen:
        raise NotImplementedError

    def cpu(self) -> float:
        return tree_cpu(self.proc.pid)

    def answers(self) -> bool:
        """One chat request answered: the rival is up and reaches the engine."""
        body = b'{"model": "sim", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}'
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.key}"} if self.key else {})}
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + "/v1/chat/completions", body, headers),
                                        timeout=30) as resp:
                return resp.status == 200
        except OSError:
            return False

    def wait(self, limit: float) -> None:
        try:
            wait_for(f"{self.name} to start", limit, lambda: http_status(self.url + self.health) == 200,
                     alive=lambda: self.proc.poll() is None, interval=0.25)
        except (TimeoutError, RuntimeError) as e:
            raise Unavailable(f"{self.name} did not start ({e}); its log: {self.log}") from None
        if not self.answers():
            raise Unavailable(f"{self.name} started but did not answer a chat request; its log: {self.log}")


class VllmRouter(Rival):
    name = "vllm-router"
    health = "/health"

    def launch(self, engine_url: str) -> subprocess.Popen:
        name = f"vllm-router-{self.port}.log"  # a bench may run more than one
        self.log = os.path.join(self.procs.tmp, name)
        return self.procs.start(["taskset", "-c", SUBJECT_CPU, VLLM_ROUTER.install(), "--host", "127.0.0.1",
                                 "--port", str(self.port), "--worker-urls", engine_url, "--policy", "round_robin",
                                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                                 "--log-level", "warning"], name)


class LiteLLM(Rival):
    name = "LiteLLM"
    health = "/health/liveliness"
    key = "sk-bench-" + os.urandom(16).hex()

    def launch(self, engine_url: str) -> subprocess.Popen:
        self.log = os.path.join(self.procs.tmp, "litellm.log")
        config = os.path.join(self.procs.tmp, "litellm.yaml")
        with open(config, "w") as f:
            f.write("model_list:\n  - model_name: sim\n    litellm_params:\n      model: openai/sim\n"
                    f"      api_base: {engine_url}/v1\n      api_key: none\n")
        # Its cost map from the package, not the network; the master key is what it authenticates with.
        env = {**os.environ, "LITELLM_MASTER_KEY": self.key, "LITELLM_LOCAL_MODEL_COST_MAP": "True",
               "LITELLM_LOG": "WARNING"}
        return self.procs.start(["taskset", "-c", SUBJECT_CPU, LITELLM.install(), "--config", config, "--host",
                                 "127.0.0.1", "--port", str(self.port), "--num_workers", "1"], "litellm.log", env=env)


def start(kind: type[Rival], procs: Procs, engine_url: str, limit: float = 180) -> Rival:
    """KIND started and answering; raises Unavailable, with what went wrong, when it cannot be."""
    rival = kind(procs, engine_url)
    rival.wait(limit)
    return rival
