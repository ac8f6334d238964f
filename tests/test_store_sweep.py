"""Sweeping expired store items: bounded batches, the owner's scope, SKIP LOCKED, the cron command."""

from __future__ import annotations

import threading
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from afkmemory.models import StoreItem
from afkmemory.stores import DjangoStore, SyncDjangoStore
from tests.utils import run

ALIASES = ["default", "postgres"]


def deletes(captured: CaptureQueriesContext) -> int:
    return sum(q["sql"].lstrip().upper().startswith("DELETE") for q in captured.captured_queries)


def fill(store: SyncDjangoStore, expired: int, later: int = 2, forever: int = 2) -> None:
    for i in range(expired):
        store.put(("cache",), f"expired-{i}", i, ttl=0)
    for i in range(later):
        store.put(("cache",), f"later-{i}", i, ttl=3600)
    for i in range(forever):
        store.put(("cache",), f"forever-{i}", i)


def keys(alias: str) -> list[str]:
    return sorted(StoreItem.objects.using(alias).values_list("key", flat=True))


@pytest.mark.django_db(databases=ALIASES)
@pytest.mark.parametrize("alias", ALIASES)
def test_sweep_deletes_only_expired_items_in_bounded_batches(alias):
    store = SyncDjangoStore(using=alias)
    fill(store, expired=5)
    with CaptureQueriesContext(connections[alias]) as captured:
        assert store.sweep_expired(2) == 5
    assert deletes(captured) == 3  # 2 + 2 + 1, one statement per batch
    assert keys(alias) == ["forever-0", "forever-1", "later-0", "later-1"]
    assert store.sweep_expired() == 0


@pytest.mark.django_db(databases=ALIASES)
@pytest.mark.parametrize("alias", ALIASES)
def test_sweep_takes_its_default_batch_size_from_the_settings(alias, settings):
    store = SyncDjangoStore(using=alias)
    fill(store, expired=7)
    batch_of_3 = override_settings(AFKMEMORY={**settings.AFKMEMORY, "DELETE_BATCH_SIZE": 3})
    with batch_of_3, CaptureQueriesContext(connections[alias]) as captured:
        assert store.sweep_expired() == 7
    assert deletes(captured) == 3


@pytest.mark.django_db(databases=ALIASES)
@pytest.mark.parametrize("alias", ALIASES)
def test_sweep_at_an_explicit_time(alias):
    store = SyncDjangoStore(using=alias)
    fill(store, expired=1)
    assert store.sweep_expired(now=timezone.now() - timedelta(hours=1)) == 0
    assert store.sweep_expired(now=timezone.now() + timedelta(hours=2)) == 3
    assert keys(alias) == ["forever-0", "forever-1"]


@pytest.mark.django_db(databases=ALIASES)
@pytest.mark.parametrize("alias", ALIASES)
def test_sweep_stays_within_the_owner_unless_told_otherwise(alias, django_user_model):
    alice = django_user_model.objects.db_manager(alias).create_user("alice")
    alices, nobodys = SyncDjangoStore(owner=alice, using=alias), SyncDjangoStore(using=alias)
    fill(alices, expired=2, later=0, forever=0)
    fill(nobodys, expired=3, later=0, forever=0)
    assert alices.sweep_expired() == 2
    assert StoreItem.objects.using(alias).for_owner(None).count() == 3
    fill(alices, expired=2, later=0, forever=0)
    assert alices.sweep_expired(all_owners=True) == 5
    assert not StoreItem.objects.using(alias).exists()


@pytest.mark.django_db(databases=ALIASES)
@pytest.mark.parametrize("alias", ALIASES)
def test_the_async_store_sweeps_too(alias):
    fill(SyncDjangoStore(using=alias), expired=2)
    assert run(DjangoStore(using=alias).sweep_expired(1)) == 2


@pytest.mark.django_db(databases=ALIASES)
def test_sweep_refuses_bad_arguments():
    store = SyncDjangoStore()
    # Past 10,000 (DELETE_BATCH_SIZE's range) one DELETE's ids could pass SQLite's parameter limit.
    for bad, error in [(0, ValueError), (-1, ValueError), (10_001, ValueError), (1.5, TypeError), ("10", TypeError)]:
        with pytest.raises(error, match="batch_size"):
            store.sweep_expired(bad)
    with pytest.raises(TypeError, match="aware"):
        store.sweep_expired(now=timezone.now().replace(tzinfo=None))


@pytest.mark.django_db(databases=ALIASES)
@pytest.mark.parametrize("alias", ALIASES)
def test_sweep_command_deletes_every_owners_expired_items(alias, django_user_model):
    alice = django_user_model.objects.db_manager(alias).create_user("alice")
    fill(SyncDjangoStore(owner=alice, using=alias), expired=2)
    fill(SyncDjangoStore(using=alias), expired=1)
    out = StringIO()
    with CaptureQueriesContext(connections[alias]) as captured:
        call_command("afkmemory_sweep_store", database=alias, batch_size=2, stdout=out)
    assert out.getvalue().strip() == f"Deleted 3 expired store items from {alias!r}."
    assert deletes(captured) == 2 + 1  # two batches, then the release of the job's single-flight claim
    assert StoreItem.objects.using(alias).count() == 8
    for bad in ("0", "10001", "many"):
        with pytest.raises(CommandError, match="--batch-size: must be a whole number from 1 to 10000"):
            call_command("afkmemory_sweep_store", "--batch-size", bad, database=alias)


@pytest.mark.django_db(databases=ALIASES, transaction=True)
def test_postgres_sweepers_skip_rows_another_sweeper_holds():
    store = SyncDjangoStore(using="postgres")
    fill(store, expired=6, later=0, forever=0)
    held = sorted(StoreItem.objects.using("postgres").values_list("id", flat=True))[:2]
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic(using="postgres"):
                list(StoreItem.objects.using("postgres").filter(id__in=held).select_for_update())
                locked.set()
                release.wait(timeout=10)  # a sweeper that waited on these rows would stall here
        finally:
            connections["postgres"].close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(timeout=10)
        assert store.sweep_expired(2) == 4  # the rows it could not lock are left for later
    finally:
        release.set()
        holder.join()
    assert sorted(StoreItem.objects.using("postgres").values_list("id", flat=True)) == held
    assert store.sweep_expired() == 2


@pytest.mark.django_db(databases=["default", "postgres"])
@pytest.mark.parametrize("alias", ALIASES)
def test_a_batch_delete_keeps_the_querysets_filters(alias):
    """DeleteByPk sends one DELETE per batch with the queryset's own WHERE: a live item whose
    id is in the batch stays; with a delete receiver it goes the ORM's way, receivers and all."""
    from django.db.models.signals import post_delete

    from afkmemory.stores.bulk import DeleteByPk

    store = SyncDjangoStore(using=alias)
    store.put(("s",), "live", 1)
    store.put(("s",), "gone", 1, ttl=0)
    store.put(("s",), "gone-too", 1, ttl=0)
    ids = dict(StoreItem.objects.using(alias).values_list("key", "id"))
    expired = StoreItem.objects.using(alias).expired(timezone.now())
    with CaptureQueriesContext(connections[alias]) as captured:
        assert DeleteByPk(expired)([ids["live"], ids["gone"]]) == 1
    [sql] = [q["sql"] for q in captured.captured_queries]
    assert sql.startswith('DELETE FROM "afkmemory_storeitem" WHERE (') and '"expires_at" <=' in sql, sql
    assert sorted(StoreItem.objects.using(alias).values_list("key", flat=True)) == ["gone-too", "live"]

    heard = []

    def receiver(sender, instance, **kwargs):
        heard.append(instance.key)

    post_delete.connect(receiver, sender=StoreItem)
    try:
        assert DeleteByPk(expired).sql is None
        assert DeleteByPk(expired)([ids["live"], ids["gone-too"]]) == 1
    finally:
        post_delete.disconnect(receiver, sender=StoreItem)
    assert heard == ["gone-too"]
    assert list(StoreItem.objects.using(alias).values_list("key", flat=True)) == ["live"]
