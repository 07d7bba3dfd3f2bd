"""Reading a GGUF file's header far enough to know its architecture, and whether llama.cpp loads it.

A GGUF file starts with its metadata: magic, version, counts, then key/value
pairs, `general.architecture` among the first. Reading it takes the first
few kilobytes (a Range request for a remote file), so a model llama.cpp
cannot load is refused before gigabytes are fetched: the lesson of a model
with architecture `ggmlc` that was fetched, catalogued, and then failed on
every node.

Which architectures the installed llama.cpp knows is read from the library
itself: llama.cpp compiles the name of every architecture it supports into
its binary as a string, so a name that is not there is one it cannot load.
When no llama.cpp is found, nothing is vouched for and nothing is refused.
"""

from __future__ import annotations

import functools
import glob
import mmap
import os
import shutil
import struct

MAGIC = b"GGUF"
HEAD_BYTES = 1 << 16  # enough for the keys before general.architecture in every file seen
# GGUF value types: the sizes of the fixed-width ones.
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class NotGGUF(ValueError):
    """The bytes are not a GGUF header (or too few of it were read)."""


_NUMBERS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _entries(head: bytes):
    """Each metadata entry of a GGUF header HEAD, in order: (key, type, value, offset of the value). VALUE is
    the string or number for those types, None for an array. Raises NotGGUF."""
    if head[:4] != MAGIC:
        raise NotGGUF("the file does not start with GGUF")
    version = struct.unpack_from("<I", head, 4)[0]
    if version not in (1, 2, 3):
        raise NotGGUF(f"GGUF version {version} is not one this reader knows")
    wide = version >= 2  # version 1 used 32-bit counts and lengths
    pos = 8
    count_fmt, count_size = ("<Q", 8) if wide else ("<I", 4)
    pos += count_size  # tensor count
    kv_count = struct.unpack_from(count_fmt, head, pos)[0]
    pos += count_size

    def string(at: int) -> tuple[str, int]:
        length = struct.unpack_from(count_fmt, head, at)[0]
        at += count_size
        if at + length > len(head):
            raise NotGGUF("the header is longer than what was read")
        return head[at:at + length].decode("utf-8", "replace"), at + length

    try:
        for _ in range(kv_count):
            key, pos = string(pos)
            kind = struct.unpack_from("<I", head, pos)[0]
            pos += 4
            if kind == _STRING:
                value, end = string(pos)
                yield key, kind, value, pos
                pos = end
            elif kind == _ARRAY:
                item = struct.unpack_from("<I", head, pos)[0]
                n = struct.unpack_from(count_fmt, head, pos + 4)[0]
                yield key, kind, None, pos
                pos += 4 + count_size
                if item == _STRING:
                    for _ in range(n):
                        _, pos = string(pos)
                elif item in _SIZES:
                    pos += _SIZES[item] * n
                else:
                    raise NotGGUF(f"an array of type {item} in the header")
            elif kind in _NUMBERS:
                yield key, kind, struct.unpack_from(_NUMBERS[kind], head, pos)[0], pos
                pos += _SIZES[kind]
            else:
                raise NotGGUF(f"a value of type {kind} in the header")
    except struct.error:
        raise NotGGUF("the header is longer than what was read") from None


def architecture(head: bytes) -> str | None:
    """`general.architecture` from the first bytes of a GGUF file (None when it is not among them)."""
    for key, _, value, _ in _entries(head):
        if key == "general.architecture":
            return value
    return None


def shape(head: bytes) -> dict[str, int | str]:
    """What sizes a model's memory from the first bytes of a GGUF file: `architecture`, and as found
    `context_length`, `block_count`, `embedding_length`, `head_count`, `head_count_kv`, `key_length`
    (its ARCH.* keys, which come before the tokenizer's long arrays). Reading stops where the bytes
    read end; what was not reached is left out. Raises NotGGUF for what is no GGUF header."""
    found: dict[str, int | str] = {}
    wanted = {"context_length": "context_length", "block_count": "block_count",
              "embedding_length": "embedding_length", "attention.head_count": "head_count",
              "attention.head_count_kv": "head_count_kv", "attention.key_length": "key_length"}
    try:
        for key, _, value, _ in _entries(head):
            if key == "general.architecture" and isinstance(value, str):
                found["architecture"] = value
            elif "architecture" in found and key.startswith(f"{found['architecture']}.") and isinstance(value, int):
                name = wanted.get(key[len(str(found["architecture"])) + 1:])
                if name:
                    found[name] = value
    except NotGGUF:
        if "architecture" not in found:
            raise
    return found


def context_length(head: bytes) -> int | None:
    """The context the model was trained for (`ARCH.context_length`) from the first bytes of a GGUF file; None
    when it is not among them."""
    found = _context_entry(head)
    return found and found[0]


def _context_entry(head: bytes) -> tuple[int, int, int] | None:
    """(`ARCH.context_length`, its type, the offset of its value), or None."""
    arch = None
    for key, kind, value, offset in _entries(head):
        if key == "general.architecture":
            arch = value
        elif arch is not None and key == f"{arch}.context_length" and isinstance(value, int):
            return value, kind, offset
    return None


def raise_context_length(path: str, tokens: int) -> int:
    """Write TOKENS as the context the GGUF file at PATH says it was trained for, in place; returns what it
    said before. llama.cpp holds each slot to that figure whatever --ctx-size asks; this is how a model is
    made to take longer prompts than it was trained on (at some cost in quality far past it)."""
    with open(path, "r+b") as f:
        head = f.read(HEAD_BYTES)
        found = _context_entry(head)
        if found is None:
            raise NotGGUF(f"{path} says no context length in its first {HEAD_BYTES} bytes")
        before, kind, offset = found
        f.seek(offset)
        f.write(struct.pack(_NUMBERS[kind], tokens))
    return before


def read_head(source: str, urlopen=None) -> bytes | None:
    """The first HEAD_BYTES of a file, a path or a URL (a Range request, made with URLOPEN when given: the
    mirror's checks where it may connect); None when they cannot be read."""
    import urllib.error
    import urllib.request

    if not source.startswith(("http://", "https://")):
        try:
            with open(source, "rb") as f:
                return f.read(HEAD_BYTES)
        except OSError:
            return None
    req = urllib.request.Request(source, headers={"Range": f"bytes=0-{HEAD_BYTES - 1}"})
    try:
        with (urlopen or urllib.request.urlopen)(req, timeout=30) as resp:
            return resp.read(HEAD_BYTES)
    except urllib.error.HTTPError as e:
        e.close()
        return None
    except OSError:
        return None


def refusal(source: str, library: bytes | None = None, urlopen=None) -> str | None:
    """Why llama.cpp could not load the GGUF at SOURCE, or None (not a GGUF, unreadable, or loadable:
    a header that cannot be read refuses nothing). URLOPEN as for `read_head`."""
    head = read_head(source, urlopen)
    if head is None:
        return None
    try:
        arch = architecture(head)
    except NotGGUF as e:
        return f"it is not a GGUF file llama.cpp can read: {e}"
    if arch and loadable(arch, library) is False:
        return f"it is a {arch!r} model, an architecture the installed llama.cpp cannot load"
    return None


def _llamacpp_binaries() -> list[str]:
    found = []
    server = shutil.which("llama-server")
    if server:
        real = os.path.realpath(server)
        found.append(real)
        found += glob.glob(os.path.join(os.path.dirname(real), "libllama*.so*"))
    try:
        import xllamacpp

        found += glob.glob(os.path.join(os.path.dirname(xllamacpp.__file__), "*.so"))
    except ImportError:
        pass
    return found


@functools.lru_cache(maxsize=512)
def _known(arch: str) -> bool | None:
    """Whether ARCH's name is in the installed llama.cpp's files, each searched in place (mapped, never read
    into memory: they are tens of megabytes, and a gateway worker asks for a page); None without any."""
    needle, searched = _needle(arch), False
    for path in _llamacpp_binaries():
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                searched = True
                if data.find(needle) != -1:
                    return True
        except (OSError, ValueError):  # unreadable, or empty (nothing to map)
            continue
    return False if searched else None


def loadable(arch: str, library: bytes | None = None) -> bool | None:
    """Whether the installed llama.cpp knows ARCH (or LIBRARY's bytes name it): True, False, or None when no
    llama.cpp is found."""
    if library is not None:
        return _needle(arch) in library
    return _known(arch)


def _needle(arch: str) -> bytes:
    """What ARCH's name looks like in llama.cpp's files: its characters and the string's end. Not a NUL before
    it: the linker merges a string into the tail of a longer one that ends the same, and `qwen2` is stored
    only as the end of `rwkv6qwen2`, so every Qwen2 model was refused. A name that is the tail of another is
    let through; the gate is for names llama.cpp has never heard of."""
    return arch.encode() + b"\0"
