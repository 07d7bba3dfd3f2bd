"""Kept conversations on the request path: a thread's history put before a request's new turn, and the turn
with its answer kept once the answer is whole.

A client names its thread in `x-llmgw-thread` and sends only its new turn, in any of the chat APIs (chat
completions, Responses, Messages: each reaches here as a chat-completions request). Only a project that
keeps conversations may (`llmgw keys threads`, pushed to workers with the keys); any other request naming
one is refused, saying how to turn them on, rather than served without its history. A personal key keeps
none. The store is read once before admission, so limits, the guard and billing see the whole prompt the
engine will see, and written once the answer is whole: for a whole answer before it is sent, for a stream
before its last event goes out, so a client's next turn always finds this one.

Where the history does not fit the model's context with the new turn and the room asked for the answer,
its oldest turns are left out of this request (kept in the store), the system messages are always sent,
and the answer says how many turns were left out in `X-Llmgw-Thread-Dropped`. Sizes are estimated from
bytes, as a request's prompt is before an engine counts it (llmgw/gateway/promptcount.py).

This is the one place the request path touches the store, and only for requests that name a thread: on
SQLite in threads of its own (sqlite3 does not yield to gevent; llmgw/gateway/offloop.py), on PostgreSQL
on the loop, cooperatively (greendb.py). What it costs is measured in bench/threads.py.
"""

from __future__ import annotations

import json
import logging
import re

import sqlalchemy as sa
from gevent.threadpool import ThreadPool

from llmgw import conversations
from llmgw.gateway import apirequest, chatout, promptcount
from llmgw.gateway.dialect import encode
from llmgw.gateway.errors import ApiError

log = logging.getLogger("llmgw.threads")

HEADER = "HTTP_X_LLMGW_THREAD"
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{24}")  # the ids this gateway gives responses (chatout.new_id)
DROPPED = "X-Llmgw-Thread-Dropped"
PATH = "/v1/threads/"
SYSTEM_ROLES = ("system", "developer")
# Threads a worker's SQLite reads and writes run in: a few, so that one request's thread does not wait
# behind another's, nor behind the usage flush (which has its own).
STORE_THREADS = 4
HOW_TO_TURN_ON = ("An operator turns conversations on for a project with `llmgw keys threads --project P "
                  "--retain-hours N`; until then, send the whole conversation without x-llmgw-thread.")


class Turn:
    """One request's part in a thread: where it is kept, what it adds, and how much history it was sent with."""

    __slots__ = ("scope", "thread_id", "hours", "system", "messages", "dropped", "kept", "response_id", "after",
                 "fork")

    def __init__(self, scope: str, thread_id: str, hours: float, system: list | None, messages: list, dropped: int):
        self.scope = scope
        self.thread_id = thread_id
        self.hours = hours
        self.system = system  # the system messages the request sent, which replace the thread's; None: none
        self.messages = messages  # the client's new messages, less its system messages
        self.dropped = dropped  # the oldest turns left out of this request
        self.kept = False  # kept already, or not to be (a Responses request with store false)
        self.response_id: str | None = None  # a Responses request's response id, kept with the turn
        self.after: int | None = None  # the turn it continues from (previous_response_id)
        self.fork: str | None = None  # the thread it goes on in, where its thread went on past `after`

    def headers(self) -> list[tuple[str, str]]:
        return [(DROPPED, str(self.dropped))] if self.dropped else []


class Threads:
    def __init__(self, runtime, prefix_bytes: int):
        self.rt = runtime
        self.engine = runtime.engine
        self.prefix_bytes = prefix_bytes
        self.max_body = runtime.cfg["gateway.max_body_bytes"]
        self.pool = ThreadPool(STORE_THREADS) if self.engine.dialect.name == "sqlite" else None

    def run(self, job, *args):
        """JOB(*ARGS) where it cannot stall the loop (see the top of the module); raises ApiError(503) where
        the store fails it."""
        try:
            return job(*args) if self.pool is None else self.pool.apply(job, args)
        except sa.exc.SQLAlchemyError as e:
            log.warning("the store failed a kept conversation's or note's request: %s", e)
            raise ApiError(503, "The store that keeps conversations and notes cannot be reached now. Retry "
                                "shortly; an operator can find why in the gateway's log.", "store_unavailable",
                           retry_after=5) from None

    def kept_for(self, caller) -> float | None:
        """Hours CALLER's project keeps its conversations; None where it keeps none (a personal key's)."""
        return self.rt.keys.threads.get(caller.project_id) if caller.project_id is not None else None

    def scope(self, caller, asked: str = "x-llmgw-thread") -> tuple[str, float]:
        """The project CALLER's conversations are kept in and for how many hours; raises ApiError(403) where it
        keeps none, naming what the request ASKED with."""
        if caller.project_id is None:
            raise ApiError(403, "A personal key keeps no conversations: they belong to a project. Use a key of a "
                                "project that keeps them. " + HOW_TO_TURN_ON.replace("x-llmgw-thread", asked),
                           "threads_need_project")
        hours = self.kept_for(caller)
        if hours is None:
            raise ApiError(403, f"This key's project keeps no conversations, so {asked} cannot be used. "
                                + HOW_TO_TURN_ON.replace("x-llmgw-thread", asked), "threads_off")
        return caller.project_id, hours

    def join(self, ex, thread_id: str) -> None:
        """Put the history of the thread THREAD_ID before EX's request, its new turn (EX.turn, kept once
        answered); raises ApiError where the request may not name one."""
        req = ex.req
        if req.kind not in ("chat", "tokens"):
            raise ApiError(400, "x-llmgw-thread names a conversation, which only chat requests have (chat "
                                "completions, Responses, Messages). Leave it out of this request.", "invalid_request")
        if not conversations.THREAD_ID.fullmatch(thread_id):
            raise ApiError(400, f"x-llmgw-thread must be 1 to 128 letters, digits and . _ : - (got "
                                f"{thread_id[:40]!r}{'...' if len(thread_id) > 40 else ''}).", "invalid_thread_id")
        if (req.body.get("n") or 1) > 1:
            raise ApiError(400, "A kept conversation keeps one answer a turn: ask for n = 1 with x-llmgw-thread.",
                           "invalid_request", "n")
        if getattr(req, "previous", None) is not None:
            raise ApiError(400, "Name the conversation once: x-llmgw-thread or previous_response_id, not both.",
                           "invalid_request", "previous_response_id")
        scope, hours = self.scope(ex.caller)
        history = self.run(conversations.read, self.engine, scope, thread_id, hours, None, None, self.max_body)
        ex.turn = self.prepend(ex, scope, thread_id, hours, history)
        if req.kind == "tokens":
            ex.turn.kept = True  # counted with its history, and nothing generated to keep
        elif req.api == "responses":
            ex.turn.response_id = req.rid
            req.stored()  # a thread keeps every turn: its response with it, whatever `store` said

    def join_responses(self, ex) -> None:
        """A Responses request that names no thread: continued from its `previous_response_id` (raises
        ApiError where that cannot be), and kept where it asks to be (`store`, true unless false) and its
        key's project keeps conversations; otherwise its response says `store: false`."""
        req = ex.req
        if req.previous is None:
            hours = self.kept_for(ex.caller) if req.store else None
            if hours is not None:
                ex.turn = self.prepend(ex, ex.caller.project_id, conversations.CHAIN + req.rid, hours, None)
                ex.turn.response_id = req.rid
                req.stored()
            return
        scope, hours = self.scope(ex.caller, "previous_response_id")
        # An id of another shape was never one of ours: not found, without asking the store.
        found = (self.run(conversations.find_response, self.engine, scope, req.previous, hours)
                 if RESPONSE_ID.fullmatch(req.previous) else None)
        history = (self.run(conversations.read, self.engine, scope, found.thread_id, hours, None, found.seq,
                            self.max_body) if found is not None else None)
        if found is None or history is None:
            raise ApiError(400, f"Previous response with id {req.previous[:64]!r} not found: it was never stored for "
                                "this key's project, was deleted, or is older than the project keeps them.",
                           "previous_response_not_found", "previous_response_id")
        ex.turn = turn = self.prepend(ex, scope, found.thread_id, hours, history)
        turn.response_id, turn.after, turn.fork = req.rid, found.seq, conversations.CHAIN + req.rid
        if req.store:
            req.stored()
        else:
            turn.kept = True  # continued from, not kept

    def prepend(self, ex, scope: str, thread_id: str, hours: float, history) -> Turn:
        """EX's request with HISTORY (conversations.History, or None) before its messages, the oldest turns
        left out where all would not fit the model's context; the turn it makes."""
        req, model = ex.req, ex.model
        messages = req.body["messages"]
        system = [m for m in messages if m.get("role") in SYSTEM_ROLES]
        new = [m for m in messages if m.get("role") not in SYSTEM_ROLES]
        sent_system = system or (history.system if history is not None else None) or []
        turns = history.turns if history is not None else []
        dropped = 0
        if turns and model.max_context:
            room = model.max_context - (req.max_tokens or 0) - _tokens(sent_system) - _tokens(new)
            held = sum(t.tokens for t in turns)
            while dropped < len(turns) and held > room:
                held -= turns[dropped].tokens
                dropped += 1
        while dropped < len(turns) and not _starts_an_exchange(turns[dropped]):
            dropped += 1  # a tool's result without its call (the turn before, left out) would stand alone
        if turns or sent_system is not system:
            replay = [m for t in turns[dropped:] for m in t.messages]
            req.body = {**req.body, "messages": sent_system + replay + new}
            req.raw = encode(req.body)
            if self.prefix_bytes:
                apirequest.conversation_key(req, self.prefix_bytes)
        left_out = dropped + (history.left_out if history is not None else 0)
        return Turn(scope, thread_id, hours, system or None, new, left_out)

    def answer(self, ex, data: bytes) -> dict | None:
        """The message to keep of DATA, EX's whole chat answer; None where nothing is to be kept."""
        if ex.turn is None or ex.turn.kept:
            return None
        try:
            return answer_message(data)
        except ApiError as e:  # an answer that is not one: the dialect's 502 says so to the client
            log.warning("a kept conversation's answer could not be read, so its turn is not kept: %s", e)
            return None

    def keep(self, ex, answer: dict, response: bytes | None = None) -> None:
        """Keep EX's turn with ANSWER, the assistant's message, and RESPONSE, the Responses API's object for
        it. A store that fails costs the turn, not the answer: the client has it, and the log says the
        thread lost a turn."""
        turn = ex.turn
        if turn.kept:
            return
        turn.kept = True
        if turn.scope not in self.rt.keys.threads:
            return  # the project stopped keeping conversations while this turn was answered
        if ex.req.forced_tool is not None:
            # The engine wrote the forced tool's arguments as its text; the client was given a call of it.
            answer = {"role": "assistant", "content": None, "tool_calls": [{
                "id": ex.req.forced_call_id, "type": "function",
                "function": {"name": ex.req.forced_tool["name"], "arguments": answer.get("content") or "{}"}}]}
        messages = turn.messages + [answer]
        try:
            kept = response.decode("utf-8", "replace") if response is not None and turn.response_id else None
            self.run(conversations.append, self.engine, turn.scope, turn.thread_id, turn.hours, turn.system,
                     messages, _tokens(messages), turn.response_id, kept, turn.after, turn.fork)
        except Exception:
            log.exception("a turn of a kept conversation could not be stored; the thread goes on without it")

    def keeper(self, ex, translator) -> "Keeper":
        """What gathers EX's streamed answer and keeps it with its turn (nothing, where it names no thread);
        TRANSLATOR: the stream's, whose finished response object a Responses turn keeps."""
        return Keeper(self if ex.turn is not None and not ex.turn.kept else None, ex, translator)

    def stored(self, caller, response_id: str, delete: bool = False) -> bytes | dict:
        """`GET /v1/responses/ID` (the response object as it was answered) or, with DELETE, `DELETE`; raises
        ApiError(404) where CALLER's project has no such response kept, another project's alike."""
        hours = self.kept_for(caller)
        scope = caller.project_id
        if not RESPONSE_ID.fullmatch(response_id) or scope is None:
            pass  # never one of ours, or a personal key's: not found, without asking the store
        elif delete:
            if self.run(conversations.delete_response, self.engine, scope, response_id, hours or 0):
                return {"id": response_id, "object": "response", "deleted": True}
        elif hours is not None:
            found = self.run(conversations.find_response, self.engine, scope, response_id, hours)
            if found is not None and found.response is not None:
                return found.response.encode()
        raise ApiError(404, f"Response with id {response_id[:64]!r} not found: it was never stored for this key's "
                            "project, was deleted, or is older than the project keeps them.", "response_not_found")

    def delete(self, caller, thread_id: str) -> dict:
        """`DELETE /v1/threads/ID`: the thread and its turns gone now; raises ApiError(404) where CALLER's
        project has no such thread (another project's included, alike)."""
        if caller.project_id is None:
            raise ApiError(403, "A personal key keeps no conversations, so it has none to delete.",
                           "threads_need_project")
        # A project that stopped keeping conversations still deletes what it kept, which reads as gone.
        if not conversations.THREAD_ID.fullmatch(thread_id) or not self.run(
                conversations.delete, self.engine, caller.project_id, thread_id, self.kept_for(caller) or 0):
            raise ApiError(404, f"No conversation {thread_id[:128]!r} is kept for this key's project.",
                           "thread_not_found")
        return {"id": thread_id, "object": "thread.deleted", "deleted": True}


def _starts_an_exchange(turn) -> bool:
    """Whether TURN can begin a replayed history: it opens with the client's word, not a tool's result or
    an answer."""
    return not turn.messages or turn.messages[0].get("role") not in ("tool", "assistant")


def _tokens(messages: list) -> int:
    return promptcount.estimate(json.dumps(messages, ensure_ascii=False).encode("utf-8", "surrogatepass"))


def answer_message(data: bytes) -> dict:
    """The assistant's message of DATA, an engine's whole chat answer, as a thread keeps it."""
    return _kept(chatout.whole(data).message)


def _kept(message: dict) -> dict:
    """What a thread keeps of an assistant's message: its text and tool calls, which any model is sent
    again; not its reasoning, which chat templates leave out of earlier turns."""
    kept: dict = {"role": "assistant", "content": message.get("content") if isinstance(message.get("content"), str)
                  else None}
    calls = [c for c in chatout.a_list(message.get("tool_calls")) if isinstance(c, dict)]
    if calls:
        kept["tool_calls"] = [{"id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}}
                              for call in map(chatout.call, calls)]
    return kept


class Keeper:
    """A streamed answer gathered from the engine's events into the message a thread keeps, and kept once
    whole. A request that keeps nothing gets one that does nothing, so the stream's loop has no branch for
    it."""

    __slots__ = ("threads", "ex", "translator", "text", "calls", "finished")

    def __init__(self, threads: Threads | None, ex, translator):
        self.threads = threads
        self.ex = ex
        self.translator = translator
        self.text: list[str] = []
        self.calls: dict[int, list] = {}  # by index: [id, name, arguments pieces]
        self.finished = False  # `[DONE]` or a finish reason was seen

    def gather(self, events: bytes) -> None:
        """Gather EVENTS, whole engine events."""
        if self.threads is None or not events:
            return
        for chunk in chatout.chunks(events):
            if chunk is None:
                self.finished = True
                continue
            for choice, delta in chatout.deltas(chunk):
                self.text.append(chatout.a_string(delta.get("content")))
                for piece in chatout.a_list(delta.get("tool_calls")):
                    if isinstance(piece, dict):
                        call = chatout.call(piece)
                        held = self.calls.setdefault(call.index, ["", "", []])
                        held[0] = held[0] or call.id
                        held[1] = held[1] or call.name
                        held[2].append(call.arguments)
                if choice.get("finish_reason"):
                    self.finished = True

    def keep(self, whole: bool) -> None:
        """Keep the turn now where WHOLE says the answer is (its `[DONE]` was gathered, or the stream ended):
        before what holds its end goes out. A stream that ended with neither `[DONE]` nor a finish reason was
        cut, and is not kept."""
        if self.threads is None or not whole or not self.finished:
            return
        inner = getattr(self.translator, "inner", self.translator)  # a forced call's wraps the dialect's
        self.threads.keep(self.ex, self.message(), getattr(inner, "final", None))
        self.threads = None

    def message(self) -> dict:
        return _kept({"content": "".join(self.text) or None, "tool_calls": [
            {"index": i, "id": call_id, "function": {"name": name, "arguments": "".join(pieces)}}
            for i, (call_id, name, pieces) in sorted(self.calls.items())]})
