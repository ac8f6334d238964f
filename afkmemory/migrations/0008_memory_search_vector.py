# A stored text search vector on PostgreSQL: the search_vector column (tsvector, nullable)
# and a trigger that sets it to to_tsvector(TEXT_SEARCH_CONFIG, search_text) on every insert
# and every update of search_text, by whatever writes it (processes still on the old code,
# bulk_update, raw SQL). Search then reads the vector instead of parsing every matching
# memory's text to rank it (about 0.5 µs a byte: seconds for a common word in one user's
# thousands of memories).
#
# The column and the trigger come in one transaction, so no row is written with the column
# and without the trigger; adding a nullable column without a default changes the catalog
# only. Its ACCESS EXCLUSIVE lock is waited for at most 2 s at a time (lock_timeout), and
# tried again after a pause: a long transaction on the table delays the migration instead
# of making every query behind it wait. The memories already there get their vectors in
# batches by primary key, each batch one short transaction (indexes.backfill_search_vectors);
# search goes on parsing search_text until 0009 has built the column's index. Not a model
# field: the column exists on PostgreSQL only, and new code runs before migrate, on a table
# without it. On SQLite nothing changes.

from django.db import migrations

from afkmemory import indexes


class AddSearchVector(indexes.MemoryTableOperation):
    """Add the stored vector column and its trigger on PostgreSQL, and fill it for the existing rows."""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor == "postgresql" and self.allowed(app_label, schema_editor, to_state):
            indexes.add_search_vector(schema_editor.connection)
            indexes.backfill_search_vectors(schema_editor.connection)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor == "postgresql" and self.allowed(app_label, schema_editor, from_state):
            indexes.remove_search_vector(schema_editor.connection)

    def describe(self):
        return "Add a stored text search vector to long-term memories (PostgreSQL)"


class Migration(migrations.Migration):
    atomic = False  # a short transaction for the DDL, then one per batch of the backfill

    dependencies = [("afkmemory", "0007_journal_state_key_indexes")]

    operations = [AddSearchVector()]
