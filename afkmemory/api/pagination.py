"""Pagination with hard caps: strict query parameters, limit/offset pages and an exact keyset cursor for events."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import BasePagination, LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.utils.urls import replace_query_param

from .fields import MAX_INT, max_page_size

DEFAULT_PAGE_SIZE = 100
_MAX_DB_INT = 2**63 - 1


def query_int(request: Request, name: str, *, default: Any = None, minimum: int = 0, maximum: int = MAX_INT) -> Any:
    """Return query parameter ``name`` as an int from ``minimum`` to ``maximum``, ``default`` if absent.

    Anything else (a sign, a fraction, words, a number out of range) is a 400 naming the
    parameter: DRF's own paginators silently fall back to their default instead.
    """
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 20) or not minimum <= int(raw) <= maximum:
        raise ValidationError({name: [f"{name} must be a whole number from {minimum} to {maximum}, got {raw!r}"]})
    return int(raw)


def default_page_size() -> int:
    return min(DEFAULT_PAGE_SIZE, max_page_size())


class LimitOffsetPage(LimitOffsetPagination):
    """``?limit=`` (1 to ``API_MAX_PAGE_SIZE``, default 100) and ``?offset=``; refuses what it cannot honour."""

    @property
    def max_limit(self) -> int:  # type: ignore[override]
        return max_page_size()

    @property
    def default_limit(self) -> int:  # type: ignore[override]
        return default_page_size()

    def get_limit(self, request: Request) -> int:
        return query_int(request, self.limit_query_param, default=self.default_limit, minimum=1, maximum=self.max_limit)

    def get_offset(self, request: Request) -> int:
        return query_int(request, self.offset_query_param, default=0)

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        return [
            {
                "name": "limit",
                "required": False,
                "in": "query",
                "description": f"Page size (default {DEFAULT_PAGE_SIZE}, at most AFKMEMORY['API_MAX_PAGE_SIZE']).",
                "schema": {"type": "integer", "minimum": 1},
            },
            {
                "name": "offset",
                "required": False,
                "in": "query",
                "description": "How many results to skip.",
                "schema": {"type": "integer", "minimum": 0, "maximum": MAX_INT},
            },
        ]


class EventCursorPagination(BasePagination):
    """Walk a thread oldest first; the cursor is the last event's ``(timestamp, id)``.

    A keyset, not an offset: exact however many events share a timestamp, and a page
    costs the same deep in a long thread as at its start. Forward only (``next``).
    """

    cursor_query_param = "cursor"
    page_size_query_param = "page_size"

    def paginate_queryset(self, queryset: Any, request: Request, view: Any = None) -> list[Any]:
        self.request = request
        size = query_int(
            request, self.page_size_query_param, default=default_page_size(), minimum=1, maximum=max_page_size()
        )
        after = self.decode_cursor(request)
        if after is not None:
            queryset = queryset.after(*after)
        rows = list(queryset[: size + 1])
        self.next_position = (rows[size - 1].timestamp, rows[size - 1].pk) if len(rows) > size else None
        return rows[:size]

    def decode_cursor(self, request: Request) -> tuple[int, int] | None:
        raw = request.query_params.get(self.cursor_query_param)
        if raw is None:
            return None
        try:
            text = base64.urlsafe_b64decode(raw.encode("ascii") + b"=" * (-len(raw) % 4)).decode("ascii")
            timestamp, pk = text.split(".")
            position = (int(timestamp), int(pk))
            if not all(part.isdigit() for part in (timestamp, pk)) or max(position) > _MAX_DB_INT:
                raise ValueError(text)
        except (ValueError, UnicodeError, binascii.Error):
            raise ValidationError(
                {self.cursor_query_param: ["invalid cursor; follow the next link of the previous page"]}
            ) from None
        return position

    def get_next_link(self) -> str | None:
        if self.next_position is None:
            return None
        token = base64.urlsafe_b64encode("{}.{}".format(*self.next_position).encode("ascii")).decode("ascii")
        return replace_query_param(self.request.build_absolute_uri(), self.cursor_query_param, token.rstrip("="))

    def get_paginated_response(self, data: Any) -> Response:
        return Response({"next": self.get_next_link(), "results": data})

    def get_paginated_response_schema(self, schema: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "object",
            "required": ["next", "results"],
            "properties": {"next": {"type": "string", "format": "uri", "nullable": True}, "results": schema},
        }

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        return [
            {
                "name": self.cursor_query_param,
                "required": False,
                "in": "query",
                "description": "Where to continue: take it from the previous page's next link.",
                "schema": {"type": "string"},
            },
            {
                "name": self.page_size_query_param,
                "required": False,
                "in": "query",
                "description": f"Events per page (default {DEFAULT_PAGE_SIZE}, at most API_MAX_PAGE_SIZE).",
                "schema": {"type": "integer", "minimum": 1},
            },
        ]
