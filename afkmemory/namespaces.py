"""Encode store namespaces (tuples of segments) as strings whose order and prefixes are the tuples'.

A namespace such as ``("users", "u1", "memories")`` is stored in one indexed string column.
Joining segments with a separator (``"users.u1.memories"``) would make ``("a.b",)`` and
``("a", "b")`` the same namespace, and a ``LIKE 'a.b%'`` prefix query would match
``("a.bc",)`` and treat ``%`` and ``_`` inside segments as wildcards.

Instead each segment is escaped, order-preservingly, and terminated by ``"\\x01"``:

- ``"\\x02"`` becomes ``"\\x02\\x03"`` and ``"\\x01"`` becomes ``"\\x02\\x02"``; every other
  character stands for itself (``"\\x00"`` is refused: PostgreSQL text cannot hold it);
- then ``"\\x01"`` is appended.

The terminator is smaller than anything that can follow it inside a segment, so comparing
encodings by code point (``KeyField`` columns: PostgreSQL's ``C`` collation, SQLite's
BINARY, Python's ``<``) orders them exactly as Python orders the tuples, and a tuple
prefix is a string prefix that ends on a segment boundary. A prefix query is therefore a
btree range, ``enc(prefix) <= namespace < enc(prefix)[:-1] + "\\x02"``, with nothing to
escape and no case folding (``querysets.prefix_bounds`` of ``encode_prefix(prefix)``:
its final terminator ``"\\x01"`` becomes ``"\\x02"``).
"""

from __future__ import annotations

import functools
from typing import Any

from .memory.types import MAX_KEY_BYTES, check_text

__all__ = [
    "TERMINATOR",
    "Namespace",
    "check_key",
    "check_namespace",
    "decode",
    "encode",
    "encode_prefix",
]

Namespace = tuple[str, ...]

TERMINATOR = "\x01"
_ESCAPE = "\x02"


def _encode_segment(segment: str) -> str:
    # Escape the escape character first, so the escapes added for "\x01" are not re-escaped.
    return segment.replace(_ESCAPE, "\x02\x03").replace(TERMINATOR, "\x02\x02") + TERMINATOR


def _encode_unchecked(namespace: Namespace) -> str:
    return "".join(_encode_segment(segment) for segment in namespace)


def _check_size(encoded: str, name: str) -> None:
    size = len(encoded.encode("utf-8"))
    if size > MAX_KEY_BYTES:
        raise ValueError(
            f"{name} is {size} bytes in UTF-8 once encoded (escapes and one terminator per segment); "
            f"the limit is {MAX_KEY_BYTES}"
        )


class NamespaceTypeError(TypeError, ValueError):
    """A namespace of the wrong type: a ``TypeError``, and the ``ValueError`` agentflow's stores raise for it."""


def check_namespace(namespace: Any, name: str = "namespace", *, allow_empty: bool = False) -> Namespace:
    """Return ``namespace`` if it is a tuple of non-empty strings that fits a key, else raise.

    ``allow_empty`` admits ``()``, which as a prefix means "every namespace". Raise
    ``NamespaceTypeError`` (a ``TypeError`` and a ``ValueError``) for a non-tuple or a
    non-string segment and ``ValueError`` for an empty namespace, an empty segment, a NUL
    character or an encoding over ``MAX_KEY_BYTES``: code written for agentflow catches
    ``ValueError`` for all of them.
    """
    if not isinstance(namespace, tuple):
        raise NamespaceTypeError(
            f"{name} must be a tuple of strings such as ('users', 'u1'), got {type(namespace).__name__}"
        )
    if not namespace and not allow_empty:
        raise ValueError(f"{name} must have at least one segment, such as ('users',)")
    for index, segment in enumerate(namespace):
        if not isinstance(segment, str):
            raise NamespaceTypeError(f"{name} segment {index} must be a string, got {type(segment).__name__}")
        if not segment:
            raise ValueError(f"{name} segment {index} must not be empty")
        check_text(segment, f"{name} segment {index}")
    _check_size(_encode_unchecked(namespace), name)
    return namespace


def check_key(key: Any, name: str = "key") -> str:
    """Return ``key`` if it is a string without NUL of at most ``MAX_KEY_BYTES`` in UTF-8, else raise."""
    if not isinstance(key, str):
        raise TypeError(f"{name} must be a string, got {type(key).__name__}")
    check_text(key, name)
    size = len(key.encode("utf-8"))
    if size > MAX_KEY_BYTES:
        raise ValueError(f"{name} is {size} bytes in UTF-8; the limit is {MAX_KEY_BYTES}")
    return key


def encode(namespace: Namespace) -> str:
    """Return the stored form of ``namespace`` (checked: see ``check_namespace``).

    An agent asks about the same few namespaces over and over: the checked encodings
    are cached (a bad namespace raises every time and is never cached).
    """
    try:
        return _encode_checked(namespace)
    except TypeError:  # unhashable (a list, say): let the check say what is wrong
        check_namespace(namespace)
        raise


@functools.lru_cache(maxsize=4096)
def _encode_checked(namespace: Namespace) -> str:
    return _encode_unchecked(check_namespace(namespace))


def encode_prefix(prefix: Namespace) -> str:
    """Return the stored form of a namespace prefix; ``()`` encodes to ``""`` (every namespace)."""
    return _encode_unchecked(check_namespace(prefix, "namespace prefix", allow_empty=True))


@functools.lru_cache(maxsize=4096)
def decode(encoded: str) -> Namespace:
    """Return the namespace tuple ``encoded`` stands for (the inverse of ``encode``; cached)."""
    segments: list[str] = []
    current: list[str] = []
    chars = iter(encoded)
    for char in chars:
        if char == TERMINATOR:
            segments.append("".join(current))
            current = []
        elif char == _ESCAPE:
            escaped = next(chars, None)
            if escaped == "\x02":
                current.append(TERMINATOR)
            elif escaped == "\x03":
                current.append(_ESCAPE)
            else:
                raise ValueError(f"malformed encoded namespace {encoded!r}: bad escape")
        else:
            current.append(char)
    if current:
        raise ValueError(f"malformed encoded namespace {encoded!r}: missing final terminator")
    return tuple(segments)
