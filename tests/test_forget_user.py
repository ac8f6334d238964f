""" "Forget this user": ``delete_long_term_memories`` on every backend, and ``DELETE memories/?user_id=``."""

from __future__ import annotations

import pytest
from django.db import connections, transaction
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from afkmemory import models
from afkmemory.memory import LongTermMemory
from afkmemory.stores import SyncDjangoMemoryStore, bulk
from tests.api_helpers import API, dimensions, errors, make_user, url
from tests.conftest import DIMENSIONS, DJANGO_ALIASES
from tests.utils import run

pytest_plugins = ["tests.api_fixtures"]  # the alias, alice/bob and api/other fixtures
pytestmark = pytest.mark.django_db(databases=list(DJANGO_ALIASES.values()))


def mem(ident: str, user: str | None = "u1", scope: str = "global", text: str = "likes green tea", updated: int = 1000):
    return LongTermMemory(ident, user, scope, {}, text, [], {}, 1000, updated)


def vec(*head: float) -> list[float]:
    return [*head, *[0.0] * (DIMENSIONS - len(head))]


def ids(memories) -> list[str]:
    return sorted(memory.id for memory in memories)


def fill(store) -> None:
    """u1's memories in two scopes, and the same words for u2 and for no user."""
    for ident, user, scope, updated in [
        ("a1", "u1", "global", 1001),
        ("a2", "u1", "global", 1002),
        ("a3", "u1", "work", 1003),
        ("a4", "u1", "work", 1003),
        ("b1", "u2", "global", 1001),
        ("b2", "u2", "work", 1004),
        ("n1", None, "global", 1005),
        ("n2", None, "work", 1005),
    ]:
        run(store.upsert_long_term_memory(mem(ident, user, scope, updated=updated), embedding=vec(1, 0.5)))


def found(store, user: str | None, scope: str | None = None) -> dict[str, list[str]]:
    """What each way of reading finds of ``user``'s (and ``scope``'s) memories."""
    return {
        "list": ids(run(store.list_long_term_memories(user, scope=scope))),
        "text": ids(run(store.search_long_term_memory_text(user, "green tea", scope=scope))),
        "vector": ids(m for m, _ in run(store.search_long_term_memory_vector(user, vec(1, 0.5), scope=scope))),
    }


def everywhere(*memory_ids: str) -> dict[str, list[str]]:
    return {"list": list(memory_ids), "text": list(memory_ids), "vector": list(memory_ids)}


# -- every backend ----------------------------------------------------------------------------


def test_forgetting_a_user_deletes_every_memory_of_theirs_and_nothing_else(memory_store):
    fill(memory_store)
    assert run(memory_store.delete_long_term_memories("u1")) == 4
    assert found(memory_store, "u1") == everywhere()
    assert found(memory_store, "u1", "work") == everywhere()
    assert found(memory_store, "u2") == everywhere("b1", "b2")
    assert found(memory_store, None) == everywhere("n1", "n2")
    assert run(memory_store.delete_long_term_memories("u1")) == 0  # nothing left: safe to repeat

    # The user can be remembered again, and forgotten again: the indexes stayed consistent.
    run(memory_store.upsert_long_term_memory(mem("a1", scope="work"), embedding=vec(1, 0.5)))
    assert found(memory_store, "u1", "work") == everywhere("a1")
    assert run(memory_store.delete_long_term_memories("u1")) == 1
    assert found(memory_store, "u1") == everywhere()


def test_with_a_scope_only_that_scope_goes(memory_store):
    fill(memory_store)
    assert run(memory_store.delete_long_term_memories("u1", scope="work")) == 2
    assert found(memory_store, "u1") == everywhere("a1", "a2")
    assert found(memory_store, "u1", "work") == everywhere()
    assert found(memory_store, "u2", "work") == everywhere("b2")
    assert found(memory_store, None, "work") == everywhere("n2")
    assert run(memory_store.delete_long_term_memories("u1", scope="nope")) == 0
    assert run(memory_store.delete_long_term_memories("nobody")) == 0


def test_none_is_the_memories_without_a_user(memory_store):
    fill(memory_store)
    assert run(memory_store.delete_long_term_memories(None)) == 2
    assert found(memory_store, None) == everywhere()
    assert found(memory_store, "u1") == everywhere("a1", "a2", "a3", "a4")
    assert found(memory_store, "u2") == everywhere("b1", "b2")


def test_a_memory_moved_to_another_user_goes_with_its_new_user(memory_store):
    fill(memory_store)
    run(memory_store.upsert_long_term_memory(mem("a3", "u2", "work", updated=1010)))
    assert run(memory_store.delete_long_term_memories("u1")) == 3
    assert found(memory_store, "u2") == everywhere("a3", "b1", "b2")  # its embedding moved with it


@pytest.mark.parametrize(
    ("user_id", "scope", "error"),
    [
        ("", None, ValueError),
        (1, None, TypeError),
        ("u" * 256, None, ValueError),
        ("nul\x00", None, ValueError),
        ("u1", "", ValueError),
        ("u1", 5, TypeError),
    ],
)
def test_bad_arguments_are_refused_and_delete_nothing(memory_store, user_id, scope, error):
    fill(memory_store)
    with pytest.raises(error, match="user_id" if scope is None else "scope"):
        run(memory_store.delete_long_term_memories(user_id, scope=scope))
    assert found(memory_store, "u1") == everywhere("a1", "a2", "a3", "a4")


def test_many_memories_go_in_several_batches(memory_store, settings, monkeypatch):
    """Batches of 3 (DELETE_BATCH_SIZE on Django, BATCH on Redis), with runs of equal updated_at."""
    settings.AFKMEMORY = {**settings.AFKMEMORY, "DELETE_BATCH_SIZE": 3}
    monkeypatch.setattr("afkmemory.memory.redis.BATCH", 3, raising=False)
    for i in range(20):
        run(memory_store.upsert_long_term_memory(mem(f"m{i:02}", scope=f"s{i % 2}", updated=2000 + i // 4)))
    run(memory_store.upsert_long_term_memory(mem("other", "u2")))
    assert run(memory_store.delete_long_term_memories("u1", scope="s1")) == 10
    assert ids(run(memory_store.list_long_term_memories("u1"))) == [f"m{i:02}" for i in range(0, 20, 2)]
    assert run(memory_store.delete_long_term_memories("u1")) == 10
    assert run(memory_store.list_long_term_memories("u1")) == []
    assert ids(run(memory_store.list_long_term_memories("u2"))) == ["other"]


# -- Redis: the indexes ------------------------------------------------------------------------


def test_redis_leaves_no_key_of_the_forgotten_user(request):
    import redis

    from tests.redis_server import redis_memory_store

    store = redis_memory_store(request, embedding_dimensions=DIMENSIONS)
    fill(store)
    assert run(store.delete_long_term_memories("u1")) == 4
    client = redis.Redis.from_url(store.url)
    try:
        keys = sorted(key.decode()[len(store.key_prefix) :] for key in client.scan_iter(f"{store.key_prefix}*"))
    finally:
        client.close()
    # Records of u2's and no user's memories, their hashes and indexes.
    assert keys == [
        "md:-",
        "md:2:u2",
        "mm:b1",
        "mm:b2",
        "mm:n1",
        "mm:n2",
        "mo:-",
        "mo:2:u2",
        "ms:-:global",
        "ms:-:work",
        "ms:2:u2:global",
        "ms:2:u2:work",
        "mv:-",
        "mv:2:u2",
    ]


# -- Django: batches, transactions, plans, accounts ---------------------------------------------


@pytest.mark.parametrize("alias", list(DJANGO_ALIASES.values()))
def test_django_deletes_by_id_in_batches_of_DELETE_BATCH_SIZE(alias, settings):
    settings.AFKMEMORY = {**settings.AFKMEMORY, "DELETE_BATCH_SIZE": 3}
    store = SyncDjangoMemoryStore(using=alias)
    for i in range(7):
        store.upsert_long_term_memory(mem(f"m{i}", updated=1000 + i // 3))
    store.upsert_long_term_memory(mem("other", "u2"))
    with CaptureQueriesContext(connections[alias]) as captured:
        assert store.delete_long_term_memories("u1") == 7
    deletes = [q["sql"] for q in captured.captured_queries if q["sql"].startswith("DELETE")]
    assert len(deletes) == 3, deletes  # 3 + 3 + 1
    assert all(sql.startswith('DELETE FROM "afkmemory_longtermmemory" WHERE') for sql in deletes), deletes
    if alias != "default":
        assert all("= ANY(" in sql for sql in deletes), deletes  # by id, one array parameter
    for i in range(6):
        store.upsert_long_term_memory(mem(f"m{i}"))
    with CaptureQueriesContext(connections[alias]) as captured:
        assert store.delete_long_term_memories("u1") == 6
    reads = [q["sql"] for q in captured.captured_queries if q["sql"].startswith("SELECT")]
    deletes = [q["sql"] for q in captured.captured_queries if q["sql"].startswith("DELETE")]
    assert (len(reads), len(deletes)) == (3, 2)  # the third read finds nothing: no DELETE
    assert models.LongTermMemory.objects.using(alias).count() == 1


@pytest.mark.parametrize("alias", list(DJANGO_ALIASES.values()))
def test_django_leaves_other_accounts_memories_of_the_same_user_id(alias):
    alice = SyncDjangoMemoryStore(owner=make_user(alias, "alice"), using=alias)
    bob = SyncDjangoMemoryStore(owner=make_user(alias, "bob"), using=alias)
    nobody = SyncDjangoMemoryStore(using=alias)
    for store in (alice, bob, nobody):
        store.upsert_long_term_memory(mem("m"), embedding=vec(1))
    assert alice.delete_long_term_memories("u1") == 1
    assert alice.list_long_term_memories("u1") == []
    assert len(bob.list_long_term_memories("u1")) == 1 and len(nobody.list_long_term_memories("u1")) == 1
    assert len(bob.search_long_term_memory_vector("u1", vec(1))) == 1
    assert nobody.delete_long_term_memories("u1") == 1  # the store without an account: its own only
    assert len(bob.list_long_term_memories("u1")) == 1


@pytest.mark.parametrize("alias", ["default", "postgres"])
@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
def test_each_batch_commits_on_its_own(alias, settings, monkeypatch):
    """Outside a transaction, a call that fails midway keeps what its earlier batches deleted."""
    settings.AFKMEMORY = {**settings.AFKMEMORY, "DELETE_BATCH_SIZE": 2}
    store = SyncDjangoMemoryStore(using=alias)
    for i in range(5):
        store.upsert_long_term_memory(mem(f"m{i}", updated=1000 + i))
    calls = []
    delete = bulk.DeleteByPk.__call__

    def second_fails(self, batch):
        calls.append(batch)
        if len(calls) == 2:
            raise RuntimeError("interrupted")
        return delete(self, batch)

    monkeypatch.setattr(bulk.DeleteByPk, "__call__", second_fails)
    with pytest.raises(RuntimeError, match="interrupted"):
        store.delete_long_term_memories("u1")
    assert ids(store.list_long_term_memories("u1")) == ["m0", "m1", "m2"]  # the newest two went
    monkeypatch.undo()
    assert store.delete_long_term_memories("u1") == 3  # the next call finishes the job
    assert not connections[alias].in_atomic_block


@pytest.mark.parametrize("alias", list(DJANGO_ALIASES.values()))
def test_a_memory_written_while_it_runs_survives_only_if_the_walk_passed_it(alias, settings, monkeypatch):
    """As documented: the batches walk down from the newest updated_at, so a memory written
    during the call is deleted if it lands below where the walk is, and kept if above."""
    settings.AFKMEMORY = {**settings.AFKMEMORY, "DELETE_BATCH_SIZE": 2}
    store = SyncDjangoMemoryStore(using=alias)
    for i in range(5):
        store.upsert_long_term_memory(mem(f"m{i}", updated=1000 + i))
    delete = bulk.DeleteByPk.__call__

    def writing_during_the_first_batch(self, batch):
        if not store.list_long_term_memories("u1", scope="late"):
            store.upsert_long_term_memory(mem("newer", scope="late", updated=5000))  # above the walk
            store.upsert_long_term_memory(mem("older", scope="late", updated=1))  # below it
        return delete(self, batch)

    monkeypatch.setattr(bulk.DeleteByPk, "__call__", writing_during_the_first_batch)
    assert store.delete_long_term_memories("u1") == 6
    assert ids(store.list_long_term_memories("u1")) == ["newer"]


@pytest.mark.parametrize("alias", ["default", "postgres"])
def test_inside_a_callers_transaction_it_is_that_transaction(alias, settings):
    settings.AFKMEMORY = {**settings.AFKMEMORY, "DELETE_BATCH_SIZE": 2}
    store = SyncDjangoMemoryStore(using=alias)
    for i in range(5):
        store.upsert_long_term_memory(mem(f"m{i}"))

    class Undone(Exception):
        pass

    with pytest.raises(Undone), transaction.atomic(using=alias):
        assert store.delete_long_term_memories("u1") == 5
        raise Undone
    assert len(store.list_long_term_memories("u1")) == 5  # rolled back with it


@pytest.mark.parametrize("scope", [None, "s1"])
@pytest.mark.parametrize("user", ["big", None])
@pytest.mark.django_db(databases=["postgres"])
def test_each_batch_reads_through_the_users_index_and_stops_at_the_batch(user, scope, settings):
    """No seq scan, for a user's and for no user's memories, with a scope or without: each
    batch's read goes through the index the filter starts, from where the last one stopped."""
    from tests.test_vector_search_postgres import bulk_load

    settings.AFKMEMORY = {**settings.AFKMEMORY, "DELETE_BATCH_SIZE": 50}
    with connections["postgres"].cursor() as cursor:
        cursor.execute("TRUNCATE afkmemory_longtermmemory")  # no dead rows of earlier tests to skew the plan
    bulk_load(
        [
            models.LongTermMemory(
                memory_id=f"m{i}", user_id=user if i < 2000 else f"other{i % 50}", scope=f"s{i % 2}",
                created_at=i, updated_at=i // 3,
            )
            for i in range(6000)
        ]
    )  # fmt: skip
    store = SyncDjangoMemoryStore(using="postgres")
    with CaptureQueriesContext(connections["postgres"]) as captured:
        assert store.delete_long_term_memories(user, scope=scope) == (2000 if scope is None else 1000)
    reads = [q["sql"] for q in captured.captured_queries if q["sql"].startswith("SELECT")]
    assert len(reads) == (2000 if scope is None else 1000) // 50 + 1
    # The one whose order the read asks for, or (the planner's choice for the last few) the other.
    index = "afkmemory_memory_user_"
    with connections["postgres"].cursor() as cursor:
        for i, sql in enumerate(reads):
            cursor.execute("EXPLAIN " + sql)
            plan = "\n".join(row[0] for row in cursor.fetchall())
            assert index in plan and "Seq Scan" not in plan, plan
            if i == 0:  # the first read of a big user stops at the batch (the last few may sort what is left)
                assert "Sort" not in plan and ("user_recent" if scope is None else "user_scope") in plan, plan
    assert models.LongTermMemory.objects.using("postgres").count() == 6000 - (2000 if scope is None else 1000)


# -- REST ---------------------------------------------------------------------------------------


def remember(client, memory_id: str, user_id: str | None, scope: str = "global") -> None:
    body = {
        "id": memory_id,
        "user_id": user_id,
        "scope": scope,
        "text": "likes green tea",
        "embedding": [1.0] * dimensions(),
    }
    response = client.post(url("memories"), body, format="json")
    assert response.status_code == 201, response.json()


def listed(client, **query) -> list[str]:
    response = client.get(url("memories", limit=100, **query))
    assert response.status_code == 200, response.json()
    return sorted(m["id"] for m in response.json()["results"])


def searched(client, user_id: str | None) -> list[str]:
    body = {"user_id": user_id, "query": "green tea", "embedding": [1.0] * dimensions()}
    response = client.post(url("memories", "search"), body, format="json")
    assert response.status_code == 200, response.json()
    return sorted(hit["memory"]["id"] for hit in response.json()["results"])


def forget(client, **query):
    return client.delete(url("memories", **query))


@pytest.fixture
def memories(api, other):
    """Alice's memories of u1 (two scopes), u2 and no user; Bob's of u1."""
    for memory_id, user_id, scope in [
        ("a1", "u1", "global"),
        ("a2", "u1", "work"),
        ("b1", "u2", "global"),
        ("n1", None, "global"),
    ]:
        remember(api, memory_id, user_id, scope)
    remember(other, "bob1", "u1")


def test_rest_forgets_one_user_of_the_callers_account(api, other, memories):
    response = forget(api, user_id="u1")
    assert response.status_code == 200 and response.json() == {"deleted": 2}
    assert listed(api) == ["b1", "n1"] and listed(api, user_id="u1") == []
    assert searched(api, "u1") == [] and searched(api, "u2") == ["b1"]
    assert listed(other) == ["bob1"] and searched(other, "u1") == ["bob1"]  # Bob's u1 is another user
    assert forget(api, user_id="u1").json() == {"deleted": 0}  # idempotent: a retry is safe


def test_rest_forgets_one_scope_or_the_memories_without_a_user(api, memories):
    assert forget(api, user_id="u1", scope="work").json() == {"deleted": 1}
    assert listed(api) == ["a1", "b1", "n1"]
    assert forget(api, without_user="true").json() == {"deleted": 1}
    assert listed(api) == ["a1", "b1"] and searched(api, None) == []
    assert forget(api, without_user="false", user_id="u2").json() == {"deleted": 1}
    assert listed(api) == ["a1"]


def test_another_account_cannot_forget_the_callers_memories(api, other, memories):
    assert forget(other, user_id="u2").json() == {"deleted": 0}
    assert forget(other, without_user="true").json() == {"deleted": 0}
    assert listed(api) == ["a1", "a2", "b1", "n1"]


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({}, "user_id"),  # never everything
        ({"scope": "work"}, "user_id"),
        ({"user_id": "u1", "without_user": "true"}, "user_id"),
        ({"without_user": "false"}, "user_id"),
        ({"without_user": "yes"}, "without_user"),
        ({"user_id": ""}, "user_id"),
        ({"user_id": "u" * 256}, "user_id"),
        ({"user_id": "u1", "scope": ""}, "scope"),
        ({"user_id": ["u1", "u2"]}, "user_id"),
        ({"user_id": "u1", "tag": "x"}, "tag"),  # not a filter it ignores: refused
        ({"user_id": "u1", "limit": "1"}, "limit"),
    ],
)
def test_rest_refuses_a_delete_that_does_not_name_one_user(api, memories, query, field):
    assert field in errors(forget(api, **query))
    assert listed(api) == ["a1", "a2", "b1", "n1"]


def test_rest_says_whether_neither_or_both_of_user_id_and_without_user_were_given(api, memories):
    assert "neither was given" in errors(forget(api))["user_id"][0]
    assert "not both" in errors(forget(api, user_id="u1", without_user="true"))["user_id"][0]


def test_rest_needs_credentials_and_counts_against_the_throttle(api, alias, memories, settings):
    assert APIClient().delete(url("memories", user_id="u1")).status_code == 401
    assert len(listed(api)) == 4
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"afkmemory": "2/minute"}}
    assert [forget(api, user_id=f"x{i}").status_code for i in range(3)] == [200, 200, 429]


def test_rest_documents_the_delete_in_the_schema(api):
    schema = api.get(API + "schema/", HTTP_ACCEPT="application/json").json()
    operation = schema["paths"]["/api/v1/memories/"]["delete"]
    assert operation["operationId"] == "memories_forget"
    assert {p["name"] for p in operation["parameters"]} == {"user_id", "without_user", "scope"}
    deleted = operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    assert schema["components"]["schemas"][deleted.rsplit("/", 1)[1]]["properties"]["deleted"]["type"] == "integer"
    assert {"400", "401", "429"} <= set(operation["responses"])
