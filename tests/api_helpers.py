"""Helpers of the REST API tests: URLs, users, error bodies, the list of endpoints (fixtures: api_fixtures.py)."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode

from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from afkmemory.conf import afk_settings

ALIASES = ["default", "postgres"]
API = "/api/v1/"


def make_user(alias: str, username: str, **extra: Any) -> Any:
    return get_user_model()._default_manager.db_manager(alias).create_user(username, password="pw", **extra)


def client_for(user: Any) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def url(*parts: str, **query: Any) -> str:
    """Return an API URL: each part percent-encoded as one path segment, then ``?query``."""
    path = API + "".join(quote(part, safe="") + "/" for part in parts)
    return path + ("?" + urlencode(query, doseq=True) if query else "")


def state_url(thread_id: str, key: str) -> str:
    """Return the URL of a state key (no trailing slash: the key is the rest of the path)."""
    return url("threads", thread_id, "state") + quote(key, safe="")


def errors(response: Any) -> dict[str, Any]:
    """Return a 400's body, asserting it is a JSON object naming fields."""
    if response.status_code != 400:
        raise AssertionError(f"expected 400, got {response.status_code}: {getattr(response, 'data', response.content)}")
    body = response.json()
    if not isinstance(body, dict) or not body:
        raise AssertionError(f"a 400 body must be an object naming fields, got {body!r}")
    return body


def dimensions() -> int:
    return int(afk_settings.EMBEDDING_DIMENSIONS)


class AccountsRouter:
    """Keep accounts, tokens and sessions in ``AFKMEMORY['DATABASE_ALIAS']``, with the data that points at them.

    How a deployment whose API database is not ``default`` keeps the owner foreign keys
    in one database; the auth tests use it to run token and session logins on both.
    """

    apps = {"auth", "authtoken", "sessions"}

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return afk_settings.DATABASE_ALIAS if model._meta.app_label in self.apps else None

    db_for_write = db_for_read


#: Every endpoint, with a body a write would accept: (method, path, body).
ENDPOINTS = [
    ("get", "threads/", None),
    ("post", "threads/", {"thread_id": "t"}),
    ("get", "threads/t/", None),
    ("patch", "threads/t/", {"metadata": {}}),
    ("delete", "threads/t/", None),
    ("get", "threads/t/events/", None),
    ("post", "threads/t/events/", {"type": "message"}),
    ("post", "threads/t/compact/", {}),
    ("get", "threads/t/state/", None),
    ("get", "threads/t/state/k", None),
    ("put", "threads/t/state/k", {"value": 1}),
    ("delete", "threads/t/state/k", None),
    ("get", "threads/t/checkpoints/?run_id=r", None),
    ("post", "threads/t/checkpoints/", {"run_id": "r", "step": 0, "phase": "p", "payload": None}),
    ("get", "threads/t/checkpoints/latest/?run_id=r", None),
    ("get", "memories/", None),
    ("post", "memories/", {"id": "m"}),
    ("get", "memories/m/", None),
    ("put", "memories/m/", {}),
    ("patch", "memories/m/", {}),
    ("delete", "memories/m/", None),
    ("delete", "memories/?user_id=u", None),
    ("post", "memories/search/", {"user_id": None, "query": "x"}),
    ("put", "store/items/", {"namespace": ["a"], "key": "k", "value": 1}),
    ("get", "store/items/?namespace=a&key=k", None),
    ("delete", "store/items/?namespace=a&key=k", None),
    ("post", "store/items/search/", {}),
    ("post", "store/namespaces/", {}),
    ("get", "schema/", None),
]
