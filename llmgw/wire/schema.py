"""What every channel's messages share: a schema held as data, and the encoding and checking that hold a message to it.

A channel (agents, the accountant) describes each message type as
{field: (type, required)}. A type is a JSON type's name ("str", "int",
"number", "bool", "object", "array"), checked one level deep, or one of the
shapes below (`Int`, `Num`, `Str`, `Nullable`, `Either`, `Row`, `ListOf`, `MapOf`, `Obj`), checked all
the way down with bounds, for what a peer may not be trusted with: numbers that move money, and the
facts a node reports, which placement compares and pages format. No channel reads NaN or Infinity.
"""

from __future__ import annotations

import dataclasses
import json
import math

_PY_TYPES: dict[str, type | tuple[type, ...]] = {"str": str, "int": int, "number": (int, float), "bool": bool,
                                                 "object": dict, "array": list}


# Where a value is in a message: a string, or (the place above it, an index or ".field"), see `_path`.
Where = str | tuple


class ProtocolError(Exception):
    """A message that cannot be read; it is dropped and logged, never acted on."""


def _path(where: Where) -> str:
    """WHERE as a message names it: a string, or (the path above, an index or ".field") built only when a
    message needs it, since checking a valid message must not pay for formatting every item's path."""
    if isinstance(where, str):
        return where
    above, step = where
    return f"{_path(above)}[{step}]" if isinstance(step, int) else f"{_path(above)}{step}"


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclasses.dataclass(frozen=True)
class Int:
    """A whole number from LOW to HIGH (a boolean is not one)."""
    low: int
    high: int

    def check(self, value, where: Where) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not self.low <= value <= self.high:
            raise ProtocolError(f"{_path(where)} must be an int from {self.low} to {self.high}, not {_shown(value)}")


@dataclasses.dataclass(frozen=True)
class Num:
    """A finite number, whole or not, from LOW to HIGH (a boolean is not one)."""
    low: float
    high: float

    def check(self, value, where: Where) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not self.low <= value <= self.high:
            raise ProtocolError(f"{_path(where)} must be a number from {self.low:g} to {self.high:g}, "
                                f"not {_shown(value)}")


@dataclasses.dataclass(frozen=True)
class Str:
    """A string of at most LONGEST characters, and one of CHOICES when they are given."""
    longest: int
    choices: tuple[str, ...] | None = None

    def check(self, value, where: Where) -> None:
        if not isinstance(value, str) or len(value) > self.longest:
            raise ProtocolError(f"{_path(where)} must be a string of at most {self.longest} characters, "
                                f"not {_shown(value)}")
        if self.choices is not None and value not in self.choices:
            raise ProtocolError(f"{_path(where)} must be one of {', '.join(self.choices)}, not {_shown(value)}")


@dataclasses.dataclass(frozen=True)
class Nullable:
    """OF, or null."""
    of: object

    def check(self, value, where: Where) -> None:
        if value is not None:
            check(value, self.of, where)


@dataclasses.dataclass(frozen=True)
class Either:
    """A value of one of these OPTIONS, the first that fits."""
    options: tuple

    def check(self, value, where: Where) -> None:
        errors = []
        where = _path(where)
        for of in self.options:
            try:
                check(value, of, where)
                return
            except ProtocolError as e:
                errors.append(str(e).removeprefix(f"{where} "))
        raise ProtocolError(f"{where} {' or '.join(errors)}")


@dataclasses.dataclass(frozen=True)
class Row:
    """An array of exactly these items, each of its own type."""
    items: tuple

    def check(self, value, where: Where) -> None:
        if not isinstance(value, list) or len(value) != len(self.items):
            raise ProtocolError(f"{_path(where)} must be an array of {len(self.items)} items, not {_shown(value)}")
        for i, (item, of) in enumerate(zip(value, self.items)):
            check(item, of, (where, i))


@dataclasses.dataclass(frozen=True)
class ListOf:
    """An array of at most LONGEST items, each an ITEM."""
    item: object
    longest: int

    def check(self, value, where: Where) -> None:
        if not isinstance(value, list) or len(value) > self.longest:
            raise ProtocolError(f"{_path(where)} must be an array of at most {self.longest} items, "
                                f"not {_shown(value)}")
        for i, item in enumerate(value):
            check(item, self.item, (where, i))


@dataclasses.dataclass(frozen=True)
class MapOf:
    """A JSON object of at most LONGEST entries, each key a KEY (a `Str`) and each value a VALUE."""
    key: Str
    value: object
    longest: int

    def check(self, value, where: Where) -> None:
        if not isinstance(value, dict) or len(value) > self.longest:
            raise ProtocolError(f"{_path(where)} must be an object of at most {self.longest} entries, "
                                f"not {_shown(value)}")
        for name, item in value.items():
            self.key.check(name, (where, f" key {_shown(name)}"))
            check(item, self.value, (where, f"[{_shown(name)}]"))


@dataclasses.dataclass(frozen=True)
class Obj:
    """A JSON object with these FIELDS ({name: (type, required)}); fields it does not know are let by,
    since a newer peer may have added them."""
    fields: dict

    def check(self, value, where: Where) -> None:
        if not isinstance(value, dict):
            raise ProtocolError(f"{_path(where)} must be an object, not {_shown(value)}")
        for name, (of, required) in self.fields.items():
            if name not in value:
                if required:
                    raise ProtocolError(f"{_path(where)} without {name}")
                continue
            check(value[name], of, (where, f".{name}"))


def check(value, of, where: Where) -> None:
    """Raise ProtocolError unless VALUE is an OF; WHERE names it in the message (see `_path`)."""
    if not isinstance(of, str):
        of.check(value, where)
        return
    if isinstance(value, bool) and of in ("int", "number"):
        raise ProtocolError(f"{_path(where)} must be {of}, not a boolean")
    if not isinstance(value, _PY_TYPES[of]):
        raise ProtocolError(f"{_path(where)} must be {of}, not {type(value).__name__}")


def _no_constant(name: str):
    # Python's json reads NaN and Infinity, which no JSON peer should write: they pass every
    # comparison a bound makes, and break whatever formats them.
    raise ProtocolError(f"not JSON: {name} is not a number JSON has")


# Made once: json.dumps and json.loads given any option build a new encoder or decoder at every call.
_ENCODER = json.JSONEncoder(separators=(",", ":"))
_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def _nested_within(value, deepest: int) -> bool:
    """Whether VALUE's arrays and objects nest at most DEEPEST levels (walked without recursion)."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        inside = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if inside is None:
            continue
        if depth > deepest:
            return False
        pending.extend((child, depth + 1) for child in inside)
    return True


class Schema:
    """One channel: its MESSAGES, the VERSION it writes, the field naming a message's kind, the versions it
    reads (None: any, since fields are only ever added), the largest message it reads, and how deep its
    arrays and objects may nest (None: as deep as the parser goes), for what is kept and written out again
    (a message nested just short of the parser's limit is past the writer's, once stored inside another)."""

    def __init__(self, messages: dict[str, dict[str, tuple[object, bool]]], version: int, kind_field: str = "type",
                 reads: frozenset[int] | None = None, largest: int | None = None, deepest: int | None = None):
        self.messages = messages
        self.version = version
        self.kind_field = kind_field
        self.reads = reads
        self.largest = largest
        self.deepest = deepest

    def encode(self, kind: str, /, **fields) -> bytes:
        """One message, with absent (None) fields left out rather than sent as null."""
        if kind not in self.messages:
            raise ValueError(f"unknown message type {kind!r}")
        body = {"v": self.version, self.kind_field: kind}
        body.update((k, v) for k, v in fields.items() if v is not None)
        return _ENCODER.encode(body).encode()

    def decode(self, data: bytes) -> dict:
        """Parse and check a message; raises ProtocolError saying what is wrong."""
        if self.largest is not None and len(data) > self.largest:
            raise ProtocolError(f"{len(data)} bytes, more than the {self.largest} any message here takes")
        try:
            # As json.loads reads bytes: the encoding found from their first bytes, lone surrogates let by.
            message = _DECODER.decode(data.decode(json.detect_encoding(data), "surrogatepass")
                                      if isinstance(data, (bytes, bytearray)) else data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ProtocolError(f"not JSON: {e}") from None
        except RecursionError:
            raise ProtocolError("not JSON: nested too deeply") from None
        if not isinstance(message, dict):
            raise ProtocolError("not a JSON object")
        if self.deepest is not None and not _nested_within(message, self.deepest):
            raise ProtocolError(f"nested more than {self.deepest} levels deep, which no message here is")
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
