# A memory's search_text becomes its words (letters and digits, lower-cased) with one space
# between them. PostgreSQL's text search parser kept an e-mail address, a host name, a path
# or a decimal number as one token ("alice@example.com", "3.5"), so a search for "alice" or
# "5" found nothing there, while SQLite, Redis and the in-memory store split them. Rows are
# rewritten in batches, each its own transaction, so a large table is not locked whole; the
# GIN index (an expression on the column) and SQLite's FTS5 table (its triggers) follow.

from django.db import migrations, transaction

from afkmemory.memory.text import search_document
from afkmemory.memory.types import LongTermMemory

BATCH = 1000
FIELDS = ("memory_id", "user_id", "scope", "data", "text", "tags", "metadata", "created_at", "updated_at")


def rewrite_search_text(apps, schema_editor):
    memories = apps.get_model("afkmemory", "LongTermMemory").objects.using(schema_editor.connection.alias)
    last = 0
    while batch := list(memories.filter(pk__gt=last).order_by("pk").only("pk", "search_text", *FIELDS)[:BATCH]):
        for row in batch:
            row.search_text = search_document(LongTermMemory(*(getattr(row, field) for field in FIELDS)))
        with transaction.atomic(using=schema_editor.connection.alias):
            memories.bulk_update(batch, ["search_text"])
        last = batch[-1].pk


class Migration(migrations.Migration):
    atomic = False  # a transaction per batch

    dependencies = [("afkmemory", "0003_foreign_keys_without_own_index")]

    operations = [migrations.RunPython(rewrite_search_text, migrations.RunPython.noop, elidable=True)]
