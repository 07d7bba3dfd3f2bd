"""A PostgreSQL server of a test's own, in a temporary directory on a free port, that the test may stop.

The shared server on 5432 is never stopped; a test of what happens when the database goes away starts
one of these (Debian's server binaries), stops it, and starts it again on the same port and data; or
pauses it (SIGSTOP to every process of the server): a store that hangs, whose connections stay open and
whose port still takes new ones, but which answers nothing. As root, the server runs as the `postgres`
user, since PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile

from llmgw.procs import free_port

BIN = sorted(glob.glob("/usr/lib/postgresql/*/bin"))[-1] if glob.glob("/usr/lib/postgresql/*/bin") else ""


class OwnPostgres:
    def __init__(self):
        # Not under pytest's tmp_path: its folders are private to root, and the server runs as postgres.
        self.folder = tempfile.mkdtemp(prefix="llmgw-pg-")
        self.data = os.path.join(self.folder, "data")
        self.port = free_port()
        if os.getuid() == 0:
            shutil.chown(self.folder, "postgres", "postgres")
            os.chmod(self.folder, 0o755)
        self._as_server_user([f"{BIN}/initdb", "-D", self.data, "--auth=trust", "-U", "postgres", "--no-sync"])
        self.start()

    def _as_server_user(self, argv: list[str]) -> None:
        if os.getuid() == 0:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        subprocess.run(argv, check=True, capture_output=True, timeout=120)

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        self._as_server_user([f"{BIN}/pg_ctl", "-D", self.data, "-w", "-t", "60", "-l",
                              os.path.join(self.folder, "server.log"), "-o",
                              f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off", "start"])

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (MODE "fast": clients are disconnected; "immediate": as if it crashed)."""
        self._as_server_user([f"{BIN}/pg_ctl", "-D", self.data, "-w", "-t", "60", "-m", mode, "stop"])

    def _signal(self, sig: int) -> None:
        """Send SIG to the postmaster (its pid file's first line), then to its children: once it is stopped, it
        forks no new one that this would miss."""
        with open(os.path.join(self.data, "postmaster.pid")) as f:
            postmaster = int(f.readline())
        os.kill(postmaster, sig)
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == postmaster:
                        os.kill(int(pid), sig)
            except OSError:
                continue

    def pause(self) -> None:
        """Stop every process of the server where it stands (SIGSTOP): it hangs, and answers nothing."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def close(self) -> None:
        try:
            self.resume()  # a paused server would not hear the stop
        except OSError:
            pass  # not running
        try:
            self.stop("immediate")
        except subprocess.CalledProcessError:
            pass  # already stopped
        shutil.rmtree(self.folder, ignore_errors=True)
