"""RedisMemoryStore keeps every script bounded: searches read pages, state listings HSCAN.

A Lua script holds the whole Redis server while it runs, so no script may read a user's
every memory or a thread's every state key; these tests run on a real Redis.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from afkmemory.memory import InMemoryMemoryStore, LongTermMemory
from afkmemory.memory import redis as redis_backend
from afkmemory.memory.redis import RedisMemoryStore, RedisMemoryStoreError
from tests.test_redis_store import prefix, raw, url  # noqa: F401  (fixtures)

PAGE = 3

# Ties everywhere: equal updated_at (ordered by id), equal term counts, equal embeddings.
MEMORIES = [
    ("m01", "u1", "a", "apple pie apple", 5, [1.0, 0.0]),
    ("m02", "u1", "a", "apple", 5, [1.0, 0.0]),
    ("m03", "u1", "b", "apple tart", 7, [0.0, 1.0]),
    ("m04", "u1", "b", "pie", 3, [1.0, 1.0]),
    ("m05", "u1", "a", "apple apple", 9, [1.0, 0.0]),
    ("m06", "u1", "a", "pear", 5, [2.0, 0.0]),
    ("m07", "u1", "b", "apple pear", 1, [1.0, 1.0]),
    ("m08", "u1", "a", "apple", 5, [3.0, 1.0]),
    ("m09", "u1", "b", "apple pie", 8, [1.0, 0.0]),
    ("m10", "u1", "a", "apple", 2, [0.0, 2.0]),
    ("m11", "u2", "a", "apple", 4, [1.0, 0.0]),
    ("m12", None, "a", "apple", 6, [1.0, 0.0]),
    ("m13", "u1", "c", "apple", 5, None),
]


def memory(ident: str, user: str | None, scope: str, text: str, ts: int) -> LongTermMemory:
    return LongTermMemory(ident, user, scope, {"n": ident}, text, ["t"], {}, ts, ts)


async def fill(store: Any) -> None:
    for ident, user, scope, text, ts, embedding in MEMORIES:
        await store.upsert_long_term_memory(memory(ident, user, scope, text, ts), embedding=embedding)


def answers(store: Any, pages: list[tuple[int, int]] | None = None) -> list[Any]:
    async def go() -> list[Any]:
        await fill(store)
        if pages is not None:
            recording_pages(store, pages)
        found: list[Any] = []
        for user in ("u1", "u2", None):
            for scope in (None, "a", "b", "c"):
                for limit in (1, 2, 3, 4, 5, 100):
                    found.append(await store.list_long_term_memories(user, scope=scope, limit=limit))
                    for query in ("apple", "pie apple", "pear", "tart", "none"):
                        found.append(await store.search_long_term_memory_text(user, query, scope=scope, limit=limit))
                    for query, floor in (([1.0, 0.0], None), ([1.0, 1.0], None), ([0.0, 1.0], 0.5)):
                        hits = await store.search_long_term_memory_vector(
                            user, query, scope=scope, limit=limit, min_score=floor
                        )
                        found.append([(m, round(score, 9)) for m, score in hits])
        return found

    return asyncio.run(go())


def recording_pages(store: RedisMemoryStore, calls: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """Record each page script's count and how many members it took, on the running loop's client."""
    _, scripts = store._connection()
    script = scripts["read_index_page"]  # the real script, counted
    calls = [] if calls is None else calls

    async def recorded(*, keys: list[str], args: list[Any]) -> Any:
        reply = await script(keys=keys, args=args)
        calls.append((int(args[1]), int(reply[0])))
        return reply

    scripts["read_index_page"] = recorded
    return calls


@pytest.mark.parametrize("threads", [False, True], ids=["inline", "threads"])
def test_searches_and_listings_over_many_pages_match_the_oracle(url, prefix, monkeypatch, threads):  # noqa: F811
    monkeypatch.setattr(redis_backend, "BATCH", PAGE)
    if threads:  # every ranking in a worker thread
        monkeypatch.setattr(redis_backend, "TEXT_INLINE_ROWS", 0)
        monkeypatch.setattr(redis_backend, "VECTOR_INLINE_ROWS", 0)
    expected = answers(InMemoryMemoryStore(embedding_dimensions=2))
    pages: list[tuple[int, int]] = []
    assert answers(RedisMemoryStore(url, key_prefix=prefix, embedding_dimensions=2), pages) == expected
    assert any(len(found) > PAGE for found in expected)  # some answers span pages
    assert (PAGE, PAGE) in pages and all(taken <= count for count, taken in pages)  # searches read full pages


def test_no_script_reads_more_than_a_page(url, prefix, monkeypatch):  # noqa: F811
    monkeypatch.setattr(redis_backend, "BATCH", PAGE)
    store = RedisMemoryStore(url, key_prefix=prefix, embedding_dimensions=2)
    calls: dict[str, list[tuple[int, int]]] = {}

    async def go() -> None:
        for i in range(10):
            await store.upsert_long_term_memory(memory(f"m{i}", "u1", "a", "word", i), embedding=[1.0, float(i)])
        recorded = recording_pages(store)
        for name, search in [
            ("text", lambda: store.search_long_term_memory_text("u1", "word", limit=100)),
            ("text in scope", lambda: store.search_long_term_memory_text("u1", "word", scope="a", limit=2)),
            ("vector", lambda: store.search_long_term_memory_vector("u1", [1.0, 0.0], limit=100)),
            ("list", lambda: store.list_long_term_memories("u1", limit=7)),
        ]:
            start = len(recorded)
            assert len(await search()) == (2 if name == "text in scope" else 7 if name == "list" else 10)
            calls[name] = recorded[start:]

    asyncio.run(go())
    for name in ("text", "text in scope", "vector"):  # pages of 3, 3, 3 and the last 1
        assert calls[name] == [(3, 3), (3, 3), (3, 3), (3, 1)], name
    # A listing pages too past BATCH (a limit of 10**7 was one script), and stops at its limit.
    assert calls["list"] == [(3, 3), (3, 3), (1, 1)]


class InterleavedStore(RedisMemoryStore):
    """Writes between a search's first and second page, as another client could."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pages = 0

    async def _read_index_page(self, keys: list[str], lower: bytes, count: int) -> Any:
        page = await super()._read_index_page(keys, lower, count)
        self.pages += 1
        if self.pages == 1:  # the first page read m9, m8, m7
            await self.upsert_long_term_memory(memory("new-first", "u1", "a", "word", 100), embedding=[1.0, 0.0])
            await self.upsert_long_term_memory(memory("new-last", "u1", "a", "word", 0), embedding=[1.0, 0.0])
            await self.delete_long_term_memory("u1", "m8")  # read already
            await self.delete_long_term_memory("u1", "m4")  # not read yet
            # m9, read, moves past the boundary: it must not come twice. m5, unread, moves
            # ahead of it: it is not read at all.
            await self.upsert_long_term_memory(memory("m9", "u1", "a", "word", 1), embedding=[1.0, 0.0])
            await self.upsert_long_term_memory(memory("m5", "u1", "a", "word", 50), embedding=[1.0, 0.0])
        return page


@pytest.mark.parametrize("kind", ["text", "vector"])
def test_writes_between_pages_leave_every_memory_present_throughout_found_once(url, prefix, monkeypatch, kind):  # noqa: F811
    monkeypatch.setattr(redis_backend, "BATCH", PAGE)
    store = InterleavedStore(url, key_prefix=prefix, embedding_dimensions=2)

    async def go() -> list[str]:
        for i in range(1, 10):
            await store.upsert_long_term_memory(memory(f"m{i}", "u1", "a", "word", i + 1), embedding=[1.0, 0.0])
        store.pages = 0
        if kind == "text":
            return [m.id for m in await store.search_long_term_memory_text("u1", "word", limit=100)]
        return [m.id for m, _ in await store.search_long_term_memory_vector("u1", [1.0, 0.0], limit=100)]

    found = asyncio.run(go())
    assert store.pages > 1
    assert len(found) == len(set(found))  # none twice
    throughout = {"m1", "m2", "m3", "m6", "m7"}
    assert throughout <= set(found)
    assert set(found) - throughout <= {"m8", "m9", "new-last"}  # read before they changed, or written behind
    assert "m9" in found and "new-last" in found and "m5" not in found and "new-first" not in found


STATE_KEYS = ["a*1", "a*2", "a*", "ab", "aa", "b?[x]1", "b?[x]", "bqx1", "b?x1", "c\\1", "c\\", "c*1", "c1", "d[]"]


@pytest.mark.parametrize(
    ("prefix_asked", "matching"),
    [
        ("a*", ["a*", "a*1", "a*2"]),
        ("b?[x]", ["b?[x]", "b?[x]1"]),
        ("c\\", ["c\\", "c\\1"]),
        ("d[", ["d[]"]),
        ("f001", [f"f00{i}" for i in range(10, 20)]),
        ("zz", []),
    ],
)
def test_list_state_pages_with_hscan_and_takes_glob_characters_literally(url, prefix, prefix_asked, matching):  # noqa: F811
    store = RedisMemoryStore(url, key_prefix=prefix)
    filler = {f"f{i:04d}": i for i in range(3500)}  # a hashtable, not a listpack: HSCAN pages
    calls: list[Any] = []

    async def go() -> tuple[dict[str, Any], dict[str, Any]]:
        await store.put_state_many("t1", filler)
        await store.put_state_many("t1", {key: key for key in STATE_KEYS})
        client, _ = store._connection()
        hscan = client.hscan

        async def recorded(*args: Any, **kwargs: Any) -> Any:
            calls.append(kwargs.get("match"))
            return await hscan(*args, **kwargs)

        client.hscan = recorded  # type: ignore[method-assign]  # the real command, counted
        return await store.list_state("t1", prefix_asked), await store.list_state("t1")

    listed, everything = asyncio.run(go())
    assert list(listed) == matching
    assert all(listed[key] == (int(key[1:]) if key[0] == "f" else key) for key in listed)
    assert list(everything) == sorted([*filler, *STATE_KEYS])
    paged = [match for match in calls if match is not None]
    assert len(paged) > 1 and len(calls) - len(paged) > 1  # several HSCAN calls with a prefix and without


def test_checkpoints_are_listed_through_hscan_too(url, prefix):  # noqa: F811
    store = RedisMemoryStore(url, key_prefix=prefix)

    async def go() -> list[Any]:
        await store.put_state_many("t1", {f"k{i}": i for i in range(3000)})
        for step in range(3):
            await store.write_checkpoint("t1", "r[1]*", step, "pre_llm", {"step": step})
        await store.write_checkpoint("t1", "r11", 0, "pre_llm", {"other": True})
        return await store.list_checkpoints("t1", "r[1]*")

    assert [c.payload for c in asyncio.run(go())] == [{"step": 0}, {"step": 1}, {"step": 2}]


# Digit counts 1 to 19, the 15/16-digit boundary of the fast path and 2**53 around it.
TIMESTAMPS = sorted(
    {int("9" * n) for n in range(1, 19)}
    | {10 ** (n - 1) for n in range(1, 20)}
    | {10**15 - 1, 10**15, 10**15 + 1, 2**53 - 1, 2**53, 2**53 + 1, 2**63 - 1, 2**63 - 2, 0, 15, 16, 255, 256}
    | {1_796_527_233_952, 123_456_789_012_345, 1_234_567_890_123_456}
)


def test_recency_members_written_by_lua_equal_pythons(url, prefix, raw, monkeypatch):  # noqa: F811
    """Lua writes index members from a record's digits on every move and delete (hex_of)."""
    monkeypatch.setattr(redis_backend, "BATCH", PAGE)
    store = RedisMemoryStore(url, key_prefix=prefix)

    async def go() -> None:
        for i, ts in enumerate(TIMESTAMPS):
            # The first write's member comes from Python; moving it makes Lua name the old one.
            await store.upsert_long_term_memory(memory(f"m{i}", "u1", "a", "x", ts))
            await store.upsert_long_term_memory(memory(f"m{i}", "u2", "b", "x", ts))

    asyncio.run(go())
    assert raw.zcard(f"{prefix}mo:2:u1") == raw.zcard(f"{prefix}ms:2:u1:a") == 0  # Lua named each old member
    members = sorted(redis_backend._recency_member(ts, f"m{i}").encode() for i, ts in enumerate(TIMESTAMPS))
    assert raw.zrange(f"{prefix}mo:2:u2", 0, -1) == members
    # Lua's members match Python's byte for byte, or the forget would leave strays.
    assert asyncio.run(store.delete_long_term_memories("u2", scope="b")) == len(TIMESTAMPS)
    assert [key for key in raw.scan_iter(match=f"{prefix}*") if not key.endswith(b"dims")] == []

    script = redis_backend._LUA_MEMORY_LIB + "return {hex_of(ARGV[1]), recency_member(ARGV[1], 'id')}"
    for ts in TIMESTAMPS:
        assert raw.eval(script, 0, str(ts)) == [
            format(ts, "x").encode(),
            redis_backend._recency_member(ts, "id").encode(),
        ]


def test_forgetting_walks_each_index_and_leaves_no_member_behind(url, prefix, raw, monkeypatch):  # noqa: F811
    monkeypatch.setattr(redis_backend, "BATCH", PAGE)
    store = RedisMemoryStore(url, key_prefix=prefix)

    async def go() -> list[int]:
        for i in range(8):
            await store.upsert_long_term_memory(memory(f"m{i}", "u1", "ab"[i % 2], "x", 1_796_527_233_952 + i % 3))
        await store.upsert_long_term_memory(memory("other", "u2", "a", "x", 5))
        return [await store.delete_long_term_memories("u1", scope="a"), await store.delete_long_term_memories("u1")]

    assert asyncio.run(go()) == [4, 4]
    assert sorted(raw.scan_iter(match=f"{prefix}m*")) == sorted(
        f"{prefix}{key}".encode() for key in ("md:2:u2", "mo:2:u2", "ms:2:u2:a", "mm:other")
    )


def test_a_forget_batch_that_fails_deletes_nothing(url, prefix, raw, monkeypatch):  # noqa: F811
    """Every type check comes before the first write: Redis would not undo the writes."""
    store = RedisMemoryStore(url, key_prefix=prefix)

    async def go() -> None:
        for i in range(6):  # m5, the newest, first: m2, in the broken scope, is in the middle
            await store.upsert_long_term_memory(memory(f"m{i}", "u1", "b" if i == 2 else "a", "x", i))

    asyncio.run(go())
    raw.delete(f"{prefix}ms:2:u1:b")
    raw.set(f"{prefix}ms:2:u1:b", "not a sorted set")
    with pytest.raises(RedisMemoryStoreError, match="WRONGTYPE"):
        asyncio.run(store.delete_long_term_memories("u1"))
    assert len(asyncio.run(store.list_long_term_memories("u1"))) == 6
    assert raw.zcard(f"{prefix}mo:2:u1") == 6 and raw.hlen(f"{prefix}md:2:u1") == 6


class MovingStore(RedisMemoryStore):
    """Moves memory ``x`` to scope "b" once a search has read its last page."""

    async def _index_pages(self, *args: Any) -> Any:
        async for page in super()._index_pages(*args):
            yield page
        await self.upsert_long_term_memory(memory("x", "u1", "b", "word", 3), embedding=[1.0, 0.0])


def test_a_memory_moved_to_another_scope_during_a_vector_search_is_not_returned_for_the_old(url, prefix):  # noqa: F811
    """The winners' records are read after the pages: one moved meanwhile is of another scope now."""
    store = MovingStore(url, key_prefix=prefix, embedding_dimensions=2)

    async def go() -> list[tuple[str, str]]:
        await store.upsert_long_term_memory(memory("x", "u1", "a", "word", 1), embedding=[1.0, 0.0])
        await store.upsert_long_term_memory(memory("y", "u1", "a", "word", 2), embedding=[0.0, 1.0])
        found = await store.search_long_term_memory_vector("u1", [1.0, 0.0], scope="a", limit=2)
        return [(m.id, m.scope) for m, _ in found]

    assert asyncio.run(go()) == [("y", "a")]


def test_equal_embeddings_score_the_same_on_a_full_page_and_a_short_one(url, prefix, monkeypatch):  # noqa: F811
    """BLAS's matrix-vector product summed a row differently with the number of rows: the same
    embedding scored a last bit apart on a page of 1,000 and on one of 3, and ``min_score``
    at an exact match kept it or not by its page."""
    import numpy as np

    dims = 384
    rng = np.random.default_rng(7)
    query = rng.standard_normal(dims).astype(np.float32).tolist()
    store = RedisMemoryStore(url, key_prefix=prefix, embedding_dimensions=dims)

    async def go() -> list[tuple[str, float]]:
        # 1,003 memories: a full page of 1,000, then 3; "first" and "last" hold the query itself.
        for i in range(1003):
            ident = "first" if i == 1002 else "last" if i == 0 else f"m{i:04}"
            vector = query if ident in ("first", "last") else rng.standard_normal(dims).astype(np.float32).tolist()
            await store.upsert_long_term_memory(memory(ident, "u1", "a", "w", i + 1), embedding=vector)
        found = await store.search_long_term_memory_vector("u1", query, limit=2, min_score=1.0)
        return [(m.id, score) for m, score in found]

    found = asyncio.run(go())
    assert [ident for ident, _ in found] == ["first", "last"]  # both, tied, by id
    assert found[0][1] == found[1][1]
