"""Rewriting memories' search text (migration 0004, ``afkmemory_refresh_search_text``) loses no update.

Migration 0004 read each batch of memories, then wrote their search text in a transaction of
its own: a memory updated in between kept the search text of its old text, and text search
no longer found it by its new words (64 of 2,655 memories updated during an upgrade of
20,000). Each batch's stale rows are now read again under their locks and written in the same
transaction; the rows whose search text is current are only read, not locked (on PostgreSQL a
lock is a write to the row: migration 0012 reads every memory, and rewrites only some).
"""

from __future__ import annotations

import threading
import time
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connections

from afkmemory import indexes, models
from afkmemory.memory import LongTermMemory
from afkmemory.memory.text import search_document
from afkmemory.stores import SyncDjangoMemoryStore
from tests.utils import FLUSHED_APPS


def stale(alias: str) -> list[str]:
    """The memories whose search text is not what their fields make now."""
    rows = models.LongTermMemory.objects.using(alias).order_by("memory_id")
    return [row.memory_id for row in rows if row.search_text != search_document(row.as_record())]


@pytest.mark.django_db(databases=["default", "postgres"])
@pytest.mark.parametrize("alias", ["default", "postgres"])
def test_only_stale_search_text_is_rewritten_and_found_again(alias):
    store = SyncDjangoMemoryStore(using=alias)
    for i in range(7):
        store.upsert_long_term_memory(LongTermMemory(f"m{i}", "u1", text=f"write to alice{i}@example.com"))
    # As code before 0004 wrote it: the raw text, which PostgreSQL's parser keeps whole.
    models.LongTermMemory.objects.using(alias).filter(memory_id__in=["m2", "m5"]).update(
        search_text="write to alice@example.com"
    )
    assert stale(alias) == ["m2", "m5"]
    out = StringIO()
    call_command("afkmemory_refresh_search_text", database=alias, stdout=out)
    assert out.getvalue() == f"Rewrote 2 stale search texts of memories on {alias!r}.\n"
    assert stale(alias) == []
    assert [m.id for m in store.search_long_term_memory_text("u1", "alice5")] == ["m5"]
    assert indexes.refresh_search_text(models.LongTermMemory.objects.using(alias), batch_size=3) == 0


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True, available_apps=FLUSHED_APPS)
def test_a_memory_updated_while_its_batch_is_rewritten_keeps_its_new_words(monkeypatch):
    alias = "postgres"
    store = SyncDjangoMemoryStore(using=alias)
    for i in range(5):
        store.upsert_long_term_memory(LongTermMemory(f"m{i}", "u1", text=f"old words {i}"))
    models.LongTermMemory.objects.using(alias).update(search_text="stale")  # all to rewrite
    reading, updating = threading.Event(), threading.Event()

    def slow_search_document(memory: LongTermMemory, words=None) -> str:
        if memory.id == "m3" and not reading.is_set():
            reading.set()  # the batch is read: now another writer updates m3
            assert updating.wait(10)
            time.sleep(0.5)  # its upsert reaches the row (and waits for the batch's lock)
        return search_document(memory, words)

    monkeypatch.setattr("afkmemory.memory.text.search_document", slow_search_document)

    def update_m3() -> None:
        try:
            assert reading.wait(10)
            updating.set()
            SyncDjangoMemoryStore(using=alias).upsert_long_term_memory(LongTermMemory("m3", "u1", text="fresh tulips"))
        finally:
            connections.close_all()  # this thread's connection: left open, the test database could not be dropped

    writer = threading.Thread(target=update_m3)
    writer.start()
    indexes.refresh_search_text(models.LongTermMemory.objects.using(alias), batch_size=10)
    writer.join(10)
    assert stale(alias) == []
    assert [m.id for m in store.search_long_term_memory_text("u1", "tulips")] == ["m3"]


@pytest.mark.django_db(databases=["postgres"])
def test_rows_whose_search_text_is_current_are_not_locked():
    """Locking a row writes its xmax: a refresh that locked every row it read rewrote every page
    of a big table (and its WAL) to change a few memories."""
    alias = "postgres"
    store = SyncDjangoMemoryStore(using=alias)
    for i in range(4):
        store.upsert_long_term_memory(LongTermMemory(f"m{i}", "u1", text=f"words {i}"))
    models.LongTermMemory.objects.using(alias).filter(memory_id="m2").update(search_text="stale")

    def xmax() -> dict[str, str]:
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT memory_id, xmax::text FROM afkmemory_longtermmemory ORDER BY memory_id")
            return dict(cursor.fetchall())

    before = xmax()
    assert indexes.refresh_search_text(models.LongTermMemory.objects.using(alias), batch_size=3) == 1
    after = xmax()
    assert stale(alias) == [] and {m: after[m] == before[m] for m in before} == {
        "m0": True, "m1": True, "m2": False, "m3": True,
    }  # fmt: skip
