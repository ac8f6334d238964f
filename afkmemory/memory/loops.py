"""What afkmemory keeps for each event loop (connection pools), released when that loop closes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import weakref
from collections.abc import Hashable, Iterable
from typing import Protocol

logger = logging.getLogger(__name__)


class Releasable(Protocol):
    async def aclose(self) -> None: ...


class _Held:
    """What one loop holds, by owner, and the releases under way on it."""

    def __init__(self) -> None:
        self.items: dict[Hashable, Releasable] = {}
        # An owner's release_soon under way (a task needs a reference), by its task; a
        # cancelled one stays until the loop closes, which releases its item then.
        self.releasing: dict[asyncio.Task[None], Releasable] = {}

    async def release_all(self) -> None:
        items = list(self.items.values())
        self.items.clear()
        while self.releasing:
            tasks = list(self.releasing)
            await asyncio.wait(tasks)
            for task in tasks:
                item = self.releasing.pop(task)
                if task.cancelled():  # asyncio.run cancels every task before it closes the loop
                    items.append(item)
        for item in items:
            await _release(item)

    def _done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled():
            self.releasing.pop(task, None)


#: Where ``held`` keeps its dict on a loop.
_ATTRIBUTE = "_afkmemory_held"
#: The dicts of loops that take no attributes, whose close cannot be hooked: pruned once closed.
_unhooked: dict[asyncio.AbstractEventLoop, _Held] = {}
_unhooked_lock = threading.Lock()  # loops in several threads register at once


def held(loop: asyncio.AbstractEventLoop) -> dict[Hashable, Releasable]:
    """Return what afkmemory keeps for ``loop``, by owner: each value's ``aclose()`` runs as the loop closes.

    asyncio connections belong to the loop that opened them, and ``asyncio.run`` and
    ``async_to_sync`` make a loop per call: a pool kept per loop must go with its loop.
    The dict lives on the loop itself and nothing else refers to the loop, so a loop
    dropped without ``close()`` is garbage collected with its pools, whose sockets close
    as they would without afkmemory; and the values hold nothing of their owners, so
    owners come and go (``release_soon``) while the loop runs on. ``loop.close`` is
    wrapped once; a loop closed by a coroutine of another loop of its thread, where it
    cannot run, is run for the release on a short-lived thread, and ``close()`` waits for
    it. A failing ``aclose()`` is logged, never raised (closing must not fail because the
    server went away). Only touch the dict on the loop's own thread.
    """
    return _held(loop).items


def release_soon(loops: Iterable[asyncio.AbstractEventLoop], key: Hashable) -> None:
    """Release what each of ``loops`` holds under ``key``, on that loop; callable from any thread.

    For an owner that is garbage collected (``weakref.finalize``): nothing is awaited
    here. A running loop releases at its next turn, an idle one when it runs or closes,
    and a closed one released everything already.
    """
    for loop in list(loops):
        with contextlib.suppress(RuntimeError):  # the loop is closed
            loop.call_soon_threadsafe(_release_later, loop, key)


def _held(loop: asyncio.AbstractEventLoop) -> _Held:
    found: _Held | None = getattr(loop, _ATTRIBUTE, None) or _unhooked.get(loop)
    if found is None:
        found = _Held()
        try:
            _hook(loop, found)
            setattr(loop, _ATTRIBUTE, found)
        except AttributeError:  # a loop without instance attributes (uvloop): its close is not hooked
            with _unhooked_lock:
                for old in [old for old in _unhooked if old.is_closed()]:
                    del _unhooked[old]
                found = _unhooked.setdefault(loop, found)
    return found


def _hook(loop: asyncio.AbstractEventLoop, found: _Held) -> None:
    original_close = loop.close
    # A loop dropped without close() is closed by its __del__ as the garbage collector
    # takes it, after clearing the weak references to it: then it must not run again
    # (inside the collector, maybe inside another running loop), and what it held goes
    # with it, finalized as it would be without afkmemory.
    alive = weakref.ref(loop)

    def close() -> None:
        holds = found.items or found.releasing
        if holds and alive() is not None and not loop.is_running() and not loop.is_closed():
            if _a_loop_runs_here():
                # Closed by a coroutine of another loop of this thread, where this one cannot
                # run: release on a thread of its own, which runs it there, and wait for it.
                releaser = threading.Thread(target=_release_all, args=(loop, found), name="afkmemory-release")
                releaser.start()
                releaser.join()
            else:
                _release_all(loop, found)
        original_close()

    loop.close = close  # type: ignore[method-assign]


def _a_loop_runs_here() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _release_all(loop: asyncio.AbstractEventLoop, found: _Held) -> None:
    """Run ``loop`` until what it held is released (not in a thread where another loop runs)."""
    try:
        loop.run_until_complete(found.release_all())
    except Exception:
        logger.debug("could not release what %r held as it closed", loop, exc_info=True)


def _release_later(loop: asyncio.AbstractEventLoop, key: Hashable) -> None:
    found = _held(loop)
    item = found.items.pop(key, None)
    if item is not None:
        task = loop.create_task(_release(item))
        found.releasing[task] = item
        task.add_done_callback(found._done)


async def _release(item: Releasable) -> None:
    try:
        await item.aclose()
    except Exception:
        logger.debug("could not release %r", item, exc_info=True)
