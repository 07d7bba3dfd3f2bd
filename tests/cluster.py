"""A controller and agents as real processes, for the control plane's tests."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from llmgw.node.shardfiles import running_engines
from llmgw.procs import free_port, http_status, wait_for
from tests.conftest import ROOT, post, stop_process, write_config

FAST = {"controller.unreachable_after": 1.0, "controller.lost_after": 2.0, "agent.heartbeat_interval": 0.2,
        "agent.reconnect_max": 0.5, "controller.reconcile_interval": 0.3, "controller.base_backoff": 1.0}


class Controller:
    def __init__(self, tmp, store_url=None, agent_port=None, models=(), root=ROOT, **settings):
        """ROOT: the checkout whose controller.py runs (a benchmark's --baseline names another)."""
        self.tmp = tmp
        self.root = root
        for attempt in range(3):
            self._choose_ports(store_url, agent_port, models, settings)
            try:
                self.start()
                return
            except RuntimeError:
                # free_port() hands out a port that is free now; on a busy machine another process may bind
                # it before the controller does. Only then is it worth another try with new ports.
                if attempt == 2 or "Address already in use" not in self.log():
                    raise

    def _choose_ports(self, store_url, agent_port, models, settings):
        tmp = self.tmp
        self.agent_port = agent_port or free_port()
        self.admin_port = free_port()
        self.metrics_port = free_port()
        self.gateway_port = free_port()
        self.values = {"store.url": store_url or f"sqlite:///{tmp}/controller.db",
                       "controller.gateway_listen": f"127.0.0.1:{self.gateway_port}",
                       "controller.agent_listen": f"127.0.0.1:{self.agent_port}",
                       "controller.admin_listen": f"127.0.0.1:{self.admin_port}",
                       "controller.metrics_listen": f"127.0.0.1:{self.metrics_port}",
                       "controller.demand_listen": f"127.0.0.1:{free_port()}",
                       "controller.accountant_listen": f"127.0.0.1:{free_port()}",
                       "controller.keys_dir": f"{tmp}/controller-keys", **FAST,
                       **{k.replace("__", "."): v for k, v in settings.items()}}
        self.config = write_config(tmp / "controller.toml", self.values, models=models)

    def start(self, lead: bool = False):
        """Start it; with LEAD, until it leads. A controller restarted after a kill leads only once its lease has
        gone unrenewed for a while (another controller could be renewing under its address); a standby's admin
        API answers 503 to all but the status."""
        self.log_path = self.tmp / f"controller-{self.admin_port}.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, os.path.join(self.root, "controller.py"), "--config", self.config],
                                         stdout=log, stderr=subprocess.STDOUT)
        # Up once it answers; without the token, 401.
        wait_for("the controller's admin API", 20,
                 lambda: http_status(f"http://127.0.0.1:{self.admin_port}/api/v1/status") == 401,
                 alive=lambda: self.proc.poll() is None)
        if lead:
            wait_for("the controller to lead", 60, lambda: self.api("/api/v1/status")["role"] == "leader",
                     alive=lambda: self.proc.poll() is None)

    def log(self) -> str:
        return self.log_path.read_text()

    def token(self) -> str:
        """The admin API's token, from the file the controller made (what llmgw ctl reads)."""
        with open(os.path.join(self.values["controller.keys_dir"], "admin.token")) as f:
            return f.read().strip()

    def api(self, path):
        req = urllib.request.Request(f"http://127.0.0.1:{self.admin_port}{path}",
                                     headers={"Authorization": f"Bearer {self.token()}"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.loads(resp.read())

    def nodes(self) -> dict:
        return {n["node_id"]: n for n in self.api("/api/v1/nodes")["nodes"]}

    def replicas(self, model=None) -> list[dict]:
        return [r for r in self.api("/api/v1/replicas")["replicas"] if model is None or r["model"] == model]

    def ready(self, model) -> list[dict]:
        return [r for r in self.replicas(model) if r["state"] == "ready"]

    def passes_made(self, count: int, limit: float = 60) -> None:
        """Wait until this controller has made COUNT more reconcile passes: what would have acted has."""
        target = self.api("/api/v1/status")["reconcile_passes"] + count
        wait_for(f"{count} more reconcile passes", limit, lambda: self.api("/api/v1/status")["reconcile_passes"] >= target)

    def state(self, node_id):
        node = self.nodes().get(node_id)
        return node and node["state"]

    def ctl(self, *args):
        return subprocess.run([sys.executable, "-m", "llmgw", "--config", self.config, "ctl", *args],
                              capture_output=True, text=True, timeout=30)

    def issue_key(self, node_id) -> str:
        run = self.ctl("node-key", "issue", node_id)
        assert run.returncode == 0, run.stderr
        return run.stdout

    def gateway_key_file(self, name="gw") -> str:
        """A key file issued to gateway NAME, for `gateway.key_file`."""
        run = self.ctl("gateway-key", "issue", name)
        assert run.returncode == 0, run.stderr
        path = self.tmp / f"gateway-{name}.key"
        path.write_text(run.stdout)
        path.chmod(0o600)
        return str(path)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            return resp.read().decode()

    def stop(self, sig=None):
        return stop_process(self.proc, sig or signal.SIGTERM)


class Mirror:
    """`python mirror.py` on free ports, copying local sources only from LOCAL_SOURCES; SETTINGS as Agent's."""

    def __init__(self, tmp, local_sources: list[str] = (), **settings):
        files, api = free_port(), free_port()
        self.url = f"http://127.0.0.1:{files}"
        self.config = write_config(tmp / "mirror.toml", {
            "mirror.dir": str(tmp / "models"), "mirror.listen": f"127.0.0.1:{files}",
            "mirror.api_listen": f"127.0.0.1:{api}", "mirror.api": f"127.0.0.1:{api}",
            "mirror.metrics_listen": f"127.0.0.1:{free_port()}", "mirror.local_sources": list(local_sources),
            "controller.admin_listen": f"127.0.0.1:{free_port()}",
            **{k.replace("__", "."): v for k, v in settings.items()}})
        self.log_path = tmp / "mirror.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "mirror.py"), "--config", self.config],
                                         stdout=log, stderr=subprocess.STDOUT)
        wait_for("the mirror", 30, lambda: http_status(f"http://127.0.0.1:{api}/api/v1/health") == 200,
                 alive=lambda: self.proc.poll() is None)

    def llmgw(self, *args: str, timeout: float = 300) -> str:
        """What an operator types, `llmgw mirror ARGS...`, against this mirror; what it printed on stdout."""
        run = subprocess.run([sys.executable, "-m", "llmgw", "--config", self.config, "mirror", *args],
                             capture_output=True, text=True, timeout=timeout)
        assert run.returncode == 0, run.stderr
        return run.stdout.strip()

    def publish(self, source: str, model: str, version: str) -> str:
        """`llmgw mirror fetch SOURCE --model MODEL --version VERSION`: the URL a catalog source names."""
        return self.llmgw("fetch", source, "--model", model, "--version", version)

    def stop(self):
        stop_process(self.proc)


class Agent:
    def __init__(self, tmp, controllers: list[str], node_id: str, key_text: str | None, labels=None,
                 nvidia_smi_capture: str | None = None, nvml_capture: str | None = None, plaintext=False,
                 engines=(), env=None, fabrics=(), **settings):
        """ENGINES: its engine catalogue (`[[engines]]`); FABRICS: its `[[fabrics]]`; ENV: variables its
        environment has besides ours."""
        self.node_id = node_id
        folder = tmp / f"agent-{node_id}"
        folder.mkdir(exist_ok=True)
        values = {"agent.controllers": controllers, "agent.weights_dir": str(folder / "weights"),
                  "agent.work_dir": str(folder / "work"), "agent.engines_dir": str(folder / "engines"),
                  "agent.labels": labels or {}, "agent.plaintext": plaintext, **FAST,
                  **{k.replace("__", "."): v for k, v in settings.items()}}
        if key_text is not None:
            (folder / "node.key").write_text(key_text)
            (folder / "node.key").chmod(0o600)
            values["agent.key_file"] = str(folder / "node.key")
        if plaintext or key_text is None:
            values["agent.node_id"] = node_id
        env = {**os.environ, **(env or {})}
        if nvidia_smi_capture:
            values["agent.nvidia_smi"] = os.path.join(ROOT, "tests", "fake-nvidia-smi")
            env["LLMGW_FAKE_SMI"] = os.path.join(ROOT, "tests", "fixtures", nvidia_smi_capture)
        else:
            # Empty: ask NVML, then nvidia-smi on the PATH (neither answers here, unless replayed).
            values["agent.nvidia_smi"] = ""
        if nvml_capture:
            env["LLMGW_FAKE_NVML"] = os.path.join(ROOT, "tests", "fixtures", nvml_capture)
            env["PYTHONPATH"] = os.path.join(ROOT, "tests", "fakenvml")
        self.config = write_config(folder / "agent.toml", values, engines=engines, fabrics=fabrics)
        self.env = env
        self.folder = folder
        self.log_path = folder / "agent.log"
        self.start()

    def start(self):
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "agent.py"), "--config", self.config],
                                         stdout=log, stderr=subprocess.STDOUT, env=self.env)

    def log(self) -> str:
        return self.log_path.read_text()

    def engines(self) -> dict[str, int]:
        return running_engines(str(self.folder / "work"))

    def pause(self):
        """Freeze the agent (SIGSTOP): silent to the controller, while its engines go on answering."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self):
        self.proc.send_signal(signal.SIGCONT)

    def stop(self, sig=None, engines=True):
        """Stop the agent; its engines outlive it unless ENGINES (what a test's clean-up wants)."""
        if self.proc.poll() is None:
            self.resume()  # a frozen agent would not hear the SIGTERM
        code = stop_process(self.proc, sig or signal.SIGTERM)
        if engines:
            for pid in self.engines().values():
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
        return code


class Traffic:
    """A client sending one chat request after another through a gateway, keeping every failure.

    Its timeout is longer than a gateway's `load_wait`: a request that waits for a replica is
    a slow answer, and only an error answer (or none) is a failure.
    """

    def __init__(self, url: str, key: str, models=("simmy",), stream: bool = False):
        """STREAM: ask for streams, and count one that does not end with `[DONE]` as failed."""
        self.url, self.key, self.models, self.stream = url + "/v1/chat/completions", key, models, stream
        self.sent = 0
        self.failures: list = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="traffic", daemon=True)
        self.thread.start()

    def _run(self):
        while not self.done.is_set():
            for model in self.models:
                body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                        **({"stream": True} if self.stream else {})}
                try:
                    status, _, raw = post(self.url, body, self.key, timeout=150)
                except (OSError, http.client.HTTPException) as e:  # a worker killed mid-answer: a failure, not the end
                    status, raw = None, str(e).encode()
                self.sent += 1
                if status != 200 or (self.stream and not raw.rstrip().endswith(b"data: [DONE]")):
                    self.failures.append((model, status, raw[:300]))
            time.sleep(0.02)

    def more(self, count: int, limit: float = 60) -> None:
        """Wait until COUNT more requests have been answered."""
        target = self.sent + count
        wait_for(f"{count} more requests through the gateway", limit, lambda: self.sent >= target)

    def stop(self) -> list:
        """Stop sending; the failures seen."""
        self.done.set()
        self.thread.join(timeout=200)
        return self.failures


class Clients:
    """N clients through a gateway, each sending BODY as a chat as soon as its last was answered, keeping
    (sent at, seconds, status) of every request; a client that got no answer records status None."""

    def __init__(self, url: str, key: str, body: dict, n: int):
        self.url, self.key, self.body = url + "/v1/chat/completions", key, body
        self.results: list[tuple[float, float, int | None]] = []
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]
        for thread in self.threads:
            thread.start()

    def _run(self):
        while not self.done.is_set():
            sent = time.monotonic()
            try:
                status = post(self.url, self.body, self.key, timeout=200)[0]
            except (OSError, http.client.HTTPException):
                status = None
            self.results.append((sent, time.monotonic() - sent, status))

    def answered(self) -> int:
        return sum(1 for r in self.results if r[2] == 200)

    def failures(self) -> list:
        return [r for r in self.results if r[2] != 200]

    def since(self, t: float) -> list[tuple[float, float, int | None]]:
        return [r for r in self.results if r[0] >= t]

    def stop(self):
        self.done.set()
        for thread in self.threads:
            thread.join(timeout=250)


def wait_for_no_duplicates(controller: Controller, agents: list[Agent], want: dict[str, int], limit: float = 60):
    """Wait until each model of WANT has exactly that many replicas, all ready, and the agents run
    exactly that many engines in all: nothing runs twice, and nothing extra is left running."""
    def settled():
        rows = controller.replicas()
        counts = {m: sum(1 for r in rows if r["model"] == m and r["state"] == "ready") for m in want}
        return counts == want and len(rows) == sum(want.values()) and \
            sum(len(a.engines()) for a in agents) == sum(want.values())

    wait_for(f"exactly {want} replicas, one engine each", limit, settled, interval=0.2)
