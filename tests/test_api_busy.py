"""SQLite's write lock held past the timeout by another connection: the API answers a JSON 503."""

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
