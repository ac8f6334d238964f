# An (owner, user_id, -updated_at, memory_id) index on memories: a user's list (every scope,
# newest first: list_long_term_memories without a scope, the REST API's ?user_id=) walks it
# and stops at the limit, for a user of 200,000 memories as for one of 10. Before it, the
# (owner, user_id, scope, -updated_at) index gave no order without a scope, and a prepared
# statement's generic plan, made for a user of a few memories, read and sorted all of a big
# user's (or walked the owner's index past all of the others' for a small one).
#
# Built CONCURRENTLY on PostgreSQL, as 0006 builds its index (see there): writes of
# memories go on while it builds.

from importlib import import_module

from django.db import migrations, models

AddIndexConcurrentlyOnPostgreSQL = import_module(
    "afkmemory.migrations.0006_memory_owner_recent_index"
).AddIndexConcurrentlyOnPostgreSQL


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ('afkmemory', '0009_memory_search_vector_index'),
    ]

    operations = [
        AddIndexConcurrentlyOnPostgreSQL(
            model_name='longtermmemory',
            index=models.Index(fields=['owner', 'user_id', '-updated_at', 'memory_id'], name='afkmemory_memory_user_recent'),
        ),
    ]
