"""One conformance suite for agentflow's Store: its own MemoryStore is the oracle for DjangoStore."""

from __future__ import annotations

import random
import time
from datetime import datetime, timedelta

import pytest
from agentflow.errors import StoreConflict
from agentflow.prebuilt import skip_if_done
from agentflow.store import Item, MemoryStore, Store

from afkmemory.models import StoreItem
from afkmemory.stores import DjangoCheckpointer, DjangoMemoryStore, DjangoStore, SyncDjangoMemoryStore
from tests.conftest import DJANGO_ALIASES as ALIASES
from tests.utils import run

pytestmark = pytest.mark.django_db(databases=list(ALIASES.values()))

BACKENDS = ["agentflow-memory", *ALIASES]


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest) -> Store:
    """A fresh, empty Store of each backend."""
    if request.param == "agentflow-memory":
        return MemoryStore()
    return DjangoStore(using=ALIASES[request.param])


@pytest.fixture(params=list(ALIASES))
def django_store(request: pytest.FixtureRequest) -> DjangoStore:
    """DjangoStore only: for checks stricter than agentflow's MemoryStore, which validates little."""
    return DjangoStore(using=ALIASES[request.param])


def tick() -> None:
    """Let the clock move on, so a timestamp that should have changed can be seen not to."""
    time.sleep(0.002)


#: Segments that break naive encodings: separators, LIKE wildcards, case, control and non-ASCII characters.
AWKWARD = [
    "a", "b", "a.b", "ab", "a/b", "a%", "a_", "%", "_", "A", "a b",
    "ä", "日本", "\U0001f600", "a\x01", "a\x02", "\x01", "\x02", "\x7f", "a\\",
]  # fmt: skip
AWKWARD_NAMESPACES = sorted(
    {(s,) for s in AWKWARD}
    | {("a", s) for s in AWKWARD}
    | {("a", "b", s) for s in AWKWARD[:6]}
    | {(s, "x") for s in AWKWARD}
)


def extends(namespace: tuple[str, ...], prefix: tuple[str, ...]) -> bool:
    return namespace[: len(prefix)] == prefix


# -- the protocol ---------------------------------------------------------------------------------


def test_implements_agentflows_protocol(store):
    assert isinstance(store, Store)
    item = run(store.put(("users", "u1"), "color", "blue"))
    assert isinstance(item, Item)
    with pytest.raises(StoreConflict) as caught:
        run(store.put(("users", "u1"), "color", "red", if_absent=True))
    assert (caught.value.namespace, caught.value.key) == (("users", "u1"), "color")


def test_put_returns_what_get_reads(store):
    value = {"text": "ü \U0001f600", "n": [1, 2.5, None, True, False], "nested": {"a": {"b": []}}, "big": 2**62}
    item = run(store.put(("users", "u1", "memories"), "k", value))
    assert (item.namespace, item.key, item.value, item.expires_at) == (("users", "u1", "memories"), "k", value, None)
    assert item.created_at and item.created_at == item.updated_at
    assert datetime.fromisoformat(item.created_at).utcoffset() == timedelta(0)  # ISO-8601 in UTC
    assert run(store.get(("users", "u1", "memories"), "k")) == item


@pytest.mark.parametrize("zone", ["Asia/Tokyo", "America/New_York", "America/Sao_Paulo"])
def test_put_returns_what_the_reads_find_on_sqlite_with_its_own_time_zone(monkeypatch, zone):
    """SQLite stores naive times in its alias's TIME_ZONE: the upsert's returned created_at is
    read in it too, and the reads compiled in it work (their stand-in datetimes were in the
    year 1, which a zone behind UTC turned into the year 0: every read an OverflowError)."""
    from django.db import connections

    from afkmemory.stores import items
    from afkmemory.stores.prepared import builder

    # The thread's connection, and the one statements are built with in an event loop.
    wrappers = [connections["default"], builder("default")]
    monkeypatch.setitem(wrappers[0].settings_dict, "TIME_ZONE", zone)
    for wrapper in wrappers:
        for cached in ("timezone", "timezone_name"):
            monkeypatch.delitem(wrapper.__dict__, cached, raising=False)
    scan = items._LIVE_NAMESPACES_UNDER
    for query in (items._LIVE_ITEM, items._LIVE_ITEMS_AT, items._LIVE_ITEMS_UNDER, scan, scan.first, scan.after,
                  scan.distinct):  # fmt: skip
        monkeypatch.setattr(query, "_compiled", {})  # compiled again, in this zone
    try:
        store = DjangoStore(using="default")
        item = run(store.put(("a",), "k", 1, ttl=3600))
        assert item.created_at == item.updated_at and run(store.get(("a",), "k")) == item
        assert run(store.search(("a",))) == [item] and run(store.list_namespaces()) == [("a",)]
    finally:
        for wrapper in wrappers:
            for cached in ("timezone", "timezone_name"):
                wrapper.__dict__.pop(cached, None)


@pytest.mark.parametrize("value", [None, True, 0, -7, 0.1, "", "text", [], {}, [{"a": None}]])
def test_any_json_value_round_trips(store, value):
    run(store.put(("v",), "k", value))
    assert run(store.get(("v",), "k")).value == value


def test_get_of_a_missing_item_is_none(store):
    run(store.put(("a",), "k", 1))
    assert run(store.get(("a",), "other")) is None
    assert run(store.get(("b",), "k")) is None
    assert run(store.get(("a", "b"), "k")) is None


def test_upsert_keeps_created_at_and_refreshes_updated_at(store):
    first = run(store.put(("a",), "k", 1))
    tick()
    second = run(store.put(("a",), "k", 2))
    assert second.created_at == first.created_at
    assert second.updated_at > first.updated_at
    assert run(store.get(("a",), "k")) == second
    assert second.value == 2


def test_namespace_and_key_address_separate_items(store):
    run(store.put(("a",), "k", "a/k"))
    run(store.put(("a",), "j", "a/j"))
    run(store.put(("a", "b"), "k", "a,b/k"))
    run(store.put(("a.b",), "k", "a.b/k"))
    addresses = [(("a",), "k"), (("a",), "j"), (("a", "b"), "k"), (("a.b",), "k")]
    assert [run(store.get(ns, k)).value for ns, k in addresses] == ["a/k", "a/j", "a,b/k", "a.b/k"]


def test_delete_says_whether_it_removed_something(store):
    run(store.put(("a",), "k", 1))
    run(store.put(("a",), "j", 2))
    assert run(store.delete(("a",), "k")) is True
    assert run(store.get(("a",), "k")) is None
    assert run(store.delete(("a",), "k")) is False
    assert run(store.delete(("nope",), "k")) is False
    assert run(store.get(("a",), "j")).value == 2


# -- if_absent ------------------------------------------------------------------------------------


def test_if_absent_creates_once_then_conflicts_and_changes_nothing(store):
    first = run(store.put(("claims",), "job", {"status": "running"}, if_absent=True))
    assert first.value == {"status": "running"}
    with pytest.raises(StoreConflict):
        run(store.put(("claims",), "job", {"status": "stolen"}, ttl=60, if_absent=True))
    assert run(store.get(("claims",), "job")) == first


def test_if_absent_reclaims_an_expired_item_as_a_fresh_insert(store):
    old = run(store.put(("claims",), "job", "old", ttl=0))
    tick()
    new = run(store.put(("claims",), "job", "new", if_absent=True))
    assert new.value == "new" and new.expires_at is None
    assert new.created_at == new.updated_at > old.created_at
    assert run(store.get(("claims",), "job")) == new


def test_if_absent_after_delete_succeeds(store):
    run(store.put(("claims",), "job", 1, if_absent=True))
    run(store.delete(("claims",), "job"))
    assert run(store.put(("claims",), "job", 2, if_absent=True)).value == 2


# -- TTL ------------------------------------------------------------------------------------------


def test_ttl_sets_expires_at_seconds_after_the_write(store):
    item = run(store.put(("cache",), "doc", "x", ttl=3600))
    lifetime = datetime.fromisoformat(item.expires_at) - datetime.fromisoformat(item.updated_at)
    assert timedelta(seconds=3600) <= lifetime < timedelta(seconds=3601)
    assert run(store.get(("cache",), "doc")) == item


def test_an_expired_item_is_never_returned(store):
    run(store.put(("cache", "x"), "gone", 1, ttl=0))
    run(store.put(("cache", "x"), "kept", 2, ttl=3600))
    run(store.put(("cache", "y"), "gone", 3, ttl=0))
    assert run(store.get(("cache", "x"), "gone")) is None
    assert [i.key for i in run(store.search(("cache",)))] == ["kept"]
    assert run(store.list_namespaces(prefix=("cache",))) == [("cache", "x")]


def test_expired_rows_stay_invisible_before_any_sweep(django_store):
    run(django_store.put(("cache",), "gone", 1, ttl=0))
    assert StoreItem.objects.using(django_store.sync.using).count() == 1  # nothing swept it
    assert run(django_store.get(("cache",), "gone")) is None
    assert run(django_store.search(())) == []
    assert run(django_store.list_namespaces()) == []


def test_upsert_over_an_expired_item_starts_a_new_life(store):
    old = run(store.put(("a",), "k", 1, ttl=0))
    tick()
    new = run(store.put(("a",), "k", 2))
    assert new.created_at == new.updated_at > old.created_at


def test_upsert_without_ttl_removes_the_expiry(store):
    run(store.put(("a",), "k", 1, ttl=60))
    item = run(store.put(("a",), "k", 2))
    assert item.expires_at is None and run(store.get(("a",), "k")).expires_at is None


def test_delete_of_an_expired_item_reports_nothing_removed_and_drops_the_row(django_store):
    run(django_store.put(("a",), "k", 1, ttl=0))
    assert run(django_store.delete(("a",), "k")) is False
    assert not StoreItem.objects.using(django_store.sync.using).exists()


# -- search and list_namespaces -------------------------------------------------------------------


def fill(store, namespaces, keys=("k",)) -> list[tuple[tuple[str, ...], str]]:
    pairs = [(ns, key) for ns in namespaces for key in keys]
    for ns, key in random.Random(7).sample(pairs, len(pairs)):  # insertion order must not matter
        run(store.put(ns, key, {"ns": list(ns), "key": key}))
    return sorted(pairs)


def test_search_orders_by_namespace_then_key_and_paginates(store):
    pairs = fill(store, [("b",), ("a", "z"), ("a",), ("a", "b", "c"), ("ab",)], keys=("k2", "k10", "K", "k1", "é"))
    found = [(i.namespace, i.key) for i in run(store.search(()))]
    assert found == pairs
    assert [(i.namespace, i.key) for i in run(store.search((), limit=4, offset=3))] == pairs[3:7]
    assert [(i.namespace, i.key) for i in run(store.search((), limit=4, offset=23))] == pairs[23:]
    assert run(store.search((), limit=0)) == []
    assert run(store.search((), offset=len(pairs))) == []
    assert [i.value for i in run(store.search(("a", "b")))] == [
        {"ns": ["a", "b", "c"], "key": k} for k in sorted(("k2", "k10", "K", "k1", "é"))
    ]


def test_search_default_limit_is_100(store):
    for i in range(105):
        run(store.put(("many",), f"{i:03d}", i))
    assert [i.value for i in run(store.search(("many",)))] == list(range(100))


PREFIXES = [
    (), ("a",), ("a", "b"), ("a.b",), ("a%",), ("a_",), ("%",), ("_",), ("A",), ("ä",),
    ("a\x01",), ("a\x02",), ("\x01",), ("a", "a\x01"), ("\U0001f600",), ("a\\",), ("zzz",),
]  # fmt: skip


@pytest.mark.parametrize("prefix", PREFIXES)
def test_prefixes_match_awkward_segments_literally(store, prefix):
    run_all = fill(store, AWKWARD_NAMESPACES)
    expected = [(ns, key) for ns, key in run_all if extends(ns, prefix)]
    assert [(i.namespace, i.key) for i in run(store.search(prefix, limit=1000))] == expected
    expected_namespaces = sorted({ns for ns, _ in expected})
    assert run(store.list_namespaces(prefix=prefix, limit=1000)) == expected_namespaces


def test_prefix_a_never_matches_a_dot_b_or_ab(store):
    fill(store, [("a",), ("a", "b"), ("a.b",), ("ab",), ("a%",), ("a_",), ("A",)])
    assert [i.namespace for i in run(store.search(("a",)))] == [("a",), ("a", "b")]
    assert run(store.list_namespaces(prefix=("a",))) == [("a",), ("a", "b")]


def test_list_namespaces_is_distinct_sorted_and_paginated(store):
    namespaces = [("users", "u2"), ("users", "u1", "memories"), ("users", "u1"), ("teams", "t1"), ("users", "u10")]
    fill(store, namespaces, keys=("a", "b", "c"))
    assert run(store.list_namespaces()) == sorted(namespaces)
    assert run(store.list_namespaces(prefix=("users",))) == sorted(ns for ns in namespaces if ns[0] == "users")
    assert run(store.list_namespaces(limit=2, offset=1)) == sorted(namespaces)[1:3]
    assert run(store.list_namespaces(limit=0)) == []
    assert run(store.list_namespaces(prefix=("nobody",))) == []


def test_a_namespace_whose_items_are_deleted_is_no_longer_listed(store):
    run(store.put(("a",), "k", 1))
    run(store.put(("b",), "k", 1))
    run(store.delete(("a",), "k"))
    assert run(store.list_namespaces()) == [("b",)]


# -- agentflow's prebuilt recipes -----------------------------------------------------------------


def test_skip_if_done_caches_a_node_in_the_store(store):
    calls = []

    async def expensive(state, ctx):
        calls.append(state["x"])
        return {"y": state["x"] * 2}

    node = skip_if_done(expensive, store, namespace=("cache", "expensive"), key_from=lambda s: str(s["x"]))
    assert run(node({"x": 2}, None)) == {"y": 4}
    assert run(node({"x": 2}, None)) == {"y": 4}
    assert run(node({"x": 3}, None)) == {"y": 6}
    assert calls == [2, 3]


# -- bad input ------------------------------------------------------------------------------------

BAD_NAMESPACES = [(), [], ["a"], "a", None, ("",), ("a", ""), ("a", 1), (b"a",)]


@pytest.mark.parametrize("namespace", BAD_NAMESPACES)
def test_put_refuses_a_bad_namespace_and_writes_nothing(store, namespace):
    with pytest.raises(ValueError):  # what agentflow raises, whatever is wrong with it
        run(store.put(namespace, "k", 1))
    assert run(store.search(())) == []


@pytest.mark.parametrize("namespace", BAD_NAMESPACES)
def test_reads_refuse_a_bad_namespace(django_store, namespace):
    with pytest.raises(ValueError):
        run(django_store.get(namespace, "k"))
    with pytest.raises(ValueError):
        run(django_store.delete(namespace, "k"))
    if namespace != ():  # () is the prefix of everything
        with pytest.raises(ValueError):
            run(django_store.search(namespace))
        with pytest.raises(ValueError):
            run(django_store.list_namespaces(prefix=namespace))


@pytest.mark.parametrize("namespace", [["a"], "a", None, ("a", 1), (b"a",)])
def test_a_namespace_of_the_wrong_type_is_a_type_error_too(django_store, namespace):
    with pytest.raises(TypeError):
        run(django_store.put(namespace, "k", 1))


@pytest.mark.parametrize(
    ("namespace", "key", "value", "ttl", "error", "message"),
    [
        (("a",), "k", {1, 2}, None, TypeError, "not JSON-serializable"),
        (("a",), "k", object(), None, TypeError, "not JSON-serializable"),
        (("a",), "k", {"x": float("nan")}, None, ValueError, "NaN"),
        (("a",), "k", {1: "x"}, None, TypeError, "non-string key"),
        (("a",), "k", {"a": [1, {"b": float("inf")}]}, None, ValueError, r"value\['a'\]\[1\]\['b'\] is inf"),
        (("a",), "k", {"a": (1, {2: 3})}, None, TypeError, r"value\['a'\]\[1\] has a non-string key 2"),
        (("a",), "k", "a\x00b", None, ValueError, "NUL"),
        (("a",), "k", 1, -1, ValueError, "ttl"),
        (("a",), "k", 1, float("inf"), ValueError, "ttl"),
        (("a",), "k", 1, "60", TypeError, "ttl"),
        (("a",), "k", 1, True, TypeError, "ttl"),
        (("a",), "k", 1, 1e12, ValueError, "ttl"),
        (("a",), "k", 1, 1e12, OverflowError, "9999"),  # what agentflow's stores raise for it
        (("a",), "k", 1, 10**400, OverflowError, "9999"),  # past any float, and too long to print
        (("a",), "k", 1, -(10**400), ValueError, "negative"),
        (("a",), 1, 1, None, TypeError, "key"),
        (("a",), None, 1, None, TypeError, "key"),
        (("a",), "k\x00", 1, None, ValueError, "NUL"),
        (("a\x00",), "k", 1, None, ValueError, "NUL"),
        (("\ud800",), "k", 1, None, ValueError, "surrogate"),
        (("a",), "é" * 513, 1, None, ValueError, "1026 bytes in UTF-8; the limit is 1024"),
        (("é" * 512,), "k", 1, None, ValueError, "1025 bytes in UTF-8 once encoded"),
    ],
)
def test_put_refuses_bad_input_clearly_and_writes_nothing(django_store, namespace, key, value, ttl, error, message):
    with pytest.raises(error, match=message):
        run(django_store.put(namespace, key, value, ttl=ttl))
    assert not StoreItem.objects.using(django_store.sync.using).exists()


def test_put_returns_the_value_as_a_get_reads_it(django_store):
    value = {"pair": (1, (2, 3)), "text": "a\\u0000b", "none": None, "float": 0.1}  # a backslash, not a NUL
    item = run(django_store.put(("a",), "k", value))
    assert item.value == {"pair": [1, [2, 3]], "text": "a\\u0000b", "none": None, "float": 0.1}
    assert run(django_store.get(("a",), "k")).value == item.value
    # The value travels as its JSON text: quotes, escapes and characters past ASCII survive.
    for tricky in ['it\'s "quoted" \\ {x}', "line\nbreak\u2028\U0001f600 日本", None, [None, True, -1.5]]:
        assert run(django_store.put(("a",), "t", tricky)).value == tricky
        assert run(django_store.get(("a",), "t")).value == tricky


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, None])
def test_bad_limits_and_offsets_are_refused(django_store, bad):
    for call in (
        lambda: django_store.search((), limit=bad),
        lambda: django_store.search((), offset=bad),
        lambda: django_store.list_namespaces(limit=bad),
        lambda: django_store.list_namespaces(offset=bad),
    ):
        with pytest.raises((TypeError, ValueError)):
            run(call())


def test_the_largest_namespace_and_key_fit(django_store):
    # 1023 bytes of segment plus the terminator: exactly the limit; "é" is two bytes in UTF-8.
    namespace = ("é" * 511 + "x",)
    key = "é" * 512
    item = run(django_store.put(namespace, key, 1))
    assert run(django_store.get(namespace, key)) == item
    assert run(django_store.search(namespace)) == [item]


# -- tenancy --------------------------------------------------------------------------------------


def test_owners_see_only_their_own_items(django_store, django_user_model):
    alias = django_store.sync.using
    alice = django_user_model.objects.db_manager(alias).create_user("alice")
    bob = django_user_model.objects.db_manager(alias).create_user("bob")
    stores = {
        name: DjangoStore(owner=owner, using=alias)
        for name, owner in [("alice", alice), ("bob", bob), ("nobody", None)]
    }
    for name, s in stores.items():
        run(s.put(("profile",), "name", name, if_absent=True))  # the same address is free for each owner
    for name, s in stores.items():
        assert run(s.get(("profile",), "name")).value == name
        assert [i.value for i in run(s.search(()))] == [name]
        assert run(s.list_namespaces()) == [("profile",)]
    assert run(stores["bob"].delete(("profile",), "name")) is True
    assert run(stores["alice"].get(("profile",), "name")).value == "alice"
    assert DjangoStore(owner=alice.pk, using=alias).sync.get(("profile",), "name").value == "alice"
    by_text = DjangoStore(owner=str(alice.pk), using=alias)  # a key as text is the user's key
    assert run(by_text.get(("profile",), "name")).value == "alice"
    assert [item.value for item in run(by_text.search(("profile",)))] == ["alice"]


@pytest.mark.parametrize("store", [DjangoStore, DjangoCheckpointer, DjangoMemoryStore, SyncDjangoMemoryStore])
def test_an_owner_without_a_primary_key_is_refused(store):
    """Such an owner's rows would be nobody's: it would read and write the ownerless threads and items."""
    from django.contrib.auth.models import AnonymousUser, User

    for owner in (AnonymousUser(), User(username="unsaved"), "not a key"):
        with pytest.raises(ValueError, match="saved user"):
            store(owner=owner)


@pytest.mark.parametrize("store", ["DjangoStore", "DjangoMemoryStore", "DjangoCheckpointer"])
def test_a_store_on_an_alias_settings_lack_says_so_when_made(store):
    """It was made, then its first call raised a bare KeyError('nope') (or ConnectionDoesNotExist)."""
    from django.utils.connection import ConnectionDoesNotExist

    from afkmemory import stores

    with pytest.raises(
        ConnectionDoesNotExist, match=r"database alias 'nope' is not in settings.DATABASES \(\['default'"
    ):
        getattr(stores, store)(using="nope")
