"""Errors of the REST API: the 413 for oversize bodies, store refusals as 400s, and the exception handler."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from django.core.exceptions import SuspiciousOperation
from django.db import DataError, InterfaceError, OperationalError
from rest_framework import status
from rest_framework.exceptions import APIException, ParseError, ValidationError
from rest_framework.response import Response
from rest_framework.settings import api_settings

from ..stores.concurrency import database_busy

logger = logging.getLogger(__name__)


class PayloadTooLarge(APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "The request body is too large."
    default_code = "payload_too_large"


class DatabaseBusy(APIException):
    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_detail = "The database is busy with another write; retry shortly."
    default_code = "database_busy"
    wait = 1  # seconds: DRF's handler sends it as Retry-After


class DatabaseUnavailable(APIException):
    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_detail = "The database cannot answer right now; retry shortly."
    default_code = "database_unavailable"
    wait = 1


class Conflict(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "The request conflicts with what is stored."
    default_code = "conflict"


def field_of(message: str, fields: Iterable[str], default: str | None) -> str:
    """Return the field a store's error message is about: its first word, if that is a field."""
    first = message.split(" ", 1)[0].split(".")[-1].split("[")[0]
    return first if first in set(fields) else (default or api_settings.NON_FIELD_ERRORS_KEY)


@contextmanager
def refusals(default: str | None = None, fields: Iterable[str] = ()) -> Iterator[None]:
    """Turn a store's ``TypeError``/``ValueError`` (bad input, nothing written) into a 400 naming the field."""
    try:
        yield
    except (TypeError, ValueError) as exc:
        message = str(exc)
        raise ValidationError({field_of(message, fields, default): [message]}) from exc


#: PostgreSQL's SQLSTATE classes (and codes) of failures that retrying can get past: connection
#: exceptions, insufficient resources, operator intervention (a restart, statement_timeout),
#: transaction rollback (serialization failure, deadlock), and lock_timeout's lock_not_available.
RETRYABLE_SQLSTATES = ("08", "53", "57", "40", "55P03")
#: SQLite's primary result codes of the same kind: the disk or file, not the query.
RETRYABLE_SQLITE_CODES = frozenset(
    {sqlite3.SQLITE_IOERR, sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_FULL, sqlite3.SQLITE_NOMEM}
)


def database_unavailable(exc: Exception) -> bool:
    """Whether ``exc`` (a Django ``OperationalError``/``InterfaceError``) is the database failing
    to answer, which a retry can get past, rather than a fault of the deployment or the code
    (a missing table or column: SQLite reports those as operational errors too)."""
    cause = exc.__cause__
    if isinstance(cause, sqlite3.Error):
        code = getattr(cause, "sqlite_errorcode", None)
        return code is not None and code & 0xFF in RETRYABLE_SQLITE_CODES
    sqlstate = getattr(cause, "sqlstate", None)
    # No SQLSTATE: the connection failed or broke before the server said anything.
    return sqlstate is None or sqlstate.startswith(RETRYABLE_SQLSTATES)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's handler, plus: a value the database refuses (out of range, bad text) is the client's 400,
    SQLite's write lock held by another connection past the timeout a 503 to retry, and so is
    any other failure of the database to answer (``database_unavailable``: down or restarting,
    a lock or statement timeout, a deadlock, a file it cannot write), logged. Any other
    database error is a fault to fix, not to retry: a 500, as before."""
    if isinstance(exc, SuspiciousOperation):  # too many query parameters, say: Django's own page is HTML
        # Logged where Django logs what it answers itself, for the same alerts; without the
        # request, whose query string the admins' e-mail handler would read (and refuse) again.
        logging.getLogger(f"django.security.{type(exc).__name__}").error(
            str(exc), exc_info=exc, extra={"status_code": 400}
        )
        exc = ParseError(str(exc))
    elif isinstance(exc, DataError):
        exc = ValidationError({api_settings.NON_FIELD_ERRORS_KEY: [f"the database refused a value: {exc}".strip()]})
    elif isinstance(exc, OperationalError) and database_busy(exc):
        exc = DatabaseBusy()
    elif isinstance(exc, OperationalError | InterfaceError) and database_unavailable(exc):
        # One line, not a traceback: an outage fails every request. The detail stays here (it
        # can name the server's address); the client is told to retry.
        request = context.get("request")
        where = f"{request.method} {request.path}" if request is not None else "a request"
        logger.error("%s answered 503: the database failed: %s: %s", where, type(exc).__name__, exc)
        exc = DatabaseUnavailable()
    # Imported here: rest_framework.views reads DEFAULT_PARSER_CLASSES as it loads, and our
    # parser imports this module, so importing this one first (or the parser) was a cycle.
    from rest_framework.views import exception_handler as drf_exception_handler

    return drf_exception_handler(exc, context)
