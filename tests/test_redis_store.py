"""What only RedisMemoryStore has: thread TTL, pooling, several processes on one Redis.

The protocol itself is checked by the conformance suite (its ``redis`` parameter).
"""

from __future__ import annotations

import asyncio
import gc
import json
import multiprocessing
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings
import weakref
from typing import Any
from urllib.parse import quote

import pytest
import redis

from afkmemory.memory import (
    InMemoryMemoryStore,
    LongTermMemory,
    MemoryEvent,
    RetentionPolicy,
    StateRetentionPolicy,
    compact_thread,
)
from afkmemory.memory import redis as redis_backend
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
    for bad in (0, -1, "60", True, float("inf"), float("nan"), 10**12 + 1, 10**400):
        with pytest.raises(ValueError, match="thread_ttl"):
            RedisMemoryStore(url, key_prefix=prefix, thread_ttl=bad)
    for bad in (float("inf"), 10**400):
        with pytest.raises(ValueError, match="socket_timeout"):
            RedisMemoryStore(url, key_prefix=prefix, socket_timeout=bad)


def test_the_longest_thread_ttl_allowed_is_one_redis_accepts(url, prefix, raw):
    # 10**15 ms, the most MAX_SECONDS allows: Redis takes it, so no append fails at its
    # PEXPIRE after writing the event (Lua does not undo it).
    store = RedisMemoryStore(url, key_prefix=prefix, thread_ttl=10**12)
    asyncio.run(store.append_event(ev(1)))
    asyncio.run(store.replace_thread_events("t2", [ev(2, "t2")]))
    assert [e.id for e in asyncio.run(store.get_recent_events("t1"))] == ["e1"]
    assert raw.pttl(f"{prefix}ev:t1") > 10**14 and raw.pttl(f"{prefix}ev:t2") > 10**14


def test_an_append_that_fails_writes_nothing(url, prefix, raw):
    # Redis does not undo a script's writes when a later command in it fails, so the
    # append checks everything that can fail first. Here the events key is not a sorted set.
    store = RedisMemoryStore(url, key_prefix=prefix)
    raw.set(f"{prefix}ev:t1", "not a sorted set")
    with pytest.raises(RedisMemoryStoreError, match="WRONGTYPE"):
        asyncio.run(store.append_event(ev(1)))
    assert raw.exists(f"{prefix}es:t1", f"{prefix}ed:t1") == 0  # no sequence number taken, no data


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
    assert pool.connection_kwargs["health_check_interval"] == redis_backend.HEALTH_CHECK_INTERVAL
    for bad in ({"max_connections": 0}, {"socket_timeout": 0}, {"socket_connect_timeout": -1}):
        with pytest.raises(ValueError):
            RedisMemoryStore(url, key_prefix=prefix, **bad)


@pytest.mark.parametrize("bad", ["my app", "a\nb", "tab\there", "", "caf\u00e9", "del\x7f"])
def test_a_client_name_redis_refuses_is_refused_at_construction(url, prefix, bad):
    # Redis refuses such a name at every connection's CLIENT SETNAME: accepted here, the
    # store never connected, and create_memory_store() fell back to memory without a word.
    from afkmemory.memory import create_memory_store

    with pytest.raises(ValueError, match="client_name"):
        RedisMemoryStore(url, key_prefix=prefix, client_name=bad)
    if bad:  # the URL's query drops an empty value: no name, which Redis accepts
        with pytest.raises(ValueError, match="client_name"):
            RedisMemoryStore(f"{url}?client_name={quote(bad)}", key_prefix=prefix)
    with pytest.raises(ValueError, match="client_name"):
        create_memory_store("redis", fallback=True, url=url, key_prefix=prefix, client_name=bad)
    with pytest.raises(TypeError, match="client_name"):
        RedisMemoryStore(url, key_prefix=prefix, client_name=b"afkmemory")


def test_a_client_name_redis_accepts_is_the_connections_name(url, prefix, raw):
    name = f"!afk~{uuid.uuid4().hex[:12]}"  # the first and last characters Redis allows
    store = RedisMemoryStore(url, key_prefix=prefix, client_name=name)

    async def named() -> int:
        await store.setup()
        return _connections_named(raw, name)

    assert asyncio.run(named()) == 1
    assert RedisMemoryStore(url, key_prefix=prefix, client_name=None).client_name is None


def test_embedding_dimensions_must_be_a_positive_integer(url, prefix):
    for bad in (0, -3):
        with pytest.raises(ValueError, match="embedding_dimensions"):
            RedisMemoryStore(url, key_prefix=prefix, embedding_dimensions=bad)
    for bad in (True, "3", 3.0):
        with pytest.raises(TypeError, match="embedding_dimensions"):
            RedisMemoryStore(url, key_prefix=prefix, embedding_dimensions=bad)
    assert RedisMemoryStore(url, key_prefix=prefix, embedding_dimensions=3).embedding_dimensions == 3


@pytest.mark.parametrize("flag", ["True", "False", "yes"])
def test_decode_responses_in_the_url_is_overridden(url, prefix, flag):
    # The store reads bytes (event members, float32 embeddings); redis-py lets the URL's
    # query turn text replies on (any value, "False" included, is a true string), which
    # broke compaction (KeyError) and vector search.
    store = RedisMemoryStore(f"{url}?decode_responses={flag}", key_prefix=prefix)

    async def go() -> tuple[Any, list[Any]]:
        await store.append_event(ev(1))
        await store.append_event(ev(2))
        compacted = await store.compact_thread("t1", RetentionPolicy(max_events_per_thread=1, keep_event_types=[]))
        await store.upsert_long_term_memory(LongTermMemory("m1", "u1", text="x"), embedding=[1.0, 0.0])
        await store.upsert_long_term_memory(LongTermMemory("m2", "u1", text="y"), embedding=[0.0, 1.0])
        found = await store.search_long_term_memory_vector("u1", [1.0, 0.1])
        return compacted, [(memory.id, round(score, 4)) for memory, score in found]

    compacted, found = asyncio.run(go())
    assert (compacted.events_before, compacted.events_after, compacted.events_removed) == (2, 1, 1)
    assert [e.id for e in asyncio.run(store.get_recent_events("t1"))] == ["e2"]
    assert found == [("m1", 0.995), ("m2", 0.0995)]


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


def _clients_named(name: str) -> int:
    from redis.asyncio import Redis

    gc.collect()
    return sum(
        1
        for o in gc.get_objects()
        # type(), not isinstance(): isinstance() of a dead weak proxy raises ReferenceError.
        if type(o) is Redis and o.connection_pool.connection_kwargs.get("client_name") == name
    )


def test_closing_and_reusing_the_store_on_one_loop_keeps_one_client(url, prefix, raw):
    """``async with store`` per request on a long-lived loop (an ASGI server): each close()
    drops the client and the next call makes one; the loop's close is hooked once, and
    releases whichever client the store then holds."""
    name = f"afkmemory-reuse-{uuid.uuid4().hex[:12]}"
    store = RedisMemoryStore(url, key_prefix=prefix, client_name=name)

    async def requests() -> int:
        for _ in range(50):
            async with store:
                await store.get_state("t1", "k")
        await store.get_state("t1", "k")  # left open: the loop's close must release it
        return _clients_named(name)

    assert asyncio.run(requests()) == 1
    assert _connections_gone(raw, name)
    assert _clients_named(name) == 0


_CLOSE_CYCLES = """
import asyncio, sys
from afkmemory.memory.redis import RedisMemoryStore
store = RedisMemoryStore(sys.argv[1], key_prefix=sys.argv[2])
per_request = sys.argv[3] == "per-request"
loop = asyncio.new_event_loop()

async def requests():
    for _ in range(1100):
        async with RedisMemoryStore(sys.argv[1], key_prefix=sys.argv[2]) if per_request else store as used:
            await used.get_state("t1", "k")

loop.run_until_complete(requests())
try:
    loop.close()
except RecursionError:
    print("RecursionError")
print("closed" if loop.is_closed() else "open")
"""


@pytest.mark.parametrize("stores", ["one", "per-request"])
def test_a_loop_still_closes_after_many_close_cycles_of_a_store(url, prefix, stores):
    # A hook per client, then one per store, chained a wrapper of loop.close per cycle or
    # per store: past ~1000, closing the loop raised RecursionError. In a child process:
    # that error's noise from the never-awaited coroutines would spill into pytest's own
    # reporting.
    child = subprocess.run(
        [sys.executable, "-c", _CLOSE_CYCLES, url, prefix, stores], capture_output=True, text=True, timeout=300
    )
    assert child.stdout.split() == ["closed"], (child.stdout, child.stderr[-500:])


def _alive(refs: list[weakref.ref[Any]]) -> int:
    gc.collect()
    return sum(ref() is not None for ref in refs)


@pytest.mark.parametrize("closed", [False, True], ids=["left-open", "closed"])
def test_stores_made_per_request_on_one_loop_are_freed(url, prefix, raw, closed):
    """An ASGI server: one loop for days, a store per request. A store dropped, closed or
    not, is freed and gives up its pool: nothing piles up on the loop (it was a pool and a
    connection per request left open, and every store kept alive by the loop's close)."""
    name = f"afkmemory-req-{uuid.uuid4().hex[:12]}"
    stores: list[weakref.ref[Any]] = []

    async def request(i: int) -> None:
        store = RedisMemoryStore(url, key_prefix=prefix, client_name=name)
        stores.append(weakref.ref(store))
        await store.put_state("t1", "k", i)
        if closed:
            await store.close()

    async def server() -> tuple[int, int]:
        for i in range(200):
            await request(i)
        for _ in range(500):  # the loop runs on, and the dropped stores' pools disconnect
            if not _connections_named(raw, name):
                break
            await asyncio.sleep(0.01)
        return _connections_named(raw, name), _alive(stores)

    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(server()) == (0, 0)  # (connections, stores alive); it was (200, 200)
    finally:
        loop.close()


def test_a_store_dropped_as_asyncio_run_ends_still_gives_up_its_connections(url, prefix, raw):
    """A store collected just before ``asyncio.run`` returns: its pool's release is a task,
    which ``asyncio.run`` cancels with every other before closing the loop. The loop's close
    then releases what such a task did not (the connection stayed open until the pool was
    garbage collected)."""
    name = f"afkmemory-end-{uuid.uuid4().hex[:12]}"

    async def main() -> None:
        store = RedisMemoryStore(url, key_prefix=prefix, client_name=name)
        await store.get_state("t1", "k")
        del store
        gc.collect()  # the store's finalizer asks the loop to release its pool
        await asyncio.sleep(0)  # the release's task is made, not yet started

    asyncio.run(main())
    assert _connections_named(raw, name) == 0


def test_a_loop_dropped_without_closing_takes_its_connections_along(url, prefix, raw):
    """``loop = new_event_loop(); loop.run_until_complete(...)`` and no ``close()``: the store
    keeps no hold on the loop, so the loop and its pool are collected as they would be without
    it, and the connection closes (the store kept every such loop and connection while it lived)."""
    name = f"afkmemory-drop-{uuid.uuid4().hex[:12]}"
    store = RedisMemoryStore(url, key_prefix=prefix, client_name=name)
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # "unclosed transport": the loop was not closed
            for i in range(50):
                loop = asyncio.new_event_loop()
                loops.append(weakref.ref(loop))
                loop.run_until_complete(store.put_state("t1", "k", i))
                del loop
            alive = _alive(loops)
        _connections_gone(raw, name)
        assert (alive, _connections_named(raw, name)) == (0, 0)  # (loops, connections) left; it was (50, 50)
        assert asyncio.run(store.get_state("t1", "k")) == 49  # the store still works, on a loop of its own
    finally:
        for ref in loops:  # only if the test failed: close what is left
            left = ref()
            if left is not None and not left.is_closed():
                left.close()


def _kill_connections_named(url: str, name: str) -> int:
    """Close, from the server's side, every connection named ``name``; return how many."""
    with redis.Redis.from_url(url) as admin:
        ids = [client["id"] for client in admin.client_list() if client.get("name") == name]
        for ident in ids:
            admin.client_kill_filter(_id=ident)
    return len(ids)


READS = {
    "get_state": lambda s: s.get_state("t1", "k"),
    "list_state": lambda s: s.list_state("t1"),
    "list_state_prefix": lambda s: s.list_state("t1", prefix="k"),
    "get_recent_events": lambda s: s.get_recent_events("t1"),
    "get_events_since": lambda s: s.get_events_since("t1", 0),
    "list_long_term_memories": lambda s: s.list_long_term_memories("u1"),
    "search_long_term_memory_text": lambda s: s.search_long_term_memory_text("u1", "kept"),
    "search_long_term_memory_vector": lambda s: s.search_long_term_memory_vector("u1", [1.0, 0.0]),
    "setup": lambda s: s.setup(),
}


@pytest.mark.parametrize("read", list(READS))
def test_a_read_after_the_server_closed_the_pooled_connections_succeeds(url, prefix, read):
    """Redis closes idle clients (its ``timeout``, a failover, a proxy's idle cut, CLIENT
    KILL here). The pool hands out a dead connection and the command fails; a read is safe
    to send again, so it goes once more on a fresh connection instead of failing the call."""
    name = f"afkmemory-kill-{uuid.uuid4().hex[:12]}"
    store = RedisMemoryStore(url, key_prefix=prefix, client_name=name)
    control = RedisMemoryStore(url, key_prefix=prefix)

    async def go() -> tuple[Any, Any]:
        await store.append_event(ev(1))
        await store.put_state("t1", "k", 1)
        await store.upsert_long_term_memory(LongTermMemory("m1", "u1", text="kept"), embedding=[1.0, 0.0])
        # Several pooled connections, all closed at once, as Redis' timeout would.
        await asyncio.gather(*(store.get_state("t1", "k") for _ in range(5)))
        assert _kill_connections_named(url, name) >= 1
        return await READS[read](store), await READS[read](control)

    got, expected = asyncio.run(go())
    assert got == expected


WRITES = {
    "put_state": lambda s: s.put_state("t1", "k", 2),
    "put_state_many": lambda s: s.put_state_many("t1", {"k": 2}),
    "delete_state": lambda s: s.delete_state("t1", "k"),
    "append_event": lambda s: s.append_event(ev(2)),
    "replace_thread_events": lambda s: s.replace_thread_events("t1", [ev(3)]),
    "upsert_long_term_memory": lambda s: s.upsert_long_term_memory(LongTermMemory("m1", "u1", text="new")),
    "delete_long_term_memory": lambda s: s.delete_long_term_memory("u1", "m1"),
}


@pytest.mark.parametrize("write", list(WRITES))
def test_a_write_after_the_server_closed_the_idle_pooled_connections_succeeds(url, prefix, write):
    """Redis closed idle pooled connections (its ``timeout``, a failover, CLIENT KILL here) and the
    loop has read the close: the pool handed them out anyway (redis-py 8.1, RESP3) and every
    write failed, "Connection closed by server.". Nothing was sent on them, so the pool
    connects afresh instead; a write that may have reached Redis still fails (see below)."""
    name = f"afkmemory-kill-{uuid.uuid4().hex[:12]}"
    store = RedisMemoryStore(url, key_prefix=prefix, client_name=name)

    async def go() -> None:
        await store.append_event(ev(1))
        await store.put_state("t1", "k", 1)
        await store.upsert_long_term_memory(LongTermMemory("m1", "u1", text="kept"))
        await asyncio.gather(*(store.get_state("t1", "k") for _ in range(5)))  # several pooled connections
        assert _kill_connections_named(url, name) >= 1
        await asyncio.sleep(0.2)  # the loop goes on, as a service's does: it reads the closes
        await WRITES[write](store)

    asyncio.run(go())


class RestartableRedis:
    """A private redis-server on a port of its own, which a test may restart (never the shared one)."""

    def __init__(self, binary: str, directory: str) -> None:
        self.binary, self.directory = binary, directory
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.directory,
                   "--save", "", "--appendonly", "no"]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def restartable_redis(tmp_path):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server on PATH to start a private Redis that the test restarts")
    server = RestartableRedis(binary, str(tmp_path))
    yield server
    server.stop()


def test_writes_after_redis_restarted_connect_afresh(restartable_redis):
    """Redis restarts (a deploy, a failover) under a long-lived async service: the next write on
    every pooled connection failed ("Connection closed by server."; 10 concurrent writes, 10
    failures) though Redis was back, and only reads recovered by themselves."""
    store = RedisMemoryStore(restartable_redis.url, key_prefix="restart:", socket_timeout=2, socket_connect_timeout=2)

    async def writes(value: int) -> list[Any]:
        return await asyncio.gather(*(store.put_state("t1", f"k{i}", value) for i in range(10)), return_exceptions=True)

    async def go() -> tuple[list[Any], dict[str, Any]]:
        assert await writes(1) == [None] * 10
        await asyncio.to_thread(restartable_redis.restart)  # the loop runs meanwhile, and reads the closes
        await asyncio.sleep(0.2)
        return await writes(2), await store.list_state("t1")

    after, state = asyncio.run(go())
    assert after == [None] * 10
    assert state == {f"k{i}": 2 for i in range(10)}  # the restart lost the first writes (no persistence)


def test_a_read_failing_again_on_a_fresh_connection_raises(monkeypatch):
    """One more attempt, not a loop: a Redis that stays away fails the read (twice refused)."""
    attempts: list[int] = []
    real = redis_backend.Redis.hget

    async def counting_hget(self: Any, *args: Any) -> Any:
        attempts.append(1)
        return await real(self, *args)

    monkeypatch.setattr(redis_backend.Redis, "hget", counting_hget)
    with socketless_port() as port:
        store = RedisMemoryStore(f"redis://127.0.0.1:{port}/0", socket_connect_timeout=1)
        with pytest.raises(RedisMemoryStoreError, match="get_state failed.*ConnectionError"):
            asyncio.run(store.get_state("t1", "k"))
    assert len(attempts) == 2


def test_a_read_that_timed_out_waiting_for_a_free_connection_is_not_sent_again(url, prefix):
    # Sent again, it would wait pool_timeout once more: twice what the caller allowed.
    store = RedisMemoryStore(url, key_prefix=prefix, max_connections=1, pool_timeout=0.2)
    waits: list[int] = []

    async def go() -> None:
        client, _ = store._connection()
        pool = client.connection_pool
        held = await pool.get_connection()  # the only one
        real = pool.get_connection

        async def counting_get_connection(*args: Any) -> Any:
            waits.append(1)
            return await real(*args)

        pool.get_connection = counting_get_connection
        try:
            await store.get_state("t1", "k")
        finally:
            await pool.release(held)

    with pytest.raises(RedisMemoryStoreError, match="No connection available"):
        asyncio.run(go())
    assert waits == [1]


class ReplyDroppingProxy:
    """A TCP proxy to Redis that, once ``armed``, passes on the next command containing
    ``marker``, lets Redis run it, and closes the client's connection instead of passing
    the reply on: a connection lost after the server ran the command (a network blip)."""

    def __init__(self, target: tuple[str, int], marker: bytes) -> None:
        self.target, self.marker = target, marker
        self.armed, self.dropped = threading.Event(), threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            drop = threading.Event()
            threading.Thread(target=self._up, args=(client, server, drop), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, drop), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, drop: threading.Event) -> None:
        with client, server:
            try:
                while data := client.recv(65536):
                    if self.armed.is_set() and self.marker in data:
                        self.armed.clear()
                        drop.set()  # before the command goes on, so its reply is dropped
                    server.sendall(data)
            except OSError:
                pass

    def _down(self, server: socket.socket, client: socket.socket, drop: threading.Event) -> None:
        try:
            while data := server.recv(65536):
                if drop.is_set():
                    self.dropped.set()
                    client.shutdown(socket.SHUT_RDWR)
                    return
                client.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()


def test_a_reply_lost_after_an_append_ran_is_an_error_not_a_false_duplicate(url, prefix):
    """No write is sent twice: resent, the append would find its own event and report
    'already exists' for an event nobody else wrote."""
    parts = redis.connection.parse_url(url)
    proxy = ReplyDroppingProxy((parts.get("host", "127.0.0.1"), parts.get("port", 6379)), b"EVALSHA")
    store = RedisMemoryStore(f"redis://127.0.0.1:{proxy.port}/{parts.get('db', 0)}", key_prefix=prefix)

    async def go() -> None:
        await store.append_event(ev(1))  # loads the script, opens the pooled connection
        proxy.armed.set()
        await store.append_event(ev(2))

    try:
        with pytest.raises(RedisMemoryStoreError, match="ConnectionError"):
            asyncio.run(go())
    finally:
        proxy.close()
    assert proxy.dropped.is_set()
    direct = RedisMemoryStore(url, key_prefix=prefix)
    assert [e.id for e in asyncio.run(direct.get_recent_events("t1"))] == ["e1", "e2"]


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


#: (URL given, URL shown) for a port nobody listens on.
MASKED_URLS = [
    ("redis://127.0.0.1:{port}/0?password=s3cret", "redis://127.0.0.1:{port}/0?password=***"),
    ("redis://127.0.0.1:{port}/0?db=0&pass%77ord=s3cret&db=0", "redis://127.0.0.1:{port}/0?db=0&pass%77ord=***&db=0"),
    ("redis://me:s3cret@127.0.0.1:{port}/0?password=s3cret", "redis://me:***@127.0.0.1:{port}/0?password=***"),
    (
        "unix:///tmp/afkmemory-no-{port}.sock?db=0&password=s3cret",
        "unix:///tmp/afkmemory-no-{port}.sock?db=0&password=***",
    ),
]


@pytest.mark.parametrize(("given", "shown"), MASKED_URLS)
def test_a_password_in_the_url_query_is_masked_too(given, shown):
    # redis-py also takes the password from the query (percent-decoding the names), the
    # usual form for unix:// sockets: it showed in repr() and in every error message.
    with socketless_port() as port:
        store = RedisMemoryStore(given.format(port=port), socket_connect_timeout=1)
        with pytest.raises(RedisMemoryStoreError) as caught:
            asyncio.run(store.get_state("t1", "k"))
    assert repr(store) == f"<RedisMemoryStore {shown.format(port=port)} prefix='afkmemory:'>"
    assert f"failed on {shown.format(port=port)} " in str(caught.value)
    assert "s3cret" not in str(caught.value)


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


def test_an_upsert_that_fails_does_not_fix_the_embedding_length(url, prefix, raw):
    """The first embedding fixes the store's length with its memory, in the upsert's script:
    one claimed before the script (a SET NX of its own) stayed when the script then failed, or
    the process died in between, and refused every other length with no memory stored."""
    store = RedisMemoryStore(url, key_prefix=prefix)
    raw.set(store._memory_key("md", "u1"), "not a hash")  # the script's type check fails
    with pytest.raises(RedisMemoryStoreError):
        asyncio.run(store.upsert_long_term_memory(LongTermMemory("m1", "u1"), embedding=[1.0, 2.0, 3.0]))
    assert raw.get(f"{prefix}dims") is None
    raw.delete(store._memory_key("md", "u1"))
    asyncio.run(store.upsert_long_term_memory(LongTermMemory("m1", "u1"), embedding=[1.0, 2.0]))
    assert raw.get(f"{prefix}dims") == b"2"
    with pytest.raises(ValueError, match="dimensions"):
        asyncio.run(store.upsert_long_term_memory(LongTermMemory("m2", "u1", text="x"), embedding=[1.0, 2.0, 3.0]))
    assert [m.id for m in asyncio.run(store.list_long_term_memories("u1"))] == ["m1"]  # nothing written
    raw.set(f"{prefix}dims", "02")  # a length stored by hand is compared as a number, as Python reads it
    asyncio.run(store.upsert_long_term_memory(LongTermMemory("m2", "u1"), embedding=[1.0, 2.0]))
    assert [m.id for m in asyncio.run(store.list_long_term_memories("u1"))] == ["m2", "m1"]


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


def test_concurrent_upserts_of_one_memory_all_succeed(url, prefix, raw):
    # Upserts were WATCH/MULTI transactions giving up after 32 lost races: of 200 writers
    # of one hot id, about 130 raised and lost their write. One script each now queues
    # them, as the other backends serialize them.
    store = RedisMemoryStore(url, key_prefix=prefix, max_connections=200)
    n = 200

    async def race() -> list[Any]:
        writes = [
            store.upsert_long_term_memory(LongTermMemory("hot", f"u{i % 2}", text=f"v{i}", created_at=i, updated_at=i))
            for i in range(n)
        ]
        return await asyncio.gather(*writes, return_exceptions=True)

    results = asyncio.run(race())
    assert [r for r in results if r is not None] == []
    (memory,) = [m for user in ("u0", "u1") for m in asyncio.run(store.list_long_term_memories(user))]
    assert memory.text == f"v{memory.updated_at}"
    assert sum(raw.zcard(k) for k in raw.scan_iter(match=f"{prefix}m[os]:*")) == 2


HUGE = [2**63 - 1, 2**63 - 2, 2**53 + 1, 2**53, 2**53 - 1, 2**60 + 7, 10**18, 255, 16, 15, 0]


def test_huge_timestamps_survive_upserts_moves_and_deletes_like_the_oracle(url, prefix, raw):
    """The scripts take a memory's timestamps from its record as digit strings, never as
    Lua numbers (doubles, exact to 2**53): a rounded one would name an index member that
    is not there, and a move or delete would leave the old one behind."""
    oracle = InMemoryMemoryStore(embedding_dimensions=2)
    store = RedisMemoryStore(url, key_prefix=prefix, embedding_dimensions=2)
    owners = [("u1", "a"), ("u1", "b"), ("u2", "a"), (None, "a"), ("u1", "a")]
    selections = [*owners[:4], ("u1", None), ("u2", None), (None, None)]

    def scenario(s: Any) -> list[Any]:
        async def go() -> list[Any]:
            for i, ts in enumerate(HUGE):
                memory = LongTermMemory(f"m{i}", "u1", "a", text=f"w{i} all", created_at=ts, updated_at=ts)
                await s.upsert_long_term_memory(memory, embedding=[1.0, i + 1.0])
            for step, (user, scope) in enumerate(owners[1:], 1):  # each memory moves, gets newer or older
                for i in range(len(HUGE)):
                    updated = HUGE[(i + step) % len(HUGE)]
                    memory = LongTermMemory(
                        f"m{i}", user, scope, text=f"w{i} all s{step}", created_at=1, updated_at=updated
                    )
                    await s.upsert_long_term_memory(memory)
            for i in range(0, len(HUGE), 3):
                await s.delete_long_term_memory("u2", f"m{i}")  # not u2's: nothing happens
                await s.delete_long_term_memory("u1", f"m{i}")
            answers = []
            for user, scope in selections:
                answers.append(await s.list_long_term_memories(user, scope=scope, limit=4))
                answers.append(await s.list_long_term_memories(user, scope=scope))
                answers.append(await s.search_long_term_memory_text(user, "all", scope=scope))
                found = await s.search_long_term_memory_vector(user, [1.0, 1.0], scope=scope)
                answers.append([(m.id, round(x, 4)) for m, x in found])
            return answers

        return asyncio.run(go())

    expected = scenario(oracle)
    assert scenario(store) == expected
    remaining = asyncio.run(store.list_long_term_memories("u1"))
    assert {m.id for m in remaining} == {f"m{i}" for i in range(len(HUGE)) if i % 3}
    assert sorted(m.created_at for m in remaining) == sorted(ts for i, ts in enumerate(HUGE) if i % 3)
    # The records and index members are exactly what Python writes, so data written
    # before or after this change is read the same way.
    for m in remaining:
        assert raw.get(f"{prefix}mm:{m.id}") == f'["u1","a",{m.updated_at},{m.created_at}]'.encode()
        row = f'["{m.id}","u1","a",{{}},"{m.text}",[],{{}},{m.created_at},{m.updated_at}]'
        assert raw.hget(f"{prefix}md:2:u1", m.id) == row.encode()
    members = [redis_backend._recency_member(m.updated_at, m.id).encode() for m in remaining]
    assert raw.zrange(f"{prefix}mo:2:u1", 0, -1) == members
    assert raw.zrange(f"{prefix}ms:2:u1:a", 0, -1) == members
    assert sum(raw.zcard(k) for k in raw.scan_iter(match=f"{prefix}m[os]:*")) == 2 * len(remaining)  # no strays
    assert raw.hlen(f"{prefix}mv:2:u1") == len(remaining)  # each embedding moved with its memory


def test_a_memory_upsert_that_fails_writes_nothing(url, prefix, raw):
    # Redis does not undo a script's writes when a later command fails, so the upsert
    # checks every key it will write first. Here the new scope's index is not a sorted set.
    store = RedisMemoryStore(url, key_prefix=prefix)
    first = LongTermMemory("m1", "u1", "a", text="kept", created_at=1, updated_at=1)
    asyncio.run(store.upsert_long_term_memory(first, embedding=[1.0, 0.0]))
    before = {key: raw.dump(key) for key in raw.scan_iter(match=f"{prefix}*")}
    raw.set(f"{prefix}ms:2:u2:b", "not a sorted set")
    with pytest.raises(RedisMemoryStoreError, match="WRONGTYPE"):
        asyncio.run(store.upsert_long_term_memory(LongTermMemory("m1", "u2", "b", text="moved", updated_at=2)))
    raw.delete(f"{prefix}ms:2:u2:b")
    assert {key: raw.dump(key) for key in raw.scan_iter(match=f"{prefix}*")} == before
    assert asyncio.run(store.list_long_term_memories("u1")) == [first]


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


def test_a_compaction_interrupted_between_round_trips_then_run_again_keeps_what_one_run_keeps(url, prefix, monkeypatch):
    """As on SQLite (tests/test_memory_concurrency.py): ten traces, then twenty messages; killed
    after its first batch of deletes, then run again, the newest five messages are left. The
    window's dropped events used to go first, and the rerun kept the traces instead."""
    monkeypatch.setattr(redis_backend, "BATCH", 2)
    store = RedisMemoryStore(url, key_prefix=prefix)
    thread = [ev(i, kind="trace") for i in range(10)] + [ev(i) for i in range(10, 30)]
    asyncio.run(store.replace_thread_events("t1", thread))
    real = RedisMemoryStore._remove_events
    policy = RetentionPolicy(max_events_per_thread=5, keep_event_types=["trace"], scan_limit=20)

    async def killed_after_the_first_batch(self: RedisMemoryStore, scripts: Any, keys: Any, members: Any) -> int:
        await real(self, scripts, keys, members[:2])
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(RedisMemoryStore, "_remove_events", killed_after_the_first_batch)
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(store.compact_thread("t1", policy))
    monkeypatch.undo()
    store = RedisMemoryStore(url, key_prefix=prefix)
    assert len(asyncio.run(store.get_recent_events("t1", limit=100))) == 28
    asyncio.run(store.compact_thread("t1", policy))
    assert [e.id for e in asyncio.run(store.get_recent_events("t1", limit=100))] == [f"e{i}" for i in range(25, 30)]


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


def test_concurrent_compactions_report_counts_that_add_up(url, prefix):
    """Two compactions whose snapshots both come before either deletes (two workers'
    schedules): the second removes nothing, and says it found only what stays."""
    policy = RetentionPolicy(max_events_per_thread=2, keep_event_types=[])
    snapped: list[int] = []

    class BothSnapshotsFirst(RedisMemoryStore):
        async def _compaction_snapshot(self, *args: Any) -> Any:
            found = await super()._compaction_snapshot(*args)
            snapped.append(1)
            for _ in range(1000):  # bounded: a failure of the other shows as an assertion
                if len(snapped) == 2:
                    break
                await asyncio.sleep(0.01)
            return found

    first, second = BothSnapshotsFirst(url, key_prefix=prefix), BothSnapshotsFirst(url, key_prefix=prefix)

    async def go() -> list[Any]:
        for i in range(10):
            await first.append_event(ev(i))
        return list(await asyncio.gather(first.compact_thread("t1", policy), second.compact_thread("t1", policy)))

    results = asyncio.run(go())
    assert len(snapped) == 2
    counts = sorted((r.events_before, r.events_after, r.events_removed) for r in results)
    assert counts == [(2, 2, 0), (10, 2, 8)]  # what the Django backend reports, where the second waits


def test_replace_thread_events_is_not_restarted_by_an_append_while_it_is_built(url, prefix, monkeypatch):
    """An append lands while the replacement is being built (one every time it is built):
    the replace still goes through, and, as on Django, replaces an event appended before it."""
    store = RedisMemoryStore(url, key_prefix=prefix)
    appended: list[str] = []
    fresh = [ev(i, ts=100 + i) for i in range(5)]
    real_json = store._event_json

    def append_while_building(event: MemoryEvent) -> str:
        if event.id == fresh[0].id:
            late = ev(1000 + len(appended), ts=10**6)
            other = RedisMemoryStore(url, key_prefix=prefix)
            worker = threading.Thread(target=asyncio.run, args=(other.append_event(late),))
            worker.start()
            worker.join(30)
            appended.append(late.id)
        return real_json(event)

    monkeypatch.setattr(store, "_event_json", append_while_building)
    asyncio.run(store.append_event(ev(99)))
    asyncio.run(store.replace_thread_events("t1", fresh))
    assert len(appended) == 1  # built once: the append did not make it start again
    assert asyncio.run(store.get_recent_events("t1", 100)) == fresh
    asyncio.run(store.append_event(ev(7, ts=1)))  # and the thread goes on from there
    assert [e.id for e in asyncio.run(store.get_recent_events("t1", 100))] == ["e7", *(e.id for e in fresh)]


def _old_runs(runs: int) -> dict[str, Any]:
    """State of ``runs`` finished runs (run r started at r ms) and a note, as put_state writes it."""
    entries: dict[str, Any] = {"note": 0}
    for r in range(runs):
        entries[f"checkpoint:old{r}:latest"] = {"run_id": f"old{r}", "step": 1, "phase": "pre_llm",
                                                "timestamp_ms": r, "key": f"checkpoint:old{r}:1:pre_llm"}  # fmt: skip
        entries[f"checkpoint:old{r}:1:pre_llm"] = {"payload": {}}
        entries[f"effect:old{r}:1:c"] = {"input_hash": "h", "output": 1}
    return entries


def _run_keys(run_id: str) -> list[str]:
    return [f"checkpoint:{run_id}:1:pre_llm", f"checkpoint:{run_id}:latest", f"effect:{run_id}:1:c"]


def test_compact_state_is_not_restarted_by_writes_to_keys_it_keeps(url, prefix, raw, monkeypatch):
    """A live run writes while every prune decides (README: 'writes to the rows that stay
    never wait for a prune'): the prune still goes through, and the write stays."""
    store = RedisMemoryStore(url, key_prefix=prefix)
    asyncio.run(store.put_state_many("t1", _old_runs(3)))
    real_doomed = redis_backend.doomed_state
    writes: list[int] = []

    def write_while_deciding(state: Any, policy: Any) -> list[str]:
        writes.append(len(writes) + 1)
        raw.hset(f"{prefix}st:t1", "note", json.dumps(len(writes)))
        return real_doomed(state, policy)

    monkeypatch.setattr(redis_backend, "doomed_state", write_while_deciding)
    assert asyncio.run(store.compact_state("t1", StateRetentionPolicy(max_runs=1))) == (10, 6)
    assert writes == [1]
    assert asyncio.run(store.list_state("t1")) == {
        **{key: value for key, value in _old_runs(3).items() if key in _run_keys("old2")},
        "note": 1,
    }


def test_compact_state_decides_again_when_a_key_it_would_delete_changes(url, prefix, raw, monkeypatch):
    """A run resumes while the prune decides: its latest pointer moves, so it is the newest
    run now. Nothing read before is deleted; the prune decides again and keeps that run."""
    store = RedisMemoryStore(url, key_prefix=prefix)
    asyncio.run(store.put_state_many("t1", _old_runs(3)))
    real_doomed = redis_backend.doomed_state
    decisions: list[list[str]] = []

    def resume_old0_while_deciding(state: Any, policy: Any) -> list[str]:
        if not decisions:
            pointer = {**_old_runs(1)["checkpoint:old0:latest"], "timestamp_ms": 99}
            raw.hset(f"{prefix}st:t1", "checkpoint:old0:latest", json.dumps(pointer))
        decisions.append(real_doomed(state, policy))
        return decisions[-1]

    monkeypatch.setattr(redis_backend, "doomed_state", resume_old0_while_deciding)
    assert asyncio.run(store.compact_state("t1", StateRetentionPolicy(max_runs=1))) == (10, 6)
    assert len(decisions) == 2 and "checkpoint:old0:latest" in decisions[0]
    assert sorted(asyncio.run(store.list_state("t1"))) == sorted([*_run_keys("old0"), "note"])


def test_a_state_prune_renews_the_thread_ttl(url, prefix, raw):
    store = RedisMemoryStore(url, key_prefix=prefix, thread_ttl=600)
    asyncio.run(store.append_event(ev(1)))
    asyncio.run(store.put_state_many("t1", _old_runs(3)))
    keys = thread_keys(prefix, "t1")
    for key in keys:
        raw.pexpire(key, 5_000)
    assert asyncio.run(store.compact_state("t1", StateRetentionPolicy(max_runs=1))) == (10, 6)
    assert all(raw.pttl(key) > 5_000 for key in keys)


def test_a_loop_closed_while_another_loop_runs_in_its_thread_disconnects_its_pool(url, prefix, raw):
    """A coroutine of one loop closes another, finished loop: its release could not run that
    loop where another runs, and the store's connections stayed open until the garbage
    collector took them."""
    name = f"afkmemory-nested-{prefix.split(':')[1][:12]}"
    store = RedisMemoryStore(url, key_prefix=prefix, client_name=name)

    async def close(loop: asyncio.AbstractEventLoop) -> None:
        loop.close()

    finished = asyncio.new_event_loop()
    try:
        finished.run_until_complete(store.put_state("t1", "k", 1))
        assert _connections_named(raw, name) == 1
        asyncio.run(close(finished))
    finally:
        if not finished.is_closed():
            finished.close()
    assert _connections_gone(raw, name)
