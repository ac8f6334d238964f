# Words keep their combining marks (memory.text): a Devanagari vowel sign or virama, or an
# accent typed as a code point of its own, used to split a word, so "हिन्दी" was indexed and
# searched as "ह न द", and a query for it matched "है न दो". Words are also lower-cased each
# on its own and composed (NFC), "İ" lower-cases to "i" as in PostgreSQL and SQLite, and
# variation selectors and enclosing marks separate words.
#
# On SQLite the FTS5 table is made again with a tokenizer that keeps marks in words
# (indexes.FTS_TOKENIZER), in one transaction, and filled from the memory table. Then, on
# either database, the memories whose search text is now otherwise are rewritten, a batch at
# a time (indexes.refresh_search_text): every memory is read, and only those with such words
# are locked and written. Backwards, the old tokenizer and the old words are put back the
# same way.

import re

from django.db import migrations, transaction

from afkmemory import indexes

#: The tokenizer before this migration, which its reverse puts back.
OLD_TOKENIZER = "porter unicode61 remove_diacritics 2"


def old_words(text):
    """A text's words as the code before this migration split them (no marks, whole text not composed)."""
    return [word.lower() for word in re.findall(r"[^\W_]+", text)]


class SearchWordsWithMarks(indexes.MemoryTableOperation):
    """Make SQLite's FTS5 table again with ``tokenizer``, then rewrite the stale search text."""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        if self.allowed(app_label, schema_editor, to_state):
            self.remake_fts(schema_editor, indexes.FTS_TOKENIZER)
            memories = to_state.apps.get_model(app_label, "LongTermMemory").objects
            indexes.refresh_search_text(memories.using(schema_editor.connection.alias))

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        # The older code's queries are split the older way: its search text is put back too
        # (left as it was, PostgreSQL found "हिन्दी" by no query the older code makes).
        if self.allowed(app_label, schema_editor, from_state):
            self.remake_fts(schema_editor, OLD_TOKENIZER)
            memories = from_state.apps.get_model(app_label, "LongTermMemory").objects
            indexes.refresh_search_text(memories.using(schema_editor.connection.alias), words=old_words)

    @staticmethod
    def remake_fts(schema_editor, tokenizer):
        connection = schema_editor.connection
        if connection.vendor == "sqlite":
            with transaction.atomic(using=connection.alias):
                for sql in [*indexes.drop_statements("sqlite"), *indexes.create_statements("sqlite", tokenizer=tokenizer)]:
                    schema_editor.execute(sql)

    def describe(self):
        return "Keep combining marks in the words of memories' search text (and SQLite's FTS5 tokenizer)"


class Migration(migrations.Migration):
    atomic = False  # a transaction for the FTS5 table, then one per batch of stale search text

    dependencies = [("afkmemory", "0011_memory_tags_index")]

    operations = [SearchWordsWithMarks()]
