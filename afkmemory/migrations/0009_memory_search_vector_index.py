# The GIN index on the stored text search vector (0008), built CONCURRENTLY as 0006 builds
# its index (writes go on; a valid index left by a killed migrate is kept, an invalid one
# dropped and built again), then the index on to_tsvector(config, search_text) it replaces,
# dropped CONCURRENTLY. Search uses the vector once its index is valid (each process finds
# out within indexes.SEARCH_VECTORS_TTL seconds): on a large table the drop waits that long
# first, so that no process searches without an index meanwhile. Backwards: the expression
# index built again (CONCURRENTLY), then the vector's index dropped, and always the same
# wait, so that unmigrating 0008 next does not drop the column under a search. On SQLite
# nothing changes.

import time

from django.db import migrations

from afkmemory import indexes

#: Below this many memories (the planner's estimate), searching them without an index is quick.
WAIT_FROM_ROWS = 10000


def wait_for_searches(cursor, *, always=False):
    """Give every process time to see the change of index (``indexes.SEARCH_VECTORS_TTL``).

    Forwards only on a large table: a process that has not switched yet searches without an
    index meanwhile, correctly but slowly. A table never analysed (a new database: every
    first migrate) has no estimate, and is counted, up to ``WAIT_FROM_ROWS``. Backwards
    ``always``: a process still reading the column would fail once 0008's backwards step
    drops it.
    """
    cursor.execute("SELECT reltuples FROM pg_class WHERE oid = to_regclass(%s)", [indexes.MEMORY_TABLE])
    rows = cursor.fetchone()[0]
    if rows < 0:
        cursor.execute(f"SELECT count(*) FROM (SELECT 1 FROM {indexes.MEMORY_TABLE} LIMIT {WAIT_FROM_ROWS}) AS head")
        rows = cursor.fetchone()[0]
    if always or rows >= WAIT_FROM_ROWS:
        time.sleep(indexes.SEARCH_VECTORS_TTL)


class IndexSearchVector(indexes.MemoryTableOperation):
    """Build the stored vector's GIN index and drop the expression index, both CONCURRENTLY."""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        connection = schema_editor.connection
        if connection.vendor != "postgresql" or not self.allowed(app_label, schema_editor, to_state):
            return
        indexes.create_index_concurrently(connection, indexes.VECTOR_GIN_INDEX, indexes.vector_index_definition())
        with connection.cursor() as cursor:
            if indexes.index_state(cursor, indexes.GIN_INDEX) is not None:
                wait_for_searches(cursor)
            cursor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {indexes.GIN_INDEX}")
        indexes.forget_search_vectors(connection.alias)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        connection = schema_editor.connection
        if connection.vendor != "postgresql" or not self.allowed(app_label, schema_editor, from_state):
            return
        indexes.create_index_concurrently(connection, indexes.GIN_INDEX, indexes.expression_index_definition())
        with connection.cursor() as cursor:
            present = indexes.index_state(cursor, indexes.VECTOR_GIN_INDEX) is not None
            cursor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {indexes.VECTOR_GIN_INDEX}")
            if present:  # processes still read the column: unmigrating 0008 next would drop it under them
                wait_for_searches(cursor, always=True)
        indexes.forget_search_vectors(connection.alias)

    def describe(self):
        return "Index the stored text search vector of long-term memories, drop the expression index (PostgreSQL)"


class Migration(migrations.Migration):
    atomic = False  # CREATE and DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("afkmemory", "0008_memory_search_vector")]

    operations = [IndexSearchVector()]
