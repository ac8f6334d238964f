"""What only RedisMemoryStore has: thread TTL, pooling, several processes on one Redis.

The protocol itself is checked by the conformance suite (its ``redis`` parameter).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from typing import Any

import pytest
import redis

from afkmemory.memory import InMemoryMemoryStore, LongTermMemory, MemoryEvent, RetentionPolicy, compact_thread
from afkmemory.memory.redis import RedisMemoryStore, RedisMemoryStoreError
from tests.redis_server import delete_prefix, require_redis, unique_prefix


@pytest.fixture
def url() -> str:
    return require_redis()


@pytest.fixture
def prefix(url: str):
    prefix = unique_prefix()
    yield prefix
    delete_prefix(url, prefix)


@pytest.fixture
def raw(url: str):
    with redis.Redis.from_url(url) as client:
        yield client


def ev(i: int, thread: str = "t1", *, ts: int | None = None, kind: str = "message") -> MemoryEvent:
    return MemoryEvent(f"e{i}", thread, None, kind, i if ts is None else ts, {"n": i}, [])


def thread_keys(prefix: str, thread: str) -> list[str]:
    return [f"{prefix}{kind}:{thread}" for kind in ("ev", "ed", "es", "st")]


# -- TTL on threads -----------------------------------------------------------------------------


def test_ttl_is_reported_only_when_configured(url, prefix):
    assert RedisMemoryStore(url, key_prefix=prefix, thread_ttl=60).capabilities.ttl is True
    assert RedisMemoryStore(url, key_prefix=prefix).capabilities.ttl is False
    assert RedisMemoryStore.capabilities.ttl is False
    for bad in (0, -1, "60", True):
        with pytest.raises(ValueError, match="thread_ttl"):
            RedisMemoryStore(url, key_prefix=prefix, thread_ttl=bad)


def test_every_thread_key_gets_the_ttl_and_memories_none(url, prefix, raw):
    store = RedisMemoryStore(url, key_prefix=prefix, thread_ttl=60)
    asyncio.run(store.append_event(ev(1)))
    asyncio.run(store.put_state("t1", "k", 1))
    asyncio.run(store.upsert_long_term_memory(LongTermMemory("m1", "u1", text="kept")))
    for key in thread_keys(prefix, "t1"):
        assert 0 < raw.pttl(key) <= 60_000, key
    memory_keys = [k for k in raw.scan_iter(match=f"{prefix}m*")]
    assert memory_keys and all(raw.pttl(k) == -1 for k in memory_keys)

    untimed = RedisMemoryStore(url, key_prefix=prefix)
    asyncio.run(untimed.append_event(ev(1, "t2")))
    assert raw.pttl(f"{prefix}ev:t2") == -1


@pytest.mark.parametrize(
    "write",
    [
        lambda s: s.append_event(ev(9)),
        lambda s: s.put_state("t1", "other", 2),
        lambda s: s.put_state_many("t1", {"a": 1, "b": 2}),
        lambda s: s.delete_state("t1", "k"),
        lambda s: s.replace_thread_events("t1", [ev(1), ev(2)]),
    ],
)
def test_every_write_to_a_thread_renews_the_ttl_of_all_its_keys(url, prefix, raw, write):
    store = RedisMemoryStore(url, key_prefix=prefix, thread_ttl=600)
    asyncio.run(store.append_event(ev(1)))
    asyncio.run(store.put_state("t1", "k", 1))
    keys = thread_keys(prefix, "t1")
    for key in keys:
        raw.pexpire(key, 5_000)
    asyncio.run(write(store))
    assert all(raw.pttl(key) > 5_000 for key in keys if raw.exists(key))
    assert raw.exists(keys[0]) and raw.pttl(keys[0]) > 5_000


def test_a_thread_expires_as_a_whole_and_memories_stay(url, prefix, raw):
    store = RedisMemoryStore(url, key_prefix=prefix, thread_ttl=0.05)
    asyncio.run(store.append_event(ev(1)))
    asyncio.run(store.put_state("t1", "k", 1))
    asyncio.run(store.upsert_long_term_memory(LongTermMemory("m1", "u1", text="kept")))
    deadline = time.monotonic() + 10
    while raw.exists(*thread_keys(prefix, "t1")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert asyncio.run(store.get_recent_events("t1")) == []
    assert asyncio.run(store.list_state("t1")) == {}
    assert [m.id for m in asyncio.run(store.list_long_term_memories("u1"))] == ["m1"]
    # The thread starts afresh and the old id is free again. The same keys through a store
    # whose threads last: with 50 ms, the new event could expire before it is read back.
    lasting = RedisMemoryStore(url, key_prefix=prefix, thread_ttl=60)
    asyncio.run(lasting.append_event(ev(1)))
    assert [e.id for e in asyncio.run(lasting.get_recent_events("t1"))] == ["e1"]


# -- connections --------------------------------------------------------------------------------


def _connections_named(raw: redis.Redis, name: str) -> int:
    return sum(1 for client in raw.client_list() if client.get("name") == name)


def _connections_gone(raw: redis.Redis, name: str) -> bool:
    """Return whether Redis has seen every connection named ``name`` close (it may lag a moment)."""
    deadline = time.monotonic() + 10
    while _connections_named(raw, name) and time.monotonic() < deadline:
        time.sleep(0.01)
    return _connections_named(raw, name) == 0


def test_pool_is_built_from_the_options(url, prefix):
    store = RedisMemoryStore(url, key_prefix=prefix, max_connections=3, socket_timeout=1.5, socket_connect_timeout=0.7)

    async def built() -> Any:
        await store.setup()
        client, _ = store._connection()
        return client.connection_pool

    pool = asyncio.run(built())
    assert pool.max_connections == 3
    assert pool.timeout == 1.5  # waiting for a free connection is bounded too
    assert pool.connection_kwargs["socket_timeout"] == 1.5
    assert pool.connection_kwargs["socket_connect_timeout"] == 0.7
    for bad in ({"max_connections": 0}, {"socket_timeout": 0}, {"socket_connect_timeout": -1}):
        with pytest.raises(ValueError):
            RedisMemoryStore(url, key_prefix=prefix, **bad)


@pytest.mark.parametrize(("max_connections", "bounded"), [(2, True), (20, False)])
def test_max_connections_bounds_the_connections_opened(url, prefix, raw, max_connections, bounded):
    name = f"afkmemory-pool-{prefix.split(':')[1][:12]}"
    store = RedisMemoryStore(url, key_prefix=prefix, max_connections=max_connections, client_name=name)

    async def burst() -> int:
        await asyncio.gather(*(store.put_state("t1", f"k{i}", i) for i in range(60)))
        return _connections_named(raw, name)

    opened = asyncio.run(burst())
    assert asyncio.run(store.list_state("t1")) == {f"k{i}": i for i in range(60)}
    if bounded:
        assert 1 <= opened <= max_connections
    else:  # the control: the same burst opens more when allowed, so the bound above is real
        assert opened > 2
    assert _connections_gone(raw, name)  # the pool was disconnected with its loop


def test_a_pool_per_event_loop_closes_with_the_loop(url, prefix, raw):
    name = f"afkmemory-loop-{prefix.split(':')[1][:12]}"
    store = RedisMemoryStore(url, key_prefix=prefix, client_name=name)
    for i in range(3):
        asyncio.run(store.put_state("t1", "k", i))
        assert _connections_gone(raw, name)
    assert asyncio.run(store.get_state("t1", "k")) == 2

    async def close_explicitly() -> int:
        async with store:
            await store.get_state("t1", "k")
            during = _connections_named(raw, name)
        return during

    assert asyncio.run(close_explicitly()) == 1
    assert _connections_gone(raw, name)


def test_socket_timeout_raises_a_clear_error(url, prefix, raw):
    store = RedisMemoryStore(url, key_prefix=prefix, socket_timeout=0.2)
    raw.execute_command("CLIENT", "PAUSE", "20000", "WRITE")
    try:
        with pytest.raises(RedisMemoryStoreError, match=r"put_state failed on .*Timeout"):
            asyncio.run(store.put_state("t1", "k", 1))
    finally:
        raw.execute_command("CLIENT", "UNPAUSE")
    asyncio.run(store.put_state("t1", "k", 1))  # and works again once Redis answers


def test_unreachable_redis_raises_a_clear_error_without_the_password():
    with socketless_port() as port:
        store = RedisMemoryStore(f"redis://:s3cret@127.0.0.1:{port}/0", socket_connect_timeout=1)
        with pytest.raises(RedisMemoryStoreError) as caught:
            asyncio.run(store.get_state("t1", "k"))
    message = str(caught.value)
    assert f"RedisMemoryStore.get_state failed on redis://:***@127.0.0.1:{port}/0" in message
    assert "s3cret" not in message and "ConnectionError" in message
    assert isinstance(caught.value.__cause__, redis.ConnectionError)


class socketless_port:
    """A port nobody listens on, held bound (not listening) so nobody takes it meanwhile."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return int(self.sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


# -- keys and encodings -------------------------------------------------------------------------


def test_prefixes_isolate_stores_sharing_a_server(url, prefix):
    other = unique_prefix()
    try:
        a = RedisMemoryStore(url, key_prefix=prefix)
        b = RedisMemoryStore(url, key_prefix=other)
        asyncio.run(a.append_event(ev(1)))
        asyncio.run(a.put_state("t1", "k", "a"))
        asyncio.run(a.upsert_long_term_memory(LongTermMemory("m1", "u1", text="a")))
        assert asyncio.run(b.get_recent_events("t1")) == []
        assert asyncio.run(b.get_state("t1", "k")) is None
        assert asyncio.run(b.list_long_term_memories("u1")) == []
        asyncio.run(b.append_event(ev(1)))  # the same id under another prefix is another thread
    finally:
        delete_prefix(url, other)


def test_users_and_scopes_never_run_together_in_keys(url, prefix):
    store = RedisMemoryStore(url, key_prefix=prefix)
    pairs = [("a:b", "c"), ("a", "b:c"), ("-", "s"), (None, "s"), ("1:x", "s"), ("1", "x:s")]
    for i, (user, scope) in enumerate(pairs):
        asyncio.run(store.upsert_long_term_memory(LongTermMemory(f"m{i}", user, scope, text="same words")))
    for i, (user, scope) in enumerate(pairs):
        assert [m.id for m in asyncio.run(store.list_long_term_memories(user, scope=scope))] == [f"m{i}"]
        assert [m.id for m in asyncio.run(store.search_long_term_memory_text(user, "words", scope=scope))] == [f"m{i}"]


def test_timestamps_beyond_float_precision_still_order_exactly(url, prefix):
    store = RedisMemoryStore(url, key_prefix=prefix)
    big = 2**60  # a double cannot tell big from big + 1: a float score would tie them
    top = 2**63 - 1  # the largest timestamp any backend takes
    for i, ts in enumerate([big + 1, big, 15, 16, top, 0]):
        asyncio.run(store.append_event(ev(i, ts=ts)))
    assert [e.timestamp for e in asyncio.run(store.get_recent_events("t1"))] == [0, 15, 16, big, big + 1, top]
    assert [e.timestamp for e in asyncio.run(store.get_events_since("t1", big + 1))] == [big + 1, top]


def test_moving_a_memory_between_users_matches_the_oracle(url, prefix):
    oracle = InMemoryMemoryStore(embedding_dimensions=3)
    store = RedisMemoryStore(url, key_prefix=prefix, embedding_dimensions=3)

    def scenario(s: Any) -> list[Any]:
        async def go() -> list[Any]:
            await s.upsert_long_term_memory(LongTermMemory("m1", "u1", "a", text="x", created_at=5, updated_at=5),
                                            embedding=[1, 0, 0])  # fmt: skip
            await s.upsert_long_term_memory(LongTermMemory("m2", "u1", "a", text="x", created_at=7, updated_at=7))
            await s.upsert_long_term_memory(LongTermMemory("m1", "u2", "b", text="y", created_at=9, updated_at=9))
            await s.delete_long_term_memory("u1", "m1")  # no longer u1's: nothing happens
            return [
                await s.list_long_term_memories("u1"),
                await s.list_long_term_memories("u2"),
                await s.list_long_term_memories("u1", scope="a"),
                [(m.id, round(x, 6)) for m, x in await s.search_long_term_memory_vector("u2", [1, 0, 0])],
                await s.search_long_term_memory_vector("u1", [1, 0, 0]),
            ]

        return asyncio.run(go())

    expected = scenario(oracle)
    assert scenario(store) == expected
    assert expected[1][0].created_at == 5 and expected[3] == [("m1", 1.0)]


def test_embedding_length_is_fixed_by_the_first_write_across_instances(url, prefix):
    first = RedisMemoryStore(url, key_prefix=prefix)
    second = RedisMemoryStore(url, key_prefix=prefix)
    asyncio.run(first.upsert_long_term_memory(LongTermMemory("m1", "u1"), embedding=[1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="dimensions"):
        asyncio.run(second.upsert_long_term_memory(LongTermMemory("m2", "u1"), embedding=[1.0, 2.0]))
    with pytest.raises(ValueError, match="dimensions"):
        asyncio.run(second.search_long_term_memory_vector("u1", [1.0, 2.0]))
    assert [m.id for m in asyncio.run(second.list_long_term_memories("u1"))] == ["m1"]


def test_concurrent_upserts_of_one_memory_leave_one_consistent_record(url, prefix, raw):
    store = RedisMemoryStore(url, key_prefix=prefix)

    async def race() -> None:
        await asyncio.gather(*(
            store.upsert_long_term_memory(LongTermMemory("m1", f"u{i % 3}", f"s{i % 4}", text=f"v{i}", updated_at=i))
            for i in range(30)
        ))  # fmt: skip

    asyncio.run(race())
    listed = {user: asyncio.run(store.list_long_term_memories(user)) for user in ("u0", "u1", "u2")}
    (owner,) = [user for user, memories in listed.items() if memories]
    (memory,) = listed[owner]
    assert [m.id for m in asyncio.run(store.list_long_term_memories(owner, scope=memory.scope))] == ["m1"]
    index_members = sum(raw.zcard(k) for k in raw.scan_iter(match=f"{prefix}m[os]:*"))
    assert index_members == 2  # one entry in the user's index, one in the scope's: no strays


# -- several processes --------------------------------------------------------------------------

APPENDERS = 3
TRACES_EACH = 150
OLD_MESSAGES = 2000
BUDGET = APPENDERS * TRACES_EACH + 10
POLICY = RetentionPolicy(max_events_per_thread=BUDGET, keep_event_types=["trace"])


def append_traces(url: str, prefix: str, worker: int, start_at: float) -> list[str]:
    """Append protected trace events one by one from another process, as an agent would."""
    store = RedisMemoryStore(url, key_prefix=prefix)
    time.sleep(max(0.0, start_at - time.time()))

    async def go() -> list[str]:
        written = []
        for i in range(TRACES_EACH):
            # Every third one is back-dated, so it sorts among the events compaction judges.
            ts = i if i % 3 == 0 else 10_000 + i
            event = MemoryEvent(f"w{worker}-{i}", "busy", None, "trace", ts, {"worker": worker}, [])
            await store.append_event(event)
            written.append(event.id)
        return written

    return asyncio.run(go())


def append_same_ids(url: str, prefix: str, start_at: float) -> int:
    """Try to append e0..e99 to one thread; return how many this process got in."""
    store = RedisMemoryStore(url, key_prefix=prefix)
    time.sleep(max(0.0, start_at - time.time()))

    async def go() -> int:
        added = 0
        for i in range(100):
            try:
                await store.append_event(ev(i, "shared"))
                added += 1
            except ValueError:
                pass
        return added

    return asyncio.run(go())


def spawn_pool(processes: int) -> Any:
    return multiprocessing.get_context("spawn").Pool(processes)


@pytest.mark.slow
def test_appends_from_processes_survive_concurrent_compaction_and_counts_add_up(url, prefix):
    store = RedisMemoryStore(url, key_prefix=prefix)
    old = [MemoryEvent(f"old{i}", "busy", None, "message", 5_000 + i, {}, []) for i in range(OLD_MESSAGES)]
    asyncio.run(store.replace_thread_events("busy", old))
    written = len(old)
    results = []
    with spawn_pool(APPENDERS) as pool:
        start_at = time.time() + 2  # the children need a moment to start
        pending = [pool.apply_async(append_traces, (url, prefix, w, start_at)) for w in range(APPENDERS)]
        rounds = 0
        while not all(p.ready() for p in pending) or rounds < 3:
            results.append(asyncio.run(compact_thread(store, thread_id="busy", event_policy=POLICY)))
            fillers = [MemoryEvent(f"r{rounds}-{i}", "busy", None, "message", 10_000 + i, {}, []) for i in range(20)]
            for event in fillers:  # unprotected, so every round has something to remove
                asyncio.run(store.append_event(event))
            written += len(fillers)
            rounds += 1
        appended = [eid for p in pending for eid in p.get(timeout=120)]
    written += len(appended)

    remaining = {e.id for e in asyncio.run(store.get_recent_events("busy", limit=100_000))}
    lost = [eid for eid in appended if eid not in remaining]
    assert lost == [], f"compaction deleted {len(lost)} events appended while it ran"
    assert len(appended) == APPENDERS * TRACES_EACH
    assert results[0].events_removed >= OLD_MESSAGES - BUDGET  # the first round cut the old history
    assert all(r.events_before - r.events_after == r.events_removed for r in results)
    # Every event ever written is either still there or counted as removed exactly once.
    assert len(remaining) + sum(r.events_removed for r in results) == written

    asyncio.run(compact_thread(store, thread_id="busy", event_policy=POLICY))
    final = asyncio.run(store.get_recent_events("busy", limit=100_000))
    assert {e.id for e in final if e.type == "trace"} == set(appended)
    assert len(final) == BUDGET


def test_the_same_event_id_from_several_processes_is_written_once(url, prefix):
    store = RedisMemoryStore(url, key_prefix=prefix)
    with spawn_pool(3) as pool:
        start_at = time.time() + 2
        added = pool.starmap(append_same_ids, [(url, prefix, start_at)] * 3)
    assert sum(added) == 100
    events = asyncio.run(store.get_recent_events("shared", limit=1000))
    assert sorted(e.id for e in events) == sorted(f"e{i}" for i in range(100))


class InterruptedCompaction(RedisMemoryStore):
    """Appends through another client right after compaction took its snapshot."""

    def __init__(self, *args: Any, late: list[MemoryEvent], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.late = late

    async def _compaction_snapshot(self, client: Any, keys: list[str], scan_limit: int) -> Any:
        snapshot = await super()._compaction_snapshot(client, keys, scan_limit)
        other = RedisMemoryStore(self.url, key_prefix=self.key_prefix)
        for event in self.late:
            await other.append_event(event)
        await other.close()
        return snapshot


def test_events_appended_between_the_decision_and_the_delete_survive(url, prefix):
    late = [ev(100, ts=0), ev(101, ts=4), ev(102, ts=50)]  # older than the window, inside it, newest
    store = InterruptedCompaction(url, key_prefix=prefix, late=late)
    for i in range(1, 11):
        asyncio.run(store.append_event(ev(i)))
    policy = RetentionPolicy(max_events_per_thread=2, scan_limit=4)  # judges e7..e10, drops e1..e6 unseen
    result = asyncio.run(compact_thread(store, thread_id="t1", event_policy=policy))
    assert (result.events_before, result.events_after, result.events_removed) == (10, 2, 8)
    assert [e.id for e in asyncio.run(store.get_recent_events("t1"))] == ["e100", "e101", "e9", "e10", "e102"]


def test_a_compaction_whose_snapshot_falls_inside_a_replace_keeps_the_replaced_events(url, prefix, monkeypatch):
    """The replace's sequence numbers are taken with its writes: a snapshot taken while it is
    being built cannot cover them, so the compaction's deletes after it leave them alone."""
    import threading

    store = RedisMemoryStore(url, key_prefix=prefix)
    for i in range(10):
        asyncio.run(store.append_event(ev(i, ts=100 + i)))
    snapped, release = threading.Event(), threading.Event()
    real_snapshot = RedisMemoryStore._compaction_snapshot

    async def snapshot_then_wait(self: Any, *args: Any) -> Any:
        found = await real_snapshot(self, *args)
        snapped.set()
        await asyncio.to_thread(release.wait, 30)  # its deletes come after the replace
        return found

    monkeypatch.setattr(RedisMemoryStore, "_compaction_snapshot", snapshot_then_wait)
    policy = RetentionPolicy(max_events_per_thread=3, keep_event_types=[], scan_limit=5)
    compactor = threading.Thread(
        target=lambda: asyncio.run(RedisMemoryStore(url, key_prefix=prefix).compact_thread("t1", policy))
    )
    real_json = store._event_json

    def event_json_once_the_compaction_snapped(event: MemoryEvent) -> str:
        if not compactor.is_alive() and not snapped.is_set():
            compactor.start()
            assert snapped.wait(30)
        return real_json(event)

    monkeypatch.setattr(store, "_event_json", event_json_once_the_compaction_snapped)
    fresh = [ev(20 + i, ts=1 + i) for i in range(5)]  # older than every event the snapshot saw
    asyncio.run(store.replace_thread_events("t1", fresh))
    release.set()
    compactor.join(30)
    assert snapped.is_set() and not compactor.is_alive()
    assert asyncio.run(store.get_recent_events("t1", 100)) == fresh
