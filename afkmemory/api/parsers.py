"""The one parser of the REST API: JSON, bounded in size and depth, refused whole when malformed."""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser
from rest_framework.renderers import JSONRenderer
from rest_framework.utils.json import strict_constant

from ..conf import afk_settings
from ..memory.types import MAX_JSON_DEPTH
from .exceptions import PayloadTooLarge

#: A JSON string, quotes and escapes included (the unrolled form: no backtracking per character).
#: One left open runs to the end of the text: a pattern that failed there was tried again from
#: every later quote, each try to the end (quadratic: a 132 KB body of escaped quotes took 3 s).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
#: The charsets a JSON body may come in (RFC 8259 asks UTF-8; RFC 4627 allowed UTF-16 and UTF-32).
CHARSETS = {"utf-8", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"}


def _too_many(limit: int) -> ParseError:
    return ParseError(
        f"JSON parse error - the body holds more than {limit} values, object keys included "
        "(AFKMEMORY['API_MAX_JSON_VALUES'])"
    )


def _check_containers(text: str, limit: int) -> None:
    """Refuse, before it is parsed, a body that opens more than ``limit`` arrays and objects.

    Parsed, each is an object Python's garbage collector keeps passing over: 4 MB of small
    nested arrays (two million) took 1 s to parse and 1.7 s more to count, most of it the
    collector's, before the count refused them. Brackets are counted outside strings, and
    only when there are more than ``limit`` of them in all.
    """
    if text.count("[") + text.count("{") > limit:
        outside = _STRING.sub("", text)
        if outside.count("[") + outside.count("{") > limit:
            raise _too_many(limit)


def _check_structure(data: Any, limit: int) -> None:
    """Refuse nesting deeper than ``MAX_JSON_DEPTH`` (as the Python API does), strings no database can store
    (lone surrogates), and more than ``limit`` (``API_MAX_JSON_VALUES``) values.

    The count bounds what a body costs the checks after this one and every later read of
    what it stored: 4 MB of small nested arrays (two million values) took 5.5 s of a
    worker's CPU to refuse as over ``API_MAX_VALUE_BYTES``, and a 1 MB one, stored, 1.2 s
    to read back each time.
    """
    stack: list[tuple[Any, int]] = [(data, 0)]
    seen = 0
    while stack:
        value, depth = stack.pop()
        seen += 1
        if seen > limit:
            raise _too_many(limit)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ParseError(r"JSON parse error - a string holds a lone surrogate (\ud800-\udfff)") from None
        elif isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise ParseError(f"JSON parse error - nested deeper than {MAX_JSON_DEPTH} levels")
            items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
            stack.extend((item, depth + 1) for item in items)


class BoundedJSONParser(BaseParser):
    """``application/json`` bodies up to ``DATA_UPLOAD_MAX_MEMORY_SIZE`` bytes, else a JSON 413.

    Not a ``JSONParser`` subclass on purpose: DRF hands those ``request.body``, whose size
    check raises Django's ``RequestDataTooBig`` outside DRF's error handling (an HTML 400).
    This one gets the stream and reads at most one byte past the limit, so an oversize
    body is refused before it is held in memory, and before anything is written.
    """

    media_type = "application/json"
    renderer_class = JSONRenderer

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None) -> Any:
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        request = (parser_context or {}).get("request")
        meta = getattr(request, "META", {})
        try:
            declared = int(meta.get("CONTENT_LENGTH") or 0)
        except ValueError:
            declared = 0
        if limit is not None and declared > limit:
            raise PayloadTooLarge(f"The request body is {declared} bytes; the limit is {limit}.")
        raw = stream.read(limit + 1) if limit is not None else stream.read()
        if limit is not None and len(raw) > limit:
            raise PayloadTooLarge(f"The request body is over the limit of {limit} bytes.")
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        values = afk_settings.whole_number("API_MAX_JSON_VALUES")
        try:
            # Any codec Python has was taken: punycode's decoding is quadratic (640 KB: 5.6 s).
            if codecs.lookup(encoding).name not in CHARSETS:
                raise ValueError(f"the body's charset is {encoding!r}; JSON is UTF-8 (or UTF-16, UTF-32)")
            text = raw.decode(encoding)
            _check_containers(text, values)
            data = json.loads(text, parse_constant=strict_constant)
        except (ValueError, RecursionError, LookupError) as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        _check_structure(data, values)
        return data
