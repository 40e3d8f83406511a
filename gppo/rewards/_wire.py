"""What crosses the code sandbox's process boundary, and how (design: docs/sandbox.md).

Messages are JSON objects framed by an 8-byte big-endian length. Values inside them are plain
data by value, in a tagged format of our own: every value is a JSON array `[tag, ...]`, and only
these exact types cross (a subclass, an object of the program's own class, a cycle: `NotPlain`):
None, bool, int (hex text: exact at any size), float (hex text: exact, with inf and nan), complex,
str, bytes, list, tuple, dict, set, frozenset, and collections' Counter, OrderedDict and deque;
any other iterator crosses as its items and arrives as an iterator over them. `decode` builds
only these types from the text, so nothing the sender chose can run where it is read. Standard
library only: the sandboxed side loads this file too.
"""

import collections
import json
import os

# LeetCode/HumanEval-style code uses these names (`List[int]`) without importing them; assert
# tests see them too.
PRELUDE = "from typing import *\nimport collections, heapq, bisect, math, itertools, functools\n"

MAX_DEPTH = 200


def cpu_seconds(timeout_s: float) -> int:
    """The program's CPU-time limit (RLIMIT_CPU) under a wall-clock limit of `timeout_s`: a backstop
    a whole second past it. The program's process spends CPU time before its clock starts (a pool
    server's fork sets up first), so with equal limits a busy loop was sometimes stopped by the CPU
    limit instead, and said so."""
    return int(-(-timeout_s // 1)) + 1  # ceil in integers: `math.ceil` was missing on the sandboxed side


class NotPlain(TypeError):
    """A value outside the plain-data format."""


class ChannelClosed(EOFError):
    """The other side closed the channel or sent a frame that is not a message."""


_SCALARS = {
    type(None): lambda v: ["none"],
    bool: lambda v: ["bool", v],
    int: lambda v: ["int", hex(v)],
    float: lambda v: ["float", v.hex()],
    complex: lambda v: ["complex", v.real.hex(), v.imag.hex()],
    str: lambda v: ["str", v],
    bytes: lambda v: ["bytes", v.hex()],
}
_SEQUENCES = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset", collections.deque: "deque"}
_MAPPINGS = {dict: "dict", collections.Counter: "Counter", collections.OrderedDict: "OrderedDict"}
_BUILD_SEQUENCE = {tag: cls for cls, tag in _SEQUENCES.items()} | {"iter": lambda items: iter(list(items))}
_BUILD_MAPPING = {tag: (lambda pairs, cls=cls: cls(dict(pairs))) for cls, tag in _MAPPINGS.items()}


def tag(value, depth: int = 0, active: frozenset = frozenset()) -> list:
    """The tagged form of `value`; `NotPlain` names what is not plain data."""
    cls = type(value)
    if cls in _SCALARS:
        return _SCALARS[cls](value)
    if depth >= MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH} levels")
    if id(value) in active:
        raise NotPlain(f"a {cls.__name__} that contains itself")
    inner = active | {id(value)}
    if cls in _MAPPINGS:
        return [_MAPPINGS[cls], [[tag(k, depth + 1, inner), tag(v, depth + 1, inner)] for k, v in value.items()]]
    if cls in _SEQUENCES:
        return [_SEQUENCES[cls], [tag(v, depth + 1, inner) for v in value]]
    if hasattr(cls, "__next__") and hasattr(cls, "__iter__"):
        return ["iter", [tag(v, depth + 1, inner) for v in value]]
    raise NotPlain(f"a {cls.__module__}.{cls.__qualname__} object is not plain data")


def untag(node, depth: int = 0):
    """The value of a tagged form; `NotPlain` when `node` is not one."""
    if type(node) is not list or not node or type(node[0]) is not str:
        raise NotPlain(f"not a tagged value: {str(node)[:80]}")
    if depth >= MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH} levels")
    kind, rest = node[0], node[1:]
    try:
        if kind == "none" and not rest:
            return None
        if kind == "bool" and len(rest) == 1 and type(rest[0]) is bool:
            return rest[0]
        if kind == "str" and len(rest) == 1 and type(rest[0]) is str:
            return rest[0]
        if kind in ("int", "float", "bytes") and len(rest) == 1 and type(rest[0]) is str:
            text = rest[0]
            return int(text, 16) if kind == "int" else float.fromhex(text) if kind == "float" else bytes.fromhex(text)
        if kind == "complex" and len(rest) == 2 and all(type(x) is str for x in rest):
            return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
        if len(rest) == 1 and type(rest[0]) is list:
            if kind in _BUILD_SEQUENCE:
                return _BUILD_SEQUENCE[kind](untag(item, depth + 1) for item in rest[0])
            if kind in _BUILD_MAPPING:
                pairs = []
                for pair in rest[0]:
                    if type(pair) is not list or len(pair) != 2:
                        raise NotPlain("a mapping entry is not a [key, value] pair")
                    pairs.append((untag(pair[0], depth + 1), untag(pair[1], depth + 1)))
                return _BUILD_MAPPING[kind](pairs)
    except (ValueError, TypeError, OverflowError) as e:  # bad number text, an unhashable key
        raise NotPlain(f"a malformed {kind!r} value ({e})") from None
    raise NotPlain(f"not a tagged value: {str(node)[:80]}")


def send(fd: int, message: dict) -> None:
    """Write one framed message (all of it: a pipe may take it in parts)."""
    data = json.dumps(message).encode()
    view = memoryview(len(data).to_bytes(8, "big") + data)
    while view:
        view = view[os.write(fd, view) :]


def receive(fd: int, limit: int) -> dict:
    """Read one framed message of at most `limit` bytes; `ChannelClosed` when there is none."""
    size = int.from_bytes(_read_exactly(fd, 8), "big")
    if size > limit:
        raise ChannelClosed(f"a message of {size} bytes, over the limit of {limit}")
    try:
        message = json.loads(_read_exactly(fd, size))
    except (ValueError, RecursionError) as e:
        raise ChannelClosed(f"a message that is not JSON ({str(e)[:80]})") from None
    if type(message) is not dict:
        raise ChannelClosed("a message that is not a JSON object")
    return message


def record(fd: int, entry: dict) -> None:
    """Append one line to a call's status file, which only the trusted side writes (the bootstrap,
    or a pool's server) and the caller reads: `{"setup": ...}` once the program's process is
    ready, then `{"outcome": ..., "exit": {"code", "timed_out"}}`."""
    os.write(fd, (json.dumps(entry) + "\n").encode())


def _read_exactly(fd: int, size: int) -> bytes:
    parts, left = [], size
    while left:
        part = os.read(fd, min(left, 1 << 20))
        if not part:
            raise ChannelClosed("the channel was closed")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)
