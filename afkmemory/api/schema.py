"""The OpenAPI schema: field schemas that depend on settings, and the errors every operation can answer."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiSerializerFieldExtension

from .. import indexes
from ..memory.types import EVENT_TYPES, MAX_ID_BYTES, MAX_KEY_BYTES
from .fields import MAX_INT, NO_NUL, max_page_size, utf8_string

ERROR = {
    "type": "object",
    "description": "What went wrong and how to fix it.",
    "properties": {"detail": {"type": "string"}},
    "required": ["detail"],
}
VALIDATION_ERROR = {
    "type": "object",
    "description": (
        "The request was refused and nothing was written: each key names a field (or `detail` / "
        "`non_field_errors`), each value lists its problems (nested for list items)."
    ),
    "additionalProperties": {},
}

#: Responses every operation may give, beyond those it documents itself.
COMMON = {
    "400": ("Invalid input: the body names each field and its problem.", "ValidationError"),
    "401": ("No or invalid credentials: send `Authorization: Token <key>`.", "Error"),
    "403": ("Not allowed (a session request without its CSRF token).", "Error"),
    "429": ("Too many requests from this account: wait `Retry-After` seconds.", "Error"),
    "503": (
        "The database is busy with another write (SQLite), or cannot answer (down, restarting, a timeout): "
        "retry after `Retry-After` seconds.",
        "Error",
    ),
}
WITH_PATH_PARAMETERS = {"404": ("Not found: no such object in your account.", "Error")}
WITH_BODY = {
    "413": ("The request body is over DATA_UPLOAD_MAX_MEMORY_SIZE.", "Error"),
    "415": ("The body is not `application/json`.", "Error"),
}
METHODS = {"get", "put", "post", "patch", "delete"}
#: Operations whose body may not be left out, which drf-spectacular cannot tell from their
#: request schema (one event or a list of them).
BODY_REQUIRED = {"threads_events_create"}
#: Request bodies of one object or a list of them: the list holds 1 to ``API_MAX_PAGE_SIZE``, as the view checks.
ONE_OR_MANY = {"EventOrEventsRequest"}
#: The query parameters that size a page, at most ``API_MAX_PAGE_SIZE``.
PAGE_SIZES = {"limit", "page_size"}
#: The path's ids (``threads/{thread_id}/``, ``memories/{id}/``), which the router documents by
#: their URL pattern alone: their limit in bytes is the one their body fields have.
PATH_IDS = {"thread_id", "id"}
#: A path id's pattern: one segment of the path, without NUL.
PATH_ID = r"^[^/\x00]+$"
#: A namespace segment: not empty, without NUL, and (the limit is on the encoded namespace) at most a key's length.
SEGMENT = {"type": "string", "minLength": 1, "maxLength": MAX_KEY_BYTES, "pattern": NO_NUL}


class EmbeddingFieldExtension(OpenApiSerializerFieldExtension):
    target_class = "afkmemory.api.fields.EmbeddingField"

    def map_serializer_field(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        dims = indexes.embedding_dimensions()
        return {
            "type": "array",
            "items": {"type": "number"},
            "minItems": dims,
            "maxItems": dims,
            "description": f"{dims} finite numbers, not all zero (AFKMEMORY['EMBEDDING_DIMENSIONS']).",
        }


class CountFieldExtension(OpenApiSerializerFieldExtension):
    target_class = "afkmemory.api.fields.CountField"
    match_subclasses = True

    def map_serializer_field(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        return {"type": "integer", "minimum": self.target.minimum, "maximum": self.target.maximum}


class NamespaceFieldExtension(OpenApiSerializerFieldExtension):
    target_class = "afkmemory.api.fields.NamespaceField"

    def map_serializer_field(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        return {
            "type": "array",
            "items": SEGMENT,
            "minItems": 0 if self.target.allow_empty else 1,
        }


def add_error_responses(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """Document on every operation the errors DRF and the API's guards can answer, and the limits
    the views check themselves: path ids, query integers, lists of events (a postprocessing hook)."""
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas.setdefault("Error", ERROR)
    schemas.setdefault("ValidationError", VALIDATION_ERROR)
    for name, component in schemas.items():
        if name.endswith("Request") and component.get("type") == "object":
            component.setdefault("additionalProperties", False)  # StrictMixin refuses unknown fields
        if name in ONE_OR_MANY:
            for option in component["oneOf"]:
                if option.get("type") == "array":
                    option.update(minItems=1, maxItems=max_page_size())
    for path, operations in result.get("paths", {}).items():
        for method, operation in operations.items():
            if method not in METHODS:
                continue
            for parameter in operation.get("parameters", []):
                if parameter["in"] == "path" and parameter["name"] in PATH_IDS:
                    parameter["schema"] = {**parameter["schema"], **utf8_string(MAX_ID_BYTES, pattern=PATH_ID)}
                # The query's integers are bounded as query_int bounds them (a page by the setting).
                elif parameter["in"] == "query" and parameter["schema"].get("type") == "integer":
                    bound = max_page_size() if parameter["name"] in PAGE_SIZES else MAX_INT
                    parameter["schema"].setdefault("maximum", bound)
            extra = dict(COMMON)
            if "{" in path:
                extra.update(WITH_PATH_PARAMETERS)
            if "requestBody" in operation:
                extra.update(WITH_BODY)
                if operation.get("operationId") in BODY_REQUIRED:
                    operation["requestBody"]["required"] = True
            responses = operation.setdefault("responses", {})
            for code, (description, component) in extra.items():
                responses.setdefault(
                    code,
                    {
                        "description": description,
                        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{component}"}}},
                    },
                )
    return result


#: The event types, as one enum component: an event's ``type`` and a compaction's
#: ``keep_event_types`` share it. A project's own schema names it through its
#: ``SPECTACULAR_SETTINGS["ENUM_NAME_OVERRIDES"]`` (README, "Installing the app").
EVENT_TYPE_ENUM = sorted(EVENT_TYPES)

#: The API's version, in the schema's ``info.version``.
API_VERSION = "1"

SPECTACULAR = {
    "TITLE": "afkmemory API",
    "DESCRIPTION": (
        "Persistent memory for LLM agents: threads and their events, state and checkpoints; "
        "long-term memories with text and vector search; agentflow's namespaced store. "
        "Every request needs `Authorization: Token <key>` (or a browser session); every object "
        "belongs to the account that created it, and another account's objects answer 404."
    ),
    # None: the schema view passes API_VERSION as its own, and drf-spectacular writes a
    # version set in both places as "1 (1)".
    "VERSION": None,
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {"EventTypeEnum": EVENT_TYPE_ENUM},
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "afkmemory.api.schema.add_error_responses",
    ],
}
