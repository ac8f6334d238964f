"""The Redis the tests run on: REDIS_URL, or a private redis-server started once per test run."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

#: Child processes inherit the URL of the parent's server through this variable.
URL_VARIABLE = "AFKMEMORY_TEST_REDIS_URL"

_server: subprocess.Popen[bytes] | None = None
_failure: str | None = None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers(url: str) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _stop(process: subprocess.Popen[bytes], directory: str) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    shutil.rmtree(directory, ignore_errors=True)


def _start(binary: str) -> str:
    """Start ``redis-server`` on a free port in a temporary directory; return its URL."""
    global _server
    directory = tempfile.mkdtemp(prefix="afkmemory-redis-")
    log = Path(directory) / "redis.log"
    for _ in range(3):  # the free port may be taken before the server binds it
        port = _free_port()
        command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", directory, "--save", "",
                   "--appendonly", "no", "--logfile", str(log), "--daemonize", "no"]  # fmt: skip
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 15
        while process.poll() is None and time.monotonic() < deadline:
            if _answers(url):
                _server = process
                atexit.register(_stop, process, directory)
                return url
            time.sleep(0.05)
        if process.poll() is None:
            _stop(process, directory)
            break
    tail = log.read_text(errors="replace")[-500:] if log.exists() else "(no log)"
    raise RuntimeError(f"{binary} did not start: {tail}")


def redis_url() -> str | None:
    """Return the URL of a Redis for the tests, or None if none can be had (see ``reason``)."""
    global _failure
    url = os.environ.get("REDIS_URL") or os.environ.get(URL_VARIABLE)
    if url:
        return url
    if _failure is not None:
        return None
    binary = shutil.which("redis-server")
    if binary is None:
        _failure = "REDIS_URL is not set and no redis-server is on PATH"
        return None
    try:
        url = _start(binary)
    except (OSError, RuntimeError) as exc:
        _failure = f"REDIS_URL is not set and {binary} could not be started: {exc}"
        return None
    os.environ[URL_VARIABLE] = url
    return url


def require_redis() -> str:
    """Return a Redis URL, or skip the test saying why there is none."""
    url = redis_url()
    if url is None:
        pytest.skip(f"no Redis could be had: {_failure}")
    return url


def unique_prefix() -> str:
    """Return a key prefix no other test uses."""
    return f"afkmemory-test:{uuid.uuid4().hex}:"


def delete_prefix(url: str, prefix: str) -> None:
    """Delete every key under ``prefix`` (the prefix has no glob characters)."""
    import redis

    with redis.Redis.from_url(url) as client:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        for start in range(0, len(keys), 1000):
            client.unlink(*keys[start : start + 1000])


def redis_memory_store(request: pytest.FixtureRequest, **options: Any) -> Any:
    """Return a RedisMemoryStore under a fresh prefix, whose keys go when the test ends."""
    from afkmemory.memory.redis import RedisMemoryStore

    url = require_redis()
    prefix = unique_prefix()
    request.addfinalizer(lambda: delete_prefix(url, prefix))
    return RedisMemoryStore(url, key_prefix=prefix, **options)
