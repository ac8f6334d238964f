"""How the async stores reach their sync logic: thread hops, shared by concurrent calls.

Every async store call that runs the ORM is a ``sync_to_async`` hop into its sync store,
and a hop costs about as much as the statement it carries (~0.2 ms: two thread wake-ups).
A hop is sent as soon as its first call is made, and the calls bound for the same thread
that are made before the thread takes it (callers woken in the same turn of the event
loop, or queued behind a call that is running) ride along: they run there one after
another, in the order they were made, each in a copy of its caller's context, each with
its own result or exception. That is what ``sync_to_async`` would do call by call, for one
hop instead of many. Which thread that is stays asgiref's choice: the request's or
``own_thread()``'s, the sync caller's under ``async_to_sync``, or the process's shared one.

``merged`` goes one step further for calls that one statement can answer together
(``DjangoStore.get`` and ``put``): consecutive calls of one kind in a hop become one call
of their ``many`` function.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable, Hashable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from asgiref.sync import AsyncToSync, SyncToAsync, ThreadSensitiveContext, sync_to_async
from django.db import DatabaseError, DataError, IntegrityError, connections

try:  # how sync_to_async moves a context between the loop and its thread (asgiref Locals re-homed)
    from asgiref.sync import _restore_context
except ImportError:  # pragma: no cover - an asgiref without it: contextvars as they are
    _restore_context = None  # type: ignore[assignment]

__all__ = ["MAX_MERGED", "database_busy", "hop", "merged", "own_thread"]

#: The most items one ``many`` call answers; the rest go in further calls, in the same hop.
MAX_MERGED = 64


@asynccontextmanager
async def own_thread() -> AsyncIterator[None]:
    """Run the Django stores' calls made inside on a thread (and connection) of their own.

    Outside a Django request, every ``sync_to_async`` call of a process runs on one shared
    thread, so concurrent agent runs queue behind each other. Wrap each run::

        async with own_thread():
            await store.append_event(...)

    Inside a request Django already gives each request such a context; this is for agent
    runners, workers and scripts. The connections the thread opened are closed on exit.
    """
    async with ThreadSensitiveContext():
        try:
            yield
        finally:
            # Shielded: a caller cancelled on its way out (an outer timeout, a worker stopping)
            # leaves the close queued, and leaving the context waits for the thread's queue.
            await asyncio.shield(sync_to_async(connections.close_all)())


@functools.cache
def hop(function: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``function`` as a coroutine function that runs it on its ``sync_to_async`` thread.

    Concurrent calls bound for one thread share a hop (see the module). Built once per
    function. Pass the sync store explicitly:
    ``await hop(type(self.sync).get)(self.sync, ...)``.
    """
    alone = sync_to_async(_mended(function))

    @functools.wraps(function)
    async def call(*args: Any, **kwargs: Any) -> Any:
        key = _thread_key()
        if key is None:
            return await alone(*args, **kwargs)
        return await _join(key, functools.partial(function, *args, **kwargs))

    return call


async def merged(kind: Hashable, many: Callable[[list[Any]], Sequence[Any]], item: Any) -> Any:
    """Answer ``item`` with one ``many([item, ...])`` for the calls of ``kind`` that share its hop.

    ``many`` runs on the hop's thread with the items of consecutive calls of ``kind`` (no
    other call between them), in order, at most ``MAX_MERGED`` at a time, and returns one
    answer per item; an answer that is an exception is raised to its caller alone, an
    exception ``many`` raises to each of them.
    ``kind`` must name everything ``many`` depends on (the operation, the database, the
    owner): the calls of one kind share the first call's ``many``.
    """
    key = _thread_key()
    if key is None:
        [answer] = await sync_to_async(_mended(many, many=True))([item])
    else:
        answer = await _join(key, None, kind, many, item)
    if isinstance(answer, Exception):
        raise answer
    return answer


#: Threads where a call failed on the database (its connection may be broken): their next
#: hop checks their connections first (``_mend_connections``).
_suspect_threads: set[int] = set()


def _note_failures(errors: Iterable[Any]) -> None:
    """Mark this thread when one of ``errors`` is a database failure that may have broken its
    connection: Django marks the connection for the same errors (not a refused value or key)."""
    if any(isinstance(e, DatabaseError) and not isinstance(e, DataError | IntegrityError) for e in errors):
        _suspect_threads.add(threading.get_ident())


def _mend_connections() -> None:
    """Close this thread's database connections that a failure left unusable (outside a transaction).

    Django checks its connections when a request starts and ends, and Celery's Django fixup
    around each task; the threads the async stores hop to (asgiref's shared one,
    ``own_thread()``'s) see neither, so a connection a server restart broke failed every
    later call of the process. After a call on this thread failed on the database, the
    next hop asks the server whether each connection Django marked still works
    (``SELECT 1``) and closes it if not: that call connects anew. Other hops skip this.
    """
    ident = threading.get_ident()
    if ident not in _suspect_threads:
        return
    _suspect_threads.discard(ident)
    for connection in connections.all(initialized_only=True):
        if connection.errors_occurred and connection.connection is not None and not connection.in_atomic_block:
            if connection.is_usable():
                connection.errors_occurred = False
            else:
                connection.close()


def _mended(function: Callable[..., Any], many: bool = False) -> Callable[..., Any]:
    """``function``, after ``_mend_connections`` on the thread it runs on, noting its failure
    (``many``: or an answer that is an exception, one item's)."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        _mend_connections()
        try:
            answer = function(*args, **kwargs)
        except Exception as error:
            _note_failures([error])
            raise
        if many:
            _note_failures(answer)
        return answer

    return call


def database_busy(error: BaseException) -> bool:
    """Whether ``error`` is SQLite's "database is locked": another connection held the write lock
    past the timeout. It is the database's, not one item's: a ``many`` whose statement met it
    raises it (to every caller) rather than send each item alone to wait out the timeout again.
    """
    cause = error.__cause__
    code = getattr(cause, "sqlite_errorcode", None)
    return (
        isinstance(cause, sqlite3.Error)
        and code is not None
        and code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    )


def _thread_key() -> Hashable | None:
    """What decides the thread ``sync_to_async`` would pick here, besides the loop (None: unknown).

    asgiref's order: the sync caller's thread under ``async_to_sync``
    (``AsyncToSync.executors.current``), else the thread of the ``ThreadSensitiveContext``
    (a request, ``own_thread()``), else the loop's or the process's one shared thread.
    Equal keys on one loop mean the same thread.
    """
    executors = getattr(AsyncToSync, "executors", None)
    if executors is None:  # asgiref no longer says: every call hops alone
        return None
    return getattr(executors, "current", None), SyncToAsync.thread_sensitive_context.get(None)


class _Call:
    """One call a hop carries: a function to run, or an item for its kind's ``many``.

    A call that joins a hop has its caller's context and a future for its answer; the
    hop's first call runs in the hop's own copy of its caller's context and gets its
    answer from the hop, so it needs neither.
    """

    __slots__ = ("context", "function", "future", "item", "kind", "many")

    def __init__(
        self,
        function: Callable[[], Any] | None,
        kind: Hashable,
        many: Callable[[list[Any]], Sequence[Any]] | None,
        item: Any,
    ) -> None:
        self.function, self.kind, self.many, self.item = function, kind, many, item
        self.context: contextvars.Context | None = None
        self.future: asyncio.Future[Any] | None = None

    def run(self, function: Callable[..., Any], *args: Any) -> Any:
        if self.context is None:
            return function(*args)
        return self.context.run(_in_context, self.context, function, args)


def _in_context(context: contextvars.Context, function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """Run ``function`` in ``context`` as sync_to_async runs a call: its asgiref Locals (Django's
    active language, time zone) moved onto this thread, where they would otherwise be hidden."""
    if _restore_context is not None:
        _restore_context(context)
    return function(*args)


class _Turn:
    """The calls one hop carries: the first caller's, and those that join before its thread takes them."""

    __slots__ = ("calls", "lock", "taken")

    def __init__(self, calls: list[_Call]) -> None:
        self.calls = calls
        self.lock = threading.Lock()  # joins happen on the loop, the take on the hop's thread
        self.taken = False

    def join(self, call: _Call) -> bool:
        with self.lock:
            if not self.taken:
                self.calls.append(call)
            return not self.taken

    def take(self) -> list[_Call] | None:
        """Close the turn and return its calls; None if it was taken already."""
        with self.lock:
            if self.taken:
                return None
            self.taken = True
            return self.calls


#: The open turn of each loop and thread key: a hop sent but not yet taken, which later calls join.
#: An entry lives only while its hop is on its way.
_turns: dict[tuple[asyncio.AbstractEventLoop, Hashable], _Turn] = {}
_resending: set[asyncio.Task[None]] = set()  # see _send (a task needs a reference)


async def _join(
    key: Hashable,
    function: Callable[[], Any] | None,
    kind: Hashable = None,
    many: Callable[[list[Any]], Sequence[Any]] | None = None,
    item: Any = None,
) -> Any:
    """Run a call (``function()``, or ``item`` for ``many``) in the open hop to the thread of ``key``, or
    send a new hop with it; return or raise its outcome.

    A new hop goes at once (a lone caller waits for nothing), and the calls made while it
    waits for its thread (behind the hop before it, or for the thread to wake) join it.
    Its thread answers the joined calls itself; the first caller gets its own answer from
    the hop. If that caller is cancelled before the thread took the turn, the hop never
    runs, and the joined calls go in a hop of their own (``_send``).
    """
    loop = asyncio.get_running_loop()
    slot = (loop, key)
    call = _Call(function, kind, many, item)
    turn = _turns.get(slot)
    if turn is not None:
        call.context, call.future = contextvars.copy_context(), loop.create_future()
        if turn.join(call):
            try:
                return await call.future
            finally:
                if _restore_context is not None:  # what the call set, its caller sees (as sync_to_async)
                    _restore_context(call.context)
        call.context = call.future = None
    ok, outcome = await _send(slot, _Turn([call]))
    if ok:
        return outcome
    raise outcome


async def _send(slot: tuple[asyncio.AbstractEventLoop, Hashable], turn: _Turn) -> tuple[bool, Any]:
    """Open ``turn`` for later calls to join, send its hop, and return its first call's outcome.

    If the sender is cancelled before the thread takes the turn, the hop never runs: the
    calls that joined it are left to a turn of their own, opened at once, so the calls
    made after them still join behind them.
    """
    loop = slot[0]
    _turns[slot] = turn
    try:
        return await _run_turn_there(turn, loop)
    finally:
        if _turns.get(slot) is turn:
            del _turns[slot]
        orphans = turn.take() or []  # not empty: the hop did not run
        # The joined calls whose callers still wait: none when a closing loop cancelled them
        # all, and then no task is made that the loop would never run.
        waiting = [call for call in orphans[1:] if call.future and not call.future.done()]
        if waiting:
            rest = _Turn(waiting)  # each has its context and future
            _turns[slot] = rest
            task = loop.create_task(_resend(slot, rest))
            _resending.add(task)
            task.add_done_callback(_resending.discard)


def _run_turn(turn: _Turn, loop: asyncio.AbstractEventLoop) -> tuple[bool, Any]:
    """On the hop's thread: take the turn, run its calls, answer the joined ones; return the first one's outcome."""
    calls = turn.take()
    if calls is None:  # its first caller was cancelled, and took the turn back to send it again
        return False, asyncio.CancelledError()
    try:
        outcomes = _run_all(calls)
    except BaseException as error:  # not an Exception (a call's own are outcomes): no joined caller waits forever
        if len(calls) > 1:
            loop.call_soon_threadsafe(_answer, calls[1:], [(False, error)] * (len(calls) - 1))
        raise
    if len(calls) > 1:
        loop.call_soon_threadsafe(_answer, calls[1:], outcomes[1:])
    return outcomes[0]


_run_turn_there = sync_to_async(_run_turn)  # built once: asgiref inspects the function (~0.1 ms)


async def _resend(slot: tuple[asyncio.AbstractEventLoop, Hashable], turn: _Turn) -> None:
    """Send the turn of joined calls whose hop never ran; answer its first call (the thread answers the rest)."""
    first = turn.calls[0]
    try:
        outcome = await _send(slot, turn)
    except BaseException as error:  # cancelled before the thread took it (``_send`` passed the rest on), or worse
        _answer([first], [(False, error)])
        raise
    _answer([first], [outcome])


def _answer(calls: list[_Call], outcomes: list[tuple[bool, Any]]) -> None:
    """On the loop: hand each joined call's caller its outcome."""
    for call, (ok, outcome) in zip(calls, outcomes, strict=True):
        future = call.future
        assert future is not None  # a joined call
        if future.done():  # its caller was cancelled
            continue
        if ok:
            future.set_result(outcome)
        elif isinstance(outcome, asyncio.CancelledError):
            future.cancel()
        else:
            future.set_exception(outcome)


def _run_all(calls: list[_Call]) -> list[tuple[bool, Any]]:
    """On the hop's thread: each call's result, or the exception it raised, in order.

    Consecutive calls of one kind go to its ``many`` together; any other call between two
    of them splits them, so every call still runs after the calls made before it (a
    ``put`` made after a ``delete`` is not written before it).
    """
    _mend_connections()
    outcomes: list[tuple[bool, Any] | None] = [None] * len(calls)
    run: list[int] = []  # consecutive calls of one kind, waiting for their ``many``
    for i, call in enumerate(calls):
        if call.future is not None and call.future.cancelled():  # given up before it ran: skipped, like sync_to_async
            outcomes[i] = (False, asyncio.CancelledError())
            continue
        if run and (call.function is not None or call.kind != calls[run[0]].kind or len(run) == MAX_MERGED):
            _run_merged(calls, run, outcomes)
            run = []
        if call.function is None:
            run.append(i)
            continue
        try:
            outcomes[i] = (True, call.run(call.function))
        except Exception as error:
            outcomes[i] = (False, error)
    _run_merged(calls, run, outcomes)
    _note_failures(outcome for _, outcome in outcomes)  # type: ignore[misc]  # an answer may be an exception
    return outcomes  # type: ignore[return-value]


def _run_merged(calls: list[_Call], run: list[int], outcomes: list[tuple[bool, Any] | None]) -> None:
    """Answer the calls at ``run`` (consecutive, of one kind) with one call of their ``many``."""
    if not run:
        return
    first = calls[run[0]]
    assert first.many is not None
    try:
        answers = first.run(first.many, [calls[i].item for i in run])
        if len(answers) != len(run):
            raise RuntimeError(f"{first.many!r} gave {len(answers)} answers to {len(run)} items")
    except Exception as error:
        answers = [error] * len(run)
    for i, answer in zip(run, answers, strict=True):
        outcomes[i] = (True, answer)  # ``merged`` raises an answer that is an exception
