"""What text search indexes of a memory, and how a query splits into terms."""

from __future__ import annotations

import re
from collections.abc import Iterator

from .types import JsonValue, LongTermMemory

# Letters and digits; "_" separates words, as PostgreSQL's text search parser and SQLite's
# FTS5 tokenizer split them, so "foo_bar" finds the same memories on every backend.
_WORD = re.compile(r"[^\W_]+", re.UNICODE)


def _json_words(value: JsonValue) -> Iterator[str]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _json_words(item)
    elif isinstance(value, list):
        for item in value:
            yield from _json_words(item)
    elif isinstance(value, str):
        yield value
    elif value is not None and not isinstance(value, bool):
        yield str(value)


def search_document(memory: LongTermMemory) -> str:
    """Return the text a memory is found by: its text, its tags and its data's keys and values."""
    parts = [memory.text or "", *memory.tags, *_json_words(memory.data)]
    return "\n".join(part for part in parts if part)


def query_terms(query: str) -> list[str]:
    """Return the distinct lower-cased words of a query, in order."""
    if not isinstance(query, str):
        raise TypeError(f"query must be a string, got {type(query).__name__}")
    return list(dict.fromkeys(word.lower() for word in _WORD.findall(query)))


def document_words(text: str) -> list[str]:
    """Return the lower-cased words of a document."""
    return [word.lower() for word in _WORD.findall(text)]
