"""What every channel's messages share: a schema held as data, and the encoding and checking that hold a message to it.

A channel (agents, the accountant) describes each message type as
{field: (type, required)}. A type is a JSON type's name ("str", "int",
"number", "bool", "object", "array"), checked one level deep, or one of the
shapes below (`Int`, `Str`, `Nullable`, `Row`, `ListOf`, `Obj`), checked all the way
down with bounds, for channels where a peer's numbers move money.
"""

from __future__ import annotations

import dataclasses
import json

_PY_TYPES = {"str": str, "int": int, "number": (int, float), "bool": bool, "object": dict, "array": list}


class ProtocolError(Exception):
    """A message that cannot be read; it is dropped and logged, never acted on."""


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclasses.dataclass(frozen=True)
class Int:
    """A whole number from LOW to HIGH (a boolean is not one)."""
    low: int
    high: int

    def check(self, value, where: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not self.low <= value <= self.high:
            raise ProtocolError(f"{where} must be an int from {self.low} to {self.high}, not {_shown(value)}")


@dataclasses.dataclass(frozen=True)
class Str:
    """A string of at most LONGEST characters, and one of CHOICES when they are given."""
    longest: int
    choices: tuple[str, ...] | None = None

    def check(self, value, where: str) -> None:
        if not isinstance(value, str) or len(value) > self.longest:
            raise ProtocolError(f"{where} must be a string of at most {self.longest} characters, not {_shown(value)}")
        if self.choices is not None and value not in self.choices:
            raise ProtocolError(f"{where} must be one of {', '.join(self.choices)}, not {_shown(value)}")


@dataclasses.dataclass(frozen=True)
class Nullable:
    """OF, or null."""
    of: object

    def check(self, value, where: str) -> None:
        if value is not None:
            check(value, self.of, where)


@dataclasses.dataclass(frozen=True)
class Row:
    """An array of exactly these items, each of its own type."""
    items: tuple

    def check(self, value, where: str) -> None:
        if not isinstance(value, list) or len(value) != len(self.items):
            raise ProtocolError(f"{where} must be an array of {len(self.items)} items, not {_shown(value)}")
        for i, (item, of) in enumerate(zip(value, self.items)):
            check(item, of, f"{where}[{i}]")


@dataclasses.dataclass(frozen=True)
class ListOf:
    """An array of at most LONGEST items, each an ITEM."""
    item: object
    longest: int

    def check(self, value, where: str) -> None:
        if not isinstance(value, list) or len(value) > self.longest:
            raise ProtocolError(f"{where} must be an array of at most {self.longest} items, not {_shown(value)}")
        for i, item in enumerate(value):
            check(item, self.item, f"{where}[{i}]")


@dataclasses.dataclass(frozen=True)
class Obj:
    """A JSON object with these FIELDS ({name: (type, required)}); fields it does not know are let by,
    since a newer peer may have added them."""
    fields: dict

    def check(self, value, where: str) -> None:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where} must be an object, not {_shown(value)}")
        for name, (of, required) in self.fields.items():
            if name not in value:
                if required:
                    raise ProtocolError(f"{where} without {name}")
                continue
            check(value[name], of, f"{where}.{name}")


def check(value, of, where: str) -> None:
    """Raise ProtocolError unless VALUE is an OF; WHERE names it in the message."""
    if not isinstance(of, str):
        of.check(value, where)
        return
    if isinstance(value, bool) and of in ("int", "number"):
        raise ProtocolError(f"{where} must be {of}, not a boolean")
    if not isinstance(value, _PY_TYPES[of]):
        raise ProtocolError(f"{where} must be {of}, not {type(value).__name__}")


class Schema:
    """One channel: its MESSAGES, the VERSION it writes, the field naming a message's kind, the versions it
    reads (None: any, since fields are only ever added) and the largest message it reads."""

    def __init__(self, messages: dict[str, dict[str, tuple[object, bool]]], version: int, kind_field: str = "type",
                 reads: frozenset[int] | None = None, largest: int | None = None):
        self.messages = messages
        self.version = version
        self.kind_field = kind_field
        self.reads = reads
        self.largest = largest

    def encode(self, kind: str, /, **fields) -> bytes:
        """One message, with absent (None) fields left out rather than sent as null."""
        if kind not in self.messages:
            raise ValueError(f"unknown message type {kind!r}")
        body = {"v": self.version, self.kind_field: kind}
        body.update((k, v) for k, v in fields.items() if v is not None)
        return json.dumps(body, separators=(",", ":")).encode()

    def decode(self, data: bytes) -> dict:
        """Parse and check a message; raises ProtocolError saying what is wrong."""
        if self.largest is not None and len(data) > self.largest:
            raise ProtocolError(f"{len(data)} bytes, more than the {self.largest} any message here takes")
        try:
            message = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ProtocolError(f"not JSON: {e}") from None
        except RecursionError:
            raise ProtocolError("not JSON: nested too deeply") from None
        if not isinstance(message, dict):
            raise ProtocolError("not a JSON object")
        kind = message.get(self.kind_field)
        schema = self.messages.get(kind) if isinstance(kind, str) else None
        if schema is None:
            raise ProtocolError(f"unknown message type {_shown(kind)}")
        version = message.get("v")
        if isinstance(version, bool) or not isinstance(version, int):
            raise ProtocolError("no protocol version (v)")
        if self.reads is not None and version not in self.reads:
            raise ProtocolError(f"protocol version {_shown(version)} is not one this peer reads "
                                f"({', '.join(map(str, sorted(self.reads)))})")
        for field, (of, required) in schema.items():
            if field not in message:
                if required:
                    raise ProtocolError(f"{kind} without {field}")
                continue
            check(message[field], of, f"{kind}.{field}")
        return message
