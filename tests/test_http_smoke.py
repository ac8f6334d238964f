"""A real server, started as a user would (gunicorn on a migrated database file), driven over plain HTTP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DIMENSIONS = 8

pytestmark = pytest.mark.slow

# Plain HTTP to 127.0.0.1: no proxy from the environment may intercept it.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def call(method: str, url: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
    """Send one JSON request; return the status and the decoded body (None if empty)."""
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Token {token}"
    data = None
    if body is not None:
        data = json.dumps(body).encode("utf-8")
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with OPENER.open(request, timeout=60) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, raw = error.code, error.read()
    return status, json.loads(raw) if raw else None


@pytest.fixture
def server(request: pytest.FixtureRequest, tmp_path: Path):
    """Migrate a fresh SQLite file, issue a token, serve with gunicorn on a free port; stop it after.

    Parametrized indirectly, the parameter is more environment variables.
    """
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'afkmemory.sqlite3'}",
        "AFKMEMORY_VAR_DIR": str(tmp_path / "var"),
        "AFKMEMORY_EMBEDDING_DIMENSIONS": str(DIMENSIONS),
        "DJANGO_DEBUG": "0",
        "DJANGO_SECRET_KEY": "a-key-of-this-deployment-only",
        "DJANGO_ALLOWED_HOSTS": "127.0.0.1",
        "REDIS_URL": "",
        **getattr(request, "param", {}),
    }
    manage = [sys.executable, str(ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "--noinput"], cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    port = free_port()
    log = (tmp_path / "gunicorn.log").open("w")
    gunicorn = [sys.executable, "-m", "gunicorn", "project.wsgi", "--bind", f"127.0.0.1:{port}", "--workers", "2"]
    process = subprocess.Popen(gunicorn, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/api/v1/"
    try:
        # The token is issued while gunicorn starts (each is a Django start-up, seconds on a busy machine).
        issued = subprocess.run(
            [*manage, "afkmemory_issue_token", "agent", "--create-user"],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        token = issued.stdout.strip()
        for _ in range(600):  # until it answers (an unauthenticated request: 401)
            if process.poll() is not None:
                pytest.fail(f"gunicorn exited with {process.returncode}:\n{(tmp_path / 'gunicorn.log').read_text()}")
            try:
                if call("GET", base + "threads/")[0] == 401:
                    break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail("gunicorn never answered")
        yield base, token
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()


def test_an_agent_turn_over_http(server):
    base, token = server

    def api(method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return call(method, base + path, body, token)

    assert call("GET", base + "threads/")[0] == 401
    assert call("GET", base + "threads/", token="wrong")[0] == 401

    # The turn starts: a thread and the user's message.
    assert api("POST", "threads/", {"thread_id": "chat-1", "metadata": {"channel": "web"}})[0] == 201
    status, event = api(
        "POST", "threads/chat-1/events/", {"type": "message", "user_id": "u1", "payload": {"text": "hi"}}
    )
    assert status == 201 and event["id"].startswith("evt_")

    # The agent calls a tool and records the call and its result atomically, then checkpoints.
    tool = [
        {"id": "call-1", "type": "tool_call", "payload": {"name": "weather", "args": {"city": "Oslo"}}},
        {"id": "result-1", "type": "tool_result", "payload": {"call": "call-1", "output": "rain"}},
    ]
    assert api("POST", "threads/chat-1/events/", tool)[0] == 201
    assert api("POST", "threads/chat-1/events/", tool)[0] == 409  # a retried append is a conflict, not a copy
    status, page = api("GET", "threads/chat-1/events/?limit=2")
    assert status == 200 and [e["id"] for e in page["results"]] == ["call-1", "result-1"]

    status, entry = api("PUT", "threads/chat-1/state/plan:step", {"value": {"next": "answer"}})
    assert status == 200 and entry == {"key": "plan:step", "value": {"next": "answer"}}
    checkpoint = {"run_id": "run-1", "step": 1, "phase": "post_tool_batch", "payload": {"pending": []}}
    assert api("POST", "threads/chat-1/checkpoints/", checkpoint)[0] == 201
    status, latest = api("GET", "threads/chat-1/checkpoints/latest/?run_id=run-1")
    assert status == 200 and latest["key"] == "checkpoint:run-1:1:post_tool_batch"
    assert api("GET", "threads/chat-1/state/checkpoint:run-1:latest")[1]["value"]["step"] == 1

    # Long-term memory: upsert two, then one fused text + vector search.
    oslo = [1.0] + [0.0] * (DIMENSIONS - 1)
    assert api("POST", "memories/", {"id": "m1", "user_id": "u1", "text": "lives in Oslo", "embedding": oslo})[0] == 201
    assert api("PUT", "memories/m2/", {"user_id": "u1", "text": "likes rain", "embedding": oslo[::-1]})[0] == 201
    assert api("PUT", "memories/m2/", {"user_id": "u1", "text": "likes rainy days"})[0] == 200
    status, found = api("POST", "memories/search/", {"user_id": "u1", "query": "Oslo", "embedding": oslo})
    assert status == 200 and found["results"][0]["memory"]["id"] == "m1"

    # A single-flight claim in the store: the first wins, the second gets 409.
    claim = {"namespace": ["effects", "run-1"], "key": "call-1", "value": {"state": "running"}, "if_absent": True}
    assert api("PUT", "store/items/", claim)[0] == 201
    assert api("PUT", "store/items/", claim)[0] == 409
    status, item = api("GET", "store/items/?namespace=effects&namespace=run-1&key=call-1")
    assert status == 200 and item["value"] == {"state": "running"}

    status, schema = api("GET", "schema/?format=json")
    assert status == 200 and "/api/v1/store/items/" in schema["paths"]


@pytest.mark.parametrize("server", [{"REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}], indirect=True)
def test_with_redis_down_the_api_serves_unthrottled(server, tmp_path):
    """The throttle counts in django-redis: with Redis down (here a closed port) every authenticated
    request answered 500. The cache fails open now, and logs each failure on a line of its own
    (it logged two tracebacks per request)."""
    base, token = server
    assert call("GET", base + "threads/", token=token)[0] == 200
    log = (tmp_path / "gunicorn.log").read_text()
    assert "Exception ignored: ConnectionInterrupted: Redis ConnectionError" in log and "Traceback" not in log, log
