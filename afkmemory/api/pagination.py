"""Pagination with hard caps: strict query parameters, limit/offset pages and exact keyset cursors."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable
from typing import Any, ClassVar

from django.conf import settings
from django.utils.crypto import constant_time_compare, salted_hmac
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import BasePagination, LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.utils.urls import replace_query_param

from .fields import MAX_INT, max_page_size

DEFAULT_PAGE_SIZE = 100
_HALF = 2**32 - 1
# The event cursor's row-id permutation and its signature are keyed apart: a signature under the
# permutation's salt would have given away a round of it for some positions.
_MASK_SALT = "afkmemory.api.pagination.EventCursorPagination"


def _secrets() -> list[str | bytes]:
    """The keys a cursor may be signed with: ``SECRET_KEY`` (new cursors), then its fallbacks.

    As Django's own signing does, so rotating the key with the old one in
    ``SECRET_KEY_FALLBACKS`` lets a walk under way go on.
    """
    return [settings.SECRET_KEY, *settings.SECRET_KEY_FALLBACKS]


def _signature(salt: str, request: Request, scope: list[Any], payload: str, secret: str | bytes | None) -> str:
    """The tag of a cursor's ``payload`` for one list: this account and ``scope`` (what else the page depends on)."""
    message = json.dumps([str(getattr(request.user, "pk", None)), *scope, payload])  # a UUID pk too
    return salted_hmac(salt, message, secret=secret, algorithm="sha256").hexdigest()[:32]


def _round(number: int, half: int, secret: str | bytes | None = None) -> int:
    digest = salted_hmac(_MASK_SALT, f"{number}.{half}", secret=secret, algorithm="sha256").digest()
    return int.from_bytes(digest[:4], "big")


def _masked(pk: int, *, unmask: bool = False, secret: str | bytes | None = None) -> int:
    """``pk`` through a keyed permutation of 64-bit numbers (or back, with ``unmask``).

    Four Feistel rounds with HMAC-SHA256 under ``secret`` (``SECRET_KEY`` by default, a
    fallback for a cursor made before a rotation): every account's events share
    the row ids, and the gap between two ids in a caller's cursors told how many events all
    accounts had appended in between.
    """
    left, right = pk >> 32, pk & _HALF
    for number in reversed(range(4)) if unmask else range(4):
        if unmask:
            left, right = right ^ _round(number, left, secret), left
        else:
            left, right = right, left ^ _round(number, right, secret)
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


def keyset_page(
    queryset: Any, request: Request, size_param: str, decode: Callable[[], Any], position: Callable[[Any], Any]
) -> tuple[list[Any], Any]:
    """Return a cursor page (``size_param`` rows, read after the position ``decode()`` gives,
    if any) and the ``position`` of its last row, or None when no row follows it.

    ``queryset`` is in the cursor's order and has ``after(*position)``; one row more than
    the page is read to tell whether another page follows.
    """
    size = query_int(request, size_param, default=default_page_size(), minimum=1, maximum=max_page_size())
    after = decode()
    if after is not None:
        queryset = queryset.after(*after)
    rows = list(queryset[: size + 1])
    return rows[:size], position(rows[size - 1]) if len(rows) > size else None


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
    row id goes masked (``_masked``) and the cursor signed with the account, the thread
    and ``since_ms``: it tells nothing of other accounts' events,
    and one that was altered, taken to another thread, account or ``since_ms``, or made
    under a key that is neither ``SECRET_KEY`` nor in ``SECRET_KEY_FALLBACKS``, is a 400
    rather than a page from somewhere else.
    """

    cursor_query_param = "cursor"
    page_size_query_param = "page_size"
    salt = f"{_MASK_SALT}.signature"

    def paginate_queryset(self, queryset: Any, request: Request, view: Any = None) -> list[Any]:
        self.request, self.thread_id = request, view.kwargs["thread_id"] if view is not None else None
        rows, self.next_position = keyset_page(
            queryset,
            request,
            self.page_size_query_param,
            lambda: self.decode_cursor(request),
            lambda row: (row.timestamp, row.pk),
        )
        return rows

    def decode_cursor(self, request: Request) -> tuple[int, int] | None:
        raw = request.query_params.get(self.cursor_query_param)
        if raw is None:
            return None
        try:
            text = base64.urlsafe_b64decode(raw.encode("ascii") + b"=" * (-len(raw) % 4)).decode("ascii")
            signed, tag = text.rsplit(".", 1)
            # Ours, under SECRET_KEY or a fallback, whose permutation then masked the row id.
            secret = next(key for key in _secrets() if constant_time_compare(tag, self.tag(signed, key)))
            timestamp, masked = signed.split(".")
            return int(timestamp), _masked(int(masked), unmask=True, secret=secret)
        except (StopIteration, ValueError, UnicodeError, binascii.Error):
            problem = (
                "invalid cursor: it was altered, or comes from another query (another thread, account or since_ms) "
                "or from before a key change; follow the next link of the previous page, or start again without it"
            )
            raise ValidationError({self.cursor_query_param: [problem]}) from None

    def tag(self, position: str, secret: str | bytes | None = None) -> str:
        """Return the signature of ``position`` for this thread, this account and this request's ``since_ms``.

        ``since_ms`` as the number it names ("05" is 5), and no other parameter: a client's
        cache-busting parameter does not void its cursor.
        """
        scope = [str(self.thread_id), query_int(self.request, "since_ms")]
        return _signature(self.salt, self.request, scope, position, secret)

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


class OffsetOrKeysetPage(LimitOffsetPage):
    """Limit/offset pages ``{count, next, previous, results}`` by default; keyset pages with ``?page_size=``.

    ``?page_size=`` (or the ``?cursor=`` of a ``next`` link) asks for cursor pages
    ``{next, results}``: no count, and each page reads at most ``page_size + 1`` rows from
    its cursor on through the list's index, so a page deep in a big account costs what the
    first does (an offset reads and skips every row before it). The modes do not mix: a
    ``limit`` or ``offset`` beside them is a 400.

    A subclass names the list's order, unique, as ``keys`` (field name: type); the view's
    queryset is in that order and its ``after(*position)`` returns the rows after a position.
    The cursor carries the last row's keys, which are the caller's own (unlike an event's
    row id, shared by every account), signed with ``SECRET_KEY`` together with the account
    and the request's other query parameters: an altered cursor, or one taken to another
    account, to other filters, or made under a key no longer in ``SECRET_KEY_FALLBACKS``,
    is a 400 rather than a page from somewhere else.
    """

    cursor_query_param = "cursor"
    page_size_query_param = "page_size"
    keys: ClassVar[dict[str, type]] = {}

    def paginate_queryset(self, queryset: Any, request: Request, view: Any = None) -> list[Any] | None:
        self.page_request, self.keyset = request, self.wants_keyset(request)
        if not self.keyset:
            return super().paginate_queryset(queryset, request, view)
        rows, self.next_position = keyset_page(
            queryset,
            request,
            self.page_size_query_param,
            lambda: self.decode_cursor(request),
            lambda row: [getattr(row, key) for key in self.keys],
        )
        return rows

    def wants_keyset(self, request: Request) -> bool:
        """Whether the request asks for cursor pages; a 400 if it mixes them with limit/offset pages."""
        keyset = [
            name for name in (self.page_size_query_param, self.cursor_query_param) if name in request.query_params
        ]
        offset = [name for name in (self.limit_query_param, self.offset_query_param) if name in request.query_params]
        if keyset and offset:
            problem = (
                f"{keyset[0]} pages by cursor, {offset[0]} by offset: send page_size (and the next link's cursor) "
                "or limit and offset, not both"
            )
            raise ValidationError({keyset[0]: [problem]})
        return bool(keyset)

    def signed(self, payload: str, secret: str | bytes | None = None) -> str:
        """Return the tag of ``payload`` for this list, this account and this request's other query parameters."""
        params = self.page_request.query_params
        ignore = (self.cursor_query_param, self.page_size_query_param)
        query = sorted((name, params.getlist(name)) for name in params if name not in ignore)
        return _signature(f"{__name__}.{type(self).__qualname__}", self.page_request, [query], payload, secret)

    def decode_cursor(self, request: Request) -> list[Any] | None:
        raw = request.query_params.get(self.cursor_query_param)
        if raw is None:
            return None
        try:
            encoded, tag = raw.rsplit(".", 1)
            payload = base64.urlsafe_b64decode(encoded.encode("ascii") + b"=" * (-len(encoded) % 4)).decode("ascii")
            if not any(constant_time_compare(tag, self.signed(payload, key)) for key in _secrets()):
                raise ValueError(raw)
            position = json.loads(payload)
            if not isinstance(position, list) or len(position) != len(self.keys):
                raise ValueError(raw)
            # Only a cursor made by an older version could fail this: one made now has the right types.
            if not all(type(value) is kind for value, kind in zip(position, self.keys.values(), strict=True)):
                raise ValueError(raw)
            return position
        except (ValueError, UnicodeError, binascii.Error):
            problem = (
                "invalid cursor: it was altered, or comes from another query (other filters, another account) "
                "or from before a key change; follow the next link of the previous page, or start again without it"
            )
            raise ValidationError({self.cursor_query_param: [problem]}) from None

    def get_next_link(self) -> str | None:
        if not self.keyset:
            return super().get_next_link()
        if self.next_position is None:
            return None
        payload = json.dumps(self.next_position, separators=(",", ":"))
        encoded = base64.urlsafe_b64encode(payload.encode("ascii")).decode("ascii").rstrip("=")
        token = f"{encoded}.{self.signed(payload)}"
        return replace_query_param(self.page_request.build_absolute_uri(), self.cursor_query_param, token)

    def get_paginated_response(self, data: Any) -> Response:
        if not self.keyset:
            return super().get_paginated_response(data)
        return Response({"next": self.get_next_link(), "results": data})

    def get_paginated_response_schema(self, schema: dict[str, Any]) -> dict[str, Any]:
        offset = super().get_paginated_response_schema(schema)
        offset["description"] = "A page by limit and offset (without page_size or cursor)."
        keyset = {
            "type": "object",
            "description": "A page by cursor (with page_size or cursor): no count; next is null on the last page.",
            "required": ["next", "results"],
            "properties": {"next": {"type": "string", "format": "uri", "nullable": True}, "results": schema},
            "additionalProperties": False,
        }
        return {"oneOf": [offset, keyset]}

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        by_offset = " Pages by offset ({count, next, previous, results}; the default, not with page_size or cursor)."
        cursor_only = "Pages by cursor ({next, results}, no count; not with limit or offset)"
        return [
            *(
                {**parameter, "description": parameter["description"] + by_offset}
                for parameter in super().get_schema_operation_parameters(view)
            ),
            {
                "name": self.page_size_query_param,
                "required": False,
                "in": "query",
                "description": f"{cursor_only}: rows a page (default {DEFAULT_PAGE_SIZE}, at most API_MAX_PAGE_SIZE).",
                "schema": {"type": "integer", "minimum": 1},
            },
            {
                "name": self.cursor_query_param,
                "required": False,
                "in": "query",
                "description": f"{cursor_only}: where to continue; take it from the previous page's next link.",
                "schema": {"type": "string"},
            },
        ]


class MemoryPage(OffsetOrKeysetPage):
    """Memories newest first: ``(-updated_at, memory_id)``."""

    keys = {"updated_at": int, "memory_id": str}


class ThreadPage(OffsetOrKeysetPage):
    """Threads by id."""

    keys = {"thread_id": str}
