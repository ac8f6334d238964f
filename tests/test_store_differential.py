"""DjangoStore against agentflow's own MemoryStore (the oracle), on random sequences of operations.

The conformance suite (test_store_conformance.py) pins each rule down by hand; this plays
the same random operations on both and compares every answer, types included, so what
no one thought to write a test for is compared too. The differences README lists as
deliberate (reads of malformed addresses, negative ttl, delete of an expired item before
a read) are kept out of the operations.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from agentflow.errors import StoreConflict
from agentflow.store import Item, MemoryStore

from afkmemory.stores import DjangoStore
from tests.conftest import DJANGO_ALIASES as ALIASES
from tests.utils import FLUSHED_APPS, run, typed

pytestmark = pytest.mark.django_db(databases=list(ALIASES.values()), transaction=True, available_apps=FLUSHED_APPS)

DJANGO = list(ALIASES)


def make(kind: str) -> Any:
    if kind == "af-memory":
        return MemoryStore()
    if kind == "pooled":
        return DjangoStore(using="postgres", async_pool=True)
    return DjangoStore(using=ALIASES[kind])


async def play(kind: str, script: Any) -> list[Any]:
    """Run ``script(store)`` (an async callable returning a list) against a fresh store of ``kind``."""
    return await script(make(kind))


async def attempt(awaitable) -> Any:
    try:
        return ("ok", await awaitable)
    except StoreConflict:
        return ("raise", "StoreConflict")
    except ValueError as error:
        return ("raise", "ValueError", type(error).__name__)
    except TypeError as error:
        return ("raise", "TypeError", type(error).__name__)
    except Exception as error:  # noqa: BLE001
        return ("raise", type(error).__name__)


NSS = [("a",), ("a", "b"), ("a", "b", "c"), ("b",), ("a.b",), ("ab",), ("A",), ("ä",), ("a", "\x01"), ("\U0001f600",)]
PREFIXES = [(), ("a",), ("a", "b"), ("b",), ("A",), ("zz",), ("a", "\x01")]
KEYS = ["k", "K", "k1", "k10", "é", "", " ", "a b", "\U0001f600"]
VALUES = [None, True, False, 0, 1, -7, 2**53 + 1, 2**70, 0.5, -0.25, 1e15, "", "x", "日本", [], {}, [1, "2", None],
          {"b": 1, "a": [True, {"c": None}]}, {"nested": {"deep": [[], {}]}}]  # fmt: skip
TTLS = [None, None, None, 0, 3600, 0.0, 3600.5]


def norm(result: Any) -> Any:
    if isinstance(result, tuple) and result and result[0] == "ok":
        return ("ok", norm(result[1]))
    if isinstance(result, Item):
        return (
            "Item",
            type(result.namespace).__name__,
            result.namespace,
            result.key,
            typed(result.value),
            result.expires_at is not None,
            "fresh" if result.created_at == result.updated_at else "kept",
            type(result.created_at).__name__,
            result.extra,
        )
    if isinstance(result, list):
        return [norm(r) for r in result]
    if isinstance(result, tuple) and result and result[0] == "raise":
        return result[:2]
    return (type(result).__name__, result)


def random_ops(seed: int, n: int = 120) -> list[tuple]:
    rng = random.Random(seed)
    ops = []
    for _ in range(n):
        kind = rng.choices(["put", "get", "delete", "search", "list"], weights=[5, 3, 2, 2, 2])[0]
        if kind == "put":
            ops.append(
                ("put", rng.choice(NSS), rng.choice(KEYS), rng.choice(VALUES), rng.choice(TTLS), rng.random() < 0.3)
            )
        elif kind in ("get", "delete"):
            ops.append((kind, rng.choice(NSS), rng.choice(KEYS)))
        elif kind == "search":
            ops.append(("search", rng.choice(PREFIXES), rng.choice([100, 1, 3, 0]), rng.choice([0, 0, 1, 5])))
        else:
            ops.append(("list", rng.choice(PREFIXES), rng.choice([100, 1, 2, 0]), rng.choice([0, 0, 1, 3])))
    return ops


def call(store: Any, op: tuple) -> Any:
    """Make ``op``'s call on ``store``: the coroutine of its answer (``attempt``)."""
    if op[0] == "put":
        _, ns, key, value, ttl, if_absent = op
        return attempt(store.put(ns, key, value, ttl=ttl, if_absent=if_absent))
    if op[0] == "get":
        return attempt(store.get(op[1], op[2]))
    if op[0] == "delete":
        return attempt(store.delete(op[1], op[2]))
    if op[0] == "search":
        return attempt(store.search(op[1], limit=op[2], offset=op[3]))
    return attempt(store.list_namespaces(prefix=op[1], limit=op[2], offset=op[3]))


async def drop_if_expired(store: Any, op: tuple) -> None:
    """Read before a delete: MemoryStore's delete of an expired item says False only once a read
    dropped it, as ours always does (the deliberate difference README lists)."""
    if op[0] == "delete":
        await store.get(op[1], op[2])


def script_for(ops: list[tuple]):
    """The operations one after another."""

    async def script(store) -> list[Any]:
        out = []
        for op in ops:
            await drop_if_expired(store, op)
            out.append(await call(store, op))
        return out

    return script


def first_difference(ops, a, b):
    for i, (op, x, y) in enumerate(zip(ops, a, b, strict=True)):
        if norm(x) != norm(y):
            return i, op, repr(norm(x)), repr(norm(y))
    return None


@pytest.mark.parametrize("kind", [*DJANGO, "pooled"])
@pytest.mark.parametrize("seed", range(6))
def test_random_sequences_match_agentflows_memory_store(kind, seed):
    ops = random_ops(seed)
    oracle = run(play("af-memory", script_for(ops)))
    ours = run(play(kind, script_for(ops)))
    assert first_difference(ops, oracle, ours) is None


def gathered_script_for(ops: list[tuple]):
    """The same operations, each batch of 6 awaited together (gather keeps MemoryStore's order: it never awaits)."""

    async def script(store) -> list[Any]:
        out: list[Any] = []
        for start in range(0, len(ops), 6):
            chunk = ops[start : start + 6]
            for op in chunk:
                await drop_if_expired(store, op)
            out += await asyncio.gather(*(call(store, op) for op in chunk))
        return out

    return script


def narrow_ops(seed: int, n: int = 150) -> list[tuple]:
    """Few addresses, so that concurrent calls hit the same keys."""
    rng = random.Random(seed)
    nss, keys = [("a",), ("a", "b")], ["k", "j"]
    ops = []
    for _ in range(n):
        kind = rng.choices(["put", "get", "delete", "search", "list"], weights=[5, 4, 2, 1, 1])[0]
        if kind == "put":
            ops.append(
                (
                    "put",
                    rng.choice(nss),
                    rng.choice(keys),
                    rng.randrange(100),
                    rng.choice([None, None, 0, 60]),
                    rng.random() < 0.3,
                )
            )
        elif kind in ("get", "delete"):
            ops.append((kind, rng.choice(nss), rng.choice(keys)))
        elif kind == "search":
            ops.append(("search", rng.choice([(), ("a",)]), 100, 0))
        else:
            ops.append(("list", (), 100, 0))
    return ops


# Concurrent calls that hop are made in order (one thread, first come first served); on
# the pool only writes of one key keep their order (README, "The async pool").
@pytest.mark.parametrize("kind", DJANGO)
@pytest.mark.parametrize("seed", range(4))
def test_concurrent_calls_answer_as_if_made_in_order(kind, seed):
    ops = narrow_ops(seed)
    oracle = run(play("af-memory", gathered_script_for(ops)))
    ours = run(play(kind, gathered_script_for(ops)))
    assert first_difference(ops, oracle, ours) is None


def _last_writer_counts(kind: str, trials: int = 200) -> dict[str, int]:
    async def script(store):
        lost = 0
        for i in range(trials):
            await asyncio.gather(store.put(("race",), f"k{i}", 1), store.put(("race",), f"k{i}", 2))
            if (await store.get(("race",), f"k{i}")).value != 2:
                lost += 1
        return [lost]

    return run(play(kind, script))[0]


@pytest.mark.parametrize("kind", ["af-memory", "django-postgres", "pooled"])
def test_of_two_concurrent_puts_of_one_key_the_later_one_wins(kind):
    assert _last_writer_counts(kind) == 0
