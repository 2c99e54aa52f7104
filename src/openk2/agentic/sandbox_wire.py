"""The wire between the judge and the candidate sandbox: length-prefixed JSON frames of plain, typed values.

A value crosses as JSON with tags for what JSON lacks: `{"$": "tuple" | "set" | "frozenset" | "dict" |
"bytes" | "complex" | "float" | "int" | "ref", ...}`; lists, strings, finite floats, small ints, booleans and
None are themselves. `decode` builds only built-in types (a dict's pairs, a set's items and so on are decoded
the same way), so whatever the candidate sends, the judge compares plain objects with its own `==`: a
candidate object never reaches the judge, only a `ref` (an opaque handle the judge can call or read an
attribute of, never compare by value).

Standard library only: both sandboxed runners (started by path) import this file.
"""

from __future__ import annotations

import json
import math
import os
import struct

MAX_FRAME_BYTES = 32 << 20
_MAX_DEPTH = 200
_HEADER = struct.Struct(">I")


class WireError(RuntimeError):
    """The other side closed the channel or sent something that is not a well-formed frame."""


def send(fd: int, message: dict) -> None:
    """Write one frame (header + JSON) to `fd`."""
    data = json.dumps(message, allow_nan=False, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit")
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise WireError("the other process closed the channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(fd: int) -> dict:
    """Read one frame from `fd`; WireError on EOF, oversize or anything but a JSON object."""
    (size,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise WireError(f"frame of {size} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        message = json.loads(_read_exactly(fd, size))
    except (ValueError, RecursionError) as exc:
        raise WireError(f"malformed frame: {type(exc).__name__}") from exc
    if type(message) is not dict:
        raise WireError("a frame must hold a JSON object")
    return message


def encode(value: object, refs: list | None = None, depth: int = 0) -> object:
    """The JSON form of `value`; objects that are not plain data become refs appended to `refs` (or TypeError)."""
    if depth > _MAX_DEPTH:
        raise ValueError("value nested too deeply to send")
    if value is None or type(value) in (bool, str):
        return value
    if isinstance(value, str):
        return str.__str__(value)  # a str subclass crosses as its plain characters, never as itself
    if isinstance(value, int):
        number = int.__index__(value)
        return number if number.bit_length() < 4000 else {"$": "int", "v": format(number, "x")}
    if isinstance(value, float):
        number = float.__float__(value)
        return number if math.isfinite(number) else {"$": "float", "v": repr(number)}
    if isinstance(value, complex):
        return {"$": "complex", "v": [encode(value.real), encode(value.imag)]}
    if isinstance(value, (bytes, bytearray)):
        return {"$": "bytes", "v": bytes(value).hex()}
    down = depth + 1
    if isinstance(value, list):
        return [encode(v, refs, down) for v in list.__iter__(value)]
    if isinstance(value, tuple):
        return {"$": "tuple", "v": [encode(v, refs, down) for v in tuple.__iter__(value)]}
    if isinstance(value, (set, frozenset)):
        kind = "frozenset" if isinstance(value, frozenset) else "set"
        return {"$": kind, "v": [encode(v, refs, down) for v in list(value)]}
    if isinstance(value, dict):
        return {"$": "dict", "v": [[encode(k, refs, down), encode(v, refs, down)] for k, v in dict.items(value)]}
    if refs is None:
        raise TypeError(f"{type(value).__name__} is not plain data")
    refs.append(value)
    return {"$": "ref", "id": len(refs) - 1, "type": type(value).__name__[:100]}


def decode(data: object, make_ref=None, depth: int = 0) -> object:
    """Built-in objects from the JSON form; `make_ref(id, type_name)` builds handles (None: refs refused)."""
    if depth > _MAX_DEPTH:
        raise WireError("value nested too deeply")
    kind = type(data)
    if data is None or kind in (bool, str, int, float):
        return data
    down = depth + 1
    if kind is list:
        return [decode(v, make_ref, down) for v in data]
    if kind is not dict or type(data.get("$")) is not str:
        raise WireError(f"unexpected {kind.__name__} in a value")
    tag, body = data["$"], data.get("v")
    if tag == "ref" and make_ref is not None and type(data.get("id")) is int:
        return make_ref(data["id"], str(data.get("type", "object")))
    if tag in ("tuple", "set", "frozenset") and type(body) is list:
        items = [decode(v, make_ref, down) for v in body]
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
    if tag == "dict" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
        return {decode(k, make_ref, down): decode(v, make_ref, down) for k, v in body}
    if tag == "bytes" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "int" and type(body) is str:
        return int(body, 16)
    if tag == "float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "complex" and type(body) is list and len(body) == 2:
        real, imag = (decode(v, None, down) for v in body)
        if type(real) is float and type(imag) is float:
            return complex(real, imag)
    raise WireError(f"malformed {tag!r} value")
