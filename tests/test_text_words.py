"""How text search splits a text into words (``memory.text``), the same for every backend."""

from __future__ import annotations

import sys
import unicodedata

from afkmemory.memory.text import _MARK_PLANES, document_words, query_terms


def test_every_combining_mark_lies_where_words_look_for_them():
    """The word pattern reads the marks of ``_MARK_PLANES`` only (the whole of Unicode takes 0.16 s)."""
    scanned = {i for plane in _MARK_PLANES for i in plane}
    outside = [hex(i) for i in range(sys.maxunicode + 1) if i not in scanned and unicodedata.category(chr(i))[0] == "M"]
    assert outside == []


def test_words_keep_their_marks_and_are_composed_and_lower_cased():
    text = "हिन्दी, İSTANBUL; cafe\u0301 foo_bar x² 𑀓𑀸 東京タワー e-mail"
    assert document_words(text) == [
        "हिन्दी", "istanbul", "café", "foo", "bar", "x²", "𑀓𑀸", "東京タワー", "e", "mail",
    ]  # fmt: skip
    assert query_terms("Café CAFE\u0301 cafe") == ["café", "cafe"]  # one word however it was typed
    assert document_words("\u0301 a\u0301b") == ["áb"]  # a mark with no letter before it is no word
