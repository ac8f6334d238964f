"""Pagination with hard caps: strict query parameters, limit/offset pages and an exact keyset cursor for events."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from django.utils.crypto import constant_time_compare, salted_hmac
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import BasePagination, LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.utils.urls import replace_query_param

from .fields import MAX_INT, max_page_size

DEFAULT_PAGE_SIZE = 100
_HALF = 2**32 - 1
_CURSOR_SALT = "afkmemory.api.pagination.EventCursorPagination"


def _round(number: int, half: int) -> int:
    digest = salted_hmac(_CURSOR_SALT, f"{number}.{half}", algorithm="sha256").digest()
    return int.from_bytes(digest[:4], "big")


def _masked(pk: int, *, unmask: bool = False) -> int:
    """``pk`` through a keyed permutation of 64-bit numbers (or back, with ``unmask``).

    Four Feistel rounds with HMAC-SHA256 under ``SECRET_KEY``: every account's events share
    the row ids, and the gap between two ids in a caller's cursors told how many events all
    accounts had appended in between.
    """
    left, right = pk >> 32, pk & _HALF
    for number in reversed(range(4)) if unmask else range(4):
        left, right = (right ^ _round(number, left), left) if unmask else (right, left ^ _round(number, right))
    return left << 32 | right


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
    costs the same deep in a long thread as at its start. Forward only (``next``). The
    row id goes masked (``_masked``) and the cursor signed: it tells nothing of other
    accounts' events, and one that was altered, or made under another ``SECRET_KEY``, is
    a 400 rather than a page from somewhere else.
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
            signed, tag = text.rsplit(".", 1)
            if not constant_time_compare(tag, self.tag(signed)):  # ours, under this SECRET_KEY
                raise ValueError(text)
            timestamp, masked = signed.split(".")
            return int(timestamp), _masked(int(masked), unmask=True)
        except (ValueError, UnicodeError, binascii.Error):
            raise ValidationError(
                {self.cursor_query_param: ["invalid cursor; follow the next link of the previous page"]}
            ) from None

    @staticmethod
    def tag(position: str) -> str:
        return salted_hmac(_CURSOR_SALT, position, algorithm="sha256").hexdigest()[:16]

    def get_next_link(self) -> str | None:
        if self.next_position is None:
            return None
        timestamp, pk = self.next_position
        position = f"{timestamp}.{_masked(pk)}"
        token = base64.urlsafe_b64encode(f"{position}.{self.tag(position)}".encode("ascii")).decode("ascii")
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
