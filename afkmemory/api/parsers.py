"""The one parser of the REST API: JSON, bounded in size and depth, refused whole when malformed."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser
from rest_framework.renderers import JSONRenderer
from rest_framework.utils.json import strict_constant

from ..memory.types import MAX_JSON_DEPTH
from .exceptions import PayloadTooLarge


def _check_structure(data: Any) -> None:
    """Refuse nesting deeper than ``MAX_JSON_DEPTH`` (as the Python API does) and strings no database can store
    (lone surrogates)."""
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
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
        try:
            data = json.loads(raw.decode(encoding), parse_constant=strict_constant)
        except (ValueError, RecursionError, LookupError) as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        _check_structure(data)
        return data
