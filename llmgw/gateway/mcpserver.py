"""The gateway's MCP server: a project's notes as tools an agent calls (`/v1/mcp`, streamable HTTP).

MCP's streamable HTTP transport is JSON-RPC 2.0 in POST bodies; a server may answer each with one JSON
object, which is all these tools need, so this speaks it directly: the official SDK's server runs on
asyncio (Starlette), which a gevent worker does not, and the part of the protocol a server of four tools
uses is a page of code. What it offers: the `initialize` handshake (every revision that has one; a
client's `server/discover` probe is answered "method not found", which tells it to shake hands),
`ping`, `tools/list` and `tools/call`. No session is kept, none is needed: the key authenticates each
request, and the project is the key's. A GET (a stream the server could push on) is 405, as the
transport allows. It is tested with the official SDK's client, Claude Code and Codex.

Tools: remember (a note made), recall (notes holding any of some words), list_notes (the last written),
forget (a note deleted). A project that keeps no notes, or a personal key, is refused at every request
(403 and a JSON-RPC error saying how to turn them on), so an agent's setup fails loudly, not its first
tool call.
"""

from __future__ import annotations

import json

from llmgw import __version__, memory
from llmgw.gateway import jsonbound
from llmgw.gateway.errors import ApiError
from llmgw.gateway.notes import Notes

PATH = "/v1/mcp"
# The revisions that shake hands with `initialize`, oldest first: a client's own is answered with itself.
VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS = -32700, -32600, -32601, -32602
REFUSED = -32001  # a server's own code: the key may not use these tools
ID_MOST = 2**53  # a request id: a number JSON carries exactly everywhere

INSTRUCTIONS = ("Notes kept for this project across conversations. Before a task, recall what earlier "
                "sessions noted about it; remember what a later session should know (decisions, conventions, "
                "where things are). Notes are kept for the project's retention after they were last written.")
TOOLS = [
    {"name": "remember", "title": "Remember a note",
     "description": "Keep a note for later conversations of this project. Returns the note's id.",
     "inputSchema": {"type": "object", "required": ["text"], "additionalProperties": False, "properties": {
         "text": {"type": "string", "description": "What to remember, in words a later reader understands.",
                  "maxLength": memory.TEXT_MOST}}}},
    {"name": "recall", "title": "Search the notes",
     "description": "Find notes that hold any of the given words, the best matches first.",
     "inputSchema": {"type": "object", "required": ["query"], "additionalProperties": False, "properties": {
         "query": {"type": "string", "description": "Words to look for.", "maxLength": memory.QUERY_MOST},
         "limit": {"type": "integer", "minimum": 1, "maximum": memory.LIST_MOST, "default": 10}}}},
    {"name": "list_notes", "title": "List the notes",
     "description": "The notes of this project, the last written first.",
     "inputSchema": {"type": "object", "additionalProperties": False, "properties": {
         "limit": {"type": "integer", "minimum": 1, "maximum": memory.LIST_MOST, "default": 20}}}},
    {"name": "forget", "title": "Delete a note",
     "description": "Delete a note by its id (as remember, recall and list_notes give it).",
     "inputSchema": {"type": "object", "required": ["id"], "additionalProperties": False, "properties": {
         "id": {"type": "string", "description": "The note's id, note_..."}}}},
]
SCHEMAS = {tool["name"]: tool["inputSchema"] for tool in TOOLS}


class McpServer:
    def __init__(self, notes: Notes):
        self.notes = notes

    def answer(self, caller, body: bytes) -> tuple[int, bytes | None]:
        """(HTTP status, body or None) for one POST to `/v1/mcp`; raises ApiError where the key may not use
        the tools (McpServer.refusal says it as JSON-RPC)."""
        self.notes.scope(caller)  # refused at once where the project keeps no notes (see the top)
        try:
            message = jsonbound.loads(body)  # bounded in size and depth, as any body
        except ApiError:
            return 400, _error(None, PARSE_ERROR, "The body is not a JSON-RPC message: JSON, within the gateway's "
                                                  "bounds of size and nesting.")
        if isinstance(message, list):
            # MCP's current revisions send no batches; taking them would let one request make twenty calls,
            # past the key's request rate.
            return 400, _error(None, INVALID_REQUEST, "Send one JSON-RPC message a request; batches are not taken.")
        found = self._one(caller, message)
        return (200, found) if found is not None else (202, None)

    def _one(self, caller, message) -> bytes | None:
        """The answer to one JSON-RPC MESSAGE; None for a notification or a client's response."""
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            return _error(None, INVALID_REQUEST, "Not a JSON-RPC 2.0 message.")
        if "id" not in message:
            return None  # a notification (notifications/initialized), or nothing to answer
        rid, method = message["id"], message.get("method")
        if not _an_id(rid):
            return _error(None, INVALID_REQUEST, "A request's id is a whole number or a string of at most 200 "
                                                 "characters.")
        if method is None and ("result" in message or "error" in message):
            return None  # a client's response to a request of ours: we make none
        if not isinstance(method, str):
            return _error(rid, INVALID_REQUEST, "A request's method is a string.")
        params = message.get("params", {})
        if not isinstance(params, dict):
            return _error(rid, INVALID_PARAMS, "params must be an object.")
        if method == "initialize":
            asked = params.get("protocolVersion")
            return _result(rid, {"protocolVersion": asked if asked in VERSIONS else VERSIONS[-1],
                                 "capabilities": {"tools": {"listChanged": False}},
                                 "serverInfo": {"name": "llmgw-memory", "title": "llmgw notes", "version": __version__},
                                 "instructions": INSTRUCTIONS})
        if method == "ping":
            return _result(rid, {})
        if method == "tools/list":
            return _result(rid, {"tools": TOOLS})
        if method == "tools/call":
            return self._call(caller, rid, params)
        return _error(rid, METHOD_NOT_FOUND, f"This server has no method {method[:60]!r}: it offers tools only.")

    def _call(self, caller, rid, params: dict) -> bytes:
        name, given = params.get("name"), params.get("arguments", {})
        if not isinstance(given, dict):
            return _error(rid, INVALID_PARAMS, "arguments must be an object.")
        schema = SCHEMAS.get(name) if isinstance(name, str) else None
        if schema is None:
            return _error(rid, INVALID_PARAMS, f"No tool {str(name)[:60]!r}: remember, recall, list_notes, forget.")
        wrong = _wrong_arguments(schema, given)
        try:
            if wrong:
                raise ApiError(400, wrong, "invalid_request")
            if name == "remember":
                text = f"Remembered as {self.notes.add(caller, given['text']).id}."
            elif name == "recall":
                found = self.notes.find(caller, given["query"], given.get("limit", 10))
                text = _listed(found, "No note holds any of those words.")
            elif name == "list_notes":
                text = _listed(self.notes.find(caller, None, given.get("limit", 20)), "No notes are kept yet.")
            else:
                self.notes.delete(caller, given["id"])
                text = f"Forgot {given['id']}."
        except ApiError as e:
            # A tool's failure is the model's to read and act on, not the protocol's.
            return _result(rid, {"content": [{"type": "text", "text": e.message}], "isError": True})
        return _result(rid, {"content": [{"type": "text", "text": text}], "isError": False})

    @staticmethod
    def refusal(e: ApiError) -> bytes:
        """E, a refusal of the request (the key's project, its rate), as the JSON-RPC error an MCP client shows."""
        return _error(None, REFUSED, e.message)


def _an_id(rid) -> bool:
    if isinstance(rid, bool):
        return False
    if isinstance(rid, int):
        return abs(rid) <= ID_MOST
    return isinstance(rid, str) and len(rid) <= 200 and _text(rid)


def _text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _wrong_arguments(schema: dict, given: dict) -> str | None:
    """What is wrong with GIVEN for a tool's input SCHEMA (its own few rules: required, types, no others)."""
    properties = schema["properties"]
    for name in schema.get("required", ()):
        if name not in given:
            return f"{name} is required."
    for name, value in given.items():
        rule = properties.get(name)
        if rule is None:
            return f"{name[:60]!r} is not an argument of this tool; it takes {', '.join(properties)}."
        if rule["type"] == "string" and not isinstance(value, str):
            return f"{name} must be a string."
        if rule["type"] == "integer" and (isinstance(value, bool) or not isinstance(value, int)):
            return f"{name} must be a whole number."
    return None


def _listed(notes: list[memory.Note], none: str) -> str:
    if not notes:
        return none
    return "\n\n".join(f"[{n.id}] {n.text}" for n in notes)


def _result(rid, value: dict) -> bytes:
    # ASCII escapes: what a note or a request said goes out whatever it holds.
    return json.dumps({"jsonrpc": "2.0", "id": rid, "result": value}).encode()


def _error(rid, code: int, message: str) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message}}).encode()
