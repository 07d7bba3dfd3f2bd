"""`llmgw init` and `llmgw mirror init` under --root: plan, make, serve the starter model for real, rerun."""

import os
import re
import signal
import subprocess
import sys

import sqlalchemy as sa

from llmgw.node.shardfiles import running_engines
from llmgw.procs import free_port, http_status
from tests.conftest import assert_units_valid, post, wait_until, write_config
from tests.test_up import signs_in

LLMGW = [sys.executable, "-m", "llmgw"]
PORTS = ("gateway.metrics_listen", "controller.agent_listen", "controller.admin_listen", "controller.metrics_listen",
         "controller.gateway_listen", "controller.demand_listen", "controller.accountant_listen", "mirror.listen",
         "mirror.api_listen", "mirror.metrics_listen")


def base_config(tmp_path, gateway_port):
    """The --config init starts from: free loopback ports, so several tests and helpers can run at once."""
    return write_config(tmp_path / "base.toml", {"gateway.listen": f"127.0.0.1:{gateway_port}", "gateway.workers": 1,
                                                 **{name: f"127.0.0.1:{free_port()}" for name in PORTS}})


def init(*args, config=None):
    ran = subprocess.run([*LLMGW, *(["--config", config] if config else []), "init", *args],
                         capture_output=True, text=True, timeout=180)
    assert ran.returncode == 0, ran.stderr
    return ran


def config_of(root) -> str:
    return str(root / "etc" / "llmgw" / "llmgw.toml")


def role_pid(role: str, config: str) -> int:
    """The process id of ROLE running with CONFIG (`python ROLE.py --config CONFIG`), from /proc."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(arg.endswith(f"/{role}.py".encode()) for arg in argv) and config.encode() in argv:
            return int(pid)
    raise AssertionError(f"no {role} runs with {config}")


def mode(path) -> str:
    return oct(os.stat(path).st_mode & 0o777)


def test_plan_does_nothing_then_init_serves_the_starter_model_and_a_rerun_keeps_everything(tmp_path):
    root = tmp_path / "root"
    port = free_port()
    config = base_config(tmp_path, port)
    plan = init("--root", str(root), "--plan", config=config)
    assert not root.exists()
    assert "would make store" in plan.stderr and "would make administrator admin@localhost" in plan.stderr
    assert "would write default limits and a price" in plan.stderr
    assert "would write unit" in plan.stderr and "done " not in plan.stderr

    out = open(tmp_path / "init.out", "w")
    err = open(tmp_path / "init.err", "w")
    proc = subprocess.Popen([*LLMGW, "--config", config, "init", "--root", str(root), "--node-name", "cp1"],
                            stdout=out, stderr=err)
    out.close()
    err.close()
    try:
        def up():
            assert proc.poll() is None, (tmp_path / "init.err").read_text()
            return "Ctrl-C stops" in (tmp_path / "init.out").read_text()

        wait_until("llmgw init to bring the starter model up", 240, up, interval=0.2)
        said, told = (tmp_path / "init.err").read_text(), (tmp_path / "init.out").read_text()
        assert "done  store" in said and "done  administrator admin@localhost" in said
        assert "done  default limits and a price (60 requests and 200,000 tokens a minute" in said
        assert "Paris" in said  # init asked the model itself through the gateway
        password_file = root / "var" / "lib" / "llmgw" / "admin-password"
        password = password_file.read_text().strip()
        assert password not in told + said and str(password_file) in told
        key = re.search(r"key: (sk-llmgw-\S+)", told).group(1)
        assert "node add" in told
        # The test asks too, as a client would, and signs in as the first administrator.
        status, _, body = post(f"http://127.0.0.1:{port}/v1/chat/completions",
                               {"model": "smollm2-135m-instruct", "max_tokens": 8,
                                "messages": [{"role": "user", "content": "Say hi"}]}, key)
        assert status == 200, body
        assert signs_in(f"http://127.0.0.1:{port}", "admin@localhost", password)
        etc, state = root / "etc" / "llmgw", root / "var" / "lib" / "llmgw"
        for secret in (etc / "llmgw.toml", etc / "keys" / "controller.key", etc / "keys" / "admin.token",
                       etc / "session.key", etc / "node.key", etc / "gateway.key", state / "llmgw.db",
                       state / "starter-key"):
            assert mode(secret) == "0o600", secret
        for folder in (etc, etc / "keys", state, root / "srv" / "models", root / "var" / "lib" / "llmgw-agent"):
            assert mode(folder) == "0o700", folder
        units = root / "etc" / "systemd" / "system"
        assert sorted(os.listdir(units)) == [f"llmgw-{r}.service" for r in ("agent", "controller", "gateway", "mirror")]
        assert f"LLMGW_CONFIG={etc / 'llmgw.toml'}" in (units / "llmgw-gateway.service").read_text()
        assert_units_valid(sorted(units.iterdir()))
        engines = running_engines(str(root / "var" / "lib" / "llmgw-agent"))
        assert len(engines) == 1
        # Nothing else supervises the roles here (no systemd): one that dies is started again, and the engine
        # keeps running under the agent started again, which adopts it.
        for role in ("controller", "agent"):
            os.kill(role_pid(role, config_of(root)), signal.SIGKILL)
        wait_until("the roles started again", 60, lambda: "the agent stopped (exit -9); starting it again" in
                   (tmp_path / "init.err").read_text() and "the controller stopped" in (tmp_path / "init.err").read_text())
        wait_until("the model to answer again", 120, lambda: post(
            f"http://127.0.0.1:{port}/v1/chat/completions", {"model": "smollm2-135m-instruct", "max_tokens": 2,
                                                             "messages": [{"role": "user", "content": "Hi"}]},
            key)[0] == 200, interval=2)  # within init's default of 60 requests a minute
        assert running_engines(str(root / "var" / "lib" / "llmgw-agent")) == engines and proc.poll() is None
    finally:
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        assert proc.wait(timeout=90) == 0, (tmp_path / "init.err").read_text()
    assert http_status(f"http://127.0.0.1:{port}/health", timeout=1) is None
    wait_until("the engine to stop", 30, lambda: running_engines(str(root / "var" / "lib" / "llmgw-agent")) == {})

    again = init("--root", str(root), "--node-name", "cp1", "--no-start", config=config)
    lines = again.stderr.splitlines()
    assert [line for line in lines if not line.startswith(("kept ", "skip "))] == [], again.stderr
    assert "kept  store" in again.stderr and "kept  node key for cp1" in again.stderr
    assert "kept  the cluster's default limits and prices" in again.stderr
    assert "password" not in again.stdout
    plan = init("--root", str(root), "--node-name", "cp1", "--plan", config=config)
    assert "would run the roles" in plan.stderr and "would make" not in plan.stderr


def test_no_node_and_no_model(tmp_path):
    root = tmp_path / "root"
    init("--root", str(root), "--no-node", "--no-model", "--no-start", config=base_config(tmp_path, free_port()))
    text = (root / "etc" / "llmgw" / "llmgw.toml").read_text()
    assert "[agent]" not in text and "[[models]]" not in text
    assert not (root / "etc" / "llmgw" / "node.key").exists()
    assert not (root / "srv" / "models" / "smollm2-135m-instruct").exists()
    assert "llmgw-agent.service" not in os.listdir(root / "etc" / "systemd" / "system")


def test_postgres_takes_the_sqlite_stores_rows(tmp_path, empty_pg):
    pg_move_url = empty_pg()
    root = tmp_path / "root"
    config = base_config(tmp_path, free_port())
    init("--root", str(root), "--no-model", "--no-start", config=config)
    toml = str(root / "etc" / "llmgw" / "llmgw.toml")
    made = subprocess.run([*LLMGW, "--config", toml, "keys", "create", "moved-key"], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr

    moved = init("--root", str(root), "--no-model", "--no-start", "--postgres", pg_move_url, config=config)
    assert "done  store moved" in moved.stderr, moved.stderr
    db = root / "var" / "lib" / "llmgw" / "llmgw.db"
    assert not db.exists() and (root / "var" / "lib" / "llmgw" / "llmgw.db.moved-to-postgresql").exists()
    assert "postgresql" in (root / "etc" / "llmgw" / "llmgw.toml").read_text()
    listed = subprocess.run([*LLMGW, "--config", toml, "keys", "list"], capture_output=True, text=True)
    assert "moved-key" in listed.stdout and "starter" in listed.stdout, listed.stderr
    engine = sa.create_engine(pg_move_url.replace("postgresql://", "postgresql+psycopg2://", 1))
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM users")).scalar() == 1
        assert conn.execute(sa.text("SELECT count(*) FROM node_keys")).scalar() == 1
    engine.dispose()
    # The node key issued on SQLite moved with its public half, so the rerun keeps the key file.
    rerun = init("--root", str(root), "--no-model", "--no-start", "--postgres", pg_move_url, config=config)
    assert "done " not in rerun.stderr and "kept  store postgresql" in rerun.stderr, rerun.stderr
    assert "kept  node key" in rerun.stderr


def test_mirror_init(tmp_path):
    root = tmp_path / "root"
    plan = subprocess.run([*LLMGW, "mirror", "init", "--root", str(root), "--controller", "10.1.2.3", "--plan"],
                          capture_output=True, text=True)
    assert plan.returncode == 0 and "would write unit" in plan.stderr and not root.exists(), plan.stderr
    first = subprocess.run([*LLMGW, "mirror", "init", "--root", str(root), "--controller", "10.1.2.3",
                            "--address", "mirror.example"], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    config = root / "etc" / "llmgw" / "mirror.toml"
    text = config.read_text()
    assert 'api_allow = ["10.1.2.3"]' in text and 'base_url = "http://mirror.example:8081"' in text
    assert mode(config) == "0o600" and mode(root / "srv" / "models") == "0o700"
    unit = (root / "etc" / "systemd" / "system" / "llmgw-mirror.service").read_text()
    assert f"ReadWritePaths={root / 'srv' / 'models'}" in unit
    assert_units_valid([root / "etc" / "systemd" / "system" / "llmgw-mirror.service"])
    assert "ProtectSystem=strict" in unit and "CapabilityBoundingSet=\n" in unit and "PrivateDevices=yes" in unit
    again = subprocess.run([*LLMGW, "mirror", "init", "--root", str(root), "--controller", "10.1.2.3",
                            "--address", "mirror.example"], capture_output=True, text=True)
    assert "done " not in again.stderr and "kept  unit" in again.stderr, again.stderr
    # The configuration it wrote is one the mirror starts with (on free ports here).
    port, api = free_port(), free_port()
    mirror = subprocess.Popen([sys.executable, "mirror.py", "--config", str(config), "--listen", f"127.0.0.1:{port}",
                               "--api-listen", f"127.0.0.1:{api}", "--metrics-listen", f"127.0.0.1:{free_port()}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until("the mirror to serve", 60, lambda: http_status(f"http://127.0.0.1:{api}/api/v1/health") == 200)
    finally:
        mirror.terminate()
        mirror.wait(timeout=30)


def test_a_configuration_an_operator_wrote_is_amended_with_its_comments_and_a_copy_kept(tmp_path):
    import tomllib

    from llmgw.cli import machine
    from llmgw.cli.bringup import Steps

    path = tmp_path / "llmgw.toml"
    mine = ('# ours: ask ops@example.org before changing\n[gateway]\nlisten = ":8080"  # behind nginx\n'
            'workers = 4\n\n[store]\nurl = "sqlite:////var/lib/llmgw/llmgw.db"\n\n[[models]]\nname = "mine"\n')
    path.write_text(mine)
    machine.ensure_config(Steps(), str(path), {"gateway.listen": ":9999", "usage.spool_dir": "/var/spool/llmgw",
                                               "gateway.workers": 2},
                          [{"name": "mine"}, {"name": "starter"}], {"store.url": "postgresql://llmgw@db/llmgw"})
    text = path.read_text()
    assert text.startswith("# ours: ask ops@example.org before changing\n[gateway]\n")
    assert 'listen = ":8080"  # behind nginx' in text and "workers = 4" in text  # what it said is kept
    read = tomllib.loads(text)
    assert read["store"]["url"] == "postgresql://llmgw@db/llmgw"  # --postgres is the one it sets
    assert read["usage"]["spool_dir"] == "/var/spool/llmgw" and [m["name"] for m in read["models"]] == ["mine", "starter"]
    (backup,) = [p for p in tmp_path.iterdir() if p.name.startswith("llmgw.toml.bak-")]
    assert backup.read_text() == mine and oct(backup.stat().st_mode & 0o777) == "0o600"


def _in_a_terminal(argv: list[str], typed: str, timeout: float = 120) -> tuple[int, str]:
    """Run ARGV with a pseudo-terminal as its input and output, everything in TYPED typed ahead at once, before
    any question is shown (lesson 58: the Go version's form lost keystrokes typed while it waited on the
    terminal). Returns its exit status and all it wrote, the terminal's echo included."""
    import pty
    import select
    import time

    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, stdin=follower, stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    os.write(leader, typed.encode())
    seen, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: every holder of the terminal closed it
                    break
                if not chunk:
                    break
                seen += chunk
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=30), seen.decode(errors="replace").replace("\r\n", "\n")
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()


def test_in_a_terminal_init_asks_and_takes_every_answer_typed_ahead(tmp_path):
    root = tmp_path / "root"
    config = base_config(tmp_path, free_port())
    # An email it refuses and asks again for; the address; Enter for SQLite; no mirror; not a node; go ahead.
    typed = "not-an-email\nops@example.org\ncp.example\n\nnone\nn\ny\n"
    status, said = _in_a_terminal([*LLMGW, "--config", config, "init", "--root", str(root), "--no-start"], typed)
    assert status == 0, said
    assert "an email address, such as you@example.org" in said
    assert f"llmgw init --plain --admin ops@example.org --address cp.example --no-mirror --no-node --root {root} " \
        "--no-start\n" in said
    assert "done  administrator ops@example.org" in said and "skip  the mirror (--no-mirror)" in said
    import tomllib

    written = tomllib.loads((root / "etc" / "llmgw" / "llmgw.toml").read_text())
    assert written["mirror"]["api"] == "" and "dir" not in written["mirror"] and "agent" not in written and "models" not in written
    assert not (root / "srv" / "models").exists()
    assert sorted(os.listdir(root / "etc" / "systemd" / "system")) == ["llmgw-controller.service",
                                                                       "llmgw-gateway.service"]
    # Answering no to the last question does nothing; --plain asks nothing, even in a terminal.
    status, said = _in_a_terminal([*LLMGW, "--config", config, "init", "--root", str(tmp_path / "other"),
                                   "--no-start"], "\n\n\n\n\n\nn\n")
    assert status == 1 and "nothing was done" in said and not (tmp_path / "other").exists(), said
    status, said = _in_a_terminal([*LLMGW, "--config", config, "init", "--root", str(root), "--plain",
                                   "--no-start", "--no-node"], "")
    assert status == 0 and "administrator's email" not in said and "kept  administrators ops@example.org" in said, said
    # That rerun kept what the configuration chose: still no mirror, no mirror unit, nothing in the catalog.
    assert [line for line in said.splitlines() if line.startswith("done")] == [], said
    assert not (root / "srv" / "models").exists() and "models" not in tomllib.loads(
        (root / "etc" / "llmgw" / "llmgw.toml").read_text())
    # Another administrator asked for by name is made, its password beside the first's, never over it.
    state = root / "var" / "lib" / "llmgw"
    first = (state / "admin-password").read_text()
    more = init("--root", str(root), "--no-start", "--no-node", "--no-mirror", "--admin", "second@example.org",
                config=config)
    assert f"done  administrator second@example.org (its password is in {state}/admin-password-second@example.org" \
        in more.stderr and (state / "admin-password").read_text() == first, more.stderr


def _publish(models_dir, model: str, version: str, name: str, data: bytes) -> None:
    from llmgw.mirror.store import MirrorDir
    from llmgw.weights import sha256_of

    mirror = MirrorDir(str(models_dir))
    os.makedirs(mirror.arriving_dir(model, version))
    path = os.path.join(mirror.arriving_dir(model, version), name)
    with open(path, "wb") as f:
        f.write(data)
    mirror.publish(model, version, {name: sha256_of(path)})


def test_init_with_another_machines_mirror_and_the_baseline_guard_once_the_judge_is_there(tmp_path):
    import tomllib

    from llmgw import settings
    from llmgw.control.catalog import parse_model

    mirror_root, root = tmp_path / "mirror-host", tmp_path / "root"
    made = subprocess.run([*LLMGW, "mirror", "init", "--root", str(mirror_root), "--controller", "127.0.0.1",
                           "--address", "models.example"], capture_output=True, text=True)
    assert made.returncode == 0 and "done  smollm2-135m-instruct in the mirror" in made.stderr, made.stderr
    assert "llmgw init --mirror http://models.example:8082 --mirror-token COPY" in made.stdout
    mirror_config = mirror_root / "etc" / "llmgw" / "mirror.toml"
    assert tomllib.loads(mirror_config.read_text())["mirror"]["api_names"] == ["models.example"]
    api = free_port()
    mirror = subprocess.Popen([sys.executable, "mirror.py", "--config", str(mirror_config), "--listen",
                               f"127.0.0.1:{free_port()}", "--api-listen", f"127.0.0.1:{api}", "--metrics-listen",
                               f"127.0.0.1:{free_port()}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until("the mirror to serve", 60, lambda: http_status(f"http://127.0.0.1:{api}/api/v1/health") == 200)
        token = mirror_root / "srv" / "models" / ".keys" / "api.token"
        config = base_config(tmp_path, free_port())
        args = ["--root", str(root), "--plain", "--no-node", "--no-start", "--mirror", f"http://127.0.0.1:{api}"]
        refused = subprocess.run([*LLMGW, "--config", config, "init", *args], capture_output=True, text=True)
        assert refused.returncode == 2 and "--mirror needs --mirror-token FILE" in refused.stderr
        wrong = tmp_path / "wrong.token"
        wrong.write_text("not-the-token\n")
        refused = subprocess.run([*LLMGW, "--config", config, "init", *args, "--mirror-token", str(wrong)],
                                 capture_output=True, text=True)
        assert refused.returncode == 1 and "token" in refused.stderr and not root.exists(), refused.stderr

        first = init(*args, "--mirror-token", str(token), config=config)
        assert "skip  the baseline guard: fetch the judge into the mirror with `llmgw mirror fetch hf:" in first.stderr
        path = root / "etc" / "llmgw" / "llmgw.toml"
        written = tomllib.loads(path.read_text())
        copy = root / "etc" / "llmgw" / "mirror.token"
        assert {k: written["mirror"].get(k) for k in ("api", "base_url", "token_file", "dir")} == {
            "api": f"http://127.0.0.1:{api}", "base_url": "http://models.example:8081", "token_file": str(copy),
            "dir": None}
        assert copy.read_text() == token.read_text() and mode(copy) == "0o600"
        assert [m["source"] for m in written["models"]] == [
            f"http://models.example:8081/smollm2-135m-instruct/{written['models'][0]['source'].split('/')[4]}/"
            "SmolLM2-135M-Instruct.Q4_1.gguf"]
        assert "guard" not in written and not (root / "srv" / "models").exists()
        assert "llmgw-mirror.service" not in os.listdir(root / "etc" / "systemd" / "system")

        # The judge arrives in the mirror: the next init adds the guard to the file it wrote, a copy kept.
        _publish(mirror_root / "srv" / "models", "llama-guard-3-1b", "1", "Llama-Guard-3-1B.Q4_K_M.gguf",
                 b"GGUF stand-in")
        again = init(*args, "--mirror-token", str(token), config=config)
        assert "the baseline guard: llama-guard-3-1b 1 from the mirror" in again.stderr, again.stderr
        written = tomllib.loads(path.read_text())
        assert written["guard"] == {"model": "llama-guard-3-1b"}
        judge = written["models"][1]
        assert judge["role"] == "guard" and judge["source"] == ("http://models.example:8081/llama-guard-3-1b/1/"
                                                                "Llama-Guard-3-1B.Q4_K_M.gguf")
        assert parse_model(judge).role == "guard" and settings.load(str(path))["guard.model"] == "llama-guard-3-1b"
        assert [p.name for p in path.parent.iterdir() if p.name.startswith("llmgw.toml.bak-")]
        # A plain rerun keeps that mirror: no mirror of its own comes up beside it.
        plain = init("--root", str(root), "--plain", "--no-node", "--no-start", config=config)
        assert "done " not in plain.stderr and f"the mirror at http://127.0.0.1:{api}" in plain.stderr, plain.stderr
        assert not (root / "srv" / "models").exists()
        # Once the configuration says anything of guardrails, init adds nothing, even where an operator turned
        # them off.
        path.write_text(path.read_text().replace('model = "llama-guard-3-1b"\n', 'model = ""\n', 1))
        third = init(*args, "--mirror-token", str(token), config=config)
        assert "baseline guard" not in third.stderr and 'model = ""' in path.read_text()
    finally:
        mirror.terminate()
        mirror.wait(timeout=30)


def test_postgres_local_makes_its_role_and_database_once(tmp_path):
    from tests.pgserver import OwnPostgres

    server = OwnPostgres()
    try:
        admin = f"postgresql://postgres@127.0.0.1:{server.port}/postgres"
        root = tmp_path / "root"
        config = base_config(tmp_path, free_port())
        args = ["--root", str(root), "--plain", "--no-node", "--no-model", "--no-start", "--postgres", "local",
                "--postgres-admin", admin]
        plan = init(*args, "--plan", config=config)
        assert "would create PostgreSQL role and database llmgw" in plan.stderr and not root.exists(), plan.stderr
        first = init(*args, config=config)
        assert "done  PostgreSQL role and database llmgw" in first.stderr and "(made database and role)" \
            in first.stderr, first.stderr
        dsn_file = root / "etc" / "llmgw" / "store-dsn"
        url = dsn_file.read_text().strip()
        assert mode(dsn_file) == "0o600" and url.startswith("postgresql+psycopg2://llmgw:") \
            and url.endswith(f"@127.0.0.1:{server.port}/llmgw")
        assert f'url = "{url}"' in (root / "etc" / "llmgw" / "llmgw.toml").read_text()
        password = url.split(":")[2].split("@")[0]
        assert password not in first.stderr + first.stdout
        engine = sa.create_engine(url)
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT email FROM users")).scalars().all() == ["admin@localhost"]
            assert conn.execute(sa.text("SELECT current_user")).scalar() == "llmgw"
        engine.dispose()
        again = init(*args, config=config)
        assert "done " not in again.stderr and "kept  store postgresql" in again.stderr, again.stderr
        # Another machine's init finds the role there and takes nothing over.
        other = subprocess.run([*LLMGW, "--config", config, "init", *args[:-4], "--postgres", "local",
                                "--postgres-admin", admin, "--root", str(tmp_path / "other")],
                               capture_output=True, text=True)
        assert other.returncode == 1 and "has a database and a role named llmgw already" in other.stderr, other.stderr
        # An init stopped after the role was made takes the same role up from store-dsn, making what is missing.
        subprocess.run(["psql", "-d", admin, "-c", "DROP DATABASE llmgw WITH (FORCE)"], check=True, capture_output=True)
        resumed_root = tmp_path / "resumed"
        (resumed_root / "etc" / "llmgw").mkdir(parents=True)
        (resumed_root / "etc" / "llmgw" / "store-dsn").write_text(url + "\n")
        resumed = init(*args[:-4], "--postgres", "local", "--postgres-admin", admin, "--root", str(resumed_root),
                       config=config)
        assert "(made database)" in resumed.stderr and f'url = "{url}"' in (
            resumed_root / "etc" / "llmgw" / "llmgw.toml").read_text(), resumed.stderr
    finally:
        server.close()


def test_what_another_machines_mirror_answers_is_checked_before_it_is_written():
    import click
    import pytest

    from llmgw.cli import initmirror, judge

    for bad in ("", None, 5, "ftp://models", "http://", "http://models\ud800", "http://a b", "http://u:p@models",
                "http://models/?q=1", "http://models\n:8081"):
        with pytest.raises(click.ClickException, match="not an http"):
            initmirror._base_url(bad, "http://m:8082")
    assert initmirror._base_url("http://models:8081/", "http://m:8082") == "http://models:8081"
    held = [{"model": judge.NAME, "version": "../..", "files": [{"name": "x.gguf"}]}, "junk", {"model": 3},
            {"model": judge.NAME, "version": "9", "files": [{"name": "../evil.gguf"}, {"name": "a b.gguf"}]},
            {"model": judge.NAME, "version": "10", "files": [{"name": "Llama-Guard-3-1B.Q4_K_M.gguf"}, None]}]
    kept = initmirror._well_formed(held)
    assert [v["version"] for v in kept] == ["9", "10"] and kept[0]["files"] == []
    assert judge.held_version(kept) == ("10", "Llama-Guard-3-1B.Q4_K_M.gguf")  # 10 after 9, as people count


def test_the_baseline_guard_from_the_mirror_beside_the_control_plane(tmp_path):
    import tomllib

    root = tmp_path / "root"
    _publish(root / "srv" / "models", "llama-guard-3-1b", "2026-10-05", "Llama-Guard-3-1B.Q4_K_M.gguf", b"stand-in")
    config = base_config(tmp_path, free_port())
    made = init("--root", str(root), "--plain", "--no-node", "--no-start", "--address", "cp.example", config=config)
    assert "the baseline guard: llama-guard-3-1b 2026-10-05 from the mirror" in made.stderr, made.stderr
    written = tomllib.loads((root / "etc" / "llmgw" / "llmgw.toml").read_text())
    assert written["guard"] == {"model": "llama-guard-3-1b"}
    judge = next(m for m in written["models"] if m["name"] == "llama-guard-3-1b")
    assert judge["source"].endswith("/llama-guard-3-1b/2026-10-05/Llama-Guard-3-1B.Q4_K_M.gguf")
    assert judge["scaling"] == {"min": 2, "max": 2} and judge["guard"] == {"format": "llamaguard3"}
    # --no-model puts no model in the catalog, the judge included.
    other = tmp_path / "other"
    _publish(other / "srv" / "models", "llama-guard-3-1b", "1", "Llama-Guard-3-1B.Q4_K_M.gguf", b"stand-in")
    init("--root", str(other), "--plain", "--no-node", "--no-start", "--no-model", config=config)
    assert "models" not in tomllib.loads((other / "etc" / "llmgw" / "llmgw.toml").read_text())
