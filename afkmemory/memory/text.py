"""What text search indexes of a memory, and how a query splits into terms."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator

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


#: How much of a memory text search reads: its first words, up to this many bytes in UTF-8.
#: PostgreSQL holds at most 1 MB in a text search vector, about four times the words' bytes
#: at worst; every backend reads the same words, so they all find the same memories.
MAX_SEARCH_BYTES = 256 * 1024


def search_document(memory: LongTermMemory) -> str:
    """Return what a memory is found by: the words of its text, its tags and its data's keys and values.

    The words (``document_words``), one space between them, the first ``MAX_SEARCH_BYTES``
    of them: every backend's tokenizer then splits it the same way. Given the raw text,
    PostgreSQL's parser keeps an e-mail address, a host name, a path or a decimal number
    as one token, which no query word matches.
    """
    parts = [memory.text or "", *memory.tags, *_json_words(memory.data)]
    words: list[str] = []
    size = 0
    for word in document_words(" ".join(parts)):
        size += len(word.encode("utf-8")) + 1
        if size > MAX_SEARCH_BYTES + 1:  # the last word needs no space after it
            break
        words.append(word)
    return " ".join(words)


#: The most distinct words a text search takes. A match holds every one of them, and ranking
#: a match costs more with each: PostgreSQL's ``ts_rank_cd`` about with their square (over
#: one memory of 256 KiB, 32 words took 0.11 s, 200 took 7.9 s and 900 eleven minutes),
#: and SQLite's ranking adds a term per word (past 1,000 it fails: too deep an expression).
MAX_QUERY_TERMS = 32


def query_terms(query: str) -> list[str]:
    """Return the distinct lower-cased words of a query, in order; more than ``MAX_QUERY_TERMS`` is a ValueError."""
    if not isinstance(query, str):
        raise TypeError(f"query must be a string, got {type(query).__name__}")
    terms = list(dict.fromkeys(word.lower() for word in _WORD.findall(query)))
    if len(terms) > MAX_QUERY_TERMS:
        raise ValueError(
            f"query has {len(terms)} distinct words; a text search takes at most {MAX_QUERY_TERMS} "
            "(a match holds every one of them)"
        )
    return terms


def document_words(text: str) -> list[str]:
    """Return the lower-cased words of a document."""
    return [word.lower() for word in _WORD.findall(text)]


def rank_by_term_count(memories: Iterable[LongTermMemory], terms: list[str], limit: int) -> list[LongTermMemory]:
    """Return the memories holding every one of ``terms``: most occurrences first, then newest, then by id.

    How the in-memory and Redis stores rank a text search (SQLite's store ranks so in SQL).
    """
    scored = []
    for memory in memories:
        counts = Counter(document_words(search_document(memory)))
        if all(counts[t] for t in terms):
            scored.append((-sum(counts[t] for t in terms), -memory.updated_at, memory.id, memory))
    return [memory for *_, memory in sorted(scored, key=lambda s: s[:3])[:limit]]
