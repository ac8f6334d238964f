"""``RedisMemoryStore``: AFK's ``MemoryStore`` on Redis, shared by every worker process.

Key layout, under a configurable prefix ``P`` (default ``afkmemory:``):

- ``P ev:<thread>`` sorted set of the thread's events. Every score is 0 and members sort
  by bytes: ``lp(timestamp) lp(seq) <type code> <event id>``, where ``lp(n)`` is ``n`` in
  hex after its two-hex-digit length, so byte order is (timestamp, insertion order) for
  any non-negative integer. ``ZRANGE`` by rank gives the newest events, by lex range
  the events since a timestamp; trimming removes exact members.
- ``P ed:<thread>`` hash event id -> event JSON; ``P es:<thread>`` the thread's insertion
  counter; ``P st:<thread>`` hash state key -> value JSON. With ``thread_ttl`` every write
  to a thread sets the TTL of all four keys, so a thread expires as a whole.
- ``P md:<user>`` hash memory id -> memory JSON and ``P mv:<user>`` hash memory id ->
  float32 embedding, per user; ``P mo:<user>`` and ``P ms:<user>:<scope>`` sorted sets
  whose members sort newest ``updated_at`` first (then id), so a listing reads only the
  page and a search only that user's (and scope's) memories. ``P mm:<id>`` records where
  memory ``id`` lives (user, scope, ``updated_at``, first ``created_at``); ``<user>`` is
  ``-`` for None, else ``<byte length>:<user>``, so a user and a scope never run together.

Reads that need two structures, and conditional writes, run as Lua scripts. Redis 7 as
Debian ships it has no search module, so text and vector search rank client-side over
the memories read, a page of ``BATCH`` per script: a script holds the whole server while
it runs, so no read takes more than a page of memories per script (``list_state`` pages
with HSCAN).
Targets one Redis server: a Redis Cluster would need every thread's keys in one hash
slot, and the memory scripts name keys that are not in their KEYS.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import unquote_plus, urlsplit, urlunsplit

import numpy as np

try:
    import redis  # noqa: F401  (an optional dependency: say how to get it)
except ImportError as missing:  # pragma: no cover - the test environment has it
    raise ImportError("the Redis backend needs redis-py: install afkmemory with its redis extra") from missing
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import AbstractConnection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from . import loops
from .base import MemoryStore, check_limit
from .compaction import check_policy, doomed_state, retained
from .text import query_terms, rank_by_term_count
from .types import (
    EVENT_TYPES,
    DuplicateEventError,
    Embedding,
    JsonValue,
    LongTermMemory,
    MemoryCapabilities,
    MemoryCompactionResult,
    MemoryEvent,
    RetentionPolicy,
    StateRetentionPolicy,
    check_count,
    check_embedding,
    check_id,
    check_min_score,
    check_prefix,
    check_replacement,
    check_state_entries,
    check_state_key,
    check_state_keys,
    check_timestamp,
    check_user_scope,
    cosine_similarities,
    dumps,
    validate_event,
    validate_memory,
)

#: One byte per event type inside a sorted-set member, so compaction never reads payloads.
TYPE_CODES = {"message": "m", "system": "s", "tool_call": "c", "tool_result": "r", "trace": "t"}
CODE_TYPES = {code.encode(): kind for kind, code in TYPE_CODES.items()}
if set(TYPE_CODES) != EVENT_TYPES:  # pragma: no cover - a new event type needs a code here
    raise ImportError(f"RedisMemoryStore has no type code for {sorted(EVENT_TYPES - set(TYPE_CODES))}")

#: Members or ids per Redis command in batched reads and deletes, and memories per page of
#: a search (one script each, see ``_index_pages``).
BATCH = 1000

#: The most memories whose text a search parses and ranks on the event loop (~40 µs
#: each); more go to a worker thread, whose hop costs ~0.1 ms. The same for the
#: embeddings of a vector search's page (~3 µs each at 384 dimensions).
TEXT_INLINE_ROWS = 100
VECTOR_INLINE_ROWS = 500

#: Keys a state listing asks HSCAN for per call.
STATE_SCAN_COUNT = 1000

#: The characters Redis's MATCH glob treats specially; a backslash makes each literal.
_GLOB_SPECIAL = re.compile(r"[*?\[\]\\]")

T = TypeVar("T")
#: Attempts of a state prune whose doomed keys keep changing, before giving up.
WATCH_RETRIES = 32

#: The longest timeout or ``thread_ttl``, in seconds (about 31,700 years). Redis keeps an
#: expiry as a signed 64-bit count of milliseconds since the epoch: a far longer TTL
#: overflows it, and PEXPIRE refuses it.
MAX_SECONDS = 10**12

#: Seconds a pooled connection may sit idle before redis-py PINGs it before its next
#: command, so a connection that died meanwhile fails before the command is sent.
HEALTH_CHECK_INTERVAL = 30

_COMPLEMENT = str.maketrans("0123456789abcdef", "fedcba9876543210")

# Lua helpers shared by the scripts: ``_lp`` for sequence numbers, the event id at the
# end of an event member, HMGET in batches (Lua's unpack() fails beyond a few thousand
# values), and the renewal of a thread's four keys' TTL (ms as a decimal string, '0':
# none), which every write does (``_touch`` outside scripts).
_LUA_LIB = """
local function lp(n)
  local hex = string.format('%x', n)
  return string.format('%02x', #hex) .. hex
end
local function event_id(m)
  local n1 = tonumber(string.sub(m, 1, 2), 16)
  local p = 3 + n1
  local n2 = tonumber(string.sub(m, p, p + 1), 16)
  return string.sub(m, p + 3 + n2)
end
local function memory_id(member)
  local n = 255 - tonumber(string.sub(member, 1, 2), 16)
  return string.sub(member, 3 + n)
end
local function hmget_pairs(hash, ids, out)
  for i = 1, #ids, 1000 do
    local chunk = {}
    for j = i, math.min(i + 999, #ids) do chunk[#chunk + 1] = ids[j] end
    local values = redis.call('HMGET', hash, unpack(chunk))
    for j = 1, #chunk do
      if values[j] then out[#out + 1] = chunk[j]; out[#out + 1] = values[j] end
    end
  end
  return out
end
local function touch(keys, ttl)
  if ttl ~= '0' then
    for i = 1, 4 do redis.call('PEXPIRE', keys[i], ttl) end
  end
end
"""

# KEYS: events, event data, counter, state. ARGV: lp(timestamp), type code, id, JSON,
# ttl ms as a decimal string ('0': none). The duplicate check, the sequence number and
# both writes happen in one step. Redis does not undo a script's writes when a later
# command fails, so whatever can fail runs before the first write: HEXISTS and ZCARD
# fail on a key of the wrong type, and the TTL arrives as an integer PEXPIRE accepts.
_APPEND = (
    _LUA_LIB
    + """
if redis.call('HEXISTS', KEYS[2], ARGV[3]) == 1 then return 0 end
redis.call('ZCARD', KEYS[1])
local seq = redis.call('INCR', KEYS[3])
redis.call('ZADD', KEYS[1], 0, ARGV[1] .. lp(seq) .. ARGV[2] .. ARGV[3])
redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
touch(KEYS, ARGV[5])
return 1
"""
)

# KEYS: events, event data, counter, state. ARGV: ttl ms ('0': none), then for each event,
# oldest first: lp(timestamp), type code, id, JSON. The sequence numbers are taken here,
# with the writes, so a compaction's snapshot never covers events not yet written, and
# an append is either before the whole replace (and replaced) or after it: it never
# makes the replace start again. The first write is the INCRBY (which fails alone on a
# counter that is not a number); the rest write to keys just unlinked, which cannot fail.
_REPLACE = (
    _LUA_LIB
    + """
local n = (#ARGV - 1) / 4
local seq = redis.call('INCRBY', KEYS[3], n) - n
redis.call('UNLINK', KEYS[1], KEYS[2])
for i = 2, #ARGV, 4000 do
  local members, data = {}, {}
  for j = i, math.min(i + 3999, #ARGV), 4 do
    seq = seq + 1
    members[#members + 1] = 0
    members[#members + 1] = ARGV[j] .. lp(seq) .. ARGV[j + 1] .. ARGV[j + 2]
    data[#data + 1] = ARGV[j + 2]
    data[#data + 1] = ARGV[j + 3]
  end
  redis.call('ZADD', KEYS[1], unpack(members))
  redis.call('HSET', KEYS[2], unpack(data))
end
touch(KEYS, ARGV[1])
"""
)

# KEYS: events, event data. ARGV: 'recent' and the first rank (minus the count), or
# 'since', the count and a lex lower bound. Returns id, JSON pairs oldest first, read in
# one atomic step. The numbers stay strings: Lua's numbers are doubles, and a limit of
# 2**63 - 1 would round to 2**63, which Redis refuses.
_READ_EVENTS = (
    _LUA_LIB
    + """
local members
if ARGV[1] == 'recent' then
  members = redis.call('ZRANGE', KEYS[1], ARGV[2], -1)
else
  members = redis.call('ZRANGE', KEYS[1], ARGV[3], '+', 'BYLEX', 'LIMIT', 0, ARGV[2])
end
local ids = {}
for i = 1, #members do ids[i] = event_id(members[i]) end
return hmget_pairs(KEYS[2], ids, {})
"""
)

# KEYS: events, event data. ARGV: members to delete. Data goes only with a member this
# call removed, so an event re-appended under the same id meanwhile keeps its data.
# HLEN fails on a data key of the wrong type before the first ZREM does anything.
_REMOVE_EVENTS = (
    _LUA_LIB
    + """
redis.call('HLEN', KEYS[2])
local removed = 0
for i = 1, #ARGV do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    removed = removed + 1
    redis.call('HDEL', KEYS[2], event_id(ARGV[i]))
  end
end
return removed
"""
)

# KEYS: a recency index, a hash keyed by memory id. ARGV: a lex lower bound ('-' for the
# first page, else '(' and the last member of the page before) and how many members to
# take at most. Returns how many members it took, the last of them ('' for none), then
# id, value pairs in index order (ids without a value are left out). One page per call,
# so no script reads more than that many memories however many the user has.
_READ_INDEX_PAGE = (
    _LUA_LIB
    + """
local members = redis.call('ZRANGE', KEYS[1], ARGV[1], '+', 'BYLEX', 'LIMIT', 0, ARGV[2])
local ids = {}
for i = 1, #members do ids[i] = memory_id(members[i]) end
return hmget_pairs(KEYS[2], ids, {#members, members[#members] or ''})
"""
)

# KEYS: events, event data, counter, state. ARGV: ttl ms ('0': none), then state key,
# value pairs. Deletes the keys only if every one still holds the value given (else
# returns 0 having written nothing), renewing the thread's TTL as every write does.
_DELETE_UNCHANGED_STATE = (
    _LUA_LIB
    + """
for i = 2, #ARGV, 2 do
  if redis.call('HGET', KEYS[4], ARGV[i]) ~= ARGV[i + 1] then return 0 end
end
for i = 2, #ARGV, 2000 do
  local chunk = {}
  for j = i, math.min(i + 1999, #ARGV), 2 do chunk[#chunk + 1] = ARGV[j] end
  redis.call('HDEL', KEYS[4], unpack(chunk))
end
touch(KEYS, ARGV[1])
return 1
"""
)

# Helpers of the memory scripts. A memory's record ``mm:<id>`` is the JSON
# ``[user, scope, updated_at, created_at]``; ``read_record`` returns its user (nil for
# None), its scope and the two timestamps as the digit strings stored, never as Lua
# numbers: those are doubles, exact only up to 2**53, and a timestamp may be up to
# 2**63 - 1. ``recency_member`` builds from such a string the index member that Python's
# ``_recency_member`` does. ``hex_of`` converts up to 15 digits (below 2**53, exact as a
# double) with string.format (a C long in Lua 5.1), longer ones by long division for the
# reason above: a forget converts one per memory, and long division of 13-digit
# millisecond timestamps took 43 ms per thousand.
_LUA_MEMORY_LIB = """
local HEX = '0123456789abcdef'
local COMPLEMENT = {}
for i = 1, 16 do COMPLEMENT[string.sub(HEX, i, i)] = string.sub(HEX, 17 - i, 17 - i) end
local function hex_of(digits)
  if #digits <= 15 then return string.format('%x', tonumber(digits)) end
  local hex = ''
  repeat
    local quotient, rest = {}, 0
    for i = 1, #digits do
      local d = rest * 10 + string.byte(digits, i) - 48
      rest = d % 16
      if #quotient > 0 or d >= 16 then quotient[#quotient + 1] = math.floor(d / 16) end
    end
    hex = string.sub(HEX, rest + 1, rest + 1) .. hex
    digits = table.concat(quotient)
  until digits == ''
  return hex
end
local function recency_member(updated_at, id)
  local hex = hex_of(updated_at)
  return (string.gsub(string.format('%02x', #hex) .. hex, '.', COMPLEMENT)) .. id
end
local function read_record(key)
  local raw = redis.call('GET', key)
  if not raw then return nil end
  local record = cjson.decode(raw)
  local user = record[1]
  if user == cjson.null then user = nil end
  local updated_at, created_at = string.match(raw, ',(%d+),(%d+)%]$')
  return {user = user, scope = record[2], updated_at = updated_at, created_at = created_at}
end
local function user_part(user)
  if user == nil then return '-' end
  return #user .. ':' .. user
end
local function check_types(command, keys)
  for i = 1, #keys do redis.call(command, keys[i]) end
end
local function scope_index_of(prefix, part, old)
  return prefix .. 'ms:' .. part .. ':' .. old.scope
end
-- Removes memory ``id`` whole: its record (key ``record``), its data and embedding in the
-- user's hashes, its ``member`` of the user's index and scope index. Every key's type has
-- been checked: nothing here fails halfway.
local function remove_memory(member, id, record, data, embeddings, index, scope_index)
  redis.call('ZREM', index, member)
  redis.call('ZREM', scope_index, member)
  redis.call('HDEL', data, id)
  redis.call('HDEL', embeddings, id)
  redis.call('DEL', record)
end
-- Deletes memory ``id`` (``old``, its record at key ``record``) whole, as remove_memory.
local function delete_memory(prefix, part, id, old, record, data, embeddings, index)
  local scope_index = scope_index_of(prefix, part, old)
  check_types('ZCARD', {scope_index})
  remove_memory(recency_member(old.updated_at, id), id, record, data, embeddings, index, scope_index)
end
"""

# KEYS: the memory's record, then the new owner's memory hash, embedding hash, index and
# scope index, then the store's embedding length. ARGV: key prefix, memory id, the new
# owner's user part, the new index member, the memory JSON before created_at and after it,
# the record JSON before created_at, the created_at given, the float32 embedding ('' for
# none: an embedding is never empty), the embedding's length where the store's is fixed by
# its first embedding ('' otherwise): a length other than the stored one writes nothing and
# returns the stored one; the first fixes it with the memory, so a write that fails or is
# killed fixes nothing. Reads the record, decides and writes in one step, so concurrent upserts
# of one id queue up like on the other backends instead of racing. created_at stays the
# first write's; a memory moving to another user takes its embedding along unless it
# gets a new one. The previous owner's and scope's keys are known only from the record,
# so they are named here rather than in KEYS: fine on one server, all this store
# supports (see the module docstring), not on a Redis Cluster. HLEN and ZCARD fail on
# any key to be written that holds another type, before the first write.
_UPSERT_MEMORY = (
    _LUA_MEMORY_LIB
    + """
local prefix, id, part = ARGV[1], ARGV[2], ARGV[3]
local created_at, blob, length = ARGV[8], ARGV[9], ARGV[10]
local fixed = length ~= '' and redis.call('GET', KEYS[6])
if fixed and tonumber(fixed) ~= tonumber(length) then return fixed end
local hashes, indexes = {KEYS[2], KEYS[3]}, {KEYS[4], KEYS[5]}
local old = read_record(KEYS[1])
local old_member, moved
if old then
  created_at = old.created_at
  old_member = recency_member(old.updated_at, id)
  local old_part = user_part(old.user)
  indexes[3] = prefix .. 'mo:' .. old_part
  indexes[4] = prefix .. 'ms:' .. old_part .. ':' .. old.scope
  moved = old_part ~= part
  if moved then
    hashes[3] = prefix .. 'md:' .. old_part
    hashes[4] = prefix .. 'mv:' .. old_part
    if blob == '' then blob = redis.call('HGET', hashes[4], id) or '' end
  end
end
check_types('HLEN', hashes)
check_types('ZCARD', indexes)
if length ~= '' and not fixed then redis.call('SET', KEYS[6], length) end
if old then
  redis.call('ZREM', indexes[3], old_member)
  redis.call('ZREM', indexes[4], old_member)
  if moved then
    redis.call('HDEL', hashes[3], id)
    redis.call('HDEL', hashes[4], id)
  end
end
redis.call('HSET', KEYS[2], id, ARGV[5] .. created_at .. ARGV[6])
if blob ~= '' then redis.call('HSET', KEYS[3], id, blob) end
redis.call('ZADD', KEYS[4], 0, ARGV[4])
redis.call('ZADD', KEYS[5], 0, ARGV[4])
redis.call('SET', KEYS[1], ARGV[7] .. created_at .. ']')
"""
)

# KEYS: the memory's record, then the owner's memory hash, embedding hash and index.
# ARGV: key prefix, memory id, the owner's user part. Deletes the memory only if the
# record says it is that owner's (returns 1), else does nothing (returns 0). The scope
# index is named from the record, as in _UPSERT_MEMORY.
_DELETE_MEMORY = (
    _LUA_MEMORY_LIB
    + """
local old = read_record(KEYS[1])
if not old or user_part(old.user) ~= ARGV[3] then return 0 end
check_types('HLEN', {KEYS[2], KEYS[3]})
check_types('ZCARD', {KEYS[4]})
delete_memory(ARGV[1], ARGV[3], ARGV[2], old, KEYS[1], KEYS[2], KEYS[3], KEYS[4])
return 1
"""
)

# KEYS: the index walked (the user's, or the user's scope's), then the user's memory hash,
# embedding hash and index. ARGV: key prefix, the user's part, how many index members to
# take. Deletes, whole, each memory of the first members of the walked index whose record
# says it is the user's, as _DELETE_MEMORY does; a member no such record backs is only
# dropped from the walked index, so the next batch moves on. Returns how many memories it
# deleted and how many members it took: fewer than asked, and the index is empty. Every
# read and type check (each scope index once) comes before the first write, so a batch
# that fails has written nothing. The walked member goes by itself only when removing
# the memory did not already take it (the walked index is its index or scope index).
_DELETE_USER_MEMORIES = (
    _LUA_LIB
    + _LUA_MEMORY_LIB
    + """
local prefix, part = ARGV[1], ARGV[2]
local members = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[3]) - 1)
check_types('HLEN', {KEYS[2], KEYS[3]})
check_types('ZCARD', {KEYS[4]})
local doomed, ids, checked = {}, {}, {[KEYS[4]] = true}
for i = 1, #members do
  local id = memory_id(members[i])
  local record = prefix .. 'mm:' .. id
  local old = read_record(record)
  if old and not ids[id] and user_part(old.user) == part then
    ids[id] = true
    local scope_index = scope_index_of(prefix, part, old)
    if not checked[scope_index] then
      check_types('ZCARD', {scope_index})
      checked[scope_index] = true
    end
    doomed[i] = {id, record, recency_member(old.updated_at, id), scope_index}
  end
end
local deleted = 0
for i = 1, #members do
  local walked, gone = members[i], doomed[i]
  if gone then
    remove_memory(gone[3], gone[1], gone[2], KEYS[2], KEYS[3], KEYS[4], gone[4])
    deleted = deleted + 1
  end
  if not gone or gone[3] ~= walked or (KEYS[1] ~= KEYS[4] and KEYS[1] ~= gone[4]) then
    redis.call('ZREM', KEYS[1], walked)
  end
end
return {deleted, #members}
"""
)

_SCRIPTS = {
    "append": _APPEND,
    "replace": _REPLACE,
    "delete_unchanged_state": _DELETE_UNCHANGED_STATE,
    "read_events": _READ_EVENTS,
    "remove_events": _REMOVE_EVENTS,
    "read_index_page": _READ_INDEX_PAGE,
    "upsert_memory": _UPSERT_MEMORY,
    "delete_memory": _DELETE_MEMORY,
    "delete_user_memories": _DELETE_USER_MEMORIES,
}


class RedisMemoryStoreError(RuntimeError):
    """A Redis command of a ``RedisMemoryStore`` failed (connection, timeout, server error)."""


def _lp(n: int) -> str:
    """Return ``n`` as length-prefixed hex, whose byte order is numeric order."""
    digits = format(n, "x")
    if len(digits) > 255:
        raise ValueError(f"{n} is too large to store (at most 1020 bits)")
    return f"{len(digits):02x}{digits}"


def _recency_member(updated_at: int, memory_id: str) -> str:
    """Return an index member that sorts newest ``updated_at`` first, then by id."""
    return _lp(updated_at).translate(_COMPLEMENT) + memory_id


def _parse_event_member(member: bytes) -> tuple[int, str, str]:
    """Return ``(seq, type, event id)`` of an event member."""
    n1 = int(member[:2], 16)
    p = 2 + n1
    n2 = int(member[p : p + 2], 16)
    seq = int(member[p + 2 : p + 2 + n2], 16)
    code = member[p + 2 + n2 : p + 3 + n2]
    return seq, CODE_TYPES[code], member[p + 3 + n2 :].decode()


def _text(name: bytes | str) -> str:
    """A hash field's name as text (the client returns bytes)."""
    return name.decode() if isinstance(name, bytes) else name


def _user_part(user_id: str | None) -> str:
    return "-" if user_id is None else f"{len(user_id.encode())}:{user_id}"


def _mask_url(url: str) -> str:
    """Return ``url`` without its password, for messages and logs.

    redis-py takes the password from ``user:password@`` or from the query
    (``?password=``, the usual form for ``unix://`` sockets), whose names it
    percent-decodes: so are they here, or ``?pass%77ord=`` would slip through.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable Redis URL>"
    if parts.password is not None:
        host = parts.netloc.rsplit("@", 1)[-1]
        url = urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
    # The query is masked as text: urlunsplit() would also turn unix:///path into unix:/path.
    base, mark, query = url.partition("?")
    fields = query.split("&")
    for i, field in enumerate(fields):
        name = field.split("=", 1)[0]
        if unquote_plus(name) == "password":
            fields[i] = f"{name}=***"
    return base + mark + "&".join(fields)


def _check_client_name(name: Any, source: str) -> None:
    # Redis refuses, at every connection's CLIENT SETNAME, a name with a character
    # outside '!'..'~' (spaces, newlines, control and non-ASCII characters): the store
    # would construct fine and never connect, and the factory fall back to memory.
    if not isinstance(name, str):
        raise TypeError(f"{source} must be a string or None, got {type(name).__name__}")
    if not re.fullmatch(r"[!-~]+", name):
        raise ValueError(
            f"{source} must be non-empty printable ASCII without spaces (Redis refuses other "
            f"connection names), got {name!r}"
        )


def _check_timeout(value: Any, name: str) -> float | None:
    # One bound for every duration: it refuses inf and nan (which no Redis command or
    # socket timeout takes) and integers too large for a float, with the option's name.
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_SECONDS:
        raise ValueError(f"{name} must be a positive number of seconds up to {MAX_SECONDS} or None, got {value!r}")
    return float(value)


class _Pool(BlockingConnectionPool):
    """redis-py's ``BlockingConnectionPool`` that does not hand out a connection Redis has closed.

    Redis closes idle connections when it restarts or fails over (or on its ``timeout``,
    ``CLIENT KILL``); once the event loop has read that close, the connection's reader is
    at EOF. redis-py's checkout probe would reconnect it, but redis-py 8.1 skips the probe
    when maintenance notifications may be on, as they are by default under RESP3, its
    default protocol (redis/redis-py#4252): the connection is handed out, the command
    written into the dead socket, and a write, never sent twice, fails. Nothing was sent
    on it yet, so it is safe to reconnect here, before the command; a connection whose
    close the loop has not seen yet looks open and is left to the health check's PING.
    redis-py 8.2 reads such a connection and reconnects it itself (the tests pass there
    without this); ``redis>=5.3.1`` still admits the releases that do not.
    """

    async def ensure_connection(self, connection: AbstractConnection) -> None:
        if _closed_by_server(connection):
            await connection.disconnect(nowait=True)  # ensure_connection connects it again
        await super().ensure_connection(connection)


def _closed_by_server(connection: AbstractConnection) -> bool:
    """Whether ``connection`` is open and its stream says the server closed it (or it broke)."""
    reader, writer = getattr(connection, "_reader", None), getattr(connection, "_writer", None)
    if reader is None or writer is None:  # not connected: ensure_connection connects it
        return False
    return bool(reader.at_eof() or reader.exception() is not None or writer.transport.is_closing())


class _Client:
    """A store's client on one event loop and its registered scripts; ``aclose()`` disconnects its pool.

    It refers to nothing of its store, so the loop that holds it keeps no store alive.
    """

    __slots__ = ("redis", "scripts")

    def __init__(self, redis: Redis, scripts: dict[str, Any]) -> None:
        self.redis = redis
        self.scripts = scripts

    async def aclose(self) -> None:
        await self.redis.connection_pool.disconnect()


class RedisMemoryStore(MemoryStore):
    """AFK's ``MemoryStore`` on Redis through redis-py's asyncio client.

    ``url`` is a redis-py URL (``redis://``, ``rediss://``, ``unix://``). Each store keeps
    one connection pool per event loop: at most ``max_connections`` connections (a caller
    waits up to ``pool_timeout``, default ``socket_timeout``, for a free one), each with
    ``socket_timeout`` per command and ``socket_connect_timeout`` to connect. A pool is
    disconnected when its loop closes (``asyncio.run`` and ``async_to_sync`` make a loop
    per call) or on ``close()``.

    ``key_prefix`` isolates tenants and tests sharing a server. ``thread_ttl`` (seconds,
    None: never) expires a thread's events and state that long after its last write;
    long-term memories do not expire. ``embedding_dimensions`` (None: fixed by the first
    stored embedding, shared through Redis) is checked like the other backends check it.

    A failing Redis command raises ``RedisMemoryStoreError`` naming the operation and the
    server. A read whose connection was lost is sent once more on a fresh one; a write
    is never sent twice (see ``_connection`` and ``_read``). Bad input raises
    ``TypeError``/``ValueError`` before anything is sent, and bad options at construction.
    """

    capabilities = MemoryCapabilities(text_search=True, vector_search=True, atomic_upsert=True, ttl=False)

    def __init__(
        self,
        url: str = "redis://localhost:6379/0",
        *,
        key_prefix: str = "afkmemory:",
        thread_ttl: float | None = None,
        max_connections: int = 50,
        socket_timeout: float | None = 5.0,
        socket_connect_timeout: float | None = 5.0,
        pool_timeout: float | None = None,
        client_name: str | None = "afkmemory",
        embedding_dimensions: int | None = None,
    ) -> None:
        if not isinstance(url, str) or urlsplit(url).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                f"url must be a Redis URL (redis://, rediss://, unix://) such as redis://localhost:6379/0, got {url!r}"
            )
        if not isinstance(key_prefix, str):
            raise TypeError(f"key_prefix must be a string, got {type(key_prefix).__name__}")
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise ValueError(f"max_connections must be a positive integer, got {max_connections!r}")
        ttl = _check_timeout(thread_ttl, "thread_ttl")
        # Parsed once, here, so a bad query value is a ValueError now rather than at the
        # first command. The query's options win over the arguments, as in from_url().
        self._url_options: dict[str, Any] = dict(parse_url(url))
        if client_name is not None:
            _check_client_name(client_name, "client_name")
        if "client_name" in self._url_options:
            _check_client_name(self._url_options["client_name"], "the URL's client_name")
        if embedding_dimensions is not None:
            check_count(embedding_dimensions, "embedding_dimensions", minimum=1)
        self.url = url
        self.key_prefix = key_prefix
        self.thread_ttl = ttl
        self.max_connections = max_connections
        self.socket_timeout = _check_timeout(socket_timeout, "socket_timeout")
        self.socket_connect_timeout = _check_timeout(socket_connect_timeout, "socket_connect_timeout")
        self.pool_timeout = _check_timeout(pool_timeout, "pool_timeout") or self.socket_timeout
        self.client_name = client_name
        self.embedding_dimensions = embedding_dimensions
        # Instances differ: TTL support is reported only when this store expires threads.
        self.capabilities = MemoryCapabilities(  # type: ignore[misc]
            text_search=True, vector_search=True, atomic_upsert=True, ttl=ttl is not None
        )
        # At most 10**15 (see MAX_SECONDS), which PEXPIRE accepts. The scripts hand it to
        # PEXPIRE as the string they get, never through tonumber(): Redis prints a Lua
        # double of 10**17 or more as '1e+17', which is not an integer.
        self._ttl_ms = 0 if ttl is None else max(1, round(ttl * 1000))
        # Each loop keeps this store's client under this key (loops.held): the loop, not the
        # store, holds it, so neither keeps the other alive. A store made per request on a
        # long-lived loop (an ASGI server) gives up its pool when it is collected.
        self._key = object()
        self._loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
        # Not at interpreter exit: loops still running in other threads keep their pools.
        finalizer = weakref.finalize(self, loops.release_soon, self._loops, self._key)
        finalizer.atexit = False  # type: ignore[misc]  # a documented attribute typeshed misses

    def __repr__(self) -> str:
        return f"<RedisMemoryStore {_mask_url(self.url)} prefix={self.key_prefix!r}>"

    # -- connections -------------------------------------------------------------------------

    def _connection(self) -> tuple[Redis, dict[str, Any]]:
        """Return this loop's client and its registered scripts, creating them on first use.

        asyncio connections belong to the loop that opened them, so each loop gets its
        own pool, disconnected when the loop closes (channels_redis does the same) or,
        on a loop that runs on, soon after the store is garbage collected.
        """
        loop = asyncio.get_running_loop()
        found = loops.held(loop).get(self._key)
        if isinstance(found, _Client):
            return found.redis, found.scripts
        options: dict[str, Any] = {
            "max_connections": self.max_connections,
            "timeout": self.pool_timeout,
            "socket_timeout": self.socket_timeout,
            "socket_connect_timeout": self.socket_connect_timeout,
            "client_name": self.client_name,
            # redis-py never sends a command again: a connection lost after Redis ran a
            # command (a network blip, a failover) looks like one that was dead before
            # it, and an append sent twice would report its own event as a duplicate.
            # So a failed write raises, and only reads go once more (see _read). A
            # connection Redis closed while idle is reconnected at checkout (_Pool); one
            # idle over HEALTH_CHECK_INTERVAL is PINGed first, so one that died unseen
            # (no close reached us) fails before the command goes out.
            "retry": Retry(NoBackoff(), 0),
            "health_check_interval": HEALTH_CHECK_INTERVAL,
        }
        # The URL's options win, as in from_url(), but for decode_responses: every reply
        # is read as bytes (event members, float32 embeddings), and text replies would
        # break compaction and vector search.
        pool = _Pool(**{**options, **self._url_options, "decode_responses": False})
        client = Redis(connection_pool=pool)
        scripts = {name: client.register_script(source) for name, source in _SCRIPTS.items()}
        loops.held(loop)[self._key] = _Client(client, scripts)
        self._loops.add(loop)
        return client, scripts

    @contextlib.contextmanager
    def _errors(self, operation: str) -> Iterator[None]:
        """Turn a Redis failure into ``RedisMemoryStoreError`` that says what and where."""
        try:
            yield
        except RedisError as exc:
            raise RedisMemoryStoreError(
                f"RedisMemoryStore.{operation} failed on {_mask_url(self.url)} "
                f"(prefix {self.key_prefix!r}): {type(exc).__name__}: {exc}"
            ) from exc

    async def _read(self, read: Callable[[Redis, dict[str, Any]], Awaitable[T]]) -> T:
        """Return ``await read(client, scripts)``, once more if the connection was lost.

        A pooled connection the server closed while idle (its ``timeout``, a failover,
        ``CLIENT KILL``) fails its next command. A read is safe to send again, unlike a
        write (see ``_connection``), so it goes once more, after the pool drops its idle
        connections, likely closed with that one. Not after a timeout, nor after a wait
        for a free connection timed out: a second wait would double the caller's.
        """
        client, scripts = self._connection()
        try:
            return await read(client, scripts)
        except RedisConnectionError as exc:
            if isinstance(exc.__cause__, TimeoutError):
                raise  # the pool's "No connection available."
            await client.connection_pool.disconnect(inuse_connections=False)
            return await read(client, scripts)

    async def setup(self) -> None:
        """Check that Redis answers (connections are otherwise opened on first use)."""
        with self._errors("setup"):
            await self._read(lambda client, _: client.ping())

    async def close(self) -> None:
        """Disconnect this loop's connection pool (others go when their loops close)."""
        found = loops.held(asyncio.get_running_loop()).pop(self._key, None)
        if found is not None:
            with self._errors("close"):
                await found.aclose()

    # -- keys --------------------------------------------------------------------------------

    def _thread_keys(self, thread_id: str) -> list[str]:
        """Return the events, event data, counter and state keys of a thread."""
        p = self.key_prefix
        return [f"{p}ev:{thread_id}", f"{p}ed:{thread_id}", f"{p}es:{thread_id}", f"{p}st:{thread_id}"]

    def _memory_key(self, kind: str, user_id: str | None, scope: str | None = None) -> str:
        key = f"{self.key_prefix}{kind}:{_user_part(user_id)}"
        return key if scope is None else f"{key}:{scope}"

    def _meta_key(self, memory_id: str) -> str:
        return f"{self.key_prefix}mm:{memory_id}"

    def _touch(self, pipe: Any, keys: list[str]) -> None:
        if self._ttl_ms:
            for key in keys:
                pipe.pexpire(key, self._ttl_ms)

    # -- events ------------------------------------------------------------------------------

    @staticmethod
    def _event_json(event: MemoryEvent) -> str:
        return dumps([event.id, event.user_id, event.type, event.timestamp, event.payload, list(event.tags)])

    @staticmethod
    def _events(thread_id: str, pairs: list[bytes]) -> list[MemoryEvent]:
        events = []
        for raw in pairs[1::2]:
            event_id, user_id, kind, timestamp, payload, tags = json.loads(raw)
            events.append(MemoryEvent(event_id, thread_id, user_id, kind, timestamp, payload, tags))
        return events

    async def append_event(self, event: MemoryEvent) -> None:
        validate_event(event)
        sort_prefix = _lp(event.timestamp)
        keys = self._thread_keys(event.thread_id)
        with self._errors("append_event"):
            _, scripts = self._connection()
            args = [sort_prefix, TYPE_CODES[event.type], event.id, self._event_json(event), self._ttl_ms]
            added = await scripts["append"](keys=keys, args=args)
        if not added:
            raise DuplicateEventError(event.id, event.thread_id)

    async def get_recent_events(self, thread_id: str, limit: int = 50) -> list[MemoryEvent]:
        check_id(thread_id, "thread_id")
        check_limit(limit)
        if limit == 0:
            return []
        keys, args = self._thread_keys(thread_id)[:2], ["recent", -limit, ""]
        with self._errors("get_recent_events"):
            pairs = await self._read(lambda _, scripts: scripts["read_events"](keys=keys, args=args))
        return self._events(thread_id, pairs)

    async def get_events_since(self, thread_id: str, since_ms: int, limit: int = 500) -> list[MemoryEvent]:
        check_id(thread_id, "thread_id")
        check_timestamp(since_ms, "since_ms")
        check_limit(limit)
        if limit == 0:
            return []
        keys, args = self._thread_keys(thread_id)[:2], ["since", limit, "[" + _lp(since_ms)]
        with self._errors("get_events_since"):
            pairs = await self._read(lambda _, scripts: scripts["read_events"](keys=keys, args=args))
        return self._events(thread_id, pairs)

    async def replace_thread_events(self, thread_id: str, events: list[MemoryEvent]) -> None:
        events = check_replacement(thread_id, events)
        ordered = sorted(events, key=lambda e: e.timestamp)  # stable: equal timestamps keep list order
        # Everything but the sequence numbers is built here; the script takes those with
        # its writes, in one step (see _REPLACE). As on Django, an event appended before
        # that step is replaced and one appended after it stays.
        args: list[Any] = [self._ttl_ms]
        for e in ordered:
            args += [_lp(e.timestamp), TYPE_CODES[e.type], e.id, self._event_json(e)]
        with self._errors("replace_thread_events"):
            _, scripts = self._connection()
            await scripts["replace"](keys=self._thread_keys(thread_id), args=args)

    async def compact_thread(self, thread_id: str, policy: RetentionPolicy) -> MemoryCompactionResult:
        """Delete exactly the events the policy drops; see ``compact_thread``.

        One ``MULTI`` reads the event count, the newest ``scan_limit`` members and the
        thread's insertion counter together; ``retained()`` decides on that snapshot.
        The deletes name exact members, and of the events older than the window only
        those whose sequence number the snapshot's counter covers, so an event appended
        meanwhile (even with an old timestamp) is never deleted, and appends never wait.
        AFK's adapters instead rewrite the thread from a snapshot and lose such events.
        The deletes take several round trips, the events beyond the window first: a
        compaction killed between two leaves what the next one, deciding on what is left,
        keeps the same (``DjangoMemoryStore.compact_thread`` says why).

        ``events_before`` is what this call kept plus what it removed: an event another
        compaction removed first is in neither, so the counts add up, as on Django, where
        the second compaction waits for the first and then finds those events gone.
        """
        check_id(thread_id, "thread_id")
        check_policy(policy, RetentionPolicy, "policy")
        keys = self._thread_keys(thread_id)
        with self._errors("compact_thread"):
            client, scripts = self._connection()
            total, window, mark = await self._compaction_snapshot(client, keys, policy.scan_limit)
            parsed = [(member, _parse_event_member(member)) for member in window]
            keep = retained([(member, kind) for member, (_, kind, _) in parsed], policy)
            removed = 0
            if total > len(window):  # beyond the window first: a rerun after a kill decides the same
                removed += await self._remove_older(client, scripts, keys, window[0], mark)
            doomed = [member for member in window if member not in keep]
            removed += await self._remove_events(scripts, keys, doomed)
        return MemoryCompactionResult(len(keep) + removed, len(keep), removed)

    async def _compaction_snapshot(
        self, client: Redis, keys: list[str], scan_limit: int
    ) -> tuple[int, list[bytes], int]:
        """Return the event count, the newest ``scan_limit`` members and the counter, at one instant."""
        events_key, _, counter_key, _ = keys
        async with client.pipeline(transaction=True) as pipe:
            pipe.zcard(events_key)
            pipe.zrange(events_key, -scan_limit, -1)
            pipe.get(counter_key)
            total, window, mark = await pipe.execute()
        return total, window, int(mark or 0)

    async def _remove_events(self, scripts: dict[str, Any], keys: list[str], members: list[bytes]) -> int:
        removed = 0
        for start in range(0, len(members), BATCH):
            removed += await scripts["remove_events"](keys=keys[:2], args=members[start : start + BATCH])
        return removed

    async def _remove_older(
        self, client: Redis, scripts: dict[str, Any], keys: list[str], oldest_kept: bytes, mark: int
    ) -> int:
        """Remove the events sorting before ``oldest_kept`` that existed at the snapshot."""
        removed = 0
        lower = b"-"
        while True:
            batch: list[bytes] = await client.zrange(  # type: ignore[assignment]
                keys[0], lower, b"(" + oldest_kept, bylex=True, offset=0, num=BATCH
            )
            doomed = [member for member in batch if _parse_event_member(member)[0] <= mark]
            removed += await self._remove_events(scripts, keys, doomed)
            if len(batch) < BATCH:
                return removed
            lower = b"(" + batch[-1]

    # -- state -------------------------------------------------------------------------------

    async def put_state(self, thread_id: str, key: str, value: JsonValue) -> None:
        await self.put_state_many(thread_id, {key: value})

    async def put_state_many(self, thread_id: str, entries: dict[str, JsonValue]) -> None:
        """Set several state keys in one ``MULTI``: all are written or none."""
        check_id(thread_id, "thread_id")
        check_state_entries(entries)
        if not entries:
            return
        keys = self._thread_keys(thread_id)
        with self._errors("put_state"):
            client, _ = self._connection()
            async with client.pipeline(transaction=True) as pipe:
                pipe.hset(keys[3], mapping={key: dumps(value) for key, value in entries.items()})
                self._touch(pipe, keys)
                await pipe.execute()

    async def get_state(self, thread_id: str, key: str) -> JsonValue | None:
        check_id(thread_id, "thread_id")
        check_state_key(key)
        state_key = self._thread_keys(thread_id)[3]
        with self._errors("get_state"):
            raw = await self._read(lambda client, _: client.hget(state_key, key))
        return None if raw is None else json.loads(raw)

    async def list_state(self, thread_id: str, prefix: str | None = None) -> dict[str, JsonValue]:
        """Return the thread's state (the keys starting with ``prefix``, if given), sorted by key.

        Read with HSCAN, ``STATE_SCAN_COUNT`` keys a call, so a big state never holds Redis
        for long; other clients' commands run between calls, so the listing is not one
        snapshot: a key present throughout is returned, one written or deleted during the
        listing may be or not (with the value read when it was seen).
        """
        check_id(thread_id, "thread_id")
        check_prefix(prefix)
        state_key = self._thread_keys(thread_id)[3]
        # MATCH is a glob: its special characters in the prefix are escaped to be literal.
        match = None if not prefix else _GLOB_SPECIAL.sub(r"\\\g<0>", prefix) + "*"
        found: dict[str, bytes] = {}
        cursor = 0
        with self._errors("list_state"):
            while True:
                cursor, page = await self._scan_state(state_key, cursor, match)
                # HSCAN may return a key twice (the hash grew or shrank meanwhile): the dict keeps one.
                found.update((_text(key), value) for key, value in page.items())
                if cursor == 0:
                    break
        if prefix:  # MATCH filters already; this makes sure of it
            found = {key: value for key, value in found.items() if key.startswith(prefix)}
        return {key: json.loads(found[key]) for key in sorted(found)}

    async def _scan_state(self, state_key: str, cursor: int, match: str | None) -> tuple[int, dict[bytes, bytes]]:
        """Return the next HSCAN cursor and the keys and values read, sent once more if the connection was lost."""
        reply: Any = await self._read(
            lambda client, _: client.hscan(state_key, cursor, match=match, count=STATE_SCAN_COUNT)
        )
        return int(reply[0]), reply[1]

    async def delete_state(self, thread_id: str, key: str) -> None:
        await self.delete_state_many(thread_id, [key])

    async def delete_state_many(self, thread_id: str, keys: Sequence[str]) -> None:
        """Delete several state keys in one ``MULTI`` (absent keys are fine)."""
        check_id(thread_id, "thread_id")
        keys = check_state_keys(keys)
        if not keys:
            return
        thread_keys = self._thread_keys(thread_id)
        with self._errors("delete_state"):
            client, _ = self._connection()
            async with client.pipeline(transaction=True) as pipe:
                for start in range(0, len(keys), BATCH):
                    pipe.hdel(thread_keys[3], *keys[start : start + BATCH])
                self._touch(pipe, thread_keys)
                await pipe.execute()

    async def compact_state(self, thread_id: str, policy: StateRetentionPolicy) -> tuple[int, int]:
        """Drop the checkpoints and effects of old runs (``MemoryStore.compact_state``).

        The state is read and judged without holding anything; then one script deletes
        the doomed keys only if each still holds the value read. If one was rewritten or
        removed meanwhile (a resumed run moving its latest pointer), nothing is deleted
        and the prune decides again from a fresh read, as the Django backend does. Writes
        to the keys that stay never make it start again, and keys written meanwhile are
        not among those read.
        """
        check_id(thread_id, "thread_id")
        keys = self._thread_keys(thread_id)
        with self._errors("compact_state"):
            client, scripts = self._connection()
            for _ in range(WATCH_RETRIES):
                raw = {_text(key): value for key, value in (await client.hgetall(keys[3])).items()}
                doomed = doomed_state({key: json.loads(value) for key, value in raw.items()}, policy)
                if not doomed:
                    return len(raw), 0
                args: list[Any] = [self._ttl_ms]
                for key in doomed:
                    args += [key, raw[key]]
                if await scripts["delete_unchanged_state"](keys=keys, args=args):
                    return len(raw), len(doomed)
        raise RedisMemoryStoreError(
            f"the state of thread {thread_id!r} changed under {WATCH_RETRIES} attempts to prune it; giving up"
        )

    # -- long-term memory --------------------------------------------------------------------

    async def _dimensions(self, client: Redis) -> int | None:
        """Return the store's embedding length (None: no embedding stored yet).

        Without ``embedding_dimensions`` the first stored embedding fixes the length for
        every process sharing the prefix, as the in-memory store fixes it for itself: the
        upsert script sets ``dims`` with that memory.
        """
        if self.embedding_dimensions is not None:
            return self.embedding_dimensions
        raw = await client.get(self._dims_key)
        return None if raw is None else int(raw)

    @property
    def _dims_key(self) -> str:
        return f"{self.key_prefix}dims"

    async def upsert_long_term_memory(self, memory: LongTermMemory, *, embedding: Embedding | None = None) -> None:
        """Write ``memory`` in one script (see ``_UPSERT_MEMORY``), keeping its first ``created_at``."""
        validate_memory(memory)
        vector = None if embedding is None else check_embedding(embedding, "embedding", self.embedding_dimensions)
        user, scope = memory.user_id, memory.scope
        # The script puts created_at (the given one, or the first write's) between these
        # halves of both JSON arrays, whose formats are those of every earlier version.
        row = dumps([memory.id, user, scope, memory.data, memory.text, list(memory.tags), memory.metadata])
        record = dumps([user, scope, memory.updated_at])
        keys = [self._meta_key(memory.id), *(self._memory_key(kind, user) for kind in ("md", "mv", "mo"))]
        keys += [self._memory_key("ms", user, scope), self._dims_key]
        # The length to check against the store's, or fix as it: where no setting fixes it.
        length = "" if vector is None or self.embedding_dimensions is not None else str(len(vector))
        with self._errors("upsert_long_term_memory"):
            _, scripts = self._connection()
            blob = b"" if vector is None else np.asarray(vector, dtype="<f4").tobytes()
            halves = [row[:-1] + ",", f",{memory.updated_at}]", record[:-1] + ","]
            member = _recency_member(memory.updated_at, memory.id)
            args = [self.key_prefix, memory.id, _user_part(user), member, *halves, memory.created_at, blob, length]
            fixed = await scripts["upsert_memory"](keys=keys, args=args)
        if fixed is not None:  # the store's length is another: nothing was written
            check_embedding(vector, "embedding", int(fixed))

    async def delete_long_term_memory(self, user_id: str | None, memory_id: str) -> None:
        """Delete the memory if it is ``user_id``'s (see ``_DELETE_MEMORY``); else do nothing."""
        check_id(user_id, "user_id", optional=True)
        check_id(memory_id, "memory_id")
        keys = [self._meta_key(memory_id), *(self._memory_key(kind, user_id) for kind in ("md", "mv", "mo"))]
        with self._errors("delete_long_term_memory"):
            _, scripts = self._connection()
            await scripts["delete_memory"](keys=keys, args=[self.key_prefix, memory_id, _user_part(user_id)])

    async def delete_long_term_memories(self, user_id: str | None, *, scope: str | None = None) -> int:
        """Delete the user's memories (only ``scope``'s, if given), ``BATCH`` at a time; return how many.

        Each batch is one script (see ``_DELETE_USER_MEMORIES``), atomic as the other memory
        writes are: a memory goes whole (record, data, embedding, both indexes) or not at
        all, and other clients' commands run between batches. Each batch takes the newest
        memories left, so one written meanwhile goes too unless it comes after the last batch.
        """
        check_user_scope(user_id, scope)
        walked = self._memory_key("mo", user_id) if scope is None else self._memory_key("ms", user_id, scope)
        keys = [walked, *(self._memory_key(kind, user_id) for kind in ("md", "mv", "mo"))]
        deleted = 0
        with self._errors("delete_long_term_memories"):
            _, scripts = self._connection()
            while True:
                removed, taken = await scripts["delete_user_memories"](
                    keys=keys, args=[self.key_prefix, _user_part(user_id), BATCH]
                )
                deleted += removed
                if taken < BATCH:
                    return deleted

    def _index_keys(self, user_id: str | None, scope: str | None, hash_kind: str) -> list[str]:
        """Return the user's (or the user's scope's) recency index and the user's ``hash_kind`` hash."""
        index = self._memory_key("mo", user_id) if scope is None else self._memory_key("ms", user_id, scope)
        return [index, self._memory_key(hash_kind, user_id)]

    async def _read_index_page(self, keys: list[str], lower: bytes, count: int) -> tuple[int, bytes, list[bytes]]:
        """Return how many members follow ``lower`` (up to ``count``), the last, and their id, value pairs.

        One script (``_READ_INDEX_PAGE``), sent once more if the connection was lost.
        """
        reply = await self._read(lambda _, scripts: scripts["read_index_page"](keys=keys, args=[lower, count]))
        return int(reply[0]), reply[1], reply[2:]

    async def _index_pages(
        self, user_id: str | None, scope: str | None, hash_kind: str, limit: int | None = None
    ) -> AsyncIterator[list[tuple[str, bytes]]]:
        """Yield ``(id, value)`` of the user's (and scope's) memories, newest first, ``BATCH`` a page
        (the first ``limit`` of them, if given: up to ``BATCH``, one page, one snapshot).

        Each page is one script reading at most ``BATCH`` memories, so a search of a user
        of any size never holds Redis for longer than a page takes, and other clients'
        commands run between pages. It is therefore not one snapshot. Pages follow on from
        the last member read, not from a rank: a memory present throughout is read exactly
        once, however many others are written or deleted meanwhile. One written or deleted
        during the search may be read or not. One updated during it may be read in its old
        version, its new one, or not at all (an update moving it ahead of the page boundary
        before it was read), but never twice: an id already read is skipped, should an
        update move it past the boundary.
        """
        keys = self._index_keys(user_id, scope, hash_kind)
        seen: set[str] = set()
        lower, wanted = b"-", limit
        while True:
            size = BATCH if wanted is None else min(BATCH, wanted)
            taken, last, flat = await self._read_index_page(keys, lower, size)
            page = []
            for ident, value in zip(flat[::2], flat[1::2], strict=True):
                text = ident.decode()
                if text not in seen:
                    seen.add(text)
                    page.append((text, value))
            if page:
                yield page
            if wanted is not None:
                wanted -= len(page)
            if taken < size or wanted == 0:
                return
            lower = b"(" + last

    async def list_long_term_memories(
        self, user_id: str | None, *, scope: str | None = None, limit: int = 100
    ) -> list[LongTermMemory]:
        """Return the newest ``limit`` memories: up to ``BATCH`` in one script (one snapshot), more
        a page at a time as searches read them (``_index_pages``), so no limit holds Redis long."""
        check_limit(limit)
        check_user_scope(user_id, scope)
        if limit == 0:
            return []
        rows: list[tuple[str, bytes]] = []
        with self._errors("list_long_term_memories"):
            async for page in self._index_pages(user_id, scope, "md", limit):
                rows += page
        return [LongTermMemory(*json.loads(raw)) for _, raw in rows]

    async def search_long_term_memory_text(
        self, user_id: str | None, query: str, *, scope: str | None = None, limit: int = 20
    ) -> list[LongTermMemory]:
        """Return memories containing every word of ``query``, most occurrences first.

        Ranked like the in-memory store (term count, then newest), over the user's and
        scope's memories only, read a page at a time (see ``_index_pages``: not one
        snapshot). Each page's best ``limit`` are kept and ranked once more at the end;
        parsing and ranking more than ``TEXT_INLINE_ROWS`` memories runs in a worker
        thread, so a big user does not hold the event loop.
        """
        check_limit(limit)
        check_user_scope(user_id, scope)
        terms = query_terms(query)
        if not terms or limit == 0:
            return []
        kept: list[LongTermMemory] = []
        with self._errors("search_long_term_memory_text"):
            async for page in self._index_pages(user_id, scope, "md"):
                kept += await _off_loop(len(page) > TEXT_INLINE_ROWS, _best_text, page, terms, limit)
        return await _off_loop(len(kept) > TEXT_INLINE_ROWS, rank_by_term_count, kept, terms, limit)

    async def search_long_term_memory_vector(
        self,
        user_id: str | None,
        query_embedding: Embedding,
        *,
        scope: str | None = None,
        limit: int = 20,
        min_score: float | None = None,
    ) -> list[tuple[LongTermMemory, float]]:
        """Return ``(memory, cosine similarity)`` pairs, most similar first, by exact scan.

        Reads the embeddings of the user's (and scope's) memories only, a page at a time
        (see ``_index_pages``: not one snapshot), ranks each page in numpy (float32 as
        stored, like pgvector) and keeps its best ``limit``, so only one page of
        embeddings is held at once; then reads the winners' records. A page of more than
        ``VECTOR_INLINE_ROWS`` is ranked in a worker thread.
        """
        check_limit(limit)
        floor = check_min_score(min_score)
        query = check_embedding(query_embedding, "query_embedding", self.embedding_dimensions)
        check_user_scope(user_id, scope)
        with self._errors("search_long_term_memory_vector"):
            check_embedding(query, "query_embedding", await self._read(lambda client, _: self._dimensions(client)))
            if limit == 0:
                return []
            kept: list[tuple[str, float]] = []
            async for page in self._index_pages(user_id, scope, "mv"):
                candidates = [(ident, blob) for ident, blob in page if len(blob) == 4 * len(query)]
                kept += await _off_loop(len(candidates) > VECTOR_INLINE_ROWS, _rank, candidates, query, limit, floor)
            ranked = sorted(kept, key=_by_score)[:limit]
            if not ranked:
                return []
            memories, winners = self._memory_key("md", user_id), [ident for ident, _ in ranked]
            raws = await self._read(lambda client, _: client.hmget(memories, winners))
        # A memory deleted between the reads is left out, and so is one moved meanwhile to
        # another scope (one moved to another user has left this user's hash).
        found = [(LongTermMemory(*json.loads(raw)), score) for (_, score), raw in zip(ranked, raws, strict=True) if raw]
        return [(memory, score) for memory, score in found if scope is None or memory.scope == scope]


async def _off_loop(big: bool, work: Callable[..., T], *args: Any) -> T:
    """Return ``work(*args)``: in a worker thread if ``big``, else here (a thread hop costs ~0.1 ms)."""
    if big:
        return await asyncio.to_thread(work, *args)
    return work(*args)


def _best_text(page: list[tuple[str, bytes]], terms: list[str], limit: int) -> list[LongTermMemory]:
    """Return the best ``limit`` memories of a page of memory JSON that match ``terms``."""
    return rank_by_term_count((LongTermMemory(*json.loads(raw)) for _, raw in page), terms, limit)


def _by_score(ranked: tuple[str, float]) -> tuple[float, str]:
    """Sort key of ``(id, score)``: best first, ties by id, as ``_rank`` orders them."""
    return -ranked[1], ranked[0]


def _rank(
    candidates: list[tuple[str, bytes]], query: list[float], limit: int, floor: float | None
) -> list[tuple[str, float]]:
    """Return the best ``limit`` ``(id, cosine similarity)``, best first, ties by id."""
    if not candidates:
        return []
    matrix = np.frombuffer(b"".join(blob for _, blob in candidates), dtype="<f4")
    matrix = matrix.reshape(len(candidates), len(query)).astype(np.float64)
    q = np.asarray(query, dtype=np.float32).astype(np.float64)
    scores = cosine_similarities(matrix, q)
    chosen = np.arange(len(candidates)) if floor is None else np.flatnonzero(scores >= floor)
    if len(chosen) > limit:
        # Everything scoring at least the limit-th best, ties included, then an exact sort.
        kth = np.partition(scores[chosen], len(chosen) - limit)[len(chosen) - limit]
        chosen = chosen[scores[chosen] >= kth]
    ranked = sorted((-float(scores[i]), candidates[i][0]) for i in chosen)[:limit]
    return [(ident, -negative) for negative, ident in ranked]
