"""Files that hold secrets: made 0600 (directories 0700) at first start, and each role refusing to start,
with the command that fixes it, while others can read them (issue 9: any local user read the store).

Tests run as root, who reads anything: modes are checked with stat, never by a permission denied."""

import os
import stat
import subprocess
import sys

import pytest
import sqlalchemy as sa

from llmgw import filemodes, keyfiles, settings, store
from llmgw.control import adminapi
from llmgw.procs import free_port
from tests.conftest import ROOT, write_config


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask_022():
    """The usual umask, whatever the test runner's: what llmgw makes must be private despite it."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_the_store_keys_and_token_are_made_private_at_first_start(tmp_path, umask_022):
    var = tmp_path / "var"
    db = var / "llmgw.db"
    engine = store.open_store(f"sqlite:///{db}")
    with engine.connect() as conn:  # while a connection is open, the -wal and -shm files exist
        with conn.begin():
            conn.execute(store.revisions.update().values(value=store.revisions.c.value + 1))
        conn.execute(sa.select(store.revisions.c.value)).all()
        assert os.path.exists(f"{db}-wal") and os.path.exists(f"{db}-shm")
        assert {p: mode(p) for p in (db, f"{db}-wal", f"{db}-shm")} == dict.fromkeys((db, f"{db}-wal", f"{db}-shm"),
                                                                                       0o600)
    engine.dispose()
    assert mode(var) == 0o700
    keys = var / "keys"
    keyfiles.controller_keypair(str(keys))
    adminapi.ensure_token(str(keys))
    assert (mode(keys), mode(keys / "controller.key"), mode(keys / "admin.token")) == (0o700, 0o600, 0o600)
    filemodes.refuse_loose({str(p): filemodes.OTHERS for p in (var, db, keys, keys / "controller.key")})


def test_what_each_role_holds_secrets_in(tmp_path):
    token = tmp_path / "token"
    token.write_text("t0ken")
    config = write_config(tmp_path / "c.toml", {"store.url": f"sqlite:///{tmp_path}/s.db",
                                                "controller.keys_dir": str(tmp_path / "keys"),
                                                "controller.admin_token": f"@{token}",
                                                "gateway.key_file": str(tmp_path / "gw.key"),
                                                "agent.key_file": str(tmp_path / "node.key")})
    cfg = settings.load(config)
    assert cfg.secret_files == (str(token),) and not cfg.holds_secret
    db = str(tmp_path / "s.db")
    files = {role: filemodes.role_files(cfg, role) for role in ("controller", "gateway", "agent", "mirror")}
    assert set(files["controller"]) == {str(tmp_path), db, f"{db}-wal", f"{db}-shm", str(tmp_path / "keys"),
                                        str(tmp_path / "keys" / "controller.key"),
                                        str(tmp_path / "keys" / "admin.token"), str(token), config}
    assert set(files["gateway"]) == {str(tmp_path), db, f"{db}-wal", f"{db}-shm", str(tmp_path / "gw.key"),
                                     str(tmp_path / "keys" / "admin.token"), str(token), config}
    # And the configuration's own directory, which its relative paths are in; and the mirror's directory.
    assert set(files["agent"]) == {str(tmp_path / "node.key"), str(token), config, str(tmp_path)}
    assert set(files["mirror"]) == {str(token), config, str(tmp_path), cfg["mirror.dir"]}
    # A configuration without a secret in it may be read by others, never changed by them.
    assert files["mirror"][config] == filemodes.OTHERS_WRITE and files["mirror"][str(token)] == filemodes.OTHERS
    os.chmod(token, 0o644)
    os.chmod(config, 0o666)
    with pytest.raises(filemodes.LooseFiles) as refused:
        filemodes.check_roles(cfg, "mirror")
    assert f"chmod 600 {token}; chmod go-w {config}" in str(refused.value)
    os.chmod(token, 0o600)
    os.chmod(config, 0o644)
    filemodes.check_roles(cfg, "controller", "gateway", "agent", "mirror")  # files that do not exist pass


@pytest.mark.parametrize("text,secret", [
    ('[store]\nurl = "postgresql://llmgw:hunter2@db/llmgw"\n', True),
    ('[store]\nurl = "postgresql://llmgw@db/llmgw"\n', False),
    ('[store]\nurl = "sqlite:///var/llmgw.db"\n', False),
    ('[controller]\nadmin_token = "t0ken"\n', True),
    ('[controller]\nadmin_token = ""\n', False),
])
def test_a_configuration_holding_a_secret_must_be_private(tmp_path, text, secret):
    path = tmp_path / "c.toml"
    path.write_text(text)
    path.chmod(0o644)
    cfg = settings.load(str(path))
    assert cfg.holds_secret is secret
    if secret:
        with pytest.raises(filemodes.LooseFiles, match=f"chmod 600 {path}"):
            filemodes.check_roles(cfg, "mirror")
    else:
        filemodes.check_roles(cfg, "mirror")


def start(tmp_path, script, config) -> subprocess.CompletedProcess:
    """Run role SCRIPT on CONFIG, which must refuse at once; a role that starts instead is stopped at the
    deadline, and the test fails."""
    try:
        return subprocess.run([sys.executable, os.path.join(ROOT, script), "--config", config], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{script} started on loose files instead of refusing")


def loose_controller(tmp_path):
    db = tmp_path / "controller.db"
    store.open_store(f"sqlite:///{db}").dispose()
    db.chmod(0o644)  # as SQLite made it before
    config = write_config(tmp_path / "controller.toml", {
        "store.url": f"sqlite:///{db}", "controller.keys_dir": str(tmp_path / "keys"),
        **{f"controller.{k}": f"127.0.0.1:{free_port()}" for k in (
            "agent_listen", "admin_listen", "metrics_listen", "gateway_listen", "demand_listen", "accountant_listen")}})
    return "controller.py", config, f"chmod 600 {db}"


def loose_controller_keys(tmp_path):
    script, config, _ = loose_controller(tmp_path)
    (tmp_path / "controller.db").chmod(0o600)
    keys = tmp_path / "keys"
    keyfiles.controller_keypair(str(keys))
    keys.chmod(0o755)
    (keys / "controller.key").chmod(0o640)
    return script, config, f"chmod 700 {keys}; chmod 600 {keys / 'controller.key'}"


def gateway_config(tmp_path, folder, **more) -> str:
    """A one-worker gateway's configuration on free ports, its store in FOLDER."""
    return write_config(tmp_path / "gateway.toml", {
        "store.url": f"sqlite:///{folder}/gateway.db", "gateway.listen": f"127.0.0.1:{free_port()}",
        "gateway.metrics_listen": f"127.0.0.1:{free_port()}", "gateway.workers": 1, **more})


def loose_gateway(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    return "gateway.py", gateway_config(tmp_path, folder), f"chmod 700 {folder}"


def loose_gateway_key(tmp_path):
    key = tmp_path / "gateway.key"
    key.write_text(keyfiles.gateway_key_file("gw", b"p" * 40, b"s" * 40, b"c" * 40))
    key.chmod(0o644)
    config = gateway_config(tmp_path, tmp_path, **{"gateway.controller": f"127.0.0.1:{free_port()}",
                                                   "gateway.key_file": str(key)})
    return "gateway.py", config, f"chmod 600 {key}"


def loose_agent(tmp_path):
    key = tmp_path / "node.key"
    key.write_text(keyfiles.node_key_file("n1", b"p" * 40, b"s" * 40, b"c" * 40))
    key.chmod(0o604)
    config = write_config(tmp_path / "agent.toml", {
        "agent.controllers": [f"127.0.0.1:{free_port()}"], "agent.key_file": str(key),
        "agent.work_dir": str(tmp_path / "work"), "agent.weights_dir": str(tmp_path / "weights")})
    return "agent.py", config, f"chmod 600 {key}"


def loose_mirror(tmp_path):
    config = write_config(tmp_path / "mirror.toml", {
        "mirror.dir": str(tmp_path / "models"), "mirror.listen": f"127.0.0.1:{free_port()}",
        "mirror.api_listen": f"127.0.0.1:{free_port()}", "mirror.metrics_listen": f"127.0.0.1:{free_port()}",
        "controller.admin_token": "written-in-the-file"})
    os.chmod(config, 0o640)
    return "mirror.py", config, f"chmod 600 {config}"


def loose_mirror_token(tmp_path):
    keys = tmp_path / "models" / ".keys"
    keys.mkdir(parents=True, mode=0o755)
    keys.chmod(0o755)
    (keys / "api.token").write_text("readable-by-every-local-user\n")
    (keys / "api.token").chmod(0o644)
    config = write_config(tmp_path / "mirror.toml", {
        "mirror.dir": str(tmp_path / "models"), "mirror.listen": f"127.0.0.1:{free_port()}",
        "mirror.api_listen": f"127.0.0.1:{free_port()}", "mirror.metrics_listen": f"127.0.0.1:{free_port()}"})
    return "mirror.py", config, f"chmod 700 {keys}; chmod 600 {keys / 'api.token'}"


@pytest.mark.parametrize("loose", [loose_controller, loose_controller_keys, loose_gateway, loose_gateway_key, loose_agent,
                                   loose_mirror, loose_mirror_token])
def test_each_role_refuses_to_start_on_files_others_can_read(tmp_path, loose, umask_022):
    script, config, fix = loose(tmp_path)
    run = start(tmp_path, script, config)
    assert run.returncode == 1, run.stderr
    assert "other users of this machine can read or change files that hold secrets" in run.stderr
    assert fix in run.stderr, run.stderr


def test_a_secret_is_written_in_place_of_a_link_never_through_it(tmp_path):
    from llmgw.filemodes import write_private

    theirs = tmp_path / "theirs"
    theirs.write_text("their own\n")
    (tmp_path / "secret").symlink_to(theirs)
    hard = tmp_path / "hard"
    os.link(theirs, hard)
    write_private(str(tmp_path / "secret"), "s3cret\n")
    write_private(str(hard), "s3cret\n")
    assert theirs.read_text() == "their own\n"
    for path in (tmp_path / "secret", hard):
        assert not path.is_symlink() and path.read_text() == "s3cret\n" and oct(path.stat().st_mode & 0o777) == "0o600"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hard", "secret", "theirs"]  # no temporary left
