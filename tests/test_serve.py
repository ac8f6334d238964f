"""``make run``'s launcher (``project/serve.py``): the server and the worker stop together."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as listing:
        return [int(child) for child in listing.read().split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is not alive
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def served(tmp_path):
    """Start ``python -m project.serve`` on a fresh SQLite database; yield it and its two children, once it serves."""
    port = _free_port()
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "AFKMEMORY_VAR_DIR": str(tmp_path / "var"),
        "DJANGO_SETTINGS_MODULE": "project.settings",
    }
    env.pop("REDIS_URL", None)
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True, timeout=120)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "project.serve", f"127.0.0.1:{port}"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/login/", timeout=2)
                break
            except OSError:
                assert launcher.poll() is None and time.monotonic() < deadline, launcher.stderr.read().decode()[-2000:]
                time.sleep(0.3)
        children = _children(launcher.pid)
        assert len(children) == 2
        yield launcher, children
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def test_a_sigterm_stops_the_server_and_the_worker(served):
    launcher, children = served
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=60) == 0
    assert not [pid for pid in children if _alive(pid)]


def test_when_the_worker_stops_the_server_is_stopped_and_the_job_fails(served):
    launcher, children = served
    worker = next(pid for pid in children if b"celery" in Path(f"/proc/{pid}/cmdline").read_bytes())
    os.killpg(worker, signal.SIGKILL)  # a worker that died
    assert launcher.wait(timeout=60) != 0
    assert "the Celery worker stopped" in launcher.stderr.read().decode()
    assert not [pid for pid in children if _alive(pid)]


def test_a_closed_terminal_and_a_second_ctrl_c_leave_nothing_running(served):
    """SIGHUP stops the job like SIGTERM; a second signal while it stops does not cut the stopping short."""
    launcher, children = served
    launcher.send_signal(signal.SIGHUP)
    time.sleep(0.2)
    launcher.send_signal(signal.SIGINT)  # while the worker is still shutting down
    launcher.wait(timeout=60)
    assert not [pid for pid in children if _alive(pid)]


@pytest.mark.parametrize(
    ("environment", "loads"),
    [({}, True), ({"DJANGO_DEBUG": "0"}, False), ({"DJANGO_DEBUG": "0", "DJANGO_SECRET_KEY": "k" * 50}, True)],
)
def test_the_development_key_is_only_for_development(tmp_path, environment, loads):
    """With DJANGO_DEBUG=0 and no DJANGO_SECRET_KEY the settings took the key published in the
    repository, with which anyone could forge what Django signs: they refuse to load now."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJANGO_")}
    env.update(AFKMEMORY_VAR_DIR=str(tmp_path), **environment)
    script = "import project.settings as s; print(s.SECRET_KEY)"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode == 0) == loads, done.stderr[-2000:]
    if not loads:
        assert "Set DJANGO_SECRET_KEY when DJANGO_DEBUG=0" in done.stderr
