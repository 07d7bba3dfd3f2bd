"""Running commands on another machine with the system's `ssh`, as the operator's own keys allow.

The system's client, not a Python SSH library: it already has the operator's keys, agent,
`~/.ssh/config` (jump hosts, user names, ports) and known hosts, and it is what they trust. It runs
in batch mode, so a missing key or an unknown host key is an error to report, never a prompt that
hangs a run over several hosts. Host keys are checked as the operator's ssh configuration says;
`accept_new` (trust on first use) is an explicit choice, never the default.
"""

from __future__ import annotations

import dataclasses
import shlex
import subprocess


class SshError(Exception):
    """The command could not be run there, or failed; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class Target:
    destination: str  # [user@]host, as given
    port: int | None = None
    identity: str | None = None
    known_hosts: str | None = None
    accept_new: bool = False
    connect_timeout: int = 15

    @property
    def host(self) -> str:
        return self.destination.rpartition("@")[2]

    def argv(self) -> list[str]:
        argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={self.connect_timeout}",
                "-o", "ServerAliveInterval=15", "-o", "LogLevel=ERROR"]
        if self.port:
            argv += ["-p", str(self.port)]
        if self.identity:
            argv += ["-i", self.identity, "-o", "IdentitiesOnly=yes"]
        if self.known_hosts:
            argv += ["-o", f"UserKnownHostsFile={self.known_hosts}"]
        if self.accept_new:
            argv += ["-o", "StrictHostKeyChecking=accept-new"]
        return argv + ["--", self.destination]

    def run(self, script: str, stdin: bytes | None = None, timeout: float = 600, what: str = "",
            check: bool = True) -> tuple[int, str]:
        """Run SCRIPT (sh) there: its exit status and standard output. SshError when ssh itself fails, and
        with CHECK when SCRIPT does, with the end of what it wrote to standard error."""
        try:
            done = subprocess.run(self.argv() + ["sh -c " + shlex.quote(script)], input=stdin,
                                  capture_output=True, timeout=timeout)
        except FileNotFoundError:
            raise SshError("there is no ssh client on this machine: install one (apt-get install openssh-client)") \
                from None
        except subprocess.TimeoutExpired:
            raise SshError(f"{what or 'a command'} on {self.host} did not finish within {timeout:.0f} s") from None
        err = done.stderr.decode(errors="replace").strip()
        if done.returncode == 255:
            raise SshError(self._explain(err))
        out = done.stdout.decode(errors="replace")
        if check and done.returncode != 0:
            last = "\n".join(err.splitlines()[-15:]) or out.strip()[-2000:]
            raise SshError(f"{what or 'a command'} failed on {self.host} (exit {done.returncode}): {last}")
        return done.returncode, out

    def _explain(self, err: str) -> str:
        """What ssh's own error means, and what to do about it."""
        where = f"{self.destination}" + (f" (port {self.port})" if self.port else "")
        if "Host key verification failed" in err:
            return (f"ssh does not know {self.host}'s host key, so it cannot tell the machine is the one meant: "
                    f"check its fingerprint and accept it with `ssh {self.destination}` once, or give "
                    "--known-hosts FILE (or --accept-new-host-key to trust it on first use)")
        if "REMOTE HOST IDENTIFICATION HAS CHANGED" in err:
            return (f"{self.host}'s host key is not the one ssh knows: if the machine was reinstalled, remove the "
                    f"old key (ssh-keygen -R {self.host}) and try again; otherwise someone may be in the way")
        if "Permission denied" in err:
            return (f"{where} refused the SSH login ({err.splitlines()[-1]}): put your public key in that user's "
                    f"~/.ssh/authorized_keys (ssh-copy-id {self.destination}), or give --identity KEY_FILE")
        if "Connection refused" in err or "timed out" in err or "No route to host" in err or \
                "Could not resolve" in err:
            return f"cannot reach SSH at {where}: {err.splitlines()[-1]}. Check the address and --ssh-port"
        return f"ssh to {where} failed: {err or 'exit 255, no message'}"
