# A memory's search_text becomes its words (letters and digits, lower-cased) with one space
# between them. PostgreSQL's text search parser kept an e-mail address, a host name, a path
# or a decimal number as one token ("alice@example.com", "3.5"), so a search for "alice" or
# "5" found nothing there, while SQLite, Redis and the in-memory store split them. Rows are
# rewritten in small batches, each its own transaction that locks its rows before reading
# them (indexes.refresh_search_text), so a large table is not locked whole and a memory
# updated meanwhile keeps the search text of its new text; the GIN index (an expression on
# the column) and SQLite's FTS5 table (its triggers) follow.

from django.db import migrations

from afkmemory.indexes import refresh_search_text


def rewrite_search_text(apps, schema_editor):
    refresh_search_text(apps.get_model("afkmemory", "LongTermMemory").objects.using(schema_editor.connection.alias))


class Migration(migrations.Migration):
    atomic = False  # a transaction per batch

    dependencies = [("afkmemory", "0003_foreign_keys_without_own_index")]

    operations = [migrations.RunPython(rewrite_search_text, migrations.RunPython.noop, elidable=True)]
