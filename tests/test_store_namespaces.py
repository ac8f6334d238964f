"""The namespace encoding: lossless, order-preserving, and prefixes are code-point ranges."""

from __future__ import annotations

import random

import pytest

from afkmemory.namespaces import check_namespace, decode, encode, encode_prefix
from afkmemory.querysets import prefix_bounds

#: Characters next to the escape and terminator codes, separators, wildcards, case, non-ASCII.
ALPHABET = ["\x01", "\x02", "\x03", "\x04", "a", "b", "A", ".", "/", "%", "_", "\\", "é", "\U0001f600", "\uffff"]


def random_namespace(rng: random.Random, *, min_segments: int = 1) -> tuple[str, ...]:
    return tuple(
        "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(min_segments, 3))
    )


def extends_by_range(namespace: tuple[str, ...], prefix: tuple[str, ...]) -> bool:
    encoded = encode_prefix(prefix)
    if not encoded:
        return True
    low, high = prefix_bounds(encoded)
    return low <= encode(namespace) < high


@pytest.mark.parametrize("seed", range(5))
def test_encoding_round_trips_and_sorts_like_the_tuples(seed):
    rng = random.Random(seed)
    namespaces = list({random_namespace(rng) for _ in range(400)})
    assert all(decode(encode(ns)) == ns for ns in namespaces)
    assert sorted(namespaces, key=encode) == sorted(namespaces)
    assert len({encode(ns) for ns in namespaces}) == len(namespaces)


@pytest.mark.parametrize("seed", range(5))
def test_a_prefix_range_holds_exactly_the_namespaces_that_extend_the_prefix(seed):
    rng = random.Random(seed)
    namespaces = [random_namespace(rng) for _ in range(300)]
    prefixes = [
        (),
        *(ns[: rng.randint(1, len(ns))] for ns in namespaces[:40]),
        *(random_namespace(rng) for _ in range(40)),
    ]
    for prefix in prefixes:
        for namespace in namespaces:
            assert extends_by_range(namespace, prefix) == (namespace[: len(prefix)] == prefix), (namespace, prefix)


def test_segments_stay_apart_whatever_they_contain():
    assert encode(("a.b",)) != encode(("a", "b"))
    assert encode(("a\x01b",)) != encode(("a", "b"))
    assert encode(("a",)) == "a\x01"
    assert encode(("a\x01", "\x02")) == "a\x02\x02\x01\x02\x03\x01"
    assert not extends_by_range(("ab",), ("a",))
    assert not extends_by_range(("a.b",), ("a",))
    assert extends_by_range(("a", "b"), ("a",))


@pytest.mark.parametrize("bad", ["a\x02", "a\x02\x04\x01", "a"])
def test_decode_refuses_what_encode_cannot_produce(bad):
    with pytest.raises(ValueError, match="malformed"):
        decode(bad)


def test_check_namespace_explains_what_is_wrong():
    with pytest.raises(TypeError, match="must be a tuple"):
        check_namespace(["a"])
    with pytest.raises(ValueError, match="at least one segment"):
        check_namespace(())
    assert check_namespace((), allow_empty=True) == ()
    with pytest.raises(ValueError, match="segment 1 must not be empty"):
        check_namespace(("a", ""))
    with pytest.raises(TypeError, match="segment 0 must be a string"):
        check_namespace((1,))
    with pytest.raises(ValueError, match="NUL"):
        check_namespace(("a\x00",))
    # Escapes count towards the limit: 512 "\x01" encode to 1024 bytes, plus the terminator.
    with pytest.raises(ValueError, match="1025 bytes in UTF-8 once encoded"):
        check_namespace(("\x01" * 512,))
