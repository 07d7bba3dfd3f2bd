"""`llmgw up`, which `make run` runs: a real model answering behind a gateway, from nothing, twice."""

import json
import os
import re
import subprocess
import sys

from llmgw.cli import starter
from llmgw.node.shardfiles import running_engines
from llmgw.procs import free_port, http_status, wait_for
from tests.conftest import Up, post


def signs_in(base, email, password) -> bool:
    """Sign in through the real pages with a cookie jar, as a browser would."""
    import http.cookiejar
    import urllib.parse
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
    with opener.open(base + "/login", timeout=10) as resp:
        token = re.search(r'name="csrf_token" type="hidden" value="([^"]+)"', resp.read().decode()).group(1)
    body = urllib.parse.urlencode({"email": email, "password": password, "csrf_token": token}).encode()
    with opener.open(base + "/login", data=body, timeout=10) as resp:  # follows the redirect to /account
        page = resp.read().decode()
    return f"Signed in as <strong>{email}</strong> (administrator)" in page


def test_up_serves_a_real_model_and_stops_everything(tmp_path):
    up = Up(tmp_path)
    port, out, err = up.port, up.out, up.err
    try:
        assert "done  key" in err and "said: " in err and "Paris" in err
        key = re.search(r"key: (sk-llmgw-\S+)", out).group(1)
        # The administrator's password is in a file of its own, never in what was printed (redirected, that
        # was a file of mode 0644).
        assert "with the password in var/admin-password" in out
        admin_password = (tmp_path / "var" / "admin-password").read_text().strip()
        assert admin_password not in out + err
        assert signs_in(f"http://127.0.0.1:{port}", "admin@localhost", admin_password)
        for secret in ("starter-key", "admin-password"):
            assert oct(os.stat(tmp_path / "var" / secret).st_mode & 0o777) == "0o600"
        # A second `llmgw up` beside this one is refused at once, naming it, and changes nothing.
        before = sorted(os.listdir(tmp_path / "var"))
        second = subprocess.run([sys.executable, "-m", "llmgw", "--config", up.config, "up", "--listen",
                                 f"127.0.0.1:{free_port()}"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert second.returncode != 0 and f"another llmgw up runs from {tmp_path / 'var'} (pid {up.proc.pid}" in \
            second.stderr, second.stderr
        assert "done " not in second.stderr and "kept " not in second.stderr
        assert sorted(os.listdir(tmp_path / "var")) == before and up.proc.poll() is None
        # The configuration it wrote names the same store whatever directory it is used from.
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        made = subprocess.run([sys.executable, "-m", "llmgw", "--config", str(tmp_path / "var" / "up.toml"), "keys",
                               "create", "from-elsewhere"], cwd=elsewhere, capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stderr
        other_key = re.search(r"sk-llmgw-\S+", made.stdout).group(0)
        wait_for("the key made elsewhere to work", 10, lambda: post(
            f"http://127.0.0.1:{port}/v1/chat/completions", {"model": starter.NAME, "max_tokens": 2, "messages": [
                {"role": "user", "content": "Hi"}]}, other_key)[0] == 200, interval=0.2)
        assert not os.listdir(elsewhere)
        # The printed curl command, run as printed.
        curl = out[out.index("curl http"):out.index("}]}'") + 4].replace("\\\n", " ")
        answer = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60)
        reply = json.loads(answer.stdout)
        assert reply["choices"][0]["message"]["content"] and reply["usage"]["completion_tokens"] <= starter.MAX_OUTPUT
        # The printed Python example, run as printed.
        example = out[out.index("  from openai"):out.index("print(reply.choices[0].message.content)") + 39]
        example = "\n".join(line[2:] for line in example.splitlines())
        ran = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=60)
        assert ran.returncode == 0 and ran.stdout.strip(), ran.stderr
        engines = running_engines(str(tmp_path / "var" / "agent"))
        assert len(engines) == 1
        ctl = subprocess.run([sys.executable, "-m", "llmgw", "--config", "var/up.toml", "ctl", "replicas"],
                             cwd=tmp_path, capture_output=True, text=True)
        assert "smollm2-135m-instruct" in ctl.stdout and "ready" in ctl.stdout
        # Filtered alike in the table and in --json; a filter matching nothing says how many there are.
        def ctl_run(*argv):
            return subprocess.run([sys.executable, "-m", "llmgw", "--config", "var/up.toml", "ctl", *argv],
                                  cwd=tmp_path, capture_output=True, text=True)
        assert len(ctl_run("replicas", "--state", "rea", "--pool", "none/cpu", "--json").stdout.splitlines()) == 1
        assert "no replicas match state gone. 1 replicas in total" in ctl_run("replicas", "--state", "gone").stderr
        assert "no nodes match fabric ib-z. 1 nodes in total" in ctl_run("nodes", "--fabric", "ib-z").stderr
        assert len(ctl_run("nodes", "--state", "ready", "--json").stdout.splitlines()) == 1
        # The node fetched the model from the mirror, which imported it from the wheel.
        assert "imported into the mirror" in err
        listed = subprocess.run([sys.executable, "-m", "llmgw", "--config", "var/up.toml", "mirror", "list"],
                                cwd=tmp_path, capture_output=True, text=True)
        assert "smollm2-135m-instruct" in listed.stdout and "present" in listed.stdout
        assert any(name.endswith(".gguf") for name in os.listdir(tmp_path / "var" / "weights"))
        # A model added at run time, ready long before llama.cpp on the next start: the start-up check once
        # asked the starter model as soon as any model was ready, got 503, and stopped with a traceback.
        (tmp_path / "quick.toml").write_text('name = "quick"\nsource = "/nothing"\n'
                                             'scaling = {min = 1, max = 1}\nprofiles = [{engine = "sim"}]\n')
        added = subprocess.run([sys.executable, "-m", "llmgw", "--config", "var/up.toml", "ctl", "model", "add",
                                "-f", "quick.toml", "--no-source-check"], cwd=tmp_path, capture_output=True, text=True)
        assert added.returncode == 0, added.stderr
    finally:
        up.stop()
    assert http_status(f"http://127.0.0.1:{port}/health", timeout=1) is None
    # The engine stopped too.
    wait_for("the engine to stop", 30, lambda: running_engines(str(tmp_path / "var" / "agent")) == {})

    # Again: the store and the key are reused, and the model added at run time does not trip the check.
    up.start()
    out, err = up.out, up.err
    try:
        assert "kept  key" in err and key in out and "kept  administrator" in err and "kept  smollm2" in err
        assert "Traceback" not in err and "Paris" in err
        status, _, _ = post(f"http://127.0.0.1:{port}/v1/chat/completions",
                            {"model": "smollm2-135m-instruct", "max_tokens": 5,
                             "messages": [{"role": "user", "content": "Hi"}]}, key)
        assert status == 200
    finally:
        up.stop()


def test_up_refuses_a_var_others_may_change_before_writing_anything(tmp_path):
    # Another user who can write var/ plants links where the keys and the administrator's password go.
    var = tmp_path / "var"
    var.mkdir()
    var.chmod(0o777)
    planted = tmp_path / "theirs"
    planted.write_text("")
    (var / "admin-password").symlink_to(planted)
    ran = subprocess.run([sys.executable, "-m", "llmgw", "up", "--listen", f"127.0.0.1:{free_port()}"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode != 0 and f"chmod 700 {var}" in ran.stderr, ran.stderr
    assert sorted(os.listdir(var)) == ["admin-password"] and planted.read_text() == ""
