"""The database failing to answer: SQLite's write lock held past the timeout by another connection,
and other failures a retry gets past, answer a JSON 503; a fault to fix (a missing table) a 500."""

from __future__ import annotations

import sqlite3

import pytest
from django.db import connections

from afkmemory import models
from tests.api_helpers import client_for, make_user, url

pytestmark = pytest.mark.django_db(databases=["default"], transaction=True)


def test_a_write_that_waits_out_sqlites_lock_answers_503_with_retry_after(settings):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"afkmemory": None}}
    client = client_for(make_user("default", "alice"))
    client.raise_request_exception = False
    connection = connections["default"]
    options = connection.settings_dict["OPTIONS"]
    timeout = options.get("timeout")
    connection.close()
    options["timeout"] = 0.3  # the example project waits 30 s; the outcome is the same, sooner
    holder = sqlite3.connect(connection.settings_dict["NAME"], isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")  # another process's long write
        response = client.post(url("threads", "t1", "events"), {"type": "message", "payload": {}}, format="json")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
        connection.close()
        options["timeout"] = timeout
    assert response.status_code == 503, (response.status_code, response.content[:200])
    assert response["Content-Type"].startswith("application/json")
    assert response["Retry-After"] == "1"
    assert "busy" in response.json()["detail"]
    assert not models.Event.objects.exists()


def test_a_missing_table_is_a_500_not_retry_shortly(settings):
    """SQLite reports "no such table" as an operational error, like a locked or unwritable
    file; a deployment that was not migrated answered "503, retry shortly" to every request,
    which clients retry forever and alerts on 500s never see."""
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"afkmemory": None}}
    client = client_for(make_user("default", "alice"))
    client.raise_request_exception = False
    assert client.post(url("threads"), {"thread_id": "t"}, format="json").status_code == 201
    with connections["default"].cursor() as cursor:
        cursor.execute("ALTER TABLE afkmemory_checkpoint RENAME TO afkmemory_checkpoint_unmigrated")
    try:
        response = client.get(url("threads", "t", "checkpoints"), {"run_id": "r"})
    finally:
        with connections["default"].cursor() as cursor:
            cursor.execute("ALTER TABLE afkmemory_checkpoint_unmigrated RENAME TO afkmemory_checkpoint")
    assert response.status_code == 500


def test_a_memory_answered_503_was_not_written(settings, monkeypatch):
    """POST memories/ writes the memory, then reads it back: the database failing between the
    two (a restart) answered 503 for a memory that was stored, and the client's retry got
    200 "Replaced" for one its own first request created. Both are now one transaction."""
    from django.db import OperationalError

    from afkmemory.api import views

    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"afkmemory": None}}
    client = client_for(make_user("default", "alice"))
    client.raise_request_exception = False

    def server_gone(self, memory_id):
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(views.MemoryViewSet, "stored", server_gone)
    response = client.post(url("memories"), {"id": "m1", "user_id": "u", "text": "kept"}, format="json")
    assert response.status_code == 503, (response.status_code, response.content[:200])
    assert not models.LongTermMemory.objects.filter(memory_id="m1").exists()
