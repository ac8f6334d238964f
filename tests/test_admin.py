"""The admin: every changelist renders with data, memories are editable and stay searchable."""

from __future__ import annotations

import pytest
from django.apps import apps
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connections
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils.timezone import now

from afkmemory import models
from afkmemory.memory import LongTermMemory, MemoryEvent
from afkmemory.memory.text import MAX_QUERY_TERMS
from afkmemory.namespaces import encode
from afkmemory.stores import SyncDjangoMemoryStore

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client(client):
    user = get_user_model().objects.create_superuser("admin", "admin@example.com", "pw")
    client.force_login(user)
    return client


@pytest.fixture
def filled():
    store = SyncDjangoMemoryStore()
    store.append_event(MemoryEvent("e1", "thread-1", "u1", "message", 1, {"text": "hi"}, []))
    store.put_state("thread-1", "plan", {"step": 1})
    store.put_state("thread-1", "checkpoint:run-1:0:pre_llm", {"payload": {}})
    store.put_state("thread-1", "effect:run-1:0:call-1", {"input_hash": "h", "output": 1})
    store.upsert_long_term_memory(LongTermMemory("m1", "u1", text="likes tea"), embedding=[1.0] * 8)
    models.GraphCheckpoint.objects.create(thread=models.Thread.objects.get(), step=0, payload={})
    return store


@pytest.mark.parametrize(
    "model", ["thread", "event", "stateentry", "checkpoint", "effect", "graphcheckpoint", "longtermmemory", "storeitem"]
)
def test_changelists_and_change_pages_render(staff_client, filled, model):
    response = staff_client.get(reverse(f"admin:afkmemory_{model}_changelist"))
    assert response.status_code == 200
    obj = getattr(models, response.context["cl"].model.__name__).objects.first()
    if obj is not None:
        assert staff_client.get(reverse(f"admin:afkmemory_{model}_change", args=[obj.pk])).status_code == 200


@pytest.mark.parametrize("timestamp", [253402300800000, 1_800_000_000_000_000, 2**63 - 1], ids=["10000", "us", "max"])
def test_a_timestamp_past_the_year_9999_shows_as_its_number(staff_client, timestamp):
    """The stores take any 64-bit timestamp; a client that sends microseconds by mistake
    writes one no datetime holds, and the lists show the number instead of a 500."""
    store = SyncDjangoMemoryStore()
    store.append_event(MemoryEvent("e1", "thread-1", "u1", "message", timestamp, {}, []))
    store.upsert_long_term_memory(LongTermMemory("m1", "u1", text="x", created_at=timestamp, updated_at=timestamp))
    for model in ("event", "longtermmemory"):
        response = staff_client.get(reverse(f"admin:afkmemory_{model}_changelist"))
        assert response.status_code == 200
        assert str(timestamp) in response.content.decode()


def test_editing_a_memory_keeps_it_searchable(staff_client, filled):
    memory = models.LongTermMemory.objects.get(memory_id="m1")
    url = reverse("admin:afkmemory_longtermmemory_change", args=[memory.pk])
    response = staff_client.post(url, {
        "owner": "", "memory_id": "m1", "user_id": "u1", "scope": "global", "text": "prefers green coffee",
        "data": "{}", "tags": "[]", "metadata": "{}",
    })  # fmt: skip
    assert response.status_code == 302, response.content
    assert [m.id for m in filled.search_long_term_memory_text("u1", "coffee")] == ["m1"]
    assert filled.search_long_term_memory_text("u1", "tea") == []
    memory.refresh_from_db()
    assert memory.embedding is not None  # the embedding survives an edit of the text
    assert memory.updated_at > 1000


def test_thread_links_to_its_records(staff_client, filled):
    response = staff_client.get(reverse("admin:afkmemory_thread_changelist"))
    thread = models.Thread.objects.get()
    assert f"?thread__id__exact={thread.pk}".encode() in response.content
    events = staff_client.get(reverse("admin:afkmemory_event_changelist") + f"?thread__id__exact={thread.pk}")
    assert b"e1" in events.content


def _memory_form(**changes) -> dict:
    return {"owner": "", "memory_id": "m1", "user_id": "u1", "scope": "global", "text": "likes tea",
            "data": "{}", "tags": "[]", "metadata": "{}", **changes}  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("data", ""),  # empty: not null, not an object
        ("data", "[1]"),
        ("metadata", "5"),
        ("tags", ""),
        ("tags", '"abc"'),
        ("tags", "[1, 2]"),
    ],
)
def test_a_memory_the_stores_would_refuse_is_not_saved(staff_client, filled, field, value):
    memory = models.LongTermMemory.objects.get(memory_id="m1")
    url = reverse("admin:afkmemory_longtermmemory_change", args=[memory.pk])
    response = staff_client.post(url, _memory_form(**{field: value}))
    assert response.status_code == 200  # the form again, with the error
    errors = response.context["adminform"].form.errors
    assert field in errors and "JSONString" not in str(errors)  # "got str", not Django's internal type
    saved = models.LongTermMemory.objects.get(pk=memory.pk)
    assert (saved.data, saved.tags, saved.metadata, saved.memory_id) == ({}, [], {}, "m1")


@pytest.mark.parametrize(
    "memory_id",
    [
        "é" * 200,  # 200 characters, 400 bytes: past the stores' limit
        "a/b",  # memories/a/b/ is no memory's URL
        "..",  # resolved away by HTTP clients
        "search",  # memories/search/ is the search
    ],
)
def test_a_new_memory_is_one_the_api_can_name(staff_client, memory_id):
    """The admin saved ids the API refuses and cannot reach (its clients saw them listed, then 404)."""
    response = staff_client.post(reverse("admin:afkmemory_longtermmemory_add"), _memory_form(memory_id=memory_id))
    assert response.status_code == 200 and "memory_id" in response.context["adminform"].form.errors
    assert not models.LongTermMemory.objects.exists()
    assert staff_client.post(reverse("admin:afkmemory_longtermmemory_add"), _memory_form()).status_code == 302


def test_a_memory_is_not_renamed(staff_client, filled):
    memory = models.LongTermMemory.objects.get(memory_id="m1")
    url = reverse("admin:afkmemory_longtermmemory_change", args=[memory.pk])
    assert staff_client.post(url, _memory_form(memory_id="m9", text="likes cocoa")).status_code == 302
    assert models.LongTermMemory.objects.get(pk=memory.pk).memory_id == "m1"  # the text changed, not the id


@pytest.mark.parametrize("model", ["event", "stateentry", "checkpoint", "effect", "graphcheckpoint"])
def test_a_threads_records_are_browsed_and_deleted_not_edited(staff_client, filled, model):
    record = getattr(models, {"stateentry": "StateEntry", "graphcheckpoint": "GraphCheckpoint"}.get(
        model, model.capitalize()
    )).objects.first()  # fmt: skip
    change = reverse(f"admin:afkmemory_{model}_change", args=[record.pk])
    page = staff_client.get(change)
    assert page.status_code == 200 and not page.context["has_change_permission"]  # read-only view
    assert staff_client.post(change, {}).status_code == 403
    assert staff_client.get(reverse(f"admin:afkmemory_{model}_add")).status_code == 403
    delete = reverse(f"admin:afkmemory_{model}_delete", args=[record.pk])
    assert staff_client.post(delete, {"post": "yes"}).status_code == 302
    assert not type(record).objects.filter(pk=record.pk).exists()


def test_a_thread_is_added_with_an_id_the_api_can_name_and_never_renamed(staff_client, filled):
    add = reverse("admin:afkmemory_thread_add")
    for unnamable in ("a/b", ".."):
        refused = staff_client.post(add, {"owner": "", "thread_id": unnamable, "metadata": "{}"})
        assert "thread_id" in refused.context["adminform"].form.errors
    assert (
        "metadata"
        in staff_client.post(add, {"owner": "", "thread_id": "t2", "metadata": ""}).context["adminform"].form.errors
    )
    assert staff_client.post(add, {"owner": "", "thread_id": "t2", "metadata": '{"a": 1}'}).status_code == 302
    thread = models.Thread.objects.get(thread_id="thread-1")
    change = reverse("admin:afkmemory_thread_change", args=[thread.pk])
    assert staff_client.post(change, {"owner": "", "thread_id": "renamed", "metadata": '{"b": 2}'}).status_code == 302
    thread.refresh_from_db()
    assert (thread.thread_id, thread.metadata) == ("thread-1", {"b": 2})  # the id is read-only


def test_a_store_item_key_past_the_stores_limit_is_not_saved(staff_client):
    from afkmemory.stores import SyncDjangoStore

    SyncDjangoStore().put(("ns",), "k", 1)
    item = models.StoreItem.objects.get()
    change = reverse("admin:afkmemory_storeitem_change", args=[item.pk])
    response = staff_client.post(
        change, {"owner": "", "key": "é" * 600, "value": "1", "expires_at_0": "", "expires_at_1": ""}
    )
    assert "key" in response.context["adminform"].form.errors
    assert models.StoreItem.objects.get().key == "k"


def test_the_memory_list_says_which_have_an_embedding(staff_client, filled):
    filled.upsert_long_term_memory(LongTermMemory("m2", "u1", text="no vector"))
    page = staff_client.get(reverse("admin:afkmemory_longtermmemory_changelist"))
    rows = {memory.memory_id: memory.embedded for memory in page.context["cl"].result_list}
    assert rows == {"m1": True, "m2": False}
    assert page.content.count(b'alt="True"') == 1 and page.content.count(b'alt="False"') == 1


# -- the changelists of a thread's records, on PostgreSQL -------------------------------------


class ReadsFromPostgres:
    """Route the app's reads to PostgreSQL, so the admin's pages read it; users stay on SQLite."""

    def db_for_read(self, model, **hints):
        return "postgres" if model._meta.app_label == "afkmemory" else None


RECORDS = {
    models.Event: lambda thread, i: models.Event(thread=thread, event_id=f"e{i}", type="message", timestamp=i),
    models.StateEntry: lambda thread, i: models.StateEntry(thread=thread, key=f"k{i:05}", value=i),
    models.Checkpoint: lambda thread, i: models.Checkpoint(thread=thread, run_id="r", step=i, phase="step_end"),
    models.Effect: lambda thread, i: models.Effect(thread=thread, run_id="r", step=i, tool_call_id="c"),
    models.GraphCheckpoint: lambda thread, i: models.GraphCheckpoint(thread=thread, step=i, payload={}),
}


@pytest.fixture
def postgres_admin(staff_client):
    with override_settings(DATABASE_ROUTERS=[f"{__name__}.ReadsFromPostgres"]):
        yield staff_client


def _fill(model, rows: int, threads: int = 100, prefix: str = "t") -> list[models.Thread]:
    """Write ``rows`` records of ``model`` over ``threads`` new threads to PostgreSQL, and ANALYZE them."""
    made = models.Thread.objects.using("postgres").bulk_create(
        [models.Thread(thread_id=f"{prefix}{i:03}") for i in range(threads)]
    )
    model.objects.using("postgres").bulk_create(
        [RECORDS[model](made[i % threads], i) for i in range(rows)], batch_size=2000
    )
    with connections["postgres"].cursor() as cursor:  # the estimate a deployment's autovacuum keeps
        cursor.execute(f"ANALYZE {model._meta.db_table}")
        cursor.execute("ANALYZE afkmemory_thread")
    return made


def _changelist(client, model, query: str = ""):
    """Return the changelist page of ``model`` and the SQL it ran on PostgreSQL."""
    with CaptureQueriesContext(connections["postgres"]) as captured:
        response = client.get(reverse(f"admin:afkmemory_{model._meta.model_name}_changelist") + query)
    assert response.status_code == 200
    return response, [q["sql"] for q in captured.captured_queries]


def _page_plan(client, model, per_page: int):
    """Return the changelist page of ``model`` and PostgreSQL's plan of the query reading its rows."""
    response, sql = _changelist(client, model)
    [page] = [q for q in sql if f'FROM "{model._meta.db_table}"' in q and f"LIMIT {per_page}" in q]
    with connections["postgres"].cursor() as cursor:
        cursor.execute("EXPLAIN " + page)
        return response, "\n".join(row[0] for row in cursor.fetchall())


@pytest.mark.django_db(databases=["default", "postgres"])
@pytest.mark.parametrize("model", list(RECORDS), ids=lambda model: model.__name__)
def test_a_page_of_a_threads_records_walks_an_index_in_order(postgres_admin, model):
    """A page of 50 reads 50 rows of an index in order: it does not sort the whole table.

    The models' ordering starts with ``thread``, which Django orders by Thread's own ordering
    (its ``thread_id``, after a join no index has): the admin orders by the thread's key.
    """
    threads = _fill(model, 20_000)
    response, plan = _page_plan(postgres_admin, model, 50)
    table = model._meta.db_table
    assert "Sort" not in plan and f"Index Scan using {table}_" in plan, plan
    # A thread's records together, in time or step order.
    rows = response.context["cl"].result_list
    assert {row.thread_id for row in rows} == {threads[0].pk} and len(rows) == 50
    order = [tuple(getattr(row, name) for name in model._meta.ordering[1:]) for row in rows]  # after "thread"
    assert order == sorted(order)


@pytest.mark.django_db(databases=["default", "postgres"])
@pytest.mark.parametrize("model", [models.Event, models.StateEntry], ids=lambda model: model.__name__)
def test_a_search_for_a_big_threads_records_walks_its_index_in_order(postgres_admin, model):
    """Searching a thread's id reads one page of its records from the (thread, ...) index.

    Through a join to the thread, PostgreSQL read a whole thread and sorted it for a page of
    50 (0.8 s for a thread of 1,000,000 events): the thread's key is looked up first.
    """
    threads = _fill(model, 20_000, threads=2)
    response, sql = _changelist(postgres_admin, model, "?q=t001")
    [page] = [q for q in sql if f'FROM "{model._meta.db_table}"' in q and "LIMIT 50" in q]
    with connections["postgres"].cursor() as cursor:
        cursor.execute("EXPLAIN " + page)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "Sort" not in plan and "Index Cond: (thread_id = " in plan, plan  # not a join's condition
    rows = response.context["cl"].result_list
    assert {row.thread_id for row in rows} == {threads[1].pk} and len(rows) == 50


ACCOUNT_RECORDS = {
    models.Thread: lambda owner, i: models.Thread(owner=owner, thread_id=f"t{i:05}"),
    models.LongTermMemory: lambda owner, i: models.LongTermMemory(
        owner=owner, memory_id=f"m{i:05}", text="t", search_text="t", created_at=i, updated_at=-i
    ),
    models.StoreItem: lambda owner, i: models.StoreItem(
        owner=owner, namespace=encode(("users",)), key=f"k{i:05}", value={}, created_at=now(), updated_at=now()
    ),
}


@pytest.mark.django_db(databases=["default", "postgres"])
@pytest.mark.parametrize("model", list(ACCOUNT_RECORDS), ids=lambda model: model.__name__)
def test_a_list_of_accounts_records_opens_newest_first_through_the_primary_key(postgres_admin, model):
    """Threads, memories and items are ordered by columns no index holds across accounts
    (thread id, update time, namespace): every page sorted the whole table. They open newest
    first, walking the primary key's index."""
    owners = (
        get_user_model()
        .objects.using("postgres")
        .bulk_create([get_user_model()(username=f"owner{i}") for i in range(10)])
    )
    with connections["postgres"].cursor() as cursor:
        # A table of its own for the test's transaction: the rollback restores the old one, so
        # no dead rows or statistics of these are left to sway later tests' plans.
        cursor.execute(f"TRUNCATE {model._meta.db_table} CASCADE")
    model.objects.using("postgres").bulk_create(
        [ACCOUNT_RECORDS[model](owners[i % 10], i) for i in range(20_000)], batch_size=2000
    )
    with connections["postgres"].cursor() as cursor:
        cursor.execute(f"ANALYZE {model._meta.db_table}")
    response, plan = _page_plan(postgres_admin, model, 100)
    table = model._meta.db_table
    assert "Sort" not in plan and f"Index Scan Backward using {table}_pkey" in plan, plan
    ids = [row.pk for row in response.context["cl"].result_list]
    assert len(ids) == 100 and ids == sorted(ids, reverse=True)
    assert ids[0] == model.objects.using("postgres").order_by("-pk").values_list("pk", flat=True)[0]


@pytest.mark.django_db(databases=["default", "postgres"])
def test_an_unfiltered_big_table_is_counted_from_the_planners_estimate(postgres_admin):
    """A page of the whole event table does not COUNT(*) it: PostgreSQL's estimate is the total.

    Tables too small for an estimate to matter are counted exactly; filtered pages exactly
    up to 10,000 rows, then no further (a thread's 200,000 events were counted on every page).
    """
    threads = _fill(models.Event, 3, threads=1, prefix="small")
    response, sql = _changelist(postgres_admin, models.Event)
    assert response.context["cl"].result_count == 3
    assert [q for q in sql if "COUNT(*)" in q]

    _fill(models.Event, 20_000)
    response, sql = _changelist(postgres_admin, models.Event)
    assert not [q for q in sql if "COUNT(*)" in q], sql
    assert response.context["cl"].result_count == 20_003  # ANALYZE read every row
    assert len(response.context["cl"].result_list) == 50
    assert b"20003 events" in response.content

    response, sql = _changelist(postgres_admin, models.Event, f"?thread__id__exact={threads[0].pk}")
    assert response.context["cl"].result_count == 3
    assert [q for q in sql if "COUNT(*)" in q and "WHERE" in q]
    response, sql = _changelist(postgres_admin, models.Event, "?type=message")
    assert response.context["cl"].result_count == 10_001
    assert [q for q in sql if "COUNT(*)" in q and "LIMIT 10001" in q and "ORDER BY" not in q], sql
    assert b"10001 events" in response.content


MARK = "kept-for-the-change-page"
JSON_COLUMNS = {
    "event": "payload",
    "stateentry": "value",
    "checkpoint": "value",
    "effect": "value",
    "graphcheckpoint": "payload",
}


@pytest.mark.parametrize(("model", "column"), list(JSON_COLUMNS.items()))
def test_a_changelist_of_records_reads_no_json_and_their_change_page_shows_it(staff_client, model, column):
    """A list of records selects neither their JSON nor their thread's metadata: it shows neither.

    50 tool results or checkpoints of up to the API's value limit each would be read and
    decoded for a page of ids; the change page of one record still shows its JSON.
    """
    store = SyncDjangoMemoryStore()
    store.append_event(MemoryEvent("e1", "thread-1", "u1", "message", 1, {"text": MARK}, [MARK]))
    store.put_state("thread-1", "plan", {"note": MARK})
    store.put_state("thread-1", "checkpoint:run-1:0:pre_llm", {"payload": {"note": MARK}})
    store.put_state("thread-1", "effect:run-1:0:call-1", {"input_hash": "h", "output": MARK})
    thread = models.Thread.objects.get()
    models.GraphCheckpoint.objects.create(thread=thread, step=0, payload={"note": MARK})
    with CaptureQueriesContext(connections["default"]) as captured:
        response = staff_client.get(reverse(f"admin:afkmemory_{model}_changelist"))
    assert response.status_code == 200
    record = response.context["cl"].result_list[0]
    table = record._meta.db_table
    [page] = [q["sql"] for q in captured.captured_queries if q["sql"].startswith(f'SELECT "{table}"."id"')]
    assert f'"{table}"."{column}"' not in page and '"afkmemory_thread"."metadata"' not in page, page
    assert '"afkmemory_thread"."thread_id"' in page  # the thread the list shows, in the same query
    change = staff_client.get(reverse(f"admin:afkmemory_{model}_change", args=[record.pk]))
    assert MARK in change.content.decode()
    # The list's action deletes through the same deferred queryset.
    selected = {"action": "delete_selected", "_selected_action": [record.pk], "post": "yes"}
    assert staff_client.post(reverse(f"admin:afkmemory_{model}_changelist"), selected).status_code == 302
    assert not type(record).objects.filter(pk=record.pk).exists()


@pytest.mark.parametrize(
    ("model", "field", "value"), [("event", "type", "message"), ("checkpoint", "phase", "pre_llm")]
)
def test_the_record_filters_read_no_distinct_values_of_the_table(staff_client, filled, model, field, value):
    """Django's filter on a plain column listed its distinct values: a scan of the whole table
    on every page. The event types and AFK's phases are known."""
    url = reverse(f"admin:afkmemory_{model}_changelist")
    with CaptureQueriesContext(connections["default"]) as captured:
        page = staff_client.get(url)
    assert page.status_code == 200 and f"?{field}={value}" in page.content.decode()
    assert not [q["sql"] for q in captured.captured_queries if "DISTINCT" in q["sql"]]
    filtered = staff_client.get(f"{url}?{field}={value}")
    assert filtered.status_code == 200 and len(filtered.context["cl"].result_list) == 1
    assert len(staff_client.get(f"{url}?{field}=nothing").context["cl"].result_list) == 0


def test_memories_are_filtered_by_a_typed_user_and_scope_without_listing_the_tables_values(staff_client):
    """A memory's user and scope are free strings: the filters take a typed value, where
    Django's would list the column's distinct values, a scan of the memory table per page."""
    store = SyncDjangoMemoryStore()
    for memory_id, user_id, scope in [("m1", "u1", "global"), ("m2", "u1", "work"), ("m3", "u2", "work")]:
        store.upsert_long_term_memory(LongTermMemory(memory_id, user_id, scope=scope, text="tea"))
    url = reverse("admin:afkmemory_longtermmemory_changelist")

    def listed(query: str) -> list[str]:
        page = staff_client.get(url + query)
        assert page.status_code == 200
        return sorted(memory.memory_id for memory in page.context["cl"].result_list)

    with CaptureQueriesContext(connections["default"]) as captured:
        page = staff_client.get(url)
    assert not [q["sql"] for q in captured.captured_queries if "DISTINCT" in q["sql"]]
    assert 'name="scope"' in page.content.decode() and 'name="user_id"' in page.content.decode()
    assert listed("?scope=work") == ["m2", "m3"]
    assert listed("?scope=work&user_id=u1") == ["m2"]
    assert listed("?scope=") == ["m1", "m2", "m3"]  # the box left empty
    assert listed("?scope=nothing") == []
    # The scope box carries the page's other parameters along: the search, the other filter.
    form = staff_client.get(url + "?q=tea&user_id=u1").content.decode()
    assert '<input type="hidden" name="q" value="tea">' in form
    assert '<input type="hidden" name="user_id" value="u1">' in form


@pytest.mark.django_db(databases=["default", "postgres"])
@pytest.mark.parametrize("value", ["a\x00b", "x" * 300])
def test_a_typed_filter_value_no_memory_can_have_lists_them_all_and_says_so(postgres_admin, value):
    """A value the store would refuse (PostgreSQL cannot even compare with a NUL) is the admin's
    'incorrect lookup' (``?e=1``), not a server error."""
    url = reverse("admin:afkmemory_longtermmemory_changelist")
    response = postgres_admin.get(url, {"scope": value})
    assert response.status_code == 302 and response["Location"].endswith("?e=1")


def test_an_accounts_delete_page_lists_its_threads(staff_client, django_user_model):
    """The threads go in a receiver during the delete (models.delete_with_owner); the page of
    what the delete takes still lists them, but not their records, which it would load one
    by one (a thread's own delete page counts them)."""
    user = django_user_model.objects.create_user("leaving")
    SyncDjangoMemoryStore(owner=user).append_event(MemoryEvent("e1", "thread-9", None, "message", 1, {}, []))
    with CaptureQueriesContext(connections["default"]) as queries:
        page = staff_client.get(reverse("admin:auth_user_delete", args=[user.pk])).content.decode()
    assert "thread-9" in page and "Threads: 1" in page
    assert "Event: " not in page and "Events: " not in page  # neither listed nor in the summary
    assert not [q["sql"] for q in queries if "afkmemory_event" in q["sql"]]
    assert staff_client.post(reverse("admin:auth_user_delete", args=[user.pk]), {"post": "yes"}).status_code == 302
    assert not models.Thread.objects.exists() and not models.Event.objects.exists()


def _account_with_rows(name: str, memories: int, items: int, threads: int):
    from afkmemory.stores import SyncDjangoStore

    user = get_user_model().objects.create_user(name)
    memory = SyncDjangoMemoryStore(owner=user)
    for i in range(memories):
        memory.upsert_long_term_memory(LongTermMemory(f"{name}-memory-{i}", "u", text="x"))
    for i in range(items):
        SyncDjangoStore(owner=user).put(("ns",), f"{name}-item-{i}", i)
    for i in range(threads):
        memory.append_event(MemoryEvent(f"e{i}", f"{name}-thread-{i}", None, "message", 1, {}, []))
    return user


def test_an_accounts_delete_page_lists_some_of_its_rows_and_counts_the_rest(staff_client, monkeypatch):
    """Django's page loaded and listed every memory and store item an account's delete
    takes: two minutes for 500,000 memories and 300,000 items. It lists the first few of
    each kind by key, says how many more there are, and its summary counts them all."""
    monkeypatch.setattr(models, "LISTED_ON_DELETE_PAGE", 3)
    # Ordered by "owner", the rows were sorted by the user model's ordering, through a join.
    monkeypatch.setattr(get_user_model()._meta, "ordering", ["username"])
    user = _account_with_rows("leaving", memories=5, items=2, threads=4)
    with CaptureQueriesContext(connections["default"]) as queries:
        page = staff_client.get(reverse("admin:auth_user_delete", args=[user.pk])).content.decode()
    for summary in ("Long-term memories: 5", "Store items: 2", "Threads: 4"):
        assert f"<li>{summary}</li>" in page, page
    assert [f"leaving-memory-{i}" in page for i in range(5)] == [True, True, True, False, False]
    assert [f"leaving-thread-{i}" in page for i in range(4)] == [True, True, True, False]
    assert "leaving-item-0" in page and "leaving-item-1" in page
    assert "<li>Long-term memories: 2 more, not listed</li>" in page
    assert "<li>Threads: 1 more, not listed</li>" in page and "Store items: 0 more" not in page
    reads = [q["sql"] for q in queries if 'FROM "afkmemory_longtermmemory"' in q["sql"]]
    assert reads and all("LIMIT 3" in sql or "COUNT(" in sql for sql in reads), reads
    assert not [sql for sql in reads if "auth_user" in sql.partition("ORDER BY")[2]], reads
    assert staff_client.post(reverse("admin:auth_user_delete", args=[user.pk]), {"post": "yes"}).status_code == 302
    for model in (models.LongTermMemory, models.StoreItem, models.Thread, models.Event):
        assert not model.objects.exists()


def test_deleting_selected_accounts_counts_each_ones_rows_past_those_listed(staff_client, monkeypatch):
    monkeypatch.setattr(models, "LISTED_ON_DELETE_PAGE", 3)
    users = [_account_with_rows(name, memories=n, items=0, threads=0) for name, n in (("ann", 4), ("bob", 2))]
    kept = _account_with_rows("kept", memories=2, items=1, threads=1)
    url = reverse("admin:auth_user_changelist")
    form = {"action": "delete_selected", "_selected_action": [user.pk for user in users]}
    page = staff_client.post(url, form).content.decode()
    assert "<li>Long-term memories: 6</li>" in page, page
    assert "Threads:" not in page and "Store items:" not in page  # they have none: not "Threads: 0"
    # The first three by (owner, key) are ann's; the rest of each account's are counted under it.
    assert [f"ann-memory-{i}" in page for i in range(4)] == [True, True, True, False]
    assert "bob-memory-" not in page and page.count("more, not listed") == 2
    assert "<li>Long-term memories: 1 more, not listed</li>" in page
    assert "<li>Long-term memories: 2 more, not listed</li>" in page
    staff_client.post(url, {**form, "post": "yes"})
    assert set(models.LongTermMemory.objects.values_list("owner", flat=True)) == {kept.pk}
    assert models.StoreItem.objects.get().owner == kept and models.Thread.objects.get().owner == kept


def test_a_project_model_referring_to_memories_gets_djangos_full_account_delete_page(staff_client, monkeypatch):
    """Rows of a project's model referring to memories must be listed and checked (a PROTECT
    among them): then the account's page lists every memory, as Django's does."""
    monkeypatch.setattr(models, "LISTED_ON_DELETE_PAGE", 1)
    user = _account_with_rows("leaving", memories=3, items=3, threads=0)
    real = models.relations_to_delete
    monkeypatch.setattr(
        models, "relations_to_delete", lambda m: ["a project's model"] if m is models.LongTermMemory else real(m)
    )
    page = staff_client.get(reverse("admin:auth_user_delete", args=[user.pk])).content.decode()
    assert all(f"leaving-memory-{i}" in page for i in range(3)) and "Long-term memories: 3" in page
    assert "leaving-item-1" not in page and "<li>Store items: 2 more, not listed</li>" in page


@pytest.mark.parametrize("heard", [False, True], ids=["fast", "receiver"])
def test_an_accounts_delete_outside_the_admin_still_takes_its_memories_and_items_in_one_statement(heard):
    """``cascade_with_owner`` is Django's CASCADE outside the admin's page: one DELETE per
    table, reading no row, unless a receiver of the project's must hear each (then, as
    Django does, each is loaded and heard once)."""
    from django.db.models.signals import post_delete

    user = _account_with_rows("leaving", memories=3, items=2, threads=0)
    deleted: list[str] = []

    def hear(sender: type, instance: models.LongTermMemory, **kwargs: object) -> None:
        deleted.append(instance.memory_id)

    if heard:
        post_delete.connect(hear, sender=models.LongTermMemory)
    try:
        with CaptureQueriesContext(connections["default"]) as queries:
            user.delete()
    finally:
        post_delete.disconnect(hear, sender=models.LongTermMemory)
    memory_sql = [q["sql"] for q in queries if '"afkmemory_longtermmemory"' in q["sql"]]
    item_sql = [q["sql"] for q in queries if '"afkmemory_storeitem"' in q["sql"]]
    assert [sql.split()[0] for sql in item_sql] == ["DELETE"]
    assert [sql.split()[0] for sql in memory_sql] == (["SELECT", "DELETE"] if heard else ["DELETE"])
    assert sorted(deleted) == ([f"leaving-memory-{i}" for i in range(3)] if heard else [])
    assert not models.LongTermMemory.objects.exists() and not models.StoreItem.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_migrations_historical_account_delete_takes_its_threads_memories_and_items():
    """The threads go in a receiver of the real user model's delete, which a data migration's
    historical models do not send to: deleting an account there failed on the threads' key."""
    from django.db.migrations.executor import MigrationExecutor

    user = _account_with_rows("leaving", memories=2, items=1, threads=2)
    historical = MigrationExecutor(connections["default"]).loader.project_state().apps
    historical.get_model(settings.AUTH_USER_MODEL).objects.get(pk=user.pk).delete()
    for model in (models.Thread, models.Event, models.LongTermMemory, models.StoreItem):
        assert not model.objects.exists(), model


def test_deleting_an_account_needs_the_permission_to_delete_its_memories_and_items(client, django_user_model):
    """Some of its memories and items are listed, and checked as Django checks every row it lists."""
    from django.contrib.auth.models import Permission

    deleter = django_user_model.objects.create_user("deleter", password="pw", is_staff=True)
    deleter.user_permissions.set(Permission.objects.filter(codename__in=["view_user", "delete_user"]))
    client.force_login(deleter)
    owner = _account_with_rows("leaving", memories=1, items=1, threads=0)
    account = reverse("admin:auth_user_delete", args=[owner.pk])
    assert client.get(account).context["perms_lacking"] == {"long-term memory", "store item"}
    assert client.post(account, {"post": "yes"}).status_code == 403
    assert models.LongTermMemory.objects.exists() and models.StoreItem.objects.exists()


# -- lists and pages that scale with their tables ----------------------------------------------


def test_a_threads_delete_page_counts_its_records_without_loading_them(staff_client, filled):
    """Django's page listed every record a delete takes, loading each: 30 s for a thread of
    200,000 events. It names the thread and counts each kind of its records, a link to them."""
    store = filled
    for i in range(2, 4):  # ids no CSRF token on the page could hold by chance ("e2" was)
        store.append_event(MemoryEvent(f"event-to-go-{i}", "thread-1", "u1", "message", i, {}, []))
    thread = models.Thread.objects.get()
    url = reverse("admin:afkmemory_thread_delete", args=[thread.pk])
    with CaptureQueriesContext(connections["default"]) as captured:
        page = staff_client.get(url).content.decode()
    records = [q["sql"] for q in captured.captured_queries if '"afkmemory_event"' in q["sql"]]
    assert records and all("COUNT(" in sql for sql in records), records
    events = reverse("admin:afkmemory_event_changelist") + f"?thread__id__exact={thread.pk}"
    assert f'<a href="{events}">3 events</a>' in page
    assert ">1 state entry</a>" in page and ">1 checkpoint</a>" in page and ">1 graph checkpoint</a>" in page
    assert "<li>Events: 3</li>" in page and "<li>Threads: 1</li>" in page  # the summary
    assert "event-to-go" not in page  # no record listed one by one
    assert staff_client.post(url, {"post": "yes"}).status_code == 302
    assert not models.Thread.objects.exists() and not models.Event.objects.exists()


def test_deleting_selected_threads_counts_the_records_of_each(staff_client):
    store = SyncDjangoMemoryStore()
    for thread_id, events in [("a", 2), ("b", 1), ("c", 0)]:
        store.put_state(thread_id, "k", 1)
        for i in range(events):
            store.append_event(MemoryEvent(f"e{i}", thread_id, None, "message", i, {}, []))
    chosen = list(models.Thread.objects.filter(thread_id__in=["a", "b"]).values_list("pk", flat=True))
    url = reverse("admin:afkmemory_thread_changelist")
    page = staff_client.post(url, {"action": "delete_selected", "_selected_action": chosen}).content.decode()
    assert ">2 events</a>" in page and ">1 event</a>" in page and "<li>Events: 3</li>" in page
    assert "<li>State entries: 2</li>" in page and "<li>Threads: 2</li>" in page
    staff_client.post(url, {"action": "delete_selected", "_selected_action": chosen, "post": "yes"})
    assert list(models.Thread.objects.values_list("thread_id", flat=True)) == ["c"]


def test_the_lists_of_memories_and_items_read_no_json_and_no_owner_per_row(staff_client, django_user_model):
    """The item list read each row's owner in a query of its own (101 queries a page), and both
    lists every row's JSON, which they do not show."""
    from afkmemory.stores import SyncDjangoStore

    def pages() -> dict[str, list[str]]:
        sql = {}
        for model in ("longtermmemory", "storeitem"):
            with CaptureQueriesContext(connections["default"]) as captured:
                assert staff_client.get(reverse(f"admin:afkmemory_{model}_changelist")).status_code == 200
            sql[model] = [q["sql"] for q in captured.captured_queries]
        return sql

    def add(n: int) -> None:
        owner = django_user_model.objects.create_user(f"owner{n}")
        SyncDjangoStore(owner=owner).put(("ns",), f"k{n}", {"note": MARK})
        memory = LongTermMemory(f"m{n}", "u1", data={"note": MARK}, tags=[MARK], metadata={"note": MARK})
        SyncDjangoMemoryStore(owner=owner).upsert_long_term_memory(memory)

    add(0)
    one = pages()
    for n in range(1, 5):
        add(n)
    five = pages()
    assert {model: len(sql) for model, sql in five.items()} == {model: len(sql) for model, sql in one.items()}
    for model, table, columns in [
        ("longtermmemory", "afkmemory_longtermmemory", ("data", "tags", "metadata", "embedding", "search_text")),
        ("storeitem", "afkmemory_storeitem", ("value",)),
    ]:
        listed = [sql for sql in five[model] if sql.startswith(f'SELECT "{table}"."id"')]
        assert len(listed) == 1, five[model]
        page = listed[0].replace(f'"{table}"."embedding" IS NOT NULL', "")  # whether there is one, not the vector
        assert not [column for column in columns if f'"{table}"."{column}"' in page], page
    item = models.StoreItem.objects.get(key="k3")
    assert MARK in staff_client.get(reverse("admin:afkmemory_storeitem_change", args=[item.pk])).content.decode()


@pytest.mark.django_db(databases=["default", "postgres"])
@pytest.mark.parametrize("alias", ["default", "postgres"])
def test_memories_are_searched_by_id_or_by_the_words_of_their_text_through_its_index(staff_client, alias):
    """Django's search read every memory's text with LIKE '%...%' (1 s over 100,000 memories):
    the words go through the text index the API searches with, an id matches exactly."""
    store = SyncDjangoMemoryStore(using=alias)
    store.upsert_long_term_memory(LongTermMemory("m1", "u1", text="Prefers green tea in the morning"))
    store.upsert_long_term_memory(LongTermMemory("m2", "u1", text="Drinks coffee"))
    store.upsert_long_term_memory(LongTermMemory("m10", "u2", text="Teas of every kind"))
    url = reverse("admin:afkmemory_longtermmemory_changelist")

    def found(term: str) -> tuple[list[str], list[str]]:
        routers = [f"{__name__}.ReadsFromPostgres"] if alias == "postgres" else []
        with override_settings(DATABASE_ROUTERS=routers), CaptureQueriesContext(connections[alias]) as captured:
            page = staff_client.get(url, {"q": term})
        assert page.status_code == 200
        return sorted(m.memory_id for m in page.context["cl"].result_list), [q["sql"] for q in captured]

    assert found("tea")[0] == ["m1", "m10"]  # stemmed, as the API's search finds them
    assert found("green tea")[0] == ["m1"]  # every word
    assert found("m1")[0] == ["m1"]  # an id, exactly: not m10
    assert found("coffee drinks")[0] == ["m2"]
    assert found("  ")[0] == ["m1", "m10", "m2"]
    memories, sql = found("morning")
    assert memories == ["m1"]
    assert not [q for q in sql if "LIKE" in q.upper()], sql
    index = '"search_vector" @@' if alias == "postgres" else "afkmemory_memory_fts"  # the stored vector (0008)
    assert [q for q in sql if index in q], sql
    # The words are matched inside the subquery, on its own rows: naming the outer query's
    # table there made it correlated, a full scan of the subquery per memory (14 minutes
    # over 100,000 memories).
    assert not [q for q in sql if '"afkmemory_longtermmemory"."search_text"' in q], sql
    assert not [q for q in sql if '"afkmemory_longtermmemory"."search_vector"' in q], sql
    # The list's filters narrow both branches, not only the outer query.
    routers = [f"{__name__}.ReadsFromPostgres"] if alias == "postgres" else []
    with override_settings(DATABASE_ROUTERS=routers), CaptureQueriesContext(connections[alias]) as captured:
        page = staff_client.get(url, {"q": "tea", "user_id": "u2"})
    assert [m.memory_id for m in page.context["cl"].result_list] == ["m10"]
    [listed] = [q["sql"] for q in captured if "UNION" in q["sql"] and "LIMIT" in q["sql"]]
    branches = listed[listed.index("IN (") :].split("UNION")
    assert len(branches) == 2 and all("user_id" in branch for branch in branches), listed


def test_a_memory_search_of_too_many_words_says_so_and_still_finds_an_id(staff_client):
    SyncDjangoMemoryStore().upsert_long_term_memory(LongTermMemory("m1", "u1", text="tea"))
    many = " ".join(f"w{n}" for n in range(MAX_QUERY_TERMS + 1))
    url = reverse("admin:afkmemory_longtermmemory_changelist")
    page = staff_client.get(url, {"q": many})
    assert page.status_code == 200 and list(page.context["cl"].result_list) == []
    assert [str(m) for m in page.context["messages"]] == [
        f"The search has {MAX_QUERY_TERMS + 1} distinct words; a text search takes at most {MAX_QUERY_TERMS} "
        "(a match holds every one of them)"
    ]
    assert [m.memory_id for m in staff_client.get(url, {"q": "m1"}).context["cl"].result_list] == ["m1"]


def test_records_are_listed_in_their_index_order_whatever_the_url_asks(staff_client, filled):
    """Sorting a thread's records by a column read and sorted the whole table (half a second at
    500,000 events): the headers offer no sorting, and ?o= is ignored."""
    url = reverse("admin:afkmemory_event_changelist")

    def page_sql(query: str) -> str:
        with CaptureQueriesContext(connections["default"]) as captured:
            response = staff_client.get(url + query)
        assert response.status_code == 200
        assert 'class="sortable' not in response.content.decode()
        [page] = [q["sql"] for q in captured.captured_queries if q["sql"].startswith('SELECT "afkmemory_event"."id"')]
        return page[page.index("ORDER BY") :]

    assert page_sql("?o=1") == page_sql("") == page_sql("?o=-4.2")
    assert 'afkmemory_event"."thread_id" ASC' in page_sql("?o=1")


def test_records_and_items_are_searched_by_exact_values(staff_client, filled):
    """A substring search (icontains) of a thread's records read the whole table through a join
    of threads: the search is a thread's exact id, which the records' index serves."""
    filled.append_event(MemoryEvent("e2", "thread-10", "u1", "message", 2, {}, []))
    events = reverse("admin:afkmemory_event_changelist")
    listed = staff_client.get(events, {"q": "thread-1"}).context["cl"].result_list
    assert [event.event_id for event in listed] == ["e1"]
    assert list(staff_client.get(events, {"q": "thread"}).context["cl"].result_list) == []
    from afkmemory.stores import SyncDjangoStore

    SyncDjangoStore().put(("ns",), "k1", 1)
    SyncDjangoStore().put(("ns",), "k10", 1)
    items = staff_client.get(reverse("admin:afkmemory_storeitem_changelist"), {"q": "k1"}).context["cl"].result_list
    assert [item.key for item in items] == ["k1"]


@pytest.fixture
def thread_deleter(client, django_user_model):
    """A staff user who may delete accounts and threads, but not a thread's events."""
    from django.contrib.auth.models import Permission

    user = django_user_model.objects.create_user("deleter", password="pw", is_staff=True)
    codenames = ["view_user", "delete_user", "view_thread", "delete_thread", "view_event"]
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    client.force_login(user)
    return client


def test_deleting_a_thread_or_its_account_needs_the_permission_to_delete_its_records(thread_deleter):
    """The account's page lists threads without their records, so Django no longer asked for
    the permission to delete events: a user without it deleted an account and its events."""
    owner = get_user_model().objects.create_user("leaving")
    SyncDjangoMemoryStore(owner=owner).append_event(MemoryEvent("e1", "t", None, "message", 1, {}, []))
    thread = models.Thread.objects.get()
    delete = reverse("admin:afkmemory_thread_delete", args=[thread.pk])
    assert thread_deleter.get(delete).status_code == 403
    assert thread_deleter.post(delete, {"post": "yes"}).status_code == 403
    account = reverse("admin:auth_user_delete", args=[owner.pk])
    assert "thread" in thread_deleter.get(account).context["perms_lacking"]
    assert thread_deleter.post(account, {"post": "yes"}).status_code == 403
    assert models.Event.objects.count() == 1 and get_user_model().objects.filter(pk=owner.pk).exists()


@pytest.mark.parametrize(
    ("model", "query"),
    [("longtermmemory", "text__regex=^(a%2B)%2B$"), ("longtermmemory", "search_text__icontains=a"),
     ("event", "payload__k__regex=a"), ("event", "payload__icontains=a"), ("storeitem", "value__icontains=a"),
     ("event", "type__exact=message"), ("thread", "metadata__icontains=a")],
)  # fmt: skip
def test_a_list_takes_only_the_lookups_it_offers(staff_client, filled, model, query):
    """Django takes any lookup on a model's own columns from the URL, from staff who may only
    view: a regex that SQLite runs in Python (its time doubling with each character), or a
    substring scan of every payload. A list now takes its filters' parameters and its links'."""
    url = reverse(f"admin:afkmemory_{model}_changelist")
    assert staff_client.get(f"{url}?{query}").status_code == 400


def test_the_lookups_a_list_offers_still_filter_it(staff_client, filled):
    thread = models.Thread.objects.get()
    offered = {
        "event": [f"thread__id__exact={thread.pk}", "type=message"],
        "checkpoint": [f"thread__id__exact={thread.pk}", "phase=pre_llm"],
        "longtermmemory": ["user_id=u1", "scope=global"],
        "storeitem": ["expiry=live"],
    }
    for model, queries in offered.items():
        for query in queries:
            response = staff_client.get(f"{reverse(f'admin:afkmemory_{model}_changelist')}?{query}")
            assert response.status_code == 200 and "?e=1" not in response.get("Location", ""), (model, query)
    listed = staff_client.get(reverse("admin:afkmemory_event_changelist"), {"thread__id__exact": thread.pk + 1})
    assert list(listed.context["cl"].result_list) == []  # the thread's records only
    owner = get_user_model().objects.create_user("owner")
    models.LongTermMemory.objects.filter(memory_id="m1").update(owner=owner)
    for model in ("thread", "longtermmemory", "storeitem"):  # an account's rows
        listed = staff_client.get(reverse(f"admin:afkmemory_{model}_changelist"), {"owner__id__exact": owner.pk})
        expected = ["m1"] if model == "longtermmemory" else []
        assert [str(row) for row in listed.context["cl"].result_list] == expected, model


def test_a_field_filter_or_date_hierarchy_offers_its_own_lookups_only(staff_client, filled, monkeypatch):
    """A subclass's field filter or date hierarchy allowed any lookup under its field:
    ?user_id__regex= or ?updated_at__regex= (helper-105)."""
    from afkmemory.admin import LongTermMemoryAdmin, ThreadAdmin

    monkeypatch.setattr(LongTermMemoryAdmin, "list_filter", ("user_id",))
    monkeypatch.setattr(ThreadAdmin, "date_hierarchy", "created_at")
    memories = reverse("admin:afkmemory_longtermmemory_changelist")
    threads = reverse("admin:afkmemory_thread_changelist")
    for url, query, status in ((memories, "user_id__exact=u1", 200), (memories, "user_id__regex=u", 400),
                               (memories, "user_id__icontains=u", 400), (threads, "created_at__year=2026", 200),
                               (threads, "created_at__regex=2", 400)):  # fmt: skip
        assert staff_client.get(f"{url}?{query}").status_code == status, query


def test_facets_are_not_counted(staff_client, filled):
    """?_facets= counted each filter's choices over the whole table, beside the estimated count."""
    url = reverse("admin:afkmemory_event_changelist")
    with CaptureQueriesContext(connections["default"]) as queries:
        staff_client.get(url, {"_facets": "True"})
    assert not [q["sql"] for q in queries if "FILTER (WHERE" in q["sql"] or "COUNT(*) FILTER" in q["sql"]]


def test_a_raw_id_popup_limited_by_limit_choices_to_still_opens(staff_client, filled, monkeypatch):
    """A project's foreign key to threads with limit_choices_to opens the thread list with those
    lookups, which Django allows whatever they are; the list's own allowance refused them."""
    monkeypatch.setattr(models.Thread._meta, "related_fkey_lookups", [{"owner__isnull": False}])
    url = reverse("admin:afkmemory_thread_changelist")
    assert staff_client.get(url, {"owner__isnull": "0", "_popup": "1", "_to_field": "id"}).status_code == 200
    assert staff_client.get(url, {"owner__isnull": "1"}).status_code == 400  # not what the popup sends


def test_exact_searches_take_the_whole_term_spaces_included(staff_client):
    store = SyncDjangoMemoryStore()
    store.append_event(MemoryEvent("e1", "my thread", None, "message", 1, {}, []))
    store.append_event(MemoryEvent("e2", "my", None, "message", 1, {}, []))
    events = staff_client.get(reverse("admin:afkmemory_event_changelist"), {"q": "my thread"})
    assert [event.event_id for event in events.context["cl"].result_list] == ["e1"]
    from afkmemory.stores import SyncDjangoStore

    SyncDjangoStore().put(("ns",), "my key", 1)
    items = staff_client.get(reverse("admin:afkmemory_storeitem_changelist"), {"q": "my key"})
    assert [item.key for item in items.context["cl"].result_list] == ["my key"]
    store.upsert_long_term_memory(LongTermMemory(" m1 ", "u1", text="tea"))
    memories = staff_client.get(reverse("admin:afkmemory_longtermmemory_changelist"), {"q": " m1 "})
    assert [memory.memory_id for memory in memories.context["cl"].result_list] == [" m1 "]


def _seven(model: str) -> None:
    from afkmemory.stores import SyncDjangoStore

    for i in range(7):
        if model == "event":
            SyncDjangoMemoryStore().append_event(MemoryEvent(f"row-{i}", "t", None, "message", i, {}, []))
        elif model == "longtermmemory":
            SyncDjangoMemoryStore().upsert_long_term_memory(LongTermMemory(f"row-{i}", "u", text="x"))
        else:
            SyncDjangoStore().put(("ns",), f"row-{i}", 1)


@pytest.mark.parametrize(
    ("model", "summary"),
    [("event", "Events: 7"), ("longtermmemory", "Long-term memories: 7"), ("storeitem", "Store items: 7")],
)
def test_deleting_every_selected_row_counts_them_without_listing_them(staff_client, model, summary):
    """Select all of a thread's events (or a user's memories, a namespace's items), then
    delete: Django's page collected and listed each one (minutes for 100,000 memories).

    (Its form still carries each selected id back, as Django's confirmation page does.)
    """
    _seven(model)
    rows = apps.get_model("afkmemory", model)
    url = reverse(f"admin:afkmemory_{model}_changelist")
    chosen = list(rows.objects.values_list("pk", flat=True)[:1])
    form = {"action": "delete_selected", "_selected_action": chosen, "select_across": "1", "index": "0"}
    page = staff_client.post(url, form).content.decode()
    assert f"<li>{summary}</li>" in page and "row-3" not in page, page
    staff_client.post(url, {**form, "post": "yes"})
    assert not rows.objects.exists()


def test_a_project_model_referring_to_threads_gets_djangos_full_delete_pages(staff_client, filled, monkeypatch):
    """The delete pages count a thread's records instead of listing them; a model of the
    project's with a foreign key to Thread (a PROTECT among them) must still be listed and
    checked, so with one the pages are Django's own, listing every row."""
    thread = models.Thread.objects.get()
    owner = get_user_model().objects.create_user("leaving")
    models.Thread.objects.filter(pk=thread.pk).update(owner=owner)
    delete = reverse("admin:afkmemory_thread_delete", args=[thread.pk])
    account = reverse("admin:auth_user_delete", args=[owner.pk])
    assert "Event: " not in staff_client.get(delete).content.decode()
    assert "Event: " not in staff_client.get(account).content.decode()
    monkeypatch.setattr(models, "thread_relations_elsewhere", lambda: ["a project's model"])
    assert "Event: " in staff_client.get(delete).content.decode()
    assert "Event: " in staff_client.get(account).content.decode()
