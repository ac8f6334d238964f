"""The stores' compiled hot paths (``afkmemory.stores.prepared`` and the one-statement append).

They must answer exactly as the querysets they were compiled from, for every argument,
owner and database, and fail loudly where an argument would be frozen into the SQL.
"""

from __future__ import annotations

import re
from datetime import UTC, timedelta

import pytest
from django.db import connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from afkmemory import models
from afkmemory.memory.types import LongTermMemory, MemoryEvent
from afkmemory.namespaces import encode_prefix
from afkmemory.querysets import prefix_bounds
from afkmemory.stores import SyncDjangoMemoryStore, SyncDjangoStore
from afkmemory.stores.prepared import PreparedQuery
from tests.conftest import DIMENSIONS
from tests.utils import FLUSHED_APPS

pytestmark = pytest.mark.django_db(databases=["default", "postgres"], transaction=True, available_apps=FLUSHED_APPS)

ALIASES = ["default", "postgres"]

ITEMS = PreparedQuery(
    lambda owner, low, high, now: models.StoreItem.objects.for_owner(owner)
    .live(now)
    .filter(namespace__gte=low, namespace__lt=high)
    .order_by("namespace", "key")
    .values_list("namespace", "key", "value", "expires_at")
)


@pytest.mark.parametrize("alias", ALIASES)
def test_a_prepared_query_answers_as_its_queryset_for_every_argument(alias, django_user_model):
    alice = django_user_model.objects.db_manager(alias).create_user("alice")
    for owner in (None, alice):
        store = SyncDjangoStore(owner=owner, using=alias)
        for i in range(4):
            store.put(("a", str(i)), "k", {"i": i, "owner": str(owner)}, ttl=3600 if i == 3 else None)
        store.put(("b",), "k", "other")
    expiring = models.StoreItem.objects.using(alias).filter(owner=alice).exclude(expires_at=None)
    expiry = expiring.values_list("expires_at", flat=True).get()

    def orm(owner, prefix, now):
        return list(ITEMS.build(owner, *prefix_bounds(prefix), now).using(alias))

    # Every combination twice: the second time runs the compiled statement with new arguments.
    for owner in (None, alice.pk, None, alice.pk):
        for prefix in (encode_prefix(("a",)), encode_prefix(("a", "1")), encode_prefix(("z",))):
            for now in (expiry - timedelta(seconds=1), expiry):
                assert ITEMS.rows(alias, owner, *prefix_bounds(prefix), now) == orm(owner, prefix, now)
    before, at_expiry = (
        ITEMS.rows(alias, alice.pk, *prefix_bounds(encode_prefix(("a",))), now)
        for now in (expiry - timedelta(seconds=1), expiry)
    )
    assert [row[2] for row in before] == [{"i": i, "owner": "alice"} for i in range(4)]  # JSON decoded, one owner
    assert before[3][3] == expiry  # a datetime, as the ORM gives it on either database
    assert [row[2]["i"] for row in at_expiry] == [0, 1, 2]  # the datetime argument is not frozen


def test_a_builder_that_changes_its_argument_is_refused():
    # startswith compiles to LIKE 'k%': the argument would not be found, and no call could change it.
    bad = PreparedQuery(lambda key: models.StoreItem.objects.filter(key__startswith=key).values_list("key"))
    with pytest.raises(RuntimeError, match="argument 0 does not reach the SQL"):
        bad.rows("default", "k")


@pytest.mark.parametrize("alias", ALIASES)
def test_an_empty_limit_asks_nothing(alias):
    store = SyncDjangoMemoryStore(using=alias)
    store.append_event(MemoryEvent("e1", "t", None, "message", 1, {}))
    with CaptureQueriesContext(connections[alias]) as captured:
        assert store.get_recent_events("t", 0) == []
    assert captured.captured_queries == []


@pytest.mark.parametrize("alias", ALIASES)
def test_an_append_to_an_existing_thread_is_one_statement(alias):
    store = SyncDjangoMemoryStore(using=alias)
    store.append_event(MemoryEvent("e1", "t", None, "message", 1, {"n": 1}))  # creates the thread
    with CaptureQueriesContext(connections[alias]) as captured:
        store.append_event(MemoryEvent("e2", "t", "u", "message", 2, {"n": 2}, ["x"]))
    assert [q["sql"].split()[0] for q in captured.captured_queries] == ["INSERT"]
    assert store.get_recent_events("t") == [
        MemoryEvent("e1", "t", None, "message", 1, {"n": 1}),
        MemoryEvent("e2", "t", "u", "message", 2, {"n": 2}, ["x"]),
    ]


@pytest.mark.parametrize("alias", ALIASES)
def test_an_append_goes_to_its_owners_thread_only(alias, django_user_model):
    alice = django_user_model.objects.db_manager(alias).create_user("alice")
    mine, nobodys = SyncDjangoMemoryStore(owner=alice, using=alias), SyncDjangoMemoryStore(using=alias)
    nobodys.append_event(MemoryEvent("e1", "t", None, "message", 1, {}))
    mine.append_event(MemoryEvent("e1", "t", None, "message", 2, {}))  # alice's own thread "t"
    mine.append_event(MemoryEvent("e2", "t", None, "message", 3, {}))
    assert [e.id for e in nobodys.get_recent_events("t")] == ["e1"]
    assert [(e.id, e.timestamp) for e in mine.get_recent_events("t")] == [("e1", 2), ("e2", 3)]


@pytest.mark.parametrize("alias", ALIASES)
def test_a_taken_event_id_inside_a_callers_transaction_leaves_it_usable(alias):
    store = SyncDjangoMemoryStore(using=alias)
    store.append_event(MemoryEvent("e1", "t", None, "message", 1, {}))
    with transaction.atomic(using=alias):
        with pytest.raises(ValueError, match="'e1' already exists in thread 't'"):
            store.append_event(MemoryEvent("e1", "t", None, "message", 2, {}))
        store.append_event(MemoryEvent("e2", "t", None, "message", 3, {}))  # the transaction goes on
    assert [e.id for e in store.get_recent_events("t")] == ["e1", "e2"]


@pytest.mark.parametrize("alias", ALIASES)
def test_a_put_and_a_get_are_one_statement_each(alias):
    store = SyncDjangoStore(using=alias)
    with CaptureQueriesContext(connections[alias]) as captured:
        store.put(("a",), "k", {"v": 1})
        item = store.get(("a",), "k")
    # No BEGIN/COMMIT around the upsert: in autocommit the statement commits itself.
    assert [q["sql"].split()[0] for q in captured.captured_queries] == ["INSERT", "SELECT"]
    assert item is not None and item.value == {"v": 1}


def test_the_stores_read_timestamps_with_psycopgs_compiled_loader_and_leave_djangos_to_the_rest():
    """Django reads ``timestamptz`` in Python (a subclass of psycopg's loader), several times
    slower than psycopg's compiled loader: the store's own statements use psycopg's, for the
    same instants, and the connection's other queries keep Django's."""
    from django.db.backends.postgresql.psycopg_any import BaseTzLoader
    from psycopg.postgres import types
    from psycopg.pq import Format

    oid = types["timestamptz"].oid
    loaders: list[tuple[str, type]] = []

    def record(execute, sql, params, many, context):
        try:
            return execute(sql, params, many, context)
        finally:
            adapters = context["cursor"].cursor.adapters
            loaders.append((sql.split()[0], adapters.get_loader(oid, Format.TEXT)))

    store = SyncDjangoStore(using="postgres")
    with connections["postgres"].execute_wrapper(record):
        put = store.put(("a",), "k", {"v": 1}, ttl=3600)
        got = store.get(("a",), "k")
        [found] = store.search(("a",))
        row = models.StoreItem.objects.using("postgres").values_list("created_at", "updated_at", "expires_at").get()
    assert [(verb, issubclass(loader, BaseTzLoader)) for verb, loader in loaders] == [
        ("INSERT", False),
        ("SELECT", False),
        ("SELECT", False),
        ("SELECT", True),  # the ORM's own query: Django's loader, as Django set up the connection
    ]
    expected = tuple(moment.astimezone(UTC).isoformat() for moment in row)
    for item in (put, got, found):
        assert (item.created_at, item.updated_at, item.expires_at) == expected


def test_paging_through_many_offsets_keeps_a_bounded_number_of_shapes():
    from afkmemory.stores import items
    from afkmemory.stores.prepared import MAX_SHAPES

    store = SyncDjangoStore()
    for i in range(3):
        store.put(("a",), f"k{i}", i)
    pages = [store.search(("a",), limit=1, offset=offset) for offset in range(MAX_SHAPES + 10)]
    assert [[item.key for item in page] for page in pages[:4]] == [["k0"], ["k1"], ["k2"], []]
    assert all(page == [] for page in pages[3:])
    assert 0 < len(items._LIVE_ITEMS_UNDER._compiled) <= MAX_SHAPES


def test_an_argument_no_placeholder_stands_for_runs_the_queryset_itself():
    # A UUID (the primary key of a custom user model, say) reaches the SQL as its field
    # prepares it (here: a string); the query must still answer as the queryset does.
    import uuid

    by_key = PreparedQuery(lambda key: models.StoreItem.objects.filter(key=key).values_list("key", "value"))
    wanted = uuid.uuid4()
    SyncDjangoStore().put(("a",), str(wanted), "found")
    SyncDjangoStore().put(("a",), "other", "not this")
    assert by_key.rows("default", wanted) == [(str(wanted), "found")]
    assert by_key._compiled == {}  # nothing compiled for it
    assert by_key.rows("default", "other") == [("other", "not this")]  # a string is compiled
    assert len(by_key._compiled) == 1


# -- list_namespaces as a loose index scan ---------------------------------------------------------


@pytest.mark.parametrize("alias", ALIASES)
def test_the_namespace_scan_answers_as_distinct_for_every_argument(alias, django_user_model):
    from afkmemory.stores.items import _LIVE_NAMESPACES_UNDER as scan

    alice = django_user_model.objects.db_manager(alias).create_user("alice")
    now = timezone.now()
    for owner in (None, alice):
        store = SyncDjangoStore(owner=owner, using=alias)
        for ns in [("a",), ("a", "b"), ("a", "b", "c"), ("ab",), ("a.b",), ("b",), ("z", "\x7f"), ("é",)]:
            for key in ("k1", "k2", "k3"):
                store.put(ns, key, 1)
        store.put(("a", "gone"), "k", 1, ttl=0)  # expired: not listed
        store.put(("a", "later"), "k", 1, ttl=60)  # live now, expired a minute on
    for owner in (None, alice.pk):
        for prefix in ((), ("a",), ("a", "b"), ("q",)):
            bounds = prefix_bounds(encode_prefix(prefix)) if prefix else (None, None)
            for moment in (now, now + timedelta(seconds=120)):
                for limit, offset in ((100, 0), (2, 0), (2, 1), (1, 5), (3, 50)):
                    args = (owner, *bounds, moment)
                    expected = scan.distinct.rows(alias, *args, limit=limit, offset=offset)
                    assert scan.rows(alias, *args, limit=limit, offset=offset) == expected, (owner, prefix, limit)
    assert scan.rows(alias, None, None, None, now, limit=100, offset=0)[:3] == [
        ("a\x01",),
        ("a\x01b\x01",),
        ("a\x01b\x01c\x01",),
    ]


@pytest.mark.parametrize("alias", ALIASES)
def test_the_namespace_scan_reads_one_row_per_namespace(alias):
    """The point of the scan: 40 namespaces of 50 items each cost 40 index probes, not 2,000 rows."""
    store = SyncDjangoStore(using=alias)
    now = timezone.now()
    models.StoreItem.objects.using(alias).bulk_create(
        models.StoreItem(namespace=encode_prefix(("ns", f"{i % 40:02d}")), key=f"k{i}", value=i,
                         created_at=now, updated_at=now)
        for i in range(2000)
    )  # fmt: skip
    connection = connections[alias]
    with CaptureQueriesContext(connection) as captured:
        assert len(store.list_namespaces(prefix=("ns",))) == 40
    [sql] = [q["sql"] for q in captured.captured_queries]
    assert sql.startswith("WITH RECURSIVE")
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE afkmemory_storeitem")
            cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)
            plan = cursor.fetchone()[0]
        rows_read = _rows_read(plan[0]["Plan"])
        assert rows_read <= 2 * 41, rows_read  # one row per namespace (and one that ends the scan)


def _rows_read(node: dict) -> float:
    """Rows that scans of the items table returned, over all their loops."""
    own = node.get("Actual Rows", 0) * node.get("Actual Loops", 1) if node.get("Relation Name") else 0
    return own + sum(_rows_read(child) for child in node.get("Plans", []))


@pytest.mark.django_db(databases=["postgres_bound"], transaction=True)
def test_on_a_preparing_alias_each_hot_call_is_one_prepared_statement_whatever_its_values():
    """README, "Prepared statements on Django's connection": preparing pays only if a call's
    statement text is the same from one call to the next, its values all parameters. On the
    alias that prepares from a statement's second run, each hot call made with changing
    values sends one statement text, and the server holds it prepared. (A limit is part of
    a statement's shape: a caller that changes it gets one statement per limit.)"""
    alias = "postgres_bound"
    memory, store = SyncDjangoMemoryStore(using=alias), SyncDjangoStore(using=alias)
    for i in range(4):
        memory.append_event(MemoryEvent("e-first", f"t{i}", None, "message", 1, {}))  # the threads
        memory.upsert_long_term_memory(
            LongTermMemory(f"m{i}", f"u{i % 2}", text=f"fact {i}"), embedding=[float(i + 1)] * DIMENSIONS
        )
        store.put(("users", f"u{i}"), "k", {"n": i})
    calls = {
        "append_event": lambda i: memory.append_event(MemoryEvent(f"e{i}", f"t{i % 4}", f"u{i}", "message", i, {})),
        "get_recent_events": lambda i: memory.get_recent_events(f"t{i % 4}", 10),
        "get_state": lambda i: memory.get_state(f"t{i % 4}", f"key{i}"),
        "search_long_term_memory_vector": lambda i: memory.search_long_term_memory_vector(
            f"u{i % 2}", [float(i + 1)] + [1.0] * (DIMENSIONS - 1), limit=3
        ),
        "Store.put": lambda i: store.put(("users", f"u{i % 4}"), "k", {"n": i + 100}),
        "Store.get": lambda i: store.get(("users", f"u{i % 4}"), "k"),
        "Store.search": lambda i: store.search(("users", f"u{i % 4}"), limit=10),
        "Store.list_namespaces": lambda i: store.list_namespaces(prefix=("users", f"u{i % 4}"), limit=10),
    }
    connection = connections[alias]
    sent: set[str] = set()

    def record(execute, sql, params, many, context):
        # psycopg's form of the statement, as the server holds it: %s numbered $1, $2, ...
        numbers = iter(range(1, 1000))
        sent.add(re.sub(r"%s|%%", lambda m: f"${next(numbers)}" if m.group() == "%s" else "%", sql))
        return execute(sql, params, many, context)

    for name, call in calls.items():
        call(0)  # a first call may read what later ones remember (the table's size, for a search)
        sent.clear()
        with connection.execute_wrapper(record):
            for i in range(1, 5):
                call(i)
        with connection.cursor() as cursor:
            cursor.execute("SELECT statement FROM pg_prepared_statements")
            held = {row[0] for row in cursor.fetchall()}
        assert len(sent) == 1 and sent <= held, (name, sent, held)


@pytest.mark.django_db(databases=["postgres_bound"], transaction=True)
def test_on_a_preparing_alias_text_search_is_planned_for_each_call():
    """Text search's right plan depends on its values: a rare word for a user with 200,000
    memories is a GIN lookup (0.6 ms), a user with a few is read through the btree, and the
    generic plan of a prepared statement, made from the small users' calls, read the big
    user's every row (370 ms). It is sent unprepared; the connection prepares the rest as before."""
    alias = "postgres_bound"
    memory = SyncDjangoMemoryStore(using=alias)
    for i in range(4):
        memory.upsert_long_term_memory(LongTermMemory(f"m{i}", f"u{i}", text=f"tea fact {i}"))
    for i in range(8):
        assert [m.id for m in memory.search_long_term_memory_text(f"u{i % 4}", "tea", limit=3)] == [f"m{i % 4}"]
        memory.get_recent_events("t", 10)
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        held = [row[0] for row in cursor.fetchall()]
    assert not [sql for sql in held if "ts_rank_cd" in sql], held
    assert [sql for sql in held if "afkmemory_event" in sql], held  # the threshold came back
