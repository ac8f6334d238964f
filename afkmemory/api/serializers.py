"""Request and response shapes of the REST API; every field is listed, and ownership is never one of them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db import transaction
from drf_spectacular.utils import extend_schema_serializer
from rest_framework import serializers

from .. import models
from ..memory.text import MAX_QUERY_TERMS
from ..memory.types import (
    LongTermMemory,
    MemoryEvent,
    RetentionPolicy,
    check_path_id,
    new_id,
    now_ms,
)
from .fields import (
    CountField,
    EmbeddingField,
    EventTypeField,
    IdField,
    JSONObjectField,
    JSONValueField,
    LimitField,
    MemoryIdField,
    NamespaceField,
    RunIdField,
    ScoreField,
    StoreKeyField,
    StrictBooleanField,
    TagsField,
    TextField,
    TTLField,
)

#: Longest text query ``memories/search/`` takes, in characters.
MAX_QUERY_CHARS = 4096

_POLICY = RetentionPolicy()


class StrictMixin:
    """Refuse unknown fields: a misspelt option must not silently fall back to its default.

    Read-only fields (``created_at``...) are ignored, so an object read from the API can be sent back.
    """

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, Mapping):
            unknown = sorted(str(name) for name in data if name not in self.fields)  # type: ignore[attr-defined]
            if unknown:
                known = ", ".join(name for name, field in self.fields.items() if not field.read_only)  # type: ignore[attr-defined]
                raise serializers.ValidationError(
                    {name: [f"unknown field; the fields are: {known}"] for name in unknown}
                )
        return super().to_internal_value(data)  # type: ignore[misc]


# -- threads ------------------------------------------------------------------------------------


class ThreadSerializer(StrictMixin, serializers.ModelSerializer):
    """A thread of the requesting account; ``thread_id`` is its name in URLs."""

    thread_id = IdField(help_text="The thread's id, unique within your account; no '/' (it is part of URLs).")
    metadata = JSONObjectField(required=False, help_text="Free-form JSON object about the thread.")

    class Meta:
        model = models.Thread
        fields = ["thread_id", "metadata", "created_at", "updated_at"]
        read_only_fields = ["created_at", "updated_at"]

    def validate_thread_id(self, value: str) -> str:
        if self.instance is not None:
            if value != self.instance.thread_id:
                raise serializers.ValidationError("a thread cannot be renamed; leave thread_id out of the PATCH")
            return value
        try:
            return check_path_id(value, "thread_id")
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from None

    def create(self, validated_data: dict[str, Any]) -> models.Thread:
        using = self.context["using"]
        # A savepoint, so a lost race (an IntegrityError: the view answers 409) leaves the
        # surrounding transaction usable.
        with transaction.atomic(using=using):
            return models.Thread.objects.db_manager(using).create(**validated_data)


# -- events -------------------------------------------------------------------------------------


class EventSerializer(StrictMixin, serializers.Serializer):
    """One event; ``thread_id`` comes from the URL."""

    id = IdField(default=lambda: new_id("evt"), help_text="Unique within the thread; generated when absent.")
    thread_id = serializers.CharField(read_only=True)
    user_id = IdField(allow_null=True, default=None)
    type = EventTypeField()
    timestamp = CountField(default=now_ms, help_text="Milliseconds since the epoch; now when absent.")
    payload = JSONObjectField(default=dict)
    tags = TagsField(default=list)

    @staticmethod
    def to_event(attrs: dict[str, Any], thread_id: str) -> MemoryEvent:
        """Return the validated ``attrs`` as the event they describe in ``thread_id``."""
        return MemoryEvent(
            attrs["id"], thread_id, attrs["user_id"], attrs["type"], attrs["timestamp"], attrs["payload"], attrs["tags"]
        )


class CompactSerializer(StrictMixin, serializers.Serializer):
    """A retention policy (``RetentionPolicy``); absent fields take AFK's defaults."""

    max_events_per_thread = CountField(default=_POLICY.max_events_per_thread)
    keep_event_types = serializers.ListField(child=EventTypeField(), default=lambda: list(_POLICY.keep_event_types))
    scan_limit = CountField(minimum=1, default=_POLICY.scan_limit)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        try:
            attrs["policy"] = RetentionPolicy(**attrs)
        except (TypeError, ValueError) as exc:
            raise serializers.ValidationError(str(exc)) from exc
        return attrs


class CompactionResultSerializer(serializers.Serializer):
    events_before = serializers.IntegerField()
    events_after = serializers.IntegerField()
    events_removed = serializers.IntegerField()


# -- state and checkpoints ----------------------------------------------------------------------


class StateValueSerializer(StrictMixin, serializers.Serializer):
    value = JSONValueField(allow_null=True, help_text="Any JSON value, null included.")


class StateEntrySerializer(serializers.Serializer):
    key = serializers.CharField()
    value = serializers.JSONField(allow_null=True)


@extend_schema_serializer(many=False)  # one object, though its view's action is a list
class StateListSerializer(serializers.Serializer):
    state = serializers.DictField(
        child=serializers.JSONField(allow_null=True),
        help_text="Key to value, sorted by key (code point order): at most `limit` keys, the first after `after`.",
    )
    next = serializers.URLField(
        allow_null=True, help_text="The next page (this query, after this page's last key); null after the last."
    )


class CheckpointWriteSerializer(StrictMixin, serializers.Serializer):
    run_id = RunIdField()
    step = CountField()
    phase = IdField(help_text="e.g. pre_llm, post_tool_batch, step_end.")
    payload = JSONValueField(allow_null=True)


class CheckpointSerializer(serializers.Serializer):
    key = serializers.CharField(help_text="The state key it is stored under.")
    thread_id = serializers.CharField()
    run_id = serializers.CharField()
    step = serializers.IntegerField()
    phase = serializers.CharField()
    timestamp_ms = serializers.IntegerField()
    payload = serializers.JSONField(allow_null=True)


@extend_schema_serializer(many=False)  # one object, though its view's action is a list
class CheckpointListSerializer(serializers.Serializer):
    checkpoints = CheckpointSerializer(many=True)
    next = serializers.URLField(
        allow_null=True, help_text="The next page (this query, after this page's last checkpoint); null after the last."
    )


# -- long-term memories -------------------------------------------------------------------------


class MemorySerializer(StrictMixin, serializers.Serializer):
    """A long-term memory; ``embedding`` is write-only (null or absent: keep the stored one)."""

    id = MemoryIdField(
        default=lambda: new_id("mem"),
        help_text="Unique within your account; generated when absent. "
        "No '/', and not '.', '..' or 'search' (URLs name it).",
    )
    user_id = IdField(allow_null=True, default=None, help_text="The agent's user (a free string), or null.")
    scope = IdField(default="global")
    data = JSONObjectField(default=dict)  # type: ignore[assignment]  # a field, popped by DRF's metaclass
    text = TextField(allow_null=True, default=None)
    tags = TagsField(default=list)
    metadata = JSONObjectField(default=dict)
    created_at = serializers.IntegerField(read_only=True, help_text="Milliseconds since the epoch.")
    updated_at = serializers.IntegerField(read_only=True, help_text="Milliseconds since the epoch.")
    embedding = EmbeddingField(write_only=True, required=False, allow_null=True)

    @staticmethod
    def to_memory(attrs: dict[str, Any], memory_id: str) -> LongTermMemory:
        """Return the validated ``attrs`` as memory ``memory_id``, stamped now."""
        now = now_ms()
        return LongTermMemory(
            memory_id, attrs["user_id"], attrs["scope"], attrs["data"], attrs["text"], attrs["tags"],
            attrs["metadata"], now, now,
        )  # fmt: skip


class MemorySearchSerializer(StrictMixin, serializers.Serializer):
    """A text query, a query embedding, or both (ranked by reciprocal rank fusion)."""

    user_id = IdField(allow_null=True, help_text="Whose memories; null: those without a user.")
    scope = IdField(allow_null=True, default=None, help_text="Only this scope; null or absent: every scope.")
    query = TextField(
        required=False,
        allow_null=True,  # as absent: the schema said it may be null, and null was a 400
        max_length=MAX_QUERY_CHARS,
        help_text=f"Words every match contains: at most {MAX_QUERY_TERMS} distinct ones; past that a 400, "
        "or with an embedding, the embedding ranks alone.",
    )
    embedding = EmbeddingField(required=False, help_text="Rank by cosine similarity to this vector.")
    min_score = ScoreField(required=False, allow_null=True, help_text="Drop vector matches less similar than this.")
    limit = LimitField(default=20)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs.get("query") is None and attrs.get("embedding") is None:
            raise serializers.ValidationError({"query": ["give a query, an embedding, or both"]})
        if attrs.get("min_score") is not None and attrs.get("embedding") is None:
            raise serializers.ValidationError({"min_score": ["min_score needs an embedding to compare with"]})
        return attrs


class MemoriesDeletedSerializer(serializers.Serializer):
    deleted = serializers.IntegerField(min_value=0, help_text="How many memories this request deleted.")


class MemoryHitSerializer(serializers.Serializer):
    memory = MemorySerializer()
    score = serializers.FloatField(help_text="Reciprocal rank fusion score: higher is better.")
    similarity = serializers.FloatField(allow_null=True, help_text="Cosine similarity, when vector search found it.")


class MemorySearchResultSerializer(serializers.Serializer):
    results = MemoryHitSerializer(many=True)


# -- store --------------------------------------------------------------------------------------


class ItemSerializer(serializers.Serializer):
    """An agentflow store item."""

    namespace = serializers.ListField(child=serializers.CharField())
    key = serializers.CharField()
    value = serializers.JSONField(allow_null=True)
    created_at = serializers.CharField(help_text="ISO-8601, UTC.")
    updated_at = serializers.CharField(help_text="ISO-8601, UTC.")
    expires_at = serializers.CharField(allow_null=True, help_text="ISO-8601, UTC; null: never.")


class ItemPutSerializer(StrictMixin, serializers.Serializer):
    namespace = NamespaceField(help_text='Segments, such as ["users", "u1"]; none may be empty.')
    key = StoreKeyField()
    value = JSONValueField(allow_null=True)
    ttl = TTLField(allow_null=True, default=None, help_text="Seconds the item lives; null: forever.")
    if_absent = StrictBooleanField(default=False, help_text="Write only if no live item is there, else 409.")


class ItemSearchSerializer(StrictMixin, serializers.Serializer):
    namespace_prefix = NamespaceField(allow_empty=True, default=tuple, help_text="[] matches every item.")
    limit = LimitField(default=100)
    offset = CountField(default=0)


class ItemListSerializer(serializers.Serializer):
    items = ItemSerializer(many=True)


class NamespaceSearchSerializer(StrictMixin, serializers.Serializer):
    prefix = NamespaceField(allow_empty=True, default=tuple, help_text="[] lists every namespace.")
    limit = LimitField(default=100)
    offset = CountField(default=0)


@extend_schema_serializer(many=False)  # one object, though its view's action is a list
class NamespaceListSerializer(serializers.Serializer):
    namespaces = serializers.ListField(child=serializers.ListField(child=serializers.CharField()))
