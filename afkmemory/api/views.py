"""Viewsets of the REST API: each calls the stores and querysets for ``request.user``, its owner.

Tenancy is the stores' ``owner``: every store is built with ``owner=request.user`` and
every queryset starts from ``for_owner(request.user)`` / ``in_thread(request.user, ...)``,
so another account's thread, memory, state key, checkpoint or item is simply not found
(404), on reads, writes, deletes, lists and searches alike. Nothing in a request body
can set an owner. The database is ``AFKMEMORY['DATABASE_ALIAS']``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from agentflow.errors import StoreConflict
from django.db import IntegrityError, connections, transaction
from django.http import HttpRequest, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    PolymorphicProxySerializer,
    extend_schema,
    extend_schema_view,
)
from rest_framework import mixins, status
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer, ListSerializer
from rest_framework.utils.urls import replace_query_param
from rest_framework.viewsets import GenericViewSet

from .. import models
from ..conf import afk_settings
from ..memory.journal import check_run_id
from ..memory.types import (
    MAX_ID_BYTES,
    MAX_KEY_BYTES,
    DuplicateEventError,
    LongTermMemory,
    MemoryEvent,
    check_count,
    check_id,
    check_memory_id,
    check_path_id,
    check_state_key,
)
from ..namespaces import check_key, check_namespace
from ..stores import SyncDjangoMemoryStore, SyncDjangoStore
from ..stores.memory import MEMORY_FIELDS
from . import serializers as s
from .exceptions import Conflict, exception_handler, refusals
from .fields import MAX_INT, RUN_ID_SCHEMA, max_page_size, utf8_string
from .pagination import DEFAULT_PAGE_SIZE, EventCursorPagination, MemoryPage, ThreadPage, default_page_size, query_int
from .parsers import BoundedJSONParser
from .permissions import IsOwner
from .schema import SEGMENT
from .throttling import AccountRateThrottle


def _error(description: str) -> OpenApiResponse:
    return OpenApiResponse(response={"$ref": "#/components/schemas/Error"}, description=description)


def own_transactions(view: Callable[..., Any]) -> Callable[..., Any]:
    """Exempt ``view`` from ``ATOMIC_REQUESTS`` on every database.

    The API's views open the transactions they need (the stores' statements, an append's
    batch, a PATCH's read and write). Inside the request's transaction a SQLite database in
    IMMEDIATE mode took its write lock for every request, reads too, before the API's error
    handler ran, so a busy database was a 500 where it is a read's 200 or a write's 503.
    """
    for alias in connections.settings:
        view = transaction.non_atomic_requests(using=alias)(view)
    return view


class ApiView(GenericViewSet):
    """What every afkmemory view shares: authentication required, JSON bodies, the app's error handling.

    What the API's documented behaviour depends on is set here, not read from the
    project's ``REST_FRAMEWORK`` (which may be DRF's defaults): the parser, permissions,
    throttle and error handler. Authentication stays the project's choice
    (``DEFAULT_AUTHENTICATION_CLASSES``), and the schema needs drf-spectacular's
    ``DEFAULT_SCHEMA_CLASS`` (system check ``afkmemory.W004``; README, "Installing the app").
    """

    permission_classes = [IsAuthenticated, IsOwner]
    parser_classes = [BoundedJSONParser]
    throttle_classes = [AccountRateThrottle]
    # OPTIONS answers 405, and the Allow header leaves it out: the OpenAPI schema describes every endpoint.
    http_method_names = [method for method in GenericViewSet.http_method_names if method != "options"]

    @classmethod
    def as_view(cls, actions: Any = None, **initkwargs: Any) -> Any:
        return own_transactions(super().as_view(actions, **initkwargs))

    def get_exception_handler(self) -> Any:
        return exception_handler

    @property
    def using(self) -> str:
        return afk_settings.DATABASE_ALIAS

    @property
    def owner(self) -> Any:
        """The requesting account (IsAuthenticated has run: never anonymous here)."""
        return self.request.user

    def memory_store(self) -> SyncDjangoMemoryStore:
        return SyncDjangoMemoryStore(owner=self.owner, using=self.using)

    def item_store(self) -> SyncDjangoStore:
        return SyncDjangoStore(owner=self.owner, using=self.using)

    def get_serializer_context(self) -> dict[str, Any]:
        return {**super().get_serializer_context(), "using": self.using}

    def validated(self, serializer_class: type[BaseSerializer], **kwargs: Any) -> BaseSerializer:
        """Return a ``serializer_class`` holding the valid request body (a 400 naming the fields otherwise)."""
        serializer = serializer_class(data=self.request.data, context=self.get_serializer_context(), **kwargs)
        serializer.is_valid(raise_exception=True)
        return serializer

    def valid(self, serializer_class: type[BaseSerializer], **kwargs: Any) -> Any:
        """Return the request body validated by ``serializer_class`` (a 400 naming the fields otherwise)."""
        return self.validated(serializer_class, **kwargs).validated_data

    def check_body_matches(self, field: str, value: str, *, many: bool = False) -> None:
        """Refuse a body (each item of a list, if ``many``) whose ``field`` differs from the URL's ``value``.

        The view takes the URL's, so the body's would be silently ignored.
        """
        for index, body in enumerate(self.request.data if many else [self.request.data]):
            if isinstance(body, dict) and field in body and body[field] != value:
                problem = {field: [f"the body's {field} differs from the URL's {value!r}; leave it out"]}
                raise ValidationError({str(index): problem} if many else problem)

    def path_id(self, name: str, check: Callable[[Any, str], str] = check_id) -> str:
        """Return URL parameter ``name`` if ``check`` passes it (an identifier, by default), else answer 400."""
        with refusals(name):
            return check(self.kwargs[name], name)


class ThreadScoped(ApiView):
    """Views under ``threads/{thread_id}/``: the thread must be the requesting account's."""

    @property
    def thread_id(self) -> str:
        # As POST threads/ checks it: a write under threads/./ would make a thread no client can name.
        return self.path_id("thread_id", check_path_id)

    def threads(self) -> Any:
        return models.Thread.objects.using(self.using).for_owner(self.owner)

    def get_thread(self) -> models.Thread:
        thread = self.threads().named(self.thread_id).first()
        if thread is None:
            raise NotFound(f"You have no thread {self.thread_id!r}.")
        self.check_object_permissions(self.request, thread)
        return thread


# -- threads ------------------------------------------------------------------------------------


@extend_schema(tags=["threads"])
@extend_schema_view(
    create=extend_schema(responses={201: s.ThreadSerializer, 409: _error("You have a thread of that id already.")})
)
class ThreadViewSet(
    mixins.ListModelMixin,
    mixins.CreateModelMixin,
    mixins.RetrieveModelMixin,
    mixins.UpdateModelMixin,
    mixins.DestroyModelMixin,
    ThreadScoped,
):
    """Your threads. Deleting one deletes its events, state and checkpoints."""

    serializer_class = s.ThreadSerializer
    pagination_class = ThreadPage
    lookup_field = "thread_id"
    lookup_value_regex = "[^/]+"
    http_method_names = ["get", "post", "patch", "delete", "head"]

    def get_queryset(self) -> Any:
        return self.threads().order_by("thread_id")

    def get_object(self) -> models.Thread:
        return self.get_thread()

    def perform_create(self, serializer: BaseSerializer) -> None:
        try:
            serializer.save(owner=self.owner)  # the owner is the caller, never the body
        except IntegrityError:  # a 409, as a duplicate event or a lost store claim is
            thread_id = serializer.validated_data["thread_id"]
            raise Conflict(f"You already have a thread {thread_id!r}; PATCH it instead.") from None

    def perform_update(self, serializer: BaseSerializer) -> None:
        # An UPDATE alone, not Model.save(): when a DELETE took the thread since the read,
        # save()'s UPDATE finds no row and it INSERTs one, bringing the deleted thread back.
        thread = cast(models.Thread, serializer.instance)
        metadata = serializer.validated_data.get("metadata", thread.metadata)
        now = timezone.now()
        if not self.threads().filter(pk=thread.pk).update(metadata=metadata, updated_at=now):
            raise NotFound(f"You have no thread {thread.thread_id!r}.")
        thread.metadata, thread.updated_at = metadata, now

    @extend_schema(request=s.CompactSerializer, responses=s.CompactionResultSerializer)
    @action(detail=True, methods=["post"])
    def compact(self, request: Request, thread_id: str) -> Response:
        """Apply a retention policy to the thread's events; return the counts.

        Only the events the policy drops are deleted, so events appended meanwhile survive.
        """
        thread = self.get_thread()
        policy = self.valid(s.CompactSerializer)["policy"]
        with refusals():
            result = self.memory_store().compact_thread(thread.thread_id, policy)
        return Response(s.CompactionResultSerializer(result).data)


# -- events -------------------------------------------------------------------------------------

EVENT_OR_EVENTS = PolymorphicProxySerializer(
    component_name="EventOrEvents",
    serializers=[s.EventSerializer, s.EventSerializer(many=True)],
    resource_type_field_name=None,
    many=False,
)


@extend_schema(tags=["threads"])
class EventViewSet(ThreadScoped):
    """A thread's events, oldest first."""

    serializer_class = s.EventSerializer
    pagination_class = EventCursorPagination

    def get_queryset(self) -> Any:
        fields = ("id", "event_id", "user_id", "type", "timestamp", "payload", "tags")
        return models.Event.objects.using(self.using).in_thread(self.owner, self.thread_id).oldest_first().only(*fields)

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "limit",
                {"type": "integer", "minimum": 0},
                description="Return the newest `limit` events (oldest first) as one page; with `since_ms`, "
                "the first `limit` events from then. Without it, pages follow `next`.",
            ),
            OpenApiParameter(
                "since_ms", {"type": "integer", "minimum": 0}, description="Only events with timestamp >= since_ms."
            ),
        ],
        responses=s.EventSerializer(many=True),
    )
    def list(self, request: Request, thread_id: str) -> Response:
        since_ms = query_int(request, "since_ms")
        limit = query_int(request, "limit", maximum=max_page_size())
        if limit is not None and "cursor" in request.query_params:
            raise ValidationError({"cursor": ["limit answers one page with no cursor; send one or the other"]})
        thread = self.get_thread()
        if limit is not None:
            store = self.memory_store()
            if since_ms is None:
                events = store.get_recent_events(thread.thread_id, limit)
            else:
                events = store.get_events_since(thread.thread_id, since_ms, limit)
            return Response({"next": None, "results": s.EventSerializer(events, many=True).data})
        queryset = self.get_queryset()
        if since_ms is not None:
            queryset = queryset.since(since_ms)
        rows = self.paginate_queryset(queryset) or []
        events = [
            MemoryEvent(row.event_id, thread.thread_id, row.user_id, row.type, row.timestamp, row.payload, row.tags)
            for row in rows
        ]
        return self.get_paginated_response(s.EventSerializer(events, many=True).data)

    @extend_schema(
        request=EVENT_OR_EVENTS,
        responses={201: EVENT_OR_EVENTS, 409: _error("An event id is already in the thread; nothing was written.")},
    )
    def create(self, request: Request, thread_id: str) -> Response:
        """Append one event, or a list of events atomically (all or none); the thread is created if new."""
        thread_id = self.thread_id
        many = isinstance(request.data, list)
        options = {"many": True, "allow_empty": False, "max_length": max_page_size()} if many else {}
        validated = self.validated(s.EventSerializer, **options)
        self.check_body_matches("thread_id", thread_id, many=many)
        # The serializer that validated the body also renders the answer: each new instance
        # deep-copies its fields (DRF re-runs every field's __init__), which cost more than
        # validating and rendering an event.
        serializer = cast(s.EventSerializer, validated.child if isinstance(validated, ListSerializer) else validated)
        items = validated.validated_data
        events = [s.EventSerializer.to_event(attrs, thread_id) for attrs in (items if many else [items])]
        try:
            self.memory_store().append_events(events)
        except DuplicateEventError as exc:
            raise Conflict(f"{exc}; nothing was appended") from exc
        except ValueError as exc:  # an id given twice in the body
            raise ValidationError({"id": [str(exc)]}) from exc
        data = [serializer.to_representation(event) for event in events]
        return Response(data if many else data[0], status=status.HTTP_201_CREATED)


# -- state and checkpoints ----------------------------------------------------------------------


@extend_schema(tags=["state"])
class StateViewSet(ThreadScoped):
    """A thread's state, including its checkpoint and effect keys."""

    serializer_class = s.StateListSerializer

    def get_queryset(self) -> Any:
        return models.StateEntry.objects.using(self.using).in_thread(self.owner, self.thread_id)

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "prefix", utf8_string(MAX_KEY_BYTES, min_length=0), description="Only keys starting with this."
            ),
            OpenApiParameter(
                "after",
                utf8_string(MAX_KEY_BYTES, min_length=0),
                description="Only keys after this one (any key, there or not); take it from the previous page's "
                "next link.",
            ),
            OpenApiParameter(
                "limit",
                {"type": "integer", "minimum": 1},
                description=f"Keys per page (default {DEFAULT_PAGE_SIZE}, at most API_MAX_PAGE_SIZE).",
            ),
        ],
        responses=s.StateListSerializer,
    )
    def list(self, request: Request, thread_id: str) -> Response:
        """Return a page of the state whose keys start with ``prefix``, sorted by key (AFK's ``list_state``).

        A keyset: ``next`` asks for the keys after the page's last one, so a page costs the
        same deep in a long run's checkpoints as at the start, and a key is never on two pages.
        """
        limit = query_int(request, "limit", default=default_page_size(), minimum=1, maximum=max_page_size())
        prefix = request.query_params.get("prefix") or None
        after = request.query_params.get("after") or None
        for name, value in (("prefix", prefix), ("after", after)):
            if value is not None:
                with refusals(name):
                    check_state_key(value, name)
        thread = self.get_thread()
        state, last = self.memory_store().state_page(thread.thread_id, prefix, after, limit)
        next_link = None if last is None else replace_query_param(request.build_absolute_uri(), "after", last)
        return Response({"state": state, "next": next_link})


STATE_KEY = OpenApiParameter(
    "key",
    utf8_string(MAX_KEY_BYTES),
    OpenApiParameter.PATH,
    description="The key, percent-encoded or not ('/' may stay as is: the key is the rest of the path).",
)


@extend_schema(tags=["state"])
class StateKeyViewSet(ThreadScoped):
    """One state key (``checkpoint:<run>:<step>:<phase>`` and ``effect:...`` keys included)."""

    serializer_class = s.StateValueSerializer

    def get_queryset(self) -> Any:
        return models.StateEntry.objects.using(self.using).in_thread(self.owner, self.thread_id)

    @property
    def key(self) -> str:
        return self.path_id("key", check_state_key)

    @extend_schema(parameters=[STATE_KEY], responses=s.StateEntrySerializer)
    def retrieve(self, request: Request, thread_id: str, key: str) -> Response:
        key = self.key
        # The lookup is scoped to the account's thread, so a hit needs no thread query;
        # only a miss asks whether the thread exists, to say which is missing.
        found, value = self.memory_store().lookup_state(self.thread_id, key)
        if not found:
            thread = self.get_thread()
            raise NotFound(f"Thread {thread.thread_id!r} has no state key {key!r}.")
        return Response({"key": key, "value": value})

    @extend_schema(parameters=[STATE_KEY], request=s.StateValueSerializer, responses=s.StateEntrySerializer)
    def update(self, request: Request, thread_id: str, key: str) -> Response:
        """Set the key (the thread is created if new)."""
        key = self.key
        value = self.valid(s.StateValueSerializer)["value"]
        with refusals("value"):
            self.memory_store().put_state(self.thread_id, key, value)
        return Response({"key": key, "value": value})

    @extend_schema(parameters=[STATE_KEY], responses={204: None})
    def destroy(self, request: Request, thread_id: str, key: str) -> Response:
        key = self.key
        thread = self.get_thread()
        # 204 only for the request whose statement deleted it: of racing deletes, one.
        if not self.memory_store().delete_state(thread.thread_id, key):
            raise NotFound(f"Thread {thread.thread_id!r} has no state key {key!r}.")
        return Response(status=status.HTTP_204_NO_CONTENT)


RUN_ID = OpenApiParameter("run_id", RUN_ID_SCHEMA, required=True, description="The run (no ':').")


@extend_schema(tags=["state"])
class CheckpointViewSet(ThreadScoped):
    """A run's checkpoints: state keys ``checkpoint:<run>:<step>:<phase>`` and ``checkpoint:<run>:latest``."""

    serializer_class = s.CheckpointSerializer

    def get_queryset(self) -> Any:
        return models.Checkpoint.objects.using(self.using).in_thread(self.owner, self.thread_id)

    def run_id(self) -> str:
        raw = self.request.query_params.get("run_id")
        if raw is None:
            raise ValidationError({"run_id": ["give the run as ?run_id=<run>"]})
        with refusals("run_id"):
            return check_run_id(raw)

    @extend_schema(
        parameters=[
            RUN_ID,
            OpenApiParameter(
                "after",
                # A step (a whole number up to MAX_INT), ':' and a phase (an id).
                {"type": "string", "pattern": r"^([0-9]+:[^\x00]+)?$", "maxLength": len(f"{MAX_INT}:") + MAX_ID_BYTES},
                description="Only checkpoints after this `<step>:<phase>`; take it from the previous page's next link.",
            ),
            OpenApiParameter(
                "limit",
                {"type": "integer", "minimum": 1},
                description=f"Checkpoints per page (default {DEFAULT_PAGE_SIZE}, at most API_MAX_PAGE_SIZE).",
            ),
        ],
        responses=s.CheckpointListSerializer,
    )
    def list(self, request: Request, thread_id: str) -> Response:
        """Return a page of the run's checkpoints, by step and then phase.

        A keyset: ``next`` asks for the checkpoints after the page's last one, so a page
        costs the same deep in a long run as at its start.
        """
        run_id = self.run_id()
        limit = query_int(request, "limit", default=default_page_size(), minimum=1, maximum=max_page_size())
        after = self.after()
        thread = self.get_thread()
        records, last = self.memory_store().checkpoint_page(thread.thread_id, run_id, after, limit)
        next_link = None
        if last is not None:
            next_link = replace_query_param(request.build_absolute_uri(), "after", f"{last[0]}:{last[1]}")
        return Response(s.CheckpointListSerializer({"checkpoints": records, "next": next_link}).data)

    def after(self) -> tuple[int, str] | None:
        """The ``after`` cursor, ``<step>:<phase>``, or None."""
        raw = self.request.query_params.get("after")
        if not raw:
            return None
        step, _, phase = raw.partition(":")
        if not step.isdigit() or not step.isascii() or not phase:
            raise ValidationError({"after": ["give it as <step>:<phase>, from the previous page's next link"]})
        with refusals("after"):
            check_count(int(step), "after step")
            check_id(phase, "after phase")
        return int(step), phase

    @extend_schema(request=s.CheckpointWriteSerializer, responses={201: s.CheckpointSerializer})
    def create(self, request: Request, thread_id: str) -> Response:
        """Write a checkpoint and point the run's latest at it, atomically (the thread is created if new)."""
        thread_id = self.thread_id
        attrs = self.valid(s.CheckpointWriteSerializer)
        with refusals("payload", fields=attrs):
            record = self.memory_store().write_checkpoint(
                thread_id, attrs["run_id"], attrs["step"], attrs["phase"], attrs["payload"]
            )
        return Response(s.CheckpointSerializer(record).data, status=status.HTTP_201_CREATED)

    @extend_schema(parameters=[RUN_ID], responses=s.CheckpointSerializer)
    @action(detail=False, methods=["get"])
    def latest(self, request: Request, thread_id: str) -> Response:
        """Return the run's newest checkpoint (404 if it has none)."""
        run_id = self.run_id()
        thread = self.get_thread()
        record = self.memory_store().latest_checkpoint(thread.thread_id, run_id)
        if record is None:
            raise NotFound(f"Run {run_id!r} of thread {thread.thread_id!r} has no checkpoint.")
        return Response(s.CheckpointSerializer(record).data)


# -- long-term memories -------------------------------------------------------------------------


MEMORY_FILTERS = [
    OpenApiParameter("user_id", utf8_string(MAX_ID_BYTES), description="Only this user's memories."),
    OpenApiParameter("scope", utf8_string(MAX_ID_BYTES), description="Only this scope."),
    OpenApiParameter("tag", utf8_string(MAX_KEY_BYTES), description="Only memories tagged with this."),
]
#: Whose memories ``DELETE memories/`` deletes: one user (or those without one), never all.
FORGET_FILTERS = [
    OpenApiParameter(
        "user_id", utf8_string(MAX_ID_BYTES), description="Delete this user's memories (give it, or without_user=true)."
    ),
    OpenApiParameter(
        "without_user",
        OpenApiTypes.BOOL,
        description="true: delete the memories that have no user_id (instead of giving user_id).",
    ),
    OpenApiParameter("scope", utf8_string(MAX_ID_BYTES), description="Only this scope's memories."),
]
#: The parameters ``DELETE memories/`` takes: any other (a ``tag``, say) is refused, not ignored.
FORGET = ("user_id", "without_user", "scope")
#: What a PATCH may change; the rest of a memory is kept.
MERGED_FIELDS = ("user_id", "scope", "data", "text", "tags", "metadata")
MEMORY_WRITTEN = {
    200: OpenApiResponse(s.MemorySerializer, description="Replaced."),
    201: OpenApiResponse(s.MemorySerializer, description="Created."),
}


@extend_schema(tags=["memories"])
class MemoryViewSet(ApiView):
    """Your long-term memories, newest first; ``user_id`` and ``scope`` are free strings within your account."""

    serializer_class = s.MemorySerializer
    pagination_class = MemoryPage
    lookup_field = "memory_id"
    lookup_url_kwarg = "id"
    lookup_value_regex = "[^/]+"

    def get_queryset(self) -> Any:
        memories = models.LongTermMemory.objects.using(self.using).for_owner(self.owner)
        return memories.newest_first().defer("embedding", "search_text")

    def get_object(self) -> models.LongTermMemory:
        # Not GenericAPIView's get_object_or_404: its 404 names the model ("No LongTermMemory
        # matches the given query."), where the API's others name what the caller asked for.
        memory_id = self.path_id("id")
        memory = self.get_queryset().named(memory_id).first()
        if memory is None:
            raise NotFound(f"You have no memory {memory_id!r}.")
        self.check_object_permissions(self.request, memory)
        return memory

    def stored(self, memory_id: str) -> LongTermMemory:
        row = self.get_queryset().named(memory_id).values_list(*MEMORY_FIELDS).first()
        if row is None:  # deleted by another request in between
            raise NotFound(f"You have no memory {memory_id!r}.")
        return LongTermMemory(*row)

    def filter_param(self, name: str, max_bytes: int = MAX_ID_BYTES) -> str | None:
        value = self.request.query_params.get(name)
        if value is None:
            return None
        with refusals(name):
            return check_id(value, name, max_bytes=max_bytes)

    @extend_schema(parameters=MEMORY_FILTERS)
    def list(self, request: Request) -> Response:
        memories = self.get_queryset()
        user_id = self.filter_param("user_id")
        scope = self.filter_param("scope")
        tag = self.filter_param("tag", MAX_KEY_BYTES)
        if user_id is not None:
            memories = memories.for_user(user_id)
        if scope is not None:
            memories = memories.in_scope(scope)
        if tag is not None:  # a user's memories through the user's index, the account's through the tags'
            memories = memories.with_tag(tag, through_index=user_id is None)
        rows = self.paginate_queryset(memories.values_list(*MEMORY_FIELDS, named=True)) or []
        return self.get_paginated_response(s.MemorySerializer([LongTermMemory(*row) for row in rows], many=True).data)

    def retrieve(self, request: Request, id: str) -> Response:
        return Response(s.MemorySerializer(self.get_object().as_record()).data)

    def upsert(self, memory: LongTermMemory, embedding: Any) -> Response:
        # The write and its read-back in one transaction: a failure between them (a restart)
        # answers 503 with nothing written, not a 503 for a memory that was stored.
        with transaction.atomic(using=self.using), refusals(fields=s.MemorySerializer().fields):
            # Whether this request made it, as the upsert's own statement decided (two racing creates: one 201).
            created = self.memory_store().save_long_term_memory(memory, embedding=embedding)
            stored = self.stored(memory.id)
        code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
        return Response(s.MemorySerializer(stored).data, status=code)

    @extend_schema(responses=MEMORY_WRITTEN)
    def create(self, request: Request) -> Response:
        """Create or replace (by ``id``) a memory; the first ``created_at`` is kept."""
        attrs = self.valid(s.MemorySerializer)
        return self.upsert(s.MemorySerializer.to_memory(attrs, attrs["id"]), attrs.get("embedding"))

    @extend_schema(responses=MEMORY_WRITTEN)
    def update(self, request: Request, id: str) -> Response:
        """Create or replace the memory; fields left out take their defaults, the embedding is kept."""
        memory_id = self.path_id("id", check_memory_id)
        self.check_body_matches("id", memory_id)
        attrs = self.valid(s.MemorySerializer)
        return self.upsert(s.MemorySerializer.to_memory(attrs, memory_id), attrs.get("embedding"))

    @extend_schema(responses={200: s.MemorySerializer})
    def partial_update(self, request: Request, id: str) -> Response:
        """Change only the fields given."""
        memory_id = self.path_id("id")
        self.check_body_matches("id", memory_id)
        attrs = self.valid(s.MemorySerializer, partial=True)
        # Read, merge and write under the row's lock, so two PATCHes of different fields both land.
        with transaction.atomic(using=self.using):
            row = self.get_queryset().select_for_update().named(memory_id).first()
            if row is None:
                raise NotFound(f"You have no memory {memory_id!r}.")
            self.check_object_permissions(request, row)
            current = row.as_record()
            merged = {field: attrs.get(field, getattr(current, field)) for field in MERGED_FIELDS}
            response = self.upsert(s.MemorySerializer.to_memory(merged, memory_id), attrs.get("embedding"))
        response.status_code = status.HTTP_200_OK
        return response

    @extend_schema(responses={204: None})
    def destroy(self, request: Request, id: str) -> Response:
        memory = self.get_object()
        # By its row, whatever a PATCH changed since the read; 204 only for the request that deleted it.
        if not self.get_queryset().filter(pk=memory.pk).delete()[0]:
            raise NotFound(f"You have no memory {memory.memory_id!r}.")
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(
        operation_id="memories_forget", parameters=FORGET_FILTERS, responses={200: s.MemoriesDeletedSerializer}
    )
    def forget(self, request: Request) -> Response:
        """Delete every memory of one user (only one scope's, with ``scope``): "forget this user".

        In batches, each committed on its own (``delete_long_term_memories``): a request cut
        short has deleted some, and sending it again finishes the job.
        """
        params = request.query_params
        problems = {name: ["not a parameter of this delete: leave it out"] for name in params if name not in FORGET}
        problems.update({name: ["give it once"] for name in FORGET if len(params.getlist(name)) > 1})
        if problems:
            raise ValidationError(problems)
        without_user = params.get("without_user", "false")
        if without_user not in ("true", "false"):
            raise ValidationError({"without_user": ["give true or false"]})
        user_id = self.filter_param("user_id")
        if (user_id is None) == (without_user == "false"):
            which = "neither was given" if user_id is None else "not both"
            problem = f"give user_id (whose memories to delete) or without_user=true (those without one): {which}"
            raise ValidationError({"user_id": [problem]})
        with refusals(fields=FORGET):
            deleted = self.memory_store().delete_long_term_memories(user_id, scope=self.filter_param("scope"))
        return Response(s.MemoriesDeletedSerializer({"deleted": deleted}).data)

    @extend_schema(request=s.MemorySearchSerializer, responses=s.MemorySearchResultSerializer)
    @action(detail=False, methods=["post"])
    def search(self, request: Request) -> Response:
        """Search by text, by embedding, or both fused by reciprocal rank fusion (k = 60)."""
        attrs = self.valid(s.MemorySearchSerializer)
        with refusals(fields=attrs):
            hits = self.memory_store().search_long_term_memory_fused(
                attrs["user_id"],
                query=attrs.get("query"),
                query_embedding=attrs.get("embedding"),
                scope=attrs["scope"],
                limit=attrs["limit"],
                min_score=attrs.get("min_score"),
            )
        results = [{"memory": memory, "score": score, "similarity": similarity} for memory, score, similarity in hits]
        return Response(s.MemorySearchResultSerializer({"results": results}).data)


# -- store --------------------------------------------------------------------------------------

ITEM_ADDRESS = [
    OpenApiParameter(
        "namespace",
        {"type": "array", "items": SEGMENT, "minItems": 1},
        required=True,
        explode=True,
        style="form",
        description="One segment per repetition: ?namespace=users&namespace=u1 is ('users', 'u1').",
    ),
    OpenApiParameter("key", utf8_string(MAX_KEY_BYTES, min_length=0), required=True, description="The item's key."),
]


@extend_schema(tags=["store"])
class StoreItemViewSet(ApiView):
    """Items of agentflow's store under your account: ``(namespace, key) -> value``, with TTLs and claims."""

    serializer_class = s.ItemSerializer

    def get_queryset(self) -> Any:
        return models.StoreItem.objects.using(self.using).for_owner(self.owner).live()

    def address(self) -> tuple[tuple[str, ...], str]:
        segments = self.request.query_params.getlist("namespace")
        key = self.request.query_params.get("key")
        errors = {}
        if not segments:
            errors["namespace"] = ["give the namespace as ?namespace=<segment>, repeated once per segment"]
        if key is None:
            errors["key"] = ["give the key as ?key=<key>"]
        if errors:
            raise ValidationError(errors)
        with refusals("namespace", fields=["namespace", "key"]):
            return check_namespace(tuple(segments)), check_key(key)

    @extend_schema(parameters=ITEM_ADDRESS, responses={200: s.ItemSerializer, 404: _error("No live item there.")})
    def retrieve(self, request: Request) -> Response:
        namespace, key = self.address()
        item = self.item_store().get(namespace, key)
        if item is None:
            raise NotFound(f"No live item {key!r} under {list(namespace)!r}.")
        return Response(s.ItemSerializer(item).data)

    @extend_schema(
        request=s.ItemPutSerializer,
        responses={
            200: OpenApiResponse(s.ItemSerializer, description="Replaced a live item."),
            201: OpenApiResponse(s.ItemSerializer, description="Created."),
            409: _error("if_absent was true and a live item is there: the claim is lost, nothing written."),
        },
    )
    def save(self, request: Request) -> Response:
        # Not named put: DRF's dispatch finds a method named for the HTTP verb on any route
        # of the view, and a PUT to store/items/search/ wrote an item.
        attrs = self.valid(s.ItemPutSerializer)
        store, namespace, key = self.item_store(), attrs["namespace"], attrs["key"]
        with refusals("value", fields=attrs):
            try:
                item, created = store.save(
                    namespace, key, attrs["value"], ttl=attrs["ttl"], if_absent=attrs["if_absent"]
                )
            except StoreConflict as exc:
                raise Conflict(
                    f"A live item {key!r} is already under {list(namespace)!r}: the claim is lost; nothing was written."
                ) from exc
        return Response(s.ItemSerializer(item).data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @extend_schema(parameters=ITEM_ADDRESS, responses={204: None, 404: _error("No live item there.")})
    def destroy(self, request: Request) -> Response:
        namespace, key = self.address()
        if not self.item_store().delete(namespace, key):
            raise NotFound(f"No live item {key!r} under {list(namespace)!r}.")
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(request=s.ItemSearchSerializer, responses=s.ItemListSerializer)
    def search(self, request: Request) -> Response:
        """Return live items under ``namespace_prefix``, by namespace then key."""
        attrs = self.valid(s.ItemSearchSerializer)
        with refusals(fields=attrs):
            items = self.item_store().search(attrs["namespace_prefix"], limit=attrs["limit"], offset=attrs["offset"])
        return Response(s.ItemListSerializer({"items": items}).data)


@extend_schema(tags=["store"])
class NamespaceViewSet(ApiView):
    """The namespaces holding your live items."""

    serializer_class = s.NamespaceListSerializer

    def get_queryset(self) -> Any:
        return models.StoreItem.objects.using(self.using).for_owner(self.owner).live()

    @extend_schema(request=s.NamespaceSearchSerializer, responses=s.NamespaceListSerializer)
    def list(self, request: Request) -> Response:
        attrs = self.valid(s.NamespaceSearchSerializer)
        with refusals(fields=attrs):
            namespaces = self.item_store().list_namespaces(
                prefix=attrs["prefix"], limit=attrs["limit"], offset=attrs["offset"]
            )
        return Response(s.NamespaceListSerializer({"namespaces": namespaces}).data)


@own_transactions
@csrf_exempt  # it changes nothing; a token client's mistyped POST gets this 404, not a CSRF page
def not_found(request: HttpRequest, *args: Any, **kwargs: Any) -> JsonResponse:
    """Answer a URL under the API that names no endpoint."""
    hint = " (endpoints end with '/', except state keys)" if not request.path.endswith("/") else ""
    return JsonResponse({"detail": f"No endpoint at {request.path!r}{hint}; see the schema."}, status=404)
