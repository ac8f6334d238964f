"""Profile one afkmemory operation with pyinstrument: ``python -m bench.profile OPERATION [-n N]``.

The evidence behind BENCHMARKS.md's *Profiles and fixes*: starts its own server like
``bench.run``, loads a small data set, runs the operation N times through the async
store (the way agentflow and AFK call it; ``-c C`` shares them among C concurrent
callers) and prints pyinstrument's call tree.
Needs ``requirements/bench.txt`` (pyinstrument).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

SHOW_ALL = False
#: ``--async-pool``: profile the stores with ``async_pool=True`` (their statements run on the event loop).
ASYNC_POOL = False
OPERATIONS = [
    "rest.get_state",
    "rest.post_events",
    "rest.get_bare",
    "rest.post_bare",
    "store.get",
    "store.put",
    "store.search",
    "store.list_namespaces",
    "memory.append_event",
    "memory.get_recent_events",
    "vector.search",
]


async def _op(name: str):
    from afkmemory.memory.types import MemoryEvent
    from afkmemory.stores import DjangoMemoryStore, DjangoStore, SyncDjangoStore

    if name.startswith("store."):
        from asgiref.sync import sync_to_async

        from .store import key, namespace, value

        def load() -> None:
            sync = SyncDjangoStore()
            for i in range(1000):
                sync.put(namespace(i), key(i, 10), value(i))

        await sync_to_async(load)()
        store = DjangoStore(async_pool=ASYNC_POOL)
        return {
            "store.get": lambda i: store.get(namespace(i), key(i, 10)),
            "store.put": lambda i: store.put(namespace(i), key(i, 10), value(i)),
            "store.search": lambda i: store.search(namespace(i)[:2], limit=50),
            "store.list_namespaces": lambda i: store.list_namespaces(prefix=("users",), limit=100),
        }[name]
    if name.startswith("memory."):
        from asgiref.sync import sync_to_async

        from .memory import THREAD, make_thread, payload

        await sync_to_async(make_thread)(THREAD, 10_000)
        mem = DjangoMemoryStore(async_pool=ASYNC_POOL)
        if name == "memory.append_event":
            return lambda i: mem.append_event(MemoryEvent(f"p{i}", THREAD, "u1", "message", 1, payload(i)))
        return lambda i: mem.get_recent_events(THREAD, 50)
    if name == "vector.search":
        import numpy as np
        from asgiref.sync import sync_to_async

        from .measure import Scale
        from .vector import load, make_data

        scale = Scale.smoke_run()
        scale.vectors, scale.vector_users, scale.vector_queries = 20_000, 20, 50
        vectors, users, queries, q_users = make_data(scale)
        await sync_to_async(load)(vectors, users)
        mem = DjangoMemoryStore(async_pool=ASYNC_POOL)
        qs = [q.tolist() for q in np.asarray(queries)]
        return lambda i: mem.search_long_term_memory_vector(f"user{q_users[i % len(qs)]}", qs[i % len(qs)], limit=10)
    if name.startswith("rest."):
        from asgiref.sync import sync_to_async
        from django.test import Client

        from .rest import THREAD, credentials, endpoints

        def prepare() -> tuple[Client, dict]:
            headers, user = credentials()
            return Client(headers=headers, HTTP_HOST="127.0.0.1"), endpoints(headers, user)

        client, requests = await sync_to_async(prepare)()
        req = requests[
            {
                "rest.get_state": "GET state/{key}",
                "rest.post_events": "POST events/",
                "rest.get_bare": "GET bare endpoint",
                "rest.post_bare": "POST bare endpoint",
            }[name]
        ]

        def call(i: int) -> None:
            if req["method"] == "GET":
                response = client.get(req["path"])
            else:
                response = client.post(req["path"], req["body"].replace("{n}", str(i)), content_type="application/json")
            assert response.status_code in (200, 201), (response.status_code, response.content[:300])

        return sync_to_async(call)
    raise SystemExit(f"unknown operation {name}")


async def _run(name: str, n: int, callers: int) -> None:
    from pyinstrument import Profiler

    op = await _op(name)
    for i in range(50):
        await op(i)
    from asgiref.sync import sync_to_async

    # The ORM work runs on sync_to_async's thread: profile that thread (pyinstrument follows
    # the thread that starts it), and the event loop's thread for the cost of the hop.
    worker = Profiler(interval=0.0002, async_mode="disabled")
    loop = Profiler(interval=0.0002, async_mode="disabled")
    await sync_to_async(worker.start)()
    loop.start()
    t0 = time.perf_counter()

    async def caller(first: int) -> None:
        for i in range(first, n, callers):
            await op(1000 + i)  # after the warm-up's indices: appends need fresh ids

    await asyncio.gather(*(caller(c) for c in range(callers)))
    elapsed = time.perf_counter() - t0
    loop.stop()
    await sync_to_async(worker.stop)()
    print(f"{n} calls of {name} from {callers} caller(s): {elapsed / n * 1e6:.0f} us per call")
    print("== the sync_to_async thread (the ORM)")
    print(worker.output_text(unicode=True, color=False, show_all=SHOW_ALL, timeline=False))
    print("== the event loop's thread")
    print(loop.output_text(unicode=True, color=False, show_all=SHOW_ALL, timeline=False))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile")
    parser.add_argument("operation", choices=OPERATIONS)
    parser.add_argument("-n", type=int, default=2000)
    parser.add_argument("--all", action="store_true", help="show every frame (no library folding)")
    parser.add_argument("-c", "--callers", type=int, default=1, help="concurrent coroutines sharing the n calls")
    parser.add_argument("--async-pool", action="store_true", help="store, memory and vector ops: async_pool=True")
    args = parser.parse_args()
    global SHOW_ALL, ASYNC_POOL
    SHOW_ALL = args.all
    ASYNC_POOL = args.async_pool
    logging.basicConfig(level=logging.WARNING)
    from . import server
    from .run import setup_django

    pg = server.start()
    try:
        setup_django(pg.url)
        asyncio.run(_run(args.operation, args.n, args.callers))
        from django.db import connections

        connections.close_all()
    finally:
        pg.drop()


if __name__ == "__main__":
    main()
