"""Connections that belong to one event loop, released when that loop closes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)


def release_on_close(loop: asyncio.AbstractEventLoop, release: Callable[[], Awaitable[object]]) -> None:
    """Run ``await release()`` on ``loop`` as it closes.

    asyncio connections belong to the loop that opened them, and ``asyncio.run`` and
    ``async_to_sync`` make a loop per call: a pool kept per loop must go with its loop,
    or its sockets stay open until garbage collection. ``loop.close`` is wrapped; a
    failing ``release`` is logged, never raised (closing must not fail because the
    server went away). A loop without instance attributes (uvloop) cannot be hooked:
    callers drop what belongs to closed loops when they next look.
    """
    original_close = loop.close

    def close() -> None:
        if not loop.is_running() and not loop.is_closed():
            try:
                loop.run_until_complete(release())
            except Exception:
                logger.debug("could not release %r when its loop closed", release, exc_info=True)
        original_close()

    with contextlib.suppress(AttributeError):
        loop.close = close  # type: ignore[method-assign]
