"""Errors in OpenAI's format, with the HTTP status each kind of failure earns.

Every refusal on `/v1` is built here, so clients (the `openai` library above
all) see the shape they parse, and every message says what happened and what
to do about it. A message names no host, port or replica: it ends with the
request's id (see llmgw/gateway/requestid.py), under which the log holds the
detail.
"""

from __future__ import annotations

import json

from llmgw.gateway import requestid

REASONS = {
    200: "200 OK", 201: "201 Created", 202: "202 Accepted",
    400: "400 Bad Request", 401: "401 Unauthorized", 403: "403 Forbidden", 404: "404 Not Found",
    405: "405 Method Not Allowed", 408: "408 Request Timeout", 409: "409 Conflict", 411: "411 Length Required",
    413: "413 Content Too Large", 414: "414 URI Too Long", 415: "415 Unsupported Media Type",
    417: "417 Expectation Failed", 429: "429 Too Many Requests", 431: "431 Request Header Fields Too Large",
    499: "499 Client Closed Request", 500: "500 Internal Server Error", 502: "502 Bad Gateway",
    503: "503 Service Unavailable", 504: "504 Gateway Timeout",
}

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 405: "invalid_request_error", 408: "timeout_error", 409: "invalid_request_error",
         411: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
         429: "rate_limit_error", 500: "api_error", 502: "api_error", 503: "api_error", 504: "timeout_error"}


class ApiError(Exception):
    """A request that ends with an error object instead of an answer."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after

    def payload(self) -> dict:
        rid = requestid.current.get()
        message = self.message if rid is None else f"{self.message} (request id {rid})"
        return {"error": {"message": message, "type": TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}

    def body(self) -> bytes:
        return json.dumps(self.payload()).encode()

    def sse_event(self) -> bytes:
        """The error as the last event of a stream that had already begun."""
        return b"data: " + self.body() + b"\n\n"

    def headers(self, body: bytes) -> list[tuple[str, str]]:
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        if self.retry_after is not None:
            headers.append(("Retry-After", str(self.retry_after)))
        return headers

    @property
    def status_line(self) -> str:
        return REASONS.get(self.status, f"{self.status} Error")
