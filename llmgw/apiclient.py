"""A small client for llmgw's own JSON APIs (the controller's admin API, the mirror's management API).

Errors keep the server's own sentence ("the source answered 404"), not "HTTP 400": that sentence is
what says what to do. A server that does not answer is a different error from one that refuses,
because callers treat them differently (an unreachable catalog must never look like an empty one).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request


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
    def __init__(self, url: str, name: str, hint: str = ""):
        self.url = url.rstrip("/")
        self.name = name  # "the controller's admin API", "the mirror"
        self.hint = hint  # what to do when it does not answer

    def call(self, method: str, path: str, body: dict | None = None, timeout: float = 30) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            with e:
                try:
                    message = json.loads(e.read())["error"]
                except (ValueError, KeyError, TypeError):
                    message = f"{self.name} answered HTTP {e.code}"
            raise Refused(message, e.code) from None
        except (OSError, ValueError) as e:
            raise Unreachable(f"{self.name} does not answer at {self.url} ({e}).{' ' + self.hint if self.hint else ''}"
                              ) from None


def address_url(listen: str) -> str:
    """An HTTP URL for a `HOST:PORT` listen address (an empty or wildcard host means this machine)."""
    if listen.startswith(("http://", "https://")):
        return listen.rstrip("/")
    host, _, port = listen.rpartition(":")
    return f"http://{host if host not in ('', '0.0.0.0', '::', '[::]') else '127.0.0.1'}:{port}"
