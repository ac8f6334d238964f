"""The store's queries use its indexes: get is one unique-index lookup, a prefix search a range scan."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from afkmemory.models import StoreItem
from afkmemory.namespaces import encode
from afkmemory.stores import SyncDjangoStore

pytestmark = pytest.mark.django_db(databases=["default", "postgres"])

ALIASES = ["default", "postgres"]
ROWS = 4000


def populate(alias: str, owner) -> SyncDjangoStore:
    """Enough rows that PostgreSQL's planner prefers an index wherever one applies."""
    if owner is not None:
        owner = owner.objects.db_manager(alias).create_user("u")
    now = timezone.now()
    StoreItem.objects.using(alias).bulk_create(
        StoreItem(
            owner=owner,
            namespace=encode((f"ns-{i % 100}",)),
            key=f"k{i}",
            value=i,
            created_at=now,
            updated_at=now,
            expires_at=now - timedelta(seconds=1) if i % 200 == 0 else None,
        )
        for i in range(ROWS)
    )
    if connections[alias].vendor == "postgresql":
        with connections[alias].cursor() as cursor:
            cursor.execute("ANALYZE afkmemory_storeitem")
    return SyncDjangoStore(owner=owner, using=alias)


def plan_of(alias: str, operation) -> str:
    """Return the query plan of the (single) SELECT the store operation runs."""
    connection = connections[alias]
    with CaptureQueriesContext(connection) as captured:
        operation()
    selects = [q["sql"] for q in captured.captured_queries if q["sql"].lstrip().upper().startswith(("SELECT", "WITH"))]
    assert len(selects) == 1, selects
    explain = "EXPLAIN QUERY PLAN " if connection.vendor == "sqlite" else "EXPLAIN "
    with transaction.atomic(using=alias), connection.cursor() as cursor:
        cursor.execute(explain + selects[0])
        return "\n".join(str(row[-1]) for row in cursor.fetchall())


def index_for(owner) -> str:
    return "afkmemory_storeitem_uniq" if owner is None else "afkmemory_storeitem_owner_uniq"


@pytest.mark.parametrize("alias", ALIASES)
@pytest.mark.parametrize("owned", [False, True], ids=["no-owner", "owner"])
def test_get_is_one_lookup_in_the_unique_index(alias, owned, django_user_model):
    store = populate(alias, django_user_model if owned else None)
    owner = store.owner
    plan = plan_of(alias, lambda: store.get(("ns-7",), "k707"))
    if alias == "default":
        assert f"SEARCH afkmemory_storeitem USING INDEX {index_for(owner)} (" in plan
        assert "namespace=? AND key=?" in plan
    else:
        assert f"Index Scan using {index_for(owner)} on afkmemory_storeitem" in plan
        assert "(namespace)::text = 'ns-7\x01'::text) AND ((key)::text = 'k707'::text)" in plan
        assert "Seq Scan" not in plan and "Sort" not in plan


@pytest.mark.parametrize("alias", ALIASES)
@pytest.mark.parametrize("owned", [False, True], ids=["no-owner", "owner"])
def test_prefix_search_is_a_range_scan_in_index_order(alias, owned, django_user_model):
    store = populate(alias, django_user_model if owned else None)
    owner = store.owner
    found = []
    plan = plan_of(alias, lambda: found.extend(store.search(("ns-7",), limit=10)))
    assert [item.key for item in found] == sorted(f"k{i}" for i in range(7, ROWS, 100))[:10]
    if alias == "default":
        assert f"SEARCH afkmemory_storeitem USING INDEX {index_for(owner)} (" in plan
        assert "namespace>? AND namespace<?" in plan
    else:
        assert f"Index Scan using {index_for(owner)} on afkmemory_storeitem" in plan
        assert "((namespace)::text >= 'ns-7\x01'::text) AND ((namespace)::text < 'ns-7\x02'::text)" in plan
        assert "Seq Scan" not in plan and "Sort" not in plan  # the index hands rows over in order
    assert "LIKE" not in plan.upper()


@pytest.mark.parametrize("alias", ALIASES)
def test_list_namespaces_walks_the_same_range(alias):
    store = populate(alias, None)
    found = []
    plan = plan_of(alias, lambda: found.extend(store.list_namespaces(prefix=("ns-7",))))
    assert found == [("ns-7",)]
    if alias == "default":
        assert "SEARCH afkmemory_storeitem USING INDEX afkmemory_storeitem_uniq (namespace>? AND namespace<?)" in plan
        assert "TEMP B-TREE" not in plan
    else:
        assert "afkmemory_storeitem_uniq" in plan and "Seq Scan" not in plan


@pytest.mark.parametrize("alias", ALIASES)
def test_sweep_finds_expired_rows_through_the_expiry_index(alias):
    store = populate(alias, None)
    connection = connections[alias]
    with CaptureQueriesContext(connection) as captured:
        assert store.sweep_expired() == ROWS // 200
    select = next(q["sql"] for q in captured.captured_queries if q["sql"].lstrip().upper().startswith("SELECT"))
    if connection.vendor == "postgresql":
        assert select.rstrip().endswith("FOR UPDATE SKIP LOCKED")
        select = select.rstrip().removesuffix("FOR UPDATE SKIP LOCKED")  # EXPLAIN of a locking read would lock
    with transaction.atomic(using=alias), connection.cursor() as cursor:
        cursor.execute(("EXPLAIN QUERY PLAN " if alias == "default" else "EXPLAIN ") + select)
        plan = "\n".join(str(row[-1]) for row in cursor.fetchall())
    if alias == "default":
        assert "USING INDEX afkmemory_storeitem_expiry (expires_at<?)" in plan
    else:
        assert "afkmemory_storeitem_expiry" in plan and "Seq Scan" not in plan
