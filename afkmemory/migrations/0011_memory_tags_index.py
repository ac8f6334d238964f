# A GIN index on memories' tags (jsonb_path_ops, which serves @>, the containment that
# MemoryQuerySet.with_tag filters by: GET memories/?tag=). Without it the filter read all of
# the account's memories, whether the tag was common or on none of them (300 ms at 500,000).
#
# PostgreSQL only, built CONCURRENTLY as 0006 builds its index (see there): writes of
# memories go on while it builds; a valid index left by a killed migrate is kept, an invalid
# one dropped and built again. It is not in LongTermMemory's Meta.indexes: SQLite has no GIN,
# and a GinIndex in the model's state would be created again (and fail) whenever SQLite
# rebuilds the table for a later schema change. On SQLite nothing changes.

from django.db import migrations

from afkmemory import indexes

TAGS_INDEX = "afkmemory_memory_tags"
TAGS_INDEX_DEFINITION = f"{indexes.MEMORY_TABLE} USING gin (tags jsonb_path_ops)"


class IndexTags(indexes.MemoryTableOperation):
    """Build the GIN index on memories' tags CONCURRENTLY (PostgreSQL); drop it backwards."""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        connection = schema_editor.connection
        if connection.vendor == "postgresql" and self.allowed(app_label, schema_editor, to_state):
            indexes.create_index_concurrently(connection, TAGS_INDEX, TAGS_INDEX_DEFINITION)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        connection = schema_editor.connection
        if connection.vendor == "postgresql" and self.allowed(app_label, schema_editor, from_state):
            indexes.drop_index_concurrently(connection, TAGS_INDEX)

    def describe(self):
        return "Index the tags of long-term memories (PostgreSQL)"


class Migration(migrations.Migration):
    atomic = False  # CREATE and DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("afkmemory", "0010_memory_user_recent_index")]

    operations = [IndexTags()]
