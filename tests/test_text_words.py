"""How text search splits a text into words (``memory.text``), the same for every backend."""

from __future__ import annotations

import random
import sys
import unicodedata

from afkmemory.memory.text import _MARK_PLANES, _NOT_IN_WORDS, document_words, query_terms


def test_every_combining_mark_lies_where_words_look_for_them():
    """The word pattern reads the marks of ``_MARK_PLANES`` only (the whole of Unicode takes 0.16 s):
    past them there are only variation selectors, which are no part of a word."""
    outside = [
        hex(i)
        for i in range(_MARK_PLANES.stop, sys.maxunicode + 1)
        if unicodedata.category(chr(i))[0] == "M" and i not in _NOT_IN_WORDS
    ]
    assert outside == []
    assert all(unicodedata.category(chr(i)) == "Mn" for i in _NOT_IN_WORDS)


def test_words_keep_their_marks_and_are_composed_and_lower_cased():
    text = "हिन्दी, İSTANBUL; cafe\u0301 foo_bar x² 𑀓𑀸 東京タワー e-mail"
    assert document_words(text) == [
        "हिन्दी", "istanbul", "café", "foo", "bar", "x²", "𑀓𑀸", "東京タワー", "e", "mail",
    ]  # fmt: skip
    assert query_terms("Café CAFE\u0301 cafe") == ["café", "cafe"]  # one word however it was typed
    assert document_words("\u0301 a\u0301b") == ["áb"]  # a mark with no letter before it is no word


def test_each_word_is_lower_cased_and_composed_on_its_own():
    """Lower-casing the whole text chose a Greek final sigma by what came after punctuation
    ("ΟΔΟΣ.ΑΒΓ" gave "οδοσ"), and could leave a letter and a mark that compose ("J̌" gave
    "j" and a caron where the text's own spelling, composed, is "ǰ")."""
    assert document_words("ΟΔΟΣ.ΑΒΓ ΑΣ:ILIK") == ["οδος", "αβγ", "ας", "ilik"]
    assert query_terms("J̌ABC ǰabc ΤΩ͂Ν τῶν") == ["ǰabc", "τῶν"]
    assert query_terms("İ\u0301") == ["í"]


def test_variation_selectors_and_enclosing_marks_separate_words():
    """Which glyph to draw is no part of a word: "葛󠄀" (an ideographic variation) is "葛",
    and a keycap "1️⃣" is "1"."""
    assert document_words("葛\U000e0100 1\ufe0f\u20e3 ❤\ufe0f a\u20dd") == ["葛", "1", "a"]


def _reference_words(text: str) -> list[str]:
    """``document_words`` spelled out a character at a time: a word starts at a letter or
    digit and goes on through letters, digits and marks (but variation selectors)."""
    words, word = [], ""
    for char in unicodedata.normalize("NFC", text):
        mark = unicodedata.category(char) in ("Mn", "Mc") and ord(char) not in _NOT_IN_WORDS
        if char.isalnum() or (mark and word):
            word += char
        elif word:
            words.append(word)
            word = ""
    words += [word] if word else []
    return [unicodedata.normalize("NFC", w.lower().replace("i\u0307", "i")) for w in words]


def test_words_match_their_definition_on_random_text():
    rng = random.Random(5)
    alphabet = [
        *"aZ9_ .-/:'ΣσςΟΔİıßJ", "\u0301", "\u030c", "\u0307", "\u093f", "\u094d", "\u0e31", "\u05b8", "\u064e",
        "\u200d", "\u200c", "\ufe0f", "\u20e3", "\U000e0100", "\U00011038", "\U00011013", "क", "ष", "東", "½", "²",
    ]  # fmt: skip
    for _ in range(5000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        assert document_words(text) == _reference_words(text), repr(text)
