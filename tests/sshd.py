"""A real OpenSSH server for the tests, on a free loopback port, so a "remote" node is reached as one is.

Debian's `/usr/sbin/sshd` with its own host key, one authorized key made by the test, and an
unprivileged login: a user made for the tests when they run as root (sshd as root can log in as
anyone), or the current user otherwise (sshd run by a user can log in only as that user).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile

from llmgw.procs import free_port, wait_for
from tests.conftest import stop_process

SSHD = "/usr/sbin/sshd"
TEST_USER = "llmgw-nodetest"


def login_user() -> str:
    """The unprivileged user the tests log in as, made (once) when they run as root."""
    if os.getuid() != 0:
        return pwd.getpwuid(os.getuid()).pw_name
    try:
        pwd.getpwnam(TEST_USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", TEST_USER], check=True)
    # useradd leaves the password "!" (locked), and sshd without PAM refuses a locked account even for a
    # key; "*" is no password, which is what the test wants: keys only.
    subprocess.run(["usermod", "-p", "*", TEST_USER], check=True)
    return TEST_USER


class Sshd:
    def __init__(self, tmp):
        if not os.path.exists(SSHD):
            raise RuntimeError(f"{SSHD} is missing: apt-get install openssh-server (make test installs it as root)")
        self.user = login_user()
        home = pwd.getpwnam(self.user).pw_dir
        # What the login user must read or write lives in its home: pytest's folders are closed to it.
        self.dir = tempfile.mkdtemp(prefix="nodeadd-", dir=home)
        if os.getuid() == 0:
            shutil.chown(self.dir, self.user, self.user)
        self.port = free_port()
        keys = tmp / "ssh"
        keys.mkdir()
        host_key, self.client_key = keys / "host_ed25519", keys / "client_ed25519"
        for path in (host_key, self.client_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
        authorized = os.path.join(self.dir, "authorized_keys")
        shutil.copy(f"{self.client_key}.pub", authorized)
        os.chmod(authorized, 0o644)
        self.known_hosts = keys / "known_hosts"
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {(keys / 'host_ed25519.pub').read_text()}")
        config = keys / "sshd_config"
        config.write_text(f"ListenAddress 127.0.0.1:{self.port}\nHostKey {host_key}\nPidFile {keys}/sshd.pid\n"
                          f"AuthorizedKeysFile {authorized}\nAllowUsers {self.user}\nPasswordAuthentication no\n"
                          "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n")
        if os.getuid() == 0:
            os.makedirs("/run/sshd", exist_ok=True)  # its privilege-separation folder, which root's sshd wants
        self.log_path = keys / "sshd.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT)
        wait_for("sshd to listen", 20, lambda: "Server listening" in self.log_path.read_text(),
                 alive=lambda: self.proc.poll() is None)

    def ssh_flags(self) -> list[str]:
        """The flags `llmgw node add` takes to reach this server as a remote machine."""
        return ["--ssh-port", str(self.port), "--identity", str(self.client_key), "--known-hosts", str(self.known_hosts)]

    def stop(self):
        stop_process(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)
