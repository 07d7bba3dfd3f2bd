"""A small client for llmgw's own JSON APIs (the controller's admin API, the mirror's management API).

The one client of both, for `llmgw ctl`, `llmgw mirror`, `llmgw up` and the gateway's pages alike;
`admin_client` and `mirror_client` give it each API's token from the configuration, and `leader_client`
finds, of two controllers sharing a store, the one that leads (a standby's admin API answers its status only).

Errors keep the server's own sentence ("the source answered 404"), not "HTTP 400": that sentence is
what says what to do. A server that does not answer is a different error from one that refuses,
because callers treat them differently (an unreachable catalog must never look like an empty one).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request

from llmgw import addresses, apiguard, settings


def segment(value: str) -> str:
    """VALUE as one segment of an API path, every character that means something in a URL quoted: a node
    named `a?force=1` or `../models/x` once sent another request than the one its command names."""
    return urllib.parse.quote(value, safe="")


class ApiError(Exception):
    """A call that did not succeed; the message is for a person."""


class Unreachable(ApiError):
    """Nothing answered."""


class Refused(ApiError):
    """The server answered with an error; the message is its own."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class ApiClient:
    def __init__(self, url: str, name: str, hint: str = "", token: str | None = None, token_note: str = ""):
        self.url = url.rstrip("/")
        self.name = name  # "the controller's admin API", "the mirror"
        self.hint = hint  # what to do when it does not answer
        self.token = token  # sent as a bearer token when there is one
        self.token_note = token_note  # why there is none, added to the server's 401

    def call(self, method: str, path: str, body: dict | None = None, timeout: float = 30) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            with e:
                try:
                    message = json.loads(e.read())["error"]
                except (ValueError, KeyError, TypeError):
                    message = f"{self.name} answered HTTP {e.code}"
            if e.code == 401 and self.token_note:
                message = f"{message} ({self.token_note})"
            raise Refused(message, e.code) from None
        except (OSError, ValueError) as e:
            raise Unreachable(f"{self.name} does not answer at {self.url} ({e}).{' ' + self.hint if self.hint else ''}"
                              ) from None


def address_url(listen: str, setting: str) -> str:
    """An HTTP URL for LISTEN, a URL or the `HOST:PORT` of SETTING (a wildcard host means this machine)."""
    if listen.startswith(("http://", "https://")):
        return listen.rstrip("/")
    return addresses.url(listen, setting)


def _read_token(path: str) -> tuple[str | None, str]:
    """(the token in PATH, or None; why there is none, for the server's 401). Read at each client's making,
    so a token made again is picked up."""
    path = os.path.abspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        return None, f"no token was sent: {path} could not be read ({e.strerror})"
    return (token, "") if token else (None, f"{path} is empty")


def admin_client(cfg: settings.Config, address: str, hint: str = "") -> ApiClient:
    """A client of the controller's admin API at ADDRESS (`HOST:PORT` or a URL), with its token:
    `controller.admin_token` when set, else the file the controller made in `controller.keys_dir`,
    which is there on the controller's machine."""
    token, note = cfg["controller.admin_token"], ""
    if not token:
        token, note = _read_token(apiguard.token_path(cfg["controller.keys_dir"]))
    return ApiClient(address_url(address, "the controller's admin API address"), "the controller's admin API", hint, token or None, note)


def mirror_client(cfg: settings.Config, hint: str = "") -> ApiClient:
    """A client of the mirror's management API (`mirror.api`), with the token in `mirror.token_file`: the file
    the mirror made on its machine, or a copy of it elsewhere."""
    token, note = _read_token(apiguard.mirror_token_path(cfg))
    return ApiClient(address_url(cfg["mirror.api"], "mirror.api"), "the mirror's management API", hint, token, note)


def leader_client(cfg: settings.Config, addresses_: list[str], hint: str = "") -> ApiClient:
    """The admin API of the controller that leads, of ADDRESSES_: the first whose status says so. With one
    address, or none leading, the first: its own answer then says what is wrong."""
    if len(addresses_) > 1:
        for address in addresses_:
            client = admin_client(cfg, address, hint)
            try:
                if client.call("GET", "/api/v1/status", timeout=2).get("role", "leader") == "leader":
                    return client
            except ApiError:
                continue
    return admin_client(cfg, addresses_[0], hint)
