"""Query shapes the benchmarks found slow (BENCHMARKS.md), held to their fixed form.

- Thread reads walk the (thread, timestamp, id) index: through a join on the thread,
  ``get_recent_events(50)`` sorted all 100,000 events of a thread (30 ms, now 0.05 ms).
- Compaction reads every id it may delete through one cursor, fetched a page at a time:
  one snapshot (a second SELECT would see back-dated appends), and no fetch as long as the
  one SELECT of a million ids that took 330 ms.
- Vector search's choice of plan counts over the btree, unordered (the ordered count of
  embedded rows read and sorted every candidate: a quarter of the search's time).
- The REST API's list of memories walks the (owner, -updated_at, memory_id) index: with
  80,000 memories of one account, each page read and sorted all of them (106 ms; 354 ms
  spilled to disk at ``?offset=79000``).
- A user's list walks the (owner, user_id, -updated_at, memory_id) index and stops at its
  limit, whoever the user: with one user of 200,000 memories among 1,000 of 10, a prepared
  statement's generic plan (estimated for a user of ~1 row) read all of the big user's
  memories through the (owner, user_id, scope, -updated_at) index and sorted them (113-140 ms).
- The REST API's cursor pages of memories and threads start their index scan at the cursor
  and count nothing: ``?offset=400000`` read and skipped 400,000 memories (0.7 s), and every
  offset page counted the account's memories (60 ms at 500,000).
"""

from __future__ import annotations

import re

import pytest
from django.contrib.auth import get_user_model
from django.db import connections
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from afkmemory import models
from afkmemory.stores import SyncDjangoMemoryStore

pytestmark = pytest.mark.django_db(databases=["postgres"])

EVENTS = 5000


def _thread_with_events(thread_id: str) -> None:
    thread = models.Thread.objects.using("postgres").create(thread_id=thread_id)
    models.Event.objects.using("postgres").bulk_create(
        [models.Event(thread=thread, event_id=f"e{i}", type="message", timestamp=1000 + i) for i in range(EVENTS)],
        batch_size=1000,
    )
    other = models.Thread.objects.using("postgres").create(thread_id=f"{thread_id}-other")
    models.Event.objects.using("postgres").create(thread=other, event_id="x", type="message", timestamp=1)
    with connections["postgres"].cursor() as cursor:
        cursor.execute("ANALYZE afkmemory_event")
        cursor.execute("ANALYZE afkmemory_thread")


def _plan_of(call) -> tuple[str, object]:
    with CaptureQueriesContext(connections["postgres"]) as captured:
        result = call()
    sql = [q["sql"] for q in captured.captured_queries if "afkmemory_event" in q["sql"]][-1]
    with connections["postgres"].cursor() as cursor:
        cursor.execute("EXPLAIN " + sql)
        return "\n".join(row[0] for row in cursor.fetchall()), result


@pytest.mark.parametrize(
    "read",
    [
        lambda store: store.get_recent_events("t", 50),
        lambda store: store.get_events_since("t", 1000 + EVENTS // 2, 50),
    ],
    ids=["get_recent_events", "get_events_since"],
)
def test_thread_reads_use_the_index_order_and_stop_at_the_limit(read):
    _thread_with_events("t")
    plan, events = _plan_of(lambda: read(SyncDjangoMemoryStore(using="postgres")))
    assert "afkmemory_event_thread_time" in plan, plan
    assert "Sort" not in plan, plan  # no sort of the thread's events
    assert len(events) == 50 and all(e.thread_id == "t" for e in events)


def test_an_event_cursor_page_starts_its_index_scan_at_the_cursor():
    """The REST API's cursor: a page deep in a thread reads from its cursor, not from the
    thread's first event (every page read everything before it: a quadratic walk)."""
    _thread_with_events("t")
    thread = models.Thread.objects.using("postgres").get(thread_id="t")
    middle = models.Event.objects.using("postgres").get(thread=thread, event_id=f"e{EVENTS // 2}")
    page = models.Event.objects.using("postgres").filter(thread=thread).after(middle.timestamp, middle.pk)
    page = page.order_by("timestamp", "id")[:50]
    with connections["postgres"].cursor() as cursor:
        sql, params = page.query.sql_with_params()
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
        plan = cursor.fetchone()[0][0]["Plan"]
    scan = plan["Plans"][0] if plan["Node Type"] == "Limit" else plan
    assert scan["Index Name"] == "afkmemory_event_thread_time", plan
    # Only the cursor's own event is read and dropped (the OR alone dropped the 2,500 before it).
    assert "timestamp" in scan["Index Cond"] and scan.get("Rows Removed by Filter", 0) <= 1, scan
    assert [e.event_id for e in page[:2]] == [f"e{EVENTS // 2 + 1}", f"e{EVENTS // 2 + 2}"]


def test_recent_events_are_still_the_newest_in_order():
    _thread_with_events("t")
    events = SyncDjangoMemoryStore(using="postgres").get_recent_events("t", 3)
    assert [e.id for e in events] == [f"e{EVENTS - 3}", f"e{EVENTS - 2}", f"e{EVENTS - 1}"]
    assert SyncDjangoMemoryStore(using="postgres").get_recent_events("missing", 3) == []


@pytest.mark.parametrize("alias", ["postgres", "default"])
@pytest.mark.django_db(databases=["default", "postgres"])
def test_compaction_reads_all_its_ids_in_one_statement_and_drops_exactly_them(alias, settings):
    """The window and the events older than it come from one SELECT (one snapshot), in
    index order: ties of timestamp neither skip nor repeat an event."""
    from afkmemory.memory.types import RetentionPolicy

    settings.AFKMEMORY = {**settings.AFKMEMORY, "DELETE_BATCH_SIZE": 7}
    thread = models.Thread.objects.using(alias).create(thread_id="c")
    # 60 events, timestamps in runs of 4 equal values, inserted in shuffled id order.
    order = [(i * 37) % 60 for i in range(60)]
    models.Event.objects.using(alias).bulk_create(
        [models.Event(thread=thread, event_id=f"e{i}", type="message", timestamp=1000 + i // 4) for i in order]
    )
    newest = sorted(models.Event.objects.using(alias).filter(thread=thread).values_list("timestamp", "id"))[-10:]
    store = SyncDjangoMemoryStore(using=alias)
    with CaptureQueriesContext(connections[alias]) as captured:
        result = store.compact_thread(
            "c", RetentionPolicy(max_events_per_thread=10, keep_event_types=[], scan_limit=12)
        )
    assert (result.events_before, result.events_after, result.events_removed) == (60, 10, 50)
    left = sorted(models.Event.objects.using(alias).filter(thread=thread).values_list("timestamp", "id"))
    assert left == newest
    reads = [q["sql"] for q in captured.captured_queries if 'FROM "afkmemory_event"' in q["sql"]]
    reads = [sql for sql in reads if "DELETE" not in sql]
    assert len(reads) == 1 and "LIMIT" not in reads[0], reads


def test_vector_search_counts_the_candidates_without_sorting_or_reading_rows():
    """The count that picks exact or HNSW search is an unordered count over the btree.

    It shares one statement with the two rankings: exact at most the threshold, HNSW over it.
    """
    from tests.conftest import DIMENSIONS
    from tests.test_vector_search_postgres import _ranked_by, bulk_load

    # 300 of 6,000 rows: the cost rule (HNSW_TUPLE_COST, off below) would rank them exactly at either threshold.
    with connections["postgres"].cursor() as cursor:
        # A table of its own for the test's transaction: earlier tests' rolled-back memories stay
        # as dead rows, and made a sequential scan with an early stop look cheaper to the planner.
        cursor.execute("TRUNCATE afkmemory_longtermmemory")
    bulk_load(
        [
            models.LongTermMemory(
                memory_id=f"m{i}", user_id="u" if i < 300 else f"other{i % 20}", created_at=i, updated_at=i,
                embedding=[1.0] * DIMENSIONS,
            )
            for i in range(6000)
        ]
    )  # fmt: skip
    store = SyncDjangoMemoryStore(using="postgres")
    for threshold, ranked in ((1000, True), (100, False)):
        config = {"EMBEDDING_DIMENSIONS": DIMENSIONS, "EXACT_SEARCH_THRESHOLD": threshold, "HNSW_TUPLE_COST": 0}
        with (
            override_settings(AFKMEMORY=config),
            CaptureQueriesContext(connections["postgres"]) as captured,
        ):
            hits = store.search_long_term_memory_vector("u", [1.0] * DIMENSIONS, limit=5)
        assert len(hits) == 5
        [statement] = [q["sql"] for q in captured.captured_queries if "COUNT(*)" in q["sql"]]
        with connections["postgres"].cursor() as cursor:
            cursor.execute("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) " + statement)
            plan = "\n".join(row[0] for row in cursor.fetchall())
        # The join's first child, up to its second ("  ->  " at the top level), is the count.
        count = plan[plan.index("Aggregate") : plan.index("\n  ->  ", plan.index("Aggregate"))]
        # Either index that begins (owner, user_id) counts them alike.
        assert "afkmemory_memory_user_scope" in count or "afkmemory_memory_user_recent" in count, plan
        assert "Sort" not in count and "embedding" not in count, plan
        assert _ranked_by(statement)[0] == ("exact" if ranked else "hnsw"), plan


@pytest.mark.parametrize("alias", ["postgres", "default"])
@pytest.mark.django_db(databases=["default", "postgres"])
def test_compaction_deletes_by_id_in_plain_statements_unless_someone_listens(alias, settings):
    """Without delete receivers each batch is one DELETE by primary key (on PostgreSQL one
    array parameter); a receiver of Event's deletes gets every deleted event, as the ORM sends."""
    from django.db.models.signals import post_delete

    from afkmemory.memory.types import RetentionPolicy

    settings.AFKMEMORY = {**settings.AFKMEMORY, "DELETE_BATCH_SIZE": 7}
    store = SyncDjangoMemoryStore(using=alias)
    policy = RetentionPolicy(max_events_per_thread=5, keep_event_types=[])
    for name in ("quiet", "heard"):
        thread = models.Thread.objects.using(alias).create(thread_id=name)
        models.Event.objects.using(alias).bulk_create(
            [models.Event(thread=thread, event_id=f"e{i}", type="message", timestamp=i) for i in range(20)]
        )
    with CaptureQueriesContext(connections[alias]) as captured:
        assert store.compact_thread("quiet", policy).events_removed == 15
    deletes = [q["sql"] for q in captured.captured_queries if q["sql"].startswith("DELETE")]
    assert len(deletes) == 3  # 15 ids in batches of 7
    if alias == "postgres":
        assert all(sql.startswith('DELETE FROM "afkmemory_event" WHERE "id" = ANY(') for sql in deletes), deletes
        assert all(sql.endswith("::bigint[])") for sql in deletes), deletes

    heard: list[str] = []

    def receiver(sender, instance, **kwargs):
        heard.append(instance.event_id)

    post_delete.connect(receiver, sender=models.Event)
    try:
        assert store.compact_thread("heard", policy).events_removed == 15
    finally:
        post_delete.disconnect(receiver, sender=models.Event)
    assert sorted(heard, key=lambda e: int(e[1:])) == [f"e{i}" for i in range(15)]
    assert sorted(
        models.Event.objects.using(alias).filter(thread__thread_id="heard").values_list("timestamp", flat=True)
    ) == list(range(15, 20))


MEMORIES = 20000


def _api_accounts_with_memories(settings) -> tuple:
    """Alice with nine in ten of ``MEMORIES`` memories (``m<i>``, user ``u<i % 50>``, updated at
    ``1000 + i // 3``: ties), Bob with the rest; the API on PostgreSQL, unthrottled."""
    from tests.api_helpers import make_user

    settings.AFKMEMORY = {**settings.AFKMEMORY, "DATABASE_ALIAS": "postgres"}
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"afkmemory": None}}
    alice, bob = make_user("postgres", "alice"), make_user("postgres", "bob")
    with connections["postgres"].cursor() as cursor:  # one statement: bulk_create of as many rows took 5 s
        cursor.execute(
            """
            INSERT INTO afkmemory_longtermmemory
                (owner_id, memory_id, user_id, scope, data, tags, metadata, created_at, updated_at, search_text)
            SELECT CASE WHEN i %% 10 = 0 THEN %s ELSE %s END, 'm' || i, 'u' || i %% 50, 's' || i %% 3,
                   '{}', '[]', '{}', i, 1000 + i / 3, ''  -- ties of updated_at: memory_id breaks them
            FROM generate_series(0, %s - 1) AS i
            """,
            [bob.pk, alice.pk, MEMORIES],
        )
        cursor.execute("ANALYZE afkmemory_longtermmemory")
    return alice, bob


def _deep_cursor_page(client, path: str, deep: int, size: int, settings, **query) -> tuple[object, list[str]]:
    """Return the ``size`` page after the first ``deep`` rows of ``path?query`` by cursor, and its statements."""
    from rest_framework.utils.urls import replace_query_param

    from tests.api_helpers import url

    settings.AFKMEMORY = {**settings.AFKMEMORY, "API_MAX_PAGE_SIZE": deep}
    head = client.get(url(path, page_size=deep, **query))
    assert head.status_code == 200 and len(head.json()["results"]) == deep, head.json()
    with CaptureQueriesContext(connections["postgres"]) as captured:
        page = client.get(replace_query_param(head.json()["next"], "page_size", size))
    assert page.status_code == 200 and set(page.json()) == {"next", "results"}, page.json()
    return page, [q["sql"] for q in captured.captured_queries]


def _scan_of(sql: str) -> dict:
    """Run ``sql`` under EXPLAIN ANALYZE; return the scan below its LIMIT."""
    with connections["postgres"].cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)
        plan = cursor.fetchone()[0][0]["Plan"]
    assert plan["Node Type"] == "Limit", plan
    [scan] = plan["Plans"]
    return scan


@pytest.mark.parametrize(
    ("query", "index", "rows"),
    [
        ({}, "afkmemory_memory_owner_recent", [i for i in range(MEMORIES) if i % 10]),
        ({"user_id": "u7"}, "afkmemory_memory_user_recent", [i for i in range(MEMORIES) if i % 50 == 7]),
    ],
    ids=["account", "user"],
)
def test_a_deep_memory_cursor_page_reads_only_its_page_from_the_index(settings, query, index, rows):
    """``GET memories/?page_size=50&cursor=`` deep in an account: the scan starts at the cursor
    (``updated_at <=`` in the index condition) and reads the page and one more row, besides the
    cursor's ties; no count. From the keyset's OR alone it read every memory before the cursor."""
    from tests.api_helpers import client_for

    alice, _ = _api_accounts_with_memories(settings)
    newest = [f"m{i}" for i in sorted(rows, key=lambda i: (-(i // 3), f"m{i}"))]
    deep = len(newest) * 3 // 4
    page, statements = _deep_cursor_page(client_for(alice), "memories", deep, 50, settings, **query)
    assert [m["id"] for m in page.json()["results"]] == newest[deep : deep + 50]
    assert not [sql for sql in statements if "COUNT(" in sql.upper()], statements
    [sql] = [sql for sql in statements if "afkmemory_longtermmemory" in sql and "LIMIT 51" in sql]
    scan = _scan_of(sql)
    assert scan["Node Type"] == "Index Scan" and scan["Index Name"] == index, scan
    assert "updated_at" in scan["Index Cond"], scan
    # Dropped: the cursor's memory and those tied with it before it (three share an updated_at at
    # most), and none of the thousands before them.
    assert scan.get("Rows Removed by Filter", 0) <= 3 and scan["Actual Rows"] <= 51, scan


def test_a_deep_thread_cursor_page_reads_only_its_page_from_the_index(settings):
    """``GET threads/?page_size=50&cursor=``: ``thread_id >`` the cursor's, on the (owner, thread_id) index."""
    from tests.api_helpers import client_for, make_user

    settings.AFKMEMORY = {**settings.AFKMEMORY, "DATABASE_ALIAS": "postgres"}
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"afkmemory": None}}
    alice, bob = make_user("postgres", "alice"), make_user("postgres", "bob")
    with connections["postgres"].cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO afkmemory_thread (owner_id, thread_id, metadata, created_at, updated_at)
            SELECT CASE WHEN i %% 10 = 0 THEN %s ELSE %s END, 't' || i, '{}', now(), now()
            FROM generate_series(0, %s - 1) AS i
            """,
            [bob.pk, alice.pk, MEMORIES],
        )
        cursor.execute("ANALYZE afkmemory_thread")
    ids = sorted(f"t{i}" for i in range(MEMORIES) if i % 10)
    deep = len(ids) * 3 // 4
    page, statements = _deep_cursor_page(client_for(alice), "threads", deep, 50, settings)
    assert [t["thread_id"] for t in page.json()["results"]] == ids[deep : deep + 50]
    assert not [sql for sql in statements if "COUNT(" in sql.upper()], statements
    [sql] = [sql for sql in statements if "afkmemory_thread" in sql and "LIMIT 51" in sql]
    scan = _scan_of(sql)
    assert scan["Index Name"] == "afkmemory_thread_owner_uniq" and "thread_id" in scan["Index Cond"], scan
    assert scan.get("Rows Removed by Filter", 0) == 0 and scan["Actual Rows"] <= 51, scan


def test_the_api_lists_an_accounts_memories_newest_first_through_the_owner_index(settings):
    """The page query of ``GET /api/v1/memories/`` (no ``user_id``) stops at its limit, unsorted.

    The (owner, user_id, scope, -updated_at) index cannot give an account's memories of every
    user_id in order: without the owner_recent index this was a seq scan and a sort of all of them.
    """
    from tests.api_helpers import client_for, url

    alice, _ = _api_accounts_with_memories(settings)
    with CaptureQueriesContext(connections["postgres"]) as captured:
        response = client_for(alice).get(url("memories", limit=50))
    assert response.status_code == 200, response.json()
    newest = sorted((i for i in range(MEMORIES) if i % 10), key=lambda i: (-(i // 3), f"m{i}"))[:50]
    assert [m["id"] for m in response.json()["results"]] == [f"m{i}" for i in newest]
    [page] = [
        q["sql"] for q in captured.captured_queries if "afkmemory_longtermmemory" in q["sql"] and "LIMIT" in q["sql"]
    ]
    with connections["postgres"].cursor() as cursor:
        cursor.execute("EXPLAIN " + page)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "Index Scan using afkmemory_memory_owner_recent on afkmemory_longtermmemory" in plan, plan
    assert "Sort" not in plan and "Seq Scan" not in plan, plan


#: The big user's memories, and the small users' (each ``SMALL_EACH``), and the memories of no user.
BIG, SMALL_USERS, SMALL_EACH, USERLESS = 3000, 300, 5, 200
#: The list's statement (the one that reads memories ordered and limited).
LIST_SQL = re.compile(r'FROM "afkmemory_longtermmemory" WHERE .* ORDER BY .* LIMIT 20$')


def _skewed_memories(alias: str, owned: bool = True):
    """An account (or no account) whose user "power" has most of its memories, beside many users with a few."""
    owner = get_user_model().objects.db_manager(alias).create_user("skewed") if owned else None
    users = ["power"] * BIG + [f"u{i % SMALL_USERS}" for i in range(SMALL_USERS * SMALL_EACH)] + [None] * USERLESS
    models.LongTermMemory.objects.using(alias).bulk_create(
        [
            models.LongTermMemory(owner=owner, memory_id=f"m{i}", user_id=user, created_at=i, updated_at=i // 2)
            for i, user in enumerate(users)
        ],
        batch_size=1000,
    )
    if alias != "default":
        with connections[alias].cursor() as cursor:
            cursor.execute("ANALYZE afkmemory_longtermmemory")
    newest = {
        user: [
            f"m{i}" for i in sorted((i for i, u in enumerate(users) if u == user), key=lambda i: (-(i // 2), f"m{i}"))
        ]
        for user in ("power", "u7", None)
    }
    return SyncDjangoMemoryStore(owner=owner, using=alias), newest


def _list_plan(alias: str, store: SyncDjangoMemoryStore, user_id: str | None, newest: dict) -> str:
    """List ``user_id``'s 20 newest memories, check them, and return the plan the list's statement ran."""
    with CaptureQueriesContext(connections[alias]) as captured:
        found = store.list_long_term_memories(user_id, limit=20)
    assert [m.id for m in found] == newest[user_id][:20]
    [sql] = [q["sql"] for q in captured.captured_queries if LIST_SQL.search(q["sql"])]
    with connections[alias].cursor() as cursor:
        if alias == "default":
            cursor.execute("EXPLAIN QUERY PLAN " + sql)
            return "\n".join(row[-1] for row in cursor.fetchall())
        cursor.execute("EXPLAIN " + sql)
        return "\n".join(row[0] for row in cursor.fetchall())


def _generic_plan(alias: str, owner, user_id: str) -> str:
    """The plan of the list's prepared statement for ``user_id``, as its cached generic plan runs it."""
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT name, statement, generic_plans FROM pg_prepared_statements")
        [(name, generic)] = [
            (row[0], row[2]) for row in cursor.fetchall() if LIST_SQL.search(row[1]) and "IS NULL" not in row[1]
        ]
        assert generic > 0, "the list did not run the generic plan"
        cursor.execute(f"EXPLAIN EXECUTE {name}({int(owner.pk)}, '{user_id}')")  # EXECUTE takes no bound parameters
        return "\n".join(row[0] for row in cursor.fetchall())


def _assert_walks_the_user_index(alias: str, plan: str) -> None:
    if alias == "default":
        assert "USING INDEX afkmemory_memory_user_recent (owner_id=? AND user_id=?)" in plan, plan
        assert "TEMP B-TREE" not in plan, plan
    else:
        assert "Index Scan using afkmemory_memory_user_recent on afkmemory_longtermmemory" in plan, plan
        assert "Sort" not in plan, plan


@pytest.mark.parametrize("alias", ["postgres", "postgres_bound", "default"])
@pytest.mark.django_db(databases=["default", "postgres", "postgres_bound"])
def test_a_users_list_walks_the_user_index_and_stops_at_the_limit_however_many_memories_they_have(alias):
    """``list_long_term_memories(user_id)`` (and the API's ``?user_id=``) reads its page from the
    (owner, user_id, -updated_at, memory_id) index, unsorted, for the big user and a small one.

    On ``postgres_bound`` the statement is prepared and has run for ten small users first, then
    runs the generic plan (forced here: PostgreSQL picks it itself after five custom plans when
    its cost is no worse). Before the index, that plan, made for a user of a few memories,
    read all of the big user's through the (owner, user_id, scope, -updated_at) index and
    sorted them, or walked the owner's index past all of the others' memories for a small one.
    """
    store, newest = _skewed_memories(alias)
    connection = connections[alias]
    for i in range(10):
        assert len(store.list_long_term_memories(f"u{i}", limit=20)) == SMALL_EACH
    if alias == "postgres_bound":
        with connection.cursor() as cursor:
            cursor.execute("SET plan_cache_mode = force_generic_plan")
    try:
        for user_id in ("power", "u7"):
            plan = _list_plan(alias, store, user_id, newest)
            if alias == "postgres_bound":
                plan = _generic_plan(alias, store.owner, user_id)
            _assert_walks_the_user_index(alias, plan)
    finally:
        if alias == "postgres_bound":
            with connection.cursor() as cursor:
                cursor.execute("RESET plan_cache_mode")


@pytest.mark.parametrize("alias", ["postgres", "default"])
@pytest.mark.parametrize(("owned", "user_id"), [(True, None), (False, "power")], ids=["no_user", "no_owner"])
@pytest.mark.django_db(databases=["default", "postgres"])
def test_a_list_of_no_user_or_no_owner_walks_the_user_index_too(alias, owned, user_id):
    """The memories of no user (``user_id IS NULL``), and a big user's in a store without an
    account (``owner_id IS NULL``, the Python API's default), listed through the same index.

    PostgreSQL takes a column's order from an index only after a column = value, not IS NULL:
    the list also orders by the owner and user it fixes (49 to 240 ms -> under 0.1 ms)."""
    store, newest = _skewed_memories(alias, owned)
    _assert_walks_the_user_index(alias, _list_plan(alias, store, user_id, newest))


#: Memories in the tag test (bob's every tenth, alice's the others), and alice's of the rare tag (all user u1's).
TAGGED, RARE = 20000, 20


#: An index of the user's memories (either of the two that lead with the user) in a plan.
USERS_INDEX = r"Index Cond: \(\(owner_id = \d+\) AND \(\(user_id\)::text = 'u\d'::text\)"


def _tagged_memories(alice, bob) -> None:
    """Alice's memories (and bob's, every tenth) of 40 users, a third tagged "common", 20 of
    alice's and 20 of bob's "rare" (alice's all of user u1)."""
    with connections["postgres"].cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO afkmemory_longtermmemory
                (owner_id, memory_id, user_id, scope, data, tags, metadata, created_at, updated_at, search_text)
            SELECT CASE WHEN i %% 10 = 0 THEN %s ELSE %s END, 'm' || i, 'u' || i %% 40, 'global', '{}',
                   CASE WHEN i %% 1000 IN (1, 10) THEN '["rare", "x"]'::jsonb
                        WHEN i %% 3 = 0 THEN '["common"]'::jsonb
                        ELSE '[]'::jsonb END,
                   '{}', i, 1000 + i / 3, ''
            FROM generate_series(0, %s - 1) AS i
            """,
            [bob.pk, alice.pk, TAGGED],
        )
        cursor.execute("ANALYZE afkmemory_longtermmemory")


def test_the_api_filters_by_tag_through_the_tags_index_and_a_users_tag_through_the_users(settings):
    """``GET memories/?tag=`` finds a rare tag's memories through the GIN index on tags
    (migration 0011), every statement of the request; with ``?user_id=`` it walks the user's
    index as before 0011, for a common tag as for a rare one.

    Without the index, ``tags @> '["rare"]'`` was a filter on every memory of the account (a
    seq scan, or a walk of the owner's index to its end): 300 ms at 500,000 memories, whatever
    the tag. With it but a user too, PostgreSQL (which takes every tag to be rare) combined the
    user's index with the tag's whole list in the GIN index: 47 ms for a tag on 60,000 memories
    of the account, where the user's 500 took 6 ms.
    """
    from tests.api_helpers import client_for, make_user, url

    settings.AFKMEMORY = {**settings.AFKMEMORY, "DATABASE_ALIAS": "postgres"}
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"afkmemory": None}}
    alice, bob = make_user("postgres", "alice"), make_user("postgres", "bob")
    _tagged_memories(alice, bob)
    newest = sorted((i for i in range(TAGGED) if i % 10), key=lambda i: (-(i // 3), f"m{i}"))
    rare = [f"m{i}" for i in newest if i % 1000 == 1]
    common = [i for i in newest if i % 3 == 0 and i % 1000 not in (1, 10)]
    common_of_u1 = [f"m{i}" for i in common if i % 40 == 1]
    assert len(rare) == RARE
    cases = [
        ({"tag": "rare"}, rare, "afkmemory_memory_tags"),
        ({"tag": "rare", "user_id": "u1"}, rare, USERS_INDEX),
        ({"tag": "rare", "user_id": "u2"}, [], USERS_INDEX),
        ({"tag": "common", "user_id": "u1"}, common_of_u1[:50], USERS_INDEX),
    ]
    for query, expected, index in cases:
        with CaptureQueriesContext(connections["postgres"]) as captured:
            response = client_for(alice).get(url("memories", limit=50, **query))
        assert response.status_code == 200, response.json()
        assert [m["id"] for m in response.json()["results"]] == expected, query
        statements = [q["sql"] for q in captured.captured_queries if "@>" in q["sql"]]
        assert statements, captured.captured_queries  # the count, and the page if there is one
        for sql in statements:
            with connections["postgres"].cursor() as cursor:
                cursor.execute("EXPLAIN " + sql)
                plan = "\n".join(row[0] for row in cursor.fetchall())
            assert re.search(index, plan), (query, plan)
            assert "Seq Scan" not in plan, (query, plan)
            if "user_id" in query:
                assert "afkmemory_memory_tags" not in plan, (query, plan)
            if query["tag"] == "common" and "LIMIT" in sql:  # the page walks the user's index, in order
                assert "Sort" not in plan and "Index Scan using afkmemory_memory_user_recent" in plan, (query, plan)
    # A common tag's first page is still the newest of them (the planner may walk the owner's index).
    response = client_for(alice).get(url("memories", tag="common", limit=50))
    assert [m["id"] for m in response.json()["results"]] == [f"m{i}" for i in common][:50]
