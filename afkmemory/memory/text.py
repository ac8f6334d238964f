"""What text search indexes of a memory, and how a query splits into terms."""

from __future__ import annotations

import functools
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Iterator

from .types import JsonValue, LongTermMemory

#: Where Unicode has the combining marks (category M) words keep: the first two planes.
#: Past them there are only variation selectors (a test checks it), which words do not keep.
_MARK_PLANES = range(0x20000)
#: Marks that are no part of a word, and separate words as punctuation does: the variation
#: selectors (which glyph to draw: "葛󠄀" is "葛", an emoji's U+FE0F). Enclosing marks (a
#: keycap: "1️⃣" is "1") are left out of words by their category.
_NOT_IN_WORDS = frozenset([0x180B, 0x180C, 0x180D, 0x180F, *range(0xFE00, 0xFE10), *range(0xE0100, 0xE01F0)])

# Letters and digits; "_" separates words, as PostgreSQL's text search parser and SQLite's
# FTS5 tokenizer split them, so "foo_bar" finds the same memories on every backend.
_ASCII_WORD = re.compile(r"[^\W_]+")


def _ranges(code_points: list[int]) -> str:
    """``code_points`` (ascending) as the inside of a regular expression's character class."""
    spans: list[list[int]] = []
    for point in code_points:
        if spans and spans[-1][1] == point - 1:
            spans[-1][1] = point
        else:
            spans.append([point, point])
    return "".join(re.escape(chr(a)) + (f"-{re.escape(chr(b))}" if b > a else "") for a, b in spans)


@functools.cache
def _word() -> re.Pattern[str]:
    """A word: letters and digits, with the combining marks among and after them.

    Combining marks (a Devanagari vowel sign or virama, an accent typed as a code point of
    its own) belong to the word, as PostgreSQL's parser and SQLite's tokenizer (migration
    0012) keep them: Python's ``\\w`` has no marks, and "हिन्दी" fell apart into "ह न द",
    so a query for it matched "है न दो". Built on first use (reading the Unicode database
    takes about 15 ms). The text it reads has no "_" (``_words`` makes them spaces), so a
    word is a ``\\w`` and then ``\\w`` or marks: one class the regular expression engine
    looks a character up in at once. The marks past the first plane are a class of their
    own: with them, a class is matched one range at a time, several times slower.
    """
    marks = [i for i in _MARK_PLANES if unicodedata.category(chr(i)) in ("Mn", "Mc") and i not in _NOT_IN_WORDS]
    first, beyond = _ranges([i for i in marks if i < 0x10000]), _ranges([i for i in marks if i >= 0x10000])
    return re.compile(rf"\w[\w{first}]*(?:[{beyond}]+[\w{first}]*)*")


def _words(text: str) -> list[str]:
    """The words of ``text``, lower-cased and composed (NFC), with "İ" as "i".

    Split first, then lower-cased word by word (here in one pass, one space between them):
    lower-casing the whole text chose a Greek final "ς" or "σ" by what followed past
    punctuation ("ΟΔΟΣ.ΑΒΓ" gave "οδοσ", which "οδος" never found); a space stops that look,
    as the end of the text does. Composed again after lower-casing, which can leave a letter
    and a mark that compose ("J̌" lower-cases to "j" and a caron, composed "ǰ"). "İ"
    lower-cases to "i" and a combining dot in Python (Unicode's special casing) and to "i"
    in PostgreSQL and SQLite: the dot is dropped, so "İstanbul" finds "istanbul".
    """
    if text.isascii():  # no marks, nothing to compose: the common case, at the old speed
        return [word.lower() for word in _ASCII_WORD.findall(text)]
    words = _word().findall(unicodedata.normalize("NFC", text).replace("_", " "))
    lowered = " ".join(words).lower().replace("i\u0307", "i")
    return unicodedata.normalize("NFC", lowered).split(" ") if words else []


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


def search_document(memory: LongTermMemory, words: Callable[[str], list[str]] | None = None) -> str:
    """Return what a memory is found by: the words of its text, its tags and its data's keys and values.

    The words (``document_words``), one space between them, the first ``MAX_SEARCH_BYTES``
    of them: every backend's tokenizer then splits it the same way. Given the raw text,
    PostgreSQL's parser keeps an e-mail address, a host name, a path or a decimal number
    as one token, which no query word matches. ``words`` splits the text instead of
    ``document_words`` (the older splitting, for migration 0012's reverse).
    """
    parts = [memory.text or "", *memory.tags, *_json_words(memory.data)]
    kept: list[str] = []
    size = 0
    for word in (words or document_words)(" ".join(parts)):
        size += len(word.encode("utf-8")) + 1
        if size > MAX_SEARCH_BYTES + 1:  # the last word needs no space after it
            break
        kept.append(word)
    return " ".join(kept)


#: The most distinct words a text search takes. A match holds every one of them, and ranking
#: a match costs more with each: PostgreSQL's ``ts_rank_cd`` about with their square (over
#: one memory of 256 KiB, 32 words took 0.11 s, 200 took 7.9 s and 900 eleven minutes),
#: and SQLite's ranking adds a term per word (past 1,000 it fails: too deep an expression).
MAX_QUERY_TERMS = 32


def query_terms(query: str) -> list[str]:
    """Return the distinct lower-cased words of a query, in order; more than ``MAX_QUERY_TERMS`` is a ValueError."""
    if not isinstance(query, str):
        raise TypeError(f"query must be a string, got {type(query).__name__}")
    terms = list(dict.fromkeys(_words(query)))
    if len(terms) > MAX_QUERY_TERMS:
        raise ValueError(
            f"query has {len(terms)} distinct words; a text search takes at most {MAX_QUERY_TERMS} "
            "(a match holds every one of them)"
        )
    return terms


def document_words(text: str) -> list[str]:
    """Return the lower-cased words of a document."""
    return _words(text)


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
